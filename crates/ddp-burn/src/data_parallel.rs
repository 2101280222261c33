//! [`DistributedDataParallel`]: the Burn-facing wrapper around `ddp_core::reducer::Reducer`.

use crate::checkpoint::MODEL_BLOB;
use crate::params::{BurnParams, ModuleParams};
use crate::{Error, Result};
use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use burn::tensor::Tensor;
use ddp_comm::ProcessGroup;
use ddp_core::adapter::{self, DdpCore, DdpWrapper, ParamAccess};
use ddp_core::checkpoint::{Checkpoint, CheckpointMeta};
use ddp_core::hooks::PeriodicModelAverager;
use ddp_core::join::{Join, JoinStep};
use ddp_core::reducer::{HostBuffer, Reducer, ReducerOptions, StepStats};
use ddp_core::verify::ReplicaReport;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};

/// The learning-rate argument of Burn's `ModuleOptimizer::step`.
pub use burn::lr_scheduler::module_lr_scheduler::ModuleLearningRate;

/// Construction options (PyTorch's names and defaults), as in `ddp-candle`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpOptions {
    /// Bucket cap in MiB (default 25).
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket in MiB (default 1).
    pub first_bucket_cap_mb: f64,
    /// Copy rank 0's parameter values to every rank at construction (default true).
    pub init_sync: bool,
    /// Fail a step whose averaged gradients are NaN or infinite with `ddp_core::Error::NonFinite`,
    /// naming the step, the rank and the parameter (default false). Same on every rank.
    pub check_finite: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        let r = ReducerOptions::default();
        DdpOptions {
            bucket_cap_mb: r.bucket_cap_mb,
            first_bucket_cap_mb: r.first_bucket_cap_mb,
            init_sync: true,
            check_finite: false,
        }
    }
}

/// Data-parallel training of a Burn module: gradients averaged over every rank of a process
/// group, replicas kept identical. Owns the module (Burn's optimizers take and return it by
/// value); see the crate documentation.
///
/// The framework-agnostic half (process group, reducer, `register_comm_hook`, statistics,
/// parameter names, ...) is `ddp-core`'s [`DdpCore`], reached through `Deref`: `ddp.rank()`,
/// `ddp.reducer_mut()` and the like are its methods.
pub struct DistributedDataParallel<M: Module> {
    pub(crate) core: DdpCore<BurnParams>,
    /// Always `Some` between calls (taken only while an optimizer maps it, or a blockwise
    /// backward runs).
    pub(crate) module: Option<M>,
}

/// Guard returned by [`DistributedDataParallel::no_sync`]; restores synchronization on drop.
pub type NoSync<'a, M> = adapter::NoSync<'a, DistributedDataParallel<M>>;

impl<M: Module> DdpWrapper for DistributedDataParallel<M> {
    type Params = BurnParams;
}

impl<M: Module> Deref for DistributedDataParallel<M> {
    type Target = DdpCore<BurnParams>;
    fn deref(&self) -> &DdpCore<BurnParams> {
        &self.core
    }
}

impl<M: Module> DerefMut for DistributedDataParallel<M> {
    fn deref_mut(&mut self) -> &mut DdpCore<BurnParams> {
        &mut self.core
    }
}

impl<M: Module> DistributedDataParallel<M> {
    /// Wraps `module`. Walks its trainable parameters in structural order, checks across ranks
    /// that names, shapes and dtypes agree (a mismatch is an error on every rank naming the first
    /// differing parameter) and, with `init_sync`, copies rank 0's values to every rank. A
    /// collective: every rank must call it.
    pub fn new(module: M, pg: &ProcessGroup, opts: DdpOptions) -> Result<Self> {
        let params = BurnParams::new(&module)?;
        let specs = adapter::param_specs(&params)?;
        let mut reducer = Reducer::new(
            pg,
            specs,
            ReducerOptions {
                bucket_cap_mb: opts.bucket_cap_mb,
                first_bucket_cap_mb: opts.first_bucket_cap_mb,
            },
        )?;
        reducer.set_check_finite(opts.check_finite);
        let mut ddp = DistributedDataParallel {
            core: DdpCore::new(pg, params, reducer),
            module: Some(module),
        };
        if opts.init_sync {
            ddp.broadcast_parameters(0)?;
        }
        Ok(ddp)
    }

