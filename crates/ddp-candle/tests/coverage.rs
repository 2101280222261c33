//! The candle adapter in settings the other tests leave out, each against plain candle (no
//! ddp-rs code) where a reference applies: f16/bf16 models, parameters unused in a step,
//! zero-size parameters, subgroups, a bucket that fills the default 25 MiB cap, and overlap on
//! the staged path.

mod common;

use candle_core::{DType, Device, Module, Tensor, Var};
use candle_nn::{Linear, Optimizer, VarMap, SGD};
use common::*;
use ddp_candle::{Ddp, DdpOptions};
use ddp_comm::ReduceOp;

/// `model(seed, HID)` with its parameters converted to `dtype`.
fn model_in(seed: u64, dtype: DType) -> (VarMap, Mlp) {
    let (src, _) = model(seed, HID);
    let vm = VarMap::new();
    for (n, v) in src.data().lock().unwrap().iter() {
        let t = v.as_tensor().to_dtype(dtype).unwrap();
        let var = Var::from_tensor(&t).unwrap();
        vm.data().lock().unwrap().insert(n.clone(), var);
    }
    let get = |n: String| vm.data().lock().unwrap()[&n].as_tensor().clone();
    let lin = |l: &str| Linear::new(get(format!("{l}.weight")), Some(get(format!("{l}.bias"))));
    let m = Mlp {
        l1: lin("l1"),
        l2: lin("l2"),
        l3: lin("l3"),
    };
    (vm, m)
}

fn loss_of(m: &Mlp, xs: &Tensor, ys: &Tensor, dtype: DType) -> Tensor {
    let logits = m.forward(&xs.to_dtype(dtype).unwrap()).unwrap();
    candle_nn::loss::cross_entropy(&logits.to_dtype(DType::F32).unwrap(), ys).unwrap()
}

/// `dtype` parameters and gradients through DDP (3 ranks, several buckets) against plain
/// candle in f32 on the global batch: the first step's averaged gradients and the parameters
/// after 4 SGD steps, within the 16-bit type's precision (`tol`).
fn half_ddp_matches_f32_reference(dtype: DType, tol: f64) {
    const STEPS: usize = 4;
    const PER: usize = 8;
    let (x, y) = dataset(3 * PER * STEPS);
    let global = |k: usize| batch(&x, &y, k * 3 * PER..(k + 1) * 3 * PER);
    let want = plain_reference(7, 0.1, STEPS, global);
    let want_grads = {
        let (vm, m) = model(7, HID);
        let (xs, ys) = global(0);
        let g = loss_of(&m, &xs, &ys, DType::F32).backward().unwrap();
        let mut v: Vec<(String, Vec<f32>)> = vm
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(n, var)| (n.clone(), flat(g.get(var.as_tensor()).unwrap())))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let out = run_ranks(3, |rank, pg| {
        let (vm, m) = model_in(7 + rank as u64, dtype);
        let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        assert!(ddp.reducer().buckets().len() > 1);
        let mut opt = SGD::new(ddp.all_vars(), 0.1).unwrap();
        let mut first = Vec::new();
        for k in 0..STEPS {
            let s = k * 3 * PER + rank * PER;
            let (xs, ys) = batch(&x, &y, s..s + PER);
            let grads = ddp.backward(&loss_of(&m, &xs, &ys, dtype)).unwrap();
            if k == 0 {
                first = ddp
                    .named_vars()
                    .iter()
                    .map(|(n, v)| {
                        let g = grads.get(v.as_tensor()).unwrap();
                        assert_eq!(g.dtype(), dtype, "`{n}`: gradient dtype");
                        (n.clone(), flat(g))
                    })
                    .collect();
            }
            opt.step(&grads).unwrap();
            assert_eq!(ddp.replica_max_diff().unwrap(), 0.0, "step {k}");
        }
        (first, varmap_params(&vm))
    });
    for (rank, (grads, params)) in out.iter().enumerate() {
        let what = format!("{dtype:?} rank {rank}");
        assert_close(grads, &want_grads, tol, &format!("{what} step-0 gradients"));
        assert_close(params, &want[STEPS - 1], tol, &format!("{what} parameters"));
    }
}

