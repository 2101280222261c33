//! One worker of `train-gpt --framework burn`: the model of [`crate::gpt_burn`] on Burn's
//! pure-Rust CPU backend under `ddprs::burn::Ddp` (`--zero 0`) or `ZeroDdp` (stages 1 and 2;
//! Burn has no stage 3 here: refused), Burn's AdamW with weight decay on 2-D weights only (a
//! second parameter group without decay for LayerNorms and biases; under ZeRO the same groups
//! applied per chunk), nanoGPT's schedule, global-norm clipping across the whole model (and the
//! shards), checkpoints (Burn's records; save sets under ZeRO) and exact resume; post-local SGD,
//! DiLoCo and streaming DiLoCo at `--zero 0` (`--hook localsgd…`, `diloco…`: the outer step after
//! each inner step through `Ddp::with_params`, each rank's inner state in the checkpoints, see
//! [`crate::outer`]).

use crate::config::Args;
use crate::data::{self, Corpus, Windows};
use crate::gpt_burn::Gpt;
use crate::outer;
use crate::report::Report;
use crate::saver::Saver;
use crate::train_candle::{sharded_set_at_zero0, zero_stage};
use burn::module::ParamGroup;
use burn::optim::{AdamW, AdamWConfig, ModuleOptimizer};
use burn::tensor::{Device, Int, Tensor, TensorData};
use ddp_example_support::outer::Outer;
use ddprs::burn::{Ddp, ZeroDdp};
use ddprs::sharding::ZeroStage;
use ddprs::{CheckpointMeta, ProcessGroup};
use std::path::Path;
use std::time::Instant;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn ids(v: Vec<u32>, rows: usize, cols: usize, device: &Device) -> Tensor<2, Int> {
    let v: Vec<i64> = v.into_iter().map(i64::from).collect();
    Tensor::from_data(TensorData::new(v, [rows, cols]), device)
}

/// Burn's AdamW with nanoGPT's betas (0.9 and `--beta2`), epsilon 1e-8 and weight decay `wd`.
fn adamw_config(args: &Args, wd: f64) -> AdamWConfig {
    AdamWConfig::new()
        .with_beta_2(args.beta2 as f32)
        .with_weight_decay(wd as f32)
        .with_epsilon(1e-8)
}

/// nanoGPT's optimizer for plain DDP: AdamW with decay on 2-D weights only (a second parameter
/// group without decay for LayerNorms and biases).
fn nanogpt_optimizer(args: &Args) -> ModuleOptimizer {
    let no_decay = ParamGroup::from_any_predicates(vec!["ln_", ".bias"]);
    adamw_config(args, args.weight_decay).init().with_group(
        no_decay,
        adamw_config(args, 0.0).build(),
        None,
    )
}

fn evaluate(model: &Gpt, corpus: &Corpus, args: &Args, device: &Device) -> f64 {
    let starts = data::val_starts(
        &corpus.val,
        args.block_size,
        args.eval_iters * args.batch_size,
    );
    let mut total = 0.0;
    for chunk in starts.chunks(args.batch_size) {
        let (x, y) = data::batch(&corpus.val, chunk, args.block_size);
        let loss = model.loss(
            ids(x, chunk.len(), args.block_size, device),
            ids(y, chunk.len(), args.block_size, device),
        );
        total += loss.into_scalar::<f64>();
    }
    total / starts.chunks(args.batch_size).len() as f64
}

/// The module and what trains it: DDP with Burn's `ModuleOptimizer` (`--zero 0`, the decay
/// groups as parameter groups) or ZeRO stages 1 and 2 (`ZeroDdp`, the groups applied to each
/// chunk by `with_weight_decay_groups`). Burn has no ZeRO-3 here (`ZeroDdp` refuses stage 3).
enum Engine {
    Ddp {
        ddp: Box<Ddp<Gpt>>,
        optim: ModuleOptimizer,
        /// `--hook localsgd` / `diloco` / `streaming-diloco`: the outer loop after each inner
        /// step.
        outer: Option<Box<Outer>>,
    },
    Zero(Box<ZeroDdp<Gpt, AdamW>>),
}

