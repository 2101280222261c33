//! The state every thread of a [`super::StoreServer`] shares: the key-value [`State`], the open
//! connections ([`Conns`]: each one's [`Phase`], the limits that bound them and who is evicted
//! first), the admission of a new connection and the throttled logs. The threads that use it
//! (`accept`, `serve`, `torch`) and the server that creates it (`server`) all sit above this
//! module, which imports none of them.

use super::data::Data;
use super::sniff::{first_bytes, FirstBytes};
use std::collections::BTreeMap;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Environment variable bounding the number of open store connections.
pub const MAX_CONNECTIONS_ENV: &str = "DDP_STORE_MAX_CONNECTIONS";

/// The resolved limits of one server.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    pub(super) max_connections: usize,
    pub(super) max_pending: usize,
    pub(super) handshake_timeout: Duration,
    pub(super) max_bytes: u64,
}

/// What every thread of a server shares.
pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    /// Notified on every change of `state.data` and on shutdown.
    pub(super) changed: Condvar,
    pub(super) secret: Option<Vec<u8>>,
    pub(super) local_addr: SocketAddr,
    pub(super) limits: Limits,
    pub(super) conns: Mutex<Conns>,
    /// Connections that have sent nothing yet wait here, without a thread (see `greeter`).
    pub(super) poller: rustix::fd::OwnedFd,
    pub(super) log_handshake: Throttle,
    pub(super) log_accept: Throttle,
    pub(super) log_limit: Throttle,
}

/// The key-value data.
pub(super) struct State {
    pub(super) data: Data,
    pub(super) shutdown: bool,
    /// Where the keys of PyTorch clients live (see `torch`); read when such a client connects.
    pub(super) torch_prefix: String,
}

impl State {
    pub(super) fn new(max_bytes: u64, torch_prefix: String) -> State {
        State {
            data: Data::new(max_bytes),
            shutdown: false,
            torch_prefix,
        }
    }
}

/// Where a connection is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Accepted, nothing received yet: watched by the greeter, no thread.
    Connected,
    /// Bytes arrived: a thread reads the `HELLO`.
    Greeted,
    /// Valid `HELLO` received, challenge sent, waiting for the proof.
    Challenged,
    /// May use the store.
    Authenticated,
}

pub(super) struct Entry {
    pub(super) stream: Arc<TcpStream>,
    pub(super) phase: Phase,
    pub(super) peer: SocketAddr,
    pub(super) since: Instant,
}

/// Every open connection, oldest (lowest id) first.
#[derive(Default)]
pub(super) struct Conns {
    pub(super) map: BTreeMap<u64, Entry>,
    next: u64,
    pub(super) pending: usize,
    pub(super) authenticated: usize,
    pub(super) threads: Vec<JoinHandle<()>>,
    pub(super) shutdown: bool,
}

impl Entry {
    /// Close the connection: at once when no thread holds it, else by waking its thread.
    pub(super) fn close(self) -> SocketAddr {
        if Arc::strong_count(&self.stream) > 1 {
            let _ = self.stream.shutdown(Shutdown::Both);
        }
        self.peer
    }
}

impl Conns {
    pub(super) fn forget(&mut self, id: u64) -> Option<Entry> {
        let e = self.map.remove(&id)?;
        match e.phase {
            Phase::Authenticated => self.authenticated -= 1,
            _ => self.pending -= 1,
        }
        Some(e)
    }

