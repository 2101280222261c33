//! The public collective API of [`ProcessGroup`]: each collective's argument checks, its
//! fingerprint, and the job that runs it on the group's backend; a blocking form over slices
//! and an `*_async` form over owned `Vec`s returning a [`Work`].

use super::ProcessGroup;
use crate::algorithms::ring;
use crate::backend::{HostBuf, RawHostSlice};
use crate::dtype::{DType, Element, ReduceOp};
use crate::transport::{Fingerprint, OpKind};
use crate::work::Work;
use crate::{Error, Result};

/// The caller's side of [`ProcessGroup::all_gather_in_place_to`]: given `read(offset, dst)`,
/// it reads the ranges of the gathered buffer it wants into its own memory.
pub type Placement<'a, T> =
    &'a mut (dyn FnMut(&mut dyn FnMut(usize, &mut [T]) -> Result<()>) -> Result<()> + Send);

impl ProcessGroup {
    // ----- all_reduce -------------------------------------------------------------------------

    /// Reduce `buf` across all ranks with `op`; every rank gets the result.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let fp = self.fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None);
        self.blocking(fp, move |b| b.all_reduce(HostBuf::new(buf), op))
    }

    /// Async [`ProcessGroup::all_reduce`]; the work returns the buffer.
    pub fn all_reduce_async<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let fp = self.fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None);
        self.spawn(fp, move |b| {
            b.all_reduce(HostBuf::new(&mut buf), op).map(|()| buf)
        })
    }

    // ----- broadcast --------------------------------------------------------------------------

    /// Copy `root`'s `buf` into every rank's `buf`.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.check_root(root)?;
        let fp = self.fingerprint(OpKind::Broadcast, T::DTYPE, None, buf.len(), Some(root));
        self.blocking(fp, move |b| b.broadcast(HostBuf::new(buf), root))
    }

    /// Async [`ProcessGroup::broadcast`].
    pub fn broadcast_async<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_root(root) {
            return Work::ready("broadcast", Err(e));
        }
        let fp = self.fingerprint(OpKind::Broadcast, T::DTYPE, None, buf.len(), Some(root));
        self.spawn(fp, move |b| {
            b.broadcast(HostBuf::new(&mut buf), root).map(|()| buf)
        })
    }

    // ----- reduce -----------------------------------------------------------------------------

    /// Reduce every rank's `buf` into `root`'s `buf` (other ranks' buffers are unchanged).
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.check_root(root)?;
        let fp = self.fingerprint(OpKind::Reduce, T::DTYPE, Some(op), buf.len(), Some(root));
        self.blocking(fp, move |b| b.reduce(HostBuf::new(buf), op, root))
    }

    /// Async [`ProcessGroup::reduce`].
    pub fn reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
        root: usize,
    ) -> Work<Vec<T>> {
        if let Err(e) = self.check_root(root) {
            return Work::ready("reduce", Err(e));
        }
        let fp = self.fingerprint(OpKind::Reduce, T::DTYPE, Some(op), buf.len(), Some(root));
        self.spawn(fp, move |b| {
            b.reduce(HostBuf::new(&mut buf), op, root).map(|()| buf)
        })
    }

    // ----- all_gather -------------------------------------------------------------------------

    /// Concatenate every rank's `input` (rank order) into `output` (`input.len() * size`).
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let fp = self.fingerprint(OpKind::AllGather, T::DTYPE, None, input.len(), None);
        self.blocking(fp, move |b| {
            b.all_gather(RawHostSlice::new(input), HostBuf::new(output))
        })
    }

    /// Async [`ProcessGroup::all_gather`]; the work returns the gathered vector.
    pub fn all_gather_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let fp = self.fingerprint(OpKind::AllGather, T::DTYPE, None, input.len(), None);
        let n = input.len() * self.size();
        self.spawn(fp, move |b| {
            let mut out = vec![T::zeroed(); n];
            b.all_gather(RawHostSlice::new(&input), HostBuf::new(&mut out))
                .map(|()| out)
        })
    }

    // ----- reduce_scatter ---------------------------------------------------------------------

    /// Reduce `input` (`output.len() * size` elements) across ranks; rank `r` gets block `r`.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let fp = self.fingerprint(OpKind::ReduceScatter, T::DTYPE, Some(op), input.len(), None);
        self.blocking(fp, move |b| {
            b.reduce_scatter(RawHostSlice::new(input), HostBuf::new(output), op)
        })
    }

    /// Async [`ProcessGroup::reduce_scatter`]; the work returns this rank's block.
    pub fn reduce_scatter_async<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let fp = self.fingerprint(OpKind::ReduceScatter, T::DTYPE, Some(op), input.len(), None);
        let n = input.len() / self.size();
        self.spawn(fp, move |b| {
            let mut out = vec![T::zeroed(); n];
            b.reduce_scatter(RawHostSlice::new(&input), HostBuf::new(&mut out), op)
                .map(|()| out)
        })
    }

    // ----- in place (MPI_IN_PLACE) -------------------------------------------------------------

    fn check_blocks(&self, what: &str, len: usize) -> Result<()> {
        if !len.is_multiple_of(self.size()) {
            return Err(Error::InvalidArgument(format!(
                "{what}: the buffer's {len} elements are not {} equal blocks (one per rank)",
                self.size()
            )));
        }
        Ok(())
    }

    /// All-gather in place (`MPI_IN_PLACE`; PyTorch's `all_gather_into_tensor` with the input a
    /// view of the output): block `rank` of `buf` (`buf.len() / size` elements) is this rank's
    /// input; afterwards `buf` holds every rank's block in rank order. Interoperates with
    /// [`ProcessGroup::all_gather`] on other ranks. Saves the copy of the input.
    pub fn all_gather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        self.check_blocks("all_gather_in_place", buf.len())?;
        let n = buf.len() / self.size();
        let fp = self.fingerprint(OpKind::AllGather, T::DTYPE, None, n, None);
        self.blocking(fp, move |b| b.all_gather_in_place(HostBuf::new(buf)))
    }

    /// [`ProcessGroup::all_gather_in_place`] whose result the caller places where it wants it:
    /// block `rank` of `buf` is this rank's input (only read); `place(read)` is called once, on
    /// this thread, and calls `read(offset, dst)` for the ranges of the gathered buffer it
    /// wants, each filling `dst` with elements `offset..offset + dst.len()`. With cross-memory
    /// attach ([`ProcessGroup::direct_gather_min`]) the other ranks' blocks are read from their
    /// buffers straight into `dst`: one copy, where a gather then a copy out of `buf` makes
    /// three on shared memory. Otherwise `buf` is all-gathered in place and copied from; either
    /// way its other blocks are unspecified afterwards. Every rank must call this one (it does
    /// not pair with `all_gather_in_place`: a rank calling that one fails with a mismatch
    /// naming both). Blocking; an error of `place` is returned once the
    /// collective has completed on this rank.
    pub fn all_gather_in_place_to<T: Element>(
        &self,
        buf: &mut [T],
        place: Placement<'_, T>,
    ) -> Result<()> {
        self.check_blocks("all_gather_in_place_to", buf.len())?;
        let n = buf.len() / self.size();
        let fp = self.fingerprint(OpKind::AllGatherPlaced, T::DTYPE, None, n, None);
        self.blocking(fp, move |b| {
            let mut erased = |read: &mut dyn FnMut(usize, &mut [u8]) -> Result<()>| {
                place(&mut |offset, dst: &mut [T]| read(offset, bytemuck::cast_slice_mut(dst)))
            };
            b.all_gather_in_place_to(HostBuf::new(buf), &mut erased)
        })
    }

    /// Async [`ProcessGroup::all_gather_in_place`]; the work returns the buffer.
    pub fn all_gather_in_place_async<T: Element>(&self, mut buf: Vec<T>) -> Work<Vec<T>> {
        if let Err(e) = self.check_blocks("all_gather_in_place_async", buf.len()) {
            return Work::ready("all_gather_in_place", Err(e));
        }
        let n = buf.len() / self.size();
        let fp = self.fingerprint(OpKind::AllGather, T::DTYPE, None, n, None);
        self.spawn(fp, move |b| {
            b.all_gather_in_place(HostBuf::new(&mut buf)).map(|()| buf)
        })
    }

    /// Reduce-scatter in place: `buf` (`size` equal blocks) is this rank's input; afterwards
    /// block `rank` holds the reduction over ranks of their block `rank`, and the other blocks
    /// are unspecified (input or partial results). Interoperates with
    /// [`ProcessGroup::reduce_scatter`] on other ranks. Saves the output buffer and, on shared
    /// memory and TCP, every copy of the input.
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.check_blocks("reduce_scatter_in_place", buf.len())?;
        let fp = self.fingerprint(OpKind::ReduceScatter, T::DTYPE, Some(op), buf.len(), None);
        self.blocking(fp, move |b| {
            b.reduce_scatter_in_place(HostBuf::new(buf), op)
        })
    }

    /// Async [`ProcessGroup::reduce_scatter_in_place`]; the work returns the buffer.
    pub fn reduce_scatter_in_place_async<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        self.reduce_scatter_in_place_then("reduce_scatter_in_place_async", buf, op, |_| {})
    }

    /// Reduce-scatter that keeps only this rank's block, in the input's own memory (ZeRO
    /// stage 2's gradient shard): `buf` (`size` equal blocks) is this rank's input; the work
    /// returns `buf` holding block `rank` reduced over ranks, moved to the front, the rest of
    /// the allocation given back (`shrink_to_fit`). All of it runs on the communication thread,
    /// so the full buffer is not alive past the collective and no output buffer is allocated
    /// (or zero-filled) next to it, as [`reduce_scatter_async`](Self::reduce_scatter_async)
    /// does. Interoperates with the other reduce-scatters on other ranks.
    pub fn reduce_scatter_shard_async<T: Element>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        let n = buf.len() / self.size();
        let at = self.rank() * n;
        self.reduce_scatter_in_place_then("reduce_scatter_shard_async", buf, op, move |buf| {
            buf.copy_within(at..at + n, 0);
            buf.truncate(n);
            buf.shrink_to_fit();
        })
    }

    /// The async in-place reduce-scatter (`what` names it in errors), then `after(buf)` on the
    /// communication thread once it succeeded.
    fn reduce_scatter_in_place_then<T: Element>(
        &self,
        what: &'static str,
        mut buf: Vec<T>,
        op: ReduceOp,
        after: impl FnOnce(&mut Vec<T>) + Send + 'static,
    ) -> Work<Vec<T>> {
        if let Err(e) = self.check_blocks(what, buf.len()) {
            return Work::ready(what, Err(e));
        }
        let fp = self.fingerprint(OpKind::ReduceScatter, T::DTYPE, Some(op), buf.len(), None);
        self.spawn(fp, move |b| {
            b.reduce_scatter_in_place(HostBuf::new(&mut buf), op)?;
            after(&mut buf);
            Ok(buf)
        })
    }

    // ----- gather / scatter / all_to_all ------------------------------------------------------

    /// Gather every rank's `input` into `output` on `root` (`output` is required there and
    /// ignored elsewhere; length `input.len() * size`).
    pub fn gather<T: Element>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.check_root(root)?;
        let fp = self.fingerprint(OpKind::Gather, T::DTYPE, None, input.len(), Some(root));
        let output = output.filter(|_| self.rank() == root);
        self.blocking(fp, move |b| {
            b.gather(RawHostSlice::new(input), output.map(HostBuf::new), root)
        })
    }

    /// Async [`ProcessGroup::gather`]; the work returns `Some(gathered)` on the root.
    pub fn gather_async<T: Element>(&self, input: Vec<T>, root: usize) -> Work<Option<Vec<T>>> {
        if let Err(e) = self.check_root(root) {
            return Work::ready("gather", Err(e));
        }
        let fp = self.fingerprint(OpKind::Gather, T::DTYPE, None, input.len(), Some(root));
        let rank = self.rank();
        let n = input.len() * self.size();
        self.spawn(fp, move |b| {
            let mut out = (rank == root).then(|| vec![T::zeroed(); n]);
            b.gather(
                RawHostSlice::new(&input),
                out.as_deref_mut().map(HostBuf::new),
                root,
            )
            .map(|()| out)
        })
    }

    /// Scatter `root`'s `input` (`output.len() * size`; ignored elsewhere): rank `r` gets block `r`.
    pub fn scatter<T: Element>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.check_root(root)?;
        let fp = self.fingerprint(OpKind::Scatter, T::DTYPE, None, output.len(), Some(root));
        let input = input.filter(|_| self.rank() == root);
        self.blocking(fp, move |b| {
            b.scatter(input.map(RawHostSlice::new), HostBuf::new(output), root)
        })
    }

    /// Async [`ProcessGroup::scatter`] of `count` elements per rank; the work returns this rank's block.
    pub fn scatter_async<T: Element>(
        &self,
        input: Option<Vec<T>>,
        count: usize,
        root: usize,
    ) -> Work<Vec<T>> {
        if let Err(e) = self.check_root(root) {
            return Work::ready("scatter", Err(e));
        }
        let fp = self.fingerprint(OpKind::Scatter, T::DTYPE, None, count, Some(root));
        let input = input.filter(|_| self.rank() == root);
        self.spawn(fp, move |b| {
            let mut out = vec![T::zeroed(); count];
            b.scatter(
                input.as_deref().map(RawHostSlice::new),
                HostBuf::new(&mut out),
                root,
            )
            .map(|()| out)
        })
    }

    /// All-to-all with equal blocks: block `j` of `input` goes to rank `j`, block `i` of
    /// `output` comes from rank `i` (both `n * size` elements).
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        let fp = self.fingerprint(OpKind::AllToAll, T::DTYPE, None, input.len(), None);
        self.blocking(fp, move |b| {
            b.all_to_all(RawHostSlice::new(input), HostBuf::new(output))
        })
    }

    /// Async [`ProcessGroup::all_to_all`]; the work returns the output.
    pub fn all_to_all_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let fp = self.fingerprint(OpKind::AllToAll, T::DTYPE, None, input.len(), None);
        self.spawn(fp, move |b| {
            let mut out = vec![T::zeroed(); input.len()];
            b.all_to_all(RawHostSlice::new(&input), HostBuf::new(&mut out))
                .map(|()| out)
        })
    }

    // ----- barrier, send / recv ---------------------------------------------------------------

    /// Wait until every rank has reached the barrier.
    pub fn barrier(&self) -> Result<()> {
        let fp = self.fingerprint(OpKind::Barrier, DType::U8, None, 0, None);
        self.blocking(fp, |b| b.barrier())
    }

    /// Async [`ProcessGroup::barrier`].
    pub fn barrier_async(&self) -> Work<()> {
        let fp = self.fingerprint(OpKind::Barrier, DType::U8, None, 0, None);
        self.spawn(fp, |b| b.barrier())
    }

    /// Send `buf` to rank `dst` (matched by a [`ProcessGroup::recv`] of the same length there).
    pub fn send<T: Element>(&self, buf: &[T], dst: usize) -> Result<()> {
        self.check_peer(dst)?;
        let fp = self.p2p_fingerprint::<T>(buf.len(), dst, true);
        self.blocking(fp, move |b| b.send(RawHostSlice::new(buf), dst))
    }

    /// Receive into `buf` from rank `src`.
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize) -> Result<()> {
        self.check_peer(src)?;
        let fp = self.p2p_fingerprint::<T>(buf.len(), src, false);
        self.blocking(fp, move |b| b.recv(HostBuf::new(buf), src))
    }

    /// Async [`ProcessGroup::send`].
    pub fn send_async<T: Element>(&self, buf: Vec<T>, dst: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_peer(dst) {
            return Work::ready("send", Err(e));
        }
        let fp = self.p2p_fingerprint::<T>(buf.len(), dst, true);
        self.spawn(fp, move |b| {
            b.send(RawHostSlice::new(&buf), dst).map(|()| buf)
        })
    }

    /// Async [`ProcessGroup::recv`] of `count` elements.
    pub fn recv_async<T: Element>(&self, count: usize, src: usize) -> Work<Vec<T>> {
        if let Err(e) = self.check_peer(src) {
            return Work::ready("recv", Err(e));
        }
        let fp = self.p2p_fingerprint::<T>(count, src, false);
        self.spawn(fp, move |b| {
            let mut buf = vec![T::zeroed(); count];
            b.recv(HostBuf::new(&mut buf), src).map(|()| buf)
        })
    }

    pub(crate) fn check_peer(&self, peer: usize) -> Result<()> {
        if peer >= self.size() || peer == self.rank() {
            return Err(Error::InvalidArgument(format!(
                "send/recv peer {peer} must be another rank of this group of size {} (this is rank {})",
                self.size(),
                self.rank()
            )));
        }
        Ok(())
    }

    /// The engine replaces `seq` with the per-pair counter; `reduce: Some` marks a send.
    pub(crate) fn p2p_fingerprint<T: Element>(
        &self,
        count: usize,
        peer: usize,
        is_send: bool,
    ) -> Fingerprint {
        let mut fp = self.fingerprint(OpKind::SendRecv, T::DTYPE, None, count, Some(peer));
        fp.reduce = is_send.then_some(ReduceOp::Sum);
        fp
    }

    // ----- serialized objects -----------------------------------------------------------------

    /// Broadcast a byte string of any length from `root` (`data` is ignored on other ranks).
    pub fn broadcast_bytes(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        self.check_root(root)?;
        let fp = self.fingerprint(OpKind::Broadcast, DType::U8, None, 0, Some(root));
        let mine = (self.rank() == root).then(|| data.to_vec());
        self.blocking(fp, move |b| {
            let mut len = [mine.as_ref().map_or(0, |d| d.len() as i64)];
            b.broadcast(HostBuf::new(&mut len), root)?;
            let mut out = mine.unwrap_or_else(|| vec![0u8; len[0] as usize]);
            b.broadcast(HostBuf::new(&mut out), root)?;
            Ok(out)
        })
    }

    /// Gather a byte string of any length from every rank, in rank order, on every rank.
    pub fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let fp = self.fingerprint(OpKind::AllGather, DType::U8, None, 0, None);
        let rank = self.rank();
        self.blocking(fp, move |b| {
            let t = b.transport();
            let p = t.size();
            let mut lens = vec![0i64; p];
            lens[rank] = data.len() as i64;
            ring::all_gather(t, &mut lens)?;
            let max = lens.iter().copied().max().unwrap_or(0) as usize;
            let mut all = vec![0u8; max * p];
            all[rank * max..rank * max + data.len()].copy_from_slice(data);
            ring::all_gather(t, &mut all)?;
            Ok((0..p)
                .map(|i| all[i * max..i * max + lens[i] as usize].to_vec())
                .collect())
        })
    }
}
