//! [`ZeroDdp`]: ZeRO stages 1 and 2 for Burn modules, on `ddp::sharding` (the framework-agnostic
//! layout, reduce-scatter hook, parameter all-gather and sharded checkpoints that
//! `ddp_candle::ZeroDdp` runs on too).
//!
//! ```text
//!  loss.backward() ─► Reducer (buckets, last parameter first) ─► ReduceScatterHook: each bucket
//!    reduce-scattered in place ─► this rank's averaged chunk of every bucket (ShardGrads)
//!  ─► Burn's optimizer (`Optimizer::step`, the per-tensor API that ModuleOptimizer maps over a
//!    module) steps one 1-D tensor per chunk, with the chunk's own state ─► sharding::
//!    gather_params_into: every bucket all-gathered ─► the module's parameters, bit-identical
//!    on every rank
//! ```
//!
//! Any Burn optimizer whose update is element-wise works unchanged (`SgdConfig`,
//! `AdamConfig`, `AdamWConfig`, ... `.build()`): stepping a chunk is then exactly stepping those
//! elements of the whole model, so a run equals DDP with the same optimizer's `.init()`. Each
//! rank keeps optimizer state for its chunks only (`8Ψ/N` bytes for Adam's two moments) and, at
//! stage 2, only its gradient chunks between steps. Gradient clipping by global norm is
//! [`ZeroDdp::clip_grad_norm`] (the norm all-reduced from the shards); Burn's own per-parameter
//! `grad_clipping` of `.init()` is not element-wise and is not applied.
//!
//! What Burn's design adds to the formulas (`8Ψ + 8Ψ/N` at stage 1, `4Ψ + 12Ψ/N` at stage 2 for
//! fp32 Adam): the chunks are tensors of their own beside the module (4Ψ/N: Burn's parameters
//! are immutable values, so the optimizer cannot update the owned elements inside them), and
//! Burn's backward returns every gradient at once, so the backward's peak holds the full
//! gradients (4Ψ) whatever the stage; stage 2 frees them as the buckets are reduce-scattered,
//! not before they exist.
//!
//! Checkpoints are `ddp::sharding`'s: each rank writes its chunks (values and every tensor of
//! the optimizer state, by Burn's `RecordState` names), rank 0 the index with the state's scalars
//! (Adam's step count); a set resumes at any world size and stage 1 or 2, and
//! `ddp::sharding::consolidate` makes one plain checkpoint of it.
//!
//! ```ignore
//! let ddp = ddp_burn::Ddp::new(model, &pg, Default::default())?;
//! let mut zero = ZeroDdp::new(ddp, ZeroStage::Two, AdamWConfig::new().build())?;
//! for (x, y) in batches {
//!     let loss = zero.module().forward_loss(x, y);
//!     zero.backward(loss)?;            // reduce-scatter
//!     zero.clip_grad_norm(1.0)?;       // optional, cross-rank norm
//!     zero.step(1e-3)?;                // owner steps its chunks, all-gather
//! }
//! zero.save(dir, &meta)?;              // a shard per rank; resumes on any world size
//! ```

use crate::{DistributedDataParallel, Error, Result};
use burn::module::Module;
use burn::optim::{
    GradientsParams, ModuleOptimizer, Optimizer, RecordState, StateSink, StateSource,
};
use burn::tensor::{Device, Tensor, TensorData};
use burn_pack::Scalar;
use ddp::checkpoint::{Checkpoint, CheckpointMeta, OptimizerRecord};
use ddp::join::{Join, JoinStep};
use ddp::reducer::{HostBuffer, StepStats};
use ddp::sharding::{self, ChunkState, ShardGrads, ShardLayout, ShardState, ZeroStage};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Stage 2's full-size buckets alive at once in the parameter all-gather.
const STAGE2_WINDOW: usize = 2;

/// Key prefix of an optimizer state scalar in `OptimizerRecord::hyper`.
const SCALAR: &str = "state:";

