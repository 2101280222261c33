//! [`ZeroDdp`]: ZeRO stages 1 and 2 for candle models, on `ddp_core::sharding` (stage 3, which
//! shards the parameters too, is [`Fsdp`](crate::Fsdp)).
//!
//! A [`Ddp`](crate::Ddp) whose buckets are reduce-scattered (`ddp_core::sharding::ReduceScatterHook`,
//! in place) instead of all-reduced; each rank keeps the optimizer state of the chunks it owns
//! (one chunk per bucket, named `bucket<b>`), steps them with an ordinary optimizer of
//! [`optim`](crate::optim) (`Sgd`, `AdamW`: element-wise, so stepping a chunk is exactly
//! stepping those elements of the whole model), and all-gathers the updated chunks into every
//! rank's parameters. Stage 0 is plain DDP through the same API.
//!
//! [`ZeroDdp::with_optimizer`] builds that optimizer itself and lets it update the owned
//! elements inside the model's parameters, so a rank holds no copy of the values it owns (the
//! ZeRO formulas: 8Ψ + 8Ψ/N at stage 1, 4Ψ + 12Ψ/N at stage 2 for fp32 AdamW); the gradient
//! chunk it steps with is a view of its bucket. [`ZeroDdp::new`] takes any
//! [`DynOptimizer`] over one 1-D chunk variable per bucket instead
//! (4Ψ/N more). Stage 2 keeps only its gradient shard: with the blockwise backward
//! ([`ZeroDdp::forward_backward_blockwise`]) the full gradients never exist at once.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # use candle_core::{DType, Device, Tensor};
//! # use ddp_candle::{ShardOptimizer, ZeroDdp};
//! # use ddp_core::sharding::ZeroStage;
//! # let pg = ddp_comm::init_process_group(Default::default())?;
//! # let varmap = candle_nn::VarMap::new();
//! # let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! # let (fc1, fc2) = (ddp_candle::nn::linear(4, 8, vb.pp("fc1"))?, ddp_candle::nn::linear(8, 3, vb.pp("fc2"))?);
//! # let blocks: [&dyn candle_core::Module; 2] = [&fc1, &fc2];
//! # let batches: Vec<(Tensor, Tensor)> = Vec::new();
//! # let loss = |o: &Tensor, y: &Tensor| candle_nn::loss::cross_entropy(o, y);
//! # let params = candle_nn::ParamsAdamW::default();
//! # let (dir, meta) = (std::path::Path::new("ckpt"), ddp_core::checkpoint::CheckpointMeta::default());
//! let ddp = ddp_candle::Ddp::new(&varmap, &pg, Default::default())?;
//! let mut zero = ZeroDdp::with_optimizer(ddp, ZeroStage::Two, ShardOptimizer::AdamW(params))?;
//! for (x, y) in batches {
//!     zero.forward_backward_blockwise(&blocks, &x, |o| loss(o, &y))?; // reduce-scatter
//!     zero.clip_grad_norm(1.0)?;               // optional, cross-rank norm
//!     zero.step()?;                            // owner steps, all-gather
//! }
//! zero.save(dir, &meta)?;                      // a shard per rank; resumes on any world size
//! # Ok(())
//! # }
//! ```

use crate::optim::{AdamW, DynOptimizer, ParamsSgd, Sgd};
use crate::shard::Shard;
use crate::{DistributedDataParallel, Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use candle_nn::ParamsAdamW;
use ddp_core::adapter::ParamAccess;
use ddp_core::checkpoint::{Checkpoint, CheckpointMeta};
use ddp_core::join::{Join, JoinStep};
use ddp_core::reducer::{HostSlice, StepStats};
use ddp_core::sharding::{self, ShardLayout, ShardState, ZeroCore, ZeroStage};
use std::path::{Path, PathBuf};

/// Options of [`ZeroDdp::with_options`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroOptions {
    /// Stage 2 only: keep the last `k` buckets whole from one step to the next (reduce-scattered
    /// in place, as at stage 1), so that each carries the parameter all-gather and the next
    /// backward's gradients instead of being allocated, zeroed and filled again: faster, at
    /// the cost of up to `k` buckets (`bucket_cap_mb` each) held between steps, beyond stage
    /// 2's 4Ψ + 12Ψ/N. Default 0 (the formula): even then the last
    /// bucket, reduce-scattered at the end of the backward (after the peak), stays whole until
    /// the step, whose all-gather it carries first (no peak memory). Measured effect: the
    /// benchmarks chapter of the book (`docs/benchmarks.md`).
    pub keep_whole_buckets: usize,
}

