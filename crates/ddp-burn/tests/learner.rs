//! Burn's own `Learner` (`SupervisedTraining`) with [`DdpLearningStrategy`], ranks as threads
//! with real TCP collectives. The reference is Burn's single-device strategy on the combined
//! batch (no ddp-rs code). Every collective is bounded by the group timeout, so a hang shows up
//! as an error.

use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::{Dataset, InMemDataset};
use burn_train::{Learner, SupervisedTraining};
use ddp_burn::{DdpLearningStrategy, ShardedDataset};
use ddp_core::DistributedSampler;
use std::path::Path;
use std::sync::{Arc, Mutex};

mod common;
use common::*;
#[path = "common/items.rs"]
mod items;
use items::*;

/// Burn's loop as a user writes it (constant LR, SGD with momentum, no application logger);
/// `strategy` is `None` for Burn's single-device default.
fn train(
    dir: &Path,
    train: impl Dataset<Item> + 'static,
    batch: usize,
    epochs: usize,
    accumulation: Option<usize>,
    strategy: Option<&Arc<DdpLearningStrategy>>,
    configure: impl FnOnce(SupervisedTraining<Mlp>) -> SupervisedTraining<Mlp>,
) -> Vec<(String, Vec<f32>)> {
    let loader = DataLoaderBuilder::new(ItemBatcher)
        .batch_size(batch)
        .build(train);
    let valid = DataLoaderBuilder::new(ItemBatcher)
        .batch_size(8)
        .build(InMemDataset::new(items(16)));
    let mut training = SupervisedTraining::new(dir, loader, valid)
        .num_epochs(epochs)
        .with_application_logger(None);
    if let Some(k) = accumulation {
        training = training.grads_accumulation(k);
    }
    if let Some(s) = strategy {
        training = training.with_training_strategy(s.into_training_strategy());
    }
    let learner = Learner::new(model(3, HID), optimizer(Opt::SgdMomentum), LR);
    let result = configure(training).launch(learner);
    if let Some(s) = strategy {
        if let Some(e) = s.take_error() {
            panic!("the ddp-rs strategy failed: {e}");
        }
    }
    result.model.params()
}

fn tmp(tag: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(tag).tempdir().unwrap()
}

/// W ranks × batch b through Burn's `Learner` equal Burn's single-device `Learner` on batch W·b
/// (rank r's shard holds items r, r+W, ..., so step k of all ranks together is items
/// k·W·b..(k+1)·W·b), over two epochs, with and without gradient accumulation (Burn sums the
/// accumulated micro-batches; the strategy accumulates them under `no_sync`). Each rank
/// starts from a different initialization: rank 0's is broadcast. Replicas end bit-identical.
#[test]
fn learner_strategy_equals_burns_single_device_learner_on_the_combined_batch() {
    const B: usize = 4;
    const STEPS: usize = 6;
    for (world, accumulation) in [(2, None), (3, None), (2, Some(2))] {
        let n = world * B * STEPS;
        let dir = tmp("ddp-learner-ref");
        let want = train(
            dir.path(),
            InMemDataset::new(items(n)),
            world * B,
            2,
            accumulation,
            None,
            |t| t,
        );
        let what = format!("world {world}, accumulation {accumulation:?}");
        let ranks = run_ranks(world, |rank, pg| {
            let data = Arc::new(InMemDataset::new(items(n)));
            let sampler = DistributedSampler::new(n, world, rank)
                .unwrap()
                .shuffle(false);
            let shard = Arc::new(ShardedDataset::new(data, sampler).unwrap());
            let epochs = Arc::new(Mutex::new(Vec::new()));
            let (seen, s) = (epochs.clone(), shard.clone());
            let strategy = Arc::new(DdpLearningStrategy::new(&pg, device()).on_epoch(move |e| {
                seen.lock().unwrap().push(e);
                s.set_epoch(e as u64);
            }));
            let dir = tmp("ddp-learner-rank");
            // The model differs per rank before the broadcast.
            let got = train(
                dir.path(),
                ArcDataset(shard),
                B,
                2,
                accumulation,
                Some(&strategy),
                |t| t,
            );
            let summary = strategy.last_fit().expect("a fit summary");
            let epochs = epochs.lock().unwrap().clone();
            (got, summary, epochs)
        });
        let steps = (2 * STEPS / accumulation.unwrap_or(1)) as u64;
        for (rank, (got, summary, epochs)) in ranks.iter().enumerate() {
            assert_close(got, &want, 1e-5, &format!("{what}, rank {rank}"));
            assert!(summary.replicas_identical, "{what}: {summary:?}");
            assert_eq!(summary.steps, steps, "{what}: {summary:?}");
            assert_eq!(summary.own_steps, steps, "{what}: {summary:?}");
            assert_eq!(summary.epochs, 2, "{what}");
            assert_eq!(epochs, &[1, 2], "{what}: on_epoch calls");
        }
        assert_eq!(ranks[0].0, ranks[world - 1].0, "{what}: replicas differ");
    }
}

