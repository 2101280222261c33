//! Helpers shared by the launcher's integration tests: running `ddprun` with a hard time limit,
//! free ports, and checking that processes are really gone; two hosts made of network
//! namespaces in [`netns`].
#![allow(dead_code)]

pub mod marked;
pub mod netns;

use std::io::BufRead;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
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

/// Finished run: status, stdout, stderr, elapsed time, and every output line with the time it
/// was read.
pub struct Run {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    pub lines: Vec<Line>,
}

/// One line of a run's output, and when the test read it.
#[derive(Debug, Clone)]
pub struct Line {
    pub at: Instant,
    pub stderr: bool,
    pub text: String,
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

/// How long the output pipes may stay open after the process exited.
const PIPE_DRAIN: Duration = Duration::from_secs(10);

/// A started `ddprun` (or other command) whose output is collected in the background.
pub struct Running {
    pub child: Child,
    program: String,
    start: Instant,
    lines: Arc<Mutex<Vec<Line>>>,
    out: std::thread::JoinHandle<String>,
    err: std::thread::JoinHandle<String>,
}

/// Read `r` to its end on a thread, line by line, each line also timestamped into `lines`.
fn collect(
    r: impl std::io::Read + Send + 'static,
    stderr: bool,
    lines: Arc<Mutex<Vec<Line>>>,
) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut r = std::io::BufReader::new(r);
        let mut all = Vec::new();
        let mut line = Vec::new();
        while matches!(r.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            all.extend_from_slice(&line);
            let text = String::from_utf8_lossy(&line).trim_end().to_string();
            let at = Instant::now();
            lines.lock().unwrap().push(Line { at, stderr, text });
            line.clear();
        }
        String::from_utf8_lossy(&all).into_owned()
    })
}

impl Running {
    /// Start `cmd` (its stdout and stderr must be piped).
    pub fn start(mut cmd: Command) -> Running {
        let program = format!("{:?}", cmd.get_program());
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = collect(child.stdout.take().unwrap(), false, lines.clone());
        let err = collect(child.stderr.take().unwrap(), true, lines.clone());
        Running {
            child,
            program,
            start: Instant::now(),
            lines,
            out,
            err,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// When it was started.
    pub fn started(&self) -> Instant {
        self.start
    }

    /// Whether it has exited (it is reaped then; [`Running::finish`] still reports it).
    pub fn exited(&mut self) -> bool {
        self.child.try_wait().unwrap().is_some()
    }

    /// The output lines read so far.
    pub fn lines_so_far(&self) -> Vec<Line> {
        self.lines.lock().unwrap().clone()
    }

    /// Wait until `deadline`; on timeout kill it and return `Err` with what it wrote.
    pub fn finish_by(mut self, deadline: Instant) -> Result<Run, Run> {
        let (status, in_time) = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break (s, true);
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                break (self.child.wait().unwrap(), false);
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let elapsed = self.start.elapsed();
        // The pipes close when every process holding them is gone: a process left behind (an
        // orphan) could hold them for ever, so wait a bounded time and then say so.
        let drained = Instant::now() + PIPE_DRAIN;
        while !(self.out.is_finished() && self.err.is_finished()) && Instant::now() < drained {
            std::thread::sleep(Duration::from_millis(10));
        }
        let lines = self.lines.lock().unwrap().clone();
        let (stdout, stderr) = if self.out.is_finished() && self.err.is_finished() {
            (self.out.join().unwrap(), self.err.join().unwrap())
        } else {
            let text = |err: bool| {
                let mut s: String = lines
                    .iter()
                    .filter(|l| l.stderr == err)
                    .map(|l| format!("{}\n", l.text))
                    .collect();
                s.push_str(&format!(
                    "\n[test: output still open {PIPE_DRAIN:?} after {} exited: a process \
                     left behind holds the pipe]\n",
                    self.program
                ));
                s
            };
            (text(false), text(true))
        };
        let run = Run {
            status,
            stdout,
            stderr,
            elapsed,
            lines,
        };
        if in_time {
            Ok(run)
        } else {
            Err(run)
        }
    }

    /// Wait at most `limit`; on timeout kill it and panic with its output.
    pub fn finish(self, limit: Duration) -> Run {
        let program = self.program.clone();
        let deadline = self.start + limit;
        self.finish_by(deadline).unwrap_or_else(|run| {
            panic!(
                "{program} did not finish within {limit:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
                run.stdout, run.stderr
            )
        })
    }
}

/// Run `ddprun args` to completion within `limit` (panics on timeout).
pub fn run(args: &[&str], limit: Duration) -> Run {
    Running::start(ddprun(args)).finish(limit)
}

/// `ddprun --nproc-per-node NPROC --master-port 0 FLAGS sh -c SCRIPT`, not started.
pub fn sh_command(nproc: usize, flags: &[&str], script: &str) -> Command {
    let nproc = nproc.to_string();
    let mut args = vec!["--nproc-per-node", &nproc, "--master-port", "0"];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["sh", "-c", script]);
    ddprun(&args)
}

/// `ddprun --nproc-per-node NPROC --master-port 0 FLAGS sh -c SCRIPT`, started.
pub fn start_sh(nproc: usize, flags: &[&str], script: &str) -> Running {
    Running::start(sh_command(nproc, flags, script))
}

/// `ddprun --nproc-per-node 2 --master-port 0 sh -c SCRIPT`, started with `script(d)` for a fresh
/// temporary directory `d`, once the workers wrote the pid files `names` there (20 s at most):
/// the directory (kept alive), the launcher, and the pids in the order of `names`.
pub fn start_sh_with_pid_files(
    script: impl FnOnce(&str) -> String,
    names: &[&str],
) -> (tempfile::TempDir, Running, Vec<i32>) {
    let dir = tempfile::tempdir().unwrap();
    let running = start_sh(2, &[], &script(&dir.path().display().to_string()));
    let files: Vec<_> = names.iter().map(|n| dir.path().join(n)).collect();
    let pids = wait_for_pids(&files, Duration::from_secs(20));
    (dir, running, pids)
}

/// `ddprun --nproc-per-node NPROC --master-port 0 FLAGS sh -c SCRIPT`, finished within `limit`.
pub fn run_sh(nproc: usize, flags: &[&str], script: &str, limit: Duration) -> Run {
    start_sh(nproc, flags, script).finish(limit)
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
