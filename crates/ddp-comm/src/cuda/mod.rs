//! Collectives on CUDA device memory (feature `nccl`): [`CudaGroup`], built from a host
//! [`ProcessGroup`] (its store, rank and world) and a device, runs every collective either on
//! an NCCL communicator or relayed through the host ([`crate::device::relay`]);
//! [`CudaGroup::topology`]
//! says which. Buffers are cudarc's [`CudaSlice`](cudarc::driver::CudaSlice) (candle's CUDA storage hands these out too:
//! both use cudarc 0.19).
//!
//! ```text
//!  caller's compute stream ──event──▶ comm stream: ncclAllReduce ... ──event──▶ CudaWork
//!        (ordered after the work       (one per group; NCCL's kernels    wait(): host waits
//!         queued before the call)        or the relay's copies)          (watchdog-bounded),
//!                                                                         compute stream waits
//! ```
//!
//! - Init: rank 0 creates the NCCL unique id and publishes it through the group's store
//!   ([`crate::device::exchange_unique_id`]); each rank joins on device
//!   `LOCAL_RANK % device_count` unless [`CudaOptions::device`] says otherwise (torch's
//!   `torch.cuda.set_device(local_rank)`). Subgroups ([`CudaGroup::new_group`]) get their own
//!   communicators.
//! - [`DeviceBackend::Auto`] uses NCCL iff every rank has its own GPU (device UUIDs exchanged
//!   through the store) and libnccl loads; otherwise relayed through pinned host memory and the
//!   host group's shared-memory/TCP collectives.
//! - Failures never hang: the watchdog ([`crate::device::watchdog`]) aborts the communicator
//!   (`ncclCommAbort`) when a collective does not finish within the timeout or
//!   `ncclCommGetAsyncError` reports one; every rank's pending and later collectives fail naming
//!   the collective and its sequence number. Before the first use of a new shape the fingerprint
//!   (op, dtype, count, root) is compared across ranks through the host group
//!   ([`crate::device::check`]).
//! - Missing `libcuda`/`libnccl` is an [`Error::Library`] naming the library and
//!   `LD_LIBRARY_PATH` ([`libs`]), never a panic.
//!
//! Element types: f32, f64, f16, bf16, i32, i64, u8 ([`CudaElement`]). Operations: all_reduce
//! (sum, avg, min, max, product), broadcast, reduce, all_gather, reduce_scatter, send/recv,
//! barrier; each blocking over `&mut CudaSlice<T>` and `*_async` over an owned `CudaSlice<T>`
//! returning a [`CudaWork`] that gives it back.
//!
//! Tests: the CPU-side ones run everywhere with `--features nccl`
//! (`cargo nextest run -p ddp-comm --features nccl`); the GPU ones are in
//! `tests/cuda_gpu.rs` and print a skip reason without a GPU (see that file for the bundle's
//! command lines).

pub mod libs;
mod nccl;
mod relay;

pub use crate::device::{DeviceBackend, DeviceTopology};

use crate::collectives::Wait;
use crate::device::check::ShapeCheck;
use crate::device::relay::RelayGroup;
use crate::device::watchdog::{Completion, Watchdog, WatchdogTiming, Watched};
use crate::device::{choose_backend, exchange_device_ids, exchange_unique_id, DeviceId};
use crate::dtype::Element;
use crate::transport::{Fingerprint, OpKind};
use crate::work::Work;
use crate::{Error, ProcessGroup, Result};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits,
};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t};
use libs::{guard, probe, Library};
use relay::{OnStream, PinnedRelay};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// An element type device collectives carry: `f32, f64, f16, bf16, i32, i64, u8`.
pub trait CudaElement: Element + DeviceRepr + ValidAsZeroBits {}
impl<T: Element + DeviceRepr + ValidAsZeroBits> CudaElement for T {}

/// How to build a [`CudaGroup`].
#[derive(Debug, Clone, Default)]
pub struct CudaOptions {
    /// NCCL, relay, or auto (default: env `DDP_DEVICE_BACKEND`, else auto).
    pub backend: Option<DeviceBackend>,
    /// CUDA device ordinal (default: `LOCAL_RANK % device_count`, `LOCAL_RANK` defaulting to
    /// the group rank).
    pub device: Option<usize>,
    /// Timeout of every collective (default: the process group's).
    pub timeout: Option<Duration>,
    /// The stream the caller computes on: collectives start after the work queued on it and
    /// [`CudaWork::wait`] orders it after them (default: the device's default stream).
    pub compute_stream: Option<Arc<CudaStream>>,
}

