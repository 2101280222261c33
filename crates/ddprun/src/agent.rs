//! The launcher's control loop (torchrun's "agent"): rendezvous, spawn this node's workers,
//! supervise them until they all succeed, one fails, a signal arrives or another node reports a
//! failure; stop them (the signal, or SIGTERM, then SIGKILL after the grace period); print the
//! root-cause summary; restart the whole group while `--max-restarts` allows.
//!
//! With `--fault-tolerance` a failed worker does not stop the others: it is reported at once
//! and the survivors go on (they regroup in place through the store); the attempt ends when
//! every worker has exited (`tolerated_outcome` says how it is judged).

use crate::cli::{available_cores, Config};
use crate::guard::{self, Guard};
use crate::output::{rank_log_dir, Sink, Tail};
use crate::process::{self, ExitEvent, Worker};
use crate::rendezvous::{RemoteFailure, Rendezvous, Stop};
use crate::signals::{self, signal_group, signal_name};
use crate::summary::{format_summary, Failure, SummaryContext};
use crate::worker_env::{worker_env, JobInfo, Placement};
use std::fs::File;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// How long to wait for SIGKILLed workers to be reaped before giving up on them.
const KILL_WAIT: Duration = Duration::from_secs(10);
/// How long to let output threads drain the pipes after the workers are gone.
const DRAIN_WAIT: Duration = Duration::from_secs(2);
/// Poll period while waiting for other nodes in a rendezvous round.
const RDZV_POLL: Duration = Duration::from_millis(50);

/// Launcher exit status for a signal.
pub(crate) fn signal_exit(sig: i32) -> i32 {
    128 + sig
}

/// `", logs in DIR/RUN_ID"` for the start-up line when `--log-dir` is set, else nothing.
pub(crate) fn logs_note(cfg: &Config) -> String {
    cfg.log_dir
        .as_ref()
        .map(|d| format!(", logs in {}", d.join(&cfg.run_id).display()))
        .unwrap_or_default()
}

/// Name of this host, for summaries and the rendezvous entry.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates on success (we
    // also stop at the end of the buffer).
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown-host".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// How one attempt of this node's workers ended.
pub(crate) enum Outcome {
    Success,
    /// Workers that failed on their own, root cause first.
    Failed(Vec<Failure>),
    Stopped(Stop),
    /// A worker could not be started (or its log file created): restarting would not help.
    SpawnFailed(String),
}

/// What the control loop does after a round.
enum Next {
    Restart,
    Exit(i32),
}

/// Where this node's workers sit in one round, and what they are told about it.
pub(crate) struct Launch {
    pub master_addr: String,
    pub master_port: u16,
    /// `TORCHELASTIC_RESTART_COUNT`: failures restarted so far.
    pub restart_count: u32,
    /// Rendezvous round (`DDP_RDZV_ROUND`, the `attempt_K` log directory); the restart count in
    /// a static job.
    pub round: u32,
    pub rank_offset: usize,
    pub world_size: usize,
    pub node_rank: usize,
    pub nnodes: usize,
    /// The workers join a running job (`DDP_FT_JOIN=1`, elastic `--fault-tolerance`).
    pub ft_join: bool,
}

/// Run a static (non-elastic) job: `cfg` after [`crate::launch::run`]'s set-up, on `host`, with
/// `house`'s orphan guard; returns the launcher's exit status.
pub(crate) fn run_static(cfg: &Config, host: &str, house: &Housekeeping) -> i32 {
    let host = host.to_string();
    let rdzv = match Rendezvous::start(cfg, &host, &mut signals::take_pending) {
        Ok(r) => r,
        Err(Stop::Signal(sig)) => {
            eprintln!(
                "ddprun: received {} while connecting to the store; exiting",
                signal_name(sig)
            );
            return signal_exit(sig);
        }
        Err(Stop::Error(e) | Stop::Rejoin(e) | Stop::JobDone(e)) => {
            eprintln!("ddprun: error: {e}");
            return 1;
        }
        Err(Stop::Remote(f)) => {
            eprintln!("ddprun: error: node {} failed: {}", f.node_rank, f.what);
            return 1;
        }
    };
    let mut attempt = 0;
    let code = loop {
        match run_round(cfg, &rdzv, &host, attempt, house) {
            Next::Restart => attempt += 1,
            Next::Exit(code) => break code,
        }
    };
    rdzv.finish(cfg.stop_grace_period + Duration::from_secs(30));
    code
}

