//! Shared-memory transport for the ranks of a group that all run on one host.
//!
//! # Segment
//!
//! Rank 0 creates one file per group in `/dev/shm`, named `ddp-rs-{pid}-{random nonce}`, and
//! publishes the name through the store; every rank maps it, marks itself attached, and once
//! the store shows every rank attached, each rank unlinks the name. From then on the memory
//! lives only as long as some rank maps it: nothing is left in `/dev/shm`, even after `kill -9`.
//! (If rank 0 dies before the unlink, the next rank 0 on the host sweeps segments whose creator
//! pid is gone: [`sweep_stale_segments`].)
//!
//! ```text
//!  page 0       header: magic, version, world, geometry, abort word (0 or 1 + first aborter)
//!  ctrl[r]      per rank, 128-byte lines: bell + sleeping | state + pid | fingerprint (seqlock)
//!               | fast-path counters in / reduced / out | abort reason text
//!  ring[i][j]   per ordered pair i != j: head (consumer) | tail (producer) | ring_cap bytes
//!  fast[r]      per rank: `window` slots of `world` sub-chunks (the all-reduce fast path)
//! ```
//!
//! # Messages ([`Transport::exchange`])
//!
//! Rank `i` sends to `j` through `ring[i][j]`, a single-producer single-consumer byte ring: a
//! 40-byte header (the sender's [`Fingerprint`] and the payload length, as on TCP) followed by
//! the payload, streamed in pieces of at most [`PIECE`] bytes. The producer publishes bytes by
//! storing `tail` (release); the consumer frees them by storing `head`. The receiver checks the
//! header against its own fingerprint before copying the payload: a difference is
//! [`Error::Mismatch`] naming both sides. All sends and receives of one exchange progress
//! together, so a ring step cannot deadlock however small the rings are.
//!
//! ```text
//!  rank i (producer)                          rank j (consumer)
//!  wait free = cap - (tail - head) > 0        wait avail = tail - head > 0
//!  copy header/payload piece at tail          copy piece at head (check header first)
//!  tail += n (release) ; ring bell[j] ──────▶ head += n (release) ; ring bell[i] ──▶ (space)
//! ```
//!
//! # Waiting
//!
//! Each rank has a *bell*, a 32-bit futex word that every peer increments after changing
//! something the rank may wait for (data, space, progress counters, abort). A waiter reads its
//! bell, re-checks its condition, spins watching the bell ([`PURE_SPIN`], env
//! `DDP_SHM_PURE_SPIN_US`), keeps watching while yielding the CPU between checks (up to
//! [`DEFAULT_SPIN`] in all, env `DDP_SHM_SPIN_US`; a peer sharing this core gets to run), then
//! sets `sleeping` and `futex_wait`s on the bell value it saw, in slices of at most
//! [`SLEEP_SLICE`]. Ringers call `futex_wake` only when `sleeping` is set, so the fast path has
//! no system call. Once the spin is over, before each sleep, the waiter checks:
//! the abort word (a peer's failure reaches every rank, naming it and its reason), the state and
//! pid of the peers it waits for (`kill(pid, 0)` and zombie state: "died (pid N)"; a dropped
//! group: "left the group"), their published fingerprints (a peer in a different collective is
//! a mismatch even when it sends nothing) and the collective's deadline.
//!
//! # All-reduce fast path
//!
//! [`crate::algorithms::shm_allreduce`] bypasses the rings: ranks copy their input into their
//! fast area and reduce from each other's areas directly (see that module's diagram). It uses
//! the progress counters of the control blocks and the same waiting machinery.
//!
//! Geometry is chosen by rank 0 and stored in the header ([`default_geometry`]); env overrides
//! read by rank 0 (all ranks then agree): `DDP_SHM_RING_KB`, `DDP_SHM_CHUNK_KB`,
//! `DDP_SHM_WINDOW`, `DDP_SHM_ONE_SHOT_KB`.
//!
//! Not done: groups spanning hosts use TCP for everything (no hierarchical shm + TCP yet).

mod segment;

pub use segment::{sweep_stale_segments, Geometry, NAME_PREFIX};

use super::tcp::TcpTransport;
use super::{Fingerprint, OpKind, Recv, Send, Transport};
use crate::dtype::{DType, ReduceOp};
use crate::store::Store;
use crate::{Error, Result};
use segment::{Segment, STATE_ABORTED, STATE_ATTACHED, STATE_EMPTY, STATE_LEFT};
use std::cell::Cell;
use std::net::IpAddr;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Message header bytes (same fields as the TCP frame header).
const HEADER_LEN: usize = 40;
const MSG_MAGIC: u32 = 0xDD9C_5E01;
const NO_REDUCE: u8 = 0xFF;
/// Largest piece copied into or out of a ring before publishing it, so that the peer starts
/// copying while the rest is still being written.
pub const PIECE: usize = 64 * 1024;
/// Default spin before sleeping in `futex_wait`: busy for [`PURE_SPIN`], then yielding the CPU
/// between checks (when cores are oversubscribed the peer may be waiting for this one).
/// Measured on 2 vCPUs: waking a sleeping vCPU costs 10-50 us, so shorter spins lose latency.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(200);
/// Initial busy spin without yielding (a 5 us spin doubled the median 4 KiB latency on 2
/// loaded vCPUs: the first `sched_yield` gives the core away for ~15 us).
pub const PURE_SPIN: Duration = Duration::from_micros(50);
/// Longest single `futex_wait`; the group's health is checked between slices.
pub const SLEEP_SLICE: Duration = Duration::from_millis(5);
/// How often a waiting rank checks that the processes it waits for are alive.
const LIVENESS_EVERY: Duration = Duration::from_millis(20);

