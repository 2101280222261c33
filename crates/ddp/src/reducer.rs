//! The gradient [`Reducer`]: PyTorch DDP's bucketed, pipelined gradient all-reduce over flat
//! buffers, independent of any tensor framework.
//!
//! This module owns:
//! - [`ParamSpec`] (name, shape, dtype) and the cross-rank check that every replica registered the
//!   same parameters in the same order ([`verify_param_specs`]): a mismatch is an error on *every*
//!   rank naming the first differing parameter and the ranks involved (no rank hangs, because the
//!   check is a single `all_gather_bytes`).
//! - Bucket assignment ([`compute_bucket_assignment`]): parameters are visited in *reverse*
//!   registration order (gradients of the last layers are ready first in backward), buckets are
//!   per dtype, the first bucket of each dtype is capped at `first_bucket_cap_mb` (1 MiB) and the
//!   rest at `bucket_cap_mb` (25 MiB) — PyTorch's names and defaults. A bucket is closed once it
//!   reaches its cap, so it may exceed it by one parameter (a parameter is never split).
//! - The per-step state machine: [`Reducer::mark_ready`] copies a gradient into its bucket's flat
//!   buffer; when every gradient of a bucket is in, the bucket's `all_reduce_async` (sum) is
//!   launched — always in bucket order, so a later bucket that becomes ready first waits until the
//!   earlier ones have launched (every rank issues the same collectives in the same order).
//!   [`Reducer::finish`] launches what is left, waits for every bucket, divides by the world size
//!   (or by the number of still-active ranks under Join, [`Reducer::finish_with_divisor`]) and makes
//!   the averaged gradients readable with [`Reducer::grad`].
//! - `no_sync` ([`Reducer::set_require_backward_grad_sync`]): backwards run without sync add their
//!   gradients into the bucket buffers locally; the next synchronized backward adds its own and
//!   reduces the accumulated sum.
//! - Overlap measurement ([`StepStats`]): time blocked waiting for communication inside `finish`
//!   versus the whole backward+communication time of the step.
//! - Start-up helpers: [`broadcast_coalesced`] (rank 0's parameter values to every replica) and
//!   [`sync_seed`] (one seed shared by every rank).
//!
//! Parameters that receive no gradient in a backward (unused in this forward) contribute zeros;
//! a rank that has joined (run out of data) therefore shadows the others' collectives by calling
//! `finish_with_divisor` without marking anything. PyTorch's bucket *rebuilding* after the first
//! iteration (reordering by observed readiness) is not done: the reverse registration order is
//! kept, which is the order of a sequential model's backward.

use crate::error::{Error, Result};
use ddp_comm::{DType, Element, ProcessGroup, ReduceOp, Work};
use std::any::Any;
use std::time::{Duration, Instant};

const MIB: f64 = 1024.0 * 1024.0;

/// PyTorch's `bucket_cap_mb` default.
pub const DEFAULT_BUCKET_CAP_MB: f64 = 25.0;
/// PyTorch's `dist._DEFAULT_FIRST_BUCKET_BYTES` (1 MiB), in MiB.
pub const DEFAULT_FIRST_BUCKET_CAP_MB: f64 = 1.0;
/// Chunk size of [`broadcast_coalesced`] (PyTorch's `broadcast_bucket_size`, 250 MiB).
pub const BROADCAST_BUCKET_BYTES: usize = 250 * 1024 * 1024;

