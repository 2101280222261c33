//! The store's key-value map with a cap on the bytes it holds (keys and values together): a
//! write that would go past the cap is refused to the client that made it, with an error naming
//! the cap and how to raise it, and the server goes on serving everyone else.

use std::collections::HashMap;

/// Environment variable setting the most bytes (keys and values) a store server holds.
pub const MAX_BYTES_ENV: &str = "DDP_STORE_MAX_BYTES";

/// Default of the cap on the bytes a store server holds: 1 GiB.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

/// The map, and the bytes its keys and values take.
#[derive(Debug)]
pub(super) struct Data {
    map: HashMap<String, Vec<u8>>,
    bytes: u64,
    max_bytes: u64,
}

fn size(key: &str, value: &[u8]) -> u64 {
    (key.len() + value.len()) as u64
}

impl Data {
    pub(super) fn new(max_bytes: u64) -> Data {
        Data {
            map: HashMap::new(),
            bytes: 0,
            max_bytes,
        }
    }

    pub(super) fn get(&self, key: &str) -> Option<&Vec<u8>> {
        self.map.get(key)
    }

    pub(super) fn contains_key(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &String> {
        self.map.keys()
    }

    pub(super) fn remove(&mut self, key: &str) -> Option<Vec<u8>> {
        let old = self.map.remove(key)?;
        self.bytes -= size(key, &old);
        Some(old)
    }

    /// Bytes held now (keys and values).
    #[cfg(test)]
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Whether `key` may hold a value of `new_len` bytes; `Err` names the cap and how to raise
    /// it.
    fn check(&self, key: &str, new_len: usize) -> Result<(), String> {
        let old = self.map.get(key).map_or(0, |v| size(key, v));
        let after = self.bytes - old + size(key, &[]) + new_len as u64;
        if after <= self.max_bytes {
            return Ok(());
        }
        let shown: String = key.chars().take(80).collect();
        let more = if shown.len() < key.len() { "..." } else { "" };
        Err(format!(
            "the store is full: writing {new_len} bytes to key {shown:?}{more} would bring what \
             it holds to {after} bytes, past its cap of {} bytes; raise the cap where the store \
             is hosted ({MAX_BYTES_ENV}, `ddprun --store-max-bytes`, or \
             ServerOptions::max_bytes), or delete keys that are no longer needed",
            self.max_bytes
        ))
    }

    /// Set `key` to `value`, unless the cap refuses it.
    pub(super) fn insert(&mut self, key: String, value: Vec<u8>) -> Result<(), String> {
        self.check(&key, value.len())?;
        let (klen, vlen) = (key.len() as u64, value.len() as u64);
        match self.map.insert(key, value) {
            Some(old) => self.bytes = self.bytes - old.len() as u64 + vlen,
            None => self.bytes += klen + vlen,
        }
        Ok(())
    }

    /// Append `value` to `key`'s value (an empty one when missing), unless the cap refuses it.
    pub(super) fn append(&mut self, key: String, value: &[u8]) -> Result<(), String> {
        let len = self.map.get(&key).map_or(0, Vec::len);
        self.check(&key, len + value.len())?;
        let existed = self.map.contains_key(&key);
        self.map
            .entry(key.clone())
            .or_default()
            .extend_from_slice(value);
        self.bytes += value.len() as u64 + if existed { 0 } else { key.len() as u64 };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_counted_and_the_cap_holds() {
        let mut d = Data::new(20);
        d.insert("k".into(), vec![0; 9]).unwrap();
        assert_eq!(d.bytes(), 10);
        d.insert("k".into(), vec![0; 4]).unwrap();
        assert_eq!(d.bytes(), 5);
        // 5 + 16 > 20: refused, nothing changed.
        let e = d.insert("j".into(), vec![0; 15]).unwrap_err();
        assert!(
            e.contains("cap of 20 bytes") && e.contains(MAX_BYTES_ENV),
            "{e}"
        );
        assert_eq!((d.bytes(), d.len()), (5, 1));
        // Replacing a value counts only the difference.
        d.insert("k".into(), vec![0; 19]).unwrap();
        assert_eq!(d.bytes(), 20);
        assert!(d.append("k".into(), b"x").is_err());
        d.remove("k");
        assert_eq!(d.bytes(), 0);
        d.append("ab".into(), b"cd").unwrap();
        d.append("ab".into(), b"e").unwrap();
        assert_eq!(
            (d.bytes(), d.get("ab").unwrap().as_slice()),
            (5, &b"cde"[..])
        );
    }
}
