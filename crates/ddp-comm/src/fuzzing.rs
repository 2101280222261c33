//! The decoders that read what peers send, reachable from the fuzz tests (`tests/fuzz.rs`).
//! Not an API: each function runs one decoder on untrusted bytes and turns its verdict into a
//! `Result`, checking on the way what must hold for every input (a decoded message encodes back
//! to the same bytes). A panic here is a bug in the decoder.

use crate::store::{protocol, torch};
use crate::transport::{decode_header, encode_header, HEADER_LEN};

fn check_round_trip(what: &str, input: &[u8], encoded: &[u8]) -> Result<(), String> {
    if encoded != input {
        // Not an error of the input: the decoder accepted bytes it cannot reproduce.
        panic!("{what} decoded {input:02x?} but encodes back as {encoded:02x?}");
    }
    Ok(())
}

/// Decode a store request frame body (client → server). `Ok` holds the request's name.
pub fn store_request(body: &[u8]) -> Result<&'static str, String> {
    let req = protocol::Request::decode(body).map_err(|e| e.to_string())?;
    // A HELLO of another version is decoded from its version alone (its tail is not kept).
    let other_version =
        matches!(&req, protocol::Request::Hello { version, .. } if *version != protocol::VERSION);
    if !other_version {
        check_round_trip("request", body, &req.encode()[4..])?;
    }
    Ok(req.name())
}

/// Decode a store reply frame body (server → client).
pub fn store_response(body: &[u8]) -> Result<(), String> {
    let resp = protocol::Response::decode(body).map_err(|e| e.to_string())?;
    if let protocol::Response::Error { kind, .. } = &resp {
        // Unknown error kinds read as `Store`: the kind byte need not round-trip.
        if body.get(1).copied() != Some(*kind as u8) {
            return Ok(());
        }
    }
    check_round_trip("reply", body, &resp.encode()[4..])
}

/// Read one store frame from `stream` (length prefix and body) with the server's limit `max`;
/// `Ok` holds the body's length.
pub fn store_frame(stream: &[u8], max: usize) -> Result<usize, String> {
    let mut r = stream;
    protocol::read_frame(&mut r, max)
        .map(|b| b.len())
        .map_err(|e| e.to_string())
}

/// Read PyTorch `TCPStore` requests from `stream` until it ends or one is malformed; `Ok` holds
/// how many were read (the stream ending between two requests is not an error).
pub fn torch_requests(stream: &[u8]) -> Result<usize, String> {
    let mut r = stream;
    let mut n = 0;
    loop {
        match torch::read_request(&mut r) {
            Ok(_) => n += 1,
            Err(torch::TorchError::Closed) => return Ok(n),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// Decode a transport message header (the 40 bytes before every message of every transport),
/// as a receiver expecting `magic` does. `Ok` holds the message's description (its kind,
/// fingerprint and payload length); unknown operation codes are an error, as for the receiver.
pub fn transport_header(magic: u32, bytes: &[u8; HEADER_LEN]) -> Result<String, String> {
    let h = decode_header(magic, bytes).ok_or("corrupt header (wrong magic)")?;
    let fp =
        h.fp.ok_or_else(|| format!("unknown operation code in a header of kind {}", h.kind))?;
    let again = encode_header(magic, h.kind, &fp, h.len);
    // The last 4 bytes are padding, which the decoder ignores.
    check_round_trip("transport header", &bytes[..36], &again[..36])?;
    Ok(format!("kind {} {fp} seq {} len {}", h.kind, fp.seq, h.len))
}

/// Number of inputs per fuzz target: `FUZZ_CASES` (default `default`, kept small so that the
/// ordinary test run stays short; the long pass sets e.g. `FUZZ_CASES=1000000`).
pub fn cases(default: u32) -> u32 {
    match std::env::var("FUZZ_CASES") {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("FUZZ_CASES={v:?} is not a number of cases")),
        Err(_) => default,
    }
}

/// A global allocator for fuzz test binaries (`#[global_allocator] static A: TrackingAlloc =
/// TrackingAlloc;`) that records the largest single allocation made by a thread inside
/// [`largest_allocation_during`], so a test can bound what a decoder allocates for an input.
pub struct TrackingAlloc;

thread_local! {
    /// `Some(largest so far)` while the thread is inside `largest_allocation_during`.
    static WATCH: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

fn note(size: usize) {
    // `try_with`: allocations during thread teardown, after the slot is gone, are not watched.
    let _ = WATCH.try_with(|w| {
        if let Some(max) = w.get() {
            w.set(Some(max.max(size)));
        }
    });
}

// SAFETY: every method forwards to the system allocator with the caller's arguments unchanged;
// the bookkeeping touches only a const-initialised thread-local `Cell` (no allocation, no lock).
unsafe impl std::alloc::GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller's contract for `alloc` is the system allocator's.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` was allocated by `System` with `layout` (every allocation goes there).
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        note(new);
        // SAFETY: as for `dealloc`; `new` is the caller's valid new size.
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
}

/// Run `f` and return its result with the largest single allocation (bytes) it made on this
/// thread. Meaningful only in a binary whose global allocator is [`TrackingAlloc`].
pub fn largest_allocation_during<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let outer = WATCH.with(|w| w.replace(Some(0)));
    let out = f();
    let max = WATCH.with(|w| w.replace(outer)).unwrap_or(0);
    (out, max)
}
