//! Process groups: who is in a job, and the public collective API.
//!
//! [`init_process_group`] (module `init`) resolves rank and world size (env or explicit), hosts or
//! joins the rendezvous store, selects the group's backend ([`crate::backend::select`]: TCP
//! mesh, shared memory, or for a group spanning hosts the hierarchical one; see
//! [`ProcessGroup::topology`]) and starts the group's background thread (module `engine`). Every
//! collective is a job queued to that thread, so collectives on one group complete in the
//! order issued and compute continues while `*_async` ones run. A failed collective aborts the
//! group: peers are told (their pending and later collectives fail with an error naming this
//! rank), and every later call on this group fails with [`Error::Aborted`] carrying the cause.
//!
//! Each collective (module `collectives`) has a blocking form over slices and an `*_async` form over
//! owned `Vec`s returning a [`Work`]. [`ProcessGroup::chain_async`] queues several collectives
//! and the computation between them as one job (module `chain`; PyTorch's `Future.then` on a
//! comm hook's work). Subgroups come from [`ProcessGroup::new_group`].

mod chain;
mod collectives;
mod engine;
mod init;
pub mod regroup;

pub use crate::backend::{Backend, Topology};
pub use chain::Chain;
pub use collectives::Placement;
pub use init::{exited_key, init_process_group, InitOptions, DEFAULT_TIMEOUT, SOCKET_IFNAME_ENV};
pub use regroup::{join_process_group, RegroupOptions, Regrouped};

use crate::backend::{select, BackendPlan, CollectiveBackend};
use crate::dtype::{DType, ReduceOp};
use crate::observe::CollectiveObserver;
use crate::store::{PrefixStore, Store, StoreServer};
use crate::transport::{Fingerprint, OpKind};
use crate::work::{self, Work};
use crate::{Error, Result};
use engine::{CollectiveFn, Engine, Job, ObserverSlot, Shared};
use init::{check_membership, GroupPlan};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Where a default group regroups (its store) and its generation ([`regroup`]).
#[derive(Clone)]
pub(crate) struct RegroupBase {
    pub store: Arc<dyn Store>,
    pub generation: u64,
}

struct Inner {
    rank: usize,
    size: usize,
    /// Group rank → rank in the default (world) group.
    global_ranks: Vec<usize>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    /// The engine, shared with the thread (blocking collectives may run on the caller's).
    engine: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Keeps the store server alive when this process hosts it.
    _server: Option<Arc<StoreServer>>,
    subgroups: AtomicU64,
    /// What the user asked for.
    backend: Backend,
    /// How this group was connected through its store (namespaced for the group; subgroups
    /// connect the same way, on their own store); `None` for an MPI group, whose subgroups
    /// are split from it.
    plan: Option<BackendPlan>,
    /// Device groups made from this group so far (each gets its own store keys).
    device_groups: AtomicU64,
    /// What the backend resolved to.
    topology: Topology,
    /// See [`ProcessGroup::direct_gather_min`].
    direct_gather_min: Option<usize>,
    /// Who sees this group's collectives (see [`ProcessGroup::set_observer`]).
    observer: ObserverSlot,
    /// Where this default group regroups, and its generation ([`regroup`]); `None` for
    /// subgroups and MPI.
    regroup: Option<RegroupBase>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.jobs.lock().unwrap().take();
        if let Some(t) = self.thread.lock().unwrap().take() {
            let _ = t.join();
        }
    }
}

/// A group of ranks that run collectives together. Cheap to clone (shared handle).
#[derive(Clone)]
pub struct ProcessGroup {
    inner: Arc<Inner>,
    timeout: Duration,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.inner.rank)
            .field("size", &self.inner.size)
            .field("global_ranks", &self.inner.global_ranks)
            .finish()
    }
}

impl ProcessGroup {
    /// Check membership, select the backend and start the engine thread.
    fn connect(plan: GroupPlan) -> Result<ProcessGroup> {
        let GroupPlan {
            backend: plan,
            global_ranks,
            server,
            regroup,
        } = plan;
        let (rank, size) = (plan.rank, plan.size);
        check_membership(&*plan.store, rank, size, plan.timeout, server.is_some())?;
        let backend = select(&plan)?;
        let topology = backend.topology();
        tracing::debug!("rank {rank} of a group of global ranks {global_ranks:?}: {topology}");
        let timeout = plan.timeout;
        let kind = plan.backend;
        ProcessGroup::start(
            backend,
            kind,
            rank,
            global_ranks,
            timeout,
            Some(plan),
            server,
            regroup,
        )
    }

