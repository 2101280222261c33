//! `ddp-candle`: PyTorch's `DistributedDataParallel` for [candle](https://github.com/huggingface/candle)
//! models.
//!
//! [`DistributedDataParallel`] (alias [`Ddp`]) wraps the parameters of a model — a candle
//! `VarMap` or a list of named `Var`s — and a `ddp_comm::ProcessGroup`. At construction it checks
//! that every rank has the same parameters (names, shapes, dtypes) and copies rank 0's values to
//! every replica. Its `backward` returns a `candle_core::backprop::GradStore` holding gradients
//! averaged over all ranks, so the unchanged `candle_nn::optim` optimizers (`SGD`, `AdamW`, ...)
//! keep every replica identical with a plain `opt.step(&grads)`.
//!
//! ```no_run
//! use candle_core::{DType, Device, Module, Tensor};
//! use candle_nn::Optimizer;
//! # fn build_model(vb: candle_nn::VarBuilder) -> candle_core::Result<candle_nn::Linear> {
//! #     candle_nn::linear(4, 3, vb.pp("fc"))
//! # }
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let batches: Vec<(Tensor, Tensor)> = Vec::new();
//! let pg = ddp_comm::init_process_group(Default::default())?; // RANK/WORLD_SIZE/MASTER_* from env
//! let varmap = candle_nn::VarMap::new();
//! let model = build_model(candle_nn::VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
//! let mut ddp = ddp_candle::Ddp::new(&varmap, &pg, Default::default())?;
//! let mut opt = candle_nn::SGD::new(varmap.all_vars(), 0.1)?;
//! for (x, y) in batches {
//!     let loss = candle_nn::loss::cross_entropy(&model.forward(&x)?, &y)?;
//!     let grads = ddp.backward(&loss)?; // averaged over all ranks
//!     opt.step(&grads)?;
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Two backward paths give the same gradients:
//! - **plain** ([`DistributedDataParallel::backward`]): candle's `loss.backward()`, then the
//!   gradients are handed to the bucketed reducer in reverse registration order; each bucket's
//!   all-reduce starts as soon as it is full, so copying later buckets overlaps communicating
//!   earlier ones.
//! - **blockwise** (`DistributedDataParallel::forward_backward_blockwise`, module `blockwise`):
//!   for a model given as a sequence of blocks, backward runs one block at a time from the last,
//!   and each block's gradients go to the reducer at once — their buckets are on the wire while
//!   earlier blocks are still computing (candle has no per-parameter backward hooks, so this is
//!   how communication overlaps compute).
//!
//! `no_sync` ([`DistributedDataParallel::no_sync`]) accumulates gradients locally for k
//! micro-batches; the next synchronized backward reduces the accumulated sum. Uneven inputs across
//! ranks: [`DistributedDataParallel::backward_join`] with `ddp_core::Join`. Module [`checkpoint`]
//! converts parameters to and from `ddp_core::Checkpoint`; module [`optim`] has PyTorch's SGD (momentum,
//! in-place fused update) and candle's AdamW, both with checkpointable state.
//! [`alloc::retain_freed_memory`] stops glibc from returning candle's per-step buffers to the
//! kernel (page faults were a large share of a CPU step; the figures are in the book's
//! benchmarks chapter, `docs/benchmarks.md`). Sharded training: [`ZeroDdp`] (ZeRO stages 1 and
//! 2) and [`Fsdp`] (stage 3). On GPUs: module [`device`] and the feature `cuda`.
//!
//! Cargo feature `avx512-matmul` (default) turns on the AVX-512 kernels of candle's CPU matmul
//! (the `gemm` crate's `x86-v4`; chosen at run time only on CPUs that have AVX-512F).
//!
//! The guide is the book's candle chapter (`docs/candle.md` in the repository), with checkpoints,
//! hooks, ZeRO/FSDP and GPUs in their own chapters.
//!
//! ## Why a separate crate
//! The reducer, sampler, checkpoints and Join live in the framework-agnostic `ddp-core` crate, which
//! works on flat buffers and depends on nothing but `ddp-comm`. Everything that knows about
//! candle (tensors, `Var`s, `GradStore`, the blockwise backward) is here, so that `ddp-core` builds in
//! seconds without candle's large dependency tree (gemm, safetensors mmap, ...), can serve other
//! frameworks (`ddp-burn` is the sibling crate for Burn), and candle version bumps touch only
//! this crate.

#![forbid(unsafe_code)]

pub mod alloc;
pub mod blockwise;
pub mod buckets;
pub mod checkpoint;
#[cfg(feature = "cuda")]
pub mod cuda;
mod data_parallel;
pub mod device;
pub mod fsdp;
pub mod nn;
pub mod optim;
pub mod params;
pub mod prelude;
mod shard;
pub mod tensors;
pub mod zero;

pub use data_parallel::{BlockwiseOutput, DdpOptions, DistributedDataParallel, NoSync};
pub use ddp_comm::ProcessGroup;
pub use fsdp::{BackwardPrefetch, Fsdp, FsdpOutput, Unit};
pub use params::CandleParams;
pub use zero::{ShardOptimizer, ZeroDdp, ZeroOptions};

/// Short alias of [`DistributedDataParallel`].
pub type Ddp = DistributedDataParallel;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Errors of the candle adapter: candle's own, or the framework-agnostic `ddp-core` ones (which carry
/// communication failures naming the peer rank).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Ddp(#[from] ddp_core::Error),
    /// A model or tensor that this adapter cannot handle (the message says why).
    #[error("{0}")]
    Unsupported(String),
}

impl Error {
    /// The communication failure this error is, if it is one (a lost peer, a timeout, ...):
    /// what in-place recovery regroups on.
    pub fn comm(&self) -> Option<&ddp_comm::Error> {
        match self {
            Error::Ddp(e) => e.comm(),
            _ => None,
        }
    }
}

impl From<ddp_comm::Error> for Error {
    fn from(e: ddp_comm::Error) -> Self {
        Error::Ddp(ddp_core::Error::Comm(e))
    }
}

/// So that `?` works inside functions returning `candle_core::Result`.
impl From<Error> for candle_core::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(c) => c,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// The book's chapters (`docs/`) whose Rust blocks need candle or only `ddp-core`/`ddp-comm`, one
/// item per chapter, compiled as doctests. The Burn chapter is hosted by `ddp-burn`, the
/// launcher's by `ddprun`.
#[cfg(doctest)]
pub mod book_doctests {
    #[doc = include_str!("../../../docs/introduction.md")]
    pub struct Introduction;
    #[doc = include_str!("../../../ARCHITECTURE.md")]
    pub struct Architecture;
    #[doc = include_str!("../../../docs/backends.md")]
    pub struct Backends;
    #[doc = include_str!("../../../docs/candle.md")]
    pub struct Candle;
    #[doc = include_str!("../../../docs/checkpoints.md")]
    pub struct Checkpoints;
    #[doc = include_str!("../../../docs/fault_tolerance.md")]
    pub struct FaultTolerance;
    #[doc = include_str!("../../../docs/hooks.md")]
    pub struct Hooks;
    #[doc = include_str!("../../../docs/zero.md")]
    pub struct Zero;
    #[doc = include_str!("../../../docs/gpus.md")]
    pub struct Gpus;
    #[doc = include_str!("../../../docs/observability.md")]
    pub struct Observability;
    #[doc = include_str!("../../../docs/benchmarks.md")]
    pub struct Benchmarks;
}
