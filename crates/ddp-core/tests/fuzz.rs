//! Fuzzing checkpoint loading: random bytes; valid checkpoints truncated or with bytes
//! overwritten; forged files of the unverified legacy format (random dtypes, shapes, offsets and
//! metadata); and valid checkpoints of another run checked against this one. Every input must
//! load or give a clear `Error`, never a panic, and loading may not allocate out of proportion
//! to the file.
//!
//! `FUZZ_CASES` sets the inputs per target (default small, for CI); a long pass:
//! `FUZZ_CASES=1000000 cargo test -p ddp-core --test fuzz`.

use ddp_comm::fuzzing::{cases, largest_allocation_during, TrackingAlloc};
use ddp_core::checkpoint::{RunPlan, TrainingState};
use ddp_core::{Checkpoint, CheckpointMeta, SamplerState};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::json;

#[global_allocator]
static ALLOC: TrackingAlloc = TrackingAlloc;

fn runner(default: u32) -> TestRunner {
    TestRunner::new(Config {
        cases: cases(default),
        failure_persistence: None,
        ..Config::default()
    })
}

/// Loading may allocate a few times the file (tensors as `f32`, names, the parsed header).
fn bound(len: usize) -> usize {
    8 * len + (256 << 10)
}

fn load(bytes: &[u8]) -> Result<Checkpoint, String> {
    let (got, peak) = largest_allocation_during(|| Checkpoint::from_bytes(bytes, "fuzz input"));
    assert!(
        peak <= bound(bytes.len()),
        "{peak} bytes allocated to load {} bytes",
        bytes.len()
    );
    got.map_err(|e| e.to_string())
}

fn meta() -> impl Strategy<Value = CheckpointMeta> {
    let big = prop_oneof![0u64..100, any::<u64>()];
    (big.clone(), big.clone(), 0usize..1000, 1usize..8).prop_map(
        |(step, epoch, consumed, world)| CheckpointMeta {
            step,
            epoch,
            sampler: SamplerState { epoch, consumed },
            rng_state: 7,
            world_size: world,
            extra: json!({"lr": 0.1}),
        },
    )
}

/// A valid checkpoint: a few tensors of random small shapes, maybe a blob.
fn checkpoint() -> impl Strategy<Value = Checkpoint> {
    let tensor = (
        "[a-z]{1,6}(\\.[a-z]{1,6})?",
        vec(0usize..5, 0..3),
        any::<u32>(),
    );
    (meta(), vec(tensor, 0..4), vec(any::<u8>(), 0..8)).prop_map(|(mut m, ts, blob)| {
        m.step %= 1 << 20;
        m.epoch %= 1 << 20;
        m.sampler.epoch = m.epoch;
        let mut c = Checkpoint::new(m);
        for (name, shape, seed) in ts {
            let n: usize = shape.iter().product();
            let data = (0..n)
                .map(|i| (i as f32) * 0.5 - seed as f32 * 1e-9)
                .collect();
            c.insert(name, shape, data).unwrap();
        }
        if !blob.is_empty() {
            c.insert_blob("blob.record", blob);
        }
        c
    })
}

#[test]
fn random_bytes_never_load() {
    runner(20_000)
        .run(&vec(any::<u8>(), 0..512), |bytes| {
            prop_assert!(load(&bytes).is_err());
            Ok(())
        })
        .unwrap();
}

#[test]
fn truncated_or_corrupted_checkpoints_are_refused_with_a_reason() {
    let strat = (
        checkpoint(),
        any::<prop::sample::Index>(),
        vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    );
    runner(5_000)
        .run(&strat, |(ck, cut, edits)| {
            let good = ck.to_bytes().unwrap();
            prop_assert_eq!(&load(&good).unwrap(), &ck);
            // Every strict prefix is refused.
            let n = cut.index(good.len());
            let e = load(&good[..n]).unwrap_err();
            prop_assert!(e.contains("fuzz input"), "{}", e);
            // Overwritten bytes: refused (checksums), or the same checkpoint when the bytes
            // written were the ones already there or in JSON whitespace/padding.
            let mut bad = good.clone();
            for (i, b) in edits {
                let i = i.index(bad.len());
                bad[i] = b;
            }
            match load(&bad) {
                Ok(back) => prop_assert_eq!(&back, &ck),
                Err(e) => prop_assert!(e.contains("fuzz input"), "{}", e),
            }
            Ok(())
        })
        .unwrap();
}

