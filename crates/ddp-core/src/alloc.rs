//! Host memory between training steps.
//!
//! glibc's `malloc` gives large freed blocks back to the kernel: blocks above
//! `M_MMAP_THRESHOLD` are `munmap`ped when freed, and the top of a heap is trimmed once more
//! than `M_TRIM_THRESHOLD` is free. A training loop frees and re-allocates its gradients and
//! activations every step (candle, for one, builds every gradient in a fresh zeroed tensor), so
//! each step pays page faults and page clearing for the same megabytes again.
//! [`retain_freed_memory`] raises both thresholds so that freed blocks stay with the
//! process and are reused, as PyTorch's caching CPU allocator keeps its blocks; the cost is
//! that the process keeps its peak heap size. [`release_freed_memory`] gives what is free back
//! once, after a one-time peak. The figures are in the book's benchmarks chapter
//! (`docs/benchmarks.md`, "Host memory between steps").
//!
//! Every reducer calls [`retain_freed_memory`] when it is built (so every framework adapter
//! does); a program can call it earlier, before it allocates its model.
//! `DDP_RETAIN_FREED_MEMORY=0` turns it off, and so does a user's own `GLIBC_TUNABLES`,
//! `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_`. Other C libraries and allocators are
//! left alone.

use std::sync::Once;

/// Blocks up to this size are served from the heap, not by `mmap` (glibc's dynamic maximum).
pub const MMAP_THRESHOLD: usize = 32 << 20;
/// Free memory at the top of a heap kept before trimming.
pub const TRIM_THRESHOLD: usize = 256 << 20;

/// Whether the thresholds were raised in this process (after [`retain_freed_memory`]).
pub fn retained() -> bool {
    RETAINED.load(std::sync::atomic::Ordering::Relaxed)
}

static RETAINED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Raises glibc's mmap and trim thresholds once per process (see the module docs); a no-op
/// when turned off, when the user tuned malloc through the environment, or off glibc.
/// Returns whether the thresholds are raised in this process ([`retained`]).
pub fn retain_freed_memory() -> bool {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let off = std::env::var("DDP_RETAIN_FREED_MEMORY").is_ok_and(|v| v.trim() == "0");
        let user_tuned = [
            "GLIBC_TUNABLES",
            "MALLOC_MMAP_THRESHOLD_",
            "MALLOC_TRIM_THRESHOLD_",
        ]
        .iter()
        .any(|v| std::env::var_os(v).is_some());
        if !off && !user_tuned && set_thresholds() {
            RETAINED.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
    retained()
}

/// Gives the heap memory freed so far back to the kernel (glibc's `malloc_trim(0)`), e.g. once
/// after a one-time peak such as building the full model before sharding it, which
/// [`retain_freed_memory`] would otherwise keep mapped for good. Returns whether memory was
/// released (`false` off glibc, where it does nothing).
pub fn release_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only returns free heap pages to the kernel; no pointer is touched.
        unsafe { libc::malloc_trim(0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> bool {
    // SAFETY: `mallopt` only adjusts malloc's parameters (under its own lock); both values are
    // within glibc's accepted ranges.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int) == 1
            && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD as libc::c_int) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> bool {
    false
}
