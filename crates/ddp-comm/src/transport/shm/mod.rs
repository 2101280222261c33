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
//! instead of spinning (spinning would keep that peer off the CPU for a whole hand-over). With no more local ranks than CPUs, each rank's communication thread binds to
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
//! [`super::hierarchical`] ([`crate::backend::select`] decides).

mod cma;
mod config;
mod fast;
mod rings;
mod segment;
mod wait;

pub use config::{
    bind_cpu, default_geometry, DEFAULT_CMA_CHUNK, DEFAULT_CMA_MIN, DEFAULT_SPIN,
    ENTRY_SLEEP_AFTER, PIECE, PURE_SPIN, SLEEP_SLICE,
};
pub(crate) use fast::Counter;
pub use segment::{sweep_stale_segments, Geometry, NAME_PREFIX};

use super::stall::StallWarning;
use super::{Fingerprint, OpKind, RecvFrom, SendTo, Transport};
use crate::dtype::DType;
use crate::store::Store;
use crate::{Error, Result};
use cma::PROBE_MAGIC;
use config::{bind_current_thread, env_usize};
use segment::{Segment, STATE_ABORTED, STATE_ATTACHED, STATE_EMPTY, STATE_LEFT};
use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use wait::{futex_wake, Idle};

/// Why connecting failed. `NoSegment`: rank 0 could not create the segment (e.g. /dev/shm is
/// full or missing); every rank learns it through the store, so `auto` falls back to TCP on all.
pub(crate) enum ConnectError {
    NoSegment(Error),
    Other(Error),
}

impl From<Error> for ConnectError {
    fn from(e: Error) -> Self {
        ConnectError::Other(e)
    }
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
    /// The warning of a collective that waits long (see [`crate::transport::stall`]).
    stall: StallWarning,
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

    pub(crate) fn connect_inner(
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
            stall: StallWarning::default(),
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
            let name = store.get_timeout("shm/name", remaining()).map_err(|e| {
                e.waiting_for(|| {
                    format!(
                        "rank 0 to create the group's shared-memory segment (world size {size})"
                    )
                })
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

    /// Log a warning when a collective waits `every` for its peers, and again every `every`
    /// (`None`: never); `group_ranks[l]` names local rank `l` in it (hierarchical groups).
    pub fn set_warn_after(&mut self, every: Option<Duration>, group_ranks: Option<Vec<usize>>) {
        self.stall = StallWarning::new(every, group_ranks);
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

    pub(super) fn fail(&self, peer: usize, reason: impl Into<String>) -> Error {
        Error::PeerFailed {
            peer,
            fingerprint: self.fp,
            reason: reason.into(),
        }
    }
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
        self.stall.start();
        self.publish_fp();
    }

    fn exchange(&mut self, sends: &mut [SendTo<'_>], recvs: &mut [RecvFrom<'_>]) -> Result<()> {
        self.exchange_rings(sends, recvs)
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
    use super::rings::MSG_MAGIC;
    use super::*;
    use crate::testing::run_with_store;
    use crate::transport::{decode_header, encode_header};

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

    #[test]
    fn published_fingerprints_are_read_back_and_compared() {
        let t = Duration::from_secs(10);
        let mut ts = run_with_store(2, t, |r, st| ShmTransport::connect(&*st, r, 2, t).unwrap());
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