    /// Close the oldest pending connection, preferring, in this order: one that has sent
    /// nothing, hung up or sent what cannot be a `HELLO`; one whose `HELLO` waits unread; one
    /// whose thread reads its `HELLO`; one waiting for its proof. Returns its peer and whether its descriptor is closed
    /// already (no thread held it).
    pub(super) fn evict_oldest_pending(&mut self) -> Option<(SocketAddr, bool)> {
        if self.pending == 0 {
            return None;
        }
        let (mut with_data, mut greeted, mut challenged) = (None, None, None);
        let mut idle = None;
        for (id, e) in &self.map {
            match e.phase {
                Phase::Connected if !matches!(first_bytes(&e.stream), FirstBytes::Plausible) => {
                    idle = Some(*id);
                    break;
                }
                Phase::Connected => {
                    with_data.get_or_insert(*id);
                }
                Phase::Greeted => {
                    greeted.get_or_insert(*id);
                }
                Phase::Challenged => {
                    challenged.get_or_insert(*id);
                }
                Phase::Authenticated => {}
            }
        }
        let id = idle.or(with_data).or(greeted).or(challenged)?;
        let e = self.forget(id)?;
        let closed = e.phase == Phase::Connected && Arc::strong_count(&e.stream) == 1;
        Some((e.close(), closed))
    }
}

/// Logs at most one line per second; counts the ones it swallowed.
#[derive(Default)]
pub(super) struct Throttle(Mutex<(Option<Instant>, u64)>);

impl Throttle {
    pub(super) fn warn(&self, local_addr: SocketAddr, message: impl FnOnce() -> String) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if g.0
            .is_some_and(|last| now.duration_since(last) < Duration::from_secs(1))
        {
            g.1 += 1;
            return;
        }
        let suppressed = std::mem::take(&mut g.1);
        g.0 = Some(now);
        drop(g);
        if suppressed > 0 {
            tracing::warn!(%local_addr, "{} ({suppressed} similar messages suppressed)", message());
        } else {
            tracing::warn!(%local_addr, "{}", message());
        }
    }
}

/// What the accept loop does with a new connection.
pub(super) enum Admission {
    Serve(u64, Arc<TcpStream>),
    Refuse(TcpStream, String),
    ShuttingDown,
}

impl Shared {
    pub(super) fn conns(&self) -> MutexGuard<'_, Conns> {
        self.conns.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn limit_message(&self) -> String {
        format!(
            "the store is at its connection limit: {} connections are open and authenticated \
             (set {MAX_CONNECTIONS_ENV} on the store's host to raise the limit, or close idle \
             clients)",
            self.limits.max_connections
        )
    }

    pub(super) fn admit(&self, stream: TcpStream, peer: SocketAddr) -> Admission {
        let mut c = self.conns();
        if c.shutdown {
            return Admission::ShuttingDown;
        }
        let mut evicted = Vec::new();
        if c.pending >= self.limits.max_pending {
            evicted.extend(c.evict_oldest_pending());
        }
        if c.pending + c.authenticated >= self.limits.max_connections {
            match c.evict_oldest_pending() {
                Some(e) => evicted.push(e),
                None => return Admission::Refuse(stream, self.limit_message()),
            }
        }
        let id = c.next;
        c.next += 1;
        let stream = Arc::new(stream);
        c.map.insert(
            id,
            Entry {
                stream: Arc::clone(&stream),
                phase: Phase::Connected,
                peer,
                since: Instant::now(),
            },
        );
        c.pending += 1;
        let pending = c.pending;
        drop(c);
        for (peer, _) in evicted {
            self.log_limit.warn(self.local_addr, || {
                format!(
                    "store closes the pending connection from {peer}: {pending} connections are \
                     in their handshake (limit {}, of {} connections in all)",
                    self.limits.max_pending, self.limits.max_connections
                )
            });
        }
        Admission::Serve(id, stream)
    }

    /// Move connection `id` to `phase`; `false` if it was evicted meanwhile (then it must end).
    pub(super) fn set_phase(&self, id: u64, phase: Phase) -> bool {
        let mut c = self.conns();
        let c = &mut *c;
        let Some(e) = c.map.get_mut(&id) else {
            return false;
        };
        if phase == Phase::Authenticated && e.phase != Phase::Authenticated {
            c.pending -= 1;
            c.authenticated += 1;
        }
        e.phase = phase;
        true
    }
}

pub(super) fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding the lock cannot leave the map half-updated (every update is a single
    // map operation), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}
