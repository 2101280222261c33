//! Training throughput: an MLP `784 - H×L - 10` on synthetic data, one thread per rank, with
//! DDP (plain backward by default; `--blockwise` sends buckets while earlier layers compute).
//!
//! `--zero 1|2` shards optimizer state (and gradients) with `ddp_candle::ZeroDdp`; `--zero 3`
//! shards the parameters too with `ddp_candle::Fsdp`, one unit per layer.
//!
//! Reports global samples/s (world × batch × steps ÷ the slowest rank's time), ms/step and the
//! mean time per step that backward spent blocked on communication.

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{linear, Linear, ParamsAdamW, VarBuilder, VarMap};
use ddp_candle::optim::ParamsSgd;
use ddp_candle::{BackwardPrefetch, Ddp, DdpOptions, Fsdp, ShardOptimizer, Unit, ZeroDdp};
use ddp_comm::{init_process_group, InitOptions, ReduceOp};
use ddp_core::hooks::{DiLoCo, PeriodicModelAverager};
use ddp_core::sharding::ZeroStage;
use ddp_core::trace;
use std::time::Instant;

use crate::TrainArgs;

/// A linear layer in the weight layout and implementation of `--weight-layout`.
enum Dense {
    /// `ddp_candle::nn::Linear`: weight `[out, in]`, `x @ W^T + b`, backward as three matmuls.
    OutIn(ddp_candle::nn::Linear),
    /// `candle_nn::Linear`: the same, with candle's own backward.
    CandleNn(Linear),
    /// Weight `[in, out]`, `x @ W + b`.
    InOut { w: Tensor, b: Tensor },
}