    /// Copies the parameter values of rank `root` to every rank (a collective), one parameter
    /// at a time: a copy of one parameter is alive beside the module, not of the model (a whole-model copy
    /// at start-up would set the peak memory of a ZeRO run).
    pub fn broadcast_parameters(&mut self, root: usize) -> Result<()> {
        for i in 0..self.param_count() {
            let mut values = self.params().read_one(self.module(), i)?;
            match &mut values {
                HostBuffer::F32(v) => self.process_group().broadcast(v, root)?,
                HostBuffer::F64(v) => self.process_group().broadcast(v, root)?,
                other => {
                    return Err(Error::Unsupported(format!(
                        "a {} parameter buffer (f32 and f64 only)",
                        other.dtype()
                    )))
                }
            }
            self.params().set_pending(i, values)?;
            self.apply_pending()?;
        }
        Ok(())
    }

    /// Post-local SGD's model averaging (PyTorch's
    /// `PeriodicModelAverager.average_parameters(model.parameters())`), after every optimizer
    /// step: on the averager's averaging steps the parameters are averaged over all ranks (a
    /// collective) and written back into the module. Returns whether it averaged.
    pub fn average_parameters(&mut self, averager: &mut PeriodicModelAverager) -> Result<bool> {
        if !averager.is_due() {
            // Counts the step; reads no parameter.
            return averager.average_parameters(self.process_group(), self.params());
        }
        self.params().capture(self.module())?;
        averager.average_parameters(self.process_group(), self.params())?;
        self.update(|m| Ok(m), |params, m| params.apply(m))?;
        Ok(true)
    }

    /// Averages the parameters over all ranks now (e.g. at the end of a local SGD run, so that
    /// every replica holds the same model). A collective.
    pub fn average_parameters_now(&mut self, averager: &mut PeriodicModelAverager) -> Result<()> {
        self.params().capture(self.module())?;
        averager.average_now(self.process_group(), self.params())?;
        self.update(|m| Ok(m), |params, m| params.apply(m))
    }

