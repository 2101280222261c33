//! Where a `train-digits-burn` run resumes from, at any `--zero` stage and world size (the design
//! of train-digits' `load_source`; which checkpoint, `ddp_example_support::resume`).
//!
//! ```text
//!   plain checkpoint (stage 0: Burn's records as blobs)  ──load_records──► stage 0
//!        └─ burn_to_flat ─► flat checkpoint ──ZeroDdp::import──────────► stages 1-2
//!   save set (stages 1-2: one shard per rank)           ──ZeroDdp::load──► stages 1-2
//!        └─ ddprs::sharding::consolidate ─► flat checkpoint ─ flat_to_burn ─► stage 0
//! ```
//!
//! The *flat* form is what `ddprs::sharding::consolidate` makes of a set and what
//! `ZeroDdp::import` cuts: every parameter under its structural path (`fc1.weight`), each
//! optimizer state tensor as `optim.<param>.<slot>` (Burn's state path with `/` for `.`:
//! `momentum/velocity`), the state's scalars (Adam's step count) in the optimizer record's hyper
//! as `state:<tag>:<name>`. Burn's own records key the same state by this process's `ParamId`s
//! (`<id>.<path>`, scalars `<id>.<name>`, and `<id>.__rank`); the bridges below map one onto the
//! other through the module's parameters in structural order.

use crate::model::Mlp;
use crate::setup::BoxResult;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::ModuleOptimizer;
use burn::tensor::{Tensor, TensorData};
use burn_pack::Scalar;
use ddprs::burn::Ddp;
use ddprs::checkpoint::{Checkpoint, OptimizerStateDict};
use std::collections::BTreeMap;
use std::path::Path;

/// Key prefix of an optimizer state scalar in the flat form's optimizer hyper (ddp-burn's
/// `ZeroDdp` convention).
const SCALAR: &str = "state:";
/// Burn's per-parameter scalar holding the rank of the parameter's state.
const RANK_KEY: &str = "__rank";

/// The name `ddprs::burn::ZeroDdp` gives optimizer `O`'s state in checkpoints (`burn.adamw`).
pub fn optimizer_kind<O>() -> String {
    let name = std::any::type_name::<O>();
    let short = name.split('<').next().unwrap_or(name);
    let short = short.rsplit("::").next().unwrap_or(short);
    format!("burn.{}", short.to_lowercase())
}

/// This process's id of each trainable parameter, in structural order (ddp-burn's order).
struct Ids(Vec<u64>);

impl ModuleVisitor for Ids {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if param.is_require_grad() {
            self.0.push(param.id.val());
        }
    }
}

fn param_ids(ddp: &Ddp<Mlp>) -> BoxResult<Vec<u64>> {
    let mut ids = Ids(Vec::new());
    ddp.module().visit(&mut ids);
    if ids.0.len() != ddp.reducer().specs().len() {
        return Err(format!(
            "the model has {} trainable parameters but ddp-burn tracks {}",
            ids.0.len(),
            ddp.reducer().specs().len()
        )
        .into());
    }
    Ok(ids.0)
}

fn scalar_tag(v: Scalar) -> (&'static str, f64) {
    match v {
        Scalar::Int(x) => ("i", x as f64),
        Scalar::UInt(x) => ("u", x as f64),
        Scalar::Float(x) => ("f", x),
        Scalar::Bool(b) => ("b", f64::from(u8::from(b))),
    }
}

fn tag_scalar(tag: &str, x: f64) -> Scalar {
    match tag {
        "i" => Scalar::Int(x as i64),
        "u" => Scalar::UInt(x as u64),
        "b" => Scalar::Bool(x != 0.0),
        _ => Scalar::Float(x),
    }
}

/// Loads a plain checkpoint's Burn records into `ddp`'s module and an optimizer built like `opt`,
/// and returns the flat form of both (for `ZeroDdp::import`, whose optimizer is `kind`).
pub fn burn_to_flat(
    ckpt: &Checkpoint,
    ddp: &mut Ddp<Mlp>,
    opt: ModuleOptimizer,
    kind: &str,
) -> BoxResult<Checkpoint> {
    let opt = ddp.load_records(ckpt, opt)?;
    let ids = param_ids(ddp)?;
    let specs = ddp.reducer().specs().to_vec();
    let values = ddp.param_values_f64()?;
    let mut flat = Checkpoint::new(ckpt.meta.clone());
    for (s, v) in specs.iter().zip(values) {
        flat.insert(
            s.name.clone(),
            s.shape.clone(),
            v.into_iter().map(|x| x as f32).collect(),
        )?;
    }
    let bad = |e: burn_pack::Error| format!("the optimizer record of the checkpoint: {e}");
    let reader = burn_pack::Reader::from_bytes(opt.into_bytes()?).map_err(bad)?;
    let scalars = reader.scalars().clone();
    let mut state = OptimizerStateDict::new(kind, ckpt.meta.step);
    let index = |id: &str| ids.iter().position(|i| i.to_string() == id);
    for t in reader.into_tensors().map_err(bad)? {
        let (name, dtype, shape, _, bytes) = t.into_parts().map_err(bad)?;
        let found = name
            .split_once('.')
            .and_then(|(id, path)| Some((index(id)?, path)));
        let Some((i, path)) = found else {
            return Err(format!("optimizer state `{name}` belongs to no parameter").into());
        };
        let data = TensorData::from_bytes(bytes, shape, dtype)
            .try_into_vec_as::<f32>()
            .map_err(|e| format!("optimizer state `{name}`: {e:?}"))?;
        state.insert(
            &specs[i].name,
            &path.replace('.', "/"),
            specs[i].shape.clone(),
            data,
        )?;
    }
    // The state's scalars are the same for every parameter (each is stepped at every step).
    let mut common: BTreeMap<String, (String, Scalar)> = BTreeMap::new();
    for (key, v) in scalars {
        let Some((id, name)) = key.split_once('.') else {
            continue;
        };
        if name == RANK_KEY || index(id).is_none() {
            continue;
        }
        match common.get(name) {
            Some((_, w)) if *w != v => {
                return Err(format!(
                    "optimizer scalar `{name}` differs between parameters ({w:?}, {v:?}): not a \
                     state ZeRO can shard"
                )
                .into())
            }
            _ => {
                common.insert(name.to_string(), (key.clone(), v));
            }
        }
    }
    for (name, (_, v)) in common {
        let (tag, x) = scalar_tag(v);
        state.hyper.insert(format!("{SCALAR}{tag}:{name}"), x);
    }
    flat.set_optimizer_state(state)?;
    Ok(flat)
}

