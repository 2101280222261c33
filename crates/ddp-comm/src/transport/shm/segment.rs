//! The shared-memory segment of one group: its layout, creation (rank 0), attaching (every other
//! rank), unlinking, and the sweep of segments left behind by creators that died.
//!
//! Everything in the segment is either an atomic word written by exactly one rank (its control
//! block, the producer index of a ring, the consumer index of a ring), or bytes whose ownership
//! is handed over through those words with release/acquire ordering.

use crate::host::SHM_DIR;
use crate::{Error, Result};
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// File-name prefix of every segment: `ddp-rs-{creator pid}-{random nonce}`.
pub const NAME_PREFIX: &str = "ddp-rs-";

const MAGIC: u64 = u64::from_le_bytes(*b"ddp-rsm1");
const VERSION: u32 = 2;
/// Spacing of independently written words (two cache lines: the adjacent-line prefetcher pulls
/// pairs of lines, so 64 bytes apart would still share).
pub(crate) const LINE: usize = 128;
const PAGE: usize = 4096;

// Header (page 0).
const H_MAGIC: usize = 0;
const H_VERSION: usize = 8;
const H_WORLD: usize = 12;
const H_RING_CAP: usize = 16;
const H_SUB: usize = 24;
const H_WINDOW: usize = 32;
const H_ONE_SHOT: usize = 40;
const H_TOTAL: usize = 48;
const H_CMA_MIN: usize = 56;
const H_CMA_CHUNK: usize = 64;
/// 0, or 1 + the rank that aborted the group first.
const H_ABORT: usize = LINE;
/// Cross-memory-attach all-reduce: chunks claimed so far, and chunks finished (both global).
pub(crate) const H_CLAIM: usize = 2 * LINE;
pub(crate) const H_DONE: usize = 3 * LINE;

// Control block of each rank (written by that rank only, except the bell).
const CTRL_BYTES: usize = 16 * LINE;
/// Rung (incremented) by any rank that changed something this rank may be waiting for.
const C_BELL: usize = 0;
/// 1 while the owner sleeps in `futex_wait` on its bell (so ringers know to wake it).
const C_SLEEPING: usize = 4;
const C_STATE: usize = LINE;
const C_PID: usize = LINE + 4;
/// The CPU the owner last ran on (refreshed when it waits or publishes progress).
const C_CPU: usize = LINE + 8;
/// Seqlock-published fingerprint of the owner's current collective.
pub(crate) const C_FP: usize = 2 * LINE;
/// Fast-path progress counters (blocks whose input is copied in / reduced / copied out).
pub(crate) const C_IN: usize = 3 * LINE;
pub(crate) const C_RED: usize = 4 * LINE;
pub(crate) const C_OUT: usize = 5 * LINE;
/// Cross-memory-attach collectives: collectives entered (a counter), then the address and the
/// length in bytes of this rank's input buffer in the current one, and the address of its
/// output (the input itself for an in-place all-reduce).
pub(crate) const C_REG: usize = 6 * LINE;
pub(crate) const C_BUF_ADDR: usize = 6 * LINE + 8;
pub(crate) const C_BUF_LEN: usize = 6 * LINE + 16;
pub(crate) const C_OUT_ADDR: usize = 6 * LINE + 24;
/// Address of an 8-byte probe value peers read at setup to test cross-memory attach, and the
/// outcome of this rank's probes (0 pending, 1 every peer readable, 2 not usable).
pub(crate) const C_PROBE_ADDR: usize = 7 * LINE;
pub(crate) const C_CMA: usize = 7 * LINE + 8;
/// Abort reason: u32 length, then the UTF-8 text.
const C_REASON: usize = 8 * LINE;
pub(crate) const REASON_MAX: usize = CTRL_BYTES - C_REASON - 8;

/// Control-block states.
pub(crate) const STATE_EMPTY: u32 = 0;
pub(crate) const STATE_ATTACHED: u32 = 1;
pub(crate) const STATE_LEFT: u32 = 2;
pub(crate) const STATE_ABORTED: u32 = 3;