/// One of this crate's optimizers for [`ZeroDdp::with_optimizer`], which it builds over its
/// shard and lets update the model's parameters in place.
#[derive(Debug, Clone)]
pub enum ShardOptimizer {
    /// [`Sgd`] (PyTorch's SGD: momentum, weight decay, Nesterov).
    Sgd(ParamsSgd),
    /// [`AdamW`] (candle's arithmetic).
    AdamW(ParamsAdamW),
}

impl ShardOptimizer {
    /// The optimizer over `vars`, boxed (for [`ZeroDdp::new`], [`Fsdp`](crate::Fsdp) or plain
    /// DDP: the same optimizer chosen once).
    pub fn build(self, vars: Vec<(String, Var)>) -> Result<Box<dyn DynOptimizer>> {
        Ok(match self {
            ShardOptimizer::Sgd(p) => Box::new(Sgd::new_named(vars, p)?),
            ShardOptimizer::AdamW(p) => Box::new(AdamW::new_named(vars, p)?),
        })
    }
}

/// The optimizer a [`ZeroDdp`] steps: any [`DynOptimizer`] over the shard's own variables, or
/// one of this crate's, which can write through to the parameters.
enum ZeroOpt {
    Dyn(Box<dyn DynOptimizer>),
    Sgd(Sgd),
    AdamW(AdamW),
}

impl ZeroOpt {
    fn get(&self) -> &(dyn DynOptimizer + 'static) {
        match self {
            ZeroOpt::Dyn(o) => &**o,
            ZeroOpt::Sgd(o) => o,
            ZeroOpt::AdamW(o) => o,
        }
    }

    fn get_mut(&mut self) -> &mut (dyn DynOptimizer + 'static) {
        match self {
            ZeroOpt::Dyn(o) => &mut **o,
            ZeroOpt::Sgd(o) => o,
            ZeroOpt::AdamW(o) => o,
        }
    }
}

/// Sharded data-parallel training (see the module doc).
pub struct ZeroDdp {
    ddp: DistributedDataParallel,
    /// The stage, the layout and (stages 1/2) this rank's averaged gradient chunks after a
    /// synchronized backward.
    core: ZeroCore,
    /// This rank's chunks (no variables at stage 0).
    shard: Shard,
    opt: ZeroOpt,
    /// Stage 0: the averaged gradients.
    full_grads: Option<GradStore>,
    /// Stage 2 with a write-through optimizer: the last buckets kept whole between steps
    /// ([`ZeroOptions::keep_whole_buckets`]); with none kept, the last bucket is whole from its
    /// reduce-scatter to the step alone (see [`ZeroDdp::step`]). `None` otherwise.
    keep_whole: Option<usize>,
}

impl ZeroDdp {
    /// Wraps `ddp` (already constructed, so replicas start identical) at `stage`; `make_opt`
    /// builds the optimizer over this rank's shard variables (stage 1/2) or every parameter
    /// (stage 0). A collective: every rank must call it with the same stage. Stage 3 is refused
    /// (it keeps no full replica): use [`Fsdp`](crate::Fsdp).
    pub fn new(
        ddp: DistributedDataParallel,
        stage: ZeroStage,
        make_opt: impl FnOnce(Vec<(String, Var)>) -> Result<Box<dyn DynOptimizer>>,
    ) -> Result<Self> {
        Self::build(ddp, stage, None, |vars| Ok(ZeroOpt::Dyn(make_opt(vars)?)))
    }

