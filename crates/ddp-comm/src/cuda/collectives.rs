//! The collectives of [`CudaGroup`], all through one launcher, [`CudaGroup::collective`]
//! (PyTorch's `ProcessGroupNCCL::collective`): the collective as a [`DeviceOp`], its buffers
//! borrowed (blocking forms, which wait) or owned (`*_async` forms, whose [`CudaWork`] gives the
//! output back), then the relay path ([`crate::device::relay`]) or NCCL: one argument check and
//! fingerprint ([`DeviceOp::fingerprint`]), one NCCL dispatch ([`nccl_call`], in place where NCCL
//! allows) and the stream/event/watchdog plumbing once ([`CudaGroup::nccl`]).

use super::nccl::{nccl_dtype, nccl_op};
use super::relay::{Exclusive, Owned, Shared};
use super::{CudaElement, CudaGroup, CudaWork, Imp, Pending};
use crate::collectives::{forward_collectives, Collectives};
use crate::device::relay::{RelayGroup, RelayIo};
use crate::device::DeviceOp;
use crate::dtype::ReduceOp;
use crate::Result;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use cudarc::nccl::result::{self, NcclError};
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t};
use std::ffi::c_void;

/// The buffers of a blocking call.
enum Borrowed<'a, T> {
    /// One buffer, read and written (all_reduce, broadcast, reduce, recv).
    InPlace(&'a mut CudaSlice<T>),
    /// One buffer, only read (send).
    Source(&'a CudaSlice<T>),
    /// Input and output (all_gather, reduce_scatter).
    Split(&'a CudaSlice<T>, &'a mut CudaSlice<T>),
}

/// The buffers of an `*_async` call; the work gives back the one buffer, or the output.
enum Moved<T> {
    InPlace(CudaSlice<T>),
    Split(CudaSlice<T>, CudaSlice<T>),
}

/// What the launcher needs of a call's buffers.
trait Buffers<T: CudaElement> {
    /// What the work yields: `()` for borrowed buffers, the output for owned ones.
    type Out: Send + 'static;
    /// The buffers, borrowed.
    fn borrow(&mut self) -> Borrowed<'_, T>;
    /// Run `op` on the relay path: borrowed buffers at once, owned ones as a queued job.
    fn relay(self, g: &CudaGroup, s: &RelayGroup, op: DeviceOp) -> Result<CudaWork<Self::Out>>;
    /// What the work yields once NCCL has the buffers.
    fn out(self) -> Self::Out;
}

impl<T: CudaElement> Buffers<T> for Borrowed<'_, T> {
    type Out = ();

    fn borrow(&mut self) -> Borrowed<'_, T> {
        match self {
            Borrowed::InPlace(b) => Borrowed::InPlace(b),
            Borrowed::Source(b) => Borrowed::Source(b),
            Borrowed::Split(i, o) => Borrowed::Split(i, o),
        }
    }

    fn relay(self, g: &CudaGroup, s: &RelayGroup, op: DeviceOp) -> Result<CudaWork<()>> {
        let done = match self {
            Borrowed::InPlace(b) => s.run(op, RelayIo::InPlace(&mut g.on(Exclusive(b))?)),
            Borrowed::Source(b) => s.run(op, RelayIo::Source(&g.on(Shared(b))?)),
            Borrowed::Split(i, o) => s.run(
                op,
                RelayIo::Split(&g.on(Shared(i))?, &mut g.on(Exclusive(o))?),
            ),
        };
        Ok(CudaWork::ready(op.name(), done))
    }

    fn out(self) {}
}

impl<T: CudaElement> Buffers<T> for Moved<T> {
    type Out = CudaSlice<T>;

    fn borrow(&mut self) -> Borrowed<'_, T> {
        match self {
            Moved::InPlace(b) => Borrowed::InPlace(b),
            Moved::Split(i, o) => Borrowed::Split(i, o),
        }
    }

    fn relay(self, g: &CudaGroup, s: &RelayGroup, op: DeviceOp) -> Result<CudaWork<CudaSlice<T>>> {
        Ok(match self {
            Moved::InPlace(b) => CudaWork::host(s.spawn_in_place(op, g.on(Owned(b))?), |b| b.buf.0),
            Moved::Split(i, o) => CudaWork::host(
                s.spawn_split(op, g.on(Owned(i))?, g.on(Owned(o))?),
                |(_, o)| o.buf.0,
            ),
        })
    }

    fn out(self) -> CudaSlice<T> {
        match self {
            Moved::InPlace(b) | Moved::Split(_, b) => b,
        }
    }
}

