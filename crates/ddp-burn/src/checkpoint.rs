//! Checkpoints of Burn training: Burn's own records (the module's `ModuleRecord` and the
//! optimizer's `OptimizerRecord`, both burnpack bytes) stored as blobs of a `ddp_core::Checkpoint`,
//! beside our metadata (step, epoch, sampler position, RNG state, world size, hyper-parameters).
//!
//! ```text
//!   checkpoint.safetensors  (one file, written by rank 0 with ddp_core::checkpoint::save_atomic)
//!   ├── "burn.model"      U8  burnpack of module.into_record()          crc32 ┐
//!   ├── "burn.optimizer"  U8  burnpack of ModuleOptimizer::to_record()  crc32 ├ in the sealed
//!   └── ddp_meta: step, epoch, sampler {epoch, consumed}, rng, world size ─────┘ metadata
//! ```
//!
//! So a Burn run gets everything `ddp_core::checkpoint` gives candle runs: the atomic update (temp
//! file, fsync, rename, fsync of the directory), checksums verified before anything is used (a
//! flipped bit is an error naming `"burn.model"` or the metadata), and
//! `ddp_core::checkpoint::resume_or_start` (rank 0 reads, every rank receives and checks the position
//! against its `RunPlan`). The optimizer record is keyed by Burn's `ParamId`s; loading the model
//! record restores rank 0's ids on every rank, so the optimizer state finds its parameters.

use crate::{DistributedDataParallel, Error, Result};
use burn::module::Module;
use burn::optim::ModuleOptimizer;
use burn::store::ModuleRecord;
use burn::tensor::Bytes;
use ddp_core::Checkpoint;

/// Blob name of the module record.
pub const MODEL_BLOB: &str = "burn.model";
/// Blob name of the optimizer record.
pub const OPTIMIZER_BLOB: &str = "burn.optimizer";

fn record_error(what: &str, e: impl std::fmt::Display) -> Error {
    Error::Record(format!("{what}: {e}"))
}

/// Stores `module`'s record and `optim`'s state in `ckpt` (as Burn serializes them).
pub fn save_records<M: Module>(
    ckpt: &mut Checkpoint,
    module: &M,
    optim: &ModuleOptimizer,
) -> Result<()> {
    let model = module
        .clone()
        .into_record()
        .into_bytes()
        .map_err(|e| record_error("cannot serialize the module record", e))?;
    let optim = optim
        .into_bytes()
        .map_err(|e| record_error("cannot serialize the optimizer record", e))?;
    ckpt.insert_blob(MODEL_BLOB, model.to_vec());
    ckpt.insert_blob(OPTIMIZER_BLOB, optim.to_vec());
    Ok(())
}

/// Loads the module and optimizer records of `ckpt` into `module` and `optim`.
pub fn load_records<M: Module>(
    ckpt: &Checkpoint,
    module: M,
    optim: ModuleOptimizer,
) -> Result<(M, ModuleOptimizer)> {
    let model = ModuleRecord::from_bytes(Bytes::from_bytes_vec(
        ckpt.require_blob(MODEL_BLOB)?.to_vec(),
    ))
    .map_err(|e| record_error(&format!("checkpoint blob {MODEL_BLOB:?}"), e))?;
    let module = module
        .try_load_record(model)
        .map_err(|e| record_error(&format!("checkpoint blob {MODEL_BLOB:?}"), e))?;
    let optim = optim
        .from_bytes(Bytes::from_bytes_vec(
            ckpt.require_blob(OPTIMIZER_BLOB)?.to_vec(),
        ))
        .map_err(|e| record_error(&format!("checkpoint blob {OPTIMIZER_BLOB:?}"), e))?;
    Ok((module, optim))
}

impl<M: Module> DistributedDataParallel<M> {
    /// [`save_records`] of the wrapped module.
    pub fn save_records(&self, ckpt: &mut Checkpoint, optim: &ModuleOptimizer) -> Result<()> {
        save_records(ckpt, self.module(), optim)
    }

    /// [`load_records`] into the wrapped module (same on every rank after
    /// `resume_or_start`); returns the optimizer with its state restored.
    pub fn load_records(
        &mut self,
        ckpt: &Checkpoint,
        optim: ModuleOptimizer,
    ) -> Result<ModuleOptimizer> {
        let (module, optim) = load_records(ckpt, self.module().clone(), optim)?;
        self.map_module(|_| module)?;
        Ok(optim)
    }
}
