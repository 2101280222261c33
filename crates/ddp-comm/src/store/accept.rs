//! The front door of the [`super::StoreServer`]: the accept loops and the greeter.
//!
//! An accept loop admits each new connection under the limits (see `server`; the bookkeeping is `conns`) and hands it to
//! the greeter, which watches every connection that has sent nothing yet with one epoll set and
//! no thread: it answers garbage itself, starts a thread (`serve`) once a plausible `HELLO`
//! arrives, and closes silent connections at the handshake deadline. The accept loops survive
//! running out of descriptors.

use super::conns::{Admission, Phase, Shared, MAX_CONNECTIONS_ENV};
use super::protocol::{ErrorKind, Response};
use super::serve;
use super::sniff::{first_bytes, is_torch_client, FirstBytes};
use super::torch;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Stack size of a connection thread (it only parses frames and touches the map).
const CONN_STACK: usize = 256 << 10;

/// Send `why` as an `ERROR` frame on a connection about to be closed (without blocking), and
/// read what the peer sent so that closing does not reset the connection before it reads it.
fn reject(stream: &TcpStream, why: &str) {
    use rustix::net::{recv, send, RecvFlags, SendFlags};
    let reply = Response::Error {
        kind: ErrorKind::Store,
        message: why.to_string(),
    }
    .encode();
    let mut sink = [0u8; 4096];
    let mut drain = || {
        for _ in 0..4 {
            match recv(stream, &mut sink[..], RecvFlags::DONTWAIT) {
                Ok((n, _)) if n > 0 => {}
                _ => break,
            }
        }
    };
    drain();
    let _ = send(stream, &reply, SendFlags::DONTWAIT | SendFlags::NOSIGNAL);
    let _ = stream.shutdown(Shutdown::Write);
    drain();
}

