//! The collectives of [`CudaGroup`]: for each, the argument checks, then NCCL (raw
//! `nccl::result` calls on the comm stream, in place where NCCL allows) or the staged path.
//! Blocking forms take `&mut CudaSlice<T>` and wait; `*_async` forms take an owned slice and
//! return a [`CudaWork`] that gives it back.

use super::nccl::{nccl_dtype, nccl_op};
use super::stage::{Exclusive, Owned, Shared};
use super::{CudaElement, CudaGroup, CudaWork, Imp};
use crate::dtype::ReduceOp;
use crate::transport::OpKind;
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use cudarc::nccl::result;
use std::ffi::c_void;

impl CudaGroup {
    // ----- all_reduce -------------------------------------------------------------------------

    /// Reduce `buf` across all ranks with `op` (avg: NCCL's `ncclAvg`; integers truncate); every
    /// rank gets the result.
    pub fn all_reduce<T: CudaElement>(&self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<()> {
        match &self.imp {
            Imp::Staged(s) => s.all_reduce(&mut self.on(Exclusive(buf))?, op),
            Imp::Nccl { .. } => self.nccl_all_reduce(buf, op)?.with(()).wait(),
        }
    }

    /// Async [`CudaGroup::all_reduce`]; the work gives the buffer back.
    pub fn all_reduce_async<T: CudaElement>(
        &self,
        mut buf: CudaSlice<T>,
        op: ReduceOp,
    ) -> CudaWork<CudaSlice<T>> {
        match &self.imp {
            Imp::Staged(s) => match self.on(Owned(buf)) {
                Ok(b) => CudaWork::host(s.all_reduce_async(b, op), |b| b.buf.0),
                Err(e) => CudaWork::ready("all_reduce", Err(e)),
            },
            Imp::Nccl { .. } => match self.nccl_all_reduce(&mut buf, op) {
                Ok(p) => p.with(buf),
                Err(e) => CudaWork::ready("all_reduce", Err(e)),
            },
        }
    }

    fn nccl_all_reduce<T: CudaElement>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<super::Pending> {
        let fp = self
            .pg
            .fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None);
        let n = buf.len();
        let (p, _sync) = buf.device_ptr_mut(&self.comm_stream);
        self.nccl(fp, |comm, stream| {
            // SAFETY: `p` is `n` elements of `T` on this group's device, kept alive by the
            // caller's slice (or the work holding it) until the work completes; cudarc's event
            // tracking orders later uses of the slice after the comm stream.
            unsafe {
                result::all_reduce(
                    p as *const c_void,
                    p as *mut c_void,
                    n,
                    nccl_dtype(T::DTYPE),
                    nccl_op(op),
                    comm,
                    stream,
                )
            }
            .map(|_| ())
        })
    }

    // ----- broadcast --------------------------------------------------------------------------

