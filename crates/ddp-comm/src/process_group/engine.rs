//! The engine: the background thread of one group, which owns its backend and runs the queued
//! collectives one at a time, in the order issued. It numbers them (the sequence number of
//! every fingerprint; per pair of ranks for send/recv), starts each on the backend with its
//! deadline, and on the first failure aborts the backend (peers are told) and keeps the cause:
//! every later collective fails with [`Error::Aborted`] carrying it.

use crate::backend::{CollectiveBackend, Topology};
use crate::observe::{CollectiveEvent, CollectiveObserver};
use crate::transport::{Fingerprint, OpKind};
use crate::{Error, Result};
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A queued collective.
pub(super) type Job = Box<dyn FnOnce(&mut Engine) + Send>;

/// A collective's body, run on the group's thread.
pub(super) type CollectiveFn<'a, R> =
    Box<dyn FnOnce(&mut dyn CollectiveBackend) -> Result<R> + Send + 'a>;

/// State owned by the background thread: the backend and the sequence counters.
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
    ) -> Result<(mpsc::Sender<Job>, JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel::<Job>();
        let topology = backend.topology();
        let mut engine = Engine {
            backend,
            seq: 0,
            p2p: vec![(0, 0); size],
            broken: None,
            observer,
            rank,
            topology,
        };
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for job in rx {
                    let run = std::panic::AssertUnwindSafe(|| job(&mut engine));
                    if std::panic::catch_unwind(run).is_err() {
                        let e = Error::Internal("panic in the communication thread".into());
                        engine.backend.abort(&e);
                        engine.broken = Some(e);
                    }
                }
            })
            .map_err(|e| Error::io("spawning the communication thread", e))?;
        Ok((tx, thread))
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
