//! What a collective is: its [`Fingerprint`] (sequence number, [`OpKind`], dtype, reduction,
//! element count, root). Every rank of a group must issue the same fingerprints in the same
//! order; every transport message carries the sender's ([`crate::transport`]), the device
//! path checks it before a new shape, and every error of a collective names it
//! ([`crate::Error`]).
//!
//! A leaf (it needs only [`crate::dtype`]), so that the error type and the transports both
//! use it without depending on each other. Also here: the wire codes shared by every
//! encoding of a fingerprint ([`OpKind`]'s code, `NO_REDUCE`, `Fingerprint::from_codes`).

use crate::dtype::{DType, ReduceOp};
use std::fmt;

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
    /// [`crate::ProcessGroup::all_gather_in_place_to`]: an all-gather whose caller places the
    /// result. On shared memory it runs another protocol than [`OpKind::AllGather`] (each rank
    /// reads the peers' buffers), so it has its own code: a rank calling one while a peer calls
    /// the other gets a mismatch naming both, not a wait until the timeout.
    AllGatherPlaced,
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
            AllGatherPlaced,
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
            AllGatherPlaced => "all_gather_in_place_to",
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

/// `reduce` byte of a fingerprint without a reduction op (in every encoding: transport
/// headers, shared-memory wait words, the device check, MPI).
pub(crate) const NO_REDUCE: u8 = 0xFF;

impl Fingerprint {
    /// Rebuild a fingerprint from its wire codes; `None` for unknown codes.
    pub(crate) fn from_codes(
        seq: u64,
        count: u64,
        op: u8,
        dtype: u8,
        reduce: u8,
        root: u32,
    ) -> Option<Fingerprint> {
        Some(Fingerprint {
            seq,
            op: OpKind::from_code(op)?,
            dtype: DType::from_code(dtype)?,
            reduce: if reduce == NO_REDUCE {
                None
            } else {
                Some(ReduceOp::from_code(reduce)?)
            },
            count,
            root,
        })
    }
}