    /// Runs `f` with the process group and the module's parameters as a
    /// [`ParamAccess`] ([`ModuleParams`]: a read copies one parameter out of the module when
    /// asked, a write is held), then writes the values `f` wrote into the module, keeping their
    /// ids, devices and `require_grad` (the optimizer's state still finds them). For code
    /// written against `ParamAccess` that reads and sets parameters, e.g. DiLoCo's outer step
    /// after each optimizer step: `ddp.with_params(|pg, p| outer.step(pg, p))` with a
    /// `ddp_core::hooks::DiLoCo` built by `ddp.with_params(|_, p| DiLoCo::new(cfg, p))`. When
    /// `f` fails, nothing it wrote is applied.
    pub fn with_params<R>(
        &mut self,
        f: impl FnOnce(&ProcessGroup, &ModuleParams<'_, M>) -> Result<R>,
    ) -> Result<R> {
        // Nothing left over from another use of the pending area is applied with `f`'s writes.
        self.params().take_pending();
        let out = f(
            self.process_group(),
            &ModuleParams {
                params: self.params(),
                module: self.module(),
            },
        );
        match out {
            Ok(r) if self.params().has_pending() => self.apply_pending().map(|()| r),
            Ok(r) => Ok(r),
            Err(e) => {
                self.params().take_pending();
                Err(e)
            }
        }
    }

    /// The wrapped module (for the forward pass).
    pub fn module(&self) -> &M {
        self.module
            .as_ref()
            .expect("the module is present between calls")
    }

    /// Unwraps the module.
    pub fn into_module(mut self) -> M {
        self.module
            .take()
            .expect("the module is present between calls")
    }

    /// Replaces the module by `f(module)`, e.g. after loading a record. The new module must have
    /// the same parameters (paths, shapes, dtypes); their ids are re-read from it.
    pub fn map_module(&mut self, f: impl FnOnce(M) -> M) -> Result<()> {
        self.update(|m| Ok(f(m)), |_, m| Ok(m))
    }

    fn update(
        &mut self,
        f: impl FnOnce(M) -> Result<M>,
        then: impl FnOnce(&BurnParams, M) -> Result<M>,
    ) -> Result<()> {
        let m = self
            .module
            .take()
            .expect("the module is present between calls");
        let m = then(self.params(), f(m)?)?;
        self.params_mut().refresh_ids(&m)?;
        self.module = Some(m);
        Ok(())
    }

    /// One optimizer step on the wrapped module with (averaged) `grads`:
    /// `module = optim.step(lr, module, grads)`.
    pub fn step(
        &mut self,
        optim: &mut ModuleOptimizer,
        lr: impl Into<ModuleLearningRate>,
        grads: GradientsParams,
    ) {
        let m = self
            .module
            .take()
            .expect("the module is present between calls");
        self.module = Some(optim.step(lr, m, grads));
    }

    /// PyTorch's `clip_grad_norm_` over the whole model: scales every gradient in `grads` by
    /// `max_norm / (norm + 1e-6)` when that is below 1, `norm` being the global L2 norm of all of
    /// them (returned). The averaged gradients are the same on every rank, so is the norm (no
    /// communication). Burn's own `grad_clipping` clips each parameter's gradient on its own.
    pub fn clip_grad_norm(&self, grads: &mut GradientsParams, max_norm: f64) -> Result<f64> {
        self.params().clip_grad_norm(grads, max_norm)
    }

    /// One training step on `loss`: [`backward`](Self::backward) (gradients averaged over the
    /// ranks), then [`step`](Self::step) with `optim` at `lr` — candle's
    /// `opt.backward_step(&loss)`, PyTorch's `loss.backward(); opt.step()`.
    pub fn backward_step<const D: usize>(
        &mut self,
        optim: &mut ModuleOptimizer,
        lr: impl Into<ModuleLearningRate>,
        loss: Tensor<D>,
    ) -> Result<()> {
        let grads = self.backward(loss)?;
        self.step(optim, lr, grads);
        Ok(())
    }

    /// PyTorch's `with ddp.no_sync():` — while the guard lives, backwards accumulate gradients
    /// locally without communicating and return this micro-batch's *local* gradients (do not
    /// step the optimizer on them). The first backward after the guard is dropped reduces the sum
    /// of everything accumulated.
    pub fn no_sync(&mut self) -> NoSync<'_, M> {
        NoSync::new(self)
    }

    /// `loss.backward()`, then the bucketed, pipelined all-reduce (buckets in reverse parameter
    /// order). Returns the gradients averaged over all ranks for every trainable parameter (zeros
    /// for one that got no gradient on any rank), ready for Burn's optimizers.
    pub fn backward<const D: usize>(&mut self, loss: Tensor<D>) -> Result<GradientsParams> {
        let local = self.local_backward(loss)?;
        self.finish_grads(local)
    }

    /// Averages gradients that Burn already computed (e.g. a `TrainStep`'s
    /// `TrainOutput::grads`) over all ranks, through the same bucketed reducer as
    /// [`backward`](Self::backward). Under [`no_sync`](Self::no_sync) it accumulates and returns
    /// `grads` unchanged.
    pub fn sync_gradients(&mut self, grads: GradientsParams) -> Result<GradientsParams> {
        let grads = self.mark(|_| grads)?;
        self.finish_grads(grads)
    }

    fn local_backward<const D: usize>(&mut self, loss: Tensor<D>) -> Result<GradientsParams> {
        self.mark(|module| GradientsParams::from_grads(loss.backward(), module))
    }

    /// Starts a reducer step, gets this rank's gradients from `grads(module)` and hands every
    /// one of them to the reducer (last parameter first); returns them.
    fn mark(&mut self, grads: impl FnOnce(&M) -> GradientsParams) -> Result<GradientsParams> {
        self.prepare_for_backward()?;
        let module = self
            .module
            .as_ref()
            .expect("the module is present between calls");
        self.core.params_mut().refresh_ids(module)?;
        let mut grads = grads(module);
        self.hand_over(&mut grads)?;
        Ok(grads)
    }