/// Sharded data-parallel training of a Burn module (see the module doc).
pub struct ZeroDdp<M: Module, O: Optimizer> {
    ddp: DistributedDataParallel<M>,
    stage: ZeroStage,
    layout: ShardLayout,
    optim: O,
    /// Stage 0: `optim` over the whole module.
    module_optim: Option<ModuleOptimizer>,
    /// This rank's chunk values, one per chunk of `layout` (`None`: empty).
    chunks: Vec<Option<Tensor<1>>>,
    /// Their optimizer states (`None` before the first step).
    states: Vec<Option<O::State<1>>>,
    /// The device the chunks live on (the parameters' without autodiff).
    device: Device,
    /// Optimizer steps taken.
    steps: u64,
    shard_grads: Option<ShardGrads>,
    /// Stage 0: the averaged gradients.
    full_grads: Option<GradientsParams>,
}

impl<M: Module, O: Optimizer> ZeroDdp<M, O> {
    /// Wraps `ddp` (already constructed, so replicas start identical) at `stage`, stepping with
    /// `optim` (Burn's bare optimizer: `AdamWConfig::new().build()`). Stage 0 is plain DDP through
    /// the same API (`optim` then steps the whole module as `ModuleOptimizer`). A collective:
    /// every rank must call it with the same stage. Stage 3 is not offered for Burn yet.
    pub fn new(ddp: DistributedDataParallel<M>, stage: ZeroStage, optim: O) -> Result<Self> {
        if stage == ZeroStage::Three {
            return Err(Error::Unsupported(
                "ZeRO stage 3 (parameters sharded) is not available for Burn modules: use stage \
                 1 or 2, or ddp_candle::Fsdp"
                    .into(),
            ));
        }
        let specs = ddp.reducer().specs().to_vec();
        if let Some(s) = specs.iter().find(|s| s.dtype != ddp_comm::DType::F32) {
            return Err(Error::Unsupported(format!(
                "ZeRO shards f32 parameters; `{}` is {:?}",
                s.name, s.dtype
            )));
        }
        let pg = ddp.process_group().clone();
        let layout = ShardLayout::new(&specs, &ddp.reducer().buckets(), pg.size(), pg.rank())?;
        let device = if specs.is_empty() {
            Device::default()
        } else {
            ddp.params().grad_device(0).clone()
        };
        let mut z = ZeroDdp {
            stage,
            chunks: Vec::new(),
            states: Vec::new(),
            module_optim: None,
            device,
            steps: 0,
            shard_grads: None,
            full_grads: None,
            layout,
            optim,
            ddp,
        };
        if stage == ZeroStage::Ddp {
            z.module_optim = Some(ModuleOptimizer::from(z.optim.clone()));
            return Ok(z);
        }
        if stage == ZeroStage::Two {
            // A bucket is filled once the one before it is cut to its shard.
            let cap = z.ddp.reducer().bucket_cap_bytes();
            z.ddp.reducer_mut().set_max_bucket_bytes_alive(Some(cap));
        }
        z.ddp.register_comm_hook(match stage {
            ZeroStage::One => sharding::ReduceScatterHook::in_place(),
            _ => sharding::ReduceScatterHook::shard_only(),
        })?;
        z.ddp.params().capture(z.ddp.module())?;
        let mut full = z.ddp.params().take_staged();
        // A parameter lies in one bucket, hence in at most one chunk of this rank: taken once.
        let values = sharding::shard_params(&z.layout, |p| match full[p].take() {
            Some(HostBuffer::F32(v)) => Ok(v),
            _ => Err(ddp::Error::InvalidArgument(format!(
                "parameter {p} was not captured as f32"
            ))),
        })?;
        drop(full);
        z.chunks = values
            .into_iter()
            .map(|v| (!v.is_empty()).then(|| z.chunk_tensor(v)))
            .collect();
        z.states = vec![None; z.chunks.len()];
        Ok(z)
    }

    fn chunk_tensor(&self, v: Vec<f32>) -> Tensor<1> {
        let n = v.len();
        Tensor::from_data(TensorData::new(v, [n]), &self.device)
    }

    pub fn stage(&self) -> ZeroStage {
        self.stage
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
        &self.layout
    }

    /// Optimizer steps taken (set by [`load`](Self::load)).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// Bytes this rank sends per synchronized step (ring model; DDP's volume).
    pub fn bytes_per_step(&self) -> u64 {
        sharding::bytes_per_step(&self.layout)
    }

