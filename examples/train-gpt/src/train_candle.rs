//! One worker of `train-gpt --framework candle`: the model of [`crate::gpt_candle`] under
//! `ddprs::candle`'s DDP (`--zero 0`), ZeRO stages 1 and 2 (`ZeroDdp`) or stage 3 (`Fsdp`, over
//! the model's units: the embeddings, each block, the head), AdamW with decay on 2-D weights only
//! (also inside a ZeRO chunk that spans both kinds), nanoGPT's schedule and global-norm clipping
//! (the norm all-reduced from the shards under ZeRO), checkpoints and exact resume.

use crate::config::Args;
use crate::data::{self, Corpus, Windows};
use crate::fault::{self, RegroupRecord};
use crate::gpt_candle::{self, cross_entropy, decays, Dropout, Gpt, UnitCtx};
use crate::outer;
use crate::report::Report;
use crate::saver::Saver;
use candle_core::{Device, Tensor, Var};
use candle_nn::{Optimizer, ParamsAdamW, VarMap};
use ddp_example_support::outer::Outer;
use ddprs::candle::checkpoint::load_vars;
use ddprs::candle::checkpoint::save_vars;
use ddprs::candle::optim::AdamW;
use ddprs::candle::{Ddp, DdpOptions, Fsdp, ShardOptimizer, ZeroDdp};
use ddprs::comm::process_group::{RegroupOptions, Regrouped};
use ddprs::sharding::ZeroStage;
use ddprs::{CheckpointMeta, ProcessGroup};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The dropout stream of step `it` on `rank`: a function of the seed, rank and step only, so a
/// resumed run draws what the uninterrupted one drew.
pub(crate) fn dropout_seed(seed: u64, rank: usize, it: u64) -> u64 {
    seed ^ (rank as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ it.wrapping_mul(0xbf58_476d_1ce4_e5b9)
}

fn tensors(x: Vec<u32>, y: Vec<u32>, rows: usize, cols: usize) -> Result<(Tensor, Tensor)> {
    let dev = &Device::Cpu;
    Ok((
        Tensor::from_vec(x, (rows, cols), dev)?,
        Tensor::from_vec(y, (rows, cols), dev)?,
    ))
}

/// The model and what trains it, by ZeRO stage.
enum Engine {
    Ddp {
        ddp: Box<Ddp>,
        opt: AdamW,
        model: Gpt,
        /// `--hook localsgd` / `diloco` / `streaming-diloco`: the outer loop after each inner
        /// step.
        outer: Option<Box<Outer>>,
    },
    Zero {
        zero: Box<ZeroDdp>,
        model: Gpt,
    },
    Fsdp {
        fsdp: Box<Fsdp>,
        ctx: Arc<UnitCtx>,
    },
}

impl Engine {
    /// `init_sync`: copy rank 0's parameters to every rank (not for a newcomer, which gets
    /// the live ranks' state from `sync_state`).
    fn new(
        args: &Args,
        pg: &ProcessGroup,
        model: Gpt,
        varmap: &VarMap,
        init_sync: bool,
    ) -> Result<Engine> {
        let params = ParamsAdamW {
            lr: args.lr,
            beta1: 0.9,
            beta2: args.beta2,
            eps: 1e-8,
            weight_decay: args.weight_decay,
        };
        let stage = zero_stage(args.zero);
        Ok(match stage {
            ZeroStage::Ddp => {
                let opts = DdpOptions {
                    init_sync,
                    ..Default::default()
                };
                let mut ddp = Ddp::new(varmap, pg, opts)?;
                if let Some(hook) = args.hook.hook()? {
                    ddp.register_comm_hook(hook)?;
                }
                let vars = ddp.named_vars().to_vec();
                let opt = AdamW::new_named_with_decay(vars, params, |n, v| decays(n, v.dims()))?;
                let outer = Outer::new(&args.hook, ddp.params())?.map(Box::new);
                Engine::Ddp {
                    ddp: Box::new(ddp),
                    opt,
                    model,
                    outer,
                }
            }
            ZeroStage::One | ZeroStage::Two => {
                let ddp = Ddp::new(varmap, pg, Default::default())?;
                let opt = ShardOptimizer::AdamW(params);
                let mut zero = ZeroDdp::with_optimizer(ddp, stage, opt)?;
                zero.set_weight_decay_filter(decays)?;
                Engine::Zero {
                    zero: Box::new(zero),
                    model,
                }
            }
            ZeroStage::Three => {
                let ctx = Arc::new(UnitCtx::default());
                let cfg = model.config().clone();
                drop(model);
                let units = gpt_candle::units(&cfg, args.dropout, ctx.clone())?;
                let mut fsdp = Fsdp::from_varmap(varmap, units, pg, |vars| {
                    Ok(Box::new(AdamW::new_named(vars, params)?))
                })?;
                fsdp.set_weight_decay_filter(decays)?;
                Engine::Fsdp {
                    fsdp: Box::new(fsdp),
                    ctx,
                }
            }
        })
    }

    /// One training step on `(x, y)` at learning rate `lr`; the local loss.
    fn step(&mut self, args: &Args, x: &Tensor, y: &Tensor, lr: f64, seed: u64) -> Result<f64> {
        let mut drop = Dropout::new(args.dropout, seed);
        let clip = args.grad_clip;
        let loss = match self {
            Engine::Ddp {
                ddp,
                opt,
                model,
                outer,
            } => {
                opt.set_learning_rate(lr);
                let loss = model.loss(x, y, &mut drop, true)?;
                let mut grads = ddp.backward(&loss)?;
                if clip > 0.0 {
                    ddp.clip_grad_norm(&mut grads, clip)?;
                }
                opt.step(&grads)?;
                if let Some(o) = outer {
                    o.step(ddp.process_group(), ddp.params())?;
                }
                loss
            }
            Engine::Zero { zero, model } => {
                zero.optimizer_mut().set_learning_rate(lr);
                let loss = model.loss(x, y, &mut drop, true)?;
                zero.backward(&loss)?;
                if clip > 0.0 {
                    zero.clip_grad_norm(clip)?;
                }
                zero.step()?;
                loss
            }
            Engine::Fsdp { fsdp, ctx } => {
                fsdp.optimizer_mut().set_learning_rate(lr);
                ctx.train.store(true, Ordering::Relaxed);
                ctx.seed.store(seed, Ordering::Relaxed);
                let out = fsdp.forward_backward(x, |logits| cross_entropy(logits, y))?;
                if clip > 0.0 {
                    fsdp.clip_grad_norm(clip)?;
                }
                fsdp.step()?;
                out.loss
            }
        };
        Ok(loss.to_scalar::<f32>()? as f64)
    }

    /// Logits of ids `[b, t]`, no dropout (a collective at stage 3, which gathers each unit).
    fn logits(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Engine::Ddp { model, .. } | Engine::Zero { model, .. } => {
                model.forward(x, &mut Dropout::new(0.0, 0), false)
            }
            Engine::Fsdp { fsdp, ctx } => {
                ctx.train.store(false, Ordering::Relaxed);
                fsdp.forward(x).map_err(candle_core::Error::wrap)
            }
        }
    }

    /// Whether evaluation and sampling are collectives (every rank runs them).
    fn collective_eval(&self) -> bool {
        matches!(self, Engine::Fsdp { .. })
    }

    fn save(&mut self, saver: &mut Saver, dir: &Path, meta: CheckpointMeta) -> Result<()> {
        if let Engine::Ddp {
            ddp,
            opt,
            outer: Some(d),
            ..
        } = self
        {
            // The outer loop's state goes with the model (DiLoCo's in-flight fragments completed), and
            // so does every rank's inner state: between synchronizations each rank has its own
            // parameters and AdamW moments (a collective gathers them).
            let (ddp, opt) = (&**ddp, &*opt);
            return outer::save(saver, ddp, d, dir, meta, |ck| {
                let failed = |e: &dyn std::fmt::Display| ddprs::Error::Checkpoint(e.to_string());
                save_vars(ck, ddp.named_vars()).map_err(|e| failed(&e))?;
                ck.save_optimizer(opt).map_err(|e| failed(&e))
            });
        }
        match self {
            Engine::Zero { zero, .. } => {
                return saver.save_set(|sets| match sets {
                    Some(s) => Ok(zero.save_async(s, dir, &meta)?),
                    None => zero.save(dir, &meta).map(|_| None).map_err(Into::into),
                })
            }
            Engine::Fsdp { fsdp, .. } => {
                return saver.save_set(|sets| match sets {
                    Some(s) => Ok(fsdp.save_async(s, dir, &meta)?),
                    None => fsdp.save(dir, &meta).map(|_| None).map_err(Into::into),
                })
            }
            Engine::Ddp { .. } => {}
        }
        saver.save(meta.step, |background| {
            Ok(match (self, background) {
                (Engine::Ddp { ddp, opt, .. }, Some(b)) => {
                    ddp.save_checkpoint_async(b, dir, Some(opt), meta)?
                }
                (Engine::Ddp { ddp, opt, .. }, None) => {
                    ddp.save_checkpoint_with(dir, Some(opt), meta)?;
                    None
                }
                (Engine::Zero { .. } | Engine::Fsdp { .. }, _) => unreachable!("save sets above"),
            })
        })
    }

    /// Loads the checkpoint of `dir` (a plain one at `--zero 0`, written at this world size; a
    /// ZeRO save set at any stage and world size, or else a plain one imported: a collective),
    /// returning its metadata and, when plain, the checkpoint (hook state).
    fn load(&mut self, dir: &Path, world: usize) -> Result<Option<(CheckpointMeta, Loaded)>> {
        let set = ddprs::sharding::latest_set(dir)?.is_some();
        if let Engine::Ddp {
            ddp, opt, outer, ..
        } = self
        {
            let Some(ck) = ddprs::checkpoint::load(dir)? else {
                return match set {
                    true => Err(sharded_set_at_zero0(dir).into()),
                    false => Ok(None),
                };
            };
            data::check_plain_world(&ck, world, ddp.reducer())?;
            load_vars(&ck, ddp.named_vars())?;
            ck.load_optimizer(opt)?;
            if let Some(d) = outer {
                let r = outer::restore(&ck, dir, d, ddp.rank(), world)?;
                load_vars(&r.local, ddp.named_vars())?;
                r.local.load_optimizer(opt)?;
                d.joined(&r, ddp.params())?;
            }
            return Ok(Some((ck.meta.clone(), Loaded::Plain(Box::new(ck)))));
        }
        if !set {
            let Some(ck) = ddprs::checkpoint::load(dir)? else {
                return Ok(None);
            };
            match self {
                Engine::Zero { zero, .. } => zero.import(&ck)?,
                Engine::Fsdp { fsdp, .. } => fsdp.import(&ck)?,
                Engine::Ddp { .. } => unreachable!("handled above"),
            }
            return Ok(Some((ck.meta.clone(), Loaded::Set)));
        }
        let meta = match self {
            Engine::Zero { zero, .. } => zero.load(dir)?,
            Engine::Fsdp { fsdp, .. } => fsdp.load(dir)?,
            Engine::Ddp { .. } => unreachable!("handled above"),
        };
        Ok(meta.map(|m| (m, Loaded::Set)))
    }

    /// `--fault-tolerance`: form the new group and move the DDP onto it, dropping the failed
    /// step's partial gradients (see [`crate::fault`]).
    fn regroup(
        &mut self,
        cause: Option<&ddprs::comm::Error>,
        opts: &RegroupOptions,
    ) -> Result<Regrouped> {
        match self {
            Engine::Ddp { ddp, .. } => Ok(ddp.regroup(cause, opts)?),
            _ => Err("--fault-tolerance needs --zero 0".into()),
        }
    }

    /// `--fault-tolerance`: every member takes the most advanced one's parameters, optimizer
    /// state and position (`meta`: this rank's own, at `step` completed steps; `None` for a
    /// newcomer). Returns the steps completed, the position to re-shard the windows from, and
    /// whether a state was sent.
    fn sync_state(
        &mut self,
        step: Option<u64>,
        meta: CheckpointMeta,
    ) -> Result<(u64, CheckpointMeta, bool)> {
        let Engine::Ddp { ddp, opt, .. } = self else {
            return Err("--fault-tolerance needs --zero 0".into());
        };
        let failed = |e: &dyn std::fmt::Display| ddprs::Error::Checkpoint(e.to_string());
        let sync = ddp.sync_state(step, || {
            let mut ck = ddprs::Checkpoint::new(meta.clone());
            save_vars(&mut ck, ddp.named_vars()).map_err(|e| failed(&e))?;
            ck.save_optimizer(&*opt).map_err(|e| failed(&e))?;
            Ok(ck)
        })?;
        let sent = sync.sent;
        let meta = match sync.received {
            Some(ck) => {
                load_vars(&ck, ddp.named_vars())?;
                ck.load_optimizer(opt)?;
                ck.meta
            }
            None => meta,
        };
        ddp.reducer_mut().set_step(sync.step);
        Ok((sync.step, meta, sent))
    }

    /// Whether an outer loop runs (local SGD, DiLoCo: the replicas differ between
    /// synchronizations).
    fn local_steps(&self) -> bool {
        matches!(self, Engine::Ddp { outer: Some(_), .. })
    }

    /// The outer loop at the end of the run: a last synchronization, so that every replica holds the
    /// same model (a collective).
    fn finish_outer(&mut self) -> Result<()> {
        if let Engine::Ddp {
            ddp,
            outer: Some(d),
            ..
        } = self
        {
            d.finish(ddp.process_group(), ddp.params())?;
        }
        Ok(())
    }

    /// Payload bytes this rank has sent: gradient buckets, averaged parameters, DiLoCo's
    /// pseudo-gradients.
    fn comm_bytes(&self) -> u64 {
        match self {
            Engine::Ddp { ddp, outer, .. } => {
                ddp.reducer().bytes_sent() + outer.as_ref().map_or(0, |d| d.bytes_sent())
            }
            Engine::Zero { zero, .. } => zero.ddp().reducer().bytes_sent(),
            Engine::Fsdp { .. } => 0,
        }
    }

    /// Whether the replicas are bit-identical (a collective).
    fn replicas_identical(&self) -> Result<bool> {
        Ok(match self {
            Engine::Ddp { ddp, .. } => ddp.verify_replicas()?.identical,
            Engine::Zero { zero, .. } => zero.ddp().verify_replicas()?.identical,
            Engine::Fsdp { fsdp, .. } => fsdp.verify_replicas()?.identical,
        })
    }

    /// `(sum, l2)` of every parameter (a collective at stage 3).
    fn param_sum_l2(&self) -> Result<(f64, f64)> {
        Ok(match self {
            Engine::Ddp { ddp, .. } => ddp.param_sum_l2()?,
            Engine::Zero { zero, .. } => zero.ddp().param_sum_l2()?,
            Engine::Fsdp { fsdp, .. } => {
                let full = fsdp.full_params()?;
                let vars = full
                    .iter()
                    .map(|(_, t)| Var::from_tensor(t))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                ddprs::candle::tensors::param_sum_l2(&vars.iter().collect::<Vec<_>>())?
            }
        })
    }
}

