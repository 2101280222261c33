//! Framework-agnostic training checkpoints, written by rank 0 only and atomically.
//!
//! One checkpoint is one file, `<dir>/checkpoint.safetensors`:
//! - named `f32` tensors (model parameters, and optimizer state under names made by
//!   [`Checkpoint::optim_key`], e.g. `optim.fc1.weight.exp_avg`), stored as safetensors
//!   (little-endian);
//! - the training position ([`CheckpointMeta`]: step, epoch, sampler state, RNG state, world size and
//!   free-form user JSON) as JSON in the safetensors header metadata under the key `"ddp_meta"`;
//! - (format version 2) a CRC-32 of every tensor's data, with its shape, and of the metadata
//!   itself, in the same JSON (see module [`integrity`]); the optimizer's step, kind and
//!   hyper-parameters ([`OptimizerRecord`]) under `"optimizer"`.
//!
//! Loading verifies everything before anything is used: a flipped bit in a tensor is an error
//! naming the tensor, one in the metadata an error about the metadata; a NaN or infinity in a
//! tensor is an error naming it (saving refuses them too); the metadata must be in range
//! ([`CheckpointMeta::validate`]). Checkpoints of format version 1 (no checksums) still load, with
//! a `tracing` warning. [`RunPlan::check`] then checks the position against the run being resumed
//! (step, epoch and sampler position consistent with the data and with each other, not past the
//! end), and [`ensure_writable`] checks the directory before training starts.
//!
//! Optimizers implement [`OptimizerState`] (a framework-agnostic state: named host tensors, step,
//! hyper-parameters); [`resume_or_start`] is the one call a training program makes at start (rank
//! 0 checks the directory, loads and shares the checkpoint, every rank checks it against its
//! [`RunPlan`]). A run whose world size changes (an elastic job) resumes by the global sampler
//! position instead: [`resume_or_start_global`], [`RunPlan::check_global`] (module `elastic`).
//!
//! Frameworks with serializers of their own (Burn's burnpack records) store their bytes as named
//! *blobs* ([`Checkpoint::insert_blob`]): `U8` tensors in the same file, checksummed like the
//! tensors, so they share the atomic update, the verification and [`resume_or_start`].
//!
//! Keeping everything in one file makes the update a single atomic rename: [`save_atomic`] writes a
//! temporary file in the same directory, fsyncs it, renames it over the old checkpoint and fsyncs the
//! directory. A crash at any point leaves either the old or the new checkpoint, never a torn one or
//! a parameters/metadata pair from two different steps. Any file written by safetensors-aware tools
//! (Python's `safetensors.torch.load_file`, candle) can read the tensors.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::sampler::SamplerState;

pub mod async_save;
mod elastic;
pub mod integrity;
mod lock;
mod resume;

pub use async_save::{AsyncCheckpointer, Submitted, WhenBusy, Written};
pub use elastic::{
    global_consumed, resume_or_start_global, GlobalPosition, ResumePoint, ResumedGlobal,
    GLOBAL_CONSUMED_KEY,
};
pub use integrity::{ensure_writable, MAX_COUNT, MAX_WORLD_SIZE};
pub use lock::{lock_dir, LOCK_FILE};
pub use resume::{
    broadcast, resume_or_start, OptimizerRecord, OptimizerState, OptimizerStateDict, Resumed,
    RunPlan, TrainingState,
};

use integrity::{crc_hex, non_finite, seal, verify_seal, TensorSum, UNSEALED};

/// File name of the checkpoint inside its directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.safetensors";

/// Key of the JSON-encoded [`CheckpointMeta`] in the safetensors header metadata.
pub const META_KEY: &str = "ddp_meta";

/// Prefix of optimizer-state tensor names (see [`Checkpoint::optim_key`]).
pub const OPTIM_PREFIX: &str = "optim.";

/// Prefix of comm hook state tensor names (see [`Checkpoint::save_hook_state`]).
pub const HOOK_PREFIX: &str = "hook.";

/// Version of the layout of the metadata in the file: 2 adds checksums and the optimizer record.
pub const FORMAT_VERSION: u32 = 2;

/// The version before checksums, still read (with a warning).
const LEGACY_VERSION: u32 = 1;

/// Prefix of temporary files; they are never read by [`load`].
const TEMP_PREFIX: &str = ".checkpoint.safetensors.tmp";

