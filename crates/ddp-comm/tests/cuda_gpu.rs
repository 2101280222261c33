//! Device collectives on real GPUs (feature `nccl`). Each test looks for a GPU and the
//! libraries first and otherwise prints `SKIPPED test: reason` (a failure under
//! `DDP_TEST_REQUIRE_GPU=1`, which `scripts/gpu-check` sets); the two-GPU tests report
//! "needs 2 GPUs" on a one-GPU machine and never fail for it.
//!
//! - NCCL at world size 1 against the sequential reference: every op, every dtype, sizes 0, 1,
//!   odd and 64 MiB, blocking and async.
//! - Two ranks sharing the one GPU: `auto` relays through the host (NCCL would refuse them),
//!   every collective against the reference.
//! - A collective that cannot finish (its stream held by a host callback) fails within the
//!   timeout, naming the collective and its sequence number; the group stays failed.
//! - Two GPUs: NCCL between two ranks against the reference; a mismatch fails by name.
//!
//! Run on the GPU machine (the bundle runs the release-built binary):
//! `cuda_gpu --test-threads 1` with `LD_LIBRARY_PATH` holding libcuda.so.1 and a
//! `libnccl.so` link to `libnccl.so.2`, and `DDP_TEST_REQUIRE_GPU=1`.
#![cfg(feature = "nccl")]
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

mod common;

use common::{check_all, run_ranks, skip_gpu};
use cudarc::driver::CudaStream;
use ddp_comm::cuda::{device_count, nccl_available, CudaGroup, CudaOptions, DeviceBackend};
use ddp_comm::{Error, ProcessGroup, ReduceOp};
use half::{bf16, f16};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The number of GPUs, or `None` after printing why the test cannot run.
fn gpus(test: &str, need: usize) -> Option<usize> {
    let n = match device_count() {
        Ok(n) => n,
        Err(e) => {
            skip_gpu(test, &format!("no CUDA: {e}"), true);
            return None;
        }
    };
    if n == 0 {
        skip_gpu(test, "no CUDA device visible", true);
        return None;
    }
    if let Err(e) = nccl_available() {
        skip_gpu(test, &format!("no NCCL: {e}"), true);
        return None;
    }
    if n < need {
        skip_gpu(test, &format!("needs {need} GPUs, found {n}"), false);
        return None;
    }
    Some(n)
}

fn group(pg: &ProcessGroup, backend: DeviceBackend, device: usize, timeout: Duration) -> CudaGroup {
    let opts = CudaOptions {
        backend: Some(backend),
        device: Some(device),
        timeout: Some(timeout),
        ..Default::default()
    };
    CudaGroup::new(pg, opts).unwrap_or_else(|e| panic!("rank {}: CudaGroup::new: {e}", pg.rank()))
}

/// 0, 1, odd, and (f32 only) 64 MiB + 4 bytes.
fn gpu_sizes(large: bool) -> Vec<usize> {
    let mut s = vec![0, 1, 7, 1001, 65_537];
    if large {
        s.push((64 << 20) / 4 + 1);
    }
    s
}

fn check_every_dtype(g: &CudaGroup, seed: u64) {
    check_all::<f32>(g, seed, &gpu_sizes(true));
    check_all::<f64>(g, seed + 1, &gpu_sizes(false));
    check_all::<f16>(g, seed + 2, &gpu_sizes(false));
    check_all::<bf16>(g, seed + 3, &gpu_sizes(false));
    check_all::<i32>(g, seed + 4, &gpu_sizes(false));
    check_all::<i64>(g, seed + 5, &gpu_sizes(false));
    check_all::<u8>(g, seed + 6, &gpu_sizes(false));
}

#[test]
fn nccl_world_1_matches_reference() {
    if gpus("nccl_world_1_matches_reference", 1).is_none() {
        return;
    }
    run_ranks(1, Duration::from_secs(120), |pg| {
        let g = group(&pg, DeviceBackend::Nccl, 0, Duration::from_secs(60));
        assert_eq!(g.topology().to_string(), "nccl: 1 ranks, one GPU each");
        check_every_dtype(&g, 101);
    });
}