/// What a resume loaded besides the metadata.
enum Loaded {
    /// A plain checkpoint (its comm hook state is restored too).
    Plain(Box<ddprs::Checkpoint>),
    /// A save set (or a plain checkpoint imported into one).
    Set,
}

pub(crate) fn zero_stage(zero: u8) -> ZeroStage {
    match zero {
        0 => ZeroStage::Ddp,
        1 => ZeroStage::One,
        2 => ZeroStage::Two,
        _ => ZeroStage::Three,
    }
}

/// The error of a `--zero 0` resume from a directory that holds a ZeRO save set only.
pub(crate) fn sharded_set_at_zero0(dir: &Path) -> String {
    format!(
        "{} holds a ZeRO save set (written with --zero 1, 2 or 3) and no plain checkpoint: \
         resume it with --zero 1, 2 or 3 (at any world size)",
        dir.display()
    )
}

/// Mean loss over the fixed validation windows (no dropout).
fn evaluate(engine: &Engine, corpus: &Corpus, args: &Args) -> Result<f64> {
    let starts = data::val_starts(
        &corpus.val,
        args.block_size,
        args.eval_iters * args.batch_size,
    );
    let mut total = 0.0;
    for chunk in starts.chunks(args.batch_size) {
        let (x, y) = data::batch(&corpus.val, chunk, args.block_size);
        let (x, y) = tensors(x, y, chunk.len(), args.block_size)?;
        total += cross_entropy(&engine.logits(&x)?, &y)?.to_scalar::<f32>()? as f64;
    }
    Ok(total / starts.chunks(args.batch_size).len() as f64)
}

