//! Verification helpers (seed 000's checks), each answered identically on every rank:
//!
//! - [`verify_replicas`]: are all ranks' parameters bit-identical? If not: the largest absolute
//!   difference, the first differing parameter and element, and which ranks disagree with rank 0.
//!   One `all_gather_bytes` of per-parameter lengths and 64-bit hashes; only parameters whose
//!   hashes differ are then compared element-wise (an all-reduce `Max` of the values and of their
//!   negations, in chunks), so checking identical replicas costs one small message.
//! - [`verify_disjoint_shards`]: do the ranks' data shards overlap (seed 000's "data leakage":
//!   every rank training on the same samples)? Which indices are held by several ranks, how many
//!   are covered. One `all_gather_bytes`.
//! - [`OverlapMeter`]: aggregates the [`Reducer`](crate::reducer::Reducer)'s per-step
//!   [`StepStats`] (time blocked on communication vs backward+communication time) into per-step
//!   and mean figures, on one rank or across ranks.

use crate::error::{Error, Result};
use crate::reducer::StepStats;
use ddp_comm::{Element, ProcessGroup, ReduceOp};
use half::{bf16, f16};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// Elements compared per all-reduce in the element-wise pass of [`verify_replicas`].
const CHUNK: usize = 1 << 18;

// ---- replicas --------------------------------------------------------------------------------

/// Floating-point types [`verify_replicas`] compares: `f32`, `f64`, `f16`, `bf16`.
pub trait ReplicaValue: Element + Copy {
    /// The bit pattern as an `i64` ordered like IEEE 754 total order (`f32::total_cmp`): equal
    /// keys mean equal bits, and `Max`/`Min` of keys are the total-order max/min.
    fn order_key(self) -> i64;
    /// Inverse of [`order_key`](Self::order_key).
    fn from_order_key(key: i64) -> Self;
    fn to_f64(self) -> f64;
}

macro_rules! replica_value {
    ($t:ty, $int:ty, $uint:ty, $to_f64:expr) => {
        impl ReplicaValue for $t {
            fn order_key(self) -> i64 {
                let b = self.to_bits() as $int;
                (if b < 0 { b ^ <$int>::MAX } else { b }) as i64
            }
            fn from_order_key(key: i64) -> Self {
                let k = key as $int;
                <$t>::from_bits((if k < 0 { k ^ <$int>::MAX } else { k }) as $uint)
            }
            fn to_f64(self) -> f64 {
                $to_f64(self)
            }
        }
    };
}
replica_value!(f32, i32, u32, |x: f32| x as f64);
replica_value!(f64, i64, u64, |x: f64| x);
replica_value!(f16, i16, u16, |x: f16| x.to_f64());
replica_value!(bf16, i16, u16, |x: bf16| x.to_f64());

/// FxHash-style hash of the bit patterns. Each step is a bijection of the running state, so two
/// parameters differing in a single element always hash differently.
fn hash_param<T: ReplicaValue>(p: &[T]) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mut h = (p.len() as u64).wrapping_mul(K);
    for &x in p {
        h = (h.rotate_left(5) ^ x.order_key() as u64).wrapping_mul(K);
    }
    h
}

/// Result of [`verify_replicas`]; the same on every rank.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaReport {
    /// Every parameter is bit-identical on every rank (`-0.0` and `0.0` differ; equal NaN bit
    /// patterns agree).
    pub identical: bool,
    /// Largest `|max - min|` over ranks of any element; `0.0` when identical, `inf` when one rank
    /// has a NaN where another does not.
    pub max_abs_diff: f64,
    /// The first differing `(parameter index, element index)`.
    pub first_differing: Option<(usize, usize)>,
    /// Indices of the parameters that differ somewhere.
    pub differing_params: Vec<usize>,
    /// Number of elements that differ across ranks.
    pub differing_elements: usize,
    /// Ranks whose parameters are not identical to rank 0's.
    pub differing_ranks: Vec<usize>,
    /// Number of parameters and of elements compared.
    pub params: usize,
    pub elements: usize,
}

