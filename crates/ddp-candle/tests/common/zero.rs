//! Shared by the ZeRO and FSDP tests: the optimizers, the global batch of each step, and the
//! test MLP cut into stage-3 units.

use super::*;
use candle_core::{Module, Tensor};
use candle_nn::{ParamsAdamW, VarBuilder};
use ddp_candle::optim::{AdamW, DynOptimizer, ParamsSgd, Sgd};
use ddp_candle::{DdpOptions, ShardOptimizer, Unit};

/// Samples per step over all ranks (divisible by every world size used: 1, 2, 3, 4).
pub const GLOBAL: usize = 12;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Opt {
    SgdMomentum,
    AdamW,
}

pub fn make_opt(
    opt: Opt,
) -> impl FnOnce(Vec<(String, candle_core::Var)>) -> ddp_candle::Result<Box<dyn DynOptimizer>> {
    move |vars| -> ddp_candle::Result<Box<dyn DynOptimizer>> {
        Ok(match opt {
            Opt::SgdMomentum => Box::new(Sgd::new_named(
                vars,
                ParamsSgd {
                    lr: 0.05,
                    momentum: 0.9,
                    weight_decay: 0.01,
                    ..Default::default()
                },
            )?),
            Opt::AdamW => Box::new(AdamW::new_named(
                vars,
                ParamsAdamW {
                    lr: 0.01,
                    weight_decay: 0.01,
                    ..Default::default()
                },
            )?),
        })
    }
}

/// The same optimizers as [`make_opt`], built by `ZeroDdp::with_optimizer`.
pub fn shard_opt(opt: Opt) -> ShardOptimizer {
    match opt {
        Opt::SgdMomentum => ShardOptimizer::Sgd(ParamsSgd {
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.01,
            ..Default::default()
        }),
        Opt::AdamW => ShardOptimizer::AdamW(ParamsAdamW {
            lr: 0.01,
            weight_decay: 0.01,
            ..Default::default()
        }),
    }
}

/// This rank's share of global step `k`'s batch.
pub fn batch_at(k: usize, rank: usize, world: usize) -> (Tensor, Tensor) {
    let (x, y) = dataset(64 * GLOBAL);
    let per = GLOBAL / world;
    let start = (k * GLOBAL) % (60 * GLOBAL) + rank * per;
    batch(&x, &y, start..start + per)
}

/// This rank's loss of global step `k` through the full model.
pub fn loss_at(m: &Mlp, k: usize, rank: usize, world: usize) -> Tensor {
    let (xs, ys) = batch_at(k, rank, world);
    candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap()
}

/// A layer of the test MLP as a stage-3 unit's function: `ddp_candle::nn::Linear` (the same
/// parameters and values as the reference model's `candle_nn::Linear`), whose weight gradients
/// reach `Fsdp` without candle's `GradStore` (`Sizes::Uneven` keeps a unit that goes through it).
pub fn layer(
    name: &'static str,
    i: usize,
    o: usize,
    act: fn(&Tensor) -> candle_core::Result<Tensor>,
) -> impl Fn(VarBuilder<'_>, &Tensor) -> candle_core::Result<Tensor> + Send + Sync + Clone + 'static
{
    move |vb, x| act(&ddp_candle::nn::linear(i, o, vb.pp(name))?.forward(x)?)
}

/// The units of the test MLP for stage 3: one per layer (`Sizes::Tiny`) or the whole model as
/// one unit (`Sizes::Default`).
pub fn mlp_units(hidden: usize, sizes: Sizes) -> Vec<Unit> {
    let l1 = layer("l1", IN, hidden, |t| t.relu());
    let l2 = layer("l2", hidden, hidden, |t| t.tanh());
    let l3 = layer("l3", hidden, OUT, |t| Ok(t.clone()));
    match sizes {
        Sizes::Tiny => vec![
            Unit::new(["l1"], l1),
            Unit::new(["l2"], l2),
            Unit::new(["l3"], l3),
        ],
        Sizes::Default => vec![Unit::new(["l1", "l2", "l3"], move |vb, x| {
            l3(vb.clone(), &l2(vb.clone(), &l1(vb, x)?)?)
        })],
        // `l3` cut in two: its bias (5 elements) is a unit smaller than 4 ranks, so one rank
        // owns nothing of it. The same ops as `Linear::forward`.
        Sizes::Uneven => vec![
            Unit::new(["l1"], l1),
            Unit::new(["l2"], l2),
            Unit::new(["l3.weight"], move |vb, x: &Tensor| {
                x.matmul(&vb.get((OUT, hidden), "l3.weight")?.t()?)
            }),
            Unit::new(["l3.bias"], |vb, x: &Tensor| {
                x.broadcast_add(&vb.get(OUT, "l3.bias")?)
            }),
        ],
    }
}

/// Bucket sizes (stages 0-2) and unit sizes (stage 3): tiny (~1 KiB buckets, a unit per layer)
/// or default (25 MiB buckets, the whole model one unit).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sizes {
    Tiny,
    Default,
    /// Stage 3 only: a unit per layer, the last layer's weight and bias apart.
    Uneven,
}

impl Sizes {
    pub fn ddp(self) -> DdpOptions {
        match self {
            Sizes::Tiny | Sizes::Uneven => tiny_buckets(),
            Sizes::Default => DdpOptions::default(),
        }
    }
}
