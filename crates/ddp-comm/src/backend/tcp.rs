//! The TCP backend: every collective over the full mesh of [`TcpTransport`], with the flat
//! algorithms ([`super::flat`]) picked by message size, like torch's gloo.

use super::{flat, with_element, CollectiveBackend, HostBuf, Topology};
use crate::algorithms::AllReduceAlgorithm;
use crate::dtype::ReduceOp;
use crate::transport::tcp::TcpTransport;
use crate::transport::Transport;
use crate::Result;

/// The TCP mesh with its algorithms.
pub struct TcpBackend {
    mesh: TcpTransport,
    algorithm: AllReduceAlgorithm,
}

impl TcpBackend {
    /// Run collectives over `mesh`, all-reduce with `algorithm`.
    pub fn new(mesh: TcpTransport, algorithm: AllReduceAlgorithm) -> Self {
        TcpBackend { mesh, algorithm }
    }
}

impl CollectiveBackend for TcpBackend {
    fn topology(&self) -> Topology {
        Topology::Tcp {
            ranks: self.mesh.size(),
        }
    }

    fn transport(&mut self) -> &mut dyn Transport {
        &mut self.mesh
    }

    fn all_reduce(&mut self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        let algo = self.algorithm;
        with_element!(buf.dtype(), T => flat::all_reduce::<T>(&mut self.mesh, buf.typed(), op, algo))
    }

    fn reduce_scatter_in_place(&mut self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        with_element!(buf.dtype(), T => {
            flat::reduce_scatter_in_place::<T>(&mut self.mesh, buf.typed(), op)
        })
    }

    fn all_gather_in_place(&mut self, buf: HostBuf<'_>) -> Result<()> {
        with_element!(buf.dtype(), T => flat::all_gather_in_place::<T>(&mut self.mesh, buf.typed()))
    }
}
