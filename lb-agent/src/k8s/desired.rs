//! Services and EndpointSlices → the data-plane services this node runs.
//!
//! Pure functions over API objects, so the rules are unit-tested with the
//! JSON real clusters serve (testdata/). The watcher calls
//! [`desired_services`] with whatever its stores hold, after every change:
//! a Service whose object, slices and node zone are the versions the last
//! result was made from keeps that result, so one change among thousands
//! of Services costs one Service's work.
//!
//! The rules:
//! - every port of a Service xlb serves becomes one data-plane service per
//!   ingress IP in `status.loadBalancer.ingress` (IPv4 and IPv6);
//! - its backends come from the EndpointSlices labelled with the Service's
//!   name, of the VIP's address family, whose port has the Service port's
//!   name (that is how the EndpointSlice controller resolves named target
//!   ports per pod) and protocol;
//! - an endpoint that is `ready` (unset counts as true) takes new flows; one
//!   that is `serving` and `terminating` keeps its flows and takes no new
//!   ones (weight 0); anything else is left out;
//! - `externalTrafficPolicy: Local` keeps only endpoints on this node;
//! - `trafficDistribution` (`PreferSameNode`, `PreferSameZone`/`PreferClose`)
//!   sends new flows to the endpoints the EndpointSlice controller hinted
//!   for this node (or its zone) when there are any, else to all, as
//!   kube-proxy does;
//! - a node labelled `node.kubernetes.io/exclude-from-external-load-balancers`
//!   serves nothing.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
};

use ipnet::IpNet;
use k8s_openapi::api::core::v1::{Node, Service};

use super::{
    serves, slice::Slice, AGENT_CHECK_PORT_ANNOTATION, ANNOUNCE_ANNOTATION, BALANCE_ANNOTATION,
    EXCLUDE_LABEL, MODE_ANNOTATION, NEW_FLOW_LIMIT_ANNOTATION, SERVICE_NAME_LABEL,
};
use crate::{
    dataplane::{NewFlowLimit, Protocol},
    service::{
        parse_source_range, ranges_for, AgentCheck, Announce, BackendCgroup, Balance,
        ClientAffinity, DesiredBackend, DesiredService, Mode, RemovedBackendFlows,
        DEFAULT_AFFINITY_TIMEOUT, MAX_AFFINITY_TIMEOUT,
    },
};

/// What decides which Services are ours and how they are forwarded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceOptions {
    pub load_balancer_class: String,
    pub default_class: bool,
    pub mode: Mode,
    pub node_name: String,
}

/// The desired state from the cluster, with the reasons anything was left out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Desired {
    pub services: Vec<Arc<DesiredService>>,
    /// `namespace/name` → the data-plane services made from it: the last good
    /// result, reused when a later version of the object is unusable.
    pub by_service: BTreeMap<String, Vec<Arc<DesiredService>>>,
    /// `namespace/name` → the versions its last good result was made from.
    made_from: BTreeMap<String, Arc<Made>>,
    /// Human-readable, one per problem (logged by the watcher).
    pub problems: Vec<String>,
    /// The addresses of Services that are unusable with no last good state
    /// here (an agent started while they were broken): what the data plane
    /// already has for them stays as it is, so that an agent restarted
    /// under a broken Service does not drop the connections the last one
    /// served.
    pub held: BTreeSet<(IpAddr, u16, Protocol)>,
    /// This node carries the exclusion label.
    pub excluded: bool,
    /// This node is being taken out ([`node_is_leaving`]): a SIGTERM then
    /// withdraws and drains; otherwise it is a restart (a rollout).
    pub leaving: bool,
    /// This node's Pod CIDRs (`spec.podCIDRs`): a SNAT address inside them
    /// is one the pod network routes back to this node unmasqueraded.
    pub pod_cidrs: Vec<IpNet>,
}

/// A Service's result, and the versions of what it was made from.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Made {
    versions: Versions,
    services: Vec<Arc<DesiredService>>,
    notes: Vec<String>,
}

