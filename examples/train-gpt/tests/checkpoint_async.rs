//! `train-gpt --checkpoint-async`: checkpoints written by a background thread, as a user runs
//! them (real processes, real files; a real SIGKILL during a write; a real full disk, a tmpfs
//! too small for two checkpoints).

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_train-gpt");

/// A small model (2 blocks, context 16), 2 ranks, a checkpoint every 2 steps.
fn args(fw: &str, dir: &Path, iters: u64) -> Vec<String> {
    let d = dir.to_str().unwrap();
    let run = [
        "--framework",
        fw,
        "--nproc",
        "2",
        "--batch-size",
        "4",
        "--warmup-iters",
        "2",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        d,
        "--json",
    ];
    common::SMALL_MODEL
        .iter()
        .chain(&run)
        .map(|s| s.to_string())
        .chain(["--max-iters".to_string(), iters.to_string()])
        .collect()
}

fn ok(out: &Output, what: &str) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed:\n{stdout}\n{stderr}");
    stdout
}

/// The same run, bit for bit: parameters' sum and norm, validation loss.
fn assert_same_run(a: &serde_json::Value, b: &serde_json::Value, what: &str) {
    for key in ["param_sum", "param_l2", "val_loss"] {
        let bits = |v: &serde_json::Value| v[key].as_f64().unwrap().to_bits();
        assert_eq!(bits(a), bits(b), "{what}: {key} differs:\n{a}\n{b}");
    }
}

/// Waits (up to 60 s) until `ready()`, the run `child` still running (it must not end first).
fn wait_while_running(child: &mut std::process::Child, what: &str, ready: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !ready() {
        assert!(t0.elapsed() < Duration::from_secs(60), "{what} never began");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before {what} began"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn step_of(dir: &Path) -> u64 {
    ddprs::checkpoint::load(dir)
        .unwrap()
        .expect("a checkpoint")
        .meta
        .step
}

/// The background write saves what the synchronous save saves: the same file byte for byte
/// (candle, which copies the state at the step), and on both frameworks a checkpoint that
/// resumes to the same run bit for bit (Burn keeps its immutable tensors until the writer
/// thread serializes them).
#[test]
fn an_async_checkpoint_saves_what_the_synchronous_one_saves() {
    for fw in ["candle", "burn"] {
        let dir = tempfile::tempdir().unwrap();
        let (sync, bg) = (dir.path().join("sync"), dir.path().join("async"));
        ok(
            &Command::new(BIN).args(args(fw, &sync, 6)).output().unwrap(),
            "sync",
        );
        let out = Command::new(BIN)
            .args(args(fw, &bg, 6))
            .arg("--checkpoint-async")
            .output()
            .unwrap();
        let stdout = ok(&out, "async");
        let json: serde_json::Value =
            serde_json::from_str(stdout.lines().rev().find(|l| l.starts_with('{')).unwrap())
                .unwrap();
        assert_eq!(json["checkpoint_async"], true, "{json}");
        assert!(
            json["checkpoint_stall_ms"].as_f64().unwrap() > 0.0,
            "{json}"
        );
        let file = |d: &Path| std::fs::read(ddprs::checkpoint::checkpoint_path(d)).unwrap();
        assert_eq!(step_of(&bg), 6, "{fw}");
        if fw == "candle" {
            assert!(
                file(&sync) == file(&bg),
                "the async checkpoint differs from the sync one"
            );
        }
        // Burn's records carry random parameter ids (two synchronous saves differ in bytes
        // too): the content is compared by what it resumes to, bit for bit (model, optimizer
        // state, position) — as candle's is.
        let resumed = |d: &Path| -> serde_json::Value {
            let out = Command::new(BIN)
                .args(args(fw, d, 8))
                .arg("--resume")
                .output()
                .unwrap();
            let stdout = ok(&out, "resume");
            serde_json::from_str(stdout.lines().rev().find(|l| l.starts_with('{')).unwrap())
                .unwrap()
        };
        let (a, b) = (resumed(&sync), resumed(&bg));
        assert_same_run(&a, &b, &format!("{fw}: resumed from sync, from async"));
    }
}

/// Killed (SIGKILL) while the background write of step 4 is between its temporary file and the
/// rename: the checkpoint of step 2 is the current one and loads; nothing torn is left behind.
#[test]
fn killed_during_a_background_write_the_previous_checkpoint_loads() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let mut child = Command::new(BIN)
        .args(args("candle", &ck, 8))
        .arg("--checkpoint-async")
        .env(ddprs::checkpoint::async_save::WRITE_PAUSE_ENV, "1500")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Step 2's checkpoint is in place and the next write's temporary file exists.
    let names = || -> Vec<String> {
        std::fs::read_dir(&ck)
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    wait_while_running(&mut child, "a second write", || {
        let names = names();
        names.iter().any(|n| n == "checkpoint.safetensors")
            && names
                .iter()
                .any(|n| n.starts_with(".checkpoint.safetensors.tmp"))
    });
    assert_eq!(step_of(&ck), 2, "{:?}", names());
    child.kill().unwrap(); // SIGKILL; the workers die with their parent (PDEATHSIG)
    child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(2500)); // past any pause that could still rename
    assert_eq!(step_of(&ck), 2, "the killed write replaced the checkpoint");
}

