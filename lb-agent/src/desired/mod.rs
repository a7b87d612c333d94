//! The agent's decisions, as pure functions of what it knows: the services
//! the config file and Kubernetes ask for, the backends' health and load,
//! and the node's settings.
//!
//! - [`compute`]: the data-plane spec of every service, the load
//!   controller's targets and how each VIP is announced;
//! - [`plan`]: the writes that take the data plane from what it has to that;
//! - [`servable_vips`] and [`routes`]: what BGP and L2 mode announce.
//!
//! The agent's event loop (`crate::agent`) gathers the inputs, applies the
//! plan and hands the routes on. Nothing here does I/O, so every decision
//! is unit-tested without root (`tests.rs`).
//!
//! Computing is incremental: a service whose inputs are those the previous
//! state was computed from (the same `Arc`, the same generation, and the
//! same health or load snapshot where it reads them) keeps its previous
//! result, and [`plan`] compares with the data plane only what was computed
//! afresh. One changed Service among thousands costs one service's work.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use lb_common::{net::service_key, ServiceKey};

use crate::{
    bgp::Route,
    config::{AgentConfig, BgpConfig},
    dataplane::{Protocol, ServiceSpec},
    health::HealthSnapshot,
    k8s::desired::Desired,
    load_aware::{
        controller::{Params, SCALE},
        LoadTarget, LoadWeights,
    },
    service::{Announce, Balance, DesiredService, Mode, RemovedBackendFlows},
};

#[cfg(test)]
mod tests;

/// A VIP, port and protocol: what one data-plane service answers on.
pub type Address = (IpAddr, u16, Protocol);

/// What every service's result depends on besides the service itself.
#[derive(Clone, Debug, Default)]
pub struct Context {
    /// Changes whenever the config or the node's routes do: every service
    /// is then computed afresh.
    pub generation: u64,
    pub health: HealthSnapshot,
    pub load: LoadWeights,
}

pub struct Inputs<'a> {
    /// The config file's services; they win over Kubernetes' on one address.
    pub file: &'a [Arc<DesiredService>],
    /// Kubernetes' desired state, when the agent watches a cluster.
    pub cluster: Option<&'a Desired>,
    /// The SNAT addresses, and whether flows are exchanged with peers.
    pub config: &'a AgentConfig,
    pub context: Context,
    /// Whether a backend address is behind the pod network's overlay.
    pub overlay: &'a dyn Fn(IpAddr) -> bool,
}

/// One service as the data plane should have it.
#[derive(Clone, Debug)]
pub struct Wanted {
    /// What it was made from.
    pub service: Arc<DesiredService>,
    /// With failing backends out and load-aware weights applied; shared
    /// with the data plane once programmed.
    pub spec: Arc<ServiceSpec>,
    /// A nat service served in snat: its backends are behind an overlay
    /// that masquerades what the node forwards there.
    pub nat_over_overlay: bool,
    /// For a load-aware service, what its controller balances.
    pub load_target: Option<LoadTarget>,
}

impl Wanted {
    /// Every configured backend, those health checks took out included.
    pub fn configured(&self) -> impl Iterator<Item = SocketAddr> + '_ {
        self.service.backends.iter().map(|b| b.addr())
    }
}

/// The desired state of this node.
#[derive(Clone, Debug, Default)]
pub struct State {
    /// Shared with the states before and after while unchanged.
    pub services: BTreeMap<ServiceKey, Arc<Wanted>>,
    /// Kubernetes Services broken since before this agent started: what the
    /// data plane has for them stays as it is.
    pub held: BTreeSet<ServiceKey>,
    /// Addresses both the file and Kubernetes ask for, with the Kubernetes
    /// Service left out (the file wins).
    pub shadowed: BTreeMap<Address, String>,
    /// How each VIP is announced: its services' `announce`, together.
    pub announce_by_vip: BTreeMap<IpAddr, Announce>,
    /// VIPs of a service that only nodes with local endpoints serve: BGP
    /// announces them as host routes, never aggregated.
    pub host_route_vips: BTreeSet<IpAddr>,
    /// The services computed afresh (new or changed); the others are as
    /// the previous state had them.
    pub changed: BTreeSet<ServiceKey>,
    /// Services whose write failed: computed afresh next time.
    retry: BTreeSet<ServiceKey>,
    /// What this state was computed with.
    context: Context,
}

