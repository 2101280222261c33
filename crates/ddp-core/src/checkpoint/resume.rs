//! Optimizer state ([`OptimizerState`]) and resuming a run ([`resume_or_start`], [`RunPlan`]),
//! shared by every framework adapter.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ddp_comm::ProcessGroup;
use serde::{Deserialize, Serialize};

use super::integrity::{ensure_writable, MAX_COUNT};
use super::{checkpoint_path, load, Checkpoint, CheckpointMeta, TensorData, OPTIM_PREFIX};
use crate::error::{Error, Result};
use crate::sampler::SamplerState;

/// The scalars of an optimizer's state, stored in the checkpoint metadata under `"optimizer"`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OptimizerRecord {
    /// The algorithm (`"sgd"`, `"adamw"`, ...), checked when the state is loaded.
    pub kind: String,
    /// Optimizer steps taken.
    pub step: u64,
    /// Hyper-parameters at save time (for the record: loading keeps the optimizer's own).
    #[serde(default)]
    pub hyper: BTreeMap<String, f64>,
}

/// An optimizer's whole state in host memory, independent of any framework: what
/// [`OptimizerState`] produces and restores.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OptimizerStateDict {
    /// The algorithm; empty when read from a checkpoint of format version 1 (no record).
    pub kind: String,
    /// Optimizer steps taken.
    pub step: u64,
    /// Scalar hyper-parameters (learning rate, betas, ...), finite.
    pub hyper: BTreeMap<String, f64>,
    /// State tensors keyed `<param>.<slot>` (PyTorch's slot names: `momentum_buffer`, `exp_avg`,
    /// ...); stored in the checkpoint as `optim.<param>.<slot>`.
    pub tensors: BTreeMap<String, TensorData>,
}

impl OptimizerStateDict {
    /// An empty state of algorithm `kind` after `step` steps.
    pub fn new(kind: impl Into<String>, step: u64) -> Self {
        Self {
            kind: kind.into(),
            step,
            ..Default::default()
        }
    }

    /// The same state with hyper-parameters `pairs` recorded (name, value), PyTorch's names.
    pub fn with_hyper<'a>(mut self, pairs: impl IntoIterator<Item = (&'a str, f64)>) -> Self {
        self.hyper
            .extend(pairs.into_iter().map(|(k, v)| (k.to_string(), v)));
        self
    }

    /// The key of state `slot` of parameter `param`: `<param>.<slot>`.
    pub fn key(param: &str, slot: &str) -> String {
        format!("{param}.{slot}")
    }

    /// Adds state `slot` of parameter `param`, checking its shape against its data.
    pub fn insert(
        &mut self,
        param: &str,
        slot: &str,
        shape: Vec<usize>,
        data: Vec<f32>,
    ) -> Result<()> {
        let key = Self::key(param, slot);
        let t = TensorData { shape, data };
        t.check(&key)?;
        self.tensors.insert(key, t);
        Ok(())
    }

    /// State `slot` of parameter `param`, if saved.
    pub fn get(&self, param: &str, slot: &str) -> Option<&TensorData> {
        self.tensors.get(&Self::key(param, slot))
    }
}

/// An optimizer whose state can be checkpointed: implemented by `ddp_candle::optim::{Sgd, AdamW}`
/// and by any other framework adapter's optimizers. Use it through
/// [`Checkpoint::save_optimizer`] and [`Checkpoint::load_optimizer`].
pub trait OptimizerState {
    /// The adapter's error type (it must hold a `ddp-core` error).
    type Error: From<Error>;

    /// The algorithm, e.g. `"sgd"`; a checkpoint of another algorithm is refused on load.
    fn kind(&self) -> &str;

    /// A host copy of the state.
    fn state_dict(&self) -> Result<OptimizerStateDict, Self::Error>;

    /// Restores a state made by [`state_dict`](Self::state_dict) (errors name a missing or
    /// mis-shaped tensor). Hyper-parameters are not restored: the optimizer keeps its own.
    fn load_state_dict(&mut self, state: &OptimizerStateDict) -> Result<(), Self::Error>;
}