    /// [`new`](Self::new) with one of this crate's optimizers, which then steps the owned
    /// elements **in the model's parameters themselves** (stages 1 and 2): the shard keeps no
    /// copy of the values it owns, only their optimizer state, so per-rank memory is ZeRO's
    /// (8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N for fp32 AdamW) rather than 4Ψ/N more. The results are the same
    /// as through `new`, bit for bit. A collective, as `new`.
    pub fn with_optimizer(
        ddp: DistributedDataParallel,
        stage: ZeroStage,
        opt: ShardOptimizer,
    ) -> Result<Self> {
        Self::with_options(ddp, stage, opt, ZeroOptions::default())
    }

    /// [`with_optimizer`](Self::with_optimizer) with [`ZeroOptions`] (the same on every rank).
    pub fn with_options(
        ddp: DistributedDataParallel,
        stage: ZeroStage,
        opt: ShardOptimizer,
        options: ZeroOptions,
    ) -> Result<Self> {
        let keep = match stage {
            ZeroStage::Two => options.keep_whole_buckets,
            _ => 0,
        };
        let mut z = Self::build(ddp, stage, Some(keep), |vars| {
            Ok(match opt {
                ShardOptimizer::Sgd(p) => ZeroOpt::Sgd(Sgd::new_named(vars, p)?),
                ShardOptimizer::AdamW(p) => ZeroOpt::AdamW(AdamW::new_named(vars, p)?),
            })
        })?;
        if matches!(stage, ZeroStage::One | ZeroStage::Two) {
            let opt = &mut z.opt;
            z.shard
                .write_through(z.ddp.params().vars(), |name, pieces| match opt {
                    ZeroOpt::Sgd(o) => o.write_through(name, pieces),
                    ZeroOpt::AdamW(o) => o.write_through(name, pieces),
                    ZeroOpt::Dyn(_) => unreachable!("built above as Sgd or AdamW"),
                })?;
        }
        Ok(z)
    }

    /// `keep_whole`: a write-through optimizer (this crate's) and how many of the last buckets
    /// stage 2 keeps whole (see [`ZeroOptions`]); `None` for any other optimizer.
    fn build(
        mut ddp: DistributedDataParallel,
        stage: ZeroStage,
        keep_whole: Option<usize>,
        make_opt: impl FnOnce(Vec<(String, Var)>) -> Result<ZeroOpt>,
    ) -> Result<Self> {
        if stage == ZeroStage::Three {
            return Err(Error::Unsupported(
                "ZeroDdp runs ZeRO stages 0-2 over a full replica; stage 3 (parameters sharded) \
                 is ddp_candle::Fsdp, built from the named variables and the model's units"
                    .into(),
            ));
        }
        let whole_from = keep_whole.map(|k| {
            // The last bucket is whole at least until the step (see `step`).
            let n = ddp.reducer().buckets().len();
            n.saturating_sub(k.max(1))
        });
        let pg = ddp.process_group().clone();
        let core = ZeroCore::new(ddp.reducer_mut(), &pg, stage, whole_from)?;
        let layout = core.layout().clone();
        let (shard, opt) = if stage == ZeroStage::Ddp {
            (Shard::empty(layout), make_opt(ddp.named_vars().to_vec())?)
        } else {
            let values = sharding::shard_params(&layout, |p| read_f32(&ddp, p))?;
            let (shard, named) = Shard::new(layout, values)?;
            (shard, make_opt(named)?)
        };
        Ok(ZeroDdp {
            ddp,
            core,
            shard,
            opt,
            full_grads: None,
            keep_whole: keep_whole.filter(|_| stage == ZeroStage::Two),
        })
    }

    pub fn stage(&self) -> ZeroStage {
        self.core.stage()
    }

