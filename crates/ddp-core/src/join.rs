//! [`Join`]: training with uneven inputs (PyTorch's `torch.distributed.algorithms.Join` /
//! `DistributedDataParallel.join()`), framework-agnostic.
//!
//! The failure mode it removes: when one rank runs out of batches and leaves the training loop,
//! the others block in their next gradient all-reduce forever (seed 000's "infinite hang"). Under
//! `Join`, every rank runs the *same number of steps*: the loop lasts until the last rank runs
//! out, and a rank without data *shadows* the others' collectives with zero gradients.
//!
//! # Protocol (per step, on every rank)
//!
//! 1. [`Join::begin_step`]`(has_data)`: one small all-reduce telling every rank which ranks
//!    still have a batch. `None` means every rank is out of data: the loop ends on all ranks at
//!    the same step. [`Join::begin_step_or_stop`] carries a stop request (an interrupt, early
//!    stopping) in the same all-reduce, so that a stop on one rank ends the loop on all.
//! 2. Every rank calls [`Reducer::set_divisor`]`(step.divisor)` (buckets launched for the
//!    world size average inside the collective). A rank with data runs forward/backward and
//!    hands its gradients to the [`Reducer`] (`mark_ready`). A rank without data does nothing
//!    else here.
//! 3. Every rank calls [`Join::sync_gradients`] — for a rank without data this *is* the shadow:
//!    unmarked gradients count as zeros, so it issues exactly the same bucket all-reduces as the
//!    others. The sum is divided by the number of ranks that had data ([`JoinStep::divisor`]), so
//!    the result is the mean over the active ranks.
//! 4. **Every rank, including those without data, applies the averaged gradients**
//!    ([`Reducer::grad`]) with its optimizer. The gradients are bit-identical on all ranks, so
//!    replicas (and optimizer states, e.g. momentum) stay bit-identical as long as the optimizer
//!    step is deterministic — which is what keeps a joined rank ready for the next epoch.
//!
//! [`Join::run`] drives this loop so none of the steps can be forgotten. As a safety net (and
//! for code whose joined ranks skip the optimizer step, as in PyTorch), [`Join::sync_params`]
//! broadcasts the parameters from [`Join::authoritative_rank`], a rank that had data in the last
//! step, like PyTorch's final model synchronization.
//!
//! Differences from PyTorch: the default divisor is the number of *active* ranks (PyTorch's
//! `divide_by_initial_world_size=True` is available as
//! [`Join::divide_by_initial_world_size`]); a rank may also report `has_data = false` for a step
//! and `true` again later (e.g. an empty shard for one epoch) — every step is decided afresh.
//!
//! With gradient accumulation (`no_sync`), decide `has_data` once per *optimizer* step and call
//! `begin_step` once per optimizer step; all ranks must toggle
//! [`Reducer::set_require_backward_grad_sync`] identically, as always.
//!
//! ```no_run
//! # use ddp_core::join::Join;
//! # use ddp_core::reducer::{ParamSpec, Reducer, ReducerOptions};
//! # fn demo(pg: &ddp_comm::ProcessGroup, my_batches: Vec<Vec<f32>>) -> ddp_core::Result<()> {
//! struct Model { w: Vec<f32> }
//! let mut model = Model { w: vec![0.0; 4] };
//! let specs = vec![ParamSpec::new("w", vec![4], ddp_comm::DType::F32)];
//! let mut reducer = Reducer::new(pg, specs, ReducerOptions::default())?;
//! let mut join = Join::new(pg);
//! let summary = join.run(
//!     &mut reducer,
//!     &mut model,
//!     my_batches, // this rank's batches: any number, different on every rank
//!     |model, reducer, batch| {
//!         // forward + backward on `batch`, then hand over the gradients
//!         let grad: Vec<f32> = model.w.iter().zip(&batch).map(|(w, x)| w * x).collect();
//!         reducer.mark_ready(0, &grad)
//!     },
//!     |model, reducer, _step| {
//!         // optimizer step with the averaged gradient, on every rank
//!         for (w, g) in model.w.iter_mut().zip(reducer.grad::<f32>(0)?) {
//!             *w -= 0.1 * g;
//!         }
//!         Ok(())
//!     },
//! )?;
//! join.sync_params(&mut [&mut model.w[..]])?; // optional safety net: no-op if replicas agree
//! println!("{} steps, {} with data on this rank", summary.steps, summary.own_steps);
//! # Ok(()) }
//! ```

