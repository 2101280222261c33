//! `train-gpt` as a user runs it: real worker processes (spawned by the binary itself through
//! `ddprs::launcher::spawn`), real collectives, checkpoints on disk. Small models, few steps:
//! the full recipe is a benchmark (`bench/gpt`), not a test.

use serde_json::Value;
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_train-gpt");

mod common;

/// [`common::SMALL_MODEL`], a 2-step warm-up and the final JSON line.
fn small() -> Vec<&'static str> {
    [common::SMALL_MODEL, &["--warmup-iters", "2", "--json"]].concat()
}

/// Runs `train-gpt` with `args`, checks its exit status, returns its final JSON line.
fn run(args: &[&str]) -> Value {
    let out = Command::new(BIN).args(small()).args(args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "train-gpt {args:?} failed:\n{stdout}\n{stderr}"
    );
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line:\n{stdout}\n{stderr}"));
    serde_json::from_str(line).unwrap()
}

fn f(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("no {key} in {v}"))
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / a.abs().max(b.abs()).max(1e-30)
}

/// The tensors of the checkpoint in `dir`, by name.
fn tensors(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let ck = ddprs::checkpoint::load(dir).unwrap().expect("a checkpoint");
    ck.tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.data.clone()))
        .collect()
}

#[test]
fn world_2_equals_world_1_with_twice_the_batch_on_both_frameworks() {
    for fw in ["candle", "burn"] {
        let common = ["--framework", fw, "--max-iters", "6", "--check-replicas"];
        let one = run(&[&common[..], &["--nproc", "1", "--batch-size", "8"]].concat());
        let two = run(&[&common[..], &["--nproc", "2", "--batch-size", "4"]].concat());
        assert_eq!(two["world_size"], 2, "{two}");
        assert_eq!(two["replicas_identical"], true, "{two}");
        assert_eq!(two["tied"], true, "{two}");
        for key in ["param_sum", "param_l2"] {
            let (a, b) = (f(&one, key), f(&two, key));
            assert!(rel(a, b) < 1e-5, "{fw} {key}: world 1 {a}, world 2 {b}");
        }
        // ... and a different batch is a different run (the comparison can fail).
        let other = run(&[&common[..], &["--nproc", "1", "--batch-size", "4"]].concat());
        assert!(
            rel(f(&one, "param_l2"), f(&other, "param_l2")) > 1e-5,
            "{fw}: batch changed nothing"
        );
    }
}

/// Every `--zero` stage of each framework (candle 0-3, Burn 0-2).
const STAGES: &[(&str, &str)] = &[
    ("candle", "0"),
    ("candle", "1"),
    ("candle", "2"),
    ("candle", "3"),
    ("burn", "0"),
    ("burn", "1"),
    ("burn", "2"),
];

#[test]
fn stopped_and_resumed_equals_the_uninterrupted_run_bit_for_bit_at_every_zero_stage() {
    for &(fw, zero) in STAGES {
        let dir = tempfile::tempdir().unwrap();
        let (full, part) = (dir.path().join("full"), dir.path().join("part"));
        let (full_s, part_s) = (full.to_str().unwrap(), part.to_str().unwrap());
        let common = [
            "--framework",
            fw,
            "--zero",
            zero,
            "--nproc",
            "2",
            "--batch-size",
            "4",
            "--max-iters",
            "8",
        ];
        let whole = run(&[&common[..], &["--checkpoint-dir", full_s]].concat());
        let first = run(&[
            &common[..],
            &["--checkpoint-dir", part_s, "--stop-after", "4"],
        ]
        .concat());
        assert_eq!(first["steps"], 4, "{first}");
        let resumed = run(&[&common[..], &["--checkpoint-dir", part_s, "--resume"]].concat());
        assert_eq!(resumed["steps"], 8, "{resumed}");
        assert_eq!(resumed["zero"], zero.parse::<u64>().unwrap(), "{resumed}");
        for key in ["param_sum", "param_l2", "val_loss"] {
            assert_eq!(
                f(&whole, key).to_bits(),
                f(&resumed, key).to_bits(),
                "{fw} --zero {zero}: {key}"
            );
        }
        if zero == "0" {
            assert_eq!(
                tensors(&full),
                tensors(&part),
                "{fw}: the final checkpoints differ"
            );
        } else {
            let set = |d: &Path| ddprs::sharding::latest_set(d).unwrap().is_some();
            assert!(set(&full) && set(&part), "{fw} --zero {zero}: no save set");
        }
    }
}

