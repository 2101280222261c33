//! Collective backends: what runs a group's collectives, above the [`Transport`] that moves its
//! bytes. A process group holds one `Box<dyn` [`CollectiveBackend`]`>`, chosen once by
//! [`select`] from what the user asked for ([`Backend`]) and where the ranks run
//! ([`crate::host`]); what was chosen is the group's [`Topology`].
//!
//! ```text
//!  ProcessGroup ──jobs──▶ engine thread ──▶ dyn CollectiveBackend ──▶ algorithms ──▶ dyn Transport
//!                                           ├ TcpBackend           flat: ring, rd, tree, direct  TcpTransport
//!                                           ├ ShmBackend           + shm_direct fast path        ShmTransport
//!                                           ├ HierarchicalBackend  + hierarchical all-reduce,    HierarchicalTransport
//!                                           │                        broadcast                   (mesh + shm per host)
//!                                           └ MpiBackend (feature `mpi`): MPI_I* collectives     MpiTransport
//!                                                                    on the job's MPI library    (MPI_Isend/Irecv)
//! ```
//!
//! Every entry point of the trait has a default: the collective written once over
//! [`CollectiveBackend::transport`] ([`flat`], the way Gloo writes each algorithm once against a
//! small transport interface). A backend overrides only what it does faster, as NCCL's
//! transports each export one small struct and one generic loop picks among them.
//!
//! Adding a backend: implement [`CollectiveBackend`] (a `transport()` for the message path,
//! plus overrides), add a [`Topology`] variant, and a branch in [`select`] (and a [`Backend`]
//! value if users may ask for it by name). A device backend (NCCL) also brings its own buffer
//! kind: see [`buffer`].

pub mod buffer;
pub mod flat;
mod hierarchical;
#[cfg(feature = "mpi")]
pub mod mpi;
mod shm;
mod tcp;

pub use crate::placement::{place_from, Place};
pub use buffer::{HostBuf, RawHostSlice};
pub use hierarchical::HierarchicalBackend;
#[cfg(feature = "mpi")]
pub use mpi::MpiBackend;
pub use shm::ShmBackend;
pub use tcp::TcpBackend;

/// A backend over one host transport `T` with the all-reduce algorithm the group asked for:
/// [`TcpBackend`] over the TCP mesh, [`ShmBackend`] over a shared-memory segment. Each
/// transport's module implements [`CollectiveBackend`] for it.
pub struct OverTransport<T> {
    transport: T,
    algorithm: AllReduceAlgorithm,
}

impl<T> OverTransport<T> {
    /// Run collectives over `transport`; all-reduce with `algorithm` (`Auto`: by size, and
    /// through the segment directly on shared memory).
    pub fn new(transport: T, algorithm: AllReduceAlgorithm) -> Self {
        OverTransport {
            transport,
            algorithm,
        }
    }
}

use crate::algorithms::{recursive_doubling, AllReduceAlgorithm};
use crate::dtype::ReduceOp;
use crate::host::{host_layout, HostLayout};
use crate::store::Store;
use crate::transport::hierarchical::HierarchicalTransport;
use crate::transport::shm::{ConnectError, ShmTransport};
use crate::transport::tcp::TcpTransport;
use crate::transport::{Fingerprint, Transport};
use crate::{Error, Result};
use buffer::with_element;
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which backend the user asked for ([`crate::InitOptions::backend`], env `DDP_BACKEND`).
/// What a group then uses is its [`Topology`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backend {
    /// Shared memory when every rank of the group is on this host; hierarchical when the ranks
    /// span hosts and some host has two or more; TCP when every rank is on its own host.
    #[default]
    Auto,
    /// TCP (loopback or network), like torch's gloo.
    Tcp,
    /// Shared memory; initialization fails if the ranks are not all on one host.
    Shm,
    /// The MPI library the job was launched with (`mpirun`/`srun`; crate feature `mpi`): rank
    /// and world size from `MPI_COMM_WORLD`, no store; like torch's `mpi` backend.
    Mpi,
}

impl Backend {
    /// Parse `auto`, `tcp` (alias `gloo`), `shm` or `mpi`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(Backend::Auto),
            "tcp" | "gloo" => Some(Backend::Tcp),
            "shm" => Some(Backend::Shm),
            "mpi" => Some(Backend::Mpi),
            _ => None,
        }
    }

    /// The backend named by env `DDP_BACKEND` (auto when unset).
    pub fn from_env() -> Result<Self> {
        match std::env::var("DDP_BACKEND") {
            Ok(v) => Backend::parse(&v).ok_or_else(|| {
                Error::Config(format!("DDP_BACKEND={v:?}: expected auto, tcp, shm or mpi"))
            }),
            Err(_) => Ok(Backend::Auto),
        }
    }
}

