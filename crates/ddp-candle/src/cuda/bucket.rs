//! [`CudaBucket`]: the CUDA implementation of `ddp_core::reducer::DeviceBucket`.
//!
//! A flat `CudaSlice` per bucket on candle's device. Copies (flatten: a gradient into its
//! segment; unflatten: a segment into a new gradient tensor) are device-to-device on candle's
//! stream. The rarer arithmetic — accumulating under `no_sync`, dividing by a Join divisor, the
//! finite check — runs candle's own kernels on a device copy of the segment. All-reduce goes
//! through the bucket's [`CudaGroup`], which gives the buffer back when done.
//!
//! The trait's infallible methods `zero_range` and `div_by` keep the first CUDA error and
//! report it from the next fallible call (`write*`, `all_reduce`) naming the operation;
//! `first_nonfinite` logs it and reports the segment as non-finite (so the finite check fails
//! the step naming the parameter); `to_host` (host copies, not used by the candle adapter on
//! this path) panics with the driver's message.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DriverError};
use candle_core::cuda_backend::CudaDevice;
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, Storage, Tensor};
use ddp_comm::cuda::{CudaGroup, CudaWork};
use ddp_comm::{DType, ProcessGroup, ReduceOp};
use ddp_core::reducer::{
    BucketBuffer, BucketWork, CudaView, DeviceBucket, DeviceSlice, HostBuffer, HostSlice,
    PendingBucket,
};
use half::{bf16, f16};
use std::sync::Arc;

/// The flat device buffer of one bucket, per float dtype.
enum Buf {
    F32(CudaSlice<f32>),
    F64(CudaSlice<f64>),
    F16(CudaSlice<f16>),
    BF16(CudaSlice<bf16>),
}

/// `$body` once per dtype with `$s` bound to the typed slice of `$buf` and `$V` the variant name.
macro_rules! each {
    ($buf:expr, |$s:ident, $V:ident| $body:expr) => {
        match $buf {
            Buf::F32($s) => {
                #[allow(unused_imports)]
                use Buf::F32 as $V;
                $body
            }
            Buf::F64($s) => {
                #[allow(unused_imports)]
                use Buf::F64 as $V;
                $body
            }
            Buf::F16($s) => {
                #[allow(unused_imports)]
                use Buf::F16 as $V;
                $body
            }
            Buf::BF16($s) => {
                #[allow(unused_imports)]
                use Buf::BF16 as $V;
                $body
            }
        }
    };
}

/// A gradient bucket in CUDA memory (see the module doc).
pub struct CudaBucket {
    buf: Buf,
    dev: CudaDevice,
    group: Arc<CudaGroup>,
    /// The first CUDA error of an infallible trait method, reported by the next fallible one.
    deferred: Option<String>,
}

impl std::fmt::Debug for CudaBucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBucket")
            .field("dtype", &self.dtype())
            .field("len", &self.len())
            .field("group", &self.group)
            .finish()
    }
}

fn cuda_err(what: &str) -> impl Fn(DriverError) -> String + '_ {
    move |e| format!("CUDA {what} failed: {e}")
}

fn candle_err(what: &str) -> impl Fn(candle_core::Error) -> String + '_ {
    move |e| format!("{what} on the device failed: {e}")
}

impl CudaBucket {
    /// `n` zeros of `dtype` on `dev`, reduced over `group`.
    pub fn zeros(
        dev: &CudaDevice,
        group: Arc<CudaGroup>,
        dtype: DType,
        n: usize,
    ) -> crate::Result<CudaBucket> {
        let s = dev.cuda_stream();
        let buf = match dtype {
            DType::F32 => s.alloc_zeros::<f32>(n).map(Buf::F32),
            DType::F64 => s.alloc_zeros::<f64>(n).map(Buf::F64),
            DType::F16 => s.alloc_zeros::<f16>(n).map(Buf::F16),
            DType::BF16 => s.alloc_zeros::<bf16>(n).map(Buf::BF16),
            other => {
                return Err(crate::Error::Unsupported(format!(
                    "CUDA gradient buckets of {other} (float dtypes only)"
                )))
            }
        }
        .map_err(|e| {
            crate::Error::Unsupported(format!(
                "allocating a gradient bucket of {n} {dtype} on cuda:{}: {e}",
                group.device()
            ))
        })?;
        Ok(CudaBucket {
            buf,
            dev: dev.clone(),
            group,
            deferred: None,
        })
    }

