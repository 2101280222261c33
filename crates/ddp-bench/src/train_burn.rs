//! Training throughput with Burn (`ddp-bench train --framework burn`): the same MLP
//! `784 - H×L - 10` (Burn's `Linear`, weight `[in, out]`), batch, synthetic data and SGD as
//! [`crate::train`], on Burn's pure-Rust CPU backend (`burn-flex`, one rayon thread per rank by
//! default), data-parallel with `ddp_burn::Ddp` (plain backward, then the bucketed all-reduce),
//! with `--hook` as for candle (post-local SGD averages through `Ddp::average_parameters`).
//! `--optimizer sgd|adamw` picks Burn's `SgdConfig` (lr 0.01) or `AdamWConfig` (lr 1e-3, Burn's
//! defaults); `--zero 1|2` shards optimizer state (and gradients) with `ddp_burn::ZeroDdp`;
//! `--blockwise` runs the backward one layer at a time (`forward_backward_blockwise`).

use crate::train::{hook_bytes, measure, report, Error, StepCost};
use crate::TrainArgs;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamWConfig, ModuleOptimizer, Optimizer, SgdConfig};
use burn::tensor::{activation, Device, Distribution, Int, Tensor, TensorData};
use ddp_burn::{Ddp, DdpOptions, ZeroDdp};
use ddp_comm::{init_process_group, InitOptions};
use ddp_core::hooks::DiLoCo;
use ddp_core::sharding::ZeroStage;

#[derive(Module, Debug)]
struct Mlp {
    hidden: Vec<Linear>,
    out: Linear,
}

impl Mlp {
    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = self
            .hidden
            .iter()
            .fold(x, |h, l| activation::relu(l.forward(h)));
        self.out.forward(h)
    }
}

/// Run the Burn benchmark as one worker; rank 0 prints.
pub fn run(args: &TrainArgs) -> Result<(), Error> {
    let pg = init_process_group(InitOptions::default())?;
    let rank = pg.rank();
    if args.device != ddp_candle::device::DeviceKind::Cpu {
        return Err(
            "--framework burn runs on burn-flex (CPU): --device is candle's for now".into(),
        );
    }
    let stage = ZeroStage::from_level(args.zero)?;
    if stage == ZeroStage::Three {
        return Err("--zero 3 is candle's (ddp_candle::Fsdp); Burn has stages 0-2".into());
    }
    let dev = Device::flex().autodiff();
    let mut width = 784;
    let mut hidden = Vec::new();
    for _ in 0..args.layers {
        hidden.push(LinearConfig::new(width, args.hidden).init(&dev));
        width = args.hidden;
    }
    let model = Mlp {
        hidden,
        out: LinearConfig::new(width, 10).init(&dev),
    };
    let opts = DdpOptions {
        bucket_cap_mb: args.bucket_cap_mb,
        ..Default::default()
    };
    let mut ddp = Ddp::new(model, &pg, opts)?;
    let loss_fn = CrossEntropyLossConfig::new().init(&dev);
    // Synthetic data, different on every rank.
    let x = Tensor::<2>::random([args.batch, 784], Distribution::Normal(0.0, 1.0), &dev)
        .add_scalar(rank as f64 * 0.01);
    let labels: Vec<i64> = (0..args.batch).map(|i| ((i + rank) % 10) as i64).collect();
    let y = Tensor::<1, Int>::from_data(TensorData::new(labels, [args.batch]), &dev);
    let (lr, adamw) = match args.optimizer.as_str() {
        "adamw" => (1e-3, true),
        _ => (0.01, false),
    };
    if stage != ZeroStage::Ddp {
        if args.hook.hook()?.is_some() || args.hook.averager()?.is_some() {
            return Err(format!(
                "--hook {} cannot be combined with --zero {}: ZeRO reduce-scatters the gradients \
                 itself",
                args.hook, args.zero
            )
            .into());
        }
        let batch = Batch {
            x,
            y,
            loss_fn,
            stages: layer_stages(args.layers),
        };
        return match adamw {
            true => run_zero(args, &pg, ddp, stage, AdamWConfig::new().build(), lr, batch),
            false => run_zero(args, &pg, ddp, stage, SgdConfig::new().build(), lr, batch),
        };
    }
    if let Some(hook) = args.hook.hook()? {
        ddp.register_comm_hook(hook)?;
    }
    let mut averager = args.hook.averager()?;
    // DiLoCo: the outer loop after each step, anchored at the replicas the wrapper made equal.
    let mut outer = match args.hook.diloco() {
        Some(cfg) => Some(ddp.with_params(|_, p| DiLoCo::new(cfg, p))?),
        None => None,
    };
    let stages = layer_stages(args.layers);
    let mut opt: ModuleOptimizer = match adamw {
        true => AdamWConfig::new().init(),
        false => SgdConfig::new().init(),
    };

    let timing = measure(
        args,
        &pg,
        || {
            let before = ddp.reducer().bytes_sent() + hook_bytes(&averager, &outer);
            let grads = if args.blockwise {
                let stages = stages.iter().map(|s| &**s).collect::<Vec<_>>();
                let loss = |o| loss_fn.forward(o, y.clone());
                ddp.forward_backward_blockwise(&stages, x.clone(), loss)?.0
            } else {
                let loss = loss_fn.forward(ddp.module().forward(x.clone()), y.clone());
                ddp.backward(loss)?
            };
            ddp.step(&mut opt, lr, grads);
            if let Some(a) = &mut averager {
                ddp.average_parameters(a)?;
            }
            if let Some(d) = &mut outer {
                ddp.with_params(|pg, p| d.step(pg, p))?;
            }
            Ok(StepCost {
                wait_s: ddp
                    .last_step_stats()
                    .map_or(0.0, |s| s.comm_wait.as_secs_f64()),
                bytes: ddp.reducer().bytes_sent() + hook_bytes(&averager, &outer) - before,
            })
        },
        || Ok(()),
    )?;
    // Local SGD and DiLoCo: replicas differ between synchronizations; synchronize once more
    // before the check (not a timed step: its bytes are not in bytes_per_step).
    if let Some(a) = &mut averager {
        ddp.average_parameters_now(a)?;
    }
    if let Some(d) = &mut outer {
        ddp.with_params(|pg, p| d.finish(pg, p))?;
    }
    let diff = ddp.replica_max_diff()?;
    let extra = serde_json::json!({
        "optimizer": args.optimizer,
        "hook": args.hook.to_string(),
        "zero": 0,
        "params": param_count(&ddp),
        "bytes_per_step": timing.bytes_per_step,
    });
    let label = format!(
        "plain path  burn-flex  hook {}  zero 0  {}",
        args.hook, args.optimizer
    );
    report(args, &pg, &label, &timing, diff, extra)
}

