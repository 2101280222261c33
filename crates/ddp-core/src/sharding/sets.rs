//! Sharded checkpoints that resume on any world size.
//!
//! A save set is a directory `zero-step<step>-<run id>/` holding one checkpoint per rank
//! (`rank<r>/checkpoint.safetensors`, the checksummed format of [`crate::checkpoint`]) with the
//! parameter values and optimizer state of that rank's chunks, and `index.json` written by rank 0
//! (world size, run id, parameter names and shapes, step and sampler position, optimizer kind,
//! step and hyper-parameters). The file `zero_latest` names the current set; it is replaced
//! atomically (write, fsync, rename, fsync the directory) only after every rank's shard and the
//! index are durable, so a crash mid-save leaves the previous set loadable.
//!
//! Shards are stored in *parameter space*: tensor `<param>@<start>` holds elements
//! `[start, start + len)` of a parameter, `<param>@<start>#<slot>` its optimizer state
//! (`exp_avg`, `momentum_buffer`, ...). Loading at another world size cuts the same elements
//! along the new [`ShardLayout`]: every rank reads the segments that overlap its new chunks.
//!
//! ```text
//!   saved at N = 4          parameter space            loaded at M = 2
//!   rank0 rank1 rank2 rank3 ─► [ w1 ........ | b1 ..] ─► rank0        rank1
//! ```
//!
//! [`consolidate`] writes what DDP writes (one plain checkpoint with every parameter and
//! `optim.<param>.<slot>`), [`import`] cuts a plain checkpoint into this rank's shard.

use super::layout::ShardLayout;
use crate::checkpoint::{
    self, sync_dir, write_synced, Checkpoint, CheckpointMeta, OptimizerRecord, OptimizerStateDict,
};
use crate::error::{Error, Result};
use crate::reducer::ParamSpec;
use ddp_comm::ProcessGroup;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// File naming the current save set.
pub const LATEST_FILE: &str = "zero_latest";
/// The index of a save set.
pub const INDEX_FILE: &str = "index.json";
const FORMAT: &str = "ddp-zero-1";
const SET_PREFIX: &str = "zero-step";

/// One owned chunk's values: the parameters and each optimizer state slot (flat, chunk order).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChunkState {
    pub params: Vec<f32>,
    /// Slot name (`exp_avg`, `momentum_buffer`, ...) to values; a slot the optimizer has not
    /// created yet (SGD momentum before the first step) is absent.
    pub slots: BTreeMap<String, Vec<f32>>,
}

