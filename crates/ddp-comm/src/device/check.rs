//! The fingerprint check of device collectives: before the first use of a new shape (op,
//! dtype, reduce op, element count, root), every rank's fingerprint goes through the host group
//! and is compared, so ranks that issue different collectives fail with an error naming both
//! sides instead of NCCL reading the wrong bytes or hanging. Later uses of a known shape cost
//! nothing (torch checks collective fingerprints the same way under `TORCH_DISTRIBUTED_DEBUG`).
//!
//! A rank that meets a shape for the first time while another rank has seen it before waits in
//! the check while the other enters the device collective: both then fail by their timeouts
//! (the host group's names the rank that did not come; the device watchdog names the collective).

use crate::dtype::{DType, ReduceOp};
use crate::transport::{Fingerprint, OpKind, NO_REDUCE};
use crate::{Error, ProcessGroup, Result};
use std::collections::HashSet;
use std::sync::Mutex;

type Shape = (u8, u8, u8, u64, u32);

fn shape(fp: &Fingerprint) -> Shape {
    (
        fp.op as u8,
        fp.dtype.code(),
        fp.reduce.map_or(NO_REDUCE, |r| r.code()),
        fp.count,
        fp.root,
    )
}

fn encode(fp: &Fingerprint) -> Vec<u8> {
    let (op, dt, red, count, root) = shape(fp);
    let mut v = vec![op, dt, red];
    v.extend_from_slice(&count.to_le_bytes());
    v.extend_from_slice(&root.to_le_bytes());
    v.extend_from_slice(&fp.seq.to_le_bytes());
    v
}

fn decode(b: &[u8]) -> Option<Fingerprint> {
    if b.len() != 3 + 8 + 4 + 8 {
        return None;
    }
    Some(Fingerprint {
        op: OpKind::from_code(b[0])?,
        dtype: DType::from_code(b[1])?,
        reduce: if b[2] == NO_REDUCE {
            None
        } else {
            Some(ReduceOp::from_code(b[2])?)
        },
        count: u64::from_le_bytes(b[3..11].try_into().ok()?),
        root: u32::from_le_bytes(b[11..15].try_into().ok()?),
        seq: u64::from_le_bytes(b[15..23].try_into().ok()?),
    })
}

/// The shapes this rank has already checked with every rank of its group.
#[derive(Debug, Default)]
pub struct ShapeCheck {
    seen: Mutex<HashSet<Shape>>,
}

impl ShapeCheck {
    /// No shape checked yet.
    pub fn new() -> ShapeCheck {
        ShapeCheck::default()
    }

    /// Number of shapes checked so far.
    pub fn len(&self) -> usize {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Whether no shape was checked yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// If `fp`'s shape is new, compare it with every rank's through `pg` (a host collective);
    /// [`Error::Mismatch`] names this rank, the first rank that issued something else, and both
    /// collectives with their sequence numbers.
    pub fn check(&self, pg: &ProcessGroup, fp: &Fingerprint) -> Result<()> {
        let key = shape(fp);
        if self
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&key)
        {
            return Ok(());
        }
        let all = pg.all_gather_bytes(&encode(fp))?;
        for (peer, theirs) in all.iter().enumerate() {
            let remote = decode(theirs);
            if remote.as_ref().map(shape) != Some(key) {
                return Err(Error::Mismatch {
                    rank: pg.rank(),
                    local: *fp,
                    local_bytes: None,
                    peer,
                    remote,
                    remote_bytes: remote.is_none().then_some(theirs.len() as u64),
                });
            }
        }
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key);
        Ok(())
    }
}
