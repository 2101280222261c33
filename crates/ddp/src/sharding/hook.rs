//! The sharded step's communication: gradients reduce-scattered bucket by bucket through the
//! reducer's comm-hook trait ([`ReduceScatterHook`]), the owners' updated chunks all-gathered
//! ([`gather_params`]), and the cross-rank gradient norm for clipping ([`clip_grad_norm`]).

use super::layout::ShardLayout;
use crate::error::{Error, Result};
use crate::reducer::{BucketBuffer, BucketWork, CommHook, GradBucket, HostBuffer, Reducer};
use ddp_comm::{Element, ProcessGroup, ReduceOp};

/// The ZeRO comm hook: a `reduce_scatter` of each bucket (padded to a multiple of the world
/// size), in place ([`ProcessGroup::reduce_scatter_in_place_async`]), instead of an
/// all-reduce. The work yields the bucket's own buffer whose chunk owned by this rank (see
/// [`ShardLayout`]) holds the average over ranks; the other elements are left unspecified (this
/// rank's unreduced gradient or partial sums): only the owned chunk is read
/// ([`shard_grads`]). Sends `(N-1)/N` of the bucket, half of a ring all-reduce; the parameter
/// all-gather is the other half. Nothing is allocated or copied per step on shared memory and
/// TCP (the in-place collectives write into the bucket).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ReduceScatterHook;

impl CommHook for ReduceScatterHook {
    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> BucketWork {
        let divisor = bucket.divisor();
        let index = bucket.index();
        match bucket.into_buffer() {
            BucketBuffer::Host(HostBuffer::F32(v)) => scatter(pg, v, divisor),
            BucketBuffer::Host(HostBuffer::F64(v)) => scatter(pg, v, divisor),
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
}

fn wrap<T>(v: Vec<T>) -> BucketBuffer
where
    HostBuffer: From<Vec<T>>,
{
    BucketBuffer::Host(HostBuffer::from(v))
}

fn scatter<T: Element>(pg: &ProcessGroup, mut v: Vec<T>, divisor: usize) -> BucketWork
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
    let (lo, hi) = ((rank * c).min(n), ((rank + 1) * c).min(n));
    BucketWork::from_work(pg.reduce_scatter_in_place_async(v, op), wrap::<T>).then(move |mut b| {
        if let BucketBuffer::Host(h) = &mut b {
            if divisor != world {
                let s = h.as_mut_slice::<T>().expect("the scatter keeps the dtype");
                T::div_by(&mut s[lo..hi], divisor);
            }
            h.truncate(n);
        }
        Ok(b)
    })
}

/// This rank's reduced gradient chunks, one per owned chunk of `layout` (after a synchronized
/// `Reducer::finish` with [`ReduceScatterHook`]): each is one contiguous copy out of its
/// bucket.
pub fn shard_grads(layout: &ShardLayout, reducer: &Reducer) -> Result<Vec<Vec<f32>>> {
    layout
        .chunks()
        .iter()
        .map(|c| {
            if c.is_empty() {
                return Ok(Vec::new());
            }
            let g = reducer.bucket_grads::<f32>(c.bucket)?;
            Ok(g[c.lo..c.hi].to_vec())
        })
        .collect()
}

/// Copies the parameter values of each owned chunk out of full parameters (`read(param)` gives
/// a parameter flat).
pub fn shard_params(
    layout: &ShardLayout,
    mut read: impl FnMut(usize) -> Result<Vec<f32>>,
) -> Result<Vec<Vec<f32>>> {
    let mut cache: Vec<Option<Vec<f32>>> = Vec::new();
    layout
        .chunks()
        .iter()
        .map(|c| {
            let mut out = vec![0f32; c.len()];
            for p in layout.pieces(c) {
                if cache.len() <= p.param {
                    cache.resize(p.param + 1, None);
                }
                if cache[p.param].is_none() {
                    cache[p.param] = Some(read(p.param)?);
                }
                let v = cache[p.param].as_ref().expect("just filled");
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
    write: impl FnMut(usize, &[f32]) -> Result<()>,
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
        |i, dst| {
            dst.copy_from_slice(&chunks[i]);
            Ok(())
        },
        write,
    )?;
    Ok(())
}

/// The parameter all-gather of a sharded step, in place in `bufs` (one per bucket of `layout`;
/// any contents, reused when their capacity suffices: ZeRO passes the reducer's bucket buffers):
/// `fill(i, dst)` writes this rank's values of chunk `i` straight into its block of bucket `i`'s
/// buffer, every bucket is all-gathered in place (one async collective per bucket, all in
/// flight together), and `write(param, values)` is called once per parameter with its full flat
/// values as each bucket arrives. Returns the buffers (`chunk_len · world` elements each). A
/// collective; `fill` runs for every bucket before the first collective starts, so a `fill`
/// error leaves the group in step.
pub fn gather_params_into(
    pg: &ProcessGroup,
    layout: &ShardLayout,
    mut bufs: Vec<Vec<f32>>,
    mut fill: impl FnMut(usize, &mut [f32]) -> Result<()>,
    mut write: impl FnMut(usize, &[f32]) -> Result<()>,
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
    for (i, (v, c)) in bufs.iter_mut().zip(&mine).enumerate() {
        v.resize(layout.buckets()[c.bucket].chunk_len(world) * world, 0.0);
        fill(i, &mut v[c.lo..c.hi])?;
    }
    let works: Vec<_> = bufs
        .into_iter()
        .map(|v| pg.all_gather_in_place_async(v))
        .collect();
    let mut failed = None;
    let mut out = Vec::with_capacity(works.len());
    for (work, c) in works.into_iter().zip(&mine) {
        let waited = {
            let _s = crate::trace::span("wait gather", "zero");
            work.wait()
        };
        match waited {
            Ok(full) => {
                if failed.is_none() {
                    let _s = crate::trace::span("write params", "zero");
                    for s in &layout.buckets()[c.bucket].slots {
                        if let Err(e) = write(s.param, &full[s.offset..s.offset + s.numel]) {
                            failed = Some(e);
                            break;
                        }
                    }
                }
                out.push(full);
            }
            Err(e) => {
                failed = failed.or(Some(Error::Comm(e)));
                out.push(Vec::new());
            }
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

/// PyTorch's `clip_grad_norm_` over sharded gradients: the global L2 norm of all gradients
/// (each rank's squared sum of its chunks, all-reduced), and every chunk scaled by
/// `max_norm / (norm + 1e-6)` when that is below 1. Returns the norm before clipping. A
/// collective.
pub fn clip_grad_norm(pg: &ProcessGroup, grads: &mut [Vec<f32>], max_norm: f64) -> Result<f64> {
    let local: f64 = grads
        .iter()
        .flatten()
        .map(|&g| f64::from(g) * f64::from(g))
        .sum();
    let mut total = [local];
    pg.all_reduce(&mut total, ReduceOp::Sum)?;
    let norm = total[0].sqrt();
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        let coef = coef as f32;
        for g in grads.iter_mut().flatten() {
            *g *= coef;
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
