//! [`DistributedDataParallel`]: the candle-facing wrapper around `ddp_core::reducer::Reducer`.

use crate::blockwise::blockwise_backward;
use crate::params::CandleParams;
use crate::tensors;
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{Module, Tensor, Var};
use candle_nn::VarMap;
use ddp_comm::ProcessGroup;
use ddp_core::adapter::{self, DdpCore, DdpWrapper};
use ddp_core::checkpoint::{CheckpointMeta, OptimizerState};
use ddp_core::join::{Join, JoinStep};
use ddp_core::reducer::{Reducer, ReducerOptions, StepStats};
use ddp_core::verify::ReplicaReport;
use std::ops::{Deref, DerefMut};
use std::path::{Path, PathBuf};

/// Construction options (PyTorch's names and defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DdpOptions {
    /// Bucket cap in MiB (default 25).
    pub bucket_cap_mb: f64,
    /// Cap of the first bucket in MiB (default 1).
    pub first_bucket_cap_mb: f64,
    /// Copy rank 0's parameter values to every rank at construction (default true).
    pub init_sync: bool,
    /// Fail a step whose averaged gradients are NaN or infinite with `ddp_core::Error::NonFinite`,
    /// naming the step, the rank and the parameter (default false; see
    /// `Reducer::set_check_finite`). Must be the same on every rank.
    pub check_finite: bool,
    /// Where the gradient buckets live: `None` (default) puts them in device memory when the
    /// parameters are on a GPU (flatten, all-reduce and unflatten on the device; feature `cuda`)
    /// and in host memory otherwise; `Some(true)` forces device buckets (on the CPU:
    /// `ddp_core::reducer::CpuBucket`, the device path run on host memory), `Some(false)` host buckets
    /// (GPU gradients then go through host copies).
    pub device_buckets: Option<bool>,
    /// The averaged gradients `backward` returns are views of the gradient buckets, not copies
    /// (PyTorch's `gradient_as_bucket_view`; default true): with host buckets and parameters on
    /// the CPU, each bucket's flat buffer becomes one candle tensor and every gradient a view
    /// into it, so a step holds parameters + gradients once (4Ψ bytes less for f32 parameters,
    /// and no copy). The reducer allocates fresh buckets at the next backward; drop the returned
    /// gradients before it to get their memory back. Ignored with device buckets.
    pub gradient_as_bucket_view: bool,
}

impl Default for DdpOptions {
    fn default() -> Self {
        let r = ReducerOptions::default();
        DdpOptions {
            bucket_cap_mb: r.bucket_cap_mb,
            first_bucket_cap_mb: r.first_bucket_cap_mb,
            init_sync: true,
            check_finite: false,
            device_buckets: None,
            gradient_as_bucket_view: true,
        }
    }
}

/// What [`DistributedDataParallel::forward_backward_blockwise`] returns.
#[derive(Debug)]
pub struct BlockwiseOutput {
    /// The local loss (detached).
    pub loss: Tensor,
    /// The last block's output (detached), e.g. logits for accuracy.
    pub output: Tensor,
    /// Gradients for the optimizer (averaged over ranks unless under `no_sync`).
    pub grads: GradStore,
}

/// Data-parallel training of a candle model: gradients averaged over every rank of a process
/// group, replicas kept identical. See the crate documentation.
///
/// The framework-agnostic half (process group, reducer, `register_comm_hook`, statistics,
/// parameter names, ...) is `ddp-core`'s [`DdpCore`], reached through `Deref`: `ddp.rank()`,
/// `ddp.reducer_mut()` and the like are its methods.
pub struct DistributedDataParallel {
    /// The parameters sorted by name: the registration order, the same on every rank.
    core: DdpCore<CandleParams>,
    bucket_views: bool,
}

/// Guard returned by [`DistributedDataParallel::no_sync`]; restores synchronization on drop.
pub type NoSync<'a> = adapter::NoSync<'a, DistributedDataParallel>;

impl DdpWrapper for DistributedDataParallel {
    type Params = CandleParams;
}

