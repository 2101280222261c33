//! [`ZeroCore`]: the framework-agnostic half of a ZeRO stage 0-2 wrapper (`ddp_candle::ZeroDdp`,
//! `ddp_burn::ZeroDdp`), and the sharded checkpoint calls that every sharded wrapper makes
//! through one [`agree`] ([`save_agreed`], [`load_agreed`], [`import_agreed`]).
//!
//! ```text
//!  new: layout from the reducer's buckets ─► ReduceScatterHook on the reducer (stage 2: one
//!       bucket alive beyond the shards)
//!  backward (the adapter's) ─► after_reduce: this rank's averaged chunks (ShardGrads)
//!  ─► clip_grad_norm (optional) ─► take_grads ─► the adapter's optimizer step and
//!     gather_params_into (window: gather_window)
//!  save / load / import: the shard state read or decoded by the adapter, agreed over the ranks
//! ```
//!
//! What stays in an adapter is what touches its framework: running the backward, stepping its
//! optimizer on the chunks, writing the gathered values into its parameters, and converting its
//! optimizer state to and from [`ShardState`].

use super::hook::{clip_grad_norm, take_shard_grads, ReduceScatterHook, ShardGrads};
use super::layout::ShardLayout;
use super::sets::{agree, import, load_sharded, save_sharded, ShardState};
use super::ZeroStage;
use crate::checkpoint::{Checkpoint, CheckpointMeta};
use crate::error::{Error, Result};
use crate::reducer::{ParamSpec, Reducer, StepStats};
use ddp_comm::ProcessGroup;
use std::path::{Path, PathBuf};

/// Stage 2's full-size buckets alive at once in the parameter all-gather.
pub const STAGE2_WINDOW: usize = 2;

/// The stage, this rank's [`ShardLayout`] and its averaged gradient chunks between a backward
/// and the step (see the module doc).
pub struct ZeroCore {
    stage: ZeroStage,
    layout: ShardLayout,
    grads: Option<ShardGrads>,
}

impl ZeroCore {
    /// The layout of `reducer`'s buckets over `pg` and, at stages 1 and 2, the reducer set up
    /// for it: buckets reduce-scattered in place (stage 1) or cut to this rank's chunk (stage 2,
    /// where a bucket is filled only once the one before it is cut, and the last buckets from
    /// `whole_from` on, when given, stay whole). Stage 0 leaves the reducer as it is. A
    /// collective: every rank calls it with the same stage. Stage 3 keeps no full replica and
    /// is refused.
    pub fn new(
        reducer: &mut Reducer,
        pg: &ProcessGroup,
        stage: ZeroStage,
        whole_from: Option<usize>,
    ) -> Result<ZeroCore> {
        if stage == ZeroStage::Three {
            return Err(Error::InvalidArgument(
                "ZeRO stage 3 shards the parameters: it is not run over a reducer".into(),
            ));
        }
        let layout = ShardLayout::new(reducer.specs(), &reducer.buckets(), pg.size(), pg.rank())?;
        if stage != ZeroStage::Ddp {
            if stage == ZeroStage::Two {
                // A bucket is filled once the one before it is cut to its shard: one bucket
                // of gradients beyond the shards in a blockwise backward, not two.
                let cap = reducer.bucket_cap_bytes();
                reducer.set_max_bucket_bytes_alive(Some(cap));
            }
            reducer.register_comm_hook(match (stage, whole_from) {
                (ZeroStage::One, _) => ReduceScatterHook::in_place(),
                (_, None) => ReduceScatterHook::shard_only(),
                (_, Some(b)) => ReduceScatterHook::shard_only().whole_from(b),
            })?;
        }
        Ok(ZeroCore {
            stage,
            layout,
            grads: None,
        })
    }

    pub fn stage(&self) -> ZeroStage {
        self.stage
    }

    /// Which elements this rank owns.
    pub fn layout(&self) -> &ShardLayout {
        &self.layout
    }

    /// Bytes this rank sends per synchronized step (ring model: all-reduce, or reduce-scatter
    /// plus all-gather; the same volume).
    pub fn bytes_per_step(&self) -> u64 {
        super::bytes_per_step(&self.layout)
    }

    /// The buckets of the parameter all-gather in flight at once ([`super::Gather::window`]):
    /// all of them at stage 1 (0), [`STAGE2_WINDOW`] at stage 2.
    pub fn gather_window(&self) -> usize {
        match self.stage {
            ZeroStage::Two => STAGE2_WINDOW,
            _ => 0,
        }
    }

