//! End-to-end tests of the rendezvous store over real sockets: concurrency, blocking semantics,
//! shared-secret authentication, hostile input, port conflicts, server death, prefixes.
//!
//! Every test runs under [`bounded`], so a hang fails the test instead of stalling CI.

use ddp_comm::store::{PrefixStore, Store, StoreOptions, StoreServer, TcpStore};
use ddp_comm::Error;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

#[path = "common/bounded.rs"]
mod bounded;
use bounded::bounded;

fn opts(secret: Option<&str>) -> StoreOptions {
    StoreOptions {
        secret: secret.map(str::to_string),
        timeout: Duration::from_secs(20),
        connect_timeout: Duration::from_secs(5),
    }
}

fn server(secret: Option<&str>) -> (StoreServer, String) {
    let server = StoreServer::bind("127.0.0.1:0", secret.map(str::to_string)).unwrap();
    let addr = server.local_addr().to_string();
    (server, addr)
}

fn client(addr: &str) -> TcpStore {
    TcpStore::connect(addr, opts(None)).unwrap()
}

const T: Duration = Duration::from_secs(30);

#[test]
fn concurrent_adds_from_many_clients_sum_exactly() {
    bounded(T, || {
        let (_server, addr) = server(None);
        const THREADS: usize = 16;
        const ADDS: i64 = 200;
        let barrier = Arc::new(Barrier::new(THREADS));
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let addr = addr.clone();
                let barrier = Arc::clone(&barrier);
                std::thread::spawn(move || {
                    let store = client(&addr);
                    barrier.wait();
                    let mut last = 0;
                    for _ in 0..ADDS {
                        let v = store.add("counter", 1).unwrap();
                        assert!(v > last, "add results must increase per client");
                        last = v;
                        store.add(&format!("per-thread/{t}"), 2).unwrap();
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let store = client(&addr);
        let total = THREADS as i64 * ADDS;
        assert_eq!(store.add("counter", 0).unwrap(), total);
        // Counters are stored as decimal text, like PyTorch.
        assert_eq!(
            store.get("counter").unwrap(),
            total.to_string().into_bytes()
        );
        for t in 0..THREADS {
            assert_eq!(store.add(&format!("per-thread/{t}"), 0).unwrap(), 2 * ADDS);
        }
        assert_eq!(store.num_keys().unwrap(), THREADS as u64 + 1);
    });
}

#[test]
fn concurrent_set_and_get_through_one_shared_client() {
    bounded(T, || {
        let (_server, addr) = server(None);
        // One connection shared by 8 threads for immediate operations...
        let shared = Arc::new(client(&addr));
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let store = Arc::clone(&shared);
                // ...and one connection per thread for blocking reads of the others' keys
                // (a blocking get occupies its connection).
                let own = shared.try_clone().unwrap();
                std::thread::spawn(move || {
                    for i in 0..100 {
                        let key = format!("k/{t}/{i}");
                        let value = format!("value {t} {i}").into_bytes();
                        store.set(&key, &value).unwrap();
                        assert_eq!(store.get(&key).unwrap(), value);
                        assert!(store.check(&key).unwrap());
                        let other = format!("k/{}/{i}", (t + 1) % 8);
                        let got = own.get(&other).unwrap();
                        assert_eq!(got, format!("value {} {i}", (t + 1) % 8).into_bytes());
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(shared.num_keys().unwrap(), 800);
    });
}

#[test]
fn blocking_get_is_satisfied_by_a_later_set_from_another_client() {
    bounded(T, || {
        let (_server, addr) = server(None);
        let waiter = client(&addr);
        let setter = client(&addr);
        let start = Instant::now();
        let h = std::thread::spawn(move || waiter.get("rdzv/addr/1").unwrap());
        std::thread::sleep(Duration::from_millis(300));
        assert!(!h.is_finished(), "get must block while the key is missing");
        setter.set("rdzv/addr/1", b"10.0.0.2:4000").unwrap();
        assert_eq!(h.join().unwrap(), b"10.0.0.2:4000");
        assert!(start.elapsed() < Duration::from_secs(5));

        // wait() on several keys is released when the last one appears.
        let waiter = client(&addr);
        let h = std::thread::spawn(move || waiter.wait(&["a", "b"], Duration::from_secs(20)));
        setter.set("a", b"1").unwrap();
        std::thread::sleep(Duration::from_millis(200));
        assert!(!h.is_finished(), "wait must block until every key exists");
        setter.add("b", 5).unwrap();
        h.join().unwrap().unwrap();
    });
}

#[test]
fn get_and_wait_time_out_naming_the_missing_keys() {
    bounded(T, || {
        let (_server, addr) = server(None);
        let store = client(&addr);
        let timeout = Duration::from_millis(400);
        let start = Instant::now();
        let err = store.get_timeout("rdzv/addr/2", timeout).unwrap_err();
        let elapsed = start.elapsed();
        assert!(elapsed >= timeout, "returned early: {elapsed:?}");
        assert!(
            elapsed < timeout + Duration::from_secs(2),
            "too late: {elapsed:?}"
        );
        match &err {
            Error::Timeout { what, timeout: t } => {
                assert_eq!(*t, timeout);
                assert!(what.contains("\"rdzv/addr/2\""), "{what}");
            }
            other => panic!("expected a timeout, got {other}"),
        }
        assert_eq!(
            err.to_string(),
            "timed out after 400ms waiting for store key(s) [\"rdzv/addr/2\"]"
        );

        store.set("present", b"x").unwrap();
        let err = store
            .wait(
                &["present", "missing/1", "missing/2"],
                Duration::from_millis(200),
            )
            .unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("[\"missing/1\", \"missing/2\"]") && !msg.contains("present"),
            "{msg}"
        );

        // Zero timeout: an immediate answer either way.
        assert!(matches!(
            store.get_timeout("nope", Duration::ZERO),
            Err(Error::Timeout { .. })
        ));
        assert_eq!(store.get_timeout("present", Duration::ZERO).unwrap(), b"x");
        store.wait(&[], Duration::ZERO).unwrap();

        // The connection is still healthy after timeouts.
        assert_eq!(store.get("present").unwrap(), b"x");

        // The store's default timeout applies to get().
        let mut short = client(&addr);
        short.set_timeout(Duration::from_millis(100));
        assert_eq!(short.timeout(), Duration::from_millis(100));
        assert!(
            matches!(short.get("nope"), Err(Error::Timeout { timeout, .. }) if timeout == Duration::from_millis(100))
        );
    });
}

#[test]
fn compare_set_delete_num_keys_and_check() {
    bounded(T, || {
        let (_server, addr) = server(None);
        let store = client(&addr);

        // Missing key, non-empty expected: nothing happens, the key stays missing.
        assert_eq!(store.compare_set("cas", b"old", b"new").unwrap(), b"");
        assert!(!store.check("cas").unwrap());
        // Missing key, empty expected: set.
        assert_eq!(store.compare_set("cas", b"", b"first").unwrap(), b"first");
        // Mismatch: unchanged, current value returned.
        assert_eq!(
            store.compare_set("cas", b"other", b"second").unwrap(),
            b"first"
        );
        // Match: swapped.
        assert_eq!(
            store.compare_set("cas", b"first", b"second").unwrap(),
            b"second"
        );
        assert_eq!(store.get("cas").unwrap(), b"second");

        // compare_set wakes a blocked get.
        let waiter = client(&addr);
        let h = std::thread::spawn(move || waiter.get("cas2"));
        std::thread::sleep(Duration::from_millis(100));
        store.compare_set("cas2", b"", b"v").unwrap();
        assert_eq!(h.join().unwrap().unwrap(), b"v");

        assert_eq!(store.num_keys().unwrap(), 2);
        assert!(store.check("cas").unwrap());
        assert!(store.delete("cas").unwrap());
        assert!(!store.delete("cas").unwrap());
        assert!(!store.check("cas").unwrap());
        assert_eq!(store.num_keys().unwrap(), 1);

        // Empty values and binary values are fine.
        store.set("empty", b"").unwrap();
        assert!(store.check("empty").unwrap());
        assert_eq!(store.get("empty").unwrap(), b"");
        let binary: Vec<u8> = (0..=255u8).collect();
        store.set("bin", &binary).unwrap();
        assert_eq!(store.get("bin").unwrap(), binary);

        // A large value (8 MiB) round-trips.
        let big: Vec<u8> = (0..8 << 20).map(|i| (i % 251) as u8).collect();
        store.set("big", &big).unwrap();
        assert_eq!(store.get("big").unwrap(), big);
    });
}

#[test]
fn add_on_a_non_integer_names_the_key_and_keeps_the_value() {
    bounded(T, || {
        let (_server, addr) = server(None);
        let store = client(&addr);
        store.set("word", b"hello").unwrap();
        let err = store.add("word", 1).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("\"word\"") && msg.contains("not an integer"),
            "{msg}"
        );
        assert_eq!(store.get("word").unwrap(), b"hello");

        store.set("big", i64::MAX.to_string().as_bytes()).unwrap();
        let err = store.add("big", 1).unwrap_err();
        assert!(err.to_string().contains("overflow"), "{err}");

        // A counter set by hand as text is usable.
        store.set("n", b"41").unwrap();
        assert_eq!(store.add("n", 1).unwrap(), 42);
        assert_eq!(store.add("fresh", -3).unwrap(), -3);
    });
}

#[test]
fn wrong_or_missing_secret_is_refused_and_others_keep_working() {
    bounded(T, || {
        let (_server, addr) = server(Some("correct horse"));

        let good = TcpStore::connect(&addr, opts(Some("correct horse"))).unwrap();
        good.set("before", b"1").unwrap();

        for bad in [
            Some("wrong"),
            None,
            Some("correct hors"),
            Some("correct horse!"),
        ] {
            let err = TcpStore::connect(&addr, opts(bad)).unwrap_err();
            match &err {
                Error::Store { addr: a, message } => {
                    assert_eq!(a, &addr);
                    assert_eq!(
                        message,
                        "refused this client: wrong or missing shared secret (DDP_STORE_SECRET)"
                    );
                }
                other => panic!("expected a refusal for {bad:?}, got {other}"),
            }
        }

        // The established client and a new one with the right secret still work.
        assert_eq!(good.get("before").unwrap(), b"1");
        let another = TcpStore::connect(&addr, opts(Some("correct horse"))).unwrap();
        another.set("after", b"2").unwrap();
        assert_eq!(good.get("after").unwrap(), b"2");
        assert_eq!(another.num_keys().unwrap(), 2);
    });
}

#[test]
fn a_server_without_secret_accepts_clients_without_one_but_not_with_one() {
    bounded(T, || {
        let (_server, addr) = server(None);
        let a = client(&addr);
        let b = client(&addr);
        a.set("k", b"v").unwrap();
        assert_eq!(b.get("k").unwrap(), b"v");
        // A client with a secret wants the server to prove it knows it: a server that does not
        // ask for one cannot, so the client refuses it.
        let err = TcpStore::connect(&addr, opts(Some("whatever"))).unwrap_err();
        assert!(
            err.to_string()
                .contains("without asking for the shared secret"),
            "{err}"
        );
    });
}

/// A version-2 `HELLO` with a fixed client nonce.
fn raw_hello_v2(nonce: &[u8; 32]) -> Vec<u8> {
    let mut body = vec![0x01];
    body.extend_from_slice(b"DDPS");
    body.extend_from_slice(&2u16.to_le_bytes());
    body.extend_from_slice(&32u32.to_le_bytes());
    body.extend_from_slice(nonce);
    frame(&body)
}

/// Authenticate a raw connection with `secret`: HELLO, CHALLENGE, AUTH, WELCOME.
fn raw_authenticate(s: &mut TcpStream, secret: &[u8]) {
    use hmac::{Hmac, Mac};
    let nonce = [5u8; 32];
    s.write_all(&raw_hello_v2(&nonce)).unwrap();
    let challenge = raw_reply(s).expect("a challenge");
    assert_eq!(challenge[0], 0x88, "CHALLENGE");
    let server_nonce = &challenge[5..];
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
    mac.update(b"ddp-store-v2 client\0");
    mac.update(&nonce);
    mac.update(server_nonce);
    let proof = mac.finalize().into_bytes();
    let mut body = vec![0x0a];
    body.extend_from_slice(&32u32.to_le_bytes());
    body.extend_from_slice(&proof);
    s.write_all(&frame(&body)).unwrap();
    assert_eq!(raw_reply(s).unwrap()[0], 0x89, "WELCOME");
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

fn raw_connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// Read one reply frame; `None` if the server closed the connection.
fn raw_reply(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut header = [0u8; 4];
    s.read_exact(&mut header).ok()?;
    let mut body = vec![0u8; u32::from_le_bytes(header) as usize];
    s.read_exact(&mut body).ok()?;
    Some(body)
}

fn assert_closed(s: &mut TcpStream) {
    let mut rest = Vec::new();
    // read_to_end returns once the server closed its side (or errors on reset).
    let _ = s.read_to_end(&mut rest);
    let mut buf = [0u8; 1];
    assert!(
        matches!(s.read(&mut buf), Ok(0) | Err(_)),
        "connection must be closed"
    );
}

#[test]
fn garbage_never_takes_the_server_down() {
    bounded(T, || {
        let (_server, addr) = server(Some("s"));
        let good = TcpStore::connect(&addr, opts(Some("s"))).unwrap();
        good.set("k", b"v").unwrap();

        // Random bytes instead of a handshake.
        {
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            for _ in 0..20 {
                let mut s = raw_connect(&addr);
                let n = rng.gen_range(1..2048);
                let junk: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
                let _ = s.write_all(&junk);
                let _ = s.shutdown(std::net::Shutdown::Write);
                assert_closed(&mut s);
            }
        }

        // A header claiming 4 GiB: an error reply, then the connection closes.
        let mut s = raw_connect(&addr);
        s.write_all(&u32::MAX.to_le_bytes()).unwrap();
        let reply = raw_reply(&mut s).expect("an error reply");
        assert_eq!(reply[0], 0x87, "ERROR reply");
        assert!(String::from_utf8_lossy(&reply).contains("exceeds the limit"));
        assert_closed(&mut s);

        // Same after a successful handshake.
        let mut s = raw_connect(&addr);
        raw_authenticate(&mut s, b"s");
        s.write_all(&u32::MAX.to_le_bytes()).unwrap();
        assert_eq!(raw_reply(&mut s).unwrap()[0], 0x87);
        assert_closed(&mut s);

        // A truncated frame followed by EOF.
        let mut s = raw_connect(&addr);
        raw_authenticate(&mut s, b"s");
        s.write_all(&[100, 0, 0, 0, 0x02, 1, 0]).unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        assert_closed(&mut s);

        // An unknown opcode and a malformed body: error replies, the connection stays usable.
        let mut s = raw_connect(&addr);
        raw_authenticate(&mut s, b"s");
        s.write_all(&frame(&[0x7e, 1, 2, 3])).unwrap();
        let reply = raw_reply(&mut s).unwrap();
        assert_eq!(reply[0], 0x87);
        assert!(String::from_utf8_lossy(&reply).contains("unknown request opcode 0x7e"));
        // CHECK with a key that is not UTF-8.
        s.write_all(&frame(&[0x09, 2, 0, 0, 0, 0xff, 0xfe]))
            .unwrap();
        let reply = raw_reply(&mut s).unwrap();
        assert!(String::from_utf8_lossy(&reply).contains("not valid UTF-8"));
        // CHECK "k" still works on this connection: BOOL true.
        s.write_all(&frame(&[0x09, 1, 0, 0, 0, b'k'])).unwrap();
        assert_eq!(raw_reply(&mut s).unwrap(), [0x84, 1]);

        // A request before the handshake is refused without touching the data.
        let mut s = raw_connect(&addr);
        s.write_all(&frame(&[0x07, 1, 0, 0, 0, b'k'])).unwrap(); // DELETE "k"
        assert_eq!(raw_reply(&mut s).unwrap()[0], 0x87);
        assert_closed(&mut s);

        // A peer that connects and says nothing does not block anyone.
        let _silent = raw_connect(&addr);

        // Through all of that, well-behaved clients kept working.
        assert_eq!(good.get("k").unwrap(), b"v");
        let fresh = TcpStore::connect(&addr, opts(Some("s"))).unwrap();
        assert_eq!(fresh.get("k").unwrap(), b"v");
        assert_eq!(fresh.num_keys().unwrap(), 1);
    });
}

#[test]
fn binding_a_port_in_use_gives_a_clear_error() {
    bounded(T, || {
        let (_first, addr) = server(None);
        let err = StoreServer::bind(&addr, None).unwrap_err();
        let msg = err.to_string();
        assert_eq!(
            msg,
            format!(
                "cannot host the store on {addr}: address already in use (another job or store \
                 is listening there; pick another --master-port)"
            )
        );
        // Also when the first server listens on all interfaces.
        let all = StoreServer::bind("0.0.0.0:0", None).unwrap();
        let port = all.local_addr().port();
        let err = StoreServer::bind(&format!("127.0.0.1:{port}"), None).unwrap_err();
        assert!(err.to_string().contains("address already in use"), "{err}");
    });
}

#[test]
fn dropping_the_server_fails_a_blocked_get_naming_the_store() {
    bounded(T, || {
        let (server, addr) = server(None);
        let store = client(&addr);
        let h = std::thread::spawn(move || {
            let start = Instant::now();
            let r = store.get_timeout("never", Duration::from_secs(60));
            (r, start.elapsed())
        });
        std::thread::sleep(Duration::from_millis(300));
        let start = Instant::now();
        drop(server);
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "drop must be prompt"
        );
        let (result, elapsed) = h.join().unwrap();
        assert!(elapsed < Duration::from_secs(5), "get took {elapsed:?}");
        let err = result.unwrap_err();
        assert!(
            matches!(&err, Error::Store { addr: a, .. } if *a == addr),
            "{err}"
        );
        assert!(err.to_string().contains(&addr), "{err}");
    });
}

#[test]
fn connect_retries_until_the_server_comes_up() {
    bounded(T, || {
        // Find a free port, then start the server on it a little later.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let addr2 = addr.clone();
        let starter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(400));
            let server = StoreServer::bind(&addr2, None).unwrap();
            std::thread::sleep(Duration::from_secs(3));
            drop(server);
        });
        let start = Instant::now();
        let store = client(&addr);
        assert!(start.elapsed() >= Duration::from_millis(300));
        store.set("up", b"1").unwrap();
        assert_eq!(store.local_addr().ip(), std::net::Ipv4Addr::LOCALHOST);
        assert_eq!(store.server_addr(), addr);
        starter.join().unwrap();
    });
}

#[test]
fn connect_gives_up_after_connect_timeout_naming_the_address() {
    bounded(T, || {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let addr = format!("127.0.0.1:{port}");
        let start = Instant::now();
        let err = TcpStore::connect(
            &addr,
            StoreOptions {
                connect_timeout: Duration::from_millis(300),
                ..opts(None)
            },
        )
        .unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        assert!(matches!(err, Error::Timeout { .. }), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&addr) && msg.contains("MASTER_ADDR/MASTER_PORT"),
            "{msg}"
        );
    });
}

