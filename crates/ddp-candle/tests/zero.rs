//! ZeRO stages 1 and 2 (`ddp_candle::ZeroDdp`) and 3 (`ddp_candle::Fsdp`) against plain DDP,
//! and sharded checkpoints resumed at other world sizes and stages. Ranks are threads with real process groups.

mod common;

use candle_core::Module;
use candle_core::Tensor;
use common::zero::*;
use common::*;
use ddp_candle::{Ddp, DdpOptions, Fsdp, Unit, ZeroDdp};
use ddp_core::checkpoint::CheckpointMeta;
use ddp_core::reducer::StepStats;
use ddp_core::sharding::{self, ZeroStage};
use std::path::Path;

/// A rank's trainer at any stage: `ZeroDdp` (stages 0-2, over the full model) or `Fsdp` (stage
/// 3, over units), driven through one interface by the tests.
enum Trainer {
    Zero(Box<ZeroDdp>, Mlp),
    Fsdp(Box<Fsdp>),
}

impl Trainer {
    fn new(
        pg: &ddp_comm::ProcessGroup,
        stage: ZeroStage,
        opt: Opt,
        sizes: Sizes,
        seed: u64,
        hidden: usize,
    ) -> Trainer {
        Trainer::build(pg, stage, opt, sizes, seed, hidden, true)
    }

    /// `through`: stages 1/2 built by `ZeroDdp::with_optimizer` (the optimizer updates the
    /// parameters in place; no chunk variables), else by `ZeroDdp::new` over chunk variables.
    fn build(
        pg: &ddp_comm::ProcessGroup,
        stage: ZeroStage,
        opt: Opt,
        sizes: Sizes,
        seed: u64,
        hidden: usize,
        through: bool,
    ) -> Trainer {
        let (vm, m) = model(seed, hidden);
        if stage == ZeroStage::Three {
            let units = mlp_units(hidden, sizes);
            let f = Fsdp::from_varmap(&vm, units, pg, make_opt(opt)).unwrap();
            return Trainer::Fsdp(Box::new(f));
        }
        let ddp = Ddp::new(&vm, pg, sizes.ddp()).unwrap();
        let z = if through {
            ZeroDdp::with_optimizer(ddp, stage, shard_opt(opt)).unwrap()
        } else {
            ZeroDdp::new(ddp, stage, make_opt(opt)).unwrap()
        };
        Trainer::Zero(Box::new(z), m)
    }

    /// Forward and backward of global step `k`'s batch, the loss scaled by `scale`.
    fn backward_scaled(&mut self, k: usize, rank: usize, world: usize, scale: f64) -> StepStats {
        match self {
            Trainer::Zero(z, m) => z
                .backward(&(loss_at(m, k, rank, world) * scale).unwrap())
                .unwrap(),
            Trainer::Fsdp(f) => {
                let (xs, ys) = batch_at(k, rank, world);
                let loss = |o: &Tensor| candle_nn::loss::cross_entropy(o, &ys)? * scale;
                f.forward_backward(&xs, loss).unwrap().stats
            }
        }
    }

    /// [`backward`](Self::backward) through `ZeroDdp`'s staged path (one stage per layer);
    /// stage 3 is staged by its units already.
    fn backward_staged(&mut self, k: usize, rank: usize, world: usize) -> StepStats {
        let Trainer::Zero(z, m) = self else {
            return self.backward(k, rank, world);
        };
        let (xs, ys) = batch_at(k, rank, world);
        let s1 = |t: &Tensor| m.stage1(t);
        let s2 = |t: &Tensor| m.stage2(t);
        let s3 = |t: &Tensor| m.stage3(t);
        let stages: [&dyn Module; 3] = [&s1, &s2, &s3];
        let (stats, loss, _) = z
            .forward_backward_blockwise(&stages, &xs, |o| candle_nn::loss::cross_entropy(o, &ys))
            .unwrap();
        let plain = loss_at(m, k, rank, world).to_scalar::<f32>().unwrap();
        assert_eq!(loss.to_scalar::<f32>().unwrap(), plain, "the staged loss");
        stats
    }

    fn backward(&mut self, k: usize, rank: usize, world: usize) -> StepStats {
        self.backward_scaled(k, rank, world, 1.0)
    }

    /// Under `Join`: global step `k`'s batch if this rank has one.
    fn backward_join(
        &mut self,
        k: Option<usize>,
        rank: usize,
        world: usize,
        join: &ddp_core::Join,
        step: &ddp_core::JoinStep,
    ) {
        match self {
            Trainer::Zero(z, m) => {
                let loss = k.map(|k| loss_at(m, k, rank, world));
                z.backward_join(loss.as_ref(), join, step).unwrap();
            }
            Trainer::Fsdp(f) => {
                let b = k.map(|k| batch_at(k, rank, world));
                let batch = b
                    .as_ref()
                    .map(|(xs, ys)| (xs, move |o: &Tensor| candle_nn::loss::cross_entropy(o, ys)));
                f.forward_backward_join(batch, join, step).unwrap();
            }
        }
    }

