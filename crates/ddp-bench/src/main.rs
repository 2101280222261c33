//! `ddp-bench`: nccl-tests-style sweeps of ddp-rs collectives (and, later, training throughput).
//!
//! `ddp-bench allreduce --nproc 2 --min-bytes 1K --max-bytes 64M` starts `--nproc` local worker
//! processes itself (re-executing this binary with the torchrun environment), and rank 0 prints
//! one row per size (×4 steps): `bytes time_us algbw_GBs busbw_GBs wrong`, or one JSON object
//! per size with `--json`. Run under `ddprun` (RANK/WORLD_SIZE set), it is one worker.
//!
//! - [`sweep`]: the collective sweeps and their busbw factors.
//! - [`launch`]: spawning and supervising the local worker processes.

mod launch;
mod sweep;

use clap::{Args, Parser, Subcommand};

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
}

/// Options shared by every sweep.
#[derive(Args, Clone, Debug)]
pub struct SweepArgs {
    /// Transport: tcp (loopback or network).
    #[arg(long, default_value = "tcp")]
    pub backend: String,
    /// Number of local processes to start (ignored under a launcher that sets RANK/WORLD_SIZE).
    #[arg(long, default_value_t = 2)]
    pub nproc: usize,
    /// Smallest message in bytes (suffixes K, M, G are powers of 1024).
    #[arg(long, default_value = "1K", value_parser = sweep::parse_bytes)]
    pub min_bytes: usize,
    /// Largest message in bytes.
    #[arg(long, default_value = "64M", value_parser = sweep::parse_bytes)]
    pub max_bytes: usize,
    /// Timed iterations per size (default: scaled by size, 5..=500).
    #[arg(long)]
    pub iters: Option<usize>,
    /// Untimed warm-up iterations per size.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// One JSON object per size instead of the table.
    #[arg(long)]
    pub json: bool,
}

fn main() {
    let cli = Cli::parse();
    let (op, args) = match cli.cmd {
        Cmd::Allreduce(a) => (sweep::Op::AllReduce, a),
        Cmd::AllGather(a) => (sweep::Op::AllGather, a),
        Cmd::ReduceScatter(a) => (sweep::Op::ReduceScatter, a),
        Cmd::Broadcast(a) => (sweep::Op::Broadcast, a),
    };
    if args.backend != "tcp" {
        eprintln!(
            "ddp-bench: unknown --backend {:?} (available: tcp)",
            args.backend
        );
        std::process::exit(2);
    }
    let code = if launch::is_worker() {
        match sweep::run(op, &args) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!(
                    "ddp-bench: rank {}: {e}",
                    std::env::var("RANK").unwrap_or_default()
                );
                1
            }
        }
    } else {
        launch::run_local(args.nproc)
    };
    std::process::exit(code);
}
