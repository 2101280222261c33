//! The run's data-parallel wrapper at any ZeRO stage: `ddprs::candle::ZeroDdp` (stages 0-2, a full
//! replica per rank) or `ddprs::candle::Fsdp` (stage 3: the parameters sharded too, one unit per
//! layer). At stage 3 the model of `model.rs` is only an evaluation copy: it is refreshed from
//! the shards ([`Trainer::refresh`], a collective) before it is evaluated, never trained.

use candle_core::{Module, Tensor, Var};
use candle_nn::VarMap;
use ddprs::candle::{Fsdp, Unit, ZeroDdp};
use ddprs::checkpoint::CheckpointMeta;
use ddprs::reducer::TotalStats;
use ddprs::verify::ReplicaReport;
use std::path::Path;

pub enum Trainer {
    Zero(Box<ZeroDdp>),
    Fsdp(Box<Fsdp>),
}

/// Stage 3's units: `fc1 + relu` and `fc2`, the model's two stages.
pub fn units(inputs: usize, hidden: usize, classes: usize) -> Vec<Unit> {
    vec![
        Unit::new(["fc1"], move |vb, x: &Tensor| {
            ddprs::candle::nn::linear(inputs, hidden, vb.pp("fc1"))?
                .forward(x)?
                .relu()
        }),
        Unit::new(["fc2"], move |vb, x: &Tensor| {
            ddprs::candle::nn::linear(hidden, classes, vb.pp("fc2"))?.forward(x)
        }),
    ]
}

impl Trainer {
    /// The stage-0-2 wrapper (the run's own features: blockwise backward, hooks, plain
    /// checkpoints); `None` at stage 3.
    pub fn zero(&self) -> Option<&ZeroDdp> {
        match self {
            Trainer::Zero(z) => Some(z),
            Trainer::Fsdp(_) => None,
        }
    }

    pub fn zero_mut(&mut self) -> Option<&mut ZeroDdp> {
        match self {
            Trainer::Zero(z) => Some(z),
            Trainer::Fsdp(_) => None,
        }
    }

    /// Seconds the last backward waited for communication.
    pub fn last_wait(&self) -> std::time::Duration {
        let s = match self {
            Trainer::Zero(z) => z.ddp().last_step_stats(),
            Trainer::Fsdp(f) => f.last_step_stats(),
        };
        s.map_or(std::time::Duration::ZERO, |s| s.comm_wait)
    }

    /// Bytes sent so far (stages 0-2: what the reducer sent; 3: gathers and reduce-scatters).
    pub fn bytes_sent(&self) -> u64 {
        match self {
            Trainer::Zero(z) => z.reducer().bytes_sent(),
            Trainer::Fsdp(f) => f.total_stats().bytes,
        }
    }

    pub fn bytes_per_step(&self) -> u64 {
        match self {
            Trainer::Zero(z) => z.bytes_per_step(),
            Trainer::Fsdp(f) => f.bytes_per_step(),
        }
    }

    pub fn total_stats(&self) -> TotalStats {
        match self {
            Trainer::Zero(z) => z.total_stats(),
            Trainer::Fsdp(f) => f.total_stats(),
        }
    }

    pub fn param_count(&self) -> usize {
        match self {
            Trainer::Zero(z) => z.reducer().specs().iter().map(|s| s.numel()).sum(),
            Trainer::Fsdp(f) => f.layout().numel(),
        }
    }

    pub fn param_names(&self) -> Vec<String> {
        match self {
            Trainer::Zero(z) => z.param_names().iter().map(|s| s.to_string()).collect(),
            Trainer::Fsdp(f) => f.param_names().to_vec(),
        }
    }

    pub fn verify_replicas(&self) -> ddprs::candle::Result<ReplicaReport> {
        match self {
            Trainer::Zero(z) => z.verify_replicas(),
            Trainer::Fsdp(f) => f.verify_replicas(),
        }
    }

    /// Saves a sharded set (stages 1-3).
    pub fn save_sharded(&self, dir: &Path, meta: &CheckpointMeta) -> ddprs::candle::Result<()> {
        match self {
            Trainer::Zero(z) => z.save(dir, meta).map(drop),
            Trainer::Fsdp(f) => f.save(dir, meta).map(drop),
        }
    }

    /// Loads the current sharded set of `dir` (stages 1-3, any world size).
    pub fn load_sharded(&mut self, dir: &Path) -> ddprs::candle::Result<Option<CheckpointMeta>> {
        match self {
            Trainer::Zero(z) => z.load(dir),
            Trainer::Fsdp(f) => f.load(dir),
        }
    }

    /// Takes this rank's chunks of a plain checkpoint (stages 1-3; a collective).
    pub fn import(&mut self, ckpt: &ddprs::checkpoint::Checkpoint) -> ddprs::candle::Result<()> {
        match self {
            Trainer::Zero(z) => z.import(ckpt),
            Trainer::Fsdp(f) => f.import(ckpt),
        }
    }

    /// Stage 3: copies the gathered parameters into the evaluation copy `varmap` (a collective:
    /// every rank must call it); a no-op otherwise (the model is the replica).
    pub fn refresh(&self, varmap: &VarMap) -> ddprs::candle::Result<()> {
        let Trainer::Fsdp(f) = self else {
            return Ok(());
        };
        let full = f.full_params()?;
        let data = varmap.data().lock().expect("VarMap lock");
        for (name, t) in full {
            let var: &Var = data.get(&name).ok_or_else(|| {
                ddprs::candle::Error::Unsupported(format!("`{name}` is not in the model"))
            })?;
            var.set(&t)?;
        }
        Ok(())
    }
}
