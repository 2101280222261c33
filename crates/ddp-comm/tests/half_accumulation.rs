//! `f16`/`bf16` are reduced with `f32` accumulation and rounded once (README), on every
//! reducing collective, transport and algorithm.
//!
//! The inputs tell the two apart: in element `i` one rank (`i mod p`, so every rank's position
//! in a chain of partial sums is exercised) holds a large value `B` (256 for bf16, 2048 for
//! f16: the first power of two where adding 1 is lost) and every other rank a small one (1 or
//! 3). In `f32` the sum `B + (p - 1) * small` is exact whatever the order, so the expected value
//! is that exact sum rounded once to the half type (for `Avg`: the exact sum divided by `p` in
//! `f32`, rounded once). A reduction that rounds partial sums to 16 bits loses the small values
//! added after `B`: bf16 `[256, 1, 1, 1]` gives 256 instead of 260 (259 rounded once).
//! With 2 ranks one addition is the whole reduction, so only world sizes >= 3 can tell; 2 is
//! checked for correctness.

#[path = "common/alone.rs"]
mod alone;
mod common;

use common::{assert_same, run_ranks_on, run_ranks_on_hosts, Num};
use ddp_comm::algorithms::AllReduceAlgorithm;
use ddp_comm::process_group::Backend;
use ddp_comm::{ProcessGroup, ReduceOp};
use half::{bf16, f16};
use std::time::Duration;

/// Rank `rank`'s input for element `i` of a `world`-rank reduction with `op`.
fn value(big: f32, op: ReduceOp, rank: usize, world: usize, i: usize) -> f32 {
    let sign = if (i / world).is_multiple_of(2) {
        1.0
    } else {
        -1.0
    };
    match op {
        // Powers of two: the product is exact in any order and precision.
        ReduceOp::Product => [1.0, 2.0, -1.0, 0.5][(i + 3 * rank) % 4],
        _ if rank == i % world => sign * big,
        _ => sign * (1 + 2 * ((i / (2 * world)) % 2)) as f32,
    }
}

/// The 16-bit float types.
trait Half: Num {
    fn from_f32(x: f32) -> Self;
}

impl Half for bf16 {
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

impl Half for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}

fn inputs<H: Half>(big: f32, op: ReduceOp, rank: usize, world: usize, n: usize) -> Vec<H> {
    (0..n)
        .map(|i| H::from_f32(value(big, op, rank, world, i)))
        .collect()
}

/// The exact reduction (f64, exact for these inputs) rounded to `f32`, `Avg` divided in `f32`,
/// then rounded once to `H`.
fn expected<H: Half>(big: f32, op: ReduceOp, world: usize, n: usize) -> Vec<H> {
    (0..n)
        .map(|i| {
            let v: Vec<f64> = (0..world)
                .map(|r| value(big, op, r, world, i) as f64)
                .collect();
            let r = match op {
                ReduceOp::Sum => v.iter().sum::<f64>() as f32,
                ReduceOp::Avg => v.iter().sum::<f64>() as f32 / world as f32,
                ReduceOp::Product => v.iter().product::<f64>() as f32,
                ReduceOp::Min => v.iter().cloned().fold(f64::INFINITY, f64::min) as f32,
                ReduceOp::Max => v.iter().cloned().fold(f64::NEG_INFINITY, f64::max) as f32,
            };
            H::from_f32(r)
        })
        .collect()
}

/// Sizes: empty, fewer elements than ranks, small, past the ring threshold and the shared-memory
/// one-shot limit (pipelined), and past the cross-memory-attach threshold (1 MiB).
const SIZES: [usize; 6] = [0, 2, 7, 1000, 70_000, 600_000];

fn check_half<H: Half>(pg: &ProcessGroup, big: f32) {
    let (rank, world) = (pg.rank(), pg.size());
    let dt = H::DTYPE;
    for n in SIZES {
        let ops: &[ReduceOp] = if n > 100_000 {
            &[ReduceOp::Sum, ReduceOp::Avg]
        } else {
            &common::OPS
        };
        for &op in ops {
            let what = |c: &str| format!("{c} {dt} {op} n={n} world={world} {}", pg.topology());
            let want = expected::<H>(big, op, world, n);
            let mut buf = inputs::<H>(big, op, rank, world, n);
            pg.all_reduce(&mut buf, op).unwrap();
            assert_same(&what("all_reduce"), &buf, &want);
            let got = pg
                .all_reduce_async(inputs::<H>(big, op, rank, world, n), op)
                .wait()
                .unwrap();
            assert_same(&what("all_reduce_async"), &got, &want);
            let root = (n + op as usize) % world;
            let mut buf = inputs::<H>(big, op, rank, world, n);
            pg.reduce(&mut buf, op, root).unwrap();
            if rank == root {
                assert_same(&what("reduce"), &buf, &want);
            }
            // reduce_scatter over `world` blocks of `n / world` (at least 1) elements
            let blk = (n / world).max(1);
            let full = inputs::<H>(big, op, rank, world, blk * world);
            let want = expected::<H>(big, op, world, blk * world);
            let mut out = vec![H::from_i(0); blk];
            pg.reduce_scatter(&full, &mut out, op).unwrap();
            assert_same(
                &what("reduce_scatter"),
                &out,
                &want[rank * blk..(rank + 1) * blk],
            );
        }
    }
}

fn check_group(pg: ProcessGroup) {
    check_half::<bf16>(&pg, 256.0);
    check_half::<f16>(&pg, 2048.0);
}