use crate::error::{Error, Result};
use crate::reducer::{broadcast_coalesced, Reducer, StepStats};
use ddp_comm::{Element, ProcessGroup, ReduceOp};

/// What every rank learns at the start of a step (identical on all ranks except `has_data`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinStep {
    /// Step number, from 0, counting steps in which at least one rank had data.
    pub index: u64,
    /// Whether *this* rank has a batch in this step (if not, it shadows).
    pub has_data: bool,
    /// The ranks that have a batch in this step, ascending (never empty).
    pub active_ranks: Vec<usize>,
    /// What the summed gradients are divided by: `active_ranks.len()`, or the world size under
    /// [`Join::divide_by_initial_world_size`].
    pub divisor: usize,
}

impl JoinStep {
    /// Number of ranks with a batch in this step.
    pub fn active(&self) -> usize {
        self.active_ranks.len()
    }
}

/// What [`Join::begin_step_or_stop`] decides, the same on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinStart {
    /// Run this step (some rank has data, none asked to stop).
    Step(JoinStep),
    /// Every rank is out of data: the loop ends.
    Done,
    /// These ranks (ascending, never empty) asked to stop: the loop ends on every rank.
    Stopped { ranks: Vec<usize> },
}

/// Counts of a finished [`Join`] loop (the same on every rank except `own_steps`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinSummary {
    /// Steps run by every rank (the longest rank's number of batches).
    pub steps: u64,
    /// Steps in which this rank had data.
    pub own_steps: u64,
    /// The ranks that had data in the last step (empty if there was no step).
    pub last_active_ranks: Vec<usize>,
}

/// The uneven-inputs context for one process group (see the module doc).
#[derive(Debug)]
pub struct Join {
    pg: ProcessGroup,
    divide_by_initial_world_size: bool,
    steps: u64,
    own_steps: u64,
    last_active_ranks: Vec<usize>,
    done: bool,
}

impl Join {
    /// A context over `pg` (the group the [`Reducer`] uses). Dividing by the active ranks.
    pub fn new(pg: &ProcessGroup) -> Join {
        Join {
            pg: pg.clone(),
            divide_by_initial_world_size: false,
            steps: 0,
            own_steps: 0,
            last_active_ranks: Vec::new(),
            done: false,
        }
    }

    /// PyTorch's `divide_by_initial_world_size`: `true` divides the summed gradients by the world
    /// size even when fewer ranks contributed (joined ranks weigh in as zeros); `false` (the
    /// default here) divides by the number of ranks that had data.
    pub fn divide_by_initial_world_size(mut self, yes: bool) -> Join {
        self.divide_by_initial_world_size = yes;
        self
    }

    /// Starts a step: one all-reduce (one `i64` per rank) telling every rank which ranks have
    /// data. Returns `None` — on every rank at the same step — once no rank has data; the loop
    /// must end then. Call it on every rank, every step, even when out of data.
    pub fn begin_step(&mut self, has_data: bool) -> Result<Option<JoinStep>> {
        Ok(match self.begin(has_data, false)? {
            JoinStart::Step(step) => Some(step),
            JoinStart::Done => None,
            JoinStart::Stopped { .. } => unreachable!("no rank asks to stop through begin_step"),
        })
    }

