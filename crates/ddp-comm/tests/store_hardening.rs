//! The store under hostile conditions, over real sockets and processes: the secret never
//! crosses the wire, the client checks the server, old clients get a clear error, handshakes
//! have a deadline, connections are bounded (pending ones evicted first, the limit named), and a
//! flood of idle and garbage connections against a server with a low descriptor limit (a child
//! process) neither takes it down nor delays a legitimate join by more than a second.

use ddp_comm::store::{ServerOptions, Store, StoreOptions, StoreServer, TcpStore};
use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[path = "common/alone.rs"]
mod alone;
#[path = "common/bounded.rs"]
mod bounded;
use bounded::bounded;

const SECRET: &str = "correct horse battery staple";

fn opts(secret: Option<&str>) -> StoreOptions {
    StoreOptions {
        secret: secret.map(str::to_string),
        timeout: Duration::from_secs(20),
        connect_timeout: Duration::from_secs(5),
    }
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

/// Read one frame body; `None` if the connection closed (or failed) first.
fn read_body(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut header = [0u8; 4];
    s.read_exact(&mut header).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(header) as usize];
    s.read_exact(&mut body).ok()?;
    Some(body)
}

/// Whether the peer has closed `s` (EOF or reset), waiting at most `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return !matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                )
            }
        }
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// A TCP proxy to `target` recording every byte in both directions; serves `n` connections.
fn recording_proxy(target: String, n: usize) -> (String, Arc<Mutex<Vec<u8>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let wire = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&wire);
    std::thread::spawn(move || {
        for _ in 0..n {
            let Ok((down, _)) = listener.accept() else {
                return;
            };
            let up = TcpStream::connect(&target).unwrap();
            for (mut from, mut to) in [
                (down.try_clone().unwrap(), up.try_clone().unwrap()),
                (up, down),
            ] {
                let log = Arc::clone(&log);
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    loop {
                        match from.read(&mut buf) {
                            Ok(0) | Err(_) => break,
                            Ok(k) => {
                                log.lock().unwrap().extend_from_slice(&buf[..k]);
                                if to.write_all(&buf[..k]).is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = to.shutdown(Shutdown::Write);
                });
            }
        }
    });
    (addr, wire)
}

#[test]
fn the_secret_never_crosses_the_wire() {
    bounded(Duration::from_secs(30), || {
        let server = StoreServer::bind("127.0.0.1:0", Some(SECRET.into())).unwrap();
        let (proxy, wire) = recording_proxy(server.local_addr().to_string(), 2);
        let good = TcpStore::connect(&proxy, opts(Some(SECRET))).unwrap();
        good.set("proxied-key", b"proxied-value").unwrap();
        assert_eq!(good.get("proxied-key").unwrap(), b"proxied-value");
        let wrong = "wrong horse battery staple";
        let err = TcpStore::connect(&proxy, opts(Some(wrong))).unwrap_err();
        assert!(
            err.to_string().contains("wrong or missing shared secret"),
            "{err}"
        );
        drop(good);
        std::thread::sleep(Duration::from_millis(200));
        let wire = wire.lock().unwrap();
        // The capture works: it holds the handshake magic and the data.
        assert!(contains(&wire, b"DDPS") && contains(&wire, b"proxied-value"));
        assert!(
            !contains(&wire, SECRET.as_bytes()),
            "the secret went over the wire"
        );
        assert!(
            !contains(&wire, wrong.as_bytes()),
            "a wrong secret went over the wire"
        );
        assert!(
            !contains(&wire, b"horse"),
            "part of a secret went over the wire"
        );
    });
}