/// Writes values into the trainable parameters, in structural order.
struct SetValues {
    values: Vec<Option<TensorData>>,
    next: usize,
}

impl ModuleMapper for SetValues {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        if !param.is_require_grad() {
            return param;
        }
        let i = self.next;
        self.next += 1;
        match self.values.get_mut(i).and_then(Option::take) {
            Some(data) => {
                let id = param.id;
                let device = param.val().device();
                param.transform_for_load(Tensor::from_data(data, &device), id)
            }
            None => param,
        }
    }
}

/// Loads a flat checkpoint (a consolidated save set) into `ddp`'s module and an optimizer built
/// like `opt` (Burn's `ModuleOptimizer`); returns the optimizer with its state.
pub fn flat_to_burn(
    flat: &Checkpoint,
    ddp: &mut Ddp<Mlp>,
    opt: ModuleOptimizer,
) -> BoxResult<ModuleOptimizer> {
    let specs = ddp.reducer().specs().to_vec();
    let mut values = Vec::with_capacity(specs.len());
    for s in &specs {
        let t = flat.require(&s.name)?;
        if t.shape != s.shape {
            return Err(format!(
                "checkpoint of another model: parameter `{}` has shape {:?} in the checkpoint \
                 and {:?} in this model",
                s.name, t.shape, s.shape
            )
            .into());
        }
        values.push(Some(TensorData::new(t.data.clone(), s.shape.clone())));
    }
    let mut mapper = SetValues { values, next: 0 };
    ddp.map_module(|m| m.map(&mut mapper))?;
    let ids = param_ids(ddp)?;
    let state = flat.optimizer_state();
    let mut scalars: Vec<(String, Scalar)> = Vec::new();
    for (k, &x) in &state.hyper {
        if let Some(rest) = k.strip_prefix(SCALAR) {
            let (tag, name) = rest.split_once(':').unwrap_or(("", rest));
            scalars.push((name.to_string(), tag_scalar(tag, x)));
        }
    }
    let mut tensors = Vec::new();
    let mut writer_scalars = BTreeMap::new();
    for (i, s) in specs.iter().enumerate() {
        let id = ids[i];
        let prefix = format!("{}.", s.name);
        let mut has_state = !scalars.is_empty();
        for (k, t) in &state.tensors {
            let Some(slot) = k.strip_prefix(&prefix) else {
                continue;
            };
            if slot.contains('.') || t.data.len() != s.numel() {
                continue; // another parameter's (`a.b.slot` is not `a`'s)
            }
            let (bytes, shape, dtype) =
                TensorData::new(t.data.clone(), s.shape.clone()).into_parts();
            let name = format!("{id}.{}", slot.replace('/', "."));
            tensors.push(burn_pack::Tensor::new(name, dtype, shape, Some(id), bytes));
            has_state = true;
        }
        if has_state {
            writer_scalars.insert(format!("{id}.{RANK_KEY}"), Scalar::from(s.shape.len()));
            for (name, v) in &scalars {
                writer_scalars.insert(format!("{id}.{name}"), *v);
            }
        }
    }
    let mut writer = burn_pack::Writer::new(tensors);
    for (k, v) in &writer_scalars {
        writer = writer.with_scalar(k, *v);
    }
    let bytes = writer
        .into_bytes()
        .map_err(|e| format!("cannot build the optimizer record: {e}"))?;
    Ok(opt
        .from_bytes(bytes)
        .map_err(|e| format!("cannot load the optimizer record: {e}"))?)
}

/// The flat form of `dir`'s current save set (`ddprs::sharding::consolidate`), and its name.
pub fn consolidated(dir: &Path) -> BoxResult<(Checkpoint, String)> {
    let ckpt = ddprs::sharding::consolidate(dir)?.ok_or("the save set disappeared")?;
    let set = ddprs::sharding::latest_set(dir)?.unwrap_or_else(|| dir.into());
    Ok((ckpt, format!("the sharded set {}", set.display())))
}
