//! Fuzzing what peers send: the store protocol (ours and PyTorch's `TCPStore`), the transport
//! message header, and the worker environment a launcher leaves (`EnvConfig`). Property-based
//! (proptest): random bytes and mutations of valid messages. Every input must give a clear
//! error or a message that encodes back to the same bytes, never a panic, and no decoder may
//! make an allocation out of proportion to the input (a peer announcing a huge length and
//! sending nothing costs nothing). A live server is fed garbage too, and must keep serving.
//!
//! `FUZZ_CASES` sets the inputs per target (default small, for CI); a long pass:
//! `FUZZ_CASES=1000000 cargo test -p ddp-comm --release --test fuzz`.

use ddp_comm::env::{first_slurm_host, EnvConfig};
use ddp_comm::fuzzing::{self, cases, largest_allocation_during, TrackingAlloc};
use ddp_comm::store::{Store, StoreOptions, StoreServer, TcpStore};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

/// Extra bytes any decode may allocate whatever the input (error messages, first buffer
/// chunk of 64 KiB).
const SLACK: usize = 128 << 10;

fn runner(default: u32) -> TestRunner {
    runner_of(cases(default))
}

fn runner_of(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    })
}

/// Random bytes, or a valid message with some bytes overwritten, cut short or extended.
fn mutated(valid: Vec<Vec<u8>>, max_len: usize) -> impl Strategy<Value = Vec<u8>> {
    let pick = proptest::sample::select(valid);
    prop_oneof![
        vec(any::<u8>(), 0..max_len),
        (
            pick.clone(),
            vec((any::<prop::sample::Index>(), any::<u8>()), 1..4)
        )
            .prop_map(|(mut m, edits)| {
                if !m.is_empty() {
                    for (i, b) in edits {
                        let i = i.index(m.len());
                        m[i] = b;
                    }
                }
                m
            }),
        (pick.clone(), any::<prop::sample::Index>()).prop_map(|(m, i)| {
            let n = i.index(m.len() + 1);
            m[..n].to_vec()
        }),
        (pick, vec(any::<u8>(), 1..16)).prop_map(|(mut m, tail)| {
            m.extend(tail);
            m
        }),
    ]
}

/// Valid store request and reply bodies (as the client and server encode them), built from
/// the public client by recording its bytes would need a socket: these are the documented
/// layouts, written out.
fn valid_store_bodies() -> Vec<Vec<u8>> {
    let s = |b: &[u8]| {
        let mut v = (b.len() as u32).to_le_bytes().to_vec();
        v.extend_from_slice(b);
        v
    };
    let cat = |parts: &[&[u8]]| parts.concat();
    vec![
        cat(&[&[0x01], b"DDPS", &2u16.to_le_bytes(), &s(&[7u8; 32])]),
        cat(&[&[0x0a], &s(&[1u8; 32])]),
        cat(&[&[0x02], &s(b"key"), &s(b"value")]),
        cat(&[&[0x03], &s(b"key"), &5000u64.to_le_bytes()]),
        cat(&[&[0x04], &s(b"ctr"), &(-3i64).to_le_bytes()]),
        cat(&[&[0x05], &s(b"k"), &s(b""), &s(b"d")]),
        cat(&[
            &[0x06],
            &2u32.to_le_bytes(),
            &s(b"a"),
            &s(b"bb"),
            &u64::MAX.to_le_bytes(),
        ]),
        cat(&[&[0x07], &s(b"key")]),
        vec![0x08],
        cat(&[&[0x09], &s(b"key")]),
        vec![0x80],
        cat(&[&[0x82], &s(b"value")]),
        cat(&[&[0x83], &7i64.to_le_bytes()]),
        vec![0x84, 1],
        cat(&[&[0x85], &9u64.to_le_bytes()]),
        cat(&[&[0x86], &1u32.to_le_bytes(), &s(b"missing")]),
        cat(&[&[0x87, 1], &s(b"no such thing")]),
        cat(&[&[0x88], &s(&[3u8; 32])]),
    ]
}

