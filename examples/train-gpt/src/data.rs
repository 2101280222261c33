//! The text: Shakespeare's plays as characters (`data/shakespeare.txt.gz`, built by
//! `data/prepare.py`; see `data/README.md`), the vocabulary (the characters present, sorted),
//! the 90/10 train/validation split (nanoGPT's: the first 90% of characters train), and the
//! windows each rank trains on.
//!
//! A training example is the window of `block_size + 1` characters starting at a position of
//! the training text (inputs, and the targets shifted by one). Which windows a step uses is a
//! [`DistributedSampler`] over every start position (PyTorch's sampler: shuffled by seed and
//! epoch, rank `r` takes positions `r, r + world, ...` of the permutation), batch `k` of a rank
//! being its sampler indices `k*b .. (k+1)*b`. The ranks' windows in a step are disjoint, and
//! together they are exactly the windows world 1 with batch `world * b` takes in that step; the
//! position (epoch, windows consumed) goes into checkpoints ([`Windows::meta`]); [`restore`] puts
//! it back, with the reducer's step and the comm hook's state, when a run resumes.

use ddprs::checkpoint::{global_consumed, CheckpointMeta, GLOBAL_CONSUMED_KEY};
use ddprs::{DistributedSampler, SamplerState};
use std::io::Read;

/// The text, compressed, in the binary (nothing is read or downloaded at run time).
const TEXT_GZ: &[u8] = include_bytes!("../data/shakespeare.txt.gz");

/// The characters of the text and their ids.
#[derive(Debug, Clone)]
pub struct Corpus {
    pub vocab: Vec<char>,
    pub train: Vec<u32>,
    pub val: Vec<u32>,
}

impl Corpus {
    /// Decompresses and encodes the text; splits at `int(0.9 * n)`.
    pub fn load() -> Corpus {
        let mut text = String::new();
        flate2::read::GzDecoder::new(TEXT_GZ)
            .read_to_string(&mut text)
            .expect("the embedded text is valid gzip and UTF-8");
        Corpus::from_text(&text)
    }

    pub fn from_text(text: &str) -> Corpus {
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        let ids: Vec<u32> = text
            .chars()
            .map(|c| vocab.binary_search(&c).unwrap() as u32)
            .collect();
        let split = (ids.len() as f64 * 0.9) as usize;
        Corpus {
            vocab,
            train: ids[..split].to_vec(),
            val: ids[split..].to_vec(),
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    pub fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|&i| self.vocab[i as usize]).collect()
    }

    pub fn encode(&self, text: &str) -> Vec<u32> {
        text.chars()
            .filter_map(|c| self.vocab.binary_search(&c).ok().map(|i| i as u32))
            .collect()
    }
}

/// Number of training windows (start positions) for a context of `block_size`.
pub fn windows(data: &[u32], block_size: usize) -> usize {
    data.len().saturating_sub(block_size + 1) + 1
}

/// Inputs and targets of the windows starting at `starts`, row-major `[starts.len(), block]`.
pub fn batch(data: &[u32], starts: &[usize], block_size: usize) -> (Vec<u32>, Vec<u32>) {
    let mut x = Vec::with_capacity(starts.len() * block_size);
    let mut y = Vec::with_capacity(starts.len() * block_size);
    for &s in starts {
        x.extend_from_slice(&data[s..s + block_size]);
        y.extend_from_slice(&data[s + 1..s + block_size + 1]);
    }
    (x, y)
}

/// A rank's stream of training windows: its sampler shard, epoch after epoch.
pub struct Windows {
    sampler: DistributedSampler,
    /// Number of windows and the shuffling seed (to re-shard over another group).
    count: usize,
    seed: u64,
    world: usize,
    indices: Vec<usize>,
    /// Positions of the epoch all ranks together had consumed when `indices` began (not 0 in
    /// an epoch resumed at another world size: its rest re-sharded over this one).
    base: usize,
    consumed: usize,
}

impl Windows {
    pub fn new(count: usize, world: usize, rank: usize, seed: u64) -> ddprs::Result<Windows> {
        let mut sampler = DistributedSampler::new(count, world, rank)?
            .seed(seed)
            .drop_last(true);
        sampler.set_epoch(0);
        let indices = sampler.indices();
        Ok(Windows {
            sampler,
            count,
            seed,
            world,
            indices,
            base: 0,
            consumed: 0,
        })
    }

    /// Continues where the checkpoint `meta` left off: at its per-rank position when it was
    /// written at this world size in an epoch that was not re-sharded, else at its global
    /// position (the windows every rank together consumed), the rest of the epoch re-sharded
    /// over this world (`DistributedSampler::indices_from_global`: none skipped, none twice).
    pub fn resume(&mut self, meta: &CheckpointMeta) -> ddprs::Result<()> {
        self.sampler.set_epoch(meta.sampler.epoch);
        let global = meta.extra.get(GLOBAL_CONSUMED_KEY).is_some();
        if meta.world_size == self.world && !global {
            self.indices = self.sampler.indices_from(0)?;
            self.base = 0;
            self.consumed = meta.sampler.consumed.min(self.indices.len());
        } else {
            self.base = global_consumed(meta)?;
            self.indices = self.sampler.indices_from_global(self.base);
            self.consumed = 0;
        }
        Ok(())
    }

