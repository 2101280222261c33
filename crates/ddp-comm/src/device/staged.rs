//! Host-staged device collectives (what Gloo does for CUDA tensors): each device buffer is
//! downloaded to host staging memory (pinned on CUDA), reduced by the host group's own backend
//! (shared memory or TCP), and uploaded back.
//!
//! ```text
//!  rank r:  device buf ──download──▶ staging (pinned host) ──▶ host CollectiveBackend ──┐
//!           device buf ◀──upload──── staging ◀────────────────── (shm / TCP, all ranks) ─┘
//! ```
//!
//! The collectives are written once, against small traits: [`StageSource`]/[`StageBuffer`]
//! (memory that can be copied to/from host memory: a `CudaSlice` on CUDA, a `Vec` on the host) and
//! [`HostStaging`] (where the host copy lives: pinned memory on CUDA, [`VecStaging`] on the
//! host). The tests run exactly this code over host memory with real multi-rank groups.
//!
//! Every collective is a job on the host group's engine thread, so staged collectives and the
//! group's own host collectives run in one order, share its sequence numbers, timeout and
//! abort, and their errors name the collective, its sequence number and the peer rank.

use crate::backend::{CollectiveBackend, HostBuf, HostSlice};
use crate::dtype::{Element, ReduceOp};
use crate::transport::OpKind;
use crate::work::Work;
use crate::{Error, ProcessGroup, Result};
use std::sync::{Arc, Mutex};

/// Memory a staged collective can copy to the host: device memory on a GPU, or host memory
/// for tests and CPU runs. The input side of a collective.
pub trait StageSource<T: Element>: Send + Sync {
    /// Its length in elements.
    fn len(&self) -> usize;

    /// Whether it holds no element.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy the buffer into `host` (`host.len() == self.len()`); returns when the copy is done
    /// (on CUDA: after everything queued on the buffer before the collective was issued).
    fn download(&self, host: &mut [T]) -> Result<()>;
}

/// A [`StageSource`] that can also be written from the host: the output side of a collective.
pub trait StageBuffer<T: Element>: StageSource<T> {
    /// Copy `host` into the buffer; returns when the copy is done.
    fn upload(&mut self, host: &[T]) -> Result<()>;
}

impl<T: Element> StageSource<T> for Vec<T> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }

    fn download(&self, host: &mut [T]) -> Result<()> {
        host.copy_from_slice(self);
        Ok(())
    }
}

impl<T: Element> StageBuffer<T> for Vec<T> {
    fn upload(&mut self, host: &[T]) -> Result<()> {
        self.copy_from_slice(host);
        Ok(())
    }
}

/// Host memory the staged copies go through, reused from one collective to the next.
pub trait HostStaging: Send + 'static {
    /// At least `bytes` bytes of host memory, aligned to 16 bytes, valid until the next call.
    fn get(&mut self, bytes: usize) -> Result<&mut [u8]>;
}

/// Staging in ordinary (pageable) host memory: for host-memory stage buffers and tests.
#[derive(Default)]
pub struct VecStaging(Vec<u128>);

impl HostStaging for VecStaging {
    fn get(&mut self, bytes: usize) -> Result<&mut [u8]> {
        let words = bytes.div_ceil(16);
        if self.0.len() < words {
            self.0.resize(words, 0);
        }
        Ok(&mut bytemuck::cast_slice_mut(&mut self.0)[..bytes])
    }
}

/// `n` elements of `T` at the start of the staging memory.
fn one<T: Element>(st: &mut dyn HostStaging, n: usize) -> Result<&mut [T]> {
    let b = st.get(n * size_of::<T>())?;
    Ok(bytemuck::cast_slice_mut(b))
}

/// `a` then `b` elements of `T` (the second starting 16-byte aligned).
fn two<T: Element>(st: &mut dyn HostStaging, a: usize, b: usize) -> Result<(&mut [T], &mut [T])> {
    let first = (a * size_of::<T>()).next_multiple_of(16);
    let bytes = st.get(first + b * size_of::<T>())?;
    let (x, y) = bytes.split_at_mut(first);
    Ok((
        bytemuck::cast_slice_mut(&mut x[..a * size_of::<T>()]),
        bytemuck::cast_slice_mut(y),
    ))
}

