//! Elastic `ddprun --fault-tolerance` (`--nnodes MIN:MAX`): membership changes in place. A lost
//! node does not restart the others (their workers keep running, no new round), and a node that
//! arrives while a round runs joins it: its workers start with `DDP_FT_JOIN=1` and the running
//! round's `DDP_RDZV_ROUND`, and nobody else's workers are restarted. Launchers run on
//! 127.0.0.1 as nodes; workers are `sh` scripts that log their start to a shared file and run
//! until the test creates `DIR/stop` (no training: the in-place regrouping itself is
//! `ddp_comm`'s and the examples' business).

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const LIMIT: Duration = Duration::from_secs(30);
/// `--heartbeat-timeout` of these tests.
const HEARTBEAT: &str = "2";

/// An elastic launcher with `--fault-tolerance`: `--nnodes RANGE` on the store at
/// 127.0.0.1:`port`, one worker running `sh -c script`, short timeouts.
fn node(port: u16, range: &str, extra: &[&str], script: &str) -> Running {
    let endpoint = format!("127.0.0.1:{port}");
    let run_id = format!("elastic-ft-{port}");
    let mut args = vec![
        "--nnodes",
        range,
        "--rdzv-endpoint",
        &endpoint,
        "--run-id",
        &run_id,
        "--rdzv-timeout",
        "15",
        "--rdzv-last-call",
        "5",
        "--heartbeat-timeout",
        HEARTBEAT,
        "--monitor-interval",
        "0.05",
        "--stop-grace-period",
        "2",
    ];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    let mut c = ddprun(&args);
    c.env_remove("DDP_FAULT_TOLERANCE");
    Running::start(c)
}

/// `n` fault-tolerant launchers on `port` (`--nnodes RANGE`), the first given time to serve the
/// store.
fn start_nodes(port: u16, range: &str, n: usize, script: &str) -> Vec<Running> {
    let mut v = vec![node(port, range, &["--fault-tolerance"], script)];
    std::thread::sleep(Duration::from_millis(300));
    for _ in 1..n {
        v.push(node(port, range, &["--fault-tolerance"], script));
    }
    v
}

/// Worker script: append `start PID AGENT_PID RANK WORLD_SIZE FT_JOIN ROUND` to `DIR/log`, then
/// run until `DIR/stop` exists and exit 0.
fn script(dir: &Path) -> String {
    format!(
        "d={}; echo \"start $$ $PPID $RANK $WORLD_SIZE ${{DDP_FT_JOIN:-0}} $DDP_RDZV_ROUND\" \
         >> $d/log; while [ ! -e $d/stop ]; do sleep 0.05; done",
        dir.display()
    )
}

/// One `start` line of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Start {
    pid: i32,
    agent: i32,
    rank: usize,
    world: usize,
    ft_join: String,
    round: String,
}

fn starts(dir: &Path) -> Vec<Start> {
    std::fs::read_to_string(dir.join("log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == 7 && f[0] == "start").then(|| Start {
                pid: f[1].parse().unwrap(),
                agent: f[2].parse().unwrap(),
                rank: f[3].parse().unwrap(),
                world: f[4].parse().unwrap(),
                ft_join: f[5].to_string(),
                round: f[6].to_string(),
            })
        })
        .collect()
}

