//! `--fault-tolerance` as a user runs it: `ddprun --fault-tolerance` starts 3 real workers, the
//! test SIGKILLs one of them at a random moment (seeded), and the survivors must finish at world
//! 2 with identical replicas, equal bit for bit to the run that had world 3 up to the step they
//! went on from and world 2 after it (a checkpoint at that step resumed at world 2: the same
//! re-sharding rule); no worker left behind, no shared-memory segment leaked. A `--join`ed
//! process is taken in from the live ranks without reading any checkpoint.
//!
//! `FT_TRIALS=N` runs N kill trials (default 3; the long suite runs 20 or more).

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

const BIN: &str = env!("CARGO_BIN_EXE_train-gpt");

fn ddprun() -> Option<PathBuf> {
    let p = Path::new(BIN).with_file_name("ddprun");
    p.is_file().then_some(p)
}

/// The run every trial makes: the small model, enough steps to be killed in the middle of.
fn run_args(iters: u64) -> Vec<String> {
    let mut v: Vec<String> = common::SMALL_MODEL.iter().map(|s| s.to_string()).collect();
    for s in [
        "--framework",
        "candle",
        "--batch-size",
        "4",
        "--warmup-iters",
        "2",
        "--eval-interval",
        "1000000",
        "--json",
        "--max-iters",
    ] {
        v.push(s.into());
    }
    v.push(iters.to_string());
    v
}

/// The JSON line among `out`'s stdout lines (rank 0's, whichever process that is by then).
fn json(out: &Output, what: &str) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed:\n{stdout}\n{stderr}");
    let line = stdout
        .lines()
        .find(|l| l.contains("{\"framework\""))
        .unwrap_or_else(|| panic!("{what}: no JSON line:\n{stdout}\n{stderr}"));
    serde_json::from_str(&line[line.find('{').unwrap()..]).unwrap()
}

fn bits(v: &Value, key: &str) -> u64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("no {key} in {v}"))
        .to_bits()
}