const T: Duration = Duration::from_secs(120);

#[test]
fn inputs_tell_f32_from_16_bit_accumulation() {
    // The premise: accumulating in bf16 loses what the test looks for.
    let acc = |xs: &[f32]| {
        xs.iter()
            .fold(bf16::from_f32(0.0), |a, &x| bf16::from_f32(a.to_f32() + x))
    };
    assert_eq!(acc(&[256.0, 1.0, 1.0, 1.0]).to_f32(), 256.0);
    let want = expected::<bf16>(256.0, ReduceOp::Sum, 4, 4);
    assert!(want.iter().all(|x| x.to_f32() == 260.0), "{want:?}");
}

#[test]
fn tcp_auto_accumulates_half_in_f32() {
    for world in [2, 3, 4, 5] {
        run_ranks_on(world, T, None, Backend::Tcp, check_group);
    }
}

#[test]
fn tcp_forced_ring_and_recursive_doubling_accumulate_half_in_f32() {
    for algo in [
        AllReduceAlgorithm::Ring,
        AllReduceAlgorithm::RecursiveDoubling,
    ] {
        for world in [3, 4] {
            run_ranks_on(world, T, Some(algo), Backend::Tcp, check_group);
        }
    }
}

#[test]
fn shm_accumulates_half_in_f32() {
    for world in [3, 4] {
        run_ranks_on(world, T, None, Backend::Shm, check_group);
    }
    // A forced algorithm takes the message path over shared memory.
    run_ranks_on(
        3,
        T,
        Some(AllReduceAlgorithm::Ring),
        Backend::Shm,
        check_group,
    );
}

#[test]
fn hierarchical_accumulates_half_in_f32() {
    for hosts in [&[0, 0, 1, 1][..], &[0, 1, 1, 0, 1], &[0, 1, 1]] {
        run_ranks_on_hosts(hosts, T, None, |pg| {
            assert_eq!(pg.topology().name(), "hierarchical", "{}", pg.topology());
            check_group(pg)
        });
    }
}

/// Bytes this process has written with `write`/`writev` (`/proc/self/io`'s `wchar`): the TCP
/// transport's frames, all ranks being threads of this process.
fn written_bytes() -> u64 {
    let io = std::fs::read_to_string("/proc/self/io").expect("/proc/self/io");
    io.lines()
        .find_map(|l| l.strip_prefix("wchar:"))
        .and_then(|v| v.trim().parse().ok())
        .expect("wchar in /proc/self/io")
}

/// Bytes all ranks write during `op` (rank 0 reads the counter between barriers).
fn bytes_of(pg: &ProcessGroup, op: impl FnOnce()) -> u64 {
    pg.barrier().unwrap();
    let before = written_bytes();
    pg.barrier().unwrap();
    op();
    pg.barrier().unwrap();
    let after = written_bytes();
    pg.barrier().unwrap();
    after - before
}

/// What the 16-bit ring puts on the wire, against the same reductions in `f32`: raw inputs and
/// finished segments travel as 16 bits, partial sums as `f32`, so `(6p - 8) / (8p - 8)` of the
/// bytes (half at two ranks) for all-reduce and `(4p - 6) / (4p - 4)` for reduce-scatter (raw
/// inputs in the first of `p - 1` steps). Widening before the wire, as the backends once did,
/// gives 1.
#[test]
fn tcp_ring_sends_half_as_16_bits_wherever_exact() {
    // `/proc/self/io` counts the whole process: measure alone.
    if !alone::in_own_process("tcp_ring_sends_half_as_16_bits_wherever_exact") {
        return;
    }
    const N: usize = 1 << 20;
    for world in [2, 3, 4] {
        let ratios = run_ranks_on(world, T, None, Backend::Tcp, move |pg| {
            let mut f = vec![1.0f32; N];
            let mut h = vec![bf16::from_f32(1.0); N];
            let f32_ar = bytes_of(&pg, || pg.all_reduce(&mut f, ReduceOp::Avg).unwrap());
            let half_ar = bytes_of(&pg, || pg.all_reduce(&mut h, ReduceOp::Avg).unwrap());
            assert!(h.iter().all(|x| x.to_f32() == 1.0));
            let mut fo = vec![0f32; N / world];
            let mut ho = vec![bf16::from_f32(0.0); N / world];
            let (fi, hi) = (&f[..N / world * world], &h[..N / world * world]);
            let f32_rs = bytes_of(&pg, || {
                pg.reduce_scatter(fi, &mut fo, ReduceOp::Sum).unwrap()
            });
            let half_rs = bytes_of(&pg, || {
                pg.reduce_scatter(hi, &mut ho, ReduceOp::Sum).unwrap()
            });
            assert!(ho.iter().all(|x| x.to_f32() == world as f32));
            (
                half_ar as f64 / f32_ar as f64,
                half_rs as f64 / f32_rs as f64,
            )
        });
        let p = world as f64;
        let (ar, rs) = ratios[0];
        let (want_ar, want_rs) = (
            (6.0 * p - 8.0) / (8.0 * p - 8.0),
            (4.0 * p - 6.0) / (4.0 * p - 4.0),
        );
        assert!(
            (ar - want_ar).abs() < 0.02,
            "world {world}: bf16 all-reduce wrote {ar:.3} of f32's bytes, expected {want_ar:.3}"
        );
        assert!(
            (rs - want_rs).abs() < 0.02,
            "world {world}: bf16 reduce-scatter wrote {rs:.3} of f32's bytes, expected {want_rs:.3}"
        );
    }
}
