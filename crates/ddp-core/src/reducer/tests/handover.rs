//! Bucket buffers handed over and back between steps (`state/handover.rs`): taken after a
//! synchronized finish, recycled into their buckets, given as spares.

use super::*;

/// `take_averaged_buffers` hands over exactly what `grad` reads, once per synchronized step;
/// the next backward reallocates the buckets (zeroed: a parameter left unmarked counts as zero)
/// and averages correctly again.
#[test]
fn averaged_buffers_are_handed_over_once_and_the_buckets_come_back() {
    const W: usize = 2;
    run_ranks(W, T, |rank, pg| {
        let mut red = Reducer::new(&pg, mixed_specs(), small()).unwrap();
        let e = red.take_averaged_buffers().unwrap_err().to_string();
        assert!(e.contains("no synchronized gradients"), "{e}");
        for step in 0..3 {
            // Step 1 leaves parameter 4 unmarked on every rank: zeros, not last step's values.
            for i in (0..12).filter(|&i| step != 1 || i != 4) {
                mark(&mut red, rank, i, step as f64 + 1.0).unwrap();
            }
            red.finish().unwrap();
            let want: Vec<Vec<f64>> = (0..12).map(|i| read(&red, i)).collect();
            assert!(red.bucket_grads::<f32>(red.buckets().len()).is_err());
            // Each bucket whole, as one slice (ZeRO reads its chunk so).
            let wholes: Vec<Vec<f64>> = (0..red.buckets().len())
                .map(|b| match red.bucket_grads::<f32>(b) {
                    Ok(v) => v.iter().map(|&x| x as f64).collect(),
                    Err(_) => red.bucket_grads::<f64>(b).unwrap().to_vec(),
                })
                .collect();
            let taken = red.take_averaged_buffers().unwrap();
            assert_eq!(taken.len(), red.buckets().len());
            let mut seen = 0;
            for (b, (buffer, layout)) in taken.iter().map(|t| t.as_ref().unwrap()).enumerate() {
                for p in layout.iter() {
                    assert_eq!(
                        wholes[b][p.offset..p.offset + p.numel],
                        want[p.index][..],
                        "bucket_grads({b}), param {}",
                        p.index
                    );
                    let got: Vec<f64> = match buffer.range(p.offset, p.numel) {
                        HostSlice::F32(v) => v.iter().map(|&x| x as f64).collect(),
                        HostSlice::F64(v) => v.to_vec(),
                        other => panic!("{:?}", other.dtype()),
                    };
                    assert_eq!(got, want[p.index], "step {step}, param {}", p.index);
                    if step == 1 && p.index == 4 {
                        assert!(got.iter().all(|&x| x == 0.0));
                    }
                    seen += 1;
                }
            }
            assert_eq!(seen, 12);
            // Handed over: neither readable here nor to be taken twice.
            assert!(red.grad::<f32>(1).is_err());
            assert!(red.bucket_grads::<f32>(0).is_err());
            assert!(red.take_averaged_buffers().is_err());
        }
    });
}

/// Every element NaN (an f32 or f64 buffer): what a recycled or spare buffer may hold.
fn fill_nan(h: &mut HostBuffer) {
    match h {
        HostBuffer::F32(v) => v.fill(f32::NAN),
        HostBuffer::F64(v) => v.fill(f64::NAN),
        _ => unreachable!("the tests' buckets are f32 or f64"),
    }
}

/// Buffers given back with `recycle_buffers` (holding anything: NaN here) carry the next
/// backward: every gradient overwrites its slot, an unused parameter's slot is zeroed, `no_sync`
/// accumulates from the first copy on. Wrong buffers are refused by bucket, changing nothing.
#[test]
fn recycled_buffers_carry_the_next_backward_whatever_they_hold() {
    const W: usize = 2;
    run_ranks(W, T, |rank, pg| {
        let mut red = Reducer::new(&pg, mixed_specs(), small()).unwrap();
        let n = red.buckets().len();
        // Before any take, every bucket still holds its buffer.
        let full: Vec<_> = red
            .buckets()
            .iter()
            .map(|b| Some(HostBuffer::zeros(b.dtype, b.numel)))
            .collect();
        let e = red.recycle_buffers(full).unwrap_err().to_string();
        assert!(e.contains("bucket 0") && e.contains("still holding"), "{e}");
        for step in 0..4 {
            // Step 1: parameter 4 unused. Step 3: a no_sync backward first (scale 1), then the
            // synchronized one (scale 4): the sum.
            if step == 3 {
                red.set_require_backward_grad_sync(false);
                for i in 0..12 {
                    mark(&mut red, rank, i, 1.0).unwrap();
                }
                red.finish().unwrap();
                red.set_require_backward_grad_sync(true);
            }
            for i in (0..12).filter(|&i| step != 1 || i != 4) {
                mark(&mut red, rank, i, step as f64 + 1.0).unwrap();
            }
            if step == 0 {
                let e = red.recycle_buffers(vec![None; n]).unwrap_err().to_string();
                assert!(e.contains("backward is in progress"), "{e}");
            }
            red.finish().unwrap();
            for i in 0..12 {
                let scale = match (step, i) {
                    (1, 4) => 0.0,
                    (3, _) => 5.0,
                    _ => step as f64 + 1.0,
                };
                for (k, v) in read(&red, i).iter().enumerate() {
                    let want = (0..W).map(|r| g(r, i, k)).sum::<f64>() * scale / W as f64;
                    assert!(
                        (v - want).abs() < 1e-4,
                        "step {step}, param {i}[{k}]: {v} vs {want}"
                    );
                }
            }
            let mut taken: Vec<_> = red
                .take_averaged_buffers()
                .unwrap()
                .into_iter()
                .map(|t| {
                    let mut h = t.unwrap().0;
                    let len = h.len();
                    h.resize(len + 3); // longer than the bucket: cut back
                    fill_nan(&mut h);
                    Some(h)
                })
                .collect();
            // Refusals, each naming the bucket; nothing is taken.
            let f64_bucket = red
                .buckets()
                .iter()
                .position(|b| b.dtype == DType::F64)
                .unwrap();
            let f32_bucket = red
                .buckets()
                .iter()
                .position(|b| b.dtype == DType::F32)
                .unwrap();
            let mut wrong = taken.clone();
            wrong[f32_bucket] = Some(HostBuffer::zeros(DType::F64, 1 << 12));
            let e = red.recycle_buffers(wrong).unwrap_err().to_string();
            assert!(e.contains(&format!("bucket {f32_bucket} ")), "{e}");
            let mut short = taken.clone();
            short[f64_bucket] = Some(HostBuffer::zeros(DType::F64, 1));
            let e = red.recycle_buffers(short).unwrap_err().to_string();
            assert!(e.contains(&format!("bucket {f64_bucket} ")), "{e}");
            assert!(red.recycle_buffers(vec![None; n + 1]).is_err());
            // Step 2 runs on freshly allocated buckets (one left out), the others on recycled.
            if step == 1 {
                taken[0] = None;
            }
            if step != 2 {
                red.recycle_buffers(taken).unwrap();
            }
        }
    });
}

