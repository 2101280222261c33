//! What the hook tests share: a small model of named `f32` parameters (the framework side,
//! implementing `ParamAccess`), its reducer and the threads-as-ranks runner.

#![allow(dead_code)] // each test file uses a part

use ddp_comm::{DType, ProcessGroup};
use ddp_core::adapter::ParamAccess;
use ddp_core::reducer::{HostBuffer, HostSlice, ParamSpec, Reducer, ReducerOptions};
use std::cell::RefCell;

const MIB: f64 = 1024.0 * 1024.0;

/// Small buckets, so that a model has several.
pub fn small_buckets() -> ReducerOptions {
    ReducerOptions {
        bucket_cap_mb: 256.0 / MIB,
        first_bucket_cap_mb: 128.0 / MIB,
    }
}

/// A model of matrices (compressible by PowerSGD), vectors, a scalar and a zero-size tensor.
pub fn model_specs() -> Vec<ParamSpec> {
    [
        ("a", vec![8, 6]),
        ("b", vec![6]),
        ("c", vec![5, 7]),
        ("d", vec![1]),
        ("e", vec![0, 3]),
        ("f", vec![12, 3, 2]),
    ]
    .into_iter()
    .map(|(n, s)| ParamSpec::new(n, s, DType::F32))
    .collect()
}

/// A deterministic pseudo-random number in [-1, 1).
pub fn noise(a: u64, b: u64, c: u64, d: u64) -> f32 {
    let mut x = a
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add(b.wrapping_mul(0xbf58_476d_1ce4_e5b9))
        .wrapping_add(c.wrapping_mul(0x94d0_49bb_1331_11eb))
        .wrapping_add(d)
        .wrapping_add(1);
    x ^= x >> 31;
    x = x.wrapping_mul(0xd6e8_feb8_6659_fd93);
    x ^= x >> 29;
    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Named `f32` parameters of `model_specs()` (the framework side of the tests).
pub struct Model {
    pub specs: Vec<ParamSpec>,
    pub vals: Vec<RefCell<Vec<f32>>>,
}

impl Model {
    pub fn new() -> Model {
        let specs = model_specs();
        let vals = specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                RefCell::new(
                    (0..s.numel())
                        .map(|k| noise(7, i as u64, k as u64, 0))
                        .collect(),
                )
            })
            .collect();
        Model { specs, vals }
    }

    pub fn values(&self) -> Vec<Vec<f32>> {
        self.vals.iter().map(|v| v.borrow().clone()).collect()
    }

    /// Gradient of 0.5·|w − target(rank, step)|² + w⁴/16: nonlinear in the parameters, so local
    /// SGD equals DDP (up to rounding) with period 1 only.
    pub fn grads(&self, rank: usize, step: u64) -> Vec<Vec<f32>> {
        self.vals
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.borrow()
                    .iter()
                    .enumerate()
                    .map(|(k, w)| {
                        w + 0.25 * w * w * w - noise(rank as u64, step, i as u64, k as u64)
                    })
                    .collect()
            })
            .collect()
    }

    pub fn sgd(&self, grads: &[Vec<f32>], lr: f32) {
        for (v, g) in self.vals.iter().zip(grads) {
            for (w, g) in v.borrow_mut().iter_mut().zip(g) {
                *w -= lr * g;
            }
        }
    }
}

impl ParamAccess for Model {
    type Grads = Vec<Vec<f32>>;
    type Error = ddp_core::Error;
    fn param_count(&self) -> usize {
        self.specs.len()
    }
    fn spec(&self, i: usize) -> ddp_core::Result<ParamSpec> {
        Ok(self.specs[i].clone())
    }
    fn with_grad<R>(
        &self,
        grads: &Self::Grads,
        i: usize,
        f: impl FnOnce(HostSlice<'_>) -> R,
    ) -> ddp_core::Result<Option<R>> {
        Ok(grads.get(i).map(|g| f(HostSlice::of(&g[..]))))
    }
    fn put_grad(&self, out: &mut Self::Grads, i: usize, g: HostSlice<'_>) -> ddp_core::Result<()> {
        out.resize(self.specs.len(), Vec::new());
        out[i] = g.get::<f32>().unwrap().to_vec();
        Ok(())
    }
    fn read_param(&self, i: usize) -> ddp_core::Result<HostBuffer> {
        Ok(HostBuffer::from(self.vals[i].borrow().clone()))
    }
    fn write_param(&self, i: usize, v: HostSlice<'_>) -> ddp_core::Result<()> {
        *self.vals[i].borrow_mut() = v.get::<f32>().unwrap().to_vec();
        Ok(())
    }
}

/// Hands `grads` to the reducer (backward order), finishes, returns the averaged gradients.
pub fn sync(red: &mut Reducer, model: &Model, grads: &[Vec<f32>]) -> Vec<Vec<f32>> {
    ddp_core::adapter::mark_grads(model, red, &mut grads.to_vec(), |_, _| Ok(())).unwrap();
    red.finish().unwrap();
    ddp_core::adapter::averaged_grads(model, red).unwrap()
}

pub fn reducer(pg: &ProcessGroup, model: &Model) -> Reducer {
    let specs = ddp_core::adapter::param_specs(model).unwrap();
    Reducer::new(pg, specs, small_buckets()).unwrap()
}

pub fn run<R: Send>(world: usize, f: impl Fn(ProcessGroup) -> R + Sync) -> Vec<R> {
    ddp_comm::testing::run_ranks(world, f)
}

pub fn mean_over_ranks(world: usize, f: impl Fn(usize) -> Vec<Vec<f32>>) -> Vec<Vec<f64>> {
    let all: Vec<_> = (0..world).map(f).collect();
    (0..all[0].len())
        .map(|i| {
            (0..all[0][i].len())
                .map(|k| all.iter().map(|g| g[i][k] as f64).sum::<f64>() / world as f64)
                .collect()
        })
        .collect()
}

pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(x, y)| (*x as f64 - y).abs()))
        .fold(0.0, f64::max)
}
