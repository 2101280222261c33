//! ZeRO stages 1 and 2 on Burn (`ddp_burn::ZeroDdp`) against plain DDP with the same Burn
//! optimizer, with real process groups (ranks as threads, TCP collectives) and real checkpoint
//! files: equal after every step, replicas bit-identical, `no_sync`, `Join`, clipping by global
//! norm, save sets resumed at other world sizes, and bad sets refused by name.

use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, ModuleOptimizer, Optimizer, SgdConfig};
use burn::tensor::Tensor;
use ddp_burn::{Ddp, DdpOptions, ZeroDdp};
use ddp_core::checkpoint::CheckpointMeta;
use ddp_core::sharding::{self, ZeroStage};
use std::path::Path;

mod common;

use common::*;

/// The global batch of every step: `G / world` samples per rank, so that every world size
/// trains on the same batches.
const G: usize = 12;

type History = Vec<Vec<(String, Vec<f32>)>>;

fn sgd_momentum() -> burn::optim::Sgd {
    SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .build()
}

fn adamw() -> burn::optim::AdamW {
    AdamWConfig::new().with_weight_decay(0.01).build()
}

fn tiny() -> DdpOptions {
    DdpOptions {
        bucket_cap_mb: 0.001,
        first_bucket_cap_mb: 0.0005,
        ..Default::default()
    }
}

/// The samples of every run: global batch `k` is samples `k * G..(k + 1) * G`.
fn data() -> (Vec<f32>, Vec<i64>) {
    dataset(G * 8)
}

/// Rank `rank`'s part of global batch `k`.
fn part(
    x: &[f32],
    y: &[i64],
    k: usize,
    rank: usize,
    world: usize,
) -> (
    burn::tensor::Tensor<2>,
    burn::tensor::Tensor<1, burn::tensor::Int>,
) {
    let per = G / world;
    let start = k * G + rank * per;
    batch(x, y, start..start + per)
}

/// `f(rank, zero)` on `world` ranks, each with a fresh ZeroDdp at `stage` over the model of
/// seed `7 + rank` (construction gives every rank rank 0's values); rank 0's result.
fn on_ranks<O: Optimizer, R: Send>(
    world: usize,
    stage: ZeroStage,
    optim: &O,
    opts: DdpOptions,
    hidden: usize,
    f: impl Fn(usize, &mut ZeroDdp<Mlp, O>) -> R + Sync,
) -> R {
    let mut out = run_ranks(world, |rank, pg| {
        let ddp = Ddp::new(model(7 + rank as u64, hidden), &pg, opts).unwrap();
        let mut z = ZeroDdp::new(ddp, stage, optim.clone()).unwrap();
        f(rank, &mut z)
    });
    out.swap_remove(0)
}

/// Global batches `from..to` at `world`: backward and step, replicas checked bit-identical
/// after every step; the parameters after each.
fn train<O: Optimizer>(
    z: &mut ZeroDdp<Mlp, O>,
    rank: usize,
    world: usize,
    from: usize,
    to: usize,
) -> History {
    let (x, y) = data();
    let mut history = Vec::new();
    for k in from..to {
        let (xs, ys) = part(&x, &y, k, rank, world);
        let loss = z.module().loss(xs, ys);
        let stats = z.backward(loss).unwrap();
        assert!(stats.synced);
        z.step(LR).unwrap();
        assert_eq!(
            z.replica_max_diff().unwrap(),
            0.0,
            "step {k}: replicas differ"
        );
        history.push(z.module().params());
    }
    history
}

/// Plain DDP with Burn's `ModuleOptimizer` over the same optimizer (no ZeRO code).
fn ddp_history<O: Optimizer>(world: usize, optim: &O, opts: DdpOptions, steps: usize) -> History {
    let (x, y) = data();
    let mut out = run_ranks(world, |rank, pg| {
        let mut ddp = Ddp::new(model(7 + rank as u64, HID), &pg, opts).unwrap();
        let mut opt = ModuleOptimizer::from(optim.clone());
        let mut history = Vec::new();
        for k in 0..steps {
            let (xs, ys) = part(&x, &y, k, rank, world);
            let grads = ddp.backward(ddp.module().loss(xs, ys)).unwrap();
            ddp.step(&mut opt, LR, grads);
            history.push(ddp.module().params());
        }
        history
    });
    out.swap_remove(0)
}

