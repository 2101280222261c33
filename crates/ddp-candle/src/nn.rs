//! Layers whose CPU backward costs less than candle's own.
//!
//! [`Linear`] is `candle_nn::Linear` (PyTorch's `nn.Linear`: weight `[out, in]`, `y = x Wᵀ + b`,
//! the same parameters, names and forward values bit for bit) as one custom op whose backward is
//! three matmuls:
//! - weight: `gᵀ x`, directly in the weight's `[out, in]` layout. candle differentiates
//!   `x.matmul(&w.t())` through the transpose: it computes `xᵀ g` as `[in, out]`, then adds it,
//!   transposed, element by element (a strided walk) into a zero tensor of the weight's shape;
//! - bias: `1ᵀ g` (a matmul with a row of ones), where candle sums the broadcast dimension of
//!   `g` with its generic strided reduction;
//! - input: `g W`, as candle, and none when the input needs no gradient (data).
//!
//! What it saves: the book's benchmarks chapter (`docs/benchmarks.md`, "Candle on CPUs").
//!
//! On other devices (CUDA, Metal) [`Linear`] runs `candle_nn::Linear`'s ops unchanged.
//!
//! Gradient capture (crate-internal, used by `Ddp`'s backward and by `Fsdp`): candle's
//! `GradStore` adds every gradient into a fresh zero tensor of its shape (`zeros_like` + `add`),
//! so for a moment a weight's gradient exists twice. Under `capture_grads(weights, f)` the
//! backward of [`Linear`] hands the weight gradient of each listed weight to the capture as it
//! is computed (summed when a weight is used twice) and leaves it out of the `GradStore`; the
//! caller gets the same values bit for bit, one buffer and one pass fewer (it lowers ZeRO
//! stage 3's peak: `docs/benchmarks.md`, "ZeRO memory (candle)").
//!
//! ```
//! # use candle_core::{DType, Device, Module, Tensor};
//! # let varmap = candle_nn::VarMap::new();
//! # let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
//! # let x = Tensor::ones((2, 64), DType::F32, &Device::Cpu)?;
//! let fc1 = ddp_candle::nn::linear(64, 4096, vb.pp("fc1"))?; // like candle_nn::linear
//! let y = fc1.forward(&x)?;
//! # assert_eq!(y.dims(), &[2, 4096]);
//! # Ok::<(), candle_core::Error>(())
//! ```

use candle_core::backend::BackendStorage;
use candle_core::backprop::GradStore;
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, Layout, Module, Result, Shape, Tensor, TensorId,
};
use candle_nn::VarBuilder;
use std::cell::RefCell;
use std::collections::HashMap;

/// `candle_nn::Linear` with a weight gradient computed in the weight's own layout (module doc).
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Linear {
    /// A layer over `weight` (`[out, in]`) and an optional `bias` (`[out]`), as
    /// `candle_nn::Linear::new`.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Linear {
        Linear { weight, bias }
    }

    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }
}

impl From<candle_nn::Linear> for Linear {
    fn from(l: candle_nn::Linear) -> Linear {
        Linear::new(l.weight().clone(), l.bias().cloned())
    }
}

/// `candle_nn::linear`: the same variables (`weight`, `bias` under `vb`), the same
/// initialization.
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    candle_nn::linear(in_dim, out_dim, vb).map(Linear::from)
}

/// `candle_nn::linear_no_bias`.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    candle_nn::linear_no_bias(in_dim, out_dim, vb).map(Linear::from)
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if !x.device().is_cpu() || x.rank() < 2 || self.weight.rank() != 2 {
            return candle_nn::Linear::new(self.weight.clone(), self.bias.clone()).forward(x);
        }
        // Leading dimensions flattened into rows: [.., in] -> [rows, in] -> [rows, out] -> [.., out].
        let dims = x.dims().to_vec();
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let x2 = x.reshape((rows, dims[dims.len() - 1]))?;
        let y = match &self.bias {
            Some(b) => x2.apply_op3(&self.weight, b, LinearOp)?,
            None => x2.apply_op2(&self.weight, LinearOp)?,
        };
        let mut out = dims;
        *out.last_mut().expect("rank >= 2") = self.weight.dim(0)?;
        y.reshape(out)
    }
}

