//! Transports move bytes between the ranks of one group; algorithms are written against the
//! [`Transport`] trait only, so a new transport needs no algorithm change. Which collective runs
//! on which transport is the business of the backends above ([`crate::backend`]).
//!
//! Every message carries the [`Fingerprint`] of the collective that sent it; the receiving side
//! compares it with its own and fails with [`Error::Mismatch`](crate::Error::Mismatch) (naming
//! both sides) instead of reading data that belongs to another collective. A transport that fails
//! tells the other ranks (an abort frame, or closing its connections) so no survivor hangs.
//!
//! - [`tcp`]: a full mesh of TCP connections, one per pair of ranks (works across hosts).
//! - [`shm`]: per-pair rings in one shared-memory segment (ranks on one host), plus the hooks of
//!   the direct shared-memory paths (all-reduce, large reduce-scatter).
//! - [`stall`]: the warning a collective logs while it waits long (which ranks have not arrived).
//! - [`hierarchical`]: ranks on several hosts: the TCP mesh, plus shared memory inside each host
//!   and a leaders-only view of the mesh for the hierarchical all-reduce.
//! - [`subset`]: some ranks of a transport as a group of their own (renumbered), for running
//!   an algorithm among them.

pub mod hierarchical;
pub mod shm;
pub mod stall;
pub mod subset;
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

/// Every message of every transport starts with this 40-byte header:
///
/// ```text
/// 0      4    5   6      7        8      12    20      28            36    40
/// | magic | kind | op | dtype | reduce | root | seq | count | payload len | pad |
/// ```
///
/// Each transport has its own `magic`; `kind` is transport-specific (TCP: data or abort).
pub(crate) const HEADER_LEN: usize = 40;
/// `reduce` byte of a fingerprint without a reduction op.
pub(crate) const NO_REDUCE: u8 = 0xFF;

/// A decoded message header.
pub(crate) struct Header {
    pub kind: u8,
    /// `None` when the codes are unknown (a peer speaking another protocol version).
    pub fp: Option<Fingerprint>,
    pub len: u64,
}

pub(crate) fn encode_header(magic: u32, kind: u8, fp: &Fingerprint, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&magic.to_le_bytes());
    h[4] = kind;
    h[5] = fp.op as u8;
    h[6] = fp.dtype.code();
    h[7] = fp.reduce.map_or(NO_REDUCE, |r| r.code());
    h[8..12].copy_from_slice(&fp.root.to_le_bytes());
    h[12..20].copy_from_slice(&fp.seq.to_le_bytes());
    h[20..28].copy_from_slice(&fp.count.to_le_bytes());
    h[28..36].copy_from_slice(&len.to_le_bytes());
    h
}

/// The header in `h`, or `None` if its magic is not `magic` (a corrupt stream).
pub(crate) fn decode_header(magic: u32, h: &[u8; HEADER_LEN]) -> Option<Header> {
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap());
    if u32_at(0) != magic {
        return None;
    }
    Some(Header {
        kind: h[4],
        fp: Fingerprint::from_codes(u64_at(12), u64_at(20), h[5], h[6], h[7], u32_at(8)),
        len: u64_at(28),
    })
}

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

/// One receive of a [`Transport::exchange`].
pub struct RecvFrom<'a> {
    pub from: usize,
    pub buf: &'a mut [u8],
}

/// One send of a [`Transport::exchange`].
pub struct SendTo<'a> {
    pub to: usize,
    pub data: &'a [u8],
}

/// Point-to-point byte movement between the ranks of one group.
///
/// Messages between a pair of ranks are delivered in order; each receive must be matched by a
/// send of exactly the same length on the peer (a length difference is a mismatch error).
pub trait Transport: Send {
    /// This process's rank within the group.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// Tag all following messages with `fp` and fail any operation after `deadline`.
    fn begin(&mut self, fp: Fingerprint, deadline: Instant);
    /// Perform all `sends` and `recvs` concurrently (so that a ring step cannot deadlock) and
    /// return when all are complete. Fails naming the peer on close, abort, mismatch or timeout.
    fn exchange(&mut self, sends: &mut [SendTo<'_>], recvs: &mut [RecvFrom<'_>]) -> Result<()>;
    /// Tell every peer this group is broken (best effort) and fail all later operations with `cause`.
    fn abort(&mut self, cause: &crate::Error);

    /// Send `data` to `to`.
    fn send(&mut self, to: usize, data: &[u8]) -> Result<()> {
        self.exchange(&mut [SendTo { to, data }], &mut [])
    }
    /// Receive exactly `buf.len()` bytes from `from`.
    fn recv(&mut self, from: usize, buf: &mut [u8]) -> Result<()> {
        self.exchange(&mut [], &mut [RecvFrom { from, buf }])
    }
    /// Send `data` to `to` while receiving `buf` from `from`.
    fn send_recv(&mut self, to: usize, data: &[u8], from: usize, buf: &mut [u8]) -> Result<()> {
        self.exchange(&mut [SendTo { to, data }], &mut [RecvFrom { from, buf }])
    }
}