/// Everything one rank holds of a sharded run: one [`ChunkState`] per chunk of its
/// [`ShardLayout`] (in `ShardLayout::chunks` order, empty chunks included) and the optimizer's
/// scalars.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ShardState {
    pub optimizer: OptimizerRecord,
    pub chunks: Vec<ChunkState>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct IndexParam {
    name: String,
    shape: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Index {
    format: String,
    run_id: String,
    world_size: usize,
    meta: CheckpointMeta,
    optimizer: OptimizerRecord,
    params: Vec<IndexParam>,
}

fn seg_key(name: &str, start: usize, slot: Option<&str>) -> String {
    match slot {
        None => format!("{name}@{start}"),
        Some(s) => format!("{name}@{start}#{s}"),
    }
}

fn parse_key(key: &str) -> Option<(&str, usize, Option<&str>)> {
    let (name, rest) = key.rsplit_once('@')?;
    let (start, slot) = match rest.split_once('#') {
        Some((s, slot)) => (s, Some(slot)),
        None => (rest, None),
    };
    Some((name, start.parse().ok()?, slot))
}

/// Parameter-space segments: `(param name, slot)` to `(start, values)`.
#[derive(Default)]
struct Segments(BTreeMap<SegmentKey, Vec<(usize, Vec<f32>)>>);

/// `(parameter name, optimizer slot)`; no slot for the parameter values.
type SegmentKey = (String, Option<String>);

impl Segments {
    fn add(&mut self, name: &str, slot: Option<&str>, start: usize, values: Vec<f32>) {
        self.0
            .entry((name.to_string(), slot.map(str::to_string)))
            .or_default()
            .push((start, values));
    }

    fn slots(&self) -> Vec<String> {
        let mut s: Vec<String> = self.0.keys().filter_map(|(_, s)| s.clone()).collect();
        s.sort();
        s.dedup();
        s
    }

    /// Elements `[start, start + out.len())` of `(name, slot)`: `Ok(false)` when none of them
    /// is stored, an error when only some are.
    fn read(&self, name: &str, slot: Option<&str>, start: usize, out: &mut [f32]) -> Result<bool> {
        let end = start + out.len();
        let mut covered = 0;
        if let Some(segs) = self.0.get(&(name.to_string(), slot.map(str::to_string))) {
            for (s, v) in segs {
                let lo = start.max(*s);
                let hi = end.min(s + v.len());
                if lo < hi {
                    out[lo - start..hi - start].copy_from_slice(&v[lo - s..hi - s]);
                    covered += hi - lo;
                }
            }
        }
        if covered == out.len() || (covered == 0 && slot.is_some()) {
            return Ok(covered == out.len());
        }
        let what = slot.map_or("values".to_string(), |s| format!("optimizer state `{s}`"));
        Err(Error::Checkpoint(format!(
            "the checkpoint holds {covered} of elements [{start}, {end}) of the {what} of \
             parameter `{name}` (a shard is missing or from another run)"
        )))
    }

    /// This rank's chunks under `layout`.
    fn fill(&self, layout: &ShardLayout, specs: &[ParamSpec]) -> Result<Vec<ChunkState>> {
        let slots = self.slots();
        layout
            .chunks()
            .iter()
            .map(|c| {
                let pieces = layout.pieces(c);
                let mut out = ChunkState {
                    params: vec![0.0; c.len()],
                    slots: BTreeMap::new(),
                };
                for p in &pieces {
                    let dst = &mut out.params[p.chunk_offset..p.chunk_offset + p.len];
                    self.read(&specs[p.param].name, None, p.param_offset, dst)?;
                }
                for slot in &slots {
                    let mut v = vec![0.0; c.len()];
                    let mut found = Vec::new();
                    for p in &pieces {
                        let dst = &mut v[p.chunk_offset..p.chunk_offset + p.len];
                        found.push(self.read(
                            &specs[p.param].name,
                            Some(slot),
                            p.param_offset,
                            dst,
                        )?);
                    }
                    if found.iter().all(|&f| f) && !found.is_empty() {
                        out.slots.insert(slot.clone(), v);
                    } else if found.iter().any(|&f| f) {
                        let name =
                            &specs[pieces[found.iter().position(|f| !f).unwrap_or(0)].param].name;
                        return Err(Error::Checkpoint(format!(
                            "optimizer state `{slot}` is missing for parameter `{name}` but \
                             present for others in the same chunk"
                        )));
                    }
                }
                Ok(out)
            })
            .collect()
    }
}

fn check_model(index: &Index, specs: &[ParamSpec], origin: &Path) -> Result<()> {
    let want: Vec<IndexParam> = specs
        .iter()
        .map(|s| IndexParam {
            name: s.name.clone(),
            shape: s.shape.clone(),
        })
        .collect();
    if want == index.params {
        return Ok(());
    }
    let saved: BTreeMap<&str, &Vec<usize>> = index
        .params
        .iter()
        .map(|p| (p.name.as_str(), &p.shape))
        .collect();
    let detail = want
        .iter()
        .find_map(|p| match saved.get(p.name.as_str()) {
            None => Some(format!("parameter `{}` is not in the checkpoint", p.name)),
            Some(s) if **s != p.shape => Some(format!(
                "parameter `{}` has shape {:?} in the checkpoint and {:?} in this model",
                p.name, s, p.shape
            )),
            _ => None,
        })
        .unwrap_or_else(|| {
            format!(
                "the checkpoint has {} parameters, this model {}",
                index.params.len(),
                want.len()
            )
        });
    Err(Error::Mismatch(format!(
        "{} is a checkpoint of another model: {detail}",
        origin.display()
    )))
}

/// Every rank's `result` agreed on: an error on any rank fails every rank (a collective). A
/// rank that did not fail gets an error naming the ranks that did and the first one's reason
/// (at most [`AGREE_REASON_CHARS`] characters of it), so whichever rank's error a launcher
/// reports first says what went wrong.
pub fn agree<T>(pg: &ProcessGroup, what: &str, result: Result<T>) -> Result<T> {
    let mine = match &result {
        Ok(_) => Vec::new(),
        Err(e) => {
            let text = e.to_string();
            let mut cut: String = text.chars().take(AGREE_REASON_CHARS).collect();
            if cut.len() < text.len() {
                cut.push_str("...");
            }
            // Never empty: an empty message means success.
            format!("!{cut}").into_bytes()
        }
    };
    let all = pg.all_gather_bytes(&mine)?;
    let failed: Vec<usize> = (0..all.len()).filter(|&r| !all[r].is_empty()).collect();
    match result {
        Err(e) => Err(e),
        Ok(_) if !failed.is_empty() => {
            let first = String::from_utf8_lossy(&all[failed[0]][1..]).into_owned();
            let more = match failed.len().saturating_sub(16) {
                0 => String::new(),
                k => format!(" and {k} more"),
            };
            Err(Error::Checkpoint(format!(
                "{what} failed on rank(s) {:?}{more}: rank {}: {first}",
                &failed[..failed.len().min(16)],
                failed[0]
            )))
        }
        Ok(v) => Ok(v),
    }
}

/// The longest reason [`agree`] passes from a failed rank to the others.
pub const AGREE_REASON_CHARS: usize = 1000;

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.tmp.{}",
        path.file_name().and_then(|f| f.to_str()).unwrap_or("file"),
        std::process::id()
    ));
    write_synced(&tmp, bytes)?;
    fs::rename(&tmp, path).map_err(|e| Error::io("cannot rename into place", path, e))?;
    sync_dir(dir)
}

