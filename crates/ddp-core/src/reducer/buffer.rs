//! Bucket buffers: one flat buffer per bucket, like c10d's one flat tensor per bucket.
//!
//! - [`HostBuffer`]: a closed enum over the host dtypes the collectives carry (`f32`, `f64`,
//!   `f16`, `bf16`, `i32`, `i64`, `u8`), with typed views ([`HostBuffer::as_slice`]) that check the
//!   dtype tag instead of downcasting; [`HostSlice`] is the borrowed form (a gradient handed over
//!   by a framework adapter, an averaged gradient read back).
//! - [`DeviceSlice`]: the borrowed device counterpart of [`HostSlice`] (a gradient in device
//!   memory; closed variants: `Cpu`, and `Cuda` (`CudaView`) with the cargo feature `cuda`).
//!   It lives here, beside the trait that takes it; the device path it serves is described in
//!   [`device`](super::device), which re-exports it.
//! - [`DeviceBucket`]: what a bucket living in device memory implements (a GPU/NCCL bucket is an
//!   addition: a type implementing this trait, allocated through
//!   [`Reducer::with_buffers`](super::Reducer::with_buffers)).
//!   Gradients that already live in device memory reach it as a [`DeviceSlice`]
//!   ([`DeviceBucket::write_device`]) and averaged gradients leave it the same way
//!   ([`DeviceBucket::device_range`]): flatten and unflatten on the device, no host round trip.
//!   [`CpuBucket`](super::CpuBucket) is the CPU implementation, so everything above the trait is
//!   tested on every machine; the CUDA one is in `ddp-candle` (feature `cuda`).
//! - [`BucketBuffer`]: either of the two, what the reducer and the comm hooks hold.
//! - [`BucketWork`]: a bucket whose reduction is in flight (what a comm hook returns, like the
//!   `Future` of PyTorch's hooks), with [`then`](BucketWork::then) to chain a step after it.

use ddp_comm::{DType, Element, ProcessGroup, ReduceOp, Work};
use half::{bf16, f16};
use std::marker::PhantomData;

/// Expands `$body` once per host dtype with `$v` bound to the typed payload of `$value` (an
/// expression of type `$Enum`, `&$Enum` or `&mut $Enum`).
macro_rules! each_host {
    ($Enum:ident, $value:expr, |$v:ident| $body:expr) => {
        match $value {
            $Enum::F32($v) => $body,
            $Enum::F64($v) => $body,
            $Enum::F16($v) => $body,
            $Enum::BF16($v) => $body,
            $Enum::I32($v) => $body,
            $Enum::I64($v) => $body,
            $Enum::U8($v) => $body,
        }
    };
}

/// Lists the host dtypes once for the enums and conversions below: `$m!(Variant, type)`.
macro_rules! host_dtypes {
    ($m:ident) => {
        $m!(F32, f32);
        $m!(F64, f64);
        $m!(F16, f16);
        $m!(BF16, bf16);
        $m!(I32, i32);
        $m!(I64, i64);
        $m!(U8, u8);
    };
}

