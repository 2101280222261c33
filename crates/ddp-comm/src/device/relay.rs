//! Device collectives relayed through the host (what Gloo does for CUDA tensors): each device
//! buffer is downloaded to host relay memory (pinned on CUDA), reduced by the host group's own
//! backend (shared memory or TCP), and uploaded back.
//!
//! ```text
//!  rank r:  device buf ──download──▶ relay memory (pinned host) ──▶ host CollectiveBackend ──┐
//!           device buf ◀──upload──── relay memory ◀──────────────── (shm / TCP, all ranks) ─┘
//! ```
//!
//! The collectives are written once, against small traits: [`RelaySource`]/[`RelayBuffer`]
//! (memory that can be copied to/from host memory: a `CudaSlice` on CUDA, a `Vec` on the host) and
//! [`HostRelay`] (where the host copy lives: pinned memory on CUDA, [`VecRelay`] on the
//! host). The tests run exactly this code over host memory with real multi-rank groups.
//!
//! Every collective ([`DeviceOp`]) is dispatched in one place (`relay`, reached through
//! `RelayGroup::run` for the blocking forms and `RelayGroup::spawn` for the `*_async` ones) and
//! is a job on the host group's engine thread, so relayed collectives and the group's own host
//! collectives run in one order, share its sequence numbers, timeout and abort, and their errors
//! name the collective, its sequence number and the peer rank.

use super::op::DeviceOp;
use crate::backend::{CollectiveBackend, HostBuf, RawHostSlice};
use crate::collectives::{forward_collectives, Collectives};
use crate::dtype::{Element, ReduceOp};
use crate::work::Work;
use crate::{Error, ProcessGroup, Result};
use std::sync::{Arc, Mutex};

/// Memory a relayed collective can copy to the host: device memory on a GPU, or host memory
/// for tests and CPU runs. The input side of a collective.
pub trait RelaySource<T: Element>: Send + Sync {
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

/// A [`RelaySource`] that can also be written from the host: the output side of a collective.
pub trait RelayBuffer<T: Element>: RelaySource<T> {
    /// Copy `host` into the buffer; returns when the copy is done.
    fn upload(&mut self, host: &[T]) -> Result<()>;
}

impl<T: Element> RelaySource<T> for Vec<T> {
    fn len(&self) -> usize {
        self.as_slice().len()
    }

    fn download(&self, host: &mut [T]) -> Result<()> {
        host.copy_from_slice(self);
        Ok(())
    }
}

impl<T: Element> RelayBuffer<T> for Vec<T> {
    fn upload(&mut self, host: &[T]) -> Result<()> {
        self.copy_from_slice(host);
        Ok(())
    }
}

/// Host memory the relayed copies go through, reused from one collective to the next.
pub trait HostRelay: Send + 'static {
    /// At least `bytes` bytes of host memory, aligned to 16 bytes, valid until the next call.
    fn get(&mut self, bytes: usize) -> Result<&mut [u8]>;
}

/// Relay memory in ordinary (pageable) host memory: for host-memory relay buffers and tests.
#[derive(Default)]
pub struct VecRelay(Vec<u128>);

impl HostRelay for VecRelay {
    fn get(&mut self, bytes: usize) -> Result<&mut [u8]> {
        let words = bytes.div_ceil(16);
        if self.0.len() < words {
            self.0.resize(words, 0);
        }
        Ok(&mut bytemuck::cast_slice_mut(&mut self.0)[..bytes])
    }
}

/// `n` elements of `T` at the start of the relay memory.
fn one<T: Element>(st: &mut dyn HostRelay, n: usize) -> Result<&mut [T]> {
    let b = st.get(n * size_of::<T>())?;
    Ok(bytemuck::cast_slice_mut(b))
}

/// `a` then `b` elements of `T` (the second starting 16-byte aligned).
fn two<T: Element>(st: &mut dyn HostRelay, a: usize, b: usize) -> Result<(&mut [T], &mut [T])> {
    let first = (a * size_of::<T>()).next_multiple_of(16);
    let bytes = st.get(first + b * size_of::<T>())?;
    let (x, y) = bytes.split_at_mut(first);
    Ok((
        bytemuck::cast_slice_mut(&mut x[..a * size_of::<T>()]),
        bytemuck::cast_slice_mut(y),
    ))
}

