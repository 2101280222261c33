//! One worker of `train-digits-burn`: joins the process group, loads its shard with Burn's
//! `DataLoaderBuilder` over a `ddprs::burn::ShardedDataset`, trains with `ddprs::burn::Ddp` and Burn's
//! optimizers (or `ddprs::burn::ZeroDdp` with `--zero 1|2`), checkpoints every epoch (plain DDP:
//! rank 0, atomically, Burn's records + our position; ZeRO: a sharded set), resumes from either
//! at any stage and world size (module `resume`, `ddprs::checkpoint::resume_or_start_global`), and
//! reports as `train-digits` does.

use crate::learner::has_learner_checkpoints;
use crate::model::{evaluate, Mlp};
use crate::resume;
use crate::setup::{optimizer, report, sgd, BoxResult, Rows, RunCounts, Setup};
use crate::Args;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::optim::{AdamWConfig, ModuleOptimizer, Optimizer, SgdConfig};
use burn::tensor::Tensor;
use ddp_example_support::flags::OptimizerKind;
use ddp_example_support::outer::Outer;
use ddp_example_support::resume::Writer;
use ddp_example_support::resume::{resume_source, Source};
use ddprs::burn::{Ddp, DdpOptions, ZeroDdp};
use ddprs::checkpoint::{self, Checkpoint, CheckpointMeta, RunPlan, TrainingState};
use ddprs::comm::ProcessGroup;
use ddprs::sharding::ZeroStage;
use ddprs::DistributedSampler;
use std::time::{Duration, Instant};

/// The run as its checkpoints record it; a checkpoint of other hyper-parameters is refused on
/// resume. The ZeRO stage is not one: it changes where the state lives, not the training (a
/// run resumes from any stage's checkpoint, module `resume`).
fn run_plan(args: &Args, world_size: usize, samples_per_epoch: usize) -> RunPlan {
    let mut plan = args.common.run_plan(world_size, samples_per_epoch);
    plan.hyper["framework"] = "burn".into();
    plan
}

fn save(
    pg: &ProcessGroup,
    args: &Args,
    t: &mut DdpStepper,
    meta: &CheckpointMeta,
    writer: &mut Writer,
) -> BoxResult<()> {
    let Some(dir) = &args.common.checkpoint_dir else {
        return Ok(());
    };
    // Comm hook state (PowerSGD's residuals differ between ranks: rank 0 saves every rank's,
    // a collective).
    let hook_state = ddprs::hooks::gather_state(pg, &t.ddp.reducer().comm_hook_state())?;
    let own = |ddp: &Ddp<Mlp>, opt: &ModuleOptimizer| -> BoxResult<Checkpoint> {
        let mut ckpt = Checkpoint::new(meta.clone());
        ddp.save_records(&mut ckpt, opt)?;
        Ok(ckpt)
    };
    // Local SGD, DiLoCo: every rank's own Burn records (parameters and optimizer state), and
    // the outer loop's state (a collective).
    let outer = match &mut t.outer {
        Some(o) => Some(o.gather(pg, &own(&t.ddp, &t.opt)?)?),
        None => None,
    };
    if pg.rank() == 0 {
        let mut ckpt = own(&t.ddp, &t.opt)?;
        ckpt.save_hook_state(&hook_state)?;
        if let Some(g) = outer {
            g.store(&mut ckpt)?;
        }
        writer.write(dir, ckpt)?;
    }
    Ok(())
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
    if stage != ZeroStage::Ddp && args.common.hook != ddprs::hooks::HookSpec::None {
        return Err(format!(
            "--hook {} cannot be combined with --zero {}: ZeRO reduce-scatters the gradients \
             itself",
            args.common.hook, args.zero
        )
        .into());
    }
    let s = crate::setup::setup(args)?;
    let plan = run_plan(args, s.pg.size(), s.samples_per_epoch);
    // Rank 0 locks and probes the directory, loads the plain checkpoint (with --resume) and
    // shares it, at any world size; a failure there reaches every rank with rank 0's reason.
    // Save sets (stages 1-2): every rank writes its shard, so every rank then checks the
    // directory too, before training.
    let plain = match &args.common.checkpoint_dir {
        Some(dir) => {
            checkpoint::resume_or_start_global(&s.pg, dir, args.resume, &plan, s.train.len())?
        }
        _ => None,
    };
    if let (Some(dir), true) = (&args.common.checkpoint_dir, stage != ZeroStage::Ddp) {
        ddprs::sharding::prepare_dir(&s.pg, dir)?;
    }
    let source = match &args.common.checkpoint_dir {
        Some(dir) if args.resume => resume_source(dir, plain)?,
        _ => None,
    };
    let opts = DdpOptions {
        check_finite: !args.common.no_check_finite,
        ..Default::default()
    };
    let ddp = Ddp::new(
        Mlp::new(args.common.hidden, args.common.seed, &s.device),
        &s.pg,
        opts,
    )?;
    match (stage, args.common.optimizer) {
        (ZeroStage::Ddp, _) => {
            let mut t = DdpStepper {
                ddp,
                opt: optimizer(args),
                outer: None,
            };
            if let Some(hook) = args.common.hook.hook()? {
                t.ddp.register_comm_hook(hook)?;
            }
            // Anchored at the replicas the wrapper made equal.
            t.outer = t.ddp.with_params(|_, p| Outer::new(&args.common.hook, p))?;
            let loaded = match &source {
                Some(Source::Plain(r)) => {
                    t.resume(&r.checkpoint, &r.path.display().to_string(), &s.pg)?;
                    Some((r.checkpoint.meta.clone(), r.path.display().to_string()))
                }
                Some(Source::Set(dir)) => {
                    // A save set into plain DDP: every parameter and optimizer tensor gathered
                    // from the shards into Burn's records (a set holds no comm hook state: its
                    // run had none, and the hook is a hyper-parameter the resume checks).
                    // Every rank reads the set; any rank's failure fails every rank.
                    let opt = std::mem::replace(&mut t.opt, optimizer_placeholder());
                    let read = resume::consolidated(dir).and_then(|(flat, what)| {
                        let opt = resume::flat_to_burn(&flat, &mut t.ddp, opt)?;
                        Ok((opt, flat.meta, what))
                    });
                    let read = read.map_err(|e| ddprs::Error::Checkpoint(e.to_string()));
                    let (opt, meta, what) =
                        ddprs::sharding::agree(&s.pg, "loading the save set", read)?;
                    t.opt = opt;
                    Some((meta, what))
                }
                None => None,
            };
            let start = Start::new(args, &s, &plan, loaded)?;
            train_loop(args, &s, &plan, t, start)
        }
        (_, OptimizerKind::Sgd) => run_zero(args, &s, &plan, ddp, stage, sgd(args).build(), source),
        (_, OptimizerKind::Adamw) => run_zero(
            args,
            &s,
            &plan,
            ddp,
            stage,
            AdamWConfig::new().build(),
            source,
        ),
    }
}