    fn set_sync(&mut self, sync: bool) {
        match self {
            Trainer::Zero(z, _) => z.set_require_backward_grad_sync(sync),
            Trainer::Fsdp(f) => f.set_require_backward_grad_sync(sync),
        }
    }

    fn clip(&mut self, max_norm: f64) -> f64 {
        match self {
            Trainer::Zero(z, _) => z.clip_grad_norm(max_norm).unwrap(),
            Trainer::Fsdp(f) => f.clip_grad_norm(max_norm).unwrap(),
        }
    }

    fn step(&mut self) {
        match self {
            Trainer::Zero(z, _) => z.step().unwrap(),
            Trainer::Fsdp(f) => f.step().unwrap(),
        }
    }

    fn save(&self, dir: &Path, meta: &CheckpointMeta) -> ddp_candle::Result<std::path::PathBuf> {
        match self {
            Trainer::Zero(z, _) => z.save(dir, meta),
            Trainer::Fsdp(f) => f.save(dir, meta),
        }
    }

    fn load(&mut self, dir: &Path) -> ddp_candle::Result<Option<CheckpointMeta>> {
        match self {
            Trainer::Zero(z, _) => z.load(dir),
            Trainer::Fsdp(f) => f.load(dir),
        }
    }

    fn import(&mut self, ckpt: &ddp_core::Checkpoint) {
        match self {
            Trainer::Zero(z, _) => z.import(ckpt).unwrap(),
            Trainer::Fsdp(f) => f.import(ckpt).unwrap(),
        }
    }

    fn shard_vars(&self) -> &[Option<candle_core::Var>] {
        match self {
            Trainer::Zero(z, _) => z.shard_vars(),
            Trainer::Fsdp(f) => f.shard_vars(),
        }
    }

    /// Every parameter in full, sorted by name (stage 3 gathers them: a collective).
    fn params(&self) -> Vec<(String, Vec<f32>)> {
        match self {
            Trainer::Zero(z, _) => params(z.ddp()),
            Trainer::Fsdp(f) => f
                .full_params()
                .unwrap()
                .into_iter()
                .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1().unwrap()))
                .collect(),
        }
    }

    /// Weight decay on the 2-D weights only (nanoGPT's parameter groups).
    fn decay_weights_only(&mut self) {
        let weights = |_: &str, dims: &[usize]| dims.len() >= 2;
        match self {
            Trainer::Zero(z, _) => z.set_weight_decay_filter(weights).unwrap(),
            Trainer::Fsdp(f) => f.set_weight_decay_filter(weights).unwrap(),
        }
    }

    /// Asserts that the ranks' parameters are bit-identical (a collective).
    fn assert_replicas(&self, what: &str) {
        let report = match self {
            Trainer::Zero(z, _) => z.ddp().verify_replicas().unwrap(),
            Trainer::Fsdp(f) => f.verify_replicas().unwrap(),
        };
        assert_eq!(report.max_abs_diff, 0.0, "replicas differ: {what}");
    }
}

const SHARDED: [ZeroStage; 3] = [ZeroStage::One, ZeroStage::Two, ZeroStage::Three];

/// Trains `steps` steps at `stage`; returns every rank's parameters.
fn train(
    world: usize,
    stage: ZeroStage,
    opt: Opt,
    sizes: Sizes,
    steps: usize,
    clip: Option<f64>,
) -> Vec<Vec<(String, Vec<f32>)>> {
    run_zero(world, stage, opt, sizes, |z, rank, pg| {
        for k in 0..steps {
            z.backward(k, rank, pg.size());
            if let Some(c) = clip {
                z.clip(c);
            }
            z.step();
        }
    })
}

#[test]
fn every_stage_equals_ddp_for_sgd_momentum_and_adamw_at_world_2_3_4() {
    for world in [2, 3, 4] {
        for sizes in [Sizes::Tiny, Sizes::Default] {
            for opt in [Opt::SgdMomentum, Opt::AdamW] {
                let want = train(world, ZeroStage::Ddp, opt, sizes, 5, None);
                for stage in SHARDED {
                    let got = train(world, stage, opt, sizes, 5, None);
                    for r in 0..world {
                        assert_eq!(got[r], got[0], "ranks are bit-identical");
                    }
                    let what = format!("world {world}, {sizes:?} sizes, {opt:?}, {stage:?}");
                    assert_close(&got[0], &want[0], 1e-6, &what);
                }
            }
        }
    }
}

