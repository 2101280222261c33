//! Collective sweeps in the manner of nccl-tests: for each size (×4 steps), warm-up iterations,
//! then timed iterations (each after a barrier) whose median is reported, and a correctness pass that
//! counts the elements differing from the exact expected result.
//!
//! The buffers live where the [`Target`] keeps them: host memory (`--backend tcp|shm|auto`) or,
//! with feature `nccl`, device memory reduced by NCCL (`--backend nccl`, submodule `cuda`).
//! Each timed iteration ends when the collective has finished on the device.
//!
//! `algbw = bytes / time`; `busbw = algbw * factor` with nccl-tests' factors: all_reduce
//! `2(N-1)/N`, all_gather and reduce_scatter `(N-1)/N`, broadcast `1`.

use ddp_comm::{init_process_group, InitOptions, ProcessGroup, ReduceOp};
use std::time::Instant;

use crate::SweepArgs;

#[cfg(feature = "nccl")]
mod cuda;

/// The collective being measured.
#[derive(Clone, Copy, Debug)]
pub enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
}

/// Parse `4096`, `4K`, `1M`, `2G` (powers of 1024), at least [`MIN_BYTES`] (a smaller
/// message holds no f32 element: a sweep of it would measure nothing and print no row).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n = num
        .parse::<usize>()
        .map_err(|_| format!("{s:?} is not a size (examples: 4096, 4K, 64M)"))?;
    match n.checked_mul(mult) {
        Some(b) if b < MIN_BYTES => Err(format!(
            "{s:?} is smaller than the smallest message, {MIN_BYTES} bytes (one f32 element)"
        )),
        Some(b) if b <= MAX_BYTES => Ok(b),
        _ => Err(format!("{s:?} is larger than the largest message, 4G")),
    }
}

/// Smallest message a sweep accepts: one f32.
pub const MIN_BYTES: usize = 4;

/// Largest message a sweep accepts.
pub const MAX_BYTES: usize = 4 << 30;

fn busbw_factor(op: Op, n: usize) -> f64 {
    let n = n as f64;
    match op {
        Op::AllReduce => 2.0 * (n - 1.0) / n,
        Op::AllGather | Op::ReduceScatter => (n - 1.0) / n,
        Op::Broadcast => 1.0,
    }
}

/// Value of element `i` on `rank` (small integers: every sum is exact in f32).
fn value(rank: usize, i: usize) -> f32 {
    ((i % 13) + rank) as f32
}

/// The host buffers of one size: `a` the input (in place for all_reduce and broadcast), `b` the
/// output of all_gather and reduce_scatter.
pub struct Bufs {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
}

/// Where the sweep's buffers live and what runs the collective: host memory and the process
/// group, or (feature `nccl`) device memory and a `CudaGroup`.
pub trait Target {
    /// The host group (barriers, agreeing on times and counts).
    fn pg(&self) -> &ProcessGroup;
    /// Fresh inputs for `op` over `elems` f32 elements.
    fn prepare(&mut self, op: Op, elems: usize) -> ddp_comm::Result<()>;
    /// One iteration of `op`, finished when this returns.
    fn run_once(&mut self, op: Op) -> ddp_comm::Result<()>;
    /// The elements of the last result that differ from the exact expected one.
    fn count_wrong(&mut self, op: Op) -> ddp_comm::Result<usize>;
}

/// Host buffers and the process group's collectives.
struct Host {
    pg: ProcessGroup,
    bufs: Bufs,
}

impl Target for Host {
    fn pg(&self) -> &ProcessGroup {
        &self.pg
    }
    fn prepare(&mut self, op: Op, elems: usize) -> ddp_comm::Result<()> {
        self.bufs = setup(op, &self.pg, elems);
        Ok(())
    }
    fn run_once(&mut self, op: Op) -> ddp_comm::Result<()> {
        run_once(op, &self.pg, &mut self.bufs)
    }
    fn count_wrong(&mut self, op: Op) -> ddp_comm::Result<usize> {
        Ok(count_wrong(op, &self.pg, &self.bufs))
    }
}

/// The inputs of `op` over `elems` f32 elements on this rank.
pub fn setup(op: Op, pg: &ProcessGroup, elems: usize) -> Bufs {
    let (r, p) = (pg.rank(), pg.size());
    match op {
        // bytes = the per-rank buffer
        Op::AllReduce | Op::Broadcast => Bufs {
            a: (0..elems).map(|i| value(r, i)).collect(),
            b: Vec::new(),
        },
        // bytes = total output (all_gather) / total input (reduce_scatter)
        Op::AllGather => Bufs {
            a: (0..elems / p).map(|i| value(r, i)).collect(),
            b: vec![0.0; elems / p * p],
        },
        Op::ReduceScatter => Bufs {
            a: (0..elems / p * p).map(|i| value(r, i)).collect(),
            b: vec![0.0; elems / p],
        },
    }
}

fn run_once(op: Op, pg: &ProcessGroup, bufs: &mut Bufs) -> ddp_comm::Result<()> {
    match op {
        Op::AllReduce => pg.all_reduce(&mut bufs.a, ReduceOp::Sum),
        Op::Broadcast => pg.broadcast(&mut bufs.a, 0),
        Op::AllGather => pg.all_gather(&bufs.a, &mut bufs.b),
        Op::ReduceScatter => pg.reduce_scatter(&bufs.a, &mut bufs.b, ReduceOp::Sum),
    }
}

