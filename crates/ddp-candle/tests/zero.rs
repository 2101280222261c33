//! ZeRO stages 1 and 2 (`ddp_candle::ZeroDdp`) against plain DDP, and sharded checkpoints
//! resumed at other world sizes. Ranks are threads with real process groups.

mod common;

use candle_core::Tensor;
use candle_nn::ParamsAdamW;
use common::*;
use ddp::checkpoint::CheckpointMeta;
use ddp::sharding::{self, ZeroStage};
use ddp_candle::optim::{AdamW, DynOptimizer, ParamsSgd, Sgd};
use ddp_candle::{Ddp, DdpOptions, ZeroDdp};
use std::path::Path;

/// Samples per step over all ranks (divisible by every world size used: 1, 2, 3, 4).
const GLOBAL: usize = 12;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Opt {
    SgdMomentum,
    AdamW,
}

fn make_opt(
    opt: Opt,
) -> impl FnOnce(Vec<(String, candle_core::Var)>) -> ddp_candle::Result<Box<dyn DynOptimizer>> {
    move |vars| -> ddp_candle::Result<Box<dyn DynOptimizer>> {
        Ok(match opt {
            Opt::SgdMomentum => Box::new(Sgd::new_named(
                vars,
                ParamsSgd {
                    lr: 0.05,
                    momentum: 0.9,
                    weight_decay: 0.01,
                    ..Default::default()
                },
            )?),
            Opt::AdamW => Box::new(AdamW::new_named(
                vars,
                ParamsAdamW {
                    lr: 0.01,
                    weight_decay: 0.01,
                    ..Default::default()
                },
            )?),
        })
    }
}

/// This rank's share of global step `k`'s batch.
fn loss_at(m: &Mlp, k: usize, rank: usize, world: usize) -> Tensor {
    let (x, y) = dataset(64 * GLOBAL);
    let per = GLOBAL / world;
    let start = (k * GLOBAL) % (60 * GLOBAL) + rank * per;
    let (xs, ys) = batch(&x, &y, start..start + per);
    candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap()
}

/// Trains `steps` steps from global step `from` at `stage`; returns every rank's parameters.
fn train(
    world: usize,
    stage: ZeroStage,
    opt: Opt,
    opts: DdpOptions,
    steps: usize,
    clip: Option<f64>,
) -> Vec<Vec<(String, Vec<f32>)>> {
    run_ranks(world, |rank, pg| {
        let (vm, m) = model(7, HID);
        let ddp = Ddp::new(&vm, &pg, opts).unwrap();
        let mut z = ZeroDdp::new(ddp, stage, make_opt(opt)).unwrap();
        for k in 0..steps {
            z.backward(&loss_at(&m, k, rank, world)).unwrap();
            if let Some(c) = clip {
                z.clip_grad_norm(c).unwrap();
            }
            z.step().unwrap();
        }
        let report = z.ddp().verify_replicas().unwrap();
        assert_eq!(report.max_abs_diff, 0.0, "replicas differ at {stage:?}");
        params(z.ddp())
    })
}

#[test]
fn stages_1_and_2_equal_ddp_for_sgd_momentum_and_adamw_at_world_2_3_4() {
    for world in [2, 3, 4] {
        for (bname, opts) in [("tiny", tiny_buckets()), ("default", DdpOptions::default())] {
            for opt in [Opt::SgdMomentum, Opt::AdamW] {
                let want = train(world, ZeroStage::Ddp, opt, opts, 5, None);
                for stage in [ZeroStage::One, ZeroStage::Two] {
                    let got = train(world, stage, opt, opts, 5, None);
                    for r in 0..world {
                        assert_eq!(got[r], got[0], "ranks are bit-identical");
                    }
                    let what = format!("world {world}, {bname} buckets, {opt:?}, {stage:?}");
                    assert_close(&got[0], &want[0], 1e-6, &what);
                }
            }
        }
    }
}

