//! [`StoreServer`]: the listening side of the store, hosted by rank 0 or by `ddprun`, and its
//! [`ServerOptions`].
//!
//! Two accept loops admit connections, a greeter watches the ones that have sent nothing yet
//! without a thread (both in `accept`), and one thread serves each connection that has (see
//! `serve`). The number of connections is bounded, so the threads and descriptors are too:
//!
//! - At most [`ServerOptions::max_connections`] connections are open at once (default: env
//!   [`MAX_CONNECTIONS_ENV`], else three quarters of the descriptor limit, at most 4096).
//! - Connections still in their handshake ("pending": not yet authenticated) are capped
//!   separately ([`ServerOptions::max_pending`]) and must finish the handshake within
//!   [`ServerOptions::handshake_timeout`] (5 s). When a new connection would exceed either cap,
//!   the oldest pending connection is closed to make room, preferring one that has not even sent
//!   a valid `HELLO` yet. Authenticated clients are never evicted: when they alone fill the
//!   limit, the newcomer gets an error naming the limit, and the server logs it.
//! - The accept loop never dies. When the process runs out of descriptors (`EMFILE`) it closes
//!   the oldest pending connection, or, with none, uses a reserved descriptor to accept the next
//!   connection and answer it with an error naming the descriptor limit; it logs at most one
//!   line per second per kind of trouble.
//!
//! Binding raises the process's soft descriptor limit to its hard limit ([`raise_fd_limit`]),
//! as Go's runtime does at start-up.

use super::accept;
pub use super::conns::MAX_CONNECTIONS_ENV;
use super::conns::{lock, Conns, Limits, Shared, State, Throttle};
use super::torch::DEFAULT_TORCH_PREFIX;
use crate::{Error, Result};
use std::io::ErrorKind as IoKind;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Default time an unauthenticated connection has to complete its handshake.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Upper bound of the default connection limit.
const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// Threads accepting connections.
const ACCEPT_THREADS: usize = 2;

use super::data::{DEFAULT_MAX_BYTES, MAX_BYTES_ENV};

/// How a [`StoreServer`] runs.
#[derive(Clone)]
pub struct ServerOptions {
    /// Shared secret clients must prove they know (see [`super::SECRET_ENV`]); `None` (or an
    /// empty string) accepts any client.
    pub secret: Option<String>,
    /// Most connections open at once. `None`: env [`MAX_CONNECTIONS_ENV`], else three quarters
    /// of the descriptor limit (after raising it), at most 4096.
    pub max_connections: Option<usize>,
    /// Most connections in their handshake at once. `None`: a quarter of `max_connections`
    /// (at least 8, at most 1024).
    pub max_pending: Option<usize>,
    /// Time a connection has to complete its handshake (default 5 s).
    pub handshake_timeout: Duration,
    /// Most bytes (keys and values together) the store holds; a write that would go past it is
    /// refused to its client with an error naming the cap. `None`: env [`MAX_BYTES_ENV`], else
    /// [`DEFAULT_MAX_BYTES`] (1 GiB).
    pub max_bytes: Option<u64>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            secret: None,
            max_connections: None,
            max_pending: None,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_bytes: None,
        }
    }
}

impl std::fmt::Debug for ServerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerOptions")
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("max_connections", &self.max_connections)
            .field("max_pending", &self.max_pending)
            .field("handshake_timeout", &self.handshake_timeout)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

/// Raise this process's soft limit on open file descriptors to its hard limit and return the
/// new soft limit (`None`: unlimited). Failing to raise it is not an error: the current limit is
/// returned.
pub fn raise_fd_limit() -> Option<u64> {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let lim = getrlimit(Resource::Nofile);
    // `None`: unlimited already.
    let soft = lim.current?;
    // An unlimited hard limit is not a valid soft value on Linux (it must stay below
    // fs.nr_open); 2^20 is the usual nr_open.
    let target = lim.maximum.unwrap_or(1 << 20);
    if target > soft {
        let raised = rustix::process::Rlimit {
            current: Some(target),
            maximum: lim.maximum,
        };
        if setrlimit(Resource::Nofile, raised).is_ok() {
            tracing::debug!(from = soft, to = target, "raised the soft descriptor limit");
            return Some(target);
        }
    }
    Some(soft)
}

