//! Tests of the reducer with real ranks (threads, each with its own TCP process group).

use super::assign::MIB;
use super::*;
use crate::error::{Error, Result};
use ddp_comm::{DType, ProcessGroup, ReduceOp};
use std::time::{Duration, Instant};

// Bucket buffers handed over between steps: taken, recycled, spares.
mod handover;

/// Runs `f(rank, pg)` on `world` threads, each with its own TCP process group.
fn run_ranks<R: Send>(
    world: usize,
    timeout: Duration,
    f: impl Fn(usize, ProcessGroup) -> R + Sync,
) -> Vec<R> {
    let cfg = ddp_comm::testing::LocalGroup {
        timeout,
        ..Default::default()
    };
    ddp_comm::testing::run_local_group(world, cfg, |pg| f(pg.rank(), pg))
}

const T: Duration = Duration::from_secs(20);

/// Mixed f32/f64 parameters of various sizes, small buckets so there are several.
fn mixed_specs() -> Vec<ParamSpec> {
    (0..12)
        .map(|i| {
            let dtype = if i % 3 == 0 { DType::F64 } else { DType::F32 };
            ParamSpec::new(format!("p{i:02}"), vec![3 + 37 * i, 2], dtype)
        })
        .collect()
}

fn small() -> ReducerOptions {
    ReducerOptions {
        bucket_cap_mb: 2048.0 / MIB,
        first_bucket_cap_mb: 512.0 / MIB,
    }
}

/// Rank `r`'s gradient of parameter `i`, element `k`.
fn g(r: usize, i: usize, k: usize) -> f64 {
    (r as f64 + 1.0) * 0.5 + i as f64 * 0.25 + k as f64 * 0.125
}

fn mark(red: &mut Reducer, r: usize, i: usize, scale: f64) -> Result<()> {
    let spec = red.specs()[i].clone();
    match spec.dtype {
        DType::F32 => {
            let v: Vec<f32> = (0..spec.numel())
                .map(|k| (g(r, i, k) * scale) as f32)
                .collect();
            red.mark_ready(i, &v)
        }
        _ => {
            let v: Vec<f64> = (0..spec.numel()).map(|k| g(r, i, k) * scale).collect();
            red.mark_ready(i, &v)
        }
    }
}

fn read(red: &Reducer, i: usize) -> Vec<f64> {
    match red.specs()[i].dtype {
        DType::F32 => red
            .grad::<f32>(i)
            .unwrap()
            .iter()
            .map(|&x| x as f64)
            .collect(),
        _ => red.grad::<f64>(i).unwrap().to_vec(),
    }
}

#[test]
fn averages_across_ranks_whatever_the_marking_order() {
    const W: usize = 3;
    let out = run_ranks(W, T, |rank, pg| {
        let mut red = Reducer::new(&pg, mixed_specs(), small()).unwrap();
        assert!(red.buckets().len() >= 4, "{:?}", red.buckets().len());
        for step in 0..3 {
            // Every rank marks in a different order; buckets must still launch in bucket
            // order (otherwise the ranks' collectives would not match).
            let mut order: Vec<usize> = (0..12).collect();
            match (rank + step) % 3 {
                0 => {}
                1 => order.reverse(),
                _ => order.rotate_left(5),
            }
            for &i in &order {
                mark(&mut red, rank, i, 1.0).unwrap();
            }
            let stats = red.finish().unwrap();
            assert!(stats.synced && stats.comm_wait <= stats.total);
            assert_eq!(stats.buckets, red.buckets().len());
            for i in 0..12 {
                let got = read(&red, i);
                for (k, v) in got.iter().enumerate() {
                    let want = (0..W).map(|r| g(r, i, k)).sum::<f64>() / W as f64;
                    assert!((v - want).abs() < 1e-5, "param {i}[{k}]: {v} vs {want}");
                }
            }
        }
        assert_eq!(red.total_stats().steps, 3);
        (0..12).map(|i| read(&red, i)).collect::<Vec<_>>()
    });
    assert_eq!(out[0], out[1]);
    assert_eq!(out[0], out[2]);
}

