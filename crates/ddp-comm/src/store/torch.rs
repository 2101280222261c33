//! PyTorch's `TCPStore` protocol, spoken by the same server on the same port, so that PyTorch
//! workers launched by `ddprun` (which tells them `TORCHELASTIC_USE_AGENT_STORE=True`, as
//! torchrun does) use the launcher's store as they use torchrun's.
//!
//! A PyTorch client opens with `VALIDATE` and a magic number, five bytes no `HELLO` frame of
//! ours can start with (see [`PREAMBLE`]): the greeter and [`is_torch_client`] tell the two
//! apart from those bytes. After that every request is one query byte and its fields, all
//! integers in the host's (little-endian) order:
//!
//! ```text
//! string/bytes = len:u64 raw          keys = n:u64 n × string
//! VALIDATE 0   magic:u32                                   (first, no reply)
//! SET 1        key value                                   (no reply)
//! COMPARE_SET 2 key expected desired  → bytes
//! GET 3        key                     → bytes (the client waits for the key first)
//! ADD 4        key delta:i64           → i64
//! CHECK 5      keys                    → u8 (0 ready, 1 not ready)
//! WAIT 6       keys                    → u8 0 once all exist; CANCEL_WAIT ends it early
//! GETNUMKEYS 7                         → i64
//! DELETE_KEY 8 key                     → i64 (keys deleted)
//! APPEND 9     key value                                   (no reply)
//! MULTI_GET 10 keys                    → n × bytes
//! MULTI_SET 11 n:u64 n × (key value)                       (no reply)
//! CANCEL_WAIT 12                       → u8 1
//! PING 13      nonce:u32               → nonce:u32
//! LIST_KEYS 17                         → n:u64 n × string
//! BARRIER 18   key world:i64           → u8 0 once the counter reached world
//! ```
//!
//! PyTorch's keys live in the same map as ours, under a prefix ([`DEFAULT_TORCH_PREFIX`], or the
//! one set by `StoreServer::set_torch_prefix`, which `ddprun` changes at each restart so that a
//! restarted group never reads the keys of the one before). A store with a secret refuses
//! PyTorch clients (they cannot prove it) and says so in its log. Malformed input closes the
//! connection with a warning, as PyTorch's own server does; nothing is allocated before the
//! bytes it is for arrive.

use super::conns::{lock, Phase, Shared, State};
use super::protocol::{MAX_KEY_LEN, MAX_VALUE_LEN};
use super::sniff::PREAMBLE;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// Where PyTorch's keys live in the shared map unless the server was told otherwise.
pub const DEFAULT_TORCH_PREFIX: &str = "torch/";
/// Most keys one `CHECK`, `WAIT`, `MULTI_GET` or `MULTI_SET` may name.
pub(crate) const MAX_KEYS: u64 = 1 << 16;

/// How often a blocked `WAIT` or `BARRIER` looks at its connection for a `CANCEL_WAIT` or a
/// hang-up.
const POLL: Duration = Duration::from_millis(50);

/// One PyTorch request, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TorchRequest {
    Set {
        key: String,
        value: Vec<u8>,
    },
    CompareSet {
        key: String,
        expected: Vec<u8>,
        desired: Vec<u8>,
    },
    Get {
        key: String,
    },
    Add {
        key: String,
        delta: i64,
    },
    Check {
        keys: Vec<String>,
    },
    Wait {
        keys: Vec<String>,
    },
    NumKeys,
    Delete {
        key: String,
    },
    Append {
        key: String,
        value: Vec<u8>,
    },
    MultiGet {
        keys: Vec<String>,
    },
    MultiSet {
        pairs: Vec<(String, Vec<u8>)>,
    },
    CancelWait,
    Ping {
        nonce: u32,
    },
    ListKeys,
    Barrier {
        key: String,
        world: i64,
    },
}

/// Why no request could be read; the connection is closed after any of these.
#[derive(Debug)]
pub(crate) enum TorchError {
    /// The peer closed the connection between two requests.
    Closed,
    /// Anything else: what to log.
    Bad(String),
}

impl std::fmt::Display for TorchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TorchError::Closed => f.write_str("connection closed"),
            TorchError::Bad(why) => f.write_str(why),
        }
    }
}

