//! `ddp-burn`: PyTorch's `DistributedDataParallel` for [Burn](https://burn.dev) 0.22 modules,
//! across processes and machines, on any Burn device (tested on the pure-Rust CPU backend
//! `burn-flex`).
//!
//! Burn's own DDP (burn-train 0.21+) runs one thread per GPU inside one process, with one
//! all-reduce per parameter; ddp-rs runs one process per rank (launched by `ddprun` or `mpirun`,
//! or spawned by the program itself through `ddprun::spawn`), over TCP or shared memory, with
//! PyTorch's bucketed, pipelined reducer, its `DistributedSampler`, `no_sync` and `Join`.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use burn::data::dataloader::{batcher::Batcher, DataLoaderBuilder};
//! # use burn::data::dataset::{Dataset, InMemDataset};
//! # use burn::module::Module;
//! # use burn::nn::{loss::CrossEntropyLossConfig, Linear, LinearConfig};
//! # use burn::tensor::{Device, Int, Tensor, TensorData};
//! # #[derive(Module, Debug)]
//! # struct MyModel { fc: Linear }
//! # struct MyModelConfig;
//! # impl MyModelConfig {
//! #     fn new() -> Self { MyModelConfig }
//! #     fn init(&self, device: &Device) -> MyModel { MyModel { fc: LinearConfig::new(4, 3).init(device) } }
//! # }
//! # impl MyModel {
//! #     fn forward(&self, x: Tensor<2>) -> Tensor<2> { self.fc.forward(x) }
//! #     fn forward_loss(&self, x: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
//! #         CrossEntropyLossConfig::new().init(&x.device()).forward(self.forward(x), y)
//! #     }
//! # }
//! # #[derive(Clone)]
//! # struct Rows;
//! # impl Batcher<usize, (Tensor<2>, Tensor<1, Int>)> for Rows {
//! #     fn batch(&self, rows: Vec<usize>, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
//! #         let n = rows.len();
//! #         let x: Vec<f32> = rows.iter().flat_map(|&r| [r as f32; 4]).collect();
//! #         let y: Vec<i64> = rows.iter().map(|&r| (r % 3) as i64).collect();
//! #         (Tensor::from_data(TensorData::new(x, [n, 4]), device),
//! #          Tensor::from_data(TensorData::new(y, [n]), device))
//! #     }
//! # }
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let batches: Vec<(Tensor<2>, Tensor<1, Int>)> = Vec::new();
//! let pg = ddp_comm::init_process_group(Default::default())?; // RANK/WORLD_SIZE/MASTER_* from env
//! let device = burn::tensor::Device::flex().autodiff();
//! let model = MyModelConfig::new().init(&device);
//! let mut ddp = ddp_burn::Ddp::new(model, &pg, Default::default())?; // rank 0's weights everywhere
//! let mut optim = burn::optim::AdamConfig::new().init();
//! for (x, y) in batches {                      // this rank's shard (ddp_burn::ShardedDataset)
//!     let loss = ddp.module().forward_loss(x, y);
//!     let grads = ddp.backward(loss)?;          // GradientsParams averaged over all ranks
//!     ddp.step(&mut optim, 1e-3, grads);        // Burn's optimizer, unchanged
//! }
//! # Ok(())
//! # }
//! ```
//!
//! - **Parameter order** (module [`params`]): Burn's `ParamId`s are random per process, so the
//!   wrapper walks the module's structure (`ModuleVisitor` with paths: `fc1.weight`,
//!   `layers.0.bias`) to name and order the trainable parameters identically on every rank. At
//!   construction `ddp_core::Reducer::new` checks names, shapes and dtypes across ranks (a mismatch is
//!   an error on every rank naming the parameter) and rank 0's values are broadcast.
//! - **Backward** ([`DistributedDataParallel::backward`]): `loss.backward()` →
//!   `GradientsParams::from_grads` → every gradient handed to the reducer last parameter first
//!   (buckets of 25 MiB, the first 1 MiB) through `ddp_core::adapter` (the same driver code as
//!   `ddp-candle`) → averaged `GradientsParams` for `SgdConfig`/`AdamConfig`/`AdamWConfig`
//!   `.init()` optimizers. [`DistributedDataParallel::no_sync`] accumulates locally;
//!   [`DistributedDataParallel::backward_join`] handles uneven inputs with `ddp_core::Join`.
//! - **Data** (module [`data`]): [`ShardedDataset`] applies `ddp_core::DistributedSampler` to any
//!   Burn `Dataset`, so `DataLoaderBuilder` works unchanged; one call:
//!   `ShardedDataset::new(Arc::new(data), &pg)?.seed(7).shared()`.
//! - **One-call save**: [`DistributedDataParallel::save_checkpoint`] on every rank (rank 0
//!   writes); `use ddp_burn::prelude::*;` brings the common imports.
//! - **Checkpoints** (module [`checkpoint`]): Burn's module and optimizer records (burnpack) as
//!   checksummed blobs of a `ddp_core::Checkpoint` beside our metadata, written atomically by rank 0;
//!   `ddp_core::checkpoint::resume_or_start` resumes exactly.
//!
//! - **Blockwise backward** (module `blockwise`): `forward_backward_blockwise` runs the backward
//!   one block at a time, each block's buckets reduced while earlier blocks compute.
//! - **ZeRO** (module [`zero`]): [`ZeroDdp`] shards the optimizer state (stage 1) and the
//!   gradients (stage 2) over the ranks on `ddp_core::sharding`, stepping each owned chunk with Burn's
//!   own optimizer; its sharded checkpoints resume at any world size.
//!
//! ## Burn's `Learner`
//! A Burn user who trains with `burn-train`'s `SupervisedTraining` keeps it, with its metrics,
//! loggers, checkpointer, LR schedulers, gradient accumulation and early stopping: module
//! [`learner`] (feature `learner`, on by default) is a `TrainingStrategy::Custom` that runs the
//! learner's steps data-parallel.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use burn::data::dataloader::{batcher::Batcher, DataLoaderBuilder};
//! # use burn::data::dataset::{Dataset, InMemDataset};
//! # use burn::module::Module;
//! # use burn::nn::{loss::CrossEntropyLossConfig, Linear, LinearConfig};
//! # use burn::tensor::{Device, Int, Tensor, TensorData};
//! # #[derive(Module, Debug)]
//! # struct MyModel { fc: Linear }
//! # struct MyModelConfig;
//! # impl MyModelConfig {
//! #     fn new() -> Self { MyModelConfig }
//! #     fn init(&self, device: &Device) -> MyModel { MyModel { fc: LinearConfig::new(4, 3).init(device) } }
//! # }
//! # use burn_train::{ClassificationOutput, InferenceStep, Learner, SupervisedTraining, TrainOutput, TrainStep};
//! # use burn::optim::AdamConfig;
//! # use ddp_burn::{DdpLearningStrategy, ShardedDataset};
//! # type Batch = (Tensor<2>, Tensor<1, Int>);
//! # impl TrainStep for MyModel {
//! #     type Input = Batch;
//! #     type Output = ClassificationOutput;
//! #     fn step(&self, b: Batch) -> TrainOutput<ClassificationOutput> {
//! #         let out = InferenceStep::step(self, b);
//! #         TrainOutput::new(self, out.loss.backward(), out)
//! #     }
//! # }
//! # impl InferenceStep for MyModel {
//! #     type Input = Batch;
//! #     type Output = ClassificationOutput;
//! #     fn step(&self, (x, y): Batch) -> ClassificationOutput {
//! #         let output = self.forward(x);
//! #         let loss = CrossEntropyLossConfig::new().init(&output.device()).forward(output.clone(), y.clone());
//! #         ClassificationOutput { loss, output, targets: y }
//! #     }
//! # }
//! # impl MyModel {
//! #     fn forward(&self, x: Tensor<2>) -> Tensor<2> { self.fc.forward(x) }
//! #     fn forward_loss(&self, x: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
//! #         CrossEntropyLossConfig::new().init(&x.device()).forward(self.forward(x), y)
//! #     }
//! # }
//! # #[derive(Clone)]
//! # struct Rows;
//! # impl Batcher<usize, (Tensor<2>, Tensor<1, Int>)> for Rows {
//! #     fn batch(&self, rows: Vec<usize>, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
//! #         let n = rows.len();
//! #         let x: Vec<f32> = rows.iter().flat_map(|&r| [r as f32; 4]).collect();
//! #         let y: Vec<i64> = rows.iter().map(|&r| (r % 3) as i64).collect();
//! #         (Tensor::from_data(TensorData::new(x, [n, 4]), device),
//! #          Tensor::from_data(TensorData::new(y, [n]), device))
//! #     }
//! # }
//! # fn loader_over(s: Arc<ShardedDataset<InMemDataset<usize>>>) -> Arc<dyn burn::data::dataloader::DataLoader<Batch>> {
//! #     DataLoaderBuilder::new(Rows).batch_size(8).build(s)
//! # }
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let device = burn::tensor::Device::flex().autodiff();
//! # let model = MyModelConfig::new().init(&device);
//! # let train_set = InMemDataset::new((0..64).collect::<Vec<usize>>());
//! # let dir = std::path::Path::new("/tmp/learner");
//! # let valid_loader = DataLoaderBuilder::new(Rows).batch_size(8).build(InMemDataset::new((0..16).collect::<Vec<usize>>()));
//! let pg = ddp_comm::init_process_group(Default::default())?;
//! let sampler = ddp_core::DistributedSampler::new(train_set.len(), pg.size(), pg.rank())?;
//! let shard = Arc::new(ShardedDataset::new(Arc::new(train_set), sampler)?); // this rank's part
//! let strategy = Arc::new(DdpLearningStrategy::new(&pg, device.clone())
//!     .on_epoch({ let s = shard.clone(); move |e| s.set_epoch(e as u64 - 1) })); // from 1
//! let result = SupervisedTraining::new(dir, loader_over(shard), valid_loader)
//!     .with_training_strategy(strategy.into_training_strategy())
//!     .num_epochs(10)
//!     .launch(Learner::new(model, AdamConfig::new().init(), 1e-3));
//! if let Some(e) = strategy.take_error() { return Err(e.into()); } // a dead peer, a mismatch
//! # let _ = result;
//! # Ok(())
//! # }
//! ```
//!
//! `burn-train` is taken without its default features (no terminal UI, no system metrics);
//! `default-features = false` on `ddp-burn` leaves it out altogether.
//!
//! ## Burn 0.22 notes
//! Burn 0.22 erased the backend type parameter: tensors are `Tensor<D>` and the backend is chosen
//! by the `Device` at run time (`Device::flex().autodiff()`); there is no `AutodiffBackend`
//! generic to be generic over. Every Burn device works; parameters must be F32 or F64.
//!
//! The guide is the book's Burn chapter (`docs/burn.md` in the repository).

