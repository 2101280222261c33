//! Collectives on device memory: the part that does not depend on CUDA, so that it builds and is
//! tested on every machine. The CUDA side (module `cuda`, feature `nccl`) is built on it.
//!
//! ```text
//!  user / reducer bucket (device memory)
//!        │ CudaGroup::all_reduce(&mut CudaSlice<T>, op)            crate::cuda (feature nccl)
//!        ▼
//!  DeviceTopology, chosen once from DeviceBackend (auto | nccl | relay) and the device ids
//!        │ every rank its own GPU and libnccl loads ──▶ NCCL communicator on a comm stream,
//!        │                                              watched by device::watchdog
//!        │ otherwise (ranks share a GPU, no libnccl, or asked for) ──▶ device::relay
//!        ▼
//!  device::relay: device ─download─▶ pinned host ─▶ ProcessGroup's own collectives (shm/TCP,
//!                  the host CollectiveBackend) ─▶ host ─upload─▶ device
//! ```
//!
//! Device collectives sit *beside* the host [`crate::backend::CollectiveBackend`], not inside
//! it: a [`crate::ProcessGroup`] stays the host group (store, rank, world, host collectives), and
//! a device group is built from one. NCCL is the device counterpart of a backend (its own
//! communicator, stream and watchdog); the relay path is a client of the host backend.
//!
//! What is here:
//! - [`DeviceBackend`] (what the user asks for) and [`DeviceTopology`] (what a group uses), with
//!   the one choice function [`choose_backend`] over the ranks' [`DeviceId`]s, exchanged through
//!   the store by [`exchange_device_ids`]; [`exchange_unique_id`] publishes rank 0's NCCL id.
//! - [`relay`]: the collectives relayed through the host, written once against the small
//!   [`relay::RelayBuffer`] trait (device memory that can be copied to and from host memory) and
//!   [`relay::HostRelay`] (where the host copy lives: pinned memory on CUDA). The tests run
//!   the same code over host-memory implementations with real multi-rank groups.
//! - [`DeviceOp`]: one device collective and its arguments, with the one argument check and
//!   fingerprint both paths (NCCL and relay) use.
//! - [`check`]: the fingerprint check (op, dtype, count, root) through the host group before the
//!   first use of a new shape, so a mismatch fails by name instead of corrupting or hanging NCCL.
//! - [`watchdog`]: a thread that fails (and aborts) a device collective not finished within
//!   its timeout and tells the other ranks through the store.

pub mod check;
mod op;
pub mod relay;
pub mod watchdog;

pub use op::DeviceOp;

use crate::store::Store;
use crate::{Error, Result};
use std::fmt;
use std::time::Duration;

/// Env var naming the device backend (`auto`, `nccl`, `relay`), read by
/// [`DeviceBackend::from_env`].
pub const DEVICE_BACKEND_ENV: &str = "DDP_DEVICE_BACKEND";

/// Which device-collective implementation the user asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceBackend {
    /// NCCL when every rank of the group has its own GPU and libnccl loads; relay otherwise.
    #[default]
    Auto,
    /// NCCL; creating the group fails (naming the reason) if it cannot be used.
    Nccl,
    /// Relayed through the host: device → pinned host → the host group's collectives → device
    /// (Gloo's way).
    Relay,
}

impl DeviceBackend {
    /// Parse `auto`, `nccl` or `relay` (aliases `staged`, its former name, and `gloo`, as torch
    /// runs CUDA tensors through gloo).
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Some(DeviceBackend::Auto),
            "nccl" => Some(DeviceBackend::Nccl),
            "relay" | "staged" | "gloo" => Some(DeviceBackend::Relay),
            _ => None,
        }
    }

    /// The backend named by env `DDP_DEVICE_BACKEND` (auto when unset).
    pub fn from_env() -> Result<Self> {
        match std::env::var(DEVICE_BACKEND_ENV) {
            Ok(v) => DeviceBackend::parse(&v).ok_or_else(|| {
                Error::Config(format!(
                    "{DEVICE_BACKEND_ENV}={v:?}: expected auto, nccl or relay"
                ))
            }),
            Err(_) => Ok(DeviceBackend::Auto),
        }
    }
}

impl fmt::Display for DeviceBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceBackend::Auto => "auto",
            DeviceBackend::Nccl => "nccl",
            DeviceBackend::Relay => "relay",
        })
    }
}

/// Which physical device a rank uses: its host and the device's UUID (or bus id). Two ranks
/// with equal ids share one GPU, which NCCL refuses ("Duplicate GPU detected").
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DeviceId {
    /// The host ([`crate::host::host_id`]).
    pub host: String,
    /// The device's UUID (or any string unique per physical device on that host).
    pub device: String,
}

impl DeviceId {
    fn encode(&self) -> Vec<u8> {
        format!("{}\n{}", self.host, self.device).into_bytes()
    }

    fn decode(b: &[u8]) -> Option<DeviceId> {
        let s = std::str::from_utf8(b).ok()?;
        let (host, device) = s.split_once('\n')?;
        Some(DeviceId {
            host: host.into(),
            device: device.into(),
        })
    }
}

