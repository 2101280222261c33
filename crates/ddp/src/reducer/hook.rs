//! Communication hooks: how a full bucket is reduced (PyTorch's `register_comm_hook`).
//!
//! When every gradient of a bucket is in, the reducer hands the bucket — its flat buffer plus
//! metadata, a [`GradBucket`] — to its [`CommHook`] together with the process group, and keeps the
//! returned [`BucketWork`] until `finish` waits on it (c10d's `run_comm_hook`). The contract: the
//! work resolves to a buffer of the same dtype and length holding the *average* of the ranks'
//! buffers — the sum divided by [`GradBucket::divisor`] (the world size, or the number of ranks
//! with data under Join) — identical on every rank. Every rank calls its hook for the same buckets
//! in the same order (bucket order), so a hook may issue its own collectives.
//!
//! [`AllReduceHook`] is the default and does what PyTorch's `allreduce_hook` does: one async
//! all-reduce of the whole bucket with `Avg` (the division fused into the collective) when the
//! divisor is the world size, else `Sum` followed by a division. A hook is a type implementing
//! [`CommHook`] (its fields are PyTorch's hook `state`), or any closure
//! `FnMut(&ProcessGroup, GradBucket) -> BucketWork`. Compression (cast to bf16/fp16, reduce,
//! cast back with [`BucketWork::then`]), PowerSGD or local SGD are hooks of this kind.
//!
//! ```
//! use ddp::reducer::{BucketWork, GradBucket};
//! use ddp_comm::{ProcessGroup, ReduceOp};
//! // Sum the gradients instead of averaging them.
//! let sum_hook = |pg: &ProcessGroup, bucket: GradBucket| -> BucketWork {
//!     bucket.into_buffer().all_reduce(pg, ReduceOp::Sum)
//! };
//! # let _ = sum_hook;
//! ```

use super::buffer::{BucketBuffer, BucketWork};
use ddp_comm::{ProcessGroup, ReduceOp};
use std::sync::Arc;

/// Where one parameter's gradient sits in its bucket's buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketParam {
    /// Parameter index (registration order, as in `mark_ready`).
    pub index: usize,
    /// First element in the bucket buffer.
    pub offset: usize,
    /// Number of elements.
    pub numel: usize,
}

/// A bucket handed to a [`CommHook`] (PyTorch's `GradBucket`): the flat buffer of this rank's
/// gradients and where each parameter sits in it.
#[derive(Debug)]
pub struct GradBucket {
    pub(crate) index: usize,
    pub(crate) is_last: bool,
    pub(crate) divisor: usize,
    pub(crate) buffer: BucketBuffer,
    pub(crate) params: Arc<[BucketParam]>,
}

impl GradBucket {
    /// Bucket index, in launch order (0: the bucket of the last parameters).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Whether this is the last bucket of the step.
    pub fn is_last(&self) -> bool {
        self.is_last
    }

    /// What the sum over ranks must be divided by (the world size, or the number of ranks with
    /// data under Join).
    pub fn divisor(&self) -> usize {
        self.divisor
    }

    /// The flat gradients of this rank.
    pub fn buffer(&self) -> &BucketBuffer {
        &self.buffer
    }

    /// The flat gradients of this rank, mutably.
    pub fn buffer_mut(&mut self) -> &mut BucketBuffer {
        &mut self.buffer
    }

    /// The flat gradients, owned (to move into a collective).
    pub fn into_buffer(self) -> BucketBuffer {
        self.buffer
    }

    /// The parameters of this bucket, in buffer order.
    pub fn parameters(&self) -> &[BucketParam] {
        &self.params
    }
}

/// How a full bucket is reduced across ranks (see the module doc for the contract).
pub trait CommHook: Send {
    /// Starts reducing `bucket` over `pg`; the returned work yields the averaged buffer.
    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> BucketWork;
}

impl<F> CommHook for F
where
    F: FnMut(&ProcessGroup, GradBucket) -> BucketWork + Send,
{
    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> BucketWork {
        self(pg, bucket)
    }
}

/// The default hook, PyTorch's `allreduce_hook`: one async all-reduce per bucket, averaged.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AllReduceHook;

impl CommHook for AllReduceHook {
    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> BucketWork {
        let divisor = bucket.divisor();
        let buffer = bucket.into_buffer();
        if divisor == pg.size() {
            // The division fused into the collective (in cache on the shared-memory path).
            buffer.all_reduce(pg, ReduceOp::Avg)
        } else {
            buffer.all_reduce(pg, ReduceOp::Sum).then(move |mut b| {
                b.div_by(divisor);
                Ok(b)
            })
        }
    }
}