fn is_out_of_fds(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Whether a connection waits in the accept queue (waits up to 100 ms for one).
fn connection_waiting(listener: &TcpListener) -> bool {
    use rustix::event::{poll, PollFd, PollFlags, Timespec};
    let mut fds = [PollFd::new(listener, PollFlags::IN)];
    let timeout = Timespec {
        tv_sec: 0,
        tv_nsec: 100_000_000,
    };
    matches!(poll(&mut fds, Some(&timeout)), Ok(n) if n > 0)
}

/// A descriptor held in reserve, so that the accept loop can still accept (and refuse) one
/// connection when the process is out of descriptors.
fn reserve_fd() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

pub(super) fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut reserve = reserve_fd();
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(x) => x,
            // Drop shuts the listener down, which fails accept().
            Err(_) if shared.conns().shutdown => return,
            Err(e) if is_out_of_fds(&e) => {
                // accept() fails with EMFILE even when no connection is waiting: act only when
                // one is, and otherwise wait for one (or for the descriptors to free up).
                if !connection_waiting(&listener) {
                    continue;
                }
                let fds = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
                let limit = fds.map_or("unlimited".to_string(), |n| n.to_string());
                let evicted = shared.conns().evict_oldest_pending();
                let still_open = matches!(evicted, Some((_, false)));
                let evicted = evicted.map(|(peer, _)| peer);
                shared.log_accept.warn(shared.local_addr, || {
                    format!(
                        "store accept failed: {e} (this process's descriptor limit, ulimit -n, \
                         is {limit}); {}; raise the limit or lower {MAX_CONNECTIONS_ENV}",
                        match evicted {
                            Some(p) => format!("closed the pending connection from {p}"),
                            None => "refusing new connections".to_string(),
                        }
                    )
                });
                if evicted.is_none() {
                    // Free the reserve to accept one connection and refuse it, so the backlog
                    // moves and the client learns why instead of timing out.
                    drop(reserve.take());
                    if let Ok((s, _)) = listener.accept() {
                        refuse(
                            s,
                            &format!(
                                "the store's host is out of file descriptors (ulimit -n is \
                                 {limit}); raise it or lower {MAX_CONNECTIONS_ENV} there"
                            ),
                        );
                    }
                    reserve = reserve_fd();
                }
                // Give the closed connection's thread time to release its descriptor.
                if still_open {
                    std::thread::sleep(Duration::from_millis(5));
                }
                continue;
            }
            Err(e) => {
                // Transient (aborted handshake, ...): back off briefly and retry.
                shared
                    .log_accept
                    .warn(shared.local_addr, || format!("store accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
        };
        if reserve.is_none() {
            reserve = reserve_fd();
        }
        let (id, stream) = match shared.admit(stream, peer) {
            Admission::Serve(id, stream) => (id, stream),
            Admission::ShuttingDown => return,
            Admission::Refuse(stream, why) => {
                shared.log_limit.warn(shared.local_addr, || {
                    format!("store refuses a connection from {peer}: {why}")
                });
                refuse(stream, &why);
                continue;
            }
        };
        // No thread yet: the greeter starts one when the first bytes arrive.
        use rustix::event::epoll;
        let watched = epoll::add(
            &shared.poller,
            &*stream,
            epoll::EventData::new_u64(id),
            epoll::EventFlags::IN | epoll::EventFlags::RDHUP,
        );
        if let Err(e) = watched {
            shared.conns().forget(id);
            shared.log_accept.warn(shared.local_addr, || {
                format!("store cannot watch the connection from {peer}: {e}")
            });
        }
    }
}

/// Watches the connections that have sent nothing yet: starts a thread for each one whose
/// first bytes arrive, drops the ones that hung up, and closes the ones past the handshake
/// deadline. An idle connection thus costs one descriptor and no thread.
pub(super) fn greeter(shared: &Arc<Shared>) {
    use rustix::event::{epoll, Timespec};
    let mut events: Vec<epoll::Event> = Vec::with_capacity(256);
    let tick = Timespec {
        tv_sec: 0,
        tv_nsec: 100_000_000,
    };
    let mut last_sweep = Instant::now();
    loop {
        events.clear();
        let _ = epoll::wait(
            &shared.poller,
            rustix::buffer::spare_capacity(&mut events),
            Some(&tick),
        );
        if shared.conns().shutdown {
            return;
        }
        // Under the lock only bookkeeping; threads start after it is released, so the accept
        // loop never waits for a thread to be created.
        let mut greeted = Vec::new();
        {
            let mut c = shared.conns();
            for ev in &events {
                let id = ev.data.u64();
                let Some(e) = c.map.get_mut(&id) else {
                    continue;
                };
                if e.phase != Phase::Connected {
                    continue;
                }
                let verdict = first_bytes(&e.stream);
                if matches!(verdict, FirstBytes::NotYet) {
                    continue;
                }
                let _ = epoll::delete(&shared.poller, &*e.stream);
                match verdict {
                    FirstBytes::NotYet => unreachable!(),
                    FirstBytes::HungUp => {
                        c.forget(id);
                        continue;
                    }
                    FirstBytes::Garbage(why) => {
                        // Answered here, without a thread: floods of junk cost little.
                        reject(&e.stream, &why);
                        let peer = e.peer;
                        c.forget(id);
                        shared.log_handshake.warn(shared.local_addr, || {
                            format!("store drops the connection from {peer}: {why}")
                        });
                        continue;
                    }
                    FirstBytes::Plausible => {}
                }
                e.phase = Phase::Greeted;
                let until = e.since + shared.limits.handshake_timeout;
                greeted.push((id, Arc::clone(&e.stream), e.peer, until));
            }
        }
        let mut handles = Vec::with_capacity(greeted.len());
        for (id, stream, peer, until) in greeted {
            let _ = stream.set_nodelay(true);
            let conn_shared = Arc::clone(shared);
            let spawned = std::thread::Builder::new()
                .name(format!("ddp-store-conn-{id}"))
                .stack_size(CONN_STACK)
                .spawn(move || {
                    if is_torch_client(&stream, until) {
                        torch::serve_connection(&stream, peer, &conn_shared, id, until);
                    } else {
                        serve::serve_connection(&stream, peer, &conn_shared, id, until);
                    }
                    conn_shared.conns().forget(id);
                });
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(err) => {
                    if let Some(e) = shared.conns().forget(id) {
                        e.close();
                    }
                    shared.log_accept.warn(shared.local_addr, || {
                        format!("store cannot start a thread for {peer}: {err}")
                    });
                }
            }
        }
        if !handles.is_empty() {
            let mut c = shared.conns();
            let live = c.pending + c.authenticated;
            if c.threads.len() > 2 * live + 64 {
                c.threads.retain(|t| !t.is_finished());
            }
            c.threads.extend(handles);
        }
        if last_sweep.elapsed() >= Duration::from_millis(100) {
            last_sweep = Instant::now();
            let timeout = shared.limits.handshake_timeout;
            let mut c = shared.conns();
            let late: Vec<u64> = c
                .map
                .iter()
                .filter(|(_, e)| e.phase == Phase::Connected && e.since.elapsed() >= timeout)
                .map(|(id, _)| *id)
                .collect();
            let n = late.len();
            let first = late.first().and_then(|id| c.map.get(id)).map(|e| e.peer);
            for id in late {
                if let Some(e) = c.forget(id) {
                    e.close();
                }
            }
            drop(c);
            if let Some(peer) = first {
                shared.log_handshake.warn(shared.local_addr, || {
                    format!(
                        "store drops {n} connection(s) (first from {peer}) that sent nothing \
                         within the {timeout:?} handshake deadline"
                    )
                });
            }
        }
    }
}

/// Answer a connection the server will not serve with an `ERROR` frame, then close it without
/// a reset (so the client reads the reason): drain what it sent, send, shut down writing.
fn refuse(stream: TcpStream, why: &str) {
    let _ = stream.set_nonblocking(true);
    let mut s = &stream;
    let mut sink = [0u8; 1024];
    let drain = |s: &mut &TcpStream, sink: &mut [u8]| {
        for _ in 0..8 {
            match s.read(sink) {
                Ok(n) if n > 0 => {}
                _ => break,
            }
        }
    };
    drain(&mut s, &mut sink);
    let reply = Response::Error {
        kind: ErrorKind::Store,
        message: why.to_string(),
    };
    let _ = s.write_all(&reply.encode());
    let _ = stream.shutdown(Shutdown::Write);
    drain(&mut s, &mut sink);
}
