//! Integrity of checkpoints: CRC-32 checksums of every tensor and of the metadata, finite tensor
//! values, metadata ranges, and a writability probe of the checkpoint directory.
//!
//! The metadata checksum covers the raw bytes of the `ddp_meta` JSON string itself: the string is
//! written with a last field `"meta_crc32":"00000000"`, the CRC-32 of that whole string is
//! computed, and the zeros are replaced by its 8 lowercase hex digits. A reader zeroes those 8
//! digits again and recomputes. The per-tensor checksums (and shapes) sit in that same JSON under
//! `"tensors"`, so they are covered too.

use std::fs;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{write_synced, CheckpointMeta, TEMP_PREFIX};
use crate::error::{Error, Result};

/// Largest step, epoch or sample count a checkpoint may record (2^53: exact in JSON numbers, in
/// `f64` and far from `u64` overflow, so no arithmetic on a resumed position can wrap).
pub const MAX_COUNT: u64 = 1 << 53;

/// Largest world size a checkpoint may record.
pub const MAX_WORLD_SIZE: usize = 1 << 24;

/// The stored shape and checksum of one tensor (format version 2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(super) struct TensorSum {
    pub shape: Vec<usize>,
    /// CRC-32 (IEEE, as zlib and `crc32fast`) of the little-endian data, 8 lowercase hex digits.
    pub crc32: String,
}

/// CRC-32 of `bytes` as 8 lowercase hex digits.
pub(super) fn crc_hex(bytes: &[u8]) -> String {
    format!("{:08x}", crc32fast::hash(bytes))
}

/// The placeholder a sealed metadata string ends with before [`seal`] fills it in.
pub(super) const UNSEALED: &str = "00000000";
const SEAL_PREFIX: &str = ",\"meta_crc32\":\"";
const SEAL_SUFFIX: &str = "\"}";

/// Fills in the trailing `"meta_crc32":"00000000"` of a JSON object string with the CRC-32 of the
/// string (placeholder in place).
pub(super) fn seal(mut json: String) -> String {
    let at = json.len() - SEAL_SUFFIX.len() - UNSEALED.len();
    debug_assert_eq!(&json[at..at + UNSEALED.len()], UNSEALED);
    let sum = crc_hex(json.as_bytes());
    json.replace_range(at..at + UNSEALED.len(), &sum);
    json
}

/// Checks the seal of a metadata string: `Ok(true)` when it is sealed and the checksum matches,
/// `Ok(false)` when it carries no seal (format version 1), `Err` (a message) when it does not match.
pub(super) fn verify_seal(json: &str) -> std::result::Result<bool, String> {
    let tail = SEAL_PREFIX.len() + UNSEALED.len() + SEAL_SUFFIX.len();
    if json.len() < tail || !json.is_char_boundary(json.len() - tail) {
        return Ok(false);
    }
    let (body, end) = json.split_at(json.len() - tail);
    if !end.starts_with(SEAL_PREFIX) || !end.ends_with(SEAL_SUFFIX) {
        return Ok(false);
    }
    let stored = &end[SEAL_PREFIX.len()..SEAL_PREFIX.len() + UNSEALED.len()];
    let computed = crc_hex(format!("{body}{SEAL_PREFIX}{UNSEALED}{SEAL_SUFFIX}").as_bytes());
    if stored != computed {
        return Err(format!(
            "metadata checksum mismatch (stored crc32 {stored}, computed {computed})"
        ));
    }
    Ok(true)
}

/// An error message when `data` holds a NaN or an infinity, naming the first one.
pub(super) fn non_finite(name: &str, data: &[f32]) -> Option<String> {
    let (i, v) = data.iter().enumerate().find(|(_, v)| !v.is_finite())?;
    let count = data.iter().filter(|v| !v.is_finite()).count();
    Some(format!(
        "tensor {name:?} holds {count} non-finite value(s) ({v} at element {i} of {})",
        data.len()
    ))
}