/// What the launcher keeps for cleaning up after workers: the orphan guard and the children it
/// must not sweep.
pub(crate) struct Housekeeping {
    pub guard: Option<Guard>,
    /// Children of this process that are not the workers' leftovers.
    pub keep: Vec<i32>,
}

impl Housekeeping {
    /// After an attempt: kill what the workers left behind (adopted as subreaper) and remove
    /// stale shared-memory segments.
    pub fn sweep(&self) {
        let adopted = guard::reap_adopted(&self.keep);
        if adopted > 0 {
            eprintln!("ddprun: killed {adopted} process(es) left behind by the workers");
        }
        // Workers are gone: remove shared-memory segments whose creator died before every rank
        // attached (the one case where a segment name can outlive its group).
        let swept = ddp_comm::transport::shm::sweep_stale_segments();
        if swept > 0 {
            eprintln!("ddprun: removed {swept} stale shared-memory segment(s) from /dev/shm");
        }
    }
}

fn run_round(
    cfg: &Config,
    rdzv: &Rendezvous,
    host: &str,
    attempt: u32,
    house: &Housekeeping,
) -> Next {
    let round = match rdzv.join(
        attempt,
        cfg.nproc_per_node,
        cfg.rdzv_timeout,
        RDZV_POLL,
        &mut signals::take_pending,
    ) {
        Ok(r) => r,
        Err(stop) => return after_stop(cfg, rdzv, attempt, stop),
    };
    let last = round.rank_offset + cfg.nproc_per_node - 1;
    eprintln!(
        "ddprun: node {} of {} ({host}): ranks {}..={last} of world size {}, store {}, run id {}, \
         attempt {attempt}{}",
        cfg.node_rank,
        cfg.nnodes,
        round.rank_offset,
        round.world_size,
        rdzv.endpoint,
        cfg.run_id,
        logs_note(cfg)
    );
    let launch = Launch {
        master_addr: rdzv.master_addr.clone(),
        master_port: rdzv.master_port,
        restart_count: round.attempt,
        round: round.attempt,
        rank_offset: round.rank_offset,
        world_size: round.world_size,
        node_rank: cfg.node_rank,
        nnodes: cfg.nnodes,
        ft_join: false,
    };
    let mut poll = || match rdzv.failure(round.attempt) {
        Ok(None) => None,
        Ok(Some(f)) => Some(Stop::Remote(f)),
        Err(stop) => Some(stop),
    };
    let mut note = |rank: usize, how: &str| rdzv.note_exit(round.attempt, rank, how);
    let outcome = supervise(
        cfg,
        &launch,
        host,
        house.guard.as_ref(),
        &mut poll,
        &mut note,
    );
    house.sweep();
    match outcome {
        Outcome::Success => {
            if cfg.nnodes == 1 {
                return Next::Exit(0);
            }
            if let Err(stop) = rdzv.report_done(attempt) {
                return after_stop(cfg, rdzv, attempt, stop);
            }
            match wait_for_other_nodes(cfg, rdzv, attempt) {
                Ok(()) => Next::Exit(0),
                Err(stop) => after_stop(cfg, rdzv, attempt, stop),
            }
        }
        Outcome::Failed(failures) => {
            let restart = attempt < cfg.max_restarts;
            let next = if restart {
                format!(
                    "ddprun: restarting the worker group (restart {} of at most {})",
                    attempt + 1,
                    cfg.max_restarts
                )
            } else if cfg.max_restarts == 0 {
                "ddprun: exiting with status 1 (use --max-restarts K to restart the group)".into()
            } else {
                format!(
                    "ddprun: no restarts left (--max-restarts {}); exiting with status 1",
                    cfg.max_restarts
                )
            };
            let ctx = SummaryContext {
                run_id: &cfg.run_id,
                attempt,
                max_restarts: cfg.max_restarts,
                next: &next,
            };
            eprintln!("{}", format_summary(&ctx, &failures));
            rdzv.report_failure(attempt, restart, &failures[0].one_line());
            if restart {
                Next::Restart
            } else {
                Next::Exit(1)
            }
        }
        Outcome::Stopped(stop) => after_stop(cfg, rdzv, attempt, stop),
        Outcome::SpawnFailed(e) => {
            eprintln!("ddprun: error: {e}");
            rdzv.report_failure(attempt, false, &format!("node {}: {e}", cfg.node_rank));
            Next::Exit(1)
        }
    }
}

