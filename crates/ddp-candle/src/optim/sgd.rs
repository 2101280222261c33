//! [`Sgd`]: PyTorch's `torch.optim.SGD`, updating CPU parameters in place in one fused pass.
//!
//! Per parameter `p` with gradient `g` (PyTorch's order of operations):
//!
//! ```text
//! d = maximize ? -g : g
//! d = d + weight_decay * p                          (if weight_decay != 0)
//! buf = first step ? d : momentum * buf + (1 - dampening) * d      (if momentum != 0)
//! d = nesterov ? d + momentum * buf : buf                          (if momentum != 0)
//! p = p - lr * d
//! ```
//!
//! For contiguous f32/f64 parameters on the CPU this is one loop over `p`, `g` and `buf` that
//! writes `p` in place (a candle in-place op): no temporaries. `candle_nn::SGD` computes
//! `p.set(p - g * lr)`, three full-size passes plus two allocations per tensor
//! (`docs/benchmarks.md`, "Candle on CPUs"). Other dtypes and devices take the same formula with
//! tensor operations. The momentum buffers are saved to checkpoints as
//! `optim.<param>.momentum_buffer` (f32), PyTorch's state name.

use super::{echo_pieces, echo_slot, write_through_named, EchoGrads, Piece, Target};
use crate::checkpoint::tensor_like;
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Tensor, Var, WithDType};
use ddp_core::checkpoint::{Checkpoint, OptimizerState, OptimizerStateDict};
use std::cell::RefCell;

/// Hyper-parameters of [`Sgd`], with PyTorch's names and defaults (except `lr`, which PyTorch
/// requires and here defaults to its documented example value 0.1).
#[derive(Debug, Clone, PartialEq)]
pub struct ParamsSgd {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
    pub maximize: bool,
}

impl Default for ParamsSgd {
    fn default() -> Self {
        ParamsSgd {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        }
    }
}

impl ParamsSgd {
    /// Plain SGD with learning rate `lr` (what `candle_nn::SGD::new(vars, lr)` does).
    pub fn with_lr(lr: f64) -> Self {
        ParamsSgd {
            lr,
            ..Default::default()
        }
    }

    fn validate(&self) -> Result<()> {
        if self.nesterov && (self.momentum <= 0.0 || self.dampening != 0.0) {
            return Err(Error::Unsupported(format!(
                "Nesterov momentum requires a momentum and zero dampening (momentum {}, dampening {})",
                self.momentum, self.dampening
            )));
        }
        if self.lr < 0.0 || self.momentum < 0.0 || self.weight_decay < 0.0 {
            return Err(Error::Unsupported(format!(
                "invalid SGD parameters: lr {}, momentum {}, weight_decay {} (none may be negative)",
                self.lr, self.momentum, self.weight_decay
            )));
        }
        Ok(())
    }
}

/// Momentum buffer of one parameter: host vectors for the in-place CPU path, a tensor otherwise.
enum Buffer {
    None,
    F32(Vec<f32>),
    F64(Vec<f64>),
    Tensor(Tensor),
}

struct Slot {
    name: String,
    target: Target,
    buf: Buffer,
}

/// PyTorch's SGD (see the module docs); implements `candle_nn::Optimizer`.
pub struct Sgd {
    slots: Vec<Slot>,
    params: ParamsSgd,
    steps: u64,
}

