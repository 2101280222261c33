//! The root-cause summary printed when workers fail: which rank failed first (local rank, node,
//! host, pid), how (exit code or signal name), when, and the last lines of its stderr; then any
//! other ranks that failed on their own before the launcher stopped the group.

use crate::process::describe_status;
use std::fmt::Write;
use std::process::ExitStatus;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// One failed worker, as the summary reports it.
#[derive(Debug, Clone)]
pub struct Failure {
    pub rank: usize,
    pub local_rank: usize,
    pub node_rank: usize,
    pub host: String,
    pub pid: i32,
    pub status: ExitStatus,
    pub at: SystemTime,
    pub started: SystemTime,
    pub stderr_tail: Vec<String>,
}

impl Failure {
    /// `rank 3 (local rank 1 on node 1, host h): exit code 3`
    pub fn one_line(&self) -> String {
        format!(
            "rank {} (local rank {} on node {}, host {}): {}",
            self.rank,
            self.local_rank,
            self.node_rank,
            self.host,
            describe_status(&self.status)
        )
    }
}

/// Context of the summary: which job and attempt.
pub struct SummaryContext<'a> {
    pub run_id: &'a str,
    pub attempt: u32,
    pub max_restarts: u32,
    /// What happens next, e.g. `restarting the worker group (attempt 1 of at most 1 restart)`.
    pub next: &'a str,
}

/// The full multi-line summary; `failures[0]` is the root cause. Entries with a successful
/// status are ranks that exited with status 0 before the failure (listed apart: a rank that
/// returns while its peers still wait for it in a collective or the rendezvous makes them fail).
pub fn format_summary(ctx: &SummaryContext<'_>, all: &[Failure]) -> String {
    let (early, failed): (Vec<Failure>, Vec<Failure>) =
        all.iter().cloned().partition(|f| f.status.success());
    let failures = &failed[..];
    let mut s = String::new();
    let rule = "=".repeat(72);
    let _ = writeln!(s, "{rule}");
    let _ = writeln!(
        s,
        "ddprun: worker failure (run id {}, attempt {}, max restarts {})",
        ctx.run_id, ctx.attempt, ctx.max_restarts
    );
    if let Some(root) = failures.first() {
        let ran_for = root.at.duration_since(root.started).unwrap_or_default();
        let _ = writeln!(s, "Root cause (first failure):");
        let _ = writeln!(s, "  rank       : {}", root.rank);
        let _ = writeln!(s, "  local rank : {}", root.local_rank);
        let _ = writeln!(s, "  node       : {}", root.node_rank);
        let _ = writeln!(s, "  host       : {}", root.host);
        let _ = writeln!(s, "  pid        : {}", root.pid);
        let _ = writeln!(
            s,
            "  error      : {}{}",
            describe_status(&root.status),
            hint(&root.status)
        );
        let _ = writeln!(
            s,
            "  time       : {} (after {:.1}s)",
            format_utc(root.at),
            ran_for.as_secs_f64()
        );
        if root.stderr_tail.is_empty() {
            let _ = writeln!(s, "  stderr     : (nothing written)");
        } else {
            let _ = writeln!(s, "  last {} stderr lines:", root.stderr_tail.len());
            for l in &root.stderr_tail {
                let _ = writeln!(s, "    [rank{}]: {l}", root.rank);
            }
        }
    }
    if failures.len() > 1 {
        let _ = writeln!(s, "Other failures (before the group was stopped):");
        let shown = ddp_comm::env::LIST_SHOWN;
        for f in failures[1..].iter().take(shown) {
            let _ = writeln!(s, "  {} at {}", f.one_line(), format_utc(f.at));
        }
        if failures.len() - 1 > shown {
            let _ = writeln!(s, "  ... and {} more", failures.len() - 1 - shown);
        }
    }
    if !early.is_empty() {
        let _ = writeln!(
            s,
            "Exited with status 0 before that (ranks still waiting for them fail):"
        );
        let shown = ddp_comm::env::LIST_SHOWN;
        for f in early.iter().take(shown) {
            let _ = writeln!(s, "  {} at {}", f.one_line(), format_utc(f.at));
        }
        if early.len() > shown {
            let _ = writeln!(s, "  ... and {} more", early.len() - shown);
        }
    }
    if !ctx.next.is_empty() {
        let _ = writeln!(s, "{}", ctx.next);
    }
    let _ = write!(s, "{rule}");
    s
}

fn hint(status: &ExitStatus) -> &'static str {
    use std::os::unix::process::ExitStatusExt;
    match status.signal() {
        Some(libc::SIGKILL) => " (killed from outside: out of memory? see `dmesg`)",
        Some(libc::SIGSEGV) | Some(libc::SIGBUS) => " (memory fault in the worker)",
        Some(libc::SIGABRT) => " (aborted: a Rust panic with panic=abort, or a failed assertion)",
        _ => "",
    }
}

/// `2024-05-01T12:34:56.789Z`: UTC, without a date-time dependency.
pub fn format_utc(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let secs = d.as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (y, m, dd) = civil_from_days(days as i64);
    format!(
        "{y:04}-{m:02}-{dd:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        d.subsec_millis()
    )
}

/// Days since 1970-01-01 → (year, month, day), Howard Hinnant's algorithm.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn utc_dates() {
        assert_eq!(format_utc(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        let t = UNIX_EPOCH + Duration::from_millis(951_782_400_123); // leap day 2000
        assert_eq!(format_utc(t), "2000-02-29T00:00:00.123Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(format_utc(t), "2023-11-14T22:13:20.000Z");
    }

    #[test]
    fn summary_names_root_cause() {
        let f = Failure {
            rank: 3,
            local_rank: 1,
            node_rank: 1,
            host: "hostA".into(),
            pid: 42,
            status: ExitStatus::from_raw(libc::SIGSEGV),
            at: UNIX_EPOCH + Duration::from_secs(10),
            started: UNIX_EPOCH + Duration::from_secs(4),
            stderr_tail: vec!["boom".into()],
        };
        let mut g = f.clone();
        g.rank = 2;
        g.status = ExitStatus::from_raw(7 << 8);
        let ctx = SummaryContext {
            run_id: "r",
            attempt: 0,
            max_restarts: 0,
            next: "giving up",
        };
        let s = format_summary(&ctx, &[f, g]);
        assert!(s.contains("rank       : 3"), "{s}");
        assert!(s.contains("signal SIGSEGV (11)"), "{s}");
        assert!(s.contains("after 6.0s"), "{s}");
        assert!(s.contains("    [rank3]: boom"), "{s}");
        assert!(
            s.contains("rank 2 (local rank 1 on node 1, host hostA): exit code 7"),
            "{s}"
        );
        assert!(s.contains("giving up"));
    }
}
