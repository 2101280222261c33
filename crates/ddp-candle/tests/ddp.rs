//! End-to-end tests of `ddp_candle::Ddp` with real process groups: every rank is a thread with its
//! own `ProcessGroup`, rendezvous over `tcp://127.0.0.1:<free port>`, real TCP collectives. Every
//! collective is bounded by the group timeout, so a bug shows up as an error, not a hang.

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use ddp_candle::{Ddp, DdpOptions};

mod common;

use common::*;

/// K SGD steps on `world` ranks × `per_rank` samples; returns rank 0's parameters after each step
/// and asserts that all ranks hold bit-identical parameters after every step.
fn train_steps(
    world: usize,
    per_rank: usize,
    steps: usize,
    opts: DdpOptions,
) -> Vec<Vec<(String, Vec<f32>)>> {
    let (x, y) = dataset(world * per_rank * steps);
    let per_rank_history = run_ranks(world, |rank, pg| {
        // Different seeds per rank: DDP must replace them with rank 0's values.
        let (vm, m) = model(7 + rank as u64, HID);
        let mut ddp = Ddp::new(&vm, &pg, opts).unwrap();
        if world > 1 {
            assert!(ddp.reducer().buckets().len() > 1 || opts.bucket_cap_mb >= 1.0);
        }
        let mut opt = SGD::new(ddp.all_vars(), 0.1).unwrap();
        let mut history = Vec::new();
        for step in 0..steps {
            let global = step * world * per_rank;
            let start = global + rank * per_rank;
            let (xs, ys) = batch(&x, &y, start..start + per_rank);
            let loss = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
            let grads = ddp.backward(&loss).unwrap();
            opt.step(&grads).unwrap();
            assert_eq!(
                ddp.replica_max_diff().unwrap(),
                0.0,
                "step {step}: replicas differ"
            );
            history.push(params(&ddp));
        }
        history
    });
    for (r, h) in per_rank_history.iter().enumerate().skip(1) {
        assert_eq!(h, &per_rank_history[0], "rank {r} differs from rank 0");
    }
    per_rank_history.into_iter().next().unwrap()
}

/// DDP over 2 ranks x 8 samples against plain candle (no ddp-rs code) on the 16-sample batch.
#[test]
fn two_ranks_match_plain_candle_on_the_double_batch() {
    const STEPS: usize = 6;
    let (x, y) = dataset(2 * 8 * STEPS);
    let want = plain_reference(7, 0.1, STEPS, |k| batch(&x, &y, k * 16..(k + 1) * 16));
    for opts in [DdpOptions::default(), tiny_buckets()] {
        let two = train_steps(2, 8, STEPS, opts);
        // Initial parameters are rank 0's (seed 7), as in the reference.
        for step in 0..STEPS {
            assert_close(&two[step], &want[step], 1e-5, &format!("step {step}"));
        }
    }
    // And training did move the parameters.
    let (_, m0) = model(7, HID);
    let w0 = m0
        .l1
        .weight()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let w = &want[STEPS - 1]
        .iter()
        .find(|(n, _)| n == "l1.weight")
        .unwrap()
        .1;
    assert!(rel_diff(w, &w0) > 1e-4);
}

#[test]
fn four_ranks_stay_bit_identical() {
    let _ = train_steps(4, 4, 3, tiny_buckets());
}

#[test]
fn staged_and_plain_backward_give_identical_gradients() {
    let (x, y) = dataset(32);
    run_ranks(2, |rank, pg| {
        let (vm, m) = model(3, HID);
        let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        let (xs, ys) = batch(&x, &y, rank * 16..rank * 16 + 16);
        let loss = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
        let plain = ddp.backward(&loss).unwrap();
        let plain = grads_of(&ddp, &plain);

        let s1 = |t: &Tensor| m.stage1(t);
        let s2 = |t: &Tensor| m.stage2(t);
        let s3 = |t: &Tensor| m.stage3(t);
        let stages: [&dyn Module; 3] = [&s1, &s2, &s3];
        let out = ddp
            .forward_backward_blockwise(&stages, &xs, |o| candle_nn::loss::cross_entropy(o, &ys))
            .unwrap();
        assert_eq!(
            out.loss.to_scalar::<f32>().unwrap(),
            loss.to_scalar::<f32>().unwrap()
        );
        let staged = grads_of(&ddp, &out.grads);
        assert_eq!(
            plain, staged,
            "rank {rank}: staged gradients differ from plain"
        );
        assert!(ddp.last_step_stats().unwrap().synced);
        assert!(ddp.last_step_stats().unwrap().buckets > 1);
    });
}

