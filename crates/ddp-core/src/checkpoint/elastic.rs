//! Resuming at another world size (an elastic job that lost or gained nodes).
//!
//! [`RunPlan::check`] refuses a checkpoint of another world size (its per-rank sampler position
//! and step count only mean something at the world size that wrote them). An elastic run resumes
//! by the *global* position instead: the samples of the epoch that all ranks together consumed,
//! which [`DistributedSampler::indices_from_global`](crate::DistributedSampler::indices_from_global)
//! re-shards over the new world (none skipped, none seen twice within the epoch but as padding).
//! A checkpoint taken in an epoch that was itself re-sharded records that global position in its
//! `extra` JSON under [`GLOBAL_CONSUMED_KEY`] ([`RunPlan::meta_global`]); otherwise it is the
//! per-rank position times the world size that wrote it.

use super::resume::share;
use super::{checkpoint_path, ensure_writable, load, Checkpoint, CheckpointMeta};
use super::{RunPlan, TrainingState};
use crate::error::{Error, Result};
use ddp_comm::ProcessGroup;
use std::path::{Path, PathBuf};

/// Key of [`CheckpointMeta::extra`] holding the samples of the current epoch consumed by all ranks
/// together, when the epoch was re-sharded (see [`RunPlan::meta_global`]).
pub const GLOBAL_CONSUMED_KEY: &str = "sampler_global_consumed";

/// Where a re-sharded run continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalPosition {
    /// Optimizer steps completed (at whatever world sizes).
    pub step: u64,
    /// Current epoch.
    pub epoch: u64,
    /// Samples of `epoch` consumed by all ranks together.
    pub global_consumed: usize,
    /// World size of the run that wrote the checkpoint.
    pub from_world_size: usize,
}

/// A checkpoint to resume from at any world size, checked against the run.
#[derive(Debug, Clone)]
pub struct ResumedGlobal {
    pub checkpoint: Checkpoint,
    pub position: GlobalPosition,
    /// The file it came from (on rank 0).
    pub path: PathBuf,
}

/// The global position a checkpoint records: [`GLOBAL_CONSUMED_KEY`] when present, else the
/// per-rank position times its world size.
pub fn global_consumed(meta: &CheckpointMeta) -> Result<usize> {
    match meta.extra.get(GLOBAL_CONSUMED_KEY) {
        None => meta
            .sampler
            .consumed
            .checked_mul(meta.world_size)
            .ok_or_else(|| Error::Checkpoint("sampler position out of range".into())),
        Some(v) => v
            .as_u64()
            .and_then(|g| usize::try_from(g).ok())
            .ok_or_else(|| {
                Error::Checkpoint(format!(
                    "invalid metadata: {GLOBAL_CONSUMED_KEY} = {v} is not a sample count"
                ))
            }),
    }
}

impl RunPlan {
    /// The metadata of a checkpoint taken at `state` in an epoch that was re-sharded: `state`'s
    /// step and epoch, and the global position `global_consumed` (saved under
    /// [`GLOBAL_CONSUMED_KEY`]; `state.consumed` is kept as this world's per-rank count).
    pub fn meta_global(&self, state: &TrainingState, global_consumed: usize) -> CheckpointMeta {
        let mut meta = self.meta(state);
        let mut extra = match meta.extra.take() {
            serde_json::Value::Object(m) => m,
            serde_json::Value::Null => serde_json::Map::new(),
            other => {
                let mut m = serde_json::Map::new();
                m.insert("user".into(), other);
                m
            }
        };
        extra.insert(GLOBAL_CONSUMED_KEY.into(), global_consumed.into());
        meta.extra = serde_json::Value::Object(extra);
        meta
    }

    /// Whether resuming `meta` needs [`RunPlan::check_global`]: another world size, or an epoch
    /// that was re-sharded.
    pub fn needs_global(&self, meta: &CheckpointMeta) -> bool {
        meta.world_size != self.world_size || meta.extra.get(GLOBAL_CONSUMED_KEY).is_some()
    }

