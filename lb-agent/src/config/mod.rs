//! The agent's configuration file (standalone mode): types, parsing and
//! validation. Every field is documented in docs/config.md.
//!
//! Parsing and validation are pure: `AgentConfig::parse(text)` either gives
//! a config that the data plane will accept or an error naming the field
//! and its line, and changes nothing.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use ipnet::IpNet;

pub use crate::podnet::PodInterfaces;
use crate::{
    dataplane::{BackendSpec, ServiceSpec},
    service::{
        parse_source_range, ranges_for, AgentCheck, Announce, BackendCgroup, Balance, CheckKind,
        ClientAffinity, DesiredBackend, DesiredService, HealthCheck, Mode, RemovedBackendFlows,
        DEFAULT_AFFINITY_TIMEOUT, MAX_AFFINITY_TIMEOUT,
    },
};

/// The whole file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentConfig {
    /// Interfaces the XDP program attaches to.
    pub interfaces: Vec<String>,
    /// Node address used as source by services in snat mode (per family).
    pub snat_ipv4: Option<Ipv4Addr>,
    pub snat_ipv6: Option<Ipv6Addr>,
    /// Port range the data plane allocates SNAT source ports from (inclusive).
    pub snat_ports: (u16, u16),
    /// Where /metrics, /healthz and /readyz are served.
    pub metrics_addr: SocketAddr,
    /// Per-backend series in `/metrics` (off on big clusters: six or more
    /// series per backend add up).
    pub backend_metrics: bool,
    /// XDP attach mode.
    pub xdp_mode: XdpAttachMode,
    /// The host side of this node's Pods, where the program also runs
    /// (generic mode) to translate local Pods' replies.
    pub pod_interfaces: PodInterfaces,
    /// Flow lifetimes after which a reply translation may be reused.
    pub tcp_timeout: Duration,
    pub tcp_closing_timeout: Duration,
    pub udp_timeout: Duration,
    /// Size of the kernel's Maglev pool (entries; two tables per service).
    /// Takes effect when the maps are created (first start or after cleanup).
    pub maglev_pool_entries: u32,
    /// Size of the flow table (entries, one per flow); likewise.
    pub flow_table_entries: u32,
    /// Flood mode: new flows a second on one CPU above which stateless NAT
    /// flows go untracked (`Dataplane::set_flood_threshold`); 0: off.
    pub flood_threshold: u32,
    /// Announcing VIPs through a BGP speaker; `None`: no announcements.
    pub bgp: Option<BgpConfig>,
    /// Services from a Kubernetes cluster, besides those in the file.
    pub kubernetes: Option<KubernetesConfig>,
    /// How often the load-aware services' weights are recomputed
    /// (`load_aware.interval`).
    pub load_interval: Duration,
    /// Where the cgroup hierarchies are mounted, for local backends' CPU
    /// (`load_aware.cgroup_root`).
    pub cgroup_root: PathBuf,
    /// Answering ARP/NDP for the VIPs (L2 mode); `None`: not answered.
    pub l2: Option<L2Config>,
    /// SNAT flows shared with the other nodes' agents.
    pub flow_sync: Option<FlowSyncConfig>,
    pub services: Vec<DesiredService>,
}

/// `load_aware.cgroup_root` when not set.
pub const DEFAULT_CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// `load_aware.interval` when not set: fast enough to follow a backend
/// that slows within seconds, slow enough that the smoothing sees a few
/// hundred flows per step at moderate rates.
pub const DEFAULT_LOAD_INTERVAL: Duration = Duration::from_secs(1);

/// The `kubernetes` section: where the cluster is and which Services are ours.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubernetesConfig {
    /// A kubeconfig file; `None`: in-cluster config, else $KUBECONFIG or
    /// ~/.kube/config (kube-rs's inference).
    pub kubeconfig: Option<PathBuf>,
    /// This node's name (for `externalTrafficPolicy: Local` and the node's
    /// exclusion label); `None`: $NODE_NAME, else the host name.
    pub node_name: Option<String>,
    /// `spec.loadBalancerClass` of the Services xlb serves.
    pub load_balancer_class: String,
    /// Also serve LoadBalancer Services that set no class.
    pub default_class: bool,
    /// How Kubernetes Services are forwarded unless their `xlb.dev/mode`
    /// annotation says otherwise.
    pub mode: Mode,
    /// Take part in electing the agent that hands out LoadBalancer IPs.
    pub allocate_addresses: bool,
    /// The Lease the allocating agent holds.
    pub lease_namespace: String,
    pub lease_name: String,
    pub lease_duration: Duration,
}

