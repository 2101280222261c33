//! The common imports of a training program: `use ddp_core::prelude::*;`.

pub use crate::adapter::ParamAccess;
pub use crate::error::{Error, Result};
pub use crate::join::{Join, JoinStep};
pub use crate::reducer::{
    AllReduceHook, BucketWork, CommHook, GradBucket, ParamSpec, Reducer, ReducerOptions, StepStats,
};
pub use crate::sampler::DistributedSampler;
pub use ddp_comm::{init_process_group, InitOptions, ProcessGroup, ReduceOp};
