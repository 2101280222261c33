//! The flags `train-digits` and `train-digits-burn` share ([`CommonArgs`], flattened into each
//! program's own `Args` with `#[command(flatten)]`), and their value parsers beyond
//! `ddprs::launcher::validate`'s: a fraction in [0, 1] and an SGD momentum in [0, 1). Like those, they
//! refuse NaN and ±inf, and clap names the flag and the value in the error (exit status 2).

use clap::ValueEnum;
use ddprs::checkpoint::RunPlan;
use ddprs::launcher::validate::{finite, int_in, positive, MAX_SECS};
use std::path::PathBuf;

/// Widest hidden layer accepted (64 × H + H × 10 weights per replica).
pub const MAX_HIDDEN: u64 = 1 << 16;
/// Largest per-rank batch accepted (the training set has 1437 images).
pub const MAX_BATCH: u64 = 1 << 20;

/// The optimizer (each program's framework's SGD or AdamW).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerKind {
    /// PyTorch's SGD (momentum without dampening), momentum buffers saved in checkpoints.
    Sgd,
    /// AdamW, moments saved in checkpoints.
    Adamw,
}

/// The flags of both programs: the run (workers, epochs, batch, optimizer, model, checkpoints)
/// and how it reports and fails.
#[derive(Debug, Clone, clap::Args)]
pub struct CommonArgs {
    /// Number of local worker processes to spawn (ignored under a launcher, which sets
    /// RANK/WORLD_SIZE).
    #[arg(long, default_value_t = 2, value_parser = int_in::<usize>(1, ddprs::launcher::cli::MAX_LOCAL_WORKERS as u64))]
    pub nproc: usize,
    /// Number of passes over the training set.
    #[arg(long, default_value_t = 30, value_parser = int_in::<u64>(1, u64::MAX))]
    pub epochs: u64,
    /// Batch size per rank (the global batch is this × world size).
    #[arg(long, default_value_t = 32, value_parser = int_in::<usize>(1, MAX_BATCH))]
    pub batch_size: usize,
    /// Optimizer (the framework's SGD or AdamW, both checkpointable).
    #[arg(long, value_enum, default_value_t = OptimizerKind::Sgd)]
    pub optimizer: OptimizerKind,
    /// Learning rate [default: 0.2 for sgd, 0.005 for adamw].
    #[arg(long, value_parser = positive)]
    pub lr: Option<f64>,
    /// SGD momentum (PyTorch's; 0 is plain SGD), 0 up to (not including) 1.
    #[arg(long, default_value_t = 0.0, value_parser = momentum)]
    pub momentum: f64,
    /// Seed of the model initialization and of the sampler's shuffle.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Hidden layer width.
    #[arg(long, default_value_t = 128, value_parser = int_in::<usize>(1, MAX_HIDDEN))]
    pub hidden: usize,
    /// Stop after this many optimizer steps in total (across resumes).
    #[arg(long, value_parser = int_in::<u64>(1, u64::MAX))]
    pub max_steps: Option<u64>,
    /// Directory for checkpoints (written by rank 0 at the end of every epoch and at exit).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Write checkpoints in the background (PyTorch DCP's async_save): rank 0 hands the
    /// snapshot to a writer thread and trains on. At most one write runs: `wait` (the default)
    /// makes the next save wait for it, `skip` skips that save with a warning. A failed write
    /// is a warning (the previous checkpoint stays current); the last one failing is an error.
    /// Plain checkpoints only (ZeRO save sets are written synchronously).
    #[arg(long, num_args = 0..=1, default_missing_value = "wait", requires = "checkpoint_dir",
          value_name = "wait|skip")]
    pub checkpoint_async: Option<ddprs::checkpoint::WhenBusy>,
    /// Timeout of rendezvous and of every collective, in seconds.
    #[arg(long, default_value_t = 300, value_parser = int_in::<u64>(1, MAX_SECS))]
    pub timeout_s: u64,
    /// Print a JSON summary as the last line of output.
    #[arg(long)]
    pub json: bool,
    /// Print progress every this many epochs (0: only the summary).
    #[arg(long, default_value_t = 5)]
    pub log_every: u64,
    /// Communication hook (PyTorch's DDP comm hooks): none (all-reduce), fp16 / bf16
    /// (compressed all-reduce), `powersgd[:RANK[:START_ITER]]` (PowerSGD, default rank 1 from
    /// step 1000), `localsgd[:PERIOD[:WARMUP]]` (post-local SGD, parameters averaged every PERIOD
    /// steps after WARMUP; default 4 and 100), `diloco:H[:OUTER_LR[:MOMENTUM]]` (DiLoCo: H
    /// local steps, then the averaged pseudo-gradient stepped by Nesterov SGD, lr 0.7 and
    /// momentum 0.9 by default), `streaming-diloco:H:F[:TAU]` (F fragments in turn, each
    /// all-reduce overlapping TAU steps, bf16). Hook and DiLoCo state are saved in checkpoints
    /// (DiLoCo's with every rank's own state: resumed at the same world size only).
    #[arg(long, default_value = "none")]
    pub hook: ddprs::hooks::HookSpec,
    /// Stop once rank 0's held-out accuracy, evaluated after every epoch, reaches this
    /// (reports `time_to_target_s`, training time excluding evaluations).
    /// A fraction, 0 to 1.
    #[arg(long, value_parser = fraction)]
    pub target_accuracy: Option<f64>,
    /// Do not stop on NaN or infinite gradients (by default a non-finite averaged gradient stops
    /// the run with an error naming the step, the rank and the parameter).
    #[arg(long)]
    pub no_check_finite: bool,
}