/// The buffers of one relayed collective, as the one dispatch sees them.
pub(crate) enum RelayIo<'a, T: Element> {
    /// One buffer, read and written: all_reduce, broadcast, reduce, recv.
    InPlace(&'a mut dyn RelayBuffer<T>),
    /// One buffer, only read: send.
    Source(&'a dyn RelaySource<T>),
    /// An input and an output: all_gather, reduce_scatter.
    Split(&'a dyn RelaySource<T>, &'a mut dyn RelayBuffer<T>),
}

impl<T: Element> RelayIo<'_, T> {
    /// The input's and the output's lengths (in place: the one buffer's, twice).
    fn lens(&self) -> (usize, usize) {
        match self {
            RelayIo::InPlace(b) => (b.len(), b.len()),
            RelayIo::Source(b) => (b.len(), b.len()),
            RelayIo::Split(i, o) => (i.len(), o.len()),
        }
    }
}

type Relay = Arc<Mutex<Box<dyn HostRelay>>>;

/// Collectives relayed through the host over a [`ProcessGroup`] (a clone of the handle: same
/// ranks, same engine thread, same timeout).
#[derive(Clone)]
pub struct RelayGroup {
    pg: ProcessGroup,
    relay: Relay,
}

impl std::fmt::Debug for RelayGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayGroup").field("pg", &self.pg).finish()
    }
}

impl RelayGroup {
    /// Collectives over `pg`, relayed through the host memory `relay`.
    pub fn new(pg: &ProcessGroup, relay: Box<dyn HostRelay>) -> RelayGroup {
        RelayGroup {
            pg: pg.clone(),
            relay: Arc::new(Mutex::new(relay)),
        }
    }

    /// Collectives over `pg`, relayed through pageable host memory ([`VecRelay`]).
    pub fn with_vec_relay(pg: &ProcessGroup) -> RelayGroup {
        RelayGroup::new(pg, Box::<VecRelay>::default())
    }

