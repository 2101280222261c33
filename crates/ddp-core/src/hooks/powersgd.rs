//! PowerSGD (Vogels et al., 2019), PyTorch's `powerSGD_hook` and `batched_powerSGD_hook`.
//!
//! Per bucket, after `start_powersgd_iter` steps of plain all-reduce:
//! 1. add the error-feedback residual of this bucket to the gradients (kept per rank);
//! 2. view each gradient as a matrix `M` (`shape[0]` × the rest) and compress it when
//!    `(n + m)·r · min_compression_rate < n·m`; the others (1-D, small) are all-reduced
//!    uncompressed, in one batch;
//! 3. `P = M Q` (`Q`: `m×r`, random and orthogonalized the first time, then the previous step's,
//!    "warm start"), all-reduce every `P` at once (in the same all-reduce as the uncompressed
//!    ones: one collective where PyTorch issues two), orthogonalize each (Gram-Schmidt);
//! 4. `Q = Mᵀ P`, all-reduce every `Q` at once, divide by the divisor;
//! 5. `M ≈ P Qᵀ` (the projection of the average gradient onto the span of `P`); the residual
//!    `input − M̂` becomes the next step's error feedback.
//!
//! Steps 3 (from the all-reduce on) to 5 run as one chain on the group's thread
//! ([`ProcessGroup::chain_async`]), like PyTorch's `Future.then` callbacks: a bucket's `Q` is
//! computed and all-reduced as soon as its `P` arrives, while backward still produces the next
//! buckets, not when the reducer waits for it after backward.
//!
//! The batched variant treats the whole bucket, zero-padded, as one `⌈√N⌉ × ⌈√N⌉` matrix.
//!
//! Differences from PyTorch: random `Q`s come from a generator seeded by `random_seed` and the
//! number of draws so far (the same on every rank, and a counter in checkpoints) instead of
//! NumPy's; a zero (or numerically dependent) column of `P` stays zero instead of turning into
//! NaN or noise; under Join the residual is taken against the world-size average; the residual is kept in
//! `f32` even for 16-bit buckets; `start_powersgd_iter` may be 0 or 1 (there is no bucket
//! rebuilding to wait for).

use super::{narrow, restore, to_f32, wire_dtype};
use crate::checkpoint::TensorData;
use crate::error::{Error, Result};
use crate::reducer::{BucketWork, CommHook, GradBucket, HookState, PendingBucket};
use ddp_comm::process_group::Chain;
use ddp_comm::{DType, ProcessGroup, ReduceOp, Work};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// PyTorch's `PowerSGDState` (its names and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PowerSgdState {
    /// Rank `r` of the approximation (default 1).
    pub matrix_approximation_rank: usize,
    /// Steps of plain all-reduce before compression starts (default 1000).
    pub start_powersgd_iter: u64,
    /// A matrix is compressed only if `(n + m)·r · min_compression_rate < n·m` (default 2).
    pub min_compression_rate: f64,
    /// Keep the compression residual and add it to the next step's gradients (default true).
    pub use_error_feedback: bool,
    /// Start each step's power iteration from the previous step's `Q` (default true).
    pub warm_start: bool,
    /// Added to each column norm in the orthogonalization (default 0).
    pub orthogonalization_epsilon: f32,
    /// Seed of the random initial `Q`s (default 0; the same on every rank).
    pub random_seed: u64,
}

impl Default for PowerSgdState {
    fn default() -> Self {
        PowerSgdState {
            matrix_approximation_rank: 1,
            start_powersgd_iter: 1000,
            min_compression_rate: 2.0,
            use_error_feedback: true,
            warm_start: true,
            orthogonalization_epsilon: 0.0,
            random_seed: 0,
        }
    }
}

/// Error-feedback residuals and warm-start `Q`s, per bucket index (shared with the work in
/// flight, which updates them when the bucket completes).
#[derive(Debug, Default)]
struct Memory {
    error: BTreeMap<usize, Vec<f32>>,
    q: BTreeMap<usize, Vec<f32>>,
}