/// `--fault-tolerance`: regroup after `cause` (or to take newcomers in when `None`), agree on
/// the state, re-shard the windows by what all ranks consumed; returns the steps completed by
/// the state training goes on from. `position`: this rank's windows at the start of the step
/// that failed (its batch is not consumed: the step is dropped).
#[allow(clippy::too_many_arguments)]
fn regroup(
    engine: &mut Engine,
    group: &mut ProcessGroup,
    windows: &mut Windows,
    position: CheckpointMeta,
    done: u64,
    cause: Option<&ddprs::comm::Error>,
    ropts: &RegroupOptions,
    report: &mut Report,
) -> Result<u64> {
    let t = Instant::now();
    let detected = fault::unix_ms();
    let old_world = group.size();
    let r = engine.regroup(cause, ropts).map_err(|e| match cause {
        Some(c) => format!("could not regroup after the failure ({c}): {e}"),
        None => format!("could not regroup to take newcomers in: {e}"),
    })?;
    *group = r.group.clone();
    let (rank, world) = (group.rank(), group.size());
    let (step, meta, sent) = engine.sync_state(Some(done), position)?;
    windows.reshard(world, rank, &meta)?;
    report.set_group(rank, world);
    if rank == 0 {
        let why = match cause {
            Some(e) => format!("after: {e}"),
            None => format!("to take in {} newcomer(s)", r.joined),
        };
        eprintln!(
            "train-gpt: regrouped (generation {}) {why}: world {old_world} -> {world}, lost \
             {:?}; going on from step {step} ({:.2} s)",
            r.generation,
            r.lost,
            t.elapsed().as_secs_f64()
        );
    }
    report.regroups.push(RegroupRecord {
        generation: r.generation,
        cause: if cause.is_some() { "lost" } else { "joined" },
        step,
        world_size: world,
        lost: r.lost,
        joined: r.joined,
        state_sent: sent,
        regroup_s: t.elapsed().as_secs_f64(),
        detected_unix_ms: detected,
        first_step_unix_ms: None,
    });
    Ok(step)
}

