//! DiLoCo and streaming DiLoCo (`ddp_core::hooks::DiLoCo`) on real groups (ranks as threads,
//! each with its own TCP process group), the inner steps plain SGD on local gradients
//! (`PostLocalSgdHook::new(0)`): DDP at H = 1, an independent reference, streaming's special
//! case, fragments identical after each update, exact resume, bytes, bad settings.

mod common;

use common::*;
use ddp_comm::ProcessGroup;
use ddp_core::hooks::{DiLoCo, DiLoCoConfig, PostLocalSgdHook, PseudoGradDtype};

const INNER_LR: f32 = 0.1;

/// `steps` inner steps of plain SGD on local gradients, DiLoCo (`cfg`) after each; calls
/// `each(step, applied fragments, model)`; returns the final parameters.
fn train(
    pg: &ProcessGroup,
    cfg: Option<DiLoCoConfig>,
    steps: u64,
    mut each: impl FnMut(u64, &[usize], &Model),
) -> Vec<Vec<f32>> {
    let model = Model::new();
    let mut red = reducer(pg, &model);
    let mut outer = cfg.map(|c| {
        red.register_comm_hook(PostLocalSgdHook::new(0)).unwrap();
        DiLoCo::new(c, &model).unwrap()
    });
    for step in 0..steps {
        let g = sync(&mut red, &model, &model.grads(pg.rank(), step));
        model.sgd(&g, INNER_LR);
        let applied = match &mut outer {
            Some(d) => d.step(pg, &model).unwrap(),
            None => Vec::new(),
        };
        each(step, &applied, &model);
    }
    model.values()
}

fn plain(h: u64, lr: f64, momentum: f64) -> DiLoCoConfig {
    DiLoCoConfig {
        outer_lr: lr,
        momentum,
        ..DiLoCoConfig::new(h)
    }
}

fn to64(v: &[Vec<f32>]) -> Vec<Vec<f64>> {
    v.iter()
        .map(|v| v.iter().map(|&x| x as f64).collect())
        .collect()
}

/// H = 1, outer lr 1, no momentum: the new anchor is the average of the ranks' parameters after
/// one local SGD step, which is DDP with SGD (the average gradient) up to rounding.
#[test]
fn h1_with_outer_lr_1_and_no_momentum_is_ddp_with_sgd() {
    for world in [1usize, 2, 3] {
        let ddp = run(world, |pg| train(&pg, None, 8, |_, _, _| {}));
        let dl = run(world, |pg| {
            train(&pg, Some(plain(1, 1.0, 0.0)), 8, |_, _, _| {})
        });
        // ... and with momentum it is another run (the comparison can fail).
        let other = run(world, |pg| {
            train(&pg, Some(plain(1, 1.0, 0.9)), 8, |_, _, _| {})
        });
        for r in 0..world {
            assert_eq!(dl[r], dl[0], "world {world}: replicas differ");
            let d = max_abs_diff(&dl[r], &to64(&ddp[r]));
            assert!(d < 1e-6, "world {world} rank {r}: DiLoCo H=1 vs DDP {d}");
        }
        let d = max_abs_diff(&other[0], &to64(&ddp[0]));
        assert!(d > 1e-3, "world {world}: momentum changed nothing ({d})");
    }
}