/// The resourceVersions of a Service and of its slices, and the node's
/// zone: all a Service's result depends on (the options are fixed).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Versions {
    service: String,
    slices: Vec<String>,
    zone: Option<String>,
}

impl Versions {
    /// Whether these are the versions of `svc`, `slices` and `zone`; an
    /// object without a resourceVersion (one not from the API server)
    /// never matches. Compared in place: this runs for every Service on
    /// every change.
    fn are_of(&self, svc: &Service, slices: &[&Slice], zone: Option<&str>) -> bool {
        let same = |mine: &str, theirs: &Option<String>| theirs.as_deref() == Some(mine);
        same(&self.service, &svc.metadata.resource_version)
            && self.slices.len() == slices.len()
            && self
                .slices
                .iter()
                .zip(slices)
                .all(|(v, s)| same(v, &s.metadata.resource_version))
            && self.zone.as_deref() == zone
    }

    /// `None` when an object has no resourceVersion: its result is never
    /// reused.
    fn of(svc: &Service, slices: &[&Slice], zone: Option<&str>) -> Option<Versions> {
        Some(Versions {
            service: svc.metadata.resource_version.clone()?,
            slices: slices
                .iter()
                .map(|s| s.metadata.resource_version.clone())
                .collect::<Option<_>>()?,
            zone: zone.map(str::to_owned),
        })
    }
}

/// Taints that say a node is going away: the cluster autoscaler's before a
/// scale-down, and the one for a node that is out of service.
pub const LEAVING_TAINTS: [&str; 2] = [
    "ToBeDeletedByClusterAutoscaler",
    "node.kubernetes.io/out-of-service",
];

/// Cordoned (`kubectl cordon`, `kubectl drain`), being deleted, or tainted
/// with one of [`LEAVING_TAINTS`].
pub fn node_is_leaving(node: &Node) -> bool {
    let spec = node.spec.as_ref();
    node.metadata.deletion_timestamp.is_some()
        || spec.and_then(|s| s.unschedulable).unwrap_or(false)
        || spec
            .and_then(|s| s.taints.as_ref())
            .is_some_and(|t| t.iter().any(|t| LEAVING_TAINTS.contains(&t.key.as_str())))
}

/// The Node's Pod CIDRs (`spec.podCIDRs`, else `spec.podCIDR`); unparsable
/// ones are left out.
fn pod_cidrs(node: &Node) -> Vec<IpNet> {
    let spec = node.spec.as_ref();
    let listed = spec.and_then(|s| s.pod_cidrs.clone()).unwrap_or_default();
    let single = spec.and_then(|s| s.pod_cidr.clone());
    let cidrs = if listed.is_empty() {
        Vec::from_iter(single)
    } else {
        listed
    };
    cidrs.iter().filter_map(|c| c.parse().ok()).collect()
}

/// Everything the watcher's stores hold, by reference.
pub struct ClusterView<'a> {
    pub services: &'a [&'a Service],
    pub slices: &'a [&'a Slice],
    /// This node; `None` when it does not exist (yet).
    pub node: Option<&'a Node>,
}

fn key(ns: &str, name: &str) -> String {
    format!("{ns}/{name}")
}