#[test]
fn store_frames_decode_or_fail_cleanly() {
    let decoded = std::cell::Cell::new(0u64);
    runner(20_000)
        .run(&mutated(valid_store_bodies(), 256), |body| {
            let ((req, resp), peak) = largest_allocation_during(|| {
                (
                    fuzzing::store_request(&body),
                    fuzzing::store_response(&body),
                )
            });
            // Keys of a WAIT/TIMEOUT are at most one per 4 bytes: a `Vec<String>` of them.
            prop_assert!(
                peak <= 8 * body.len() + SLACK,
                "{peak} bytes for {body:02x?}"
            );
            if req.is_ok() || resp.is_ok() {
                decoded.set(decoded.get() + 1);
            }
            for e in [req.err(), resp.err()].into_iter().flatten() {
                prop_assert!(!e.is_empty());
            }
            Ok(())
        })
        .unwrap();
    eprintln!(
        "store bodies: {} decoded as a request or reply",
        decoded.get()
    );
}

#[test]
fn a_frame_announcing_any_length_costs_only_what_arrives() {
    let strat = (
        prop_oneof![any::<u32>(), 0u32..300, Just(u32::MAX)],
        vec(any::<u8>(), 0..512),
        prop_oneof![Just(64usize << 20), Just(4096usize), 1usize..1024],
    );
    runner(20_000)
        .run(&strat, |(len, rest, max)| {
            let mut stream = len.to_le_bytes().to_vec();
            stream.extend(rest);
            let (got, peak) = largest_allocation_during(|| fuzzing::store_frame(&stream, max));
            prop_assert!(
                peak <= 2 * stream.len() + SLACK,
                "{peak} bytes for len {len}"
            );
            match got {
                Ok(n) => prop_assert!(n == len as usize && n <= max && n + 4 <= stream.len()),
                Err(e) => prop_assert!(!e.is_empty()),
            }
            Ok(())
        })
        .unwrap();
}

