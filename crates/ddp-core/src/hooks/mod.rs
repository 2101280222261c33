//! Built-in communication hooks (PyTorch's `torch.distributed.algorithms.ddp_comm_hooks`), each
//! an implementation of the reducer's [`CommHook`](crate::reducer::CommHook):
//!
//! | hook | PyTorch | payload per bucket of N `f32` elements |
//! |---|---|---|
//! | [`AllReduceHook`](crate::reducer::AllReduceHook) (default) | `allreduce_hook` | 4N bytes |
//! | [`CompressHook::fp16`], [`CompressHook::bf16`] | `fp16_compress_hook`, `bf16_compress_hook` | 2N bytes |
//! | [`Compressed`] (wrapping any hook) | `fp16_compress_wrapper`, `bf16_compress_wrapper` | the inner hook's, in 16 bits |
//! | [`PowerSgdHook::new`] | `powerSGD_hook` | 4·Σ(n+m)·r for the compressed n×m gradients, 4N for the rest |
//! | [`PowerSgdHook::batched`] | `batched_powerSGD_hook` | 4·2·⌈√N⌉·r |
//! | [`PostLocalSgdHook`] + [`PeriodicModelAverager`] | `post_localSGD_hook` + `PeriodicModelAverager` | 4N until the warm-up ends, then 0 (parameters averaged every `period` steps) |
//! | [`PostLocalSgdHook::new(0)`](PostLocalSgdHook) + [`DiLoCo`] | torchft's `DiLoCo`, `StreamingDiLoCo` | 0 (pseudo-gradients all-reduced every `H` steps, by fragment) |
//!
//! ```text
//!   bucket (f32) ──÷ divisor──► bf16 ──all_reduce(Sum)──► bf16 ──cast──► bucket     (CompressHook)
//!
//!   bucket + error ─► M_i (n×m) ─► P_i = M_i Q_i ─all_reduce─► orthogonalize(P_i)
//!        ▲                             (1-D, small: one uncompressed all_reduce)
//!        │                         Q_i = M_iᵀ P_i ─all_reduce─► Q_i ÷ divisor
//!   error = input − M̂              M̂_i = P_i Q_iᵀ ─► bucket                       (PowerSgdHook)
//! ```
//!
//! Every hook keeps its state in itself (error-feedback buffers, warm-start `Q` matrices, step
//! counters) and hands it to checkpoints as a [`HookState`](crate::reducer::HookState)
//! ([`Reducer::comm_hook_state`](crate::reducer::Reducer::comm_hook_state),
//! [`Checkpoint::save_hook_state`](crate::Checkpoint::save_hook_state)); resuming restores it and
//! continues bit for bit. Every hook counts the payload bytes it hands to collectives
//! ([`Reducer::bytes_sent`](crate::reducer::Reducer::bytes_sent)).
//!
//! The hooks compute in `f32` on a host copy of the bucket (a device bucket is copied out and
//! written back), and send in the bucket's dtype when it is 16-bit (so
//! `Compressed::bf16(PowerSgdHook)` sends `P` and `Q` in bf16), else in `f32`. Integer buckets
//! are refused with an error naming the hook and the bucket.
//!
//! [`HookSpec`] parses the command-line form shared by `train-digits` and `ddp-bench train`:
//! `none|fp16|bf16|powersgd[:RANK[:START_ITER]]|localsgd[:PERIOD[:WARMUP]]`.

mod compress;
pub mod diloco;
mod local_sgd;
pub mod local_state;
mod powersgd;
mod spec;
pub(crate) mod state;

pub use compress::{CompressHook, Compressed, Precision};
pub use diloco::{DiLoCo, DiLoCoConfig, PseudoGradDtype};
pub use local_sgd::{PeriodicModelAverager, PostLocalSgdHook};
pub use powersgd::{PowerSgdHook, PowerSgdState};
pub use spec::{BuiltinHook, HookSpec};
pub use state::gather_state;

