//! What both training loops of `train-digits-burn` share, the plain one (module `train`) and
//! Burn's `Learner` (module `learner`): joining the group and loading this rank's shard
//! ([`setup`]), the optimizer of `--optimizer`, and the end of the run ([`report`]: the replica
//! check and `ddp_example_support`'s summary).

use crate::model::{evaluate, tensors, Mlp};
use crate::{Args, Backend};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, ModuleOptimizer, SgdConfig};
use burn::tensor::{Device, Int, Tensor};
use ddp_example_support::data::{self, Dataset};
use ddp_example_support::flags::OptimizerKind;
use ddp_example_support::summary::{self, Details, RunSummary};
use ddprs::burn::{Ddp, ShardedDataset};
use ddprs::comm::process_group::Backend as CommBackend;
use ddprs::comm::{init_process_group, InitOptions, ProcessGroup};
use ddprs::DistributedSampler;
use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

pub type BoxResult<T> = Result<T, Box<dyn Error>>;

/// Builds a batch from row indices of the training set.
#[derive(Clone)]
pub struct Rows(pub Arc<Dataset>);

impl Batcher<usize, (Tensor<2>, Tensor<1, Int>)> for Rows {
    fn batch(&self, rows: Vec<usize>, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        tensors(&self.0, &rows, device)
    }
}

/// Burn's SGD with `--momentum` (PyTorch's: no dampening).
pub fn sgd(args: &Args) -> SgdConfig {
    SgdConfig::new().with_momentum((args.common.momentum > 0.0).then(|| {
        MomentumConfig::new()
            .with_momentum(args.common.momentum)
            .with_dampening(0.0)
    }))
}

pub fn optimizer(args: &Args) -> ModuleOptimizer {
    match args.common.optimizer {
        OptimizerKind::Sgd => sgd(args).init(),
        OptimizerKind::Adamw => AdamWConfig::new().init(),
    }
}

/// What both training loops (this one and Burn's `Learner`, module `learner`) start from.
pub struct Setup {
    pub pg: ProcessGroup,
    pub train: Arc<Dataset>,
    pub test: Dataset,
    pub device: Device,
    /// This rank's shard of the training rows (`set_epoch` before each epoch).
    pub shard: Arc<ShardedDataset<InMemDataset<usize>>>,
    /// Batches of `--batch-size` rows of the shard.
    pub loader: Arc<dyn DataLoader<(Tensor<2>, Tensor<1, Int>)>>,
    /// Samples of the shard per epoch.
    pub samples_per_epoch: usize,
}

/// Joins the process group, loads the data and builds this rank's shard and loader.
pub fn setup(args: &Args) -> BoxResult<Setup> {
    let pg = init_process_group(InitOptions {
        timeout: Duration::from_secs(args.common.timeout_s),
        backend: args.backend.map(|b| match b {
            Backend::Auto => CommBackend::Auto,
            Backend::Tcp => CommBackend::Tcp,
            Backend::Shm => CommBackend::Shm,
        }),
        ..Default::default()
    })?;
    let all = data::load()?;
    let (train, test) = data::train_test_split(&all);
    let train = Arc::new(train);
    let device = Device::flex().autodiff();
    let sampler =
        DistributedSampler::new(train.len(), pg.size(), pg.rank())?.seed(args.common.seed);
    let samples_per_epoch = sampler.len();
    let shard = Arc::new(ShardedDataset::new(
        Arc::new(InMemDataset::new((0..train.len()).collect::<Vec<_>>())),
        sampler,
    )?);
    let loader = DataLoaderBuilder::new(Rows(train.clone()))
        .batch_size(args.common.batch_size)
        .set_device(device.clone())
        .build(shard.clone());
    Ok(Setup {
        pg,
        train,
        test,
        device,
        shard,
        loader,
        samples_per_epoch,
    })
}

/// What a finished run did, for [`report`].
pub struct RunCounts {
    /// Optimizer steps in total (across resumes).
    pub steps: u64,
    /// Steps of this run.
    pub steps_run: u64,
    /// Samples this rank trained on in this run.
    pub local_samples: u64,
    /// Training time, evaluations for --target-accuracy excluded.
    pub train_time: Duration,
    /// When the held-out accuracy reached --target-accuracy (evaluations excluded).
    pub time_to_target: Option<Duration>,
    /// Bytes this rank sent for gradients, model averaging and DiLoCo's pseudo-gradients in this
    /// run.
    pub bytes_sent: u64,
}

/// Checks the replicas and prints the summary (rank 0), as train-digits does; a collective.
pub fn report(
    args: &Args,
    pg: &ProcessGroup,
    ddp: &Ddp<Mlp>,
    train: &Dataset,
    test: &Dataset,
    device: &Device,
    run: RunCounts,
) -> BoxResult<()> {
    let (samples_per_s, train_time_s) = summary::throughput(pg, run.local_samples, run.train_time)?;
    let replicas = ddp.verify_replicas()?;
    if pg.rank() == 0 {
        let (test_accuracy, test_loss) = evaluate(ddp.module(), test, device);
        let (_, final_loss) = evaluate(ddp.module(), train, device);
        let (param_sum, param_l2) = ddp.param_sum_l2()?;
        let run_summary = RunSummary {
            world_size: pg.size(),
            steps: run.steps,
            test_accuracy,
            final_loss,
            samples_per_s,
            replicas_identical: replicas.identical,
            max_param_diff: replicas.max_abs_diff,
            param_sum,
            param_l2,
            hook: args.common.hook.to_string(),
            bytes_per_step: run.bytes_sent as f64 / run.steps_run.max(1) as f64,
            train_time_s,
            time_to_target_s: run.time_to_target.map(|t| t.as_secs_f64()),
        };
        let details = Details {
            test_images: test.len(),
            test_loss,
            steps_run: run.steps_run,
            stats: ddp.total_stats(),
            overlap: None,
            replicas: replicas.describe(&ddp.param_names()),
        };
        summary::print(&run_summary, &details, args.common.json);
    }
    pg.barrier()?;
    if !replicas.identical {
        return Err(format!("after training: {}", replicas.describe(&ddp.param_names())).into());
    }
    Ok(())
}
