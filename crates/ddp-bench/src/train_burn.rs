//! Training throughput with Burn (`ddp-bench train --framework burn`): the same MLP
//! `784 - H×L - 10` (Burn's `Linear`, weight `[in, out]`), batch, synthetic data and SGD as
//! [`crate::train`], on Burn's pure-Rust CPU backend (`burn-flex`, one rayon thread per rank by
//! default), data-parallel with `ddp_burn::Ddp` (plain backward, then the bucketed all-reduce),
//! with `--hook` as for candle (post-local SGD averages through `Ddp::average_parameters`).

use crate::train::{measure, report, Error, StepCost};
use crate::TrainArgs;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::{activation, Device, Distribution, Int, Tensor, TensorData};
use ddp::hooks::PeriodicModelAverager;
use ddp_burn::{Ddp, DdpOptions};
use ddp_comm::{init_process_group, InitOptions};

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
    if args.device != ddp_candle::device::DeviceKind::Cpu || args.zero != 0 {
        return Err("--framework burn runs DDP on burn-flex (CPU): --device and --zero are candle's for now".into());
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
    if let Some(hook) = args.hook.hook()? {
        ddp.register_comm_hook(hook)?;
    }
    let mut averager = args.hook.averager()?;
    let mut opt = SgdConfig::new().init();
    let loss_fn = CrossEntropyLossConfig::new().init(&dev);

    // Synthetic data, different on every rank.
    let x = Tensor::<2>::random([args.batch, 784], Distribution::Normal(0.0, 1.0), &dev)
        .add_scalar(rank as f64 * 0.01);
    let labels: Vec<i64> = (0..args.batch).map(|i| ((i + rank) % 10) as i64).collect();
    let y = Tensor::<1, Int>::from_data(TensorData::new(labels, [args.batch]), &dev);

    let timing = measure(
        args,
        &pg,
        || {
            let sent = |a: &Option<PeriodicModelAverager>| a.as_ref().map_or(0, |a| a.bytes_sent());
            let before = ddp.reducer().bytes_sent() + sent(&averager);
            let loss = loss_fn.forward(ddp.module().forward(x.clone()), y.clone());
            let grads = ddp.backward(loss)?;
            ddp.step(&mut opt, 0.01, grads);
            if let Some(a) = &mut averager {
                ddp.average_parameters(a)?;
            }
            Ok(StepCost {
                wait_s: ddp
                    .last_step_stats()
                    .map_or(0.0, |s| s.comm_wait.as_secs_f64()),
                bytes: ddp.reducer().bytes_sent() + sent(&averager) - before,
            })
        },
        || Ok(()),
    )?;
    // Local SGD: replicas differ between averagings; average once more before the check.
    if let Some(a) = &mut averager {
        ddp.average_parameters_now(a)?;
    }
    let diff = ddp.replica_max_diff()?;
    let extra = serde_json::json!({ "optimizer": "sgd", "hook": args.hook.to_string() });
    let label = format!("plain path  burn-flex  hook {}", args.hook);
    report(args, &pg, &label, &timing, diff, extra)
}