/// The `bgp` section: which speaker, and what to announce.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BgpConfig {
    pub speaker: Speaker,
    /// This node's address as next hop; `None`: the first address of the
    /// first attached interface of that family.
    pub next_hop_ipv4: Option<Ipv4Addr>,
    pub next_hop_ipv6: Option<Ipv6Addr>,
    pub communities: Vec<(u16, u16)>,
    /// Large communities (RFC 8092) added to every announcement.
    pub large_communities: Vec<(u32, u32, u32)>,
    pub local_pref: Option<u32>,
    /// On shutdown: withdraw, wait this long for the router to converge, exit.
    pub drain_time: Duration,
    /// On leaving, before the withdrawal: announce with GRACEFUL_SHUTDOWN
    /// (RFC 8326) and wait this long for the routers to move traffic away.
    /// Zero: off.
    pub graceful_shutdown: Duration,
    /// How often the whole announced set is re-applied (heals a speaker
    /// restart even when no event says so).
    pub resync_interval: Duration,
    /// This node's AS number, where the agent writes the sessions (BIRD);
    /// gobgpd takes its own from its global config.
    pub asn: Option<u32>,
    /// The BGP neighbours the agent configures in the speaker (GoBGP, BIRD);
    /// empty: the speaker's own configuration holds them.
    pub peers: Vec<BgpPeer>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Speaker {
    GoBgp {
        address: String,
    },
    Bird {
        routes_file: PathBuf,
        /// The file of `protocol bgp` blocks the agent writes for
        /// [`BgpConfig::peers`], included by BIRD's configuration.
        peers_file: PathBuf,
        socket: PathBuf,
        protocol: String,
    },
    ExaBgp {
        pipe_dir: PathBuf,
        pipe_name: String,
    },
    Frr {
        /// The directory of FRR's vty sockets (`vtysh --vty_socket`).
        socket_dir: PathBuf,
        /// Where `write memory` saves FRR's configuration (`vtysh --config_dir`).
        config_dir: PathBuf,
        vtysh: PathBuf,
    },
}

/// A BGP neighbour the agent configures in its speaker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BgpPeer {
    pub address: IpAddr,
    pub asn: u32,
    /// The peer's BGP port; `None`: 179.
    pub port: Option<u16>,
    pub hold_time: Duration,
    pub keepalive: Duration,
    pub password: Option<String>,
    pub multihop_ttl: Option<u8>,
    /// BGP graceful restart's restart time; `None`: off.
    pub graceful_restart: Option<Duration>,
    /// Bidirectional Forwarding Detection on the session; `None`: off.
    pub bfd: Option<Bfd>,
}

/// A BFD session's timers (RFC 5880): the peer is down when nothing came
/// for `multiplier` × the negotiated receive interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bfd {
    /// The shortest interval this node wants between received packets.
    pub min_rx: Duration,
    /// The shortest interval this node sends at.
    pub min_tx: Duration,
    pub multiplier: u8,
}

impl Bfd {
    /// The defaults: 100 ms both ways, 3 missed: down within 300 ms.
    pub const DEFAULT: Bfd = Bfd {
        min_rx: Duration::from_millis(100),
        min_tx: Duration::from_millis(100),
        multiplier: 3,
    };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpAttachMode {
    /// Driver (native) mode: the fast one; veth, most NICs.
    Native,
    /// Generic (skb) mode: works everywhere, slower.
    Generic,
}

// ---------------------------------------------------------------------------
// Defaults and limits (docs/config.md lists them too).

/// `metrics_addr` when the file sets none.
/// Default wait between withdrawing and exiting.
pub const DEFAULT_LOAD_BALANCER_CLASS: &str = "xlb.dev/xlb";
pub const DEFAULT_LEASE_NAME: &str = "xlb-address-allocator";
pub const DEFAULT_LEASE_NAMESPACE: &str = "xlb-system";
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
pub const DEFAULT_DRAIN_TIME: Duration = Duration::from_secs(5);
/// Default period of re-applying the announced set.
pub const DEFAULT_RESYNC_INTERVAL: Duration = Duration::from_secs(5);
/// Where gobgpd serves its gRPC API by default.
pub const DEFAULT_GOBGP_ADDRESS: &str = "http://127.0.0.1:50051";
pub const DEFAULT_METRICS_ADDR: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 9469);
pub const DEFAULT_TCP_TIMEOUT: Duration = Duration::from_secs(900);
pub const DEFAULT_TCP_CLOSING_TIMEOUT: Duration = Duration::from_secs(10);
pub const DEFAULT_UDP_TIMEOUT: Duration = Duration::from_secs(60);
/// Lowest port `snat_ports` may start at (below are the privileged ports).
pub const MIN_SNAT_PORT: u16 = 1024;
pub const MAX_WEIGHT: u32 = 1000;
pub const DEFAULT_CHECK_INTERVAL: Duration = Duration::from_secs(1);
pub const MIN_CHECK_INTERVAL: Duration = Duration::from_millis(100);
pub const DEFAULT_RISE: u32 = 2;
pub const DEFAULT_FALL: u32 = 3;
/// Longest interface name Linux accepts (IFNAMSIZ - 1).
const MAX_IFNAME: usize = 15;
const MAX_SERVICE_NAME: usize = 63;

