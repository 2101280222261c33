//! One NCCL communicator: created from rank 0's unique id (exchanged through the store),
//! aborted by the watchdog, polled for asynchronous errors. Collectives are enqueued on the
//! group's communication stream through cudarc's raw `nccl::result` bindings; the handle is
//! behind a mutex so that the watchdog's abort and an enqueue never overlap.

use crate::dtype::{DType, ReduceOp};
use crate::{Error, Result};
use cudarc::nccl::{result, sys};
use std::sync::Mutex;

/// NCCL's name of an element type.
pub(crate) fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    use sys::ncclDataType_t as N;
    match d {
        DType::F32 => N::ncclFloat32,
        DType::F64 => N::ncclFloat64,
        DType::F16 => N::ncclFloat16,
        DType::BF16 => N::ncclBfloat16,
        DType::I32 => N::ncclInt32,
        DType::I64 => N::ncclInt64,
        DType::U8 => N::ncclUint8,
    }
}

/// NCCL's reduction operator (`avg` is NCCL's own `ncclAvg`).
pub(crate) fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    use sys::ncclRedOp_t as N;
    match op {
        ReduceOp::Sum => N::ncclSum,
        ReduceOp::Avg => N::ncclAvg,
        ReduceOp::Min => N::ncclMin,
        ReduceOp::Max => N::ncclMax,
        ReduceOp::Product => N::ncclProd,
    }
}

/// NCCL's description of an error code.
pub(crate) fn describe(e: &result::NcclError) -> String {
    // SAFETY: ncclGetErrorString takes any result code and returns a static C string.
    let s = unsafe { sys::ncclGetErrorString(e.0) };
    if s.is_null() {
        return format!("{:?}", e.0);
    }
    // SAFETY: non-NULL, NUL-terminated, static (owned by libnccl).
    let text = unsafe { std::ffi::CStr::from_ptr(s) }.to_string_lossy();
    format!("{text} ({:?})", e.0)
}

/// A communicator handle; `None` once aborted.
pub(crate) struct Comm {
    raw: Mutex<Option<sys::ncclComm_t>>,
    rank: usize,
}

// SAFETY: an ncclComm_t may be used from any thread as long as calls on it are not concurrent;
// every use goes through the mutex.
unsafe impl Send for Comm {}
// SAFETY: as above: shared access only reaches the handle through the mutex.
unsafe impl Sync for Comm {}

impl Comm {
    /// A new unique id (rank 0), as bytes for the store.
    pub(crate) fn unique_id() -> Result<Vec<u8>> {
        let id = result::get_uniqueid().map_err(|e| Error::Device {
            call: "ncclGetUniqueId".into(),
            rank: 0,
            message: describe(&e),
        })?;
        Ok(id.internal.iter().map(|&c| c as u8).collect())
    }

    /// Join the communicator of `size` ranks identified by `id` as `rank`, on the device current
    /// on this thread (blocks until every rank joined).
    pub(crate) fn init(id: &[u8], rank: usize, size: usize) -> Result<Comm> {
        let internal: [std::ffi::c_char; 128] = id
            .iter()
            .map(|&b| b as std::ffi::c_char)
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|v: Vec<_>| {
                Error::Config(format!("NCCL unique id of {} bytes, expected 128", v.len()))
            })?;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is a valid out-pointer; the id is the 128 bytes rank 0 made; the
        // rank and size fit in i32 (checked by the caller's group).
        unsafe {
            result::comm_init_rank(
                comm.as_mut_ptr(),
                size as i32,
                sys::ncclUniqueId { internal },
                rank as i32,
            )
        }
        .map_err(|e| Error::Device {
            call: "ncclCommInitRank".into(),
            rank,
            message: describe(&e),
        })?;
        Ok(Comm {
            // SAFETY: ncclCommInitRank succeeded, so it wrote the handle.
            raw: Mutex::new(Some(unsafe { comm.assume_init() })),
            rank,
        })
    }

    /// Run `f` on the handle (enqueue a collective); fails if the communicator was aborted.
    pub(crate) fn with<R>(
        &self,
        what: &str,
        f: impl FnOnce(sys::ncclComm_t) -> std::result::Result<R, result::NcclError>,
    ) -> Result<R> {
        let g = self.raw.lock().unwrap_or_else(|p| p.into_inner());
        let Some(c) = *g else {
            return Err(Error::Device {
                call: what.into(),
                rank: self.rank,
                message: "the NCCL communicator was aborted".into(),
            });
        };
        f(c).map_err(|e| Error::Device {
            call: what.into(),
            rank: self.rank,
            message: describe(&e),
        })
    }

    /// `ncclCommGetAsyncError`: `Err` if the communicator reported an error.
    pub(crate) fn async_error(&self) -> Result<()> {
        self.with("ncclCommGetAsyncError", |c| {
            let mut r = sys::ncclResult_t::ncclSuccess;
            // SAFETY: `c` is a live communicator (we hold the lock), `r` a valid out-pointer.
            unsafe { sys::ncclCommGetAsyncError(c, &mut r) }.result()?;
            r.result()
        })
        .map(|_| ())
    }

    /// `ncclCommAbort`: stop every pending operation; the handle is gone afterwards.
    pub(crate) fn abort(&self) {
        let mut g = self.raw.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = g.take() {
            // SAFETY: `c` is live and taken out, so nothing uses it after this call.
            if let Err(e) = unsafe { result::comm_abort(c) } {
                tracing::warn!("ncclCommAbort on rank {}: {}", self.rank, describe(&e));
            }
        }
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let g = self.raw.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = g.take() {
            // SAFETY: the last owner; `c` is live and nothing else can reach it. Destroy without
            // finalize: it does not wait for the other ranks (which may be gone).
            let _ = unsafe { result::comm_destroy(c) };
        }
    }
}
