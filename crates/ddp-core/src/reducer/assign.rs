//! Bucket assignment ([`compute_bucket_assignment`]): parameters are visited in *reverse*
//! registration order (gradients of the last layers are ready first in backward), buckets are per
//! dtype, the first bucket of each dtype is capped at `first_bucket_cap_mb` (1 MiB) and the rest
//! at `bucket_cap_mb` (25 MiB) — PyTorch's names and defaults. A bucket is closed once it reaches
//! its cap, so it may exceed it by one parameter (a parameter is never split).
//!
//! PyTorch's bucket *rebuilding* after the first iteration (reordering by observed readiness) is
//! not done: the reverse registration order is kept, which is the order of a sequential model's
//! backward.

use super::spec::ParamSpec;
use ddp_comm::DType;

pub(crate) const MIB: f64 = 1024.0 * 1024.0;

/// PyTorch's `bucket_cap_mb` default.
pub const DEFAULT_BUCKET_CAP_MB: f64 = 25.0;
/// PyTorch's `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB), in MiB.
pub const DEFAULT_FIRST_BUCKET_CAP_MB: f64 = 1.0;

/// Bucket sizes, with PyTorch's names and defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReducerOptions {
    /// Cap of every bucket but the first of each dtype, in MiB (default 25).
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket of each dtype, in MiB (default 1): small, so that the first
    /// all-reduce starts early in backward.
    pub first_bucket_cap_mb: f64,
}

impl Default for ReducerOptions {
    fn default() -> Self {
        ReducerOptions {
            bucket_cap_mb: DEFAULT_BUCKET_CAP_MB,
            first_bucket_cap_mb: DEFAULT_FIRST_BUCKET_CAP_MB,
        }
    }
}

/// Groups parameter indices into buckets: reverse registration order, one running bucket per
/// dtype, the first bucket of each dtype capped at `first_bucket_cap_mb`, the others at
/// `bucket_cap_mb`. Returned buckets are in launch order: bucket 0 holds the last parameters.
pub fn compute_bucket_assignment(specs: &[ParamSpec], opts: &ReducerOptions) -> Vec<Vec<usize>> {
    let first_cap = (opts.first_bucket_cap_mb.max(0.0) * MIB) as usize;
    let cap = (opts.bucket_cap_mb.max(0.0) * MIB) as usize;
    // dtype -> (open bucket, its bytes, buckets closed so far for this dtype)
    let mut open: Vec<(DType, Vec<usize>, usize, usize)> = Vec::new();
    let mut closed: Vec<Vec<usize>> = Vec::new();
    for idx in (0..specs.len()).rev() {
        let dtype = specs[idx].dtype;
        let slot = match open.iter().position(|o| o.0 == dtype) {
            Some(p) => p,
            None => {
                open.push((dtype, Vec::new(), 0, 0));
                open.len() - 1
            }
        };
        let o = &mut open[slot];
        o.1.push(idx);
        o.2 += specs[idx].bytes();
        let limit = if o.3 == 0 { first_cap } else { cap };
        if o.2 >= limit {
            closed.push(std::mem::take(&mut o.1));
            o.2 = 0;
            o.3 += 1;
        }
    }
    closed.extend(open.into_iter().map(|o| o.1).filter(|b| !b.is_empty()));
    // Launch order: the bucket whose gradients are ready first (highest parameter index) first.
    closed.sort_by_key(|b| std::cmp::Reverse(b.iter().copied().max().unwrap_or(0)));
    closed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, numel: usize, dtype: DType) -> ParamSpec {
        ParamSpec::new(name, vec![numel], dtype)
    }

    #[test]
    fn buckets_are_reverse_order_with_small_first_bucket() {
        // 4 f32 params of 256 KiB each and one of 2 MiB; first cap 0.5 MiB, cap 1 MiB.
        let q = 64 * 1024; // elements in 256 KiB
        let specs = vec![
            spec("a", q, DType::F32),
            spec("b", q, DType::F32),
            spec("c", 8 * q, DType::F32),
            spec("d", q, DType::F32),
            spec("e", q, DType::F32),
        ];
        let opts = ReducerOptions {
            bucket_cap_mb: 1.0,
            first_bucket_cap_mb: 0.5,
        };
        let b = compute_bucket_assignment(&specs, &opts);
        // e+d reach 0.5 MiB -> first bucket; c alone exceeds 1 MiB; b+a remain.
        assert_eq!(b, vec![vec![4, 3], vec![2], vec![1, 0]]);
    }

    #[test]
    fn buckets_are_per_dtype_and_ordered_by_readiness() {
        let specs = vec![
            spec("a", 10, DType::F64),
            spec("b", 10, DType::F32),
            spec("c", 10, DType::F64),
            spec("d", 10, DType::F32),
        ];
        let b = compute_bucket_assignment(&specs, &ReducerOptions::default());
        assert_eq!(b, vec![vec![3, 1], vec![2, 0]]);
    }

    #[test]
    fn every_parameter_lands_in_exactly_one_bucket() {
        let specs: Vec<_> = (0..50)
            .map(|i| spec(&format!("p{i:02}"), 1000 * (i % 7 + 1), DType::F32))
            .collect();
        let opts = ReducerOptions {
            bucket_cap_mb: 0.05,
            first_bucket_cap_mb: 0.01,
        };
        let b = compute_bucket_assignment(&specs, &opts);
        let mut all: Vec<usize> = b.iter().flatten().copied().collect();
        all.sort();
        assert_eq!(all, (0..50).collect::<Vec<_>>());
        assert!(b.len() > 3);
        // Within and across buckets, indices descend (reverse registration order).
        let flat: Vec<usize> = b.iter().flatten().copied().collect();
        assert!(flat.windows(2).all(|w| w[0] > w[1]));
    }
}