/// Decide what to do after a round was cut short (workers already stopped).
fn after_stop(cfg: &Config, rdzv: &Rendezvous, attempt: u32, stop: Stop) -> Next {
    match stop {
        Stop::Signal(sig) => {
            let what = format!(
                "node {} ({}) stopped by {}",
                cfg.node_rank,
                hostname(),
                signal_name(sig)
            );
            eprintln!("ddprun: {what}; exiting with status {}", signal_exit(sig));
            rdzv.report_failure(attempt, false, &what);
            Next::Exit(signal_exit(sig))
        }
        Stop::Error(e) | Stop::Rejoin(e) | Stop::JobDone(e) => {
            eprintln!("ddprun: error: {e}");
            rdzv.report_failure(attempt, false, &format!("node {}: {e}", cfg.node_rank));
            Next::Exit(1)
        }
        Stop::Remote(RemoteFailure {
            node_rank,
            restart,
            what,
        }) => {
            if restart && attempt < cfg.max_restarts {
                eprintln!(
                    "ddprun: node {node_rank} reported a failure ({what}); restarting the worker \
                     group (restart {} of at most {})",
                    attempt + 1,
                    cfg.max_restarts
                );
                Next::Restart
            } else {
                eprintln!(
                    "ddprun: node {node_rank} reported a failure ({what}); stopped this node's \
                     workers; exiting with status 1"
                );
                Next::Exit(1)
            }
        }
    }
}

/// After this node's workers all succeeded: wait until every node has (or one fails).
fn wait_for_other_nodes(cfg: &Config, rdzv: &Rendezvous, attempt: u32) -> Result<(), Stop> {
    let mut announced = false;
    loop {
        let missing = rdzv.not_done(attempt)?;
        if missing.is_empty() {
            return Ok(());
        }
        if let Some(f) = rdzv.failure(attempt)? {
            return Err(Stop::Remote(f));
        }
        if let Some(sig) = signals::take_pending() {
            return Err(Stop::Signal(sig));
        }
        if !announced {
            eprintln!(
                "ddprun: this node's workers finished; waiting for node(s) {}",
                ddp_comm::env::list_bounded(&missing, ddp_comm::env::LIST_SHOWN)
            );
            announced = true;
        }
        std::thread::sleep(cfg.monitor_interval);
    }
}

/// The sinks of one worker's stdout and stderr, per --redirects/--tee/--log-dir/--local-ranks-filter.
fn sinks(
    cfg: &Config,
    p: &Placement,
    attempt: u32,
    tail: &Arc<Mutex<Tail>>,
) -> Result<(Sink, Sink), String> {
    let redirect = cfg.redirects.for_local_rank(p.local_rank);
    let tee = cfg.tee.for_local_rank(p.local_rank);
    let shown = cfg
        .local_ranks_filter
        .as_ref()
        .is_none_or(|f| f.contains(&p.local_rank));
    let (out_console, err_console) = cfg.console.streams(p.rank);
    let file = |name: &str, wanted: bool| -> Result<Option<File>, String> {
        let (Some(dir), true) = (&cfg.log_dir, wanted) else {
            return Ok(None);
        };
        let dir = rank_log_dir(dir, &cfg.run_id, attempt, p.rank);
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create log directory {}: {e}", dir.display()))?;
        let path = dir.join(name);
        File::create(&path)
            .map(Some)
            .map_err(|e| format!("cannot create log file {}: {e}", path.display()))
    };
    let out = Sink {
        console: (shown && !redirect.stdout).then_some(out_console),
        file: file("stdout.log", redirect.stdout || tee.stdout)?,
        tail: None,
    };
    let err = Sink {
        console: (shown && !redirect.stderr).then_some(err_console),
        file: file("stderr.log", redirect.stderr || tee.stderr)?,
        tail: Some(tail.clone()),
    };
    Ok((out, err))
}

