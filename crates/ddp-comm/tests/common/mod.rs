//! Shared test support: shorthands over `ddp_comm::testing`'s threads-as-ranks harness (a
//! closure on `world` ranks, one thread each, every rank with its own process group over real
//! TCP sockets on loopback: [`run_ranks`], [`run_ranks_with`]; or another backend:
//! [`run_ranks_on`], [`run_ranks_on_hosts`]), a sequential reference of every collective, and
//! worker processes (this test binary re-executed with the torchrun environment).
#![allow(dead_code)]
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

pub mod api;

use ddp_comm::algorithms::AllReduceAlgorithm;
use ddp_comm::process_group::Backend;
pub use ddp_comm::Collectives;
use ddp_comm::{Element, ReduceOp};
use ddp_comm::{InitOptions, ProcessGroup};
use half::{bf16, f16};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Start `world` process groups (ranks as threads) and run `f(pg)` on each; results by rank.
pub fn run_ranks<R: Send + 'static>(
    world: usize,
    timeout: Duration,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    run_ranks_with(world, timeout, None, f)
}

/// [`run_ranks`] with a forced all-reduce algorithm.
pub fn run_ranks_with<R: Send + 'static>(
    world: usize,
    timeout: Duration,
    algorithm: Option<AllReduceAlgorithm>,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    run_ranks_on(world, timeout, algorithm, Backend::Tcp, f)
}

/// [`run_ranks_with`] over `backend`.
pub fn run_ranks_on<R: Send + 'static>(
    world: usize,
    timeout: Duration,
    algorithm: Option<AllReduceAlgorithm>,
    backend: Backend,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    run_ranks_configured(
        world,
        timeout,
        move |_, opts| {
            opts.allreduce_algorithm = algorithm;
            opts.backend = Some(backend);
        },
        f,
    )
}

/// Ranks on simulated hosts, backend auto: rank `r` runs on host `hosts[r]` (its host id is
/// `test-host-{hosts[r]}`; all of them can share memory, being threads of this process).
pub fn run_ranks_on_hosts<R: Send + 'static>(
    hosts: &[usize],
    timeout: Duration,
    algorithm: Option<AllReduceAlgorithm>,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let hosts = hosts.to_vec();
    run_ranks_configured(
        hosts.len(),
        timeout,
        move |rank, opts| {
            opts.allreduce_algorithm = algorithm;
            opts.backend = Some(Backend::Auto);
            opts.host_id = Some(format!("test-host-{}", hosts[rank]));
        },
        f,
    )
}

/// Start `world` groups (ranks as threads), each rank's options adjusted by `configure(rank,
/// options)`, and run `f(pg)` on each; results by rank ([`ddp_comm::testing`]'s harness).
pub fn run_ranks_configured<R: Send + 'static>(
    world: usize,
    timeout: Duration,
    configure: impl Fn(usize, &mut InitOptions) + Send + Sync + 'static,
    f: impl Fn(ProcessGroup) -> R + Send + Sync + 'static,
) -> Vec<R> {
    ddp_comm::testing::run_ranks_configured(world, timeout, configure, f)
}

// ----- sequential reference for every collective -------------------------------------------

pub const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Avg,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Product,
];

/// Conversions the reference needs.
pub trait Num: Element + Copy {
    fn from_i(v: i64) -> Self;
    fn to_f(self) -> f64;
    /// The reference reduction, mirroring the library's semantics for this type.
    fn reduce(vals: &[Self], op: ReduceOp) -> Self;
}

macro_rules! float_num {
    ($t:ty, $from:expr, $to:expr) => {
        impl Num for $t {
            fn from_i(v: i64) -> Self {
                $from(v as f32)
            }
            fn to_f(self) -> f64 {
                $to(self) as f64
            }
            fn reduce(vals: &[Self], op: ReduceOp) -> Self {
                let v: Vec<f64> = vals.iter().map(|x| x.to_f()).collect();
                let r = match op {
                    ReduceOp::Sum => v.iter().sum::<f64>(),
                    ReduceOp::Avg => (v.iter().sum::<f64>() as f32 / v.len() as f32) as f64,
                    ReduceOp::Min => v.iter().cloned().fold(f64::INFINITY, f64::min),
                    ReduceOp::Max => v.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
                    ReduceOp::Product => v.iter().product::<f64>(),
                };
                $from(r as f32)
            }
        }
    };
}
float_num!(f32, |x: f32| x, |x: f32| x);
float_num!(f16, f16::from_f32, |x: f16| x.to_f32());
float_num!(bf16, bf16::from_f32, |x: bf16| x.to_f32());

