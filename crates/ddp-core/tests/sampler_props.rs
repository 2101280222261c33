//! Property tests of `DistributedSampler` against PyTorch's formulas, over dataset length, world
//! size, shuffle and drop_last.

use ddp_core::DistributedSampler;
use proptest::prelude::*;

/// PyTorch's `num_samples`, written as in `torch/utils/data/distributed.py` with signed arithmetic
/// and `math.ceil` on a real division.
fn torch_num_samples(len: usize, r: usize, drop_last: bool) -> usize {
    let remainder = len % r;
    let (n, r) = (len as f64, r as f64);
    let v = if drop_last && remainder != 0 {
        ((n - r) / r).ceil()
    } else {
        (n / r).ceil()
    };
    v.max(0.0) as usize // ceil(-0.6) is -0.0 in f64
}

fn all_ranks(
    len: usize,
    r: usize,
    shuffle: bool,
    drop_last: bool,
    seed: u64,
    epoch: u64,
) -> Vec<Vec<usize>> {
    (0..r)
        .map(|rank| {
            let mut s = DistributedSampler::new(len, r, rank)
                .unwrap()
                .shuffle(shuffle)
                .drop_last(drop_last)
                .seed(seed);
            s.set_epoch(epoch);
            s.indices()
        })
        .collect()
}

/// Re-interleaves the ranks' shards into the global (padded / truncated) list.
fn interleave(shards: &[Vec<usize>]) -> Vec<usize> {
    let n = shards[0].len();
    (0..n)
        .flat_map(|i| shards.iter().map(move |s| s[i]))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn shards_follow_pytorch(
        len in 0usize..500,
        r in 1usize..=8,
        shuffle: bool,
        drop_last: bool,
        seed in 0u64..1000,
        epoch in 0u64..20,
    ) {
        let shards = all_ranks(len, r, shuffle, drop_last, seed, epoch);
        let num_samples = torch_num_samples(len, r, drop_last);
        for (rank, shard) in shards.iter().enumerate() {
            prop_assert_eq!(shard.len(), num_samples, "rank {}", rank);
            prop_assert!(shard.iter().all(|&i| i < len));
        }
        let global = interleave(&shards);
        prop_assert_eq!(global.len(), num_samples * r);

        // The global list is a permutation of 0..len (identity without shuffle), then padded by
        // cycling from its start or truncated.
        let perm_len = len.min(global.len());
        let mut head = global[..perm_len].to_vec();
        if !shuffle {
            prop_assert_eq!(&head, &(0..perm_len).collect::<Vec<_>>());
        }
        if !drop_last {
            prop_assert_eq!(perm_len, len);
            for (k, &v) in global[len..].iter().enumerate() {
                prop_assert_eq!(v, global[k % len], "padding position {}", len + k);
            }
        }
        head.sort_unstable();
        head.dedup();
        prop_assert_eq!(head.len(), perm_len, "the first min(len, total) entries are distinct");

        // Coverage: without drop_last every item is seen; with it at most len % r (< r) are not.
        let mut seen = vec![false; len];
        for &i in &global {
            seen[i] = true;
        }
        let unseen = seen.iter().filter(|s| !**s).count();
        if drop_last {
            prop_assert_eq!(unseen, len - num_samples * r);
            prop_assert!(unseen < r);
        } else {
            prop_assert_eq!(unseen, 0);
        }

        // Disjointness: with an even split (or drop_last) no index is on two ranks.
        let remainder = len % r;
        if remainder == 0 || drop_last {
            let mut all: Vec<usize> = shards.concat();
            all.sort_unstable();
            let n = all.len();
            all.dedup();
            prop_assert_eq!(all.len(), n);
        }
    }

    #[test]
    fn epochs_change_the_order_and_seeds_reproduce_it(
        len in 10usize..500,
        r in 1usize..=8,
        drop_last: bool,
        seed in any::<u64>(),
        epoch in 0u64..1000,
    ) {
        let a = all_ranks(len, r, true, drop_last, seed, epoch);
        let again = all_ranks(len, r, true, drop_last, seed, epoch);
        prop_assert_eq!(&a, &again);
        let next = all_ranks(len, r, true, drop_last, seed, epoch + 1);
        // P(two epochs give the same permutation) <= 1/10!.
        prop_assert_ne!(interleave(&a), interleave(&next));
    }
}
