//! [`ZeroDdp`]: ZeRO stages 1 and 2 for Burn modules, on `ddp_core::sharding` (the framework-agnostic
//! layout, reduce-scatter hook, parameter all-gather and sharded checkpoints that
//! `ddp_candle::ZeroDdp` runs on too).
//!
//! ```text
//!  loss.backward() ─► Reducer (buckets, last parameter first; each Burn gradient dropped once
//!    in its bucket) ─► ReduceScatterHook: each bucket reduce-scattered in place ─► this rank's
//!    averaged chunk of every bucket (ShardGrads)
//!  ─► step: sharding::gather_params_into, bucket by bucket: this rank's block is filled by
//!    Burn's optimizer (`Optimizer::step`, the per-tensor API that ModuleOptimizer maps over a
//!    module) stepping the chunk as one 1-D tensor (values read from the module, the chunk's
//!    own state), then the bucket is all-gathered while the next chunk steps ─► the module's
//!    parameters, bit-identical on every rank
//! ```
//!
//! Any Burn optimizer whose update is element-wise works unchanged (`SgdConfig`,
//! `AdamConfig`, `AdamWConfig`, ... `.build()`): stepping a chunk is then exactly stepping those
//! elements of the whole model, so a run equals DDP with the same optimizer's `.init()`. Each
//! rank keeps optimizer state for its chunks only (`8Ψ/N` bytes for Adam's two moments), and
//! nothing else between steps: the chunks' values are read from the module when stepped, and
//! the bucket buffers are freed after the all-gather. Gradient clipping by global norm is
//! [`ZeroDdp::clip_grad_norm`] (the norm all-reduced from the shards); Burn's own per-parameter
//! `grad_clipping` of `.init()` is not element-wise and is not applied.
//!
//! Memory per rank, fp32 AdamW: stage 1 holds ZeRO's `8Ψ + 8Ψ/N` (parameters, gradient buckets
//! from the backward to the step, moments). Burn 0.22's backward returns every gradient of a
//! graph at once, so with a plain `loss.backward()` stage 2's peak holds them whole once
//! (`8Ψ + 8Ψ/N`); [`ZeroDdp::forward_backward_blockwise`] runs the backward a block at a time
//! (module [`blockwise`](crate::blockwise)) and keeps them at their shard (`4Ψ + 12Ψ/N`).
//! Measured peaks: the benchmarks chapter of the book (`docs/benchmarks.md`, ZeRO on Burn).
//!
//! Checkpoints are `ddp_core::sharding`'s: each rank writes its chunks (values and every tensor of
//! the optimizer state, by Burn's `RecordState` names), rank 0 the index with the state's scalars
//! (Adam's step count); a set resumes at any world size and stage 1 or 2, and
//! `ddp_core::sharding::consolidate` makes one plain checkpoint of it.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # use burn::module::Module;
//! # use burn::nn::{loss::CrossEntropyLossConfig, Linear, LinearConfig};
//! # use burn::optim::AdamWConfig;
//! # use burn::tensor::{Int, Tensor};
//! # use ddp_core::sharding::ZeroStage;
//! # use ddp_burn::ZeroDdp;
//! # #[derive(Module, Debug)]
//! # struct Model { fc: Linear }
//! # impl Model {
//! #     fn forward_loss(&self, x: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
//! #         CrossEntropyLossConfig::new().init(&x.device()).forward(self.fc.forward(x), y)
//! #     }
//! # }
//! # let pg = ddp_comm::init_process_group(Default::default())?;
//! # let device = burn::tensor::Device::flex().autodiff();
//! # let model = Model { fc: LinearConfig::new(4, 3).init(&device) };
//! # let batches: Vec<(Tensor<2>, Tensor<1, Int>)> = Vec::new();
//! # let (dir, meta) = (std::path::Path::new("ckpt"), ddp_core::checkpoint::CheckpointMeta::default());
//! let ddp = ddp_burn::Ddp::new(model, &pg, Default::default())?;
//! let mut zero = ZeroDdp::new(ddp, ZeroStage::Two, AdamWConfig::new().build())?;
//! for (x, y) in batches {
//!     let loss = zero.module().forward_loss(x, y);
//!     zero.backward(loss)?;            // reduce-scatter
//!     zero.clip_grad_norm(1.0)?;       // optional, cross-rank norm
//!     zero.step(1e-3)?;                // owner steps its chunks, all-gather
//! }
//! zero.save(dir, &meta)?;              // a shard per rank; resumes on any world size
//! # Ok(())
//! # }
//! ```