/// Sizes of the parts of a segment, fixed by rank 0 and stored in the header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Bytes of each pairwise message ring (power of two).
    pub ring_cap: usize,
    /// Bytes of one fast-path sub-chunk (a block is `world` sub-chunks).
    pub sub_bytes: usize,
    /// Blocks in flight per rank in the fast path (slots of its fast area).
    pub window: usize,
    /// All-reduces up to this many bytes use the one-shot variant.
    pub one_shot_max: usize,
    /// All-reduces of at least this many bytes use cross-memory attach when it is available.
    pub cma_min: usize,
    /// Bytes of one chunk of the cross-memory-attach all-reduce.
    pub cma_chunk: usize,
}

#[derive(Debug, Clone, Copy)]
struct Layout {
    world: usize,
    geo: Geometry,
    ctrl: usize,
    rings: usize,
    ring_stride: usize,
    fast: usize,
    fast_stride: usize,
    total: usize,
}

fn align(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

impl Layout {
    fn new(world: usize, geo: Geometry) -> Layout {
        let ctrl = PAGE;
        let rings = align(ctrl + world * CTRL_BYTES, PAGE);
        let ring_stride = PAGE + geo.ring_cap;
        let fast = rings + world * world.saturating_sub(1) * ring_stride;
        let fast_stride = align(geo.window * world * geo.sub_bytes, PAGE);
        let total = fast + world * fast_stride;
        Layout {
            world,
            geo,
            ctrl,
            rings,
            ring_stride,
            fast,
            fast_stride,
            total,
        }
    }
}

/// One mapping of a group's segment.
pub(crate) struct Segment {
    base: *mut u8,
    layout: Layout,
    name: String,
}

// SAFETY: the mapping is shared memory accessed only through atomics and protocol-owned byte
// ranges; the pointer may move between threads with the transport that owns it.
unsafe impl Send for Segment {}

fn path_of(name: &str) -> String {
    format!("{SHM_DIR}/{name}")
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: writes at most 8 bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, 0) };
    if n == 8 {
        u64::from_ne_bytes(b)
    } else {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ (std::process::id() as u64).rotate_left(32)
    }
}

/// Whether process `pid` is gone (no such process, or a zombie waiting to be reaped).
pub(crate) fn pid_is_dead(pid: u32) -> bool {
    if pid == 0 {
        return false;
    }
    // SAFETY: signal 0 only checks for existence and permission.
    if unsafe { libc::kill(pid as libc::pid_t, 0) } != 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    // `/proc/PID/stat`: "pid (comm) S ..."; the state follows the last ')'.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.trim_start().chars().next())
            .is_some_and(|c| c == 'Z' || c == 'X'),
        Err(_) => false,
    }
}

/// Remove our segments (`/dev/shm/ddp-rs-{pid}-*`) whose creator process no longer exists
/// (left behind when a creator was killed between creating its segment and every rank
/// attaching). Returns how many. A launcher may call it when its workers exit.
pub fn sweep_stale_segments() -> usize {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return 0;
    };
    let mut removed = 0;
    for entry in dir.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(rest) = name.strip_prefix(NAME_PREFIX) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid_is_dead(pid) && std::fs::remove_file(entry.path()).is_ok() {
            tracing::info!(
                "removed stale shared-memory segment {SHM_DIR}/{name} (creator pid {pid} is gone)"
            );
            removed += 1;
        }
    }
    removed
}

/// Remove the segment's name (attached mappings stay valid). Missing names are fine.
pub(crate) fn unlink(name: &str) {
    let _ = std::fs::remove_file(path_of(name));
}

fn map(fd: i32, len: usize) -> std::io::Result<*mut u8> {
    // SAFETY: a fresh shared mapping of `len` bytes of an open file; checked for MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(p.cast())
    }
}

