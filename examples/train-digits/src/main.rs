//! `train-digits`: the main job of ddp-rs — an MLP classifier on the UCI handwritten digits,
//! trained data-parallel over N processes with `ddp-candle`, checking at the end that every
//! replica holds bit-identical weights.
//!
//! Run directly, it spawns `--nproc` local workers of itself (module [`launcher`]); under `ddprun`
//! (or any environment that sets `RANK` and `WORLD_SIZE`) it is one worker (module [`train`]),
//! and with `--backend mpi` (feature `mpi`) every process is a worker of the job `mpirun`
//! started: `mpirun -np 2 train-digits --backend mpi`.
//! Data and split: `ddp_example_support::data`; model: module [`model`]. The flags, data and
//! summary it shares with `train-digits-burn` are `ddp_example_support`'s.

mod launcher;
mod model;
mod observe;
mod train;
mod trainer;

use clap::{Parser, ValueEnum};
use ddp_example_support::flags::CommonArgs;
use ddprs::launcher::validate::int_in;

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

/// Data-parallel MLP training on the UCI digits (1797 8×8 images, fixed 80/20 split).
#[derive(Debug, Clone, Parser)]
#[command(name = "train-digits", version, allow_negative_numbers = true)]
pub struct Args {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Communication backend [default: env DDP_BACKEND, else auto: shared memory when all ranks
    /// are on this host, TCP otherwise].
    #[arg(long, value_enum)]
    pub backend: Option<Backend>,
    /// Continue from the checkpoint in --checkpoint-dir (a fresh start if there is none). A
    /// checkpoint of another world size (an elastic `ddprun --nnodes MIN:MAX` job that lost or
    /// gained nodes) resumes too: the rest of its epoch is re-sharded over the new ranks by the
    /// global number of samples consumed (not a DiLoCo run's, which holds every rank's own state:
    /// at its world size only). Any --zero loads any checkpoint: a plain one (written at --zero
    /// 0) or a sharded set (--zero 1-3), the newer when both are there.
    #[arg(long, requires = "checkpoint_dir")]
    pub resume: bool,
    /// Also checkpoint every this many optimizer steps (mid-epoch), not only at epoch ends.
    #[arg(long, value_name = "STEPS", requires = "checkpoint_dir",
          value_parser = int_in::<u64>(1, 1 << 32))]
    pub checkpoint_every: Option<u64>,
    /// Linear learning-rate scaling (`ddprs::scale_lr_linear`): --lr is tuned for a global batch of
    /// BASE samples, and a run at world size W uses lr × (batch-size × W) / BASE, so a job that
    /// resumes at another world size follows its new global batch.
    #[arg(long, value_name = "BASE", value_parser = int_in::<usize>(1, 1 << 40))]
    pub scale_lr: Option<usize>,
    /// Backward path.
    #[arg(long, value_enum, default_value_t = BackwardMode::Plain)]
    pub backward: BackwardMode,
    /// Device of every worker: `cpu`, or `cuda` (GPU `LOCAL_RANK % device_count`, like
    /// `torch.cuda.set_device(local_rank)`; needs a build with `--features cuda`). Gradients are
    /// then bucketed and all-reduced on the GPU: NCCL when every rank has its own GPU, staged
    /// through host memory when ranks share one (env `DDP_DEVICE_BACKEND`: auto, nccl, staged).
    #[arg(long, default_value = "cpu")]
    pub device: ddprs::candle::device::DeviceKind,
    /// ZeRO stage: 0 (DDP), 1 (optimizer state sharded over the ranks), 2 (+ gradients), 3 (+
    /// parameters: `ddprs::candle::Fsdp`, units fc1 and fc2); with --checkpoint-dir, stages 1-3
    /// write sharded checkpoints (`ddprs::sharding`), loadable at any world size and any --zero.
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

fn main() {
    // Validates every flag (clap's error and exit status 2) before any worker starts.
    let args = Args::parse();
    if let Err(e) = args.device.check_built("train-digits") {
        eprintln!("train-digits: error: {e}");
        std::process::exit(2);
    }
    if !ddprs::launcher::spawn::is_worker() && args.backend != Some(Backend::Mpi) {
        std::process::exit(launcher::launch(args.common.nproc));
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
