//! Save sets written in the background (PyTorch DCP's `async_save`, for ZeRO and FSDP): the
//! adapter snapshots this rank's shard into host memory (the only stall), a writer thread
//! writes it in the set's format, and the set is *committed* — every rank's shard agreed
//! written, then rank 0's index and `zero_latest` — at the next save or at
//! [`AsyncSetSaver::wait`], both collectives at a step boundary (a writer thread never runs a
//! collective, so the ranks' collectives stay in the same order).
//!
//! At most one set is in flight: the next save waits for it. Until it is committed the previous
//! set stays current, so a crash or a full disk during the write leaves the previous set to
//! resume from; a failed write is reported by the commit (every rank gets the same outcome, the
//! partial set is removed) and training goes on.

use super::layout::ShardLayout;
use super::sets::{agree, shard_checkpoint, NewSet, ShardState};
use crate::checkpoint::async_save::WRITE_PAUSE_ENV;
use crate::checkpoint::{save_atomic_paused, CheckpointMeta};
use crate::error::{Error, Result};
use crate::reducer::ParamSpec;
use ddp_comm::ProcessGroup;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Duration;

/// Writes save sets in the background, one at a time (see the module doc).
#[derive(Default)]
pub struct AsyncSetSaver {
    pending: Option<Pending>,
}

struct Pending {
    set: NewSet,
    writer: JoinHandle<Result<()>>,
}

impl AsyncSetSaver {
    pub fn new() -> Self {
        Self::default()
    }

    /// The step of the set being written, if one is.
    pub fn in_flight(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.set.step())
    }

    /// Starts a set of `state` (this rank's snapshot, owned: training may change the model as
    /// soon as this returns) in `dir`, after committing the set in flight, whose outcome it
    /// returns (`None` when there was none). A collective; an error reading `state` on any rank
    /// is an error on every rank before anything is written.
    pub fn save(
        &mut self,
        pg: &ProcessGroup,
        dir: &Path,
        layout: &ShardLayout,
        specs: &[ParamSpec],
        state: Result<ShardState>,
        meta: &CheckpointMeta,
    ) -> Result<Option<Result<PathBuf>>> {
        let previous = self.wait(pg);
        let state = agree(pg, "reading the shard state", state)?;
        let set = NewSet::start(pg, dir, layout, specs, &state, meta)?;
        let (shard_meta, shard_dir) = set.shard_target();
        let (layout, specs) = (layout.clone(), specs.to_vec());
        let pause = std::env::var(WRITE_PAUSE_ENV)
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis);
        let writer = std::thread::Builder::new()
            .name(format!("ddp-set-{}", meta.step))
            .spawn(move || {
                let ck = shard_checkpoint(shard_meta, &layout, &specs, &state)?;
                save_atomic_paused(&shard_dir, &ck, pause).map(|_| ())
            })
            .map_err(|e| Error::Checkpoint(format!("cannot start the writer thread: {e}")))?;
        self.pending = Some(Pending { set, writer });
        Ok(previous)
    }

    /// Waits for the set in flight and commits it (a collective): its directory, or why it
    /// failed (then the previous set stays current); `None` when none was in flight. Call it
    /// before the run ends, so that its last set lands.
    pub fn wait(&mut self, pg: &ProcessGroup) -> Option<Result<PathBuf>> {
        let p = self.pending.take()?;
        let step = p.set.step();
        let written = p.writer.join().unwrap_or_else(|_| {
            Err(Error::Checkpoint(format!(
                "the writer of step {step}'s shard panicked"
            )))
        });
        Some(
            p.set
                .commit(pg, written)
                .map_err(|e| Error::Checkpoint(format!("save set of step {step}: {e}"))),
        )
    }
}
