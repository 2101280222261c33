//! [`Fsdp`]: ZeRO stage 3 (FSDP-style parameter sharding) for candle models, on
//! `ddp_core::sharding::units`.
//!
//! The model is a sequence of [`Unit`]s (its layers or stages): each owns the parameters whose
//! names start with its prefixes and maps an input to an output, given its parameters through a
//! `VarBuilder`. Every rank keeps only its chunk of every unit (parameters, gradient, optimizer
//! state: 16Ψ/N bytes with fp32 AdamW); a unit's parameters exist in full only while it runs.
//!
//! candle's autograd keeps every op's inputs alive, so a forward whose graph is kept would keep
//! every gathered unit alive too. The forward therefore runs *without* a graph (the gathered
//! parameters are plain tensors) and keeps only each unit's input; the backward, last unit
//! first, gathers the unit again, recomputes its forward with a graph (parameters and input as
//! `Var`s) and differentiates the surrogate `(out * grad_out).sum()` exactly as the blockwise
//! backward ([`blockwise`](crate::blockwise)) does — the same ops on the same values, so the gradients
//! are bit-identical to a plain `loss.backward()` of the whole model.
//!
//! ```text
//!  forward    [gather u0]─►u0 (no graph)─►free   [gather u1]─►u1─►free ... [gather u(n-1)]
//!                 └──── u1's gather in flight ────┘ (prefetch)
//!  backward   u(n-1): fwd+graph, loss.backward ─► reduce-scatter grad (async) ─► free
//!             [u(n-2) gathered meanwhile] ─► recompute, surrogate backward ─► reduce-scatter ...
//!  step       the owner steps its chunks (Sgd, AdamW: element-wise); nothing is gathered
//! ```
//!
//! Memory per rank: the shards (16Ψ/N with AdamW), at most two gathered units (one at the
//! backward's peak with [`BackwardPrefetch::BackwardPost`] or without backward prefetch, at the
//! cost of overlap) and one unit's gradient (plus at most `ddp_core::sharding::units::MAX_SCATTERS_IN_FLIGHT` gradients waiting to
//! be reduce-scattered), the units' inputs (activations) and one unit's graph. Communication: the
//! all-gathers (every unit in forward, all but the last again in backward) and the gradient
//! reduce-scatters, at most 1.5× DDP's all-reduce ([`Fsdp::bytes_per_step`]).
//!
//! ```no_run
//! # use candle_core::{DType, Device, Module, Tensor};
//! # use candle_nn::ParamsAdamW;
//! # use ddp_candle::{optim::AdamW, Fsdp, Unit};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let pg = ddp_comm::init_process_group(Default::default())?;
//! # let varmap = candle_nn::VarMap::new();
//! # let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! # candle_nn::linear(64, 128, vb.pp("l1"))?;
//! # candle_nn::linear(128, 10, vb.pp("l2"))?;
//! # let batches: Vec<(Tensor, Tensor)> = Vec::new();
//! # let (dir, meta) = (std::path::Path::new("/tmp/ckpt"), ddp_core::CheckpointMeta::default());
//! let units = vec![
//!     Unit::new(["l1"], |vb, x| candle_nn::linear(64, 128, vb.pp("l1"))?.forward(x)?.relu()),
//!     Unit::new(["l2"], |vb, x| candle_nn::linear(128, 10, vb.pp("l2"))?.forward(x)),
//! ];
//! let mut fsdp = Fsdp::from_varmap(&varmap, units, &pg, |vars| {
//!     Ok(Box::new(AdamW::new_named(vars, ParamsAdamW::default())?))
//! })?;
//! drop(varmap); // the full parameters are not needed any more
//! for (x, y) in batches {
//!     fsdp.forward_backward(&x, |logits| candle_nn::loss::cross_entropy(logits, &y))?;
//!     fsdp.clip_grad_norm(1.0)?; // optional
//!     fsdp.step()?;
//! }
//! fsdp.save(dir, &meta)?; // the sets of stages 1 and 2: loads at any world size and stage
//! # Ok(())
//! # }
//! ```
//!
//! `no_sync` accumulates each unit's local gradient in full (as PyTorch's FSDP does; parameters
//! are still gathered, no gradient is sent); `Join` shadow ranks take part in every gather and
//! reduce-scatter with zero gradients ([`Fsdp::forward_backward_join`]). Parameters must be f32
//! on the CPU.

