//! End-to-end tests of `ddp_burn::Ddp` with real process groups: every rank is a thread with its
//! own `ProcessGroup`, rendezvous over `tcp://127.0.0.1:<free port>`, real TCP collectives; the
//! references are plain Burn (module `common`, no ddp-rs code). Every collective is bounded by the
//! group timeout, so a bug shows up as an error, not a hang.

use ddp_burn::{Ddp, DdpOptions};
use ddp_core::hooks::{
    CompressHook, PeriodicModelAverager, PostLocalSgdHook, PowerSgdHook, PowerSgdState,
};

mod common;

use common::*;

/// Buckets small enough that the 3-layer MLP spans several of them.
fn tiny_buckets() -> DdpOptions {
    DdpOptions {
        bucket_cap_mb: 0.001,
        first_bucket_cap_mb: 0.0005,
        ..Default::default()
    }
}

/// How a test prepares each rank's wrapper before training (e.g. registers a comm hook).
type Setup<'a> = &'a (dyn Fn(&mut Ddp<Mlp>) + Sync);

/// K steps on `world` ranks × `per_rank` samples (global batch k = samples
/// `k*world*per_rank..`); asserts bit-identical replicas after every step and returns rank 0's
/// parameters after each step.
fn train_steps(
    world: usize,
    per_rank: usize,
    steps: usize,
    kind: Opt,
    opts: DdpOptions,
) -> Vec<Vec<(String, Vec<f32>)>> {
    train_steps_with(world, per_rank, steps, kind, opts, &|_| {})
}

/// [`train_steps`] with `setup` applied to each rank's wrapper first.
fn train_steps_with(
    world: usize,
    per_rank: usize,
    steps: usize,
    kind: Opt,
    opts: DdpOptions,
    setup: Setup<'_>,
) -> Vec<Vec<(String, Vec<f32>)>> {
    let (x, y) = dataset(world * per_rank * steps);
    let histories = run_ranks(world, |rank, pg| {
        // Different seeds per rank: DDP must replace them with rank 0's values.
        let mut ddp = Ddp::new(model(7 + rank as u64, HID), &pg, opts).unwrap();
        setup(&mut ddp);
        let mut opt = optimizer(kind);
        let mut history = Vec::new();
        for step in 0..steps {
            let start = step * world * per_rank + rank * per_rank;
            let (xs, ys) = batch(&x, &y, start..start + per_rank);
            let loss = ddp.module().loss(xs, ys);
            let grads = ddp.backward(loss).unwrap();
            ddp.step(&mut opt, LR, grads);
            let report = ddp.verify_replicas().unwrap();
            assert!(
                report.identical,
                "step {step}: {}",
                report.describe(&ddp.param_names())
            );
            history.push(ddp.module().params());
        }
        history
    });
    for (r, h) in histories.iter().enumerate().skip(1) {
        assert_eq!(h, &histories[0], "rank {r} differs from rank 0");
    }
    histories.into_iter().next().unwrap()
}

/// DDP over W ranks × b samples against plain Burn on the W·b batch, for SGD with momentum and
/// Adam, with default and tiny buckets.
#[test]
fn ranks_match_plain_burn_on_the_combined_batch() {
    const STEPS: usize = 5;
    const B: usize = 6;
    for kind in [Opt::SgdMomentum, Opt::Adam] {
        for world in [1, 2, 3] {
            let (x, y) = dataset(world * B * STEPS);
            let n = world * B;
            let want = plain_reference(7, kind, STEPS, |k| batch(&x, &y, k * n..(k + 1) * n));
            for opts in [DdpOptions::default(), tiny_buckets()] {
                let got = train_steps(world, B, STEPS, kind, opts);
                for step in 0..STEPS {
                    let what = format!("{kind:?}, world {world}, {opts:?}, step {step}");
                    assert_close(&got[step], &want[step], 1e-5, &what);
                }
            }
            // Training moved the parameters.
            let w0 = &model(7, HID).params()[0].1;
            assert!(rel_diff(&want[STEPS - 1][0].1, w0) > 1e-4);
        }
    }
}

