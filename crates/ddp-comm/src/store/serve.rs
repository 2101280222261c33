//! Serving one store connection: the handshake (with its deadline), then requests.
//!
//! A peer that breaks the protocol (garbage, oversized or truncated frames, a wrong secret) gets
//! an error reply where one can still be framed, and its connection is closed; the server never
//! panics on input and keeps serving everyone else. Blocking `get`/`wait` sleep on a condition
//! variable that every `set`, `add` and `compare_set` notifies, so waiting costs no CPU.

use super::auth::{self, Side, NONCE_LEN};
use super::conns::{lock, Phase, Shared, State};
use super::protocol::{
    self, read_frame, write_frame, ErrorKind, FrameError, Request, Response, MAX_FRAME,
    MAX_HANDSHAKE_FRAME, VERSION,
};
use std::io::{self, Read};
use std::net::{SocketAddr, TcpStream};
use std::sync::MutexGuard;
use std::time::Instant;

fn send(mut stream: &TcpStream, resp: &Response) -> io::Result<()> {
    write_frame(&mut stream, &resp.encode())
}

fn error_reply(kind: ErrorKind, message: impl Into<String>) -> Response {
    Response::Error {
        kind,
        message: message.into(),
    }
}

/// Reads from a stream until a fixed deadline: each read waits at most the time left, so a peer
/// dripping one byte at a time cannot stretch the handshake.
struct Deadline<'a> {
    stream: &'a TcpStream,
    until: Instant,
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake deadline passed",
            ));
        }
        self.stream.set_read_timeout(Some(left))?;
        let mut s = self.stream;
        s.read(buf)
    }
}

