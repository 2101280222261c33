//! Parameter specs and the start-up collectives: what every rank must agree on before the first
//! step.
//!
//! - [`ParamSpec`] (name, shape, dtype) and the cross-rank check that every replica registered the
//!   same parameters in the same order ([`verify_param_specs`]): a mismatch is an error on *every*
//!   rank naming the first differing parameter and the ranks involved (no rank hangs, because the
//!   check is a single `all_gather_bytes`).
//! - [`broadcast_coalesced`] (rank 0's parameter values to every replica) and [`sync_seed`] (one
//!   seed shared by every rank).

use crate::error::{Error, Result};
use ddp_comm::{DType, Element, ProcessGroup};

/// Chunk size of [`broadcast_coalesced`] (PyTorch's `broadcast_bucket_size`, 250 MiB).
pub const BROADCAST_BUCKET_BYTES: usize = 250 * 1024 * 1024;

/// One registered parameter: what every rank must agree on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl ParamSpec {
    pub fn new(name: impl Into<String>, shape: impl Into<Vec<usize>>, dtype: DType) -> Self {
        ParamSpec {
            name: name.into(),
            shape: shape.into(),
            dtype,
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size of the gradient in bytes.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

impl std::fmt::Display for ParamSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` {:?} {}", self.name, self.shape, self.dtype)
    }
}

fn encode_specs(specs: &[ParamSpec]) -> Vec<u8> {
    let v: Vec<(String, Vec<usize>, String)> = specs
        .iter()
        .map(|s| (s.name.clone(), s.shape.clone(), s.dtype.to_string()))
        .collect();
    serde_json::to_vec(&v).expect("serializing parameter specs")
}

fn describe(spec: Option<&(String, Vec<usize>, String)>) -> String {
    match spec {
        Some((n, s, d)) => format!("`{n}` {s:?} {d}"),
        None => "no parameter".to_string(),
    }
}

/// Checks that every rank registered the same parameters (names, shapes, dtypes) in the same
/// order. One `all_gather_bytes`, so every rank sees every list and reports the same error:
/// the first differing parameter, what each side has, and which ranks differ from rank 0.
pub fn verify_param_specs(pg: &ProcessGroup, specs: &[ParamSpec]) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for s in specs {
        if !seen.insert(s.name.as_str()) {
            return Err(Error::InvalidArgument(format!(
                "parameter name `{}` is registered twice on rank {}",
                s.name,
                pg.rank()
            )));
        }
    }
    let all = pg.all_gather_bytes(&encode_specs(specs))?;
    let decoded: Vec<Vec<(String, Vec<usize>, String)>> = all
        .iter()
        .enumerate()
        .map(|(r, b)| {
            serde_json::from_slice(b).map_err(|e| {
                Error::Mismatch(format!("rank {r} sent an unreadable parameter list: {e}"))
            })
        })
        .collect::<Result<_>>()?;
    let reference = &decoded[0];
    let mut first: Option<(usize, usize)> = None; // (rank, position)
    let mut differing = Vec::new();
    for (r, list) in decoded.iter().enumerate().skip(1) {
        if list == reference {
            continue;
        }
        differing.push(r);
        let pos = (0..list.len().max(reference.len()))
            .find(|&i| list.get(i) != reference.get(i))
            .unwrap_or(0);
        if first.is_none_or(|(_, p)| pos < p) {
            first = Some((r, pos));
        }
    }
    let Some((r, pos)) = first else {
        return Ok(());
    };
    let count_note = if decoded[r].len() != reference.len() {
        format!(
            " (rank 0 has {} parameters, rank {r} has {})",
            reference.len(),
            decoded[r].len()
        )
    } else {
        String::new()
    };
    Err(Error::Mismatch(format!(
        "model parameters differ across ranks: ranks {differing:?} disagree with rank 0; first \
         difference at parameter #{pos} (in registration order, sorted by name): rank 0 has {} but \
         rank {r} has {}{count_note}",
        describe(reference.get(pos)),
        describe(decoded[r].get(pos)),
    )))
}

/// Broadcasts `tensors` from `root` to every rank, packed into flat chunks of at most
/// [`BROADCAST_BUCKET_BYTES`] (fewer, larger messages than one broadcast per tensor).
pub fn broadcast_coalesced<T: Element>(
    pg: &ProcessGroup,
    tensors: &mut [&mut [T]],
    root: usize,
) -> Result<()> {
    let cap = (BROADCAST_BUCKET_BYTES / std::mem::size_of::<T>()).max(1);
    let mut start = 0;
    while start < tensors.len() {
        let mut end = start;
        let mut n = 0;
        while end < tensors.len() && (end == start || n + tensors[end].len() <= cap) {
            n += tensors[end].len();
            end += 1;
        }
        let mut flat = Vec::with_capacity(n);
        for t in tensors[start..end].iter() {
            flat.extend_from_slice(t);
        }
        pg.broadcast(&mut flat, root)?;
        let mut off = 0;
        for t in tensors[start..end].iter_mut() {
            let len = t.len();
            t.copy_from_slice(&flat[off..off + len]);
            off += len;
        }
        start = end;
    }
    Ok(())
}

/// One seed for every rank: rank 0's `seed` (or, if `None`, a fresh one drawn on rank 0) is
/// broadcast, so that every replica seeds its random number generators identically.
pub fn sync_seed(pg: &ProcessGroup, seed: Option<u64>) -> Result<u64> {
    let mine = seed.unwrap_or_else(rand::random::<u64>);
    let mut buf = [mine as i64];
    pg.broadcast(&mut buf, 0)?;
    Ok(buf[0] as u64)
}

/// Refuses an empty parameter set (every data-parallel wrapper calls it: the reducer, stage 3's
/// units). PyTorch refuses a module without parameters that require gradients too: with none,
/// nothing is broadcast or averaged and every rank would train alone, silently.
pub fn require_trainable(specs: &[ParamSpec]) -> Result<()> {
    if specs.is_empty() {
        return Err(Error::InvalidArgument(
            "data-parallel training needs at least one trainable parameter and the model has \
             none: was it wrapped before its layers were built (a VarMap wrapped before the \
             model created its variables), or are all its parameters frozen? Build the model \
             first, then wrap it"
                .into(),
        ));
    }
    Ok(())
}