    /// [`begin_step`](Self::begin_step) that also carries a stop request in the same
    /// all-reduce: if any rank passes `stop = true` (a user interrupt, a data error, early
    /// stopping), every rank gets [`JoinStart::Stopped`] at this same step, naming the ranks that
    /// asked, and the loop must end on every rank — a rank leaving alone would leave the others
    /// in their next collective. One collective per step instead of two. A stop ends the loop
    /// like [`JoinStart::Done`] (call [`reset`](Self::reset) to start another).
    pub fn begin_step_or_stop(&mut self, has_data: bool, stop: bool) -> Result<JoinStart> {
        self.begin(has_data, stop)
    }

    fn begin(&mut self, has_data: bool, stop: bool) -> Result<JoinStart> {
        if self.done {
            return Err(Error::InvalidArgument(format!(
                "Join::begin_step on rank {} after the loop ended (every rank ran out of data \
                 or one asked to stop; step {}): the loop should have ended then (call reset() \
                 to start another loop)",
                self.pg.rank(),
                self.steps
            )));
        }
        // Bit 0: has data; bit 1: asks to stop.
        let mut flags = vec![0i64; self.pg.size()];
        flags[self.pg.rank()] = has_data as i64 | (stop as i64) << 1;
        self.pg.all_reduce(&mut flags, ReduceOp::Sum)?;
        let ranks = |bit: i64| -> Vec<usize> {
            (0..flags.len()).filter(|&r| flags[r] & bit != 0).collect()
        };
        let stopping = ranks(2);
        if !stopping.is_empty() {
            self.done = true;
            return Ok(JoinStart::Stopped { ranks: stopping });
        }
        let active_ranks = ranks(1);
        if active_ranks.is_empty() {
            self.done = true;
            return Ok(JoinStart::Done);
        }
        let step = JoinStep {
            index: self.steps,
            has_data,
            divisor: if self.divide_by_initial_world_size {
                self.pg.size()
            } else {
                active_ranks.len()
            },
            active_ranks,
        };
        self.steps += 1;
        self.own_steps += has_data as u64;
        self.last_active_ranks.clone_from(&step.active_ranks);
        Ok(JoinStart::Step(step))
    }

    /// Synchronizes this step's gradients on every rank: `reducer.finish_with_divisor(divisor)`.
    /// On a rank without data (which marked nothing) this is the shadow: its gradients count as
    /// zeros and it takes part in exactly the same bucket all-reduces as the active ranks.
    /// Afterwards [`Reducer::grad`] holds the mean over the active ranks on every rank.
    pub fn sync_gradients(&self, reducer: &mut Reducer, step: &JoinStep) -> Result<StepStats> {
        let size = reducer.process_group().size();
        if size != self.pg.size() {
            return Err(Error::InvalidArgument(format!(
                "Join::sync_gradients: the reducer's process group has {size} ranks, the Join's \
                 has {}: they must be the same group",
                self.pg.size()
            )));
        }
        reducer.finish_with_divisor(step.divisor)
    }

    /// Runs the whole uneven-inputs loop (a new loop, see [`reset`](Self::reset)): each step
    /// pulls this rank's next batch from `batches` (once it yields `None` it is not polled
    /// again), calls `backward(ctx, reducer, batch)` if
    /// there is one (it must `mark_ready` the gradients), synchronizes the gradients
    /// ([`sync_gradients`](Self::sync_gradients)) and calls `apply(ctx, reducer, step)` on
    /// *every* rank (the optimizer step with [`Reducer::grad`]). Ends when every rank is out of
    /// data. `ctx` is handed to both closures, so both can use the model mutably.
    ///
    /// An error from a closure ends the loop on this rank only; the other ranks' next
    /// collective then fails with an error naming this rank (once its process group is dropped)
    /// or times out.
    pub fn run<C, B, E>(
        &mut self,
        reducer: &mut Reducer,
        ctx: &mut C,
        batches: impl IntoIterator<Item = B>,
        mut backward: impl FnMut(&mut C, &mut Reducer, B) -> std::result::Result<(), E>,
        mut apply: impl FnMut(&mut C, &Reducer, &JoinStep) -> std::result::Result<(), E>,
    ) -> std::result::Result<JoinSummary, E>
    where
        E: From<Error>,
    {
        self.reset();
        let mut batches = batches.into_iter();
        let mut exhausted = false;
        loop {
            let batch = if exhausted { None } else { batches.next() };
            exhausted = batch.is_none();
            let Some(step) = self.begin_step(batch.is_some())? else {
                break;
            };
            reducer.set_divisor(step.divisor)?;
            if let Some(batch) = batch {
                reducer.prepare_for_backward()?;
                backward(ctx, reducer, batch)?;
            }
            self.sync_gradients(reducer, &step)?;
            apply(ctx, reducer, &step)?;
        }
        Ok(self.summary())
    }

