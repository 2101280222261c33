//! What every sharded stage (1, 2 and 3) holds on a rank: the values of its chunks of a
//! `ShardLayout` as 1-D `Var`s (named `bucket<b>` for the optimizer), stepped by an ordinary
//! element-wise optimizer, and converted to and from `ddp_core::sharding`'s checkpoints. Shared by
//! [`ZeroDdp`](crate::ZeroDdp) (chunks of the reducer's buckets) and [`Fsdp`](crate::Fsdp)
//! (chunks of the units).

use crate::optim::{DynOptimizer, EchoGrads, Piece};
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, TensorId, Var};
use ddp_comm::ProcessGroup;
use ddp_core::checkpoint::{
    Checkpoint, CheckpointMeta, OptimizerRecord, OptimizerStateDict, TensorData,
};
use ddp_core::reducer::{HostSlice, ParamSpec};
use ddp_core::sharding::{self, ChunkState, ShardGrads, ShardLayout, ShardState};
use std::path::{Path, PathBuf};

/// `opt` as this crate's [`AdamW`](crate::optim::AdamW), the one optimizer with weight-decay
/// groups over chunks.
pub(crate) fn adamw(opt: &mut dyn DynOptimizer) -> Result<&mut crate::optim::AdamW> {
    opt.as_any_mut()
        .downcast_mut::<crate::optim::AdamW>()
        .ok_or_else(|| {
            Error::Unsupported(
                "weight-decay groups over a sharded model need ddp_candle::optim::AdamW \
                 (ShardOptimizer::AdamW)"
                    .into(),
            )
        })
}

pub(crate) fn chunk_name(bucket: usize) -> String {
    format!("bucket{bucket}")
}

/// This rank's chunks (see the module doc).
pub(crate) struct Shard {
    pub layout: ShardLayout,
    /// One per chunk of `layout` (`None` for an empty chunk, or one written through).
    pub vars: Vec<Option<Var>>,
    /// Per chunk, once [`Shard::write_through`]: the id its gradient is keyed by and the pieces
    /// of the model's parameters that hold its values (no variable of its own then). Empty
    /// otherwise.
    through: Vec<Option<(TensorId, Vec<Piece>)>>,
}

impl Shard {
    /// The shard holding `values` (one per chunk of `layout`), and its named variables for the
    /// optimizer.
    pub fn new(layout: ShardLayout, values: Vec<Vec<f32>>) -> Result<(Shard, Vec<(String, Var)>)> {
        let mut vars = Vec::new();
        let mut named = Vec::new();
        for (c, v) in layout.chunks().iter().zip(values) {
            if c.is_empty() {
                vars.push(None);
                continue;
            }
            let var = Var::from_vec(v, c.len(), &Device::Cpu)?;
            named.push((chunk_name(c.bucket), var.clone()));
            vars.push(Some(var));
        }
        Ok((
            Shard {
                layout,
                vars,
                through: Vec::new(),
            },
            named,
        ))
    }

    /// A shard holding nothing (stage 0: plain DDP).
    pub fn empty(layout: ShardLayout) -> Shard {
        Shard {
            layout,
            vars: Vec::new(),
            through: Vec::new(),
        }
    }

