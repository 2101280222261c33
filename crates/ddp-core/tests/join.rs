//! `Join` with deliberately uneven shards, real collectives among threads (one TCP process group
//! per rank): a tiny linear regression trained with plain f32 SGD must finish (no hang) with
//! bit-identical parameters, and each step's gradient must be the mean over the active ranks.

use ddp_comm::testing::{run_local_group, LocalGroup};
use ddp_comm::{DType, ProcessGroup};
use ddp_core::reducer::{broadcast_coalesced, ParamSpec, Reducer, ReducerOptions};
use ddp_core::{verify_replicas, Join, JoinStart, JoinStep};
use std::time::{Duration, Instant};

/// Collective timeout: a missing shadow collective fails a test within this bound.
const TIMEOUT: Duration = Duration::from_secs(20);

/// Runs `f(pg)` on `world` threads, each with its own TCP process group; results by rank.
fn run_ranks<R: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(ProcessGroup) -> R + Sync,
) -> Vec<R> {
    run_local_group(
        world,
        LocalGroup {
            timeout,
            ..Default::default()
        },
        f,
    )
}

// ---- the model: y = w·x + b, MSE loss --------------------------------------------------------

const D: usize = 3;
const BATCH: usize = 4;
const LR: f32 = 0.05;

/// Parameters in registration order (sorted by name): `bias` [1], `weight` [D].
type Params = Vec<Vec<f32>>;

fn specs() -> Vec<ParamSpec> {
    vec![
        ParamSpec::new("bias", vec![1], DType::F32),
        ParamSpec::new("weight", vec![D], DType::F32),
    ]
}

/// One bucket per parameter, so every step issues several all-reduces that must line up.
fn opts() -> ReducerOptions {
    ReducerOptions {
        bucket_cap_mb: 1e-9,
        first_bucket_cap_mb: 1e-9,
    }
}

fn sample(i: usize) -> ([f32; D], f32) {
    let t = i as f32;
    let x = [
        (t * 0.7).sin(),
        (t * 1.3).cos(),
        ((i % 5) as f32 - 2.0) * 0.3,
    ];
    let y = 1.5 * x[0] - 2.0 * x[1] + 0.5 * x[2] + 0.25 + 0.01 * (t * 2.9).sin();
    (x, y)
}

/// Sample indices of batch `k` of rank `r` (shards disjoint by construction).
fn batch(r: usize, k: usize) -> Vec<usize> {
    (0..BATCH).map(|j| r * 1000 + k * BATCH + j).collect()
}

/// Gradient of the mean squared error over `batch`, as [d bias, d weight].
fn local_grad(p: &Params, batch: &[usize]) -> Params {
    let mut g = vec![vec![0.0f32; 1], vec![0.0f32; D]];
    for &i in batch {
        let (x, y) = sample(i);
        let pred = p[0][0] + (0..D).map(|d| p[1][d] * x[d]).sum::<f32>();
        let e = 2.0 * (pred - y) / batch.len() as f32;
        g[0][0] += e;
        for d in 0..D {
            g[1][d] += e * x[d];
        }
    }
    g
}

fn sgd(p: &mut Params, g: &[&[f32]]) {
    for (pi, gi) in p.iter_mut().zip(g) {
        for (w, d) in pi.iter_mut().zip(gi.iter()) {
            *w -= LR * d;
        }
    }
}

/// Rank-dependent initial values (replicas start different; rank 0's are broadcast).
fn init(rank: usize) -> Params {
    let v = |k: usize| ((rank * 7 + k) as f32 * 0.37).sin();
    vec![vec![v(0)], (1..=D).map(v).collect()]
}

/// Single-process reference: at each step, the mean of the gradients of the ranks that still
/// have batches (or their sum over the world size), then SGD. Returns final parameters and the
/// gradient of every step.
fn reference(counts: &[usize], divide_by_world: bool) -> (Params, Vec<Params>) {
    let mut p = init(0);
    let mut grads = Vec::new();
    let steps = counts.iter().copied().max().unwrap_or(0);
    for s in 0..steps {
        let active: Vec<usize> = (0..counts.len()).filter(|&r| s < counts[r]).collect();
        let mut sum = [vec![0.0f64; 1], vec![0.0f64; D]];
        for &r in &active {
            for (si, gi) in sum.iter_mut().zip(local_grad(&p, &batch(r, s))) {
                for (a, b) in si.iter_mut().zip(gi) {
                    *a += b as f64;
                }
            }
        }
        let div = if divide_by_world {
            counts.len()
        } else {
            active.len()
        } as f64;
        let g: Params = sum
            .iter()
            .map(|v| v.iter().map(|&x| (x / div) as f32).collect())
            .collect();
        sgd(&mut p, &[&g[0], &g[1]]);
        grads.push(g);
    }
    (p, grads)
}

