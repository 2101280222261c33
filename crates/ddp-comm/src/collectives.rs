//! The collectives every group offers, as one trait: [`Collectives`], implemented by the host
//! [`ProcessGroup`] (buffers: `Vec<T>`), the relay path over host memory
//! ([`crate::device::relay::RelayGroup`], buffers: `Vec<T>`) and, with feature `nccl`, the CUDA
//! group (`cuda::CudaGroup`, buffers: `CudaSlice<T>`). Code written against it (a checker, a
//! benchmark, a reducer) runs on any of them; each group's own methods stay the fuller API
//! (gather, scatter, all_to_all and the in-place forms are host-only).
//!
//! Each collective comes blocking, on borrowed buffers, and `*_async`, on owned ones, returning
//! a handle ([`Wait`]: [`Work`] on the host, `CudaWork` on a device) that gives the buffer back.

use crate::dtype::{Element, ReduceOp};
use crate::work::Work;
use crate::{ProcessGroup, Result};

/// A collective in flight that yields an `R` ([`Work`], `cuda::CudaWork`).
pub trait Wait<R> {
    /// Whether it finished (successfully or not).
    fn is_completed(&self) -> bool;

    /// Block until it finished (bounded by the group's timeout) and return its output.
    fn wait(self) -> Result<R>;
}

impl<R> Wait<R> for Work<R> {
    fn is_completed(&self) -> bool {
        Work::is_completed(self)
    }

    fn wait(self) -> Result<R> {
        Work::wait(self)
    }
}

/// The collectives of a group on buffers of `T` ([`Collectives::Buf`]): all_reduce, broadcast,
/// reduce, all_gather, reduce_scatter, send/recv and barrier, blocking and async.
pub trait Collectives<T: Element> {
    /// The buffer the collectives take (`Vec<T>` in host memory, `CudaSlice<T>` on a GPU).
    type Buf: Send + 'static;
    /// What an `*_async` collective returns: it gives the (output) buffer back.
    type Pending: Wait<Self::Buf>;

    /// This rank in the group.
    fn rank(&self) -> usize;

    /// Number of ranks.
    fn size(&self) -> usize;

    /// A buffer holding a copy of `host` (on a device: uploaded, ordered like the collectives).
    fn copy_from_host(&self, host: &[T]) -> Result<Self::Buf>;

    /// A host copy of `buf`.
    fn copy_to_host(&self, buf: &Self::Buf) -> Result<Vec<T>>;

    /// Reduce `buf` across all ranks with `op`; every rank gets the result.
    fn all_reduce(&self, buf: &mut Self::Buf, op: ReduceOp) -> Result<()>;

    /// Async [`Collectives::all_reduce`]; the work gives the buffer back.
    fn all_reduce_async(&self, buf: Self::Buf, op: ReduceOp) -> Self::Pending;

    /// Copy `root`'s `buf` into every rank's `buf`.
    fn broadcast(&self, buf: &mut Self::Buf, root: usize) -> Result<()>;

    /// Async [`Collectives::broadcast`]; the work gives the buffer back.
    fn broadcast_async(&self, buf: Self::Buf, root: usize) -> Self::Pending;

    /// Reduce every rank's `buf` into `root`'s `buf` (other ranks' buffers are unchanged).
    fn reduce(&self, buf: &mut Self::Buf, op: ReduceOp, root: usize) -> Result<()>;

    /// Async [`Collectives::reduce`]; the work gives the buffer back.
    fn reduce_async(&self, buf: Self::Buf, op: ReduceOp, root: usize) -> Self::Pending;

    /// Concatenate every rank's `input` (rank order) into `output` (`input.len() * size`).
    fn all_gather(&self, input: &Self::Buf, output: &mut Self::Buf) -> Result<()>;

    /// Async [`Collectives::all_gather`]; the work returns the gathered buffer.
    fn all_gather_async(&self, input: Self::Buf) -> Self::Pending;

    /// Reduce `input` (`output.len() * size` elements) across ranks; rank `r` gets block `r`.
    fn reduce_scatter(&self, input: &Self::Buf, output: &mut Self::Buf, op: ReduceOp)
        -> Result<()>;