/// Computes the data-plane services for `view`. `previous` is the last
/// result: a Service whose new version cannot be used (a bad annotation, an
/// unsupported protocol) keeps what it had, so bad input changes nothing.
pub fn desired_services(
    view: &ClusterView<'_>,
    opts: &SourceOptions,
    previous: &Desired,
) -> Desired {
    let mut out = Desired::default();
    let zone = view
        .node
        .and_then(|n| n.metadata.labels.as_ref())
        .and_then(|l| l.get(ZONE_LABEL))
        .map(String::as_str);
    if let Some(node) = view.node {
        out.leaving = node_is_leaving(node);
        out.pod_cidrs = pod_cidrs(node);
        let labels = node.metadata.labels.as_ref();
        if labels.is_some_and(|l| l.contains_key(EXCLUDE_LABEL)) {
            out.excluded = true;
            out.problems.push(format!(
                "node {} has the label {EXCLUDE_LABEL}: serving no Services",
                opts.node_name
            ));
            return out;
        }
    }
    // Slices by (namespace, service name).
    let mut slices: BTreeMap<(&str, &str), Vec<&Slice>> = BTreeMap::new();
    for s in view.slices {
        let ns = s.metadata.namespace.as_deref().unwrap_or("");
        if let Some(svc) = s
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL))
        {
            slices.entry((ns, svc.as_str())).or_default().push(s);
        }
    }
    // Oldest first, so that when two Services claim one VIP:port the older
    // one keeps it (the same rule the address allocator uses).
    let mut services: Vec<&Service> = view
        .services
        .iter()
        .copied()
        .filter(|s| serves(s, &opts.load_balancer_class, opts.default_class))
        .collect();
    services.sort_by(|a, b| age(a).cmp(&age(b)));
    let mut taken: BTreeMap<(IpAddr, u16, Protocol), String> = BTreeMap::new();
    for svc in services {
        let ns = svc.metadata.namespace.as_deref().unwrap_or("");
        let name = svc.metadata.name.as_deref().unwrap_or("");
        let k = key(ns, name);
        let own_slices = slices.get(&(ns, name)).map(Vec::as_slice).unwrap_or(&[]);
        let made = previous
            .made_from
            .get(&k)
            .filter(|m| m.versions.are_of(svc, own_slices, zone));
        let result = match made {
            Some(m) => {
                out.made_from.insert(k.clone(), m.clone());
                Ok((m.services.clone(), m.notes.clone()))
            }
            None => service_configs(svc, own_slices, opts, zone).map(|(configs, notes)| {
                let configs: Vec<_> = configs.into_iter().map(Arc::new).collect();
                if let Some(versions) = Versions::of(svc, own_slices, zone) {
                    let made = Made {
                        versions,
                        services: configs.clone(),
                        notes: notes.clone(),
                    };
                    out.made_from.insert(k.clone(), Arc::new(made));
                }
                (configs, notes)
            }),
        };
        let configs = match result {
            Ok((configs, mut notes)) => {
                out.problems.append(&mut notes);
                configs
            }
            Err(problem) => {
                let kept = previous.by_service.get(&k).cloned().unwrap_or_default();
                let what = if kept.is_empty() {
                    if let Ok((vips, ports)) = addresses(svc, &mut Vec::new()) {
                        for vip in vips {
                            out.held
                                .extend(ports.iter().map(|&(_, port, proto)| (vip, port, proto)));
                        }
                    }
                    "what the data plane already has for its addresses is left as it is, nothing new is served"
                } else {
                    "keeping its previous state"
                };
                out.problems.push(format!("Service {k}: {problem}; {what}"));
                kept
            }
        };
        let mut accepted = Vec::with_capacity(configs.len());
        for c in configs {
            match taken.get(&(c.vip, c.port, c.protocol)) {
                Some(owner) => out.problems.push(format!(
                    "Service {k}: {}:{}/{} is already served for Service {owner}",
                    c.vip,
                    c.port,
                    c.protocol.name()
                )),
                None => {
                    taken.insert((c.vip, c.port, c.protocol), k.clone());
                    accepted.push(c);
                }
            }
        }
        out.services.extend(accepted.iter().cloned());
        out.by_service.insert(k, accepted);
    }
    out
}

/// What orders Services oldest first: creation time, then namespace and name.
fn age(
    s: &Service,
) -> (
    Option<k8s_openapi::jiff::Timestamp>,
    Option<&str>,
    Option<&str>,
) {
    (
        s.metadata.creation_timestamp.as_ref().map(|t| t.0),
        s.metadata.namespace.as_deref(),
        s.metadata.name.as_deref(),
    )
}

fn parse_protocol(p: Option<&str>) -> Result<Protocol, String> {
    match p.unwrap_or("TCP") {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        other => Err(format!(
            "protocol {other} is not supported (TCP and UDP are)"
        )),
    }
}

