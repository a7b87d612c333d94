//! FRR driver: the agent configures FRR's running `bgpd` through `vtysh`,
//! FRR's supported shell, and reads back what it configured from FRR's
//! running configuration (`show running-config`), never from its own
//! memory.
//!
//! # What the driver writes
//!
//! Each VIP is a `network` statement with a route map of its own, which
//! carries the route's attributes:
//!
//! ```text
//! router bgp 65001
//!  no bgp network import-check
//!  address-family ipv4 unicast
//!   network 192.0.2.10/32 route-map xlb-vip-192.0.2.10/32-1f2e3d4c
//! route-map xlb-vip-192.0.2.10/32-1f2e3d4c permit 10
//!  set ip next-hop 10.0.0.1
//!  set community 65000:100
//!  set local-preference 200
//! ```
//!
//! * `no bgp network import-check`: a VIP is not in the node's routing
//!   table (XDP answers it before the kernel routes), and FRR otherwise
//!   announces a `network` only while its prefix is routable.
//! * The route map's name ends with a hash of the attributes. A changed
//!   route gets a new map and its `network` statement is pointed at it (FRR
//!   re-announces at once), then the old map is deleted. Editing a map in
//!   place would wait for FRR's route-map delay timer (5 s by default).
//! * Every name the driver writes starts with `xlb-`: the running config's
//!   `network` statements with other route maps are the operator's, and
//!   left alone.
//!
//! # Sessions the agent writes (`bgp.peers`, BGPPeers)
//!
//! One `neighbor` per peer, marked `description xlb:HASH` (the hash of its
//! settings: a changed peer is deleted and added again), importing nothing
//! (`route-map xlb-import in`, a deny) and exporting what bgpd has
//! (`route-map xlb-export out`). BFD timers go in a profile of `bfdd`
//! (`bfd` → `profile xlb-bfd-MULT-RX-TX`), which must run. Neighbours
//! without the mark are the operator's: the agent never touches them, and
//! refuses a peer at the same address.
//!
//! # Saved configuration
//!
//! Every change ends with `write memory`, which saves FRR's whole running
//! configuration into `config_dir` (`frr.conf` when `vtysh.conf` says
//! `service integrated-vtysh-config`, FRR's default). A restarted FRR then
//! announces the VIPs it had before the agent is back, as BIRD re-reads
//! its routes file, and a BGP graceful restart ends with them in place.
//! An agent killed without withdrawing leaves them there too, until it
//! comes back.
//!
//! # How `apply` works
//!
//! The desired set is checked first (as every driver does). The running
//! config is read (`vtysh -d bgpd`: bgpd down is
//! [`AnnounceError::Unreachable`]), and what differs is sent as one `vtysh`
//! call: new route maps, then the `router bgp` block, then the deletion of
//! maps no longer used. vtysh stops at the first command FRR refuses
//! ([`AnnounceError::Refused`] with FRR's message); what went before stays,
//! and the next apply compares again from what FRR then has.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use ipnet::IpNet;
use tokio::process::Command;

use super::{
    check_routes, fnv1a, AnnounceError, AnnounceResult, Announcer, BoxFuture, PeerLimit, Route,
    Session,
};
use crate::config::{Bfd, BgpPeer};

/// The default `vtysh` binary, looked up in `PATH`.
pub const DEFAULT_VTYSH: &str = "vtysh";
/// The default directory of FRR's daemons' vty sockets.
pub const DEFAULT_SOCKET_DIR: &str = "/var/run/frr";
/// The default directory of FRR's configuration (`frr.conf`, `vtysh.conf`).
pub const DEFAULT_CONFIG_DIR: &str = "/etc/frr";
/// The default limit for one `vtysh` call.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// The prefix of every route map, BFD profile and description the driver
/// writes.
const MARK: &str = "xlb";
const IMPORT_MAP: &str = "xlb-import";
/// The `bgp route-map delay-timer` the agent sets where none is (seconds).
const ROUTE_MAP_DELAY: u32 = 1;
const EXPORT_MAP: &str = "xlb-export";

/// Drives FRR's bgpd through `vtysh`.
#[derive(Clone, Debug)]
pub struct FrrAnnouncer {
    vtysh: PathBuf,
    socket_dir: PathBuf,
    config_dir: PathBuf,
    /// A change was sent and `write memory` has not succeeded since.
    unsaved: bool,
    /// `router bgp ASN`; `None`: the instance FRR already has.
    asn: Option<u32>,
    peers: Vec<BgpPeer>,
    /// What each of the agent's sessions may export of the limited
    /// prefixes.
    limits: Vec<PeerLimit>,
    timeout: Duration,
}

/// What the driver reads from FRR's running configuration.
#[derive(Debug, Default, PartialEq, Eq)]
struct Running {
    /// The default instance's AS number (`router bgp N` without `vrf`).
    asn: Option<u32>,
    import_check_off: bool,
    /// `coalesce-time N` is configured in the instance.
    coalesce_set: bool,
    /// `bgp route-map delay-timer N` is configured (not FRR's default).
    route_map_delay_set: bool,
    /// `network PREFIX route-map xlb-...` statements: prefix → map name.
    networks: BTreeMap<IpNet, String>,
    /// Route maps named `xlb-...`: name → their `set` lines.
    route_maps: BTreeMap<String, Vec<String>>,
    /// Neighbours: address → description (`xlb:HASH` for the agent's).
    neighbors: BTreeMap<IpAddr, Option<String>>,
    /// Neighbours' outbound route maps (`neighbor A route-map M out`), by
    /// address family (`ipv4`, `ipv6`).
    exports: BTreeMap<(IpAddr, String), String>,
    /// Prefix lists named `xlb-...`, with their command (`ip`, `ipv6`).
    prefix_lists: BTreeSet<(String, String)>,
}