/// `x Wᵀ (+ b)` for `x: [n, k]`, `W: [m, k]`, `b: [m]` (the op with two arguments has no bias).
struct LinearOp;

/// `x Wᵀ` and its shape `[n, m]`, by the call candle makes for `x.matmul(&w.t())` (so bit for
/// bit its forward).
fn matmul_wt(
    x: &CpuStorage,
    lx: &Layout,
    w: &CpuStorage,
    lw: &Layout,
) -> Result<(CpuStorage, Shape)> {
    let (n, k) = lx.shape().dims2()?;
    let (m, kw) = lw.shape().dims2()?;
    if k != kw {
        candle_core::bail!(
            "linear: input has {k} features but the weight is [{m}, {kw}] (expects {kw})"
        );
    }
    let y = x.matmul(w, (1, n, m, k), lx, &lw.transpose(0, 1)?)?;
    Ok((y, Shape::from((n, m))))
}

/// The input's and the weight's gradients: `g W` and `gᵀ x` (none for what needs none).
///
/// Computed from detached `x` and `w`: a gradient built from tracked operands would record its
/// own graph (a matmul of `w` or of the activations `x`), and candle's backward then stores
/// `zeros + gw` with that graph attached, keeping every weight gradient's addends alive as long
/// as the gradient (twice the gradients' bytes after `backward()`).
///
/// A weight under [`capture_grads`] has its gradient delivered there instead (none returned).
fn grads_xw(x: &Tensor, w: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let (xd, wd) = (x.detach(), w.detach());
    let gx = x.track_op().then(|| g.matmul(&wd)).transpose()?;
    let gw = w.track_op().then(|| g.t()?.matmul(&xd)).transpose()?;
    let gw = match gw {
        Some(gw) => deliver(w, gw)?,
        None => None,
    };
    Ok((gx, gw))
}

/// The weights whose gradients [`capture_grads`] takes on this thread, and what it took.
struct Capture {
    grads: HashMap<TensorId, Option<Tensor>>,
}

thread_local! {
    static CAPTURE: RefCell<Option<Capture>> = const { RefCell::new(None) };
}

/// `gw` for `w`: kept by the capture if `w` is one of its weights (summed with what it already
/// holds, as candle sums a variable used twice; `None` returned), else handed back.
fn deliver(w: &Tensor, gw: Tensor) -> Result<Option<Tensor>> {
    CAPTURE.with(|c| {
        let mut c = c.borrow_mut();
        let Some(slot) = c.as_mut().and_then(|c| c.grads.get_mut(&w.id())) else {
            return Ok(Some(gw));
        };
        *slot = Some(match slot.take() {
            Some(prev) => (prev + gw)?,
            None => gw,
        });
        Ok(None)
    })
}

/// `loss.backward()`, with the gradients of `weights` that a [`Linear`] of this module computes
/// put into the returned store as they are ([`capture_grads`]) rather than as candle's
/// `zeros + g`: the same store, bit for bit, without a second buffer and an extra pass over
/// each weight gradient. What `Ddp`'s backward runs.
pub(crate) fn backward_capturing(loss: &Tensor, weights: &[&Tensor]) -> Result<GradStore> {
    let (grads, captured) = capture_grads(weights, || loss.backward())?;
    let mut grads = grads?;
    for (w, g) in weights.iter().zip(captured) {
        if let Some(g) = merge_captured(g, grads.remove(w))? {
            grads.insert(w, g);
        }
    }
    Ok(grads)
}

