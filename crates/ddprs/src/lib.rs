//! **ddp-rs**: distributed data-parallel training for Rust — PyTorch's `torch.distributed`,
//! `DistributedDataParallel` and `torchrun`, with Rust's safety and errors that name the rank,
//! the peer and the collective. One process per device, each with a full model replica and a
//! disjoint shard of the data; the gradients are averaged with all-reduce in buckets while the
//! backward pass still runs, so every replica takes the identical step.
//!
//! This is the facade crate: one dependency, the framework by feature.
//!
//! ```toml
//! [dependencies]
//! ddprs = { version = "0.1", features = ["candle"] }   # or "burn"
//! ```
//!
//! | feature | brings | PyTorch |
//! |---|---|---|
//! | (always) | [`comm`]: process groups, collectives, the rendezvous store; at the root: the reducer, [comm hooks](hooks), [ZeRO](sharding), [`DistributedSampler`], [`Join`], [checkpoints](checkpoint), [`prelude`] | `torch.distributed`, `DistributedSampler` |
//! | `candle` | `candle`: `Ddp` for candle models, ZeRO, FSDP, optimizers with checkpointable state | `DistributedDataParallel`, FSDP |
//! | `burn` | `burn`: `Ddp` for Burn modules, `ShardedDataset`, Burn's `Learner` data-parallel | `DistributedDataParallel` |
//! | `launcher` | `launcher`: `spawn` workers from inside a program (the `ddprun` command: `cargo install ddprun`) | `torch.multiprocessing.spawn`, `torchrun` |
//! | `mpi`, `nccl`, `cuda` | the MPI backend; NCCL on CUDA memory; candle on CUDA with device buckets | `mpi`, `nccl` backends |
//!
//! # Quick start with candle
//!
//! A complete program (`examples/quickstart-candle.rs`); the lines that make it data-parallel
//! end in `// DDP`, the same program without them is `examples/quickstart-candle-no-ddp.rs`.
//! Built as your crate's binary, run it with `ddprun --nproc-per-node 2 target/debug/<binary>`
//! (in the repository: `cargo build -p ddprs --features candle --examples`, then
//! `ddprun --nproc-per-node 2 target/debug/examples/quickstart-candle`). `ddprun` (`cargo install
//! ddprun`) sets each worker's `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`, as torchrun
//! does.
//!
#![cfg_attr(feature = "candle", doc = "```no_run")]
#![cfg_attr(not(feature = "candle"), doc = "```ignore")]
#![doc = include_str!("../examples/quickstart-candle.rs")]
//! ```
//!
//! # Quick start with Burn
//!
#![cfg_attr(feature = "burn", doc = "```no_run")]
#![cfg_attr(not(feature = "burn"), doc = "```ignore")]
#![doc = include_str!("../examples/quickstart-burn.rs")]
//! ```
//!
//! # Where to read on
//!
//! The book (`docs/` in the repository, <https://github.com/ddp-rs/ddp-rs/blob/main/docs/SUMMARY.md>):
//! launching and elastic jobs, backends, training with candle and Burn, checkpoints, comm
//! hooks, ZeRO and FSDP, GPUs, observability, benchmarks, versioning.

#![forbid(unsafe_code)]

/// Process groups, collectives, transports and the rendezvous store: the `ddp-comm` crate.
#[doc(inline)]
pub use ddp_comm as comm;

#[doc(inline)]
pub use ddp_comm::{init_process_group, Backend, InitOptions, ProcessGroup, ReduceOp};

#[doc(inline)]
pub use ddp_core::*;

/// DistributedDataParallel for candle models: the `ddp-candle` crate (feature `candle`).
#[cfg(feature = "candle")]
pub mod candle {
    #[doc(inline)]
    pub use ddp_candle::*;
}

/// DistributedDataParallel for Burn modules: the `ddp-burn` crate (feature `burn`).
#[cfg(feature = "burn")]
pub mod burn {
    #[doc(inline)]
    pub use ddp_burn::*;
}

/// Starting workers: `spawn` them from inside a program, the launcher's agent, rendezvous and
/// output: the library of the `ddprun` crate (feature `launcher`; the `ddprun` command itself is
/// `cargo install ddprun`).
#[cfg(feature = "launcher")]
pub mod launcher {
    #[doc(inline)]
    pub use ddprun::*;
}

/// The README's Rust blocks (the two quick starts, as in `examples/`), compiled as doctests
/// when both frameworks are on (as under `cargo test --workspace`).
#[cfg(all(doctest, feature = "candle", feature = "burn"))]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;
