//! Burn `Learner` plumbing for the test `Mlp`, shared by `learner.rs` and `quickstart.rs`
//! (included with `#[path]`, as it needs `burn-train`): items of the synthetic task, their
//! batcher, and `TrainStep` / `InferenceStep` with cross-entropy loss.

use crate::common::{dataset, Mlp, IN};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::Dataset;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn_train::{ClassificationOutput, InferenceStep, TrainOutput, TrainStep};
use std::sync::Arc;

pub type Batch = (Tensor<2>, Tensor<1, Int>);

#[derive(Clone, Debug)]
pub struct Item {
    pub x: Vec<f32>,
    pub y: i64,
}

pub struct ItemBatcher;

impl Batcher<Item, Batch> for ItemBatcher {
    fn batch(&self, items: Vec<Item>, device: &Device) -> Batch {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|i| i.x.iter().copied()).collect();
        let y: Vec<i64> = items.iter().map(|i| i.y).collect();
        (
            Tensor::from_data(TensorData::new(x, [n, IN]), device),
            Tensor::from_data(TensorData::new(y, [n]), device),
        )
    }
}

impl TrainStep for Mlp {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, (x, y): Batch) -> TrainOutput<ClassificationOutput> {
        let out = InferenceStep::step(self, (x, y));
        TrainOutput::new(self, out.loss.backward(), out)
    }
}

impl InferenceStep for Mlp {
    type Input = Batch;
    type Output = ClassificationOutput;
    fn step(&self, (x, y): Batch) -> ClassificationOutput {
        let output = self.forward(x);
        let loss = burn::nn::loss::CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), y.clone());
        ClassificationOutput {
            loss,
            output,
            targets: y,
        }
    }
}

pub fn items(n: usize) -> Vec<Item> {
    let (x, y) = dataset(n);
    (0..n)
        .map(|i| Item {
            x: x[i * IN..(i + 1) * IN].to_vec(),
            y: y[i],
        })
        .collect()
}

/// A `Dataset` behind an `Arc` (the loader takes ownership; the epoch hook keeps another handle
/// to the shard).
pub struct ArcDataset<D>(pub Arc<D>);

impl<D: Dataset<Item>> Dataset<Item> for ArcDataset<D> {
    fn get(&self, index: usize) -> Result<Item, burn::data::dataset::DatasetError> {
        self.0.get(index)
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}
