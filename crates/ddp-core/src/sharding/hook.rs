//! The sharded step's communication: gradients reduce-scattered bucket by bucket through the
//! reducer's comm-hook trait ([`ReduceScatterHook`]), the owners' updated chunks all-gathered
//! ([`gather_params`]), and the cross-rank gradient norm for clipping ([`clip_grad_norm`]).

use super::layout::{owned, ShardLayout};
use crate::error::{Error, Result};
use crate::reducer::{
    BucketBuffer, BucketWork, CommHook, GradBucket, HostBuffer, Reducer, ShardRange,
};
use ddp_comm::{Element, ProcessGroup, ReduceOp};

/// The ZeRO comm hook: a `reduce_scatter` of each bucket (padded to a multiple of the world
/// size) instead of an all-reduce. Sends `(N-1)/N` of the bucket, half of a ring all-reduce;
/// the parameter all-gather is the other half. Two forms:
/// - [`ReduceScatterHook::in_place`] (stage 1): in place
///   ([`ProcessGroup::reduce_scatter_in_place_async`]); the work yields the bucket's own buffer,
///   whose chunk owned by this rank (see [`ShardLayout`]) holds the average over ranks, the
///   other elements unspecified (this rank's unreduced gradient or partial sums). Nothing is
///   allocated or copied per step on shared memory and TCP, and the buffer can carry the
///   parameter all-gather afterwards ([`gather_params_into`]).
/// - [`ReduceScatterHook::shard_only`] (stage 2): the work yields this rank's chunk alone
///   ([`CommHook::shard_range`]), reduced in the bucket's own memory and cut to the chunk on
///   the communication thread as soon as its reduce-scatter is done
///   ([`ProcessGroup::reduce_scatter_shard_async`]: no output buffer next to the bucket), so
///   that only gradient shards outlive the backward.
///   [`whole_from`](ReduceScatterHook::whole_from) keeps the last buckets whole (as stage 1),
///   a bounded number, so that their buffers can carry the parameter all-gather and the next
///   backward instead of being allocated again.
///
/// Either way only the owned chunk is read ([`take_shard_grads`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReduceScatterHook {
    /// Buckets from this index on come back whole; the others as their chunk alone.
    whole_from: usize,
}

impl ReduceScatterHook {
    /// Each bucket comes back whole, its owned chunk averaged (see the type doc).
    pub fn in_place() -> Self {
        ReduceScatterHook { whole_from: 0 }
    }

    /// Each bucket comes back as its owned chunk alone (see the type doc).
    pub fn shard_only() -> Self {
        ReduceScatterHook {
            whole_from: usize::MAX,
        }
    }

    /// Buckets `first..` come back whole, as with [`in_place`](Self::in_place).
    pub fn whole_from(self, first: usize) -> Self {
        ReduceScatterHook { whole_from: first }
    }

    fn shard_only_at(&self, bucket: usize) -> bool {
        bucket < self.whole_from
    }
}

impl CommHook for ReduceScatterHook {
    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> BucketWork {
        let divisor = bucket.divisor();
        let index = bucket.index();
        let shard_only = self.shard_only_at(index);
        match bucket.into_buffer() {
            BucketBuffer::Host(HostBuffer::F32(v)) => scatter(pg, v, divisor, shard_only),
            BucketBuffer::Host(HostBuffer::F64(v)) => scatter(pg, v, divisor, shard_only),
            other => BucketWork::ready(Err(ddp_comm::Error::InvalidArgument(format!(
                "ZeRO reduce-scatter hook: bucket {index} is a {} {} buffer; only f32/f64 host \
                 buckets are sharded",
                other.dtype(),
                if other.as_host().is_some() {
                    "host"
                } else {
                    "device"
                },
            )))),
        }
    }

    fn shard_range(&self, pg: &ProcessGroup, bucket: usize, numel: usize) -> Option<ShardRange> {
        let (lo, hi) = owned(numel, pg.size(), pg.rank());
        Some(ShardRange {
            buffer: if self.shard_only_at(bucket) {
                0..hi - lo
            } else {
                lo..hi
            },
            bucket_start: lo,
        })
    }
}

fn wrap<T>(v: Vec<T>) -> BucketBuffer
where
    HostBuffer: From<Vec<T>>,
{
    BucketBuffer::Host(HostBuffer::from(v))
}

