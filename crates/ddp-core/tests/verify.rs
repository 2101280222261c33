//! Verification helpers over real collectives among threads (one TCP process group per rank):
//! replica comparison, shard disjointness with real `DistributedSampler` shards, and the overlap
//! meter fed by a real `Reducer`.

use ddp_comm::testing::{run_local_group, LocalGroup};
use ddp_comm::{DType, ProcessGroup};
use ddp_core::reducer::{ParamSpec, Reducer, ReducerOptions};
use ddp_core::{verify_disjoint_shards, verify_replicas, DistributedSampler, OverlapMeter};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(20);

/// Runs `f(pg)` on `world` threads, each with its own TCP process group; results by rank.
fn run_ranks<R: Send>(world: usize, f: impl Fn(ProcessGroup) -> R + Sync) -> Vec<R> {
    run_local_group(
        world,
        LocalGroup {
            timeout: TIMEOUT,
            ..Default::default()
        },
        f,
    )
}

fn all_equal<T: PartialEq + std::fmt::Debug>(v: &[T]) -> &T {
    for (r, x) in v.iter().enumerate() {
        assert_eq!(x, &v[0], "rank {r} got a different answer than rank 0");
    }
    &v[0]
}

// ---- replicas --------------------------------------------------------------------------------

const NAMES: [&str; 3] = ["a", "b", "c"];
/// `b` spans several all-reduce chunks of the element-wise pass.
const B_LEN: usize = 600_000;

fn params() -> Vec<Vec<f32>> {
    vec![
        (0..5).map(|i| i as f32 * 0.3 - 1.0).collect(),
        (0..B_LEN).map(|i| (i as f32 * 1e-3).sin()).collect(),
        vec![0.0, 2.0],
    ]
}

#[test]
fn identical_replicas_pass_and_perturbed_ones_are_named() {
    let out = run_ranks(3, |pg| {
        let mut p = params();
        let same = verify_replicas(&pg, &[&p[0], &p[1], &p[2]]).unwrap();
        // Rank 2 drifts in `b` (second chunk); rank 1 has -0.0 where the others have 0.0 in `c`.
        match pg.rank() {
            2 => p[1][300_001] += 0.5,
            1 => p[2][0] = -0.0,
            _ => {}
        }
        let diff = verify_replicas(&pg, &[&p[0], &p[1], &p[2]]).unwrap();
        (same, diff)
    });
    let same = all_equal(&out.iter().map(|o| o.0.clone()).collect::<Vec<_>>()).clone();
    assert!(same.identical, "{same}");
    assert_eq!(same.max_abs_diff, 0.0);
    assert_eq!(same.first_differing, None);
    assert!(same.differing_ranks.is_empty() && same.differing_params.is_empty());
    assert_eq!((same.params, same.elements), (3, 5 + B_LEN + 2));

    let diff = all_equal(&out.iter().map(|o| o.1.clone()).collect::<Vec<_>>()).clone();
    assert!(!diff.identical);
    let x = params()[1][300_001];
    let want = ((x + 0.5) as f64 - x as f64).abs();
    assert_eq!(
        diff.max_abs_diff, want,
        "the sign of zero is a bit difference, not a value one"
    );
    assert_eq!(diff.first_differing, Some((1, 300_001)));
    assert_eq!(diff.differing_params, vec![1, 2]);
    assert_eq!(diff.differing_elements, 2);
    assert_eq!(diff.differing_ranks, vec![1, 2]);
    let text = diff.describe(&NAMES);
    assert!(
        text.contains("parameters `b`, `c`")
            && text.contains("first at parameter `b` element 300001"),
        "{text}"
    );
    assert!(diff.to_string().contains("#1"), "{diff}");
}

#[test]
fn nan_on_one_rank_is_an_infinite_difference_f64() {
    let out = run_ranks(2, |pg| {
        let mut p = [1.0f64, f64::NAN, 3.0];
        let same = verify_replicas(&pg, &[&p[..]]).unwrap(); // equal NaN bits agree
        if pg.rank() == 0 {
            p[2] = f64::NAN;
        }
        (same, verify_replicas(&pg, &[&p[..]]).unwrap())
    });
    assert!(out[0].0.identical);
    let r = all_equal(&[out[0].1.clone(), out[1].1.clone()]).clone();
    assert!(!r.identical);
    assert_eq!(r.max_abs_diff, f64::INFINITY);
    assert_eq!(r.first_differing, Some((0, 2)));
    assert_eq!(r.differing_ranks, vec![1]);
}

#[test]
fn mismatched_parameter_lists_are_an_error_on_every_rank() {
    let out = run_ranks(3, |pg| {
        let mut p = params();
        if pg.rank() == 1 {
            p[1].push(0.0);
        }
        let len = verify_replicas(&pg, &[&p[0], &p[1], &p[2]])
            .unwrap_err()
            .to_string();
        let count = if pg.rank() == 2 {
            verify_replicas(&pg, &[&p[0][..]])
        } else {
            verify_replicas(&pg, &[&p[0][..], &p[2][..]])
        }
        .unwrap_err()
        .to_string();
        (len, count)
    });
    let (len, count) = all_equal(&out);
    assert!(
        len.contains("parameter #1 has 600000 elements on rank 0 and 600001 on rank 1"),
        "{len}"
    );
    assert!(
        count.contains("rank 0 passed 2 parameters, rank 2 passed 1"),
        "{count}"
    );
}

