//! [`AdamW`]: candle's AdamW with a checkpointable state.
//!
//! `candle_nn::AdamW` keeps its moment estimates private, so a run using it cannot be checkpointed
//! and resumed exactly. [`AdamW`] here performs the *same arithmetic, operation for operation*
//! (so it produces bit-identical parameters; a test checks this against `candle_nn::AdamW`),
//! implements `candle_nn::Optimizer`, and saves/restores its state to/from a `ddp::Checkpoint`
//! under PyTorch's state names: `optim.<param>.exp_avg`, `optim.<param>.exp_avg_sq`, and the step
//! count.

use super::unnamed;
use crate::checkpoint::tensor_like;
use crate::{Error, Result};
use candle_core::backprop::GradStore;
use candle_core::Var;
use candle_nn::{Optimizer, ParamsAdamW};
use ddp::checkpoint::{Checkpoint, OptimizerState, OptimizerStateDict};

/// State key of the step count in checkpoints of format version 1, stored as two `f32` halves of
/// 24 bits (format 2 stores it in the metadata).
const LEGACY_STEP_KEY: &str = "__adamw.step";

struct Slot {
    name: String,
    var: Var,
    m: Var,
    v: Var,
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
        let slots = vars
            .into_iter()
            .filter(|(_, v)| v.dtype().is_float())
            .map(|(name, var)| {
                let m = Var::zeros(var.shape(), var.dtype(), var.device())?;
                let v = Var::zeros(var.shape(), var.dtype(), var.device())?;
                Ok(Slot { name, var, m, v })
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

    /// Optimizer steps taken so far.
    pub fn step_count(&self) -> usize {
        self.step_t
    }

    /// Adds the state (both moments of every parameter, the step count and the
    /// hyper-parameters) to `ckpt`; the same as `ckpt.save_optimizer(self)`.
    pub fn save_state(&self, ckpt: &mut Checkpoint) -> Result<()> {
        ckpt.save_optimizer(self)
    }

    /// Restores the state saved by [`save_state`](Self::save_state) (errors name a missing or
    /// mis-shaped tensor); the same as `ckpt.load_optimizer(self)`.
    pub fn load_state(&mut self, ckpt: &Checkpoint) -> Result<()> {
        ckpt.load_optimizer(self)
    }
}

/// States `exp_avg` and `exp_avg_sq` per parameter (PyTorch's names), the step count, and the
/// hyper-parameters `lr`, `beta1`, `beta2`, `eps`, `weight_decay`.
impl OptimizerState for AdamW {
    type Error = Error;

    fn kind(&self) -> &str {
        "adamw"
    }

    fn state_dict(&self) -> Result<OptimizerStateDict> {
        let p = &self.params;
        let mut state = OptimizerStateDict::new("adamw", self.step_t as u64);
        state.hyper = [
            ("lr", p.lr),
            ("beta1", p.beta1),
            ("beta2", p.beta2),
            ("eps", p.eps),
            ("weight_decay", p.weight_decay),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
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
        Ok(state)
    }

    fn load_state_dict(&mut self, state: &OptimizerStateDict) -> Result<()> {
        for s in &self.slots {
            for (slot, t) in [("exp_avg", &s.m), ("exp_avg_sq", &s.v)] {
                let key = Checkpoint::optim_key(&s.name, slot);
                let saved = state.get(&s.name, slot).ok_or_else(|| {
                    Error::Ddp(ddp::Error::Mismatch(format!(
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
                    return Err(Error::Ddp(ddp::Error::Mismatch(format!(
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

impl Optimizer for AdamW {
    type Config = ParamsAdamW;

    /// Unnamed variables are called `param0`, `param1`, ... in checkpoints.
    fn new(vars: Vec<Var>, params: ParamsAdamW) -> candle_core::Result<Self> {
        Ok(AdamW::new_named(unnamed(vars), params)?)
    }

    fn learning_rate(&self) -> f64 {
        self.params.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        self.params.lr = lr
    }

    // The same operations, in the same order, as candle_nn::AdamW::step.
    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_t += 1;
        let lr = self.params.lr;
        let lambda = self.params.weight_decay;
        let lr_lambda = lr * lambda;
        let beta1 = self.params.beta1;
        let beta2 = self.params.beta2;
        let scale_m = 1f64 / (1f64 - beta1.powi(self.step_t as i32));
        let scale_v = 1f64 / (1f64 - beta2.powi(self.step_t as i32));
        for s in &self.slots {
            let theta = &s.var;
            if let Some(g) = grads.get(theta) {
                let next_m = ((s.m.as_tensor() * beta1)? + (g * (1.0 - beta1))?)?;
                let next_v = ((s.v.as_tensor() * beta2)? + (g.sqr()? * (1.0 - beta2))?)?;
                let m_hat = (&next_m * scale_m)?;
                let v_hat = (&next_v * scale_v)?;
                let next_theta = (theta.as_tensor() * (1f64 - lr_lambda))?;
                let adjusted_grad = (m_hat / (v_hat.sqrt()? + self.params.eps)?)?;
                let next_theta = (next_theta - (adjusted_grad * lr)?)?;
                s.m.set(&next_m)?;
                s.v.set(&next_v)?;
                theta.set(&next_theta)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};
    use ddp::checkpoint::CheckpointMeta;

    fn vars(seed: f32) -> Vec<(String, Var)> {
        let mk = |n: usize, k: f32| {
            let d: Vec<f32> = (0..n).map(|i| ((i as f32 + k) * 0.37).sin()).collect();
            Var::from_tensor(&Tensor::from_vec(d, n, &Device::Cpu).unwrap()).unwrap()
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

    fn values(vs: &[(String, Var)]) -> Vec<Vec<f32>> {
        vs.iter()
            .map(|(_, v)| v.as_tensor().to_vec1::<f32>().unwrap())
            .collect()
    }

    #[test]
    fn matches_candle_adamw_bitwise() {
        let p = ParamsAdamW {
            lr: 0.05,
            ..Default::default()
        };
        let ours_vars = vars(0.0);
        let theirs_vars = vars(0.0);
        let mut ours = AdamW::new_named(ours_vars.clone(), p.clone()).unwrap();
        let mut theirs =
            candle_nn::AdamW::new(theirs_vars.iter().map(|(_, v)| v.clone()).collect(), p).unwrap();
        for k in 0..5 {
            ours.step(&loss(&ours_vars, k).backward().unwrap()).unwrap();
            theirs
                .step(&loss(&theirs_vars, k).backward().unwrap())
                .unwrap();
            assert_eq!(values(&ours_vars), values(&theirs_vars), "step {k}");
        }
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
