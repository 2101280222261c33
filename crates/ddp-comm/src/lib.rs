//! `ddp-comm`: the communication core of ddp-rs, with no ML dependencies.
//!
//! Data flows one way: environment ([`env`](mod@env)) → rendezvous [`store`] → [`ProcessGroup`]
//! (a background thread driving the group's [`backend`]) → collective [`algorithms`] over a
//! [`transport`] connecting every pair of ranks. Every operation is bounded by a timeout and
//! every failure names the peer rank, the collective and its sequence number.
//!
//! Where to find things:
//! - [`store`]: the TCP key-value store used for rendezvous (server, client, prefix wrapper).
//! - [`env`](mod@env): reading rank / world size / master address from torchrun, Slurm or OpenMPI env.
//! - [`host`]: where the ranks run (host identity, the group's layout over hosts).
//! - [`backend`]: the [`backend::CollectiveBackend`] trait (TCP, shared memory, hierarchical),
//!   the one selection function, requested [`Backend`] and resolved [`Topology`].
//! - [`transport`]: the [`transport::Transport`] trait; TCP, shared memory, hierarchical (hosts).
//! - [`fingerprint`]: what a collective is ([`fingerprint::Fingerprint`]: op, dtype, count,
//!   root, sequence number), carried by every message and named by every error.
//! - [`algorithms`]: one file per collective algorithm (ring, recursive doubling, trees, ...).
//! - [`placement`]: the caller's side of an all-gather whose result it places
//!   ([`placement::Place`]), shared by the backends and the shared-memory algorithm.
//! - [`collectives`]: the [`Collectives`] trait every group (host, relay, CUDA) implements.
//! - [`process_group`]: init, groups, subgroups, the engine thread and the public collective API.
//! - [`work`]: async work handles.
//! - [`observe`]: the hook through which timelines and profilers see each collective.
//! - [`dtype`]: element types and reduction ops.
//! - [`error`]: the error type.
//! - [`testing`]: running N ranks as threads of one process, for tests.

pub mod algorithms;
pub mod backend;
pub mod collectives;
#[cfg(feature = "nccl")]
pub mod cuda;
pub mod device;
pub mod dtype;
pub mod env;
pub mod error;
pub mod fingerprint;
#[doc(hidden)]
pub mod fuzzing;
pub mod host;
pub mod observe;
pub mod placement;
pub mod process_group;
pub mod store;
pub mod testing;
pub mod transport;
pub mod work;

pub use backend::{Backend, Topology};
pub use collectives::{Collectives, Wait};
pub use dtype::{DType, Element, ReduceOp};
pub use error::{Error, Result};
pub use process_group::{init_process_group, InitOptions, ProcessGroup};
pub use store::{PrefixStore, Store, StoreServer, TcpStore};
pub use work::Work;
