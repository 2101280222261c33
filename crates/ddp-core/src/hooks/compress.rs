//! 16-bit gradient compression: PyTorch's `fp16_compress_hook` / `bf16_compress_hook`
//! ([`CompressHook`]) and `fp16_compress_wrapper` / `bf16_compress_wrapper` ([`Compressed`]).

use super::{from_f32, restore, to_f32, WireWork};
use crate::error::Result;
use crate::reducer::{BucketBuffer, BucketWork, CommHook, GradBucket, HookState};
use ddp_comm::{DType, ProcessGroup, ReduceOp};

/// The 16-bit format a bucket is compressed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// IEEE half precision (PyTorch's `torch.float16`): 11-bit significand, range ±65504.
    F16,
    /// bfloat16: 8-bit significand, the range of `f32`.
    Bf16,
}

impl Precision {
    /// The dtype on the wire.
    pub fn dtype(self) -> DType {
        match self {
            Precision::F16 => DType::F16,
            Precision::Bf16 => DType::BF16,
        }
    }

    /// PyTorch's name of the hook (`fp16_compress`, `bf16_compress`).
    pub fn hook_name(self) -> &'static str {
        match self {
            Precision::F16 => "fp16_compress",
            Precision::Bf16 => "bf16_compress",
        }
    }
}

/// PyTorch's `fp16_compress_hook` / `bf16_compress_hook`: each bucket is divided by the divisor
/// (the world size, or the ranks with data under Join), cast to 16 bits, summed with one
/// all-reduce in 16 bits, and cast back into the bucket: half the bytes of the default hook.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompressHook {
    precision: Precision,
    sent: u64,
}

impl CompressHook {
    /// A hook compressing to `precision`.
    pub fn new(precision: Precision) -> CompressHook {
        CompressHook { precision, sent: 0 }
    }

    /// `fp16_compress_hook`.
    pub fn fp16() -> CompressHook {
        Self::new(Precision::F16)
    }

    /// `bf16_compress_hook`.
    pub fn bf16() -> CompressHook {
        Self::new(Precision::Bf16)
    }
}

impl CommHook for CompressHook {
    fn run(&mut self, pg: &ProcessGroup, bucket: GradBucket) -> BucketWork {
        let (index, divisor) = (bucket.index(), bucket.divisor());
        let buf = bucket.into_buffer();
        let mut v = match to_f32(&buf, self.precision.hook_name(), index) {
            Ok(v) => v,
            Err(e) => return BucketWork::ready(Err(e)),
        };
        let d = divisor as f32;
        v.iter_mut().for_each(|x| *x /= d);
        self.sent += (v.len() * 2) as u64;
        let work = WireWork::start(pg, v, self.precision.dtype(), ReduceOp::Sum);
        BucketWork::ready(Ok(buf)).then(move |buf| restore(buf, &work.wait()?))
    }

    fn take_sent_bytes(&mut self) -> Option<u64> {
        Some(std::mem::take(&mut self.sent))
    }

    fn state_dict(&self) -> HookState {
        HookState::new(self.precision.hook_name())
    }
}

/// PyTorch's `fp16_compress_wrapper(hook)` / `bf16_compress_wrapper(hook)`: the bucket is cast to
/// 16 bits, reduced by the inner hook (which then computes and sends in 16 bits, e.g. PowerSGD's
/// `P` and `Q`), and cast back.
pub struct Compressed<H> {
    precision: Precision,
    inner: H,
    /// Bytes counted here when the inner hook does not count its own.
    sent: u64,
}

impl<H: CommHook> Compressed<H> {
    /// `inner`, run on buckets cast to `precision`.
    pub fn new(precision: Precision, inner: H) -> Compressed<H> {
        Compressed {
            precision,
            inner,
            sent: 0,
        }
    }

    /// `fp16_compress_wrapper(inner)`.
    pub fn fp16(inner: H) -> Compressed<H> {
        Self::new(Precision::F16, inner)
    }

    /// `bf16_compress_wrapper(inner)`.
    pub fn bf16(inner: H) -> Compressed<H> {
        Self::new(Precision::Bf16, inner)
    }

    /// The wrapped hook.
    pub fn inner(&self) -> &H {
        &self.inner
    }

    fn kind(&self, inner: &str) -> String {
        format!("{}_wrapper({inner})", self.precision.hook_name())
    }
}

impl<H: CommHook> CommHook for Compressed<H> {
    fn run(&mut self, pg: &ProcessGroup, mut bucket: GradBucket) -> BucketWork {
        let v = match to_f32(bucket.buffer(), self.precision.hook_name(), bucket.index()) {
            Ok(v) => v,
            Err(e) => return BucketWork::ready(Err(e)),
        };
        self.sent += (v.len() * 2) as u64;
        let compressed = BucketBuffer::Host(from_f32(&v, self.precision.dtype()));
        drop(v);
        let original = bucket.set_buffer(compressed);
        let hook = self.precision.hook_name();
        let index = bucket.index();
        self.inner.run(pg, bucket).then(move |reduced| {
            let v = to_f32(&reduced, hook, index)?;
            restore(original, &v)
        })
    }

    fn take_sent_bytes(&mut self) -> Option<u64> {
        let own = std::mem::take(&mut self.sent);
        Some(self.inner.take_sent_bytes().unwrap_or(own))
    }

    fn state_dict(&self) -> HookState {
        let mut s = self.inner.state_dict();
        s.kind = self.kind(&s.kind);
        s
    }

    fn load_state_dict(&mut self, state: &HookState) -> Result<()> {
        let inner_kind = self.inner.state_dict().kind;
        state.expect_kind(&self.kind(&inner_kind))?;
        let mut inner = state.clone();
        inner.kind = inner_kind;
        self.inner.load_state_dict(&inner)
    }
}