    /// Hands every gradient in `grads` to the reducer (last parameter first); for a
    /// synchronized step they are taken out of `grads` (owned: no copy), else left there.
    pub(crate) fn hand_over(&mut self, grads: &mut GradientsParams) -> Result<()> {
        // A synchronized step returns the averaged gradients, not these: hand them over owned.
        let take = self.reducer().require_backward_grad_sync();
        if take {
            self.params().take_grads(grads)?;
        }
        let marked = self.mark_grads(grads, |_, _| Ok(()));
        self.params().clear_taken();
        marked
    }

    /// One step under [`Join`] (uneven inputs, PyTorch's `model.join()`): `loss` is this rank's
    /// loss when it has a batch in `step`, `None` once it has run out (it then shadows the
    /// others' all-reduces with zeros). Returns, on every rank, the gradients averaged over the
    /// ranks that had data; step the optimizer with them on every rank.
    pub fn backward_join<const D: usize>(
        &mut self,
        loss: Option<Tensor<D>>,
        join: &Join,
        step: &JoinStep,
    ) -> Result<GradientsParams> {
        let (stats, local) =
            self.join_step("backward_join", "loss", loss, join, step, |d, l| {
                d.local_backward(l)
            })?;
        self.reduced_grads(stats, local.unwrap_or_default())
    }

    /// [`backward_join`](Self::backward_join) for gradients Burn already computed (a
    /// `TrainStep`'s `TrainOutput::grads`): `grads` is `Some` when this rank had a batch in
    /// `step`, `None` once it has run out (it shadows the others' all-reduces with zeros).
    /// Returns the gradients averaged over the ranks that had data, on every rank.
    pub fn sync_gradients_join(
        &mut self,
        grads: Option<GradientsParams>,
        join: &Join,
        step: &JoinStep,
    ) -> Result<GradientsParams> {
        let what = "sync_gradients_join";
        let (stats, local) =
            self.join_step(what, "gradients", grads, join, step, |d, g| d.mark(|_| g))?;
        self.reduced_grads(stats, local.unwrap_or_default())
    }

    /// ZeRO's backward: this rank's gradients handed to the reducer and reduced; the reduced
    /// buckets stay in the reducer (for `sharding::take_shard_grads`).
    pub(crate) fn reduce_backward<const D: usize>(&mut self, loss: Tensor<D>) -> Result<StepStats> {
        self.local_backward(loss)?;
        self.finish()
    }

    /// [`reduce_backward`](Self::reduce_backward) under [`Join`].
    pub(crate) fn reduce_backward_join<const D: usize>(
        &mut self,
        loss: Option<Tensor<D>>,
        join: &Join,
        step: &JoinStep,
    ) -> Result<StepStats> {
        let (stats, _) = self.join_step("backward_join", "loss", loss, join, step, |d, l| {
            d.local_backward(l)
        })?;
        Ok(stats)
    }

    /// Holds new values of parameter `index` for [`apply_pending`](Self::apply_pending).
    pub(crate) fn set_pending_param(&self, index: usize, values: &[f32]) -> Result<()> {
        self.params()
            .write_param(index, ddp_core::reducer::HostSlice::of(values))
    }

    /// Makes the parameters windows of `buffers` (see `BurnParams::apply_windows`).
    pub(crate) fn apply_windows(&mut self, buffers: crate::params::Windows) -> Result<()> {
        self.update(|m| Ok(m), |params, m| params.apply_windows(m, buffers))
    }

    /// Writes the pending parameter values into the module.
    pub(crate) fn apply_pending(&mut self) -> Result<()> {
        self.update(|m| Ok(m), |params, m| params.apply(m))
    }

    fn finish_grads(&mut self, local: GradientsParams) -> Result<GradientsParams> {
        let stats = self.finish()?;
        self.reduced_grads(stats, local)
    }

