//! The MPI backend (feature `mpi`, `DDP_BACKEND=mpi`): a group's collectives run on the MPI
//! library the job was launched with (`mpirun`/`srun`), so clusters get their fabric
//! (InfiniBand, RoCE, Omni-Path through UCX or libfabric) without a transport of ours.
//!
//! ```text
//!  ProcessGroup ──jobs──▶ engine thread ──▶ MpiBackend
//!                                            ├ fingerprint check: MPI_Iallreduce(max) of [fp, !fp]
//!                                            │   on a twin communicator, overlapped with ──┐
//!                                            ├ the collective: MPI_Iallreduce, MPI_Ibcast, │
//!                                            │   MPI_Ireduce, MPI_Iallgather, ...          │
//!                                            │   MPI_Ireduce_scatter_block, MPI_Igather,   │
//!                                            │   MPI_Iscatter, MPI_Ialltoall, MPI_Ibarrier │
//!                                            ├ runtime::wait: MPI_Testall until done or ◀──┘
//!                                            │   the deadline (then MPI_Abort: never a hang)
//!                                            └ MpiTransport: send/recv = MPI_Isend/MPI_Irecv
//!                                                with our 40-byte header (fingerprint, length)
//! ```
//!
//! - The default group is `MPI_COMM_WORLD` (duplicated, so our traffic never meets the
//!   program's own); rank and world size come from MPI, no store is needed. Subgroups are
//!   `MPI_Comm_split` of their parent ([`CollectiveBackend::split`]).
//! - Every collective is non-blocking (`MPI_I*`) and completed on the group's communication
//!   thread by polling `MPI_Testall` against ddp-comm's deadline: MPI has no timeouts, so a
//!   collective a peer never joins fails with [`Error::Timeout`] naming it and its sequence
//!   number, and the job then ends with `MPI_Abort` (a pending MPI collective cannot be
//!   cancelled, and its buffers must not be freed). A peer that dies is normally reported by
//!   `mpirun` itself, which ends the job.
//! - `f16`/`bf16` reductions are widened to `f32`, reduced as `MPI_FLOAT` and rounded once, as
//!   on every other backend (the same bits as `tcp`/`shm`); a 16-bit user-defined op would halve
//!   the bytes but round after every pairwise step. Other collectives move their bits as
//!   `uint16_t`.
//! - Mismatched collectives: before each collective, its [`Fingerprint`] (sequence number, op,
//!   dtype, reduce op, count, root) is reduced with `MPI_MAX` together with its complement on a
//!   second communicator; ranks that disagree see `max != mine` and learn who differs from an
//!   `MPI_Iallgather` of the fingerprints ([`Error::Mismatch`], naming both sides). The check
//!   is overlapped with the collective; its cost is measured by `ddp-bench allreduce --backend
//!   mpi` against raw `MPI_Allreduce` (README) and it can be turned off with
//!   `DDP_MPI_FINGERPRINTS=0`.

mod runtime;
mod transport;