/// A dense `f32` tensor: row-major `data` of `shape`.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorData {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl TensorData {
    /// A tensor, checking that `data.len()` is the product of `shape` (1 for a scalar `[]`).
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Result<Self> {
        let t = Self { shape, data };
        t.check("<new tensor>")?;
        Ok(t)
    }

    /// Number of elements the shape implies.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn check(&self, name: &str) -> Result<()> {
        if self.numel() != self.data.len() {
            return Err(Error::InvalidArgument(format!(
                "checkpoint tensor {name:?}: shape {:?} has {} elements but data has {}",
                self.shape,
                self.numel(),
                self.data.len()
            )));
        }
        Ok(())
    }
}

/// Where training stands, stored beside the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    /// Optimizer steps completed.
    pub step: u64,
    /// Current epoch.
    pub epoch: u64,
    /// Sampler position (epoch and indices consumed by each rank in that epoch).
    pub sampler: SamplerState,
    /// State or seed of the training RNG (dropout, augmentation, ...), to continue its stream.
    pub rng_state: u64,
    /// World size of the run that wrote the checkpoint; resuming mid-epoch needs the same one.
    pub world_size: usize,
    /// Free-form user data (hyper-parameters, metrics, ...); `null` when unused.
    #[serde(default)]
    pub extra: serde_json::Value,
}

impl Default for CheckpointMeta {
    fn default() -> Self {
        Self {
            step: 0,
            epoch: 0,
            sampler: SamplerState::default(),
            rng_state: 0,
            world_size: 1,
            extra: serde_json::Value::Null,
        }
    }
}

impl CheckpointMeta {
    /// Errors with [`Error::Mismatch`] when the checkpoint was written by a run of another world
    /// size (the sampler position then means nothing for this run).
    pub fn check_world_size(&self, world_size: usize) -> Result<()> {
        if self.world_size != world_size {
            return Err(Error::Mismatch(format!(
                "checkpoint was written with world_size {} but this run has world_size {world_size}; \
                 resume with the same number of processes",
                self.world_size
            )));
        }
        Ok(())
    }
}

/// The on-disk form of the metadata as written: [`CheckpointMeta`], a format version, the
/// optimizer record, the tensor checksums and (last) the metadata checksum.
#[derive(Serialize)]
struct StoredMetaOut<'a> {
    format_version: u32,
    #[serde(flatten)]
    meta: &'a CheckpointMeta,
    #[serde(skip_serializing_if = "Option::is_none")]
    optimizer: Option<&'a OptimizerRecord>,
    tensors: BTreeMap<&'a str, TensorSum>,
    meta_crc32: &'static str,
}

/// The on-disk form of the metadata as read (version 1 has neither checksums nor record).
#[derive(Deserialize)]
struct StoredMetaIn {
    format_version: u32,
    #[serde(flatten)]
    meta: CheckpointMeta,
    #[serde(default)]
    optimizer: Option<OptimizerRecord>,
    #[serde(default)]
    tensors: Option<BTreeMap<String, TensorSum>>,
}

/// A checkpoint: named tensors (parameters and optimizer state), the training position and the
/// optimizer's scalars.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Checkpoint {
    pub tensors: BTreeMap<String, TensorData>,
    pub meta: CheckpointMeta,
    /// Step, kind and hyper-parameters of the optimizer (see [`Checkpoint::save_optimizer`]).
    pub optimizer: Option<OptimizerRecord>,
    /// Named opaque byte strings (a framework's own serialized records; see
    /// [`Checkpoint::insert_blob`]), stored as `U8` tensors and checksummed like the tensors.
    pub blobs: BTreeMap<String, Vec<u8>>,
}

impl Checkpoint {
    /// An empty checkpoint with the given metadata.
    pub fn new(meta: CheckpointMeta) -> Self {
        Self {
            tensors: BTreeMap::new(),
            meta,
            optimizer: None,
            blobs: BTreeMap::new(),
        }
    }

    /// Adds (or replaces) a named byte string, e.g. a framework's serialized model record. Its
    /// name must not be a tensor's (checked on save).
    pub fn insert_blob(&mut self, name: impl Into<String>, bytes: Vec<u8>) {
        self.blobs.insert(name.into(), bytes);
    }

    /// The byte string called `name`, or an error naming it.
    pub fn require_blob(&self, name: &str) -> Result<&[u8]> {
        self.blobs.get(name).map(Vec::as_slice).ok_or_else(|| {
            Error::Mismatch(format!(
                "checkpoint has no blob {name:?} (it has {} blobs: {:?})",
                self.blobs.len(),
                self.blobs.keys().collect::<Vec<_>>()
            ))
        })
    }