/// PyTorch's `powerSGD_hook` ([`new`](Self::new)) or `batched_powerSGD_hook`
/// ([`batched`](Self::batched)), with its `PowerSGDState`.
pub struct PowerSgdHook {
    state: PowerSgdState,
    batched: bool,
    /// Synchronized steps seen (PyTorch's `state.iter`).
    iter: u64,
    /// Random `Q` initializations drawn so far (seeds the next one).
    draws: u64,
    memory: Arc<Mutex<Memory>>,
    sent: u64,
}

/// One matrix of the bucket: `n×m` at `offset` of the work vector, approximated at rank `r`;
/// its `P` at `p` of the concatenated `P`s and its `Q` at `q` of the concatenated `Q`s.
#[derive(Debug, Clone, Copy)]
struct Mat {
    offset: usize,
    n: usize,
    m: usize,
    r: usize,
    p: usize,
    q: usize,
}

impl PowerSgdHook {
    /// `powerSGD_hook` with `state`.
    pub fn new(state: PowerSgdState) -> Result<PowerSgdHook> {
        Self::build(state, false)
    }

    /// `batched_powerSGD_hook`: the whole bucket as one square matrix.
    pub fn batched(state: PowerSgdState) -> Result<PowerSgdHook> {
        Self::build(state, true)
    }

    fn build(state: PowerSgdState, batched: bool) -> Result<PowerSgdHook> {
        if state.matrix_approximation_rank == 0 {
            return Err(Error::InvalidArgument(
                "PowerSGD: matrix_approximation_rank must be at least 1".into(),
            ));
        }
        if !(state.min_compression_rate >= 0.0 && state.min_compression_rate.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "PowerSGD: min_compression_rate must be a finite number >= 0, got {}",
                state.min_compression_rate
            )));
        }
        // Also refuses NaN.
        if state.orthogonalization_epsilon.is_nan() || state.orthogonalization_epsilon < 0.0 {
            return Err(Error::InvalidArgument(format!(
                "PowerSGD: orthogonalization_epsilon must be >= 0, got {}",
                state.orthogonalization_epsilon
            )));
        }
        Ok(PowerSgdHook {
            state,
            batched,
            iter: 0,
            draws: 0,
            memory: Arc::default(),
            sent: 0,
        })
    }

    /// The state it was built with.
    pub fn state(&self) -> &PowerSgdState {
        &self.state
    }

    /// Synchronized steps seen so far (PyTorch's `iter`).
    pub fn iter(&self) -> u64 {
        self.iter
    }

    /// The error-feedback residual of bucket `index` (a copy), once it exists.
    pub fn error(&self, index: usize) -> Option<Vec<f32>> {
        self.lock().error.get(&index).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn kind(&self) -> &'static str {
        if self.batched {
            "batched_powersgd"
        } else {
            "powersgd"
        }
    }

    /// Fills `q` (`m×r` row-major) with standard normal numbers, the same on every rank.
    fn random_q(&mut self, q: &mut [f32]) {
        let seed = self.state.random_seed ^ self.draws.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.draws += 1;
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for pair in q.chunks_mut(2) {
            // Box-Muller.
            let u1: f64 = 1.0 - rng.gen::<f64>();
            let u2: f64 = rng.gen();
            let rad = (-2.0 * u1.ln()).sqrt();
            let th = std::f64::consts::TAU * u2;
            pair[0] = (rad * th.cos()) as f32;
            if let Some(x) = pair.get_mut(1) {
                *x = (rad * th.sin()) as f32;
            }
        }
    }

    /// The matrices of a bucket and the ranges all-reduced uncompressed.
    fn plan(&self, bucket: &GradBucket, len: usize) -> (Vec<Mat>, Vec<(usize, usize)>, usize) {
        let rank = self.state.matrix_approximation_rank;
        let (mut mats, mut unc) = (Vec::new(), Vec::new());
        let (mut p, mut q) = (0, 0);
        if self.batched {
            let side = (len as f64).sqrt().ceil() as usize;
            let side = if side * side < len { side + 1 } else { side };
            if side > 0 {
                let r = rank.min(side);
                mats.push(Mat {
                    offset: 0,
                    n: side,
                    m: side,
                    r,
                    p: 0,
                    q: 0,
                });
            }
            return (mats, unc, side * side);
        }
        for (param, shape) in bucket.parameters().iter().zip(bucket.shapes()) {
            let n = shape.first().copied().unwrap_or(1);
            let m = param.numel.checked_div(n).unwrap_or(0);
            let r = rank.min(n).min(m);
            let compressed = ((n + m) * r) as f64 * self.state.min_compression_rate;
            if r > 0 && shape.len() >= 2 && compressed < (n * m) as f64 {
                mats.push(Mat {
                    offset: param.offset,
                    n,
                    m,
                    r,
                    p,
                    q,
                });
                p += n * r;
                q += m * r;
            } else if param.numel > 0 {
                unc.push((param.offset, param.numel));
            }
        }
        (mats, unc, len)
    }
}

