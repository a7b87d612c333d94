//! Announcing service IPs through an external BGP speaker, so that the
//! upstream router spreads traffic over every node that can serve it (ECMP).
//!
//! The agent does not speak BGP itself. An [`Announcer`] drives one speaker
//! (GoBGP over gRPC, BIRD 2 through an included file and `birdc`, ExaBGP
//! through its API pipes, FRR through `vtysh`). The agent computes the whole set of routes this
//! node should announce and calls [`Announcer::apply`]: the driver lists what
//! the speaker announces, and adds and withdraws the difference. Applying
//! the same set again is a no-op, and a speaker that restarted empty gets
//! everything back on the next apply.

pub mod bird;
pub mod exabgp;
pub mod frr;
pub mod gobgp;
pub mod task;

use crate::config::BgpPeer;
use ipnet::IpNet;
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    future::Future,
    net::IpAddr,
    pin::Pin,
};

/// One announced prefix, with this node as next hop: a VIP as a /32 or
/// /128, or a covering prefix of a pool (a BGPAdvertisement's aggregation).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Route {
    pub prefix: IpNet,
    pub next_hop: IpAddr,
    /// Standard communities as (ASN, value).
    pub communities: Vec<(u16, u16)>,
    /// Large communities (RFC 8092) as (global administrator, local data 1,
    /// local data 2).
    pub large_communities: Vec<(u32, u32, u32)>,
    pub local_pref: Option<u32>,
}

impl Route {
    /// The route with its communities sorted and without duplicates (a
    /// speaker keeps communities as a set).
    pub fn normalized(&self) -> Route {
        let mut r = self.clone();
        r.communities.sort_unstable();
        r.communities.dedup();
        r.large_communities.sort_unstable();
        r.large_communities.dedup();
        r
    }
}

/// Checks a desired set before any driver sends it: every prefix is in
/// canonical form (no host bits), every next hop is of its prefix's family
/// and specified, and there is one route per prefix (routes that differ
/// only in the order of their communities are one). Returns the routes
/// normalized, by prefix.
pub fn check_routes(desired: &BTreeSet<Route>) -> AnnounceResult<BTreeMap<IpNet, Route>> {
    let mut by_prefix = BTreeMap::new();
    for route in desired {
        if route.prefix != route.prefix.trunc() {
            return Err(AnnounceError::Refused(format!(
                "{route}: the prefix has host bits set"
            )));
        }
        if route.prefix.addr().is_ipv4() != route.next_hop.is_ipv4() {
            return Err(AnnounceError::Refused(format!(
                "{route}: the next hop is not of the VIP's address family"
            )));
        }
        if route.next_hop.is_unspecified() {
            return Err(AnnounceError::Refused(format!(
                "{route}: the next hop is unspecified"
            )));
        }
        let normal = route.normalized();
        match by_prefix.get(&route.prefix) {
            Some(other) if *other == normal => {}
            Some(other) => {
                return Err(AnnounceError::Refused(format!(
                    "two routes for one prefix: {other} and {route}"
                )))
            }
            None => {
                by_prefix.insert(route.prefix, normal);
            }
        }
    }
    Ok(by_prefix)
}

impl fmt::Display for Route {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} via {}", self.prefix, self.next_hop)?;
        for (a, v) in &self.communities {
            write!(f, " community {a}:{v}")?;
        }
        for (g, l1, l2) in &self.large_communities {
            write!(f, " large-community {g}:{l1}:{l2}")?;
        }
        if let Some(lp) = self.local_pref {
            write!(f, " local-pref {lp}")?;
        }
        Ok(())
    }
}

/// Attributes added to the routes of the VIPs in some address ranges: a
/// BGPAdvertisement selecting this node and some pools.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advertisement {
    /// Its name, for logs.
    pub name: String,
    /// Inclusive address ranges (the selected pools').
    pub covers: Vec<(IpAddr, IpAddr)>,
    pub communities: Vec<(u16, u16)>,
    pub large_communities: Vec<(u32, u32, u32)>,
    pub local_pref: Option<u32>,
    /// The prefix length the covered IPv4 VIPs are announced under (the
    /// covering prefix of each); `None`: host routes. The ranges of
    /// `covers` are whole prefixes of this length.
    pub aggregation_length: Option<u8>,
    /// The same for IPv6.
    pub aggregation_length_v6: Option<u8>,
    /// The only peers the covered VIPs go to (a peerSelector: the
    /// addresses of the BGPPeers it selects that peer with this node);
    /// `None`: no limit of its own.
    pub peers: Option<BTreeSet<IpAddr>>,
}

