//! [`ShardedDataset`]: `ddp::DistributedSampler` (PyTorch's `DistributedSampler`: the same
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
use ddp::DistributedSampler;
use std::sync::{Arc, RwLock};

/// This rank's shard of a dataset: item `i` is item `indices[i]` of the wrapped dataset, where
/// `indices` are the sampler's indices for the current epoch.
pub struct ShardedDataset<D> {
    inner: Arc<D>,
    state: RwLock<(DistributedSampler, Arc<Vec<usize>>)>,
}

impl<D> ShardedDataset<D> {
    /// Shards `inner` with `sampler` (built for `inner`'s length; its epoch is the current one).
    pub fn new<I, E>(inner: Arc<D>, mut sampler: DistributedSampler) -> Result<Self>
    where
        D: Dataset<I, E>,
        E: std::error::Error + Send + Sync + 'static,
    {
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
