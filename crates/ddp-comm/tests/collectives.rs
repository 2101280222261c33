//! Every collective, op and dtype against a sequential reference, over random sizes (0, 1, odd,
//! ≥ 4 MiB) and world sizes 1..=5, among threads with real TCP connections; and the same on
//! hierarchical groups (threads given distinct host ids: shared memory inside a simulated host,
//! TCP between).
//!
//! Inputs are small integers (exactly representable in every dtype, sums and products too), so
//! the reference can demand bit-exact equality whatever the reduction order.

mod common;

use common::{
    assert_bit_identical, check_all, check_every_collective, run_ranks, run_ranks_on_hosts,
    run_ranks_with, sizes,
};
use ddp_comm::{ProcessGroup, ReduceOp};
use half::{bf16, f16};
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

/// The reference checker on every collective, op and dtype (sizes 0, 1 and 7 included: fewer
/// elements than ranks; the 4 MiB case is left to the unforced tests, for time) with the
/// all-reduce algorithm forced, then random floats whose sums must be bit-identical across ranks.
fn check_forced(algo: ddp_comm::algorithms::AllReduceAlgorithm) {
    for world in [2, 3, 5] {
        let out = run_ranks_with(world, Duration::from_secs(120), Some(algo), move |pg| {
            let seed = 40 + pg.size() as u64;
            check_all::<f32>(&pg, seed, &sizes(seed, false));
            check_all::<f64>(&pg, seed + 1, &sizes(seed + 1, false));
            check_all::<f16>(&pg, seed + 2, &sizes(seed + 2, false));
            check_all::<bf16>(&pg, seed + 3, &sizes(seed + 3, false));
            check_all::<i32>(&pg, seed + 4, &sizes(seed + 4, false));
            check_all::<i64>(&pg, seed + 5, &sizes(seed + 5, false));
            check_all::<u8>(&pg, seed + 6, &sizes(seed + 6, false));
            let mut rng = StdRng::seed_from_u64(pg.rank() as u64);
            let mut v: Vec<f32> = (0..100_003).map(|_| rng.gen::<f32>() * 1e3).collect();
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            vec![v.iter().map(|x| x.to_bits() as u64).collect()]
        });
        assert_bit_identical(&out, &format!("{algo:?} world {world}"));
    }
}

#[test]
fn forced_ring_matches_reference_and_is_bit_identical_across_ranks() {
    check_forced(ddp_comm::algorithms::AllReduceAlgorithm::Ring);
}

#[test]
fn forced_recursive_doubling_matches_reference_and_is_bit_identical_across_ranks() {
    check_forced(ddp_comm::algorithms::AllReduceAlgorithm::RecursiveDoubling);
}

/// Async collectives of decreasing size (a reordering engine would finish the small later ones
/// first), mixed kinds: at every moment the completed works form a prefix of the issue order.
#[test]
fn async_collectives_complete_in_issue_order() {
    run_ranks(3, Duration::from_secs(30), |pg| {
        let n = |i: usize| 4000 * (20 - i);
        let works: Vec<_> = (0..20)
            .map(|i| match i % 3 {
                0 => pg.all_reduce_async(vec![(pg.rank() + i) as i64; n(i)], ReduceOp::Sum),
                1 => pg.broadcast_async(vec![(pg.rank() + i) as i64; n(i)], i % 3),
                _ => pg.all_gather_async(vec![(pg.rank() + i) as i64; n(i) / 3]),
            })
            .collect();
        loop {
            let done: Vec<bool> = works.iter().map(|w| w.is_completed()).collect();
            let prefix = done.iter().take_while(|&&d| d).count();
            assert!(
                done[prefix..].iter().all(|&d| !d),
                "completed out of issue order: {done:?}"
            );
            if prefix == works.len() {
                break;
            }
            std::thread::yield_now();
        }
        for (i, w) in works.into_iter().enumerate() {
            let v = w.wait().unwrap();
            let want = match i % 3 {
                0 => vec![(3 * i + 3) as i64; n(i)],
                1 => vec![(1 + i) as i64; n(i)],
                _ => (0..3)
                    .flat_map(|r| vec![(r + i) as i64; n(i) / 3])
                    .collect(),
            };
            assert_eq!(v, want, "work {i}");
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
