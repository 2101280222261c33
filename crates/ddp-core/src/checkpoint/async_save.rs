//! Checkpoints written in the background (PyTorch Distributed Checkpoint's `async_save`).
//!
//! A synchronous save stops training for the whole write: serializing, writing, `fsync`,
//! renaming. An [`AsyncCheckpointer`] stops it only for the *snapshot*: the state copied into
//! host buffers at a step boundary (or, where tensors are immutable, as Burn's are, only
//! referenced), handed to a writer thread that serializes it and writes it with the same
//! [`save_atomic`](super::save_atomic) as a synchronous save (temporary file, `fsync`,
//! rename, `fsync` of the directory), so a crash or a full disk during the write leaves the
//! previous checkpoint current.
//!
//! At most one write is in flight. A save that finds the previous one still running waits for it
//! ([`WhenBusy::Wait`], the default: every requested checkpoint is written) or is skipped with a
//! warning ([`WhenBusy::Skip`]: training never waits for storage; the last skipped one is kept
//! and written at [`AsyncCheckpointer::wait`] unless a later save supersedes it, so the run's
//! final checkpoint always lands). A write's outcome is reported
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
    /// Skip this one with a warning (training never waits for storage). The last skipped one
    /// is kept (replacing any earlier) and written by [`AsyncCheckpointer::wait`] unless a
    /// later save supersedes it, so the checkpoint a run asks for last always lands.
    Skip,
}

impl std::str::FromStr for WhenBusy {
    type Err = String;

    /// `wait` or `skip` (a command line's spelling, e.g. `--checkpoint-async skip`).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "wait" => Ok(WhenBusy::Wait),
            "skip" => Ok(WhenBusy::Skip),
            _ => Err(format!("`{s}`: expected `wait` or `skip`")),
        }
    }
}

impl std::fmt::Display for WhenBusy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WhenBusy::Wait => "wait",
            WhenBusy::Skip => "skip",
        })
    }
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
pub struct AsyncCheckpointer {
    when_busy: WhenBusy,
    in_flight: Option<(u64, JoinHandle<Result<Written>>)>,
    /// [`WhenBusy::Skip`]: the last checkpoint skipped since the last write started (step,
    /// directory, snapshot), written by [`wait`](Self::wait) if nothing supersedes it.
    skipped: Option<(u64, PathBuf, Make)>,
}

type Make = Box<dyn FnOnce() -> Result<Checkpoint> + Send>;

impl std::fmt::Debug for AsyncCheckpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCheckpointer")
            .field("when_busy", &self.when_busy)
            .field("in_flight", &self.in_flight())
            .field("skipped", &self.skipped.as_ref().map(|s| s.0))
            .finish()
    }
}

impl AsyncCheckpointer {
    pub fn new(when_busy: WhenBusy) -> Self {
        AsyncCheckpointer {
            when_busy,
            in_flight: None,
            skipped: None,
        }
    }