impl Num for f64 {
    fn from_i(v: i64) -> Self {
        v as f64
    }
    fn to_f(self) -> f64 {
        self
    }
    fn reduce(vals: &[Self], op: ReduceOp) -> Self {
        match op {
            ReduceOp::Sum => vals.iter().sum(),
            ReduceOp::Avg => vals.iter().sum::<f64>() / vals.len() as f64,
            ReduceOp::Min => vals.iter().cloned().fold(f64::INFINITY, f64::min),
            ReduceOp::Max => vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
            ReduceOp::Product => vals.iter().product(),
        }
    }
}

macro_rules! int_num {
    ($t:ty) => {
        impl Num for $t {
            fn from_i(v: i64) -> Self {
                v as $t
            }
            fn to_f(self) -> f64 {
                self as f64
            }
            fn reduce(vals: &[Self], op: ReduceOp) -> Self {
                let mut acc = vals[0];
                for &v in &vals[1..] {
                    acc = match op {
                        ReduceOp::Sum | ReduceOp::Avg => acc.wrapping_add(v),
                        ReduceOp::Product => acc.wrapping_mul(v),
                        ReduceOp::Min => acc.min(v),
                        ReduceOp::Max => acc.max(v),
                    };
                }
                if op == ReduceOp::Avg {
                    acc / vals.len() as $t
                } else {
                    acc
                }
            }
        }
    };
}
int_num!(i32);
int_num!(i64);
int_num!(u8);

/// Rank `rank`'s input for case `case`: small integers (products stay small too).
pub fn input<T: Num>(case: u64, rank: usize, n: usize, op: ReduceOp) -> Vec<T> {
    let mut rng = StdRng::seed_from_u64(case * 1000 + rank as u64);
    (0..n)
        .map(|_| {
            let v: i64 = match op {
                ReduceOp::Product => [1, 2, 1, 1][rng.gen_range(0..4)],
                _ if T::DTYPE == ddp_comm::DType::U8 => rng.gen_range(0..40),
                _ => rng.gen_range(-8..=8),
            };
            T::from_i(v)
        })
        .collect()
}

pub fn reference<T: Num>(case: u64, world: usize, n: usize, op: ReduceOp) -> Vec<T> {
    let all: Vec<Vec<T>> = (0..world).map(|r| input(case, r, n, op)).collect();
    (0..n)
        .map(|i| T::reduce(&all.iter().map(|v| v[i]).collect::<Vec<_>>(), op))
        .collect()
}

pub fn assert_same<T: Num>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i].to_f().to_bits() != want[i].to_f().to_bits()) {
        panic!("{what}: element {i}: got {:?}, want {:?}", got[i], want[i]);
    }
}

/// All-reduces (sum, avg, product) of random floats of every float dtype, sizes 1000 and
/// 300003, different on every rank; returns the bit patterns of the results, which must be
/// the same on every rank ([`assert_bit_identical`]).
pub fn random_float_all_reduces(pg: &ProcessGroup) -> Vec<Vec<u64>> {
    let mut rng = StdRng::seed_from_u64(pg.rank() as u64 + 1);
    let mut res = Vec::new();
    for n in [1000, 300_003] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product] {
            let mut v: Vec<f32> = (0..n).map(|_| rng.gen::<f32>() * 10.0 - 5.0).collect();
            pg.all_reduce(&mut v, op).unwrap();
            res.push(v.iter().map(|x| x.to_bits() as u64).collect::<Vec<_>>());
            let mut h: Vec<bf16> = (0..n)
                .map(|_| bf16::from_f32(rng.gen::<f32>() * 3.0))
                .collect();
            pg.all_reduce(&mut h, op).unwrap();
            res.push(h.iter().map(|x| x.to_bits() as u64).collect());
            let mut g: Vec<f16> = (0..n).map(|_| f16::from_f32(rng.gen::<f32>())).collect();
            pg.all_reduce(&mut g, op).unwrap();
            res.push(g.iter().map(|x| x.to_bits() as u64).collect());
            let d: Vec<f64> = (0..n).map(|_| rng.gen::<f64>()).collect();
            let d = pg.all_reduce_async(d, op).wait().unwrap();
            res.push(d.iter().map(|x| x.to_bits()).collect());
        }
    }
    res
}