#[test]
fn the_client_refuses_a_server_that_cannot_prove_the_secret() {
    bounded(Duration::from_secs(30), || {
        // A fake store: challenges the client, takes its proof, then "welcomes" it with junk.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let fake = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let hello = read_body(&mut s).expect("a hello");
            assert_eq!(&hello[..5], b"\x01DDPS");
            let mut challenge = vec![0x88];
            challenge.extend_from_slice(&32u32.to_le_bytes());
            challenge.extend_from_slice(&[3u8; 32]);
            s.write_all(&frame(&challenge)).unwrap();
            let auth = read_body(&mut s).expect("a proof");
            assert_eq!(auth[0], 0x0a, "AUTH");
            let mut welcome = vec![0x89];
            welcome.extend_from_slice(&32u32.to_le_bytes());
            welcome.extend_from_slice(&[0u8; 32]);
            s.write_all(&frame(&welcome)).unwrap();
            let _ = closed_within(&mut s, Duration::from_secs(5));
        });
        let err = TcpStore::connect(&addr, opts(Some(SECRET))).unwrap_err();
        assert!(
            err.to_string()
                .contains("could not prove that it knows the shared secret"),
            "{err}"
        );
        fake.join().unwrap();
    });
}

#[test]
fn an_old_client_gets_a_version_error_not_a_hang() {
    bounded(Duration::from_secs(30), || {
        let server = StoreServer::bind("127.0.0.1:0", Some(SECRET.into())).unwrap();
        // Protocol version 1's HELLO: magic, version 1, the secret in plain text.
        let mut hello = vec![0x01];
        hello.extend_from_slice(b"DDPS");
        hello.extend_from_slice(&1u16.to_le_bytes());
        hello.extend_from_slice(&(SECRET.len() as u32).to_le_bytes());
        hello.extend_from_slice(SECRET.as_bytes());
        let mut s = TcpStream::connect(server.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let start = Instant::now();
        s.write_all(&frame(&hello)).unwrap();
        let reply = read_body(&mut s).expect("an error reply within 2 s");
        assert_eq!(reply[0], 0x87, "ERROR");
        let text = String::from_utf8_lossy(&reply);
        assert!(
            text.contains("protocol version mismatch: the store speaks v2, this client v1"),
            "{text}"
        );
        assert!(closed_within(&mut s, Duration::from_secs(2)));
        assert!(start.elapsed() < Duration::from_secs(2));
    });
}

#[test]
fn silent_and_dripping_connections_are_dropped_after_the_handshake_deadline() {
    bounded(Duration::from_secs(40), || {
        let server = StoreServer::bind("127.0.0.1:0", Some(SECRET.into())).unwrap();
        let addr = server.local_addr();
        let start = Instant::now();
        let mut silent = TcpStream::connect(addr).unwrap();
        let mut drip = TcpStream::connect(addr).unwrap();
        // One byte of a frame header every 300 ms: each read alone is quick, the whole is not.
        let mut dripper = drip.try_clone().unwrap();
        let drip_thread = std::thread::spawn(move || {
            for b in [0x30u8, 0, 0, 0].iter().cycle().take(60) {
                if dripper.write_all(&[*b]).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        });
        assert!(closed_within(&mut silent, Duration::from_secs(15)));
        let silent_after = start.elapsed();
        assert!(closed_within(&mut drip, Duration::from_secs(15)));
        let drip_after = start.elapsed();
        drip_thread.join().unwrap();
        for (what, t) in [("silent", silent_after), ("dripping", drip_after)] {
            assert!(
                t >= Duration::from_secs(4) && t < Duration::from_secs(9),
                "{what} connection closed after {t:?}, expected the 5 s handshake deadline"
            );
        }
        // The server still serves.
        let c = TcpStore::connect(&addr.to_string(), opts(Some(SECRET))).unwrap();
        c.set("alive", b"1").unwrap();
    });
}

#[test]
fn pending_connections_make_room_and_the_limit_is_named() {
    bounded(Duration::from_secs(30), || {
        let server = StoreServer::bind_with(
            "127.0.0.1:0",
            ServerOptions {
                secret: Some(SECRET.into()),
                max_connections: Some(4),
                max_pending: Some(2),
                ..ServerOptions::default()
            },
        )
        .unwrap();
        assert_eq!(server.max_connections(), 4);
        let addr = server.local_addr().to_string();
        let join = || TcpStore::connect(&addr, opts(Some(SECRET)));
        let a = join().unwrap();
        let _b = join().unwrap();
        let mut idle1 = TcpStream::connect(&addr).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let mut idle2 = TcpStream::connect(&addr).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        // Two pending already: the oldest makes room for c.
        let _c = join().unwrap();
        assert!(
            closed_within(&mut idle1, Duration::from_secs(2)),
            "oldest idle evicted"
        );
        // 3 authenticated + 1 pending = the limit: the pending one makes room for d.
        let _d = join().unwrap();
        assert!(
            closed_within(&mut idle2, Duration::from_secs(2)),
            "idle evicted for d"
        );
        // 4 authenticated: nobody is evicted, the newcomer is told why.
        let err = join().unwrap_err().to_string();
        assert!(
            err.contains("connection limit")
                && err.contains("4 connections")
                && err.contains("DDP_STORE_MAX_CONNECTIONS"),
            "{err}"
        );
        // The authenticated ones keep working, and a freed slot is usable again.
        a.set("k", b"v").unwrap();
        drop(a);
        let deadline = Instant::now() + Duration::from_secs(5);
        let e = loop {
            match join() {
                Ok(e) => break e,
                Err(err) if Instant::now() < deadline => {
                    assert!(err.to_string().contains("connection limit"), "{err}");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(err) => panic!("no slot freed: {err}"),
            }
        };
        assert_eq!(e.get("k").unwrap(), b"v");
    });
}

// ---- A store server in a child process with a low descriptor limit ----

const CHILD_ENV: &str = "DDP_TEST_STORE_CHILD_FD_LIMIT";

/// Not a test of its own: the body of the child process of the tests below (they run this test
/// binary again with [`CHILD_ENV`] set). Without it, it does nothing.
#[test]
fn store_server_child_process() {
    let Ok(limit) = std::env::var(CHILD_ENV) else {
        return;
    };
    let limit: u64 = limit.parse().unwrap();
    use rustix::process::{setrlimit, Resource, Rlimit};
    // Hard and soft, so that the server's own attempt to raise it changes nothing.
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: Some(limit),
            maximum: Some(limit),
        },
    )
    .unwrap();
    // The connection limit comes from DDP_STORE_MAX_CONNECTIONS, set by the parent.
    let server = StoreServer::bind("127.0.0.1:0", Some(SECRET.into())).unwrap();
    println!(
        "STORE_ADDR={} MAX={}",
        server.local_addr(),
        server.max_connections()
    );
    std::io::stdout().flush().unwrap();
    // Serve until the parent closes our stdin (or at most two minutes).
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        let _ = tx.send(());
    });
    let _ = rx.recv_timeout(Duration::from_secs(120));
}