impl Checkpoint {
    /// Stores `opt`'s state: its tensors as `optim.<param>.<slot>`, its step and hyper-parameters
    /// in the metadata. Replaces any optimizer state stored before.
    pub fn save_optimizer<O: OptimizerState + ?Sized>(&mut self, opt: &O) -> Result<(), O::Error> {
        let state = opt.state_dict()?;
        Ok(self.set_optimizer_state(state)?)
    }

    /// Restores `opt` from the state stored by [`save_optimizer`](Self::save_optimizer); an error
    /// when the checkpoint holds another algorithm's state.
    pub fn load_optimizer<O: OptimizerState + ?Sized>(&self, opt: &mut O) -> Result<(), O::Error> {
        let state = self.optimizer_state();
        if !state.kind.is_empty() && state.kind != opt.kind() {
            return Err(Error::Mismatch(format!(
                "checkpoint holds {} optimizer state but the optimizer is {}",
                state.kind,
                opt.kind()
            ))
            .into());
        }
        opt.load_state_dict(&state)
    }

    /// Stores an optimizer state (see [`save_optimizer`](Self::save_optimizer)).
    pub fn set_optimizer_state(&mut self, state: OptimizerStateDict) -> Result<()> {
        if state.step > MAX_COUNT {
            return Err(Error::InvalidArgument(format!(
                "optimizer step {} is out of range (at most 2^53)",
                state.step
            )));
        }
        if let Some((k, v)) = state.hyper.iter().find(|(_, v)| !v.is_finite()) {
            return Err(Error::InvalidArgument(format!(
                "optimizer hyper-parameter {k} = {v} is not finite"
            )));
        }
        for (k, t) in &state.tensors {
            t.check(k)?;
        }
        self.tensors.retain(|k, _| !k.starts_with(OPTIM_PREFIX));
        for (k, t) in state.tensors {
            self.tensors.insert(format!("{OPTIM_PREFIX}{k}"), t);
        }
        self.optimizer = Some(OptimizerRecord {
            kind: state.kind,
            step: state.step,
            hyper: state.hyper,
        });
        Ok(())
    }

    /// The stored optimizer state (empty kind and step 0 for a format-1 checkpoint, whose
    /// scalars, if any, are tensors named `optim.__<kind>.<name>`).
    pub fn optimizer_state(&self) -> OptimizerStateDict {
        let record = self.optimizer.clone().unwrap_or_default();
        OptimizerStateDict {
            kind: record.kind,
            step: record.step,
            hyper: record.hyper,
            tensors: self
                .tensors
                .iter()
                .filter_map(|(k, t)| Some((k.strip_prefix(OPTIM_PREFIX)?.to_string(), t.clone())))
                .collect(),
        }
    }
}

/// Where a training loop stands: what a checkpoint records to continue exactly.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TrainingState {
    /// Optimizer steps completed.
    pub step: u64,
    /// Current epoch.
    pub epoch: u64,
    /// Samples of `epoch` this rank has consumed.
    pub consumed: usize,
}

/// The run that saves and resumes checkpoints: what a checkpoint's position must be consistent
/// with. The training loop it describes runs `epochs` epochs of `samples_per_epoch` samples per
/// rank in batches of `batch_size` (the last one may be short), one optimizer step per batch,
/// stopping early after `max_steps` steps in total.
#[derive(Debug, Clone)]
pub struct RunPlan {
    /// Number of processes.
    pub world_size: usize,
    /// Samples each rank draws per epoch (`DistributedSampler::len()`).
    pub samples_per_epoch: usize,
    /// Samples per rank per step.
    pub batch_size: usize,
    /// Epochs of the whole run (across resumes).
    pub epochs: u64,
    /// Total optimizer steps after which the run stops, if any.
    pub max_steps: Option<u64>,
    /// Hyper-parameters that a resumed checkpoint must have been written with: a JSON object,
    /// saved as the metadata's `extra` and compared key by key on resume.
    pub hyper: serde_json::Value,
    /// RNG seed or state, saved as `rng_state`.
    pub rng_state: u64,
}

