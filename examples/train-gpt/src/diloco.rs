//! What the candle and Burn workers share for the checkpoints of `--hook diloco` /
//! `streaming-diloco`: the library's [`ddprs::hooks::local_state`] (every rank's own
//! inner state gathered beside the outer state) written through train-gpt's [`Saver`], and the
//! resume (`ddp_example_support::diloco::restore`: at the same world size exact, at another —
//! an elastic restart — joining ranks start from the last synchronization).

use crate::saver::Saver;
use ddp_example_support::diloco::{self, Restored};
use ddprs::adapter::{DdpCore, ParamAccess};
use ddprs::hooks::local_state;
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
    let gathered = local_state::gather(core.process_group(), outer.state_dict()?, &local)?;
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

/// Resuming from the DiLoCo checkpoint `ck` (of `dir`) as `rank` of `world`
/// ([`ddp_example_support::diloco::restore`]): the outer state loaded, this rank's part
/// returned — load `local`, then, when not `own`, `DiLoCo::restore_anchor`.
pub fn restore(
    ck: &Checkpoint,
    dir: &Path,
    outer: &mut DiLoCo,
    rank: usize,
    world: usize,
) -> Result<Restored> {
    let from = dir.display().to_string();
    Ok(diloco::restore("train-gpt", ck, &from, outer, rank, world)?)
}
