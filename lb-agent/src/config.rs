//! The agent's configuration file (standalone mode): types, parsing and
//! validation. Every field is documented in docs/config.md.
//!
//! Parsing and validation are pure: `AgentConfig::parse(text)` either gives
//! a config that the data plane will accept or an error naming the field
//! and its line, and changes nothing.

use std::{
    collections::HashMap,
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use ipnet::IpNet;
use lb_common::maglev;
use serde::{
    de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor},
    Deserialize,
};

use crate::dataplane::{BackendSpec, Protocol, ServiceSpec};

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
    /// XDP attach mode.
    pub xdp_mode: XdpAttachMode,
    /// Flow lifetimes after which a reply translation may be reused.
    pub tcp_timeout: Duration,
    pub tcp_closing_timeout: Duration,
    pub udp_timeout: Duration,
    /// Size of the kernel's Maglev pool (entries; two tables per service).
    /// Takes effect when the maps are created (first start or after cleanup).
    pub maglev_pool_entries: u32,
    /// Announcing VIPs through a BGP speaker; `None`: no announcements.
    pub bgp: Option<BgpConfig>,
    /// Services from a Kubernetes cluster, besides those in the file.
    pub kubernetes: Option<KubernetesConfig>,
    pub services: Vec<ServiceConfig>,
}

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
    pub local_pref: Option<u32>,
    /// On shutdown: withdraw, wait this long for the router to converge, exit.
    pub drain_time: Duration,
    /// How often the whole announced set is re-applied (heals a speaker
    /// restart even when no event says so).
    pub resync_interval: Duration,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Speaker {
    GoBgp {
        address: String,
        peers: Vec<BgpPeer>,
    },
    Bird {
        routes_file: PathBuf,
        socket: PathBuf,
        protocol: String,
    },
    ExaBgp {
        pipe_dir: PathBuf,
        pipe_name: String,
    },
}

/// A BGP neighbour the agent configures in GoBGP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BgpPeer {
    pub address: IpAddr,
    pub asn: u32,
    pub hold_time: Duration,
    pub keepalive: Duration,
    pub password: Option<String>,
    pub multihop_ttl: Option<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XdpAttachMode {
    /// Driver (native) mode: the fast one; veth, most NICs.
    Native,
    /// Generic (skb) mode: works everywhere, slower.
    Generic,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mode {
    /// DNAT only; the client address is kept.
    Nat,
    /// DNAT + SNAT to the node's address.
    Snat,
}

/// What happens to flows on a backend that leaves the service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemovedBackendFlows {
    /// Kept until they end (as Kubernetes terminating endpoints are).
    Keep,
    /// Their connection-table entries are deleted: the next packet goes to a
    /// new backend (TCP connections break, which is the point).
    Reset,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceConfig {
    pub name: String,
    pub vip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    pub mode: Mode,
    pub backends: Vec<BackendConfig>,
    pub health_check: Option<HealthCheck>,
    /// Maglev table size (prime); `None`: chosen from the backend count.
    pub table_size: Option<u32>,
    pub removed_backend_flows: RemovedBackendFlows,
    /// Clients allowed to connect; `None`: everyone. `Some` and empty: no
    /// one (a Kubernetes Service whose ranges are all of the other family).
    pub source_ranges: Option<Vec<IpNet>>,
    /// Session affinity by client address, and its (reported) timeout.
    pub affinity: Option<ClientAffinity>,
}

/// `affinity: client_ip` / `sessionAffinity: ClientIP`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientAffinity {
    /// Kubernetes' `timeoutSeconds` (1 s to 24 h; default 3 h). xlb's
    /// affinity is computed from the client address rather than remembered,
    /// so it does not lapse: docs/config.md explains.
    pub timeout: Duration,
}

/// Kubernetes' default `sessionAffinityConfig.clientIP.timeoutSeconds`.
pub const DEFAULT_AFFINITY_TIMEOUT: Duration = Duration::from_secs(10800);
/// Kubernetes' largest `timeoutSeconds`.
pub const MAX_AFFINITY_TIMEOUT: Duration = Duration::from_secs(86400);

/// Parses one source range: a CIDR, or a single address (a /32 or /128).
/// `strict` refuses host bits (the config file); otherwise they are cleared,
/// as kube-proxy does with what the API server accepted.
pub fn parse_source_range(entry: &str, strict: bool) -> Result<IpNet, String> {
    let entry = entry.trim();
    let net = match entry.parse::<IpNet>() {
        Ok(n) => n,
        Err(_) => match entry.parse::<IpAddr>() {
            Ok(ip) => IpNet::from(ip),
            Err(_) => return Err(format!("{entry:?} is not a CIDR (e.g. 203.0.113.0/24)")),
        },
    };
    if strict && net.trunc() != net {
        return Err(format!(
            "{entry:?} has host bits set (the network is {})",
            net.trunc()
        ));
    }
    Ok(net.trunc())
}

/// The ranges of `ranges` of the family of `vip`, sorted and deduplicated.
pub fn ranges_for(vip: IpAddr, ranges: &[IpNet]) -> Vec<IpNet> {
    let mut out: Vec<IpNet> = ranges
        .iter()
        .filter(|n| n.addr().is_ipv4() == vip.is_ipv4())
        .copied()
        .collect();
    out.sort();
    out.dedup();
    out
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendConfig {
    pub ip: IpAddr,
    pub port: u16,
    pub weight: u32,
}

impl BackendConfig {
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.ip, self.port)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthCheck {
    pub kind: CheckKind,
    pub interval: Duration,
    pub timeout: Duration,
    /// Consecutive successes that bring a backend (back) in.
    pub rise: u32,
    /// Consecutive failures that take it out.
    pub fall: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CheckKind {
    /// A TCP connect to the backend's address (or `port` if set).
    Tcp { port: Option<u16> },
    /// An HTTP/1.1 GET of `path`; healthy when the status is `expect_status`.
    Http {
        port: Option<u16>,
        path: String,
        expect_status: u16,
    },
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
// The file as written: plain values, checked and converted by `Validator`.
// `expecting` keeps Rust type names out of "invalid type" messages.

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of configuration fields")]
struct RawConfig {
    interfaces: Vec<String>,
    snat_ipv4: Option<String>,
    snat_ipv6: Option<String>,
    snat_ports: Option<String>,
    metrics_addr: Option<String>,
    xdp_mode: Option<RawXdpMode>,
    timeouts: Option<RawTimeouts>,
    maglev_pool_entries: Option<u32>,
    bgp: Option<RawBgp>,
    kubernetes: Option<RawKubernetes>,
    #[serde(default)]
    services: Vec<RawService>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a kubernetes mapping (kubeconfig, node_name, load_balancer_class, ...)"
)]
struct RawKubernetes {
    kubeconfig: Option<String>,
    node_name: Option<String>,
    load_balancer_class: Option<String>,
    default_class: Option<bool>,
    mode: Option<RawMode>,
    allocate_addresses: Option<bool>,
    lease_namespace: Option<String>,
    lease_name: Option<String>,
    lease_duration: Option<String>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a bgp mapping (driver, next hops, ...)"
)]
struct RawBgp {
    driver: RawDriver,
    next_hop_ipv4: Option<String>,
    next_hop_ipv6: Option<String>,
    #[serde(default)]
    communities: Vec<String>,
    local_pref: Option<u32>,
    drain_time: Option<String>,
    resync_interval: Option<String>,
    gobgp: Option<RawGoBgp>,
    bird: Option<RawBird>,
    exabgp: Option<RawExaBgp>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "gobgp, bird or exabgp")]