fn assert_histories(got: &History, want: &History, tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert_close(g, w, tol, &format!("{what}, step {k}"));
    }
}

fn equals_ddp<O: Optimizer>(optim: O, name: &str) {
    const STEPS: usize = 4;
    for (sizes, opts) in [
        ("tiny buckets", tiny()),
        ("default buckets", DdpOptions::default()),
    ] {
        for world in [2, 3, 4] {
            let want = ddp_history(world, &optim, opts, STEPS);
            for stage in [ZeroStage::Ddp, ZeroStage::One, ZeroStage::Two] {
                let got = on_ranks(world, stage, &optim, opts, HID, |rank, z| {
                    train(z, rank, world, 0, STEPS)
                });
                let what = format!("{name}, {sizes}, world {world}, {stage:?}");
                assert_histories(&got, &want, 1e-6, &what);
            }
        }
    }
}

#[test]
fn every_stage_equals_ddp_with_sgd_momentum_at_world_2_3_4() {
    equals_ddp(sgd_momentum(), "SGD momentum 0.9");
}

#[test]
fn every_stage_equals_ddp_with_adamw_at_world_2_3_4() {
    equals_ddp(adamw(), "AdamW");
}

/// Each rank keeps optimizer state for its chunks only: together they cover the model once.
/// PyTorch's two parameter groups under ZeRO (`with_weight_decay_groups`: decay on the 2-D
/// weights only, the optimizer built without decay) against plain DDP with Burn's
/// `ModuleOptimizer` whose bias group has no decay (no ZeRO code), with chunks that span both
/// kinds (tiny buckets, worlds 2 and 3).
#[test]
fn weight_decay_groups_under_zero_equal_ddp_with_parameter_groups() {
    use burn::module::ParamGroup;
    const STEPS: usize = 4;
    let adamw = |wd: f32| AdamWConfig::new().with_weight_decay(wd);
    let (x, y) = data();
    for world in [2, 3] {
        let mut want = run_ranks(world, |rank, pg| {
            let mut ddp = Ddp::new(model(7 + rank as u64, HID), &pg, tiny()).unwrap();
            let biases = ParamGroup::from_any_predicates(vec![".bias"]);
            let mut opt = adamw(0.01)
                .init()
                .with_group(biases, adamw(0.0).build(), None);
            let mut history = Vec::new();
            for k in 0..STEPS {
                let (xs, ys) = part(&x, &y, k, rank, world);
                let grads = ddp.backward(ddp.module().loss(xs, ys)).unwrap();
                ddp.step(&mut opt, LR, grads);
                history.push(ddp.module().params());
            }
            history
        })
        .swap_remove(0);
        let plain = ddp_history(world, &adamw(0.01).build(), tiny(), STEPS);
        assert!(
            plain.last() != want.last(),
            "the groups change the result (the test can tell)"
        );
        for stage in [ZeroStage::One, ZeroStage::Two] {
            let got = run_ranks(world, |rank, pg| {
                let ddp = Ddp::new(model(7 + rank as u64, HID), &pg, tiny()).unwrap();
                let z = ZeroDdp::new(ddp, stage, adamw(0.0).build()).unwrap();
                let mut z = z
                    .with_weight_decay_groups(0.01, |_, dims| dims.len() >= 2)
                    .unwrap();
                train(&mut z, rank, world, 0, STEPS)
            })
            .swap_remove(0);
            let what = format!("decay groups, world {world}, {stage:?}");
            assert_histories(&got, &want, 1e-6, &what);
        }
        want.clear();
    }
    let stage0 = run_ranks(1, |_, pg| {
        let ddp = Ddp::new(model(7, HID), &pg, tiny()).unwrap();
        let z = ZeroDdp::new(ddp, ZeroStage::Ddp, adamw(0.0).build()).unwrap();
        z.with_weight_decay_groups(0.01, |_, _| true)
            .err()
            .unwrap()
            .to_string()
    });
    assert!(stage0[0].contains("ModuleOptimizer"), "{}", stage0[0]);
}

