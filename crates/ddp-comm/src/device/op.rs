//! One device collective, as both device paths run it: [`DeviceOp`] names the collective and
//! its arguments once, so that NCCL (module `cuda`) and the relay path ([`super::relay`]) each
//! dispatch on it in one place, with one set of argument checks and one fingerprint.

use crate::dtype::{Element, ReduceOp};
use crate::transport::{Fingerprint, OpKind};
use crate::{Error, ProcessGroup, Result};

/// A device collective and its arguments (the buffers travel beside it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceOp {
    /// Reduce one buffer in place; every rank gets the result.
    AllReduce(ReduceOp),
    /// Copy `root`'s buffer into every rank's.
    Broadcast {
        /// The rank whose buffer is copied.
        root: usize,
    },
    /// Reduce every rank's buffer into `root`'s.
    Reduce {
        /// The reduction.
        op: ReduceOp,
        /// The rank that gets the result.
        root: usize,
    },
    /// Every rank's input concatenated in rank order into the output (`input * size`).
    AllGather,
    /// Reduce the input (`output * size` elements); rank `r` gets block `r` in its output.
    ReduceScatter(ReduceOp),
    /// Send one buffer to `dst`.
    Send {
        /// The receiving rank.
        dst: usize,
    },
    /// Receive one buffer from `src`.
    Recv {
        /// The sending rank.
        src: usize,
    },
}

impl DeviceOp {
    /// Its name in errors and work handles (`all_reduce`, `send`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DeviceOp::AllReduce(_) => "all_reduce",
            DeviceOp::Broadcast { .. } => "broadcast",
            DeviceOp::Reduce { .. } => "reduce",
            DeviceOp::AllGather => "all_gather",
            DeviceOp::ReduceScatter(_) => "reduce_scatter",
            DeviceOp::Send { .. } => "send",
            DeviceOp::Recv { .. } => "recv",
        }
    }

    /// Check the arguments on `pg` (root, peer, and the block sizes of `input` and `output`
    /// elements; a collective in place passes its one buffer's length twice), and return the
    /// collective's fingerprint for elements of `T` (its sequence number is set when it runs).
    pub fn fingerprint<T: Element>(
        self,
        pg: &ProcessGroup,
        input: usize,
        output: usize,
    ) -> Result<Fingerprint> {
        let dt = T::DTYPE;
        Ok(match self {
            DeviceOp::AllReduce(op) => pg.fingerprint(OpKind::AllReduce, dt, Some(op), input, None),
            DeviceOp::Broadcast { root } => {
                pg.check_root(root)?;
                pg.fingerprint(OpKind::Broadcast, dt, None, input, Some(root))
            }
            DeviceOp::Reduce { op, root } => {
                pg.check_root(root)?;
                pg.fingerprint(OpKind::Reduce, dt, Some(op), input, Some(root))
            }
            DeviceOp::AllGather => {
                check_blocks(pg, "all_gather", output, input)?;
                pg.fingerprint(OpKind::AllGather, dt, None, input, None)
            }
            DeviceOp::ReduceScatter(op) => {
                check_blocks(pg, "reduce_scatter", input, output)?;
                pg.fingerprint(OpKind::ReduceScatter, dt, Some(op), input, None)
            }
            DeviceOp::Send { dst } => {
                pg.check_peer(dst)?;
                pg.p2p_fingerprint::<T>(input, dst, true)
            }
            DeviceOp::Recv { src } => {
                pg.check_peer(src)?;
                pg.p2p_fingerprint::<T>(input, src, false)
            }
        })
    }
}

/// `big` must be `small * size` elements.
fn check_blocks(pg: &ProcessGroup, what: &str, big: usize, small: usize) -> Result<()> {
    if big != small * pg.size() {
        return Err(Error::InvalidArgument(format!(
            "{what} on rank {}: the full buffer has {big} elements but the per-rank one has \
             {small}; expected {small} x {} ranks = {}",
            pg.rank(),
            pg.size(),
            small * pg.size()
        )));
    }
    Ok(())
}