/// PyTorch's comm hooks through the Burn adapter, at three ranks and with tiny buckets: every
/// hook keeps the replicas bit-identical (checked after each step); fp16/bf16 compression stays
/// within its rounding of plain Burn on the combined batch but is not the exact average (the hook
/// really ran), and PowerSGD at full rank reproduces the exact average.
#[test]
fn comm_hooks_run_through_the_burn_adapter() {
    const STEPS: usize = 4;
    const B: usize = 6;
    let (world, kind) = (3, Opt::SgdMomentum);
    let (x, y) = dataset(world * B * STEPS);
    let n = world * B;
    let want = plain_reference(7, kind, STEPS, |k| batch(&x, &y, k * n..(k + 1) * n));
    let exact = train_steps(world, B, STEPS, kind, tiny_buckets());
    let full_rank = PowerSgdState {
        matrix_approximation_rank: 64,
        start_powersgd_iter: 0,
        min_compression_rate: 0.0,
        ..Default::default()
    };
    // (hook, tolerance against plain Burn, whether it must differ from the exact average)
    let cases: [(&str, f64, bool, Setup<'_>); 3] = [
        ("bf16", 2e-2, true, &|d| {
            d.register_comm_hook(CompressHook::bf16()).unwrap()
        }),
        ("fp16", 2e-3, true, &|d| {
            d.register_comm_hook(CompressHook::fp16()).unwrap()
        }),
        ("powersgd at full rank", 1e-5, false, &|d| {
            d.register_comm_hook(PowerSgdHook::new(full_rank).unwrap())
                .unwrap()
        }),
    ];
    for (name, tol, lossy, setup) in cases {
        let got = train_steps_with(world, B, STEPS, kind, tiny_buckets(), setup);
        for step in 0..STEPS {
            assert_close(
                &got[step],
                &want[step],
                tol,
                &format!("{name}, step {step}"),
            );
        }
        if lossy {
            assert_ne!(
                got, exact,
                "{name}: the hook left the exact average unchanged"
            );
        }
    }
}

/// Post-local SGD through the Burn adapter (`PostLocalSgdHook` and a `PeriodicModelAverager`
/// driven by `Ddp::average_parameters`), warm-up 2 steps, three ranks. With plain SGD,
/// averaging the parameters after every local step equals a step on the averaged gradient, so
/// period 1 follows plain Burn on the combined batch; with period 3 the replicas drift apart
/// between averagings (the hook really stopped all-reducing) and are bit-identical right after
/// each one and after `average_parameters_now`.
#[test]
fn local_sgd_runs_through_the_burn_adapter() {
    const STEPS: usize = 7;
    const B: usize = 6;
    const WARMUP: u64 = 2;
    let world = 3;
    let (x, y) = dataset(world * B * STEPS);
    let n = world * B;
    let want = plain_reference(7, Opt::Sgd, STEPS, |k| batch(&x, &y, k * n..(k + 1) * n));
    for period in [1, 3] {
        let histories = run_ranks(world, |rank, pg| {
            let mut ddp = Ddp::new(model(7 + rank as u64, HID), &pg, tiny_buckets()).unwrap();
            ddp.register_comm_hook(PostLocalSgdHook::new(WARMUP))
                .unwrap();
            let mut averager = PeriodicModelAverager::new(period, WARMUP).unwrap();
            let mut opt = optimizer(Opt::Sgd);
            let mut history = Vec::new();
            for step in 0..STEPS as u64 {
                let start = step as usize * n + rank * B;
                let (xs, ys) = batch(&x, &y, start..start + B);
                let loss = ddp.module().loss(xs, ys);
                let grads = ddp.backward(loss).unwrap();
                ddp.step(&mut opt, LR, grads);
                let averaged = ddp.average_parameters(&mut averager).unwrap();
                let due = step >= WARMUP && (step - WARMUP).is_multiple_of(period);
                assert_eq!(averaged, due, "period {period}, step {step}");
                let identical = ddp.verify_replicas().unwrap().identical;
                assert_eq!(
                    identical,
                    step < WARMUP || due,
                    "period {period}, step {step}: replicas identical = {identical}"
                );
                history.push(ddp.module().params());
            }
            ddp.average_parameters_now(&mut averager).unwrap();
            assert!(ddp.verify_replicas().unwrap().identical);
            history
        });
        if period == 1 {
            for (step, want) in want.iter().enumerate() {
                let what = format!("local SGD period 1, step {step}");
                assert_close(&histories[0][step], want, 1e-5, &what);
            }
        }
    }
}

/// DiLoCo's outer loop (`ddp_core::hooks::DiLoCo`) on a Burn module through
/// `Ddp::with_params`, three ranks, inner gradients not reduced (`PostLocalSgdHook::new(0)`).
/// With H = 1 and an outer SGD of lr 1 without momentum the new anchor is the average of the
/// ranks' parameters after their local steps, which for inner SGD with momentum (its state keyed
/// by the parameters' ids, which the writes keep) is plain Burn's step on the combined batch.
/// With H = 3 and Adam the replicas differ between synchronizations and are bit-identical right
/// after each one and after `finish`.
#[test]
fn diloco_runs_through_the_burn_adapter() {
    use ddp_core::hooks::{DiLoCo, DiLoCoConfig};
    const STEPS: usize = 7;
    const B: usize = 6;
    let world = 3;
    let (x, y) = dataset(world * B * STEPS);
    let n = world * B;
    let want = plain_reference(7, Opt::SgdMomentum, STEPS, |k| {
        batch(&x, &y, k * n..(k + 1) * n)
    });
    let averaging = DiLoCoConfig {
        outer_lr: 1.0,
        momentum: 0.0,
        nesterov: false,
        ..DiLoCoConfig::new(1)
    };
    for (cfg, kind) in [
        (averaging, Opt::SgdMomentum),
        (DiLoCoConfig::new(3), Opt::Adam),
    ] {
        let h = cfg.inner_steps as usize;
        let histories = run_ranks(world, |rank, pg| {
            let mut ddp = Ddp::new(model(7 + rank as u64, HID), &pg, tiny_buckets()).unwrap();
            ddp.register_comm_hook(PostLocalSgdHook::new(0)).unwrap();
            let mut outer = ddp.with_params(|_, p| DiLoCo::new(cfg, p)).unwrap();
            let mut opt = optimizer(kind);
            let mut history = Vec::new();
            for step in 0..STEPS {
                let start = step * n + rank * B;
                let (xs, ys) = batch(&x, &y, start..start + B);
                let loss = ddp.module().loss(xs, ys);
                let grads = ddp.backward(loss).unwrap();
                ddp.step(&mut opt, LR, grads);
                ddp.with_params(|pg, p| outer.step(pg, p)).unwrap();
                let synced = (step + 1).is_multiple_of(h);
                let identical = ddp.verify_replicas().unwrap().identical;
                assert_eq!(
                    identical, synced,
                    "H {h}, step {step}: identical {identical}"
                );
                history.push(ddp.module().params());
            }
            ddp.with_params(|pg, p| outer.finish(pg, p)).unwrap();
            assert!(
                ddp.verify_replicas().unwrap().identical,
                "H {h}: after finish"
            );
            history
        });
        if h == 1 {
            for (step, want) in want.iter().enumerate() {
                let what = format!("DiLoCo H 1 averaging, step {step}");
                assert_close(&histories[0][step], want, 1e-5, &what);
            }
        }
    }
}

/// What `Ddp::with_params` gives: reads of the module's current values, writes applied once the
/// closure returns (checked when made, naming the parameter), none applied when it fails.
#[test]
fn with_params_reads_the_module_and_applies_writes_only_on_success() {
    use ddp_core::adapter::ParamAccess;
    use ddp_core::reducer::{HostBuffer, HostSlice};
    run_ranks(1, |_, pg| {
        let mut ddp = Ddp::new(model(2, HID), &pg, DdpOptions::default()).unwrap();
        let before = ddp.module().params();
        let read = ddp.with_params(|_, p| p.read_param(1)).unwrap();
        assert_eq!(read, HostBuffer::F32(before[1].1.clone()));
        let ones = vec![1.0f32; HID];
        let failed = ddp.with_params(|_, p| {
            p.write_param(1, HostSlice::of(&ones[..]))?;
            Err::<(), _>(ddp_burn::Error::Unsupported("stop".into()))
        });
        assert!(failed.is_err());
        assert_eq!(
            ddp.module().params(),
            before,
            "a failed closure's write was applied"
        );
        let short = ddp.with_params(|_, p| p.write_param(1, HostSlice::of(&ones[1..])));
        let e = short.unwrap_err().to_string();
        assert!(e.contains("l1.bias"), "{e}");
        ddp.with_params(|_, p| p.write_param(1, HostSlice::of(&ones[..])))
            .unwrap();
        let after = ddp.module().params();
        assert_eq!(after[1].1, ones);
        assert_eq!(after[0], before[0]);
        assert_eq!(after[2..], before[2..]);
    });
}

#[test]
fn parameters_are_ordered_by_module_structure_and_spread_over_buckets() {
    run_ranks(2, |_, pg| {
        let ddp = Ddp::new(model(1, HID), &pg, tiny_buckets()).unwrap();
        assert_eq!(
            ddp.param_names(),
            [
                "l1.weight",
                "l1.bias",
                "l2.weight",
                "l2.bias",
                "l3.weight",
                "l3.bias"
            ]
        );
        assert!(ddp.reducer().buckets().len() > 1);
    });
}

#[test]
fn five_ranks_stay_bit_identical() {
    let _ = train_steps(5, 3, 3, Opt::Adam, tiny_buckets());
}

/// k micro-batches, the first k−1 under `no_sync` (losses scaled by 1/k), equal one step on the
/// big batch of all ranks' micro-batches.
#[test]
fn no_sync_accumulation_equals_the_big_batch() {
    const K: usize = 3;
    const B: usize = 4;
    const STEPS: usize = 2;
    let world = 2;
    let (x, y) = dataset(world * K * B * STEPS);
    // Step s uses samples s*W*K*B..; rank r's micro-batch j is the j-th block of B in its half.
    let per_step = world * K * B;
    let want = plain_reference(5, Opt::SgdMomentum, STEPS, |s| {
        batch(&x, &y, s * per_step..(s + 1) * per_step)
    });
    let got = run_ranks(world, |rank, pg| {
        let mut ddp = Ddp::new(model(5, HID), &pg, tiny_buckets()).unwrap();
        let mut opt = optimizer(Opt::SgdMomentum);
        let micro = |s: usize, j: usize| {
            let start = s * per_step + rank * K * B + j * B;
            batch(&x, &y, start..start + B)
        };
        let mut out = Vec::new();
        for s in 0..STEPS {
            {
                let mut guard = ddp.no_sync();
                for j in 0..K - 1 {
                    let (xs, ys) = micro(s, j);
                    let loss = guard.module().loss(xs, ys) / K as f32;
                    let _local = guard.backward(loss).unwrap();
                    assert!(!guard.last_step_stats().is_some_and(|st| st.synced));
                }
            }
            let (xs, ys) = micro(s, K - 1);
            let loss = ddp.module().loss(xs, ys) / K as f32;
            let grads = ddp.backward(loss).unwrap();
            assert!(ddp.last_step_stats().unwrap().synced);
            ddp.step(&mut opt, LR, grads);
            out.push(ddp.module().params());
        }
        assert_eq!(ddp.replica_max_diff().unwrap(), 0.0);
        out
    });
    for (r, h) in got.iter().enumerate() {
        for s in 0..STEPS {
            assert_close(&h[s], &want[s], 1e-5, &format!("rank {r}, step {s}"));
        }
    }
}

/// Rank 0 has 2 batches, rank 1 has 4: while both have data the step is the mean over both
/// batches, afterwards rank 1's batch alone (Join divides by the ranks that had data); both
/// ranks step on every round and end bit-identical, equal to plain Burn on that schedule.
#[test]
fn join_with_uneven_shards_ends_identical_and_matches_the_schedule() {
    const B: usize = 5;
    let counts = [2usize, 4];
    let (x, y) = dataset(B * 6);
    // Rank 0 takes blocks 0, 1; rank 1 takes blocks 2..6.
    let block = |r: usize, i: usize| if r == 0 { i } else { 2 + i };
    let want = plain_reference(9, Opt::Adam, 4, |k| {
        if k < 2 {
            // Mean over both ranks' batches = the mean over the 2B samples together.
            let (a, b) = (block(0, k), block(1, k));
            let mut xs = x[a * B * IN..(a + 1) * B * IN].to_vec();
            xs.extend_from_slice(&x[b * B * IN..(b + 1) * B * IN]);
            let mut ys = y[a * B..(a + 1) * B].to_vec();
            ys.extend_from_slice(&y[b * B..(b + 1) * B]);
            batch(&xs, &ys, 0..2 * B)
        } else {
            let b = block(1, k);
            batch(&x, &y, b * B..(b + 1) * B)
        }
    });
    let got = run_ranks(2, |rank, pg| {
        let mut ddp = Ddp::new(model(9, HID), &pg, tiny_buckets()).unwrap();
        let mut opt = optimizer(Opt::Adam);
        let mut join = ddp_core::Join::new(&pg);
        let mut rounds = 0;
        let mut i = 0;
        loop {
            let has = i < counts[rank];
            let Some(step) = join.begin_step(has).unwrap() else {
                break;
            };
            let loss = has.then(|| {
                let b = block(rank, i);
                let (xs, ys) = batch(&x, &y, b * B..(b + 1) * B);
                ddp.module().loss(xs, ys)
            });
            let grads = ddp.backward_join(loss, &join, &step).unwrap();
            ddp.step(&mut opt, LR, grads);
            i += 1;
            rounds += 1;
        }
        assert_eq!(rounds, 4);
        assert_eq!(ddp.replica_max_diff().unwrap(), 0.0);
        ddp.module().params()
    });
    assert_eq!(got[0], got[1]);
    assert_close(&got[0], &want[3], 1e-5, "after the uneven epoch");
}

/// A model of another shape on one rank: construction fails on every rank, naming the parameter.
#[test]
fn mismatched_models_fail_on_every_rank_at_construction() {
    let errors = run_ranks(3, |rank, pg| {
        let hidden = if rank == 2 { HID + 1 } else { HID };
        match Ddp::new(model(1, hidden), &pg, DdpOptions::default()) {
            Ok(_) => panic!("rank {rank}: a mismatched model was accepted"),
            Err(e) => e.to_string(),
        }
    });
    for (rank, e) in errors.iter().enumerate() {
        assert!(e.contains("l1.weight"), "rank {rank}: {e}");
        assert!(e.contains("rank 2"), "rank {rank}: {e}");
    }
}

/// A frozen parameter is neither averaged nor broadcast; the trainable ones are.
#[test]
fn frozen_parameters_are_left_alone() {
    let out = run_ranks(2, |rank, pg| {
        let mut m = model(3 + rank as u64, HID);
        m.l1.bias = m.l1.bias.set_require_grad(false);
        let ddp = Ddp::new(m, &pg, DdpOptions::default()).unwrap();
        assert!(!ddp.param_names().contains(&"l1.bias"));
        ddp.module().params()
    });
    let (a, b) = (&out[0], &out[1]);
    for (pa, pb) in a.iter().zip(b) {
        if pa.0 == "l1.bias" {
            assert_ne!(pa.1, pb.1, "the frozen bias was overwritten");
        } else {
            assert_eq!(pa, pb, "{} was not broadcast", pa.0);
        }
    }
}

/// A module without trainable parameters (wrapped before its layers exist, or all frozen) is
/// refused, saying why, instead of training each rank alone; ZeroDdp is built on it, so it
/// refuses too.
#[test]
fn a_model_without_trainable_parameters_is_refused() {
    let errors = run_ranks(2, |_, pg| {
        let empty = burn::nn::Relu::new();
        match Ddp::new(empty, &pg, DdpOptions::default()) {
            Ok(_) => panic!("a model without parameters was accepted"),
            Err(e) => e.to_string(),
        }
    });
    for e in errors {
        assert!(e.contains("at least one trainable parameter"), "{e}");
    }
}
