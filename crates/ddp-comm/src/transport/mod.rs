//! Transports move bytes between the ranks of one group; algorithms are written against the
//! [`Transport`] trait only, so a new transport needs no algorithm change. Which collective runs
//! on which transport is the business of the backends above ([`crate::backend`]).
//!
//! Every message carries the [`Fingerprint`] of the collective that sent it (defined in the leaf
//! [`crate::fingerprint`], re-exported here with [`OpKind`]); the receiving side
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

pub(crate) use crate::fingerprint::NO_REDUCE;
pub use crate::fingerprint::{Fingerprint, OpKind};

use crate::Result;
use std::time::Instant;

/// Every message of every transport starts with this 40-byte header:
///
/// ```text
/// 0      4    5   6      7        8      12    20      28            36    40
/// | magic | kind | op | dtype | reduce | root | seq | count | payload len | pad |
/// ```
///
/// Each transport has its own `magic`; `kind` is transport-specific (TCP: data or abort).
pub(crate) const HEADER_LEN: usize = 40;

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