impl ReplicaReport {
    /// A one-line description naming parameters by `names` (registration order) instead of
    /// `#index`.
    pub fn describe<S: AsRef<str>>(&self, names: &[S]) -> String {
        let name = |i: usize| match names.get(i) {
            Some(n) => format!("`{}`", n.as_ref()),
            None => format!("#{i}"),
        };
        if self.identical {
            return format!(
                "replicas identical ({} parameters, {} elements)",
                self.params, self.elements
            );
        }
        let (p, e) = self.first_differing.unwrap_or_default();
        let list: Vec<String> = self
            .differing_params
            .iter()
            .take(8)
            .map(|&i| name(i))
            .collect();
        let more = if self.differing_params.len() > 8 {
            format!(" and {} more", self.differing_params.len() - 8)
        } else {
            String::new()
        };
        format!(
            "replicas differ: {} of {} elements in parameters {}{more}; max abs diff {:e}; first \
             at parameter {} element {e}; ranks {:?} differ from rank 0",
            self.differing_elements,
            self.elements,
            list.join(", "),
            self.max_abs_diff,
            name(p),
            self.differing_ranks
        )
    }
}

impl fmt::Display for ReplicaReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe::<&str>(&[]))
    }
}

/// Checks that every rank holds bit-identical parameters (`params` in the same order on every
/// rank, e.g. the reducer's registration order). Every rank gets the same report. Parameter
/// counts, lengths or element types that differ across ranks are an error ([`Error::Mismatch`])
/// on every rank. Identity is decided by 64-bit hashes (a multi-element difference could in
/// principle collide, with probability about 2⁻⁶⁴); differing parameters are compared exactly.
pub fn verify_replicas<T: ReplicaValue>(
    pg: &ProcessGroup,
    params: &[&[T]],
) -> Result<ReplicaReport> {
    let lens: Vec<u64> = params.iter().map(|p| p.len() as u64).collect();
    let hashes: Vec<u64> = params.iter().map(|p| hash_param(p)).collect();
    let header = serde_json::to_vec(&(T::DTYPE.to_string(), &lens, &hashes))
        .expect("serializing replica header");
    let all: Vec<(String, Vec<u64>, Vec<u64>)> = pg
        .all_gather_bytes(&header)?
        .iter()
        .enumerate()
        .map(|(r, b)| {
            serde_json::from_slice(b).map_err(|e| {
                Error::Mismatch(format!(
                    "verify_replicas: rank {r} sent an unreadable header: {e}"
                ))
            })
        })
        .collect::<Result<_>>()?;
    let (dtype0, lens0, hashes0) = &all[0];
    for (r, (dtype, lens, _)) in all.iter().enumerate().skip(1) {
        if dtype != dtype0 {
            return Err(Error::Mismatch(format!(
                "verify_replicas: rank 0 passed {dtype0} parameters, rank {r} passed {dtype}"
            )));
        }
        if lens != lens0 {
            let detail = match (0..lens.len().min(lens0.len())).find(|&i| lens[i] != lens0[i]) {
                Some(i) => format!(
                    "parameter #{i} has {} elements on rank 0 and {} on rank {r}",
                    lens0[i], lens[i]
                ),
                None => format!(
                    "rank 0 passed {} parameters, rank {r} passed {}",
                    lens0.len(),
                    lens.len()
                ),
            };
            return Err(Error::Mismatch(format!("verify_replicas: {detail}")));
        }
    }
    let differing_params: Vec<usize> = (0..params.len())
        .filter(|&i| all.iter().any(|(_, _, h)| h[i] != hashes0[i]))
        .collect();
    let differing_ranks: Vec<usize> = (1..all.len()).filter(|&r| all[r].2 != *hashes0).collect();

    let mut max_abs_diff = 0.0f64;
    let mut first_differing = None;
    let mut differing_elements = 0;
    let mut buf: Vec<i64> = Vec::new();
    for &p in &differing_params {
        let param = params[p];
        for start in (0..param.len()).step_by(CHUNK) {
            let chunk = &param[start..param.len().min(start + CHUNK)];
            let n = chunk.len();
            buf.clear();
            buf.extend(chunk.iter().map(|x| x.order_key()));
            buf.extend(chunk.iter().map(|x| !x.order_key())); // max of !k is !min of k
            pg.all_reduce(&mut buf, ReduceOp::Max)?;
            for i in 0..n {
                let (hi, lo) = (buf[i], !buf[n + i]);
                if hi == lo {
                    continue;
                }
                differing_elements += 1;
                first_differing.get_or_insert((p, start + i));
                let (a, b) = (
                    T::from_order_key(hi).to_f64(),
                    T::from_order_key(lo).to_f64(),
                );
                let d = if a.is_nan() || b.is_nan() {
                    f64::INFINITY
                } else {
                    (a - b).abs()
                };
                max_abs_diff = max_abs_diff.max(d);
            }
        }
    }
    Ok(ReplicaReport {
        identical: differing_params.is_empty(),
        max_abs_diff,
        first_differing,
        differing_params,
        differing_elements,
        differing_ranks,
        params: params.len(),
        elements: params.iter().map(|p| p.len()).sum(),
    })
}

