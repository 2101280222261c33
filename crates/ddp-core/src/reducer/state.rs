//! The per-step state machine of the [`Reducer`].
//!
//! - [`Reducer::mark_ready`] copies a gradient into its bucket's flat buffer; when every gradient
//!   of a bucket is in, the bucket goes to the comm hook (by default an `all_reduce_async`
//!   averaging over the ranks) — always in bucket order, so a later bucket that becomes ready
//!   first waits until the earlier ones have launched (every rank issues the same collectives in
//!   the same order). [`Reducer::finish`] launches what is left, waits for every bucket (the
//!   division by the world size, or by the number of still-active ranks under Join,
//!   [`Reducer::finish_with_divisor`], is part of the hook's work) and makes the averaged
//!   gradients readable with [`Reducer::grad`].
//! - `no_sync` ([`Reducer::set_require_backward_grad_sync`]): backwards run without sync add their
//!   gradients into the bucket buffers locally; the next synchronized backward adds its own and
//!   reduces the accumulated sum.
//! - Overlap measurement ([`StepStats`]): time blocked waiting for communication inside `finish`
//!   versus the whole backward+communication time of the step.
//! - The finite check ([`Reducer::set_check_finite`], submodule `finite`).
//! - The timeline ([`crate::trace`], when on): a `backward` span from the start of backward to
//!   the end of `finish`, each bucket's `ready` instant, its flight from launch to the end of the
//!   wait for it, and each wait.
//!
//! Parameters that receive no gradient in a backward (unused in this forward) contribute zeros;
//! a rank that has joined (run out of data) therefore shadows the others' collectives by calling
//! `finish_with_divisor` without marking anything.
//!
//! Handing the bucket buffers over and back between steps (ZeRO, `gradient_as_bucket_view`) is
//! in `handover`.

use super::assign::{compute_bucket_assignment, ReducerOptions};
use super::buffer::{BucketBuffer, BucketWork, HostBuffer, HostSlice};
use super::device::DeviceSlice;
use super::hook::{AllReduceHook, BucketParam, CommHook, GradBucket, HookState, ShardRange};
use super::spec::{require_trainable, verify_param_specs, ParamSpec};
use crate::error::{Error, Result};
use crate::trace;
use ddp_comm::{DType, Element, ProcessGroup};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod alive;
mod finite;
mod handover;
mod regroup;
use handover::reallocate_released;

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

enum BucketState {
    Idle(BucketBuffer),
    InFlight(BucketWork),
    /// The buffer went down with a failed collective.
    Lost,
}

struct Bucket {
    dtype: DType,
    params: Vec<usize>,
    /// Where each parameter sits in the buffer (shared with the hook's `GradBucket`).
    layout: Arc<[BucketParam]>,
    /// Shape of each parameter in `layout` (for the hook's `GradBucket::shapes`).
    shapes: Arc<[Vec<usize>]>,
    numel: usize,
    /// Gradients of this bucket not yet marked in the current backward.
    pending: usize,
    state: BucketState,
    /// When it was handed to the hook in this step (recorded only while tracing).
    launched: Option<Instant>,
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

/// A bucket's averaged gradients handed over by [`Reducer::take_averaged_buffers`]: the flat
/// buffer and where each parameter sits in it.
pub type TakenBucket = (HostBuffer, Arc<[BucketParam]>);

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
    hook: Box<dyn CommHook>,
    custom_hook: bool,
    pub(super) check_finite: bool,
    /// First parameter whose local gradient (sum under `no_sync`) was non-finite since the last
    /// synchronized step (only tracked with the finite check on).
    pub(super) local_nonfinite: Option<usize>,
    /// Index of the next synchronized step.
    step: u64,
    /// Payload bytes handed to collectives by the hook, summed over synchronized steps.
    sent_bytes: u64,
    /// [`set_max_bucket_bytes_alive`](Reducer::set_max_bucket_bytes_alive).
    alive_limit: Option<usize>,
    /// `ReducerOptions::bucket_cap_mb` in bytes.
    bucket_cap: usize,
    /// Buckets below this index (and below `next_launch`) were waited for before `finish`.
    waited_upto: usize,
    /// Time spent in those early waits this step (part of `StepStats::comm_wait`).
    early_wait: Duration,
}

