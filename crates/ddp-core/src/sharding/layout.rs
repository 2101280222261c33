//! [`ShardLayout`]: which rank owns which elements of the flat parameter space.
//!
//! The flat space is the reducer's buckets, in launch order. Bucket `b` of `n` elements is cut
//! into `world` chunks of `c = ceil(n / world)` elements (the last ones shorter or empty): rank
//! `r` owns elements `[r·c, min((r+1)·c, n))` of every bucket. This is exactly the block a
//! `reduce_scatter` of the bucket (padded to `c·world`) leaves on rank `r`, so the gradient
//! reduce-scatter hands each owner its chunk and the parameter all-gather puts the owners'
//! chunks back together, bucket by bucket.
//!
//! ```text
//!  bucket 0 (n = 10, world 3, c = 4)     bucket 1 (n = 5, c = 2)
//!  [ r0 r0 r0 r0 | r1 r1 r1 r1 | r2 r2 ] [ r0 r0 | r1 r1 | r2 ]
//!    └─ a chunk may span parameters: a [`Piece`] is the part of one parameter in one chunk
//! ```

use crate::error::{Error, Result};
use crate::reducer::{BucketInfo, ParamSpec};
use ddp_comm::DType;

/// One parameter's place in one bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketSlot {
    /// Parameter index (registration order).
    pub param: usize,
    /// First element in the bucket.
    pub offset: usize,
    /// Elements.
    pub numel: usize,
}

/// A bucket of the flat space.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardBucket {
    /// The parameters in bucket order.
    pub slots: Vec<BucketSlot>,
    /// Elements.
    pub numel: usize,
}

impl ShardBucket {
    /// Chunk length `ceil(numel / world)`.
    pub fn chunk_len(&self, world: usize) -> usize {
        self.numel.div_ceil(world)
    }

    /// The elements `[lo, hi)` of this bucket that `rank` owns.
    pub fn owned(&self, world: usize, rank: usize) -> (usize, usize) {
        owned(self.numel, world, rank)
    }
}

/// The elements `[lo, hi)` of a bucket of `numel` elements that `rank` of `world` owns: chunk
/// `rank` of `ceil(numel / world)` elements, cut at the end (the one rule every part of a
/// sharded step shares).
pub fn owned(numel: usize, world: usize, rank: usize) -> (usize, usize) {
    let c = numel.div_ceil(world);
    ((rank * c).min(numel), ((rank + 1) * c).min(numel))
}

/// The part of one parameter inside one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Parameter index.
    pub param: usize,
    /// First element within the parameter (flat, row-major).
    pub param_offset: usize,
    /// First element within the chunk.
    pub chunk_offset: usize,
    /// Elements.
    pub len: usize,
}

/// A chunk owned by this rank: bucket `bucket`, elements `[lo, hi)` of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub bucket: usize,
    pub lo: usize,
    pub hi: usize,
}

impl Chunk {
    pub fn len(&self) -> usize {
        self.hi - self.lo
    }

    pub fn is_empty(&self) -> bool {
        self.hi == self.lo
    }
}

/// The partition of the flat parameter space over the ranks (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    world: usize,
    rank: usize,
    buckets: Vec<ShardBucket>,
}

