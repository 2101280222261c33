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
use std::ops::Range;

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
    let (n, next, prev) = (buf.len(), (r + 1) % p, (r + p - 1) % p);
    let chunk = (CHUNK_BYTES / std::mem::size_of::<T>()).max(1);
    let mut tmp: Vec<T> = vec![T::zeroed(); segment(n, p, 0).len().min(chunk)];
    walk_reduce_scatter(n, r, p, chunk, |_, sr, rr| {
        let got = &mut tmp[..rr.len()];
        t.send_recv(next, bytes(&buf[sr]), prev, bytes_mut(got))?;
        T::reduce_into(&mut buf[rr], got, op);
        Ok(())
    })
}

/// The ring reduce-scatter's schedule on rank `r` of `p` over `n` elements: for each step `s`
/// and chunk, `f(s, send, recv)` with the element ranges to send to `r + 1` and to receive
/// from `r - 1` and reduce. Segment lengths differ by at most one; both are walked in chunk
/// steps, and an empty exchange is still made so that a zero-length segment keeps the two ends
/// in step.
fn walk_reduce_scatter(
    n: usize,
    r: usize,
    p: usize,
    chunk: usize,
    mut f: impl FnMut(usize, Range<usize>, Range<usize>) -> Result<()>,
) -> Result<()> {
    for s in 0..p - 1 {
        let send_seg = segment(n, p, (r + 2 * p - s - 1) % p);
        let recv_seg = segment(n, p, (r + 2 * p - s - 2) % p);
        let steps = send_seg.len().max(recv_seg.len()).div_ceil(chunk).max(1);
        for c in 0..steps {
            f(
                s,
                clip(&send_seg, c * chunk, chunk),
                clip(&recv_seg, c * chunk, chunk),
            )?;
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

/// Ring all-reduce of a 16-bit float buffer (`T::widen` is `Some`) with `f32` accumulation,
/// rounded once, and 16 bits on the wire wherever that is exact: the raw inputs (the first
/// reduce-scatter step) and the finished segments (the whole all-gather) travel as `T`, only
/// the partial sums in between (steps 2..p-1 of the reduce-scatter) as `f32`. The result is
/// bit for bit the one of widening everything to `f32` (the same `f32` operations on the same
/// operand pairs), with `(6p - 8) / (8p - 8)` of the widened ring's bytes: half at two ranks
/// (the one reduce-scatter exchange is of raw inputs), 5/8 at three, tending to 3/4.
///
/// `finish` is applied to each rank's finished `f32` segment before it is rounded (`Avg`'s
/// division).
pub fn all_reduce_half<T: Element>(
    t: &mut dyn Transport,
    buf: &mut [T],
    op: ReduceOp,
    finish: &dyn Fn(&mut [f32]),
) -> Result<()> {
    let (r, p, n) = (t.rank(), t.size(), buf.len());
    if p == 2 {
        return all_reduce_pair_half(t, buf, op, finish);
    }
    let mut acc = reduce_scatter_half(t, buf, op)?;
    let own = segment(n, p, r);
    finish(&mut acc[own.clone()]);
    T::narrow(&acc[own.clone()], &mut buf[own]);
    all_gather(t, buf)
}

/// The reduce-scatter half of [`all_reduce_half`]: returns the buffer widened to `f32` whose
/// segment `r` (of `p` nearly equal segments) holds the finished reduction on rank `r`. Step 1 sends
/// the raw `T` inputs, later steps the `f32` partial sums.
pub fn reduce_scatter_half<T: Element>(
    t: &mut dyn Transport,
    buf: &[T],
    op: ReduceOp,
) -> Result<Vec<f32>> {
    let mut acc = widened(buf);
    let (r, p) = (t.rank(), t.size());
    if p == 1 {
        return Ok(acc);
    }
    let (n, next, prev) = (buf.len(), (r + 1) % p, (r + p - 1) % p);
    let chunk = CHUNK_BYTES / std::mem::size_of::<f32>();
    let cap = segment(n, p, 0).len().min(chunk);
    let (mut got16, mut got32) = (vec![T::zeroed(); cap], vec![0f32; cap]);
    walk_reduce_scatter(n, r, p, chunk, |s, sr, rr| {
        if s == 0 {
            let got = &mut got16[..rr.len()];
            t.send_recv(next, bytes(&buf[sr]), prev, bytes_mut(got))?;
            f32::reduce_into(&mut acc[rr], &widened(got), op);
        } else {
            let got = &mut got32[..rr.len()];
            t.send_recv(next, bytes(&acc[sr]), prev, bytes_mut(got))?;
            f32::reduce_into(&mut acc[rr], got, op);
        }
        Ok(())
    })?;
    Ok(acc)
}

/// [`all_reduce_pair`] for 16-bit floats: both exchanges are of `T` (raw inputs, then the
/// rounded result), the sum is taken in `f32`.
fn all_reduce_pair_half<T: Element>(
    t: &mut dyn Transport,
    buf: &mut [T],
    op: ReduceOp,
    finish: &dyn Fn(&mut [f32]),
) -> Result<()> {
    let (r, n) = (t.rank(), buf.len());
    let peer = 1 - r;
    let (mine, theirs) = (segment(n, 2, r), segment(n, 2, peer));
    let chunk = CHUNK_BYTES / std::mem::size_of::<f32>();
    let mut tmp: Vec<T> = vec![T::zeroed(); mine.len().min(chunk)];
    let steps = mine.len().max(theirs.len()).div_ceil(chunk).max(1);
    for c in 0..steps {
        let own = clip(&mine, c * chunk, chunk);
        let other = clip(&theirs, c * chunk, chunk);
        let got = &mut tmp[..own.len()];
        t.send_recv(peer, bytes(&buf[other.clone()]), peer, bytes_mut(got))?;
        let mut acc = widened(&buf[own.clone()]);
        f32::reduce_into(&mut acc, &widened(got), op);
        finish(&mut acc);
        T::narrow(&acc, &mut buf[own.clone()]);
        let (out, inp) = split_disjoint(buf, own, other);
        t.send_recv(peer, bytes(out), peer, bytes_mut(inp))?;
    }
    Ok(())
}

fn widened<T: Element>(s: &[T]) -> Vec<f32> {
    T::widen(s).expect("the 16-bit ring is only called for types that widen to f32")
}
