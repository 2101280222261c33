//! [`TcpStore`]: the connecting side of the store, and its [`StoreOptions`].
//!
//! A `TcpStore` holds one TCP connection to a [`super::StoreServer`] behind a mutex, so it can be
//! shared between threads (requests from different threads are serialised). Connecting retries
//! until the server is up or `connect_timeout` passes, like PyTorch's `TCPStore`. Blocking
//! operations send their timeout to the server, which answers "timed out" itself; the client's
//! socket timeout is a little longer so that a dead or unreachable server is detected as well.
//!
//! A blocking `get`/`wait` occupies the connection until it returns: other threads' requests on
//! the same `TcpStore` queue behind it. Give each user that blocks concurrently its own
//! connection ([`TcpStore::try_clone`]).
//!
//! The handshake proves the shared secret without sending it (see [`super::auth`]) and, when
//! the client has a secret, checks that the server knows it too: a client with a secret refuses
//! a server that does not ask for one. When the server closes the connection during the
//! handshake (it evicts the oldest unauthenticated connections when flooded), the client
//! reconnects a few times within `connect_timeout`.
//!
//! After any I/O failure the connection is considered broken and every later call fails with an
//! error naming the store address (use [`TcpStore::try_clone`] to open a fresh connection).

use super::auth::{self, Side};
use super::protocol::{
    read_frame, timeout_to_ms, write_frame, ErrorKind, FrameError, Request, Response, MAX_FRAME,
    MAX_KEY_LEN, MAX_VALUE_LEN, VERSION,
};
use super::{Store, DEFAULT_STORE_TIMEOUT, SECRET_ENV};
use crate::{Error, Result};
use std::io::ErrorKind as IoKind;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Extra time the client waits for a reply beyond the operation's own timeout, before declaring
/// the server dead.
const REPLY_MARGIN: Duration = Duration::from_secs(5);

/// How to connect to a store.
#[derive(Clone)]
pub struct StoreOptions {
    /// Shared secret presented to the server; must match the server's if it has one.
    pub secret: Option<String>,
    /// Default timeout of blocking operations ([`Store::get`], ...).
    pub timeout: Duration,
    /// How long to keep retrying the initial connection while the server is not up yet.
    pub connect_timeout: Duration,
}

impl Default for StoreOptions {
    /// Secret from `DDP_STORE_SECRET` (if set and non-empty), timeout
    /// [`DEFAULT_STORE_TIMEOUT`] (5 min), connect timeout 60 s.
    fn default() -> Self {
        StoreOptions {
            secret: secret_from(std::env::var_os(SECRET_ENV)),
            timeout: DEFAULT_STORE_TIMEOUT,
            connect_timeout: Duration::from_secs(60),
        }
    }
}

impl std::fmt::Debug for StoreOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreOptions")
            .field("secret", &self.secret.as_ref().map(|_| "<redacted>"))
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .finish()
    }
}

fn secret_from(value: Option<std::ffi::OsString>) -> Option<String> {
    value
        .map(|v| v.to_string_lossy().into_owned())
        .filter(|s| !s.is_empty())
}

/// A client connection to a [`super::StoreServer`].
pub struct TcpStore {
    addr: String,
    opts: StoreOptions,
    local_addr: SocketAddr,
    conn: Mutex<Conn>,
}

struct Conn {
    stream: TcpStream,
    /// Why the connection was abandoned, if it was.
    broken: Option<String>,
    /// The server closed the connection (rather than answering badly or timing out).
    closed_by_peer: bool,
}

/// Reconnections after the server closed the connection during the handshake.
const HANDSHAKE_RETRIES: u32 = 4;

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpStore")
            .field("addr", &self.addr)
            .field("local_addr", &self.local_addr)
            .field("opts", &self.opts)
            .finish()
    }
}