/// Whether `name` is a save set's name: `zero-step<10+ digits>-<16 hex digits>`, one path
/// component (no separator, no `..`), as [`save_sharded`] makes them.
pub fn is_set_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix(SET_PREFIX) else {
        return false;
    };
    let Some((step, run)) = rest.split_once('-') else {
        return false;
    };
    step.len() >= 10
        && step.bytes().all(|b| b.is_ascii_digit())
        && run.len() == 16
        && run.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The directory of the current save set in `dir`, if any. The pointer file must name one
/// save set of `dir` ([`is_set_name`]: one path component, no separator, no `..`) that is a
/// directory, not a symbolic link; anything else (an absolute path, `..`, an empty file, a
/// link) is refused with an error naming the file, so no caller ever reads, writes or removes
/// outside `dir` because of what a file said.
pub fn latest_set(dir: &Path) -> Result<Option<PathBuf>> {
    let latest = dir.join(LATEST_FILE);
    let raw = match fs::read(&latest) {
        Ok(raw) => raw,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("cannot read", &latest, e)),
    };
    let refuse = |why: String| {
        Err(Error::Checkpoint(format!(
            "{} does not name a save set of {}: {why}; it must hold one name like \
             `zero-step0000000042-0123456789abcdef` (remove the file to start fresh, or write \
             the name of the set to resume)",
            latest.display(),
            dir.display()
        )))
    };
    let Ok(text) = std::str::from_utf8(&raw) else {
        return refuse("it is not UTF-8 text".into());
    };
    let name = text.trim_end_matches(['\n', '\r']);
    if name.is_empty() {
        return refuse("it is empty".into());
    }
    if !is_set_name(name) {
        let shown: String = name.chars().take(80).collect();
        let more = if name.chars().count() > 80 { "..." } else { "" };
        return refuse(format!("it says {shown:?}{more}"));
    }
    let set = dir.join(name);
    match fs::symlink_metadata(&set) {
        Ok(m) if m.file_type().is_symlink() => {
            refuse(format!("{name} is a symbolic link, not a set written here"))
        }
        Ok(m) if !m.is_dir() => refuse(format!("{name} is not a directory")),
        Ok(_) => Ok(Some(set)),
        Err(e) => Err(Error::io(
            format!("{} names a save set that cannot be read:", latest.display()),
            &set,
            e,
        )),
    }
}

