//! `ddp`: framework-agnostic distributed data parallelism on top of `ddp-comm`.
pub mod adapter;
pub mod alloc;
pub mod checkpoint;
pub mod error;
pub mod hooks;
pub mod join;
pub mod lr;
pub mod prelude;
pub mod reducer;
pub mod sampler;
pub mod sharding;
pub mod trace;
pub mod verify;

pub use checkpoint::{Checkpoint, CheckpointMeta, TensorData};
pub use error::{Error, Result};
pub use join::{Join, JoinStart, JoinStep, JoinSummary};
pub use lr::{global_batch_size, scale_lr_linear};
pub use sampler::{DistributedSampler, SamplerState};
pub use verify::{
    verify_disjoint_shards, verify_replicas, OverlapMeter, OverlapSummary, ReplicaReport,
    ShardReport,
};