/// Over shared memory, with a bucket above the cross-memory-attach threshold, the parameter
/// all-gather reads the owners' chunks straight into the parameters
/// (`ProcessGroup::all_gather_in_place_to`): stages 1 and 2 equal DDP there too, with the
/// write-through optimizers and with chunk variables.
#[test]
fn the_all_gather_straight_into_the_parameters_equals_ddp() {
    const HIDDEN: usize = 600; // l2's weight: 1.4 MB
    let shm = ddp_comm::testing::LocalGroup {
        backend: ddp_comm::Backend::Shm,
        ..Default::default()
    };
    for world in [2, 3] {
        for opt in [Opt::SgdMomentum, Opt::AdamW] {
            let run = |stage: ZeroStage, through: bool| {
                ddp_comm::testing::run_local_group(world, shm, |pg| {
                    let rank = pg.rank();
                    let min = pg
                        .direct_gather_min()
                        .expect("cross-memory attach among threads");
                    let mut z = Trainer::build(&pg, stage, opt, Sizes::Default, 7, HIDDEN, through);
                    if let Trainer::Zero(zd, _) = &z {
                        let big = zd
                            .ddp()
                            .reducer()
                            .buckets()
                            .iter()
                            .any(|b| 4 * b.numel >= min);
                        assert!(big, "a bucket of at least {min} bytes");
                    }
                    for k in 0..3 {
                        z.backward(k, rank, world);
                        z.step();
                    }
                    z.assert_replicas(&format!("{stage:?}"));
                    z.params()
                })
            };
            let want = run(ZeroStage::Ddp, true);
            for stage in SHARDED {
                for through in [true, false] {
                    let got = run(stage, through);
                    let what =
                        format!("world {world}, {opt:?}, {stage:?}, write-through {through}");
                    assert_close(&got[0], &want[0], 1e-6, &what);
                }
            }
        }
    }
}

/// Stage 2 keeping its last buckets whole (`ZeroOptions::keep_whole_buckets`: reduce-scattered
/// in place, carrying the all-gather and the next backward) trains exactly as without: none,
/// one, and more than there are buckets; with clipping and a `no_sync` step.
#[test]
fn stage_2_keeping_whole_buckets_trains_as_without() {
    for world in [2, 3] {
        for opt in [Opt::SgdMomentum, Opt::AdamW] {
            let runs: Vec<_> = [0usize, 1, 100]
                .into_iter()
                .map(|keep| {
                    run_ranks(world, |rank, pg| {
                        let (vm, m) = model(7, HID);
                        let ddp = Ddp::new(&vm, &pg, Sizes::Tiny.ddp()).unwrap();
                        assert!(ddp.reducer().buckets().len() >= 3);
                        let options = ddp_candle::ZeroOptions {
                            keep_whole_buckets: keep,
                        };
                        let z = ZeroDdp::with_options(ddp, ZeroStage::Two, shard_opt(opt), options)
                            .unwrap();
                        let mut t = Trainer::Zero(Box::new(z), m);
                        for k in 0..5 {
                            if k == 2 {
                                t.set_sync(false);
                                t.backward(k + 10, rank, pg.size());
                                t.set_sync(true);
                            }
                            t.backward(k, rank, pg.size());
                            t.clip(0.5);
                            t.step();
                        }
                        t.assert_replicas(&format!("keep {keep}"));
                        t.params()
                    })
                })
                .collect();
            for (keep, run) in [1, 100].iter().zip(&runs[1..]) {
                let what = format!("world {world}, {opt:?}, keep {keep}");
                assert_close(&run[0], &runs[0][0], 1e-6, &what);
            }
        }
    }
}

/// `ZeroDdp::with_optimizer` (the optimizer steps the owned elements inside the parameters)
/// against `ZeroDdp::new` (over chunk variables): bit-identical training, checkpoints and
/// state, and no chunk variable held.
#[test]
fn stepping_the_parameters_in_place_equals_stepping_chunk_variables() {
    for world in [2, 3] {
        for opt in [Opt::SgdMomentum, Opt::AdamW] {
            for stage in [ZeroStage::One, ZeroStage::Two] {
                let runs: Vec<_> = [true, false]
                    .into_iter()
                    .map(|through| {
                        run_ranks(world, |rank, pg| {
                            let mut z =
                                Trainer::build(&pg, stage, opt, Sizes::Tiny, 7, HID, through);
                            for k in 0..4 {
                                z.backward(k, rank, pg.size());
                                z.clip(0.5);
                                z.step();
                            }
                            let held = z.shard_vars().iter().flatten().count();
                            assert_eq!(held == 0, through, "chunk variables held: {held}");
                            z.assert_replicas("write-through");
                            let state = match &z {
                                Trainer::Zero(z, _) => z.shard_state().unwrap(),
                                Trainer::Fsdp(_) => unreachable!(),
                            };
                            let chunks: Vec<_> = state
                                .chunks
                                .into_iter()
                                .map(|c| (c.params, c.slots))
                                .collect();
                            (z.params(), chunks)
                        })
                    })
                    .collect();
                assert_eq!(runs[0], runs[1], "world {world}, {opt:?}, {stage:?}");
            }
        }
    }
}

