//! Cross-memory attach (`process_vm_readv`/`process_vm_writev`): the probe at setup that tells
//! whether every rank of the group may copy from and to every other's memory, and the
//! primitives of the large all-reduce and reduce-scatter of [`crate::algorithms::shm_direct`]
//! (publishing a buffer, claiming chunks, copying, waiting for every chunk).

use super::fast::Counter;
use super::segment::{self, Segment};
use super::{Idle, ShmTransport};
use crate::{Error, Result};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Value every rank exposes for its peers' cross-memory-attach probe.
pub(super) const PROBE_MAGIC: u64 = 0xDD9C_C3A0_5EED_0001;

/// `process_vm_readv` (or `writev` with `write`) of `len` bytes between `local` in this process
/// and `remote` in process `pid`, looping over partial transfers.
pub(super) fn cma_copy(
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

impl ShmTransport {
    /// Every rank reads every peer's probe value with `process_vm_readv` and publishes whether
    /// all worked (`DDP_SHM_CMA=0` publishes "no"); the result is the same on every rank: true
    /// only if all of them succeeded. (Containers often forbid these calls.)
    pub(super) fn probe_cma(
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
            rank: self.rank,
            local: self.fp,
            local_bytes: Some(mine as u64),
            peer,
            remote: None,
            remote_bytes: Some(theirs as u64),
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
}
