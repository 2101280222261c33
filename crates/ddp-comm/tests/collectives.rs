//! Every collective, op and dtype against a sequential reference, over random sizes (0, 1, odd,
//! ≥ 4 MiB) and world sizes 1..=5, among threads with real TCP connections; and the same on
//! hierarchical groups (threads given distinct host ids: shared memory inside a simulated host,
//! TCP between).
//!
//! Inputs are small integers (exactly representable in every dtype, sums and products too), so
//! the reference can demand bit-exact equality whatever the reduction order.

mod common;

use common::{check_every_collective, run_ranks, run_ranks_on_hosts, run_ranks_with};
use ddp_comm::{ProcessGroup, ReduceOp};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Duration;

fn check_world(world: usize) {
    run_ranks(world, Duration::from_secs(60), check_group);
}

/// Ranks on simulated hosts (`hosts[rank]`): the group must be hierarchical.
fn check_hosts(hosts: &'static [usize]) {
    run_ranks_on_hosts(hosts, Duration::from_secs(60), None, |pg| {
        assert_eq!(pg.topology().name(), "hierarchical", "{}", pg.topology());
        check_group(pg);
    });
}

fn check_group(pg: ProcessGroup) {
    check_every_collective(&pg, 11 + pg.size() as u64);
}

#[test]
fn world_1_matches_reference() {
    check_world(1);
}

#[test]
fn world_2_matches_reference() {
    check_world(2);
}

#[test]
fn world_3_matches_reference() {
    check_world(3);
}

#[test]
fn world_4_matches_reference() {
    check_world(4);
}

#[test]
fn world_5_matches_reference() {
    check_world(5);
}

#[test]
fn hierarchical_2_plus_2_matches_reference() {
    check_hosts(&[0, 0, 1, 1]);
}

#[test]
fn hierarchical_2_plus_3_interleaved_matches_reference() {
    // host 0 = ranks {0, 3}, host 1 = ranks {1, 2, 4}: local numbering differs from the group's.
    check_hosts(&[0, 1, 1, 0, 1]);
}

#[test]
fn hierarchical_1_plus_2_matches_reference() {
    check_hosts(&[0, 1, 1]);
}

#[test]
fn forced_algorithms_agree_and_results_are_bit_identical_across_ranks() {
    use ddp_comm::algorithms::AllReduceAlgorithm;
    for algo in [
        AllReduceAlgorithm::Ring,
        AllReduceAlgorithm::RecursiveDoubling,
    ] {
        for world in [2, 3, 4] {
            let out = run_ranks_with(world, Duration::from_secs(30), Some(algo), move |pg| {
                let mut rng = StdRng::seed_from_u64(pg.rank() as u64);
                let mut v: Vec<f32> = (0..100_003).map(|_| rng.gen::<f32>() * 1e3).collect();
                pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                v
            });
            for r in 1..world {
                assert!(
                    out[r]
                        .iter()
                        .zip(&out[0])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "rank {r} differs"
                );
            }
        }
    }
}

#[test]
fn async_collectives_complete_in_issue_order() {
    run_ranks(3, Duration::from_secs(30), |pg| {
        let works: Vec<_> = (0..20)
            .map(|i| {
                pg.all_reduce_async(vec![(pg.rank() + i) as i64; 1000 * (i + 1)], ReduceOp::Sum)
            })
            .collect();
        let mut last_done = true;
        for (i, w) in works.into_iter().enumerate() {
            let v = w.wait().unwrap();
            assert!(last_done);
            assert!(v.iter().all(|&x| x == (3 * i + 3) as i64));
            last_done = true;
        }
    });
}

#[test]
fn subgroups_translate_ranks_and_run_their_own_collectives() {
    run_ranks(5, Duration::from_secs(30), |pg| {
        let evens = pg.new_group(&[4, 0, 2]).unwrap();
        let odds = pg.new_group(&[1, 3]).unwrap();
        let me = pg.rank();
        match (&evens, &odds) {
            (Some(g), None) => {
                assert_eq!(g.size(), 3);
                assert_eq!(g.global_rank(g.rank()), Some(me));
                assert_eq!(g.group_rank(4), Some(2));
                let mut v = [me as i32];
                g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert_eq!(v[0], 6);
            }
            (None, Some(g)) => {
                let mut v = [me as i32];
                g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
                assert_eq!(v[0], 4);
                assert_eq!(g.group_rank(2), None);
            }
            _ => panic!("rank {me} must be in exactly one subgroup"),
        }
        // the default group still works after subgroup traffic
        let mut v = [1i32];
        pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v[0], 5);
    });
}