impl FrrAnnouncer {
    /// A driver using `vtysh` from `PATH` with the daemons' sockets in
    /// `socket_dir`, for the BGP instance `asn` (`None`: FRR's own).
    pub fn new(socket_dir: impl Into<PathBuf>, asn: Option<u32>) -> Self {
        Self {
            vtysh: DEFAULT_VTYSH.into(),
            socket_dir: socket_dir.into(),
            config_dir: DEFAULT_CONFIG_DIR.into(),
            unsaved: false,
            asn,
            peers: Vec::new(),
            limits: Vec::new(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Uses this `vtysh` binary.
    pub fn with_vtysh(mut self, vtysh: impl Into<PathBuf>) -> Self {
        self.vtysh = vtysh.into();
        self
    }

    /// Saves FRR's configuration into `config_dir` (`vtysh --config_dir`).
    pub fn with_config_dir(mut self, config_dir: impl Into<PathBuf>) -> Self {
        self.config_dir = config_dir.into();
        self
    }

    /// Gives up on a `vtysh` call after `timeout` (FRR hung:
    /// [`AnnounceError::Unreachable`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Configures these sessions (see the [module documentation](self)).
    pub fn with_peers(mut self, peers: Vec<BgpPeer>) -> Self {
        self.peers = peers;
        self
    }

    /// The directory of FRR's vty sockets.
    pub fn socket_dir(&self) -> &Path {
        &self.socket_dir
    }

    /// Runs `vtysh [-d bgpd] -c C1 -c C2 ...` and returns its output.
    async fn vtysh(&self, bgpd_only: bool, commands: &[String]) -> AnnounceResult<String> {
        let what = commands.first().cloned().unwrap_or_default();
        let mut cmd = Command::new(&self.vtysh);
        cmd.arg("--vty_socket")
            .arg(&self.socket_dir)
            .arg("--config_dir")
            .arg(&self.config_dir);
        if bgpd_only {
            cmd.args(["-d", "bgpd"]);
        }
        for c in commands {
            cmd.arg("-c").arg(c);
        }
        let out = super::run_control(cmd, &format!("vtysh -c {what}"), self.timeout).await?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&out.stderr);
        tracing::trace!(commands = ?commands, %stdout, %stderr, "vtysh");
        let all = format!("{stderr}{stdout}");
        // bgpd down is a speaker away (retried); another daemon down (bfdd,
        // for BFD) is a setup to fix, refused below with vtysh's words.
        if let Some(line) = all
            .lines()
            .find(|l| l.contains("failed to connect") || l.contains("bgpd is not running"))
        {
            return Err(AnnounceError::Unreachable(format!(
                "FRR at {}: {}",
                self.socket_dir.display(),
                line.trim()
            )));
        }
        if !out.status.success() {
            let said: Vec<&str> = all
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            return Err(AnnounceError::Refused(format!(
                "vtysh ({}): {}",
                out.status,
                said.join("; ")
            )));
        }
        Ok(stdout)
    }

    async fn running(&self) -> AnnounceResult<Running> {
        let text = self
            .vtysh(true, &["show running-config".to_string()])
            .await?;
        Ok(Running::parse(&text))
    }

    async fn apply_now(&mut self, desired: &BTreeSet<Route>) -> AnnounceResult<(usize, usize)> {
        let by_prefix = check_routes(desired)?;
        let running = self.running().await?;
        let mut plan = plan(&running, self.asn, &self.peers, &self.limits, &by_prefix)?;
        if !plan.commands.is_empty() {
            plan.commands.push("end".into());
            self.unsaved = true;
        }
        if self.unsaved {
            // Saved, so that a restarted FRR announces the VIPs again
            // before the agent is back (as BIRD re-reads its routes file).
            plan.commands.push("write memory".into());
            self.vtysh(false, &plan.commands).await?;
            self.unsaved = false;
        }
        Ok((plan.added, plan.withdrawn))
    }
}

impl Announcer for FrrAnnouncer {
    fn name(&self) -> &'static str {
        "frr"
    }

    /// Every neighbour of bgpd, up while its state is `Established`
    /// (`show bgp neighbors json`).
    fn peers(&mut self) -> BoxFuture<'_, AnnounceResult<Vec<Session>>> {
        Box::pin(async move {
            let text = self
                .vtysh(true, &["show bgp neighbors json".to_string()])
                .await?;
            parse_neighbors(&text).map_err(AnnounceError::Refused)
        })
    }

    fn announced(&mut self) -> BoxFuture<'_, AnnounceResult<BTreeSet<Route>>> {
        Box::pin(async move { Ok(self.running().await?.routes()) })
    }

    /// Written as outbound route maps of the sessions the agent writes.
    /// Neighbours of FRR's own config export what their maps say.
    fn set_peer_limits(&mut self, limits: &[PeerLimit]) -> Result<(), String> {
        self.limits = limits.to_vec();
        Ok(())
    }

    fn set_peers(&mut self, peers: &[BgpPeer]) -> Result<(), String> {
        if self.asn.is_none() && !peers.is_empty() {
            return Err(
                "bgp.asn (this node's AS number) is required to write FRR's sessions".into(),
            );
        }
        self.peers = peers.to_vec();
        Ok(())
    }

    fn apply<'a>(
        &'a mut self,
        desired: &'a BTreeSet<Route>,
    ) -> BoxFuture<'a, AnnounceResult<(usize, usize)>> {
        Box::pin(self.apply_now(desired))
    }
}