/// One Service's data-plane services, plus notes on what was skipped; `Err`
/// when the object as a whole is unusable.
fn service_configs(
    svc: &Service,
    slices: &[&Slice],
    opts: &SourceOptions,
    zone: Option<&str>,
) -> Result<(Vec<DesiredService>, Vec<String>), String> {
    let ns = svc.metadata.namespace.as_deref().unwrap_or("");
    let name = svc.metadata.name.as_deref().unwrap_or("");
    let spec = svc.spec.as_ref().ok_or("no spec")?;
    let mode = match annotation(svc, MODE_ANNOTATION) {
        None => opts.mode,
        Some("nat") => Mode::Nat,
        Some("snat") => Mode::Snat,
        Some(other) => {
            return Err(format!(
                "annotation {MODE_ANNOTATION}: {other:?} is neither nat nor snat"
            ))
        }
    };
    let local = spec.external_traffic_policy.as_deref() == Some("Local");
    let here = Here {
        node: &opts.node_name,
        zone,
        local,
        distribution: spec.traffic_distribution.as_deref(),
    };
    let source_ranges = source_ranges(svc)?;
    let affinity = affinity(svc)?;
    let balance = balance(svc)?;
    let announce = announce(svc)?;
    let new_flow_limit = new_flow_limit(svc)?;
    let mut notes = Vec::new();
    let (vips, ports) = addresses(svc, &mut notes)?;
    let mut out = Vec::new();
    for &vip in &vips {
        for (port_name, port, protocol) in &ports {
            let backends = backends_for(slices, vip.is_ipv4(), port_name, *protocol, &here);
            let label = if port_name.is_empty() {
                port.to_string()
            } else {
                port_name.clone()
            };
            out.push(DesiredService {
                name: format!("{ns}/{name}:{label}"),
                vip,
                port: *port,
                protocol: *protocol,
                mode,
                backends,
                health_check: None,
                table_size: None,
                // Kubernetes semantics: a removed endpoint's flows end on
                // their own (the pod has its grace period).
                removed_backend_flows: RemovedBackendFlows::Keep,
                source_ranges: source_ranges.as_ref().map(|r| ranges_for(vip, r)),
                affinity,
                balance: balance.clone(),
                announce,
                new_flow_limit,
                local_endpoints_only: local,
            });
        }
    }
    Ok((out, notes))
}

/// Why the Service as a whole cannot be served (a bad annotation or field),
/// if so: what [`desired_services`] logs on every node, for the allocator's
/// Event.
pub fn spec_problem(svc: &Service) -> Option<String> {
    let opts = SourceOptions {
        load_balancer_class: String::new(),
        default_class: false,
        mode: Mode::Snat,
        node_name: String::new(),
    };
    service_configs(svc, &[], &opts, None).err()
}

/// The annotation kube-proxy reads when `spec.loadBalancerSourceRanges` is empty.
pub const SOURCE_RANGES_ANNOTATION: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";