/// The elements of `bufs` (after `op`) that differ from the exact expected result.
pub fn count_wrong(op: Op, pg: &ProcessGroup, bufs: &Bufs) -> usize {
    let p = pg.size();
    let sum = |i: usize| (0..p).map(|r| value(r, i)).sum::<f32>();
    match op {
        Op::AllReduce => bufs
            .a
            .iter()
            .enumerate()
            .filter(|(i, &v)| v != sum(*i))
            .count(),
        Op::Broadcast => bufs
            .a
            .iter()
            .enumerate()
            .filter(|(i, &v)| v != value(0, *i))
            .count(),
        Op::AllGather => {
            let n = bufs.a.len();
            bufs.b
                .iter()
                .enumerate()
                .filter(|(i, &v)| v != value(i / n.max(1), i % n.max(1)))
                .count()
        }
        Op::ReduceScatter => {
            let n = bufs.b.len();
            let off = pg.rank() * n;
            bufs.b
                .iter()
                .enumerate()
                .filter(|(i, &v)| v != sum(off + i))
                .count()
        }
    }
}

/// Run the sweep as one worker; rank 0 prints.
pub fn run(op: Op, args: &SweepArgs) -> Result<(), Box<dyn std::error::Error>> {
    let pg = init_process_group(InitOptions::default())?;
    if args.backend == "nccl" {
        return run_nccl(op, args, pg);
    }
    let mut host = Host {
        pg,
        bufs: Bufs {
            a: Vec::new(),
            b: Vec::new(),
        },
    };
    sweep(op, args, &mut host)
}

#[cfg(feature = "nccl")]
fn run_nccl(op: Op, args: &SweepArgs, pg: ProcessGroup) -> Result<(), Box<dyn std::error::Error>> {
    let mut dev = cuda::Device::new(pg)?;
    sweep(op, args, &mut dev)
}

#[cfg(not(feature = "nccl"))]
fn run_nccl(_: Op, _: &SweepArgs, _: ProcessGroup) -> Result<(), Box<dyn std::error::Error>> {
    Err(
        "--backend nccl needs ddp-bench built with the nccl feature \
         (cargo build --release -p ddp-bench --features nccl)"
            .into(),
    )
}

/// The sweep over `target`; rank 0 prints.
fn sweep(
    op: Op,
    args: &SweepArgs,
    target: &mut impl Target,
) -> Result<(), Box<dyn std::error::Error>> {
    let (rank, p) = (target.pg().rank(), target.pg().size());
    if rank == 0 && !args.json {
        println!(
            "# ddp-bench {op:?}  world_size {p}  backend {}  dtype f32",
            args.backend
        );
        println!(
            "{:>12} {:>12} {:>10} {:>10} {:>8}",
            "bytes", "time_us", "algbw_GBs", "busbw_GBs", "wrong"
        );
    }
    let mut bytes = args.min_bytes.max(MIN_BYTES);
    while bytes <= args.max_bytes {
        let elems = bytes / 4;
        let iters = args
            .iters
            .unwrap_or_else(|| ((256 << 20) / bytes).clamp(5, 500));
        target.prepare(op, elems)?;
        for _ in 0..args.warmup {
            target.run_once(op)?;
        }
        // As the peer scripts do: a barrier before every timed iteration, so each one starts
        // with the ranks in step; the median over iterations of the slowest rank is reported.
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            target.pg().barrier()?;
            let t = Instant::now();
            target.run_once(op)?;
            times.push(t.elapsed().as_secs_f64());
        }
        // Agree on the slowest rank's median, like nccl-tests reports the max over ranks.
        times.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let mut med = [times[times.len() / 2]];
        target.pg().all_reduce(&mut med, ReduceOp::Max)?;
        // Correctness pass on fresh inputs, every size.
        target.prepare(op, elems)?;
        target.run_once(op)?;
        let mut wrong = [target.count_wrong(op)? as i64];
        target.pg().all_reduce(&mut wrong, ReduceOp::Sum)?;
        if rank == 0 {
            let t = med[0];
            let algbw = bytes as f64 / t / 1e9;
            let busbw = algbw * busbw_factor(op, p);
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"bytes": bytes, "time_us": t * 1e6, "algbw_gbs": algbw, "busbw_gbs": busbw, "wrong": wrong[0]})
                );
            } else {
                println!(
                    "{bytes:>12} {:>12.2} {algbw:>10.3} {busbw:>10.3} {:>8}",
                    t * 1e6,
                    wrong[0]
                );
            }
        }
        bytes *= 4;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every op on 3 real ranks: `count_wrong` is 0 on the collective's result and counts
    /// exactly the elements corrupted afterwards (one value off by 1, one NaN).
    #[test]
    fn wrong_counts_corrupted_elements() {
        ddp_comm::testing::run_ranks(3, |pg| {
            for op in [
                Op::AllReduce,
                Op::AllGather,
                Op::ReduceScatter,
                Op::Broadcast,
            ] {
                let mut bufs = setup(op, &pg, 3 * 1000);
                run_once(op, &pg, &mut bufs).unwrap();
                assert_eq!(count_wrong(op, &pg, &bufs), 0, "{op:?}");
                let out = match op {
                    Op::AllReduce | Op::Broadcast => &mut bufs.a,
                    Op::AllGather | Op::ReduceScatter => &mut bufs.b,
                };
                out[7] += 1.0;
                let last = out.len() - 1;
                out[last] = f32::NAN;
                assert_eq!(count_wrong(op, &pg, &bufs), 2, "{op:?} corrupted");
            }
        });
    }
}
