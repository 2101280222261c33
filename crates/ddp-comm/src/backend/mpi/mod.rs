//! The MPI backend (feature `mpi`, `DDP_BACKEND=mpi`): a group's collectives run on the MPI
//! library the job was launched with (`mpirun`/`srun`), so clusters get their fabric
//! (InfiniBand, RoCE, Omni-Path through UCX or libfabric) without a transport of ours.
//!
//! ```text
//!  ProcessGroup ─(caller's thread when idle, else jobs)─▶ engine ─▶ MpiBackend
//!     ├ watchdog: armed with the deadline; past it prints the timeout naming the collective and
//!     │   its sequence number, then MPI_Abort (a blocking call cannot be interrupted: no hang)
//!     ├ fingerprint check: MPI_Allreduce(max) of [fp, !fp] on a twin communicator
//!     ├ the collective, blocking: MPI_Allreduce, MPI_Bcast, MPI_Reduce, MPI_Allgather,
//!     │   MPI_Reduce_scatter_block, MPI_Gather, MPI_Scatter, MPI_Alltoall, MPI_Barrier
//!     └ MpiTransport: send/recv = MPI_Isend/MPI_Irecv with our 40-byte header (fingerprint,
//!         length), completed by runtime::wait under the deadline
//! ```
//!
//! - The default group is `MPI_COMM_WORLD` (duplicated, so our traffic never meets the
//!   program's own); rank and world size come from MPI, no store is needed. Subgroups are
//!   `MPI_Comm_split` of their parent ([`CollectiveBackend::split`]).
//! - Collectives are MPI's blocking calls: the engine runs one collective at a time anyway, and
//!   Open MPI's blocking collectives (its tuned component) are faster on one host than the
//!   non-blocking ones (libnbc; figures in the book's benchmarks chapter). MPI has no timeouts, so each call is watched
//!   (`watchdog.rs`): a collective a peer never joins ends the job with [`Error::Timeout`]
//!   naming it and its sequence number, then `MPI_Abort` (a pending MPI collective cannot be
//!   cancelled). A peer that dies is reported by `mpirun` itself, which ends the job.
//! - Blocking calls need `MPI_THREAD_MULTIPLE` (what we ask for; then no lock is held during a
//!   call, so groups on other threads and the watchdog always proceed). Under
//!   `MPI_THREAD_SERIALIZED` (a program that initialized MPI itself), or with
//!   `DDP_MPI_NONBLOCKING=1`, every collective is its `MPI_I*` form instead, completed by
//!   polling `MPI_Testall` against the deadline with the serializing lock held per poll only.
//! - `f16`/`bf16` reductions are widened to `f32`, reduced as `MPI_FLOAT` and rounded once, as
//!   on every other backend (the same bits as `tcp`/`shm`); a 16-bit user-defined op would halve
//!   the bytes but round after every pairwise step. Other collectives move their bits as
//!   `uint16_t`.
//! - Mismatched collectives: before each collective, its [`Fingerprint`] (sequence number, op,
//!   dtype, reduce op, count, root) is reduced with `MPI_MAX` together with its complement on a
//!   second communicator; ranks that disagree see `max != mine` and learn who differs from an
//!   `MPI_Allgather` of the fingerprints ([`Error::Mismatch`], naming both sides). In blocking
//!   mode the check completes before the collective is issued (a mismatched blocking call
//!   could hang or corrupt memory); non-blocking, it overlaps the collective. It costs one
//!   small all-reduce per collective (`ddp-bench allreduce --backend mpi` against raw
//!   `MPI_Allreduce`: the book's benchmarks chapter) and is turned off with `DDP_MPI_FINGERPRINTS=0`.

mod runtime;
mod transport;
mod watchdog;

use super::{flat, with_element, CollectiveBackend, HostBuf, RawHostSlice, Topology};
use crate::dtype::{Element, ReduceOp};
use crate::transport::{Fingerprint, OpKind, Transport};
use crate::{Error, Result};
use mpi::ffi;
use runtime::Comm;
use std::ffi::{c_int, c_void};
use std::time::Duration;
use transport::MpiTransport;
use watchdog::{Armed, Watch};

