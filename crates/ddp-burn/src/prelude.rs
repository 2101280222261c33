//! The common imports of a Burn training program: `use ddp_burn::prelude::*;` brings the DDP
//! wrapper, its options, the sharded dataset, Burn's `Learner` strategy (feature `learner`),
//! everything of `ddp_core::prelude` (reducer, comm hooks, sampler, Join, process group), and what the
//! program needs next: the module `checkpoint` (`ddp_core::checkpoint`: `resume_or_start`, `RunPlan`,
//! ...) with its common types and Burn's [`load_records`]/[`save_records`] (the one call that
//! saves a run is [`DistributedDataParallel::save_checkpoint`]), and the checks
//! [`verify_disjoint_shards`] and [`verify_replicas`]. Mirrors `ddp_candle::prelude`.

pub use crate::checkpoint::{load_records, save_records};
pub use crate::data::Sharding;
#[cfg(feature = "learner")]
pub use crate::learner::{DdpLearningStrategy, QuietRenderer};
pub use crate::{Ddp, DdpOptions, DistributedDataParallel, ShardedDataset};
pub use ddp_core::checkpoint::{
    self as checkpoint, Checkpoint, CheckpointMeta, RunPlan, TrainingState,
};
pub use ddp_core::prelude::*;
pub use ddp_core::verify::{verify_disjoint_shards, verify_replicas};