fn torch_bytes(b: &[u8]) -> Vec<u8> {
    let mut v = (b.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(b);
    v
}

/// A well-formed PyTorch request of query `q` (keys from `keys`, values from `value`).
fn torch_request(q: u8, keys: &[String], value: &[u8], int: i64) -> Vec<u8> {
    let mut v = vec![q];
    let key = keys.first().map_or("/k", String::as_str).as_bytes();
    let count = |v: &mut Vec<u8>| v.extend((keys.len() as u64).to_le_bytes());
    match q {
        1 | 9 => [torch_bytes(key), torch_bytes(value)]
            .iter()
            .for_each(|f| v.extend(f)),
        2 => [torch_bytes(key), torch_bytes(value), torch_bytes(value)]
            .iter()
            .for_each(|f| v.extend(f)),
        3 | 8 => v.extend(torch_bytes(key)),
        4 | 18 => {
            v.extend(torch_bytes(key));
            v.extend(int.to_le_bytes());
        }
        5 | 6 | 10 => {
            count(&mut v);
            keys.iter()
                .for_each(|k| v.extend(torch_bytes(k.as_bytes())));
        }
        11 => {
            count(&mut v);
            for k in keys {
                v.extend(torch_bytes(k.as_bytes()));
                v.extend(torch_bytes(value));
            }
        }
        13 => v.extend((int as u32).to_le_bytes()),
        _ => {}
    }
    v
}

/// PyTorch request streams: well-formed requests of every query, alone or with bytes
/// overwritten; queries with fields of random, huge or inconsistent lengths; random bytes.
fn torch_stream() -> impl Strategy<Value = Vec<u8>> {
    let len = prop_oneof![0u64..16, any::<u64>(), Just(u64::MAX), Just(1u64 << 26)];
    let field = (len, vec(any::<u8>(), 0..24)).prop_map(|(n, b)| {
        let mut v = n.to_le_bytes().to_vec();
        v.extend(b);
        v
    });
    let fuzzy = (0u8..20, vec(field, 0..4)).prop_map(|(q, fields)| {
        let mut v = vec![q];
        fields.into_iter().for_each(|f| v.extend(f));
        v
    });
    let query = prop_oneof![1u8..14, Just(17u8), Just(18u8)];
    let valid = (
        query,
        vec("[a-z/_0-9]{0,12}", 0..4),
        vec(any::<u8>(), 0..16),
        any::<i64>(),
    )
        .prop_map(|(q, keys, value, int)| torch_request(q, &keys, &value, int));
    let edited = (
        vec(valid.clone(), 1..4),
        vec((any::<prop::sample::Index>(), any::<u8>()), 1..3),
    )
        .prop_map(|(rs, edits)| {
            let mut s = rs.concat();
            for (i, b) in edits {
                let i = i.index(s.len());
                s[i] = b;
            }
            s
        });
    prop_oneof![
        3 => vec(valid, 1..6).prop_map(|rs| rs.concat()),
        2 => edited,
        2 => vec(fuzzy, 1..6).prop_map(|rs| rs.concat()),
        1 => vec(any::<u8>(), 0..256),
    ]
}

#[test]
fn pytorch_store_requests_decode_or_fail_cleanly() {
    let (requests, errors) = (std::cell::Cell::new(0usize), std::cell::Cell::new(0u64));
    runner(20_000)
        .run(&torch_stream(), |stream| {
            let (got, peak) = largest_allocation_during(|| fuzzing::torch_requests(&stream));
            prop_assert!(
                peak <= 8 * stream.len() + SLACK,
                "{peak} bytes for {stream:02x?}"
            );
            match got {
                Ok(n) => requests.set(requests.get() + n),
                Err(e) => {
                    errors.set(errors.get() + 1);
                    prop_assert!(!e.is_empty());
                }
            }
            Ok(())
        })
        .unwrap();
    eprintln!(
        "pytorch streams: {} requests decoded, {} streams refused",
        requests.get(),
        errors.get()
    );
}

#[test]
fn transport_headers_decode_or_fail_cleanly() {
    // A valid header: magic, kind, op, dtype, reduce, root, seq, count, len, padding.
    const MAGIC: u32 = 0xDD9C_0001;
    let valid = |op: u8, dtype: u8, reduce: u8| {
        let mut h = MAGIC.to_le_bytes().to_vec();
        h.extend([0, op, dtype, reduce]);
        h.extend(u32::MAX.to_le_bytes());
        h.extend(42u64.to_le_bytes());
        h.extend(1000u64.to_le_bytes());
        h.extend(4000u64.to_le_bytes());
        h.extend([0; 4]);
        h
    };
    let seeds: Vec<Vec<u8>> = (0..4u8)
        .flat_map(|op| (0..4u8).map(move |d| valid(op, d, if op == 0 { 0 } else { 0xFF })))
        .collect();
    let strat = (mutated(seeds, 41), any::<bool>());
    runner(20_000)
        .run(&strat, |(bytes, own_magic)| {
            let mut h = [0u8; 40];
            let n = bytes.len().min(40);
            h[..n].copy_from_slice(&bytes[..n]);
            let magic = if own_magic { MAGIC } else { 0x1234_5678 };
            match fuzzing::transport_header(magic, &h) {
                Ok(s) => prop_assert!(
                    u32::from_le_bytes(h[..4].try_into().unwrap()) == magic && !s.is_empty()
                ),
                Err(e) => prop_assert!(!e.is_empty()),
            }
            Ok(())
        })
        .unwrap();
}

/// The variables a launcher (torchrun, ddprun, Slurm, mpirun) leaves for a worker.
const ENV_VARS: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "DDP_RDZV_ROUND",
    "DDP_STORE_HOSTED",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
];

fn env_value() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..8).prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        Just("18446744073709551616".to_string()),
        Just("-1".to_string()),
        Just(" 3 ".to_string()),
        Just(String::new()),
        Just("node[01-04,07],gpu3".to_string()),
        Just("n[".to_string()),
        Just("[]".to_string()),
        Just("4(x2),3".to_string()),
        "\\PC{0,24}",
        "[\\[\\]0-9,()x-]{0,16}",
    ]
}