impl CommonArgs {
    /// The learning rate: `--lr`, or the optimizer's default.
    pub fn lr(&self) -> f64 {
        self.lr.unwrap_or(match self.optimizer {
            OptimizerKind::Sgd => 0.2,
            OptimizerKind::Adamw => 0.005,
        })
    }

    /// The optimizer's name, as `--optimizer` spells it (and checkpoints record it).
    pub fn optimizer_name(&self) -> &'static str {
        match self.optimizer {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adamw => "adamw",
        }
    }

    /// The run as checkpoints record it: its length and the hyper-parameters both programs
    /// have (a program adds its own to `hyper`). A checkpoint of other hyper-parameters is
    /// refused on resume (it would not continue "exactly"), as is a position this run could
    /// not have reached.
    pub fn run_plan(&self, world_size: usize, samples_per_epoch: usize) -> RunPlan {
        RunPlan {
            world_size,
            samples_per_epoch,
            batch_size: self.batch_size,
            epochs: self.epochs,
            max_steps: self.max_steps,
            hyper: serde_json::json!({
                "optimizer": self.optimizer_name(),
                "lr": self.lr(),
                "momentum": self.momentum,
                "batch_size": self.batch_size,
                "hidden": self.hidden,
                "seed": self.seed,
                "hook": self.hook.to_string(),
            }),
            rng_state: self.seed,
        }
    }

    /// Whether the progress line is due after `epoch` (counted from 1): every `--log-every`
    /// epochs and after the last one.
    pub fn log_due(&self, epoch: u64) -> bool {
        self.log_every > 0 && (epoch.is_multiple_of(self.log_every) || epoch == self.epochs)
    }

    /// The progress line after `epoch` (counted from 1): the run's `step`, rank 0's mean
    /// training loss over the epoch, the held-out accuracy and the seconds since the start.
    pub fn epoch_line(&self, epoch: u64, step: u64, loss: f64, accuracy: f64, secs: f64) -> String {
        format!(
            "epoch {:>3}/{}  step {:>5}  train_loss(rank0) {:.4}  test_acc {:.4}  {:.1}s",
            epoch, self.epochs, step, loss, accuracy, secs
        )
    }
}

/// A finite number in [0, 1] (`--target-accuracy`: a fraction of the held-out images).
pub fn fraction(s: &str) -> Result<f64, String> {
    let v = finite(s)?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not a fraction: use 0 to 1"))
    }
}

/// A finite number in [0, 1) (`--momentum`: at 1 or above the velocity never decays and SGD
/// diverges).
pub fn momentum(s: &str) -> Result<f64, String> {
    let v = finite(s)?;
    if (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!(
            "{v} is out of range: use 0 (plain SGD) up to, not including, 1"
        ))
    }
}
