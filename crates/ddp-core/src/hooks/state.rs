//! Comm hook state in checkpoints ([`Checkpoint::save_hook_state`], [`Checkpoint::hook_state`]).
//!
//! A [`HookState`] of kind `K` is stored as tensors named `hook.K.#` (an empty marker),
//! `hook.K.counter.NAME` (a counter as three exact 24-bit limbs in `f32`) and
//! `hook.K.tensor.NAME`; several kinds (a hook and a model averager) live side by side.

use crate::checkpoint::{Checkpoint, TensorData, HOOK_PREFIX};
use crate::error::{Error, Result};
use crate::reducer::HookState;

const LIMB: u64 = 1 << 24;

impl Checkpoint {
    /// Stores `state` (replacing any state of the same kind stored before).
    pub fn save_hook_state(&mut self, state: &HookState) -> Result<()> {
        let kind = &state.kind;
        if kind.is_empty() || kind.contains('.') {
            return Err(Error::InvalidArgument(format!(
                "comm hook state kind {kind:?} must be non-empty and contain no '.'"
            )));
        }
        let prefix = format!("{HOOK_PREFIX}{kind}.");
        self.tensors.retain(|k, _| !k.starts_with(&prefix));
        self.insert(format!("{prefix}#"), vec![0], vec![])?;
        for (name, &v) in &state.counters {
            let limbs = [v % LIMB, (v / LIMB) % LIMB, v / (LIMB * LIMB)];
            let data = limbs.iter().map(|&l| l as f32).collect();
            self.insert(format!("{prefix}counter.{name}"), vec![3], data)?;
        }
        for (name, t) in &state.tensors {
            self.insert(
                format!("{prefix}tensor.{name}"),
                t.shape.clone(),
                t.data.clone(),
            )?;
        }
        Ok(())
    }

    /// The stored state of hook `kind`; an error naming the kinds the checkpoint holds when it
    /// holds none of this one.
    pub fn hook_state(&self, kind: &str) -> Result<HookState> {
        let prefix = format!("{HOOK_PREFIX}{kind}.");
        if !self.tensors.contains_key(&format!("{prefix}#")) {
            let held: Vec<&str> = self
                .tensors
                .keys()
                .filter_map(|k| k.strip_prefix(HOOK_PREFIX)?.strip_suffix(".#"))
                .collect();
            return Err(Error::Mismatch(format!(
                "checkpoint holds no state of comm hook {kind:?} (it holds hook state of {held:?})"
            )));
        }
        let mut s = HookState::new(kind);
        for (key, t) in self.tensors.range(prefix.clone()..) {
            let Some(rest) = key.strip_prefix(&prefix) else {
                break;
            };
            if let Some(name) = rest.strip_prefix("counter.") {
                let exact = t.data.len() == 3
                    && t.data
                        .iter()
                        .all(|&l| l >= 0.0 && l < LIMB as f32 && l.fract() == 0.0);
                if !exact {
                    return Err(Error::Mismatch(format!(
                        "checkpoint tensor {key:?} is not a hook counter (three 24-bit limbs)"
                    )));
                }
                let v = t.data[0] as u64 + t.data[1] as u64 * LIMB + t.data[2] as u64 * LIMB * LIMB;
                s.counters.insert(name.to_string(), v);
            } else if let Some(name) = rest.strip_prefix("tensor.") {
                s.tensors.insert(name.to_string(), TensorData::clone(t));
            }
        }
        Ok(s)
    }
}

/// Every rank's `state` in one (a collective; every rank gets the result): the counters (the
/// same on every rank) and each rank's tensors as `rank<r>.<name>`. Error-feedback residuals
/// differ between ranks, so a checkpoint written by rank 0 alone needs all of them for an
/// exact resume; [`HookState::for_rank`] picks one rank's back out.
pub fn gather_state(pg: &ddp_comm::ProcessGroup, state: &HookState) -> Result<HookState> {
    let mut out = HookState::new(state.kind.clone());
    out.counters = state.counters.clone();
    for (name, t) in &state.tensors {
        let mut all = vec![0f32; t.data.len() * pg.size()];
        pg.all_gather(&t.data, &mut all).map_err(|e| {
            Error::Mismatch(format!(
                "gathering {} comm hook state tensor {name:?} ({} elements on rank {}): {e}",
                state.kind,
                t.data.len(),
                pg.rank()
            ))
        })?;
        for (r, chunk) in all.chunks(t.data.len().max(1)).enumerate().take(pg.size()) {
            let data = if t.data.is_empty() {
                vec![]
            } else {
                chunk.to_vec()
            };
            out.tensors.insert(
                format!("rank{r}.{name}"),
                TensorData {
                    shape: t.shape.clone(),
                    data,
                },
            );
        }
    }
    Ok(out)
}

impl HookState {
    /// Rank `rank`'s state out of a [`gather_state`] result (a state without per-rank tensors
    /// is returned as it is).
    pub fn for_rank(&self, rank: usize) -> HookState {
        if !self.tensors.keys().any(|k| k.starts_with("rank")) {
            return self.clone();
        }
        let prefix = format!("rank{rank}.");
        HookState {
            kind: self.kind.clone(),
            counters: self.counters.clone(),
            tensors: self
                .tensors
                .iter()
                .filter_map(|(k, t)| Some((k.strip_prefix(&prefix)?.to_string(), t.clone())))
                .collect(),
        }
    }
}
