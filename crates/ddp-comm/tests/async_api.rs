//! The documented async API beyond `all_reduce_async`: every `*_async` collective against the
//! reference, `Work::wait_timeout`, `Work::is_completed`, `pg.with_timeout`, errors naming the
//! sequence number, and two process groups with interleaved async operations.

mod common;

use common::{assert_same, input, reference, run_ranks};
use ddp_comm::{Error, ProcessGroup, ReduceOp};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(60);

/// The ten `*_async` collectives other than `all_reduce_async`, each against the reference.
fn check_async(pg: &ProcessGroup, case: u64) {
    let (rank, world) = (pg.rank(), pg.size());
    let n = 1001;
    let op = ReduceOp::Sum;
    let root = (case as usize) % world;
    let mine = || input::<f32>(case, rank, n, op);
    let all = |c: u64| -> Vec<f32> { (0..world).flat_map(|r| input::<f32>(c, r, n, op)).collect() };

    let got = pg.broadcast_async(mine(), root).wait().unwrap();
    assert_same("broadcast_async", &got, &input(case, root, n, op));

    let got = pg.reduce_async(mine(), ReduceOp::Max, root).wait().unwrap();
    let want = if rank == root {
        reference(case, world, n, ReduceOp::Max)
    } else {
        input(case, rank, n, ReduceOp::Max)
    };
    assert_same("reduce_async", &got, &want);

    let got = pg.all_gather_async(mine()).wait().unwrap();
    assert_same("all_gather_async", &got, &all(case));

    let full = input::<f32>(case, rank, n * world, op);
    let got = pg.reduce_scatter_async(full, op).wait().unwrap();
    let want = reference::<f32>(case, world, n * world, op);
    assert_same(
        "reduce_scatter_async",
        &got,
        &want[rank * n..(rank + 1) * n],
    );

    let got = pg.gather_async(mine(), root).wait().unwrap();
    match got {
        Some(v) => {
            assert_eq!(rank, root, "gather_async: a non-root got data");
            assert_same("gather_async", &v, &all(case));
        }
        None => assert_ne!(rank, root, "gather_async: the root got nothing"),
    }

    let src = (rank == root).then(|| input::<f32>(case + 1, root, n * world, op));
    let got = pg.scatter_async(src, n, root).wait().unwrap();
    let want = input::<f32>(case + 1, root, n * world, op);
    assert_same("scatter_async", &got, &want[rank * n..(rank + 1) * n]);

    let send = input::<f32>(case + 2, rank, n * world, op);
    let got = pg.all_to_all_async(send).wait().unwrap();
    let want: Vec<f32> = (0..world)
        .flat_map(|i| input::<f32>(case + 2, i, n * world, op)[rank * n..(rank + 1) * n].to_vec())
        .collect();
    assert_same("all_to_all_async", &got, &want);

    pg.barrier_async().wait().unwrap();

    // send_async / recv_async around the ring, both posted before either is waited on.
    let (next, prev) = ((rank + 1) % world, (rank + world - 1) % world);
    let (s, r) = if rank % 2 == 0 {
        let s = pg.send_async(mine(), next);
        (s, pg.recv_async::<f32>(n, prev))
    } else {
        let r = pg.recv_async::<f32>(n, prev);
        (pg.send_async(mine(), next), r)
    };
    assert_same("send_async returns the buffer", &s.wait().unwrap(), &mine());
    assert_same("recv_async", &r.wait().unwrap(), &input(case, prev, n, op));
}

#[test]
fn every_async_collective_matches_reference() {
    for world in [2, 3] {
        run_ranks(world, T, |pg| {
            for case in 0..3 {
                check_async(&pg, 300 + case);
            }
        });
    }
}

/// Rank 1 joins an all-reduce 1.5 s late: rank 0's work is pending meanwhile
/// (`is_completed` false, `wait_timeout` times out), and completes once rank 1 arrives.
#[test]
fn wait_timeout_and_is_completed_follow_a_late_peer() {
    run_ranks(2, T, |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        let early = pg.all_reduce_async(vec![1i32; 10], ReduceOp::Sum);
        let late = pg.all_reduce_async(vec![2i32; 10], ReduceOp::Sum);
        if pg.rank() == 0 {
            assert!(!early.is_completed() && !late.is_completed());
            let t0 = Instant::now();
            match early.wait_timeout(Duration::from_millis(200)) {
                Err(Error::Timeout { timeout, .. }) => {
                    assert_eq!(timeout, Duration::from_millis(200))
                }
                other => panic!("wait_timeout on a pending work: {other:?}"),
            }
            let waited = t0.elapsed();
            assert!(
                waited >= Duration::from_millis(200) && waited < Duration::from_millis(1000),
                "wait_timeout returned after {waited:?}"
            );
            assert!(!late.is_completed());
        } else {
            drop(early.wait().unwrap());
        }
        // The late work completes once the peer is there; poll is_completed until it does.
        let t0 = Instant::now();
        while !late.is_completed() {
            assert!(t0.elapsed() < Duration::from_secs(20), "never completed");
            std::thread::sleep(Duration::from_millis(5));
        }
        let v = late.wait_timeout(Duration::from_millis(1)).unwrap();
        assert_eq!(v, vec![4; 10]);
    });
}

