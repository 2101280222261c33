//! [`AdamW`]: candle's AdamW with a checkpointable state, updating CPU parameters in place.
//!
//! `candle_nn::AdamW` keeps its moment estimates private, so a run using it cannot be checkpointed
//! and resumed exactly. [`AdamW`] here performs the *same arithmetic, operation for operation*
//! (so it produces bit-identical parameters; a test checks this against `candle_nn::AdamW` in f32
//! and f64), implements `candle_nn::Optimizer`, and saves/restores its state to/from a
//! `ddp_core::Checkpoint` under PyTorch's state names: `optim.<param>.exp_avg`,
//! `optim.<param>.exp_avg_sq`, and the step count.
//!
//! For contiguous f32/f64 parameters on the CPU the update is three in-place passes (first
//! moment, second moment, parameter: candle in-place ops) with no temporaries; candle's version
//! allocates fifteen parameter-sized tensors per parameter and step, which keeps more memory
//! resident (`docs/benchmarks.md`, "ZeRO memory (candle)"). Other dtypes and devices take
//! candle's tensor operations.

use super::{echo_pieces, echo_slot, write_through_named, EchoGrads, Piece, Target};
use crate::checkpoint::tensor_like;
use crate::tensors::{with_flat, with_flat_mut};
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Tensor, Var, WithDType};
use candle_nn::ParamsAdamW;
use ddp_core::checkpoint::{Checkpoint, OptimizerState, OptimizerStateDict};

/// State key of the step count in checkpoints of format version 1, stored as two `f32` halves of
/// 24 bits (format 2 stores it in the metadata).
const LEGACY_STEP_KEY: &str = "__adamw.step";

struct Slot {
    name: String,
    target: Target,
    m: Var,
    v: Var,
    /// Where `weight_decay` applies (PyTorch's parameter groups: nanoGPT decays 2-D weights
    /// only): runs `(start, decays)` of the slot's flat elements, each up to the next's start.
    /// One run for a parameter; a ZeRO chunk spanning parameters of both groups has several
    /// ([`AdamW::set_decay_runs`]).
    decay: Vec<(usize, bool)>,
}

/// The parts of `start..end` (flat elements of a slot) under each run of `decay` (see
/// `Slot::decay`): `(from, to, decays)`.
fn runs_in(
    decay: &[(usize, bool)],
    start: usize,
    end: usize,
) -> impl Iterator<Item = (usize, usize, bool)> + '_ {
    decay.iter().enumerate().filter_map(move |(i, &(at, d))| {
        let next = decay.get(i + 1).map_or(usize::MAX, |r| r.0);
        let (a, b) = (at.max(start), next.min(end));
        (a < b).then_some((a, b, d))
    })
}

/// AdamW with the arithmetic of `candle_nn::AdamW` and a checkpointable state.
pub struct AdamW {
    slots: Vec<Slot>,
    step_t: usize,
    params: ParamsAdamW,
}

impl AdamW {
    /// Optimizes the named variables (names key the state in checkpoints; non-float variables
    /// are skipped, as in candle).
    pub fn new_named(
        vars: impl IntoIterator<Item = (String, Var)>,
        params: ParamsAdamW,
    ) -> Result<Self> {
        Self::new_named_with_decay(vars, params, |_, _| true)
    }

