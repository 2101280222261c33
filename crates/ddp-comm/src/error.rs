//! The one error type of the communication core.
//!
//! Errors are `Clone` because a failure of one collective is handed to every pending and later
//! operation of the group (a broken group stays broken), and each of them must be able to say
//! which peer, which collective and which sequence number failed.

use crate::fingerprint::Fingerprint;
use std::time::Duration;

/// Result alias used throughout `ddp-comm`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the communication core.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Bad or missing configuration (env vars, init options, ranks, world size).
    #[error("invalid configuration: {0}")]
    Config(String),

    /// A caller passed arguments that cannot work (buffer sizes, ranks out of range, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// An I/O failure that is not attributable to a specific peer rank.
    #[error("{context}: {message}")]
    Io { context: String, message: String },

    /// The store refused this client (wrong or missing shared secret) or broke its protocol.
    #[error("store at {addr}: {message}")]
    Store { addr: String, message: String },

    /// An operation did not finish within its timeout.
    #[error("timed out after {timeout:?} waiting for {what}")]
    Timeout { what: String, timeout: Duration },

    /// A peer rank died, closed its connection, or aborted the group.
    #[error("{fingerprint} #{} failed: peer rank {peer} {reason}", .fingerprint.seq)]
    PeerFailed {
        /// The peer's rank in the group.
        peer: usize,
        /// The collective that failed (with its sequence number).
        fingerprint: Fingerprint,
        /// What the peer did, in words ("closed its connection ...", "aborted the group: ...").
        reason: String,
    },

    /// Ranks issued different collectives (op, dtype, element count or root differ).
    #[error(
        "collective mismatch at #{}: rank {rank} issued {} but rank {peer} issued {}",
        .local.seq,
        describe(Some(.local), .local.seq, .local_bytes),
        describe(.remote.as_ref(), .local.seq, .remote_bytes)
    )]
    Mismatch {
        /// This rank.
        rank: usize,
        /// What this rank issued.
        local: Fingerprint,
        /// The bytes this rank expected, when the mismatch is in a message.
        local_bytes: Option<u64>,
        /// The other rank.
        peer: usize,
        /// What the peer issued; `None` when only its buffer is known.
        remote: Option<Fingerprint>,
        /// The bytes the peer sent or registered, when known.
        remote_bytes: Option<u64>,
    },

    /// A library loaded at run time (libcuda, libnccl) is missing or failed; the message says
    /// which names were tried and what to set (`LD_LIBRARY_PATH`).
    #[error("{library}: {message}")]
    Library {
        /// `libcuda`, `libnccl`, or `CUDA` for a failure inside the CUDA bindings.
        library: &'static str,
        /// What went wrong and what to do.
        message: String,
    },

    /// A CUDA driver or NCCL call failed (not a missing library).
    #[error("{call} failed on rank {rank}: {message}")]
    Device {
        /// The call (`cuMemcpyDtoH`, `ncclAllReduce`, ...) or the collective.
        call: String,
        /// This rank.
        rank: usize,
        /// The error the library reported.
        message: String,
    },

    /// The process group shut down (dropped, or its thread ended) before an operation ran.
    #[error("{0}: the process group shut down before it ran")]
    Shutdown(String),

    /// A bug in the communication core (e.g. a panic on the group's thread), not an I/O error.
    #[error("internal error: {0}")]
    Internal(String),

    /// This process is not a member of the group its job regrouped into (it arrived after the
    /// membership closed, e.g. cut off by a network partition), or the regrouped job is below
    /// its minimum size ([`crate::process_group::regroup`]).
    #[error("regrouping into generation {generation}: {message}")]
    Excluded {
        /// The generation of the group that formed without this process.
        generation: u64,
        /// What happened, in words.
        message: String,
    },

    /// The group was aborted earlier; carries the original cause.
    #[error("process group aborted: {0}")]
    Aborted(Box<Error>),
}

/// One side of a [`Error::Mismatch`]: `all_reduce(sum, f32 x 10) [40 bytes]`, with ` #seq`
/// when the sequence number differs from this rank's `seq`, or `a buffer of N bytes`.
fn describe(fp: Option<&Fingerprint>, seq: u64, bytes: &Option<u64>) -> String {
    let Some(fp) = fp else {
        return format!("a buffer of {} bytes", bytes.unwrap_or(0));
    };
    let mut s = fp.to_string();
    if fp.seq != seq {
        s.push_str(&format!(" #{}", fp.seq));
    }
    if let Some(len) = *bytes {
        s.push_str(&format!(" [{len} bytes]"));
    }
    s
}

impl Error {
    /// An I/O error with a description of what was being done.
    pub fn io(context: impl Into<String>, err: std::io::Error) -> Self {
        Error::Io {
            context: context.into(),
            message: err.to_string(),
        }
    }

    /// A store wait that timed out, told as what it waited for (`rank 1 to join the
    /// rendezvous ...`) instead of the store key; other errors unchanged.
    pub(crate) fn waiting_for(self, what: impl FnOnce() -> String) -> Error {
        match self {
            Error::Timeout { timeout, .. } => Error::Timeout {
                what: what(),
                timeout,
            },
            e => e,
        }
    }

    /// The root cause, looking through [`Error::Aborted`] wrappers.
    pub fn root_cause(&self) -> &Error {
        match self {
            Error::Aborted(inner) => inner.root_cause(),
            other => other,
        }
    }

    /// The peer this failure says is gone (died, was killed, closed its connection, or did not
    /// answer within the timeout), as opposed to one that is alive and aborted the group because
    /// of another failure: what a regrouping reports so that the survivors need not wait out
    /// the membership window.
    pub fn lost_peer(&self) -> Option<usize> {
        match self.root_cause() {
            Error::PeerFailed { peer, reason, .. } if !reason.starts_with("aborted") => Some(*peer),
            _ => None,
        }
    }
}