struct ChildServer {
    child: Child,
    stdin: Option<ChildStdin>,
    addr: String,
    max: usize,
}

impl ChildServer {
    fn start(fd_limit: u64, max_connections: usize) -> ChildServer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "store_server_child_process", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(CHILD_ENV, fd_limit.to_string())
            .env("DDP_STORE_MAX_CONNECTIONS", max_connections.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        // libtest may print "test NAME ... " on the same line first.
        let line = lines
            .find_map(|l| {
                let l = l.ok()?;
                Some(l[l.find("STORE_ADDR=")?..].to_string())
            })
            .expect("the child prints its address");
        // Keep reading (and discarding) the child's output, so it never writes to a closed pipe.
        std::thread::spawn(move || lines.for_each(drop));
        let mut parts = line.split_whitespace();
        let addr = parts.next().unwrap()["STORE_ADDR=".len()..].to_string();
        let max = parts.next().unwrap()["MAX=".len()..].parse().unwrap();
        ChildServer {
            child,
            stdin,
            addr,
            max,
        }
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if !self.alive() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Connect, set, get: the whole of what a joining rank first does. Returns the time it took.
fn legit_join(addr: &str, i: usize) -> Duration {
    let start = Instant::now();
    let s = TcpStore::connect(addr, opts(Some(SECRET))).unwrap();
    let key = format!("join/{i}");
    s.set(&key, b"here").unwrap();
    assert_eq!(s.get(&key).unwrap(), b"here");
    start.elapsed()
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
fn a_flood_of_idle_and_garbage_connections_does_not_delay_a_legitimate_join() {
    bounded(Duration::from_secs(120), || {
        // The flood holds thousands of connections on this side.
        ddp_comm::store::raise_fd_limit();
        let mut child = ChildServer::start(256, 100);
        assert_eq!(child.max, 100);
        let addr = child.addr.clone();
        let baseline: Vec<Duration> = (0..5).map(|i| legit_join(&addr, i)).collect();

        // The flood runs until the joins are done; the count only bounds it if they stall. Each
        // flooder is paced (a fast machine opened all 40 000 before the ten joins were done, and
        // unpaced it would also exhaust the ephemeral ports the legitimate joins need).
        const FLOOD: usize = 40_000;
        const PER_THREAD_PER_SEC: f64 = 2_000.0;
        const HELD_PER_THREAD: usize = 300;
        let stop = Arc::new(AtomicBool::new(false));
        let opened = Arc::new(AtomicUsize::new(0));
        let evicted = Arc::new(AtomicUsize::new(0));
        let mut flooders = Vec::new();
        for t in 0..3 {
            let (stop, opened, evicted, addr) = (
                Arc::clone(&stop),
                Arc::clone(&opened),
                Arc::clone(&evicted),
                addr.clone(),
            );
            flooders.push(std::thread::spawn(move || {
                use rand::{Rng, SeedableRng};
                let mut rng = rand::rngs::StdRng::seed_from_u64(t);
                let target = addr.parse().unwrap();
                let mut held: VecDeque<TcpStream> = VecDeque::new();
                let began = Instant::now();
                let mut mine = 0usize;
                while !stop.load(Ordering::Relaxed) && opened.load(Ordering::Relaxed) < FLOOD {
                    if mine as f64 > began.elapsed().as_secs_f64() * PER_THREAD_PER_SEC {
                        std::thread::sleep(Duration::from_millis(1));
                        continue;
                    }
                    mine += 1;
                    let Ok(mut s) = TcpStream::connect_timeout(&target, Duration::from_secs(2))
                    else {
                        continue;
                    };
                    opened.fetch_add(1, Ordering::Relaxed);
                    if t == 2 {
                        // Garbage: random bytes, a 4 GiB header, or a wrong proof-less hello.
                        let junk: Vec<u8> = match rng.gen_range(0..3) {
                            0 => (0..rng.gen_range(1..512)).map(|_| rng.gen()).collect(),
                            1 => u32::MAX.to_le_bytes().to_vec(),
                            _ => b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
                        };
                        let _ = s.write_all(&junk);
                        continue;
                    }
                    // Idle: hold it, dropping the oldest (noting if the server had closed it).
                    held.push_back(s);
                    if held.len() > HELD_PER_THREAD {
                        let old = held.pop_front().unwrap();
                        old.set_nonblocking(true).unwrap();
                        if matches!((&old).read(&mut [0u8; 1]), Ok(0)) {
                            evicted.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }));
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while opened.load(Ordering::Relaxed) < 1000 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let opened_before_joins = opened.load(Ordering::Relaxed);
        let mut during = Vec::new();
        for i in 0..10 {
            if opened.load(Ordering::Relaxed) >= FLOOD {
                break;
            }
            during.push(legit_join(&addr, 100 + i));
            std::thread::sleep(Duration::from_millis(100));
        }
        let opened_during_joins = opened.load(Ordering::Relaxed) - opened_before_joins;
        let flood_open_during_joins = opened.load(Ordering::Relaxed) < FLOOD;
        stop.store(true, Ordering::Relaxed);
        for f in flooders {
            f.join().unwrap();
        }
        let total = opened.load(Ordering::Relaxed);
        let baseline_max = *baseline.iter().max().unwrap();
        eprintln!(
            "flood: {total} connections, {opened_during_joins} of them during the joins ({} idle \
             ones seen evicted); legit join: baseline median {:?} max {baseline_max:?}, during \
             the flood median {:?} max {:?} (all: {during:?})",
            evicted.load(Ordering::Relaxed),
            median(baseline.clone()),
            median(during.clone()),
            during.iter().max().unwrap(),
        );
        assert!(child.alive(), "the server process died");
        assert!(total >= 2000, "the flood opened only {total} connections");
        assert!(
            during.len() == 10 && flood_open_during_joins && opened_during_joins >= 1000,
            "joins did not overlap the flood"
        );
        assert!(
            evicted.load(Ordering::Relaxed) > 0,
            "the server never evicted an idle one"
        );
        // "Not delayed by more than a second": against a baseline taken on this (possibly
        // loaded) machine just before the flood.
        for d in &during {
            assert!(
                *d < baseline_max + Duration::from_secs(1),
                "a join took {d:?} during the flood, {baseline_max:?} before it"
            );
        }

        // After the flood: fill the limit with authenticated clients; the next one is told the
        // limit, and the server is still up.
        let mut clients = Vec::new();
        let err = loop {
            match TcpStore::connect(&addr, opts(Some(SECRET))) {
                Ok(c) => clients.push(c),
                Err(e) => break e.to_string(),
            }
            assert!(clients.len() <= 100, "more clients than the limit of 100");
        };
        assert!(
            clients.len() >= 90,
            "refused after {} clients: {err}",
            clients.len()
        );
        assert!(
            err.contains("connection limit: 100 connections")
                && err.contains("DDP_STORE_MAX_CONNECTIONS"),
            "{err}"
        );
        clients.truncate(10);
        std::thread::sleep(Duration::from_millis(300));
        legit_join(&addr, 1000);
        assert!(child.alive());
    });
}

#[test]
fn running_out_of_descriptors_is_survived_and_named() {
    // Exhausting a server's descriptors is timing-sensitive next to the floods of this binary's
    // other tests: run alone.
    if !alone::in_own_process("running_out_of_descriptors_is_survived_and_named") {
        return;
    }
    bounded(Duration::from_secs(60), || {
        // A connection limit above the descriptor limit: the process runs out of descriptors
        // first, and the accept loop must live through EMFILE.
        let mut child = ChildServer::start(64, 1000);
        let addr = child.addr.clone();
        let mut clients = Vec::new();
        let err = loop {
            match TcpStore::connect(&addr, opts(Some(SECRET))) {
                Ok(c) => clients.push(c),
                Err(e) => break e.to_string(),
            }
            assert!(clients.len() < 64, "more connections than descriptors");
        };
        assert!(
            err.contains("out of file descriptors") && err.contains("ulimit -n is 64"),
            "after {} clients: {err}",
            clients.len()
        );
        assert!(child.alive());
        // Freeing descriptors lets clients in again, once the server has seen the closes (it
        // may take a while when other tests load the machine: poll, bounded).
        let n = clients.len();
        clients.truncate(n / 2);
        let deadline = Instant::now() + Duration::from_secs(20);
        let join = || -> Result<(), String> {
            let s = TcpStore::connect(&addr, opts(Some(SECRET))).map_err(|e| e.to_string())?;
            s.set("join/0", b"here").map_err(|e| e.to_string())?;
            assert_eq!(s.get("join/0").map_err(|e| e.to_string())?, b"here");
            Ok(())
        };
        while let Err(e) = join() {
            assert!(e.contains("out of file descriptors"), "{e}");
            assert!(
                Instant::now() < deadline,
                "still refused 20 s after freeing {} clients: {e}",
                n - n / 2
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(child.alive());
    });
}

#[test]
fn a_write_past_the_byte_cap_is_refused_and_the_server_serves_on() {
    bounded(Duration::from_secs(60), || {
        const CAP: u64 = 1 << 20;
        let server = StoreServer::bind_with(
            "127.0.0.1:0",
            ServerOptions {
                max_bytes: Some(CAP),
                ..ServerOptions::default()
            },
        )
        .unwrap();
        assert_eq!(server.max_bytes(), CAP);
        let addr = server.local_addr().to_string();
        let a = TcpStore::connect(&addr, opts(None)).unwrap();
        let b = TcpStore::connect(&addr, opts(None)).unwrap();
        let big = vec![7u8; 600 << 10];
        a.set("first", &big).unwrap();
        // 2 × 600 KiB > 1 MiB: refused, with the cap and how to raise it named.
        let e = a.set("second", &big).unwrap_err().to_string();
        assert!(
            e.contains(&format!("cap of {CAP} bytes")) && e.contains("DDP_STORE_MAX_BYTES"),
            "{e}"
        );
        assert!(e.contains("--store-max-bytes"), "{e}");
        // Nothing of the refused write was kept; the same client and the others go on.
        assert!(!a.check("second").unwrap());
        assert_eq!(a.get("first").unwrap(), big);
        b.set("small", b"1").unwrap();
        assert_eq!(b.add("counter", 5).unwrap(), 5);
        assert!(
            b.compare_set("second", b"", &big).is_err(),
            "compare_set is capped too"
        );
        // Space given back by a delete can be used again.
        assert!(a.delete("first").unwrap());
        a.set("second", &big).unwrap();
        assert_eq!(b.get("second").unwrap(), big);
    });
}

#[test]
fn the_byte_cap_comes_from_its_environment_variable() {
    // In a child process, so that the variable cannot reach the other tests' servers.
    match std::env::var("STORE_CAP_CHILD").as_deref() {
        Ok("valid") => {
            let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
            assert_eq!(server.max_bytes(), 12345);
            let c = TcpStore::connect(&server.local_addr().to_string(), opts(None)).unwrap();
            let e = c.set("k", &[0u8; 20000]).unwrap_err().to_string();
            assert!(e.contains("cap of 12345 bytes"), "{e}");
            return;
        }
        Ok(_) => {
            let e = StoreServer::bind("127.0.0.1:0", None)
                .unwrap_err()
                .to_string();
            assert!(e.contains("DDP_STORE_MAX_BYTES=\"lots\""), "{e}");
            return;
        }
        Err(_) => {}
    }
    let default = StoreServer::bind("127.0.0.1:0", None).unwrap();
    if std::env::var_os("DDP_STORE_MAX_BYTES").is_none() {
        assert_eq!(default.max_bytes(), ddp_comm::store::DEFAULT_MAX_BYTES);
    }
    for (mode, value) in [("valid", "12345"), ("invalid", "lots")] {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "the_byte_cap_comes_from_its_environment_variable",
                "--nocapture",
            ])
            .env("STORE_CAP_CHILD", mode)
            .env("DDP_STORE_MAX_BYTES", value)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{mode}: {text}{err}");
        assert!(text.contains("1 passed"), "{mode}: {text}");
    }
}

#[test]
fn a_timeout_on_many_keys_names_a_few_and_counts_the_rest() {
    bounded(Duration::from_secs(30), || {
        let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
        let c = TcpStore::connect(&server.local_addr().to_string(), opts(None)).unwrap();
        let keys: Vec<String> = (0..100_000).map(|r| format!("members/{r}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let e = c
            .wait(&refs, Duration::from_millis(100))
            .unwrap_err()
            .to_string();
        assert!(e.len() < 600, "{} bytes: {e:.300}", e.len());
        assert!(e.contains("\"members/0\", \"members/1\""), "{e}");
        assert!(e.contains(" and 99984 more]"), "{e}");
    });
}
