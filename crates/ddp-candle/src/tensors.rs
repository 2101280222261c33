//! Conversions between candle tensors and the flat buffers of `ddp-core`/`ddp-comm`: a tensor as a flat
//! host slice without an extra copy ([`with_host_slice`]), a tensor from flat values
//! ([`tensor_from_host`]), and whole-model statistics (cross-rank replica difference, sum, L2
//! norm). The adapter contract built on them is in module [`params`](crate::params).
//!
//! Supported parameter dtypes: `f32`, `f64`, `f16`, `bf16` (what both candle and the collectives
//! carry).

use crate::{Error, Result};
use candle_core::{
    CpuStorage, DType, Device, InplaceOp1, Layout, Shape, Storage, Tensor, Var, WithDType,
};
use ddp_comm::ProcessGroup;
use ddp_core::reducer::{HostBuffer, HostSlice};
use ddp_core::verify::ReplicaReport;
use half::{bf16, f16};
use std::cell::RefCell;

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

/// Runs `f` on the elements of a contiguous f32 CPU tensor, mutably, in place (an error for
/// any other tensor).
pub fn with_flat_mut<R>(t: &Tensor, f: impl FnOnce(&mut [f32]) -> R) -> Result<R> {
    struct Op<F, R>(RefCell<Option<F>>, RefCell<Option<R>>);
    impl<F: FnOnce(&mut [f32]) -> R, R> InplaceOp1 for Op<F, R> {
        fn name(&self) -> &'static str {
            "ddp-with-flat-mut"
        }

        fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> candle_core::Result<()> {
            let (Some((a, b)), CpuStorage::F32(v)) = (l.contiguous_offsets(), s) else {
                candle_core::bail!("ddp-with-flat-mut: a contiguous f32 CPU tensor");
            };
            let f = self.0.borrow_mut().take().expect("called once");
            *self.1.borrow_mut() = Some(f(&mut v[a..b]));
            Ok(())
        }
    }
    let op = Op(RefCell::new(Some(f)), RefCell::new(None));
    t.inplace_op1(&op)?;
    op.1.into_inner().ok_or_else(|| {
        Error::Unsupported(format!(
            "with_flat_mut: a contiguous f32 CPU tensor, not {:?} on {:?}",
            t.dtype(),
            t.device().location()
        ))
    })
}