impl Advertisement {
    fn covers(&self, vip: IpAddr) -> bool {
        self.covers
            .iter()
            .any(|&(first, last)| first.is_ipv4() == vip.is_ipv4() && first <= vip && vip <= last)
    }

    /// The prefix length it announces `vip` under.
    fn prefix_len(&self, vip: IpAddr) -> u8 {
        let host = IpNet::from(vip).max_prefix_len();
        if vip.is_ipv4() {
            self.aggregation_length.unwrap_or(host)
        } else {
            self.aggregation_length_v6.unwrap_or(host)
        }
    }
}

/// The routes with what the advertisements covering each VIP add: the
/// union of every community and large community (the route's own
/// included), and the highest LOCAL_PREF of the route's and theirs.
///
/// A VIP that every covering advertisement aggregates is announced as its
/// covering prefix, of the longest length they ask (the fewest addresses),
/// one route for all the VIPs in it, with all their attributes. VIPs in
/// `host_only` (served by some nodes only, so a covering prefix would draw
/// their traffic to the others) and VIPs no advertisement covers stay host
/// routes, which routers prefer to any covering prefix.
pub fn advertise(
    routes: &BTreeSet<Route>,
    adverts: &[Advertisement],
    host_only: &BTreeSet<IpAddr>,
) -> BTreeSet<Route> {
    if adverts.is_empty() {
        return routes.clone();
    }
    let mut out: BTreeMap<IpNet, Route> = BTreeMap::new();
    for route in routes {
        let vip = route.prefix.addr();
        let mut r = route.clone();
        let mut len: Option<u8> = None;
        for a in adverts.iter().filter(|a| a.covers(vip)) {
            r.communities.extend(&a.communities);
            r.large_communities.extend(&a.large_communities);
            r.local_pref = r.local_pref.max(a.local_pref);
            len = len.max(Some(a.prefix_len(vip)));
        }
        if let Some(len) = len.filter(|_| !host_only.contains(&vip)) {
            r.prefix = IpNet::new(vip, len.min(route.prefix.prefix_len()))
                .expect("a length no longer than the route's")
                .trunc();
        }
        match out.get_mut(&r.prefix) {
            Some(merged) => {
                merged.communities.extend(r.communities);
                merged.large_communities.extend(r.large_communities);
                merged.local_pref = merged.local_pref.max(r.local_pref);
            }
            None => {
                out.insert(r.prefix, r);
            }
        }
    }
    out.into_values().map(|r| r.normalized()).collect()
}

/// The routes inside `prefix` (its covering prefixes and host routes) go
/// to these peers only: every other session of the speaker must not get
/// them.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct PeerLimit {
    pub prefix: IpNet,
    pub peers: BTreeSet<IpAddr>,
}