/// Spare buffers (any values: NaN here; in any order) go to the buckets that lack one: one of
/// a bucket's own padded size to that bucket (not to an earlier, smaller one it would also
/// fit), otherwise, in the order the backward fills them, each bucket the smallest of its dtype
/// with room for the bucket padded to the world size; the others are dropped. The next
/// backward averages as on fresh buffers, including a bucket left without a spare.
#[test]
fn spare_buffers_carry_the_next_backward_own_size_then_smallest_fitting_first() {
    const W: usize = 3;
    run_ranks(W, T, |rank, pg| {
        let mut red = Reducer::new(&pg, mixed_specs(), small()).unwrap();
        let infos = red.buckets();
        let n = infos.len();
        let room = |b: usize| infos[b].numel.next_multiple_of(W);
        let big = 64 * infos.iter().map(|b| b.numel).max().unwrap();
        let nan = |dtype, len| {
            let mut h = HostBuffer::zeros(dtype, len);
            fill_nan(&mut h);
            h
        };
        for step in 0..4 {
            for i in (0..12).filter(|&i| step != 1 || i != 4) {
                mark(&mut red, rank, i, step as f64 + 1.0).unwrap();
            }
            if step == 0 {
                let e = red.give_spare_buffers(vec![]).unwrap_err().to_string();
                assert!(e.contains("backward is in progress"), "{e}");
            }
            red.finish().unwrap();
            for i in 0..12 {
                let scale = if (step, i) == (1, 4) {
                    0.0
                } else {
                    step as f64 + 1.0
                };
                for (k, v) in read(&red, i).iter().enumerate() {
                    let want = (0..W).map(|r| g(r, i, k)).sum::<f64>() * scale / W as f64;
                    assert!(
                        (v - want).abs() < 1e-4,
                        "step {step}, param {i}[{k}]: {v} vs {want}"
                    );
                }
            }
            let taken: Vec<HostBuffer> = red
                .take_averaged_buffers()
                .unwrap()
                .into_iter()
                .map(|t| t.unwrap().0)
                .collect();
            if step == 1 || step == 3 {
                // No bucket took the oversized decoy while a buffer of its own size fitted.
                assert!(taken.iter().all(|h| h.capacity() < big), "step {step}");
            }
            drop(taken);
            if step == 1 {
                // One spare for all: the first bucket of its dtype takes it; the rest allocate.
                let first = infos.iter().position(|b| b.dtype == DType::F64).unwrap();
                let took = red.give_spare_buffers(vec![nan(DType::F64, big)]).unwrap();
                assert_eq!(took, vec![first]);
            } else if step == 2 {
                // One spare of the size of an f32 bucket that an earlier, smaller f32 bucket
                // (the first, capped lower) would fit in: the bucket of its size takes it.
                let f32s: Vec<usize> = (0..n).filter(|&b| infos[b].dtype == DType::F32).collect();
                let later = *f32s
                    .iter()
                    .find(|&&b| f32s.iter().any(|&e| e < b && room(e) < room(b)))
                    .expect("an f32 bucket after a smaller one");
                let took = red
                    .give_spare_buffers(vec![nan(DType::F32, room(later))])
                    .unwrap();
                assert_eq!(took, vec![later]);
            } else {
                // A buffer of each bucket's padded size (in reverse), a decoy bigger than all
                // and one too small for any.
                let mut spares: Vec<_> =
                    (0..n).rev().map(|b| nan(infos[b].dtype, room(b))).collect();
                spares.insert(n / 2, nan(DType::F32, big));
                spares.push(nan(DType::F32, 1));
                let took = red.give_spare_buffers(spares).unwrap();
                assert_eq!(took, (0..n).collect::<Vec<_>>(), "step {step}");
            }
        }
    });
}