/// A tmpfs of about `bytes` mounted at `dir` (created), unmounted on drop. Needs root.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, bytes: u64) -> Tmpfs {
        std::fs::create_dir_all(dir).unwrap();
        let kib = bytes.div_ceil(4096) * 4;
        let mount = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={kib}k"), "tmpfs"])
            .arg(dir)
            .status()
            .unwrap();
        assert!(mount.success(), "mount tmpfs");
        Tmpfs(dir.to_path_buf())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn is_root() -> bool {
    let root = Command::new("id").arg("-u").output().unwrap().stdout == b"0\n";
    if !root {
        assert!(
            std::env::var("DDP_TEST_REQUIRE_ALL").map_or(true, |v| v != "1"),
            "needs root to mount a tmpfs (DDP_TEST_REQUIRE_ALL=1)"
        );
    }
    root
}

/// A disk with room for one checkpoint but not for a second next to it (a tmpfs): step 2's
/// checkpoint is written, step 4's background write fails for lack of space — a warning, and
/// training goes on — and the final one (step 6) fails too, which ends the run with an error
/// naming it; step 2's checkpoint is still the current one and loads. Needs root (mount).
#[test]
fn a_full_disk_during_a_background_write_is_reported_and_training_goes_on() {
    if !is_root() {
        return eprintln!("SKIPPED a_full_disk_during_a_background_write: needs root (mount)");
    }
    let dir = tempfile::tempdir().unwrap();
    let probe = dir.path().join("probe");
    ok(
        &Command::new(BIN)
            .args(args("candle", &probe, 2))
            .output()
            .unwrap(),
        "probe",
    );
    let size = std::fs::metadata(ddprs::checkpoint::checkpoint_path(&probe))
        .unwrap()
        .len();
    let disk = dir.path().join("disk");
    let _unmount = Tmpfs::mount(&disk, size * 3 / 2);
    let out = Command::new(BIN)
        .args(args("candle", &disk, 6))
        .arg("--checkpoint-async")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the final write could not fit:\n{stderr}"
    );
    let warned = stderr
        .lines()
        .position(|l| l.contains("warning") && l.contains("step 4"))
        .unwrap_or_else(|| panic!("no warning about step 4:\n{stderr}"));
    assert!(
        stderr.lines().skip(warned).any(|l| l.contains("step 6")),
        "training did not go on to step 6 after the warning:\n{stderr}"
    );
    assert_eq!(step_of(&disk), 2, "the current checkpoint is step 2's");
    let left: Vec<String> = std::fs::read_dir(&disk)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(left.is_empty(), "temporary files left behind: {left:?}");
}

/// [`args`] with `--zero STAGE` (save sets: a shard per rank, an index).
fn zero_args(fw: &str, stage: &str, dir: &Path, iters: u64) -> Vec<String> {
    let mut v = args(fw, dir, iters);
    v.extend(["--zero".to_string(), stage.to_string()]);
    v
}

/// The step of the current save set of `dir`.
fn set_step(dir: &Path) -> u64 {
    ddprs::sharding::set_meta(dir)
        .unwrap()
        .expect("a save set")
        .step
}

