//! The built-in comm hooks (`ddp_core::hooks`) on real groups (ranks as threads, each with its own
//! TCP process group): each hook's result against a sequential reference, replicas identical,
//! error feedback, local SGD against DDP, Join and no_sync, exact resume from a checkpoint, bytes.

use ddp_comm::{DType, ProcessGroup};
use ddp_core::hooks::{
    CompressHook, Compressed, HookSpec, PeriodicModelAverager, PowerSgdHook, PowerSgdState,
};
use ddp_core::reducer::{CommHook, HostSlice, ParamSpec, Reducer, ReducerOptions};
use ddp_core::{Checkpoint, CheckpointMeta, Join};
use half::{bf16, f16};

mod common;
use common::*;

/// fp16/bf16 compression equals the exact average within the format's rounding, for buckets of
/// size 0, 1, odd and large, f32/f64/bf16 buckets and worlds 1..=5; every rank gets the same bits.
#[test]
fn compress_hooks_equal_the_exact_average_within_the_formats_rounding() {
    for world in 1..=5usize {
        for (precision, unit) in [(0u8, 2f64.powi(-11)), (1, 2f64.powi(-8))] {
            for dtype in [DType::F32, DType::F64, DType::BF16] {
                let sizes = [0usize, 1, 17, 40_000];
                let out = run(world, |pg| {
                    let specs: Vec<ParamSpec> = sizes
                        .iter()
                        .map(|&n| ParamSpec::new(format!("p{n}"), vec![n], dtype))
                        .collect();
                    let mut red = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
                    let hook = match precision {
                        0 => CompressHook::fp16(),
                        _ => CompressHook::bf16(),
                    };
                    red.register_comm_hook(hook).unwrap();
                    let r = pg.rank();
                    for (i, &n) in sizes.iter().enumerate().rev() {
                        let v: Vec<f64> = (0..n)
                            .map(|k| 100.0 * noise(r as u64, 1, i as u64, k as u64) as f64)
                            .collect();
                        match dtype {
                            DType::F64 => red.mark_ready(i, &v),
                            DType::F32 => {
                                red.mark_ready(i, &v.iter().map(|&x| x as f32).collect::<Vec<_>>())
                            }
                            _ => red.mark_ready(
                                i,
                                &v.iter().map(|&x| bf16::from_f64(x)).collect::<Vec<_>>(),
                            ),
                        }
                        .unwrap();
                    }
                    red.finish().unwrap();
                    let res: Vec<Vec<f64>> = (0..sizes.len())
                        .map(|i| {
                            red.with_grad(i, |g| match g {
                                HostSlice::F64(v) => v.to_vec(),
                                HostSlice::F32(v) => v.iter().map(|&x| x as f64).collect(),
                                HostSlice::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
                                _ => unreachable!(),
                            })
                            .unwrap()
                        })
                        .collect();
                    (res, red.bytes_sent())
                });
                let bucket_unit = if dtype == DType::BF16 {
                    2f64.powi(-8)
                } else {
                    0.0
                };
                for (i, &n) in sizes.iter().enumerate() {
                    for k in 0..n {
                        let vals: Vec<f64> = (0..world)
                            .map(|r| {
                                let x = 100.0 * noise(r as u64, 1, i as u64, k as u64) as f64;
                                if dtype == DType::BF16 {
                                    bf16::from_f64(x).to_f64()
                                } else {
                                    x
                                }
                            })
                            .collect();
                        let exact = vals.iter().sum::<f64>() / world as f64;
                        let scale = vals.iter().map(|x| x.abs()).sum::<f64>() / world as f64;
                        let tol = (world as f64 + 1.0) * (unit + bucket_unit) * scale + 1e-30;
                        let got = out[0].0[i][k];
                        assert!(
                            (got - exact).abs() <= tol,
                            "world {world} precision {precision} {dtype} p{n}[{k}]: {got} vs \
                             exact {exact} (tolerance {tol})"
                        );
                    }
                }
                for (r, o) in out.iter().enumerate() {
                    assert_eq!(o.0, out[0].0, "rank {r} differs from rank 0");
                    // Two bytes per element on the wire, whatever the bucket dtype.
                    assert_eq!(o.1, 2 * sizes.iter().sum::<usize>() as u64);
                }
            }
        }
    }
}