impl Running {
    /// Reads what the driver needs from `show running-config`: lines are
    /// indented by nesting, and blocks end with `exit`.
    fn parse(text: &str) -> Running {
        let mut r = Running::default();
        // The block a line is in: the default BGP instance, a route map of
        // ours (by name), or anything else.
        enum Block {
            Bgp,
            RouteMap(String),
            Other,
        }
        let mut block = Block::Other;
        // The address family block of the instance a line is in.
        let mut af = String::new();
        for line in text.lines() {
            let words: Vec<&str> = line.split_whitespace().collect();
            if !line.starts_with(' ') {
                block = match words.as_slice() {
                    ["bgp", "route-map", "delay-timer", _] => {
                        r.route_map_delay_set = true;
                        Block::Other
                    }
                    ["router", "bgp", asn] => {
                        r.asn = asn.parse().ok();
                        Block::Bgp
                    }
                    ["route-map", name, "permit" | "deny", _] if name.starts_with(MARK) => {
                        r.route_maps.entry(name.to_string()).or_default();
                        Block::RouteMap(name.to_string())
                    }
                    [kind @ ("ip" | "ipv6"), "prefix-list", name, ..] if name.starts_with(MARK) => {
                        r.prefix_lists.insert((kind.to_string(), name.to_string()));
                        Block::Other
                    }
                    _ => Block::Other,
                };
                continue;
            }
            match (&block, words.as_slice()) {
                (Block::Bgp, ["no", "bgp", "network", "import-check"]) => r.import_check_off = true,
                (Block::Bgp, ["coalesce-time", _]) => r.coalesce_set = true,
                (Block::Bgp, ["address-family", family, ..]) => af = family.to_string(),
                (Block::Bgp, ["exit-address-family"]) => af.clear(),
                (Block::Bgp, ["network", prefix, "route-map", name]) if name.starts_with(MARK) => {
                    if let Ok(net) = prefix.parse::<IpNet>() {
                        r.networks.insert(net.trunc(), name.to_string());
                    }
                }
                (Block::Bgp, ["neighbor", addr, rest @ ..]) => {
                    if let Ok(addr) = addr.parse::<IpAddr>() {
                        let entry = r.neighbors.entry(addr).or_default();
                        match rest {
                            ["description", d] => *entry = Some(d.to_string()),
                            ["route-map", m, "out"] => {
                                r.exports.insert((addr, af.clone()), m.to_string());
                            }
                            _ => {}
                        }
                    }
                }
                (Block::RouteMap(name), ["set", ..]) => {
                    if let Some(sets) = r.route_maps.get_mut(name) {
                        sets.push(words.join(" "));
                    }
                }
                _ => {}
            }
        }
        r
    }

    /// The routes the `network` statements of ours announce: their route
    /// maps' attributes. A statement whose map is missing announces
    /// nothing (FRR denies the route).
    fn routes(&self) -> BTreeSet<Route> {
        self.networks
            .iter()
            .filter_map(|(&prefix, map)| {
                let sets = self.route_maps.get(map)?;
                Some(route_of(prefix, sets))
            })
            .collect()
    }
}

/// The route a route map's `set` lines give `prefix`.
fn route_of(prefix: IpNet, sets: &[String]) -> Route {
    let mut route = Route {
        prefix,
        next_hop: if prefix.addr().is_ipv4() {
            IpAddr::from([0u8; 4])
        } else {
            IpAddr::from([0u8; 16])
        },
        communities: Vec::new(),
        large_communities: Vec::new(),
        local_pref: None,
    };
    for set in sets {
        let words: Vec<&str> = set.split_whitespace().collect();
        match words.as_slice() {
            ["set", "ip", "next-hop", a] | ["set", "ipv6", "next-hop", "global", a] => {
                if let Ok(a) = a.parse() {
                    route.next_hop = a;
                }
            }
            ["set", "community", list @ ..] => {
                route.communities.extend(
                    list.iter()
                        .filter_map(|c| crate::config::parse_community(c)),
                );
            }
            ["set", "large-community", list @ ..] => {
                route.large_communities.extend(
                    list.iter()
                        .filter_map(|c| crate::config::parse_large_community(c)),
                );
            }
            ["set", "local-preference", n] => route.local_pref = n.parse().ok(),
            _ => {}
        }
    }
    route.normalized()
}

/// What one apply sends, and what it adds and withdraws.
#[derive(Debug, Default)]
struct Plan {
    commands: Vec<String>,
    added: usize,
    withdrawn: usize,
}

