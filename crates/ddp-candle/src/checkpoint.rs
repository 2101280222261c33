//! candle parameters to and from `ddp_core::Checkpoint` (rank-0, atomic, safetensors checkpoints of
//! the `ddp-core` crate), and sharing a checkpoint that only rank 0 can read with every rank.
//!
//! Tensors are stored as `f32` (`ddp_core::checkpoint` stores `f32` only): exact for `f32`, `f16` and
//! `bf16` parameters, rounded for `f64`.

use crate::{Error, Result};
use candle_core::{DType, Tensor, Var};
use ddp_comm::ProcessGroup;
use ddp_core::checkpoint::{Checkpoint, TensorData};

/// Adds every variable to `ckpt` under its name.
pub fn save_vars(ckpt: &mut Checkpoint, vars: &[(String, Var)]) -> Result<()> {
    for (name, var) in vars {
        let data = var
            .as_tensor()
            .flatten_all()?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?;
        ckpt.insert(name.clone(), var.dims().to_vec(), data)?;
    }
    Ok(())
}

/// Sets every variable from the tensor of the same name in `ckpt` (an error names a missing
/// tensor or a shape that does not match). All or nothing: every tensor is checked before any
/// variable changes, so a checkpoint of another model leaves the model as it was.
pub fn load_vars(ckpt: &Checkpoint, vars: &[(String, Var)]) -> Result<()> {
    let loaded = vars
        .iter()
        .map(|(name, var)| load_like(ckpt, name, var))
        .collect::<Result<Vec<_>>>()?;
    for ((_, var), t) in vars.iter().zip(&loaded) {
        var.set(t)?;
    }
    Ok(())
}

/// Tensor `key` of `ckpt` with the dtype and device of `like` (an error names a missing tensor
/// or a shape that differs from `like`'s).
pub fn load_like(ckpt: &Checkpoint, key: &str, like: &Tensor) -> Result<Tensor> {
    tensor_like(ckpt.require(key)?, key, like)
}

/// Host tensor `t` (called `key` in errors) as a tensor with the dtype and device of `like` (an
/// error when the shapes differ).
pub fn tensor_like(t: &TensorData, key: &str, like: &Tensor) -> Result<Tensor> {
    if t.shape != like.dims() {
        return Err(Error::Ddp(ddp_core::Error::Mismatch(format!(
            "checkpoint tensor `{key}` has shape {:?} but the model's tensor has {:?}",
            t.shape,
            like.dims()
        ))));
    }
    Ok(Tensor::from_slice(&t.data, like.shape(), like.device())?.to_dtype(like.dtype())?)
}

/// Sends `root`'s checkpoint (or its absence) to every rank: what `root` passes is what every rank
/// gets back (`ckpt` is ignored on the other ranks). Lets a resumed run read the file on rank 0
/// only, e.g. when the checkpoint directory is not shared between nodes. A collective; the same as
/// `ddp_core::checkpoint::broadcast` (`ddp_core::checkpoint::resume_or_start` does all of a resume).
pub fn broadcast_checkpoint(
    pg: &ProcessGroup,
    ckpt: Option<&Checkpoint>,
    root: usize,
) -> Result<Option<Checkpoint>> {
    Ok(ddp_core::checkpoint::broadcast(pg, ckpt, root)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use ddp_core::checkpoint::CheckpointMeta;

    #[test]
    fn vars_round_trip_through_a_checkpoint_file() {
        let dir = tempfile::tempdir().unwrap();
        let a = Var::randn(0f32, 1.0, (3, 4), &Device::Cpu).unwrap();
        let b = Var::randn(0f32, 1.0, 5, &Device::Cpu)
            .unwrap()
            .as_tensor()
            .to_dtype(DType::BF16)
            .unwrap();
        let b = Var::from_tensor(&b).unwrap();
        let vars = vec![("a".to_string(), a.clone()), ("b".to_string(), b.clone())];
        let mut ckpt = Checkpoint::new(CheckpointMeta {
            step: 7,
            ..Default::default()
        });
        save_vars(&mut ckpt, &vars).unwrap();
        ddp_core::checkpoint::save_atomic(dir.path(), &ckpt).unwrap();

        let a2 = Var::zeros((3, 4), DType::F32, &Device::Cpu).unwrap();
        let b2 = Var::zeros(5, DType::BF16, &Device::Cpu).unwrap();
        let vars2 = vec![("a".to_string(), a2.clone()), ("b".to_string(), b2.clone())];
        let loaded = ddp_core::checkpoint::load(dir.path()).unwrap().unwrap();
        assert_eq!(loaded.meta.step, 7);
        load_vars(&loaded, &vars2).unwrap();
        let flat = |v: &Var| {
            v.as_tensor()
                .flatten_all()
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        assert_eq!(flat(&a), flat(&a2));
        assert_eq!(flat(&b), flat(&b2));
        assert_eq!(b2.dtype(), DType::BF16);

        let wrong = vec![(
            "a".to_string(),
            Var::zeros(12, DType::F32, &Device::Cpu).unwrap(),
        )];
        let err = load_vars(&loaded, &wrong).unwrap_err().to_string();
        assert!(err.contains("`a`") && err.contains("[3, 4]"), "{err}");
        let missing = vec![(
            "c".to_string(),
            Var::zeros(1, DType::F32, &Device::Cpu).unwrap(),
        )];
        let err = load_vars(&loaded, &missing).unwrap_err().to_string();
        assert!(err.contains("\"c\""), "{err}");
    }
}
