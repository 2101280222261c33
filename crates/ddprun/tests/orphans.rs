//! What the workers start does not outlive the launcher: processes in a worker's group after a
//! SIGKILL of `ddprun` (the orphan guard), processes that left the group (the launcher is their
//! child subreaper), and the open-files limit raised for the workers.

mod common;

use common::*;
use std::time::Duration;

/// SIGKILLs whatever of `pids` is still there (cleanup after a failed assertion).
struct KillOnDrop(Vec<i32>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        for &p in &self.0 {
            // SAFETY: plain kill(2) of processes this test's launcher started.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
    }
}

/// A worker that started `sleep` in the background (same process group): `kill -9 ddprun` kills
/// the workers (parent-death signal) and the guard kills their groups, `sleep` included.
#[test]
fn children_of_workers_die_with_a_sigkilled_launcher() {
    let (_dir, running, pids) = start_sh_with_pid_files(
        |d| format!("sleep 1000 & echo $! > {d}/child$RANK; echo $$ > {d}/pid$RANK; wait"),
        &["pid0", "pid1", "child0", "child1"],
    );
    let _cleanup = KillOnDrop(pids.clone());
    // SAFETY: killing the launcher we started.
    unsafe { libc::kill(running.pid(), libc::SIGKILL) };
    let r = running.finish(Duration::from_secs(10));
    assert_eq!(r.status.code(), None, "killed by a signal: {r}");
    assert_all_gone(&pids[..2], Duration::from_secs(5), "workers");
    assert_all_gone(&pids[2..], Duration::from_secs(5), "children of workers");
}

/// A worker's child that left its process group (`setsid`) and outlived the worker is killed
/// when the attempt ends: it was reparented to the launcher, a child subreaper.
#[test]
fn processes_that_leave_the_worker_group_are_killed_at_the_end() {
    let (_dir, running, pids) = start_sh_with_pid_files(
        |d| format!("setsid sleep 1000 & echo $! > {d}/daemon$RANK; sleep 0.3"),
        &["daemon0", "daemon1"],
    );
    let _cleanup = KillOnDrop(pids.clone());
    let r = running.finish(Duration::from_secs(30));
    assert_eq!(r.code(), Some(0), "{r}");
    assert!(
        r.stderr
            .contains("killed 2 process(es) left behind by the workers"),
        "{r}"
    );
    assert_all_gone(
        &pids,
        Duration::from_secs(2),
        "processes that left the group",
    );
}

/// Workers inherit a soft open-files limit raised to the hard limit (the launcher is started
/// with a low soft limit).
#[test]
fn workers_get_the_hard_open_files_limit() {
    let mut cmd = std::process::Command::new("sh");
    cmd.args([
        "-c",
        "ulimit -Sn 256 && exec \"$0\" \"$@\"",
        DDPRUN,
        "--master-port",
        "0",
        "sh",
        "-c",
        "echo soft $(ulimit -Sn) hard $(ulimit -Hn)",
    ])
    .stdin(std::process::Stdio::null())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped());
    let r = Running::start(cmd).finish(Duration::from_secs(30));
    assert_eq!(r.code(), Some(0), "{r}");
    let line = lines_with(&r.stdout, "[rank0]: soft").join("");
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f.len(), 5, "{r}");
    assert_eq!(f[2], f[4], "soft limit raised to the hard one: {r}");
}
