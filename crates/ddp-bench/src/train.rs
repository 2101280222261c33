//! Training throughput: an MLP `784 - H×L - 10` on synthetic data, one thread per rank, with
//! DDP (plain backward by default; `--staged` communicates buckets while earlier layers compute).
//!
//! Reports global samples/s (world × batch × steps ÷ the slowest rank's time), ms/step and the
//! mean time per step that backward spent blocked on communication.

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{linear, Linear, ParamsAdamW, VarBuilder, VarMap};
use ddp::sharding::ZeroStage;
use ddp_candle::optim::{AdamW, DynOptimizer, ParamsSgd, Sgd};
use ddp_candle::{Ddp, DdpOptions, ZeroDdp};
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

type Error = Box<dyn std::error::Error>;

/// The MLP's blocks, their variables taken from (or created in) `vb`'s map.
fn build(args: &TrainArgs, vb: VarBuilder) -> Result<Vec<Block>, Error> {
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
    Ok(blocks)
}

/// Run the benchmark as one worker; rank 0 prints.
pub fn run(args: &TrainArgs) -> Result<(), Error> {
    if !args.no_retain_memory {
        ddp_candle::alloc::retain_freed_memory();
    }
    let pg = init_process_group(InitOptions::default())?;
    let (rank, world) = (pg.rank(), pg.size());
    let dev = ddp_candle::device::worker_device(args.device)?;
    // Initialized on the host (no device RNG), then the variables are copied to the device.
    let host_map = VarMap::new();
    build(
        args,
        VarBuilder::from_varmap(&host_map, DType::F32, &Device::Cpu),
    )?;
    let varmap = match dev.is_cpu() {
        true => host_map,
        false => {
            let on_dev = VarMap::new();
            for (name, v) in host_map.data().lock().expect("VarMap lock").iter() {
                let t = v.as_tensor().to_device(&dev)?;
                on_dev
                    .data()
                    .lock()
                    .expect("VarMap lock")
                    .insert(name.clone(), Var::from_tensor(&t)?);
            }
            on_dev
        }
    };
    let blocks = build(args, VarBuilder::from_varmap(&varmap, DType::F32, &dev))?;
    let opts = DdpOptions {
        bucket_cap_mb: args.bucket_cap_mb,
        ..Default::default()
    };
    let stage = ZeroStage::from_level(args.zero)?;
    if args.staged && stage != ZeroStage::Ddp {
        return Err("--staged is not supported with --zero 1/2 yet".into());
    }
    if stage != ZeroStage::Ddp && !dev.is_cpu() {
        return Err("--zero 1/2 keeps its shards in host memory: run it with --device cpu".into());
    }
    if stage != ZeroStage::Ddp && args.hook != ddp::hooks::HookSpec::None {
        return Err(format!(
            "--hook {} cannot be combined with --zero {}: ZeRO reduce-scatters the gradients \
             through its own comm hook",
            args.hook, args.zero
        )
        .into());
    }
    let adamw = args.optimizer == "adamw";
    let make_opt = move |vars: Vec<(String, Var)>| -> ddp_candle::Result<Box<dyn DynOptimizer>> {
        Ok(if adamw {
            Box::new(AdamW::new_named(vars, ParamsAdamW::default())?)
        } else {
            Box::new(Sgd::new_named(vars, ParamsSgd::with_lr(0.01))?)
        })
    };
    let mut ddp = Ddp::new(&varmap, &pg, opts)?;
    if let Some(hook) = args.hook.hook()? {
        ddp.register_comm_hook(hook)?;
    }
    let mut averager = args.hook.averager()?;
    let mut zero = ZeroDdp::new(ddp, stage, make_opt)?;
    let params: usize = zero
        .ddp()
        .named_vars()
        .iter()
        .map(|(_, v)| v.elem_count())
        .sum();
    let stages: Vec<&dyn Module> = blocks.iter().map(|b| b as &dyn Module).collect();

    // Synthetic data, different on every rank (drawn on the host).
    let x = Tensor::randn(0f32, 1.0, (args.batch, 784), &Device::Cpu)?
        .affine(1.0, rank as f64 * 0.01)?
        .to_device(&dev)?;
    let labels: Vec<u32> = (0..args.batch).map(|i| ((i + rank) % 10) as u32).collect();
    let y = Tensor::from_vec(labels, args.batch, &dev)?;

    let mut step = |zero: &mut ZeroDdp| -> Result<f64, Error> {
        let out = if !args.staged {
            let logits = stages.iter().try_fold(x.clone(), |h, s| s.forward(&h))?;
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            zero.backward(&loss)?;
            zero.step()?;
            loss
        } else {
            let o = zero
                .ddp_mut()
                .forward_backward_staged(&stages, &x, |logits| {
                    candle_nn::loss::cross_entropy(logits, &y)
                })?;
            zero.optimizer_mut().step(&o.grads)?;
            o.loss
        };
        if let Some(a) = &mut averager {
            a.average_parameters(&pg, zero.ddp().params())?;
        }
        let wait = zero
            .ddp()
            .last_step_stats()
            .map_or(0.0, |s| s.comm_wait.as_secs_f64());
        drop(out);
        Ok(wait)
    };
    for _ in 0..args.warmup {
        step(&mut zero)?;
    }
    pg.barrier()?;
    let t = Instant::now();
    let mut wait = 0.0;
    let sent_before = zero.ddp().reducer().bytes_sent();
    for _ in 0..args.steps {
        wait += step(&mut zero)?;
    }
    dev.synchronize()?; // the GPU has finished the timed steps
    let averaged = averager.as_ref().map_or(0, |a| a.bytes_sent());
    let bytes_per_step =
        (zero.ddp().reducer().bytes_sent() - sent_before + averaged) as f64 / args.steps as f64;
    let mut times = [t.elapsed().as_secs_f64(), wait];
    pg.all_reduce(&mut times, ReduceOp::Max)?;
    let (elapsed, wait) = (times[0], times[1]);
    let samples_per_s = (world * args.batch * args.steps) as f64 / elapsed;
    let step_ms = elapsed / args.steps as f64 * 1e3;
    let comm_wait_ms = wait / args.steps as f64 * 1e3;
    // Local SGD: replicas differ between averagings; average once more before the check.
    if let Some(a) = &mut averager {
        a.average_now(&pg, zero.ddp().params())?;
    }
    let diff = zero.ddp().replica_max_diff()?;
    let mut rss = [peak_rss_bytes() as i64];
    pg.all_reduce(&mut rss, ReduceOp::Max)?;
    // Stage 0: the payload the reducer (and its hook, and local SGD's averager) really sent;
    // ZeRO: its reduce-scatter plus all-gather.
    let bytes_per_step = if stage == ZeroStage::Ddp {
        bytes_per_step
    } else {
        zero.bytes_per_step() as f64
    };
    if rank == 0 {
        println!(
            "# ddp-bench train  world_size {world}  device {}  MLP 784-{}x{}-10  batch {} per rank  {} path  weights {}",
            args.device,
            args.hidden,
            args.layers,
            args.batch,
            if args.staged { "staged" } else { "plain" },
            args.weight_layout
        );
        println!(
            "samples/s {samples_per_s:.1}   ms/step {step_ms:.2}   comm_wait ms/step {comm_wait_ms:.2}   replicas max diff {diff:e}   hook {}   bytes/step {bytes_per_step:.0}",
            args.hook
        );
        if args.json {
            println!(
                "{}",
                serde_json::json!({"world_size": world, "samples_per_s": samples_per_s, "step_ms": step_ms, "comm_wait_ms": comm_wait_ms, "hook": args.hook.to_string(), "zero": args.zero, "optimizer": args.optimizer, "params": params, "peak_rss_bytes": rss[0], "bytes_per_step": bytes_per_step})
            );
        }
    }
    if diff != 0.0 {
        return Err(format!("replicas diverged: max abs difference {diff:e}").into());
    }
    Ok(())
}

/// Peak resident memory of this process (`VmHWM` of `/proc/self/status`), in bytes; 0 where
/// there is none.
fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            Some(kb * 1024)
        })
        .unwrap_or(0)
}