    /// [`new_named`](Self::new_named) with `params.weight_decay` applied only to the variables
    /// for which `decays(name, var)` holds, the others updated with no decay: PyTorch's two
    /// parameter groups (e.g. nanoGPT's `var.rank() >= 2`: weights and embeddings decay,
    /// biases and LayerNorm weights do not).
    pub fn new_named_with_decay(
        vars: impl IntoIterator<Item = (String, Var)>,
        params: ParamsAdamW,
        decays: impl Fn(&str, &Var) -> bool,
    ) -> Result<Self> {
        let slots = vars
            .into_iter()
            .filter(|(_, v)| v.dtype().is_float())
            .map(|(name, var)| {
                let m = Var::zeros(var.shape(), var.dtype(), var.device())?;
                let v = Var::zeros(var.shape(), var.dtype(), var.device())?;
                let decay = vec![(0, decays(&name, &var))];
                Ok(Slot {
                    name,
                    target: Target::Var(var),
                    m,
                    v,
                    decay,
                })
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(AdamW {
            slots,
            step_t: 0,
            params,
        })
    }

    pub fn params(&self) -> &ParamsAdamW {
        &self.params
    }

    pub fn set_params(&mut self, params: ParamsAdamW) {
        self.params = params;
    }

    /// ZeRO stages 1/2: slot `name` from now on updates `pieces` of the model's parameters in
    /// place instead of its own variable (see `Target::write_through`).
    pub(crate) fn write_through(&mut self, name: &str, pieces: Vec<Piece>) -> Result<()> {
        let slots = self.slots.iter_mut();
        write_through_named(
            slots.map(|s| (s.name.as_str(), &mut s.target)),
            name,
            pieces,
        )
    }

    /// ZeRO's write-through step (stages 1 and 2): the same operations as `step` for every slot
    /// written through that has a gradient in `grads`, each gradient then holding the slot's
    /// updated values (see [`EchoGrads`]).
    pub(crate) fn step_through(&mut self, grads: &mut EchoGrads<'_>) -> Result<()> {
        self.step_t += 1;
        let coefs = Coefs::pair(&self.params, self.step_t);
        for s in &self.slots {
            let Some((pieces, g)) = echo_slot(&s.target, grads)? else {
                continue;
            };
            // The moments do not depend on weight decay.
            let k = &coefs[0];
            with_flat_mut(s.m.as_tensor(), |m| Fused::Moment1(k).moment(m, g))?;
            with_flat_mut(s.v.as_tensor(), |v| Fused::Moment2(k).moment(v, g))?;
            with_flat::<f32, _>(s.m.as_tensor(), |m| {
                with_flat::<f32, _>(s.v.as_tensor(), |v| {
                    echo_pieces(pieces, g, |at, x, _| {
                        for (a, b, d) in runs_in(&s.decay, at, at + x.len()) {
                            let k = &coefs[usize::from(d)];
                            Fused::update(k, &mut x[a - at..b - at], &m[a..b], &v[a..b])
                        }
                    })
                })?
            })??;
        }
        Ok(())
    }

    /// From now on weight decay applies to the elements of slot `name` as `runs` say
    /// (`(start, decays)`, starts increasing from 0; see `ShardLayout::decay_runs`): a ZeRO
    /// chunk that spans decayed and undecayed parameters.
    pub(crate) fn set_decay_runs(&mut self, name: &str, runs: Vec<(usize, bool)>) -> Result<()> {
        let Some(slot) = self.slots.iter_mut().find(|s| s.name == name) else {
            return Err(Error::Unsupported(format!(
                "weight decay runs: the optimizer has no parameter {name:?}"
            )));
        };
        let ordered = runs.first().is_some_and(|r| r.0 == 0)
            && runs.windows(2).all(|w| w[0].0 < w[1].0)
            && runs
                .last()
                .is_some_and(|r| r.0 <= slot.target.like().elem_count());
        if !ordered {
            return Err(Error::Unsupported(format!(
                "weight decay runs of {name:?} must start at 0 and increase within its {} \
                 elements: {runs:?}",
                slot.target.like().elem_count()
            )));
        }
        slot.decay = runs;
        Ok(())
    }

    /// Weight decay on the parameters `decays(name, dims)` selects only, the others updated
    /// without (PyTorch's two parameter groups), for an optimizer over whole parameters.
    pub fn set_decay_filter(&mut self, decays: impl Fn(&str, &[usize]) -> bool) {
        for s in &mut self.slots {
            s.decay = vec![(0, decays(&s.name, s.target.like().dims()))];
        }
    }

    /// Optimizer steps taken so far.
    pub fn step_count(&self) -> usize {
        self.step_t
    }
}

impl AdamW {
    /// States `exp_avg` and `exp_avg_sq` per parameter (PyTorch's names), the step count, and the
    /// hyper-parameters `lr`, `beta1`, `beta2`, `eps`, `weight_decay`.
    fn save_slots(&self, state: &mut OptimizerStateDict) -> Result<()> {
        for s in &self.slots {
            for (slot, t) in [("exp_avg", &s.m), ("exp_avg_sq", &s.v)] {
                let data = t
                    .as_tensor()
                    .flatten_all()?
                    .to_dtype(candle_core::DType::F32)?
                    .to_vec1::<f32>()?;
                state.insert(&s.name, slot, t.dims().to_vec(), data)?;
            }
        }
        Ok(())
    }

    /// Restores what [`save_slots`](Self::save_slots) wrote.
    fn load_slots(&mut self, state: &OptimizerStateDict) -> Result<()> {
        for s in &self.slots {
            for (slot, t) in [("exp_avg", &s.m), ("exp_avg_sq", &s.v)] {
                let key = Checkpoint::optim_key(&s.name, slot);
                let saved = state.get(&s.name, slot).ok_or_else(|| {
                    Error::Ddp(ddp_core::Error::Mismatch(format!(
                        "checkpoint has no optimizer state {key:?}"
                    )))
                })?;
                t.set(&tensor_like(saved, &key, t)?)?;
            }
        }
        self.step_t = match state.tensors.get(LEGACY_STEP_KEY) {
            // Format 1: the step count as two exact f32 halves.
            Some(t) if state.kind.is_empty() => match t.data[..] {
                [hi, lo] => ((hi as u64) << 24 | lo as u64) as usize,
                _ => {
                    return Err(Error::Ddp(ddp_core::Error::Mismatch(format!(
                        "checkpoint tensor `optim.{LEGACY_STEP_KEY}` has {} values, expected 2",
                        t.data.len()
                    ))))
                }
            },
            _ => usize::try_from(state.step).map_err(|_| {
                Error::Unsupported(format!("AdamW step count {} too large", state.step))
            })?,
        };
        Ok(())
    }
}

super::impl_optimizer!(AdamW, ParamsAdamW, "adamw");

/// The hyper-parameters recorded in checkpoints, under PyTorch's names.
fn hyper(p: &ParamsAdamW) -> [(&'static str, f64); 5] {
    [
        ("lr", p.lr),
        ("beta1", p.beta1),
        ("beta2", p.beta2),
        ("eps", p.eps),
        ("weight_decay", p.weight_decay),
    ]
}

impl AdamW {
    /// The operations of `candle_nn::AdamW::step`, in its order. Contiguous f32/f64 CPU
    /// parameters are updated in place (three passes, no temporaries); others with candle's
    /// tensor operations.
    fn apply_step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_t += 1;
        let coefs = Coefs::pair(&self.params, self.step_t);
        for s in &self.slots {
            let Some(g) = s.target.grad(grads) else {
                continue;
            };
            // The moments do not depend on weight decay; the update does, run by run.
            let k = &coefs[0];
            let theta = match &s.target {
                Target::Var(var) => var,
                Target::Pieces { like, pieces, .. } => {
                    // Contiguous f32/f64 CPU views (checked when set): the in-place passes,
                    // the moments over the whole slot, the update piece by piece.
                    if like.elem_count() == 0 {
                        continue;
                    }
                    let g = g.contiguous()?;
                    s.m.as_tensor().inplace_op2(&g, &Fused::Moment1(k))?;
                    s.v.as_tensor().inplace_op2(&g, &Fused::Moment2(k))?;
                    for p in pieces {
                        let n = p.view.elem_count();
                        for (a, b, d) in runs_in(&s.decay, p.offset, p.offset + n) {
                            p.view.narrow(0, a - p.offset, b - a)?.inplace_op3(
                                &s.m.as_tensor().narrow(0, a, b - a)?,
                                &s.v.as_tensor().narrow(0, a, b - a)?,
                                &Fused::Update(&coefs[usize::from(d)]),
                            )?;
                        }
                    }
                    continue;
                }
            };
            let in_place = theta.device().is_cpu()
                && matches!(theta.dtype(), DType::F32 | DType::F64)
                && [theta, &s.m, &s.v].iter().all(|t| t.is_contiguous());
            if in_place {
                if theta.elem_count() == 0 {
                    continue; // candle refuses in-place ops on zero-size tensors
                }
                let g = g.contiguous()?;
                s.m.as_tensor().inplace_op2(&g, &Fused::Moment1(k))?;
                s.v.as_tensor().inplace_op2(&g, &Fused::Moment2(k))?;
                if let [(_, d)] = s.decay[..] {
                    theta.as_tensor().inplace_op3(
                        s.m.as_tensor(),
                        s.v.as_tensor(),
                        &Fused::Update(&coefs[usize::from(d)]),
                    )?;
                    continue;
                }
                // Views of the contiguous storage, updated in place run by run.
                let flat = |t: &Tensor| t.flatten_all();
                let (x, m, v) = (flat(theta)?, flat(&s.m)?, flat(&s.v)?);
                for (a, b, d) in runs_in(&s.decay, 0, x.elem_count()) {
                    x.narrow(0, a, b - a)?.inplace_op3(
                        &m.narrow(0, a, b - a)?,
                        &v.narrow(0, a, b - a)?,
                        &Fused::Update(&coefs[usize::from(d)]),
                    )?;
                }
            } else {
                let next_m = ((s.m.as_tensor() * k.beta1)? + (g * (1.0 - k.beta1))?)?;
                let next_v = ((s.v.as_tensor() * k.beta2)? + (g.sqr()? * (1.0 - k.beta2))?)?;
                let m_hat = (&next_m * k.scale_m)?;
                let v_hat = (&next_v * k.scale_v)?;
                let decayed = |t: &Tensor, d: bool| t * (1f64 - coefs[usize::from(d)].lr_lambda);
                let next_theta = match s.decay[..] {
                    [(_, d)] => decayed(theta.as_tensor(), d)?,
                    _ => {
                        let x = theta.as_tensor().flatten_all()?;
                        let parts = runs_in(&s.decay, 0, x.elem_count())
                            .map(|(a, b, d)| decayed(&x.narrow(0, a, b - a)?, d))
                            .collect::<candle_core::Result<Vec<_>>>()?;
                        Tensor::cat(&parts, 0)?.reshape(theta.shape())?
                    }
                };
                let adjusted_grad = (m_hat / (v_hat.sqrt()? + k.eps)?)?;
                let next_theta = (next_theta - (adjusted_grad * k.lr)?)?;
                s.m.set(&next_m)?;
                s.v.set(&next_v)?;
                theta.set(&next_theta)?;
            }
        }
        Ok(())
    }
}

/// The scalars of one step, as `candle_nn::AdamW` computes them (in f64).
struct Coefs {
    lr: f64,
    lr_lambda: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    scale_m: f64,
    scale_v: f64,
}

impl Coefs {
    /// The coefficients without weight decay, then with.
    fn pair(p: &ParamsAdamW, step_t: usize) -> [Coefs; 2] {
        let no_decay = ParamsAdamW {
            weight_decay: 0.0,
            ..p.clone()
        };
        [Coefs::new(&no_decay, step_t), Coefs::new(p, step_t)]
    }

    fn new(p: &ParamsAdamW, step_t: usize) -> Coefs {
        Coefs {
            lr: p.lr,
            lr_lambda: p.lr * p.weight_decay,
            beta1: p.beta1,
            beta2: p.beta2,
            eps: p.eps,
            scale_m: 1f64 / (1f64 - p.beta1.powi(step_t as i32)),
            scale_v: 1f64 / (1f64 - p.beta2.powi(step_t as i32)),
        }
    }
}

/// The in-place passes. Each element goes through the operations candle's tensor version
/// performs, in its order and precision: `t * c` is candle's `affine(c, 0)`, i.e. `t * c + 0`
/// (which turns `-0` into `+0`, kept here so that results stay bit-identical), `t + eps` is
/// `affine(1, eps)`.
enum Fused<'a> {
    /// `m = m * beta1 + g * (1 - beta1)`
    Moment1(&'a Coefs),
    /// `v = v * beta2 + g² * (1 - beta2)`
    Moment2(&'a Coefs),
    /// `theta = theta * (1 - lr * wd) - (m * scale_m) / (sqrt(v * scale_v) + eps) * lr`
    Update(&'a Coefs),
}

/// f32 and f64, the dtypes of the in-place path.
trait Real: WithDType + std::ops::Div<Output = Self> {
    fn sqrt(self) -> Self;
}

impl Real for f32 {
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
}

impl Real for f64 {
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
}

impl Fused<'_> {
    fn moment<T: Real>(&self, acc: &mut [T], g: &[T]) {
        let zero = T::from_f64(0.0);
        match self {
            Fused::Moment1(k) => {
                let (b, c) = (T::from_f64(k.beta1), T::from_f64(1.0 - k.beta1));
                for (m, &g) in acc.iter_mut().zip(g) {
                    *m = (*m * b + zero) + (g * c + zero);
                }
            }
            Fused::Moment2(k) => {
                let (b, c) = (T::from_f64(k.beta2), T::from_f64(1.0 - k.beta2));
                for (v, &g) in acc.iter_mut().zip(g) {
                    *v = (*v * b + zero) + ((g * g) * c + zero);
                }
            }
            Fused::Update(_) => unreachable!("the update is a three-operand op"),
        }
    }

    fn update<T: Real>(k: &Coefs, theta: &mut [T], m: &[T], v: &[T]) {
        let zero = T::from_f64(0.0);
        let one = T::from_f64(1.0);
        let (sm, sv) = (T::from_f64(k.scale_m), T::from_f64(k.scale_v));
        let (decay, lr, eps) = (
            T::from_f64(1f64 - k.lr_lambda),
            T::from_f64(k.lr),
            T::from_f64(k.eps),
        );
        for ((t, &m), &v) in theta.iter_mut().zip(m).zip(v) {
            let adjusted = (m * sm + zero) / ((v * sv + zero).sqrt() * one + eps);
            *t = (*t * decay + zero) - (adjusted * lr + zero);
        }
    }
}

fn contiguous<'a, T>(s: &'a [T], l: &Layout, name: &str) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("{name}: operands must be contiguous"),
    }
}

