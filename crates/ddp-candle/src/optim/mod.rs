//! Optimizers that work with [`Ddp`](crate::Ddp)'s averaged gradients and can be checkpointed.
//!
//! Both implement `candle_nn::Optimizer` (`opt.step(&grads)`) and save and restore their state to
//! and from a `ddp_core::Checkpoint` under PyTorch's state names:
//! - [`Sgd`]: PyTorch's `torch.optim.SGD` (momentum, dampening, weight decay, Nesterov,
//!   maximize), one fused pass over parameter, gradient and momentum buffer per tensor. With no
//!   momentum and no weight decay it is bit-identical to `candle_nn::SGD`, which allocates three
//!   temporaries per tensor and has no momentum.
//! - [`AdamW`]: candle's AdamW arithmetic, operation for operation (in place for CPU parameters),
//!   with a checkpointable state
//!   (`candle_nn::AdamW` keeps its moments private).
//!
//! Both implement `ddp_core::checkpoint::OptimizerState` (`ckpt.save_optimizer(&opt)`,
//! `ckpt.load_optimizer(&mut opt)`), the framework-agnostic state every adapter shares, and so
//! [`DynOptimizer`]: an optimizer chosen at run time is a `Box<dyn DynOptimizer>`.

mod adamw;
mod sgd;

pub use adamw::AdamW;
pub use sgd::{ParamsSgd, Sgd};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};
use candle_nn::Optimizer;
use ddp_core::checkpoint::OptimizerState;

/// An optimizer behind `Box<dyn DynOptimizer>` (`candle_nn::Optimizer` is not object safe): a
/// step, the learning rate, and a checkpointable state. Implemented for every
/// `candle_nn::Optimizer` that implements `ddp_core::checkpoint::OptimizerState`. Call `step`,
/// `learning_rate` and `set_learning_rate` on the `dyn DynOptimizer` (inherent methods, so they
/// never clash with `candle_nn::Optimizer`'s on a concrete optimizer).
pub trait DynOptimizer: OptimizerState<Error = crate::Error> {
    /// `candle_nn::Optimizer::step`.
    fn dyn_step(&mut self, grads: &GradStore) -> candle_core::Result<()>;
    /// `candle_nn::Optimizer::learning_rate`.
    fn dyn_learning_rate(&self) -> f64;
    /// `candle_nn::Optimizer::set_learning_rate`.
    fn dyn_set_learning_rate(&mut self, lr: f64);
    /// The optimizer as `Any` (to reach a concrete optimizer's own settings, e.g.
    /// [`AdamW`]'s weight-decay groups, behind a `Box<dyn DynOptimizer>`).
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any;
}

impl<T: Optimizer + OptimizerState<Error = crate::Error> + 'static> DynOptimizer for T {
    fn dyn_step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step(grads)
    }

    fn dyn_learning_rate(&self) -> f64 {
        self.learning_rate()
    }

    fn dyn_set_learning_rate(&mut self, lr: f64) {
        self.set_learning_rate(lr)
    }

    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
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