#[test]
fn the_shards_partition_the_model_and_its_optimizer_state() {
    let world = 3;
    let per_rank = run_ranks(world, |rank, pg| {
        let ddp = Ddp::new(model(7, HID), &pg, tiny()).unwrap();
        let mut z = ZeroDdp::new(ddp, ZeroStage::Two, adamw()).unwrap();
        train(&mut z, rank, world, 0, 1);
        let s = z.shard_state().unwrap();
        let owned: usize = s.chunks.iter().map(|c| c.params.len()).sum();
        let moments: usize = s
            .chunks
            .iter()
            .map(|c| c.slots.get("momentum/moment_1").map_or(0, Vec::len))
            .sum();
        assert_eq!(owned, z.layout().owned_numel());
        assert_eq!(owned, moments, "a moment per owned element");
        assert_eq!(s.optimizer.kind, "burn.adamw");
        (owned, z.layout().numel())
    });
    let total: usize = per_rank.iter().map(|p| p.0).sum();
    assert_eq!(total, per_rank[0].1, "owned chunks partition the model");
    let params: usize = model(7, HID).params().iter().map(|p| p.1.len()).sum();
    assert_eq!(total, params);
}

/// `K - 1` micro-batches under no_sync, then a synchronized one: stages 1 and 2 equal stage 0.
#[test]
fn no_sync_accumulation_under_zero_equals_ddp() {
    const K: usize = 3;
    let world = 2;
    let (x, y) = dataset(G * K * 2);
    let run = |stage| {
        on_ranks(world, stage, &sgd_momentum(), tiny(), HID, |rank, z| {
            for s in 0..2 {
                z.set_require_backward_grad_sync(false);
                for j in 0..K - 1 {
                    let (xs, ys) = part(&x, &y, s * K + j, rank, world);
                    let st = z.backward(z.module().loss(xs, ys) / K as f32).unwrap();
                    assert!(!st.synced);
                    assert!(z.step(LR).is_err(), "no step on local gradients");
                }
                z.set_require_backward_grad_sync(true);
                let (xs, ys) = part(&x, &y, s * K + K - 1, rank, world);
                z.backward(z.module().loss(xs, ys) / K as f32).unwrap();
                z.step(LR).unwrap();
            }
            assert_eq!(z.replica_max_diff().unwrap(), 0.0);
            z.module().params()
        })
    };
    let want = run(ZeroStage::Ddp);
    for stage in [ZeroStage::One, ZeroStage::Two] {
        assert_close(&run(stage), &want, 1e-6, &format!("{stage:?}"));
    }
}

/// Rank 0 runs out after 2 batches, rank 1 after 4: stages 1 and 2 under Join equal stage 0.
#[test]
fn join_with_uneven_inputs_under_zero_equals_ddp() {
    let counts = [2usize, 4];
    let (x, y) = dataset(G * 8);
    let run = |stage| {
        on_ranks(2, stage, &adamw(), tiny(), HID, |rank, z| {
            let pg = z.process_group().clone();
            let mut join = ddp_core::Join::new(&pg);
            let mut i = 0;
            while let Some(step) = join.begin_step(i < counts[rank]).unwrap() {
                let loss = step.has_data.then(|| {
                    let (xs, ys) = part(&x, &y, 2 * i + rank, rank, 2);
                    z.module().loss(xs, ys)
                });
                z.backward_join(loss, &join, &step).unwrap();
                z.step(LR).unwrap();
                i += 1;
            }
            assert_eq!(i, 4);
            assert_eq!(z.replica_max_diff().unwrap(), 0.0);
            z.module().params()
        })
    };
    let want = run(ZeroStage::Ddp);
    for stage in [ZeroStage::One, ZeroStage::Two] {
        assert_close(&run(stage), &want, 1e-6, &format!("{stage:?}"));
    }
}

