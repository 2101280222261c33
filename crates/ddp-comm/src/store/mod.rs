//! The rendezvous store: a small TCP key-value server and its client.
//!
//! Ranks find each other through it (each publishes its listening address, then reads the
//! others'), and the launcher uses it to count arriving nodes. Semantics follow PyTorch's
//! `TCPStore`: `get` and `wait` block until the keys exist or the timeout passes, `add` is an
//! atomic counter, `compare_set` is an atomic swap.
//!
//! An optional shared secret (`DDP_STORE_SECRET`) makes the server refuse clients that do not
//! know it. The secret never crosses the wire: the client proves it knows it by an HMAC-SHA256
//! over a nonce of each side, and the server proves it back, so a client with a secret also
//! refuses a server that does not know it (`auth`). The data itself is not encrypted: keep the
//! store on a trusted network, as with PyTorch's.
//!
//! Anyone who can reach the port can connect, so the server bounds what a connection costs
//! before it authenticates: at most `DDP_STORE_MAX_CONNECTIONS` connections (default: three
//! quarters of the descriptor limit, at most 4096), unauthenticated ones capped separately and
//! evicted oldest (and silent or garbage ones) first, a 5 s handshake deadline, no thread for a
//! connection until it sends something, and an accept loop that survives running out of
//! descriptors. A client refused at the limit gets an error naming it. See `server`. The bytes
//! the store holds are capped too (`DDP_STORE_MAX_BYTES`, default 1 GiB): a write past the cap is
//! refused to its client with an error naming the cap (`data`).
//!
//! - `server`: [`StoreServer`] and [`ServerOptions`], the listening side (hosted by rank 0 or by
//!   `ddprun`) and its connection limits.
//! - `data`: the key-value map and its cap on the bytes held.
//! - `conns`: what the server's threads share: the key-value state, the open connections, their
//!   limits and admission (a leaf below `server`, `accept`, `serve` and `torch`).
//! - `sniff`: what a new connection's first bytes say (ours, PyTorch's, or garbage).
//! - `accept`: the accept loops, and the greeter that watches connections that sent nothing.
//! - `serve`: one connection's handshake and requests.
//! - `client`: [`TcpStore`], the connecting side.
//! - `auth`: the challenge-response proof of the secret.
//! - `prefix`: [`PrefixStore`], a namespace over any store.
//! - `protocol`: the wire format shared by both sides.
//! - `torch`: PyTorch's `TCPStore` protocol on the same port (told apart by its first bytes),
//!   so that PyTorch workers started by `ddprun` use this store as they use torchrun's.

mod accept;
mod auth;
mod client;
mod conns;
mod data;
mod prefix;
pub(crate) mod protocol;
mod serve;
mod server;
mod sniff;
pub(crate) mod torch;

pub use client::{StoreOptions, TcpStore};
pub use data::{DEFAULT_MAX_BYTES, MAX_BYTES_ENV};
pub use prefix::PrefixStore;
pub use server::{
    raise_fd_limit, ServerOptions, StoreServer, DEFAULT_HANDSHAKE_TIMEOUT, MAX_CONNECTIONS_ENV,
};
pub use torch::DEFAULT_TORCH_PREFIX;

use crate::Result;
use std::time::Duration;

/// Environment variable holding the optional shared secret of the store.
pub const SECRET_ENV: &str = "DDP_STORE_SECRET";

/// Default timeout of blocking store operations (PyTorch's default is 30 minutes too... for
/// collectives; its store default is 5 minutes, which we follow).
pub const DEFAULT_STORE_TIMEOUT: Duration = Duration::from_secs(300);

/// The key-value interface shared by [`TcpStore`] and [`PrefixStore`].
pub trait Store: Send + Sync {
    /// Set `key` to `value`, waking any `get`/`wait` blocked on it.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Value of `key`, blocking until it exists or [`Store::timeout`] passes.
    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.get_timeout(key, self.timeout())
    }
    /// Value of `key`, blocking until it exists or `timeout` passes.
    fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Atomically add `delta` to the integer stored at `key` (missing = 0); returns the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// If `key`'s value equals `expected` (or `key` is missing and `expected` is empty), set it
    /// to `desired`. Returns the value after the operation.
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;
    /// Block until every key in `keys` exists or `timeout` passes (the error names the missing keys).
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// Delete `key`; returns whether it existed.
    fn delete(&self, key: &str) -> Result<bool>;
    /// Number of keys currently stored.
    fn num_keys(&self) -> Result<u64>;
    /// Whether `key` exists right now (never blocks).
    fn check(&self, key: &str) -> Result<bool>;
    /// Default timeout of blocking operations.
    fn timeout(&self) -> Duration;
}
