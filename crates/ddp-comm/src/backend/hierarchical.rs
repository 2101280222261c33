//! The hierarchical backend: ranks on several hosts, some host with two or more. All-reduce
//! and broadcast cross hosts once per host ([`crate::algorithms::hierarchical`]); every other
//! collective runs the flat algorithms over the group's TCP mesh.

use super::{flat, with_element, CollectiveBackend, HostBuf, Topology};
use crate::algorithms::{hierarchical, AllReduceAlgorithm};
use crate::dtype::{Element, ReduceOp};
use crate::transport::hierarchical::HierarchicalTransport;
use crate::transport::Transport;
use crate::Result;

/// A TCP mesh plus shared memory inside each host.
pub struct HierarchicalBackend {
    h: HierarchicalTransport,
    algorithm: AllReduceAlgorithm,
}

impl HierarchicalBackend {
    /// Run collectives over `h`; a forced `algorithm` runs all-reduce flat over the mesh.
    pub fn new(h: HierarchicalTransport, algorithm: AllReduceAlgorithm) -> Self {
        HierarchicalBackend { h, algorithm }
    }
}

/// The hierarchical all-reduce, `f16`/`bf16` widened to `f32` first (as the flat one does).
fn all_reduce<T: Element>(
    h: &mut HierarchicalTransport,
    buf: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    if let Some(mut wide) = T::widen(buf) {
        all_reduce::<f32>(h, &mut wide, op)?;
        T::narrow(&wide, buf);
        return Ok(());
    }
    hierarchical::all_reduce(h, buf, op)
}

impl CollectiveBackend for HierarchicalBackend {
    fn topology(&self) -> Topology {
        Topology::Hierarchical {
            per_host: self.h.per_host().to_vec(),
        }
    }

    /// The mesh; its `begin` and `abort` also reach the local shared memory.
    fn transport(&mut self) -> &mut dyn Transport {
        &mut self.h
    }

    fn all_reduce(&mut self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        let algo = self.algorithm;
        with_element!(buf.dtype(), T => {
            if algo == AllReduceAlgorithm::Auto {
                all_reduce::<T>(&mut self.h, buf.typed(), op)
            } else {
                flat::all_reduce::<T>(&mut self.h, buf.typed(), op, algo)
            }
        })
    }

    fn broadcast(&mut self, buf: HostBuf<'_>, root: usize) -> Result<()> {
        with_element!(buf.dtype(), T => hierarchical::broadcast::<T>(&mut self.h, buf.typed(), root))
    }
}