/// The peer limits of `adverts`, as disjoint prefixes: an address that
/// advertisements with a peerSelector cover goes to the union of their
/// peers; one without a peerSelector does not widen that (its attributes
/// apply, its "every peer" does not), so that a catch-all advertisement
/// cannot leak a limited pool. Addresses no limited advertisement covers
/// are not listed: they go to every peer.
pub fn peer_limits(adverts: &[Advertisement]) -> Vec<PeerLimit> {
    let limited: Vec<(u128, u128, bool, &BTreeSet<IpAddr>)> = adverts
        .iter()
        .filter_map(|a| a.peers.as_ref().map(|p| (a, p)))
        .flat_map(|(a, peers)| {
            a.covers
                .iter()
                .map(move |&(first, last)| (num(first), num(last), first.is_ipv4(), peers))
        })
        .collect();
    let mut out = Vec::new();
    for v4 in [true, false] {
        // Split at every range's edges: between two edges, one peer set.
        let mut edges: Vec<u128> = limited
            .iter()
            .filter(|r| r.2 == v4)
            .flat_map(|&(first, last, _, _)| [Some(first), last.checked_add(1)])
            .flatten()
            .collect();
        edges.sort_unstable();
        edges.dedup();
        let top = if v4 { u128::from(u32::MAX) } else { u128::MAX };
        for (i, &start) in edges.iter().enumerate() {
            let end = edges.get(i + 1).map_or(top, |next| next - 1);
            let mut peers = BTreeSet::new();
            let mut covered = false;
            for &(first, last, _, p) in limited.iter().filter(|r| r.2 == v4) {
                if first <= start && end <= last {
                    covered = true;
                    peers.extend(p.iter().copied());
                }
            }
            if covered {
                out.extend(cidrs(start, end, v4).into_iter().map(|prefix| PeerLimit {
                    prefix,
                    peers: peers.clone(),
                }));
            }
        }
    }
    out
}

fn num(a: IpAddr) -> u128 {
    match a {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

/// The fewest prefixes that cover `first..=last` exactly.
fn cidrs(first: u128, last: u128, v4: bool) -> Vec<IpNet> {
    if v4 {
        let (a, b) = (first as u32, last as u32);
        ipnet::Ipv4Subnets::new(a.into(), b.into(), 0)
            .map(IpNet::V4)
            .collect()
    } else {
        ipnet::Ipv6Subnets::new(first.into(), last.into(), 0)
            .map(IpNet::V6)
            .collect()
    }
}

/// One BGP session of the speaker, as read from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Session {
    pub peer: IpAddr,
    pub established: bool,
    /// How long it has been established; `None` while it is not, or when
    /// the speaker does not say.
    pub uptime: Option<std::time::Duration>,
    /// The prefixes the speaker sends the peer now, over all families;
    /// `None` while it is not established, or when the speaker does not say.
    pub prefixes_sent: Option<u64>,
}

impl Session {
    /// A session with only its state known.
    pub fn new(peer: IpAddr, established: bool) -> Self {
        Session {
            peer,
            established,
            uptime: None,
            prefixes_sent: None,
        }
    }
}

/// Why talking to a speaker failed. The agent keeps its desired set and
/// retries; nothing the data plane does depends on the speaker.
#[derive(Debug, thiserror::Error)]
pub enum AnnounceError {
    /// The speaker cannot be reached (not running, socket gone, restarting).
    #[error("BGP speaker unreachable: {0}")]
    Unreachable(String),
    /// The speaker answered but refused or failed the request.
    #[error("BGP speaker refused: {0}")]
    Refused(String),
}

pub type AnnounceResult<T> = Result<T, AnnounceError>;
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A driver for one BGP speaker.
pub trait Announcer: Send {
    /// A short name for logs and metrics ("gobgp", "bird", "exabgp", "frr").
    fn name(&self) -> &'static str;

    /// The routes the speaker announces for us now.
    fn announced(&mut self) -> BoxFuture<'_, AnnounceResult<BTreeSet<Route>>>;

    /// The speaker's BGP sessions, one per peer. A driver that cannot tell
    /// returns an empty list.
    fn peers(&mut self) -> BoxFuture<'_, AnnounceResult<Vec<Session>>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    /// Takes the peer limits of routes from now on (the next
    /// [`apply`](Self::apply) makes the speaker export so). A speaker that
    /// cannot hold its routes back from some sessions refuses any.
    fn set_peer_limits(&mut self, limits: &[PeerLimit]) -> Result<(), String> {
        if limits.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} cannot send routes to some peers only",
                self.name()
            ))
        }
    }

    /// Whether the peer limits hold for every session of the speaker, not
    /// only for those the agent configures.
    fn limits_every_session(&self) -> bool {
        false
    }

    /// Takes the peers the agent configures in the speaker from now on
    /// (the next [`apply`](Self::apply) makes the speaker's sessions so). A
    /// speaker that takes no peers from the agent refuses any.
    fn set_peers(&mut self, peers: &[BgpPeer]) -> Result<(), String> {
        if peers.is_empty() {
            Ok(())
        } else {
            Err(format!("{} takes no peers from the agent", self.name()))
        }
    }

    /// Makes the speaker announce exactly `desired` (for us): lists, then
    /// adds what is missing and withdraws what is extra. Returns how many
    /// routes were (added, withdrawn).
    fn apply<'a>(
        &'a mut self,
        desired: &'a BTreeSet<Route>,
    ) -> BoxFuture<'a, AnnounceResult<(usize, usize)>>;
}