/// The global norm is all-reduced from the shards: the same norm and the same clipped steps as
/// clipping whole gradients.
#[test]
fn clipping_by_global_norm_matches_ddp_across_shards() {
    let world = 3;
    let run = |stage| {
        on_ranks(world, stage, &adamw(), tiny(), HID, |rank, z| {
            let (x, y) = dataset(G * 3);
            let mut norms = Vec::new();
            for k in 0..3 {
                let (xs, ys) = part(&x, &y, k, rank, world);
                z.backward(z.module().loss(xs, ys)).unwrap();
                norms.push(z.clip_grad_norm(0.05).unwrap());
                z.step(LR).unwrap();
            }
            (norms, z.module().params())
        })
    };
    let (want_norms, want) = run(ZeroStage::Ddp);
    assert!(
        want_norms[0] > 0.05,
        "the test clips: norm {}",
        want_norms[0]
    );
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let (norms, got) = run(stage);
        for (a, b) in norms.iter().zip(&want_norms) {
            assert!((a - b).abs() <= 1e-6 * b, "{stage:?}: norm {a} vs {b}");
        }
        assert_close(&got, &want, 1e-6, &format!("{stage:?}"));
    }
}

fn meta(step: usize, world: usize) -> CheckpointMeta {
    CheckpointMeta {
        step: step as u64,
        world_size: world,
        ..Default::default()
    }
}

/// Saves after 3 steps at `n` ranks and stage `saved`, resumes at `m` ranks and stage `loaded`:
/// the loaded parameters are the consolidated checkpoint's exactly, and 3 more steps equal an
/// uninterrupted DDP run of 6 steps at `m` (the same global batches).
fn resume_case<O: Optimizer>(n: usize, saved: ZeroStage, m: usize, loaded: ZeroStage, optim: O) {
    let what = format!(
        "{n}->{m} {saved:?}->{loaded:?} {}",
        std::any::type_name::<O>()
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    on_ranks(n, saved, &optim, tiny(), HID, |rank, z| {
        train(z, rank, n, 0, 3);
        z.save(d, &meta(3, n)).unwrap();
    });
    let ckpt = sharding::consolidate(d).unwrap().unwrap();
    let resumed = on_ranks(m, loaded, &optim, tiny(), HID, |rank, z| {
        let meta = z.load(d).unwrap().expect("a save set");
        assert_eq!(meta.step, 3);
        assert_eq!(z.steps(), 3);
        assert_eq!(z.replica_max_diff().unwrap(), 0.0);
        for (name, v) in z.module().params() {
            assert_eq!(&ckpt.require(&name).unwrap().data, &v, "{what}: `{name}`");
        }
        train(z, rank, m, 3, 6)
    });
    let want = ddp_history(m, &optim, tiny(), 6);
    assert_histories(&resumed, &want[3..].to_vec(), 1e-5, &what);
}

#[test]
fn a_save_set_resumes_at_another_world_size_exactly() {
    resume_case(4, ZeroStage::Two, 2, ZeroStage::Two, adamw());
    resume_case(2, ZeroStage::One, 3, ZeroStage::One, sgd_momentum());
    resume_case(3, ZeroStage::Two, 1, ZeroStage::One, adamw());
    resume_case(3, ZeroStage::One, 1, ZeroStage::Two, sgd_momentum());
}

#[test]
fn import_of_the_consolidated_checkpoint_equals_loading_the_set() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    on_ranks(2, ZeroStage::Two, &adamw(), tiny(), HID, |rank, z| {
        train(z, rank, 2, 0, 3);
        z.save(d, &meta(3, 2)).unwrap();
    });
    let ckpt = sharding::consolidate(d).unwrap().unwrap();
    assert_eq!(ckpt.optimizer.as_ref().unwrap().kind, "burn.adamw");
    assert_eq!(ckpt.optimizer.as_ref().unwrap().step, 3);
    let loaded = on_ranks(3, ZeroStage::One, &adamw(), tiny(), HID, |rank, z| {
        z.load(d).unwrap().unwrap();
        train(z, rank, 3, 3, 5)
    });
    let imported = on_ranks(3, ZeroStage::One, &adamw(), tiny(), HID, |rank, z| {
        z.import(&ckpt).unwrap();
        train(z, rank, 3, 3, 5)
    });
    assert_eq!(
        imported, loaded,
        "import and load give the same run, bit for bit"
    );
}

