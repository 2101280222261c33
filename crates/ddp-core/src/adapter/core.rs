//! [`DdpCore`]: the framework-agnostic half of a DDP wrapper (PyTorch's one
//! `DistributedDataParallel` around c10d's one reducer), which every framework adapter embeds
//! and exposes through `Deref`.
//!
//! ```text
//!   ddp_candle::DistributedDataParallel ─┐ Deref                ┌─ process group, reducer
//!   ddp_burn::DistributedDataParallel<M> ┴──────► DdpCore<P> ───┼─ sync flag (no_sync → NoSync)
//!   (forward, backward, gradients,                (P: ParamAccess) ├─ Join step, has-data check
//!    optimizer step, framework records)                        ├─ statistics, parameter names
//!                                                              └─ save_checkpoint's tail
//! ```
//!
//! What a wrapper writes itself is what touches its framework: running the backward (handing
//! the gradients over with [`DdpCore::mark_grads`]), collecting the averaged gradients into the
//! framework's container, and the tensors it saves. Everything else is here once, so a method
//! such as `ddp.rank()`, `ddp.reducer_mut()` or `ddp.register_comm_hook(h)` is the same method
//! for every framework, reached through `Deref` without importing a trait. The wrapper declares
//! itself with [`DdpWrapper`], which gives it the shared [`NoSync`] guard and
//! [`DdpWrapper::join_step`].

use super::{mark_grads, ParamAccess};
use crate::checkpoint::{save_atomic, AsyncCheckpointer, Checkpoint, CheckpointMeta, Submitted};
use crate::error::Result;
use crate::join::{Join, JoinStep};
use crate::reducer::{CommHook, Reducer, StepStats, TotalStats};
use crate::sampler::SamplerState;
use ddp_comm::process_group::{RegroupOptions, Regrouped};
use ddp_comm::ProcessGroup;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};

/// The part of an asynchronous checkpoint that runs on the writer thread
/// ([`DdpCore::write_checkpoint_async`]): adds what the snapshot deferred (e.g. serializes
/// immutable tensors it kept).
pub type Deferred = Box<dyn FnOnce(&mut Checkpoint) -> Result<()> + Send>;

/// The process group, the named parameters (`P`, the adapter's [`ParamAccess`]) and the
/// [`Reducer`] of a DDP wrapper, with every method that does not touch the framework (see the
/// module doc).
pub struct DdpCore<P> {
    pg: ProcessGroup,
    params: P,
    reducer: Reducer,
}

impl<P: ParamAccess> DdpCore<P> {
    /// The core over `params`, whose gradients `reducer` (built from
    /// [`param_specs`](super::param_specs)`(&params)`) reduces over `pg`.
    pub fn new(pg: &ProcessGroup, params: P, reducer: Reducer) -> Self {
        DdpCore {
            pg: pg.clone(),
            params,
            reducer,
        }
    }

    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    pub fn rank(&self) -> usize {
        self.pg.rank()
    }

    pub fn world_size(&self) -> usize {
        self.pg.size()
    }

    /// The wrapped parameters as `ddp-core`'s adapter contract sees them.
    pub fn params(&self) -> &P {
        &self.params
    }

    /// The wrapped parameters, mutably (an adapter re-reading its parameter ids).
    pub fn params_mut(&mut self) -> &mut P {
        &mut self.params
    }

    /// The underlying reducer (bucket assignment, timing).
    pub fn reducer(&self) -> &Reducer {
        &self.reducer
    }

    /// The underlying reducer, e.g. to set the step after resuming or for Join's
    /// `finish_with_divisor`.
    pub fn reducer_mut(&mut self) -> &mut Reducer {
        &mut self.reducer
    }

    /// The parameters and the reducer at once (a backward that hands gradients over while it
    /// reads the parameters).
    pub fn parts_mut(&mut self) -> (&mut P, &mut Reducer) {
        (&mut self.params, &mut self.reducer)
    }

    /// Number of parameters (tensors) wrapped.
    pub fn param_count(&self) -> usize {
        self.params.param_count()
    }

    /// PyTorch's `register_comm_hook`: gradient buckets are reduced by `hook` instead of the
    /// default all-reduce average (see [`CommHook`] for the contract). Every rank must register
    /// an equivalent hook, once, between steps.
    pub fn register_comm_hook(&mut self, hook: impl CommHook + 'static) -> Result<(), P::Error> {
        Ok(self.reducer.register_comm_hook(hook)?)
    }

