//! Checkpoints of Burn training through `ddp_core::checkpoint` (real files, real collectives): an
//! interrupted-and-resumed run equals the uninterrupted one bit for bit (model and Adam state
//! from Burn's records, position from our metadata), and damaged or foreign records are errors
//! naming the blob.

use ddp_burn::checkpoint::{MODEL_BLOB, OPTIMIZER_BLOB};
use ddp_burn::{Ddp, DdpOptions};
use ddp_core::checkpoint::{self, RunPlan, TrainingState};
use ddp_core::Checkpoint;

mod common;

use common::*;

const B: usize = 4;
const STEPS: usize = 6;
const WORLD: usize = 2;

fn plan() -> RunPlan {
    RunPlan {
        world_size: WORLD,
        samples_per_epoch: B * STEPS,
        batch_size: B,
        epochs: 1,
        max_steps: None,
        hyper: serde_json::json!({"lr": LR}),
        rng_state: 0,
    }
}

/// Steps `from..to` of rank `rank`'s schedule.
fn run_steps(
    ddp: &mut Ddp<Mlp>,
    opt: &mut burn::optim::ModuleOptimizer,
    rank: usize,
    from: usize,
    to: usize,
) {
    let (x, y) = dataset(WORLD * B * STEPS);
    for step in from..to {
        let start = step * WORLD * B + rank * B;
        let (xs, ys) = batch(&x, &y, start..start + B);
        let loss = ddp.module().loss(xs, ys);
        let grads = ddp.backward(loss).unwrap();
        ddp.step(opt, LR, grads);
    }
}

#[test]
fn interrupted_and_resumed_equals_uninterrupted() {
    let dir = tempfile::tempdir().unwrap();
    let uninterrupted = run_ranks(WORLD, |rank, pg| {
        let mut ddp = Ddp::new(model(4, HID), &pg, DdpOptions::default()).unwrap();
        let mut opt = optimizer(Opt::Adam);
        run_steps(&mut ddp, &mut opt, rank, 0, STEPS);
        ddp.module().params()
    });
    // First half, then a checkpoint written by rank 0; everything is dropped.
    run_ranks(WORLD, |rank, pg| {
        let mut ddp = Ddp::new(model(4, HID), &pg, DdpOptions::default()).unwrap();
        let mut opt = optimizer(Opt::Adam);
        run_steps(&mut ddp, &mut opt, rank, 0, STEPS / 2);
        let pos = TrainingState {
            step: (STEPS / 2) as u64,
            epoch: 0,
            consumed: B * STEPS / 2,
        };
        if rank == 0 {
            let mut ckpt = Checkpoint::new(plan().meta(&pos));
            ddp.save_records(&mut ckpt, &opt).unwrap();
            checkpoint::save_atomic(dir.path(), &ckpt).unwrap();
        }
        pg.barrier().unwrap();
    });
    // Second half from the file, starting from other weights and a fresh optimizer.
    let resumed = run_ranks(WORLD, |rank, pg| {
        let r = checkpoint::resume_or_start(&pg, dir.path(), true, &plan())
            .unwrap()
            .expect("a checkpoint was written");
        assert_eq!(r.state.step, (STEPS / 2) as u64);
        let mut ddp = Ddp::new(model(99, HID), &pg, DdpOptions::default()).unwrap();
        let mut opt = ddp
            .load_records(&r.checkpoint, optimizer(Opt::Adam))
            .unwrap();
        run_steps(&mut ddp, &mut opt, rank, r.state.step as usize, STEPS);
        assert_eq!(ddp.replica_max_diff().unwrap(), 0.0);
        ddp.module().params()
    });
    for rank in 0..WORLD {
        assert_eq!(resumed[rank], uninterrupted[rank], "rank {rank}");
    }
}

#[test]
fn a_damaged_or_missing_record_is_an_error_naming_the_blob() {
    run_ranks(1, |_, pg| {
        let mut ddp = Ddp::new(model(4, HID), &pg, DdpOptions::default()).unwrap();
        let opt = optimizer(Opt::Adam);
        let mut ckpt = Checkpoint::new(Default::default());
        ddp.save_records(&mut ckpt, &opt).unwrap();
        // Valid checksums but not a burnpack record (as a foreign writer could produce).
        let mut bad = ckpt.clone();
        bad.insert_blob(MODEL_BLOB, b"not a burnpack record".to_vec());
        let e = ddp
            .load_records(&bad, optimizer(Opt::Adam))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(MODEL_BLOB), "{e}");
        let mut missing = ckpt.clone();
        missing.blobs.remove(OPTIMIZER_BLOB);
        let e = ddp
            .load_records(&missing, optimizer(Opt::Adam))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(OPTIMIZER_BLOB), "{e}");
        // The module is untouched by the failed loads and still trains.
        assert_eq!(ddp.module().params(), model(4, HID).params());
    });
}
