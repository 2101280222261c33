//! The classifier: an MLP `64 → hidden → 10` (ReLU; `ddprs::candle::nn::Linear` layers, PyTorch's
//! layout with a cheaper CPU backward), its parameters in a candle `VarMap`, built
//! as two blocks (`fc1 + relu`, `fc2`) so the blockwise backward can overlap communication.
//! Initialization is PyTorch's `nn.Linear` default (uniform in `±1/sqrt(fan_in)`) drawn from a
//! seeded generator, so runs are reproducible (DDP then copies rank 0's values everywhere anyway).

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use candle_nn::VarMap;
use ddprs::candle::nn::Linear;
use rand::{Rng, SeedableRng};

pub struct Mlp {
    pub fc1: Linear,
    pub fc2: Linear,
}

/// Drawn on the host (the same values on every device; no device RNG needed), then copied to
/// `device`.
fn uniform_var(
    rng: &mut rand::rngs::StdRng,
    shape: &[usize],
    bound: f32,
    device: &Device,
) -> Result<Var> {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|_| rng.gen_range(-bound..bound)).collect();
    Var::from_tensor(&Tensor::from_vec(data, shape, device)?)
}

impl Mlp {
    /// A new model on `device` whose parameters (`fc1.weight`, `fc1.bias`, `fc2.weight`,
    /// `fc2.bias`) are registered in `varmap`.
    pub fn new(
        varmap: &VarMap,
        inputs: usize,
        hidden: usize,
        classes: usize,
        seed: u64,
        device: &Device,
    ) -> Result<Mlp> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut layer = |name: &str, fan_in: usize, fan_out: usize| -> Result<Linear> {
            let bound = 1.0 / (fan_in as f32).sqrt();
            let w = uniform_var(&mut rng, &[fan_out, fan_in], bound, device)?;
            let b = uniform_var(&mut rng, &[fan_out], bound, device)?;
            let mut data = varmap.data().lock().unwrap();
            data.insert(format!("{name}.weight"), w.clone());
            data.insert(format!("{name}.bias"), b.clone());
            Ok(Linear::new(
                w.as_tensor().clone(),
                Some(b.as_tensor().clone()),
            ))
        };
        let fc1 = layer("fc1", inputs, hidden)?;
        let fc2 = layer("fc2", hidden, classes)?;
        Ok(Mlp { fc1, fc2 })
    }

    pub fn stage1(&self, x: &Tensor) -> Result<Tensor> {
        self.fc1.forward(x)?.relu()
    }

    pub fn stage2(&self, h: &Tensor) -> Result<Tensor> {
        self.fc2.forward(h)
    }

    /// Logits of a batch `(n, 64)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.stage2(&self.stage1(x)?)
    }
}

/// `(accuracy, mean cross-entropy)` of `model` on `(features, labels)`.
pub fn evaluate(model: &Mlp, features: &[f32], labels: &[u32]) -> Result<(f64, f64)> {
    let n = labels.len();
    let device = model.fc1.weight().device();
    let x = Tensor::from_slice(features, (n, features.len() / n.max(1)), device)?;
    let y = Tensor::from_slice(labels, n, device)?;
    let logits = model.forward(&x)?;
    let loss = candle_nn::loss::cross_entropy(&logits, &y)?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
    let pred = logits.argmax(1)?.to_vec1::<u32>()?;
    let correct = pred.iter().zip(labels).filter(|(p, l)| p == l).count();
    Ok((correct as f64 / n.max(1) as f64, loss))
}
