//! `train-gpt --framework burn --hook diloco` / `streaming-diloco`, as a user runs it (real
//! worker processes): what `tests/diloco.rs` checks on candle, on Burn. The replicas end
//! identical and the model learns, the bytes are DiLoCo's synchronizations', a run stopped
//! between synchronizations resumes bit for bit from its checkpoint (each rank's own inner state
//! in it), and another world size is refused.

mod common;

use common::bits;
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_train-gpt");

/// Every run here: Burn, the small model, `nproc` processes of 4 windows, 12 steps.
fn flags<'a>(nproc: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let run = ["--framework", "burn", "--nproc", nproc, "--batch-size", "4"];
    let steps = ["--warmup-iters", "2", "--max-iters", "12"];
    [common::SMALL_MODEL, &run, &steps, args].concat()
}

/// A run of 2 processes; its JSON line.
fn run(args: &[&str]) -> Value {
    common::json_run(BIN, &flags("2", &[args, &["--json"]].concat()))
}

/// DiLoCo every 4 steps and streaming DiLoCo (2 fragments, overlap 1): the replicas end
/// identical (the last step synchronizes), training learns, DiLoCo sends 3 synchronizations'
/// worth of DDP's per-step bytes in 12 steps (streaming: bf16, fewer again), and the model is
/// not DDP's.
#[test]
fn burn_diloco_ends_with_identical_replicas_and_sends_its_synchronizations_bytes() {
    let ddp = run(&[]);
    let dl = run(&["--hook", "diloco:4"]);
    let st = run(&["--hook", "streaming-diloco:4:2:1"]);
    common::assert_diloco_trains(&ddp, &dl, &st);
}

/// Stopped at step 7 — between synchronizations, streaming with a fragment in flight — and
/// resumed from the checkpoint: the same run as the uninterrupted one, bit for bit. The
/// checkpoint holds each rank's own state; at 3 processes rank 2 joins from the last
/// synchronization, at 1 rank 1's progress is dropped.
#[test]
fn burn_diloco_resumes_exactly_between_synchronizations() {
    for hook in ["diloco:4:0.5:0.8", "streaming-diloco:4:2:1"] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        let whole = run(&["--hook", hook]);
        let common = ["--hook", hook, "--checkpoint-dir", d];
        let stopped = run(&[&common[..], &["--stop-after", "7"]].concat());
        let at7 = common::copy_dir(dir.path());
        assert_ne!(bits(&stopped, "param_sum"), bits(&whole, "param_sum"));
        let resumed = run(&[&common[..], &["--resume"]].concat());
        assert_eq!(resumed["start_step"], 7, "{resumed}");
        for key in ["param_sum", "param_l2", "val_loss"] {
            assert_eq!(bits(&whole, key), bits(&resumed, key), "{hook} {key}");
        }
        // At another world size: ranks joining start from the last synchronization (step 4).
        for nproc in [3, 1] {
            let copy = common::copy_dir(at7.path());
            let c = ["--hook", hook, "--resume", "--json", "--checkpoint-dir"];
            let args = [&c[..], &[copy.path().to_str().unwrap()]].concat();
            let n = nproc.to_string();
            let args = flags(&n, &args);
            common::assert_diloco_resumes_at_another_world(BIN, nproc, &args);
        }
    }
}
