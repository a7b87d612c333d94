//! The cluster keys' encryption, shared by the flow exchange's frames and
//! L2 mode's datagrams: each message is encrypted and authenticated with
//! XChaCha20-Poly1305 under a key derived from a cluster key.
//!
//! Why an AEAD keyed from the cluster key rather than TLS: L2 membership
//! is UDP datagrams, which rustls does not carry (no DTLS); one scheme for
//! both channels keeps one secret to manage, the Secret the chart already
//! mounts, with no certificates to issue, renew or trust. Random 192-bit
//! nonces (XChaCha) need no counter shared between restarts.
//!
//! Key rotation: a key file holds one or more keys, one per line. An agent
//! sends with the first and accepts any of them, so a new key is rolled
//! node by node (add it second everywhere, move it first everywhere, drop
//! the old one) with no moment when two nodes cannot read each other.
//!
//! A sealed message: key id (4 bytes), nonce (24), ciphertext, tag (16).
//! The caller's header is authenticated with it (associated data).

use std::sync::{Arc, RwLock};

use chacha20poly1305::{
    aead::{Aead, KeyInit, Payload},
    XChaCha20Poly1305, XNonce,
};
use hkdf::Hkdf;
use rand::TryRngCore;
use sha2::Sha256;

const ID_LEN: usize = 4;
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;
/// What sealing adds to a message.
pub const OVERHEAD: usize = ID_LEN + NONCE_LEN + TAG_LEN;

/// What a message is for: a key derived for one never opens the other's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    FlowSync,
    L2,
}

impl Purpose {
    fn label(self) -> &'static [u8] {
        match self {
            Purpose::FlowSync => b"xlb flow exchange v1",
            Purpose::L2 => b"xlb l2 membership v1",
        }
    }
}

/// Why a message did not open.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("too short to be sealed")]
    Short,
    #[error("sealed with a key this node does not have")]
    UnknownKey,
    #[error("altered, or sealed with another key")]
    Forged,
}

struct Key {
    id: [u8; ID_LEN],
    cipher: XChaCha20Poly1305,
}

/// The keys of one purpose, the first the one to send with.
pub struct Keyring {
    keys: Vec<Key>,
}

impl std::fmt::Debug for Keyring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<String> = self.keys.iter().map(|k| hex(&k.id)).collect();
        f.debug_struct("Keyring").field("ids", &ids).finish()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Keyring {
    /// The keyring of `secrets` (at least one) for `purpose`.
    pub fn new(secrets: &[Vec<u8>], purpose: Purpose) -> Keyring {
        assert!(!secrets.is_empty(), "a keyring needs a key");
        let keys = secrets
            .iter()
            .map(|secret| {
                let h = Hkdf::<Sha256>::new(Some(purpose.label()), secret);
                let mut key = [0u8; 32];
                let mut id = [0u8; ID_LEN];
                h.expand(b"key", &mut key)
                    .expect("32 bytes is a valid length");
                h.expand(b"id", &mut id).expect("4 bytes is a valid length");
                Key {
                    id,
                    cipher: XChaCha20Poly1305::new(&key.into()),
                }
            })
            .collect();
        Keyring { keys }
    }

    /// The id of the key this node seals with.
    pub fn sending_id(&self) -> String {
        hex(&self.keys[0].id)
    }

    /// `message`, encrypted with the first key, `header` authenticated.
    pub fn seal(&self, header: &[u8], message: &[u8]) -> Vec<u8> {
        let key = &self.keys[0];
        let mut nonce = [0u8; NONCE_LEN];
        rand::rngs::OsRng
            .try_fill_bytes(&mut nonce)
            .expect("the kernel's random numbers");
        let aad = [header, &key.id, &nonce].concat();
        let sealed = key
            .cipher
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: message,
                    aad: &aad,
                },
            )
            .expect("a message under 256 GiB");
        let mut out = Vec::with_capacity(OVERHEAD + message.len());
        out.extend_from_slice(&key.id);
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&sealed);
        out
    }

    /// The message `sealed` carries, if one of the keys sealed it with
    /// `header`.
    pub fn open(&self, header: &[u8], sealed: &[u8]) -> Result<Vec<u8>, Refusal> {
        if sealed.len() < OVERHEAD {
            return Err(Refusal::Short);
        }
        let (id, rest) = sealed.split_at(ID_LEN);
        let (nonce, body) = rest.split_at(NONCE_LEN);
        let key = self
            .keys
            .iter()
            .find(|k| k.id == id)
            .ok_or(Refusal::UnknownKey)?;
        let aad = [header, id, nonce].concat();
        key.cipher
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: body,
                    aad: &aad,
                },
            )
            .map_err(|_| Refusal::Forged)
    }
}

/// A keyring that a reload can replace while the tasks that use it run.
#[derive(Clone, Debug)]
pub struct SharedKeys(Arc<RwLock<Arc<Keyring>>>);

impl SharedKeys {
    pub fn new(ring: Keyring) -> Self {
        SharedKeys(Arc::new(RwLock::new(Arc::new(ring))))
    }

    pub fn get(&self) -> Arc<Keyring> {
        self.0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    pub fn set(&self, ring: Keyring) {
        *self
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(ring);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(secrets: &[&[u8]], purpose: Purpose) -> Keyring {
        let secrets: Vec<Vec<u8>> = secrets.iter().map(|s| s.to_vec()).collect();
        Keyring::new(&secrets, purpose)
    }

    const OLD: &[u8] = b"0123456789abcdef";
    const NEW: &[u8] = b"fedcba9876543210";

    #[test]
    fn a_sealed_message_opens_with_its_key_and_header_only() {
        let r = ring(&[OLD], Purpose::L2);
        let s = r.seal(b"head", b"client 10.1.2.3:40000");
        assert_eq!(r.open(b"head", &s).unwrap(), b"client 10.1.2.3:40000");
        assert!(
            !s.windows(8).any(|w| w == b"10.1.2.3"),
            "the message is not readable"
        );
        assert_eq!(r.open(b"hea?", &s), Err(Refusal::Forged), "header bound");
        let mut flipped = s.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(r.open(b"head", &flipped), Err(Refusal::Forged));
        assert_eq!(r.open(b"head", &s[..OVERHEAD - 1]), Err(Refusal::Short));
        assert_eq!(
            ring(&[NEW], Purpose::L2).open(b"head", &s),
            Err(Refusal::UnknownKey)
        );
        assert_eq!(
            ring(&[OLD], Purpose::FlowSync).open(b"head", &s),
            Err(Refusal::UnknownKey),
            "one purpose's messages do not open as the other's"
        );
        assert_ne!(r.seal(b"head", b"x"), r.seal(b"head", b"x"), "fresh nonces");
    }

    /// The three steps of a rotation: every pair of neighbouring steps
    /// reads each other.
    #[test]
    fn a_rotation_never_has_two_nodes_that_cannot_read_each_other() {
        let steps = [
            ring(&[OLD], Purpose::FlowSync),
            ring(&[OLD, NEW], Purpose::FlowSync),
            ring(&[NEW, OLD], Purpose::FlowSync),
            ring(&[NEW], Purpose::FlowSync),
        ];
        for pair in steps.windows(2) {
            for (a, b) in [(&pair[0], &pair[1]), (&pair[1], &pair[0])] {
                assert_eq!(a.open(b"", &b.seal(b"", b"m")).unwrap(), b"m");
            }
        }
        assert_eq!(steps[0].sending_id(), steps[1].sending_id());
        assert_ne!(steps[1].sending_id(), steps[2].sending_id());
    }
}