/// Start this node's workers for `launch` and watch them until the attempt ends. `poll` is asked
/// every monitor interval whether the rest of the job wants the workers stopped.
/// `note_exit(rank, how)` is told of each worker that exits while others still run, so ranks
/// waiting for it in the rendezvous stop waiting (see [`note_exit`]).
pub(crate) fn supervise(
    cfg: &Config,
    launch: &Launch,
    host: &str,
    guard: Option<&Guard>,
    poll: &mut dyn FnMut() -> Option<Stop>,
    note_exit: &mut dyn FnMut(usize, &str),
) -> Outcome {
    let mut workers: Vec<Worker> = Vec::with_capacity(cfg.nproc_per_node);
    let outcome = supervise_workers(cfg, launch, host, guard, poll, note_exit, &mut workers);
    // Every exit path has stopped the workers and SIGKILLed their groups.
    for w in &workers {
        if let Some(g) = guard {
            g.forget(w.pid);
        }
    }
    outcome
}

fn supervise_workers(
    cfg: &Config,
    launch: &Launch,
    host: &str,
    guard: Option<&Guard>,
    poll: &mut dyn FnMut() -> Option<Stop>,
    note_exit: &mut dyn FnMut(usize, &str),
    workers: &mut Vec<Worker>,
) -> Outcome {
    let (tx, rx) = mpsc::channel::<ExitEvent>();
    let job = JobInfo {
        master_addr: launch.master_addr.clone(),
        master_port: launch.master_port,
        restart_count: launch.restart_count,
        rdzv_round: launch.round,
        max_restarts: cfg.max_restarts,
        run_id: cfg.run_id.clone(),
        cores: available_cores(),
        fault_tolerance: cfg.fault_tolerance,
        ft_join: launch.ft_join,
    };
    let started = match start_workers(cfg, launch, &job, guard) {
        Ok(s) => s,
        Err(e) => return Outcome::SpawnFailed(e),
    };
    let mut started = started.into_iter();
    while let Some(s) = started.next() {
        match s.supervise(tx.clone()) {
            Ok(w) => workers.push(w),
            Err(e) => {
                abandon(started, guard);
                stop_workers(workers, &rx, libc::SIGTERM, cfg.stop_grace_period);
                return Outcome::SpawnFailed(e);
            }
        }
    }
    let mut failed: Vec<usize> = Vec::new();
    // --fault-tolerance: how many of `failed` were reported.
    let mut announced = 0;
    loop {
        match rx.recv_timeout(cfg.monitor_interval) {
            Ok(ev) => record_exit(workers, ev, Some(&mut failed)),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => unreachable!("the launcher holds a sender"),
        }
        while let Ok(ev) = rx.try_recv() {
            record_exit(workers, ev, Some(&mut failed));
        }
        for w in workers.iter_mut() {
            if let (Some((status, _)), false) = (w.exit, w.exit_noted) {
                w.exit_noted = true;
                note_exit(w.placement.rank, &process::describe_status(&status));
            }
        }
        if cfg.fault_tolerance {
            let running = workers.iter().filter(|w| w.exit.is_none()).count();
            for &i in &failed[announced..] {
                announce_tolerated(&workers[i], running);
                // What the failed worker left running in its process group goes now.
                signal_group(workers[i].pid, libc::SIGKILL);
            }
            announced = failed.len();
        } else if !failed.is_empty() {
            stop_workers(workers, &rx, libc::SIGTERM, cfg.stop_grace_period);
            let mut failures: Vec<Failure> = failed
                .iter()
                .map(|&i| failure_of(&workers[i], host))
                .collect();
            // Workers that returned with status 0 before the failure: a peer waiting for one
            // of them fails, so the summary names them beside the root cause.
            let first = failures[0].at;
            failures.extend(
                workers
                    .iter()
                    .filter(|w| w.exit.is_some_and(|(st, at)| st.success() && at <= first))
                    .map(|w| failure_of(w, host)),
            );
            return Outcome::Failed(failures);
        }
        if workers.iter().all(|w| w.exit.is_some()) {
            // No orphans: whatever a worker left running in its process group goes too.
            stop_workers(workers, &rx, libc::SIGKILL, Duration::ZERO);
            if cfg.fault_tolerance {
                let exits: Vec<_> = workers
                    .iter()
                    .map(|w| w.exit.expect("every worker exited"))
                    .collect();
                if let Some(report) = tolerated_outcome(&exits) {
                    return Outcome::Failed(
                        report
                            .iter()
                            .map(|&i| failure_of(&workers[i], host))
                            .collect(),
                    );
                }
            }
            return Outcome::Success;
        }
        if let Some(sig) = signals::take_pending() {
            eprintln!(
                "ddprun: received {}; forwarding it to the workers (SIGKILL after {:?})",
                signal_name(sig),
                cfg.stop_grace_period
            );
            stop_workers(workers, &rx, sig, cfg.stop_grace_period);
            return Outcome::Stopped(Stop::Signal(sig));
        }
        if let Some(stop) = poll() {
            stop_workers(workers, &rx, libc::SIGTERM, cfg.stop_grace_period);
            return Outcome::Stopped(stop);
        }
    }
}

