//! The error type of the framework-agnostic `ddp` crate.
//!
//! Communication failures keep their `ddp_comm::Error` (which names the peer rank, collective and
//! sequence number); everything else says which file, tensor, rank or argument is at fault.

use std::path::{Path, PathBuf};

/// Result alias used throughout `ddp`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `ddp`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A collective or the process group failed.
    #[error(transparent)]
    Comm(#[from] ddp_comm::Error),

    /// A file-system operation failed; `context` says what was being done to `path`.
    #[error("{context} {}: {source}", path.display())]
    Io {
        context: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A checkpoint file is corrupted, truncated, or not one of ours (the message names the file).
    #[error("checkpoint error: {0}")]
    Checkpoint(String),

    /// Ranks (or a checkpoint and the running job) disagree about something that must match.
    #[error("mismatch: {0}")]
    Mismatch(String),

    /// A caller passed arguments that cannot work.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl Error {
    /// An I/O error with what was being done (`context`) and the file or directory involved.
    pub fn io(context: impl Into<String>, path: impl AsRef<Path>, source: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            path: path.as_ref().to_path_buf(),
            source,
        }
    }
}