impl TcpStore {
    /// Connect to the store at `addr` (`HOST:PORT`), retrying until `opts.connect_timeout`
    /// while nobody listens there yet, then perform the handshake.
    pub fn connect(addr: &str, opts: StoreOptions) -> Result<TcpStore> {
        let start = Instant::now();
        let mut retries = 0;
        let mut first_error = None;
        loop {
            let window = match first_error {
                None => opts.connect_timeout,
                // Reconnecting after an eviction: briefly, and report the first failure if the
                // server is gone.
                Some(_) => opts
                    .connect_timeout
                    .saturating_sub(start.elapsed())
                    .min(Duration::from_secs(1)),
            };
            let stream = match connect_with_retry(addr, window) {
                Ok(s) => s,
                Err(e) => return Err(first_error.unwrap_or(e)),
            };
            let store = TcpStore::over(addr, stream, opts.clone())?;
            match store.handshake() {
                Ok(()) => return Ok(store),
                Err(e) => {
                    let dropped = store.lock().closed_by_peer;
                    let time_left = start.elapsed() < opts.connect_timeout;
                    if !dropped || retries >= HANDSHAKE_RETRIES || !time_left {
                        return Err(first_error.unwrap_or(e));
                    }
                    tracing::debug!(
                        addr,
                        "store closed the connection during the handshake; reconnecting: {e}"
                    );
                    retries += 1;
                    first_error.get_or_insert(e);
                    std::thread::sleep(Duration::from_millis(10 << retries));
                }
            }
        }
    }

    fn over(addr: &str, stream: TcpStream, opts: StoreOptions) -> Result<TcpStore> {
        let local_addr = stream.local_addr().map_err(|e| Error::Store {
            addr: addr.to_string(),
            message: format!("cannot read the local address: {e}"),
        })?;
        let _ = stream.set_nodelay(true);
        Ok(TcpStore {
            addr: addr.to_string(),
            local_addr,
            conn: Mutex::new(Conn {
                stream,
                broken: None,
                closed_by_peer: false,
            }),
            opts,
        })
    }

    /// Prove the secret without sending it, and check the server's proof (see [`super::auth`]).
    fn handshake(&self) -> Result<()> {
        let store_err = |message: String| Error::Store {
            addr: self.addr.clone(),
            message,
        };
        let refused = || {
            store_err(
                "refused this client: wrong or missing shared secret (DDP_STORE_SECRET)".into(),
            )
        };
        let client_nonce =
            auth::nonce().map_err(|e| store_err(format!("cannot draw a random nonce: {e}")))?;
        let reply_within = self.opts.connect_timeout.max(Duration::from_secs(1));
        let hello = Request::Hello {
            version: VERSION,
            nonce: client_nonce.to_vec(),
        };
        let key = self.opts.secret.as_deref().unwrap_or("").as_bytes();
        match self.request(&hello, reply_within)? {
            Response::Ok if self.opts.secret.is_some() => Err(store_err(
                "the store accepted this client without asking for the shared secret: it runs \
                 without DDP_STORE_SECRET while this client has one (or it is not your job's \
                 store), so it cannot be trusted with this job's data"
                    .into(),
            )),
            Response::Ok => Ok(()),
            Response::Challenge(server_nonce) => {
                let proof = auth::proof(key, Side::Client, &client_nonce, &server_nonce);
                match self.request(&Request::Auth { proof }, reply_within)? {
                    Response::Welcome(theirs)
                        if auth::verify(
                            key,
                            Side::Server,
                            &client_nonce,
                            &server_nonce,
                            &theirs,
                        ) =>
                    {
                        Ok(())
                    }
                    Response::Welcome(_) => Err(store_err(
                        "the store could not prove that it knows the shared secret \
                         (DDP_STORE_SECRET): it is not your job's store, or something on the way \
                         tampered with the handshake"
                            .into(),
                    )),
                    Response::Refused => Err(refused()),
                    other => Err(unexpected(&self.addr, "authentication", &other)),
                }
            }
            Response::Refused => Err(refused()),
            other => Err(unexpected(&self.addr, "handshake", &other)),
        }
    }

    /// The local end of the connection: the address of the interface this host uses to reach
    /// the store (the process group publishes this IP for its peers).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The store address as given to [`TcpStore::connect`].
    pub fn server_addr(&self) -> String {
        self.addr.clone()
    }

    /// Open a new, independent connection to the same store with the same options (including
    /// the current timeout).
    pub fn try_clone(&self) -> Result<TcpStore> {
        TcpStore::connect(&self.addr, self.opts.clone())
    }