    pub(crate) fn reduced_grads(
        &mut self,
        stats: StepStats,
        local: GradientsParams,
    ) -> Result<GradientsParams> {
        if !stats.synced {
            return Ok(local);
        }
        let n = self.param_count();
        if (0..n).any(|i| self.reducer().is_device_bucket(i)) {
            return adapter::averaged_grads(self.params(), self.reducer());
        }
        // Host buckets: the gradients are windows of the buckets' buffers, which the reducer
        // hands over (PyTorch's `gradient_as_bucket_view`), not copies.
        let taken = self.reducer_mut().take_averaged_buffers()?;
        self.params()
            .grads_from_buckets(taken.into_iter().flatten())
    }

    /// Every parameter's values as `f64` (exact for F32 and F64), in order.
    pub fn param_values_f64(&self) -> Result<Vec<Vec<f64>>> {
        self.params().capture(self.module())?;
        self.params()
            .take_pending()
            .into_iter()
            .map(|v| match v {
                Some(HostBuffer::F32(v)) => Ok(v.iter().map(|&x| x as f64).collect()),
                Some(HostBuffer::F64(v)) => Ok(v),
                other => Err(Error::Unsupported(format!(
                    "unexpected parameter buffer {:?}",
                    other.map(|b| b.dtype())
                ))),
            })
            .collect()
    }

    /// Checks across ranks that every replica holds bit-identical parameters (a collective).
    pub fn verify_replicas(&self) -> Result<ReplicaReport> {
        self.params().capture(self.module())?;
        let pending = self.params().take_pending();
        // In the parameters' own dtype (no f64 copy of an f32 model) when they share one.
        let f32s: Option<Vec<&[f32]>> = pending
            .iter()
            .map(|b| match b {
                Some(HostBuffer::F32(v)) => Some(v.as_slice()),
                _ => None,
            })
            .collect();
        if let Some(slices) = f32s {
            return Ok(ddp_core::verify::verify_replicas(
                self.process_group(),
                &slices,
            )?);
        }
        drop(pending);
        let values = self.param_values_f64()?;
        let slices: Vec<&[f64]> = values.iter().map(Vec::as_slice).collect();
        Ok(ddp_core::verify::verify_replicas(
            self.process_group(),
            &slices,
        )?)
    }

    /// Largest absolute difference of any parameter element between any two ranks (a
    /// collective; `0.0` means bit-identical replicas).
    pub fn replica_max_diff(&self) -> Result<f64> {
        Ok(self.verify_replicas()?.max_abs_diff)
    }

    /// `(sum, l2 norm)` of all parameters, in `f64`.
    pub fn param_sum_l2(&self) -> Result<(f64, f64)> {
        let flat: Vec<f64> = self.param_values_f64()?.concat();
        let sq: f64 = flat.iter().map(|x| x * x).sum();
        Ok((flat.iter().sum(), sq.sqrt()))
    }
}

/// One-call checkpoints: what a training program calls on every rank to save its run.
impl<M: Module> DistributedDataParallel<M> {
    /// Saves the module and `optim`'s state in one call, on every rank (a collective): rank 0
    /// writes `<dir>/checkpoint.safetensors` atomically (`ddp_core::checkpoint::save_atomic`), the
    /// other ranks write nothing. Returns the file on rank 0, `None` elsewhere; a failure to write
    /// on rank 0 is an error on every rank.
    ///
    /// Burn's records (module and optimizer, burnpack) are stored as blobs, as
    /// [`crate::checkpoint::save_records`] does, with every rank's comm hook state. The metadata:
    /// the reducer's count of synchronized steps ([`Reducer::step`]), the process group's world
    /// size, and the start of epoch `epoch` as position (pass the epochs completed). It resumes
    /// through `ddp_core::checkpoint::resume_or_start` (a `RunPlan` of the same world size and
    /// `hyper: Null`) and [`load_records`](Self::load_records); other positions:
    /// [`save_checkpoint_with`](Self::save_checkpoint_with).
    pub fn save_checkpoint(
        &self,
        dir: &Path,
        optim: &ModuleOptimizer,
        epoch: u64,
    ) -> Result<Option<PathBuf>> {
        self.save_checkpoint_with(dir, Some(optim), self.epoch_meta(epoch))
    }

    /// [`save_checkpoint`](Self::save_checkpoint) of the module alone (blob
    /// [`crate::checkpoint::MODEL_BLOB`]); loads with [`load_model`](Self::load_model).
    pub fn save_model(&self, dir: &Path, epoch: u64) -> Result<Option<PathBuf>> {
        self.save_checkpoint_with(dir, None, self.epoch_meta(epoch))
    }

