//! The TCP backend: every collective over the full mesh of [`TcpTransport`], with the flat
//! algorithms ([`super::flat`]) picked by message size, like torch's gloo.

use super::{flat, with_element, CollectiveBackend, HostBuf, OverTransport, Topology};
use crate::dtype::ReduceOp;
use crate::transport::tcp::TcpTransport;
use crate::transport::Transport;
use crate::Result;

/// The TCP mesh with its algorithms.
pub type TcpBackend = OverTransport<TcpTransport>;

impl CollectiveBackend for TcpBackend {
    fn topology(&self) -> Topology {
        Topology::Tcp {
            ranks: self.transport.size(),
        }
    }

    fn transport(&mut self) -> &mut dyn Transport {
        &mut self.transport
    }

    fn all_reduce(&mut self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        let algo = self.algorithm;
        with_element!(buf.dtype(), T => flat::all_reduce::<T>(&mut self.transport, buf.typed(), op, algo))
    }

    fn reduce_scatter_in_place(&mut self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        with_element!(buf.dtype(), T => {
            flat::reduce_scatter_in_place::<T>(&mut self.transport, buf.typed(), op)
        })
    }

    fn all_gather_in_place(&mut self, buf: HostBuf<'_>) -> Result<()> {
        with_element!(buf.dtype(), T => flat::all_gather_in_place::<T>(&mut self.transport, buf.typed()))
    }
}