    /// Change the default timeout of blocking operations.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.opts.timeout = timeout;
    }

    fn lock(&self) -> MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Send `req` and read its reply, giving the server `reply_within` to answer. `Error`
    /// replies are turned into errors here; any transport failure breaks the connection.
    fn request(&self, req: &Request, reply_within: Duration) -> Result<Response> {
        let mut conn = self.lock();
        let what = describe(req);
        if let Some(why) = &conn.broken {
            return Err(Error::Store {
                addr: self.addr.clone(),
                // No API advice here: launchers show this to users (the module doc says how
                // to reconnect).
                message: format!("{what} failed: the connection was lost earlier ({why})"),
            });
        }
        let limit = Some(reply_within.max(Duration::from_millis(1)));
        let io_result = conn
            .stream
            .set_write_timeout(limit)
            .and_then(|()| conn.stream.set_read_timeout(limit))
            .map_err(|e| (format!("cannot set socket timeouts: {e}"), false))
            .and_then(|()| {
                write_frame(&mut conn.stream, &req.encode()).map_err(|e| match e.kind() {
                    IoKind::WouldBlock | IoKind::TimedOut => (format!(
                        "could not send the request within {reply_within:?} (the store host may be down or unreachable)"
                    ), false),
                    _ => (format!("connection lost while sending the request: {e} (did the master exit?)"), true),
                })
            })
            .and_then(|()| {
                read_frame(&mut conn.stream, MAX_FRAME).map_err(|e| match e {
                    FrameError::Closed | FrameError::Truncated { .. } => (
                        "the store closed the connection (did the master exit?)".to_string(),
                        true,
                    ),
                    FrameError::Io(e)
                        if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut) =>
                    {
                        (format!(
                            "no reply within {reply_within:?} (the store host may be down or unreachable)"
                        ), false)
                    }
                    FrameError::Io(e) => (format!("connection lost: {e} (did the master exit?)"), true),
                    other => (format!("protocol error: {other}"), false),
                })
            })
            .and_then(|body| {
                Response::decode(&body)
                    .map_err(|e| (format!("protocol error in the reply: {e}"), false))
            });
        match io_result {
            Ok(Response::Error { kind, message }) => Err(match kind {
                ErrorKind::InvalidArgument => Error::InvalidArgument(message),
                ErrorKind::Store => Error::Store {
                    addr: self.addr.clone(),
                    message: format!("{what} failed: {message}"),
                },
            }),
            Ok(resp) => Ok(resp),
            Err((why, closed)) => {
                let _ = conn.stream.shutdown(std::net::Shutdown::Both);
                conn.broken = Some(why.clone());
                conn.closed_by_peer = closed;
                let message = if matches!(req, Request::Hello { .. } | Request::Auth { .. }) {
                    format!(
                        "handshake failed ({why}): is {} really a ddp-rs store \
                         (MASTER_PORT pointing at another service?), or is the store flooded \
                         with connections that never authenticate?",
                        self.addr
                    )
                } else {
                    format!("{what}: {why}")
                };
                Err(Error::Store {
                    addr: self.addr.clone(),
                    message,
                })
            }
        }
    }

    /// A request whose reply is immediate; the default timeout bounds the wait for it.
    fn quick(&self, req: &Request) -> Result<Response> {
        self.request(req, self.opts.timeout.saturating_add(REPLY_MARGIN))
    }
}

fn describe(req: &Request) -> String {
    match req {
        Request::Hello { .. } => "handshake".into(),
        Request::Auth { .. } => "authentication".into(),
        Request::Set { key, .. }
        | Request::Get { key, .. }
        | Request::Add { key, .. }
        | Request::CompareSet { key, .. }
        | Request::Delete { key }
        | Request::Check { key } => format!("{} of key {key:?}", req.name()),
        Request::Wait { keys, .. } => format!("wait for keys {keys:?}"),
        Request::NumKeys => "num_keys".into(),
    }
}

fn unexpected(addr: &str, what: &str, resp: &Response) -> Error {
    Error::Store {
        addr: addr.to_string(),
        message: format!("unexpected reply to {what}: {resp:?} (mixing ddp-rs versions?)"),
    }
}

fn check_key(key: &str) -> Result<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidArgument(format!(
            "store key of {} bytes ({:?}...) exceeds the limit of {MAX_KEY_LEN} bytes",
            key.len(),
            key.chars().take(32).collect::<String>()
        )));
    }
    Ok(())
}