type Staging = Arc<Mutex<Box<dyn HostStaging>>>;

/// Host-staged collectives over a [`ProcessGroup`] (a clone of the handle: same ranks, same
/// engine thread, same timeout).
#[derive(Clone)]
pub struct StagedGroup {
    pg: ProcessGroup,
    staging: Staging,
}

impl std::fmt::Debug for StagedGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedGroup").field("pg", &self.pg).finish()
    }
}

impl StagedGroup {
    /// Staged collectives over `pg`, staging in `staging`.
    pub fn new(pg: &ProcessGroup, staging: Box<dyn HostStaging>) -> StagedGroup {
        StagedGroup {
            pg: pg.clone(),
            staging: Arc::new(Mutex::new(staging)),
        }
    }

    /// Staged collectives over `pg`, staging in pageable host memory ([`VecStaging`]).
    pub fn with_host_staging(pg: &ProcessGroup) -> StagedGroup {
        StagedGroup::new(pg, Box::<VecStaging>::default())
    }

    /// The host group the collectives run on.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// Run `f` (with the backend and the staging memory) as the collective `op` on the group's
    /// thread and wait for it.
    fn blocking<R: Send + 'static>(
        &self,
        fp: crate::transport::Fingerprint,
        f: impl FnOnce(&mut dyn CollectiveBackend, &mut dyn HostStaging) -> Result<R> + Send,
    ) -> Result<R> {
        let st = self.staging.clone();
        self.pg.blocking(fp, move |b| f(b, &mut **lock(&st)))
    }

    /// Queue `f` as the collective `op` on the group's thread.
    fn spawn<R: Send + 'static>(
        &self,
        fp: crate::transport::Fingerprint,
        f: impl FnOnce(&mut dyn CollectiveBackend, &mut dyn HostStaging) -> Result<R> + Send + 'static,
    ) -> Work<R> {
        let st = self.staging.clone();
        self.pg.spawn(fp, move |b| f(b, &mut **lock(&st)))
    }

    // ----- all_reduce -------------------------------------------------------------------------

    /// Reduce `buf` across all ranks with `op`; every rank gets the result.
    pub fn all_reduce<T: Element, B: StageBuffer<T>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
    ) -> Result<()> {
        let fp = self
            .pg
            .fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None);
        self.blocking(fp, move |b, st| all_reduce(b, st, buf, op))
    }

    /// Async [`StagedGroup::all_reduce`]; the work returns the buffer.
    pub fn all_reduce_async<T: Element, B: StageBuffer<T> + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
    ) -> Work<B> {
        let fp = self
            .pg
            .fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None);
        self.spawn(fp, move |b, st| {
            all_reduce(b, st, &mut buf, op).map(|()| buf)
        })
    }

    // ----- broadcast --------------------------------------------------------------------------

    /// Copy `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<T: Element, B: StageBuffer<T>>(&self, buf: &mut B, root: usize) -> Result<()> {
        self.pg.check_root(root)?;
        let fp = self
            .pg
            .fingerprint(OpKind::Broadcast, T::DTYPE, None, buf.len(), Some(root));
        self.blocking(fp, move |b, st| broadcast(b, st, buf, root))
    }

    /// Async [`StagedGroup::broadcast`]; the work returns the buffer.
    pub fn broadcast_async<T: Element, B: StageBuffer<T> + 'static>(
        &self,
        mut buf: B,
        root: usize,
    ) -> Work<B> {
        if let Err(e) = self.pg.check_root(root) {
            return Work::ready("broadcast", Err(e));
        }
        let fp = self
            .pg
            .fingerprint(OpKind::Broadcast, T::DTYPE, None, buf.len(), Some(root));
        self.spawn(fp, move |b, st| {
            broadcast(b, st, &mut buf, root).map(|()| buf)
        })
    }

    // ----- reduce -----------------------------------------------------------------------------

    /// Reduce every rank's `buf` into `root`'s `buf` (other ranks' buffers are unchanged).
    pub fn reduce<T: Element, B: StageBuffer<T>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.pg.check_root(root)?;
        let fp = self
            .pg
            .fingerprint(OpKind::Reduce, T::DTYPE, Some(op), buf.len(), Some(root));
        self.blocking(fp, move |b, st| reduce(b, st, buf, op, root))
    }

    /// Async [`StagedGroup::reduce`]; the work returns the buffer.
    pub fn reduce_async<T: Element, B: StageBuffer<T> + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
        root: usize,
    ) -> Work<B> {
        if let Err(e) = self.pg.check_root(root) {
            return Work::ready("reduce", Err(e));
        }
        let fp = self
            .pg
            .fingerprint(OpKind::Reduce, T::DTYPE, Some(op), buf.len(), Some(root));
        self.spawn(fp, move |b, st| {
            reduce(b, st, &mut buf, op, root).map(|()| buf)
        })
    }

    // ----- all_gather -------------------------------------------------------------------------

    /// Concatenate every rank's `input` (rank order) into `output` (`input.len() * size`).
    pub fn all_gather<T: Element, I: StageSource<T>, O: StageBuffer<T>>(
        &self,
        input: &I,
        output: &mut O,
    ) -> Result<()> {
        self.check_blocks("all_gather", output.len(), input.len())?;
        let fp = self
            .pg
            .fingerprint(OpKind::AllGather, T::DTYPE, None, input.len(), None);
        self.blocking(fp, move |b, st| all_gather(b, st, input, output))
    }

    /// Async [`StagedGroup::all_gather`]; the work returns `(input, output)`.
    pub fn all_gather_async<
        T: Element,
        I: StageSource<T> + 'static,
        O: StageBuffer<T> + 'static,
    >(
        &self,
        input: I,
        mut output: O,
    ) -> Work<(I, O)> {
        if let Err(e) = self.check_blocks("all_gather", output.len(), input.len()) {
            return Work::ready("all_gather", Err(e));
        }
        let fp = self
            .pg
            .fingerprint(OpKind::AllGather, T::DTYPE, None, input.len(), None);
        self.spawn(fp, move |b, st| {
            all_gather(b, st, &input, &mut output).map(|()| (input, output))
        })
    }

    // ----- reduce_scatter ---------------------------------------------------------------------

    /// Reduce `input` (`output.len() * size` elements) across ranks; rank `r` gets block `r`.
    pub fn reduce_scatter<T: Element, I: StageSource<T>, O: StageBuffer<T>>(
        &self,
        input: &I,
        output: &mut O,
        op: ReduceOp,
    ) -> Result<()> {
        self.check_blocks("reduce_scatter", input.len(), output.len())?;
        let fp = self
            .pg
            .fingerprint(OpKind::ReduceScatter, T::DTYPE, Some(op), input.len(), None);
        self.blocking(fp, move |b, st| reduce_scatter(b, st, input, output, op))
    }

    /// Async [`StagedGroup::reduce_scatter`]; the work returns `(input, output)`.
    pub fn reduce_scatter_async<
        T: Element,
        I: StageSource<T> + 'static,
        O: StageBuffer<T> + 'static,
    >(
        &self,
        input: I,
        mut output: O,
        op: ReduceOp,
    ) -> Work<(I, O)> {
        if let Err(e) = self.check_blocks("reduce_scatter", input.len(), output.len()) {
            return Work::ready("reduce_scatter", Err(e));
        }
        let fp = self
            .pg
            .fingerprint(OpKind::ReduceScatter, T::DTYPE, Some(op), input.len(), None);
        self.spawn(fp, move |b, st| {
            reduce_scatter(b, st, &input, &mut output, op).map(|()| (input, output))
        })
    }

    // ----- send / recv / barrier --------------------------------------------------------------

    /// Send `buf` to rank `dst` (matched by a [`StagedGroup::recv`] of the same length there).
    pub fn send<T: Element, I: StageSource<T>>(&self, buf: &I, dst: usize) -> Result<()> {
        self.pg.check_peer(dst)?;
        let fp = self.pg.p2p_fingerprint::<T>(buf.len(), dst, true);
        self.blocking(fp, move |b, st| {
            let host = one::<T>(st, buf.len())?;
            buf.download(host)?;
            b.send(HostSlice::new(host), dst)
        })
    }

    /// Receive into `buf` from rank `src`.
    pub fn recv<T: Element, B: StageBuffer<T>>(&self, buf: &mut B, src: usize) -> Result<()> {
        self.pg.check_peer(src)?;
        let fp = self.pg.p2p_fingerprint::<T>(buf.len(), src, false);
        self.blocking(fp, move |b, st| {
            let host = one::<T>(st, buf.len())?;
            b.recv(HostBuf::new(host), src)?;
            buf.upload(host)
        })
    }

    /// Wait until every rank has reached the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.pg.barrier()
    }

    /// `big` must be `small * size` elements.
    fn check_blocks(&self, what: &str, big: usize, small: usize) -> Result<()> {
        if big != small * self.pg.size() {
            return Err(Error::InvalidArgument(format!(
                "{what}: the full buffer has {big} elements but the per-rank one has {small}; \
                 expected {small} x {} ranks = {}",
                self.pg.size(),
                small * self.pg.size()
            )));
        }
        Ok(())
    }
}