impl CommHook for PowerSgdHook {
    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> BucketWork {
        let (index, divisor) = (bucket.index(), bucket.divisor());
        if self.iter < self.state.start_powersgd_iter {
            if bucket.is_last() {
                self.iter += 1;
            }
            self.sent += (bucket.buffer().len() * bucket.buffer().dtype().size()) as u64;
            return crate::reducer::AllReduceHook.run(pg, bucket);
        }
        let mut input = match to_f32(bucket.buffer(), self.kind(), index) {
            Ok(v) => v,
            Err(e) => return BucketWork::ready(Err(e)),
        };
        let len = input.len();
        let wire = wire_dtype(bucket.buffer().dtype());
        let (mats, unc, padded) = self.plan(&bucket, len);
        input.resize(padded, 0.0);
        let ef = self.state.use_error_feedback;
        let mut memory = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        if ef {
            match memory.error.get(&index) {
                Some(e) if e.len() == padded => {
                    input.iter_mut().zip(e).for_each(|(x, e)| *x += e);
                }
                _ => {
                    memory.error.insert(index, vec![0.0; padded]);
                }
            }
        }
        let input_cp = if ef { input.clone() } else { Vec::new() };
        // Q: the previous step's (warm start) or fresh random ones.
        let q_len: usize = mats.iter().map(|t| t.m * t.r).sum();
        let mut qs = match memory.q.get(&index) {
            Some(q) if self.state.warm_start && q.len() == q_len => q.clone(),
            _ => Vec::new(),
        };
        drop(memory);
        if qs.is_empty() && q_len > 0 {
            qs = vec![0.0; q_len];
            for t in &mats {
                let q = &mut qs[t.q..t.q + t.m * t.r];
                self.random_q(q);
                if !self.batched {
                    orthogonalize(q, t.m, t.r, self.state.orthogonalization_epsilon);
                }
            }
        }
        let p_len: usize = mats.iter().map(|t| t.n * t.r).sum();
        // One all-reduce carries the uncompressed tensors and every `P` (PyTorch sends them
        // in two, one after the other).
        let unc_len: usize = unc.iter().map(|&(_, n)| n).sum();
        let mut first = Vec::with_capacity(unc_len + p_len);
        for &(o, n) in &unc {
            first.extend_from_slice(&input[o..o + n]);
        }
        first.resize(unc_len + p_len, 0.0);
        for t in &mats {
            matmul(
                &input[t.offset..t.offset + t.n * t.m],
                &qs[t.q..t.q + t.m * t.r],
                &mut first[unc_len + t.p..unc_len + t.p + t.n * t.r],
                t.n,
                t.m,
                t.r,
            );
        }
        self.sent += ((unc_len + p_len + q_len) * wire.size()) as u64;
        if bucket.is_last() {
            self.iter += 1;
        }
        let second = SecondHalf {
            index,
            divisor,
            wire,
            input,
            input_cp,
            qs,
            mats,
            unc,
            first,
            epsilon: self.state.orthogonalization_epsilon,
            warm_start: self.state.warm_start,
            memory: self.memory.clone(),
        };
        let what = format!("{} bucket {index}", self.kind());
        BucketWork::new(Pending {
            bucket,
            len,
            work: pg.chain_async(&what, move |chain| second.run(chain)),
        })
    }