/// Every rank's results (`out[rank]`) equal rank 0's; `what` names the setting in the message.
pub fn assert_bit_identical(out: &[Vec<Vec<u64>>], what: &str) {
    for r in 1..out.len() {
        for (k, (a, b)) in out[r].iter().zip(&out[0]).enumerate() {
            assert!(a == b, "{what}: rank {r} differs from rank 0 in case {k}");
        }
    }
}

/// Every collective of every dtype on `pg` against the reference (random sizes from `seed`,
/// the first dtype with a ≥ 4 MiB case), then the serialized-object collectives.
pub fn check_every_collective(pg: &ProcessGroup, seed: u64) {
    check_all::<f32>(pg, seed, &sizes(seed, true));
    check_all::<f64>(pg, seed + 1, &sizes(seed + 1, false));
    check_all::<f16>(pg, seed + 2, &sizes(seed + 2, false));
    check_all::<bf16>(pg, seed + 3, &sizes(seed + 3, false));
    check_all::<i32>(pg, seed + 4, &sizes(seed + 4, false));
    check_all::<i64>(pg, seed + 5, &sizes(seed + 5, false));
    check_all::<u8>(pg, seed + 6, &sizes(seed + 6, false));
    // serialized objects of random, rank-dependent lengths
    let mut rng = StdRng::seed_from_u64(pg.rank() as u64 + seed);
    let mine: Vec<u8> = (0..rng.gen_range(0..3000)).map(|_| rng.gen()).collect();
    let all = pg.all_gather_bytes(&mine).unwrap();
    assert_eq!(all[pg.rank()], mine);
    let root = pg.size() - 1;
    assert_eq!(pg.broadcast_bytes(&mine, root).unwrap(), all[root]);
}

