//! [`PrefixStore`]: a namespace over any [`Store`], like PyTorch's `PrefixStore`.
//!
//! Every key is stored in the inner store as `"{prefix}/{key}"`, so several users (process
//! groups, subgroups, the launcher) can share one store without their keys colliding. Prefix
//! stores nest: a `PrefixStore` over a `PrefixStore` yields `"outer/inner/key"`.

use super::Store;
use crate::Result;
use std::sync::Arc;
use std::time::Duration;

/// A [`Store`] that prefixes every key with `"{prefix}/"` before handing it to `inner`.
#[derive(Clone)]
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// A view of `inner` in which every key is namespaced under `prefix`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> PrefixStore {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    /// The prefix (without the trailing `/`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The store this one forwards to.
    pub fn inner(&self) -> &Arc<dyn Store> {
        &self.inner
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{key}", self.prefix)
    }
}

impl std::fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixStore")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }

    fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get_timeout(&self.key(key), timeout)
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let full: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = full.iter().map(String::as_str).collect();
        self.inner.wait(&refs, timeout)
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }

    /// Number of keys in the **inner** store, all prefixes included (as in PyTorch: the store
    /// protocol has no per-prefix count).
    fn num_keys(&self) -> Result<u64> {
        self.inner.num_keys()
    }

    fn check(&self, key: &str) -> Result<bool> {
        self.inner.check(&self.key(key))
    }

    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
}
