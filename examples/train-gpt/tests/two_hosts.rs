//! `train-gpt` on two "hosts": `ddprun --nnodes 2` in two network namespaces joined by a veth
//! pair, each with its own `/dev/shm` (so the ranks share no memory and talk over TCP), against
//! the same run spawned on one host. Needs root, `ip` and `unshare` (skipped otherwise, unless
//! `DDP_TEST_REQUIRE_ALL=1`, as in CI).

mod common;

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_train-gpt");
const ADDRS: [&str; 2] = ["10.79.0.1", "10.79.0.2"];

/// Two namespaces `gpt-PID-TAG-0/1` with `veth0`/`veth1` between them, deleted on drop.
struct Hosts([String; 2]);

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        )),
    }
}

impl Hosts {
    /// `tag` keeps the namespaces of tests running at once in this process apart.
    fn new(tag: &str) -> Result<Hosts, String> {
        let id = std::process::id();
        let hosts = Hosts([format!("gpt-{id}-{tag}-0"), format!("gpt-{id}-{tag}-1")]);
        let [a, b] = &hosts.0;
        ip(&["netns", "add", a])?;
        ip(&["netns", "add", b])?;
        ip(&[
            "link", "add", "veth0", "netns", a, "type", "veth", "peer", "name", "veth1", "netns", b,
        ])?;
        for (i, ns) in hosts.0.iter().enumerate() {
            let (dev, addr) = (format!("veth{i}"), format!("{}/24", ADDRS[i]));
            ip(&["-n", ns, "addr", "add", &addr, "dev", &dev])?;
            ip(&["-n", ns, "link", "set", &dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// `ddprun ARGS` on host `i`, in its own mount namespace with a fresh `/dev/shm`.
    fn ddprun(&self, i: usize, ddprun: &Path, args: &[&str]) -> std::process::Child {
        self.run(i, ddprun, args, &[])
    }

    /// `program ARGS` with `env` added on host `i`, in its own mount namespace with a fresh
    /// `/dev/shm`.
    fn run(
        &self,
        i: usize,
        program: &Path,
        args: &[&str],
        env: &[(&str, String)],
    ) -> std::process::Child {
        Command::new("ip")
            .args([
                "netns", "exec", &self.0[i], "unshare", "--mount", "sh", "-c",
            ])
            .arg(r#"mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@""#)
            .arg(program)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in &self.0 {
            let _ = ip(&["netns", "del", ns]);
        }
    }
}

/// Why this machine cannot make the hosts, if so.
fn missing() -> Option<String> {
    let have = |p: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {p}")])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let root = Command::new("id").arg("-u").output().ok()?.stdout == b"0\n";
    match (root, have("ip") && have("unshare")) {
        (false, _) => Some("needs root (ip netns)".into()),
        (_, false) => Some("`ip` or `unshare` not found (iproute2, util-linux)".into()),
        _ => None,
    }
}

fn json(out: &Output, what: &str) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed:\n{stdout}\n{stderr}");
    let line = stdout
        .lines()
        .find_map(|l| l.find("{\"framework\"").map(|at| &l[at..]))
        .unwrap_or_else(|| panic!("{what}: no JSON line:\n{stdout}\n{stderr}"));
    serde_json::from_str(line).unwrap()
}

/// Both frameworks, `--nnodes 2 --nproc-per-node 1` over the veth pair: world 2, replicas
/// identical, and the run the one-host `--nproc 2` run trains (to rounding: TCP's all-reduce
/// and shared memory's may add in another order).
#[test]
fn nnodes_2_over_two_network_namespaces_is_the_one_host_run() {
    if let Some(why) = missing() {
        assert!(
            std::env::var("DDP_TEST_REQUIRE_ALL").map_or(true, |v| v != "1"),
            "cannot run: {why} (DDP_TEST_REQUIRE_ALL=1)"
        );
        return eprintln!("SKIPPED nnodes_2_over_two_network_namespaces: {why}");
    }
    let ddprun = Path::new(BIN).with_file_name("ddprun");
    assert!(
        ddprun.is_file(),
        "ddprun is not built (cargo test --workspace builds it)"
    );
    let gpt = [
        common::SMALL_MODEL,
        &[
            "--batch-size",
            "4",
            "--max-iters",
            "6",
            "--json",
            "--check-replicas",
        ],
    ]
    .concat();
    for fw in ["candle", "burn"] {
        let one = Command::new(BIN)
            .args(&gpt)
            .args(["--framework", fw, "--nproc", "2"])
            .output()
            .unwrap();
        let one = json(&one, "the one-host run");
        let hosts = Hosts::new(fw).unwrap();
        let port = 29_000 + (std::process::id() % 1000) as u16;
        let port = port.to_string();
        let nodes: Vec<_> = (0..2)
            .map(|i| {
                let rank = i.to_string();
                let launcher = [
                    "--nnodes",
                    "2",
                    "--node-rank",
                    &rank,
                    "--nproc-per-node",
                    "1",
                    "--master-addr",
                    ADDRS[0],
                    "--master-port",
                    &port,
                ];
                let args = [&launcher[..], &[BIN], &gpt[..], &["--framework", fw]].concat();
                hosts.ddprun(i, &ddprun, &args)
            })
            .collect();
        let outs: Vec<Output> = nodes
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        let two = json(&outs[0], "node 0");
        assert!(
            outs[1].status.success(),
            "node 1: {}",
            String::from_utf8_lossy(&outs[1].stderr)
        );
        assert_eq!(two["world_size"], 2, "{two}");
        assert_eq!(two["replicas_identical"], true, "{two}");
        for key in ["param_sum", "param_l2", "val_loss"] {
            let (a, b) = (one[key].as_f64().unwrap(), two[key].as_f64().unwrap());
            assert!(
                (a - b).abs() <= 1e-6 * a.abs(),
                "{fw} {key}: one host {a}, two {b}"
            );
        }
    }
}

/// `--fault-tolerance` when a rank is cut off rather than killed: ranks 0 and 1 on host 0, rank
/// 2 on host 1 (the store on rank 0), then host 1's link goes down mid-training. Ranks 0 and 1
/// wait out the collective timeout, regroup without rank 2 and finish at world 2 with identical
/// replicas; rank 2 cannot reach the store to regroup and exits with an error saying so.
#[test]
fn a_rank_cut_off_by_a_partition_is_left_behind_and_exits_with_a_clear_error() {
    if let Some(why) = missing() {
        assert!(
            std::env::var("DDP_TEST_REQUIRE_ALL").map_or(true, |v| v != "1"),
            "cannot run: {why} (DDP_TEST_REQUIRE_ALL=1)"
        );
        return eprintln!("SKIPPED a_rank_cut_off_by_a_partition: {why}");
    }
    let hosts = Hosts::new("cut").unwrap();
    let port = (29_000 + (std::process::id() % 1000) as u16 + 1).to_string();
    let pid_dir = tempfile::tempdir().unwrap();
    let timeout = 3.0;
    let gpt = [
        common::SMALL_MODEL,
        &[
            "--framework",
            "candle",
            "--batch-size",
            "4",
            "--max-iters",
            "100000",
            "--stop-after",
            "1500",
            "--eval-interval",
            "1000000",
            "--json",
            "--fault-tolerance",
            "--timeout",
            "3",
        ],
    ]
    .concat();
    // --stop-after needs a checkpoint directory; it is written at the end only.
    let ck = tempfile::tempdir().unwrap();
    let gpt = [&gpt[..], &["--checkpoint-dir", ck.path().to_str().unwrap()]].concat();
    let workers: Vec<_> = [0usize, 0, 1]
        .iter()
        .enumerate()
        .map(|(rank, &host)| {
            let env = [
                ("RANK", rank.to_string()),
                ("LOCAL_RANK", if rank == 2 { 0 } else { rank }.to_string()),
                ("WORLD_SIZE", "3".to_string()),
                ("MASTER_ADDR", ADDRS[0].to_string()),
                ("MASTER_PORT", port.clone()),
                ("RAYON_NUM_THREADS", "1".to_string()),
                (
                    "TRAIN_GPT_DEBUG_PID_DIR",
                    pid_dir.path().display().to_string(),
                ),
            ];
            hosts.run(host, Path::new(BIN), &gpt, &env)
        })
        .collect();
    let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while (0..3).any(|r| !pid_dir.path().join(format!("rank{r}.pid")).exists()) {
        assert!(
            std::time::Instant::now() < until,
            "the workers did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    std::thread::sleep(std::time::Duration::from_millis(700));
    let cut = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    ip(&["-n", &hosts.0[1], "link", "set", "veth1", "down"]).unwrap();
    let outs: Vec<Output> = workers
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let j = json(&outs[0], "rank 0");
    assert!(
        outs[1].status.success(),
        "rank 1: {}",
        String::from_utf8_lossy(&outs[1].stderr)
    );
    assert_eq!(j["world_size"], 2, "{j}");
    assert_eq!(j["replicas_identical"], true, "{j}");
    let r = &j["regroups"][0];
    assert_eq!(r["lost"], serde_json::json!([2]), "{j}");
    assert_eq!(r["cause"], "lost", "{j}");
    let detected = r["detected_unix_ms"].as_u64().unwrap();
    assert!(
        detected >= cut && detected - cut <= (timeout * 1000.0) as u64 + 2000,
        "detected {} ms after the cut (timeout {timeout} s): {j}",
        detected as i64 - cut as i64
    );
    let err = String::from_utf8_lossy(&outs[2].stderr);
    assert!(!outs[2].status.success(), "rank 2 should fail:\n{err}");
    assert!(
        err.contains("could not regroup") && err.contains("store") && err.contains("unreachable"),
        "rank 2's error:\n{err}"
    );
}
