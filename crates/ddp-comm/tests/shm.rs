//! The shared-memory backend: every collective against the sequential reference among threads
//! (world sizes 1..=5) and processes, bit-identical results across ranks for both all-reduce
//! variants, a peer killed with SIGKILL (survivors name it, nothing is left in /dev/shm), a peer
//! that left, mismatched collectives (same path and across the message and fast paths), and a
//! stalled peer. No test may hang: every wait is bounded.
//!
//! Worker processes are this test binary, re-executed on the ignored `worker` test with the
//! torchrun environment and `DDP_BACKEND=shm`.

mod common;

use common::{
    assert_bit_identical, check_all, check_every_collective, expect_all_fail, finish,
    kill_one_mid_loop, random_float_all_reduces, run_ranks_on, sizes, spawn_workers,
    stalled_rank_1_is_warned_about, stalled_rank_1_times_out_naming_it,
};
use ddp_comm::algorithms::AllReduceAlgorithm;
use ddp_comm::process_group::Backend;
use ddp_comm::transport::shm::NAME_PREFIX;
use ddp_comm::{init_process_group, InitOptions, ReduceOp};
use half::bf16;
use std::process::Command;
use std::time::{Duration, Instant};

fn check_world(world: usize) {
    run_ranks_on(
        world,
        Duration::from_secs(60),
        None,
        Backend::Shm,
        move |pg| {
            assert_eq!(pg.topology().name(), "shm");
            check_every_collective(&pg, 31 + world as u64);
        },
    );
}

/// A placement that asks for a range beyond the gathered buffer gets an error naming the
/// collective, on the cross-memory path (4 MiB) and on the message rings (4 KiB); its peer is
/// not left waiting, and reads straight from the peer's buffer where it may.
#[test]
fn all_gather_in_place_to_names_a_bad_range_and_completes() {
    for n in [1 << 20, 1 << 10] {
        let got = run_ranks_on(2, Duration::from_secs(20), None, Backend::Shm, move |pg| {
            let direct = pg.direct_gather_min().is_some_and(|m| 4 * n >= m);
            let mut buf = vec![pg.rank() as f32; n];
            let mut out = vec![0f32; n];
            let r = pg.all_gather_in_place_to(&mut buf, &mut |read| {
                let at = if pg.rank() == 0 { n } else { 0 };
                read(at, &mut out)
            });
            (direct, r.map_err(|e| e.to_string()), out)
        });
        assert_eq!(got[0].0, n == 1 << 20, "n={n}: direct path {}", got[0].0);
        let err = got[0].1.clone().unwrap_err();
        assert!(
            err.contains("all_gather_in_place_to") && err.contains("asked"),
            "{err}"
        );
        if let Ok(()) = got[1].1 {
            // Rank 1 read the first half (rank 0's block) and its own.
            let want: Vec<f32> = (0..n).map(|i| if i < n / 2 { 0.0 } else { 1.0 }).collect();
            assert_eq!(got[1].2, want, "n={n}");
        }
    }
}

#[test]
fn shm_world_1_matches_reference() {
    check_world(1);
}

#[test]
fn shm_world_2_matches_reference() {
    check_world(2);
}

#[test]
fn shm_world_3_matches_reference() {
    check_world(3);
}

#[test]
fn shm_world_4_matches_reference() {
    check_world(4);
}

#[test]
fn shm_world_5_matches_reference() {
    check_world(5);
}

#[test]
fn auto_picks_shm_on_one_host_and_tcp_stays_available() {
    let got = run_ranks_on(3, Duration::from_secs(30), None, Backend::Auto, |pg| {
        pg.topology().name()
    });
    assert_eq!(got, ["shm"; 3]);
    let got = run_ranks_on(2, Duration::from_secs(30), None, Backend::Tcp, |pg| {
        pg.topology().name()
    });
    assert_eq!(got, ["tcp"; 2]);
    assert_eq!(Backend::parse("SHM"), Some(Backend::Shm));
    assert_eq!(Backend::parse("gloo"), Some(Backend::Tcp));
    assert_eq!(Backend::parse("nccl"), None);
}

/// Random (inexact) floats: every rank must end with the same bits, for the one-shot and the
/// pipelined fast path and for the message-ring algorithms, with every float type.
#[test]
fn results_are_bit_identical_across_ranks() {
    for algo in [
        None,
        Some(AllReduceAlgorithm::Ring),
        Some(AllReduceAlgorithm::RecursiveDoubling),
    ] {
        for world in [3, 4] {
            let out = run_ranks_on(world, Duration::from_secs(60), algo, Backend::Shm, |pg| {
                random_float_all_reduces(&pg)
            });
            assert_bit_identical(&out, &format!("algorithm {algo:?}, world {world}"));
        }
    }
}