/// PowerSGD at full rank (every matrix compressed: min_compression_rate 0) reproduces the exact
/// average to 1e-5 (relative to the largest gradient), plain and batched, worlds 1..=4; replicas get identical bits.
#[test]
fn powersgd_at_full_rank_reproduces_the_exact_average() {
    for world in 1..=4usize {
        for batched in [false, true] {
            let state = PowerSgdState {
                matrix_approximation_rank: 64,
                start_powersgd_iter: 0,
                min_compression_rate: 0.0,
                ..Default::default()
            };
            let out = run(world, |pg| {
                let model = Model::new();
                let mut red = reducer(&pg, &model);
                let hook = if batched {
                    PowerSgdHook::batched(state)
                } else {
                    PowerSgdHook::new(state)
                };
                red.register_comm_hook(hook.unwrap()).unwrap();
                (0..3)
                    .map(|step| sync(&mut red, &model, &model.grads(pg.rank(), step)))
                    .collect::<Vec<_>>()
            });
            let model = Model::new();
            for step in 0..3u64 {
                let exact = mean_over_ranks(world, |r| model.grads(r, step));
                let d = max_abs_diff(&out[0][step as usize], &exact);
                let scale = exact.iter().flatten().fold(1f64, |m, x| m.max(x.abs()));
                assert!(
                    d < 1e-5 * scale,
                    "world {world} batched {batched} step {step}: max |error| {d} (largest \
                     |gradient| {scale})"
                );
                for o in &out {
                    assert_eq!(o[step as usize], out[0][step as usize]);
                }
            }
        }
    }
}

/// Error feedback: on every rank r, the sum of the applied (averaged) updates plus the residual
/// left in the hook equals the sum of r's own gradients (Σ applied + residual_r = Σ g_r), so
/// averaged over the ranks nothing of the true gradient sum is lost.
#[test]
fn error_feedback_keeps_applied_plus_residual_equal_to_the_true_sum() {
    for batched in [false, true] {
        let world = 3;
        let steps = 6u64;
        let out = run(world, |pg| {
            let model = Model::new();
            let specs = ddp_core::adapter::param_specs(&model).unwrap();
            // One bucket, so that the residual is one vector in buffer order.
            let mut red = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
            let state = PowerSgdState {
                start_powersgd_iter: 0,
                ..Default::default()
            };
            let hook = match batched {
                false => PowerSgdHook::new(state),
                true => PowerSgdHook::batched(state),
            };
            red.register_comm_hook(hook.unwrap()).unwrap();
            let layout = red.buckets();
            assert_eq!(layout.len(), 1);
            let mut applied = vec![0f64; layout[0].numel];
            let mut local = vec![0f64; layout[0].numel];
            for step in 0..steps {
                let g = model.grads(pg.rank(), step);
                let avg = sync(&mut red, &model, &g);
                let mut off = 0;
                for &p in &layout[0].params {
                    for k in 0..g[p].len() {
                        applied[off + k] += avg[p][k] as f64;
                        local[off + k] += g[p][k] as f64;
                    }
                    off += g[p].len();
                }
            }
            let state = red.comm_hook_state();
            let residual = state.tensors["error.0"].data.clone();
            (applied, local, residual)
        });
        for (r, (applied, local, residual)) in out.iter().enumerate() {
            let mut compressed_somewhere = false;
            for k in 0..applied.len() {
                let lhs = applied[k] + residual[k] as f64;
                assert!(
                    (lhs - local[k]).abs() < 1e-4,
                    "batched {batched} rank {r} element {k}: applied {} + residual {} != {}",
                    applied[k],
                    residual[k],
                    local[k]
                );
                compressed_somewhere |= residual[k].abs() > 1e-3;
            }
            assert!(compressed_somewhere, "rank-1 compression left no residual");
        }
    }
}

fn a_period(spec: HookSpec) -> u64 {
    match spec {
        HookSpec::LocalSgd { period, .. } => period,
        _ => 1,
    }
}

