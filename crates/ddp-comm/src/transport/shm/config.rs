//! Tuning of the shared-memory transport: spin and sleep constants (with the measurements that
//! chose them), the segment geometry and its env overrides (read by rank 0, so every rank
//! agrees), and the placement of a rank's communication thread on a CPU.

use super::segment::Geometry;
use crate::{Error, Result};
use std::time::Duration;

/// Largest piece copied into or out of a ring before publishing it, so that the peer starts
/// copying while the rest is still being written.
pub const PIECE: usize = 64 * 1024;
/// Default spin before sleeping in `futex_wait`: busy for [`PURE_SPIN`], then yielding the CPU
/// between checks (when cores are oversubscribed the peer may be waiting for this one). A
/// sleeping vCPU is slow to wake (`docs/benchmarks.md`, "Shared-memory tuning"), so shorter
/// spins lose latency.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(200);
/// Initial busy spin without yielding (a shorter one raised small-message latency on loaded
/// vCPUs: the first `sched_yield` gives the core away).
pub const PURE_SPIN: Duration = Duration::from_micros(50);
/// A collective's first wait skips spinning when such waits averaged more than this lately
/// (peers still computing). Lower thresholds let the wake-up latency of a sleeping vCPU keep
/// the average up and trap small all-reduces in the slow path.
pub const ENTRY_SLEEP_AFTER: Duration = Duration::from_millis(1);
/// Longest single `futex_wait`; the group's health is checked between slices.
pub const SLEEP_SLICE: Duration = Duration::from_millis(5);
/// All-reduces from this size use cross-memory attach (when every rank can use it).
pub const DEFAULT_CMA_MIN: usize = 1 << 20;
/// Chunk of work claimed at a time in the cross-memory-attach all-reduce.
pub const DEFAULT_CMA_CHUNK: usize = 256 << 10;
/// How often a waiting rank checks that the processes it waits for are alive.
pub(super) const LIVENESS_EVERY: Duration = Duration::from_millis(20);

pub(super) fn env_usize(name: &str) -> Result<Option<usize>> {
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

/// The CPU a rank's communication thread binds to: with at most one local rank per CPU this
/// process may use, local rank `l` (env `LOCAL_RANK`, else the group rank) takes the `l`-th
/// allowed CPU; `None` when ranks outnumber CPUs or env `DDP_SHM_BIND=0`.
///
/// Unbound, a rank's caller and communication threads often end up on different CPUs, and
/// every hand-over then wakes a halted vCPU (what that cost: `docs/benchmarks.md`,
/// "Shared-memory tuning").
pub fn bind_cpu(rank: usize, size: usize) -> Result<Option<usize>> {
    if std::env::var("DDP_SHM_BIND").is_ok_and(|v| v.trim() == "0") {
        return Ok(None);
    }
    let local_rank = env_usize("LOCAL_RANK")?.unwrap_or(rank);
    let local_world = env_usize("LOCAL_WORLD_SIZE")?.unwrap_or(size);
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills it for this thread.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the calling thread.
    let ok =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }
            == 0;
    if !ok {
        return Ok(None);
    }
    let allowed: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c < CPU_SETSIZE`, within the set.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    if allowed.is_empty() || local_world > allowed.len() {
        return Ok(None);
    }
    Ok(Some(allowed[local_rank % allowed.len()]))
}

/// Bind the calling thread to `cpu` (best effort).
pub(super) fn bind_current_thread(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t with one CPU set; affects only the calling thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            tracing::debug!("cannot bind the communication thread to CPU {cpu}");
        }
    }
}
