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
//!  page 0       header: magic, version, world, geometry | abort word (0 or 1 + first aborter)
//!               | chunks claimed | chunks done (cross-memory-attach all-reduce)
//!  ctrl[r]      per rank, 128-byte lines: bell + sleeping | state + pid | fingerprint (seqlock)
//!               | fast-path counters in / reduced / out | registered buffer | probe | reason
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
//! no system call. A collective's *first* wait skips the spin when such waits have lately been
//! long ([`ENTRY_SLEEP_AFTER`], a moving average): peers that arrive late (still computing, as
//! in DDP with overlapped buckets) then get the CPU instead of a spinning waiter. Once the spin is over, before each sleep, the waiter checks:
//! the abort word (a peer's failure reaches every rank, naming it and its reason), the state and
//! pid of the peers it waits for (`kill(pid, 0)` and zombie state: "died (pid N)"; a dropped
//! group: "left the group"), their published fingerprints (a peer in a different collective is
//! a mismatch even when it sends nothing) and the collective's deadline.
//!
//! # Placement
//!
//! A waiter that finds the peer it waits for last seen on its own CPU yields from the start
//! instead of spinning (spinning would keep that peer off the CPU: ~100 us per hand-over on 2
//! busy vCPUs). With no more local ranks than CPUs, each rank's communication thread binds to
//! one CPU ([`bind_cpu`], env `DDP_SHM_BIND=0` to disable), which keeps hand-overs between a
//! rank's caller and communication threads off halted vCPUs.
//!
//! # All-reduce fast path
//!
//! [`crate::algorithms::shm_direct`] bypasses the rings: ranks copy their input into their
//! fast area and reduce from each other's areas directly (see that module's diagram), or, for
//! large messages when the kernel allows it, copy straight between the ranks' buffers with
//! `process_vm_readv`/`process_vm_writev` (cross-memory attach). Whether every rank may do the
//! latter is probed once at setup (each reads a value from every peer; containers often forbid
//! it; `DDP_SHM_CMA=0` turns it off) and agreed through the segment. Both use the progress
//! counters of the control blocks and the same waiting machinery.
//!
//! Geometry is chosen by rank 0 and stored in the header ([`default_geometry`]); env overrides
//! read by rank 0 (all ranks then agree): `DDP_SHM_RING_KB`, `DDP_SHM_CHUNK_KB`,
//! `DDP_SHM_WINDOW`, `DDP_SHM_ONE_SHOT_KB`, `DDP_SHM_CMA_MIN_KB`, `DDP_SHM_CMA_CHUNK_KB`.
//!
//! Groups spanning hosts use this transport only inside each host, under
//! [`super::hierarchical`] ([`connect_auto`] decides).

mod segment;

pub use segment::{sweep_stale_segments, Geometry, NAME_PREFIX};

use super::hierarchical::HierarchicalTransport;
use super::tcp::TcpTransport;
use super::{
    decode_header, encode_header, Fingerprint, OpKind, Recv, Send, Transport, HEADER_LEN, NO_REDUCE,
};
use crate::dtype::DType;
use crate::store::Store;
use crate::{Error, Result};
use segment::{Segment, STATE_ABORTED, STATE_ATTACHED, STATE_EMPTY, STATE_LEFT};
use std::cell::Cell;
use std::net::IpAddr;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Message header bytes (same fields as the TCP frame header).
const MSG_MAGIC: u32 = 0xDD9C_5E01;
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
/// A collective's first wait skips spinning when such waits averaged more than this lately
/// (peers still computing). Lower thresholds (200 us) let the wake-up latency of a sleeping
/// vCPU (50-300 us) keep the average up and trapped small all-reduces at ~50 us instead of 4.
pub const ENTRY_SLEEP_AFTER: Duration = Duration::from_millis(1);
/// Longest single `futex_wait`; the group's health is checked between slices.
pub const SLEEP_SLICE: Duration = Duration::from_millis(5);
/// All-reduces from this size use cross-memory attach (when every rank can use it).
pub const DEFAULT_CMA_MIN: usize = 1 << 20;
/// Chunk of work claimed at a time in the cross-memory-attach all-reduce.
pub const DEFAULT_CMA_CHUNK: usize = 256 << 10;
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
    /// Cross-memory-attach all-reduces the rank has entered (its buffer is published).
    Registered,
}