/// Queue `op` on NCCL: `n` elements of `dtype` from `src` to `dst` (the same pointer in place).
///
/// # Safety
///
/// `src` and `dst` must point to live device memory of the communicator's device, holding what
/// `op` reads and writes for `n` (all_gather: `n` in, `n * size` out; reduce_scatter: `n * size`
/// in, `n` out; the others `n`), kept alive and unused by others until the collective is done.
unsafe fn nccl_call(
    op: DeviceOp,
    src: CUdeviceptr,
    dst: CUdeviceptr,
    n: usize,
    dtype: ncclDataType_t,
    comm: ncclComm_t,
    stream: cudaStream_t,
) -> std::result::Result<(), NcclError> {
    let (s, d) = (src as *const c_void, dst as *mut c_void);
    // SAFETY: the caller's contract: the pointers hold what the collective reads and writes.
    unsafe {
        match op {
            DeviceOp::AllReduce(o) => {
                result::all_reduce(s, d, n, dtype, nccl_op(o), comm, stream).map(drop)
            }
            DeviceOp::Broadcast { root } => {
                result::broadcast(s, d, n, dtype, root as i32, comm, stream).map(drop)
            }
            DeviceOp::Reduce { op, root } => {
                result::reduce(s, d, n, dtype, nccl_op(op), root as i32, comm, stream).map(drop)
            }
            DeviceOp::AllGather => result::all_gather(s, d, n, dtype, comm, stream).map(drop),
            DeviceOp::ReduceScatter(o) => {
                result::reduce_scatter(s, d, n, dtype, nccl_op(o), comm, stream).map(drop)
            }
            DeviceOp::Send { dst } => result::send(s, n, dtype, dst as i32, comm, stream).map(drop),
            DeviceOp::Recv { src } => result::recv(d, n, dtype, src as i32, comm, stream).map(drop),
        }
    }
}

impl CudaGroup {
    /// The one launcher: every collective, blocking or async, on either path.
    fn collective<T: CudaElement, B: Buffers<T>>(
        &self,
        op: DeviceOp,
        mut bufs: B,
    ) -> CudaWork<B::Out> {
        let launched = match &self.imp {
            Imp::Relay(s) => bufs.relay(self, s, op),
            Imp::Nccl { .. } => self
                .enqueue::<T>(op, bufs.borrow())
                .map(|p| p.with(bufs.out())),
        };
        launched.unwrap_or_else(|e| CudaWork::ready(op.name(), Err(e)))
    }

    /// Check `op`, then queue it on NCCL with the buffers' device pointers (cudarc orders the
    /// buffers' later uses after the comm stream when the pointers' guards drop, after the call).
    fn enqueue<T: CudaElement>(&self, op: DeviceOp, bufs: Borrowed<'_, T>) -> Result<Pending> {
        let (input, output) = match &bufs {
            Borrowed::InPlace(b) => (b.len(), b.len()),
            Borrowed::Source(b) => (b.len(), b.len()),
            Borrowed::Split(i, o) => (i.len(), o.len()),
        };
        let fp = op.fingerprint::<T>(&self.pg, input, output)?;
        let stream = &*self.comm_stream;
        let (src, dst, _guards) = match bufs {
            Borrowed::InPlace(b) => {
                let (p, g) = b.device_ptr_mut(stream);
                (p, p, [Some(g), None])
            }
            Borrowed::Source(b) => {
                let (p, g) = b.device_ptr(stream);
                (p, p, [Some(g), None])
            }
            Borrowed::Split(i, o) => {
                let (s, gs) = i.device_ptr(stream);
                let (d, gd) = o.device_ptr_mut(stream);
                (s, d, [Some(gs), Some(gd)])
            }
        };
        // NCCL counts per rank: the output's block for reduce_scatter, the input otherwise.
        let count = match op {
            DeviceOp::ReduceScatter(_) => output,
            _ => input,
        };
        self.nccl(fp, |comm, stream| {
            // SAFETY: `src`/`dst` are the live buffers of this call on this group's device,
            // their sizes checked by `fingerprint` (blocks, roots, peers); the caller's slices
            // (or the work holding them) keep them alive until the collective completes, and
            // cudarc's event tracking orders their later uses after the comm stream.
            unsafe { nccl_call(op, src, dst, count, nccl_dtype(T::DTYPE), comm, stream) }
        })
    }

    /// Reduce `buf` across all ranks with `op` (avg: NCCL's `ncclAvg`; integers truncate); every
    /// rank gets the result.
    pub fn all_reduce<T: CudaElement>(&self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<()> {
        self.collective(DeviceOp::AllReduce(op), Borrowed::InPlace(buf))
            .wait()
    }

    /// Async [`CudaGroup::all_reduce`]; the work gives the buffer back.
    pub fn all_reduce_async<T: CudaElement>(
        &self,
        buf: CudaSlice<T>,
        op: ReduceOp,
    ) -> CudaWork<CudaSlice<T>> {
        self.collective(DeviceOp::AllReduce(op), Moved::InPlace(buf))
    }

    /// Copy `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<T: CudaElement>(&self, buf: &mut CudaSlice<T>, root: usize) -> Result<()> {
        self.collective(DeviceOp::Broadcast { root }, Borrowed::InPlace(buf))
            .wait()
    }