#[test]
fn no_sync_accumulates_and_unused_parameters_count_as_zero() {
    run_ranks(2, T, |rank, pg| {
        let mut red = Reducer::new(&pg, mixed_specs(), small()).unwrap();
        red.set_require_backward_grad_sync(false);
        for _ in 0..2 {
            for i in 0..12 {
                mark(&mut red, rank, i, 1.0).unwrap();
            }
            assert!(!red.finish().unwrap().synced);
            assert!(
                red.grad::<f32>(1).is_err(),
                "no reduced gradients under no_sync"
            );
        }
        assert_eq!(red.total_stats().steps, 0);
        red.set_require_backward_grad_sync(true);
        for i in 0..12 {
            mark(&mut red, rank, i, 1.0).unwrap();
        }
        red.finish().unwrap();
        for i in 0..12 {
            for (k, v) in read(&red, i).iter().enumerate() {
                let want = 3.0 * (g(0, i, k) + g(1, i, k)) / 2.0;
                assert!((v - want).abs() < 1e-4, "param {i}[{k}]: {v} vs {want}");
            }
        }
        // Next step: only rank 0 produces gradients for parameter 4 (unused on rank 1), and
        // nobody for parameter 7. Divide by 1 (as under Join with one active rank).
        red.set_divisor(1).unwrap();
        for i in 0..12 {
            if i != 7 && (i != 4 || rank == 0) {
                mark(&mut red, rank, i, 2.0).unwrap();
            }
        }
        red.finish_with_divisor(1).unwrap();
        assert!(read(&red, 7).iter().all(|&v| v == 0.0));
        for (k, v) in read(&red, 4).iter().enumerate() {
            assert!((v - 2.0 * g(0, 4, k)).abs() < 1e-4);
        }
    });
}

#[test]
fn misuse_is_reported() {
    run_ranks(1, T, |_, pg| {
        let specs = vec![ParamSpec::new("a", vec![2], DType::F32)];
        let mut red = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
        let e = red.mark_ready(0, &[1.0f64, 2.0]).unwrap_err().to_string();
        assert!(e.contains("`a`") && e.contains("f64"), "{e}");
        let e = red.mark_ready(0, &[1.0f32]).unwrap_err().to_string();
        assert!(e.contains("1 elements, expected 2"), "{e}");
        let e = red.mark_ready(3, &[1.0f32]).unwrap_err().to_string();
        assert!(e.contains("index 3"), "{e}");
        assert!(red.grad::<f32>(0).is_err());
        red.mark_ready(0, &[1.0f32, 2.0]).unwrap();
        let e = red.mark_ready(0, &[1.0f32, 2.0]).unwrap_err().to_string();
        assert!(e.contains("twice"), "{e}");
        red.finish().unwrap();
        assert_eq!(red.grad::<f32>(0).unwrap(), &[1.0, 2.0]);
        let dup = vec![
            ParamSpec::new("a", vec![2], DType::F32),
            ParamSpec::new("a", vec![3], DType::F32),
        ];
        let e = Reducer::new(&pg, dup, ReducerOptions::default())
            .err()
            .unwrap();
        assert!(e.to_string().contains("registered twice"), "{e}");
    });
}

#[test]
fn spec_mismatch_is_an_error_on_every_rank() {
    let errs = run_ranks(3, T, |rank, pg| {
        let mut specs = vec![
            ParamSpec::new("a", vec![2, 2], DType::F32),
            ParamSpec::new("b", vec![4], DType::F32),
        ];
        if rank == 2 {
            specs.push(ParamSpec::new("c", vec![1], DType::F32));
        }
        Reducer::new(&pg, specs, ReducerOptions::default())
            .err()
            .map(|e| e.to_string())
    });
    for e in &errs {
        let e = e.as_ref().expect("mismatch accepted");
        assert!(e.contains("ranks [2]"), "{e}");
        assert!(
            e.contains("parameter #2") && e.contains("`c` [1] f32"),
            "{e}"
        );
        assert!(e.contains("rank 0 has 2 parameters, rank 2 has 3"), "{e}");
    }
    assert_eq!(errs[0], errs[1]);
}

#[test]
fn broadcast_and_seed_helpers() {
    let out = run_ranks(3, T, |rank, pg| {
        let mut a = vec![rank as f32; 5];
        let mut b = vec![rank as f32 * 10.0; 3];
        broadcast_coalesced(&pg, &mut [&mut a[..], &mut b[..]], 1).unwrap();
        assert_eq!(a, vec![1.0; 5]);
        assert_eq!(b, vec![10.0; 3]);
        let fixed = sync_seed(&pg, Some(40 + rank as u64)).unwrap();
        assert_eq!(fixed, 40);
        sync_seed(&pg, None).unwrap()
    });
    assert!(out.iter().all(|&s| s == out[0]));
}