    /// The lowest rank that had data in the last step: its parameters are the reference for
    /// [`sync_params`](Self::sync_params). `None` before the first step.
    pub fn authoritative_rank(&self) -> Option<usize> {
        self.last_active_ranks.first().copied()
    }

    /// Broadcasts `params` from [`authoritative_rank`](Self::authoritative_rank) to every rank
    /// (PyTorch's final model synchronization after `join`). Under the contract of the module
    /// doc the replicas already agree and this changes nothing; it repairs joined ranks that did
    /// not apply the updates. Call it on every rank with parameters in the same order (no-op if
    /// no step ran).
    pub fn sync_params<T: Element>(&self, params: &mut [&mut [T]]) -> Result<()> {
        match self.authoritative_rank() {
            Some(root) => broadcast_coalesced(&self.pg, params, root),
            None => Ok(()),
        }
    }

    /// Counts so far.
    pub fn summary(&self) -> JoinSummary {
        JoinSummary {
            steps: self.steps,
            own_steps: self.own_steps,
            last_active_ranks: self.last_active_ranks.clone(),
        }
    }

    /// Starts a new loop (e.g. the next epoch) with counters at zero. No communication: call it
    /// on every rank. [`run`](Self::run) does it itself.
    pub fn reset(&mut self) {
        self.steps = 0;
        self.own_steps = 0;
        self.last_active_ranks.clear();
        self.done = false;
    }

    /// Whether every rank has run out of data (`begin_step` returned `None`).
    pub fn is_done(&self) -> bool {
        self.done
    }
}

/// A decision rank 0 takes for every rank (early stopping: rank 0 evaluates, every rank learns
/// whether to stop): `decide` runs on rank 0 only and its answer is broadcast, so every rank
/// returns the same value and leaves (or stays in) the loop at the same step. A collective.
/// When `decide` fails on rank 0, rank 0 returns its error and every other rank an error
/// naming rank 0, instead of waiting in the next collective for a rank that has left.
pub fn rank0_decides<E: From<Error>>(
    pg: &ProcessGroup,
    decide: impl FnOnce() -> std::result::Result<bool, E>,
) -> std::result::Result<bool, E> {
    const CONTINUE: u8 = 0;
    const STOP: u8 = 1;
    const FAILED: u8 = 2;
    let (mut flag, mut failure) = ([CONTINUE], None);
    if pg.rank() == 0 {
        match decide() {
            Ok(stop) => flag[0] = if stop { STOP } else { CONTINUE },
            Err(e) => {
                flag[0] = FAILED;
                failure = Some(e);
            }
        }
    }
    pg.broadcast(&mut flag, 0).map_err(Error::from)?;
    match (flag[0], failure) {
        (_, Some(e)) => Err(e),
        (FAILED, None) => Err(Error::InvalidArgument(format!(
            "rank0_decides on rank {}: the decision failed on rank 0",
            pg.rank()
        ))
        .into()),
        (f, None) => Ok(f == STOP),
    }
}
