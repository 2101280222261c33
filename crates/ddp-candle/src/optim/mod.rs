//! Optimizers that work with [`Ddp`](crate::Ddp)'s averaged gradients and can be checkpointed.
//!
//! Both implement `candle_nn::Optimizer` (`opt.step(&grads)`) and save and restore their state to
//! and from a `ddp::Checkpoint` under PyTorch's state names:
//! - [`Sgd`]: PyTorch's `torch.optim.SGD` (momentum, dampening, weight decay, Nesterov,
//!   maximize), one fused pass over parameter, gradient and momentum buffer per tensor. With no
//!   momentum and no weight decay it is bit-identical to `candle_nn::SGD`, which allocates three
//!   temporaries per tensor and has no momentum.
//! - [`AdamW`]: candle's AdamW arithmetic, operation for operation (in place for CPU parameters),
//!   with a checkpointable state
//!   (`candle_nn::AdamW` keeps its moments private).
//!
//! Both implement `ddp::checkpoint::OptimizerState` (`ckpt.save_optimizer(&opt)`,
//! `ckpt.load_optimizer(&mut opt)`), the framework-agnostic state every adapter shares, and so
//! [`DynOptimizer`]: an optimizer chosen at run time is a `Box<dyn DynOptimizer>`.

mod adamw;
mod sgd;

pub use adamw::AdamW;
pub use sgd::{ParamsSgd, Sgd};

use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::Optimizer;
use ddp::checkpoint::OptimizerState;

/// An optimizer behind `Box<dyn DynOptimizer>` (`candle_nn::Optimizer` is not object safe): a
/// step, the learning rate, and a checkpointable state. Implemented for every
/// `candle_nn::Optimizer` that implements `ddp::checkpoint::OptimizerState`. Call `step`,
/// `learning_rate` and `set_learning_rate` on the `dyn DynOptimizer` (inherent methods, so they
/// never clash with `candle_nn::Optimizer`'s on a concrete optimizer).
pub trait DynOptimizer: OptimizerState<Error = crate::Error> {
    /// `candle_nn::Optimizer::step`.
    fn dyn_step(&mut self, grads: &GradStore) -> candle_core::Result<()>;
    /// `candle_nn::Optimizer::learning_rate`.
    fn dyn_learning_rate(&self) -> f64;
    /// `candle_nn::Optimizer::set_learning_rate`.
    fn dyn_set_learning_rate(&mut self, lr: f64);
}

impl<T: Optimizer + OptimizerState<Error = crate::Error>> DynOptimizer for T {
    fn dyn_step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step(grads)
    }

    fn dyn_learning_rate(&self) -> f64 {
        self.learning_rate()
    }

    fn dyn_set_learning_rate(&mut self, lr: f64) {
        self.set_learning_rate(lr)
    }
}

impl dyn DynOptimizer {
    /// One update from (averaged) gradients.
    pub fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.dyn_step(grads)
    }

    pub fn learning_rate(&self) -> f64 {
        self.dyn_learning_rate()
    }

    pub fn set_learning_rate(&mut self, lr: f64) {
        self.dyn_set_learning_rate(lr)
    }
}

/// Names for optimizers built without names (`Optimizer::new`): `param0`, `param1`, ... (the
/// keys of their state in checkpoints).
fn unnamed(vars: Vec<Var>) -> impl Iterator<Item = (String, Var)> {
    vars.into_iter()
        .enumerate()
        .map(|(i, v)| (format!("param{i}"), v))
}