impl Deref for DistributedDataParallel {
    type Target = DdpCore<CandleParams>;
    fn deref(&self) -> &DdpCore<CandleParams> {
        &self.core
    }
}

impl DerefMut for DistributedDataParallel {
    fn deref_mut(&mut self) -> &mut DdpCore<CandleParams> {
        &mut self.core
    }
}

impl DistributedDataParallel {
    /// Wraps every variable of `varmap`. A collective: every rank must call it.
    pub fn new(varmap: &VarMap, pg: &ProcessGroup, opts: DdpOptions) -> Result<Self> {
        Self::from_params(CandleParams::from_varmap(varmap)?, pg, opts)
    }

    /// Wraps the given named variables (names must be unique and the same on every rank). Checks
    /// across ranks that names, shapes and dtypes agree — a mismatch is an error on every rank
    /// naming the first differing parameter — and, with `init_sync`, copies rank 0's values to
    /// every rank. A collective: every rank must call it.
    pub fn from_named_vars(
        vars: impl IntoIterator<Item = (String, Var)>,
        pg: &ProcessGroup,
        opts: DdpOptions,
    ) -> Result<Self> {
        Self::from_params(CandleParams::new(vars), pg, opts)
    }

    fn from_params(params: CandleParams, pg: &ProcessGroup, opts: DdpOptions) -> Result<Self> {
        let specs = adapter::param_specs(&params)?;
        let ropts = ReducerOptions {
            bucket_cap_mb: opts.bucket_cap_mb,
            first_bucket_cap_mb: opts.first_bucket_cap_mb,
        };
        let device = params.device()?;
        let mut reducer = match opts.device_buckets.unwrap_or(device.is_cuda()) {
            true => crate::buckets::device_reducer(pg, specs, ropts, &device)?,
            false => Reducer::new(pg, specs, ropts)?,
        };
        reducer.set_check_finite(opts.check_finite);
        let ddp = DistributedDataParallel {
            core: DdpCore::new(pg, params, reducer),
            bucket_views: opts.gradient_as_bucket_view,
        };
        if opts.init_sync {
            ddp.broadcast_parameters(0)?;
        }
        Ok(ddp)
    }

    /// Copies the parameter values of rank `root` to every rank (a collective).
    pub fn broadcast_parameters(&self, root: usize) -> Result<()> {
        adapter::broadcast_params(self.params(), self.process_group(), root)
    }

    /// The wrapped variables, sorted by name.
    pub fn named_vars(&self) -> &[(String, Var)] {
        self.params().vars()
    }

    /// The wrapped variables, sorted by name (e.g. for `candle_nn::SGD::new`).
    pub fn all_vars(&self) -> Vec<Var> {
        self.named_vars().iter().map(|(_, v)| v.clone()).collect()
    }