/// `Ddp`'s backward takes `ddp_candle::nn::Linear`'s weight gradients straight from the layer
/// instead of candle's `GradStore` copy of them: the plain and the staged backward both give,
/// bit for bit, the average of the two ranks' own `loss.backward()` gradients.
#[test]
fn our_linear_weight_gradients_reach_the_buckets_bit_for_bit() {
    let (x, y) = dataset(32);
    run_ranks(2, |rank, pg| {
        let (vm, m) = model(3, HID);
        let ours = [&m.l1, &m.l2, &m.l3].map(|l| ddp_candle::nn::Linear::from(l.clone()));
        let s1 = |t: &Tensor| ours[0].forward(t)?.relu();
        let s2 = |t: &Tensor| ours[1].forward(t)?.tanh();
        let s3 = |t: &Tensor| ours[2].forward(t);
        let loss_of = |r: usize| {
            let (xs, ys) = batch(&x, &y, r * 16..r * 16 + 16);
            let o = s3(&s2(&s1(&xs).unwrap()).unwrap()).unwrap();
            candle_nn::loss::cross_entropy(&o, &ys).unwrap()
        };
        let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        let own: Vec<Vec<Vec<f32>>> = (0..2)
            .map(|r| grads_of(&ddp, &loss_of(r).backward().unwrap()))
            .collect();
        let want: Vec<Vec<f32>> = own[0]
            .iter()
            .zip(&own[1])
            .map(|(a, b)| a.iter().zip(b).map(|(a, b)| (a + b) / 2.0).collect())
            .collect();
        let plain = ddp.backward(&loss_of(rank)).unwrap();
        assert_eq!(grads_of(&ddp, &plain), want, "rank {rank}: plain backward");
        let (xs, ys) = batch(&x, &y, rank * 16..rank * 16 + 16);
        let stages: [&dyn Module; 3] = [&s1, &s2, &s3];
        let out = ddp
            .forward_backward_blockwise(&stages, &xs, |o| candle_nn::loss::cross_entropy(o, &ys))
            .unwrap();
        assert_eq!(
            grads_of(&ddp, &out.grads),
            want,
            "rank {rank}: staged backward"
        );
    });
}

#[test]
fn no_sync_accumulation_equals_one_big_batch() {
    const K: usize = 3; // micro-batches per rank
    const M: usize = 5; // samples per micro-batch
    let (x, y) = dataset(2 * K * M);
    run_ranks(2, |rank, pg| {
        let (vm, m) = model(11, HID);
        let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        let base = rank * K * M;
        let micro_loss = |k: usize| {
            let (xs, ys) = batch(&x, &y, base + k * M..base + (k + 1) * M);
            // Mean over the micro-batch / K: the K losses sum to the mean over K·M samples.
            (candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap() / K as f64)
                .unwrap()
        };
        {
            let mut guard = ddp.no_sync();
            for k in 0..K - 1 {
                let local = guard.backward(&micro_loss(k)).unwrap();
                assert!(!guard.last_step_stats().unwrap().synced);
                assert_eq!(guard.total_stats().steps, 0, "no_sync must not communicate");
                assert!(local.get(vm.all_vars()[0].as_tensor()).is_some());
            }
        }
        let accumulated = ddp.backward(&micro_loss(K - 1)).unwrap();
        assert!(ddp.last_step_stats().unwrap().synced);
        let accumulated = grads_of(&ddp, &accumulated);

        let (xs, ys) = batch(&x, &y, base..base + K * M);
        let big = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
        let big = ddp.backward(&big).unwrap();
        let big = grads_of(&ddp, &big);
        for (i, (a, b)) in accumulated.iter().zip(&big).enumerate() {
            let d = rel_diff(a, b);
            assert!(
                d <= 1e-5,
                "rank {rank} param #{i}: relative difference {d:e}"
            );
        }
    });
}