#[test]
fn a_dead_peer_fails_finish_instead_of_hanging() {
    let t0 = Instant::now();
    let errs = run_ranks(2, Duration::from_secs(10), |rank, pg| {
        let specs = vec![ParamSpec::new("a", vec![1000], DType::F32)];
        let mut red = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
        if rank == 1 {
            return None; // leaves without reducing: its group shuts down
        }
        red.mark_ready(0, &vec![1.0f32; 1000]).unwrap();
        let e = red.finish().unwrap_err().to_string();
        // The reducer stays failed, with the original cause.
        let again = red
            .mark_ready(0, &vec![1.0f32; 1000])
            .unwrap_err()
            .to_string();
        Some((e, again))
    });
    let (e, again) = errs[0].clone().unwrap();
    assert!(e.contains("rank 1"), "{e}");
    assert!(again.contains("rank 1"), "{again}");
    assert!(t0.elapsed() < Duration::from_secs(15));
}

#[test]
fn overlap_ratio() {
    let s = StepStats {
        synced: true,
        total: Duration::from_millis(100),
        comm_wait: Duration::from_millis(25),
        buckets: 1,
        bytes: 4,
    };
    assert!((s.overlap() - 0.75).abs() < 1e-12);
}

#[test]
fn a_registered_comm_hook_reduces_every_bucket() {
    use std::sync::{Arc, Mutex};
    const W: usize = 3;
    run_ranks(W, T, |rank, pg| {
        let mut red = Reducer::new(&pg, mixed_specs(), small()).unwrap();
        let buckets = red.buckets();
        // (bucket index, is_last, parameters) of every hook call.
        type Calls = Vec<(usize, bool, Vec<usize>)>;
        let seen: Arc<Mutex<Calls>> = Arc::default();
        let log = seen.clone();
        // Sum instead of average: PyTorch's `register_comm_hook(state, hook)` with a custom hook.
        red.register_comm_hook(move |pg: &ProcessGroup, bucket: GradBucket| {
            let params = bucket.parameters().iter().map(|p| p.index).collect();
            log.lock()
                .unwrap()
                .push((bucket.index(), bucket.is_last(), params));
            bucket.into_buffer().all_reduce(pg, ReduceOp::Sum)
        })
        .unwrap();
        for step in 0..2 {
            for i in (0..12).rev() {
                mark(&mut red, rank, i, 1.0).unwrap();
            }
            red.finish().unwrap();
            for i in 0..12 {
                for (k, v) in read(&red, i).iter().enumerate() {
                    let want = (0..W).map(|r| g(r, i, k)).sum::<f64>();
                    assert!(
                        (v - want).abs() < 1e-4,
                        "step {step} param {i}[{k}]: {v} vs {want}"
                    );
                }
            }
        }
        let seen = seen.lock().unwrap();
        assert_eq!(
            seen.len(),
            2 * buckets.len(),
            "the hook ran once per bucket and step"
        );
        for (n, (index, is_last, params)) in seen.iter().enumerate() {
            let b = n % buckets.len();
            assert_eq!(*index, b);
            assert_eq!(*is_last, b + 1 == buckets.len());
            assert_eq!(params, &buckets[b].params);
        }
    });
}

#[test]
fn comm_hook_then_runs_after_the_collective_and_bad_buffers_fail_the_step() {
    run_ranks(2, T, |rank, pg| {
        let specs = vec![ParamSpec::new("a", vec![4], DType::F32)];
        let mut red = Reducer::new(&pg, specs.clone(), ReducerOptions::default()).unwrap();
        // Sum, then halve and add 1 in `then`: shows the chained step ran on the reduced buffer.
        red.register_comm_hook(|pg: &ProcessGroup, b: GradBucket| {
            b.into_buffer()
                .all_reduce(pg, ReduceOp::Sum)
                .then(|mut buf| {
                    for x in buf.as_host_mut().unwrap().as_mut_slice::<f32>().unwrap() {
                        *x = *x / 2.0 + 1.0;
                    }
                    Ok(buf)
                })
        })
        .unwrap();
        let e = red.register_comm_hook(AllReduceHook).unwrap_err();
        assert!(e.to_string().contains("already registered"), "{e}");
        red.mark_ready(0, &[rank as f32 + 1.0; 4]).unwrap();
        red.finish().unwrap();
        assert_eq!(red.grad::<f32>(0).unwrap(), &[2.5; 4]);

        // A hook returning a buffer of the wrong length fails the step (on every rank).
        let mut red = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
        red.mark_ready(0, &[1.0f32; 4]).unwrap();
        let e = red.register_comm_hook(AllReduceHook).unwrap_err();
        assert!(e.to_string().contains("in progress"), "{e}");
        red.finish().unwrap();
        red.register_comm_hook(|_: &ProcessGroup, _: GradBucket| {
            BucketWork::ready(Ok(BucketBuffer::Host(HostBuffer::from(vec![0f32; 3]))))
        })
        .unwrap();
        red.mark_ready(0, &[1.0f32; 4]).unwrap();
        let e = red.finish().unwrap_err().to_string();
        assert!(e.contains("f32 buffer of 3 elements for bucket 0"), "{e}");
    });
}

