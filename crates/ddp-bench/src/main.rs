//! `ddp-bench`: nccl-tests-style sweeps of ddp-rs collectives (and, later, training throughput).
//!
//! `ddp-bench allreduce --nproc 2 --min-bytes 1K --max-bytes 64M` starts `--nproc` local worker
//! processes itself (re-executing this binary with the torchrun environment), and rank 0 prints
//! one row per size (×4 steps): `bytes time_us algbw_GBs busbw_GBs wrong`, or one JSON object
//! per size with `--json`. Run under `ddprun` (RANK/WORLD_SIZE set), it is one worker.
//!
//! - [`sweep`]: the collective sweeps and their busbw factors.
//! - [`train`]: DDP training throughput of an MLP (`ddp-bench train`).
//! - [`launch`]: spawning and supervising the local worker processes.

#![forbid(unsafe_code)]

mod launch;
mod sweep;
mod trace_cost;
mod train;
mod train_burn;

use clap::{Args, Parser, Subcommand};
use ddprun::cli::MAX_LOCAL_WORKERS;
use ddprun::validate::{int_in, positive};

/// Most timed or warm-up iterations or steps accepted.
const MAX_ITERS: u64 = 1_000_000;

/// `--bucket-cap-mb`: positive, at most 1 TiB.
fn bucket_cap(s: &str) -> Result<f64, String> {
    let v = positive(s)?;
    if v <= 1024.0 * 1024.0 {
        Ok(v)
    } else {
        Err(format!("{v} MiB is more than 1 TiB"))
    }
}

#[derive(Parser)]
#[command(
    name = "ddp-bench",
    about = "Benchmarks for ddp-rs collectives",
    version
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// all_reduce (sum, f32) sweep; busbw = algbw * 2(N-1)/N
    #[command(alias = "all_reduce")]
    Allreduce(SweepArgs),
    /// all_gather sweep (bytes = output size); busbw = algbw * (N-1)/N
    #[command(name = "all_gather", alias = "allgather")]
    AllGather(SweepArgs),
    /// reduce_scatter sweep (bytes = input size); busbw = algbw * (N-1)/N
    #[command(name = "reduce_scatter", alias = "reducescatter")]
    ReduceScatter(SweepArgs),
    /// broadcast sweep from rank 0; busbw = algbw
    Broadcast(SweepArgs),
    /// DDP training throughput: MLP 784-HxL-10 on synthetic data, one thread per rank
    Train(TrainArgs),
    /// Cost of one timeline span (`ddp_core::trace`) with tracing off and on, in ns (one rank)
    TraceCost(TraceCostArgs),
}

/// Options of `ddp-bench trace-cost`.
#[derive(Args, Clone, Debug)]
pub struct TraceCostArgs {
    /// Spans recorded per measurement.
    #[arg(long, default_value_t = 200_000, value_parser = int_in::<usize>(1000, 1_000_000))]
    pub spans: usize,
    /// Measurements (the median is reported).
    #[arg(long, default_value_t = 5, value_parser = int_in::<usize>(1, 100))]
    pub reps: usize,
}

