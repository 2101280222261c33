//! The MPI library as the backend uses it: initialized once per process (thread level
//! `MPI_THREAD_MULTIPLE`, else calls are serialized through one lock), finalized at exit;
//! whether collectives are blocking calls ([`blocking_calls`]); communicators that free
//! themselves; element types and ops; and [`wait`], the loop that completes non-blocking
//! requests under ddp-comm's deadline (MPI has no timeouts of its own).

use crate::dtype::{DType, ReduceOp};
use crate::transport::Fingerprint;
use crate::{Error, Result};
use mpi::environment::{Threading, Universe};
use mpi::ffi;
use std::ffi::{c_int, c_void};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

extern "C" {
    /// `MPI_IN_PLACE` of the linked library (shim.c).
    fn ddp_mpi_in_place() -> *mut c_void;
}

/// Where an empty buffer points instead of its dangling address (which for one-byte elements
/// is `0x1`, Open MPI's `MPI_IN_PLACE`): MPI reads or writes nothing for a count of 0.
static EMPTY: [u64; 1] = [0];

/// The address of a send buffer for MPI.
pub(super) fn send_ptr<T>(s: &[T]) -> *const c_void {
    if s.is_empty() {
        EMPTY.as_ptr().cast()
    } else {
        s.as_ptr().cast()
    }
}

/// The address of a receive buffer for MPI (never written through when empty).
pub(super) fn recv_ptr<T>(s: &mut [T]) -> *mut c_void {
    if s.is_empty() {
        EMPTY.as_ptr() as *mut c_void
    } else {
        s.as_mut_ptr().cast()
    }
}

/// `MPI_IN_PLACE`.
pub(super) fn in_place() -> *mut c_void {
    // SAFETY: the shim returns a constant of the MPI headers; no state is touched.
    unsafe { ddp_mpi_in_place() }
}

/// The thread level MPI granted, once initialized.
static LEVEL: OnceLock<std::result::Result<Threading, String>> = OnceLock::new();
/// The universe we initialized (finalized at exit), `None` if the user initialized MPI.
static UNIVERSE: Mutex<Option<Universe>> = Mutex::new(None);
/// Serializes MPI calls when the library gave less than `MPI_THREAD_MULTIPLE`.
static SERIAL: Mutex<()> = Mutex::new(());

/// Initialize MPI for this process (once; a no-op if the program initialized it itself, which
/// then must have asked for `MPI_THREAD_SERIALIZED` or more).
pub(super) fn ensure_initialized() -> Result<()> {
    let level = LEVEL.get_or_init(|| {
        let level = if mpi::environment::is_initialized() {
            let mut provided: c_int = 0;
            // SAFETY: MPI is initialized; `provided` is a valid out-pointer.
            unsafe { ffi::MPI_Query_thread(&mut provided) };
            threading_of(provided)
        } else {
            let (universe, level) = mpi::initialize_with_threading(Threading::Multiple)
                .ok_or("MPI_Init_thread failed (or MPI was finalized already)")?;
            *UNIVERSE.lock().unwrap_or_else(|e| e.into_inner()) = Some(universe);
            // SAFETY: registers a plain `extern "C" fn()` with the C runtime.
            unsafe { libc::atexit(finalize_at_exit) };
            level
        };
        match level {
            Threading::Multiple | Threading::Serialized => Ok(level),
            other => Err(format!(
                "the MPI library grants thread level {other:?}; the mpi backend calls MPI from \
                 each group's communication thread and needs MPI_THREAD_SERIALIZED or more"
            )),
        }
    });
    level
        .clone()
        .map(|_| ())
        .map_err(|e| Error::Config(format!("backend mpi: {e}")))
}

fn threading_of(provided: c_int) -> Threading {
    // SAFETY: reading the library's constant thread levels.
    let (multiple, serialized, funneled) = unsafe {
        (
            ffi::RSMPI_THREAD_MULTIPLE,
            ffi::RSMPI_THREAD_SERIALIZED,
            ffi::RSMPI_THREAD_FUNNELED,
        )
    };
    match provided {
        p if p == multiple => Threading::Multiple,
        p if p == serialized => Threading::Serialized,
        p if p == funneled => Threading::Funneled,
        _ => Threading::Single,
    }
}

extern "C" fn finalize_at_exit() {
    // Dropping the universe calls MPI_Finalize (mpirun expects every rank to).
    if let Ok(mut u) = UNIVERSE.lock() {
        drop(u.take());
    }
}

/// Env var: `1` completes every collective as `MPI_I*` + `MPI_Testall` polling, as under
/// `MPI_THREAD_SERIALIZED` (for comparison and tests; default off).
pub const NONBLOCKING_ENV: &str = "DDP_MPI_NONBLOCKING";