    /// [`RunPlan::check`] for a checkpoint of any world size, over a dataset of `dataset_len`
    /// samples: the same hyper-parameters, a sampler epoch equal to the epoch, a global position
    /// inside the epoch (at most the writer's padded epoch), not past the end of the run. The step
    /// count cannot be checked against the position (earlier epochs may have run at other world
    /// sizes); it must not pass `max_steps`.
    pub fn check_global(
        &self,
        meta: &CheckpointMeta,
        dataset_len: usize,
    ) -> Result<GlobalPosition> {
        meta.validate()?;
        self.check_hyper(meta)?;
        let bad = |m: String| {
            Err(Error::Checkpoint(format!(
                "checkpoint position is inconsistent with this run: {m}"
            )))
        };
        if meta.sampler.epoch != meta.epoch {
            return bad(format!(
                "sampler epoch {} differs from epoch {}",
                meta.sampler.epoch, meta.epoch
            ));
        }
        let g = global_consumed(meta)?;
        // The writer's epoch has at most dataset_len + world_size - 1 positions (padding).
        let most = dataset_len.saturating_add(meta.world_size);
        if g >= most {
            return bad(format!(
                "{g} samples of the epoch consumed, but an epoch has {dataset_len} (padded to \
                 less than {most} at world size {})",
                meta.world_size
            ));
        }
        self.check_not_past_end(meta, g)?;
        Ok(GlobalPosition {
            step: meta.step,
            epoch: meta.epoch,
            global_consumed: g,
            from_world_size: meta.world_size,
        })
    }
}

impl RunPlan {
    /// The position to continue from for a checkpoint of any world size: [`RunPlan::check`]
    /// (the exact per-rank position) when it was written at this world size in an epoch that
    /// was not re-sharded, else [`RunPlan::check_global`].
    pub fn check_any(&self, meta: &CheckpointMeta, dataset_len: usize) -> Result<GlobalPosition> {
        if self.needs_global(meta) {
            return self.check_global(meta, dataset_len);
        }
        let s = self.check(meta)?;
        Ok(GlobalPosition {
            step: s.step,
            epoch: s.epoch,
            global_consumed: s.consumed * self.world_size,
            from_world_size: self.world_size,
        })
    }
}

/// Where a run of this world continues from a checkpoint ([`RunPlan::resume_point`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumePoint {
    /// This world's per-rank position: `consumed` is 0 when the epoch is re-sharded.
    pub state: TrainingState,
    /// `Some(global samples of the epoch consumed)` when the rest of the epoch is re-sharded
    /// over this world ([`crate::DistributedSampler::indices_from_global`]); its checkpoints
    /// then record the global position ([`RunPlan::meta_global`]).
    pub reshard: Option<usize>,
    /// The checkpoint's position.
    pub position: GlobalPosition,
}

impl ResumePoint {
    /// The line a training program prints on resume, `what` naming the checkpoint.
    pub fn describe(&self, what: &str, world_size: usize) -> String {
        let (s, p) = (&self.state, &self.position);
        match self.reshard {
            Some(g) => format!(
                "resuming from {what} at step {}, epoch {}, {g} samples of the epoch consumed \
                 (written at world size {}): the rest of the epoch re-sharded over \
                 {world_size} ranks",
                s.step, s.epoch, p.from_world_size
            ),
            None => format!(
                "resuming from {what} at step {}, epoch {}, {} samples into the epoch",
                s.step, s.epoch, s.consumed
            ),
        }
    }
}

impl RunPlan {
    /// [`RunPlan::check_any`], then where this world continues: the exact per-rank position,
    /// or the start of a re-sharded rest of the epoch.
    pub fn resume_point(&self, meta: &CheckpointMeta, dataset_len: usize) -> Result<ResumePoint> {
        let position = self.check_any(meta, dataset_len)?;
        let reshard = self.needs_global(meta).then_some(position.global_consumed);
        Ok(ResumePoint {
            state: TrainingState {
                step: position.step,
                epoch: position.epoch,
                consumed: match reshard {
                    Some(_) => 0,
                    None => position.global_consumed / self.world_size,
                },
            },
            reshard,
            position,
        })
    }
}