use crate::{DistributedDataParallel, Error, Result};
use burn::module::Module;
use burn::optim::{
    GradientsParams, ModuleOptimizer, Optimizer, RecordState, StateSink, StateSource,
};
use burn::tensor::{Device, Tensor, TensorData};
use burn_pack::Scalar;
use ddp_core::checkpoint::{Checkpoint, CheckpointMeta, OptimizerRecord};
use ddp_core::join::{Join, JoinStep};
use ddp_core::reducer::StepStats;
use ddp_core::sharding::{self, ChunkState, ShardLayout, ShardState, ZeroCore, ZeroStage};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Key prefix of an optimizer state scalar in `OptimizerRecord::hyper`.
const SCALAR: &str = "state:";

/// Sharded data-parallel training of a Burn module (see the module doc).
pub struct ZeroDdp<M: Module, O: Optimizer> {
    ddp: DistributedDataParallel<M>,
    /// The stage, the layout and (stages 1/2) this rank's averaged gradient chunks after a
    /// synchronized backward.
    core: ZeroCore,
    optim: O,
    /// Stage 0: `optim` over the whole module.
    module_optim: Option<ModuleOptimizer>,
    /// The optimizer states of this rank's chunks, one per chunk of `layout` (`None` before
    /// the first step). The chunks' values are the module's own (read when stepped).
    states: Vec<Option<O::State<1>>>,
    /// The device the chunks live on (the parameters' without autodiff).
    device: Device,
    /// Optimizer steps taken.
    steps: u64,
    /// Stage 0: the averaged gradients.
    full_grads: Option<GradientsParams>,
    /// Weight-decay groups applied before the optimizer steps each chunk
    /// ([`ZeroDdp::with_weight_decay_groups`]).
    decay: Option<DecayGroups>,
}

/// Decoupled weight decay at `rate` where each chunk's runs say (`(start, decays)`, from
/// `ShardLayout::decay_runs`).
struct DecayGroups {
    rate: f32,
    runs: Vec<Vec<(usize, bool)>>,
}

impl DecayGroups {
    /// `chunk` (chunk `i`'s values) decayed as Burn's AdamW decays a parameter at learning rate
    /// `lr` (`θ · (1 − lr · rate)`, the factor rounded to f32 as `mul_scalar` does), only where
    /// the runs say; the other elements are multiplied by 1 (unchanged).
    fn apply(&self, i: usize, chunk: Tensor<1>, lr: f64) -> Tensor<1> {
        let runs = &self.runs[i];
        let decay_rate = lr * self.rate as f64;
        if decay_rate == 0.0 || runs.iter().all(|r| !r.1) {
            return chunk;
        }
        let n = chunk.dims()[0];
        let mut factor = vec![1f32; n];
        for (j, &(at, d)) in runs.iter().enumerate() {
            let end = runs.get(j + 1).map_or(n, |r| r.0);
            if d {
                factor[at..end].fill((1.0 - decay_rate) as f32);
            }
        }
        let device = chunk.device();
        chunk * Tensor::<1>::from_data(TensorData::new(factor, [n]), &device)
    }
}