    /// ZeRO stages 1/2 with the full model at hand: every chunk's values from now on live in
    /// the model's parameters `params` (in the layout's parameter order), which the optimizer
    /// updates in place through `retarget(chunk_name, pieces)`; the chunk variables are dropped
    /// (4Ψ/N bytes less per rank). The parameters must hold the chunks' values (they do after
    /// construction and after every all-gather).
    pub fn write_through(
        &mut self,
        params: &[(String, Var)],
        mut retarget: impl FnMut(&str, Vec<Piece>) -> Result<()>,
    ) -> Result<()> {
        let mut through = Vec::with_capacity(self.vars.len());
        let flat: Vec<Tensor> = params
            .iter()
            .map(|(_, v)| v.as_tensor().flatten_all())
            .collect::<candle_core::Result<_>>()?;
        for (c, var) in self.layout.chunks().iter().zip(&self.vars) {
            let Some(var) = var else {
                through.push(None);
                continue;
            };
            let pieces = self
                .layout
                .pieces(c)
                .into_iter()
                .map(|p| {
                    Ok(Piece {
                        view: flat[p.param].narrow(0, p.param_offset, p.len)?,
                        offset: p.chunk_offset,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            retarget(&chunk_name(c.bucket), pieces.clone())?;
            through.push(Some((var.id(), pieces)));
        }
        self.through = through;
        self.vars.iter_mut().for_each(|v| *v = None);
        Ok(())
    }

    /// Weight decay in `opt` (this crate's [`AdamW`](crate::optim::AdamW), else an error) on
    /// the elements of the parameters `decays(name, dims)` selects only, chunk by chunk
    /// (`ShardLayout::decay_runs`); `params` are the layout's parameters, in its order.
    pub fn set_weight_decay_filter(
        &self,
        opt: &mut dyn DynOptimizer,
        params: impl IntoIterator<Item = (String, Vec<usize>)>,
        decays: impl Fn(&str, &[usize]) -> bool,
    ) -> Result<()> {
        let flags: Vec<bool> = params.into_iter().map(|(n, d)| decays(&n, &d)).collect();
        let adamw = adamw(opt)?;
        if self.vars.is_empty() && self.through.is_empty() {
            return Ok(()); // stage 0: the caller's optimizer is over whole parameters
        }
        for (i, c) in self.layout.chunks().iter().enumerate() {
            if self.present(i) {
                adamw.set_decay_runs(&chunk_name(c.bucket), self.layout.decay_runs(c, &flags))?;
            }
        }
        Ok(())
    }

    fn through(&self, i: usize) -> Option<&(TensorId, Vec<Piece>)> {
        self.through.get(i).and_then(Option::as_ref)
    }

    /// Whether chunk `i` holds elements (a variable or pieces).
    fn present(&self, i: usize) -> bool {
        self.vars[i].is_some() || self.through(i).is_some()
    }

    /// The values of chunk `i` (empty for an empty chunk).
    pub fn chunk(&self, i: usize) -> Result<Vec<f32>> {
        if let Some((_, pieces)) = self.through(i) {
            let mut out = vec![0f32; self.layout.chunks()[i].len()];
            self.copy_pieces(pieces, &mut out)?;
            return Ok(out);
        }
        match &self.vars[i] {
            Some(v) => Ok(v.as_tensor().to_vec1::<f32>()?),
            None => Ok(Vec::new()),
        }
    }

    /// Copies the values of chunk `i` into `dst` (its length; nothing for an empty chunk).
    pub fn copy_chunk(&self, i: usize, dst: &mut [f32]) -> ddp_core::Result<()> {
        if let Some((_, pieces)) = self.through(i) {
            return self
                .copy_pieces(pieces, dst)
                .map_err(|e| ddp_core::Error::InvalidArgument(e.to_string()));
        }
        let Some(var) = &self.vars[i] else {
            return Ok(());
        };
        crate::tensors::with_flat::<f32, _>(var.as_tensor(), |s| {
            if s.len() == dst.len() {
                dst.copy_from_slice(s);
                Ok(())
            } else {
                Err(ddp_core::Error::InvalidArgument(format!(
                    "shard chunk {i} holds {} values, its block {}",
                    s.len(),
                    dst.len()
                )))
            }
        })
        .map_err(|e| ddp_core::Error::InvalidArgument(e.to_string()))?
    }

    fn copy_pieces(&self, pieces: &[Piece], dst: &mut [f32]) -> Result<()> {
        for p in pieces {
            crate::tensors::with_flat::<f32, _>(&p.view, |s| {
                dst[p.offset..p.offset + s.len()].copy_from_slice(s)
            })?;
        }
        Ok(())
    }

    /// The values of every chunk.
    pub fn values(&self) -> Result<Vec<Vec<f32>>> {
        (0..self.vars.len()).map(|i| self.chunk(i)).collect()
    }

    /// One optimizer step of the chunks with their averaged gradients (one per chunk; each
    /// gradient is a view of its buffer, not a copy).
    pub fn step(&self, opt: &mut dyn DynOptimizer, grads: ShardGrads) -> Result<()> {
        let mut store = GradStore::default();
        for (i, (g, range)) in grads.into_parts().into_iter().enumerate() {
            let key = match (&self.vars[i], self.through(i)) {
                (Some(var), _) => var.id(),
                (None, Some((key, _))) => *key,
                (None, None) => continue,
            };
            let n = g.len();
            let t = Tensor::from_vec(g, n, &Device::Cpu)?.narrow(0, range.start, range.len())?;
            store.insert_id(key, t);
        }
        opt.dyn_step(&store)?;
        Ok(())
    }

    /// A write-through step ([`Shard::write_through`]): `step` gets each chunk's averaged
    /// gradient as a slice of its buffer, by the chunk's key, and leaves the chunk's updated
    /// values there instead (see `optim::EchoGrads`). Returns the buffers, each with the range
    /// that is the chunk, which then holds this rank's block of the parameter all-gather.
    pub fn step_through(
        &self,
        grads: ShardGrads,
        step: impl FnOnce(&mut EchoGrads<'_>) -> Result<()>,
    ) -> Result<Vec<(Vec<f32>, std::ops::Range<usize>)>> {
        let mut parts = grads.into_parts();
        let mut map = EchoGrads::new();
        for (i, (g, range)) in parts.iter_mut().enumerate() {
            match self.through(i) {
                Some((key, _)) => {
                    map.insert(*key, &mut g[range.clone()]);
                }
                None if self.vars[i].is_some() => {
                    return Err(Error::Unsupported(format!(
                        "step_through: chunk {i} is not written through"
                    )))
                }
                None => {}
            }
        }
        step(&mut map)?;
        Ok(parts)
    }

    /// Parameter values and optimizer state of the chunks.
    pub fn state(&self, opt: &dyn DynOptimizer) -> Result<ShardState> {
        let state = opt.state_dict()?;
        let mut chunks = Vec::new();
        for (i, (c, values)) in self.layout.chunks().iter().zip(self.values()?).enumerate() {
            let mut cs = ChunkState {
                params: values,
                ..Default::default()
            };
            if self.present(i) {
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
            optimizer: OptimizerRecord {
                kind: state.kind,
                step: state.step,
                hyper: state.hyper,
            },
            chunks,
        })
    }

    /// Sets the chunks and the optimizer state from `state` (this rank's cut of a checkpoint).
    pub fn apply(&self, opt: &mut dyn DynOptimizer, state: ShardState) -> Result<()> {
        if !state.optimizer.kind.is_empty() && state.optimizer.kind != opt.kind() {
            return Err(Error::Ddp(ddp_core::Error::Mismatch(format!(
                "checkpoint holds {} optimizer state but the optimizer is {}",
                state.optimizer.kind,
                opt.kind()
            ))));
        }
        let mut dict = OptimizerStateDict::new(state.optimizer.kind.clone(), state.optimizer.step);
        dict.hyper = state.optimizer.hyper.clone();
        for (i, (c, cs)) in self.layout.chunks().iter().zip(&state.chunks).enumerate() {
            if !self.present(i) {
                continue;
            }
            for (slot, v) in &cs.slots {
                dict.tensors.insert(
                    OptimizerStateDict::key(&chunk_name(c.bucket), slot),
                    TensorData::new(vec![v.len()], v.clone())?,
                );
            }
        }
        opt.load_state_dict(&dict)?;
        for (i, cs) in state.chunks.into_iter().enumerate() {
            if let Some((_, pieces)) = self.through(i) {
                for p in pieces {
                    let n = p.view.elem_count();
                    let src = HostSlice::of(&cs.params[p.offset..p.offset + n]);
                    p.view.inplace_op1(&crate::params::CopyIn(src))?;
                }
            } else if let Some(var) = &self.vars[i] {
                let n = cs.params.len();
                var.set(&Tensor::from_vec(cs.params, n, &Device::Cpu)?)?;
            }
        }
        Ok(())
    }

    /// Saves a sharded checkpoint set in `dir` (a collective; see `ddp_core::sharding::sets`).
    pub fn save(
        &self,
        pg: &ProcessGroup,
        opt: &dyn DynOptimizer,
        specs: &[ParamSpec],
        dir: &Path,
        meta: &CheckpointMeta,
    ) -> Result<PathBuf> {
        // A failure to read the state on one rank fails every rank before anything is written.
        let state = self.state(opt).map_err(Error::into_ddp);
        Ok(sharding::save_agreed(
            pg,
            dir,
            &self.layout,
            specs,
            state,
            meta,
        )?)
    }

    /// [`save`](Self::save) written in the background by `saver` (see
    /// `ddp_core::sharding::AsyncSetSaver`): returns the outcome of the set it committed first.
    pub fn save_async(
        &self,
        saver: &mut ddp_core::sharding::AsyncSetSaver,
        pg: &ProcessGroup,
        opt: &dyn DynOptimizer,
        specs: &[ParamSpec],
        dir: &Path,
        meta: &CheckpointMeta,
    ) -> Result<Option<ddp_core::Result<PathBuf>>> {
        let state = self.state(opt).map_err(Error::into_ddp);
        Ok(saver.save(pg, dir, &self.layout, specs, state, meta)?)
    }

    /// This rank's cut of the current sharded set of `dir` (any world size, any stage), agreed
    /// over the ranks: an error on one is an error on all. Reads only.
    pub fn load(
        &self,
        pg: &ProcessGroup,
        specs: &[ParamSpec],
        dir: &Path,
    ) -> Result<Option<(ShardState, CheckpointMeta)>> {
        Ok(sharding::load_agreed(pg, dir, &self.layout, specs, Ok)?)
    }

    /// This rank's cut of a plain checkpoint, agreed over the ranks.
    pub fn import(
        &self,
        pg: &ProcessGroup,
        specs: &[ParamSpec],
        ckpt: &Checkpoint,
    ) -> Result<ShardState> {
        Ok(sharding::import_agreed(pg, ckpt, &self.layout, specs, Ok)?)
    }
}
