//! DiLoCo (`--hook diloco:H[:OUTER_LR[:MOMENTUM]]`, `--hook streaming-diloco:H:F[:TAU]`,
//! `ddprs::hooks::DiLoCo`) in the examples' plain checkpoints and at the end of their runs.
//!
//! Between synchronizations every rank trains its own replica, so the checkpoint holds every
//! rank's parameters and optimizer state beside the outer state: the library's
//! [`ddprs::hooks::local_state`] ([`gather`] on every rank, [`Gathered::store`] in rank 0's
//! checkpoint, [`restore`] on resume). At the world size it was written at the resume is exact;
//! at another (an elastic restart) a rank joining between synchronizations starts from the last
//! synchronization with a peer's optimizer state, and rank 0 says so.
//!
//! The end of a run: the last synchronization ([`DiLoCo::finish`]) comes after the last
//! epoch's training and before its evaluation and checkpoint, so that both see the one model
//! every replica holds; a run stopped earlier (`--max-steps`, `--target-accuracy`) writes its
//! checkpoint first, so that a resume continues where the uninterrupted run would, and then
//! synchronizes for its summary. `finish` does nothing the second time.

use ddprs::checkpoint::Checkpoint;
use ddprs::comm::ProcessGroup;
use ddprs::hooks::local_state;
pub use ddprs::hooks::local_state::{Gathered, Restored};
use ddprs::hooks::DiLoCo;

/// Collects every rank's `local` checkpoint (its own parameters and optimizer state, as its
/// framework writes them) and `outer`'s state (its all-reduces in flight completed). A
/// collective: every rank calls it at the same step.
pub fn gather(
    pg: &ProcessGroup,
    outer: &mut DiLoCo,
    local: &Checkpoint,
) -> ddprs::Result<Gathered> {
    local_state::gather(pg, outer.state_dict()?, local)
}

/// Resuming a DiLoCo run on `rank` of a world of `world` from `ckpt` (`from` names it): loads
/// the outer state into `outer` and returns this rank's part. Load `local` (parameters and
/// optimizer state); when not `own` (a rank joining between synchronizations) then set the
/// parameters to the last-synchronized ones with [`DiLoCo::restore_anchor`]. Rank 0 prints
/// (prefixed with `program`) what a change of world size did.
pub fn restore(
    program: &str,
    ckpt: &Checkpoint,
    from: &str,
    outer: &mut DiLoCo,
    rank: usize,
    world: usize,
) -> ddprs::Result<Restored> {
    let r = local_state::restore(ckpt, from, "diloco", rank, world)?;
    outer.load_state_dict(&r.state)?;
    let joiners = outer.joiners_start();
    let note = local_state::world_change_note(ckpt.meta.world_size, world, &joiners);
    if let Some(note) = note.filter(|_| rank == 0) {
        eprintln!("{program}: DiLoCo {note}");
    }
    Ok(r)
}