fn assert_close(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (k, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "{what}[{k}]: got {a}, want {b}"
        );
    }
}

#[derive(Clone)]
struct Replica {
    params: Params,
    /// (step, averaged gradient) as seen by this rank.
    log: Vec<(JoinStep, Params)>,
}

/// One rank's Join loop over `counts[rank]` batches, through the `Join::run` driver.
fn train_with_driver(pg: &ProcessGroup, join: &mut Join, counts: &[usize]) -> (Replica, u64, u64) {
    let rank = pg.rank();
    let mut red = Reducer::new(pg, specs(), opts()).unwrap();
    assert_eq!(red.buckets().len(), 2);
    let mut rep = Replica {
        params: init(rank),
        log: Vec::new(),
    };
    {
        let (b, w) = rep.params.split_at_mut(1);
        broadcast_coalesced(pg, &mut [&mut b[0][..], &mut w[0][..]], 0).unwrap();
    }
    let batches = (0..counts[rank]).map(|k| batch(rank, k));
    let summary = join
        .run(
            &mut red,
            &mut rep,
            batches,
            |rep, red, b| {
                let g = local_grad(&rep.params, &b);
                red.mark_ready(1, &g[1])?; // backward order: last parameter first
                red.mark_ready(0, &g[0])
            },
            |rep, red, step| -> ddp_core::Result<()> {
                let g = [red.grad::<f32>(0)?, red.grad::<f32>(1)?];
                rep.log
                    .push((step.clone(), g.iter().map(|s| s.to_vec()).collect()));
                sgd(&mut rep.params, &g);
                Ok(())
            },
        )
        .unwrap();
    (rep, summary.steps, summary.own_steps)
}

fn check_against_reference(reps: &[Replica], counts: &[usize], divide_by_world: bool) {
    let (want_params, want_grads) = reference(counts, divide_by_world);
    let steps = counts.iter().copied().max().unwrap();
    for (r, rep) in reps.iter().enumerate() {
        assert_eq!(rep.log.len(), steps, "rank {r} ran every step");
        for (s, (step, g)) in rep.log.iter().enumerate() {
            let active: Vec<usize> = (0..counts.len()).filter(|&q| s < counts[q]).collect();
            assert_eq!(step.index, s as u64);
            assert_eq!(step.has_data, s < counts[r], "rank {r} step {s}");
            assert_eq!(step.active_ranks, active, "rank {r} step {s}");
            let div = if divide_by_world {
                counts.len()
            } else {
                active.len()
            };
            assert_eq!(step.divisor, div);
            assert_close(
                &format!("rank {r} step {s} d bias"),
                &g[0],
                &want_grads[s][0],
            );
            assert_close(
                &format!("rank {r} step {s} d weight"),
                &g[1],
                &want_grads[s][1],
            );
        }
        assert_close(&format!("rank {r} bias"), &rep.params[0], &want_params[0]);
        assert_close(&format!("rank {r} weight"), &rep.params[1], &want_params[1]);
    }
    for (r, rep) in reps.iter().enumerate().skip(1) {
        for (a, b) in rep
            .params
            .iter()
            .flatten()
            .zip(reps[0].params.iter().flatten())
        {
            assert_eq!(a.to_bits(), b.to_bits(), "rank {r} differs from rank 0");
        }
        for ((_, a), (_, b)) in rep.log.iter().zip(&reps[0].log) {
            assert_eq!(a, b, "rank {r}: averaged gradients identical on every rank");
        }
    }
}

#[test]
fn two_ranks_3_vs_7_batches_then_7_vs_3_reusing_the_join() {
    let t0 = Instant::now();
    let out = run_ranks(2, TIMEOUT, |pg| {
        let mut join = Join::new(&pg);
        let mut epochs = Vec::new();
        for counts in [[3, 7], [7, 3]] {
            let (rep, steps, own) = train_with_driver(&pg, &mut join, &counts);
            assert_eq!((steps, own), (7, counts[pg.rank()] as u64));
            let longest = if counts[1] > counts[0] { 1 } else { 0 };
            assert_eq!(join.authoritative_rank(), Some(longest));
            let report = verify_replicas(&pg, &[&rep.params[0], &rep.params[1]]).unwrap();
            assert!(report.identical, "{report}");
            epochs.push(rep);
        }
        epochs
    });
    assert!(
        t0.elapsed() < TIMEOUT,
        "finished well within the collective timeout"
    );
    for (e, counts) in [[3, 7], [7, 3]].iter().enumerate() {
        let reps: Vec<Replica> = out.iter().map(|ep| ep[e].clone()).collect();
        check_against_reference(&reps, counts, false);
    }
}

