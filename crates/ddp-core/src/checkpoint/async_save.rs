//! Checkpoints written in the background (PyTorch Distributed Checkpoint's `async_save`).
//!
//! A synchronous save stops training for the whole write: serializing, writing, `fsync`,
//! renaming. An [`AsyncCheckpointer`] stops it only for the *snapshot*: the state copied into
//! host buffers at a step boundary (or, where tensors are immutable, as Burn's are, only
//! referenced), handed to a writer thread that serializes it and writes it with the same
//! [`save_atomic`] as a synchronous save (temporary file, `fsync`, rename, `fsync` of the
//! directory), so a crash or a full disk during the write leaves the previous checkpoint current.
//!
//! At most one write is in flight. A save that finds the previous one still running waits for it
//! ([`WhenBusy::Wait`], the default: every requested checkpoint is written) or is skipped with a
//! warning ([`WhenBusy::Skip`]: training never waits for storage). A write's outcome is reported
//! when it is next looked at ([`AsyncCheckpointer::poll`], the next [`save`](AsyncCheckpointer::save),
//! [`wait`](AsyncCheckpointer::wait), or the drop, which waits): a failure is an `Err` naming the
//! file and the step, and a `tracing` warning; it does not stop training.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use ddp_core::checkpoint::{AsyncCheckpointer, Checkpoint, CheckpointMeta, WhenBusy};
//! let mut saver = AsyncCheckpointer::new(WhenBusy::Wait);
//! for step in 1..=100u64 {
//!     // ... a training step ...
//!     if step % 10 == 0 {
//!         let mut ckpt = Checkpoint::new(CheckpointMeta { step, ..Default::default() });
//!         ckpt.insert("w", vec![2], vec![1.0, 2.0])?; // the snapshot: copies
//!         let sent = saver.save(std::path::Path::new("ckpt"), step, move || Ok(ckpt));
//!         if let Some(Err(e)) = sent.finished {
//!             eprintln!("warning: {e}"); // the previous write failed; training goes on
//!         }
//!     }
//! }
//! saver.wait().transpose()?; // the last write lands before the program ends
//! # Ok(())
//! # }
//! ```

use super::{save_atomic_paused, Checkpoint};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Environment variable (tests and fault drills only): milliseconds the writer thread sleeps
/// after writing the temporary file and before the rename, so that a test can kill a process
/// or fill a disk while a write is in flight.
pub const WRITE_PAUSE_ENV: &str = "DDP_DEBUG_CHECKPOINT_WRITE_PAUSE_MS";

/// What [`AsyncCheckpointer::save`] does when the previous write is still running.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum WhenBusy {
    /// Wait for it, then start this one (every requested checkpoint is written).
    #[default]
    Wait,
    /// Skip this one with a warning (training never waits for storage).
    Skip,
}

/// A finished background write.
#[derive(Debug, Clone, PartialEq)]
pub struct Written {
    /// The step the checkpoint holds.
    pub step: u64,
    /// Where it is (`dir/checkpoint.safetensors`).
    pub path: PathBuf,
    /// Seconds the writer thread took (serializing, writing, syncing).
    pub write_s: f64,
}

/// What [`AsyncCheckpointer::save`] did.
#[derive(Debug)]
pub struct Submitted {
    /// Whether this checkpoint's write started (false: skipped, [`WhenBusy::Skip`]).
    pub started: bool,
    /// The previous write's outcome, when it finished (or was waited for) by now.
    pub finished: Option<Result<Written>>,
}

/// One checkpoint write at a time on a background thread (see the module doc).
#[derive(Debug)]
pub struct AsyncCheckpointer {
    when_busy: WhenBusy,
    in_flight: Option<(u64, JoinHandle<Result<Written>>)>,
}

impl AsyncCheckpointer {
    pub fn new(when_busy: WhenBusy) -> Self {
        AsyncCheckpointer {
            when_busy,
            in_flight: None,
        }
    }

    /// Starts writing the checkpoint `make` returns into `dir` (atomically, as [`save_atomic`]
    /// does) on the writer thread. `make` runs there too: it must own a snapshot of the state
    /// (values copied, or tensors nothing changes any more), taken before this call returns.
    /// With a write in flight: [`WhenBusy::Wait`] waits for it first, [`WhenBusy::Skip`]
    /// drops this checkpoint (`started: false`) with a warning.
    ///
    /// [`save_atomic`]: super::save_atomic
    pub fn save(
        &mut self,
        dir: &Path,
        step: u64,
        make: impl FnOnce() -> Result<Checkpoint> + Send + 'static,
    ) -> Submitted {
        let mut finished = self.poll();
        if let Some((busy, _)) = &self.in_flight {
            if self.when_busy == WhenBusy::Skip {
                tracing::warn!(
                    step,
                    busy = *busy,
                    "checkpoint of step {step} skipped: the write of step {busy} is still running"
                );
                return Submitted {
                    started: false,
                    finished,
                };
            }
            finished = self.wait();
        }
        let target = dir.to_path_buf();
        let pause = std::env::var(WRITE_PAUSE_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis);
        let handle = std::thread::Builder::new()
            .name(format!("ddp-checkpoint-{step}"))
            .spawn(move || {
                let t0 = Instant::now();
                let path = make().and_then(|ckpt| save_atomic_paused(&target, &ckpt, pause))?;
                Ok(Written {
                    step,
                    path,
                    write_s: t0.elapsed().as_secs_f64(),
                })
            });
        match handle {
            Ok(h) => self.in_flight = Some((step, h)),
            Err(e) => {
                let e = Error::io("cannot start the checkpoint writer thread", dir, e);
                return Submitted {
                    started: false,
                    finished: Some(Err(e)),
                };
            }
        }
        Submitted {
            started: true,
            finished,
        }
    }

    /// The step whose write is running, if any.
    pub fn in_flight(&self) -> Option<u64> {
        self.in_flight.as_ref().map(|(s, _)| *s)
    }

    /// The outcome of the write in flight if it has finished (without waiting).
    pub fn poll(&mut self) -> Option<Result<Written>> {
        match &self.in_flight {
            Some((_, h)) if h.is_finished() => self.wait(),
            _ => None,
        }
    }

    /// Waits for the write in flight and returns its outcome (`None`: there was none). Call it
    /// before the program ends (dropping the checkpointer waits too, but cannot report).
    pub fn wait(&mut self) -> Option<Result<Written>> {
        let (step, handle) = self.in_flight.take()?;
        let outcome = handle.join().unwrap_or_else(|_| {
            Err(Error::Checkpoint(format!(
                "the writer thread of step {step}'s checkpoint panicked"
            )))
        });
        let outcome = outcome.map_err(|e| {
            let e = Error::Checkpoint(format!(
                "the background write of step {step}'s checkpoint failed (the previous \
                 checkpoint is still the current one): {e}"
            ));
            tracing::warn!("{e}");
            e
        });
        Some(outcome)
    }
}

impl Drop for AsyncCheckpointer {
    fn drop(&mut self) {
        if let Some(Err(e)) = self.wait() {
            tracing::error!("{e}");
        }
    }
}
