//! The CUDA side (feature `nccl`) on a machine without CUDA: a missing libcuda or libnccl is a
//! clear error naming the library and `LD_LIBRARY_PATH` (and the `libnccl.so` vs
//! `libnccl.so.2` trap), never a panic, also where cudarc itself would panic. On a machine
//! with the libraries these tests skip, saying so (they are about their absence).
#![cfg(feature = "nccl")]

mod common;

use common::run_ranks;
use ddp_comm::cuda::libs::{guard, probe, Library};
use ddp_comm::cuda::{nccl_available, CudaGroup, CudaOptions, DeviceBackend};
use ddp_comm::Error;
use std::time::Duration;

/// Whether `lib` loads here (then the tests about its absence cannot run).
fn present(lib: Library, test: &str) -> bool {
    let here = probe(lib, None).is_ok();
    if here {
        common::skip_gpu(test, &format!("{} is installed here", lib.name()), false);
    }
    here
}

#[test]
fn missing_libcuda_is_an_error_naming_it_and_ld_library_path() {
    if present(
        Library::Cuda,
        "missing_libcuda_is_an_error_naming_it_and_ld_library_path",
    ) {
        return;
    }
    let out = run_ranks(1, Duration::from_secs(20), |pg| {
        let opts = CudaOptions {
            backend: Some(DeviceBackend::Auto),
            ..Default::default()
        };
        CudaGroup::new(&pg, opts).unwrap_err()
    });
    let e = &out[0];
    assert!(
        matches!(
            e,
            Error::Library {
                library: "libcuda",
                ..
            }
        ),
        "{e:?}"
    );
    let s = e.to_string();
    assert!(
        s.contains("libcuda.so.1") && s.contains("LD_LIBRARY_PATH"),
        "{s}"
    );
    // also through the device count, as the GPU tests ask first
    let s = ddp_comm::cuda::device_count().unwrap_err().to_string();
    assert!(s.starts_with("libcuda: not found"), "{s}");
}

#[test]
fn missing_libnccl_says_cudarc_wants_libnccl_so_not_so_2() {
    if present(
        Library::Nccl,
        "missing_libnccl_says_cudarc_wants_libnccl_so_not_so_2",
    ) {
        return;
    }
    let s = nccl_available().unwrap_err().to_string();
    assert!(
        s.starts_with("libnccl: not found")
            && s.contains("LD_LIBRARY_PATH")
            && s.contains("cudarc looks for libnccl.so, not libnccl.so.2"),
        "{s}"
    );
}

#[test]
fn a_libnccl_so_2_on_the_path_gets_the_link_command() {
    if present(
        Library::Nccl,
        "a_libnccl_so_2_on_the_path_gets_the_link_command",
    ) {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("libnccl.so.2"), b"not really a library").unwrap();
    let path = format!("/nonexistent:{}", dir.path().display());
    let s = probe(Library::Nccl, Some(&path)).unwrap_err().to_string();
    let so2 = dir.path().join("libnccl.so.2");
    assert!(
        s.contains(&format!("found {}", so2.display()))
            && s.contains(&format!("ln -s {} DIR/libnccl.so", so2.display())),
        "{s}"
    );
}

/// cudarc panics when a lazily loaded library is missing; our entry points catch that.
#[test]
fn a_panic_inside_cudarc_becomes_an_error() {
    if present(Library::Nccl, "a_panic_inside_cudarc_becomes_an_error") {
        return;
    }
    let e = guard("ncclGetUniqueId", || {
        cudarc::nccl::result::get_uniqueid()
            .map(|_| ())
            .map_err(|_| Error::Internal("cudarc returned instead of panicking".into()))
    })
    .unwrap_err();
    let s = e.to_string();
    assert!(
        matches!(e, Error::Library { .. }) && s.contains("ncclGetUniqueId") && s.contains("nccl"),
        "{s}"
    );
}