    /// Async [`Collectives::reduce_scatter`]; the work returns this rank's block.
    fn reduce_scatter_async(&self, input: Self::Buf, op: ReduceOp) -> Self::Pending;

    /// Send `buf` to rank `dst` (matched by a [`Collectives::recv`] of the same length there).
    fn send(&self, buf: &Self::Buf, dst: usize) -> Result<()>;

    /// Receive into `buf` from rank `src`.
    fn recv(&self, buf: &mut Self::Buf, src: usize) -> Result<()>;

    /// Wait until every rank has reached the barrier.
    fn barrier(&self) -> Result<()>;
}

/// The methods of [`Collectives`] that a group's own methods of the same names implement, for
/// its `impl Collectives` block (`$ty`: the group; `, gather_async` adds `all_gather_async` and
/// `reduce_scatter_async` where the group's own take the same arguments).
macro_rules! forward_collectives {
    ($ty:ty, gather_async) => {
        fn all_gather_async(&self, input: Self::Buf) -> Self::Pending {
            <$ty>::all_gather_async(self, input)
        }
        fn reduce_scatter_async(&self, input: Self::Buf, op: $crate::ReduceOp) -> Self::Pending {
            <$ty>::reduce_scatter_async(self, input, op)
        }
        $crate::collectives::forward_collectives!($ty);
    };
    ($ty:ty) => {
        fn rank(&self) -> usize {
            <$ty>::rank(self)
        }
        fn size(&self) -> usize {
            <$ty>::size(self)
        }
        fn all_reduce(&self, buf: &mut Self::Buf, op: $crate::ReduceOp) -> $crate::Result<()> {
            <$ty>::all_reduce(self, buf, op)
        }
        fn all_reduce_async(&self, buf: Self::Buf, op: $crate::ReduceOp) -> Self::Pending {
            <$ty>::all_reduce_async(self, buf, op)
        }
        fn broadcast(&self, buf: &mut Self::Buf, root: usize) -> $crate::Result<()> {
            <$ty>::broadcast(self, buf, root)
        }
        fn broadcast_async(&self, buf: Self::Buf, root: usize) -> Self::Pending {
            <$ty>::broadcast_async(self, buf, root)
        }
        fn reduce(
            &self,
            buf: &mut Self::Buf,
            op: $crate::ReduceOp,
            root: usize,
        ) -> $crate::Result<()> {
            <$ty>::reduce(self, buf, op, root)
        }
        fn reduce_async(&self, buf: Self::Buf, op: $crate::ReduceOp, root: usize) -> Self::Pending {
            <$ty>::reduce_async(self, buf, op, root)
        }
        fn all_gather(&self, input: &Self::Buf, output: &mut Self::Buf) -> $crate::Result<()> {
            <$ty>::all_gather(self, input, output)
        }
        fn reduce_scatter(
            &self,
            input: &Self::Buf,
            output: &mut Self::Buf,
            op: $crate::ReduceOp,
        ) -> $crate::Result<()> {
            <$ty>::reduce_scatter(self, input, output, op)
        }
        fn send(&self, buf: &Self::Buf, dst: usize) -> $crate::Result<()> {
            <$ty>::send(self, buf, dst)
        }
        fn recv(&self, buf: &mut Self::Buf, src: usize) -> $crate::Result<()> {
            <$ty>::recv(self, buf, src)
        }
        fn barrier(&self) -> $crate::Result<()> {
            <$ty>::barrier(self)
        }
    };
}
pub(crate) use forward_collectives;

impl<T: Element> Collectives<T> for ProcessGroup {
    type Buf = Vec<T>;
    type Pending = Work<Vec<T>>;

    fn copy_from_host(&self, host: &[T]) -> Result<Vec<T>> {
        Ok(host.to_vec())
    }
    fn copy_to_host(&self, buf: &Vec<T>) -> Result<Vec<T>> {
        Ok(buf.clone())
    }
    forward_collectives!(ProcessGroup, gather_async);
}