/// `MPI_Gather` and `MPI_Scatter`: send buffer, count, type, receive buffer, count, type, root,
/// communicator.
type RootedCall = unsafe extern "C" fn(
    *const c_void,
    c_int,
    ffi::MPI_Datatype,
    *mut c_void,
    c_int,
    ffi::MPI_Datatype,
    c_int,
    ffi::MPI_Comm,
) -> c_int;
/// `MPI_Igather` and `MPI_Iscatter`: the same, and the request.
type RootedStart = unsafe extern "C" fn(
    *const c_void,
    c_int,
    ffi::MPI_Datatype,
    *mut c_void,
    c_int,
    ffi::MPI_Datatype,
    c_int,
    ffi::MPI_Comm,
    *mut ffi::MPI_Request,
) -> c_int;

/// Env var: `0` turns the per-collective fingerprint check off (default on).
pub const FINGERPRINTS_ENV: &str = "DDP_MPI_FINGERPRINTS";

/// What the default MPI group needs from [`crate::InitOptions`].
pub(crate) struct MpiPlan {
    pub rank: Option<usize>,
    pub world_size: Option<usize>,
    pub timeout: Duration,
    pub warn_after: Option<Duration>,
}

/// Initialize MPI (once per process) and connect the default group over `MPI_COMM_WORLD`.
/// Returns the backend and this process's (rank, world size).
pub(crate) fn connect_world(p: &MpiPlan) -> Result<(Box<dyn CollectiveBackend>, usize, usize)> {
    runtime::ensure_initialized()?;
    let (rank, size) = runtime::world_rank_size();
    for (name, given, actual) in [("rank", p.rank, rank), ("world size", p.world_size, size)] {
        if given.is_some_and(|g| g != actual) {
            return Err(Error::Config(format!(
                "backend mpi: {name} {} was given, but MPI_COMM_WORLD says {actual} (the mpi \
                 backend takes rank and world size from mpirun/srun; drop the explicit value)",
                given.unwrap_or_default()
            )));
        }
    }
    let check = match std::env::var(FINGERPRINTS_ENV) {
        Ok(v) if v.trim() == "0" => false,
        Ok(v) if v.trim() == "1" || v.trim().is_empty() => true,
        Ok(v) => {
            return Err(Error::Config(format!(
                "{FINGERPRINTS_ENV}={v:?}: expected 0 or 1"
            )))
        }
        Err(_) => true,
    };
    // SAFETY: reading the library's constant world communicator handle.
    let world = unsafe { ffi::RSMPI_COMM_WORLD };
    let backend = MpiBackend::from_parent(world, p.timeout, p.warn_after, check)?;
    Ok((Box::new(backend), rank, size))
}

/// Collectives on an MPI communicator (see the module docs).
pub struct MpiBackend {
    t: MpiTransport,
    /// Twin communicator of the fingerprint checks (never confused with the data collectives).
    check: Option<Comm>,
    /// Fingerprint words of the check in flight: mine, then the maximum over ranks.
    fp_words: Box<[u64; 6]>,
    /// Watches this group's blocking calls (`None` when collectives are non-blocking).
    watch: Option<Watch>,
}

/// Start `MPI_Comm_idup(parent)` and wait for it under `timeout`.
fn idup(parent: ffi::MPI_Comm, timeout: Duration, what: &dyn Fn() -> String) -> Result<Comm> {
    let mut out = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
    let mut req = runtime::request_null();
    let rc = {
        let _g = runtime::lock();
        // SAFETY: `parent` is valid; `out` is written when the request completes, which we
        // wait for before reading it.
        unsafe { ffi::MPI_Comm_idup(parent, out.as_mut_ptr(), &mut req) }
    };
    runtime::check(rc, "MPI_Comm_idup", what)?;
    let d = runtime::Deadline {
        at: std::time::Instant::now() + timeout,
        timeout,
        warn_after: None,
        what,
    };
    runtime::wait(std::slice::from_mut(&mut req), &d, &|_| None)?;
    // SAFETY: the request completed, so the new communicator handle was written.
    Ok(Comm::own(unsafe { out.assume_init() }))
}