/// ZeRO shards the optimizer state (1), the gradients (2) and the parameters (3) and changes
/// nothing else: every stage trains what plain DDP trains (with the decay groups applied inside
/// the chunks). Stage 3 unties the head (a parameter belongs to one unit), so it is compared with
/// an untied DDP run.
#[test]
fn every_zero_stage_trains_what_plain_ddp_trains() {
    let common = ["--nproc", "2", "--batch-size", "4", "--max-iters", "6"];
    let mut plain = std::collections::HashMap::new();
    for &(fw, zero) in STAGES {
        let untied: &[&str] = if zero == "3" { &["--untied"] } else { &[] };
        let key = (fw, untied.len());
        let args = [&common[..], &["--framework", fw], untied].concat();
        let want = plain
            .entry(key)
            .or_insert_with(|| run(&[&args[..], &["--zero", "0"]].concat()))
            .clone();
        let got = run(&[&args[..], &["--zero", zero, "--check-replicas"]].concat());
        assert_eq!(got["replicas_identical"], true, "{got}");
        assert_eq!(got["tied"], untied.is_empty(), "{got}");
        for key in ["param_sum", "param_l2", "val_loss"] {
            let (a, b) = (f(&want, key), f(&got, key));
            assert!(
                rel(a, b) < 1e-6,
                "{fw} --zero {zero} {key}: DDP {a}, ZeRO {b}"
            );
        }
    }
}

/// A save set written at world 2 resumes at world 3 and at world 1 (the same global batch: the
/// rest of the epoch re-sharded by the windows all ranks consumed) and continues the run the
/// uninterrupted world-2 job trains; a plain (`--zero 0`) checkpoint is imported by ZeRO at
/// another world size the same way.
#[test]
fn a_save_set_of_world_2_resumes_at_world_1_and_3() {
    for (fw, zero) in [
        ("candle", "1"),
        ("candle", "3"),
        ("burn", "2"),
        ("candle", "0"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let at = |world: usize| -> Vec<String> {
            [
                "--framework",
                fw,
                "--nproc",
                &world.to_string(),
                "--batch-size",
                &(12 / world).to_string(),
                "--max-iters",
                "6",
                "--untied",
            ]
            .map(String::from)
            .to_vec()
        };
        let whole = run(&[&strs(&at(2))[..], &["--zero", zero]].concat());
        let saved = dir.path().join("saved");
        let s = saved.to_str().unwrap();
        run(&[
            &strs(&at(2))[..],
            &["--zero", zero, "--checkpoint-dir", s, "--stop-after", "3"],
        ]
        .concat());
        for world in [3, 1] {
            let copy = dir.path().join(format!("w{world}"));
            copy_dir(&saved, &copy);
            // A plain checkpoint resumes under ZeRO (imported); a set under its own stage.
            let resume_zero = if zero == "0" { "1" } else { zero };
            let c = copy.to_str().unwrap();
            let args = ["--zero", resume_zero, "--checkpoint-dir", c, "--resume"];
            let got = run(&[&strs(&at(world))[..], &args[..], &["--check-replicas"]].concat());
            assert_eq!(got["steps"], 6, "{got}");
            assert_eq!(got["world_size"], world, "{got}");
            // The same windows, averaged over 3 or 1 ranks instead of 2: equal up to rounding,
            // which AdamW's first steps magnify in the loss (an element with a near-zero
            // gradient moves by about lr either way), less in the parameters' sum and norm
            // (which a different batch moves by more than 1e-5: the world test above).
            for (key, tol) in [("param_sum", 1e-5), ("param_l2", 1e-5), ("val_loss", 5e-3)] {
                let (a, b) = (f(&whole, key), f(&got, key));
                assert!(
                    rel(a, b) < tol,
                    "{fw} --zero {zero} resumed at world {world}: {key} {a} vs {b}"
                );
            }
        }
    }
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        match e.file_type().unwrap().is_dir() {
            true => copy_dir(&e.path(), &dest),
            false => {
                std::fs::copy(e.path(), dest).unwrap();
            }
        }
    }
}