impl State {
    pub fn load_targets(&self) -> Vec<LoadTarget> {
        self.services
            .values()
            .filter_map(|w| w.load_target.clone())
            .collect()
    }

    /// The nat services served in snat because of an overlay, by name.
    pub fn nat_over_overlay(&self) -> BTreeSet<String> {
        self.services
            .values()
            .filter(|w| w.nat_over_overlay)
            .map(|w| w.service.name.clone())
            .collect()
    }

    /// Has `key` computed afresh next time (its write failed).
    pub fn retry(&mut self, key: ServiceKey) {
        self.retry.insert(key);
    }

    pub fn context(&self) -> &Context {
        &self.context
    }
}

fn address(s: &DesiredService) -> Address {
    (s.vip, s.port, s.protocol)
}

fn key_of(s: &DesiredService) -> ServiceKey {
    service_key(s.vip, s.port, s.protocol.number())
}

/// The desired state for `inputs`, reusing from `previous` what did not change.
pub fn compute(inputs: &Inputs<'_>, previous: &State) -> State {
    let ctx = &inputs.context;
    let same_generation = previous.context.generation == ctx.generation;
    let same_health = Arc::ptr_eq(&previous.context.health, &ctx.health);
    let same_load = Arc::ptr_eq(&previous.context.load, &ctx.load);
    let unchanged = |w: &Wanted, svc: &Arc<DesiredService>| {
        same_generation
            && Arc::ptr_eq(&w.service, svc)
            && (svc.health_check.is_none() || same_health)
            && (!svc.balance.is_load_aware() || same_load)
    };

    let mut out = State {
        context: ctx.clone(),
        ..Default::default()
    };
    let in_file: BTreeSet<Address> = inputs.file.iter().map(|s| address(s)).collect();
    let file = inputs.file.iter().map(|s| (s, true));
    let cluster = inputs.cluster.into_iter().flat_map(|d| &d.services);
    for (svc, from_file) in file.chain(cluster.map(|s| (s, false))) {
        if !from_file && in_file.contains(&address(svc)) {
            out.shadowed.insert(address(svc), svc.name.clone());
            continue;
        }
        let key = key_of(svc);
        out.announce_by_vip
            .entry(svc.vip)
            .and_modify(|a| *a = a.union(svc.announce))
            .or_insert(svc.announce);
        if svc.local_endpoints_only {
            out.host_route_vips.insert(svc.vip);
        }
        let wanted = match previous.services.get(&key) {
            Some(w) if unchanged(w, svc) && !previous.retry.contains(&key) => w.clone(),
            _ => {
                out.changed.insert(key);
                Arc::new(wanted(svc, from_file, inputs))
            }
        };
        out.services.insert(key, wanted);
    }
    out.held = inputs
        .cluster
        .into_iter()
        .flat_map(|d| &d.held)
        .map(|&(vip, port, proto)| service_key(vip, port, proto.number()))
        .collect();
    out
}

/// One service's data-plane spec and load target.
fn wanted(svc: &Arc<DesiredService>, from_file: bool, inputs: &Inputs<'_>) -> Wanted {
    let config = inputs.config;
    let mut spec = config.service_spec(svc);
    // The kernel forwards into the overlay, where the pod network
    // masquerades a client's address (flannel's `--ip-masq`): the
    // backend's answer would miss the flow. The file's services are served
    // as written: their author knows whether the overlay masquerades.
    let nat_over_overlay =
        svc.mode == Mode::Nat && !from_file && svc.backends.iter().any(|b| (inputs.overlay)(b.ip));
    if nat_over_overlay {
        spec.snat = match svc.vip {
            IpAddr::V4(_) => config.snat_ipv4.map(IpAddr::V4),
            IpAddr::V6(_) => config.snat_ipv6.map(IpAddr::V6),
        };
    }
    if svc.health_check.is_some() {
        let health = &inputs.context.health;
        spec.backends
            .retain(|b| health.get(&b.addr).is_none_or(|h| h.healthy));
    }
    let load_target = match &svc.balance {
        Balance::LoadAware { agent_check } => {
            let target = LoadTarget {
                key: spec.key(),
                name: svc.name.clone(),
                backends: spec.backends.iter().map(|b| (b.addr, b.weight)).collect(),
                agent_check: *agent_check,
                cgroups: svc
                    .backends
                    .iter()
                    .filter_map(|b| Some((b.addr(), b.cgroup.as_deref()?.clone())))
                    .collect(),
                least_loaded: spec.least_loaded,
            };
            apply_load(&mut spec, &inputs.context.load);
            Some(target)
        }
        Balance::Static => None,
    };
    Wanted {
        service: svc.clone(),
        spec: Arc::new(spec),
        nat_over_overlay,
        load_target,
    }
}

