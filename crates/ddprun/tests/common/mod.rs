//! Helpers shared by the launcher's integration tests: running `ddprun` with a hard time limit,
//! free ports, and checking that processes are really gone.
#![allow(dead_code)]

use std::io::Read;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// Path of the `ddprun` binary under test.
pub const DDPRUN: &str = env!("CARGO_BIN_EXE_ddprun");

/// A `ddprun` command with `args`, output captured.
pub fn ddprun(args: &[&str]) -> Command {
    let mut c = Command::new(DDPRUN);
    c.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Finished run: status, stdout, stderr, elapsed time.
pub struct Run {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Run {
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "status {:?} after {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.status, self.elapsed, self.stdout, self.stderr
        )
    }
}

/// A started `ddprun` (or other command) whose output is collected in the background.
pub struct Running {
    pub child: Child,
    program: String,
    start: Instant,
    out: std::thread::JoinHandle<String>,
    err: std::thread::JoinHandle<String>,
}

fn collect(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = r.read_to_end(&mut v);
        String::from_utf8_lossy(&v).into_owned()
    })
}

impl Running {
    /// Start `cmd` (its stdout and stderr must be piped).
    pub fn start(mut cmd: Command) -> Running {
        let program = format!("{:?}", cmd.get_program());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
        let out = collect(child.stdout.take().unwrap());
        let err = collect(child.stderr.take().unwrap());
        Running {
            child,
            program,
            start: Instant::now(),
            out,
            err,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Wait at most `limit`; on timeout kill it and panic with its output.
    pub fn finish(mut self, limit: Duration) -> Run {
        let deadline = self.start + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                let out = self.out.join().unwrap();
                let err = self.err.join().unwrap();
                panic!("{} did not finish within {limit:?}\n--- stdout ---\n{out}\n--- stderr ---\n{err}", self.program);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let elapsed = self.start.elapsed();
        Run {
            status,
            stdout: self.out.join().unwrap(),
            stderr: self.err.join().unwrap(),
            elapsed,
        }
    }
}

/// Run `ddprun args` to completion within `limit` (panics on timeout).
pub fn run(args: &[&str], limit: Duration) -> Run {
    Running::start(ddprun(args)).finish(limit)
}

/// `ddprun --nproc-per-node NPROC --master-port 0 FLAGS sh -c SCRIPT`, finished within `limit`.
pub fn run_sh(nproc: usize, flags: &[&str], script: &str, limit: Duration) -> Run {
    let nproc = nproc.to_string();
    let mut args = vec!["--nproc-per-node", &nproc, "--master-port", "0"];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["sh", "-c", script]);
    run(&args, limit)
}

/// A TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Whether a process with this pid exists in any state (a zombie counts as existing).
pub fn exists(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// `Some(state char)` from /proc/PID/stat (`Z` = zombie), `None` when gone.
pub fn proc_state(pid: i32) -> Option<char> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    s.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Wait up to `limit` until every file in `paths` exists with a pid in it; return the pids.
pub fn wait_for_pids(paths: &[std::path::PathBuf], limit: Duration) -> Vec<i32> {
    let deadline = Instant::now() + limit;
    loop {
        let pids: Vec<Option<i32>> = paths.iter().map(|p| read_pid(p)).collect();
        if pids.iter().all(Option::is_some) {
            return pids.into_iter().map(Option::unwrap).collect();
        }
        assert!(
            Instant::now() < deadline,
            "pid files {paths:?} did not all appear within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn read_pid(p: &Path) -> Option<i32> {
    let s = std::fs::read_to_string(p).ok()?;
    if !s.ends_with('\n') {
        return None;
    }
    s.trim().parse().ok()
}

/// Wait up to `limit` until none of `pids` exists (zombies count as existing); panic naming
/// those left.
pub fn assert_all_gone(pids: &[i32], limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    loop {
        let left: Vec<(i32, Option<char>)> = pids
            .iter()
            .filter(|&&p| exists(p))
            .map(|&p| (p, proc_state(p)))
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: processes still exist (pid, state): {left:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Lines of `text` that start with `prefix`.
pub fn lines_with<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.starts_with(prefix)).collect()
}

/// Environment variable that turns skips into failures; `.ci/run` sets it to `1` (CI installs
/// `mpirun`, `ip` and runs as root, so nothing may skip there).
pub const REQUIRE_ALL: &str = "DDP_TEST_REQUIRE_ALL";

/// Call when `test` cannot run here for `reason` (a missing program, no root, a binary not
/// built), then return from the test. With [`REQUIRE_ALL`]` = 1` this panics: under CI a skip is
/// a failure. Elsewhere it prints `SKIPPED test: reason` (see [`note_skip`]).
pub fn skip(test: &str, reason: &str) {
    if std::env::var(REQUIRE_ALL).is_ok_and(|v| v == "1") {
        panic!("{test} cannot run: {reason} ({REQUIRE_ALL}=1: no test may skip)");
    }
    note_skip(test, reason);
}

/// Print `SKIPPED test: reason` straight to the process's stderr, past the test harness's
/// capture, so that `cargo test` shows it as nextest does (`success-output` in
/// `.config/nextest.toml`): a skip never reads as a silent pass. Used alone for what no machine
/// is required to have (PyTorch), even under [`REQUIRE_ALL`].
pub fn note_skip(test: &str, reason: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED {test}: {reason}");
}
