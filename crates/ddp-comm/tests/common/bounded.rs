//! `bounded`: the deadline every store test runs under, so a hang fails the test instead of
//! stalling CI (shared by `store.rs` and `store_hardening.rs`).

use std::time::Duration;

/// Run `f` on a thread and fail if it does not finish within `limit`.
pub fn bounded<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => {
            handle.join().unwrap();
            v
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            // `f` panicked: surface its panic.
            std::panic::resume_unwind(handle.join().unwrap_err())
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("test did not finish within {limit:?}")
        }
    }
}
