//! One worker of `train-gpt --framework candle`: the model of [`crate::gpt_candle`] wrapped in
//! `ddprs::candle::Ddp`, AdamW with decay on 2-D weights only, nanoGPT's schedule and global-norm
//! clipping, checkpoints and exact resume.

use crate::config::Args;
use crate::data::{self, Corpus, Windows};
use crate::gpt_candle::{decays, Dropout, Gpt};
use crate::report::Report;
use candle_core::{Device, Tensor};
use candle_nn::{Optimizer, ParamsAdamW, VarMap};
use ddprs::candle::checkpoint::load_vars;
use ddprs::candle::optim::AdamW;
use ddprs::candle::Ddp;
use ddprs::ProcessGroup;
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

/// Mean loss over the fixed validation windows (no dropout).
fn evaluate(model: &Gpt, corpus: &Corpus, args: &Args) -> Result<f64> {
    let starts = data::val_starts(
        &corpus.val,
        args.block_size,
        args.eval_iters * args.batch_size,
    );
    let mut total = 0.0;
    let mut drop = Dropout::new(0.0, 0);
    for chunk in starts.chunks(args.batch_size) {
        let (x, y) = data::batch(&corpus.val, chunk, args.block_size);
        let (x, y) = tensors(x, y, chunk.len(), args.block_size)?;
        total += model.loss(&x, &y, &mut drop, false)?.to_scalar::<f32>()? as f64;
    }
    Ok(total / starts.chunks(args.batch_size).len() as f64)
}

pub fn run(args: &Args, pg: &ProcessGroup) -> Result<Report> {
    let (rank, world) = (pg.rank(), pg.size());
    let corpus = Corpus::load();
    let cfg = args.model(corpus.vocab_size());
    let varmap = VarMap::new();
    let model = Gpt::new(&cfg, &varmap, &Device::Cpu, args.seed)?;
    let mut ddp = Ddp::new(&varmap, pg, Default::default())?;
    if let Some(hook) = args.hook.hook()? {
        ddp.register_comm_hook(hook)?;
    }
    let params = ParamsAdamW {
        lr: args.lr,
        beta1: 0.9,
        beta2: args.beta2,
        eps: 1e-8,
        weight_decay: args.weight_decay,
    };
    let mut opt = AdamW::new_named_with_decay(ddp.named_vars().to_vec(), params, decays)?;
    let count = data::windows(&corpus.train, args.block_size);
    let mut windows = Windows::new(count, world, rank, args.seed)?;
    let mut start = 0u64;
    if args.resume {
        let dir = args.checkpoint_dir.as_ref().unwrap();
        if let Some(ck) = ddprs::checkpoint::load(dir)? {
            ck.meta.check_world_size(world)?;
            load_vars(&ck, ddp.named_vars())?;
            ck.load_optimizer(&mut opt)?;
            start = data::restore(&mut *ddp, &ck, &mut windows, dir)?;
        }
    }
    let end = args
        .stop_after
        .map_or(args.max_iters, |s| s.min(args.max_iters));
    let mut report = Report::new(args, rank, world, model.tied());
    let t0 = Instant::now();
    let mut train_time = 0.0;
    let mut steps = 0u64;
    for it in start..end {
        let step_start = Instant::now();
        opt.set_learning_rate(args.lr_at(it));
        let (x, y) = data::batch(
            &corpus.train,
            &windows.next_batch(args.batch_size),
            args.block_size,
        );
        let (x, y) = tensors(x, y, args.batch_size, args.block_size)?;
        let mut drop = Dropout::new(args.dropout, dropout_seed(args.seed, rank, it));
        let loss = model.loss(&x, &y, &mut drop, true)?;
        let mut grads = ddp.backward(&loss)?;
        if args.grad_clip > 0.0 {
            ddp.clip_grad_norm(&mut grads, args.grad_clip)?;
        }
        opt.step(&grads)?;
        train_time += step_start.elapsed().as_secs_f64();
        steps += 1;
        if args.check_replicas && !ddp.verify_replicas()?.identical {
            return Err(format!("replicas differ after step {}", it + 1).into());
        }
        let done = it + 1;
        let train_loss = loss.to_scalar::<f32>()? as f64;
        if args.eval_due(done, end) {
            let val = if rank == 0 {
                Some(evaluate(&model, &corpus, args)?)
            } else {
                None
            };
            report.eval_at(done, train_loss, val, t0, steps, train_time);
        }
        if let Some(dir) = args
            .checkpoint_dir
            .as_ref()
            .filter(|_| args.save_due(done, end))
        {
            let extra = serde_json::json!({"framework": "candle", "n_layer": args.n_layer});
            let meta = windows.meta(done, world, args.seed, extra);
            ddp.save_checkpoint_with(dir, Some(&opt), meta)?;
        }
    }
    let replicas = ddp.verify_replicas()?;
    let (sum, l2) = ddp.param_sum_l2()?;
    report.finish(pg, end, sum, l2, replicas.identical, train_time, steps)?;
    if args.sample > 0 && rank == 0 {
        let prompt = corpus.encode("\n");
        let text = model.generate(&prompt, args.sample, args.seed)?;
        report.sample = Some(corpus.decode(&text));
    }
    Ok(report)
}