    /// Continues as rank `rank` of `world` (a regrouped job, `--fault-tolerance`) from the
    /// global position of `meta` ([`Windows::meta_global`]): what a checkpoint written at the
    /// old world size and resumed at the new one continues from.
    pub fn reshard(
        &mut self,
        world: usize,
        rank: usize,
        meta: &CheckpointMeta,
    ) -> ddprs::Result<()> {
        *self = Windows::new(self.count, world, rank, self.seed)?;
        self.resume(meta)
    }

    /// The next `b` window starts of this rank (a new epoch when this one runs out).
    pub fn next_batch(&mut self, b: usize) -> Vec<usize> {
        if self.consumed + b > self.indices.len() {
            let next = self.sampler.epoch() + 1;
            self.sampler.set_epoch(next);
            self.indices = self.sampler.indices();
            self.base = 0;
            self.consumed = 0;
        }
        let out = self.indices[self.consumed..self.consumed + b].to_vec();
        self.consumed += b;
        out
    }

    /// A checkpoint's metadata after `step` steps at `world` ranks: this stream's position
    /// (resumed by [`Windows::resume`]: per rank, and all ranks together when the epoch was
    /// re-sharded), the seed, and `extra` (a JSON object).
    pub fn meta(&self, step: u64, seed: u64, extra: serde_json::Value) -> CheckpointMeta {
        let epoch = self.sampler.epoch();
        let mut extra = extra;
        if self.base > 0 {
            let global = self.base + self.consumed * self.world;
            extra[GLOBAL_CONSUMED_KEY] = global.into();
        }
        CheckpointMeta {
            step,
            epoch,
            sampler: SamplerState {
                epoch,
                consumed: self.consumed,
            },
            rng_state: seed,
            world_size: self.world,
            extra,
        }
    }
}

impl Windows {
    /// [`meta`](Self::meta) with the global position always written (the windows all ranks
    /// consumed): a state handed to the ranks of a regrouped job, which re-shard from it.
    pub fn meta_global(&self, step: u64, seed: u64, extra: serde_json::Value) -> CheckpointMeta {
        let mut meta = self.meta(step, seed, extra);
        meta.extra[GLOBAL_CONSUMED_KEY] = (self.base + self.consumed * self.world).into();
        meta
    }
}

/// The index that a uniform draw `u` in [0, 1) picks from a probability vector (the last one
/// when rounding leaves the sum short of `u`).
pub fn sample_index(probs: &[f32], u: f32) -> usize {
    let mut acc = 0.0;
    for (i, p) in probs.iter().enumerate() {
        acc += p;
        if u < acc {
            return i;
        }
    }
    probs.len() - 1
}

/// The validation windows rank 0 evaluates on: `count` evenly spaced starts (fixed, the same
/// for every run and framework).
pub fn val_starts(data: &[u32], block_size: usize, count: usize) -> Vec<usize> {
    let n = windows(data, block_size);
    (0..count).map(|i| i * n / count.max(1)).collect()
}

/// What a resumed run takes from its checkpoint besides the model and the optimizer: the windows'
/// position ([`Windows::resume`]) and, for a plain checkpoint, this rank's comm hook state and
/// the reducer's step count. Returns the step to continue at.
pub fn restore<P: ddprs::adapter::ParamAccess>(
    core: &mut ddprs::adapter::DdpCore<P>,
    meta: &CheckpointMeta,
    ck: Option<&ddprs::Checkpoint>,
    windows: &mut Windows,
    dir: &std::path::Path,
) -> Result<u64, Box<dyn std::error::Error>> {
    let rank = core.rank();
    let kind = core.reducer().comm_hook_state().kind;
    if let (false, Some(ck)) = (kind.is_empty(), ck) {
        let state = ck.hook_state(&kind)?.for_rank(rank);
        core.reducer_mut().load_comm_hook_state(&state)?;
    }
    core.reducer_mut().set_step(meta.step);
    restore_windows(rank, core.world_size(), meta, windows, dir)
}

/// Whether the plain (`--zero 0`) checkpoint `ck` can resume at `world`: at any world size
/// (every rank holds the whole model and optimizer state; [`restore`] re-shards the windows by
/// the global position), except when its comm hook state is per rank (e.g. PowerSGD's
/// residuals): then only at the world size it was written at.
pub fn check_plain_world(
    ck: &ddprs::Checkpoint,
    world: usize,
    reducer: &ddprs::reducer::Reducer,
) -> Result<(), Box<dyn std::error::Error>> {
    let kind = reducer.comm_hook_state().kind;
    if ck.meta.world_size == world || kind.is_empty() {
        return Ok(());
    }
    let state = ck.hook_state(&kind)?;
    if !state.tensors.keys().any(|k| k.starts_with("rank")) {
        return Ok(());
    }
    Err(format!(
        "the checkpoint was written at world size {} and this run has world size {world}: the \
         comm hook's per-rank state ({kind}) cannot be re-sharded; resume it with {} processes, \
         or without --hook",
        ck.meta.world_size, ck.meta.world_size
    )
    .into())
}

/// The windows' part of [`restore`] (ZeRO-3 has no reducer).
pub fn restore_windows(
    rank: usize,
    world: usize,
    meta: &CheckpointMeta,
    windows: &mut Windows,
    dir: &std::path::Path,
) -> Result<u64, Box<dyn std::error::Error>> {
    windows.resume(meta)?;
    if rank == 0 {
        let from = match meta.world_size {
            w if w == world => String::new(),
            w => format!(" (written at world size {w}: the epoch's rest re-sharded)"),
        };
        eprintln!("resumed at step {} from {}{from}", meta.step, dir.display());
    }
    Ok(meta.step)
}
