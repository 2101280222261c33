//! Single-node behaviour of `ddprun` with real worker processes (small `sh` scripts): the
//! environment contract, output prefixing and logs, failure handling and the summary, restarts,
//! signal forwarding without orphans, and the store's port being in use.

mod common;

use common::*;
use std::collections::HashMap;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(40);

/// `KEY=VALUE` pairs of the `[rankN]: env ...` line of rank `n`.
fn env_of(stdout: &str, n: usize) -> HashMap<String, String> {
    let prefix = format!("[rank{n}]: env ");
    let line = lines_with(stdout, &prefix);
    assert_eq!(line.len(), 1, "one env line for rank {n} in:\n{stdout}");
    line[0][prefix.len()..]
        .split(' ')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

const PRINT_ENV: &str = "echo env RANK=$RANK LOCAL_RANK=$LOCAL_RANK WORLD_SIZE=$WORLD_SIZE \
    LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK MASTER_ADDR=$MASTER_ADDR \
    MASTER_PORT=$MASTER_PORT RESTART=$TORCHELASTIC_RESTART_COUNT \
    MAX_RESTARTS=$TORCHELASTIC_MAX_RESTARTS RUN_ID=$TORCHELASTIC_RUN_ID \
    HOSTED=$DDP_STORE_HOSTED OMP=$OMP_NUM_THREADS RAYON=$RAYON_NUM_THREADS ARG=$0";

#[test]
fn env_contract_and_prefixed_output() {
    let mut cmd = ddprun(&[
        "--nproc-per-node",
        "3",
        "--master-port",
        "0",
        "--run-id",
        "envtest",
        "--max-restarts",
        "2",
        "--",
        "sh",
        "-c",
        PRINT_ENV,
        "first-arg",
    ]);
    cmd.env("OMP_NUM_THREADS", "7")
        .env_remove("RAYON_NUM_THREADS");
    let r = Running::start(cmd).finish(LIMIT);
    assert_eq!(r.code(), Some(0), "{r}");
    let cores = std::thread::available_parallelism().unwrap().get();
    let mut port = None;
    for n in 0..3 {
        let e = env_of(&r.stdout, n);
        assert_eq!(e["RANK"], n.to_string());
        assert_eq!(e["LOCAL_RANK"], n.to_string());
        assert_eq!(e["WORLD_SIZE"], "3");
        assert_eq!(e["LOCAL_WORLD_SIZE"], "3");
        assert_eq!(e["GROUP_RANK"], "0");
        assert_eq!(e["MASTER_ADDR"], "127.0.0.1");
        assert_eq!(e["RESTART"], "0");
        assert_eq!(e["MAX_RESTARTS"], "2");
        assert_eq!(e["RUN_ID"], "envtest");
        assert_eq!(e["HOSTED"], "1");
        assert_eq!(e["OMP"], "7", "a user's OMP_NUM_THREADS is kept");
        assert_eq!(e["RAYON"], (cores / 3).max(1).to_string());
        assert_eq!(
            e["ARG"], "first-arg",
            "program arguments are passed through"
        );
        let p: u16 = e["MASTER_PORT"].parse().unwrap();
        assert_ne!(p, 0, "--master-port 0 gives workers the actual port");
        assert_eq!(*port.get_or_insert(p), p, "all ranks get the same port");
    }
    // The launcher's own line names the store it hosted.
    assert!(
        r.stderr
            .contains(&format!("store 127.0.0.1:{}", port.unwrap())),
        "{r}"
    );
}

#[test]
fn program_without_double_dash_and_standalone() {
    let r = run(
        &[
            "--standalone",
            "--nproc-per-node",
            "2",
            "sh",
            "-c",
            "echo \"$0 $1 $RANK\"",
            "a",
            "--b",
        ],
        LIMIT,
    );
    assert_eq!(r.code(), Some(0), "{r}");
    let mut got = lines_with(&r.stdout, "[rank");
    got.sort();
    assert_eq!(got, ["[rank0]: a --b 0", "[rank1]: a --b 1"], "{r}");
}

#[test]
fn failing_rank_stops_the_others_and_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    // Every rank records its pid; rank 1 waits until all have, then fails with exit code 3.
    let script = format!(
        "echo $$ > {d}/pid$RANK; \
         if [ \"$RANK\" = 1 ]; then \
           while [ ! -s {d}/pid0 ] || [ ! -s {d}/pid2 ]; do sleep 0.05; done; \
           echo 'rank 1 is about to fail' >&2; echo 'last words' >&2; exit 3; \
         fi; exec sleep 60"
    );
    let r = run_sh(3, &["--"], &script, LIMIT);
    assert_eq!(r.code(), Some(1), "{r}");
    assert!(
        r.elapsed < Duration::from_secs(20),
        "others were stopped promptly: {r}"
    );
    assert!(r.stderr.contains("rank       : 1"), "{r}");
    assert!(r.stderr.contains("local rank : 1"), "{r}");
    assert!(r.stderr.contains("error      : exit code 3"), "{r}");
    assert!(
        r.stderr
            .contains("    [rank1]: rank 1 is about to fail\n    [rank1]: last words"),
        "{r}"
    );
    assert!(
        !r.stderr.contains("Other failures"),
        "stopped ranks are not failures: {r}"
    );
    let pids: Vec<i32> = (0..3)
        .map(|n| {
            std::fs::read_to_string(format!("{d}/pid{n}"))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    assert_all_gone(&pids, Duration::from_secs(2), "workers after a failure");
}

#[test]
fn worker_killed_by_signal_is_named() {
    for (sig, name) in [("SEGV", "SIGSEGV"), ("KILL", "SIGKILL")] {
        let script = format!("if [ \"$RANK\" = 0 ]; then kill -{sig} $$; fi; exec sleep 60");
        let r = run_sh(2, &[], &script, LIMIT);
        assert_eq!(r.code(), Some(1), "{r}");
        assert!(r.stderr.contains("rank       : 0"), "{r}");
        assert!(
            r.stderr.contains(&format!("error      : signal {name}")),
            "{r}"
        );
    }
}

#[test]
fn restart_after_failure_on_first_attempt() {
    let logs = tempfile::tempdir().unwrap();
    // Attempt 0: rank 1 fails while rank 0 waits (and is stopped); attempt 1: both succeed.
    let script = "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then \
                    if [ \"$RANK\" = 0 ]; then exec sleep 60; fi; \
                    echo \"rank $RANK fails on attempt 0\" >&2; exit 1; fi; \
                  echo \"rank $RANK ok on attempt $TORCHELASTIC_RESTART_COUNT\"";
    let log_dir = logs.path().display().to_string();
    let r = run_sh(
        2,
        &[
            "--max-restarts",
            "1",
            "--log-dir",
            &log_dir,
            "--run-id",
            "rs",
        ],
        script,
        LIMIT,
    );
    assert_eq!(r.code(), Some(0), "{r}");
    assert!(r.stdout.contains("[rank0]: rank 0 ok on attempt 1"), "{r}");
    assert!(r.stdout.contains("[rank1]: rank 1 ok on attempt 1"), "{r}");
    assert!(
        r.stderr
            .contains("restarting the worker group (restart 1 of at most 1)"),
        "{r}"
    );
    // One log file per rank, stream and attempt.
    let read = |p: &str| std::fs::read_to_string(logs.path().join(p)).unwrap();
    assert_eq!(
        read("rs/attempt_0/1/stderr.log"),
        "rank 1 fails on attempt 0\n"
    );
    assert_eq!(
        read("rs/attempt_1/0/stdout.log"),
        "rank 0 ok on attempt 1\n"
    );
    assert_eq!(
        read("rs/attempt_1/1/stdout.log"),
        "rank 1 ok on attempt 1\n"
    );

    // Without restarts the same program fails.
    let r = run_sh(2, &[], script, LIMIT);
    assert_eq!(r.code(), Some(1), "{r}");
    assert!(r.stderr.contains("use --max-restarts K"), "{r}");
}

#[test]
fn restarts_are_bounded() {
    let r = run_sh(
        1,
        &["--max-restarts", "2"],
        "echo attempt $TORCHELASTIC_RESTART_COUNT; exit 5",
        LIMIT,
    );
    assert_eq!(r.code(), Some(1), "{r}");
    let attempts = lines_with(&r.stdout, "[rank0]: attempt");
    assert_eq!(
        attempts,
        [
            "[rank0]: attempt 0",
            "[rank0]: attempt 1",
            "[rank0]: attempt 2"
        ],
        "{r}"
    );
    assert!(
        r.stderr.contains("no restarts left (--max-restarts 2)"),
        "{r}"
    );
}

#[test]
fn redirects_tee_and_rank_filter() {
    let logs = tempfile::tempdir().unwrap();
    let log_dir = logs.path().display().to_string();
    let script = "echo out$RANK; echo err$RANK >&2";
    // --redirects 1: stdout only in the files, stderr still on the console.
    let r = run(
        &[
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--redirects",
            "1",
            "--log-dir",
            &log_dir,
            "--run-id",
            "red",
            "sh",
            "-c",
            script,
        ],
        LIMIT,
    );
    assert_eq!(r.code(), Some(0), "{r}");
    assert!(
        !r.stdout.contains("out0") && !r.stdout.contains("out1"),
        "{r}"
    );
    assert!(
        r.stderr.contains("[rank0]: err0") && r.stderr.contains("[rank1]: err1"),
        "{r}"
    );
    let read = |p: &str| std::fs::read_to_string(logs.path().join(p)).unwrap();
    assert_eq!(read("red/attempt_0/1/stdout.log"), "out1\n");
    assert!(
        !logs.path().join("red/attempt_0/1/stderr.log").exists(),
        "stderr is neither redirected nor teed"
    );

    // --local-ranks-filter 1: only rank 1 on the console; --log-dir alone tees everything.
    let r = run(
        &[
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--local-ranks-filter",
            "1",
            "--log-dir",
            &log_dir,
            "--run-id",
            "flt",
            "sh",
            "-c",
            script,
        ],
        LIMIT,
    );
    assert_eq!(r.code(), Some(0), "{r}");
    assert_eq!(lines_with(&r.stdout, "[rank"), ["[rank1]: out1"], "{r}");
    assert_eq!(read("flt/attempt_0/0/stdout.log"), "out0\n");
    assert_eq!(read("flt/attempt_0/0/stderr.log"), "err0\n");
}

/// SIGTERM or SIGINT to the launcher reaches every worker (which may react to it), then the
/// launcher exits 128+N and leaves nothing behind: no worker, no process a worker started, no
/// zombie.
#[test]
fn signals_to_the_launcher_are_forwarded_without_orphans() {
    for (sig, name) in [(libc::SIGTERM, "TERM"), (libc::SIGINT, "INT")] {
        // Each worker starts a background child (same process group), records both pids, and
        // reports the signal it gets.
        let (_dir, running, pids) = start_sh_with_pid_files(
            |d| {
                format!(
                    "trap 'echo got {name}; exit 0' {name}; sleep 300 & echo $! > {d}/child$RANK; \
                     echo $$ > {d}/pid$RANK; wait"
                )
            },
            &["pid0", "pid1", "child0", "child1"],
        );
        // SAFETY: signalling the launcher we started.
        unsafe { libc::kill(running.pid(), sig) };
        let r = running.finish(Duration::from_secs(20));
        assert_eq!(r.code(), Some(128 + sig), "{r}");
        assert!(
            r.stdout.contains(&format!("[rank0]: got {name}")),
            "worker 0 got the signal: {r}"
        );
        assert!(
            r.stdout.contains(&format!("[rank1]: got {name}")),
            "worker 1 got the signal: {r}"
        );
        // Workers were reaped by the launcher (not even zombies), their children killed.
        assert_all_gone(&pids[..2], Duration::from_millis(500), "workers");
        assert_all_gone(&pids[2..], Duration::from_secs(3), "children of workers");
    }
}

#[test]
fn worker_ignoring_sigterm_is_killed_after_the_grace_period() {
    let script = "trap '' TERM; if [ \"$RANK\" = 1 ]; then sleep 0.3; exit 2; fi; \
                  while true; do sleep 0.1; done";
    let r = run_sh(2, &["--stop-grace-period", "1"], script, LIMIT);
    assert_eq!(r.code(), Some(1), "{r}");
    assert!(
        r.stderr
            .contains("rank(s) 0 still running 1s after SIGTERM; sending SIGKILL"),
        "{r}"
    );
    assert!(r.elapsed < Duration::from_secs(15), "{r}");
}

#[test]
fn port_in_use_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let r = run(
        &["--master-port", &port, "sh", "-c", "echo SHOULD-NOT-RUN"],
        LIMIT,
    );
    assert_eq!(r.code(), Some(1), "{r}");
    assert!(!r.stdout.contains("SHOULD-NOT-RUN"), "{r}");
    assert!(r.stderr.contains("address already in use"), "{r}");
    assert!(r.stderr.contains(&format!("127.0.0.1:{port}")), "{r}");
    assert!(
        r.stderr.contains("--master-port 0"),
        "suggests a way out: {r}"
    );
    assert!(r.elapsed < Duration::from_secs(5), "{r}");
}

#[test]
fn bad_program_and_bad_flags() {
    let r = run(&["--master-port", "0", "./no-such-program-xyz"], LIMIT);
    assert_eq!(r.code(), Some(1), "{r}");
    assert!(
        r.stderr
            .contains("cannot start worker program `./no-such-program-xyz` for rank 0"),
        "{r}"
    );
    let r = run(&["--nnodes", "2", "--node-rank", "2", "true"], LIMIT);
    assert_eq!(r.code(), Some(2), "{r}");
    assert!(
        r.stderr
            .contains("--node-rank 2 is out of range for --nnodes 2"),
        "{r}"
    );
    let r = run(&["--nproc-per-node", "many", "true"], LIMIT);
    assert_eq!(r.code(), Some(2), "{r}");
    let r = run(&["--help"], LIMIT);
    assert_eq!(r.code(), Some(0), "{r}");
    for flag in [
        "--nproc-per-node",
        "--max-restarts",
        "--redirects",
        "--tee",
        "--log-dir",
        "--rdzv-timeout",
    ] {
        assert!(r.stdout.contains(flag), "--help documents {flag}: {r}");
    }
}

/// Even a launcher killed with SIGKILL (no chance to clean up) leaves no running workers: they
/// get SIGKILL from the kernel when their parent dies.
#[test]
fn workers_die_with_a_killed_launcher() {
    let (_dir, running, pids) = start_sh_with_pid_files(
        |d| format!("echo $$ > {d}/pid$RANK; exec sleep 60"),
        &["pid0", "pid1"],
    );
    // SAFETY: killing the launcher we started.
    unsafe { libc::kill(running.pid(), libc::SIGKILL) };
    let r = running.finish(Duration::from_secs(10));
    assert_eq!(r.status.code(), None, "killed by a signal: {r}");
    assert_all_gone(
        &pids,
        Duration::from_secs(3),
        "workers of a SIGKILLed launcher",
    );
}

#[test]
fn stale_shared_memory_segments_are_swept_when_workers_exit() {
    // A segment name left by a creator that died before every rank attached: its pid is gone.
    let mut dead = std::process::Command::new("true").spawn().unwrap();
    let pid = dead.id();
    dead.wait().unwrap();
    let path = std::path::PathBuf::from(format!("/dev/shm/ddp-rs-{pid}-00000000deadbeef"));
    if std::fs::write(&path, b"x").is_err() {
        skip(
            "stale_shared_memory_segments_are_swept_when_workers_exit",
            "/dev/shm is not writable here",
        );
        return;
    }
    let r = run(
        &["--standalone", "--nproc-per-node", "1", "true"],
        Duration::from_secs(30),
    );
    let still_there = path.exists();
    let _ = std::fs::remove_file(&path);
    assert_eq!(r.code(), Some(0), "{r}");
    assert!(
        !still_there,
        "stale segment {} was not removed: {r}",
        path.display()
    );
    assert!(
        r.stderr
            .contains("stale shared-memory segment(s) from /dev/shm"),
        "{r}"
    );
}
