//! What the train-gpt test files share.
#![allow(dead_code)] // each test file uses its part

use std::path::Path;
use std::process::Command;

/// A small model that still has every part (2 blocks, 2 heads, tied head, context 16), evaluated
/// on 2 batches of windows.
pub const SMALL_MODEL: &[&str] = &[
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "16",
    "--eval-iters",
    "2",
];

/// An elastic `ddprun --nnodes 2:3` agent on 127.0.0.1 (one worker, `flags` added, rendezvous
/// `port`) running `bin gpt`, its output to `log`: spawn it.
pub fn elastic_node(
    ddprun: &Path,
    bin: &str,
    port: u16,
    log: &Path,
    flags: &[&str],
    gpt: &[String],
) -> Command {
    let out = std::fs::File::create(log).unwrap();
    let mut cmd = Command::new(ddprun);
    cmd.args(["--nnodes", "2:3", "--nproc-per-node", "1"])
        .args(flags)
        .args(["--rdzv-endpoint", &format!("127.0.0.1:{port}")])
        .args(["--run-id", &format!("gpt-elastic-{port}")])
        .args(["--heartbeat-timeout", "2", "--rdzv-last-call", "2"])
        .args(["--monitor-interval", "0.05", bin])
        .args(gpt)
        .env_remove("DDP_FAULT_TOLERANCE")
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    cmd
}

/// Runs `train-gpt` (`bin`) with `args` (`--json` among them) and returns its JSON line,
/// failing the test with the output when the run fails or prints none.
pub fn json_run(bin: &str, args: &[&str]) -> serde_json::Value {
    json_run_stderr(bin, args).0
}

/// [`json_run`], with the run's stderr.
pub fn json_run_stderr(bin: &str, args: &[&str]) -> (serde_json::Value, String) {
    let out = Command::new(bin).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{args:?} failed:\n{stdout}\n{stderr}");
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("{args:?}: no JSON line:\n{stdout}\n{stderr}"));
    (serde_json::from_str(line).unwrap(), stderr.into_owned())
}

/// A DiLoCo checkpoint of 2 processes written at step 7, between the synchronizations of steps
/// 4 and 8, resumes at another world size: `args` run `nproc` processes (`--resume`, `--json`
/// among them). The run ends at world `nproc` with identical replicas, and rank 0 said which
/// ranks joined from the last synchronization or whose progress was dropped.
pub fn assert_diloco_resumes_at_another_world(bin: &str, nproc: usize, args: &[&str]) {
    let (j, err) = json_run_stderr(bin, args);
    assert_eq!(j["world_size"], nproc, "{j}");
    assert_eq!(j["start_step"], 7, "{j}");
    assert_eq!(j["replicas_identical"], true, "{j}");
    let said = match nproc > 2 {
        true => {
            "join between synchronizations from the parameters of the last synchronization \
                 (step 4)"
        }
        false => "the progress of ranks 1..2 since the last synchronization is dropped",
    };
    assert!(
        err.contains("DiLoCo checkpoint of 2 processes resumed with") && err.contains(said),
        "{nproc}: {err}"
    );
}

/// The JSON lines of 12-step runs of DDP, DiLoCo every 4 steps (`dl`) and streaming DiLoCo every
/// 4 steps (`st`): the replicas end identical (the last step synchronizes), training learns,
/// DiLoCo sends 3 synchronizations' worth of DDP's per-step bytes (steps 4, 8 and 12), streaming
/// (bf16) fewer again even with the final synchronization of its fragment in flight, and the
/// model is not DDP's.
pub fn assert_diloco_trains(
    ddp: &serde_json::Value,
    dl: &serde_json::Value,
    st: &serde_json::Value,
) {
    for j in [dl, st] {
        assert_eq!(j["replicas_identical"], true, "{j}");
        assert!(j["val_loss"].as_f64().unwrap() < 4.15, "{j}"); // below ln(65) = 4.17
    }
    let bytes = |j: &serde_json::Value| j["comm_bytes"].as_u64().unwrap() as f64;
    let per_step = bytes(ddp) / 12.0; // the parameters' size in bytes
    assert!(per_step > 0.0, "{ddp}");
    assert!(
        (bytes(dl) - 3.0 * per_step).abs() < 0.01 * per_step,
        "{dl}\n{ddp}"
    );
    assert!(bytes(st) < 0.6 * bytes(dl), "{st}\n{dl}");
    assert_ne!(bits(dl, "param_sum"), bits(ddp, "param_sum"));
}

/// The bits of the number `key` of a JSON line (for bit-for-bit comparisons).
pub fn bits(v: &serde_json::Value, key: &str) -> u64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("no {key} in {v}"))
        .to_bits()
}

/// A copy of the directory `from` (its files, not below), in a new temporary directory.
pub fn copy_dir(from: &Path) -> tempfile::TempDir {
    let to = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), to.path().join(e.file_name())).unwrap();
        }
    }
    to
}
