//! Ring algorithms: reduce-scatter and all-gather in `p - 1` steps each, every rank sending to
//! `rank + 1` and receiving from `rank - 1` at once; all-reduce is their composition and moves
//! `2 (p-1)/p` of the buffer per rank, the bandwidth optimum.
//!
//! Each step is split into chunks of [`CHUNK_BYTES`]: a received chunk is reduced while it is
//! still in cache, and the kernel keeps receiving the next one meanwhile.

use super::{bytes, bytes_mut, segment, split_disjoint};
use crate::dtype::{Element, ReduceOp};
use crate::transport::Transport;
use crate::Result;

/// Bytes moved per exchange within one ring step.
pub const CHUNK_BYTES: usize = 256 * 1024;

/// Ring reduce-scatter in place over `buf` split into `p` segments (`segment`): afterwards
/// segment `r` of rank `r` holds the reduction over all ranks (other segments hold partials).
pub fn reduce_scatter<T: Element>(
    t: &mut dyn Transport,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    if p == 1 {
        return Ok(());
    }
    let n = buf.len();
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    let chunk = (CHUNK_BYTES / std::mem::size_of::<T>()).max(1);
    let mut tmp: Vec<T> = vec![T::zeroed(); segment(n, p, 0).len().min(chunk)];
    for s in 0..p - 1 {
        let send_seg = segment(n, p, (r + 2 * p - s - 1) % p);
        let recv_seg = segment(n, p, (r + 2 * p - s - 2) % p);
        // Segment lengths differ by at most one; walk both in chunk steps (an empty exchange is
        // still sent so that a zero-length segment keeps the two ends in step).
        let steps = send_seg.len().max(recv_seg.len()).div_ceil(chunk).max(1);
        for c in 0..steps {
            let sr = clip(&send_seg, c * chunk, chunk);
            let rr = clip(&recv_seg, c * chunk, chunk);
            let got = &mut tmp[..rr.len()];
            t.send_recv(next, bytes(&buf[sr]), prev, bytes_mut(got))?;
            T::reduce_into(&mut buf[rr], got, op);
        }
    }
    Ok(())
}

/// Ring all-gather in place: on entry segment `r` of rank `r` is valid; on exit all are.
pub fn all_gather<T: Element>(t: &mut dyn Transport, buf: &mut [T]) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    if p == 1 {
        return Ok(());
    }
    let n = buf.len();
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    for s in 0..p - 1 {
        let send_seg = segment(n, p, (r + p - s) % p);
        let recv_seg = segment(n, p, (r + 2 * p - s - 1) % p);
        let (out, inp) = split_disjoint(buf, send_seg, recv_seg);
        t.send_recv(next, bytes(out), prev, bytes_mut(inp))?;
    }
    Ok(())
}

/// Ring all-reduce: reduce-scatter then all-gather. With two ranks the two phases are fused
/// chunk by chunk (`all_reduce_pair`).
pub fn all_reduce<T: Element>(t: &mut dyn Transport, buf: &mut [T], op: ReduceOp) -> Result<()> {
    if t.size() == 2 {
        return all_reduce_pair(t, buf, op);
    }
    reduce_scatter(t, buf, op)?;
    all_gather(t, buf)
}

/// The two-rank ring with its phases fused per chunk: exchange the inputs of chunk `c` of each
/// other's half, reduce one's own chunk, and send it back at once while it is still in cache
/// (the peer's chunk, just read for sending, is overwritten while still cached too). Same
/// messages and the same result as reduce-scatter then all-gather, with each byte of the
/// buffer touched within one chunk's time: 64 MiB over loopback TCP stops being DRAM-bound.
fn all_reduce_pair<T: Element>(t: &mut dyn Transport, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let (r, n) = (t.rank(), buf.len());
    let peer = 1 - r;
    let (mine, theirs) = (segment(n, 2, r), segment(n, 2, peer));
    let chunk = (CHUNK_BYTES / std::mem::size_of::<T>()).max(1);
    let mut tmp: Vec<T> = vec![T::zeroed(); mine.len().min(chunk)];
    // Both ranks walk the same number of steps; an empty chunk is still exchanged.
    let steps = mine.len().max(theirs.len()).div_ceil(chunk).max(1);
    for c in 0..steps {
        let own = clip(&mine, c * chunk, chunk);
        let other = clip(&theirs, c * chunk, chunk);
        let got = &mut tmp[..own.len()];
        t.send_recv(peer, bytes(&buf[other.clone()]), peer, bytes_mut(got))?;
        T::reduce_into(&mut buf[own.clone()], got, op);
        let (out, inp) = split_disjoint(buf, own, other);
        t.send_recv(peer, bytes(out), peer, bytes_mut(inp))?;
    }
    Ok(())
}

/// The part `[off, off + len)` of `range`, clipped to it.
fn clip(range: &std::ops::Range<usize>, off: usize, len: usize) -> std::ops::Range<usize> {
    let start = (range.start + off).min(range.end);
    start..(start + len).min(range.end)
}