/// Runs `f` on the elements of `t` in row-major order as a [`HostSlice`] (borrowed from a
/// contiguous CPU tensor, copied otherwise).
pub fn with_host_slice<R>(t: &Tensor, f: impl FnOnce(HostSlice<'_>) -> R) -> Result<R> {
    match t.dtype() {
        DType::F32 => with_flat::<f32, _>(t, |s| f(HostSlice::of(s))),
        DType::F64 => with_flat::<f64, _>(t, |s| f(HostSlice::of(s))),
        DType::F16 => with_flat::<f16, _>(t, |s| f(HostSlice::of(s))),
        DType::BF16 => with_flat::<bf16, _>(t, |s| f(HostSlice::of(s))),
        other => Err(Error::Unsupported(format!(
            "tensors of dtype {other:?} are not supported (use f32, f64, f16 or bf16)"
        ))),
    }
}

/// A tensor of `shape` on `device` holding `values` (row-major), copied.
pub fn tensor_from_host(values: HostSlice<'_>, shape: &Shape, device: &Device) -> Result<Tensor> {
    Ok(match values {
        HostSlice::F32(v) => Tensor::from_slice(v, shape, device)?,
        HostSlice::F64(v) => Tensor::from_slice(v, shape, device)?,
        HostSlice::F16(v) => Tensor::from_slice(v, shape, device)?,
        HostSlice::BF16(v) => Tensor::from_slice(v, shape, device)?,
        other => return Err(not_a_candle_dtype(other.dtype())),
    })
}

/// [`tensor_from_host`] taking the buffer over: on the CPU its memory becomes the tensor's
/// storage, no copy.
pub fn tensor_from_buffer(values: HostBuffer, shape: &Shape, device: &Device) -> Result<Tensor> {
    Ok(match values {
        HostBuffer::F32(v) => Tensor::from_vec(v, shape, device)?,
        HostBuffer::F64(v) => Tensor::from_vec(v, shape, device)?,
        HostBuffer::F16(v) => Tensor::from_vec(v, shape, device)?,
        HostBuffer::BF16(v) => Tensor::from_vec(v, shape, device)?,
        other => return Err(not_a_candle_dtype(other.dtype())),
    })
}

fn not_a_candle_dtype(dtype: ddp_comm::DType) -> Error {
    Error::Unsupported(format!(
        "{dtype} values for a candle tensor (use f32, f64, f16 or bf16)"
    ))
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
/// call it with the same parameters; every rank gets the same report), with
/// `ddp_core::verify_replicas`: one small message of hashes when the replicas agree, an element-wise
/// comparison of the differing parameters otherwise. When every parameter has the same dtype
/// the values are compared in it, borrowed from contiguous CPU tensors (no copy: checking a
/// model does not double its memory); mixed dtypes are widened to `f64` (exact, and
/// bit-identity is preserved).
pub fn verify_replicas(pg: &ProcessGroup, vars: &[&Var]) -> Result<ReplicaReport> {
    let first = vars.first().map(|v| v.dtype());
    if vars.iter().all(|v| Some(v.dtype()) == first) {
        match first {
            Some(DType::F32) => return verify_as::<f32>(pg, vars),
            Some(DType::F64) => return verify_as::<f64>(pg, vars),
            Some(DType::F16) => return verify_as::<f16>(pg, vars),
            Some(DType::BF16) => return verify_as::<bf16>(pg, vars),
            _ => {}
        }
    }
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
    Ok(ddp_core::verify::verify_replicas(pg, &slices)?)
}

/// [`verify_replicas`] for parameters all of dtype `T`.
fn verify_as<T>(pg: &ProcessGroup, vars: &[&Var]) -> Result<ReplicaReport>
where
    T: WithDType + ddp_core::verify::ReplicaValue,
{
    // Read guards of every storage, held for the check; tensors that are not contiguous on the
    // CPU (a GPU parameter) are copied to the host instead.
    let guards: Vec<_> = vars
        .iter()
        .map(|v| v.as_tensor().storage_and_layout())
        .collect();
    let mut owned: Vec<Option<Vec<T>>> = Vec::with_capacity(vars.len());
    for (v, (storage, layout)) in vars.iter().zip(&guards) {
        let borrowable =
            matches!(&**storage, Storage::Cpu(_)) && layout.contiguous_offsets().is_some();
        owned.push(if borrowable {
            None
        } else {
            Some(v.as_tensor().flatten_all()?.to_vec1::<T>()?)
        });
    }
    let mut slices: Vec<&[T]> = Vec::with_capacity(vars.len());
    for ((storage, layout), copy) in guards.iter().zip(&owned) {
        slices.push(match (copy, &**storage, layout.contiguous_offsets()) {
            (Some(v), _, _) => v.as_slice(),
            (None, Storage::Cpu(cpu), Some((start, end))) => &cpu.as_slice::<T>()?[start..end],
            (None, _, _) => unreachable!("checked borrowable above"),
        });
    }
    Ok(ddp_core::verify::verify_replicas(pg, &slices)?)
}

/// `(sum, l2 norm)` over every element of `vars`, accumulated in `f64`, one parameter at a time
/// (no widened copy of the whole model).
pub fn param_sum_l2(vars: &[&Var]) -> Result<(f64, f64)> {
    let (mut sum, mut sq) = (0f64, 0f64);
    for v in vars {
        let t = v.as_tensor().flatten_all()?.to_dtype(DType::F64)?;
        for x in t.to_vec1::<f64>()? {
            sum += x;
            sq += x * x;
        }
    }
    Ok((sum, sq.sqrt()))
}