/// Options of `ddp-bench train`.
#[derive(Args, Clone, Debug)]
pub struct TrainArgs {
    /// Transport: tcp, shm or auto.
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// Number of local processes (world size).
    #[arg(long, default_value_t = 2, value_parser = int_in::<usize>(1, MAX_LOCAL_WORKERS as u64))]
    pub nproc: usize,
    /// Hidden width H.
    #[arg(long, default_value_t = 1024, value_parser = int_in::<usize>(1, 1 << 16))]
    pub hidden: usize,
    /// Number of hidden layers L.
    #[arg(long, default_value_t = 4, value_parser = int_in::<usize>(1, 1024))]
    pub layers: usize,
    /// Batch size per rank.
    #[arg(long, default_value_t = 64, value_parser = int_in::<usize>(1, 1 << 16))]
    pub batch: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 50, value_parser = int_in::<usize>(1, MAX_ITERS))]
    pub steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 5, value_parser = int_in::<usize>(0, MAX_ITERS))]
    pub warmup: usize,
    /// Use the blockwise backward (block by block, buckets overlapping earlier blocks' compute)
    /// instead of the plain one (loss.backward() then bucketed all-reduce). On candle's CPU
    /// backend the blockwise path's extra per-block backward passes cost more than the overlap
    /// saves for this model (see the benchmarks chapter), hence plain by default.
    /// With `--zero 2` it is what keeps gradients at their shard (each block's gradients are
    /// reduce-scattered and freed before the next block's backward). `--staged` is its former
    /// name.
    #[arg(long, alias = "staged")]
    pub blockwise: bool,
    /// Layout of the linear layers' weights: `out-in` is `ddp_candle::nn::Linear` (PyTorch's
    /// layout, `x @ W^T`, its backward three matmuls); `candle-nn` the same layout through
    /// `candle_nn::Linear`, whose backward of `W^T` adds a transposed (strided) gradient into a
    /// zero tensor and sums the bias gradient with a strided reduction; `in-out` stores W^T
    /// (Flax's `Dense` kernel layout, `x @ W`). The model and its arithmetic are the same.
    #[arg(long, default_value = "out-in", value_parser = ["out-in", "candle-nn", "in-out"])]
    pub weight_layout: String,
    /// DDP bucket cap in MiB (PyTorch's `bucket_cap_mb`).
    #[arg(long, default_value_t = 25.0, value_parser = bucket_cap)]
    pub bucket_cap_mb: f64,
    /// Leave glibc's default heap trimming (see `ddp_candle::alloc::retain_freed_memory`, which
    /// the benchmark calls by default).
    #[arg(long)]
    pub no_retain_memory: bool,
    /// Communication hook: `none|fp16|bf16|powersgd[:RANK[:START_ITER]]|localsgd[:PERIOD[:WARMUP]]|
    /// diloco:H[:OUTER_LR[:MOMENTUM]]|streaming-diloco:H:F[:TAU]` (see
    /// `ddp_core::hooks::HookSpec`; DiLoCo runs its outer loop after every step); the table and
    /// the JSON report the payload bytes sent per timed step.
    #[arg(long, default_value = "none")]
    pub hook: ddp_core::hooks::HookSpec,
    /// A last JSON line with world_size, samples_per_s, step_ms, comm_wait_ms, hook, zero,
    /// optimizer, params, peak_rss_bytes, bytes_per_step.
    #[arg(long)]
    pub json: bool,
    /// ZeRO stage: 0 (DDP), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters, one
    /// unit per layer; CPU).
    #[arg(long, default_value_t = 0, value_parser = int_in::<u8>(0, 3))]
    pub zero: u8,
    /// With `--zero 2`: keep the last K buckets whole between steps (`ddp_candle::ZeroOptions`:
    /// faster, up to K buckets of memory beyond stage 2's formula).
    #[arg(long, default_value_t = 0, value_parser = int_in::<usize>(0, 1 << 20))]
    pub zero_keep_buckets: usize,
    /// With `--zero 3`: when the backward gathers the next unit (PyTorch FSDP's
    /// `backward_prefetch`): `pre` before the current unit's gradient (overlaps it; two units
    /// gathered at the peak), `post` after it (one unit less memory), `none` (no overlap).
    #[arg(long, default_value = "pre", value_parser = ["pre", "post", "none"])]
    pub backward_prefetch: String,
    /// Optimizer: sgd (lr 0.01) or adamw (lr 1e-3, candle's defaults otherwise).
    #[arg(long, default_value = "sgd", value_parser = ["sgd", "adamw"])]
    pub optimizer: String,
    /// Device of every rank: `cpu`, or `cuda` (GPU `LOCAL_RANK % device_count`; needs a build
    /// with `--features cuda`). Gradient buckets then live on the GPU: NCCL when every rank has
    /// its own GPU, host-staged when ranks share one (`DDP_DEVICE_BACKEND` overrides).
    #[arg(long, default_value = "cpu")]
    pub device: ddp_candle::device::DeviceKind,
    /// Framework of the model: candle (`ddp-candle`) or burn (`ddp-burn`, Burn's `Linear` on
    /// the burn-flex CPU backend; `--weight-layout` is candle's).
    #[arg(long, default_value = "candle", value_parser = ["candle", "burn"])]
    pub framework: String,
    /// Record every rank's timeline of the timed steps; rank 0 merges them into DIR/trace.json
    /// (Chrome trace) [default: env DDP_TRACE].
    #[arg(long, value_name = "DIR")]
    pub trace: Option<std::path::PathBuf>,
}

