//! The shared-memory backend: ranks on one host. All-reduce and large reduce-scatters go
//! straight through the segment ([`crate::algorithms::shm_direct`]); every other collective
//! runs the flat algorithms over the segment's message rings.

use super::{
    flat, place_from, with_element, CollectiveBackend, HostBuf, OverTransport, Place, RawHostSlice,
    Topology,
};
use crate::algorithms::{shm_direct, AllReduceAlgorithm};
use crate::dtype::ReduceOp;
use crate::transport::shm::ShmTransport;
use crate::transport::Transport;
use crate::Result;

/// One shared-memory segment among the group's ranks, with its fast paths (a forced
/// algorithm skips the all-reduce fast path).
pub type ShmBackend = OverTransport<ShmTransport>;

impl CollectiveBackend for ShmBackend {
    fn topology(&self) -> Topology {
        Topology::Shm {
            ranks: self.transport.size(),
        }
    }

    fn transport(&mut self) -> &mut dyn Transport {
        &mut self.transport
    }

    fn all_reduce(&mut self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        let algo = self.algorithm;
        with_element!(buf.dtype(), T => {
            if algo == AllReduceAlgorithm::Auto {
                shm_direct::all_reduce::<T>(&mut self.transport, buf.typed(), op)
            } else {
                flat::all_reduce::<T>(&mut self.transport, buf.typed(), op, algo)
            }
        })
    }

    fn reduce_scatter(
        &mut self,
        input: RawHostSlice<'_>,
        output: HostBuf<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        with_element!(input.dtype(), T => {
            let (input, output) = (input.typed::<T>(), output.typed::<T>());
            flat::check_len("reduce_scatter input", input.len(), output.len() * self.transport.size())?;
            if shm_direct::reduce_scatter(&mut self.transport, input, output, op)? {
                return Ok(());
            }
            flat::reduce_scatter(&mut self.transport, input, output, op)
        })
    }

    fn reduce_scatter_in_place(&mut self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        with_element!(buf.dtype(), T => {
            let buf = buf.typed::<T>();
            let p = self.transport.size();
            flat::check_len("reduce_scatter_in_place buffer", buf.len(), buf.len() / p * p)?;
            if shm_direct::reduce_scatter_in_place(&mut self.transport, buf, op)? {
                return Ok(());
            }
            flat::reduce_scatter_in_place(&mut self.transport, buf, op)
        })
    }

    fn all_gather_in_place(&mut self, buf: HostBuf<'_>) -> Result<()> {
        with_element!(buf.dtype(), T => flat::all_gather_in_place::<T>(&mut self.transport, buf.typed()))
    }

    fn all_gather_in_place_to(&mut self, mut buf: HostBuf<'_>, place: Place<'_>) -> Result<()> {
        let (p, esz) = (self.transport.size(), buf.dtype().size());
        flat::check_len(
            "all_gather_in_place_to buffer",
            buf.len(),
            buf.len() / p * p,
        )?;
        if shm_direct::all_gather_to(&mut self.transport, buf.bytes(), esz, &mut *place)? {
            return Ok(());
        }
        self.all_gather_in_place(buf.reborrow())?;
        place_from(buf.bytes(), esz, place)
    }

    fn direct_gather_min(&self) -> Option<usize> {
        shm_direct::direct_min(&self.transport)
    }
}
