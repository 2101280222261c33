//! Aligning the ranks' trace clocks with rank 0's, as NTP does: rank `r` sends its time `t1`,
//! rank 0 answers with its time `t2`, rank `r` reads `t3` on receipt. If the two one-way trips
//! take equally long, rank 0's clock read `t2` at `r`'s `(t1 + t3) / 2`, so
//! `offset = t2 - (t1 + t3) / 2` maps `r`'s clock onto rank 0's; an unequal split errs by at
//! most half the round trip `t3 - t1`. Of [`ROUNDS`] exchanges the one with the shortest round
//! trip is kept (least queueing), and that round trip is reported as the error bound.

use crate::error::Result;
use ddp_comm::ProcessGroup;

/// Exchanges per rank.
pub const ROUNDS: usize = 8;

/// This rank's clock against rank 0's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockSync {
    /// Add to this rank's trace clock (ns) to get rank 0's.
    pub offset_ns: i64,
    /// Round trip of the exchange the offset came from: the offset is right within half of it.
    pub rtt_ns: i64,
}

/// Estimates every rank's [`ClockSync`] (a collective; rank 0 gets offset 0). `now` reads the
/// trace clock in nanoseconds.
pub fn estimate(pg: &ProcessGroup, now: impl Fn() -> i64) -> Result<ClockSync> {
    let (rank, size) = (pg.rank(), pg.size());
    let mut best = ClockSync {
        offset_ns: 0,
        rtt_ns: 0,
    };
    if rank == 0 {
        for peer in 1..size {
            for _ in 0..ROUNDS {
                let mut t1 = [0i64];
                pg.recv(&mut t1, peer)?;
                pg.send(&[now()], peer)?;
            }
        }
    } else {
        let mut best_rtt = i64::MAX;
        for _ in 0..ROUNDS {
            let t1 = now();
            pg.send(&[t1], 0)?;
            let mut t2 = [0i64];
            pg.recv(&mut t2, 0)?;
            let t3 = now();
            if t3 - t1 < best_rtt {
                best_rtt = t3 - t1;
                best = ClockSync {
                    offset_ns: t2[0] - (t1 + t3) / 2,
                    rtt_ns: best_rtt,
                };
            }
        }
    }
    Ok(best)
}