#[test]
fn the_staged_backward_under_zero_equals_plain_ddp() {
    // Stage 2 needs it to keep only gradient shards; every stage takes it (stage 0 is DDP's
    // staged path, bit-identical to its plain one: tests/ddp.rs). Tiny buckets: a stage's
    // gradients fill several, reduce-scattered while earlier stages compute.
    zero_matches_ddp("staged", Opt::AdamW, |z, rank, pg| {
        for k in 0..4 {
            z.backward_staged(k, rank, pg.size());
            z.step();
        }
    });
}

/// One training run at `world` ranks and `stage` (tiny buckets or units unless `sizes` says),
/// each rank running `body` on its trainer; checks that the replicas end bit-identical and
/// returns every rank's parameters.
fn run_zero(
    world: usize,
    stage: ZeroStage,
    opt: Opt,
    sizes: Sizes,
    body: impl Fn(&mut Trainer, usize, &ddp_comm::ProcessGroup) + Sync,
) -> Vec<Vec<(String, Vec<f32>)>> {
    run_ranks(world, |rank, pg| {
        let mut z = Trainer::new(&pg, stage, opt, sizes, 7, HID);
        body(&mut z, rank, &pg);
        z.assert_replicas(&format!("{stage:?}"));
        z.params()
    })
}

/// Stages 1, 2 and 3 against stage 0 (plain DDP) running the same `body`, at worlds 2 and 3.
fn zero_matches_ddp(
    what: &str,
    opt: Opt,
    body: impl Fn(&mut Trainer, usize, &ddp_comm::ProcessGroup) + Sync + Copy,
) {
    for world in [2, 3] {
        let want = run_zero(world, ZeroStage::Ddp, opt, Sizes::Tiny, body);
        for stage in SHARDED {
            let got = run_zero(world, stage, opt, Sizes::Tiny, body);
            for r in 0..world {
                assert_eq!(got[r], got[0], "{what}: ranks are bit-identical");
            }
            let what = format!("{what}, world {world}, {opt:?}, {stage:?}");
            assert_close(&got[0], &want[0], 1e-6, &what);
        }
    }
}

/// PyTorch's two parameter groups (decay on the 2-D weights only) at every stage, with chunks
/// that span weights and biases (tiny buckets and units), equal plain DDP with
/// `AdamW::new_named_with_decay` and the same rule; and the groups change the result.
#[test]
fn weight_decay_groups_at_every_stage_equal_ddp() {
    let body = |z: &mut Trainer, rank: usize, pg: &ddp_comm::ProcessGroup| {
        z.decay_weights_only();
        for k in 0..4 {
            z.backward(k, rank, pg.size());
            z.step();
        }
    };
    zero_matches_ddp("decay groups", Opt::AdamW, body);
    let reference = run_ranks(2, |rank, pg| {
        let (vm, m) = model(7, HID);
        let ddp = Ddp::new(&vm, &pg, Sizes::Tiny.ddp()).unwrap();
        let ddp_candle::ShardOptimizer::AdamW(p) = shard_opt(Opt::AdamW) else {
            unreachable!("AdamW")
        };
        let vars = ddp.named_vars().to_vec();
        let mut opt =
            ddp_candle::optim::AdamW::new_named_with_decay(vars, p, |_, v| v.rank() >= 2).unwrap();
        let mut ddp = ddp;
        for k in 0..4 {
            let grads = ddp.backward(&loss_at(&m, k, rank, 2)).unwrap();
            candle_nn::Optimizer::step(&mut opt, &grads).unwrap();
        }
        params(&ddp)
    });
    let grouped = run_zero(2, ZeroStage::One, Opt::AdamW, Sizes::Tiny, body);
    assert_close(
        &grouped[0],
        &reference[0],
        1e-6,
        "stage 1 against the plain optimizer",
    );
    let all = train(2, ZeroStage::One, Opt::AdamW, Sizes::Tiny, 4, None);
    assert_ne!(
        all[0], grouped[0],
        "the groups change the result (the test can tell)"
    );
}

#[test]
fn no_sync_accumulation_under_zero_equals_ddp() {
    const K: usize = 3;
    zero_matches_ddp("no_sync", Opt::AdamW, |z, rank, pg| {
        let world = pg.size();
        let scale = 1.0 / K as f64;
        for step in 0..3 {
            z.set_sync(false);
            for k in 0..K - 1 {
                let stats = z.backward_scaled(step * K + k, rank, world, scale);
                assert!(
                    !stats.synced && stats.bytes == 0,
                    "no_sync must not communicate gradients"
                );
            }
            z.set_sync(true);
            assert!(
                z.backward_scaled(step * K + K - 1, rank, world, scale)
                    .synced
            );
            z.step();
        }
    });
}