/// One registered parameter: what every rank must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl ParamSpec {
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>, dtype: DType) -> Self {
        ParamSpec {
            name: name.into(),
            shape: shape.into(),
            dtype,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size of the gradient in bytes.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

impl std::fmt::Display for ParamSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` {:?} {}", self.name, self.shape, self.dtype)
    }
}

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

fn encode_specs(specs: &[ParamSpec]) -> Vec<u8> {
    let v: Vec<(String, Vec<usize>, String)> = specs
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone(), s.dtype.to_string()))
        .collect();
    serde_json::to_vec(&v).expect("serializing parameter specs")
}

fn describe(spec: Option<&(String, Vec<usize>, String)>) -> String {
    match spec {
        Some((n, s, d)) => format!("`{n}` {s:?} {d}"),
        None => "no parameter".to_string(),
    }
}

/// Checks that every rank registered the same parameters (names, shapes, dtypes) in the same
/// order. One `all_gather_bytes`, so every rank sees every list and reports the same error:
/// the first differing parameter, what each side has, and which ranks differ from rank 0.
pub fn verify_param_specs(pg: &ProcessGroup, specs: &[ParamSpec]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for s in specs {
        if !seen.insert(s.name.as_str()) {
            return Err(Error::InvalidArgument(format!(
                "parameter name `{}` is registered twice on rank {}",
                s.name,
                pg.rank()
            )));
        }
    }
    let all = pg.all_gather_bytes(&encode_specs(specs))?;
    let decoded: Vec<Vec<(String, Vec<usize>, String)>> = all
        .iter()
        .enumerate()
        .map(|(r, b)| {
            serde_json::from_slice(b).map_err(|e| {
                Error::Mismatch(format!("rank {r} sent an unreadable parameter list: {e}"))
            })
        })
        .collect::<Result<_>>()?;
    let reference = &decoded[0];
    let mut first: Option<(usize, usize)> = None; // (rank, position)
    let mut differing = Vec::new();
    for (r, list) in decoded.iter().enumerate().skip(1) {
        if list == reference {
            continue;
        }
        differing.push(r);
        let pos = (0..list.len().max(reference.len()))
            .find(|&i| list.get(i) != reference.get(i))
            .unwrap_or(0);
        if first.is_none_or(|(_, p)| pos < p) {
            first = Some((r, pos));
        }
    }
    let Some((r, pos)) = first else {
        return Ok(());
    };
    let count_note = if decoded[r].len() != reference.len() {
        format!(
            " (rank 0 has {} parameters, rank {r} has {})",
            reference.len(),
            decoded[r].len()
        )
    } else {
        String::new()
    };
    Err(Error::Mismatch(format!(
        "model parameters differ across ranks: ranks {differing:?} disagree with rank 0; first \
         difference at parameter #{pos} (in registration order, sorted by name): rank 0 has {} but \
         rank {r} has {}{count_note}",
        describe(reference.get(pos)),
        describe(decoded[r].get(pos)),
    )))
}

/// Broadcasts `tensors` from `root` to every rank, packed into flat chunks of at most
/// [`BROADCAST_BUCKET_BYTES`] (fewer, larger messages than one broadcast per tensor).
pub fn broadcast_coalesced<T: Element>(
    pg: &ProcessGroup,
    tensors: &mut [&mut [T]],
    root: usize,
) -> Result<()> {
    let cap = (BROADCAST_BUCKET_BYTES / std::mem::size_of::<T>()).max(1);
    let mut start = 0;
    while start < tensors.len() {
        let mut end = start;
        let mut n = 0;
        while end < tensors.len() && (end == start || n + tensors[end].len() <= cap) {
            n += tensors[end].len();
            end += 1;
        }
        let mut flat = Vec::with_capacity(n);
        for t in tensors[start..end].iter() {
            flat.extend_from_slice(t);
        }
        pg.broadcast(&mut flat, root)?;
        let mut off = 0;
        for t in tensors[start..end].iter_mut() {
            let len = t.len();
            t.copy_from_slice(&flat[off..off + len]);
            off += len;
        }
        start = end;
    }
    Ok(())
}

/// One seed for every rank: rank 0's `seed` (or, if `None`, a fresh one drawn on rank 0) is
/// broadcast, so that every replica seeds its random number generators identically.
pub fn sync_seed(pg: &ProcessGroup, seed: Option<u64>) -> Result<u64> {
    let mine = seed.unwrap_or_else(rand::random::<u64>);
    let mut buf = [mine as i64];
    pg.broadcast(&mut buf, 0)?;
    Ok(buf[0] as u64)
}

/// Timing of one backward + gradient synchronization.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Whether this backward was synchronized (false under `no_sync`).
    pub synced: bool,
    /// From the start of backward ([`Reducer::prepare_for_backward`], or the first
    /// `mark_ready`) to the end of `finish`.
    pub total: Duration,
    /// Time `finish` spent blocked waiting for bucket all-reduces to complete.
    pub comm_wait: Duration,
    /// Buckets reduced in this step.
    pub buckets: usize,
    /// Bytes reduced in this step (per rank).
    pub bytes: usize,
}

impl StepStats {
    /// Fraction of the step's backward+communication time that was *not* spent waiting for
    /// communication (1.0: communication fully hidden behind backward compute).
    pub fn overlap(&self) -> f64 {
        if self.total.is_zero() {
            return 1.0;
        }
        1.0 - self.comm_wait.as_secs_f64() / self.total.as_secs_f64()
    }
}

/// Sums of [`StepStats`] over all synchronized steps since construction.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct TotalStats {
    pub steps: u64,
    pub total: Duration,
    pub comm_wait: Duration,
    pub bytes: u64,
}

/// A bucket as assigned (see [`Reducer::buckets`]).
#[derive(Debug, Clone, PartialEq)]
pub struct BucketInfo {
    pub dtype: DType,
    /// Parameter indices, in the order their gradients sit in the flat buffer.
    pub params: Vec<usize>,
    pub numel: usize,
}

// ---- type-erased flat buffers -------------------------------------------------------------

trait FlatBuf: Send {
    /// Starts the bucket's all-reduce: `Avg` (the division fused into the collective, in cache
    /// on the shared-memory path) or `Sum` (divided in `finish`).
    fn launch(self: Box<Self>, pg: &ProcessGroup, op: ReduceOp) -> Box<dyn PendingBuf>;
    fn zero_range(&mut self, start: usize, len: usize);
    fn div_by(&mut self, n: usize);
    fn as_any(&self) -> &dyn Any;
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

trait PendingBuf: Send {
    fn wait(self: Box<Self>) -> ddp_comm::Result<Box<dyn FlatBuf>>;
}

struct Typed<T>(Vec<T>);

impl<T: Element> FlatBuf for Typed<T> {
    fn launch(self: Box<Self>, pg: &ProcessGroup, op: ReduceOp) -> Box<dyn PendingBuf> {
        Box::new(pg.all_reduce_async(self.0, op))
    }
    fn zero_range(&mut self, start: usize, len: usize) {
        self.0[start..start + len].fill(<T as bytemuck::Zeroable>::zeroed());
    }
    fn div_by(&mut self, n: usize) {
        T::div_by(&mut self.0, n)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl<T: Element> PendingBuf for Work<Vec<T>> {
    fn wait(self: Box<Self>) -> ddp_comm::Result<Box<dyn FlatBuf>> {
        Ok(Box::new(Typed((*self).wait()?)))
    }
}

fn new_buf(dtype: DType, n: usize) -> Box<dyn FlatBuf> {
    use half::{bf16, f16};
    match dtype {
        DType::F32 => Box::new(Typed(vec![0f32; n])),
        DType::F64 => Box::new(Typed(vec![0f64; n])),
        DType::F16 => Box::new(Typed(vec![f16::ZERO; n])),
        DType::BF16 => Box::new(Typed(vec![bf16::ZERO; n])),
        DType::I32 => Box::new(Typed(vec![0i32; n])),
        DType::I64 => Box::new(Typed(vec![0i64; n])),
        DType::U8 => Box::new(Typed(vec![0u8; n])),
    }
}

enum BucketState {
    Idle(Box<dyn FlatBuf>),
    InFlight(Box<dyn PendingBuf>),
    /// The buffer went down with a failed collective.
    Lost,
}

struct Bucket {
    dtype: DType,
    params: Vec<usize>,
    numel: usize,
    /// Gradients of this bucket not yet marked in the current backward.
    pending: usize,
    /// Launched with `ReduceOp::Avg` in the current step (already divided by the world size).
    averaged: bool,
    state: BucketState,
}

#[derive(Clone, Copy)]
struct Slot {
    bucket: usize,
    offset: usize,
    numel: usize,
    /// Marked in the current backward.
    marked: bool,
    /// The buffer segment holds a gradient (sum) not yet reduced.
    accumulated: bool,
}

/// Bucketed, pipelined gradient all-reduce for one replica (see the module doc).
///
/// Per step: optionally [`prepare_for_backward`](Reducer::prepare_for_backward), then
/// [`mark_ready`](Reducer::mark_ready) for each gradient as backward produces it, then
/// [`finish`](Reducer::finish); read the averaged gradients with [`grad`](Reducer::grad).
pub struct Reducer {
    pg: ProcessGroup,
    specs: Vec<ParamSpec>,
    slots: Vec<Slot>,
    buckets: Vec<Bucket>,
    next_launch: usize,
    require_sync: bool,
    /// `Some(sync)` once the current backward started (sync mode captured at its start).
    current: Option<bool>,
    backward_start: Option<Instant>,
    results_valid: bool,
    failed: Option<ddp_comm::Error>,
    /// What the current step's gradients are divided by (the world size unless
    /// [`set_divisor`](Reducer::set_divisor) says otherwise).
    divisor: usize,
    last: Option<StepStats>,
    totals: TotalStats,
}

impl Reducer {
    /// Verifies `specs` across ranks ([`verify_param_specs`]) and assigns buckets. `specs` must
    /// be in the same (deterministic) order on every rank — the candle adapter sorts by name.
    pub fn new(pg: &ProcessGroup, specs: Vec<ParamSpec>, opts: ReducerOptions) -> Result<Reducer> {
        verify_param_specs(pg, &specs)?;
        Ok(Self::new_unverified(pg, specs, opts))
    }

    fn new_unverified(pg: &ProcessGroup, specs: Vec<ParamSpec>, opts: ReducerOptions) -> Reducer {
        let assignment = compute_bucket_assignment(&specs, &opts);
        let mut slots = vec![
            Slot {
                bucket: 0,
                offset: 0,
                numel: 0,
                marked: false,
                accumulated: false,
            };
            specs.len()
        ];
        let buckets = assignment
            .into_iter()
            .enumerate()
            .map(|(b, params)| {
                let mut offset = 0;
                for &p in &params {
                    slots[p].bucket = b;
                    slots[p].offset = offset;
                    slots[p].numel = specs[p].numel();
                    offset += specs[p].numel();
                }
                let dtype = specs[params[0]].dtype;
                Bucket {
                    dtype,
                    pending: params.len(),
                    params,
                    numel: offset,
                    averaged: false,
                    state: BucketState::Idle(new_buf(dtype, offset)),
                }
            })
            .collect();
        Reducer {
            pg: pg.clone(),
            specs,
            slots,
            buckets,
            next_launch: 0,
            require_sync: true,
            current: None,
            backward_start: None,
            results_valid: false,
            failed: None,
            divisor: pg.size(),
            last: None,
            totals: TotalStats::default(),
        }
    }

    /// The registered parameters, in registration order (indices of `mark_ready`/`grad`).
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }

    /// The process group the reducer communicates over.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// The bucket assignment, in launch order.
    pub fn buckets(&self) -> Vec<BucketInfo> {
        self.buckets
            .iter()
            .map(|b| BucketInfo {
                dtype: b.dtype,
                params: b.params.clone(),
                numel: b.numel,
            })
            .collect()
    }

    /// PyTorch's `require_backward_grad_sync`: `false` makes the following backwards accumulate
    /// locally without communicating (what `no_sync()` sets). Takes effect at the next backward.
    pub fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.require_sync = sync;
    }

    /// Whether backwards synchronize (see [`set_require_backward_grad_sync`](Self::set_require_backward_grad_sync)).
    pub fn require_backward_grad_sync(&self) -> bool {
        self.require_sync
    }

    /// Divide the next synchronized step's gradients by `divisor` instead of the world size (Join:
    /// the number of ranks with data). Call it before that step's first `mark_ready`: buckets
    /// launched while the divisor is the world size average inside the collective.
    pub fn set_divisor(&mut self, divisor: usize) -> Result<()> {
        if divisor == 0 {
            return Err(Error::InvalidArgument(
                "set_divisor: divisor must be at least 1".into(),
            ));
        }
        if self.next_launch > 0 && divisor != self.divisor {
            return Err(Error::InvalidArgument(format!(
                "set_divisor({divisor}): this step's first buckets are already reduced for \
                 divisor {}; set the divisor before the backward",
                self.divisor
            )));
        }
        self.divisor = divisor;
        Ok(())
    }

    /// Marks the start of a backward (for timing). Optional: the first `mark_ready` does it too.
    pub fn prepare_for_backward(&mut self) -> Result<()> {
        self.check_failed()?;
        self.begin();
        Ok(())
    }

    fn begin(&mut self) {
        if self.current.is_none() {
            self.current = Some(self.require_sync);
            self.backward_start = Some(Instant::now());
            self.results_valid = false;
        }
    }

    fn check_failed(&self) -> Result<()> {
        match &self.failed {
            // A broken group stays broken: report the original communication failure.
            Some(e) => Err(Error::Comm(e.clone())),
            None => Ok(()),
        }
    }

    /// Hands over the gradient of parameter `index` (registration order). It is copied (or, after
    /// `no_sync` backwards, added) into its bucket; when the bucket is complete its all-reduce is
    /// launched, in bucket order. Each parameter may be marked once per backward.
    pub fn mark_ready<T: Element>(&mut self, index: usize, grad: &[T]) -> Result<()> {
        self.check_failed()?;
        let spec = self.specs.get(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "mark_ready: parameter index {index} out of range ({} parameters registered)",
                self.specs.len()
            ))
        })?;
        if T::DTYPE != spec.dtype {
            return Err(Error::InvalidArgument(format!(
                "mark_ready: gradient of {spec} given as {}",
                T::DTYPE
            )));
        }
        let slot = self.slots[index];
        if grad.len() != slot.numel {
            return Err(Error::InvalidArgument(format!(
                "mark_ready: gradient of {spec} has {} elements, expected {}",
                grad.len(),
                slot.numel
            )));
        }
        if slot.marked {
            return Err(Error::InvalidArgument(format!(
                "mark_ready: parameter {spec} was marked ready twice in one backward \
                 (call finish() between backwards)"
            )));
        }
        self.begin();
        let bucket = &mut self.buckets[slot.bucket];
        let BucketState::Idle(buf) = &mut bucket.state else {
            unreachable!("a bucket with unmarked gradients is never in flight");
        };
        let seg = &mut buf
            .as_any_mut()
            .downcast_mut::<Typed<T>>()
            .expect("bucket dtype matches its parameters")
            .0[slot.offset..slot.offset + slot.numel];
        if slot.accumulated {
            T::reduce_into(seg, grad, ReduceOp::Sum);
        } else {
            seg.copy_from_slice(grad);
        }
        let s = &mut self.slots[index];
        s.marked = true;
        s.accumulated = true;
        bucket.pending -= 1;
        if self.current == Some(true) {
            self.launch_ready();
        }
        Ok(())
    }

    /// Launches every bucket that is complete and whose predecessors have all launched.
    fn launch_ready(&mut self) {
        let averaged = self.divisor == self.pg.size();
        let op = if averaged {
            ReduceOp::Avg
        } else {
            ReduceOp::Sum
        };
        while self.next_launch < self.buckets.len() && self.buckets[self.next_launch].pending == 0 {
            let b = &mut self.buckets[self.next_launch];
            let state = std::mem::replace(&mut b.state, BucketState::Lost);
            b.state = match state {
                BucketState::Idle(buf) => BucketState::InFlight(buf.launch(&self.pg, op)),
                other => other,
            };
            b.averaged = averaged;
            self.next_launch += 1;
        }
    }

    /// Ends the backward: in sync mode, launches the remaining buckets (unmarked gradients count
    /// as zeros), waits for all of them and divides by the world size. Under `no_sync` it only
    /// closes the backward (gradients stay accumulated locally). Returns the step's timing.
    pub fn finish(&mut self) -> Result<StepStats> {
        let n = self.pg.size();
        self.finish_with_divisor(n)
    }

    /// [`finish`](Self::finish) dividing by `divisor` instead of the world size: under Join, the
    /// number of ranks that still contributed gradients.
    pub fn finish_with_divisor(&mut self, divisor: usize) -> Result<StepStats> {
        self.check_failed()?;
        if divisor == 0 {
            return Err(Error::InvalidArgument(
                "finish: divisor must be at least 1".into(),
            ));
        }
        // Buckets already launched averaged over the world size cannot be divided by another
        // divisor: the step still completes (no collective is left behind), then fails.
        let late_divisor = self.next_launch > 0 && divisor != self.divisor;
        if !late_divisor {
            self.divisor = divisor;
        }
        self.begin();
        let sync = self.current.take() == Some(true);
        let start = self.backward_start.take().unwrap_or_else(Instant::now);
        if !sync {
            for s in &mut self.slots {
                s.marked = false;
            }
            for b in &mut self.buckets {
                b.pending = b.params.len();
            }
            let stats = StepStats {
                synced: false,
                total: start.elapsed(),
                ..Default::default()
            };
            self.last = Some(stats);
            return Ok(stats);
        }
        // Unused parameters: zeros, unless an earlier no_sync backward accumulated into them.
        for bi in self.next_launch..self.buckets.len() {
            let b = &mut self.buckets[bi];
            if b.pending == 0 {
                continue;
            }
            let BucketState::Idle(buf) = &mut b.state else {
                unreachable!("an incomplete bucket is idle");
            };
            for &p in &b.params {
                let s = &mut self.slots[p];
                if !s.marked {
                    if !s.accumulated {
                        buf.zero_range(s.offset, s.numel);
                    }
                    s.marked = true;
                }
            }
            b.pending = 0;
        }
        self.launch_ready();
        let mut comm_wait = Duration::ZERO;
        let mut bytes = 0;
        for bi in 0..self.buckets.len() {
            let b = &mut self.buckets[bi];
            let state = std::mem::replace(&mut b.state, BucketState::Lost);
            let BucketState::InFlight(work) = state else {
                unreachable!("every bucket was launched");
            };
            let t = Instant::now();
            let result = work.wait();
            comm_wait += t.elapsed();
            match result {
                Ok(mut buf) => {
                    if !b.averaged {
                        buf.div_by(divisor);
                    }
                    b.state = BucketState::Idle(buf);
                    bytes += b.numel * b.dtype.size();
                }
                Err(e) => {
                    tracing::error!(
                        "rank {}: all_reduce of gradient bucket {bi} ({} {} elements, {} \
                         parameters) failed: {e}",
                        self.pg.rank(),
                        b.numel,
                        b.dtype,
                        b.params.len(),
                    );
                    // Drain the other in-flight buckets so no work handle is left behind.
                    for later in &mut self.buckets[bi + 1..] {
                        if let BucketState::InFlight(w) =
                            std::mem::replace(&mut later.state, BucketState::Lost)
                        {
                            let _ = w.wait();
                        }
                    }
                    self.failed = Some(e.clone());
                    return Err(Error::Comm(e));
                }
            }
        }
        for s in &mut self.slots {
            s.marked = false;
            s.accumulated = false;
        }
        for b in &mut self.buckets {
            b.pending = b.params.len();
        }
        self.next_launch = 0;
        let launched_for = std::mem::replace(&mut self.divisor, self.pg.size());
        if late_divisor {
            return Err(Error::InvalidArgument(format!(
                "finish_with_divisor({divisor}): this step's buckets were reduced for divisor \
                 {launched_for}; call set_divisor({divisor}) before the backward"
            )));
        }
        self.results_valid = true;
        let stats = StepStats {
            synced: true,
            total: start.elapsed(),
            comm_wait,
            buckets: self.buckets.len(),
            bytes,
        };
        self.totals.steps += 1;
        self.totals.total += stats.total;
        self.totals.comm_wait += stats.comm_wait;
        self.totals.bytes += bytes as u64;
        self.last = Some(stats);
        Ok(stats)
    }

    /// The averaged gradient of parameter `index` after a synchronized `finish`, valid until
    /// the next backward starts.
    pub fn grad<T: Element>(&self, index: usize) -> Result<&[T]> {
        if !self.results_valid {
            return Err(Error::InvalidArgument(
                "grad: no synchronized gradients available (call finish() after a synced backward)"
                    .into(),
            ));
        }
        let spec = self.specs.get(index).ok_or_else(|| {
            Error::InvalidArgument(format!("grad: parameter index {index} out of range"))
        })?;
        if T::DTYPE != spec.dtype {
            return Err(Error::InvalidArgument(format!(
                "grad: gradient of {spec} requested as {}",
                T::DTYPE
            )));
        }
        let slot = self.slots[index];
        let BucketState::Idle(buf) = &self.buckets[slot.bucket].state else {
            unreachable!("results are valid only when every bucket is idle");
        };
        let v = &buf
            .as_any()
            .downcast_ref::<Typed<T>>()
            .expect("bucket dtype matches its parameters")
            .0;
        Ok(&v[slot.offset..slot.offset + slot.numel])
    }

    /// Timing of the last backward (`None` before the first `finish`).
    pub fn last_step_stats(&self) -> Option<StepStats> {
        self.last
    }

    /// Timing summed over every synchronized step.
    pub fn total_stats(&self) -> TotalStats {
        self.totals
    }
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

    /// Runs `f(rank, pg)` on `world` threads, each with its own TCP process group.
    fn run_ranks<R: Send>(
        world: usize,
        timeout: Duration,
        f: impl Fn(usize, ProcessGroup) -> R + Sync,
    ) -> Vec<R> {
        let cfg = ddp_comm::testing::LocalGroup {
            timeout,
            ..Default::default()
        };
        ddp_comm::testing::run_local_group(world, cfg, |pg| f(pg.rank(), pg))
    }

    const T: Duration = Duration::from_secs(20);

    /// Mixed f32/f64 parameters of various sizes, small buckets so there are several.
    fn mixed_specs() -> Vec<ParamSpec> {
        (0..12)
            .map(|i| {
                let dtype = if i % 3 == 0 { DType::F64 } else { DType::F32 };
                ParamSpec::new(format!("p{i:02}"), vec![3 + 37 * i, 2], dtype)
            })
            .collect()
    }

    fn small() -> ReducerOptions {
        ReducerOptions {
            bucket_cap_mb: 2048.0 / MIB,
            first_bucket_cap_mb: 512.0 / MIB,
        }
    }

    /// Rank `r`'s gradient of parameter `i`, element `k`.
    fn g(r: usize, i: usize, k: usize) -> f64 {
        (r as f64 + 1.0) * 0.5 + i as f64 * 0.25 + k as f64 * 0.125
    }

    fn mark(red: &mut Reducer, r: usize, i: usize, scale: f64) -> Result<()> {
        let spec = red.specs()[i].clone();
        match spec.dtype {
            DType::F32 => {
                let v: Vec<f32> = (0..spec.numel())
                    .map(|k| (g(r, i, k) * scale) as f32)
                    .collect();
                red.mark_ready(i, &v)
            }
            _ => {
                let v: Vec<f64> = (0..spec.numel()).map(|k| g(r, i, k) * scale).collect();
                red.mark_ready(i, &v)
            }
        }
    }

    fn read(red: &Reducer, i: usize) -> Vec<f64> {
        match red.specs()[i].dtype {
            DType::F32 => red
                .grad::<f32>(i)
                .unwrap()
                .iter()
                .map(|&x| x as f64)
                .collect(),
            _ => red.grad::<f64>(i).unwrap().to_vec(),
        }
    }

    #[test]
    fn averages_across_ranks_whatever_the_marking_order() {
        const W: usize = 3;
        let out = run_ranks(W, T, |rank, pg| {
            let mut red = Reducer::new(&pg, mixed_specs(), small()).unwrap();
            assert!(red.buckets().len() >= 4, "{:?}", red.buckets().len());
            for step in 0..3 {
                // Every rank marks in a different order; buckets must still launch in bucket
                // order (otherwise the ranks' collectives would not match).
                let mut order: Vec<usize> = (0..12).collect();
                match (rank + step) % 3 {
                    0 => {}
                    1 => order.reverse(),
                    _ => order.rotate_left(5),
                }
                for &i in &order {
                    mark(&mut red, rank, i, 1.0).unwrap();
                }
                let stats = red.finish().unwrap();
                assert!(stats.synced && stats.comm_wait <= stats.total);
                assert_eq!(stats.buckets, red.buckets().len());
                for i in 0..12 {
                    let got = read(&red, i);
                    for (k, v) in got.iter().enumerate() {
                        let want = (0..W).map(|r| g(r, i, k)).sum::<f64>() / W as f64;
                        assert!((v - want).abs() < 1e-5, "param {i}[{k}]: {v} vs {want}");
                    }
                }
            }
            assert_eq!(red.total_stats().steps, 3);
            (0..12).map(|i| read(&red, i)).collect::<Vec<_>>()
        });
        assert_eq!(out[0], out[1]);
        assert_eq!(out[0], out[2]);
    }

    #[test]
    fn no_sync_accumulates_and_unused_parameters_count_as_zero() {
        run_ranks(2, T, |rank, pg| {
            let mut red = Reducer::new(&pg, mixed_specs(), small()).unwrap();
            red.set_require_backward_grad_sync(false);
            for _ in 0..2 {
                for i in 0..12 {
                    mark(&mut red, rank, i, 1.0).unwrap();
                }
                assert!(!red.finish().unwrap().synced);
                assert!(
                    red.grad::<f32>(1).is_err(),
                    "no reduced gradients under no_sync"
                );
            }
            assert_eq!(red.total_stats().steps, 0);
            red.set_require_backward_grad_sync(true);
            for i in 0..12 {
                mark(&mut red, rank, i, 1.0).unwrap();
            }
            red.finish().unwrap();
            for i in 0..12 {
                for (k, v) in read(&red, i).iter().enumerate() {
                    let want = 3.0 * (g(0, i, k) + g(1, i, k)) / 2.0;
                    assert!((v - want).abs() < 1e-4, "param {i}[{k}]: {v} vs {want}");
                }
            }
            // Next step: only rank 0 produces gradients for parameter 4 (unused on rank 1), and
            // nobody for parameter 7. Divide by 1 (as under Join with one active rank).
            red.set_divisor(1).unwrap();
            for i in 0..12 {
                if i != 7 && (i != 4 || rank == 0) {
                    mark(&mut red, rank, i, 2.0).unwrap();
                }
            }
            red.finish_with_divisor(1).unwrap();
            assert!(read(&red, 7).iter().all(|&v| v == 0.0));
            for (k, v) in read(&red, 4).iter().enumerate() {
                assert!((v - 2.0 * g(0, 4, k)).abs() < 1e-4);
            }
        });
    }

    #[test]
    fn misuse_is_reported() {
        run_ranks(1, T, |_, pg| {
            let specs = vec![ParamSpec::new("a", vec![2], DType::F32)];
            let mut red = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
            let e = red.mark_ready(0, &[1.0f64, 2.0]).unwrap_err().to_string();
            assert!(e.contains("`a`") && e.contains("f64"), "{e}");
            let e = red.mark_ready(0, &[1.0f32]).unwrap_err().to_string();
            assert!(e.contains("1 elements, expected 2"), "{e}");
            let e = red.mark_ready(3, &[1.0f32]).unwrap_err().to_string();
            assert!(e.contains("index 3"), "{e}");
            assert!(red.grad::<f32>(0).is_err());
            red.mark_ready(0, &[1.0f32, 2.0]).unwrap();
            let e = red.mark_ready(0, &[1.0f32, 2.0]).unwrap_err().to_string();
            assert!(e.contains("twice"), "{e}");
            red.finish().unwrap();
            assert_eq!(red.grad::<f32>(0).unwrap(), &[1.0, 2.0]);
            let dup = vec![
                ParamSpec::new("a", vec![2], DType::F32),
                ParamSpec::new("a", vec![3], DType::F32),
            ];
            let e = Reducer::new(&pg, dup, ReducerOptions::default())
                .err()
                .unwrap();
            assert!(e.to_string().contains("registered twice"), "{e}");
        });
    }

    #[test]
    fn spec_mismatch_is_an_error_on_every_rank() {
        let errs = run_ranks(3, T, |rank, pg| {
            let mut specs = vec![
                ParamSpec::new("a", vec![2, 2], DType::F32),
                ParamSpec::new("b", vec![4], DType::F32),
            ];
            if rank == 2 {
                specs.push(ParamSpec::new("c", vec![1], DType::F32));
            }
            Reducer::new(&pg, specs, ReducerOptions::default())
                .err()
                .map(|e| e.to_string())
        });
        for e in &errs {
            let e = e.as_ref().expect("mismatch accepted");
            assert!(e.contains("ranks [2]"), "{e}");
            assert!(
                e.contains("parameter #2") && e.contains("`c` [1] f32"),
                "{e}"
            );
            assert!(e.contains("rank 0 has 2 parameters, rank 2 has 3"), "{e}");
        }
        assert_eq!(errs[0], errs[1]);
    }

    #[test]
    fn broadcast_and_seed_helpers() {
        let out = run_ranks(3, T, |rank, pg| {
            let mut a = vec![rank as f32; 5];
            let mut b = vec![rank as f32 * 10.0; 3];
            broadcast_coalesced(&pg, &mut [&mut a[..], &mut b[..]], 1).unwrap();
            assert_eq!(a, vec![1.0; 5]);
            assert_eq!(b, vec![10.0; 3]);
            let fixed = sync_seed(&pg, Some(40 + rank as u64)).unwrap();
            assert_eq!(fixed, 40);
            sync_seed(&pg, None).unwrap()
        });
        assert!(out.iter().all(|&s| s == out[0]));
    }

    #[test]
    fn a_dead_peer_fails_finish_instead_of_hanging() {
        let t0 = Instant::now();
        let errs = run_ranks(2, Duration::from_secs(10), |rank, pg| {
            let specs = vec![ParamSpec::new("a", vec![1000], DType::F32)];
            let mut red = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
            if rank == 1 {
                return None; // leaves without reducing: its group shuts down
            }
            red.mark_ready(0, &vec![1.0f32; 1000]).unwrap();
            let e = red.finish().unwrap_err().to_string();
            // The reducer stays failed, with the original cause.
            let again = red
                .mark_ready(0, &vec![1.0f32; 1000])
                .unwrap_err()
                .to_string();
            Some((e, again))
        });
        let (e, again) = errs[0].clone().unwrap();
        assert!(e.contains("rank 1"), "{e}");
        assert!(again.contains("rank 1"), "{again}");
        assert!(t0.elapsed() < Duration::from_secs(15));
    }

    #[test]
    fn overlap_ratio() {
        let s = StepStats {
            synced: true,
            total: Duration::from_millis(100),
            comm_wait: Duration::from_millis(25),
            buckets: 1,
            bytes: 4,
        };
        assert!((s.overlap() - 0.75).abs() < 1e-12);
    }
}
