//! Every numeric flag of `train-digits-burn`'s `--help` has a bound: values outside it
//! (non-finite, not a number, negative, zero where zero means nothing, a fraction above 1) are
//! refused with exit status 2 and an error naming the flag and the value.

#[path = "../../train-digits/tests/flag_table/mod.rs"]
mod flag_table;

use flag_table::{DIGITS_BASE, DIGITS_NUMERIC};

const BIN: &str = env!("CARGO_BIN_EXE_train-digits-burn");

#[test]
fn every_numeric_flag_in_help_refuses_values_outside_its_bounds() {
    let own: &[(&str, &[&str])] = &[("--zero", &["3", "1.5"])];
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
            "--hook",
        ],
    }
    .check();
    // The edges of the new bounds are accepted (one step of one rank each).
    let quick = ["--nproc", "1", "--epochs", "1", "--max-steps", "1"];
    flag_table::digits_edges_accepted(BIN, &quick);
}