/// A weight's whole gradient from what [`capture_grads`] took of it and what the `GradStore`
/// holds of it: both when the weight is used by a [`Linear`] and by other ops as well.
pub(crate) fn merge_captured(
    captured: Option<Tensor>,
    stored: Option<Tensor>,
) -> Result<Option<Tensor>> {
    Ok(match (captured, stored) {
        (Some(c), Some(s)) => Some((c + s)?),
        (c, s) => c.or(s),
    })
}

/// Runs `f` (a backward) with the gradients of `weights`, where a [`Linear`] of this module
/// computes them, delivered straight to the caller instead of through candle's `GradStore`.
/// candle stores a variable's gradient as `zeros + g`, a second buffer of the weight's size
/// allocated while `g` is alive; the captured gradient is `g` itself, bit for bit what the
/// `GradStore` would have held. Returns `f`'s result and, for each weight in order, its
/// gradient (`None`: no [`Linear`] of this crate used it, so look in the `GradStore`).
/// Weights used by other ops still get their gradients through the `GradStore`, as do biases.
/// Captures do not nest (an inner one is an error); they are per thread, as candle's backward.
pub(crate) fn capture_grads<R>(
    weights: &[&Tensor],
    f: impl FnOnce() -> R,
) -> Result<(R, Vec<Option<Tensor>>)> {
    CAPTURE.with(|c| {
        let mut c = c.borrow_mut();
        if c.is_some() {
            candle_core::bail!("capture_grads: a capture is already running on this thread");
        }
        *c = Some(Capture {
            grads: weights.iter().map(|w| (w.id(), None)).collect(),
        });
        Ok(())
    })?;
    /// Ends the capture even if `f` panics.
    struct End;
    impl Drop for End {
        fn drop(&mut self) {
            CAPTURE.with(|c| c.borrow_mut().take());
        }
    }
    let end = End;
    let r = f();
    let mut cap = CAPTURE
        .with(|c| c.borrow_mut().take())
        .expect("the capture is set until `end` drops");
    drop(end);
    let grads = weights
        .iter()
        .map(|w| cap.grads.remove(&w.id()).flatten())
        .collect();
    Ok((r, grads))
}

impl CustomOp2 for LinearOp {
    fn name(&self) -> &'static str {
        "ddp-candle-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        matmul_wt(x, lx, w, lw)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        grads_xw(x, w, g)
    }
}