/// `--fault-tolerance`: say at once that worker `w` failed and that the `running` others go on.
fn announce_tolerated(w: &Worker, running: usize) {
    let Some((status, _)) = w.exit else { return };
    let how = match status.signal() {
        Some(sig) => format!(
            "killed by signal {sig} ({}){}",
            signal_name(sig),
            if status.core_dumped() {
                ", core dumped"
            } else {
                ""
            }
        ),
        None => process::describe_status(&status),
    };
    let rest = match running {
        0 => "no other worker is running".to_string(),
        1 => "the other worker goes on".to_string(),
        n => format!("the other {n} workers go on"),
    };
    eprintln!(
        "ddprun: worker rank {} (pid {}) failed: {how}; --fault-tolerance: {rest}",
        w.placement.rank, w.pid
    );
}

/// How an attempt under `--fault-tolerance` ended, once every worker has exited (`exits[i]`:
/// worker `i`'s status and time). `None` (success) when the job finished on survivors: at least
/// one worker exited with status 0, and every worker that failed did so strictly before the
/// first exit with status 0. Otherwise the workers for the summary: those that failed, by time
/// (the root cause, the first failure, first), then those that exited with status 0 before the
/// last failure (peers still waiting for them fail).
pub(crate) fn tolerated_outcome(exits: &[(ExitStatus, SystemTime)]) -> Option<Vec<usize>> {
    let first_success = exits
        .iter()
        .filter(|(st, _)| st.success())
        .map(|&(_, at)| at)
        .min();
    let mut failed: Vec<usize> = (0..exits.len())
        .filter(|&i| !exits[i].0.success())
        .collect();
    let last = failed.iter().map(|&i| exits[i].1).max()?;
    if first_success.is_some_and(|first| last < first) {
        return None;
    }
    failed.sort_by_key(|&i| exits[i].1);
    let mut early: Vec<usize> = (0..exits.len())
        .filter(|&i| exits[i].0.success() && exits[i].1 <= last)
        .collect();
    early.sort_by_key(|&i| exits[i].1);
    failed.extend(early);
    Some(failed)
}