    /// Starts writing the checkpoint `make` returns into `dir` (atomically, as [`save_atomic`]
    /// does) on the writer thread. `make` runs there too: it must own a snapshot of the state
    /// (values copied, or tensors nothing changes any more), taken before this call returns.
    /// With a write in flight: [`WhenBusy::Wait`] waits for it first, [`WhenBusy::Skip`] keeps
    /// this checkpoint aside (`started: false`, a warning) for [`wait`](Self::wait), unless a
    /// later save supersedes it.
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
                self.skipped = Some((step, dir.to_path_buf(), Box::new(make)));
                return Submitted {
                    started: false,
                    finished,
                };
            }
            finished = self.join();
        }
        self.skipped = None; // superseded by this one
        match self.start(dir, step, Box::new(make)) {
            Ok(()) => Submitted {
                started: true,
                finished,
            },
            Err(e) => Submitted {
                started: false,
                finished: Some(Err(e)),
            },
        }
    }

    /// Starts the writer thread of `make` (no write is in flight).
    fn start(&mut self, dir: &Path, step: u64, make: Make) -> Result<()> {
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
            })
            .map_err(|e| Error::io("cannot start the checkpoint writer thread", dir, e))?;
        self.in_flight = Some((step, handle));
        Ok(())
    }

    /// The step whose write is running, if any.
    pub fn in_flight(&self) -> Option<u64> {
        self.in_flight.as_ref().map(|(s, _)| *s)
    }

    /// The outcome of the write in flight if it has finished (without waiting).
    pub fn poll(&mut self) -> Option<Result<Written>> {
        match &self.in_flight {
            Some((_, h)) if h.is_finished() => self.join(),
            _ => None,
        }
    }

    /// Waits for the write in flight and then writes the last skipped checkpoint, if one is
    /// kept ([`WhenBusy::Skip`]); returns the outcome of the last of them (`None`: there was
    /// none). Call it before the program ends (dropping the checkpointer waits too, but cannot
    /// report).
    pub fn wait(&mut self) -> Option<Result<Written>> {
        let first = self.join();
        let Some((step, dir, make)) = self.skipped.take() else {
            return first;
        };
        match self.start(&dir, step, make) {
            Ok(()) => self.join(),
            Err(e) => Some(Err(e)),
        }
    }

    /// Joins the write in flight: its outcome, a failure also a `tracing` warning.
    fn join(&mut self) -> Option<Result<Written>> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{load, CheckpointMeta};

    /// A snapshot of step `step` (one tensor holding the step) that takes `ms` to produce on
    /// the writer thread.
    fn snapshot(step: u64, ms: u64) -> impl FnOnce() -> Result<Checkpoint> + Send + 'static {
        let mut ckpt = Checkpoint::new(CheckpointMeta {
            step,
            ..Default::default()
        });
        ckpt.insert("w", vec![1], vec![step as f32]).unwrap();
        move || {
            std::thread::sleep(Duration::from_millis(ms));
            Ok(ckpt)
        }
    }

    fn step_in(dir: &Path) -> u64 {
        load(dir).unwrap().unwrap().meta.step
    }

    #[test]
    fn wait_writes_every_checkpoint_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut saver = AsyncCheckpointer::new(WhenBusy::Wait);
        for step in 1..=3 {
            let sent = saver.save(dir.path(), step, snapshot(step, 50));
            assert!(sent.started, "step {step}");
            if step > 1 {
                // The previous write was waited for and reported.
                let done = sent
                    .finished
                    .expect("the previous write's outcome")
                    .unwrap();
                assert_eq!(done.step, step - 1);
                assert_eq!(step_in(dir.path()), step - 1);
            }
        }
        assert_eq!(saver.wait().unwrap().unwrap().step, 3);
        assert_eq!(step_in(dir.path()), 3);
        assert!(saver.wait().is_none(), "nothing left in flight");
    }

    #[test]
    fn skip_never_waits_and_the_last_skipped_checkpoint_lands_at_wait() {
        let dir = tempfile::tempdir().unwrap();
        let mut saver = AsyncCheckpointer::new(WhenBusy::Skip);
        assert!(saver.save(dir.path(), 1, snapshot(1, 400)).started);
        let t0 = Instant::now();
        assert!(!saver.save(dir.path(), 2, snapshot(2, 0)).started);
        assert!(!saver.save(dir.path(), 3, snapshot(3, 0)).started);
        assert!(t0.elapsed() < Duration::from_millis(300), "a skip waited");
        assert_eq!(saver.in_flight(), Some(1));
        // Step 3 replaced step 2 and is written once step 1's write is done.
        assert_eq!(saver.wait().unwrap().unwrap().step, 3);
        assert_eq!(step_in(dir.path()), 3);
    }

    #[test]
    fn a_failed_write_is_reported_with_its_step_and_the_previous_checkpoint_stays() {
        let dir = tempfile::tempdir().unwrap();
        let mut saver = AsyncCheckpointer::new(WhenBusy::Wait);
        saver.save(dir.path(), 1, snapshot(1, 0));
        let sent = saver.save(dir.path(), 2, || {
            Err(Error::Checkpoint(
                "no space left on device (simulated)".into(),
            ))
        });
        assert!(sent.started);
        assert_eq!(sent.finished.unwrap().unwrap().step, 1);
        let e = saver.wait().unwrap().unwrap_err().to_string();
        assert!(e.contains("step 2") && e.contains("no space left"), "{e}");
        assert!(
            e.contains("previous checkpoint is still the current one"),
            "{e}"
        );
        assert_eq!(step_in(dir.path()), 1);
    }
}