impl Reducer {
    /// Verifies `specs` across ranks ([`verify_param_specs`]) and assigns buckets, each with a
    /// host buffer. `specs` must be in the same (deterministic) order on every rank — the candle
    /// adapter sorts by name.
    pub fn new(pg: &ProcessGroup, specs: Vec<ParamSpec>, opts: ReducerOptions) -> Result<Reducer> {
        let world = pg.size();
        Self::with_buffers(pg, specs, opts, |b| {
            BucketBuffer::Host(HostBuffer::zeros_padded(b.dtype, b.numel, world))
        })
    }

    /// [`new`](Self::new) with the bucket buffers made by `alloc` (e.g. device buckets): it gets
    /// each bucket's assignment and must return a buffer of that dtype and length.
    pub fn with_buffers(
        pg: &ProcessGroup,
        specs: Vec<ParamSpec>,
        opts: ReducerOptions,
        mut alloc: impl FnMut(&BucketInfo) -> BucketBuffer,
    ) -> Result<Reducer> {
        // Every framework adapter builds a reducer: freed step buffers stay with the process.
        crate::alloc::retain_freed_memory();
        require_trainable(&specs)?;
        verify_param_specs(pg, &specs)?;
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
        let mut buckets = Vec::with_capacity(assignment.len());
        for (b, params) in assignment.into_iter().enumerate() {
            let mut offset = 0;
            let mut layout = Vec::with_capacity(params.len());
            for &p in &params {
                let numel = specs[p].numel();
                slots[p].bucket = b;
                slots[p].offset = offset;
                slots[p].numel = numel;
                layout.push(BucketParam {
                    index: p,
                    offset,
                    numel,
                });
                offset += numel;
            }
            let info = BucketInfo {
                dtype: specs[params[0]].dtype,
                params,
                numel: offset,
            };
            let buf = alloc(&info);
            if buf.dtype() != info.dtype || buf.len() != info.numel {
                return Err(Error::InvalidArgument(format!(
                    "bucket {b}: the allocator returned a {} buffer of {} elements for a bucket \
                     of {} {} elements",
                    buf.dtype(),
                    buf.len(),
                    info.numel,
                    info.dtype
                )));
            }
            let shapes = info
                .params
                .iter()
                .map(|&p| specs[p].shape.clone())
                .collect();
            buckets.push(Bucket {
                dtype: info.dtype,
                pending: info.params.len(),
                params: info.params,
                layout: layout.into(),
                shapes,
                numel: info.numel,
                state: BucketState::Idle(buf),
                launched: None,
            });
        }
        Ok(Reducer {
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
            hook: Box::new(AllReduceHook),
            custom_hook: false,
            check_finite: false,
            local_nonfinite: None,
            step: 0,
            sent_bytes: 0,
            alive_limit: None,
            bucket_cap: (opts.bucket_cap_mb.max(0.0) * 1024.0 * 1024.0) as usize,
            waited_upto: 0,
            early_wait: Duration::ZERO,
        })
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

    /// PyTorch's `register_comm_hook`: buckets are reduced by `hook` instead of the default
    /// [`AllReduceHook`] (see [`CommHook`] for the contract). Every rank must register an
    /// equivalent hook. Once per reducer, between steps (an error otherwise).
    pub fn register_comm_hook(&mut self, hook: impl CommHook + 'static) -> Result<()> {
        if self.custom_hook {
            return Err(Error::InvalidArgument(
                "register_comm_hook: a comm hook is already registered (once per reducer, as \
                 in PyTorch)"
                    .into(),
            ));
        }
        if self.current.is_some() || self.next_launch > 0 {
            return Err(Error::InvalidArgument(
                "register_comm_hook: a backward is in progress; register the hook between steps"
                    .into(),
            ));
        }
        self.hook = Box::new(hook);
        self.custom_hook = true;
        Ok(())
    }

    /// The registered hook's state, for a checkpoint ([`CommHook::state_dict`]).
    pub fn comm_hook_state(&self) -> HookState {
        self.hook.state_dict()
    }

    /// Restores the registered hook's state from a checkpoint ([`CommHook::load_state_dict`]).
    pub fn load_comm_hook_state(&mut self, state: &HookState) -> Result<()> {
        self.hook.load_state_dict(state)
    }

    /// Payload bytes this rank handed to collectives for gradients, summed over every
    /// synchronized step: the bucket bytes under the default all-reduce, what the hook reports
    /// ([`CommHook::take_sent_bytes`]) otherwise (e.g. half of it with `bf16_compress`).
    pub fn bytes_sent(&self) -> u64 {
        self.sent_bytes
    }

    /// Turns the finite check on or off (default off; it must be the same on every rank): after
    /// each synchronized step the averaged gradients are checked for NaN and infinity, and if
    /// any is found `finish` fails on every rank with [`Error::NonFinite`], naming the step, the
    /// first rank whose local gradient was non-finite and the parameter. A healthy step costs
    /// one pass over the gradients and no communication.
    pub fn set_check_finite(&mut self, on: bool) {
        self.check_finite = on;
        self.local_nonfinite = None;
    }

    /// Whether the finite check is on.
    pub fn check_finite(&self) -> bool {
        self.check_finite
    }

    /// Sets the index of the next synchronized step (what [`Error::NonFinite`] reports), e.g. the
    /// step a resumed run starts at. Counts up by one per synchronized `finish`.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// The index of the next synchronized step.
    pub fn step(&self) -> u64 {
        self.step
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
    /// `no_sync` backwards, added) into its bucket; when the bucket is complete it goes to the
    /// comm hook, in bucket order. Each parameter may be marked once per backward.
    pub fn mark_ready<T: Element>(&mut self, index: usize, grad: &[T]) -> Result<()> {
        self.mark_ready_flat(index, HostSlice::of(grad))
    }

    /// [`mark_ready`](Self::mark_ready) with the gradient in its enum form (what framework
    /// adapters hand over without knowing the element type statically).
    pub fn mark_ready_flat(&mut self, index: usize, grad: HostSlice<'_>) -> Result<()> {
        self.mark_ready_with(index, grad.dtype(), grad.len(), |buf, offset, add| {
            buf.write(offset, grad, add)
        })
    }

    /// [`mark_ready`](Self::mark_ready) for a gradient in device memory: copied (or added) into
    /// its device bucket on the device, without a host round trip. The bucket must be a device
    /// bucket that takes this kind of memory (an error naming the parameter otherwise).
    pub fn mark_ready_device(&mut self, index: usize, grad: DeviceSlice<'_>) -> Result<()> {
        let (dtype, len) = (grad.dtype(), grad.len());
        self.mark_ready_with(index, dtype, len, |buf, offset, add| {
            buf.write_device(offset, grad, add)
        })
    }

    /// Whether parameter `index`'s bucket lives in device memory (adapters then hand its
    /// gradients over with [`mark_ready_device`](Self::mark_ready_device)).
    pub fn is_device_bucket(&self, index: usize) -> bool {
        self.slots.get(index).is_some_and(|s| {
            matches!(
                self.buckets[s.bucket].state,
                BucketState::Idle(BucketBuffer::Device(_))
            )
        })
    }

    /// The bookkeeping of every `mark_ready*`: checks, then `write(buffer, offset, add)`.
    fn mark_ready_with(
        &mut self,
        index: usize,
        dtype: DType,
        len: usize,
        write: impl FnOnce(&mut BucketBuffer, usize, bool) -> std::result::Result<(), String>,
    ) -> Result<()> {
        self.check_failed()?;
        let spec = self.specs.get(index).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "mark_ready: parameter index {index} out of range ({} parameters registered)",
                self.specs.len()
            ))
        })?;
        if dtype != spec.dtype {
            return Err(Error::InvalidArgument(format!(
                "mark_ready: gradient of {spec} given as {dtype}"
            )));
        }
        let slot = self.slots[index];
        if len != slot.numel {
            return Err(Error::InvalidArgument(format!(
                "mark_ready: gradient of {spec} has {len} elements, expected {}",
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
        if self.current == Some(true)
            && self.buckets[slot.bucket].pending == self.buckets[slot.bucket].params.len()
        {
            self.limit_alive(slot.bucket);
        }
        let bucket = &mut self.buckets[slot.bucket];
        let BucketState::Idle(buf) = &mut bucket.state else {
            unreachable!("a bucket with unmarked gradients is never in flight");
        };
        reallocate_released(buf, bucket.dtype, bucket.numel, self.pg.size());
        if let Err(e) = write(buf, slot.offset, slot.accumulated) {
            let spec = &self.specs[index];
            return Err(Error::InvalidArgument(format!("mark_ready: {spec}: {e}")));
        }
        if self.check_finite
            && self.local_nonfinite.is_none()
            && !finite::all_finite(buf, slot.offset, slot.numel)
        {
            self.local_nonfinite = Some(index);
        }
        let s = &mut self.slots[index];
        s.marked = true;
        s.accumulated = true;
        bucket.pending -= 1;
        if bucket.pending == 0 && trace::enabled() {
            trace::instant(
                format!("bucket {} ready", slot.bucket),
                "bucket",
                vec![
                    ("bucket", slot.bucket.into()),
                    ("bytes", (bucket.numel * bucket.dtype.size()).into()),
                    ("step", self.step.into()),
                ],
            );
        }
        if self.current == Some(true) {
            self.launch_ready();
        }
        Ok(())
    }

    /// Hands every bucket that is complete and whose predecessors have all launched to the hook.
    fn launch_ready(&mut self) {
        let last = self.buckets.len().saturating_sub(1);
        while self.next_launch < self.buckets.len() && self.buckets[self.next_launch].pending == 0 {
            let index = self.next_launch;
            let b = &mut self.buckets[index];
            b.launched = trace::enabled().then(Instant::now);
            let state = std::mem::replace(&mut b.state, BucketState::Lost);
            b.state = match state {
                BucketState::Idle(buffer) => BucketState::InFlight(self.hook.run(
                    &self.pg,
                    GradBucket {
                        index,
                        is_last: index == last,
                        divisor: self.divisor,
                        buffer,
                        params: b.layout.clone(),
                        shapes: b.shapes.clone(),
                        step: self.step,
                    },
                )),
                other => other,
            };
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
            if trace::enabled() {
                let args = vec![("step", self.step.into())];
                trace::record_span("backward (no_sync)", "train", start, Instant::now(), args);
            }
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
            reallocate_released(buf, b.dtype, b.numel, self.pg.size());
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
        let mut comm_wait = std::mem::take(&mut self.early_wait);
        let mut bytes = 0;
        for bi in 0..self.buckets.len() {
            let b = &mut self.buckets[bi];
            let state = std::mem::replace(&mut b.state, BucketState::Lost);
            let BucketState::InFlight(work) = state else {
                unreachable!("every bucket was launched");
            };
            let t = Instant::now();
            let shard = self.hook.shard_range(&self.pg, bi, b.numel);
            let result = work.wait().and_then(|buf| {
                let fits = match &shard {
                    None => buf.len() == b.numel,
                    Some(r) => buf.len() <= b.numel && r.buffer.end <= buf.len(),
                };
                if buf.dtype() == b.dtype && fits {
                    Ok(buf)
                } else {
                    Err(ddp_comm::Error::InvalidArgument(format!(
                        "the comm hook returned a {} buffer of {} elements for bucket {bi} of {} \
                         {} elements",
                        buf.dtype(),
                        buf.len(),
                        b.numel,
                        b.dtype
                    )))
                }
            });
            let waited = Instant::now();
            comm_wait += waited - t;
            if let Some(launched) = b.launched.take() {
                let bytes = b.numel * b.dtype.size();
                let args = || {
                    vec![
                        ("bucket", bi.into()),
                        ("bytes", bytes.into()),
                        ("params", b.params.len().into()),
                        ("step", self.step.into()),
                    ]
                };
                trace::record_span(format!("wait bucket {bi}"), "bucket", t, waited, args());
                let id = (self.step << 16) | bi as u64;
                trace::record_async(
                    format!("bucket {bi}"),
                    "bucket",
                    id,
                    launched,
                    waited,
                    args(),
                );
            }
            match result {
                Ok(buf) => {
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
        self.waited_upto = 0;
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
        if trace::enabled() {
            let args = vec![
                ("step", self.step.into()),
                ("buckets", self.buckets.len().into()),
                ("bytes", bytes.into()),
                ("comm_wait_ms", (comm_wait.as_secs_f64() * 1e3).into()),
            ];
            trace::record_span("backward", "train", start, Instant::now(), args);
        }
        self.totals.steps += 1;
        self.totals.total += stats.total;
        self.totals.comm_wait += stats.comm_wait;
        self.totals.bytes += bytes as u64;
        self.sent_bytes += self.hook.take_sent_bytes().unwrap_or(bytes as u64);
        self.last = Some(stats);
        let step = self.step;
        self.step += 1;
        if self.check_finite {
            self.check_averaged_finite(step)?;
        }
        Ok(stats)
    }

    /// The averaged gradients of every bucket, in launch order, with each bucket's layout (for
    /// the finite check).
    /// The averaged buckets with where this rank's shard of each lies, if the hook shards them
    /// (`None` per bucket otherwise).
    pub(super) fn averaged_shards(
        &self,
    ) -> impl Iterator<Item = (&BucketBuffer, &[BucketParam], Option<ShardRange>)> {
        self.buckets
            .iter()
            .enumerate()
            .filter_map(|(i, b)| match &b.state {
                BucketState::Idle(buf) => Some((
                    buf,
                    &b.layout[..],
                    self.hook.shard_range(&self.pg, i, b.numel),
                )),
                _ => None,
            })
    }

    /// Whether the registered hook shards the averaged buckets ([`CommHook::shard_range`]).
    pub(super) fn hook_shards(&self) -> bool {
        self.hook.shard_range(&self.pg, 0, 1).is_some()
    }

    fn results(&self, index: usize, what: &str) -> Result<(&BucketBuffer, Slot)> {
        if !self.results_valid {
            return Err(Error::InvalidArgument(format!(
                "{what}: no synchronized gradients available (call finish() after a synced \
                 backward)"
            )));
        }
        if index >= self.specs.len() {
            return Err(Error::InvalidArgument(format!(
                "{what}: parameter index {index} out of range"
            )));
        }
        let slot = self.slots[index];
        let b = &self.buckets[slot.bucket];
        let BucketState::Idle(buf) = &b.state else {
            unreachable!("results are valid only when every bucket is idle");
        };
        if self
            .hook
            .shard_range(&self.pg, slot.bucket, b.numel)
            .is_some()
        {
            return Err(Error::InvalidArgument(format!(
                "{what}: bucket {} holds only this rank's shard of its averaged gradients (a \
                 sharding comm hook); read it whole with bucket_grads",
                slot.bucket
            )));
        }
        Ok((buf, slot))
    }

    /// The averaged gradient of parameter `index` after a synchronized `finish`, valid until
    /// the next backward starts. Host buckets only (see [`with_grad`](Self::with_grad)).
    pub fn grad<T: Element>(&self, index: usize) -> Result<&[T]> {
        let (buf, slot) = self.results(index, "grad")?;
        let spec = &self.specs[index];
        if T::DTYPE != spec.dtype {
            return Err(Error::InvalidArgument(format!(
                "grad: gradient of {spec} requested as {}",
                T::DTYPE
            )));
        }
        let host = buf.as_host().ok_or_else(|| {
            Error::InvalidArgument(format!(
                "grad: the gradient of {spec} is in a device bucket (use with_grad)"
            ))
        })?;
        let v = host
            .as_slice::<T>()
            .expect("bucket dtype matches its parameters");
        Ok(&v[slot.offset..slot.offset + slot.numel])
    }

    /// The whole host buffer of bucket `bucket` after a synchronized `finish` (every parameter
    /// at its [`BucketParam`] offset; a comm hook such as ZeRO's reduce-scatter may leave some
    /// ranges unreduced, or return this rank's chunk alone: [`CommHook::shard_range`]), valid
    /// until the next backward starts.
    pub fn bucket_grads<T: Element>(&self, bucket: usize) -> Result<&[T]> {
        if bucket >= self.buckets.len() {
            return Err(Error::InvalidArgument(format!(
                "bucket_grads: bucket {bucket} does not exist ({} buckets)",
                self.buckets.len()
            )));
        }
        if !self.results_valid {
            return Err(Error::InvalidArgument(
                "bucket_grads: no synchronized gradients available (call finish() after a \
                 synced backward)"
                    .into(),
            ));
        }
        let BucketState::Idle(buf) = &self.buckets[bucket].state else {
            unreachable!("results are valid only when every bucket is idle");
        };
        buf.as_host()
            .and_then(|h| h.as_slice::<T>())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "bucket_grads: bucket {bucket} is not a host buffer of {}",
                    T::DTYPE
                ))
            })
    }

    /// Calls `f` with the averaged gradient of parameter `index` (after a synchronized `finish`):
    /// borrowed from a host bucket, copied from a device bucket.
    pub fn with_grad<R>(&self, index: usize, f: impl FnOnce(HostSlice<'_>) -> R) -> Result<R> {
        let (buf, slot) = self.results(index, "with_grad")?;
        Ok(match buf {
            BucketBuffer::Host(h) => f(h.range(slot.offset, slot.numel)),
            BucketBuffer::Device(d) => f(d.to_host(slot.offset, slot.numel).as_host_slice()),
        })
    }

    /// Calls `f` with the averaged gradient of parameter `index` as device memory, a view into
    /// its device bucket (after a synchronized `finish`); `Ok(None)` for a host bucket or a
    /// device bucket without device views (use [`with_grad`](Self::with_grad) then).
    pub fn with_device_grad<R>(
        &self,
        index: usize,
        f: impl FnOnce(DeviceSlice<'_>) -> R,
    ) -> Result<Option<R>> {
        let (buf, slot) = self.results(index, "with_device_grad")?;
        Ok(buf.device_range(slot.offset, slot.numel).map(f))
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
