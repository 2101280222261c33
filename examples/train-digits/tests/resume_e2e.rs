//! What a user hit resuming with the real `train-digits` binary (issue 40): a `zero_latest`
//! pointer that names something outside its directory, two jobs on one directory, a save set
//! resumed at another world size, a resume across `--zero` stages, and an unwritable directory
//! found only at the first save.

use ddp_example_support::testing as common;

use common::{assert_same_run, run_bin, Finished};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_train-digits");

fn run(args: &[&str]) -> Finished {
    run_bin(BIN, args, 180)
}

fn run_ok(args: &[&str]) -> (serde_json::Value, Finished) {
    let f = run(args);
    assert!(f.success, "train-digits {args:?} failed:\n{}", f.stderr);
    (f.json(), f)
}

const BASE: [&str; 7] = [
    "--optimizer",
    "adamw",
    "--momentum",
    "0",
    "--json",
    "--seed",
    "3",
];

/// A run of 3 epochs.
fn args<'a>(nproc: &'a str, zero: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    args_epochs(nproc, zero, "3", extra)
}

fn args_epochs<'a>(
    nproc: &'a str,
    zero: &'a str,
    epochs: &'a str,
    extra: &[&'a str],
) -> Vec<&'a str> {
    [
        &BASE[..],
        &["--nproc", nproc, "--zero", zero, "--epochs", epochs],
        extra,
    ]
    .concat()
}

/// The save-set directories in `dir`.
fn sets(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("zero-step"))
        .collect();
    v.sort();
    v
}

/// A pointer naming a directory outside the checkpoint directory (absolute, or through `..`)
/// never makes a save delete it, and a resume refuses it naming the file; an empty pointer
/// neither deletes the set just written nor resumes as a fresh start.
#[test]
fn a_zero_latest_pointer_outside_its_directory_is_refused_and_deletes_nothing() {
    let root = tempfile::tempdir().unwrap();
    let victim = root.path().join("precious");
    std::fs::create_dir(&victim).unwrap();
    std::fs::write(victim.join("data.txt"), b"keep me").unwrap();
    let ck = root.path().join("ck");
    std::fs::create_dir(&ck).unwrap();
    let d = ck.to_str().unwrap();
    let latest = ck.join("zero_latest");
    // A user's own directory with a set-like name but no index of ours: never removed either.
    std::fs::create_dir(ck.join("zero-step-notes")).unwrap();

    for pointer in [victim.to_str().unwrap().to_string(), "../precious".into()] {
        std::fs::write(&latest, &pointer).unwrap();
        // Without --resume the job trains and saves (twice: an epoch end and the end).
        let (_, f) = run_ok(&args(
            "2",
            "1",
            &["--max-steps", "40", "--checkpoint-dir", d],
        ));
        assert!(
            victim.join("data.txt").exists(),
            "pointer {pointer:?} deleted {}\n{}",
            victim.display(),
            f.stdout
        );
        assert_eq!(sets(&ck).len(), 2, "one set and the notes: {:?}", sets(&ck));
        // With --resume, a pointer like it is refused, naming the file.
        std::fs::write(&latest, &pointer).unwrap();
        let f = run(&args("2", "1", &["--resume", "--checkpoint-dir", d]));
        assert!(!f.success, "resumed from {pointer:?}:\n{}", f.stdout);
        assert!(
            f.stderr.contains("zero_latest") && f.stderr.contains("does not name a save set"),
            "{}",
            f.stderr
        );
        assert!(!f.stdout.contains("held-out accuracy"), "{}", f.stdout);
    }
    assert!(ck.join("zero-step-notes").exists());

    // An empty pointer: refused on resume, and a save beside it keeps what it wrote.
    std::fs::write(&latest, b"").unwrap();
    let f = run(&args("2", "1", &["--resume", "--checkpoint-dir", d]));
    assert!(
        !f.success && f.stderr.contains("it is empty"),
        "{}",
        f.stderr
    );
    let (_, _) = run_ok(&args(
        "2",
        "1",
        &["--max-steps", "10", "--checkpoint-dir", d],
    ));
    let name = std::fs::read_to_string(&latest).unwrap();
    assert!(ck.join(name.trim()).join("index.json").exists(), "{name}");
    // A symbolic link with a set's name is refused too.
    let link = "zero-step0000000010-00000000000000aa";
    std::os::unix::fs::symlink(&victim, ck.join(link)).unwrap();
    std::fs::write(&latest, link).unwrap();
    let f = run(&args("2", "1", &["--resume", "--checkpoint-dir", d]));
    assert!(
        !f.success && f.stderr.contains("symbolic link"),
        "{}",
        f.stderr
    );
    assert!(victim.join("data.txt").exists());
}

