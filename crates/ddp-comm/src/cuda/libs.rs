//! Finding `libcuda` and `libnccl` at run time, with errors that say what to do.
//!
//! cudarc (feature `fallback-dynamic-loading`) opens the libraries on first use and *panics*
//! when it cannot. We look first, with the names cudarc tries, and turn a missing library into
//! [`Error::Library`] naming the library, the names tried and `LD_LIBRARY_PATH`. In particular
//! cudarc looks for `libnccl.so` (and `libnccl.so.<CUDA major>`), never `libnccl.so.2`, the
//! only name NVIDIA's packages (e.g. pip's `nvidia-nccl-cu13`) install: when a `libnccl.so.2` is
//! found on `LD_LIBRARY_PATH` the error says to link it as `libnccl.so`. A panic that still
//! escapes cudarc is caught at the entry points ([`guard`]) and becomes an error too.

use crate::{Error, Result};
use std::ffi::CString;
use std::path::{Path, PathBuf};

/// A library the CUDA side loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Library {
    /// The CUDA driver, `libcuda.so.1` (comes with the NVIDIA driver).
    Cuda,
    /// NCCL, `libnccl.so` (cudarc's name; NVIDIA ships `libnccl.so.2`).
    Nccl,
}

impl Library {
    /// `libcuda` or `libnccl`.
    pub fn name(self) -> &'static str {
        match self {
            Library::Cuda => "libcuda",
            Library::Nccl => "libnccl",
        }
    }

    /// The file names cudarc tries, in its order (CUDA major version 13).
    pub fn candidates(self) -> &'static [&'static str] {
        match self {
            Library::Cuda => &[
                "libcuda.so",
                "libcuda.so.13",
                "libcuda.so.12",
                "libcuda.so.11",
                "libcuda.so.1",
            ],
            Library::Nccl => &[
                "libnccl.so",
                "libnccl.so.13",
                "libnccl.so.12",
                "libnccl.so.11",
                "libnccl.so.1",
            ],
        }
    }

    /// The name NVIDIA installs that cudarc does not try, if any.
    fn soname_not_tried(self) -> Option<&'static str> {
        match self {
            Library::Cuda => None,
            Library::Nccl => Some("libnccl.so.2"),
        }
    }
}

/// Whether the dynamic loader can open `name` (as cudarc would, by name, through
/// `LD_LIBRARY_PATH` and the system paths).
fn loadable(name: &str) -> std::result::Result<(), String> {
    let c = CString::new(name).map_err(|e| e.to_string())?;
    // SAFETY: `c` is a valid NUL-terminated string; dlopen has no other preconditions. Loading
    // runs the library's initialisers, which for libcuda/libnccl is what cudarc does next anyway;
    // the handle is kept open (as cudarc keeps its own) so nothing is unloaded under anyone.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if !h.is_null() {
        return Ok(());
    }
    // SAFETY: dlerror returns NULL or a valid C string owned by libc, read before any other dl* call.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        return Err(format!("{name}: cannot be opened"));
    }
    // SAFETY: non-NULL dlerror result is a valid NUL-terminated string.
    Err(unsafe { std::ffi::CStr::from_ptr(msg) }
        .to_string_lossy()
        .into_owned())
}

/// Check that `lib` can be loaded under one of cudarc's names; `ld_library_path` is searched for
/// a `libnccl.so.2` to suggest the link (pass `std::env::var("LD_LIBRARY_PATH").ok()`).
pub fn probe(lib: Library, ld_library_path: Option<&str>) -> Result<()> {
    let mut last = String::new();
    for name in lib.candidates() {
        match loadable(name) {
            Ok(()) => return Ok(()),
            Err(e) => last = e,
        }
    }
    Err(missing(lib, ld_library_path, &last))
}

/// The error for `lib` not found, with what to do about it.
pub fn missing(lib: Library, ld_library_path: Option<&str>, loader_said: &str) -> Error {
    let path = ld_library_path.unwrap_or("");
    let tried = lib.candidates().join(", ");
    let mut hint = match lib {
        Library::Cuda => format!(
            "install the NVIDIA driver, or add the folder holding libcuda.so.1 to LD_LIBRARY_PATH \
             (now {path:?})"
        ),
        Library::Nccl => format!(
            "add the folder holding it to LD_LIBRARY_PATH (now {path:?}); note that cudarc looks \
             for libnccl.so, not libnccl.so.2 (the name NVIDIA's packages install): create a \
             link named libnccl.so to libnccl.so.2 in a folder on LD_LIBRARY_PATH"
        ),
    };
    if let Some(so2) = lib.soname_not_tried() {
        if let Some(found) = find_in(path, so2) {
            hint = format!(
                "found {} but cudarc does not load libnccl.so.2 by that name: run `ln -s {} \
                 DIR/libnccl.so` for a DIR on LD_LIBRARY_PATH (now {path:?})",
                found.display(),
                found.display()
            );
        }
    }
    Error::Library {
        library: lib.name(),
        message: format!("not found (tried {tried}; the loader said: {loader_said}); {hint}"),
    }
}

/// The first `dir/name` that exists for a `dir` of the colon-separated `path`.
fn find_in(path: &str, name: &str) -> Option<PathBuf> {
    path.split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(name))
        .find(|p| p.exists())
}

/// Run `f`, turning a panic inside it (cudarc panics when a library it loads lazily is missing)
/// into an error about `what`.
pub fn guard<R>(what: &str, f: impl FnOnce() -> Result<R>) -> Result<R> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic without a message".into());
            Err(Error::Library {
                library: "CUDA",
                message: format!("{what}: {msg}"),
            })
        }
    }
}