/// `candle_nn::Optimizer` and `OptimizerState` for one of this module's optimizers: named
/// construction from unnamed variables, the learning rate in `params.lr`, the step in the type's
/// own `apply_step`; the state is algorithm `$kind` with the module's `hyper(&params)` and the
/// slots the type's `save_slots` / `load_slots` write and read.
macro_rules! impl_optimizer {
    ($ty:ident, $config:ty, $kind:literal) => {
        impl OptimizerState for $ty {
            type Error = crate::Error;

            fn kind(&self) -> &str {
                $kind
            }

            fn state_dict(&self) -> crate::Result<OptimizerStateDict> {
                let mut state = OptimizerStateDict::new($kind, self.step_count() as u64)
                    .with_hyper(hyper(&self.params));
                self.save_slots(&mut state)?;
                Ok(state)
            }

            fn load_state_dict(&mut self, state: &OptimizerStateDict) -> crate::Result<()> {
                self.load_slots(state)
            }
        }

        impl candle_nn::Optimizer for $ty {
            type Config = $config;

            /// Unnamed variables are called `param0`, `param1`, ... in checkpoints.
            fn new(vars: Vec<Var>, params: $config) -> candle_core::Result<Self> {
                Ok($ty::new_named(super::unnamed(vars), params)?)
            }

            fn learning_rate(&self) -> f64 {
                self.params.lr
            }

            fn set_learning_rate(&mut self, lr: f64) {
                self.params.lr = lr
            }

            fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
                self.apply_step(grads)
            }
        }

        impl $ty {
            /// Adds the state (what its `OptimizerState` impl lists) to `ckpt`; the same as
            /// `ckpt.save_optimizer(self)`.
            pub fn save_state(
                &self,
                ckpt: &mut ddp_core::checkpoint::Checkpoint,
            ) -> crate::Result<()> {
                ckpt.save_optimizer(self)
            }

            /// Restores the state saved by [`save_state`](Self::save_state) (errors name a
            /// missing or mis-shaped tensor; a parameter without a saved SGD momentum buffer
            /// starts fresh, as in PyTorch); the same as `ckpt.load_optimizer(self)`.
            pub fn load_state(
                &mut self,
                ckpt: &ddp_core::checkpoint::Checkpoint,
            ) -> crate::Result<()> {
                ckpt.load_optimizer(self)
            }
        }
    };
}
use impl_optimizer;

/// Names for optimizers built without names (`Optimizer::new`): `param0`, `param1`, ... (the
/// keys of their state in checkpoints).
fn unnamed(vars: Vec<Var>) -> impl Iterator<Item = (String, Var)> {
    vars.into_iter()
        .enumerate()
        .map(|(i, v)| (format!("param{i}"), v))
}

/// What an optimizer slot updates: its variable, or (ZeRO stages 1 and 2,
/// [`Target::write_through`]) pieces of the model's own parameters that together are the slot's
/// flat values, updated in place, so that the shard keeps no copy of the values it owns.
pub(crate) enum Target {
    Var(Var),
    Pieces {
        /// The id the slot's gradient is stored under in a `GradStore` (the replaced variable's).
        key: TensorId,
        /// A tensor of the slot's shape, dtype and device without storage of that size (a
        /// broadcast scalar), for state shapes and checkpoint conversions.
        like: Tensor,
        /// Contiguous 1-D views, in order of `offset`, covering the slot.
        pieces: Vec<Piece>,
    },
}

/// The gradients of a write-through step (`Sgd::step_through`, `AdamW::step_through`): per
/// slot key (see [`Target::Pieces`]), its flat f32 gradient, which after the step holds the
/// slot's updated values instead (ZeRO's parameter all-gather then sends them from there,
/// without another pass over the parameters).
pub(crate) type EchoGrads<'a> = std::collections::HashMap<TensorId, &'a mut [f32]>;

/// Elements per block of a write-through step: a block is updated and then copied over its
/// gradient while it is still in cache.
const ECHO_BLOCK: usize = 1 << 14;

/// `update(start, values, grad)` block by block over `values` (a parameter piece) and `grad`
/// (its gradient), each block then copied over its gradient.
fn echo_blocks(
    values: &mut [f32],
    grad: &mut [f32],
    mut update: impl FnMut(usize, &mut [f32], &[f32]),
) {
    for start in (0..values.len()).step_by(ECHO_BLOCK) {
        let end = (start + ECHO_BLOCK).min(values.len());
        update(start, &mut values[start..end], &grad[start..end]);
        grad[start..end].copy_from_slice(&values[start..end]);
    }
}

/// `update(slot_offset, values, grad)` over every piece of a write-through slot (`grad` is the
/// slot's flat gradient), block by block ([`echo_blocks`]): each block of the model's values is
/// updated in place and then copied over its gradient; `slot_offset` is where the block starts
/// in the slot.
fn echo_pieces(
    pieces: &[Piece],
    grad: &mut [f32],
    mut update: impl FnMut(usize, &mut [f32], &[f32]),
) -> crate::Result<()> {
    for p in pieces {
        let n = p.view.elem_count();
        let g = &mut grad[p.offset..p.offset + n];
        crate::tensors::with_flat_mut(&p.view, |x| {
            echo_blocks(x, g, |start, x, g| update(p.offset + start, x, g))
        })?;
    }
    Ok(())
}

