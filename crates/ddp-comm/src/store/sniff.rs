//! What the first bytes of a new connection say about it, read without consuming them: a
//! ddp-rs client's `HELLO`, PyTorch's `TCPStore` `VALIDATE` query ([`PREAMBLE`]), or garbage.
//! Used by the greeter (`accept`), by eviction (`conns`: silent or garbage connections go
//! first) and by the connection threads; it imports none of them.

use super::protocol::{HELLO_OPCODE, MAGIC, MAX_HANDSHAKE_FRAME};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// `VALIDATE` (query 0) followed by PyTorch's magic number `0x3C85F7CE`, little-endian.
pub(crate) const PREAMBLE: [u8; 5] = [0x00, 0xce, 0xf7, 0x85, 0x3c];

/// What the first bytes of a connection say about it.
pub(super) enum FirstBytes {
    /// Nothing to read after all.
    NotYet,
    /// End of stream or an error: nothing to answer.
    HungUp,
    /// Cannot be a `HELLO`: the reply to send before closing.
    Garbage(String),
    /// A `HELLO` (or PyTorch's `VALIDATE`) as far as can be seen: a thread reads it.
    Plausible,
}

/// Peek at the frame header, opcode and magic of a new connection's first frame.
pub(super) fn first_bytes(stream: &TcpStream) -> FirstBytes {
    use rustix::net::{recv, RecvFlags};
    let mut head = [0u8; 9];
    let n = match recv(stream, &mut head[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
        Ok((0, _)) => return FirstBytes::HungUp,
        Ok((n, _)) => n,
        Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => return FirstBytes::NotYet,
        Err(_) => return FirstBytes::HungUp,
    };
    if may_be_torch(&head[..n]) {
        // PyTorch's TCPStore client: its thread tells it apart ([`is_torch_client`]).
        return FirstBytes::Plausible;
    }
    if n >= 4 {
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        if len == 0 {
            return FirstBytes::Garbage("bad handshake frame: empty frame (no opcode)".into());
        }
        if len > MAX_HANDSHAKE_FRAME {
            return FirstBytes::Garbage(format!(
                "bad handshake frame: frame of {len} bytes exceeds the limit of \
                 {MAX_HANDSHAKE_FRAME} bytes"
            ));
        }
    }
    if n >= 5 && head[4] != HELLO_OPCODE {
        return FirstBytes::Garbage("expected a handshake first".into());
    }
    if n >= 9 && head[5..9] != MAGIC {
        return FirstBytes::Garbage(format!(
            "bad handshake: magic {:02x?}, expected {MAGIC:02x?} (not a ddp-rs store client)",
            &head[5..9]
        ));
    }
    FirstBytes::Plausible
}

/// Whether the connection starts with PyTorch's [`PREAMBLE`]. Waits (until `until`) while the
/// bytes that arrived are a strict prefix of it; never consumes anything.
pub(crate) fn is_torch_client(stream: &TcpStream, until: Instant) -> bool {
    use rustix::net::{recv, RecvFlags};
    loop {
        let mut head = [0u8; PREAMBLE.len()];
        let n = match recv(stream, &mut head[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Ok((n, _)) => n,
            Err(rustix::io::Errno::AGAIN) | Err(rustix::io::Errno::INTR) => 0,
            Err(_) => return false,
        };
        if n == PREAMBLE.len() {
            return head == PREAMBLE;
        }
        if head[..n] != PREAMBLE[..n] || Instant::now() >= until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Whether the first `n` bytes of a connection could begin PyTorch's [`PREAMBLE`].
pub(crate) fn may_be_torch(head: &[u8]) -> bool {
    let n = head.len().min(PREAMBLE.len());
    n > 0 && head[..n] == PREAMBLE[..n]
}
