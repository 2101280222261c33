//! What the candle and Burn workers share for the checkpoints of `--hook diloco` /
//! `streaming-diloco`: the library's [`ddprs::hooks::diloco::checkpoint`] (every rank's own
//! inner state gathered beside the outer state) written through train-gpt's [`Saver`], and the
//! resume at the same world size (exact) or another (an elastic restart: joining ranks start
//! from the last synchronization).

use crate::saver::Saver;
use ddprs::adapter::{DdpCore, ParamAccess};
use ddprs::hooks::diloco::checkpoint::{self, Restored};
use ddprs::hooks::DiLoCo;
use ddprs::{Checkpoint, CheckpointMeta};
use std::path::Path;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Saves a DiLoCo run's checkpoint of `dir` through `saver` (in the background with
/// `--checkpoint-async`): `inner` writes a rank's parameters and optimizer state into a
/// checkpoint; rank 0's are the checkpoint's model, every rank's go in as blobs, with the outer
/// state of `outer` (its in-flight all-reduces completed). Collectives: every rank calls it at
/// the same step.
pub fn save<P: ParamAccess>(
    saver: &mut Saver,
    core: &DdpCore<P>,
    outer: &mut DiLoCo,
    dir: &Path,
    meta: CheckpointMeta,
    inner: impl Fn(&mut Checkpoint) -> ddprs::Result<()>,
) -> Result<()> {
    let mut local = Checkpoint::new(meta.clone());
    inner(&mut local)?;
    let gathered = checkpoint::gather(core.process_group(), outer, &local)?;
    let fill = |ck: &mut Checkpoint| -> ddprs::Result<()> {
        inner(ck)?;
        gathered.store(ck)
    };
    saver.save(meta.step, |background| {
        Ok(match background {
            Some(b) => core.write_checkpoint_async(b, dir, meta, |ck| {
                fill(ck)?;
                Ok(None)
            })?,
            None => {
                core.write_checkpoint(dir, meta, fill)?;
                None
            }
        })
    })
}

/// Resuming from the DiLoCo checkpoint `ck` (of `dir`) as `rank` of `world`: loads the outer
/// state into `outer` and returns this rank's part: load `local` (parameters and optimizer
/// state), then, when not `own` (a rank joining between synchronizations), set the parameters
/// to the anchor with `DiLoCo::restore_anchor`. Rank 0 says so when the world size changed.
pub fn restore(
    ck: &Checkpoint,
    dir: &Path,
    outer: &mut DiLoCo,
    rank: usize,
    world: usize,
) -> Result<Restored> {
    let r = checkpoint::restore(ck, &dir.display().to_string(), outer, rank, world)?;
    let note = checkpoint::world_change_note(ck.meta.world_size, world, outer.last_sync_step());
    if let Some(note) = note.filter(|_| rank == 0) {
        eprintln!("train-gpt: {note}");
    }
    Ok(r)
}