fn scatter<T: Element>(
    pg: &ProcessGroup,
    mut v: Vec<T>,
    divisor: usize,
    shard_only: bool,
) -> BucketWork
where
    HostBuffer: From<Vec<T>>,
{
    let (world, rank) = (pg.size(), pg.rank());
    let n = v.len();
    let c = n.div_ceil(world);
    v.resize(c * world, T::zeroed());
    let op = if divisor == world {
        ReduceOp::Avg
    } else {
        ReduceOp::Sum
    };
    let (lo, hi) = owned(n, world, rank);
    let work = if shard_only {
        pg.reduce_scatter_shard_async(v, op)
    } else {
        pg.reduce_scatter_in_place_async(v, op)
    };
    BucketWork::from_work(work, wrap::<T>).then(move |mut b| {
        if let BucketBuffer::Host(h) = &mut b {
            // The owned elements: the whole (padded) chunk, or the chunk within the bucket.
            let (lo, hi, keep) = if shard_only {
                (0, hi - lo, hi - lo)
            } else {
                (lo, hi, n)
            };
            if divisor != world {
                let s = h.as_mut_slice::<T>().expect("the scatter keeps the dtype");
                T::div_by(&mut s[lo..hi], divisor);
            }
            h.truncate(keep);
        }
        Ok(b)
    })
}

/// This rank's averaged gradient chunks after a sharded backward, one per owned chunk of a
/// [`ShardLayout`]: each as a buffer and the range of it that holds the chunk, so that nothing
/// is copied out of the reducer (stage 1: the whole bucket, the chunk inside it; stage 2 and 3:
/// the chunk alone).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShardGrads {
    parts: Vec<(Vec<f32>, std::ops::Range<usize>)>,
}

impl ShardGrads {
    /// One buffer per chunk, each wholly the chunk.
    pub fn from_chunks(chunks: Vec<Vec<f32>>) -> ShardGrads {
        ShardGrads {
            parts: chunks
                .into_iter()
                .map(|v| {
                    let n = v.len();
                    (v, 0..n)
                })
                .collect(),
        }
    }

