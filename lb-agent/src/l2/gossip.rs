//! The membership among agents: SWIM through the `foca` crate (transport-
//! and identity-agnostic, no I/O of its own, maintained), over UDP. Every
//! datagram is encrypted and authenticated with the cluster key
//! (`crate::seal`) so that nodes of another cluster, or strangers, cannot
//! join, declare members down, or read who serves what.

use std::{net::SocketAddr, num::NonZeroUsize, time::Duration};

use serde::{Deserialize, Serialize};

use crate::{
    config::L2Config,
    seal::{Keyring, Refusal, OVERHEAD},
};

/// A member: its node name, where it listens, and a generation bumped when
/// it rejoins after being declared down (the newer one wins).
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub name: String,
    pub addr: SocketAddr,
    pub generation: u64,
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}#{}", self.name, self.addr, self.generation)
    }
}

impl foca::Identity for Member {
    type Addr = SocketAddr;

    fn renew(&self) -> Option<Self> {
        Some(Self {
            generation: self.generation.wrapping_add(1),
            ..self.clone()
        })
    }

    fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn win_addr_conflict(&self, adversary: &Self) -> bool {
        self.generation > adversary.generation
    }
}

/// The SWIM settings for the configured timings. Updates are gossiped
/// every half probe interval so that a member declared down is known by
/// all within a few milliseconds, and down members are re-announced to
/// every second so that a healed partition merges by itself.
pub fn swim_config(cfg: &L2Config) -> foca::Config {
    let mut c = foca::Config::simple();
    c.probe_period = cfg.probe_interval;
    c.probe_rtt = cfg.probe_timeout;
    c.suspect_to_down_after = cfg.suspect_timeout;
    c.num_indirect_probes = NonZeroUsize::new(3).expect("non-zero");
    c.notify_down_members = true;
    c.remove_down_after = Duration::from_secs(3600);
    c.periodic_gossip = Some(foca::PeriodicParams {
        frequency: cfg.probe_interval / 2,
        num_members: NonZeroUsize::new(3).expect("non-zero"),
    });
    c.periodic_announce_to_down_members = Some(foca::PeriodicParams {
        frequency: Duration::from_secs(1),
        num_members: NonZeroUsize::new(3).expect("non-zero"),
    });
    c
}

/// Datagram header, authenticated with the sealed rest: a magic and a
/// version, then the kind of datagram.
const MAGIC: &[u8; 4] = b"XLB\x03";

/// What a datagram carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// SWIM (foca's encoding).
    Swim = 0,
    /// A heartbeat: the sender and the VIPs it answers for (`Heartbeat`).
    Heartbeat = 1,
}

/// Sent to every peer each renewal: that the sender lives, which VIPs it
/// can serve (a usable backend: with `externalTrafficPolicy: Local`, a
/// ready local endpoint), and which it answers for now. Owners are chosen
/// among the nodes that can serve a VIP, and a node takes a VIP only when
/// no member it hears from holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub name: String,
    pub serves: Vec<std::net::IpAddr>,
    pub holds: Vec<std::net::IpAddr>,
}

/// Why a datagram was refused (the metric's label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Not xlb's, or another version's.
    Malformed,
    /// Sealed with a key this node does not have, or altered: another
    /// cluster, a stranger, or a key not rolled out here yet.
    BadKey,
}

impl Refused {
    pub fn label(self) -> &'static str {
        match self {
            Refused::Malformed => "malformed",
            Refused::BadKey => "bad_key",
        }
    }
}

/// A datagram of `kind` carrying `payload`, sealed with the first key.
pub fn seal(keys: &Keyring, kind: Kind, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAGIC.len() + 1 + OVERHEAD + payload.len());
    out.extend_from_slice(MAGIC);
    out.push(kind as u8);
    let sealed = keys.seal(&out, payload);
    out.extend_from_slice(&sealed);
    out
}

/// The kind and payload of a datagram sealed with one of `keys`.
pub fn open(keys: &Keyring, datagram: &[u8]) -> Result<(Kind, Vec<u8>), Refused> {
    let head = MAGIC.len() + 1;
    if datagram.len() < head + OVERHEAD || &datagram[..MAGIC.len()] != MAGIC {
        return Err(Refused::Malformed);
    }
    let (header, sealed) = datagram.split_at(head);
    let payload = keys.open(header, sealed).map_err(|e| match e {
        Refusal::Short => Refused::Malformed,
        Refusal::UnknownKey | Refusal::Forged => Refused::BadKey,
    })?;
    let kind = match header[MAGIC.len()] {
        0 => Kind::Swim,
        1 => Kind::Heartbeat,
        _ => return Err(Refused::Malformed),
    };
    Ok((kind, payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seal::Purpose;

    fn keys(secret: &[u8]) -> Keyring {
        Keyring::new(&[secret.to_vec()], Purpose::L2)
    }

    #[test]
    fn a_sealed_datagram_opens_with_its_key_only() {
        let key = keys(b"0123456789abcdef");
        let d = seal(&key, Kind::Swim, b"hello");
        assert_eq!(open(&key, &d), Ok((Kind::Swim, b"hello".to_vec())));
        assert!(!d.windows(5).any(|w| w == b"hello"), "not readable");
        assert_eq!(open(&keys(b"another key 0123"), &d), Err(Refused::BadKey));
        let mut flipped = d.clone();
        flipped[4] ^= 1;
        assert_eq!(open(&key, &flipped), Err(Refused::BadKey), "kind bound");
        let mut flipped = d.clone();
        *flipped.last_mut().unwrap() ^= 1;
        assert_eq!(open(&key, &flipped), Err(Refused::BadKey));
        assert_eq!(open(&key, b"XLB\x02"), Err(Refused::Malformed));
        assert_eq!(open(&key, &d[1..]), Err(Refused::Malformed));
    }

    mod generated {
        //! Generated input (`cargo xtask fuzz` runs these long).
        use proptest::{collection::vec, prelude::*, sample::Index};

        use super::*;

        proptest! {
            #[test]
            fn generated_datagrams_are_refused(bytes in vec(any::<u8>(), 0..1500)) {
                prop_assert!(open(&keys(b"0123456789abcdef"), &bytes).is_err());
            }

            /// Any bit flipped anywhere in a datagram: refused, never taken.
            #[test]
            fn generated_changes_to_a_datagram_are_refused(
                payload in vec(any::<u8>(), 0..300),
                heartbeat in any::<bool>(),
                at in any::<Index>(),
                bit in 0u8..8,
            ) {
                let key = keys(b"0123456789abcdef");
                let kind = if heartbeat { Kind::Heartbeat } else { Kind::Swim };
                let mut d = seal(&key, kind, &payload);
                prop_assert_eq!(open(&key, &d), Ok((kind, payload)));
                let i = at.index(d.len());
                d[i] ^= 1 << bit;
                prop_assert!(open(&key, &d).is_err());
            }
        }
    }
}