    fn take_sent_bytes(&mut self) -> Option<u64> {
        Some(std::mem::take(&mut self.sent))
    }

    fn state_dict(&self) -> HookState {
        let mut s = HookState::new(self.kind());
        s.counters.insert("iter".into(), self.iter);
        s.counters.insert("draws".into(), self.draws);
        let memory = self.lock();
        for (name, map) in [("error", &memory.error), ("q", &memory.q)] {
            for (b, v) in map {
                s.tensors.insert(
                    format!("{name}.{b}"),
                    TensorData {
                        shape: vec![v.len()],
                        data: v.clone(),
                    },
                );
            }
        }
        s
    }

    fn load_state_dict(&mut self, state: &HookState) -> Result<()> {
        state.expect_kind(self.kind())?;
        let iter = state.counter("iter")?;
        let draws = state.counter("draws")?;
        let mut memory = Memory::default();
        for (key, t) in &state.tensors {
            let bad = || {
                Error::Mismatch(format!(
                    "{} comm hook state: unexpected tensor {key:?} (expected error.<bucket> or \
                     q.<bucket>)",
                    self.kind()
                ))
            };
            let (name, b) = key.split_once('.').ok_or_else(bad)?;
            let b: usize = b.parse().map_err(|_| bad())?;
            match name {
                "error" => memory.error.insert(b, t.data.clone()),
                "q" => memory.q.insert(b, t.data.clone()),
                _ => return Err(bad()),
            };
        }
        self.iter = iter;
        self.draws = draws;
        *self.lock() = memory;
        Ok(())
    }
}

/// The rest of a PowerSGD bucket once `P` is computed, chained on the group's thread
/// ([`ProcessGroup::chain_async`]) so that it runs as soon as the all-reduce of `P` is done,
/// while backward goes on.
struct SecondHalf {
    index: usize,
    divisor: usize,
    wire: DType,
    input: Vec<f32>,
    input_cp: Vec<f32>,
    qs: Vec<f32>,
    mats: Vec<Mat>,
    unc: Vec<(usize, usize)>,
    /// The uncompressed elements, then every `P`.
    first: Vec<f32>,
    epsilon: f32,
    warm_start: bool,
    memory: Arc<Mutex<Memory>>,
}

impl SecondHalf {
    /// All-reduce the uncompressed elements and `P`, orthogonalize, `Q = MᵀP`, all-reduce `Q`,
    /// `M̂ = PQᵀ`; keeps the residual and `Q`; returns the averaged bucket (padded).
    fn run(mut self, chain: &mut Chain<'_>) -> ddp_comm::Result<Vec<f32>> {
        let d = self.divisor as f32;
        let mut first = std::mem::take(&mut self.first);
        if !first.is_empty() {
            all_reduce_wire(chain, &mut first, self.wire)?;
        }
        let mut k = 0;
        for &(o, n) in &self.unc {
            for (x, s) in self.input[o..o + n].iter_mut().zip(&first[k..k + n]) {
                *x = s / d;
            }
            k += n;
        }
        let ps = &mut first[k..];
        if !self.mats.is_empty() {
            for t in &self.mats {
                orthogonalize(&mut ps[t.p..t.p + t.n * t.r], t.n, t.r, self.epsilon);
            }
            for t in &self.mats {
                matmul_tn(
                    &self.input[t.offset..t.offset + t.n * t.m],
                    &ps[t.p..t.p + t.n * t.r],
                    &mut self.qs[t.q..t.q + t.m * t.r],
                    t.n,
                    t.m,
                    t.r,
                );
            }
            all_reduce_wire(chain, &mut self.qs, self.wire)?;
            self.qs.iter_mut().for_each(|q| *q /= d);
            for t in &self.mats {
                matmul_nt(
                    &ps[t.p..t.p + t.n * t.r],
                    &self.qs[t.q..t.q + t.m * t.r],
                    &mut self.input[t.offset..t.offset + t.n * t.m],
                    t.n,
                    t.m,
                    t.r,
                );
            }
        }
        let mut memory = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        if !self.input_cp.is_empty() {
            // The residual is taken against the world-size average (PyTorch's, whenever the
            // divisor is the world size) so that the residuals of all ranks sum to the
            // compression error of the sum, also under Join, where the shadows' residuals enter
            // a sum divided by fewer ranks.
            let f = self.divisor as f32 / chain.size() as f32;
            let mut e = std::mem::take(&mut self.input_cp);
            e.iter_mut().zip(&self.input).for_each(|(c, x)| *c -= x * f);
            memory.error.insert(self.index, e);
        }
        if self.warm_start && !self.qs.is_empty() {
            memory.q.insert(self.index, std::mem::take(&mut self.qs));
        }
        Ok(self.input)
    }
}

