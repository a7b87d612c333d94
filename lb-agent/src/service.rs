//! What a service should be, whichever source says so: the config file
//! (`config`) and Kubernetes (`k8s::desired`) both produce these, and the
//! agent programs the data plane and the health checks from them.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use ipnet::IpNet;

use crate::dataplane::Protocol;

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
pub struct DesiredService {
    pub name: String,
    pub vip: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    pub mode: Mode,
    pub backends: Vec<DesiredBackend>,
    pub health_check: Option<HealthCheck>,
    /// Maglev table size (prime); `None`: chosen from the backend count.
    pub table_size: Option<u32>,
    pub removed_backend_flows: RemovedBackendFlows,
    /// Clients allowed to connect; `None`: everyone. `Some` and empty: no
    /// one (a Kubernetes Service whose ranges are all of the other family).
    pub source_ranges: Option<Vec<IpNet>>,
    /// Session affinity by client address, and its (reported) timeout.
    pub affinity: Option<ClientAffinity>,
    /// How new flows are shared among the backends.
    pub balance: Balance,
    /// Which of this node's ways of telling the network announce the VIP.
    pub announce: Announce,
    /// New flows a second per source prefix; `None`: unlimited.
    pub new_flow_limit: Option<crate::dataplane::NewFlowLimit>,
    /// Only this node's endpoints serve it (`externalTrafficPolicy:
    /// Local`), so only the nodes that have some announce the VIP: its
    /// route is never aggregated into a prefix other nodes announce.
    pub local_endpoints_only: bool,
}

/// Tests' one way to build a service: [`DesiredService::for_test`] has the
/// defaults, a test sets what it is about (fields, or struct update syntax).
#[cfg(test)]
impl DesiredService {
    /// `vip:port` over TCP, nat, no backends, and every optional setting as
    /// a config file entry without it has it.
    pub(crate) fn for_test(name: &str, vip: IpAddr, port: u16) -> Self {
        DesiredService {
            name: name.into(),
            vip,
            port,
            protocol: Protocol::Tcp,
            mode: Mode::Nat,
            backends: Vec::new(),
            health_check: None,
            table_size: None,
            removed_backend_flows: RemovedBackendFlows::Keep,
            source_ranges: None,
            affinity: None,
            balance: Balance::Static,
            announce: Announce::Both,
            new_flow_limit: None,
            local_endpoints_only: false,
        }
    }

    /// With one more backend, `ip:port` of `weight` (no cgroup, not terminating).
    pub(crate) fn with_backend(mut self, ip: IpAddr, port: u16, weight: u32) -> Self {
        self.backends.push(DesiredBackend {
            ip,
            port,
            weight,
            cgroup: None,
            terminating: false,
        });
        self
    }
}

/// `announce:` / the `xlb.dev/announce` annotation: whether the VIP is
/// announced through BGP, answered for in L2 mode, or both. Each applies
/// only where the node has it configured (`bgp:`, `l2:`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Announce {
    /// Every way the node is configured for.
    #[default]
    Both,
    Bgp,
    L2,
}

impl Announce {
    pub fn by_bgp(self) -> bool {
        self != Announce::L2
    }

    pub fn by_l2(self) -> bool {
        self != Announce::Bgp
    }

    /// What two services on one VIP ask for together: each way either asks.
    pub fn union(self, other: Announce) -> Announce {
        if self == other {
            self
        } else {
            Announce::Both
        }
    }

    pub fn parse(s: &str) -> Option<Announce> {
        match s {
            "both" => Some(Announce::Both),
            "bgp" => Some(Announce::Bgp),
            "l2" => Some(Announce::L2),
            _ => None,
        }
    }
}

/// `balance:` / the `xlb.dev/balance` annotation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Balance {
    /// By the configured weights (Maglev), whatever the backends' load.
    #[default]
    Static,
    /// The configured weights scaled by the backends' measured load
    /// (`crate::load`): open flows, probe latency, reports.
    LoadAware { agent_check: Option<AgentCheck> },
}

impl Balance {
    pub fn is_load_aware(&self) -> bool {
        matches!(self, Balance::LoadAware { .. })
    }
}

/// HAProxy's agent check: a TCP port on the backend's address that answers
/// one line such as `75%`, `drain`, `down` or `up` (`crate::load_aware::agent`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentCheck {
    pub port: u16,
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
pub struct DesiredBackend {
    pub ip: IpAddr,
    pub port: u16,
    pub weight: u32,
    /// Where its CPU use can be read on this node (load-aware balancing);
    /// `None`: not local, or not said. Boxed: most backends have none, and
    /// a cluster has 100,000s of backends.
    pub cgroup: Option<Box<BackendCgroup>>,
    /// A Kubernetes endpoint that is terminating but still serving: it
    /// keeps its flows and takes no new ones (weight 0).
    pub terminating: bool,
}

/// A local backend's cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackendCgroup {
    /// A path below the cgroup hierarchies' root (config file).
    Path(std::path::PathBuf),
    /// A Pod on this node, by UID (Kubernetes): found where kubelet puts it.
    Pod(String),
}

impl DesiredBackend {
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

#[cfg(test)]
mod tests {
    use super::Announce;

    #[test]
    fn services_on_one_vip_announce_every_way_either_asks() {
        use Announce::*;
        assert_eq!(Bgp.union(Bgp), Bgp);
        assert_eq!(L2.union(L2), L2);
        assert_eq!(Bgp.union(L2), Both);
        assert_eq!(L2.union(Both), Both);
        assert!(Bgp.by_bgp() && !Bgp.by_l2());
        assert!(!L2.by_bgp() && L2.by_l2());
        assert!(Both.by_bgp() && Both.by_l2());
        assert_eq!(Announce::parse("l2"), Some(L2));
        assert_eq!(Announce::parse("arp"), None);
    }
}