/// Turn a cudarc driver error into ours, naming the call and the rank.
pub(crate) fn driver_err(call: &'static str, rank: usize) -> impl Fn(DriverError) -> Error {
    move |e| Error::Device {
        call: call.into(),
        rank,
        message: e.to_string(),
    }
}

/// Whether libnccl can be loaded here (`Err` says why not and what to do).
pub fn nccl_available() -> Result<()> {
    probe(
        Library::Nccl,
        std::env::var("LD_LIBRARY_PATH").ok().as_deref(),
    )
}

/// Number of CUDA devices; a missing libcuda is an [`Error::Library`].
pub fn device_count() -> Result<usize> {
    probe(
        Library::Cuda,
        std::env::var("LD_LIBRARY_PATH").ok().as_deref(),
    )?;
    guard("cuDeviceGetCount", || {
        CudaContext::device_count()
            .map(|n| n as usize)
            .map_err(driver_err("cuDeviceGetCount", 0))
    })
}

enum Imp {
    Nccl {
        comm: Arc<nccl::Comm>,
        watchdog: Watchdog,
        shapes: ShapeCheck,
        seq: AtomicU64,
    },
    Relay(RelayGroup),
}

/// Collectives on CUDA memory among the ranks of a [`ProcessGroup`].
pub struct CudaGroup {
    pg: ProcessGroup,
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    comm_stream: Arc<CudaStream>,
    topology: DeviceTopology,
    timeout: Duration,
    opts: CudaOptions,
    imp: Imp,
}

impl std::fmt::Debug for CudaGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaGroup")
            .field("rank", &self.pg.rank())
            .field("size", &self.pg.size())
            .field("device", &self.ctx.ordinal())
            .field("topology", &self.topology)
            .finish()
    }
}

/// The CUDA-side key prefix of a group in its store.
const KEY: &str = "cuda";

impl CudaGroup {
    /// Build the device group of `pg` (every rank of `pg` must call this, in the same order of
    /// `CudaGroup::new` calls on `pg`).
    pub fn new(pg: &ProcessGroup, opts: CudaOptions) -> Result<CudaGroup> {
        let rank = pg.rank();
        let requested = match opts.backend {
            Some(b) => b,
            None => DeviceBackend::from_env()?,
        };
        let count = device_count()?;
        if count == 0 {
            return Err(Error::Config(format!(
                "rank {rank}: no CUDA device is visible (CUDA_VISIBLE_DEVICES={:?})",
                std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default()
            )));
        }
        let ordinal = match opts.device {
            Some(d) if d >= count => {
                return Err(Error::Config(format!(
                    "rank {rank}: CUDA device {d} requested but only {count} visible"
                )))
            }
            Some(d) => d,
            None => local_rank(pg) % count,
        };
        let ctx = guard("cuCtxCreate", || {
            CudaContext::new(ordinal).map_err(driver_err("cuDevicePrimaryCtxRetain", rank))
        })?;
        let compute = match &opts.compute_stream {
            Some(s) => s.clone(),
            None => ctx.default_stream(),
        };
        let comm_stream = ctx
            .new_stream()
            .map_err(driver_err("cuStreamCreate", rank))?;
        let uuid = ctx.uuid().map_err(driver_err("cuDeviceGetUuid", rank))?;
        let me = DeviceId {
            host: crate::host::host_id(),
            device: uuid
                .bytes
                .iter()
                .map(|b| format!("{:02x}", *b as u8))
                .collect(),
        };
        let timeout = opts.timeout.unwrap_or(pg.timeout());
        let store = pg
            .store()
            .ok_or_else(|| {
                Error::Config(
                    "a CUDA group is made from a store-backed process group (DDP_BACKEND tcp, \
                     shm or auto); an MPI group has no store for the NCCL id exchange"
                        .into(),
                )
            })?
            .clone();
        let k = pg.next_device_group();
        let key = format!("{KEY}{k}");
        let ids = exchange_device_ids(
            &*store,
            &format!("{key}/dev"),
            rank,
            pg.size(),
            &me,
            timeout,
        )?;
        let nccl_ok = if requested == DeviceBackend::Relay {
            Err(String::new())
        } else {
            nccl_available().map_err(|e| e.to_string())
        };
        let topology = choose_backend(requested, &ids, nccl_ok)?;
        let imp = match &topology {
            DeviceTopology::Relay { .. } => {
                let relay = PinnedRelay {
                    ctx: ctx.clone(),
                    buf: None,
                    rank,
                };
                Imp::Relay(RelayGroup::new(pg, Box::new(relay)))
            }
            DeviceTopology::Nccl { .. } => {
                let id = exchange_unique_id(&*store, &format!("{key}/uid"), rank, timeout, || {
                    guard("ncclGetUniqueId", nccl::Comm::unique_id)
                })?;
                ctx.bind_to_thread()
                    .map_err(driver_err("cuCtxSetCurrent", rank))?;
                let comm = Arc::new(guard("ncclCommInitRank", || {
                    nccl::Comm::init(&id, rank, pg.size())
                })?);
                let c = comm.clone();
                let watchdog = Watchdog::start(
                    store.clone(),
                    format!("{key}/abort"),
                    rank,
                    Box::new(move |_| c.abort()),
                    WatchdogTiming::default(),
                )?;
                Imp::Nccl {
                    comm,
                    watchdog,
                    shapes: ShapeCheck::new(),
                    seq: AtomicU64::new(0),
                }
            }
        };
        tracing::debug!("rank {rank}: device {ordinal}, {topology}");
        Ok(CudaGroup {
            pg: pg.clone(),
            ctx,
            compute,
            comm_stream,
            topology,
            timeout,
            opts,
            imp,
        })
    }

