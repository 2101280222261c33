//! Real collectives under real launchers, with the `ddp-allreduce-check` worker (each rank
//! all-reduces `rank + 1` and checks the sum): under `ddprun` on one node (also across a
//! restart, which must not mix up the rendezvous keys of the two attempts), under OpenMPI's
//! `mpirun` (no `ddprun` involved), and across two "hosts" made of network namespaces joined by a
//! veth pair, each with its own `/dev/shm`, with one `ddprun` in each (two ranks per host make
//! the group hierarchical: shared memory inside a host, TCP between).
//!
//! The mpirun test skips (with a message) when `mpirun` is not installed; the namespace test
//! skips when not running as root or when `ip` or `unshare` is missing. CI installs
//! openmpi-bin and iproute2 and runs as root, so both run there.

mod common;

use common::netns::{have, missing_prerequisite, TwoHosts};
use common::*;
use std::process::{Command, Stdio};
use std::time::Duration;

const CHECK: &str = env!("CARGO_BIN_EXE_ddp-allreduce-check");
const LIMIT: Duration = Duration::from_secs(50);

fn ok_lines(stdout: &str) -> Vec<&str> {
    stdout
        .lines()
        .filter(|l| l.contains("all_reduce ok"))
        .collect()
}

#[test]
fn allreduce_under_ddprun() {
    let r = run(
        &["--nproc-per-node", "3", "--master-port", "0", CHECK],
        LIMIT,
    );
    assert_eq!(r.code(), Some(0), "{r}");
    let ok = ok_lines(&r.stdout);
    assert_eq!(ok.len(), 3, "{r}");
    for rank in 0..3 {
        let want = format!("[rank{rank}]: rank {rank}/3: all_reduce ok (sum 6,");
        assert!(ok.iter().any(|l| l.starts_with(&want)), "{want} in {r}");
    }
}

#[test]
fn allreduce_after_restart() {
    // Rank 1 fails after a successful all-reduce on attempt 0; attempt 1 rendezvous through the
    // same hosted store must start clean.
    let r = run(
        &[
            "--nproc-per-node",
            "3",
            "--master-port",
            "0",
            "--max-restarts",
            "1",
            CHECK,
            "--fail-rank",
            "1",
            "--fail-attempt",
            "0",
            "--timeout",
            "20",
        ],
        LIMIT,
    );
    assert_eq!(r.code(), Some(0), "{r}");
    assert!(r.stderr.contains("failing on purpose on attempt 0"), "{r}");
    let attempt1: Vec<_> = ok_lines(&r.stdout)
        .into_iter()
        .filter(|l| l.contains(" attempt 1 "))
        .collect();
    assert_eq!(attempt1.len(), 3, "all ranks succeed on attempt 1: {r}");
}

/// A rank that exits with status 0 before joining the group (a worker that returns early) makes
/// its peers fail at once, naming it and its exit, instead of after the rendezvous timeout (120 s
/// here); the summary names it beside the root cause.
#[test]
fn a_rank_that_exits_0_before_joining_fails_its_peers_at_once() {
    let start = std::time::Instant::now();
    let r = run(
        &[
            "--nproc-per-node",
            "3",
            "--master-port",
            "0",
            CHECK,
            "--exit-rank",
            "1",
            "--timeout",
            "120",
        ],
        Duration::from_secs(100),
    );
    assert_eq!(r.code(), Some(1), "{r}");
    assert!(
        r.stderr
            .contains("rank 1 exited (exit code 0) without joining the rendezvous"),
        "{r}"
    );
    assert!(
        r.stderr.contains("Exited with status 0 before that")
            && r.stderr.contains("  rank 1 (local rank 1 on node 0"),
        "{r}"
    );
    // Far below the 120 s rendezvous timeout the peers would otherwise wait.
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn allreduce_under_mpirun() {
    if !have("mpirun") {
        skip(
            "allreduce_under_mpirun",
            "`mpirun` not found (install openmpi-bin)",
        );
        return;
    }
    let port = free_port().to_string();
    let mut cmd = Command::new("mpirun");
    cmd.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "2",
        CHECK,
        "--timeout",
        "20",
    ])
    .env("MASTER_ADDR", "127.0.0.1")
    .env("MASTER_PORT", &port)
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let r = Running::start(cmd).finish(LIMIT);
    assert_eq!(r.code(), Some(0), "{r}");
    let ok = ok_lines(&r.stdout);
    assert_eq!(ok.len(), 2, "{r}");
    for rank in 0..2 {
        let want = format!("rank {rank}/2: all_reduce ok (sum 3,");
        assert!(
            ok.iter()
                .any(|l| l.starts_with(&want) && l.contains("launcher OpenMpi")),
            "{r}"
        );
    }
}