// ---------------------------------------------------------------------------
// Errors.

/// Why a configuration file was rejected. `Display` gives the position and
/// the field, e.g. `line 7, services[0].backends[1].ip: "10.2.0.x" is not an
/// IP address`; it does not repeat the file name (the caller knows it).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the file: {source}")]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    /// Not YAML at all.
    #[error("line {line}, column {column}: YAML syntax error: {message}")]
    Syntax {
        line: usize,
        column: usize,
        message: String,
    },
    /// YAML, but not a valid configuration: `field` is the dotted path of
    /// the offending value (`services[1].backends[0].ip`; `(top level)` for
    /// the document itself), `line` its (1-based) line.
    #[error("line {line}, {field}: {message}")]
    Invalid {
        line: usize,
        field: String,
        message: String,
    },
}

impl ConfigError {
    /// The 1-based line the error is about, if it is about the text.
    pub fn line(&self) -> Option<usize> {
        match self {
            ConfigError::Read { .. } => None,
            ConfigError::Syntax { line, .. } | ConfigError::Invalid { line, .. } => Some(*line),
        }
    }

    /// The dotted path of the offending field, if there is one.
    pub fn field(&self) -> Option<&str> {
        match self {
            ConfigError::Invalid { field, .. } => Some(field),
            _ => None,
        }
    }
}

// ---------------------------------------------------------------------------
// Parsing and validation.

/// The streaming parser, set to accept what serde_yaml accepts: YAML 1.2
/// booleans only, duplicate keys and merge keys refused. No node budget: the
/// file is the operator's own, and a large one is the point.
fn streaming_options() -> serde_saphyr::Options {
    let mut o = serde_saphyr::Options::default();
    o.budget = None;
    o.strict_booleans = true;
    o.duplicate_keys = serde_saphyr::DuplicateKeyPolicy::Error;
    o.merge_keys = serde_saphyr::MergeKeyPolicy::Error;
    o.with_snippet = false;
    o
}

impl AgentConfig {
    /// Parses and validates a configuration file's text.
    ///
    /// serde-saphyr deserializes as it parses, so a file of 100,000
    /// backends costs little more than its text; serde_yaml would first
    /// hold every YAML event of the document (about 25 times the text).
    /// Only when the text is refused does serde_yaml parse it again, because
    /// its errors name the field path (`services[3].backends[0].port`),
    /// which the messages are built on.
    pub fn parse(text: &str) -> Result<AgentConfig, ConfigError> {
        let raw: RawConfig = serde_saphyr::from_str_with_options(text, streaming_options())
            .map_err(|e| match serde_yaml::from_str::<RawConfig>(text) {
                Err(detailed) => yaml_error(text, detailed),
                // Refused by one parser only: report what the streaming one said.
                Ok(_) => {
                    let (line, column) = e
                        .location()
                        .map_or((1, 1), |l| (l.line() as usize, l.column() as usize));
                    ConfigError::Syntax {
                        line,
                        column,
                        message: e.to_string(),
                    }
                }
            })?;
        Validator { text }.config(raw)
    }