    /// The host group the collectives run on.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.pg.rank()
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.pg.size()
    }

    /// Check `op` against its buffers, run it on the group's thread and wait for it: every
    /// blocking collective comes through here.
    pub(crate) fn run<T: Element>(&self, op: DeviceOp, io: RelayIo<'_, T>) -> Result<()> {
        let (input, output) = io.lens();
        let fp = op.fingerprint::<T>(&self.pg, input, output)?;
        let st = self.relay.clone();
        self.pg
            .blocking(fp, move |b| relay(b, &mut **lock(&st), op, io))
    }

    /// Check `op` against the buffers `x` holds (seen through `io`), and queue it on the group's
    /// thread; the work yields `out(x)`. Every `*_async` collective comes through here.
    pub(crate) fn spawn<T: Element, X: Send + 'static, R: Send + 'static>(
        &self,
        op: DeviceOp,
        mut x: X,
        io: fn(&mut X) -> RelayIo<'_, T>,
        out: fn(X) -> R,
    ) -> Work<R> {
        let (input, output) = io(&mut x).lens();
        let fp = match op.fingerprint::<T>(&self.pg, input, output) {
            Ok(fp) => fp,
            Err(e) => return Work::ready(op.name(), Err(e)),
        };
        let st = self.relay.clone();
        self.pg.spawn(fp, move |b| {
            relay(b, &mut **lock(&st), op, io(&mut x))?;
            Ok(out(x))
        })
    }

    /// [`RelayGroup::spawn`] of a collective in place on `buf`.
    pub(crate) fn spawn_in_place<T: Element, B: RelayBuffer<T> + 'static>(
        &self,
        op: DeviceOp,
        buf: B,
    ) -> Work<B> {
        self.spawn(op, buf, |b| RelayIo::InPlace(b), |b| b)
    }

    /// [`RelayGroup::spawn`] of a collective from `input` into `output`.
    pub(crate) fn spawn_split<
        T: Element,
        I: RelaySource<T> + 'static,
        O: RelayBuffer<T> + 'static,
    >(
        &self,
        op: DeviceOp,
        input: I,
        output: O,
    ) -> Work<(I, O)> {
        self.spawn(op, (input, output), |(i, o)| RelayIo::Split(i, o), |x| x)
    }

    /// Reduce `buf` across all ranks with `op`; every rank gets the result.
    pub fn all_reduce<T: Element, B: RelayBuffer<T>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
    ) -> Result<()> {
        self.run(DeviceOp::AllReduce(op), RelayIo::InPlace(buf))
    }

    /// Async [`RelayGroup::all_reduce`]; the work returns the buffer.
    pub fn all_reduce_async<T: Element, B: RelayBuffer<T> + 'static>(
        &self,
        buf: B,
        op: ReduceOp,
    ) -> Work<B> {
        self.spawn_in_place(DeviceOp::AllReduce(op), buf)
    }

    /// Copy `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<T: Element, B: RelayBuffer<T>>(&self, buf: &mut B, root: usize) -> Result<()> {
        self.run(DeviceOp::Broadcast { root }, RelayIo::InPlace(buf))
    }

    /// Async [`RelayGroup::broadcast`]; the work returns the buffer.
    pub fn broadcast_async<T: Element, B: RelayBuffer<T> + 'static>(
        &self,
        buf: B,
        root: usize,
    ) -> Work<B> {
        self.spawn_in_place(DeviceOp::Broadcast { root }, buf)
    }

    /// Reduce every rank's `buf` into `root`'s `buf` (other ranks' buffers are unchanged).
    pub fn reduce<T: Element, B: RelayBuffer<T>>(
        &self,
        buf: &mut B,
        op: ReduceOp,
        root: usize,
    ) -> Result<()> {
        self.run(DeviceOp::Reduce { op, root }, RelayIo::InPlace(buf))
    }

    /// Async [`RelayGroup::reduce`]; the work returns the buffer.
    pub fn reduce_async<T: Element, B: RelayBuffer<T> + 'static>(
        &self,
        buf: B,
        op: ReduceOp,
        root: usize,
    ) -> Work<B> {
        self.spawn_in_place(DeviceOp::Reduce { op, root }, buf)
    }

    /// Concatenate every rank's `input` (rank order) into `output` (`input.len() * size`).
    pub fn all_gather<T: Element, I: RelaySource<T>, O: RelayBuffer<T>>(
        &self,
        input: &I,
        output: &mut O,
    ) -> Result<()> {
        self.run(DeviceOp::AllGather, RelayIo::Split(input, output))
    }

    /// Async [`RelayGroup::all_gather`]; the work returns `(input, output)`.
    pub fn all_gather_async<
        T: Element,
        I: RelaySource<T> + 'static,
        O: RelayBuffer<T> + 'static,
    >(
        &self,
        input: I,
        output: O,
    ) -> Work<(I, O)> {
        self.spawn_split(DeviceOp::AllGather, input, output)
    }

    /// Reduce `input` (`output.len() * size` elements) across ranks; rank `r` gets block `r`.
    pub fn reduce_scatter<T: Element, I: RelaySource<T>, O: RelayBuffer<T>>(
        &self,
        input: &I,
        output: &mut O,
        op: ReduceOp,
    ) -> Result<()> {
        self.run(DeviceOp::ReduceScatter(op), RelayIo::Split(input, output))
    }

    /// Async [`RelayGroup::reduce_scatter`]; the work returns `(input, output)`.
    pub fn reduce_scatter_async<
        T: Element,
        I: RelaySource<T> + 'static,
        O: RelayBuffer<T> + 'static,
    >(
        &self,
        input: I,
        output: O,
        op: ReduceOp,
    ) -> Work<(I, O)> {
        self.spawn_split(DeviceOp::ReduceScatter(op), input, output)
    }

    /// Send `buf` to rank `dst` (matched by a [`RelayGroup::recv`] of the same length there).
    pub fn send<T: Element, I: RelaySource<T>>(&self, buf: &I, dst: usize) -> Result<()> {
        self.run(DeviceOp::Send { dst }, RelayIo::Source(buf))
    }

    /// Receive into `buf` from rank `src`.
    pub fn recv<T: Element, B: RelayBuffer<T>>(&self, buf: &mut B, src: usize) -> Result<()> {
        self.run(DeviceOp::Recv { src }, RelayIo::InPlace(buf))
    }

    /// Wait until every rank has reached the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.pg.barrier()
    }
}