fn bad(why: impl Into<String>) -> TorchError {
    TorchError::Bad(why.into())
}

fn read_exact(r: &mut impl Read, buf: &mut [u8], what: &str) -> Result<(), TorchError> {
    r.read_exact(buf).map_err(|e| match e.kind() {
        io::ErrorKind::UnexpectedEof => bad(format!("connection closed in the middle of {what}")),
        _ => bad(format!("reading {what}: {e}")),
    })
}

fn u64_field(r: &mut impl Read, what: &str) -> Result<u64, TorchError> {
    let mut b = [0u8; 8];
    read_exact(r, &mut b, what)?;
    Ok(u64::from_le_bytes(b))
}

/// A length-prefixed byte string of at most `max` bytes, read as its bytes arrive (a peer that
/// announces a large value and sends nothing costs no memory).
fn bytes_field(r: &mut impl Read, max: usize, what: &str) -> Result<Vec<u8>, TorchError> {
    let len = u64_field(r, what)?;
    if len > max as u64 {
        return Err(bad(format!(
            "{what} of {len} bytes exceeds the limit of {max} bytes"
        )));
    }
    let len = len as usize;
    let mut out = Vec::new();
    while out.len() < len {
        let start = out.len();
        let end = len.min((start * 2).max(64 << 10));
        out.resize(end, 0);
        read_exact(r, &mut out[start..end], what)?;
    }
    Ok(out)
}

fn key_field(r: &mut impl Read) -> Result<String, TorchError> {
    let raw = bytes_field(r, MAX_KEY_LEN, "key")?;
    String::from_utf8(raw).map_err(|e| {
        bad(format!(
            "key is not valid UTF-8: {:?}",
            String::from_utf8_lossy(e.as_bytes())
        ))
    })
}

fn count_field(r: &mut impl Read, what: &str) -> Result<usize, TorchError> {
    let n = u64_field(r, what)?;
    if n > MAX_KEYS {
        return Err(bad(format!("{what} {n} exceeds the limit of {MAX_KEYS}")));
    }
    Ok(n as usize)
}

fn keys_field(r: &mut impl Read) -> Result<Vec<String>, TorchError> {
    let n = count_field(r, "key count")?;
    // Grown as keys arrive: the count alone reserves nothing.
    let mut keys = Vec::new();
    for _ in 0..n {
        keys.push(key_field(r)?);
    }
    Ok(keys)
}

/// Read the connection's `VALIDATE` query (the [`PREAMBLE`]).
pub(crate) fn read_preamble(r: &mut impl Read) -> Result<(), TorchError> {
    let mut b = [0u8; 5];
    read_exact(r, &mut b, "the VALIDATE query")?;
    if b != PREAMBLE {
        return Err(bad(format!(
            "expected PyTorch's VALIDATE query {PREAMBLE:02x?}, got {b:02x?}"
        )));
    }
    Ok(())
}

/// Read one request (after the preamble).
pub(crate) fn read_request(r: &mut impl Read) -> Result<TorchRequest, TorchError> {
    let mut q = [0u8; 1];
    loop {
        match r.read(&mut q) {
            Ok(0) => return Err(TorchError::Closed),
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(bad(format!("reading a query: {e}"))),
        }
    }
    let value = |r: &mut _| bytes_field(r, MAX_VALUE_LEN, "value");
    Ok(match q[0] {
        1 => TorchRequest::Set {
            key: key_field(r)?,
            value: value(r)?,
        },
        2 => TorchRequest::CompareSet {
            key: key_field(r)?,
            expected: value(r)?,
            desired: value(r)?,
        },
        3 => TorchRequest::Get { key: key_field(r)? },
        4 => {
            let key = key_field(r)?;
            let delta = u64_field(r, "add's delta")? as i64;
            TorchRequest::Add { key, delta }
        }
        5 => TorchRequest::Check {
            keys: keys_field(r)?,
        },
        6 => TorchRequest::Wait {
            keys: keys_field(r)?,
        },
        7 => TorchRequest::NumKeys,
        8 => TorchRequest::Delete { key: key_field(r)? },
        9 => TorchRequest::Append {
            key: key_field(r)?,
            value: value(r)?,
        },
        10 => TorchRequest::MultiGet {
            keys: keys_field(r)?,
        },
        11 => {
            let n = count_field(r, "pair count")?;
            let mut pairs = Vec::new();
            for _ in 0..n {
                pairs.push((key_field(r)?, value(r)?));
            }
            TorchRequest::MultiSet { pairs }
        }
        12 => TorchRequest::CancelWait,
        13 => {
            let mut b = [0u8; 4];
            read_exact(r, &mut b, "the ping's nonce")?;
            TorchRequest::Ping {
                nonce: u32::from_le_bytes(b),
            }
        }
        17 => TorchRequest::ListKeys,
        18 => {
            let key = key_field(r)?;
            let world = u64_field(r, "the barrier's world size")? as i64;
            TorchRequest::Barrier { key, world }
        }
        0 => return Err(bad("a second VALIDATE query")),
        q @ 14..=16 => {
            return Err(bad(format!(
                "query {q} (PyTorch's store queues) is not supported by the ddp-rs store"
            )))
        }
        q => return Err(bad(format!("unknown query {q}"))),
    })
}

