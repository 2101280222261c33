//! The message path of an MPI group ([`Transport`]): `send`/`recv` and the algorithms that run
//! over a transport (e.g. `all_gather_bytes`) become `MPI_Isend`/`MPI_Irecv` on the group's
//! communicator. Each message is preceded by the 40-byte header every transport sends (the
//! fingerprint and the payload length), so a receive that meets the wrong send fails with
//! [`Error::Mismatch`] naming both sides instead of reading another operation's bytes.

use super::runtime::{self, Comm, Deadline};
use crate::transport::{
    decode_header, encode_header, Fingerprint, OpKind, RecvFrom, SendTo, Transport, HEADER_LEN,
};
use crate::{DType, Error, Result};
use mpi::ffi;
use std::ffi::c_int;
use std::time::{Duration, Instant};

const MAGIC: u32 = 0xDD9C_0A01;
/// Tag of every point-to-point message (MPI keeps messages between a pair, on one tag, in order).
const TAG: c_int = 0;

/// Point-to-point messages on one communicator, with ddp-comm's fingerprints and deadline.
pub(super) struct MpiTransport {
    pub(super) comm: Comm,
    rank: usize,
    size: usize,
    pub(super) fp: Fingerprint,
    pub(super) deadline: Instant,
    pub(super) timeout: Duration,
    pub(super) warn_after: Option<Duration>,
}

impl MpiTransport {
    pub(super) fn new(comm: Comm, warn_after: Option<Duration>) -> Result<MpiTransport> {
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        {
            let _g = runtime::lock();
            // SAFETY: `comm` is a valid communicator; valid out-pointers.
            unsafe {
                ffi::MPI_Comm_rank(comm.raw(), &mut rank);
                ffi::MPI_Comm_size(comm.raw(), &mut size);
            }
        }
        Ok(MpiTransport {
            comm,
            rank: rank as usize,
            size: size as usize,
            fp: Fingerprint {
                seq: 0,
                op: OpKind::Rendezvous,
                dtype: DType::U8,
                reduce: None,
                count: 0,
                root: Fingerprint::NO_ROOT,
            },
            deadline: Instant::now(),
            timeout: Duration::ZERO,
            warn_after,
        })
    }

    /// `all_reduce(sum, f32 x 1024) #7 on rank 0 of 2`.
    pub(super) fn describe(&self) -> String {
        runtime::describe(&self.fp, self.rank, self.size)
    }

    pub(super) fn deadline<'a>(&self, what: &'a dyn Fn() -> String) -> Deadline<'a> {
        Deadline {
            at: self.deadline,
            timeout: self.timeout,
            warn_after: self.warn_after,
            what,
        }
    }
}

impl Transport for MpiTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn begin(&mut self, fp: Fingerprint, deadline: Instant) {
        self.fp = fp;
        self.deadline = deadline;
        // The group's timeout (to the millisecond: the deadline was computed from it just now).
        let left = deadline.saturating_duration_since(Instant::now());
        self.timeout = Duration::from_millis((left.as_secs_f64() * 1e3).round() as u64);
    }

    fn exchange(&mut self, sends: &mut [SendTo<'_>], recvs: &mut [RecvFrom<'_>]) -> Result<()> {
        let desc = self.describe();
        let what = || desc.clone();
        for p in sends
            .iter()
            .map(|s| s.to)
            .chain(recvs.iter().map(|r| r.from))
        {
            if p >= self.size {
                return Err(Error::InvalidArgument(format!(
                    "{desc}: peer rank {p} is not in this group of size {}",
                    self.size
                )));
            }
        }
        let out_headers: Vec<[u8; HEADER_LEN]> = sends
            .iter()
            .map(|s| encode_header(MAGIC, 0, &self.fp, s.data.len() as u64))
            .collect();
        let mut in_headers = vec![[0u8; HEADER_LEN]; recvs.len()];
        let null = runtime::request_null();
        // Layout: [header recvs][payload recvs][header sends][payload sends].
        let (nr, ns) = (recvs.len(), sends.len());
        let mut reqs = vec![null; 2 * (nr + ns)];
        let mut peer_of = vec![0usize; reqs.len()];
        let comm = self.comm.raw();
        let byte = runtime::datatype(DType::U8);
        let mut rc = ffi::MPI_SUCCESS as c_int;
        {
            let _g = runtime::lock();
            for (i, r) in recvs.iter_mut().enumerate() {
                let n = runtime::count(r.buf.len(), &what)?;
                peer_of[i] = r.from;
                peer_of[nr + i] = r.from;
                // SAFETY: the header and payload buffers live until every request completed
                // (we wait below; on an error the caller ends the job before they are freed).
                unsafe {
                    runtime::keep_first(
                        &mut rc,
                        ffi::MPI_Irecv(
                            in_headers[i].as_mut_ptr().cast(),
                            HEADER_LEN as c_int,
                            byte,
                            r.from as c_int,
                            TAG,
                            comm,
                            &mut reqs[i],
                        ),
                    );
                    runtime::keep_first(
                        &mut rc,
                        ffi::MPI_Irecv(
                            runtime::recv_ptr(r.buf),
                            n,
                            byte,
                            r.from as c_int,
                            TAG,
                            comm,
                            &mut reqs[nr + i],
                        ),
                    );
                }
            }
            for (i, s) in sends.iter().enumerate() {
                let n = runtime::count(s.data.len(), &what)?;
                let (h, p) = (2 * nr + i, 2 * nr + ns + i);
                peer_of[h] = s.to;
                peer_of[p] = s.to;
                // SAFETY: as above; MPI only reads send buffers.
                unsafe {
                    runtime::keep_first(
                        &mut rc,
                        ffi::MPI_Isend(
                            out_headers[i].as_ptr() as *mut _,
                            HEADER_LEN as c_int,
                            byte,
                            s.to as c_int,
                            TAG,
                            comm,
                            &mut reqs[h],
                        ),
                    );
                    runtime::keep_first(
                        &mut rc,
                        ffi::MPI_Isend(
                            runtime::send_ptr(s.data) as *mut _,
                            n,
                            byte,
                            s.to as c_int,
                            TAG,
                            comm,
                            &mut reqs[p],
                        ),
                    );
                }
            }
        }
        runtime::check(rc, "MPI_Isend/MPI_Irecv", &what)?;
        let d = self.deadline(&what);
        // Headers first: they arrive before their payload (MPI keeps the order), and a
        // mismatch must be reported before a payload of the wrong length is.
        runtime::wait(&mut reqs[..nr], &d, &|i| Some(peer_of[i]))?;
        for (h, r) in in_headers.iter().zip(recvs.iter()) {
            let hdr = decode_header(MAGIC, h);
            let (remote, len) = hdr.map_or((None, None), |h| (h.fp, Some(h.len)));
            if remote != Some(self.fp) || len != Some(r.buf.len() as u64) {
                return Err(Error::Mismatch {
                    rank: self.rank,
                    local: self.fp,
                    local_bytes: Some(r.buf.len() as u64),
                    peer: r.from,
                    remote,
                    remote_bytes: len,
                });
            }
        }
        runtime::wait(&mut reqs, &d, &|i| Some(peer_of[i]))
    }

    fn abort(&mut self, _cause: &Error) {
        // The backend ends the job (MPI_Abort); nothing to tell peers here.
    }
}