/// One training run at `world` ranks and `stage`, each rank running `body` on its wrapper;
/// checks that the replicas end bit-identical and returns every rank's parameters.
fn run_zero(
    world: usize,
    stage: ZeroStage,
    opt: Opt,
    body: impl Fn(&mut ZeroDdp, &Mlp, usize, &ddp_comm::ProcessGroup) + Sync,
) -> Vec<Vec<(String, Vec<f32>)>> {
    run_ranks(world, |rank, pg| {
        let (vm, m) = model(7, HID);
        let ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        let mut z = ZeroDdp::new(ddp, stage, make_opt(opt)).unwrap();
        body(&mut z, &m, rank, &pg);
        let report = z.ddp().verify_replicas().unwrap();
        assert_eq!(report.max_abs_diff, 0.0, "replicas differ at {stage:?}");
        params(z.ddp())
    })
}

/// Stages 1 and 2 against stage 0 (plain DDP) running the same `body`, at worlds 2 and 3.
fn zero_matches_ddp(
    what: &str,
    opt: Opt,
    body: impl Fn(&mut ZeroDdp, &Mlp, usize, &ddp_comm::ProcessGroup) + Sync + Copy,
) {
    for world in [2, 3] {
        let want = run_zero(world, ZeroStage::Ddp, opt, body);
        for stage in [ZeroStage::One, ZeroStage::Two] {
            let got = run_zero(world, stage, opt, body);
            for r in 0..world {
                assert_eq!(got[r], got[0], "{what}: ranks are bit-identical");
            }
            let what = format!("{what}, world {world}, {opt:?}, {stage:?}");
            assert_close(&got[0], &want[0], 1e-6, &what);
        }
    }
}

/// `no_sync` under ZeRO: K - 1 micro-batches accumulated locally (nothing sent), then one
/// synchronized backward and the step, as under plain DDP.
#[test]
fn no_sync_accumulation_under_zero_equals_ddp() {
    const K: usize = 3;
    zero_matches_ddp("no_sync", Opt::AdamW, |z, m, rank, pg| {
        let world = pg.size();
        let micro = |k: usize| (loss_at(m, k, rank, world) / K as f64).unwrap();
        for step in 0..3 {
            z.set_require_backward_grad_sync(false);
            for k in 0..K - 1 {
                let stats = z.backward(&micro(step * K + k)).unwrap();
                assert!(
                    !stats.synced && stats.bytes == 0,
                    "no_sync must not communicate"
                );
            }
            z.set_require_backward_grad_sync(true);
            assert!(z.backward(&micro(step * K + K - 1)).unwrap().synced);
            z.step().unwrap();
        }
    });
}

/// `Join` under ZeRO: rank `r` has `2 + 2r` batches; the ranks that ran out shadow the
/// collectives (their shards still step, with the gradients averaged over the ranks with data)
/// until the last rank is done, as under plain DDP.
#[test]
fn join_with_uneven_inputs_under_zero_equals_ddp() {
    zero_matches_ddp("join", Opt::SgdMomentum, |z, m, rank, pg| {
        let world = pg.size();
        let mut join = ddp::Join::new(pg);
        let mut k = 0;
        while let Some(step) = join.begin_step(k < 2 + 2 * rank).unwrap() {
            let loss = step.has_data.then(|| loss_at(m, k, rank, world));
            z.backward_join(loss.as_ref(), &join, &step).unwrap();
            z.step().unwrap();
            k += 1;
        }
        assert_eq!(
            k,
            2 + 2 * (world - 1),
            "every rank runs until the last one is done"
        );
    });
}

#[test]
fn clipping_by_global_norm_matches_ddp_across_shards() {
    // A max norm far below the gradient norm: every step is clipped.
    let want = train(
        3,
        ZeroStage::Ddp,
        Opt::SgdMomentum,
        tiny_buckets(),
        4,
        Some(0.05),
    );
    let unclipped = train(3, ZeroStage::Two, Opt::SgdMomentum, tiny_buckets(), 4, None);
    let got = train(
        3,
        ZeroStage::Two,
        Opt::SgdMomentum,
        tiny_buckets(),
        4,
        Some(0.05),
    );
    assert_close(&got[0], &want[0], 1e-6, "clipped stage 2 vs clipped DDP");
    assert!(
        rel_diff(&got[0][0].1, &unclipped[0][0].1) > 1e-3,
        "clipping changed nothing"
    );
}