enum RawDriver {
    Gobgp,
    Bird,
    Exabgp,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a gobgp mapping (address, peers)")]
struct RawGoBgp {
    address: Option<String>,
    #[serde(default)]
    peers: Vec<RawPeer>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a peer (address, asn, ...)")]
struct RawPeer {
    address: String,
    asn: u32,
    hold_time: Option<String>,
    keepalive: Option<String>,
    password: Option<String>,
    multihop_ttl: Option<u8>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a bird mapping (routes_file, socket, protocol)"
)]
struct RawBird {
    routes_file: Option<String>,
    socket: Option<String>,
    protocol: Option<String>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an exabgp mapping (pipe_dir, pipe_name)"
)]
struct RawExaBgp {
    pipe_dir: Option<String>,
    pipe_name: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "native or generic")]
enum RawXdpMode {
    Native,
    Generic,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with tcp, tcp_closing, udp"
)]
struct RawTimeouts {
    tcp: Option<String>,
    tcp_closing: Option<String>,
    udp: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a service (a mapping)")]
struct RawService {
    name: String,
    vip: String,
    port: i64,
    protocol: Option<RawProtocol>,
    mode: Option<RawMode>,
    table_size: Option<i64>,
    on_backend_removed: Option<RawRemoved>,
    backends: Vec<RawBackend>,
    health_check: Option<RawHealthCheck>,
    source_ranges: Option<Vec<String>>,
    affinity: Option<RawAffinity>,
    affinity_timeout: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "none or client_ip")]
enum RawAffinity {
    None,
    ClientIp,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "tcp or udp")]
enum RawProtocol {
    Tcp,
    Udp,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "nat or snat")]
enum RawMode {
    Nat,
    Snat,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "keep or reset")]
enum RawRemoved {
    Keep,
    Reset,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a backend (a mapping with ip, port, weight)"
)]
struct RawBackend {
    ip: String,
    port: i64,
    weight: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a health check (a mapping)")]
struct RawHealthCheck {
    #[serde(rename = "type")]
    kind: RawCheckType,
    port: Option<i64>,
    path: Option<String>,
    expect_status: Option<i64>,
    interval: Option<String>,
    timeout: Option<String>,
    rise: Option<i64>,
    fall: Option<i64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "tcp or http")]
enum RawCheckType {
    Tcp,
    Http,
}

// ---------------------------------------------------------------------------
// Field paths and their lines.

#[derive(Clone, Copy, Debug)]
enum Seg {
    Key(&'static str),
    Index(usize),
}

/// A dotted path into the document, e.g. `services[1].backends[0].ip`.
#[derive(Clone, Debug, Default)]
struct FieldPath(Vec<Seg>);

impl FieldPath {
    fn key(&self, key: &'static str) -> Self {
        let mut v = self.0.clone();
        v.push(Seg::Key(key));
        FieldPath(v)
    }

    fn index(&self, i: usize) -> Self {
        let mut v = self.0.clone();
        v.push(Seg::Index(i));
        FieldPath(v)
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str(TOP_LEVEL);
        }
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                Seg::Key(k) if i == 0 => f.write_str(k)?,
                Seg::Key(k) => write!(f, ".{k}")?,
                Seg::Index(n) => write!(f, "[{n}]")?,
            }
        }
        Ok(())
    }
}

const TOP_LEVEL: &str = "(top level)";

/// The line of the value at `path` in `text` (1-based); for a path that is
/// not in the document, the line of its deepest ancestor that is.
///
/// serde_yaml gives no positions to `Deserialize` impls, only to errors, so
/// this walks the document down `path` and fails on purpose there: the
/// error carries the position of the value it failed on. This re-parses the
/// text, which only happens when there is an error to report.
fn locate(text: &str, path: &[Seg]) -> usize {
    match Probe(path).deserialize(serde_yaml::Deserializer::from_str(text)) {
        Err(e) => e.location().map_or(1, |l| l.line()),
        Ok(()) => 1,
    }
}

struct Probe<'p>(&'p [Seg]);

const PROBE: &str = "(probe)";

impl<'de> DeserializeSeed<'de> for Probe<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Probe<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PROBE)
    }

    // Scalars: the default `visit_*` fail, at the scalar: what we want.

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        if let Some((Seg::Key(want), rest)) = self.0.split_first() {
            // The last key fails on itself: `backends:` rather than the
            // first line of its value.
            let seed = KeyProbe {
                want,
                fail: rest.is_empty(),
            };
            while let Some(found) = map.next_key_seed(seed)? {
                if found {
                    return map.next_value_seed(Probe(rest));
                }
                map.next_value::<IgnoredAny>()?;
            }
        }
        Err(de::Error::custom(PROBE))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        if let Some((Seg::Index(want), rest)) = self.0.split_first() {
            for _ in 0..*want {
                if seq.next_element::<IgnoredAny>()?.is_none() {
                    return Err(de::Error::custom(PROBE));
                }
            }
            if seq.next_element_seed(Probe(rest))?.is_some() {
                return Ok(());
            }
        }
        Err(de::Error::custom(PROBE))
    }
}

/// A mapping key: is it `want`? With `fail`, finding it is an error (at
/// the key).
#[derive(Clone, Copy)]
struct KeyProbe<'w> {
    want: &'w str,
    fail: bool,
}

impl<'de> DeserializeSeed<'de> for KeyProbe<'_> {
    type Value = bool;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<bool, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeyProbe<'_> {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(PROBE)
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<bool, E> {
        match key == self.want {
            true if self.fail => Err(E::custom(PROBE)),
            found => Ok(found),
        }
    }
}

/// Turns a serde_yaml error (syntax, unknown field, wrong type, missing
/// field) into a `ConfigError` with the line and dotted path.
fn yaml_error(text: &str, e: serde_yaml::Error) -> ConfigError {
    let position = |e: &serde_yaml::Error| e.location().map_or((1, 1), |l| (l.line(), l.column()));
    // serde_yaml deserializes what libyaml parsed before a syntax error, so
    // a schema error may come first: look for a syntax error on its own.
    if let Err(e) = serde_yaml::from_str::<IgnoredAny>(text) {
        let (line, column) = position(&e);
        return ConfigError::Syntax {
            line,
            column,
            message: e
                .to_string()
                .replacen(&format!(" at line {line} column {column}"), "", 1),
        };
    }
    let (line, column) = position(&e);
    let full = e.to_string();
    let at = format!(" at line {line} column {column}");
    let msg = full.strip_suffix(&at).unwrap_or(&full);
    // serde_yaml writes "path: message" unless the path is the root.
    let (mut field, msg) = match msg.split_once(": ") {
        Some((p, m)) if !p.is_empty() && !p.contains([' ', '`', '"']) => (p.to_owned(), m),
        _ => (String::new(), msg),
    };
    // Unknown and missing fields are reported on their parent: name them.
    for lead in ["unknown field `", "missing field `", "duplicate field `"] {
        if let Some(name) = msg.strip_prefix(lead).and_then(|r| r.split('`').next()) {
            if !field.is_empty() {
                field.push('.');
            }
            field.push_str(name);
        }
    }
    if field.is_empty() {
        field = TOP_LEVEL.to_owned();
    }
    ConfigError::Invalid {
        line,
        field,
        message: msg.replace("expected i64", "expected an integer"),
    }
}

// ---------------------------------------------------------------------------
// Parsing and validation.

