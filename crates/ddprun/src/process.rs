//! Worker processes: starting one (its own process group, killed if the launcher dies, output
//! piped), then supervising it (reader threads copying its output, a waiter thread that reaps
//! it and reports the exit with its time), and describing exit statuses.
//!
//! Starting and supervising are two steps so that a launcher starts all its workers before it
//! creates any of their threads: each start forks the launcher, and a fork copies the page
//! tables of every thread stack there is, so forking among 3 threads per worker already started
//! made starting N workers take time in N² (`docs/benchmarks.md`, "Launcher").

use crate::output::{spawn_reader, Console, Sink, Tail};
use crate::signals::signal_name;
use crate::worker_env::Placement;
use std::io::IsTerminal;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

/// A worker's exit, reported by its waiter thread.
#[derive(Debug)]
pub struct ExitEvent {
    pub local_rank: usize,
    pub status: ExitStatus,
    pub at: SystemTime,
}

/// A running (or finished) worker.
pub struct Worker {
    pub placement: Placement,
    /// Process id, also the id of the worker's process group.
    pub pid: i32,
    pub started: SystemTime,
    /// Set once the waiter thread has reaped the process.
    pub exit: Option<(ExitStatus, SystemTime)>,
    /// Whether its exit was recorded for the rendezvous (`rendezvous::note_exit`).
    pub exit_noted: bool,
    /// Last lines of its stderr.
    pub stderr_tail: Arc<Mutex<Tail>>,
    readers: Vec<JoinHandle<()>>,
}

impl Worker {
    /// Whether the worker exited unsuccessfully (non-zero code or killed by a signal).
    pub fn failed(&self) -> bool {
        self.exit.as_ref().is_some_and(|(s, _)| !s.success())
    }

    /// Wait until the output reader threads have drained the pipes, at most until `deadline`
    /// (a process the worker left behind may hold a pipe open; it is not waited for).
    pub fn join_readers(&mut self, deadline: Instant) {
        while self.readers.iter().any(|h| !h.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        for h in std::mem::take(&mut self.readers) {
            if h.is_finished() {
                let _ = h.join();
            }
        }
    }

    /// The stderr tail, oldest line first.
    pub fn tail_lines(&self) -> Vec<String> {
        self.stderr_tail
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .lines()
    }
}

/// A started worker whose output threads and waiter do not exist yet (see
/// [`Started::supervise`]).
pub struct Started {
    child: std::process::Child,
    placement: Placement,
    started: SystemTime,
    stdout: Sink,
    stderr: Sink,
    tail: Arc<Mutex<Tail>>,
}

/// [`start`] then [`Started::supervise`]: one worker, started and supervised.
pub fn spawn(
    program: &[String],
    env: &[(String, String)],
    placement: Placement,
    stdout: Sink,
    stderr: Sink,
    tail: Arc<Mutex<Tail>>,
    events: Sender<ExitEvent>,
) -> Result<Worker, String> {
    start(program, env, placement, stdout, stderr, tail)?.supervise(events)
}

/// Start `program` with `env` added to the launcher's environment, creating no thread. The
/// worker gets its own
/// process group (so group signals reach anything it starts, and a Ctrl-C on the terminal reaches
/// only the launcher, which forwards it), a parent-death signal (SIGKILL if the launcher dies),
/// stdin from /dev/null and piped stdout/stderr, copied by [`Started::supervise`]'s reader
/// threads into `stdout`/`stderr` (the stderr sink's tail must be `tail`). A stdout shown
/// unprefixed on the launcher's stdout and logged nowhere is the launcher's stdout itself when
/// that is a terminal (rank 0 under `ConsoleStyle::Rank0Stdout`: its progress bar reaches the
/// terminal).
///
/// Must be called from the thread that stays alive for the whole run (the parent-death signal
/// is tied to the spawning thread).
pub fn start(
    program: &[String],
    env: &[(String, String)],
    placement: Placement,
    stdout: Sink,
    stderr: Sink,
    tail: Arc<Mutex<Tail>>,
) -> Result<Started, String> {
    let (exe, args) = program
        .split_first()
        .ok_or_else(|| "no worker program given".to_string())?;
    let inherit_stdout = stdout.file.is_none()
        && matches!(&stdout.console, Some((Console::Stdout, prefix)) if prefix.is_empty())
        && std::io::stdout().is_terminal();
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(if inherit_stdout {
            Stdio::inherit()
        } else {
            Stdio::piped()
        })
        .stderr(Stdio::piped());
    // SAFETY: getpid is async-signal-safe; read before forking.
    let launcher_pid = unsafe { libc::getpid() };
    // SAFETY: only async-signal-safe calls (setpgid, prctl, getppid, _exit) run between fork and
    // exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            ) != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher died before prctl took effect: do not run orphaned.
            if libc::getppid() != launcher_pid {
                libc::_exit(1);
            }
            Ok(())
        });
    }
    let rank = placement.rank;
    let child = cmd
        .spawn()
        .map_err(|e| format!("cannot start worker program `{exe}` for rank {rank}: {e}"))?;
    Ok(Started {
        child,
        placement,
        started: SystemTime::now(),
        stdout,
        stderr,
        tail,
    })
}