/// Serve connection `id` until it closes, fails or the server shuts down.
pub(super) fn serve_connection(
    stream: &TcpStream,
    peer: SocketAddr,
    shared: &Shared,
    id: u64,
    until: Instant,
) {
    if !handshake(stream, peer, shared, id, until) {
        return;
    }
    let _ = stream.set_read_timeout(None);
    let mut reader = stream;
    loop {
        let body = match read_frame(&mut reader, MAX_FRAME) {
            Ok(body) => body,
            Err(FrameError::Closed) => return,
            Err(e) => {
                if !lock(&shared.state).shutdown {
                    tracing::warn!(%peer, "store closes a connection: {e}");
                    if matches!(e, FrameError::TooLarge { .. } | FrameError::Empty) {
                        let _ = send(
                            stream,
                            &error_reply(ErrorKind::Store, format!("bad frame: {e}")),
                        );
                    }
                }
                return;
            }
        };
        let resp = match Request::decode(&body) {
            Ok(Request::Hello { .. } | Request::Auth { .. }) => error_reply(
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
        if send(stream, &resp).is_err() {
            return;
        }
    }
}

/// Read one handshake frame before the deadline; `Err` carries what to log (`None`: say nothing).
fn read_handshake_frame(
    stream: &TcpStream,
    until: Instant,
    shared: &Shared,
) -> Result<Request, Option<String>> {
    let mut r = Deadline { stream, until };
    let body = match read_frame(&mut r, MAX_HANDSHAKE_FRAME) {
        Ok(body) => body,
        Err(FrameError::Closed) => return Err(None),
        Err(FrameError::Io(e))
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) =>
        {
            return Err(Some(format!(
                "no complete handshake within {:?}",
                shared.limits.handshake_timeout
            )))
        }
        Err(e) => {
            if matches!(e, FrameError::TooLarge { .. } | FrameError::Empty) {
                let _ = send(
                    stream,
                    &error_reply(ErrorKind::Store, format!("bad handshake frame: {e}")),
                );
            }
            return Err(Some(format!("bad handshake frame: {e}")));
        }
    };
    Request::decode(&body).map_err(|e| {
        let _ = send(
            stream,
            &error_reply(ErrorKind::Store, format!("bad handshake: {e}")),
        );
        Some(format!("bad handshake: {e}"))
    })
}

/// Run the handshake; returns whether the connection is authenticated and may go on.
fn handshake(
    stream: &TcpStream,
    peer: SocketAddr,
    shared: &Shared,
    id: u64,
    until: Instant,
) -> bool {
    match handshake_steps(stream, until, shared, id) {
        Ok(()) => true,
        Err(None) => false,
        Err(Some(why)) => {
            if !lock(&shared.state).shutdown {
                shared.log_handshake.warn(shared.local_addr, || {
                    format!("store drops the connection from {peer}: {why}")
                });
            }
            false
        }
    }
}

fn handshake_steps(
    stream: &TcpStream,
    until: Instant,
    shared: &Shared,
    id: u64,
) -> Result<(), Option<String>> {
    let client_nonce = match read_handshake_frame(stream, until, shared)? {
        Request::Hello { version, .. } if version != VERSION => {
            let msg = format!(
                "protocol version mismatch: the store speaks v{VERSION}, this client v{version} \
                 (mixing ddp-rs versions?)"
            );
            let _ = send(stream, &error_reply(ErrorKind::Store, msg.clone()));
            return Err(Some(msg));
        }
        Request::Hello { nonce, .. } => nonce,
        other => {
            let _ = send(
                stream,
                &error_reply(ErrorKind::Store, "expected a handshake first"),
            );
            return Err(Some(format!(
                "it sent {} before its handshake",
                other.name()
            )));
        }
    };
    let Some(secret) = &shared.secret else {
        if !shared.set_phase(id, Phase::Authenticated) {
            return Err(None);
        }
        return send(stream, &Response::Ok).map_err(|_| None);
    };
    if client_nonce.len() != NONCE_LEN {
        let msg = format!(
            "handshake nonce of {} bytes, expected {NONCE_LEN}",
            client_nonce.len()
        );
        let _ = send(stream, &error_reply(ErrorKind::Store, msg.clone()));
        return Err(Some(msg));
    }
    let server_nonce = auth::nonce().map_err(|e| Some(format!("no random nonce: {e}")))?;
    if !shared.set_phase(id, Phase::Challenged) {
        return Err(None);
    }
    send(stream, &Response::Challenge(server_nonce.to_vec())).map_err(|_| None)?;
    let proof = match read_handshake_frame(stream, until, shared)? {
        Request::Auth { proof } => proof,
        other => {
            let _ = send(
                stream,
                &error_reply(ErrorKind::Store, "expected the proof of the shared secret"),
            );
            return Err(Some(format!(
                "it sent {} instead of its proof of the secret",
                other.name()
            )));
        }
    };
    if !auth::verify(secret, Side::Client, &client_nonce, &server_nonce, &proof) {
        let _ = send(stream, &Response::Refused);
        return Err(Some(
            "wrong or missing shared secret (DDP_STORE_SECRET)".to_string(),
        ));
    }
    if !shared.set_phase(id, Phase::Authenticated) {
        return Err(None);
    }
    let mine = auth::proof(secret, Side::Server, &client_nonce, &server_nonce);
    send(stream, &Response::Welcome(mine)).map_err(|_| None)
}

/// Run one request against the shared map. `None` means the server is shutting down.
fn execute(shared: &Shared, req: Request) -> Option<Response> {
    let mut st = lock(&shared.state);
    if st.shutdown {
        return None;
    }
    let resp = match req {
        Request::Hello { .. } | Request::Auth { .. } => {
            unreachable!("handled by serve_connection")
        }
        Request::Set { key, value } => match st.data.insert(key, value) {
            Ok(()) => {
                shared.changed.notify_all();
                Response::Ok
            }
            Err(full) => error_reply(ErrorKind::Store, full),
        },
        Request::Get { key, timeout_ms } => {
            let (guard, missing) = wait_for(shared, st, &[key.as_str()], timeout_ms);
            let guard = guard?;
            if missing.is_empty() {
                Response::Value(guard.data.get(&key).cloned().unwrap_or_default())
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
                Ok(new) => match st.data.insert(key, new.to_string().into_bytes()) {
                    Ok(()) => {
                        shared.changed.notify_all();
                        Response::Int(new)
                    }
                    Err(full) => error_reply(ErrorKind::Store, full),
                },
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
        } => {
            let swap = match st.data.get(&key) {
                Some(current) => *current == expected,
                None => expected.is_empty(),
            };
            if !swap {
                // The current value; a missing key answers an empty one.
                Response::Value(st.data.get(&key).cloned().unwrap_or_default())
            } else {
                match st.data.insert(key, desired.clone()) {
                    Ok(()) => {
                        shared.changed.notify_all();
                        Response::Value(desired)
                    }
                    Err(full) => error_reply(ErrorKind::Store, full),
                }
            }
        }
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
            .filter(|k| !st.data.contains_key(k))
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
    use super::super::StoreServer;
    use super::*;
    use std::io::Read;
    use std::net::TcpStream;
    use std::time::Duration;

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
