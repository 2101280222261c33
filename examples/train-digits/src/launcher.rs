//! Local launcher: `train-digits` run directly spawns `--nproc` workers of itself, torchrun-style.
//!
//! Every worker gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`,
//! a free `MASTER_PORT`, and (unless set) `OMP_NUM_THREADS` / `RAYON_NUM_THREADS` = cores / workers. Rank 0's stdout is passed through unchanged (so `--json`'s last line
//! stays machine-readable); everything else is forwarded to stderr prefixed with `[rankN]`.
//! Fail fast: when a worker fails, the others get a short grace period to report the failure they
//! see (a peer-failure error naming the rank), then are killed; the launcher exits non-zero naming
//! the rank that failed first.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long surviving workers may take to exit on their own after a failure before being killed.
const GRACE: Duration = Duration::from_secs(5);

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn forward(
    src: impl std::io::Read + Send + 'static,
    prefix: Option<String>,
    to_stdout: bool,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(src).lines() {
            let Ok(line) = line else { break };
            let text = match &prefix {
                Some(p) => format!("{p} {line}\n"),
                None => format!("{line}\n"),
            };
            let _ = if to_stdout {
                std::io::stdout().lock().write_all(text.as_bytes())
            } else {
                std::io::stderr().lock().write_all(text.as_bytes())
            };
        }
    })
}

fn describe(status: &ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("killed by signal {sig}");
        }
    }
    match status.code() {
        Some(c) => format!("exit status {c}"),
        None => status.to_string(),
    }
}

/// Spawns `nproc` workers running this binary with `args`; returns the process exit code.
pub fn launch(nproc: usize, args: &[String]) -> i32 {
    if nproc == 0 {
        eprintln!("train-digits: --nproc must be at least 1");
        return 2;
    }
    let port = match free_port() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("train-digits: cannot find a free port for MASTER_PORT: {e}");
            return 1;
        }
    };
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("train-digits: cannot locate own executable: {e}");
            return 1;
        }
    };
    // Like torchrun/ddprun: split the cores among the workers (candle's CPU kernels use rayon),
    // unless the user chose.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / nproc).max(1).to_string();
    let thread_env: Vec<(&str, String)> = ["OMP_NUM_THREADS", "RAYON_NUM_THREADS"]
        .into_iter()
        .filter(|v| std::env::var_os(v).is_none())
        .map(|v| (v, threads.clone()))
        .collect();
    let mut children: Vec<Option<Child>> = Vec::new();
    let mut pumps = Vec::new();
    for rank in 0..nproc {
        let spawned = Command::new(&exe)
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .envs(thread_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                eprintln!("train-digits: cannot start worker rank {rank}: {e}");
                for c in children.iter_mut().flatten() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return 1;
            }
        };
        eprintln!("[launcher] started rank {rank} (pid {})", child.id());
        let prefix = format!("[rank{rank}]");
        let out = child.stdout.take().expect("piped stdout");
        let err = child.stderr.take().expect("piped stderr");
        pumps.push(if rank == 0 {
            forward(out, None, true)
        } else {
            forward(out, Some(prefix.clone()), false)
        });
        pumps.push(forward(err, Some(prefix), false));
        children.push(Some(child));
    }

    let mut first_failure: Option<(usize, String)> = None;
    let mut failed_at: Option<Instant> = None;
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; nproc];
    loop {
        // Failures seen in one sweep: a worker killed by a signal is the likelier root cause
        // (the others then fail with an error naming it), so it is reported first.
        let mut sweep: Vec<(bool, usize, String)> = Vec::new();
        for (rank, slot) in children.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            match child.try_wait() {
                Ok(Some(status)) => {
                    if !status.success() {
                        sweep.push((status.code().is_some(), rank, describe(&status)));
                    }
                    statuses[rank] = Some(status);
                    *slot = None;
                }
                Ok(None) => {}
                Err(e) => {
                    eprintln!("[launcher] cannot poll rank {rank}: {e}");
                }
            }
        }
        sweep.sort();
        if let (None, Some((_, rank, what))) = (&first_failure, sweep.into_iter().next()) {
            first_failure = Some((rank, what));
            failed_at = Some(Instant::now());
        }
        if children.iter().all(|c| c.is_none()) {
            break;
        }
        if failed_at.is_some_and(|t| t.elapsed() > GRACE) {
            for (rank, slot) in children.iter_mut().enumerate() {
                if let Some(child) = slot {
                    eprintln!("[launcher] killing rank {rank} (still running {GRACE:?} after the failure)");
                    let _ = child.kill();
                    statuses[rank] = child.wait().ok();
                    *slot = None;
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in pumps {
        let _ = p.join();
    }
    match first_failure {
        None => 0,
        Some((rank, what)) => {
            let others: Vec<String> = statuses
                .iter()
                .enumerate()
                .filter(|(r, _)| *r != rank)
                .map(|(r, s)| match s {
                    Some(s) => format!("rank {r}: {}", describe(s)),
                    None => format!("rank {r}: unknown"),
                })
                .collect();
            eprintln!(
                "train-digits: worker rank {rank} failed ({what}); other workers: {}",
                others.join(", ")
            );
            1
        }
    }
}
