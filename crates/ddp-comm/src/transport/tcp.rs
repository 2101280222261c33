//! TCP transport: a full mesh of connections, one per pair of ranks, with `TCP_NODELAY`.
//!
//! Setup ([`TcpTransport::connect_mesh`]): every rank listens on an ephemeral port and publishes
//! `ip:port` under `addr/{rank}` in the store; rank `r` connects to every lower rank and accepts a
//! connection from every higher one. The connector sends a hello (`magic, rank, world size`), the
//! acceptor answers with an ack or a refusal text (e.g. a world-size mismatch), so a
//! misconfigured job fails at init on both sides with a message naming the ranks.
//!
//! Data moves in frames, each starting with the transports' common 40-byte header (see
//! `HEADER_LEN` in the parent module); `kind` is data or abort (an abort frame's payload is the UTF-8 reason). The receiver checks
//! the header against its own [`Fingerprint`] before trusting the payload. Sockets are
//! non-blocking; [`Transport::exchange`] drives all sends and receives of one step with
//! `writev`/`readv` and `poll(2)`, so a ring step never deadlocks and a closed socket, an abort
//! or the deadline ends the step with an error naming the peer.
//!
//! The address a rank publishes is the one it reaches the store from, or that of the interface
//! named by `DDP_SOCKET_IFNAME` ([`interface_ip`]).

use super::stall::StallWarning;
use super::{
    decode_header, encode_header, Fingerprint, OpKind, RecvFrom, SendTo, Transport, HEADER_LEN,
};
use crate::dtype::DType;
use crate::store::Store;
use crate::{Error, Result};
use std::io::{IoSlice, IoSliceMut};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::time::{Duration, Instant};

const FRAME_MAGIC: u32 = 0xDD9C_0001;
const HELLO_MAGIC: u32 = 0xDD9C_0AAA;
const KIND_DATA: u8 = 0;
const KIND_ABORT: u8 = 1;
/// Largest single `writev`/`readv`: moving a big message in slices of this size, alternating
/// between sending and receiving, keeps the data cache-resident between the two copies of the
/// loopback path (`docs/benchmarks.md`, "Collectives").
const IO_CAP: usize = 256 * 1024;
/// Busy-poll iterations (each yields the CPU) before sleeping in `poll(2)`: keeps
/// small-message latency low without starving other ranks when cores are oversubscribed.
const SPIN_ITERS: u32 = 2000;

struct Peer {
    stream: TcpStream,
    fd: RawFd,
    /// A frame was partly written when an operation failed: the stream can't carry an abort frame.
    dirty: bool,
}

/// One rank's end of a TCP full mesh.
pub struct TcpTransport {
    rank: usize,
    size: usize,
    peers: Vec<Option<Peer>>,
    fp: Fingerprint,
    deadline: Instant,
    timeout: Duration,
    stall: StallWarning,
}

/// Progress of one send within an exchange.
struct FrameSend {
    header: [u8; HEADER_LEN],
    done: usize,
    total: usize,
}

/// Progress of one receive within an exchange.
struct FrameRecv {
    header: [u8; HEADER_LEN],
    done: usize,
    total: usize,
    checked: bool,
}