/// Trains on `group` (replaced by the regrouped one under `--fault-tolerance`); `newcomer`: this
/// process joined a running job (`--join`) and takes its state from the live ranks.
pub fn run(args: &Args, group: &mut ProcessGroup, newcomer: bool) -> Result<Report> {
    let pg = group.clone();
    let (rank, world) = (pg.rank(), pg.size());
    let corpus = Corpus::load();
    let mut cfg = args.model(corpus.vocab_size());
    if args.zero == 3 && cfg.tied {
        // A ZeRO-3 unit owns its parameters: the head cannot be the embedding's weight.
        cfg.tied = false;
        if rank == 0 {
            eprintln!("train-gpt: --zero 3 unties the head (a parameter belongs to one unit)");
        }
    }
    let varmap = VarMap::new();
    let model = Gpt::new(&cfg, &varmap, &Device::Cpu, args.seed)?;
    let tied = model.tied();
    let mut engine = Engine::new(args, &pg, model, &varmap, !newcomer)?;
    drop(varmap);
    let count = data::windows(&corpus.train, args.block_size);
    let mut windows = Windows::new(count, world, rank, args.seed)?;
    let mut start = 0u64;
    if args.resume {
        let dir = args.checkpoint_dir.as_ref().unwrap();
        if let Some((meta, loaded)) = engine.load(dir, world)? {
            let ck = match &loaded {
                Loaded::Plain(ck) => Some(&**ck),
                Loaded::Set => None,
            };
            let w = &mut windows;
            start = match &mut engine {
                Engine::Ddp { ddp, .. } => data::restore(&mut ***ddp, &meta, ck, w, dir)?,
                Engine::Zero { zero, .. } => data::restore(zero.ddp_mut(), &meta, ck, w, dir)?,
                Engine::Fsdp { .. } => data::restore_windows(rank, world, &meta, w, dir)?,
            };
        }
    }
    let end = args
        .stop_after
        .map_or(args.max_iters, |s| s.min(args.max_iters));
    let mut report = Report::new(args, rank, world, tied);
    let mut saver = Saver::new(args);
    let t0 = Instant::now();
    let mut train_time = 0.0;
    let mut steps = 0u64;
    let ft = args.fault_tolerant();
    let ropts = RegroupOptions::from_env()?;
    let beacon = fault::Beacon::from_env(rank);
    let mut it = start;
    report.start_step = start;
    if newcomer {
        let t = Instant::now();
        let detected = fault::unix_ms();
        let own = windows.meta_global(0, args.seed, serde_json::json!({}));
        let (step, meta, _) = engine.sync_state(None, own)?;
        windows.reshard(world, rank, &meta)?;
        it = step;
        report.start_step = step;
        report.regroups.push(RegroupRecord {
            generation: pg.generation(),
            cause: "joined",
            step,
            world_size: world,
            lost: Vec::new(),
            joined: 1,
            state_sent: true,
            regroup_s: t.elapsed().as_secs_f64(),
            detected_unix_ms: detected,
            first_step_unix_ms: None,
        });
    }
    let mut awaiting_first_step = newcomer;
    while it < end {
        // Where this step starts, for a regrouping (its batch is not consumed if it fails).
        let position = ft.then(|| windows.meta_global(it, args.seed, serde_json::json!({})));
        if let Some(pos) = position.clone() {
            let cause = match group.joiners_waiting() {
                Ok(false) => None,
                Ok(true) => Some(None),
                Err(e) => Some(Some(e)),
            };
            if let Some(cause) = cause {
                let (g, r) = (&mut *group, &mut report);
                it = regroup(
                    &mut engine,
                    g,
                    &mut windows,
                    pos,
                    it,
                    cause.as_ref(),
                    &ropts,
                    r,
                )?;
                awaiting_first_step = true;
                continue;
            }
        }
        let step_start = Instant::now();
        let (x, y) = data::batch(
            &corpus.train,
            &windows.next_batch(args.batch_size),
            args.block_size,
        );
        let (x, y) = tensors(x, y, args.batch_size, args.block_size)?;
        let seed = dropout_seed(args.seed, group.rank(), it);
        let train_loss = match engine.step(args, &x, &y, args.lr_at(it), seed) {
            Ok(loss) => loss,
            Err(e) => {
                // Under --fault-tolerance a failed collective drops this step and regroups;
                // anything else (or without the flag) ends the run.
                let (Some(pos), Some(cause)) = (position, fault::comm_error(&*e)) else {
                    return Err(format!("step {} failed: {e}", it + 1).into());
                };
                report.failed_steps += 1;
                let (g, r) = (&mut *group, &mut report);
                it = regroup(
                    &mut engine,
                    g,
                    &mut windows,
                    pos,
                    it,
                    Some(&cause),
                    &ropts,
                    r,
                )?;
                awaiting_first_step = true;
                continue;
            }
        };
        train_time += step_start.elapsed().as_secs_f64();
        steps += 1;
        if report.first_step_unix_ms.is_none() {
            report.first_step_unix_ms = Some(fault::unix_ms());
        }
        if std::mem::take(&mut awaiting_first_step) {
            if let Some(last) = report.regroups.last_mut() {
                last.first_step_unix_ms = Some(fault::unix_ms());
            }
        }
        if args.check_replicas && !engine.local_steps() && !engine.replicas_identical()? {
            return Err(format!("replicas differ after step {}", it + 1).into());
        }
        let done = it + 1;
        it = done;
        beacon.step(done);
        if done == args.max_iters {
            // An outer loop ends synchronized: the last evaluation and checkpoint see one model.
            engine.finish_outer()?;
        }
        let rank = group.rank();
        report.comm_bytes = engine.comm_bytes();
        if args.eval_due(done, end) {
            let val = match rank == 0 || engine.collective_eval() {
                true => Some(evaluate(&engine, &corpus, args)?),
                false => None,
            };
            report.eval_at(
                done,
                train_loss,
                val.filter(|_| rank == 0),
                t0,
                steps,
                train_time,
            );
        }
        if let Some(dir) = args
            .checkpoint_dir
            .as_ref()
            .filter(|_| args.save_due(done, end))
        {
            let extra = serde_json::json!({"framework": "candle", "n_layer": args.n_layer});
            engine.save(&mut saver, dir, windows.meta(done, args.seed, extra))?;
        }
    }
    let identical = engine.replicas_identical()?;
    let (sum, l2) = engine.param_sum_l2()?;
    saver.finish(group)?;
    report.finish(group, end, sum, l2, identical, train_time, steps)?;
    report.checkpoint_stall(saver.stall_ms());
    let rank = group.rank();
    if args.sample > 0 && (rank == 0 || engine.collective_eval()) {
        let prompt = corpus.encode("\n");
        let logits = |x: &Tensor| engine.logits(x);
        let text = gpt_candle::generate(logits, cfg.block_size, &prompt, args.sample, args.seed)?;
        report.sample = (rank == 0).then(|| corpus.decode(&text));
    }
    Ok(report)
}
