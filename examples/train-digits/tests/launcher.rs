//! The launcher of `train-digits` (`ddprs::launcher::spawn`) with real processes: signals to the launcher
//! alone reach every worker, a SIGKILLed launcher takes its workers along, and the first failure
//! stops the rest with `ddprun`'s summary and exit status. Workers are found in /proc (children
//! of the launcher with `RANK` in their environment); every wait is bounded and leftovers are
//! killed.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_train-digits");
/// Long enough to still be training when the test acts.
const FOREVER: &[&str] = &["--nproc", "2", "--epochs", "1000000", "--log-every", "0"];

/// A launcher run directly (not as a worker), output collected in the background.
struct Launcher {
    child: Child,
    stderr: std::thread::JoinHandle<String>,
    workers: Vec<i32>,
}

impl Launcher {
    fn start(args: &[&str]) -> Launcher {
        let mut child = Command::new(BIN)
            .args(args)
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let mut l = Launcher {
            child,
            stderr,
            workers: Vec::new(),
        };
        l.workers = l.find_workers(2, Duration::from_secs(30));
        l
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Pids of the launcher's children that carry `RANK` (the workers), by rank.
    fn find_workers(&self, n: usize, limit: Duration) -> Vec<i32> {
        let deadline = Instant::now() + limit;
        loop {
            let mut found: Vec<(usize, i32)> = std::fs::read_dir("/proc")
                .unwrap()
                .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
                .filter(|&p| parent_of(p) == Some(self.pid()))
                .filter_map(|p| Some((rank_of(p)?, p)))
                .collect();
            if found.len() == n {
                found.sort();
                return found.into_iter().map(|(_, p)| p).collect();
            }
            assert!(
                Instant::now() < deadline,
                "{n} workers did not start: {found:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: signalling the launcher this test started.
        assert_eq!(unsafe { libc::kill(self.pid(), sig) }, 0);
    }

    /// Wait for the launcher's exit (bounded); its status and stderr.
    fn finish(mut self, limit: Duration) -> (std::process::ExitStatus, String, Vec<i32>) {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                panic!("launcher did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let workers = std::mem::take(&mut self.workers);
        let err = std::mem::replace(&mut self.stderr, std::thread::spawn(String::new));
        // The pipe closes once the launcher and everything holding it are gone.
        (status, err.join().unwrap(), workers)
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        kill_all(&self.workers);
    }
}

fn kill_all(pids: &[i32]) {
    for &p in pids {
        // SAFETY: plain kill(2) of a worker this test's launcher started.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
}

fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(
        s.rsplit_once(')')?
            .1
            .split_whitespace()
            .map(str::to_string)
            .collect(),
    )
}

fn parent_of(pid: i32) -> Option<i32> {
    stat_fields(pid)?.get(1)?.parse().ok()
}

fn rank_of(pid: i32) -> Option<usize> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0)
        .find_map(|kv| kv.strip_prefix(b"RANK="))
        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
}

/// Running: present in /proc and not a zombie (a zombie's parent is gone or about to reap it).
fn running(pid: i32) -> bool {
    stat_fields(pid).is_some_and(|f| f[0] != "Z")
}

/// Wait up to `limit` until none of `pids` runs; kill and fail otherwise.
fn assert_gone(pids: &[i32], limit: Duration, what: &str) {
    let deadline = Instant::now() + limit;
    while pids.iter().any(|&p| running(p)) {
        if Instant::now() >= deadline {
            let left: Vec<i32> = pids.iter().copied().filter(|&p| running(p)).collect();
            kill_all(pids);
            panic!("{what}: still running after {limit:?}: {left:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `kill -TERM` / `kill -INT` of the launcher alone (not its process group): forwarded, every
/// worker stops, the launcher exits 128+N.
#[test]
fn a_signal_to_the_launcher_alone_stops_every_worker() {
    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGINT, "SIGINT")] {
        let l = Launcher::start(FOREVER);
        std::thread::sleep(Duration::from_millis(300));
        l.signal(sig);
        let (status, err, workers) = l.finish(Duration::from_secs(30));
        assert_gone(&workers, Duration::from_secs(5), "workers");
        assert_eq!(status.code(), Some(128 + sig), "{err}");
        assert!(
            err.contains(&format!("received {name}; forwarding it to the workers")),
            "{err}"
        );
    }
}

/// `kill -9` of the launcher: the kernel kills the workers (parent-death signal).
#[test]
fn workers_die_with_a_sigkilled_launcher() {
    let l = Launcher::start(FOREVER);
    let workers = l.workers.clone();
    // Past start-up (a worker whose first write hits the dead launcher's pipe dies anyway).
    std::thread::sleep(Duration::from_secs(1));
    l.signal(libc::SIGKILL);
    let (status, _, _) = l.finish(Duration::from_secs(10));
    assert_eq!(status.code(), None);
    assert_gone(
        &workers,
        Duration::from_secs(5),
        "workers of a SIGKILLed launcher",
    );
}

/// A worker killed from outside: the launcher stops the other one and prints `ddprun`'s root
/// cause summary naming the rank and the signal, then exits 1.
#[test]
fn first_failure_stops_the_rest_with_a_summary() {
    let l = Launcher::start(FOREVER);
    std::thread::sleep(Duration::from_millis(300)); // let training start
    let (rank0, rank1) = (l.workers[0], l.workers[1]);
    kill_all(&[rank1]);
    let start = Instant::now();
    let (status, err, _) = l.finish(Duration::from_secs(60));
    assert!(start.elapsed() < Duration::from_secs(30), "{err}");
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("Root cause (first failure):"), "{err}");
    assert!(err.contains("  rank       : 1\n"), "{err}");
    assert!(err.contains(&format!("  pid        : {rank1}\n")), "{err}");
    assert!(err.contains("signal SIGKILL (9)"), "{err}");
    assert_gone(&[rank0], Duration::from_secs(1), "the other worker");
}
