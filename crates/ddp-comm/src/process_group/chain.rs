//! Chained collectives: a computation that issues several collectives, queued as one job.
//!
//! A communication hook often has a second half that depends on its first collective (PowerSGD:
//! all-reduce `P`, orthogonalize it, compute `Q = MᵀP`, all-reduce `Q`). Run from the training
//! thread, that second half waits until the reducer asks for the bucket, after backward, and its
//! collective queues behind every later bucket's. PyTorch chains it with `Future.then`, so it
//! runs as soon as the first collective is done; here [`ProcessGroup::chain_async`] queues the
//! whole chain as one job on the group's thread:
//!
//! ```text
//!   training thread:  backward ─ bucket 0 ready ─ backward ─ bucket 1 ready ─ wait ─ wait
//!   group thread:                [all_reduce P0 · Q0 = MᵀP0 · all_reduce Q0] [P1 · Q1 · Q1]
//! ```
//!
//! Collectives stay in the order issued on every rank (a chain's collectives come right after
//! one another, before anything issued after the chain), so ranks still agree on the sequence.
//! A failed collective breaks the group as any other; a chain that returns an error without a
//! failed collective leaves the group usable (the error goes to its [`Work`]).

use super::engine::Engine;
use super::{new_fingerprint, ProcessGroup};
use crate::backend::HostBuf;
use crate::dtype::{Element, ReduceOp};
use crate::transport::OpKind;
use crate::work::{self, Work};
use crate::Result;
use std::time::Duration;

/// The group as seen from inside a chain: collectives on slices, run at once, in order, on
/// the group's thread (see [`ProcessGroup::chain_async`]).
pub struct Chain<'a> {
    engine: &'a mut Engine,
    timeout: Duration,
    rank: usize,
    size: usize,
}

impl Chain<'_> {
    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// [`ProcessGroup::all_reduce`], run now.
    pub fn all_reduce<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let fp = new_fingerprint(OpKind::AllReduce, T::DTYPE, Some(op), buf.len(), None);
        self.engine
            .run(fp, self.timeout, |b| b.all_reduce(HostBuf::new(buf), op))
    }
}

impl ProcessGroup {
    /// Queue `f` as one job on the group's thread, after everything issued before it; the
    /// collectives it issues through its [`Chain`] run in its order, before anything issued
    /// after this call. The work completes with `f`'s result. `what` names the chain in the
    /// error of a work whose job never ran (the group shut down).
    ///
    /// `f` runs on the group's thread: collectives issued after this call wait for it, so
    /// it should compute only what the next collective needs.
    pub fn chain_async<R: Send + 'static>(
        &self,
        what: &str,
        f: impl FnOnce(&mut Chain<'_>) -> Result<R> + Send + 'static,
    ) -> Work<R> {
        let (work, done) = work::pending::<R>(format!("{what} on rank {}", self.rank()));
        let (timeout, rank, size) = (self.timeout, self.rank(), self.size());
        self.enqueue(Box::new(move |engine: &mut Engine| {
            let mut chain = Chain {
                engine,
                timeout,
                rank,
                size,
            };
            done.complete(f(&mut chain))
        }));
        work
    }
}
