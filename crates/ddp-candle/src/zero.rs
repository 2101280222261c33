//! [`ZeroDdp`]: ZeRO stages 1 and 2 for candle models, on `ddp::sharding`.
//!
//! A [`Ddp`](crate::Ddp) whose buckets are reduce-scattered (`ddp::sharding::ReduceScatterHook`)
//! instead of all-reduced; each rank keeps the parameter values and optimizer state of the
//! chunks it owns (one 1-D `Var` per owned bucket chunk, named `bucket<b>`), steps them with an
//! ordinary optimizer of [`optim`](crate::optim) (`Sgd`, `AdamW`: element-wise, so stepping a
//! chunk is exactly stepping those elements of the whole model), and all-gathers the updated
//! chunks into every rank's parameters. Stage 0 is plain DDP through the same API.
//!
//! ```ignore
//! let ddp = ddp_candle::Ddp::new(&varmap, &pg, Default::default())?;
//! let mut zero = ZeroDdp::new(ddp, ZeroStage::Two, |vars| {
//!     Ok(Box::new(AdamW::new_named(vars, ParamsAdamW::default())?))
//! })?;
//! for (x, y) in batches {
//!     zero.backward(&loss(&model, &x, &y)?)?; // reduce-scatter
//!     zero.clip_grad_norm(1.0)?;               // optional, cross-rank norm
//!     zero.step()?;                            // owner steps, all-gather
//! }
//! zero.save(dir, &meta)?;                      // a shard per rank; resumes on any world size
//! ```

