//! Boundary values (0, 1, the type's maximum, negative, empty) for every numeric flag of `ddprun`
//! and `ddp-allreduce-check`: no panic, a clear error when refused.

#[path = "common/cli_bounds.rs"]
mod cli_bounds;

use cli_bounds::{outcome, Binary, F64_MAX, U16_MAX, U32_MAX, U64_MAX};
use std::time::Duration;

#[test]
fn ddprun_flags_at_their_bounds() {
    let ddprun = Binary {
        path: env!("CARGO_BIN_EXE_ddprun"),
        lead: &[],
        base: &[("--master-port", "0"), ("--rdzv-timeout", "5")],
        trail: &["true"],
        env: &[],
        limit: Duration::from_secs(60),
    };
    let all = ddprun.check_all(&[
        ("--nproc-per-node", U64_MAX),
        ("--nnodes", U64_MAX),
        ("--node-rank", U64_MAX),
        ("--master-port", U16_MAX),
        ("--rdzv-timeout", F64_MAX),
        ("--max-restarts", U32_MAX),
        ("--monitor-interval", F64_MAX),
        ("--stop-grace-period", F64_MAX),
        ("--rdzv-last-call", F64_MAX),
        ("--heartbeat-timeout", F64_MAX),
        ("--local-ranks-filter", U64_MAX),
        ("--redirects", U64_MAX),
        ("--tee", U64_MAX),
    ]);
    let o = outcome(&all, "--nproc-per-node", U64_MAX);
    assert_eq!(o.code, Some(2), "{o:?}");
    assert!(o.stderr.contains("at most 4096"), "{o:?}");
    let o = outcome(&all, "--stop-grace-period", F64_MAX);
    assert!(o.stderr.contains("more than a year"), "{o:?}");
    assert_eq!(outcome(&all, "--nproc-per-node", "1").code, Some(0));
    assert_eq!(outcome(&all, "--max-restarts", U32_MAX).code, Some(0));
}

#[test]
fn allreduce_check_flags_at_their_bounds() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let env = [
        ("RANK", "0".to_string()),
        ("WORLD_SIZE", "1".to_string()),
        ("MASTER_ADDR", "127.0.0.1".to_string()),
        ("MASTER_PORT", port.to_string()),
    ];
    let check = Binary {
        path: env!("CARGO_BIN_EXE_ddp-allreduce-check"),
        lead: &[],
        base: &[("--elements", "16"), ("--timeout", "10")],
        trail: &[],
        env: &env,
        limit: Duration::from_secs(60),
    };
    let all = check.check_all(&[
        ("--elements", U64_MAX),
        ("--timeout", U64_MAX),
        ("--fail-rank", U64_MAX),
        ("--fail-attempt", U32_MAX),
    ]);
    for (flag, value) in [
        ("--elements", "0"),
        ("--elements", U64_MAX),
        ("--timeout", "0"),
    ] {
        let o = outcome(&all, flag, value);
        assert_eq!(o.code, Some(2), "{o:?}");
        assert!(o.stderr.contains(flag), "{o:?}");
    }
    assert_eq!(outcome(&all, "--fail-rank", U64_MAX).code, Some(2));
    assert_eq!(outcome(&all, "--fail-attempt", U32_MAX).code, Some(0));
}
