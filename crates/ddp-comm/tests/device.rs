//! The device-agnostic parts of device collectives, on real stores and groups: the choice
//! between NCCL and relay from the ranks' device ids, the id exchanges through the store, the
//! fingerprint check through the host group, and the watchdog (a collective not finished in
//! time aborts the group on every rank, each error naming the collective and its sequence).

mod common;

use common::run_ranks;
use ddp_comm::device::check::ShapeCheck;
use ddp_comm::device::watchdog::{Completion, Watchdog, WatchdogTiming};
use ddp_comm::device::{
    choose_backend, exchange_device_ids, exchange_unique_id, DeviceBackend, DeviceId,
    DeviceTopology,
};
use ddp_comm::testing::run_with_store;
use ddp_comm::transport::{Fingerprint, OpKind};
use ddp_comm::{DType, Error, ReduceOp};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn dev(host: &str, device: &str) -> DeviceId {
    DeviceId {
        host: host.into(),
        device: device.into(),
    }
}

#[test]
fn auto_picks_nccl_iff_every_rank_has_its_own_gpu_and_nccl_loads() {
    let own = [dev("a", "gpu0"), dev("a", "gpu1"), dev("b", "gpu0")];
    let t = choose_backend(DeviceBackend::Auto, &own, Ok(())).unwrap();
    assert_eq!(t, DeviceTopology::Nccl { ranks: 3 });
    assert_eq!(t.to_string(), "nccl: 3 ranks, one GPU each");

    let shared = [dev("a", "gpu0"), dev("b", "gpu0"), dev("a", "gpu0")];
    let t = choose_backend(DeviceBackend::Auto, &shared, Ok(())).unwrap();
    assert_eq!(t.name(), "relay");
    assert!(
        t.to_string()
            .contains("ranks 0 and 2 share a GPU (device gpu0 on host a)"),
        "{t}"
    );

    let t = choose_backend(DeviceBackend::Auto, &own, Err("libnccl: not found".into())).unwrap();
    assert_eq!(t.name(), "relay");
    assert!(t.to_string().contains("libnccl: not found"), "{t}");

    let t = choose_backend(DeviceBackend::Relay, &own, Ok(())).unwrap();
    assert_eq!(t.to_string(), "relay: 3 ranks, relayed on request");
}

#[test]
fn nccl_on_request_fails_naming_the_shared_gpu_or_the_missing_library() {
    let shared = [dev("h", "u1"), dev("h", "u1")];
    let e = choose_backend(DeviceBackend::Nccl, &shared, Ok(())).unwrap_err();
    let s = e.to_string();
    assert!(
        s.contains("ranks 0 and 1 share a GPU") && s.contains("Duplicate GPU detected"),
        "{s}"
    );
    let e = choose_backend(
        DeviceBackend::Nccl,
        &[dev("h", "u1")],
        Err("libnccl: not found".into()),
    )
    .unwrap_err();
    assert!(e.to_string().contains("libnccl: not found"), "{e}");
}

#[test]
fn device_backend_parses_like_the_env_var() {
    assert_eq!(DeviceBackend::parse("NCCL"), Some(DeviceBackend::Nccl));
    assert_eq!(DeviceBackend::parse("gloo"), Some(DeviceBackend::Relay));
    assert_eq!(DeviceBackend::parse("relay"), Some(DeviceBackend::Relay));
    assert_eq!(DeviceBackend::parse("staged"), Some(DeviceBackend::Relay));
    assert_eq!(DeviceBackend::parse(""), Some(DeviceBackend::Auto));
    assert_eq!(DeviceBackend::parse("mpi"), None);
}