/// A load-aware service's weights: the controller's where it decided,
/// else the configured weights on its scale (a backend it has not seen yet
/// starts at the ramp, as it would there). Backends that reported `down`
/// are out.
fn apply_load(spec: &mut ServiceSpec, load: &LoadWeights) {
    let Some(l) = load.get(&spec.key()) else {
        return;
    };
    let ramp = Params::for_service(spec.least_loaded).ramp_start;
    spec.backends
        .retain(|b| !l.backends.get(&b.addr).is_some_and(|d| d.decision.down));
    for b in &mut spec.backends {
        b.weight = match l.backends.get(&b.addr) {
            Some(d) => d.decision.weight,
            None if b.weight == 0 => 0,
            None => ((b.weight as f64 * SCALE * ramp).round() as u32).max(1),
        };
    }
}

/// The writes that take the data plane from `current` to `desired`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Services to write, each with the backends whose flows are reset
    /// (those it loses, where it asks for `Reset`).
    pub set: Vec<(ServiceKey, Vec<SocketAddr>)>,
    /// Services to remove: neither desired nor held.
    pub remove: Vec<ServiceKey>,
}

/// Compares with `current` (what the data plane has) only the services
/// `desired` computed afresh; the others were written before.
pub fn plan<'a>(
    current: impl IntoIterator<Item = (&'a ServiceKey, &'a ServiceSpec)>,
    desired: &State,
) -> Plan {
    let mut out = Plan::default();
    let mut present = BTreeSet::new();
    for (key, spec) in current {
        present.insert(*key);
        let Some(want) = desired.services.get(key) else {
            if !desired.held.contains(key) {
                out.remove.push(*key);
            }
            continue;
        };
        if !desired.changed.contains(key) || *want.spec == *spec {
            continue;
        }
        let gone = match want.service.removed_backend_flows {
            RemovedBackendFlows::Keep => Vec::new(),
            RemovedBackendFlows::Reset => spec
                .backends
                .iter()
                .filter(|b| !want.spec.backends.iter().any(|n| n.addr == b.addr))
                .map(|b| b.addr)
                .collect(),
        };
        out.set.push((*key, gone));
    }
    for key in &desired.changed {
        if !present.contains(key) {
            out.set.push((*key, Vec::new()));
        }
    }
    out
}

/// The VIPs the node can serve now (a programmed service on the VIP has a
/// backend with weight) and announces the way `by` asks.
pub fn servable_vips<'a>(
    programmed: impl IntoIterator<Item = &'a ServiceSpec>,
    announce_by_vip: &BTreeMap<IpAddr, Announce>,
    by: fn(Announce) -> bool,
) -> BTreeSet<IpAddr> {
    programmed
        .into_iter()
        .filter(|spec| spec.backends.iter().any(|b| b.weight > 0))
        .map(|spec| spec.vip)
        .filter(|vip| by(announce_by_vip.get(vip).copied().unwrap_or_default()))
        .collect()
}

/// One host route per VIP, with this node's address of its family as next
/// hop; and the VIPs left out for want of one.
pub fn routes(
    vips: &BTreeSet<IpAddr>,
    bgp: &BgpConfig,
    hop4: Option<IpAddr>,
    hop6: Option<IpAddr>,
) -> (BTreeSet<Route>, Vec<IpAddr>) {
    let mut routes = BTreeSet::new();
    let mut no_hop = Vec::new();
    for &vip in vips {
        match if vip.is_ipv4() { hop4 } else { hop6 } {
            Some(next_hop) => {
                routes.insert(Route {
                    prefix: vip.into(),
                    next_hop,
                    communities: bgp.communities.clone(),
                    large_communities: bgp.large_communities.clone(),
                    local_pref: bgp.local_pref,
                });
            }
            None => no_hop.push(vip),
        }
    }
    (routes, no_hop)
}
