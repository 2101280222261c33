//! One worker of `train-digits-burn`: joins the process group, loads its shard with Burn's
//! `DataLoaderBuilder` over a `ddp_burn::ShardedDataset`, trains with `ddp_burn::Ddp` and Burn's
//! optimizers, checkpoints every epoch (rank 0, atomically: Burn's records + our position,
//! through `ddp::checkpoint::resume_or_start` on resume), and reports as `train-digits` does.

use crate::data::{self, Dataset};
use crate::model::{evaluate, tensors, Mlp};
use crate::{Args, Backend, OptimizerKind};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::data::dataset::InMemDataset;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamWConfig, ModuleOptimizer, Optimizer, SgdConfig};
use burn::tensor::{Device, Int, Tensor};
use ddp::checkpoint::{self, Checkpoint, RunPlan, TrainingState};
use ddp::hooks::PeriodicModelAverager;
use ddp::sharding::ZeroStage;
use ddp::DistributedSampler;
use ddp_burn::{Ddp, DdpOptions, ShardedDataset, ZeroDdp};
use ddp_comm::process_group::Backend as CommBackend;
use ddp_comm::{init_process_group, InitOptions, ProcessGroup, ReduceOp};
use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub type BoxResult<T> = Result<T, Box<dyn Error>>;

/// Builds a batch from row indices of the training set.
#[derive(Clone)]
pub struct Rows(pub Arc<Dataset>);

impl Batcher<usize, (Tensor<2>, Tensor<1, Int>)> for Rows {
    fn batch(&self, rows: Vec<usize>, device: &Device) -> (Tensor<2>, Tensor<1, Int>) {
        tensors(&self.0, &rows, device)
    }
}

fn sgd(args: &Args) -> SgdConfig {
    SgdConfig::new().with_momentum((args.momentum > 0.0).then(|| {
        MomentumConfig::new()
            .with_momentum(args.momentum)
            .with_dampening(0.0)
    }))
}

pub fn optimizer(args: &Args) -> ModuleOptimizer {
    match args.optimizer {
        OptimizerKind::Sgd => sgd(args).init(),
        OptimizerKind::Adamw => AdamWConfig::new().init(),
    }
}

fn run_plan(args: &Args, world_size: usize, samples_per_epoch: usize) -> RunPlan {
    RunPlan {
        world_size,
        samples_per_epoch,
        batch_size: args.batch_size,
        epochs: args.epochs,
        max_steps: args.max_steps,
        hyper: serde_json::json!({
            "framework": "burn",
            "optimizer": args.optimizer_name(),
            "lr": args.lr(),
            "momentum": args.momentum,
            "batch_size": args.batch_size,
            "hidden": args.hidden,
            "seed": args.seed,
            "hook": args.hook.to_string(),
            "zero": args.zero,
        }),
        rng_state: args.seed,
    }
}