#[test]
fn replicas_start_identical_and_report_differences() {
    run_ranks(3, |rank, pg| {
        let (vm, _) = model(100 + rank as u64, HID);
        // Without init_sync the replicas keep their own (different) values.
        let raw = Ddp::new(
            &vm,
            &pg,
            DdpOptions {
                init_sync: false,
                ..Default::default()
            },
        )
        .unwrap();
        let report = raw.verify_replicas().unwrap();
        assert!(!report.identical && report.max_abs_diff > 0.0);
        assert_eq!(report.differing_ranks, vec![1, 2]);
        assert!(report.describe(&raw.param_names()).contains("`l1.bias`"));
        let ddp = Ddp::new(&vm, &pg, DdpOptions::default()).unwrap();
        assert_eq!(ddp.replica_max_diff().unwrap(), 0.0);
        let (_, m0) = model(100, HID);
        let w0 = m0
            .l2
            .weight()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let w = &params(&ddp)
            .into_iter()
            .find(|(n, _)| n == "l2.weight")
            .unwrap()
            .1;
        assert_eq!(w, &w0, "rank {rank} did not receive rank 0's values");
    });
}

#[test]
fn mismatched_models_fail_on_every_rank_at_init() {
    // Rank 1 has a wider hidden layer: l1.bias is the first parameter (sorted by name) to differ.
    let errors = run_ranks(2, |rank, pg| {
        let (vm, _) = model(1, if rank == 1 { HID + 1 } else { HID });
        Ddp::new(&vm, &pg, DdpOptions::default())
            .err()
            .map(|e| e.to_string())
    });
    for (rank, e) in errors.iter().enumerate() {
        let e = e
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank} accepted a mismatched model"));
        assert!(e.contains("`l1.bias`"), "rank {rank}: {e}");
        assert!(
            e.contains("rank 1") && e.contains("rank 0"),
            "rank {rank}: {e}"
        );
        assert!(
            e.contains(&format!("[{HID}]")) && e.contains(&format!("[{}]", HID + 1)),
            "{e}"
        );
    }

    // A missing parameter and a dtype difference are caught too.
    let errors = run_ranks(3, |rank, pg| {
        let (vm, _) = model(1, HID);
        if rank == 2 {
            vm.data().lock().unwrap().remove("l3.bias");
        }
        if rank == 1 {
            let v = Var::zeros(OUT, DType::F64, &Device::Cpu).unwrap();
            vm.data().lock().unwrap().insert("l3.bias".into(), v);
        }
        Ddp::new(&vm, &pg, DdpOptions::default())
            .err()
            .map(|e| e.to_string())
    });
    for (rank, e) in errors.iter().enumerate() {
        let e = e
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank} accepted a mismatched model"));
        assert!(
            e.contains("`l3.bias`") && e.contains("[1, 2]"),
            "rank {rank}: {e}"
        );
        assert!(e.contains("f64"), "rank {rank}: {e}");
    }
}

#[test]
fn optimizer_agnostic_adamw_keeps_replicas_identical() {
    let (x, y) = dataset(64);
    run_ranks(2, |rank, pg| {
        let (vm, m) = model(5, HID);
        let mut ddp = Ddp::new(&vm, &pg, DdpOptions::default()).unwrap();
        let mut opt = candle_nn::AdamW::new_lr(ddp.all_vars(), 1e-2).unwrap();
        for step in 0..4 {
            let s = step * 16 + rank * 8;
            let (xs, ys) = batch(&x, &y, s..s + 8);
            let loss = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
            opt.step(&ddp.backward(&loss).unwrap()).unwrap();
        }
        assert_eq!(ddp.replica_max_diff().unwrap(), 0.0);
    });
}