/// A stand-in for a device bucket: host memory behind the `DeviceBucket` trait, counting the
/// reductions it was asked for.
#[derive(Debug)]
struct FakeDevice {
    mem: HostBuffer,
    reductions: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl DeviceBucket for FakeDevice {
    fn dtype(&self) -> DType {
        self.mem.dtype()
    }
    fn len(&self) -> usize {
        self.mem.len()
    }
    fn write(&mut self, offset: usize, src: HostSlice<'_>, add: bool) -> Result<(), String> {
        self.mem.write(offset, src, add)
    }
    fn zero_range(&mut self, start: usize, len: usize) {
        self.mem.zero_range(start, len)
    }
    fn div_by(&mut self, n: usize) {
        self.mem.div_by(n)
    }
    fn first_nonfinite(&self, start: usize, len: usize) -> Option<usize> {
        self.mem.range(start, len).first_nonfinite()
    }
    fn to_host(&self, start: usize, len: usize) -> HostBuffer {
        self.mem.range(start, len).to_buffer()
    }
    fn all_reduce(self: Box<Self>, pg: &ProcessGroup, op: ReduceOp) -> BucketWork {
        let counter = self.reductions.clone();
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.mem.all_reduce(pg, op).then(move |b| {
            let BucketBuffer::Host(mem) = b else {
                unreachable!("host memory reduces to host memory")
            };
            Ok(BucketBuffer::Device(Box::new(FakeDevice {
                mem,
                reductions: counter,
            })))
        })
    }
}

#[test]
fn device_buckets_reduce_like_host_buckets() {
    const W: usize = 2;
    run_ranks(W, T, |rank, pg| {
        let reductions = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let mut red = Reducer::with_buffers(&pg, mixed_specs(), small(), |b| {
            BucketBuffer::Device(Box::new(FakeDevice {
                mem: HostBuffer::zeros(b.dtype, b.numel),
                reductions: reductions.clone(),
            }))
        })
        .unwrap();
        red.set_check_finite(true);
        for i in 0..12 {
            if i != 7 {
                mark(&mut red, rank, i, 1.0).unwrap();
            }
        }
        red.finish().unwrap();
        let n = red.buckets().len();
        assert_eq!(reductions.load(std::sync::atomic::Ordering::SeqCst), n);
        for i in 0..12 {
            let got: Vec<f64> = red
                .with_grad(i, |s| match s {
                    HostSlice::F32(v) => v.iter().map(|&x| x as f64).collect(),
                    HostSlice::F64(v) => v.to_vec(),
                    other => panic!("{other:?}"),
                })
                .unwrap();
            for (k, v) in got.iter().enumerate() {
                let want = if i == 7 {
                    0.0
                } else {
                    (0..W).map(|r| g(r, i, k)).sum::<f64>() / W as f64
                };
                assert!((v - want).abs() < 1e-5, "param {i}[{k}]: {v} vs {want}");
            }
        }
        let e = red.grad::<f32>(1).unwrap_err().to_string();
        assert!(e.contains("device bucket"), "{e}");
        // An allocator that returns the wrong size is refused.
        let e = Reducer::with_buffers(&pg, mixed_specs(), small(), |b| {
            BucketBuffer::Host(HostBuffer::zeros(b.dtype, b.numel + 1))
        })
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("the allocator returned"), "{e}");
    });
}