#![forbid(unsafe_code)]

pub mod blockwise;
pub mod checkpoint;
pub mod data;
mod data_parallel;
#[cfg(feature = "learner")]
pub mod learner;
pub mod params;
pub mod prelude;
pub mod zero;

pub use blockwise::{Block, Stage};
pub use data::{ShardedDataset, Sharding};
pub use data_parallel::{DdpOptions, DistributedDataParallel, ModuleLearningRate, NoSync};
pub use ddp_comm::ProcessGroup;
#[cfg(feature = "learner")]
pub use learner::{DdpLearningStrategy, FitSummary, QuietRenderer};
pub use params::{BurnParams, ModuleParams};
pub use zero::ZeroDdp;

/// Short alias of [`DistributedDataParallel`].
pub type Ddp<M> = DistributedDataParallel<M>;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the Burn adapter: the framework-agnostic `ddp-core` ones (which carry communication
/// failures naming the peer rank), Burn record errors, and models it cannot handle.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Ddp(#[from] ddp_core::Error),
    /// A Burn record could not be written or read (the message names the blob).
    #[error("{0}")]
    Record(String),
    /// A model or tensor that this adapter cannot handle (the message names the parameter).
    #[error("{0}")]
    Unsupported(String),
    /// Burn's training loop recorded an error (`LearningResult::error`; see
    /// `DdpLearningStrategy::launch`).
    #[error("Burn's training loop failed: {0}")]
    Training(String),
}

impl From<ddp_comm::Error> for Error {
    fn from(e: ddp_comm::Error) -> Self {
        Error::Ddp(ddp_core::Error::Comm(e))
    }
}

/// The book's Burn chapter (`docs/burn.md`), compiled as doctests.
#[cfg(doctest)]
pub mod book_doctests {
    #[doc = include_str!("../../../docs/burn.md")]
    pub struct Burn;
}
