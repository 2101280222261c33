//! Wire format of the store, shared by [`super::server`] and [`super::client`].
//!
//! Every message, in both directions, is one **frame**:
//!
//! ```text
//! frame   = len:u32-LE  body            (len = byte length of body, 1 ..= MAX_FRAME)
//! body    = opcode:u8   fields...
//! bytes   = n:u32-LE    n raw bytes
//! string  = bytes                      (UTF-8; keys at most MAX_KEY_LEN bytes)
//! ```
//!
//! Requests (client → server):
//!
//! | opcode | name          | fields                                                        | reply            |
//! |--------|---------------|---------------------------------------------------------------|------------------|
//! | `0x01` | `HELLO`       | magic `b"DDPS"`, version:u16-LE, client_nonce:bytes           | `OK` / `CHALLENGE` / `ERROR` |
//! | `0x0a` | `AUTH`        | proof:bytes (HMAC of both nonces, see [`super::auth`])       | `WELCOME` / `REFUSED` |
//! | `0x02` | `SET`         | key:string, value:bytes                                       | `OK`             |
//! | `0x03` | `GET`         | key:string, timeout_ms:u64-LE                                 | `VALUE` / `TIMEOUT` |
//! | `0x04` | `ADD`         | key:string, delta:i64-LE                                      | `INT`            |
//! | `0x05` | `COMPARE_SET` | key:string, expected:bytes, desired:bytes                     | `VALUE`          |
//! | `0x06` | `WAIT`        | n:u32-LE, n × key:string, timeout_ms:u64-LE                   | `OK` / `TIMEOUT` |
//! | `0x07` | `DELETE`      | key:string                                                    | `BOOL`           |
//! | `0x08` | `NUM_KEYS`    | (none)                                                        | `COUNT`          |
//! | `0x09` | `CHECK`       | key:string                                                    | `BOOL`           |
//!
//! A `timeout_ms` of `u64::MAX` means "wait forever".
//!
//! Replies (server → client):
//!
//! | opcode | name      | fields                                                    |
//! |--------|-----------|-----------------------------------------------------------|
//! | `0x80` | `OK`      | (none)                                                    |
//! | `0x81` | `REFUSED` | (none): wrong or missing secret; the server then closes   |
//! | `0x88` | `CHALLENGE` | server_nonce:bytes: the server has a secret, prove it with `AUTH` |
//! | `0x89` | `WELCOME` | proof:bytes: the server's proof that it knows the secret too |
//! | `0x82` | `VALUE`   | value:bytes                                               |
//! | `0x83` | `INT`     | value:i64-LE                                              |
//! | `0x84` | `BOOL`    | value:u8 (0 or 1)                                         |
//! | `0x85` | `COUNT`   | value:u64-LE                                              |
//! | `0x86` | `TIMEOUT` | n:u32-LE, n × key:string (the keys still missing)         |
//! | `0x87` | `ERROR`   | kind:u8 (0 = store error, 1 = invalid argument), message:string |
//!
//! The first request on a connection must be `HELLO`, and its frame may be at most
//! [`MAX_HANDSHAKE_FRAME`] bytes, so unauthenticated peers cannot make the server allocate much.
//! A server without a secret answers `HELLO` with `OK`. A server with one answers `CHALLENGE`;
//! the client sends `AUTH` with its proof, and the server answers `WELCOME` with its own proof
//! (which the client checks) or `REFUSED`. The secret itself never crosses the wire. A server
//! at its connection limit answers `HELLO` with `ERROR` naming the limit, then closes.
//!
//! `HELLO` keeps the layout of version 1 (whose last field was the secret in plain text), so a
//! server of either version reads the other's version number and answers a mismatch with an
//! `ERROR` naming both versions instead of hanging.
//! Counters written by `ADD` are stored as ASCII decimal strings, like PyTorch's `TCPStore`.

use std::io::{self, Read, Write};
use std::time::Duration;