impl Dense {
    fn new(layout: &str, i: usize, o: usize, vb: VarBuilder) -> candle_core::Result<Dense> {
        match layout {
            "out-in" => return Ok(Dense::OutIn(ddp_candle::nn::linear(i, o, vb)?)),
            "candle-nn" => return Ok(Dense::CandleNn(linear(i, o, vb)?)),
            _ => {}
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
            Dense::CandleNn(l) => l.forward(x)?,
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

/// The MLP's layers: `(name, in, out, relu)`.
fn layers(args: &TrainArgs) -> Vec<(String, usize, usize, bool)> {
    let mut out = Vec::new();
    let mut width = 784;
    for l in 0..args.layers {
        out.push((format!("l{l:02}"), width, args.hidden, true));
        width = args.hidden;
    }
    out.push(("out".to_string(), width, 10, false));
    out
}

/// The MLP's blocks, their variables taken from (or created in) `vb`'s map.
fn build(args: &TrainArgs, vb: VarBuilder) -> Result<Vec<Block>, Error> {
    let mut blocks = Vec::new();
    for (name, i, o, relu) in layers(args) {
        blocks.push(Block {
            lin: Dense::new(&args.weight_layout, i, o, vb.pp(name))?,
            relu,
        });
    }
    Ok(blocks)
}

/// Stage 3's units: one per layer, each building its block from the gathered parameters.
fn units(args: &TrainArgs) -> Vec<Unit> {
    layers(args)
        .into_iter()
        .map(|(name, i, o, relu)| {
            let layout = args.weight_layout.clone();
            let prefix = name.clone();
            Unit::new([prefix], move |vb, x| {
                let lin = Dense::new(&layout, i, o, vb.pp(&name))?;
                Block { lin, relu }.forward(x)
            })
        })
        .collect()
}

/// Run the benchmark as one worker; rank 0 prints.
pub fn run(args: &TrainArgs) -> Result<(), Error> {
    if !args.no_retain_memory {
        ddp_candle::alloc::retain_freed_memory();
    }
    let pg = init_process_group(InitOptions::default())?;
    let rank = pg.rank();
    let dev = ddp_candle::device::worker_device(args.device)?;
    let stage = ZeroStage::from_level(args.zero)?;
    if stage == ZeroStage::Three {
        return run_fsdp(args, &pg);
    }
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
    if stage != ZeroStage::Ddp && !dev.is_cpu() {
        return Err("--zero 1/2 keeps its shards in host memory: run it with --device cpu".into());
    }
    if stage != ZeroStage::Ddp && args.hook != ddp_core::hooks::HookSpec::None {
        return Err(format!(
            "--hook {} cannot be combined with --zero {}: ZeRO reduce-scatters the gradients \
             through its own comm hook",
            args.hook, args.zero
        )
        .into());
    }
    let mut ddp = Ddp::new(&varmap, &pg, opts)?;
    if let Some(hook) = args.hook.hook()? {
        ddp.register_comm_hook(hook)?;
    }
    let mut averager = args.hook.averager()?;
    let options = ddp_candle::ZeroOptions {
        keep_whole_buckets: args.zero_keep_buckets,
    };
    let mut zero = ZeroDdp::with_options(ddp, stage, optimizer(args), options)?;
    // DiLoCo (stage 0: a hook with --zero was refused above): the outer loop after each step.
    let mut outer = match args.hook.diloco() {
        Some(cfg) => Some(DiLoCo::new(cfg, zero.ddp().params())?),
        None => None,
    };
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

    let sent =
        |zero: &ZeroDdp, averager: &Option<PeriodicModelAverager>, outer: &Option<DiLoCo>| {
            zero.ddp().reducer().bytes_sent() + hook_bytes(averager, outer)
        };
    let mut step = || -> Result<StepCost, Error> {
        let before = sent(&zero, &averager, &outer);
        let out = if !args.blockwise {
            let loss = {
                let _s = trace::span("forward", "train");
                ddp_core::trace::debug::slow_forward();
                let logits = stages.iter().try_fold(x.clone(), |h, s| s.forward(&h))?;
                candle_nn::loss::cross_entropy(&logits, &y)?
            };
            zero.backward(&loss)?;
            let _s = trace::span("optimizer", "train");
            zero.step()?;
            loss
        } else {
            let (_, loss, _) = zero.forward_backward_blockwise(&stages, &x, |logits| {
                candle_nn::loss::cross_entropy(logits, &y)
            })?;
            let _s = trace::span("optimizer", "train");
            zero.step()?;
            loss
        };
        if let Some(a) = &mut averager {
            a.average_parameters(&pg, zero.ddp().params())?;
        }
        if let Some(d) = &mut outer {
            d.step(&pg, zero.ddp().params())?;
        }
        let wait_s = zero
            .ddp()
            .last_step_stats()
            .map_or(0.0, |s| s.comm_wait.as_secs_f64());
        drop(out);
        Ok(StepCost {
            wait_s,
            bytes: sent(&zero, &averager, &outer) - before,
        })
    };
    // `dev.synchronize()`: the GPU has finished the timed steps before the clock stops.
    let timing = measure(args, &pg, &mut step, || Ok(dev.synchronize()?))?;
    // Local SGD and DiLoCo: replicas differ between synchronizations; synchronize once more
    // before the check (not a timed step: its bytes are not in bytes_per_step).
    if let Some(a) = &mut averager {
        a.average_now(&pg, zero.ddp().params())?;
    }
    if let Some(d) = &mut outer {
        d.finish(&pg, zero.ddp().params())?;
    }
    let diff = zero.ddp().replica_max_diff()?;
    // Stage 0: the payload the reducer (and its hook, local SGD's averager, DiLoCo's outer
    // loop) really sent; ZeRO: its reduce-scatter plus all-gather.
    let bytes_per_step = if stage == ZeroStage::Ddp {
        timing.bytes_per_step
    } else {
        zero.bytes_per_step() as f64
    };
    let path = if args.blockwise { "blockwise" } else { "plain" };
    let label = format!(
        "device {}  {path} path  weights {}  hook {}  zero {}  {}",
        args.device, args.weight_layout, args.hook, args.zero, args.optimizer
    );
    let extra = serde_json::json!({
        "hook": args.hook.to_string(),
        "zero": args.zero,
        "optimizer": args.optimizer,
        "params": params,
        "bytes_per_step": bytes_per_step,
    });
    report(args, &pg, &label, &timing, diff, extra)
}

/// Payload bytes sent so far besides the reducer's: local SGD's model averaging and DiLoCo's
/// pseudo-gradients (both frameworks).
pub(crate) fn hook_bytes(averager: &Option<PeriodicModelAverager>, outer: &Option<DiLoCo>) -> u64 {
    averager.as_ref().map_or(0, |a| a.bytes_sent()) + outer.as_ref().map_or(0, |d| d.bytes_sent())
}

/// `--optimizer`: SGD (lr 0.01) or AdamW (candle's defaults).
fn optimizer(args: &TrainArgs) -> ShardOptimizer {
    if args.optimizer == "adamw" {
        ShardOptimizer::AdamW(ParamsAdamW::default())
    } else {
        ShardOptimizer::Sgd(ParamsSgd::with_lr(0.01))
    }
}

/// `--zero 3`: the parameters sharded over the ranks, one unit per layer (`ddp_candle::Fsdp`).
/// The model is built one unit at a time, each cut to its shard before the next is built
/// (`Fsdp::from_unit_init`): it never exists whole.
fn run_fsdp(args: &TrainArgs, pg: &ddp_comm::ProcessGroup) -> Result<(), Error> {
    if args.blockwise {
        return Err("--blockwise does not apply to --zero 3: its backward is by unit".into());
    }
    if args.device != ddp_candle::device::DeviceKind::Cpu {
        return Err("--zero 3 keeps its shards in host memory: run it with --device cpu".into());
    }
    if args.hook != ddp_core::hooks::HookSpec::None {
        return Err(format!(
            "--hook {} cannot be combined with --zero 3: ZeRO reduce-scatters the gradients itself",
            args.hook
        )
        .into());
    }
    let rank = pg.rank();
    let opt = optimizer(args);
    let ls = layers(args);
    let init = |u: usize, vb: VarBuilder| {
        let (name, i, o, _) = &ls[u];
        Dense::new(&args.weight_layout, *i, *o, vb.pp(name)).map(drop)
    };
    let mut fsdp = Fsdp::from_unit_init(units(args), pg, init, |vars| opt.build(vars))?;
    fsdp.set_backward_prefetch(match args.backward_prefetch.as_str() {
        "pre" => Some(BackwardPrefetch::BackwardPre),
        "post" => Some(BackwardPrefetch::BackwardPost),
        _ => None,
    });
    let params: usize = fsdp.layout().numel();
    // Each unit existed whole only to be cut into its shard: give that memory back (the
    // retained heap would otherwise keep it resident for good).
    ddp_candle::alloc::release_freed_memory();
    let x = Tensor::randn(0f32, 1.0, (args.batch, 784), &Device::Cpu)?
        .affine(1.0, rank as f64 * 0.01)?;
    let labels: Vec<u32> = (0..args.batch).map(|i| ((i + rank) % 10) as u32).collect();
    let y = Tensor::from_vec(labels, args.batch, &Device::Cpu)?;
    let per_step = fsdp.bytes_per_step();
    let mut step = || -> Result<StepCost, Error> {
        let out = {
            let _s = trace::span("forward_backward", "train");
            fsdp.forward_backward(&x, |logits| candle_nn::loss::cross_entropy(logits, &y))?
        };
        let _s = trace::span("optimizer", "train");
        fsdp.step()?;
        Ok(StepCost {
            wait_s: out.stats.comm_wait.as_secs_f64(),
            bytes: per_step,
        })
    };
    let timing = measure(args, pg, &mut step, || Ok(()))?;
    let diff = fsdp.replica_max_diff()?;
    let label = format!(
        "device cpu  units (one per layer)  weights {}  zero 3  {}  backward prefetch {}",
        args.weight_layout, args.optimizer, args.backward_prefetch
    );
    let extra = serde_json::json!({
        "hook": args.hook.to_string(),
        "zero": 3,
        "optimizer": args.optimizer,
        "params": params,
        "bytes_per_step": per_step as f64,
        "largest_unit_params": fsdp.largest_unit_numel(),
        "backward_prefetch": args.backward_prefetch,
    });
    report(args, pg, &label, &timing, diff, extra)
}

/// What one training step cost: seconds backward spent blocked on communication, payload bytes
/// this rank handed to collectives.
pub(crate) struct StepCost {
    pub wait_s: f64,
    pub bytes: u64,
}

/// The timed steps, over every rank.
pub(crate) struct Timing {
    samples_per_s: f64,
    step_ms: f64,
    comm_wait_ms: f64,
    /// This rank's mean payload bytes per timed step.
    pub(crate) bytes_per_step: f64,
    /// This rank's peak resident memory once the timed steps are done (before the replica
    /// check, whose copy of the parameters, where a framework needs one, is not training's).
    peak_rss: u64,
}

/// Times `args.steps` calls of `step` after `args.warmup` untimed ones (the slowest rank's
/// time; `sync` runs before the clock stops, e.g. a device synchronize): shared by every
/// framework.
pub(crate) fn measure(
    args: &TrainArgs,
    pg: &ddp_comm::ProcessGroup,
    mut step: impl FnMut() -> Result<StepCost, Error>,
    sync: impl FnOnce() -> Result<(), Error>,
) -> Result<Timing, Error> {
    for _ in 0..args.warmup {
        step()?;
    }
    // The timeline (`--trace`, `DDP_TRACE`) covers the timed steps.
    ddp_core::trace::start_from_env(pg, args.trace.as_deref())?;
    pg.barrier()?;
    let t = Instant::now();
    let (mut wait, mut bytes) = (0.0, 0u64);
    for i in 0..args.steps {
        let _s = ddp_core::trace::span("step", "step").arg("step", i);
        let c = step()?;
        wait += c.wait_s;
        bytes += c.bytes;
    }
    sync()?;
    let elapsed = t.elapsed().as_secs_f64();
    let peak_rss = peak_rss_bytes();
    if let Some(path) = ddp_core::trace::finish(pg)? {
        println!("# timeline of every rank: {}", path.display());
    }
    let mut times = [elapsed, wait];
    pg.all_reduce(&mut times, ReduceOp::Max)?;
    let (elapsed, wait) = (times[0], times[1]);
    Ok(Timing {
        samples_per_s: (pg.size() * args.batch * args.steps) as f64 / elapsed,
        step_ms: elapsed / args.steps as f64 * 1e3,
        comm_wait_ms: wait / args.steps as f64 * 1e3,
        bytes_per_step: bytes as f64 / args.steps as f64,
        peak_rss,
    })
}

/// Rank 0 prints the run (and with `--json` a last line with the common keys plus `extra`'s,
/// and `peak_rss_bytes`, the largest over the ranks, as of the end of the timed steps); every rank fails when the replicas differ.
pub(crate) fn report(
    args: &TrainArgs,
    pg: &ddp_comm::ProcessGroup,
    label: &str,
    t: &Timing,
    diff: f64,
    extra: serde_json::Value,
) -> Result<(), Error> {
    let (rank, world) = (pg.rank(), pg.size());
    let mut rss = [t.peak_rss as i64];
    pg.all_reduce(&mut rss, ReduceOp::Max)?;
    if rank == 0 {
        println!(
            "# ddp-bench train  world_size {world}  MLP 784-{}x{}-10  batch {} per rank  {}  {label}",
            args.hidden, args.layers, args.batch, args.framework
        );
        println!(
            "samples/s {:.1}   ms/step {:.2}   comm_wait ms/step {:.2}   bytes/step {:.0}   \
             replicas max diff {diff:e}",
            t.samples_per_s, t.step_ms, t.comm_wait_ms, t.bytes_per_step
        );
        if args.json {
            let mut row = serde_json::json!({
                "world_size": world,
                "framework": args.framework,
                "samples_per_s": t.samples_per_s,
                "step_ms": t.step_ms,
                "comm_wait_ms": t.comm_wait_ms,
                "bytes_per_step": t.bytes_per_step,
                "peak_rss_bytes": rss[0],
            });
            if let (Some(row), serde_json::Value::Object(extra)) = (row.as_object_mut(), extra) {
                row.extend(extra);
            }
            println!("{row}");
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