/// The commands that make `running` announce `desired` with `peers`.
fn plan(
    running: &Running,
    asn: Option<u32>,
    peers: &[BgpPeer],
    limits: &[PeerLimit],
    desired: &BTreeMap<IpNet, Route>,
) -> AnnounceResult<Plan> {
    let asn = match (asn, running.asn) {
        (Some(want), Some(has)) if want != has => {
            return Err(AnnounceError::Refused(format!(
                "FRR runs `router bgp {has}`, bgp.asn is {want}"
            )))
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => {
            return Err(AnnounceError::Refused(
                "FRR has no `router bgp` instance: configure one, or set bgp.asn".into(),
            ))
        }
    };
    let announced = running.routes();
    let mut maps = Vec::new();
    let mut bgp = Vec::new();
    let mut unused_maps = Vec::new();
    let mut p = Plan::default();

    // Sessions.
    // By profile name: one per distinct set of timers.
    let mut bfd_profiles = BTreeMap::new();
    let mut wanted_peers = BTreeSet::new();
    for peer in peers {
        wanted_peers.insert(peer.address);
        let lines = peer_lines(peer)?;
        let mark = format!("{MARK}:{:08x}", fnv1a(lines.join("\n").as_bytes()));
        match running.neighbors.get(&peer.address) {
            Some(Some(d)) if *d == mark => continue,
            Some(Some(d)) if d.starts_with(&format!("{MARK}:")) => {
                bgp.push(format!("no neighbor {}", peer.address))
            }
            Some(_) => {
                return Err(AnnounceError::Refused(format!(
                    "FRR already has neighbor {} from its own configuration: \
                     leave it out of bgp.peers and the BGPPeers, or out of FRR's config",
                    peer.address
                )))
            }
            None => {}
        }
        if let Some(b) = &peer.bfd {
            bfd_profiles.insert(bfd_profile(b), *b);
        }
        bgp.push(format!("neighbor {} remote-as {}", peer.address, peer.asn));
        bgp.push(format!("neighbor {} description {mark}", peer.address));
        bgp.extend(lines);
    }
    for (addr, d) in &running.neighbors {
        let ours = d
            .as_deref()
            .is_some_and(|d| d.starts_with(&format!("{MARK}:")));
        if ours && !wanted_peers.contains(addr) {
            bgp.push(format!("no neighbor {addr}"));
        }
    }
    if !peers.is_empty() && !bgp.is_empty() {
        maps.push(format!("route-map {IMPORT_MAP} deny 10"));
        maps.push("exit".into());
        maps.push(format!("route-map {EXPORT_MAP} permit 10"));
        maps.push("exit".into());
    }
    // Each session's outbound map: the shared one, or one that denies the
    // limited prefixes the peer may not have (shared by the peers with the
    // same denials).
    let exports: BTreeMap<IpAddr, String> = peers
        .iter()
        .map(|peer| (peer.address, export_map(limits, peer.address)))
        .collect();
    let mut limit_maps = BTreeSet::new();
    for (peer, name) in &exports {
        if name == EXPORT_MAP || !limit_maps.insert(name.clone()) {
            continue;
        }
        if running.route_maps.contains_key(name) {
            continue;
        }
        let denied: Vec<IpNet> = limits
            .iter()
            .filter(|l| !l.peers.contains(peer))
            .map(|l| l.prefix)
            .collect();
        let mut seq = 10;
        for (kind, v4) in [("ip", true), ("ipv6", false)] {
            let list = format!("{name}-{}", if v4 { "4" } else { "6" });
            let family: Vec<&IpNet> = denied.iter().filter(|p| p.addr().is_ipv4() == v4).collect();
            if family.is_empty() {
                continue;
            }
            for (i, prefix) in family.iter().enumerate() {
                // `le` must be longer than the prefix: none for a host route.
                let le = if prefix.prefix_len() < prefix.max_prefix_len() {
                    format!(" le {}", prefix.max_prefix_len())
                } else {
                    String::new()
                };
                maps.push(format!(
                    "{kind} prefix-list {list} seq {} permit {prefix}{le}",
                    (i + 1) * 5
                ));
            }
            maps.push(format!("route-map {name} deny {seq}"));
            maps.push(format!("match {kind} address prefix-list {list}"));
            maps.push("exit".into());
            seq += 10;
        }
        maps.push(format!("route-map {name} permit {seq}"));
        maps.push("exit".into());
    }
    if !running.route_map_delay_set {
        // FRR applies route maps defined after the statements that use
        // them (as its saved config has them: after `router bgp`) only
        // when this timer fires: 5 s by default, so a restarted FRR would
        // announce its saved VIPs 5 s late. 0 would stop such updates.
        maps.insert(0, format!("bgp route-map delay-timer {ROUTE_MAP_DELAY}"));
    }
    if !bfd_profiles.is_empty() {
        maps.push("bfd".into());
        for (name, b) in &bfd_profiles {
            maps.push(format!("profile {name}"));
            maps.push(format!("detect-multiplier {}", b.multiplier));
            maps.push(format!("receive-interval {}", b.min_rx.as_millis()));
            maps.push(format!("transmit-interval {}", b.min_tx.as_millis()));
            maps.push("exit".into());
        }
        maps.push("exit".into());
    }

    // Routes.
    let mut per_family: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (prefix, route) in desired {
        let name = map_name(route);
        if running.networks.get(prefix) == Some(&name) && announced.contains(route) {
            continue;
        }
        // A changed route counts as one withdrawn and one added (as the
        // other drivers count a replacement).
        p.added += 1;
        if announced.iter().any(|r| r.prefix == *prefix) {
            p.withdrawn += 1;
        }
        maps.push(format!("route-map {name} permit 10"));
        maps.extend(set_lines(route));
        maps.push("exit".into());
        per_family
            .entry(family(prefix.addr()))
            .or_default()
            .push(format!("network {prefix} route-map {name}"));
        if let Some(old) = running.networks.get(prefix).filter(|&o| *o != name) {
            unused_maps.push(old.clone());
        }
    }
    for (prefix, old) in &running.networks {
        if desired.contains_key(prefix) {
            continue;
        }
        if announced.iter().any(|r| r.prefix == *prefix) {
            p.withdrawn += 1;
        }
        per_family
            .entry(family(prefix.addr()))
            .or_default()
            .push(format!("no network {prefix}"));
        unused_maps.push(old.clone());
    }
    // Maps of ours that no statement uses (left by an earlier apply that
    // stopped half-way).
    let used: BTreeSet<&String> = running.networks.values().collect();
    unused_maps.extend(
        running
            .route_maps
            .keys()
            .filter(|m| m.starts_with(&format!("{MARK}-vip-")) && !used.contains(m))
            .cloned(),
    );
    if !running.import_check_off {
        bgp.insert(0, "no bgp network import-check".into());
    }
    if !running.coalesce_set {
        // FRR 8.4 loses a withdrawal made within the coalesce time (1 s)
        // after a session comes up: the router keeps the route (seen in
        // the ECMP lab, 1 in 3 stops right after a start). Without the
        // wait, a new session gets the table at once.
        bgp.insert(0, "coalesce-time 0".into());
    }
    for peer in peers {
        let activate = !bgp.is_empty()
            && bgp
                .iter()
                .any(|l| l == &format!("neighbor {} remote-as {}", peer.address, peer.asn));
        let export = &exports[&peer.address];
        let a = peer.address;
        if activate {
            per_family
                .entry(family(a))
                .or_default()
                .push(format!("neighbor {a} activate"));
        }
        // Both families, whichever FRR activates (IPv4 unicast is on for
        // every neighbour by default, IPv6 ones included).
        for af in ["ipv4", "ipv6"] {
            let lines = per_family.entry(af).or_default();
            if activate {
                lines.push(format!("neighbor {a} route-map {IMPORT_MAP} in"));
            }
            if activate || running.exports.get(&(a, af.to_string())) != Some(export) {
                lines.push(format!("neighbor {a} route-map {export} out"));
            }
        }
    }
    per_family.retain(|_, lines| !lines.is_empty());
    // Limit maps and their lists no session uses any more (after the
    // sessions moved to their new maps).
    let limit_prefix = format!("{EXPORT_MAP}-");
    unused_maps.extend(
        running
            .route_maps
            .keys()
            .filter(|m| m.starts_with(&limit_prefix) && !limit_maps.contains(*m))
            .cloned(),
    );
    let unused_lists: Vec<String> = running
        .prefix_lists
        .iter()
        .filter(|(_, l)| {
            l.starts_with(&limit_prefix)
                && !limit_maps.iter().any(|m| {
                    l.strip_prefix(m.as_str())
                        .is_some_and(|s| s == "-4" || s == "-6")
                })
        })
        .map(|(kind, l)| format!("no {kind} prefix-list {l}"))
        .collect();
    for (af, lines) in per_family {
        bgp.push(format!("address-family {af} unicast"));
        bgp.extend(lines);
        bgp.push("exit-address-family".into());
    }
    // No sessions of ours left: their policy maps go too.
    if peers.is_empty() {
        unused_maps.extend(
            [IMPORT_MAP, EXPORT_MAP]
                .into_iter()
                .filter(|m| running.route_maps.contains_key(*m))
                .map(String::from),
        );
    }
    unused_maps.sort_unstable();
    unused_maps.dedup();
    if maps.is_empty() && bgp.is_empty() && unused_maps.is_empty() && unused_lists.is_empty() {
        return Ok(p);
    }
    p.commands.push("configure terminal".into());
    p.commands.extend(maps);
    if !bgp.is_empty() {
        p.commands.push(format!("router bgp {asn}"));
        p.commands.extend(bgp);
        p.commands.push("exit".into());
    }
    p.commands
        .extend(unused_maps.into_iter().map(|m| format!("no route-map {m}")));
    p.commands.extend(unused_lists);
    Ok(p)
}

/// The outbound route map of the agent's session with `peer`: the shared
/// one, or one named after the limited prefixes it may not have.
fn export_map(limits: &[PeerLimit], peer: IpAddr) -> String {
    let denied: String = limits
        .iter()
        .filter(|l| !l.peers.contains(&peer))
        .map(|l| format!("{};", l.prefix))
        .collect();
    if denied.is_empty() {
        EXPORT_MAP.into()
    } else {
        format!("{EXPORT_MAP}-{:08x}", fnv1a(denied.as_bytes()))
    }
}

fn family(a: IpAddr) -> &'static str {
    if a.is_ipv4() {
        "ipv4"
    } else {
        "ipv6"
    }
}

