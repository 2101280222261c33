//! The common imports of a candle training program: `use ddp_candle::prelude::*;` brings the
//! DDP wrapper, its options and errors, and everything of `ddp::prelude` (reducer, comm hooks,
//! sampler, Join, process group).

pub use crate::{Ddp, DdpOptions, DistributedDataParallel};
pub use ddp::prelude::*;
