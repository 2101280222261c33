//! Every numeric flag of `train-digits-burn`'s `--help` has a bound: values outside it
//! (non-finite, not a number, negative, zero where zero means nothing, a fraction above 1) are
//! refused with exit status 2 and an error naming the flag and the value.

#[path = "../../train-digits/tests/flag_table/mod.rs"]
mod flag_table;

use flag_table::U64_OVER;

const BIN: &str = env!("CARGO_BIN_EXE_train-digits-burn");

#[test]
fn every_numeric_flag_in_help_refuses_values_outside_its_bounds() {
    flag_table::Table {
        bin: BIN,
        lead: &[],
        base: &[
            ("--nproc", "1"),
            ("--epochs", "1"),
            ("--max-steps", "1"),
            ("--log-every", "0"),
        ],
        numeric: &[
            ("--nproc", &["0", "1.5", "100000", U64_OVER]),
            ("--epochs", &["0", "1.5", U64_OVER]),
            ("--batch-size", &["0", "1.5", U64_OVER]),
            ("--lr", &["0", "-0.001", "1e-400"]),
            ("--momentum", &["1", "1.5", "-0.1"]),
            ("--seed", &["1.5", U64_OVER]),
            ("--hidden", &["0", "65537"]),
            ("--max-steps", &["0", "1.5"]),
            ("--timeout-s", &["0", "31536001", "1.5"]),
            ("--log-every", &["1.5", U64_OVER]),
            ("--target-accuracy", &["2", "1.0000001", "-0.1", "-1e-9"]),
            ("--zero", &["3", "1.5"]),
        ],
        not_numeric: &["--backend", "--optimizer", "--checkpoint-dir", "--hook"],
    }
    .check();
    // The edges of the new bounds are accepted (one step of one rank each).
    let quick = ["--nproc", "1", "--epochs", "1", "--max-steps", "1"];
    for extra in [
        ["--target-accuracy", "0"],
        ["--target-accuracy", "1"],
        ["--momentum", "0.99"],
    ] {
        let args: Vec<&str> = quick.iter().chain(&extra).copied().collect();
        flag_table::accepted(BIN, &args);
    }
}