/// Trains `steps` sharded steps at `world` from `dir`'s checkpoint (or from scratch), then saves
/// to `dir` if asked; returns rank 0's parameters.
fn sharded_run(
    world: usize,
    stage: ZeroStage,
    opt: Opt,
    from: Option<&Path>,
    first: usize,
    steps: usize,
    save: Option<&Path>,
) -> Vec<(String, Vec<f32>)> {
    let out = run_ranks(world, |rank, pg| {
        let (vm, m) = model(7, HID);
        let ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        let mut z = ZeroDdp::new(ddp, stage, make_opt(opt)).unwrap();
        if let Some(d) = from {
            let meta = z.load(d).unwrap().expect("a save set");
            assert_eq!(meta.step as usize, first);
        }
        for k in first..first + steps {
            z.backward(&loss_at(&m, k, rank, world)).unwrap();
            z.step().unwrap();
        }
        if let Some(d) = save {
            let meta = CheckpointMeta {
                step: (first + steps) as u64,
                world_size: world,
                ..Default::default()
            };
            z.save(d, &meta).unwrap();
        }
        assert_eq!(z.ddp().replica_max_diff().unwrap(), 0.0);
        params(z.ddp())
    });
    out.into_iter().next().unwrap()
}

/// Plain DDP at `world` resumed from the consolidated checkpoint of `dir`.
fn ddp_from_consolidated(
    world: usize,
    opt: Opt,
    dir: &Path,
    first: usize,
    steps: usize,
) -> Vec<(String, Vec<f32>)> {
    let ckpt = sharding::consolidate(dir).unwrap().unwrap();
    let out = run_ranks(world, |rank, pg| {
        let (vm, m) = model(99, HID); // other values: everything comes from the checkpoint
        let ddp = Ddp::new(&vm, &pg, DdpOptions::default()).unwrap();
        ddp_candle::checkpoint::load_vars(&ckpt, ddp.named_vars()).unwrap();
        let mut z = ZeroDdp::new(ddp, ZeroStage::Ddp, make_opt(opt)).unwrap();
        ckpt.load_optimizer(z.optimizer_mut()).unwrap();
        for k in first..first + steps {
            z.backward(&loss_at(&m, k, rank, world)).unwrap();
            z.step().unwrap();
        }
        params(z.ddp())
    });
    out.into_iter().next().unwrap()
}

#[test]
fn a_save_set_resumes_at_another_world_size_exactly() {
    for (n, m, stage, opt) in [
        (4, 2, ZeroStage::Two, Opt::AdamW),
        (2, 3, ZeroStage::One, Opt::SgdMomentum),
        (3, 1, ZeroStage::Two, Opt::SgdMomentum),
        (3, 1, ZeroStage::One, Opt::AdamW),
    ] {
        let dir = tempfile::tempdir().unwrap();
        sharded_run(n, stage, opt, None, 0, 3, Some(dir.path()));
        // The set re-cut for m ranks, before any step, is the consolidated checkpoint exactly.
        let resumed_now = sharded_run(m, stage, opt, Some(dir.path()), 3, 0, None);
        let ckpt = sharding::consolidate(dir.path()).unwrap().unwrap();
        for (name, v) in &resumed_now {
            assert_eq!(&ckpt.require(name).unwrap().data, v, "{n}->{m}: `{name}`");
        }
        let resumed = sharded_run(m, stage, opt, Some(dir.path()), 3, 3, None);
        let want = ddp_from_consolidated(m, opt, dir.path(), 3, 3);
        assert_close(
            &resumed,
            &want,
            1e-6,
            &format!("{n}->{m} {stage:?} {opt:?}"),
        );
    }
}

#[test]
fn import_of_a_plain_checkpoint_equals_loading_the_set() {
    let dir = tempfile::tempdir().unwrap();
    sharded_run(2, ZeroStage::Two, Opt::AdamW, None, 0, 3, Some(dir.path()));
    let ckpt = sharding::consolidate(dir.path()).unwrap().unwrap();
    assert_eq!(ckpt.optimizer.as_ref().unwrap().kind, "adamw");
    assert_eq!(ckpt.optimizer.as_ref().unwrap().step, 3);
    let loaded = sharded_run(3, ZeroStage::Two, Opt::AdamW, Some(dir.path()), 3, 2, None);
    let imported = run_ranks(3, |rank, pg| {
        let (vm, m) = model(5, HID);
        let ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        let mut z = ZeroDdp::new(ddp, ZeroStage::Two, make_opt(Opt::AdamW)).unwrap();
        z.import(&ckpt).unwrap();
        for k in 3..5 {
            z.backward(&loss_at(&m, k, rank, 3)).unwrap();
            z.step().unwrap();
        }
        params(z.ddp())
    });
    assert_eq!(
        imported[0], loaded,
        "import and load give the same run, bit for bit"
    );
}

