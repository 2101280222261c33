//! Where a run of either program resumes from, at any `--zero` stage: the plain checkpoint
//! (written at `--zero 0`, loaded and shared by rank 0) or the directory's save set (written by
//! every rank at `--zero` 1 and up), the newer of the two.

use ddprs::checkpoint::ResumedGlobal;
use std::path::{Path, PathBuf};

/// What a run resumes from: a plain checkpoint (already loaded and shared by rank 0) or the
/// current save set of the directory.
pub enum Source {
    Plain(Box<ResumedGlobal>),
    Set(PathBuf),
}

/// The checkpoint to resume from in `dir`: the newer of the plain checkpoint (`plain`) and the
/// current save set; `None` when there is neither. A directory with a checkpoint never ends as
/// a fresh start, whatever `--zero` the run has.
pub fn resume_source(dir: &Path, plain: Option<ResumedGlobal>) -> ddprs::Result<Option<Source>> {
    let set = ddprs::sharding::set_meta(dir)?;
    Ok(match (plain, set) {
        (Some(p), Some(s)) if s.step > p.checkpoint.meta.step => Some(Source::Set(dir.into())),
        (Some(p), _) => Some(Source::Plain(Box::new(p))),
        (None, Some(_)) => Some(Source::Set(dir.into())),
        (None, None) => None,
    })
}

/// How rank 0 writes a plain checkpoint: synchronously, or through the background writer of
/// `--checkpoint-async` (`ddprs::checkpoint::AsyncCheckpointer`), whose report of an earlier
/// write (failed, or this one skipped) is printed as a warning: training goes on.
pub struct Writer(Option<ddprs::checkpoint::AsyncCheckpointer>);

impl Writer {
    pub fn new(args: &crate::flags::CommonArgs) -> Writer {
        Writer(
            args.checkpoint_async
                .map(ddprs::checkpoint::AsyncCheckpointer::new),
        )
    }

    /// Writes `ckpt` (a snapshot: it owns its values) into `dir`.
    pub fn write(&mut self, dir: &Path, ckpt: ddprs::Checkpoint) -> ddprs::Result<()> {
        let Some(saver) = &mut self.0 else {
            ddprs::checkpoint::save_atomic(dir, &ckpt)?;
            return Ok(());
        };
        let step = ckpt.meta.step;
        let sent = saver.save(dir, step, move || Ok(ckpt));
        if let Some(Err(e)) = sent.finished {
            eprintln!("warning: {e}");
        }
        if !sent.started {
            eprintln!(
                "warning: checkpoint of step {step} skipped: the previous write is still \
                 running (--checkpoint-async skip)"
            );
        }
        Ok(())
    }

    /// Waits for the last background write: an error if it failed.
    pub fn finish(&mut self) -> ddprs::Result<()> {
        match self
            .0
            .as_mut()
            .and_then(ddprs::checkpoint::AsyncCheckpointer::wait)
        {
            Some(Err(e)) => Err(e),
            _ => Ok(()),
        }
    }
}