/// Which fast-path progress counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counter {
    /// Blocks whose input the rank has copied into its fast area.
    In,
    /// Blocks whose owned sub-chunk the rank has reduced and published.
    Reduced,
    /// Blocks the rank has finished reading from peers' areas.
    Out,
}

impl Counter {
    fn offset(self) -> usize {
        match self {
            Counter::In => segment::C_IN,
            Counter::Reduced => segment::C_RED,
            Counter::Out => segment::C_OUT,
        }
    }
}

fn env_usize(name: &str) -> Result<Option<usize>> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse::<usize>()
            .map(Some)
            .map_err(|_| Error::Config(format!("{name}={v:?} is not a non-negative integer"))),
        _ => Ok(None),
    }
}

/// The default geometry for `world` ranks, with env overrides.
pub fn default_geometry(world: usize) -> Result<Geometry> {
    let ring_cap = match env_usize("DDP_SHM_RING_KB")? {
        Some(kb) => (kb.clamp(4, 1 << 30) * 1024).next_power_of_two(),
        None if world <= 4 => 1 << 20,
        None if world <= 8 => 512 << 10,
        None => 256 << 10,
    };
    let sub_bytes = match env_usize("DDP_SHM_CHUNK_KB")? {
        Some(kb) => kb.clamp(4, 16 * 1024) * 1024,
        None => 64 << 10,
    };
    let window = env_usize("DDP_SHM_WINDOW")?.unwrap_or(8).clamp(4, 1024);
    let one_shot_max = match env_usize("DDP_SHM_ONE_SHOT_KB")? {
        Some(kb) => kb * 1024,
        // One-shot reads every peer's whole input: worth it while that stays small.
        None => (256 << 10) / world,
    }
    .min(world * sub_bytes);
    Ok(Geometry {
        ring_cap,
        sub_bytes,
        window,
        one_shot_max,
    })
}

/// This host's identity for backend selection: hostname, boot id, and the device and inode of
/// `/dev/shm` (containers on one machine with separate `/dev/shm` mounts differ).
pub fn host_id() -> String {
    use std::os::unix::fs::MetadataExt;
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    match std::fs::metadata(segment::SHM_DIR) {
        Ok(m) => format!("{host}/{boot}/{}:{}", m.dev(), m.ino()),
        // No shared memory here: an id no other process shares, so `auto` picks TCP.
        Err(_) => format!("{host}/{boot}/no-shm/{}", std::process::id()),
    }
}

/// Whether every rank of the group runs on this host, decided once by rank 0 from the host ids
/// every rank publishes (`id`: usually [`host_id`]). `None` when they all match; otherwise a
/// description of a rank that differs.
pub fn host_mismatch(
    store: &dyn Store,
    rank: usize,
    size: usize,
    id: &str,
    timeout: Duration,
) -> Result<Option<String>> {
    if size == 1 {
        return Ok(None);
    }
    store.set(&format!("host/{rank}"), id.as_bytes())?;
    let verdict = if rank == 0 {
        let mut verdict = String::new();
        for r in 1..size {
            let other = store
                .get_timeout(&format!("host/{r}"), timeout)
                .map_err(|e| match e {
                    Error::Timeout { timeout, .. } => Error::Timeout {
                        what: format!("rank {r} to join the rendezvous (world size {size})"),
                        timeout,
                    },
                    e => e,
                })?;
            if other != id.as_bytes() && verdict.is_empty() {
                verdict = format!(
                    "rank {r} runs on host {:?} and rank 0 on {id:?}",
                    String::from_utf8_lossy(&other)
                );
            }
        }
        store.set("host/verdict", format!("={verdict}").as_bytes())?;
        verdict
    } else {
        let v = store
            .get_timeout("host/verdict", timeout)
            .map_err(|e| match e {
                Error::Timeout { timeout, .. } => Error::Timeout {
                    what: format!("rank 0 to compare the hosts of the group (world size {size})"),
                    timeout,
                },
                e => e,
            })?;
        String::from_utf8_lossy(&v[1.min(v.len())..]).into_owned()
    };
    Ok((!verdict.is_empty()).then_some(verdict))
}

