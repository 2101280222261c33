//! All-reduce through the shared-memory segment directly (no message rings): each rank copies
//! its input once into its fast area, and ranks reduce straight out of each other's areas; or,
//! for large messages, straight between the ranks' own buffers (cross-memory attach). Large
//! reduce-scatters ([`reduce_scatter`]) take the cross-memory path too (all-gathers into a
//! buffer do not: over the message rings they were as fast or faster), and so do all-gathers whose result the caller places ([`all_gather_to`]: each rank
//! reads the peers' blocks straight into where they go, one copy instead of the ring's two and
//! the caller's third).
//!
//! **Cross-memory attach** (at least [`Geometry::cma_min`] bytes, when every rank may use
//! `process_vm_readv`/`writev` on the others): each rank publishes its buffer's address and
//! `Registered`; then all ranks claim chunks of [`Geometry::cma_chunk`] bytes from one atomic
//! counter. The claimer reads the chunk of every peer's buffer, reduces in rank order into its
//! own buffer and writes the result into every peer's buffer, then counts the chunk done; a
//! rank returns when all chunks are done. Work goes to whoever runs: a rank that is descheduled
//! (cores oversubscribed, as on 2 vCPUs with other load) no longer stalls its peers, which the
//! lock-step pipeline below cannot avoid. One copy per peer in, one out, no shared staging.
//!
//! ```text
//!  rank 0 buffer [ c0 | c1 | c2 | c3 ]      claim counter: c0→rank 0, c1→rank 1, c2→rank 0 ...
//!  rank 1 buffer [ c0 | c1 | c2 | c3 ]      claimer of c: read peers' c, reduce, write c back
//!                                           to every buffer; done += 1; wait done == 4
//! ```
//!
//! **Pipelined** (messages above [`Geometry::one_shot_max`]): the buffer is cut into blocks of
//! `p` sub-chunks of `sub_bytes`; rank `r` owns sub-chunk `r` of every block. Per block `g`,
//! rank `r` runs three phases, software-pipelined so that phase 1 of block `g` overlaps phase 2
//! of `g-1` and phase 3 of `g-2`:
//!
//! ```text
//!               rank 0's fast area slot g%W        rank 1's fast area slot g%W
//!               [ sub 0      | sub 1      ]        [ sub 0      | sub 1      ]
//! 1 copy in     [            | in0[sub 1] ]        [ in1[sub 0] |            ]   publish In = g+1
//! 2 reduce      rank 0: in0[sub 0] + in1[sub 0] ──▶ own buffer and [ res 0 | .. ]   publish Reduced
//!               rank 1: in1[sub 1] + in0[sub 1] ──▶ own buffer and [ .. | res 1 ]
//! 3 copy out    rank 0 copies res 1 from rank 1's slot, rank 1 copies res 0    publish Out = g+1
//! ```
//!
//! Phase 1 of block `g` waits until every peer's `Out` reached `g + 1 - W` (the slot is free
//! again); phase 2 waits for the peers' `In`, phase 3 for their `Reduced`. Per rank, its own
//! buffer is read once and written once; the shared traffic stays within `W` blocks, in cache.
//! Every result element is computed once, by its owner, so all ranks get identical bits.
//!
//! **One-shot** (small messages, one round of synchronisation): every rank copies its whole
//! input into its slot, publishes `In`, and then every rank reduces all `p` inputs itself in
//! rank order `((in0 op in1) op in2) ...` (identical operations, hence identical bits).
//!
//! Reductions run over pieces that stay in L1; `f16`/`bf16` accumulate in `f32` and round once
//! (as the widening path of the process group does); `Avg` divides once, by the owner.
//!
//! [`crate::ProcessGroup::all_reduce`] uses this whenever the group's transport is shared
//! memory and the all-reduce algorithm is `auto`. Defaults
//! ([`crate::transport::shm::default_geometry`]): sub-chunks of 64 KiB, a window of 8 blocks
//! (larger windows let the slots fall out of cache), one-shot up to `256 KiB / p`, cross-memory
//! attach from 1 MiB in chunks of 256 KiB. The measurements that chose them are in the book's
//! benchmarks chapter (`docs/benchmarks.md`, "Shared-memory tuning").