/// Whether `path` is a save set this module wrote: a directory (not a link) directly inside
/// `dir`, with a set name and an index of this format. Only such directories are ever removed.
fn is_own_set(dir: &Path, path: &Path) -> bool {
    let name_ok = path.parent() == Some(dir)
        && path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_set_name);
    let dir_ok = fs::symlink_metadata(path).is_ok_and(|m| m.is_dir());
    name_ok
        && dir_ok
        && fs::read(path.join(INDEX_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice::<Index>(&b).ok())
            .is_some_and(|i| i.format == FORMAT)
}

/// Removes the save sets of `dir` other than `keep` (only those [`is_own_set`] identifies):
/// the previous current set, and sets a crash left between writing a pointer and removing.
fn remove_old_sets(dir: &Path, keep: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path != keep && is_own_set(dir, &path) {
            if let Err(e) = fs::remove_dir_all(&path) {
                tracing::warn!("cannot remove the old save set {}: {e}", path.display());
            }
        }
    }
}

/// Removes the directory of a save that failed (only a set-named directory inside `dir`, never
/// the current set), so an interrupted or refused save leaves no partial set behind.
fn remove_partial_set(dir: &Path, set: &Path) {
    let named = set.parent() == Some(dir)
        && set
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(is_set_name);
    let current = latest_set(dir).ok().flatten();
    if named
        && current.as_deref() != Some(set)
        && fs::symlink_metadata(set).is_ok_and(|m| m.is_dir())
    {
        match fs::remove_dir_all(set) {
            Ok(()) => tracing::warn!(
                "the failed save's partial set {} was removed; the previous set stays current",
                set.display()
            ),
            Err(e) => tracing::warn!("cannot remove the partial set {}: {e}", set.display()),
        }
    }
}

/// Prepares `dir` for a sharded run before it trains (a collective): rank 0 creates it, takes
/// its lock (one job per directory, [`checkpoint::lock_dir`]) and checks it is writable
/// ([`checkpoint::ensure_writable`]), then every rank checks that it can write there (each
/// writes its own shard). An unwritable or locked directory fails every rank at once, instead
/// of at the first save after the training time is spent.
pub fn prepare_dir(pg: &ProcessGroup, dir: &Path) -> Result<()> {
    let first = if pg.rank() == 0 {
        checkpoint::ensure_writable(dir)
    } else {
        Ok(())
    };
    agree(pg, "preparing the checkpoint directory", first)?;
    let mine = if pg.rank() == 0 {
        Ok(())
    } else {
        checkpoint::integrity::probe_writable(dir)
    };
    agree(pg, "checking the checkpoint directory", mine)
}

/// Saves this rank's shard (a collective: every rank calls it with its own `state`). Returns
/// the new set's directory. On any rank's failure every rank gets an error and `zero_latest`
/// still names the previous set.
pub fn save_sharded(
    pg: &ProcessGroup,
    dir: &Path,
    layout: &ShardLayout,
    specs: &[ParamSpec],
    state: &ShardState,
    meta: &CheckpointMeta,
) -> Result<PathBuf> {
    let set = NewSet::start(pg, dir, layout, specs, state, meta)?;
    let (shard_meta, shard_dir) = set.shard_target();
    let written = shard_checkpoint(shard_meta, layout, specs, state).and_then(|ck| {
        checkpoint::save_atomic(&shard_dir, &ck)?;
        Ok(())
    });
    set.commit(pg, written)
}