    /// PyTorch's `with ddp.no_sync():` — while the guard lives, backwards accumulate gradients
    /// locally without communicating and return this micro-batch's *local* gradients (do not
    /// step the optimizer on them). The first backward after the guard is dropped reduces the sum
    /// of everything accumulated (scale each micro-batch's loss so that the sum is the gradient
    /// you want, e.g. divide by the number of micro-batches).
    pub fn no_sync(&mut self) -> NoSync<'_> {
        NoSync::new(self)
    }

    /// Plain path: `loss.backward()`, then the bucketed, pipelined all-reduce. Returns the
    /// gradients averaged over all ranks, for every wrapped variable (zeros for one that got no
    /// gradient on any rank).
    pub fn backward(&mut self, loss: &Tensor) -> Result<GradStore> {
        let local = self.local_backward(loss)?;
        self.finish_grads(local)
    }

    /// `loss.backward()` and every parameter gradient handed to the reducer (last parameter
    /// first); returns the local gradients under `no_sync` (what `backward` returns then), an
    /// empty store otherwise: the local gradients are freed as soon as the reducer holds them,
    /// not kept next to the averaged ones (4Ψ bytes less at the peak for f32 parameters).
    fn local_backward(&mut self, loss: &Tensor) -> Result<GradStore> {
        self.prepare_for_backward()?;
        let mut grads = {
            let vars = self.named_vars();
            let weights: Vec<&Tensor> = vars.iter().map(|(_, v)| v.as_tensor()).collect();
            crate::nn::backward_capturing(loss, &weights)?
        };
        let mut local = GradStore::default();
        let keep = !self.reducer().require_backward_grad_sync();
        let (params, reducer) = self.core.parts_mut();
        let params = &*params;
        adapter::mark_grads(params, reducer, &mut grads, |i, grads| {
            let t = params.vars()[i].1.as_tensor();
            if let (true, Some(g)) = (keep, grads.get(t)) {
                local.insert(t, g.clone());
            }
            Ok(())
        })?;
        Ok(local)
    }

    /// One step under [`Join`] (uneven inputs, PyTorch's `model.join()`): `loss` is this rank's
    /// loss when it has a batch in `step`, `None` once it has run out — then it *shadows* the
    /// others' bucket all-reduces with zero gradients. Returns, on every rank, the gradients
    /// averaged over the ranks that had data ([`JoinStep::divisor`]); step the optimizer with
    /// them on every rank (joined ones included) and the replicas stay identical.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use candle_core::{DType, Device, Module, Tensor};
    /// # use ddp_candle::prelude::*;
    /// # let pg = ddp_comm::init_process_group(Default::default())?;
    /// # let varmap = candle_nn::VarMap::new();
    /// # let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    /// # let model = ddp_candle::nn::linear(4, 3, vb.pp("fc"))?;
    /// # let mut ddp = Ddp::new(&varmap, &pg, Default::default())?;
    /// # let mut opt = Sgd::new_named(ddp.named_vars().to_vec(), ParamsSgd { lr: 0.1, ..Default::default() })?;
    /// # let my_batches: Vec<(Tensor, Tensor)> = Vec::new();
    /// let mut join = ddp_core::Join::new(&pg);
    /// let mut batches = my_batches.into_iter(); // any number, different on every rank
    /// loop {
    ///     let batch = batches.next();
    ///     let Some(step) = join.begin_step(batch.is_some())? else { break }; // all ranks done
    ///     let loss = match batch {
    ///         Some((x, y)) => Some(candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?),
    ///         None => None,
    ///     };
    ///     let grads = ddp.backward_join(loss.as_ref(), &join, &step)?;
    ///     opt.step(&grads)?; // on every rank
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn backward_join(
        &mut self,
        loss: Option<&Tensor>,
        join: &Join,
        step: &JoinStep,
    ) -> Result<GradStore> {
        let (stats, local) =
            self.join_step("backward_join", "loss", loss, join, step, |d, l| {
                d.local_backward(l)
            })?;
        self.reduced_grads(stats, local.unwrap_or_default())
    }

    /// Blockwise path: forward through `blocks` in order, `loss_fn` on the last output, then
    /// backward one block at a time from the last, each block's gradients handed to the reducer
    /// right away so their buckets communicate while earlier blocks compute. Same gradients as
    /// [`backward`](Self::backward). A parameter must belong to a single block.
    pub fn forward_backward_blockwise<L>(
        &mut self,
        blocks: &[&dyn Module],
        input: &Tensor,
        loss_fn: L,
    ) -> Result<BlockwiseOutput>
    where
        L: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    {
        let (loss, output, local) = self.blockwise_local(blocks, input, loss_fn)?;
        let grads = self.finish_grads(local)?;
        Ok(BlockwiseOutput {
            loss,
            output,
            grads,
        })
    }

    /// [`forward_backward_blockwise`](Self::forward_backward_blockwise) without collecting the
    /// averaged gradients (for `ZeroDdp`): the step's statistics, the loss and the output.
    pub(crate) fn reduce_forward_backward_blockwise<L>(
        &mut self,
        blocks: &[&dyn Module],
        input: &Tensor,
        loss_fn: L,
    ) -> Result<(StepStats, Tensor, Tensor)>
    where
        L: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    {
        let (loss, output, _) = self.blockwise_local(blocks, input, loss_fn)?;
        Ok((self.finish()?, loss, output))
    }

    /// The blockwise forward and backward, every block's gradients handed to the reducer (and
    /// released) as soon as that block is done; returns the loss, the output and, under
    /// `no_sync`, the local gradients (an empty store otherwise).
    fn blockwise_local<L>(
        &mut self,
        blocks: &[&dyn Module],
        input: &Tensor,
        loss_fn: L,
    ) -> Result<(Tensor, Tensor, GradStore)>
    where
        L: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    {
        self.prepare_for_backward()?;
        let mut local = GradStore::default();
        let keep = !self.reducer().require_backward_grad_sync();
        let mut marked = vec![false; self.param_count()];
        let (params, reducer) = self.core.parts_mut();
        let params = &*params;
        let weights: Vec<&Tensor> = params.vars().iter().map(|(_, v)| v.as_tensor()).collect();
        let on_block = |block, grads: &mut GradStore| {
            adapter::mark_grads(params, reducer, grads, |i, grads| {
                let (name, var) = &params.vars()[i];
                if marked[i] {
                    return Err(Error::Unsupported(format!(
                        "parameter `{name}` is used by block {block} and a later block; the \
                         blockwise backward needs every parameter in a single block (use \
                         backward() for shared parameters)"
                    )));
                }
                marked[i] = true;
                if let (true, Some(g)) = (keep, grads.get(var.as_tensor())) {
                    local.insert(var.as_tensor(), g.clone());
                }
                Ok(())
            })
        };
        let (loss, output) = blockwise_backward(blocks, input, loss_fn, &weights, on_block)?;
        Ok((loss, output, local))
    }

    /// `loss.backward()` and the reduction through the registered hook, without collecting the
    /// averaged gradients into a `GradStore` (for `ZeroDdp`, which reads its shard from the
    /// reducer).
    pub(crate) fn reduce_backward(&mut self, loss: &Tensor) -> Result<StepStats> {
        self.local_backward(loss)?;
        self.finish()
    }

    /// [`backward_join`](Self::backward_join) without collecting the averaged gradients.
    pub(crate) fn reduce_backward_join(
        &mut self,
        loss: Option<&Tensor>,
        join: &Join,
        step: &JoinStep,
    ) -> Result<StepStats> {
        let (stats, _) = self.join_step("backward_join", "loss", loss, join, step, |d, l| {
            d.local_backward(l)
        })?;
        Ok(stats)
    }

    fn finish_grads(&mut self, local: GradStore) -> Result<GradStore> {
        let stats = self.finish()?;
        self.reduced_grads(stats, local)
    }

    /// After a `finish`: the averaged gradients, or `local` if the backward was not synced.
    fn reduced_grads(&mut self, stats: StepStats, local: GradStore) -> Result<GradStore> {
        if !stats.synced {
            return Ok(local);
        }
        if self.bucket_views {
            if let Some(grads) = self.bucket_views()? {
                return Ok(grads);
            }
        }
        adapter::averaged_grads(self.params(), self.reducer())
    }

    /// The averaged gradients as views of the reducer's buckets, which it hands over (see
    /// [`DdpOptions::gradient_as_bucket_view`]); `None` when a bucket lives on a device or a
    /// parameter is not on the CPU (the copying path then applies).
    fn bucket_views(&mut self) -> Result<Option<GradStore>> {
        let (params, reducer) = self.core.parts_mut();
        let vars = params.vars();
        let host = (0..vars.len()).all(|i| !reducer.is_device_bucket(i));
        if !host || vars.iter().any(|(_, v)| !v.device().is_cpu()) {
            return Ok(None);
        }
        let mut out = GradStore::default();
        for (buffer, layout) in reducer.take_averaged_buffers()?.into_iter().flatten() {
            let n = buffer.len();
            let flat = tensors::tensor_from_buffer(buffer, &n.into(), &candle_core::Device::Cpu)?;
            for p in layout.iter() {
                let var = vars[p.index].1.as_tensor();
                let view = flat.narrow(0, p.offset, p.numel)?.reshape(var.shape())?;
                out.insert(var, view);
            }
        }
        Ok(Some(out))
    }

    /// Checks across ranks that every replica holds bit-identical parameters (a collective; the
    /// same report on every rank). `report.describe(&names)` names the differing parameters.
    pub fn verify_replicas(&self) -> Result<ReplicaReport> {
        let vars: Vec<&Var> = self.named_vars().iter().map(|(_, v)| v).collect();
        tensors::verify_replicas(self.process_group(), &vars)
    }

    /// Largest absolute difference of any parameter element between any two ranks (a collective;
    /// `0.0` means bit-identical replicas). Shorthand for `verify_replicas()?.max_abs_diff`.
    pub fn replica_max_diff(&self) -> Result<f64> {
        Ok(self.verify_replicas()?.max_abs_diff)
    }

    /// PyTorch's `clip_grad_norm_` over the whole model: scales every gradient in `grads` by
    /// `max_norm / (norm + 1e-6)` when that is below 1, `norm` being the global L2 norm of all of
    /// them (returned). The averaged gradients are the same on every rank, so is the norm (no
    /// communication). As `ddp_burn::Ddp::clip_grad_norm`.
    pub fn clip_grad_norm(&self, grads: &mut GradStore, max_norm: f64) -> Result<f64> {
        let mut sq = 0f64;
        for (_, v) in self.named_vars() {
            if let Some(g) = grads.get(v) {
                sq += g
                    .to_dtype(candle_core::DType::F64)?
                    .sqr()?
                    .sum_all()?
                    .to_scalar::<f64>()?;
            }
        }
        let norm = sq.sqrt();
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for (_, v) in self.named_vars() {
                if let Some(g) = grads.remove(v) {
                    grads.insert(v, (g * coef)?);
                }
            }
        }
        Ok(norm)
    }

    /// `(sum, l2 norm)` of all parameters, in `f64`.
    pub fn param_sum_l2(&self) -> Result<(f64, f64)> {
        let vars: Vec<&Var> = self.named_vars().iter().map(|(_, v)| v).collect();
        tensors::param_sum_l2(&vars)
    }
}