/// Start every worker of this node, each watched by `guard`, before any of their threads
/// exists: a fork copies the page tables of every thread stack, so with the threads of the
/// workers already started each start would cost more, and starting N workers time in N²
/// (see [`process`]). On error the workers already started are killed.
fn start_workers(
    cfg: &Config,
    launch: &Launch,
    job: &JobInfo,
    guard: Option<&Guard>,
) -> Result<Vec<process::Started>, String> {
    let mut started = Vec::with_capacity(cfg.nproc_per_node);
    for local_rank in 0..cfg.nproc_per_node {
        let p = Placement {
            rank: launch.rank_offset + local_rank,
            local_rank,
            world_size: launch.world_size,
            local_world_size: cfg.nproc_per_node,
            node_rank: launch.node_rank,
            nnodes: launch.nnodes,
        };
        let env = worker_env(&p, job, |k| std::env::var(k).ok());
        let tail = Arc::new(Mutex::new(Tail::default()));
        let one = sinks(cfg, &p, launch.round, &tail)
            .and_then(|(out, err)| process::start(&cfg.program, &env, p, out, err, tail));
        match one {
            Ok(s) => {
                if let Some(g) = guard {
                    g.watch(s.pid());
                }
                started.push(s);
            }
            Err(e) => {
                abandon(started, guard);
                return Err(e);
            }
        }
    }
    Ok(started)
}

/// Kill and reap workers that were started but will not be supervised.
fn abandon(started: impl IntoIterator<Item = process::Started>, guard: Option<&Guard>) {
    for s in started {
        let pid = s.pid();
        s.abandon();
        if let Some(g) = guard {
            g.forget(pid);
        }
    }
}

fn record_exit(workers: &mut [Worker], ev: ExitEvent, failed: Option<&mut Vec<usize>>) {
    if let Some(i) = workers
        .iter()
        .position(|w| w.placement.local_rank == ev.local_rank)
    {
        workers[i].exit = Some((ev.status, ev.at));
        if let Some(failed) = failed {
            if !ev.status.success() {
                failed.push(i);
            }
        }
    }
}

pub(crate) fn failure_of(w: &Worker, host: &str) -> Failure {
    let (status, at) = w.exit.expect("failed workers have exited");
    Failure {
        rank: w.placement.rank,
        local_rank: w.placement.local_rank,
        node_rank: w.placement.node_rank,
        host: host.to_string(),
        pid: w.pid,
        status,
        at,
        started: w.started,
        stderr_tail: w.tail_lines(),
    }
}