/// `H:MM:SS` (as speakers print times and durations) → (H, M, S).
pub(crate) fn parse_hms(text: &str) -> Option<(u64, u64, u64)> {
    let parts: Vec<u64> = text
        .split(':')
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    let [h, m, s] = parts[..] else {
        return None;
    };
    Some((h, m, s))
}

/// FNV-1a, 32 bits: a hash that stays the same across builds (names the
/// agent gives things in a speaker's config outlive the agent).
pub(crate) fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5, |h, &b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// Runs a speaker's control program (`birdc`, `vtysh`) to completion
/// within `timeout`, its output captured. Not starting, no answer in time
/// and a failed wait are [`AnnounceError::Unreachable`]; `what` names the
/// command in those messages.
pub(crate) async fn run_control(
    mut cmd: tokio::process::Command,
    what: &str,
    timeout: std::time::Duration,
) -> AnnounceResult<std::process::Output> {
    let program = cmd.as_std().get_program().to_string_lossy().into_owned();
    let child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| AnnounceError::Unreachable(format!("running {program}: {e}")))?;
    match tokio::time::timeout(timeout, child.wait_with_output()).await {
        Err(_) => Err(AnnounceError::Unreachable(format!(
            "`{what}` got no answer within {timeout:?}"
        ))),
        Ok(Err(e)) => Err(AnnounceError::Unreachable(format!("`{what}`: {e}"))),
        Ok(Ok(out)) => Ok(out),
    }
}