/// What a device group resolved to (`CudaGroup::topology` of module `cuda`, feature `nccl`).
/// Displays as `nccl: 4 ranks, one GPU each` or `relay: 2 ranks, ranks 0 and 1 share a GPU`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceTopology {
    /// An NCCL communicator over `ranks` ranks, each on its own GPU.
    Nccl { ranks: usize },
    /// Collectives relayed through the host group; `reason` says why not NCCL.
    Relay { ranks: usize, reason: String },
}

impl DeviceTopology {
    /// `nccl` or `relay`.
    pub fn name(&self) -> &'static str {
        match self {
            DeviceTopology::Nccl { .. } => "nccl",
            DeviceTopology::Relay { .. } => "relay",
        }
    }
}

impl fmt::Display for DeviceTopology {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceTopology::Nccl { ranks } => write!(f, "nccl: {ranks} ranks, one GPU each"),
            DeviceTopology::Relay { ranks, reason } => {
                write!(f, "relay: {ranks} ranks, {reason}")
            }
        }
    }
}

/// The one place that picks a device group's implementation, from what was asked, every rank's
/// device (by group rank) and whether NCCL can be loaded here (`Err` carries why not):
///
/// - `relay`: relay.
/// - two ranks on one device: `nccl` fails naming both ranks and the device; `auto` relays.
/// - NCCL missing: `nccl` fails with the loader's reason; `auto` relays.
/// - otherwise NCCL.
pub fn choose_backend(
    requested: DeviceBackend,
    devices: &[DeviceId],
    nccl: std::result::Result<(), String>,
) -> Result<DeviceTopology> {
    let ranks = devices.len();
    if requested == DeviceBackend::Relay {
        return Ok(DeviceTopology::Relay {
            ranks,
            reason: "relayed on request".into(),
        });
    }
    let shared = (0..ranks).find_map(|j| {
        (0..j)
            .find(|&i| devices[i] == devices[j])
            .map(|i| (i, j, &devices[j]))
    });
    if let Some((i, j, d)) = shared {
        let why = format!(
            "ranks {i} and {j} share a GPU (device {} on host {})",
            d.device, d.host
        );
        if requested == DeviceBackend::Nccl {
            return Err(Error::Config(format!(
                "device backend nccl: {why}, which NCCL refuses (\"Duplicate GPU detected\"); \
                 give each rank its own GPU or use device backend auto or relay"
            )));
        }
        return Ok(DeviceTopology::Relay { ranks, reason: why });
    }
    match nccl {
        Ok(()) => Ok(DeviceTopology::Nccl { ranks }),
        Err(why) if requested == DeviceBackend::Nccl => {
            Err(Error::Config(format!("device backend nccl: {why}")))
        }
        Err(why) => Ok(DeviceTopology::Relay { ranks, reason: why }),
    }
}

/// Publish this rank's device under `key`/`rank` and read every rank's (by rank), waiting at
/// most `timeout` for the others (the error names the ranks that did not publish).
pub fn exchange_device_ids(
    store: &dyn Store,
    key: &str,
    rank: usize,
    size: usize,
    mine: &DeviceId,
    timeout: Duration,
) -> Result<Vec<DeviceId>> {
    store.set(&format!("{key}/{rank}"), &mine.encode())?;
    (0..size)
        .map(|r| {
            let bytes = store
                .get_timeout(&format!("{key}/{r}"), timeout)
                .map_err(|e| e.waiting_for(|| format!("rank {r} to publish its CUDA device")))?;
            DeviceId::decode(&bytes).ok_or_else(|| {
                Error::Config(format!(
                    "rank {r} published a malformed device id {bytes:?}"
                ))
            })
        })
        .collect()
}

/// Rank 0 makes an id with `make` (NCCL's `ncclGetUniqueId`) and publishes it under `key`; every
/// rank returns rank 0's id. A failure of `make` on rank 0 is published too, so the other
/// ranks fail with it instead of waiting out `timeout`.
pub fn exchange_unique_id(
    store: &dyn Store,
    key: &str,
    rank: usize,
    timeout: Duration,
    make: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<Vec<u8>> {
    if rank == 0 {
        let made = make();
        let msg = match &made {
            Ok(id) => {
                let mut m = vec![b'+'];
                m.extend_from_slice(id);
                m
            }
            Err(e) => format!("-{e}").into_bytes(),
        };
        store.set(key, &msg)?;
        return made;
    }
    let got = store
        .get_timeout(key, timeout)
        .map_err(|e| e.waiting_for(|| "rank 0 to publish the NCCL unique id".into()))?;
    match got.split_first() {
        Some((b'+', id)) => Ok(id.to_vec()),
        Some((b'-', why)) => Err(Error::Config(format!(
            "rank 0 could not create the NCCL unique id: {}",
            String::from_utf8_lossy(why)
        ))),
        _ => Err(Error::Config(format!(
            "malformed NCCL unique id under store key {key:?} ({} bytes)",
            got.len()
        ))),
    }
}
