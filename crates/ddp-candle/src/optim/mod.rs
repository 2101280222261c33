//! Optimizers that work with [`Ddp`](crate::Ddp)'s averaged gradients and can be checkpointed.
//!
//! Both implement `candle_nn::Optimizer` (`opt.step(&grads)`) and save and restore their state to
//! and from a `ddp::Checkpoint` under PyTorch's state names:
//! - [`Sgd`]: PyTorch's `torch.optim.SGD` (momentum, dampening, weight decay, Nesterov,
//!   maximize), one fused pass over parameter, gradient and momentum buffer per tensor. With no
//!   momentum and no weight decay it is bit-identical to `candle_nn::SGD`, which allocates three
//!   temporaries per tensor and has no momentum.
//! - [`AdamW`]: candle's AdamW arithmetic, operation for operation, with a checkpointable state
//!   (`candle_nn::AdamW` keeps its moments private).

mod adamw;
mod sgd;

pub use adamw::AdamW;
pub use sgd::{ParamsSgd, Sgd};

use candle_core::Var;

/// Names for optimizers built without names (`Optimizer::new`): `param0`, `param1`, ... (the
/// keys of their state in checkpoints).
fn unnamed(vars: Vec<Var>) -> impl Iterator<Item = (String, Var)> {
    vars.into_iter()
        .enumerate()
        .map(|(i, v)| (format!("param{i}"), v))
}
