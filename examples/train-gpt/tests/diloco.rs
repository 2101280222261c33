//! `train-gpt --hook diloco` / `streaming-diloco` (and `localsgd`, the other outer loop), as a
//! user runs it (real worker processes):
//! the replicas end identical, far fewer bytes than DDP, an exact resume from a checkpoint
//! taken between synchronizations (a fragment in flight), and the refusals.

mod common;

use common::bits;
use serde_json::Value;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_train-gpt");

/// The small model at `nproc` processes of 4 windows, candle, `args` after.
fn flags<'a>(nproc: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let run = [
        "--framework",
        "candle",
        "--nproc",
        nproc,
        "--batch-size",
        "4",
    ];
    [
        common::SMALL_MODEL,
        &run,
        &["--warmup-iters", "2", "--json"],
        args,
    ]
    .concat()
}

fn run(args: &[&str]) -> Value {
    common::json_run(BIN, &flags("2", args))
}

/// DiLoCo every 4 steps and streaming DiLoCo (2 fragments, overlap 1): the replicas end
/// identical (the last step synchronizes), training learns, and the bytes sent are about 1/H of
/// DDP's (streaming: bf16, half again).
#[test]
fn diloco_ends_with_identical_replicas_and_sends_a_fraction_of_ddps_bytes() {
    let ddp = run(&["--max-iters", "12"]);
    let dl = run(&["--max-iters", "12", "--hook", "diloco:4"]);
    let st = run(&["--max-iters", "12", "--hook", "streaming-diloco:4:2:1"]);
    common::assert_diloco_trains(&ddp, &dl, &st);
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
        let at7 = common::copy_dir(dir.path());
        let resumed = run(&[&common[..], &["--resume"]].concat());
        for key in ["param_sum", "param_l2", "val_loss"] {
            assert_eq!(bits(&whole, key), bits(&resumed, key), "{hook} {key}");
        }
        // Each rank's own state is in it; at another world size the ranks joining start from
        // the last synchronization (step 4), and the progress of those leaving is dropped.
        for nproc in [3, 1] {
            let n = nproc.to_string();
            let copy = common::copy_dir(at7.path());
            let c = [
                "--max-iters",
                "12",
                "--hook",
                hook,
                "--resume",
                "--checkpoint-dir",
            ];
            let args = flags(&n, &[&c[..], &[copy.path().to_str().unwrap()]].concat());
            common::assert_diloco_resumes_at_another_world(BIN, nproc, &args);
        }
    }
}

#[test]
fn malformed_diloco_forms_are_refused() {
    let bad_forms = ["diloco", "diloco:0", "streaming-diloco:4", "diloco:4:x"];
    // Settings that parse but do not go together: F > H, TAU >= H/F, momentum 1.
    let bad_settings = [
        "streaming-diloco:4:8",
        "streaming-diloco:4:2:2",
        "diloco:4:0.7:1",
    ];
    for bad in bad_forms.into_iter().chain(bad_settings) {
        let out = Command::new(BIN).args(["--hook", bad]).output().unwrap();
        assert!(!out.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("forms") || err.contains("H"), "{bad}: {err}");
    }
}