// ---- shards ----------------------------------------------------------------------------------

/// Result of [`verify_disjoint_shards`]; the same on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardReport {
    /// No dataset index is held twice (by two ranks, or twice by one rank).
    pub disjoint: bool,
    /// Distinct in-range indices held by some rank.
    pub covered: usize,
    pub dataset_len: usize,
    pub world_size: usize,
    /// Indices held over all ranks, counting repeats.
    pub total: usize,
    /// Each index held more than once, ascending, with the ranks holding it (a rank appears once
    /// per occurrence).
    pub duplicates: Vec<(usize, Vec<usize>)>,
    /// `(index, rank)` for indices `>= dataset_len`.
    pub out_of_range: Vec<(usize, usize)>,
}

impl ShardReport {
    /// Every index of the dataset is held by some rank.
    pub fn complete(&self) -> bool {
        self.covered == self.dataset_len
    }

    /// A partition of the dataset up to `DistributedSampler`'s padding: complete, nothing out of
    /// range, and fewer than `world_size` repeated occurrences in all (the sampler pads
    /// `ceil(N/R)·R - N < R` indices by cycling from the start of its order).
    pub fn is_padded_partition(&self) -> bool {
        self.complete()
            && self.out_of_range.is_empty()
            && self.total - self.covered < self.world_size.max(1)
    }
}

impl fmt::Display for ShardReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "shards over {} ranks: {} of {} indices covered, {} held in all; ",
            self.world_size, self.covered, self.dataset_len, self.total
        )?;
        if self.disjoint {
            f.write_str("disjoint")?;
        } else {
            let shown: Vec<String> = self
                .duplicates
                .iter()
                .take(5)
                .map(|(i, r)| format!("{i} on ranks {r:?}"))
                .collect();
            write!(
                f,
                "{} indices held more than once ({}{})",
                self.duplicates.len(),
                shown.join(", "),
                if self.duplicates.len() > 5 {
                    ", ..."
                } else {
                    ""
                }
            )?;
        }
        if let Some((i, r)) = self.out_of_range.first() {
            write!(
                f,
                "; {} out of range (first: {i} on rank {r})",
                self.out_of_range.len()
            )?;
        }
        Ok(())
    }
}

/// Gathers every rank's sample indices (e.g. `DistributedSampler::indices()`) and reports which
/// are held more than once and how much of `0..dataset_len` is covered. Every rank gets the same
/// report; a `dataset_len` that differs across ranks is an error on every rank.
pub fn verify_disjoint_shards(
    pg: &ProcessGroup,
    my_indices: &[usize],
    dataset_len: usize,
) -> Result<ShardReport> {
    let mut payload = Vec::with_capacity(8 * (my_indices.len() + 1));
    for v in std::iter::once(dataset_len).chain(my_indices.iter().copied()) {
        payload.extend_from_slice(&(v as u64).to_le_bytes());
    }
    let all = pg.all_gather_bytes(&payload)?;
    let decoded: Vec<Vec<usize>> = all
        .iter()
        .map(|b| {
            b.chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
                .collect()
        })
        .collect();
    for (r, d) in decoded.iter().enumerate() {
        if d.first() != decoded[0].first() {
            return Err(Error::Mismatch(format!(
                "verify_disjoint_shards: rank 0 has a dataset of {} items, rank {r} of {}",
                decoded[0][0],
                d.first().map_or("?".to_string(), |n| n.to_string())
            )));
        }
    }
    let mut owner: Vec<Option<usize>> = vec![None; dataset_len];
    let mut dups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let mut out_of_range = Vec::new();
    let mut total = 0;
    for (r, d) in decoded.iter().enumerate() {
        for &i in &d[1..] {
            total += 1;
            match owner.get_mut(i) {
                None => out_of_range.push((i, r)),
                Some(o @ None) => *o = Some(r),
                Some(Some(first)) => dups.entry(i).or_insert_with(|| vec![*first]).push(r),
            }
        }
    }
    Ok(ShardReport {
        disjoint: dups.is_empty(),
        covered: owner.iter().filter(|o| o.is_some()).count(),
        dataset_len,
        world_size: pg.size(),
        total,
        duplicates: dups.into_iter().collect(),
        out_of_range,
    })
}