    /// PyTorch's `require_backward_grad_sync`; prefer the wrapper's `no_sync` ([`NoSync`]).
    pub fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.reducer.set_require_backward_grad_sync(sync);
    }

    /// Timing of the last backward (communication wait vs backward+communication).
    pub fn last_step_stats(&self) -> Option<StepStats> {
        self.reducer.last_step_stats()
    }

    /// Timing summed over all synchronized steps.
    pub fn total_stats(&self) -> TotalStats {
        self.reducer.total_stats()
    }

    /// The parameter names, in registration order (for
    /// [`ReplicaReport::describe`](crate::verify::ReplicaReport::describe)).
    pub fn param_names(&self) -> Vec<&str> {
        self.reducer
            .specs()
            .iter()
            .map(|s| s.name.as_str())
            .collect()
    }

    /// Starts a backward ([`Reducer::prepare_for_backward`]).
    pub fn prepare_for_backward(&mut self) -> Result<(), P::Error> {
        Ok(self.reducer.prepare_for_backward()?)
    }

    /// Hands every gradient present in `grads` to the reducer, last parameter first
    /// ([`mark_grads`] on this core's parameters and reducer).
    pub fn mark_grads(
        &mut self,
        grads: &mut P::Grads,
        before: impl FnMut(usize, &P::Grads) -> Result<(), P::Error>,
    ) -> Result<(), P::Error> {
        mark_grads(&self.params, &mut self.reducer, grads, before)
    }

    /// Ends a backward ([`Reducer::finish`]): the step's statistics; its `synced` says whether
    /// the buckets now hold averaged gradients.
    pub fn finish(&mut self) -> Result<StepStats, P::Error> {
        Ok(self.reducer.finish()?)
    }

    /// A [`Join`] step's input must agree with what this rank told `Join::begin_step`: an error
    /// naming `what` (the method) and `input` (what it takes) otherwise.
    pub fn check_has_data(
        &self,
        what: &str,
        given: bool,
        input: &str,
        step: &JoinStep,
    ) -> Result<(), P::Error> {
        if given == step.has_data {
            return Ok(());
        }
        Err(crate::Error::InvalidArgument(format!(
            "{what} on rank {}: this rank reported has_data = {} to Join::begin_step but passed \
             {} {input}",
            self.rank(),
            step.has_data,
            if given { "its" } else { "no" }
        ))
        .into())
    }

    /// The metadata of a checkpoint at the start of epoch `epoch` (sampler epoch `epoch`,
    /// nothing consumed), at the reducer's step, with the process group's world size.
    pub fn epoch_meta(&self, epoch: u64) -> CheckpointMeta {
        CheckpointMeta {
            step: self.reducer.step(),
            epoch,
            sampler: SamplerState { epoch, consumed: 0 },
            world_size: self.pg.size(),
            ..Default::default()
        }
    }

    /// What every wrapper's `save_checkpoint_with` does after choosing its tensors (a
    /// collective): `meta.world_size` set to the group's size; every rank's comm hook state
    /// gathered; on rank 0 a checkpoint of `meta`, filled by `fill` (the framework's model and
    /// optimizer) and the hook states, written atomically to `dir`
    /// ([`save_atomic`]). Returns the file on rank 0, `None` elsewhere; rank 0's failure fails
    /// every rank ([`agree`](crate::sharding::agree)).
    pub fn write_checkpoint(
        &self,
        dir: &Path,
        mut meta: CheckpointMeta,
        fill: impl FnOnce(&mut Checkpoint) -> Result<()>,
    ) -> Result<Option<PathBuf>> {
        meta.world_size = self.pg.size();
        // Every rank's comm hook state (a collective, so before the rank-0-only part).
        let hooks = crate::hooks::state::gather_state(&self.pg, &self.reducer.comm_hook_state())?;
        let written = if self.pg.rank() == 0 {
            (|| -> Result<PathBuf> {
                let mut ckpt = Checkpoint::new(meta);
                fill(&mut ckpt)?;
                ckpt.save_hook_state(&hooks)?;
                save_atomic(dir, &ckpt)
            })()
            .map(Some)
        } else {
            Ok(None)
        };
        // Rank 0's failure fails every rank (the others would otherwise carry on without a
        // checkpoint); the others' `Ok(None)` never fails rank 0.
        crate::sharding::agree(&self.pg, "saving the checkpoint", written)
    }

    /// [`write_checkpoint`](Self::write_checkpoint) with the write in the background
    /// ([`AsyncCheckpointer`]): every rank's comm hook state is gathered (a collective) and rank
    /// 0 takes the snapshot, `snapshot(ckpt)` filling what must be copied now and returning
    /// what may run on the writer thread (e.g. serializing immutable tensors), which then
    /// serializes and writes the file. The stall is the snapshot alone. Returns rank 0's
    /// [`Submitted`] (`None` on the other ranks); an error taking the snapshot on rank 0 is an
    /// error on every rank, a failed write is reported later by the checkpointer (rank 0) and
    /// leaves the previous checkpoint current.
    pub fn write_checkpoint_async(
        &self,
        saver: &mut AsyncCheckpointer,
        dir: &Path,
        mut meta: CheckpointMeta,
        snapshot: impl FnOnce(&mut Checkpoint) -> Result<Option<Deferred>>,
    ) -> Result<Option<Submitted>> {
        meta.world_size = self.pg.size();
        let step = meta.step;
        let hooks = crate::hooks::state::gather_state(&self.pg, &self.reducer.comm_hook_state())?;
        let taken = if self.pg.rank() == 0 {
            (|| -> Result<(Checkpoint, Option<Deferred>)> {
                let mut ckpt = Checkpoint::new(meta);
                let deferred = snapshot(&mut ckpt)?;
                ckpt.save_hook_state(&hooks)?;
                Ok((ckpt, deferred))
            })()
            .map(Some)
        } else {
            Ok(None)
        };
        let Some((mut ckpt, deferred)) =
            crate::sharding::agree(&self.pg, "taking the checkpoint snapshot", taken)?
        else {
            return Ok(None);
        };
        Ok(Some(saver.save(dir, step, move || {
            if let Some(finish) = deferred {
                finish(&mut ckpt)?;
            }
            Ok(ckpt)
        })))
    }
}