impl Started {
    /// Process id, also the id of the worker's process group.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Kill the worker's process group and reap it (it could not be supervised).
    pub fn abandon(mut self) {
        crate::signals::signal_group(self.pid(), libc::SIGKILL);
        let _ = self.child.wait();
    }

    /// Start the threads that copy the worker's output and reap it; its exit is sent on
    /// `events`. On error the worker is killed.
    pub fn supervise(self, events: Sender<ExitEvent>) -> Result<Worker, String> {
        let Started {
            mut child,
            placement,
            started,
            stdout,
            stderr,
            tail,
        } = self;
        let rank = placement.rank;
        let pid = child.id() as i32;
        let mut readers = Vec::with_capacity(2);
        let err = child.stderr.take().expect("stderr is piped");
        let spawn_err =
            |e: std::io::Error| format!("cannot start output thread for rank {rank}: {e}");
        let r1 = child
            .stdout
            .take()
            .map(|out| spawn_reader(format!("rank{rank}-stdout"), out, stdout));
        let r2 = spawn_reader(format!("rank{rank}-stderr"), err, stderr);
        let local_rank = placement.local_rank;
        let waiter = std::thread::Builder::new()
            .name(format!("rank{rank}-wait"))
            .spawn(move || {
                // wait() only fails for a child that was already reaped, which cannot happen here.
                let status = loop {
                    match child.wait() {
                        Ok(s) => break s,
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(_) => break ExitStatus::from_raw(0xff00),
                    }
                };
                let _ = events.send(ExitEvent {
                    local_rank,
                    status,
                    at: SystemTime::now(),
                });
            });
        let ok = (|| -> Result<(), String> {
            if let Some(r1) = r1 {
                readers.push(r1.map_err(spawn_err)?);
            }
            readers.push(r2.map_err(spawn_err)?);
            waiter.map_err(spawn_err)?;
            Ok(())
        })();
        if let Err(e) = ok {
            // Could not supervise it: do not leave it running.
            crate::signals::signal_group(pid, libc::SIGKILL);
            return Err(e);
        }
        Ok(Worker {
            placement,
            pid,
            started,
            exit: None,
            exit_noted: false,
            stderr_tail: tail,
            readers,
        })
    }
}

/// `exit code 3`, `signal SIGSEGV (11), core dumped`, ...
pub fn describe_status(status: &ExitStatus) -> String {
    if let Some(code) = status.code() {
        format!("exit code {code}")
    } else if let Some(sig) = status.signal() {
        let core = if status.core_dumped() {
            ", core dumped"
        } else {
            ""
        };
        format!("signal {} ({sig}){core}", signal_name(sig))
    } else {
        format!("{status}")
    }
}

/// Exit-status-style number for a status: the code, or 128 + signal.
pub fn status_number(status: &ExitStatus) -> i32 {
    status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn describe() {
        assert_eq!(
            describe_status(&ExitStatus::from_raw(3 << 8)),
            "exit code 3"
        );
        assert_eq!(
            describe_status(&ExitStatus::from_raw(libc::SIGKILL)),
            "signal SIGKILL (9)"
        );
        assert_eq!(
            describe_status(&ExitStatus::from_raw(libc::SIGSEGV | 0x80)),
            "signal SIGSEGV (11), core dumped"
        );
        assert_eq!(status_number(&ExitStatus::from_raw(libc::SIGTERM)), 143);
    }
}
