//! The `l2:` section: answering ARP/NDP for service IPs on networks without
//! a BGP router (docs/l2.md).

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use super::locate::FieldPath;
use super::raw::RawL2;
use super::validate::{root, Checked, Validator};

/// L2 mode, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct L2Config {
    /// Interfaces ARP/NDP is answered on (each also in `interfaces`).
    pub interfaces: Vec<String>,
    /// This node's name in the membership; unique per node.
    pub node_name: String,
    /// Where this node's membership traffic is received (UDP); `None`: the
    /// first IPv4 address of the first L2 interface, port 7946 (resolved
    /// when the agent starts, so that one file serves every node).
    pub bind: Option<SocketAddr>,
    /// The other nodes' membership addresses.
    pub peers: Vec<SocketAddr>,
    /// No peers listed and a `kubernetes:` section: the peers are the
    /// other agents' membership Leases (`crate::k8s::members`).
    pub discover_peers: bool,
    /// The cluster keys every datagram is sealed with (`crate::seal`): the
    /// first to send, any to receive; strangers are refused.
    pub keys: Vec<Vec<u8>>,
    pub key_file: PathBuf,
    /// Members (this node included) a node must see to answer at all.
    pub quorum: usize,
    /// `quorum` was not set: a majority of the peers and this node, again
    /// whenever discovered peers change.
    pub quorum_is_majority: bool,
    /// SWIM: how often a member is probed, how long a direct probe waits,
    /// and how long a suspect has to refute before it is declared down.
    pub probe_interval: Duration,
    pub probe_timeout: Duration,
    pub suspect_timeout: Duration,
    /// How often owned VIPs are announced again (gratuitous ARP, unsolicited
    /// NA) so that switch tables never age them out.
    pub announce_interval: Duration,
    /// Share flows with the members (TCP 7947, signed with `key`) when
    /// there is no `flow_sync:` section, so that connections survive a
    /// failover (docs/l2.md). On by default: the others forget a gone
    /// node's flows once its SNAT address stops answering.
    pub share_flows: bool,
}

/// A majority of `peers` and this node.
pub fn majority(peers: usize) -> usize {
    let members = peers + 1;
    members / 2 + 1
}

/// Default membership port (the one memberlist uses too).
pub const DEFAULT_L2_PORT: u16 = 7946;
/// A key shorter than this is refused: the keys derived from it are only
/// as strong as it.
const MIN_KEY_BYTES: usize = 16;