/// What [`DdpCore::sync_state`] did: whose state every member now has, at which step, and the
/// state this rank must load (`None` when it already had it).
#[derive(Debug)]
pub struct StateSync {
    /// The rank whose state was taken: the most advanced survivor (the lowest rank among equals).
    pub source: usize,
    /// The number of steps that state has taken.
    pub step: u64,
    /// The source's state, on every rank that must load it (a newcomer, or a survivor one step
    /// behind the source); `None` on the source and on ranks already equal to it.
    pub received: Option<Checkpoint>,
    /// Whether the state was sent at all (some member differed from the source).
    pub sent: bool,
}

impl<P: ParamAccess> DdpCore<P> {
    /// In-place recovery, first half: form the new group with the processes still here
    /// ([`ProcessGroup::regroup`]; `cause` is the failed step's error, `None` when regrouping to
    /// take newcomers in) and move the reducer onto it, dropping the failed step's partial
    /// gradients ([`Reducer::regroup`]). Then call [`sync_state`](Self::sync_state). A
    /// collective over the survivors (and newcomers, who build their wrapper on the new group).
    pub fn regroup(
        &mut self,
        cause: Option<&ddp_comm::Error>,
        opts: &RegroupOptions,
    ) -> Result<Regrouped> {
        let regrouped = self.pg.regroup(cause, opts)?;
        self.reducer.regroup(&regrouped.group)?;
        self.pg = regrouped.group.clone();
        Ok(regrouped)
    }