#[test]
fn two_ranks_sharing_one_gpu_are_relayed_and_match_reference() {
    if gpus(
        "two_ranks_sharing_one_gpu_are_relayed_and_match_reference",
        1,
    )
    .is_none()
    {
        return;
    }
    run_ranks(2, Duration::from_secs(120), |pg| {
        let g = group(&pg, DeviceBackend::Auto, 0, Duration::from_secs(60));
        let t = g.topology().to_string();
        assert!(
            t.starts_with("relay: 2 ranks, ranks 0 and 1 share a GPU"),
            "{t}"
        );
        check_every_dtype(&g, 201);
    });
}

/// A host callback that holds its stream until released.
extern "C" fn hold(flag: *mut std::ffi::c_void) {
    // SAFETY: `flag` is the `Arc<AtomicBool>` leaked by `hold_stream`, never freed.
    let flag = unsafe { &*(flag as *const AtomicBool) };
    while !flag.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Hold `stream` until the returned flag is set (work queued after this waits).
fn hold_stream(stream: &CudaStream) -> Arc<AtomicBool> {
    let flag = Arc::new(AtomicBool::new(false));
    let raw = Arc::into_raw(flag.clone()) as *mut std::ffi::c_void; // leaked on purpose
                                                                    // SAFETY: `hold` only reads the AtomicBool behind `raw`, which is never freed.
    let r = unsafe { cudarc::driver::sys::cuLaunchHostFunc(stream.cu_stream(), Some(hold), raw) };
    assert_eq!(
        r,
        cudarc::driver::sys::cudaError_enum::CUDA_SUCCESS,
        "cuLaunchHostFunc"
    );
    flag
}

#[test]
fn a_collective_that_cannot_finish_fails_in_time_naming_it() {
    if gpus("a_collective_that_cannot_finish_fails_in_time_naming_it", 1).is_none() {
        return;
    }
    run_ranks(1, Duration::from_secs(60), |pg| {
        let g = group(&pg, DeviceBackend::Nccl, 0, Duration::from_secs(2));
        let mut ok = g.compute_stream().clone_htod(&[1.0f32; 1024]).unwrap();
        g.all_reduce(&mut ok, ReduceOp::Sum).unwrap(); // #0 finishes
        let release = hold_stream(g.compute_stream());
        let d = g.compute_stream().alloc_zeros::<f32>(1024).unwrap();
        let started = Instant::now();
        let e = g.all_reduce_async(d, ReduceOp::Sum).wait().err();
        let waited = started.elapsed();
        release.store(true, Ordering::SeqCst);
        let e = e.expect("the held collective must fail");
        let s = e.to_string();
        assert!(
            matches!(e, Error::Timeout { .. }) && s.contains("all_reduce(sum, f32 x 1024) #1"),
            "{s}"
        );
        assert!(waited < Duration::from_secs(10), "failed after {waited:?}");
        let later = g.all_reduce(&mut ok, ReduceOp::Sum).unwrap_err();
        assert!(matches!(later, Error::Aborted(_)), "{later}");
    });
}

#[test]
fn two_gpus_nccl_matches_reference() {
    if gpus("two_gpus_nccl_matches_reference", 2).is_none() {
        return;
    }
    run_ranks(2, Duration::from_secs(120), |pg| {
        let dev = pg.rank();
        let g = group(&pg, DeviceBackend::Auto, dev, Duration::from_secs(60));
        assert_eq!(g.topology().name(), "nccl");
        check_every_dtype(&g, 301);
    });
}

#[test]
fn two_gpus_mismatch_fails_by_name() {
    if gpus("two_gpus_mismatch_fails_by_name", 2).is_none() {
        return;
    }
    let out = run_ranks(2, Duration::from_secs(60), |pg| {
        let g = group(&pg, DeviceBackend::Nccl, pg.rank(), Duration::from_secs(10));
        let n = if pg.rank() == 0 { 10 } else { 11 };
        let mut d = g.compute_stream().alloc_zeros::<f32>(n).unwrap();
        g.all_reduce(&mut d, ReduceOp::Sum).unwrap_err().to_string()
    });
    assert!(
        out[0].contains("rank 1 issued all_reduce(sum, f32 x 11)"),
        "{}",
        out[0]
    );
}