fn check_value(key: &str, what: &str, value: &[u8]) -> Result<()> {
    if value.len() > MAX_VALUE_LEN {
        return Err(Error::InvalidArgument(format!(
            "{what} for store key {key:?} is {} bytes, the limit is {MAX_VALUE_LEN} bytes",
            value.len()
        )));
    }
    Ok(())
}

fn timeout_error(keys: Vec<String>, timeout: Duration) -> Error {
    Error::Timeout {
        what: format!(
            "store key(s) [{}]",
            crate::env::list_bounded(
                keys.iter().map(|k| format!("{k:?}")),
                crate::env::LIST_SHOWN
            )
        ),
        timeout,
    }
}

/// Connect to `addr`, retrying with backoff while nothing listens there, until `timeout`.
fn connect_with_retry(addr: &str, timeout: Duration) -> Result<TcpStream> {
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
            if port.parse::<u16>() == Ok(0) {
                return Err(Error::Config(format!(
                    "invalid store address {addr:?}: port 0 means \"any free port\" to a server, \
                     and nothing can connect to it; MASTER_PORT=0 only works with a launcher that \
                     picks the port and passes it on (ddprun --master-port 0), so set a fixed \
                     MASTER_PORT such as 29500"
                )));
            }
        }
        _ => {
            return Err(Error::Config(format!(
                "invalid store address {addr:?}: expected HOST:PORT (MASTER_ADDR:MASTER_PORT)"
            )))
        }
    }
    let start = Instant::now();
    let deadline = start.checked_add(timeout);
    let mut backoff = Duration::from_millis(10);
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let remaining = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let last_error = match addr.to_socket_addrs() {
            Ok(candidates) => {
                let mut last = String::from("the address resolved to nothing");
                for sa in candidates {
                    let per_try = remaining
                        .unwrap_or(Duration::MAX)
                        .clamp(Duration::from_millis(10), Duration::from_secs(10));
                    match TcpStream::connect_timeout(&sa, per_try) {
                        Ok(stream) => {
                            tracing::debug!(addr, attempts, elapsed = ?start.elapsed(), "connected to the store");
                            return Ok(stream);
                        }
                        Err(e) => last = format!("{sa}: {e}"),
                    }
                }
                last
            }
            Err(e) => format!("cannot resolve: {e}"),
        };
        let remaining = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if remaining == Some(Duration::ZERO) {
            return Err(Error::Timeout {
                what: format!(
                    "the store at {addr} to answer ({attempts} attempts, last error: {last_error}; \
                     is the master (rank 0 / ddprun on node 0) running and MASTER_ADDR/MASTER_PORT right?)"
                ),
                timeout,
            });
        }
        std::thread::sleep(backoff.min(remaining.unwrap_or(backoff)));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        check_value(key, "value", value)?;
        let req = Request::Set {
            key: key.to_string(),
            value: value.to_vec(),
        };
        match self.quick(&req)? {
            Response::Ok => Ok(()),
            other => Err(unexpected(&self.addr, &describe(&req), &other)),
        }
    }

    fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        check_key(key)?;
        let req = Request::Get {
            key: key.to_string(),
            timeout_ms: timeout_to_ms(timeout),
        };
        match self.request(&req, timeout.saturating_add(REPLY_MARGIN))? {
            Response::Value(v) => Ok(v),
            Response::Timeout(missing) => Err(timeout_error(missing, timeout)),
            other => Err(unexpected(&self.addr, &describe(&req), &other)),
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        check_key(key)?;
        let req = Request::Add {
            key: key.to_string(),
            delta,
        };
        match self.quick(&req)? {
            Response::Int(v) => Ok(v),
            other => Err(unexpected(&self.addr, &describe(&req), &other)),
        }
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        check_key(key)?;
        if expected.len().saturating_add(desired.len()) > MAX_VALUE_LEN {
            return Err(Error::InvalidArgument(format!(
                "compare_set for store key {key:?}: expected ({} bytes) plus desired ({} bytes) \
                 exceed the limit of {MAX_VALUE_LEN} bytes",
                expected.len(),
                desired.len()
            )));
        }
        let req = Request::CompareSet {
            key: key.to_string(),
            expected: expected.to_vec(),
            desired: desired.to_vec(),
        };
        match self.quick(&req)? {
            Response::Value(v) => Ok(v),
            other => Err(unexpected(&self.addr, &describe(&req), &other)),
        }
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let mut total = 0usize;
        for key in keys {
            check_key(key)?;
            total += key.len() + 4;
        }
        if total > MAX_FRAME - 64 {
            return Err(Error::InvalidArgument(format!(
                "wait for {} store keys: {total} bytes of keys exceed the limit of one request",
                keys.len()
            )));
        }
        let req = Request::Wait {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            timeout_ms: timeout_to_ms(timeout),
        };
        match self.request(&req, timeout.saturating_add(REPLY_MARGIN))? {
            Response::Ok => Ok(()),
            Response::Timeout(missing) => Err(timeout_error(missing, timeout)),
            other => Err(unexpected(&self.addr, &describe(&req), &other)),
        }
    }

    fn delete(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        let req = Request::Delete {
            key: key.to_string(),
        };
        match self.quick(&req)? {
            Response::Bool(b) => Ok(b),
            other => Err(unexpected(&self.addr, &describe(&req), &other)),
        }
    }

    fn num_keys(&self) -> Result<u64> {
        match self.quick(&Request::NumKeys)? {
            Response::Count(n) => Ok(n),
            other => Err(unexpected(&self.addr, "num_keys", &other)),
        }
    }

    fn check(&self, key: &str) -> Result<bool> {
        check_key(key)?;
        let req = Request::Check {
            key: key.to_string(),
        };
        match self.quick(&req)? {
            Response::Bool(b) => Ok(b),
            other => Err(unexpected(&self.addr, &describe(&req), &other)),
        }
    }

    fn timeout(&self) -> Duration {
        self.opts.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::super::StoreServer;
    use super::*;

    fn opts() -> StoreOptions {
        StoreOptions {
            secret: None,
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn secret_comes_from_a_non_empty_env_value() {
        assert_eq!(secret_from(None), None);
        assert_eq!(secret_from(Some("".into())), None);
        assert_eq!(secret_from(Some("abc".into())), Some("abc".to_string()));
        let d = StoreOptions::default();
        assert_eq!(d.timeout, DEFAULT_STORE_TIMEOUT);
        assert_eq!(d.connect_timeout, Duration::from_secs(60));
    }

    #[test]
    fn debug_output_hides_the_secret() {
        let o = StoreOptions {
            secret: Some("hunter2".into()),
            ..opts()
        };
        let s = format!("{o:?}");
        assert!(!s.contains("hunter2") && s.contains("redacted"), "{s}");
    }

    #[test]
    fn malformed_addresses_are_config_errors() {
        for bad in ["localhost", ":29500", "host:notaport", "host:99999"] {
            let err = TcpStore::connect(bad, opts()).unwrap_err();
            assert!(matches!(err, Error::Config(_)), "{bad}: {err}");
            assert!(err.to_string().contains(bad), "{err}");
        }
    }

    #[test]
    fn oversized_keys_and_values_fail_before_sending() {
        let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
        let store = TcpStore::connect(&server.local_addr().to_string(), opts()).unwrap();
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert!(matches!(
            store.set(&long, b"v"),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            store.wait(&[&long], Duration::ZERO),
            Err(Error::InvalidArgument(_))
        ));
        let huge = vec![0u8; MAX_VALUE_LEN + 1];
        let err = store.set("big", &huge).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(_)) && err.to_string().contains("\"big\""),
            "{err}"
        );
        // The connection is still usable: nothing was sent.
        store.set("ok", b"1").unwrap();
        assert_eq!(store.get("ok").unwrap(), b"1");
    }

    #[test]
    fn broken_connection_stays_broken_and_says_why() {
        let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
        let addr = server.local_addr().to_string();
        let store = TcpStore::connect(&addr, opts()).unwrap();
        store.set("a", b"1").unwrap();
        drop(server);
        let first = store.check("a").unwrap_err();
        assert!(
            matches!(&first, Error::Store { addr: a, .. } if *a == addr),
            "{first}"
        );
        let second = store.check("a").unwrap_err();
        assert!(second.to_string().contains("lost earlier"), "{second}");
    }
}
