//! End-to-end tests of the `train-digits` binary: real worker processes, real TCP collectives,
//! real checkpoint files, real `SIGKILL`. Every process is waited on with a deadline and killed
//! if it overruns, so a hang fails the test instead of blocking it.

use ddp_example_support::testing as common;

use std::io::{BufReader, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_train-digits");
const DEADLINE: Duration = Duration::from_secs(120);

struct Finished {
    success: bool,
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

fn reader(src: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = BufReader::new(src).read_to_string(&mut s);
        s
    })
}

/// Waits for `child` (stdout/stderr piped) at most `deadline`, killing it on overrun.
fn wait_bounded(mut child: Child, deadline: Duration, what: &str) -> Finished {
    let start = Instant::now();
    let out = reader(child.stdout.take().unwrap());
    let err = reader(child.stderr.take().unwrap());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what} did not finish within {deadline:?}; stderr:\n{}",
                err.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Finished {
        success: status.success(),
        code: status.code(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
        elapsed: start.elapsed(),
    }
}

fn launch(args: &[&str]) -> Child {
    Command::new(BIN)
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn run_ok(args: &[&str]) -> (serde_json::Value, Finished) {
    let f = wait_bounded(launch(args), DEADLINE, "train-digits");
    assert!(
        f.success,
        "train-digits {args:?} failed:\n{}\n{}",
        f.stdout, f.stderr
    );
    let last = f.stdout.lines().last().unwrap_or_default();
    let v: serde_json::Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("last line is not JSON ({e}): {last:?}"));
    (v, f)
}

#[test]
fn default_run_reaches_95_percent_with_identical_replicas() {
    let (v, f) = run_ok(&["--nproc", "2", "--json"]);
    common::assert_json_keys_in_order(f.stdout.lines().last().unwrap());
    assert_eq!(v["world_size"], 2);
    assert!(v["test_accuracy"].as_f64().unwrap() >= 0.95, "{v}");
    assert_eq!(v["replicas_identical"], true);
    assert_eq!(v["max_param_diff"], 0.0);
    assert!(v["final_loss"].as_f64().unwrap() < 0.3, "{v}");
    assert!(v["samples_per_s"].as_f64().unwrap() > 0.0);
    // 1437 training images, 719 per rank (padded), 32 per batch: 23 steps × 30 epochs.
    assert_eq!(v["steps"], 690);
    assert!(f.elapsed < Duration::from_secs(60), "took {:?}", f.elapsed);
    assert!(f.stdout.contains("held-out accuracy"), "{}", f.stdout);
}

#[test]
fn staged_backward_trains_bit_identically_to_plain() {
    let common = ["--nproc", "2", "--epochs", "3", "--json"];
    let (plain, _) = run_ok(&[&common[..], &["--backward", "plain"]].concat());
    let (staged, _) = run_ok(&[&common[..], &["--backward", "staged"]].concat());
    assert_eq!(plain["param_sum"], staged["param_sum"]);
    assert_eq!(plain["param_l2"], staged["param_l2"]);
    assert_eq!(plain["final_loss"], staged["final_loss"]);
}

#[test]
fn checkpoints_written_in_the_background_are_the_synchronous_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (sync, bg) = (dir.path().join("sync"), dir.path().join("async"));
    let o = [
        "--optimizer",
        "adamw",
        "--momentum",
        "0",
        "--epochs",
        "3",
        "--json",
    ];
    let stop = ["--max-steps", "50", "--checkpoint-dir"];
    run_ok(&[&o[..], &stop[..], &[sync.to_str().unwrap()]].concat());
    let with = [bg.to_str().unwrap(), "--checkpoint-async", "skip"];
    run_ok(&[&o[..], &stop[..], &with[..]].concat());
    let file = |d: &std::path::Path| std::fs::read(d.join("checkpoint.safetensors")).unwrap();
    assert!(
        file(&sync) == file(&bg),
        "the background write differs from the synchronous one"
    );
}

