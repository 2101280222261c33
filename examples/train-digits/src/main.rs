//! `train-digits`: the main job of ddp-rs — an MLP classifier on the UCI handwritten digits,
//! trained data-parallel over N processes with `ddp-candle`, checking at the end that every
//! replica holds bit-identical weights.
//!
//! Run directly, it spawns `--nproc` local workers of itself (module [`launcher`]); under `ddprun`
//! (or any environment that sets `RANK` and `WORLD_SIZE`) it is one worker (module [`train`]),
//! and with `--backend mpi` (feature `mpi`) every process is a worker of the job `mpirun`
//! started: `mpirun -np 2 train-digits --backend mpi`.
//! Data and split: module [`data`]; model: module [`model`].

mod data;
mod flags;
mod launcher;
mod model;
mod observe;
mod train;
mod trainer;

use clap::{Parser, ValueEnum};
use ddprun::validate::{int_in, positive, MAX_SECS};

/// Communication backend (`auto` picks the best available one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    Auto,
    Tcp,
    Shm,
    /// The job's MPI library (run under `mpirun`/`srun`; needs the `mpi` feature).
    Mpi,
}

/// Which backward path the workers use (both give the same gradients).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackwardMode {
    /// `loss.backward()`, then the bucketed all-reduce.
    Plain,
    /// Block-by-block backward, each block's buckets communicated while earlier blocks compute
    /// (`staged` is its former name).
    #[value(alias = "staged")]
    Blockwise,
}

/// The optimizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OptimizerKind {
    /// `ddp_candle::optim::Sgd`: PyTorch's SGD, in place (momentum buffers saved in checkpoints).
    Sgd,
    /// `ddp_candle::optim::AdamW` (candle's arithmetic; moments saved in checkpoints).
    Adamw,
}