/// DiLoCo (H = 3, the paper's outer Nesterov SGD) against a reference written here with plain
/// loops over each rank's parameter vectors, no reducer, no DiLoCo: 4 outer steps, world 3.
#[test]
fn diloco_equals_an_independent_reference() {
    let (world, h, outers) = (3usize, 3u64, 4u64);
    let (lr, mu) = (0.7f64, 0.9f64);
    let got = run(world, |pg| {
        train(&pg, Some(plain(h, lr, mu)), h * outers, |_, _, _| {})
    });
    // The reference, in f64.
    let init = to64(&Model::new().values());
    let mut anchor = init.clone();
    let mut m: Vec<Vec<f64>> = init.iter().map(|v| vec![0.0; v.len()]).collect();
    for outer in 0..outers {
        let mut delta: Vec<Vec<f64>> = init.iter().map(|v| vec![0.0; v.len()]).collect();
        for r in 0..world {
            let mut w = anchor.clone();
            for s in 0..h {
                let step = outer * h + s;
                for (i, v) in w.iter_mut().enumerate() {
                    for (k, x) in v.iter_mut().enumerate() {
                        let g = *x + 0.25 * *x * *x * *x
                            - noise(r as u64, step, i as u64, k as u64) as f64;
                        *x -= INNER_LR as f64 * g;
                    }
                }
            }
            for (i, v) in w.iter().enumerate() {
                for (k, x) in v.iter().enumerate() {
                    delta[i][k] += (anchor[i][k] - x) / world as f64;
                }
            }
        }
        for i in 0..anchor.len() {
            for k in 0..anchor[i].len() {
                m[i][k] = mu * m[i][k] + delta[i][k];
                let u = delta[i][k] + mu * m[i][k];
                anchor[i][k] -= lr * u;
            }
        }
    }
    for (r, g) in got.iter().enumerate() {
        let d = max_abs_diff(g, &anchor);
        assert!(d < 1e-5, "rank {r}: DiLoCo vs the reference: {d}");
    }
    assert!(
        max_abs_diff(&got[0], &init) > 1e-2,
        "the reference moved nothing: the check is blind"
    );
}

/// Streaming with one fragment, no overlap and f32 pseudo-gradients is DiLoCo, bit for bit.
#[test]
fn streaming_with_one_fragment_and_no_overlap_is_diloco() {
    let dl = run(2, |pg| {
        train(&pg, Some(DiLoCoConfig::new(4)), 12, |_, _, _| {})
    });
    let st = run(2, |pg| {
        let cfg = DiLoCoConfig {
            comm: PseudoGradDtype::F32,
            ..DiLoCoConfig::streaming(4, 1, 0)
        };
        train(&pg, Some(cfg), 12, |_, _, _| {})
    });
    assert_eq!(dl, st);
}

/// Streaming DiLoCo (H = 6, 3 fragments, overlap 1, bf16): each fragment is updated every 6
/// steps, one step after its all-reduce began, staggered (fragment i at steps ≡ 2(i+1)+1 mod 6),
/// and right after its update it is bit-identical on every rank.
#[test]
fn streaming_fragments_are_staggered_and_identical_after_each_update() {
    let world = 3;
    let cfg = DiLoCoConfig::streaming(6, 3, 1);
    let logs = run(world, |pg| {
        let mut log: Vec<(u64, usize, Vec<Vec<f32>>)> = Vec::new();
        let mut frags = None;
        train(&pg, Some(cfg), 18, |step, applied, model| {
            let frags =
                frags.get_or_insert_with(|| DiLoCo::new(cfg, model).unwrap().fragments().to_vec());
            for &f in applied {
                let vals = frags[f]
                    .iter()
                    .map(|&i| model.vals[i].borrow().clone())
                    .collect();
                log.push((step + 1, f, vals));
            }
        });
        log
    });
    // Steps (1-based) at which each fragment is updated: launched at 2(i+1) mod 6, +1.
    let expect: Vec<(u64, usize)> = (1..=18u64)
        .flat_map(|s| {
            (0..3usize).filter_map(move |f| {
                let o = 2 * (f as u64 + 1);
                (s > o && (s - 1 - o).is_multiple_of(6)).then_some((s, f))
            })
        })
        .collect();
    let got: Vec<(u64, usize)> = logs[0].iter().map(|(s, f, _)| (*s, *f)).collect();
    assert_eq!(got, expect);
    for r in 1..world {
        assert_eq!(logs[r].len(), logs[0].len());
        for (a, b) in logs[0].iter().zip(&logs[r]) {
            assert_eq!(
                a.2, b.2,
                "fragment {} differs at step {} on rank {r}",
                a.1, a.0
            );
        }
    }
}