    /// Weight decay on the parameters `decays(name, dims)` selects only, the others stepped
    /// without (PyTorch's two parameter groups; nanoGPT decays `dims.len() >= 2`), at every
    /// stage: a chunk that spans both kinds decays only the former's elements, so a run equals
    /// plain DDP with `AdamW::new_named_with_decay` and the same filter. Needs this crate's
    /// [`AdamW`] (`ShardOptimizer::AdamW`, or one built by `new`'s closure); the same on every
    /// rank.
    pub fn set_weight_decay_filter(
        &mut self,
        decays: impl Fn(&str, &[usize]) -> bool,
    ) -> Result<()> {
        let params = self.ddp.params().vars().iter();
        let params = params.map(|(n, v)| (n.clone(), v.dims().to_vec()));
        let opt = self.opt.get_mut();
        if self.core.stage() == ZeroStage::Ddp {
            crate::shard::adamw(opt)?.set_decay_filter(decays);
            return Ok(());
        }
        self.shard.set_weight_decay_filter(opt, params, decays)
    }

    /// The wrapped DDP (parameters, reducer, replica checks).
    pub fn ddp(&self) -> &DistributedDataParallel {
        &self.ddp
    }

    /// The wrapped DDP, mutably (stage 0's blockwise backward, comm timing).
    pub fn ddp_mut(&mut self) -> &mut DistributedDataParallel {
        &mut self.ddp
    }

    /// Which elements this rank owns.
    pub fn layout(&self) -> &ShardLayout {
        &self.shard.layout
    }

    /// This rank's shard variables, one per chunk (`None` for an empty one); empty at stage 0.
    pub fn shard_vars(&self) -> &[Option<Var>] {
        &self.shard.vars
    }

    pub fn optimizer(&self) -> &(dyn DynOptimizer + 'static) {
        self.opt.get()
    }

    pub fn optimizer_mut(&mut self) -> &mut (dyn DynOptimizer + 'static) {
        self.opt.get_mut()
    }

    /// Bytes this rank sends per synchronized step (ring model: all-reduce, or reduce-scatter
    /// plus all-gather; the same volume).
    pub fn bytes_per_step(&self) -> u64 {
        self.core.bytes_per_step()
    }

