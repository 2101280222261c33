//! Gradients in device memory: [`DeviceSlice`], the borrowed device counterpart of
//! [`HostSlice`], and [`CpuBucket`], the CPU implementation of [`DeviceBucket`].
//!
//! A framework adapter whose gradients live on a device hands them to the reducer as
//! `DeviceSlice`s ([`Reducer::mark_ready_device`](super::Reducer::mark_ready_device)); the
//! device bucket copies them into its flat buffer on the device (the flatten), the comm hook
//! reduces the bucket where it lives, and the adapter reads each averaged gradient back as a
//! `DeviceSlice` of the bucket ([`Reducer::with_device_grad`](super::Reducer::with_device_grad),
//! the unflatten):
//!
//! ```text
//!  framework grad (device) ──DeviceSlice──▶ DeviceBucket::write_device  (device → device copy)
//!                                               │ CommHook (NCCL / staged all-reduce)
//!  framework grad (device) ◀──DeviceSlice── DeviceBucket::device_range   (device → device copy)
//! ```
//!
//! The variants are closed (no downcasts): `Cpu` (host memory treated as a device: what
//! [`CpuBucket`] takes, so the device path runs in every test) and, with the cargo feature
//! `cuda`, `Cuda` (cudarc device views, the memory candle's CUDA tensors and
//! `ddp_comm::cuda::CudaGroup` share).

use super::buffer::{BucketBuffer, BucketWork, DeviceBucket, HostBuffer, HostSlice};
use ddp_comm::{DType, ProcessGroup, ReduceOp};
use std::marker::PhantomData;

/// A borrowed, flat range of device memory of one of the collective dtypes.
#[derive(Debug)]
pub enum DeviceSlice<'a> {
    /// Host memory standing in for a device (what [`CpuBucket`] takes).
    Cpu(HostSlice<'a>),
    /// CUDA device memory (a view into a cudarc `CudaSlice`).
    #[cfg(feature = "cuda")]
    Cuda(CudaView<'a>),
    #[doc(hidden)]
    _Lifetime(PhantomData<&'a ()>, std::convert::Infallible),
}

/// A view of CUDA device memory, one variant per float dtype a gradient can have.
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub enum CudaView<'a> {
    F32(cudarc::driver::CudaView<'a, f32>),
    F64(cudarc::driver::CudaView<'a, f64>),
    F16(cudarc::driver::CudaView<'a, half::f16>),
    BF16(cudarc::driver::CudaView<'a, half::bf16>),
}

#[cfg(feature = "cuda")]
impl CudaView<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            CudaView::F32(_) => DType::F32,
            CudaView::F64(_) => DType::F64,
            CudaView::F16(_) => DType::F16,
            CudaView::BF16(_) => DType::BF16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CudaView::F32(v) => v.len(),
            CudaView::F64(v) => v.len(),
            CudaView::F16(v) => v.len(),
            CudaView::BF16(v) => v.len(),
        }
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl DeviceSlice<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            DeviceSlice::Cpu(s) => s.dtype(),
            #[cfg(feature = "cuda")]
            DeviceSlice::Cuda(v) => v.dtype(),
            DeviceSlice::_Lifetime(_, never) => match *never {},
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            DeviceSlice::Cpu(s) => s.len(),
            #[cfg(feature = "cuda")]
            DeviceSlice::Cuda(v) => v.len(),
            DeviceSlice::_Lifetime(_, never) => match *never {},
        }
    }

    /// Whether the slice has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the memory is, for error messages: "a cpu f32 gradient of 12 elements".
    pub fn describe(&self) -> String {
        let place = match self {
            DeviceSlice::Cpu(_) => "cpu",
            #[cfg(feature = "cuda")]
            DeviceSlice::Cuda(_) => "cuda",
            DeviceSlice::_Lifetime(_, never) => match *never {},
        };
        format!(
            "a {place} {} gradient of {} elements",
            self.dtype(),
            self.len()
        )
    }
}

/// The CPU implementation of [`DeviceBucket`]: a host buffer behind the device-bucket trait,
/// taking [`DeviceSlice::Cpu`] gradients and reducing over the process group's own
/// collectives. It runs the device path of the reducer and of the adapters (flatten and
/// unflatten through `DeviceSlice`s, hooks over `BucketBuffer::Device`) on every machine, the
/// same code the CUDA bucket runs under.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuBucket(pub HostBuffer);

impl CpuBucket {
    /// `n` zeros of `dtype`, as a [`BucketBuffer::Device`].
    pub fn zeros(dtype: DType, n: usize) -> BucketBuffer {
        BucketBuffer::Device(Box::new(CpuBucket(HostBuffer::zeros(dtype, n))))
    }
}

impl DeviceBucket for CpuBucket {
    fn dtype(&self) -> DType {
        self.0.dtype()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn write(&mut self, offset: usize, src: HostSlice<'_>, add: bool) -> Result<(), String> {
        self.0.write(offset, src, add)
    }
    fn zero_range(&mut self, start: usize, len: usize) {
        self.0.zero_range(start, len)
    }
    fn div_by(&mut self, n: usize) {
        self.0.div_by(n)
    }
    fn first_nonfinite(&self, start: usize, len: usize) -> Option<usize> {
        self.0.range(start, len).first_nonfinite()
    }
    fn to_host(&self, start: usize, len: usize) -> HostBuffer {
        self.0.range(start, len).to_buffer()
    }
    fn all_reduce(self: Box<Self>, pg: &ProcessGroup, op: ReduceOp) -> BucketWork {
        self.0.all_reduce(pg, op).then(|b| match b {
            BucketBuffer::Host(h) => Ok(BucketBuffer::Device(Box::new(CpuBucket(h)))),
            device => Ok(device),
        })
    }
    fn write_device(
        &mut self,
        offset: usize,
        src: DeviceSlice<'_>,
        add: bool,
    ) -> Result<(), String> {
        match src {
            DeviceSlice::Cpu(s) => self.0.write(offset, s, add),
            other => Err(format!("{} written into a cpu bucket", other.describe())),
        }
    }
    fn device_range(&self, start: usize, len: usize) -> Option<DeviceSlice<'_>> {
        Some(DeviceSlice::Cpu(self.0.range(start, len)))
    }
}