    /// In-place recovery, second half (and a newcomer's first step): every member agrees on the
    /// most advanced state and gets it. `step` is the number of optimizer steps this rank has
    /// completed (`None` for a newcomer, which has none of its own). A survivor whose last step
    /// completed everywhere before the failure is one step ahead of one whose step failed; the
    /// most advanced survivor's state is the true one (its all-reduce had every rank's
    /// gradient), so it is `snapshot()` taken on that rank and broadcast (the parameters,
    /// optimizer state and position, as a checkpoint would hold them) to every rank that
    /// differs. When all survivors are at the same step and no newcomer came, nothing is sent.
    /// A collective.
    pub fn sync_state(
        &self,
        step: Option<u64>,
        snapshot: impl FnOnce() -> Result<Checkpoint>,
    ) -> Result<StateSync> {
        let mine = [step.map_or(-1, |s| s as i64)];
        let mut all = vec![0i64; self.pg.size()];
        self.pg.all_gather(&mine, &mut all)?;
        let steps: Vec<Option<u64>> = all.iter().map(|&s| (s >= 0).then_some(s as u64)).collect();
        let Some(best) = steps.iter().flatten().max().copied() else {
            return Err(crate::Error::InvalidArgument(
                "sync_state: no member of the group has a state to give (every one is a newcomer)"
                    .into(),
            ));
        };
        let source = steps.iter().position(|s| *s == Some(best)).unwrap();
        if steps.iter().all(|s| *s == Some(best)) {
            return Ok(StateSync {
                source,
                step: best,
                received: None,
                sent: false,
            });
        }
        let local = match self.pg.rank() == source {
            true => Some(snapshot()?),
            false => None,
        };
        let got = crate::checkpoint::broadcast(&self.pg, local.as_ref(), source)?;
        let received = match self.pg.rank() == source || step == Some(best) {
            true => None,
            false => Some(got.ok_or_else(|| {
                crate::Error::Checkpoint(format!("sync_state: rank {source} sent no state"))
            })?),
        };
        Ok(StateSync {
            source,
            step: best,
            received,
            sent: true,
        })
    }
}

/// A framework's DDP wrapper: a [`DdpCore`] (reached through `Deref`) and the framework's own
/// methods around it. Implementing it (one line: the parameter type) gives the wrapper the
/// shared [`NoSync`] guard and [`join_step`](Self::join_step).
pub trait DdpWrapper: DerefMut<Target = DdpCore<Self::Params>> {
    /// The adapter's parameters ([`ParamAccess`]).
    type Params: ParamAccess;

    /// One step under [`Join`] (uneven inputs, PyTorch's `model.join()`), whatever the
    /// framework: `input` (`what`'s `input_name`) must be `Some` exactly when this rank told
    /// `Join::begin_step` it had data; the reducer's divisor is the step's; `backward(self,
    /// input)` runs this rank's backward when it has data (handing its gradients to the reducer);
    /// then this rank's buckets join the others' reduction (shadowing them with zeros once it
    /// has run out). Returns the step's statistics and what `backward` returned.
    #[allow(clippy::type_complexity)]
    fn join_step<I, T>(
        &mut self,
        what: &str,
        input_name: &str,
        input: Option<I>,
        join: &Join,
        step: &JoinStep,
        backward: impl FnOnce(&mut Self, I) -> Result<T, <Self::Params as ParamAccess>::Error>,
    ) -> Result<(StepStats, Option<T>), <Self::Params as ParamAccess>::Error> {
        self.check_has_data(what, input.is_some(), input_name, step)?;
        self.reducer_mut().set_divisor(step.divisor)?;
        let local = match input {
            Some(input) => Some(backward(self, input)?),
            None => None,
        };
        let stats = join.sync_gradients(self.reducer_mut(), step)?;
        Ok((stats, local))
    }
}

/// Guard of a wrapper's `no_sync` (PyTorch's `with ddp.no_sync():`): while it lives, backwards
/// accumulate gradients locally without communicating; dropping it restores the previous
/// setting. Derefs to the wrapper, so the backward runs through it.
pub struct NoSync<'a, W: DdpWrapper + ?Sized> {
    ddp: &'a mut W,
    prev: bool,
}

impl<'a, W: DdpWrapper + ?Sized> NoSync<'a, W> {
    /// Turns gradient synchronization off on `ddp` until the guard is dropped.
    pub fn new(ddp: &'a mut W) -> Self {
        let prev = ddp.reducer().require_backward_grad_sync();
        ddp.set_require_backward_grad_sync(false);
        NoSync { ddp, prev }
    }
}

impl<W: DdpWrapper + ?Sized> Deref for NoSync<'_, W> {
    type Target = W;
    fn deref(&self) -> &W {
        self.ddp
    }
}

impl<W: DdpWrapper + ?Sized> DerefMut for NoSync<'_, W> {
    fn deref_mut(&mut self) -> &mut W {
        self.ddp
    }
}

