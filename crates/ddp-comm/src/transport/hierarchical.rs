//! The transport of a group whose ranks run on several hosts, some host with two or more:
//! backend `auto` picks it ([`crate::backend::select`]). It owns three views of the group:
//!
//! ```text
//!            host 0                          host 1
//!   ┌──────────────────────┐      ┌─────────────────────────────┐
//!   │ rank 0 ══shm══ rank 1 │      │ rank 2 ══shm══ rank 3, 4    │   local: one shm segment per
//!   │ (leader)             │      │ (leader)                    │   host (store prefix hier/<h>/,
//!   └───┬──────────────────┘      └───┬─────────────────────────┘   local ranks 0.. in group order)
//!       └────────── tcp ──────────────┘                             leaders: the mesh restricted
//!   mesh: TCP between every pair of ranks (0..4), the group's general transport   to ranks [0, 2]
//! ```
//!
//! - The **mesh** ([`TcpTransport`]) is what the [`Transport`] methods use, so every collective
//!   works unchanged on it, over TCP (also between ranks of one host).
//! - The **local** [`ShmTransport`] connects the ranks of this host; its ranks are renumbered
//!   `0..k` in group-rank order, so local rank 0 is the host's *leader* (its lowest rank).
//! - The **leaders** view ([`Subset`] of the mesh) connects the hosts' leaders.
//!
//! All-reduce and broadcast use local and leaders, in [`crate::algorithms::hierarchical`]. Every
//! collective starts on both transports ([`Transport::begin`]: same fingerprint and deadline);
//! an abort aborts both, so a failure anywhere reaches every rank: the local ranks through the
//! segment, the other hosts through the mesh (and their leaders pass it on to their hosts).
//! Errors of the local transport are renumbered to group ranks ([`HierarchicalTransport::local_error`]).
//!
//! Unlike a one-host group under `auto`, a host that cannot create its segment does not fall
//! back to TCP (the hosts would then run different all-reduces): initialization fails, and
//! `DDP_BACKEND=tcp` is the way around it.

use super::shm::ShmTransport;
use super::subset::Subset;
use super::tcp::TcpTransport;
use super::{Fingerprint, RecvFrom, SendTo, Transport};
use crate::host::HostLayout;
use crate::store::{PrefixStore, Store};
use crate::{Error, Result};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A TCP mesh over the whole group plus shared memory inside each host (see the module doc).
pub struct HierarchicalTransport {
    mesh: TcpTransport,
    local: ShmTransport,
    /// Group ranks on this host, ascending: local rank `l` is group rank `local_ranks[l]`.
    local_ranks: Vec<usize>,
    /// Each host's leader (lowest group rank), by host index (hence ascending).
    leaders: Vec<usize>,
    /// Ranks per host, by host index.
    per_host: Vec<usize>,
    /// Host index of every group rank.
    host_of: Vec<usize>,
}

impl HierarchicalTransport {
    /// Connect the mesh (keys of `store`), then this host's segment (keys under `hier/<host>/`).
    pub fn connect(
        store: &Arc<dyn Store>,
        rank: usize,
        size: usize,
        local_ip: IpAddr,
        timeout: Duration,
        layout: &HostLayout,
    ) -> Result<HierarchicalTransport> {
        let mesh = TcpTransport::connect_mesh(&**store, rank, size, local_ip, timeout)?;
        let host = layout.host_of[rank];
        let local_ranks = layout.ranks_on(host);
        let local_rank = local_ranks.iter().position(|&r| r == rank).unwrap();
        let local_store = PrefixStore::new(format!("hier/{host}"), store.clone());
        let local = ShmTransport::connect(&local_store, local_rank, local_ranks.len(), timeout)
            .map_err(|e| match e {
                Error::Io { context, message } => Error::Io {
                    context: format!(
                        "shared memory among ranks {local_ranks:?} on this host (DDP_BACKEND=tcp avoids it): {context}"
                    ),
                    message,
                },
                e => e,
            })?;
        let hosts = layout.hosts();
        Ok(HierarchicalTransport {
            mesh,
            local,
            leaders: (0..hosts).map(|h| layout.ranks_on(h)[0]).collect(),
            per_host: (0..hosts).map(|h| layout.ranks_on(h).len()).collect(),
            host_of: layout.host_of.clone(),
            local_ranks,
        })
    }

    /// This host's shared-memory transport (local numbering; local rank 0 is the leader).
    pub fn local(&mut self) -> &mut ShmTransport {
        &mut self.local
    }

    /// The hosts' leaders over the mesh (numbered by host), on a leader; `None` elsewhere.
    pub fn leaders(&mut self) -> Option<Subset<'_>> {
        Subset::new(&mut self.mesh, &self.leaders)
    }

    /// Where group rank `r` runs: its host index (= its leader's rank among the leaders) and,
    /// when that is this host, its local rank.
    pub fn locate(&self, r: usize) -> (usize, Option<usize>) {
        (
            self.host_of[r],
            self.local_ranks.iter().position(|&l| l == r),
        )
    }

    /// Ranks per host, by host index.
    pub fn per_host(&self) -> &[usize] {
        &self.per_host
    }

    /// Log a warning when a collective waits `every` for its peers, and again every `every`
    /// (`None`: never), on the mesh and on this host's shared memory (naming group ranks).
    pub fn set_warn_after(&mut self, every: Option<Duration>) {
        self.mesh.set_warn_after(every);
        self.local
            .set_warn_after(every, Some(self.local_ranks.clone()));
    }

    /// `e`, from the local transport, with its ranks renumbered to group ranks (texts from the
    /// segment may still use local numbers: the reason says how they map).
    pub fn local_error(&self, e: Error) -> Error {
        let g = |l: usize| self.local_ranks.get(l).copied().unwrap_or(l);
        match e {
            Error::PeerFailed {
                peer,
                fingerprint,
                reason,
            } => Error::PeerFailed {
                peer: g(peer),
                fingerprint,
                reason: format!(
                    "{reason} [host shm: local ranks 0.. are group ranks {:?}]",
                    self.local_ranks
                ),
            },
            Error::Mismatch {
                rank,
                peer,
                local,
                local_bytes,
                remote,
                remote_bytes,
            } => Error::Mismatch {
                rank: g(rank),
                peer: g(peer),
                local,
                local_bytes,
                remote,
                remote_bytes,
            },
            Error::Aborted(inner) => Error::Aborted(Box::new(self.local_error(*inner))),
            e => e,
        }
    }
}

impl Transport for HierarchicalTransport {
    fn rank(&self) -> usize {
        self.mesh.rank()
    }

    fn size(&self) -> usize {
        self.mesh.size()
    }

    fn begin(&mut self, fp: Fingerprint, deadline: Instant) {
        self.mesh.begin(fp, deadline);
        self.local.begin(fp, deadline);
    }

    fn exchange(&mut self, sends: &mut [SendTo<'_>], recvs: &mut [RecvFrom<'_>]) -> Result<()> {
        self.mesh.exchange(sends, recvs)
    }

    fn abort(&mut self, cause: &Error) {
        self.mesh.abort(cause);
        self.local.abort(cause);
    }
}