use crate::optim::DynOptimizer;
use crate::{DistributedDataParallel, Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use ddp::adapter::ParamAccess;
use ddp::checkpoint::{Checkpoint, CheckpointMeta, OptimizerStateDict, TensorData};
use ddp::join::{Join, JoinStep};
use ddp::reducer::{HostSlice, StepStats};
use ddp::sharding::{self, ChunkState, ShardLayout, ShardState, ZeroStage};
use ddp_comm::ReduceOp;
use std::path::{Path, PathBuf};

/// Sharded data-parallel training (see the module doc).
pub struct ZeroDdp {
    ddp: DistributedDataParallel,
    stage: ZeroStage,
    layout: ShardLayout,
    /// One per chunk of `layout` (`None` for an empty chunk).
    shard: Vec<Option<Var>>,
    opt: Box<dyn DynOptimizer>,
    /// Stage 1/2: this rank's averaged gradient chunks after a synchronized backward.
    shard_grads: Option<Vec<Vec<f32>>>,
    /// Stage 0: the averaged gradients.
    full_grads: Option<GradStore>,
}

fn chunk_name(bucket: usize) -> String {
    format!("bucket{bucket}")
}

impl ZeroDdp {
    /// Wraps `ddp` (already constructed, so replicas start identical) at `stage`; `make_opt`
    /// builds the optimizer over this rank's shard variables (stage 1/2) or every parameter
    /// (stage 0). A collective: every rank must call it with the same stage.
    pub fn new(
        mut ddp: DistributedDataParallel,
        stage: ZeroStage,
        make_opt: impl FnOnce(Vec<(String, Var)>) -> Result<Box<dyn DynOptimizer>>,
    ) -> Result<Self> {
        let specs = ddp.reducer().specs().to_vec();
        let pg = ddp.process_group().clone();
        let layout = ShardLayout::new(&specs, &ddp.reducer().buckets(), pg.size(), pg.rank())?;
        let mut shard = Vec::new();
        let opt = if stage == ZeroStage::Ddp {
            make_opt(ddp.named_vars().to_vec())?
        } else {
            ddp.register_comm_hook(sharding::ReduceScatterHook)?;
            let values = sharding::shard_params(&layout, |p| read_f32(&ddp, p))?;
            let mut named = Vec::new();
            for (c, v) in layout.chunks().iter().zip(values) {
                if c.is_empty() {
                    shard.push(None);
                    continue;
                }
                let var = Var::from_tensor(&Tensor::from_vec(v, c.len(), &Device::Cpu)?)?;
                named.push((chunk_name(c.bucket), var.clone()));
                shard.push(Some(var));
            }
            make_opt(named)?
        };
        Ok(ZeroDdp {
            ddp,
            stage,
            layout,
            shard,
            opt,
            shard_grads: None,
            full_grads: None,
        })
    }

    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// The wrapped DDP (parameters, reducer, replica checks).
    pub fn ddp(&self) -> &DistributedDataParallel {
        &self.ddp
    }

    /// The wrapped DDP, mutably (stage 0's staged backward, comm timing).
    pub fn ddp_mut(&mut self) -> &mut DistributedDataParallel {
        &mut self.ddp
    }

    /// Which elements this rank owns.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// This rank's shard variables, one per chunk (`None` for an empty one); empty at stage 0.
    pub fn shard_vars(&self) -> &[Option<Var>] {
        &self.shard
    }

    pub fn optimizer(&self) -> &(dyn DynOptimizer + 'static) {
        &*self.opt
    }

    pub fn optimizer_mut(&mut self) -> &mut (dyn DynOptimizer + 'static) {
        &mut *self.opt
    }

    /// Bytes this rank sends per synchronized step (ring model: all-reduce, or reduce-scatter
    /// plus all-gather; the same volume).
    pub fn bytes_per_step(&self) -> u64 {
        sharding::bytes_per_step(&self.layout)
    }

    /// PyTorch's `no_sync` (see [`DistributedDataParallel::no_sync`]): backwards accumulate
    /// locally while `sync` is false; do not step until a synchronized backward.
    pub fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.ddp.set_require_backward_grad_sync(sync);
    }

    /// Backward and gradient reduction: all-reduce at stage 0, reduce-scatter at stages 1 and 2
    /// (this rank keeps its averaged chunk; stage 2 frees the bucket buffers).
    pub fn backward(&mut self, loss: &Tensor) -> Result<StepStats> {
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
    pub fn backward_join(
        &mut self,
        loss: Option<&Tensor>,
        join: &Join,
        step: &JoinStep,
    ) -> Result<StepStats> {
        if self.stage == ZeroStage::Ddp {
            let grads = self.ddp.backward_join(loss, join, step)?;
            let stats = self.ddp.last_step_stats().unwrap_or_default();
            self.full_grads = Some(grads);
            return Ok(stats);
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
        if !stats.synced {
            self.shard_grads = None;
            return Ok(stats);
        }
        self.shard_grads = Some(sharding::shard_grads(&self.layout, self.ddp.reducer())?);
        if self.stage == ZeroStage::Two {
            self.ddp.reducer_mut().release_buffers()?;
        }
        Ok(stats)
    }

    /// PyTorch's `clip_grad_norm_`: scales the averaged gradients so that their global L2 norm
    /// is at most `max_norm` (the norm is all-reduced from the shards); returns the norm before
    /// clipping. After a synchronized backward.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        if let Some(g) = &mut self.shard_grads {
            return Ok(sharding::clip_grad_norm(
                self.ddp.process_group(),
                g,
                max_norm,
            )?);
        }
        let Some(grads) = &mut self.full_grads else {
            return Err(self.no_grads("clip_grad_norm"));
        };
        let mut sq = 0f64;
        for (_, v) in self.ddp.named_vars() {
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
            for (_, v) in self.ddp.named_vars() {
                if let Some(g) = grads.remove(v) {
                    grads.insert(v, (g * coef)?);
                }
            }
        }
        Ok(norm)
    }

    fn no_grads(&self, what: &str) -> Error {
        Error::Unsupported(format!(
            "{what} on rank {}: no averaged gradients (call backward first, outside no_sync)",
            self.ddp.rank()
        ))
    }

    /// The optimizer step on this rank's chunks, then the all-gather of the updated parameters
    /// (stage 0: the plain step).
    pub fn step(&mut self) -> Result<()> {
        if self.stage == ZeroStage::Ddp {
            let grads = self
                .full_grads
                .take()
                .ok_or_else(|| self.no_grads("step"))?;
            self.opt.step(&grads)?;
            return Ok(());
        }
        let grads = self
            .shard_grads
            .take()
            .ok_or_else(|| self.no_grads("step"))?;
        let mut store = GradStore::default();
        for (var, g) in self.shard.iter().zip(grads) {
            if let Some(var) = var {
                let n = g.len();
                store.insert(var.as_tensor(), Tensor::from_vec(g, n, &Device::Cpu)?);
            }
        }
        self.opt.step(&store)?;
        self.gather()
    }

    fn shard_values(&self) -> Result<Vec<Vec<f32>>> {
        self.shard
            .iter()
            .map(|v| match v {
                Some(v) => Ok(v.as_tensor().to_vec1::<f32>()?),
                None => Ok(Vec::new()),
            })
            .collect()
    }

    /// Every rank's parameters from the owners' chunks.
    fn gather(&self) -> Result<()> {
        let chunks = self.shard_values()?;
        let params = self.ddp.params();
        sharding::gather_params(self.ddp.process_group(), &self.layout, chunks, |p, v| {
            params
                .write_param(p, HostSlice::of(v))
                .map_err(|e| ddp::Error::InvalidArgument(e.to_string()))
        })?;
        Ok(())
    }

    /// This rank's shard: parameter values and optimizer state of its chunks.
    pub fn shard_state(&self) -> Result<ShardState> {
        let state = self.opt.state_dict()?;
        let mut chunks = Vec::new();
        for ((c, values), var) in self
            .layout
            .chunks()
            .iter()
            .zip(self.shard_values()?)
            .zip(&self.shard)
        {
            let mut cs = ChunkState {
                params: values,
                ..Default::default()
            };
            if var.is_some() {
                let prefix = format!("{}.", chunk_name(c.bucket));
                for (k, t) in &state.tensors {
                    if let Some(slot) = k.strip_prefix(&prefix) {
                        cs.slots.insert(slot.to_string(), t.data.clone());
                    }
                }
            }
            chunks.push(cs);
        }
        Ok(ShardState {
            optimizer: ddp::checkpoint::OptimizerRecord {
                kind: state.kind,
                step: state.step,
                hyper: state.hyper,
            },
            chunks,
        })
    }

    fn require_sharded(&self, what: &str) -> Result<()> {
        if self.stage == ZeroStage::Ddp {
            return Err(Error::Unsupported(format!(
                "{what}: stage 0 is plain DDP; use ddp::checkpoint (save_vars, save_optimizer)"
            )));
        }
        Ok(())
    }

    /// Saves a sharded checkpoint set in `dir` (a collective; see `ddp::sharding::checkpoint`).
    pub fn save(&self, dir: &Path, meta: &CheckpointMeta) -> Result<PathBuf> {
        self.require_sharded("save")?;
        let specs = self.ddp.reducer().specs();
        let state = self.shard_state();
        let pg = self.ddp.process_group();
        // A failure to read the state on one rank must not leave the others waiting.
        let state = match state {
            Ok(s) => s,
            Err(e) => {
                let mut flag = [1u8];
                let _ = pg.all_reduce(&mut flag, ReduceOp::Max);
                return Err(e);
            }
        };
        Ok(sharding::save_sharded(
            pg,
            dir,
            &self.layout,
            specs,
            &state,
            meta,
        )?)
    }

    /// Loads the current sharded set of `dir`, saved at any world size, re-cut for this one (a
    /// collective). `Ok(None)` when there is none. On any error on any rank nothing is changed
    /// on any rank.
    pub fn load(&mut self, dir: &Path) -> Result<Option<CheckpointMeta>> {
        self.require_sharded("load")?;
        let loaded = sharding::load_sharded(dir, &self.layout, self.ddp.reducer().specs())
            .map_err(Error::from);
        let loaded = self.agree("loading the sharded checkpoint", loaded)?;
        let Some((state, meta)) = loaded else {
            return Ok(None);
        };
        self.apply(state)?;
        Ok(Some(meta))
    }

    /// Takes this rank's shard of a plain checkpoint (DDP's, or `ddp::sharding::consolidate`'s):
    /// parameters and optimizer state (a collective).
    pub fn import(&mut self, ckpt: &Checkpoint) -> Result<()> {
        self.require_sharded("import")?;
        let state =
            sharding::import(ckpt, &self.layout, self.ddp.reducer().specs()).map_err(Error::from);
        let state = self.agree("importing the checkpoint", state)?;
        self.apply(state)
    }

    fn agree<T>(&self, what: &str, r: Result<T>) -> Result<T> {
        let pg = self.ddp.process_group();
        let mut flags = vec![0u8; pg.size()];
        flags[pg.rank()] = r.is_err() as u8;
        pg.all_reduce(&mut flags, ReduceOp::Max)?;
        match r {
            Err(e) => Err(e),
            Ok(_) if flags.iter().any(|&f| f != 0) => Err(Error::Unsupported(format!(
                "{what} failed on rank(s) {:?}; nothing was changed",
                (0..pg.size())
                    .filter(|&r| flags[r] != 0)
                    .collect::<Vec<_>>()
            ))),
            Ok(v) => Ok(v),
        }
    }

    fn apply(&mut self, state: ShardState) -> Result<()> {
        if !state.optimizer.kind.is_empty() && state.optimizer.kind != self.opt.kind() {
            return Err(Error::Ddp(ddp::Error::Mismatch(format!(
                "checkpoint holds {} optimizer state but the optimizer is {}",
                state.optimizer.kind,
                self.opt.kind()
            ))));
        }
        let mut dict = OptimizerStateDict::new(state.optimizer.kind.clone(), state.optimizer.step);
        dict.hyper = state.optimizer.hyper.clone();
        for ((c, cs), var) in self
            .layout
            .chunks()
            .iter()
            .zip(&state.chunks)
            .zip(&self.shard)
        {
            if var.is_none() {
                continue;
            }
            for (slot, v) in &cs.slots {
                dict.tensors.insert(
                    OptimizerStateDict::key(&chunk_name(c.bucket), slot),
                    TensorData::new(vec![v.len()], v.clone())?,
                );
            }
        }
        self.opt.load_state_dict(&dict)?;
        for (var, cs) in self.shard.iter().zip(&state.chunks) {
            if let Some(var) = var {
                var.set(&Tensor::from_vec(
                    cs.params.clone(),
                    cs.params.len(),
                    &Device::Cpu,
                )?)?;
            }
        }
        self.shard_grads = None;
        self.gather()
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

fn read_f32(ddp: &DistributedDataParallel, p: usize) -> ddp::Result<Vec<f32>> {
    let b = ddp
        .params()
        .read_param(p)
        .map_err(|e| ddp::Error::InvalidArgument(e.to_string()))?;
    b.as_slice::<f32>()
        .map(<[f32]>::to_vec)
        .ok_or_else(|| ddp::Error::InvalidArgument(format!("parameter {p} is not f32")))
}