/// Stopped after step 6 (a fragment's all-reduce in flight), saved with the parameters, loaded into
/// a fresh model and a fresh DiLoCo, and continued: the run equals the uninterrupted one bit for
/// bit.
#[test]
fn resume_is_exact_with_a_fragment_in_flight() {
    let cfg = DiLoCoConfig::streaming(4, 2, 1);
    let whole = run(2, |pg| train(&pg, Some(cfg), 12, |_, _, _| {}));
    let resumed = run(2, |pg| {
        let model = Model::new();
        let mut red = reducer(&pg, &model);
        red.register_comm_hook(PostLocalSgdHook::new(0)).unwrap();
        let mut d = DiLoCo::new(cfg, &model).unwrap();
        let mut saved = None;
        for step in 0..12 {
            if step == 6 {
                let state = d.state_dict().unwrap();
                assert!(
                    state.tensors.keys().any(|k| k.starts_with("pending.")),
                    "no fragment in flight at step 6: the test tests less than it says"
                );
                saved = Some((state, model.values()));
                // A fresh DiLoCo and model, from the saved state.
                let (state, values) = saved.as_ref().unwrap();
                for (v, s) in model.vals.iter().zip(values) {
                    *v.borrow_mut() = s.clone();
                }
                d = DiLoCo::new(cfg, &model).unwrap();
                d.load_state_dict(state).unwrap();
            }
            let g = sync(&mut red, &model, &model.grads(pg.rank(), step));
            model.sgd(&g, INNER_LR);
            d.step(&pg, &model).unwrap();
        }
        assert!(saved.is_some());
        model.values()
    });
    assert_eq!(whole, resumed);
}

/// A rank joining between synchronizations: world 2 trains 5 steps of DiLoCo (H = 3: synchronized
/// at step 3, step 5 is between two), then world 3 goes on — ranks 0 and 1 from their own
/// parameters and outer state, the newcomer from rank 0's outer state and the last-synchronized
/// parameters (`restore_anchor`) — to step 9. Against a reference with plain loops in f64 where
/// the newcomer starts at the anchor at step 5 and the average at steps 6 and 9 is over 3 ranks.
#[test]
fn a_rank_joining_between_synchronizations_starts_from_the_anchor() {
    let (h, join_at, steps) = (3u64, 5u64, 9u64);
    let cfg = DiLoCoConfig::new(h);
    let inner = |model: &Model, red: &mut ddp_core::reducer::Reducer, rank: usize, step: u64| {
        let g = sync(red, model, &model.grads(rank, step));
        model.sgd(&g, INNER_LR);
    };
    let saved = run(2, |pg| {
        let model = Model::new();
        let mut red = reducer(&pg, &model);
        red.register_comm_hook(PostLocalSgdHook::new(0)).unwrap();
        let mut d = DiLoCo::new(cfg, &model).unwrap();
        for step in 0..join_at {
            inner(&model, &mut red, pg.rank(), step);
            d.step(&pg, &model).unwrap();
        }
        assert_eq!(d.last_sync_step(), h);
        (d.state_dict().unwrap(), model.values())
    });
    assert_eq!(
        saved[0].0, saved[1].0,
        "the outer state differs between ranks"
    );
    assert_ne!(
        saved[0].1, saved[1].1,
        "no local progress since the sync: the test is blind"
    );
    let got = run(3, |pg| {
        let rank = pg.rank();
        let model = Model::new();
        let mut red = reducer(&pg, &model);
        red.register_comm_hook(PostLocalSgdHook::new(0)).unwrap();
        let mut d = DiLoCo::new(cfg, &model).unwrap();
        let (state, values) = &saved[if rank < 2 { rank } else { 0 }];
        d.load_state_dict(state).unwrap();
        if rank < 2 {
            for (v, s) in model.vals.iter().zip(values) {
                *v.borrow_mut() = s.clone();
            }
        } else {
            d.restore_anchor(&model).unwrap();
        }
        for step in join_at..steps {
            inner(&model, &mut red, rank, step);
            d.step(&pg, &model).unwrap();
        }
        model.values()
    });
    // The reference, in f64.
    let (lr, mu) = (cfg.outer_lr, cfg.momentum);
    let init = to64(&Model::new().values());
    let mut anchor = init.clone();
    let mut m: Vec<Vec<f64>> = init.iter().map(|v| vec![0.0; v.len()]).collect();
    let mut local = vec![init.clone(), init.clone()];
    for step in 0..steps {
        if step == join_at {
            local.push(anchor.clone());
        }
        for (r, w) in local.iter_mut().enumerate() {
            for (i, v) in w.iter_mut().enumerate() {
                for (k, x) in v.iter_mut().enumerate() {
                    let g =
                        *x + 0.25 * *x * *x * *x - noise(r as u64, step, i as u64, k as u64) as f64;
                    *x -= INNER_LR as f64 * g;
                }
            }
        }
        if (step + 1) % h == 0 {
            let n = local.len() as f64;
            for i in 0..anchor.len() {
                for k in 0..anchor[i].len() {
                    let delta: f64 = local.iter().map(|w| anchor[i][k] - w[i][k]).sum::<f64>() / n;
                    m[i][k] = mu * m[i][k] + delta;
                    anchor[i][k] -= lr * (delta + mu * m[i][k]);
                }
            }
            local.iter_mut().for_each(|w| *w = anchor.clone());
        }
    }
    for (r, g) in got.iter().enumerate() {
        let d = max_abs_diff(g, &anchor);
        assert!(d < 1e-5, "rank {r}: joined DiLoCo vs the reference: {d}");
    }
}