    /// A device group over the subgroup `ranks` of this group (as
    /// [`ProcessGroup::new_group`]: every rank calls it; members get `Some`), with its own
    /// communicator, on the same device and with the same options.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<CudaGroup>> {
        let Some(sub) = self.pg.new_group(ranks)? else {
            return Ok(None);
        };
        let mut opts = self.opts.clone();
        opts.device = Some(self.ctx.ordinal());
        opts.backend = Some(match self.topology {
            DeviceTopology::Relay { .. } => DeviceBackend::Relay,
            DeviceTopology::Nccl { .. } => opts.backend.unwrap_or_default(),
        });
        CudaGroup::new(&sub, opts).map(Some)
    }

    /// This rank in the group.
    pub fn rank(&self) -> usize {
        self.pg.rank()
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.pg.size()
    }

    /// The host group underneath.
    pub fn process_group(&self) -> &ProcessGroup {
        &self.pg
    }

    /// The CUDA context (device) of this rank.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The device ordinal of this rank.
    pub fn device(&self) -> usize {
        self.ctx.ordinal()
    }

    /// The caller's compute stream the collectives are ordered against.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The stream the collectives run on.
    pub fn comm_stream(&self) -> &Arc<CudaStream> {
        &self.comm_stream
    }

    /// NCCL or relay, and why.
    pub fn topology(&self) -> &DeviceTopology {
        &self.topology
    }

    /// Timeout of every collective.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// An event after the work queued so far on the compute stream.
    fn ready(&self) -> Result<Arc<CudaEvent>> {
        self.compute
            .record_event(None)
            .map(Arc::new)
            .map_err(driver_err("cuEventRecord", self.rank()))
    }

    fn on<S>(&self, buf: S) -> Result<OnStream<S>> {
        Ok(OnStream {
            buf,
            stream: self.comm_stream.clone(),
            ready: self.ready()?,
            rank: self.rank(),
        })
    }

    /// Enqueue an NCCL collective (after the fingerprint check) on the comm stream, ordered
    /// after the compute stream; the returned pending work becomes a [`CudaWork`] with a value.
    fn nccl(
        &self,
        mut fp: Fingerprint,
        enqueue: impl FnOnce(ncclComm_t, cudaStream_t) -> std::result::Result<(), NcclError>,
    ) -> Result<Pending> {
        let Imp::Nccl {
            comm,
            watchdog,
            shapes,
            seq,
        } = &self.imp
        else {
            return Err(Error::Internal(
                "an NCCL collective on a relay group".into(),
            ));
        };
        if let Some(cause) = watchdog.broken() {
            return Err(Error::Aborted(Box::new(cause)));
        }
        fp.seq = seq.fetch_add(1, Ordering::SeqCst);
        if fp.op != OpKind::SendRecv {
            shapes.check(&self.pg, &fp)?;
        }
        let rank = self.rank();
        self.comm_stream
            .wait(&*self.ready()?)
            .map_err(driver_err("cuStreamWaitEvent", rank))?;
        let stream = self.comm_stream.cu_stream() as cudaStream_t;
        comm.with(&format!("{fp} #{}", fp.seq), |c| enqueue(c, stream))?;
        let done = Arc::new(
            self.comm_stream
                .record_event(None)
                .map_err(driver_err("cuEventRecord", rank))?,
        );
        let watched = watchdog.watch(
            fp,
            self.timeout,
            Box::new(EventDone {
                event: done.clone(),
                comm: comm.clone(),
            }),
        );
        Ok(Pending {
            watched,
            done,
            compute: self.compute.clone(),
        })
    }
}