/// The limits of a server with `opts` in a process allowed `fd_limit` descriptors.
fn resolve_limits(opts: &ServerOptions, fd_limit: Option<u64>) -> Result<Limits> {
    let max_connections = match opts.max_connections {
        Some(n) => n,
        None => match std::env::var(MAX_CONNECTIONS_ENV) {
            Ok(v) => v.trim().parse::<usize>().map_err(|_| {
                Error::Config(format!(
                    "{MAX_CONNECTIONS_ENV}={v:?} is not a positive integer"
                ))
            })?,
            Err(_) => {
                let fds = fd_limit.unwrap_or(u64::MAX);
                let usable = fds - fds / 4;
                usable.clamp(16, DEFAULT_MAX_CONNECTIONS as u64) as usize
            }
        },
    };
    if max_connections == 0 {
        return Err(Error::Config(format!(
                "the store's connection limit ({MAX_CONNECTIONS_ENV} / ServerOptions::max_connections) \
                 must be at least 1"
            )));
    }
    let max_pending = opts
        .max_pending
        .unwrap_or((max_connections / 4).clamp(8, 1024))
        .clamp(1, max_connections);
    let max_bytes = match opts.max_bytes {
        Some(n) => n,
        None => match std::env::var(MAX_BYTES_ENV) {
            Ok(v) => v.trim().parse::<u64>().map_err(|_| {
                Error::Config(format!(
                    "{MAX_BYTES_ENV}={v:?} is not a whole number of bytes"
                ))
            })?,
            Err(_) => DEFAULT_MAX_BYTES,
        },
    };
    if max_bytes == 0 {
        return Err(Error::Config(format!(
            "the store's cap on the bytes it holds ({MAX_BYTES_ENV} / \
                 ServerOptions::max_bytes) must be at least 1"
        )));
    }
    Ok(Limits {
        max_connections,
        max_pending,
        handshake_timeout: opts.handshake_timeout.max(Duration::from_millis(1)),
        max_bytes,
    })
}