/// A rank's shard as a checkpoint of `meta`: its segments of every parameter and optimizer slot.
pub(super) fn shard_checkpoint(
    meta: CheckpointMeta,
    layout: &ShardLayout,
    specs: &[ParamSpec],
    state: &ShardState,
) -> Result<Checkpoint> {
    if state.chunks.len() != layout.chunks().len() {
        return Err(Error::InvalidArgument(format!(
            "saving a shard: {} chunk states for {} chunks",
            state.chunks.len(),
            layout.chunks().len()
        )));
    }
    let mut ck = Checkpoint::new(meta);
    for (c, cs) in layout.chunks().iter().zip(&state.chunks) {
        for p in layout.pieces(c) {
            let name = &specs[p.param].name;
            let seg = |v: &[f32]| v[p.chunk_offset..p.chunk_offset + p.len].to_vec();
            ck.insert(
                seg_key(name, p.param_offset, None),
                vec![p.len],
                seg(&cs.params),
            )?;
            for (slot, v) in &cs.slots {
                ck.insert(
                    seg_key(name, p.param_offset, Some(slot)),
                    vec![p.len],
                    seg(v),
                )?;
            }
        }
    }
    Ok(ck)
}

/// A set being written: its name, its index, where this rank's shard goes. `save_sharded`
/// writes it at once; `AsyncSetSaver` writes the shard in the background and commits it later.
pub(super) struct NewSet {
    dir: PathBuf,
    set: PathBuf,
    set_name: String,
    rank: usize,
    index: Index,
}

impl NewSet {
    /// Names the set (rank 0 draws the run id and sends it: a collective) and prepares its
    /// index from `state` (the optimizer record) and `specs`.
    pub(super) fn start(
        pg: &ProcessGroup,
        dir: &Path,
        layout: &ShardLayout,
        specs: &[ParamSpec],
        state: &ShardState,
        meta: &CheckpointMeta,
    ) -> Result<NewSet> {
        let id = if pg.rank() == 0 {
            format!("{:016x}", rand::random::<u64>())
        } else {
            String::new()
        };
        let run_id = String::from_utf8(pg.broadcast_bytes(id.as_bytes(), 0)?)
            .map_err(|_| Error::Checkpoint("run id is not UTF-8".into()))?;
        let set_name = format!("{SET_PREFIX}{:010}-{run_id}", meta.step);
        let index = Index {
            format: FORMAT.into(),
            run_id,
            world_size: layout.world_size(),
            meta: CheckpointMeta {
                world_size: layout.world_size(),
                ..meta.clone()
            },
            optimizer: state.optimizer.clone(),
            params: specs
                .iter()
                .map(|s| IndexParam {
                    name: s.name.clone(),
                    shape: s.shape.clone(),
                })
                .collect(),
        };
        Ok(NewSet {
            dir: dir.to_path_buf(),
            set: dir.join(&set_name),
            set_name,
            rank: pg.rank(),
            index,
        })
    }

    /// The step the set was taken at.
    pub(super) fn step(&self) -> u64 {
        self.index.meta.step
    }

