//! Quick start with Burn: `quickstart-burn-no-ddp.rs` made data-parallel (`cargo add ddprs
//! --features burn`; the lines that differ end in `// DDP`). Every process trains a replica on
//! its shard of the data; run it with `ddprun --nproc-per-node 2 ./quickstart-burn`.

use burn::data::dataloader::{batcher::Batcher, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::{loss::CrossEntropyLossConfig, Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use ddprs::burn::prelude::*; // DDP
use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pg = init_process_group(Default::default())?; // DDP: rank and world from ddprun's env
    let device = Device::flex().autodiff();
    let dataset = ShardedDataset::new(Arc::new(InMemDataset::new(samples())), &pg)?.shared(); // DDP
    let mut ddp = Ddp::new(Mlp::new(&device), &pg, Default::default())?; // DDP: rank 0's values
    let mut optim = AdamConfig::new().init();
    let loader = DataLoaderBuilder::new(Rows)
        .batch_size(64)
        .build(dataset.clone()); // DDP
    let epochs = 5;
    for epoch in 0..epochs {
        dataset.set_epoch(epoch); // DDP: this epoch's shuffle of this rank's shard
        let (mut loss_sum, mut batches) = (0.0, 0);
        for batch in loader.iter() {
            let (x, y) = batch?;
            let loss = ddp.module().loss(x, y); // DDP
            (loss_sum, batches) = (loss_sum + loss.clone().into_scalar::<f64>(), batches + 1);
            ddp.backward_step(&mut optim, 1e-2, loss)?; // DDP: gradients averaged over the ranks
        }
        println!("epoch {epoch}: mean loss {:.4}", loss_sum / batches as f64);
    }
    std::fs::create_dir_all("checkpoints")?;
    ddp.save_checkpoint("checkpoints".as_ref(), &optim, epochs)?; // DDP: rank 0 writes, atomically
    assert!(ddp.verify_replicas()?.identical, "replicas differ"); // DDP
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
