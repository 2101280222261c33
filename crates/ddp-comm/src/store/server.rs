//! [`StoreServer`]: the listening side of the store, hosted by rank 0 or by `ddprun`.
//!
//! One background thread accepts connections and one thread serves each connection. All
//! connections share one map behind a mutex; blocking `get`/`wait` sleep on a condition variable
//! that every `set`, `add` and `compare_set` notifies, so waiting costs no CPU.
//!
//! A peer that breaks the protocol (garbage, oversized or truncated frames, a wrong secret) gets
//! an error reply where one can still be framed, and its connection is closed; the server never
//! panics on input and keeps serving everyone else. Dropping the [`StoreServer`] stops the accept
//! loop, closes every connection (clients blocked in `get` see an error at once) and joins all
//! threads.

use super::protocol::{
    self, read_frame, write_frame, ErrorKind, FrameError, Request, Response, MAX_FRAME,
    MAX_HANDSHAKE_FRAME, VERSION,
};
use crate::{Error, Result};
use std::collections::HashMap;
use std::io::{self, ErrorKind as IoKind};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an unauthenticated connection may take to send its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(60);

/// The store server. Serves until dropped.
pub struct StoreServer {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    /// A second handle on the listening socket, used to wake the accept loop on drop.
    listener: TcpListener,
    accept_thread: Option<JoinHandle<()>>,
}

struct Shared {
    state: Mutex<State>,
    /// Notified on every change of `state.data` and on shutdown.
    changed: Condvar,
    secret: Option<Vec<u8>>,
    local_addr: SocketAddr,
}

#[derive(Default)]
struct State {
    data: HashMap<String, Vec<u8>>,
    shutdown: bool,
    /// A clone of every open connection, so that shutdown can close them.
    conns: HashMap<u64, TcpStream>,
    next_conn: u64,
    threads: Vec<JoinHandle<()>>,
}

impl StoreServer {
    /// Listen on `addr` (e.g. `"0.0.0.0:29500"`, or `"127.0.0.1:0"` for any free port) and serve
    /// in background threads. With `secret`, clients must present the same secret (see
    /// [`super::SECRET_ENV`]); without, any client is accepted.
    pub fn bind(addr: &str, secret: Option<String>) -> Result<StoreServer> {
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
        let local_addr = listener
            .local_addr()
            .map_err(|e| Error::io(context.clone(), e))?;
        let wake = listener.try_clone().map_err(|e| Error::io(context, e))?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            secret: secret.map(String::into_bytes),
            local_addr,
        });
        let accept_shared = Arc::clone(&shared);
        let accept_thread = std::thread::Builder::new()
            .name(format!("ddp-store-accept-{}", local_addr.port()))
            .spawn(move || accept_loop(listener, accept_shared))
            .map_err(|e| Error::io("cannot start the store's accept thread", e))?;
        tracing::debug!(%local_addr, "store server listening");
        Ok(StoreServer {
            local_addr,
            shared,
            listener: wake,
            accept_thread: Some(accept_thread),
        })
    }

    /// The address the server listens on (with the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
}

impl std::fmt::Debug for StoreServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreServer")
            .field("local_addr", &self.local_addr)
            .field("secret", &self.shared.secret.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        let threads = {
            let mut st = lock(&self.shared.state);
            st.shutdown = true;
            for conn in st.conns.values() {
                let _ = conn.shutdown(Shutdown::Both);
            }
            std::mem::take(&mut st.threads)
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
        if let Some(accept) = self.accept_thread.take() {
            if !accept.is_finished() {
                let _ = TcpStream::connect_timeout(&wake_addr, Duration::from_millis(200));
            }
            let _ = accept.join();
        }
        // The accept loop has exited, so no thread is added after this.
        let late = std::mem::take(&mut lock(&self.shared.state).threads);
        for t in threads.into_iter().chain(late) {
            let _ = t.join();
        }
        tracing::debug!(local_addr = %self.local_addr, "store server stopped");
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding the lock cannot leave the map half-updated (every update is a single
    // map operation), so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let accepted = listener.accept();
        if lock(&shared.state).shutdown {
            return;
        }
        let (stream, peer) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // Transient (aborted handshake, out of file descriptors...): back off and retry.
                tracing::warn!(local_addr = %shared.local_addr, "store accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        let mut st = lock(&shared.state);
        if st.shutdown {
            return;
        }
        let id = st.next_conn;
        st.next_conn += 1;
        st.conns.insert(id, clone);
        st.threads.retain(|t| !t.is_finished());
        let conn_shared = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name(format!("ddp-store-conn-{id}"))
            .spawn(move || {
                serve_connection(stream, peer, &conn_shared);
                lock(&conn_shared.state).conns.remove(&id);
            });
        match spawned {
            Ok(handle) => st.threads.push(handle),
            Err(e) => {
                tracing::warn!("store cannot start a thread for {peer}: {e}");
                if let Some(c) = st.conns.remove(&id) {
                    let _ = c.shutdown(Shutdown::Both);
                }
            }
        }
    }
}

/// Compare two secrets in time independent of where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u64;
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= u64::from(x ^ y);
    }
    // Keep the optimiser from turning the loop into an early exit.
    std::hint::black_box(diff) == 0
}