impl RunPlan {
    /// Optimizer steps per epoch.
    pub fn steps_per_epoch(&self) -> u64 {
        self.samples_per_epoch.div_ceil(self.batch_size.max(1)) as u64
    }

    /// The metadata of a checkpoint taken at `state`.
    pub fn meta(&self, state: &TrainingState) -> CheckpointMeta {
        CheckpointMeta {
            step: state.step,
            epoch: state.epoch,
            sampler: SamplerState {
                epoch: state.epoch,
                consumed: state.consumed,
            },
            rng_state: self.rng_state,
            world_size: self.world_size,
            extra: self.hyper.clone(),
        }
    }

    /// The position (`consumed` samples into `meta.epoch`) is not past the end of this run:
    /// its epochs, or `max_steps`. Shared by [`RunPlan::check`] and the elastic check.
    pub(super) fn check_not_past_end(&self, meta: &CheckpointMeta, consumed: usize) -> Result<()> {
        let bad = |m: String| {
            Err(Error::Checkpoint(format!(
                "checkpoint position is inconsistent with this run: {m}"
            )))
        };
        if meta.epoch > self.epochs || (meta.epoch == self.epochs && consumed > 0) {
            return bad(format!(
                "epoch {} is past the end of this run ({} epochs)",
                meta.epoch, self.epochs
            ));
        }
        if let Some(m) = self.max_steps.filter(|&m| meta.step > m) {
            return bad(format!(
                "step {} is past this run's max_steps {m}",
                meta.step
            ));
        }
        Ok(())
    }

    /// The hyper-parameters of `meta` (its `extra`) include this run's, with the same values.
    pub(super) fn check_hyper(&self, meta: &CheckpointMeta) -> Result<()> {
        if let Some(want) = self.hyper.as_object() {
            for (k, v) in want {
                let got = meta.extra.get(k);
                if got != Some(v) {
                    return Err(Error::Mismatch(format!(
                        "checkpoint was written with {k} = {} but this run has {k} = {v}",
                        got.map_or_else(|| "?".to_string(), |x| x.to_string())
                    )));
                }
            }
        }
        Ok(())
    }

    /// Checks a checkpoint's metadata against this run and returns its position: same world size
    /// and hyper-parameters; a sampler position inside the epoch's data, at a batch boundary, in
    /// the same epoch; a step count equal to the one the epoch and position imply; not past the
    /// end of the run (so a crafted position can neither wrap counters nor skip training).
    pub fn check(&self, meta: &CheckpointMeta) -> Result<TrainingState> {
        meta.validate()?;
        meta.check_world_size(self.world_size)?;
        self.check_hyper(meta)?;
        let bad = |m: String| {
            Err(Error::Checkpoint(format!(
                "checkpoint position is inconsistent with this run: {m}"
            )))
        };
        let (n, bs) = (self.samples_per_epoch, self.batch_size.max(1));
        let s = &meta.sampler;
        if s.epoch != meta.epoch {
            return bad(format!(
                "sampler epoch {} differs from epoch {}",
                s.epoch, meta.epoch
            ));
        }
        if s.consumed > n || (!s.consumed.is_multiple_of(bs) && s.consumed != n) {
            return bad(format!(
                "{} samples consumed, but an epoch has {n} samples per rank in batches of {bs}",
                s.consumed
            ));
        }
        let spe = self.steps_per_epoch();
        let expected = meta
            .epoch
            .checked_mul(spe)
            .and_then(|x| x.checked_add(s.consumed.div_ceil(bs) as u64));
        if expected != Some(meta.step) {
            return bad(format!(
                "step {} does not match epoch {} and {} samples consumed at {spe} steps per epoch \
                 (expected step {})",
                meta.step,
                meta.epoch,
                s.consumed,
                expected.map_or_else(|| "out of range".to_string(), |x| x.to_string())
            ));
        }
        self.check_not_past_end(meta, s.consumed)?;
        Ok(TrainingState {
            step: meta.step,
            epoch: meta.epoch,
            consumed: s.consumed,
        })
    }
}