/// Where the loop starts: the checkpoint's position checked against this run (at any world
/// size: another one re-shards the rest of the epoch over this world's ranks).
struct Start {
    pos: TrainingState,
    /// `Some(global samples of the epoch consumed)` when resumed at another world size or in a
    /// re-sharded epoch: this world's sharding of the first epoch starts there, and the run's
    /// checkpoints record their global position.
    reshard: Option<usize>,
}

impl Start {
    /// Checks `loaded` (the checkpoint's metadata and where it came from) and says where the
    /// run continues.
    fn new(
        args: &Args,
        s: &Setup,
        plan: &RunPlan,
        loaded: Option<(checkpoint::CheckpointMeta, String)>,
    ) -> BoxResult<Start> {
        let (rank, world) = (s.pg.rank(), s.pg.size());
        let Some((meta, what)) = loaded else {
            if let (true, Some(dir)) = (args.resume, &args.common.checkpoint_dir) {
                // Never a fresh start over checkpoints this loop cannot load.
                if has_learner_checkpoints(dir) {
                    return Err(format!(
                        "--resume: {} holds checkpoints of Burn's Learner: resume them with \
                         --learner; nothing was loaded",
                        dir.display()
                    )
                    .into());
                }
                if rank == 0 {
                    println!("no checkpoint in {}: starting fresh", dir.display());
                }
            }
            return Ok(Start {
                pos: TrainingState::default(),
                reshard: None,
            });
        };
        let point = plan.resume_point(&meta, s.train.len())?;
        if rank == 0 {
            println!("{}", point.describe(&what, world));
        }
        Ok(Start {
            pos: point.state,
            reshard: point.reshard,
        })
    }
}