    /// Reads, parses and validates the file at `path`.
    pub fn load(path: &Path) -> Result<AgentConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            file: path.to_owned(),
            source,
        })?;
        Self::parse(&text)
    }

    /// What the data plane should program, one spec per service, in file
    /// order. Every spec passes `ServiceSpec::validate`.
    pub fn service_specs(&self) -> Vec<ServiceSpec> {
        self.services.iter().map(|s| self.service_spec(s)).collect()
    }

    /// The data-plane spec of one service of this config.
    pub fn service_spec(&self, s: &DesiredService) -> ServiceSpec {
        let snat = match s.mode {
            Mode::Nat => None,
            Mode::Snat => match s.vip {
                IpAddr::V4(_) => self.snat_ipv4.map(IpAddr::V4),
                IpAddr::V6(_) => self.snat_ipv6.map(IpAddr::V6),
            },
        };
        ServiceSpec {
            vip: s.vip,
            port: s.port,
            protocol: s.protocol,
            snat,
            table_size: s.table_size,
            source_ranges: s.source_ranges.as_ref().map(|r| ranges_for(s.vip, r)),
            client_affinity: s.affinity.is_some(),
            // Affinity places a client's flows by its address alone.
            least_loaded: s.balance.is_load_aware() && s.affinity.is_none(),
            // Another node's flow comes with the exchange: hold it, rather
            // than translate it afresh into a reset.
            hold_unknown_flows: self.flow_sync.is_some(),
            new_flow_limit: s.new_flow_limit,
            backends: s
                .backends
                .iter()
                .map(|b| BackendSpec {
                    addr: b.addr(),
                    weight: b.weight,
                })
                .collect(),
        }
    }

    /// The data plane's global settings (SNAT ports, flow timeouts).
    pub fn dataplane_config(&self) -> lb_common::Config {
        let secs = |d: Duration| u32::try_from(d.as_secs()).unwrap_or(u32::MAX);
        lb_common::Config {
            snat_port_min: self.snat_ports.0,
            snat_port_max: self.snat_ports.1,
            tcp_timeout_s: secs(self.tcp_timeout),
            tcp_closing_timeout_s: secs(self.tcp_closing_timeout),
            udp_timeout_s: secs(self.udp_timeout),
        }
    }
}

mod flow_sync;
mod l2;
mod locate;
mod raw;
mod validate;

/// This node's name when the file gives none: `$NODE_NAME` (the Helm chart
/// sets it from the downward API: the Kubernetes Node's name), else the
/// host name.
pub fn this_node() -> Option<String> {
    let env = std::env::var("NODE_NAME").ok();
    let host = || std::fs::read_to_string("/proc/sys/kernel/hostname").ok();
    env.filter(|n| !n.trim().is_empty())
        .or_else(host)
        .map(|n| n.trim().to_string())
        .filter(|n| !n.is_empty())
}

/// `lb-agent --metrics-addr`: an address:port as in the file, or an IPv6
/// address without brackets before the last `:PORT`, so that the chart's
/// `$(HOST_IP):9469` works on an IPv6 node too.
pub fn parse_listen_addr(s: &str) -> Result<SocketAddr, String> {
    let s = s.trim();
    if let Ok(addr) = s.parse() {
        return Ok(addr);
    }
    s.rsplit_once(':')
        .and_then(|(ip, port)| Some(SocketAddr::new(ip.parse().ok()?, port.parse().ok()?)))
        .ok_or_else(|| {
            format!("{s:?} is not an address:port (e.g. 10.0.0.11:9469, \"[::1]:9469\")")
        })
}

pub use self::flow_sync::{FlowSyncConfig, FlowSyncReload, DEFAULT_FLOW_SYNC_PORT};
pub(crate) use self::raw::{RawBfd, RawPeer};

/// A large community written `GLOBAL:LOCAL1:LOCAL2` (each 0 to 4294967295).
pub(crate) fn parse_large_community(s: &str) -> Option<(u32, u32, u32)> {
    let mut parts = s.split(':').map(|p| p.trim().parse::<u32>());
    let c = (
        parts.next()?.ok()?,
        parts.next()?.ok()?,
        parts.next()?.ok()?,
    );
    parts.next().is_none().then_some(c)
}

/// A standard community written `ASN:VALUE` (each 0 to 65535).
pub(crate) fn parse_community(s: &str) -> Option<(u16, u16)> {
    let (a, v) = s.split_once(':')?;
    Some((a.trim().parse().ok()?, v.trim().parse().ok()?))
}

/// Checks one peer as `bgp.peers[]` is checked (a BGPPeer object's spec
/// converted to those fields); the error names the field.
pub(crate) fn check_peer(raw: RawPeer) -> Result<BgpPeer, String> {
    validate::Validator { text: "" }
        .bgp_peers(vec![raw])
        .map(|mut peers| peers.remove(0))
        .map_err(|e| match e {
            ConfigError::Invalid { field, message, .. } => {
                format!("{}: {message}", field.trim_start_matches("bgp.peers[0]."))
            }
            e => e.to_string(),
        })
}

pub use self::l2::{majority, L2Config, DEFAULT_L2_PORT};
use self::{locate::yaml_error, raw::RawConfig, validate::Validator};
#[cfg(test)]
mod tests;
