//! Collective algorithms, one file each, written against [`Transport`](crate::transport::Transport) only.
//!
//! - [`ring`]: bandwidth-optimal ring reduce-scatter and all-gather (and all-reduce as their
//!   composition), processed in cache-sized chunks; for large messages.
//! - [`recursive_doubling`]: latency-optimal all-reduce in `ceil(log2 p)` exchanges (non-powers
//!   of two fold the extra ranks in first); for small messages, and the barrier.
//! - [`tree`]: binomial-tree broadcast and reduce.
//! - [`direct`]: one-step exchanges: gather, scatter, all-to-all.
//! - [`shm_direct`]: all-reduce straight through a shared-memory segment, not its message
//!   rings (one-shot for small messages, pipelined reduce-scatter + all-gather by owners, or
//!   cross-memory attach between the ranks' own buffers for large ones); large reduce-scatters
//!   by cross-memory attach too.
//! - [`hierarchical`]: all-reduce and broadcast for groups spanning hosts: shared memory inside
//!   each host, ring / recursive doubling / tree among the hosts' leaders over TCP.
//!
//! Every algorithm is correct for any world size (1 included) and any length (0 included), and
//! leaves bit-identical results on all ranks (float `op` is applied to the same operand pairs on
//! every rank; commutativity of IEEE addition/multiplication makes both ends agree).

pub mod direct;
pub mod hierarchical;
pub mod recursive_doubling;
pub mod ring;
pub mod shm_direct;
pub mod tree;

use crate::dtype::Element;
use std::ops::Range;

/// Which all-reduce algorithm to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AllReduceAlgorithm {
    /// Recursive doubling below [`AllReduceAlgorithm::RING_THRESHOLD_BYTES`], ring above.
    #[default]
    Auto,
    Ring,
    RecursiveDoubling,
}

impl AllReduceAlgorithm {
    /// Message size (bytes per rank) from which `Auto` switches to the ring.
    pub const RING_THRESHOLD_BYTES: usize = 64 * 1024;

    /// Parse `auto`, `ring` or `rd`/`recursive_doubling` (env `DDP_ALLREDUCE_ALGO`).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(Self::Auto),
            "ring" => Some(Self::Ring),
            "rd" | "recursive_doubling" | "recursive-doubling" => Some(Self::RecursiveDoubling),
            _ => None,
        }
    }

    /// The concrete algorithm for a message of `bytes` bytes.
    pub fn resolve(self, bytes: usize, world: usize) -> Self {
        match self {
            Self::Auto if bytes >= Self::RING_THRESHOLD_BYTES && world > 1 => Self::Ring,
            Self::Auto => Self::RecursiveDoubling,
            other => other,
        }
    }
}

pub(crate) fn bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

pub(crate) fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

/// Range of segment `i` when `n` elements are split into `parts` nearly equal segments.
pub(crate) fn segment(n: usize, parts: usize, i: usize) -> Range<usize> {
    let base = n / parts;
    let rem = n % parts;
    let start = i * base + i.min(rem);
    start..start + base + usize::from(i < rem)
}

/// Borrow `send` immutably and `recv` mutably from one buffer; the ranges must be disjoint.
pub(crate) fn split_disjoint<T>(
    buf: &mut [T],
    send: Range<usize>,
    recv: Range<usize>,
) -> (&[T], &mut [T]) {
    if send.end <= recv.start {
        let (a, b) = buf.split_at_mut(recv.start);
        (&a[send], &mut b[..recv.len()])
    } else {
        assert!(
            recv.end <= send.start,
            "overlapping send {send:?} and recv {recv:?}"
        );
        let (a, b) = buf.split_at_mut(send.start);
        (&b[..send.len()], &mut a[recv])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_partition_exactly() {
        for n in [0, 1, 5, 7, 100, 1001] {
            for p in 1..=6 {
                let mut next = 0;
                for i in 0..p {
                    let s = segment(n, p, i);
                    assert_eq!(s.start, next);
                    assert!(s.len() <= n / p + 1);
                    next = s.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn split_disjoint_both_orders() {
        let mut v = [0, 1, 2, 3, 4, 5];
        let (s, r) = split_disjoint(&mut v, 0..2, 3..6);
        assert_eq!(s, &[0, 1]);
        r[0] = 9;
        let (s, r) = split_disjoint(&mut v, 4..6, 0..1);
        assert_eq!(s, &[4, 5]);
        r[0] = 7;
        assert_eq!(v, [7, 1, 2, 9, 4, 5]);
    }
}
