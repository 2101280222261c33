//! `ddprun --fault-tolerance` with real worker processes (small `sh` scripts): a worker that dies
//! is reported at once and the others go on; the job succeeds when the workers that failed did so
//! before the first one finished with status 0, and fails otherwise; `DDP_FAULT_TOLERANCE=1`
//! reaches the workers only when it is on.

mod common;

use common::*;
use std::process::Command;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(40);

/// Rank 2 SIGKILLs itself at once; ranks 0 and 1 sleep 1 s, then print `rank N done` and exit 0.
const RANK2_DIES: &str =
    "if [ \"$RANK\" = 2 ]; then kill -9 $$; fi; sleep 1; echo \"rank $RANK done\"";

/// `ddprun --nproc-per-node NPROC --master-port 0 FLAGS sh -c SCRIPT` with no
/// `DDP_FAULT_TOLERANCE` inherited from the test's environment.
fn command(nproc: usize, flags: &[&str], script: &str) -> Command {
    let mut c = sh_command(nproc, flags, script);
    c.env_remove("DDP_FAULT_TOLERANCE");
    c
}

fn finish(c: Command) -> Run {
    Running::start(c).finish(LIMIT)
}

fn done_lines(r: &Run) -> Vec<&str> {
    let mut got: Vec<&str> = r.stdout.lines().filter(|l| l.ends_with(" done")).collect();
    got.sort();
    got
}

#[test]
fn survivors_finish_after_a_worker_is_killed() {
    let r = finish(command(3, &["--fault-tolerance", "--"], RANK2_DIES));
    assert_eq!(r.code(), Some(0), "{r}");
    assert_eq!(
        done_lines(&r),
        ["[rank0]: rank 0 done", "[rank1]: rank 1 done"],
        "{r}"
    );
    let line = r
        .stderr
        .lines()
        .find(|l| l.starts_with("ddprun: worker rank 2 (pid "))
        .unwrap_or_else(|| panic!("no report of rank 2's failure:\n{r}"));
    assert!(
        line.ends_with(
            "failed: killed by signal 9 (SIGKILL); --fault-tolerance: the other 2 workers go on"
        ),
        "{line}\n{r}"
    );
    assert!(
        !r.stderr.contains("worker failure"),
        "no failure summary for a tolerated failure:\n{r}"
    );
}

#[test]
fn without_the_flag_a_killed_worker_stops_the_others() {
    let r = finish(command(3, &["--"], RANK2_DIES));
    assert_eq!(r.code(), Some(1), "{r}");
    assert!(done_lines(&r).is_empty(), "the others were stopped:\n{r}");
    assert!(r.stderr.contains("SIGKILL"), "{r}");
    assert!(!r.stderr.contains("--fault-tolerance:"), "{r}");
}

#[test]
fn a_failure_after_a_worker_finished_fails_the_job() {
    // Rank 2 dies at once (tolerated); rank 0 finishes with status 0 after 0.3 s; rank 1 then
    // exits with 3 after 1 s: not a job that finished on survivors.
    let script = "case $RANK in \
                    2) kill -9 $$ ;; \
                    0) sleep 0.3; echo 'rank 0 done' ;; \
                    1) sleep 1; echo 'rank 1 gives up' >&2; exit 3 ;; \
                  esac";
    let r = finish(command(3, &["--fault-tolerance", "--"], script));
    assert_eq!(r.code(), Some(1), "{r}");
    assert_eq!(done_lines(&r), ["[rank0]: rank 0 done"], "{r}");
    assert!(
        r.stderr
            .lines()
            .any(|l| l.starts_with("ddprun: worker rank 1 (pid ")
                && l.contains("failed: exit code 3; --fault-tolerance: no other worker")),
        "{r}"
    );
    // The summary: rank 2 is the root cause (the first failure), rank 1 failed too, rank 0 had
    // exited with status 0 before that.
    assert!(r.stderr.contains("worker failure"), "{r}");
    assert!(r.stderr.contains("rank 1 (local rank 1"), "{r}");
    assert!(r.stderr.contains("exit code 3"), "{r}");
    assert!(r.stderr.contains("Exited with status 0 before that"), "{r}");
    let root = r
        .stderr
        .split("Root cause (first failure):")
        .nth(1)
        .unwrap_or_else(|| panic!("no root cause:\n{r}"));
    assert!(root.trim_start().starts_with("rank       : 2"), "{r}");
}

#[test]
fn workers_get_the_variable_only_with_the_flag() {
    let script = "echo \"ft=$DDP_FAULT_TOLERANCE.\"";
    let r = finish(command(2, &["--fault-tolerance", "--"], script));
    assert_eq!(r.code(), Some(0), "{r}");
    let mut got = lines_with(&r.stdout, "[rank");
    got.sort();
    assert_eq!(got, ["[rank0]: ft=1.", "[rank1]: ft=1."], "{r}");

    let r = finish(command(2, &["--"], script));
    assert_eq!(r.code(), Some(0), "{r}");
    let mut got = lines_with(&r.stdout, "[rank");
    got.sort();
    assert_eq!(got, ["[rank0]: ft=.", "[rank1]: ft=."], "{r}");
}

#[test]
fn the_environment_variable_turns_it_on_and_off() {
    let mut c = command(3, &["--"], RANK2_DIES);
    c.env("DDP_FAULT_TOLERANCE", "1");
    let r = finish(c);
    assert_eq!(
        r.code(),
        Some(0),
        "DDP_FAULT_TOLERANCE=1 is --fault-tolerance:\n{r}"
    );
    assert_eq!(done_lines(&r).len(), 2, "{r}");

    let mut c = command(3, &["--"], RANK2_DIES);
    c.env("DDP_FAULT_TOLERANCE", "0");
    let r = finish(c);
    assert_eq!(r.code(), Some(1), "DDP_FAULT_TOLERANCE=0 is off:\n{r}");
    assert!(done_lines(&r).is_empty(), "{r}");
}
