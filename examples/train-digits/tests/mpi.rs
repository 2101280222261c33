//! `mpirun -np 2 train-digits --backend mpi` (feature `mpi`): the main job runs unchanged on the
//! MPI backend, its replicas end bit-identical, and it trains exactly as over TCP (averaging two
//! ranks is one rounding in any backend, so the parameters must be the same bits).

#![cfg(feature = "mpi")]

use ddp_example_support::testing as common;

use std::process::{Command, Output, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_train-digits");

fn summary(out: &Output, what: &str) -> serde_json::Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{what} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("{what}: last line not JSON ({e}): {stdout}"))
}

#[test]
fn mpirun_train_digits_backend_mpi_matches_tcp_bit_for_bit() {
    let args = ["--epochs", "3", "--json", "--timeout-s", "120"];
    let mpi = Command::new("timeout")
        .args([
            "300",
            "mpirun",
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "2",
            BIN,
        ])
        .args(args)
        .args(["--backend", "mpi"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let tcp = Command::new("timeout")
        .args(["300", BIN, "--nproc", "2", "--backend", "tcp"])
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let (m, t) = (
        summary(&mpi, "mpirun train-digits"),
        summary(&tcp, "train-digits tcp"),
    );
    assert_eq!(m["world_size"], 2, "{m}");
    assert_eq!(m["replicas_identical"], true, "{m}");
    assert_eq!(m["max_param_diff"], 0.0, "{m}");
    common::assert_same_run(&m, &t, "mpirun against tcp");
}
