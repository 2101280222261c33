//! What the candle and Burn workers share for the checkpoints of `--hook localsgd…`,
//! `diloco…` and `streaming-diloco…` (the outer loop, `ddp_example_support::outer::Outer`):
//! every rank's own inner state gathered beside the outer loop's state
//! ([`ddprs::hooks::local_state`]) and written through train-gpt's [`Saver`], and the resume (at
//! the same world size exact; at another — an elastic restart — joining ranks start from a
//! peer's state, under DiLoCo from the last synchronization).

use crate::saver::Saver;
use ddp_example_support::outer::{Outer, Restored};
use ddprs::adapter::{DdpCore, ParamAccess};
use ddprs::{Checkpoint, CheckpointMeta};
use std::path::Path;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Saves the checkpoint of a run with an outer loop of `dir` through `saver` (in the background with
/// `--checkpoint-async`): `inner` writes a rank's parameters and optimizer state into a
/// checkpoint; rank 0's are the checkpoint's model, every rank's go in as blobs, with the outer
/// state of `outer` (its in-flight all-reduces completed). Collectives: every rank calls it at
/// the same step.
pub fn save<P: ParamAccess>(
    saver: &mut Saver,
    core: &DdpCore<P>,
    outer: &mut Outer,
    dir: &Path,
    meta: CheckpointMeta,
    inner: impl Fn(&mut Checkpoint) -> ddprs::Result<()>,
) -> Result<()> {
    let mut local = Checkpoint::new(meta.clone());
    inner(&mut local)?;
    let gathered = outer.gather(core.process_group(), &local)?;
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

/// Resuming from the checkpoint `ck` (of `dir`) of a run with an outer loop, as `rank` of
/// `world` ([`Outer::restore`]): the outer state loaded, this rank's part returned — load
/// `local`, then call [`Outer::joined`].
pub fn restore(
    ck: &Checkpoint,
    dir: &Path,
    outer: &mut Outer,
    rank: usize,
    world: usize,
) -> Result<Restored> {
    let from = dir.display().to_string();
    Ok(outer.restore("train-gpt", ck, &from, rank, world)?)
}