/// Local SGD with period 1 and no warm-up averages the parameters after every local step:
/// with a gradient linear in the parameters, that is DDP up to rounding.
#[test]
fn local_sgd_with_period_1_equals_ddp() {
    for world in [1usize, 2, 3, 5] {
        let train = |spec: HookSpec| {
            run(world, move |pg| {
                let model = Model::new();
                let mut red = reducer(&pg, &model);
                if let Some(h) = spec.hook().unwrap() {
                    red.register_comm_hook(h).unwrap();
                }
                let mut avg = spec.averager().unwrap();
                for step in 0..10 {
                    let g = sync(&mut red, &model, &model.grads(pg.rank(), step));
                    model.sgd(&g, 0.1);
                    if let Some(a) = &mut avg {
                        let due = a.average_parameters(&pg, &model).unwrap();
                        assert_eq!(due, step % a_period(spec) == 0);
                    }
                }
                model.values()
            })
        };
        let ddp = train(HookSpec::None);
        let local = train(HookSpec::LocalSgd {
            period: 1,
            warmup: 0,
        });
        let period_2 = train(HookSpec::LocalSgd {
            period: 2,
            warmup: 0,
        });
        if world > 1 {
            let to64 = |v: &Vec<Vec<f32>>| -> Vec<Vec<f64>> {
                v.iter()
                    .map(|v| v.iter().map(|&x| x as f64).collect())
                    .collect()
            };
            let d = max_abs_diff(&period_2[0], &to64(&ddp[0]));
            assert!(
                d > 1e-3,
                "world {world}: period 2 is DDP too ({d}): the check is blind"
            );
        }
        for r in 0..world {
            assert_eq!(
                local[r], local[0],
                "world {world}: local SGD replicas differ"
            );
            let d = max_abs_diff(
                &local[r],
                &ddp[r]
                    .iter()
                    .map(|v| v.iter().map(|&x| x as f64).collect())
                    .collect::<Vec<_>>(),
            );
            assert!(d < 1e-5, "world {world} rank {r}: local SGD vs DDP {d}");
        }
    }
}

fn every_hook() -> Vec<HookSpec> {
    vec![
        HookSpec::None,
        HookSpec::Fp16,
        HookSpec::Bf16,
        HookSpec::PowerSgd {
            rank: 1,
            start_iter: 2,
        },
        HookSpec::PowerSgd {
            rank: 2,
            start_iter: 0,
        },
        HookSpec::LocalSgd {
            period: 3,
            warmup: 2,
        },
    ]
}

/// Trains `steps` steps from the start, or from `resume` (params + hook state); returns the
/// parameters and, after `save_at` steps, a checkpoint's bytes.
fn train(
    pg: &ProcessGroup,
    spec: HookSpec,
    steps: u64,
    save_at: Option<u64>,
    resume: Option<&[u8]>,
) -> (Vec<Vec<f32>>, Option<Vec<u8>>) {
    let model = Model::new();
    let mut red = reducer(pg, &model);
    if let Some(h) = spec.hook().unwrap() {
        red.register_comm_hook(h).unwrap();
    }
    let mut avg = spec.averager().unwrap();
    let mut first = 0;
    if let Some(bytes) = resume {
        let ck = Checkpoint::from_bytes(bytes, "test").unwrap();
        for i in 0..model.specs.len() {
            let t = ck.require(&model.specs[i].name).unwrap();
            *model.vals[i].borrow_mut() = t.data.clone();
        }
        let kind = red.comm_hook_state().kind;
        let state = ck.hook_state(&kind).unwrap().for_rank(pg.rank());
        red.load_comm_hook_state(&state).unwrap();
        if let Some(a) = &mut avg {
            let s = ck.hook_state("periodic_model_averager").unwrap();
            a.load_state_dict(&s).unwrap();
        }
        first = ck.meta.step;
        red.set_step(first);
    }
    let mut saved = None;
    for step in first..steps {
        if save_at == Some(step) {
            let mut ck = Checkpoint::new(CheckpointMeta {
                step,
                world_size: pg.size(),
                ..Default::default()
            });
            for (s, v) in model.specs.iter().zip(model.values()) {
                ck.insert(s.name.clone(), s.shape.clone(), v).unwrap();
            }
            // Every rank's residuals, as a rank-0-only checkpoint must hold them.
            let all = ddp_core::hooks::gather_state(pg, &red.comm_hook_state()).unwrap();
            ck.save_hook_state(&all).unwrap();
            if let Some(a) = &avg {
                ck.save_hook_state(&a.state_dict()).unwrap();
            }
            saved = Some(ck.to_bytes().unwrap());
        }
        let g = sync(&mut red, &model, &model.grads(pg.rank(), step));
        model.sgd(&g, 0.1);
        if let Some(a) = &mut avg {
            a.average_parameters(pg, &model).unwrap();
        }
    }
    if let Some(a) = &mut avg {
        a.average_now(pg, &model).unwrap();
    }
    (model.values(), saved)
}

/// Every hook keeps the replicas bit-identical (local SGD after its final averaging).
#[test]
fn replicas_stay_bit_identical_with_every_hook() {
    for spec in every_hook() {
        for world in [2usize, 3] {
            let out = run(world, |pg| train(&pg, spec, 9, None, None).0);
            for (r, o) in out.iter().enumerate() {
                assert_eq!(
                    o, &out[0],
                    "{spec}, world {world}: rank {r} differs from rank 0"
                );
            }
            assert_ne!(out[0], Model::new().values(), "{spec}: nothing trained");
        }
    }
}