impl TcpTransport {
    /// Build the mesh among `size` ranks through `store` (already namespaced for this group).
    /// `local_ip` is the address peers use to reach this process.
    pub fn connect_mesh(
        store: &dyn Store,
        rank: usize,
        size: usize,
        local_ip: IpAddr,
        timeout: Duration,
    ) -> Result<TcpTransport> {
        let deadline = Instant::now() + timeout;
        let listener = TcpListener::bind(SocketAddr::new(
            if local_ip.is_loopback() {
                local_ip
            } else {
                IpAddr::from([0, 0, 0, 0])
            },
            0,
        ))
        .map_err(|e| Error::io("cannot open a listening socket for peer connections", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| Error::io("listener address", e))?
            .port();
        store.set(
            &format!("addr/{rank}"),
            format!("{local_ip}:{port}").as_bytes(),
        )?;

        let mut peers: Vec<Option<Peer>> = (0..size).map(|_| None).collect();
        // Connect to every lower rank.
        for (peer, slot) in peers.iter_mut().enumerate().take(rank) {
            let key = format!("addr/{peer}");
            let remaining = deadline.saturating_duration_since(Instant::now());
            let addr = store.get_timeout(&key, remaining).map_err(|e| {
                e.waiting_for(|| format!("rank {peer} to join the rendezvous (world size {size})"))
            })?;
            let addr = String::from_utf8_lossy(&addr).to_string();
            let stream = connect_with_retry(&addr, deadline)
                .map_err(|e| Error::io(format!("cannot connect to rank {peer} at {addr}"), e))?;
            let mut stream = stream;
            stream
                .set_read_timeout(Some(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                ))
                .ok();
            let mut hello = Vec::with_capacity(12);
            hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
            hello.extend_from_slice(&(rank as u32).to_le_bytes());
            hello.extend_from_slice(&(size as u32).to_le_bytes());
            stream
                .write_all(&hello)
                .map_err(|e| Error::io(format!("handshake with rank {peer} at {addr}"), e))?;
            let mut len = [0u8; 4];
            stream.read_exact(&mut len).map_err(|e| {
                Error::io(
                    format!("handshake with rank {peer} at {addr} (no answer)"),
                    e,
                )
            })?;
            let len = u32::from_le_bytes(len) as usize;
            if len > 0 {
                let mut msg = vec![0u8; len.min(4096)];
                stream.read_exact(&mut msg).ok();
                return Err(Error::Config(format!(
                    "rank {peer} refused this rank ({rank}): {}",
                    String::from_utf8_lossy(&msg)
                )));
            }
            *slot = Some(Peer::new(stream)?);
        }
        // Accept every higher rank.
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("listener", e))?;
        let mut missing: Vec<usize> = (rank + 1..size).collect();
        while !missing.is_empty() {
            let (mut stream, from) = match listener.accept() {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(Error::Timeout {
                            what: format!(
                                "rank(s) {missing:?} to connect to rank {rank} (world size {size})"
                            ),
                            timeout,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(2));
                    continue;
                }
                Err(e) => return Err(Error::io("accepting a peer connection", e)),
            };
            stream.set_nonblocking(false).ok();
            stream.set_read_timeout(Some(Duration::from_secs(10))).ok();
            let mut hello = [0u8; 12];
            if stream.read_exact(&mut hello).is_err()
                || u32::from_le_bytes(hello[0..4].try_into().unwrap()) != HELLO_MAGIC
            {
                tracing::warn!("ignoring a connection from {from} that is not a ddp-rs peer");
                continue;
            }
            let peer = u32::from_le_bytes(hello[4..8].try_into().unwrap()) as usize;
            let peer_size = u32::from_le_bytes(hello[8..12].try_into().unwrap()) as usize;
            let refusal = if peer_size != size {
                Some(format!(
                    "world size mismatch: rank {peer} was started with world size {peer_size}, rank {rank} with {size}"
                ))
            } else if !missing.contains(&peer) {
                Some(format!(
                    "rank {peer} connected twice or is out of range (world size {size}): two processes were given the same rank?"
                ))
            } else {
                None
            };
            if let Some(msg) = refusal {
                let _ = stream.write_all(&(msg.len() as u32).to_le_bytes());
                let _ = stream.write_all(msg.as_bytes());
                return Err(Error::Config(msg));
            }
            stream
                .write_all(&0u32.to_le_bytes())
                .map_err(|e| Error::io(format!("handshake with rank {peer}"), e))?;
            missing.retain(|&m| m != peer);
            peers[peer] = Some(Peer::new(stream)?);
        }
        Ok(TcpTransport {
            rank,
            size,
            peers,
            fp: Fingerprint {
                seq: 0,
                op: OpKind::Rendezvous,
                dtype: DType::U8,
                reduce: None,
                count: 0,
                root: Fingerprint::NO_ROOT,
            },
            deadline,
            timeout,
            stall: StallWarning::default(),
        })
    }

    /// Log a warning when a collective waits `every` for its peers, and again every `every`
    /// (`None`: never; see [`super::stall`]).
    pub fn set_warn_after(&mut self, every: Option<Duration>) {
        self.stall = StallWarning::new(every, None);
    }