/// All-reduce (sum) `v` in place, sent as `wire` (16-bit buckets in their own dtype).
fn all_reduce_wire(chain: &mut Chain<'_>, v: &mut [f32], wire: DType) -> ddp_comm::Result<()> {
    fn through<T: ddp_comm::Element + Default>(
        chain: &mut Chain<'_>,
        v: &mut [f32],
    ) -> ddp_comm::Result<()>
    where
        [T]: HalfFloatSliceExt,
    {
        let mut w: Vec<T> = narrow(v);
        chain.all_reduce(&mut w, ReduceOp::Sum)?;
        w.convert_to_f32_slice(v);
        Ok(())
    }
    match wire {
        DType::F16 => through::<f16>(chain, v),
        DType::BF16 => through::<bf16>(chain, v),
        _ => chain.all_reduce(v, ReduceOp::Sum),
    }
}

/// A PowerSGD bucket in flight: its chain, then the bucket written back.
struct Pending {
    bucket: GradBucket,
    len: usize,
    work: Work<Vec<f32>>,
}

impl PendingBucket for Pending {
    fn wait(self: Box<Self>) -> ddp_comm::Result<crate::reducer::BucketBuffer> {
        let input = self.work.wait()?;
        restore(self.bucket.into_buffer(), &input[..self.len])
    }
}

// The products accumulate in f64 (the operands stay f32): a full-rank approximation then
// reproduces the average to about f32 rounding.

/// `p (n×r) = a (n×m) · q (m×r)`, row-major.
fn matmul(a: &[f32], q: &[f32], p: &mut [f32], n: usize, m: usize, r: usize) {
    let mut acc = vec![0f64; r];
    for i in 0..n {
        acc.fill(0.0);
        for (j, &x) in a[i * m..(i + 1) * m].iter().enumerate() {
            for (o, &y) in acc.iter_mut().zip(&q[j * r..(j + 1) * r]) {
                *o += x as f64 * y as f64;
            }
        }
        for (o, a) in p[i * r..(i + 1) * r].iter_mut().zip(&acc) {
            *o = *a as f32;
        }
    }
}

/// `q (m×r) = aᵀ · p`, `a` being `n×m` and `p` `n×r`, row-major.
fn matmul_tn(a: &[f32], p: &[f32], q: &mut [f32], n: usize, m: usize, r: usize) {
    let mut acc = vec![0f64; m * r];
    for i in 0..n {
        let prow = &p[i * r..(i + 1) * r];
        for (j, &x) in a[i * m..(i + 1) * m].iter().enumerate() {
            for (o, &y) in acc[j * r..(j + 1) * r].iter_mut().zip(prow) {
                *o += x as f64 * y as f64;
            }
        }
    }
    for (o, a) in q.iter_mut().zip(&acc) {
        *o = *a as f32;
    }
}

