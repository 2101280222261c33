//! DDP over ddp-comm's MPI backend (feature `mpi`), under `mpirun -np 2`: the same training as
//! the thread-rank tests in `ddp.rs` — against plain candle on the global batch, replicas
//! bit-identical after every step, `no_sync` accumulation equal to one big batch, and `Join`
//! with uneven shards equal to the single-process reference. Each rank checks its own result
//! (the references are single-process), and the replicas are compared through the group.
//!
//! The ranks are this test binary re-executed by `mpirun` on its ignored `mpi_rank` test.

#![cfg(feature = "mpi")]

use candle_core::Tensor;
use candle_nn::{Optimizer, SGD};
use ddp_candle::{Ddp, DdpOptions};
use ddp_comm::{init_process_group, Backend, InitOptions};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::*;

/// The rank side, run only under `mpirun` by the test below.
#[test]
#[ignore = "entry point of the ranks that the test below starts with mpirun"]
fn mpi_rank() {
    let pg = init_process_group(InitOptions {
        backend: Some(Backend::Mpi),
        timeout: Duration::from_secs(60),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(pg.topology().name(), "mpi");
    let (rank, world) = (pg.rank(), pg.size());
    assert_eq!(world, 2);

    // 1. Equivalence: 2 ranks x 8 samples against plain candle on the 16-sample batch.
    const STEPS: usize = 6;
    let (x, y) = dataset(2 * 8 * STEPS);
    let want = plain_reference(7, 0.1, STEPS, |k| batch(&x, &y, k * 16..(k + 1) * 16));
    for opts in [DdpOptions::default(), tiny_buckets()] {
        let (vm, m) = model(7 + rank as u64, HID);
        let mut ddp = Ddp::new(&vm, &pg, opts).unwrap();
        let mut opt = SGD::new(ddp.all_vars(), 0.1).unwrap();
        for (step, want) in want.iter().enumerate() {
            let start = step * 16 + rank * 8;
            let (xs, ys) = batch(&x, &y, start..start + 8);
            let loss = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
            opt.step(&ddp.backward(&loss).unwrap()).unwrap();
            assert_eq!(
                ddp.replica_max_diff().unwrap(),
                0.0,
                "step {step}: replicas differ"
            );
            assert_close(&params(&ddp), want, 1e-5, &format!("mpi step {step}"));
        }
    }

    // 2. no_sync: K micro-batches accumulated locally, then one synced step, equal to one big batch.
    const K: usize = 3;
    const M: usize = 5;
    let (x, y) = dataset(2 * K * M);
    let (vm, m) = model(11, HID);
    let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
    let base = rank * K * M;
    let micro_loss = |k: usize| {
        let (xs, ys) = batch(&x, &y, base + k * M..base + (k + 1) * M);
        (candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap() / K as f64).unwrap()
    };
    {
        let mut guard = ddp.no_sync();
        for k in 0..K - 1 {
            guard.backward(&micro_loss(k)).unwrap();
            assert_eq!(guard.total_stats().steps, 0, "no_sync must not communicate");
        }
    }
    let accumulated = ddp.backward(&micro_loss(K - 1)).unwrap();
    let accumulated = grads_of(&ddp, &accumulated);
    let (xs, ys) = batch(&x, &y, base..base + K * M);
    let big = candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap();
    let big = ddp.backward(&big).unwrap();
    for (i, (a, b)) in accumulated.iter().zip(&grads_of(&ddp, &big)).enumerate() {
        assert!(rel_diff(a, b) <= 1e-5, "no_sync: param #{i}");
    }

    // 3. Join: rank 0 has 3 batches, rank 1 has 7; the result equals plain candle's.
    const B: usize = 6;
    let (x, y) = dataset(10 * B);
    let shard: Vec<std::ops::Range<usize>> = match rank {
        0 => (0..3).map(|i| i * B..(i + 1) * B).collect(),
        _ => (3..10).map(|i| i * B..(i + 1) * B).collect(),
    };
    let (vm, m) = model(21 + rank as u64, HID);
    let mut ddp = Ddp::new(&vm, &pg, tiny_buckets()).unwrap();
    let mut opt = SGD::new(ddp.all_vars(), 0.1).unwrap();
    let mut join = ddp_core::Join::new(&pg);
    let mut batches = shard.into_iter();
    let mut steps = 0;
    loop {
        let range = batches.next();
        let Some(step) = join.begin_step(range.is_some()).unwrap() else {
            break;
        };
        let loss = range.map(|r| {
            let (xs, ys) = batch(&x, &y, r);
            candle_nn::loss::cross_entropy(&m.forward(&xs).unwrap(), &ys).unwrap()
        });
        opt.step(&ddp.backward_join(loss.as_ref(), &join, &step).unwrap())
            .unwrap();
        assert_eq!(ddp.replica_max_diff().unwrap(), 0.0, "join step {steps}");
        steps += 1;
    }
    assert_eq!(steps, 7);
    let reference = plain_reference(21, 0.1, 7, |step| {
        if step < 3 {
            let (a, ay) = batch(&x, &y, step * B..(step + 1) * B);
            let (b, by) = batch(&x, &y, (3 + step) * B..(4 + step) * B);
            (
                Tensor::cat(&[a, b], 0).unwrap(),
                Tensor::cat(&[ay, by], 0).unwrap(),
            )
        } else {
            batch(&x, &y, (3 + step) * B..(4 + step) * B)
        }
    });
    assert_close(&params(&ddp), &reference[6], 1e-5, "join");
    println!("OK rank {rank}");
}

#[test]
fn ddp_no_sync_and_join_over_mpi_match_plain_candle() {
    let mut child = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "2"])
        .arg(std::env::current_exe().unwrap())
        .args([
            "mpi_rank",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun (the mpi feature needs an MPI installation, e.g. openmpi-bin)");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(180) {
            child.kill().ok();
            panic!("mpirun did not finish within 180 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(status.success(), "{text}");
    assert!(
        text.contains("OK rank 0\n") && text.contains("OK rank 1\n"),
        "{text}"
    );
}