    /// [`save_checkpoint`](Self::save_checkpoint) at the position `meta` gives (e.g.
    /// `plan.meta(&pos)` of a `RunPlan`), with `optim`'s state when given. `meta.world_size` is
    /// set to the process group's size (`CheckpointMeta::default()` says 1); the rest is written
    /// as given. A collective.
    pub fn save_checkpoint_with(
        &self,
        dir: &Path,
        optim: Option<&ModuleOptimizer>,
        meta: CheckpointMeta,
    ) -> Result<Option<PathBuf>> {
        let fill = |ckpt: &mut Checkpoint| -> Result<()> {
            match optim {
                Some(o) => crate::checkpoint::save_records(ckpt, self.module(), o),
                None => {
                    ckpt.insert_blob(MODEL_BLOB, model_bytes(self.module())?);
                    Ok(())
                }
            }
        };
        Ok(self.write_checkpoint(dir, meta, |ckpt| fill(ckpt).map_err(Error::into_ddp))?)
    }

    /// [`save_checkpoint_with`](Self::save_checkpoint_with) written in the background by
    /// `saver` (PyTorch DCP's `async_save`). The snapshot copies nothing: Burn's tensors are
    /// immutable (a step makes new ones, and a tensor still referenced is never updated in
    /// place), so rank 0 keeps a clone of the module and of the optimizer, and `saver`'s
    /// thread serializes their records and writes the file atomically. The same file as the
    /// synchronous save. A collective; rank 0 gets what `saver` did (a failed write is
    /// reported later and leaves the previous checkpoint current).
    pub fn save_checkpoint_async(
        &self,
        saver: &mut ddp_core::checkpoint::AsyncCheckpointer,
        dir: &Path,
        optim: Option<&ModuleOptimizer>,
        meta: CheckpointMeta,
    ) -> Result<Option<ddp_core::checkpoint::Submitted>>
    where
        M: 'static,
    {
        let module = self.module().clone();
        let optim = optim.cloned();
        Ok(self.write_checkpoint_async(saver, dir, meta, move |_| {
            Ok(Some(Box::new(move |ckpt: &mut Checkpoint| {
                let filled = match optim {
                    Some(o) => crate::checkpoint::save_records(ckpt, &module, &o),
                    None => model_bytes(&module).map(|b| ckpt.insert_blob(MODEL_BLOB, b)),
                };
                filled.map_err(Error::into_ddp)
            })))
        })?)
    }

    /// Loads the module record of `ckpt` (blob [`crate::checkpoint::MODEL_BLOB`], e.g. of
    /// [`save_model`](Self::save_model)) into the wrapped module.
    pub fn load_model(&mut self, ckpt: &Checkpoint) -> Result<()> {
        let what = format!("checkpoint blob {MODEL_BLOB:?}");
        let record = ModuleRecord::from_bytes(Bytes::from_bytes_vec(
            ckpt.require_blob(MODEL_BLOB)?.to_vec(),
        ))
        .map_err(|e| Error::Record(format!("{what}: {e}")))?;
        let module = self
            .module()
            .clone()
            .try_load_record(record)
            .map_err(|e| Error::Record(format!("{what}: {e}")))?;
        self.map_module(|_| module)
    }
}

/// `module`'s record as burnpack bytes.
fn model_bytes<M: Module>(module: &M) -> Result<Vec<u8>> {
    let bytes = module
        .clone()
        .into_record()
        .into_bytes()
        .map_err(|e| Error::Record(format!("cannot serialize the module record: {e}")))?;
    Ok(bytes.to_vec())
}

impl Error {
    /// This error as `ddp-core`'s: its own when it carries one, else a checkpoint error with its
    /// message (for `ddp-core`'s collectives that agree on a result over the ranks).
    pub(crate) fn into_ddp(self) -> ddp_core::Error {
        match self {
            Error::Ddp(e) => e,
            other => ddp_core::Error::Checkpoint(other.to_string()),
        }
    }
}