use super::segment;
use crate::dtype::{DType, Element, ReduceOp};
use crate::placement::{placed_range, Place};
use crate::transport::shm::{Counter, Geometry, ShmTransport};
use crate::transport::Transport;
use crate::Result;
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Elements reduced per piece (the accumulator stays in L1).
const PIECE_ELEMS: usize = 4096;

/// All-reduce `buf` in place with `op` over the shared-memory segment of `t`.
pub fn all_reduce<T: Element>(t: &mut ShmTransport, buf: &mut [T], op: ReduceOp) -> Result<()> {
    if t.size() == 1 {
        return Ok(());
    }
    let geo = t.fast_geometry();
    let bytes = std::mem::size_of_val(buf);
    if t.cross_memory_attach() && bytes >= geo.cma_min {
        let (data, n) = (buf.as_mut_ptr(), buf.len());
        // SAFETY: in place over `buf`, which this call borrows mutably.
        unsafe { cross_memory(t, data, n, data, op, geo, None) }
    } else if bytes <= geo.one_shot_max {
        one_shot(t, buf, op)
    } else {
        pipelined(t, buf, op, geo)
    }
}

/// Reduce-scatter: `output` (`n` elements) gets the reduction of every rank's segment `r` of
/// `input` (`p * n` elements). Cross-memory attach only (`cross_memory`): each chunk lies
/// inside one segment, and its claimer reads it from every input and writes the result to that
/// segment's owner alone (half an all-reduce's traffic; no copy of the input). Returns `false`
/// (nothing done) when cross-memory attach is off or the input is below [`Geometry::cma_min`];
/// the caller then takes the message path.
pub fn reduce_scatter<T: Element>(
    t: &mut ShmTransport,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<bool> {
    let Some(geo) = cma_geometry(t, std::mem::size_of_val(input)) else {
        return Ok(false);
    };
    let n = output.len();
    // SAFETY: `input` holds `p * n` elements (checked by the caller) and is only read; `output`
    // holds `n` and is written only by the claimers of this rank's segment.
    unsafe {
        cross_memory(
            t,
            input.as_ptr(),
            input.len(),
            output.as_mut_ptr(),
            op,
            geo,
            Some(n),
        )
    }?;
    Ok(true)
}

/// [`reduce_scatter`] in place: `buf` holds `p` segments of `n`; the result goes into this
/// rank's own segment of `buf`. The claimer of a chunk is the only one that reads that chunk of
/// any input, and it reads every input before it writes the result, so the output may alias
/// the owner's input segment. Returns `false` as [`reduce_scatter`] does.
pub fn reduce_scatter_in_place<T: Element>(
    t: &mut ShmTransport,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<bool> {
    let Some(geo) = cma_geometry(t, std::mem::size_of_val(buf)) else {
        return Ok(false);
    };
    let n = buf.len() / t.size();
    let data = buf.as_mut_ptr();
    // SAFETY: `buf` holds `p * n` elements (checked by the caller) and is borrowed mutably by
    // this call; the output is its segment `rank`, written only by the claimer of each chunk
    // after that claimer read the chunk from every input (see above).
    unsafe { cross_memory(t, data, buf.len(), data.add(t.rank() * n), op, geo, Some(n)) }?;
    Ok(true)
}

/// All-gather in place by cross-memory attach, the result placed by the caller
/// ([`crate::backend::CollectiveBackend::all_gather_in_place_to`]; `buf` holds `p` blocks of
/// `esz`-byte elements, this rank's only read): every rank publishes `buf`, then `place` reads
/// the ranges it wants, each from its owner's buffer straight into the caller's memory
/// (`process_vm_readv`; this rank's own block is copied locally). Each rank then counts itself
/// done (its one chunk of the collective) and returns once every rank is, since a peer may
/// read its block until then; an error of `place` is returned after that. Returns `false`
/// (nothing done) as [`reduce_scatter`] does.
pub fn all_gather_to(
    t: &mut ShmTransport,
    buf: &[u8],
    esz: usize,
    place: Place<'_>,
) -> Result<bool> {
    if cma_geometry(t, buf.len()).is_none() {
        return Ok(false);
    }
    let (r, p) = (t.rank(), t.size());
    let block = buf.len() / p;
    let addr = buf.as_ptr() as usize;
    let (reg, first) = t.cma_begin(addr, buf.len(), addr, p as u64);
    t.wait_peers(Counter::Registered, reg)?;
    t.check_same_collective()?;
    let t = &*t;
    let mut peers = Vec::with_capacity(p);
    for j in 0..p {
        let (addr, len, _) = t.peer_buffer(j);
        if len != buf.len() {
            return Err(t.mismatch(j, buf.len(), len));
        }
        peers.push(addr);
    }
    let placed = place(&mut |offset, dst| {
        let n = dst.len();
        let mut start = placed_range(offset, n, buf.len(), esz)?;
        let mut at = 0;
        while start < offset * esz + n {
            let owner = start / block;
            let stop = (offset * esz + n).min((owner + 1) * block);
            let d = &mut dst[at..at + stop - start];
            if owner == r {
                d.copy_from_slice(&buf[start..stop]);
            } else {
                t.cma_transfer(owner, peers[owner] + start, d.as_mut_ptr(), d.len(), false)?;
            }
            at += stop - start;
            start = stop;
        }
        Ok(())
    });
    // This rank no longer reads its peers' buffers (whatever `place` did): one chunk each,
    // claimed to keep the group's chunk numbering in step.
    let end = first + p as u64;
    let _ = t.claim(end);
    t.finish_chunk();
    t.wait_done(end)?;
    placed.map(|()| true)
}

/// The smallest buffer, in bytes, that [`all_gather_to`] gathers by cross-memory attach;
/// `None` when it never does (one rank, or attach not allowed).
pub fn direct_min(t: &ShmTransport) -> Option<usize> {
    (t.size() > 1 && t.cross_memory_attach()).then(|| t.fast_geometry().cma_min)
}

/// The geometry for a reduce-scatter of `bytes` input bytes by cross-memory attach, or `None`
/// when it does not apply (one rank, attach not allowed, or below [`Geometry::cma_min`]).
fn cma_geometry(t: &ShmTransport, bytes: usize) -> Option<Geometry> {
    if t.size() == 1 || !t.cross_memory_attach() {
        return None; // (a group of one has no fast area)
    }
    let geo = t.fast_geometry();
    (bytes >= geo.cma_min).then_some(geo)
}

/// Cross-memory attach: every rank publishes its input and output; ranks claim chunks one at a
/// time (an atomic counter), and the claimer of a chunk reads every peer's input for it with
/// `process_vm_readv`, reduces in rank order, and writes the result:
/// - all-reduce (`seg == None`, output = input, in place): into its own buffer and, with
///   `process_vm_writev`, into every peer's;
/// - reduce-scatter (`seg == Some(n)`: input is `p` segments of `n`, chunks lie inside one
///   segment): into the output of that segment's owner only.
///
/// Whoever runs does the work: a descheduled rank does not hold the others up once it has
/// published its buffers.
///
/// # Safety
/// `input` holds `n_in` elements; `output` holds `n_in` (all-reduce, and may equal `input`) or
/// `seg` elements (reduce-scatter, and may be the owner's segment of `input`); neither is used
/// by anything else until this returns.
unsafe fn cross_memory<T: Element>(
    t: &mut ShmTransport,
    input: *const T,
    n_in: usize,
    output: *mut T,
    op: ReduceOp,
    geo: Geometry,
    seg: Option<usize>,
) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    let esz = std::mem::size_of::<T>();
    let chunk = (geo.cma_chunk / esz).max(1);
    // Chunks per owner's segment (reduce-scatter) or over the whole buffer (all-reduce).
    let (seg_len, per_seg) = match seg {
        Some(s) => (s, s.div_ceil(chunk)),
        None => (n_in, n_in.div_ceil(chunk)),
    };
    let nchunks = (per_seg * if seg.is_some() { p } else { 1 }) as u64;
    let bytes = n_in * esz;
    let (reg, first) = t.cma_begin(input as usize, bytes, output as usize, nchunks);
    t.wait_peers(Counter::Registered, reg)?;
    t.check_same_collective()?;
    let t = &*t;
    // A peer's registration stays valid until every chunk is done; a peer already in a later
    // collective (possible only once all chunks are done) leaves nothing to claim here.
    let mut peers: Vec<(usize, usize)> = Vec::new();
    let temp = || vec![T::zeroed(); chunk.min(n_in)];
    let mut temps: Vec<Vec<T>> = (0..p)
        .map(|j| if j == r { Vec::new() } else { temp() })
        .collect();
    // Reduce-scatter: where a chunk owned by a peer is reduced before it is sent.
    let mut result = if seg.is_some() { temp() } else { Vec::new() };
    let end = first + nchunks;
    while let Some(c) = t.claim(end) {
        if peers.is_empty() {
            for j in 0..p {
                let (addr, len, out) = t.peer_buffer(j);
                if len != bytes {
                    return Err(t.mismatch(j, bytes, len));
                }
                peers.push((addr, out));
            }
        }
        let c = (c - first) as usize;
        let (owner, within) = (c / per_seg, c % per_seg * chunk);
        let start = owner * seg_len + within;
        let len = chunk.min(seg_len - within);
        for j in (0..p).filter(|&j| j != r) {
            t.cma_transfer(
                j,
                peers[j].0 + start * esz,
                temps[j].as_mut_ptr().cast(),
                len * esz,
                false,
            )?;
        }
        // SAFETY: `input + start` holds `len` of our input elements, and the destination `len`
        // of our output (or the local result), which nobody else touches in this chunk (we
        // claimed it); the temporaries hold the peers' inputs.
        let own = unsafe { input.add(start) };
        let (dest, at) = match seg {
            // SAFETY: `start + len <= n_in`, inside the output (see above).
            None => (unsafe { output.add(start) }, start),
            // SAFETY: `within + len <= seg`, inside this rank's output segment.
            Some(_) if owner == r => (unsafe { output.add(within) }, within),
            Some(_) => (result.as_mut_ptr(), within),
        };
        let inputs: Vec<*const T> = (0..p)
            .map(|j| if j == r { own } else { temps[j].as_ptr() })
            .collect();
        // SAFETY: every input and `dest` hold `len` elements nobody else writes (see above).
        unsafe { reduce_to(&inputs, &[dest], len, op, p) };
        let targets = match seg {
            None => (0..p).filter(|&j| j != r).collect(),
            Some(_) if owner != r => vec![owner],
            Some(_) => Vec::new(),
        };
        for j in targets {
            t.cma_transfer(j, peers[j].1 + at * esz, dest.cast(), len * esz, true)?;
        }
        t.finish_chunk();
    }
    t.wait_done(end)
}

fn one_shot<T: Element>(t: &mut ShmTransport, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    let window = t.fast_geometry().window as u64;
    let n = buf.len();
    let g = t.take_blocks(1);
    if g >= window {
        t.wait_peers(Counter::Out, g + 1 - window)?;
    }
    let data = buf.as_mut_ptr();
    // SAFETY: the slot holds `p * sub_bytes >= one_shot_max >= n * size_of::<T>()` bytes and is
    // ours until the peers' `Out` says they read it (waited for above, `window` blocks later).
    unsafe { std::ptr::copy_nonoverlapping(data, t.fast_slot(r, g) as *mut T, n) };
    t.publish(Counter::In, g + 1);
    t.wait_peers(Counter::In, g + 1)?;
    t.check_same_collective()?;
    let inputs: Vec<*const T> = (0..p)
        .map(|j| {
            if j == r {
                data as *const T
            } else {
                t.fast_slot(j, g) as *const T
            }
        })
        .collect();
    // SAFETY: every input holds `n` published elements; the only output is our own buffer.
    unsafe { reduce_to(&inputs, &[data], n, op, p) };
    t.publish(Counter::Out, g + 1);
    Ok(())
}

fn pipelined<T: Element>(
    t: &mut ShmTransport,
    buf: &mut [T],
    op: ReduceOp,
    geo: Geometry,
) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    let sub_elems = geo.sub_bytes / std::mem::size_of::<T>();
    let block = sub_elems * p;
    let n = buf.len();
    let nblocks = n.div_ceil(block) as u64;
    let base = t.take_blocks(nblocks);
    let window = geo.window as u64;
    let data = buf.as_mut_ptr();
    let t = &*t;
    // (offset, length) in `buf` of sub-chunk `j` of the collective's block `k`.
    let part = |k: u64, j: usize| {
        let start = k as usize * block;
        let s = segment(block.min(n - start), p, j);
        (start + s.start, s.len())
    };
    // Sub-chunk `j` of `rank`'s slot for global block `g`.
    // SAFETY: (of the `add`) `j < p`, inside the slot of `p * sub_bytes` bytes.
    let sub_at = |rank: usize, g: u64, j: usize| unsafe {
        t.fast_slot(rank, g).add(j * geo.sub_bytes) as *mut T
    };
    for step in 0..nblocks + 2 {
        if step < nblocks {
            // Phase 1: copy our input for the other owners into our slot.
            let g = base + step;
            if g >= window {
                t.wait_peers(Counter::Out, g + 1 - window)?;
            }
            for j in (0..p).filter(|&j| j != r) {
                let (off, len) = part(step, j);
                // SAFETY: `len <= sub_elems`; the slot is free (peers' `Out` waited above).
                unsafe { std::ptr::copy_nonoverlapping(data.add(off), sub_at(r, g, j), len) };
            }
            t.publish(Counter::In, g + 1);
        }
        if (1..=nblocks).contains(&step) {
            // Phase 2: reduce the sub-chunk we own from our buffer and every peer's slot.
            let k = step - 1;
            let g = base + k;
            t.wait_peers(Counter::In, g + 1)?;
            if k == 0 {
                t.check_same_collective()?;
            }
            let (off, len) = part(k, r);
            let inputs: Vec<*const T> = (0..p)
                .map(|j| {
                    if j == r {
                        // SAFETY: `off + len <= n`, inside our buffer.
                        unsafe { data.add(off) as *const T }
                    } else {
                        sub_at(j, g, r) as *const T
                    }
                })
                .collect();
            // SAFETY: peers published these sub-chunks (`In`); the outputs are our buffer's
            // owned range and our slot's sub-chunk `r`, which nobody reads before `Reduced`.
            unsafe { reduce_to(&inputs, &[data.add(off), sub_at(r, g, r)], len, op, p) };
            t.publish(Counter::Reduced, g + 1);
        }
        if step >= 2 {
            // Phase 3: copy every other owner's result into our buffer.
            let k = step - 2;
            let g = base + k;
            t.wait_peers(Counter::Reduced, g + 1)?;
            for j in (0..p).filter(|&j| j != r) {
                let (off, len) = part(k, j);
                // SAFETY: owner `j` published its result (`Reduced`) and keeps it until our `Out`.
                unsafe { std::ptr::copy_nonoverlapping(sub_at(j, g, j), data.add(off), len) };
            }
            t.publish(Counter::Out, g + 1);
        }
    }
    Ok(())
}