/// Ranks with different numbers of batches (no `ShardedDataset`): the rank that runs out
/// shadows the others' all-reduces (`ddp_core::Join`), so nobody hangs, every rank takes the same
/// number of optimizer steps and the replicas end bit-identical.
#[test]
fn uneven_loaders_end_together_with_identical_replicas() {
    let world = 3;
    let ranks = run_ranks(world, |rank, pg| {
        let strategy = Arc::new(DdpLearningStrategy::new(&pg, device()));
        let dir = tmp("ddp-learner-uneven");
        let batches = 2 + 2 * rank; // 2, 4 and 6 batches of 4
        let data = InMemDataset::new(items(4 * batches));
        let got = train(dir.path(), data, 4, 1, None, Some(&strategy), |t| t);
        (got, strategy.last_fit().expect("a fit summary"))
    });
    for (rank, (got, summary)) in ranks.iter().enumerate() {
        assert!(summary.replicas_identical, "rank {rank}: {summary:?}");
        assert_eq!(summary.steps, 6, "rank {rank}: {summary:?}");
        assert_eq!(summary.own_steps, 2 + 2 * rank as u64, "rank {rank}");
        assert_eq!(got, &ranks[0].0, "rank {rank}'s replica differs");
    }
}

/// Burn's `Interrupter` stopped on one rank (here rank 1, at the start of epoch 2) stops every
/// rank at the same step, instead of leaving the others in their all-reduce; and Burn's
/// checkpointer is written by rank 0 only.
#[test]
fn a_stop_on_one_rank_stops_every_rank_and_only_rank_0_checkpoints() {
    let world = 2;
    let n = world * 4 * 3;
    let dirs: Vec<_> = (0..world).map(|_| tmp("ddp-learner-stop")).collect();
    let ranks = run_ranks(world, |rank, pg| {
        let interrupter = burn_train::Interrupter::new();
        let stopper = interrupter.clone();
        let strategy = Arc::new(DdpLearningStrategy::new(&pg, device()).on_epoch(move |e| {
            if rank == 1 && e == 2 {
                stopper.stop(Some("rank 1 asked to stop"));
            }
        }));
        let data = Arc::new(InMemDataset::new(items(n)));
        let sampler = DistributedSampler::new(n, world, rank).unwrap();
        let shard = ArcDataset(Arc::new(ShardedDataset::new(data, sampler).unwrap()));
        let got = train(dirs[rank].path(), shard, 4, 3, None, Some(&strategy), |t| {
            t.with_interrupter(interrupter.clone())
                .with_default_checkpointers()
        });
        let reason = interrupter.interruption().and_then(|i| i.reason);
        (got, strategy.last_fit().expect("a fit summary"), reason)
    });
    for (rank, (_, summary, reason)) in ranks.iter().enumerate() {
        assert_eq!(
            summary.steps, 3,
            "rank {rank} ran past the stop: {summary:?}"
        );
        assert_eq!(summary.epochs, 1, "rank {rank}: {summary:?}");
        assert!(summary.replicas_identical, "rank {rank}: {summary:?}");
        let want = if rank == 1 {
            "rank 1 asked to stop"
        } else {
            "ddp-rs: another rank stopped the training"
        };
        assert_eq!(reason.as_deref(), Some(want), "rank {rank}");
    }
    assert_eq!(ranks[0].0, ranks[1].0);
    let has_checkpoint = |d: &tempfile::TempDir| {
        std::fs::read_dir(d.path().join("checkpoint")).is_ok_and(|mut e| e.next().is_some())
    };
    assert!(has_checkpoint(&dirs[0]), "rank 0 wrote no checkpoint");
    assert!(!has_checkpoint(&dirs[1]), "rank 1 wrote a checkpoint");
}

