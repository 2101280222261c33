//! Binomial trees rooted at any rank: broadcast (root's buffer reaches everyone in
//! `ceil(log2 p)` rounds, children served concurrently) and reduce (partials flow to the root).
//! Ranks are renumbered `v = (rank - root) mod p` so the root is always virtual rank 0.

use super::{bytes, bytes_mut};
use crate::dtype::{Element, ReduceOp};
use crate::transport::{SendTo, Transport};
use crate::Result;

/// Broadcast `buf` from `root` to every rank.
pub fn broadcast<T: Element>(t: &mut dyn Transport, buf: &mut [T], root: usize) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    let v = (r + p - root) % p;
    let real = |v: usize| (v + root) % p;
    let mut mask = 1;
    while mask < p {
        if v & mask != 0 {
            t.recv(real(v - mask), bytes_mut(buf))?;
            break;
        }
        mask <<= 1;
    }
    let mut children = Vec::new();
    mask >>= 1;
    while mask > 0 {
        if v + mask < p {
            children.push(real(v + mask));
        }
        mask >>= 1;
    }
    if !children.is_empty() {
        let data = bytes(buf);
        let mut sends: Vec<SendTo<'_>> = children.iter().map(|&to| SendTo { to, data }).collect();
        t.exchange(&mut sends, &mut [])?;
    }
    Ok(())
}

/// Reduce every rank's `buf` into `root`'s `buf`; other ranks' buffers are left unchanged.
pub fn reduce<T: Element>(
    t: &mut dyn Transport,
    buf: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (r, p) = (t.rank(), t.size());
    let v = (r + p - root) % p;
    let real = |v: usize| (v + root) % p;
    let mut own: Option<Vec<T>> = None; // non-roots accumulate in a copy
    let mut tmp: Vec<T> = Vec::new();
    let mut mask = 1;
    while mask < p {
        let acc: &mut [T] = match own.as_mut() {
            Some(v) => v,
            None if v == 0 => buf,
            None => own.insert(buf.to_vec()),
        };
        if v & mask == 0 {
            if v | mask < p {
                tmp.resize(acc.len(), T::zeroed());
                t.recv(real(v | mask), bytes_mut(&mut tmp))?;
                T::reduce_into(acc, &tmp, op);
            }
        } else {
            t.send(real(v - mask), bytes(acc))?;
            break;
        }
        mask <<= 1;
    }
    Ok(())
}