fn save(
    pg: &ProcessGroup,
    args: &Args,
    plan: &RunPlan,
    ddp: &Ddp<Mlp>,
    opt: &ModuleOptimizer,
    averager: Option<&PeriodicModelAverager>,
    pos: &TrainingState,
) -> BoxResult<()> {
    let Some(dir) = &args.checkpoint_dir else {
        return Ok(());
    };
    // Comm hook state (PowerSGD's residuals differ between ranks: rank 0 saves every rank's,
    // a collective).
    let hook_state = ddp::hooks::gather_state(pg, &ddp.reducer().comm_hook_state())?;
    if pg.rank() == 0 {
        let mut ckpt = Checkpoint::new(plan.meta(pos));
        ddp.save_records(&mut ckpt, opt)?;
        ckpt.save_hook_state(&hook_state)?;
        if let Some(a) = averager {
            ckpt.save_hook_state(&a.state_dict())?;
        }
        checkpoint::save_atomic(dir, &ckpt)?;
    }
    Ok(())
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
        timeout: Duration::from_secs(args.timeout_s),
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
    let sampler = DistributedSampler::new(train.len(), pg.size(), pg.rank())?.seed(args.seed);
    let samples_per_epoch = sampler.len();
    let shard = Arc::new(ShardedDataset::new(
        Arc::new(InMemDataset::new((0..train.len()).collect::<Vec<_>>())),
        sampler,
    )?);
    let loader = DataLoaderBuilder::new(Rows(train.clone()))
        .batch_size(args.batch_size)
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

pub fn run(args: &Args) -> BoxResult<()> {
    let stage = ZeroStage::from_level(args.zero)?;
    if stage == ZeroStage::Three {
        return Err(
            "--zero 3 (parameters sharded) is train-digits' (candle's Fsdp); Burn \
                    has stages 0-2"
                .into(),
        );
    }
    if stage != ZeroStage::Ddp && args.hook != ddp::hooks::HookSpec::None {
        return Err(format!(
            "--hook {} cannot be combined with --zero {}: ZeRO reduce-scatters the gradients \
             itself",
            args.hook, args.zero
        )
        .into());
    }
    let s = setup(args)?;
    let plan = run_plan(args, s.pg.size(), s.samples_per_epoch);
    // Plain DDP: rank 0 reads the checkpoint and shares it (before the model is built).
    let resumed = match &args.checkpoint_dir {
        Some(dir) if stage == ZeroStage::Ddp => {
            checkpoint::resume_or_start(&s.pg, dir, args.resume, &plan)?
        }
        _ => None,
    };
    let opts = DdpOptions {
        check_finite: !args.no_check_finite,
        ..Default::default()
    };
    let ddp = Ddp::new(Mlp::new(args.hidden, args.seed, &s.device), &s.pg, opts)?;
    let mut pos = TrainingState::default();
    match (stage, args.optimizer) {
        (ZeroStage::Ddp, _) => {
            let mut t = DdpStepper {
                ddp,
                opt: optimizer(args),
                averager: args.hook.averager()?,
            };
            if let Some(hook) = args.hook.hook()? {
                t.ddp.register_comm_hook(hook)?;
            }
            if let Some(r) = &resumed {
                t.resume(r, s.pg.rank())?;
                pos = r.state;
                announce(&s.pg, &r.path.display().to_string(), &pos);
            } else {
                no_checkpoint(args, &s.pg);
            }
            train_loop(args, &s, &plan, t, pos)
        }
        (_, OptimizerKind::Sgd) => run_zero(args, &s, &plan, ddp, stage, sgd(args).build()),
        (_, OptimizerKind::Adamw) => {
            run_zero(args, &s, &plan, ddp, stage, AdamWConfig::new().build())
        }
    }
}

fn announce(pg: &ProcessGroup, from: &str, pos: &TrainingState) {
    if pg.rank() == 0 {
        println!(
            "resuming from {from} at step {}, epoch {}, {} samples into the epoch",
            pos.step, pos.epoch, pos.consumed
        );
    }
}

fn no_checkpoint(args: &Args, pg: &ProcessGroup) {
    if let (true, Some(dir), 0) = (args.resume, &args.checkpoint_dir, pg.rank()) {
        println!("no checkpoint in {}: starting fresh", dir.display());
    }
}

/// `--zero 1|2`: `ddp_burn::ZeroDdp` with Burn's bare `optim`; with `--resume` every rank
/// first loads its cut of the sharded set (a collective).
fn run_zero<O: Optimizer>(
    args: &Args,
    s: &Setup,
    plan: &RunPlan,
    ddp: Ddp<Mlp>,
    stage: ZeroStage,
    optim: O,
) -> BoxResult<()> {
    let mut zero = ZeroDdp::new(ddp, stage, optim)?;
    let mut pos = TrainingState::default();
    if let (Some(dir), true) = (&args.checkpoint_dir, args.resume) {
        match zero.load(dir)? {
            Some(meta) => {
                pos = plan.check(&meta)?;
                announce(
                    &s.pg,
                    &format!("the sharded set in {}", dir.display()),
                    &pos,
                );
            }
            None => no_checkpoint(args, &s.pg),
        }
    }
    train_loop(args, s, plan, zero, pos)
}

/// What the epoch loop drives: plain DDP with Burn's optimizer (and a comm hook), or ZeRO.
trait Stepper {
    fn ddp(&self) -> &Ddp<Mlp>;
    /// The run's step count (for the reducer's messages).
    fn set_step(&mut self, step: u64);
    /// Backward of `loss`, the gradients' synchronization and one optimizer step.
    fn train_step(&mut self, loss: Tensor<1>, lr: f64) -> BoxResult<()>;
    /// A checkpoint at `pos` (a collective).
    fn save(
        &self,
        pg: &ProcessGroup,
        args: &Args,
        plan: &RunPlan,
        pos: &TrainingState,
    ) -> BoxResult<()>;
    /// After the last step (e.g. local SGD's last averaging); the bytes this rank sent in this
    /// run of `steps_run` steps.
    fn finish(&mut self, steps_run: u64) -> BoxResult<u64>;
}

/// `Ddp` with Burn's `ModuleOptimizer` and, for local SGD, the model averager.
struct DdpStepper {
    ddp: Ddp<Mlp>,
    opt: ModuleOptimizer,
    averager: Option<PeriodicModelAverager>,
}

impl DdpStepper {
    fn resume(&mut self, r: &checkpoint::Resumed, rank: usize) -> BoxResult<()> {
        let opt = std::mem::replace(&mut self.opt, optimizer_placeholder());
        self.opt = self.ddp.load_records(&r.checkpoint, opt)?;
        let kind = self.ddp.reducer().comm_hook_state().kind;
        let hook_state = r.checkpoint.hook_state(&kind)?.for_rank(rank);
        self.ddp.reducer_mut().load_comm_hook_state(&hook_state)?;
        if let Some(a) = &mut self.averager {
            a.load_state_dict(&r.checkpoint.hook_state("periodic_model_averager")?)?;
        }
        Ok(())
    }
}

/// Stands in for the optimizer while its record loads.
fn optimizer_placeholder() -> ModuleOptimizer {
    SgdConfig::new().init()
}

impl Stepper for DdpStepper {
    fn ddp(&self) -> &Ddp<Mlp> {
        &self.ddp
    }

    fn set_step(&mut self, step: u64) {
        self.ddp.reducer_mut().set_step(step);
    }

    fn train_step(&mut self, loss: Tensor<1>, lr: f64) -> BoxResult<()> {
        let grads = self.ddp.backward(loss)?;
        self.ddp.step(&mut self.opt, lr, grads);
        if let Some(a) = &mut self.averager {
            self.ddp.average_parameters(a)?;
        }
        Ok(())
    }

    fn save(
        &self,
        pg: &ProcessGroup,
        args: &Args,
        plan: &RunPlan,
        pos: &TrainingState,
    ) -> BoxResult<()> {
        save(
            pg,
            args,
            plan,
            &self.ddp,
            &self.opt,
            self.averager.as_ref(),
            pos,
        )
    }

    fn finish(&mut self, _steps_run: u64) -> BoxResult<u64> {
        // Local SGD: replicas differ between averagings; average once more at the end.
        if let Some(a) = &mut self.averager {
            self.ddp.average_parameters_now(a)?;
        }
        Ok(self.ddp.reducer().bytes_sent() + self.averager.as_ref().map_or(0, |a| a.bytes_sent()))
    }
}

impl<O: Optimizer> Stepper for ZeroDdp<Mlp, O> {
    fn ddp(&self) -> &Ddp<Mlp> {
        ZeroDdp::ddp(self)
    }

    fn set_step(&mut self, step: u64) {
        ZeroDdp::set_step(self, step);
    }

    fn train_step(&mut self, loss: Tensor<1>, lr: f64) -> BoxResult<()> {
        self.backward(loss)?;
        self.step(lr)?;
        Ok(())
    }

    fn save(
        &self,
        _pg: &ProcessGroup,
        args: &Args,
        plan: &RunPlan,
        pos: &TrainingState,
    ) -> BoxResult<()> {
        if let Some(dir) = &args.checkpoint_dir {
            // Every rank writes its shard; rank 0 the index (loadable at any world size).
            ZeroDdp::save(self, dir, &plan.meta(pos))?;
        }
        Ok(())
    }

    fn finish(&mut self, steps_run: u64) -> BoxResult<u64> {
        // Reduce-scatter plus all-gather: the ring model's bytes (DDP's volume).
        Ok(self.bytes_per_step() * steps_run)
    }
}

/// The epochs from `pos` to the end, then the summary.
fn train_loop(
    args: &Args,
    s: &Setup,
    plan: &RunPlan,
    mut t: impl Stepper,
    mut pos: TrainingState,
) -> BoxResult<()> {
    let Setup {
        pg,
        train,
        test,
        device,
        shard,
        loader,
        ..
    } = s;
    let (rank, world) = (pg.rank(), pg.size());
    t.set_step(pos.step); // non-finite errors name the run's step
    if rank == 0 {
        println!(
            "train-digits-burn: world_size {world}, {} train / {} test images, batch {} per rank \
             (global {}), {} steps per epoch, {} lr {}, zero {}, {} parameters",
            train.len(),
            test.len(),
            args.batch_size,
            args.batch_size * world,
            plan.steps_per_epoch(),
            args.optimizer_name(),
            args.lr(),
            args.zero,
            t.ddp()
                .reducer()
                .specs()
                .iter()
                .map(|s| s.numel())
                .sum::<usize>(),
        );
    }

    // The clock starts once every rank holds its replica (rank 0's broadcast received: on a
    // slow link that takes a while after rank 0 has sent it), as the PyTorch peer's barrier.
    pg.barrier()?;
    let start = Instant::now();
    let mut eval_time = Duration::ZERO;
    let mut time_to_target: Option<Duration> = None;
    let mut local_samples = 0u64;
    let mut steps_run = 0u64;
    'epochs: while pos.epoch < args.epochs {
        shard.set_epoch(pos.epoch);
        let mut loss_sum = 0f64;
        let mut batches = 0u64;
        for b in loader.iter().skip(pos.consumed / args.batch_size) {
            if args.max_steps.is_some_and(|m| pos.step >= m) {
                break 'epochs;
            }
            let (x, y) = b?;
            let n = y.dims()[0];
            let loss = t.ddp().module().loss(x, y);
            loss_sum += loss.clone().into_scalar::<f64>();
            t.train_step(loss, args.lr())?;
            pos.step += 1;
            pos.consumed += n;
            steps_run += 1;
            local_samples += n as u64;
            batches += 1;
        }
        pos.epoch += 1;
        pos.consumed = 0;
        t.save(pg, args, plan, &pos)?;
        if let Some(target) = args.target_accuracy {
            // Rank 0 evaluates (outside the timed span); every rank learns whether to stop.
            let paused = Instant::now();
            let reached = ddp::join::rank0_decides(pg, || -> BoxResult<bool> {
                Ok(evaluate(t.ddp().module(), test, device).0 >= target)
            })?;
            eval_time += paused.elapsed();
            if reached {
                time_to_target = Some(start.elapsed() - eval_time);
                break 'epochs;
            }
        }
        if rank == 0
            && args.log_every > 0
            && (pos.epoch.is_multiple_of(args.log_every) || pos.epoch == args.epochs)
        {
            let (acc, _) = evaluate(t.ddp().module(), test, device);
            println!(
                "epoch {:>3}/{}  step {:>5}  train_loss(rank0) {:.4}  test_acc {:.4}  {:.1}s",
                pos.epoch,
                args.epochs,
                pos.step,
                loss_sum / batches.max(1) as f64,
                acc,
                start.elapsed().as_secs_f64()
            );
        }
    }
    let train_time = start.elapsed() - eval_time;
    if pos.epoch < args.epochs && time_to_target.is_none() {
        t.save(pg, args, plan, &pos)?;
    }
    let bytes_sent = t.finish(steps_run)?;
    let run = RunCounts {
        steps: pos.step,
        steps_run,
        local_samples,
        train_time,
        time_to_target,
        bytes_sent,
    };
    report(args, pg, t.ddp(), train, test, device, run)
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
    /// Bytes this rank sent for gradients and model averaging in this run.
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
    let (rank, world) = (pg.rank(), pg.size());
    let mut counts = [run.local_samples as f64, run.train_time.as_secs_f64()];
    pg.all_reduce(&mut counts[..1], ReduceOp::Sum)?;
    pg.all_reduce(&mut counts[1..], ReduceOp::Max)?;
    let replicas = ddp.verify_replicas()?;
    let max_diff = replicas.max_abs_diff;
    if rank == 0 {
        let (test_acc, test_loss) = evaluate(ddp.module(), test, device);
        let (_, train_loss) = evaluate(ddp.module(), train, device);
        let (param_sum, param_l2) = ddp.param_sum_l2()?;
        let samples_per_s = if counts[1] > 0.0 {
            counts[0] / counts[1]
        } else {
            0.0
        };
        let stats = ddp.total_stats();
        println!(
            "held-out accuracy {:.4} ({} images), test loss {:.4}, final train loss {:.4}",
            test_acc,
            test.len(),
            test_loss,
            train_loss
        );
        println!(
            "{} steps ({} this run) in {:.2}s: {:.0} samples/s over {} ranks",
            run.steps, run.steps_run, counts[1], samples_per_s, world
        );
        if stats.steps > 0 {
            let wait = stats.comm_wait.as_secs_f64() * 1e3 / stats.steps as f64;
            let total = stats.total.as_secs_f64() * 1e3 / stats.steps as f64;
            println!(
                "gradient sync (rank 0): {wait:.3} ms/step waiting for communication of {total:.3} \
                 ms/step backward+communication"
            );
        }
        println!(
            "replica check: {} (max |param difference| across ranks = {:e})",
            replicas.describe(&ddp.param_names()),
            max_diff
        );
        if args.json {
            // train-digits' keys, in its order.
            let time_to_target: serde_json::Value = run
                .time_to_target
                .map_or(serde_json::Value::Null, |t| t.as_secs_f64().into());
            let bytes_per_step = run.bytes_sent as f64 / run.steps_run.max(1) as f64;
            let fields: [(&str, serde_json::Value); 13] = [
                ("world_size", world.into()),
                ("steps", run.steps.into()),
                ("test_accuracy", test_acc.into()),
                ("final_loss", train_loss.into()),
                ("samples_per_s", samples_per_s.into()),
                ("replicas_identical", replicas.identical.into()),
                ("max_param_diff", max_diff.into()),
                ("param_sum", param_sum.into()),
                ("param_l2", param_l2.into()),
                ("hook", args.hook.to_string().into()),
                ("bytes_per_step", bytes_per_step.into()),
                ("train_time_s", counts[1].into()),
                ("time_to_target_s", time_to_target),
            ];
            let body: Vec<String> = fields.iter().map(|(k, v)| format!("\"{k}\":{v}")).collect();
            println!("{{{}}}", body.join(","));
        }
    }
    pg.barrier()?;
    if !replicas.identical {
        return Err(format!("after training: {}", replicas.describe(&ddp.param_names())).into());
    }
    Ok(())
}