/// Run every collective of `T` on `g` for the sizes in `sizes`, checking each against the
/// reference through the library's [`Collectives`] trait: blocking and async forms (alternating
/// by size case); gather, scatter and all_to_all where `g` is a host [`ProcessGroup`].
pub fn check_all<T: Num>(g: &(impl Collectives<T> + 'static), seed: u64, sizes: &[usize]) {
    let (rank, world) = (g.rank(), g.size());
    let v = api::Vecs(g);
    let mut rng = StdRng::seed_from_u64(seed); // same sequence on every rank
    for (k, &n) in sizes.iter().enumerate() {
        let case = seed * 100 + k as u64;
        let dt = T::DTYPE;
        // Large messages: one op, and per-rank blocks of n / world, to bound the test's time.
        let large = n > 100_000;
        let ops: &[ReduceOp] = if large { &[ReduceOp::Sum] } else { &OPS };
        let blk = if large { n / world } else { n };
        // The blocking form for even cases, the async one for odd (all_reduce: both, always).
        let asy = k % 2 == 1;
        for &op in ops {
            let how = format!("{dt} {op} n={n} world={world} async={asy}");
            let want = reference(case, world, n, op);
            for a in [false, true] {
                let got = v.all_reduce(input::<T>(case, rank, n, op), op, a);
                assert_same(&format!("all_reduce {how} (async={a})"), &got, &want);
            }
            // reduce to a random root
            let root = rng.gen_range(0..world);
            let got = v.reduce(input::<T>(case, rank, n, op), op, root, asy);
            if rank == root {
                assert_same(&format!("reduce {how} root={root}"), &got, &want);
            } else {
                let mine = input::<T>(case, rank, n, op);
                assert_same("reduce leaves non-root input unchanged", &got, &mine);
            }
            // reduce_scatter: rank r gets block r of the reduction
            let full: Vec<T> = input(case, rank, blk * world, op);
            let got = v.reduce_scatter(full, op, asy);
            let want = reference::<T>(case, world, blk * world, op);
            assert_same(
                &format!("reduce_scatter {how} blk={blk}"),
                &got,
                &want[rank * blk..(rank + 1) * blk],
            );
        }
        let op = ReduceOp::Sum;
        let mine = input::<T>(case, rank, blk, op);
        let want_all: Vec<T> = (0..world)
            .flat_map(|r| input::<T>(case, r, blk, op))
            .collect();
        let root = rng.gen_range(0..world);
        // broadcast
        let got = v.broadcast(input::<T>(case, rank, n, op), root, asy);
        let want = input::<T>(case, root, n, op);
        assert_same(
            &format!("broadcast {dt} n={n} root={root} async={asy}"),
            &got,
            &want,
        );
        // all_gather
        let got = v.all_gather(mine.clone(), asy);
        assert_same(
            &format!("all_gather {dt} n={blk} async={asy}"),
            &got,
            &want_all,
        );
        if let Some(pg) = (g as &dyn std::any::Any).downcast_ref::<ProcessGroup>() {
            check_host_only::<T>(pg, case, blk, root, &mine, &want_all);
        }
        // send / recv around the ring (even ranks send first, odd ranks receive first)
        if world > 1 {
            let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
            let mine = input::<T>(case, rank, n, op);
            let got = if rank % 2 == 0 {
                v.send(mine, next);
                v.recv(n, prev)
            } else {
                let got = v.recv(n, prev);
                v.send(mine, next);
                got
            };
            assert_same(
                &format!("send/recv {dt} n={n}"),
                &got,
                &input::<T>(case, prev, n, op),
            );
        }
        v.barrier::<T>();
    }
}

/// gather, scatter, all_to_all and the in-place all_gather / reduce_scatter (host groups only)
/// against the reference.
fn check_host_only<T: Num>(
    pg: &ProcessGroup,
    case: u64,
    blk: usize,
    root: usize,
    mine: &[T],
    want: &[T],
) {
    let (rank, world, dt, op) = (pg.rank(), pg.size(), T::DTYPE, ReduceOp::Sum);
    // gather
    let mut out = vec![T::from_i(0); blk * world];
    pg.gather(mine, (rank == root).then_some(&mut out[..]), root)
        .unwrap();
    if rank == root {
        assert_same(&format!("gather {dt} n={blk}"), &out, want);
    }
    // scatter: root's input is everyone's blocks
    let mut out = vec![T::from_i(0); blk];
    let all_in: Vec<T> = input(case + 7, root, blk * world, op);
    pg.scatter((rank == root).then_some(&all_in[..]), &mut out, root)
        .unwrap();
    assert_same(
        &format!("scatter {dt} n={blk}"),
        &out,
        &input::<T>(case + 7, root, blk * world, op)[rank * blk..(rank + 1) * blk],
    );
    // all_to_all: block j of rank i goes to rank j's block i
    let send: Vec<T> = input(case + 9, rank, blk * world, op);
    let mut recv = vec![T::from_i(0); blk * world];
    pg.all_to_all(&send, &mut recv).unwrap();
    let want_a2a: Vec<T> = (0..world)
        .flat_map(|i| {
            input::<T>(case + 9, i, blk * world, op)[rank * blk..(rank + 1) * blk].to_vec()
        })
        .collect();
    assert_same(&format!("all_to_all {dt} n={blk}"), &recv, &want_a2a);
    // in place: all_gather with this rank's block already in the output, reduce_scatter into
    // this rank's block of the input (blocking for even cases, async for odd)
    let asy = case % 2 == 1;
    let mut buf = vec![T::from_i(0); blk * world];
    buf[rank * blk..(rank + 1) * blk].copy_from_slice(mine);
    let buf = if asy {
        pg.all_gather_in_place_async(buf).wait().unwrap()
    } else {
        pg.all_gather_in_place(&mut buf).unwrap();
        buf
    };
    assert_same(
        &format!("all_gather_in_place {dt} n={blk} async={asy}"),
        &buf,
        want,
    );
    // in place, placed by the caller: random pieces (crossing blocks, this rank's own among
    // them) read in random order into a separate output
    let mut buf = vec![T::from_i(0); blk * world];
    buf[rank * blk..(rank + 1) * blk].copy_from_slice(mine);
    let mut rng = StdRng::seed_from_u64(case * 7 + rank as u64);
    let total = blk * world;
    let mut cuts = vec![0];
    while *cuts.last().unwrap() < total {
        let at = *cuts.last().unwrap();
        cuts.push((at + rng.gen_range(1..=(total / 3).max(1))).min(total));
    }
    let mut pieces: Vec<(usize, usize)> = cuts.windows(2).map(|w| (w[0], w[1])).collect();
    pieces.shuffle(&mut rng);
    let mut placed = vec![T::from_i(0); total];
    pg.all_gather_in_place_to(&mut buf, &mut |read| {
        for &(a, b) in &pieces {
            read(a, &mut placed[a..b])?;
        }
        Ok(())
    })
    .unwrap();
    let what = format!("all_gather_in_place_to {dt} n={blk} world={world}");
    assert_same(&what, &placed, want);
    assert_same(&what, &buf[rank * blk..(rank + 1) * blk], mine);
    let ops: &[ReduceOp] = if blk * world > 100_000 {
        &[ReduceOp::Sum]
    } else {
        &OPS
    };
    for &op in ops {
        let mut buf: Vec<T> = input(case + 11, rank, blk * world, op);
        let buf = if asy {
            pg.reduce_scatter_in_place_async(buf, op).wait().unwrap()
        } else {
            pg.reduce_scatter_in_place(&mut buf, op).unwrap();
            buf
        };
        let want = reference::<T>(case + 11, world, blk * world, op);
        assert_same(
            &format!("reduce_scatter_in_place {dt} {op} n={blk} world={world} async={asy}"),
            &buf[rank * blk..(rank + 1) * blk],
            &want[rank * blk..(rank + 1) * blk],
        );
        // The shard alone, in the input's memory, its allocation cut to the block.
        let shard = pg
            .reduce_scatter_shard_async(input(case + 11, rank, blk * world, op), op)
            .wait()
            .unwrap();
        let what = format!("reduce_scatter_shard {dt} {op} n={blk} world={world}");
        assert_same(&what, &shard, &want[rank * blk..(rank + 1) * blk]);
        assert_eq!(shard.capacity(), blk, "{what}: capacity");
    }
    // a buffer that is not one block per rank is refused locally
    if world > 1 {
        let mut odd = vec![T::from_i(0); world + 1];
        let err = pg.all_gather_in_place(&mut odd).unwrap_err().to_string();
        assert!(err.contains("not") && err.contains("blocks"), "{err}");
        let err = pg
            .reduce_scatter_in_place_async(odd.clone(), ReduceOp::Sum)
            .wait()
            .unwrap_err()
            .to_string();
        assert!(err.contains("equal blocks"), "{err}");
        let err = pg
            .reduce_scatter_shard_async(odd, ReduceOp::Sum)
            .wait()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("reduce_scatter_shard") && err.contains("equal blocks"),
            "{err}"
        );
    }
}