impl CustomOp3 for LinearOp {
    fn name(&self) -> &'static str {
        "ddp-candle-linear"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        w: &CpuStorage,
        lw: &Layout,
        b: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (y, shape) = matmul_wt(x, lx, w, lw)?;
        if lb.dims() != [shape.dims()[1]] {
            candle_core::bail!(
                "linear: the bias has shape {:?} but the weight has {} rows",
                lb.dims(),
                shape.dims()[1]
            );
        }
        // candle's own broadcast add (what `broadcast_add` runs): bit for bit its forward.
        let y = y.binary_impl::<candle_core::op::Add>(
            b,
            &Layout::contiguous(&shape),
            &lb.broadcast_as(shape.clone())?,
        )?;
        Ok((y, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _y: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (gx, gw) = grads_xw(x, w, g)?;
        let gb = if b.track_op() {
            let (n, m) = g.dims2()?;
            let ones = Tensor::ones((1, n), g.dtype(), g.device())?;
            Some(ones.matmul(g)?.reshape(m)?)
        } else {
            None
        };
        Ok((gx, gw, gb))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        let n: usize = shape.iter().product();
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().flatten_all().unwrap();
        let d = d.max(0).unwrap().to_scalar::<f32>().unwrap();
        let s = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        d / s.to_scalar::<f32>().unwrap().max(1e-30)
    }

    /// Forward bit for bit and every gradient (input, weight, bias) within f32 rounding of
    /// candle_nn::Linear's, for 2-D and 3-D inputs, with and without bias, through a
    /// nonlinear loss so that the incoming gradient is not uniform.
    #[test]
    fn equals_candle_nn_linear_values_and_gradients() {
        for (shape, bias) in [
            (vec![5usize, 7], true),
            (vec![1, 3], false),
            (vec![2, 3, 4], true),
            (vec![32, 64], true),
        ] {
            let (k, m) = (shape[shape.len() - 1], 9);
            let x = Var::from_tensor(&rand(&shape, 1)).unwrap();
            let w = Var::from_tensor(&rand(&[m, k], 2)).unwrap();
            let b = Var::from_tensor(&rand(&[m], 3)).unwrap();
            let b = bias.then(|| b.as_tensor().clone());
            let ours = Linear::new(w.as_tensor().clone(), b.clone());
            let theirs = candle_nn::Linear::new(w.as_tensor().clone(), b.clone());
            let y1 = ours.forward(x.as_tensor()).unwrap();
            let y2 = theirs.forward(x.as_tensor()).unwrap();
            assert_eq!(y1.dims(), y2.dims());
            let (v1, v2) = (
                y1.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                y2.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(v1, v2, "{shape:?}: forward differs");
            let g1 = y1.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let g2 = y2.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            let mut vars = vec![("x", x.as_tensor()), ("w", w.as_tensor())];
            if let Some(b) = &b {
                vars.push(("b", b));
            }
            for (name, t) in vars {
                let (a, e) = (g1.get(t).unwrap(), g2.get(t).unwrap());
                assert_eq!(a.dims(), e.dims(), "{shape:?}: {name}");
                let r = max_rel(a, e);
                assert!(r < 1e-6, "{shape:?}: gradient of {name} off by {r:e}");
            }
        }
    }

    /// An input that needs no gradient (data) gets none; the weight still does.
    /// The gradients `backward()` returns carry no graph of their own: a weight gradient that
    /// recorded the matmul it came from would keep that matmul's operands alive with it.
    #[test]
    fn gradients_are_detached_from_the_graph() {
        let x = rand(&[4, 3], 11);
        let w1 = Var::from_tensor(&rand(&[5, 3], 12)).unwrap();
        let w2 = Var::from_tensor(&rand(&[2, 5], 13)).unwrap();
        let b2 = Var::from_tensor(&rand(&[2], 14)).unwrap();
        let l1 = Linear::new(w1.as_tensor().clone(), None);
        let l2 = Linear::new(w2.as_tensor().clone(), Some(b2.as_tensor().clone()));
        let h = l1.forward(&x).unwrap().relu().unwrap();
        let grads = l2
            .forward(&h)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (name, v) in [("w1", &w1), ("w2", &w2), ("b2", &b2)] {
            let g = grads.get(v).unwrap();
            assert!(!g.track_op(), "the gradient of {name} records an operation");
        }
    }

    #[test]
    fn data_input_gets_no_gradient() {
        let x = rand(&[4, 3], 5);
        let w = Var::from_tensor(&rand(&[2, 3], 6)).unwrap();
        let l = Linear::new(w.as_tensor().clone(), None);
        let g = l
            .forward(&x)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(g.get(&x).is_none());
        let gw = g.get(w.as_tensor()).unwrap();
        // d(sum(x Wᵀ))/dW[j, :] = column sums of x.
        let want = x.sum_keepdim(0).unwrap().broadcast_as((2, 3)).unwrap();
        assert!(max_rel(gw, &want.to_dtype(DType::F32).unwrap()) < 1e-6);
    }

    /// Under `capture_grads` a captured weight's gradient is the `GradStore`'s bit for bit and
    /// absent from the `GradStore`; a weight used by two layers gets the sum, as candle sums
    /// it; a weight not captured, the biases and the input keep theirs in the `GradStore`;
    /// after the capture (also after a panic inside it) backward is candle's again; captures
    /// do not nest.
    #[test]
    fn captured_weight_gradients_equal_the_grad_store_and_leave_it() {
        let x = Var::from_tensor(&rand(&[6, 4], 21)).unwrap();
        let w1 = Var::from_tensor(&rand(&[4, 4], 22)).unwrap();
        let w2 = Var::from_tensor(&rand(&[3, 4], 23)).unwrap();
        let b2 = Var::from_tensor(&rand(&[3], 24)).unwrap();
        // w1 twice (tied), then w2 with a bias.
        let l1 = Linear::new(w1.as_tensor().clone(), None);
        let l2 = Linear::new(w2.as_tensor().clone(), Some(b2.as_tensor().clone()));
        let loss = || {
            let h = l1.forward(x.as_tensor())?.tanh()?;
            let h = l1.forward(&h)?.tanh()?;
            l2.forward(&h)?.sqr()?.sum_all()
        };
        let plain = loss().unwrap().backward().unwrap();
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (got, caught) =
            capture_grads(&[w1.as_tensor()], || loss().unwrap().backward().unwrap()).unwrap();
        let caught_w1 = caught[0].as_ref().expect("w1 captured");
        assert_eq!(bits(caught_w1), bits(plain.get(w1.as_tensor()).unwrap()));
        assert!(
            got.get(w1.as_tensor()).is_none(),
            "w1 also in the GradStore"
        );
        for (name, v) in [("x", &x), ("w2", &w2), ("b2", &b2)] {
            let (a, e) = (got.get(v).unwrap(), plain.get(v).unwrap());
            assert_eq!(bits(a), bits(e), "{name}");
        }
        // A weight no Linear of this crate uses is left to the GradStore (reported `None`).
        let other = Var::from_tensor(&rand(&[3], 25)).unwrap();
        let (g, caught) = capture_grads(&[other.as_tensor()], || {
            other
                .as_tensor()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap()
        })
        .unwrap();
        assert!(caught[0].is_none() && g.get(other.as_tensor()).is_some());
        let nested = capture_grads(&[w1.as_tensor()], || {
            capture_grads(&[w2.as_tensor()], || ()).map(|_| ())
        })
        .unwrap()
        .0;
        assert!(nested.unwrap_err().to_string().contains("already running"));
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            capture_grads(&[w1.as_tensor()], || panic!("inside")).ok();
        }));
        assert!(panicked.is_err());
        let after = loss().unwrap().backward().unwrap();
        assert_eq!(bits(after.get(w1.as_tensor()).unwrap()), bits(caught_w1));
    }

    /// A weight used by a [`Linear`] and by another op (a weight penalty, a tied output
    /// projection written with `matmul`) has part of its gradient captured and part in the
    /// `GradStore`: `backward_capturing` returns their sum, candle's gradient.
    #[test]
    fn a_weight_also_used_outside_linear_gets_both_parts() {
        let x = rand(&[5, 4], 31);
        let w = Var::from_tensor(&rand(&[3, 4], 32)).unwrap();
        let l = Linear::new(w.as_tensor().clone(), None);
        let loss = || -> Result<Tensor> {
            let y = l.forward(&x)?.tanh()?.sum_all()?;
            y + w.as_tensor().sqr()?.sum_all()?
        };
        let plain = loss().unwrap().backward().unwrap();
        let got = backward_capturing(&loss().unwrap(), &[w.as_tensor()]).unwrap();
        let (g, want) = (
            got.get(w.as_tensor()).unwrap(),
            plain.get(w.as_tensor()).unwrap(),
        );
        assert!(max_rel(g, want) < 1e-6, "{}", max_rel(g, want));
    }

    #[test]
    fn a_mismatched_input_is_an_error_naming_the_sizes() {
        let x = rand(&[4, 5], 7);
        let l = Linear::new(rand(&[2, 3], 8), None);
        let e = l.forward(&x).unwrap_err().to_string();
        assert!(e.contains("5 features") && e.contains("[2, 3]"), "{e}");
    }
}