/// A flat host buffer of one of the collective dtypes.
#[derive(Debug, Clone, PartialEq)]
pub enum HostBuffer {
    F32(Vec<f32>),
    F64(Vec<f64>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
}

/// A borrowed flat host slice of one of the collective dtypes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum HostSlice<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    I32(&'a [i32]),
    I64(&'a [i64]),
    U8(&'a [u8]),
}

macro_rules! conversions {
    ($variant:ident, $t:ty) => {
        impl From<Vec<$t>> for HostBuffer {
            fn from(v: Vec<$t>) -> Self {
                HostBuffer::$variant(v)
            }
        }
        impl<'a> From<&'a [$t]> for HostSlice<'a> {
            fn from(s: &'a [$t]) -> Self {
                HostSlice::$variant(s)
            }
        }
    };
}
host_dtypes!(conversions);

/// Finiteness of one element (integers are always finite).
trait Finite: Copy {
    fn finite(self) -> bool;
}

macro_rules! finite_float {
    ($($t:ty),*) => {$(impl Finite for $t { fn finite(self) -> bool { self.is_finite() } })*};
}
macro_rules! finite_int {
    ($($t:ty),*) => {$(impl Finite for $t { fn finite(self) -> bool { true } })*};
}
finite_float!(f32, f64, f16, bf16);
finite_int!(i32, i64, u8);

fn first_nonfinite<T: Finite>(s: &[T]) -> Option<usize> {
    s.iter().position(|x| !x.finite())
}

/// `dst[offset..]` = (or +=) `src`; false when the dtypes differ.
fn write_typed<T: Element>(dst: &mut [T], offset: usize, src: HostSlice<'_>, add: bool) -> bool {
    let Some(src) = src.get::<T>() else {
        return false;
    };
    let seg = &mut dst[offset..offset + src.len()];
    if add {
        T::reduce_into(seg, src, ReduceOp::Sum);
    } else {
        seg.copy_from_slice(src);
    }
    true
}

impl HostBuffer {
    /// `n` zeros of `dtype` with room for `n` rounded up to a multiple of `multiple` (a bucket
    /// of a group of `multiple` ranks: a sharding hook pads it to equal blocks in place instead
    /// of reallocating and copying it). One zeroed allocation (calloc's fresh pages need no
    /// pass of zeros), cut to `n`.
    pub fn zeros_padded(dtype: DType, n: usize, multiple: usize) -> HostBuffer {
        let mut b = HostBuffer::zeros(dtype, n.next_multiple_of(multiple.max(1)));
        b.truncate(n);
        b
    }