/// Checkpoint after 4 of 9 steps, resume in a fresh reducer and hook: the parameters equal an
/// uninterrupted run's bit for bit, with every hook.
#[test]
fn resume_is_exact_with_every_hook() {
    for spec in every_hook() {
        let world = 2;
        let out = run(world, |pg| {
            let (straight, ck) = train(&pg, spec, 9, Some(4), None);
            let (resumed, _) = train(&pg, spec, 9, None, Some(&ck.unwrap()));
            (straight, resumed)
        });
        for (r, (straight, resumed)) in out.iter().enumerate() {
            assert_eq!(straight, resumed, "{spec}: rank {r} resumed differently");
        }
    }
}

/// Makes a function that registers one hook on a reducer (one per rank).
type MakeRegister = Box<dyn Fn() -> Box<dyn FnOnce(&mut Reducer) + Send> + Sync>;

/// Hooks under Join (uneven inputs: the divisor is the number of ranks with data) and after
/// no_sync accumulation: the result is the mean over the active ranks of the accumulated sums.
#[test]
fn hooks_under_join_and_no_sync() {
    let exact_powersgd = PowerSgdState {
        matrix_approximation_rank: 64,
        start_powersgd_iter: 0,
        min_compression_rate: 0.0,
        ..Default::default()
    };
    let hooks: Vec<(&str, f64, MakeRegister)> = vec![
        (
            "fp16",
            1e-2,
            Box::new(|| {
                Box::new(|r: &mut Reducer| r.register_comm_hook(CompressHook::fp16()).unwrap())
            }),
        ),
        (
            "bf16",
            6e-2,
            Box::new(|| {
                Box::new(|r: &mut Reducer| r.register_comm_hook(CompressHook::bf16()).unwrap())
            }),
        ),
        (
            "powersgd",
            1e-5,
            Box::new(move || {
                Box::new(move |r: &mut Reducer| {
                    r.register_comm_hook(PowerSgdHook::new(exact_powersgd).unwrap())
                        .unwrap()
                })
            }),
        ),
        (
            "bf16_wrapper(powersgd)",
            0.15,
            Box::new(move || {
                Box::new(move |r: &mut Reducer| {
                    r.register_comm_hook(Compressed::bf16(
                        PowerSgdHook::new(exact_powersgd).unwrap(),
                    ))
                    .unwrap()
                })
            }),
        ),
    ];
    let world = 3;
    // Rank r has 2 + r batches of 2 micro-batches each (no_sync on the first).
    let batches = |r: usize| 2 + r as u64;
    for (name, tol, register) in &hooks {
        let out = run(world, |pg| {
            let model = Model::new();
            let mut red = reducer(&pg, &model);
            register()(&mut red);
            let mut join = Join::new(&pg);
            let mut results = Vec::new();
            let mut b = 0;
            while let Some(step) = join.begin_step(b < batches(pg.rank())).unwrap() {
                if step.has_data {
                    red.set_require_backward_grad_sync(false);
                    let mut g = model.grads(pg.rank(), 100 + b);
                    ddp_core::adapter::mark_grads(&model, &mut red, &mut g, |_, _| Ok(())).unwrap();
                    red.finish().unwrap();
                    red.set_require_backward_grad_sync(true);
                    red.set_divisor(step.divisor).unwrap();
                    let mut g = model.grads(pg.rank(), b);
                    ddp_core::adapter::mark_grads(&model, &mut red, &mut g, |_, _| Ok(())).unwrap();
                }
                red.set_divisor(step.divisor).unwrap();
                join.sync_gradients(&mut red, &step).unwrap();
                results.push(ddp_core::adapter::averaged_grads(&model, &red).unwrap());
                b += 1;
            }
            results
        });
        let model = Model::new();
        assert_eq!(out[0].len(), batches(world - 1) as usize);
        for step in 0..out[0].len() as u64 {
            let active: Vec<usize> = (0..world).filter(|&r| step < batches(r)).collect();
            let sums: Vec<Vec<Vec<f32>>> = active
                .iter()
                .map(|&r| {
                    let (a, b) = (model.grads(r, 100 + step), model.grads(r, step));
                    a.iter()
                        .zip(&b)
                        .map(|(x, y)| x.iter().zip(y).map(|(x, y)| x + y).collect())
                        .collect()
                })
                .collect();
            let exact = mean_over_ranks(active.len(), |i| sums[i].clone());
            let d = max_abs_diff(&out[0][step as usize], &exact);
            assert!(
                d < *tol,
                "{name} step {step} ({} active): max |error| {d}",
                active.len()
            );
            for o in &out {
                assert_eq!(
                    o[step as usize], out[0][step as usize],
                    "{name}: ranks differ"
                );
            }
        }
    }
}