/// Stop every worker: `sig` to each process group, SIGKILL to what is left after `grace` (or
/// at once when another signal reaches the launcher meanwhile), reap them all, and let the
/// output threads drain.
fn stop_workers(workers: &mut [Worker], rx: &Receiver<ExitEvent>, sig: i32, grace: Duration) {
    // Groups of already exited workers are signalled too: that reaches their leftovers.
    for w in workers.iter() {
        signal_group(w.pid, sig);
    }
    let alive = |ws: &[Worker]| ws.iter().filter(|w| w.exit.is_none()).count();
    let deadline = Instant::now() + grace;
    while alive(workers) > 0 {
        let now = Instant::now();
        if now >= deadline {
            break;
        }
        if let Ok(ev) = rx.recv_timeout((deadline - now).min(Duration::from_millis(50))) {
            record_exit(workers, ev, None);
        }
        if let Some(s) = signals::take_pending() {
            eprintln!(
                "ddprun: received {} again; killing the workers now",
                signal_name(s)
            );
            break;
        }
    }
    if alive(workers) > 0 && sig != libc::SIGKILL {
        let ranks = ddp_comm::env::list_bounded(
            workers
                .iter()
                .filter(|w| w.exit.is_none())
                .map(|w| w.placement.rank),
            ddp_comm::env::LIST_SHOWN,
        );
        eprintln!(
            "ddprun: rank(s) {ranks} still running {grace:?} after {}; sending SIGKILL",
            signal_name(sig)
        );
    }
    for w in workers.iter() {
        signal_group(w.pid, libc::SIGKILL);
    }
    let deadline = Instant::now() + KILL_WAIT;
    while alive(workers) > 0 && Instant::now() < deadline {
        if let Ok(ev) = rx.recv_timeout(Duration::from_millis(50)) {
            record_exit(workers, ev, None);
        }
    }
    for w in workers.iter().filter(|w| w.exit.is_none()) {
        eprintln!(
            "ddprun: warning: rank {} (pid {}) did not exit after SIGKILL (stuck in the kernel?)",
            w.placement.rank, w.pid
        );
    }
    let drain = Instant::now() + DRAIN_WAIT;
    for w in workers.iter_mut() {
        w.join_readers(drain);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// Threads of this process whose name starts with `prefix`.
    fn threads_named(prefix: &str) -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|name| name.starts_with(prefix))
            .count()
    }

    #[test]
    fn every_worker_starts_before_any_worker_thread_exists() {
        // Ranks no other test uses, so that their thread names ("rank7000NN-...") are ours.
        const OFFSET: usize = 700_000;
        const N: usize = 12;
        let cfg = crate::Args::try_parse_from([
            "ddprun",
            "--nproc-per-node",
            &N.to_string(),
            "sleep",
            "30",
        ])
        .unwrap()
        .into_config()
        .unwrap();
        let launch = Launch {
            master_addr: "127.0.0.1".into(),
            master_port: 1,
            restart_count: 0,
            round: 0,
            rank_offset: OFFSET,
            world_size: OFFSET + N,
            node_rank: 0,
            nnodes: 1,
            ft_join: false,
        };
        let job = JobInfo {
            master_addr: launch.master_addr.clone(),
            master_port: 1,
            restart_count: 0,
            rdzv_round: 0,
            max_restarts: 0,
            run_id: "t".into(),
            cores: 1,
            fault_tolerance: false,
            ft_join: false,
        };
        let started = start_workers(&cfg, &launch, &job, None).unwrap();
        assert_eq!(started.len(), N);
        // Every fork happened with the same threads: none of the workers' yet.
        assert_eq!(threads_named("rank7000"), 0);
        let (tx, rx) = mpsc::channel();
        let mut workers: Vec<Worker> = started
            .into_iter()
            .map(|s| s.supervise(tx.clone()).unwrap())
            .collect();
        // A thread names itself once it runs: wait for the names.
        let deadline = Instant::now() + Duration::from_secs(30);
        while threads_named("rank7000") < 3 * N && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            threads_named("rank7000"),
            3 * N,
            "2 readers and a waiter each"
        );
        stop_workers(&mut workers, &rx, libc::SIGKILL, Duration::ZERO);
        assert!(workers.iter().all(|w| w.exit.is_some()));
    }

    #[test]
    fn fault_tolerance_succeeds_only_on_survivors() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let ok = ExitStatus::from_raw(0);
        let code3 = ExitStatus::from_raw(3 << 8);
        let killed = ExitStatus::from_raw(libc::SIGKILL);
        // Every worker succeeded.
        assert_eq!(tolerated_outcome(&[(ok, at(1)), (ok, at(2))]), None);
        // Rank 2 died, then the survivors finished.
        assert_eq!(
            tolerated_outcome(&[(ok, at(5)), (ok, at(6)), (killed, at(1))]),
            None
        );
        // Two failures, both before the first success.
        assert_eq!(
            tolerated_outcome(&[(ok, at(5)), (code3, at(2)), (killed, at(1))]),
            None
        );
        // Rank 2 died, rank 0 finished, then rank 1 failed: rank 2 is the root cause, rank 1
        // also failed, and rank 0 had exited before that.
        assert_eq!(
            tolerated_outcome(&[(ok, at(5)), (code3, at(6)), (killed, at(1))]),
            Some(vec![2, 1, 0])
        );
        // A failure at the very moment of the first success is not before it.
        assert_eq!(
            tolerated_outcome(&[(ok, at(5)), (code3, at(5))]),
            Some(vec![1, 0])
        );
        // Nobody succeeded.
        assert_eq!(
            tolerated_outcome(&[(code3, at(3)), (killed, at(1))]),
            Some(vec![1, 0])
        );
    }
}