impl Counter {
    fn offset(self) -> usize {
        match self {
            Counter::In => segment::C_IN,
            Counter::Reduced => segment::C_RED,
            Counter::Out => segment::C_OUT,
            Counter::Registered => segment::C_REG,
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
    let cma_min = match env_usize("DDP_SHM_CMA_MIN_KB")? {
        Some(kb) => kb * 1024,
        None => DEFAULT_CMA_MIN,
    };
    let cma_chunk = match env_usize("DDP_SHM_CMA_CHUNK_KB")? {
        Some(kb) => kb.clamp(4, 64 * 1024) * 1024,
        None => DEFAULT_CMA_CHUNK,
    };
    Ok(Geometry {
        ring_cap,
        sub_bytes,
        window,
        one_shot_max,
        cma_min,
        cma_chunk,
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

/// Which host every rank of a group runs on, decided once by rank 0 from the host ids every
/// rank publishes ([`host_layout`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostLayout {
    /// Host index of every rank. Hosts are numbered in the order of their lowest rank, so host
    /// 0 holds rank 0 and the hosts' lowest ranks (their leaders) ascend with the index.
    pub host_of: Vec<usize>,
    /// When the ranks are not all on one host: a rank on another host than rank 0's, as
    /// `rank 2 runs on host "b/..." and rank 0 on "a/..."`.
    pub mismatch: Option<String>,
}

impl HostLayout {
    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.host_of.iter().max().map_or(0, |&h| h + 1)
    }

    /// The ranks on host `h`, ascending.
    pub fn ranks_on(&self, h: usize) -> Vec<usize> {
        (0..self.host_of.len())
            .filter(|&r| self.host_of[r] == h)
            .collect()
    }
}

/// Where the ranks of the group run: every rank publishes `id` (usually [`host_id`]), rank 0
/// numbers the distinct ids and publishes the layout, the others read it.
pub fn host_layout(
    store: &dyn Store,
    rank: usize,
    size: usize,
    id: &str,
    timeout: Duration,
) -> Result<HostLayout> {
    if size == 1 {
        return Ok(HostLayout {
            host_of: vec![0],
            mismatch: None,
        });
    }
    store.set(&format!("host/{rank}"), id.as_bytes())?;
    // Published as "h0,h1,...\n<mismatch or empty>".
    let verdict = if rank == 0 {
        let mut ids = vec![id.as_bytes().to_vec()];
        let mut mismatch = String::new();
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
            if other != id.as_bytes() && mismatch.is_empty() {
                mismatch = format!(
                    "rank {r} runs on host {:?} and rank 0 on {id:?}",
                    String::from_utf8_lossy(&other)
                );
            }
            ids.push(other);
        }
        let mut distinct: Vec<&[u8]> = Vec::new();
        let host_of: Vec<String> = ids
            .iter()
            .map(|i| {
                let h = distinct.iter().position(|d| *d == i.as_slice());
                h.unwrap_or_else(|| {
                    distinct.push(i);
                    distinct.len() - 1
                })
                .to_string()
            })
            .collect();
        let host_of = host_of.join(",");
        let v = format!("{host_of}\n{mismatch}");
        store.set("host/verdict", v.as_bytes())?;
        v
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
        String::from_utf8_lossy(&v).into_owned()
    };
    let malformed = || Error::Io {
        context: "host layout".into(),
        message: format!("rank 0 published a malformed layout {verdict:?}"),
    };
    let (hosts, mismatch) = verdict.split_once('\n').ok_or_else(malformed)?;
    let host_of = hosts
        .split(',')
        .map(|h| h.parse::<usize>().map_err(|_| malformed()))
        .collect::<Result<Vec<_>>>()?;
    if host_of.len() != size {
        return Err(malformed());
    }
    Ok(HostLayout {
        host_of,
        mismatch: (!mismatch.is_empty()).then(|| mismatch.to_string()),
    })
}

/// Connect the transport of a group whose backend is `auto` (`require_shm == false`) or `shm`
/// (`require_shm == true`), given this process's host id `id` ([`host_id`] unless overridden):
///
/// - every rank on this host: shared memory (`auto` falls back to TCP if no segment can be
///   created);
/// - ranks on several hosts, some host with at least two: `shm` fails naming a remote rank,
///   `auto` builds a [`HierarchicalTransport`] (TCP mesh plus shared memory per host);
/// - one rank per host: `shm` fails, `auto` uses the TCP mesh.
pub fn connect_auto(
    store: &Arc<dyn Store>,
    rank: usize,
    size: usize,
    local_ip: IpAddr,
    timeout: Duration,
    require_shm: bool,
    id: &str,
) -> Result<Box<dyn Transport>> {
    let layout = host_layout(&**store, rank, size, id, timeout)?;
    let Some(why) = &layout.mismatch else {
        return match ShmTransport::connect_inner(&**store, rank, size, timeout) {
            Ok(t) => Ok(Box::new(t)),
            Err(ConnectError::NoSegment(e)) if !require_shm => {
                tracing::warn!("{e}; using TCP");
                Ok(Box::new(TcpTransport::connect_mesh(
                    &**store, rank, size, local_ip, timeout,
                )?))
            }
            Err(ConnectError::NoSegment(e) | ConnectError::Other(e)) => Err(e),
        };
    };
    if require_shm {
        return Err(Error::Config(format!(
            "backend shm needs every rank of the group on one host, but {why} (use backend auto or tcp)"
        )));
    }
    if layout.hosts() < size {
        tracing::debug!("group spans hosts ({why}): TCP mesh plus shared memory inside hosts");
        return Ok(Box::new(HierarchicalTransport::connect(
            store, rank, size, local_ip, timeout, &layout,
        )?));
    }
    tracing::debug!("group spans hosts ({why}), one rank per host: using TCP");
    Ok(Box::new(TcpTransport::connect_mesh(
        &**store, rank, size, local_ip, timeout,
    )?))
}

/// The CPU a rank's communication thread binds to: with at most one local rank per CPU this
/// process may use, local rank `l` (env `LOCAL_RANK`, else the group rank) takes the `l`-th
/// allowed CPU; `None` when ranks outnumber CPUs or env `DDP_SHM_BIND=0`.
///
/// Measured on 2 vCPUs: unbound, a rank's caller and communication threads often end up on
/// different CPUs, and every hand-over then wakes a halted vCPU (~15 us each way): 1-4 KiB
/// all-reduces took 34-45 us in about half the runs instead of 3-4 us.
pub fn bind_cpu(rank: usize, size: usize) -> Result<Option<usize>> {
    if std::env::var("DDP_SHM_BIND").is_ok_and(|v| v.trim() == "0") {
        return Ok(None);
    }
    let local_rank = env_usize("LOCAL_RANK")?.unwrap_or(rank);
    let local_world = env_usize("LOCAL_WORLD_SIZE")?.unwrap_or(size);
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills it for this thread.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let ok =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }
            == 0;
    if !ok {
        return Ok(None);
    }
    let allowed: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    if allowed.is_empty() || local_world > allowed.len() {
        return Ok(None);
    }
    Ok(Some(allowed[local_rank % allowed.len()]))
}

/// Bind the calling thread to `cpu` (best effort).
fn bind_current_thread(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t with one CPU set; affects only the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::debug!("cannot bind the communication thread to CPU {cpu}");
        }
    }
}

