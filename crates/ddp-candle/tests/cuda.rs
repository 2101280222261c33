//! candle on CUDA with DDP (feature `cuda`): run on the GPU machine by `scripts/gpu-check`'s
//! bundle (binary `ddp-candle-cuda`). Every test needs a GPU and prints `SKIPPED ...` without
//! one. Ranks are threads sharing GPU 0, so the device group is host-staged (NCCL refuses two
//! ranks on one device); at world 1 it is NCCL when libnccl loads.
#![cfg(feature = "cuda")]

use candle_core::{Device, Module, Tensor, Var};
use candle_nn::{Optimizer, VarMap, SGD};
use ddp_candle::{Ddp, DdpOptions};

mod common;

use common::*;

/// `vm`'s variables copied to `dev` in a new map, and the model over them.
fn on_device(vm: &VarMap, dev: &Device) -> (VarMap, Mlp) {
    let out = VarMap::new();
    for (name, v) in vm.data().lock().unwrap().iter() {
        let t = v.as_tensor().to_device(dev).unwrap();
        out.data()
            .lock()
            .unwrap()
            .insert(name.clone(), Var::from_tensor(&t).unwrap());
    }
    let lin = |n: &str| {
        let d = out.data().lock().unwrap();
        candle_nn::Linear::new(
            d[&format!("{n}.weight")].as_tensor().clone(),
            Some(d[&format!("{n}.bias")].as_tensor().clone()),
        )
    };
    let m = Mlp {
        l1: lin("l1"),
        l2: lin("l2"),
        l3: lin("l3"),
    };
    (out, m)
}

fn to_dev(t: (Tensor, Tensor), dev: &Device) -> (Tensor, Tensor) {
    (t.0.to_device(dev).unwrap(), t.1.to_device(dev).unwrap())
}

/// 2 ranks × b samples on the GPU (device buckets, staged all-reduce), plain and staged
/// backward, equal plain candle on the CPU with 1 rank × 2b to 1e-5 after every step; the
/// replicas stay bit-identical.
#[test]
fn two_ranks_on_one_gpu_match_one_rank_on_the_double_batch() {
    let Some(dev) = gpu("two_ranks_on_one_gpu_match_one_rank_on_the_double_batch") else {
        return;
    };
    const STEPS: usize = 6;
    let (x, y) = dataset(2 * 8 * STEPS);
    let want = plain_reference(7, 0.1, STEPS, |k| batch(&x, &y, k * 16..(k + 1) * 16));
    let got = run_ranks(2, |rank, pg| {
        let (vm, _) = model(7 + rank as u64, HID);
        let (vm, m) = on_device(&vm, &dev);
        let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
        assert!(ddp.reducer().is_device_bucket(0), "buckets on the GPU");
        let mut opt = SGD::new(ddp.all_vars(), 0.1).unwrap();
        let s1 = |t: &Tensor| m.stage1(t);
        let s2 = |t: &Tensor| m.stage2(t);
        let s3 = |t: &Tensor| m.stage3(t);
        let stages: [&dyn Module; 3] = [&s1, &s2, &s3];
        let mut history = Vec::new();
        for k in 0..STEPS {
            let start = k * 16 + rank * 8;
            let (xs, ys) = to_dev(batch(&x, &y, start..start + 8), &dev);
            let grads = if k % 2 == 0 {
                let loss = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
                ddp.backward(&loss).unwrap()
            } else {
                ddp.forward_backward_blockwise(&stages, &xs, |o| {
                    candle_nn::loss::cross_entropy(o, &ys)
                })
                .unwrap()
                .grads
            };
            opt.step(&grads).unwrap();
            assert_eq!(ddp.replica_max_diff().unwrap(), 0.0, "step {k}");
            history.push(params(&ddp));
        }
        history
    });
    for k in 0..STEPS {
        assert_eq!(got[0][k], got[1][k], "step {k}: replicas differ");
        assert_close(&got[0][k], &want[k], 1e-5, &format!("step {k}"));
    }
}

/// One rank on the GPU (NCCL when libnccl loads, else staged): the same parameters as plain
/// candle on the CPU to 1e-5, and a NaN gradient stops the step naming the parameter.
#[test]
fn one_rank_on_the_gpu_matches_plain_candle_and_checks_finiteness() {
    let Some(dev) = gpu("one_rank_on_the_gpu_matches_plain_candle_and_checks_finiteness") else {
        return;
    };
    const STEPS: usize = 4;
    let (x, y) = dataset(16 * STEPS);
    let want = plain_reference(3, 0.1, STEPS, |k| batch(&x, &y, k * 16..(k + 1) * 16));
    run_ranks(1, |_, pg| {
        let (vm, _) = model(3, HID);
        let (vm, m) = on_device(&vm, &dev);
        let opts = DdpOptions {
            check_finite: true,
            ..Default::default()
        };
        let mut ddp = Ddp::new(&vm, &pg, opts).unwrap();
        let mut opt = SGD::new(ddp.all_vars(), 0.1).unwrap();
        for (k, want) in want.iter().enumerate() {
            let (xs, ys) = to_dev(batch(&x, &y, k * 16..(k + 1) * 16), &dev);
            let loss = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
            opt.step(&ddp.backward(&loss).unwrap()).unwrap();
            assert_close(&params(&ddp), want, 1e-5, &format!("step {k}"));
        }
        let (xs, ys) = to_dev(batch(&x, &y, 0..16), &dev);
        let nan = (xs.ones_like().unwrap() * f64::NAN).unwrap();
        let loss = candle_nn::loss::cross_entropy(&m.forward(&nan).unwrap(), &ys).unwrap();
        let e = ddp.backward(&loss).unwrap_err().to_string();
        assert!(e.contains("non-finite") && e.contains("rank 0"), "{e}");
    });
}
