//! The watchdog of blocking MPI calls. MPI has no timeouts and a blocking collective cannot be
//! interrupted, so before one starts its group arms a [`Watch`] with the deadline, and one
//! thread per process checks every armed watch each [`TICK`]: past the deadline it prints the
//! timeout naming the collective and its sequence number, and ends the job with `MPI_Abort`
//! (never a hang); past `warn_after` it logs a warning, and again every such interval.
//!
//! Arming and disarming is an uncontended lock and a store (tens of ns); nothing is formatted
//! unless the watch fires.

use super::runtime;
use crate::transport::Fingerprint;
use crate::Error;
use std::sync::{Arc, Mutex, Once, Weak};
use std::time::{Duration, Instant};

/// How often the watchdog looks (the precision of the timeout).
const TICK: Duration = Duration::from_millis(20);

/// What a group is waiting for.
#[derive(Clone, Copy)]
pub(super) struct Armed {
    pub fp: Fingerprint,
    pub rank: usize,
    pub size: usize,
    pub deadline: Instant,
    pub timeout: Duration,
    pub warn_after: Option<Duration>,
    pub since: Instant,
}

type Slot = Mutex<Option<(Armed, Option<Instant>)>>;

/// The watch of one group (registered with the process's watchdog thread while it lives).
pub(super) struct Watch(Arc<Slot>);

static WATCHES: Mutex<Vec<Weak<Slot>>> = Mutex::new(Vec::new());
static START: Once = Once::new();

impl Watch {
    pub(super) fn new() -> Watch {
        let slot = Arc::new(Mutex::new(None));
        lock(&WATCHES).push(Arc::downgrade(&slot));
        START.call_once(|| {
            // If the thread cannot be spawned, blocking calls would have no timeout: say so
            // loudly rather than fail every group (the process is then as MPI leaves it).
            if let Err(e) = std::thread::Builder::new()
                .name("ddp-comm-mpi-watchdog".into())
                .spawn(watch_loop)
            {
                tracing::error!(
                    "ddp-comm (backend mpi): no watchdog thread ({e}): collectives have no timeout"
                );
            }
        });
        Watch(slot)
    }

    /// Watch a blocking call until [`Watch::disarm`].
    pub(super) fn arm(&self, a: Armed) {
        let warn = a.warn_after.map(|w| a.since + w);
        *lock(&self.0) = Some((a, warn));
    }

    pub(super) fn disarm(&self) {
        *lock(&self.0) = None;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn watch_loop() {
    loop {
        std::thread::sleep(TICK);
        let now = Instant::now();
        let mut watches = lock(&WATCHES);
        watches.retain(|w| w.strong_count() > 0);
        for w in watches.iter().filter_map(Weak::upgrade) {
            let mut slot = lock(&w);
            let Some((a, warn)) = slot.as_mut() else {
                continue;
            };
            let what = || runtime::describe(&a.fp, a.rank, a.size);
            if now >= a.deadline {
                let cause = Error::Timeout {
                    what: format!("{} on MPI (MPI cannot cancel it)", what()),
                    timeout: a.timeout,
                };
                tracing::error!("{cause}");
                runtime::abort_with(&cause);
            }
            if warn.is_some_and(|t| now >= t) {
                tracing::warn!("{} on MPI: still waiting after {:?}", what(), now - a.since);
                *warn = a.warn_after.map(|w| now + w);
            }
        }
    }
}
