//! The `flow_sync:` section: which agents share SNAT flows, so that a node
//! leaving ECMP hands its connections over (docs/bgp.md).

use std::{
    net::{IpAddr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use super::raw::RawFlowSync;
use super::validate::{root, Checked, Validator};
use super::L2Config;

/// The flow exchange, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowSyncConfig {
    /// Where this agent takes pushes and answers pulls (TCP). Unspecified
    /// (`0.0.0.0`): every address, and the peers are told the first IPv4
    /// address of the first interface.
    pub listen: SocketAddr,
    /// The other agents' `listen` addresses.
    pub peers: Vec<SocketAddr>,
    /// No peers listed and a `kubernetes:` section: the peers are the other
    /// agents' flow exchange Leases (`crate::k8s::members`).
    pub discover_peers: bool,
    /// The cluster keys every frame is sealed with (`crate::seal`): the
    /// first to send, any to receive; strangers are refused.
    pub keys: Vec<Vec<u8>>,
    /// Where the keys are read from; a change is taken at once.
    pub key_file: PathBuf,
    /// How often the flows this node opened are pushed to the peers: a
    /// connection younger than this when the routers' ECMP set changes may
    /// be reset.
    pub interval: Duration,
    /// How long a peer's SNAT address may answer nothing before the flows
    /// translated with it are forgotten here (the peer is gone: the
    /// backends' replies to it are lost).
    pub forget_after: Duration,
}

const DEFAULT_INTERVAL: Duration = Duration::from_millis(500);
const DEFAULT_FORGET_AFTER: Duration = Duration::from_secs(10);

/// Default port of the flow exchange.
pub const DEFAULT_FLOW_SYNC_PORT: u16 = 7947;

impl Validator<'_> {
    pub(super) fn flow_sync(&self, raw: RawFlowSync, kubernetes: bool) -> Checked<FlowSyncConfig> {
        let path = || root().key("flow_sync");
        let listen = match &raw.listen {
            None => SocketAddr::from(([0, 0, 0, 0], DEFAULT_FLOW_SYNC_PORT)),
            Some(l) => self.socket(l, DEFAULT_FLOW_SYNC_PORT, || path().key("listen"))?,
        };
        if raw.peers.is_empty() && !kubernetes {
            return Err(self.err(
                path().key("peers"),
                "at least one peer is required (the other nodes' flow_sync listen addresses), unless a kubernetes section lets the agents find each other",
            ));
        }
        let mut peers = Vec::new();
        for (i, p) in raw.peers.iter().enumerate() {
            let at = || path().key("peers").index(i);
            let addr = self.socket(p, DEFAULT_FLOW_SYNC_PORT, at)?;
            if peers.contains(&addr) {
                return Err(self.err(at(), format!("{addr} is listed twice")));
            }
            peers.push(addr);
        }
        let keys = self.cluster_keys(&raw.key_file, || path().key("key_file"))?;
        let interval = self.duration_within(
            raw.interval.as_deref(),
            DEFAULT_INTERVAL,
            (
                Duration::from_millis(10),
                Duration::from_secs(60),
                "10ms..=60s",
            ),
            || path().key("interval"),
        )?;
        let forget_after = self.duration_within(
            raw.forget_after.as_deref(),
            DEFAULT_FORGET_AFTER,
            (Duration::from_secs(1), Duration::from_secs(3600), "1s..=1h"),
            || path().key("forget_after"),
        )?;
        Ok(FlowSyncConfig {
            listen,
            discover_peers: peers.is_empty(),
            peers,
            keys,
            key_file: PathBuf::from(&raw.key_file),
            interval,
            forget_after,
        })
    }
}

impl FlowSyncConfig {
    /// L2 mode's exchange with `share_flows` and no `flow_sync:` section: with the
    /// members, on port 7947 of their membership addresses, sealed with the
    /// membership keys. A failover moves every client of a VIP at once, so
    /// without it every snat connection through the old owner is reset.
    /// `None` with no members to share with.
    pub fn for_l2(l2: &L2Config) -> Option<Self> {
        if !l2.share_flows || (l2.peers.is_empty() && !l2.discover_peers) {
            return None;
        }
        let port = DEFAULT_FLOW_SYNC_PORT;
        // Unbound: both families (an IPv6-only node has no IPv4 address).
        let ip = l2
            .bind
            .map_or(IpAddr::V6(Ipv6Addr::UNSPECIFIED), |b| b.ip());
        Some(Self {
            listen: SocketAddr::new(ip, port),
            peers: l2
                .peers
                .iter()
                .map(|p| SocketAddr::new(p.ip(), port))
                .collect(),
            discover_peers: l2.discover_peers,
            keys: l2.keys.clone(),
            key_file: l2.key_file.clone(),
            interval: DEFAULT_INTERVAL,
            forget_after: DEFAULT_FORGET_AFTER,
        })
    }
}

