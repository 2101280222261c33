//! `train-digits-burn`: `train-digits` written with Burn — the same MLP (`64 → hidden → 10`,
//! ReLU), the same UCI digits data and fixed 80/20 split (the very same `data.rs`), the same flags
//! and the same final `--json` line, trained data-parallel with `ddp-burn` on Burn's pure-Rust CPU
//! backend (`burn-flex`).
//!
//! Run directly, it spawns `--nproc` local workers of itself through `ddprun::spawn`; under
//! `ddprun`, torchrun-style environments, Slurm or `mpirun` (any environment
//! `ddp_comm::env::EnvConfig` recognises) it is one worker (module [`train`]).

#[path = "../../train-digits/src/data.rs"]
mod data;
#[path = "../../train-digits/src/flags.rs"]
mod flags;
mod learner;
mod model;
mod train;

use clap::{Parser, ValueEnum};
use ddprun::output::ConsoleStyle;
use ddprun::spawn::{spawn, SpawnOptions};
use ddprun::validate::{int_in, positive, MAX_SECS};

/// Communication backend (`auto` picks the best available one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Auto,
    Tcp,
    Shm,
}

/// The optimizer (Burn's own, from `burn::optim`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerKind {
    /// `SgdConfig` (PyTorch's momentum: dampening 0), state saved in checkpoints.
    Sgd,
    /// `AdamWConfig`, moments saved in checkpoints.
    Adamw,
}

/// Data-parallel MLP training on the UCI digits with Burn (1797 8×8 images, fixed 80/20 split).
#[derive(Debug, Clone, Parser)]
#[command(name = "train-digits-burn", version, allow_negative_numbers = true)]
pub struct Args {
    /// Number of local worker processes to spawn (ignored under a launcher).
    #[arg(long, default_value_t = 2, value_parser = int_in::<usize>(1, ddprun::cli::MAX_LOCAL_WORKERS as u64))]
    pub nproc: usize,
    /// Communication backend [default: env DDP_BACKEND, else auto].
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// Number of passes over the training set.
    #[arg(long, default_value_t = 30, value_parser = int_in::<u64>(1, u64::MAX))]
    pub epochs: u64,
    /// Batch size per rank (the global batch is this × world size).
    #[arg(long, default_value_t = 32, value_parser = int_in::<usize>(1, 1 << 20))]
    pub batch_size: usize,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Sgd)]
    pub optimizer: OptimizerKind,
    /// Learning rate [default: 0.2 for sgd, 0.005 for adamw].
    #[arg(long, value_parser = positive)]
    pub lr: Option<f64>,
    /// SGD momentum (PyTorch's; 0 is plain SGD), 0 up to (not including) 1.
    #[arg(long, default_value_t = 0.0, value_parser = flags::momentum)]
    pub momentum: f64,
    /// Seed of the model initialization and of the sampler's shuffle.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Hidden layer width.
    #[arg(long, default_value_t = 128, value_parser = int_in::<usize>(1, 1 << 16))]
    pub hidden: usize,
    /// Stop after this many optimizer steps in total (across resumes).
    #[arg(long, value_parser = int_in::<u64>(1, u64::MAX))]
    pub max_steps: Option<u64>,
    /// Directory for checkpoints (written by rank 0 at the end of every epoch and at exit).
    #[arg(long)]
    pub checkpoint_dir: Option<std::path::PathBuf>,
    /// Continue from the checkpoint in --checkpoint-dir (a fresh start if there is none). A
    /// checkpoint of another world size resumes too (the rest of its epoch re-sharded over the
    /// new ranks), and any --zero loads any checkpoint of the plain loop: a plain one or a
    /// sharded set, the newer when both are there. --learner resumes its own checkpoints only.
    #[arg(long, requires = "checkpoint_dir")]
    pub resume: bool,
    /// Timeout of rendezvous and of every collective, in seconds.
    #[arg(long, default_value_t = 300, value_parser = int_in::<u64>(1, MAX_SECS))]
    pub timeout_s: u64,
    /// Print a JSON summary as the last line of output.
    #[arg(long)]
    pub json: bool,
    /// Print progress every this many epochs (0: only the summary).
    #[arg(long, default_value_t = 5)]
    pub log_every: u64,
    /// Do not stop on NaN or infinite gradients.
    #[arg(long)]
    pub no_check_finite: bool,
    /// Communication hook, as in train-digits: none, fp16 / bf16, `powersgd[:RANK[:START_ITER]]`,
    /// `localsgd[:PERIOD[:WARMUP]]`. Hook state is saved in checkpoints.
    #[arg(long, default_value = "none")]
    pub hook: ddp::hooks::HookSpec,
    /// Stop once rank 0's held-out accuracy at the end of an epoch reaches this, as in
    /// train-digits (reports `time_to_target_s`, training time excluding evaluations). A
    /// fraction, 0 to 1.
    #[arg(long, value_parser = flags::fraction)]
    pub target_accuracy: Option<f64>,
    /// ZeRO stage: 0 (DDP), 1 (optimizer state sharded over the ranks), 2 (+ gradients), with
    /// `ddp_burn::ZeroDdp`; its checkpoints are sharded sets (one shard per rank).
    #[arg(long, default_value_t = 0, value_parser = int_in::<u8>(0, 2))]
    pub zero: u8,
    /// Train through Burn's own loop (`burn-train`'s `SupervisedTraining` / `Learner`) with
    /// ddp-rs as its training strategy; with --checkpoint-dir Burn's checkpointer writes there.
    #[arg(long)]
    pub learner: bool,
}

impl Args {
    /// The learning rate: `--lr`, or the optimizer's default.
    pub fn lr(&self) -> f64 {
        self.lr.unwrap_or(match self.optimizer {
            OptimizerKind::Sgd => 0.2,
            OptimizerKind::Adamw => 0.005,
        })
    }

    pub fn optimizer_name(&self) -> &'static str {
        match self.optimizer {
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::Adamw => "adamw",
        }
    }
}

fn main() {
    let args = Args::parse();
    // A worker when a launcher (ddprun/torchrun, Slurm, mpirun) set the environment.
    if ddp_comm::env::EnvConfig::from_env().is_err() {
        std::process::exit(spawn(&SpawnOptions {
            console: ConsoleStyle::Rank0Stdout,
            ..SpawnOptions::new(args.nproc)
        }));
    }
    let result = if args.learner {
        learner::run(&args)
    } else {
        train::run(&args)
    };
    if let Err(e) = result {
        let rank = std::env::var("RANK").unwrap_or_default();
        eprintln!("train-digits-burn rank {rank}: error: {e}");
        std::process::exit(1);
    }
}