/// A safetensors file of the legacy format (no checksums: the loader trusts the header most):
/// tensors of random dtypes and shapes (dims up to 2^64 - 1) laid out as the header says, then
/// maybe one lie: an end offset, the header length or the data length.
fn forged_legacy_file() -> impl Strategy<Value = Vec<u8>> {
    let dim = prop_oneof![
        6 => 0u64..5,
        1 => any::<u64>(),
        1 => Just(u64::MAX),
        1 => Just(1u64 << 62)
    ];
    let dtype = prop_oneof![
        4 => Just("F32"),
        2 => Just("U8"),
        1 => proptest::sample::select(vec!["F64", "I64", "BF16", "BOOL", "X"])
    ];
    let entry = ("[a-z.]{1,8}", dtype, vec(dim, 0..3));
    let count = prop_oneof![3 => 0u64..1000, 1 => any::<u64>()];
    // 0: no lie; 1: the first end offset; 2: the header length; 3: the data length.
    let lie = prop_oneof![4 => Just(0u8), 1 => 1u8..4];
    (
        vec(entry, 0..4),
        (count.clone(), count, 0u64..8),
        lie,
        any::<u64>(),
        vec(any::<u8>(), 0..16),
    )
        .prop_map(|(entries, (step, consumed, world), lie, junk, tail)| {
            let meta = json!({
                "format_version": 1,
                "step": step, "epoch": step,
                "sampler": {"epoch": step, "consumed": consumed},
                "rng_state": 1, "world_size": world, "extra": null
            });
            let mut header = serde_json::Map::new();
            header.insert("__metadata__".into(), json!({"ddp_meta": meta.to_string()}));
            let mut data = Vec::new();
            let mut cursor = 0u64;
            for (k, (name, dtype, shape)) in entries.into_iter().enumerate() {
                let elem: u64 = match dtype {
                    "F32" => 4,
                    "F64" | "I64" => 8,
                    "BF16" => 2,
                    _ => 1,
                };
                let n = shape.iter().fold(1u64, |a, &d| a.saturating_mul(d));
                let size = n.saturating_mul(elem);
                let mut end = cursor.saturating_add(size);
                if lie == 1 && k == 0 {
                    end = junk;
                }
                header.insert(
                    name,
                    json!({"dtype": dtype, "shape": shape, "data_offsets": [cursor, end]}),
                );
                // The bytes themselves only when they are few (else the file is short).
                if size <= 4096 {
                    data.extend((0..n).flat_map(|i| match elem {
                        4 => (i as f32).to_le_bytes().to_vec(),
                        e => vec![i as u8; e as usize],
                    }));
                }
                cursor = end;
            }
            let h = serde_json::Value::Object(header).to_string().into_bytes();
            let len = if lie == 2 { junk } else { h.len() as u64 };
            if lie == 3 {
                if tail.is_empty() {
                    data.pop();
                } else {
                    data.extend(tail);
                }
            }
            let mut file = len.to_le_bytes().to_vec();
            file.extend(h);
            file.extend(data);
            file
        })
}

#[test]
fn forged_headers_of_the_unverified_format_load_only_when_consistent() {
    let loaded = std::cell::Cell::new(0u64);
    runner(20_000)
        .run(&forged_legacy_file(), |file| {
            if let Ok(ck) = load(&file) {
                loaded.set(loaded.get() + 1);
                // Whatever loads is consistent: every tensor's shape matches its data and
                // its values are finite; the position is in range.
                for (name, t) in &ck.tensors {
                    let n = t.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
                    prop_assert_eq!(n, Some(t.data.len()), "{}", name);
                    prop_assert!(t.data.iter().all(|v| v.is_finite()));
                }
                prop_assert!(ck.meta.validate().is_ok());
            }
            Ok(())
        })
        .unwrap();
    eprintln!("forged legacy files: {} loaded (consistent)", loaded.get());
}

#[test]
fn a_checkpoint_of_another_run_is_refused_by_the_run_plan() {
    let plan = RunPlan {
        world_size: 2,
        samples_per_epoch: 719,
        batch_size: 32,
        epochs: 6,
        max_steps: None,
        hyper: json!({"lr": 0.1}),
        rng_state: 7,
    };
    runner(20_000)
        .run(&meta(), |m| {
            match plan.check(&m) {
                Ok(TrainingState {
                    step,
                    epoch,
                    consumed,
                }) => {
                    prop_assert!(epoch <= plan.epochs && consumed <= plan.samples_per_epoch);
                    prop_assert_eq!(
                        step,
                        epoch * plan.steps_per_epoch() + consumed.div_ceil(32) as u64
                    );
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
            Ok(())
        })
        .unwrap();
}

#[test]
fn a_checkpoint_of_any_world_size_is_checked_by_its_global_position() {
    let plan = RunPlan {
        world_size: 3,
        samples_per_epoch: 479,
        batch_size: 32,
        epochs: 6,
        max_steps: Some(500),
        hyper: json!({"lr": 0.1}),
        rng_state: 7,
    };
    let global = prop_oneof![
        Just(serde_json::Value::Null),
        (0u64..3000).prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        "\\PC{0,8}".prop_map(serde_json::Value::from),
    ];
    runner(20_000)
        .run(&(meta(), global), |(mut m, g)| {
            if !g.is_null() {
                m.extra[ddp_core::checkpoint::GLOBAL_CONSUMED_KEY] = g;
            }
            match plan.check_global(&m, 1437) {
                Ok(p) => {
                    prop_assert!(p.epoch <= plan.epochs && p.step <= 500);
                    prop_assert!(p.global_consumed < 1437 + m.world_size);
                    prop_assert!(p.epoch < plan.epochs || p.global_consumed == 0);
                }
                Err(e) => prop_assert!(!e.to_string().is_empty()),
            }
            Ok(())
        })
        .unwrap();
}

/// What the forged-header target found: an end offset near 2^64 made safetensors 0.4 overflow
/// (`buffer_end + 8 + n`), a panic with overflow checks. Now a named error.
#[test]
fn an_end_offset_near_two_to_the_64_is_an_error_not_an_overflow() {
    let header = format!(
        r#"{{"__metadata__":{{"ddp_meta":"{{}}"}},"t":{{"dtype":"U8","shape":[1],"data_offsets":[0,{}]}}}}"#,
        u64::MAX - 4
    );
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.push(7);
    let e = load(&file).unwrap_err();
    assert!(e.contains("claims data up to byte"), "{e}");
}
