//! Bucket buffers handed over and back between steps: freed until the next backward
//! ([`Reducer::release_buffers`]), taken by an adapter or a sharded step
//! ([`Reducer::take_averaged_buffers`]), given back to their buckets
//! ([`Reducer::recycle_buffers`]) or as spares to whichever buckets lack one
//! ([`Reducer::give_spare_buffers`]); a bucket left without one allocates at its first gradient.

use super::{BucketState, Reducer, TakenBucket};
use crate::error::{Error, Result};
use crate::reducer::buffer::{BucketBuffer, HostBuffer};
use ddp_comm::DType;

/// A spare "nearly" fits a bucket when its capacity exceeds the bucket's room by at most
/// `room / NEAR_FIT`.
const NEAR_FIT: usize = 16;

impl Reducer {
    /// Frees every host bucket buffer until the next backward needs it (ZeRO stage 2, which
    /// keeps only its gradient shard between steps): a released bucket is reallocated, zeroed,
    /// when its first gradient arrives. The averaged gradients are no longer readable. Only
    /// between steps and with nothing accumulated under `no_sync` (an error otherwise).
    pub fn release_buffers(&mut self) -> Result<()> {
        if self.current.is_some() || self.slots.iter().any(|s| s.accumulated) {
            return Err(Error::InvalidArgument(
                "release_buffers: a backward is in progress or no_sync gradients are \
                 accumulated; release after a synchronized finish"
                    .into(),
            ));
        }
        for b in &mut self.buckets {
            if let BucketState::Idle(BucketBuffer::Host(h)) = &mut b.state {
                *h = HostBuffer::zeros(b.dtype, 0);
            }
        }
        self.results_valid = false;
        Ok(())
    }

    /// Hands the averaged gradients' host buffers over (PyTorch's `gradient_as_bucket_view`):
    /// after a synchronized [`finish`](Self::finish), each host bucket's flat buffer moves out
    /// with where every parameter sits in it, so that an adapter can give out views of it
    /// instead of copies. The buckets are then released as by
    /// [`release_buffers`](Self::release_buffers) (reallocated, zeroed, when the next backward
    /// writes them) and the averaged gradients are no longer readable here. A device bucket
    /// stays where it is (`None` in its place). Only right after a synchronized `finish`.
    pub fn take_averaged_buffers(&mut self) -> Result<Vec<Option<TakenBucket>>> {
        if !self.results_valid || self.current.is_some() || self.slots.iter().any(|s| s.accumulated)
        {
            return Err(Error::InvalidArgument(
                "take_averaged_buffers: no synchronized gradients to hand over (call it once \
                 after a synchronized finish(), with nothing accumulated under no_sync)"
                    .into(),
            ));
        }
        let taken = self
            .buckets
            .iter_mut()
            .map(|b| match &mut b.state {
                BucketState::Idle(BucketBuffer::Host(h)) => Some((
                    std::mem::replace(h, HostBuffer::zeros(b.dtype, 0)),
                    b.layout.clone(),
                )),
                _ => None,
            })
            .collect();
        self.results_valid = false;
        Ok(taken)
    }