/// Slot `name` of `slots` (name, target) writes through `pieces` from now on
/// ([`Target::write_through`]); an error when the optimizer has no such slot.
fn write_through_named<'a>(
    slots: impl IntoIterator<Item = (&'a str, &'a mut Target)>,
    name: &str,
    pieces: Vec<Piece>,
) -> crate::Result<()> {
    match slots.into_iter().find(|(n, _)| *n == name) {
        Some((_, target)) => target.write_through(pieces),
        None => Err(crate::Error::Unsupported(format!(
            "write_through: the optimizer has no parameter {name:?}"
        ))),
    }
}

/// The write-through slot's key, dtype check and gradient (`None`: a slot not written through
/// or without a gradient, skipped).
fn echo_slot<'g, 't>(
    target: &'t Target,
    grads: &'g mut EchoGrads<'_>,
) -> crate::Result<Option<(&'t [Piece], &'g mut [f32])>> {
    let Target::Pieces { key, like, pieces } = target else {
        return Ok(None);
    };
    let Some(g) = grads.get_mut(key) else {
        return Ok(None);
    };
    if like.dtype() != candle_core::DType::F32 || g.len() != like.elem_count() {
        return Err(crate::Error::Unsupported(format!(
            "step_through: a {:?} slot of {} elements given {} f32 gradients (f32 slots only)",
            like.dtype(),
            like.elem_count(),
            g.len()
        )));
    }
    Ok(Some((pieces, &mut **g)))
}

/// A contiguous 1-D view of part of a parameter and where it sits in a slot's flat values.
#[derive(Clone)]
pub(crate) struct Piece {
    pub view: Tensor,
    pub offset: usize,
}

impl Target {
    /// The gradient of this slot in `grads`.
    pub fn grad<'a>(&self, grads: &'a GradStore) -> Option<&'a Tensor> {
        match self {
            Target::Var(v) => grads.get(v),
            Target::Pieces { key, .. } => grads.get_id(*key),
        }
    }

    /// A tensor of the slot's shape, dtype and device.
    pub fn like(&self) -> &Tensor {
        match self {
            Target::Var(v) => v.as_tensor(),
            Target::Pieces { like, .. } => like,
        }
    }

    /// From now on the slot's values are `pieces` (which must hold the variable's current
    /// values, contiguous 1-D CPU views of its dtype covering it in order); the variable is let
    /// go (its storage is freed with the caller's last clone).
    pub fn write_through(&mut self, pieces: Vec<Piece>) -> crate::Result<()> {
        let Target::Var(var) = self else {
            return Err(crate::Error::Unsupported(
                "write_through: the slot already writes through".into(),
            ));
        };
        let mut at = 0;
        for p in &pieces {
            let ok = p.offset == at
                && p.view.rank() == 1
                && p.view.is_contiguous()
                && p.view.device().is_cpu()
                && p.view.dtype() == var.dtype();
            if !ok {
                return Err(crate::Error::Unsupported(format!(
                    "write_through: piece at {} is not a contiguous 1-D {:?} CPU view at offset {at}",
                    p.offset,
                    var.dtype()
                )));
            }
            at += p.view.elem_count();
        }
        if at != var.elem_count() || !var.device().is_cpu() {
            return Err(crate::Error::Unsupported(format!(
                "write_through: the pieces cover {at} of the slot's {} CPU elements",
                var.elem_count()
            )));
        }
        let like = Tensor::zeros((), var.dtype(), var.device())?.broadcast_as(var.shape())?;
        *self = Target::Pieces {
            key: var.id(),
            like,
            pieces,
        };
        Ok(())
    }
}