impl<M: Module, O: Optimizer> ZeroDdp<M, O> {
    /// Wraps `ddp` (already constructed, so replicas start identical) at `stage`, stepping with
    /// `optim` (Burn's bare optimizer: `AdamWConfig::new().build()`). Stage 0 is plain DDP through
    /// the same API (`optim` then steps the whole module as `ModuleOptimizer`). A collective:
    /// every rank must call it with the same stage. Stage 3 is not offered for Burn yet.
    pub fn new(mut ddp: DistributedDataParallel<M>, stage: ZeroStage, optim: O) -> Result<Self> {
        if stage == ZeroStage::Three {
            return Err(Error::Unsupported(
                "ZeRO stage 3 (parameters sharded) is not available for Burn modules: use stage \
                 1 or 2, or ddp_candle::Fsdp"
                    .into(),
            ));
        }
        let specs = ddp.reducer().specs();
        if let Some(s) = specs.iter().find(|s| s.dtype != ddp_comm::DType::F32) {
            return Err(Error::Unsupported(format!(
                "ZeRO shards f32 parameters; `{}` is {:?}",
                s.name, s.dtype
            )));
        }
        let device = if specs.is_empty() {
            Device::default()
        } else {
            ddp.params().grad_device(0).clone()
        };
        let pg = ddp.process_group().clone();
        let core = ZeroCore::new(ddp.reducer_mut(), &pg, stage, None)?;
        let (states, module_optim) = match stage {
            ZeroStage::Ddp => (Vec::new(), Some(ModuleOptimizer::from(optim.clone()))),
            _ => (vec![None; core.layout().chunks().len()], None),
        };
        Ok(ZeroDdp {
            ddp,
            core,
            optim,
            module_optim,
            states,
            device,
            steps: 0,
            full_grads: None,
            decay: None,
        })
    }

    /// Decoupled weight decay (AdamW's) at `rate` on the parameters `decays(name, dims)`
    /// selects only: PyTorch's two parameter groups under ZeRO (nanoGPT decays
    /// `dims.len() >= 2`), which one optimizer stepping a chunk cannot express when the chunk
    /// spans both kinds. Build the optimizer **without** weight decay: before it steps a
    /// chunk, the selected elements are scaled by `1 − lr · rate` here, which is exactly what
    /// Burn's AdamW does first, so a run equals plain DDP with a `ModuleOptimizer` whose
    /// decayed group is the same optimizer `.with_weight_decay(rate)`. Stages 1 and 2 (stage
    /// 0 steps through `ModuleOptimizer`: give it the groups). The same on every rank.
    pub fn with_weight_decay_groups(
        mut self,
        rate: f32,
        decays: impl Fn(&str, &[usize]) -> bool,
    ) -> Result<Self> {
        if self.stage() == ZeroStage::Ddp {
            return Err(Error::Unsupported(
                "weight-decay groups at ZeRO stage 0: plain DDP steps with Burn's \
                 ModuleOptimizer, give it the groups (`.with_group(..)`)"
                    .into(),
            ));
        }
        let specs = self.ddp.reducer().specs();
        let flags: Vec<bool> = specs.iter().map(|s| decays(&s.name, &s.shape)).collect();
        let layout = self.core.layout();
        let runs = layout
            .chunks()
            .iter()
            .map(|c| layout.decay_runs(c, &flags))
            .collect();
        self.decay = Some(DecayGroups { rate, runs });
        Ok(self)
    }

    pub fn stage(&self) -> ZeroStage {
        self.core.stage()
    }

    /// The wrapped module (for the forward pass).
    pub fn module(&self) -> &M {
        self.ddp.module()
    }

    /// The wrapped DDP (parameters, reducer, replica checks).
    pub fn ddp(&self) -> &DistributedDataParallel<M> {
        &self.ddp
    }

    /// Unwraps the module (every rank's is the whole model).
    pub fn into_module(self) -> M {
        self.ddp.into_module()
    }

    /// Which elements this rank owns.
    pub fn layout(&self) -> &ShardLayout {
        self.core.layout()
    }

