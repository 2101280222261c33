//! The finite check ([`Reducer::set_check_finite`]): a training run whose gradients turned NaN or
//! infinite stops with an error instead of "succeeding" with a NaN model.
//!
//! The averaged gradients are identical on every rank, so every rank takes the same branch:
//! - healthy step: one pass over the averaged buckets after they are reduced (vectorized for
//!   `f32`/`f64`), no communication;
//! - non-finite step: one small extra collective (an `all_gather` of one `i64` per rank) finds
//!   the ranks whose *local* gradients were already non-finite — each rank noted, while copying
//!   its gradients into the buckets, the first parameter whose local gradient was — and every
//!   rank fails with the same [`Error::NonFinite`] naming the step, the lowest such rank and its
//!   parameter. If every local gradient was finite, the sum overflowed in the reduction: the
//!   error names the parameter of the averaged gradient and no rank.

use super::Reducer;
use crate::error::{Error, Result};
use crate::reducer::buffer::{BucketBuffer, HostBuffer};

/// Whether `x * 0` summed over `s` is zero: `x * 0` is `±0` for a finite `x` and NaN for NaN or
/// infinity, and the fixed-width accumulators let the compiler vectorize the loop.
macro_rules! all_finite_float {
    ($name:ident, $t:ty) => {
        fn $name(s: &[$t]) -> bool {
            const W: usize = 16;
            let mut acc = [0.0 as $t; W];
            let chunks = s.chunks_exact(W);
            let rest = chunks.remainder();
            for c in chunks {
                for i in 0..W {
                    acc[i] += c[i] * 0.0;
                }
            }
            acc.iter().chain(rest).all(|x| x.is_finite())
        }
    };
}
all_finite_float!(all_finite_f32, f32);
all_finite_float!(all_finite_f64, f64);

/// Whether elements `[start, start + len)` of `buf` are all finite.
pub(super) fn all_finite(buf: &BucketBuffer, start: usize, len: usize) -> bool {
    match buf {
        BucketBuffer::Host(HostBuffer::F32(v)) => all_finite_f32(&v[start..start + len]),
        BucketBuffer::Host(HostBuffer::F64(v)) => all_finite_f64(&v[start..start + len]),
        other => other.first_nonfinite(start, len).is_none(),
    }
}

impl Reducer {
    /// After a synchronized step `step`: `Err(NonFinite)` on every rank if an averaged gradient is
    /// NaN or infinite (see the module doc). Resets this rank's local note.
    pub(super) fn check_averaged_finite(&mut self, step: u64) -> Result<()> {
        let local = self.local_nonfinite.take();
        let averaged = self
            .averaged_shards()
            .find_map(|(buf, layout, shard)| match shard {
                None => layout
                    .iter()
                    .find(|p| !all_finite(buf, p.offset, p.numel))
                    .map(|p| p.index),
                Some(r) => {
                    // Only this rank's shard is averaged: its first non-finite element and the
                    // parameter holding it.
                    let at = buf.first_nonfinite(r.buffer.start, r.buffer.len())?;
                    let pos = r.bucket_start + at;
                    layout
                        .iter()
                        .find(|p| (p.offset..p.offset + p.numel).contains(&pos))
                        .map(|p| p.index)
                }
            });
        let averaged = if self.hook_shards() {
            // Every rank checked a different shard: the ranks agree first (one small
            // all-gather every step); the lowest rank that found one names its parameter.
            let pg = self.process_group();
            let mut all = vec![0i64; pg.size()];
            pg.all_gather(&[averaged.map_or(-1, |i| i as i64)], &mut all)?;
            all.iter().find(|&&i| i >= 0).map(|&i| i as usize)
        } else {
            // The averaged buckets are identical on every rank: so is this branch.
            averaged
        };
        let Some(averaged) = averaged else {
            return Ok(());
        };
        let pg = self.process_group();
        let mut all = vec![0i64; pg.size()];
        pg.all_gather(&[local.map_or(-1, |i| i as i64)], &mut all)?;
        let ranks: Vec<usize> = (0..all.len()).filter(|&r| all[r] >= 0).collect();
        let (rank, param) = match ranks.first() {
            Some(&r) => (Some(r), all[r] as usize),
            None => (None, averaged),
        };
        Err(Error::NonFinite {
            step,
            rank,
            parameter: self.specs()[param].name.clone(),
            ranks,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vectorized_check_finds_every_kind_of_non_finite_value() {
        for n in [0usize, 1, 15, 16, 17, 100] {
            let v = vec![1.5f32; n];
            assert!(all_finite_f32(&v));
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                for at in [0, n / 2, n.saturating_sub(1)] {
                    if n == 0 {
                        continue;
                    }
                    let mut w = v.clone();
                    w[at] = bad;
                    assert!(!all_finite_f32(&w), "{bad} at {at} of {n}");
                    let w64: Vec<f64> = w.iter().map(|&x| x as f64).collect();
                    assert!(!all_finite_f64(&w64));
                }
            }
        }
        // Large finite values times zero stay zero.
        assert!(all_finite_f32(&[f32::MAX; 40]));
    }
}