impl CheckpointMeta {
    /// Checks the ranges of the metadata on its own (every save and load does): counts at most
    /// [`MAX_COUNT`], a world size in `1..=`[`MAX_WORLD_SIZE`], a sampler epoch not after the
    /// training epoch. [`RunPlan::check`](super::RunPlan::check) also checks it against a run.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Checkpoint(format!("invalid metadata: {m}")));
        for (what, v) in [
            ("step", self.step),
            ("epoch", self.epoch),
            ("sampler.epoch", self.sampler.epoch),
            ("sampler.consumed", self.sampler.consumed as u64),
        ] {
            if v > MAX_COUNT {
                return bad(format!("{what} = {v} is out of range (at most 2^53)"));
            }
        }
        if self.world_size == 0 || self.world_size > MAX_WORLD_SIZE {
            return bad(format!(
                "world_size = {} is out of range (1 to {MAX_WORLD_SIZE})",
                self.world_size
            ));
        }
        if self.sampler.epoch > self.epoch {
            return bad(format!(
                "sampler.epoch = {} is after epoch = {}",
                self.sampler.epoch, self.epoch
            ));
        }
        Ok(())
    }
}

/// Makes sure checkpoints can be written to `dir` (creating it if needed): writes, fsyncs and
/// removes a small probe file there. Call it before training starts, so that an unwritable
/// directory (read-only, a path through a regular file, full disk, ...) is an error at once
/// instead of after the first epoch. [`resume_or_start`](super::resume_or_start) calls it on rank 0.
///
/// It also takes the directory's lock for the rest of the process ([`lock_dir`](super::lock_dir)):
/// a second job pointed at the same directory is refused, naming the holder.
///
/// It also removes the temporary files of interrupted saves and probes (a writer killed between
/// creating its file and renaming or removing it, e.g. a rank 0 that died with its launcher:
/// found by the fault-injection suite, `crates/ddprun/tests/chaos.rs`), which would otherwise stay
/// for ever and fill a small disk: at the start of a run no save of the job is in flight.
pub fn ensure_writable(dir: &Path) -> Result<()> {
    const WHY: &str = "checkpoint directory is not writable:";
    fs::create_dir_all(dir).map_err(|e| Error::io(format!("{WHY} cannot create"), dir, e))?;
    super::lock::lock_dir(dir)?;
    remove_stale_temporaries(dir);
    probe_writable(dir)
}

/// Writes, fsyncs and removes a probe file in the existing directory `dir` (no lock, no clean-up:
/// what ranks other than the one holding the lock check before a sharded save).
pub(crate) fn probe_writable(dir: &Path) -> Result<()> {
    const WHY: &str = "checkpoint directory is not writable:";
    let probe = dir.join(format!("{PROBE_PREFIX}.{}", std::process::id()));
    let written = write_synced(&probe, b"ddp checkpoint directory probe\n");
    let removed = fs::remove_file(&probe);
    written.map_err(|e| match e {
        Error::Io { source, .. } => Error::io(format!("{WHY} cannot write a file in"), dir, source),
        other => other,
    })?;
    removed.map_err(|e| Error::io(format!("{WHY} cannot remove a file in"), dir, e))
}

/// Prefix of [`ensure_writable`]'s probe files.
const PROBE_PREFIX: &str = ".ddp-write-probe";

/// Remove the temporary files (`.checkpoint.safetensors.tmp.PID`, `.ddp-write-probe.PID`) that
/// interrupted saves and probes left in `dir`; returns how many. Errors are ignored: a file that
/// cannot be removed does no harm beyond its space.
fn remove_stale_temporaries(dir: &Path) -> usize {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let stale = [TEMP_PREFIX, PROBE_PREFIX].iter().any(|p| {
            name.strip_prefix(p)
                .is_some_and(|rest| rest.starts_with('.'))
        });
        if stale && fs::remove_file(entry.path()).is_ok() {
            tracing::info!(
                "removed {}, left by an interrupted checkpoint save",
                entry.path().display()
            );
            removed += 1;
        }
    }
    removed
}