/// What a config reload changes in a running flow exchange.
#[derive(Debug, PartialEq, Eq)]
pub enum FlowSyncReload {
    Unchanged,
    /// Only the listed peers: the running exchange takes them at once.
    Peers(Vec<SocketAddr>),
    /// Anything else but the keys (turned on or off, `listen`, the
    /// interval, listed against discovered peers): the exchange keeps
    /// running as it started until the agent restarts; what changed, for
    /// the log. New keys are taken at once (`Peers::set_keys`).
    NeedsRestart(&'static str),
}

impl FlowSyncConfig {
    /// What going from `before` to `after` asks of the running exchange.
    pub fn reload(before: Option<&Self>, after: Option<&Self>) -> FlowSyncReload {
        let (b, a) = match (before, after) {
            (None, None) => return FlowSyncReload::Unchanged,
            (None, Some(_)) => return FlowSyncReload::NeedsRestart("turned on"),
            (Some(_), None) => return FlowSyncReload::NeedsRestart("turned off"),
            (Some(b), Some(a)) => (b, a),
        };
        if b.listen != a.listen {
            FlowSyncReload::NeedsRestart("listen")
        } else if b.interval != a.interval {
            FlowSyncReload::NeedsRestart("interval")
        } else if b.forget_after != a.forget_after {
            FlowSyncReload::NeedsRestart("forget_after")
        } else if b.discover_peers != a.discover_peers {
            FlowSyncReload::NeedsRestart("peers listed or discovered")
        } else if b.peers != a.peers {
            FlowSyncReload::Peers(a.peers.clone())
        } else {
            FlowSyncReload::Unchanged
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(peers: &[&str]) -> FlowSyncConfig {
        FlowSyncConfig {
            listen: "10.0.0.11:7947".parse().unwrap(),
            peers: peers.iter().map(|p| p.parse().unwrap()).collect(),
            discover_peers: peers.is_empty(),
            keys: vec![b"0123456789abcdef".to_vec()],
            key_file: PathBuf::from("/etc/xlb/key"),
            interval: DEFAULT_INTERVAL,
            forget_after: DEFAULT_FORGET_AFTER,
        }
    }

    #[test]
    fn l2_members_share_flows_on_port_7947_with_the_membership_key() {
        let dir = std::env::temp_dir().join(format!("xlb-l2fs-{}", std::process::id()));
        let yaml = |extra: &str| {
            std::fs::create_dir_all(&dir).unwrap();
            let key = dir.join("l2.key");
            std::fs::write(
                &key,
                "l2-key-0123456789abcdef\n\nl2-key-2-0123456789abcdef\n",
            )
            .unwrap();
            format!(
                "interfaces: [lo]\nl2:\n  interfaces: [lo]\n  node_name: a\n  bind: 10.0.0.11\n  peers: [10.0.0.12, \"10.0.0.13:8000\"]\n  key_file: {}\n{extra}",
                key.display()
            )
        };
        let parse = |s: &str| crate::config::AgentConfig::parse(s).expect("valid config");
        assert_eq!(
            parse(&yaml("  share_flows: false\n")).flow_sync,
            None,
            "off when asked"
        );
        let fs = parse(&yaml("")).flow_sync.expect("shared by default");
        assert_eq!(fs.forget_after, DEFAULT_FORGET_AFTER);
        assert_eq!(fs.listen, "10.0.0.11:7947".parse().unwrap());
        assert_eq!(
            fs.peers,
            [
                "10.0.0.12:7947".parse().unwrap(),
                "10.0.0.13:7947".parse().unwrap()
            ]
        );
        assert_eq!(
            fs.keys,
            [
                b"l2-key-0123456789abcdef".to_vec(),
                b"l2-key-2-0123456789abcdef".to_vec()
            ],
            "one key a line, blank lines skipped, in order"
        );
        assert!(!fs.discover_peers);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_reload_changes_the_peers_and_keys_live_and_names_what_needs_a_restart() {
        use FlowSyncReload::*;
        let two = config(&["10.0.0.12:7947"]);
        let three = config(&["10.0.0.12:7947", "10.0.0.13:7947"]);
        let reload =
            |b: &FlowSyncConfig, a: &FlowSyncConfig| FlowSyncConfig::reload(Some(b), Some(a));
        assert_eq!(reload(&two, &two), Unchanged);
        assert_eq!(reload(&two, &three), Peers(three.peers.clone()));
        assert_eq!(reload(&three, &two), Peers(two.peers.clone()));
        let moved = FlowSyncConfig {
            listen: "10.0.0.11:9000".parse().unwrap(),
            ..three.clone()
        };
        assert_eq!(reload(&three, &moved), NeedsRestart("listen"));
        let rekeyed = FlowSyncConfig {
            keys: vec![b"another key of 16+".to_vec()],
            ..three.clone()
        };
        assert_eq!(reload(&three, &rekeyed), Unchanged, "keys are taken live");
        let slower = FlowSyncConfig {
            interval: Duration::from_secs(1),
            ..three.clone()
        };
        assert_eq!(reload(&three, &slower), NeedsRestart("interval"));
        assert_eq!(
            reload(&three, &config(&[])),
            NeedsRestart("peers listed or discovered")
        );
        assert_eq!(
            FlowSyncConfig::reload(None, Some(&two)),
            NeedsRestart("turned on")
        );
        assert_eq!(
            FlowSyncConfig::reload(Some(&two), None),
            NeedsRestart("turned off")
        );
        assert_eq!(FlowSyncConfig::reload(None, None), Unchanged);
    }
}
