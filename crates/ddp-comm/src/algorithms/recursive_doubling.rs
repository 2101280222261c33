//! Recursive doubling all-reduce: `ceil(log2 p)` exchanges of the whole buffer, the latency
//! optimum for small messages.
//!
//! With `p` not a power of two, let `q` be the largest power of two below `p` and `e = p - q`:
//! ranks `0, 2, .., 2e-2` first hand their data to `1, 3, .., 2e-1` and wait; the remaining `q`
//! ranks run the hypercube exchange (partner = virtual rank XOR mask); then the folded ranks get
//! the result back.

use super::{bytes, bytes_mut};
use crate::dtype::{Element, ReduceOp};
use crate::transport::Transport;
use crate::Result;

/// All-reduce `buf` in place.
pub fn all_reduce<T: Element>(t: &mut dyn Transport, buf: &mut [T], op: ReduceOp) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    if p == 1 {
        return Ok(());
    }
    let q = 1usize << (usize::BITS - 1 - p.leading_zeros());
    let extra = p - q;
    let mut tmp: Vec<T> = vec![T::zeroed(); buf.len()];
    // Fold: even ranks below 2*extra give their data away and sit out the hypercube.
    let vrank = if r < 2 * extra {
        if r % 2 == 0 {
            t.send(r + 1, bytes(buf))?;
            t.recv(r + 1, bytes_mut(buf))?;
            return Ok(());
        }
        t.recv(r - 1, bytes_mut(&mut tmp))?;
        T::reduce_into(buf, &tmp, op);
        r / 2
    } else {
        r - extra
    };
    let real = |v: usize| if v < extra { 2 * v + 1 } else { v + extra };
    let mut mask = 1;
    while mask < q {
        let partner = real(vrank ^ mask);
        t.send_recv(partner, bytes(buf), partner, bytes_mut(&mut tmp))?;
        T::reduce_into(buf, &tmp, op);
        mask <<= 1;
    }
    if r < 2 * extra {
        t.send(r - 1, bytes(buf))?;
    }
    Ok(())
}