use crate::optim::DynOptimizer;
use crate::params::CandleParams;
use crate::shard::Shard;
use crate::{nn, tensors, Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarBuilder;
use ddp_comm::ProcessGroup;
use ddp_core::adapter::{self, ParamAccess};
use ddp_core::checkpoint::{Checkpoint, CheckpointMeta};
use ddp_core::join::{Join, JoinStep};
use ddp_core::reducer::{verify_param_specs, ParamSpec, StepStats, TotalStats};
use ddp_core::sharding::{self, ShardGrads, ShardLayout, ShardState, UnitComm};
use ddp_core::verify::ReplicaReport;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

type UnitForward = dyn Fn(VarBuilder<'_>, &Tensor) -> candle_core::Result<Tensor> + Send + Sync;

/// One unit of a stage-3 model: the parameters it owns (by name prefix) and its forward.
pub struct Unit {
    prefixes: Vec<String>,
    forward: Box<UnitForward>,
}

impl Unit {
    /// A unit owning every parameter named `p` or `p.<...>` for a `p` in `prefixes`; `forward`
    /// maps the unit's input to its output, reading its parameters from the `VarBuilder` under
    /// their full names (e.g. `candle_nn::linear(i, o, vb.pp("l1"))`). It must use only its own
    /// parameters and be deterministic (it runs twice per step).
    pub fn new<S: Into<String>>(
        prefixes: impl IntoIterator<Item = S>,
        forward: impl Fn(VarBuilder<'_>, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    ) -> Unit {
        Unit {
            prefixes: prefixes.into_iter().map(Into::into).collect(),
            forward: Box::new(forward),
        }
    }

    fn owns(&self, name: &str) -> bool {
        self.prefixes.iter().any(|p| {
            name == p
                || name
                    .strip_prefix(p.as_str())
                    .is_some_and(|r| r.starts_with('.'))
        })
    }
}

/// What [`Fsdp::forward_backward`] returns.
#[derive(Debug)]
pub struct FsdpOutput {
    /// The local loss (detached).
    pub loss: Tensor,
    /// The last unit's output (detached), e.g. logits for accuracy.
    pub output: Tensor,
    /// Timing; `bytes` counts the gradient reduce-scatters only (0 under `no_sync`), the
    /// parameter gathers are in [`Fsdp::bytes_per_step`].
    pub stats: StepStats,
}

/// When the backward starts gathering the next unit (the one before, in model order), as
/// PyTorch FSDP's `backward_prefetch`: the gather then overlaps this unit's work instead of
/// waiting at the next unit's start, at the cost of holding two gathered units at once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackwardPrefetch {
    /// Before this unit's recomputation and gradient (the default, as PyTorch's
    /// `BACKWARD_PRE`): the gather overlaps the unit's whole backward, and the next unit's
    /// parameters are alive next to this unit's gradient computation, the peak.
    #[default]
    BackwardPre,
    /// After this unit's gradient is computed (PyTorch's `BACKWARD_POST`): the gather overlaps
    /// only the gradient's copy and reduce-scatter start, and the peak holds one gathered unit
    /// fewer (one unit's size less memory, for less overlap).
    BackwardPost,
}

/// ZeRO stage 3 (see the module doc).
pub struct Fsdp {
    pg: ProcessGroup,
    names: Vec<String>,
    specs: Vec<ParamSpec>,
    units: Vec<Unit>,
    shard: Shard,
    opt: Box<dyn DynOptimizer>,
    /// This rank's averaged gradient chunks after a synchronized backward.
    grads: Option<ShardGrads>,
    /// Under `no_sync`: each unit's local gradient, accumulated in full.
    accum: Option<Vec<Vec<f32>>>,
    sync: bool,
    /// `None`: each unit's gather starts when the backward reaches it (no overlap).
    backward_prefetch: Option<BackwardPrefetch>,
    last: Option<StepStats>,
    totals: TotalStats,
}

impl Fsdp {
    /// [`new`](Self::new) over every variable of `varmap`.
    pub fn from_varmap(
        varmap: &candle_nn::VarMap,
        units: Vec<Unit>,
        pg: &ProcessGroup,
        make_opt: impl FnOnce(Vec<(String, Var)>) -> Result<Box<dyn DynOptimizer>>,
    ) -> Result<Self> {
        let vars = CandleParams::from_varmap(varmap)?.vars().to_vec();
        Self::new(vars, units, pg, make_opt)
    }

    /// Builds the model one unit at a time, never whole (as FSDP's deferred initialization):
    /// `init(u, vb)` creates unit `u`'s parameters through `vb` (a builder over a fresh
    /// `VarMap`, e.g. `candle_nn::linear(i, o, vb.pp("l1"))`), each rank keeps its chunk of
    /// rank 0's values and the unit is dropped before the next is built, so construction holds
    /// the shards plus one unit. Every parameter `init(u, ..)` creates must belong to unit `u`
    /// (an error names it); each unit's names, shapes and dtypes are checked across ranks
    /// before its values are sent. Equal to [`from_varmap`](Self::from_varmap) over the same
    /// variables (the same order and layout). A collective.
    pub fn from_unit_init(
        units: Vec<Unit>,
        pg: &ProcessGroup,
        mut init: impl FnMut(usize, VarBuilder<'_>) -> candle_core::Result<()>,
        make_opt: impl FnOnce(Vec<(String, Var)>) -> Result<Box<dyn DynOptimizer>>,
    ) -> Result<Self> {
        let (world, rank) = (pg.size(), pg.rank());
        let mut unit_specs = Vec::with_capacity(units.len());
        let mut values = Vec::with_capacity(units.len());
        for (u, unit) in units.iter().enumerate() {
            let vm = candle_nn::VarMap::new();
            init(u, VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu))?;
            let params = CandleParams::from_varmap(&vm)?;
            drop(vm);
            if let Some((name, _)) = params.vars().iter().find(|(n, _)| !unit.owns(n)) {
                return Err(Error::Unsupported(format!(
                    "ZeRO stage 3: unit {u}'s init created `{name}`, which is not among its \
                     prefixes {:?}",
                    unit.prefixes
                )));
            }
            if !params.device()?.is_cpu() {
                return Err(Error::Unsupported(
                    "ZeRO stage 3 keeps its shards in host memory: the parameters must be on \
                     the CPU"
                        .into(),
                ));
            }
            let specs = adapter::param_specs(&params)?;
            verify_param_specs(pg, &specs)?;
            let one = sharding::unit_layout(&specs, &[(0..specs.len()).collect()], world, rank)?;
            values.push(rank0_chunk(
                pg,
                &params,
                &one.buckets()[0],
                &one.chunks()[0],
            )?);
            unit_specs.push(specs);
        }
        // The registration order of `new`: every parameter sorted by name. A unit's slots
        // keep their order (sorted within the unit), so the chunks cut above are the layout's.
        let mut specs: Vec<ParamSpec> = unit_specs.iter().flatten().cloned().collect();
        specs.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = specs.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(Error::Unsupported(format!(
                "ZeRO stage 3: parameter `{}` is created by two units",
                w[0].name
            )));
        }
        let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
        let lists: Vec<Vec<usize>> = units
            .iter()
            .map(|u| (0..names.len()).filter(|&p| u.owns(&names[p])).collect())
            .collect();
        let layout = sharding::unit_layout(&specs, &lists, world, rank)?;
        for ((b, us), c) in layout.buckets().iter().zip(&unit_specs).zip(&values) {
            debug_assert_eq!(b.slots.len(), us.len());
            debug_assert_eq!(b.owned(world, rank).1 - b.owned(world, rank).0, c.len());
        }
        Self::assemble(pg, names, specs, units, layout, values, make_opt)
    }

    /// Shards the named variables over the ranks of `pg` along `units` (every parameter in
    /// exactly one unit; an error names the first that is not). Checks that every rank has the
    /// same parameters and takes rank 0's values (as DDP does); `make_opt` builds the optimizer
    /// over this rank's chunk variables. The given variables are not referenced afterwards: drop
    /// them to free the full model. A collective.
    pub fn new(
        vars: impl IntoIterator<Item = (String, Var)>,
        units: Vec<Unit>,
        pg: &ProcessGroup,
        make_opt: impl FnOnce(Vec<(String, Var)>) -> Result<Box<dyn DynOptimizer>>,
    ) -> Result<Self> {
        let params = CandleParams::new(vars);
        if !params.device()?.is_cpu() {
            return Err(Error::Unsupported(
                "ZeRO stage 3 keeps its shards in host memory: the parameters must be on the CPU"
                    .into(),
            ));
        }
        let specs = adapter::param_specs(&params)?;
        ddp_core::reducer::require_trainable(&specs)?;
        verify_param_specs(pg, &specs)?;
        let names: Vec<String> = params.vars().iter().map(|(n, _)| n.clone()).collect();
        let lists: Vec<Vec<usize>> = units
            .iter()
            .map(|u| (0..names.len()).filter(|&p| u.owns(&names[p])).collect())
            .collect();
        let layout = sharding::unit_layout(&specs, &lists, pg.size(), pg.rank())?;
        // Rank 0's values, one parameter at a time (never a second copy of the whole model):
        // each rank keeps the part that falls in its chunks.
        let mut values = Vec::with_capacity(lists.len());
        for (c, b) in layout.chunks().iter().zip(layout.buckets()) {
            values.push(rank0_chunk(pg, &params, b, c)?);
        }
        drop(params);
        Self::assemble(pg, names, specs, units, layout, values, make_opt)
    }

    fn assemble(
        pg: &ProcessGroup,
        names: Vec<String>,
        specs: Vec<ParamSpec>,
        units: Vec<Unit>,
        layout: ShardLayout,
        values: Vec<Vec<f32>>,
        make_opt: impl FnOnce(Vec<(String, Var)>) -> Result<Box<dyn DynOptimizer>>,
    ) -> Result<Self> {
        let (shard, named) = Shard::new(layout, values)?;
        let opt = make_opt(named)?;
        Ok(Fsdp {
            pg: pg.clone(),
            names,
            specs,
            units,
            shard,
            opt,
            grads: None,
            accum: None,
            sync: true,
            backward_prefetch: Some(BackwardPrefetch::BackwardPre),
            last: None,
            totals: TotalStats::default(),
        })
    }

    /// Weight decay on the parameters `decays(name, dims)` selects only, the others stepped
    /// without (PyTorch's parameter groups; nanoGPT decays `dims.len() >= 2`): a chunk that
    /// spans both kinds decays only the former's elements. Needs this crate's
    /// [`AdamW`](crate::optim::AdamW) as the optimizer; the same on every rank.
    pub fn set_weight_decay_filter(
        &mut self,
        decays: impl Fn(&str, &[usize]) -> bool,
    ) -> Result<()> {
        let params = self.specs.iter().map(|s| (s.name.clone(), s.shape.clone()));
        self.shard
            .set_weight_decay_filter(&mut *self.opt, params, decays)
    }

    /// Which elements of which unit this rank owns (one bucket per unit).
    pub fn layout(&self) -> &ShardLayout {
        &self.shard.layout
    }

    /// This rank's chunk variables, one per unit (`None` for an empty chunk).
    pub fn shard_vars(&self) -> &[Option<Var>] {
        &self.shard.vars
    }

    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Parameter names in registration (sorted) order.
    pub fn param_names(&self) -> &[String] {
        &self.names
    }

    pub fn optimizer(&self) -> &(dyn DynOptimizer + 'static) {
        &*self.opt
    }

    pub fn optimizer_mut(&mut self) -> &mut (dyn DynOptimizer + 'static) {
        &mut *self.opt
    }

    /// Bytes this rank sends per synchronized step (ring model): the forward and backward
    /// parameter gathers and the gradient reduce-scatters.
    pub fn bytes_per_step(&self) -> u64 {
        sharding::stage3_bytes_per_step(&self.shard.layout)
    }

    /// The largest unit, in elements (it is gathered in full, with its gradient).
    pub fn largest_unit_numel(&self) -> usize {
        let b = self.shard.layout.buckets();
        b.iter().map(|b| b.numel).max().unwrap_or(0)
    }

    /// Timing of the last backward.
    pub fn last_step_stats(&self) -> Option<StepStats> {
        self.last
    }

    /// Sums over the synchronized steps since construction; `bytes` counts everything sent
    /// (gathers and reduce-scatters, ring model).
    pub fn total_stats(&self) -> TotalStats {
        self.totals
    }

    /// PyTorch's `no_sync`: while `sync` is false, backwards accumulate each unit's local
    /// gradient (in full) and send no gradient; the next synchronized backward reduce-scatters
    /// the sum. Do not step until then.
    pub fn set_require_backward_grad_sync(&mut self, sync: bool) {
        self.sync = sync;
    }

    /// When the backward prefetches the next unit's parameters (see [`BackwardPrefetch`];
    /// `None`: not at all, each gather waited for where it is needed). Every rank must use the
    /// same setting (it orders the collectives). Values are the same for every setting.
    pub fn set_backward_prefetch(&mut self, prefetch: Option<BackwardPrefetch>) {
        self.backward_prefetch = prefetch;
    }

    /// The current [`set_backward_prefetch`](Self::set_backward_prefetch) setting.
    pub fn backward_prefetch(&self) -> Option<BackwardPrefetch> {
        self.backward_prefetch
    }

    /// Forward and backward of one batch (see the module doc); the gradients are averaged over
    /// the ranks into this rank's chunks (unless under `no_sync`). A collective.
    pub fn forward_backward<L>(&mut self, input: &Tensor, loss_fn: L) -> Result<FsdpOutput>
    where
        L: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    {
        let (out, stats) = self.run(Some((input, loss_fn)), self.pg.size())?;
        let (loss, output) = out.expect("a batch gives a loss");
        Ok(FsdpOutput {
            loss,
            output,
            stats,
        })
    }

    /// [`forward_backward`](Self::forward_backward) under [`Join`] (uneven inputs): `batch` is
    /// `None` once this rank has run out of data; it then takes part in every gather and
    /// reduce-scatter with zero gradients, and the gradients are averaged over the ranks that
    /// had data. Step on every rank afterwards. Returns the loss and output when there was a
    /// batch.
    pub fn forward_backward_join<L>(
        &mut self,
        batch: Option<(&Tensor, L)>,
        join: &Join,
        step: &JoinStep,
    ) -> Result<(Option<(Tensor, Tensor)>, StepStats)>
    where
        L: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    {
        if batch.is_some() != step.has_data {
            return Err(Error::Unsupported(format!(
                "forward_backward_join on rank {}: has_data = {} but {} batch given",
                self.pg.rank(),
                step.has_data,
                if batch.is_some() { "a" } else { "no" }
            )));
        }
        if join.is_done() {
            return Err(Error::Unsupported(
                "forward_backward_join: the Join loop is over".into(),
            ));
        }
        if !self.sync {
            return Err(Error::Unsupported(
                "ZeRO stage 3: Join with no_sync is not supported (synchronize every Join step)"
                    .into(),
            ));
        }
        self.run(batch, step.divisor)
    }

    /// Unit `u`'s parameters as `(name, tensor)` views into its flat values `flat`.
    fn views(&self, u: usize, flat: &Tensor) -> Result<HashMap<String, Tensor>> {
        let b = &self.shard.layout.buckets()[u];
        let mut out = HashMap::with_capacity(b.slots.len());
        for s in &b.slots {
            let t = flat
                .narrow(0, s.offset, s.numel)?
                .reshape(self.specs[s.param].shape.as_slice())?;
            out.insert(self.names[s.param].clone(), t);
        }
        Ok(out)
    }

    fn unit_forward(
        &self,
        u: usize,
        params: HashMap<String, Tensor>,
        x: &Tensor,
    ) -> Result<Tensor> {
        let vb = VarBuilder::from_tensors(params, DType::F32, &Device::Cpu);
        Ok((self.units[u].forward)(vb, x)?)
    }

    /// Unit `u`'s gathered values `flat` as one variable per parameter (in slot order): the
    /// largest parameter keeps `flat`'s allocation (moved to its front and cut), the others are
    /// copied out first, so the unit is never held twice.
    fn unit_vars(&self, u: usize, mut flat: Vec<f32>) -> Result<Vec<Var>> {
        let slots = &self.shard.layout.buckets()[u].slots;
        let big = (0..slots.len())
            .max_by_key(|&i| slots[i].numel)
            .unwrap_or(0);
        let shape = |i: usize| self.specs[slots[i].param].shape.as_slice();
        let mut vars: Vec<Option<Var>> = Vec::with_capacity(slots.len());
        for (i, s) in slots.iter().enumerate() {
            vars.push(match i == big {
                true => None,
                false => Some(Var::from_slice(
                    &flat[s.offset..s.offset + s.numel],
                    shape(i),
                    &Device::Cpu,
                )?),
            });
        }
        if let Some(s) = slots.get(big) {
            flat.truncate(s.offset + s.numel);
            flat.drain(..s.offset);
            flat.shrink_to_fit();
            vars[big] = Some(Var::from_vec(flat, shape(big), &Device::Cpu)?);
        }
        Ok(vars.into_iter().flatten().collect())
    }

    /// `(name, tensor)` of unit `u`'s per-parameter variables, for its forward.
    fn var_tensors(&self, u: usize, vars: &[Var]) -> HashMap<String, Tensor> {
        let slots = &self.shard.layout.buckets()[u].slots;
        slots
            .iter()
            .zip(vars)
            .map(|(s, v)| (self.names[s.param].clone(), v.as_tensor().clone()))
            .collect()
    }

    /// Unit `u`'s flat gradient (slot order) from its parameters' gradients `pieces`, each freed
    /// once copied; a parameter without one (unused) counts as zero.
    fn flat_grad(&self, u: usize, pieces: Vec<Option<Tensor>>) -> Result<Vec<f32>> {
        let b = &self.shard.layout.buckets()[u];
        let mut flat = Vec::with_capacity(b.numel);
        for (s, g) in b.slots.iter().zip(pieces) {
            debug_assert_eq!(flat.len(), s.offset, "slots are contiguous, in order");
            match g {
                Some(g) => tensors::with_flat::<f32, _>(&g, |x| flat.extend_from_slice(x))?,
                None => flat.resize(s.offset + s.numel, 0.0),
            }
        }
        Ok(flat)
    }

    /// One step's forward and backward; `batch` is `None` for a Join shadow rank.
    #[allow(clippy::type_complexity)]
    fn run<L>(
        &mut self,
        batch: Option<(&Tensor, L)>,
        divisor: usize,
    ) -> Result<(Option<(Tensor, Tensor)>, StepStats)>
    where
        L: FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    {
        let start = Instant::now();
        let n = self.units.len();
        if n == 0 {
            return Err(Error::Unsupported(
                "ZeRO stage 3 needs at least one unit".into(),
            ));
        }
        let wait = std::cell::Cell::new(Duration::ZERO);
        let timed = |t: Instant| wait.set(wait.get() + t.elapsed());
        let (mut x, loss_fn) = match batch {
            Some((x, l)) => (Some(x.clone()), Some(l)),
            None => (None, None),
        };
        let shard = &self.shard;
        let numel = |u: usize| shard.layout.buckets()[u].numel;
        let mut comm = UnitComm::new(&self.pg, &shard.layout, divisor)?;
        let gathered = |comm: &mut UnitComm, u: usize| -> Result<Vec<f32>> {
            let t = Instant::now();
            let v = comm.gathered(u)?;
            timed(t);
            Ok(v)
        };
        // Forward of every unit but the last, without a graph; only the inputs are kept.
        let mut inputs: Vec<Tensor> = Vec::with_capacity(n);
        comm.prefetch(0, shard.chunk(0)?)?;
        for u in 0..n - 1 {
            let v = gathered(&mut comm, u)?;
            comm.prefetch(u + 1, shard.chunk(u + 1)?)?;
            if let Some(xu) = x.take() {
                let flat = Tensor::from_vec(v, numel(u), &Device::Cpu)?;
                let out = self.unit_forward(u, self.views(u, &flat)?, &xu)?.detach();
                inputs.push(xu);
                x = Some(out);
            }
        }
        if let Some(xu) = x.take() {
            inputs.push(xu);
        }
        // Backward, last unit first: gather again (the last unit is still in flight from the
        // forward), recompute with a graph, reduce-scatter the unit's gradient at once.
        let mut loss_fn = loss_fn;
        let mut grad_out: Option<Tensor> = None;
        let mut result = None;
        let mut accum = self.accum.take();
        let prefetch = self.backward_prefetch;
        let prefetch_at = |when: BackwardPrefetch, comm: &mut UnitComm, u: usize| -> Result<()> {
            if u > 0 && prefetch == Some(when) {
                comm.prefetch(u - 1, shard.chunk(u - 1)?)?;
            }
            Ok(())
        };
        for u in (0..n).rev() {
            if !comm.in_flight(u) {
                comm.prefetch(u, shard.chunk(u)?)?;
            }
            let v = gathered(&mut comm, u)?;
            prefetch_at(BackwardPrefetch::BackwardPre, &mut comm, u)?;
            let numel = numel(u);
            let mut grad = match inputs.get(u) {
                Some(xu) => {
                    // One variable per parameter (not views of one flat variable, whose
                    // backward would widen every parameter's gradient to the unit's size).
                    let vars = self.unit_vars(u, v)?;
                    let input = (u > 0).then(|| Var::from_tensor(xu)).transpose()?;
                    let xin = input.as_ref().map_or(xu, Var::as_tensor);
                    // The weights' gradients come straight from `ddp_candle::nn::Linear`
                    // where the unit uses it (candle's GradStore would hold each twice).
                    let weights: Vec<&Tensor> = vars.iter().map(Var::as_tensor).collect();
                    let upstream = grad_out.take();
                    let (grads, captured) = nn::capture_grads(&weights, || -> Result<_> {
                        let out = self.unit_forward(u, self.var_tensors(u, &vars), xin)?;
                        Ok(if u == n - 1 {
                            let l = loss_fn.take().expect("the last unit runs once");
                            let loss = l(&out)?;
                            let g = loss.backward()?;
                            result = Some((loss.detach(), out.detach()));
                            g
                        } else {
                            match upstream {
                                Some(g) => (&out * g.detach())?.sum_all()?.backward()?,
                                // The later unit ignored its input: nothing reaches this one.
                                None => GradStore::default(),
                            }
                        })
                    })?;
                    let mut grads = grads?;
                    grad_out = input.and_then(|v| grads.remove(v.as_tensor()));
                    let pieces = captured
                        .into_iter()
                        .zip(&weights)
                        .map(|(c, w)| nn::merge_captured(c, grads.remove(w)))
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    // The unit's values are not needed for its flat gradient: free them first.
                    drop((grads, weights));
                    drop(vars);
                    self.flat_grad(u, pieces)?
                }
                None => vec![0.0; numel],
            };
            prefetch_at(BackwardPrefetch::BackwardPost, &mut comm, u)?;
            if let Some(acc) = &mut accum {
                for (g, a) in grad.iter_mut().zip(&acc[u]) {
                    *g += *a;
                }
            }
            if self.sync {
                // Waits for the oldest reduce-scatter if too many are in flight.
                let t = Instant::now();
                comm.reduce_scatter(u, grad)?;
                timed(t);
            } else {
                let acc = accum.get_or_insert_with(|| vec![Vec::new(); n]);
                acc[u] = grad;
            }
        }
        let t = Instant::now();
        let stats = if self.sync {
            let chunks = comm.finish()?;
            self.grads = Some(ShardGrads::from_chunks(chunks));
            self.accum = None;
            StepStats {
                synced: true,
                total: Duration::ZERO,
                comm_wait: Duration::ZERO,
                buckets: n,
                bytes: self.grad_bytes(),
            }
        } else {
            drop(comm);
            self.grads = None;
            self.accum = accum;
            StepStats {
                synced: false,
                ..Default::default()
            }
        };
        timed(t);
        let stats = StepStats {
            total: start.elapsed(),
            comm_wait: wait.get(),
            ..stats
        };
        self.last = Some(stats);
        if stats.synced {
            self.totals.steps += 1;
            self.totals.total += stats.total;
            self.totals.comm_wait += stats.comm_wait;
            self.totals.bytes += self.bytes_per_step();
        }
        Ok((result, stats))
    }

    /// Bytes of one gradient reduce-scatter of every unit (ring model, padded chunks).
    fn grad_bytes(&self) -> usize {
        let l = &self.shard.layout;
        let w = l.world_size();
        l.buckets()
            .iter()
            .map(|b| b.chunk_len(w) * 4 * (w - 1))
            .sum()
    }

    /// Inference: the forward of every unit, each gathered (the next one prefetched) and freed
    /// in turn, no graph. A collective (every rank must call it, e.g. on its own batch).
    pub fn forward(&self, input: &Tensor) -> Result<Tensor> {
        let n = self.units.len();
        let mut comm = UnitComm::new(&self.pg, &self.shard.layout, self.pg.size())?;
        comm.prefetch(0, self.shard.chunk(0)?)?;
        let mut x = input.clone();
        for u in 0..n {
            let v = comm.gathered(u)?;
            if u + 1 < n {
                comm.prefetch(u + 1, self.shard.chunk(u + 1)?)?;
            }
            let flat = Tensor::from_vec(v, self.shard.layout.buckets()[u].numel, &Device::Cpu)?;
            x = self.unit_forward(u, self.views(u, &flat)?, &x)?.detach();
        }
        Ok(x)
    }

    /// Every parameter in full, `(name, values)` in registration order: all units gathered (a
    /// collective; for checks and exports, it holds the whole model).
    pub fn full_params(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out: Vec<Option<Tensor>> = vec![None; self.names.len()];
        sharding::gather_params(
            &self.pg,
            &self.shard.layout,
            self.shard.values()?,
            |p, v| {
                let t = Tensor::from_slice(v, self.specs[p].shape.as_slice(), &Device::Cpu)
                    .map_err(|e| ddp_core::Error::InvalidArgument(e.to_string()))?;
                out[p] = Some(t);
                Ok(())
            },
        )?;
        Ok(self
            .names
            .iter()
            .cloned()
            .zip(
                out.into_iter()
                    .map(|t| t.expect("every parameter is in a unit")),
            )
            .collect())
    }

    /// Checks across ranks that the parameters every rank gathers are bit-identical (a
    /// collective; see `ddp_core::verify`).
    pub fn verify_replicas(&self) -> Result<ReplicaReport> {
        let vars: Vec<Var> = self
            .full_params()?
            .into_iter()
            .map(|(_, t)| Var::from_tensor(&t))
            .collect::<candle_core::Result<_>>()?;
        let refs: Vec<&Var> = vars.iter().collect();
        tensors::verify_replicas(&self.pg, &refs)
    }

    /// Largest absolute difference of any parameter element between any two ranks' gathered
    /// parameters, checked unit by unit (never more than one unit in full; a collective).
    pub fn replica_max_diff(&self) -> Result<f64> {
        let n = self.units.len();
        let mut comm = UnitComm::new(&self.pg, &self.shard.layout, self.pg.size())?;
        let mut max = 0f64;
        for u in 0..n {
            comm.prefetch(u, self.shard.chunk(u)?)?;
            let v = comm.gathered(u)?;
            let vars: Vec<Var> = comm
                .split(u, &v)
                .into_iter()
                .map(|(_, s)| Var::from_slice(s, s.len(), &Device::Cpu))
                .collect::<candle_core::Result<_>>()?;
            let refs: Vec<&Var> = vars.iter().collect();
            max = max.max(tensors::verify_replicas(&self.pg, &refs)?.max_abs_diff);
        }
        Ok(max)
    }

    fn no_grads(&self, what: &str) -> Error {
        Error::Unsupported(format!(
            "{what} on rank {}: no averaged gradients (call forward_backward first, outside \
             no_sync)",
            self.pg.rank()
        ))
    }

    /// PyTorch's `clip_grad_norm_` over the sharded gradients (the global norm is all-reduced);
    /// returns the norm before clipping. After a synchronized backward. A collective.
    pub fn clip_grad_norm(&mut self, max_norm: f64) -> Result<f64> {
        let Some(g) = &mut self.grads else {
            return Err(self.no_grads("clip_grad_norm"));
        };
        Ok(sharding::clip_grad_norm(&self.pg, g, max_norm)?)
    }

    /// The optimizer step of this rank's chunks. Nothing is communicated: the next forward
    /// gathers the updated units.
    pub fn step(&mut self) -> Result<()> {
        let grads = self.grads.take().ok_or_else(|| self.no_grads("step"))?;
        self.shard.step(&mut *self.opt, grads)
    }

    /// This rank's shard: parameter values and optimizer state of its chunks.
    pub fn shard_state(&self) -> Result<ShardState> {
        self.shard.state(&*self.opt)
    }

    /// Saves a sharded checkpoint set in `dir` (a collective): the format of stages 1 and 2, in
    /// parameter space, so it loads at any world size and any sharded stage.
    pub fn save(&self, dir: &Path, meta: &CheckpointMeta) -> Result<PathBuf> {
        self.shard
            .save(&self.pg, &*self.opt, &self.specs, dir, meta)
    }

    /// [`save`](Self::save) in the background (see `ZeroDdp::save_async` and
    /// `ddp_core::sharding::AsyncSetSaver`).
    pub fn save_async(
        &self,
        saver: &mut ddp_core::sharding::AsyncSetSaver,
        dir: &Path,
        meta: &CheckpointMeta,
    ) -> Result<Option<ddp_core::Result<PathBuf>>> {
        self.shard
            .save_async(saver, &self.pg, &*self.opt, &self.specs, dir, meta)
    }

    /// Loads the current sharded set of `dir` (saved at any world size by any sharded stage),
    /// re-cut for this layout (a collective). `Ok(None)` when there is none; on any error on any
    /// rank nothing is changed on any rank.
    pub fn load(&mut self, dir: &Path) -> Result<Option<CheckpointMeta>> {
        let Some((state, meta)) = self.shard.load(&self.pg, &self.specs, dir)? else {
            return Ok(None);
        };
        self.apply(state)?;
        Ok(Some(meta))
    }

    /// Takes this rank's shard of a plain checkpoint (DDP's, or `ddp_core::sharding::consolidate`'s):
    /// parameters and optimizer state (a collective).
    pub fn import(&mut self, ckpt: &Checkpoint) -> Result<()> {
        let state = self.shard.import(&self.pg, &self.specs, ckpt)?;
        self.apply(state)
    }

    fn apply(&mut self, state: ShardState) -> Result<()> {
        self.shard.apply(&mut *self.opt, state)?;
        self.grads = None;
        self.accum = None;
        Ok(())
    }
}

/// This rank's chunk `c` of bucket `b` (whose slots index `params`), from rank 0's values
/// broadcast one parameter at a time.
fn rank0_chunk(
    pg: &ProcessGroup,
    params: &CandleParams,
    b: &sharding::ShardBucket,
    c: &sharding::Chunk,
) -> Result<Vec<f32>> {
    let mut out = vec![0f32; c.len()];
    for s in &b.slots {
        let mut v = params
            .read_param(s.param)?
            .as_slice::<f32>()
            .map(<[f32]>::to_vec)
            .ok_or_else(|| {
                Error::Unsupported(format!(
                    "parameter `{}` is not f32",
                    params.vars()[s.param].0
                ))
            })?;
        pg.broadcast(&mut v, 0)?;
        let (lo, hi) = (c.lo.max(s.offset), c.hi.min(s.offset + s.numel));
        if lo < hi {
            out[lo - c.lo..hi - c.lo].copy_from_slice(&v[lo - s.offset..hi - s.offset]);
        }
    }
    Ok(out)
}