fn set_dir(dir: &Path) -> std::path::PathBuf {
    sharding::latest_set(dir).unwrap().unwrap()
}

/// Loads `dir` at world 2 into a model of `hidden` units; returns each rank's error and whether
/// its parameters were left untouched.
fn failing_load(dir: &Path, hidden: usize) -> Vec<(String, bool)> {
    run_ranks(2, |_, pg| {
        let (vm, _) = model(3, hidden);
        let ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        let mut z = ZeroDdp::new(ddp, ZeroStage::One, make_opt(Opt::AdamW)).unwrap();
        let before = params(z.ddp());
        let e = z.load(dir).unwrap_err().to_string();
        (e, params(z.ddp()) == before)
    })
}

#[test]
fn bad_sets_are_refused_by_name_and_change_nothing() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    sharded_run(2, ZeroStage::One, Opt::AdamW, None, 0, 1, Some(a.path()));
    sharded_run(2, ZeroStage::One, Opt::AdamW, None, 0, 2, Some(b.path()));

    // A checkpoint of another model (other hidden size): names the parameter.
    for (e, untouched) in failing_load(a.path(), HID + 1) {
        assert!(e.contains("another model") && e.contains("l1.bias"), "{e}");
        assert!(untouched);
    }
    // A shard from another save set.
    let (sa, sb) = (set_dir(a.path()), set_dir(b.path()));
    let victim = sa.join("rank1").join("checkpoint.safetensors");
    let saved = std::fs::read(&victim).unwrap();
    std::fs::copy(sb.join("rank1").join("checkpoint.safetensors"), &victim).unwrap();
    for (e, untouched) in failing_load(a.path(), HID) {
        assert!(e.contains("another save") && e.contains("rank1"), "{e}");
        assert!(untouched);
    }
    // A missing shard.
    std::fs::remove_file(&victim).unwrap();
    for (e, untouched) in failing_load(a.path(), HID) {
        assert!(e.contains("shard of rank 1 (of 2) is missing"), "{e}");
        assert!(untouched);
    }
    std::fs::write(&victim, saved).unwrap();
    // Repaired, it loads.
    sharded_run(2, ZeroStage::One, Opt::AdamW, Some(a.path()), 1, 0, None);
}

#[test]
fn a_failed_save_leaves_the_previous_set_current() {
    let dir = tempfile::tempdir().unwrap();
    let good = sharded_run(
        2,
        ZeroStage::Two,
        Opt::SgdMomentum,
        None,
        0,
        2,
        Some(dir.path()),
    );
    let first = set_dir(dir.path());
    let errors = run_ranks(2, |rank, pg| {
        let (vm, m) = model(7, HID);
        let ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        let mut z = ZeroDdp::new(ddp, ZeroStage::Two, make_opt(Opt::SgdMomentum)).unwrap();
        z.load(dir.path()).unwrap();
        z.backward(&loss_at(&m, 2, rank, 2)).unwrap();
        z.step().unwrap();
        if rank == 1 {
            // Rank 1's shard holds a NaN: its checkpoint refuses it, mid-save.
            let v = z.shard_vars().iter().flatten().next().unwrap();
            v.set(&(v.as_tensor() * f64::NAN).unwrap()).unwrap();
        }
        let meta = CheckpointMeta {
            step: 3,
            world_size: 2,
            ..Default::default()
        };
        z.save(dir.path(), &meta).unwrap_err().to_string()
    });
    assert!(
        errors[1].contains("not finite") || errors[1].contains("NaN"),
        "{}",
        errors[1]
    );
    assert!(errors[0].contains("rank(s) [1]"), "{}", errors[0]);
    assert_eq!(
        set_dir(dir.path()),
        first,
        "zero_latest still names the previous set"
    );
    let resumed = sharded_run(
        2,
        ZeroStage::Two,
        Opt::SgdMomentum,
        Some(dir.path()),
        2,
        0,
        None,
    );
    assert_eq!(resumed, good);
}

#[test]
fn stage_3_is_refused_by_name() {
    let e = ZeroStage::from_level(3).unwrap_err().to_string();
    assert!(e.contains("stage 3"), "{e}");
}
