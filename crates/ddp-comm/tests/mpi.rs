//! The MPI backend (feature `mpi`) under `mpirun`: every collective, op, dtype and size (0, 1,
//! odd, 4 MiB + 3) against the sequential reference at world sizes 1–4; subgroups from
//! `MPI_Comm_split`; random float all-reduces bit-identical on every rank; mismatched
//! collectives, a stalled rank and a killed rank end the job with errors naming the collective
//! and its sequence number, within the timeout.
//!
//! The ranks are this test binary re-executed by `mpirun` on its ignored `mpi_rank` test
//! (mode in `DDP_TEST_MODE`), with `DDP_BACKEND=mpi`: no store, no `MASTER_*`.

#![cfg(feature = "mpi")]

mod common;

use ddp_comm::{init_process_group, InitOptions, ReduceOp};
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The rank side, run only under `mpirun` by the tests below.
#[test]
#[ignore = "entry point of the ranks that the other tests start with mpirun"]
fn mpi_rank() {
    let mode = std::env::var("DDP_TEST_MODE").expect("DDP_TEST_MODE");
    let timeout =
        Duration::from_secs(std::env::var("DDP_TEST_TIMEOUT").map_or(60, |v| v.parse().unwrap()));
    common::log_to_stderr();
    let pg = init_process_group(InitOptions {
        timeout,
        ..Default::default()
    })
    .expect("init over MPI");
    assert_eq!(pg.topology().name(), "mpi", "{}", pg.topology());
    let rank = pg.rank();
    let fail = |e: ddp_comm::Error| -> ! {
        println!("ERROR: {e}");
        std::process::exit(3)
    };
    match mode.as_str() {
        "reference" => {
            common::check_every_collective(&pg, 700 + pg.size() as u64);
            // Random floats: every rank must get the same bits (compared by hash).
            let mine: Vec<i64> = hashes(&common::random_float_all_reduces(&pg))
                .into_iter()
                .map(|h| h as i64)
                .collect();
            let mut all = vec![0i64; mine.len() * pg.size()];
            pg.all_gather(&mine, &mut all).unwrap();
            let by_rank: Vec<Vec<Vec<u64>>> = all
                .chunks(mine.len())
                .map(|c| vec![c.iter().map(|&h| h as u64).collect()])
                .collect();
            common::assert_bit_identical(&by_rank, &format!("mpi world {}", pg.size()));
            // Subgroups: the even ranks, and every rank but 0 (MPI_Comm_split).
            let evens: Vec<usize> = (0..pg.size()).step_by(2).collect();
            let rest: Vec<usize> = (1..pg.size()).collect();
            let ge = pg.new_group(&evens).unwrap();
            let gr = if rest.is_empty() {
                None
            } else {
                pg.new_group(&rest).unwrap()
            };
            assert_eq!(ge.is_some(), rank.is_multiple_of(2));
            assert_eq!(gr.is_some(), rank > 0);
            for g in [ge, gr].into_iter().flatten() {
                common::check_all::<f32>(&g, 90 + g.size() as u64, &[0, 1, 7, 1001]);
                common::check_all::<half::bf16>(&g, 91, &[0, 1, 333]);
            }
            println!("OK rank {rank}");
        }
        "mismatch" => {
            let mut ok = vec![0.0f32; 8];
            pg.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
            let n = if rank == 1 { 10 } else { 11 };
            let mut buf = vec![1.0f32; n];
            match pg.all_reduce(&mut buf, ReduceOp::Sum) {
                Err(e) => fail(e),
                Ok(()) => println!("NO ERROR"),
            }
        }
        "stall" => {
            let mut buf = vec![1i64; 100];
            pg.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(60));
            }
            match pg.all_reduce(&mut buf, ReduceOp::Sum) {
                Err(e) => fail(e),
                Ok(()) => println!("NO ERROR"),
            }
        }
        "loop" => {
            let mut buf = vec![1.0f32; 1 << 18];
            let mut i = 0u64;
            loop {
                if let Err(e) = pg.all_reduce(&mut buf, ReduceOp::Avg) {
                    fail(e)
                }
                if i == 0 {
                    println!("READY {rank} pid {}", std::process::id());
                }
                i += 1;
            }
        }
        other => panic!("unknown mode {other}"),
    }
}

/// One FNV-1a hash per case of [`common::random_float_all_reduces`]'s bit patterns.
fn hashes(cases: &[Vec<u64>]) -> Vec<u64> {
    cases
        .iter()
        .map(|c| {
            c.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
                (h ^ x).wrapping_mul(0x0000_0100_0000_01b3)
            })
        })
        .collect()
}

/// `mpirun -np world` of this binary's `mpi_rank` in `mode` (as root: `--allow-run-as-root`;
/// more ranks than cores: `--oversubscribe`), stdout and stderr piped.
fn mpirun(world: usize, mode: &str, env: &[(&str, &str)]) -> Child {
    mpirun_with(Command::new("mpirun"), &[], world, mode, env)
}

