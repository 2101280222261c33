//! [`ShardedDataset`]: `ddp_core::DistributedSampler` (PyTorch's `DistributedSampler`: the same
//! indices, padding, `drop_last` and `set_epoch` shuffle) applied to any Burn
//! [`Dataset`], so that Burn's `DataLoaderBuilder` loads this rank's shard unchanged.
//!
//! ```text
//!   Dataset (N items) ──DistributedSampler(rank r of W, epoch e)──► ShardedDataset (ceil(N/W) items)
//!                                                                     └─► DataLoaderBuilder (no shuffle)
//! ```
//!
//! Build the loader *without* Burn's shuffle (the sampler shuffles, identically on every rank
//! for a given epoch and seed) and call [`ShardedDataset::set_epoch`] before each epoch, as with
//! PyTorch.

use crate::{Error, Result};
use burn::data::dataset::Dataset;
use ddp_comm::ProcessGroup;
use ddp_core::DistributedSampler;
use std::sync::{Arc, RwLock};

/// This rank's shard of a dataset: item `i` is item `indices[i]` of the wrapped dataset, where
/// `indices` are the sampler's indices for the current epoch.
pub struct ShardedDataset<D> {
    inner: Arc<D>,
    state: RwLock<(DistributedSampler, Arc<Vec<usize>>)>,
}

/// How [`ShardedDataset::new`] shards: a sampler built by the caller, or this rank's place in a
/// process group (PyTorch's default sampler: shuffled, seed 0, padded; options by
/// [`ShardedDataset::seed`], [`ShardedDataset::shuffle`], [`ShardedDataset::drop_last`]).
pub enum Sharding {
    /// This sampler (built for the dataset's length).
    Sampler(DistributedSampler),
    /// `DistributedSampler::new(dataset.len(), size, rank)`.
    Group {
        /// Number of ranks.
        size: usize,
        /// This rank.
        rank: usize,
    },
}

impl From<DistributedSampler> for Sharding {
    fn from(s: DistributedSampler) -> Self {
        Sharding::Sampler(s)
    }
}

impl From<&ProcessGroup> for Sharding {
    fn from(pg: &ProcessGroup) -> Self {
        Sharding::Group {
            size: pg.size(),
            rank: pg.rank(),
        }
    }
}

impl<D> ShardedDataset<D> {
    /// This rank's shard of `inner`, in one call: `ShardedDataset::new(data, &pg)?` builds the
    /// `DistributedSampler` for `inner`'s length and `pg`'s rank (options as builder methods:
    /// `.seed(s)`, `.shuffle(b)`, `.drop_last(b)`); `ShardedDataset::new(data, sampler)?` takes a
    /// sampler built for `inner`'s length (its epoch is the current one). Wrap the result in an
    /// `Arc` to share it between the loader and `set_epoch` ([`ShardedDataset::shared`]).
    /// [`ShardedDataset::from_dataset`] takes the dataset itself.
    pub fn new<I, E>(inner: Arc<D>, by: impl Into<Sharding>) -> Result<Self>
    where
        D: Dataset<I, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        let mut sampler = match by.into() {
            Sharding::Sampler(s) => s,
            Sharding::Group { size, rank } => DistributedSampler::new(inner.len(), size, rank)?,
        };
        if sampler.dataset_len() != inner.len() {
            return Err(Error::Unsupported(format!(
                "ShardedDataset: the sampler was built for {} items but the dataset has {} \
                 (rank {})",
                sampler.dataset_len(),
                inner.len(),
                sampler.rank()
            )));
        }
        let indices = Arc::new(sampler.indices());
        Ok(ShardedDataset {
            inner,
            state: RwLock::new((sampler, indices)),
        })
    }

    /// [`ShardedDataset::new`] of `Arc::new(dataset)`: `ShardedDataset::from_dataset(data, &pg)?`.
    pub fn from_dataset<I, E>(dataset: D, by: impl Into<Sharding>) -> Result<Self>
    where
        D: Dataset<I, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
        Self::new(Arc::new(dataset), by)
    }

    /// The sampler's `seed` (PyTorch's `seed`, the same on every rank): the shard is rebuilt.
    pub fn seed(self, seed: u64) -> Self {
        self.with_sampler(|s| s.seed(seed))
    }

    /// The sampler's `shuffle` (default true): the shard is rebuilt.
    pub fn shuffle(self, shuffle: bool) -> Self {
        self.with_sampler(|s| s.shuffle(shuffle))
    }

    /// The sampler's `drop_last` (default false: the last shards are padded): the shard is
    /// rebuilt.
    pub fn drop_last(self, drop_last: bool) -> Self {
        self.with_sampler(|s| s.drop_last(drop_last))
    }

    /// `Arc::new(self)`: one handle for `DataLoaderBuilder::build`, a clone for `set_epoch`.
    pub fn shared(self) -> Arc<Self> {
        Arc::new(self)
    }

    /// The samples of this rank's shard per epoch (`DistributedSampler::len`).
    pub fn samples_per_epoch(&self) -> usize {
        self.state.read().unwrap_or_else(|p| p.into_inner()).0.len()
    }

    fn with_sampler(self, f: impl FnOnce(DistributedSampler) -> DistributedSampler) -> Self {
        let (sampler, _) = self.state.into_inner().unwrap_or_else(|p| p.into_inner());
        let mut sampler = f(sampler);
        let indices = Arc::new(sampler.indices());
        ShardedDataset {
            inner: self.inner,
            state: RwLock::new((sampler, indices)),
        }
    }

    /// PyTorch's `sampler.set_epoch(epoch)`: the shard for `epoch` (a new shuffle when the
    /// sampler shuffles). Call it before each epoch, on every rank.
    pub fn set_epoch(&self, epoch: u64) {
        let mut s = self.state.write().unwrap_or_else(|p| p.into_inner());
        s.0.set_epoch(epoch);
        s.1 = Arc::new(s.0.indices());
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.state
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .epoch()
    }

    /// The dataset indices of this rank's shard for the current epoch.
    pub fn indices(&self) -> Arc<Vec<usize>> {
        self.state
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .clone()
    }
}

impl<D, I, E> Dataset<I, E> for ShardedDataset<D>
where
    D: Dataset<I, E>,
    E: std::error::Error + Send + Sync + 'static,
{
    /// Item `index` of this shard. Panics when `index >= len()`, like every Burn dataset.
    fn get(&self, index: usize) -> std::result::Result<I, E> {
        let indices = self.indices();
        self.inner.get(indices[index])
    }

    fn len(&self) -> usize {
        self.indices().len()
    }
}
