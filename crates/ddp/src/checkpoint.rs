//! Framework-agnostic training checkpoints, written by rank 0 only and atomically.
//!
//! One checkpoint is one file, `<dir>/checkpoint.safetensors`:
//! - named `f32` tensors (model parameters, and optimizer state under names made by
//!   [`Checkpoint::optim_key`], e.g. `optim.fc1.weight.m`), stored as safetensors (little-endian);
//! - the training position ([`CheckpointMeta`]: step, epoch, sampler state, RNG state, world size and
//!   free-form user JSON) as JSON in the safetensors header metadata under the key `"ddp_meta"`.
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

/// File name of the checkpoint inside its directory.
pub const CHECKPOINT_FILE: &str = "checkpoint.safetensors";

/// Key of the JSON-encoded [`CheckpointMeta`] in the safetensors header metadata.
pub const META_KEY: &str = "ddp_meta";

/// Prefix of optimizer-state tensor names (see [`Checkpoint::optim_key`]).
pub const OPTIM_PREFIX: &str = "optim.";

/// Version of the layout of [`CheckpointMeta`] in the file.
const FORMAT_VERSION: u32 = 1;

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

/// The on-disk form of the metadata: [`CheckpointMeta`] plus a format version.
#[derive(Serialize, Deserialize)]
struct StoredMeta {
    format_version: u32,
    #[serde(flatten)]
    meta: CheckpointMeta,
}

/// A checkpoint: named tensors (parameters and optimizer state) and the training position.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Checkpoint {
    pub tensors: BTreeMap<String, TensorData>,
    pub meta: CheckpointMeta,
}

impl Checkpoint {
    /// An empty checkpoint with the given metadata.
    pub fn new(meta: CheckpointMeta) -> Self {
        Self {
            tensors: BTreeMap::new(),
            meta,
        }
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

    /// Tensors that are not optimizer state (names not starting with `optim.`).
    pub fn params(&self) -> impl Iterator<Item = (&str, &TensorData)> {
        self.tensors
            .iter()
            .filter(|(k, _)| !k.starts_with(OPTIM_PREFIX))
            .map(|(k, v)| (k.as_str(), v))
    }

    /// Encodes the checkpoint as the bytes of a safetensors file.
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        let mut raw: Vec<(&str, Vec<usize>, Vec<u8>)> = Vec::with_capacity(self.tensors.len());
        for (name, t) in &self.tensors {
            t.check(name)?;
            let bytes = t.data.iter().flat_map(|v| v.to_le_bytes()).collect();
            raw.push((name.as_str(), t.shape.clone(), bytes));
        }
        let mut views = Vec::with_capacity(raw.len());
        for (name, shape, bytes) in &raw {
            let view = TensorView::new(Dtype::F32, shape.clone(), bytes).map_err(|e| {
                Error::InvalidArgument(format!("checkpoint tensor {name:?}: {e:?}"))
            })?;
            views.push((*name, view));
        }
        let stored = StoredMeta {
            format_version: FORMAT_VERSION,
            meta: self.meta.clone(),
        };
        let meta_json = serde_json::to_string(&stored)
            .map_err(|e| Error::Checkpoint(format!("cannot encode checkpoint metadata: {e}")))?;
        // A single metadata key keeps the file byte-for-byte deterministic.
        let info = Some(HashMap::from([(META_KEY.to_string(), meta_json)]));
        safetensors::serialize(views, &info)
            .map_err(|e| Error::Checkpoint(format!("cannot encode checkpoint: {e:?}")))
    }

    /// Decodes a checkpoint from safetensors bytes; `origin` names the source in errors.
    pub fn from_bytes(bytes: &[u8], origin: &str) -> Result<Self> {
        let corrupt = |what: String| {
            Error::Checkpoint(format!(
                "{origin}: {what}; the file is corrupted, truncated or not a ddp checkpoint"
            ))
        };
        let (_, header) = SafeTensors::read_metadata(bytes)
            .map_err(|e| corrupt(format!("invalid safetensors data ({e:?})")))?;
        let meta_json = header
            .metadata()
            .as_ref()
            .and_then(|m| m.get(META_KEY))
            .ok_or_else(|| corrupt(format!("no {META_KEY:?} entry in the safetensors metadata")))?;
        let stored: StoredMeta = serde_json::from_str(meta_json)
            .map_err(|e| corrupt(format!("invalid {META_KEY:?} metadata ({e})")))?;
        if stored.format_version != FORMAT_VERSION {
            return Err(Error::Checkpoint(format!(
                "{origin}: checkpoint format version {} is not supported (expected {FORMAT_VERSION})",
                stored.format_version
            )));
        }
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| corrupt(format!("invalid safetensors data ({e:?})")))?;
        let mut tensors = BTreeMap::new();
        for (name, view) in st.tensors() {
            if view.dtype() != Dtype::F32 {
                return Err(Error::Checkpoint(format!(
                    "{origin}: tensor {name:?} has dtype {:?}, only F32 is supported",
                    view.dtype()
                )));
            }
            let data = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            tensors.insert(
                name,
                TensorData {
                    shape: view.shape().to_vec(),
                    data,
                },
            );
        }
        Ok(Self {
            tensors,
            meta: stored.meta,
        })
    }
}

/// Path of the checkpoint file in `dir`.
pub fn checkpoint_path(dir: &Path) -> PathBuf {
    dir.join(CHECKPOINT_FILE)
}

/// Writes `ckpt` to `dir/checkpoint.safetensors` atomically and durably (creating `dir` if
/// needed): temp file in `dir`, write, fsync, rename over the old file, fsync `dir`. Returns the
/// checkpoint's path. Readers see the previous checkpoint or this one, whatever happens.
pub fn save_atomic(dir: &Path, ckpt: &Checkpoint) -> Result<PathBuf> {
    let bytes = ckpt.to_bytes()?;
    fs::create_dir_all(dir).map_err(|e| Error::io("cannot create checkpoint directory", dir, e))?;
    let final_path = checkpoint_path(dir);
    let tmp_path = dir.join(format!("{TEMP_PREFIX}.{}", std::process::id()));
    let result = write_synced(&tmp_path, &bytes).and_then(|()| {
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
/// files of interrupted saves are ignored. A damaged file is an error naming its path.
pub fn load(dir: &Path) -> Result<Option<Checkpoint>> {
    let path = checkpoint_path(dir);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("cannot read checkpoint", &path, e)),
    };
    Checkpoint::from_bytes(&bytes, &path.display().to_string()).map(Some)
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
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
fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("cannot fsync checkpoint directory", dir, e))?;
    #[cfg(not(unix))]
    let _ = dir;
    Ok(())
}
