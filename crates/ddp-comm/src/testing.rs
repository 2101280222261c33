//! Test support, the one threads-as-ranks harness of the workspace: run a closure on `world`
//! ranks of a real process group, one thread per rank, in this process (a store server on
//! `127.0.0.1:0`, then real TCP sockets or shared memory): [`run_ranks`], [`run_local_group`],
//! [`run_ranks_configured`]; or, below process groups, on `world` threads sharing a store
//! ([`run_with_store`]).
//!
//! Used by this workspace's tests, and meant for users testing their own distributed code the
//! way PyTorch's `MultiProcessTestCase` is used: every collective runs for real, and every
//! rank's group has a timeout, so a bug shows up as an error naming the rank, not as a hang.

use crate::algorithms::AllReduceAlgorithm;
use crate::backend::Backend;
use crate::store::{Store, StoreOptions, StoreServer, TcpStore};
use crate::{init_process_group, InitOptions, ProcessGroup};
use std::sync::Arc;
use std::time::Duration;

/// How [`run_local_group`] builds each rank's group.
#[derive(Debug, Clone, Copy)]
pub struct LocalGroup {
    /// Timeout of rendezvous and of every collective.
    pub timeout: Duration,
    /// Backend (default: TCP, so tests do not depend on the host detection).
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
    let configure = |_: usize, opts: &mut InitOptions| {
        opts.backend = Some(cfg.backend);
        opts.allreduce_algorithm = cfg.algorithm;
    };
    run_ranks_configured(world, cfg.timeout, configure, f)
}

/// Run `f(pg)` on `world` ranks (threads), each rank's [`InitOptions`] (a store client,
/// `rank`, `world`, `timeout`) adjusted by `configure(rank, options)` first; results by rank.
/// Panics (naming the rank) if a rank's group cannot be created or a rank's closure panics.
pub fn run_ranks_configured<R: Send>(
    world: usize,
    timeout: Duration,
    configure: impl Fn(usize, &mut InitOptions) + Sync,
    f: impl Fn(ProcessGroup) -> R + Sync,
) -> Vec<R> {
    run_with_store(world, timeout, |rank, store| {
        let mut opts = InitOptions::with_store(store, rank, world);
        opts.timeout = timeout;
        configure(rank, &mut opts);
        let pg = init_process_group(opts).unwrap_or_else(|e| panic!("rank {rank}: init: {e}"));
        f(pg)
    })
}

/// The harness under the others: one store server on `127.0.0.1:0`, and `f(rank, store)` on
/// `world` threads, each with its own client (`timeout` for every request); results by rank.
/// For tests of what lies below a process group (transports, host detection).
pub fn run_with_store<R: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, Arc<dyn Store>) -> R + Sync,
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
                            timeout,
                            connect_timeout: timeout,
                        },
                    )
                    .unwrap_or_else(|e| panic!("rank {rank}: store: {e}"));
                    f(rank, Arc::new(store))
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
