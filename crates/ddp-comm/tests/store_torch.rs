//! The store answers PyTorch's `TCPStore` protocol on its own port (what `ddprun` relies on for
//! PyTorch workers). These tests speak that protocol byte for byte, as torch 2.x's client does
//! (the bytes were captured from torch 2.15), over real sockets; `ddprun`'s tests run real
//! PyTorch workers where torch is installed.

use ddp_comm::store::{Store, StoreOptions, StoreServer, TcpStore, DEFAULT_TORCH_PREFIX};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

#[path = "common/bounded.rs"]
mod bounded;
use bounded::bounded;

const T: Duration = Duration::from_secs(30);

/// A PyTorch-protocol client: one connection, requests as the torch client encodes them.
struct Torch(TcpStream);

fn string(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

impl Torch {
    fn connect(addr: &str) -> Torch {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        // VALIDATE + magic, then PING with a nonce that must come back.
        s.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c, 13, 0x78, 0x56, 0x34, 0x12])
            .unwrap();
        let mut t = Torch(s);
        assert_eq!(t.read_n(4), [0x78, 0x56, 0x34, 0x12], "ping echo");
        t
    }
    fn send(&mut self, query: u8, fields: &[&[u8]]) {
        let mut out = vec![query];
        for f in fields {
            string(&mut out, f);
        }
        self.0.write_all(&out).unwrap();
    }
    fn send_raw(&mut self, bytes: &[u8]) {
        self.0.write_all(bytes).unwrap();
    }
    fn keys_query(&mut self, query: u8, keys: &[&str]) {
        let mut out = vec![query];
        out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            string(&mut out, k.as_bytes());
        }
        self.0.write_all(&out).unwrap();
    }
    fn read_n(&mut self, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.0.read_exact(&mut b).unwrap();
        b
    }
    fn read_u64(&mut self) -> u64 {
        u64::from_le_bytes(self.read_n(8).try_into().unwrap())
    }
    fn read_bytes(&mut self) -> Vec<u8> {
        let n = self.read_u64() as usize;
        self.read_n(n)
    }
    fn set(&mut self, k: &str, v: &[u8]) {
        self.send(1, &[k.as_bytes(), v]);
    }
    fn get(&mut self, k: &str) -> Vec<u8> {
        self.send(3, &[k.as_bytes()]);
        self.read_bytes()
    }
    fn add(&mut self, k: &str, delta: i64) -> i64 {
        let mut out = vec![4];
        string(&mut out, k.as_bytes());
        out.extend_from_slice(&delta.to_le_bytes());
        self.send_raw(&out);
        self.read_u64() as i64
    }
    /// Whether the server closed the connection (within the read timeout).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.0.read(&mut b), Ok(0) | Err(_))
    }
}

fn server() -> (StoreServer, String) {
    let s = StoreServer::bind("127.0.0.1:0", None).unwrap();
    let addr = s.local_addr().to_string();
    (s, addr)
}

#[test]
fn every_query_pytorch_uses_is_answered_like_pytorchs_server() {
    bounded(T, || {
        let (_server, addr) = server();
        let mut t = Torch::connect(&addr);
        t.set("/k", b"v");
        assert_eq!(t.get("/k"), b"v");
        assert_eq!(t.add("/c", 5), 5);
        assert_eq!(t.add("/c", -2), 3);
        // compare_set: match swaps, mismatch answers the current value, a missing key with an
        // empty expectation is created.
        t.send(2, &[b"/k", b"v", b"w"]);
        assert_eq!(t.read_bytes(), b"w");
        t.send(2, &[b"/k", b"v", b"x"]);
        assert_eq!(t.read_bytes(), b"w");
        t.send(2, &[b"/new", b"", b"n"]);
        assert_eq!(t.read_bytes(), b"n");
        // check: 0 ready, 1 not ready.
        t.keys_query(5, &["/k", "/c"]);
        assert_eq!(t.read_n(1), [0]);
        t.keys_query(5, &["/k", "/missing"]);
        assert_eq!(t.read_n(1), [1]);
        // wait on present keys answers STOP_WAITING at once.
        t.keys_query(6, &["/k"]);
        assert_eq!(t.read_n(1), [0]);
        // num_keys, delete.
        t.send_raw(&[7]);
        assert_eq!(t.read_u64(), 3);
        t.send(8, &[b"/new"]);
        assert_eq!(t.read_u64(), 1);
        t.send(8, &[b"/new"]);
        assert_eq!(t.read_u64(), 0);
        // append, multi_set, multi_get.
        t.send(9, &[b"/a", b"x"]);
        t.send(9, &[b"/a", b"y"]);
        let mut ms = vec![11];
        ms.extend_from_slice(&2u64.to_le_bytes());
        for (k, v) in [("/m1", "1"), ("/m2", "22")] {
            string(&mut ms, k.as_bytes());
            string(&mut ms, v.as_bytes());
        }
        t.send_raw(&ms);
        t.keys_query(10, &["/a", "/m1", "/m2"]);
        assert_eq!(
            [t.read_bytes(), t.read_bytes(), t.read_bytes()],
            [b"xy".to_vec(), b"1".to_vec(), b"22".to_vec()]
        );
        // list_keys names the keys without the server's namespace.
        t.send_raw(&[17]);
        let n = t.read_u64();
        let mut keys: Vec<String> = (0..n)
            .map(|_| String::from_utf8(t.read_bytes()).unwrap())
            .collect();
        keys.sort();
        assert_eq!(keys, ["/a", "/c", "/k", "/m1", "/m2"]);
    });
}

