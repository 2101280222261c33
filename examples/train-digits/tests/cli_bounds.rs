//! Boundary values (0, 1, the type's maximum, negative, empty) for every numeric flag of
//! `train-digits`: no panic (e.g. `--hidden 0` used to panic inside `rand`), a clear error when
//! refused.

#[path = "../../../crates/ddprun/tests/common/cli_bounds.rs"]
mod cli_bounds;
mod flag_table;

use cli_bounds::{outcome, Binary, F64_MAX, U64_MAX};
use std::time::Duration;

#[test]
fn every_numeric_flag_at_its_bounds() {
    let bin = Binary {
        path: env!("CARGO_BIN_EXE_train-digits"),
        lead: &[],
        base: &[
            ("--nproc", "1"),
            ("--epochs", "1"),
            ("--max-steps", "1"),
            ("--log-every", "0"),
            ("--timeout-s", "30"),
        ],
        trail: &[],
        env: &[],
        limit: Duration::from_secs(120),
    };
    let all = bin.check_all(&[
        ("--nproc", U64_MAX),
        ("--epochs", U64_MAX),
        ("--batch-size", U64_MAX),
        ("--lr", F64_MAX),
        ("--momentum", F64_MAX),
        ("--seed", U64_MAX),
        ("--hidden", U64_MAX),
        ("--max-steps", U64_MAX),
        ("--timeout-s", U64_MAX),
        ("--log-every", U64_MAX),
        ("--metrics-every", U64_MAX),
        ("--scale-lr", U64_MAX),
    ]);
    for (flag, value) in [
        ("--hidden", "0"),
        ("--hidden", U64_MAX),
        ("--batch-size", "0"),
        ("--nproc", "0"),
        ("--nproc", U64_MAX),
        ("--lr", "0"),
        ("--lr", "-1"),
        ("--momentum", "-1"),
        ("--timeout-s", "0"),
        ("--timeout-s", U64_MAX),
    ] {
        let o = outcome(&all, flag, value);
        assert_eq!(o.code, Some(2), "{o:?}");
        assert!(o.stderr.contains(flag), "{o:?}");
    }
    for (flag, value) in [
        ("--hidden", "1"),
        ("--epochs", U64_MAX),
        ("--seed", U64_MAX),
    ] {
        let o = outcome(&all, flag, value);
        assert_eq!(o.code, Some(0), "{o:?}");
    }
}

const BIN: &str = env!("CARGO_BIN_EXE_train-digits");

/// Every numeric flag of `--help` has a row, and every value outside its bounds (non-finite,
/// not a number, negative, zero where zero means nothing, a fraction above 1) is refused with
/// exit status 2 and an error naming the flag and the value. `--target-accuracy 2` (or -1, nan)
/// used to be accepted.
#[test]
fn every_numeric_flag_in_help_refuses_values_outside_its_bounds() {
    use flag_table::{DIGITS_BASE, DIGITS_NUMERIC};
    let own: &[(&str, &[&str])] = &[
        ("--checkpoint-every", &["0", "1.5"]),
        ("--scale-lr", &["0", "1.5"]),
        ("--zero", &["4", "1.5"]),
        ("--metrics-every", &["0", "1.5"]),
    ];
    flag_table::Table {
        bin: BIN,
        lead: &[],
        base: DIGITS_BASE,
        numeric: &[DIGITS_NUMERIC, own].concat(),
        not_numeric: &[
            "--backend",
            "--optimizer",
            "--checkpoint-dir",
            "--checkpoint-async",
            "--backward",
            "--hook",
            "--device",
            "--trace",
            "--metrics",
            "--report",
        ],
    }
    .check();
    // The edges of the new bounds are accepted (one step of one rank each).
    let quick = [
        "--nproc",
        "1",
        "--epochs",
        "1",
        "--max-steps",
        "1",
        "--quiet",
    ];
    flag_table::digits_edges_accepted(BIN, &quick);
}

/// `--device cuda` in a build without the `cuda` feature: exit 2 at once, before any worker,
/// saying how to rebuild; an unknown device is a usage error naming it.
#[test]
fn device_flag_is_checked_before_any_worker_starts() {
    let run = |device: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_train-digits"))
            .args(["--device", device, "--nproc", "2", "--epochs", "1"])
            .output()
            .unwrap()
    };
    let o = run("gpu");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("unknown device 'gpu'"), "{err}");
    if cfg!(feature = "cuda") {
        return;
    }
    let o = run("cuda");
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("built without the `cuda` feature"), "{err}");
    assert!(err.contains("--features cuda -p train-digits"), "{err}");
    assert!(
        !err.contains("rank "),
        "refused before any worker started: {err}"
    );
}