/// `spec.loadBalancerSourceRanges`, or when that is empty the annotation
/// (comma-separated), as kube-proxy reads them; `None`: open to all.
/// Host bits are cleared, as kube-proxy does. A range the API server let
/// through but that is not a CIDR makes the whole Service unusable (it keeps
/// its last good state): serving it open would be a hole.
fn source_ranges(svc: &Service) -> Result<Option<Vec<IpNet>>, String> {
    let field: Vec<&str> = svc
        .spec
        .as_ref()
        .and_then(|s| s.load_balancer_source_ranges.as_ref())
        .into_iter()
        .flatten()
        .map(String::as_str)
        .filter(|s| !s.trim().is_empty())
        .collect();
    let (entries, what) = if field.is_empty() {
        let annotation = svc
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(SOURCE_RANGES_ANNOTATION));
        let Some(a) = annotation.filter(|a| !a.trim().is_empty()) else {
            return Ok(None);
        };
        let entries: Vec<&str> = a.split(',').filter(|s| !s.trim().is_empty()).collect();
        (entries, format!("annotation {SOURCE_RANGES_ANNOTATION}"))
    } else {
        (field, "loadBalancerSourceRanges".to_string())
    };
    if entries.len() > lb_common::MAX_SOURCE_RANGES as usize / 2 {
        return Err(format!(
            "{what}: {} ranges are more than the data plane holds for one Service ({})",
            entries.len(),
            lb_common::MAX_SOURCE_RANGES / 2
        ));
    }
    entries
        .iter()
        .map(|e| parse_source_range(e, false).map_err(|m| format!("{what}: {m}")))
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// `sessionAffinity: ClientIP` and its timeout (validated as the API server
/// does, for objects that reached us some other way).
/// The `xlb.dev/balance` and `xlb.dev/agent-check-port` annotations.
fn balance(svc: &Service) -> Result<Balance, String> {
    let get = |k: &str| annotation(svc, k);
    let agent_check = match get(AGENT_CHECK_PORT_ANNOTATION) {
        None => None,
        Some(p) => match p.parse::<u16>() {
            Ok(port) if port > 0 => Some(AgentCheck { port }),
            _ => {
                return Err(format!(
                    "annotation {AGENT_CHECK_PORT_ANNOTATION}: {p:?} is not a port (1-65535)"
                ))
            }
        },
    };
    match get(BALANCE_ANNOTATION) {
        Some("load-aware") => Ok(Balance::LoadAware { agent_check }),
        None | Some("static") if agent_check.is_some() => Err(format!(
            "annotation {AGENT_CHECK_PORT_ANNOTATION} needs {BALANCE_ANNOTATION}: load-aware"
        )),
        None | Some("static") => Ok(Balance::Static),
        Some(other) => Err(format!(
            "annotation {BALANCE_ANNOTATION}: {other:?} is neither static nor load-aware"
        )),
    }
}

/// The `xlb.dev/announce` annotation.
fn announce(svc: &Service) -> Result<Announce, String> {
    match annotation(svc, ANNOUNCE_ANNOTATION) {
        None => Ok(Announce::Both),
        Some(v) => Announce::parse(v).ok_or_else(|| {
            format!("annotation {ANNOUNCE_ANNOTATION}: {v:?} is none of bgp, l2, both")
        }),
    }
}

/// The `xlb.dev/new-flow-limit` annotation.
fn new_flow_limit(svc: &Service) -> Result<Option<NewFlowLimit>, String> {
    let Some(v) = annotation(svc, NEW_FLOW_LIMIT_ANNOTATION) else {
        return Ok(None);
    };
    let bad = |why: String| format!("annotation {NEW_FLOW_LIMIT_ANNOTATION}: {v:?}: {why}");
    let mut fields: BTreeMap<&str, u32> = BTreeMap::new();
    for part in v.split(',').map(str::trim) {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| bad(format!("{part:?} is not key=value")))?;
        let n = value
            .trim()
            .parse::<u32>()
            .map_err(|_| bad(format!("{key}: {value:?} is not a number")))?;
        fields.insert(key.trim(), n);
    }
    let get = |key: &str, default: Option<u32>, lo: u32, hi: u32| match fields
        .get(key)
        .copied()
        .or(default)
    {
        None => Err(bad(format!("{key} is required"))),
        Some(n) if (lo..=hi).contains(&n) => Ok(n),
        Some(n) => Err(bad(format!("{key} must be {lo} to {hi}, not {n}"))),
    };
    if let Some(k) = fields
        .keys()
        .find(|k| !["per-second", "burst", "ipv4-prefix", "ipv6-prefix"].contains(k))
    {
        return Err(bad(format!(
            "unknown key {k:?} (per-second, burst, ipv4-prefix, ipv6-prefix)"
        )));
    }
    let per_second = get("per-second", None, 1, NewFlowLimit::MAX_PER_SECOND)?;
    Ok(Some(NewFlowLimit {
        per_second,
        burst: get("burst", Some(per_second), 1, NewFlowLimit::MAX_PER_SECOND)?,
        ipv4_prefix: get("ipv4-prefix", Some(32), 0, 32)? as u8,
        ipv6_prefix: get("ipv6-prefix", Some(64), 0, 128)? as u8,
    }))
}

fn annotation<'a>(svc: &'a Service, key: &str) -> Option<&'a str> {
    svc.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(|v| v.trim())
}