/// One-call checkpoints: what a training program calls on every rank to save its run.
impl DistributedDataParallel {
    /// Saves the model and `opt`'s state in one call, on every rank (a collective): rank 0 writes
    /// `<dir>/checkpoint.safetensors` atomically (`ddp_core::checkpoint::save_atomic`: temp file,
    /// fsync, rename), the other ranks write nothing. Returns the file on rank 0, `None`
    /// elsewhere; a failure to write on rank 0 is an error on every rank.
    ///
    /// The metadata says where the run stands: the step is the reducer's count of synchronized
    /// steps ([`Reducer::step`]; one per optimizer step, counting from the `set_step` of a resumed
    /// run), the world size is the process group's, and the position is the start of epoch
    /// `epoch` (sampler epoch `epoch`, nothing consumed) — pass the number of epochs completed
    /// when saving after an epoch or at the end of training. Besides the parameters (under
    /// their names) and `opt`'s state ([`ddp_core::checkpoint::OptimizerState`]), the comm hook's
    /// state is saved, every rank's (PowerSGD's residuals differ between ranks).
    ///
    /// It resumes through `ddp_core::checkpoint::resume_or_start` with a `RunPlan` of the same world
    /// size and no hyper-parameters (`hyper: Null`), then
    /// `ddp_candle::checkpoint::load_vars(&r.checkpoint, ddp.named_vars())` and
    /// `r.checkpoint.load_optimizer(&mut opt)`. A mid-epoch position, hyper-parameters or an
    /// RNG state: [`save_checkpoint_with`](Self::save_checkpoint_with) with `plan.meta(&pos)`.
    ///
    /// ```no_run
    /// # fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// # use candle_core::{DType, Device, Module, Tensor};
    /// # use ddp_candle::prelude::*;
    /// # let pg = ddp_comm::init_process_group(Default::default())?;
    /// # let varmap = candle_nn::VarMap::new();
    /// # let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    /// # let model = ddp_candle::nn::linear(4, 3, vb.pp("fc"))?;
    /// # let mut ddp = Ddp::new(&varmap, &pg, Default::default())?;
    /// # let mut opt = Sgd::new_named(ddp.named_vars().to_vec(), ParamsSgd { lr: 0.1, ..Default::default() })?;
    /// # let (dir, epochs) = (std::path::PathBuf::from("ckpt"), 3);
    /// let saved = ddp.save_checkpoint(&dir, &opt, epochs)?; // every rank
    /// # Ok(())
    /// # }
    /// ```
    pub fn save_checkpoint<O>(&self, dir: &Path, opt: &O, epoch: u64) -> Result<Option<PathBuf>>
    where
        O: OptimizerState + ?Sized,
        Error: From<O::Error>,
    {
        self.save_checkpoint_with(dir, Some(opt), self.epoch_meta(epoch))
    }