/// The reply bytes of a request; `Err` closes the connection with that reason.
enum Step {
    Reply(Vec<u8>),
    Nothing,
    /// A `WAIT` or `BARRIER` registered: block until `keys` exist (or, with `at_least`, until
    /// the counter at `keys[0]` reaches it).
    Block {
        keys: Vec<String>,
        at_least: Option<i64>,
    },
}

fn enc_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

fn counter(raw: &[u8]) -> Option<i64> {
    std::str::from_utf8(raw).ok()?.trim().parse().ok()
}

fn execute(st: &mut State, prefix: &str, req: TorchRequest) -> Result<(Step, bool), String> {
    let k = |key: &str| format!("{prefix}{key}");
    let mut changed = false;
    let step = match req {
        TorchRequest::Set { key, value } => {
            st.data.insert(k(&key), value)?;
            changed = true;
            Step::Nothing
        }
        TorchRequest::CompareSet {
            key,
            expected,
            desired,
        } => {
            let mut out = Vec::new();
            let key = k(&key);
            match st.data.get(&key) {
                Some(cur) if *cur != expected => enc_bytes(&mut out, cur),
                Some(_) => {
                    enc_bytes(&mut out, &desired);
                    st.data.insert(key, desired)?;
                    changed = true;
                }
                None if expected.is_empty() => {
                    enc_bytes(&mut out, &desired);
                    st.data.insert(key, desired)?;
                    changed = true;
                }
                // As PyTorch's server: a missing key with a non-empty expectation answers the
                // expectation.
                None => enc_bytes(&mut out, &expected),
            }
            Step::Reply(out)
        }
        TorchRequest::Get { key } => {
            let value = st
                .data
                .get(&k(&key))
                .ok_or_else(|| format!("get of the missing key {key:?}"))?;
            let mut out = Vec::new();
            enc_bytes(&mut out, value);
            Step::Reply(out)
        }
        TorchRequest::Add { key, delta } => {
            let cur = match st.data.get(&k(&key)) {
                None => 0,
                Some(raw) => counter(raw)
                    .ok_or_else(|| format!("add to key {key:?}, whose value is not an integer"))?,
            };
            let new = cur
                .checked_add(delta)
                .ok_or_else(|| format!("add to key {key:?}: {cur} + {delta} overflows"))?;
            st.data.insert(k(&key), new.to_string().into_bytes())?;
            changed = true;
            Step::Reply(new.to_le_bytes().to_vec())
        }
        TorchRequest::Check { keys } => {
            let ready = keys.iter().all(|key| st.data.contains_key(&k(key)));
            Step::Reply(vec![if ready { 0 } else { 1 }])
        }
        TorchRequest::Wait { keys } => Step::Block {
            keys: keys.iter().map(|key| k(key)).collect(),
            at_least: None,
        },
        TorchRequest::NumKeys => {
            let n = st.data.keys().filter(|key| key.starts_with(prefix)).count();
            Step::Reply((n as i64).to_le_bytes().to_vec())
        }
        TorchRequest::Delete { key } => {
            let n = i64::from(st.data.remove(&k(&key)).is_some());
            Step::Reply(n.to_le_bytes().to_vec())
        }
        TorchRequest::Append { key, value } => {
            let len = st.data.get(&k(&key)).map_or(0, Vec::len);
            if len + value.len() > MAX_VALUE_LEN {
                return Err(format!(
                    "append to key {key:?} would exceed the value limit of {MAX_VALUE_LEN} bytes"
                ));
            }
            st.data.append(k(&key), &value)?;
            changed = true;
            Step::Nothing
        }
        TorchRequest::MultiGet { keys } => {
            let mut out = Vec::new();
            for key in &keys {
                let value = st
                    .data
                    .get(&k(key))
                    .ok_or_else(|| format!("multi_get of the missing key {key:?}"))?;
                enc_bytes(&mut out, value);
            }
            Step::Reply(out)
        }
        TorchRequest::MultiSet { pairs } => {
            for (key, value) in pairs {
                st.data.insert(k(&key), value)?;
            }
            changed = true;
            Step::Nothing
        }
        TorchRequest::CancelWait => Step::Reply(vec![1]),
        TorchRequest::Ping { nonce } => Step::Reply(nonce.to_le_bytes().to_vec()),
        TorchRequest::ListKeys => {
            let keys: Vec<&str> = st
                .data
                .keys()
                .filter_map(|key| key.strip_prefix(prefix))
                .collect();
            let mut out = (keys.len() as u64).to_le_bytes().to_vec();
            for key in keys {
                enc_bytes(&mut out, key.as_bytes());
            }
            Step::Reply(out)
        }
        TorchRequest::Barrier { key, world } => {
            let key = k(&key);
            let count = match st.data.get(&key) {
                None => 1,
                Some(raw) => counter(raw).and_then(|c| c.checked_add(1)).ok_or_else(|| {
                    format!("barrier on key {key:?}, whose value is not a counter")
                })?,
            };
            st.data
                .insert(key.clone(), count.to_string().into_bytes())?;
            changed = true;
            Step::Block {
                keys: vec![key],
                at_least: Some(world),
            }
        }
    };
    Ok((step, changed))
}

