//! One worker of `train-gpt --framework burn`: the model of [`crate::gpt_burn`] wrapped in
//! `ddprs::burn::Ddp` on Burn's pure-Rust CPU backend, Burn's AdamW with weight decay on 2-D
//! weights only (a second parameter group without decay for LayerNorms and biases), nanoGPT's
//! schedule, global-norm clipping across the whole model, checkpoints (Burn's records) and exact
//! resume.

use crate::config::Args;
use crate::data::{self, Corpus, Windows};
use crate::gpt_burn::Gpt;
use crate::report::Report;
use burn::module::ParamGroup;
use burn::optim::{AdamWConfig, ModuleOptimizer};
use burn::tensor::{Device, Int, Tensor, TensorData};
use ddprs::burn::Ddp;
use ddprs::ProcessGroup;
use std::time::Instant;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

fn ids(v: Vec<u32>, rows: usize, cols: usize, device: &Device) -> Tensor<2, Int> {
    let v: Vec<i64> = v.into_iter().map(i64::from).collect();
    Tensor::from_data(TensorData::new(v, [rows, cols]), device)
}

/// nanoGPT's optimizer: AdamW (betas 0.9 and --beta2), decay on 2-D weights only.
fn optimizer(args: &Args) -> Result<ModuleOptimizer> {
    let adamw = |wd: f64| {
        AdamWConfig::new()
            .with_beta_2(args.beta2 as f32)
            .with_weight_decay(wd as f32)
            .with_epsilon(1e-8)
    };
    let no_decay = ParamGroup::from_any_predicates(vec!["ln_", ".bias"]);
    Ok(adamw(args.weight_decay)
        .init()
        .with_group(no_decay, adamw(0.0).build(), None))
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

pub fn run(args: &Args, pg: &ProcessGroup) -> Result<Report> {
    let (rank, world) = (pg.rank(), pg.size());
    let corpus = Corpus::load();
    let cfg = args.model(corpus.vocab_size());
    let device = Device::flex().autodiff();
    let model = Gpt::new(&cfg, args.dropout as f64, args.seed, &device);
    let tied = model.tied();
    let mut ddp = Ddp::new(model, pg, Default::default())?;
    if let Some(hook) = args.hook.hook()? {
        ddp.register_comm_hook(hook)?;
    }
    let mut optim = optimizer(args)?;
    let count = data::windows(&corpus.train, args.block_size);
    let mut windows = Windows::new(count, world, rank, args.seed)?;
    let mut start = 0u64;
    if args.resume {
        let dir = args.checkpoint_dir.as_ref().unwrap();
        if let Some(ck) = ddprs::checkpoint::load(dir)? {
            ck.meta.check_world_size(world)?;
            optim = ddp.load_records(&ck, optim)?;
            start = data::restore(&mut *ddp, &ck, &mut windows, dir)?;
        }
    }
    let end = args
        .stop_after
        .map_or(args.max_iters, |s| s.min(args.max_iters));
    let mut report = Report::new(args, rank, world, tied);
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
        let loss = ddp.module().loss(
            ids(x, args.batch_size, args.block_size, &device),
            ids(y, args.batch_size, args.block_size, &device),
        );
        let train_loss = loss.clone().into_scalar::<f64>();
        let mut grads = ddp.backward(loss)?;
        if args.grad_clip > 0.0 {
            ddp.clip_grad_norm(&mut grads, args.grad_clip)?;
        }
        ddp.step(&mut optim, args.lr_at(it), grads);
        train_time += step_start.elapsed().as_secs_f64();
        steps += 1;
        if args.check_replicas && !ddp.verify_replicas()?.identical {
            return Err(format!("replicas differ after step {}", it + 1).into());
        }
        let done = it + 1;
        if args.eval_due(done, end) {
            let val = (rank == 0).then(|| evaluate(ddp.module(), &corpus, args, &device));
            report.eval_at(done, train_loss, val, t0, steps, train_time);
        }
        if let Some(dir) = args
            .checkpoint_dir
            .as_ref()
            .filter(|_| args.save_due(done, end))
        {
            let extra = serde_json::json!({"framework": "burn", "n_layer": args.n_layer});
            let meta = windows.meta(done, world, args.seed, extra);
            ddp.save_checkpoint_with(dir, Some(&optim), meta)?;
        }
    }
    let replicas = ddp.verify_replicas()?;
    let (sum, l2) = ddp.param_sum_l2()?;
    report.finish(pg, end, sum, l2, replicas.identical, train_time, steps)?;
    if args.sample > 0 && rank == 0 {
        let text = ddp
            .module()
            .generate(&corpus.encode("\n"), args.sample, args.seed, &device);
        report.sample = Some(corpus.decode(&text));
    }
    Ok(report)
}