/// A route's map: named after its prefix and a hash of its attributes.
fn map_name(route: &Route) -> String {
    let attrs = set_lines(route).join("\n");
    format!(
        "{MARK}-vip-{}-{:08x}",
        route.prefix,
        fnv1a(attrs.as_bytes())
    )
}

fn set_lines(route: &Route) -> Vec<String> {
    let mut sets = vec![match route.next_hop {
        IpAddr::V4(a) => format!("set ip next-hop {a}"),
        IpAddr::V6(a) => format!("set ipv6 next-hop global {a}"),
    }];
    if !route.communities.is_empty() {
        let list: Vec<String> = route
            .communities
            .iter()
            .map(|(a, v)| format!("{a}:{v}"))
            .collect();
        sets.push(format!("set community {}", list.join(" ")));
    }
    if !route.large_communities.is_empty() {
        let list: Vec<String> = route
            .large_communities
            .iter()
            .map(|(g, l1, l2)| format!("{g}:{l1}:{l2}"))
            .collect();
        sets.push(format!("set large-community {}", list.join(" ")));
    }
    if let Some(lp) = route.local_pref {
        sets.push(format!("set local-preference {lp}"));
    }
    sets
}

fn bfd_profile(b: &Bfd) -> String {
    format!(
        "{MARK}-bfd-{}-{}-{}",
        b.multiplier,
        b.min_rx.as_millis(),
        b.min_tx.as_millis()
    )
}