fn lock(st: &Staging) -> std::sync::MutexGuard<'_, Box<dyn HostStaging>> {
    st.lock().unwrap_or_else(|p| p.into_inner())
}

// ----- the collectives, once, on the group's thread ----------------------------------------------

fn all_reduce<T: Element, B: StageBuffer<T> + ?Sized>(
    b: &mut dyn CollectiveBackend,
    st: &mut dyn HostStaging,
    buf: &mut B,
    op: ReduceOp,
) -> Result<()> {
    let host = one::<T>(st, buf.len())?;
    buf.download(host)?;
    b.all_reduce(HostBuf::new(host), op)?;
    buf.upload(host)
}

fn broadcast<T: Element, B: StageBuffer<T> + ?Sized>(
    b: &mut dyn CollectiveBackend,
    st: &mut dyn HostStaging,
    buf: &mut B,
    root: usize,
) -> Result<()> {
    let host = one::<T>(st, buf.len())?;
    let is_root = b.transport().rank() == root;
    if is_root {
        buf.download(host)?;
    }
    b.broadcast(HostBuf::new(host), root)?;
    if is_root {
        return Ok(());
    }
    buf.upload(host)
}

fn reduce<T: Element, B: StageBuffer<T> + ?Sized>(
    b: &mut dyn CollectiveBackend,
    st: &mut dyn HostStaging,
    buf: &mut B,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let host = one::<T>(st, buf.len())?;
    buf.download(host)?;
    b.reduce(HostBuf::new(host), op, root)?;
    if b.transport().rank() == root {
        buf.upload(host)?;
    }
    Ok(())
}

fn all_gather<T: Element, I: StageSource<T> + ?Sized, O: StageBuffer<T> + ?Sized>(
    b: &mut dyn CollectiveBackend,
    st: &mut dyn HostStaging,
    input: &I,
    output: &mut O,
) -> Result<()> {
    let (inp, out) = two::<T>(st, input.len(), output.len())?;
    input.download(inp)?;
    b.all_gather(HostSlice::new(inp), HostBuf::new(out))?;
    output.upload(out)
}

fn reduce_scatter<T: Element, I: StageSource<T> + ?Sized, O: StageBuffer<T> + ?Sized>(
    b: &mut dyn CollectiveBackend,
    st: &mut dyn HostStaging,
    input: &I,
    output: &mut O,
    op: ReduceOp,
) -> Result<()> {
    let (inp, out) = two::<T>(st, input.len(), output.len())?;
    input.download(inp)?;
    b.reduce_scatter(HostSlice::new(inp), HostBuf::new(out), op)?;
    output.upload(out)
}