impl Segment {
    /// Create a fresh segment for `world` ranks (called by rank 0), named with this process's
    /// pid and a random nonce. Stale segments of dead creators are swept first.
    pub(crate) fn create(world: usize, geo: Geometry) -> Result<Segment> {
        sweep_stale_segments();
        let layout = Layout::new(world, geo);
        // SAFETY: an all-zero statvfs is a valid value of this plain C struct.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: statvfs fills `st` for a NUL-terminated path.
        if unsafe { libc::statvfs(c"/dev/shm".as_ptr(), &mut st) } == 0 {
            let free = st.f_bavail as u128 * st.f_frsize as u128;
            if layout.total as u128 > free {
                return Err(Error::Config(format!(
                    "not enough space in {SHM_DIR} for the shared-memory segment: {} bytes needed, {free} free (enlarge it, e.g. docker --shm-size, or use backend tcp)",
                    layout.total
                )));
            }
        }
        let name = format!("{NAME_PREFIX}{}-{:016x}", std::process::id(), random_u64());
        let path = path_of(&name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| Error::io(format!("cannot create the shared-memory segment {path}"), e))?;
        let fail = |what: &str, e: std::io::Error| {
            unlink(&name);
            Error::io(
                format!(
                    "{what} the shared-memory segment {path} ({} bytes)",
                    layout.total
                ),
                e,
            )
        };
        // Reserve every page now: a too small /dev/shm (containers default to 64 MiB) then fails
        // here with a clear error instead of SIGBUS on first touch.
        // SAFETY: plain syscall on an open file descriptor.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, layout.total as libc::off_t) };
        if rc != 0 {
            let e = std::io::Error::from_raw_os_error(rc);
            return Err(fail(
                if rc == libc::ENOSPC {
                    "not enough space in /dev/shm (enlarge it, e.g. docker --shm-size, or use backend tcp) for"
                } else {
                    "cannot allocate"
                },
                e,
            ));
        }
        let base = map(file.as_raw_fd(), layout.total).map_err(|e| fail("cannot map", e))?;
        let seg = Segment { base, layout, name };
        // A fresh file is zero-filled: every counter, state and ring index starts at 0.
        seg.u32(H_VERSION).store(VERSION, Ordering::Relaxed);
        seg.u32(H_WORLD).store(world as u32, Ordering::Relaxed);
        seg.u64(H_RING_CAP)
            .store(geo.ring_cap as u64, Ordering::Relaxed);
        seg.u64(H_SUB)
            .store(geo.sub_bytes as u64, Ordering::Relaxed);
        seg.u64(H_WINDOW)
            .store(geo.window as u64, Ordering::Relaxed);
        seg.u64(H_ONE_SHOT)
            .store(geo.one_shot_max as u64, Ordering::Relaxed);
        seg.u64(H_TOTAL)
            .store(layout.total as u64, Ordering::Relaxed);
        seg.u64(H_CMA_MIN)
            .store(geo.cma_min as u64, Ordering::Relaxed);
        seg.u64(H_CMA_CHUNK)
            .store(geo.cma_chunk as u64, Ordering::Relaxed);
        seg.u64(H_MAGIC).store(MAGIC, Ordering::Release);
        Ok(seg)
    }