#[test]
fn any_launcher_environment_parses_or_names_what_is_wrong() {
    let strat =
        proptest::collection::hash_map(proptest::sample::select(ENV_VARS), env_value(), 0..12);
    runner(20_000)
        .run(&strat, |env: HashMap<&str, String>| {
            match EnvConfig::from_lookup(|k| env.get(k).cloned()) {
                Ok(c) => {
                    prop_assert!(c.world_size >= 1 && c.rank < c.world_size, "{c:?}");
                    prop_assert!(c.master_port != 0);
                }
                Err(ddp_comm::Error::Config(msg)) => prop_assert!(!msg.is_empty()),
                Err(other) => prop_assert!(false, "not a configuration error: {other}"),
            }
            Ok(())
        })
        .unwrap();
    runner(20_000)
        .run(&"[\\PC\\[\\],-]{0,32}", |list: String| {
            if let Some(h) = first_slurm_host(&list) {
                prop_assert!(!h.is_empty());
            }
            Ok(())
        })
        .unwrap();
}

/// Panics on the store's own threads (a panic there would not fail the test by itself).
static STORE_PANICS: AtomicUsize = AtomicUsize::new(0);

#[test]
fn a_live_store_fed_garbage_keeps_serving_both_protocols() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if std::thread::current()
            .name()
            .is_some_and(|n| n.starts_with("ddp-store"))
        {
            STORE_PANICS.fetch_add(1, Ordering::SeqCst);
        }
        default_hook(info);
    }));
    let server = StoreServer::bind("127.0.0.1:0", None).unwrap();
    let addr = server.local_addr();
    let opts = StoreOptions {
        secret: None,
        timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(10),
    };
    let legit = TcpStore::connect(&addr.to_string(), opts.clone()).unwrap();
    // Garbage after our HELLO, after PyTorch's VALIDATE, or from the first byte.
    let ours_hello: Vec<u8> = {
        let mut b = vec![0x01];
        b.extend(b"DDPS");
        b.extend(2u16.to_le_bytes());
        b.extend(32u32.to_le_bytes());
        b.extend([9u8; 32]);
        let mut f = (b.len() as u32).to_le_bytes().to_vec();
        f.extend(b);
        f
    };
    let torch_hello = vec![0x00, 0xce, 0xf7, 0x85, 0x3c];
    let strat = (
        0..3u8,
        prop_oneof![torch_stream(), vec(any::<u8>(), 0..300)],
    );
    let n = std::cell::Cell::new(0u64);
    // A connection per input: a hundredth of the decoder targets' count, at most 20 000.
    runner_of((cases(30_000) / 100).clamp(1, 20_000))
        .run(&strat, |(start, tail)| {
            let mut bytes = match start {
                0 => ours_hello.clone(),
                1 => torch_hello.clone(),
                _ => Vec::new(),
            };
            bytes.extend(tail);
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_millis(200)))
                .unwrap();
            let _ = s.write_all(&bytes);
            let _ = s.shutdown(std::net::Shutdown::Write);
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
            n.set(n.get() + 1);
            // Every hundredth input: the store still answers a real client.
            if n.get().is_multiple_of(100) {
                let key = format!("alive{}", n.get());
                legit.set(&key, b"1").unwrap();
                prop_assert_eq!(legit.get(&key).unwrap(), b"1".to_vec());
            }
            Ok(())
        })
        .unwrap();
    legit.set("end", b"ok").unwrap();
    assert_eq!(legit.get("end").unwrap(), b"ok");
    let fresh = TcpStore::connect(&addr.to_string(), opts).unwrap();
    assert!(fresh.check("end").unwrap());
    assert_eq!(
        STORE_PANICS.load(Ordering::SeqCst),
        0,
        "a store thread panicked"
    );
    eprintln!("live store: {} garbage connections, still serving", n.get());
}
