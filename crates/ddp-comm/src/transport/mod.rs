//! Transports move bytes between the ranks of one group; algorithms are written against the
//! [`Transport`] trait only, so a new transport (shared memory, NCCL) needs no algorithm change.
//!
//! Every message carries the [`Fingerprint`] of the collective that sent it; the receiving side
//! compares it with its own and fails with [`Error::Mismatch`](crate::Error::Mismatch) (naming
//! both sides) instead of reading data that belongs to another collective. A transport that fails
//! tells the other ranks (an abort frame, or closing its connections) so no survivor hangs.
//!
//! - [`tcp`]: a full mesh of TCP connections, one per pair of ranks (works across hosts).
//! - [`shm`]: per-pair rings in one shared-memory segment (ranks on one host), plus the hooks of
//!   the shared-memory all-reduce fast path.

pub mod shm;
pub mod tcp;

use crate::dtype::{DType, ReduceOp};
use crate::Result;
use std::fmt;
use std::time::Instant;

/// The kind of operation a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum OpKind {
    AllReduce = 0,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    Gather,
    Scatter,
    AllToAll,
    Barrier,
    SendRecv,
    Rendezvous,
}

impl OpKind {
    pub(crate) fn from_code(code: u8) -> Option<OpKind> {
        use OpKind::*;
        [
            AllReduce,
            Broadcast,
            Reduce,
            AllGather,
            ReduceScatter,
            Gather,
            Scatter,
            AllToAll,
            Barrier,
            SendRecv,
            Rendezvous,
        ]
        .get(code as usize)
        .copied()
    }

    /// The name users know (`all_reduce`, `broadcast`, ...).
    pub fn name(self) -> &'static str {
        use OpKind::*;
        match self {
            AllReduce => "all_reduce",
            Broadcast => "broadcast",
            Reduce => "reduce",
            AllGather => "all_gather",
            ReduceScatter => "reduce_scatter",
            Gather => "gather",
            Scatter => "scatter",
            AllToAll => "all_to_all",
            Barrier => "barrier",
            SendRecv => "send/recv",
            Rendezvous => "rendezvous",
        }
    }
}

/// What a collective is: every rank of a group must issue the same fingerprints in the same order.
/// Displays as `all_reduce(sum, f32 x 1024)` (the sequence number is reported separately).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint {
    /// Sequence number within the group (for send/recv: within the pair of ranks).
    pub seq: u64,
    pub op: OpKind,
    pub dtype: DType,
    pub reduce: Option<ReduceOp>,
    /// Element count of the per-rank buffer the caller passed.
    pub count: u64,
    /// Root rank for rooted collectives, `u32::MAX` otherwise.
    pub root: u32,
}

impl Fingerprint {
    pub const NO_ROOT: u32 = u32::MAX;
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.op.name())?;
        if let Some(r) = self.reduce {
            write!(f, "{r}, ")?;
        }
        write!(f, "{} x {}", self.dtype, self.count)?;
        if self.root != Self::NO_ROOT {
            write!(f, ", root {}", self.root)?;
        }
        write!(f, ")")
    }
}

/// One receive of a [`Transport::exchange`].
pub struct Recv<'a> {
    pub from: usize,
    pub buf: &'a mut [u8],
}

/// One send of a [`Transport::exchange`].
pub struct Send<'a> {
    pub to: usize,
    pub data: &'a [u8],
}

/// Point-to-point byte movement between the ranks of one group.
///
/// Messages between a pair of ranks are delivered in order; each receive must be matched by a
/// send of exactly the same length on the peer (a length difference is a mismatch error).
pub trait Transport: std::marker::Send {
    /// This process's rank within the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Tag all following messages with `fp` and fail any operation after `deadline`.
    fn begin(&mut self, fp: Fingerprint, deadline: Instant);
    /// Perform all `sends` and `recvs` concurrently (so that a ring step cannot deadlock) and
    /// return when all are complete. Fails naming the peer on close, abort, mismatch or timeout.
    fn exchange(&mut self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> Result<()>;
    /// Tell every peer this group is broken (best effort) and fail all later operations with `cause`.
    fn abort(&mut self, cause: &crate::Error);

    /// The shared-memory transport behind this one, if it is one (enables the algorithms of
    /// [`crate::algorithms::shm_allreduce`]).
    fn shm(&mut self) -> Option<&mut shm::ShmTransport> {
        None
    }

    /// Send `data` to `to`.
    fn send(&mut self, to: usize, data: &[u8]) -> Result<()> {
        self.exchange(&mut [Send { to, data }], &mut [])
    }
    /// Receive exactly `buf.len()` bytes from `from`.
    fn recv(&mut self, from: usize, buf: &mut [u8]) -> Result<()> {
        self.exchange(&mut [], &mut [Recv { from, buf }])
    }
    /// Send `data` to `to` while receiving `buf` from `from`.
    fn send_recv(&mut self, to: usize, data: &[u8], from: usize, buf: &mut [u8]) -> Result<()> {
        self.exchange(&mut [Send { to, data }], &mut [Recv { from, buf }])
    }
}
