//! The reference checker ([`super::check_all`]) drives every group kind through the library's
//! [`Collectives`] trait: host groups ([`ddp_comm::ProcessGroup`]), the relay path over host
//! memory ([`ddp_comm::device::relay::RelayGroup`]) and, in the GPU tests, CUDA groups. [`Vecs`]
//! moves `Vec`s in and out of the group's buffers; `asynchronous` picks the `*_async` form.

use super::Num;
use ddp_comm::{Collectives, ReduceOp, Wait};

/// A group's collectives on host `Vec`s (copied to and from its buffers).
pub struct Vecs<'g, G>(pub &'g G);

impl<G> Vecs<'_, G> {
    fn up<T: Num>(&self, v: &[T]) -> G::Buf
    where
        G: Collectives<T>,
    {
        self.0.copy_from_host(v).unwrap()
    }

    fn down<T: Num>(&self, b: &G::Buf) -> Vec<T>
    where
        G: Collectives<T>,
    {
        self.0.copy_to_host(b).unwrap()
    }

    /// A collective on one buffer holding `v`: `blocking` on it, or `asynchronous` on it owned.
    fn one<T: Num>(
        &self,
        v: &[T],
        asynchronous: bool,
        blocking: impl FnOnce(&mut G::Buf) -> ddp_comm::Result<()>,
        spawn: impl FnOnce(G::Buf) -> G::Pending,
    ) -> Vec<T>
    where
        G: Collectives<T>,
    {
        let mut d = self.up(v);
        if asynchronous {
            d = spawn(d).wait().unwrap();
        } else {
            blocking(&mut d).unwrap();
        }
        self.down(&d)
    }

    /// A collective from `input` into an output of `n` elements.
    fn two<T: Num>(
        &self,
        input: &[T],
        n: usize,
        asynchronous: bool,
        blocking: impl FnOnce(&G::Buf, &mut G::Buf) -> ddp_comm::Result<()>,
        spawn: impl FnOnce(G::Buf) -> G::Pending,
    ) -> Vec<T>
    where
        G: Collectives<T>,
    {
        let d = self.up(input);
        let out = if asynchronous {
            spawn(d).wait().unwrap()
        } else {
            let mut out = self.up(&vec![T::from_i(0); n]);
            blocking(&d, &mut out).unwrap();
            out
        };
        self.down(&out)
    }

    pub fn all_reduce<T: Num>(&self, buf: Vec<T>, op: ReduceOp, a: bool) -> Vec<T>
    where
        G: Collectives<T>,
    {
        let g = self.0;
        self.one(
            &buf,
            a,
            |d| g.all_reduce(d, op),
            |d| g.all_reduce_async(d, op),
        )
    }

    pub fn broadcast<T: Num>(&self, buf: Vec<T>, root: usize, a: bool) -> Vec<T>
    where
        G: Collectives<T>,
    {
        let g = self.0;
        self.one(
            &buf,
            a,
            |d| g.broadcast(d, root),
            |d| g.broadcast_async(d, root),
        )
    }

    pub fn reduce<T: Num>(&self, buf: Vec<T>, op: ReduceOp, root: usize, a: bool) -> Vec<T>
    where
        G: Collectives<T>,
    {
        let g = self.0;
        self.one(
            &buf,
            a,
            |d| g.reduce(d, op, root),
            |d| g.reduce_async(d, op, root),
        )
    }

    /// This rank's block of the reduction of `full` (`size` blocks).
    pub fn reduce_scatter<T: Num>(&self, full: Vec<T>, op: ReduceOp, a: bool) -> Vec<T>
    where
        G: Collectives<T>,
    {
        let g = self.0;
        let n = full.len() / g.size();
        self.two(
            &full,
            n,
            a,
            |i, o| g.reduce_scatter(i, o, op),
            |i| g.reduce_scatter_async(i, op),
        )
    }

    /// Every rank's `mine`, concatenated in rank order.
    pub fn all_gather<T: Num>(&self, mine: Vec<T>, a: bool) -> Vec<T>
    where
        G: Collectives<T>,
    {
        let g = self.0;
        let n = mine.len() * g.size();
        self.two(
            &mine,
            n,
            a,
            |i, o| g.all_gather(i, o),
            |i| g.all_gather_async(i),
        )
    }

    pub fn send<T: Num>(&self, buf: Vec<T>, dst: usize)
    where
        G: Collectives<T>,
    {
        self.0.send(&self.up(&buf), dst).unwrap();
    }

    pub fn recv<T: Num>(&self, n: usize, src: usize) -> Vec<T>
    where
        G: Collectives<T>,
    {
        let mut d = self.up(&vec![T::from_i(0); n]);
        self.0.recv(&mut d, src).unwrap();
        self.down(&d)
    }

    pub fn barrier<T: Num>(&self)
    where
        G: Collectives<T>,
    {
        self.0.barrier().unwrap();
    }
}
