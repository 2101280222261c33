//! `ShardedDataset` under Burn's own `DataLoaderBuilder`: each rank loads exactly
//! `ddp_core::DistributedSampler`'s indices (PyTorch semantics), the shards partition the dataset
//! (with PyTorch's padding), and `set_epoch` reshuffles identically on every rank.

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::{Dataset, InMemDataset};
use burn::tensor::Device;
use ddp_burn::ShardedDataset;
use ddp_core::DistributedSampler;
use std::sync::Arc;

/// Batches item ids as they are (the loader's output is what it read).
#[derive(Clone)]
struct Ids;

impl Batcher<usize, Vec<usize>> for Ids {
    fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
        items
    }
}

/// Everything rank `rank` of `world` loads in `epoch` through a Burn data loader.
fn loaded(n: usize, world: usize, rank: usize, epoch: u64, drop_last: bool) -> Vec<usize> {
    let data = Arc::new(InMemDataset::new(
        (0..n).map(|i| 1000 + i).collect::<Vec<_>>(),
    ));
    let sampler = DistributedSampler::new(n, world, rank)
        .unwrap()
        .seed(11)
        .drop_last(drop_last);
    let shard = Arc::new(ShardedDataset::new(data, sampler).unwrap());
    shard.set_epoch(epoch);
    let loader = DataLoaderBuilder::new(Ids)
        .batch_size(3)
        .build(shard.clone());
    assert_eq!(loader.num_items(), shard.len());
    loader.iter().flat_map(|b| b.unwrap()).collect()
}

#[test]
fn each_rank_loads_the_samplers_indices_and_the_shards_cover_the_dataset() {
    for n in [0usize, 1, 7, 10, 101] {
        for world in 1..=5 {
            for drop_last in [false, true] {
                let mut all = Vec::new();
                for rank in 0..world {
                    let got = loaded(n, world, rank, 3, drop_last);
                    let mut s = DistributedSampler::new(n, world, rank)
                        .unwrap()
                        .seed(11)
                        .drop_last(drop_last);
                    s.set_epoch(3);
                    let want: Vec<usize> = s.indices().iter().map(|i| 1000 + i).collect();
                    assert_eq!(got, want, "n {n}, world {world}, rank {rank}, {drop_last}");
                    all.extend(got);
                }
                all.sort();
                all.dedup();
                let expect = if drop_last { (n / world) * world } else { n };
                if !drop_last || n >= world {
                    assert_eq!(all.len(), expect.min(n), "n {n}, world {world}");
                }
            }
        }
    }
}

#[test]
fn set_epoch_reshuffles_the_same_way_on_every_rank() {
    let e0: Vec<_> = (0..2).map(|r| loaded(50, 2, r, 0, false)).collect();
    let e1: Vec<_> = (0..2).map(|r| loaded(50, 2, r, 1, false)).collect();
    assert_ne!(e0, e1, "set_epoch did not change the order");
    assert_eq!(
        e1,
        (0..2)
            .map(|r| loaded(50, 2, r, 1, false))
            .collect::<Vec<_>>()
    );
}

#[test]
fn a_sampler_for_another_length_is_an_error_naming_both() {
    let data = Arc::new(InMemDataset::new(vec![1u8; 10]));
    let e = ShardedDataset::new(data, DistributedSampler::new(12, 2, 1).unwrap())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("12") && e.contains("10") && e.contains("rank 1"),
        "{e}"
    );
}