/// Largest frame body accepted in either direction (64 MiB).
pub(crate) const MAX_FRAME: usize = 64 << 20;
/// Largest frame body accepted before the handshake succeeded.
pub(crate) const MAX_HANDSHAKE_FRAME: usize = 4 << 10;
/// Longest key, in bytes.
pub(crate) const MAX_KEY_LEN: usize = 4096;
/// Handshake magic: "ddp-rs store".
pub(crate) const MAGIC: [u8; 4] = *b"DDPS";
/// Protocol version spoken by this build.
pub(crate) const VERSION: u16 = 2;
/// `timeout_ms` value meaning "no timeout".
pub(crate) const NO_TIMEOUT: u64 = u64::MAX;
/// Bytes of a frame that are not the value of a `SET` with a key of [`MAX_KEY_LEN`] bytes.
pub(crate) const MAX_VALUE_LEN: usize = MAX_FRAME - MAX_KEY_LEN - 16;

/// Opcode of `HELLO` (the greeter peeks at it before a thread reads the frame).
pub(crate) const HELLO_OPCODE: u8 = op::HELLO;

mod op {
    pub const HELLO: u8 = 0x01;
    pub const SET: u8 = 0x02;
    pub const GET: u8 = 0x03;
    pub const ADD: u8 = 0x04;
    pub const COMPARE_SET: u8 = 0x05;
    pub const WAIT: u8 = 0x06;
    pub const DELETE: u8 = 0x07;
    pub const NUM_KEYS: u8 = 0x08;
    pub const CHECK: u8 = 0x09;
    pub const AUTH: u8 = 0x0a;

    pub const OK: u8 = 0x80;
    pub const REFUSED: u8 = 0x81;
    pub const VALUE: u8 = 0x82;
    pub const INT: u8 = 0x83;
    pub const BOOL: u8 = 0x84;
    pub const COUNT: u8 = 0x85;
    pub const TIMEOUT: u8 = 0x86;
    pub const ERROR: u8 = 0x87;
    pub const CHALLENGE: u8 = 0x88;
    pub const WELCOME: u8 = 0x89;
}

/// What a request with `opcode` is called in decode errors ("truncated set request").
fn request_what(opcode: u8) -> &'static str {
    match opcode {
        op::HELLO => "handshake",
        op::AUTH => "authentication",
        op::SET => "set request",
        op::GET => "get request",
        op::ADD => "add request",
        op::COMPARE_SET => "compare_set request",
        op::WAIT => "wait request",
        op::DELETE => "delete request",
        op::CHECK => "check request",
        _ => "request",
    }
}

/// A client → server message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    /// `nonce` is the client's nonce (for other versions: whatever their last field holds,
    /// which the server never looks at).
    Hello {
        version: u16,
        nonce: Vec<u8>,
    },
    Auth {
        proof: Vec<u8>,
    },
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
        timeout_ms: u64,
    },
    Add {
        key: String,
        delta: i64,
    },
    CompareSet {
        key: String,
        expected: Vec<u8>,
        desired: Vec<u8>,
    },
    Wait {
        keys: Vec<String>,
        timeout_ms: u64,
    },
    Delete {
        key: String,
    },
    NumKeys,
    Check {
        key: String,
    },
}

/// Category of an `ERROR` reply; the client maps it to an [`crate::Error`] variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorKind {
    /// The store failed or the request was malformed → `Error::Store`.
    Store = 0,
    /// The request cannot work (e.g. `add` on a non-integer) → `Error::InvalidArgument`.
    InvalidArgument = 1,
}

/// A server → client message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Response {
    Ok,
    Refused,
    Challenge(Vec<u8>),
    Welcome(Vec<u8>),
    Value(Vec<u8>),
    Int(i64),
    Bool(bool),
    Count(u64),
    Timeout(Vec<String>),
    Error { kind: ErrorKind, message: String },
}