#[test]
fn interrupted_and_resumed_run_ends_exactly_like_an_uninterrupted_one() {
    for (optimizer, momentum) in [("sgd", "0.9"), ("adamw", "0")] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        let o = [
            "--optimizer",
            optimizer,
            "--momentum",
            momentum,
            "--epochs",
            "6",
            "--json",
        ];
        let (full, _) = run_ok(&o);
        // Stop mid-epoch (23 steps per epoch), then resume from the checkpoint.
        let (part, _) = run_ok(&[&o[..], &["--max-steps", "50", "--checkpoint-dir", d]].concat());
        assert_eq!(part["steps"], 50);
        assert!(dir.path().join("checkpoint.safetensors").exists());
        let (resumed, f) = run_ok(&[&o[..], &["--resume", "--checkpoint-dir", d]].concat());
        assert!(
            f.stdout.contains("resuming from")
                && f.stdout.contains("at step 50, epoch 2, 128 samples"),
            "{}",
            f.stdout
        );
        common::assert_same_run(&resumed, &full, &format!("{optimizer} after resume"));
        // A checkpoint of other hyper-parameters is refused with a clear error.
        let f = wait_bounded(
            launch(&[&o[..], &["--lr", "0.5", "--resume", "--checkpoint-dir", d]].concat()),
            DEADLINE,
            "resume with another lr",
        );
        assert!(!f.success);
        assert!(f.stderr.contains("lr"), "{}", f.stderr);
    }
}

/// With each comm hook that keeps state (PowerSGD's per-rank residuals and warm-start Q,
/// local SGD's averager), an interrupted-and-resumed run ends exactly like an uninterrupted one
/// through the candle adapter; the hook's traffic shows in `bytes_per_step`, and a checkpoint of
/// another hook is refused.
#[test]
fn resume_is_exact_with_stateful_comm_hooks() {
    let mut bytes = Vec::new();
    for hook in ["powersgd:2:5", "localsgd:3:5"] {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        let o = ["--hook", hook, "--hidden", "256", "--epochs", "2", "--json"];
        let (full, _) = run_ok(&o);
        assert_eq!(full["hook"], hook);
        assert_eq!(full["replicas_identical"], true);
        bytes.push(full["bytes_per_step"].as_f64().unwrap());
        let (part, _) = run_ok(&[&o[..], &["--max-steps", "30", "--checkpoint-dir", d]].concat());
        assert_eq!(part["steps"], 30);
        let (resumed, _) = run_ok(&[&o[..], &["--resume", "--checkpoint-dir", d]].concat());
        common::assert_same_run(&resumed, &full, &format!("{hook} after resume"));
        let other = [
            &o[..1],
            &["bf16", "--hidden", "256", "--epochs", "2"],
            &["--resume", "--checkpoint-dir", d],
        ]
        .concat();
        let f = wait_bounded(launch(&other), DEADLINE, "resume with another hook");
        assert!(!f.success);
        assert!(f.stderr.contains("hook"), "{}", f.stderr);
    }
    // 64·256 + 256·10 weights + 266 biases = 19 210 f32 = 76 840 bytes uncompressed per step.
    assert!(bytes.iter().all(|&b| b < 76_840.0 / 2.0), "{bytes:?}");
}

