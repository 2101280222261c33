//! The all-reduce fast path's side of the segment: per-rank slots and progress counters, used
//! by [`crate::algorithms::shm_direct`] (see that module's diagram).

use super::segment::{self, Geometry};
use super::{Idle, ShmTransport};
use crate::Result;
use std::sync::atomic::Ordering;

/// Which fast-path progress counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counter {
    /// Blocks whose input the rank has copied into its fast area.
    In,
    /// Blocks whose owned sub-chunk the rank has reduced and published.
    Reduced,
    /// Blocks the rank has finished reading from peers' areas.
    Out,
    /// Cross-memory-attach all-reduces the rank has entered (its buffer is published).
    Registered,
}

impl Counter {
    pub(super) fn offset(self) -> usize {
        match self {
            Counter::In => segment::C_IN,
            Counter::Reduced => segment::C_RED,
            Counter::Out => segment::C_OUT,
            Counter::Registered => segment::C_REG,
        }
    }
}

impl ShmTransport {
    /// Geometry of the fast path.
    pub(crate) fn fast_geometry(&self) -> Geometry {
        self.seg().geometry()
    }

    /// Reserve `n` consecutive fast-path blocks; returns the first block's global index.
    pub(crate) fn take_blocks(&mut self, n: u64) -> u64 {
        let first = self.blocks;
        self.blocks += n;
        first
    }

    /// Start of `rank`'s fast-area slot for global block `block`.
    pub(crate) fn fast_slot(&self, rank: usize, block: u64) -> *mut u8 {
        let seg = self.seg();
        seg.fast_slot(rank, (block % seg.geometry().window as u64) as usize)
    }

    /// Publish this rank's progress counter and ring every peer.
    pub(crate) fn publish(&self, which: Counter, value: u64) {
        self.note_cpu();
        let seg = self.seg();
        seg.counter(self.rank, which.offset())
            .store(value, Ordering::Release);
        for p in (0..self.size).filter(|&p| p != self.rank) {
            Self::ring_bell(seg, p);
        }
    }

    /// Wait until every peer's counter `which` is at least `value`.
    pub(crate) fn wait_peers(&self, which: Counter, value: u64) -> Result<()> {
        let seg = self.seg();
        let lagging = || -> Vec<usize> {
            (0..self.size)
                .filter(|&p| {
                    p != self.rank && seg.counter(p, which.offset()).load(Ordering::Acquire) < value
                })
                .collect()
        };
        let mut st = Idle::default();
        let entry = matches!(which, Counter::In | Counter::Registered) && self.entry_pending.get();
        loop {
            let seen = seg.bell(self.rank).load(Ordering::SeqCst);
            let ready = (0..self.size).all(|p| {
                p == self.rank || seg.counter(p, which.offset()).load(Ordering::Acquire) >= value
            });
            if ready {
                if entry {
                    self.record_entry_wait(&st);
                }
                return Ok(());
            }
            self.idle(&mut st, seen, &lagging, entry)?;
        }
    }

    /// After every peer's `In` counter shows it reached this collective: fail with a mismatch
    /// if any of them is in a different one.
    pub(crate) fn check_same_collective(&self) -> Result<()> {
        for p in (0..self.size).filter(|&p| p != self.rank) {
            self.check_peer_fp(p, true)?;
        }
        Ok(())
    }
}