/// Reduce `inputs` (each `len` elements, combined in this order) with `op` and write the result
/// to every pointer of `outs`; `Avg` divides by `p`. An output may alias an input: each piece
/// of the inputs is fully read before that piece of the outputs is written.
///
/// # Safety
/// Every pointer must be valid for `len` elements, and no other thread may write them meanwhile.
unsafe fn reduce_to<T: Element>(
    inputs: &[*const T],
    outs: &[*mut T],
    len: usize,
    op: ReduceOp,
    p: usize,
) {
    // SAFETY: the caller's guarantees, passed on (the casts keep the element size: `T` is
    // `f16`/`bf16` in the half arms).
    unsafe {
        match T::DTYPE {
            DType::F16 => reduce_half::<f16>(cast(inputs), cast_mut(outs), len, op, p),
            DType::BF16 => reduce_half::<bf16>(cast(inputs), cast_mut(outs), len, op, p),
            _ => reduce_native(inputs, outs, len, op, p),
        }
    }
}

fn cast<T, U>(ptrs: &[*const T]) -> Vec<*const U> {
    ptrs.iter().map(|&q| q as *const U).collect()
}

fn cast_mut<T, U>(ptrs: &[*mut T]) -> Vec<*mut U> {
    ptrs.iter().map(|&q| q as *mut U).collect()
}