impl InplaceOp2 for Fused<'_> {
    fn name(&self) -> &'static str {
        "ddp-adamw-moment"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let Some((a, b)) = l1.contiguous_offsets() else {
            candle_core::bail!("ddp-adamw-moment: the moment must be contiguous");
        };
        match (s1, s2) {
            (CpuStorage::F32(acc), CpuStorage::F32(g)) => {
                self.moment(&mut acc[a..b], contiguous(g, l2, "ddp-adamw-moment")?)
            }
            (CpuStorage::F64(acc), CpuStorage::F64(g)) => {
                self.moment(&mut acc[a..b], contiguous(g, l2, "ddp-adamw-moment")?)
            }
            _ => candle_core::bail!("ddp-adamw-moment: moment and gradient dtypes differ"),
        }
        Ok(())
    }
}

impl InplaceOp3 for Fused<'_> {
    fn name(&self) -> &'static str {
        "ddp-adamw-update"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<()> {
        let Fused::Update(k) = self else {
            candle_core::bail!("ddp-adamw-update: not an update");
        };
        let Some((a, b)) = l1.contiguous_offsets() else {
            candle_core::bail!("ddp-adamw-update: the parameter must be contiguous");
        };
        let name = "ddp-adamw-update";
        match (s1, s2, s3) {
            (CpuStorage::F32(t), CpuStorage::F32(m), CpuStorage::F32(v)) => Fused::update(
                k,
                &mut t[a..b],
                contiguous(m, l2, name)?,
                contiguous(v, l3, name)?,
            ),
            (CpuStorage::F64(t), CpuStorage::F64(m), CpuStorage::F64(v)) => Fused::update(
                k,
                &mut t[a..b],
                contiguous(m, l2, name)?,
                contiguous(v, l3, name)?,
            ),
            _ => candle_core::bail!("ddp-adamw-update: parameter and moment dtypes differ"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};
    use candle_nn::Optimizer;
    use ddp_core::checkpoint::CheckpointMeta;

    fn vars(seed: f32) -> Vec<(String, Var)> {
        vars_of(seed, DType::F32)
    }

    fn vars_of(seed: f32, dtype: DType) -> Vec<(String, Var)> {
        let mk = |n: usize, k: f32| {
            let d: Vec<f32> = (0..n).map(|i| ((i as f32 + k) * 0.37).sin()).collect();
            let t = Tensor::from_vec(d, n, &Device::Cpu).unwrap();
            Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
        };
        vec![("a".into(), mk(7, seed)), ("b".into(), mk(3, seed + 1.0))]
    }

    fn loss(vs: &[(String, Var)], k: usize) -> Tensor {
        let a = vs[0].1.as_tensor();
        let b = vs[1].1.as_tensor();
        let t = ((a.sqr().unwrap().sum_all().unwrap() * (k as f64 + 1.0)).unwrap()
            + b.sin().unwrap().sum_all().unwrap())
        .unwrap();
        t.to_dtype(DType::F32).unwrap()
    }

    fn values(vs: &[(String, Var)]) -> Vec<Vec<f64>> {
        let f64s = |v: &Var| {
            let t = v.as_tensor().to_dtype(DType::F64).unwrap();
            t.to_vec1::<f64>().unwrap()
        };
        vs.iter().map(|(_, v)| f64s(v)).collect()
    }

    /// The in-place passes (f32 and f64 CPU parameters) against candle's tensor operations,
    /// bit for bit, with and without weight decay.
    #[test]
    fn matches_candle_adamw_bitwise() {
        for (dtype, weight_decay) in [(DType::F32, 0.01), (DType::F64, 0.01), (DType::F32, 0.0)] {
            let p = ParamsAdamW {
                lr: 0.05,
                weight_decay,
                ..Default::default()
            };
            let ours_vars = vars_of(0.0, dtype);
            let theirs_vars = vars_of(0.0, dtype);
            let mut ours = AdamW::new_named(ours_vars.clone(), p.clone()).unwrap();
            let theirs = theirs_vars.iter().map(|(_, v)| v.clone()).collect();
            let mut theirs = candle_nn::AdamW::new(theirs, p).unwrap();
            for k in 0..5 {
                ours.step(&loss(&ours_vars, k).backward().unwrap()).unwrap();
                theirs
                    .step(&loss(&theirs_vars, k).backward().unwrap())
                    .unwrap();
                let (a, b) = (values(&ours_vars), values(&theirs_vars));
                assert_eq!(a, b, "{dtype:?}, weight decay {weight_decay}, step {k}");
            }
        }
    }

    /// Decay only where the filter says: with the same gradients, the decayed variable moves
    /// as candle's AdamW with decay moves it, the other as candle's AdamW without decay.
    #[test]
    fn the_decay_filter_decays_only_the_variables_it_selects() {
        let mk = |wd: f64| ParamsAdamW {
            lr: 0.1,
            weight_decay: wd,
            ..Default::default()
        };
        // The loss is a sum of one term per variable: each one's updates depend on it alone.
        let (ours, with, without) = (vars(0.5), vars(0.5), vars(0.5));
        let mut opt =
            AdamW::new_named_with_decay(ours.clone(), mk(0.5), |name, _| name == "a").unwrap();
        let all = |vs: &[(String, Var)]| vs.iter().map(|(_, v)| v.clone()).collect::<Vec<_>>();
        let mut decayed = candle_nn::AdamW::new(all(&with), mk(0.5)).unwrap();
        let mut plain = candle_nn::AdamW::new(all(&without), mk(0.0)).unwrap();
        for k in 0..3 {
            opt.backward_step(&loss(&ours, k)).unwrap();
            decayed.backward_step(&loss(&with, k)).unwrap();
            plain.backward_step(&loss(&without, k)).unwrap();
        }
        let (got, a, b) = (values(&ours), values(&with), values(&without));
        assert_eq!(got[0], a[0], "the selected variable decays");
        assert_eq!(got[1], b[1], "the other does not");
        assert_ne!(a[0], b[0], "decay changes the result (the test can tell)");
    }

    #[test]
    fn save_and_load_continue_exactly() {
        let p = ParamsAdamW::default();
        let full = vars(2.0);
        let mut opt = AdamW::new_named(full.clone(), p.clone()).unwrap();
        for k in 0..6 {
            opt.step(&loss(&full, k).backward().unwrap()).unwrap();
        }

        let first = vars(2.0);
        let mut opt1 = AdamW::new_named(first.clone(), p.clone()).unwrap();
        for k in 0..3 {
            opt1.step(&loss(&first, k).backward().unwrap()).unwrap();
        }
        let mut ckpt = Checkpoint::new(CheckpointMeta::default());
        crate::checkpoint::save_vars(&mut ckpt, &first).unwrap();
        opt1.save_state(&mut ckpt).unwrap();
        let ckpt = Checkpoint::from_bytes(&ckpt.to_bytes().unwrap(), "test").unwrap();
        assert!(ckpt.get("optim.a.exp_avg_sq").is_some());

        let second = vars(9.0); // different values: everything comes from the checkpoint
        crate::checkpoint::load_vars(&ckpt, &second).unwrap();
        let mut opt2 = AdamW::new_named(second.clone(), p).unwrap();
        opt2.load_state(&ckpt).unwrap();
        assert_eq!(opt2.step_count(), 3);
        for k in 3..6 {
            opt2.step(&loss(&second, k).backward().unwrap()).unwrap();
        }
        assert_eq!(values(&second), values(&full));

        let mut missing = Checkpoint::new(CheckpointMeta::default());
        crate::checkpoint::save_vars(&mut missing, &second).unwrap();
        let e = opt2.load_state(&missing).unwrap_err().to_string();
        assert!(e.contains("optim.a.exp_avg"), "{e}");
    }

    #[test]
    fn format_1_step_tensor_loads_and_kind_is_checked_through_dyn_optimizer() {
        use crate::optim::{DynOptimizer, ParamsSgd, Sgd};
        let vs = vars(1.0);
        let mut opt = AdamW::new_named(vs.clone(), ParamsAdamW::default()).unwrap();
        for k in 0..3 {
            opt.step(&loss(&vs, k).backward().unwrap()).unwrap();
        }
        let mut ckpt = Checkpoint::new(CheckpointMeta::default());
        opt.save_state(&mut ckpt).unwrap();
        assert_eq!(ckpt.optimizer.as_ref().unwrap().step, 3);
        let mut boxed: Box<dyn DynOptimizer> =
            Box::new(AdamW::new_named(vars(5.0), ParamsAdamW::default()).unwrap());
        ckpt.load_optimizer(&mut *boxed).unwrap();
        assert_eq!(boxed.state_dict().unwrap(), opt.state_dict().unwrap());

        // As format 1 stored it: no record, the step as a tensor of two 24-bit halves.
        ckpt.optimizer = None;
        ckpt.insert("optim.__adamw.step", vec![2], vec![1.0, 3.0])
            .unwrap();
        let mut old = AdamW::new_named(vars(5.0), ParamsAdamW::default()).unwrap();
        old.load_state(&ckpt).unwrap();
        assert_eq!(old.step_count(), (1 << 24) + 3);

        let mut sgd: Box<dyn DynOptimizer> =
            Box::new(Sgd::new_named(vars(5.0), ParamsSgd::default()).unwrap());
        let mut adamw_ckpt = Checkpoint::new(CheckpointMeta::default());
        adamw_ckpt.save_optimizer(&opt).unwrap();
        let e = adamw_ckpt
            .load_optimizer(&mut *sgd)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("adamw optimizer state") && e.contains("sgd"),
            "{e}"
        );
    }
}