fn affinity(svc: &Service) -> Result<Option<ClientAffinity>, String> {
    let Some(spec) = svc.spec.as_ref() else {
        return Ok(None);
    };
    match spec.session_affinity.as_deref() {
        None | Some("None") => Ok(None),
        Some("ClientIP") => {
            let secs = spec
                .session_affinity_config
                .as_ref()
                .and_then(|c| c.client_ip.as_ref())
                .and_then(|c| c.timeout_seconds);
            let timeout = match secs {
                None => DEFAULT_AFFINITY_TIMEOUT,
                Some(s) if s >= 1 && s as u64 <= MAX_AFFINITY_TIMEOUT.as_secs() => {
                    std::time::Duration::from_secs(s as u64)
                }
                Some(s) => {
                    return Err(format!(
                        "sessionAffinityConfig.clientIP.timeoutSeconds {s} is out of range (1 to 86400)"
                    ))
                }
            };
            Ok(Some(ClientAffinity { timeout }))
        }
        Some(other) => Err(format!(
            "sessionAffinity {other:?} is not supported (None and ClientIP are)"
        )),
    }
}

/// The well-known label with a Node's zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";

/// Where this agent runs, and what the Service asks of the endpoints.
struct Here<'a> {
    node: &'a str,
    zone: Option<&'a str>,
    /// `externalTrafficPolicy: Local`: this node's endpoints or none.
    local: bool,
    /// `spec.trafficDistribution`: a preference, with a fallback to all.
    distribution: Option<&'a str>,
}

/// Where a Service is served: its ingress addresses (ones that are not
/// addresses are noted and skipped), and its ports (name, port, protocol).
type Addresses = (BTreeSet<IpAddr>, Vec<(String, u16, Protocol)>);

fn addresses(svc: &Service, notes: &mut Vec<String>) -> Result<Addresses, String> {
    let ns = svc.metadata.namespace.as_deref().unwrap_or("");
    let name = svc.metadata.name.as_deref().unwrap_or("");
    let mut vips = BTreeSet::new();
    for ing in super::ingress(svc) {
        match ing.ip.as_deref().map(str::parse::<IpAddr>) {
            Some(Ok(ip)) => {
                vips.insert(ip);
            }
            Some(Err(_)) => notes.push(format!(
                "Service {ns}/{name}: ingress ip {:?} is not an address; skipped",
                ing.ip.as_deref().unwrap_or_default()
            )),
            // Hostname-only ingress: nothing to serve on this node.
            None => {}
        }
    }
    let mut ports = Vec::new();
    for p in svc.spec.iter().flat_map(|s| s.ports.iter().flatten()) {
        let protocol = parse_protocol(p.protocol.as_deref())?;
        let port = u16::try_from(p.port)
            .ok()
            .filter(|&p| p > 0)
            .ok_or_else(|| format!("port {} is out of range", p.port))?;
        ports.push((p.name.clone().unwrap_or_default(), port, protocol));
    }
    Ok((vips, ports))
}

/// An endpoint of one port, with what its hints say about this node.
struct Candidate {
    ip: IpAddr,
    port: u16,
    weight: u32,
    /// Its Pod's UID, when the Pod runs on this node (its cgroup is here).
    local_pod: Option<String>,
    /// `hints.forNodes` names this node (`None`: no node hints).
    for_this_node: Option<bool>,
    /// `hints.forZones` names this node's zone (`None`: no zone hints).
    for_this_zone: Option<bool>,
}