/// A model that differs between ranks (a hidden width) is refused on every rank, naming the
/// parameter, before any step.
#[test]
fn a_mismatched_model_is_refused_on_every_rank() {
    let errors = run_ranks(2, |rank, pg| {
        let strategy = Arc::new(DdpLearningStrategy::new(&pg, device()));
        let dir = tmp("ddp-learner-mismatch");
        let loader = DataLoaderBuilder::new(ItemBatcher)
            .batch_size(4)
            .build(InMemDataset::new(items(8)));
        let valid = DataLoaderBuilder::new(ItemBatcher)
            .batch_size(4)
            .build(InMemDataset::new(items(8)));
        let learner = Learner::new(model(3, HID + rank), optimizer(Opt::SgdMomentum), LR);
        let result = SupervisedTraining::new(dir.path(), loader, valid)
            .with_application_logger(None)
            .with_training_strategy(strategy.into_training_strategy())
            .launch(learner);
        assert!(result.interrupted.is_some(), "rank {rank} was not stopped");
        strategy.take_error().map(|e| e.to_string())
    });
    for (rank, e) in errors.iter().enumerate() {
        let e = e
            .as_deref()
            .unwrap_or_else(|| panic!("rank {rank}: no error"));
        assert!(e.contains("l1.weight"), "rank {rank}: {e}");
    }
}

/// `ChecksummedCheckpointer` (Burn's `Checkpointer` on ddp's checksummed format): a record saved
/// restores bit for bit, with the metadata given to `with_meta`; one flipped bit anywhere in the
/// file's record data is refused by `verify` and `restore`, naming the file; `delete` removes
/// the epoch.
#[test]
fn checksummed_checkpointer_restores_exactly_and_refuses_a_flipped_bit() {
    use burn::module::Module;
    use burn::store::ModuleRecord;
    use burn_train::checkpoint::Checkpointer;
    use ddp_burn::learner::ChecksummedCheckpointer;

    let dir = tmp("ddp-learner-crc");
    let c = ChecksummedCheckpointer::new(dir.path(), "model").with_meta(|epoch| {
        ddp_core::checkpoint::CheckpointMeta {
            step: 10 * epoch as u64,
            world_size: 3,
            ..Default::default()
        }
    });
    let m = model(5, HID);
    for epoch in [1, 2] {
        c.save(epoch, m.clone().into_record()).unwrap();
    }
    assert_eq!(c.epochs(), vec![1, 2]);
    let meta = c.read_meta(2).unwrap();
    assert_eq!((meta.epoch, meta.step, meta.world_size), (2, 20, 3));
    let back: ModuleRecord = Checkpointer::<ModuleRecord>::restore(&c, 2).unwrap();
    let restored = model(6, HID).load_record(back);
    assert_eq!(restored.params(), m.params(), "restored bit for bit");

    let file = c.path_for_epoch(2);
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 50;
    bytes[at] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
    let e = c.verify(2).unwrap_err().to_string();
    assert!(
        e.contains(file.to_str().unwrap()) && e.contains("checksum"),
        "{e}"
    );
    let e = match Checkpointer::<ModuleRecord>::restore(&c, 2) {
        Ok(_) => panic!("a flipped bit restored"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains(file.to_str().unwrap()), "{e}");
    c.verify(1).unwrap();
    Checkpointer::<ModuleRecord>::delete(&c, 2).unwrap();
    assert_eq!(c.epochs(), vec![1]);
    let e = c.verify(2).unwrap_err().to_string();
    assert!(e.contains("missing"), "{e}");
}