#[test]
fn non_finite_gradients_fail_every_rank_naming_step_rank_and_parameter() {
    const W: usize = 3;
    let errs = run_ranks(W, T, |rank, pg| {
        let mut red = Reducer::new(&pg, mixed_specs(), small()).unwrap();
        red.set_check_finite(true);
        red.set_step(10);
        let mut errors = Vec::new();
        for step in 0..4 {
            for i in (0..12).rev() {
                let spec = red.specs()[i].clone();
                let mut v: Vec<f32> = (0..spec.numel()).map(|k| g(rank, i, k) as f32).collect();
                if spec.dtype == DType::F64 {
                    let v: Vec<f64> = v.iter().map(|&x| x as f64).collect();
                    red.mark_ready(i, &v).unwrap();
                    continue;
                }
                // Step 1: ranks 1 and 2 produce NaN / inf in p05 (rank 2 also in p08, marked
                // earlier); step 2: every rank finite but the sum overflows in p04.
                if step == 1 && i == 5 && rank == 1 {
                    v[3] = f32::NAN;
                }
                if step == 1 && (i == 5 || i == 8) && rank == 2 {
                    v[0] = f32::INFINITY;
                }
                if step == 2 && i == 4 {
                    v[1] = f32::MAX;
                }
                red.mark_ready(i, &v).unwrap();
            }
            match red.finish() {
                Ok(_) => errors.push(None),
                Err(Error::NonFinite {
                    step,
                    rank,
                    parameter,
                    ranks,
                }) => errors.push(Some((step, rank, parameter, ranks))),
                Err(e) => panic!("{e}"),
            }
        }
        // The error message names the step, the rank and the parameter.
        red.set_check_finite(true);
        red.mark_ready(2, &vec![f32::NAN; red.specs()[2].numel()])
            .unwrap();
        let msg = red.finish().unwrap_err().to_string();
        let who = "rank 0 produced a NaN or infinite gradient of parameter `p02`";
        let _ = rank;
        assert!(msg.contains("at step 14") && msg.contains(who), "{msg}");
        errors
    });
    for e in &errs {
        assert_eq!(
            e,
            &vec![
                None,
                Some((11, Some(1), "p05".to_string(), vec![1, 2])),
                Some((12, None, "p04".to_string(), vec![])),
                None,
            ]
        );
    }
}

#[test]
fn without_the_check_non_finite_gradients_pass() {
    run_ranks(2, T, |_, pg| {
        let specs = vec![ParamSpec::new("a", vec![2], DType::F32)];
        let mut red = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
        assert!(!red.check_finite());
        red.mark_ready(0, &[f32::NAN, 1.0]).unwrap();
        red.finish().unwrap();
        assert!(red.grad::<f32>(0).unwrap()[0].is_nan());
    });
}

/// Rank `r`'s gradient of parameter `i` as a host buffer of the parameter's dtype.
fn grad_buf(red: &Reducer, r: usize, i: usize, scale: f64) -> HostBuffer {
    let spec = &red.specs()[i];
    let v: Vec<f64> = (0..spec.numel()).map(|k| g(r, i, k) * scale).collect();
    match spec.dtype {
        DType::F32 => HostBuffer::from(v.iter().map(|&x| x as f32).collect::<Vec<_>>()),
        _ => HostBuffer::from(v),
    }
}

fn to_f64(s: HostSlice<'_>) -> Vec<f64> {
    match s {
        HostSlice::F32(v) => v.iter().map(|&x| x as f64).collect(),
        HostSlice::F64(v) => v.to_vec(),
        other => panic!("{other:?}"),
    }
}