impl MpiBackend {
    /// A group over a duplicate of `parent` (and a second one for the fingerprint checks).
    fn from_parent(
        parent: ffi::MPI_Comm,
        timeout: Duration,
        warn_after: Option<Duration>,
        check: bool,
    ) -> Result<MpiBackend> {
        let what = || "creating the MPI group (MPI_Comm_idup)".to_string();
        let data = idup(parent, timeout, &what)?;
        let check = if check {
            Some(idup(parent, timeout, &what)?)
        } else {
            None
        };
        Ok(MpiBackend {
            t: MpiTransport::new(data, warn_after)?,
            check,
            fp_words: Box::new([0; 6]),
            watch: runtime::blocking_calls().then(Watch::new),
        })
    }

    fn describe(&self) -> String {
        self.t.describe()
    }

    /// Run one collective (`call` names the blocking form).
    ///
    /// Blocking ([`runtime::blocking_calls`]): arm the watchdog, check the fingerprints (a
    /// blocking `MPI_Allreduce` on the twin communicator, so a mismatched collective is never
    /// issued), make the blocking call, disarm. Non-blocking: start the fingerprint check and
    /// the collective's `MPI_I*` form, then complete both under the deadline.
    fn run(
        &mut self,
        call: &str,
        start: impl FnOnce(ffi::MPI_Comm, Option<&mut ffi::MPI_Request>) -> c_int,
    ) -> Result<()> {
        if self.watch.is_some() {
            return self.watched(|b| {
                b.check_fingerprints()?;
                let what = || b.describe();
                let comm = b.t.comm.raw();
                runtime::call(call, &b.t.deadline(&what), |req| start(comm, req))
            });
        }
        let desc = self.describe();
        let what = || desc.clone();
        let mut check_req = if self.load_check() {
            Some(self.start_check(&what)?)
        } else {
            None
        };
        let mut req = runtime::request_null();
        let rc = {
            let _g = runtime::lock();
            start(self.t.comm.raw(), Some(&mut req))
        };
        if let Some(r) = check_req.as_mut() {
            let d = self.t.deadline(&what);
            runtime::wait(std::slice::from_mut(r), &d, &|_| None)?;
            self.compare_check()?;
        }
        runtime::check(rc, call, &what)?;
        runtime::wait(
            std::slice::from_mut(&mut req),
            &self.t.deadline(&what),
            &|_| None,
        )
    }

    /// Run `f` with the watchdog armed with the current collective's deadline (if watched).
    fn watched<R>(&mut self, f: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        if let Some(w) = &self.watch {
            w.arm(Armed {
                fp: self.t.fp,
                rank: self.t.rank(),
                size: self.t.size(),
                deadline: self.t.deadline,
                timeout: self.t.timeout,
                warn_after: self.t.warn_after,
                since: std::time::Instant::now(),
            });
        }
        let r = f(self);
        if let Some(w) = &self.watch {
            w.disarm();
        }
        r
    }

    /// The fingerprint as three words: sequence number; op, dtype, reduce op and root; count.
    fn words(fp: &Fingerprint) -> [u64; 3] {
        let reduce = fp.reduce.map_or(crate::transport::NO_REDUCE, |r| r.code());
        [
            fp.seq,
            fp.op as u64
                | (fp.dtype.code() as u64) << 8
                | (reduce as u64) << 16
                | (fp.root as u64) << 32,
            fp.count,
        ]
    }

    fn from_words(w: &[u64]) -> Option<Fingerprint> {
        Fingerprint::from_codes(
            w[0],
            w[2],
            w[1] as u8,
            (w[1] >> 8) as u8,
            (w[1] >> 16) as u8,
            (w[1] >> 32) as u32,
        )
    }

    /// Load the check's words (mine and their complement, reduced with `MPI_MAX`); `false`
    /// when there is nothing to check (checks off, one rank, or point-to-point, whose
    /// messages carry the fingerprint in their header).
    fn load_check(&mut self) -> bool {
        if self.check.is_none() || self.t.size() == 1 || self.t.fp.op == OpKind::SendRecv {
            return false;
        }
        let w = Self::words(&self.t.fp);
        *self.fp_words = [w[0], w[1], w[2], !w[0], !w[1], !w[2]];
        true
    }