impl Engine {
    fn module(&self) -> &Gpt {
        match self {
            Engine::Ddp { ddp, .. } => ddp.module(),
            Engine::Zero(z) => z.module(),
        }
    }

    fn save(&mut self, saver: &mut Saver, dir: &Path, meta: CheckpointMeta) -> Result<()> {
        match self {
            Engine::Zero(z) => saver.save_set(|sets| match sets {
                Some(s) => Ok(z.save_async(s, dir, &meta)?),
                None => z.save(dir, &meta).map(|_| None).map_err(Into::into),
            }),
            Engine::Ddp {
                ddp,
                optim,
                outer: Some(d),
            } => {
                // Every rank's own module and optimizer records, and the outer state.
                let (ddp, optim) = (&**ddp, &*optim);
                outer::save(saver, ddp, d, dir, meta, |ck| {
                    ddp.save_records(ck, optim)
                        .map_err(|e| ddprs::Error::Checkpoint(e.to_string()))
                })
            }
            Engine::Ddp {
                ddp,
                optim,
                outer: None,
            } => saver.save(meta.step, |background| {
                Ok(match background {
                    Some(b) => ddp.save_checkpoint_async(b, dir, Some(optim), meta)?,
                    None => {
                        ddp.save_checkpoint_with(dir, Some(optim), meta)?;
                        None
                    }
                })
            }),
        }
    }

    /// See `train_candle`'s `Engine::load`: plain at `--zero 0` (any world size without a comm
    /// hook; with an outer loop this rank's own records, or a joining rank's: `outer::restore`), a save
    /// set (any world size) or an imported plain checkpoint at stages 1 and 2.
    fn load(&mut self, dir: &Path, world: usize) -> Result<Option<(CheckpointMeta, Loaded)>> {
        let set = ddprs::sharding::latest_set(dir)?.is_some();
        match self {
            Engine::Ddp { ddp, optim, outer } => {
                let Some(ck) = ddprs::checkpoint::load(dir)? else {
                    return match set {
                        true => Err(sharded_set_at_zero0(dir).into()),
                        false => Ok(None),
                    };
                };
                data::check_plain_world(&ck, world, ddp.reducer())?;
                let restored = match outer.as_deref_mut() {
                    Some(d) => Some(outer::restore(&ck, dir, d, ddp.rank(), world)?),
                    None => None,
                };
                let local = restored.as_ref().map_or(&ck, |r| &r.local);
                let taken = std::mem::replace(optim, AdamWConfig::new().build().into());
                *optim = ddp.load_records(local, taken)?;
                if let (Some(o), Some(r)) = (outer, &restored) {
                    ddp.with_params(|_, p| o.joined(r, p))?;
                }
                Ok(Some((ck.meta.clone(), Loaded::Plain(Box::new(ck)))))
            }
            Engine::Zero(z) if set => Ok(z.load(dir)?.map(|m| (m, Loaded::Set))),
            Engine::Zero(z) => {
                let Some(ck) = ddprs::checkpoint::load(dir)? else {
                    return Ok(None);
                };
                z.import(&ck)?;
                Ok(Some((ck.meta.clone(), Loaded::Set)))
            }
        }
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
            ddp.with_params(|pg, p| d.finish(pg, p))?;
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
            Engine::Zero(z) => z.ddp().reducer().bytes_sent(),
        }
    }
}

enum Loaded {
    Plain(Box<ddprs::Checkpoint>),
    Set,
}