/// Loads `dir` at world 2 with `optim` into a model of `hidden` units; each rank's error and
/// whether its parameters and shard were left untouched.
fn failing_load<O: Optimizer>(dir: &Path, optim: O, hidden: usize) -> Vec<(String, bool)> {
    run_ranks(2, |rank, pg| {
        let ddp = Ddp::new(model(7 + rank as u64, hidden), &pg, tiny()).unwrap();
        let mut z = ZeroDdp::new(ddp, ZeroStage::Two, optim.clone()).unwrap();
        let before = (z.module().params(), z.shard_state().unwrap());
        let e = z.load(dir).unwrap_err().to_string();
        (e, (z.module().params(), z.shard_state().unwrap()) == before)
    })
}

#[test]
fn bad_sets_are_refused_by_name_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    on_ranks(2, ZeroStage::One, &adamw(), tiny(), HID, |rank, z| {
        train(z, rank, 2, 0, 2);
        z.save(d, &meta(2, 2)).unwrap();
    });
    // Another model (other hidden size).
    for (e, unchanged) in failing_load(d, adamw(), HID + 1) {
        assert!(e.contains("another model"), "{e}");
        assert!(unchanged);
    }
    // Another optimizer.
    for (e, unchanged) in failing_load(d, sgd_momentum(), HID) {
        assert!(e.contains("burn.adamw") && e.contains("burn.sgd"), "{e}");
        assert!(unchanged);
    }
    // A shard missing.
    let set = sharding::latest_set(d).unwrap().unwrap();
    std::fs::remove_dir_all(set.join("rank1")).unwrap();
    for (e, unchanged) in failing_load(d, adamw(), HID) {
        assert!(e.contains("rank 1") && e.contains("missing"), "{e}");
        assert!(unchanged);
    }
}

#[test]
fn stage_3_and_stage_0_checkpoints_are_refused_with_the_way_out() {
    let e = run_ranks(1, |_, pg| {
        let ddp = Ddp::new(model(7, HID), &pg, tiny()).unwrap();
        ZeroDdp::new(ddp, ZeroStage::Three, adamw())
            .err()
            .unwrap()
            .to_string()
    });
    assert!(e[0].contains("stage 3"), "{}", e[0]);
    let dir = tempfile::tempdir().unwrap();
    let e = on_ranks(1, ZeroStage::Ddp, &adamw(), tiny(), HID, |_, z| {
        z.save(dir.path(), &meta(0, 1)).unwrap_err().to_string()
    });
    assert!(e.contains("ddp_burn::checkpoint"), "{e}");
}

/// The staged backward's stages for the test MLP: one per layer.
fn stage0(m: &Mlp, x: Tensor<2>) -> Tensor<2> {
    burn::tensor::activation::relu(m.l1.forward(x))
}

fn stage1(m: &Mlp, h: Tensor<2>) -> Tensor<2> {
    m.l2.forward(h).tanh()
}

fn stage2(m: &Mlp, h: Tensor<2>) -> Tensor<2> {
    m.l3.forward(h)
}