#[test]
fn connecting_to_something_that_is_not_a_store_fails_clearly() {
    bounded(T, || {
        // A listener that accepts and immediately hangs up.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let h = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            drop(s);
        });
        let err = TcpStore::connect(&addr, opts(None)).unwrap_err();
        assert!(
            matches!(&err, Error::Store { addr: a, .. } if *a == addr),
            "{err}"
        );
        assert!(err.to_string().contains("really a ddp-rs store"), "{err}");
        h.join().unwrap();
    });
}

#[test]
fn try_clone_opens_an_independent_connection() {
    bounded(T, || {
        let (_server, addr) = server(Some("x"));
        let mut a = TcpStore::connect(&addr, opts(Some("x"))).unwrap();
        a.set_timeout(Duration::from_secs(7));
        let b = a.try_clone().unwrap();
        assert_eq!(b.timeout(), Duration::from_secs(7));
        assert_ne!(a.local_addr(), b.local_addr());
        // b blocks in get while a (another connection) sets the key.
        let h = std::thread::spawn(move || b.get("x"));
        std::thread::sleep(Duration::from_millis(100));
        a.set("x", b"1").unwrap();
        assert_eq!(h.join().unwrap().unwrap(), b"1");
    });
}

#[test]
fn prefix_stores_are_isolated_and_nest() {
    bounded(T, || {
        let (_server, addr) = server(None);
        let base: Arc<dyn Store> = Arc::new(client(&addr));
        let a = PrefixStore::new("pg0", Arc::clone(&base));
        let b = PrefixStore::new("pg1", Arc::clone(&base));
        a.set("rank", b"a").unwrap();
        b.set("rank", b"b").unwrap();
        assert_eq!(a.get("rank").unwrap(), b"a");
        assert_eq!(b.get("rank").unwrap(), b"b");
        assert_eq!(base.get("pg0/rank").unwrap(), b"a");
        assert!(!base.check("rank").unwrap());

        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(b.add("n", 5).unwrap(), 5);
        assert!(!b.check("only-a").unwrap());
        a.set("only-a", b"").unwrap();
        assert!(a.check("only-a").unwrap() && !b.check("only-a").unwrap());
        assert!(b.delete("n").unwrap());
        assert_eq!(a.add("n", 0).unwrap(), 2);
        assert_eq!(a.compare_set("c", b"", b"1").unwrap(), b"1");
        assert_eq!(
            b.compare_set("c", b"1", b"2").unwrap(),
            b"",
            "b's c is missing"
        );

        // wait and timeouts go through the prefix, and the error names the full key.
        a.wait(&["rank", "n"], Duration::from_secs(1)).unwrap();
        let err = b.wait(&["only-a"], Duration::from_millis(50)).unwrap_err();
        assert!(err.to_string().contains("\"pg1/only-a\""), "{err}");

        // Nesting.
        let inner = PrefixStore::new("sub", Arc::new(a.clone()) as Arc<dyn Store>);
        inner.set("k", b"deep").unwrap();
        assert_eq!(base.get("pg0/sub/k").unwrap(), b"deep");
        assert_eq!(inner.prefix(), "sub");

        // num_keys counts the whole inner store.
        assert_eq!(a.num_keys().unwrap(), base.num_keys().unwrap());
        assert_eq!(a.timeout(), base.timeout());
    });
}

#[test]
fn port_zero_fails_at_once_saying_why() {
    bounded(T, || {
        // MASTER_PORT=0 without a launcher: nothing can ever listen on port 0, so retrying until
        // the connect timeout would only hide the mistake.
        let start = Instant::now();
        let err = TcpStore::connect("127.0.0.1:0", opts(None)).unwrap_err();
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
        assert!(matches!(err, Error::Config(_)), "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("port 0") && msg.contains("MASTER_PORT"),
            "{msg}"
        );
    });
}