/// The benchmark's fixed batch and loss, and its blocks for `--blockwise`.
struct Batch {
    x: Tensor<2>,
    y: Tensor<1, Int>,
    loss_fn: burn::nn::loss::CrossEntropyLoss,
    stages: Vec<BoxedStage>,
}

type BoxedStage = Box<dyn Fn(&Mlp, Tensor<2>) -> Tensor<2>>;

/// `--blockwise`: one block per layer.
fn layer_stages(layers: usize) -> Vec<BoxedStage> {
    let mut stages: Vec<BoxedStage> = (0..layers)
        .map(|i| Box::new(move |m: &Mlp, h| activation::relu(m.hidden[i].forward(h))) as BoxedStage)
        .collect();
    stages.push(Box::new(|m: &Mlp, h| m.out.forward(h)));
    stages
}

fn param_count(ddp: &Ddp<Mlp>) -> usize {
    ddp.reducer().specs().iter().map(|s| s.numel()).sum()
}

/// `--zero 1|2`: `ddp_burn::ZeroDdp` with Burn's bare optimizer `optim`.
fn run_zero<O: Optimizer>(
    args: &TrainArgs,
    pg: &ddp_comm::ProcessGroup,
    ddp: Ddp<Mlp>,
    stage: ZeroStage,
    optim: O,
    lr: f64,
    b: Batch,
) -> Result<(), Error> {
    let params = param_count(&ddp);
    let mut zero = ZeroDdp::new(ddp, stage, optim)?;
    let timing = measure(
        args,
        pg,
        || {
            let stats = if args.blockwise {
                let stages = b.stages.iter().map(|s| &**s).collect::<Vec<_>>();
                let loss = |o| b.loss_fn.forward(o, b.y.clone());
                zero.forward_backward_blockwise(&stages, b.x.clone(), loss)?
                    .0
            } else {
                let loss = b
                    .loss_fn
                    .forward(zero.module().forward(b.x.clone()), b.y.clone());
                zero.backward(loss)?
            };
            zero.step(lr)?;
            Ok(StepCost {
                wait_s: stats.comm_wait.as_secs_f64(),
                bytes: zero.bytes_per_step(),
            })
        },
        || Ok(()),
    )?;
    let diff = zero.replica_max_diff()?;
    let extra = serde_json::json!({
        "optimizer": args.optimizer,
        "hook": args.hook.to_string(),
        "zero": args.zero,
        "params": params,
        "bytes_per_step": zero.bytes_per_step() as f64,
    });
    let label = format!(
        "plain path  burn-flex  zero {}  {}",
        args.zero, args.optimizer
    );
    report(args, pg, &label, &timing, diff, extra)
}