#[test]
fn device_ids_go_through_the_store_by_rank() {
    let out = run_with_store(4, Duration::from_secs(20), |rank, store| {
        let mine = dev(&format!("host{}", rank / 2), &format!("uuid-{}", rank % 2));
        exchange_device_ids(&*store, "devs", rank, 4, &mine, Duration::from_secs(20)).unwrap()
    });
    for ids in &out {
        assert_eq!(ids, &out[0]);
    }
    assert_eq!(out[0][3], dev("host1", "uuid-1"));
    // two hosts with GPUs uuid-0 and uuid-1 each: four distinct devices
    let t = choose_backend(DeviceBackend::Auto, &out[0], Ok(())).unwrap();
    assert_eq!(t.name(), "nccl");
}

#[test]
fn a_missing_rank_is_named_when_device_ids_are_exchanged() {
    let out = run_with_store(2, Duration::from_secs(5), |rank, store| {
        if rank == 1 {
            return None;
        }
        let e = exchange_device_ids(
            &*store,
            "d",
            0,
            2,
            &dev("h", "g"),
            Duration::from_millis(300),
        )
        .unwrap_err();
        Some(e.to_string())
    });
    let s = out[0].as_ref().unwrap();
    assert!(s.contains("rank 1 to publish its CUDA device"), "{s}");
}

#[test]
fn every_rank_gets_rank_0s_unique_id_and_rank_0s_failure() {
    let out = run_with_store(3, Duration::from_secs(20), |rank, store| {
        let ok = exchange_unique_id(&*store, "uid", rank, Duration::from_secs(20), || {
            assert_eq!(rank, 0, "only rank 0 makes the id");
            Ok((0..128u8).collect())
        })
        .unwrap();
        let failed = exchange_unique_id(&*store, "uid2", rank, Duration::from_secs(20), || {
            Err(Error::Config("ncclGetUniqueId: no network".into()))
        })
        .unwrap_err();
        (ok, failed.to_string())
    });
    for (rank, (ok, failed)) in out.iter().enumerate() {
        assert_eq!(ok, &(0..128u8).collect::<Vec<_>>(), "rank {rank}");
        assert!(failed.contains("no network"), "rank {rank}: {failed}");
    }
    assert!(
        out[1]
            .1
            .contains("rank 0 could not create the NCCL unique id"),
        "{}",
        out[1].1
    );
}

fn fp(op: OpKind, dtype: DType, count: u64, seq: u64) -> Fingerprint {
    Fingerprint {
        seq,
        op,
        dtype,
        reduce: Some(ReduceOp::Sum),
        count,
        root: Fingerprint::NO_ROOT,
    }
}

#[test]
fn fingerprint_check_passes_equal_shapes_once_and_names_a_mismatch() {
    let out = run_ranks(3, Duration::from_secs(20), |pg| {
        let check = ShapeCheck::new();
        let a = fp(OpKind::AllReduce, DType::F32, 1024, 0);
        check.check(&pg, &a).unwrap();
        check.check(&pg, &Fingerprint { seq: 1, ..a }).unwrap(); // known shape: no exchange
        assert_eq!(check.len(), 1);
        // rank 2 issues f16 x 1000 where the others issue f32 x 1000
        let (dtype, count) = if pg.rank() == 2 {
            (DType::F16, 1000)
        } else {
            (DType::F32, 1000)
        };
        check
            .check(&pg, &fp(OpKind::AllReduce, dtype, count, 2))
            .unwrap_err()
            .to_string()
    });
    assert!(
        out[0].contains("rank 0 issued all_reduce(sum, f32 x 1000)")
            && out[0].contains("rank 2 issued all_reduce(sum, f16 x 1000)"),
        "{}",
        out[0]
    );
    assert!(
        out[2].contains("rank 2 issued all_reduce(sum, f16 x 1000) but rank 0"),
        "{}",
        out[2]
    );
}

/// A completion that finishes when its flag is set.
struct Flag(Arc<AtomicBool>);

impl Completion for Flag {
    fn poll(&mut self) -> ddp_comm::Result<bool> {
        Ok(self.0.load(Ordering::SeqCst))
    }
}

fn timing() -> WatchdogTiming {
    WatchdogTiming {
        poll: Duration::from_millis(1),
        store_poll: Duration::from_millis(20),
    }
}

