//! The membership among agents: SWIM through the `foca` crate (transport-
//! and identity-agnostic, no I/O of its own, maintained), over UDP. Every
//! datagram is signed with the cluster key (HMAC-SHA256) so that nodes of
//! another cluster, or strangers, cannot join or declare members down.

use std::{net::SocketAddr, num::NonZeroUsize, time::Duration};

use serde::{Deserialize, Serialize};

use crate::{
    config::L2Config,
    sign::{self, TAG_LEN},
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

/// Datagram header: a magic and a version, covered by the signature, then
/// the kind of datagram.
const MAGIC: &[u8; 4] = b"XLB\x02";

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
    /// Signed with another key: another cluster, or a stranger.
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

pub fn seal(key: &[u8], kind: Kind, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAGIC.len() + 1 + payload.len() + TAG_LEN);
    out.extend_from_slice(MAGIC);
    out.push(kind as u8);
    out.extend_from_slice(payload);
    let tag = sign::sign(key, &[&out]);
    out.extend_from_slice(&tag);
    out
}

/// The kind and payload of a datagram signed with `key`.
pub fn open<'d>(key: &[u8], datagram: &'d [u8]) -> Result<(Kind, &'d [u8]), Refused> {
    if datagram.len() < MAGIC.len() + 1 + TAG_LEN || &datagram[..MAGIC.len()] != MAGIC {
        return Err(Refused::Malformed);
    }
    let (signed, tag) = datagram.split_at(datagram.len() - TAG_LEN);
    if !sign::verify(key, &[signed], tag) {
        return Err(Refused::BadKey);
    }
    let kind = match signed[MAGIC.len()] {
        0 => Kind::Swim,
        1 => Kind::Heartbeat,
        _ => return Err(Refused::Malformed),
    };
    Ok((kind, &signed[MAGIC.len() + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sealed_datagram_opens_with_its_key_only() {
        let d = seal(b"0123456789abcdef", Kind::Swim, b"hello");
        assert_eq!(
            open(b"0123456789abcdef", &d),
            Ok((Kind::Swim, &b"hello"[..]))
        );
        assert_eq!(open(b"another key 0123", &d), Err(Refused::BadKey));
        let mut flipped = d.clone();
        flipped[5] ^= 1;
        assert_eq!(open(b"0123456789abcdef", &flipped), Err(Refused::BadKey));
        assert_eq!(
            open(b"0123456789abcdef", b"XLB\x01"),
            Err(Refused::Malformed)
        );
        assert_eq!(open(b"0123456789abcdef", &d[1..]), Err(Refused::Malformed));
    }
}