/// ZeRO save sets in the background save what the synchronous save saves: resumed, both
/// continue to the same run bit for bit (candle stages 2 and 3, Burn stage 1); the last set
/// (step 6, committed at the end) is the current one.
#[test]
fn an_async_save_set_saves_what_the_synchronous_one_saves() {
    for (fw, stage) in [("candle", "2"), ("candle", "3"), ("burn", "1")] {
        let dir = tempfile::tempdir().unwrap();
        let (sync, bg) = (dir.path().join("sync"), dir.path().join("async"));
        let run = |d: &Path, iters: u64, extra: &[&str]| -> serde_json::Value {
            let out = Command::new(BIN)
                .args(zero_args(fw, stage, d, iters))
                .args(extra)
                .output()
                .unwrap();
            let stdout = ok(&out, &format!("{fw} --zero {stage} {extra:?}"));
            serde_json::from_str(stdout.lines().rev().find(|l| l.starts_with('{')).unwrap())
                .unwrap()
        };
        run(&sync, 6, &[]);
        let j = run(&bg, 6, &["--checkpoint-async"]);
        assert_eq!(j["checkpoint_async"], true, "{j}");
        assert_eq!(set_step(&bg), 6, "{fw} --zero {stage}");
        let (a, b) = (run(&sync, 8, &["--resume"]), run(&bg, 8, &["--resume"]));
        let what = format!("{fw} --zero {stage}: resumed from sync, from async");
        assert_same_run(&a, &b, &what);
    }
}

/// Killed (SIGKILL) while step 4's shards are being written in the background (held between
/// the temporary file and the rename): step 2's set, committed when step 4's save began, is
/// the current one and a resumed run loads it.
#[test]
fn killed_during_a_background_set_write_the_previous_set_loads() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let mut child = Command::new(BIN)
        .args(zero_args("candle", "1", &ck, 8))
        .arg("--checkpoint-async")
        .env(ddprs::checkpoint::async_save::WRITE_PAUSE_ENV, "1500")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A shard of step 4 is between its temporary file and the rename.
    let writing = |d: &Path| -> bool {
        std::fs::read_dir(d)
            .into_iter()
            .flatten()
            .flatten()
            .any(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                name.starts_with("zero-step0000000004")
                    && std::fs::read_dir(e.path().join("rank0"))
                        .into_iter()
                        .flatten()
                        .flatten()
                        .any(|f| f.file_name().to_string_lossy().contains(".tmp"))
            })
    };
    wait_while_running(&mut child, "step 4's background write", || writing(&ck));
    assert_eq!(set_step(&ck), 2);
    child.kill().unwrap();
    child.wait().unwrap();
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(
        set_step(&ck),
        2,
        "the killed write replaced the current set"
    );
    let out = Command::new(BIN)
        .args(zero_args("candle", "1", &ck, 4))
        .arg("--resume")
        .output()
        .unwrap();
    ok(&out, "resume from step 2's set");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("resumed at step 2"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A disk with room for one save set but not two (a tmpfs): step 2's set lands; step 4's
/// background shards fail for lack of space, which its commit (at step 6's save) reports as a
/// warning, training going on; step 6's set fails too, an error at the end naming it. Step 2's
/// set stays current and no partial set or temporary file is left.
#[test]
fn a_full_disk_under_a_background_set_is_reported_and_the_previous_set_stays() {
    if !is_root() {
        return eprintln!("SKIPPED a_full_disk_under_a_background_set: needs root (mount)");
    }
    let dir = tempfile::tempdir().unwrap();
    let probe = dir.path().join("probe");
    ok(
        &Command::new(BIN)
            .args(zero_args("candle", "1", &probe, 2))
            .output()
            .unwrap(),
        "probe",
    );
    let size: u64 = walk_sizes(&probe);
    let disk = dir.path().join("disk");
    let _unmount = Tmpfs::mount(&disk, size * 3 / 2);
    let out = Command::new(BIN)
        .args(zero_args("candle", "1", &disk, 6))
        .arg("--checkpoint-async")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the final set could not fit:\n{stderr}"
    );
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("warning") && l.contains("step 4")),
        "no warning about step 4:\n{stderr}"
    );
    assert!(
        stderr.contains("step 6"),
        "no error naming step 6:\n{stderr}"
    );
    assert_eq!(set_step(&disk), 2, "the current set is step 2's");
    let sets: Vec<String> = std::fs::read_dir(&disk)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("zero-step"))
        .collect();
    assert_eq!(sets.len(), 1, "partial sets left behind: {sets:?}");
}

/// The bytes of every file under `dir`.
fn walk_sizes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| match e.file_type().unwrap().is_dir() {
            true => walk_sizes(&e.path()),
            false => e.metadata().unwrap().len(),
        })
        .sum()
}
