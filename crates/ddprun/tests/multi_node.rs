//! Multi-node rendezvous of `ddprun` on one host: several launchers on 127.0.0.1 acting as nodes
//! (rank assignment across nodes, failures and restarts propagated between nodes, and the errors
//! for a node that never arrives, an unreachable master, duplicate node ranks and mismatched
//! flags). The two-host version with network namespaces is in `collective.rs`.

mod common;

use common::*;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(40);

fn node(port: u16, nnodes: usize, rank: usize, extra: &[&str], script: &str) -> Running {
    node_with_env(port, nnodes, rank, extra, script, &[])
}

fn node_with_env(
    port: u16,
    nnodes: usize,
    rank: usize,
    extra: &[&str],
    script: &str,
    env: &[(&str, &str)],
) -> Running {
    let port = port.to_string();
    let nnodes = nnodes.to_string();
    let rank = rank.to_string();
    let mut args = vec![
        "--nnodes",
        &nnodes,
        "--node-rank",
        &rank,
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port,
        "--rdzv-timeout",
        "20",
    ];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    let mut cmd = ddprun(&args);
    cmd.envs(env.iter().copied());
    Running::start(cmd)
}

#[test]
fn two_nodes_assign_ranks_in_node_order() {
    let port = free_port();
    let script =
        "echo env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_PORT";
    // Node 1 starts first: it must wait for node 0's store to come up.
    let n1 = node(port, 2, 1, &["--nproc-per-node", "1"], script);
    std::thread::sleep(Duration::from_millis(300));
    let n0 = node(port, 2, 0, &["--nproc-per-node", "2"], script);
    let (r0, r1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!(r0.code(), Some(0), "{r0}");
    assert_eq!(r1.code(), Some(0), "{r1}");
    let mut l0 = lines_with(&r0.stdout, "[rank");
    l0.sort();
    assert_eq!(
        l0,
        [
            format!("[rank0]: env 0 0 3 2 0 {port}"),
            format!("[rank1]: env 1 1 3 2 0 {port}")
        ]
    );
    assert_eq!(
        lines_with(&r1.stdout, "[rank"),
        [format!("[rank2]: env 2 0 3 1 1 {port}")]
    );
}

#[test]
fn failure_on_one_node_restarts_every_node() {
    let port = free_port();
    // Attempt 0: node 1's worker fails, node 0's would run for a minute (it must be stopped);
    // attempt 1: everyone succeeds.
    let script = "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then \
                    if [ \"$GROUP_RANK\" = 1 ]; then echo 'node 1 breaks' >&2; exit 4; fi; \
                    exec sleep 60; fi; echo \"rank $RANK done on attempt $TORCHELASTIC_RESTART_COUNT\"";
    let extra = ["--max-restarts", "1", "--nproc-per-node", "2"];
    let n0 = node(port, 2, 0, &extra, script);
    let n1 = node(port, 2, 1, &extra, script);
    let (r0, r1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!(r0.code(), Some(0), "{r0}");
    assert_eq!(r1.code(), Some(0), "{r1}");
    assert!(r0.stderr.contains("node 1 reported a failure"), "{r0}");
    assert!(
        r0.elapsed < Duration::from_secs(25),
        "node 0's sleeping workers were stopped: {r0}"
    );
    for rank in 0..4 {
        let out = if rank < 2 { &r0.stdout } else { &r1.stdout };
        assert!(
            out.contains(&format!("[rank{rank}]: rank {rank} done on attempt 1")),
            "{r0}\n{r1}"
        );
    }
    assert!(
        r1.stderr.contains("    [rank2]: node 1 breaks")
            || r1.stderr.contains("    [rank3]: node 1 breaks"),
        "{r1}"
    );
}

#[test]
fn final_failure_on_one_node_stops_every_node() {
    let port = free_port();
    let script = "if [ \"$GROUP_RANK\" = 1 ]; then exit 4; fi; exec sleep 60";
    let n0 = node(port, 2, 0, &[], script);
    let n1 = node(port, 2, 1, &[], script);
    let (r0, r1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!(r1.code(), Some(1), "{r1}");
    assert!(r1.stderr.contains("error      : exit code 4"), "{r1}");
    assert_eq!(r0.code(), Some(1), "{r0}");
    assert!(
        r0.stderr
            .contains("node 1 reported a failure (rank 1 (local rank 0 on node 1"),
        "node 0 names the node and rank that failed: {r0}"
    );
    assert!(r0.elapsed < Duration::from_secs(25), "{r0}");
}

/// Node `node_rank` of `nnodes` alone on `port` with a 1.5 s rendezvous timeout: it fails (exit
/// code 1) within 10 s without running its workers, and its stderr contains `error`.
fn lone_node_fails_with(port: u16, nnodes: usize, node_rank: usize, error: &str) {
    let r = node(
        port,
        nnodes,
        node_rank,
        &["--rdzv-timeout", "1.5"],
        "echo SHOULD-NOT-RUN",
    )
    .finish(LIMIT);
    assert_eq!(r.code(), Some(1), "{r}");
    assert!(!r.stdout.contains("SHOULD-NOT-RUN"), "{r}");
    assert!(r.stderr.contains(error), "{r}");
    assert!(r.elapsed < Duration::from_secs(10), "{r}");
}

#[test]
fn node_that_never_arrives_is_named() {
    lone_node_fails_with(free_port(), 3, 0, "nodes 1, 2 of --nnodes 3 never arrived");
}

#[test]
fn unreachable_master_is_a_clear_error() {
    let port = free_port();
    lone_node_fails_with(
        port,
        2,
        1,
        &format!("cannot reach the rendezvous store at 127.0.0.1:{port}"),
    );
}

#[test]
fn duplicate_node_rank_and_mismatched_flags_are_rejected() {
    let port = free_port();
    let n0 = node(port, 2, 0, &["--rdzv-timeout", "10"], "echo ran");
    let a = node(port, 2, 1, &["--rdzv-timeout", "10"], "echo ran");
    let b = node(port, 2, 1, &["--rdzv-timeout", "10"], "echo ran");
    let (r0, ra, rb) = (n0.finish(LIMIT), a.finish(LIMIT), b.finish(LIMIT));
    assert_eq!(r0.code(), Some(0), "{r0}");
    let (ok, dup) = if ra.code() == Some(0) {
        (ra, rb)
    } else {
        (rb, ra)
    };
    assert_eq!(ok.code(), Some(0), "{ok}");
    assert_eq!(dup.code(), Some(1), "{dup}");
    assert!(
        dup.stderr
            .contains("another launcher already joined run none as node rank 1"),
        "{dup}"
    );

    let port = free_port();
    let n0 = node(port, 2, 0, &["--rdzv-timeout", "10"], "echo ran");
    let n1 = node(port, 3, 1, &["--rdzv-timeout", "10"], "echo ran");
    let (r0, r1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!(r0.code(), Some(1), "{r0}");
    assert_eq!(r1.code(), Some(1), "{r1}");
    assert!(
        r0.stderr.contains("node 1 (host") && r0.stderr.contains("was started with --nnodes 3"),
        "{r0}"
    );
    assert!(r1.stderr.contains("was started with --nnodes 2"), "{r1}");
}

#[test]
fn sigterm_on_one_node_stops_the_other() {
    let port = free_port();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().display().to_string();
    let script = format!("echo $$ > {d}/pid$RANK; exec sleep 60");
    let n0 = node(port, 2, 0, &[], &script);
    let n1 = node(port, 2, 1, &[], &script);
    let pids = wait_for_pids(
        &[dir.path().join("pid0"), dir.path().join("pid1")],
        Duration::from_secs(20),
    );
    // SAFETY: signalling the launcher we started.
    unsafe { libc::kill(n1.pid(), libc::SIGTERM) };
    let (r0, r1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!(r1.code(), Some(128 + libc::SIGTERM), "{r1}");
    assert_eq!(r0.code(), Some(1), "{r0}");
    assert!(
        r0.stderr.contains("node 1 reported a failure (node 1 ("),
        "{r0}"
    );
    assert!(r0.stderr.contains("stopped by SIGTERM"), "{r0}");
    assert_all_gone(&pids, Duration::from_secs(2), "workers of both nodes");
}

#[test]
fn wrong_store_secret_is_refused() {
    let port = free_port();
    let n0 = node_with_env(
        port,
        2,
        0,
        &["--rdzv-timeout", "3"],
        "echo ran",
        &[("DDP_STORE_SECRET", "right")],
    );
    let n1 = node_with_env(
        port,
        2,
        1,
        &["--rdzv-timeout", "10"],
        "echo ran",
        &[("DDP_STORE_SECRET", "wrong")],
    );
    let (r0, r1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!(r1.code(), Some(1), "{r1}");
    assert!(
        r1.stderr.contains("cannot join the rendezvous store"),
        "{r1}"
    );
    assert!(r1.stderr.contains("DDP_STORE_SECRET"), "{r1}");
    assert!(
        r1.elapsed < Duration::from_secs(8),
        "no retrying a refusal: {r1}"
    );
    assert_eq!(r0.code(), Some(1), "{r0}");
    assert!(
        r0.stderr.contains("node 1 of --nnodes 2 never arrived"),
        "{r0}"
    );
}
