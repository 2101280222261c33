//! A hook point for observers of collectives (timelines, profilers): a group with an observer
//! ([`ProcessGroup::set_observer`](crate::ProcessGroup::set_observer)) reports every collective
//! its engine thread runs, with its fingerprint, bytes, start and end, on that thread. Without
//! an observer the engine pays one atomic load per collective.

use crate::backend::Topology;
use crate::transport::Fingerprint;
use std::time::Instant;

/// One collective as the group's engine thread ran it.
#[derive(Debug, Clone, Copy)]
pub struct CollectiveEvent<'a> {
    /// What ran (operation, dtype, element count) and its sequence number.
    pub fingerprint: &'a Fingerprint,
    /// Payload bytes of this rank's buffer (element count × element size).
    pub bytes: u64,
    /// When the engine thread started it (after every collective queued before it).
    pub start: Instant,
    /// When it completed (or failed).
    pub end: Instant,
    /// Whether it succeeded.
    pub ok: bool,
    /// The group's rank and size, and what its backend resolved to.
    pub rank: usize,
    pub size: usize,
    pub topology: &'a Topology,
}

impl CollectiveEvent<'_> {
    /// The operation's name (`all_reduce`, `barrier`, ...).
    pub fn op_name(&self) -> &'static str {
        self.fingerprint.op.name()
    }
}

/// Receives every collective of the groups it observes, on their engine threads: keep it short.
pub trait CollectiveObserver: Send + Sync {
    fn collective(&self, event: &CollectiveEvent<'_>);
}