#[test]
fn subgroups_get_their_own_segment() {
    run_ranks_on(4, Duration::from_secs(30), None, Backend::Shm, |pg| {
        let low = pg.new_group(&[0, 1]).unwrap();
        let high = pg.new_group(&[2, 3]).unwrap();
        let g = low.or(high).expect("every rank is in one subgroup");
        assert_eq!(g.topology().name(), "shm");
        let mut v = vec![pg.rank() as i64; 100_000];
        g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        let want = if pg.rank() < 2 { 1 } else { 5 };
        assert!(v.iter().all(|&x| x == want));
        let mut w = vec![1.0f32; 10];
        pg.all_reduce(&mut w, ReduceOp::Sum).unwrap();
        assert_eq!(w, [4.0; 10]);
    });
}

#[test]
fn a_peer_that_left_is_named_without_waiting_for_the_timeout() {
    let start = Instant::now();
    let out = run_ranks_on(2, Duration::from_secs(60), None, Backend::Shm, |pg| {
        if pg.rank() == 1 {
            return None; // drops its group: its transport marks it as gone
        }
        std::thread::sleep(Duration::from_millis(200));
        let mut v = vec![1.0f32; 1 << 16];
        Some(
            pg.all_reduce(&mut v, ReduceOp::Sum)
                .unwrap_err()
                .to_string(),
        )
    });
    let e = out[0].as_deref().unwrap();
    assert!(
        e.contains("rank 1") && e.contains("left the group") && e.contains("all_reduce"),
        "{e}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
}

/// The transport itself: per-pair order of several messages in one exchange, messages larger
/// than the ring (wrap-around, odd lengths), and a length mismatch naming both sides.
#[test]
fn raw_transport_orders_messages_and_checks_lengths() {
    use ddp_comm::testing::run_with_store;
    use ddp_comm::transport::shm::ShmTransport;
    use ddp_comm::transport::{Fingerprint, OpKind, RecvFrom, SendTo, Transport};
    use ddp_comm::DType;
    let t20 = Duration::from_secs(20);
    let results = run_with_store(2, t20, |rank, store| {
        let mut t = ShmTransport::connect(&*store, rank, 2, t20).unwrap();
        let ring = t.geometry().unwrap().ring_cap;
        let fp = |seq| Fingerprint {
            seq,
            op: OpKind::Broadcast,
            dtype: DType::U8,
            reduce: None,
            count: 0,
            root: 0,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        let msg = |k: usize, n: usize| -> Vec<u8> { (0..n).map(|i| (i * 7 + k) as u8).collect() };
        let sizes = [3 * ring + 17, 0, 5, ring - 1];
        t.begin(fp(0), deadline);
        if rank == 0 {
            let data: Vec<Vec<u8>> = sizes.iter().enumerate().map(|(k, &n)| msg(k, n)).collect();
            let mut sends: Vec<SendTo<'_>> =
                data.iter().map(|d| SendTo { to: 1, data: d }).collect();
            t.exchange(&mut sends, &mut []).unwrap();
        } else {
            let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0xAA; n]).collect();
            let mut recvs: Vec<RecvFrom<'_>> = bufs
                .iter_mut()
                .map(|b| RecvFrom { from: 0, buf: b })
                .collect();
            t.exchange(&mut [], &mut recvs).unwrap();
            for (k, b) in bufs.iter().enumerate() {
                assert!(
                    *b == msg(k, sizes[k]),
                    "message {k} corrupted or out of order"
                );
            }
        }
        // Rank 1 expects 10 bytes, rank 0 sends 12.
        t.begin(fp(1), deadline);
        if rank == 0 {
            t.send(1, &[1; 12]).unwrap();
            String::new()
        } else {
            t.recv(0, &mut [0; 10]).unwrap_err().to_string()
        }
    });
    let e = &results[1];
    assert!(
        e.contains("mismatch")
            && e.contains("[10 bytes]")
            && e.contains("[12 bytes]")
            && e.contains("rank 0"),
        "{e}"
    );
}

// ----- processes ----------------------------------------------------------------------------

/// Our segments in /dev/shm created by any of `pids`.
fn segments_of(pids: &[u32]) -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    pids.iter()
                        .any(|p| n.starts_with(&format!("{NAME_PREFIX}{p}-")))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The worker side, run only when re-executed by the tests above.
