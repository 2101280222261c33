//! How a run writes its checkpoints: synchronously, or in the background (`--checkpoint-async`:
//! an `AsyncCheckpointer` for plain checkpoints, an `AsyncSetSaver` for ZeRO save sets), and
//! what each save stalled the step (rank 0's time in the save).

use crate::config::Args;
use ddprs::checkpoint::{AsyncCheckpointer, Submitted};
use ddprs::sharding::AsyncSetSaver;
use ddprs::ProcessGroup;
use std::path::PathBuf;
use std::time::Instant;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

pub struct Saver {
    /// `Some` with `--checkpoint-async`.
    pub background: Option<AsyncCheckpointer>,
    /// `Some` with `--checkpoint-async` (ZeRO save sets).
    sets: Option<AsyncSetSaver>,
    stall_s: f64,
    saves: u64,
}

impl Saver {
    pub fn new(args: &Args) -> Saver {
        Saver {
            background: args.checkpoint_async.map(AsyncCheckpointer::new),
            sets: args.checkpoint_async.map(|_| AsyncSetSaver::new()),
            stall_s: 0.0,
            saves: 0,
        }
    }

    /// Runs one save (`save(background)`: synchronous when `background` is `None`), timing
    /// its stall, and reports what the background writer says (a failed earlier write, a
    /// skipped save) as warnings: training goes on.
    pub fn save(
        &mut self,
        step: u64,
        save: impl FnOnce(Option<&mut AsyncCheckpointer>) -> Result<Option<Submitted>>,
    ) -> Result<()> {
        let t0 = Instant::now();
        let submitted = save(self.background.as_mut())?;
        self.stall_s += t0.elapsed().as_secs_f64();
        self.saves += 1;
        if let Some(s) = submitted {
            if let Some(Err(e)) = s.finished {
                eprintln!("train-gpt: warning: {e}");
            }
            if !s.started {
                eprintln!(
                    "train-gpt: warning: checkpoint of step {step} skipped: the previous write \
                     is still running (--checkpoint-async skip)"
                );
            }
        }
        Ok(())
    }

    /// Runs one save of a ZeRO save set (`save(sets)`: synchronous when `sets` is `None`),
    /// timing its stall; a failed earlier background set is a warning (training goes on, the
    /// set before it stays current).
    pub fn save_set(
        &mut self,
        save: impl FnOnce(Option<&mut AsyncSetSaver>) -> Result<Option<ddprs::Result<PathBuf>>>,
    ) -> Result<()> {
        let t0 = Instant::now();
        let committed = save(self.sets.as_mut())?;
        self.stall_s += t0.elapsed().as_secs_f64();
        self.saves += 1;
        if let Some(Err(e)) = committed {
            eprintln!("train-gpt: warning: {e}");
        }
        Ok(())
    }

    /// Waits for the last background write (and commits a background set: a collective on
    /// `pg`): an error if it failed (the run asked for a checkpoint at its end and has none
    /// newer than the previous one).
    pub fn finish(&mut self, pg: &ProcessGroup) -> Result<()> {
        if let Some(Err(e)) = self.sets.as_mut().and_then(|s| s.wait(pg)) {
            return Err(e.into());
        }
        match self.background.as_mut().and_then(AsyncCheckpointer::wait) {
            Some(Err(e)) => Err(e.into()),
            _ => Ok(()),
        }
    }

    /// Mean stall per save, in milliseconds (`None` before any).
    pub fn stall_ms(&self) -> Option<f64> {
        (self.saves > 0).then(|| 1e3 * self.stall_s / self.saves as f64)
    }
}