/// What a group's backend resolved to ([`crate::ProcessGroup::topology`]). Displays as
/// `tcp: 4 ranks, full mesh`, `shm: 3 ranks on one host` or
/// `hierarchical: 2 hosts x [2, 2] ranks, shm inside a host, tcp between`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Topology {
    /// A TCP full mesh among `ranks` ranks.
    Tcp { ranks: usize },
    /// One shared-memory segment among `ranks` ranks on one host.
    Shm { ranks: usize },
    /// A TCP mesh over the group plus shared memory inside each host; ranks per host, by host.
    Hierarchical { per_host: Vec<usize> },
    /// An MPI communicator of `ranks` ranks.
    Mpi { ranks: usize },
}

impl Topology {
    /// `tcp`, `shm`, `hierarchical` or `mpi`.
    pub fn name(&self) -> &'static str {
        match self {
            Topology::Tcp { .. } => "tcp",
            Topology::Shm { .. } => "shm",
            Topology::Hierarchical { .. } => "hierarchical",
            Topology::Mpi { .. } => "mpi",
        }
    }
}

impl fmt::Display for Topology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Topology::Tcp { ranks } => write!(f, "tcp: {ranks} ranks, full mesh"),
            Topology::Shm { ranks } => write!(f, "shm: {ranks} ranks on one host"),
            Topology::Hierarchical { per_host } => write!(
                f,
                "hierarchical: {} hosts x {per_host:?} ranks, shm inside a host, tcp between",
                per_host.len()
            ),
            Topology::Mpi { ranks } => write!(f, "mpi: {ranks} ranks, MPI communicator"),
        }
    }
}

/// Runs the collectives of one group on its engine thread. Every entry point takes host
/// buffers with their element type erased ([`HostBuf`], [`RawHostSlice`]); the defaults run the
/// collective over [`CollectiveBackend::transport`] ([`flat`]). Errors abort the group (the
/// engine then calls [`CollectiveBackend::abort`]).
pub trait CollectiveBackend: Send {
    /// What this backend is, for people and tests.
    fn topology(&self) -> Topology;

    /// The smallest [`all_gather_in_place_to`](CollectiveBackend::all_gather_in_place_to), in
    /// bytes of the whole buffer, that reads the peers' blocks straight from their memory;
    /// `None` when none does (the default: it all-gathers in place and copies).
    fn direct_gather_min(&self) -> Option<usize> {
        None
    }

    /// The message transport of the group (the defaults and point-to-point run on it).
    fn transport(&mut self) -> &mut dyn Transport;

    /// Tag the next collective's messages with `fp` and fail it after `deadline`.
    fn begin(&mut self, fp: Fingerprint, deadline: Instant) {
        self.transport().begin(fp, deadline);
    }

    /// Tell every peer the group is broken (best effort); later operations fail with `cause`.
    fn abort(&mut self, cause: &Error) {
        self.transport().abort(cause);
    }