#[test]
#[ignore = "entry point of worker processes spawned by the other tests"]
fn worker() {
    let mode = std::env::var("DDP_TEST_MODE").expect("DDP_TEST_MODE");
    let timeout =
        Duration::from_secs(std::env::var("DDP_TEST_TIMEOUT").map_or(30, |v| v.parse().unwrap()));
    common::log_to_stderr();
    let pg = match init_process_group(InitOptions {
        timeout,
        ..Default::default()
    }) {
        Ok(pg) => pg,
        Err(e) => {
            println!("INIT ERROR: {e}");
            std::process::exit(5)
        }
    };
    if std::env::var("DDP_BACKEND").as_deref() == Ok("shm") {
        assert_eq!(pg.topology().name(), "shm");
    }
    let rank = pg.rank();
    let fail = |e: ddp_comm::Error| -> ! {
        println!("ERROR: {e}");
        std::process::exit(3)
    };
    let expect_error = |r: ddp_comm::Result<()>| match r {
        Err(e) => fail(e),
        Ok(()) => println!("NO ERROR"),
    };
    match mode.as_str() {
        "reference" => {
            let seed = 700 + pg.size() as u64;
            check_all::<f32>(&pg, seed, &sizes(seed, true));
            check_all::<bf16>(&pg, seed + 1, &sizes(seed + 1, false));
            check_all::<i64>(&pg, seed + 2, &sizes(seed + 2, false));
            check_all::<u8>(&pg, seed + 3, &sizes(seed + 3, false));
            println!("OK");
        }
        "loop" => {
            // Alternate a large all-reduce (cross-memory attach, or the pipelined slots with
            // DDP_SHM_CMA=0) and a one-shot one; give up after 30 s so that a failed test never
            // leaves workers spinning.
            let mut big = vec![1.0f32; 1 << 20];
            let mut small = vec![1.0f32; 100];
            let mut i = 0u64;
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(30) {
                let r = if i.is_multiple_of(2) {
                    pg.all_reduce(&mut big, ReduceOp::Avg)
                } else {
                    pg.all_reduce(&mut small, ReduceOp::Avg)
                };
                if let Err(e) = r {
                    fail(e)
                }
                if i == 1 {
                    println!("READY");
                }
                i += 1;
            }
            std::process::exit(4);
        }
        "mismatch" | "mismatch_large" => {
            let mut ok = vec![0.0f32; 8];
            pg.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
            let base = if mode == "mismatch" { 10 } else { 300_000 };
            let mut buf = vec![1.0f32; base + usize::from(rank != 1)];
            expect_error(pg.all_reduce(&mut buf, ReduceOp::Sum));
        }
        "mismatch_mixed" => {
            // Rank 1 takes the all-reduce fast path while the others use the message rings.
            let mut ok = vec![0.0f32; 8];
            pg.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
            let mut buf = vec![1.0f32; 12];
            if rank == 1 {
                expect_error(pg.all_reduce(&mut buf, ReduceOp::Sum));
            } else {
                let mut out = vec![0.0f32; 12 * pg.size()];
                expect_error(pg.all_gather(&buf, &mut out));
            }
        }
        "mismatch_placed" => {
            // Rank 1 gathers with the caller-placed all-gather (cross-memory reads on this
            // machine), the others with the plain in-place one: two protocols, one count.
            let mut ok = vec![0.0f32; 8];
            pg.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
            let mut buf = vec![1.0f32; 300_000 * pg.size()];
            if rank == 1 {
                let mut out = vec![0.0f32; buf.len()];
                expect_error(pg.all_gather_in_place_to(&mut buf, &mut |read| read(0, &mut out)));
            } else {
                expect_error(pg.all_gather_in_place(&mut buf));
            }
        }
        "fallback" => {
            let mut v = vec![pg.rank() as i64 + 1; 100_000];
            pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert!(v.iter().all(|&x| x == 3));
            println!("BACKEND {}", pg.topology().name());
        }
        "stall" => {
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(20));
            }
            let mut buf = vec![1i64; 100];
            expect_error(pg.all_reduce(&mut buf, ReduceOp::Sum));
        }
        "stall_warn" => common::stall_warn_mode(&pg),
        other => panic!("unknown mode {other}"),
    }
}

/// World 2 and 3, and world 2 again without cross-memory attach (large all-reduces then take
/// the pipelined path through the shared slots).
#[test]
fn processes_match_reference_over_shm() {
    for (world, cma) in [(2, "1"), (3, "1"), (2, "0")] {
        let deadline = Instant::now() + Duration::from_secs(120);
        let env = [("DDP_SHM_CMA", cma.to_string())];
        let children = spawn_workers("shm", world, 0..world, "reference", &env);
        let pids: Vec<u32> = children.iter().map(|c| c.id()).collect();
        for (rank, child) in children.into_iter().enumerate() {
            let (code, out) = finish(child, deadline);
            assert_eq!(code, Some(0), "rank {rank} of {world}: {out}");
            assert!(out.contains("OK"), "rank {rank}: {out}");
        }
        assert_eq!(
            segments_of(&pids),
            Vec::<String>::new(),
            "segments left in /dev/shm"
        );
    }
}