impl Sgd {
    /// Optimizes the named variables (names key the momentum buffers in checkpoints; non-float
    /// variables are skipped, as in candle).
    pub fn new_named(
        vars: impl IntoIterator<Item = (String, Var)>,
        params: ParamsSgd,
    ) -> Result<Self> {
        params.validate()?;
        let slots = vars
            .into_iter()
            .filter(|(_, v)| v.dtype().is_float())
            .map(|(name, var)| Slot {
                name,
                target: Target::Var(var),
                buf: Buffer::None,
            })
            .collect();
        Ok(Sgd {
            slots,
            params,
            steps: 0,
        })
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

    /// ZeRO's write-through step (stages 1 and 2): the same update as `step` for every slot
    /// written through that has a gradient in `grads`, each gradient then holding the slot's
    /// updated values (see [`EchoGrads`]).
    pub(crate) fn step_through(&mut self, grads: &mut EchoGrads<'_>) -> Result<()> {
        self.steps += 1;
        let params = &self.params;
        for s in &mut self.slots {
            let Some((pieces, g)) = echo_slot(&s.target, grads)? else {
                continue;
            };
            if matches!(s.buf, Buffer::None) && params.momentum != 0.0 {
                s.buf = Buffer::F32(Vec::new());
            }
            let mut buf = match &mut s.buf {
                Buffer::None => None,
                Buffer::F32(b) => Some(b),
                _ => {
                    return Err(Error::Unsupported(format!(
                        "step_through: {} has a momentum buffer that is not f32 on the CPU",
                        s.name
                    )))
                }
            };
            echo_pieces(pieces, g, |at, x, g| {
                update(params, x, g, buf.as_deref_mut(), at)
            })?;
        }
        Ok(())
    }

    pub fn params(&self) -> &ParamsSgd {
        &self.params
    }

    pub fn set_params(&mut self, params: ParamsSgd) -> Result<()> {
        params.validate()?;
        self.params = params;
        Ok(())
    }

    /// Optimizer steps taken so far (restored from checkpoints).
    pub fn step_count(&self) -> u64 {
        self.steps
    }
}

impl Sgd {
    /// State `momentum_buffer` per parameter (PyTorch's name), the step count, and the
    /// hyper-parameters `lr`, `momentum`, `dampening`, `weight_decay`, `nesterov`, `maximize` (0/1).
    fn save_slots(&self, state: &mut OptimizerStateDict) -> Result<()> {
        for s in &self.slots {
            let data = match &s.buf {
                Buffer::None => continue,
                Buffer::F32(b) => b.clone(),
                Buffer::F64(b) => b.iter().map(|&x| x as f32).collect(),
                Buffer::Tensor(t) => t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?,
            };
            let dims = s.target.like().dims().to_vec();
            state.insert(&s.name, "momentum_buffer", dims, data)?;
        }
        Ok(())
    }

    /// Restores what [`save_slots`](Self::save_slots) wrote.
    fn load_slots(&mut self, state: &OptimizerStateDict) -> Result<()> {
        for s in &mut self.slots {
            let Some(t) = state.get(&s.name, "momentum_buffer") else {
                s.buf = Buffer::None;
                continue;
            };
            let key = Checkpoint::optim_key(&s.name, "momentum_buffer");
            let like = s.target.like();
            let t = tensor_like(t, &key, like)?;
            s.buf = match (like.device().is_cpu(), like.dtype()) {
                (true, DType::F32) => Buffer::F32(t.flatten_all()?.to_vec1()?),
                (true, DType::F64) => Buffer::F64(t.flatten_all()?.to_vec1()?),
                _ => Buffer::Tensor(t),
            };
        }
        self.steps = state.step;
        Ok(())
    }
}

super::impl_optimizer!(Sgd, ParamsSgd, "sgd");

/// The hyper-parameters recorded in checkpoints, under PyTorch's names (flags as 0/1).
fn hyper(p: &ParamsSgd) -> [(&'static str, f64); 6] {
    [
        ("lr", p.lr),
        ("momentum", p.momentum),
        ("dampening", p.dampening),
        ("weight_decay", p.weight_decay),
        ("nesterov", p.nesterov as u8 as f64),
        ("maximize", p.maximize as u8 as f64),
    ]
}

impl Sgd {
    fn apply_step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.steps += 1;
        for s in &mut self.slots {
            let Some(g) = s.target.grad(grads) else {
                continue;
            };
            let var = match &s.target {
                Target::Var(var) => var,
                Target::Pieces { like, pieces, .. } => {
                    // Contiguous f32/f64 CPU views (checked when set): the fused pass piece by
                    // piece, each over its range of the momentum buffer (filled in order on the
                    // first step).
                    if like.elem_count() == 0 {
                        continue;
                    }
                    if matches!(s.buf, Buffer::None) && self.params.momentum != 0.0 {
                        s.buf = match like.dtype() {
                            DType::F32 => Buffer::F32(Vec::new()),
                            _ => Buffer::F64(Vec::new()),
                        };
                    }
                    let g = g.contiguous()?;
                    for p in pieces {
                        let n = p.view.elem_count();
                        if n == 0 {
                            continue;
                        }
                        let op = Fused {
                            p: &self.params,
                            buf: RefCell::new(&mut s.buf),
                            offset: p.offset,
                        };
                        p.view.inplace_op2(&g.narrow(0, p.offset, n)?, &op)?;
                    }
                    continue;
                }
            };
            if var.elem_count() == 0 {
                // Nothing to update; candle refuses in-place ops on zero-size tensors.
                continue;
            }
            let in_place = var.device().is_cpu()
                && var.is_contiguous()
                && matches!(var.dtype(), DType::F32 | DType::F64)
                && !matches!(s.buf, Buffer::Tensor(_));
            if in_place {
                if matches!(s.buf, Buffer::None) && self.params.momentum != 0.0 {
                    s.buf = match var.dtype() {
                        DType::F32 => Buffer::F32(Vec::new()),
                        _ => Buffer::F64(Vec::new()),
                    };
                }
                let g = g.contiguous()?;
                let op = Fused {
                    p: &self.params,
                    buf: RefCell::new(&mut s.buf),
                    offset: 0,
                };
                var.as_tensor().inplace_op2(&g, &op)?;
            } else {
                tensor_step(&self.params, var, g, &mut s.buf)?;
            }
        }
        Ok(())
    }
}

/// The in-place CPU update of one parameter (the momentum buffer rides along; an empty vector is
/// filled on the first step).
struct Fused<'a> {
    p: &'a ParamsSgd,
    buf: RefCell<&'a mut Buffer>,
    /// Where the parameter's elements start in the momentum buffer (a piece of a ZeRO slot).
    offset: usize,
}

