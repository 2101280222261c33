//! The classifier: Burn's `Linear` layers, `64 → hidden → 10` with ReLU (Burn's default
//! initialization, seeded by `--seed`; DDP copies rank 0's values everywhere anyway).

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{activation, Device, Int, Tensor, TensorData};
use ddp_example_support::data::{Dataset, CLASSES, FEATURES};

#[derive(Module, Debug)]
pub struct Mlp {
    pub fc1: Linear,
    pub fc2: Linear,
}

impl Mlp {
    pub fn new(hidden: usize, seed: u64, device: &Device) -> Mlp {
        device.seed(seed);
        Mlp {
            fc1: LinearConfig::new(FEATURES, hidden).init(device),
            fc2: LinearConfig::new(hidden, CLASSES).init(device),
        }
    }

    /// Logits of a batch `(n, 64)`.
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.fc2.forward(activation::relu(self.fc1.forward(x)))
    }

    /// Mean cross-entropy of a batch.
    pub fn loss(&self, x: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
        CrossEntropyLossConfig::new()
            .init(&x.device())
            .forward(self.forward(x), y)
    }
}

/// A batch of rows of `data` as tensors on `device`.
pub fn tensors(data: &Dataset, rows: &[usize], device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
    let (x, y) = data.gather(rows);
    let y: Vec<i64> = y.into_iter().map(i64::from).collect();
    (
        Tensor::from_data(TensorData::new(x, [rows.len(), FEATURES]), device),
        Tensor::from_data(TensorData::new(y, [rows.len()]), device),
    )
}

/// `(accuracy, mean cross-entropy)` of `model` on all of `data` (no autodiff graph).
pub fn evaluate(model: &Mlp, data: &Dataset, device: &Device) -> (f64, f64) {
    let model = model.valid();
    let device = device.clone().inner();
    let rows: Vec<usize> = (0..data.len()).collect();
    let (x, y) = tensors(data, &rows, &device);
    let logits = model.forward(x);
    let loss = model.loss_of(logits.clone(), y);
    let pred: Vec<i64> = logits.argmax(1).into_data().iter::<i64>().collect();
    let correct = pred
        .iter()
        .zip(&data.labels)
        .filter(|(p, l)| **p == i64::from(**l))
        .count();
    (correct as f64 / data.len().max(1) as f64, loss)
}

impl Mlp {
    fn loss_of(&self, logits: Tensor<2>, y: Tensor<1, Int>) -> f64 {
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, y)
            .into_scalar::<f64>()
    }
}