    /// Start the engine thread of a connected `backend` and wrap it as a group.
    #[allow(clippy::too_many_arguments)] // the group's parts, each kept as given
    fn start(
        backend: Box<dyn CollectiveBackend>,
        kind: Backend,
        rank: usize,
        global_ranks: Vec<usize>,
        timeout: Duration,
        plan: Option<BackendPlan>,
        server: Option<Arc<StoreServer>>,
        regroup: Option<RegroupBase>,
    ) -> Result<ProcessGroup> {
        let size = global_ranks.len();
        let topology = backend.topology();
        let direct_gather_min = backend.direct_gather_min();
        let observer = ObserverSlot::default();
        let (engine, tx, thread) = Engine::start(
            backend,
            rank,
            size,
            format!("ddp-comm-r{}", global_ranks[rank]),
            observer.clone(),
        )?;
        Ok(ProcessGroup {
            inner: Arc::new(Inner {
                rank,
                size,
                global_ranks,
                jobs: Mutex::new(Some(tx)),
                engine,
                thread: Mutex::new(Some(thread)),
                _server: server,
                subgroups: AtomicU64::new(0),
                backend: kind,
                device_groups: AtomicU64::new(0),
                plan,
                topology,
                direct_gather_min,
                observer,
                regroup,
            }),
            timeout,
        })
    }

    /// The default group of the mpi backend: `MPI_COMM_WORLD`, no store.
    #[cfg(feature = "mpi")]
    fn connect_mpi(p: &crate::backend::mpi::MpiPlan) -> Result<ProcessGroup> {
        let (backend, rank, size) = crate::backend::mpi::connect_world(p)?;
        tracing::debug!("rank {rank} of {size}: {}", backend.topology());
        ProcessGroup::start(
            backend,
            Backend::Mpi,
            rank,
            (0..size).collect(),
            p.timeout,
            None,
            None,
            None,
        )
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.inner.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.inner.size
    }

    /// The rank in the default group of this group's rank `group_rank`.
    pub fn global_rank(&self, group_rank: usize) -> Option<usize> {
        self.inner.global_ranks.get(group_rank).copied()
    }

    /// This group's rank of the default group's rank `global_rank`, if it is a member.
    pub fn group_rank(&self, global_rank: usize) -> Option<usize> {
        self.inner
            .global_ranks
            .iter()
            .position(|&g| g == global_rank)
    }

    /// The store this group uses (namespaced to the group); `None` on the mpi backend, which
    /// needs none.
    pub fn store(&self) -> Option<&Arc<dyn Store>> {
        self.inner.plan.as_ref().map(|p| &p.store)
    }

    /// The backend this group was asked for (`auto` unless set; what it resolved to is
    /// [`ProcessGroup::topology`]).
    pub fn backend(&self) -> Backend {
        self.inner.backend
    }

    /// What the backend resolved to; displays e.g. as `tcp: 4 ranks, full mesh`,
    /// `shm: 3 ranks on one host` or
    /// `hierarchical: 2 hosts x [2, 2] ranks, shm inside a host, tcp between`.
    pub fn topology(&self) -> &Topology {
        &self.inner.topology
    }

    /// The smallest [`all_gather_in_place_to`](ProcessGroup::all_gather_in_place_to) buffer, in
    /// bytes, whose peers' blocks are read straight from their memory (shared memory with
    /// cross-memory attach); `None` when none is (it then all-gathers in place and copies).
    /// The same on every rank.
    pub fn direct_gather_min(&self) -> Option<usize> {
        self.inner.direct_gather_min
    }

    /// Reports every later collective of this group to `observer`, on the thread that runs it
    /// (the group's engine thread, or the caller's for a blocking collective issued while the
    /// group is idle; see [`crate::observe`]). Once per group: `false` (and `observer` unused) when the group
    /// already has one. Subgroups made later have their own.
    pub fn set_observer(&self, observer: Arc<dyn CollectiveObserver>) -> bool {
        self.inner.observer.set(observer).is_ok()
    }

    /// Whether [`set_observer`](Self::set_observer) gave this group an observer.
    pub fn has_observer(&self) -> bool {
        self.inner.observer.get().is_some()
    }

    /// The timeout of collectives issued through this handle.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A handle to the same group whose collectives use `timeout`.
    pub fn with_timeout(&self, timeout: Duration) -> ProcessGroup {
        ProcessGroup {
            inner: self.inner.clone(),
            timeout,
        }
    }

