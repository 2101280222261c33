//! Async work handles: what an `*_async` collective returns.
//!
//! A [`Work`] is completed by the group's background thread. If the job is dropped without
//! running (the group shut down or its thread died), the handle completes with an error instead
//! of leaving its waiter hanging.

use crate::{Error, Result};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

struct Slot<T> {
    value: Mutex<Option<Result<T>>>,
    ready: Condvar,
}

/// Handle to a collective running in the background; `wait` returns its output.
#[must_use = "a Work must be waited on to observe errors and get its buffer back"]
pub struct Work<T> {
    slot: Arc<Slot<T>>,
    what: String,
}

/// The completing side of a [`Work`]; completes it with an error if dropped unused.
pub(crate) struct Completer<T> {
    slot: Option<Arc<Slot<T>>>,
    /// The collective, for the error when dropped unused.
    what: String,
}

/// A new pending work handle (for `what`, used in timeout messages) and its completer.
pub(crate) fn pending<T>(what: String) -> (Work<T>, Completer<T>) {
    let slot = Arc::new(Slot {
        value: Mutex::new(None),
        ready: Condvar::new(),
    });
    (
        Work {
            slot: slot.clone(),
            what: what.clone(),
        },
        Completer {
            slot: Some(slot),
            what,
        },
    )
}

impl<T> Completer<T> {
    pub(crate) fn complete(mut self, result: Result<T>) {
        if let Some(slot) = self.slot.take() {
            *slot.value.lock().unwrap() = Some(result);
            slot.ready.notify_all();
        }
    }
}

impl<T> Drop for Completer<T> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            *slot.value.lock().unwrap() = Some(Err(Error::Shutdown(self.what.clone())));
            slot.ready.notify_all();
        }
    }
}

impl<T> Work<T> {
    /// A work that is already complete.
    pub fn ready(what: impl Into<String>, value: Result<T>) -> Work<T> {
        let (w, c) = pending(what.into());
        c.complete(value);
        w
    }

    /// Whether the collective has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.slot.value.lock().unwrap().is_some()
    }

    /// Block until the collective finishes. The group's own timeout bounds this: a collective
    /// whose peers stop answering fails with an error naming them.
    pub fn wait(self) -> Result<T> {
        let mut v = self.slot.value.lock().unwrap();
        loop {
            if let Some(r) = v.take() {
                return r;
            }
            v = self.slot.ready.wait(v).unwrap();
        }
    }

    /// Block at most `timeout`; returns [`Error::Timeout`] if the collective is still running.
    pub fn wait_timeout(self, timeout: Duration) -> Result<T> {
        let until = Instant::now() + timeout;
        let mut v = self.slot.value.lock().unwrap();
        loop {
            if let Some(r) = v.take() {
                return r;
            }
            let now = Instant::now();
            if now >= until {
                return Err(Error::Timeout {
                    what: self.what.clone(),
                    timeout,
                });
            }
            v = self.slot.ready.wait_timeout(v, until - now).unwrap().0;
        }
    }
}