/// The device path (gradients handed over as `DeviceSlice`s, flattened into and read back out
/// of `DeviceBucket`s) through the CPU implementation of the trait: bit-identical to host
/// buckets over 1, 2, 3 and 5 ranks, with no_sync accumulation, unused parameters, a Join
/// divisor and the finite check; wrong memory kinds are named errors.
#[test]
fn device_path_through_cpu_buckets_matches_host_buckets_bit_for_bit() {
    for world in [1usize, 2, 3, 5] {
        run_ranks(world, T, |rank, pg| {
            let mut host = Reducer::new(&pg, mixed_specs(), small()).unwrap();
            let mut dev = Reducer::with_buffers(&pg, mixed_specs(), small(), |b| {
                CpuBucket::zeros(b.dtype, b.numel)
            })
            .unwrap();
            assert!((0..12).all(|i| dev.is_device_bucket(i) && !host.is_device_bucket(i)));
            for red in [&mut host, &mut dev] {
                red.set_check_finite(true);
            }
            // Step 0: plain. Step 1: a no_sync micro-batch, then a synced one (accumulated sum).
            // Step 2: parameter 7 unused, divisor 1 (Join: one rank with data).
            for step in 0..3 {
                let micro = if step == 1 { 2 } else { 1 };
                for m in 0..micro {
                    let sync = m + 1 == micro;
                    if step == 2 {
                        host.set_divisor(1).unwrap();
                        dev.set_divisor(1).unwrap();
                    }
                    for red in [&mut host, &mut dev] {
                        red.set_require_backward_grad_sync(sync);
                    }
                    for i in (0..12).rev().filter(|&i| step != 2 || i != 7) {
                        let scale = 1.0 + m as f64 + step as f64;
                        let buf = grad_buf(&host, rank, i, scale);
                        host.mark_ready_flat(i, buf.as_host_slice()).unwrap();
                        dev.mark_ready_device(i, DeviceSlice::Cpu(buf.as_host_slice()))
                            .unwrap();
                    }
                    let (a, b) = if step == 2 {
                        (host.finish_with_divisor(1), dev.finish_with_divisor(1))
                    } else {
                        (host.finish(), dev.finish())
                    };
                    assert_eq!(a.unwrap().synced, b.unwrap().synced);
                }
                for i in 0..12 {
                    let want = host.with_grad(i, to_f64).unwrap();
                    let got = dev
                        .with_device_grad(i, |d| match d {
                            DeviceSlice::Cpu(s) => to_f64(s),
                            other => panic!("{}", other.describe()),
                        })
                        .unwrap()
                        .expect("a cpu bucket offers device views");
                    assert_eq!(got, want, "world {world} step {step} param {i}");
                    assert_eq!(dev.with_grad(i, to_f64).unwrap(), want);
                    assert_eq!(host.with_device_grad(i, |_| ()).unwrap(), None);
                }
            }
            // A device gradient for a host bucket, and the wrong dtype or length, are named.
            let buf = grad_buf(&host, rank, 4, 1.0);
            let e = host
                .mark_ready_device(4, DeviceSlice::Cpu(buf.as_host_slice()))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("p04") && e.contains("written into a host bucket"),
                "{e}"
            );
            let e = dev
                .mark_ready_device(4, DeviceSlice::Cpu(HostSlice::of(&[1.0f64; 3])))
                .unwrap_err()
                .to_string();
            assert!(e.contains("p04") && e.contains("given as f64"), "{e}");
            let e = dev
                .mark_ready_device(5, DeviceSlice::Cpu(HostSlice::of(&[1.0f32; 3])))
                .unwrap_err()
                .to_string();
            assert!(e.contains("p05") && e.contains("has 3 elements"), "{e}");
        });
    }
}

/// `n` f32 parameters `p0..` of 37 + 41 i elements (odd sizes, some not multiples of 3).
fn odd_specs(n: usize) -> Vec<ParamSpec> {
    (0..n)
        .map(|i| ParamSpec::new(format!("p{i}"), vec![37 + 41 * i], DType::F32))
        .collect()
}