    /// Number of chunks.
    pub fn len(&self) -> usize {
        self.parts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Chunk `i`'s averaged gradient.
    pub fn chunk(&self, i: usize) -> &[f32] {
        let (v, r) = &self.parts[i];
        &v[r.clone()]
    }

    /// Chunk `i`'s averaged gradient, mutably (clipping).
    pub fn chunk_mut(&mut self, i: usize) -> &mut [f32] {
        let (v, r) = &mut self.parts[i];
        &mut v[r.clone()]
    }

    /// Every chunk's buffer and the range of it that is the chunk.
    pub fn into_parts(self) -> Vec<(Vec<f32>, std::ops::Range<usize>)> {
        self.parts
    }
}

/// Takes this rank's averaged gradient chunks over from the reducer, without copies (after a
/// synchronized `Reducer::finish` with [`ReduceScatterHook`]): each bucket's buffer, whole with
/// [`ReduceScatterHook::in_place`] (the chunk at its place inside) or the chunk alone with
/// [`ReduceScatterHook::shard_only`]. The reducer allocates new buckets at the next backward.
pub fn take_shard_grads(layout: &ShardLayout, reducer: &mut Reducer) -> Result<ShardGrads> {
    let taken = reducer.take_averaged_buffers()?;
    let parts = layout
        .chunks()
        .iter()
        .zip(taken)
        .map(|(c, t)| {
            let numel = layout.buckets()[c.bucket].numel;
            match t {
                Some((HostBuffer::F32(v), _)) if v.len() == c.len() => {
                    let n = v.len();
                    Ok((v, 0..n))
                }
                Some((HostBuffer::F32(v), _)) if v.len() == numel => Ok((v, c.lo..c.hi)),
                Some((h, _)) => Err(Error::InvalidArgument(format!(
                    "take_shard_grads: bucket {} holds {} {} elements, neither the bucket ({numel} \
                     f32) nor this rank's chunk ({} f32): register ReduceScatterHook",
                    c.bucket,
                    h.len(),
                    h.dtype(),
                    c.len()
                ))),
                None => Err(Error::InvalidArgument(format!(
                    "take_shard_grads: bucket {} is not a host bucket",
                    c.bucket
                ))),
            }
        })
        .collect::<Result<_>>()?;
    Ok(ShardGrads { parts })
}

/// Copies the parameter values of each owned chunk out of full parameters (`read(param)` gives
/// a parameter flat). A parameter lies in one bucket, hence in at most one chunk of this rank:
/// each is read once and dropped once copied, so at most one parameter is held besides the
/// chunks.
pub fn shard_params(
    layout: &ShardLayout,
    mut read: impl FnMut(usize) -> Result<Vec<f32>>,
) -> Result<Vec<Vec<f32>>> {
    layout
        .chunks()
        .iter()
        .map(|c| {
            let mut out = vec![0f32; c.len()];
            for p in layout.pieces(c) {
                let v = read(p.param)?;
                out[p.chunk_offset..p.chunk_offset + p.len]
                    .copy_from_slice(&v[p.param_offset..p.param_offset + p.len]);
            }
            Ok(out)
        })
        .collect()
}

/// All-gathers every bucket from its owners' `chunks` (one per owned chunk, in bucket order) and
/// calls `write(param, values)` once per parameter with its full flat values. A collective; see
/// [`gather_params_into`], which this runs with fresh buffers.
pub fn gather_params(
    pg: &ProcessGroup,
    layout: &ShardLayout,
    chunks: Vec<Vec<f32>>,
    mut write: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    if chunks.len() != layout.buckets().len() {
        return Err(Error::InvalidArgument(format!(
            "gather_params: {} chunks given, the layout has {} buckets",
            chunks.len(),
            layout.buckets().len()
        )));
    }
    let bufs = vec![Vec::new(); chunks.len()];
    gather_params_into(
        pg,
        layout,
        bufs,
        Gather::default(),
        |i, dst| {
            dst.copy_from_slice(&chunks[i]);
            Ok(())
        },
        |p, _, v| write(p, v),
        None,
    )?;
    Ok(())
}

/// A framework's parameters lent to [`gather_params_into`]: `lend(param, offset, len, f)` calls
/// `f` with elements `offset..offset + len` of parameter `param`, mutably, and returns its result.
pub type Lend<'a> = &'a mut (dyn FnMut(usize, usize, usize, &mut dyn FnMut(&mut [f32]) -> Result<()>) -> Result<()>
             + Send);

/// How [`gather_params_into`] runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Gather {
    /// At most this many buckets in flight (`0`: all at once); a window bounds the full-size
    /// buffers alive together: a buffer allocated here carries a later bucket once written
    /// (when it has room), else it is freed.
    pub window: usize,
    /// The parameters already hold this rank's own chunk (a write-through optimizer updated
    /// it in place): only the other ranks' elements are written.
    pub skip_owned: bool,
    /// A bucket gathered first, whose buffer (given, whole) then carries later buckets as one
    /// allocated here would, instead of coming back at its index: stage 2's last bucket,
    /// reduce-scattered in place at the end of the backward, so that the step neither
    /// allocates nor fills a buffer for it and holds no more full-size buffers than the window.
    pub lead: Option<usize>,
}