    /// [`save_checkpoint`](Self::save_checkpoint) without optimizer state: the parameters (and
    /// the comm hook's state), e.g. a final model for inference. Loads with
    /// `ddp_candle::checkpoint::load_vars`.
    pub fn save_model(&self, dir: &Path, epoch: u64) -> Result<Option<PathBuf>> {
        self.save_checkpoint_with::<crate::optim::Sgd>(dir, None, self.epoch_meta(epoch))
    }

    /// [`save_checkpoint`](Self::save_checkpoint) at the position `meta` gives (e.g.
    /// `plan.meta(&pos)` of a `ddp_core::checkpoint::RunPlan`: a mid-epoch sampler position,
    /// hyper-parameters, RNG state), with `opt`'s state when given. `meta.world_size` is set
    /// to the process group's size whatever it was (`CheckpointMeta::default()` says 1); the
    /// rest is written as given. A collective, like `save_checkpoint`.
    pub fn save_checkpoint_with<O>(
        &self,
        dir: &Path,
        opt: Option<&O>,
        meta: CheckpointMeta,
    ) -> Result<Option<PathBuf>>
    where
        O: OptimizerState + ?Sized,
        Error: From<O::Error>,
    {
        let fill = |ckpt: &mut ddp_core::Checkpoint| -> Result<()> {
            crate::checkpoint::save_vars(ckpt, self.named_vars())?;
            if let Some(opt) = opt {
                ckpt.save_optimizer(opt)?;
            }
            Ok(())
        };
        Ok(self.write_checkpoint(dir, meta, |ckpt| fill(ckpt).map_err(Error::into_ddp))?)
    }