#[test]
fn two_hosts_in_network_namespaces() {
    if let Some(why) = missing_prerequisite() {
        skip("two_hosts_in_network_namespaces", &why);
        return;
    }
    let hosts = TwoHosts::new().expect("set up two network namespaces");
    // `ddprun` on host `i` (node rank `i` of 2, 2 workers) running the check; `flags` go to
    // ddprun, `check_args` to the check.
    let launch = |i: usize, flags: &[&str], check_args: &[&str], env: &[(&str, &str)]| {
        let rank = i.to_string();
        let mut args = vec![
            "--nnodes",
            "2",
            "--node-rank",
            &rank,
            "--master-addr",
            TwoHosts::ADDRS[0],
            "--master-port",
            "29500",
            "--nproc-per-node",
            "2",
            "--rdzv-timeout",
            "20",
        ];
        args.extend_from_slice(flags);
        args.extend_from_slice(&[CHECK, "--timeout", "20"]);
        args.extend_from_slice(check_args);
        hosts.ddprun_env(i, &args, env)
    };

    // A collective across the two hosts (hierarchical: 2 ranks on each): node 1 starts first and
    // waits for node 0's store.
    let n1 = launch(1, &[], &[], &[]);
    std::thread::sleep(Duration::from_millis(200));
    let n0 = launch(0, &[], &[], &[]);
    let (r0, r1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!(r0.code(), Some(0), "{r0}");
    assert_eq!(r1.code(), Some(0), "{r1}");
    for (r, ranks) in [(&r0, [0, 1]), (&r1, [2, 3])] {
        for rank in ranks {
            let want = format!("[rank{rank}]: rank {rank}/4: all_reduce ok (sum 10,");
            assert!(r.stdout.contains(&want), "{want} in {r}");
            assert!(r.stdout.contains("master 10.77.0.1:29500"), "{r}");
        }
        let topology =
            "topology hierarchical: 2 hosts x [2, 2] ranks, shm inside a host, tcp between";
        assert_eq!(r.stdout.matches(topology).count(), 2, "{r}");
    }

    // DDP_SOCKET_IFNAME: the store stays on the first network, the ranks' TCP traffic (4 ranks,
    // flat TCP, a 4 MiB all-reduce: ~12 MiB crosses the hosts) goes over the second one.
    let before: Vec<[u64; 2]> = (0..2)
        .map(|i| {
            [
                hosts.tx_bytes(i, &format!("veth{i}")),
                hosts.tx_bytes(i, &format!("dat{i}")),
            ]
        })
        .collect();
    let (n0, n1) = (
        launch(
            0,
            &[],
            &["--elements", "1048576"],
            &[("DDP_SOCKET_IFNAME", "dat0"), ("DDP_BACKEND", "tcp")],
        ),
        launch(
            1,
            &[],
            &["--elements", "1048576"],
            &[("DDP_SOCKET_IFNAME", "dat1"), ("DDP_BACKEND", "tcp")],
        ),
    );
    let (r0, r1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!(r0.code(), Some(0), "{r0}");
    assert_eq!(r1.code(), Some(0), "{r1}");
    let sent = |dev: usize| -> u64 {
        (0..2)
            .map(|i| hosts.tx_bytes(i, &format!("{}{i}", ["veth", "dat"][dev])) - before[i][dev])
            .sum()
    };
    let (control, data) = (sent(0), sent(1));
    assert!(
        data > 8 << 20,
        "only {data} bytes over the data network ({control} over the other)"
    );
    assert!(
        control < 1 << 20,
        "{control} bytes over the store's network ({data} over the data one)"
    );
    // A name that is not an interface: every rank fails naming it.
    let n0 = launch(0, &[], &[], &[("DDP_SOCKET_IFNAME", "nosuch9")]);
    let n1 = launch(1, &[], &[], &[("DDP_SOCKET_IFNAME", "nosuch9")]);
    let (r0, r1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    for r in [&r0, &r1] {
        assert_eq!(r.code(), Some(1), "{r}");
        assert!(r.stderr.contains("DDP_SOCKET_IFNAME=\"nosuch9\""), "{r}");
    }

    // A rank on host 1 fails on attempt 0: both hosts restart their workers and finish.
    let extra = ["--fail-rank", "3", "--fail-attempt", "0"];
    let restart = |i: usize| launch(i, &["--max-restarts", "1"], &extra, &[]);
    let (n0, n1) = (restart(0), restart(1));
    let (r0, r1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!(r0.code(), Some(0), "{r0}");
    assert_eq!(r1.code(), Some(0), "{r1}");
    assert!(
        r1.stderr.contains("failing on purpose on attempt 0"),
        "{r1}"
    );
    let attempt1 = |r: &Run| {
        ok_lines(&r.stdout)
            .iter()
            .filter(|l| l.contains(" attempt 1 "))
            .count()
    };
    assert_eq!((attempt1(&r0), attempt1(&r1)), (2, 2), "{r0}\n{r1}");

    // A master address nobody has: a clear error within the rendezvous timeout.
    let r = hosts
        .ddprun(
            1,
            &[
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-addr",
                "10.77.0.3",
                "--rdzv-timeout",
                "2",
                CHECK,
            ],
        )
        .finish(LIMIT);
    assert_eq!(r.code(), Some(1), "{r}");
    assert!(
        r.stderr
            .contains("cannot reach the rendezvous store at 10.77.0.3:29500"),
        "{r}"
    );
    assert!(r.elapsed < Duration::from_secs(15), "{r}");

    // The main job across the two hosts: train-digits, one worker per host. Its binary sits
    // next to ddprun when the workspace is built (as `cargo nextest run --workspace` does).
    let digits = std::path::Path::new(DDPRUN).with_file_name("train-digits");
    if !digits.exists() {
        let why = format!("{} not built", digits.display());
        skip("two_hosts_in_network_namespaces (train-digits part)", &why);
        return;
    }
    let digits = digits.to_str().unwrap();
    let train = |i: usize| {
        let rank = i.to_string();
        hosts.ddprun(
            i,
            &[
                "--nnodes",
                "2",
                "--node-rank",
                &rank,
                "--master-addr",
                TwoHosts::ADDRS[0],
                "--master-port",
                "29501",
                "--nproc-per-node",
                "1",
                "--rdzv-timeout",
                "20",
                digits,
                "--epochs",
                "10",
                "--json",
            ],
        )
    };
    let (n0, n1) = (train(0), train(1));
    let (r0, r1) = (n0.finish(LIMIT), n1.finish(LIMIT));
    assert_eq!(r0.code(), Some(0), "{r0}");
    assert_eq!(r1.code(), Some(0), "{r1}");
    let json = r0
        .stdout
        .lines()
        .rev()
        .find(|l| l.contains("\"world_size\""))
        .unwrap_or_else(|| panic!("no JSON line: {r0}"));
    assert!(json.contains("\"world_size\":2"), "{json}");
    assert!(json.contains("\"replicas_identical\":true"), "{json}");
}