/// The parameter all-gather of a sharded step, in place in `bufs` (one per bucket of `layout`;
/// any contents, used when their capacity suffices, else allocated here): `fill(i, dst)`
/// writes this rank's values of chunk `i` straight into its block of bucket `i`'s buffer, the
/// bucket is all-gathered in place (async), and `write(param, offset, values)` is called as
/// each bucket arrives, in bucket order, with the values of parameter `param` from element
/// `offset` on: once per parameter with all of them, or, with [`Gather::skip_owned`], once per
/// part of it that lies outside this rank's chunk. A collective: every bucket's all-gather is
/// run even after an error here (`fill` or `write`), so that the group stays in step; the first
/// error is returned. The buffers that were given come back (each a whole bucket, padded,
/// holding the gathered parameters; e.g. for `Reducer::recycle_buffers`), and so do those
/// allocated here that carried the last buckets (at most the window's worth: e.g. for
/// `Reducer::give_spare_buffers`), each at its bucket's index (a buffer that carried buckets
/// placed straight into the parameters keeps the length of the largest of them, so that its
/// next user need not zero-fill it again); the others were carried over to
/// later buckets or freed, an empty vector in their place. Buckets are gathered in index order,
/// [`Gather::lead`] (the same on every rank) first.
///
/// With `lend` (the parameters themselves, see [`Lend`]), a bucket of at least
/// [`ProcessGroup::direct_gather_min`] bytes is all-gathered straight into them
/// ([`ProcessGroup::all_gather_in_place_to`]: on shared memory each rank reads the owners'
/// chunks from their buffers into its parameters, one copy where the gather and `write` make
/// three), blocking, and `write` is not called for it; its buffer then goes on as any other.
pub fn gather_params_into(
    pg: &ProcessGroup,
    layout: &ShardLayout,
    bufs: Vec<Vec<f32>>,
    how: Gather,
    mut fill: impl FnMut(usize, &mut [f32]) -> Result<()>,
    mut write: impl FnMut(usize, usize, &[f32]) -> Result<()>,
    mut lend: Option<Lend<'_>>,
) -> Result<Vec<Vec<f32>>> {
    let world = layout.world_size();
    let mine = layout.chunks();
    if bufs.len() != mine.len() {
        return Err(Error::InvalidArgument(format!(
            "gather_params_into: {} buffers given, the layout has {} buckets",
            bufs.len(),
            mine.len()
        )));
    }
    let mut failed: Option<Error> = None;
    let mut kept = vec![Vec::new(); mine.len()];
    let padded = |c: &super::layout::Chunk| layout.buckets()[c.bucket].chunk_len(world) * world;
    // The buffers given and used (handed back at the end), not allocated here.
    let given: Vec<bool> = bufs
        .iter()
        .zip(&mine)
        .map(|(v, c)| v.capacity() >= padded(c))
        .collect();
    // Carried over like a buffer allocated here once its bucket is written: the lead's.
    let carries = |j: usize| !given[j] || how.lead == Some(j);
    let lead = how.lead.filter(|&l| l < mine.len());
    let order: Vec<usize> = lead
        .into_iter()
        .chain((0..mine.len()).filter(|&i| Some(i) != lead))
        .collect();
    let mut bufs: Vec<Option<Vec<f32>>> = bufs.into_iter().map(Some).collect();
    let mut pending = std::collections::VecDeque::new();
    // Waits for bucket `i`, writes its parameters, and gives its buffer back.
    // The parts of bucket `c`'s slots this rank writes, each `(param, start, end, slot start)`
    // in bucket elements: the slot less the owned range with `skip_owned`.
    let parts_of = |c: &super::layout::Chunk| -> Vec<(usize, usize, usize, usize)> {
        let owned = if how.skip_owned { c.lo..c.hi } else { 0..0 };
        let mut out = Vec::new();
        for s in &layout.buckets()[c.bucket].slots {
            let (lo, hi) = (s.offset, s.offset + s.numel);
            let parts = if owned.is_empty() {
                [(lo, hi), (hi, hi)]
            } else {
                [(lo, hi.min(owned.start)), (lo.max(owned.end), hi)]
            };
            let parts = parts.into_iter().filter(|(a, b)| a < b);
            out.extend(parts.map(|(a, b)| (s.param, a, b, lo)));
        }
        out
    };
    let direct_min = pg.direct_gather_min();
    let mut complete = |i: usize, work: Gathered, failed: &mut Option<Error>| -> Vec<f32> {
        let work = match work {
            Gathered::Placed(v) => return v,
            Gathered::Pending(work) => work,
        };
        let waited = {
            let _s = crate::trace::span("wait gather", "zero");
            work.wait()
        };
        match waited {
            Ok(full) => {
                if failed.is_none() {
                    let _s = crate::trace::span("write params", "zero");
                    let c = &mine[i];
                    for (p, a, b, lo) in parts_of(c) {
                        if let Err(e) = write(p, a - lo, &full[a..b]) {
                            *failed = Some(e);
                            break;
                        }
                    }
                }
                full
            }
            Err(e) => {
                failed.get_or_insert(Error::Comm(e));
                Vec::new()
            }
        }
    };
    for i in order {
        let (mut v, c) = (bufs[i].take().expect("each bucket once"), &mine[i]);
        let len = padded(c);
        let direct = lend.is_some() && direct_min.is_some_and(|m| 4 * len >= m);
        // The window is full: the oldest bucket completes first, so that its buffer (if
        // allocated here) can carry this one and no more than the window is ever alive. A
        // bucket placed straight into the parameters is complete already: its buffer carries
        // the next such bucket at once (one full-size buffer alive, not the window's).
        let mut freed = None;
        let placed = matches!(pending.front(), Some((_, Gathered::Placed(_))));
        if (placed && direct) || (how.window > 0 && pending.len() >= how.window) {
            let (j, work) = pending.pop_front().expect("the window is full");
            let full = complete(j, work, &mut failed);
            if carries(j) {
                freed = Some(full);
            } else {
                kept[j] = full;
            }
        }
        if !given[i] {
            v = match freed.take() {
                // Any values: the fill and the gather write every element.
                // Placed straight into the parameters, a bucket uses the first `len` elements
                // of a longer buffer, which keeps its length: the bucket of that size reuses
                // it next without zero-filling the rest again.
                Some(w) if direct && w.len() >= len => w,
                Some(mut w) if w.capacity() >= len => {
                    w.resize(len, 0.0);
                    w
                }
                // A fresh buffer: calloc's pages need no second pass of zeros.
                _ => vec![0.0; len],
            };
        } else {
            v.resize(len, 0.0);
        }
        if failed.is_none() {
            let _s = crate::trace::span("fill chunk", "zero");
            if let Err(e) = fill(i, &mut v[c.lo..c.hi]) {
                failed = Some(e);
            }
        }
        match lend.as_deref_mut().filter(|_| direct) {
            Some(lend) => {
                let _s = crate::trace::span("gather into params", "zero");
                let parts = if failed.is_none() {
                    parts_of(c)
                } else {
                    Vec::new()
                };
                let mut lent: Option<Error> = None;
                // A parameter that cannot be lent stops the placing, not the collective, so
                // that the group stays in step.
                let r = pg.all_gather_in_place_to(&mut v[..len], &mut |read| {
                    for &(p, a, b, lo) in &parts {
                        let r = lend(p, a - lo, b - a, &mut |dst| {
                            read(a, dst).map_err(Error::Comm)
                        });
                        if let Err(e) = r {
                            lent = Some(e);
                            break;
                        }
                    }
                    Ok(())
                });
                match (lent, r) {
                    (Some(e), _) => {
                        failed.get_or_insert(e);
                    }
                    (None, Err(e)) => {
                        failed.get_or_insert(Error::Comm(e));
                    }
                    (None, Ok(())) => {}
                }
                pending.push_back((i, Gathered::Placed(v)));
            }
            None => pending.push_back((i, Gathered::Pending(pg.all_gather_in_place_async(v)))),
        }
    }
    while let Some((j, work)) = pending.pop_front() {
        kept[j] = complete(j, work, &mut failed);
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(kept),
    }
}