    /// Optimizer steps taken (set by [`load`](Self::load)).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The run's step count, for the reducer's messages (e.g. after resuming).
    pub fn set_step(&mut self, step: u64) {
        self.ddp.reducer_mut().set_step(step);
    }

    /// Bytes this rank sends per synchronized step (ring model; DDP's volume).
    pub fn bytes_per_step(&self) -> u64 {
        self.core.bytes_per_step()
    }

    /// PyTorch's `no_sync`: backwards accumulate locally while `sync` is false; do not step
    /// until a synchronized backward.
    pub fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.ddp.reducer_mut().set_require_backward_grad_sync(sync);
    }

    /// Backward and gradient reduction: all-reduce at stage 0, reduce-scatter at stages 1 and 2
    /// (this rank keeps its averaged chunks; stage 2 frees the rest of each bucket).
    pub fn backward<const D: usize>(&mut self, loss: Tensor<D>) -> Result<StepStats> {
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
    /// through `blocks`, `loss_fn` on the last output, then the backward one block at a time,
    /// each block's buckets reduce-scattered while earlier blocks compute. At stage 2 this is what
    /// keeps the gradients at their shard: a plain `loss.backward()` holds every gradient at
    /// once. Returns the statistics and the loss (detached).
    pub fn forward_backward_blockwise<const D: usize, const L: usize>(
        &mut self,
        blocks: &[crate::Block<'_, M, D>],
        input: Tensor<D>,
        loss_fn: impl FnOnce(Tensor<D>) -> Tensor<L>,
    ) -> Result<(StepStats, Tensor<L>)> {
        if self.stage() == ZeroStage::Ddp {
            let (grads, loss) = self
                .ddp
                .forward_backward_blockwise(blocks, input, loss_fn)?;
            let stats = self.ddp.last_step_stats().unwrap_or_default();
            self.full_grads = stats.synced.then_some(grads);
            return Ok((stats, loss));
        }
        let (stats, loss) = self.ddp.reduce_blockwise(blocks, input, loss_fn)?;
        Ok((self.after_reduce(stats)?, loss))
    }

    /// [`backward`](Self::backward) under [`Join`] (uneven inputs): `loss` is `None` once this
    /// rank has run out of data; gradients are averaged over the ranks that had data.
    pub fn backward_join<const D: usize>(
        &mut self,
        loss: Option<Tensor<D>>,
        join: &Join,
        step: &JoinStep,
    ) -> Result<StepStats> {
        if self.stage() == ZeroStage::Ddp {
            self.full_grads = Some(self.ddp.backward_join(loss, join, step)?);
            return Ok(self.ddp.last_step_stats().unwrap_or_default());
        }
        let stats = self.ddp.reduce_backward_join(loss, join, step)?;
        self.after_reduce(stats)
    }

    fn after_reduce(&mut self, stats: StepStats) -> Result<StepStats> {
        Ok(self.core.after_reduce(self.ddp.reducer_mut(), stats)?)
    }

    fn no_grads(&self, what: &str) -> Error {
        sharding::zero::no_grads(what, self.ddp.rank()).into()
    }

    /// PyTorch's `clip_grad_norm_`: scales the averaged gradients so that their global L2 norm
    /// is at most `max_norm` (from the shards, all-reduced); returns the norm before clipping.
    /// After a synchronized backward.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        if let Some(norm) = self.core.clip_grad_norm(self.ddp.process_group(), max_norm) {
            return Ok(norm?);
        }
        let Some(grads) = self.full_grads.as_mut() else {
            return Err(self.no_grads("clip_grad_norm"));
        };
        self.ddp.params().clip_grad_norm(grads, max_norm)
    }

    /// The optimizer step on this rank's chunks, then the all-gather of the updated parameters
    /// into the module (stage 0: the plain step). `lr` as Burn's `LearningRate`.
    pub fn step(&mut self, lr: f64) -> Result<()> {
        if self.stage() == ZeroStage::Ddp {
            let grads = self
                .full_grads
                .take()
                .ok_or_else(|| self.no_grads("step"))?;
            let optim = self.module_optim.as_mut().expect("stage 0 has one");
            self.ddp.step(optim, lr, grads);
            self.steps += 1;
            return Ok(());
        }
        let grads = self.core.take_grads("step", self.ddp.rank())?;
        // Stage 1: a whole bucket's buffer, its averaged chunk inside, carries the bucket's
        // all-gather (the chunk is stepped in place of its gradient). Stage 2: the chunk alone
        // becomes its gradient tensor, and the gather allocates its window's buffers.
        let mut bufs = Vec::with_capacity(self.layout().buckets().len());
        let mut shards = Vec::with_capacity(bufs.capacity());
        for ((v, _), b) in grads
            .into_parts()
            .into_iter()
            .zip(self.core.layout().buckets())
        {
            if v.len() == b.numel && b.numel > 0 {
                bufs.push(v);
                shards.push(None);
            } else {
                bufs.push(Vec::new());
                shards.push(Some(v));
            }
        }
        self.gather(bufs, Fill::Step { lr, shards })?;
        self.steps += 1;
        Ok(())
    }

    /// This rank's chunk `i` of the module's parameters, as one tensor: a view when it lies in
    /// one parameter, else the views joined (one copy).
    fn read_chunk(
        ddp: &DistributedDataParallel<M>,
        layout: &ShardLayout,
        i: usize,
    ) -> Result<Tensor<1>> {
        let mut pieces = layout.pieces(&layout.chunks()[i]);
        pieces.sort_by_key(|p| p.chunk_offset);
        let want: Vec<_> = pieces
            .iter()
            .map(|p| (p.param, p.param_offset, p.len))
            .collect();
        let mut views = ddp.params().ranges(ddp.module(), &want)?;
        Ok(match views.len() {
            1 => views.pop().expect("one view"),
            _ => Tensor::cat(views, 0),
        })
    }

    /// Every rank's parameters all-gathered from the owners' chunks and written into the
    /// module, a bucket at a time (each bucket's parameters are set pending, then applied). This
    /// rank's block of bucket `i` is filled just before its all-gather starts, while the
    /// buckets before it are in flight: by [`Fill`], stepping the chunk (its values read from
    /// the module, its gradient from the block or the shard), so that one chunk's values,
    /// gradient and update exist at a time, or from a checkpoint. `bufs`: one per bucket, used
    /// where big enough; nothing is kept between steps (see the module doc).
    fn gather(&mut self, bufs: Vec<Vec<f32>>, mut fill: Fill) -> Result<()> {
        let pg = self.ddp.process_group().clone();
        let last_of_bucket: Vec<usize> = self
            .layout()
            .buckets()
            .iter()
            .filter_map(|b| b.slots.last().map(|s| s.param))
            .collect();
        let how = sharding::Gather {
            window: self.core.gather_window(),
            ..Default::default()
        };
        // Stage 1 gathers every bucket at once in a buffer of its own, which then holds the
        // new parameters: it becomes them (Burn's shared `Bytes` windows) instead of being
        // copied into new tensors. Stage 2's window reuses its buffers: it copies.
        let in_place = how.window == 0;
        let layout = self.core.layout();
        let (optim, device, decay) = (&self.optim, &self.device, &self.decay);
        let states = &mut self.states;
        let ddp = std::cell::RefCell::new(&mut self.ddp);
        // The first error of ours, kept whole (the gather carries a message).
        let first = std::cell::RefCell::new(None);
        let keep = |e: Error| {
            let msg = e.to_string();
            first.borrow_mut().get_or_insert(e);
            ddp_core::Error::InvalidArgument(msg)
        };
        let tensor = |v: Vec<f32>| {
            let n = v.len();
            Tensor::<1>::from_data(TensorData::new(v, [n]), device)
        };
        let gathered = sharding::gather_params_into(
            &pg,
            layout,
            bufs,
            how,
            |i, dst| {
                if dst.is_empty() {
                    return Ok(());
                }
                let values = match &mut fill {
                    Fill::Values(v) => v[i].take().unwrap_or_default(),
                    Fill::Step { lr, shards } => {
                        let _s = ddp_core::trace::span("shard step", "zero");
                        let grad = shards[i].take().unwrap_or_else(|| dst.to_vec());
                        let chunk = Self::read_chunk(&ddp.borrow(), layout, i).map_err(keep)?;
                        let chunk = match decay {
                            Some(d) => d.apply(i, chunk, *lr),
                            None => chunk,
                        };
                        let (new, state) = optim.step(*lr, chunk, tensor(grad), states[i].take());
                        states[i] = state;
                        f32_vec(new.into_data(), "the stepped chunk")?
                    }
                };
                if values.len() != dst.len() {
                    return Err(ddp_core::Error::InvalidArgument(format!(
                        "chunk {i} has {} values for a block of {}",
                        values.len(),
                        dst.len()
                    )));
                }
                dst.copy_from_slice(&values);
                Ok(())
            },
            |p, _, v| {
                if in_place {
                    return Ok(()); // the buckets become the parameters below
                }
                let mut ddp = ddp.borrow_mut();
                let set =
                    ddp.set_pending_param(p, v)
                        .and_then(|()| match last_of_bucket.contains(&p) {
                            true => ddp.apply_pending(),
                            false => Ok(()),
                        });
                set.map_err(keep)
            },
            None,
        );
        if let Some(e) = first.into_inner() {
            return Err(e);
        }
        let bufs = gathered?;
        if in_place {
            // Every bucket came back whole (all given or allocated at once): its parameters are
            // windows of it from now on, no copy (the old parameters are freed as they go).
            let windows = bufs
                .into_iter()
                .zip(layout.buckets())
                .filter(|(_, b)| !b.slots.is_empty())
                .map(|(v, b)| (v, b.slots.iter().map(|s| (s.param, s.offset)).collect()))
                .collect();
            ddp.into_inner().apply_windows(windows)?;
        }
        Ok(())
    }

    fn require_sharded(&self, what: &str) -> Result<()> {
        let how = "save it with ddp_burn::checkpoint";
        Ok(self.core.require_sharded(what, how)?)
    }

    /// The optimizer's name in checkpoints (`burn.adamw`, `burn.sgd`, ...).
    fn kind() -> String {
        let name = std::any::type_name::<O>();
        let short = name.split('<').next().unwrap_or(name);
        let short = short.rsplit("::").next().unwrap_or(short);
        format!("burn.{}", short.to_lowercase())
    }

    /// This rank's shard: the values and optimizer state of its chunks, and the state's
    /// scalars (the same for every chunk: each is stepped at every step).
    pub fn shard_state(&self) -> Result<ShardState> {
        self.require_sharded("shard_state")?;
        let mut scalars: Option<(usize, Vec<(String, Scalar)>)> = None;
        let mut chunks = Vec::with_capacity(self.states.len());
        for (i, (c, s)) in self.layout().chunks().iter().zip(&self.states).enumerate() {
            let mut cs = ChunkState::default();
            if !c.is_empty() {
                let chunk = Self::read_chunk(&self.ddp, self.layout(), i)?;
                cs.params = f32_vec(chunk.into_data(), "a chunk")?;
            }
            if let Some(s) = s {
                let mut sink = StateSink::default();
                s.state_flatten("", &mut sink);
                for (name, data) in sink.tensors {
                    let what = format!("optimizer state `{name}`");
                    cs.slots.insert(slot_name(&name), f32_vec(data, &what)?);
                }
                match &scalars {
                    None => scalars = Some((i, sink.scalars)),
                    Some((j, first)) if *first != sink.scalars => {
                        return Err(Error::Unsupported(format!(
                            "the optimizer state scalars of chunks {j} and {i} differ \
                             ({first:?}, {:?}): ZeRO needs an optimizer that steps every \
                             element alike",
                            sink.scalars
                        )))
                    }
                    Some(_) => {}
                }
            }
            chunks.push(cs);
        }
        let mut hyper = BTreeMap::new();
        for (name, v) in scalars.map(|s| s.1).unwrap_or_default() {
            let (tag, x) = match v {
                Scalar::Int(x) => ("i", x as f64),
                Scalar::UInt(x) => ("u", x as f64),
                Scalar::Float(x) => ("f", x),
                Scalar::Bool(b) => ("b", f64::from(u8::from(b))),
            };
            hyper.insert(format!("{SCALAR}{tag}:{name}"), x);
        }
        Ok(ShardState {
            optimizer: OptimizerRecord {
                kind: Self::kind(),
                step: self.steps,
                hyper,
            },
            chunks,
        })
    }

    /// Saves a sharded checkpoint set in `dir` (a collective; see `ddp_core::sharding::sets`).
    /// It loads at any world size, at stage 1 or 2.
    pub fn save(&self, dir: &Path, meta: &CheckpointMeta) -> Result<PathBuf> {
        self.require_sharded("save")?;
        let state = self.shard_state().map_err(Error::into_ddp);
        let (pg, specs) = (self.ddp.process_group(), self.ddp.reducer().specs());
        Ok(sharding::save_agreed(
            pg,
            dir,
            self.layout(),
            specs,
            state,
            meta,
        )?)
    }

    /// [`save`](Self::save) in the background (PyTorch DCP's `async_save`): this rank's shard is
    /// copied now (the only stall) and written by `saver`'s thread; the set becomes current when
    /// `saver` commits it, at the next save or at `saver.wait(pg)` (collectives). Returns the
    /// committed set's outcome (`None` when none was in flight). See
    /// `ddp_core::sharding::AsyncSetSaver`.
    pub fn save_async(
        &self,
        saver: &mut ddp_core::sharding::AsyncSetSaver,
        dir: &Path,
        meta: &CheckpointMeta,
    ) -> Result<Option<ddp_core::Result<PathBuf>>> {
        self.require_sharded("save")?;
        let state = self.shard_state().map_err(Error::into_ddp);
        let (pg, specs) = (self.ddp.process_group(), self.ddp.reducer().specs());
        Ok(saver.save(pg, dir, self.layout(), specs, state, meta)?)
    }

    /// Loads the current sharded set of `dir` (saved at any world size, by Burn's ZeRO), re-cut
    /// for this one (a collective). `Ok(None)` when there is none. On any error on any rank,
    /// nothing is changed on any rank.
    pub fn load(&mut self, dir: &Path) -> Result<Option<CheckpointMeta>> {
        self.require_sharded("load")?;
        let (pg, specs) = (self.ddp.process_group(), self.ddp.reducer().specs());
        let loaded = sharding::load_agreed(pg, dir, self.layout(), specs, |s| self.decode(s))?;
        let Some((state, meta)) = loaded else {
            return Ok(None);
        };
        self.apply(state)?;
        Ok(Some(meta))
    }

    /// Takes this rank's shard of a plain checkpoint (`ddp_core::sharding::consolidate`'s):
    /// parameters and optimizer state (a collective).
    pub fn import(&mut self, ckpt: &Checkpoint) -> Result<()> {
        self.require_sharded("import")?;
        let (pg, specs) = (self.ddp.process_group(), self.ddp.reducer().specs());
        let state = sharding::import_agreed(pg, ckpt, self.layout(), specs, |s| self.decode(s))?;
        self.apply(state)
    }

    /// Rebuilds the chunks' values and optimizer states from `state` (checking that it is this
    /// optimizer's), without changing anything yet.
    fn decode(&self, state: ShardState) -> ddp_core::Result<Decoded<O>> {
        let kind = Self::kind();
        let rec = &state.optimizer;
        if !rec.kind.is_empty() && rec.kind != kind {
            return Err(ddp_core::Error::Mismatch(format!(
                "the checkpoint holds {} optimizer state but the optimizer is {kind}",
                rec.kind
            )));
        }
        let mut scalars = BTreeMap::new();
        for (k, &x) in &rec.hyper {
            let Some(rest) = k.strip_prefix(SCALAR) else {
                continue;
            };
            let (tag, name) = rest.split_once(':').unwrap_or(("", rest));
            let v = match tag {
                "i" => Scalar::Int(x as i64),
                "u" => Scalar::UInt(x as u64),
                "b" => Scalar::Bool(x != 0.0),
                _ => Scalar::Float(x),
            };
            scalars.insert(name.to_string(), v);
        }
        let mut out = Decoded {
            chunks: Vec::new(),
            states: Vec::new(),
            steps: rec.step,
        };
        for (i, cs) in state.chunks.into_iter().enumerate() {
            let present = self.layout().chunks().get(i).is_some_and(|c| !c.is_empty());
            if !present {
                out.chunks.push(None);
                out.states.push(None);
                continue;
            }
            let st = if cs.slots.is_empty() && scalars.is_empty() {
                None
            } else {
                let mut src = StateSource::new(scalars.clone());
                let names: Vec<String> = cs.slots.keys().cloned().collect();
                for (name, v) in cs.slots {
                    let n = v.len();
                    src.insert_tensor(name.replace('/', "."), TensorData::new(v, [n]));
                }
                let st = O::State::<1>::state_unflatten("", &mut src, &self.device);
                Some(st.ok_or_else(|| {
                    ddp_core::Error::Mismatch(format!(
                        "the checkpoint's optimizer state of chunk {i} (tensors {names:?}, \
                         scalars {:?}) does not make a {kind} state",
                        scalars.keys().collect::<Vec<_>>()
                    ))
                })?)
            };
            out.chunks.push(Some(cs.params));
            out.states.push(st);
        }
        Ok(out)
    }

    fn apply(&mut self, d: Decoded<O>) -> Result<()> {
        self.states = d.states;
        self.steps = d.steps;
        self.core.clear_grads();
        let n = self.layout().buckets().len();
        self.gather(vec![Vec::new(); n], Fill::Values(d.chunks))
    }
}