    /// The fingerprint check's reduction of `fp_words`: blocking without a request.
    fn check_call(&mut self) -> impl FnOnce(Option<&mut ffi::MPI_Request>) -> c_int {
        let words: *mut c_void = self.fp_words.as_mut_ptr().cast();
        let comm = self.check.as_ref().map_or(self.t.comm.raw(), Comm::raw);
        move |req| {
            // SAFETY: `fp_words` is boxed (stable address) and lives in self until the call
            // completed (blocking, or waited for by the caller; else the job is ended); the
            // type and op are the library's constants.
            unsafe {
                let (ty, max) = (ffi::RSMPI_UINT64_T, ffi::RSMPI_MAX);
                match req {
                    None => ffi::MPI_Allreduce(runtime::in_place(), words, 6, ty, max, comm),
                    Some(r) => ffi::MPI_Iallreduce(runtime::in_place(), words, 6, ty, max, comm, r),
                }
            }
        }
    }

    /// Check the fingerprints now (blocking mode, and before a split).
    fn check_fingerprints(&mut self) -> Result<()> {
        if !self.load_check() {
            return Ok(());
        }
        let f = self.check_call();
        let what = || self.describe();
        runtime::call(
            "MPI_Allreduce (fingerprint check)",
            &self.t.deadline(&what),
            f,
        )?;
        self.compare_check()
    }

    /// Start the check as `MPI_Iallreduce` (non-blocking mode; overlapped with the collective).
    fn start_check(&mut self, what: &dyn Fn() -> String) -> Result<ffi::MPI_Request> {
        let f = self.check_call();
        let mut req = runtime::request_null();
        let rc = {
            let _g = runtime::lock();
            f(Some(&mut req))
        };
        runtime::check(rc, "MPI_Iallreduce (fingerprint check)", what)?;
        Ok(req)
    }

    /// After the check: on a disagreement, find and name a rank that issued something else.
    fn compare_check(&self) -> Result<()> {
        let mine = Self::words(&self.t.fp);
        let max = &self.fp_words[..3];
        let min: Vec<u64> = self.fp_words[3..].iter().map(|w| !w).collect();
        if max == mine && min == mine {
            return Ok(());
        }
        // Somebody differs: gather everyone's words to say who and what.
        let check = self.check.as_ref().expect("a check ran").raw();
        let size = self.t.size();
        let mut all = vec![0u64; 3 * size];
        let (send, recv): (*mut c_void, *mut c_void) =
            (mine.as_ptr() as *mut c_void, all.as_mut_ptr().cast());
        let what = || self.describe();
        runtime::call(
            "MPI_Allgather (fingerprint check)",
            &self.t.deadline(&what),
            |req| {
                // SAFETY: `mine` and `all` live until the call completed (`call` waits); the
                // type is the library's constant.
                unsafe {
                    let ty = ffi::RSMPI_UINT64_T;
                    match req {
                        None => ffi::MPI_Allgather(send, 3, ty, recv, 3, ty, check),
                        Some(r) => ffi::MPI_Iallgather(send, 3, ty, recv, 3, ty, check, r),
                    }
                }
            },
        )?;
        let rank = self.t.rank();
        let peer = (0..size)
            .find(|&r| all[3 * r..3 * r + 3] != mine)
            .unwrap_or(rank);
        Err(Error::Mismatch {
            rank,
            local: self.t.fp,
            local_bytes: None,
            peer,
            remote: Self::from_words(&all[3 * peer..3 * peer + 3]),
            remote_bytes: None,
        })
    }

    /// At the root, the buffer `what` (`size × n` elements) a rooted collective must be given
    /// there, checked; `None` on the other ranks.
    fn at_root<B>(
        &self,
        what: &str,
        root: usize,
        buf: Option<B>,
        n: usize,
        len: impl Fn(&B) -> usize,
    ) -> Result<Option<B>> {
        if self.t.rank() != root {
            return Ok(None);
        }
        let b = buf.ok_or_else(|| {
            let (call, side) = what.split_once(' ').unwrap_or((what, "a"));
            Error::InvalidArgument(format!("{call}: the root must pass an {side} buffer"))
        })?;
        flat::check_len(what, len(&b), n * self.t.size())?;
        self.count(len(&b))?;
        Ok(Some(b))
    }

