//! Boundary values (0, 1, the type's maximum, negative, empty) for every numeric flag of
//! `ddp-bench`'s sweeps and training benchmark: no panic, a clear error when refused.

#[path = "../../ddprun/tests/common/cli_bounds.rs"]
mod cli_bounds;
#[path = "../../../examples/train-digits/tests/flag_table/mod.rs"]
mod flag_table;

use cli_bounds::{outcome, Binary, F64_MAX, U64_MAX};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_ddp-bench");

/// The smallest sweep: one rank, one 4-byte message, one iteration, no warmup.
const SWEEP_BASE: &[(&str, &str)] = &[
    ("--nproc", "1"),
    ("--min-bytes", "4"),
    ("--max-bytes", "4"),
    ("--iters", "1"),
    ("--warmup", "0"),
];

/// The smallest training run: one rank, hidden 8, one layer, batch 2, one step, no warmup.
const TRAIN_BASE: &[(&str, &str)] = &[
    ("--nproc", "1"),
    ("--hidden", "8"),
    ("--layers", "1"),
    ("--batch", "2"),
    ("--steps", "1"),
    ("--warmup", "0"),
];

/// `ddp-bench LEAD BASE`, each run at most 60 s, no trailing arguments or environment.
fn bench<'a>(lead: &'a [&'a str], base: &'a [(&'a str, &'a str)]) -> Binary<'a> {
    Binary {
        path: BIN,
        lead,
        base,
        trail: &[],
        env: &[],
        limit: Duration::from_secs(60),
    }
}

#[test]
fn sweep_flags_at_their_bounds() {
    let all = bench(&["allreduce"], SWEEP_BASE).check_all(&[
        ("--nproc", U64_MAX),
        ("--min-bytes", U64_MAX),
        ("--max-bytes", U64_MAX),
        ("--iters", U64_MAX),
        ("--warmup", U64_MAX),
    ]);
    for (flag, value) in [
        ("--iters", "0"),
        ("--nproc", "0"),
        ("--max-bytes", U64_MAX),
        ("--max-bytes", "0"),
        ("--max-bytes", "1"),
        ("--min-bytes", "0"),
    ] {
        let o = outcome(&all, flag, value);
        assert_eq!(o.code, Some(2), "{o:?}");
        assert!(o.stderr.contains(flag), "{o:?}");
    }
}

fn sweep(args: &[&str]) -> std::process::Output {
    std::process::Command::new(BIN)
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap()
}

