//! Real processes: collectives against the reference, a peer killed with SIGKILL mid-collective,
//! mismatched collectives, and a stalled peer. Every survivor must fail with an error naming the
//! peer, and no test may hang.
//!
//! The workers are this test binary itself, re-executed on the ignored `worker` test with the
//! torchrun environment (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).

mod common;

use common::{
    expect_all_fail, finish, free_port, guard, kill_one_mid_loop, spawn_workers,
    stalled_rank_1_is_warned_about, stalled_rank_1_times_out_naming_it,
};

use ddp_comm::{init_process_group, InitOptions, ReduceOp};
use half::bf16;

use std::time::{Duration, Instant};

/// The worker side, run only when re-executed by the tests above.
#[test]
#[ignore = "entry point of worker processes spawned by the other tests"]
fn worker() {
    let mode = std::env::var("DDP_TEST_MODE").expect("DDP_TEST_MODE");
    let timeout =
        Duration::from_secs(std::env::var("DDP_TEST_TIMEOUT").map_or(30, |v| v.parse().unwrap()));
    // `DDP_TEST_HOSTS=0,0,1,1`: rank r claims to run on simulated host hosts[r] (hierarchical).
    let host_id = std::env::var("DDP_TEST_HOSTS").ok().map(|hosts| {
        let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
        format!("test-host-{}", hosts.split(',').nth(rank).unwrap())
    });
    common::log_to_stderr();
    let pg = match init_process_group(InitOptions {
        timeout,
        host_id,
        ..Default::default()
    }) {
        Ok(pg) => pg,
        Err(e) => {
            println!("INIT ERROR: {e}");
            std::process::exit(5)
        }
    };
    if let Ok(want) = std::env::var("DDP_TEST_TOPOLOGY") {
        assert!(
            pg.topology().to_string().starts_with(&want),
            "{}",
            pg.topology()
        );
    }
    let rank = pg.rank();
    let fail = |e: ddp_comm::Error| -> ! {
        println!("ERROR: {e}");
        std::process::exit(3)
    };
    match mode.as_str() {
        "reference" => {
            let seed = 500 + pg.size() as u64;
            common::check_all::<f32>(&pg, seed, &common::sizes(seed, true));
            common::check_all::<bf16>(&pg, seed + 1, &common::sizes(seed + 1, false));
            common::check_all::<i64>(&pg, seed + 2, &common::sizes(seed + 2, false));
            common::check_all::<u8>(&pg, seed + 3, &common::sizes(seed + 3, false));
            common::check_all::<f64>(&pg, seed + 4, &common::sizes(seed + 4, false));
            common::check_all::<half::f16>(&pg, seed + 5, &common::sizes(seed + 5, false));
            common::check_all::<i32>(&pg, seed + 6, &common::sizes(seed + 6, false));
            println!("OK");
        }
        "loop" if std::env::var("DDP_TEST_PENDING").is_ok() => {
            // Keep 8 async all-reduces in flight: when one fails, every one still pending must
            // fail too, and every error must name a peer rank and a sequence number (`#N`).
            let names_seq = |e: &str| {
                e.contains("rank ")
                    && e.split('#')
                        .skip(1)
                        .any(|t| t.starts_with(|c: char| c.is_ascii_digit()))
            };
            let mut pending = std::collections::VecDeque::new();
            let mut i = 0u64;
            loop {
                pending.push_back(pg.all_reduce_async(vec![1.0f32; 1 << 18], ReduceOp::Avg));
                if pending.len() < 8 {
                    continue;
                }
                match pending.pop_front().unwrap().wait() {
                    Ok(_) if i == 0 => println!("READY"),
                    Ok(_) => {}
                    Err(e) => {
                        let mut bad = usize::from(!names_seq(&e.to_string()));
                        for w in pending {
                            match w.wait() {
                                Ok(_) => bad += 1,
                                Err(p) => {
                                    println!("PENDING: {p}");
                                    bad += usize::from(!names_seq(&p.to_string()));
                                }
                            }
                        }
                        if bad > 0 {
                            println!("{bad} collectives succeeded or lack peer/sequence after {e}");
                            std::process::exit(4)
                        }
                        fail(e)
                    }
                }
                i += 1;
            }
        }
        "loop" => {
            let mut buf = vec![1.0f32; 1 << 20];
            let mut i = 0u64;
            loop {
                if let Err(e) = pg.all_reduce(&mut buf, ReduceOp::Avg) {
                    fail(e)
                }
                if i == 0 {
                    println!("READY");
                }
                i += 1;
            }
        }
        "mismatch" => {
            let mut ok = vec![0.0f32; 8];
            pg.all_reduce(&mut ok, ReduceOp::Sum).unwrap();
            let n = if rank == 1 { 10 } else { 11 };
            let mut buf = vec![1.0f32; n];
            match pg.all_reduce(&mut buf, ReduceOp::Sum) {
                Err(e) => fail(e),
                Ok(()) => println!("NO ERROR"),
            }
        }
        "stall" => {
            if rank == 1 {
                std::thread::sleep(Duration::from_secs(20));
            }
            let mut buf = vec![1i64; 100];
            match pg.all_reduce(&mut buf, ReduceOp::Sum) {
                Err(e) => fail(e),
                Ok(()) => println!("NO ERROR"),
            }
        }
        "once" => {
            // Keep the store (hosted by rank 0) up for a duplicate that joins late.
            let mut buf = vec![1i64; 100];
            pg.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            println!("OK");
            std::thread::sleep(Duration::from_secs(8));
        }
        "stall_warn" => common::stall_warn_mode(&pg),
        other => panic!("unknown mode {other}"),
    }
}