// ---- overlap ---------------------------------------------------------------------------------

/// Mean communication/computation overlap over steps (see [`OverlapMeter`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlapSummary {
    /// Steps summarized (over all ranks for [`OverlapMeter::summary_across_ranks`]).
    pub steps: u64,
    /// Mean backward+communication time per step ([`StepStats::total`]).
    pub mean_total: Duration,
    /// Mean time blocked waiting for communication per step ([`StepStats::comm_wait`]).
    pub mean_comm_wait: Duration,
    /// Longest wait of any step.
    pub max_comm_wait: Duration,
    /// Mean of [`StepStats::overlap`]: 1.0 means communication entirely hidden behind backward
    /// (1.0 when there are no steps).
    pub mean_overlap: f64,
}

impl OverlapSummary {
    fn from_sums(steps: f64, total: f64, wait: f64, overlap: f64, max_wait: f64) -> Self {
        let per = |x: f64| {
            if steps > 0.0 {
                Duration::from_secs_f64(x / steps)
            } else {
                Duration::ZERO
            }
        };
        OverlapSummary {
            steps: steps as u64,
            mean_total: per(total),
            mean_comm_wait: per(wait),
            max_comm_wait: Duration::from_secs_f64(max_wait),
            mean_overlap: if steps > 0.0 { overlap / steps } else { 1.0 },
        }
    }

    /// Fraction of all backward+communication time spent waiting for communication.
    pub fn comm_fraction(&self) -> f64 {
        if self.mean_total.is_zero() {
            0.0
        } else {
            self.mean_comm_wait.as_secs_f64() / self.mean_total.as_secs_f64()
        }
    }
}

impl fmt::Display for OverlapSummary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "overlap {:.1}%: {:.3} ms waiting for communication of {:.3} ms backward+communication \
             per step (max wait {:.3} ms, {} steps)",
            self.mean_overlap * 100.0,
            self.mean_comm_wait.as_secs_f64() * 1e3,
            self.mean_total.as_secs_f64() * 1e3,
            self.max_comm_wait.as_secs_f64() * 1e3,
            self.steps
        )
    }
}

/// Collects the reducer's [`StepStats`] of synchronized steps (pass what
/// [`Reducer::finish`](crate::reducer::Reducer::finish) returns), skipping the first `warmup`
/// ones (connection set-up, allocation), and summarizes them.
#[derive(Debug, Clone, Default)]
pub struct OverlapMeter {
    warmup: usize,
    skipped: usize,
    steps: Vec<StepStats>,
}

impl OverlapMeter {
    pub fn new() -> Self {
        Self::default()
    }

    /// A meter ignoring the first `steps` synchronized steps.
    pub fn with_warmup(steps: usize) -> Self {
        OverlapMeter {
            warmup: steps,
            ..Self::default()
        }
    }

    /// Records one step; returns whether it was kept (unsynchronized `no_sync` steps and warm-up
    /// steps are not).
    pub fn record(&mut self, stats: StepStats) -> bool {
        if !stats.synced {
            return false;
        }
        if self.skipped < self.warmup {
            self.skipped += 1;
            return false;
        }
        self.steps.push(stats);
        true
    }

    /// The recorded steps, in order (the per-step figures: [`StepStats::overlap`] etc.).
    pub fn steps(&self) -> &[StepStats] {
        &self.steps
    }

    fn sums(&self) -> [f64; 4] {
        let mut s = [self.steps.len() as f64, 0.0, 0.0, 0.0];
        for st in &self.steps {
            s[1] += st.total.as_secs_f64();
            s[2] += st.comm_wait.as_secs_f64();
            s[3] += st.overlap();
        }
        s
    }