#[test]
fn three_ranks_0_2_5_batches_with_the_manual_protocol() {
    let counts = [0usize, 2, 5];
    let out = run_ranks(3, TIMEOUT, move |pg| {
        let rank = pg.rank();
        let mut red = Reducer::new(&pg, specs(), opts()).unwrap();
        let mut p = init(rank);
        {
            let (b, w) = p.split_at_mut(1);
            broadcast_coalesced(&pg, &mut [&mut b[0][..], &mut w[0][..]], 0).unwrap();
        }
        let mut join = Join::new(&pg);
        let mut log = Vec::new();
        let mut k = 0;
        while let Some(step) = join.begin_step(k < counts[rank]).unwrap() {
            red.set_divisor(step.divisor).unwrap();
            if step.has_data {
                let g = local_grad(&p, &batch(rank, k));
                red.mark_ready(0, &g[0]).unwrap();
                red.mark_ready(1, &g[1]).unwrap();
                k += 1;
            } // else: nothing to do here; sync_gradients below is the shadow
            let stats = join.sync_gradients(&mut red, &step).unwrap();
            assert!(stats.synced && stats.buckets == 2);
            let g = [red.grad::<f32>(0).unwrap(), red.grad::<f32>(1).unwrap()];
            log.push((step, g.iter().map(|s| s.to_vec()).collect()));
            sgd(&mut p, &g);
        }
        assert!(join.is_done());
        let s = join.summary();
        assert_eq!((s.steps, s.own_steps), (5, counts[rank] as u64));
        assert_eq!(s.last_active_ranks, vec![2]);
        assert_eq!(join.authoritative_rank(), Some(2));
        let e = join.begin_step(false).unwrap_err().to_string();
        assert!(e.contains("ran out of data"), "{e}");

        // A joined rank that skipped updates is repaired by sync_params from rank 2.
        let clean = p.clone();
        if rank < 2 {
            p[1][0] += 1.0;
        }
        let before = verify_replicas(&pg, &[&p[0], &p[1]]).unwrap();
        let (b, w) = p.split_at_mut(1);
        join.sync_params(&mut [&mut b[0][..], &mut w[0][..]])
            .unwrap();
        assert_eq!(p, clean);
        (Replica { params: p, log }, before)
    });
    let before = &out[0].1;
    assert!(!before.identical);
    assert_eq!(before.first_differing, Some((1, 0)));
    assert_eq!(before.differing_ranks, vec![2]); // ranks 0 and 1 agree with each other
    let reps: Vec<Replica> = out.into_iter().map(|(r, _)| r).collect();
    check_against_reference(&reps, &counts, false);
}

#[test]
fn divide_by_initial_world_size_counts_joined_ranks_as_zeros() {
    let counts = [1usize, 3];
    let out = run_ranks(2, TIMEOUT, move |pg| {
        let mut join = Join::new(&pg).divide_by_initial_world_size(true);
        train_with_driver(&pg, &mut join, &counts).0
    });
    check_against_reference(&out, &counts, true);
}

#[test]
fn no_rank_with_data_ends_at_once() {
    let out = run_ranks(3, TIMEOUT, |pg| {
        let mut join = Join::new(&pg);
        let first = join.begin_step(false).unwrap();
        let mut p = [pg.rank() as f32; 3];
        join.sync_params(&mut [&mut p[..]]).unwrap(); // no step ran: nothing to sync from
        (first.is_none(), join.summary().steps, p[0])
    });
    for (r, (ended, steps, p)) in out.into_iter().enumerate() {
        assert!(ended && steps == 0);
        assert_eq!(p, r as f32);
    }
}

/// The failure mode Join removes: with plain `finish`, the rank with more batches is left alone
/// in its all-reduce and fails (instead of finishing) once its peer has left.
#[test]
fn without_join_the_longer_rank_fails() {
    let t0 = Instant::now();
    let out = run_ranks(2, Duration::from_secs(5), |pg| {
        let rank = pg.rank();
        let mut red = Reducer::new(&pg, specs(), opts()).unwrap();
        let p = init(0);
        for k in 0..[1, 2][rank] {
            let g = local_grad(&p, &batch(rank, k));
            red.mark_ready(0, &g[0]).unwrap();
            red.mark_ready(1, &g[1]).unwrap();
            if let Err(e) = red.finish() {
                return Some(e.to_string());
            }
        }
        None
    });
    assert!(out[0].is_none());
    let e = out[1]
        .as_ref()
        .expect("the longer rank cannot complete its second step");
    assert!(e.contains("rank 0"), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(15));
}