/// Backends of one (VIP family, port) from the Service's slices. An address
/// in several slices (a pod moving between slices) counts once, ready wins.
fn backends_for(
    slices: &[&Slice],
    ipv4: bool,
    port_name: &str,
    protocol: Protocol,
    here: &Here<'_>,
) -> Vec<DesiredBackend> {
    let family = if ipv4 { "IPv4" } else { "IPv6" };
    let mut candidates = Vec::new();
    for slice in slices {
        if slice.address_type != family {
            continue;
        }
        let Some(port) = slice.ports.iter().find_map(|p| {
            let same_name = p.name.as_deref().unwrap_or("") == port_name;
            let same_proto = parse_protocol(p.protocol.as_deref()).ok() == Some(protocol);
            (same_name && same_proto)
                .then_some(p.port)
                .flatten()
                .and_then(|n| u16::try_from(n).ok())
                .filter(|&n| n > 0)
        }) else {
            continue;
        };
        for ep in &slice.endpoints {
            let on_this_node = ep.node.as_deref() == Some(here.node);
            if here.local && !on_this_node {
                continue;
            }
            let ready = ep.ready.unwrap_or(true);
            let serving = ep.serving.unwrap_or(ready);
            let terminating = ep.terminating.unwrap_or(false);
            let weight = if ready {
                1
            } else if serving && terminating {
                0
            } else {
                continue;
            };
            let Some(ip) = ep.ip else {
                continue;
            };
            if ip.is_ipv4() != ipv4 {
                continue;
            }
            let for_this_node = ep.for_nodes().map(|n| n.iter().any(|n| **n == *here.node));
            let for_this_zone = ep
                .for_zones()
                .map(|z| here.zone.is_some_and(|zone| z.iter().any(|z| **z == *zone)));
            let local_pod = ep
                .pod_uid
                .as_deref()
                .filter(|_| on_this_node)
                .map(String::from);
            candidates.push(Candidate {
                ip,
                port,
                weight,
                local_pod,
                for_this_node,
                for_this_zone,
            });
        }
    }
    let keep = preferred(&candidates, here);
    let mut chosen: BTreeMap<(IpAddr, u16), (u32, Option<&String>)> = BTreeMap::new();
    for c in candidates.iter().filter(|c| keep(c)) {
        let (w, pod) = chosen.entry((c.ip, c.port)).or_insert((c.weight, None));
        *w = (*w).max(c.weight);
        *pod = pod.or(c.local_pod.as_ref());
    }
    chosen
        .into_iter()
        .map(|((ip, port), (weight, pod))| DesiredBackend {
            ip,
            port,
            weight,
            cgroup: pod.map(|uid| Box::new(BackendCgroup::Pod(uid.clone()))),
            // Weight 0 only comes from a terminating endpoint.
            terminating: weight == 0,
        })
        .collect()
}

/// Which candidates take part under the Service's `trafficDistribution`, by
/// kube-proxy's rules: hints are used only when every ready endpoint has
/// them (a controller that wrote some hints but not all is not trusted),
/// and only when they leave this node at least one ready endpoint; else
/// the next wider set (this node, then this zone, then all).
fn preferred<'a>(candidates: &'a [Candidate], here: &Here<'_>) -> impl Fn(&Candidate) -> bool + 'a {
    let ready: Vec<&Candidate> = candidates.iter().filter(|c| c.weight > 0).collect();
    let usable = |hint: fn(&Candidate) -> Option<bool>| {
        !ready.is_empty()
            && ready.iter().all(|c| hint(c).is_some())
            && ready.iter().any(|c| hint(c) == Some(true))
    };
    let by_node: fn(&Candidate) -> Option<bool> = |c| c.for_this_node;
    let by_zone: fn(&Candidate) -> Option<bool> = |c| c.for_this_zone;
    let scope: Option<fn(&Candidate) -> Option<bool>> = match (here.local, here.distribution) {
        (true, _) => None,
        (false, Some("PreferSameNode")) if usable(by_node) => Some(by_node),
        (false, Some("PreferSameNode" | "PreferSameZone" | "PreferClose")) if usable(by_zone) => {
            Some(by_zone)
        }
        _ => None,
    };
    move |c: &Candidate| scope.is_none_or(|hint| hint(c) == Some(true))
}

/// The VIPs of `desired` that have at least one backend taking new flows;
/// used in logs and tests.
pub fn serving_vips(desired: &Desired) -> BTreeSet<IpAddr> {
    desired
        .services
        .iter()
        .filter(|s| s.backends.iter().any(|b| b.weight > 0))
        .map(|s| s.vip)
        .collect()
}

#[cfg(test)]
mod tests;