fn flat(t: &Tensor) -> Vec<f32> {
    let t = t.to_dtype(DType::F32).unwrap();
    t.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn bf16_ddp_matches_f32_plain_candle() {
    half_ddp_matches_f32_reference(DType::BF16, 2e-2);
}

#[test]
fn f16_ddp_matches_f32_plain_candle() {
    half_ddp_matches_f32_reference(DType::F16, 3e-3);
}

/// Rank 0 uses an extra head that rank 1 does not, and one parameter is used by nobody: the
/// averaged gradients equal plain candle's gradient of the mean of the ranks' losses (the
/// head's is rank 0's / 2, the unused one's is zero), and the unused parameter stays put.
#[test]
fn parameters_unused_in_a_step_match_plain_candle() {
    let (x, y) = dataset(16);
    let extra = |vm: &VarMap| {
        let mk = |shape: &[usize], v: f32| {
            let n: usize = shape.iter().product();
            let d: Vec<f32> = (0..n).map(|i| v * ((i % 7) as f32 - 3.0)).collect();
            Var::from_tensor(&Tensor::from_vec(d, shape, &Device::Cpu).unwrap()).unwrap()
        };
        let (head, never) = (mk(&[3, HID], 0.05), mk(&[4], 1.0));
        let mut data = vm.data().lock().unwrap();
        data.insert("head.weight".into(), head.clone());
        data.insert("never".into(), never.clone());
        (head, never)
    };
    let rank_loss = |m: &Mlp, head: &Var, rank: usize| {
        let (xs, ys) = batch(&x, &y, rank * 8..rank * 8 + 8);
        let l = loss_of(m, &xs, &ys, DType::F32);
        if rank == 0 {
            let h = m.stage2(&m.stage1(&xs).unwrap()).unwrap();
            let aux = h.matmul(&head.as_tensor().t().unwrap()).unwrap();
            (l + (aux.sqr().unwrap().mean_all().unwrap() * 0.1).unwrap()).unwrap()
        } else {
            l
        }
    };
    // Plain candle: gradient of (loss_0 + loss_1) / 2.
    let want = {
        let (vm, m) = model(3, HID);
        let (head, _) = extra(&vm);
        let l = ((rank_loss(&m, &head, 0) + rank_loss(&m, &head, 1)).unwrap() / 2.0).unwrap();
        let g = l.backward().unwrap();
        let mut v: Vec<(String, Vec<f32>)> = vm
            .data()
            .lock()
            .unwrap()
            .iter()
            .map(|(n, var)| {
                let grad = g
                    .get(var.as_tensor())
                    .map_or(vec![0.0; var.elem_count()], flat);
                (n.clone(), grad)
            })
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let out = run_ranks(2, |rank, pg| {
        let (vm, m) = model(3, HID);
        let (head, never) = extra(&vm);
        let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        let grads = ddp.backward(&rank_loss(&m, &head, rank)).unwrap();
        let got: Vec<(String, Vec<f32>)> = ddp
            .named_vars()
            .iter()
            .map(|(n, v)| (n.clone(), flat(grads.get(v.as_tensor()).unwrap())))
            .collect();
        let before = flat(never.as_tensor());
        let mut opt = ddp_candle::optim::Sgd::new(ddp.all_vars(), Default::default()).unwrap();
        opt.step(&grads).unwrap();
        assert_eq!(flat(never.as_tensor()), before, "an unused parameter moved");
        assert_eq!(ddp.replica_max_diff().unwrap(), 0.0);
        got
    });
    for (rank, got) in out.iter().enumerate() {
        assert_close(got, &want, 1e-5, &format!("rank {rank}"));
        let never = &got.iter().find(|(n, _)| n == "never").unwrap().1;
        assert!(never.iter().all(|&g| g == 0.0), "rank {rank}: {never:?}");
    }
}

/// Zero-size parameters (`[0]`, `[4, 0]`) among the model's: DDP verifies, buckets, reduces and
/// steps through them, and the others train exactly as in plain candle.
#[test]
fn zero_size_parameters_pass_through_ddp() {
    const STEPS: usize = 3;
    let (x, y) = dataset(2 * 8 * STEPS);
    let want = plain_reference(7, 0.1, STEPS, |k| batch(&x, &y, k * 16..(k + 1) * 16));
    run_ranks(2, |rank, pg| {
        let (vm, m) = model(7 + rank as u64, HID);
        let empty = [Var::zeros(0, DType::F32, &Device::Cpu).unwrap(), {
            Var::zeros((4, 0), DType::F32, &Device::Cpu).unwrap()
        }];
        for (i, v) in empty.iter().enumerate() {
            vm.data()
                .lock()
                .unwrap()
                .insert(format!("empty{i}"), v.clone());
        }
        let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        // ddp-rs's in-place SGD (bit-identical to candle_nn::SGD, which refuses to set a
        // zero-size variable).
        let p = ddp_candle::optim::ParamsSgd::with_lr(0.1);
        let mut opt = ddp_candle::optim::Sgd::new(ddp.all_vars(), p).unwrap();
        for (k, want_k) in want.iter().enumerate().take(STEPS) {
            let s = k * 16 + rank * 8;
            let (xs, ys) = batch(&x, &y, s..s + 8);
            // The empty parameters take part in the graph (their sums are 0).
            let l = loss_of(&m, &xs, &ys, DType::F32);
            let l = (l + empty[0].as_tensor().sum_all().unwrap()).unwrap();
            let l = (l + empty[1].as_tensor().sum_all().unwrap()).unwrap();
            let grads = ddp.backward(&l).unwrap();
            for v in &empty {
                let g = grads.get(v.as_tensor()).expect("a zero-size gradient");
                assert_eq!(g.dims(), v.dims());
            }
            opt.step(&grads).unwrap();
            let got: Vec<_> = params(&ddp)
                .into_iter()
                .filter(|(n, _)| !n.starts_with("empty"))
                .collect();
            assert_close(&got, want_k, 1e-5, &format!("rank {rank} step {k}"));
        }
    });
}

/// DDP on two interleaved subgroups of a 4-rank job ({0, 2} and {1, 3}), each on its own data:
/// each matches plain candle on its group's global batch, starting from its group rank 0's
/// parameters; the default group still works afterwards.
#[test]
fn ddp_on_subgroups_matches_plain_candle_per_group() {
    const STEPS: usize = 3;
    let (x, y) = dataset(2 * 2 * 8 * STEPS);
    let base = |g: usize, k: usize| g * 16 * STEPS + k * 16;
    let out = run_ranks(4, |rank, pg| {
        let a = pg.new_group(&[0, 2]).unwrap();
        let b = pg.new_group(&[1, 3]).unwrap();
        let (g, sub) = match (a, b) {
            (Some(s), None) => (0, s),
            (None, Some(s)) => (1, s),
            _ => panic!("rank {rank} must be in exactly one subgroup"),
        };
        let (vm, m) = model(7 + rank as u64, HID);
        let mut ddp = Ddp::new(&vm, &sub, tiny_buckets()).unwrap();
        let mut opt = SGD::new(ddp.all_vars(), 0.1).unwrap();
        for k in 0..STEPS {
            let s = base(g, k) + sub.rank() * 8;
            let (xs, ys) = batch(&x, &y, s..s + 8);
            opt.step(&ddp.backward(&loss_of(&m, &xs, &ys, DType::F32)).unwrap())
                .unwrap();
        }
        let mut v = [1i32];
        pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        assert_eq!(v[0], 4);
        (g, params(&ddp))
    });
    for g in 0..2 {
        // Group g's rank 0 is global rank g: seed 7 + g.
        let want = plain_reference(7 + g as u64, 0.1, STEPS, |k| {
            batch(&x, &y, base(g, k)..base(g, k) + 16)
        });
        for (rank, (group, got)) in out.iter().enumerate() {
            if *group == g {
                assert_close(got, &want[STEPS - 1], 1e-5, &format!("rank {rank}"));
            }
        }
    }
    assert_ne!(
        out[0].1, out[1].1,
        "the two groups trained on different data"
    );
}

/// 30 parameters of 1 MiB with default options: the first bucket (1 MiB cap) holds the last
/// parameter, the next one fills the default 25 MiB cap exactly, the rest form the last
/// bucket; every averaged gradient is exact.
#[test]
fn a_bucket_fills_the_default_25_mib_cap() {
    const N: usize = 30;
    const LEN: usize = 1 << 18; // 1 MiB of f32
    run_ranks(2, |rank, pg| {
        let vm = VarMap::new();
        let vars: Vec<Var> = (0..N)
            .map(|i| {
                let v = Var::zeros(LEN, DType::F32, &Device::Cpu).unwrap();
                vm.data()
                    .lock()
                    .unwrap()
                    .insert(format!("p{i:02}"), v.clone());
                v
            })
            .collect();
        let mut ddp = Ddp::new(&vm, &pg, DdpOptions::default()).unwrap();
        let sizes: Vec<usize> = ddp.reducer().buckets().iter().map(|b| b.numel).collect();
        assert_eq!(sizes, vec![LEN, 25 * LEN, 4 * LEN], "bucket sizes");
        // loss = sum_i c(rank, i) * sum(p_i): gradient of p_i is c(rank, i) everywhere.
        let c = |r: usize, i: usize| ((r + 1) * (i + 3)) as f64;
        let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
        for (i, v) in vars.iter().enumerate() {
            loss = (loss + (v.as_tensor().sum_all().unwrap() * c(rank, i)).unwrap()).unwrap();
        }
        let grads = ddp.backward(&loss).unwrap();
        assert_eq!(ddp.last_step_stats().unwrap().buckets, 3);
        for (i, v) in vars.iter().enumerate() {
            let g = flat(grads.get(v.as_tensor()).unwrap());
            let want = ((c(0, i) + c(1, i)) / 2.0) as f32;
            assert!(g.iter().all(|&x| x == want), "p{i:02}: want {want}");
        }
    });
}

/// What happened, in order, on one rank: a bucket handed to communication, or the backward of
/// the first stage beginning.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Event {
    BucketLaunched(usize),
    FirstStageBackwardBegins,
}

/// The identity, whose backward logs [`Event::FirstStageBackwardBegins`] (placed at the output of
/// stage 1, its backward runs first in that stage's backward).
struct Marker(std::sync::Arc<std::sync::Mutex<Vec<Event>>>);

impl candle_core::CustomOp1 for Marker {
    fn name(&self) -> &'static str {
        "marker"
    }
    fn cpu_fwd(
        &self,
        s: &candle_core::CpuStorage,
        l: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        assert!(l.is_contiguous() && l.start_offset() == 0);
        Ok((s.clone(), l.shape().clone()))
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, g: &Tensor) -> candle_core::Result<Option<Tensor>> {
        self.0.lock().unwrap().push(Event::FirstStageBackwardBegins);
        Ok(Some(g.clone()))
    }
}