/// How a blocked `WAIT` or `BARRIER` ended.
enum Blocked {
    Done,
    /// The client sent something (a `CANCEL_WAIT`) or hung up: go and read it.
    Interrupted,
    ShuttingDown,
}

fn readable(stream: &TcpStream) -> bool {
    use rustix::net::{recv, RecvFlags};
    let mut b = [0u8; 1];
    match recv(stream, &mut b[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
        Ok(_) => true, // data, or 0 = hung up
        Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => false,
        Err(_) => true,
    }
}

fn block(shared: &Shared, stream: &TcpStream, keys: &[String], at_least: Option<i64>) -> Blocked {
    let mut st = lock(&shared.state);
    loop {
        if st.shutdown {
            return Blocked::ShuttingDown;
        }
        let done = match at_least {
            None => keys.iter().all(|key| st.data.contains_key(key)),
            Some(n) => st
                .data
                .get(&keys[0])
                .and_then(|raw| counter(raw))
                .is_some_and(|c| c >= n),
        };
        if done {
            return Blocked::Done;
        }
        st = shared
            .changed
            .wait_timeout(st, POLL)
            .unwrap_or_else(|p| p.into_inner())
            .0;
        if readable(stream) {
            return Blocked::Interrupted;
        }
    }
}

/// Serve a PyTorch client on connection `id` until it closes, breaks the protocol or the server
/// shuts down.
pub(super) fn serve_connection(
    stream: &TcpStream,
    peer: SocketAddr,
    shared: &Shared,
    id: u64,
    until: Instant,
) {
    let _ = stream.set_read_timeout(Some(until.saturating_duration_since(Instant::now())));
    let mut reader = stream;
    if let Err(e) = read_preamble(&mut reader) {
        shared.log_handshake.warn(shared.local_addr, || {
            format!("store drops the PyTorch client {peer}: {e}")
        });
        return;
    }
    if shared.secret.is_some() {
        shared.log_handshake.warn(shared.local_addr, || {
            format!(
                "store refuses the PyTorch TCPStore client {peer}: this store has a shared \
                 secret (DDP_STORE_SECRET), which PyTorch's client cannot prove; unset it to \
                 launch PyTorch workers"
            )
        });
        return;
    }
    if !shared.set_phase(id, Phase::Authenticated) {
        return;
    }
    let _ = stream.set_read_timeout(None);
    // Fixed for the connection: a client of an earlier restart keeps its own namespace.
    let prefix = lock(&shared.state).torch_prefix.clone();
    let mut writer = stream;
    loop {
        let req = match read_request(&mut reader) {
            Ok(req) => req,
            Err(TorchError::Closed) => return,
            Err(e) => {
                if !lock(&shared.state).shutdown {
                    tracing::warn!(%peer, "store closes a PyTorch client connection: {e}");
                }
                return;
            }
        };
        let step = {
            let mut st = lock(&shared.state);
            if st.shutdown {
                return;
            }
            match execute(&mut st, &prefix, req) {
                Ok((step, changed)) => {
                    if changed {
                        shared.changed.notify_all();
                    }
                    step
                }
                Err(why) => {
                    drop(st);
                    tracing::warn!(%peer, "store closes a PyTorch client connection: {why}");
                    return;
                }
            }
        };
        let reply = match step {
            Step::Nothing => continue,
            Step::Reply(out) => out,
            Step::Block { keys, at_least } => match block(shared, stream, &keys, at_least) {
                Blocked::Done => vec![0],
                Blocked::Interrupted => continue,
                Blocked::ShuttingDown => return,
            },
        };
        if writer.write_all(&reply).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::sniff::may_be_torch;
    use super::*;

    fn s(b: &mut Vec<u8>, x: &[u8]) {
        b.extend_from_slice(&(x.len() as u64).to_le_bytes());
        b.extend_from_slice(x);
    }

    #[test]
    fn decodes_what_pytorch_sends() {
        // Captured from torch 2.15's client: set("/k", b"v"), then wait(["/k"]).
        let set = hex("0102000000000000002f6b010000000000000076");
        let wait = hex("06010000000000000002000000000000002f6b");
        assert_eq!(
            read_request(&mut &set[..]).unwrap(),
            TorchRequest::Set {
                key: "/k".into(),
                value: b"v".to_vec()
            }
        );
        assert_eq!(
            read_request(&mut &wait[..]).unwrap(),
            TorchRequest::Wait {
                keys: vec!["/k".into()]
            }
        );
        let mut ms = vec![11];
        ms.extend_from_slice(&2u64.to_le_bytes());
        for (k, v) in [("a", "1"), ("b", "2")] {
            s(&mut ms, k.as_bytes());
            s(&mut ms, v.as_bytes());
        }
        assert!(matches!(
            read_request(&mut &ms[..]).unwrap(),
            TorchRequest::MultiSet { pairs } if pairs.len() == 2
        ));
    }

    #[test]
    fn huge_lengths_and_counts_are_refused_before_allocating() {
        let mut b = vec![1];
        b.extend_from_slice(&u64::MAX.to_le_bytes());
        let e = read_request(&mut &b[..]).unwrap_err().to_string();
        assert!(e.contains("exceeds the limit"), "{e}");
        let mut b = vec![6];
        b.extend_from_slice(&(MAX_KEYS + 1).to_le_bytes());
        let e = read_request(&mut &b[..]).unwrap_err().to_string();
        assert!(e.contains("key count"), "{e}");
        // A large announced value with nothing behind it: a clear truncation error.
        let mut b = vec![1];
        s(&mut b, b"k");
        b.extend_from_slice(&((MAX_VALUE_LEN as u64) - 1).to_le_bytes());
        let e = read_request(&mut &b[..]).unwrap_err().to_string();
        assert!(e.contains("closed in the middle of value"), "{e}");
    }

    #[test]
    fn preamble_is_not_a_frame_of_ours() {
        assert!(may_be_torch(&PREAMBLE[..2]));
        assert!(!may_be_torch(&[0x2b, 0, 0, 0, 1]));
        let mut r = &PREAMBLE[..];
        read_preamble(&mut r).unwrap();
        assert!(read_preamble(&mut &[0u8, 1, 2, 3, 4][..]).is_err());
    }

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }
}
