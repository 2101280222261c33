//! `Fsdp::from_unit_init`: stage 3 built one unit at a time (the model never whole) equals
//! stage 3 built from the full `VarMap`, takes rank 0's values, and refuses bad units by name.
//! Ranks are threads with real process groups.

mod common;

use candle_core::{Tensor, Var};
use candle_nn::VarMap;
use common::zero::*;
use common::*;
use ddp_candle::{Fsdp, Unit};
use std::sync::{Arc, Mutex};

const LAYERS: [(&str, usize, usize); 3] = [("l1", IN, HID), ("l2", HID, HID), ("l3", HID, OUT)];

/// Values of `(name, tensor)` pairs, sorted by name.
fn values(mut ps: Vec<(String, Tensor)>) -> Vec<(String, Vec<f32>)> {
    ps.sort_by(|a, b| a.0.cmp(&b.0));
    ps.into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

fn train(f: &mut Fsdp, rank: usize, world: usize) {
    for k in 0..3 {
        let (xs, ys) = batch_at(k, rank, world);
        f.forward_backward(&xs, |o| candle_nn::loss::cross_entropy(o, &ys))
            .unwrap();
        f.step().unwrap();
    }
}

#[test]
fn building_unit_by_unit_equals_building_from_the_varmap_and_takes_rank_0s_values() {
    for world in [2, 3] {
        for opt in [Opt::SgdMomentum, Opt::AdamW] {
            let out = run_ranks(world, |rank, pg| {
                // Each rank draws its own random values; rank 0 records the ones it drew.
                let drawn: Arc<Mutex<Vec<(String, Tensor)>>> = Arc::default();
                let log = drawn.clone();
                let init = move |u: usize, vb: candle_nn::VarBuilder<'_>| {
                    let (name, i, o) = LAYERS[u];
                    let lin = candle_nn::linear(i, o, vb.pp(name))?;
                    let mut log = log.lock().unwrap();
                    log.push((format!("{name}.weight"), lin.weight().clone()));
                    log.push((format!("{name}.bias"), lin.bias().unwrap().clone()));
                    Ok(())
                };
                let units = mlp_units(HID, Sizes::Tiny);
                let mut f = Fsdp::from_unit_init(units, &pg, init, make_opt(opt)).unwrap();
                let initial = values(f.full_params().unwrap());
                let drawn = values(drawn.lock().unwrap().clone());
                // The same values through the full VarMap.
                let vm = VarMap::new();
                for (name, t) in f.full_params().unwrap() {
                    let v = Var::from_tensor(&t.copy().unwrap()).unwrap();
                    vm.data().lock().unwrap().insert(name, v);
                }
                let units = mlp_units(HID, Sizes::Tiny);
                let mut g = Fsdp::from_varmap(&vm, units, &pg, make_opt(opt)).unwrap();
                drop(vm);
                assert_eq!(f.layout(), g.layout(), "the same layout");
                train(&mut f, rank, world);
                train(&mut g, rank, world);
                let (a, b) = (
                    values(f.full_params().unwrap()),
                    values(g.full_params().unwrap()),
                );
                assert_eq!(
                    a, b,
                    "world {world} {opt:?}: unit-by-unit against the VarMap"
                );
                (drawn, initial, a)
            });
            let rank0 = &out[0].0;
            for (r, (drawn, initial, trained)) in out.iter().enumerate() {
                assert_eq!(initial, rank0, "rank {r} starts from rank 0's values");
                assert_ne!(trained, initial, "it trained");
                if r > 0 {
                    assert_ne!(drawn, rank0, "rank {r} drew values of its own");
                }
            }
        }
    }
}

#[test]
fn building_unit_by_unit_refuses_a_foreign_parameter_and_a_mismatch_by_name() {
    let errors = run_ranks(2, |rank, pg| {
        // Unit 1's init creates a parameter of unit 2.
        let foreign = Fsdp::from_unit_init(
            mlp_units(HID, Sizes::Tiny),
            &pg,
            |u, vb| {
                let (name, i, o) = LAYERS[u];
                candle_nn::linear(i, o, vb.pp(name))?;
                if u == 1 {
                    vb.get((OUT,), "l3.bias")?;
                }
                Ok(())
            },
            make_opt(Opt::AdamW),
        )
        .err()
        .unwrap()
        .to_string();
        // Rank 1's second layer is wider.
        let units = vec![
            Unit::new(["l1"], |_, x| Ok(x.clone())),
            Unit::new(["l2"], |_, x| Ok(x.clone())),
        ];
        let mismatch = Fsdp::from_unit_init(
            units,
            &pg,
            |u, vb| {
                let o = if u == 1 && rank == 1 { HID + 1 } else { HID };
                candle_nn::linear(HID, o, vb.pp(format!("l{}", u + 1)))?;
                Ok(())
            },
            make_opt(Opt::AdamW),
        )
        .err()
        .unwrap()
        .to_string();
        (foreign, mismatch)
    });
    for (r, (foreign, mismatch)) in errors.iter().enumerate() {
        assert!(
            foreign.contains("unit 1's init created `l3.bias`"),
            "rank {r}: {foreign}"
        );
        assert!(mismatch.contains("`l2.bias` [25]"), "rank {r}: {mismatch}");
    }
}