    /// Gather or scatter: `n` elements of `dt` per rank between `(inp, out)` (the root's side
    /// `size × n`, checked by [`MpiBackend::at_root`]), by `calls`, the blocking and the
    /// non-blocking form, which share one signature.
    fn rooted(
        &mut self,
        call: &str,
        (inp, out): (*const c_void, *mut c_void),
        dt: crate::dtype::DType,
        n: usize,
        root: usize,
        calls: (RootedCall, RootedStart),
    ) -> Result<()> {
        let c = self.count(n)?;
        let ty = runtime::datatype(dt);
        let root = root as c_int;
        self.run(call, |comm, req| {
            // SAFETY: the buffers outlive the call; this rank's side holds `n` elements and the
            // root's `size × n` (checked by `at_root`).
            unsafe {
                match req {
                    None => (calls.0)(inp, c, ty, out, c, ty, root, comm),
                    Some(r) => (calls.1)(inp, c, ty, out, c, ty, root, comm, r),
                }
            }
        })
    }

    fn count(&self, n: usize) -> Result<c_int> {
        runtime::count(n, &|| self.describe())
    }

    fn all_reduce_typed<T: Element>(&mut self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        if let Some(mut wide) = T::widen(buf) {
            self.all_reduce_typed::<f32>(&mut wide, op)?;
            T::narrow(&wide, buf);
            return Ok(());
        }
        let n = self.count(buf.len())?;
        let ptr = runtime::recv_ptr(buf);
        let (ty, mop, inpl) = (
            runtime::datatype(T::DTYPE),
            runtime::op_of(op),
            runtime::in_place(),
        );
        self.run("MPI_Allreduce", |comm, req| {
            // SAFETY: `buf` outlives the call (completed in `run`, or the job is ended).
            unsafe {
                match req {
                    None => ffi::MPI_Allreduce(inpl, ptr, n, ty, mop, comm),
                    Some(r) => ffi::MPI_Iallreduce(inpl, ptr, n, ty, mop, comm, r),
                }
            }
        })?;
        if op == ReduceOp::Avg {
            T::div_by(buf, self.t.size());
        }
        Ok(())
    }

    fn reduce_typed<T: Element>(&mut self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        let is_root = self.t.rank() == root;
        if let Some(mut wide) = T::widen(buf) {
            self.reduce_typed::<f32>(&mut wide, op, root)?;
            if is_root {
                T::narrow(&wide, buf);
            }
            return Ok(());
        }
        let n = self.count(buf.len())?;
        let ptr = runtime::recv_ptr(buf);
        let (ty, mop, root_c) = (
            runtime::datatype(T::DTYPE),
            runtime::op_of(op),
            root as c_int,
        );
        self.run("MPI_Reduce", |comm, req| {
            let (send, recv) = if is_root {
                (runtime::in_place(), ptr)
            } else {
                (ptr, std::ptr::null_mut())
            };
            // SAFETY: as in all_reduce; non-roots' recv buffer is not significant.
            unsafe {
                match req {
                    None => ffi::MPI_Reduce(send, recv, n, ty, mop, root_c, comm),
                    Some(r) => ffi::MPI_Ireduce(send, recv, n, ty, mop, root_c, comm, r),
                }
            }
        })?;
        if op == ReduceOp::Avg && is_root {
            T::div_by(buf, self.t.size());
        }
        Ok(())
    }