    /// After a backward's reduction (stages 1 and 2): a synchronized step leaves this rank's
    /// averaged chunks of the reducer's buckets here, taken over as they are (stage 1: whole,
    /// the chunk inside; stage 2: the chunk alone); an unsynchronized one (`no_sync`) none.
    pub fn after_reduce(&mut self, reducer: &mut Reducer, stats: StepStats) -> Result<StepStats> {
        self.grads = match stats.synced {
            true => Some(take_shard_grads(&self.layout, reducer)?),
            false => None,
        };
        Ok(stats)
    }

    /// Whether averaged gradient chunks wait for the step.
    pub fn has_grads(&self) -> bool {
        self.grads.is_some()
    }

    /// The averaged gradient chunks for the step (`what`), or the error saying that there are
    /// none ([`no_grads`]).
    pub fn take_grads(&mut self, what: &str, rank: usize) -> Result<ShardGrads> {
        self.grads.take().ok_or_else(|| no_grads(what, rank))
    }

    /// Drops the averaged gradient chunks (a loaded checkpoint replaces the step).
    pub fn clear_grads(&mut self) {
        self.grads = None;
    }

    /// PyTorch's `clip_grad_norm_` over the gradient chunks (the norm all-reduced from every
    /// rank's; see [`clip_grad_norm`]); `None` when there are none (stage 0, or before a
    /// synchronized backward).
    pub fn clip_grad_norm(&mut self, pg: &ProcessGroup, max_norm: f64) -> Option<Result<f64>> {
        let grads = self.grads.as_mut()?;
        Some(clip_grad_norm(pg, grads, max_norm))
    }

    /// An error for `what` at stage 0, whose checkpoints are plain DDP's (`how` says how to
    /// save them).
    pub fn require_sharded(&self, what: &str, how: &str) -> Result<()> {
        match self.stage {
            ZeroStage::Ddp => Err(Error::InvalidArgument(format!(
                "{what}: stage 0 is plain DDP; {how}"
            ))),
            _ => Ok(()),
        }
    }
}

/// The error of a step (or clipping) with no averaged gradients to use.
pub fn no_grads(what: &str, rank: usize) -> Error {
    Error::InvalidArgument(format!(
        "{what} on rank {rank}: no averaged gradients (call backward first, outside no_sync)"
    ))
}

/// Saves this rank's shard `state` as a sharded set of `dir` ([`save_sharded`], a
/// collective): `state` is agreed over the ranks first, so that a rank that could not read its
/// state fails every rank before anything is written.
pub fn save_agreed(
    pg: &ProcessGroup,
    dir: &Path,
    layout: &ShardLayout,
    specs: &[ParamSpec],
    state: Result<ShardState>,
    meta: &CheckpointMeta,
) -> Result<PathBuf> {
    let state = agree(pg, "reading the shard state", state)?;
    save_sharded(pg, dir, layout, specs, &state, meta)
}

/// This rank's cut of the current sharded set of `dir` (any world size, any stage),
/// `decode`d by the adapter, agreed over the ranks: an error on one is an error on all, and
/// nothing is changed (reads only). `Ok(None)` when `dir` holds no set.
pub fn load_agreed<T>(
    pg: &ProcessGroup,
    dir: &Path,
    layout: &ShardLayout,
    specs: &[ParamSpec],
    decode: impl FnOnce(ShardState) -> Result<T>,
) -> Result<Option<(T, CheckpointMeta)>> {
    let loaded = load_sharded(dir, layout, specs).and_then(|l| {
        l.map(|(state, meta)| Ok((decode(state)?, meta)))
            .transpose()
    });
    agree(pg, "loading the sharded checkpoint", loaded)
}

/// This rank's cut of a plain checkpoint ([`import`]), `decode`d by the adapter, agreed over
/// the ranks.
pub fn import_agreed<T>(
    pg: &ProcessGroup,
    ckpt: &Checkpoint,
    layout: &ShardLayout,
    specs: &[ParamSpec],
    decode: impl FnOnce(ShardState) -> Result<T>,
) -> Result<T> {
    let state = import(ckpt, layout, specs).and_then(decode);
    agree(pg, "importing the checkpoint", state)
}