/// [`super::resume_or_start`] for runs whose world size may change: rank 0 checks `dir`, loads
/// the checkpoint (with `resume`) and shares it; every rank checks it, with [`RunPlan::check`]
/// when it was written at this world size in an epoch that was not re-sharded (the exact
/// position), else with [`RunPlan::check_global`]. Both give a [`GlobalPosition`].
pub fn resume_or_start_global(
    pg: &ProcessGroup,
    dir: &Path,
    resume: bool,
    plan: &RunPlan,
    dataset_len: usize,
) -> Result<Option<ResumedGlobal>> {
    let local = if pg.rank() == 0 {
        let loaded = ensure_writable(dir).and_then(|()| if resume { load(dir) } else { Ok(None) });
        Some(loaded)
    } else {
        None
    };
    let Some(checkpoint) = share(pg, local, 0)? else {
        return Ok(None);
    };
    let position = plan.check_any(&checkpoint.meta, dataset_len)?;
    Ok(Some(ResumedGlobal {
        checkpoint,
        position,
        path: checkpoint_path(dir),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplerState;

    fn plan(world_size: usize) -> RunPlan {
        RunPlan {
            world_size,
            samples_per_epoch: 100usize.div_ceil(world_size),
            batch_size: 5,
            epochs: 3,
            max_steps: None,
            hyper: serde_json::json!({"lr": 0.1}),
            rng_state: 1,
        }
    }

    #[test]
    fn another_world_size_is_refused_exactly_and_accepted_globally() {
        // Written at world 4 (5 steps per epoch) after 3 steps of 5 per rank in epoch 1.
        let meta = plan(4).meta(&TrainingState {
            step: 8,
            epoch: 1,
            consumed: 15,
        });
        assert!(plan(4).check(&meta).is_ok());
        let e = plan(2).check(&meta).unwrap_err().to_string();
        assert!(e.contains("world_size 4"), "{e}");
        assert!(plan(2).needs_global(&meta) && !plan(4).needs_global(&meta));
        let p = plan(2).check_global(&meta, 100).unwrap();
        assert_eq!(
            p,
            GlobalPosition {
                step: 8,
                epoch: 1,
                global_consumed: 60,
                from_world_size: 4
            }
        );
        // Then at world 2, 2 steps later, a checkpoint of the re-sharded epoch.
        let meta2 = plan(2).meta_global(
            &TrainingState {
                step: 10,
                epoch: 1,
                consumed: 10,
            },
            80,
        );
        assert!(plan(2).needs_global(&meta2), "a re-sharded epoch");
        assert_eq!(meta2.extra["lr"], 0.1, "the hyper-parameters are kept");
        let p = plan(3).check_global(&meta2, 100).unwrap();
        assert_eq!((p.step, p.global_consumed, p.from_world_size), (10, 80, 2));
        // Still refused: other hyper-parameters, a position past the epoch or the run.
        let mut other = plan(2);
        other.hyper = serde_json::json!({"lr": 0.2});
        assert!(other.check_global(&meta, 100).is_err());
        let mut far = meta.clone();
        far.extra[GLOBAL_CONSUMED_KEY] = 104.into();
        let e = plan(2).check_global(&far, 100).unwrap_err().to_string();
        assert!(e.contains("104 samples of the epoch"), "{e}");
        let mut late = meta.clone();
        late.epoch = 3;
        late.sampler = SamplerState {
            epoch: 3,
            consumed: 1,
        };
        assert!(plan(2).check_global(&late, 100).is_err());
        let mut bad = meta;
        bad.extra[GLOBAL_CONSUMED_KEY] = "x".into();
        assert!(plan(2).check_global(&bad, 100).is_err());
    }
}
