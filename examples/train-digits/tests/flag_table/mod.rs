//! A table of every numeric flag of a binary with the values it must refuse, checked against the
//! binary's own `--help`: every flag there that takes a value has a row (numeric) or is named as
//! not numeric, so a flag added without a bound fails the test that uses this table. Each bad
//! value must be refused at parse time: exit status 2, the flag and the value named on stderr.
//! Shared by the `numeric_flags` tests of `train-digits`, `train-digits-burn` and `ddp-bench`
//! (included with `#[path]`).
#![allow(dead_code)]

use std::process::{Command, Output};

/// Values no numeric flag of ours accepts: not a number, non-finite, overflowing to infinity,
/// negative, empty.
pub const ALWAYS_BAD: &[&str] = &["nan", "NaN", "inf", "-inf", "1e400", "-1", "", "abc"];

/// One past `u64::MAX`.
pub const U64_OVER: &str = "18446744073709551616";

/// A flag of `--help`: its name and whether it takes a value; its `[default: ...]` if any.
#[derive(Debug, Clone, PartialEq)]
pub struct HelpFlag {
    pub name: String,
    pub takes_value: bool,
    pub default: Option<String>,
}

/// The output of `bin args...` (no worker environment: a launcher would start workers).
pub fn run(bin: &str, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("LOCAL_RANK")
        .output()
        .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"))
}

/// The flags of `bin lead... --help` (clap's long help: a flag's line is indented by at most 6
/// spaces and starts with `-`; its description, indented further, may hold `[default: X]`).
pub fn help_flags(bin: &str, lead: &[&str]) -> Vec<HelpFlag> {
    let mut args = lead.to_vec();
    args.push("--help");
    let o = run(bin, &args);
    assert_eq!(o.status.code(), Some(0), "{bin} {args:?}");
    let help = String::from_utf8(o.stdout).unwrap();
    let mut flags: Vec<HelpFlag> = Vec::new();
    for line in help.lines() {
        let indent = line.len() - line.trim_start().len();
        let t = line.trim_start();
        if indent <= 6 && t.starts_with('-') {
            let Some(long) = t.split_whitespace().find(|w| w.starts_with("--")) else {
                continue;
            };
            flags.push(HelpFlag {
                name: long.trim_end_matches(',').to_string(),
                takes_value: t.contains(" <") || t.contains(" [<"),
                default: None,
            });
        } else if let (Some(f), Some(i)) = (flags.last_mut(), t.find("[default: ")) {
            let rest = &t[i + "[default: ".len()..];
            f.default = rest.split(']').next().map(str::to_string);
        }
    }
    assert!(flags.len() > 2, "no flags found in {bin} {args:?}:\n{help}");
    flags
}

/// The subcommands of `bin --help` (the `Commands:` section), `help` left out.
pub fn subcommands(bin: &str) -> Vec<String> {
    let o = run(bin, &["--help"]);
    let help = String::from_utf8(o.stdout).unwrap();
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(str::to_string)
        .collect()
}

/// One binary (or subcommand) under test.
pub struct Table<'a> {
    pub bin: &'a str,
    /// Arguments that come first (a subcommand).
    pub lead: &'a [&'a str],
    /// Quick values of other flags, so that a value wrongly accepted ends a short run instead of
    /// the default one (left out for the flag under test).
    pub base: &'a [(&'a str, &'a str)],
    /// Every numeric flag and the values it must refuse besides [`ALWAYS_BAD`].
    pub numeric: &'a [(&'a str, &'a [&'a str])],
    /// The flags that take a value that is not a number (paths, names, specs).
    pub not_numeric: &'a [&'a str],
}

impl Table<'_> {
    /// The table matches `--help`, and every bad value is refused with exit status 2 and an
    /// error naming the flag and the value.
    pub fn check(&self) {
        let who = format!("{} {}", self.bin, self.lead.join(" "));
        let help = help_flags(self.bin, self.lead);
        let in_table =
            |f: &str| self.numeric.iter().any(|r| r.0 == f) || self.not_numeric.contains(&f);
        for f in help.iter().filter(|f| f.takes_value) {
            assert!(
                in_table(&f.name),
                "{who}: {} takes a value but has no row: add its bad values to the table \
                 (numeric) or name it as not numeric",
                f.name
            );
        }
        for f in &help {
            let numeric_default = f
                .default
                .as_deref()
                .is_some_and(|d| d.parse::<f64>().is_ok());
            if numeric_default {
                assert!(
                    self.numeric.iter().any(|r| r.0 == f.name),
                    "{who}: {} has a numeric default ({:?}) but no numeric row",
                    f.name,
                    f.default
                );
            }
        }
        for (flag, _) in self.numeric {
            assert!(
                help.iter().any(|f| f.name == *flag && f.takes_value),
                "{who}: the table's {flag} is not a flag with a value in --help"
            );
        }
        for &(flag, extra) in self.numeric {
            for &value in ALWAYS_BAD.iter().chain(extra) {
                let mut args: Vec<&str> = self.lead.to_vec();
                for (f, v) in self.base.iter().filter(|(f, _)| f != &flag) {
                    args.extend([*f, *v]);
                }
                // `--flag=value`: a value starting with `-` is the flag's value, not a flag.
                let arg = format!("{flag}={value}");
                args.push(&arg);
                let o = run(self.bin, &args);
                let err = String::from_utf8_lossy(&o.stderr);
                assert_eq!(
                    o.status.code(),
                    Some(2),
                    "{who}: {flag} {value:?} was not refused:\n{err}"
                );
                assert!(
                    err.contains(flag) && err.contains(&format!("'{value}'")) || value.is_empty(),
                    "{who}: {flag} {value:?}: the error names neither the flag nor the value:\n{err}"
                );
                assert!(err.contains(flag), "{who}: {flag} {value:?}:\n{err}");
            }
        }
    }
}

/// `bin args...` exits 0 (a bound that is not too tight).
pub fn accepted(bin: &str, args: &[&str]) {
    let o = run(bin, args);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{bin} {args:?} was refused or failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Quick values of the flags `train-digits` and `train-digits-burn` share
/// (`ddp_example_support::flags::CommonArgs`): one epoch, one step, one worker, no progress.
pub const DIGITS_BASE: &[(&str, &str)] = &[
    ("--nproc", "1"),
    ("--epochs", "1"),
    ("--max-steps", "1"),
    ("--log-every", "0"),
];

/// The rows of the numeric flags `train-digits` and `train-digits-burn` share
/// (`ddp_example_support::flags::CommonArgs`).
pub const DIGITS_NUMERIC: &[(&str, &[&str])] = &[
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
];

/// The edges of the shared bounds are accepted (one step of one rank each, `quick` the
/// arguments that make it so).
pub fn digits_edges_accepted(bin: &str, quick: &[&str]) {
    for extra in [
        ["--target-accuracy", "0"],
        ["--target-accuracy", "1"],
        ["--momentum", "0.99"],
    ] {
        let args: Vec<&str> = quick.iter().chain(&extra).copied().collect();
        accepted(bin, &args);
    }
}
