//! Training throughput: an MLP `784 - H×L - 10` on synthetic data, one thread per rank, with
//! DDP (plain backward by default; `--staged` communicates buckets while earlier layers compute).
//!
//! [`measure`] and [`check_replicas`] are shared with the Burn side ([`crate::train_burn`],
//! `--framework burn`).
//!
//! Reports global samples/s (world × batch × steps ÷ the slowest rank's time), ms/step and the
//! mean time per step that backward spent blocked on communication.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::{linear, Linear, Optimizer, VarBuilder, VarMap};
use ddp_candle::optim::{ParamsSgd, Sgd};
use ddp_candle::{Ddp, DdpOptions};
use ddp_comm::{init_process_group, InitOptions, ReduceOp};
use std::time::Instant;

use crate::TrainArgs;

/// A linear layer in either weight layout (`--weight-layout`).
enum Dense {
    /// `candle_nn::Linear`: weight `[out, in]`, `x @ W^T + b`.
    OutIn(Linear),
    /// Weight `[in, out]`, `x @ W + b`.
    InOut { w: Tensor, b: Tensor },
}

impl Dense {
    fn new(layout: &str, i: usize, o: usize, vb: VarBuilder) -> candle_core::Result<Dense> {
        if layout == "out-in" {
            return Ok(Dense::OutIn(linear(i, o, vb)?));
        }
        // candle_nn::linear's initialisation, transposed.
        let bound = 1. / (i as f64).sqrt();
        let init = candle_nn::Init::Uniform {
            lo: -bound,
            up: bound,
        };
        Ok(Dense::InOut {
            w: vb.get_with_hints((i, o), "weight", init)?,
            b: vb.get_with_hints(o, "bias", init)?,
        })
    }
}

/// One hidden layer: linear + ReLU.
struct Block {
    lin: Dense,
    relu: bool,
}

impl Module for Block {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = match &self.lin {
            Dense::OutIn(l) => l.forward(x)?,
            Dense::InOut { w, b } => x.matmul(w)?.broadcast_add(b)?,
        };
        if self.relu {
            y.relu()
        } else {
            Ok(y)
        }
    }
}

pub(crate) type Error = Box<dyn std::error::Error>;

/// Run the benchmark as one worker; rank 0 prints.
pub fn run(args: &TrainArgs) -> Result<(), Error> {
    if !args.no_retain_memory {
        ddp_candle::alloc::retain_freed_memory();
    }
    let pg = init_process_group(InitOptions::default())?;
    let rank = pg.rank();
    let dev = Device::Cpu;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
    let mut blocks = Vec::new();
    let mut width = 784;
    for l in 0..args.layers {
        blocks.push(Block {
            lin: Dense::new(
                &args.weight_layout,
                width,
                args.hidden,
                vb.pp(format!("l{l:02}")),
            )?,
            relu: true,
        });
        width = args.hidden;
    }
    blocks.push(Block {
        lin: Dense::new(&args.weight_layout, width, 10, vb.pp("out"))?,
        relu: false,
    });
    let opts = DdpOptions {
        bucket_cap_mb: args.bucket_cap_mb,
        ..Default::default()
    };
    let mut ddp = Ddp::new(&varmap, &pg, opts)?;
    let mut opt = Sgd::new(ddp.all_vars(), ParamsSgd::with_lr(0.01))?;
    let stages: Vec<&dyn Module> = blocks.iter().map(|b| b as &dyn Module).collect();

    // Synthetic data, different on every rank.
    let x = Tensor::randn(0f32, 1.0, (args.batch, 784), &dev)?.affine(1.0, rank as f64 * 0.01)?;
    let labels: Vec<u32> = (0..args.batch).map(|i| ((i + rank) % 10) as u32).collect();
    let y = Tensor::from_vec(labels, args.batch, &dev)?;

    let step = |ddp: &mut Ddp, opt: &mut Sgd| -> Result<f64, Error> {
        let out = if !args.staged {
            let logits = stages.iter().try_fold(x.clone(), |h, s| s.forward(&h))?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            let grads = ddp.backward(&loss)?;
            opt.step(&grads)?;
            loss
        } else {
            let o = ddp.forward_backward_staged(&stages, &x, |logits| {
                candle_nn::loss::cross_entropy(logits, &y)
            })?;
            opt.step(&o.grads)?;
            o.loss
        };
        let wait = ddp
            .last_step_stats()
            .map_or(0.0, |s| s.comm_wait.as_secs_f64());
        drop(out);
        Ok(wait)
    };
    let path = if args.staged { "staged" } else { "plain" };
    let label = format!("{path} path  weights {}", args.weight_layout);
    measure(args, &pg, &label, || step(&mut ddp, &mut opt))?;
    check_replicas(rank, ddp.replica_max_diff()?)
}

/// Times `args.steps` calls of `step` (returning its communication wait in seconds) after
/// `args.warmup` untimed ones, and prints rank 0's line (and JSON): shared by every framework.
pub(crate) fn measure(
    args: &TrainArgs,
    pg: &ddp_comm::ProcessGroup,
    label: &str,
    mut step: impl FnMut() -> Result<f64, Error>,
) -> Result<(), Error> {
    let (rank, world) = (pg.rank(), pg.size());
    for _ in 0..args.warmup {
        step()?;
    }
    pg.barrier()?;
    let t = Instant::now();
    let mut wait = 0.0;
    for _ in 0..args.steps {
        wait += step()?;
    }
    let mut times = [t.elapsed().as_secs_f64(), wait];
    pg.all_reduce(&mut times, ReduceOp::Max)?;
    let (elapsed, wait) = (times[0], times[1]);
    let samples_per_s = (world * args.batch * args.steps) as f64 / elapsed;
    let step_ms = elapsed / args.steps as f64 * 1e3;
    let comm_wait_ms = wait / args.steps as f64 * 1e3;
    if rank == 0 {
        println!(
            "# ddp-bench train  world_size {world}  MLP 784-{}x{}-10  batch {} per rank  {}  {label}",
            args.hidden, args.layers, args.batch, args.framework
        );
        println!(
            "samples/s {samples_per_s:.1}   ms/step {step_ms:.2}   comm_wait ms/step {comm_wait_ms:.2}"
        );
        if args.json {
            println!(
                "{}",
                serde_json::json!({"world_size": world, "framework": args.framework, "samples_per_s": samples_per_s, "step_ms": step_ms, "comm_wait_ms": comm_wait_ms})
            );
        }
    }
    Ok(())
}

/// Fails the run when the replicas differ after training; rank 0 prints the difference.
pub(crate) fn check_replicas(rank: usize, diff: f64) -> Result<(), Error> {
    if rank == 0 {
        println!("replicas max diff {diff:e}");
    }
    if diff != 0.0 {
        return Err(format!("replicas diverged: max abs difference {diff:e}").into());
    }
    Ok(())
}