#[test]
fn a_divisor_set_after_buckets_launched_is_a_clear_error_and_the_next_step_works() {
    let out = run_ranks(2, TIMEOUT, move |pg| {
        let rank = pg.rank();
        let mut red = Reducer::new(&pg, specs(), opts()).unwrap();
        let p = init(0);
        let g = local_grad(&p, &batch(rank, 0));
        // Both buckets launch (averaged over 2 ranks) as soon as their gradient is marked.
        red.mark_ready(0, &g[0]).unwrap();
        red.mark_ready(1, &g[1]).unwrap();
        let e = red.finish_with_divisor(1).unwrap_err().to_string();
        assert!(e.contains("set_divisor(1)"), "{e}");
        assert!(red.grad::<f32>(0).is_err());
        // The step completed on both ranks: the next one is in step.
        red.set_divisor(1).unwrap();
        red.mark_ready(0, &g[0]).unwrap();
        red.mark_ready(1, &g[1]).unwrap();
        red.finish_with_divisor(1).unwrap();
        red.grad::<f32>(0).unwrap().to_vec()
    });
    let sum: Vec<f32> = {
        let p = init(0);
        let (g0, g1) = (local_grad(&p, &batch(0, 0)), local_grad(&p, &batch(1, 0)));
        g0[0].iter().zip(&g1[0]).map(|(a, b)| a + b).collect()
    };
    assert_eq!(out[0], out[1]);
    assert_eq!(out[0], sum);
}

#[test]
fn a_stop_asked_by_any_rank_ends_the_loop_on_every_rank_at_the_same_step() {
    // Three ranks with 2, 6 and 6 batches; rank 2 asks to stop at its 4th step (index 3), when
    // rank 0 is already out of data: the stop wins over running on, on every rank alike.
    let counts = [2usize, 6, 6];
    let out = run_ranks(3, TIMEOUT, move |pg| {
        let rank = pg.rank();
        let mut join = Join::new(&pg);
        let mut seen = Vec::new();
        let mut k = 0;
        let end = loop {
            let stop = rank == 2 && k == 3;
            match join.begin_step_or_stop(k < counts[rank], stop).unwrap() {
                JoinStart::Step(step) => {
                    seen.push((step.index, step.active_ranks.clone()));
                    k += step.has_data as usize;
                }
                other => break other,
            }
        };
        assert!(join.is_done());
        let again = join.begin_step(true).unwrap_err().to_string();
        assert!(again.contains("asked to stop"), "{again}");
        // After reset the same Join runs a new loop; two ranks asking at once are both named.
        join.reset();
        let both = join.begin_step_or_stop(true, rank != 1).unwrap();
        (end, seen, join.summary().steps, both)
    });
    for (rank, (end, seen, steps, both)) in out.iter().enumerate() {
        assert_eq!(end, &JoinStart::Stopped { ranks: vec![2] }, "rank {rank}");
        let want: Vec<(u64, Vec<usize>)> =
            vec![(0, vec![0, 1, 2]), (1, vec![0, 1, 2]), (2, vec![1, 2])];
        assert_eq!(seen, &want, "rank {rank}");
        assert_eq!(*steps, 0, "rank {rank}: a stop is not a step");
        assert_eq!(
            both,
            &JoinStart::Stopped { ranks: vec![0, 2] },
            "rank {rank}"
        );
    }
}

/// `rank0_decides`: rank 0's answer reaches every rank (whatever the others would say), and a
/// failure on rank 0 fails every rank, rank 0 with its own error, the others naming rank 0.
#[test]
fn rank0_decides_for_every_rank_and_its_failure_is_named() {
    let out = run_ranks(3, TIMEOUT, |pg| {
        let rank = pg.rank();
        let answers: Vec<bool> = [true, false]
            .iter()
            .map(|&a| {
                ddp_core::join::rank0_decides::<ddp_core::Error>(&pg, || {
                    assert_eq!(rank, 0, "decide runs on rank 0 only");
                    Ok(a)
                })
                .unwrap()
            })
            .collect();
        let failed = ddp_core::join::rank0_decides::<ddp_core::Error>(&pg, || {
            Err(ddp_core::Error::InvalidArgument("no test set".into()))
        })
        .unwrap_err()
        .to_string();
        (answers, failed)
    });
    for (rank, (answers, failed)) in out.iter().enumerate() {
        assert_eq!(answers, &[true, false], "rank {rank}");
        let want = if rank == 0 {
            "no test set".to_string()
        } else {
            format!("rank0_decides on rank {rank}: the decision failed on rank 0")
        };
        assert!(failed.contains(&want), "rank {rank}: {failed}");
    }
}