fn send(stream: &mut TcpStream, resp: &Response) -> io::Result<()> {
    write_frame(stream, &resp.encode())
}

fn error_reply(kind: ErrorKind, message: impl Into<String>) -> Response {
    Response::Error {
        kind,
        message: message.into(),
    }
}

fn serve_connection(mut stream: TcpStream, peer: SocketAddr, shared: &Shared) {
    if !handshake(&mut stream, peer, shared) {
        return;
    }
    loop {
        let body = match read_frame(&mut stream, MAX_FRAME) {
            Ok(body) => body,
            Err(FrameError::Closed) => return,
            Err(e) => {
                if !lock(&shared.state).shutdown {
                    tracing::warn!(%peer, "store closes a connection: {e}");
                    if matches!(e, FrameError::TooLarge { .. } | FrameError::Empty) {
                        let _ = send(
                            &mut stream,
                            &error_reply(ErrorKind::Store, format!("bad frame: {e}")),
                        );
                    }
                }
                return;
            }
        };
        let resp = match Request::decode(&body) {
            Ok(Request::Hello { .. }) => error_reply(
                ErrorKind::Store,
                "unexpected second handshake on an established connection",
            ),
            Ok(req) => match execute(shared, req) {
                Some(resp) => resp,
                None => return, // shutting down: just close
            },
            Err(e) => {
                tracing::warn!(%peer, "store got a malformed request: {e}");
                error_reply(ErrorKind::Store, format!("malformed request: {e}"))
            }
        };
        if send(&mut stream, &resp).is_err() {
            return;
        }
    }
}

/// Read and check the `HELLO`; returns whether the connection may go on.
fn handshake(stream: &mut TcpStream, peer: SocketAddr, shared: &Shared) -> bool {
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let body = match read_frame(stream, MAX_HANDSHAKE_FRAME) {
        Ok(body) => body,
        Err(FrameError::Closed) => return false,
        Err(e) => {
            tracing::warn!(%peer, "store drops a connection before its handshake: {e}");
            if matches!(e, FrameError::TooLarge { .. } | FrameError::Empty) {
                let _ = send(
                    stream,
                    &error_reply(ErrorKind::Store, format!("bad handshake frame: {e}")),
                );
            }
            return false;
        }
    };
    match Request::decode(&body) {
        Ok(Request::Hello { version, secret }) => {
            if version != VERSION {
                let msg = format!(
                    "protocol version mismatch: the store speaks v{VERSION}, this client v{version} \
                     (mixing ddp-rs versions?)"
                );
                tracing::warn!(%peer, "store refuses a client: {msg}");
                let _ = send(stream, &error_reply(ErrorKind::Store, msg));
                return false;
            }
            if let Some(expected) = &shared.secret {
                if !constant_time_eq(expected, &secret) {
                    tracing::warn!(%peer, "store refuses a client with a wrong or missing secret");
                    let _ = send(stream, &Response::Refused);
                    return false;
                }
            }
            let _ = stream.set_read_timeout(None);
            send(stream, &Response::Ok).is_ok()
        }
        Ok(other) => {
            tracing::warn!(%peer, "store drops a client that sent {} before its handshake", other.name());
            let _ = send(
                stream,
                &error_reply(ErrorKind::Store, "expected a handshake first"),
            );
            false
        }
        Err(e) => {
            tracing::warn!(%peer, "store drops a connection with a bad handshake: {e}");
            let _ = send(
                stream,
                &error_reply(ErrorKind::Store, format!("bad handshake: {e}")),
            );
            false
        }
    }
}

