//! The device watchdog (torch's NCCL watchdog): device collectives run asynchronously on a
//! stream, so nothing blocks long enough to time out by itself. A thread polls every pending
//! collective; one not finished within its timeout, or one whose completion reports an error
//! (NCCL's `ncclCommGetAsyncError`), breaks the group:
//!
//! ```text
//!  watch(fp, timeout, completion) ──▶ pending ──poll──▶ done ─────────────▶ Watched::wait = Ok
//!                                        │ past deadline / async error
//!                                        ▼
//!                        abort (ncclCommAbort) ─▶ store key "<key>" = "rank: cause"
//!                        every pending and later collective fails, naming collective + #seq
//!  other ranks' watchdogs see the key (polled while they have work pending) and fail likewise
//! ```

use crate::store::Store;
use crate::transport::Fingerprint;
use crate::{Error, Result};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Whether a watched collective has finished; polled by the watchdog thread.
pub trait Completion: Send {
    /// `Ok(true)` when finished, `Ok(false)` while running, `Err` when it failed.
    fn poll(&mut self) -> Result<bool>;
}

/// What the watchdog does to the communicator when a collective fails (NCCL: `ncclCommAbort`).
pub type AbortFn = Box<dyn FnMut(&Error) + Send>;

/// How often the watchdog polls pending collectives, and the store for other ranks' aborts.
#[derive(Debug, Clone, Copy)]
pub struct WatchdogTiming {
    /// Interval between polls of pending collectives.
    pub poll: Duration,
    /// Interval between looks at the store while collectives are pending.
    pub store_poll: Duration,
}

impl Default for WatchdogTiming {
    fn default() -> Self {
        WatchdogTiming {
            poll: Duration::from_micros(200),
            store_poll: Duration::from_millis(500),
        }
    }
}

struct Slot {
    value: Mutex<Option<Result<()>>>,
    ready: Condvar,
}

impl Slot {
    fn complete(&self, r: Result<()>) {
        *self.value.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        self.ready.notify_all();
    }
}

/// A watched collective; [`Watched::wait`] returns when it finished or failed.
pub struct Watched {
    slot: Arc<Slot>,
}

impl Watched {
    /// Whether it finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.slot
            .value
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    /// Block until it finished (`Ok`) or failed (the error names the collective and its
    /// sequence number; the watchdog's own timeout bounds the wait).
    pub fn wait(&self) -> Result<()> {
        let mut v = self.slot.value.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = v.as_ref() {
                return r.clone();
            }
            v = self.slot.ready.wait(v).unwrap_or_else(|p| p.into_inner());
        }
    }
}

struct Entry {
    fp: Fingerprint,
    deadline: Instant,
    timeout: Duration,
    completion: Box<dyn Completion>,
    slot: Arc<Slot>,
}

struct State {
    pending: Vec<Entry>,
    broken: Option<Error>,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One watchdog per device group.
pub struct Watchdog {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Start the watchdog of rank `rank`: `abort` is called once when the group breaks, and the
    /// cause is published under store key `key` (other ranks' watchdogs watch the same key).
    pub fn start(
        store: Arc<dyn Store>,
        key: String,
        rank: usize,
        abort: AbortFn,
        timing: WatchdogTiming,
    ) -> Result<Watchdog> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                pending: Vec::new(),
                broken: None,
                stop: false,
            }),
            wake: Condvar::new(),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ddp-watchdog-r{rank}"))
            .spawn(move || run(&sh, &*store, &key, rank, abort, timing))
            .map_err(|e| Error::io("spawning the device watchdog thread", e))?;
        Ok(Watchdog {
            shared,
            thread: Some(thread),
        })
    }

    /// Watch collective `fp` (with its sequence number): it must finish within `timeout`.
    /// On a broken group the result is an immediate [`Error::Aborted`] with the cause.
    pub fn watch(
        &self,
        fp: Fingerprint,
        timeout: Duration,
        completion: Box<dyn Completion>,
    ) -> Watched {
        let slot = Arc::new(Slot {
            value: Mutex::new(None),
            ready: Condvar::new(),
        });
        let mut st = self.shared.lock();
        if let Some(cause) = &st.broken {
            slot.complete(Err(Error::Aborted(Box::new(cause.clone()))));
        } else {
            st.pending.push(Entry {
                fp,
                deadline: Instant::now() + timeout,
                timeout,
                completion,
                slot: slot.clone(),
            });
            self.shared.wake.notify_all();
        }
        Watched { slot }
    }

    /// The cause, if the group is broken.
    pub fn broken(&self) -> Option<Error> {
        self.shared.lock().broken.clone()
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(
    sh: &Shared,
    store: &dyn Store,
    key: &str,
    rank: usize,
    mut abort: AbortFn,
    timing: WatchdogTiming,
) {
    let mut last_store = Instant::now();
    let mut st = sh.lock();
    loop {
        if st.pending.is_empty() {
            if st.stop {
                return;
            }
            st = sh.wake.wait(st).unwrap_or_else(|p| p.into_inner());
            last_store = Instant::now();
            continue;
        }
        // Poll in issue order; the first failure breaks the group.
        let mut failure = None;
        let now = Instant::now();
        let mut i = 0;
        while i < st.pending.len() {
            let e = &mut st.pending[i];
            match e.completion.poll() {
                Ok(true) => {
                    let e = st.pending.remove(i);
                    e.slot.complete(Ok(()));
                    continue;
                }
                Ok(false) if now < e.deadline => i += 1,
                Ok(false) => {
                    failure = Some((
                        i,
                        Error::Timeout {
                            what: format!(
                                "{} #{} on rank {rank} to finish on the device (watchdog: the \
                                 communicator was aborted)",
                                e.fp, e.fp.seq
                            ),
                            timeout: e.timeout,
                        },
                    ));
                    break;
                }
                Err(err) => {
                    failure = Some((i, err));
                    break;
                }
            }
        }
        if failure.is_none() && last_store.elapsed() >= timing.store_poll {
            last_store = Instant::now();
            drop(st);
            let remote = remote_abort(store, key, rank);
            st = sh.lock();
            if let (Some((peer, why)), Some(first)) = (remote, st.pending.first()) {
                let err = Error::PeerFailed {
                    peer,
                    fingerprint: first.fp,
                    reason: format!("aborted the device group: {why}"),
                };
                failure = Some((0, err));
            }
        }
        if let Some((i, cause)) = failure {
            tracing::error!("device watchdog of rank {rank}: {cause}");
            abort(&cause);
            if !matches!(cause, Error::PeerFailed { .. }) {
                let _ = store.set(key, format!("{rank}\n{cause}").as_bytes());
            }
            let pending = std::mem::take(&mut st.pending);
            st.broken = Some(cause.clone());
            for (j, e) in pending.into_iter().enumerate() {
                let r = if j == i {
                    cause.clone()
                } else {
                    Error::Aborted(Box::new(cause.clone()))
                };
                e.slot.complete(Err(r));
            }
            continue;
        }
        st = sh
            .wake
            .wait_timeout(st, timing.poll)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Another rank's abort published under `key`: `(rank, cause)`.
fn remote_abort(store: &dyn Store, key: &str, rank: usize) -> Option<(usize, String)> {
    if !store.check(key).ok()? {
        return None;
    }
    let v = store.get_timeout(key, Duration::from_secs(1)).ok()?;
    let s = String::from_utf8_lossy(&v);
    let (who, why) = s.split_once('\n')?;
    let who: usize = who.parse().ok()?;
    (who != rank).then(|| (who, why.to_string()))
}