impl<W: DdpWrapper + ?Sized> Drop for NoSync<'_, W> {
    fn drop(&mut self) {
        let prev = self.prev;
        self.ddp.set_require_backward_grad_sync(prev);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapter::{param_specs, tests::Toy};
    use crate::reducer::ReducerOptions;
    use std::cell::RefCell;
    use std::collections::HashMap;

    /// A third framework's wrapper: what it writes itself is its backward (here: gradients
    /// given as a map); the rest is the core's.
    struct ToyDdp(DdpCore<Toy>);

    impl Deref for ToyDdp {
        type Target = DdpCore<Toy>;
        fn deref(&self) -> &DdpCore<Toy> {
            &self.0
        }
    }

    impl DerefMut for ToyDdp {
        fn deref_mut(&mut self) -> &mut DdpCore<Toy> {
            &mut self.0
        }
    }

    impl DdpWrapper for ToyDdp {
        type Params = Toy;
    }

    impl ToyDdp {
        fn local(&mut self, mut grads: HashMap<usize, Vec<f32>>) -> Result<()> {
            self.prepare_for_backward()?;
            self.mark_grads(&mut grads, |_, _| Ok(()))
        }

        fn backward(&mut self, grads: HashMap<usize, Vec<f32>>) -> Result<StepStats> {
            self.local(grads)?;
            self.finish()
        }

        fn averaged(&self) -> Vec<f32> {
            let got = self
                .reducer()
                .with_grad(0, |g| g.get::<f32>().unwrap().to_vec());
            got.unwrap()
        }
    }

    fn grads(v: f32) -> HashMap<usize, Vec<f32>> {
        HashMap::from([(0, vec![v; 2])])
    }

    #[test]
    fn a_third_adapter_gets_no_sync_join_and_checkpoints_from_the_core() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        ddp_comm::testing::run_ranks(2, move |pg| {
            let r = pg.rank() as f32;
            let toy = Toy {
                params: vec![("a".into(), RefCell::new(vec![r; 2]))],
            };
            let specs = param_specs(&toy).unwrap();
            let reducer = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
            let mut ddp = ToyDdp(DdpCore::new(&pg, toy, reducer));
            assert_eq!(ddp.param_names(), vec!["a"]);
            assert_eq!(
                (ddp.rank(), ddp.world_size(), ddp.param_count()),
                (pg.rank(), 2, 1)
            );

            // no_sync: a local backward, then the guard restores synchronization and the next
            // backward reduces the sum of both: ((1 + 2) * 2) / 2.
            {
                let mut guard = NoSync::new(&mut ddp);
                assert!(!guard.backward(grads(r + 1.0)).unwrap().synced);
            }
            assert!(ddp.reducer().require_backward_grad_sync());
            assert!(ddp.backward(grads(r + 1.0)).unwrap().synced);
            assert_eq!(ddp.averaged(), vec![3.0; 2]);
            assert_eq!(ddp.total_stats().steps, 1);

            // Join: rank 1 has run out; rank 0's gradient is averaged over itself alone.
            let mut join = Join::new(&pg);
            let step = join.begin_step(pg.rank() == 0).unwrap().unwrap();
            let input = step.has_data.then(|| grads(7.0));
            let (stats, ran) = ddp
                .join_step("backward", "gradients", input, &join, &step, |d, g| {
                    d.local(g)
                })
                .unwrap();
            assert!(stats.synced);
            assert_eq!(ran.is_some(), pg.rank() == 0);
            assert_eq!(ddp.averaged(), vec![7.0; 2]);
            // An input that contradicts has_data is refused before any collective.
            let wrong = (!step.has_data).then(|| grads(1.0));
            let e = ddp
                .join_step("backward", "gradients", wrong, &join, &step, |d, g| {
                    d.local(g)
                })
                .unwrap_err()
                .to_string();
            assert!(e.contains("has_data"), "{e}");

            // The checkpoint tail: rank 0 writes what `fill` adds, every rank agrees.
            let meta = ddp.epoch_meta(3);
            assert_eq!((meta.epoch, meta.world_size), (3, 2));
            let written = ddp
                .write_checkpoint(&path, meta, |ckpt| ckpt.insert("a", vec![2], vec![r; 2]))
                .unwrap();
            assert_eq!(written.is_some(), pg.rank() == 0);
            // Rank 0's failure is every rank's.
            let failed = ddp.write_checkpoint(&path, ddp.epoch_meta(4), |_| {
                Err(crate::Error::Checkpoint("no room".into()))
            });
            assert!(failed.is_err());
        });
    }
}