    /// PyTorch's `no_sync`: backwards accumulate locally while `sync` is false; do not step
    /// until a synchronized backward.
    pub fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.ddp.reducer_mut().set_require_backward_grad_sync(sync);
    }

    /// Backward and gradient reduction: all-reduce at stage 0, reduce-scatter at stages 1 and 2
    /// (this rank keeps its averaged chunks; stage 2 frees the rest of each bucket).
    pub fn backward<const D: usize>(&mut self, loss: Tensor<D>) -> Result<StepStats> {
        if self.stage == ZeroStage::Ddp {
            let grads = self.ddp.backward(loss)?;
            let stats = self.ddp.last_step_stats().unwrap_or_default();
            self.full_grads = stats.synced.then_some(grads);
            return Ok(stats);
        }
        let stats = self.ddp.reduce_backward(loss)?;
        self.after_reduce(stats)
    }

    /// [`backward`](Self::backward) under [`Join`] (uneven inputs): `loss` is `None` once this
    /// rank has run out of data; gradients are averaged over the ranks that had data.
    pub fn backward_join<const D: usize>(
        &mut self,
        loss: Option<Tensor<D>>,
        join: &Join,
        step: &JoinStep,
    ) -> Result<StepStats> {
        if self.stage == ZeroStage::Ddp {
            self.full_grads = Some(self.ddp.backward_join(loss, join, step)?);
            return Ok(self.ddp.last_step_stats().unwrap_or_default());
        }
        if loss.is_some() != step.has_data {
            return Err(Error::Unsupported(format!(
                "backward_join on rank {}: has_data = {} but {} loss given",
                self.ddp.rank(),
                step.has_data,
                if loss.is_some() { "a" } else { "no" }
            )));
        }
        let stats = self.ddp.reduce_backward_join(loss, join, step)?;
        self.after_reduce(stats)
    }

    fn after_reduce(&mut self, stats: StepStats) -> Result<StepStats> {
        self.shard_grads = if stats.synced {
            Some(sharding::take_shard_grads(
                &self.layout,
                self.ddp.reducer_mut(),
            )?)
        } else {
            None
        };
        Ok(stats)
    }

    fn no_grads(&self, what: &str) -> Error {
        Error::Unsupported(format!(
            "{what} on rank {}: no averaged gradients (call backward first, outside no_sync)",
            self.ddp.rank()
        ))
    }

    /// PyTorch's `clip_grad_norm_`: scales the averaged gradients so that their global L2 norm
    /// is at most `max_norm` (from the shards, all-reduced); returns the norm before clipping.
    /// After a synchronized backward.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        if let Some(g) = &mut self.shard_grads {
            return Ok(sharding::clip_grad_norm(
                self.ddp.process_group(),
                g,
                max_norm,
            )?);
        }
        let Some(grads) = self.full_grads.as_mut() else {
            return Err(self.no_grads("clip_grad_norm"));
        };
        self.ddp.params().clip_grad_norm(grads, max_norm)
    }

    /// The optimizer step on this rank's chunks, then the all-gather of the updated parameters
    /// into the module (stage 0: the plain step). `lr` as Burn's `LearningRate`.
    pub fn step(&mut self, lr: f64) -> Result<()> {
        if self.stage == ZeroStage::Ddp {
            let grads = self
                .full_grads
                .take()
                .ok_or_else(|| self.no_grads("step"))?;
            let optim = self.module_optim.as_mut().expect("stage 0 has one");
            self.ddp.step(optim, lr, grads);
            self.steps += 1;
            return Ok(());
        }
        let grads = self
            .shard_grads
            .take()
            .ok_or_else(|| self.no_grads("step"))?;
        let mut parts = grads.into_parts();
        {
            let _s = ddp::trace::span("shard step", "zero");
            for (i, (buf, range)) in parts.iter_mut().enumerate() {
                let Some(chunk) = self.chunks[i].take() else {
                    continue;
                };
                // A chunk alone (stage 2) becomes the gradient tensor as it is; a whole
                // bucket (stage 1) keeps its buffer for the all-gather and lends a copy.
                let grad = match range.len() == buf.len() {
                    true => std::mem::take(buf),
                    false => buf[range.clone()].to_vec(),
                };
                let grad = self.chunk_tensor(grad);
                let (new, state) = self.optim.step(lr, chunk, grad, self.states[i].take());
                self.chunks[i] = Some(new);
                self.states[i] = state;
            }
        }
        self.steps += 1;
        // Stage 1's buffers are whole buckets: they carry the all-gather and go back to the
        // reducer. Stage 2's are the chunks alone: the gather allocates its window's buffers,
        // which become the next backward's first buckets.
        let n = self.layout.buckets().len();
        let whole: Vec<bool> = parts
            .iter()
            .zip(self.layout.buckets())
            .map(|((v, _), b)| v.len() == b.numel && b.numel > 0)
            .collect();
        let bufs: Vec<Vec<f32>> = parts
            .into_iter()
            .zip(&whole)
            .map(|((v, _), &w)| if w { v } else { Vec::new() })
            .collect();
        let _s = ddp::trace::span("gather params", "zero");
        let bufs = self.gather(bufs)?;
        let mut own = Vec::with_capacity(n);
        let mut spares = Vec::new();
        for (v, w) in bufs.into_iter().zip(whole) {
            let v = (!v.is_empty()).then_some(HostBuffer::F32(v));
            if w {
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

    /// Every rank's parameters all-gathered from the owners' chunks in `bufs` (fresh ones where
    /// empty) and written into the module, a bucket at a time (each bucket's parameters are
    /// staged, then applied: at most a bucket of parameters staged at once). The buffers come
    /// back (see `sharding::gather_params_into`).
    fn gather(&mut self, bufs: Vec<Vec<f32>>) -> Result<Vec<Vec<f32>>> {
        let pg = self.ddp.process_group().clone();
        let last_of_bucket: Vec<usize> = self
            .layout
            .buckets()
            .iter()
            .filter_map(|b| b.slots.last().map(|s| s.param))
            .collect();
        let how = sharding::Gather {
            window: if self.stage == ZeroStage::Two {
                STAGE2_WINDOW
            } else {
                0
            },
            ..Default::default()
        };
        let chunks = &self.chunks;
        let ddp = &mut self.ddp;
        let mut apply_error = None;
        let out = sharding::gather_params_into(
            &pg,
            &self.layout,
            bufs,
            how,
            |i, dst| {
                let Some(c) = &chunks[i] else {
                    return Ok(());
                };
                let data = c.clone().into_data();
                let v = data.as_slice::<f32>().map_err(|e| {
                    ddp::Error::InvalidArgument(format!("chunk {i} is not f32: {e:?}"))
                })?;
                dst.copy_from_slice(v);
                Ok(())
            },
            |p, _, v| {
                let staged =
                    ddp.stage_param(p, v)
                        .and_then(|()| match last_of_bucket.contains(&p) {
                            true => ddp.apply_staged(),
                            false => Ok(()),
                        });
                staged.map_err(|e| {
                    let msg = e.to_string();
                    apply_error.get_or_insert(e);
                    ddp::Error::InvalidArgument(msg)
                })
            },
            None,
        );
        if let Some(e) = apply_error {
            return Err(e);
        }
        Ok(out?)
    }

    fn require_sharded(&self, what: &str) -> Result<()> {
        if self.stage == ZeroStage::Ddp {
            return Err(Error::Unsupported(format!(
                "{what}: stage 0 is plain DDP; save it with ddp_burn::checkpoint"
            )));
        }
        Ok(())
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
        let mut chunks = Vec::with_capacity(self.chunks.len());
        for (i, (c, s)) in self.chunks.iter().zip(&self.states).enumerate() {
            let mut cs = ChunkState::default();
            if let Some(c) = c {
                cs.params = f32_vec(c.clone().into_data(), "a chunk")?;
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

    /// Saves a sharded checkpoint set in `dir` (a collective; see `ddp::sharding::checkpoint`).
    /// It loads at any world size, at stage 1 or 2.
    pub fn save(&self, dir: &Path, meta: &CheckpointMeta) -> Result<PathBuf> {
        self.require_sharded("save")?;
        let pg = self.ddp.process_group();
        let state = sharding::agree(pg, "reading the shard state", {
            self.shard_state()
                .map_err(|e| ddp::Error::Checkpoint(e.to_string()))
        })?;
        let specs = self.ddp.reducer().specs();
        Ok(sharding::save_sharded(
            pg,
            dir,
            &self.layout,
            specs,
            &state,
            meta,
        )?)
    }

    /// Loads the current sharded set of `dir` (saved at any world size, by Burn's ZeRO), re-cut
    /// for this one (a collective). `Ok(None)` when there is none. On any error on any rank,
    /// nothing is changed on any rank.
    pub fn load(&mut self, dir: &Path) -> Result<Option<CheckpointMeta>> {
        self.require_sharded("load")?;
        let loaded = sharding::load_sharded(dir, &self.layout, self.ddp.reducer().specs());
        let loaded = loaded.and_then(|l| match l {
            Some((state, meta)) => Ok(Some((self.decode(state)?, meta))),
            None => Ok(None),
        });
        let pg = self.ddp.process_group().clone();
        let Some((state, meta)) = sharding::agree(&pg, "loading the sharded checkpoint", loaded)?
        else {
            return Ok(None);
        };
        self.apply(state)?;
        Ok(Some(meta))
    }

    /// Takes this rank's shard of a plain checkpoint (`ddp::sharding::consolidate`'s):
    /// parameters and optimizer state (a collective).
    pub fn import(&mut self, ckpt: &Checkpoint) -> Result<()> {
        self.require_sharded("import")?;
        let state = sharding::import(ckpt, &self.layout, self.ddp.reducer().specs());
        let state = state.and_then(|s| self.decode(s));
        let pg = self.ddp.process_group().clone();
        let state = sharding::agree(&pg, "importing the checkpoint", state)?;
        self.apply(state)
    }

    /// Rebuilds the chunks' values and optimizer states from `state` (checking that it is this
    /// optimizer's), without changing anything yet.
    fn decode(&self, state: ShardState) -> ddp::Result<Decoded<O>> {
        let kind = Self::kind();
        let rec = &state.optimizer;
        if !rec.kind.is_empty() && rec.kind != kind {
            return Err(ddp::Error::Mismatch(format!(
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
            let present = self.chunks.get(i).is_some_and(Option::is_some);
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
                    ddp::Error::Mismatch(format!(
                        "the checkpoint's optimizer state of chunk {i} (tensors {names:?}, \
                         scalars {:?}) does not make a {kind} state",
                        scalars.keys().collect::<Vec<_>>()
                    ))
                })?)
            };
            out.chunks.push(Some(self.chunk_tensor(cs.params)));
            out.states.push(st);
        }
        Ok(out)
    }

    fn apply(&mut self, d: Decoded<O>) -> Result<()> {
        self.chunks = d.chunks;
        self.states = d.states;
        self.steps = d.steps;
        self.shard_grads = None;
        let n = self.layout.buckets().len();
        self.gather(vec![Vec::new(); n])?;
        Ok(())
    }
}

/// A checkpoint's cut for this rank, decoded (see [`ZeroDdp::decode`]).
struct Decoded<O: Optimizer> {
    chunks: Vec<Option<Tensor<1>>>,
    states: Vec<Option<O::State<1>>>,
    steps: u64,
}

/// A state tensor's checkpoint slot: Burn's path with `/` for `.` (`momentum/moment_1`), since
/// a plain checkpoint names state `optim.<parameter>.<slot>` and parameter paths hold dots.
fn slot_name(path: &str) -> String {
    path.replace('.', "/")
}

fn f32_vec(data: TensorData, what: &str) -> ddp::Result<Vec<f32>> {
    data.try_into_vec::<f32>()
        .map_err(|e| ddp::Error::InvalidArgument(format!("{what} is not f32: {e:?}")))
}

impl<M: Module, O: Optimizer> std::ops::Deref for ZeroDdp<M, O> {
    type Target = DistributedDataParallel<M>;
    fn deref(&self) -> &DistributedDataParallel<M> {
        &self.ddp
    }
}
