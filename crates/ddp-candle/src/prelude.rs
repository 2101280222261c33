//! The common imports of a candle training program: `use ddp_candle::prelude::*;` brings the
//! DDP wrapper, its options and errors, everything of `ddp_core::prelude` (reducer, comm hooks,
//! sampler, Join, process group), and what the program needs next:
//! - checkpoints: the module `checkpoint` (`ddp_core::checkpoint`: `resume_or_start`, `RunPlan`,
//!   `save_atomic`, ...), its common types, and candle's [`load_vars`]/[`save_vars`]; the one
//!   call that saves a run is [`DistributedDataParallel::save_checkpoint`];
//! - checks: [`verify_disjoint_shards`] (the sampler's shards cover the data once) and
//!   [`verify_replicas`];
//! - optimizers: candle's [`Optimizer`] trait (for `Sgd::new` and `opt.step(&grads)`) and
//!   PyTorch's [`Sgd`] / [`AdamW`] with checkpointable state.

pub use crate::checkpoint::{load_vars, save_vars};
pub use crate::optim::{AdamW, ParamsSgd, Sgd};
pub use crate::{Ddp, DdpOptions, DistributedDataParallel};
pub use candle_nn::Optimizer;
pub use ddp_core::checkpoint::{
    self as checkpoint, Checkpoint, CheckpointMeta, OptimizerState, RunPlan, TrainingState,
};
pub use ddp_core::prelude::*;
pub use ddp_core::verify::{verify_disjoint_shards, verify_replicas};