    fn peer(&self, r: usize) -> Result<&Peer> {
        self.peers.get(r).and_then(|p| p.as_ref()).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "rank {r} is not a peer of rank {} (world size {})",
                self.rank, self.size
            ))
        })
    }

    fn fail(&self, peer: usize, reason: impl Into<String>) -> Error {
        Error::PeerFailed {
            peer,
            fingerprint: self.fp,
            reason: reason.into(),
        }
    }

    fn io_fail(&self, peer: usize, e: &std::io::Error) -> Error {
        use std::io::ErrorKind::*;
        match e.kind() {
            ConnectionReset | BrokenPipe | ConnectionAborted | UnexpectedEof => self.fail(
                peer,
                "closed its connection (process died or left the group)",
            ),
            _ => self.fail(peer, format!("connection failed: {e}")),
        }
    }

    /// Read the rest of an abort frame's reason text (best effort, short timeout).
    fn read_abort_reason(&self, from: usize, prefix: &[u8], len: usize) -> String {
        let mut msg = prefix[..prefix.len().min(len)].to_vec();
        if let Ok(p) = self.peer(from) {
            let mut s = &p.stream;
            let until = Instant::now() + Duration::from_millis(200);
            let mut chunk = [0u8; 512];
            while msg.len() < len.min(64 * 1024) && Instant::now() < until {
                match s.read(&mut chunk[..(len - msg.len()).min(512)]) {
                    Ok(0) => break,
                    Ok(n) => msg.extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(1))
                    }
                    Err(_) => break,
                }
            }
        }
        String::from_utf8_lossy(&msg).into_owned()
    }

    fn check_header(&self, from: usize, st: &FrameRecv, buf: &[u8]) -> Result<()> {
        let h = decode_header(FRAME_MAGIC, &st.header)
            .ok_or_else(|| self.fail(from, "sent a corrupt frame (protocol violation)"))?;
        if h.kind == KIND_ABORT {
            let got = st.done.saturating_sub(HEADER_LEN).min(buf.len());
            let reason = self.read_abort_reason(from, &buf[..got], h.len as usize);
            return Err(self.fail(from, format!("aborted the group: {reason}")));
        }
        let remote =
            h.fp.ok_or_else(|| self.fail(from, "sent a frame with an unknown operation code"))?;
        if remote != self.fp || h.len != buf.len() as u64 {
            return Err(Error::Mismatch {
                rank: self.rank,
                local: self.fp,
                local_bytes: Some(buf.len() as u64),
                peer: from,
                remote: Some(remote),
                remote_bytes: Some(h.len),
            });
        }
        Ok(())
    }
}

impl Peer {
    fn new(stream: TcpStream) -> Result<Peer> {
        stream
            .set_nodelay(true)
            .map_err(|e| Error::io("TCP_NODELAY", e))?;
        stream.set_read_timeout(None).ok();
        stream
            .set_nonblocking(true)
            .map_err(|e| Error::io("non-blocking socket", e))?;
        let fd = stream.as_raw_fd();
        Ok(Peer {
            stream,
            fd,
            dirty: false,
        })
    }
}