impl InplaceOp2 for Fused<'_> {
    fn name(&self) -> &'static str {
        "ddp-sgd"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (Some((p0, p1)), Some((g0, g1))) = (l1.contiguous_offsets(), l2.contiguous_offsets())
        else {
            candle_core::bail!("ddp-sgd: parameter and gradient must be contiguous");
        };
        let mut buf = self.buf.borrow_mut();
        match (s1, s2, &mut **buf) {
            (CpuStorage::F32(p), CpuStorage::F32(g), b) => {
                let b = match b {
                    Buffer::F32(v) => Some(v),
                    _ => None,
                };
                update(self.p, &mut p[p0..p1], &g[g0..g1], b, self.offset);
            }
            (CpuStorage::F64(p), CpuStorage::F64(g), b) => {
                let b = match b {
                    Buffer::F64(v) => Some(v),
                    _ => None,
                };
                update(self.p, &mut p[p0..p1], &g[g0..g1], b, self.offset);
            }
            _ => candle_core::bail!("ddp-sgd: parameter and gradient dtypes differ"),
        }
        Ok(())
    }
}

/// One pass of the update over a parameter, its gradient and (with momentum) its buffer.
/// One fused pass over `param` (elements `offset..` of its slot's momentum buffer, which the
/// first step fills in order: a buffer exactly `offset` long is still being filled).
fn update<T: WithDType + std::ops::Neg<Output = T>>(
    p: &ParamsSgd,
    param: &mut [T],
    grad: &[T],
    buf: Option<&mut Vec<T>>,
    offset: usize,
) {
    let lr = T::from_f64(p.lr);
    let wd = T::from_f64(p.weight_decay);
    let m = T::from_f64(p.momentum);
    let damp = T::from_f64(1.0 - p.dampening);
    let dir = |x: &T, g: T| {
        let d = if p.maximize { -g } else { g };
        if p.weight_decay != 0.0 {
            d + wd * *x
        } else {
            d
        }
    };
    match buf {
        None => {
            for (x, &g) in param.iter_mut().zip(grad) {
                let d = dir(x, g);
                *x -= d * lr;
            }
        }
        Some(b) if b.len() == offset => {
            b.reserve(param.len());
            for (x, &g) in param.iter_mut().zip(grad) {
                let d = dir(x, g);
                b.push(d);
                let d = if p.nesterov { d + m * d } else { d };
                *x -= d * lr;
            }
        }
        Some(b) => {
            let b = &mut b[offset..offset + param.len()];
            for ((x, &g), b) in param.iter_mut().zip(grad).zip(b.iter_mut()) {
                let d = dir(x, g);
                *b = m * *b + damp * d;
                let d = if p.nesterov { d + m * *b } else { *b };
                *x -= d * lr;
            }
        }
    }
}