use super::{flat, with_element, CollectiveBackend, HostBuf, HostSlice, Topology};
use crate::dtype::{Element, ReduceOp};
use crate::transport::{Fingerprint, OpKind, Transport};
use crate::{Error, Result};
use mpi::ffi;
use runtime::Comm;
use std::ffi::{c_int, c_void};
use std::time::Duration;
use transport::MpiTransport;

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
        })
    }

    fn describe(&self) -> String {
        self.t.describe()
    }

    /// Run one collective: start the fingerprint check (when on), start the collective with
    /// `start`, then check the fingerprints and complete the collective under the deadline.
    fn run(
        &mut self,
        call: &str,
        start: impl FnOnce(ffi::MPI_Comm, &mut ffi::MPI_Request) -> c_int,
    ) -> Result<()> {
        let desc = self.describe();
        let what = || desc.clone();
        let mut check_req = self.start_check(&what)?;
        let mut req = runtime::request_null();
        let rc = {
            let _g = runtime::lock();
            start(self.t.comm.raw(), &mut req)
        };
        if let Some(r) = check_req.as_mut() {
            self.finish_check(r, &what)?;
        }
        runtime::check(rc, call, &what)?;
        runtime::wait(
            std::slice::from_mut(&mut req),
            &self.t.deadline(&what),
            &|_| None,
        )
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

    fn start_check(&mut self, what: &dyn Fn() -> String) -> Result<Option<ffi::MPI_Request>> {
        let Some(check) = &self.check else {
            return Ok(None);
        };
        if self.t.size() == 1 || self.t.fp.op == OpKind::SendRecv {
            return Ok(None);
        }
        let w = Self::words(&self.t.fp);
        *self.fp_words = [w[0], w[1], w[2], !w[0], !w[1], !w[2]];
        let mut req = runtime::request_null();
        let rc = {
            let _g = runtime::lock();
            // SAFETY: `fp_words` is boxed (stable address) and lives in self until the request
            // completed in `finish_check` (or the job is ended).
            unsafe {
                ffi::MPI_Iallreduce(
                    runtime::in_place(),
                    self.fp_words.as_mut_ptr().cast(),
                    6,
                    ffi::RSMPI_UINT64_T,
                    ffi::RSMPI_MAX,
                    check.raw(),
                    &mut req,
                )
            }
        };
        runtime::check(rc, "MPI_Iallreduce (fingerprint check)", what)?;
        Ok(Some(req))
    }

    /// Wait for the check; on a disagreement, find and name a rank that issued something else.
    fn finish_check(
        &mut self,
        req: &mut ffi::MPI_Request,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        let d = self.t.deadline(what);
        runtime::wait(std::slice::from_mut(req), &d, &|_| None)?;
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
        let mut req = runtime::request_null();
        let rc = {
            let _g = runtime::lock();
            // SAFETY: `mine` and `all` live until the request completed (waited below).
            unsafe {
                ffi::MPI_Iallgather(
                    mine.as_ptr() as *mut c_void,
                    3,
                    ffi::RSMPI_UINT64_T,
                    all.as_mut_ptr().cast(),
                    3,
                    ffi::RSMPI_UINT64_T,
                    check,
                    &mut req,
                )
            }
        };
        runtime::check(rc, "MPI_Iallgather (fingerprint check)", what)?;
        runtime::wait(std::slice::from_mut(&mut req), &d, &|_| None)?;
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
        self.run("MPI_Iallreduce", |comm, req| {
            // SAFETY: `buf` outlives the request (completed in `run`, or the job is ended).
            unsafe {
                ffi::MPI_Iallreduce(
                    runtime::in_place(),
                    ptr,
                    n,
                    runtime::datatype(T::DTYPE),
                    runtime::op_of(op),
                    comm,
                    req,
                )
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
        self.run("MPI_Ireduce", |comm, req| {
            let (send, recv) = if is_root {
                (runtime::in_place(), ptr)
            } else {
                (ptr, std::ptr::null_mut())
            };
            // SAFETY: as in all_reduce; non-roots' recv buffer is not significant.
            unsafe {
                ffi::MPI_Ireduce(
                    send,
                    recv,
                    n,
                    runtime::datatype(T::DTYPE),
                    runtime::op_of(op),
                    root as c_int,
                    comm,
                    req,
                )
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
        self.run("MPI_Ireduce_scatter_block", |comm, req| {
            // SAFETY: `input` and `output` outlive the request; sizes checked above.
            unsafe {
                ffi::MPI_Ireduce_scatter_block(
                    inp,
                    out,
                    n,
                    runtime::datatype(T::DTYPE),
                    runtime::op_of(op),
                    comm,
                    req,
                )
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
        eprintln!(
            "ddp-comm (backend mpi): {cause}; ending the job with MPI_Abort (MPI cannot cancel \
             a pending collective)"
        );
        runtime::abort_job(self.t.comm.raw());
    }

    fn all_reduce(&mut self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        with_element!(buf.dtype(), T => self.all_reduce_typed::<T>(buf.typed(), op))
    }

    fn broadcast(&mut self, buf: HostBuf<'_>, root: usize) -> Result<()> {
        let (dt, len) = (buf.dtype(), buf.len());
        let n = self.count(len)?;
        let ptr: *mut c_void = with_element!(dt, T => runtime::recv_ptr(buf.typed::<T>()));
        self.run("MPI_Ibcast", |comm, req| {
            // SAFETY: the buffer outlives the request (completed in `run`, or the job is ended).
            unsafe { ffi::MPI_Ibcast(ptr, n, runtime::datatype(dt), root as c_int, comm, req) }
        })
    }

    fn reduce(&mut self, buf: HostBuf<'_>, op: ReduceOp, root: usize) -> Result<()> {
        with_element!(buf.dtype(), T => self.reduce_typed::<T>(buf.typed(), op, root))
    }

    fn all_gather(&mut self, input: HostSlice<'_>, output: HostBuf<'_>) -> Result<()> {
        let (dt, n) = (input.dtype(), input.len());
        flat::check_len("all_gather output", output.len(), n * self.t.size())?;
        let c = self.count(n)?;
        self.count(output.len())?;
        let inp: *const c_void = with_element!(dt, T => runtime::send_ptr(input.typed::<T>()));
        let out: *mut c_void = with_element!(dt, T => runtime::recv_ptr(output.typed::<T>()));
        let ty = runtime::datatype(dt);
        self.run("MPI_Iallgather", |comm, req| {
            // SAFETY: buffers outlive the request; `output` holds size × n elements (checked).
            unsafe { ffi::MPI_Iallgather(inp, c, ty, out, c, ty, comm, req) }
        })
    }

    fn reduce_scatter(
        &mut self,
        input: HostSlice<'_>,
        output: HostBuf<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        with_element!(input.dtype(), T => {
            self.reduce_scatter_typed::<T>(input.typed(), output.typed(), op)
        })
    }

    fn gather(
        &mut self,
        input: HostSlice<'_>,
        output: Option<HostBuf<'_>>,
        root: usize,
    ) -> Result<()> {
        let (dt, n) = (input.dtype(), input.len());
        let out: *mut c_void = if self.t.rank() == root {
            let o = output.ok_or_else(|| {
                Error::InvalidArgument("gather: the root must pass an output buffer".into())
            })?;
            flat::check_len("gather output", o.len(), n * self.t.size())?;
            self.count(o.len())?;
            with_element!(dt, T => runtime::recv_ptr(o.typed::<T>()))
        } else {
            std::ptr::null_mut()
        };
        let c = self.count(n)?;
        let inp: *const c_void = with_element!(dt, T => runtime::send_ptr(input.typed::<T>()));
        let ty = runtime::datatype(dt);
        self.run("MPI_Igather", |comm, req| {
            // SAFETY: buffers outlive the request; the root's output holds size × n (checked).
            unsafe { ffi::MPI_Igather(inp, c, ty, out, c, ty, root as c_int, comm, req) }
        })
    }

    fn scatter(
        &mut self,
        input: Option<HostSlice<'_>>,
        output: HostBuf<'_>,
        root: usize,
    ) -> Result<()> {
        let (dt, n) = (output.dtype(), output.len());
        let inp: *const c_void = if self.t.rank() == root {
            let i = input.ok_or_else(|| {
                Error::InvalidArgument("scatter: the root must pass an input buffer".into())
            })?;
            flat::check_len("scatter input", i.len(), n * self.t.size())?;
            self.count(i.len())?;
            with_element!(dt, T => runtime::send_ptr(i.typed::<T>()))
        } else {
            std::ptr::null()
        };
        let c = self.count(n)?;
        let out: *mut c_void = with_element!(dt, T => runtime::recv_ptr(output.typed::<T>()));
        let ty = runtime::datatype(dt);
        self.run("MPI_Iscatter", |comm, req| {
            // SAFETY: buffers outlive the request; the root's input holds size × n (checked).
            unsafe { ffi::MPI_Iscatter(inp, c, ty, out, c, ty, root as c_int, comm, req) }
        })
    }

    fn all_to_all(&mut self, input: HostSlice<'_>, output: HostBuf<'_>) -> Result<()> {
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
        self.run("MPI_Ialltoall", |comm, req| {
            // SAFETY: buffers outlive the request; both hold size × c elements (checked).
            unsafe { ffi::MPI_Ialltoall(inp, c, ty, out, c, ty, comm, req) }
        })
    }

    fn barrier(&mut self) -> Result<()> {
        // SAFETY: no buffers.
        self.run("MPI_Ibarrier", |comm, req| unsafe {
            ffi::MPI_Ibarrier(comm, req)
        })
    }

    fn split(&mut self, members: &[usize]) -> Result<Option<Box<dyn CollectiveBackend>>> {
        let rank = self.t.rank();
        let member = members.contains(&rank);
        let desc = self.describe();
        let what = || desc.clone();
        // Everyone must be here with the same members (the check covers the count; the split
        // itself is blocking in MPI, so it only starts once every rank has arrived).
        if let Some(mut r) = self.start_check(&what)? {
            self.finish_check(&mut r, &what)?;
        }
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
