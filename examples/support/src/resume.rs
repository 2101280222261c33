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