    fn reduce_scatter_typed<T: Element>(
        &mut self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        let p = self.t.size();
        flat::check_len("reduce_scatter input", input.len(), output.len() * p)?;
        if let Some(wide_in) = T::widen(input) {
            let mut wide_out = vec![0f32; output.len()];
            self.reduce_scatter_typed::<f32>(&wide_in, &mut wide_out, op)?;
            T::narrow(&wide_out, output);
            return Ok(());
        }
        let n = self.count(output.len())?;
        let (inp, out): (*const c_void, *mut c_void) =
            (runtime::send_ptr(input), runtime::recv_ptr(output));
        let (ty, mop) = (runtime::datatype(T::DTYPE), runtime::op_of(op));
        self.run("MPI_Reduce_scatter_block", |comm, req| {
            // SAFETY: `input` and `output` outlive the call; sizes checked above.
            unsafe {
                match req {
                    None => ffi::MPI_Reduce_scatter_block(inp, out, n, ty, mop, comm),
                    Some(r) => ffi::MPI_Ireduce_scatter_block(inp, out, n, ty, mop, comm, r),
                }
            }
        })?;
        if op == ReduceOp::Avg {
            T::div_by(output, p);
        }
        Ok(())
    }
}

impl CollectiveBackend for MpiBackend {
    fn topology(&self) -> Topology {
        Topology::Mpi {
            ranks: self.t.size(),
        }
    }

    fn transport(&mut self) -> &mut dyn Transport {
        &mut self.t
    }

    fn begin(&mut self, fp: Fingerprint, deadline: std::time::Instant) {
        self.t.begin(fp, deadline);
    }

    fn abort(&mut self, cause: &Error) {
        runtime::abort_with(cause);
    }

    fn all_reduce(&mut self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        with_element!(buf.dtype(), T => self.all_reduce_typed::<T>(buf.typed(), op))
    }

    fn broadcast(&mut self, buf: HostBuf<'_>, root: usize) -> Result<()> {
        let (dt, len) = (buf.dtype(), buf.len());
        let n = self.count(len)?;
        let ptr: *mut c_void = with_element!(dt, T => runtime::recv_ptr(buf.typed::<T>()));
        let (ty, root) = (runtime::datatype(dt), root as c_int);
        self.run("MPI_Bcast", |comm, req| {
            // SAFETY: the buffer outlives the call (completed in `run`, or the job is ended).
            unsafe {
                match req {
                    None => ffi::MPI_Bcast(ptr, n, ty, root, comm),
                    Some(r) => ffi::MPI_Ibcast(ptr, n, ty, root, comm, r),
                }
            }
        })
    }

    fn reduce(&mut self, buf: HostBuf<'_>, op: ReduceOp, root: usize) -> Result<()> {
        with_element!(buf.dtype(), T => self.reduce_typed::<T>(buf.typed(), op, root))
    }

    fn all_gather(&mut self, input: RawHostSlice<'_>, output: HostBuf<'_>) -> Result<()> {
        let (dt, n) = (input.dtype(), input.len());
        flat::check_len("all_gather output", output.len(), n * self.t.size())?;
        let c = self.count(n)?;
        self.count(output.len())?;
        let inp: *const c_void = with_element!(dt, T => runtime::send_ptr(input.typed::<T>()));
        let out: *mut c_void = with_element!(dt, T => runtime::recv_ptr(output.typed::<T>()));
        let ty = runtime::datatype(dt);
        self.run("MPI_Allgather", |comm, req| {
            // SAFETY: buffers outlive the call; `output` holds size × n elements (checked).
            unsafe {
                match req {
                    None => ffi::MPI_Allgather(inp, c, ty, out, c, ty, comm),
                    Some(r) => ffi::MPI_Iallgather(inp, c, ty, out, c, ty, comm, r),
                }
            }
        })
    }

    fn reduce_scatter(
        &mut self,
        input: RawHostSlice<'_>,
        output: HostBuf<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        with_element!(input.dtype(), T => {
            self.reduce_scatter_typed::<T>(input.typed(), output.typed(), op)
        })
    }

    fn gather(
        &mut self,
        input: RawHostSlice<'_>,
        output: Option<HostBuf<'_>>,
        root: usize,
    ) -> Result<()> {
        let (dt, n) = (input.dtype(), input.len());
        let out: *mut c_void = match self.at_root("gather output", root, output, n, |o| o.len())? {
            Some(o) => with_element!(dt, T => runtime::recv_ptr(o.typed::<T>())),
            None => std::ptr::null_mut(),
        };
        let inp: *const c_void = with_element!(dt, T => runtime::send_ptr(input.typed::<T>()));
        self.rooted(
            "MPI_Gather",
            (inp, out),
            dt,
            n,
            root,
            (ffi::MPI_Gather, ffi::MPI_Igather),
        )
    }

