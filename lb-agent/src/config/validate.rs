//! Checks the raw file field by field and builds the typed config; every
//! error names its field and line.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use lb_common::maglev;

use super::{locate::*, raw::*, *};
use crate::dataplane::{NewFlowLimit, Protocol};

/// Bounds of `flow_table_entries`: a table smaller than a few thousand
/// flows evicts live ones under any load; 2^26 flows take ~9 GiB.
const MIN_FLOW_TABLE_ENTRIES: u32 = 1024;
const MAX_FLOW_TABLE_ENTRIES: u32 = 1 << 26;
/// Upper bound of `flood_threshold`: no CPU makes a billion flows a second.
const MAX_FLOOD_THRESHOLD: u32 = 1_000_000_000;

pub(super) struct Validator<'t> {
    pub(super) text: &'t str,
}

pub(super) type Checked<T> = Result<T, ConfigError>;

pub(super) fn root() -> FieldPath {
    FieldPath::default()
}

impl Validator<'_> {
    fn line(&self, path: &FieldPath) -> usize {
        locate(self.text, &path.0)
    }

    pub(super) fn err(&self, path: FieldPath, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            line: self.line(&path),
            field: path.to_string(),
            message: message.into(),
        }
    }

    pub(super) fn config(&self, raw: RawConfig) -> Checked<AgentConfig> {
        let interfaces = self.interfaces(raw.interfaces)?;
        let snat_ipv4 = match &raw.snat_ipv4 {
            None => None,
            Some(s) => match self.ip(s, || root().key("snat_ipv4"))? {
                IpAddr::V4(a) => Some(a),
                IpAddr::V6(_) => {
                    return Err(self.err(
                        root().key("snat_ipv4"),
                        format!("{s} is not an IPv4 address"),
                    ))
                }
            },
        };
        let snat_ipv6 = match &raw.snat_ipv6 {
            None => None,
            Some(s) => match self.ip(s, || root().key("snat_ipv6"))? {
                IpAddr::V6(a) => Some(a),
                IpAddr::V4(_) => {
                    return Err(self.err(
                        root().key("snat_ipv6"),
                        format!("{s} is not an IPv6 address"),
                    ))
                }
            },
        };
        let snat_ports = match &raw.snat_ports {
            None => (
                lb_common::DEFAULT_SNAT_PORT_MIN,
                lb_common::DEFAULT_SNAT_PORT_MAX,
            ),
            Some(s) => parse_port_range(s).map_err(|m| self.err(root().key("snat_ports"), m))?,
        };
        let metrics_addr = match &raw.metrics_addr {
            None => DEFAULT_METRICS_ADDR,
            Some(s) => s.trim().parse().map_err(|_| {
                self.err(
                    root().key("metrics_addr"),
                    format!("{s:?} is not an address:port (e.g. 127.0.0.1:9469, \"[::1]:9469\")"),
                )
            })?,
        };
        let xdp_mode = match raw.xdp_mode {
            None | Some(RawXdpMode::Native) => XdpAttachMode::Native,
            Some(RawXdpMode::Generic) => XdpAttachMode::Generic,
        };
        let (tcp_timeout, tcp_closing_timeout, udp_timeout) = self.timeouts(raw.timeouts)?;

        let maglev_pool_entries = match raw.maglev_pool_entries {
            None => lb_common::MAGLEV_POOL_ENTRIES,
            Some(n) if (2 * lb_common::MAX_MAGLEV_SIZE..=1 << 28).contains(&n) => n,
            Some(n) => {
                return Err(self.err(
                    root().key("maglev_pool_entries"),
                    format!(
                        "{n} is outside {}..={}",
                        2 * lb_common::MAX_MAGLEV_SIZE,
                        1u32 << 28
                    ),
                ))
            }
        };
        let flow_table_entries = match raw.flow_table_entries {
            None => lb_common::FLOWS_ENTRIES,
            Some(n) if (MIN_FLOW_TABLE_ENTRIES..=MAX_FLOW_TABLE_ENTRIES).contains(&n) => n,
            Some(n) => {
                return Err(self.err(
                    root().key("flow_table_entries"),
                    format!("{n} is outside {MIN_FLOW_TABLE_ENTRIES}..={MAX_FLOW_TABLE_ENTRIES}"),
                ))
            }
        };
        let flood_threshold = match raw.flood_threshold {
            None => lb_common::DEFAULT_FLOOD_THRESHOLD,
            Some(n) if n <= MAX_FLOOD_THRESHOLD => n,
            Some(n) => {
                return Err(self.err(
                    root().key("flood_threshold"),
                    format!("{n} is above {MAX_FLOOD_THRESHOLD} (0 turns flood mode off)"),
                ))
            }
        };
        let bgp = match raw.bgp {
            None => None,
            Some(b) => Some(self.bgp(b)?),
        };
        let kubernetes = match raw.kubernetes {
            None => None,
            Some(k) => Some(self.kubernetes(k)?),
        };
        let (load_interval, cgroup_root) = self.load_aware(raw.load_aware)?;
        let pod_interfaces =
            self.pod_interfaces(raw.pod_interfaces, &interfaces, kubernetes.is_some())?;
        let l2 = match raw.l2 {
            None => None,
            Some(l) => Some(self.l2(l, &interfaces, kubernetes.is_some())?),
        };
        let flow_sync = match raw.flow_sync {
            Some(f) => Some(self.flow_sync(f, kubernetes.is_some())?),
            None => l2.as_ref().and_then(FlowSyncConfig::for_l2),
        };
        let services = self.services(raw.services, snat_ipv4, snat_ipv6)?;
        self.announce(&services, bgp.is_some(), l2.is_some())?;
        Ok(AgentConfig {
            interfaces,
            snat_ipv4,
            snat_ipv6,
            snat_ports,
            metrics_addr,
            backend_metrics: raw.backend_metrics.unwrap_or(true),
            xdp_mode,
            pod_interfaces,
            tcp_timeout,
            tcp_closing_timeout,
            udp_timeout,
            maglev_pool_entries,
            flow_table_entries,
            flood_threshold,
            bgp,
            kubernetes,
            load_interval,
            cgroup_root,
            l2,
            flow_sync,
            services,
        })
    }

    /// Every service, with the checks that span services (names, VIPs,
    /// the SNAT address snat mode needs).
    fn services(
        &self,
        raw_services: Vec<RawService>,
        snat_ipv4: Option<Ipv4Addr>,
        snat_ipv6: Option<Ipv6Addr>,
    ) -> Checked<Vec<DesiredService>> {
        let mut services: Vec<DesiredService> = Vec::with_capacity(raw_services.len());
        // name -> index; (vip, port, protocol) -> index
        let mut names: HashMap<String, usize> = HashMap::with_capacity(raw_services.len());
        let mut vips: HashMap<(IpAddr, u16, Protocol), usize> =
            HashMap::with_capacity(raw_services.len());
        for (i, rs) in raw_services.into_iter().enumerate() {
            let path = root().key("services").index(i);
            let s = self.service(rs, &path)?;
            if let Some(&j) = names.get(&s.name) {
                let other = self.line(&root().key("services").index(j).key("name"));
                return Err(self.err(
                    path.key("name"),
                    format!(
                        "duplicate service name {:?} (also services[{j}] at line {other})",
                        s.name
                    ),
                ));
            }
            if let Some(&j) = vips.get(&(s.vip, s.port, s.protocol)) {
                let other = self.line(&root().key("services").index(j));
                return Err(self.err(
                    path,
                    format!(
                        "duplicate VIP {}/{} (also in service {:?} at line {other})",
                        SocketAddr::new(s.vip, s.port),
                        s.protocol.name(),
                        services[j].name,
                    ),
                ));
            }
            if s.mode == Mode::Snat {
                let missing = match s.vip {
                    IpAddr::V4(_) if snat_ipv4.is_none() => Some("snat_ipv4"),
                    IpAddr::V6(_) if snat_ipv6.is_none() => Some("snat_ipv6"),
                    _ => None,
                };
                if let Some(key) = missing {
                    return Err(self.err(
                        path.key("mode"),
                        format!(
                            "mode snat with the {} VIP {} needs {key} (the node's source address)",
                            if s.vip.is_ipv4() { "IPv4" } else { "IPv6" },
                            s.vip
                        ),
                    ));
                }
            }
            names.insert(s.name.clone(), i);
            vips.insert((s.vip, s.port, s.protocol), i);
            services.push(s);
        }
        Ok(services)
    }

    /// `timeouts`: (tcp, tcp_closing, udp).
    fn timeouts(&self, timeouts: Option<RawTimeouts>) -> Checked<(Duration, Duration, Duration)> {
        let t = timeouts.unwrap_or(RawTimeouts {
            tcp: None,
            tcp_closing: None,
            udp: None,
        });
        let timeout = |v: &Option<String>, key: &'static str, default: Duration| match v {
            None => Ok(default),
            Some(s) => {
                let path = || root().key("timeouts").key(key);
                let d = self.duration(s, path)?;
                if d < Duration::from_secs(1) {
                    Err(self.err(path(), format!("{s} is shorter than 1s")))
                } else if d.as_secs() > u64::from(u32::MAX) {
                    Err(self.err(path(), format!("{s} is longer than {}s", u32::MAX)))
                } else {
                    Ok(d)
                }
            }
        };
        let tcp_timeout = timeout(&t.tcp, "tcp", DEFAULT_TCP_TIMEOUT)?;
        let tcp_closing_timeout =
            timeout(&t.tcp_closing, "tcp_closing", DEFAULT_TCP_CLOSING_TIMEOUT)?;
        let udp_timeout = timeout(&t.udp, "udp", DEFAULT_UDP_TIMEOUT)?;
        Ok((tcp_timeout, tcp_closing_timeout, udp_timeout))
    }

    fn kubernetes(&self, k: RawKubernetes) -> Checked<KubernetesConfig> {
        let path = || root().key("kubernetes");
        let name = |v: Option<String>, key: &'static str, default: &str| -> Checked<String> {
            let v = v.unwrap_or_else(|| default.to_string());
            // DNS-1123 subdomain, as Kubernetes checks names and namespaces.
            let ok = !v.is_empty()
                && v.len() <= 253
                && v.split('.').all(|l| {
                    !l.is_empty()
                        && l.len() <= 63
                        && l.bytes()
                            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                        && !l.starts_with('-')
                        && !l.ends_with('-')
                });
            if ok {
                Ok(v)
            } else {
                Err(self.err(
                    path().key(key),
                    format!(
                        "{v:?} is not a Kubernetes name (lower-case letters, digits, '-', '.')"
                    ),
                ))
            }
        };
        let class = k
            .load_balancer_class
            .unwrap_or_else(|| DEFAULT_LOAD_BALANCER_CLASS.to_string());
        // A class is a label-style key: an optional DNS prefix, '/', a name.
        if class.is_empty() || class.len() > 253 || class.contains(char::is_whitespace) {
            return Err(self.err(
                path().key("load_balancer_class"),
                format!("{class:?} is not a loadBalancerClass (e.g. xlb.dev/xlb)"),
            ));
        }
        let lease_duration = match &k.lease_duration {
            None => DEFAULT_LEASE_DURATION,
            Some(s) => {
                let d = self.duration(s, || path().key("lease_duration"))?;
                if !(Duration::from_secs(2)..=Duration::from_secs(3600)).contains(&d) {
                    return Err(self.err(
                        path().key("lease_duration"),
                        format!("{s} is outside 2s..=1h"),
                    ));
                }
                d
            }
        };
        Ok(KubernetesConfig {
            kubeconfig: k.kubeconfig.map(PathBuf::from),
            node_name: match k.node_name {
                None => None,
                Some(n) => Some(name(Some(n), "node_name", "")?),
            },
            load_balancer_class: class,
            default_class: k.default_class.unwrap_or(false),
            mode: match k.mode {
                None | Some(RawMode::Snat) => Mode::Snat,
                Some(RawMode::Nat) => Mode::Nat,
            },
            allocate_addresses: k.allocate_addresses.unwrap_or(true),
            lease_namespace: name(
                k.lease_namespace,
                "lease_namespace",
                DEFAULT_LEASE_NAMESPACE,
            )?,
            lease_name: name(k.lease_name, "lease_name", DEFAULT_LEASE_NAME)?,
            lease_duration,
        })
    }

    fn bgp(&self, b: RawBgp) -> Checked<BgpConfig> {
        let path = || root().key("bgp");
        let next_hop_ipv4 = match &b.next_hop_ipv4 {
            None => None,
            Some(s) => match self.ip(s, || path().key("next_hop_ipv4"))? {
                IpAddr::V4(a) => Some(a),
                IpAddr::V6(_) => {
                    return Err(self.err(
                        path().key("next_hop_ipv4"),
                        format!("{s} is not an IPv4 address"),
                    ))
                }
            },
        };
        let next_hop_ipv6 = match &b.next_hop_ipv6 {
            None => None,
            Some(s) => match self.ip(s, || path().key("next_hop_ipv6"))? {
                IpAddr::V6(a) => Some(a),
                IpAddr::V4(_) => {
                    return Err(self.err(
                        path().key("next_hop_ipv6"),
                        format!("{s} is not an IPv6 address"),
                    ))
                }
            },
        };
        let mut communities = Vec::new();
        for (i, c) in b.communities.iter().enumerate() {
            match parse_community(c) {
                Some(p) => communities.push(p),
                None => {
                    return Err(self.err(
                        path().key("communities").index(i),
                        format!("{c:?} is not a community ASN:VALUE (each 0 to 65535)"),
                    ))
                }
            }
        }
        let mut large_communities = Vec::new();
        for (i, c) in b.large_communities.iter().enumerate() {
            match super::parse_large_community(c) {
                Some(p) => large_communities.push(p),
                None => {
                    return Err(self.err(
                        path().key("large_communities").index(i),
                        format!(
                            "{c:?} is not a large community GLOBAL:LOCAL1:LOCAL2 (each 0 to 4294967295)"
                        ),
                    ))
                }
            }
        }
        let dur = |v: &Option<String>, key: &'static str, default: Duration| match v {
            None => Ok(default),
            Some(s) => self.duration(s, || path().key(key)),
        };
        let drain_time = dur(&b.drain_time, "drain_time", DEFAULT_DRAIN_TIME)?;
        let graceful_shutdown = dur(&b.graceful_shutdown, "graceful_shutdown", Duration::ZERO)?;
        let resync_interval = dur(
            &b.resync_interval,
            "resync_interval",
            DEFAULT_RESYNC_INTERVAL,
        )?;
        if resync_interval < Duration::from_millis(100) {
            return Err(self.err(path().key("resync_interval"), "must be at least 100ms"));
        }
        let peers = self.bgp_peers(b.peers)?;
        let speaker = match b.driver {
            RawDriver::Gobgp => {
                if let Some(i) = peers.iter().position(|p| p.bfd.is_some()) {
                    return Err(self.err(
                        path().key("peers").index(i).key("bfd"),
                        "GoBGP has no BFD: use the bird or frr driver for BFD, or leave bfd out",
                    ));
                }
                Speaker::GoBgp {
                    address: b
                        .gobgp
                        .and_then(|g| g.address)
                        .unwrap_or_else(|| DEFAULT_GOBGP_ADDRESS.to_string()),
                }
            }
            RawDriver::Bird => {
                let r = b.bird.unwrap_or(RawBird {
                    routes_file: None,
                    peers_file: None,
                    socket: None,
                    protocol: None,
                });
                if !peers.is_empty() && b.asn.is_none() {
                    return Err(self.err(
                        path().key("asn"),
                        "this node's AS number is required when the agent writes BIRD's sessions (bgp.peers)",
                    ));
                }
                let routes_file: PathBuf = r
                    .routes_file
                    .unwrap_or_else(|| "/run/xlb/bird-routes".into())
                    .into();
                Speaker::Bird {
                    // Beside the routes files: a directory the agent writes.
                    peers_file: r
                        .peers_file
                        .map_or_else(|| routes_file.with_file_name("bird-peers"), PathBuf::from),
                    routes_file,
                    socket: r
                        .socket
                        .unwrap_or_else(|| "/run/bird/bird.ctl".into())
                        .into(),
                    protocol: r.protocol.unwrap_or_else(|| "xlb_vips".into()),
                }
            }
            RawDriver::Exabgp => {
                if !peers.is_empty() {
                    return Err(self.err(
                        path().key("peers"),
                        "ExaBGP cannot take neighbours from the agent: list them in ExaBGP's own configuration",
                    ));
                }
                let e = b.exabgp.unwrap_or(RawExaBgp {
                    pipe_dir: None,
                    pipe_name: None,
                });
                Speaker::ExaBgp {
                    pipe_dir: e.pipe_dir.unwrap_or_else(|| "/run/exabgp".into()).into(),
                    pipe_name: e.pipe_name.unwrap_or_else(|| "exabgp".into()),
                }
            }
            RawDriver::Frr => {
                if !peers.is_empty() && b.asn.is_none() {
                    return Err(self.err(
                        path().key("asn"),
                        "this node's AS number is required when the agent writes FRR's sessions (bgp.peers)",
                    ));
                }
                if let Some(i) = peers.iter().position(|p| {
                    p.password
                        .as_deref()
                        .is_some_and(|w| w.chars().any(char::is_whitespace))
                }) {
                    return Err(self.err(
                        path().key("peers").index(i).key("password"),
                        "FRR takes no password with spaces",
                    ));
                }
                let f = b.frr.unwrap_or_default();
                Speaker::Frr {
                    socket_dir: f
                        .socket_dir
                        .unwrap_or_else(|| crate::bgp::frr::DEFAULT_SOCKET_DIR.into())
                        .into(),
                    config_dir: f
                        .config_dir
                        .unwrap_or_else(|| crate::bgp::frr::DEFAULT_CONFIG_DIR.into())
                        .into(),
                    vtysh: f
                        .vtysh
                        .unwrap_or_else(|| crate::bgp::frr::DEFAULT_VTYSH.into())
                        .into(),
                }
            }
        };
        Ok(BgpConfig {
            speaker,
            next_hop_ipv4,
            next_hop_ipv6,
            communities,
            large_communities,
            local_pref: b.local_pref,
            drain_time,
            graceful_shutdown,
            resync_interval,
            asn: b.asn,
            peers,
        })
    }

    /// `bgp.peers`.
    pub(super) fn bgp_peers(&self, raw: Vec<RawPeer>) -> Checked<Vec<BgpPeer>> {
        let mut peers: Vec<BgpPeer> = Vec::new();
        for (i, p) in raw.into_iter().enumerate() {
            let pp = || root().key("bgp").key("peers").index(i);
            let hold_time = match &p.hold_time {
                None => Duration::from_secs(9),
                Some(s) => self.duration(s, || pp().key("hold_time"))?,
            };
            let keepalive = match &p.keepalive {
                None => hold_time / 3,
                Some(s) => self.duration(s, || pp().key("keepalive"))?,
            };
            if hold_time < Duration::from_secs(3) || keepalive > hold_time {
                return Err(self.err(
                    pp().key("hold_time"),
                    "hold_time must be at least 3s and not below keepalive",
                ));
            }
            let graceful_restart = match &p.graceful_restart {
                None => None,
                Some(s) => {
                    let t = self.duration(s, || pp().key("graceful_restart"))?;
                    // The capability carries the restart time in 12 bits.
                    if t < Duration::from_secs(1) || t > Duration::from_secs(4095) {
                        return Err(self.err(
                            pp().key("graceful_restart"),
                            "graceful_restart (the restart time) must be 1s to 4095s",
                        ));
                    }
                    Some(t)
                }
            };
            let bfd = match p.bfd {
                None => None,
                Some(raw) => Some(self.bfd(raw, || pp().key("bfd"))?),
            };
            let address = self.ip(&p.address, || pp().key("address"))?;
            if peers.iter().any(|q| q.address == address) {
                return Err(self.err(pp().key("address"), format!("{address} is listed twice")));
            }
            if p.password
                .as_deref()
                .is_some_and(|pw| pw.chars().any(|c| c == '"' || c == '\\' || c.is_control()))
            {
                return Err(self.err(
                    pp().key("password"),
                    "may not hold quotes, backslashes or control characters",
                ));
            }
            if p.port == Some(0) {
                return Err(self.err(pp().key("port"), "must be 1 to 65535"));
            }
            peers.push(BgpPeer {
                address,
                asn: p.asn,
                port: p.port,
                hold_time,
                keepalive,
                password: p.password,
                multihop_ttl: p.multihop_ttl,
                graceful_restart,
                bfd,
            });
        }
        Ok(peers)
    }

    /// A peer's `bfd` mapping: each timer 10ms to 10s, a multiplier of 1 to 255.
    fn bfd(&self, raw: RawBfd, at: impl Fn() -> FieldPath) -> Checked<Bfd> {
        let timer = |v: &Option<String>, key: &'static str, default: Duration| {
            let t = match v {
                None => default,
                Some(s) => self.duration(s, || at().key(key))?,
            };
            if t < Duration::from_millis(10) || t > Duration::from_secs(10) {
                return Err(self.err(at().key(key), "must be 10ms to 10s"));
            }
            Ok(t)
        };
        let multiplier = raw.multiplier.unwrap_or(Bfd::DEFAULT.multiplier);
        if multiplier == 0 {
            return Err(self.err(at().key("multiplier"), "must be 1 to 255"));
        }
        Ok(Bfd {
            min_rx: timer(&raw.min_rx, "min_rx", Bfd::DEFAULT.min_rx)?,
            min_tx: timer(&raw.min_tx, "min_tx", Bfd::DEFAULT.min_tx)?,
            multiplier,
        })
    }

    fn interfaces(&self, raw: Vec<String>) -> Checked<Vec<String>> {
        let path = || root().key("interfaces");
        if raw.is_empty() {
            return Err(self.err(path(), "at least one interface is required"));
        }
        self.interface_names(&raw, "interfaces")?;
        Ok(raw)
    }

    /// `pod_interfaces`: by default `auto` with Kubernetes (Pods are
    /// there), else `none`.
    fn pod_interfaces(
        &self,
        raw: Option<RawPodInterfaces>,
        uplinks: &[String],
        kubernetes: bool,
    ) -> Checked<PodInterfaces> {
        let path = || root().key("pod_interfaces");
        match raw {
            None if kubernetes => Ok(PodInterfaces::Auto),
            None => Ok(PodInterfaces::None),
            Some(RawPodInterfaces::Word(w)) => match w.as_str() {
                "auto" => Ok(PodInterfaces::Auto),
                "none" => Ok(PodInterfaces::None),
                _ => Err(self.err(
                    path(),
                    format!("{w:?} is not auto, none or a list of interface names"),
                )),
            },
            Some(RawPodInterfaces::Names(names)) => {
                self.interface_names(&names, "pod_interfaces")?;
                if let Some((i, name)) = names.iter().enumerate().find(|(_, n)| uplinks.contains(n))
                {
                    return Err(self.err(
                        path().index(i),
                        format!(
                            "{name:?} is also in interfaces: an interface is an uplink or \
                             pod-side, not both"
                        ),
                    ));
                }
                Ok(PodInterfaces::Named(names))
            }
        }
    }

    /// Each name valid and listed once, in the list at `key`.
    fn interface_names(&self, raw: &[String], key: &'static str) -> Checked<()> {
        let path = || root().key(key);
        for (i, name) in raw.iter().enumerate() {
            let valid = !name.is_empty()
                && name.len() <= MAX_IFNAME
                && name != "."
                && name != ".."
                && !name
                    .chars()
                    .any(|c| c == '/' || c == ':' || c.is_whitespace());
            if !valid {
                return Err(self.err(
                    path().index(i),
                    format!(
                        "{name:?} is not an interface name (1 to {MAX_IFNAME} characters, \
                         no '/', ':' or spaces)"
                    ),
                ));
            }
            if let Some(j) = raw[..i].iter().position(|n| n == name) {
                return Err(self.err(
                    path().index(i),
                    format!("{name:?} is listed twice (also {key}[{j}])"),
                ));
            }
        }
        Ok(())
    }

    fn ip(&self, s: &str, path: impl FnOnce() -> FieldPath) -> Checked<IpAddr> {
        s.trim()
            .parse()
            .map_err(|_| self.err(path(), format!("{s:?} is not an IP address")))
    }

    fn port(&self, n: i64, path: impl FnOnce() -> FieldPath) -> Checked<u16> {
        match u16::try_from(n) {
            Ok(p) if p != 0 => Ok(p),
            _ => Err(self.err(path(), format!("{n} is not a port (1 to 65535)"))),
        }
    }

    pub(super) fn duration(&self, s: &str, path: impl FnOnce() -> FieldPath) -> Checked<Duration> {
        humantime::parse_duration(s.trim()).map_err(|e| {
            self.err(
                path(),
                format!("{s:?} is not a duration (e.g. 500ms, 10s, 15m): {e}"),
            )
        })
    }

    fn count(&self, n: i64, path: impl FnOnce() -> FieldPath) -> Checked<u32> {
        match u32::try_from(n) {
            Ok(c) if c >= 1 => Ok(c),
            _ => Err(self.err(path(), format!("{n} is not a count of at least 1"))),
        }
    }

    fn service(&self, rs: RawService, path: &FieldPath) -> Checked<DesiredService> {
        let name = rs.name;
        let name_ok = !name.is_empty()
            && name.len() <= MAX_SERVICE_NAME
            && name.bytes().all(|b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_' | b'.')
            });
        if !name_ok {
            return Err(self.err(
                path.key("name"),
                format!(
                    "{name:?} is not a service name (1 to {MAX_SERVICE_NAME} of a-z, 0-9, '-', '_', '.')"
                ),
            ));
        }
        let vip = self.ip(&rs.vip, || path.key("vip"))?;
        let port = self.port(rs.port, || path.key("port"))?;
        let protocol = match rs.protocol {
            None | Some(RawProtocol::Tcp) => Protocol::Tcp,
            Some(RawProtocol::Udp) => Protocol::Udp,
        };
        let mode = match rs.mode {
            None | Some(RawMode::Nat) => Mode::Nat,
            Some(RawMode::Snat) => Mode::Snat,
        };
        let removed_backend_flows = match rs.on_backend_removed {
            None | Some(RawRemoved::Keep) => RemovedBackendFlows::Keep,
            Some(RawRemoved::Reset) => RemovedBackendFlows::Reset,
        };
        if rs.backends.is_empty() {
            return Err(self.err(path.key("backends"), "a service needs at least one backend"));
        }
        let mut backends = Vec::with_capacity(rs.backends.len());
        let mut seen: HashMap<SocketAddr, usize> = HashMap::with_capacity(rs.backends.len());
        for (j, rb) in rs.backends.into_iter().enumerate() {
            let at = |key: &'static str| path.key("backends").index(j).key(key);
            let ip = self.ip(&rb.ip, || at("ip"))?;
            if ip.is_ipv4() != vip.is_ipv4() {
                return Err(self.err(
                    at("ip"),
                    format!(
                        "{ip} is {} but the VIP {vip} is {}",
                        family_name(ip),
                        family_name(vip)
                    ),
                ));
            }
            let bport = self.port(rb.port, || at("port"))?;
            let weight = match rb.weight {
                None => 1,
                Some(w) => match u32::try_from(w) {
                    Ok(w) if w <= MAX_WEIGHT => w,
                    _ => {
                        return Err(self.err(
                            at("weight"),
                            format!("weight {w} is out of range (0 to {MAX_WEIGHT}; 0 drains)"),
                        ))
                    }
                },
            };
            let addr = SocketAddr::new(ip, bport);
            if let Some(&k) = seen.get(&addr) {
                let other = self.line(&path.key("backends").index(k));
                return Err(self.err(
                    path.key("backends").index(j),
                    format!("duplicate backend {addr} (also backends[{k}] at line {other})"),
                ));
            }
            seen.insert(addr, j);
            let cgroup = match rb.cgroup {
                None => None,
                Some(c) => Some(self.cgroup(&c, || at("cgroup"))?),
            };
            backends.push(DesiredBackend {
                ip,
                port: bport,
                weight,
                cgroup: cgroup.map(Box::new),
                terminating: false,
            });
        }
        let table_size = self.table_size(rs.table_size, backends.len(), path)?;
        let health_check = match rs.health_check {
            None => None,
            Some(h) => Some(self.health_check(h, &path.key("health_check"))?),
        };
        let source_ranges = self.source_ranges(rs.source_ranges, vip, path)?;
        let affinity = self.affinity(rs.affinity, rs.affinity_timeout, path)?;
        let balance = self.balance(rs.balance, rs.agent_check, &backends, path)?;
        let announce = match rs.announce {
            None | Some(RawAnnounce::Both) => Announce::Both,
            Some(RawAnnounce::Bgp) => Announce::Bgp,
            Some(RawAnnounce::L2) => Announce::L2,
        };
        let new_flow_limit = match rs.new_flow_limit {
            None => None,
            Some(l) => Some(self.new_flow_limit(l, &path.key("new_flow_limit"))?),
        };
        Ok(DesiredService {
            name,
            vip,
            port,
            protocol,
            mode,
            backends,
            health_check,
            table_size,
            removed_backend_flows,
            source_ranges,
            affinity,
            balance,
            announce,
            new_flow_limit,
            // A node's config file names what it serves itself.
            local_endpoints_only: false,
        })
    }

    /// `load_aware`: the interval and the cgroup root.
    fn load_aware(&self, raw: Option<RawLoadAware>) -> Checked<(Duration, PathBuf)> {
        let (load_interval, cgroup_root) = match raw {
            None => (None, None),
            Some(l) => (l.interval, l.cgroup_root),
        };
        let cgroup_root = match cgroup_root {
            None => PathBuf::from(DEFAULT_CGROUP_ROOT),
            Some(r) if r.starts_with('/') => PathBuf::from(r),
            Some(r) => {
                let at = root().key("load_aware").key("cgroup_root");
                return Err(self.err(at, format!("{r:?} is not an absolute path")));
            }
        };
        let load_interval = match load_interval {
            None => DEFAULT_LOAD_INTERVAL,
            Some(t) => {
                let at = || root().key("load_aware").key("interval");
                let d = self.duration(&t, at)?;
                if !(Duration::from_millis(100)..=Duration::from_secs(60)).contains(&d) {
                    return Err(self.err(at(), format!("{t:?} is outside 100ms..=60s")));
                }
                d
            }
        };
        Ok((load_interval, cgroup_root))
    }

    /// A backend's cgroup: a path below the hierarchies' root, as
    /// /proc/PID/cgroup shows it (a leading `/` is allowed).
    fn cgroup(&self, raw: &str, at: impl Fn() -> FieldPath) -> Checked<BackendCgroup> {
        let rel = raw.trim_start_matches('/');
        if rel.split('/').any(|s| matches!(s, "" | "." | "..")) {
            return Err(self.err(
                at(),
                format!("{raw:?} is not a cgroup path (like system.slice/web.service)"),
            ));
        }
        Ok(BackendCgroup::Path(rel.into()))
    }

    /// `services[].new_flow_limit`.
    fn new_flow_limit(&self, raw: RawNewFlowLimit, path: &FieldPath) -> Checked<NewFlowLimit> {
        let int = |v: i64, key: &'static str, lo: i64, hi: i64| {
            if (lo..=hi).contains(&v) {
                Ok(v)
            } else {
                Err(self.err(
                    path.key(key),
                    format!("{key} must be {lo} to {hi}, not {v}"),
                ))
            }
        };
        let per_second = int(raw.per_second, "per_second", 1, 1_000_000_000)? as u32;
        Ok(NewFlowLimit {
            per_second,
            burst: match raw.burst {
                None => per_second,
                Some(b) => int(b, "burst", 1, 1_000_000_000)? as u32,
            },
            ipv4_prefix: int(raw.ipv4_prefix.unwrap_or(32), "ipv4_prefix", 0, 32)? as u8,
            ipv6_prefix: int(raw.ipv6_prefix.unwrap_or(64), "ipv6_prefix", 0, 128)? as u8,
        })
    }

    /// A service announced only by a way this node does not have would
    /// never be reachable through it.
    fn announce(&self, services: &[DesiredService], bgp: bool, l2: bool) -> Checked<()> {
        for (i, s) in services.iter().enumerate() {
            let missing = match s.announce {
                Announce::Bgp if !bgp => "bgp",
                Announce::L2 if !l2 => "l2",
                _ => continue,
            };
            return Err(self.err(
                root().key("services").index(i).key("announce"),
                format!(
                    "announce: {missing} needs the {missing}: section (without it this node never announces {})",
                    s.vip
                ),
            ));
        }
        Ok(())
    }

    /// `balance`, and `agent_check` and the backends' `cgroup`, which only
    /// load-aware balancing reads.
    fn balance(
        &self,
        balance: Option<RawBalance>,
        agent_check: Option<RawAgentCheck>,
        backends: &[DesiredBackend],
        path: &FieldPath,
    ) -> Checked<Balance> {
        let agent_check = match agent_check {
            None => None,
            Some(a) => Some(AgentCheck {
                port: self.port(a.port, || path.key("agent_check").key("port"))?,
            }),
        };
        Ok(match balance {
            Some(RawBalance::LoadAware) => Balance::LoadAware { agent_check },
            None | Some(RawBalance::Static) => {
                if agent_check.is_some() {
                    return Err(self.err(
                        path.key("agent_check"),
                        "agent_check needs balance: load-aware (static weights ignore it)",
                    ));
                }
                if let Some(j) = backends.iter().position(|b| b.cgroup.is_some()) {
                    return Err(self.err(
                        path.key("backends").index(j).key("cgroup"),
                        "cgroup needs balance: load-aware (static weights ignore it)",
                    ));
                }
                Balance::Static
            }
        })
    }

    /// `table_size`, or the default, which must hold the backends.
    fn table_size(
        &self,
        table_size: Option<i64>,
        backend_count: usize,
        path: &FieldPath,
    ) -> Checked<Option<u32>> {
        Ok(match table_size {
            Some(m) => {
                let bad = |msg: String| self.err(path.key("table_size"), msg);
                let m32 = u32::try_from(m).map_err(|_| {
                    bad(format!(
                        "table size {m} is not a prime up to {}",
                        lb_common::MAX_MAGLEV_SIZE
                    ))
                })?;
                maglev::check_table_size(m32, backend_count).map_err(|e| bad(e.to_string()))?;
                Some(m32)
            }
            None => {
                let m = maglev::default_table_size(backend_count);
                if maglev::check_table_size(m, backend_count).is_err() {
                    return Err(self.err(
                        path.key("backends"),
                        format!(
                            "{} backends are too many: the largest Maglev table ({m}) \
                             holds at most {} (100 entries each)",
                            backend_count,
                            m / 100
                        ),
                    ));
                }
                None
            }
        })
    }

    /// `source_ranges`: CIDRs of the VIP's family, at least one.
    fn source_ranges(
        &self,
        ranges: Option<Vec<String>>,
        vip: IpAddr,
        path: &FieldPath,
    ) -> Checked<Option<Vec<IpNet>>> {
        Ok(match ranges {
            None => None,
            Some(entries) => {
                let mut nets = Vec::with_capacity(entries.len());
                for (j, e) in entries.iter().enumerate() {
                    let at = || path.key("source_ranges").index(j);
                    let net = parse_source_range(e, true).map_err(|m| self.err(at(), m))?;
                    if net.addr().is_ipv4() != vip.is_ipv4() {
                        return Err(self.err(
                            at(),
                            format!(
                                "{net} is {} but the VIP {vip} is {}",
                                family_name(net.addr()),
                                family_name(vip)
                            ),
                        ));
                    }
                    nets.push(net);
                }
                if nets.is_empty() {
                    return Err(self.err(
                        path.key("source_ranges"),
                        "an empty list would refuse every client; leave source_ranges out to allow all",
                    ));
                }
                Some(ranges_for(vip, &nets))
            }
        })
    }

    /// `affinity` and `affinity_timeout`.
    fn affinity(
        &self,
        affinity: Option<RawAffinity>,
        timeout_raw: Option<String>,
        path: &FieldPath,
    ) -> Checked<Option<ClientAffinity>> {
        let timeout = match &timeout_raw {
            None => DEFAULT_AFFINITY_TIMEOUT,
            Some(t) => {
                let at = || path.key("affinity_timeout");
                let d = self.duration(t, at)?;
                if d < Duration::from_secs(1) || d > MAX_AFFINITY_TIMEOUT {
                    return Err(self.err(
                        at(),
                        format!("{t:?} is out of range (1s to 24h, as in Kubernetes)"),
                    ));
                }
                d
            }
        };
        Ok(match affinity {
            Some(RawAffinity::ClientIp) => Some(ClientAffinity { timeout }),
            None | Some(RawAffinity::None) => {
                if timeout_raw.is_some() {
                    return Err(self.err(
                        path.key("affinity_timeout"),
                        "affinity_timeout needs affinity: client_ip",
                    ));
                }
                None
            }
        })
    }

    fn health_check(&self, h: RawHealthCheck, path: &FieldPath) -> Checked<HealthCheck> {
        let port = match h.port {
            None => None,
            Some(p) => Some(self.port(p, || path.key("port"))?),
        };
        let kind = match h.kind {
            RawCheckType::Tcp => {
                if h.path.is_some() {
                    return Err(self.err(path.key("path"), "only http checks have a path"));
                }
                if h.expect_status.is_some() {
                    return Err(self.err(
                        path.key("expect_status"),
                        "only http checks have an expected status",
                    ));
                }
                CheckKind::Tcp { port }
            }
            RawCheckType::Http => {
                let check_path = h.path.unwrap_or_else(|| "/".to_owned());
                // It goes into the request line as is.
                if !check_path.starts_with('/') || !check_path.bytes().all(|b| b.is_ascii_graphic())
                {
                    return Err(self.err(
                        path.key("path"),
                        format!(
                            "{check_path:?} is not an HTTP path (it starts with '/' and has \
                             no spaces or control characters)"
                        ),
                    ));
                }
                let expect_status = match h.expect_status {
                    None => 200,
                    Some(s @ 100..=599) => s as u16,
                    Some(s) => {
                        return Err(self.err(
                            path.key("expect_status"),
                            format!("{s} is not an HTTP status (100 to 599)"),
                        ))
                    }
                };
                CheckKind::Http {
                    port,
                    path: check_path,
                    expect_status,
                }
            }
        };
        let interval = match &h.interval {
            None => DEFAULT_CHECK_INTERVAL,
            Some(s) => self.duration(s, || path.key("interval"))?,
        };
        if interval < MIN_CHECK_INTERVAL {
            return Err(self.err(
                path.key("interval"),
                format!(
                    "{} is shorter than {}",
                    humantime::format_duration(interval),
                    humantime::format_duration(MIN_CHECK_INTERVAL)
                ),
            ));
        }
        let timeout = match &h.timeout {
            None => interval / 2,
            Some(s) => self.duration(s, || path.key("timeout"))?,
        };
        if timeout.is_zero() || timeout > interval {
            return Err(self.err(
                path.key("timeout"),
                format!(
                    "timeout {} must be above 0 and at most the interval ({})",
                    humantime::format_duration(timeout),
                    humantime::format_duration(interval)
                ),
            ));
        }
        let rise = match h.rise {
            None => DEFAULT_RISE,
            Some(n) => self.count(n, || path.key("rise"))?,
        };
        let fall = match h.fall {
            None => DEFAULT_FALL,
            Some(n) => self.count(n, || path.key("fall"))?,
        };
        Ok(HealthCheck {
            kind,
            interval,
            timeout,
            rise,
            fall,
        })
    }
}

pub(super) fn parse_port_range(s: &str) -> Result<(u16, u16), String> {
    let bad =
        || format!("{s:?} is not a port range MIN-MAX with {MIN_SNAT_PORT} <= MIN <= MAX <= 65535");
    let (lo, hi) = s.split_once('-').ok_or_else(bad)?;
    let lo: u16 = lo.trim().parse().map_err(|_| bad())?;
    let hi: u16 = hi.trim().parse().map_err(|_| bad())?;
    if lo < MIN_SNAT_PORT || lo > hi {
        return Err(bad());
    }
    Ok((lo, hi))
}

pub(super) fn family_name(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() {
        "IPv4"
    } else {
        "IPv6"
    }
}