    /// What the writer of this rank's shard needs: the shard's metadata and its directory.
    pub(super) fn shard_target(&self) -> (CheckpointMeta, PathBuf) {
        let mut shard_meta = self.index.meta.clone();
        shard_meta.extra = serde_json::json!({ "run_id": self.index.run_id, "rank": self.rank });
        (shard_meta, self.set.join(format!("rank{}", self.rank)))
    }
    /// Makes the set current once every rank wrote its shard (`written`: this rank's outcome;
    /// a collective): rank 0 writes the index and `zero_latest`, and removes older sets. On any
    /// rank's failure every rank gets an error, the partial set is removed and the previous set
    /// stays current.
    pub(super) fn commit(self, pg: &ProcessGroup, written: Result<()>) -> Result<PathBuf> {
        let (dir, set) = (&self.dir, &self.set);
        if let Err(e) = agree(pg, "saving the shards", written) {
            if self.rank == 0 {
                remove_partial_set(dir, set);
            }
            return Err(e);
        }
        let index = (|| -> Result<()> {
            if self.rank != 0 {
                return Ok(());
            }
            let json = serde_json::to_vec_pretty(&self.index)
                .map_err(|e| Error::Checkpoint(format!("cannot encode the index: {e}")))?;
            write_atomic(&set.join(INDEX_FILE), &json)?;
            write_atomic(&dir.join(LATEST_FILE), self.set_name.as_bytes())?;
            // The new set is current: older sets of this directory can go (only sets identified
            // as written here: never what a pointer file says).
            remove_old_sets(dir, set);
            Ok(())
        })();
        if let Err(e) = agree(pg, "writing the index", index) {
            if self.rank == 0 {
                remove_partial_set(dir, set);
            }
            return Err(e);
        }
        Ok(self.set)
    }
}

/// The metadata (training position) of the current save set of `dir`, read from its index
/// only; `None` when `dir` has none. What a run reads to decide which checkpoint to resume
/// from (a save set, or a plain checkpoint beside it) before loading either.
pub fn set_meta(dir: &Path) -> Result<Option<CheckpointMeta>> {
    let Some(set) = latest_set(dir)? else {
        return Ok(None);
    };
    Ok(Some(read_index(&set)?.meta))
}

/// Loads the current save set of `dir` cut along `layout` (this rank's chunks), checking that
/// every shard is there and from the same save, and that the model matches `specs`.
/// `Ok(None)` when `dir` has no save set. Reads only; nothing is modified.
pub fn load_sharded(
    dir: &Path,
    layout: &ShardLayout,
    specs: &[ParamSpec],
) -> Result<Option<(ShardState, CheckpointMeta)>> {
    let Some(set) = latest_set(dir)? else {
        return Ok(None);
    };
    let (index, segs) = read_set(&set)?;
    check_model(&index, specs, &set)?;
    let chunks = segs.fill(layout, specs)?;
    Ok(Some((
        ShardState {
            optimizer: index.optimizer,
            chunks,
        },
        index.meta,
    )))
}

fn read_index(set: &Path) -> Result<Index> {
    let index_path = set.join(INDEX_FILE);
    let bytes =
        fs::read(&index_path).map_err(|e| Error::io("cannot read the index", &index_path, e))?;
    // The format first, on its own: another format's index may differ in everything else.
    #[derive(Deserialize)]
    struct Format {
        format: String,
    }
    if let Ok(Format { format }) = serde_json::from_slice(&bytes) {
        if format != FORMAT {
            return Err(Error::Checkpoint(format!(
                "{}: format {format:?}, this release reads {FORMAT:?} (a set written by another \
                 ddp-rs version?)",
                index_path.display()
            )));
        }
    }
    let index: Index = serde_json::from_slice(&bytes).map_err(|e| {
        Error::Checkpoint(format!(
            "{} is not a sharded checkpoint index: {e}",
            index_path.display()
        ))
    })?;
    if index.format != FORMAT {
        return Err(Error::Checkpoint(format!(
            "{}: format {:?}, expected {FORMAT:?}",
            index_path.display(),
            index.format
        )));
    }
    index
        .meta
        .validate()
        .map_err(|e| Error::Checkpoint(format!("{}: {e}", index_path.display())))?;
    Ok(index)
}