#[test]
fn processes_match_reference_world_2_and_3() {
    for world in [2, 3] {
        let deadline = Instant::now() + Duration::from_secs(90);
        for (rank, child) in spawn_workers("tcp", world, 0..world, "reference", &[])
            .into_iter()
            .enumerate()
        {
            let (code, out) = finish(child, deadline);
            assert_eq!(code, Some(0), "rank {rank} of {world}: {out}");
            assert!(out.contains("OK"), "rank {rank}: {out}");
        }
    }
}

#[test]
fn killed_peer_is_named_by_every_survivor() {
    kill_one_mid_loop("tcp", 3, 1, &[]);
}

/// The README: a dead peer makes every survivor's *pending* collectives fail too, each error
/// naming a peer rank and a sequence number (checked by the worker, which exits 4 otherwise).
#[test]
fn killed_peer_fails_every_pending_collective_naming_rank_and_sequence() {
    kill_one_mid_loop("tcp", 3, 2, &[("DDP_TEST_PENDING", "1".to_string())]);
}

/// Hosts {0, 1} and {2, 3}: shared memory inside each, TCP between. Killing a host's leader
/// (rank 2) must reach its host-mate over shared memory and the other host over TCP.
#[test]
fn killed_leader_of_a_hierarchical_group_is_named_by_every_survivor() {
    let env = [
        ("DDP_TEST_HOSTS", "0,0,1,1".to_string()),
        ("DDP_TEST_TOPOLOGY", "hierarchical".to_string()),
    ];
    kill_one_mid_loop("auto", 4, 2, &env);
    kill_one_mid_loop("auto", 4, 1, &env);
}

#[test]
fn mismatched_collectives_fail_on_every_rank_naming_both_sides() {
    expect_all_fail("tcp", "mismatch", 3, &["mismatch", "f32 x 10", "f32 x 11"]);
}

#[test]
fn stalled_peer_times_out_naming_it() {
    stalled_rank_1_times_out_naming_it("tcp");
}

#[test]
fn stalled_peer_is_warned_about_while_waiting() {
    stalled_rank_1_is_warned_about("tcp");
}

/// Two processes started with the same `RANK` over TCP: the second to join is told so, naming
/// both processes (as on shared memory), instead of failing later with a bare
/// `Connection reset by peer`; rank 0 and the first one run normally.
#[test]
fn duplicate_rank_is_named() {
    let env = [("MASTER_PORT", free_port().to_string())];
    let mut children = spawn_workers("tcp", 2, 0..2, "once", &env);
    children.extend(spawn_workers("tcp", 2, 1..2, "once", &env));
    let _guard = guard(&children);
    let deadline = Instant::now() + Duration::from_secs(60);
    let outs: Vec<_> = children.into_iter().map(|c| finish(c, deadline)).collect();
    assert_eq!(outs[0].0, Some(0), "rank 0: {}", outs[0].1);
    let named = outs[1..]
        .iter()
        .filter(|(code, out)| {
            *code == Some(5)
                && out.contains("rank 1 (world size 2) was claimed by pid")
                && out.contains("two processes were given the same rank")
        })
        .count();
    let ran = outs[1..]
        .iter()
        .filter(|(code, _)| *code == Some(0))
        .count();
    assert_eq!(
        (named, ran),
        (1, 1),
        "the two processes of rank 1: {outs:?}"
    );
}