    /// `n` zeros of `dtype`.
    pub fn zeros(dtype: DType, n: usize) -> HostBuffer {
        match dtype {
            DType::F32 => HostBuffer::F32(vec![0.0; n]),
            DType::F64 => HostBuffer::F64(vec![0.0; n]),
            DType::F16 => HostBuffer::F16(vec![f16::ZERO; n]),
            DType::BF16 => HostBuffer::BF16(vec![bf16::ZERO; n]),
            DType::I32 => HostBuffer::I32(vec![0; n]),
            DType::I64 => HostBuffer::I64(vec![0; n]),
            DType::U8 => HostBuffer::U8(vec![0; n]),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.as_host_slice().dtype()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        each_host!(HostBuffer, self, |v| v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as `&[T]`; `None` unless `T` is this buffer's dtype.
    pub fn as_slice<T: Element>(&self) -> Option<&[T]> {
        self.as_host_slice().get()
    }

    /// The elements as `&mut [T]`; `None` unless `T` is this buffer's dtype.
    pub fn as_mut_slice<T: Element>(&mut self) -> Option<&mut [T]> {
        if T::DTYPE != self.dtype() {
            return None;
        }
        // Same dtype tag, hence the same type: the cast is the identity.
        Some(each_host!(HostBuffer, self, |v| bytemuck::cast_slice_mut(
            &mut v[..]
        )))
    }

    /// The borrowed form.
    pub fn as_host_slice(&self) -> HostSlice<'_> {
        each_host!(HostBuffer, self, |v| HostSlice::from(&v[..]))
    }

    /// Elements `[start, start + len)`, borrowed.
    pub fn range(&self, start: usize, len: usize) -> HostSlice<'_> {
        each_host!(HostBuffer, self, |v| HostSlice::from(
            &v[start..start + len]
        ))
    }

    /// Sets elements `[start, start + len)` to zero.
    pub fn zero_range(&mut self, start: usize, len: usize) {
        each_host!(HostBuffer, self, |v| v[start..start + len]
            .fill(bytemuck::Zeroable::zeroed()))
    }

    /// Keeps the first `n` elements (the capacity stays).
    pub fn truncate(&mut self, n: usize) {
        each_host!(HostBuffer, self, |v| v.truncate(n))
    }

    /// How many elements it can hold without reallocating.
    pub fn capacity(&self) -> usize {
        each_host!(HostBuffer, self, |v| v.capacity())
    }

    /// `n` elements: the first ones kept, new ones zero (no reallocation up to the capacity).
    pub fn resize(&mut self, n: usize) {
        each_host!(HostBuffer, self, |v| v
            .resize(n, bytemuck::Zeroable::zeroed()))
    }

    /// Divides every element by `n` (the end of an average).
    pub fn div_by(&mut self, n: usize) {
        each_host!(HostBuffer, self, |v| Element::div_by(&mut v[..], n))
    }

    /// Copies `src` into elements `[offset, offset + src.len())`, or adds it there with `add`.
    /// Errors if the dtypes differ.
    pub fn write(&mut self, offset: usize, src: HostSlice<'_>, add: bool) -> Result<(), String> {
        let ok = each_host!(HostBuffer, self, |v| write_typed(v, offset, src, add));
        match ok {
            true => Ok(()),
            false => Err(format!(
                "{} data written into a {} buffer",
                src.dtype(),
                self.dtype()
            )),
        }
    }

    /// Starts an async all-reduce of the whole buffer over `pg`.
    pub fn all_reduce(self, pg: &ProcessGroup, op: ReduceOp) -> BucketWork {
        macro_rules! arm {
            ($($variant:ident),*) => {
                match self {
                    $(HostBuffer::$variant(v) => BucketWork::from_work(
                        pg.all_reduce_async(v, op),
                        |v| BucketBuffer::Host(HostBuffer::$variant(v)),
                    ),)*
                }
            };
        }
        arm!(F32, F64, F16, BF16, I32, I64, U8)
    }
}

impl<'a> HostSlice<'a> {
    /// A typed slice in its enum form (`T` must be one of the collective dtypes, which every
    /// [`Element`] is).
    pub fn of<T: Element>(s: &'a [T]) -> HostSlice<'a> {
        // Each cast is from `T` to the type `T::DTYPE` names, i.e. to `T` itself.
        match T::DTYPE {
            DType::F32 => HostSlice::F32(bytemuck::cast_slice(s)),
            DType::F64 => HostSlice::F64(bytemuck::cast_slice(s)),
            DType::F16 => HostSlice::F16(bytemuck::cast_slice(s)),
            DType::BF16 => HostSlice::BF16(bytemuck::cast_slice(s)),
            DType::I32 => HostSlice::I32(bytemuck::cast_slice(s)),
            DType::I64 => HostSlice::I64(bytemuck::cast_slice(s)),
            DType::U8 => HostSlice::U8(bytemuck::cast_slice(s)),
        }
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            HostSlice::F32(_) => DType::F32,
            HostSlice::F64(_) => DType::F64,
            HostSlice::F16(_) => DType::F16,
            HostSlice::BF16(_) => DType::BF16,
            HostSlice::I32(_) => DType::I32,
            HostSlice::I64(_) => DType::I64,
            HostSlice::U8(_) => DType::U8,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        each_host!(HostSlice, self, |v| v.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements as `&[T]`; `None` unless `T` is this slice's dtype.
    pub fn get<T: Element>(self) -> Option<&'a [T]> {
        if T::DTYPE != self.dtype() {
            return None;
        }
        // Same dtype tag, hence the same type: the cast is the identity.
        Some(each_host!(HostSlice, self, |v| bytemuck::cast_slice(v)))
    }

    /// Index of the first NaN or infinite element.
    pub fn first_nonfinite(&self) -> Option<usize> {
        each_host!(HostSlice, self, |v| first_nonfinite(v))
    }

    /// An owned copy.
    pub fn to_buffer(&self) -> HostBuffer {
        each_host!(HostSlice, self, |v| HostBuffer::from(v.to_vec()))
    }
}

/// A borrowed, flat range of device memory of one of the collective dtypes.
#[derive(Debug)]
pub enum DeviceSlice<'a> {
    /// Host memory standing in for a device (what [`CpuBucket`](super::CpuBucket) takes).
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

/// A bucket buffer in device memory (a GPU bucket reduced with NCCL, say). The reducer copies
/// host gradients in with [`write`](Self::write), reads averaged gradients back with
/// [`to_host`](Self::to_host), and the default comm hook reduces it with
/// [`all_reduce`](Self::all_reduce).
pub trait DeviceBucket: Send + std::fmt::Debug {
    /// The element type.
    fn dtype(&self) -> DType;
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether the buffer has no elements.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `src` into elements `[offset, offset + src.len())`, or adds it there with `add`.
    fn write(&mut self, offset: usize, src: HostSlice<'_>, add: bool) -> Result<(), String>;
    /// Sets elements `[start, start + len)` to zero.
    fn zero_range(&mut self, start: usize, len: usize);
    /// Divides every element by `n`.
    fn div_by(&mut self, n: usize);
    /// Offset (from `start`) of the first NaN or infinite element in `[start, start + len)`.
    fn first_nonfinite(&self, start: usize, len: usize) -> Option<usize>;
    /// Elements `[start, start + len)` copied to host memory.
    fn to_host(&self, start: usize, len: usize) -> HostBuffer;
    /// Starts the all-reduce of the whole buffer (over `pg`, or a device communicator of the
    /// same ranks).
    fn all_reduce(self: Box<Self>, pg: &ProcessGroup, op: ReduceOp) -> BucketWork;
    /// Copies a gradient that lives in device memory into elements `[offset, offset +
    /// src.len())`, or adds it there with `add`, without a host round trip (the flatten of
    /// c10d's bucket view). By default only host data is taken: an error.
    fn write_device(
        &mut self,
        offset: usize,
        src: DeviceSlice<'_>,
        add: bool,
    ) -> Result<(), String> {
        let _ = (offset, add);
        Err(format!(
            "this device bucket takes host gradients only, not {}",
            src.describe()
        ))
    }
    /// Elements `[start, start + len)` as device memory (to unflatten averaged gradients on the
    /// device); `None` when this bucket offers no device view (the reducer then copies to host).
    fn device_range(&self, start: usize, len: usize) -> Option<DeviceSlice<'_>> {
        let _ = (start, len);
        None
    }
}

/// A bucket's flat buffer: host memory, or a device bucket.
#[derive(Debug)]
pub enum BucketBuffer {
    Host(HostBuffer),
    Device(Box<dyn DeviceBucket>),
}

impl BucketBuffer {
    pub fn dtype(&self) -> DType {
        match self {
            BucketBuffer::Host(h) => h.dtype(),
            BucketBuffer::Device(d) => d.dtype(),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            BucketBuffer::Host(h) => h.len(),
            BucketBuffer::Device(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The host buffer (`None` for a device bucket).
    pub fn as_host(&self) -> Option<&HostBuffer> {
        match self {
            BucketBuffer::Host(h) => Some(h),
            BucketBuffer::Device(_) => None,
        }
    }

    /// The host buffer, mutably (`None` for a device bucket).
    pub fn as_host_mut(&mut self) -> Option<&mut HostBuffer> {
        match self {
            BucketBuffer::Host(h) => Some(h),
            BucketBuffer::Device(_) => None,
        }
    }

    /// See [`HostBuffer::write`].
    pub fn write(&mut self, offset: usize, src: HostSlice<'_>, add: bool) -> Result<(), String> {
        match self {
            BucketBuffer::Host(h) => h.write(offset, src, add),
            BucketBuffer::Device(d) => d.write(offset, src, add),
        }
    }

    pub fn zero_range(&mut self, start: usize, len: usize) {
        match self {
            BucketBuffer::Host(h) => h.zero_range(start, len),
            BucketBuffer::Device(d) => d.zero_range(start, len),
        }
    }

    pub fn div_by(&mut self, n: usize) {
        match self {
            BucketBuffer::Host(h) => h.div_by(n),
            BucketBuffer::Device(d) => d.div_by(n),
        }
    }

    /// Copies (or with `add` adds) a device gradient into elements `[offset, offset +
    /// src.len())` of a device bucket (see [`DeviceBucket::write_device`]); an error for a host
    /// bucket.
    pub fn write_device(
        &mut self,
        offset: usize,
        src: DeviceSlice<'_>,
        add: bool,
    ) -> Result<(), String> {
        match self {
            BucketBuffer::Host(_) => Err(format!(
                "{} written into a host bucket (device gradients need device buckets)",
                src.describe()
            )),
            BucketBuffer::Device(d) => d.write_device(offset, src, add),
        }
    }

    /// Elements `[start, start + len)` as device memory (`None` for a host bucket, or a device
    /// bucket without device views).
    pub fn device_range(&self, start: usize, len: usize) -> Option<DeviceSlice<'_>> {
        match self {
            BucketBuffer::Host(_) => None,
            BucketBuffer::Device(d) => d.device_range(start, len),
        }
    }

    /// Offset (from `start`) of the first NaN or infinite element in `[start, start + len)`.
    pub fn first_nonfinite(&self, start: usize, len: usize) -> Option<usize> {
        match self {
            BucketBuffer::Host(h) => h.range(start, len).first_nonfinite(),
            BucketBuffer::Device(d) => d.first_nonfinite(start, len),
        }
    }

    /// Starts an async all-reduce of the whole buffer (what the default comm hook does).
    pub fn all_reduce(self, pg: &ProcessGroup, op: ReduceOp) -> BucketWork {
        match self {
            BucketBuffer::Host(h) => h.all_reduce(pg, op),
            BucketBuffer::Device(d) => d.all_reduce(pg, op),
        }
    }
}

/// What [`BucketWork`] waits on: anything that eventually yields the reduced buffer.
pub trait PendingBucket: Send {
    fn wait(self: Box<Self>) -> ddp_comm::Result<BucketBuffer>;
}

/// A bucket whose reduction is in flight (PyTorch's hook `Future`); [`wait`](Self::wait) yields
/// the reduced buffer.
pub struct BucketWork(Box<dyn PendingBucket>);

struct Ready(ddp_comm::Result<BucketBuffer>);

impl PendingBucket for Ready {
    fn wait(self: Box<Self>) -> ddp_comm::Result<BucketBuffer> {
        self.0
    }
}

struct FromWork<T> {
    work: Work<T>,
    wrap: fn(T) -> BucketBuffer,
}

impl<T: Send + 'static> PendingBucket for FromWork<T> {
    fn wait(self: Box<Self>) -> ddp_comm::Result<BucketBuffer> {
        self.work.wait().map(self.wrap)
    }
}

struct Then<F> {
    first: BucketWork,
    f: F,
}

impl<F> PendingBucket for Then<F>
where
    F: FnOnce(BucketBuffer) -> ddp_comm::Result<BucketBuffer> + Send,
{
    fn wait(self: Box<Self>) -> ddp_comm::Result<BucketBuffer> {
        (self.f)(self.first.wait()?)
    }
}

impl BucketWork {
    /// Work that waits on `pending`.
    pub fn new(pending: impl PendingBucket + 'static) -> BucketWork {
        BucketWork(Box::new(pending))
    }

    /// Work that is already done (a hook that reduced synchronously, or failed).
    pub fn ready(result: ddp_comm::Result<BucketBuffer>) -> BucketWork {
        BucketWork::new(Ready(result))
    }

    /// A `ddp_comm` async collective whose result `wrap` turns into the bucket buffer.
    pub fn from_work<T: Send + 'static>(work: Work<T>, wrap: fn(T) -> BucketBuffer) -> BucketWork {
        BucketWork::new(FromWork { work, wrap })
    }

    /// Runs `f` on the buffer once this work completes (PyTorch's `fut.then`), e.g. a division
    /// or a decompression; runs inside [`wait`](Self::wait).
    pub fn then<F>(self, f: F) -> BucketWork
    where
        F: FnOnce(BucketBuffer) -> ddp_comm::Result<BucketBuffer> + Send + 'static,
    {
        BucketWork::new(Then { first: self, f })
    }

    /// Blocks until the reduced buffer is available.
    pub fn wait(self) -> ddp_comm::Result<BucketBuffer> {
        self.0.wait()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_views_check_the_dtype() {
        let mut b = HostBuffer::zeros(DType::F32, 4);
        assert_eq!(b.dtype(), DType::F32);
        assert!(b.as_slice::<f64>().is_none());
        b.write(1, HostSlice::of(&[1.0f32, f32::NAN]), false)
            .unwrap();
        b.write(1, HostSlice::of(&[2.0f32]), true).unwrap();
        assert!(b.write(0, HostSlice::of(&[1.0f64]), false).is_err());
        assert_eq!(b.as_slice::<f32>().unwrap()[..2], [0.0, 3.0]);
        assert_eq!(b.range(1, 3).first_nonfinite(), Some(1));
        assert_eq!(b.range(0, 2).first_nonfinite(), None);
        b.zero_range(2, 1);
        b.div_by(3);
        assert_eq!(b.as_slice::<f32>().unwrap(), &[0.0, 1.0, 0.0, 0.0]);
        let h = HostBuffer::from(vec![f16::INFINITY, f16::ONE]);
        assert_eq!(h.as_host_slice().first_nonfinite(), Some(0));
        assert_eq!(
            HostBuffer::from(vec![1i64])
                .as_host_slice()
                .first_nonfinite(),
            None
        );
    }
}