/// The driver the `bgp` section of the config asks for.
pub fn from_config(bgp: &crate::config::BgpConfig) -> Result<Box<dyn Announcer>, String> {
    use crate::config::Speaker;
    Ok(match &bgp.speaker {
        Speaker::GoBgp { address } => {
            let peers = bgp.peers.iter().map(gobgp::PeerConfig::of).collect();
            let config = gobgp::GoBgpConfig {
                endpoint: address.clone(),
                peers,
                ..Default::default()
            };
            Box::new(
                gobgp::GoBgpAnnouncer::new(config)
                    .map_err(|e| format!("gobgp address {address}: {e}"))?,
            )
        }
        Speaker::Bird {
            routes_file,
            peers_file,
            socket,
            protocol,
        } => {
            let mut bird = bird::BirdAnnouncer::new(routes_file.clone(), socket.clone())
                .with_protocol(protocol.clone());
            // Without peers the file is still written (a header only), so
            // that a BIRD config including it starts; without an AS number
            // there are no peers (the config check requires it).
            bird = bird.with_sessions(peers_file.clone(), bgp.asn.unwrap_or(0), bgp.peers.clone());
            // BIRD refuses to start while an included file is missing.
            bird.ensure_files().map_err(|e| {
                format!(
                    "creating BIRD's routes and sessions files at {} and {}: {e}",
                    routes_file.display(),
                    peers_file.display()
                )
            })?;
            Box::new(bird)
        }
        Speaker::ExaBgp {
            pipe_dir,
            pipe_name,
        } => Box::new(
            exabgp::ExaBgpAnnouncer::new(pipe_dir.clone()).with_pipe_name(pipe_name.clone()),
        ),
        Speaker::Frr {
            socket_dir,
            config_dir,
            vtysh,
        } => Box::new(
            frr::FrrAnnouncer::new(socket_dir.clone(), bgp.asn)
                .with_config_dir(config_dir.clone())
                .with_vtysh(vtysh.clone())
                .with_peers(bgp.peers.clone()),
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn advertisements_add_their_communities_and_the_highest_local_pref() {
        let route = |vip: &str| Route {
            prefix: IpNet::from(vip.parse::<IpAddr>().unwrap()),
            next_hop: "10.0.0.1".parse().unwrap(),
            communities: vec![(65000, 1)],
            large_communities: vec![],
            local_pref: Some(100),
        };
        let routes: BTreeSet<Route> = [
            route("192.0.2.10"),
            route("198.51.100.1"),
            route("2001:db8::1"),
        ]
        .into_iter()
        .collect();
        let adv = |name: &str, first: &str, last: &str, c: Vec<(u16, u16)>, lp: Option<u32>| {
            Advertisement {
                name: name.into(),
                covers: vec![(first.parse().unwrap(), last.parse().unwrap())],
                communities: c,
                large_communities: vec![],
                local_pref: lp,
                aggregation_length: None,
                aggregation_length_v6: None,
                peers: None,
            }
        };
        let adverts = [
            adv(
                "public",
                "192.0.2.0",
                "192.0.2.255",
                vec![(65000, 100), (65000, 1)],
                Some(50),
            ),
            adv(
                "edge",
                "192.0.2.8",
                "192.0.2.15",
                vec![(65000, 200)],
                Some(300),
            ),
        ];
        let out: Vec<Route> = advertise(&routes, &adverts, &BTreeSet::new())
            .into_iter()
            .collect();
        let by = |vip: &str| {
            out.iter()
                .find(|r| r.prefix.addr().to_string() == vip)
                .unwrap()
        };
        assert_eq!(
            by("192.0.2.10").communities,
            [(65000, 1), (65000, 100), (65000, 200)]
        );
        assert_eq!(by("192.0.2.10").local_pref, Some(300));
        // Not covered: as it was (an IPv4 range covers no IPv6 VIP).
        assert_eq!(by("198.51.100.1").communities, [(65000, 1)]);
        assert_eq!(by("2001:db8::1").local_pref, Some(100));
    }

    #[test]
    fn routes_print_as_prefixes() {
        let r = Route {
            prefix: "192.0.2.10/32".parse().unwrap(),
            next_hop: "10.0.0.1".parse().unwrap(),
            communities: vec![(65000, 100)],
            large_communities: vec![],
            local_pref: Some(200),
        };
        assert_eq!(
            r.to_string(),
            "192.0.2.10/32 via 10.0.0.1 community 65000:100 local-pref 200"
        );
        let v6 = Route {
            prefix: "2001:db8::/64".parse().unwrap(),
            next_hop: "fd00::1".parse().unwrap(),
            communities: vec![],
            large_communities: vec![],
            local_pref: None,
        };
        assert_eq!(v6.to_string(), "2001:db8::/64 via fd00::1");
    }

    fn host(vip: &str, communities: Vec<(u16, u16)>) -> Route {
        Route {
            prefix: IpNet::from(vip.parse::<IpAddr>().unwrap()),
            next_hop: if vip.contains(':') {
                "fd00::1"
            } else {
                "10.0.0.1"
            }
            .parse()
            .unwrap(),
            communities,
            large_communities: vec![],
            local_pref: None,
        }
    }

    fn aggregating(
        name: &str,
        first: &str,
        last: &str,
        v4: Option<u8>,
        v6: Option<u8>,
    ) -> Advertisement {
        Advertisement {
            name: name.into(),
            covers: vec![(first.parse().unwrap(), last.parse().unwrap())],
            communities: vec![],
            large_communities: vec![],
            local_pref: None,
            aggregation_length: v4,
            aggregation_length_v6: v6,
            peers: None,
        }
    }

    fn prefixes(routes: &BTreeSet<Route>) -> Vec<String> {
        routes.iter().map(|r| r.prefix.to_string()).collect()
    }

    #[test]
    fn aggregated_vips_are_one_covering_route_with_all_their_attributes() {
        let routes: BTreeSet<Route> = [
            host("192.0.2.10", vec![(65000, 1)]),
            host("192.0.2.200", vec![(65000, 2)]),
            host("192.0.2.77", vec![]),
            host("198.51.100.1", vec![]),
            host("2001:db8::1", vec![]),
            host("2001:db8::2", vec![]),
        ]
        .into_iter()
        .collect();
        let adverts = [
            aggregating("pool", "192.0.2.0", "192.0.2.255", Some(24), None),
            aggregating("v6", "2001:db8::", "2001:db8::ffff", None, Some(112)),
        ];
        // 192.0.2.77 is served by some nodes only: a host route.
        let host_only: BTreeSet<IpAddr> = ["192.0.2.77".parse().unwrap()].into();
        let out = advertise(&routes, &adverts, &host_only);
        assert_eq!(
            prefixes(&out),
            [
                "192.0.2.0/24",
                "192.0.2.77/32",
                "198.51.100.1/32",
                "2001:db8::/112"
            ]
        );
        let agg = out.iter().next().unwrap();
        assert_eq!(agg.communities, [(65000, 1), (65000, 2)]);
        assert!(check_routes(&out).is_ok());
    }

    #[test]
    fn the_most_specific_covering_advertisement_sets_the_length() {
        let routes: BTreeSet<Route> = [host("192.0.2.10", vec![]), host("192.0.2.130", vec![])]
            .into_iter()
            .collect();
        let wide = aggregating("wide", "192.0.2.0", "192.0.2.255", Some(24), None);
        let narrow = aggregating("narrow", "192.0.2.0", "192.0.2.255", Some(25), None);
        let out = advertise(&routes, &[wide.clone(), narrow], &BTreeSet::new());
        assert_eq!(prefixes(&out), ["192.0.2.0/25", "192.0.2.128/25"]);
        // One covering advertisement without a length keeps host routes.
        let hosts = aggregating("hosts", "192.0.2.0", "192.0.2.255", None, None);
        let out = advertise(&routes, &[wide, hosts], &BTreeSet::new());
        assert_eq!(prefixes(&out), ["192.0.2.10/32", "192.0.2.130/32"]);
    }

    fn limited(name: &str, first: &str, last: &str, peers: &[&str]) -> Advertisement {
        Advertisement {
            peers: Some(peers.iter().map(|p| p.parse().unwrap()).collect()),
            ..aggregating(name, first, last, None, None)
        }
    }

    fn limits(adverts: &[Advertisement]) -> Vec<(String, Vec<String>)> {
        peer_limits(adverts)
            .into_iter()
            .map(|l| {
                let peers = l.peers.iter().map(ToString::to_string).collect();
                (l.prefix.to_string(), peers)
            })
            .collect()
    }

    #[test]
    fn peer_limits_are_disjoint_prefixes_with_the_union_of_their_peers() {
        let tor = limited("tor", "10.9.0.0", "10.9.0.255", &["10.0.1.254"]);
        // Overlaps the upper half, and adds the edge router there.
        let edge = limited("edge", "10.9.0.128", "10.9.1.9", &["10.0.9.1"]);
        // No peerSelector: it does not widen the limits.
        let all = aggregating("all", "0.0.0.0", "255.255.255.255", None, None);
        let nowhere = limited("nowhere", "2001:db8::", "2001:db8::ff", &[]);
        assert_eq!(
            limits(&[tor, edge, all, nowhere]),
            [
                ("10.9.0.0/25".to_string(), vec!["10.0.1.254".to_string()]),
                (
                    "10.9.0.128/25".to_string(),
                    vec!["10.0.1.254".to_string(), "10.0.9.1".to_string()]
                ),
                ("10.9.1.0/29".to_string(), vec!["10.0.9.1".to_string()]),
                ("10.9.1.8/31".to_string(), vec!["10.0.9.1".to_string()]),
                ("2001:db8::/120".to_string(), vec![]),
            ]
        );
        assert!(
            peer_limits(&[aggregating("all", "0.0.0.0", "255.255.255.255", None, None)]).is_empty()
        );
    }

    #[test]
    fn a_prefix_with_host_bits_is_refused() {
        let mut r = host("192.0.2.10", vec![]);
        r.prefix = "192.0.2.10/24".parse().unwrap();
        let err = check_routes(&[r].into()).unwrap_err();
        assert!(err.to_string().contains("host bits"), "{err}");
    }
}