/// [`train`] through `forward_backward_blockwise`, `K` micro-batches per step (the first `K - 1`
/// under no_sync, losses scaled by `1/K`).
fn train_staged<O: Optimizer, const K: usize>(
    z: &mut ZeroDdp<Mlp, O>,
    rank: usize,
    world: usize,
    steps: usize,
) -> History {
    let (x, y) = data();
    let stages: [ddp_burn::Block<'_, Mlp, 2>; 3] = [&stage0, &stage1, &stage2];
    let mut history = Vec::new();
    for k in 0..steps {
        for j in 0..K {
            z.set_require_backward_grad_sync(j == K - 1);
            let (xs, ys) = part(&x, &y, k * K + j, rank, world);
            let loss_fn = |out: Tensor<2>| {
                burn::nn::loss::CrossEntropyLossConfig::new()
                    .init(&out.device())
                    .forward(out, ys)
                    / K as f32
            };
            let (stats, _) = z.forward_backward_blockwise(&stages, xs, loss_fn).unwrap();
            assert_eq!(stats.synced, j == K - 1);
        }
        z.step(LR).unwrap();
        assert_eq!(
            z.replica_max_diff().unwrap(),
            0.0,
            "step {k}: replicas differ"
        );
        history.push(z.module().params());
    }
    history
}

/// One stage at a time (each stage's gradients reduced before the stage before it computes)
/// trains as the plain backward does: DDP and ZeRO stages 1 and 2, with and without no_sync.
#[test]
fn the_staged_backward_equals_the_plain_one() {
    let world = 2;
    let want = ddp_history(world, &adamw(), tiny(), 3);
    for stage in [ZeroStage::Ddp, ZeroStage::One, ZeroStage::Two] {
        let got = on_ranks(world, stage, &adamw(), tiny(), HID, |rank, z| {
            train_staged::<_, 1>(z, rank, world, 3)
        });
        assert_histories(&got, &want, 1e-6, &format!("staged, {stage:?}"));
    }
    // Two micro-batches per step, the first under no_sync: the plain path on the same schedule.
    let plain = on_ranks(
        world,
        ZeroStage::Ddp,
        &sgd_momentum(),
        tiny(),
        HID,
        |rank, z| {
            let (x, y) = data();
            let mut history = Vec::new();
            for k in 0..2 {
                for j in 0..2 {
                    z.set_require_backward_grad_sync(j == 1);
                    let (xs, ys) = part(&x, &y, k * 2 + j, rank, world);
                    z.backward(z.module().loss(xs, ys) / 2.0).unwrap();
                }
                z.step(LR).unwrap();
                history.push(z.module().params());
            }
            history
        },
    );
    for stage in [ZeroStage::Ddp, ZeroStage::Two] {
        let got = on_ranks(world, stage, &sgd_momentum(), tiny(), HID, |rank, z| {
            train_staged::<_, 2>(z, rank, world, 2)
        });
        assert_histories(&got, &plain, 1e-6, &format!("staged no_sync, {stage:?}"));
    }
}

/// Under no_sync the staged backward returns this rank's own gradients of every stage, as the
/// plain backward does.
#[test]
fn the_staged_backward_under_no_sync_returns_every_local_gradient() {
    let (x, y) = data();
    let got = run_ranks(2, |rank, pg| {
        let mut ddp = Ddp::new(model(7, HID), &pg, tiny()).unwrap();
        let (xs, ys) = part(&x, &y, 0, rank, 2);
        let mut guard = ddp.no_sync();
        let loss = guard.module().loss(xs.clone(), ys.clone());
        let plain = guard.backward(loss).unwrap();
        let stages: [ddp_burn::Block<'_, Mlp, 2>; 3] = [&stage0, &stage1, &stage2];
        let loss_fn = |out: Tensor<2>| {
            burn::nn::loss::CrossEntropyLossConfig::new()
                .init(&out.device())
                .forward(out, ys)
        };
        let (staged, _) = guard
            .forward_backward_blockwise(&stages, xs, loss_fn)
            .unwrap();
        let m = guard.module();
        let ids2 = [m.l1.weight.id, m.l2.weight.id, m.l3.weight.id];
        let ids1 = [m.l1.bias.id, m.l2.bias.id, m.l3.bias.id];
        let both = |g: &burn::optim::GradientsParams| {
            let mut v: Vec<Vec<f32>> = ids2
                .iter()
                .map(|&i| values(g.get::<2>(i).unwrap()))
                .collect();
            v.extend(ids1.iter().map(|&i| values(g.get::<1>(i).unwrap())));
            v
        };
        (both(&plain), both(&staged))
    });
    for (plain, staged) in got {
        for (p, s) in plain.iter().zip(&staged) {
            assert!(
                rel_diff(s, p) <= 1e-6,
                "staged local gradient differs: {}",
                rel_diff(s, p)
            );
        }
    }
}