/// [`mpirun`] as `cmd` (e.g. `ip netns exec NS mpirun`), with `flags` before the program.
fn mpirun_with(
    mut cmd: Command,
    flags: &[String],
    world: usize,
    mode: &str,
    env: &[(&str, &str)],
) -> Child {
    cmd.args(["--allow-run-as-root", "--oversubscribe"])
        .args(flags)
        .arg("-np")
        .arg(world.to_string())
        .args(["-x", "DDP_BACKEND=mpi", "-x"])
        .arg(format!("DDP_TEST_MODE={mode}"));
    for (k, v) in env {
        cmd.arg("-x").arg(format!("{k}={v}"));
    }
    cmd.arg(std::env::current_exe().unwrap())
        .args([
            "mpi_rank",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd.spawn()
        .expect("mpirun (the mpi feature needs an MPI installation, e.g. openmpi-bin)")
}

/// Wait for the job at most `limit`; its exit code (`None`: killed at the limit) and output.
fn finish(child: Child, limit: Duration) -> (Option<i32>, String, Duration) {
    let start = Instant::now();
    let (code, out) = common::finish(child, start + limit);
    (code, out, start.elapsed())
}

fn reference_at(world: usize) {
    reference_with(world, &[]);
}

fn reference_with(world: usize, env: &[(&str, &str)]) {
    let (code, out, _) = finish(mpirun(world, "reference", env), Duration::from_secs(300));
    assert_eq!(code, Some(0), "world {world}: {out}");
    for r in 0..world {
        assert!(
            out.contains(&format!("OK rank {r}\n")),
            "world {world}: {out}"
        );
    }
}

#[test]
fn mpi_world_1_matches_reference() {
    reference_at(1);
}

#[test]
fn mpi_world_2_matches_reference() {
    reference_at(2);
}

#[test]
fn mpi_world_3_matches_reference() {
    reference_at(3);
}

#[test]
fn mpi_world_4_matches_reference() {
    reference_at(4);
}

/// The `MPI_I*` path (what runs under `MPI_THREAD_SERIALIZED`), forced by its env var.
#[test]
fn mpi_world_3_nonblocking_matches_reference() {
    reference_with(3, &[("DDP_MPI_NONBLOCKING", "1")]);
}

/// Fingerprint checks off: the collectives alone still match the reference.
#[test]
fn mpi_world_2_without_fingerprints_matches_reference() {
    reference_with(2, &[("DDP_MPI_FINGERPRINTS", "0")]);
}

#[test]
fn mpi_mismatched_collectives_end_the_job_naming_both_sides() {
    let (code, out, took) = finish(mpirun(3, "mismatch", &[]), Duration::from_secs(60));
    assert_ne!(code, Some(0), "{out}");
    assert!(!out.contains("NO ERROR"), "{out}");
    assert!(
        out.contains("collective mismatch at #1")
            && out.contains("all_reduce(sum, f32 x 10)")
            && out.contains("all_reduce(sum, f32 x 11)"),
        "the error must name the sequence number and both sides: {out}"
    );
    assert!(out.contains("MPI_Abort"), "{out}");
    assert!(took < Duration::from_secs(30), "took {took:?}");
}

/// Blocking calls: the watchdog thread ends the job.
#[test]
fn mpi_stalled_rank_ends_the_job_within_the_timeout() {
    stalled_rank(&[]);
}

/// `MPI_I*` calls: the polling loop's deadline ends the job.
#[test]
fn mpi_stalled_rank_ends_the_job_within_the_timeout_nonblocking() {
    stalled_rank(&[("DDP_MPI_NONBLOCKING", "1")]);
}

fn stalled_rank(env: &[(&str, &str)]) {
    let env = [&[("DDP_TEST_TIMEOUT", "3")], env].concat();
    let (code, out, took) = finish(mpirun(3, "stall", &env), Duration::from_secs(50));
    assert_ne!(code, Some(0), "{out}");
    // Ranks 0 and 2 both time out; the first to call MPI_Abort ends the other, so one of
    // them is heard.
    let named = |r: usize| {
        out.contains(&format!(
            "timed out after 3s waiting for all_reduce(sum, i64 x 100) #1 on rank {r} of 3"
        ))
    };
    assert!(
        named(0) || named(2),
        "a waiting rank must name the collective and its sequence number: {out}"
    );
    assert!(out.contains("MPI_Abort"), "{out}");
    // 3 s timeout; rank 1 sleeps 60 s: the job must end long before.
    assert!(took < Duration::from_secs(20), "took {took:?}: {out}");
}

#[test]
fn mpi_killed_rank_ends_the_job_naming_it() {
    let mut child = mpirun(3, "loop", &[("DDP_TEST_TIMEOUT", "5")]);
    let _guard = common::guard(std::slice::from_ref(&child));
    // Lines of the job's stdout, read on a thread so that waiting for them has a deadline.
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            let _ = tx.send(l);
        }
    });
    let (mut victim, mut ready, mut seen) = (None, 0, String::new());
    while ready < 3 {
        let l = rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("the ranks never all became ready: {seen}"));
        // The harness prints `test mpi_rank ... ` without a newline before the rank's line.
        if let Some(i) = l.find("READY ") {
            ready += 1;
            if let Some(pid) = l[i..].strip_prefix("READY 1 pid ") {
                victim = Some(pid.trim().parse::<i32>().unwrap());
            }
        }
        seen.push_str(&l);
        seen.push('\n');
    }
    let victim = victim.expect("rank 1 printed its pid");
    let killed = Instant::now();
    // SAFETY: plain kill(2) of a rank we started (through mpirun).
    unsafe { libc::kill(victim, libc::SIGKILL) };
    let code = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s.code();
        }
        assert!(
            killed.elapsed() < Duration::from_secs(40),
            "the job hangs after rank 1 was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = killed.elapsed();
    let mut out = String::new();
    while let Ok(l) = rx.recv_timeout(Duration::from_secs(5)) {
        out.push_str(&l);
        out.push('\n');
    }
    child.stderr.take().unwrap().read_to_string(&mut out).ok();
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("rank 1") && out.contains("signal 9"),
        "the job must end naming the killed rank 1: {out}"
    );
    // Well within the 5 s collective timeout (mpirun notices the death at once).
    assert!(took < Duration::from_secs(5), "took {took:?}: {out}");
}

