//! Test support: run a closure on `world` ranks of a real process group, one thread per rank,
//! in this process (a store server on `127.0.0.1:0`, then real TCP sockets or shared memory).
//!
//! Used by this workspace's tests, and meant for users testing their own distributed code the
//! way PyTorch's `MultiProcessTestCase` is used: every collective runs for real, and every
//! rank's group has a timeout, so a bug shows up as an error naming the rank, not as a hang.

use crate::algorithms::AllReduceAlgorithm;
use crate::process_group::Backend;
use crate::store::{StoreOptions, StoreServer, TcpStore};
use crate::{init_process_group, InitOptions, ProcessGroup};
use std::sync::Arc;
use std::time::Duration;

/// How [`run_local_group`] builds each rank's group.
#[derive(Debug, Clone, Copy)]
pub struct LocalGroup {
    /// Timeout of rendezvous and of every collective.
    pub timeout: Duration,
    /// Transport (default: TCP, so tests do not depend on the host detection).
    pub backend: Backend,
    /// All-reduce algorithm (default: the group's choice by size).
    pub algorithm: Option<AllReduceAlgorithm>,
}

impl Default for LocalGroup {
    fn default() -> Self {
        LocalGroup {
            timeout: Duration::from_secs(30),
            backend: Backend::Tcp,
            algorithm: None,
        }
    }
}

/// Run `f(pg)` on `world` ranks (threads) of a TCP group with a 30 s timeout; results by rank.
pub fn run_ranks<R: Send>(world: usize, f: impl Fn(ProcessGroup) -> R + Sync) -> Vec<R> {
    run_local_group(world, LocalGroup::default(), f)
}

/// Run `f(pg)` on `world` ranks (threads) of a group built as `cfg` says; results by rank.
/// Panics (naming the rank) if a rank's group cannot be created or a rank's closure panics.
pub fn run_local_group<R: Send>(
    world: usize,
    cfg: LocalGroup,
    f: impl Fn(ProcessGroup) -> R + Sync,
) -> Vec<R> {
    let server = StoreServer::bind("127.0.0.1:0", None).expect("test store server");
    let addr = server.local_addr().to_string();
    let out = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let (f, addr) = (&f, addr.as_str());
                s.spawn(move || {
                    let store = TcpStore::connect(
                        addr,
                        StoreOptions {
                            secret: None,
                            timeout: cfg.timeout,
                            connect_timeout: cfg.timeout,
                        },
                    )
                    .unwrap_or_else(|e| panic!("rank {rank}: store: {e}"));
                    let mut opts = InitOptions::with_store(Arc::new(store), rank, world);
                    opts.timeout = cfg.timeout;
                    opts.backend = Some(cfg.backend);
                    opts.allreduce_algorithm = cfg.algorithm;
                    let pg = init_process_group(opts)
                        .unwrap_or_else(|e| panic!("rank {rank}: init: {e}"));
                    f(pg)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| h.join().unwrap_or_else(|_| panic!("rank {rank} panicked")))
            .collect()
    });
    drop(server);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ReduceOp;

    #[test]
    fn every_rank_runs_and_results_come_back_in_rank_order() {
        let out = run_ranks(3, |pg| {
            let mut v = [pg.rank() as i64];
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            (pg.rank(), v[0])
        });
        assert_eq!(out, vec![(0, 3), (1, 3), (2, 3)]);
    }
}