/// [`reduce_to`] for element types reduced natively.
///
/// # Safety
/// As [`reduce_to`].
unsafe fn reduce_native<T: Element>(
    inputs: &[*const T],
    outs: &[*mut T],
    len: usize,
    op: ReduceOp,
    p: usize,
) {
    let mut acc: Vec<T> = vec![T::zeroed(); PIECE_ELEMS.min(len)];
    let mut start = 0;
    while start < len {
        let k = PIECE_ELEMS.min(len - start);
        let a = &mut acc[..k];
        // SAFETY: `start + k <= len`; every input is valid for `len` elements (caller).
        a.copy_from_slice(unsafe { std::slice::from_raw_parts(inputs[0].add(start), k) });
        for &inp in &inputs[1..] {
            // SAFETY: as above.
            T::reduce_into(
                a,
                unsafe { std::slice::from_raw_parts(inp.add(start), k) },
                op,
            );
        }
        if op == ReduceOp::Avg {
            T::div_by(a, p);
        }
        for &out in outs {
            // SAFETY: every output is valid for `len` elements (caller); `acc` is ours.
            unsafe { std::ptr::copy_nonoverlapping(a.as_ptr(), out.add(start), k) };
        }
        start += k;
    }
}

/// 16-bit floats that widen to and narrow from `f32` slice-wise.
trait Half: Copy + bytemuck::Pod {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl Half for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst); // F16C when the CPU has it
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Half for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        bf16_to_f32(bytemuck::cast_slice(src), dst);
    }
    fn narrow(src: &[f32], dst: &mut [Self]) {
        f32_to_bf16(src, bytemuck::cast_slice_mut(dst));
    }
}