/// Why a frame body could not be decoded. The frame boundaries are intact, so the reader may
/// answer with an error and go on reading the next frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DecodeError(pub String);

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Why no frame could be read. After any of these the stream is out of sync and must be closed.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The peer closed the connection cleanly between two frames.
    Closed,
    /// The peer closed the connection in the middle of a frame.
    Truncated { expected: usize, got: usize },
    /// The header announced a body larger than allowed.
    TooLarge { len: u64, max: usize },
    /// The header announced an empty body (no opcode).
    Empty,
    /// Any other I/O error (including read timeouts).
    Io(io::Error),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Closed => write!(f, "connection closed"),
            FrameError::Truncated { expected, got } => write!(
                f,
                "connection closed in the middle of a frame ({got} of {expected} bytes received)"
            ),
            FrameError::TooLarge { len, max } => {
                write!(f, "frame of {len} bytes exceeds the limit of {max} bytes")
            }
            FrameError::Empty => write!(f, "empty frame (no opcode)"),
            FrameError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Read one frame body (without its length prefix), refusing bodies over `max` bytes before
/// allocating anything for them.
pub(crate) fn read_frame(r: &mut impl Read, max: usize) -> Result<Vec<u8>, FrameError> {
    let mut header = [0u8; 4];
    let mut got = 0;
    while got < header.len() {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Err(FrameError::Closed),
            Ok(0) => return Err(FrameError::Truncated { expected: 4, got }),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FrameError::Io(e)),
        }
    }
    let len = u32::from_le_bytes(header) as u64;
    if len == 0 {
        return Err(FrameError::Empty);
    }
    if len > max as u64 {
        return Err(FrameError::TooLarge { len, max });
    }
    let len = len as usize;
    // Grow the buffer as bytes arrive (doubling), so a peer announcing a large frame and then
    // sending nothing costs little memory.
    let mut body = Vec::new();
    while body.len() < len {
        let start = body.len();
        let end = len.min((start * 2).max(64 << 10));
        body.resize(end, 0);
        let mut filled = start;
        while filled < end {
            match r.read(&mut body[filled..end]) {
                Ok(0) => {
                    return Err(FrameError::Truncated {
                        expected: len,
                        got: filled,
                    })
                }
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(FrameError::Io(e)),
            }
        }
    }
    Ok(body)
}

/// Write one already-encoded frame (as produced by `encode`).
pub(crate) fn write_frame(w: &mut impl Write, frame: &[u8]) -> io::Result<()> {
    w.write_all(frame)?;
    w.flush()
}

/// Builds a frame: reserves the length prefix, then patches it in `finish`.
struct Encoder(Vec<u8>);

impl Encoder {
    fn new(opcode: u8) -> Self {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&[0, 0, 0, 0, opcode]);
        Encoder(buf)
    }
    fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.0.extend_from_slice(b);
        self
    }
    fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.0.extend_from_slice(b);
        self
    }
    fn finish(&mut self) -> Vec<u8> {
        let mut buf = std::mem::take(&mut self.0);
        let len = (buf.len() - 4) as u32;
        buf[..4].copy_from_slice(&len.to_le_bytes());
        buf
    }
}