    /// The tensor name of optimizer state `slot` (e.g. `"m"`, `"v"`, `"momentum"`) of parameter
    /// `param`: `optim.<param>.<slot>`.
    pub fn optim_key(param: &str, slot: &str) -> String {
        format!("{OPTIM_PREFIX}{param}.{slot}")
    }

    /// Adds (or replaces) a tensor, checking its shape against its data.
    pub fn insert(
        &mut self,
        name: impl Into<String>,
        shape: Vec<usize>,
        data: Vec<f32>,
    ) -> Result<()> {
        let name = name.into();
        let t = TensorData { shape, data };
        t.check(&name)?;
        self.tensors.insert(name, t);
        Ok(())
    }

    /// The tensor called `name`, if any.
    pub fn get(&self, name: &str) -> Option<&TensorData> {
        self.tensors.get(name)
    }

    /// The tensor called `name`, or an error naming it (for restoring a model that needs it).
    pub fn require(&self, name: &str) -> Result<&TensorData> {
        self.tensors.get(name).ok_or_else(|| {
            Error::Mismatch(format!(
                "checkpoint has no tensor {name:?} (it has {} tensors)",
                self.tensors.len()
            ))
        })
    }

    /// Tensors that are neither optimizer nor comm hook state (names starting with neither
    /// `optim.` nor `hook.`).
    pub fn params(&self) -> impl Iterator<Item = (&str, &TensorData)> {
        self.tensors
            .iter()
            .filter(|(k, _)| !k.starts_with(OPTIM_PREFIX) && !k.starts_with(HOOK_PREFIX))
            .map(|(k, v)| (k.as_str(), v))
    }

