//! The cluster key's signature (HMAC-SHA256), shared by the flow exchange's
//! frames and L2 mode's datagrams so that both sign and check the same way.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// A signature's length in bytes.
pub const TAG_LEN: usize = 32;

fn keyed(key: &[u8], parts: &[&[u8]]) -> Hmac<Sha256> {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for part in parts {
        m.update(part);
    }
    m
}

/// The signature of `parts`, one after the other, under `key`.
pub fn sign(key: &[u8], parts: &[&[u8]]) -> [u8; TAG_LEN] {
    keyed(key, parts).finalize().into_bytes().into()
}

/// Whether `tag` signs `parts` under `key` (compared in constant time, so
/// that a forger learns nothing from how long the check takes).
pub fn verify(key: &[u8], parts: &[&[u8]], tag: &[u8]) -> bool {
    keyed(key, parts).verify_slice(tag).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_sign_as_their_concatenation() {
        let key = b"0123456789abcdef";
        let whole = sign(key, &[b"header payload"]);
        assert_eq!(sign(key, &[b"header ", b"payload"]), whole);
        assert!(verify(key, &[b"header", b" payload"], &whole));
        assert!(!verify(b"another key 0123", &[b"header payload"], &whole));
        assert!(!verify(key, &[b"header payload"], &whole[..TAG_LEN - 1]));
    }
}