/// Two network namespaces joined by a veth pair (`10.79.0.1`, `10.79.0.2`), deleted on drop.
struct TwoHosts([String; 2]);

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TwoHosts {
    const ADDRS: [&'static str; 2] = ["10.79.0.1", "10.79.0.2"];

    fn new() -> TwoHosts {
        let id = std::process::id();
        let h = TwoHosts([format!("ddpmpi-{id}-0"), format!("ddpmpi-{id}-1")]);
        let [a, b] = &h.0;
        ip(&["netns", "add", a]);
        ip(&["netns", "add", b]);
        ip(&[
            "link", "add", "veth0", "netns", a, "type", "veth", "peer", "name", "veth1", "netns", b,
        ]);
        for (i, ns) in h.0.iter().enumerate() {
            let dev = format!("veth{i}");
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{}/24", Self::ADDRS[i]),
                "dev",
                &dev,
            ]);
            ip(&["-n", ns, "link", "set", &dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        h
    }

    fn tx_bytes(&self, i: usize) -> u64 {
        let path = format!("/sys/class/net/veth{i}/statistics/tx_bytes");
        let out = Command::new("ip")
            .args(["netns", "exec", &self.0[i], "cat", &path])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// `mpirun` in namespace 0 launches rank 0 there and rank 1 in namespace 1 through an rsh agent
/// that runs `ip netns exec`: MPI's own TCP transport carries the collectives across the
/// "hosts" (the veth pair), and the reference checker passes.
#[test]
fn mpi_two_hosts_in_network_namespaces() {
    // SAFETY: plain syscall.
    if unsafe { libc::geteuid() } != 0 {
        let why = "mpi_two_hosts_in_network_namespaces needs root (ip netns)";
        assert!(
            std::env::var("DDP_TEST_REQUIRE_ALL").map_or(true, |v| v != "1"),
            "{why} (DDP_TEST_REQUIRE_ALL=1: no test may skip)"
        );
        // Past the harness's output capture, so that `cargo test` shows the skip too.
        let _ = std::io::Write::write_all(
            &mut std::io::stderr().lock(),
            format!("SKIPPED {why}\n").as_bytes(),
        );
        return;
    }
    let hosts = TwoHosts::new();
    let dir = std::env::temp_dir().join(format!("ddp-mpi-rsh-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let agent = dir.join("netns-rsh");
    // Called as `agent HOST COMMAND...`: HOST is an address; run COMMAND in its namespace.
    let script = format!(
        "#!/bin/sh\nhost=$1; shift\ncase $host in\n  {}) ns={} ;;\n  {}) ns={} ;;\n  *) echo \"netns-rsh: unknown host $host\" >&2; exit 1 ;;\nesac\nexec ip netns exec $ns sh -c \"$*\"\n",
        TwoHosts::ADDRS[0], hosts.0[0], TwoHosts::ADDRS[1], hosts.0[1]
    );
    std::fs::write(&agent, script).unwrap();
    std::fs::set_permissions(&agent, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let before = hosts.tx_bytes(1);
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", &hosts.0[0], "mpirun"]);
    let flags: Vec<String> = [
        "--host",
        &format!("{},{}", TwoHosts::ADDRS[0], TwoHosts::ADDRS[1]),
        "--mca",
        "plm_rsh_agent",
        agent.to_str().unwrap(),
        "--mca",
        "btl",
        "self,tcp",
        "--mca",
        "btl_tcp_if_include",
        "10.79.0.0/24",
        "--mca",
        "oob_tcp_if_include",
        "10.79.0.0/24",
        "--map-by",
        "node",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let child = mpirun_with(cmd, &flags, 2, "reference", &[]);
    let (code, out, _) = finish(child, Duration::from_secs(300));
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("OK rank 0\n") && out.contains("OK rank 1\n"),
        "{out}"
    );
    let sent = hosts.tx_bytes(1) - before;
    // The 4 MiB + 3 all-reduce alone sends more than 4 MB each way.
    assert!(
        sent > 4 << 20,
        "host 1 sent only {sent} bytes over the veth pair: {out}"
    );
}