impl ShardLayout {
    /// The layout of the reducer's `buckets` (`Reducer::buckets`) for `rank` of `world`. Only
    /// `f32` parameters can be sharded (optimizer state and checkpoints are `f32`); another
    /// dtype is an error naming the parameter.
    pub fn new(
        specs: &[ParamSpec],
        buckets: &[BucketInfo],
        world: usize,
        rank: usize,
    ) -> Result<ShardLayout> {
        if world == 0 || rank >= world {
            return Err(Error::InvalidArgument(format!(
                "ShardLayout: rank {rank} of world size {world}"
            )));
        }
        let mut out = Vec::with_capacity(buckets.len());
        for b in buckets {
            let mut offset = 0;
            let mut slots = Vec::with_capacity(b.params.len());
            for &p in &b.params {
                let spec = &specs[p];
                if spec.dtype != DType::F32 {
                    return Err(Error::InvalidArgument(format!(
                        "ZeRO sharding supports f32 parameters only; parameter {spec} is {}",
                        spec.dtype
                    )));
                }
                slots.push(BucketSlot {
                    param: p,
                    offset,
                    numel: spec.numel(),
                });
                offset += spec.numel();
            }
            out.push(ShardBucket {
                slots,
                numel: offset,
            });
        }
        Ok(ShardLayout {
            world,
            rank,
            buckets: out,
        })
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn buckets(&self) -> &[ShardBucket] {
        &self.buckets
    }

    /// This rank's chunk of every bucket, in bucket order (empty ones included).
    pub fn chunks(&self) -> Vec<Chunk> {
        self.buckets
            .iter()
            .enumerate()
            .map(|(bucket, b)| {
                let (lo, hi) = b.owned(self.world, self.rank);
                Chunk { bucket, lo, hi }
            })
            .collect()
    }

    /// Elements this rank owns in total.
    pub fn owned_numel(&self) -> usize {
        self.chunks().iter().map(Chunk::len).sum()
    }

    /// Elements of the whole flat space.
    pub fn numel(&self) -> usize {
        self.buckets.iter().map(|b| b.numel).sum()
    }

    /// The parameter pieces of `chunk`, in chunk order.
    pub fn pieces(&self, chunk: &Chunk) -> Vec<Piece> {
        self.buckets[chunk.bucket]
            .slots
            .iter()
            .filter_map(|s| {
                let lo = chunk.lo.max(s.offset);
                let hi = chunk.hi.min(s.offset + s.numel);
                (lo < hi).then(|| Piece {
                    param: s.param,
                    param_offset: lo - s.offset,
                    chunk_offset: lo - chunk.lo,
                    len: hi - lo,
                })
            })
            .collect()
    }

    /// Where weight decay applies in `chunk`: runs `(start, decays)` in chunk order, each up to
    /// the next's start (the first at 0), merged where neighbours agree; `decays[p]` says
    /// whether parameter `p` decays. What a sharded optimizer needs to apply PyTorch's
    /// parameter groups (e.g. nanoGPT's decay on 2-D weights only) to a chunk that spans
    /// parameters of both groups.
    pub fn decay_runs(&self, chunk: &Chunk, decays: &[bool]) -> Vec<(usize, bool)> {
        let mut runs: Vec<(usize, bool)> = Vec::new();
        for p in self.pieces(chunk) {
            let d = decays.get(p.param).copied().unwrap_or(false);
            if runs.last().is_none_or(|&(_, last)| last != d) {
                runs.push((p.chunk_offset, d));
            }
        }
        if runs.is_empty() {
            runs.push((0, false));
        }
        runs
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The layout of f32 parameters `p{i}` of `sizes[i]` elements in `buckets` (parameter
    /// indices, in fill order) for `rank` of `world`.
    pub(crate) fn layout(
        sizes: &[usize],
        buckets: &[&[usize]],
        world: usize,
        rank: usize,
    ) -> ShardLayout {
        let specs: Vec<ParamSpec> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| ParamSpec::new(format!("p{i}"), vec![n], DType::F32))
            .collect();
        let infos: Vec<BucketInfo> = buckets
            .iter()
            .map(|ps| BucketInfo {
                dtype: DType::F32,
                params: ps.to_vec(),
                numel: ps.iter().map(|&p| sizes[p]).sum(),
            })
            .collect();
        ShardLayout::new(&specs, &infos, world, rank).unwrap()
    }

    #[test]
    fn the_ranks_chunks_tile_every_bucket_exactly_once() {
        for world in 1..=5 {
            for sizes in [&[0usize, 1, 7][..], &[3, 0], &[13, 2, 9, 1]] {
                let all: Vec<usize> = (0..sizes.len()).rev().collect();
                let split: Vec<&[usize]> = vec![&all[..1], &all[1..]];
                let mut seen: Vec<Vec<u32>> = sizes.iter().map(|&n| vec![0; n]).collect();
                for rank in 0..world {
                    let l = layout(sizes, &split, world, rank);
                    assert_eq!(l.numel(), sizes.iter().sum::<usize>());
                    for c in l.chunks() {
                        let mut at = 0;
                        for p in l.pieces(&c) {
                            assert_eq!(p.chunk_offset, at, "pieces are contiguous");
                            at += p.len;
                            for e in &mut seen[p.param][p.param_offset..p.param_offset + p.len] {
                                *e += 1;
                            }
                        }
                        assert_eq!(at, c.len());
                    }
                }
                assert!(seen.iter().flatten().all(|&k| k == 1), "{world} {sizes:?}");
            }
        }
    }

    #[test]
    fn decay_runs_follow_the_parameters_of_each_chunk() {
        // p0 (5, decays), p1 (3, not), p2 (4, decays), one bucket, world 2: rank 0 owns
        // elements 0..6 (p0, one of p1), rank 1 owns 6..12 (two of p1, p2).
        let decays = [true, false, true];
        let l0 = layout(&[5, 3, 4], &[&[0, 1, 2]], 2, 0);
        let l1 = layout(&[5, 3, 4], &[&[0, 1, 2]], 2, 1);
        assert_eq!(
            l0.decay_runs(&l0.chunks()[0], &decays),
            [(0, true), (5, false)]
        );
        assert_eq!(
            l1.decay_runs(&l1.chunks()[0], &decays),
            [(0, false), (2, true)]
        );
        // Neighbours that agree merge; a chunk of one kind is one run.
        let all = [true, true, true];
        assert_eq!(l0.decay_runs(&l0.chunks()[0], &all), [(0, true)]);
        let l = layout(&[5, 3, 4], &[&[0, 1, 2]], 1, 0);
        assert_eq!(
            l.decay_runs(&l.chunks()[0], &decays),
            [(0, true), (5, false), (8, true)]
        );
    }

    #[test]
    fn non_f32_parameters_are_refused_by_name() {
        let specs = vec![ParamSpec::new("emb", vec![2], DType::F16)];
        let infos = vec![BucketInfo {
            dtype: DType::F16,
            params: vec![0],
            numel: 2,
        }];
        let e = ShardLayout::new(&specs, &infos, 2, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("emb") && e.contains("f32"), "{e}");
    }
}
