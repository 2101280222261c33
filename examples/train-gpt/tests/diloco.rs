//! `train-gpt --hook diloco` / `streaming-diloco`, as a user runs it (real worker processes):
//! the replicas end identical, far fewer bytes than DDP, an exact resume from a checkpoint
//! taken between synchronizations (a fragment in flight), and the refusals.

mod common;

use serde_json::Value;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_train-gpt");

fn run(args: &[&str]) -> Value {
    let out = Command::new(BIN)
        .args(common::SMALL_MODEL)
        .args(["--framework", "candle", "--nproc", "2", "--batch-size", "4"])
        .args(["--warmup-iters", "2", "--json"])
        .args(args)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?} failed:\n{stdout}\n{stderr}");
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line:\n{stdout}\n{stderr}"));
    serde_json::from_str(line).unwrap()
}

fn bits(v: &Value, key: &str) -> u64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} in {v}"))
        .to_bits()
}

/// DiLoCo every 4 steps and streaming DiLoCo (2 fragments, overlap 1): the replicas end
/// identical (the last step synchronizes), training learns, and the bytes sent are about 1/H of
/// DDP's (streaming: bf16, half again).
#[test]
fn diloco_ends_with_identical_replicas_and_sends_a_fraction_of_ddps_bytes() {
    let ddp = run(&["--max-iters", "12"]);
    let dl = run(&["--max-iters", "12", "--hook", "diloco:4"]);
    let st = run(&["--max-iters", "12", "--hook", "streaming-diloco:4:2:1"]);
    for j in [&dl, &st] {
        assert_eq!(j["replicas_identical"], true, "{j}");
        assert!(j["val_loss"].as_f64().unwrap() < 4.15, "{j}"); // below ln(65) = 4.17
    }
    let bytes = |j: &Value| j["comm_bytes"].as_u64().unwrap() as f64;
    let per_step = bytes(&ddp) / 12.0; // the parameters' size in bytes
                                       // 3 synchronizations in 12 steps.
    assert!(
        (bytes(&dl) - 3.0 * per_step).abs() < 0.01 * per_step,
        "{dl}\n{ddp}"
    );
    // Half the bytes (bf16), the same synchronizations, plus the final one of the fragment in
    // flight at the end.
    assert!(bytes(&st) < 0.6 * bytes(&dl), "{st}\n{dl}");
    assert_ne!(bits(&dl, "param_sum"), bits(&ddp, "param_sum"));
}

/// Stopped at step 6 — between synchronizations, streaming with a fragment in flight — and
/// resumed from the checkpoint: the same run as the uninterrupted one, bit for bit.
#[test]
fn diloco_resumes_exactly_between_synchronizations() {
    for hook in ["diloco:4:0.5:0.8", "streaming-diloco:4:2:1"] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        let whole = run(&["--max-iters", "12", "--hook", hook]);
        let common = ["--max-iters", "12", "--hook", hook, "--checkpoint-dir", d];
        run(&[&common[..], &["--stop-after", "7"]].concat());
        let resumed = run(&[&common[..], &["--resume"]].concat());
        for key in ["param_sum", "param_l2", "val_loss"] {
            assert_eq!(bits(&whole, key), bits(&resumed, key), "{hook} {key}");
        }
        // Each rank's own state is in it: another world size is refused, naming the one.
        let out = Command::new(BIN)
            .args(common::SMALL_MODEL)
            .args(["--framework", "candle", "--nproc", "1", "--batch-size", "8"])
            .args([
                "--max-iters",
                "14",
                "--hook",
                hook,
                "--checkpoint-dir",
                d,
                "--resume",
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("with 2 processes"),
            "{err}"
        );
    }
}

#[test]
fn diloco_is_refused_where_it_is_not_wired() {
    let out = Command::new(BIN)
        .args(["--framework", "burn", "--hook", "diloco:4"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("candle"), "{err}");
    for bad in ["diloco", "diloco:0", "streaming-diloco:4", "diloco:4:x"] {
        let out = Command::new(BIN).args(["--hook", bad]).output().unwrap();
        assert!(!out.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("forms") || err.contains("H"), "{bad}: {err}");
    }
}