/// The store server. Serves until dropped.
pub struct StoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    /// A second handle on the listening socket, used to wake the accept loop on drop.
    listener: TcpListener,
    accept_threads: Vec<JoinHandle<()>>,
    greeter_thread: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listen on `addr` (e.g. `"0.0.0.0:29500"`, or `"127.0.0.1:0"` for any free port) and serve
    /// in background threads. With `secret`, clients must prove they know the same secret (see
    /// [`super::SECRET_ENV`]); without, any client is accepted. Other settings are
    /// [`ServerOptions`]' defaults.
    pub fn bind(addr: &str, secret: Option<String>) -> Result<StoreServer> {
        StoreServer::bind_with(
            addr,
            ServerOptions {
                secret,
                ..ServerOptions::default()
            },
        )
    }

    /// [`StoreServer::bind`] with every setting.
    pub fn bind_with(addr: &str, opts: ServerOptions) -> Result<StoreServer> {
        let fd_limit = raise_fd_limit();
        let limits = resolve_limits(&opts, fd_limit)?;
        let context = format!("cannot host the store on {addr}");
        let listener = TcpListener::bind(addr).map_err(|e| match e.kind() {
            IoKind::AddrInUse => Error::Io {
                context: context.clone(),
                message: "address already in use (another job or store is listening there; \
                          pick another --master-port)"
                    .into(),
            },
            IoKind::AddrNotAvailable => Error::Io {
                context: context.clone(),
                message: "address not available on this machine (is MASTER_ADDR one of this \
                          host's interfaces? use 0.0.0.0 to listen on all of them)"
                    .into(),
            },
            IoKind::PermissionDenied => Error::Io {
                context: context.clone(),
                message: format!(
                    "{e} (ports below 1024 need privileges; pick another --master-port)"
                ),
            },
            _ => Error::io(context.clone(), e),
        })?;
        // A deep accept queue, so that a burst of connections does not make the kernel drop
        // the SYN of a legitimate client (which would cost it a 1 s retransmission). Calling
        // listen() again on a listening socket only changes its backlog; the kernel caps it at
        // net.core.somaxconn.
        let _ = rustix::net::listen(&listener, 4096);
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io(context.clone(), e))?;
        let wake = listener
            .try_clone()
            .map_err(|e| Error::io(context.clone(), e))?;
        let poller = rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)
            .map_err(|e| Error::io(context, e.into()))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::new(
                limits.max_bytes,
                DEFAULT_TORCH_PREFIX.to_string(),
            )),
            changed: Condvar::new(),
            secret: opts
                .secret
                .filter(|s| !s.is_empty())
                .map(String::into_bytes),
            local_addr,
            limits,
            conns: Mutex::new(Conns::default()),
            poller,
            log_handshake: Throttle::default(),
            log_accept: Throttle::default(),
            log_limit: Throttle::default(),
        });
        // Two accept loops on the one socket, so that a flood of connections made from several
        // threads does not outpace accepting on a loaded machine (every connection waiting in
        // the accept queue delays the ones behind it).
        let mut listeners = Vec::with_capacity(ACCEPT_THREADS);
        for _ in 1..ACCEPT_THREADS {
            listeners.push(
                listener
                    .try_clone()
                    .map_err(|e| Error::io("cannot share the store's listening socket", e))?,
            );
        }
        listeners.push(listener);
        let mut accept_threads = Vec::with_capacity(ACCEPT_THREADS);
        for listener in listeners {
            let accept_shared = Arc::clone(&shared);
            let thread = std::thread::Builder::new()
                .name(format!("ddp-store-accept-{}", local_addr.port()))
                .spawn(move || accept::accept_loop(listener, accept_shared))
                .map_err(|e| Error::io("cannot start the store's accept thread", e))?;
            accept_threads.push(thread);
        }
        let greeter_shared = Arc::clone(&shared);
        let greeter_thread = std::thread::Builder::new()
            .name(format!("ddp-store-greeter-{}", local_addr.port()))
            .spawn(move || accept::greeter(&greeter_shared))
            .map_err(|e| Error::io("cannot start the store's greeter thread", e))?;
        tracing::debug!(%local_addr, ?limits, fd_limit, "store server listening");
        Ok(StoreServer {
            local_addr,
            shared,
            listener: wake,
            accept_threads,
            greeter_thread: Some(greeter_thread),
        })
    }

    /// The address the server listens on (with the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Put the keys of PyTorch `TCPStore` clients that connect from now on under `prefix`
    /// (default `torch/`). `ddprun` gives each restart of the worker group its own prefix, so
    /// that restarted PyTorch workers never read the keys (addresses, counters) of the group
    /// before them, and they never see the keys of ddp-rs clients either.
    pub fn set_torch_prefix(&self, prefix: &str) {
        lock(&self.shared.state).torch_prefix = prefix.to_string();
    }

    /// The connection limit in force (see [`ServerOptions::max_connections`]).
    pub fn max_connections(&self) -> usize {
        self.shared.limits.max_connections
    }

    /// The most bytes (keys and values) this server holds (see [`ServerOptions::max_bytes`]).
    pub fn max_bytes(&self) -> u64 {
        self.shared.limits.max_bytes
    }
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("local_addr", &self.local_addr)
            .field("secret", &self.shared.secret.as_ref().map(|_| "<redacted>"))
            .field("limits", &self.shared.limits)
            .finish()
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        lock(&self.shared.state).shutdown = true;
        let threads = {
            let mut c = self.shared.conns();
            c.shutdown = true;
            for e in c.map.values() {
                let _ = e.stream.shutdown(Shutdown::Both);
            }
            std::mem::take(&mut c.threads)
        };
        self.shared.changed.notify_all();
        // On Linux, shutting down a listening socket wakes a blocked accept() with an error;
        // connecting to ourselves covers other platforms (it is refused harmlessly otherwise).
        let _ = rustix::net::shutdown(&self.listener, rustix::net::Shutdown::Read);
        let mut wake_addr = self.local_addr;
        if wake_addr.ip().is_unspecified() {
            wake_addr.set_ip(match wake_addr {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        for accept in std::mem::take(&mut self.accept_threads) {
            if !accept.is_finished() {
                let _ = TcpStream::connect_timeout(&wake_addr, Duration::from_millis(200));
            }
            let _ = accept.join();
        }
        if let Some(greeter) = self.greeter_thread.take() {
            let _ = greeter.join();
        }
        // The accept loop has exited, so no thread is added after this.
        let late = std::mem::take(&mut self.shared.conns().threads);
        for t in threads.into_iter().chain(late) {
            let _ = t.join();
        }
        self.shared.conns().map.clear();
        tracing::debug!(local_addr = %self.local_addr, "store server stopped");
    }
}