fn lock(st: &Relay) -> std::sync::MutexGuard<'_, Box<dyn HostRelay>> {
    st.lock().unwrap_or_else(|p| p.into_inner())
}

/// Every relayed collective, once, on the group's thread: download what the rank contributes
/// into the relay memory, run the host collective there, upload what the rank receives.
fn relay<T: Element>(
    b: &mut dyn CollectiveBackend,
    st: &mut dyn HostRelay,
    op: DeviceOp,
    io: RelayIo<'_, T>,
) -> Result<()> {
    let rank = b.transport().rank();
    match (op, io) {
        (DeviceOp::Send { dst }, RelayIo::Source(buf)) => {
            let host = one::<T>(st, buf.len())?;
            buf.download(host)?;
            b.send(RawHostSlice::new(host), dst)
        }
        (DeviceOp::AllGather | DeviceOp::ReduceScatter(_), RelayIo::Split(input, output)) => {
            let (inp, out) = two::<T>(st, input.len(), output.len())?;
            input.download(inp)?;
            let (inp, out_buf) = (RawHostSlice::new(inp), HostBuf::new(out));
            match op {
                DeviceOp::ReduceScatter(o) => b.reduce_scatter(inp, out_buf, o)?,
                _ => b.all_gather(inp, out_buf)?,
            }
            output.upload(out)
        }
        (_, RelayIo::InPlace(buf)) => {
            let host = one::<T>(st, buf.len())?;
            // What this rank contributes, and what it receives.
            let (reads, writes) = match op {
                DeviceOp::Broadcast { root } => (rank == root, rank != root),
                DeviceOp::Reduce { root, .. } => (true, rank == root),
                DeviceOp::Recv { .. } => (false, true),
                _ => (true, true),
            };
            if reads {
                buf.download(host)?;
            }
            let h = HostBuf::new(host);
            match op {
                DeviceOp::AllReduce(o) => b.all_reduce(h, o)?,
                DeviceOp::Broadcast { root } => b.broadcast(h, root)?,
                DeviceOp::Reduce { op, root } => b.reduce(h, op, root)?,
                DeviceOp::Recv { src } => b.recv(h, src)?,
                _ => return Err(wrong_buffers(op)),
            }
            if writes {
                buf.upload(host)?;
            }
            Ok(())
        }
        (op, _) => Err(wrong_buffers(op)),
    }
}

fn wrong_buffers(op: DeviceOp) -> Error {
    Error::Internal(format!("relayed {} given the wrong buffers", op.name()))
}

/// The relay path over host memory (`Vec<T>` buffers standing in for device memory): the same
/// code a CUDA group runs when it relays.
impl<T: Element> Collectives<T> for RelayGroup {
    type Buf = Vec<T>;
    type Pending = Work<Vec<T>>;

    fn copy_from_host(&self, host: &[T]) -> Result<Vec<T>> {
        Ok(host.to_vec())
    }
    fn copy_to_host(&self, buf: &Vec<T>) -> Result<Vec<T>> {
        Ok(buf.clone())
    }
    fn all_gather_async(&self, input: Vec<T>) -> Work<Vec<T>> {
        let out = vec![T::zeroed(); input.len() * self.pg.size()];
        self.spawn(
            DeviceOp::AllGather,
            (input, out),
            |(i, o)| RelayIo::Split(i, o),
            |(_, o)| o,
        )
    }
    fn reduce_scatter_async(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let out = vec![T::zeroed(); input.len() / self.pg.size()];
        self.spawn(
            DeviceOp::ReduceScatter(op),
            (input, out),
            |(i, o)| RelayIo::Split(i, o),
            |(_, o)| o,
        )
    }
    forward_collectives!(RelayGroup);
}
