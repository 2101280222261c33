//! Fuzzing checkpoint loading into the wrong model: checkpoints whose tensors are missing, extra
//! or of other shapes than the model's, written and read back as files are, then loaded into
//! candle variables. A load succeeds only when every tensor matches, and otherwise names the
//! offending tensor and leaves the model unchanged (all or nothing).
//!
//! `FUZZ_CASES` sets the number of checkpoints (default small, for CI); a long pass:
//! `FUZZ_CASES=1000000 cargo test -p ddp-candle --test fuzz`.

use candle_core::{DType, Device, Var};
use ddp_candle::checkpoint::load_vars;
use ddp_comm::fuzzing::cases;
use ddp_core::{Checkpoint, CheckpointMeta};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

/// The model: name and shape of each parameter.
const MODEL: &[(&str, &[usize])] = &[
    ("fc1.weight", &[4, 3]),
    ("fc1.bias", &[4]),
    ("fc2.weight", &[2, 4]),
    ("fc2.bias", &[2]),
];

/// What a checkpoint holds for one of the model's parameters.
#[derive(Debug, Clone)]
enum Entry {
    Missing,
    Right,
    Shape(Vec<usize>),
}

fn entry() -> impl Strategy<Value = Entry> {
    prop_oneof![
        1 => Just(Entry::Missing),
        4 => Just(Entry::Right),
        1 => vec(0usize..6, 0..4).prop_map(Entry::Shape),
    ]
}

#[test]
fn a_checkpoint_of_another_model_is_refused_and_changes_nothing() {
    let vars: Vec<(String, Var)> = MODEL
        .iter()
        .map(|(n, s)| {
            let v = Var::zeros(*s, DType::F32, &Device::Cpu).unwrap();
            (n.to_string(), v)
        })
        .collect();
    let strat = (
        vec(entry(), MODEL.len()),
        vec("[a-z]{1,4}\\.[a-z]{1,6}", 0..3),
    );
    let mut runner = TestRunner::new(Config {
        cases: cases(2_000),
        failure_persistence: None,
        ..Config::default()
    });
    let generation = std::cell::Cell::new(0f32);
    runner
        .run(&strat, |(entries, extra)| {
            generation.set(generation.get() + 1.0);
            let generation = generation.get();
            let mut ck = Checkpoint::new(CheckpointMeta::default());
            for ((name, shape), e) in MODEL.iter().zip(&entries) {
                let shape = match e {
                    Entry::Missing => continue,
                    Entry::Right => shape.to_vec(),
                    Entry::Shape(s) => s.clone(),
                };
                let n = shape.iter().product();
                ck.insert(*name, shape, vec![generation; n]).unwrap();
            }
            for name in extra {
                ck.insert(name, vec![1], vec![generation]).unwrap();
            }
            let ck = Checkpoint::from_bytes(&ck.to_bytes().unwrap(), "fuzz").unwrap();
            let before: Vec<Vec<f32>> = vars
                .iter()
                .map(|(_, v)| v.flatten_all().unwrap().to_vec1().unwrap())
                .collect();
            let fits = MODEL.iter().zip(&entries).all(|((_, s), e)| match e {
                Entry::Missing => false,
                Entry::Right => true,
                Entry::Shape(got) => got == s,
            });
            match load_vars(&ck, &vars) {
                Ok(()) => {
                    prop_assert!(fits, "loaded a checkpoint of another model: {entries:?}");
                    for (_, v) in &vars {
                        let got: Vec<f32> = v.flatten_all().unwrap().to_vec1().unwrap();
                        prop_assert!(got.iter().all(|x| *x == generation));
                    }
                }
                Err(e) => {
                    prop_assert!(!fits, "refused a fitting checkpoint: {e}");
                    let msg = e.to_string();
                    prop_assert!(MODEL.iter().any(|(n, _)| msg.contains(n)), "{msg}");
                    let after: Vec<Vec<f32>> = vars
                        .iter()
                        .map(|(_, v)| v.flatten_all().unwrap().to_vec1().unwrap())
                        .collect();
                    prop_assert_eq!(after, before, "a refused load changed the model");
                }
            }
            Ok(())
        })
        .unwrap();
}
