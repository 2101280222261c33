//! The error type of the framework-agnostic `ddp-core` crate.
//!
//! Communication failures keep their `ddp_comm::Error` (which names the peer rank, collective and
//! sequence number); everything else says which file, tensor, rank or argument is at fault.

use std::path::{Path, PathBuf};

/// Result alias used throughout `ddp-core`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `ddp-core`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
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

    /// An averaged gradient is NaN or infinite (the reducer's finite check,
    /// `Reducer::set_check_finite`). The same error on every rank.
    #[error("non-finite gradient at step {step}: {}", describe_non_finite(.rank, .parameter, .ranks))]
    NonFinite {
        /// The synchronized step (`Reducer::step` numbering: from 0, or from `set_step`).
        step: u64,
        /// The lowest rank whose local gradient was already non-finite; `None` when every
        /// local gradient was finite and the sum overflowed in the reduction.
        rank: Option<usize>,
        /// The parameter: the first non-finite one (in backward order) of `rank`, or the first
        /// non-finite averaged one when `rank` is `None`.
        parameter: String,
        /// Every rank whose local gradients were non-finite, ascending.
        ranks: Vec<usize>,
    },
}

impl Error {
    /// The communication failure this error is, if it is one (e.g. to regroup after a lost
    /// rank: `ddp_comm::Error::lost_peer`).
    pub fn comm(&self) -> Option<&ddp_comm::Error> {
        match self {
            Error::Comm(e) => Some(e),
            _ => None,
        }
    }
}

fn describe_non_finite(rank: &Option<usize>, parameter: &str, ranks: &[usize]) -> String {
    match rank {
        Some(r) => format!(
            "rank {r} produced a NaN or infinite gradient of parameter `{parameter}` (ranks \
             with non-finite local gradients: {ranks:?})"
        ),
        None => format!(
            "the averaged gradient of parameter `{parameter}` is NaN or infinite although \
             every rank's local gradients were finite (overflow in the reduction)"
        ),
    }
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