/// A hook that returns this rank's shard of each bucket (ZeRO stage 2's reduce-scatter): the
/// shard is the average of that chunk, per-parameter reads are refused naming it, and the next
/// backward gets full buckets again.
#[test]
fn a_sharding_hook_returns_each_ranks_chunk_and_per_parameter_reads_are_refused() {
    const W: usize = 3;
    let specs = odd_specs(5);
    let opts = ReducerOptions {
        bucket_cap_mb: 700.0 / MIB,
        first_bucket_cap_mb: 512.0 / MIB,
    };
    // Every bucket as its chunk alone; then the last two whole (stage 2 keeping them).
    for whole_from in [usize::MAX, 2] {
        run_ranks(W, T, |rank, pg| {
            let mut red = Reducer::new(&pg, specs.clone(), opts).unwrap();
            let n = red.buckets().len();
            assert!(n >= 3, "{n} buckets");
            let whole_from = whole_from.min(n - 2);
            let hook = crate::sharding::ReduceScatterHook::shard_only();
            red.register_comm_hook(if whole_from == n - 2 {
                hook.whole_from(whole_from)
            } else {
                hook
            })
            .unwrap();
            let layout =
                crate::sharding::ShardLayout::new(red.specs(), &red.buckets(), W, rank).unwrap();
            for step in 0..2 {
                for i in 0..5 {
                    mark(&mut red, rank, i, step as f64 + 1.0).unwrap();
                }
                red.finish().unwrap();
                let e = red.grad::<f32>(0).unwrap_err().to_string();
                assert!(e.contains("shard") && e.contains("bucket_grads"), "{e}");
                for c in layout.chunks() {
                    let got = red.bucket_grads::<f32>(c.bucket).unwrap();
                    let whole = c.bucket >= whole_from;
                    let numel = layout.buckets()[c.bucket].numel;
                    assert_eq!(
                        got.len(),
                        if whole { numel } else { c.len() },
                        "bucket {} holds {}",
                        c.bucket,
                        if whole { "itself" } else { "the chunk alone" }
                    );
                    let at = if whole { c.lo } else { 0 };
                    for p in layout.pieces(&c) {
                        for k in 0..p.len {
                            let e = p.param_offset + k;
                            let want = (0..W)
                                .map(|r| (g(r, p.param, e) * (step as f64 + 1.0)) as f32 as f64)
                                .sum::<f64>()
                                / W as f64;
                            let v = got[at + p.chunk_offset + k] as f64;
                            assert!(
                                (v - want).abs() < 1e-5,
                                "param {} [{e}]: {v} vs {want}",
                                p.param
                            );
                        }
                    }
                }
                let shards = crate::sharding::take_shard_grads(&layout, &mut red).unwrap();
                assert_eq!(shards.len(), layout.chunks().len());
                for (i, c) in layout.chunks().iter().enumerate() {
                    assert_eq!(shards.chunk(i).len(), c.len());
                }
            }
        });
    }
}

/// Host buckets are allocated with room for a sharding hook's padding to equal blocks (a
/// bucket of 7 elements at world 3 is padded to 9 in place), at construction and whenever a
/// taken bucket is reallocated, so that the reduce-scatter never reallocates and copies a
/// bucket on the communication thread.
#[test]
fn host_buckets_have_room_for_padding_to_equal_blocks() {
    use crate::reducer::{BucketBuffer, GradBucket};
    use crate::sharding::ReduceScatterHook;
    use std::sync::{Arc, Mutex};

    /// Records each bucket's (index, length, capacity) as it reaches the hook.
    struct Recording(ReduceScatterHook, Arc<Mutex<Vec<(usize, usize, usize)>>>);
    impl CommHook for Recording {
        fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> BucketWork {
            if let BucketBuffer::Host(h) = bucket.buffer() {
                self.1
                    .lock()
                    .unwrap()
                    .push((bucket.index(), h.len(), h.capacity()));
            }
            self.0.run(pg, bucket)
        }
        fn shard_range(&self, pg: &ProcessGroup, b: usize, numel: usize) -> Option<ShardRange> {
            self.0.shard_range(pg, b, numel)
        }
    }

    const W: usize = 3;
    // One parameter per bucket, some sizes not multiples of 3.
    let specs = odd_specs(4);
    let opts = ReducerOptions {
        bucket_cap_mb: 1.0 / MIB,
        first_bucket_cap_mb: 1.0 / MIB,
    };
    for hook in [
        ReduceScatterHook::in_place(),
        ReduceScatterHook::shard_only(),
    ] {
        let specs = specs.clone();
        run_ranks(W, T, move |rank, pg| {
            let mut red = Reducer::new(&pg, specs.clone(), opts).unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            red.register_comm_hook(Recording(hook, seen.clone()))
                .unwrap();
            let layout =
                crate::sharding::ShardLayout::new(red.specs(), &red.buckets(), W, rank).unwrap();
            for step in 0..3 {
                for i in 0..4 {
                    mark(&mut red, rank, i, step as f64 + 1.0).unwrap();
                }
                red.finish().unwrap();
                // The buckets are taken (reallocated at the next backward).
                crate::sharding::take_shard_grads(&layout, &mut red).unwrap();
            }
            let seen = seen.lock().unwrap();
            assert_eq!(seen.len(), 3 * red.buckets().len());
            assert!(seen.iter().any(|&(_, len, _)| len % W != 0));
            for &(b, len, cap) in seen.iter() {
                assert!(
                    cap >= len.next_multiple_of(W),
                    "bucket {b}: {len} elements, room for {cap}"
                );
            }
        });
    }
}