/// Wait until the log has `n` start lines (panics after `limit`, stopping `v`).
fn wait_for_starts(dir: &Path, n: usize, limit: Duration, v: &mut Vec<Running>) -> Vec<Start> {
    let deadline = Instant::now() + limit;
    loop {
        let s = starts(dir);
        if s.len() >= n {
            return s;
        }
        if Instant::now() > deadline {
            give_up(v, &format!("{n} worker starts within {limit:?}, got {s:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Wait until launcher `i` of `v` wrote a stderr line containing `text`.
fn wait_for_line(v: &mut Vec<Running>, i: usize, text: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while !v[i]
        .lines_so_far()
        .iter()
        .any(|l| l.stderr && l.text.contains(text))
    {
        if Instant::now() > deadline {
            give_up(v, &format!("launcher {i} saying {text:?} within {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stop every launcher and panic with their output.
fn give_up(v: &mut Vec<Running>, what: &str) -> ! {
    for n in v.iter() {
        signal(n.pid(), libc::SIGKILL);
    }
    let runs: Vec<Run> = std::mem::take(v)
        .into_iter()
        .map(|n| n.finish(LIMIT))
        .collect();
    panic!("no {what}:\n{}", all(&runs));
}

fn all(runs: &[Run]) -> String {
    runs.iter()
        .map(|r| r.to_string())
        .collect::<Vec<_>>()
        .join("\n=====\n")
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: plain kill(2) of a process (or, negative, a process group) this test started.
    unsafe { libc::kill(pid, sig) };
}

/// Kill launcher `i` of `v` and its worker's process group, as a dying node would lose both.
fn kill_node(v: &mut Vec<Running>, i: usize, worker: i32) -> Run {
    let n = v.remove(i);
    signal(n.pid(), libc::SIGKILL);
    signal(-worker, libc::SIGKILL);
    let gone = n.finish(LIMIT);
    assert_eq!(gone.code(), None, "killed: {gone}");
    gone
}

fn stop_file(dir: &Path) -> PathBuf {
    dir.join("stop")
}

const LOST: &str = "--fault-tolerance: the workers go on in place";

#[test]
fn a_lost_node_leaves_the_others_running_and_its_restart_joins_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let (port, s) = (free_port(), script(dir.path()));
    let extra = ["--fault-tolerance"];
    let mut v = start_nodes(port, "2:3", 3, &s);
    let first = wait_for_starts(dir.path(), 3, Duration::from_secs(15), &mut v);
    let worker_of = |agent: i32| first.iter().find(|s| s.agent == agent).cloned();
    let (a, b, c) = (v[0].pid(), v[1].pid(), v[2].pid());
    let (wa, wb, wc) = match (worker_of(a), worker_of(b), worker_of(c)) {
        (Some(wa), Some(wb), Some(wc)) => (wa, wb, wc),
        _ => give_up(&mut v, &format!("worker per launcher in {first:?}")),
    };
    assert!(
        first
            .iter()
            .all(|s| s.world == 3 && s.round == "0" && s.ft_join == "0"),
        "{first:?}"
    );

    // Node C dies: launcher and worker.
    let killed = kill_node(&mut v, 2, wc.pid);
    let lost_at = Instant::now();
    for i in 0..2 {
        wait_for_line(&mut v, i, LOST, Duration::from_secs(10));
    }
    eprintln!("loss of a node reported {:?} later", lost_at.elapsed());
    // Give a restart the time to happen if it were going to.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(starts(dir.path()), first, "nobody was restarted");
    assert!(
        exists(wa.pid) && exists(wb.pid),
        "A's and B's workers run on"
    );

    // Node C comes back (a new launcher, same flags): it joins round 0 in place.
    v.push(node(port, "2:3", &extra, &s));
    let now = wait_for_starts(dir.path(), 4, Duration::from_secs(10), &mut v);
    let joined = &now[3];
    assert_eq!(joined.agent, v[2].pid(), "{now:?}");
    assert_eq!(
        (joined.ft_join.as_str(), joined.round.as_str()),
        ("1", "0"),
        "DDP_FT_JOIN=1 in the running round: {now:?}"
    );
    // Placeholder rank: after the three nodes listed in the round (C's lost one included).
    assert_eq!((joined.rank, joined.world), (3, 4), "{now:?}");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(starts(dir.path()).len(), 4, "nobody else started");
    assert!(
        exists(wa.pid) && exists(wb.pid),
        "A's and B's workers are the same"
    );

    // Every worker finishes: the job ends with status 0 on every live node.
    std::fs::write(stop_file(dir.path()), "").unwrap();
    let runs: Vec<Run> = v.into_iter().map(|n| n.finish(LIMIT)).collect();
    let text = format!("{}\n=====\nkilled: {killed}", all(&runs));
    assert!(runs.iter().all(|r| r.code() == Some(0)), "{text}");
    for r in &runs[..2] {
        assert!(
            r.stderr.contains("no heartbeat") && r.stderr.contains(LOST),
            "the loss is reported: {text}"
        );
        assert!(
            r.stderr.contains("joined the running round in place"),
            "the arrival is reported: {text}"
        );
        assert!(
            !r.stderr.contains("rejoining") && !r.stderr.contains("new rendezvous round"),
            "no new round: {text}"
        );
    }
    assert!(
        runs[2].stderr.contains("joins the running round in place")
            && !runs[2].stderr.contains(LOST),
        "the new node joins, and the loss before it is not its news: {text}"
    );
    assert_eq!(starts(dir.path()).len(), 4, "{text}");
    assert_all_gone(
        &now.iter().map(|s| s.pid).collect::<Vec<_>>(),
        Duration::from_secs(5),
        "the workers",
    );
}

#[test]
fn a_spare_beyond_max_waits_and_joins_in_place_once_a_node_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let (port, s) = (free_port(), script(dir.path()));
    let extra = ["--fault-tolerance"];
    let mut v = start_nodes(port, "1:2", 2, &s);
    let first = wait_for_starts(dir.path(), 2, Duration::from_secs(15), &mut v);
    // A third node: the round runs with MAX = 2 nodes, so it waits.
    v.push(node(port, "1:2", &extra, &s));
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(
        starts(dir.path()),
        first,
        "the spare waits, nobody restarts"
    );
    let b = v[1].pid();
    let Some(wb) = first.iter().find(|s| s.agent == b).cloned() else {
        give_up(
            &mut v,
            &format!("worker of the second launcher in {first:?}"),
        )
    };
    let wa = first.iter().find(|s| s.pid != wb.pid).unwrap().clone();
    let killed = kill_node(&mut v, 1, wb.pid);
    // The spare (now v[1]) takes the lost node's place in round 0.
    let now = wait_for_starts(dir.path(), 3, Duration::from_secs(10), &mut v);
    let joined = &now[2];
    assert_eq!(joined.agent, v[1].pid(), "{now:?}");
    assert_eq!(
        (joined.ft_join.as_str(), joined.round.as_str(), joined.rank),
        ("1", "0", 2),
        "{now:?}"
    );
    assert!(exists(wa.pid), "the first node's worker runs on");
    std::fs::write(stop_file(dir.path()), "").unwrap();
    let runs: Vec<Run> = v.into_iter().map(|n| n.finish(LIMIT)).collect();
    let text = format!("{}\n=====\nkilled: {killed}", all(&runs));
    assert!(runs.iter().all(|r| r.code() == Some(0)), "{text}");
    assert!(runs[0].stderr.contains(LOST), "{text}");
    assert_eq!(starts(dir.path()).len(), 3, "{text}");
}

#[test]
fn below_min_a_lost_node_still_ends_the_round() {
    let dir = tempfile::tempdir().unwrap();
    let (port, s) = (free_port(), script(dir.path()));
    let mut v = start_nodes(port, "2:2", 2, &s);
    let first = wait_for_starts(dir.path(), 2, Duration::from_secs(15), &mut v);
    let b = v[1].pid();
    let Some(wb) = first.iter().find(|s| s.agent == b).cloned() else {
        give_up(
            &mut v,
            &format!("worker of the second launcher in {first:?}"),
        )
    };
    let _ = kill_node(&mut v, 1, wb.pid);
    let run = v.pop().unwrap().finish(LIMIT);
    // --max-restarts 0: the round ends as without the flag, and the job with it.
    assert_eq!(run.code(), Some(1), "{run}");
    assert!(
        run.stderr.contains("no heartbeat")
            && run
                .stderr
                .contains("fewer than the minimum 2 of --nnodes 2:2")
            && !run.stderr.contains(LOST),
        "{run}"
    );
    assert_all_gone(
        &first.iter().map(|s| s.pid).collect::<Vec<_>>(),
        Duration::from_secs(5),
        "the workers",
    );
}

#[test]
fn a_node_stopped_by_sigterm_leaves_without_restarting_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let (port, s) = (free_port(), script(dir.path()));
    let mut v = start_nodes(port, "2:3", 3, &s);
    let first = wait_for_starts(dir.path(), 3, Duration::from_secs(15), &mut v);
    let third = v.pop().unwrap();
    signal(third.pid(), libc::SIGTERM);
    let left = third.finish(LIMIT);
    assert_eq!(left.code(), Some(128 + libc::SIGTERM), "{left}");
    // Reported at once (not after the heartbeat timeout): the node said why it left.
    for i in 0..2 {
        wait_for_line(&mut v, i, "stopped by SIGTERM", Duration::from_secs(1));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(starts(dir.path()), first, "nobody was restarted");
    std::fs::write(stop_file(dir.path()), "").unwrap();
    let runs: Vec<Run> = v.into_iter().map(|n| n.finish(LIMIT)).collect();
    let text = format!("{}\n=====\nstopped: {left}", all(&runs));
    assert!(runs.iter().all(|r| r.code() == Some(0)), "{text}");
    assert!(
        runs.iter()
            .all(|r| r.stderr.contains(LOST) && !r.stderr.contains("rejoining")),
        "{text}"
    );
}