/// A checkpoint to resume from, checked against the run.
#[derive(Debug, Clone)]
pub struct Resumed {
    /// The checkpoint (parameters, optimizer state, metadata), integrity-checked.
    pub checkpoint: Checkpoint,
    /// Where training continues.
    pub state: TrainingState,
    /// The file it came from (on rank 0).
    pub path: PathBuf,
}

/// The start of a run that checkpoints to `dir` (a collective): rank 0 makes sure `dir` is
/// writable ([`ensure_writable`]) and, when `resume` is set, loads its checkpoint and sends it to
/// every rank (so `dir` need not be shared). Every rank checks it against `plan`
/// ([`RunPlan::check`]). `Ok(None)`: start fresh. Any failure — an unwritable directory, a damaged
/// checkpoint, one of another run — is an error on every rank, before training starts.
pub fn resume_or_start(
    pg: &ProcessGroup,
    dir: &Path,
    resume: bool,
    plan: &RunPlan,
) -> Result<Option<Resumed>> {
    let local = if pg.rank() == 0 {
        let loaded = ensure_writable(dir).and_then(|()| if resume { load(dir) } else { Ok(None) });
        Some(loaded)
    } else {
        None
    };
    let Some(checkpoint) = share(pg, local, 0)? else {
        return Ok(None);
    };
    let state = plan.check(&checkpoint.meta)?;
    Ok(Some(Resumed {
        checkpoint,
        state,
        path: checkpoint_path(dir),
    }))
}

/// Sends `root`'s checkpoint (or its absence) to every rank: what `root` passes is what every rank
/// gets back (`ckpt` is ignored elsewhere). The bytes are integrity-checked again on arrival.
/// A collective.
pub fn broadcast(
    pg: &ProcessGroup,
    ckpt: Option<&Checkpoint>,
    root: usize,
) -> Result<Option<Checkpoint>> {
    let local = (pg.rank() == root).then(|| Ok(ckpt.cloned()));
    share(pg, local, root)
}

/// Broadcasts `root`'s outcome (`local`, `Some` on `root` only): a checkpoint, none, or an error,
/// which then fails every rank.
pub(super) fn share(
    pg: &ProcessGroup,
    local: Option<Result<Option<Checkpoint>>>,
    root: usize,
) -> Result<Option<Checkpoint>> {
    const NONE: u8 = 0;
    const SOME: u8 = 1;
    const FAILED: u8 = 2;
    let mut payload = Vec::new();
    let mut mine = None;
    if let Some(outcome) = local {
        match outcome.and_then(|c| c.map(|c| c.to_bytes().map(|b| (c, b))).transpose()) {
            Ok(None) => payload.push(NONE),
            Ok(Some((c, bytes))) => {
                payload.push(SOME);
                payload.extend_from_slice(&bytes);
                mine = Some(c);
            }
            Err(e) => {
                payload.push(FAILED);
                payload.extend_from_slice(e.to_string().as_bytes());
                pg.broadcast_bytes(&payload, root)?;
                return Err(e);
            }
        }
    }
    let bytes = pg.broadcast_bytes(&payload, root)?;
    if pg.rank() == root {
        return Ok(mine);
    }
    match bytes.split_first() {
        Some((&NONE, _)) => Ok(None),
        Some((&SOME, b)) => {
            Checkpoint::from_bytes(b, &format!("checkpoint broadcast from rank {root}")).map(Some)
        }
        Some((&FAILED, msg)) => Err(Error::Checkpoint(format!(
            "rank {root} could not provide the checkpoint: {}",
            String::from_utf8_lossy(msg)
        ))),
        _ => Err(Error::Checkpoint(format!(
            "invalid checkpoint broadcast from rank {root}"
        ))),
    }
}
