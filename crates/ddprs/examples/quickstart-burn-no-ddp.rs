//! The Burn quick start without DDP: the same training program on one process, with no
//! ddp-rs at all. `quickstart-burn.rs` is this program made data-parallel; the test
//! `crates/ddprs/tests/package.rs` counts the lines in which the two differ.

use burn::data::dataloader::{batcher::Batcher, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::{loss::CrossEntropyLossConfig, Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let device = Device::flex().autodiff();
    let dataset = Arc::new(InMemDataset::new(samples()));
    let mut model = Mlp::new(&device);
    let mut optim = AdamConfig::new().init();
    let loader = DataLoaderBuilder::new(Rows)
        .batch_size(64)
        .shuffle(7)
        .build(dataset);
    let epochs = 5;
    for epoch in 0..epochs {
        let (mut loss_sum, mut batches) = (0.0, 0);
        for batch in loader.iter() {
            let (x, y) = batch?;
            let loss = model.loss(x, y);
            (loss_sum, batches) = (loss_sum + loss.clone().into_scalar::<f64>(), batches + 1);
            let grads = burn::optim::GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-2, model, grads);
        }
        println!("epoch {epoch}: mean loss {:.4}", loss_sum / batches as f64);
    }
    std::fs::create_dir_all("checkpoints")?;
    model.save_file("checkpoints/model.bpk")?;
    Ok(())
}

/// A two-layer perceptron.
#[derive(Module, Debug)]
struct Mlp {
    fc1: Linear,
    act: Relu,
    fc2: Linear,
}

impl Mlp {
    fn new(device: &Device) -> Self {
        Mlp {
            fc1: LinearConfig::new(16, 64).init(device),
            act: Relu,
            fc2: LinearConfig::new(64, 4).init(device),
        }
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
        let logits = self.fc2.forward(self.act.forward(self.fc1.forward(x)));
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, y)
    }
}

/// A synthetic task: 4096 points in 16 dimensions, in 4 classes by the signs of the sums of
/// their two halves.
fn samples() -> Vec<([f32; 16], i64)> {
    let mut rng = 0x2545_f491_4f6c_dd1d_u64;
    (0..4096)
        .map(|_| {
            let x: [f32; 16] = std::array::from_fn(|_| uniform(&mut rng) * 2.0 - 1.0);
            let y = i64::from(x[..8].iter().sum::<f32>() > 0.0) * 2
                + i64::from(x[8..].iter().sum::<f32>() > 0.0);
            (x, y)
        })
        .collect()
}

/// xorshift64: a uniform number in [0, 1).
fn uniform(state: &mut u64) -> f32 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    (*state >> 40) as f32 / (1u64 << 24) as f32
}

/// Samples into a batch of inputs and labels.
#[derive(Clone)]
struct Rows;

impl Batcher<([f32; 16], i64), (Tensor<2>, Tensor<1, Int>)> for Rows {
    fn batch(&self, rows: Vec<([f32; 16], i64)>, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        let n = rows.len();
        let x: Vec<f32> = rows.iter().flat_map(|(x, _)| *x).collect();
        let y: Vec<i64> = rows.iter().map(|(_, y)| *y).collect();
        (
            Tensor::from_data(TensorData::new(x, [n, 16]), device),
            Tensor::from_data(TensorData::new(y, [n]), device),
        )
    }
}