    /// Reduce `buf` across the group; every rank gets the result.
    fn all_reduce(&mut self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()>;

    /// Copy `root`'s `buf` into every rank's.
    fn broadcast(&mut self, buf: HostBuf<'_>, root: usize) -> Result<()> {
        with_element!(buf.dtype(), T => flat::broadcast::<T>(self.transport(), buf.typed(), root))
    }

    /// Reduce every rank's `buf` into `root`'s.
    fn reduce(&mut self, buf: HostBuf<'_>, op: ReduceOp, root: usize) -> Result<()> {
        with_element!(buf.dtype(), T => flat::reduce::<T>(self.transport(), buf.typed(), op, root))
    }

    /// Concatenate every rank's `input` into `output`, in rank order.
    fn all_gather(&mut self, input: RawHostSlice<'_>, output: HostBuf<'_>) -> Result<()> {
        with_element!(input.dtype(), T => {
            flat::all_gather::<T>(self.transport(), input.typed(), output.typed())
        })
    }

    /// Reduce `input` across ranks; rank `r` gets block `r` in `output`.
    fn reduce_scatter(
        &mut self,
        input: RawHostSlice<'_>,
        output: HostBuf<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        with_element!(input.dtype(), T => {
            flat::reduce_scatter::<T>(self.transport(), input.typed(), output.typed(), op)
        })
    }

    /// All-gather in place (MPI's `MPI_IN_PLACE`): block `rank` of `buf` (`buf.len() / size`
    /// elements each) is this rank's input; afterwards `buf` holds every rank's block in rank
    /// order. The default copies the block out and runs [`CollectiveBackend::all_gather`].
    fn all_gather_in_place(&mut self, buf: HostBuf<'_>) -> Result<()> {
        with_element!(buf.dtype(), T => {
            let buf = buf.typed::<T>();
            let (r, p) = (self.transport().rank(), self.transport().size());
            flat::check_len("all_gather_in_place buffer", buf.len(), buf.len() / p * p)?;
            let n = buf.len() / p;
            let mine = buf[r * n..(r + 1) * n].to_vec();
            self.all_gather(RawHostSlice::new(&mine), HostBuf::new(buf))
        })
    }

    /// All-gather in place whose result the caller places where it wants it: block `rank` of
    /// `buf` is this rank's input (only read); `place(read)` is called once and calls
    /// `read(offset, dst)` for the ranges of the gathered buffer it wants (`offset` in
    /// elements, `dst` bytes of whole elements), each filling `dst` with those gathered
    /// elements. Every rank must call this (not [`all_gather_in_place`]) for the collective.
    /// The default all-gathers `buf` in place and copies out of it ([`place_from`]); a backend
    /// that can read its peers' memory reads their blocks straight into `dst` (one copy instead
    /// of a gather and a copy), leaving the other blocks of `buf` unspecified.
    ///
    /// [`all_gather_in_place`]: CollectiveBackend::all_gather_in_place
    fn all_gather_in_place_to(&mut self, mut buf: HostBuf<'_>, place: Place<'_>) -> Result<()> {
        self.all_gather_in_place(buf.reborrow())?;
        place_from(buf.bytes(), buf.dtype().size(), place)
    }

    /// Reduce-scatter in place: `buf` (`size` blocks) is this rank's input; afterwards block
    /// `rank` holds the reduction of every rank's block `rank`, and the other blocks are
    /// unspecified (input or scratch). The default reduces into a temporary and copies it in.
    fn reduce_scatter_in_place(&mut self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        with_element!(buf.dtype(), T => {
            let buf = buf.typed::<T>();
            let (r, p) = (self.transport().rank(), self.transport().size());
            flat::check_len("reduce_scatter_in_place buffer", buf.len(), buf.len() / p * p)?;
            let n = buf.len() / p;
            let mut out = vec![<T as bytemuck::Zeroable>::zeroed(); n];
            self.reduce_scatter(RawHostSlice::new(buf), HostBuf::new(&mut out), op)?;
            buf[r * n..(r + 1) * n].copy_from_slice(&out);
            Ok(())
        })
    }

    /// Gather every rank's `input` into `output` on `root` (required there only).
    fn gather(
        &mut self,
        input: RawHostSlice<'_>,
        output: Option<HostBuf<'_>>,
        root: usize,
    ) -> Result<()> {
        with_element!(input.dtype(), T => {
            let out = output.map(|o| o.typed::<T>());
            flat::gather::<T>(self.transport(), input.typed(), out, root)
        })
    }

    /// Scatter `root`'s `input` (ignored elsewhere): rank `r` gets block `r` in `output`.
    fn scatter(
        &mut self,
        input: Option<RawHostSlice<'_>>,
        output: HostBuf<'_>,
        root: usize,
    ) -> Result<()> {
        with_element!(output.dtype(), T => {
            let inp = input.map(|i| i.typed::<T>());
            flat::scatter::<T>(self.transport(), inp, output.typed(), root)
        })
    }

    /// Block `j` of `input` goes to rank `j`; block `i` of `output` comes from rank `i`.
    fn all_to_all(&mut self, input: RawHostSlice<'_>, output: HostBuf<'_>) -> Result<()> {
        with_element!(input.dtype(), T => {
            flat::all_to_all::<T>(self.transport(), input.typed(), output.typed())
        })
    }

    /// Return once every rank has entered the barrier.
    fn barrier(&mut self) -> Result<()> {
        recursive_doubling::all_reduce::<u8>(self.transport(), &mut [], ReduceOp::Sum)
    }

    /// Send `data` to rank `to`.
    fn send(&mut self, data: RawHostSlice<'_>, to: usize) -> Result<()> {
        with_element!(data.dtype(), T => {
            self.transport().send(to, bytemuck::cast_slice::<T, u8>(data.typed()))
        })
    }

    /// The subgroup of `members` (sorted ranks of this group) for a backend whose subgroups
    /// come from the library it runs on (MPI: `MPI_Comm_split` of this group's communicator):
    /// `Some` on members, `None` elsewhere; every rank of the group calls it, in the same
    /// order. Backends that connect subgroups through the store (all others) never get here.
    fn split(&mut self, members: &[usize]) -> Result<Option<Box<dyn CollectiveBackend>>> {
        let _ = members;
        Err(Error::Internal(format!(
            "{} groups connect their subgroups through the store, not by splitting",
            self.topology().name()
        )))
    }

    /// Receive `buf` from rank `from`.
    fn recv(&mut self, buf: HostBuf<'_>, from: usize) -> Result<()> {
        with_element!(buf.dtype(), T => {
            self.transport().recv(from, bytemuck::cast_slice_mut::<T, u8>(buf.typed()))
        })
    }
}

/// What [`select`] needs to connect a group's backend.
pub struct BackendPlan {
    /// The group's store (namespaced for the group).
    pub store: Arc<dyn Store>,
    pub rank: usize,
    pub size: usize,
    /// The address peers use to reach this rank over TCP.
    pub local_ip: IpAddr,
    /// Connection and collective timeout.
    pub timeout: Duration,
    /// What the user asked for.
    pub backend: Backend,
    /// All-reduce algorithm; a forced one runs flat (no shm fast path, no hierarchical all-reduce).
    pub algorithm: AllReduceAlgorithm,
    /// This process's host id ([`crate::host::host_id`] unless overridden).
    pub host_id: String,
    /// Log a warning when a collective waits this long, and again every such interval.
    pub warn_after: Option<Duration>,
}

/// The one place that picks a group's backend:
///
/// - `tcp`: the TCP mesh.
/// - every rank on this host: shared memory (`auto` falls back to TCP if no segment can be
///   created);
/// - ranks on several hosts, some host with at least two: `shm` fails naming a remote rank,
///   `auto` builds the hierarchical backend (TCP mesh plus shared memory per host);
/// - one rank per host: `shm` fails, `auto` uses the TCP mesh.
pub fn select(plan: &BackendPlan) -> Result<Box<dyn CollectiveBackend>> {
    let p = plan;
    if p.backend == Backend::Mpi {
        return Err(Error::Internal(
            "backend mpi groups come from MPI_COMM_WORLD, not from a store".into(),
        ));
    }
    let tcp = || -> Result<Box<dyn CollectiveBackend>> {
        let mut mesh =
            TcpTransport::connect_mesh(&*p.store, p.rank, p.size, p.local_ip, p.timeout)?;
        mesh.set_warn_after(p.warn_after);
        Ok(Box::new(TcpBackend::new(mesh, p.algorithm)))
    };
    if p.backend == Backend::Tcp {
        return tcp();
    }
    let require_shm = p.backend == Backend::Shm;
    let layout: HostLayout = host_layout(&*p.store, p.rank, p.size, &p.host_id, p.timeout)?;
    let Some(why) = &layout.mismatch else {
        return match ShmTransport::connect_inner(&*p.store, p.rank, p.size, p.timeout) {
            Ok(mut t) => {
                t.set_warn_after(p.warn_after, None);
                Ok(Box::new(ShmBackend::new(t, p.algorithm)))
            }
            Err(ConnectError::NoSegment(e)) if !require_shm => {
                tracing::warn!("{e}; using TCP");
                tcp()
            }
            Err(ConnectError::NoSegment(e) | ConnectError::Other(e)) => Err(e),
        };
    };
    if require_shm {
        return Err(Error::Config(format!(
            "backend shm needs every rank of the group on one host, but {why} (use backend auto or tcp)"
        )));
    }
    if layout.hosts() < p.size {
        tracing::debug!("group spans hosts ({why}): TCP mesh plus shared memory inside hosts");
        let mut h = HierarchicalTransport::connect(
            &p.store, p.rank, p.size, p.local_ip, p.timeout, &layout,
        )?;
        h.set_warn_after(p.warn_after);
        return Ok(Box::new(HierarchicalBackend::new(h, p.algorithm)));
    }
    tracing::debug!("group spans hosts ({why}), one rank per host: using TCP");
    tcp()
}
