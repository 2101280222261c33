//! Conversions between candle tensors and the flat buffers of `ddp`/`ddp-comm`: parameter specs,
//! handing a gradient tensor to the reducer without an extra copy, rebuilding averaged gradient
//! tensors, broadcasting parameter values from one rank, and whole-model statistics
//! (cross-rank replica difference, sum, L2 norm).
//!
//! Supported parameter dtypes: `f32`, `f64`, `f16`, `bf16` (what both candle and the collectives
//! carry).

use crate::{Error, Result};
use candle_core::{DType, Storage, Tensor, Var, WithDType};
use ddp::reducer::{broadcast_coalesced, ParamSpec, Reducer};
use ddp::verify::ReplicaReport;
use ddp_comm::{Element, ProcessGroup};
use half::{bf16, f16};

/// The collective dtype of a candle dtype (error for dtypes that carry no gradient).
pub fn comm_dtype(dtype: DType) -> Result<ddp_comm::DType> {
    Ok(match dtype {
        DType::F32 => ddp_comm::DType::F32,
        DType::F64 => ddp_comm::DType::F64,
        DType::F16 => ddp_comm::DType::F16,
        DType::BF16 => ddp_comm::DType::BF16,
        other => {
            return Err(Error::Unsupported(format!(
                "parameters of dtype {other:?} are not supported (use f32, f64, f16 or bf16)"
            )))
        }
    })
}

/// The [`ParamSpec`]s of named variables, in the given order.
pub fn param_specs(vars: &[(String, Var)]) -> Result<Vec<ParamSpec>> {
    vars.iter()
        .map(|(name, v)| {
            Ok(ParamSpec::new(
                name.clone(),
                v.dims().to_vec(),
                comm_dtype(v.dtype())
                    .map_err(|e| Error::Unsupported(format!("parameter `{name}`: {e}")))?,
            ))
        })
        .collect()
}

/// Runs `f` on the elements of `t` in row-major order: borrowed straight from a contiguous CPU
/// tensor, copied otherwise.
pub fn with_flat<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            let s = cpu.as_slice::<T>()?;
            return Ok(f(&s[start..end]));
        }
    }
    let v = t.flatten_all()?.to_vec1::<T>()?;
    Ok(f(&v))
}

/// Hands `grad` (the gradient of parameter `index`) to the reducer.
pub fn mark_grad(reducer: &mut Reducer, index: usize, grad: &Tensor) -> Result<()> {
    fn go<T: WithDType + Element>(r: &mut Reducer, i: usize, g: &Tensor) -> Result<()> {
        with_flat::<T, _>(g, |s| r.mark_ready(i, s))?.map_err(Error::from)
    }
    match grad.dtype() {
        DType::F32 => go::<f32>(reducer, index, grad),
        DType::F64 => go::<f64>(reducer, index, grad),
        DType::F16 => go::<f16>(reducer, index, grad),
        DType::BF16 => go::<bf16>(reducer, index, grad),
        other => Err(Error::Unsupported(format!(
            "gradient of dtype {other:?} for parameter #{index}"
        ))),
    }
}

/// The reduced gradient of parameter `index` as a tensor shaped like `var`.
pub fn reduced_grad(reducer: &Reducer, index: usize, var: &Var) -> Result<Tensor> {
    fn go<T: WithDType + Element>(r: &Reducer, i: usize, v: &Var) -> Result<Tensor> {
        Ok(Tensor::from_slice(r.grad::<T>(i)?, v.shape(), v.device())?)
    }
    match var.dtype() {
        DType::F32 => go::<f32>(reducer, index, var),
        DType::F64 => go::<f64>(reducer, index, var),
        DType::F16 => go::<f16>(reducer, index, var),
        DType::BF16 => go::<bf16>(reducer, index, var),
        other => Err(Error::Unsupported(format!("parameter of dtype {other:?}"))),
    }
}

/// Copies the values of `vars` on rank `root` to every rank (coalesced per dtype).
pub fn broadcast_vars(pg: &ProcessGroup, vars: &[&Var], root: usize) -> Result<()> {
    fn go<T: WithDType + Element>(pg: &ProcessGroup, vars: &[&Var], root: usize) -> Result<()> {
        let vars: Vec<&Var> = vars
            .iter()
            .copied()
            .filter(|v| v.dtype() == <T as WithDType>::DTYPE)
            .collect();
        if vars.is_empty() {
            return Ok(());
        }
        let mut data: Vec<Vec<T>> = vars
            .iter()
            .map(|v| v.as_tensor().flatten_all()?.to_vec1::<T>())
            .collect::<candle_core::Result<_>>()?;
        let mut slices: Vec<&mut [T]> = data.iter_mut().map(|d| d.as_mut_slice()).collect();
        broadcast_coalesced(pg, &mut slices, root)?;
        for (v, d) in vars.iter().zip(data) {
            v.set(&Tensor::from_vec(d, v.shape(), v.device())?)?;
        }
        Ok(())
    }
    for v in vars {
        comm_dtype(v.dtype())?;
    }
    go::<f32>(pg, vars, root)?;
    go::<f64>(pg, vars, root)?;
    go::<f16>(pg, vars, root)?;
    go::<bf16>(pg, vars, root)?;
    Ok(())
}

/// All elements of `vars`, in order, widened to `f64` (exact for every supported dtype).
pub fn flatten_f64(vars: &[&Var]) -> Result<Vec<f64>> {
    let mut out = Vec::new();
    for v in vars {
        let t = v.as_tensor().flatten_all()?.to_dtype(DType::F64)?;
        out.extend(t.to_vec1::<f64>()?);
    }
    Ok(out)
}

/// Checks that every rank holds bit-identical values of `vars` (a collective: every rank must
/// call it with the same parameters; every rank gets the same report). Values are widened to
/// `f64` (exact, and bit-identity is preserved) and compared with `ddp::verify_replicas`: one
/// small message of hashes when the replicas agree, an element-wise comparison of the differing
/// parameters otherwise.
pub fn verify_replicas(pg: &ProcessGroup, vars: &[&Var]) -> Result<ReplicaReport> {
    let values: Vec<Vec<f64>> = vars
        .iter()
        .map(|v| {
            v.as_tensor()
                .flatten_all()?
                .to_dtype(DType::F64)?
                .to_vec1::<f64>()
        })
        .collect::<candle_core::Result<_>>()?;
    let slices: Vec<&[f64]> = values.iter().map(|v| v.as_slice()).collect();
    Ok(ddp::verify::verify_replicas(pg, &slices)?)
}

/// `(sum, l2 norm)` over every element of `vars`, accumulated in `f64`.
pub fn param_sum_l2(vars: &[&Var]) -> Result<(f64, f64)> {
    let flat = flatten_f64(vars)?;
    let sum = flat.iter().sum();
    let sq: f64 = flat.iter().map(|x| x * x).sum();
    Ok((sum, sq.sqrt()))
}