/// An enqueued NCCL collective, before its output is attached.
struct Pending {
    watched: Watched,
    done: Arc<CudaEvent>,
    compute: Arc<CudaStream>,
}

impl Pending {
    fn with<R>(self, value: R) -> CudaWork<R> {
        CudaWork {
            inner: WorkInner::Nccl {
                watched: self.watched,
                done: self.done,
                compute: self.compute,
                value: Some(value),
            },
        }
    }
}

/// The watchdog's view of an NCCL collective: its completion event and the communicator's
/// asynchronous error.
struct EventDone {
    event: Arc<CudaEvent>,
    comm: Arc<nccl::Comm>,
}

impl Completion for EventDone {
    fn poll(&mut self) -> Result<bool> {
        self.comm.async_error()?;
        self.event
            .try_is_complete()
            .map_err(driver_err("cuEventQuery", 0))
    }
}

/// The rank of this process on its host (`LOCAL_RANK`, else the group rank).
fn local_rank(pg: &ProcessGroup) -> usize {
    std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(pg.rank())
}

enum WorkInner<R> {
    Nccl {
        watched: Watched,
        done: Arc<CudaEvent>,
        compute: Arc<CudaStream>,
        value: Option<R>,
    },
    Host(Box<dyn HostWait<R>>),
}

/// A relayed collective's [`Work`] with the conversion of its output.
trait HostWait<R>: Send {
    fn is_completed(&self) -> bool;
    fn wait(self: Box<Self>) -> Result<R>;
}

struct Mapped<X, F> {
    work: Work<X>,
    f: F,
}

impl<X: Send, R, F: FnOnce(X) -> R + Send> HostWait<R> for Mapped<X, F> {
    fn is_completed(&self) -> bool {
        self.work.is_completed()
    }
    fn wait(self: Box<Self>) -> Result<R> {
        let Mapped { work, f } = *self;
        work.wait().map(f)
    }
}

/// A device collective in flight; [`CudaWork::wait`] returns its output.
#[must_use = "a CudaWork must be waited on to observe errors and get its buffer back"]
pub struct CudaWork<R> {
    inner: WorkInner<R>,
}

impl<R> CudaWork<R> {
    /// Whether the collective finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        match &self.inner {
            WorkInner::Nccl { watched, .. } => watched.is_completed(),
            WorkInner::Host(w) => w.is_completed(),
        }
    }

    /// Block until the collective finished on the device (bounded by the group's timeout: the
    /// watchdog fails it then), and order the compute stream after it.
    pub fn wait(self) -> Result<R> {
        match self.inner {
            WorkInner::Nccl {
                watched,
                done,
                compute,
                value,
            } => {
                watched.wait()?;
                compute
                    .wait(&done)
                    .map_err(driver_err("cuStreamWaitEvent", 0))?;
                Ok(value.expect("value taken once"))
            }
            WorkInner::Host(w) => w.wait(),
        }
    }
}

impl<R> Wait<R> for CudaWork<R> {
    fn is_completed(&self) -> bool {
        CudaWork::is_completed(self)
    }

    fn wait(self) -> Result<R> {
        CudaWork::wait(self)
    }
}

impl<R: Send + 'static> CudaWork<R> {
    /// A work already finished with `r`.
    fn ready(what: &str, r: Result<R>) -> CudaWork<R> {
        CudaWork::host(Work::ready(what, r), |x| x)
    }

    /// A relayed collective's work, its output converted by `f`.
    fn host<X: Send + 'static>(work: Work<X>, f: impl FnOnce(X) -> R + Send + 'static) -> Self {
        CudaWork {
            inner: WorkInner::Host(Box::new(Mapped { work, f })),
        }
    }
}

mod collectives;