/// Whether collectives are the blocking MPI calls (`MPI_Allreduce`, ...), watched by the
/// watchdog thread: when MPI is thread-multiple (a blocking call then holds no lock, so groups
/// on other threads and the watchdog's `MPI_Abort` can always proceed) and
/// [`NONBLOCKING_ENV`] is not `1`. Otherwise `MPI_I*` completed by [`wait`], which holds the
/// serializing lock only for each `MPI_Testall`. Open MPI runs its non-blocking collectives
/// in libnbc, slower than the tuned blocking ones (`docs/benchmarks.md`, "Choosing a backend").
pub(super) fn blocking_calls() -> bool {
    static BLOCKING: OnceLock<bool> = OnceLock::new();
    *BLOCKING.get_or_init(|| {
        matches!(LEVEL.get(), Some(Ok(Threading::Multiple)))
            && std::env::var(NONBLOCKING_ENV).map_or(true, |v| v.trim() != "1")
    })
}

/// `all_reduce(sum, f32 x 1024) #7 on rank 0 of 2`.
pub(super) fn describe(fp: &Fingerprint, rank: usize, size: usize) -> String {
    format!("{fp} #{} on rank {rank} of {size}", fp.seq)
}

/// Hold while calling MPI: the serializing lock unless MPI is thread-multiple.
pub(super) fn lock() -> Option<MutexGuard<'static, ()>> {
    match LEVEL.get() {
        Some(Ok(Threading::Multiple)) => None,
        _ => Some(SERIAL.lock().unwrap_or_else(|e| e.into_inner())),
    }
}

/// This process's rank in `MPI_COMM_WORLD` and its size.
pub(super) fn world_rank_size() -> (usize, usize) {
    let (mut rank, mut size): (c_int, c_int) = (0, 0);
    let _g = lock();
    // SAFETY: MPI is initialized (ensure_initialized ran); valid out-pointers.
    unsafe {
        ffi::MPI_Comm_rank(ffi::RSMPI_COMM_WORLD, &mut rank);
        ffi::MPI_Comm_size(ffi::RSMPI_COMM_WORLD, &mut size);
    }
    (rank as usize, size as usize)
}

/// Say why, and end the whole job: MPI cannot cancel a collective that a peer never joins.
pub(super) fn abort_with(cause: &Error) -> ! {
    eprintln!(
        "ddp-comm (backend mpi): {cause}; ending the job with MPI_Abort (MPI cannot cancel a \
         pending collective)"
    );
    // SAFETY: MPI_Abort may be called from any thread of an initialized MPI process (it is
    // thread-multiple whenever another thread may be inside a blocking call).
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    std::process::abort()
}

/// An owned communicator (freed on drop).
pub(super) struct Comm(ffi::MPI_Comm);

// SAFETY: a communicator handle is an opaque value; MPI calls on it are made under [`lock`]
// (or the library is thread-multiple), by one thread at a time (the group's engine lock).
unsafe impl Send for Comm {}

impl Comm {
    /// Take ownership of `raw`; errors are returned as codes on it (`MPI_ERRORS_RETURN`).
    pub(super) fn own(raw: ffi::MPI_Comm) -> Comm {
        let _g = lock();
        // SAFETY: `raw` is a valid communicator we created.
        unsafe { ffi::MPI_Comm_set_errhandler(raw, ffi::RSMPI_ERRORS_RETURN) };
        Comm(raw)
    }

    /// [`Comm::own`], or `None` for `MPI_COMM_NULL` (what a split gives non-members).
    pub(super) fn own_unless_null(raw: ffi::MPI_Comm) -> Option<Comm> {
        // SAFETY: reading the library's constant null communicator handle.
        let null = unsafe { ffi::RSMPI_COMM_NULL };
        (raw != null).then(|| Comm::own(raw))
    }

    pub(super) fn raw(&self) -> ffi::MPI_Comm {
        self.0
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        if mpi::environment::is_finalized() {
            return;
        }
        let _g = lock();
        // SAFETY: we own the handle; freeing is local (pending operations complete first).
        unsafe { ffi::MPI_Comm_free(&mut self.0) };
    }
}

/// The MPI type that carries `d`'s elements (16-bit floats travel as `uint16_t` bits; they
/// are reduced as `f32`, see the backend).
pub(super) fn datatype(d: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading the library's predefined datatype handles.
    unsafe {
        match d {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::F64 => ffi::RSMPI_DOUBLE,
            DType::F16 | DType::BF16 => ffi::RSMPI_UINT16_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
        }
    }
}

/// The MPI op of `op` (`Avg` sums; the division follows).
pub(super) fn op_of(op: ReduceOp) -> ffi::MPI_Op {
    // SAFETY: reading the library's predefined op handles.
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => ffi::RSMPI_SUM,
            ReduceOp::Product => ffi::RSMPI_PROD,
            ReduceOp::Min => ffi::RSMPI_MIN,
            ReduceOp::Max => ffi::RSMPI_MAX,
        }
    }
}