    /// Encodes the checkpoint as the bytes of a safetensors file, with checksums. Refuses (naming
    /// the culprit) metadata out of range and tensors holding a NaN or an infinity, which could not
    /// be loaded back.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let refuse = |m: String| Error::InvalidArgument(format!("cannot save checkpoint: {m}"));
        self.meta.validate().map_err(|e| refuse(e.to_string()))?;
        let mut raw: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> =
            Vec::with_capacity(self.tensors.len() + self.blobs.len());
        let mut sums = BTreeMap::new();
        for (name, t) in &self.tensors {
            t.check(name)?;
            if let Some(m) = non_finite(name, &t.data) {
                return Err(refuse(m));
            }
            let bytes: Vec<u8> = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
            let sum = TensorSum {
                shape: t.shape.clone(),
                crc32: crc_hex(&bytes),
            };
            sums.insert(name.as_str(), sum);
            raw.push((name.as_str(), Dtype::F32, t.shape.clone(), bytes));
        }
        for (name, bytes) in &self.blobs {
            if self.tensors.contains_key(name) {
                return Err(refuse(format!(
                    "{name:?} is both a tensor and a blob; names must be unique"
                )));
            }
            let sum = TensorSum {
                shape: vec![bytes.len()],
                crc32: crc_hex(bytes),
            };
            sums.insert(name.as_str(), sum);
            raw.push((name.as_str(), Dtype::U8, vec![bytes.len()], bytes.clone()));
        }
        let mut views = Vec::with_capacity(raw.len());
        for (name, dtype, shape, bytes) in &raw {
            let view = TensorView::new(*dtype, shape.clone(), bytes).map_err(|e| {
                Error::InvalidArgument(format!("checkpoint tensor {name:?}: {e:?}"))
            })?;
            views.push((*name, view));
        }
        let stored = StoredMetaOut {
            format_version: FORMAT_VERSION,
            meta: &self.meta,
            optimizer: self.optimizer.as_ref(),
            tensors: sums,
            meta_crc32: UNSEALED,
        };
        let meta_json = serde_json::to_string(&stored)
            .map_err(|e| Error::Checkpoint(format!("cannot encode checkpoint metadata: {e}")))?;
        let meta_json = seal(meta_json);
        // A single metadata key keeps the file byte-for-byte deterministic.
        let info = Some(HashMap::from([(META_KEY.to_string(), meta_json)]));
        safetensors::serialize(views, &info)
            .map_err(|e| Error::Checkpoint(format!("cannot encode checkpoint: {e:?}")))
    }

    /// Decodes a checkpoint from safetensors bytes; `origin` names the source in errors. Verifies
    /// the checksums (format 2; format 1 loads with a warning), that every tensor is finite and
    /// that the metadata is in range.
    pub fn from_bytes(bytes: &[u8], origin: &str) -> Result<Self> {
        let corrupt = |what: String| {
            Error::Checkpoint(format!(
                "{origin}: {what}; the file is corrupted, truncated or not a ddp checkpoint"
            ))
        };
        check_offsets(bytes).map_err(corrupt)?;
        let (_, header) = SafeTensors::read_metadata(bytes)
            .map_err(|e| corrupt(format!("invalid safetensors data ({e:?})")))?;
        let meta_json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(META_KEY))
            .ok_or_else(|| corrupt(format!("no {META_KEY:?} entry in the safetensors metadata")))?;
        // The version first, on its own: a later format may change everything else, and must
        // be named as such, not as corruption.
        #[derive(Deserialize)]
        struct Version {
            format_version: u32,
        }
        if let Ok(Version { format_version: v }) = serde_json::from_str(meta_json) {
            if v > FORMAT_VERSION {
                return Err(Error::Checkpoint(format!(
                    "{origin}: checkpoint format version {v} was written by a newer ddp-rs; this \
                     release reads versions {LEGACY_VERSION} to {FORMAT_VERSION} (see the \
                     versioning chapter of the book)"
                )));
            }
        }
        let sealed = verify_seal(meta_json).map_err(corrupt)?;
        let stored: StoredMetaIn = serde_json::from_str(meta_json)
            .map_err(|e| corrupt(format!("invalid {META_KEY:?} metadata ({e})")))?;
        let sums = match (stored.format_version, sealed, stored.tensors) {
            (FORMAT_VERSION, true, Some(sums)) => Some(sums),
            (FORMAT_VERSION, ..) => {
                return Err(corrupt(
                    "format version 2 metadata without its checksums".to_string(),
                ))
            }
            (LEGACY_VERSION, false, None) if stored.optimizer.is_none() => {
                tracing::warn!(
                    "{origin}: checkpoint of format version 1 has no checksums; loading it \
                     unverified (the next save writes version {FORMAT_VERSION})"
                );
                None
            }
            (LEGACY_VERSION, ..) => {
                return Err(corrupt(
                    "format version 1 metadata with fields of a later version".to_string(),
                ))
            }
            (v, ..) => {
                return Err(Error::Checkpoint(format!(
                    "{origin}: checkpoint format version {v} is not supported (expected \
                     {FORMAT_VERSION} or {LEGACY_VERSION})"
                )))
            }
        };
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| corrupt(format!("invalid safetensors data ({e:?})")))?;
        let mut tensors = BTreeMap::new();
        let mut blobs = BTreeMap::new();
        for (name, view) in st.tensors() {
            if !matches!(view.dtype(), Dtype::F32 | Dtype::U8) {
                return Err(Error::Checkpoint(format!(
                    "{origin}: tensor {name:?} has dtype {:?}, only F32 (and U8 blobs) are \
                     supported",
                    view.dtype()
                )));
            }
            if let Some(sums) = &sums {
                let sum = sums.get(&name).ok_or_else(|| {
                    corrupt(format!("tensor {name:?} is not listed in the checksums"))
                })?;
                let crc = crc_hex(view.data());
                if sum.shape != view.shape() || sum.crc32 != crc {
                    return Err(corrupt(format!(
                        "tensor {name:?} fails its checksum (stored shape {:?} crc32 {}, found \
                         shape {:?} crc32 {crc})",
                        sum.shape,
                        sum.crc32,
                        view.shape()
                    )));
                }
            }
            if view.dtype() == Dtype::U8 {
                blobs.insert(name, view.data().to_vec());
                continue;
            }
            let data: Vec<f32> = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            if let Some(m) = non_finite(&name, &data) {
                return Err(Error::Checkpoint(format!(
                    "{origin}: {m}; refusing to load non-finite values"
                )));
            }
            tensors.insert(
                name,
                TensorData {
                    shape: view.shape().to_vec(),
                    data,
                },
            );
        }
        if let Some(missing) = sums
            .iter()
            .flat_map(|s| s.keys())
            .find(|k| !tensors.contains_key(*k) && !blobs.contains_key(*k))
        {
            return Err(corrupt(format!("tensor {missing:?} is listed but missing")));
        }
        stored
            .meta
            .validate()
            .map_err(|e| Error::Checkpoint(format!("{origin}: {e}")))?;
        if let Some(o) = stored.optimizer.as_ref().filter(|o| o.step > MAX_COUNT) {
            return Err(Error::Checkpoint(format!(
                "{origin}: invalid metadata: optimizer step {} is out of range",
                o.step
            )));
        }
        Ok(Self {
            tensors,
            meta: stored.meta,
            optimizer: stored.optimizer,
            blobs,
        })
    }
}