    fn scatter(
        &mut self,
        input: Option<RawHostSlice<'_>>,
        output: HostBuf<'_>,
        root: usize,
    ) -> Result<()> {
        let (dt, n) = (output.dtype(), output.len());
        let inp: *const c_void = match self.at_root("scatter input", root, input, n, |i| i.len())? {
            Some(i) => with_element!(dt, T => runtime::send_ptr(i.typed::<T>())),
            None => std::ptr::null(),
        };
        let out: *mut c_void = with_element!(dt, T => runtime::recv_ptr(output.typed::<T>()));
        self.rooted(
            "MPI_Scatter",
            (inp, out),
            dt,
            n,
            root,
            (ffi::MPI_Scatter, ffi::MPI_Iscatter),
        )
    }

    fn all_to_all(&mut self, input: RawHostSlice<'_>, output: HostBuf<'_>) -> Result<()> {
        let (dt, p) = (input.dtype(), self.t.size());
        if !input.len().is_multiple_of(p) {
            return Err(Error::InvalidArgument(format!(
                "all_to_all input has {} elements, not a multiple of the group size {p}",
                input.len()
            )));
        }
        flat::check_len("all_to_all output", output.len(), input.len())?;
        self.count(input.len())?;
        let c = self.count(input.len() / p)?;
        let inp: *const c_void = with_element!(dt, T => runtime::send_ptr(input.typed::<T>()));
        let out: *mut c_void = with_element!(dt, T => runtime::recv_ptr(output.typed::<T>()));
        let ty = runtime::datatype(dt);
        self.run("MPI_Alltoall", |comm, req| {
            // SAFETY: buffers outlive the call; both hold size × c elements (checked).
            unsafe {
                match req {
                    None => ffi::MPI_Alltoall(inp, c, ty, out, c, ty, comm),
                    Some(r) => ffi::MPI_Ialltoall(inp, c, ty, out, c, ty, comm, r),
                }
            }
        })
    }

    fn barrier(&mut self) -> Result<()> {
        // SAFETY: no buffers.
        self.run("MPI_Barrier", |comm, req| unsafe {
            match req {
                None => ffi::MPI_Barrier(comm),
                Some(r) => ffi::MPI_Ibarrier(comm, r),
            }
        })
    }

    fn split(&mut self, members: &[usize]) -> Result<Option<Box<dyn CollectiveBackend>>> {
        self.watched(|b| b.split_watched(members))
    }
}

impl MpiBackend {
    /// [`CollectiveBackend::split`], with the watchdog armed (its calls are blocking).
    fn split_watched(&mut self, members: &[usize]) -> Result<Option<Box<dyn CollectiveBackend>>> {
        let rank = self.t.rank();
        let member = members.contains(&rank);
        // Everyone must be here with the same members (the check covers the count; the split
        // itself is blocking in MPI, so it only starts once every rank has arrived).
        self.check_fingerprints()?;
        let desc = self.describe();
        let what = || desc.clone();
        // SAFETY: reading the library's constant.
        let undefined = unsafe { ffi::RSMPI_UNDEFINED };
        let color = if member { 0 } else { undefined };
        let mut sub = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        let rc = {
            let _g = runtime::lock();
            // SAFETY: a valid communicator; `sub` is written by the call.
            unsafe {
                ffi::MPI_Comm_split(self.t.comm.raw(), color, rank as c_int, sub.as_mut_ptr())
            }
        };
        runtime::check(rc, "MPI_Comm_split", &what)?;
        // SAFETY: MPI_Comm_split succeeded and wrote the handle (MPI_COMM_NULL for non-members).
        let sub = Comm::own_unless_null(unsafe { sub.assume_init() });
        let Some(sub) = sub else {
            return Ok(None);
        };
        let b = MpiBackend::from_parent(
            sub.raw(),
            self.t.timeout,
            self.t.warn_after,
            self.check.is_some(),
        )?;
        drop(sub);
        Ok(Some(Box::new(b)))
    }
}