/// A plain checkpoint holds every rank's whole state, so it resumes at another world size (the
/// windows re-sharded: the run `--fault-tolerance` is compared with); with a comm hook, whose
/// state is per rank, that is refused, clearly, and the checkpoint is left as it was.
#[test]
fn a_plain_checkpoint_resumes_at_another_world_size_unless_a_hook_keeps_per_rank_state() {
    let write = |dir: &str, hook: &str| {
        run(&[
            "--nproc",
            "2",
            "--batch-size",
            "4",
            "--max-iters",
            "2",
            "--hook",
            hook,
            "--checkpoint-dir",
            dir,
        ])
    };
    let resume = |dir: &str, hook: &str| {
        Command::new(BIN)
            .args(small())
            .args(["--nproc", "1", "--batch-size", "8", "--max-iters", "4"])
            .args(["--hook", hook, "--checkpoint-dir", dir, "--resume"])
            .output()
            .unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    write(d, "none");
    let out = resume(d, "none");
    let text = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("resumed at step 2") && text.contains("written at world size 2"),
        "{text}"
    );

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    write(d, "powersgd:1:1");
    let before = tensors(dir.path());
    let out = resume(d, "powersgd:1:1");
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("world size 2") && text.contains("world size 1") && text.contains("hook"),
        "{text}"
    );
    assert_eq!(
        tensors(dir.path()),
        before,
        "the refused resume changed the checkpoint"
    );
}

/// `--zero 0` cannot take a save set (it holds shards, not a DDP checkpoint): refused, naming
/// the way out, and the set is left as it was.
#[test]
fn plain_ddp_refuses_a_save_set_naming_the_zero_flag() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let common = ["--nproc", "2", "--batch-size", "4", "--checkpoint-dir", d];
    run(&[&common[..], &["--zero", "1", "--max-iters", "2"]].concat());
    let listing = |p: &Path| {
        let mut v: Vec<_> = walk(p);
        v.sort();
        v
    };
    let before = listing(dir.path());
    let out = Command::new(BIN)
        .args(small())
        .args(common)
        .args(["--max-iters", "4", "--resume"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("save set") && text.contains("--zero 1, 2 or 3"),
        "{text}"
    );
    assert_eq!(
        listing(dir.path()),
        before,
        "the refused resume changed the set"
    );
}

/// Every file under `p` with its contents.
fn walk(p: &Path) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(p).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push((e.path(), std::fs::read(e.path()).unwrap()));
        }
    }
    out
}

#[test]
fn a_short_run_learns_well_below_the_uniform_guess_on_both_frameworks() {
    for fw in ["candle", "burn"] {
        let out = run(&[
            "--framework",
            fw,
            "--nproc",
            "2",
            "--batch-size",
            "8",
            "--max-iters",
            "150",
            "--lr",
            "3e-3",
            "--eval-interval",
            "150",
        ]);
        let uniform = 77f64.ln();
        let val = f(&out, "val_loss");
        assert!(
            val < 0.7 * uniform,
            "{fw}: validation loss {val} after 150 steps (uniform guess {uniform:.3})"
        );
    }
}