#[test]
fn join_with_uneven_shards_ends_identical_and_matches_a_single_process() {
    // Rank 0 has 3 batches, rank 1 has 7: steps 0..3 average both ranks, steps 3..7 only rank 1.
    const B: usize = 6;
    let (x, y) = dataset(10 * B);
    let shard = |rank: usize| -> Vec<std::ops::Range<usize>> {
        match rank {
            0 => (0..3).map(|i| i * B..(i + 1) * B).collect(),
            _ => (3..10).map(|i| i * B..(i + 1) * B).collect(),
        }
    };
    let finals = run_ranks(2, |rank, pg| {
        let (vm, m) = model(21 + rank as u64, HID);
        let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        let mut opt = SGD::new(ddp.all_vars(), 0.1).unwrap();
        let mut join = ddp_core::Join::new(&pg);
        let mut batches = shard(rank).into_iter();
        let mut steps = 0;
        loop {
            let range = batches.next();
            let Some(step) = join.begin_step(range.is_some()).unwrap() else {
                break;
            };
            let loss = range.map(|r| {
                let (xs, ys) = batch(&x, &y, r);
                candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap()
            });
            let grads = ddp.backward_join(loss.as_ref(), &join, &step).unwrap();
            opt.step(&grads).unwrap();
            assert_eq!(ddp.replica_max_diff().unwrap(), 0.0, "step {steps}");
            steps += 1;
        }
        assert_eq!(steps, 7);
        // has_data must match the loss passed.
        if let Some(step) = ddp_core::Join::new(&pg).begin_step(true).unwrap() {
            assert!(ddp.backward_join(None, &join, &step).is_err());
        }
        params(&ddp)
    });
    assert_eq!(finals[0], finals[1]);

    // Reference: plain candle, the same averaged steps (both batches together, then rank 1's).
    let reference = plain_reference(21, 0.1, 7, |step| {
        if step < 3 {
            let (a, ay) = batch(&x, &y, step * B..(step + 1) * B);
            let (b, by) = batch(&x, &y, (3 + step) * B..(4 + step) * B);
            (
                Tensor::cat(&[a, b], 0).unwrap(),
                Tensor::cat(&[ay, by], 0).unwrap(),
            )
        } else {
            batch(&x, &y, (3 + step) * B..(4 + step) * B)
        }
    });
    assert_close(&finals[0], &reference[6], 1e-5, "join");
}

#[test]
fn a_registered_comm_hook_sums_instead_of_averaging() {
    use ddp_candle::prelude::*;
    let (x, y) = dataset(48);
    run_ranks(3, |rank, pg| {
        let (vm, m) = model(5, HID);
        let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        ddp.register_comm_hook(|pg: &ProcessGroup, bucket: GradBucket| {
            bucket.into_buffer().all_reduce(pg, ReduceOp::Sum)
        })
        .unwrap();
        let (xs, ys) = batch(&x, &y, rank * 16..rank * 16 + 16);
        let loss = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
        // Expected: each local gradient summed over the ranks, one all-reduce per parameter.
        let local = loss.backward().unwrap();
        let mut want = grads_of(&ddp, &local);
        for g in &mut want {
            pg.all_reduce(g, ReduceOp::Sum).unwrap();
        }
        let plain = ddp.backward(&loss).unwrap();
        let s1 = |t: &Tensor| m.stage1(t);
        let s2 = |t: &Tensor| m.stage2(t);
        let s3 = |t: &Tensor| m.stage3(t);
        let stages: [&dyn Module; 3] = [&s1, &s2, &s3];
        let staged = ddp
            .forward_backward_blockwise(&stages, &xs, |o| candle_nn::loss::cross_entropy(o, &ys))
            .unwrap()
            .grads;
        for got in [grads_of(&ddp, &plain), grads_of(&ddp, &staged)] {
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    rel_diff(g, w) < 1e-6,
                    "rank {rank} parameter {i}: {g:?} vs {w:?}"
                );
            }
        }
    });
}

#[test]
fn check_finite_names_the_step_rank_and_parameter_on_every_rank() {
    let (x, y) = dataset(32);
    let errors = run_ranks(2, |rank, pg| {
        let (vm, m) = model(7, HID);
        let opts = DdpOptions {
            check_finite: true,
            ..tiny_buckets()
        };
        let mut ddp = Ddp::new(&vm, &pg, opts).unwrap();
        let bias = vm.data().lock().unwrap()["l2.bias"].as_tensor().clone();
        let (xs, ys) = batch(&x, &y, rank * 16..rank * 16 + 16);
        let mut out = Vec::new();
        for step in 0..3 {
            let mut loss = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
            if step == 1 && rank == 1 {
                // A NaN gradient for l2.bias only, on rank 1 only.
                let nan = (bias.sum_all().unwrap() * f64::NAN).unwrap();
                loss = (loss + nan).unwrap();
            }
            out.push(ddp.backward(&loss).err().map(|e| match e {
                ddp_candle::Error::Ddp(ddp_core::Error::NonFinite {
                    step,
                    rank,
                    parameter,
                    ..
                }) => (step, rank, parameter),
                other => panic!("{other}"),
            }));
        }
        out
    });
    for e in &errors {
        assert_eq!(
            e,
            &vec![None, Some((1, Some(1), "l2.bias".to_string())), None]
        );
    }
}