/// Cursor over a frame body.
struct Decoder<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Decoder<'a> {
    fn take(&mut self, n: usize, field: &str) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError(format!(
                "{} is truncated: field `{field}` needs {n} bytes, {} left",
                self.what,
                self.buf.len()
            )));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn u8(&mut self, field: &str) -> Result<u8, DecodeError> {
        Ok(self.take(1, field)?[0])
    }
    fn u16(&mut self, field: &str) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.take(2, field)?.try_into().unwrap()))
    }
    fn u32(&mut self, field: &str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take(4, field)?.try_into().unwrap()))
    }
    fn u64(&mut self, field: &str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take(8, field)?.try_into().unwrap()))
    }
    fn i64(&mut self, field: &str) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.take(8, field)?.try_into().unwrap()))
    }
    fn bytes(&mut self, field: &str) -> Result<Vec<u8>, DecodeError> {
        let n = self.u32(field)? as usize;
        Ok(self.take(n, field)?.to_vec())
    }
    fn string(&mut self, field: &str, max: usize) -> Result<String, DecodeError> {
        let n = self.u32(field)? as usize;
        if n > max {
            return Err(DecodeError(format!(
                "{}: field `{field}` is {n} bytes long, the limit is {max}",
                self.what
            )));
        }
        let raw = self.take(n, field)?;
        String::from_utf8(raw.to_vec()).map_err(|_| {
            DecodeError(format!(
                "{}: field `{field}` is not valid UTF-8: {:?}",
                self.what,
                String::from_utf8_lossy(raw)
            ))
        })
    }
    fn key(&mut self) -> Result<String, DecodeError> {
        self.string("key", MAX_KEY_LEN)
    }
    fn keys(&mut self) -> Result<Vec<String>, DecodeError> {
        let n = self.u32("key count")? as usize;
        // Every key takes at least its 4-byte length, which bounds `n` by the frame size.
        if n > self.buf.len() / 4 {
            return Err(DecodeError(format!(
                "{}: claims {n} keys but only {} bytes follow",
                self.what,
                self.buf.len()
            )));
        }
        (0..n).map(|_| self.key()).collect()
    }
    fn end(&self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError(format!(
                "{} has {} unexpected trailing bytes",
                self.what,
                self.buf.len()
            )))
        }
    }
}

fn encode_keys(e: &mut Encoder, keys: &[String]) {
    e.raw(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        e.bytes(k.as_bytes());
    }
}

impl Request {
    /// Short name for logs and error messages.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "handshake",
            Request::Auth { .. } => "authentication",
            Request::Set { .. } => "set",
            Request::Get { .. } => "get",
            Request::Add { .. } => "add",
            Request::CompareSet { .. } => "compare_set",
            Request::Wait { .. } => "wait",
            Request::Delete { .. } => "delete",
            Request::NumKeys => "num_keys",
            Request::Check { .. } => "check",
        }
    }

    /// The complete frame, length prefix included.
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Request::Hello { version, nonce } => Encoder::new(op::HELLO)
                .raw(&MAGIC)
                .raw(&version.to_le_bytes())
                .bytes(nonce)
                .finish(),
            Request::Auth { proof } => Encoder::new(op::AUTH).bytes(proof).finish(),
            Request::Set { key, value } => Encoder::new(op::SET)
                .bytes(key.as_bytes())
                .bytes(value)
                .finish(),
            Request::Get { key, timeout_ms } => Encoder::new(op::GET)
                .bytes(key.as_bytes())
                .raw(&timeout_ms.to_le_bytes())
                .finish(),
            Request::Add { key, delta } => Encoder::new(op::ADD)
                .bytes(key.as_bytes())
                .raw(&delta.to_le_bytes())
                .finish(),
            Request::CompareSet {
                key,
                expected,
                desired,
            } => Encoder::new(op::COMPARE_SET)
                .bytes(key.as_bytes())
                .bytes(expected)
                .bytes(desired)
                .finish(),
            Request::Wait { keys, timeout_ms } => {
                let mut e = Encoder::new(op::WAIT);
                encode_keys(&mut e, keys);
                e.raw(&timeout_ms.to_le_bytes()).finish()
            }
            Request::Delete { key } => Encoder::new(op::DELETE).bytes(key.as_bytes()).finish(),
            Request::NumKeys => Encoder::new(op::NUM_KEYS).finish(),
            Request::Check { key } => Encoder::new(op::CHECK).bytes(key.as_bytes()).finish(),
        }
    }

    /// Parse a frame body (as returned by [`read_frame`]).
    pub(crate) fn decode(body: &[u8]) -> Result<Request, DecodeError> {
        let Some((&opcode, rest)) = body.split_first() else {
            return Err(DecodeError("empty request".into()));
        };
        let mut d = Decoder {
            buf: rest,
            what: request_what(opcode),
        };
        let req = match opcode {
            op::HELLO => {
                let magic = d.take(4, "magic")?;
                if magic != MAGIC {
                    return Err(DecodeError(format!(
                        "handshake has magic {magic:02x?}, expected {MAGIC:02x?} (not a ddp-rs store client)"
                    )));
                }
                let version = d.u16("version")?;
                if version != VERSION {
                    // Another version's layout: the version is all the server needs to answer.
                    return Ok(Request::Hello {
                        version,
                        nonce: Vec::new(),
                    });
                }
                let nonce = d.bytes("client nonce")?;
                Request::Hello { version, nonce }
            }
            op::AUTH => Request::Auth {
                proof: d.bytes("proof")?,
            },
            op::SET => Request::Set {
                key: d.key()?,
                value: d.bytes("value")?,
            },
            op::GET => Request::Get {
                key: d.key()?,
                timeout_ms: d.u64("timeout_ms")?,
            },
            op::ADD => Request::Add {
                key: d.key()?,
                delta: d.i64("delta")?,
            },
            op::COMPARE_SET => Request::CompareSet {
                key: d.key()?,
                expected: d.bytes("expected")?,
                desired: d.bytes("desired")?,
            },
            op::WAIT => Request::Wait {
                keys: d.keys()?,
                timeout_ms: d.u64("timeout_ms")?,
            },
            op::DELETE => Request::Delete { key: d.key()? },
            op::NUM_KEYS => Request::NumKeys,
            op::CHECK => Request::Check { key: d.key()? },
            other => {
                return Err(DecodeError(format!(
                    "unknown request opcode 0x{other:02x} (client speaks a newer or different protocol?)"
                )))
            }
        };
        d.end()?;
        Ok(req)
    }
}