fn read_set(set: &Path) -> Result<(Index, Segments)> {
    let index = read_index(set)?;
    let index_path = set.join(INDEX_FILE);
    let mut segs = Segments::default();
    for k in 0..index.world_size {
        let d = set.join(format!("rank{k}"));
        let ck = checkpoint::load(&d)?.ok_or_else(|| {
            Error::Checkpoint(format!(
                "shard of rank {k} (of {}) is missing: {}",
                index.world_size,
                checkpoint::checkpoint_path(&d).display()
            ))
        })?;
        let run = ck.meta.extra.get("run_id").and_then(|v| v.as_str());
        let rank = ck.meta.extra.get("rank").and_then(|v| v.as_u64());
        if run != Some(index.run_id.as_str()) || rank != Some(k as u64) {
            return Err(Error::Checkpoint(format!(
                "shard {} is from another save (run {}, rank {}) than its index {} (run {}, rank \
                 {k})",
                checkpoint::checkpoint_path(&d).display(),
                run.unwrap_or("?"),
                rank.map_or("?".into(), |r| r.to_string()),
                index_path.display(),
                index.run_id
            )));
        }
        for (key, t) in ck.tensors {
            let (name, start, slot) = parse_key(&key).ok_or_else(|| {
                Error::Checkpoint(format!(
                    "shard {}: tensor {key:?} is not a parameter segment",
                    d.display()
                ))
            })?;
            segs.add(name, slot, start, t.data);
        }
    }
    Ok((index, segs))
}

/// The current save set of `dir` as one plain checkpoint (what DDP writes): every parameter
/// under its name and shape, optimizer state as `optim.<param>.<slot>`, the optimizer record
/// and the metadata. `None` when `dir` has no save set.
pub fn consolidate(dir: &Path) -> Result<Option<Checkpoint>> {
    let Some(set) = latest_set(dir)? else {
        return Ok(None);
    };
    let (index, segs) = read_set(&set)?;
    let slots = segs.slots();
    let mut ck = Checkpoint::new(index.meta.clone());
    let mut state = OptimizerStateDict::new(index.optimizer.kind.clone(), index.optimizer.step);
    state.hyper = index.optimizer.hyper.clone();
    for p in &index.params {
        let n = p.shape.iter().product();
        let mut v = vec![0.0; n];
        segs.read(&p.name, None, 0, &mut v)?;
        ck.insert(p.name.clone(), p.shape.clone(), v)?;
        for slot in &slots {
            let mut v = vec![0.0; n];
            if segs.read(&p.name, Some(slot), 0, &mut v)? {
                state.insert(&p.name, slot, p.shape.clone(), v)?;
            }
        }
    }
    ck.set_optimizer_state(state)?;
    Ok(Some(ck))
}

/// Cuts a plain checkpoint (DDP's, or [`consolidate`]'s) along `layout`: this rank's chunks of
/// every parameter and optimizer state slot. A parameter missing or mis-shaped is an error
/// naming it.
pub fn import(ckpt: &Checkpoint, layout: &ShardLayout, specs: &[ParamSpec]) -> Result<ShardState> {
    let mut segs = Segments::default();
    let optim = ckpt.optimizer_state();
    for s in specs {
        let t = ckpt.require(&s.name)?;
        if t.shape != s.shape {
            return Err(Error::Mismatch(format!(
                "checkpoint of another model: parameter `{}` has shape {:?} in the checkpoint and \
                 {:?} in this model",
                s.name, t.shape, s.shape
            )));
        }
        segs.add(&s.name, None, 0, t.data.clone());
        let prefix = format!("{}.", s.name);
        for (k, t) in &optim.tensors {
            let Some(slot) = k.strip_prefix(&prefix) else {
                continue;
            };
            // `a.b.exp_avg` belongs to `a.b`, not to a parameter `a` with slot `b.exp_avg`.
            if slot.contains('.') || t.data.len() != s.numel() {
                continue;
            }
            segs.add(&s.name, Some(slot), 0, t.data.clone());
        }
    }
    Ok(ShardState {
        optimizer: ckpt.optimizer.clone().unwrap_or_default(),
        chunks: segs.fill(layout, specs)?,
    })
}