    /// PyTorch's `no_sync` (see [`DistributedDataParallel::no_sync`]): backwards accumulate
    /// locally while `sync` is false; do not step until a synchronized backward.
    pub fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.ddp.set_require_backward_grad_sync(sync);
    }

    /// Backward and gradient reduction: all-reduce at stage 0, reduce-scatter at stages 1 and 2
    /// (this rank keeps its averaged chunk; stage 2 frees the bucket buffers).
    pub fn backward(&mut self, loss: &Tensor) -> Result<StepStats> {
        if self.stage() == ZeroStage::Ddp {
            let grads = self.ddp.backward(loss)?;
            let stats = self.ddp.last_step_stats().unwrap_or_default();
            self.full_grads = stats.synced.then_some(grads);
            return Ok(stats);
        }
        let stats = self.ddp.reduce_backward(loss)?;
        self.after_reduce(stats)
    }

    /// The blockwise path ([`DistributedDataParallel::forward_backward_blockwise`]): forward
    /// through `blocks`, `loss_fn` on the last output, then backward one block at a time, each
    /// block's gradients reduce-scattered (and freed) while earlier blocks compute. At stage 2
    /// this is what keeps the gradients at their shard: a plain `loss.backward()` holds every
    /// full gradient at once before any bucket is reduced. Returns the statistics, the loss and
    /// the output (detached). Stage 0 runs DDP's blockwise path.
    pub fn forward_backward_blockwise<L>(
        &mut self,
        blocks: &[&dyn candle_core::Module],
        input: &Tensor,
        loss_fn: L,
    ) -> Result<(StepStats, Tensor, Tensor)>
    where
        L: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    {
        if self.stage() == ZeroStage::Ddp {
            let out = self
                .ddp
                .forward_backward_blockwise(blocks, input, loss_fn)?;
            let stats = self.ddp.last_step_stats().unwrap_or_default();
            self.full_grads = stats.synced.then_some(out.grads);
            return Ok((stats, out.loss, out.output));
        }
        let (stats, loss, output) = self
            .ddp
            .reduce_forward_backward_blockwise(blocks, input, loss_fn)?;
        Ok((self.after_reduce(stats)?, loss, output))
    }

    /// [`backward`](Self::backward) under [`Join`] (uneven inputs): `loss` is `None` once this
    /// rank has run out of data; gradients are averaged over the ranks that had data.
    pub fn backward_join(
        &mut self,
        loss: Option<&Tensor>,
        join: &Join,
        step: &JoinStep,
    ) -> Result<StepStats> {
        if self.stage() == ZeroStage::Ddp {
            let grads = self.ddp.backward_join(loss, join, step)?;
            let stats = self.ddp.last_step_stats().unwrap_or_default();
            self.full_grads = Some(grads);
            return Ok(stats);
        }
        let stats = self.ddp.reduce_backward_join(loss, join, step)?;
        self.after_reduce(stats)
    }

    fn after_reduce(&mut self, stats: StepStats) -> Result<StepStats> {
        Ok(self.core.after_reduce(self.ddp.reducer_mut(), stats)?)
    }

    /// PyTorch's `clip_grad_norm_`: scales the averaged gradients so that their global L2 norm
    /// is at most `max_norm` (the norm is all-reduced from the shards); returns the norm before
    /// clipping. After a synchronized backward.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        if let Some(norm) = self.core.clip_grad_norm(self.ddp.process_group(), max_norm) {
            return Ok(norm?);
        }
        let Some(grads) = &mut self.full_grads else {
            return Err(self.no_grads("clip_grad_norm"));
        };
        self.ddp.clip_grad_norm(grads, max_norm)
    }

    fn no_grads(&self, what: &str) -> Error {
        sharding::zero::no_grads(what, self.ddp.rank()).into()
    }

    /// The optimizer step on this rank's chunks, then the all-gather of the updated parameters
    /// (stage 0: the plain step).
    pub fn step(&mut self) -> Result<()> {
        if self.stage() == ZeroStage::Ddp {
            let grads = self
                .full_grads
                .take()
                .ok_or_else(|| self.no_grads("step"))?;
            self.opt.get_mut().step(&grads)?;
            return Ok(());
        }
        let grads = self.core.take_grads("step", self.ddp.rank())?;
        let opt = match &mut self.opt {
            ZeroOpt::Dyn(o) => {
                {
                    let _s = ddp_core::trace::span("shard step", "zero");
                    self.shard.step(&mut **o, grads)?;
                }
                let _s = ddp_core::trace::span("gather params", "zero");
                return self.gather_from_shard();
            }
            opt => opt,
        };
        // A write-through optimizer updates the owned elements inside the parameters and
        // leaves their new values in the gradient's place in each buffer; a whole bucket's
        // buffer (all at stage 1; at stage 2 the last bucket's, and those
        // `ZeroOptions::keep_whole_buckets` keeps) then carries the parameter all-gather as it
        // is: a stage-1 step allocates nothing and copies no parameter into a buffer. A chunk
        // alone is copied into a bucket buffer of the gather's. Stage 2's last bucket is
        // reduce-scattered at the very end of the backward, after its live peak, so keeping it
        // whole until here costs no peak memory and saves allocating, zero-filling and filling
        // a buffer for its all-gather; the gather runs it first and lets its buffer carry
        // later buckets (`sharding::Gather::lead`).
        let parts = {
            let _s = ddp_core::trace::span("shard step", "zero");
            self.shard.step_through(grads, |g| match opt {
                ZeroOpt::Sgd(o) => o.step_through(g),
                ZeroOpt::AdamW(o) => o.step_through(g),
                ZeroOpt::Dyn(_) => unreachable!("handled above"),
            })?
        };
        let n = self.shard.layout.buckets().len();
        let mut bufs = Vec::with_capacity(n);
        let mut chunks = Vec::with_capacity(n);
        let mut whole = Vec::with_capacity(n);
        for (i, (v, _)) in parts.into_iter().enumerate() {
            let is_whole = v.len() == self.shard.layout.buckets()[i].numel;
            whole.push(is_whole);
            if is_whole {
                bufs.push(v); // the whole bucket, this rank's block already in place
                chunks.push(None);
            } else {
                // A chunk alone (stage 2): into a bucket buffer of the gather's.
                bufs.push(Vec::new());
                chunks.push(Some(v));
            }
        }
        let _s = ddp_core::trace::span("gather params", "zero");
        // Kept whole between steps: these buckets' buffers go back to their own bucket.
        let kept_from = n - self.keep_whole.unwrap_or(n).min(n);
        let bufs = self.gather(bufs, |i, dst| {
            // Each chunk is freed once in its bucket's buffer: gradient shards and gather
            // buffers do not add up.
            if let Some(c) = chunks[i].take() {
                dst.copy_from_slice(&c);
            }
            Ok(())
        })?;
        // A whole bucket's buffer goes back to its bucket; the gather buffers of the last
        // chunks alone (stage 2: at most `sharding::zero::STAGE2_WINDOW`) to the buckets the next backward fills
        // first, which are reduce-scattered and freed early in it, so that holding them from
        // now on does not add to the peak, which comes late in the backward.
        let mut own = Vec::with_capacity(n);
        let mut spares = Vec::new();
        for (i, (v, whole)) in bufs.into_iter().zip(whole).enumerate() {
            let v = (!v.is_empty()).then_some(ddp_core::reducer::HostBuffer::F32(v));
            if whole && i >= kept_from {
                own.push(v);
            } else {
                own.push(None);
                spares.extend(v);
            }
        }
        let reducer = self.ddp.reducer_mut();
        reducer.recycle_buffers(own)?;
        reducer.give_spare_buffers(spares)?;
        Ok(())
    }

    /// Every rank's parameters from the owners' chunks, all-gathered in place in `bufs` (fresh
    /// ones where empty; `fill(i, dst)` puts this rank's chunk `i` into its block): all buckets
    /// at once at stage 1 (the gradients are gone by then, and its formula holds them),
    /// [`sharding::zero::STAGE2_WINDOW`] at a time at stage 2, so that full-size buckets never add up to the
    /// model. With a write-through optimizer the parameters already hold this rank's chunk:
    /// only the others' elements are written. The buffers given come back (see
    /// [`sharding::gather_params_into`]).
    fn gather(
        &self,
        bufs: Vec<Vec<f32>>,
        fill: impl FnMut(usize, &mut [f32]) -> ddp_core::Result<()>,
    ) -> Result<Vec<Vec<f32>>> {
        let how = sharding::Gather {
            window: self.core.gather_window(),
            skip_owned: !matches!(self.opt, ZeroOpt::Dyn(_)),
            lead: match self.keep_whole {
                // Stage 2's last bucket, whole until the step (see `step`).
                Some(0) => self.shard.layout.buckets().len().checked_sub(1),
                _ => None,
            },
        };
        let params = self.ddp.params();
        // The parameters lent to the all-gather, which reads the owners' chunks straight into
        // them where it can (shared memory: one copy instead of three).
        let mut lend =
            |p: usize,
             offset: usize,
             len: usize,
             f: &mut dyn FnMut(&mut [f32]) -> ddp_core::Result<()>| {
                params
                    .lend_param_range(p, offset, len, f)
                    .map_err(|e| match e {
                        Error::Ddp(e) => e,
                        e => ddp_core::Error::InvalidArgument(e.to_string()),
                    })
            };
        Ok(sharding::gather_params_into(
            self.ddp.process_group(),
            &self.shard.layout,
            bufs,
            how,
            fill,
            |p, offset, v| {
                params
                    .write_param_range(p, offset, HostSlice::of(v))
                    .map_err(|e| ddp_core::Error::InvalidArgument(e.to_string()))
            },
            Some(&mut lend),
        )?)
    }

    /// This rank's shard: parameter values and optimizer state of its chunks.
    pub fn shard_state(&self) -> Result<ShardState> {
        self.shard.state(self.opt.get())
    }

    fn require_sharded(&self, what: &str) -> Result<()> {
        let how = "use ddp_core::checkpoint (save_vars, save_optimizer)";
        Ok(self.core.require_sharded(what, how)?)
    }

    /// Saves a sharded checkpoint set in `dir` (a collective; see `ddp_core::sharding::sets`).
    /// It loads at any world size and stage (1, 2 or 3).
    pub fn save(&self, dir: &Path, meta: &CheckpointMeta) -> Result<PathBuf> {
        self.require_sharded("save")?;
        let specs = self.ddp.reducer().specs();
        self.shard
            .save(self.ddp.process_group(), self.opt.get(), specs, dir, meta)
    }

    /// [`save`](Self::save) in the background (PyTorch DCP's `async_save`): this rank's shard is
    /// copied now (the only stall) and written by `saver`'s thread; the set becomes current when
    /// `saver` commits it, at the next save or at `saver.wait(pg)` (collectives). Returns the
    /// committed set's outcome (`None` when none was in flight); a failed write leaves the
    /// previous set current. See `ddp_core::sharding::AsyncSetSaver`.
    pub fn save_async(
        &self,
        saver: &mut ddp_core::sharding::AsyncSetSaver,
        dir: &Path,
        meta: &CheckpointMeta,
    ) -> Result<Option<ddp_core::Result<PathBuf>>> {
        self.require_sharded("save")?;
        let specs = self.ddp.reducer().specs();
        self.shard.save_async(
            saver,
            self.ddp.process_group(),
            self.opt.get(),
            specs,
            dir,
            meta,
        )
    }

    /// Loads the current sharded set of `dir`, saved at any world size and stage (1, 2 or 3),
    /// re-cut for this one (a collective). `Ok(None)` when there is none. On any error on any
    /// rank nothing is changed on any rank.
    pub fn load(&mut self, dir: &Path) -> Result<Option<CheckpointMeta>> {
        self.require_sharded("load")?;
        let specs = self.ddp.reducer().specs();
        let Some((state, meta)) = self.shard.load(self.ddp.process_group(), specs, dir)? else {
            return Ok(None);
        };
        self.apply(state)?;
        Ok(Some(meta))
    }

    /// Takes this rank's shard of a plain checkpoint (DDP's, or `ddp_core::sharding::consolidate`'s):
    /// parameters and optimizer state (a collective).
    pub fn import(&mut self, ckpt: &Checkpoint) -> Result<()> {
        self.require_sharded("import")?;
        let specs = self.ddp.reducer().specs();
        let state = self.shard.import(self.ddp.process_group(), specs, ckpt)?;
        self.apply(state)
    }

    fn apply(&mut self, state: ShardState) -> Result<()> {
        self.shard.apply(self.opt.get_mut(), state)?;
        self.core.clear_grads();
        self.gather_from_shard()
    }

    /// Every rank's parameters all-gathered from the shard's chunks, in fresh buffers.
    fn gather_from_shard(&self) -> Result<()> {
        let n = self.shard.layout.buckets().len();
        self.gather(vec![Vec::new(); n], |i, dst| self.shard.copy_chunk(i, dst))?;
        Ok(())
    }
}

/// Read access to the wrapped DDP (replica checks, statistics, parameter names); mutable access
/// goes through [`ZeroDdp::ddp_mut`] on purpose.
impl std::ops::Deref for ZeroDdp {
    type Target = DistributedDataParallel;
    fn deref(&self) -> &DistributedDataParallel {
        &self.ddp
    }
}

fn read_f32(ddp: &DistributedDataParallel, p: usize) -> ddp_core::Result<Vec<f32>> {
    let b = ddp
        .params()
        .read_param(p)
        .map_err(|e| ddp_core::Error::InvalidArgument(e.to_string()))?;
    b.as_slice::<f32>()
        .map(<[f32]>::to_vec)
        .ok_or_else(|| ddp_core::Error::InvalidArgument(format!("parameter {p} is not f32")))
}