/// The reducer's device path (gradients flattened into device buckets and read back as device
/// slices, `DdpOptions::device_buckets`) run through the CPU implementation of the bucket
/// trait, and host buckets with and without `gradient_as_bucket_view`: plain, staged and
/// no_sync backwards give the same parameters, bit for bit, at 1, 2 and 3 ranks, with the
/// finite check on. With bucket views the averaged gradients are views into the buckets (a
/// gradient after the first of its bucket starts past the buffer's beginning), without them
/// copies of their own.
#[test]
fn device_buckets_on_the_cpu_match_host_buckets_bit_for_bit() {
    for world in [1usize, 2, 3] {
        let run = |device_buckets: bool, views: bool| {
            let (x, y) = dataset(world * 12 * 3);
            run_ranks(world, |rank, pg| {
                let (vm, m) = model(5 + rank as u64, HID);
                let opts = DdpOptions {
                    device_buckets: Some(device_buckets),
                    gradient_as_bucket_view: views,
                    check_finite: true,
                    ..tiny_buckets()
                };
                let mut ddp = Ddp::new(&vm, &pg, opts).unwrap();
                assert_eq!(ddp.reducer().is_device_bucket(0), device_buckets);
                let mut opt = SGD::new(ddp.all_vars(), 0.1).unwrap();
                let s1 = |t: &Tensor| m.stage1(t);
                let s2 = |t: &Tensor| m.stage2(t);
                let s3 = |t: &Tensor| m.stage3(t);
                let stages: [&dyn Module; 3] = [&s1, &s2, &s3];
                let at = |k: usize| (k * world + rank) * 12;
                // Step 0 plain, step 1 staged, step 2 two no_sync micro-batches then a synced one.
                let (xs, ys) = batch(&x, &y, at(0)..at(0) + 12);
                let loss = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
                let grads = ddp.backward(&loss).unwrap();
                let offsets: Vec<usize> = ddp
                    .all_vars()
                    .iter()
                    .map(|v| grads.get(v).unwrap().layout().start_offset())
                    .collect();
                let viewed = views && !device_buckets;
                assert_eq!(offsets.iter().any(|&o| o > 0), viewed, "{offsets:?}");
                opt.step(&grads).unwrap();
                drop(grads);
                let (xs, ys) = batch(&x, &y, at(1)..at(1) + 12);
                let out = ddp
                    .forward_backward_blockwise(&stages, &xs, |o| {
                        candle_nn::loss::cross_entropy(o, &ys)
                    })
                    .unwrap();
                opt.step(&out.grads).unwrap();
                for k in 0..3 {
                    let (xs, ys) = batch(&x, &y, at(2) + 4 * k..at(2) + 4 * k + 4);
                    let loss =
                        candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
                    if k < 2 {
                        let _ = ddp.no_sync().backward(&loss).unwrap();
                    } else {
                        opt.step(&ddp.backward(&loss).unwrap()).unwrap();
                    }
                }
                assert_eq!(ddp.replica_max_diff().unwrap(), 0.0);
                params(&ddp)
            })
        };
        let host = run(false, true);
        assert_eq!(
            run(false, false),
            host,
            "world {world}: gradients as bucket views differ from copies"
        );
        assert_eq!(
            run(true, true),
            host,
            "world {world}: device buckets differ from host buckets"
        );
    }
}

/// Wrapping the `VarMap` before the model created its variables (an easy order to write) is
/// refused, saying why, instead of a DDP of 0 parameters where each rank trains alone.
#[test]
fn a_varmap_without_parameters_is_refused() {
    let errors = run_ranks(2, |_, pg| {
        let vm = candle_nn::VarMap::new();
        let ddp = Ddp::new(&vm, &pg, DdpOptions::default()).err();
        let fsdp = ddp_candle::Fsdp::from_varmap(&vm, Vec::new(), &pg, |vars| {
            ddp_candle::ShardOptimizer::AdamW(Default::default()).build(vars)
        })
        .err();
        [ddp, fsdp].map(|e| e.expect("an empty model was accepted").to_string())
    });
    for e in errors.iter().flatten() {
        assert!(e.contains("at least one trainable parameter"), "{e}");
    }
}
