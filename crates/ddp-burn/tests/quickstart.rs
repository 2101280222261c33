//! The one-call forms of issue 40 (items 13, 14) through the public API, on 2 ranks (threads with
//! real TCP process groups): `Ddp::save_checkpoint` writes one file on rank 0 that resumes bit for
//! bit through `resume_or_start` + `load_records`; `ShardedDataset::new(data, &pg)` with sampler
//! options; `DdpLearningStrategy::supervised` / `launch` (per-rank directory, errors as `Err`).

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::{Dataset, InMemDataset};
use burn_train::Learner;
use ddp_burn::prelude::*;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod common;
#[path = "common/items.rs"]
mod items;
use common::{dataset, device, model, optimizer, Mlp, Opt, HID, LR};
use items::{items, ArcDataset, ItemBatcher};

const B: usize = 4;
const STEPS: usize = 3;
const EPOCHS: u64 = 2;

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    v.retain(|p| !p.ends_with(ddp_core::checkpoint::LOCK_FILE));
    v.sort();
    v
}

fn bits(m: &Mlp) -> Vec<(String, Vec<u32>)> {
    m.params()
        .into_iter()
        .map(|(n, v)| (n, v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

#[test]
fn one_call_save_writes_one_file_on_rank_0_and_resumes_bit_for_bit() {
    let root = tempfile::tempdir().unwrap();
    let dirs: Vec<PathBuf> = (0..2).map(|r| root.path().join(format!("r{r}"))).collect();
    let (x, y) = dataset(2 * B * STEPS);
    ddp_comm::testing::run_ranks(2, |pg| {
        let rank = pg.rank();
        let dir = &dirs[rank];
        let mut ddp = Ddp::new(model(4 + rank as u64, HID), &pg, DdpOptions::default()).unwrap();
        let mut opt = optimizer(Opt::Adam);
        for _epoch in 0..EPOCHS {
            for step in 0..STEPS {
                let start = step * 2 * B + rank * B;
                let (xs, ys) = common::batch(&x, &y, start..start + B);
                let loss = ddp.module().loss(xs, ys);
                let grads = ddp.backward(loss).unwrap();
                ddp.step(&mut opt, LR, grads);
            }
        }
        let steps = EPOCHS * STEPS as u64;
        let saved = ddp.save_checkpoint(dir, &opt, EPOCHS).unwrap();
        if rank == 0 {
            let file = dir.join(ddp_core::checkpoint::CHECKPOINT_FILE);
            assert_eq!(saved.as_deref(), Some(file.as_path()));
            assert_eq!(files(dir), vec![file]);
            let meta = ddp_core::checkpoint::load(dir).unwrap().unwrap().meta;
            assert_eq!((meta.world_size, meta.step, meta.epoch), (2, steps, EPOCHS));
        } else {
            assert_eq!(saved, None);
            assert!(files(dir).is_empty(), "rank {rank} wrote {:?}", files(dir));
        }
        pg.barrier().unwrap();

        // Resume into a fresh model and optimizer through the existing path.
        let fresh = DdpOptions {
            init_sync: false,
            ..Default::default()
        };
        let mut ddp2 = Ddp::new(model(99, HID), &pg, fresh).unwrap();
        assert_ne!(bits(ddp2.module()), bits(ddp.module()));
        let plan = RunPlan {
            world_size: 2,
            samples_per_epoch: B * STEPS,
            batch_size: B,
            epochs: EPOCHS + 1,
            max_steps: None,
            hyper: Default::default(),
            rng_state: 0,
        };
        let r = checkpoint::resume_or_start(&pg, dir, true, &plan)
            .unwrap()
            .expect("a checkpoint");
        assert_eq!(
            r.state,
            TrainingState {
                step: steps,
                epoch: EPOCHS,
                consumed: 0
            }
        );
        let mut opt2 = ddp2
            .load_records(&r.checkpoint, optimizer(Opt::Adam))
            .unwrap();
        assert_eq!(bits(ddp2.module()), bits(ddp.module()), "model bit for bit");
        // The optimizer state too: one more identical step on both gives identical models.
        let (xs, ys) = common::batch(&x, &y, rank * B..(rank + 1) * B);
        for (d, o) in [(&mut ddp, &mut opt), (&mut ddp2, &mut opt2)] {
            let loss = d.module().loss(xs.clone(), ys.clone());
            let g = d.backward(loss).unwrap();
            d.step(o, LR, g);
        }
        assert_eq!(
            bits(ddp2.module()),
            bits(ddp.module()),
            "Adam state resumed"
        );

        // Model-only: no optimizer blob, loads with load_model.
        let mdir = root.path().join(format!("m{rank}"));
        let saved = ddp.save_model(&mdir, 0).unwrap();
        assert_eq!(saved.is_some(), rank == 0);
        if rank == 0 {
            let c = ddp_core::checkpoint::load(&mdir).unwrap().unwrap();
            assert!(c
                .require_blob(ddp_burn::checkpoint::OPTIMIZER_BLOB)
                .is_err());
            let mut ddp3 = Ddp::new(model(7, HID), &ddp_single(), fresh).unwrap();
            ddp3.load_model(&c).unwrap();
            assert_eq!(bits(ddp3.module()), bits(ddp.module()));
        }
    });
}

fn ddp_single() -> ProcessGroup {
    ddp_comm::testing::run_ranks(1, |pg| pg).pop().unwrap()
}

#[test]
fn sharded_dataset_in_one_call_with_sampler_options() {
    let data: Vec<usize> = (0..10).collect();
    let got = ddp_comm::testing::run_ranks(2, |pg| {
        let want = |s: ddp_core::DistributedSampler| -> Vec<usize> {
            let mut s = s;
            s.indices()
        };
        let plain = ShardedDataset::new(Arc::new(InMemDataset::new(data.clone())), &pg).unwrap();
        let mut d = ddp_core::DistributedSampler::new(10, 2, pg.rank()).unwrap();
        assert_eq!(*plain.indices(), d.indices());
        let opt = ShardedDataset::from_dataset(InMemDataset::new(data.clone()), &pg)
            .unwrap()
            .seed(7)
            .shuffle(false)
            .drop_last(true)
            .shared();
        let s = ddp_core::DistributedSampler::new(10, 2, pg.rank())
            .unwrap()
            .seed(7)
            .shuffle(false)
            .drop_last(true);
        assert_eq!(*opt.indices(), want(s));
        assert_eq!(opt.samples_per_epoch(), 5);
        // The old constructor still works.
        let old = ShardedDataset::new(
            Arc::new(InMemDataset::new(data.clone())),
            ddp_core::DistributedSampler::new(10, 2, pg.rank())
                .unwrap()
                .seed(3),
        )
        .unwrap();
        let seeded = ShardedDataset::new(Arc::new(InMemDataset::new(data.clone())), &pg)
            .unwrap()
            .seed(3);
        assert_eq!(old.indices(), seeded.indices());
        (0..opt.len())
            .map(|i| opt.get(i).unwrap())
            .collect::<Vec<_>>()
    });
    let mut all: Vec<usize> = got.concat();
    all.sort();
    assert_eq!(
        all,
        (0..10).collect::<Vec<_>>(),
        "shards disjoint and complete"
    );
}

/// `supervised` gives rank 0 `base` and rank 1 `base/rank1` (created for Burn's logs), and
/// `launch` returns `Ok` on a good run and the strategy's error as `Err` on every rank when the
/// models differ (no `take_error` needed).
#[test]
fn strategy_sets_up_per_rank_directories_and_launch_surfaces_errors() {
    let base = tempfile::tempdir().unwrap();
    let base = base.path().to_path_buf();
    let outcome = ddp_comm::testing::run_ranks(2, |pg| {
        let rank = pg.rank();
        let run = |hidden: usize, tag: &str| {
            let strategy = Arc::new(DdpLearningStrategy::new(&pg, device()));
            let shard = ShardedDataset::new(Arc::new(InMemDataset::new(items(16))), &pg)
                .unwrap()
                .shared();
            let loader = DataLoaderBuilder::new(ItemBatcher)
                .batch_size(4)
                .build(ArcDataset(shard));
            let valid = DataLoaderBuilder::new(ItemBatcher)
                .batch_size(4)
                .build(InMemDataset::new(items(8)));
            let training = strategy
                .supervised::<Mlp>(base.join(tag), loader, valid)
                .unwrap()
                .with_application_logger(None);
            let learner = Learner::new(model(3, hidden), optimizer(Opt::SgdMomentum), LR);
            strategy.launch(training, learner).map(|_| ())
        };
        let good = run(HID, "good");
        let bad = run(HID + rank, "bad").map_err(|e| e.to_string());
        (rank, good.is_ok(), bad)
    });
    for (rank, good, bad) in outcome {
        assert!(good, "rank {rank}: the good run failed");
        let e = bad.expect_err("a model that differs between ranks is an Err from launch");
        assert!(e.contains("l1.weight"), "rank {rank}: {e}");
    }
    assert!(base.join("good").is_dir() && base.join("good/rank1").is_dir());
    assert!(!base.join("good/rank0").exists(), "rank 0 uses base itself");
}
