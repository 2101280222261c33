//! candle on CUDA (cargo feature `cuda`): the reducer's buckets in device memory
//! ([`CudaBucket`]), all-reduced by a [`CudaGroup`] of the DDP process group's ranks, and the
//! conversions between candle's CUDA tensors and the reducer's
//! [`DeviceSlice`](ddp_core::reducer::DeviceSlice)s.
//!
//! ```text
//!  candle backward (compute stream) ── grad ──memcpy_dtod──▶ CudaBucket (flat, device)
//!                                                                 │ bucket full: all_reduce_async
//!                                    comm stream (waits on an event of the compute stream):
//!                                    NCCL (every rank its own GPU) or host relay (shared GPU)
//!                                                                 │ finish(): wait
//!  optimizer ◀── averaged grad tensor ◀──clone_dtod── view of the bucket
//! ```
//!
//! Everything is queued on candle's stream of the device (the compute stream handed to the
//! `CudaGroup`), so each copy runs after the kernels that produced its gradient and the
//! collectives are ordered against both with CUDA events; the host only blocks in `finish`.
//! Under the blockwise backward the buckets of later blocks are on the wire while earlier blocks
//! still compute.

mod bucket;

pub use bucket::CudaBucket;

use crate::{Error, Result};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::CudaSlice;
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType, Device, Shape, Storage, Tensor};
use ddp_comm::cuda::{CudaGroup, CudaOptions};
use ddp_comm::ProcessGroup;
use ddp_core::reducer::{CudaView, DeviceSlice, ParamSpec, Reducer, ReducerOptions};
use std::sync::Arc;

/// Number of CUDA devices visible to this process (a missing libcuda is an error naming it).
pub fn device_count() -> Result<usize> {
    let n = ddp_comm::cuda::device_count()?;
    if n == 0 {
        return Err(Error::Unsupported(format!(
            "--device cuda: no CUDA device is visible (CUDA_VISIBLE_DEVICES={:?})",
            std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
        )));
    }
    Ok(n)
}

/// The device group of `pg` on candle's device `dev`, its collectives ordered against candle's
/// stream.
pub fn cuda_group(pg: &ProcessGroup, dev: &CudaDevice) -> Result<CudaGroup> {
    let opts = CudaOptions {
        device: Some(dev.cuda_stream().context().ordinal()),
        compute_stream: Some(dev.cuda_stream()),
        ..Default::default()
    };
    Ok(CudaGroup::new(pg, opts)?)
}

/// A reducer whose buckets are [`CudaBucket`]s on `dev`, reduced over a new [`CudaGroup`] of
/// `pg`'s ranks (a collective).
pub fn cuda_reducer(
    pg: &ProcessGroup,
    specs: Vec<ParamSpec>,
    opts: ReducerOptions,
    dev: &CudaDevice,
) -> Result<Reducer> {
    let group = Arc::new(cuda_group(pg, dev)?);
    if pg.rank() == 0 {
        tracing::info!(
            "DDP gradient buckets on cuda:{}: {}",
            group.device(),
            group.topology()
        );
    }
    // Allocate every bucket first so that an allocation failure is an error, not a panic.
    let assignment = ddp_core::reducer::compute_bucket_assignment(&specs, &opts);
    let mut buffers = Vec::with_capacity(assignment.len());
    for params in &assignment {
        let numel = params.iter().map(|&p| specs[p].numel()).sum();
        let dtype = specs[params[0]].dtype;
        buffers.push(CudaBucket::zeros(dev, group.clone(), dtype, numel)?);
    }
    let mut buffers = buffers.into_iter();
    Ok(Reducer::with_buffers(pg, specs, opts, |_| {
        ddp_core::reducer::BucketBuffer::Device(Box::new(
            buffers
                .next()
                .expect("one buffer per bucket of the same assignment"),
        ))
    })?)
}

/// Runs `f` on elements `[start, end)` of a CUDA tensor's storage as a device slice.
pub(crate) fn with_cuda_view<R>(
    cs: &CudaStorage,
    start: usize,
    end: usize,
    f: impl FnOnce(DeviceSlice<'_>) -> R,
) -> Result<R> {
    let view = match cs.dtype() {
        DType::F32 => CudaView::F32(cs.as_cuda_slice::<f32>()?.slice(start..end)),
        DType::F64 => CudaView::F64(cs.as_cuda_slice::<f64>()?.slice(start..end)),
        DType::F16 => CudaView::F16(cs.as_cuda_slice::<half::f16>()?.slice(start..end)),
        DType::BF16 => CudaView::BF16(cs.as_cuda_slice::<half::bf16>()?.slice(start..end)),
        other => {
            return Err(Error::Unsupported(format!(
                "CUDA tensors of dtype {other:?} are not supported (use f32, f64, f16 or bf16)"
            )))
        }
    };
    Ok(f(DeviceSlice::Cuda(view)))
}

/// A tensor of `shape` on `device` holding a device copy of `view`.
pub(crate) fn tensor_from_view(
    view: CudaView<'_>,
    shape: &Shape,
    device: &Device,
) -> Result<Tensor> {
    let Device::Cuda(dev) = device else {
        return Err(Error::Unsupported(format!(
            "a CUDA gradient for a parameter on {:?}",
            device.location()
        )));
    };
    let stream = dev.cuda_stream();
    let storage = match view {
        CudaView::F32(v) => wrap(stream.clone_dtod(&v), dev)?,
        CudaView::F64(v) => wrap(stream.clone_dtod(&v), dev)?,
        CudaView::F16(v) => wrap(stream.clone_dtod(&v), dev)?,
        CudaView::BF16(v) => wrap(stream.clone_dtod(&v), dev)?,
    };
    if storage.1 != shape.elem_count() {
        return Err(Error::Unsupported(format!(
            "a CUDA gradient of {} elements for a parameter of shape {shape:?}",
            storage.1
        )));
    }
    Ok(Tensor::from_storage(
        Storage::Cuda(storage.0),
        shape.clone(),
        BackpropOp::none(),
        false,
    ))
}

/// A fresh device copy as candle storage, with its length.
fn wrap<T: CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr>(
    copy: std::result::Result<CudaSlice<T>, candle_core::cuda_backend::cudarc::driver::DriverError>,
    dev: &CudaDevice,
) -> Result<(CudaStorage, usize)> {
    let copy = copy.map_err(|e| Error::Unsupported(format!("CUDA device copy failed: {e}")))?;
    let n = copy.len();
    Ok((CudaStorage::wrap_cuda_slice(copy, dev.clone()), n))
}