    fn max_wait(&self) -> f64 {
        self.steps
            .iter()
            .map(|s| s.comm_wait.as_secs_f64())
            .fold(0.0, f64::max)
    }

    /// Means over this rank's recorded steps.
    pub fn summary(&self) -> OverlapSummary {
        let [n, t, w, o] = self.sums();
        OverlapSummary::from_sums(n, t, w, o, self.max_wait())
    }

    /// Means over every rank's recorded steps (two small all-reduces; call on every rank). The
    /// same on every rank.
    pub fn summary_across_ranks(&self, pg: &ProcessGroup) -> Result<OverlapSummary> {
        let mut sums = self.sums();
        pg.all_reduce(&mut sums, ReduceOp::Sum)?;
        let mut max = [self.max_wait()];
        pg.all_reduce(&mut max, ReduceOp::Max)?;
        let [n, t, w, o] = sums;
        Ok(OverlapSummary::from_sums(n, t, w, o, max[0]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_keys_follow_total_order_and_round_trip() {
        let vals = [
            f32::NEG_INFINITY,
            -1.5,
            -f32::MIN_POSITIVE,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for w in vals.windows(2) {
            assert!(w[0].order_key() < w[1].order_key(), "{} < {}", w[0], w[1]);
        }
        for v in vals.iter().copied().chain([f32::NAN, -f32::NAN]) {
            assert_eq!(f32::from_order_key(v.order_key()).to_bits(), v.to_bits());
        }
        for v in [-0.0f64, 0.0, -3.25, f64::MAX, f64::NAN, -f64::NAN] {
            assert_eq!(f64::from_order_key(v.order_key()).to_bits(), v.to_bits());
        }
        assert!((-1.0f64).order_key() < (-0.5f64).order_key());
        for v in [-2.5f32, -0.0, 0.0, 7.0] {
            let h = bf16::from_f32(v);
            assert_eq!(bf16::from_order_key(h.order_key()), h);
            let h = f16::from_f32(v);
            assert_eq!(f16::from_order_key(h.order_key()).to_bits(), h.to_bits());
        }
        assert!(f16::from_f32(-1.0).order_key() < f16::from_f32(0.5).order_key());
    }

    #[test]
    fn hash_tells_single_element_changes_apart() {
        let a: Vec<f32> = (0..1000).map(|i| i as f32 * 0.01).collect();
        let h = hash_param(&a);
        for i in [0, 1, 500, 999] {
            let mut b = a.clone();
            b[i] = f32::from_bits(b[i].to_bits() ^ 1);
            assert_ne!(hash_param(&b), h, "flip at {i}");
        }
        let mut z = a.clone();
        z[0] = -0.0;
        assert_ne!(hash_param(&z), h);
        assert_ne!(hash_param(&a[..999]), h);
        assert_eq!(hash_param(&a.clone()), h);
    }

    fn st(synced: bool, total_ms: u64, wait_ms: u64) -> StepStats {
        StepStats {
            synced,
            total: Duration::from_millis(total_ms),
            comm_wait: Duration::from_millis(wait_ms),
            buckets: 1,
            bytes: 8,
        }
    }

    #[test]
    fn overlap_meter_means_skip_warmup_and_unsynced_steps() {
        let mut m = OverlapMeter::with_warmup(1);
        assert!(!m.record(st(true, 500, 500))); // warm-up
        assert!(!m.record(st(false, 3, 0))); // no_sync
        assert!(m.record(st(true, 100, 50)));
        assert!(m.record(st(true, 300, 0)));
        assert_eq!(m.steps().len(), 2);
        let s = m.summary();
        assert_eq!(s.steps, 2);
        assert_eq!(s.mean_total, Duration::from_millis(200));
        assert_eq!(s.mean_comm_wait, Duration::from_millis(25));
        assert_eq!(s.max_comm_wait, Duration::from_millis(50));
        assert!((s.mean_overlap - 0.75).abs() < 1e-12); // (0.5 + 1.0) / 2
        assert!((s.comm_fraction() - 0.125).abs() < 1e-9);
        assert!(s.to_string().contains("overlap 75.0%"), "{s}");
        let empty = OverlapMeter::new().summary();
        assert_eq!((empty.steps, empty.mean_overlap), (0, 1.0));
        assert_eq!(empty.comm_fraction(), 0.0);
    }
}