/// A peer's settings as bgpd commands (after `remote-as` and the mark).
fn peer_lines(peer: &BgpPeer) -> AnnounceResult<Vec<String>> {
    let a = peer.address;
    let secs = |d: Duration| d.as_secs().max(u64::from(d.subsec_nanos() > 0));
    let mut lines = vec![format!(
        "neighbor {a} timers {} {}",
        secs(peer.keepalive),
        secs(peer.hold_time)
    )];
    if let Some(port) = peer.port {
        lines.push(format!("neighbor {a} port {port}"));
    }
    if let Some(password) = &peer.password {
        if password.chars().any(char::is_whitespace) {
            return Err(AnnounceError::Refused(format!(
                "peer {a}: FRR takes no password with spaces"
            )));
        }
        lines.push(format!("neighbor {a} password {password}"));
    }
    if let Some(ttl) = peer.multihop_ttl {
        lines.push(format!("neighbor {a} ebgp-multihop {ttl}"));
    }
    if peer.graceful_restart.is_some() {
        lines.push(format!("neighbor {a} graceful-restart"));
    }
    if let Some(b) = &peer.bfd {
        lines.push(format!("neighbor {a} bfd profile {}", bfd_profile(b)));
    }
    Ok(lines)
}

/// `show bgp neighbors json`: address → `bgpState`.
/// An established session's uptime is `bgpTimerUpMsec`; its prefixes
/// sent, the sum of `sentPrefixCounter` over `addressFamilyInfo`.
fn parse_neighbors(text: &str) -> Result<Vec<Session>, String> {
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| format!("`show bgp neighbors json` is not JSON: {e}"))?;
    let map = v
        .as_object()
        .ok_or("`show bgp neighbors json` is not an object")?;
    Ok(map
        .iter()
        .filter_map(|(k, v)| {
            let addr: IpAddr = k.parse().ok()?;
            let mut s = Session::new(addr, v["bgpState"].as_str() == Some("Established"));
            if s.established {
                s.uptime = v["bgpTimerUpMsec"].as_u64().map(Duration::from_millis);
                s.prefixes_sent = v["addressFamilyInfo"].as_object().map(|families| {
                    families
                        .values()
                        .filter_map(|f| f["sentPrefixCounter"].as_u64())
                        .sum()
                });
            }
            Some(s)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write as _;

    fn route(vip: &str, hop: &str, c: Vec<(u16, u16)>, lp: Option<u32>) -> Route {
        Route {
            prefix: IpNet::from(vip.parse::<IpAddr>().unwrap()),
            next_hop: hop.parse().unwrap(),
            communities: c,
            large_communities: vec![],
            local_pref: lp,
        }
    }

    fn peer(addr: &str, bfd: Option<Bfd>) -> BgpPeer {
        BgpPeer {
            address: addr.parse().unwrap(),
            asn: 65000,
            port: None,
            hold_time: Duration::from_secs(3),
            keepalive: Duration::from_secs(1),
            password: None,
            multihop_ttl: None,
            graceful_restart: None,
            bfd,
        }
    }

    /// Applies `plan` to a running config the way FRR shows it: enough of
    /// FRR to check that a second apply sends nothing.
    fn render_running(
        asn: u32,
        routes: &BTreeMap<IpNet, Route>,
        peers: &[BgpPeer],
        limits: &[PeerLimit],
    ) -> String {
        let mut s = format!(
            "bgp route-map delay-timer 1\n!\nrouter bgp {asn}\n coalesce-time 0\n no bgp network import-check\n"
        );
        for p in peers {
            let lines = peer_lines(p).unwrap();
            let mark = format!("{MARK}:{:08x}", fnv1a(lines.join("\n").as_bytes()));
            let _ = writeln!(s, " neighbor {} remote-as {}", p.address, p.asn);
            let _ = writeln!(s, " neighbor {} description {mark}", p.address);
        }
        for v4 in [true, false] {
            let af = if v4 { "ipv4" } else { "ipv6" };
            let _ = writeln!(s, " !\n address-family {af} unicast");
            for (prefix, r) in routes.iter().filter(|(p, _)| p.addr().is_ipv4() == v4) {
                let _ = writeln!(s, "  network {prefix} route-map {}", map_name(r));
            }
            for p in peers {
                if p.address.is_ipv4() == v4 {
                    let _ = writeln!(s, "  neighbor {} activate", p.address);
                }
                let _ = writeln!(s, "  neighbor {} route-map {IMPORT_MAP} in", p.address);
                let export = export_map(limits, p.address);
                let _ = writeln!(s, "  neighbor {} route-map {export} out", p.address);
            }
            s.push_str(" exit-address-family\n");
        }
        s.push_str("exit\n!\n");
        // The limit maps, as FRR shows them (names are all the plan reads).
        for p in peers {
            let export = export_map(limits, p.address);
            if export != EXPORT_MAP {
                let _ = writeln!(
                    s,
                    "ip prefix-list {export}-4 seq 5 permit 192.0.2.0/24 le 32"
                );
                let _ = writeln!(
                    s,
                    "route-map {export} deny 10\n match ip address prefix-list {export}-4\nexit\n!"
                );
                let _ = writeln!(s, "route-map {export} permit 20\nexit\n!");
            }
        }
        for r in routes.values() {
            let _ = writeln!(s, "route-map {} permit 10", map_name(r));
            for l in set_lines(r) {
                let _ = writeln!(s, " {l}");
            }
            s.push_str("exit\n!\n");
        }
        s
    }

    #[test]
    fn limited_prefixes_get_a_session_an_outbound_map_that_denies_them() {
        let peers = [peer("10.9.0.254", None), peer("10.9.0.253", None)];
        let limits = [
            PeerLimit {
                prefix: "192.0.2.64/26".parse().unwrap(),
                peers: ["10.9.0.253".parse().unwrap()].into(),
            },
            PeerLimit {
                prefix: "192.0.2.200/32".parse().unwrap(),
                peers: BTreeSet::new(),
            },
        ];
        let sessions = Running::parse(&render_running(65001, &BTreeMap::new(), &peers, &[]));
        let p = plan(&sessions, Some(65001), &peers, &limits, &BTreeMap::new()).unwrap();
        let text = p.commands.join("\n");
        let denies_both = export_map(&limits, "10.9.0.254".parse().unwrap());
        let denies_one = export_map(&limits, "10.9.0.253".parse().unwrap());
        assert_ne!(denies_both, denies_one);
        // Lists first (a host route without `le`), then the maps, then
        // the sessions moved to them.
        assert!(
            text.contains(&format!(
                "ip prefix-list {denies_both}-4 seq 5 permit 192.0.2.64/26 le 32\n\
                 ip prefix-list {denies_both}-4 seq 10 permit 192.0.2.200/32\n\
                 route-map {denies_both} deny 10\n\
                 match ip address prefix-list {denies_both}-4\nexit\n\
                 route-map {denies_both} permit 20\nexit"
            )),
            "{text}"
        );
        assert!(text.contains(&format!("neighbor 10.9.0.254 route-map {denies_both} out")));
        assert!(text.contains(&format!("neighbor 10.9.0.253 route-map {denies_one} out")));
        // As FRR then shows it: nothing more to do.
        let limited = Running::parse(&render_running(65001, &BTreeMap::new(), &peers, &limits));
        let p = plan(&limited, Some(65001), &peers, &limits, &BTreeMap::new()).unwrap();
        assert!(p.commands.is_empty(), "{:?}", p.commands);
        // Limits gone: back to the shared map, the limit maps and lists go.
        let p = plan(&limited, Some(65001), &peers, &[], &BTreeMap::new()).unwrap();
        let text = p.commands.join("\n");
        assert!(text.contains(&format!("neighbor 10.9.0.254 route-map {EXPORT_MAP} out")));
        assert!(
            text.contains(&format!("no route-map {denies_both}")),
            "{text}"
        );
        // The lists go last, once no map uses them.
        let lists = text.split("no ip prefix-list").skip(1).count();
        assert!(
            lists == 2 && text.contains(&format!("no ip prefix-list {denies_one}-4")),
            "{text}"
        );
        assert!(
            text.rfind("no route-map") < text.find("no ip prefix-list"),
            "{text}"
        );
    }

    #[test]
    fn reads_back_the_routes_of_its_route_maps_and_leaves_the_operators_alone() {
        let text = "\
frr version 8.4.4
router bgp 65001
 bgp router-id 10.9.0.1
 no bgp network import-check
 neighbor 10.9.0.254 remote-as 65000
 neighbor 10.9.0.254 description xlb:0badcafe
 neighbor 10.9.0.253 remote-as 65000
 !
 address-family ipv4 unicast
  network 192.0.2.10/32 route-map xlb-vip-192.0.2.10/32-1
  network 198.51.100.0/24 route-map operators
  network 192.0.2.11/32 route-map xlb-vip-192.0.2.11/32-gone
 exit-address-family
 !
 address-family ipv6 unicast
  network 2001:db8::10/128 route-map xlb-vip-2001:db8::10/128-2
 exit-address-family
exit
!
router bgp 65009 vrf blue
 address-family ipv4 unicast
  network 203.0.113.1/32 route-map xlb-vip-elsewhere
 exit-address-family
exit
!
route-map xlb-vip-192.0.2.10/32-1 permit 10
 set community 65000:1 65000:100
 set ip next-hop 10.9.0.1
 set local-preference 200
exit
!
route-map xlb-vip-2001:db8::10/128-2 permit 10
 set ipv6 next-hop global fd00::1
exit
!
end
";
        let r = Running::parse(text);
        assert_eq!(r.asn, Some(65001));
        assert!(r.import_check_off);
        assert_eq!(r.neighbors.len(), 2);
        assert_eq!(
            r.neighbors[&"10.9.0.254".parse::<IpAddr>().unwrap()].as_deref(),
            Some("xlb:0badcafe")
        );
        let routes: Vec<Route> = r.routes().into_iter().collect();
        assert_eq!(
            routes,
            [
                route(
                    "192.0.2.10",
                    "10.9.0.1",
                    vec![(65000, 1), (65000, 100)],
                    Some(200)
                ),
                route("2001:db8::10", "fd00::1", vec![], None),
            ],
            "the operator's network, the one without its map and the other VRF's are not ours"
        );
    }

    #[test]
    fn plans_additions_changes_and_withdrawals_and_then_nothing() {
        let a = route("192.0.2.10", "10.0.0.1", vec![(65000, 1)], None);
        let b = Route {
            prefix: "192.0.2.0/28".parse().unwrap(),
            ..route("192.0.2.0", "10.0.0.1", vec![], Some(200))
        };
        let desired: BTreeMap<IpNet, Route> = [(a.prefix, a.clone()), (b.prefix, b.clone())].into();
        let empty = Running::parse("router bgp 65001\nexit\n");
        let p = plan(&empty, Some(65001), &[], &[], &desired).unwrap();
        assert_eq!((p.added, p.withdrawn), (2, 0));
        let text = p.commands.join("\n");
        assert!(
            text.starts_with("configure terminal\nbgp route-map delay-timer 1\n"),
            "{text}"
        );
        assert!(text.contains(&format!(
            "route-map {} permit 10\nset ip next-hop 10.0.0.1\nset community 65000:1\nexit",
            map_name(&a)
        )));
        assert!(text.contains(
            "router bgp 65001\ncoalesce-time 0\nno bgp network import-check\naddress-family ipv4 unicast\n"
        ));
        assert!(text.contains(&format!("network 192.0.2.0/28 route-map {}", map_name(&b))));

        // What FRR then shows: nothing more to do.
        let now = Running::parse(&render_running(65001, &desired, &[], &[]));
        assert_eq!(now.routes(), desired.values().cloned().collect());
        let p = plan(&now, Some(65001), &[], &[], &desired).unwrap();
        assert!(p.commands.is_empty(), "{:?}", p.commands);

        // a gets a community (a new map, the old deleted after), b goes.
        let a2 = route("192.0.2.10", "10.0.0.1", vec![(65000, 1), (65535, 0)], None);
        let next: BTreeMap<IpNet, Route> = [(a2.prefix, a2.clone())].into();
        let p = plan(&now, Some(65001), &[], &[], &next).unwrap();
        assert_eq!((p.added, p.withdrawn), (1, 2));
        let text = p.commands.join("\n");
        assert_ne!(map_name(&a), map_name(&a2));
        assert!(text.contains(&format!(
            "network 192.0.2.10/32 route-map {}",
            map_name(&a2)
        )));
        assert!(text.contains("no network 192.0.2.0/28"));
        let deletions = format!(
            "no route-map {}\nno route-map {}",
            map_name(&a).min(map_name(&b)),
            map_name(&a).max(map_name(&b))
        );
        assert!(text.ends_with(&deletions), "{text}");
    }

    #[test]
    fn writes_its_sessions_and_refuses_the_operators_neighbour_or_another_as() {
        let bfd = Bfd::DEFAULT;
        let peers = [peer("10.0.0.254", Some(bfd))];
        let empty = Running::parse("router bgp 65001\nexit\n");
        let p = plan(&empty, Some(65001), &peers, &[], &BTreeMap::new()).unwrap();
        let text = p.commands.join("\n");
        for want in [
            "route-map xlb-import deny 10",
            "bfd\nprofile xlb-bfd-3-100-100\ndetect-multiplier 3\nreceive-interval 100\ntransmit-interval 100\nexit\nexit",
            "neighbor 10.0.0.254 remote-as 65000\nneighbor 10.0.0.254 description xlb:",
            "neighbor 10.0.0.254 timers 1 3",
            "neighbor 10.0.0.254 bfd profile xlb-bfd-3-100-100",
            "address-family ipv4 unicast\nneighbor 10.0.0.254 activate\nneighbor 10.0.0.254 route-map xlb-import in\nneighbor 10.0.0.254 route-map xlb-export out\nexit-address-family",
        ] {
            assert!(text.contains(want), "missing {want:?} in:\n{text}");
        }
        // Once FRR has it: nothing; changed: deleted and added again; gone: deleted.
        let now = Running::parse(&render_running(65001, &BTreeMap::new(), &peers, &[]));
        assert!(plan(&now, Some(65001), &peers, &[], &BTreeMap::new())
            .unwrap()
            .commands
            .is_empty());
        let changed = [peer("10.0.0.254", None)];
        let text = plan(&now, Some(65001), &changed, &[], &BTreeMap::new())
            .unwrap()
            .commands
            .join("\n");
        assert!(
            text.contains("no neighbor 10.0.0.254\nneighbor 10.0.0.254 remote-as 65000"),
            "{text}"
        );
        let text = plan(&now, Some(65001), &[], &[], &BTreeMap::new())
            .unwrap()
            .commands
            .join("\n");
        assert!(text.contains("no neighbor 10.0.0.254"), "{text}");

        let operators =
            Running::parse("router bgp 65001\n neighbor 10.0.0.254 remote-as 65000\nexit\n");
        let e = plan(&operators, Some(65001), &peers, &[], &BTreeMap::new()).unwrap_err();
        assert!(e.to_string().contains("from its own configuration"), "{e}");
        let e = plan(&empty, Some(65002), &[], &[], &BTreeMap::new()).unwrap_err();
        assert!(e.to_string().contains("router bgp 65001"), "{e}");
        let e = plan(&Running::default(), None, &[], &[], &BTreeMap::new()).unwrap_err();
        assert!(e.to_string().contains("no `router bgp`"), "{e}");
    }

    #[test]
    fn reads_session_states() {
        // The keys read, as FRR 8.4 writes them (shortened).
        let text = r#"{"10.0.0.254":{"remoteAs":65000,"bgpState":"Established",
                         "bgpTimerUpMsec":92000,"bgpTimerUpString":"00:01:32",
                         "addressFamilyInfo":{
                           "ipv4Unicast":{"acceptedPrefixCounter":0,"sentPrefixCounter":3},
                           "ipv6Unicast":{"acceptedPrefixCounter":0,"sentPrefixCounter":1}}},
                       "fd00::fe":{"bgpState":"Active","bgpTimerUpMsec":0}}"#;
        assert_eq!(
            parse_neighbors(text).unwrap(),
            [
                Session {
                    peer: "10.0.0.254".parse().unwrap(),
                    established: true,
                    uptime: Some(Duration::from_secs(92)),
                    prefixes_sent: Some(4),
                },
                Session::new("fd00::fe".parse().unwrap(), false)
            ]
        );
    }
}