/// Data-parallel MLP training on the UCI digits (1797 8×8 images, fixed 80/20 split).
#[derive(Debug, Clone, Parser)]
#[command(name = "train-digits", version, allow_negative_numbers = true)]
pub struct Args {
    /// Number of local worker processes to spawn (ignored when RANK/WORLD_SIZE are set).
    #[arg(long, default_value_t = 2, value_parser = int_in::<usize>(1, ddprun::cli::MAX_LOCAL_WORKERS as u64))]
    pub nproc: usize,
    /// Communication backend [default: env DDP_BACKEND, else auto: shared memory when all ranks
    /// are on this host, TCP otherwise].
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// Number of passes over the training set.
    #[arg(long, default_value_t = 30, value_parser = int_in::<u64>(1, u64::MAX))]
    pub epochs: u64,
    /// Batch size per rank (the global batch is this × world size).
    #[arg(long, default_value_t = 32, value_parser = int_in::<usize>(1, MAX_BATCH))]
    pub batch_size: usize,
    /// Optimizer (ddp-candle's SGD or AdamW, both checkpointable).
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
    #[arg(long, default_value_t = 128, value_parser = int_in::<usize>(1, MAX_HIDDEN))]
    pub hidden: usize,
    /// Stop after this many optimizer steps in total (across resumes).
    #[arg(long, value_parser = int_in::<u64>(1, u64::MAX))]
    pub max_steps: Option<u64>,
    /// Directory for checkpoints (written by rank 0 at the end of every epoch and at exit).
    #[arg(long)]
    pub checkpoint_dir: Option<std::path::PathBuf>,
    /// Continue from the checkpoint in --checkpoint-dir (a fresh start if there is none). A
    /// checkpoint of another world size (an elastic `ddprun --nnodes MIN:MAX` job that lost or
    /// gained nodes) resumes too: the rest of its epoch is re-sharded over the new ranks by the
    /// global number of samples consumed. Any --zero loads any checkpoint: a plain one (written
    /// at --zero 0) or a sharded set (--zero 1-3), the newer when both are there.
    #[arg(long, requires = "checkpoint_dir")]
    pub resume: bool,
    /// Also checkpoint every this many optimizer steps (mid-epoch), not only at epoch ends.
    #[arg(long, value_name = "STEPS", requires = "checkpoint_dir",
          value_parser = int_in::<u64>(1, 1 << 32))]
    pub checkpoint_every: Option<u64>,
    /// Linear learning-rate scaling (`ddp::scale_lr_linear`): --lr is tuned for a global batch of
    /// BASE samples, and a run at world size W uses lr × (batch-size × W) / BASE, so a job that
    /// resumes at another world size follows its new global batch.
    #[arg(long, value_name = "BASE", value_parser = int_in::<usize>(1, 1 << 40))]
    pub scale_lr: Option<usize>,
    /// Backward path.
    #[arg(long, value_enum, default_value_t = BackwardMode::Plain)]
    pub backward: BackwardMode,
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
    /// steps after WARMUP; default 4 and 100). Hook state is saved in checkpoints.
    #[arg(long, default_value = "none")]
    pub hook: ddp::hooks::HookSpec,
    /// Stop once rank 0's held-out accuracy, evaluated after every epoch, reaches this
    /// (reports `time_to_target_s`, training time excluding evaluations).
    /// A fraction, 0 to 1.
    #[arg(long, value_parser = flags::fraction)]
    pub target_accuracy: Option<f64>,
    /// Device of every worker: `cpu`, or `cuda` (GPU `LOCAL_RANK % device_count`, like
    /// `torch.cuda.set_device(local_rank)`; needs a build with `--features cuda`). Gradients are
    /// then bucketed and all-reduced on the GPU: NCCL when every rank has its own GPU, staged
    /// through host memory when ranks share one (env `DDP_DEVICE_BACKEND`: auto, nccl, staged).
    #[arg(long, default_value = "cpu")]
    pub device: ddp_candle::device::DeviceKind,
    /// Do not stop on NaN or infinite gradients (by default a non-finite averaged gradient stops
    /// the run with an error naming the step, the rank and the parameter).
    #[arg(long)]
    pub no_check_finite: bool,
    /// ZeRO stage: 0 (DDP), 1 (optimizer state sharded over the ranks), 2 (+ gradients), 3 (+
    /// parameters: `ddp_candle::Fsdp`, units fc1 and fc2); with --checkpoint-dir, stages 1-3
    /// write sharded checkpoints (`ddp::sharding`), loadable at any world size and any --zero.
    #[arg(long, default_value_t = 0, value_parser = int_in::<u8>(0, 3))]
    pub zero: u8,
    /// Record every rank's timeline (forward, backward, buckets, collectives, optimizer, data,
    /// checkpoints); rank 0 merges them into DIR/trace.json (Chrome trace: Perfetto or
    /// chrome://tracing) and writes DIR/report.json [default: env DDP_TRACE].
    #[arg(long, value_name = "DIR")]
    pub trace: Option<std::path::PathBuf>,
    /// Rank 0 appends one JSON line per logged step (loss, accuracy at epoch ends, lr,
    /// samples/s, communication wait, bytes sent) and the bottleneck report; `ddp-plot` draws it.
    #[arg(long, value_name = "FILE")]
    pub metrics: Option<std::path::PathBuf>,
    /// Log a metrics line every this many steps.
    #[arg(long, default_value_t = 10, value_parser = int_in::<u64>(1, 1 << 32))]
    pub metrics_every: u64,
    /// Rank 0 writes the bottleneck report (per-rank step split, straggler) as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub report: Option<std::path::PathBuf>,
    /// No progress bar, progress lines or epoch lines (the summary is still printed).
    #[arg(long)]
    pub quiet: bool,
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

/// Widest hidden layer accepted (64 × H + H × 10 weights per replica).
const MAX_HIDDEN: u64 = 1 << 16;
/// Largest per-rank batch accepted (the training set has 1437 images).
const MAX_BATCH: u64 = 1 << 20;

fn main() {
    // Validates every flag (clap's error and exit status 2) before any worker starts.
    let args = Args::parse();
    if let Err(e) = args.device.check_built("train-digits") {
        eprintln!("train-digits: error: {e}");
        std::process::exit(2);
    }
    if !ddprun::spawn::is_worker() && args.backend != Some(Backend::Mpi) {
        std::process::exit(launcher::launch(args.nproc));
    }
    let rank = std::env::var("RANK")
        .or_else(|_| std::env::var("OMPI_COMM_WORLD_RANK"))
        .or_else(|_| std::env::var("PMI_RANK"))
        .unwrap_or_default();
    if let Err(e) = train::run(&args) {
        eprintln!("train-digits rank {rank}: error: {e}");
        std::process::exit(1);
    }
}
