//! Bad configurations fail at init with a message naming what is wrong, never a hang.

use ddp_comm::{init_process_group, InitOptions};
use std::time::{Duration, Instant};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn opts(port: u16, rank: usize, world: usize, timeout: Duration) -> InitOptions {
    let mut o = InitOptions::tcp(&format!("127.0.0.1:{port}"), rank, world);
    o.timeout = timeout;
    o
}

#[test]
fn port_in_use_is_named() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let err = init_process_group(opts(port, 0, 1, Duration::from_secs(5))).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("already in use") && msg.contains(&port.to_string()),
        "{msg}"
    );
}

#[test]
fn world_size_disagreement_is_named_on_both_sides() {
    let port = free_port();
    let timeout = Duration::from_secs(4);
    let start = Instant::now();
    let r0 = std::thread::spawn(move || init_process_group(opts(port, 0, 3, timeout)).map(|_| ()));
    let r1 = std::thread::spawn(move || init_process_group(opts(port, 1, 2, timeout)).map(|_| ()));
    let e1 = r1.join().unwrap().unwrap_err().to_string();
    let e0 = r0.join().unwrap().unwrap_err().to_string();
    assert!(
        e1.contains("world size mismatch") && e1.contains("rank 0"),
        "rank 1: {e1}"
    );
    assert!(
        e0.contains("world size mismatch") && e0.contains("rank 1"),
        "rank 0: {e0}"
    );
    assert!(start.elapsed() < Duration::from_secs(15));
}

#[test]
fn missing_rank_times_out_naming_it() {
    let port = free_port();
    let start = Instant::now();
    let err = init_process_group(opts(port, 0, 2, Duration::from_secs(2)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("rank(s) [1]"), "{err}");
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn invalid_explicit_options_are_named() {
    let e = init_process_group(opts(1, 2, 2, Duration::from_secs(1)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 2 is not below world size 2"), "{e}");
    let e = init_process_group(opts(1, 0, 0, Duration::from_secs(1)))
        .unwrap_err()
        .to_string();
    assert!(e.contains("world size is 0"), "{e}");
    let mut o = InitOptions::tcp("127.0.0.1:notaport", 0, 1);
    o.timeout = Duration::from_secs(1);
    let e = init_process_group(o).unwrap_err().to_string();
    assert!(e.contains("not a port number"), "{e}");
    let o = InitOptions {
        init_method: Some("file:///tmp/x".into()),
        ..Default::default()
    };
    let e = init_process_group(o).unwrap_err().to_string();
    assert!(e.contains("unsupported init method"), "{e}");
}