/// Under the elastic launcher (`ddprun --nnodes 2:3`, no `--fault-tolerance`): a third node
/// arriving while two train restarts the round at world 3, which resumes from the newest DiLoCo
/// checkpoint — nodes 0 and 1 from their own state, the newcomer from the last synchronization —
/// and ends with identical replicas.
#[test]
fn a_node_joining_an_elastic_diloco_job_starts_from_the_last_synchronization() {
    let ddprun = std::path::Path::new(BIN).with_file_name("ddprun");
    if !ddprun.is_file() {
        return eprintln!("skipped: the ddprun binary is not built");
    }
    let port = ddp_example_support::testing::free_port();
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    let iters = "3000";
    let mut gpt: Vec<String> = flags("1", &["--hook", "diloco:4", "--max-iters", iters])
        .into_iter()
        .filter(|a| *a != "--nproc" && *a != "1")
        .map(String::from)
        .collect();
    gpt.extend(
        [
            "--eval-interval",
            "1000000",
            "--checkpoint-every",
            "25",
            "--resume",
        ]
        .map(String::from),
    );
    gpt.extend(["--checkpoint-dir".into(), ck.display().to_string()]);
    let log = |n: &str| tmp.path().join(format!("{n}.log"));
    let node = |n: &str| {
        common::elastic_node(&ddprun, BIN, port, &log(n), &[], &gpt)
            .spawn()
            .unwrap()
    };
    let a = node("a");
    std::thread::sleep(std::time::Duration::from_millis(300)); // A hosts the rendezvous store
    let b = node("b");
    // Once the pair has written a checkpoint, a third node arrives.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while std::fs::read_dir(&ck).map_or(0, |d| d.count()) == 0 {
        assert!(std::time::Instant::now() < until, "no checkpoint written");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let c = node("c");
    let ok: Vec<bool> = [a, b, c]
        .into_iter()
        .map(|mut ch| ch.wait().unwrap().success())
        .collect();
    let text = |n: &str| std::fs::read_to_string(log(n)).unwrap_or_default();
    let all = format!("A:\n{}\nB:\n{}\nC:\n{}", text("a"), text("b"), text("c"));
    assert!(ok.iter().all(|&s| s), "{all}");
    let line = all
        .lines()
        .find(|l| l.contains("{\"framework\""))
        .unwrap_or_else(|| panic!("no JSON line:\n{all}"));
    let j: Value = serde_json::from_str(&line[line.find('{').unwrap()..]).unwrap();
    assert_eq!(j["world_size"], 3, "{j}\n{all}");
    assert_eq!(j["replicas_identical"], true, "{j}");
    assert!(j["start_step"].as_u64().unwrap() > 0, "{j}\n{all}");
    assert!(
        all.contains("DiLoCo checkpoint of 2 processes resumed with 3"),
        "{all}"
    );
}

/// Post-local SGD (`--hook localsgd:4:4`: all-reduce for 4 steps, then the parameters averaged
/// every 4 steps and at the end) on both frameworks: identical replicas at the end, the bytes of
/// 4 all-reduced steps and 3 averagings (steps 5, 9 and the end), an exact resume from step 7
/// (between averagings: every rank's own state in the checkpoint), and a resume with 3
/// processes where rank 2 starts from a peer's state.
#[test]
fn post_local_sgd_averages_every_period_and_resumes_exactly() {
    for fw in ["candle", "burn"] {
        let run = |nproc: &str, args: &[&str]| {
            let run = ["--framework", fw, "--nproc", nproc, "--batch-size", "4"];
            let steps = ["--warmup-iters", "2", "--max-iters", "12", "--json"];
            common::json_run_stderr(BIN, &[common::SMALL_MODEL, &run, &steps, args].concat())
        };
        let (ddp, _) = run("2", &[]);
        let hook = ["--hook", "localsgd:4:4"];
        let (whole, _) = run("2", &hook);
        assert_eq!(whole["replicas_identical"], true, "{fw}: {whole}");
        let bytes = |j: &Value| j["comm_bytes"].as_u64().unwrap() as f64;
        let per_step = bytes(&ddp) / 12.0;
        assert!(
            (bytes(&whole) - 7.0 * per_step).abs() < 0.01 * per_step,
            "{fw}: {whole}\n{ddp}"
        );
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        let ck = [&hook[..], &["--checkpoint-dir", d]].concat();
        run("2", &[&ck[..], &["--stop-after", "7"]].concat());
        let at7 = common::copy_dir(dir.path());
        let (resumed, _) = run("2", &[&ck[..], &["--resume"]].concat());
        for key in ["param_sum", "param_l2", "val_loss"] {
            assert_eq!(bits(&whole, key), bits(&resumed, key), "{fw} {key}");
        }
        let p = at7.path().to_str().unwrap();
        let (three, err) = run(
            "3",
            &[&hook[..], &["--checkpoint-dir", p, "--resume"]].concat(),
        );
        assert_eq!(three["replicas_identical"], true, "{fw}: {three}");
        assert!(
            err.contains("post-local SGD checkpoint of 2 processes resumed with 3")
                && err.contains("from a peer's parameters"),
            "{fw}: {err}"
        );
    }
}