/// The staged path puts buckets on the wire while earlier stages still compute: in every step,
/// the buckets of the later stages are handed to communication *before* the backward of the
/// first stage begins (causal order observed through a logging comm hook and a marker op, not
/// timing), and every bucket is launched once per step.
#[test]
fn staged_backward_launches_buckets_before_earlier_stages_compute() {
    use std::sync::{Arc, Mutex};
    let (x, y) = dataset(64);
    run_ranks(2, |rank, pg| {
        let (vm, m) = model(3, HID);
        let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        let n_buckets = ddp.reducer().buckets().len();
        assert!(n_buckets >= 2, "{n_buckets} bucket: nothing to overlap");
        let log = Arc::new(Mutex::new(Vec::new()));
        let hook_log = Arc::clone(&log);
        let mut inner = ddp_core::reducer::AllReduceHook;
        ddp.register_comm_hook(
            move |pg: &ddp_comm::ProcessGroup, b: ddp_core::reducer::GradBucket| {
                hook_log
                    .lock()
                    .unwrap()
                    .push(Event::BucketLaunched(b.index()));
                ddp_core::reducer::CommHook::run(&mut inner, pg, b)
            },
        )
        .unwrap();
        let marker_log = Arc::clone(&log);
        let s1 = |t: &Tensor| m.stage1(t)?.apply_op1(Marker(Arc::clone(&marker_log)));
        let s2 = |t: &Tensor| m.stage2(t);
        let s3 = |t: &Tensor| m.stage3(t);
        let stages: [&dyn Module; 3] = [&s1, &s2, &s3];
        for k in 0..3 {
            log.lock().unwrap().clear();
            let s = k * 16 + rank * 8;
            let (xs, ys) = batch(&x, &y, s..s + 8);
            ddp.forward_backward_blockwise(&stages, &xs, |o| {
                candle_nn::loss::cross_entropy(o, &ys)
            })
            .unwrap();
            let events = log.lock().unwrap().clone();
            let first = events
                .iter()
                .position(|e| *e == Event::FirstStageBackwardBegins)
                .unwrap_or_else(|| panic!("rank {rank}: stage 1 never ran backward: {events:?}"));
            let mut launched: Vec<usize> = events
                .iter()
                .filter_map(|e| match e {
                    Event::BucketLaunched(b) => Some(*b),
                    _ => None,
                })
                .collect();
            assert!(
                events[..first]
                    .iter()
                    .any(|e| matches!(e, Event::BucketLaunched(_))),
                "rank {rank}, step {k}: no bucket was launched before the first stage's \
                 backward began: {events:?}"
            );
            launched.sort();
            assert_eq!(
                launched,
                (0..n_buckets).collect::<Vec<_>>(),
                "rank {rank}, step {k}"
            );
        }
    });
}
