//! Gradients in device memory: [`DeviceSlice`], the borrowed device counterpart of
//! [`HostSlice`] (defined in [`buffer`](super::buffer) beside the [`DeviceBucket`] trait that
//! takes it, re-exported here), and [`CpuBucket`], the CPU implementation of [`DeviceBucket`].
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

#[cfg(feature = "cuda")]
pub use super::buffer::CudaView;
pub use super::buffer::DeviceSlice;
use super::buffer::{BucketBuffer, BucketWork, DeviceBucket, HostBuffer, HostSlice};
use ddp_comm::{DType, ProcessGroup, ReduceOp};

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