/// Checks that no tensor's data offsets reach past the end of the file, before safetensors reads
/// the header: safetensors 0.4 adds the largest offset to the header length unchecked, which a
/// forged header turns into an overflow (a panic in builds with overflow checks, a wrapped
/// length otherwise). Found by `tests/fuzz.rs`.
fn check_offsets(bytes: &[u8]) -> std::result::Result<(), String> {
    let Some(head) = bytes.get(..8) else {
        return Err(format!(
            "{} bytes, shorter than a safetensors header",
            bytes.len()
        ));
    };
    let n = u64::from_le_bytes(head.try_into().expect("8 bytes"));
    let after = (bytes.len() - 8) as u64;
    if n > after {
        return Err(format!(
            "the header claims {n} bytes but only {after} follow its length"
        ));
    }
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n as usize])
        .map_err(|e| format!("the safetensors header is not JSON ({e})"))?;
    let data = after - n;
    for (name, t) in header.as_object().into_iter().flatten() {
        let offsets = t.get("data_offsets").and_then(|o| o.as_array());
        for end in offsets.into_iter().flatten().filter_map(|v| v.as_u64()) {
            if end > data {
                return Err(format!(
                    "tensor {name:?} claims data up to byte {end}, the file holds {data}"
                ));
            }
        }
    }
    Ok(())
}

/// Path of the checkpoint file in `dir`.
pub fn checkpoint_path(dir: &Path) -> PathBuf {
    dir.join(CHECKPOINT_FILE)
}

/// Writes `ckpt` to `dir/checkpoint.safetensors` atomically and durably (creating `dir` if
/// needed): temp file in `dir`, write, fsync, rename over the old file, fsync `dir`. Returns the
/// checkpoint's path. Readers see the previous checkpoint or this one, whatever happens.
pub fn save_atomic(dir: &Path, ckpt: &Checkpoint) -> Result<PathBuf> {
    save_atomic_paused(dir, ckpt, None)
}

/// [`save_atomic`], sleeping `pause` between the temporary file and the rename (fault drills:
/// [`async_save::WRITE_PAUSE_ENV`]).
pub(crate) fn save_atomic_paused(
    dir: &Path,
    ckpt: &Checkpoint,
    pause: Option<std::time::Duration>,
) -> Result<PathBuf> {
    let bytes = ckpt.to_bytes()?;
    fs::create_dir_all(dir).map_err(|e| Error::io("cannot create checkpoint directory", dir, e))?;
    let final_path = checkpoint_path(dir);
    let tmp_path = dir.join(format!("{TEMP_PREFIX}.{}", std::process::id()));
    let result = write_synced(&tmp_path, &bytes).and_then(|()| {
        if let Some(p) = pause {
            std::thread::sleep(p);
        }
        fs::rename(&tmp_path, &final_path).map_err(|e| {
            Error::io(
                format!("cannot rename {} to", tmp_path.display()),
                &final_path,
                e,
            )
        })
    });
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp_path);
        return Err(e);
    }
    sync_dir(dir)?;
    tracing::debug!(
        path = %final_path.display(),
        step = ckpt.meta.step,
        bytes = bytes.len(),
        "checkpoint saved"
    );
    Ok(final_path)
}

/// [`save_atomic`] on rank 0, nothing elsewhere (returns the path on rank 0, `None` on the others).
/// Ranks that read the checkpoint afterwards must wait for rank 0 first (e.g. a barrier).
pub fn save_if_rank0(rank: usize, dir: &Path, ckpt: &Checkpoint) -> Result<Option<PathBuf>> {
    if rank == 0 {
        save_atomic(dir, ckpt).map(Some)
    } else {
        Ok(None)
    }
}

/// Loads `dir/checkpoint.safetensors`; `Ok(None)` when there is none (a fresh run). Temporary
/// files of interrupted saves are ignored. A damaged file (checksum, non-finite value, metadata
/// out of range; see [`Checkpoint::from_bytes`]) is an error naming its path.
pub fn load(dir: &Path) -> Result<Option<Checkpoint>> {
    let path = checkpoint_path(dir);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("cannot read checkpoint", &path, e)),
    };
    Checkpoint::from_bytes(&bytes, &path.display().to_string()).map(Some)
}

pub(crate) fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(|e| Error::io("cannot create temporary checkpoint file", path, e))?;
    f.write_all(bytes)
        .map_err(|e| Error::io("cannot write temporary checkpoint file", path, e))?;
    f.sync_all()
        .map_err(|e| Error::io("cannot fsync temporary checkpoint file", path, e))
}

/// Makes the rename durable: fsync the directory entry (a no-op where directories can't be opened).
pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("cannot fsync checkpoint directory", dir, e))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}
