//! Heartbeats through the store: each elastic launcher's background thread increments its own
//! counter key every `timeout / 5`; every other launcher watches the counters and treats a node
//! whose counter has not moved for `timeout` as dead.
//!
//! A counter rather than a timestamp, so that the nodes' clocks need not agree: each observer
//! times the counter with its own monotonic clock. A node is declared dead between
//! `timeout - timeout / 5` and `timeout + 2 × poll` after its launcher stopped beating (`poll`:
//! the observer's polling period, `--monitor-interval` while workers run).

use ddp_comm::store::{Store, TcpStore};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The beating thread of this launcher (stopped and joined on drop).
pub struct Beater {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Beater {
    /// Start beating `key` on `store` (its own connection) every `interval`.
    pub fn start(store: TcpStore, key: String, interval: Duration) -> std::io::Result<Beater> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ddprun-heartbeat".into())
            .spawn(move || {
                let step = Duration::from_millis(10).min(interval);
                while !flag.load(Ordering::Relaxed) {
                    // A store that is gone is noticed (and reported) by the main loop.
                    if store.add(&key, 1).is_err() {
                        return;
                    }
                    let next = Instant::now() + interval;
                    while Instant::now() < next && !flag.load(Ordering::Relaxed) {
                        std::thread::sleep(step);
                    }
                }
            })?;
        Ok(Beater {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Beater {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What one launcher has seen of the others' heartbeat counters.
#[derive(Default)]
pub struct Watch {
    seen: HashMap<u64, (i64, Instant)>,
}

impl Watch {
    /// Record the counter `value` of node `id` read now; returns how long it has not moved.
    pub fn observe(&mut self, id: u64, value: i64) -> Duration {
        let now = Instant::now();
        let e = self.seen.entry(id).or_insert((value, now));
        if e.0 != value {
            *e = (value, now);
        }
        now - e.1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_that_stops_ages() {
        let mut w = Watch::default();
        assert_eq!(w.observe(1, 5), Duration::ZERO);
        std::thread::sleep(Duration::from_millis(30));
        assert!(w.observe(1, 5) >= Duration::from_millis(30));
        assert_eq!(
            w.observe(1, 6),
            Duration::ZERO,
            "a new value resets the age"
        );
        assert_eq!(
            w.observe(2, 6),
            Duration::ZERO,
            "nodes are timed separately"
        );
    }
}