/// `--zero 1|2`: `ddprs::burn::ZeroDdp` with Burn's bare `optim`; a resumed run first loads its
/// cut of the save set (a collective), or of a plain checkpoint (`ZeroDdp::import` of its flat
/// form).
fn run_zero<O: Optimizer>(
    args: &Args,
    s: &Setup,
    plan: &RunPlan,
    mut ddp: Ddp<Mlp>,
    stage: ZeroStage,
    optim: O,
    source: Option<Source>,
) -> BoxResult<()> {
    // A plain checkpoint's Burn records are loaded into the module (and Burn's optimizer)
    // before the module is wrapped; `import` then takes this rank's chunks of the flat form.
    let flat = match &source {
        Some(Source::Plain(r)) => {
            let kind = resume::optimizer_kind::<O>();
            let flat = resume::burn_to_flat(&r.checkpoint, &mut ddp, optimizer(args), &kind)?;
            Some((flat, r.path.display().to_string()))
        }
        _ => None,
    };
    let mut zero = ZeroDdp::new(ddp, stage, optim)?;
    let loaded = match (&source, flat) {
        (Some(Source::Plain(_)), Some((flat, what))) => {
            zero.import(&flat)?;
            Some((flat.meta, what))
        }
        (Some(Source::Set(dir)), _) => {
            let meta = zero.load(dir)?.ok_or("the save set disappeared")?;
            Some((meta, format!("the sharded set in {}", dir.display())))
        }
        _ => None,
    };
    let start = Start::new(args, s, plan, loaded)?;
    train_loop(args, s, plan, zero, start)
}

/// What the epoch loop drives: plain DDP with Burn's optimizer (and a comm hook), or ZeRO.
trait Stepper {
    fn ddp(&self) -> &Ddp<Mlp>;
    /// The run's step count (for the reducer's messages).
    fn set_step(&mut self, step: u64);
    /// Backward of `loss`, the gradients' synchronization and one optimizer step.
    fn train_step(&mut self, loss: Tensor<1>, lr: f64) -> BoxResult<()>;
    /// A checkpoint with metadata `meta` (a collective).
    fn save(
        &mut self,
        pg: &ProcessGroup,
        args: &Args,
        meta: &CheckpointMeta,
        writer: &mut Writer,
    ) -> BoxResult<()>;
    /// Once the last epoch is trained, before its checkpoint: DiLoCo's last synchronization
    /// (a collective; `ddp_example_support::outer`). Nothing for the others.
    fn end_training(&mut self) -> BoxResult<()> {
        Ok(())
    }
    /// After the last step (e.g. local SGD's last averaging); the bytes this rank sent in this
    /// run of `steps_run` steps.
    fn finish(&mut self, steps_run: u64) -> BoxResult<u64>;
}

/// `Ddp` with Burn's `ModuleOptimizer` and the outer loop of local SGD (model averaging) or
/// DiLoCo.
struct DdpStepper {
    ddp: Ddp<Mlp>,
    opt: ModuleOptimizer,
    outer: Option<Outer>,
}

