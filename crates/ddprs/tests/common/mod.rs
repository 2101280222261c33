//! What the packaging tests share.

use std::path::{Path, PathBuf};

/// The crates published, in dependency order; everything else says `publish = false`.
pub const PUBLISHED: [&str; 6] = [
    "ddp-comm",
    "ddp-core",
    "ddp-candle",
    "ddp-burn",
    "ddprun",
    "ddprs",
];

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}