fn wait_for_file(path: &Path, deadline: Duration) {
    let start = Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn checkpoint_epoch(dir: &Path) -> u64 {
    let bytes = std::fs::read(dir.join("checkpoint.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(header["__metadata__"]["ddp_meta"].as_str().unwrap()).unwrap();
    meta["sampler"]["epoch"].as_u64().unwrap()
}

fn sigkill(pid: u32) {
    // SAFETY: plain kill(2) on a process this test started.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
}

#[test]
fn killing_a_worker_fails_the_others_naming_it_then_resume_completes() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    // Workers started directly (as under ddprun): one process per rank, env rendezvous.
    let port = ddp_example_support::testing::free_port().to_string();
    let worker = |rank: &str| {
        Command::new(BIN)
            .args([
                "--epochs",
                "1000000",
                "--log-every",
                "0",
                "--checkpoint-dir",
                d,
            ])
            .env("RANK", rank)
            .env("WORLD_SIZE", "2")
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let rank0 = worker("0");
    let mut rank1 = worker("1");
    wait_for_file(&dir.path().join("checkpoint.safetensors"), DEADLINE);
    sigkill(rank1.id());
    let _ = rank1.wait();
    let f = wait_bounded(
        rank0,
        Duration::from_secs(60),
        "rank 0 after its peer was killed",
    );
    assert!(!f.success, "rank 0 exited successfully after losing rank 1");
    assert_eq!(f.code, Some(1));
    assert!(
        f.stderr.contains("rank 1"),
        "rank 0's error does not name rank 1:\n{}",
        f.stderr
    );
    assert!(
        f.elapsed < Duration::from_secs(30),
        "rank 0 took {:?} to notice",
        f.elapsed
    );

    // Resume from the last epoch checkpoint, a few epochs further, with the launcher.
    let epoch = checkpoint_epoch(dir.path());
    assert!(epoch >= 1);
    let target = (epoch + 3).to_string();
    let (v, out) = run_ok(&[
        "--epochs",
        &target,
        "--resume",
        "--checkpoint-dir",
        d,
        "--json",
    ]);
    assert!(out.stdout.contains("resuming from"), "{}", out.stdout);
    assert_eq!(v["steps"].as_u64().unwrap(), (epoch + 3) * 23);
    assert_eq!(v["replicas_identical"], true);
    assert!(v["test_accuracy"].as_f64().unwrap() > 0.8);
}

#[test]
fn non_finite_gradients_stop_the_run_naming_step_rank_and_parameter() {
    let args = [
        "--nproc",
        "2",
        "--lr",
        "1e30",
        "--epochs",
        "1",
        "--log-every",
        "0",
    ];
    let f = wait_bounded(launch(&args), DEADLINE, "train-digits --lr 1e30");
    assert!(
        !f.success,
        "--lr 1e30 must fail:\n{}\n{}",
        f.stdout, f.stderr
    );
    let want = "non-finite gradient at step 1: rank 0 produced a NaN or infinite gradient of \
                parameter `";
    assert!(f.stderr.contains(want), "stderr:\n{}", f.stderr);
    // With the check off, the old behaviour: success with a NaN (null) loss.
    let mut off = args.to_vec();
    off.extend(["--no-check-finite", "--json"]);
    let (v, _) = run_ok(&off);
    assert!(v["final_loss"].is_null(), "{v}");
}

/// `--zero 3` (parameters sharded, `ddprs::candle::Fsdp`, units fc1 and fc2) trains like DDP with
/// identical replicas, sends at most 1.5x its bytes, and an interrupted run resumed from its
/// sharded set ends exactly like an uninterrupted one.
#[test]
fn zero_3_trains_like_ddp_and_resumes_exactly() {
    let o = [
        "--nproc",
        "2",
        "--optimizer",
        "adamw",
        "--momentum",
        "0",
        "--epochs",
        "3",
        "--json",
    ];
    let (ddp, _) = run_ok(&[&o[..], &["--zero", "0"]].concat());
    let (full, _) = run_ok(&[&o[..], &["--zero", "3"]].concat());
    assert_eq!(full["replicas_identical"], true);
    assert_eq!(full["steps"], ddp["steps"]);
    let (a, b) = (
        full["param_l2"].as_f64().unwrap(),
        ddp["param_l2"].as_f64().unwrap(),
    );
    assert!((a - b).abs() <= 1e-4 * b, "param_l2 {a} vs DDP's {b}");
    let (a, b) = (
        full["test_accuracy"].as_f64().unwrap(),
        ddp["test_accuracy"].as_f64().unwrap(),
    );
    assert!((a - b).abs() <= 0.01, "test accuracy {a} vs DDP's {b}");
    let (a, b) = (
        full["bytes_per_step"].as_f64().unwrap(),
        ddp["bytes_per_step"].as_f64().unwrap(),
    );
    assert!(a > b && a <= 1.5 * b * 1.01, "bytes/step {a} vs DDP's {b}");

    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let z3 = [&o[..], &["--zero", "3", "--checkpoint-dir", d]].concat();
    let (part, _) = run_ok(&[&z3[..], &["--max-steps", "30"]].concat());
    assert_eq!(part["steps"], 30);
    assert!(dir.path().join("zero_latest").exists());
    let (resumed, f) = run_ok(&[&z3[..], &["--resume"]].concat());
    assert!(
        f.stdout.contains("resuming from the sharded set") && f.stdout.contains("at step 30"),
        "{}",
        f.stdout
    );
    common::assert_same_run(&resumed, &full, "after resume");
}