impl Validator<'_> {
    pub(super) fn l2(
        &self,
        raw: RawL2,
        attached: &[String],
        kubernetes: bool,
    ) -> Checked<L2Config> {
        let path = || root().key("l2");
        if raw.interfaces.is_empty() {
            return Err(self.err(
                path().key("interfaces"),
                "at least one interface is required",
            ));
        }
        for (i, name) in raw.interfaces.iter().enumerate() {
            if !attached.contains(name) {
                return Err(self.err(
                    path().key("interfaces").index(i),
                    format!("{name:?} is not in interfaces: the XDP program answers ARP/NDP, so it must be attached there"),
                ));
            }
        }
        let node_name = match raw.node_name {
            Some(n) if !n.trim().is_empty() && n.len() <= 253 => n,
            Some(n) => {
                return Err(self.err(
                    path().key("node_name"),
                    format!("{n:?} is not a node name (1 to 253 characters)"),
                ))
            }
            // As the Kubernetes node name: the chart sets $NODE_NAME.
            None => super::this_node().ok_or_else(|| {
                self.err(
                    path().key("node_name"),
                    "no node_name and the host name is unknown",
                )
            })?,
        };
        let bind = match &raw.bind {
            None => None,
            Some(b) => Some(self.socket(b, DEFAULT_L2_PORT, || path().key("bind"))?),
        };
        let mut peers = Vec::new();
        for (i, p) in raw.peers.iter().enumerate() {
            let at = || path().key("peers").index(i);
            let addr = self.socket(p, DEFAULT_L2_PORT, at)?;
            if Some(addr) == bind || peers.contains(&addr) {
                return Err(self.err(at(), format!("{addr} is listed twice (or is bind)")));
            }
            peers.push(addr);
        }
        let key_file = PathBuf::from(&raw.key_file);
        let keys = self.cluster_keys(&raw.key_file, || path().key("key_file"))?;
        let discover_peers = peers.is_empty() && kubernetes;
        let members = peers.len() + 1;
        let quorum = match raw.quorum {
            None => majority(peers.len()),
            Some(q) if q >= 1 && (discover_peers || q as usize <= members) => q as usize,
            Some(q) => {
                return Err(self.err(
                    path().key("quorum"),
                    format!("{q} is outside 1..={members} (the peers and this node)"),
                ))
            }
        };
        let dur = |v: Option<String>, key: &'static str, default_ms: u64| -> Checked<Duration> {
            self.duration_within(
                v.as_deref(),
                Duration::from_millis(default_ms),
                (
                    Duration::from_millis(10),
                    Duration::from_secs(3600),
                    "10ms..=1h",
                ),
                || path().key(key),
            )
        };
        let probe_interval = dur(raw.probe_interval, "probe_interval", 100)?;
        let probe_timeout = dur(raw.probe_timeout, "probe_timeout", 40)?;
        let suspect_timeout = dur(raw.suspect_timeout, "suspect_timeout", 300)?;
        let announce_interval = dur(raw.announce_interval, "announce_interval", 30_000)?;
        if suspect_timeout < probe_interval * 2 {
            return Err(self.err(
                path().key("suspect_timeout"),
                "must be at least twice probe_interval (a node cut off falls silent after two probe intervals, before the others may declare it down)",
            ));
        }
        if probe_timeout >= probe_interval {
            return Err(self.err(
                path().key("probe_timeout"),
                "must be shorter than probe_interval (the indirect probes need the rest)",
            ));
        }
        Ok(L2Config {
            interfaces: raw.interfaces,
            node_name,
            bind,
            peers,
            discover_peers,
            keys,
            key_file,
            quorum,
            quorum_is_majority: raw.quorum.is_none(),
            probe_interval,
            probe_timeout,
            suspect_timeout,
            announce_interval,
            share_flows: raw.share_flows.unwrap_or(true),
        })
    }

    /// A duration within `min..=max` (`shown` says the range), or `default`
    /// when left out.
    pub(super) fn duration_within(
        &self,
        s: Option<&str>,
        default: Duration,
        (min, max, shown): (Duration, Duration, &str),
        at: impl Fn() -> FieldPath,
    ) -> Checked<Duration> {
        let Some(s) = s else {
            return Ok(default);
        };
        let d = self.duration(s, &at)?;
        if d < min || d > max {
            return Err(self.err(at(), format!("{s:?} is outside {shown}")));
        }
        Ok(d)
    }

    /// A shared secret read from `file`, surrounding whitespace trimmed.
    /// The keys of a key file: one per line, the first the one to send
    /// with (a rotation adds the new key second, then moves it first).
    pub(super) fn cluster_keys(
        &self,
        file: &str,
        at: impl Fn() -> FieldPath,
    ) -> Checked<Vec<Vec<u8>>> {
        let bytes = std::fs::read(file).map_err(|e| self.err(at(), format!("{file}: {e}")))?;
        let mut keys: Vec<Vec<u8>> = Vec::new();
        for (i, line) in bytes.split(|b| *b == b'\n').enumerate() {
            let key = line.trim_ascii();
            if key.is_empty() {
                continue;
            }
            if key.len() < MIN_KEY_BYTES {
                return Err(self.err(
                    at(),
                    format!("{file}, line {}: a key must have at least {MIN_KEY_BYTES} bytes (e.g. `head -c 32 /dev/urandom | base64`)", i + 1),
                ));
            }
            if keys.iter().any(|k| k == key) {
                return Err(self.err(at(), format!("{file}, line {}: the same key twice", i + 1)));
            }
            keys.push(key.to_vec());
        }
        if keys.is_empty() {
            return Err(self.err(
                at(),
                format!("{file} holds no key (one per line, the first to send with)"),
            ));
        }
        Ok(keys)
    }

    /// An address, with `port` unless it names its own.
    pub(super) fn socket(
        &self,
        s: &str,
        port: u16,
        at: impl Fn() -> FieldPath,
    ) -> Checked<SocketAddr> {
        let s = s.trim();
        if let Ok(a) = s.parse::<SocketAddr>() {
            return Ok(a);
        }
        match s.parse::<std::net::IpAddr>() {
            Ok(ip) => Ok(SocketAddr::new(ip, port)),
            Err(_) => Err(self.err(
                at(),
                format!(
                    "{s:?} is not an address or address:port (e.g. 10.0.0.11, \"[fd00::11]:7946\")"
                ),
            )),
        }
    }
}
