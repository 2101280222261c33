//! `ddprun`'s output prefixing under stress: many ranks writing long lines (longer than a pipe's
//! atomic write) at once, on stdout and stderr. Every console line must be exactly one line of
//! one rank, with that rank's prefix.

mod common;

use common::*;
use std::time::Duration;

const RANKS: usize = 8;
const LINES: usize = 150;
const LEN: usize = 9000; // > PIPE_BUF (4096): the kernel may split each write

/// Every line of `text` is `[rankR]: R I <LEN times R>`; each rank's `I` run 0..LINES in order.
fn check_stream(text: &str, what: &str) {
    let mut next = [0usize; RANKS];
    for (n, line) in text.lines().enumerate() {
        let bad = || format!("{what} line {n} is mixed or cut: {:.120}...", line);
        let rest = line
            .strip_prefix("[rank")
            .unwrap_or_else(|| panic!("{}", bad()));
        let (rank, rest) = rest
            .split_once("]: ")
            .unwrap_or_else(|| panic!("{}", bad()));
        let r: usize = rank.parse().unwrap_or_else(|_| panic!("{}", bad()));
        let mut parts = rest.splitn(3, ' ');
        assert_eq!(parts.next(), Some(rank), "{}", bad());
        assert_eq!(
            parts.next(),
            Some(next[r].to_string().as_str()),
            "{}",
            bad()
        );
        let body = parts.next().unwrap_or_else(|| panic!("{}", bad()));
        let ch = rank.chars().next().unwrap();
        assert!(
            body.len() == LEN && body.chars().all(|c| c == ch),
            "{}",
            bad()
        );
        next[r] += 1;
    }
    assert_eq!(next, [LINES; RANKS], "{what}: lines per rank");
}

#[test]
fn long_lines_of_many_ranks_never_mix() {
    // Each rank builds one long line of its digit, then prints it LINES times to stdout and to
    // stderr, numbered.
    let script = format!(
        "L=$(head -c {LEN} /dev/zero | tr '\\0' \"$RANK\"); i=0; \
         while [ $i -lt {LINES} ]; do echo \"$RANK $i $L\"; echo \"$RANK $i $L\" >&2; \
         i=$((i+1)); done"
    );
    let r = run_sh(RANKS, &[], &script, Duration::from_secs(120));
    assert_eq!(r.code(), Some(0), "exit: {:?}", r.code());
    check_stream(&r.stdout, "stdout");
    // stderr also carries the launcher's own messages: keep the workers' lines.
    let worker_err: String = r
        .stderr
        .lines()
        .filter(|l| l.starts_with("[rank"))
        .map(|l| format!("{l}\n"))
        .collect();
    check_stream(&worker_err, "stderr");
}