/// Kill `victim` mid-loop; every survivor must fail naming it, quickly, and no segment of
/// these processes may remain in /dev/shm. `cma`: value of `DDP_SHM_CMA` (the large
/// all-reduces use cross-memory attach, or the shared slots with "0").
fn kill_one(victim: usize, cma: &str) {
    let env = [("DDP_SHM_CMA", cma.to_string())];
    let pids = kill_one_mid_loop("shm", 3, victim, &env);
    assert_eq!(
        segments_of(&pids),
        Vec::<String>::new(),
        "segments left in /dev/shm"
    );
}

#[test]
fn killed_peer_is_named_by_every_survivor_and_nothing_leaks() {
    kill_one(1, "1");
    kill_one(1, "0");
}

#[test]
fn killed_creator_rank_0_or_last_rank_is_named_and_nothing_leaks() {
    kill_one(0, "1");
    kill_one(2, "0");
}

/// A creator killed before every rank attached leaves its segment's name behind (the others
/// still need it); the next segment created on the host sweeps names whose creator is gone.
#[test]
fn segment_of_a_dead_creator_is_swept_by_the_next_group() {
    let mut gone = Command::new("true").spawn().unwrap();
    let pid = gone.id();
    gone.wait().unwrap();
    let path = format!("/dev/shm/{NAME_PREFIX}{pid}-00000000deadbeef");
    std::fs::write(&path, b"stale").unwrap();
    let mut alive = Command::new("sleep").arg("30").spawn().unwrap();
    let alive_path = format!("/dev/shm/{NAME_PREFIX}{}-00000000cafef00d", alive.id());
    std::fs::write(&alive_path, b"in use").unwrap();
    run_ranks_on(2, Duration::from_secs(30), None, Backend::Shm, |pg| {
        let mut v = [1u8];
        pg.all_reduce(&mut v, ReduceOp::Sum).unwrap();
    });
    let swept = !std::path::Path::new(&path).exists();
    let kept = std::path::Path::new(&alive_path).exists();
    std::fs::remove_file(&alive_path).ok();
    alive.kill().ok();
    alive.wait().ok();
    assert!(swept, "{path} of dead pid {pid} was not swept");
    assert!(kept, "{alive_path} of a live process was removed");
}

#[test]
fn mismatched_collectives_fail_on_every_rank_naming_both_sides() {
    expect_all_fail("shm", "mismatch", 3, &["mismatch", "f32 x 10", "f32 x 11"]);
    expect_all_fail(
        "shm",
        "mismatch_large",
        3,
        &["mismatch", "f32 x 300000", "f32 x 300001"],
    );
    expect_all_fail(
        "shm",
        "mismatch_mixed",
        3,
        &[
            "mismatch",
            "all_reduce(sum, f32 x 12)",
            "all_gather(f32 x 12)",
        ],
    );
    expect_all_fail(
        "shm",
        "mismatch_placed",
        3,
        &[
            "mismatch",
            "all_gather(f32 x 300000)",
            "all_gather_in_place_to(f32 x 300000)",
        ],
    );
}

/// Rank 0 cannot create the segment (here: larger than /dev/shm): with `auto` every rank falls
/// back to TCP together; with `shm` initialization fails naming the cause.
#[test]
fn no_room_in_dev_shm_falls_back_to_tcp_or_fails_clearly() {
    let huge = ("DDP_SHM_RING_KB", (1usize << 30).to_string());
    let deadline = Instant::now() + Duration::from_secs(60);
    let auto = [huge.clone(), ("DDP_BACKEND", "auto".to_string())];
    for (rank, child) in spawn_workers("shm", 2, 0..2, "fallback", &auto)
        .into_iter()
        .enumerate()
    {
        let (code, out) = finish(child, deadline);
        assert_eq!(code, Some(0), "auto: rank {rank}: {out}");
        assert!(out.contains("BACKEND tcp"), "auto: rank {rank}: {out}");
    }
    for (rank, child) in spawn_workers("shm", 2, 0..2, "fallback", std::slice::from_ref(&huge))
        .into_iter()
        .enumerate()
    {
        let (code, out) = finish(child, deadline);
        assert_eq!(code, Some(5), "shm: rank {rank}: {out}");
        // Rank 1 may instead see rank 0, which hosts the store, exit before it got the news.
        assert!(
            out.contains("not enough space in /dev/shm") || (rank == 1 && out.contains("store")),
            "shm: rank {rank}: {out}"
        );
    }
}

#[test]
fn stalled_peer_times_out_naming_it() {
    stalled_rank_1_times_out_naming_it("shm");
}

#[test]
fn stalled_peer_is_warned_about_while_waiting() {
    stalled_rank_1_is_warned_about("shm");
}