pub fn run(args: &Args, pg: &ProcessGroup) -> Result<Report> {
    let (rank, world) = (pg.rank(), pg.size());
    let corpus = Corpus::load();
    let cfg = args.model(corpus.vocab_size());
    let device = Device::flex().autodiff();
    let model = Gpt::new(&cfg, args.dropout as f64, args.seed, &device);
    let tied = model.tied();
    let mut ddp = Ddp::new(model, pg, Default::default())?;
    let mut engine = match zero_stage(args.zero) {
        ZeroStage::Ddp => {
            if let Some(hook) = args.hook.hook()? {
                ddp.register_comm_hook(hook)?;
            }
            let outer = ddp.with_params(|_, p| Outer::new(&args.hook, p))?;
            let outer = outer.map(Box::new);
            Engine::Ddp {
                ddp: Box::new(ddp),
                optim: nanogpt_optimizer(args),
                outer,
            }
        }
        stage => {
            let wd = args.weight_decay as f32;
            let zero = ZeroDdp::new(ddp, stage, adamw_config(args, 0.0).build())?;
            let zero = zero.with_weight_decay_groups(wd, crate::gpt_candle::decays)?;
            Engine::Zero(Box::new(zero))
        }
    };
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
                Engine::Zero(_) => data::restore_windows(rank, world, &meta, w, dir)?,
            };
        }
    }
    let end = args
        .stop_after
        .map_or(args.max_iters, |s| s.min(args.max_iters));
    let mut report = Report::new(args, rank, world, tied);
    report.start_step = start;
    let mut saver = Saver::new(args);
    let t0 = Instant::now();
    let (mut train_time, mut steps) = (0.0, 0u64);
    for it in start..end {
        let step_start = Instant::now();
        if args.dropout > 0.0 {
            // The dropout stream of this step and rank only (exact resume).
            device.seed(crate::train_candle::dropout_seed(args.seed, rank, it));
        }
        let (x, y) = data::batch(
            &corpus.train,
            &windows.next_batch(args.batch_size),
            args.block_size,
        );
        let loss = engine.module().loss(
            ids(x, args.batch_size, args.block_size, &device),
            ids(y, args.batch_size, args.block_size, &device),
        );
        let train_loss = loss.clone().into_scalar::<f64>();
        let lr = args.lr_at(it);
        match &mut engine {
            Engine::Ddp { ddp, optim, outer } => {
                let mut grads = ddp.backward(loss)?;
                if args.grad_clip > 0.0 {
                    ddp.clip_grad_norm(&mut grads, args.grad_clip)?;
                }
                ddp.step(optim, lr, grads);
                if let Some(d) = outer {
                    ddp.with_params(|pg, p| d.step(pg, p))?;
                }
            }
            Engine::Zero(z) => {
                z.backward(loss)?;
                if args.grad_clip > 0.0 {
                    z.clip_grad_norm(args.grad_clip)?;
                }
                z.step(lr)?;
            }
        }
        train_time += step_start.elapsed().as_secs_f64();
        steps += 1;
        if report.first_step_unix_ms.is_none() {
            report.first_step_unix_ms = Some(crate::fault::unix_ms());
        }
        if args.check_replicas && !engine.local_steps() && !replicas(&engine)? {
            return Err(format!("replicas differ after step {}", it + 1).into());
        }
        let done = it + 1;
        if done == args.max_iters {
            // An outer loop ends synchronized: the last evaluation and checkpoint see one model.
            engine.finish_outer()?;
        }
        report.comm_bytes = engine.comm_bytes();
        if args.eval_due(done, end) {
            let val = (rank == 0).then(|| evaluate(engine.module(), &corpus, args, &device));
            report.eval_at(done, train_loss, val, t0, steps, train_time);
        }
        if let Some(dir) = args
            .checkpoint_dir
            .as_ref()
            .filter(|_| args.save_due(done, end))
        {
            let extra = serde_json::json!({"framework": "burn", "n_layer": args.n_layer});
            engine.save(&mut saver, dir, windows.meta(done, args.seed, extra))?;
        }
    }
    let identical = replicas(&engine)?;
    let (sum, l2) = match &engine {
        Engine::Ddp { ddp, .. } => ddp.param_sum_l2()?,
        Engine::Zero(z) => z.ddp().param_sum_l2()?,
    };
    saver.finish(pg)?;
    report.finish(pg, end, sum, l2, identical, train_time, steps)?;
    report.checkpoint_stall(saver.stall_ms());
    if args.sample > 0 && rank == 0 {
        let text = engine
            .module()
            .generate(&corpus.encode("\n"), args.sample, args.seed, &device);
        report.sample = Some(corpus.decode(&text));
    }
    Ok(report)
}

fn replicas(engine: &Engine) -> Result<bool> {
    Ok(match engine {
        Engine::Ddp { ddp, .. } => ddp.verify_replicas()?.identical,
        Engine::Zero(z) => z.ddp().verify_replicas()?.identical,
    })
}
