//! `ddp-core`: framework-agnostic distributed data parallelism on top of `ddp-comm` — PyTorch's
//! `DistributedDataParallel` machinery (bucketed gradient reducer, comm hooks, sampler, Join,
//! checkpoints, ZeRO sharding, timeline) over flat buffers, with no tensor framework.
//!
//! Framework adapters sit on top of it: `ddp-candle` and `ddp-burn` implement
//! [`adapter::ParamAccess`] for their models and drive the reducer through [`adapter`]'s
//! functions; a training program uses the adapter's wrapper (`ddp_candle::Ddp`,
//! `ddp_burn::Ddp`) and this crate's sampler, checkpoints and hooks. The guide is the book in the
//! repository's `docs/` (`docs/SUMMARY.md`), the layers are in `ARCHITECTURE.md`.
//!
//! # Data flow
//!
//! ```text
//!  launcher (ddprun, torchrun, srun, mpirun)   sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
//!    → env (ddp_comm::env)                     which launcher, rank, world, store address
//!    → rendezvous (ddp_comm::store)            membership, addresses, host ids
//!    → process group (ddp_comm::ProcessGroup)  collectives on TCP / shared memory / MPI
//!    → reducer (ddp_core::reducer::Reducer)         gradients into buckets, a comm hook per bucket
//!    → optimizer (the framework's, or ddp_core::sharding's per-shard step)
//! ```
//!
//! Per step: the adapter hands each gradient to [`Reducer::mark_ready`](reducer::Reducer::mark_ready)
//! as the backward produces it; a full bucket goes to its [`CommHook`](reducer::CommHook)
//! (all-reduce and average by default) while the backward goes on;
//! [`Reducer::finish`](reducer::Reducer::finish) waits for the buckets, and the averaged
//! gradients go back to the framework's optimizer.
//!
//! # Modules
//!
//! - [`adapter`]: the contract a framework adapter implements ([`adapter::ParamAccess`]) and the
//!   drivers shared by the adapters (specs, gradients in and out, parameter broadcast).
//! - [`reducer`]: the bucketed, pipelined gradient [`Reducer`](reducer::Reducer) (c10d's
//!   `reducer.cpp`): parameter specs, bucket assignment, buffers on the host or a device, comm
//!   hooks, the per-step state machine, the finite check.
//! - [`hooks`]: PyTorch's built-in comm hooks: fp16/bf16 compression, PowerSGD, post-local SGD
//!   and the periodic model averager, the `--hook` syntax, hook state in checkpoints.
//! - [`sampler`]: [`DistributedSampler`], PyTorch's, index for index.
//! - [`join`]: [`Join`] for uneven inputs across ranks (and a rank-0 decision for early stops).
//! - [`checkpoint`]: atomic, checksummed single-file checkpoints, optimizer state dicts, exact
//!   resume ([`checkpoint::RunPlan`], [`checkpoint::resume_or_start`]), at other world sizes.
//! - [`sharding`]: ZeRO stages 1-3: shard layout, reduce-scatter hook, parameter gathers,
//!   global-norm clipping, sharded save sets loadable at any world size.
//! - [`trace`]: per-rank timeline merged into one Chrome trace, step profile and bottleneck
//!   report, progress output.
//! - [`verify`]: replicas identical, shards disjoint, communication overlap.
//! - [`lr`]: the linear learning-rate scaling rule for a changed world size.
//! - [`alloc`]: keeping freed host memory between steps (glibc thresholds).
//! - [`error`]: [`Error`], which carries `ddp_comm`'s errors (naming the peer and the collective).
//! - [`prelude`]: the common imports, `use ddp_core::prelude::*;`.
//!
//! # Example
//!
//! The reducer alone, on two ranks run as threads with a real process group (a launcher would
//! start processes instead, each calling `ddp_comm::init_process_group`):
//!
//! ```
//! use ddp_core::reducer::{ParamSpec, Reducer, ReducerOptions};
//! use ddp_comm::DType;
//!
//! let averaged = ddp_comm::testing::run_ranks(2, |pg| {
//!     let specs = vec![
//!         ParamSpec::new("fc.weight", [2, 2], DType::F32),
//!         ParamSpec::new("fc.bias", [2], DType::F32),
//!     ];
//!     let mut reducer = Reducer::new(&pg, specs, ReducerOptions::default()).unwrap();
//!     let g = pg.rank() as f32;                   // this rank's gradients
//!     reducer.mark_ready(1, &[g; 2]).unwrap();    // in the order the backward makes them
//!     reducer.mark_ready(0, &[g; 4]).unwrap();
//!     reducer.finish().unwrap();                  // the buckets' all-reduces, waited for
//!     reducer.grad::<f32>(0).unwrap().to_vec()
//! });
//! assert_eq!(averaged, vec![vec![0.5f32; 4]; 2]); // (0 + 1) / 2 on both ranks
//! ```
pub mod adapter;
pub mod alloc;
pub mod checkpoint;
pub mod error;
pub mod hooks;
pub mod join;
pub mod lr;
pub mod prelude;
pub mod reducer;
pub mod sampler;
pub mod sharding;
pub mod trace;
pub mod verify;

pub use checkpoint::{Checkpoint, CheckpointMeta, TensorData};
pub use error::{Error, Result};
pub use join::{Join, JoinStart, JoinStep, JoinSummary};
pub use lr::{global_batch_size, scale_lr_linear};
pub use sampler::{DistributedSampler, SamplerState};
pub use verify::{
    verify_disjoint_shards, verify_replicas, OverlapMeter, OverlapSummary, ReplicaReport,
    ShardReport,
};
