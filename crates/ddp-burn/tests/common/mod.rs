//! Shared by the Burn adapter's tests: ranks as threads (each with its own process group and real
//! TCP collectives), a small 3-layer MLP with seeded parameters written as a plain Burn module, a
//! synthetic classification task, and plain-Burn reference training (no ddp-rs code).
#![allow(dead_code)]

use burn::module::{Module, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, GradientsParams, ModuleOptimizer, SgdConfig};
use burn::tensor::{activation, Device, Int, Tensor, TensorData};
use ddp_comm::ProcessGroup;

pub const IN: usize = 12;
pub const HID: usize = 24;
pub const OUT: usize = 5;
pub const LR: f64 = 0.05;

/// Runs `f(rank, pg)` on `world` threads, each with its own process group; results by rank.
pub fn run_ranks<R: Send>(world: usize, f: impl Fn(usize, ProcessGroup) -> R + Sync) -> Vec<R> {
    ddp_comm::testing::run_ranks(world, |pg| f(pg.rank(), pg))
}

pub fn device() -> Device {
    Device::flex().autodiff()
}

#[derive(Module, Debug)]
pub struct Lin {
    /// `[in, out]`.
    pub weight: Param<Tensor<2>>,
    pub bias: Param<Tensor<1>>,
}

impl Lin {
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        x.matmul(self.weight.val()) + self.bias.val().unsqueeze_dim(0)
    }
}

#[derive(Module, Debug)]
pub struct Mlp {
    pub l1: Lin,
    pub l2: Lin,
    pub l3: Lin,
}

impl Mlp {
    pub fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        let h = activation::relu(self.l1.forward(x));
        let h = self.l2.forward(h).tanh();
        self.l3.forward(h)
    }

    pub fn loss(&self, x: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
        CrossEntropyLossConfig::new()
            .init(&x.device())
            .forward(self.forward(x), y)
    }

    /// Every parameter as `(path, values)`, in declaration order (read without ddp-rs).
    pub fn params(&self) -> Vec<(String, Vec<f32>)> {
        let mut out = Vec::new();
        for (name, l) in [("l1", &self.l1), ("l2", &self.l2), ("l3", &self.l3)] {
            out.push((format!("{name}.weight"), values(l.weight.val())));
            out.push((format!("{name}.bias"), values(l.bias.val())));
        }
        out
    }
}

pub fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.into_data().try_to_vec::<f32>().unwrap()
}

/// A 3-layer MLP whose parameters are drawn from `seed` (a small LCG, so every process agrees).
pub fn model(seed: u64, hidden: usize) -> Mlp {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    };
    let dev = device();
    let mut lin = |i: usize, o: usize| {
        let w: Vec<f32> = (0..i * o).map(|_| next()).collect();
        let b: Vec<f32> = (0..o).map(|_| next()).collect();
        Lin {
            weight: Param::from_data(TensorData::new(w, [i, o]), &dev),
            bias: Param::from_data(TensorData::new(b, [o]), &dev),
        }
    };
    Mlp {
        l1: lin(IN, hidden),
        l2: lin(hidden, hidden),
        l3: lin(hidden, OUT),
    }
}

/// `n` samples of a fixed synthetic classification task.
pub fn dataset(n: usize) -> (Vec<f32>, Vec<i64>) {
    let mut state = 99u64;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        state >> 33
    };
    let x: Vec<f32> = (0..n * IN)
        .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let y: Vec<i64> = (0..n).map(|_| (next() % OUT as u64) as i64).collect();
    (x, y)
}

pub fn batch(x: &[f32], y: &[i64], range: std::ops::Range<usize>) -> (Tensor<2>, Tensor<1, Int>) {
    let n = range.len();
    let dev = device();
    let xs = Tensor::from_data(
        TensorData::new(x[range.start * IN..range.end * IN].to_vec(), [n, IN]),
        &dev,
    );
    let ys = Tensor::from_data(TensorData::new(y[range].to_vec(), [n]), &dev);
    (xs, ys)
}

/// The optimizers of the equivalence tests.
#[derive(Debug, Clone, Copy)]
pub enum Opt {
    /// Plain SGD (no momentum).
    Sgd,
    SgdMomentum,
    Adam,
}

pub fn optimizer(kind: Opt) -> ModuleOptimizer {
    match kind {
        Opt::Sgd => SgdConfig::new().init(),
        Opt::SgdMomentum => SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
            .init(),
        Opt::Adam => AdamConfig::new().init(),
    }
}

/// Plain Burn (no ddp-rs code): `steps` optimizer steps of a model from `seed`, batch `k` from
/// `batch_of(k)`; the parameters after each step.
pub fn plain_reference(
    seed: u64,
    kind: Opt,
    steps: usize,
    batch_of: impl Fn(usize) -> (Tensor<2>, Tensor<1, Int>),
) -> Vec<Vec<(String, Vec<f32>)>> {
    let mut m = model(seed, HID);
    let mut opt = optimizer(kind);
    let mut history = Vec::new();
    for k in 0..steps {
        let (xs, ys) = batch_of(k);
        let grads = GradientsParams::from_grads(m.loss(xs, ys).backward(), &m);
        m = opt.step(LR, m, grads);
        history.push(m.params());
    }
    history
}

pub fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

pub fn assert_close(got: &[(String, Vec<f32>)], want: &[(String, Vec<f32>)], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for ((gn, g), (wn, w)) in got.iter().zip(want) {
        assert_eq!(gn, wn, "{what}");
        let d = rel_diff(g, w);
        assert!(
            d <= tol,
            "{what}: {gn} differs by {d:e} relative (tolerance {tol:e})"
        );
    }
}
