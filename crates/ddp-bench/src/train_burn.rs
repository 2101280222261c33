//! Training throughput with Burn (`ddp-bench train --framework burn`): the same MLP
//! `784 - H×L - 10` (Burn's `Linear`, weight `[in, out]`), batch, synthetic data and SGD as
//! [`crate::train`], on Burn's pure-Rust CPU backend (`burn-flex`, one rayon thread per rank by
//! default), data-parallel with `ddp_burn::Ddp` (plain backward, then the bucketed all-reduce).

use crate::train::{measure, report, Error, StepCost};
use crate::TrainArgs;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::{activation, Device, Distribution, Int, Tensor, TensorData};
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
    if args.device != ddp_candle::device::DeviceKind::Cpu
        || args.zero != 0
        || args.hook != ddp::hooks::HookSpec::None
    {
        return Err("--framework burn runs plain DDP on burn-flex (CPU): --device, --zero and --hook are candle's for now".into());
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
            let before = ddp.reducer().bytes_sent();
            let loss = loss_fn.forward(ddp.module().forward(x.clone()), y.clone());
            let grads = ddp.backward(loss)?;
            ddp.step(&mut opt, 0.01, grads);
            Ok(StepCost {
                wait_s: ddp
                    .last_step_stats()
                    .map_or(0.0, |s| s.comm_wait.as_secs_f64()),
                bytes: ddp.reducer().bytes_sent() - before,
            })
        },
        || Ok(()),
    )?;
    let diff = ddp.replica_max_diff()?;
    let extra = serde_json::json!({ "optimizer": "sgd" });
    report(args, &pg, "plain path  burn-flex", &timing, diff, extra)
}
