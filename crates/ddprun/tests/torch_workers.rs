//! PyTorch workers under `ddprun`, as under torchrun: they are told
//! `TORCHELASTIC_USE_AGENT_STORE=True` and use the launcher's store through PyTorch's own
//! `TCPStore` client. Needs `python3` with `torch`; without it the test prints
//! `SKIPPED ...` and passes (PyTorch is not a dependency of this project; `.ci/run` does not install
//! it, but runs these tests where the machine has it).

mod common;
use common::*;
use std::process::{Command, Stdio};
use std::time::Duration;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/torch_ddp.py");

/// Why PyTorch cannot run here, if it cannot.
fn no_torch() -> Option<String> {
    match Command::new("python3")
        .args([
            "-c",
            "import torch.distributed as d; assert d.is_available()",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => None,
        Ok(_) => Some("python3 cannot import torch.distributed (pip install torch)".into()),
        Err(e) => Some(format!("no python3: {e}")),
    }
}

#[test]
fn pytorch_ddp_workers_run_under_ddprun_like_under_torchrun() {
    if let Some(why) = no_torch() {
        note_skip(
            "pytorch_ddp_workers_run_under_ddprun_like_under_torchrun",
            &why,
        );
        return;
    }
    let r = run(
        &[
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "python3",
            SCRIPT,
        ],
        Duration::from_secs(120),
    );
    assert_eq!(r.code(), Some(0), "{r}");
    for rank in 0..2 {
        let line = format!("torch rank {rank}/2: all_reduce=3 replicas agree");
        assert!(r.stdout.contains(&line), "missing {line:?}: {r}");
    }
    assert!(!r.stderr.contains("Ping failed"), "{r}");
}

#[test]
fn a_restarted_pytorch_group_starts_from_a_clean_namespace() {
    if let Some(why) = no_torch() {
        note_skip(
            "a_restarted_pytorch_group_starts_from_a_clean_namespace",
            &why,
        );
        return;
    }
    // Every worker counts itself in the store; rank 1 fails attempt 0 after the count. The
    // restarted group must count from zero again (its own namespace in the store), not on top
    // of attempt 0's keys.
    let script = "import os, sys, torch\n\
import torch.distributed as dist\n\
dist.init_process_group('gloo')\n\
attempt = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n\
n = dist.distributed_c10d._get_default_store().add('arrived', 1)\n\
t = torch.ones(1)\n\
dist.all_reduce(t)\n\
dist.barrier()\n\
print(f'attempt {attempt}: arrived {n}, sum {t.item():g}', flush=True)\n\
dist.destroy_process_group()\n\
sys.exit(3 if attempt == 0 and dist.get_rank() == 1 else 0)\n";
    let r = run(
        &[
            "--nproc-per-node",
            "2",
            "--master-port",
            "0",
            "--max-restarts",
            "1",
            "python3",
            "-c",
            script,
        ],
        Duration::from_secs(180),
    );
    assert_eq!(r.code(), Some(0), "{r}");
    assert!(r.stderr.contains("restart 1 of at most 1"), "{r}");
    let mut counts: Vec<&str> = r
        .stdout
        .lines()
        .filter_map(|l| l.split_once("attempt 1: arrived ").map(|x| x.1))
        .collect();
    counts.sort();
    assert_eq!(counts, ["1, sum 2", "2, sum 2"], "{r}");
}