impl AgentConfig {
    /// Parses and validates a configuration file's text.
    pub fn parse(text: &str) -> Result<AgentConfig, ConfigError> {
        let raw: RawConfig = serde_yaml::from_str(text).map_err(|e| yaml_error(text, e))?;
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
    pub fn service_spec(&self, s: &ServiceConfig) -> ServiceSpec {
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

struct Validator<'t> {
    text: &'t str,
}

type Checked<T> = Result<T, ConfigError>;

fn root() -> FieldPath {
    FieldPath::default()
}

impl Validator<'_> {
    fn line(&self, path: &FieldPath) -> usize {
        locate(self.text, &path.0)
    }

    fn err(&self, path: FieldPath, message: impl Into<String>) -> ConfigError {
        ConfigError::Invalid {
            line: self.line(&path),
            field: path.to_string(),
            message: message.into(),
        }
    }

    fn config(&self, raw: RawConfig) -> Checked<AgentConfig> {
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
        let t = raw.timeouts.unwrap_or(RawTimeouts {
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
        let bgp = match raw.bgp {
            None => None,
            Some(b) => Some(self.bgp(b)?),
        };
        let kubernetes = match raw.kubernetes {
            None => None,
            Some(k) => Some(self.kubernetes(k)?),
        };
        let mut services: Vec<ServiceConfig> = Vec::with_capacity(raw.services.len());
        // name -> index; (vip, port, protocol) -> index
        let mut names: HashMap<String, usize> = HashMap::with_capacity(raw.services.len());
        let mut vips: HashMap<(IpAddr, u16, Protocol), usize> =
            HashMap::with_capacity(raw.services.len());
        for (i, rs) in raw.services.into_iter().enumerate() {
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
                        protocol_name(s.protocol),
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
        Ok(AgentConfig {
            interfaces,
            snat_ipv4,
            snat_ipv6,
            snat_ports,
            metrics_addr,
            xdp_mode,
            tcp_timeout,
            tcp_closing_timeout,
            udp_timeout,
            maglev_pool_entries,
            bgp,
            kubernetes,
            services,
        })
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
            let parsed = c
                .split_once(':')
                .and_then(|(a, v)| Some((a.trim().parse().ok()?, v.trim().parse().ok()?)));
            match parsed {
                Some(p) => communities.push(p),
                None => {
                    return Err(self.err(
                        path().key("communities").index(i),
                        format!("{c:?} is not a community ASN:VALUE (each 0 to 65535)"),
                    ))
                }
            }
        }
        let dur = |v: &Option<String>, key: &'static str, default: Duration| match v {
            None => Ok(default),
            Some(s) => self.duration(s, || path().key(key)),
        };
        let drain_time = dur(&b.drain_time, "drain_time", DEFAULT_DRAIN_TIME)?;
        let resync_interval = dur(
            &b.resync_interval,
            "resync_interval",
            DEFAULT_RESYNC_INTERVAL,
        )?;
        if resync_interval < Duration::from_millis(100) {
            return Err(self.err(path().key("resync_interval"), "must be at least 100ms"));
        }
        let speaker = match b.driver {
            RawDriver::Gobgp => {
                let g = b.gobgp.unwrap_or(RawGoBgp {
                    address: None,
                    peers: Vec::new(),
                });
                let mut peers = Vec::new();
                for (i, p) in g.peers.into_iter().enumerate() {
                    let pp = || path().key("gobgp").key("peers").index(i);
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
                    peers.push(BgpPeer {
                        address: self.ip(&p.address, || pp().key("address"))?,
                        asn: p.asn,
                        hold_time,
                        keepalive,
                        password: p.password,
                        multihop_ttl: p.multihop_ttl,
                    });
                }
                Speaker::GoBgp {
                    address: g
                        .address
                        .unwrap_or_else(|| DEFAULT_GOBGP_ADDRESS.to_string()),
                    peers,
                }
            }
            RawDriver::Bird => {
                let r = b.bird.unwrap_or(RawBird {
                    routes_file: None,
                    socket: None,
                    protocol: None,
                });
                Speaker::Bird {
                    routes_file: r
                        .routes_file
                        .unwrap_or_else(|| "/run/xlb/bird-routes".into())
                        .into(),
                    socket: r
                        .socket
                        .unwrap_or_else(|| "/run/bird/bird.ctl".into())
                        .into(),
                    protocol: r.protocol.unwrap_or_else(|| "xlb_vips".into()),
                }
            }
            RawDriver::Exabgp => {
                let e = b.exabgp.unwrap_or(RawExaBgp {
                    pipe_dir: None,
                    pipe_name: None,
                });
                Speaker::ExaBgp {
                    pipe_dir: e.pipe_dir.unwrap_or_else(|| "/run/exabgp".into()).into(),
                    pipe_name: e.pipe_name.unwrap_or_else(|| "exabgp".into()),
                }
            }
        };
        Ok(BgpConfig {
            speaker,
            next_hop_ipv4,
            next_hop_ipv6,
            communities,
            local_pref: b.local_pref,
            drain_time,
            resync_interval,
        })
    }

    fn interfaces(&self, raw: Vec<String>) -> Checked<Vec<String>> {
        let path = || root().key("interfaces");
        if raw.is_empty() {
            return Err(self.err(path(), "at least one interface is required"));
        }
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
                    format!("{name:?} is listed twice (also interfaces[{j}])"),
                ));
            }
        }
        Ok(raw)
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

    fn duration(&self, s: &str, path: impl FnOnce() -> FieldPath) -> Checked<Duration> {
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

    fn service(&self, rs: RawService, path: &FieldPath) -> Checked<ServiceConfig> {
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
            backends.push(BackendConfig {
                ip,
                port: bport,
                weight,
            });
        }
        let table_size = match rs.table_size {
            Some(m) => {
                let bad = |msg: String| self.err(path.key("table_size"), msg);
                let m32 = u32::try_from(m).map_err(|_| {
                    bad(format!(
                        "table size {m} is not a prime up to {}",
                        lb_common::MAX_MAGLEV_SIZE
                    ))
                })?;
                maglev::check_table_size(m32, backends.len()).map_err(|e| bad(e.to_string()))?;
                Some(m32)
            }
            None => {
                let m = maglev::default_table_size(backends.len());
                if maglev::check_table_size(m, backends.len()).is_err() {
                    return Err(self.err(
                        path.key("backends"),
                        format!(
                            "{} backends are too many: the largest Maglev table ({m}) \
                             holds at most {} (100 entries each)",
                            backends.len(),
                            m / 100
                        ),
                    ));
                }
                None
            }
        };
        let health_check = match rs.health_check {
            None => None,
            Some(h) => Some(self.health_check(h, &path.key("health_check"))?),
        };
        let source_ranges = match rs.source_ranges {
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
        };
        let timeout = match &rs.affinity_timeout {
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
        let affinity = match rs.affinity {
            Some(RawAffinity::ClientIp) => Some(ClientAffinity { timeout }),
            None | Some(RawAffinity::None) => {
                if rs.affinity_timeout.is_some() {
                    return Err(self.err(
                        path.key("affinity_timeout"),
                        "affinity_timeout needs affinity: client_ip",
                    ));
                }
                None
            }
        };
        Ok(ServiceConfig {
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

fn parse_port_range(s: &str) -> Result<(u16, u16), String> {
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

fn protocol_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
    }
}

fn family_name(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() {
        "IPv4"
    } else {
        "IPv6"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The example of docs/config.md, every field set.
    const FULL: &str = "\
interfaces: [eth0, eth1]
snat_ipv4: 10.0.0.1
snat_ipv6: fd00::1
snat_ports: 20000-29999
metrics_addr: 0.0.0.0:9469
xdp_mode: generic
timeouts: { tcp: 15m, tcp_closing: 10s, udp: 60s }
services:
  - name: web
    vip: 192.0.2.10
    port: 80
    protocol: tcp
    mode: nat
    table_size: 16381
    on_backend_removed: keep
    backends:
      - { ip: 10.2.0.2, port: 8080, weight: 1 }
      - { ip: 10.2.0.3, port: 8080, weight: 0 }
    health_check: { type: tcp, interval: 1s, timeout: 500ms, rise: 2, fall: 2 }
  - name: dns6
    vip: 2001:db8::53
    port: 53
    protocol: udp
    mode: snat
    on_backend_removed: reset
    backends:
      - ip: fd00::2
        port: 53
        weight: 1000
    health_check:
      type: http
      path: /healthz
      expect_status: 204
      port: 8081
      interval: 2s
      timeout: 1s
      rise: 3
      fall: 4
";

    /// Small and valid; the rejection tests break one thing in it.
    /// Line numbers matter: the tests assert them.
    const BASE: &str = "\
interfaces: [eth0]
snat_ipv4: 10.0.0.1
services:
  - name: web
    vip: 192.0.2.10
    port: 80
    backends:
      - { ip: 10.2.0.2, port: 8080 }
      - ip: 10.2.0.3
        port: 8080
  - name: api
    vip: 192.0.2.11
    port: 443
    backends:
      - { ip: 10.2.0.4, port: 8443 }
";

    fn v4(s: &str) -> IpAddr {
        IpAddr::V4(s.parse().unwrap())
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Replaces exactly one occurrence of `from` in `text`.
    fn edit(text: &str, from: &str, to: &str) -> String {
        assert_eq!(text.matches(from).count(), 1, "{from:?} must occur once");
        text.replacen(from, to, 1)
    }

    /// Asserts that `text` is rejected at `line` about `field`, with a
    /// message containing `needle`; returns the message.
    #[track_caller]
    fn rejects(text: &str, line: usize, field: &str, needle: &str) -> String {
        let e = AgentConfig::parse(text).expect_err("must be rejected");
        let msg = e.to_string();
        assert_eq!(e.line(), Some(line), "wrong line in {msg:?}");
        assert_eq!(e.field(), Some(field), "wrong field in {msg:?}");
        assert!(
            msg.starts_with(&format!("line {line}, {field}: ")),
            "bad format: {msg:?}"
        );
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
        msg
    }

    #[test]
    fn full_example() {
        let c = AgentConfig::parse(FULL).unwrap();
        let expected = AgentConfig {
            interfaces: vec!["eth0".into(), "eth1".into()],
            snat_ipv4: Some("10.0.0.1".parse().unwrap()),
            snat_ipv6: Some("fd00::1".parse().unwrap()),
            snat_ports: (20000, 29999),
            metrics_addr: "0.0.0.0:9469".parse().unwrap(),
            xdp_mode: XdpAttachMode::Generic,
            tcp_timeout: Duration::from_secs(900),
            tcp_closing_timeout: Duration::from_secs(10),
            udp_timeout: Duration::from_secs(60),
            maglev_pool_entries: lb_common::MAGLEV_POOL_ENTRIES,
            bgp: None,
            kubernetes: None,
            services: vec![
                ServiceConfig {
                    name: "web".into(),
                    vip: v4("192.0.2.10"),
                    port: 80,
                    protocol: Protocol::Tcp,
                    mode: Mode::Nat,
                    backends: vec![
                        BackendConfig {
                            ip: v4("10.2.0.2"),
                            port: 8080,
                            weight: 1,
                        },
                        BackendConfig {
                            ip: v4("10.2.0.3"),
                            port: 8080,
                            weight: 0,
                        },
                    ],
                    health_check: Some(HealthCheck {
                        kind: CheckKind::Tcp { port: None },
                        interval: Duration::from_secs(1),
                        timeout: Duration::from_millis(500),
                        rise: 2,
                        fall: 2,
                    }),
                    table_size: Some(16381),
                    removed_backend_flows: RemovedBackendFlows::Keep,
                    source_ranges: None,
                    affinity: None,
                },
                ServiceConfig {
                    name: "dns6".into(),
                    vip: ip("2001:db8::53"),
                    port: 53,
                    protocol: Protocol::Udp,
                    mode: Mode::Snat,
                    backends: vec![BackendConfig {
                        ip: ip("fd00::2"),
                        port: 53,
                        weight: 1000,
                    }],
                    health_check: Some(HealthCheck {
                        kind: CheckKind::Http {
                            port: Some(8081),
                            path: "/healthz".into(),
                            expect_status: 204,
                        },
                        interval: Duration::from_secs(2),
                        timeout: Duration::from_secs(1),
                        rise: 3,
                        fall: 4,
                    }),
                    table_size: None,
                    removed_backend_flows: RemovedBackendFlows::Reset,
                    source_ranges: None,
                    affinity: None,
                },
            ],
        };
        assert_eq!(c, expected);
        let dp = c.dataplane_config();
        assert_eq!(
            (dp.snat_port_min, dp.snat_port_max, dp.tcp_timeout_s),
            (20000, 29999, 900)
        );
        assert_eq!((dp.tcp_closing_timeout_s, dp.udp_timeout_s), (10, 60));
    }

    #[test]
    fn defaults() {
        let c = AgentConfig::parse(
            "interfaces: [eth0]\n\
             services:\n\
             - name: a\n  vip: 192.0.2.1\n  port: 53\n  backends: [{ ip: 10.0.0.1, port: 53 }]\n  \
               health_check: { type: http }\n",
        )
        .unwrap();
        assert_eq!(c.snat_ipv4, None);
        assert_eq!(c.snat_ipv6, None);
        assert_eq!(c.snat_ports, (10000, 32767));
        assert_eq!(c.metrics_addr, "127.0.0.1:9469".parse().unwrap());
        assert_eq!(c.xdp_mode, XdpAttachMode::Native);
        assert_eq!(c.tcp_timeout, Duration::from_secs(900));
        assert_eq!(c.tcp_closing_timeout, Duration::from_secs(10));
        assert_eq!(c.udp_timeout, Duration::from_secs(60));
        assert_eq!(c.dataplane_config(), lb_common::Config::default());
        let s = &c.services[0];
        assert_eq!(s.protocol, Protocol::Tcp);
        assert_eq!(s.mode, Mode::Nat);
        assert_eq!(s.table_size, None);
        assert_eq!(s.removed_backend_flows, RemovedBackendFlows::Keep);
        assert_eq!(s.backends[0].weight, 1);
        assert_eq!(
            s.health_check,
            Some(HealthCheck {
                kind: CheckKind::Http {
                    port: None,
                    path: "/".into(),
                    expect_status: 200
                },
                interval: Duration::from_secs(1),
                timeout: Duration::from_millis(500),
                rise: 2,
                fall: 3,
            })
        );
        // A tcp check with only an interval: timeout is half of it.
        let c = AgentConfig::parse(&edit(
            BASE,
            "    port: 443\n",
            "    port: 443\n    health_check: { type: tcp, interval: 10s }\n",
        ))
        .unwrap();
        let h = c.services[1].health_check.as_ref().unwrap();
        assert_eq!(h.kind, CheckKind::Tcp { port: None });
        assert_eq!(h.timeout, Duration::from_secs(5));
        // No services at all is valid (an idle agent).
        let c = AgentConfig::parse("interfaces: [eth0]\n").unwrap();
        assert!(c.services.is_empty());
    }

    #[test]
    fn base_is_valid() {
        let c = AgentConfig::parse(BASE).unwrap();
        assert_eq!(c.services.len(), 2);
        // Same VIP and port with another protocol is another service.
        let text = edit(
            BASE,
            "    vip: 192.0.2.11\n    port: 443\n",
            "    vip: 192.0.2.10\n    port: 80\n    protocol: udp\n",
        );
        AgentConfig::parse(&text).unwrap();
    }

    #[test]
    fn service_specs_validate() {
        for text in [FULL, BASE] {
            let c = AgentConfig::parse(text).unwrap();
            let specs = c.service_specs();
            assert_eq!(specs.len(), c.services.len());
            for spec in &specs {
                spec.validate().unwrap();
            }
        }
        let c = AgentConfig::parse(FULL).unwrap();
        let specs = c.service_specs();
        assert_eq!(specs[0].snat, None);
        assert_eq!(specs[0].table_size, Some(16381));
        assert_eq!(
            specs[0].backends,
            vec![
                BackendSpec {
                    addr: "10.2.0.2:8080".parse().unwrap(),
                    weight: 1
                },
                BackendSpec {
                    addr: "10.2.0.3:8080".parse().unwrap(),
                    weight: 0
                },
            ]
        );
        assert_eq!(specs[1].snat, Some(ip("fd00::1")));
        assert_eq!(specs[1].protocol, Protocol::Udp);
        assert_eq!(specs[1].table_size, None);
        // An IPv4 snat service gets the IPv4 address.
        let text = edit(BASE, "    port: 443\n", "    port: 443\n    mode: snat\n");
        let specs = AgentConfig::parse(&text).unwrap().service_specs();
        assert_eq!(specs[1].snat, Some(v4("10.0.0.1")));
        specs[1].validate().unwrap();
        // The largest service the default table takes.
        let mut text = String::from(
            "interfaces: [eth0]\nservices:\n- name: big\n  vip: 192.0.2.1\n  port: 80\n  backends:\n",
        );
        for j in 0..655 {
            text += &format!("  - {{ ip: 10.1.{}.{}, port: 80 }}\n", j / 256, j % 256);
        }
        let specs = AgentConfig::parse(&text).unwrap().service_specs();
        specs[0].validate().unwrap();
    }

    #[test]
    fn yaml_syntax_error() {
        let text = edit(BASE, "    vip: 192.0.2.11\n", "    vip: 192.0.2.11: 5\n");
        let e = AgentConfig::parse(&text).unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { .. }), "{e}");
        assert_eq!(e.line(), Some(12));
        assert_eq!(
            e.to_string(),
            "line 12, column 20: YAML syntax error: mapping values are not allowed in this context"
        );
        // Bad indentation: libyaml only notices on the next line; serde_yaml
        // would have reported a missing field of the service before it.
        let text = edit(BASE, "    port: 80\n", "    port: 80\n   vip: 1.2.3.4\n");
        let e = AgentConfig::parse(&text).unwrap_err();
        assert!(matches!(e, ConfigError::Syntax { line: 7, .. }), "{e}");
        assert!(
            e.to_string()
                .contains("did not find expected '-' indicator"),
            "{e}"
        );
        let text = edit(BASE, "    port: 80\n", "    port: 80\n\tvip: 1.2.3.4\n");
        let e = AgentConfig::parse(&text).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("line 7, column 1: YAML syntax error: found a tab"),
            "{e}"
        );
        let e = AgentConfig::parse("a: 1\n---\nb: 2\n").unwrap_err();
        assert!(e.to_string().contains("more than one document"), "{e}");
        let e = AgentConfig::parse("interfaces: *x\n").unwrap_err();
        assert!(
            e.to_string()
                .contains("line 1, column 13: YAML syntax error: unknown anchor"),
            "{e}"
        );
    }

    #[test]
    fn unknown_fields() {
        let text = edit(BASE, "port: 8080 }", "port: 8080, wieght: 2 }");
        rejects(
            &text,
            8,
            "services[0].backends[0].wieght",
            "unknown field `wieght`",
        );
        let text = edit(BASE, "snat_ipv4: 10.0.0.1\n", "snat_ip: 10.0.0.1\n");
        rejects(
            &text,
            2,
            "snat_ip",
            "unknown field `snat_ip`, expected one of",
        );
        let text = edit(
            BASE,
            "    port: 443\n",
            "    port: 443\n    health_check: { type: tcp, intreval: 1s }\n",
        );
        rejects(
            &text,
            14,
            "services[1].health_check.intreval",
            "unknown field",
        );
        let text = edit(
            BASE,
            "snat_ipv4: 10.0.0.1\n",
            "timeouts:\n  tcp: 1m\n  icmp: 1m\n",
        );
        rejects(&text, 4, "timeouts.icmp", "unknown field `icmp`");
        let text = edit(BASE, "    port: 443\n", "    port: 443\n    port: 444\n");
        rejects(&text, 11, "services[1].port", "duplicate field `port`");
    }

    #[test]
    fn wrong_types_and_missing_fields() {
        let text = edit(BASE, "    port: 80\n", "    port: http\n");
        rejects(
            &text,
            6,
            "services[0].port",
            "invalid type: string \"http\", expected an integer",
        );
        let text = edit(BASE, "interfaces: [eth0]", "interfaces: eth0");
        rejects(&text, 1, "interfaces", "invalid type");
        let text = edit(
            BASE,
            "    port: 443\n",
            "    port: 443\n    protocol: sctp\n",
        );
        rejects(
            &text,
            14,
            "services[1].protocol",
            "unknown variant `sctp`, expected `tcp` or `udp`",
        );
        let text = edit(BASE, "    port: 443\n", "    port: 443\n    mode: dsr\n");
        rejects(&text, 14, "services[1].mode", "unknown variant `dsr`");
        let text = edit(BASE, "snat_ipv4: 10.0.0.1\n", "xdp_mode: offload\n");
        rejects(&text, 2, "xdp_mode", "unknown variant `offload`");
        let text = edit(
            BASE,
            "    port: 443\n",
            "    port: 443\n    on_backend_removed: drop\n",
        );
        rejects(
            &text,
            14,
            "services[1].on_backend_removed",
            "unknown variant `drop`",
        );
        let text = edit(
            BASE,
            "    port: 443\n",
            "    port: 443\n    health_check: { type: icmp }\n",
        );
        rejects(
            &text,
            14,
            "services[1].health_check.type",
            "unknown variant `icmp`",
        );
        // Missing: reported at the mapping that lacks it.
        let text = edit(BASE, "    vip: 192.0.2.11\n", "");
        rejects(&text, 11, "services[1].vip", "missing field `vip`");
        let text = edit(BASE, "interfaces: [eth0]\n", "");
        rejects(&text, 1, "interfaces", "missing field `interfaces`");
        rejects("", 1, "interfaces", "missing field `interfaces`");
        let msg = rejects("- eth0\n", 1, "(top level)", "invalid type: sequence");
        assert!(
            msg.contains("expected a mapping of configuration fields"),
            "{msg}"
        );
        let text = edit(
            BASE,
            "  - name: api\n",
            "  - name: api\n    table_size: 1.5\n",
        );
        rejects(
            &text,
            12,
            "services[1].table_size",
            "invalid type: floating point",
        );
    }

    #[test]
    fn bad_addresses() {
        let text = edit(BASE, "      - ip: 10.2.0.3\n", "      - ip: 10.2.0.x\n");
        let msg = rejects(
            &text,
            9,
            "services[0].backends[1].ip",
            "\"10.2.0.x\" is not an IP address",
        );
        assert_eq!(
            msg,
            "line 9, services[0].backends[1].ip: \"10.2.0.x\" is not an IP address"
        );
        let text = edit(BASE, "    vip: 192.0.2.11\n", "    vip: 192.0.2.256\n");
        rejects(&text, 12, "services[1].vip", "is not an IP address");
        let text = edit(BASE, "    vip: 192.0.2.11\n", "    vip: 12\n");
        rejects(&text, 12, "services[1].vip", "\"12\" is not an IP address");
        let text = edit(BASE, "snat_ipv4: 10.0.0.1", "snat_ipv4: fd00::1");
        rejects(&text, 2, "snat_ipv4", "is not an IPv4 address");
        let text = edit(BASE, "snat_ipv4: 10.0.0.1", "snat_ipv6: 10.0.0.1");
        rejects(&text, 2, "snat_ipv6", "is not an IPv6 address");
        let text = edit(BASE, "snat_ipv4: 10.0.0.1", "metrics_addr: localhost:9469");
        rejects(&text, 2, "metrics_addr", "is not an address:port");
        let text = edit(BASE, "snat_ipv4: 10.0.0.1", "metrics_addr: \"[::1]:9469\"");
        assert_eq!(
            AgentConfig::parse(&text).unwrap().metrics_addr,
            "[::1]:9469".parse().unwrap()
        );
    }

    #[test]
    fn bad_ports() {
        let text = edit(BASE, "        port: 8080\n", "        port: 0\n");
        rejects(
            &text,
            10,
            "services[0].backends[1].port",
            "0 is not a port (1 to 65535)",
        );
        let text = edit(BASE, "        port: 8080\n", "        port: 70000\n");
        rejects(
            &text,
            10,
            "services[0].backends[1].port",
            "70000 is not a port",
        );
        let text = edit(BASE, "    port: 443\n", "    port: -1\n");
        rejects(&text, 13, "services[1].port", "-1 is not a port");
        let text = edit(
            BASE,
            "    port: 443\n",
            "    port: 443\n    health_check: { type: tcp, port: 65536 }\n",
        );
        rejects(
            &text,
            14,
            "services[1].health_check.port",
            "65536 is not a port",
        );
    }

    #[test]
    fn interfaces() {
        let text = edit(BASE, "interfaces: [eth0]", "interfaces: []");
        rejects(&text, 1, "interfaces", "at least one interface");
        let text = edit(
            BASE,
            "interfaces: [eth0]",
            "interfaces:\n  - eth0\n  - a-very-long-name0",
        );
        rejects(&text, 3, "interfaces[1]", "is not an interface name");
        let text = edit(BASE, "interfaces: [eth0]", "interfaces: [eth0, eth0]");
        rejects(&text, 1, "interfaces[1]", "listed twice");
        let text = edit(BASE, "interfaces: [eth0]", "interfaces: [\"et h0\"]");
        rejects(&text, 1, "interfaces[0]", "is not an interface name");
    }

    #[test]
    fn service_names() {
        let text = edit(BASE, "  - name: api\n", "  - name: web\n");
        let msg = rejects(
            &text,
            11,
            "services[1].name",
            "duplicate service name \"web\"",
        );
        assert!(msg.ends_with("(also services[0] at line 4)"), "{msg}");
        let text = edit(BASE, "  - name: api\n", "  - name: Api\n");
        rejects(&text, 11, "services[1].name", "is not a service name");
        let long = "x".repeat(64);
        let text = edit(BASE, "  - name: api\n", &format!("  - name: {long}\n"));
        rejects(&text, 11, "services[1].name", "is not a service name");
        let text = edit(BASE, "  - name: api\n", "  - name: \"\"\n");
        rejects(&text, 11, "services[1].name", "is not a service name");
        let text = edit(
            BASE,
            "  - name: api\n",
            &format!("  - name: a-b_c.{}\n", "9".repeat(57)),
        );
        AgentConfig::parse(&text).unwrap();
    }

    #[test]
    fn duplicate_vip() {
        let text = edit(
            BASE,
            "    vip: 192.0.2.11\n    port: 443\n",
            "    vip: 192.0.2.10\n    port: 80\n",
        );
        let msg = rejects(&text, 11, "services[1]", "duplicate VIP");
        assert_eq!(
            msg,
            "line 11, services[1]: duplicate VIP 192.0.2.10:80/tcp (also in service \"web\" at line 4)"
        );
        let text = edit(
            BASE,
            "    vip: 192.0.2.11\n    port: 443\n",
            "    vip: 192.0.2.10\n    port: 80\n    protocol: tcp\n",
        );
        rejects(&text, 11, "services[1]", "duplicate VIP 192.0.2.10:80/tcp");
    }

    #[test]
    fn backends() {
        let text = edit(
            BASE,
            "    backends:\n      - { ip: 10.2.0.4, port: 8443 }\n",
            "    backends: []\n",
        );
        rejects(&text, 14, "services[1].backends", "at least one backend");
        let text = edit(BASE, "10.2.0.4", "fd00::4");
        rejects(
            &text,
            15,
            "services[1].backends[0].ip",
            "fd00::4 is IPv6 but the VIP 192.0.2.11 is IPv4",
        );
        let text = edit(BASE, "    vip: 192.0.2.11\n", "    vip: 2001:db8::1\n");
        rejects(
            &text,
            15,
            "services[1].backends[0].ip",
            "10.2.0.4 is IPv4 but the VIP 2001:db8::1 is IPv6",
        );
        let text = edit(BASE, "      - ip: 10.2.0.3\n", "      - ip: 10.2.0.2\n");
        let msg = rejects(
            &text,
            9,
            "services[0].backends[1]",
            "duplicate backend 10.2.0.2:8080",
        );
        assert!(msg.ends_with("(also backends[0] at line 8)"), "{msg}");
        // Same address, other port: fine.
        let text = edit(
            BASE,
            "      - ip: 10.2.0.3\n        port: 8080\n",
            "      - ip: 10.2.0.2\n        port: 8081\n",
        );
        AgentConfig::parse(&text).unwrap();
        let text = edit(BASE, "port: 8443 }", "port: 8443, weight: 1001 }");
        rejects(
            &text,
            15,
            "services[1].backends[0].weight",
            "weight 1001 is out of range (0 to 1000",
        );
        let text = edit(BASE, "port: 8443 }", "port: 8443, weight: -1 }");
        rejects(
            &text,
            15,
            "services[1].backends[0].weight",
            "weight -1 is out of range",
        );
        let text = edit(BASE, "port: 8443 }", "port: 8443, weight: 0 }");
        assert_eq!(
            AgentConfig::parse(&text).unwrap().services[1].backends[0].weight,
            0
        );
    }

    #[test]
    fn snat_needs_its_address() {
        let text = edit(BASE, "snat_ipv4: 10.0.0.1\n", "snat_ipv6: fd00::1\n");
        let text = edit(&text, "    port: 443\n", "    port: 443\n    mode: snat\n");
        rejects(&text, 14, "services[1].mode", "needs snat_ipv4");
        let text = edit(BASE, "    vip: 192.0.2.11\n", "    vip: 2001:db8::1\n");
        let text = edit(&text, "10.2.0.4", "fd00::4");
        let text = edit(&text, "    port: 443\n", "    port: 443\n    mode: snat\n");
        rejects(
            &text,
            14,
            "services[1].mode",
            "mode snat with the IPv6 VIP 2001:db8::1 needs snat_ipv6",
        );
        // nat mode needs neither.
        let text = edit(BASE, "snat_ipv4: 10.0.0.1\n", "");
        AgentConfig::parse(&text).unwrap();
    }

    #[test]
    fn source_ranges_and_affinity() {
        let with = |extra: &str| edit(BASE, "  - name: web\n", &format!("  - name: web\n{extra}"));
        let ok = AgentConfig::parse(&with(
            "    source_ranges: [203.0.113.0/24, 10.0.0.0/8, 198.51.100.7]\n    affinity: client_ip\n",
        ))
        .unwrap();
        let web = &ok.services[0];
        let nets: Vec<String> = web
            .source_ranges
            .iter()
            .flatten()
            .map(|n| n.to_string())
            .collect();
        assert_eq!(nets, ["10.0.0.0/8", "198.51.100.7/32", "203.0.113.0/24"]);
        assert_eq!(
            web.affinity,
            Some(ClientAffinity {
                timeout: DEFAULT_AFFINITY_TIMEOUT
            })
        );
        let spec = ok.service_spec(web);
        assert!(spec.client_affinity);
        assert_eq!(spec.source_ranges.as_ref().map(Vec::len), Some(3));
        assert_eq!(ok.services[1].source_ranges, None, "open unless restricted");
        assert!(!ok.service_spec(&ok.services[1]).client_affinity);

        rejects(
            &with("    source_ranges: [10.0.0.1/8]\n"),
            5,
            "services[0].source_ranges[0]",
            "host bits set (the network is 10.0.0.0/8)",
        );
        rejects(
            &with("    source_ranges: [2001:db8::/32]\n"),
            5,
            "services[0].source_ranges[0]",
            "is IPv6 but the VIP 192.0.2.10 is IPv4",
        );
        rejects(
            &with("    source_ranges: [10.0.0.0/33]\n"),
            5,
            "services[0].source_ranges[0]",
            "is not a CIDR",
        );
        rejects(
            &with("    source_ranges: []\n"),
            5,
            "services[0].source_ranges",
            "refuse every client",
        );
        rejects(
            &with("    affinity: client_ip\n    affinity_timeout: 2d\n"),
            6,
            "services[0].affinity_timeout",
            "out of range",
        );
        rejects(
            &with("    affinity_timeout: 1h\n"),
            5,
            "services[0].affinity_timeout",
            "needs affinity: client_ip",
        );
        let t = AgentConfig::parse(&with(
            "    affinity: client_ip\n    affinity_timeout: 10m\n",
        ))
        .unwrap();
        assert_eq!(
            t.services[0].affinity.unwrap().timeout,
            Duration::from_secs(600)
        );
    }

    #[test]
    fn table_sizes() {
        let with = |m: &str| {
            edit(
                BASE,
                "  - name: web\n",
                &format!("  - name: web\n    table_size: {m}\n"),
            )
        };
        rejects(&with("16380"), 5, "services[0].table_size", "not a prime");
        rejects(&with("65539"), 5, "services[0].table_size", "exceeds 65537");
        rejects(
            &with("101"),
            5,
            "services[0].table_size",
            "below 100 x 2 backends",
        );
        rejects(&with("-7"), 5, "services[0].table_size", "not a prime");
        rejects(
            &with("4294967311"),
            5,
            "services[0].table_size",
            "not a prime",
        );
        assert_eq!(
            AgentConfig::parse(&with("211")).unwrap().services[0].table_size,
            Some(211)
        );
        // Without a size, the default must hold the backends.
        let mut text = String::from(
            "interfaces: [eth0]\nservices:\n- name: big\n  vip: 192.0.2.1\n  port: 80\n  backends:\n",
        );
        for j in 0..656 {
            text += &format!("  - {{ ip: 10.1.{}.{}, port: 80 }}\n", j / 256, j % 256);
        }
        rejects(
            &text,
            6,
            "services[0].backends",
            "656 backends are too many",
        );
    }

    #[test]
    fn timeouts() {
        let with = |t: &str| {
            edit(
                BASE,
                "snat_ipv4: 10.0.0.1\n",
                &format!("timeouts:\n  {t}\n"),
            )
        };
        rejects(
            &with("tcp: 15 parsecs"),
            3,
            "timeouts.tcp",
            "\"15 parsecs\" is not a duration",
        );
        rejects(
            &with("udp: 500ms"),
            3,
            "timeouts.udp",
            "500ms is shorter than 1s",
        );
        rejects(
            &with("tcp_closing: 0s"),
            3,
            "timeouts.tcp_closing",
            "shorter than 1s",
        );
        rejects(
            &with("udp: 60"),
            3,
            "timeouts.udp",
            "\"60\" is not a duration",
        );
        rejects(&with("udp: 200years"), 3, "timeouts.udp", "is longer than");
        let c = AgentConfig::parse(&with("tcp: 1h 30m")).unwrap();
        assert_eq!(c.tcp_timeout, Duration::from_secs(5400));
        assert_eq!(c.udp_timeout, DEFAULT_UDP_TIMEOUT);
    }

    #[test]
    fn health_checks() {
        let with = |h: &str| {
            edit(
                BASE,
                "    port: 443\n",
                &format!("    port: 443\n    health_check:\n      {h}\n"),
            )
        };
        let hc = "services[1].health_check";
        rejects(
            &with("{ type: tcp, interval: 50ms }"),
            15,
            &format!("{hc}.interval"),
            "50ms is shorter than 100ms",
        );
        rejects(
            &with("{ type: tcp, interval: 1x }"),
            15,
            &format!("{hc}.interval"),
            "is not a duration",
        );
        rejects(
            &with("{ type: tcp, timeout: 0s }"),
            15,
            &format!("{hc}.timeout"),
            "must be above 0",
        );
        rejects(
            &with("{ type: tcp, interval: 1s, timeout: 2s }"),
            15,
            &format!("{hc}.timeout"),
            "at most the interval (1s)",
        );
        rejects(
            &with("{ type: tcp, rise: 0 }"),
            15,
            &format!("{hc}.rise"),
            "0 is not a count of at least 1",
        );
        rejects(
            &with("{ type: tcp, fall: -2 }"),
            15,
            &format!("{hc}.fall"),
            "-2 is not a count",
        );
        rejects(
            &with("{ type: http, path: healthz }"),
            15,
            &format!("{hc}.path"),
            "\"healthz\" is not an HTTP path",
        );
        rejects(
            &with("{ type: http, path: \"/a b\" }"),
            15,
            &format!("{hc}.path"),
            "is not an HTTP path",
        );
        rejects(
            &with("{ type: http, expect_status: 99 }"),
            15,
            &format!("{hc}.expect_status"),
            "99 is not an HTTP status",
        );
        rejects(
            &with("{ type: tcp, path: /x }"),
            15,
            &format!("{hc}.path"),
            "only http checks",
        );
        rejects(
            &with("{ type: tcp, expect_status: 200 }"),
            15,
            &format!("{hc}.expect_status"),
            "only http checks",
        );
        // Block style: the line of the field itself.
        let text = with("type: http\n      path: /ok\n      interval: 1s\n      timeout: 5s");
        rejects(&text, 18, &format!("{hc}.timeout"), "at most the interval");
    }

    #[test]
    fn snat_ports() {
        let with = |p: &str| {
            edit(
                BASE,
                "snat_ipv4: 10.0.0.1\n",
                &format!("snat_ipv4: 10.0.0.1\nsnat_ports: {p}\n"),
            )
        };
        for bad in [
            "80-90",
            "30000-20000",
            "abc",
            "10000-70000",
            "10000",
            "1023-2000",
        ] {
            rejects(&with(bad), 3, "snat_ports", "is not a port range MIN-MAX");
        }
        assert_eq!(
            AgentConfig::parse(&with("1024-65535")).unwrap().snat_ports,
            (1024, 65535)
        );
        assert_eq!(
            AgentConfig::parse(&with("5000-5000")).unwrap().snat_ports,
            (5000, 5000)
        );
    }

    #[test]
    fn lines_in_flow_style_and_with_comments() {
        // The whole file on few lines, in flow style, with comments and
        // blank lines: the line is still the value's.
        let text = "# xlb\n\ninterfaces: [eth0]   # the uplink\n\
                    services: [ { name: a, vip: 192.0.2.1, port: 80, backends: [ { ip: 10.0.0.1, port: 80 } ] },\n\
                    \n  # the second\n\
                    { name: b, vip: 192.0.2.2, port: 80, backends: [ { ip: 10.0.0.1, port: 80 },\n\
                    { ip: 10.0.0.x, port: 80 } ] } ]\n";
        rejects(
            text,
            8,
            "services[1].backends[1].ip",
            "\"10.0.0.x\" is not an IP address",
        );
        // Anchors and aliases.
        let text = "interfaces: [eth0]\nservices:\n- name: a\n  vip: 192.0.2.1\n  port: 80\n  \
                    backends: &bs\n  - { ip: 10.0.0.1, port: 80 }\n  - { ip: 10.0.0.1, port: 80 }\n";
        rejects(text, 8, "services[0].backends[1]", "duplicate backend");
    }

    #[test]
    fn load_from_file() {
        let dir = std::env::temp_dir().join(format!("xlb-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("lb.yaml");
        std::fs::write(&file, BASE).unwrap();
        assert_eq!(
            AgentConfig::load(&file).unwrap(),
            AgentConfig::parse(BASE).unwrap()
        );
        let missing = dir.join("missing.yaml");
        let e = AgentConfig::load(&missing).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }), "{e}");
        assert_eq!(e.line(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    // Its speed shows in the e2e bench (reload time); here only correctness.
    fn large_config_parses_and_locates_errors() {
        let mut text = String::from("interfaces: [eth0]\nsnat_ipv4: 10.0.0.1\nservices:\n");
        for i in 0..1000 {
            text += &format!(
                "  - name: svc-{i}\n    vip: 192.0.{}.{}\n    port: 80\n    mode: snat\n    \
                 health_check: {{ type: http, path: /healthz }}\n    backends:\n",
                i / 256,
                i % 256
            );
            for j in 0..100 {
                text += &format!(
                    "      - {{ ip: 10.{}.{}.{j}, port: 8080, weight: 1 }}\n",
                    i / 256,
                    i % 256
                );
            }
        }
        let c = AgentConfig::parse(&text).unwrap();
        assert_eq!(c.services.len(), 1000);
        assert_eq!(c.services[999].backends.len(), 100);
        // An error at the very end is located.
        let bad = text.replacen("ip: 10.3.231.99,", "ip: 10.3.231.x,", 1);
        let e = AgentConfig::parse(&bad).unwrap_err();
        assert_eq!(e.field(), Some("services[999].backends[99].ip"));
        assert_eq!(e.line(), Some(text.lines().count()));
    }
    #[test]
    fn kubernetes_section_parses_and_checks() {
        let k = AgentConfig::parse("interfaces: [eth0]\nkubernetes: {}\n")
            .unwrap()
            .kubernetes
            .unwrap();
        assert_eq!(k.load_balancer_class, DEFAULT_LOAD_BALANCER_CLASS);
        assert_eq!(
            (k.default_class, k.mode, k.allocate_addresses),
            (false, Mode::Snat, true)
        );
        assert_eq!(
            (k.lease_namespace.as_str(), k.lease_name.as_str()),
            (DEFAULT_LEASE_NAMESPACE, DEFAULT_LEASE_NAME)
        );
        assert_eq!(k.lease_duration, DEFAULT_LEASE_DURATION);
        assert_eq!((k.kubeconfig, k.node_name), (None, None));

        let full = "interfaces: [eth0]\nkubernetes:\n  kubeconfig: /etc/xlb/kc\n  node_name: worker-1\n  \
                    load_balancer_class: example.com/lb\n  default_class: true\n  mode: nat\n  \
                    allocate_addresses: false\n  lease_namespace: lb\n  lease_name: ipam\n  lease_duration: 30s\n";
        let k = AgentConfig::parse(full).unwrap().kubernetes.unwrap();
        assert_eq!(k.kubeconfig.as_deref(), Some(Path::new("/etc/xlb/kc")));
        assert_eq!(k.node_name.as_deref(), Some("worker-1"));
        assert_eq!(k.load_balancer_class, "example.com/lb");
        assert_eq!(
            (k.default_class, k.mode, k.allocate_addresses),
            (true, Mode::Nat, false)
        );
        assert_eq!(
            (k.lease_namespace.as_str(), k.lease_name.as_str()),
            ("lb", "ipam")
        );
        assert_eq!(k.lease_duration, Duration::from_secs(30));

        let bad = |line: &str| format!("interfaces: [eth0]\nkubernetes:\n  {line}\n");
        rejects(
            &bad("node_name: Worker_1"),
            3,
            "kubernetes.node_name",
            "not a Kubernetes name",
        );
        rejects(
            &bad("lease_namespace: -x"),
            3,
            "kubernetes.lease_namespace",
            "not a Kubernetes name",
        );
        rejects(
            &bad("lease_duration: 1s"),
            3,
            "kubernetes.lease_duration",
            "outside 2s..=1h",
        );
        rejects(
            &bad("load_balancer_class: \"a b\""),
            3,
            "kubernetes.load_balancer_class",
            "not a loadBalancerClass",
        );
        rejects(&bad("mode: dsr"), 3, "kubernetes.mode", "nat");
        rejects(&bad("watch: all"), 3, "kubernetes.watch", "unknown field");
    }

    #[test]
    fn bgp_section_parses_and_checks() {
        let text = format!(
            "{BASE}bgp:\n  driver: gobgp\n  next_hop_ipv4: 10.0.0.1\n  communities: [\"65000:100\"]\n  local_pref: 200\n  drain_time: 2s\n  gobgp:\n    peers:\n      - {{ address: 10.0.0.254, asn: 65000, hold_time: 6s }}\n"
        );
        let c = AgentConfig::parse(&text).unwrap();
        let b = c.bgp.unwrap();
        assert_eq!(b.next_hop_ipv4, Some("10.0.0.1".parse().unwrap()));
        assert_eq!(b.communities, vec![(65000, 100)]);
        assert_eq!(b.local_pref, Some(200));
        assert_eq!(b.drain_time, Duration::from_secs(2));
        match b.speaker {
            Speaker::GoBgp { address, peers } => {
                assert_eq!(address, DEFAULT_GOBGP_ADDRESS);
                assert_eq!(peers.len(), 1);
                assert_eq!(peers[0].hold_time, Duration::from_secs(6));
                assert_eq!(peers[0].keepalive, Duration::from_secs(2));
            }
            other => panic!("{other:?}"),
        }
        let bad = format!("{BASE}bgp:\n  driver: gobgp\n  communities: [\"65000:x\"]\n");
        let e = AgentConfig::parse(&bad).unwrap_err().to_string();
        assert!(
            e.contains("bgp.communities[0]") && e.contains("line"),
            "{e}"
        );
        let bad = format!("{BASE}bgp:\n  driver: quagga\n");
        let e = AgentConfig::parse(&bad).unwrap_err().to_string();
        assert!(
            e.contains("line") && e.contains("bgp.driver") && e.contains("quagga"),
            "{e}"
        );
        let bad = format!("{BASE}bgp:\n  driver: bird\n  next_hop_ipv4: fd00::1\n");
        let e = AgentConfig::parse(&bad).unwrap_err().to_string();
        assert!(e.contains("bgp.next_hop_ipv4"), "{e}");
    }
}
