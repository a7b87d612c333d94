//! The file as written: plain values, checked and converted by the
//! validator. serde refuses unknown fields and wrong shapes here.

use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a mapping of configuration fields")]
pub(super) struct RawConfig {
    pub(super) interfaces: Vec<String>,
    pub(super) snat_ipv4: Option<String>,
    pub(super) snat_ipv6: Option<String>,
    pub(super) snat_ports: Option<String>,
    pub(super) metrics_addr: Option<String>,
    pub(super) backend_metrics: Option<bool>,
    pub(super) xdp_mode: Option<RawXdpMode>,
    pub(super) pod_interfaces: Option<RawPodInterfaces>,
    pub(super) timeouts: Option<RawTimeouts>,
    pub(super) maglev_pool_entries: Option<u32>,
    pub(super) flow_table_entries: Option<u32>,
    pub(super) flood_threshold: Option<u32>,
    pub(super) bgp: Option<RawBgp>,
    pub(super) kubernetes: Option<RawKubernetes>,
    pub(super) load_aware: Option<RawLoadAware>,
    pub(super) l2: Option<RawL2>,
    pub(super) flow_sync: Option<RawFlowSync>,
    #[serde(default)]
    pub(super) services: Vec<RawService>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a kubernetes mapping (kubeconfig, node_name, load_balancer_class, ...)"
)]
pub(super) struct RawKubernetes {
    pub(super) kubeconfig: Option<String>,
    pub(super) node_name: Option<String>,
    pub(super) load_balancer_class: Option<String>,
    pub(super) default_class: Option<bool>,
    pub(super) mode: Option<RawMode>,
    pub(super) allocate_addresses: Option<bool>,
    pub(super) lease_namespace: Option<String>,
    pub(super) lease_name: Option<String>,
    pub(super) lease_duration: Option<String>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a bgp mapping (driver, next hops, ...)"
)]
pub(super) struct RawBgp {
    pub(super) driver: RawDriver,
    pub(super) next_hop_ipv4: Option<String>,
    pub(super) next_hop_ipv6: Option<String>,
    #[serde(default)]
    pub(super) communities: Vec<String>,
    #[serde(default)]
    pub(super) large_communities: Vec<String>,
    pub(super) local_pref: Option<u32>,
    pub(super) drain_time: Option<String>,
    pub(super) graceful_shutdown: Option<String>,
    pub(super) resync_interval: Option<String>,
    pub(super) asn: Option<u32>,
    #[serde(default)]
    pub(super) peers: Vec<RawPeer>,
    pub(super) gobgp: Option<RawGoBgp>,
    pub(super) bird: Option<RawBird>,
    pub(super) exabgp: Option<RawExaBgp>,
    pub(super) frr: Option<RawFrr>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "gobgp, bird, exabgp or frr")]
pub(super) enum RawDriver {
    Gobgp,
    Bird,
    Exabgp,
    Frr,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a gobgp mapping (address)")]
pub(super) struct RawGoBgp {
    pub(super) address: Option<String>,
}

/// One of `bgp.peers` as written (also built from a BGPPeer object).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, expecting = "a peer (address, asn, ...)")]
pub(crate) struct RawPeer {
    pub(crate) address: String,
    pub(crate) asn: u32,
    pub(crate) port: Option<u16>,
    pub(crate) hold_time: Option<String>,
    pub(crate) keepalive: Option<String>,
    pub(crate) password: Option<String>,
    pub(crate) multihop_ttl: Option<u8>,
    pub(crate) graceful_restart: Option<String>,
    pub(crate) bfd: Option<RawBfd>,
}

#[derive(Deserialize, Default)]
#[serde(
    deny_unknown_fields,
    expecting = "a bfd mapping (min_rx, min_tx, multiplier)"
)]
pub(crate) struct RawBfd {
    pub(crate) min_rx: Option<String>,
    pub(crate) min_tx: Option<String>,
    pub(crate) multiplier: Option<u8>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a bird mapping (routes_file, peers_file, socket, protocol)"
)]
pub(super) struct RawBird {
    pub(super) routes_file: Option<String>,
    pub(super) peers_file: Option<String>,
    pub(super) socket: Option<String>,
    pub(super) protocol: Option<String>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an exabgp mapping (pipe_dir, pipe_name)"
)]
pub(super) struct RawExaBgp {
    pub(super) pipe_dir: Option<String>,
    pub(super) pipe_name: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(
    deny_unknown_fields,
    expecting = "an frr mapping (socket_dir, config_dir, vtysh)"
)]
pub(super) struct RawFrr {
    pub(super) socket_dir: Option<String>,
    pub(super) config_dir: Option<String>,
    pub(super) vtysh: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "native or generic")]