    /// Async [`CudaGroup::broadcast`]; the work gives the buffer back.
    pub fn broadcast_async<T: CudaElement>(
        &self,
        buf: CudaSlice<T>,
        root: usize,
    ) -> CudaWork<CudaSlice<T>> {
        self.collective(DeviceOp::Broadcast { root }, Moved::InPlace(buf))
    }

    /// Reduce every rank's `buf` into `root`'s `buf` (other ranks' buffers are unchanged).
    pub fn reduce<T: CudaElement>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.collective(DeviceOp::Reduce { op, root }, Borrowed::InPlace(buf))
            .wait()
    }

    /// Async [`CudaGroup::reduce`]; the work gives the buffer back.
    pub fn reduce_async<T: CudaElement>(
        &self,
        buf: CudaSlice<T>,
        op: ReduceOp,
        root: usize,
    ) -> CudaWork<CudaSlice<T>> {
        self.collective(DeviceOp::Reduce { op, root }, Moved::InPlace(buf))
    }

    /// Concatenate every rank's `input` (rank order) into `output` (`input.len() * size`).
    pub fn all_gather<T: CudaElement>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<()> {
        self.collective(DeviceOp::AllGather, Borrowed::Split(input, output))
            .wait()
    }

    /// Async [`CudaGroup::all_gather`]; the work returns the gathered buffer (allocated here).
    pub fn all_gather_async<T: CudaElement>(&self, input: CudaSlice<T>) -> CudaWork<CudaSlice<T>> {
        match self.alloc::<T>(input.len() * self.size()) {
            Ok(out) => self.collective(DeviceOp::AllGather, Moved::Split(input, out)),
            Err(e) => CudaWork::ready("all_gather", Err(e)),
        }
    }

    /// Reduce `input` (`output.len() * size` elements) across ranks; rank `r` gets block `r`.
    pub fn reduce_scatter<T: CudaElement>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.collective(DeviceOp::ReduceScatter(op), Borrowed::Split(input, output))
            .wait()
    }

    /// Async [`CudaGroup::reduce_scatter`]; the work returns this rank's block (allocated here).
    pub fn reduce_scatter_async<T: CudaElement>(
        &self,
        input: CudaSlice<T>,
        op: ReduceOp,
    ) -> CudaWork<CudaSlice<T>> {
        match self.alloc::<T>(input.len() / self.size()) {
            Ok(out) => self.collective(DeviceOp::ReduceScatter(op), Moved::Split(input, out)),
            Err(e) => CudaWork::ready("reduce_scatter", Err(e)),
        }
    }

    /// Send `buf` to rank `dst` (matched by a [`CudaGroup::recv`] of the same length there).
    pub fn send<T: CudaElement>(&self, buf: &CudaSlice<T>, dst: usize) -> Result<()> {
        self.collective(DeviceOp::Send { dst }, Borrowed::Source(buf))
            .wait()
    }

    /// Receive into `buf` from rank `src`.
    pub fn recv<T: CudaElement>(&self, buf: &mut CudaSlice<T>, src: usize) -> Result<()> {
        self.collective(DeviceOp::Recv { src }, Borrowed::InPlace(buf))
            .wait()
    }

    /// Wait until every rank has reached the barrier and the work queued on each rank's
    /// compute stream before it has finished (NCCL: a one-element all_reduce, as torch does).
    pub fn barrier(&self) -> Result<()> {
        match &self.imp {
            Imp::Relay(s) => {
                self.compute
                    .synchronize()
                    .map_err(super::driver_err("cuStreamSynchronize", self.rank()))?;
                s.barrier()
            }
            Imp::Nccl { .. } => {
                let mut one = self.alloc::<u8>(1)?;
                self.all_reduce(&mut one, ReduceOp::Sum)
            }
        }
    }

    /// `n` zeroed elements on this device (on the comm stream).
    fn alloc<T: CudaElement>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.comm_stream
            .alloc_zeros::<T>(n)
            .map_err(super::driver_err("cuMemAllocAsync", self.rank()))
    }
}

/// A CUDA group as a [`Collectives`]: buffers are `CudaSlice<T>`; host copies run on the
/// compute stream.
impl<T: CudaElement> Collectives<T> for CudaGroup {
    type Buf = CudaSlice<T>;
    type Pending = CudaWork<CudaSlice<T>>;

    fn copy_from_host(&self, host: &[T]) -> Result<CudaSlice<T>> {
        let s = &self.compute;
        if host.is_empty() {
            return s
                .alloc_zeros::<T>(0)
                .map_err(super::driver_err("cuMemAllocAsync", self.rank()));
        }
        s.clone_htod(host)
            .map_err(super::driver_err("cuMemcpyHtoDAsync", self.rank()))
    }
    fn copy_to_host(&self, buf: &CudaSlice<T>) -> Result<Vec<T>> {
        if buf.is_empty() {
            return Ok(Vec::new());
        }
        self.compute
            .clone_dtoh(buf)
            .map_err(super::driver_err("cuMemcpyDtoHAsync", self.rank()))
    }
    forward_collectives!(CudaGroup, gather_async);
}
