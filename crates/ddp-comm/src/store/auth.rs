//! Challenge-response proof of the shared secret, used by the store handshake.
//!
//! The secret never crosses the wire. Each side sends a fresh random nonce; each side then
//! proves it knows the secret with HMAC-SHA256 keyed by the secret over both nonces and a label
//! naming the side (so a proof made by one side can never be replayed as the other's):
//!
//! ```text
//! client_proof = HMAC-SHA256(secret, "ddp-store-v2 client\0" || client_nonce || server_nonce)
//! server_proof = HMAC-SHA256(secret, "ddp-store-v2 server\0" || client_nonce || server_nonce)
//! ```
//!
//! The server sends its proof only after the client's checked out, so an unauthenticated peer
//! learns nothing that depends on the secret. Proofs are compared in constant time
//! (`Mac::verify_slice`). This authenticates the handshake only: later frames are neither
//! encrypted nor integrity-protected (like PyTorch's `TCPStore`, which has no secret at all).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes in a nonce. The server refuses client nonces of another length.
pub(crate) const NONCE_LEN: usize = 32;

const CLIENT_LABEL: &[u8] = b"ddp-store-v2 client\0";
const SERVER_LABEL: &[u8] = b"ddp-store-v2 server\0";

/// Which side a proof comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    Client,
    Server,
}

fn mac(secret: &[u8], side: Side, client_nonce: &[u8], server_nonce: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length, so this cannot fail.
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC accepts any key length");
    mac.update(match side {
        Side::Client => CLIENT_LABEL,
        Side::Server => SERVER_LABEL,
    });
    mac.update(client_nonce);
    mac.update(server_nonce);
    mac
}

/// The proof `side` sends.
pub(crate) fn proof(
    secret: &[u8],
    side: Side,
    client_nonce: &[u8],
    server_nonce: &[u8],
) -> Vec<u8> {
    mac(secret, side, client_nonce, server_nonce)
        .finalize()
        .into_bytes()
        .to_vec()
}

/// Whether `claimed` is `side`'s proof for these nonces (constant time).
pub(crate) fn verify(
    secret: &[u8],
    side: Side,
    client_nonce: &[u8],
    server_nonce: &[u8],
    claimed: &[u8],
) -> bool {
    mac(secret, side, client_nonce, server_nonce)
        .verify_slice(claimed)
        .is_ok()
}

/// A fresh nonce from the operating system's random source.
pub(crate) fn nonce() -> std::io::Result<[u8; NONCE_LEN]> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::getrandom(&mut n).map_err(|e| std::io::Error::other(e.to_string()))?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_the_secret_the_side_and_both_nonces() {
        let (cn, sn) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let p = proof(b"s3cret", Side::Client, &cn, &sn);
        assert_eq!(p.len(), 32);
        assert!(verify(b"s3cret", Side::Client, &cn, &sn, &p));
        assert!(!verify(b"s3creT", Side::Client, &cn, &sn, &p));
        assert!(
            !verify(b"s3cret", Side::Server, &cn, &sn, &p),
            "sides differ"
        );
        assert!(
            !verify(b"s3cret", Side::Client, &sn, &cn, &p),
            "nonces are ordered"
        );
        assert!(!verify(b"s3cret", Side::Client, &cn, &sn, &p[..31]));
        assert!(!verify(b"s3cret", Side::Client, &cn, &sn, b""));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }

    #[test]
    fn matches_the_rfc_4231_vector() {
        // RFC 4231 test case 2: key "Jefe", data "what do ya want for nothing?".
        let mut m = Hmac::<Sha256>::new_from_slice(b"Jefe").unwrap();
        m.update(b"what do ya want for nothing?");
        let hex: String = m
            .finalize()
            .into_bytes()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