/// A second job on a directory in use is refused at start, naming the holder; once the first
/// is killed with SIGKILL, its lock does not block the next start.
#[test]
fn a_second_job_on_one_checkpoint_directory_is_refused_naming_the_holder() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    for zero in ["0", "1"] {
        let long = args_epochs("2", zero, "100000", &["--checkpoint-dir", d]);
        // The previous iteration's holder (killed) left its name: wait for this job's.
        let before = std::fs::read_to_string(dir.path().join(".ddp-lock")).unwrap_or_default();
        let mut first = Command::new(BIN)
            .args(&long)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .unwrap();
        let lock = dir.path().join(".ddp-lock");
        let start = Instant::now();
        while std::fs::read_to_string(&lock).map_or(true, |s| !s.contains("pid") || s == before) {
            assert!(start.elapsed() < Duration::from_secs(60), "no lock taken");
            std::thread::sleep(Duration::from_millis(50));
        }
        let f = run(&args(
            "2",
            zero,
            &["--max-steps", "5", "--checkpoint-dir", d],
        ));
        let holder = std::fs::read_to_string(&lock).unwrap();
        // Kill the whole first job (launcher and workers) with SIGKILL: no clean-up runs.
        let pgid = first.id() as i32;
        // SAFETY: sending a signal to a process group this test started has no memory effects.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = first.wait();
        assert!(
            !f.success,
            "--zero {zero}: the second job ran:\n{}",
            f.stdout
        );
        assert!(
            f.stderr.contains("is in use by another job") && f.stderr.contains(holder.trim()),
            "--zero {zero}: {}\n(holder: {holder})",
            f.stderr
        );
        assert!(!f.stdout.contains("epoch "), "{}", f.stdout);
        // The holder died without releasing: the next job starts.
        std::thread::sleep(Duration::from_millis(200));
        run_ok(&args(
            "2",
            zero,
            &["--max-steps", "5", "--checkpoint-dir", d],
        ));
    }
}

/// A save set written at one world size resumes at another (the rest of the epoch re-sharded),
/// and ends where a plain DDP checkpoint resumed across the same sizes ends.
#[test]
fn a_zero_set_resumes_at_another_world_size_like_ddp() {
    for (from, to) in [("2", "3"), ("2", "1")] {
        let mut ends = Vec::new();
        for zero in ["0", "2"] {
            let dir = tempfile::tempdir().unwrap();
            let d = dir.path().to_str().unwrap();
            let (part, _) = run_ok(&args(
                from,
                zero,
                &["--max-steps", "30", "--checkpoint-dir", d],
            ));
            assert_eq!(part["steps"], 30);
            let (end, f) = run_ok(&args(to, zero, &["--resume", "--checkpoint-dir", d]));
            assert!(
                f.stdout.contains("re-sharded over") && f.stdout.contains("at step 30"),
                "--zero {zero} {from}->{to}:\n{}",
                f.stdout
            );
            assert_eq!(end["replicas_identical"], true);
            ends.push(end);
        }
        assert_eq!(ends[0]["steps"], ends[1]["steps"], "{from}->{to}");
        let (a, b) = (
            ends[1]["param_l2"].as_f64().unwrap(),
            ends[0]["param_l2"].as_f64().unwrap(),
        );
        assert!(
            (a - b).abs() <= 1e-5 * b,
            "{from}->{to}: ZeRO {a} vs DDP {b}"
        );
    }
}

/// `--resume` with another `--zero` loads the checkpoint (a plain one into a sharded run, a
/// set into plain DDP or stage 3) and ends like the run that never changed stage.
#[test]
fn changing_zero_on_resume_loads_the_checkpoint_instead_of_starting_fresh() {
    let (full, _) = run_ok(&args("2", "0", &[]));
    for (before, after) in [("0", "1"), ("1", "0"), ("0", "3"), ("2", "3")] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        run_ok(&args(
            "2",
            before,
            &["--max-steps", "30", "--checkpoint-dir", d],
        ));
        let (end, f) = run_ok(&args("2", after, &["--resume", "--checkpoint-dir", d]));
        assert!(
            f.stdout.contains("resuming from") && f.stdout.contains("at step 30"),
            "--zero {before} -> {after} did not resume:\n{}",
            f.stdout
        );
        assert_eq!(end["steps"], full["steps"], "{before}->{after}");
        let (a, b) = (
            end["param_l2"].as_f64().unwrap(),
            full["param_l2"].as_f64().unwrap(),
        );
        assert!((a - b).abs() <= 1e-5 * b, "{before}->{after}: {a} vs {b}");
        if before == "0" && after == "1" {
            // The same stage both times: exactly the uninterrupted run.
            let (again, _) = run_ok(&args("2", "1", &["--resume", "--checkpoint-dir", d]));
            assert_eq!(again["steps"], full["steps"]);
        }
    }
    // Stage 0 resumed from its own checkpoint is still exact.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    run_ok(&args(
        "2",
        "0",
        &["--max-steps", "30", "--checkpoint-dir", d],
    ));
    let (end, _) = run_ok(&args("2", "0", &["--resume", "--checkpoint-dir", d]));
    assert_same_run(&end, &full, "stage 0 resumed");
}

/// A sharded run checks its directory before training: an unwritable one fails at start.
#[test]
fn a_zero_run_with_an_unwritable_directory_fails_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("not-a-directory");
    std::fs::write(&file, b"x").unwrap();
    let bad = file.join("ck");
    for zero in ["1", "3"] {
        let f = run(&args(
            "2",
            zero,
            &["--checkpoint-dir", bad.to_str().unwrap()],
        ));
        assert!(!f.success);
        assert!(
            f.stderr.contains("checkpoint directory is not writable"),
            "--zero {zero}: {}",
            f.stderr
        );
        assert!(!f.stdout.contains("epoch "), "--zero {zero}: {}", f.stdout);
        assert!(f.elapsed < Duration::from_secs(60), "took {:?}", f.elapsed);
    }
}
