//! Sharded data parallelism (ZeRO stages 1, 2 and 3): optimizer state, gradients and parameters
//! partitioned over the ranks, with checkpoints that resume on any world size.
//!
//! DDP replicates everything: with fp32 AdamW every rank holds parameters (4Ψ bytes), gradients
//! (4Ψ) and two moments (8Ψ). ZeRO (Rajbhandari et al. 2019) partitions them:
//!
//! | stage | sharded | per rank (fp32 AdamW) | communication |
//! |---|---|---|---|
//! | 0 (DDP) | nothing | 16Ψ | all-reduce (2Ψ·(N-1)/N sent) |
//! | 1 | optimizer state | 8Ψ + 8Ψ/N | reduce-scatter + all-gather, the same volume |
//! | 2 | + gradients | 4Ψ + 12Ψ/N | the same |
//! | 3 | + parameters ([`units`]) | 16Ψ/N + the largest gathered unit(s) and their gradients + activations | all-gather twice + reduce-scatter: up to 1.5× |
//!
//! The flat parameter space is the reducer's buckets; rank `r` owns chunk `r` of each bucket
//! ([`ShardLayout`]). One step:
//!
//! ```text
//!  backward ─► Reducer (buckets fill in backward order) ─► ReduceScatterHook: reduce_scatter
//!    per bucket, in place, async (the CommHook trait) ─► owner's averaged gradient chunk, a
//!    range of the bucket's own buffer (take_shard_grads: no copy)
//!  ─► optimizer steps its chunk only (state for Ψ/N elements) ─► gather_params_into:
//!    all_gather per bucket, in place, async ─► every rank's parameters, bit-identical
//!    (on shared memory, a bucket of 1 MiB or more straight into the parameters instead:
//!    all_gather_in_place_to, each rank reading the owners' chunks from their buffers)
//! ```
//!
//! On shared memory with cross-memory attach the all-gather into a bucket and the copy out of
//! it into the parameters copy every received byte three times (into the segment, out of it,
//! into the parameter); reading it from the owner's buffer straight into the parameter copies
//! it once. (Gains measured: `docs/benchmarks.md`.)
//!
//! Stage 2's hook keeps only the owned chunk of each bucket (`ReduceScatterHook::shard_only`):
//! the full bucket is freed on the communication thread once reduced, so with a backward that
//! hands gradients over block by block only gradient shards outlive it. Measured against the
//! formulas: `docs/benchmarks.md`.
//! Stage 3 keeps no full parameters at all: the model is cut into units, each all-gathered just
//! before its forward and again before its backward, then freed (module [`units`]; one unit is
//! one bucket of a [`ShardLayout`], so checkpoints are shared by all stages). Checkpoints: module
//! [`sets`]. What a stage 0-2 wrapper does whatever its framework: module [`zero`]. The candle adapters are `ddp_candle::ZeroDdp` (stages 0-2) and
//! `ddp_candle::Fsdp` (stage 3); Burn's is `ddp_burn::ZeroDdp` (stages 0-2, Burn's own
//! optimizers stepping each chunk as one tensor; its save sets are these).

pub mod async_sets;
mod hook;
pub mod layout;
pub mod sets;
pub mod units;
pub mod zero;

/// The former name of [`sets`] (kept so that `ddp_core::sharding::checkpoint::*` paths resolve).
#[doc(hidden)]
pub use sets as checkpoint;

pub use async_sets::AsyncSetSaver;
pub use hook::{
    bytes_per_step, clip_grad_norm, gather_params, gather_params_into, shard_params,
    take_shard_grads, Gather, Lend, ReduceScatterHook, ShardGrads,
};
pub use layout::{BucketSlot, Chunk, Piece, ShardBucket, ShardLayout};
pub use sets::{
    agree, consolidate, import, is_set_name, latest_set, load_sharded, prepare_dir, save_sharded,
    set_meta, ChunkState, ShardState,
};
pub use units::{stage3_bytes_per_step, unit_layout, UnitComm};
pub use zero::{import_agreed, load_agreed, save_agreed, ZeroCore};

use crate::error::{Error, Result};

/// How much is sharded (DeepSpeed's stages; 0 is plain DDP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ZeroStage {
    /// Nothing sharded: DDP.
    #[default]
    Ddp,
    /// Optimizer state sharded.
    One,
    /// Optimizer state and gradients sharded.
    Two,
    /// Optimizer state, gradients and parameters sharded (FSDP-style, module [`units`]).
    Three,
}

impl ZeroStage {
    /// `0`, `1`, `2` or `3` (what `--zero` takes).
    pub fn from_level(level: u8) -> Result<ZeroStage> {
        match level {
            0 => Ok(ZeroStage::Ddp),
            1 => Ok(ZeroStage::One),
            2 => Ok(ZeroStage::Two),
            3 => Ok(ZeroStage::Three),
            n => Err(Error::InvalidArgument(format!(
                "ZeRO stage {n} does not exist (0, 1, 2, 3)"
            ))),
        }
    }

    pub fn level(self) -> u8 {
        match self {
            ZeroStage::Ddp => 0,
            ZeroStage::One => 1,
            ZeroStage::Two => 2,
            ZeroStage::Three => 3,
        }
    }
}