/// DiLoCo sends the parameters' size every H steps and nothing else; streaming spreads it over
/// F moments of the cycle in bf16: its largest send is at most 1/F of DiLoCo's.
#[test]
fn streaming_peak_bytes_are_at_most_1_over_f_of_diloco() {
    let peak = |cfg: DiLoCoConfig| -> (u64, u64) {
        run(2, move |pg| {
            let model = Model::new();
            let mut red = reducer(&pg, &model);
            red.register_comm_hook(PostLocalSgdHook::new(0)).unwrap();
            let mut d = DiLoCo::new(cfg, &model).unwrap();
            let (mut last, mut peak) = (0, 0);
            for step in 0..24 {
                let g = sync(&mut red, &model, &model.grads(pg.rank(), step));
                model.sgd(&g, INNER_LR);
                d.step(&pg, &model).unwrap();
                peak = peak.max(d.bytes_sent() - last);
                last = d.bytes_sent();
            }
            (peak, d.bytes_sent())
        })[0]
    };
    let numel: u64 = model_specs().iter().map(|s| s.numel() as u64).sum();
    let (dl_peak, dl_total) = peak(DiLoCoConfig::new(8));
    assert_eq!(dl_peak, 4 * numel);
    assert_eq!(dl_total, 3 * 4 * numel, "3 syncs in 24 steps");
    let f = 3;
    let (st_peak, _) = peak(DiLoCoConfig::streaming(8, f, 1));
    assert!(
        st_peak * f as u64 <= dl_peak,
        "streaming peak {st_peak} bytes, DiLoCo's {dl_peak}"
    );
}

#[test]
fn bad_settings_are_refused_naming_them() {
    let model = Model::new();
    let err = |cfg: DiLoCoConfig| DiLoCo::new(cfg, &model).err().unwrap().to_string();
    assert!(err(DiLoCoConfig::new(0)).contains("H"));
    assert!(err(DiLoCoConfig::streaming(4, 5, 0)).contains("fragments"));
    assert!(err(DiLoCoConfig::streaming(8, 2, 4)).contains("overlap"));
    assert!(err(plain(4, 0.0, 0.9)).contains("outer lr"));
    assert!(err(plain(4, 0.7, 1.0)).contains("momentum"));
}