    /// Map the segment `name` created by rank 0, checking it is one of ours for `world` ranks.
    pub(crate) fn open(name: &str, world: usize) -> Result<Segment> {
        let path = path_of(name);
        if !name.starts_with(NAME_PREFIX) || name.contains('/') {
            return Err(Error::Config(format!(
                "{path:?} is not a ddp-rs shared-memory segment"
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| {
                Error::io(
                    format!("cannot open the shared-memory segment {path} created by rank 0"),
                    e,
                )
            })?;
        let len = file
            .metadata()
            .map_err(|e| Error::io(format!("shared-memory segment {path}"), e))?
            .len() as usize;
        if len < PAGE {
            return Err(Error::Config(format!(
                "shared-memory segment {path} is truncated ({len} bytes)"
            )));
        }
        let base = map(file.as_raw_fd(), len)
            .map_err(|e| Error::io(format!("cannot map the shared-memory segment {path}"), e))?;
        // Map first, then validate the header (an invalid one is unmapped by Drop).
        let mut seg = Segment {
            base,
            layout: Layout::new(
                0,
                Geometry {
                    ring_cap: 0,
                    sub_bytes: 0,
                    window: 0,
                    one_shot_max: 0,
                    cma_min: 0,
                    cma_chunk: 0,
                },
            ),
            name: name.to_string(),
        };
        seg.layout.total = len;
        let bad = |what: String| Error::Config(format!("shared-memory segment {path}: {what}"));
        if seg.u64(H_MAGIC).load(Ordering::Acquire) != MAGIC {
            return Err(bad("bad magic (not created by ddp-rs)".into()));
        }
        let version = seg.u32(H_VERSION).load(Ordering::Relaxed);
        if version != VERSION {
            return Err(bad(format!(
                "layout version {version}, this build uses {VERSION} (mixed ddp-rs versions?)"
            )));
        }
        let seg_world = seg.u32(H_WORLD).load(Ordering::Relaxed) as usize;
        if seg_world != world {
            return Err(Error::Config(format!(
                "world size mismatch: rank 0 created the shared-memory segment for {seg_world} ranks, this rank was started with world size {world}"
            )));
        }
        let geo = Geometry {
            ring_cap: seg.u64(H_RING_CAP).load(Ordering::Relaxed) as usize,
            sub_bytes: seg.u64(H_SUB).load(Ordering::Relaxed) as usize,
            window: seg.u64(H_WINDOW).load(Ordering::Relaxed) as usize,
            one_shot_max: seg.u64(H_ONE_SHOT).load(Ordering::Relaxed) as usize,
            cma_min: seg.u64(H_CMA_MIN).load(Ordering::Relaxed) as usize,
            cma_chunk: seg.u64(H_CMA_CHUNK).load(Ordering::Relaxed) as usize,
        };
        let layout = Layout::new(world, geo);
        let total = seg.u64(H_TOTAL).load(Ordering::Relaxed) as usize;
        if layout.total != total || total > len || !geo.ring_cap.is_power_of_two() {
            return Err(bad(format!(
                "inconsistent header (size {total}, file {len} bytes)"
            )));
        }
        seg.layout = layout;
        seg.layout.total = len;
        Ok(seg)
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn geometry(&self) -> Geometry {
        self.layout.geo
    }

    fn u32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= self.layout.total);
        // SAFETY: in bounds, aligned (the mapping is page aligned), and only accessed atomically.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    fn u64(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.layout.total);
        // SAFETY: as for `u32`.
        unsafe { &*(self.base.add(off) as *const AtomicU64) }
    }

    fn ctrl(&self, rank: usize) -> usize {
        debug_assert!(rank < self.layout.world);
        self.layout.ctrl + rank * CTRL_BYTES
    }

    pub(crate) fn abort_word(&self) -> &AtomicU32 {
        self.u32(H_ABORT)
    }

    pub(crate) fn bell(&self, rank: usize) -> &AtomicU32 {
        self.u32(self.ctrl(rank) + C_BELL)
    }

    pub(crate) fn sleeping(&self, rank: usize) -> &AtomicU32 {
        self.u32(self.ctrl(rank) + C_SLEEPING)
    }

    pub(crate) fn state(&self, rank: usize) -> &AtomicU32 {
        self.u32(self.ctrl(rank) + C_STATE)
    }

    pub(crate) fn pid(&self, rank: usize) -> &AtomicU32 {
        self.u32(self.ctrl(rank) + C_PID)
    }

    pub(crate) fn cpu(&self, rank: usize) -> &AtomicU32 {
        self.u32(self.ctrl(rank) + C_CPU)
    }

    /// Word `i` (0 = seqlock version, 1..=3 = payload) of `rank`'s published fingerprint.
    pub(crate) fn fp_word(&self, rank: usize, i: usize) -> &AtomicU64 {
        self.u64(self.ctrl(rank) + C_FP + 8 * i)
    }

    /// A 64-bit word of `rank`'s control block (`which`: `C_IN`, `C_RED`, `C_OUT`, `C_REG`,
    /// `C_BUF_ADDR`, `C_BUF_LEN`, `C_OUT_ADDR`, `C_PROBE_ADDR`, `C_CMA`).
    pub(crate) fn counter(&self, rank: usize, which: usize) -> &AtomicU64 {
        self.u64(self.ctrl(rank) + which)
    }

    /// A 64-bit word of the header (`H_CLAIM`, `H_DONE`).
    pub(crate) fn global(&self, which: usize) -> &AtomicU64 {
        self.u64(which)
    }

    /// Store `rank`'s abort reason (truncated to [`REASON_MAX`] bytes).
    pub(crate) fn set_reason(&self, rank: usize, reason: &str) {
        let mut n = reason.len().min(REASON_MAX);
        while !reason.is_char_boundary(n) {
            n -= 1;
        }
        let off = self.ctrl(rank) + C_REASON;
        // SAFETY: the reason area of our own control block; peers read it only after observing
        // the abort word, which is stored (release) after this.
        unsafe { std::ptr::copy_nonoverlapping(reason.as_ptr(), self.base.add(off + 8), n) };
        self.u32(off).store(n as u32, Ordering::Release);
    }

    pub(crate) fn reason(&self, rank: usize) -> String {
        let off = self.ctrl(rank) + C_REASON;
        let n = (self.u32(off).load(Ordering::Acquire) as usize).min(REASON_MAX);
        let mut v = vec![0u8; n];
        // SAFETY: reads within the reason area of `rank`'s control block.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(off + 8), v.as_mut_ptr(), n) };
        String::from_utf8_lossy(&v).into_owned()
    }

    /// The ring carrying messages from `from` to `to`: (head, tail, data pointer, capacity).
    pub(crate) fn ring(&self, from: usize, to: usize) -> RingRef<'_> {
        debug_assert!(from != to);
        // Pairs (from, to != from) in order; no ring for a rank to itself.
        let idx = from * (self.layout.world - 1) + if to < from { to } else { to - 1 };
        let off = self.layout.rings + idx * self.layout.ring_stride;
        RingRef {
            head: self.u64(off),
            tail: self.u64(off + LINE),
            // SAFETY: the data area lies within the mapping (checked by the layout).
            data: unsafe { self.base.add(off + PAGE) },
            cap: self.layout.geo.ring_cap,
        }
    }

    /// Start of `rank`'s fast-area slot `pos` (of `window`); sub-chunk `j` is at `+ j * sub_bytes`.
    pub(crate) fn fast_slot(&self, rank: usize, pos: usize) -> *mut u8 {
        debug_assert!(pos < self.layout.geo.window);
        let off = self.layout.fast
            + rank * self.layout.fast_stride
            + pos * self.layout.world * self.layout.geo.sub_bytes;
        // SAFETY: within the mapping (see `Layout::new`).
        unsafe { self.base.add(off) }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `create`/`open`.
        unsafe { libc::munmap(self.base.cast(), self.layout.total) };
    }
}

/// A single-producer single-consumer byte ring inside the segment. `head` (bytes consumed) is
/// written only by the consumer, `tail` (bytes produced) only by the producer; both grow forever.
pub(crate) struct RingRef<'a> {
    pub head: &'a AtomicU64,
    pub tail: &'a AtomicU64,
    pub data: *mut u8,
    pub cap: usize,
}

impl RingRef<'_> {
    /// Copy `src` into the ring at absolute position `at` (the caller checked there is room).
    pub(crate) fn write_at(&self, at: u64, src: &[u8]) {
        let pos = (at as usize) & (self.cap - 1);
        let first = src.len().min(self.cap - pos);
        // SAFETY: both pieces lie within the data area; the range [at, at + len) is free (the
        // consumer's head is at least `at + len - cap`), so nobody else touches it.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data.add(pos), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data, src.len() - first);
        }
    }

    /// Copy bytes at absolute position `at` into `dst` (the caller checked they were published).
    pub(crate) fn read_at(&self, at: u64, dst: &mut [u8]) {
        let pos = (at as usize) & (self.cap - 1);
        let first = dst.len().min(self.cap - pos);
        // SAFETY: both pieces lie within the data area and were published by the producer
        // (acquire load of `tail`); the producer will not overwrite them before `head` moves.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.add(pos), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(
                self.data,
                dst.as_mut_ptr().add(first),
                dst.len() - first,
            );
        }
    }
}
