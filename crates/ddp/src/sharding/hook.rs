//! The sharded step's communication: gradients reduce-scattered bucket by bucket through the
//! reducer's comm-hook trait ([`ReduceScatterHook`]), the owners' updated chunks all-gathered
//! ([`gather_params`]), and the cross-rank gradient norm for clipping ([`clip_grad_norm`]).

use super::layout::ShardLayout;
use crate::error::{Error, Result};
use crate::reducer::{BucketBuffer, BucketWork, CommHook, GradBucket, HostBuffer, Reducer};
use ddp_comm::{Element, ProcessGroup, ReduceOp};

/// The ZeRO comm hook: a `reduce_scatter` of each bucket (padded to a multiple of the world
/// size) instead of an all-reduce. The work yields a bucket-length buffer whose chunk owned by
/// this rank (see [`ShardLayout`]) holds the average over ranks; the other elements are zero.
/// Sends `(N-1)/N` of the bucket, half of a ring all-reduce; the parameter all-gather is the
/// other half.
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
    BucketWork::from_work(pg.reduce_scatter_async(v, op), wrap::<T>).then(move |b| {
        let lo = (rank * c).min(n);
        let hi = ((rank + 1) * c).min(n);
        let mut full = vec![T::zeroed(); n];
        if let BucketBuffer::Host(h) = &b {
            let chunk = h.as_slice::<T>().expect("the scatter keeps the dtype");
            full[lo..hi].copy_from_slice(&chunk[..hi - lo]);
        }
        let mut out = wrap(full);
        if divisor != world {
            out.div_by(divisor);
        }
        Ok(out)
    })
}

/// This rank's reduced gradient chunks, one per owned chunk of `layout` (after a synchronized
/// `Reducer::finish` with [`ReduceScatterHook`]).
pub fn shard_grads(layout: &ShardLayout, reducer: &Reducer) -> Result<Vec<Vec<f32>>> {
    layout
        .chunks()
        .iter()
        .map(|c| {
            let mut out = vec![0f32; c.len()];
            for p in layout.pieces(c) {
                let g = reducer.grad::<f32>(p.param)?;
                out[p.chunk_offset..p.chunk_offset + p.len]
                    .copy_from_slice(&g[p.param_offset..p.param_offset + p.len]);
            }
            Ok(out)
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
/// calls `write(param, values)` once per parameter with its full flat values. One async
/// all-gather per bucket, all in flight together. A collective.
pub fn gather_params(
    pg: &ProcessGroup,
    layout: &ShardLayout,
    chunks: Vec<Vec<f32>>,
    mut write: impl FnMut(usize, &[f32]) -> Result<()>,
) -> Result<()> {
    let world = layout.world_size();
    let mine = layout.chunks();
    if chunks.len() != mine.len() {
        return Err(Error::InvalidArgument(format!(
            "gather_params: {} chunks given, the layout has {} buckets",
            chunks.len(),
            mine.len()
        )));
    }
    let works: Vec<_> = chunks
        .into_iter()
        .zip(&mine)
        .map(|(mut v, c)| {
            let b = &layout.buckets()[c.bucket];
            v.resize(b.chunk_len(world), 0.0);
            pg.all_gather_async(v)
        })
        .collect();
    let mut failed = None;
    for (work, c) in works.into_iter().zip(&mine) {
        match work.wait() {
            Ok(full) if failed.is_none() => {
                for s in &layout.buckets()[c.bucket].slots {
                    write(s.param, &full[s.offset..s.offset + s.numel])?;
                }
            }
            Ok(_) => {}
            Err(e) => failed = failed.or(Some(e)),
        }
    }
    match failed {
        Some(e) => Err(Error::Comm(e)),
        None => Ok(()),
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
