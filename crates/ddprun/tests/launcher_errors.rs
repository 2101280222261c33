//! The launcher's own errors, through the binary: a port in use (`--master-port`), unparsable
//! endpoints refused at once, retries to reach the store printed with their reason, node 0's
//! store bound to the address it was given, and the cap on the bytes of the store it hosts.

mod common;

use common::*;
use std::time::Duration;

#[test]
fn master_port_in_use_names_it_in_one_clean_message() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let r = run(
        &["--master-port", &port, "--rdzv-timeout", "5", "true"],
        Duration::from_secs(60),
    );
    assert_eq!(r.code(), Some(1), "{r}");
    assert_eq!(
        r.stderr,
        format!(
            "ddprun: error: cannot host the store on 127.0.0.1:{port}: address already in use \
             (another job or store is listening there; pick another --master-port) (node 0 hosts \
             the rendezvous store at --master-addr 127.0.0.1 --master-port {port}); for a \
             single-node job, --standalone or --master-port 0 picks a free port\n"
        )
    );
}

#[test]
fn an_unparsable_rdzv_endpoint_is_refused_at_once_naming_flag_and_value() {
    for (ep, why) in [
        (
            "not a host:29500",
            "`not a host` is not a host name or an IP address",
        ),
        ("node1:http", "`http` is not a port (0..=65535)"),
        (":29500", "the host is empty"),
        ("[::1:29500", "the `[` of an IPv6 address is not closed"),
        ("[node1]:29500", "`node1` is not an IPv6 address"),
    ] {
        let r = run(&["--rdzv-endpoint", ep, "true"], Duration::from_secs(60));
        assert_eq!(r.code(), Some(2), "{ep}: {r}");
        assert_eq!(
            r.stderr,
            format!("ddprun: error: --rdzv-endpoint `{ep}` is not HOST or HOST:PORT: {why}\n"),
        );
    }
    let r = run(&["--master-addr", "a/b", "true"], Duration::from_secs(60));
    assert_eq!(r.code(), Some(2), "{r}");
    assert_eq!(
        r.stderr,
        "ddprun: error: --master-addr `a/b` is refused: `a/b` is not a host name or an IP \
         address\n"
    );
}

#[test]
fn each_retry_to_reach_the_store_is_printed_with_its_reason() {
    let port = free_port().to_string();
    let r = run(
        &[
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-port",
            &port,
            "--rdzv-timeout",
            "7",
            "true",
        ],
        Duration::from_secs(60),
    );
    assert_eq!(r.code(), Some(1), "{r}");
    let retry = format!(
        "ddprun: the rendezvous store at 127.0.0.1:{port} (hosted by node 0's ddprun) is not \
         reachable yet: "
    );
    let retries = lines_with(&r.stderr, &retry);
    assert!(retries.len() >= 2, "{r}");
    assert!(
        retries
            .iter()
            .all(|l| l.contains("Connection refused") && l.contains("retrying in")),
        "{r}"
    );
}

/// A non-loopback IPv4 address of this machine.
fn local_ipv4() -> Option<std::net::Ipv4Addr> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list`, freed below; every node is read while the list lives.
    unsafe {
        if libc::getifaddrs(&mut list) != 0 {
            return None;
        }
        let mut found = None;
        let mut p = list;
        while !p.is_null() {
            let a = (*p).ifa_addr;
            if !a.is_null() && i32::from((*a).sa_family) == libc::AF_INET {
                let sin = &*(a as *const libc::sockaddr_in);
                let ip = std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                if !ip.is_loopback() {
                    found = Some(ip);
                    break;
                }
            }
            p = (*p).ifa_next;
        }
        libc::freeifaddrs(list);
        found
    }
}

#[test]
fn node_0_binds_the_store_to_the_local_address_it_was_given() {
    let Some(ip) = local_ipv4() else {
        skip(
            "node_0_binds_the_store_to_the_local_address_it_was_given",
            "no non-loopback IPv4 address",
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let port = free_port();
    let endpoint = format!("{ip}:{port}");
    let script = format!("while [ ! -e '{}' ]; do sleep 0.05; done", go.display());
    let running = Running::start(ddprun(&["--rdzv-endpoint", &endpoint, "sh", "-c", &script]));
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect((ip, port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "the store never listened on {endpoint}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Bound to the address given, not to every interface: loopback does not reach it.
    let on_loopback = std::net::TcpStream::connect(("127.0.0.1", port));
    std::fs::write(&go, "").unwrap();
    let r = running.finish(Duration::from_secs(60));
    assert_eq!(r.code(), Some(0), "{r}");
    assert!(
        on_loopback.is_err(),
        "the store also listened on 127.0.0.1:{port}"
    );
}

#[test]
fn store_max_bytes_caps_the_store_ddprun_hosts() {
    // The launcher's own entry (about 50 bytes) does not fit under a 10-byte cap.
    for (flag, env) in [(Some("10"), None), (None, Some("10"))] {
        let mut args = vec!["--master-port", "0", "--rdzv-timeout", "10"];
        if let Some(v) = flag {
            args.extend(["--store-max-bytes", v]);
        }
        args.push("true");
        let mut cmd = ddprun(&args);
        if let Some(v) = env {
            cmd.env("DDP_STORE_MAX_BYTES", v);
        }
        let r = Running::start(cmd).finish(Duration::from_secs(60));
        assert_eq!(r.code(), Some(1), "{r}");
        assert!(
            r.stderr.contains("past its cap of 10 bytes")
                && r.stderr.contains("`ddprun --store-max-bytes`"),
            "{r}"
        );
    }
    let r = run(&["--store-max-bytes", "0", "true"], Duration::from_secs(60));
    assert_eq!(r.code(), Some(2), "{r}");
}

#[test]
fn a_huge_world_size_is_refused_at_once_in_a_short_message() {
    let port = free_port().to_string();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ddp-allreduce-check"));
    cmd.env("RANK", "0")
        .env("WORLD_SIZE", "1000000")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", &port)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let r = Running::start(cmd).finish(Duration::from_secs(120));
    assert_ne!(r.code(), Some(0), "{r}");
    assert!(
        r.stderr
            .contains("world size 1000000 is more than ddp-rs supports (at most 65536)"),
        "{r}"
    );
    assert!(
        r.stderr.len() + r.stdout.len() < 2000,
        "{} bytes of output",
        r.stderr.len()
    );
}