use crate::reducer::{BucketBuffer, HostBuffer};
use ddp_comm::{DType, ProcessGroup, ReduceOp, Work};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// `v` rounded to `T` (f16 or bf16) with half's slice conversion: F16C's vector instructions
/// where the CPU has them (8 elements per instruction; `f16::from_f32` element by element is
/// several times slower), the same round-to-nearest-even result either way.
fn narrow<T: Copy + Default>(v: &[f32]) -> Vec<T>
where
    [T]: HalfFloatSliceExt,
{
    let mut out = vec![T::default(); v.len()];
    out.convert_from_f32_slice(v);
    out
}

/// `v` widened to `f32` (exact), with half's slice conversion.
fn widen<T>(v: &[T]) -> Vec<f32>
where
    [T]: HalfFloatSliceExt,
{
    let mut out = vec![0f32; v.len()];
    v.convert_to_f32_slice(&mut out);
    out
}

/// The bucket's elements as `f32` (a host copy); an error for integer buckets.
pub(crate) fn to_f32(buf: &BucketBuffer, hook: &str, bucket: usize) -> ddp_comm::Result<Vec<f32>> {
    let device;
    let host = match buf {
        BucketBuffer::Host(h) => h,
        BucketBuffer::Device(d) => {
            device = d.to_host(0, d.len());
            &device
        }
    };
    Ok(match host {
        HostBuffer::F32(v) => v.clone(),
        HostBuffer::F64(v) => v.iter().map(|&x| x as f32).collect(),
        HostBuffer::F16(v) => widen(v),
        HostBuffer::BF16(v) => widen(v),
        _ => {
            return Err(ddp_comm::Error::InvalidArgument(format!(
                "{hook} comm hook: bucket {bucket} holds {} gradients; the hook reduces \
                 floating-point gradients only",
                host.dtype()
            )))
        }
    })
}

/// `v` as a host buffer of `dtype` (a float dtype).
pub(crate) fn from_f32(v: &[f32], dtype: DType) -> HostBuffer {
    match dtype {
        DType::F64 => HostBuffer::F64(v.iter().map(|&x| x as f64).collect()),
        DType::F16 => HostBuffer::F16(narrow(v)),
        DType::BF16 => HostBuffer::BF16(narrow(v)),
        _ => HostBuffer::F32(v.to_vec()),
    }
}

/// Writes `v` back into `buf` (its own dtype, host or device) and returns it.
pub(crate) fn restore(mut buf: BucketBuffer, v: &[f32]) -> ddp_comm::Result<BucketBuffer> {
    let host = from_f32(v, buf.dtype());
    buf.write(0, host.as_host_slice(), false)
        .map_err(ddp_comm::Error::InvalidArgument)?;
    Ok(buf)
}

/// The dtype a hook sends `f32` data in for a bucket of `dtype`: 16-bit buckets in their own
/// dtype, everything else in `f32`.
pub(crate) fn wire_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => dtype,
        _ => DType::F32,
    }
}

/// An `f32` all-reduce sent in a (possibly 16-bit) wire dtype.
pub(crate) enum WireWork {
    F32(Work<Vec<f32>>),
    F16(Work<Vec<f16>>),
    BF16(Work<Vec<bf16>>),
}

impl WireWork {
    /// Starts the all-reduce of `v` over `pg`, sent as `wire` (`F16`, `BF16`, else `f32`).
    pub(crate) fn start(pg: &ProcessGroup, v: Vec<f32>, wire: DType, op: ReduceOp) -> WireWork {
        match wire {
            DType::F16 => WireWork::F16(pg.all_reduce_async(narrow(&v), op)),
            DType::BF16 => WireWork::BF16(pg.all_reduce_async(narrow(&v), op)),
            _ => WireWork::F32(pg.all_reduce_async(v, op)),
        }
    }

    /// Waits for the result, as `f32`.
    pub(crate) fn wait(self) -> ddp_comm::Result<Vec<f32>> {
        Ok(match self {
            WireWork::F32(w) => w.wait()?,
            WireWork::F16(w) => widen(&w.wait()?),
            WireWork::BF16(w) => widen(&w.wait()?),
        })
    }
}