#[test]
fn watchdog_completes_finished_work_and_aborts_every_rank_on_a_timeout() {
    let out = run_with_store(2, Duration::from_secs(20), |rank, store| {
        let aborts = Arc::new(AtomicUsize::new(0));
        let a = aborts.clone();
        let dog = Watchdog::start(
            store,
            "abort".into(),
            rank,
            Box::new(move |_| {
                a.fetch_add(1, Ordering::SeqCst);
            }),
            timing(),
        )
        .unwrap();
        // a collective that finishes
        let done = Arc::new(AtomicBool::new(false));
        let w = dog.watch(
            fp(OpKind::Broadcast, DType::U8, 4, 0),
            Duration::from_secs(10),
            Box::new(Flag(done.clone())),
        );
        assert!(!w.is_completed());
        done.store(true, Ordering::SeqCst);
        w.wait().unwrap();
        // #1 never finishes: rank 0 times out after 300 ms, rank 1 would wait 20 s
        let limit = [300, 20_000][rank];
        let started = Instant::now();
        let w = dog.watch(
            fp(OpKind::AllReduce, DType::F32, 10, 1),
            Duration::from_millis(limit),
            Box::new(Flag(Arc::new(AtomicBool::new(false)))),
        );
        let e = w.wait().unwrap_err();
        let waited = started.elapsed();
        // later collectives fail at once with the cause
        let later = dog
            .watch(
                fp(OpKind::AllReduce, DType::F32, 10, 2),
                Duration::from_secs(10),
                Box::new(Flag(Arc::new(AtomicBool::new(true)))),
            )
            .wait()
            .unwrap_err();
        // the communicator is aborted once, right after the errors are handed out
        let until = Instant::now() + Duration::from_secs(5);
        while aborts.load(Ordering::SeqCst) == 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        (e, waited, later, aborts.load(Ordering::SeqCst))
    });
    let (e0, w0, later0, aborts0) = &out[0];
    assert!(matches!(e0, Error::Timeout { .. }), "{e0}");
    let s = e0.to_string();
    assert!(s.contains("all_reduce(sum, f32 x 10) #1 on rank 0"), "{s}");
    assert!(
        *w0 >= Duration::from_millis(300) && *w0 < Duration::from_secs(5),
        "{w0:?}"
    );
    assert!(matches!(later0, Error::Aborted(_)), "{later0}");
    assert_eq!(*aborts0, 1, "rank 0 aborted its communicator once");
    let (e1, w1, _, aborts1) = &out[1];
    let s = e1.to_string();
    assert!(
        matches!(e1, Error::PeerFailed { peer: 0, .. })
            && s.contains("all_reduce(sum, f32 x 10) #1"),
        "{s}"
    );
    assert!(
        *w1 < Duration::from_secs(10),
        "rank 1 learned of the abort in {w1:?}"
    );
    assert_eq!(*aborts1, 1, "rank 1 aborted its communicator once");
}

/// A completion that reports an error (as NCCL's `ncclCommGetAsyncError` does).
struct Failing;

impl Completion for Failing {
    fn poll(&mut self) -> ddp_comm::Result<bool> {
        Err(Error::Device {
            call: "ncclCommGetAsyncError".into(),
            rank: 0,
            message: "remote process exited".into(),
        })
    }
}

#[test]
fn watchdog_fails_on_an_asynchronous_error() {
    let out = run_with_store(1, Duration::from_secs(20), |rank, store| {
        let dog = Watchdog::start(store, "abort".into(), rank, Box::new(|_| {}), timing()).unwrap();
        let e = dog
            .watch(
                fp(OpKind::AllReduce, DType::F32, 1, 0),
                Duration::from_secs(20),
                Box::new(Failing),
            )
            .wait()
            .unwrap_err();
        (e.to_string(), dog.broken().is_some())
    });
    assert!(out[0].0.contains("remote process exited"), "{}", out[0].0);
    assert!(out[0].1);
}
