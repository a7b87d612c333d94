//! The agent's configuration file (standalone mode): types, parsing and
//! validation. Every field is documented in docs/config.md.
//!
//! Parsing and validation are pure: `AgentConfig::parse(text)` either gives
//! a config that the data plane will accept or an error naming the field
//! and its line, and changes nothing.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
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
    /// XDP attach mode.
    pub xdp_mode: XdpAttachMode,
    /// Flow lifetimes after which a reply translation may be reused.
    pub tcp_timeout: Duration,
    pub tcp_closing_timeout: Duration,
    pub udp_timeout: Duration,
    pub services: Vec<ServiceConfig>,
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
    pub protocol: crate::dataplane::Protocol,
    pub mode: Mode,
    pub backends: Vec<BackendConfig>,
    pub health_check: Option<HealthCheck>,
    /// Maglev table size (prime); `None`: chosen from the backend count.
    pub table_size: Option<u32>,
    pub removed_backend_flows: RemovedBackendFlows,
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
    Http { port: Option<u16>, path: String, expect_status: u16 },
}
