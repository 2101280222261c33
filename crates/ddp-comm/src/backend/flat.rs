//! Every collective over any [`Transport`], written once (Gloo's way): the algorithms of
//! [`crate::algorithms`] chosen by message size, `f16`/`bf16` reduced with `f32` accumulation
//! and rounded once (on the ring they still travel as 16 bits wherever that is exact:
//! [`ring::all_reduce_half`]), `Avg` finished by one division, and the argument checks. The TCP backend is these functions
//! over its mesh; the shared-memory and hierarchical backends use them for every collective they
//! have no faster path for.

use crate::algorithms::{direct, recursive_doubling, ring, tree, AllReduceAlgorithm};
use crate::dtype::{Element, ReduceOp};
use crate::transport::Transport;
use crate::{Error, Result};

pub(crate) fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::InvalidArgument(format!(
            "{what} has {got} elements, expected {want}"
        )));
    }
    Ok(())
}

/// Ring above [`AllReduceAlgorithm::RING_THRESHOLD_BYTES`] (under `Auto`), else recursive doubling.
pub fn all_reduce<T: Element>(
    t: &mut dyn Transport,
    buf: &mut [T],
    op: ReduceOp,
    algo: AllReduceAlgorithm,
) -> Result<()> {
    let half = T::widen(&[]).is_some();
    // 16-bit floats choose as their f32 accumulation would (by the widened size).
    let size = std::mem::size_of_val(buf) * if half { 2 } else { 1 };
    let resolved = algo.resolve(size, t.size());
    let p = t.size();
    if half && resolved == AllReduceAlgorithm::Ring {
        // 16-bit floats on the ring: 16 bits on the wire wherever exact, f32 accumulation.
        let finish = |s: &mut [f32]| {
            if op == ReduceOp::Avg {
                f32::div_by(s, p)
            }
        };
        return ring::all_reduce_half(t, buf, op, &finish);
    }
    if let Some(mut wide) = T::widen(buf) {
        all_reduce::<f32>(t, &mut wide, op, algo)?;
        T::narrow(&wide, buf);
        return Ok(());
    }
    match resolved {
        AllReduceAlgorithm::Ring => ring::all_reduce(t, buf, op)?,
        _ => recursive_doubling::all_reduce(t, buf, op)?,
    }
    if op == ReduceOp::Avg {
        T::div_by(buf, t.size());
    }
    Ok(())
}

pub fn broadcast<T: Element>(t: &mut dyn Transport, buf: &mut [T], root: usize) -> Result<()> {
    tree::broadcast(t, buf, root)
}

pub fn reduce<T: Element>(
    t: &mut dyn Transport,
    buf: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    if let Some(mut wide) = T::widen(buf) {
        reduce::<f32>(t, &mut wide, op, root)?;
        if t.rank() == root {
            T::narrow(&wide, buf);
        }
        return Ok(());
    }
    tree::reduce(t, buf, op, root)?;
    if op == ReduceOp::Avg && t.rank() == root {
        T::div_by(buf, t.size());
    }
    Ok(())
}

pub fn all_gather<T: Element>(t: &mut dyn Transport, input: &[T], output: &mut [T]) -> Result<()> {
    let (r, n) = (t.rank(), input.len());
    check_len("all_gather output", output.len(), n * t.size())?;
    output[r * n..(r + 1) * n].copy_from_slice(input);
    ring::all_gather(t, output)
}

/// [`all_gather`] with this rank's input already in its block of `buf` (no copy in).
pub fn all_gather_in_place<T: Element>(t: &mut dyn Transport, buf: &mut [T]) -> Result<()> {
    let p = t.size();
    check_len("all_gather_in_place buffer", buf.len(), buf.len() / p * p)?;
    ring::all_gather(t, buf)
}

pub fn reduce_scatter<T: Element>(
    t: &mut dyn Transport,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (r, n, p) = (t.rank(), output.len(), t.size());
    check_len("reduce_scatter input", input.len(), n * p)?;
    if T::widen(&[]).is_some() {
        // Raw inputs travel as 16 bits, partial sums as f32 (`ring::reduce_scatter_half`).
        let mut wide = ring::reduce_scatter_half(t, input, op)?;
        if op == ReduceOp::Avg {
            f32::div_by(&mut wide[r * n..(r + 1) * n], p);
        }
        T::narrow(&wide[r * n..(r + 1) * n], output);
        return Ok(());
    }
    let mut work = input.to_vec();
    ring::reduce_scatter(t, &mut work, op)?;
    output.copy_from_slice(&work[r * n..(r + 1) * n]);
    if op == ReduceOp::Avg {
        T::div_by(output, p);
    }
    Ok(())
}

/// [`reduce_scatter`] in place: block `rank` of `buf` gets the result (the ring reduces in
/// place, so no copy of the input; 16-bit floats go through [`reduce_scatter`]'s widening).
pub fn reduce_scatter_in_place<T: Element>(
    t: &mut dyn Transport,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    check_len(
        "reduce_scatter_in_place buffer",
        buf.len(),
        buf.len() / p * p,
    )?;
    let n = buf.len() / p;
    if T::widen(&[]).is_some() {
        let mut out = vec![T::zeroed(); n];
        reduce_scatter(t, buf, &mut out, op)?;
        buf[r * n..(r + 1) * n].copy_from_slice(&out);
        return Ok(());
    }
    ring::reduce_scatter(t, buf, op)?;
    if op == ReduceOp::Avg {
        T::div_by(&mut buf[r * n..(r + 1) * n], p);
    }
    Ok(())
}

pub fn gather<T: Element>(
    t: &mut dyn Transport,
    input: &[T],
    output: Option<&mut [T]>,
    root: usize,
) -> Result<()> {
    if t.rank() == root {
        let out = output.ok_or_else(|| {
            Error::InvalidArgument("gather: the root must pass an output buffer".into())
        })?;
        check_len("gather output", out.len(), input.len() * t.size())?;
        direct::gather(t, input, Some(out), root)
    } else {
        direct::gather(t, input, None, root)
    }
}

pub fn scatter<T: Element>(
    t: &mut dyn Transport,
    input: Option<&[T]>,
    output: &mut [T],
    root: usize,
) -> Result<()> {
    if t.rank() == root {
        let inp = input.ok_or_else(|| {
            Error::InvalidArgument("scatter: the root must pass an input buffer".into())
        })?;
        check_len("scatter input", inp.len(), output.len() * t.size())?;
        direct::scatter(t, Some(inp), output, root)
    } else {
        direct::scatter(t, None, output, root)
    }
}

pub fn all_to_all<T: Element>(t: &mut dyn Transport, input: &[T], output: &mut [T]) -> Result<()> {
    let p = t.size();
    if !input.len().is_multiple_of(p) {
        return Err(Error::InvalidArgument(format!(
            "all_to_all input has {} elements, not a multiple of the group size {p}",
            input.len()
        )));
    }
    check_len("all_to_all output", output.len(), input.len())?;
    direct::all_to_all(t, input, output)
}