/// The same update with tensor operations (other dtypes and devices).
fn tensor_step(p: &ParamsSgd, var: &Var, g: &Tensor, buf: &mut Buffer) -> candle_core::Result<()> {
    let x = var.as_tensor();
    let mut d = if p.maximize { g.neg()? } else { g.clone() };
    if p.weight_decay != 0.0 {
        d = (d + (x * p.weight_decay)?)?;
    }
    if p.momentum != 0.0 {
        let b = match buf {
            Buffer::Tensor(b) => ((&*b * p.momentum)? + (&d * (1.0 - p.dampening))?)?,
            _ => d.clone(),
        };
        d = if p.nesterov {
            (d + (&b * p.momentum)?)?
        } else {
            b.clone()
        };
        *buf = Buffer::Tensor(b);
    }
    var.set(&x.sub(&(d * p.lr)?)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use candle_nn::Optimizer;
    use ddp_core::checkpoint::CheckpointMeta;

    fn vars(seed: f32, dtype: DType) -> Vec<(String, Var)> {
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
        ((a.sqr().unwrap().sum_all().unwrap() * (k as f64 + 1.0)).unwrap()
            + b.sin().unwrap().sum_all().unwrap())
        .unwrap()
    }

    fn values(vs: &[(String, Var)]) -> Vec<Vec<f64>> {
        vs.iter()
            .map(|(_, v)| {
                let t = v.as_tensor().to_dtype(DType::F64).unwrap();
                t.to_vec1::<f64>().unwrap()
            })
            .collect()
    }

    /// PyTorch's algorithm in f64 on host vectors, from the gradients of `loss`.
    fn reference(p: &ParamsSgd, steps: usize) -> Vec<Vec<f64>> {
        let vs = vars(0.0, DType::F64);
        let mut bufs: Vec<Option<Vec<f64>>> = vec![None; vs.len()];
        for k in 0..steps {
            let grads = loss(&vs, k).backward().unwrap();
            for ((_, v), buf) in vs.iter().zip(&mut bufs) {
                let g = grads.get(v).unwrap().to_vec1::<f64>().unwrap();
                let mut x = v.as_tensor().to_vec1::<f64>().unwrap();
                for i in 0..x.len() {
                    let mut d = if p.maximize { -g[i] } else { g[i] };
                    d += p.weight_decay * x[i];
                    if p.momentum != 0.0 {
                        let b = buf.get_or_insert_with(|| vec![f64::NAN; x.len()]);
                        b[i] = if b[i].is_nan() {
                            d
                        } else {
                            p.momentum * b[i] + (1.0 - p.dampening) * d
                        };
                        d = if p.nesterov {
                            d + p.momentum * b[i]
                        } else {
                            b[i]
                        };
                    }
                    x[i] -= p.lr * d;
                }
                v.set(&Tensor::from_vec(x, v.shape(), &Device::Cpu).unwrap())
                    .unwrap();
            }
        }
        values(&vs)
    }

    fn run(p: &ParamsSgd, dtype: DType, steps: usize) -> Vec<Vec<f64>> {
        let vs = vars(0.0, dtype);
        let mut opt = Sgd::new_named(vs.clone(), p.clone()).unwrap();
        for k in 0..steps {
            opt.step(&loss(&vs, k).backward().unwrap()).unwrap();
        }
        values(&vs)
    }

    #[test]
    fn plain_sgd_is_bit_identical_to_candle_sgd() {
        let ours = vars(0.0, DType::F32);
        let theirs = vars(0.0, DType::F32);
        let mut a = Sgd::new_named(ours.clone(), ParamsSgd::with_lr(0.05)).unwrap();
        let mut b =
            candle_nn::SGD::new(theirs.iter().map(|(_, v)| v.clone()).collect(), 0.05).unwrap();
        for k in 0..5 {
            a.step(&loss(&ours, k).backward().unwrap()).unwrap();
            b.step(&loss(&theirs, k).backward().unwrap()).unwrap();
            assert_eq!(values(&ours), values(&theirs), "step {k}");
        }
    }

    fn variants() -> [ParamsSgd; 4] {
        [
            ParamsSgd::with_lr(0.05),
            ParamsSgd {
                lr: 0.05,
                momentum: 0.9,
                ..Default::default()
            },
            ParamsSgd {
                lr: 0.03,
                momentum: 0.8,
                dampening: 0.3,
                weight_decay: 0.01,
                ..Default::default()
            },
            ParamsSgd {
                lr: 0.02,
                momentum: 0.9,
                nesterov: true,
                weight_decay: 0.1,
                maximize: true,
                ..Default::default()
            },
        ]
    }

    #[test]
    fn every_variant_matches_pytorch_algorithm_in_place_and_on_tensors() {
        for p in &variants() {
            let want = reference(p, 6);
            // f64 in place: the same arithmetic as the reference up to operation order.
            let got = run(p, DType::F64, 6);
            // f16 takes the tensor path.
            let half = run(p, DType::F16, 6);
            for ((w, g), h) in want
                .iter()
                .flatten()
                .zip(got.iter().flatten())
                .zip(half.iter().flatten())
            {
                assert!(
                    (w - g).abs() <= 1e-12 * w.abs().max(1.0),
                    "{p:?}: {w} vs {g}"
                );
                assert!(
                    (w - h).abs() <= 2e-2 * w.abs().max(1.0),
                    "{p:?} f16: {w} vs {h}"
                );
            }
            // f32 in place against f32 through tensors (BF16 -> tensor path covers the rest).
            let f32_vals = run(p, DType::F32, 6);
            for (w, g) in want.iter().flatten().zip(f32_vals.iter().flatten()) {
                assert!(
                    (w - g).abs() <= 1e-5 * w.abs().max(1.0),
                    "{p:?} f32: {w} vs {g}"
                );
            }
        }
    }

    /// The tensor-op path (`tensor_step`, taken for other dtypes and devices) in f64, so that it
    /// can be held to the reference algorithm tightly (a dropped weight decay or dampening shows).
    fn run_tensor_path(p: &ParamsSgd, steps: usize) -> Vec<Vec<f64>> {
        let vs = vars(0.0, DType::F64);
        let mut bufs: Vec<Buffer> = vs.iter().map(|_| Buffer::None).collect();
        for k in 0..steps {
            let grads = loss(&vs, k).backward().unwrap();
            for ((_, v), b) in vs.iter().zip(&mut bufs) {
                tensor_step(p, v, grads.get(v).unwrap(), b).unwrap();
            }
        }
        values(&vs)
    }

    #[test]
    fn tensor_path_matches_pytorch_algorithm_in_f64() {
        for p in variants() {
            let want = reference(&p, 6);
            let got = run_tensor_path(&p, 6);
            for (w, g) in want.iter().flatten().zip(got.iter().flatten()) {
                assert!(
                    (w - g).abs() <= 1e-9 * w.abs().max(1.0),
                    "{p:?} tensor path: {w} vs {g}"
                );
            }
        }
    }

    #[test]
    fn invalid_parameters_are_refused() {
        let e = Sgd::new_named(
            vars(0.0, DType::F32),
            ParamsSgd {
                nesterov: true,
                ..Default::default()
            },
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("Nesterov"), "{e}");
    }

    #[test]
    fn momentum_state_saves_and_resumes_exactly() {
        let p = ParamsSgd {
            lr: 0.05,
            momentum: 0.9,
            ..Default::default()
        };
        let full = vars(2.0, DType::F32);
        let mut opt = Sgd::new_named(full.clone(), p.clone()).unwrap();
        for k in 0..6 {
            opt.step(&loss(&full, k).backward().unwrap()).unwrap();
        }
        let first = vars(2.0, DType::F32);
        let mut opt1 = Sgd::new_named(first.clone(), p.clone()).unwrap();
        for k in 0..3 {
            opt1.step(&loss(&first, k).backward().unwrap()).unwrap();
        }
        let mut ckpt = Checkpoint::new(CheckpointMeta::default());
        crate::checkpoint::save_vars(&mut ckpt, &first).unwrap();
        opt1.save_state(&mut ckpt).unwrap();
        let ckpt = Checkpoint::from_bytes(&ckpt.to_bytes().unwrap(), "test").unwrap();
        assert!(ckpt.get("optim.a.momentum_buffer").is_some());

        let second = vars(9.0, DType::F32);
        crate::checkpoint::load_vars(&ckpt, &second).unwrap();
        let mut opt2 = Sgd::new_named(second.clone(), p).unwrap();
        opt2.load_state(&ckpt).unwrap();
        for k in 3..6 {
            opt2.step(&loss(&second, k).backward().unwrap()).unwrap();
        }
        assert_eq!(values(&second), values(&full));
    }
}
