//! Device buckets for candle parameters: the reducer's flat gradient buffers allocated where the
//! parameters live ([`DdpOptions::device_buckets`](crate::DdpOptions::device_buckets)).
//!
//! - CPU: [`ddp_core::reducer::CpuBucket`] (the device path on host memory, what the tests run).
//! - CUDA (feature `cuda`): `crate::cuda::CudaBucket`, reduced by a
//!   `ddp_comm::cuda::CudaGroup` of the same ranks (NCCL when every rank has its own GPU,
//!   relayed through host memory when ranks share one).
//!
//! Either way the reducer's state machine, hooks and finite check are the same code.

use crate::{Error, Result};
use candle_core::Device;
use ddp_comm::ProcessGroup;
use ddp_core::reducer::{CpuBucket, ParamSpec, Reducer, ReducerOptions};

/// A reducer whose buckets live on `device` (a collective: every rank calls it).
pub fn device_reducer(
    pg: &ProcessGroup,
    specs: Vec<ParamSpec>,
    opts: ReducerOptions,
    device: &Device,
) -> Result<Reducer> {
    match device {
        Device::Cpu => Ok(Reducer::with_buffers(pg, specs, opts, |b| {
            CpuBucket::zeros(b.dtype, b.numel)
        })?),
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => crate::cuda::cuda_reducer(pg, specs, opts, dev),
        other => Err(Error::Unsupported(format!(
            "device buckets on {:?}: this build of ddp-candle has {} (rebuild with the cargo \
             feature `cuda` for GPUs)",
            other.location(),
            if crate::device::CUDA_BUILT {
                "CUDA buckets only"
            } else {
                "no GPU support"
            }
        ))),
    }
}
