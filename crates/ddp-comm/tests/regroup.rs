//! In-place regrouping over real TCP groups, one thread per rank: a lost rank (its group
//! dropped, so its sockets close as a killed process's do), a newcomer, a late survivor, a
//! membership below the minimum.

use ddp_comm::process_group::{join_process_group, RegroupOptions, Regrouped};
use ddp_comm::testing::run_with_store;
use ddp_comm::{init_process_group, Backend, Error, InitOptions, ProcessGroup, ReduceOp};
use std::sync::Barrier;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(30);

fn group(store: std::sync::Arc<dyn ddp_comm::Store>, rank: usize, world: usize) -> ProcessGroup {
    let mut opts = InitOptions::with_store(store, rank, world);
    opts.timeout = TIMEOUT;
    opts.backend = Some(Backend::Tcp);
    init_process_group(opts).unwrap()
}

fn window(ms: u64) -> RegroupOptions {
    RegroupOptions {
        window: Duration::from_millis(ms),
        min_size: 1,
    }
}

/// The sum over the group of `rank + 1`, as f64.
fn rank_sum(pg: &ProcessGroup) -> f64 {
    let mut v = [pg.rank() as f64 + 1.0; 5];
    pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    assert!(v.iter().all(|&x| x == v[0]));
    v[0]
}

#[test]
fn survivors_of_a_lost_rank_regroup_at_once_and_keep_their_order() {
    // A long window: the survivors must close the membership early because the failure names
    // the lost rank, not because the window passed.
    let out = run_with_store(3, TIMEOUT, |rank, store| {
        let pg = group(store, rank, 3);
        assert_eq!(rank_sum(&pg), 6.0);
        if rank == 2 {
            drop(pg); // its sockets close, as a killed process's would
            return None;
        }
        let mut v = vec![1.0f32; 1 << 16];
        let err = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
        // A survivor sees rank 2 gone, or the other survivor's abort (which names it too).
        assert!(
            err.lost_peer().is_none_or(|p| p == 2) && err.to_string().contains("rank 2"),
            "rank {rank}: {err}"
        );
        let t = Instant::now();
        let r: Regrouped = pg.regroup(Some(&err), &window(20_000)).unwrap();
        let took = t.elapsed();
        drop(pg);
        assert!(took < Duration::from_secs(10), "waited {took:?}");
        assert_eq!(r.group.rank(), rank);
        assert_eq!(r.group.size(), 2);
        assert_eq!(r.generation, 1);
        assert_eq!(r.group.generation(), 1);
        assert_eq!(r.survivors, vec![0, 1]);
        assert_eq!(r.lost, vec![2]);
        assert_eq!(r.joined, 0);
        assert_eq!(r.previous_rank, Some(rank));
        Some(rank_sum(&r.group))
    });
    assert_eq!(out, vec![Some(3.0), Some(3.0), None]);
}

#[test]
fn a_newcomer_joins_at_a_step_boundary_and_is_numbered_last() {
    let out = run_with_store(3, TIMEOUT, |rank, store| {
        if rank == 2 {
            let mut opts = InitOptions::with_store(store, 0, 1);
            opts.timeout = TIMEOUT;
            opts.backend = Some(Backend::Tcp);
            let r = join_process_group(opts, &window(5_000)).unwrap();
            assert_eq!((r.group.rank(), r.group.size()), (2, 3));
            assert_eq!(r.previous_rank, None);
            assert_eq!(r.joined, 1);
            return (rank_sum(&r.group), 0);
        }
        let pg = group(store, rank, 2);
        let mut steps = 0;
        // Steps go on until the group sees the newcomer (every rank the same answer).
        while !pg.joiners_waiting().unwrap() {
            assert_eq!(rank_sum(&pg), 3.0);
            steps += 1;
            std::thread::sleep(Duration::from_millis(5));
        }
        let t = Instant::now();
        let r = pg.regroup(None, &window(20_000)).unwrap();
        // Everyone expected arrived: no waiting out the window.
        assert!(t.elapsed() < Duration::from_secs(10));
        assert_eq!((r.group.rank(), r.group.size()), (rank, 3));
        assert_eq!(r.survivors, vec![0, 1]);
        assert!(r.lost.is_empty());
        (rank_sum(&r.group), steps)
    });
    assert_eq!(out[0].0, 6.0);
    assert_eq!(out[1].0, 6.0);
    assert_eq!(out[2].0, 6.0);
    assert_eq!(
        out[0].1, out[1].1,
        "both members saw the newcomer at the same step"
    );
}

#[test]
fn a_survivor_arriving_after_the_window_is_excluded_with_a_clear_error() {
    let barrier = Barrier::new(3);
    let out = run_with_store(3, TIMEOUT, |rank, store| {
        let pg = group(store, rank, 3);
        barrier.wait();
        if rank == 2 {
            // Alive but late (e.g. cut off for a while): the others have moved on.
            std::thread::sleep(Duration::from_millis(1500));
        }
        let r = pg.regroup(None, &window(200));
        match r {
            Ok(r) => {
                assert_eq!(r.lost, vec![2]);
                Ok(rank_sum(&r.group))
            }
            Err(e) => Err(e),
        }
    });
    assert_eq!(out[0].as_ref().unwrap(), &3.0);
    assert_eq!(out[1].as_ref().unwrap(), &3.0);
    let err = out[2].as_ref().unwrap_err();
    assert!(
        matches!(err, Error::Excluded { generation: 1, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains("after the new membership closed"),
        "{err}"
    );
}

#[test]
fn a_membership_below_the_minimum_fails_every_arrived_process() {
    let out = run_with_store(3, TIMEOUT, |rank, store| {
        let pg = group(store, rank, 3);
        assert_eq!(rank_sum(&pg), 6.0);
        if rank == 2 {
            drop(pg);
            return None;
        }
        let mut v = vec![1.0f32; 1 << 16];
        let err = pg.all_reduce(&mut v, ReduceOp::Sum).unwrap_err();
        let opts = RegroupOptions {
            window: Duration::from_millis(200),
            min_size: 3,
        };
        Some(pg.regroup(Some(&err), &opts).unwrap_err().to_string())
    });
    for msg in out.into_iter().flatten() {
        assert!(msg.contains("fewer than the minimum of 3"), "{msg}");
    }
}

#[test]
fn a_group_regroups_twice_and_subgroups_refuse() {
    let out = run_with_store(3, TIMEOUT, |rank, store| {
        let pg = group(store, rank, 3);
        let sub = pg.new_group(&[0, 1, 2]).unwrap().unwrap();
        let err = sub.regroup(None, &window(100)).unwrap_err();
        assert!(err.to_string().contains("subgroup"), "{err}");
        let r1 = pg.regroup(None, &window(5_000)).unwrap();
        drop((pg, sub));
        let r2 = r1.group.regroup(None, &window(5_000)).unwrap();
        assert_eq!(r2.generation, 2);
        rank_sum(&r2.group)
    });
    assert_eq!(out, vec![6.0; 3]);
}