    /// Gives buffers back to the buckets that [`take_averaged_buffers`](Self::take_averaged_buffers)
    /// or [`release_buffers`](Self::release_buffers) emptied, so that the next backward writes
    /// its gradients into them instead of allocating (ZeRO stage 1 hands each bucket's buffer
    /// back after the parameter all-gather it carried). `buffers[b]` is for bucket `b`: `None`
    /// leaves it as it is; a buffer of the bucket's dtype holding at least its elements (any
    /// values: every gradient is copied over its slot and an unused parameter's slot is zeroed)
    /// takes its place, cut to the bucket's length. Refused, changing nothing, while a backward
    /// is in progress, for a bucket that still holds its buffer, or for a buffer of another
    /// dtype or too small.
    pub fn recycle_buffers(&mut self, buffers: Vec<Option<HostBuffer>>) -> Result<()> {
        if self.current.is_some() || buffers.len() != self.buckets.len() {
            return Err(Error::InvalidArgument(format!(
                "recycle_buffers: {} buffers for {} buckets{}",
                buffers.len(),
                self.buckets.len(),
                if self.current.is_some() {
                    " while a backward is in progress"
                } else {
                    ""
                }
            )));
        }
        for (i, (b, new)) in self.buckets.iter().zip(&buffers).enumerate() {
            let Some(new) = new else { continue };
            let empty =
                matches!(&b.state, BucketState::Idle(BucketBuffer::Host(h)) if h.is_empty());
            if b.numel > 0 && (!empty || new.dtype() != b.dtype || new.capacity() < b.numel) {
                return Err(Error::InvalidArgument(format!(
                    "recycle_buffers: bucket {i} ({} {} elements{}) cannot take a {} buffer of \
                     {} elements",
                    b.numel,
                    b.dtype,
                    if empty {
                        ""
                    } else {
                        ", still holding its buffer"
                    },
                    new.dtype(),
                    new.capacity(),
                )));
            }
        }
        for (b, new) in self.buckets.iter_mut().zip(buffers) {
            if let (Some(mut new), BucketState::Idle(BucketBuffer::Host(h))) = (new, &mut b.state) {
                if b.numel == 0 {
                    continue;
                }
                new.resize(b.numel);
                *h = new;
            }
        }
        Ok(())
    }

    /// Gives spare buffers of any origin (e.g. the parameter all-gather's, ZeRO stage 2) to the
    /// host buckets that lack one (emptied by [`take_averaged_buffers`](Self::take_averaged_buffers)
    /// or [`release_buffers`](Self::release_buffers)): first each spare of nearly a bucket's own
    /// size (room for the bucket padded to a multiple of the world size, at most 1/16 more) to
    /// such a bucket, then, in the order the backward fills them (bucket 0 first), each bucket
    /// still without one the smallest spare of its dtype with that room; spares that no bucket
    /// takes are dropped here. A buffer that fits nearly exactly costs that bucket nothing beyond
    /// its own size and spares it the zero-filling of a fresh one, where given to a smaller
    /// bucket it would leave the bucket of its size to allocate and zero-fill a fresh buffer (ZeRO
    /// stage 2; `docs/benchmarks.md`, "ZeRO memory (candle)"). Returns the buckets that
    /// took one, in order. As with
    /// [`recycle_buffers`](Self::recycle_buffers), any values may be in them, and the buffer
    /// is cut to the bucket's length; refused, changing nothing, while a backward is in
    /// progress.
    pub fn give_spare_buffers(&mut self, mut spares: Vec<HostBuffer>) -> Result<Vec<usize>> {
        if self.current.is_some() {
            return Err(Error::InvalidArgument(
                "give_spare_buffers: a backward is in progress".into(),
            ));
        }
        let world = self.pg.size();
        let mut took = Vec::new();
        // First the spares of (nearly) a bucket's own size, then the smallest that fits.
        for near_fit in [true, false] {
            for (i, b) in self.buckets.iter_mut().enumerate() {
                let BucketState::Idle(BucketBuffer::Host(h)) = &mut b.state else {
                    continue;
                };
                if b.numel == 0 || !h.is_empty() {
                    continue;
                }
                let room = b.numel.next_multiple_of(world);
                let best = spares
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| s.dtype() == b.dtype && s.capacity() >= room)
                    .filter(|(_, s)| !near_fit || s.capacity() <= room + room / NEAR_FIT)
                    .min_by_key(|(_, s)| s.capacity())
                    .map(|(j, _)| j);
                if let Some(j) = best {
                    let mut new = spares.swap_remove(j);
                    new.resize(b.numel);
                    *h = new;
                    took.push(i);
                }
            }
        }
        took.sort_unstable();
        Ok(took)
    }
}

/// A host bucket freed by [`Reducer::release_buffers`] (or taken) gets its zeroed buffer back,
/// with room to be padded to `world` equal blocks ([`HostBuffer::zeros_padded`]).
pub(super) fn reallocate_released(
    buf: &mut BucketBuffer,
    dtype: DType,
    numel: usize,
    world: usize,
) {
    if let BucketBuffer::Host(h) = buf {
        if h.len() != numel {
            *h = HostBuffer::zeros_padded(dtype, numel, world);
        }
    }
}