/// A bucket of [`gather_params_into`] in its window: all-gathered async, or already placed.
enum Gathered {
    Pending(ddp_comm::Work<Vec<f32>>),
    Placed(Vec<f32>),
}

/// PyTorch's `clip_grad_norm_` over sharded gradients: the global L2 norm of all gradients
/// (each rank's squared sum of its chunks, all-reduced), and every chunk scaled by
/// `max_norm / (norm + 1e-6)` when that is below 1. Returns the norm before clipping. A
/// collective.
pub fn clip_grad_norm(pg: &ProcessGroup, grads: &mut ShardGrads, max_norm: f64) -> Result<f64> {
    let local: f64 = (0..grads.len())
        .flat_map(|i| grads.chunk(i).iter())
        .map(|&g| f64::from(g) * f64::from(g))
        .sum();
    let mut total = [local];
    pg.all_reduce(&mut total, ReduceOp::Sum)?;
    let norm = total[0].sqrt();
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        let coef = coef as f32;
        for i in 0..grads.len() {
            for g in grads.chunk_mut(i) {
                *g *= coef;
            }
        }
    }
    Ok(norm)
}

/// Bytes this rank sends per synchronized step with a ring: reduce-scatter plus all-gather of
/// every bucket (padded), `2·(N-1)/N` of the model, what a ring all-reduce sends (DDP).
pub fn bytes_per_step(layout: &ShardLayout) -> u64 {
    let n = layout.world_size() as u64;
    layout
        .buckets()
        .iter()
        .map(|b| 2 * (n - 1) * b.chunk_len(layout.world_size()) as u64 * 4)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sharding::layout::tests::layout;

    /// Element `k` of parameter `p`, as its owner holds it.
    fn value(p: usize, k: usize) -> f32 {
        (p * 1000 + k) as f32
    }

    /// Parameter sizes and buckets (in the order a backward fills them): bucket 1, the lead
    /// below, is the largest, so its buffer has room for every later one.
    const SIZES: [usize; 6] = [5, 17, 1, 9, 30, 4];
    const BUCKETS: [&[usize]; 4] = [&[5], &[4, 3], &[2, 1], &[0]];

    #[test]
    fn the_lead_bucket_is_gathered_first_and_its_buffer_carries_later_ones() {
        // Tiny buckets over TCP (the async window), then buckets of 1 MiB and more over shared
        // memory with the parameters lent (each placed straight into them, blocking).
        check_gather(1, ddp_comm::testing::LocalGroup::default(), false);
        let shm = ddp_comm::testing::LocalGroup {
            backend: ddp_comm::Backend::Shm,
            ..Default::default()
        };
        check_gather(70_000, shm, true);
    }

    /// [`gather_params_into`] at world 3 with the parameters `SIZES` times `scale`.
    fn check_gather(scale: usize, group: ddp_comm::testing::LocalGroup, lent: bool) {
        const W: usize = 3;
        let sizes: Vec<usize> = SIZES.iter().map(|n| n * scale).collect();
        ddp_comm::testing::run_local_group(W, group, |pg| {
            let layout = layout(&sizes, &BUCKETS, W, pg.rank());
            let chunks = layout.chunks();
            let fill = |i: usize, dst: &mut [f32]| {
                dst.fill(f32::NAN); // the padding
                for p in layout.pieces(&chunks[i]) {
                    for k in 0..p.len {
                        dst[p.chunk_offset + k] = value(p.param, p.param_offset + k);
                    }
                }
                Ok(())
            };
            let padded = |b: usize| layout.buckets()[b].chunk_len(W) * W;
            let direct = pg
                .direct_gather_min()
                .is_some_and(|m| (0..BUCKETS.len()).all(|b| 4 * padded(b) >= m));
            assert_eq!(direct, lent, "every bucket placed directly");
            for lead in [None, Some(1)] {
                for window in [0, 1, 2] {
                    let what = format!("rank {}, lead {lead:?}, window {window}", pg.rank());
                    let mut bufs = vec![Vec::new(); BUCKETS.len()];
                    // The lead's buffer is given whole, its other ranks' blocks stale.
                    let lead_at = lead.map(|l| {
                        bufs[l] = vec![f32::NAN; padded(l)];
                        bufs[l].as_ptr()
                    });
                    let got = std::sync::Mutex::new(
                        sizes.iter().map(|&n| vec![f32::NAN; n]).collect::<Vec<_>>(),
                    );
                    let first_written = std::sync::Mutex::new(None);
                    let how = Gather {
                        window,
                        skip_owned: false,
                        lead,
                    };
                    let write = |p: usize, at: usize, v: &[f32]| {
                        first_written.lock().unwrap().get_or_insert(p);
                        got.lock().unwrap()[p][at..at + v.len()].copy_from_slice(v);
                        Ok(())
                    };
                    let mut lend =
                        |p: usize,
                         at: usize,
                         n: usize,
                         f: &mut dyn FnMut(&mut [f32]) -> Result<()>| {
                            first_written.lock().unwrap().get_or_insert(p);
                            f(&mut got.lock().unwrap()[p][at..at + n])
                        };
                    let lend: Option<Lend<'_>> = if lent { Some(&mut lend) } else { None };
                    let back =
                        gather_params_into(&pg, &layout, bufs, how, fill, write, lend).unwrap();
                    for (p, g) in got.lock().unwrap().iter().enumerate() {
                        let ok = g.iter().enumerate().all(|(k, &x)| x == value(p, k));
                        assert!(ok, "{what}: parameter {p}");
                    }
                    let first = first_written.lock().unwrap().unwrap();
                    let lead_bucket = BUCKETS[lead.unwrap_or(0)];
                    assert!(
                        lead_bucket.contains(&first),
                        "{what}: first written p{first}"
                    );
                    let alive = back.iter().filter(|v| !v.is_empty()).count();
                    if lent {
                        // Each placed bucket's buffer carries the next one at once.
                        assert_eq!(alive, 1, "{what}: {alive} buffers came back");
                    } else if window > 0 {
                        assert!(alive <= window, "{what}: {alive} buffers came back");
                    } else {
                        assert_eq!(alive, BUCKETS.len(), "{what}");
                    }
                    if let (Some(l), Some(ptr)) = (lead, lead_at) {
                        let at = back.iter().position(|v| v.as_ptr() == ptr && !v.is_empty());
                        if window > 0 || lent {
                            // Carried on to a later bucket rather than back at its index.
                            assert!(
                                at.is_some_and(|j| j != l),
                                "{what}: lead's buffer at {at:?}"
                            );
                            if lent {
                                // Placed buckets use a prefix: the lead's length is kept.
                                let lead_len = layout.buckets()[l].chunk_len(pg.size()) * pg.size();
                                let got = back[at.unwrap()].len();
                                assert_eq!(got, lead_len, "{what}: length of the lead's buffer");
                            }
                        } else {
                            assert_eq!(at, Some(l), "{what}");
                        }
                    }
                }
            }
        });
    }
}