impl DdpStepper {
    /// Loads a plain checkpoint (`from` names it): Burn's records, the comm hook's state (this
    /// rank's), the model averager's, and DiLoCo's outer state with this rank's own records.
    fn resume(&mut self, ckpt: &Checkpoint, from: &str, pg: &ProcessGroup) -> BoxResult<()> {
        let rank = pg.rank();
        let opt = std::mem::replace(&mut self.opt, optimizer_placeholder());
        self.opt = self.ddp.load_records(ckpt, opt)?;
        let kind = self.ddp.reducer().comm_hook_state().kind;
        let hook_state = ckpt.hook_state(&kind)?.for_rank(rank);
        self.ddp.reducer_mut().load_comm_hook_state(&hook_state)?;
        if let Some(o) = &mut self.outer {
            // This rank's own parameters and optimizer state (rank 0's were loaded above), or a
            // joining rank's (DiLoCo: from the last synchronization).
            let own = o.restore("train-digits-burn", ckpt, from, rank, pg.size())?;
            let opt = std::mem::replace(&mut self.opt, optimizer_placeholder());
            self.opt = self.ddp.load_records(&own.local, opt)?;
            self.ddp.with_params(|_, p| o.joined(&own, p))?;
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
        if let Some(o) = &mut self.outer {
            self.ddp.with_params(|pg, p| o.step(pg, p))?;
        }
        Ok(())
    }

    fn save(
        &mut self,
        pg: &ProcessGroup,
        args: &Args,
        meta: &CheckpointMeta,
        writer: &mut Writer,
    ) -> BoxResult<()> {
        save(pg, args, self, meta, writer)
    }

    fn end_training(&mut self) -> BoxResult<()> {
        if let Some(o @ Outer::DiLoCo(_)) = &mut self.outer {
            self.ddp.with_params(|pg, p| o.finish(pg, p))?;
        }
        Ok(())
    }

    fn finish(&mut self, _steps_run: u64) -> BoxResult<u64> {
        // Local SGD and DiLoCo: replicas differ between synchronizations; synchronize once more
        // at the end (DiLoCo: already done after the last epoch, unless the run stopped
        // earlier).
        if let Some(o) = &mut self.outer {
            self.ddp.with_params(|pg, p| o.finish(pg, p))?;
        }
        Ok(self.ddp.reducer().bytes_sent() + self.outer.as_ref().map_or(0, |o| o.bytes_sent()))
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
        &mut self,
        _pg: &ProcessGroup,
        args: &Args,
        meta: &CheckpointMeta,
        _writer: &mut Writer,
    ) -> BoxResult<()> {
        if let Some(dir) = &args.common.checkpoint_dir {
            // Every rank writes its shard; rank 0 the index (loadable at any world size and
            // stage).
            ZeroDdp::save(self, dir, meta)?;
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
    start: Start,
) -> BoxResult<()> {
    let Start {
        mut pos,
        mut reshard,
    } = start;
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
            args.common.batch_size,
            args.common.batch_size * world,
            plan.steps_per_epoch(),
            args.common.optimizer_name(),
            args.common.lr(),
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
    let mut writer = Writer::new(&args.common);
    // A re-sharded run (resumed at another world size) records the global position of the
    // epoch in its checkpoints: `epoch_base` global samples of the epoch were consumed before
    // this world's sharding of it began, then `pos.consumed` per rank.
    let resharded_run = reshard.is_some();
    let mut epoch_base = 0usize;
    let meta_at = |base: usize, pos: &TrainingState| match resharded_run {
        true => plan.meta_global(pos, base + pos.consumed * world),
        false => plan.meta(pos),
    };
    'epochs: while pos.epoch < args.common.epochs {
        shard.set_epoch(pos.epoch);
        let (epoch_loader, skip) = match reshard.take() {
            Some(g) => {
                // The rest of the epoch's global order, split over this world's ranks.
                epoch_base = g;
                let mut sampler =
                    DistributedSampler::new(train.len(), world, rank)?.seed(args.common.seed);
                sampler.set_epoch(pos.epoch);
                let rows = InMemDataset::new(sampler.indices_from_global(g));
                let l = DataLoaderBuilder::new(Rows(train.clone()))
                    .batch_size(args.common.batch_size)
                    .set_device(device.clone())
                    .build(rows);
                (l, 0)
            }
            None => {
                epoch_base = 0;
                (loader.clone(), pos.consumed / args.common.batch_size)
            }
        };
        let mut loss_sum = 0f64;
        let mut batches = 0u64;
        for b in epoch_loader.iter().skip(skip) {
            if args.common.max_steps.is_some_and(|m| pos.step >= m) {
                break 'epochs;
            }
            let (x, y) = b?;
            let n = y.dims()[0];
            let loss = t.ddp().module().loss(x, y);
            loss_sum += loss.clone().into_scalar::<f64>();
            t.train_step(loss, args.common.lr())?;
            pos.step += 1;
            pos.consumed += n;
            steps_run += 1;
            local_samples += n as u64;
            batches += 1;
        }
        pos.epoch += 1;
        pos.consumed = 0;
        epoch_base = 0;
        if pos.epoch == args.common.epochs {
            t.end_training()?;
        }
        t.save(pg, args, &meta_at(0, &pos), &mut writer)?;
        if let Some(target) = args.common.target_accuracy {
            // Rank 0 evaluates (outside the timed span); every rank learns whether to stop.
            let paused = Instant::now();
            let reached = ddprs::join::rank0_decides(pg, || -> BoxResult<bool> {
                Ok(evaluate(t.ddp().module(), test, device).0 >= target)
            })?;
            eval_time += paused.elapsed();
            if reached {
                time_to_target = Some(start.elapsed() - eval_time);
                break 'epochs;
            }
        }
        if rank == 0 && args.common.log_due(pos.epoch) {
            let (acc, _) = evaluate(t.ddp().module(), test, device);
            println!(
                "{}",
                args.common.epoch_line(
                    pos.epoch,
                    pos.step,
                    loss_sum / batches.max(1) as f64,
                    acc,
                    start.elapsed().as_secs_f64(),
                )
            );
        }
    }
    let train_time = start.elapsed() - eval_time;
    if pos.epoch < args.common.epochs && time_to_target.is_none() {
        t.save(pg, args, &meta_at(epoch_base, &pos), &mut writer)?;
    }
    writer.finish()?; // the last background write has landed (or failed: an error)
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