    fn defer(&mut self, r: Result<(), String>) {
        if let (Err(e), None) = (r, &self.deferred) {
            self.deferred = Some(e);
        }
    }

    fn check_deferred(&self) -> Result<(), String> {
        match &self.deferred {
            Some(e) => Err(format!("an earlier operation on this bucket failed: {e}")),
            None => Ok(()),
        }
    }

    /// Elements `[start, start + len)` as a new candle tensor (a device copy).
    fn segment_tensor(&self, start: usize, len: usize) -> Result<Tensor, String> {
        let stream = self.dev.cuda_stream();
        let storage = each!(&self.buf, |s, V| {
            let copy = stream
                .clone_dtod(&s.slice(start..start + len))
                .map_err(cuda_err("copy"))?;
            CudaStorage::wrap_cuda_slice(copy, self.dev.clone())
        });
        Ok(Tensor::from_storage(
            Storage::Cuda(storage),
            len,
            BackpropOp::none(),
            false,
        ))
    }

    /// Copies the contiguous tensor `t` (of this bucket's dtype) into `[offset, offset + len)`.
    fn store_tensor(&mut self, offset: usize, t: &Tensor) -> Result<(), String> {
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            return Err("a device result not in CUDA memory".into());
        };
        let (a, b) = layout
            .contiguous_offsets()
            .ok_or("a non-contiguous device result")?;
        let stream = self.dev.cuda_stream();
        each!(&mut self.buf, |s, V| {
            let src = cs.as_cuda_slice().map_err(candle_err("reading a result"))?;
            stream
                .memcpy_dtod(&src.slice(a..b), &mut s.slice_mut(offset..offset + (b - a)))
                .map_err(cuda_err("copy"))
        })
    }

    /// `[offset, offset + len) += src` with candle's kernels.
    fn add_tensor(&mut self, offset: usize, src: &Tensor) -> Result<(), String> {
        let cur = self.segment_tensor(offset, src.elem_count())?;
        let sum = (cur + src).map_err(candle_err("accumulating a gradient"))?;
        self.store_tensor(offset, &sum)
    }

    fn view_tensor(&self, v: CudaView<'_>) -> Result<Tensor, String> {
        let n = v.len();
        let dev = candle_core::Device::Cuda(self.dev.clone());
        crate::cuda::tensor_from_view(v, &candle_core::Shape::from(n), &dev)
            .map_err(|e| e.to_string())
    }

    fn host_tensor(&self, src: HostSlice<'_>) -> Result<Tensor, String> {
        crate::tensors::tensor_from_host(
            src,
            &candle_core::Shape::from(src.len()),
            &candle_core::Device::Cuda(self.dev.clone()),
        )
        .map_err(|e| e.to_string())
    }
}

impl DeviceBucket for CudaBucket {
    fn dtype(&self) -> DType {
        match self.buf {
            Buf::F32(_) => DType::F32,
            Buf::F64(_) => DType::F64,
            Buf::F16(_) => DType::F16,
            Buf::BF16(_) => DType::BF16,
        }
    }

    fn len(&self) -> usize {
        each!(&self.buf, |s, V| s.len())
    }

    fn write(&mut self, offset: usize, src: HostSlice<'_>, add: bool) -> Result<(), String> {
        self.check_deferred()?;
        if src.dtype() != self.dtype() {
            return Err(format!(
                "{} data written into a {} bucket",
                src.dtype(),
                self.dtype()
            ));
        }
        let t = self.host_tensor(src)?;
        match add {
            true => self.add_tensor(offset, &t),
            false => self.store_tensor(offset, &t),
        }
    }

    fn write_device(
        &mut self,
        offset: usize,
        src: DeviceSlice<'_>,
        add: bool,
    ) -> Result<(), String> {
        self.check_deferred()?;
        let v = match src {
            DeviceSlice::Cpu(h) => return self.write(offset, h, add),
            DeviceSlice::Cuda(v) => v,
            other => return Err(format!("{} written into a CUDA bucket", other.describe())),
        };
        if add {
            let t = self.view_tensor(v)?;
            return self.add_tensor(offset, &t);
        }
        let stream = self.dev.cuda_stream();
        let (len, mine) = (v.len(), self.dtype());
        let copied = match (&mut self.buf, v) {
            (Buf::F32(d), CudaView::F32(v)) => {
                stream.memcpy_dtod(&v, &mut d.slice_mut(offset..offset + len))
            }
            (Buf::F64(d), CudaView::F64(v)) => {
                stream.memcpy_dtod(&v, &mut d.slice_mut(offset..offset + len))
            }
            (Buf::F16(d), CudaView::F16(v)) => {
                stream.memcpy_dtod(&v, &mut d.slice_mut(offset..offset + len))
            }
            (Buf::BF16(d), CudaView::BF16(v)) => {
                stream.memcpy_dtod(&v, &mut d.slice_mut(offset..offset + len))
            }
            (_, v) => return Err(format!("{} data written into a {mine} bucket", v.dtype())),
        };
        copied.map_err(cuda_err("copy of a gradient into its bucket"))
    }

