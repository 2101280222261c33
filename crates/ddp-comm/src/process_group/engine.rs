//! The engine: the state of one group (its backend and sequence counters) and the background
//! thread that runs the queued collectives one at a time, in the order issued. It numbers them
//! (the sequence number of every fingerprint; per pair of ranks for send/recv), starts each on
//! the backend with its deadline, and on the first failure aborts the backend (peers are told)
//! and keeps the cause: every later collective fails with [`Error::Aborted`] carrying it.
//!
//! A blocking collective issued while nothing is queued runs on the caller's own thread
//! ([`Shared::idle`]): the engine is behind a lock, so it still runs alone and in order, and
//! the caller saves the two thread switches of a hand-off (several µs per small collective).

use crate::backend::{CollectiveBackend, Topology};
use crate::observe::{CollectiveEvent, CollectiveObserver};
use crate::transport::{Fingerprint, OpKind};
use crate::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A queued collective.
pub(super) type Job = Box<dyn FnOnce(&mut Engine) + Send>;

/// A collective's body, run on the group's thread.
pub(super) type CollectiveFn<'a, R> =
    Box<dyn FnOnce(&mut dyn CollectiveBackend) -> Result<R> + Send + 'a>;

/// The engine and its queue length, shared by the group's thread and its callers.
pub(super) struct Shared {
    engine: Mutex<Engine>,
    /// Jobs sent to the thread and not yet finished.
    queued: AtomicUsize,
}

impl Shared {
    /// The engine, locked, if no job is queued or running: a blocking collective may then run
    /// on the caller's thread and still come after everything issued before it.
    pub(super) fn idle(&self) -> Option<MutexGuard<'_, Engine>> {
        let engine = self.engine.lock().unwrap_or_else(|e| e.into_inner());
        // Jobs are counted before they are sent and uncounted while the engine is locked, so
        // 0 here means nothing was issued earlier that has not run.
        (self.queued.load(Ordering::SeqCst) == 0).then_some(engine)
    }

    /// Count a job about to be sent to the thread.
    pub(super) fn queue(&self) {
        self.queued.fetch_add(1, Ordering::SeqCst);
    }

    /// Uncount a job that could not be sent.
    pub(super) fn unqueue(&self) {
        self.queued.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A group's state: the backend and the sequence counters.
pub(super) struct Engine {
    backend: Box<dyn CollectiveBackend>,
    seq: u64,
    /// Per peer: messages sent to it, messages received from it (send/recv sequence numbers).
    p2p: Vec<(u64, u64)>,
    broken: Option<Error>,
    /// Set once by `ProcessGroup::set_observer`; read once per collective.
    observer: ObserverSlot,
    rank: usize,
    topology: Topology,
}

/// The observer of a group, shared by its handle and its engine thread.
pub(super) type ObserverSlot = Arc<OnceLock<Arc<dyn CollectiveObserver>>>;

impl Engine {
    /// Start the thread `name` running the jobs sent to the returned channel on `backend`.
    pub(super) fn start(
        backend: Box<dyn CollectiveBackend>,
        rank: usize,
        size: usize,
        name: String,
        observer: ObserverSlot,
    ) -> Result<(Arc<Shared>, mpsc::Sender<Job>, JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel::<Job>();
        let topology = backend.topology();
        let shared = Arc::new(Shared {
            engine: Mutex::new(Engine {
                backend,
                seq: 0,
                p2p: vec![(0, 0); size],
                broken: None,
                observer,
                rank,
                topology,
            }),
            queued: AtomicUsize::new(0),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for job in rx {
                    let mut engine = s.engine.lock().unwrap_or_else(|e| e.into_inner());
                    let run = std::panic::AssertUnwindSafe(|| job(&mut engine));
                    if std::panic::catch_unwind(run).is_err() {
                        engine.panicked();
                    }
                    s.queued.fetch_sub(1, Ordering::SeqCst);
                }
            })
            .map_err(|e| Error::io("spawning the communication thread", e))?;
        Ok((shared, tx, thread))
    }

    /// A collective panicked: abort the backend and keep the group broken.
    fn panicked(&mut self) -> Error {
        let e = Error::Internal("panic in the communication thread".into());
        self.backend.abort(&e);
        self.broken = Some(e.clone());
        e
    }

    /// [`Engine::run`] on the caller's thread (see [`Shared::idle`]); a panic breaks the group
    /// as it does on the group's thread.
    pub(super) fn run_here<R>(
        &mut self,
        fp: Fingerprint,
        timeout: Duration,
        f: impl FnOnce(&mut dyn CollectiveBackend) -> Result<R>,
    ) -> Result<R> {
        let run = std::panic::AssertUnwindSafe(|| self.run(fp, timeout, f));
        std::panic::catch_unwind(run).unwrap_or_else(|_| Err(self.panicked()))
    }

    /// Run collective `fp` (its sequence number assigned here) with `timeout`.
    pub(super) fn run<R>(
        &mut self,
        mut fp: Fingerprint,
        timeout: Duration,
        f: impl FnOnce(&mut dyn CollectiveBackend) -> Result<R>,
    ) -> Result<R> {
        if let Some(cause) = &self.broken {
            return Err(Error::Aborted(Box::new(cause.clone())));
        }
        if fp.op == OpKind::SendRecv {
            let peer = fp.root as usize;
            let counters = self.p2p.get_mut(peer).ok_or_else(|| {
                Error::InvalidArgument(format!("peer rank {peer} is out of range"))
            })?;
            // `reduce` carries the direction: the sender's "sent" must meet the receiver's "received".
            let c = if fp.reduce.is_some() {
                &mut counters.0
            } else {
                &mut counters.1
            };
            fp.seq = *c;
            *c += 1;
            fp.reduce = None;
            fp.root = Fingerprint::NO_ROOT;
        } else {
            fp.seq = self.seq;
            self.seq += 1;
        }
        let start = Instant::now();
        self.backend.begin(fp, start + timeout);
        let result = f(&mut *self.backend);
        if let Some(observer) = self.observer.get() {
            observer.collective(&CollectiveEvent {
                fingerprint: &fp,
                bytes: fp.count * fp.dtype.size() as u64,
                start,
                end: Instant::now(),
                ok: result.is_ok(),
                rank: self.rank,
                size: self.p2p.len(),
                topology: &self.topology,
            });
        }
        match result {
            Ok(v) => Ok(v),
            Err(e) => {
                tracing::error!("{e}");
                self.backend.abort(&e);
                self.broken = Some(e.clone());
                Err(e)
            }
        }
    }
}