impl Response {
    /// The complete frame, length prefix included.
    pub(crate) fn encode(&self) -> Vec<u8> {
        match self {
            Response::Ok => Encoder::new(op::OK).finish(),
            Response::Refused => Encoder::new(op::REFUSED).finish(),
            Response::Challenge(n) => Encoder::new(op::CHALLENGE).bytes(n).finish(),
            Response::Welcome(p) => Encoder::new(op::WELCOME).bytes(p).finish(),
            Response::Value(v) => Encoder::new(op::VALUE).bytes(v).finish(),
            Response::Int(v) => Encoder::new(op::INT).raw(&v.to_le_bytes()).finish(),
            Response::Bool(v) => Encoder::new(op::BOOL).raw(&[*v as u8]).finish(),
            Response::Count(v) => Encoder::new(op::COUNT).raw(&v.to_le_bytes()).finish(),
            Response::Timeout(keys) => {
                let mut e = Encoder::new(op::TIMEOUT);
                encode_keys(&mut e, keys);
                e.finish()
            }
            Response::Error { kind, message } => Encoder::new(op::ERROR)
                .raw(&[*kind as u8])
                .bytes(message.as_bytes())
                .finish(),
        }
    }

    /// Parse a frame body (as returned by [`read_frame`]).
    pub(crate) fn decode(body: &[u8]) -> Result<Response, DecodeError> {
        let Some((&opcode, rest)) = body.split_first() else {
            return Err(DecodeError("empty reply".into()));
        };
        let mut d = Decoder {
            buf: rest,
            what: "reply",
        };
        let resp = match opcode {
            op::OK => Response::Ok,
            op::REFUSED => Response::Refused,
            op::CHALLENGE => Response::Challenge(d.bytes("server nonce")?),
            op::WELCOME => Response::Welcome(d.bytes("proof")?),
            op::VALUE => Response::Value(d.bytes("value")?),
            op::INT => Response::Int(d.i64("value")?),
            op::BOOL => match d.u8("value")? {
                0 => Response::Bool(false),
                1 => Response::Bool(true),
                b => return Err(DecodeError(format!("boolean reply has value {b}"))),
            },
            op::COUNT => Response::Count(d.u64("value")?),
            op::TIMEOUT => Response::Timeout(d.keys()?),
            op::ERROR => {
                let kind = match d.u8("kind")? {
                    1 => ErrorKind::InvalidArgument,
                    _ => ErrorKind::Store,
                };
                Response::Error {
                    kind,
                    message: d.string("message", MAX_FRAME)?,
                }
            }
            other => {
                return Err(DecodeError(format!(
                    "unknown reply opcode 0x{other:02x} (is this a ddp-rs store?)"
                )))
            }
        };
        d.end()?;
        Ok(resp)
    }
}

