//! Hierarchical groups on simulated hosts (threads with distinct host ids, `InitOptions::host_id`):
//! which backend `auto` picks, bit-identical all-reduce results, and failures reaching every
//! rank. The reference checks of every collective on such groups are in `collectives.rs`.

mod common;

use common::{assert_bit_identical, random_float_all_reduces, run_ranks_on_hosts};
use ddp_comm::{Error, ReduceOp};
use std::time::{Duration, Instant};

#[test]
fn auto_picks_the_topology_from_the_hosts_and_subgroups_pick_again() {
    let t = Duration::from_secs(30);
    let got = run_ranks_on_hosts(&[0, 1, 1, 0, 1], t, None, |pg| {
        let whole = (pg.topology().name(), pg.topology().to_string());
        // Subgroups: one host (shm), the two leaders (one rank per host: tcp), both hosts.
        let sub = |ranks: &[usize]| {
            pg.new_group(ranks)
                .unwrap()
                .map(|g| (g.topology().name(), g.topology().to_string()))
        };
        (whole, sub(&[1, 2, 4]), sub(&[0, 1]), sub(&[0, 1, 3]))
    });
    for (rank, (whole, one_host, leaders, both)) in got.into_iter().enumerate() {
        assert_eq!(
            whole,
            (
                "hierarchical",
                "hierarchical: 2 hosts x [2, 3] ranks, shm inside a host, tcp between".into()
            )
        );
        let on_host1 = [1, 2, 4].contains(&rank);
        assert_eq!(
            one_host,
            on_host1.then(|| ("shm", "shm: 3 ranks on one host".into()))
        );
        assert_eq!(
            leaders,
            (rank < 2).then(|| ("tcp", "tcp: 2 ranks, full mesh".into()))
        );
        assert_eq!(
            both.map(|b| b.0),
            [0, 1, 3].contains(&rank).then_some("hierarchical")
        );
    }
    let got = run_ranks_on_hosts(&[0, 1, 2], t, None, |pg| pg.topology().name());
    assert_eq!(got, ["tcp"; 3]);
}

/// Random (inexact) floats: the reduction order matters, and every rank must still end with
/// the same bits, for small (recursive doubling between leaders) and large (ring) messages.
#[test]
fn results_are_bit_identical_across_ranks_and_hosts() {
    let out = run_ranks_on_hosts(&[0, 1, 1, 0, 1], Duration::from_secs(60), None, |pg| {
        random_float_all_reduces(&pg)
    });
    assert_bit_identical(&out, "hosts [0, 1, 1, 0, 1]");
}

/// What every rank saw, by rank, when `culprit` misbehaves and leaves during an all-reduce:
/// `(error, time to fail)` (`None` for the culprit).
fn failures(
    timeout: Duration,
    culprit: usize,
    misbehave: impl Fn() + Send + Sync + 'static,
) -> Vec<Option<(Error, Duration)>> {
    run_ranks_on_hosts(&[0, 0, 1, 1], timeout, None, move |pg| {
        let mut v = vec![pg.rank() as f32; 100_000];
        pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        if pg.rank() == culprit {
            misbehave();
            drop(pg);
            return None;
        }
        let start = Instant::now();
        let e = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
        let elapsed = start.elapsed();
        // The group stays broken.
        let later = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
        assert!(matches!(later, Error::Aborted(_)), "{later}");
        Some((e, elapsed))
    })
}

#[test]
fn a_rank_leaving_fails_every_rank_with_a_named_error() {
    // Rank 3 (not a leader) leaves; its leader, rank 2, sees it on shared memory and aborts
    // both transports; rank 0 hears it over TCP and tells rank 1 through its host's segment.
    let out = failures(Duration::from_secs(30), 3, || {});
    for (rank, got) in out.iter().enumerate().take(3) {
        let (e, elapsed) = got.as_ref().unwrap();
        assert!(*elapsed < Duration::from_secs(10), "rank {rank}: {e}");
        assert!(matches!(e, Error::PeerFailed { .. }), "rank {rank}: {e}");
    }
    let (e, _) = out[2].as_ref().unwrap();
    let msg = e.to_string();
    assert!(matches!(e, Error::PeerFailed { peer: 3, .. }), "{msg}");
    assert!(
        msg.contains("left the group") && msg.contains("are group ranks [2, 3]"),
        "{msg}"
    );
}

#[test]
fn a_stalled_rank_times_out_on_every_rank() {
    // Rank 1 (not a leader) stalls past the timeout: rank 0 times out waiting on it and the
    // abort reaches host 1 through the TCP mesh.
    let timeout = Duration::from_secs(2);
    let out = failures(timeout, 1, move || std::thread::sleep(timeout * 3));
    for (rank, got) in out.iter().enumerate() {
        let Some((e, elapsed)) = got else { continue };
        assert!(*elapsed < timeout * 3, "rank {rank}: {e}");
        assert!(matches!(e, Error::PeerFailed { .. }), "rank {rank}: {e}");
    }
    let (e, _) = out[0].as_ref().unwrap();
    assert!(
        matches!(e, Error::PeerFailed { peer: 1, .. }) && e.to_string().contains("timeout"),
        "{e}"
    );
}