    /// Copy `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<T: CudaElement>(&self, buf: &mut CudaSlice<T>, root: usize) -> Result<()> {
        match &self.imp {
            Imp::Staged(s) => s.broadcast(&mut self.on(Exclusive(buf))?, root),
            Imp::Nccl { .. } => self.nccl_broadcast(buf, root)?.with(()).wait(),
        }
    }

    /// Async [`CudaGroup::broadcast`]; the work gives the buffer back.
    pub fn broadcast_async<T: CudaElement>(
        &self,
        mut buf: CudaSlice<T>,
        root: usize,
    ) -> CudaWork<CudaSlice<T>> {
        match &self.imp {
            Imp::Staged(s) => match self.on(Owned(buf)) {
                Ok(b) => CudaWork::host(s.broadcast_async(b, root), |b| b.buf.0),
                Err(e) => CudaWork::ready("broadcast", Err(e)),
            },
            Imp::Nccl { .. } => match self.nccl_broadcast(&mut buf, root) {
                Ok(p) => p.with(buf),
                Err(e) => CudaWork::ready("broadcast", Err(e)),
            },
        }
    }

    fn nccl_broadcast<T: CudaElement>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<super::Pending> {
        self.pg.check_root(root)?;
        let fp = self
            .pg
            .fingerprint(OpKind::Broadcast, T::DTYPE, None, buf.len(), Some(root));
        let n = buf.len();
        let (p, _sync) = buf.device_ptr_mut(&self.comm_stream);
        self.nccl(fp, |comm, stream| {
            // SAFETY: as in `nccl_all_reduce`: `n` live elements on this device.
            unsafe {
                result::broadcast(
                    p as *const c_void,
                    p as *mut c_void,
                    n,
                    nccl_dtype(T::DTYPE),
                    root as i32,
                    comm,
                    stream,
                )
            }
            .map(|_| ())
        })
    }

    // ----- reduce -----------------------------------------------------------------------------

    /// Reduce every rank's `buf` into `root`'s `buf` (other ranks' buffers are unchanged).
    pub fn reduce<T: CudaElement>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        match &self.imp {
            Imp::Staged(s) => s.reduce(&mut self.on(Exclusive(buf))?, op, root),
            Imp::Nccl { .. } => self.nccl_reduce(buf, op, root)?.with(()).wait(),
        }
    }

    /// Async [`CudaGroup::reduce`]; the work gives the buffer back.
    pub fn reduce_async<T: CudaElement>(
        &self,
        mut buf: CudaSlice<T>,
        op: ReduceOp,
        root: usize,
    ) -> CudaWork<CudaSlice<T>> {
        match &self.imp {
            Imp::Staged(s) => match self.on(Owned(buf)) {
                Ok(b) => CudaWork::host(s.reduce_async(b, op, root), |b| b.buf.0),
                Err(e) => CudaWork::ready("reduce", Err(e)),
            },
            Imp::Nccl { .. } => match self.nccl_reduce(&mut buf, op, root) {
                Ok(p) => p.with(buf),
                Err(e) => CudaWork::ready("reduce", Err(e)),
            },
        }
    }

    fn nccl_reduce<T: CudaElement>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
        root: usize,
    ) -> Result<super::Pending> {
        self.pg.check_root(root)?;
        let fp = self
            .pg
            .fingerprint(OpKind::Reduce, T::DTYPE, Some(op), buf.len(), Some(root));
        let n = buf.len();
        let (p, _sync) = buf.device_ptr_mut(&self.comm_stream);
        self.nccl(fp, |comm, stream| {
            // SAFETY: as in `nccl_all_reduce`; in place (NCCL allows send == recv).
            unsafe {
                result::reduce(
                    p as *const c_void,
                    p as *mut c_void,
                    n,
                    nccl_dtype(T::DTYPE),
                    nccl_op(op),
                    root as i32,
                    comm,
                    stream,
                )
            }
            .map(|_| ())
        })
    }

    // ----- all_gather -------------------------------------------------------------------------

    /// Concatenate every rank's `input` (rank order) into `output` (`input.len() * size`).
    pub fn all_gather<T: CudaElement>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<()> {
        self.check_blocks("all_gather", output.len(), input.len())?;
        match &self.imp {
            Imp::Staged(s) => {
                s.all_gather(&self.on(Shared(input))?, &mut self.on(Exclusive(output))?)
            }
            Imp::Nccl { .. } => self.nccl_all_gather(input, output)?.with(()).wait(),
        }
    }

    /// Async [`CudaGroup::all_gather`]; the work returns the gathered buffer (allocated here).
    pub fn all_gather_async<T: CudaElement>(&self, input: CudaSlice<T>) -> CudaWork<CudaSlice<T>> {
        let mut out = match self.alloc::<T>(input.len() * self.size()) {
            Ok(o) => o,
            Err(e) => return CudaWork::ready("all_gather", Err(e)),
        };
        match &self.imp {
            Imp::Staged(s) => match (self.on(Owned(input)), self.on(Owned(out))) {
                (Ok(i), Ok(o)) => CudaWork::host(s.all_gather_async(i, o), |(_, o)| o.buf.0),
                (Err(e), _) | (_, Err(e)) => CudaWork::ready("all_gather", Err(e)),
            },
            Imp::Nccl { .. } => match self.nccl_all_gather(&input, &mut out) {
                Ok(p) => p.with(out),
                Err(e) => CudaWork::ready("all_gather", Err(e)),
            },
        }
    }

    fn nccl_all_gather<T: CudaElement>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
    ) -> Result<super::Pending> {
        let fp = self
            .pg
            .fingerprint(OpKind::AllGather, T::DTYPE, None, input.len(), None);
        let n = input.len();
        let (src, _s) = input.device_ptr(&self.comm_stream);
        let (dst, _d) = output.device_ptr_mut(&self.comm_stream);
        self.nccl(fp, |comm, stream| {
            // SAFETY: `src` holds `n` and `dst` `n * size` live elements on this device
            // (checked by the caller).
            unsafe {
                result::all_gather(
                    src as *const c_void,
                    dst as *mut c_void,
                    n,
                    nccl_dtype(T::DTYPE),
                    comm,
                    stream,
                )
            }
            .map(|_| ())
        })
    }

    // ----- reduce_scatter ---------------------------------------------------------------------

    /// Reduce `input` (`output.len() * size` elements) across ranks; rank `r` gets block `r`.
    pub fn reduce_scatter<T: CudaElement>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_blocks("reduce_scatter", input.len(), output.len())?;
        match &self.imp {
            Imp::Staged(s) => s.reduce_scatter(
                &self.on(Shared(input))?,
                &mut self.on(Exclusive(output))?,
                op,
            ),
            Imp::Nccl { .. } => self.nccl_reduce_scatter(input, output, op)?.with(()).wait(),
        }
    }

    /// Async [`CudaGroup::reduce_scatter`]; the work returns this rank's block (allocated here).
    pub fn reduce_scatter_async<T: CudaElement>(
        &self,
        input: CudaSlice<T>,
        op: ReduceOp,
    ) -> CudaWork<CudaSlice<T>> {
        if let Err(e) = self.check_blocks("reduce_scatter", input.len(), input.len() / self.size())
        {
            return CudaWork::ready("reduce_scatter", Err(e));
        }
        let mut out = match self.alloc::<T>(input.len() / self.size()) {
            Ok(o) => o,
            Err(e) => return CudaWork::ready("reduce_scatter", Err(e)),
        };
        match &self.imp {
            Imp::Staged(s) => match (self.on(Owned(input)), self.on(Owned(out))) {
                (Ok(i), Ok(o)) => {
                    CudaWork::host(s.reduce_scatter_async(i, o, op), |(_, o)| o.buf.0)
                }
                (Err(e), _) | (_, Err(e)) => CudaWork::ready("reduce_scatter", Err(e)),
            },
            Imp::Nccl { .. } => match self.nccl_reduce_scatter(&input, &mut out, op) {
                Ok(p) => p.with(out),
                Err(e) => CudaWork::ready("reduce_scatter", Err(e)),
            },
        }
    }

    fn nccl_reduce_scatter<T: CudaElement>(
        &self,
        input: &CudaSlice<T>,
        output: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<super::Pending> {
        let fp = self
            .pg
            .fingerprint(OpKind::ReduceScatter, T::DTYPE, Some(op), input.len(), None);
        let n = output.len();
        let (src, _s) = input.device_ptr(&self.comm_stream);
        let (dst, _d) = output.device_ptr_mut(&self.comm_stream);
        self.nccl(fp, |comm, stream| {
            // SAFETY: `dst` holds `n` and `src` `n * size` live elements on this device.
            unsafe {
                result::reduce_scatter(
                    src as *const c_void,
                    dst as *mut c_void,
                    n,
                    nccl_dtype(T::DTYPE),
                    nccl_op(op),
                    comm,
                    stream,
                )
            }
            .map(|_| ())
        })
    }

    // ----- send / recv / barrier --------------------------------------------------------------

    /// Send `buf` to rank `dst` (matched by a [`CudaGroup::recv`] of the same length there).
    pub fn send<T: CudaElement>(&self, buf: &CudaSlice<T>, dst: usize) -> Result<()> {
        self.pg.check_peer(dst)?;
        match &self.imp {
            Imp::Staged(s) => s.send(&self.on(Shared(buf))?, dst),
            Imp::Nccl { .. } => {
                let fp = self.pg.p2p_fingerprint::<T>(buf.len(), dst, true);
                let n = buf.len();
                let (p, _s) = buf.device_ptr(&self.comm_stream);
                self.nccl(fp, |comm, stream| {
                    // SAFETY: `n` live elements on this device, kept until the wait below.
                    unsafe {
                        result::send(
                            p as *const c_void,
                            n,
                            nccl_dtype(T::DTYPE),
                            dst as i32,
                            comm,
                            stream,
                        )
                    }
                    .map(|_| ())
                })?
                .with(())
                .wait()
            }
        }
    }

    /// Receive into `buf` from rank `src`.
    pub fn recv<T: CudaElement>(&self, buf: &mut CudaSlice<T>, src: usize) -> Result<()> {
        self.pg.check_peer(src)?;
        match &self.imp {
            Imp::Staged(s) => s.recv(&mut self.on(Exclusive(buf))?, src),
            Imp::Nccl { .. } => {
                let fp = self.pg.p2p_fingerprint::<T>(buf.len(), src, false);
                let n = buf.len();
                let (p, _s) = buf.device_ptr_mut(&self.comm_stream);
                self.nccl(fp, |comm, stream| {
                    // SAFETY: `n` live elements on this device, kept until the wait below.
                    unsafe {
                        result::recv(
                            p as *mut c_void,
                            n,
                            nccl_dtype(T::DTYPE),
                            src as i32,
                            comm,
                            stream,
                        )
                    }
                    .map(|_| ())
                })?
                .with(())
                .wait()
            }
        }
    }

    /// Wait until every rank has reached the barrier and the work queued on each rank's
    /// compute stream before it has finished (NCCL: a one-element all_reduce, as torch does).
    pub fn barrier(&self) -> Result<()> {
        match &self.imp {
            Imp::Staged(s) => {
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

    /// `big` must be `small * size` elements.
    fn check_blocks(&self, what: &str, big: usize, small: usize) -> Result<()> {
        if big != small * self.size() {
            return Err(Error::InvalidArgument(format!(
                "{what} on rank {}: the full buffer has {big} elements but the per-rank one has \
                 {small}; expected {small} x {} ranks = {}",
                self.rank(),
                self.size(),
                small * self.size()
            )));
        }
        Ok(())
    }
}