#[test]
fn bad_flags_are_refused_before_any_work() {
    let out = Command::new(BIN)
        .args(["--n-embd", "30", "--n-head", "4"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("--n-embd 30 is not a multiple of --n-head 4"));
    let out = Command::new(BIN)
        .args(["--stop-after", "3"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--stop-after needs --checkpoint-dir"));
    for (args, says) in [
        (
            &["--framework", "burn", "--zero", "3"][..],
            "--framework candle",
        ),
        (
            &["--zero", "2", "--hook", "bf16"][..],
            "--hook applies to plain DDP",
        ),
    ] {
        let out = Command::new(BIN).args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let text = String::from_utf8_lossy(&out.stderr);
        assert!(text.contains(says), "{args:?}: {text}");
    }
}

/// Skips (with a message) when `what` is missing, unless `DDP_TEST_REQUIRE_ALL=1` (CI).
fn skip(test: &str, why: &str) {
    assert!(
        std::env::var("DDP_TEST_REQUIRE_ALL").map_or(true, |v| v != "1"),
        "{test} cannot run: {why} (DDP_TEST_REQUIRE_ALL=1: no test may skip)"
    );
    let _ = std::io::Write::write_all(
        &mut std::io::stderr().lock(),
        format!("SKIPPED {test}: {why}\n").as_bytes(),
    );
}

fn last_json(out: &std::process::Output, what: &str) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed:\n{stdout}\n{stderr}");
    let jsons: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("{\"framework\""))
        .collect();
    assert_eq!(
        jsons.len(),
        1,
        "{what}: one JSON line (rank 0's) expected:\n{stdout}"
    );
    let line = jsons[0];
    serde_json::from_str(&line[line.find('{').unwrap()..]).unwrap()
}

/// Under `ddprun --nproc-per-node 2` and under Open MPI's `mpirun -np 2`, each process is one
/// worker, and the run is the one `--nproc 2` spawns itself, bit for bit.
#[test]
fn under_ddprun_and_mpirun_it_is_the_same_run() {
    let args = [
        "--framework",
        "candle",
        "--batch-size",
        "4",
        "--max-iters",
        "4",
    ];
    let own = run(&[&args[..], &["--nproc", "2"]].concat());
    let ddprun = Path::new(BIN).with_file_name("ddprun");
    if ddprun.is_file() {
        let out = Command::new(&ddprun)
            .args(["--nproc-per-node", "2", BIN])
            .args(small())
            .args(args)
            .output()
            .unwrap();
        let j = last_json(&out, "train-gpt under ddprun");
        assert_eq!(j["world_size"], 2, "{j}");
        assert_eq!(
            f(&j, "param_sum").to_bits(),
            f(&own, "param_sum").to_bits(),
            "{j}\n{own}"
        );
    } else {
        skip(
            "under_ddprun_and_mpirun_it_is_the_same_run (ddprun)",
            "the ddprun binary is not built (cargo test --workspace builds it)",
        );
    }
    let have_mpirun = Command::new("sh")
        .args(["-c", "command -v mpirun"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !have_mpirun {
        return skip(
            "under_ddprun_and_mpirun_it_is_the_same_run (mpirun)",
            "`mpirun` not found (install openmpi-bin)",
        );
    }
    let port = ddp_example_support::testing::free_port();
    let out = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2", BIN])
        .args(small())
        .args(args)
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .output()
        .unwrap();
    let j = last_json(&out, "train-gpt under mpirun");
    assert_eq!(j["world_size"], 2, "{j}");
    assert_eq!(
        f(&j, "param_sum").to_bits(),
        f(&own, "param_sum").to_bits(),
        "{j}\n{own}"
    );
}

/// `--sample N` prints N generated characters from rank 0 (characters of the text's
/// vocabulary), and `--metrics` writes one JSON line per evaluation.
#[test]
fn sample_and_metrics_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let metrics = dir.path().join("m.jsonl");
    let out = Command::new(BIN)
        .args(small())
        .args([
            "--nproc",
            "2",
            "--batch-size",
            "4",
            "--max-iters",
            "4",
            "--eval-interval",
            "2",
            "--sample",
            "40",
        ])
        .arg("--metrics")
        .arg(&metrics)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let start = stdout.find("--- sample ---\n").expect("a sample") + "--- sample ---\n".len();
    let end = stdout.find("\n--- end of sample ---").expect("its end");
    assert_eq!(stdout[start..end].chars().count(), 40, "{stdout}");
    let lines: Vec<Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines
            .iter()
            .map(|l| l["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![2, 4]
    );
    assert!(
        lines.iter().all(|l| l["val_loss"].as_f64().is_some()),
        "{lines:?}"
    );
}

/// `--trace DIR`: rank 0 writes one Chrome trace holding both ranks' timelines, with the
/// reducer's bucket collectives in it.
#[test]
fn trace_writes_one_timeline_of_both_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    run(&[
        "--framework",
        "candle",
        "--nproc",
        "2",
        "--batch-size",
        "4",
        "--max-iters",
        "3",
        "--trace",
        d,
    ]);
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("trace.json")).unwrap())
            .unwrap();
    let events = trace["traceEvents"].as_array().expect("a Chrome trace");
    let mut pids: Vec<u64> = events.iter().filter_map(|e| e["pid"].as_u64()).collect();
    pids.sort_unstable();
    pids.dedup();
    assert_eq!(pids.len(), 2, "one timeline per rank: {pids:?}");
    assert!(events.len() > 10, "{} events", events.len());
}