/// Value every rank exposes for its peers' cross-memory-attach probe.
const PROBE_MAGIC: u64 = 0xDD9C_C3A0_5EED_0001;

/// `process_vm_readv` (or `writev` with `write`) of `len` bytes between `local` in this process
/// and `remote` in process `pid`, looping over partial transfers.
fn cma_copy(
    pid: u32,
    remote: usize,
    local: *mut u8,
    len: usize,
    write: bool,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        let l = libc::iovec {
            iov_base: local.wrapping_add(done).cast(),
            iov_len: len - done,
        };
        let r = libc::iovec {
            iov_base: (remote + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: `l` covers memory of this process the caller owns for the call; the kernel
        // checks `r` against the peer's address space (EFAULT, never UB here).
        let n = unsafe {
            if write {
                libc::process_vm_writev(pid as libc::pid_t, &l, 1, &r, 1, 0)
            } else {
                libc::process_vm_readv(pid as libc::pid_t, &l, 1, &r, 1, 0)
            }
        };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "no progress",
            ));
        }
        done += n as usize;
    }
    Ok(())
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
    /// A peer waited for was last seen on this rank's CPU.
    colocated: bool,
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
    /// [`ENTRY_SLEEP_AFTER`], or env `DDP_SHM_ENTRY_SLEEP_US`.
    entry_sleep_after: Duration,
    /// The next wait is this collective's first wait for its peers (see [`ShmTransport::idle`]).
    entry_pending: Cell<bool>,
    /// Moving average of how long those first waits lasted, in nanoseconds.
    entry_wait_ns: Cell<u64>,
    /// Every rank can read and write every other's memory (`process_vm_readv`/`writev`).
    cma: bool,
    /// The value peers read to test that (its address is in our control block; kept alive).
    _probe: Box<u64>,
    /// CPU to bind the communication thread to at its first collective (see [`bind_cpu`]).
    bind: Option<usize>,
    /// Cross-memory-attach all-reduces entered, and chunks used by them (global numbering).
    cma_collectives: u64,
    cma_chunks: u64,
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
        let entry_sleep_after = match env_usize("DDP_SHM_ENTRY_SLEEP_US")? {
            Some(us) => Duration::from_micros(us as u64),
            None => ENTRY_SLEEP_AFTER,
        };
        let pid = std::process::id();
        let probe = Box::new(PROBE_MAGIC);
        let seg = if size == 1 {
            None
        } else {
            Some(Self::attach(
                store, rank, size, deadline, timeout, pid, &probe,
            )?)
        };
        let cma = match &seg {
            Some(seg) => Self::probe_cma(seg, rank, size, pid, deadline)?,
            None => false,
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
            entry_sleep_after,
            entry_pending: Cell::new(false),
            entry_wait_ns: Cell::new(0),
            cma,
            _probe: probe,
            bind: if size > 1 {
                bind_cpu(rank, size)?
            } else {
                None
            },
            cma_collectives: 0,
            cma_chunks: 0,
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
        probe: &u64,
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
        seg.counter(rank, segment::C_PROBE_ADDR)
            .store(probe as *const u64 as u64, Ordering::Relaxed);
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

    /// Every rank reads every peer's probe value with `process_vm_readv` and publishes whether
    /// all worked (`DDP_SHM_CMA=0` publishes "no"); the result is the same on every rank: true
    /// only if all of them succeeded. (Containers often forbid these calls.)
    fn probe_cma(
        seg: &Segment,
        rank: usize,
        size: usize,
        pid: u32,
        deadline: Instant,
    ) -> Result<bool> {
        let disabled = std::env::var("DDP_SHM_CMA").is_ok_and(|v| v.trim() == "0");
        let ok = !disabled
            && (0..size).filter(|&j| j != rank).all(|j| {
                let mut got = 0u64;
                let addr = seg
                    .counter(j, segment::C_PROBE_ADDR)
                    .load(Ordering::Relaxed) as usize;
                let peer_pid = seg.pid(j).load(Ordering::Relaxed);
                cma_copy(peer_pid, addr, (&mut got as *mut u64).cast(), 8, false).is_ok()
                    && got == PROBE_MAGIC
            });
        seg.counter(rank, segment::C_CMA)
            .store(if ok { 1 } else { 2 }, Ordering::Release);
        let mut all = true;
        for j in (0..size).filter(|&j| j != rank) {
            loop {
                match seg.counter(j, segment::C_CMA).load(Ordering::Acquire) {
                    0 if Instant::now() < deadline => std::thread::sleep(Duration::from_micros(50)),
                    0 => {
                        return Err(Error::Timeout {
                            what: format!("rank {j} to finish joining the shared-memory segment (pid {pid} waited)"),
                            timeout: Duration::ZERO,
                        })
                    }
                    v => {
                        all &= v == 1;
                        break;
                    }
                }
            }
        }
        if !all || !ok {
            tracing::debug!(
                "cross-memory attach unavailable in this group: all-reduce uses the shared slots"
            );
        }
        Ok(ok && all)
    }

    /// Whether this group's ranks can copy from and to each other's memory directly.
    pub fn cross_memory_attach(&self) -> bool {
        self.cma
    }

    /// Enter a cross-memory-attach collective over `len` input bytes at `addr`, writing to
    /// `out` (equal to `addr` in place), in `chunks` chunks: publish the buffers, then return
    /// `(registration number, first global chunk)`.
    pub(crate) fn cma_begin(
        &mut self,
        addr: usize,
        len: usize,
        out: usize,
        chunks: u64,
    ) -> (u64, u64) {
        let seg = self.seg();
        seg.counter(self.rank, segment::C_BUF_ADDR)
            .store(addr as u64, Ordering::Relaxed);
        seg.counter(self.rank, segment::C_BUF_LEN)
            .store(len as u64, Ordering::Relaxed);
        seg.counter(self.rank, segment::C_OUT_ADDR)
            .store(out as u64, Ordering::Relaxed);
        self.cma_collectives += 1;
        let first = self.cma_chunks;
        self.cma_chunks += chunks;
        self.publish(Counter::Registered, self.cma_collectives);
        (self.cma_collectives, first)
    }

    /// `(input address, input length, output address)` of the buffers `peer` registered (valid
    /// once its `Registered` counter reached this collective, until every chunk of it is done).
    pub(crate) fn peer_buffer(&self, peer: usize) -> (usize, usize, usize) {
        let seg = self.seg();
        let word = |w| seg.counter(peer, w).load(Ordering::Relaxed) as usize;
        (
            word(segment::C_BUF_ADDR),
            word(segment::C_BUF_LEN),
            word(segment::C_OUT_ADDR),
        )
    }

    /// A mismatch error: `peer` registered a buffer of `theirs` bytes where this rank has `mine`.
    pub(crate) fn mismatch(&self, peer: usize, mine: usize, theirs: usize) -> Error {
        Error::Mismatch {
            seq: self.fp.seq,
            rank: self.rank,
            local: format!("{} [{mine} bytes]", self.fp),
            peer,
            remote: format!("a buffer of {theirs} bytes"),
        }
    }

    /// Claim the next unclaimed chunk below `end` (global numbering), if any.
    pub(crate) fn claim(&self, end: u64) -> Option<u64> {
        let claim = self.seg().global(segment::H_CLAIM);
        let mut c = claim.load(Ordering::Acquire);
        while c < end {
            match claim.compare_exchange_weak(c, c + 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return Some(c),
                Err(now) => c = now,
            }
        }
        None
    }

    /// A claimed chunk is written everywhere: count it and ring every peer.
    pub(crate) fn finish_chunk(&self) {
        let seg = self.seg();
        seg.global(segment::H_DONE).fetch_add(1, Ordering::AcqRel);
        for p in (0..self.size).filter(|&p| p != self.rank) {
            Self::ring_bell(seg, p);
        }
    }

    /// Wait until every chunk below `end` is done (by whichever rank claimed it).
    pub(crate) fn wait_done(&self, end: u64) -> Result<()> {
        let seg = self.seg();
        let others = || {
            (0..self.size)
                .filter(|&p| p != self.rank)
                .collect::<Vec<_>>()
        };
        let mut st = Idle::default();
        loop {
            let seen = seg.bell(self.rank).load(Ordering::SeqCst);
            if seg.global(segment::H_DONE).load(Ordering::Acquire) >= end {
                return Ok(());
            }
            self.idle(&mut st, seen, &others, false)?;
        }
    }

    /// Copy `len` bytes between `local` and `remote` in `peer`'s memory (`write`: to the peer).
    pub(crate) fn cma_transfer(
        &self,
        peer: usize,
        remote: usize,
        local: *mut u8,
        len: usize,
        write: bool,
    ) -> Result<()> {
        let pid = self.seg().pid(peer).load(Ordering::Relaxed);
        cma_copy(pid, remote, local, len, write).map_err(|e| {
            // A rank that saw the first failure aborts the group and exits: report that root
            // cause rather than its exit.
            let seg = self.seg();
            let a = seg.abort_word().load(Ordering::Acquire);
            if a != 0 && a as usize - 1 != self.rank {
                let who = a as usize - 1;
                self.fail(who, format!("aborted the group: {}", seg.reason(who)))
            } else if e.raw_os_error() == Some(libc::ESRCH) {
                self.fail(
                    peer,
                    format!("died (pid {pid}): its process exited or was killed"),
                )
            } else {
                self.fail(
                    peer,
                    format!("cross-memory copy of {len} bytes failed: {e}"),
                )
            }
        })
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
                return Fingerprint::from_codes(
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
                local: self.fp.describe(&self.fp, None),
                peer,
                remote: theirs.describe(&self.fp, None),
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
        if st.since.is_none() {
            // A peer last seen on this CPU cannot run while we spin here: yield from the start.
            let cpu = self.note_cpu();
            st.colocated = waiting()
                .iter()
                .any(|&p| seg.cpu(p).load(Ordering::Relaxed) == cpu);
        }
        let since = *st.since.get_or_insert(now);
        let waited = now.duration_since(since);
        let spin = if entry && self.entry_wait_ns.get() > self.entry_sleep_after.as_nanos() as u64 {
            Duration::ZERO
        } else {
            self.spin
        };
        if waited < spin {
            if st.colocated || waited >= self.pure_spin {
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

    /// Publish (and return) the CPU this thread runs on.
    fn note_cpu(&self) -> u32 {
        // SAFETY: no arguments; returns -1 on failure.
        let cpu = unsafe { libc::sched_getcpu() } as u32;
        self.seg().cpu(self.rank).store(cpu, Ordering::Relaxed);
        cpu
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

    // ----- fast path (used by `algorithms::shm_direct`) ------------------------------------

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
        self.note_cpu();
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
        let entry = matches!(which, Counter::In | Counter::Registered) && self.entry_pending.get();
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
        if let Some(cpu) = self.bind.take() {
            bind_current_thread(cpu);
        }
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
                header: encode_header(MSG_MAGIC, 0, &self.fp, s.data.len() as u64),
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
                    let fail = match decode_header(MSG_MAGIC, &h).map(|h| (h.fp, h.len)) {
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
                                local: self.fp.describe(&self.fp, Some(r.buf.len() as u64)),
                                peer: r.from,
                                remote: remote.describe(&self.fp, Some(len)),
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
            reduce: Some(crate::ReduceOp::Max),
            count,
            root: Fingerprint::NO_ROOT,
        }
    }

    #[test]
    fn headers_round_trip() {
        let f = fp(7, 1 << 40);
        let h = decode_header(MSG_MAGIC, &encode_header(MSG_MAGIC, 0, &f, 12345)).unwrap();
        assert_eq!(h.fp, Some(f));
        assert_eq!(h.len, 12345);
        let mut bad = encode_header(MSG_MAGIC, 0, &f, 1);
        bad[0] ^= 1;
        assert!(decode_header(MSG_MAGIC, &bad).is_none());
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
    fn host_layout_numbers_hosts_by_lowest_rank_and_names_a_remote_rank() {
        let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
        let ids = ["a/boot", "b/boot", "a/boot", "c/boot", "b/boot"];
        let out: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..5)
                .map(|r| {
                    let st = store(&server);
                    s.spawn(move || {
                        host_layout(&*st, r, 5, ids[r], Duration::from_secs(10)).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for l in &out {
            assert_eq!(l, &out[0]);
            assert_eq!(l.host_of, [0, 1, 0, 2, 1]);
            assert_eq!((l.hosts(), l.ranks_on(1)), (3, vec![1, 4]));
            let v = l.mismatch.as_deref().expect("mismatch detected");
            assert!(v.contains("rank 1") && v.contains("b/boot"), "{v}");
        }
        let one = host_layout(&*store(&server), 0, 1, "x", Duration::from_secs(1)).unwrap();
        assert_eq!((one.host_of, one.mismatch), (vec![0], None));
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
