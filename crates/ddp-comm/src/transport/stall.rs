//! "Never silent": a collective that is still waiting after an interval (default
//! [`DEFAULT_WARN_AFTER`], [`crate::InitOptions::warn_after`], env [`WARN_AFTER_ENV`]) logs a
//! warning naming the collective, its sequence number and the ranks it still waits for, and
//! repeats it every interval until the collective completes or times out:
//!
//! ```text
//! WARN all_reduce(sum, f32 x 100) #3 on rank 0: still waiting after 60s for rank(s) [1] (not arrived yet; timeout 1800s)
//! ```
//!
//! Each transport calls `StallWarning::check` where it is about to sleep waiting for peers.

use super::Fingerprint;
use crate::{Error, Result};
use std::cell::Cell;
use std::time::{Duration, Instant};

/// Default interval of the warning: one minute.
pub const DEFAULT_WARN_AFTER: Duration = Duration::from_secs(60);
/// Env var overriding it, in seconds (fractions allowed; `0` turns the warning off).
pub const WARN_AFTER_ENV: &str = "DDP_WARN_AFTER_SECS";

/// The interval from env [`WARN_AFTER_ENV`], else [`DEFAULT_WARN_AFTER`]; `None`: off.
pub fn warn_after_from_env() -> Result<Option<Duration>> {
    match std::env::var(WARN_AFTER_ENV) {
        Ok(v) if !v.trim().is_empty() => {
            let secs: f64 = v
                .trim()
                .parse()
                .ok()
                .filter(|s: &f64| *s >= 0.0)
                .ok_or_else(|| {
                    Error::Config(format!("{WARN_AFTER_ENV}={v:?} is not a number of seconds"))
                })?;
            Ok((secs > 0.0).then(|| Duration::from_secs_f64(secs)))
        }
        _ => Ok(Some(DEFAULT_WARN_AFTER)),
    }
}

/// When the current collective started and when it warns next.
#[derive(Debug, Default)]
pub(crate) struct StallWarning {
    every: Option<Duration>,
    started: Cell<Option<Instant>>,
    next: Cell<Option<Instant>>,
    /// Group ranks of this transport's ranks, when they differ (the shared memory of one host
    /// in a hierarchical group numbers its ranks locally).
    group_ranks: Option<Vec<usize>>,
}

impl StallWarning {
    /// Warn every `every` (`None`: never); `group_ranks` renames ranks in the message.
    pub(crate) fn new(every: Option<Duration>, group_ranks: Option<Vec<usize>>) -> Self {
        StallWarning {
            every,
            started: Cell::new(None),
            next: Cell::new(None),
            group_ranks,
        }
    }

    /// A collective starts now.
    pub(crate) fn start(&self) {
        let now = Instant::now();
        self.started.set(Some(now));
        self.next.set(self.every.map(|e| now + e));
    }

    /// Rank `rank` is about to sleep in collective `fp` (timeout `timeout`) waiting for the
    /// ranks `waiting()` returns: warn if the interval has passed since the start or the last
    /// warning.
    pub(crate) fn check(
        &self,
        fp: &Fingerprint,
        rank: usize,
        timeout: Duration,
        waiting: impl FnOnce() -> Vec<usize>,
    ) {
        let (Some(next), Some(every), Some(started)) =
            (self.next.get(), self.every, self.started.get())
        else {
            return;
        };
        let now = Instant::now();
        if now < next {
            return;
        }
        self.next.set(Some(now + every));
        let name = |r: usize| match &self.group_ranks {
            Some(g) => g.get(r).copied().unwrap_or(r),
            None => r,
        };
        let waiting: Vec<usize> = waiting().into_iter().map(name).collect();
        tracing::warn!(
            "{fp} #{} on rank {}: still waiting after {:.1?} for rank(s) {waiting:?} (not arrived yet; timeout {timeout:?})",
            fp.seq,
            name(rank),
            now.duration_since(started),
        );
    }
}