/// `bf16 -> f32`, bit-identical to `half::bf16::to_f32`, written without branches so that it
/// vectorises.
fn bf16_to_f32(src: &[u16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        let quiet = if s & 0x7FFF > 0x7F80 { 0x0040 } else { 0 };
        *d = f32::from_bits(((s | quiet) as u32) << 16);
    }
}

/// `f32 -> bf16` with round-to-nearest-even, bit-identical to `half::bf16::from_f32`.
fn f32_to_bf16(src: &[f32], dst: &mut [u16]) {
    for (d, &f) in dst.iter_mut().zip(src) {
        let x = f.to_bits();
        let hi = (x >> 16) as u16;
        let round_up = (x & 0x8000 != 0) && (x & 0x1_7FFF != 0);
        let rounded = hi.wrapping_add(round_up as u16);
        *d = if x & 0x7FFF_FFFF > 0x7F80_0000 {
            hi | 0x0040
        } else {
            rounded
        };
    }
}

/// [`reduce_to`] for 16-bit floats, accumulated in `f32`.
///
/// # Safety
/// As [`reduce_to`].
unsafe fn reduce_half<H: Half>(
    inputs: Vec<*const H>,
    outs: Vec<*mut H>,
    len: usize,
    op: ReduceOp,
    p: usize,
) {
    let piece = PIECE_ELEMS.min(len);
    let mut acc = vec![0f32; piece];
    let mut tmp = vec![0f32; piece];
    let mut start = 0;
    while start < len {
        let k = PIECE_ELEMS.min(len - start);
        let (a, b) = (&mut acc[..k], &mut tmp[..k]);
        // SAFETY: `start + k <= len`; every input is valid for `len` elements (caller).
        H::widen(
            unsafe { std::slice::from_raw_parts(inputs[0].add(start), k) },
            a,
        );
        for &inp in &inputs[1..] {
            // SAFETY: as above.
            H::widen(unsafe { std::slice::from_raw_parts(inp.add(start), k) }, b);
            f32::reduce_into(a, b, op);
        }
        if op == ReduceOp::Avg {
            f32::div_by(a, p);
        }
        // SAFETY: every output is valid for `len` elements and written by no one else (caller).
        let first = unsafe { std::slice::from_raw_parts_mut(outs[0].add(start), k) };
        H::narrow(a, first);
        for &out in &outs[1..] {
            // SAFETY: as above; the first output's piece is complete.
            unsafe {
                std::ptr::copy_nonoverlapping(outs[0].add(start) as *const H, out.add(start), k)
            };
        }
        start += k;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn bf16_conversions_match_half_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut bits: Vec<u32> = (0..200_000).map(|_| rng.gen()).collect();
        // Edge cases: ties, NaNs, infinities, the largest finite values, zeros.
        bits.extend([
            0x3F80_8000,
            0x3F81_8000,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0001,
            0xFFFF_FFFF,
            0x7F7F_FFFF,
            0x8000_0000,
            0,
        ]);
        let src: Vec<f32> = bits.iter().map(|&b| f32::from_bits(b)).collect();
        let mut ours = vec![0u16; src.len()];
        f32_to_bf16(&src, &mut ours);
        for (i, &f) in src.iter().enumerate() {
            assert_eq!(
                ours[i],
                bf16::from_f32(f).to_bits(),
                "from_f32({:#x})",
                f.to_bits()
            );
        }
        let halves: Vec<u16> = (0..=u16::MAX).collect();
        let mut wide = vec![0f32; halves.len()];
        bf16_to_f32(&halves, &mut wide);
        for (&h, &w) in halves.iter().zip(&wide) {
            assert_eq!(
                w.to_bits(),
                bf16::from_bits(h).to_f32().to_bits(),
                "to_f32({h:#x})"
            );
        }
    }

    #[test]
    fn reduce_to_combines_in_order_with_aliasing_output() {
        // 3 inputs, the first aliases the output; lengths cross a piece boundary.
        let n = PIECE_ELEMS + 5;
        let mut a: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let b: Vec<f32> = (0..n).map(|i| 2.0 * i as f32).collect();
        let c: Vec<f32> = vec![1.0; n];
        let mut copy = vec![0f32; n];
        let ins = [a.as_ptr(), b.as_ptr(), c.as_ptr()];
        // SAFETY: every pointer is valid for `n` elements; this thread is the only user.
        unsafe {
            reduce_to(
                &ins,
                &[a.as_mut_ptr(), copy.as_mut_ptr()],
                n,
                ReduceOp::Avg,
                3,
            )
        };
        for (i, x) in a.iter().enumerate() {
            assert_eq!(*x, (3 * i + 1) as f32 / 3.0);
        }
        assert_eq!(a, copy);
        let x: Vec<bf16> = (0..n).map(|i| bf16::from_f32((i % 100) as f32)).collect();
        let mut y: Vec<bf16> = vec![bf16::from_f32(0.5); n];
        // SAFETY: as above.
        unsafe {
            reduce_to(
                &[x.as_ptr(), y.as_ptr()],
                &[y.as_mut_ptr()],
                n,
                ReduceOp::Sum,
                2,
            )
        };
        assert!(y
            .iter()
            .enumerate()
            .all(|(i, v)| v.to_f32() == (i % 100) as f32 + 0.5));
    }
}