/// Options shared by every sweep.
#[derive(Args, Clone, Debug)]
pub struct SweepArgs {
    /// Transport: tcp (loopback or network), shm (shared memory, all ranks on this host),
    /// auto (shm when every rank is on this host, else tcp) or mpi (feature `mpi`: run under
    /// `mpirun -np N`, every process a rank; `--nproc` is ignored). Sets `DDP_BACKEND` for the
    /// workers. nccl: buffers in GPU memory (device `LOCAL_RANK % device_count`), reduced by NCCL
    /// (needs the `nccl` feature; the host group underneath uses auto).
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "shm", "auto", "mpi", "nccl"])]
    pub backend: String,
    /// Number of local processes to start (ignored under a launcher that sets RANK/WORLD_SIZE).
    #[arg(long, default_value_t = 2, value_parser = int_in::<usize>(1, MAX_LOCAL_WORKERS as u64))]
    pub nproc: usize,
    /// Smallest message in bytes (suffixes K, M, G are powers of 1024; 4 to 4G).
    #[arg(long, default_value = "1K", value_parser = sweep::parse_bytes)]
    pub min_bytes: usize,
    /// Largest message in bytes (4 to 4G).
    #[arg(long, default_value = "64M", value_parser = sweep::parse_bytes)]
    pub max_bytes: usize,
    /// Timed iterations per size (default: scaled by size, 5..=500).
    #[arg(long, value_parser = int_in::<usize>(1, MAX_ITERS))]
    pub iters: Option<usize>,
    /// Untimed warm-up iterations per size.
    #[arg(long, default_value_t = 3, value_parser = int_in::<usize>(0, MAX_ITERS))]
    pub warmup: usize,
    /// One JSON object per size instead of the table.
    #[arg(long)]
    pub json: bool,
}

fn main() {
    let cli = Cli::parse();
    if let Cmd::Allreduce(a) | Cmd::AllGather(a) | Cmd::ReduceScatter(a) | Cmd::Broadcast(a) =
        &cli.cmd
    {
        if a.min_bytes > a.max_bytes {
            eprintln!(
                "ddp-bench: error: --min-bytes {} is larger than --max-bytes {}",
                a.min_bytes, a.max_bytes
            );
            std::process::exit(2);
        }
    }
    if let Cmd::Train(a) = &cli.cmd {
        if let Err(e) = a.device.check_built("ddp-bench") {
            eprintln!("ddp-bench: error: {e}");
            std::process::exit(2);
        }
    }
    let (backend, nproc) = match &cli.cmd {
        Cmd::Train(a) => (a.backend.clone(), a.nproc),
        Cmd::TraceCost(_) => ("auto".to_string(), 1),
        Cmd::Allreduce(a) | Cmd::AllGather(a) | Cmd::ReduceScatter(a) | Cmd::Broadcast(a) => {
            (a.backend.clone(), a.nproc)
        }
    };
    // Workers (this process under a launcher, or its children) read the backend from the env.
    // NCCL runs on device buffers beside a host group, which picks its own transport.
    let host_backend = if backend == "nccl" { "auto" } else { &backend };
    std::env::set_var("DDP_BACKEND", host_backend);
    if !launch::is_worker() && backend != "mpi" {
        std::process::exit(launch::run_local(nproc));
    }
    let result = match cli.cmd {
        Cmd::Train(a) if a.framework == "burn" => train_burn::run(&a),
        Cmd::Train(a) => train::run(&a),
        Cmd::TraceCost(a) => trace_cost::run(&a),
        Cmd::Allreduce(a) => sweep::run(sweep::Op::AllReduce, &a),
        Cmd::AllGather(a) => sweep::run(sweep::Op::AllGather, &a),
        Cmd::ReduceScatter(a) => sweep::run(sweep::Op::ReduceScatter, &a),
        Cmd::Broadcast(a) => sweep::run(sweep::Op::Broadcast, &a),
    };
    if let Err(e) = result {
        let rank = std::env::var("RANK")
            .or_else(|_| std::env::var("OMPI_COMM_WORLD_RANK"))
            .unwrap_or_default();
        eprintln!("ddp-bench: rank {rank}: {e}");
        std::process::exit(1);
    }
}
