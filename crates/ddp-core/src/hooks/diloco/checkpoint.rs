//! DiLoCo in checkpoints. Between synchronizations every rank trains its own replica, so a
//! checkpoint that resumes exactly holds every rank's parameters and inner optimizer state, not
//! only rank 0's: each rank writes its own into a small [`Checkpoint`] of its framework's,
//! [`gather`] collects them (a collective) with the outer state (anchor, momentum, fragments in
//! flight), and rank 0 stores them beside the model ([`Gathered::store`]: blobs
//! `diloco_rank{R}` and the hook state `"diloco"`).
//!
//! [`restore`] gives each rank its part back. At the world size the checkpoint was written at,
//! the run goes on exactly as the uninterrupted one. At another (an elastic restart after a node
//! joined or left) the ranks that were there take their own state; a rank that was not — one
//! *joining between synchronizations* — takes the outer state (identical on every rank) and the
//! last-synchronized parameters ([`DiLoCo::restore_anchor`]), with the inner optimizer state of
//! rank `rank mod written` (torchft's healing also copies a live peer's). A departed rank's
//! progress since the last synchronization is dropped. The next synchronization averages over
//! the new world.
//!
//! ```text
//!  save:    each rank: params + inner optimizer ─all_gather─► rank 0: diloco_rank0 … R-1
//!           outer state (all-reduces in flight completed)       + hook state "diloco"
//!  resume:  rank r < R:  its own blob                (parameters and optimizer)
//!           rank r ≥ R:  anchor → parameters, diloco_rank{r mod R}'s optimizer state
//! ```

use super::DiLoCo;
use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::reducer::HookState;
use ddp_comm::ProcessGroup;

/// The blob of rank R's own parameters and optimizer state: `diloco_rank{R}`.
pub const LOCAL_BLOB: &str = "diloco_rank";

/// The kind of the outer loop's hook state in a checkpoint.
pub const STATE_KIND: &str = "diloco";

/// Every rank's own state and the outer loop's, for rank 0's checkpoint ([`gather`]).
pub struct Gathered {
    locals: Vec<Vec<u8>>,
    state: HookState,
}

/// Collects every rank's `local` checkpoint (its own parameters and optimizer state, as its
/// framework writes them) and `outer`'s state (its all-reduces in flight completed). A
/// collective: every rank calls it at the same step.
pub fn gather(pg: &ProcessGroup, outer: &mut DiLoCo, local: &Checkpoint) -> Result<Gathered> {
    let state = outer.state_dict()?;
    let locals = pg.all_gather_bytes(&local.to_bytes()?)?;
    Ok(Gathered { locals, state })
}

impl Gathered {
    /// Adds the ranks' states and the outer state to `ckpt` (rank 0's checkpoint).
    pub fn store(self, ckpt: &mut Checkpoint) -> Result<()> {
        for (r, bytes) in self.locals.into_iter().enumerate() {
            ckpt.insert_blob(format!("{LOCAL_BLOB}{r}"), bytes);
        }
        ckpt.save_hook_state(&self.state)
    }
}

/// What [`restore`] hands a rank.
pub struct Restored {
    /// The inner state to load: the optimizer state always; the parameters only when
    /// [`own`](Self::own).
    pub local: Checkpoint,
    /// The rank's own state (it was in the run that wrote the checkpoint). When false the rank
    /// joins between synchronizations: [`restore`] set nothing yet, the caller loads the
    /// optimizer state from `local` and calls [`DiLoCo::restore_anchor`] for the parameters.
    pub own: bool,
    /// The rank whose blob `local` is.
    pub source: usize,
}

/// Resuming a DiLoCo run on `rank` of a world of `world` from `ckpt` (`from` names it in
/// errors): loads the outer state into `outer` and returns this rank's part (see the module doc
/// for a world size other than the checkpoint's).
pub fn restore(
    ckpt: &Checkpoint,
    from: &str,
    outer: &mut DiLoCo,
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
    let what = format!("rank {source}'s DiLoCo state in {from}");
    let blob = ckpt.require_blob(&format!("{LOCAL_BLOB}{source}"))?;
    let local = Checkpoint::from_bytes(blob, &what)?;
    outer.load_state_dict(&ckpt.hook_state(STATE_KIND)?)?;
    Ok(Restored { local, own, source })
}

/// The line a program prints (rank 0) when a DiLoCo checkpoint of `written` processes resumes
/// with `world`; `None` at the same size.
pub fn world_change_note(written: usize, world: usize, last_sync: u64) -> Option<String> {
    if written == world {
        return None;
    }
    let kept = written.min(world);
    let mut s = format!(
        "DiLoCo checkpoint of {written} processes resumed with {world}: ranks 0..{kept} go on \
         from their own parameters and optimizer state"
    );
    if world > written {
        s += &format!(
            "; ranks {written}..{world} join between synchronizations from the parameters of \
             the last one (step {last_sync}) and a peer's optimizer state"
        );
    } else {
        s += &format!(
            "; the progress of ranks {world}..{written} since the last synchronization (step \
             {last_sync}) is dropped"
        );
    }
    Some(s)
}