fn connect_with_retry(addr: &str, deadline: Instant) -> std::io::Result<TcpStream> {
    loop {
        match TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// `writev` of the unsent part of `header ++ data`. Returns bytes written or the error.
fn writev2(fd: impl AsFd, a: &[u8], b: &[u8]) -> std::io::Result<usize> {
    Ok(rustix::io::writev(fd, &[IoSlice::new(a), IoSlice::new(b)])?)
}

/// `readv` into the unread part of `header ++ buf`. Returns bytes read (0 = peer closed).
fn readv2(fd: impl AsFd, a: &mut [u8], b: &mut [u8]) -> std::io::Result<usize> {
    Ok(rustix::io::readv(
        fd,
        &mut [IoSliceMut::new(a), IoSliceMut::new(b)],
    )?)
}

impl Transport for TcpTransport {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn begin(&mut self, fp: Fingerprint, deadline: Instant) {
        self.fp = fp;
        self.deadline = deadline;
        self.stall.start();
    }

    fn exchange(&mut self, sends: &mut [SendTo<'_>], recvs: &mut [RecvFrom<'_>]) -> Result<()> {
        let mut sst: Vec<FrameSend> = sends
            .iter()
            .map(|s| FrameSend {
                header: encode_header(FRAME_MAGIC, KIND_DATA, &self.fp, s.data.len() as u64),
                done: 0,
                total: HEADER_LEN + s.data.len(),
            })
            .collect();
        let mut rst: Vec<FrameRecv> = recvs
            .iter()
            .map(|r| FrameRecv {
                header: [0; HEADER_LEN],
                done: 0,
                total: HEADER_LEN + r.buf.len(),
                checked: false,
            })
            .collect();
        for s in sends.iter() {
            self.peer(s.to)?;
        }
        for r in recvs.iter() {
            self.peer(r.from)?;
        }
        let mut idle: u32 = 0;
        let mut pollfds: Vec<libc::pollfd> = Vec::new();
        loop {
            let mut progress = false;
            let mut pending = false;
            for (s, st) in sends.iter().zip(sst.iter_mut()) {
                if st.done == st.total {
                    continue;
                }
                let fd = &self.peer(s.to)?.stream;
                let (h, d) = if st.done < HEADER_LEN {
                    (&st.header[st.done..], s.data)
                } else {
                    (&st.header[..0], &s.data[st.done - HEADER_LEN..])
                };
                let d = &d[..d.len().min(IO_CAP)];
                match writev2(fd, h, d) {
                    Ok(n) => {
                        if n > 0 {
                            progress = true;
                            st.done += n;
                            if let Some(p) = self.peers[s.to].as_mut() {
                                p.dirty = st.done < st.total;
                            }
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(self.io_fail(s.to, &e)),
                }
                if st.done < st.total {
                    pending = true;
                }
            }
            for (r, st) in recvs.iter_mut().zip(rst.iter_mut()) {
                if st.done == st.total {
                    continue;
                }
                let fd = &self.peer(r.from)?.stream;
                let res = if st.done < HEADER_LEN {
                    let cap = r.buf.len().min(IO_CAP);
                    readv2(fd, &mut st.header[st.done..], &mut r.buf[..cap])
                } else {
                    let rest = &mut r.buf[st.done - HEADER_LEN..];
                    let cap = rest.len().min(IO_CAP);
                    readv2(fd, &mut [], &mut rest[..cap])
                };
                match res {
                    Ok(0) => {
                        return Err(self.fail(
                            r.from,
                            "closed its connection (process died or left the group)",
                        ))
                    }
                    Ok(n) => {
                        progress = true;
                        st.done += n;
                        if !st.checked && st.done >= HEADER_LEN {
                            st.checked = true;
                            self.check_header(r.from, st, r.buf)?;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(self.io_fail(r.from, &e)),
                }
                if st.done < st.total {
                    pending = true;
                }
            }
            if !pending {
                return Ok(());
            }
            if progress {
                idle = 0;
                continue;
            }
            idle += 1;
            if idle < SPIN_ITERS {
                std::thread::yield_now();
                continue;
            }
            // Nothing moved for a while: sleep in poll(2) until a socket is ready or the deadline.
            let waiting = || -> Vec<usize> {
                recvs
                    .iter()
                    .zip(&rst)
                    .filter(|(_, st)| st.done < st.total)
                    .map(|(r, _)| r.from)
                    .chain(
                        sends
                            .iter()
                            .zip(&sst)
                            .filter(|(_, st)| st.done < st.total)
                            .map(|(s, _)| s.to),
                    )
                    .collect()
            };
            self.stall.check(&self.fp, self.rank, self.timeout, waiting);
            let now = Instant::now();
            if now >= self.deadline {
                let waiting = waiting();
                let peer = waiting.first().copied().unwrap_or(self.rank);
                return Err(self.fail(
                    peer,
                    format!(
                        "did not answer within the timeout of {:?} (stalled, deadlocked, or issuing other collectives); waiting on rank(s) {waiting:?}",
                        self.timeout
                    ),
                ));
            }
            pollfds.clear();
            for (s, st) in sends.iter().zip(&sst) {
                if st.done < st.total {
                    pollfds.push(libc::pollfd {
                        fd: self.peer(s.to)?.fd,
                        events: libc::POLLOUT,
                        revents: 0,
                    });
                }
            }
            for (r, st) in recvs.iter().zip(&rst) {
                if st.done < st.total {
                    pollfds.push(libc::pollfd {
                        fd: self.peer(r.from)?.fd,
                        events: libc::POLLIN | libc::POLLRDHUP,
                        revents: 0,
                    });
                }
            }
            let wait_ms = (self.deadline - now).as_millis().clamp(1, 1000) as i32;
            // SAFETY: pollfds is a valid array of pollfd for the duration of the call.
            unsafe { libc::poll(pollfds.as_mut_ptr(), pollfds.len() as libc::nfds_t, wait_ms) };
            idle = SPIN_ITERS / 2;
        }
    }

    fn abort(&mut self, cause: &Error) {
        let reason = format!("rank {}: {}", self.rank, cause.root_cause());
        let header = encode_header(FRAME_MAGIC, KIND_ABORT, &self.fp, reason.len() as u64);
        for p in self.peers.iter_mut().flatten() {
            if !p.dirty {
                let until = Instant::now() + Duration::from_millis(100);
                let mut done = 0;
                let total = HEADER_LEN + reason.len();
                while done < total && Instant::now() < until {
                    let (h, d) = if done < HEADER_LEN {
                        (&header[done..], reason.as_bytes())
                    } else {
                        (&header[..0], &reason.as_bytes()[done - HEADER_LEN..])
                    };
                    match writev2(&p.stream, h, d) {
                        Ok(n) => done += n,
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_micros(200))
                        }
                        Err(_) => break,
                    }
                }
            }
            let _ = p.stream.shutdown(std::net::Shutdown::Both);
            p.dirty = true;
        }
    }
}

/// The address of network interface `name`: its first IPv4 address, else its first IPv6
/// address that is not link-local. The error names the interfaces this host has.
pub fn interface_ip(name: &str) -> Result<IpAddr> {
    let mut names = Vec::new();
    let mut v6 = None;
    let mut ifap: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills a list we walk read-only and free once with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut ifap) } != 0 {
        return Err(Error::io(
            "listing network interfaces",
            std::io::Error::last_os_error(),
        ));
    }
    let mut found = None;
    let mut cur = ifap;
    while !cur.is_null() {
        // SAFETY: a node of the list from getifaddrs; name is a C string, addr may be null.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        // SAFETY: `ifa_name` of a getifaddrs node is a NUL-terminated C string.
        let ifname = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }.to_string_lossy();
        if !names.contains(&ifname.to_string()) {
            names.push(ifname.to_string());
        }
        if ifname != name || ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: the family says which sockaddr type the pointer refers to.
        match i32::from(unsafe { (*ifa.ifa_addr).sa_family }) {
            libc::AF_INET => {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                found = Some(IpAddr::from(
                    u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
                ));
                break;
            }
            libc::AF_INET6 if v6.is_none() => {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                let ip = std::net::Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                if !ip.is_unicast_link_local() {
                    v6 = Some(IpAddr::V6(ip));
                }
            }
            _ => {}
        }
    }
    // SAFETY: the list from the successful getifaddrs above, freed once.
    unsafe { libc::freeifaddrs(ifap) };
    found.or(v6).ok_or_else(|| {
        Error::Config(format!(
            "DDP_SOCKET_IFNAME={name:?}: no network interface of that name with an IP address \
             (this host has: {})",
            names.join(", ")
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interface_addresses_are_found_and_unknown_names_listed() {
        assert_eq!(interface_ip("lo").unwrap(), IpAddr::from([127, 0, 0, 1]));
        let e = interface_ip("no-such-if0").unwrap_err().to_string();
        assert!(
            e.contains("no-such-if0") && e.contains("this host has: ") && e.contains("lo"),
            "{e}"
        );
    }
}