#[test]
fn a_wait_is_released_by_another_client_or_cancelled_by_its_own() {
    bounded(T, || {
        let (_server, addr) = server();
        let mut waiter = Torch::connect(&addr);
        let mut setter = Torch::connect(&addr);
        waiter.keys_query(6, &["/late"]);
        std::thread::sleep(Duration::from_millis(200));
        setter.set("/late", b"1");
        assert_eq!(waiter.read_n(1), [0], "STOP_WAITING once the key is set");
        // The client's timeout path: WAIT, then CANCEL_WAIT → WAIT_CANCELED.
        let start = Instant::now();
        waiter.keys_query(6, &["/never"]);
        std::thread::sleep(Duration::from_millis(200));
        waiter.send_raw(&[12]);
        assert_eq!(waiter.read_n(1), [1], "WAIT_CANCELED");
        assert!(start.elapsed() < Duration::from_secs(5));
        // The connection still works, and the cancelled wait leaves nothing behind.
        setter.set("/never", b"");
        assert_eq!(waiter.get("/late"), b"1");
    });
}

#[test]
fn a_barrier_releases_when_the_counter_reaches_the_world_size() {
    bounded(T, || {
        let (_server, addr) = server();
        let mut out = vec![18];
        string(&mut out, b"/bar");
        out.extend_from_slice(&2i64.to_le_bytes());
        let mut first = Torch::connect(&addr);
        first.send_raw(&out);
        std::thread::sleep(Duration::from_millis(200));
        let mut second = Torch::connect(&addr);
        second.send_raw(&out);
        assert_eq!(second.read_n(1), [0]);
        assert_eq!(first.read_n(1), [0]);
    });
}

#[test]
fn pytorch_keys_live_in_their_own_namespace_and_restarts_get_a_fresh_one() {
    bounded(T, || {
        let (server, addr) = server();
        let mut t = Torch::connect(&addr);
        t.set("/rank0", b"10.0.0.1:1234");
        let ours = TcpStore::connect(
            &addr,
            StoreOptions {
                secret: None,
                timeout: Duration::from_secs(5),
                connect_timeout: Duration::from_secs(5),
            },
        )
        .unwrap();
        assert!(!ours.check("/rank0").unwrap());
        assert_eq!(
            ours.get(&format!("{DEFAULT_TORCH_PREFIX}/rank0")).unwrap(),
            b"10.0.0.1:1234"
        );
        server.set_torch_prefix("torch/run/1/");
        let mut restarted = Torch::connect(&addr);
        restarted.keys_query(5, &["/rank0"]);
        assert_eq!(
            restarted.read_n(1),
            [1],
            "a new group does not see the old keys"
        );
        // A connection keeps the namespace it started in.
        assert_eq!(t.get("/rank0"), b"10.0.0.1:1234");
    });
}

#[test]
fn a_store_with_a_secret_refuses_pytorch_clients_and_bad_input_closes_only_that_connection() {
    bounded(T, || {
        let guarded = StoreServer::bind("127.0.0.1:0", Some("s3cret".into())).unwrap();
        let mut s = TcpStream::connect(guarded.local_addr()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&[0x00, 0xce, 0xf7, 0x85, 0x3c, 13, 1, 2, 3, 4])
            .unwrap();
        assert!(
            Torch(s).closed(),
            "refused: PyTorch cannot prove the secret"
        );

        let (_server, addr) = server();
        for garbage in [
            vec![0xee],                                              // unknown query
            vec![1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff], // key of 2^64-1 bytes
            vec![0x00, 0xce, 0xf7, 0x85, 0x3c],                      // a second VALIDATE
            vec![14],                                                // queue_push: not supported
        ] {
            let mut bad = Torch::connect(&addr);
            bad.send_raw(&garbage);
            assert!(bad.closed(), "{garbage:02x?} must close the connection");
        }
        // An ADD to a value that is not a number closes that connection, as PyTorch's does.
        let mut bad = Torch::connect(&addr);
        bad.set("/txt", b"abc");
        let mut out = vec![4];
        string(&mut out, b"/txt");
        out.extend_from_slice(&1i64.to_le_bytes());
        bad.send_raw(&out);
        assert!(bad.closed());
        // Everyone else is still served.
        let mut good = Torch::connect(&addr);
        assert_eq!(good.get("/txt"), b"abc");
    });
}