    fn zero_range(&mut self, start: usize, len: usize) {
        let stream = self.dev.cuda_stream();
        let r = each!(&mut self.buf, |s, V| stream
            .memset_zeros(&mut s.slice_mut(start..start + len))
            .map_err(cuda_err("memset")));
        self.defer(r);
    }

    fn div_by(&mut self, n: usize) {
        let len = self.len();
        let r = self.segment_tensor(0, len).and_then(|t| {
            let q = t
                .affine(1.0 / n as f64, 0.0)
                .map_err(candle_err("dividing a bucket"))?;
            self.store_tensor(0, &q)
        });
        self.defer(r);
    }

    fn first_nonfinite(&self, start: usize, len: usize) -> Option<usize> {
        if len == 0 {
            return None;
        }
        // x * 0 is 0 for finite x and NaN otherwise: one scalar comes back per check.
        let r = self.segment_tensor(start, len).and_then(|t| {
            let probe = t
                .affine(0.0, 0.0)
                .and_then(|z| z.sum_all())
                .and_then(|s| s.to_dtype(candle_core::DType::F32))
                .and_then(|s| s.to_scalar::<f32>())
                .map_err(candle_err("the finite check"))?;
            if probe.is_finite() {
                return Ok(None);
            }
            let host = t
                .to_dtype(candle_core::DType::F32)
                .and_then(|h| h.to_vec1::<f32>())
                .map_err(candle_err("the finite check"))?;
            Ok(host.iter().position(|x| !x.is_finite()))
        });
        match r {
            Ok(found) => found,
            Err(e) => {
                tracing::error!("{e}; the segment is reported as non-finite");
                Some(0)
            }
        }
    }

    fn to_host(&self, start: usize, len: usize) -> HostBuffer {
        let stream = self.dev.cuda_stream();
        each!(&self.buf, |s, V| HostBuffer::from(
            stream
                .clone_dtoh(&s.slice(start..start + len))
                .unwrap_or_else(|e| panic!("CUDA copy of a gradient bucket to the host: {e}"))
        ))
    }

    fn all_reduce(self: Box<Self>, _pg: &ProcessGroup, op: ReduceOp) -> BucketWork {
        if let Err(e) = self.check_deferred() {
            return BucketWork::ready(Err(ddp_comm::Error::Internal(e)));
        }
        let CudaBucket {
            buf, dev, group, ..
        } = *self;
        each!(buf, |s, V| BucketWork::new(InFlight {
            work: group.all_reduce_async(s, op),
            wrap: V,
            dev,
            group: group.clone(),
        }))
    }

    fn device_range(&self, start: usize, len: usize) -> Option<DeviceSlice<'_>> {
        let r = start..start + len;
        Some(DeviceSlice::Cuda(match &self.buf {
            Buf::F32(s) => CudaView::F32(s.slice(r)),
            Buf::F64(s) => CudaView::F64(s.slice(r)),
            Buf::F16(s) => CudaView::F16(s.slice(r)),
            Buf::BF16(s) => CudaView::BF16(s.slice(r)),
        }))
    }
}

/// A bucket whose all-reduce is in flight on the device group.
struct InFlight<T> {
    work: CudaWork<CudaSlice<T>>,
    wrap: fn(CudaSlice<T>) -> Buf,
    dev: CudaDevice,
    group: Arc<CudaGroup>,
}

impl<T: Send + 'static> PendingBucket for InFlight<T> {
    fn wait(self: Box<Self>) -> ddp_comm::Result<BucketBuffer> {
        let s = self.work.wait()?;
        Ok(BucketBuffer::Device(Box::new(CudaBucket {
            buf: (self.wrap)(s),
            dev: self.dev,
            group: self.group,
            deferred: None,
        })))
    }
}
