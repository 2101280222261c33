//! The command line (nanoGPT's `shakespeare_char` recipe in its small CPU configuration by
//! default), the model shape and the learning-rate schedule.

use clap::{Parser, ValueEnum};
use std::path::PathBuf;

/// Which framework trains the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Framework {
    Candle,
    Burn,
}

/// A character-level GPT (nanoGPT's) on Shakespeare's plays, data-parallel over N processes.
#[derive(Debug, Clone, Parser)]
#[command(name = "train-gpt", version, allow_negative_numbers = true)]
pub struct Args {
    /// Framework: burn (through ddprs::burn, on Burn's pure-Rust CPU backend) or candle
    /// (through ddprs::candle).
    #[arg(long, value_enum, default_value = "burn")]
    pub framework: Framework,
    /// Worker processes started on this host when not under a launcher (ddprun, torchrun,
    /// Slurm, mpirun: then this process is one worker).
    #[arg(long, default_value_t = 1)]
    pub nproc: usize,
    /// Transformer blocks.
    #[arg(long, default_value_t = 4)]
    pub n_layer: usize,
    /// Attention heads per block.
    #[arg(long, default_value_t = 4)]
    pub n_head: usize,
    /// Embedding width.
    #[arg(long, default_value_t = 128)]
    pub n_embd: usize,
    /// Context length (characters).
    #[arg(long, default_value_t = 64)]
    pub block_size: usize,
    /// Windows per rank and step (nanoGPT's `batch_size`, per process): the global batch is
    /// world size × this.
    #[arg(long, default_value_t = 12)]
    pub batch_size: usize,
    /// Steps of the schedule (warm-up, cosine decay to --min-lr at this step).
    #[arg(long, default_value_t = 2000)]
    pub max_iters: u64,
    /// End after this many steps with a checkpoint in --checkpoint-dir, as an interrupted run
    /// would (the schedule stays --max-iters'); --resume continues it.
    #[arg(long)]
    pub stop_after: Option<u64>,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Learning rate at the end of the cosine decay.
    #[arg(long, default_value_t = 1e-4)]
    pub min_lr: f64,
    /// Steps of linear warm-up.
    #[arg(long, default_value_t = 100)]
    pub warmup_iters: u64,
    /// AdamW's weight decay, on parameters of 2 or more dimensions only.
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// AdamW's beta2.
    #[arg(long, default_value_t = 0.99)]
    pub beta2: f64,
    /// Clip gradients to this global L2 norm (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub grad_clip: f64,
    /// Dropout probability.
    #[arg(long, default_value_t = 0.0)]
    pub dropout: f32,
    /// Biases in Linear and LayerNorm layers (nanoGPT's `bias`; off in its recipe).
    #[arg(long)]
    pub bias: bool,
    /// An untied language-model head (its own weight) instead of the token embedding's.
    #[arg(long)]
    pub untied: bool,
    /// Seed of the initialization, the data order and dropout.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Evaluate the validation loss every this many steps (and at the end).
    #[arg(long, default_value_t = 250)]
    pub eval_interval: u64,
    /// Validation windows of --eval-batch each, evaluated by rank 0.
    #[arg(long, default_value_t = 20)]
    pub eval_iters: usize,
    /// ZeRO stage: 0 DDP; 1 optimizer state sharded; 2 and gradients; 3 and parameters
    /// (candle only, through ddprs::candle::Fsdp, one unit per block; it unties the head,
    /// since a parameter belongs to one unit). Checkpoints of stages 1-3 are save sets that
    /// resume at any world size and stage 1-3.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: u8,
    /// Communication hook (PyTorch's DDP comm hooks): none (all-reduce), fp16 / bf16
    /// (compressed all-reduce), `powersgd[:RANK[:START_ITER]]`, `localsgd[:PERIOD[:WARMUP]]`
    /// (post-local SGD: all-reduce for WARMUP steps, then local steps with the parameters
    /// averaged every PERIOD; 4:100 by default), `diloco:H[:OUTER_LR[:MOMENTUM]]` (DiLoCo: H
    /// local steps, then the averaged pseudo-gradient stepped by Nesterov SGD, lr 0.7 and
    /// momentum 0.9 by default), `streaming-diloco:H:F[:TAU]` (F fragments in turn, each
    /// all-reduce overlapping TAU steps, bf16). Hook and outer-loop state (every rank's own
    /// parameters under localsgd and DiLoCo) are saved in checkpoints.
    #[arg(long, default_value = "none")]
    pub hook: ddprs::hooks::HookSpec,
    /// Save checkpoints here.
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Save a checkpoint every this many steps (0: at the end only).
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: u64,
    /// Write checkpoints in the background (PyTorch DCP's async_save): a save stalls the step
    /// only for a copy of the state (candle) or none (Burn's tensors are immutable), a writer
    /// thread serializes and writes it atomically. At most one write runs: `wait` (the default)
    /// makes the next save wait for it, `skip` skips that save with a warning. A failed write
    /// is a warning and training goes on (the previous checkpoint stays current); the final
    /// one failing is an error. With --zero 1-3 each rank's shard of the save set is written in
    /// the background and the set becomes current at the next save (or at the end), after every
    /// rank's shard landed (`wait` only).
    #[arg(long, num_args = 0..=1, default_missing_value = "wait", requires = "checkpoint_dir",
          value_name = "wait|skip")]
    pub checkpoint_async: Option<ddprs::checkpoint::WhenBusy>,
    /// Continue from the checkpoint in --checkpoint-dir (a fresh start if there is none).
    #[arg(long, requires = "checkpoint_dir")]
    pub resume: bool,

    /// Opt-in in-place recovery: when a rank is lost, the others regroup through the job's
    /// store, drop the failed step, take the most advanced survivor's state and go on at the
    /// smaller world size, the data re-sharded by the windows consumed; processes started with
    /// --join are taken in at step boundaries. Also on with DDP_FAULT_TOLERANCE=1 (set by
    /// `ddprun --fault-tolerance`). Window of the regrouping: DDP_FT_WINDOW_MS (default 1000).
    /// candle, --zero 0, no --hook.
    #[arg(long)]
    pub fault_tolerance: bool,

    /// Timeout of the rendezvous and of every collective, in seconds (torch.distributed's
    /// `timeout`, 1800 by default). Under --fault-tolerance it is how long a silent rank (cut off
    /// by the network rather than dead) is waited for before the others regroup without it.
    #[arg(long, default_value_t = 1800.0, value_parser = positive_secs)]
    pub timeout: f64,

    /// Join a running --fault-tolerance job (its store found as a worker's is: MASTER_ADDR,
    /// MASTER_PORT) instead of starting one: this process enters at the job's next step boundary
    /// with the live ranks' model, optimizer state and data position, received from them (no
    /// checkpoint is read).
    #[arg(long, conflicts_with = "resume")]
    pub join: bool,
    /// One JSON line per evaluation (step, train loss, validation loss, tokens/s) to this file
    /// (rank 0).
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Record every rank's timeline (forward and backward as one span per step, buckets,
    /// collectives, optimizer); rank 0 merges them into DIR/trace.json (Chrome trace: Perfetto
    /// or chrome://tracing) [default: env DDP_TRACE].
    #[arg(long, value_name = "DIR")]
    pub trace: Option<PathBuf>,
    /// Print N characters generated by the trained model (rank 0).
    #[arg(long, default_value_t = 0)]
    pub sample: usize,
    /// Check after every step that the replicas are bit-identical (a collective; for tests).
    #[arg(long, hide = true)]
    pub check_replicas: bool,
    /// Print a final JSON line with the run's figures.
    #[arg(long)]
    pub json: bool,
}