/// `ddprun LAUNCHER BIN GPT` with the workers' pids written to `pid_dir`, its output piped.
fn launch(launcher: &[&str], gpt: &[String], pid_dir: &Path) -> Child {
    Command::new(ddprun().expect("checked by the caller"))
        .args(launcher)
        .arg(BIN)
        .args(gpt)
        .env("TRAIN_GPT_DEBUG_PID_DIR", pid_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The same run, bit for bit: parameters' sum and norm, validation loss.
fn assert_same_run(a: &Value, b: &Value, what: &str) {
    for key in ["param_sum", "param_l2", "val_loss"] {
        assert_eq!(
            bits(a, key),
            bits(b, key),
            "{what}: {key} differs:\n{a}\n{b}"
        );
    }
}

/// A small deterministic generator (splitmix64) for the trials' choices.
fn mix(seed: u64) -> u64 {
    let mut z = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Waits until every rank of `world` wrote its pid (`TRAIN_GPT_DEBUG_PID_DIR`); their pids.
fn pids(dir: &Path, world: usize, child: &mut Child) -> Vec<i32> {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let got: Vec<i32> = (0..world)
            .filter_map(|r| std::fs::read_to_string(dir.join(format!("rank{r}.pid"))).ok())
            .filter_map(|s| s.trim().parse().ok())
            .collect();
        if got.len() == world {
            return got;
        }
        if let Ok(Some(st)) = child.try_wait() {
            panic!("ddprun exited ({st}) before every worker started");
        }
        assert!(Instant::now() < until, "workers did not start");
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .contains(") Z ")
}

/// Shared-memory segments created by `pid` (`/dev/shm/ddp-rs-{pid}-*`).
fn segments_of(pid: i32) -> Vec<String> {
    let prefix = format!("ddp-rs-{pid}-");
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Train-gpt at world `n` (self-spawned), `extra` flags after the trial's.
fn plain(n: usize, iters: u64, extra: &[&str]) -> Value {
    let out = Command::new(BIN)
        .args(run_args(iters))
        .args(["--nproc", &n.to_string()])
        .args(extra)
        .output()
        .unwrap();
    json(&out, &format!("train-gpt --nproc {n} {extra:?}"))
}

/// The reference of a trial whose survivors went on from step `k` at world 2: world 3 up to
/// `k` (a checkpoint there), then world 2 resumed from it.
fn reference(k: u64, iters: u64) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    if k == 0 {
        return plain(2, iters, &[]);
    }
    let s = k.to_string();
    plain(3, iters, &["--checkpoint-dir", d, "--stop-after", &s]);
    plain(2, iters, &["--checkpoint-dir", d, "--resume"])
}

/// One trial: ddprun --fault-tolerance with 3 workers, rank `victim` SIGKILLed `delay` after
/// every worker started.
fn trial(seed: u64, iters: u64) {
    let victim = (mix(seed) % 3) as usize;
    let delay = Duration::from_millis(mix(seed ^ 1) % 1000);
    let pid_dir = tempfile::tempdir().unwrap();
    let launcher = ["--standalone", "--fault-tolerance", "--nproc-per-node", "3"];
    let mut child = launch(&launcher, &run_args(iters), pid_dir.path());
    let pids = pids(pid_dir.path(), 3, &mut child);
    std::thread::sleep(delay);
    let killed = unsafe_free_kill(pids[victim]);
    let out = child.wait_with_output().unwrap();
    let what = format!("trial {seed} (rank {victim} killed after {delay:?})");
    let ft = json(&out, &what);
    let stderr = String::from_utf8_lossy(&out.stderr);
    for &p in &pids {
        assert!(!alive(p), "{what}: worker pid {p} outlived the job");
        assert!(
            segments_of(p).is_empty(),
            "{what}: pid {p} left {:?}",
            segments_of(p)
        );
    }
    let regroups = ft["regroups"].as_array().cloned().unwrap_or_default();
    if !killed || regroups.is_empty() {
        // The kill came after the victim had finished: nothing to recover from.
        assert_eq!(ft["world_size"], 3, "{what}: {ft}\n{stderr}");
        eprintln!("{what}: the victim had finished; no recovery to check");
        return;
    }
    assert_eq!(regroups.len(), 1, "{what}: {ft}");
    let r = &regroups[0];
    assert_eq!(
        r["lost"],
        serde_json::json!([victim]),
        "{what}: {ft}\n{stderr}"
    );
    assert_eq!(ft["world_size"], 2, "{what}: {ft}");
    assert_eq!(ft["replicas_identical"], true, "{what}: {ft}");
    assert!(ft["failed_steps"].as_u64().unwrap() <= 1, "{what}: {ft}");
    assert!(
        stderr.contains(&format!("worker rank {victim}")) && stderr.contains("SIGKILL"),
        "{what}: ddprun did not report the loss:\n{stderr}"
    );
    let k = r["step"].as_u64().unwrap();
    let reference = reference(k, iters);
    let why = format!("{what}: went on from step {k}, against world 3 to {k} then world 2");
    assert_same_run(&ft, &reference, &why);
    eprintln!("{what}: went on from step {k} at world 2, equal to the reference");
}

/// SIGKILL through the `kill` command (this test crate has no libc); whether it was delivered.
fn unsafe_free_kill(pid: i32) -> bool {
    Command::new("kill")
        .args(["-9", &pid.to_string()])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn a_rank_killed_at_a_random_moment_is_survived_in_place_and_equals_the_reference() {
    if ddprun().is_none() {
        eprintln!("skipped: the ddprun binary is not built (cargo test --workspace builds it)");
        return;
    }
    let trials: u64 = std::env::var("FT_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let seed0: u64 = std::env::var("FT_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(7);
    for t in 0..trials {
        trial(seed0 + t, 500);
    }
}

#[test]
fn without_fault_tolerance_a_killed_rank_still_fails_the_job() {
    if ddprun().is_none() {
        return;
    }
    let pid_dir = tempfile::tempdir().unwrap();
    let launcher = ["--standalone", "--nproc-per-node", "3"];
    let mut child = launch(&launcher, &run_args(100_000), pid_dir.path());
    let pids = pids(pid_dir.path(), 3, &mut child);
    std::thread::sleep(Duration::from_millis(300));
    assert!(unsafe_free_kill(pids[1]));
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!stdout.contains("regroups"), "{stdout}");
}

#[test]
fn a_joined_process_gets_the_live_state_and_no_checkpoint_is_read() {
    if ddprun().is_none() {
        return;
    }
    // Two workers under ddprun; a third process joins by hand through the job's store.
    let port = ddp_example_support::testing::free_port().to_string();
    let pid_dir = tempfile::tempdir().unwrap();
    let iters = 400;
    let launcher = [
        "--fault-tolerance",
        "--nproc-per-node",
        "2",
        "--master-addr",
    ];
    let launcher = [&launcher[..], &["127.0.0.1", "--master-port", &port]].concat();
    let job = launch(&launcher, &run_args(iters), pid_dir.path());
    let mut job = job;
    pids(pid_dir.path(), 2, &mut job);
    let joiner = Command::new(BIN)
        .args(run_args(iters))
        .arg("--join")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port)
        .env("RANK", "2")
        .env("WORLD_SIZE", "3")
        .env("DDP_STORE_HOSTED", "1")
        .output()
        .unwrap();
    let out = job.wait_with_output().unwrap();
    let j = json(&out, "the job a process joined");
    let stderr = String::from_utf8_lossy(&joiner.stderr);
    assert!(joiner.status.success(), "the joiner failed:\n{stderr}");
    assert_eq!(j["world_size"], 3, "{j}");
    assert_eq!(j["replicas_identical"], true, "{j}");
    let r = &j["regroups"][0];
    assert_eq!(r["cause"], "joined", "{j}");
    assert_eq!(r["joined"], 1, "{j}");
    assert_eq!(r["state_sent"], true, "{j}");
    assert_eq!(j["failed_steps"], 0, "{j}");
    // World 2 up to the step the newcomer entered at, world 3 after it.
    let k = r["step"].as_u64().unwrap();
    assert!(k > 0 && k < iters, "{j}");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    plain(
        2,
        iters,
        &["--checkpoint-dir", d, "--stop-after", &k.to_string()],
    );
    let reference = plain(3, iters, &["--checkpoint-dir", d, "--resume"]);
    assert_same_run(&j, &reference, "joined, against world 2 then 3");
}

/// An elastic `ddprun --nnodes 2:3 --fault-tolerance` agent on 127.0.0.1 (one worker), its
/// output in `log`.
fn elastic_node(port: u16, pid_dir: &Path, log: &Path, gpt: &[String]) -> Child {
    let ddprun = ddprun().expect("checked by the caller");
    let mut cmd = common::elastic_node(&ddprun, BIN, port, log, &["--fault-tolerance"], gpt);
    cmd.env("TRAIN_GPT_DEBUG_PID_DIR", pid_dir).spawn().unwrap()
}

/// The parent pid of `pid`.
fn ppid(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    after.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// A node of an elastic `--nnodes 2:3` job dies (its agent and worker SIGKILLed): the other two
/// go on in place at world 2. Restarted — after the checkpoint directory is removed — it joins
/// the running job from its live peers: world 3 again, replicas identical, and the run equals,
/// bit for bit, world 3 up to the loss, world 2 up to the join, world 3 after.
#[test]
fn a_restarted_node_rejoins_an_elastic_job_from_its_live_peers() {
    if ddprun().is_none() {
        return eprintln!("skipped: the ddprun binary is not built");
    }
    let port = ddp_example_support::testing::free_port();
    let tmp = tempfile::tempdir().unwrap();
    let (pid_dir, ck) = (tmp.path().join("pids"), tmp.path().join("ck"));
    std::fs::create_dir_all(&pid_dir).unwrap();
    let iters = 2500;
    let mut gpt = run_args(iters);
    gpt.extend(["--checkpoint-dir".into(), ck.display().to_string()]);
    gpt.extend(["--checkpoint-every".into(), "100".into()]);
    let log = |n: &str| tmp.path().join(format!("{n}.log"));
    let a = elastic_node(port, &pid_dir, &log("a"), &gpt);
    std::thread::sleep(Duration::from_millis(300)); // A hosts the rendezvous store
    let b = elastic_node(port, &pid_dir, &log("b"), &gpt);
    let c = elastic_node(port, &pid_dir, &log("c"), &gpt);
    let mut c = c;
    let workers = pids(&pid_dir, 3, &mut c);
    let c_rank = workers
        .iter()
        .position(|&p| ppid(p) == c.id() as i32)
        .expect("node C's worker");
    std::thread::sleep(Duration::from_millis(800));
    // Node C dies: its agent and its worker.
    assert!(unsafe_free_kill(c.id() as i32));
    assert!(unsafe_free_kill(workers[c_rank]));
    c.wait().unwrap();
    // The others go on at world 2 (the loss is seen at once, the window is 1 s).
    std::thread::sleep(Duration::from_millis(2500));
    // No checkpoint to read: the restarted node can only get its state from its peers.
    std::fs::remove_dir_all(&ck).ok();
    let c2 = elastic_node(port, &pid_dir, &log("c2"), &gpt);
    let outs: Vec<_> = [a, b, c2]
        .into_iter()
        .map(|mut ch| ch.wait().unwrap())
        .collect();
    let text = |n: &str| std::fs::read_to_string(log(n)).unwrap_or_default();
    let all = format!("A:\n{}\nB:\n{}\nC2:\n{}", text("a"), text("b"), text("c2"));
    assert!(outs.iter().all(|s| s.success()), "{all}");
    let line = ["a", "b", "c2"]
        .iter()
        .flat_map(|n| text(n).lines().map(str::to_string).collect::<Vec<_>>())
        .find(|l| l.contains("{\"framework\""))
        .unwrap_or_else(|| panic!("no JSON line:\n{all}"));
    let j: Value = serde_json::from_str(&line[line.find('{').unwrap()..]).unwrap();
    assert_eq!(j["world_size"], 3, "{j}\n{all}");
    assert_eq!(j["replicas_identical"], true, "{j}");
    let r = j["regroups"].as_array().cloned().unwrap_or_default();
    assert_eq!(r.len(), 2, "{j}\n{all}");
    assert_eq!(r[0]["cause"], "lost", "{j}");
    assert_eq!(r[0]["lost"], serde_json::json!([c_rank]), "{j}");
    assert_eq!(r[1]["cause"], "joined", "{j}");
    assert_eq!(r[1]["state_sent"], true, "{j}");
    let (k1, k2) = (
        r[0]["step"].as_u64().unwrap(),
        r[1]["step"].as_u64().unwrap(),
    );
    assert!(k1 < k2 && k2 < iters, "{j}");
    // The reference: world 3 to k1, world 2 to k2, world 3 to the end.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    plain(
        3,
        iters,
        &["--checkpoint-dir", d, "--stop-after", &k1.to_string()],
    );
    plain(
        2,
        iters,
        &[
            "--checkpoint-dir",
            d,
            "--resume",
            "--stop-after",
            &k2.to_string(),
        ],
    );
    let reference = plain(3, iters, &["--checkpoint-dir", d, "--resume"]);
    assert_same_run(&j, &reference, "against world 3, then 2, then 3");
}