/// Bytes handed to collectives per step: half with bf16, (n+m)·r per compressed matrix plus the
/// uncompressed rest with PowerSGD, nothing with local SGD after its warm-up.
#[test]
fn bytes_sent_per_step_follow_the_compression() {
    let specs = model_specs();
    let total: u64 = specs.iter().map(|s| s.numel() as u64 * 4).sum();
    let out = run(2, |pg| {
        [
            HookSpec::None,
            HookSpec::Bf16,
            HookSpec::PowerSgd {
                rank: 1,
                start_iter: 1,
            },
            HookSpec::LocalSgd {
                period: 2,
                warmup: 1,
            },
        ]
        .map(|spec| {
            let model = Model::new();
            let mut red = reducer(&pg, &model);
            if let Some(h) = spec.hook().unwrap() {
                red.register_comm_hook(h).unwrap();
            }
            let mut per_step = Vec::new();
            for step in 0..3 {
                let before = red.bytes_sent();
                sync(&mut red, &model, &model.grads(pg.rank(), step));
                per_step.push(red.bytes_sent() - before);
            }
            per_step
        })
    });
    let [none, bf16, powersgd, local] = &out[0];
    assert_eq!(none, &vec![total; 3]);
    assert_eq!(bf16, &vec![total / 2; 3]);
    // a 8x6 → (8+6)·1, c 5x7 → (5+7)·1, f 12x6 → (12+6)·1; b, d uncompressed (e is empty).
    let compressed = 4 * ((8 + 6) + (5 + 7) + (12 + 6) + 6 + 1);
    assert_eq!(powersgd, &vec![total, compressed, compressed]);
    assert_eq!(local, &vec![total, 0, 0]);
}

/// Bad input: errors name the hook, the field, the bucket or the checkpoint's contents.
#[test]
fn bad_input_gets_errors_that_name_the_thing() {
    let e = "powersgd:0".parse::<HookSpec>().unwrap_err();
    assert!(e.contains("RANK") && e.contains(">= 1"), "{e}");
    let e = "localsgd:4:x".parse::<HookSpec>().unwrap_err();
    assert!(e.contains("WARMUP") && e.contains("\"x\""), "{e}");
    let e = "powersgd:1:2:3".parse::<HookSpec>().unwrap_err();
    assert!(e.contains("too many"), "{e}");
    let e = "topk".parse::<HookSpec>().unwrap_err();
    assert!(e.contains("unknown hook \"topk\""), "{e}");
    assert_eq!(
        "powersgd:2:10".parse::<HookSpec>().unwrap(),
        HookSpec::PowerSgd {
            rank: 2,
            start_iter: 10
        }
    );
    assert_eq!(
        "powersgd".parse::<HookSpec>().unwrap().to_string(),
        "powersgd:1:1000"
    );
    assert_eq!(
        "localsgd".parse::<HookSpec>().unwrap().to_string(),
        "localsgd:4:100"
    );
    let e = PowerSgdHook::new(PowerSgdState {
        matrix_approximation_rank: 0,
        ..Default::default()
    })
    .err()
    .unwrap();
    assert!(e.to_string().contains("matrix_approximation_rank"), "{e}");
    assert!(PeriodicModelAverager::new(0, 0)
        .unwrap_err()
        .to_string()
        .contains("period"));
    // A hook on an integer bucket fails the step, naming the hook and the bucket.
    let out = run(2, |pg| {
        let specs = vec![ParamSpec::new("counts", vec![3], DType::I32)];
        let mut red = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
        red.register_comm_hook(CompressHook::bf16()).unwrap();
        red.mark_ready(0, &[1i32, 2, 3]).unwrap();
        red.finish().unwrap_err().to_string()
    });
    assert!(
        out[0].contains("bf16_compress") && out[0].contains("bucket 0") && out[0].contains("i32"),
        "{}",
        out[0]
    );
    // A checkpoint without this hook's state says what it holds.
    let mut ck = Checkpoint::new(CheckpointMeta::default());
    ck.save_hook_state(&CompressHook::bf16().state_dict())
        .unwrap();
    let e = ck.hook_state("powersgd").unwrap_err().to_string();
    assert!(e.contains("powersgd") && e.contains("bf16_compress"), "{e}");
    // Hook state tensors are not parameters.
    assert_eq!(ck.params().count(), 0);
    let e = PowerSgdHook::new(PowerSgdState::default())
        .unwrap()
        .load_state_dict(&ck.hook_state("bf16_compress").unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("bf16_compress") && e.contains("powersgd"), "{e}");
    let _ = (f16::ONE, HookSpec::default());
}