/// A timeout as sent on the wire: milliseconds, rounded up, [`NO_TIMEOUT`] for "forever".
pub(crate) fn timeout_to_ms(timeout: Duration) -> u64 {
    let ms = timeout.as_nanos().div_ceil(1_000_000);
    u64::try_from(ms).unwrap_or(NO_TIMEOUT)
}

/// Inverse of [`timeout_to_ms`]: `None` means "wait forever".
pub(crate) fn timeout_from_ms(ms: u64) -> Option<Duration> {
    (ms != NO_TIMEOUT).then(|| Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn body(frame: &[u8]) -> &[u8] {
        let len = u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize;
        assert_eq!(len, frame.len() - 4, "length prefix must match the body");
        &frame[4..]
    }

    fn all_requests() -> Vec<Request> {
        vec![
            Request::Hello {
                version: VERSION,
                nonce: vec![7; 32],
            },
            Request::Auth { proof: vec![9; 32] },
            Request::Set {
                key: "rdzv/addr/0".into(),
                value: vec![0, 1, 2, 255],
            },
            Request::Get {
                key: "k".into(),
                timeout_ms: 1234,
            },
            Request::Add {
                key: "counter".into(),
                delta: -7,
            },
            Request::CompareSet {
                key: "cas".into(),
                expected: vec![],
                desired: b"x".to_vec(),
            },
            Request::Wait {
                keys: vec!["a".into(), "".into(), "ü/ß".into()],
                timeout_ms: NO_TIMEOUT,
            },
            Request::Delete { key: "d".into() },
            Request::NumKeys,
            Request::Check { key: "c".into() },
        ]
    }

    fn all_responses() -> Vec<Response> {
        vec![
            Response::Ok,
            Response::Refused,
            Response::Challenge(vec![1; 32]),
            Response::Welcome(vec![2; 32]),
            Response::Value(b"v".to_vec()),
            Response::Int(i64::MIN),
            Response::Bool(true),
            Response::Bool(false),
            Response::Count(42),
            Response::Timeout(vec!["x".into(), "y".into()]),
            Response::Error {
                kind: ErrorKind::InvalidArgument,
                message: "nope".into(),
            },
            Response::Error {
                kind: ErrorKind::Store,
                message: String::new(),
            },
        ]
    }

    #[test]
    fn requests_round_trip() {
        for req in all_requests() {
            let frame = req.encode();
            assert_eq!(Request::decode(body(&frame)).unwrap(), req);
            // Through the framing layer too.
            let got = read_frame(&mut &frame[..], MAX_FRAME).unwrap();
            assert_eq!(Request::decode(&got).unwrap(), req);
        }
    }

    #[test]
    fn responses_round_trip() {
        for resp in all_responses() {
            let frame = resp.encode();
            assert_eq!(Response::decode(body(&frame)).unwrap(), resp);
        }
    }

    #[test]
    fn every_strict_prefix_of_a_request_is_rejected() {
        for req in all_requests() {
            let frame = req.encode();
            let b = body(&frame);
            for cut in 0..b.len() {
                assert!(
                    Request::decode(&b[..cut]).is_err(),
                    "{req:?} cut at {cut} must not decode"
                );
            }
            let mut longer = b.to_vec();
            longer.push(0);
            let err = Request::decode(&longer).unwrap_err();
            assert!(err.0.contains("trailing"), "{err}");
        }
    }

    #[test]
    fn rejects_bad_fields() {
        let err = Request::decode(&[0x7f]).unwrap_err();
        assert!(err.0.contains("unknown request opcode 0x7f"), "{err}");

        let mut bad_utf8 = vec![op::CHECK];
        bad_utf8.extend_from_slice(&2u32.to_le_bytes());
        bad_utf8.extend_from_slice(&[0xff, 0xfe]);
        let err = Request::decode(&bad_utf8).unwrap_err();
        assert!(err.0.contains("not valid UTF-8"), "{err}");

        let long = Request::Check {
            key: "k".repeat(MAX_KEY_LEN + 1),
        }
        .encode();
        let err = Request::decode(body(&long)).unwrap_err();
        assert!(err.0.contains("limit is 4096"), "{err}");

        let mut many = vec![op::WAIT];
        many.extend_from_slice(&u32::MAX.to_le_bytes());
        let err = Request::decode(&many).unwrap_err();
        assert!(err.0.contains("claims 4294967295 keys"), "{err}");

        let mut bad_magic = vec![op::HELLO];
        bad_magic.extend_from_slice(b"HTTP");
        let err = Request::decode(&bad_magic).unwrap_err();
        assert!(err.0.contains("not a ddp-rs store client"), "{err}");
    }

    #[test]
    fn hello_of_another_version_still_yields_its_version() {
        // Version 1's HELLO: magic, version 1, the secret in plain text.
        let mut v1 = vec![op::HELLO];
        v1.extend_from_slice(&MAGIC);
        v1.extend_from_slice(&1u16.to_le_bytes());
        v1.extend_from_slice(&3u32.to_le_bytes());
        v1.extend_from_slice(b"abc");
        assert_eq!(
            Request::decode(&v1).unwrap(),
            Request::Hello {
                version: 1,
                nonce: vec![]
            }
        );
    }

    #[test]
    fn read_frame_errors() {
        assert!(matches!(
            read_frame(&mut &[][..], MAX_FRAME),
            Err(FrameError::Closed)
        ));
        assert!(matches!(
            read_frame(&mut &[1u8, 0][..], MAX_FRAME),
            Err(FrameError::Truncated {
                expected: 4,
                got: 2
            })
        ));
        assert!(matches!(
            read_frame(&mut &[0u8, 0, 0, 0][..], MAX_FRAME),
            Err(FrameError::Empty)
        ));
        let huge = u32::MAX.to_le_bytes();
        assert!(matches!(
            read_frame(&mut &huge[..], MAX_FRAME),
            Err(FrameError::TooLarge { len, .. }) if len == u32::MAX as u64
        ));
        let short = [10u8, 0, 0, 0, op::NUM_KEYS, 1, 2];
        assert!(matches!(
            read_frame(&mut &short[..], MAX_FRAME),
            Err(FrameError::Truncated {
                expected: 10,
                got: 3
            })
        ));
        let over_handshake = ((MAX_HANDSHAKE_FRAME + 1) as u32).to_le_bytes();
        assert!(matches!(
            read_frame(&mut &over_handshake[..], MAX_HANDSHAKE_FRAME),
            Err(FrameError::TooLarge { .. })
        ));
    }

    #[test]
    fn timeouts_on_the_wire() {
        assert_eq!(timeout_to_ms(Duration::from_millis(1500)), 1500);
        assert_eq!(timeout_to_ms(Duration::from_micros(1)), 1);
        assert_eq!(timeout_to_ms(Duration::ZERO), 0);
        assert_eq!(timeout_to_ms(Duration::MAX), NO_TIMEOUT);
        assert_eq!(timeout_from_ms(NO_TIMEOUT), None);
        assert_eq!(timeout_from_ms(250), Some(Duration::from_millis(250)));
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Request::decode(&bytes);
            let _ = Response::decode(&bytes);
            let _ = read_frame(&mut &bytes[..], 1024);
        }

        #[test]
        fn set_round_trips(key in "\\PC{0,64}", value in proptest::collection::vec(any::<u8>(), 0..512)) {
            let req = Request::Set { key, value };
            let frame = req.encode();
            prop_assert_eq!(Request::decode(body(&frame)).unwrap(), req);
        }
    }
}