pub fn sizes(seed: u64, large: bool) -> Vec<usize> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut s = vec![
        0,
        1,
        7,
        rng.gen_range(2..200) * 2 + 1,
        rng.gen_range(1000..70_000),
    ];
    if large {
        s.push((4 << 20) / 4 + 3); // ≥ 4 MiB of f32, odd
    }
    s
}

// ----- worker processes ---------------------------------------------------------------------

/// A TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills the listed processes when dropped, so a failing test leaves no worker running.
pub struct KillOnDrop(pub Vec<u32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for &pid in &self.0 {
            // SAFETY: plain kill(2) on a pid we spawned; harmless if it already exited.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// A [`KillOnDrop`] for `children`.
pub fn guard(children: &[Child]) -> KillOnDrop {
    KillOnDrop(children.iter().map(|c| c.id()).collect())
}

/// Start ranks `ranks` of a `world`-rank job as worker processes: this test binary re-executed
/// on its ignored `worker` test, with the torchrun environment, `DDP_BACKEND=backend`,
/// `DDP_TEST_MODE=mode` and `extra`.
pub fn spawn_workers(
    backend: &str,
    world: usize,
    ranks: std::ops::Range<usize>,
    mode: &str,
    extra: &[(&str, String)],
) -> Vec<Child> {
    let port = free_port().to_string();
    ranks
        .map(|rank| {
            let mut cmd = Command::new(std::env::current_exe().unwrap());
            cmd.args([
                "worker",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .env("DDP_BACKEND", backend)
            .env("DDP_TEST_MODE", mode)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
            for (k, v) in extra {
                cmd.env(k, v);
            }
            cmd.spawn().unwrap()
        })
        .collect()
}

/// Wait for `child` at most until `deadline`; kill it if it is still running then.
pub fn finish(mut child: Child, deadline: Instant) -> (Option<i32>, String) {
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut out = String::new();
            child.stdout.take().unwrap().read_to_string(&mut out).ok();
            child.stderr.take().unwrap().read_to_string(&mut out).ok();
            return (status.code(), out);
        }
        if Instant::now() > deadline {
            child.kill().ok();
            child.wait().ok();
            return (None, "<killed: still running at the deadline>".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Start `world` workers in mode `loop` (each prints `READY` after its first all-reduce, then
/// all-reduces until one fails: it prints `ERROR: ...` and exits 3), SIGKILL `victim` once
/// every worker is ready, and check that every survivor exits 3 within 10 s with an error naming
/// `rank {victim}` and `all_reduce`. Returns the workers' pids.
pub fn kill_one_mid_loop(
    backend: &str,
    world: usize,
    victim: usize,
    env: &[(&str, String)],
) -> Vec<u32> {
    let mut children = spawn_workers(backend, world, 0..world, "loop", env);
    let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
    let _guard = guard(&children);
    let mut readers = Vec::new();
    for c in children.iter_mut() {
        let mut lines = BufReader::new(c.stdout.take().unwrap()).lines();
        // Skip the test harness's own lines ("running 1 test", ...).
        assert!(
            lines
                .by_ref()
                .take(10)
                .any(|l| l.is_ok_and(|l| l.ends_with("READY"))),
            "a worker never became ready"
        );
        readers.push(lines);
    }
    let killed_at = Instant::now();
    children[victim].kill().unwrap();
    children[victim].wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    for (rank, (mut child, lines)) in children.into_iter().zip(readers).enumerate() {
        if rank == victim {
            continue;
        }
        let code = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s.code();
            }
            assert!(
                Instant::now() < deadline,
                "rank {rank} hangs after its peer {victim} died"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        // stdout was taken for the READY line; the rest comes from the line iterator.
        let out = lines.map_while(|l| l.ok()).collect::<Vec<_>>().join("\n");
        assert_eq!(code, Some(3), "rank {rank}: {out}");
        assert!(
            out.contains(&format!("rank {victim}")),
            "rank {rank} does not name rank {victim}: {out}"
        );
        assert!(
            out.contains("all_reduce"),
            "rank {rank} does not name the collective: {out}"
        );
    }
    assert!(
        killed_at.elapsed() < Duration::from_secs(10),
        "detection took {:?}",
        killed_at.elapsed()
    );
    pids
}

/// Three workers of `backend` in mode `stall` (rank 1 sleeps 20 s before an all-reduce the
/// others have entered) with a 3 s timeout: ranks 0 and 2 must exit 3 within 15 s naming rank 1.
pub fn stalled_rank_1_times_out_naming_it(backend: &str) {
    let start = Instant::now();
    let deadline = start + Duration::from_secs(40);
    let env = [("DDP_TEST_TIMEOUT", "3".to_string())];
    let children = spawn_workers(backend, 3, 0..3, "stall", &env);
    let _guard = guard(&children);
    for (rank, child) in children.into_iter().enumerate() {
        let (code, out) = finish(child, if rank == 1 { Instant::now() } else { deadline });
        if rank == 1 {
            continue; // still asleep: killed
        }
        assert_eq!(code, Some(3), "rank {rank}: {out}");
        assert!(
            out.contains("rank 1"),
            "rank {rank} must name the stalled rank 1: {out}"
        );
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "took {:?}",
            start.elapsed()
        );
    }
}

/// `world` workers of `backend` in `mode`: every one must exit 3 (a failed collective) with
/// output containing each of `must_contain`, within 40 s.
pub fn expect_all_fail(backend: &str, mode: &str, world: usize, must_contain: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(40);
    let children = spawn_workers(backend, world, 0..world, mode, &[]);
    let _guard = guard(&children);
    for (rank, child) in children.into_iter().enumerate() {
        let (code, out) = finish(child, deadline);
        assert_eq!(code, Some(3), "{mode}: rank {rank}: {out}");
        for s in must_contain {
            assert!(
                out.contains(s),
                "{mode}: rank {rank} must mention {s:?}: {out}"
            );
        }
    }
}

/// Worker side: log `tracing` events (warnings and up, unless `RUST_LOG` says otherwise) to
/// stderr without colours, so that tests can read them.
pub fn log_to_stderr() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
}

/// Worker side of [`stalled_rank_1_is_warned_about`]: an all-reduce (#0), then rank 1 sleeps
/// 4 s before the next one (#1); prints `OK` when both completed.
pub fn stall_warn_mode(pg: &ProcessGroup) {
    let mut buf = vec![1i64; 100];
    pg.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    if pg.rank() == 1 {
        std::thread::sleep(Duration::from_secs(4));
    }
    pg.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
    println!("OK");
}

/// Two workers of `backend` in mode `stall_warn` with `DDP_WARN_AFTER_SECS=1`: while rank 1
/// sleeps, rank 0 must log (more than once) a warning naming the collective, its sequence
/// number and rank 1; then both finish.
pub fn stalled_rank_1_is_warned_about(backend: &str) {
    let deadline = Instant::now() + Duration::from_secs(40);
    let env = [("DDP_WARN_AFTER_SECS", "1".to_string())];
    let children = spawn_workers(backend, 2, 0..2, "stall_warn", &env);
    let _guard = guard(&children);
    let outs: Vec<_> = children.into_iter().map(|c| finish(c, deadline)).collect();
    for (rank, (code, out)) in outs.iter().enumerate() {
        assert_eq!(*code, Some(0), "rank {rank}: {out}");
        assert!(out.contains("OK"), "rank {rank}: {out}");
    }
    let out = &outs[0].1;
    let warnings: Vec<&str> = out
        .lines()
        .filter(|l| l.contains("still waiting"))
        .collect();
    assert!(warnings.len() >= 2, "rank 0 must warn, and repeat: {out}");
    for w in &warnings {
        assert!(
            w.contains("WARN")
                && w.contains("all_reduce(sum, i64 x 100) #1 on rank 0")
                && w.contains("rank(s) [1]"),
            "the warning must name the collective, its sequence number and rank 1: {w}"
        );
    }
}

// ----- GPU tests ----------------------------------------------------------------------------

/// Env var that turns a GPU test's skip for want of a GPU or its libraries into a failure;
/// `scripts/gpu-check` sets it on the GPU machine. (Tests that need more GPUs than there are
/// still skip, saying how many they need.)
pub const REQUIRE_GPU: &str = "DDP_TEST_REQUIRE_GPU";

/// Call when GPU test `test` cannot run here for `reason`, then return from the test: prints
/// `SKIPPED test: reason` (shown by nextest, so a skip never reads as a pass); panics instead
/// when [`REQUIRE_GPU`]` = 1` and `fatal` (no GPU or no library, as opposed to too few GPUs).
pub fn skip_gpu(test: &str, reason: &str, fatal: bool) {
    if fatal && std::env::var(REQUIRE_GPU).is_ok_and(|v| v == "1") {
        panic!("{test} cannot run: {reason} ({REQUIRE_GPU}=1)");
    }
    // Past the harness's output capture, so that `cargo test` shows the skip too.
    let _ = std::io::Write::write_all(
        &mut std::io::stderr().lock(),
        format!("SKIPPED {test}: {reason}\n").as_bytes(),
    );
}
