//! Checkpoints of methods whose replicas differ between synchronizations — [`DiLoCo`] and
//! post-local SGD ([`PeriodicModelAverager`](super::PeriodicModelAverager)). Each rank's
//! parameters and inner optimizer state are its own, so a checkpoint that resumes exactly holds
//! every rank's, not only rank 0's: each rank writes its own into a small [`Checkpoint`] of its
//! framework's, [`gather`] collects them (a collective) with the method's state (identical on
//! every rank: DiLoCo's anchor, momentum and fragments in flight; the averager's step), and
//! rank 0 stores them beside the model ([`Gathered::store`]: blobs `local_rank{R}` and the hook
//! state).
//!
//! [`restore`] gives each rank its part back. At the world size the checkpoint was written at,
//! the run goes on exactly as the uninterrupted one. At another (an elastic restart after a node
//! joined or left) the ranks that were there take their own state; a rank that was not — one
//! *joining between synchronizations* — takes the method's state and the inner state of rank
//! `rank mod written` (torchft's healing also copies a live peer's); under DiLoCo it then starts
//! from the last-synchronized parameters ([`DiLoCo::restore_anchor`]). A departed rank's progress
//! since the last synchronization is dropped; the next synchronization averages over the new
//! world.
//!
//! ```text
//!  save:    each rank: params + inner optimizer ─all_gather─► rank 0: local_rank0 … R-1
//!           the method's state (DiLoCo: all-reduces in flight completed) + its hook state
//!  resume:  rank r < R:  its own blob                (parameters and optimizer)
//!           rank r ≥ R:  local_rank{r mod R}; DiLoCo: then the anchor → parameters
//! ```

use super::DiLoCo;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::reducer::HookState;
use ddp_comm::ProcessGroup;

/// The blob of rank R's own parameters and optimizer state: `local_rank{R}`.
pub const LOCAL_BLOB: &str = "local_rank";

/// Every rank's own state and the method's, for rank 0's checkpoint ([`gather`]).
pub struct Gathered {
    locals: Vec<Vec<u8>>,
    state: HookState,
}

/// Collects every rank's `local` checkpoint (its own parameters and optimizer state, as its
/// framework writes them) beside `state`, the method's (e.g. [`DiLoCo::state_dict`], which
/// completes its all-reduces in flight). A collective: every rank calls it at the same step.
pub fn gather(pg: &ProcessGroup, state: HookState, local: &Checkpoint) -> Result<Gathered> {
    let locals = pg.all_gather_bytes(&local.to_bytes()?)?;
    Ok(Gathered { locals, state })
}

impl Gathered {
    /// Adds the ranks' states and the method's to `ckpt` (rank 0's checkpoint).
    pub fn store(self, ckpt: &mut Checkpoint) -> Result<()> {
        for (r, bytes) in self.locals.into_iter().enumerate() {
            ckpt.insert_blob(format!("{LOCAL_BLOB}{r}"), bytes);
        }
        ckpt.save_hook_state(&self.state)
    }
}

/// What [`restore`] hands a rank.
pub struct Restored {
    /// The method's state (load it into the method).
    pub state: HookState,
    /// The inner state to load: parameters and optimizer state.
    pub local: Checkpoint,
    /// The rank's own state (it was in the run that wrote the checkpoint); when false it joins
    /// between synchronizations with rank [`source`](Self::source)'s (under DiLoCo, call
    /// [`DiLoCo::restore_anchor`] after loading it).
    pub own: bool,
    /// The rank whose blob `local` is.
    pub source: usize,
}

/// Resuming on `rank` of a world of `world` from `ckpt` (`from` names it in errors), whose
/// method's state is of `kind`: this rank's part (see the module doc for a world size other
/// than the checkpoint's).
pub fn restore(
    ckpt: &Checkpoint,
    from: &str,
    kind: &str,
    rank: usize,
    world: usize,
) -> Result<Restored> {
    let written = ckpt.meta.world_size;
    if written == 0 || rank >= world {
        return Err(Error::InvalidArgument(format!(
            "{from}: rank {rank} of {world}, checkpoint of {written} processes"
        )));
    }
    let (source, own) = match rank < written {
        true => (rank, true),
        false => (rank % written, false),
    };
    let what = format!("rank {source}'s own state in {from}");
    let blob = ckpt.require_blob(&format!("{LOCAL_BLOB}{source}"))?;
    Ok(Restored {
        state: ckpt.hook_state(kind)?,
        local: Checkpoint::from_bytes(blob, &what)?,
        own,
        source,
    })
}

/// The line a program prints (rank 0) when a checkpoint of `written` processes resumes with
/// `world`; `joiners`: what a joining rank starts from (e.g. "the parameters of the last
/// synchronization (step 4)"). `None` at the same size.
pub fn world_change_note(written: usize, world: usize, joiners: &str) -> Option<String> {
    if written == world {
        return None;
    }
    let kept = written.min(world);
    let mut s = format!(
        "checkpoint of {written} processes resumed with {world}: ranks 0..{kept} go on from \
         their own parameters and optimizer state"
    );
    if world > written {
        s += &format!(
            "; ranks {written}..{world} join between synchronizations from {joiners} and a \
             peer's optimizer state"
        );
    } else {
        s += &format!(
            "; the progress of ranks {world}..{written} since the last synchronization is dropped"
        );
    }
    Some(s)
}

impl DiLoCo {
    /// What a rank joining between synchronizations starts from, for [`world_change_note`].
    pub fn joiners_start(&self) -> String {
        format!(
            "the parameters of the last synchronization (step {})",
            self.last_sync_step()
        )
    }
}