    /// Create a subgroup of `ranks` (this group's numbering; sorted, as in PyTorch). Every rank
    /// of this group must call it with the same ranks, in the same order of `new_group` calls;
    /// members get `Some(group)`, others `None`.
    pub fn new_group(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        let mut ranks = ranks.to_vec();
        ranks.sort_unstable();
        if ranks.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::InvalidArgument(format!(
                "new_group: duplicate ranks in {ranks:?}"
            )));
        }
        if let Some(&bad) = ranks.iter().find(|&&r| r >= self.size()) {
            return Err(Error::InvalidArgument(format!(
                "new_group: rank {bad} is not in this group of size {}",
                self.size()
            )));
        }
        let k = self.inner.subgroups.fetch_add(1, Ordering::SeqCst);
        let my = ranks.iter().position(|&r| r == self.rank());
        let global: Vec<usize> = ranks.iter().map(|&r| self.inner.global_ranks[r]).collect();
        let Some(p) = &self.inner.plan else {
            // MPI: every rank of this group splits its communicator, on the group's thread
            // (in order with the collectives queued before).
            let fp = self.fingerprint(OpKind::Rendezvous, DType::U8, None, ranks.len(), None);
            let members = ranks.clone();
            let sub = self.blocking(fp, move |b| b.split(&members))?;
            return match (sub, my) {
                (Some(b), Some(my)) => {
                    let (kind, timeout) = (self.inner.backend, self.timeout);
                    ProcessGroup::start(b, kind, my, global, timeout, None, None, None).map(Some)
                }
                _ => Ok(None),
            };
        };
        let Some(my) = my else {
            return Ok(None);
        };
        let store: Arc<dyn Store> =
            Arc::new(PrefixStore::new(format!("group{k}"), p.store.clone()));
        ProcessGroup::connect(GroupPlan {
            backend: BackendPlan {
                store,
                rank: my,
                size: ranks.len(),
                local_ip: p.local_ip,
                timeout: p.timeout,
                backend: p.backend,
                algorithm: p.algorithm,
                host_id: p.host_id.clone(),
                warn_after: p.warn_after,
            },
            global_ranks: global,
            server: None,
            regroup: None,
        })
        .map(Some)
    }

    /// A number for the next device group made from this group (the same on every rank when
    /// every rank makes its device groups in the same order).
    #[allow(dead_code)] // used by the `nccl` feature's `cuda` module
    pub(crate) fn next_device_group(&self) -> u64 {
        self.inner.device_groups.fetch_add(1, Ordering::SeqCst)
    }

    pub(crate) fn fingerprint(
        &self,
        op: OpKind,
        dtype: DType,
        reduce: Option<ReduceOp>,
        count: usize,
        root: Option<usize>,
    ) -> Fingerprint {
        new_fingerprint(op, dtype, reduce, count, root)
    }

    pub(crate) fn check_root(&self, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(Error::InvalidArgument(format!(
                "root rank {root} is not in this group of size {}",
                self.size()
            )));
        }
        Ok(())
    }

    /// Queue `f` on the group's thread; the returned work completes with its result.
    pub(crate) fn spawn<R: Send + 'static>(
        &self,
        fp: Fingerprint,
        f: impl FnOnce(&mut dyn CollectiveBackend) -> Result<R> + Send + 'static,
    ) -> Work<R> {
        let (work, done) = work::pending::<R>(format!("{fp} on rank {}", self.rank()));
        let timeout = self.timeout;
        self.enqueue(Box::new(move |engine: &mut Engine| {
            done.complete(engine.run(fp, timeout, f))
        }));
        work
    }

    /// Hand `job` to the group's thread (dropped, so its work fails, once the group is shut).
    fn enqueue(&self, job: Job) {
        if let Some(tx) = self.inner.jobs.lock().unwrap().as_ref() {
            self.inner.engine.queue();
            // A send error drops the job, which completes the work with an error.
            if tx.send(job).is_err() {
                self.inner.engine.unqueue();
            }
        }
    }

    /// Run `f` after everything issued before it and wait for it: on this thread when the
    /// group's thread is idle, else queued to it.
    pub(crate) fn blocking<R: Send + 'static>(
        &self,
        fp: Fingerprint,
        f: impl FnOnce(&mut dyn CollectiveBackend) -> Result<R> + Send,
    ) -> Result<R> {
        if let Some(mut engine) = self.inner.engine.idle() {
            return engine.run_here(fp, self.timeout, f);
        }
        let boxed: CollectiveFn<'_, R> = Box::new(f);
        // SAFETY: `f` may borrow the caller's buffers. We wait below until the work completes,
        // which happens only after `f` ran or was dropped unrun (its completer fires on drop),
        // so the borrows never outlive this call.
        let boxed: CollectiveFn<'static, R> = unsafe { std::mem::transmute(boxed) };
        self.spawn(fp, boxed).wait()
    }
}

/// The fingerprint of a collective before the engine numbers it.
fn new_fingerprint(
    op: OpKind,
    dtype: DType,
    reduce: Option<ReduceOp>,
    count: usize,
    root: Option<usize>,
) -> Fingerprint {
    Fingerprint {
        seq: 0,
        op,
        dtype,
        reduce,
        count: count as u64,
        root: root.map_or(Fingerprint::NO_ROOT, |r| r as u32),
    }
}