/// Connect the transport of a group whose backend is `auto` (`require_shm == false`: shared
/// memory when every rank is on this host, TCP otherwise) or `shm` (`require_shm == true`: an
/// error naming a remote rank when they are not).
pub fn connect_auto(
    store: &dyn Store,
    rank: usize,
    size: usize,
    local_ip: IpAddr,
    timeout: Duration,
    require_shm: bool,
) -> Result<Box<dyn Transport>> {
    match host_mismatch(store, rank, size, &host_id(), timeout)? {
        None => match ShmTransport::connect_inner(store, rank, size, timeout) {
            Ok(t) => Ok(Box::new(t)),
            Err(ConnectError::NoSegment(e)) if !require_shm => {
                tracing::warn!("{e}; using TCP");
                Ok(Box::new(TcpTransport::connect_mesh(store, rank, size, local_ip, timeout)?))
            }
            Err(ConnectError::NoSegment(e) | ConnectError::Other(e)) => Err(e),
        },
        Some(why) if require_shm => Err(Error::Config(format!(
            "backend shm needs every rank of the group on one host, but {why} (use backend auto or tcp)"
        ))),
        Some(why) => {
            tracing::debug!("group spans hosts ({why}): using TCP");
            Ok(Box::new(TcpTransport::connect_mesh(store, rank, size, local_ip, timeout)?))
        }
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a valid, aligned, shared (non-private: other processes map it)
    // 32-bit word with a relative timeout. Spurious returns are handled by the callers.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a valid shared word; wakes every waiter.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            0usize,
            0usize,
            0u32,
        );
    }
}

fn encode_header(fp: &Fingerprint, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..4].copy_from_slice(&MSG_MAGIC.to_le_bytes());
    h[5] = fp.op as u8;
    h[6] = fp.dtype.code();
    h[7] = fp.reduce.map_or(NO_REDUCE, |r| r.code());
    h[8..12].copy_from_slice(&fp.root.to_le_bytes());
    h[12..20].copy_from_slice(&fp.seq.to_le_bytes());
    h[20..28].copy_from_slice(&fp.count.to_le_bytes());
    h[28..36].copy_from_slice(&len.to_le_bytes());
    h
}

/// `(fingerprint, payload length)`; `None` for a corrupt header.
fn decode_header(h: &[u8; HEADER_LEN]) -> Option<(Option<Fingerprint>, u64)> {
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().unwrap());
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().unwrap());
    if u32_at(0) != MSG_MAGIC {
        return None;
    }
    let fp = unpack_fp(u64_at(12), u64_at(20), h[5], h[6], h[7], u32_at(8));
    Some((fp, u64_at(28)))
}

fn unpack_fp(
    seq: u64,
    count: u64,
    op: u8,
    dtype: u8,
    reduce: u8,
    root: u32,
) -> Option<Fingerprint> {
    Some(Fingerprint {
        seq,
        op: OpKind::from_code(op)?,
        dtype: DType::from_code(dtype)?,
        reduce: if reduce == NO_REDUCE {
            None
        } else {
            Some(ReduceOp::from_code(reduce)?)
        },
        count,
        root,
    })
}

fn describe(fp: &Fingerprint, mine: &Fingerprint, len: Option<u64>) -> String {
    let mut s = fp.to_string();
    if fp.seq != mine.seq {
        s.push_str(&format!(" #{}", fp.seq));
    }
    if let Some(len) = len {
        s.push_str(&format!(" [{len} bytes]"));
    }
    s
}

/// Why connecting failed. `NoSegment`: rank 0 could not create the segment (e.g. /dev/shm is
/// full or missing); every rank learns it through the store, so `auto` falls back to TCP on all.
enum ConnectError {
    NoSegment(Error),
    Other(Error),
}

impl From<Error> for ConnectError {
    fn from(e: Error) -> Self {
        ConnectError::Other(e)
    }
}

/// State of one wait: spin budget, liveness schedule, and a peer found gone (reported only if
/// a re-poll after noticing it still makes no progress, so its last data is never lost).
#[derive(Default)]
struct Idle {
    since: Option<Instant>,
    next_liveness: Option<Instant>,
    gone: Option<Error>,
}

/// One rank's end of a group's shared-memory segment.
pub struct ShmTransport {
    rank: usize,
    size: usize,
    /// `None` for a group of one rank (nothing to share).
    seg: Option<Segment>,
    fp: Fingerprint,
    deadline: Instant,
    op_timeout: Duration,
    pid: u32,
    /// Producer index of `ring[rank][j]` / consumer index of `ring[j][rank]`, per peer `j`.
    tails: Vec<u64>,
    heads: Vec<u64>,
    /// Fast-path blocks used so far (the progress counters are global across collectives).
    blocks: u64,
    spin: Duration,
    pure_spin: Duration,
    /// The next wait is this collective's first wait for its peers (see [`ShmTransport::idle`]).
    entry_pending: Cell<bool>,
    /// Moving average of how long those first waits lasted, in nanoseconds.
    entry_wait_ns: Cell<u64>,
    aborted: bool,
}