/// A handle from `with_timeout` bounds its collectives by that timeout (not the group's), and
/// the error names the peer that did not come.
#[test]
fn with_timeout_bounds_a_collective_and_names_the_missing_peer() {
    let errs = run_ranks(2, T, |pg| {
        let short = pg.with_timeout(Duration::from_millis(500));
        assert_eq!(short.timeout(), Duration::from_millis(500));
        assert_eq!(
            pg.timeout(),
            T,
            "with_timeout must not change the original handle"
        );
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_secs(3));
            // Rank 0 gave up (its data may still sit in the socket): whatever this returns, it
            // must not hang.
            let t0 = Instant::now();
            let _ = short.all_reduce(&mut [1.0f32; 4], ReduceOp::Sum);
            assert!(t0.elapsed() < Duration::from_secs(10));
            return String::new();
        }
        let t0 = Instant::now();
        let e = short
            .all_reduce(&mut [1.0f32; 4], ReduceOp::Sum)
            .expect_err("rank 1 never came");
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(400) && took < Duration::from_millis(2500),
            "took {took:?}: {e}"
        );
        e.to_string()
    });
    assert!(errs[0].contains("rank 1"), "rank 0: {}", errs[0]);
}

/// Errors name the collective's sequence number: the mismatch is the 4th collective (#3).
#[test]
fn errors_name_the_sequence_number() {
    let errs = run_ranks(2, T, |pg| {
        for _ in 0..3 {
            pg.all_reduce(&mut [1i64; 3], ReduceOp::Sum).unwrap();
        }
        let n = 5 + pg.rank();
        let e = pg
            .all_reduce(&mut vec![1i64; n], ReduceOp::Sum)
            .expect_err("mismatched counts");
        e.to_string()
    });
    for (rank, e) in errs.iter().enumerate() {
        assert!(e.contains("#3"), "rank {rank}: {e}");
    }
}

/// Two groups over the same ranks (the default one and a subgroup of all ranks) with async
/// operations interleaved, waited in an order different from issue order.
#[test]
fn two_groups_with_interleaved_async_operations() {
    run_ranks(3, T, |pg| {
        let other = pg.new_group(&[0, 1, 2]).unwrap().unwrap();
        let r = pg.rank() as i64;
        let mut a = Vec::new();
        let mut b = Vec::new();
        for i in 0..10i64 {
            a.push(pg.all_reduce_async(vec![r + i; 5000], ReduceOp::Sum));
            b.push(other.all_gather_async(vec![r * 100 + i; 300]));
            a.push(pg.broadcast_async(vec![r - i; 200], (i % 3) as usize));
            b.push(other.all_reduce_async(vec![r * i; 7000], ReduceOp::Max));
        }
        for (k, w) in b.into_iter().enumerate().rev() {
            let i = (k / 2) as i64;
            let v = w.wait().unwrap();
            if k % 2 == 0 {
                let want: Vec<i64> = (0..3).flat_map(|q| vec![q * 100 + i; 300]).collect();
                assert_eq!(v, want, "group b work {k}");
            } else {
                assert!(v.iter().all(|&x| x == 2 * i), "group b work {k}");
            }
        }
        for (k, w) in a.into_iter().enumerate() {
            let i = (k / 2) as i64;
            let v = w.wait().unwrap();
            let want = if k % 2 == 0 { 3 + 3 * i } else { (i % 3) - i };
            assert!(v.iter().all(|&x| x == want), "group a work {k}");
        }
    });
}

/// `chain_async`: a chain's collectives run one after the other, each with what the previous
/// one returned, and before a collective issued after the chain, even when one rank computes
/// slowly between them (the later collective has another length: running it out of order
/// would fail its fingerprint check). An error returned by the chain goes to its work and
/// leaves the group usable.
#[test]
fn chained_collectives_run_in_order_before_later_ones() {
    for world in [2, 3] {
        run_ranks(world, T, move |pg| {
            let (rank, n) = (pg.rank(), 257);
            let a = input::<f32>(7, rank, n, ReduceOp::Sum);
            let chain = pg.chain_async("test chain", move |c| {
                let mut a = a;
                c.all_reduce(&mut a, ReduceOp::Sum)?;
                if c.rank() == 1 {
                    std::thread::sleep(Duration::from_millis(100));
                }
                let mut b: Vec<f32> = a.iter().map(|s| 2.0 * s + c.rank() as f32).collect();
                c.all_reduce(&mut b, ReduceOp::Sum)?;
                Ok((a, b))
            });
            let later = pg.all_reduce_async(vec![rank as f64; 3], ReduceOp::Sum);
            let (a, b) = chain.wait().unwrap();
            let sum = reference::<f32>(7, world, n, ReduceOp::Sum);
            assert_same("chain: first all_reduce", &a, &sum);
            let ranks = (0..world).sum::<usize>() as f32;
            let want: Vec<f32> = a.iter().map(|s| 2.0 * s * world as f32 + ranks).collect();
            assert_same("chain: second all_reduce", &b, &want);
            assert_eq!(later.wait().unwrap(), vec![ranks as f64; 3]);

            let failed = pg.chain_async("failing chain", |_| -> ddp_comm::Result<()> {
                Err(Error::InvalidArgument("no such thing".into()))
            });
            let err = failed.wait().unwrap_err().to_string();
            assert!(err.contains("no such thing"), "{err}");
            let mut x = [1i32];
            pg.all_reduce(&mut x, ReduceOp::Sum).unwrap();
            assert_eq!(x[0], world as i32);
        });
    }
}