pub(super) enum RawXdpMode {
    Native,
    Generic,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with tcp, tcp_closing, udp"
)]
pub(super) struct RawTimeouts {
    pub(super) tcp: Option<String>,
    pub(super) tcp_closing: Option<String>,
    pub(super) udp: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a service (a mapping)")]
pub(super) struct RawService {
    pub(super) name: String,
    pub(super) vip: String,
    pub(super) port: i64,
    pub(super) protocol: Option<RawProtocol>,
    pub(super) mode: Option<RawMode>,
    pub(super) table_size: Option<i64>,
    pub(super) on_backend_removed: Option<RawRemoved>,
    pub(super) backends: Vec<RawBackend>,
    pub(super) health_check: Option<RawHealthCheck>,
    pub(super) source_ranges: Option<Vec<String>>,
    pub(super) affinity: Option<RawAffinity>,
    pub(super) affinity_timeout: Option<String>,
    pub(super) balance: Option<RawBalance>,
    pub(super) agent_check: Option<RawAgentCheck>,
    pub(super) announce: Option<RawAnnounce>,
    pub(super) new_flow_limit: Option<RawNewFlowLimit>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a new flow limit (per_second, burst, ipv4_prefix, ipv6_prefix)"
)]
pub(super) struct RawNewFlowLimit {
    pub(super) per_second: i64,
    pub(super) burst: Option<i64>,
    pub(super) ipv4_prefix: Option<i64>,
    pub(super) ipv6_prefix: Option<i64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase", expecting = "bgp, l2 or both")]
pub(super) enum RawAnnounce {
    Both,
    Bgp,
    L2,
}

#[derive(Deserialize)]
#[serde(expecting = "static or load-aware")]
pub(super) enum RawBalance {
    #[serde(rename = "static")]
    Static,
    #[serde(rename = "load-aware")]
    LoadAware,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an agent check (a mapping with port)"
)]
pub(super) struct RawAgentCheck {
    pub(super) port: i64,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a mapping with interval, cgroup_root"
)]
pub(super) struct RawLoadAware {
    pub(super) interval: Option<String>,
    pub(super) cgroup_root: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "none or client_ip")]
pub(super) enum RawAffinity {
    None,
    ClientIp,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "tcp or udp")]
pub(super) enum RawProtocol {
    Tcp,
    Udp,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "nat or snat")]
pub(super) enum RawMode {
    Nat,
    Snat,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "keep or reset")]
pub(super) enum RawRemoved {
    Keep,
    Reset,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a backend (a mapping with ip, port, weight, cgroup)"
)]
pub(super) struct RawBackend {
    pub(super) ip: String,
    pub(super) port: i64,
    pub(super) weight: Option<i64>,
    pub(super) cgroup: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "a health check (a mapping)")]
pub(super) struct RawHealthCheck {
    #[serde(rename = "type")]
    pub(super) kind: RawCheckType,
    pub(super) port: Option<i64>,
    pub(super) path: Option<String>,
    pub(super) expect_status: Option<i64>,
    pub(super) interval: Option<String>,
    pub(super) timeout: Option<String>,
    pub(super) rise: Option<i64>,
    pub(super) fall: Option<i64>,
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case", expecting = "tcp or http")]
pub(super) enum RawCheckType {
    Tcp,
    Http,
}

/// `pod_interfaces`: `auto`, `none`, or a list of names.
#[derive(Deserialize)]
#[serde(untagged, expecting = "auto, none, or a list of interface names")]
pub(super) enum RawPodInterfaces {
    Word(String),
    Names(Vec<String>),
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an l2 mapping (interfaces, bind, peers, key_file, share_flows, ...)"
)]
pub(super) struct RawL2 {
    pub(super) interfaces: Vec<String>,
    pub(super) node_name: Option<String>,
    pub(super) bind: Option<String>,
    #[serde(default)]
    pub(super) peers: Vec<String>,
    pub(super) key_file: String,
    pub(super) quorum: Option<i64>,
    pub(super) probe_interval: Option<String>,
    pub(super) probe_timeout: Option<String>,
    pub(super) suspect_timeout: Option<String>,
    pub(super) announce_interval: Option<String>,
    pub(super) share_flows: Option<bool>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a flow_sync mapping (listen, peers, key_file, interval, forget_after)"
)]
pub(super) struct RawFlowSync {
    pub(super) listen: Option<String>,
    #[serde(default)]
    pub(super) peers: Vec<String>,
    pub(super) key_file: String,
    pub(super) interval: Option<String>,
    pub(super) forget_after: Option<String>,
}