/// An MPI element count (`int`), or an error naming `what`.
pub(super) fn count(n: usize, what: &dyn Fn() -> String) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        Error::InvalidArgument(format!(
            "{}: {n} elements exceed MPI's count limit ({})",
            what(),
            c_int::MAX
        ))
    })
}

/// The library's message for error code `rc`.
pub(super) fn error_string(rc: c_int) -> String {
    let mut buf = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: `buf` holds at least MPI_MAX_ERROR_STRING (256 in Open MPI and MPICH) bytes.
    unsafe { ffi::MPI_Error_string(rc, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.clamp(0, 512) as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

/// `Ok` for `MPI_SUCCESS`, else an error naming `what` and `call`.
pub(super) fn check(rc: c_int, call: &str, what: &dyn Fn() -> String) -> Result<()> {
    if rc == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    Err(Error::Io {
        context: format!("{} ({call})", what()),
        message: error_string(rc),
    })
}

/// Keep the first error code of several calls in `rc`.
pub(super) fn keep_first(rc: &mut c_int, next: c_int) {
    if *rc == ffi::MPI_SUCCESS as c_int {
        *rc = next;
    }
}

/// How long to wait, and for what (for the errors and warnings).
pub(super) struct Deadline<'a> {
    pub at: Instant,
    pub timeout: Duration,
    pub warn_after: Option<Duration>,
    /// `all_reduce(sum, f32 x 1024) #7 on rank 0 of 2`.
    pub what: &'a dyn Fn() -> String,
}

/// Complete `reqs` (null requests count as complete), polling on this thread: spin first, then
/// yield, then sleep briefly, so a long wait does not burn a core. Past the deadline: a timeout
/// error naming the collective (the requests stay pending; the caller ends the job).
/// `pending_peer(i)` names who request `i` waits for, when known.
pub(super) fn wait(
    reqs: &mut [ffi::MPI_Request],
    d: &Deadline<'_>,
    pending_peer: &dyn Fn(usize) -> Option<usize>,
) -> Result<()> {
    let start = Instant::now();
    let mut next_warn = d.warn_after.map(|w| start + w);
    let mut polls: u32 = 0;
    loop {
        let mut done: c_int = 0;
        let rc = {
            let _g = lock();
            // SAFETY: `reqs` are valid requests (or MPI_REQUEST_NULL) owned by the caller,
            // whose buffers outlive this call.
            unsafe {
                ffi::MPI_Testall(
                    reqs.len() as c_int,
                    reqs.as_mut_ptr(),
                    &mut done,
                    ffi::RSMPI_STATUSES_IGNORE,
                )
            }
        };
        check(rc, "MPI_Testall", d.what)?;
        if done != 0 {
            return Ok(());
        }
        let now = Instant::now();
        if now >= d.at || next_warn.is_some_and(|w| now >= w) {
            let null = request_null();
            let waiting: Vec<usize> = (0..reqs.len())
                .filter(|&i| reqs[i] != null)
                .filter_map(pending_peer)
                .collect();
            let on = if waiting.is_empty() {
                String::new()
            } else {
                format!(", waiting for rank(s) {waiting:?}")
            };
            if now >= d.at {
                return Err(Error::Timeout {
                    what: format!(
                        "{} on MPI{on} (MPI cannot cancel it: the job is ended with MPI_Abort)",
                        (d.what)()
                    ),
                    timeout: d.timeout,
                });
            }
            tracing::warn!(
                "{} on MPI: still waiting after {:?}{on}",
                (d.what)(),
                now - start
            );
            next_warn = d.warn_after.map(|w| now + w);
        }
        polls = polls.saturating_add(1);
        if polls < 2000 {
            std::hint::spin_loop();
        } else if now - start < Duration::from_millis(20) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Make one MPI call `f` and complete it: the blocking form (`f(None)`) when
/// [`blocking_calls`] (the caller's watch bounds it), else the `MPI_I*` form
/// (`f(Some(request))`) completed by [`wait`] under `d`. `name` is the blocking form's.
pub(super) fn call(
    name: &str,
    d: &Deadline<'_>,
    f: impl FnOnce(Option<&mut ffi::MPI_Request>) -> c_int,
) -> Result<()> {
    if blocking_calls() {
        // No lock: blocking calls are made only when MPI is thread-multiple.
        return check(f(None), name, d.what);
    }
    let mut req = request_null();
    let rc = {
        let _g = lock();
        f(Some(&mut req))
    };
    check(rc, name, d.what)?;
    wait(std::slice::from_mut(&mut req), d, &|_| None)
}

/// `MPI_REQUEST_NULL`.
pub(super) fn request_null() -> ffi::MPI_Request {
    // SAFETY: reading the library's constant null request handle.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}