// ---- shards ----------------------------------------------------------------------------------

#[test]
fn distributed_sampler_shards_pass() {
    let out = run_ranks(4, |pg| {
        let (r, w) = (pg.rank(), pg.size());
        let mut even = DistributedSampler::new(100, w, r).unwrap().seed(7);
        even.set_epoch(3);
        let even = verify_disjoint_shards(&pg, &even.indices(), 100).unwrap();
        // 10 items over 4 ranks: padded to 12 by cycling, as PyTorch does.
        let padded = DistributedSampler::new(10, w, r).unwrap().shuffle(false);
        let padded = verify_disjoint_shards(&pg, &padded.peek_indices(), 10).unwrap();
        let dropped = DistributedSampler::new(10, w, r).unwrap().drop_last(true);
        let dropped = verify_disjoint_shards(&pg, &dropped.peek_indices(), 10).unwrap();
        (even, padded, dropped)
    });
    let (even, padded, dropped) = all_equal(&out);
    assert!(
        even.disjoint && even.complete() && even.is_padded_partition(),
        "{even}"
    );
    assert_eq!((even.covered, even.total, even.world_size), (100, 100, 4));

    // Shards [0,4,8], [1,5,9], [2,6,0], [3,7,1].
    assert!(!padded.disjoint && padded.complete() && padded.is_padded_partition());
    assert_eq!(padded.duplicates, vec![(0, vec![0, 2]), (1, vec![1, 3])]);
    assert_eq!(padded.total, 12);

    assert!(dropped.disjoint && !dropped.complete(), "{dropped}");
    assert_eq!(dropped.covered, 8);
}

#[test]
fn overlapping_shards_are_detected() {
    let out = run_ranks(3, |pg| {
        // Seed 000's leakage: every rank iterates the whole dataset; rank 2 also has a bad index.
        let mut mine: Vec<usize> = (0..20).collect();
        if pg.rank() == 2 {
            mine.push(25);
        }
        let leak = verify_disjoint_shards(&pg, &mine, 20).unwrap();
        // One shared index between otherwise disjoint shards, one index twice on rank 0.
        let mut mine: Vec<usize> = (pg.rank() * 5..pg.rank() * 5 + 5).collect();
        match pg.rank() {
            1 => mine.push(12),
            0 => mine.push(3),
            _ => {}
        }
        let one = verify_disjoint_shards(&pg, &mine, 15).unwrap();
        let bad = verify_disjoint_shards(&pg, &mine, 15 + pg.rank())
            .map(|_| ())
            .unwrap_err();
        (leak, one, bad.to_string())
    });
    let (leak, one, bad) = all_equal(&out);
    assert!(!leak.disjoint && !leak.is_padded_partition());
    assert_eq!(leak.duplicates.len(), 20);
    assert!(leak.duplicates.iter().all(|(_, r)| r == &vec![0, 1, 2]));
    assert_eq!(leak.out_of_range, vec![(25, 2)]);
    assert!(
        leak.to_string().contains("20 indices held more than once"),
        "{leak}"
    );

    assert!(!one.disjoint && one.complete());
    assert_eq!(one.duplicates, vec![(3, vec![0, 0]), (12, vec![1, 2])]);
    assert!(
        bad.contains("rank 0 has a dataset of 15 items, rank 1"),
        "{bad}"
    );
}

// ---- overlap ---------------------------------------------------------------------------------

#[test]
fn overlap_meter_summarizes_real_reducer_steps() {
    let out = run_ranks(2, |pg| {
        let specs: Vec<ParamSpec> = (0..4)
            .map(|i| ParamSpec::new(format!("p{i}"), vec![50_000], DType::F32))
            .collect();
        let opts = ReducerOptions {
            bucket_cap_mb: 0.2,
            first_bucket_cap_mb: 0.1,
        };
        let mut red = Reducer::new(&pg, specs, opts).unwrap();
        let mut meter = OverlapMeter::with_warmup(1);
        let g = vec![1.0f32; 50_000];
        for _ in 0..5 {
            red.prepare_for_backward().unwrap();
            for i in (0..4).rev() {
                red.mark_ready(i, &g).unwrap();
            }
            meter.record(red.finish().unwrap());
        }
        let local = meter.summary();
        assert_eq!(local.steps, 4);
        for s in meter.steps() {
            assert!(s.comm_wait <= s.total && (0.0..=1.0).contains(&s.overlap()));
            assert_eq!(s.bytes, 4 * 50_000 * 4);
        }
        assert!(local.mean_comm_wait <= local.mean_total);
        assert!(local.max_comm_wait >= local.mean_comm_wait);
        let global = meter.summary_across_ranks(&pg).unwrap();
        (global, local)
    });
    let global = *all_equal(&out.iter().map(|o| o.0).collect::<Vec<_>>());
    assert_eq!(global.steps, 8);
    assert!((0.0..=1.0).contains(&global.mean_overlap), "{global}");
    assert!((0.0..=1.0).contains(&global.comm_fraction()), "{global}");
    let max_local = out.iter().map(|o| o.1.max_comm_wait).max().unwrap();
    let diff = global.max_comm_wait.abs_diff(max_local);
    assert!(diff < Duration::from_micros(1), "{global}");
}