/// `Join` under ZeRO: rank `r` has `2 + 2r` batches; the ranks that ran out shadow the
/// collectives (their shards still step, with the gradients averaged over the ranks with data)
/// until the last rank is done, as under plain DDP.
#[test]
fn join_with_uneven_inputs_under_zero_equals_ddp() {
    zero_matches_ddp("join", Opt::SgdMomentum, |z, rank, pg| {
        let world = pg.size();
        let mut join = ddp_core::Join::new(pg);
        let mut k = 0;
        while let Some(step) = join.begin_step(k < 2 + 2 * rank).unwrap() {
            z.backward_join(step.has_data.then_some(k), rank, world, &join, &step);
            z.step();
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
    let (opt, tiny) = (Opt::SgdMomentum, Sizes::Tiny);
    let want = train(3, ZeroStage::Ddp, opt, tiny, 4, Some(0.05));
    for stage in [ZeroStage::Two, ZeroStage::Three] {
        let unclipped = train(3, stage, opt, tiny, 4, None);
        let got = train(3, stage, opt, tiny, 4, Some(0.05));
        assert_close(
            &got[0],
            &want[0],
            1e-6,
            &format!("clipped {stage:?} vs DDP"),
        );
        assert!(
            rel_diff(&got[0][0].1, &unclipped[0][0].1) > 1e-3,
            "clipping changed nothing"
        );
    }
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
    let out = run_zero(world, stage, opt, Sizes::Tiny, |z, rank, _| {
        if let Some(d) = from {
            let meta = z.load(d).unwrap().expect("a save set");
            assert_eq!(meta.step as usize, first);
        }
        for k in first..first + steps {
            z.backward(k, rank, world);
            z.step();
        }
        if let Some(d) = save {
            let meta = CheckpointMeta {
                step: (first + steps) as u64,
                world_size: world,
                ..Default::default()
            };
            z.save(d, &meta).unwrap();
        }
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

/// Saves after 3 steps at `n` ranks and stage `saved`, resumes at `m` ranks and stage `loaded`:
/// the re-cut set is the consolidated checkpoint exactly, and 3 more steps equal plain DDP
/// resumed from the consolidated export.
fn resume_case(n: usize, saved: ZeroStage, m: usize, loaded: ZeroStage, opt: Opt) {
    let what = format!("{n}->{m} {saved:?}->{loaded:?} {opt:?}");
    let dir = tempfile::tempdir().unwrap();
    sharded_run(n, saved, opt, None, 0, 3, Some(dir.path()));
    let resumed_now = sharded_run(m, loaded, opt, Some(dir.path()), 3, 0, None);
    let ckpt = sharding::consolidate(dir.path()).unwrap().unwrap();
    for (name, v) in &resumed_now {
        assert_eq!(&ckpt.require(name).unwrap().data, v, "{what}: `{name}`");
    }
    let resumed = sharded_run(m, loaded, opt, Some(dir.path()), 3, 3, None);
    let want = ddp_from_consolidated(m, opt, dir.path(), 3, 3);
    assert_close(&resumed, &want, 1e-6, &what);
}

#[test]
fn a_save_set_resumes_at_another_world_size_exactly() {
    for (n, m, stage, opt) in [
        (4, 2, ZeroStage::Two, Opt::AdamW),
        (2, 3, ZeroStage::One, Opt::SgdMomentum),
        (3, 1, ZeroStage::Two, Opt::SgdMomentum),
        (3, 1, ZeroStage::One, Opt::AdamW),
        (4, 2, ZeroStage::Three, Opt::AdamW),
        (2, 3, ZeroStage::Three, Opt::SgdMomentum),
        (3, 1, ZeroStage::Three, Opt::AdamW),
    ] {
        resume_case(n, stage, m, stage, opt);
    }
}

/// Sets are in parameter space: a stage-3 set (chunks of units) resumes at stages 1 and 2
/// (chunks of buckets) and back, at another world size.
#[test]
fn a_save_set_moves_between_stages_1_2_and_3() {
    resume_case(2, ZeroStage::Three, 3, ZeroStage::One, Opt::AdamW);
    resume_case(4, ZeroStage::Two, 2, ZeroStage::Three, Opt::SgdMomentum);
}

#[test]
fn import_of_a_plain_checkpoint_equals_loading_the_set() {
    for stage in [ZeroStage::Two, ZeroStage::Three] {
        let dir = tempfile::tempdir().unwrap();
        sharded_run(2, stage, Opt::AdamW, None, 0, 3, Some(dir.path()));
        let ckpt = sharding::consolidate(dir.path()).unwrap().unwrap();
        assert_eq!(ckpt.optimizer.as_ref().unwrap().kind, "adamw");
        assert_eq!(ckpt.optimizer.as_ref().unwrap().step, 3);
        let loaded = sharded_run(3, stage, Opt::AdamW, Some(dir.path()), 3, 2, None);
        let imported = run_ranks(3, |rank, pg| {
            let mut z = Trainer::new(&pg, stage, Opt::AdamW, Sizes::Tiny, 5, HID);
            z.import(&ckpt);
            for k in 3..5 {
                z.backward(k, rank, 3);
                z.step();
            }
            z.params()
        });
        assert_eq!(
            imported[0], loaded,
            "{stage:?}: import and load give the same run, bit for bit"
        );
    }
}

fn set_dir(dir: &Path) -> std::path::PathBuf {
    sharding::latest_set(dir).unwrap().unwrap()
}

/// Loads `dir` at world 2 and `stage` into a model of `hidden` units; returns each rank's error
/// and whether its parameters were left untouched.
fn failing_load(dir: &Path, stage: ZeroStage, hidden: usize) -> Vec<(String, bool)> {
    run_ranks(2, |_, pg| {
        let mut z = Trainer::new(&pg, stage, Opt::AdamW, Sizes::Tiny, 3, hidden);
        let before = (z.params(), z.shard_state_values());
        let e = z.load(dir).unwrap_err().to_string();
        (e, (z.params(), z.shard_state_values()) == before)
    })
}

impl Trainer {
    fn shard_state_values(&self) -> Vec<Vec<f32>> {
        match self {
            Trainer::Zero(z, _) => z
                .shard_state()
                .unwrap()
                .chunks
                .into_iter()
                .map(|c| c.params)
                .collect(),
            Trainer::Fsdp(_) => self
                .shard_vars()
                .iter()
                .flatten()
                .map(|v| v.as_tensor().to_vec1().unwrap())
                .collect(),
        }
    }
}

#[test]
fn bad_sets_are_refused_by_name_and_change_nothing() {
    for stage in [ZeroStage::One, ZeroStage::Three] {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        sharded_run(2, stage, Opt::AdamW, None, 0, 1, Some(a.path()));
        sharded_run(2, stage, Opt::AdamW, None, 0, 2, Some(b.path()));

        // A checkpoint of another model (other hidden size): names the parameter.
        for (e, untouched) in failing_load(a.path(), stage, HID + 1) {
            assert!(e.contains("another model") && e.contains("l1.bias"), "{e}");
            assert!(untouched);
        }
        // A shard from another save set.
        let (sa, sb) = (set_dir(a.path()), set_dir(b.path()));
        let victim = sa.join("rank1").join("checkpoint.safetensors");
        let saved = std::fs::read(&victim).unwrap();
        std::fs::copy(sb.join("rank1").join("checkpoint.safetensors"), &victim).unwrap();
        for (e, untouched) in failing_load(a.path(), stage, HID) {
            assert!(e.contains("another save") && e.contains("rank1"), "{e}");
            assert!(untouched);
        }
        // A missing shard.
        std::fs::remove_file(&victim).unwrap();
        for (e, untouched) in failing_load(a.path(), stage, HID) {
            assert!(e.contains("shard of rank 1 (of 2) is missing"), "{e}");
            assert!(untouched);
        }
        std::fs::write(&victim, saved).unwrap();
        // Repaired, it loads.
        sharded_run(2, stage, Opt::AdamW, Some(a.path()), 1, 0, None);
    }
}

#[test]
fn a_failed_save_leaves_the_previous_set_current() {
    for stage in [ZeroStage::Two, ZeroStage::Three] {
        let dir = tempfile::tempdir().unwrap();
        let opt = Opt::SgdMomentum;
        let good = sharded_run(2, stage, opt, None, 0, 2, Some(dir.path()));
        let first = set_dir(dir.path());
        let errors = run_ranks(2, |rank, pg| {
            // Over chunk variables (`ZeroDdp::new`), so that one can be spoiled.
            let mut z = Trainer::build(&pg, stage, opt, Sizes::Tiny, 7, HID, false);
            z.load(dir.path()).unwrap();
            z.backward(2, rank, 2);
            z.step();
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
            "{stage:?}: zero_latest still names the previous set"
        );
        let resumed = sharded_run(2, stage, opt, Some(dir.path()), 2, 0, None);
        assert_eq!(resumed, good);
    }
}

#[test]
fn stage_3_is_fsdp_and_zero_ddp_says_so() {
    assert_eq!(ZeroStage::from_level(3).unwrap(), ZeroStage::Three);
    assert_eq!(ZeroStage::Three.level(), 3);
    let e = ZeroStage::from_level(4).unwrap_err().to_string();
    assert!(e.contains("stage 4 does not exist"), "{e}");
    let errors = run_ranks(2, |_, pg| {
        let (vm, _) = model(7, HID);
        let ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        ZeroDdp::new(ddp, ZeroStage::Three, make_opt(Opt::AdamW))
            .err()
            .unwrap()
            .to_string()
    });
    for e in errors {
        assert!(e.contains("stage 3") && e.contains("Fsdp"), "{e}");
    }
}

/// The recompute in the backward runs the same ops on the same values as a plain
/// `loss.backward()`: at world 1 (no reduction) stage 3 and DDP agree bit for bit.
#[test]
fn stage_3_is_bit_identical_to_plain_backward_at_world_1() {
    for sizes in [Sizes::Tiny, Sizes::Default] {
        for opt in [Opt::SgdMomentum, Opt::AdamW] {
            let want = train(1, ZeroStage::Ddp, opt, sizes, 4, None);
            let got = train(1, ZeroStage::Three, opt, sizes, 4, None);
            assert_eq!(got[0], want[0], "{sizes:?} {opt:?}");
        }
    }
}

/// Stage 3 keeps only its chunk of each unit; its bytes per step are what the ring sends (two
/// gathers of every unit but the last, one reduce-scatter), within 1.5x DDP's; inference
/// gathers unit by unit and equals the full model's forward.
#[test]
fn stage_3_holds_its_shard_only_and_sends_at_most_one_and_a_half_ddp() {
    let world = 3;
    run_ranks(world, |rank, pg| {
        let (vm, m) = model(7, HID);
        let full_out = m.forward(&batch_at(0, rank, world).0).unwrap();
        let total: usize = varmap_params(&vm).iter().map(|(_, v)| v.len()).sum();
        let units = mlp_units(HID, Sizes::Tiny);
        let mut f = Fsdp::from_varmap(&vm, units, &pg, make_opt(Opt::AdamW)).unwrap();
        drop((vm, m));
        let held: usize = f
            .shard_vars()
            .iter()
            .flatten()
            .map(|v| v.elem_count())
            .sum();
        assert_eq!(held, f.layout().owned_numel());
        assert!(held <= total.div_ceil(world) + 3, "{held} of {total}");
        let (xs, ys) = batch_at(0, rank, world);
        let out = f.forward(&xs).unwrap();
        assert_eq!(
            out.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            full_out.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        let stats = f
            .forward_backward(&xs, |o| candle_nn::loss::cross_entropy(o, &ys))
            .unwrap()
            .stats;
        assert!(stats.synced && stats.bytes > 0);
        let units: Vec<usize> = f
            .layout()
            .buckets()
            .iter()
            .map(|b| b.chunk_len(world))
            .collect();
        let per = |c: usize| ((world - 1) * c * 4) as u64;
        let want: u64 = per(units[0]) * 3 + per(units[1]) * 3 + per(units[2]) * 2;
        assert_eq!(f.bytes_per_step(), want);
        let ddp_bytes = 2 * (world as u64 - 1) * total.div_ceil(world) as u64 * 4;
        assert!(f.bytes_per_step() as f64 <= 1.5 * ddp_bytes as f64 * 1.01);
        f.step().unwrap();
        assert!(
            f.step().is_err(),
            "a second step without a backward is refused"
        );
    });
}

/// A unit layout that leaves a parameter out, or names one twice, is refused naming it.
/// `Fsdp::set_backward_prefetch`: before the unit's gradient (the default), after it, or not at
/// all, stage 3 trains as DDP does, with and without `no_sync` accumulation (the settings only
/// move when each unit's gather starts; a wrong unit or a missing gather fails or hangs here).
#[test]
fn every_backward_prefetch_setting_equals_ddp() {
    use ddp_candle::BackwardPrefetch::{BackwardPost, BackwardPre};
    for world in [2, 3, 4] {
        for opt in [Opt::SgdMomentum, Opt::AdamW] {
            let body = |z: &mut Trainer, rank: usize, pg: &ddp_comm::ProcessGroup| {
                for k in 0..4 {
                    z.set_sync(k != 1);
                    z.backward(k, rank, pg.size());
                    if k != 1 {
                        z.step();
                    }
                }
            };
            let want = run_zero(world, ZeroStage::Ddp, opt, Sizes::Tiny, body);
            for prefetch in [Some(BackwardPre), Some(BackwardPost), None] {
                let got = run_zero(world, ZeroStage::Three, opt, Sizes::Tiny, |z, rank, pg| {
                    let Trainer::Fsdp(f) = z else {
                        unreachable!("stage 3 is Fsdp")
                    };
                    f.set_backward_prefetch(prefetch);
                    assert_eq!(f.backward_prefetch(), prefetch);
                    body(z, rank, pg)
                });
                for r in 0..world {
                    assert_eq!(got[r], got[0], "{prefetch:?}: ranks are bit-identical");
                }
                let what = format!("world {world}, {opt:?}, backward prefetch {prefetch:?}");
                assert_close(&got[0], &want[0], 1e-6, &what);
            }
        }
    }
}

#[test]
fn stage_3_refuses_units_that_do_not_cover_the_model() {
    let errors = run_ranks(2, |_, pg| {
        let (vm, _) = model(7, HID);
        let mut units = mlp_units(HID, Sizes::Tiny);
        units.pop();
        let missing = Fsdp::from_varmap(&vm, units, &pg, make_opt(Opt::AdamW))
            .err()
            .unwrap()
            .to_string();
        let mut units = mlp_units(HID, Sizes::Tiny);
        units.push(Unit::new(["l1.bias"], |_, x| Ok(x.clone())));
        let twice = Fsdp::from_varmap(&vm, units, &pg, make_opt(Opt::AdamW))
            .err()
            .unwrap()
            .to_string();
        (missing, twice)
    });
    for (missing, twice) in errors {
        assert!(missing.contains("`l3.bias` is in no unit"), "{missing}");
        assert!(
            twice.contains("`l1.bias` is in unit 0 and unit 3"),
            "{twice}"
        );
    }
}

/// Join combined with `no_sync` is not built at stage 3: refused by name on every rank, before
/// any collective of the step.
#[test]
fn stage_3_refuses_join_under_no_sync_by_name() {
    let errors = run_ranks(2, |rank, pg| {
        let (vm, _) = model(7, HID);
        let units = mlp_units(HID, Sizes::Tiny);
        let mut f = Fsdp::from_varmap(&vm, units, &pg, make_opt(Opt::AdamW)).unwrap();
        let mut join = ddp_core::Join::new(&pg);
        let step = join.begin_step(true).unwrap().unwrap();
        f.set_require_backward_grad_sync(false);
        let (xs, ys) = batch_at(0, rank, 2);
        let loss = |o: &Tensor| candle_nn::loss::cross_entropy(o, &ys);
        f.forward_backward_join(Some((&xs, loss)), &join, &step)
            .unwrap_err()
            .to_string()
    });
    for e in errors {
        assert!(e.contains("Join with no_sync"), "{e}");
    }
}

/// A unit smaller than the world (one rank owns an empty chunk of it) trains like DDP (and
/// bit-identically at world 1).
#[test]
fn stage_3_with_a_unit_smaller_than_the_world_equals_ddp() {
    for opt in [Opt::SgdMomentum, Opt::AdamW] {
        let want = train(4, ZeroStage::Ddp, opt, Sizes::Tiny, 4, None);
        let got = run_zero(4, ZeroStage::Three, opt, Sizes::Uneven, |z, rank, pg| {
            if let Trainer::Fsdp(f) = z {
                let empty = f.shard_vars().iter().filter(|v| v.is_none()).count();
                assert_eq!(empty, usize::from(rank == 3), "rank {rank}");
            }
            for k in 0..4 {
                z.backward(k, rank, pg.size());
                z.step();
            }
        });
        for r in 0..4 {
            assert_eq!(got[r], got[0], "ranks are bit-identical");
        }
        assert_close(&got[0], &want[0], 1e-6, &format!("uneven units, {opt:?}"));
    }
    let want = train(1, ZeroStage::Ddp, Opt::AdamW, Sizes::Tiny, 3, None);
    let got = train(1, ZeroStage::Three, Opt::AdamW, Sizes::Uneven, 3, None);
    assert_eq!(got[0], want[0], "bit-identical at world 1");
}

/// The finite check under ZeRO: every rank holds a different averaged shard, so a NaN that
/// lands in one rank's shard only (here `l3.bias`'s gradient, from rank 1) must still fail every
/// rank the same way (the ranks agree on it), not leave the others waiting; healthy steps pass.
#[test]
fn a_nan_gradient_under_zero_fails_every_rank_naming_it() {
    const W: usize = 3;
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let errors = run_ranks(W, |rank, pg| {
            let (vm, m) = model(7, HID);
            let opts = DdpOptions {
                check_finite: true,
                ..tiny_buckets()
            };
            let ddp = Ddp::new(&vm, &pg, opts).unwrap();
            let mut z = ZeroDdp::with_optimizer(ddp, stage, shard_opt(Opt::AdamW)).unwrap();
            for k in 0..2 {
                z.backward(&loss_at(&m, k, rank, W)).unwrap();
                z.step().unwrap();
            }
            let mut loss = loss_at(&m, 2, rank, W);
            if rank == 1 {
                let bias = m.l3.bias().unwrap().sum_all().unwrap();
                loss = (loss + (bias * f64::NAN).unwrap()).unwrap();
            }
            z.backward(&loss).unwrap_err().to_string()
        });
        for (r, e) in errors.iter().enumerate() {
            assert!(
                e.contains("non-finite gradient at step 2")
                    && e.contains("rank 1")
                    && e.contains("l3.bias"),
                "{stage:?}, rank {r}: {e}"
            );
        }
    }
}
