//! Boundary values (0, 1, the type's maximum, negative, empty) for every numeric flag of
//! `ddp-bench`'s sweeps and training benchmark: no panic, a clear error when refused.

#[path = "../../ddprun/tests/common/cli_bounds.rs"]
mod cli_bounds;

use cli_bounds::{outcome, Binary, F64_MAX, U64_MAX};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_ddp-bench");

#[test]
fn sweep_flags_at_their_bounds() {
    let bin = Binary {
        path: BIN,
        lead: &["allreduce"],
        base: &[
            ("--nproc", "1"),
            ("--min-bytes", "4"),
            ("--max-bytes", "4"),
            ("--iters", "1"),
            ("--warmup", "0"),
        ],
        trail: &[],
        env: &[],
        limit: Duration::from_secs(60),
    };
    let all = bin.check_all(&[
        ("--nproc", U64_MAX),
        ("--min-bytes", U64_MAX),
        ("--max-bytes", U64_MAX),
        ("--iters", U64_MAX),
        ("--warmup", U64_MAX),
    ]);
    for (flag, value) in [("--iters", "0"), ("--nproc", "0"), ("--max-bytes", U64_MAX)] {
        let o = outcome(&all, flag, value);
        assert_eq!(o.code, Some(2), "{o:?}");
        assert!(o.stderr.contains(flag), "{o:?}");
    }
    assert!(outcome(&all, "--max-bytes", "1")
        .stderr
        .contains("--min-bytes 4 is larger than --max-bytes 1"));
}

#[test]
fn train_flags_at_their_bounds() {
    let bin = Binary {
        path: BIN,
        lead: &["train"],
        base: &[
            ("--nproc", "1"),
            ("--hidden", "8"),
            ("--layers", "1"),
            ("--batch", "2"),
            ("--steps", "1"),
            ("--warmup", "0"),
        ],
        trail: &[],
        env: &[],
        limit: Duration::from_secs(60),
    };
    let all = bin.check_all(&[
        ("--nproc", U64_MAX),
        ("--hidden", U64_MAX),
        ("--layers", U64_MAX),
        ("--batch", U64_MAX),
        ("--steps", U64_MAX),
        ("--warmup", U64_MAX),
        ("--bucket-cap-mb", F64_MAX),
    ]);
    for (flag, value) in [
        ("--hidden", "0"),
        ("--steps", "0"),
        ("--bucket-cap-mb", "0"),
    ] {
        let o = outcome(&all, flag, value);
        assert_eq!(o.code, Some(2), "{o:?}");
    }
    assert_eq!(outcome(&all, "--hidden", "1").code, Some(0));
}

/// `--backend nccl` without a GPU: a clear error naming what is missing (the feature, or with
/// it, libcuda and `LD_LIBRARY_PATH`), exit status 1, no panic.
#[test]
fn nccl_backend_without_a_gpu_says_what_is_missing() {
    let out = std::process::Command::new(BIN)
        .args([
            "allreduce",
            "--backend",
            "nccl",
            "--nproc",
            "1",
            "--max-bytes",
            "4K",
        ])
        .env("LD_LIBRARY_PATH", "/nonexistent")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let want = if cfg!(feature = "nccl") {
        "libcuda: not found"
    } else {
        "--backend nccl needs ddp-bench built with the nccl feature"
    };
    if cfg!(feature = "nccl") && !err.contains(want) && err.contains("nccl") {
        // a machine with libcuda: the error is about NCCL or the device instead
        eprintln!("libcuda present here: {err}");
        return;
    }
    assert!(err.contains(want), "{err}");
}

/// `ddp-bench train --device cuda` without the `cuda` feature: exit 2 before any rank starts,
/// saying how to rebuild.
#[test]
fn train_device_cuda_needs_the_feature() {
    if cfg!(feature = "cuda") {
        return;
    }
    let o = std::process::Command::new(BIN)
        .args(["train", "--device", "cuda", "--nproc", "2", "--steps", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--features cuda -p ddp-bench"), "{err}");
}
