//! Waiting: the bell (a futex word per rank), spinning then sleeping, and the health checks a
//! long wait makes (abort word, peers' state and pids, their published fingerprints, the
//! deadline). See the parent module's "Waiting" section for the design and its measurements.

use super::config::{LIVENESS_EVERY, SLEEP_SLICE};
use super::segment::{self, Segment, STATE_ABORTED, STATE_LEFT};
use super::ShmTransport;
use crate::transport::{Fingerprint, OpKind, NO_REDUCE};
use crate::{Error, Result};
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub(super) fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
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

pub(super) fn futex_wake(word: &AtomicU32) {
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

/// State of one wait: spin budget, liveness schedule, and a peer found gone (reported only if
/// a re-poll after noticing it still makes no progress, so its last data is never lost).
#[derive(Default)]
pub(super) struct Idle {
    pub(super) since: Option<Instant>,
    /// A peer waited for was last seen on this rank's CPU.
    pub(super) colocated: bool,
    pub(super) next_liveness: Option<Instant>,
    pub(super) gone: Option<Error>,
}

impl ShmTransport {
    pub(super) fn ring_bell(seg: &Segment, peer: usize) {
        seg.bell(peer).fetch_add(1, Ordering::SeqCst);
        if seg.sleeping(peer).load(Ordering::SeqCst) != 0 {
            futex_wake(seg.bell(peer));
        }
    }

    pub(super) fn publish_fp(&self) {
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
    pub(super) fn peer_fp(&self, peer: usize) -> Option<Fingerprint> {
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
    pub(super) fn check_peer_fp(&self, peer: usize, strict: bool) -> Result<()> {
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
                rank: self.rank,
                local: self.fp,
                local_bytes: None,
                peer,
                remote: Some(theirs),
                remote_bytes: None,
            });
        }
        Ok(())
    }

    pub(super) fn timeout_error(&self, waiting: &[usize]) -> Error {
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
    pub(super) fn check_health(
        &self,
        st: &mut Idle,
        waiting: &[usize],
        now: Instant,
    ) -> Result<()> {
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
    pub(super) fn idle(
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
        self.stall
            .check(&self.fp, self.rank, self.op_timeout, || waiting.clone());
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
    pub(super) fn note_cpu(&self) -> u32 {
        // SAFETY: no arguments; returns -1 on failure.
        let cpu = unsafe { libc::sched_getcpu() } as u32;
        self.seg().cpu(self.rank).store(cpu, Ordering::Relaxed);
        cpu
    }

    /// The collective's first wait is over: fold its length into the moving average.
    pub(super) fn record_entry_wait(&self, st: &Idle) {
        if self.entry_pending.replace(false) {
            let waited = st.since.map_or(0, |t| t.elapsed().as_nanos() as u64);
            self.entry_wait_ns
                .set((self.entry_wait_ns.get() * 7 + waited) / 8);
        }
    }
}