/// What fills this rank's block of each bucket in [`ZeroDdp::gather`].
enum Fill {
    /// The optimizer step of each chunk; its averaged gradient is the block itself (stage 1)
    /// or its shard (stage 2).
    Step {
        lr: f64,
        shards: Vec<Option<Vec<f32>>>,
    },
    /// Values (from a checkpoint).
    Values(Vec<Option<Vec<f32>>>),
}

/// A checkpoint's cut for this rank, decoded (see [`ZeroDdp::decode`]).
struct Decoded<O: Optimizer> {
    chunks: Vec<Option<Vec<f32>>>,
    states: Vec<Option<O::State<1>>>,
    steps: u64,
}

/// A state tensor's checkpoint slot: Burn's path with `/` for `.` (`momentum/moment_1`), since
/// a plain checkpoint names state `optim.<parameter>.<slot>` and parameter paths hold dots.
fn slot_name(path: &str) -> String {
    path.replace('.', "/")
}

fn f32_vec(data: TensorData, what: &str) -> ddp_core::Result<Vec<f32>> {
    data.try_into_vec::<f32>()
        .map_err(|e| ddp_core::Error::InvalidArgument(format!("{what} is not f32: {e:?}")))
}

impl<M: Module, O: Optimizer> std::ops::Deref for ZeroDdp<M, O> {
    type Target = DistributedDataParallel<M>;
    fn deref(&self) -> &DistributedDataParallel<M> {
        &self.ddp
    }
}
