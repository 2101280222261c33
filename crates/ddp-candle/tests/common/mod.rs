//! Shared by the candle adapter's tests: ranks as threads, a small 3-stage MLP with seeded
//! parameters, a synthetic classification dataset, and parameter comparisons.
#![allow(dead_code)]

use candle_core::{Device, Module, Tensor, Var};
use candle_nn::{Linear, VarMap};
use ddp_candle::{Ddp, DdpOptions};
use ddp_comm::ProcessGroup;
use rand::{Rng, SeedableRng};

pub mod zero;

pub const IN: usize = 12;
pub const HID: usize = 24;
pub const OUT: usize = 5;

/// Runs `f(rank, pg)` on `world` threads, each with its own process group; results by rank.
pub fn run_ranks<R: Send>(world: usize, f: impl Fn(usize, ProcessGroup) -> R + Sync) -> Vec<R> {
    ddp_comm::testing::run_ranks(world, |pg| f(pg.rank(), pg))
}

pub struct Mlp {
    pub l1: Linear,
    pub l2: Linear,
    pub l3: Linear,
}

impl Mlp {
    pub fn stage1(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l1.forward(x)?.relu()
    }
    pub fn stage2(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l2.forward(x)?.tanh()
    }
    pub fn stage3(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l3.forward(x)
    }
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.stage3(&self.stage2(&self.stage1(x)?)?)
    }
}

/// A 3-layer MLP whose parameters are drawn from `seed`, registered in a new `VarMap`.
pub fn model(seed: u64, hidden: usize) -> (VarMap, Mlp) {
    let vm = VarMap::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut lin = |name: &str, i: usize, o: usize| {
        let mut var = |shape: &[usize]| {
            let n: usize = shape.iter().product();
            let d: Vec<f32> = (0..n).map(|_| rng.gen_range(-0.5..0.5)).collect();
            Var::from_tensor(&Tensor::from_vec(d, shape, &Device::Cpu).unwrap()).unwrap()
        };
        let w = var(&[o, i]);
        let b = var(&[o]);
        let mut data = vm.data().lock().unwrap();
        data.insert(format!("{name}.weight"), w.clone());
        data.insert(format!("{name}.bias"), b.clone());
        Linear::new(w.as_tensor().clone(), Some(b.as_tensor().clone()))
    };
    let l1 = lin("l1", IN, hidden);
    let l2 = lin("l2", hidden, hidden);
    let l3 = lin("l3", hidden, OUT);
    (vm, Mlp { l1, l2, l3 })
}

/// `n` samples of a fixed synthetic classification task.
pub fn dataset(n: usize) -> (Vec<f32>, Vec<u32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(99);
    let x: Vec<f32> = (0..n * IN).map(|_| rng.gen_range(-1.0..1.0)).collect();
    let y: Vec<u32> = (0..n).map(|_| rng.gen_range(0..OUT as u32)).collect();
    (x, y)
}

pub fn batch(x: &[f32], y: &[u32], range: std::ops::Range<usize>) -> (Tensor, Tensor) {
    let n = range.len();
    let xs =
        Tensor::from_slice(&x[range.start * IN..range.end * IN], (n, IN), &Device::Cpu).unwrap();
    let ys = Tensor::from_slice(&y[range], n, &Device::Cpu).unwrap();
    (xs, ys)
}

/// Parameters as `name -> values`, sorted by name.
pub fn params(ddp: &Ddp) -> Vec<(String, Vec<f32>)> {
    ddp.named_vars()
        .iter()
        .map(|(n, v)| {
            (
                n.clone(),
                v.as_tensor().flatten_all().unwrap().to_vec1().unwrap(),
            )
        })
        .collect()
}

pub fn grads_of(ddp: &Ddp, g: &candle_core::backprop::GradStore) -> Vec<Vec<f32>> {
    ddp.named_vars()
        .iter()
        .map(|(_, v)| {
            g.get(v.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        })
        .collect()
}

pub fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

pub fn tiny_buckets() -> DdpOptions {
    // ~1 KiB buckets: this model's gradients spread over several buckets, exercising pipelining.
    DdpOptions {
        bucket_cap_mb: 1.0 / 1024.0,
        first_bucket_cap_mb: 0.5 / 1024.0,
        ..Default::default()
    }
}

/// A `VarMap`'s parameters as `name -> values`, sorted by name (as [`params`] lists a `Ddp`'s).
pub fn varmap_params(vm: &VarMap) -> Vec<(String, Vec<f32>)> {
    let mut v: Vec<(String, Vec<f32>)> = vm
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| {
            let t = v.as_tensor().to_dtype(candle_core::DType::F32).unwrap();
            (n.clone(), t.flatten_all().unwrap().to_vec1().unwrap())
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// The reference, in plain candle with no ddp-rs code: `model(seed, HID)` trained for `steps`
/// steps of `candle_nn::SGD` (`lr`), step `k` on the whole global batch `batch_of(k)` (the
/// union of the ranks' batches: the mean loss over it is the mean of equal-sized ranks' means),
/// through `loss.backward()`. Returns the parameters after every step.
pub fn plain_reference(
    seed: u64,
    lr: f64,
    steps: usize,
    batch_of: impl Fn(usize) -> (Tensor, Tensor),
) -> Vec<Vec<(String, Vec<f32>)>> {
    use candle_nn::Optimizer;
    let (vm, m) = model(seed, HID);
    let mut opt = candle_nn::SGD::new(vm.all_vars(), lr).unwrap();
    (0..steps)
        .map(|k| {
            let (xs, ys) = batch_of(k);
            let loss = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
            opt.step(&loss.backward().unwrap()).unwrap();
            varmap_params(&vm)
        })
        .collect()
}

/// `got` and `want` (name -> values) within relative difference `tol` per parameter.
pub fn assert_close(got: &[(String, Vec<f32>)], want: &[(String, Vec<f32>)], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: parameter count");
    for ((name, a), (wname, b)) in got.iter().zip(want) {
        assert_eq!(name, wname, "{what}: parameter names");
        let d = rel_diff(a, b);
        assert!(d <= tol, "{what} `{name}`: relative difference {d:e}");
    }
}

/// The first CUDA device, or `None` after printing why a GPU test cannot run here (no `cuda`
/// feature, no driver or no device). Under `DDP_TEST_REQUIRE_ALL=1` a missing GPU fails the
/// test instead of skipping it.
pub fn gpu(test: &str) -> Option<Device> {
    let reason =
        match ddp_candle::device::device_for_local_rank(ddp_candle::device::DeviceKind::Cuda, 0) {
            Ok(d) => return Some(d),
            Err(e) => e.to_string(),
        };
    if std::env::var("DDP_TEST_REQUIRE_ALL").is_ok_and(|v| v == "1") {
        panic!("{test}: needs a GPU (DDP_TEST_REQUIRE_ALL=1): {reason}");
    }
    // Past the harness's output capture, so that `cargo test` shows the skip too.
    let _ = std::io::Write::write_all(
        &mut std::io::stderr().lock(),
        format!("SKIPPED {test}: needs a GPU: {reason}\n").as_bytes(),
    );
    None
}
