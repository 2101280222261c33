//! The collective API the reference checker ([`super::check_all`]) drives, so that one checker
//! holds host groups ([`ProcessGroup`]), staged device groups over host memory
//! ([`StagedGroup`] with `Vec` buffers) and, in the GPU tests, CUDA groups to the same
//! sequential reference. Buffers cross as `Vec`s; `asynchronous` picks the `*_async` form.

use super::Num;
use ddp_comm::device::staged::StagedGroup;
use ddp_comm::{ProcessGroup, ReduceOp};

/// The collectives every group kind offers (gather, scatter and all_to_all are host-only: see
/// [`Collectives::host`]).
pub trait Collectives<T: Num> {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn all_reduce(&self, buf: Vec<T>, op: ReduceOp, asynchronous: bool) -> Vec<T>;
    fn broadcast(&self, buf: Vec<T>, root: usize, asynchronous: bool) -> Vec<T>;
    fn reduce(&self, buf: Vec<T>, op: ReduceOp, root: usize, asynchronous: bool) -> Vec<T>;
    /// This rank's block of the reduction of `full` (`size` blocks).
    fn reduce_scatter(&self, full: Vec<T>, op: ReduceOp, asynchronous: bool) -> Vec<T>;
    /// Every rank's `mine`, concatenated in rank order.
    fn all_gather(&self, mine: Vec<T>, asynchronous: bool) -> Vec<T>;
    fn send(&self, buf: Vec<T>, dst: usize);
    fn recv(&self, n: usize, src: usize) -> Vec<T>;
    fn barrier(&self);
    /// The host group, for the host-only collectives.
    fn host(&self) -> Option<&ProcessGroup> {
        None
    }
}

impl<T: Num> Collectives<T> for ProcessGroup {
    fn rank(&self) -> usize {
        ProcessGroup::rank(self)
    }
    fn size(&self) -> usize {
        ProcessGroup::size(self)
    }
    fn all_reduce(&self, mut buf: Vec<T>, op: ReduceOp, asynchronous: bool) -> Vec<T> {
        if asynchronous {
            return self.all_reduce_async(buf, op).wait().unwrap();
        }
        ProcessGroup::all_reduce(self, &mut buf, op).unwrap();
        buf
    }
    fn broadcast(&self, mut buf: Vec<T>, root: usize, asynchronous: bool) -> Vec<T> {
        if asynchronous {
            return self.broadcast_async(buf, root).wait().unwrap();
        }
        ProcessGroup::broadcast(self, &mut buf, root).unwrap();
        buf
    }
    fn reduce(&self, mut buf: Vec<T>, op: ReduceOp, root: usize, asynchronous: bool) -> Vec<T> {
        if asynchronous {
            return self.reduce_async(buf, op, root).wait().unwrap();
        }
        ProcessGroup::reduce(self, &mut buf, op, root).unwrap();
        buf
    }
    fn reduce_scatter(&self, full: Vec<T>, op: ReduceOp, asynchronous: bool) -> Vec<T> {
        if asynchronous {
            return self.reduce_scatter_async(full, op).wait().unwrap();
        }
        let mut out = vec![T::from_i(0); full.len() / ProcessGroup::size(self)];
        ProcessGroup::reduce_scatter(self, &full, &mut out, op).unwrap();
        out
    }
    fn all_gather(&self, mine: Vec<T>, asynchronous: bool) -> Vec<T> {
        if asynchronous {
            return self.all_gather_async(mine).wait().unwrap();
        }
        let mut out = vec![T::from_i(0); mine.len() * ProcessGroup::size(self)];
        ProcessGroup::all_gather(self, &mine, &mut out).unwrap();
        out
    }
    fn send(&self, buf: Vec<T>, dst: usize) {
        ProcessGroup::send(self, &buf, dst).unwrap();
    }
    fn recv(&self, n: usize, src: usize) -> Vec<T> {
        let mut buf = vec![T::from_i(0); n];
        ProcessGroup::recv(self, &mut buf, src).unwrap();
        buf
    }
    fn barrier(&self) {
        ProcessGroup::barrier(self).unwrap();
    }
    fn host(&self) -> Option<&ProcessGroup> {
        Some(self)
    }
}

/// The staged device path with host memory standing in for the device (`Vec<T>` is a
/// `StageBuffer`): the same code the CUDA groups run when staged.
impl<T: Num> Collectives<T> for StagedGroup {
    fn rank(&self) -> usize {
        self.process_group().rank()
    }
    fn size(&self) -> usize {
        self.process_group().size()
    }
    fn all_reduce(&self, mut buf: Vec<T>, op: ReduceOp, asynchronous: bool) -> Vec<T> {
        if asynchronous {
            return self.all_reduce_async(buf, op).wait().unwrap();
        }
        StagedGroup::all_reduce(self, &mut buf, op).unwrap();
        buf
    }
    fn broadcast(&self, mut buf: Vec<T>, root: usize, asynchronous: bool) -> Vec<T> {
        if asynchronous {
            return self.broadcast_async(buf, root).wait().unwrap();
        }
        StagedGroup::broadcast(self, &mut buf, root).unwrap();
        buf
    }
    fn reduce(&self, mut buf: Vec<T>, op: ReduceOp, root: usize, asynchronous: bool) -> Vec<T> {
        if asynchronous {
            return self.reduce_async(buf, op, root).wait().unwrap();
        }
        StagedGroup::reduce(self, &mut buf, op, root).unwrap();
        buf
    }
    fn reduce_scatter(&self, full: Vec<T>, op: ReduceOp, asynchronous: bool) -> Vec<T> {
        let mut out = vec![T::from_i(0); full.len() / Collectives::<T>::size(self)];
        if asynchronous {
            return self.reduce_scatter_async(full, out, op).wait().unwrap().1;
        }
        StagedGroup::reduce_scatter(self, &full, &mut out, op).unwrap();
        out
    }
    fn all_gather(&self, mine: Vec<T>, asynchronous: bool) -> Vec<T> {
        let mut out = vec![T::from_i(0); mine.len() * Collectives::<T>::size(self)];
        if asynchronous {
            return self.all_gather_async(mine, out).wait().unwrap().1;
        }
        StagedGroup::all_gather(self, &mine, &mut out).unwrap();
        out
    }
    fn send(&self, buf: Vec<T>, dst: usize) {
        StagedGroup::send(self, &buf, dst).unwrap();
    }
    fn recv(&self, n: usize, src: usize) -> Vec<T> {
        let mut buf = vec![T::from_i(0); n];
        StagedGroup::recv(self, &mut buf, src).unwrap();
        buf
    }
    fn barrier(&self) {
        StagedGroup::barrier(self).unwrap();
    }
}
