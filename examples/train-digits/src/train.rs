//! One worker of `train-digits`: joins the process group, trains with `ddprs::candle::Ddp` and
//! `ddprs::candle::optim::Sgd` (or AdamW), checkpoints every epoch (rank 0, atomically, checked
//! before training starts and on resume by `ddprs::checkpoint::resume_or_start`), resumes exactly,
//! and reports accuracy, loss, throughput and the cross-rank replica check.

use crate::model::{evaluate, Mlp};
use crate::observe::{MetricsLog, Progress, StepMetrics};
use crate::trainer::{self, Trainer};
use crate::{Args, Backend, BackwardMode};
use candle_core::{Module, Tensor, Var};
use candle_nn::VarMap;
use ddp_example_support::data::{self, CLASSES, FEATURES};
use ddp_example_support::flags::OptimizerKind;
use ddp_example_support::outer::Outer;
use ddp_example_support::resume::{resume_source, Source, Writer};
use ddp_example_support::summary::{self, Details, RunSummary};
use ddprs::candle::optim::ParamsSgd;
use ddprs::candle::{Ddp, DdpOptions, Fsdp, ShardOptimizer, ZeroDdp};
use ddprs::checkpoint::{self, Checkpoint, RunPlan, TrainingState};
use ddprs::comm::process_group::Backend as CommBackend;
use ddprs::comm::{init_process_group, InitOptions, ProcessGroup};
use ddprs::sharding::ZeroStage;
use ddprs::trace::{self, Phase, StepProfiler};
use ddprs::DistributedSampler;
use std::error::Error;
use std::time::{Duration, Instant};

type BoxResult<T> = Result<T, Box<dyn Error>>;

fn init_options(args: &Args) -> InitOptions {
    InitOptions {
        timeout: Duration::from_secs(args.common.timeout_s),
        backend: args.backend.map(|b| match b {
            Backend::Auto => CommBackend::Auto,
            Backend::Tcp => CommBackend::Tcp,
            Backend::Shm => CommBackend::Shm,
            Backend::Mpi => CommBackend::Mpi,
        }),
        ..Default::default()
    }
}

/// The learning rate at world size `world`: `--lr`, scaled linearly to the global batch with
/// `--scale-lr BASE`.
fn effective_lr(args: &Args, world: usize) -> f64 {
    match args.scale_lr {
        Some(base) => ddprs::scale_lr_linear(args.common.lr(), args.common.batch_size, world, base),
        None => args.common.lr(),
    }
}

/// The optimizer of the run, at learning rate `lr`.
fn optimizer(args: &Args, lr: f64) -> ShardOptimizer {
    match args.common.optimizer {
        OptimizerKind::Sgd => ShardOptimizer::Sgd(ParamsSgd {
            lr,
            momentum: args.common.momentum,
            ..Default::default()
        }),
        OptimizerKind::Adamw => ShardOptimizer::AdamW(candle_nn::ParamsAdamW {
            lr,
            ..Default::default()
        }),
    }
}

/// The run as checkpoints record it (`CommonArgs::run_plan`), `--scale-lr` among its
/// hyper-parameters.
fn run_plan(args: &Args, world_size: usize, samples_per_epoch: usize) -> RunPlan {
    let mut plan = args.common.run_plan(world_size, samples_per_epoch);
    if let Some(base) = args.scale_lr {
        plan.hyper["scale_lr"] = base.into();
    }
    plan
}

/// Where the run stands in its epoch, in the checkpoint's terms.
struct Position {
    state: TrainingState,
    /// `Some(global samples of the epoch consumed)` once the run was re-sharded (resumed at
    /// another world size): its checkpoints are then checked by the global position.
    global: Option<usize>,
}

impl Position {
    fn meta(&self, plan: &RunPlan) -> checkpoint::CheckpointMeta {
        match self.global {
            Some(g) => plan.meta_global(&self.state, g),
            None => plan.meta(&self.state),
        }
    }
}

/// The outer loop of `--hook` (local SGD's model averaging, DiLoCo), beside the DDP wrapper.
struct Extra {
    outer: Option<Outer>,
}

impl Extra {
    /// After every optimizer step: local SGD's averaging or DiLoCo's outer step (each a
    /// collective on its synchronization steps).
    fn step(&mut self, pg: &ProcessGroup, trainer: &Trainer) -> BoxResult<()> {
        if let (Some(o), Some(z)) = (&mut self.outer, trainer.zero()) {
            o.step(pg, z.params())?;
        }
        Ok(())
    }

