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
//! use ddp_core::reducer::{BucketWork, GradBucket};
//! use ddp_comm::{ProcessGroup, ReduceOp};
//! // Sum the gradients instead of averaging them.
//! let sum_hook = |pg: &ProcessGroup, bucket: GradBucket| -> BucketWork {
//!     bucket.into_buffer().all_reduce(pg, ReduceOp::Sum)
//! };
//! # let _ = sum_hook;
//! ```

use super::buffer::{BucketBuffer, BucketWork};
use crate::checkpoint::TensorData;
use crate::error::{Error, Result};
use ddp_comm::{ProcessGroup, ReduceOp};
use std::collections::BTreeMap;
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
    /// Shape of each parameter, parallel to `params`.
    pub(crate) shapes: Arc<[Vec<usize>]>,
    /// Index of the synchronized step this bucket belongs to (the reducer's step).
    pub(crate) step: u64,
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

    /// The shape of each parameter of [`parameters`](Self::parameters), in the same order
    /// (PyTorch's `bucket.gradients()[i].shape`).
    pub fn shapes(&self) -> &[Vec<usize>] {
        &self.shapes
    }

    /// The index of the synchronized step this bucket belongs to (the reducer's
    /// [`step`](super::Reducer::step)).
    pub fn step(&self) -> u64 {
        self.step
    }

    /// PyTorch's `bucket.set_buffer`: replaces the flat buffer (e.g. with a compressed copy, to
    /// hand the bucket on to an inner hook) and returns the old one.
    pub fn set_buffer(&mut self, buffer: BucketBuffer) -> BucketBuffer {
        std::mem::replace(&mut self.buffer, buffer)
    }
}

/// A comm hook's state in host memory (PyTorch's hook `state` as far as a checkpoint needs it):
/// counters and named `f32` tensors (error-feedback buffers, warm-start matrices). What
/// [`CommHook::state_dict`] returns and [`CommHook::load_state_dict`] restores; stored in a
/// checkpoint by [`Checkpoint::save_hook_state`](crate::Checkpoint::save_hook_state).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HookState {
    /// The hook (`"allreduce"`, `"bf16_compress"`, `"powersgd"`, ...), checked on load.
    pub kind: String,
    /// Step counters and other integers (e.g. PowerSGD's `iter`).
    pub counters: BTreeMap<String, u64>,
    /// Named tensors (e.g. `error.3`, `q.3` for bucket 3).
    pub tensors: BTreeMap<String, TensorData>,
}

impl HookState {
    /// An empty state of hook `kind`.
    pub fn new(kind: impl Into<String>) -> HookState {
        HookState {
            kind: kind.into(),
            ..Default::default()
        }
    }

    /// Counter `name`, or an error naming the hook and the counter.
    pub fn counter(&self, name: &str) -> Result<u64> {
        self.counters.get(name).copied().ok_or_else(|| {
            Error::Mismatch(format!(
                "{} comm hook state has no counter {name:?}",
                self.kind
            ))
        })
    }

    /// Errors unless this state was saved by a hook of kind `kind`.
    pub fn expect_kind(&self, kind: &str) -> Result<()> {
        if self.kind != kind {
            return Err(Error::Mismatch(format!(
                "comm hook state of {:?} given to a {kind:?} hook",
                self.kind
            )));
        }
        Ok(())
    }
}

/// How a full bucket is reduced across ranks (see the module doc for the contract).
/// Where a sharding hook's averaged shard lies ([`CommHook::shard_range`]): elements `buffer`
/// of the work's buffer, which are elements `bucket_start..` of the bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardRange {
    pub buffer: std::ops::Range<usize>,
    pub bucket_start: usize,
}

pub trait CommHook: Send {
    /// Starts reducing `bucket` over `pg`; the returned work yields the averaged buffer.
    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> BucketWork;

    /// Payload bytes this hook handed to collectives since the last call, if it counts them
    /// (the reducer then reports them in [`Reducer::bytes_sent`](super::Reducer::bytes_sent);
    /// `None`: the bucket bytes are counted, as for the default all-reduce).
    fn take_sent_bytes(&mut self) -> Option<u64> {
        None
    }

    /// For a sharding hook (ZeRO's reduce-scatter): where in the work's buffer this rank's
    /// averaged shard of bucket `bucket`, of `numel` elements, lies ([`ShardRange`]); the rest of the
    /// buffer, if any, is unspecified. `None` (default): the buffer is the whole averaged bucket.
    /// With `Some`, the reducer accepts a buffer shorter than the bucket, refuses per-parameter
    /// reads (the bucket is read whole: [`Reducer::bucket_grads`](super::Reducer::bucket_grads),
    /// [`Reducer::take_averaged_buffers`](super::Reducer::take_averaged_buffers)), and its
    /// finite check looks at the shard only, agreeing with the other ranks (every rank holds a
    /// different shard) over one small all-gather per step.
    fn shard_range(&self, pg: &ProcessGroup, bucket: usize, numel: usize) -> Option<ShardRange> {
        let _ = (pg, bucket, numel);
        None
    }

    /// The hook's state for a checkpoint (default: a stateless hook, kind `"custom"`).
    fn state_dict(&self) -> HookState {
        HookState::new("custom")
    }

    /// Restores a state made by [`state_dict`](Self::state_dict) (errors name what is missing
    /// or of the wrong kind).
    fn load_state_dict(&mut self, state: &HookState) -> Result<()> {
        state.expect_kind(&self.state_dict().kind)
    }
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
    fn state_dict(&self) -> HookState {
        HookState::new("allreduce")
    }

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
