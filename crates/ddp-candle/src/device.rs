//! Which device a worker trains on: `--device cpu|cuda` of the binaries, and
//! [`worker_device`], PyTorch's `torch.cuda.set_device(local_rank)`: rank `LOCAL_RANK` of a node
//! uses GPU `LOCAL_RANK % device_count`.
//!
//! ```no_run
//! # use candle_core::DType;
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let varmap = candle_nn::VarMap::new();
//! let device = ddp_candle::device::worker_device("cuda".parse()?)?;   // Device::Cuda(LOCAL_RANK % n)
//! let vb = candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &device);
//! # let _ = vb;
//! # Ok(())
//! # }
//! ```
//!
//! Built without the cargo feature `cuda`, asking for `cuda` is an error saying how to rebuild
//! ([`DeviceKind::check_built`]), before any worker starts.

use crate::{Error, Result};
use candle_core::Device;
use std::fmt;
use std::str::FromStr;

/// Whether this build of `ddp-candle` has the cargo feature `cuda` (candle on CUDA).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// A kind of device, as named on command lines (`cpu`, `cuda`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceKind {
    #[default]
    Cpu,
    Cuda,
}

impl FromStr for DeviceKind {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda),
            other => Err(format!("unknown device '{other}' (cpu or cuda)")),
        }
    }
}

impl fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        })
    }
}

impl DeviceKind {
    /// Errors when this build cannot use the device (`cuda` without the cargo feature), saying
    /// how to rebuild.
    pub fn check_built(self, program: &str) -> Result<()> {
        match self {
            DeviceKind::Cuda if !CUDA_BUILT => Err(Error::Unsupported(format!(
                "--device cuda: this {program} was built without the `cuda` feature; rebuild with \
                 `cargo build --release --features cuda -p {program}` (nvcc needed at build \
                 time: see the README's GPU section)"
            ))),
            _ => Ok(()),
        }
    }
}

/// This worker's device: the CPU, or GPU `LOCAL_RANK % device_count` (`LOCAL_RANK` from the
/// launcher, 0 without one), like `torch.cuda.set_device(local_rank)`.
pub fn worker_device(kind: DeviceKind) -> Result<Device> {
    let local_rank = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0);
    device_for_local_rank(kind, local_rank)
}

/// The device of local rank `local_rank` (see [`worker_device`]).
pub fn device_for_local_rank(kind: DeviceKind, local_rank: usize) -> Result<Device> {
    kind.check_built("binary")?;
    match kind {
        DeviceKind::Cpu => Ok(Device::Cpu),
        DeviceKind::Cuda => cuda_device(local_rank),
    }
}

#[cfg(feature = "cuda")]
fn cuda_device(local_rank: usize) -> Result<Device> {
    let count = crate::cuda::device_count()?;
    Ok(Device::new_cuda(local_rank % count)?)
}

#[cfg(not(feature = "cuda"))]
fn cuda_device(_local_rank: usize) -> Result<Device> {
    unreachable!("check_built refuses cuda without the feature")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print_back() {
        for k in [DeviceKind::Cpu, DeviceKind::Cuda] {
            assert_eq!(k.to_string().parse::<DeviceKind>().unwrap(), k);
        }
        let e = "gpu".parse::<DeviceKind>().unwrap_err();
        assert!(e.contains("unknown device 'gpu'"), "{e}");
        assert!(matches!(worker_device(DeviceKind::Cpu), Ok(Device::Cpu)));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_says_how_to_rebuild() {
        let e = device_for_local_rank(DeviceKind::Cuda, 0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("built without the `cuda` feature"), "{e}");
        assert!(e.contains("--features cuda"), "{e}");
    }
}