/// The model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct GptConfig {
    pub vocab_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_embd: usize,
    pub block_size: usize,
    pub bias: bool,
    pub tied: bool,
}

impl GptConfig {
    /// A model small enough for unit tests: vocabulary 11, 2 blocks of 2 heads, width 8,
    /// context 6.
    #[cfg(test)]
    pub fn tiny(tied: bool) -> GptConfig {
        GptConfig {
            vocab_size: 11,
            n_layer: 2,
            n_head: 2,
            n_embd: 8,
            block_size: 6,
            bias: false,
            tied,
        }
    }
}

impl Args {
    pub fn model(&self, vocab_size: usize) -> GptConfig {
        GptConfig {
            vocab_size,
            n_layer: self.n_layer,
            n_head: self.n_head,
            n_embd: self.n_embd,
            block_size: self.block_size,
            bias: self.bias,
            tied: !self.untied,
        }
    }

    /// Checks that clap cannot express.
    pub fn check(&self) -> Result<(), String> {
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!(
                "--n-embd {} is not a multiple of --n-head {}",
                self.n_embd, self.n_head
            ));
        }
        for (flag, v) in [
            ("--n-layer", self.n_layer),
            ("--n-head", self.n_head),
            ("--block-size", self.block_size),
            ("--batch-size", self.batch_size),
            ("--nproc", self.nproc),
        ] {
            if v == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("--dropout {} is not in [0, 1)", self.dropout));
        }
        if self.zero == 3 && self.framework == Framework::Burn {
            return Err(
                "--zero 3 shards the parameters, which ddp-rs offers for candle models \
                        only (ddprs::candle::Fsdp): use --framework candle, or --zero 1 or 2"
                    .into(),
            );
        }
        if self.zero > 0 && self.hook.hook().ok().flatten().is_some() {
            return Err(format!(
                "--hook applies to plain DDP (--zero 0): ZeRO reduce-scatters the gradients \
                 itself (--zero {})",
                self.zero
            ));
        }
        if self.zero > 0 && self.checkpoint_async == Some(ddprs::checkpoint::WhenBusy::Skip) {
            return Err(format!(
                "--checkpoint-async skip applies to plain checkpoints (--zero 0); a ZeRO save \
                 set (--zero {}) in the background always waits for the previous one: use \
                 --checkpoint-async (or --checkpoint-async wait)",
                self.zero
            ));
        }
        if self.stop_after.is_some() && self.checkpoint_dir.is_none() {
            return Err(
                "--stop-after needs --checkpoint-dir (the run it stops resumes from there)".into(),
            );
        }
        Ok(())
    }

    /// Whether in-place recovery is on (`--fault-tolerance`, `--join`, or
    /// `DDP_FAULT_TOLERANCE=1` from `ddprun --fault-tolerance`).
    pub fn fault_tolerant(&self) -> bool {
        self.fault_tolerance
            || self.joining()
            || ddprs::comm::process_group::regroup::fault_tolerance_from_env()
    }

    /// Whether this process joins a running job: `--join`, or `DDP_FT_JOIN=1` (what `ddprun
    /// --fault-tolerance` sets for the workers of a node admitted into a running job).
    pub fn joining(&self) -> bool {
        self.join || std::env::var("DDP_FT_JOIN").is_ok_and(|v| v.trim() == "1")
    }

    /// Whether to evaluate after `done` of `end` steps.
    pub fn eval_due(&self, done: u64, end: u64) -> bool {
        done.is_multiple_of(self.eval_interval.max(1)) || done == end
    }

    /// Whether to save a checkpoint after `done` of `end` steps (with --checkpoint-dir).
    pub fn save_due(&self, done: u64, end: u64) -> bool {
        (self.checkpoint_every > 0 && done.is_multiple_of(self.checkpoint_every)) || done == end
    }

    /// nanoGPT's `get_lr`: linear warm-up over --warmup-iters, cosine decay to --min-lr at
    /// --max-iters.
    pub fn lr_at(&self, it: u64) -> f64 {
        if it < self.warmup_iters {
            return self.lr * (it + 1) as f64 / (self.warmup_iters + 1) as f64;
        }
        if it > self.max_iters {
            return self.min_lr;
        }
        let span = (self.max_iters - self.warmup_iters).max(1) as f64;
        let ratio = (it - self.warmup_iters) as f64 / span;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

/// A number of seconds above zero (`--timeout`).
fn positive_secs(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if v > 0.0 && v.is_finite() => Ok(v),
        _ => Err(format!("{s:?} is not a positive number of seconds")),
    }
}