/// A sweep that would measure nothing (messages under one f32: `--max-bytes 0`, or 3) is
/// refused before any rank starts, naming the flag and the smallest size; it used to print the
/// table's header, no row, and exit 0. Every accepted range prints at least one row.
#[test]
fn sweeps_of_no_bytes_are_refused_and_every_accepted_one_prints_rows() {
    for op in ["allreduce", "all_gather", "reduce_scatter", "broadcast"] {
        for (min, max) in [("0", "0"), ("0", "3"), ("3", "4"), ("4", "0")] {
            let o = sweep(&[op, "--nproc", "1", "--min-bytes", min, "--max-bytes", max]);
            let err = String::from_utf8_lossy(&o.stderr);
            let out = String::from_utf8_lossy(&o.stdout);
            assert_eq!(o.status.code(), Some(2), "{op} {min}..{max}: {out}{err}");
            assert!(out.is_empty(), "{op} {min}..{max} printed {out}");
            let flag = if min.parse::<u32>().unwrap() < 4 {
                "--min-bytes"
            } else {
                "--max-bytes"
            };
            assert!(err.contains(flag), "{op} {min}..{max}: {err}");
            assert!(
                err.contains("smallest message, 4 bytes (one f32 element)"),
                "{op} {min}..{max}: {err}"
            );
        }
    }
    let o = sweep(&[
        "allreduce",
        "--nproc",
        "1",
        "--min-bytes",
        "8",
        "--max-bytes",
        "4",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--min-bytes 8 is larger than --max-bytes 4"),
        "{err}"
    );
    // The smallest accepted sweep: one row of 4 bytes, nothing wrong.
    for json in [false, true] {
        let mut args = vec![
            "allreduce",
            "--nproc",
            "1",
            "--min-bytes",
            "4",
            "--max-bytes",
            "4",
        ];
        args.extend(["--iters", "1", "--warmup", "0"]);
        if json {
            args.push("--json");
        }
        let o = sweep(&args);
        let out = String::from_utf8_lossy(&o.stdout);
        assert_eq!(o.status.code(), Some(0), "{out}");
        let rows: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
        if json {
            assert_eq!(rows.len(), 1, "{out}");
            assert!(
                rows[0].contains(r#""bytes":4"#) && rows[0].contains(r#""wrong":0"#),
                "{out}"
            );
        } else {
            // header and one row: `4 <time> <algbw> <busbw> 0`
            assert_eq!(rows.len(), 2, "{out}");
            let row: Vec<&str> = rows[1].split_whitespace().collect();
            assert_eq!((row[0], row[4]), ("4", "0"), "{out}");
        }
    }
}

#[test]
fn train_flags_at_their_bounds() {
    let all = bench(&["train"], TRAIN_BASE).check_all(&[
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

/// Every numeric flag in the `--help` of every subcommand has a row, and values outside its
/// bounds (non-finite, not a number, negative, zero where zero means nothing, a message under
/// 4 bytes) are refused with exit status 2 and an error naming the flag and the value.
#[test]
fn every_numeric_flag_in_help_refuses_values_outside_its_bounds() {
    use flag_table::{Table, U64_OVER};
    let sweep: &[(&str, &[&str])] = &[
        ("--nproc", &["0", "1.5", "100000", U64_OVER]),
        ("--min-bytes", &["0", "3", "5G", "1.5K"]),
        ("--max-bytes", &["0", "3", "5G", U64_OVER]),
        ("--iters", &["0", "1.5", "1000001"]),
        ("--warmup", &["1.5", "1000001"]),
    ];
    let subcommands = flag_table::subcommands(BIN);
    let mut covered = Vec::new();
    for op in ["allreduce", "all_gather", "reduce_scatter", "broadcast"] {
        Table {
            bin: BIN,
            lead: &[op],
            base: SWEEP_BASE,
            numeric: sweep,
            not_numeric: &["--backend"],
        }
        .check();
        covered.push(op);
    }
    Table {
        bin: BIN,
        lead: &["train"],
        base: TRAIN_BASE,
        numeric: &[
            ("--nproc", &["0", "1.5", "100000"]),
            ("--hidden", &["0", "65537"]),
            ("--layers", &["0", "1025"]),
            ("--batch", &["0", "65537"]),
            ("--steps", &["0", "1.5", "1000001"]),
            ("--warmup", &["1.5", "1000001"]),
            ("--bucket-cap-mb", &["0", "-0.5", "1048577"]),
            ("--zero", &["4", "1.5"]),
            ("--zero-keep-buckets", &["1.5", "1048577", U64_OVER]),
        ],
        not_numeric: &[
            "--backend",
            "--weight-layout",
            "--hook",
            "--backward-prefetch",
            "--optimizer",
            "--device",
            "--framework",
            "--trace",
        ],
    }
    .check();
    covered.push("train");
    Table {
        bin: BIN,
        lead: &["trace-cost"],
        base: &[("--spans", "1000"), ("--reps", "1")],
        numeric: &[
            ("--spans", &["0", "999", "1000001"]),
            ("--reps", &["0", "101"]),
        ],
        not_numeric: &[],
    }
    .check();
    covered.push("trace-cost");
    for c in &subcommands {
        assert!(
            covered.contains(&c.as_str()),
            "subcommand {c} has no table of its numeric flags"
        );
    }
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