    /// The end of training: local SGD averages once more, DiLoCo synchronizes every fragment
    /// (a collective; nothing the second time), so that every rank holds the same model.
    fn finish(&mut self, pg: &ProcessGroup, trainer: &Trainer) -> BoxResult<()> {
        if let (Some(o), Some(z)) = (&mut self.outer, trainer.zero()) {
            o.finish(pg, z.params())?;
        }
        Ok(())
    }

    /// Bytes this rank sent for gradients, model averaging and pseudo-gradients.
    fn bytes_sent(&self, trainer: &Trainer) -> u64 {
        trainer.bytes_sent() + self.outer.as_ref().map_or(0, |o| o.bytes_sent())
    }
}

fn save(
    pg: &ProcessGroup,
    args: &Args,
    plan: &RunPlan,
    trainer: &Trainer,
    extra: &mut Extra,
    position: &Position,
    writer: &mut Writer,
) -> BoxResult<()> {
    let Some(dir) = &args.common.checkpoint_dir else {
        return Ok(());
    };
    let zero = match trainer.zero() {
        Some(z) if z.stage() == ZeroStage::Ddp => z,
        _ => {
            // Sharded: every rank writes its own shard (loadable at any world size and stage).
            trainer.save_sharded(dir, &position.meta(plan))?;
            return Ok(());
        }
    };
    let (ddp, opt) = (zero.ddp(), zero.optimizer());
    // Comm hook state (PowerSGD's residuals and Q matrices, step counters): the residuals differ
    // between ranks, so rank 0 saves every rank's (a collective).
    let hook_state = ddprs::hooks::gather_state(pg, &ddp.reducer().comm_hook_state())?;
    let own = |meta| -> BoxResult<Checkpoint> {
        let mut ckpt = Checkpoint::new(meta);
        ddprs::candle::checkpoint::save_vars(&mut ckpt, ddp.named_vars())?;
        ckpt.save_optimizer(opt)?;
        Ok(ckpt)
    };
    // Local SGD, DiLoCo: every rank's own parameters and optimizer state, and the outer
    // loop's state (a collective).
    let outer = match &mut extra.outer {
        Some(o) => Some(o.gather(pg, &own(position.meta(plan))?)?),
        None => None,
    };
    if pg.rank() == 0 {
        let mut ckpt = own(position.meta(plan))?;
        ckpt.save_hook_state(&hook_state)?;
        if let Some(g) = outer {
            g.store(&mut ckpt)?;
        }
        writer.write(dir, ckpt)?;
    }
    Ok(())
}

/// Loads `source` into the run's wrapper and optimizer at any stage; returns the checkpoint's
/// metadata and a description of where it came from.
fn load_source(
    ddp: &mut Trainer,
    source: &Source,
    extra: &mut Extra,
    pg: &ProcessGroup,
) -> BoxResult<(checkpoint::CheckpointMeta, String)> {
    let rank = pg.rank();
    let stage0 = ddp.zero().is_some_and(|z| z.stage() == ZeroStage::Ddp);
    match source {
        Source::Plain(r) if stage0 => {
            let z = ddp.zero_mut().expect("stage 0");
            ddprs::candle::checkpoint::load_vars(&r.checkpoint, z.named_vars())?;
            r.checkpoint.load_optimizer(z.optimizer_mut())?;
            let kind = z.reducer().comm_hook_state().kind;
            let hook_state = r.checkpoint.hook_state(&kind)?.for_rank(rank);
            z.ddp_mut()
                .reducer_mut()
                .load_comm_hook_state(&hook_state)?;
            let from = r.path.display().to_string();
            if let Some(o) = &mut extra.outer {
                // This rank's own parameters and optimizer state (rank 0's were loaded above),
                // or a joining rank's (DiLoCo: from the last synchronization).
                let own = o.restore("train-digits", &r.checkpoint, &from, rank, pg.size())?;
                ddprs::candle::checkpoint::load_vars(&own.local, z.named_vars())?;
                own.local.load_optimizer(z.optimizer_mut())?;
                o.joined(&own, z.ddp().params())?;
            }
            Ok((r.checkpoint.meta.clone(), from))
        }
        Source::Plain(r) => {
            // A plain checkpoint into a sharded run: each rank takes its chunks.
            ddp.import(&r.checkpoint)?;
            Ok((r.checkpoint.meta.clone(), r.path.display().to_string()))
        }
        Source::Set(dir) if stage0 => {
            // A save set into plain DDP: every parameter and optimizer slot gathered from the
            // shards (the run's hyper-parameters, hook included, were checked: a set has none).
            let ckpt = ddprs::sharding::consolidate(dir)?.ok_or("the save set disappeared")?;
            let z = ddp.zero_mut().expect("stage 0");
            ddprs::candle::checkpoint::load_vars(&ckpt, z.named_vars())?;
            ckpt.load_optimizer(z.optimizer_mut())?;
            let set = ddprs::sharding::latest_set(dir)?.unwrap_or_else(|| dir.clone());
            Ok((ckpt.meta, format!("the sharded set {}", set.display())))
        }
        Source::Set(dir) => {
            let meta = ddp.load_sharded(dir)?.ok_or("the save set disappeared")?;
            Ok((meta, format!("the sharded set in {}", dir.display())))
        }
    }
}