/// `a (n×m) = p (n×r) · qᵀ` (`q` being `m×r`), row-major.
fn matmul_nt(p: &[f32], q: &[f32], a: &mut [f32], n: usize, m: usize, r: usize) {
    for i in 0..n {
        let prow = &p[i * r..(i + 1) * r];
        for (j, o) in a[i * m..(i + 1) * m].iter_mut().enumerate() {
            let dot: f64 = prow
                .iter()
                .zip(&q[j * r..(j + 1) * r])
                .map(|(x, y)| *x as f64 * *y as f64)
                .sum();
            *o = dot as f32;
        }
    }
}

/// Gram-Schmidt on the `r` columns of the `n×r` row-major matrix `x` (PyTorch's
/// `_orthogonalize_gram_schmidt`). A zero column stays zero, and so does a column that is
/// (numerically) a combination of the earlier ones — what is left of it after the projections is
/// below `32·ε·√n` of its norm — instead of becoming normalized rounding noise that is not
/// orthogonal to the others (zero-padded or rank-deficient matrices would otherwise lose the
/// exactness of the projection).
fn orthogonalize(x: &mut [f32], n: usize, r: usize, epsilon: f32) {
    let col_norm = |x: &[f32], i: usize| {
        (0..n)
            .map(|k| (x[k * r + i] as f64).powi(2))
            .sum::<f64>()
            .sqrt()
    };
    let original: Vec<f64> = (0..r).map(|i| col_norm(x, i)).collect();
    let dependent = 32.0 * f32::EPSILON as f64 * (n as f64).sqrt();
    for i in 0..r {
        let norm = col_norm(x, i);
        let scale = if norm == 0.0 || norm <= dependent * original[i] {
            0.0
        } else if epsilon == 0.0 {
            1.0 / norm
        } else {
            1.0 / (norm + epsilon as f64)
        } as f32;
        for k in 0..n {
            x[k * r + i] *= scale;
        }
        for j in i + 1..r {
            let dot: f64 = (0..n).map(|k| (x[k * r + i] * x[k * r + j]) as f64).sum();
            let dot = dot as f32;
            for k in 0..n {
                x[k * r + j] -= dot * x[k * r + i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gram_schmidt_gives_orthonormal_columns() {
        let (n, r) = (7, 3);
        let mut x: Vec<f32> = (0..n * r).map(|k| ((k * 37) % 11) as f32 - 5.0).collect();
        orthogonalize(&mut x, n, r, 0.0);
        for i in 0..r {
            for j in 0..r {
                let dot: f32 = (0..n).map(|k| x[k * r + i] * x[k * r + j]).sum();
                let want = if i == j { 1.0 } else { 0.0 };
                assert!((dot - want).abs() < 1e-5, "columns {i},{j}: {dot}");
            }
        }
        let mut z = vec![0.0f32; 6];
        orthogonalize(&mut z, 3, 2, 0.0);
        assert!(z.iter().all(|&v| v == 0.0));
    }

    #[test]
    fn matmuls_agree_with_the_definition() {
        let (n, m, r) = (3, 4, 2);
        let a: Vec<f32> = (0..n * m).map(|k| k as f32 - 3.0).collect();
        let q: Vec<f32> = (0..m * r).map(|k| (k as f32) * 0.5).collect();
        let mut p = vec![0.0; n * r];
        matmul(&a, &q, &mut p, n, m, r);
        for i in 0..n {
            for k in 0..r {
                let want: f32 = (0..m).map(|j| a[i * m + j] * q[j * r + k]).sum();
                assert!((p[i * r + k] - want).abs() < 1e-5);
            }
        }
        let mut qt = vec![0.0; m * r];
        matmul_tn(&a, &p, &mut qt, n, m, r);
        for j in 0..m {
            for k in 0..r {
                let want: f32 = (0..n).map(|i| a[i * m + j] * p[i * r + k]).sum();
                assert!((qt[j * r + k] - want).abs() < 1e-4);
            }
        }
        let mut back = vec![0.0; n * m];
        matmul_nt(&p, &q, &mut back, n, m, r);
        for i in 0..n {
            for j in 0..m {
                let want: f32 = (0..r).map(|k| p[i * r + k] * q[j * r + k]).sum();
                assert!((back[i * m + j] - want).abs() < 1e-5);
            }
        }
    }
}