impl std::fmt::Debug for ShmTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTransport")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("geometry", &self.seg.as_ref().map(|s| s.geometry()))
            .finish()
    }
}

impl ShmTransport {
    /// Create (rank 0) or attach to (other ranks) the group's segment through `store` (already
    /// namespaced for this group), then unlink its name once every rank is attached.
    pub fn connect(
        store: &dyn Store,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<ShmTransport> {
        Self::connect_inner(store, rank, size, timeout).map_err(|e| match e {
            ConnectError::NoSegment(e) | ConnectError::Other(e) => e,
        })
    }

    fn connect_inner(
        store: &dyn Store,
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> std::result::Result<ShmTransport, ConnectError> {
        let deadline = Instant::now() + timeout;
        let spin = match env_usize("DDP_SHM_SPIN_US")? {
            Some(us) => Duration::from_micros(us as u64),
            None => DEFAULT_SPIN,
        };
        let pure_spin = match env_usize("DDP_SHM_PURE_SPIN_US")? {
            Some(us) => Duration::from_micros(us as u64),
            None => PURE_SPIN,
        };
        let pid = std::process::id();
        let seg = if size == 1 {
            None
        } else {
            Some(Self::attach(store, rank, size, deadline, timeout, pid)?)
        };
        Ok(ShmTransport {
            rank,
            size,
            seg,
            fp: Fingerprint {
                seq: 0,
                op: OpKind::Rendezvous,
                dtype: DType::U8,
                reduce: None,
                count: 0,
                root: Fingerprint::NO_ROOT,
            },
            deadline,
            op_timeout: timeout,
            pid,
            tails: vec![0; size],
            heads: vec![0; size],
            blocks: 0,
            spin,
            pure_spin,
            entry_pending: Cell::new(false),
            entry_wait_ns: Cell::new(0),
            aborted: false,
        })
    }

    fn attach(
        store: &dyn Store,
        rank: usize,
        size: usize,
        deadline: Instant,
        timeout: Duration,
        pid: u32,
    ) -> std::result::Result<Segment, ConnectError> {
        let remaining = || deadline.saturating_duration_since(Instant::now());
        let seg = if rank == 0 {
            let seg = match Segment::create(size, default_geometry(size)?) {
                Ok(seg) => seg,
                Err(e) => {
                    // Tell the other ranks, so that they fail (or fall back) the same way.
                    let _ = store.set("shm/name", format!("!{e}").as_bytes());
                    return Err(ConnectError::NoSegment(e));
                }
            };
            if let Err(e) = store.set("shm/name", seg.name().as_bytes()) {
                segment::unlink(seg.name());
                return Err(e.into());
            }
            seg
        } else {
            let name = store.get_timeout("shm/name", remaining()).map_err(|e| match e {
                Error::Timeout { timeout, .. } => Error::Timeout {
                    what: format!("rank 0 to create the group's shared-memory segment (world size {size})"),
                    timeout,
                },
                e => e,
            })?;
            if let Some(why) = name.strip_prefix(b"!") {
                return Err(ConnectError::NoSegment(Error::Config(format!(
                    "rank 0 could not create the shared-memory segment: {}",
                    String::from_utf8_lossy(why)
                ))));
            }
            Segment::open(&String::from_utf8_lossy(&name), size)?
        };
        seg.pid(rank).store(pid, Ordering::Relaxed);
        if seg
            .state(rank)
            .compare_exchange(
                STATE_EMPTY,
                STATE_ATTACHED,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .is_err()
        {
            let other = seg.pid(rank).load(Ordering::Relaxed);
            return Err(Error::Config(format!(
                "rank {rank} attached twice to the shared-memory segment (pids {other} and {pid}): two processes were given the same rank?"
            ))
            .into());
        }
        store.set(&format!("shm/attached/{rank}"), b"1")?;
        let keys: Vec<String> = (0..size).map(|r| format!("shm/attached/{r}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let waited = store.wait(&refs, remaining());
        // Every rank is attached (or the group failed): the name is no longer needed by anyone.
        segment::unlink(seg.name());
        if let Err(e) = waited {
            let missing: Vec<usize> = (0..size)
                .filter(|r| !store.check(&keys[*r]).unwrap_or(false))
                .collect();
            return Err(match e {
                Error::Timeout { .. } => Error::Timeout {
                    what: format!("rank(s) {missing:?} to attach the shared-memory segment (world size {size})"),
                    timeout,
                },
                e => e,
            }
            .into());
        }
        Ok(seg)
    }

    /// The segment's geometry (`None` for a group of one).
    pub fn geometry(&self) -> Option<Geometry> {
        self.seg.as_ref().map(|s| s.geometry())
    }

    fn seg(&self) -> &Segment {
        self.seg
            .as_ref()
            .expect("shared-memory segment of a group of more than one rank")
    }

    fn ring_bell(seg: &Segment, peer: usize) {
        seg.bell(peer).fetch_add(1, Ordering::SeqCst);
        if seg.sleeping(peer).load(Ordering::SeqCst) != 0 {
            futex_wake(seg.bell(peer));
        }
    }

    fn fail(&self, peer: usize, reason: impl Into<String>) -> Error {
        Error::PeerFailed {
            peer,
            op: self.fp.to_string(),
            seq: self.fp.seq,
            reason: reason.into(),
        }
    }

    fn publish_fp(&self) {
        let Some(seg) = &self.seg else { return };
        let fp = &self.fp;
        let code = fp.op as u64
            | (fp.dtype.code() as u64) << 8
            | (fp.reduce.map_or(NO_REDUCE, |r| r.code()) as u64) << 16
            | (fp.root as u64) << 32;
        let ver = seg.fp_word(self.rank, 0);
        let v = ver.load(Ordering::Relaxed);
        ver.store(v + 1, Ordering::Relaxed);
        fence(Ordering::Release);
        seg.fp_word(self.rank, 1).store(fp.seq, Ordering::Relaxed);
        seg.fp_word(self.rank, 2).store(fp.count, Ordering::Relaxed);
        seg.fp_word(self.rank, 3).store(code, Ordering::Relaxed);
        ver.store(v + 2, Ordering::Release);
    }

    /// The fingerprint `peer` published last (`None`: nothing yet, or being rewritten).
    fn peer_fp(&self, peer: usize) -> Option<Fingerprint> {
        let seg = self.seg();
        let ver = seg.fp_word(peer, 0);
        for _ in 0..1000 {
            let v1 = ver.load(Ordering::Acquire);
            if v1 == 0 {
                return None;
            }
            if v1 % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let seq = seg.fp_word(peer, 1).load(Ordering::Relaxed);
            let count = seg.fp_word(peer, 2).load(Ordering::Relaxed);
            let code = seg.fp_word(peer, 3).load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if ver.load(Ordering::Relaxed) == v1 {
                return unpack_fp(
                    seq,
                    count,
                    code as u8,
                    (code >> 8) as u8,
                    (code >> 16) as u8,
                    (code >> 32) as u32,
                );
            }
        }
        None
    }

    /// Mismatch if `peer` published a different collective under this sequence number (or, with
    /// `strict`, an earlier one: used once a peer's fast-path progress shows it is in this one).
    fn check_peer_fp(&self, peer: usize, strict: bool) -> Result<()> {
        if self.fp.op == OpKind::SendRecv {
            return Ok(());
        }
        let Some(theirs) = self.peer_fp(peer) else {
            return Ok(());
        };
        if theirs.op == OpKind::SendRecv {
            return Ok(());
        }
        if (theirs.seq == self.fp.seq && theirs != self.fp) || (strict && theirs.seq < self.fp.seq)
        {
            return Err(Error::Mismatch {
                seq: self.fp.seq,
                rank: self.rank,
                local: describe(&self.fp, &self.fp, None),
                peer,
                remote: describe(&theirs, &self.fp, None),
            });
        }
        Ok(())
    }

    fn timeout_error(&self, waiting: &[usize]) -> Error {
        let peer = waiting.first().copied().unwrap_or(self.rank);
        self.fail(
            peer,
            format!(
                "did not answer within the timeout of {:?} (stalled, deadlocked, or issuing other collectives); waiting on rank(s) {waiting:?}",
                self.op_timeout
            ),
        )
    }

    /// Checks made when a wait gets long: abort, peers gone, fingerprints.
    fn check_health(&self, st: &mut Idle, waiting: &[usize], now: Instant) -> Result<()> {
        let seg = self.seg();
        let a = seg.abort_word().load(Ordering::Acquire);
        if a != 0 && a as usize - 1 != self.rank {
            let who = a as usize - 1;
            return Err(self.fail(who, format!("aborted the group: {}", seg.reason(who))));
        }
        let check_pids = st.next_liveness.is_none_or(|t| now >= t);
        if check_pids {
            st.next_liveness = Some(now + LIVENESS_EVERY);
        }
        for &p in waiting {
            let gone = match seg.state(p).load(Ordering::Acquire) {
                STATE_LEFT => Some("left the group (its process group was shut down) before this collective completed".to_string()),
                STATE_ABORTED => Some(format!("aborted the group: {}", seg.reason(p))),
                _ => {
                    let pid = seg.pid(p).load(Ordering::Relaxed);
                    (check_pids && pid != self.pid && segment::pid_is_dead(pid))
                        .then(|| format!("died (pid {pid}): its process exited or was killed"))
                }
            };
            if let Some(reason) = gone {
                if st.gone.is_some() {
                    return Err(self.fail(p, reason));
                }
                // Re-poll once: what it published before leaving is still readable.
                st.gone = Some(self.fail(p, reason));
                return Ok(());
            }
            self.check_peer_fp(p, false)?;
        }
        Ok(())
    }

    /// Nothing changed since the bell read `seen`: spin, then (after health checks) sleep on
    /// the bell. Returns to let the caller re-poll.
    ///
    /// `entry`: this is the collective's first wait for its peers. When those waits have lately
    /// been long (peers arrive much later, e.g. still computing gradients), spinning would only
    /// take the CPU from them, so it sleeps at once.
    fn idle(
        &self,
        st: &mut Idle,
        seen: u32,
        waiting: &dyn Fn() -> Vec<usize>,
        entry: bool,
    ) -> Result<()> {
        let seg = self.seg();
        let bell = seg.bell(self.rank);
        let now = Instant::now();
        let since = *st.since.get_or_insert(now);
        let waited = now.duration_since(since);
        let spin = if entry && self.entry_wait_ns.get() > self.spin.as_nanos() as u64 {
            Duration::ZERO
        } else {
            self.spin
        };
        if waited < spin {
            if waited >= self.pure_spin {
                // Cores may be oversubscribed: let the peer we wait for run on this one.
                std::thread::yield_now();
            }
            for _ in 0..64 {
                if bell.load(Ordering::Relaxed) != seen {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            return Ok(());
        }
        let waiting = waiting();
        let was_gone = st.gone.is_some();
        self.check_health(st, &waiting, now)?;
        if st.gone.is_some() && !was_gone {
            return Ok(());
        }
        let remaining = self.deadline.saturating_duration_since(now);
        if remaining.is_zero() {
            return Err(self.timeout_error(&waiting));
        }
        let sleeping = seg.sleeping(self.rank);
        sleeping.store(1, Ordering::SeqCst);
        if bell.load(Ordering::SeqCst) == seen {
            futex_wait(bell, seen, remaining.min(SLEEP_SLICE));
        }
        sleeping.store(0, Ordering::Relaxed);
        Ok(())
    }

    /// The collective's first wait is over: fold its length into the moving average.
    fn record_entry_wait(&self, st: &Idle) {
        if self.entry_pending.replace(false) {
            let waited = st.since.map_or(0, |t| t.elapsed().as_nanos() as u64);
            self.entry_wait_ns
                .set((self.entry_wait_ns.get() * 7 + waited) / 8);
        }
    }

    fn check_peer_index(&self, peer: usize, what: &str) -> Result<()> {
        if peer >= self.size || peer == self.rank {
            return Err(Error::InvalidArgument(format!(
                "{what} rank {peer}: not another rank of this group of size {} (this is rank {})",
                self.size, self.rank
            )));
        }
        Ok(())
    }

    // ----- fast path (used by `algorithms::shm_allreduce`) ------------------------------------

    /// Geometry of the fast path.
    pub(crate) fn fast_geometry(&self) -> Geometry {
        self.seg().geometry()
    }

    /// Reserve `n` consecutive fast-path blocks; returns the first block's global index.
    pub(crate) fn take_blocks(&mut self, n: u64) -> u64 {
        let first = self.blocks;
        self.blocks += n;
        first
    }

    /// Start of `rank`'s fast-area slot for global block `block`.
    pub(crate) fn fast_slot(&self, rank: usize, block: u64) -> *mut u8 {
        let seg = self.seg();
        seg.fast_slot(rank, (block % seg.geometry().window as u64) as usize)
    }

    /// Publish this rank's progress counter and ring every peer.
    pub(crate) fn publish(&self, which: Counter, value: u64) {
        let seg = self.seg();
        seg.counter(self.rank, which.offset())
            .store(value, Ordering::Release);
        for p in (0..self.size).filter(|&p| p != self.rank) {
            Self::ring_bell(seg, p);
        }
    }

    /// Wait until every peer's counter `which` is at least `value`.
    pub(crate) fn wait_peers(&self, which: Counter, value: u64) -> Result<()> {
        let seg = self.seg();
        let lagging = || -> Vec<usize> {
            (0..self.size)
                .filter(|&p| {
                    p != self.rank && seg.counter(p, which.offset()).load(Ordering::Acquire) < value
                })
                .collect()
        };
        let mut st = Idle::default();
        let entry = which == Counter::In && self.entry_pending.get();
        loop {
            let seen = seg.bell(self.rank).load(Ordering::SeqCst);
            let ready = (0..self.size).all(|p| {
                p == self.rank || seg.counter(p, which.offset()).load(Ordering::Acquire) >= value
            });
            if ready {
                if entry {
                    self.record_entry_wait(&st);
                }
                return Ok(());
            }
            self.idle(&mut st, seen, &lagging, entry)?;
        }
    }

    /// After every peer's `In` counter shows it reached this collective: fail with a mismatch
    /// if any of them is in a different one.
    pub(crate) fn check_same_collective(&self) -> Result<()> {
        for p in (0..self.size).filter(|&p| p != self.rank) {
            self.check_peer_fp(p, true)?;
        }
        Ok(())
    }
}

/// Progress of one send within an exchange.
struct SendState {
    header: [u8; HEADER_LEN],
    header_done: bool,
    done: usize,
}

/// Progress of one receive within an exchange.
struct RecvState {
    header_done: bool,
    done: usize,
}

impl Transport for ShmTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn begin(&mut self, fp: Fingerprint, deadline: Instant) {
        self.fp = fp;
        self.deadline = deadline;
        self.op_timeout = deadline.saturating_duration_since(Instant::now());
        self.entry_pending.set(true);
        self.publish_fp();
    }

    fn exchange(&mut self, sends: &mut [Send<'_>], recvs: &mut [Recv<'_>]) -> Result<()> {
        for s in sends.iter() {
            self.check_peer_index(s.to, "send to")?;
        }
        for r in recvs.iter() {
            self.check_peer_index(r.from, "receive from")?;
        }
        if sends.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        let mut sst: Vec<SendState> = sends
            .iter()
            .map(|s| SendState {
                header: encode_header(&self.fp, s.data.len() as u64),
                header_done: false,
                done: 0,
            })
            .collect();
        let mut rst: Vec<RecvState> = recvs
            .iter()
            .map(|_| RecvState {
                header_done: false,
                done: 0,
            })
            .collect();
        let mut st = Idle::default();
        let mut busy = vec![false; self.size];
        let seg = self.seg.as_ref().expect("a group with peers has a segment");
        loop {
            let seen = seg.bell(self.rank).load(Ordering::SeqCst);
            let mut progress = false;
            let mut pending = false;
            // Several messages to (from) one peer in one exchange go in posting order.
            busy.fill(false);
            for (s, ss) in sends.iter().zip(sst.iter_mut()) {
                if ss.header_done && ss.done == s.data.len() {
                    continue;
                }
                if std::mem::replace(&mut busy[s.to], true) {
                    pending = true;
                    continue;
                }
                let ring = seg.ring(self.rank, s.to);
                let mut tail = self.tails[s.to];
                let free = ring.cap - (tail - ring.head.load(Ordering::Acquire)) as usize;
                let mut room = free;
                if !ss.header_done && room >= HEADER_LEN {
                    ring.write_at(tail, &ss.header);
                    tail += HEADER_LEN as u64;
                    room -= HEADER_LEN;
                    ss.header_done = true;
                }
                if ss.header_done {
                    let n = room.min(s.data.len() - ss.done).min(PIECE);
                    ring.write_at(tail, &s.data[ss.done..ss.done + n]);
                    tail += n as u64;
                    ss.done += n;
                }
                if tail != self.tails[s.to] {
                    self.tails[s.to] = tail;
                    ring.tail.store(tail, Ordering::Release);
                    Self::ring_bell(seg, s.to);
                    progress = true;
                }
                if !(ss.header_done && ss.done == s.data.len()) {
                    pending = true;
                }
            }
            busy.fill(false);
            for (r, rs) in recvs.iter_mut().zip(rst.iter_mut()) {
                if rs.header_done && rs.done == r.buf.len() {
                    continue;
                }
                if std::mem::replace(&mut busy[r.from], true) {
                    pending = true;
                    continue;
                }
                let ring = seg.ring(r.from, self.rank);
                let mut head = self.heads[r.from];
                let mut avail = (ring.tail.load(Ordering::Acquire) - head) as usize;
                if !rs.header_done && avail >= HEADER_LEN {
                    let mut h = [0u8; HEADER_LEN];
                    ring.read_at(head, &mut h);
                    head += HEADER_LEN as u64;
                    avail -= HEADER_LEN;
                    rs.header_done = true;
                    let fail = match decode_header(&h) {
                        None => Some(
                            self.fail(r.from, "sent a corrupt message header (protocol violation)"),
                        ),
                        Some((None, _)) => {
                            Some(self.fail(r.from, "sent a message with an unknown operation code"))
                        }
                        Some((Some(remote), len))
                            if remote != self.fp || len != r.buf.len() as u64 =>
                        {
                            Some(Error::Mismatch {
                                seq: self.fp.seq,
                                rank: self.rank,
                                local: describe(&self.fp, &self.fp, Some(r.buf.len() as u64)),
                                peer: r.from,
                                remote: describe(&remote, &self.fp, Some(len)),
                            })
                        }
                        Some(_) => None,
                    };
                    if let Some(e) = fail {
                        self.heads[r.from] = head;
                        ring.head.store(head, Ordering::Release);
                        return Err(e);
                    }
                }
                if rs.header_done {
                    let n = avail.min(r.buf.len() - rs.done).min(PIECE);
                    ring.read_at(head, &mut r.buf[rs.done..rs.done + n]);
                    head += n as u64;
                    rs.done += n;
                }
                if head != self.heads[r.from] {
                    self.heads[r.from] = head;
                    ring.head.store(head, Ordering::Release);
                    Self::ring_bell(seg, r.from);
                    progress = true;
                }
                if !(rs.header_done && rs.done == r.buf.len()) {
                    pending = true;
                }
            }
            if !pending {
                self.record_entry_wait(&st);
                return Ok(());
            }
            if progress {
                if st.since.is_some() {
                    self.record_entry_wait(&st);
                }
                st = Idle::default();
                continue;
            }
            let waiting = || -> Vec<usize> {
                let mut w: Vec<usize> = recvs
                    .iter()
                    .zip(&rst)
                    .filter(|(r, rs)| !(rs.header_done && rs.done == r.buf.len()))
                    .map(|(r, _)| r.from)
                    .chain(
                        sends
                            .iter()
                            .zip(&sst)
                            .filter(|(s, ss)| !(ss.header_done && ss.done == s.data.len()))
                            .map(|(s, _)| s.to),
                    )
                    .collect();
                w.dedup();
                w
            };
            self.idle(&mut st, seen, &waiting, self.entry_pending.get())?;
        }
    }

    fn abort(&mut self, cause: &Error) {
        let Some(seg) = &self.seg else { return };
        self.aborted = true;
        let reason = format!("rank {}: {}", self.rank, cause.root_cause());
        seg.set_reason(self.rank, &reason);
        seg.state(self.rank).store(STATE_ABORTED, Ordering::Release);
        let _ = seg.abort_word().compare_exchange(
            0,
            self.rank as u32 + 1,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        for p in (0..self.size).filter(|&p| p != self.rank) {
            seg.bell(p).fetch_add(1, Ordering::SeqCst);
            futex_wake(seg.bell(p));
        }
    }

    fn shm(&mut self) -> Option<&mut ShmTransport> {
        Some(self)
    }
}

impl Drop for ShmTransport {
    fn drop(&mut self) {
        let Some(seg) = &self.seg else { return };
        if !self.aborted {
            seg.state(self.rank).store(STATE_LEFT, Ordering::Release);
        }
        for p in (0..self.size).filter(|&p| p != self.rank) {
            Self::ring_bell(seg, p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{StoreOptions, StoreServer, TcpStore};
    use std::sync::Arc;

    fn fp(seq: u64, count: u64) -> Fingerprint {
        Fingerprint {
            seq,
            op: OpKind::AllReduce,
            dtype: DType::BF16,
            reduce: Some(ReduceOp::Max),
            count,
            root: Fingerprint::NO_ROOT,
        }
    }

    #[test]
    fn headers_round_trip() {
        let f = fp(7, 1 << 40);
        let (got, len) = decode_header(&encode_header(&f, 12345)).unwrap();
        assert_eq!(got, Some(f));
        assert_eq!(len, 12345);
        let mut bad = encode_header(&f, 1);
        bad[0] ^= 1;
        assert!(decode_header(&bad).is_none());
    }

    fn store(server: &StoreServer) -> Arc<dyn Store> {
        let opts = StoreOptions {
            secret: None,
            timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(10),
        };
        Arc::new(TcpStore::connect(&server.local_addr().to_string(), opts).unwrap())
    }

    #[test]
    fn host_mismatch_names_the_rank_on_another_host() {
        let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
        let ids = ["a/boot", "a/boot", "b/boot"];
        let out: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let st = store(&server);
                    s.spawn(move || {
                        host_mismatch(&*st, r, 3, ids[r], Duration::from_secs(10)).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for v in &out {
            let v = v.as_deref().expect("mismatch detected");
            assert!(v.contains("rank 2") && v.contains("b/boot"), "{v}");
        }
        assert_eq!(out[0], out[1]);
        assert_eq!(
            host_mismatch(&*store(&server), 0, 1, "x", Duration::from_secs(1)).unwrap(),
            None
        );
    }

    #[test]
    fn published_fingerprints_are_read_back_and_compared() {
        let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
        let mut ts: Vec<ShmTransport> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|r| {
                    let st = store(&server);
                    s.spawn(move || {
                        ShmTransport::connect(&*st, r, 2, Duration::from_secs(10)).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(ts[0].peer_fp(1), None, "nothing published yet");
        let deadline = Instant::now() + Duration::from_secs(5);
        ts[0].begin(fp(3, 10), deadline);
        ts[1].begin(fp(3, 10), deadline);
        assert_eq!(ts[1].peer_fp(0), Some(fp(3, 10)));
        ts[1].check_same_collective().unwrap();
        ts[1].begin(fp(3, 11), deadline);
        let e = ts[0].check_same_collective().unwrap_err().to_string();
        assert!(
            e.contains("x 10") && e.contains("x 11") && e.contains("rank 1"),
            "{e}"
        );
        // A peer still on an earlier collective is only a mismatch once its progress says otherwise.
        ts[1].begin(fp(2, 10), deadline);
        ts[0].check_peer_fp(1, false).unwrap();
        assert!(ts[0].check_peer_fp(1, true).is_err());
    }
}