pub fn run(args: &Args) -> BoxResult<()> {
    if args.common.batch_size == 0 {
        return Err("--batch-size must be at least 1".into());
    }
    let pg = init_process_group(init_options(args))?;
    let (rank, world) = (pg.rank(), pg.size());
    let tracing = trace::start_from_env(&pg, args.trace.as_deref())?;
    let all = data::load()?;
    let (train, test) = data::train_test_split(&all);

    let device = ddprs::candle::device::worker_device(args.device)?;
    let varmap = VarMap::new();
    let model = Mlp::new(
        &varmap,
        FEATURES,
        args.common.hidden,
        CLASSES,
        args.common.seed,
        &device,
    )?;

    let mut sampler = DistributedSampler::new(train.len(), world, rank)?.seed(args.common.seed);
    let plan = run_plan(args, world, sampler.len());
    // Before training: rank 0 checks that the directory is writable and (with --resume) reads the
    // checkpoint and shares it, so the directory need not be shared; every rank checks it.
    let stage = ZeroStage::from_level(args.zero)?;
    if stage != ZeroStage::Ddp && args.backward == BackwardMode::Blockwise {
        return Err(format!(
            "--backward blockwise is not supported with --zero {} yet (stage 3 runs its own \
             backward, unit by unit)",
            args.zero
        )
        .into());
    }
    if stage != ZeroStage::Ddp && !device.is_cpu() {
        return Err(format!(
            "--zero {} keeps its shards in host memory: run it with --device cpu",
            args.zero
        )
        .into());
    }
    if stage != ZeroStage::Ddp && args.common.hook != ddprs::hooks::HookSpec::None {
        return Err(format!(
            "--hook {} cannot be combined with --zero {}: ZeRO reduce-scatters the gradients \
             through its own comm hook",
            args.common.hook, args.zero
        )
        .into());
    }
    // Plain checkpoints: rank 0 locks and probes the directory, loads (with --resume) and
    // shares. Save sets (stages 1-3): every rank writes its shard, so every rank checks.
    let plain = match &args.common.checkpoint_dir {
        Some(dir) if stage == ZeroStage::Ddp || args.resume => {
            checkpoint::resume_or_start_global(&pg, dir, args.resume, &plan, train.len())?
        }
        _ => None,
    };
    if let (Some(dir), true) = (&args.common.checkpoint_dir, stage != ZeroStage::Ddp) {
        ddprs::sharding::prepare_dir(&pg, dir)?;
    }
    let source = match &args.common.checkpoint_dir {
        Some(dir) if args.resume => resume_source(dir, plain)?,
        _ => None,
    };
    let lr = effective_lr(args, world);

    let opts = DdpOptions {
        check_finite: !args.common.no_check_finite,
        ..Default::default()
    };
    let mut ddp = if stage == ZeroStage::Three {
        let units = trainer::units(FEATURES, args.common.hidden, CLASSES);
        Trainer::Fsdp(Box::new(Fsdp::from_varmap(&varmap, units, &pg, |vars| {
            optimizer(args, lr).build(vars)
        })?))
    } else {
        let mut ddp = Ddp::new(&varmap, &pg, opts)?;
        if let Some(hook) = args.common.hook.hook()? {
            ddp.register_comm_hook(hook)?;
        }
        Trainer::Zero(Box::new(ZeroDdp::with_optimizer(
            ddp,
            stage,
            optimizer(args, lr),
        )?))
    };
    let mut extra = Extra {
        // Anchored at the replicas the wrapper made equal (stage 0 only: --zero with a hook was
        // refused above).
        outer: match ddp.zero() {
            Some(z) => Outer::new(&args.common.hook, z.params())?,
            None => None,
        },
    };
    let mut pos = TrainingState::default();
    let mut writer = Writer::new(&args.common);
    // Set when resuming at another world size (or in a re-sharded run): the global samples of
    // the epoch already consumed, where this world's sharding of the epoch starts.
    let mut reshard: Option<usize> = None;
    let mut resharded_run = false;
    if let Some(source) = source {
        let (meta, what) = load_source(&mut ddp, &source, &mut extra, &pg)?;
        let point = plan.resume_point(&meta, train.len())?;
        (pos, reshard) = (point.state, point.reshard);
        resharded_run = reshard.is_some();
        if rank == 0 {
            println!("{}", point.describe(&what, world));
        }
    } else if let (true, Some(dir), 0) = (args.resume, &args.common.checkpoint_dir, rank) {
        println!("no checkpoint in {}: starting fresh", dir.display());
    }
    if let Some(z) = ddp.zero_mut() {
        z.ddp_mut().reducer_mut().set_step(pos.step); // non-finite errors name the run's step
    }
    if rank == 0 {
        println!(
            "train-digits: world_size {world} on {}, {} train / {} test images, batch {} per rank \
             (global {}), {} steps per epoch, {} lr {}, {} backward, {} parameters",
            args.device,
            train.len(),
            test.len(),
            args.common.batch_size,
            args.common.batch_size * world,
            sampler.len().div_ceil(args.common.batch_size),
            args.common.optimizer_name(),
            lr,
            match args.backward {
                BackwardMode::Plain => "plain",
                BackwardMode::Blockwise => "blockwise",
            },
            ddp.param_count(),
        );
    }

    let steps_per_epoch = sampler.len().div_ceil(args.common.batch_size) as u64;
    let total_steps = args
        .common
        .max_steps
        .unwrap_or(u64::MAX)
        .min(args.common.epochs.saturating_mul(steps_per_epoch));
    let mut progress = Progress::new(rank, args.quiet, total_steps, pos.step, args.common.epochs);
    let mut metrics = match (&args.metrics, rank) {
        (Some(path), 0) => Some(
            MetricsLog::open(path, args.metrics_every, world)
                .map_err(|e| format!("--metrics {}: {e}", path.display()))?,
        ),
        _ => None,
    };
    let mut prof = StepProfiler::new(&pg);
    let stage1 = |x: &Tensor| model.stage1(x);
    let stage2 = |h: &Tensor| model.stage2(h);
    let stages: [&dyn Module; 2] = [&stage1, &stage2];
    // The clock starts once every rank holds its replica (rank 0's broadcast received: on a
    // slow link that takes a while after rank 0 has sent it), as the PyTorch peer's barrier.
    pg.barrier()?;
    let start = Instant::now();
    let mut eval_time = Duration::ZERO;
    let mut time_to_target: Option<Duration> = None;
    let mut local_samples = 0u64;
    let mut steps_run = 0u64;
    // Global samples of the current epoch consumed before this world's sharding of it began.
    let mut epoch_base = 0usize;
    let global_at =
        |base: usize, pos: &TrainingState| resharded_run.then_some(base + pos.consumed * world);
    'epochs: while pos.epoch < args.common.epochs {
        sampler.set_epoch(pos.epoch);
        let indices = match reshard.take() {
            Some(g) => {
                epoch_base = g;
                sampler.indices_from_global(g)
            }
            None => {
                epoch_base = 0;
                sampler.indices_from(pos.consumed)?
            }
        };
        let epoch_len = pos.consumed + indices.len();
        let mut loss_sum = 0f64;
        let mut batches = 0u64;
        for batch in indices.chunks(args.common.batch_size) {
            if args.common.max_steps.is_some_and(|m| pos.step >= m) {
                break 'epochs;
            }
            prof.begin_step();
            let (x, y) = prof.phase(Phase::Data, || -> candle_core::Result<_> {
                let (x, y) = train.gather(batch);
                let x = Tensor::from_vec(x, (batch.len(), FEATURES), &device)?;
                Ok((x, Tensor::from_vec(y, batch.len(), &device)?))
            })?;
            // The reducer records the backward (and its buckets) on the timeline itself.
            let loss = match (&mut ddp, args.backward) {
                (Trainer::Fsdp(f), _) => {
                    // Forward and backward interleave unit by unit: one span for both.
                    let out = prof.phase(Phase::Forward, || {
                        f.forward_backward(&x, |logits| candle_nn::loss::cross_entropy(logits, &y))
                    })?;
                    prof.phase(Phase::Optimizer, || f.step())?;
                    out.loss
                }
                (Trainer::Zero(ddp), BackwardMode::Plain) => {
                    let loss = prof.phase(Phase::Forward, || {
                        candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)
                    })?;
                    ddp.backward(&loss)?;
                    prof.phase(Phase::Optimizer, || ddp.step())?;
                    loss
                }
                (Trainer::Zero(ddp), BackwardMode::Blockwise) => {
                    // Forward and backward interleave stage by stage: one span for both.
                    let out = prof.phase(Phase::Forward, || {
                        ddp.ddp_mut()
                            .forward_backward_blockwise(&stages, &x, |logits| {
                                candle_nn::loss::cross_entropy(logits, &y)
                            })
                    })?;
                    prof.phase(Phase::Optimizer, || ddp.optimizer_mut().step(&out.grads))?;
                    out.loss
                }
            };
            let wait = ddp.last_wait();
            prof.add_comm_wait(wait);
            extra.step(&pg, &ddp)?;
            pos.step += 1;
            pos.consumed += batch.len();
            steps_run += 1;
            local_samples += batch.len() as u64;
            let loss = loss.to_scalar::<f32>()? as f64;
            loss_sum += loss;
            batches += 1;
            prof.end_step();
            let elapsed = start.elapsed().as_secs_f64();
            let sps = (local_samples * world as u64) as f64 / elapsed.max(1e-9);
            progress.step(pos.epoch, pos.step, loss, sps);
            let last_of_epoch = pos.consumed >= epoch_len;
            if let Some(m) = &mut metrics {
                m.count(batch.len(), wait);
                if m.due(pos.step) && !last_of_epoch {
                    m.write(StepMetrics {
                        step: pos.step,
                        epoch: pos.epoch,
                        loss,
                        accuracy: None,
                        lr,
                        bytes_sent: extra.bytes_sent(&ddp),
                    })?;
                }
            }
            if args
                .checkpoint_every
                .is_some_and(|k| pos.step.is_multiple_of(k))
                && !last_of_epoch
            {
                let here = Position {
                    state: pos,
                    global: global_at(epoch_base, &pos),
                };
                prof.phase(Phase::Checkpoint, || {
                    save(&pg, args, &plan, &ddp, &mut extra, &here, &mut writer)
                })?;
            }
        }
        pos.epoch += 1;
        pos.consumed = 0;
        if pos.epoch == args.common.epochs {
            // The last epoch is trained: DiLoCo's last synchronization, before the evaluation
            // and the checkpoint, which then see the one model (`ddp_example_support::outer`).
            extra.finish(&pg, &ddp)?;
        }
        // Stage 3: the evaluation copy gathered from the shards, on every rank.
        ddp.refresh(&varmap)?;
        if let Some(m) = &mut metrics {
            // The epoch's last line carries the held-out accuracy (rank 0 evaluates).
            let paused = Instant::now();
            let (acc, _) = prof.phase(Phase::Eval, || {
                evaluate(&model, &test.features, &test.labels)
            })?;
            m.write(StepMetrics {
                step: pos.step,
                epoch: pos.epoch - 1,
                loss: loss_sum / batches.max(1) as f64,
                accuracy: Some(acc),
                lr,
                bytes_sent: extra.bytes_sent(&ddp),
            })?;
            eval_time += paused.elapsed();
        }
        epoch_base = 0;
        let here = Position {
            state: pos,
            global: global_at(0, &pos),
        };
        prof.phase(Phase::Checkpoint, || {
            save(&pg, args, &plan, &ddp, &mut extra, &here, &mut writer)
        })?;
        if let Some(target) = args.common.target_accuracy {
            // Rank 0 evaluates (outside the timed span); every rank learns whether to stop.
            let paused = Instant::now();
            let reached = ddprs::join::rank0_decides(&pg, || -> BoxResult<bool> {
                Ok(evaluate(&model, &test.features, &test.labels)?.0 >= target)
            })?;
            eval_time += paused.elapsed();
            if reached {
                time_to_target = Some(start.elapsed() - eval_time);
                break 'epochs;
            }
        }
        if rank == 0 && !args.quiet && args.common.log_due(pos.epoch) {
            let (acc, _) = evaluate(&model, &test.features, &test.labels)?;
            progress.println(&args.common.epoch_line(
                pos.epoch,
                pos.step,
                loss_sum / batches.max(1) as f64,
                acc,
                start.elapsed().as_secs_f64(),
            ));
        }
    }
    progress.finish();
    let train_time = start.elapsed() - eval_time;
    // Stopped early (--max-steps) mid-epoch: record the exact position.
    if pos.epoch < args.common.epochs {
        let here = Position {
            state: pos,
            global: global_at(epoch_base, &pos),
        };
        prof.phase(Phase::Checkpoint, || {
            save(&pg, args, &plan, &ddp, &mut extra, &here, &mut writer)
        })?;
    }
    // The last background write has landed (or failed: an error).
    writer.finish()?;
    // Local SGD and DiLoCo: the replicas differ between synchronizations; synchronize once more
    // so that every rank ends with the same model (DiLoCo: already done after the last epoch; a
    // run stopped earlier wrote its checkpoint first, so that a resume is exact).
    extra.finish(&pg, &ddp)?;
    let bytes_per_step = if stage != ZeroStage::Ddp {
        ddp.bytes_per_step() as f64
    } else {
        extra.bytes_sent(&ddp) as f64 / steps_run.max(1) as f64
    };
    ddp.refresh(&varmap)?;

    // Where the steps' time went (a collective), then the merged timeline.
    let report = prof.report(&pg)?;
    if let (Some(m), true) = (&mut metrics, rank == 0) {
        m.write_report(&report)?;
    }
    if let Some(path) = trace::finish(&pg)? {
        println!("timeline of every rank: {}", path.display());
    }
    if rank == 0 {
        println!("{report}");
        let mut targets: Vec<std::path::PathBuf> = args.report.iter().cloned().collect();
        if let (true, Some(dir)) = (tracing, trace_dir(args)) {
            targets.push(dir.join("report.json"));
        }
        for path in targets {
            std::fs::write(&path, format!("{}\n", report.to_json()))
                .map_err(|e| format!("bottleneck report {}: {e}", path.display()))?;
        }
    }

    // Summary: global samples, replica check, statistics.
    let (samples_per_s, train_time_s) = summary::throughput(&pg, local_samples, train_time)?;
    let replicas = ddp.verify_replicas()?;
    if rank == 0 {
        let (test_accuracy, test_loss) = evaluate(&model, &test.features, &test.labels)?;
        let (_, final_loss) = evaluate(&model, &train.features, &train.labels)?;
        let vars: Vec<Var> = ddprs::candle::CandleParams::from_varmap(&varmap)?
            .vars()
            .iter()
            .map(|(_, v)| v.clone())
            .collect();
        let (param_sum, param_l2) =
            ddprs::candle::tensors::param_sum_l2(&vars.iter().collect::<Vec<_>>())?;
        let run = RunSummary {
            world_size: world,
            steps: pos.step,
            test_accuracy,
            final_loss,
            samples_per_s,
            replicas_identical: replicas.identical,
            max_param_diff: replicas.max_abs_diff,
            param_sum,
            param_l2,
            hook: args.common.hook.to_string(),
            bytes_per_step,
            train_time_s,
            time_to_target_s: time_to_target.map(|t| t.as_secs_f64()),
        };
        let details = Details {
            test_images: test.len(),
            test_loss,
            steps_run,
            stats: ddp.total_stats(),
            // The overlap figure is the report's (one definition, printed one way).
            overlap: Some(report.hidden_comm_line()),
            replicas: replicas.describe(&ddp.param_names()),
        };
        summary::print(&run, &details, args.common.json);
    }
    // Keep every rank alive until rank 0 has finished using the group.
    pg.barrier()?;
    if !replicas.identical {
        return Err(format!("after training: {}", replicas.describe(&ddp.param_names())).into());
    }
    Ok(())
}

/// The trace directory: `--trace`, else `DDP_TRACE`.
fn trace_dir(args: &Args) -> Option<std::path::PathBuf> {
    args.trace.clone().or_else(|| {
        std::env::var_os(trace::TRACE_ENV)
            .filter(|v| !v.is_empty())
            .map(Into::into)
    })
}