    /// [`save_checkpoint_with`](Self::save_checkpoint_with) written in the background by
    /// `saver` (PyTorch DCP's `async_save`): rank 0 copies the parameters and `opt`'s state into
    /// host buffers (the only stall; training may change them as soon as this returns), and
    /// `saver`'s thread serializes and writes them atomically. The same file as the
    /// synchronous save. A collective; rank 0 gets what `saver` did (see
    /// `ddp_core::checkpoint::AsyncCheckpointer`: a failed write is reported later and leaves
    /// the previous checkpoint current).
    pub fn save_checkpoint_async<O>(
        &self,
        saver: &mut ddp_core::checkpoint::AsyncCheckpointer,
        dir: &Path,
        opt: Option<&O>,
        meta: CheckpointMeta,
    ) -> Result<Option<ddp_core::checkpoint::Submitted>>
    where
        O: OptimizerState + ?Sized,
        Error: From<O::Error>,
    {
        let snapshot = |ckpt: &mut ddp_core::Checkpoint| -> Result<()> {
            crate::checkpoint::save_vars(ckpt, self.named_vars())?;
            if let Some(opt) = opt {
                ckpt.save_optimizer(opt)?;
            }
            Ok(())
        };
        Ok(self.write_checkpoint_async(saver, dir, meta, |ckpt| {
            snapshot(ckpt).map_err(Error::into_ddp)?;
            Ok(None)
        })?)
    }
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