/// Run one request against the shared map. `None` means the server is shutting down.
fn execute(shared: &Shared, req: Request) -> Option<Response> {
    let mut st = lock(&shared.state);
    if st.shutdown {
        return None;
    }
    let resp = match req {
        Request::Hello { .. } => unreachable!("handled by serve_connection"),
        Request::Set { key, value } => {
            st.data.insert(key, value);
            shared.changed.notify_all();
            Response::Ok
        }
        Request::Get { key, timeout_ms } => {
            let (guard, missing) = wait_for(shared, st, &[key.as_str()], timeout_ms);
            let guard = guard?;
            if missing.is_empty() {
                Response::Value(guard.data[&key].clone())
            } else {
                Response::Timeout(missing)
            }
        }
        Request::Wait { keys, timeout_ms } => {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            let (guard, missing) = wait_for(shared, st, &refs, timeout_ms);
            let _guard = guard?;
            if missing.is_empty() {
                Response::Ok
            } else {
                Response::Timeout(missing)
            }
        }
        Request::Add { key, delta } => {
            let current = match st.data.get(&key) {
                None => Ok(0),
                Some(raw) => parse_counter(raw),
            };
            match current.and_then(|cur| {
                cur.checked_add(delta)
                    .ok_or_else(|| format!("{cur} + {delta} overflows a 64-bit integer"))
            }) {
                Ok(new) => {
                    st.data.insert(key, new.to_string().into_bytes());
                    shared.changed.notify_all();
                    Response::Int(new)
                }
                Err(why) => error_reply(
                    ErrorKind::InvalidArgument,
                    format!("cannot add {delta} to store key {key:?}: {why}"),
                ),
            }
        }
        Request::CompareSet {
            key,
            expected,
            desired,
        } => match st.data.get_mut(&key) {
            Some(current) if *current == expected => {
                *current = desired.clone();
                shared.changed.notify_all();
                Response::Value(desired)
            }
            Some(current) => Response::Value(current.clone()),
            None if expected.is_empty() => {
                st.data.insert(key, desired.clone());
                shared.changed.notify_all();
                Response::Value(desired)
            }
            None => Response::Value(Vec::new()),
        },
        Request::Delete { key } => Response::Bool(st.data.remove(&key).is_some()),
        Request::NumKeys => Response::Count(st.data.len() as u64),
        Request::Check { key } => Response::Bool(st.data.contains_key(&key)),
    };
    Some(resp)
}

fn parse_counter(raw: &[u8]) -> std::result::Result<i64, String> {
    std::str::from_utf8(raw)
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .ok_or_else(|| {
            const SHOWN: usize = 64;
            let shown = String::from_utf8_lossy(&raw[..raw.len().min(SHOWN)]);
            let more = if raw.len() > SHOWN { "..." } else { "" };
            format!("its value {shown:?}{more} is not an integer")
        })
}

/// Wait until all `keys` exist or the timeout passes. Returns the guard (`None` on shutdown) and
/// the keys still missing (empty on success).
fn wait_for<'a>(
    shared: &'a Shared,
    mut st: MutexGuard<'a, State>,
    keys: &[&str],
    timeout_ms: u64,
) -> (Option<MutexGuard<'a, State>>, Vec<String>) {
    let deadline =
        protocol::timeout_from_ms(timeout_ms).and_then(|t| Instant::now().checked_add(t));
    loop {
        if st.shutdown {
            return (None, Vec::new());
        }
        let missing: Vec<String> = keys
            .iter()
            .filter(|k| !st.data.contains_key(**k))
            .map(|k| k.to_string())
            .collect();
        if missing.is_empty() {
            return (Some(st), missing);
        }
        st = match deadline {
            None => shared.changed.wait(st).unwrap_or_else(|p| p.into_inner()),
            Some(deadline) => {
                let now = Instant::now();
                if now >= deadline {
                    return (Some(st), missing);
                }
                shared
                    .changed
                    .wait_timeout(st, deadline - now)
                    .unwrap_or_else(|p| p.into_inner())
                    .0
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn constant_time_eq_compares_exactly() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
        assert!(!constant_time_eq(b"a\0", b"a"));
    }

    #[test]
    fn counters_parse_like_pytorch() {
        assert_eq!(parse_counter(b"42"), Ok(42));
        assert_eq!(parse_counter(b" -3\n"), Ok(-3));
        let err = parse_counter(b"abc").unwrap_err();
        assert!(err.contains("\"abc\" is not an integer"), "{err}");
        let err = parse_counter(&[0xff; 100]).unwrap_err();
        assert!(err.ends_with("... is not an integer"), "{err}");
    }

    #[test]
    fn drop_joins_threads_and_frees_the_port() {
        let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
        let addr = server.local_addr();
        // An idle connection that never sends its handshake must not keep the server alive.
        let mut idle = TcpStream::connect(addr).unwrap();
        idle.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let start = Instant::now();
        drop(server);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "drop took {:?}",
            start.elapsed()
        );
        let mut buf = [0u8; 1];
        assert!(
            matches!(idle.read(&mut buf), Ok(0) | Err(_)),
            "connection must be closed"
        );
        // The port is free again.
        let again = StoreServer::bind(&addr.to_string(), None).unwrap();
        assert_eq!(again.local_addr(), addr);
    }

    #[test]
    fn drop_of_a_server_on_the_unspecified_address_is_prompt() {
        let server = StoreServer::bind("0.0.0.0:0", None).unwrap();
        assert!(server.local_addr().ip().is_unspecified());
        let start = Instant::now();
        drop(server);
        assert!(start.elapsed() < Duration::from_secs(2));
    }
}
