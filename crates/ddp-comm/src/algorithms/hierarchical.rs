//! Hierarchical all-reduce over a [`HierarchicalTransport`] (ranks on several hosts): reduce
//! inside each host over shared memory, all-reduce among the hosts' leaders over TCP, then
//! copy the leader's result to the other ranks of its host.
//!
//! ```text
//!                   host 0 (ranks 0, 1)        host 1 (ranks 2, 3, 4)
//!  1 local   shm    a0+a1 on 0 and 1           a2+a3+a4 on 2, 3, 4     shm all-reduce fast path
//!  2 leaders tcp    rank 0  ◀───────────────▶  rank 2                  ring / recursive doubling
//!  3 local   shm    0 ──▶ 1                    2 ──▶ 3, 4              broadcast from the leader
//! ```
//!
//! Across hosts only the leaders send, once each way per byte of the ring instead of once per
//! rank. Every rank ends with its leader's bytes, and the leaders' all-reduce gives them all
//! the same bits, so results are bit-identical on every rank. `Avg` runs as `Sum` and the
//! leaders divide once, by the group size. `f16`/`bf16` arrive widened to `f32` (as
//! [`crate::ProcessGroup::all_reduce`] does for every algorithm), so they round once.
//!
//! [`broadcast`] crosses hosts once per host too: the root's host gets the data over shared
//! memory, its leader sends it down a binomial tree of leaders over TCP, and each other leader
//! broadcasts it inside its host. The other collectives run over the group's TCP mesh.
//!
//! Against flat TCP (`DDP_BACKEND=tcp`) on two simulated hosts: the book's benchmarks chapter
//! (`docs/benchmarks.md`, "Hierarchical all-reduce").

use super::{recursive_doubling, ring, shm_direct, tree, AllReduceAlgorithm};
use crate::dtype::{Element, ReduceOp};
use crate::transport::hierarchical::HierarchicalTransport;
use crate::transport::Transport;
use crate::Result;

/// All-reduce `buf` in place over the group of `h`.
pub fn all_reduce<T: Element>(
    h: &mut HierarchicalTransport,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    let partial = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    let size = h.size();
    let r = shm_direct::all_reduce(h.local(), buf, partial);
    r.map_err(|e| h.local_error(e))?;
    if let Some(mut leaders) = h.leaders() {
        match AllReduceAlgorithm::Auto.resolve(std::mem::size_of_val(buf), leaders.size()) {
            AllReduceAlgorithm::Ring => ring::all_reduce(&mut leaders, buf, partial)?,
            _ => recursive_doubling::all_reduce(&mut leaders, buf, partial)?,
        }
        if op == ReduceOp::Avg {
            T::div_by(buf, size);
        }
    }
    let r = tree::broadcast(h.local(), buf, 0);
    r.map_err(|e| h.local_error(e))
}

/// Broadcast `buf` from group rank `root` over the group of `h` (see the module doc).
pub fn broadcast<T: Element>(
    h: &mut HierarchicalTransport,
    buf: &mut [T],
    root: usize,
) -> Result<()> {
    let (root_host, root_local) = h.locate(root);
    if let Some(l) = root_local {
        // The root's host: everyone, its leader included, gets the data from the root.
        let r = tree::broadcast(h.local(), buf, l);
        r.map_err(|e| h.local_error(e))?;
    }
    if let Some(mut leaders) = h.leaders() {
        tree::broadcast(&mut leaders, buf, root_host)?;
    }
    if root_local.is_none() {
        let r = tree::broadcast(h.local(), buf, 0);
        r.map_err(|e| h.local_error(e))?;
    }
    Ok(())
}
