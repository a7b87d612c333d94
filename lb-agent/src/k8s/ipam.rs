//! Pure address-pool arithmetic and allocation decisions.
//!
//! Nothing here talks to the API server. [`Pools::build`] turns
//! `LoadBalancerPool` specs into usable pools (or says why one is not),
//! [`ServiceRequest::from_service`] reads what a Service asks for, and
//! [`allocate`] decides, for every Service at once, which addresses it holds.
//! The decision is recomputed from the live objects each time, so an address
//! is released simply because its Service is no longer among them.
//!
//! Who wins when two Services want one address: an address a Service already
//! holds (in its `status.loadBalancer.ingress`) is not free for anyone else
//! unless they may share it ([`super::sharing`]); between two holders, or two
//! requesters of a free address, the older Service (creation time, then
//! namespace/name) wins. A Service that may share looks for an address its
//! partners hold before it takes a free one. The result does not depend on
//! the order of the inputs.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::jiff::Timestamp;

use super::sharing::Sharing;
use super::IP_ANNOTATION;
use super::POOL_ANNOTATION;

mod pools;

pub use self::pools::{AddressRange, Family, Pool, PoolInput, PoolScope, Pools, SIZE_CAP};

/// A Service's namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceName {
    pub namespace: String,
    pub name: String,
}

impl ServiceName {
    pub fn new(namespace: &str, name: &str) -> ServiceName {
        ServiceName {
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// `spec.ipFamilyPolicy`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FamilyPolicy {
    #[default]
    SingleStack,
    PreferDualStack,
    RequireDualStack,
}

/// What one Service asks for, as read from the object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceRequest {
    pub key: ServiceName,
    pub created: Option<Timestamp>,
    /// The `xlb.dev/pool` annotation.
    pub pool: Option<String>,
    /// Requested addresses (at most one per family).
    pub requested: Vec<IpAddr>,
    /// `spec.ipFamilies`, in order of preference (may be empty).
    pub families: Vec<Family>,
    pub policy: FamilyPolicy,
    /// The addresses in `status.loadBalancer.ingress` now.
    pub current: Vec<IpAddr>,
    /// Why the request cannot be read (a malformed annotation or field).
    pub bad_request: Option<String>,
    /// With whom it may share an address.
    pub sharing: Sharing,
    /// The Service's labels and its namespace's (for scoped pools).
    pub labels: BTreeMap<String, String>,
    pub namespace_labels: BTreeMap<String, String>,
}

impl ServiceRequest {
    /// A request with defaults, for building by hand.
    pub fn new(namespace: &str, name: &str) -> ServiceRequest {
        ServiceRequest {
            key: ServiceName::new(namespace, name),
            created: None,
            pool: None,
            requested: Vec::new(),
            families: Vec::new(),
            policy: FamilyPolicy::SingleStack,
            current: Vec::new(),
            bad_request: None,
            sharing: Sharing::default(),
            labels: BTreeMap::new(),
            namespace_labels: BTreeMap::new(),
        }
    }

    /// Reads a Service: its pool and address annotations,
    /// `spec.loadBalancerIP`, its families and its current ingress.
    pub fn from_service(svc: &Service) -> ServiceRequest {
        let meta = &svc.metadata;
        let mut req = ServiceRequest::new(
            meta.namespace.as_deref().unwrap_or("default"),
            meta.name.as_deref().unwrap_or(""),
        );
        req.created = meta.creation_timestamp.as_ref().map(|t| t.0);
        req.sharing = Sharing::from_service(svc);
        req.labels = meta.labels.clone().unwrap_or_default();
        let annotation = |key: &str| {
            meta.annotations
                .as_ref()
                .and_then(|a| a.get(key))
                .map(|v| v.trim())
                .filter(|v| !v.is_empty())
        };
        req.pool = annotation(POOL_ANNOTATION).map(str::to_string);
        let mut problems = Vec::new();

        let spec = svc.spec.as_ref();
        let from_annotation = annotation(IP_ANNOTATION).map(|v| parse_requested(IP_ANNOTATION, v));
        let from_field = spec
            .and_then(|s| s.load_balancer_ip.as_deref())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(|v| parse_requested("spec.loadBalancerIP", v));
        match (from_annotation, from_field) {
            (Some(Err(e)), _) | (_, Some(Err(e))) => problems.push(e),
            (Some(Ok(a)), Some(Ok(f))) => {
                let (sa, sf): (BTreeSet<_>, BTreeSet<_>) = (a.iter().collect(), f.iter().collect());
                if sa != sf {
                    problems.push(format!(
                        "annotation {IP_ANNOTATION} and spec.loadBalancerIP ask for different addresses"
                    ));
                }
                req.requested = a;
            }
            (Some(Ok(a)), None) => req.requested = a,
            (None, Some(Ok(f))) => req.requested = f,
            (None, None) => {}
        }

        for name in spec
            .and_then(|s| s.ip_families.as_ref())
            .into_iter()
            .flatten()
        {
            match pools::from_k8s_name(name) {
                Some(f) if !req.families.contains(&f) => req.families.push(f),
                Some(_) => {}
                None => problems.push(format!("spec.ipFamilies: unknown family {name:?}")),
            }
        }
        req.policy = match spec.and_then(|s| s.ip_family_policy.as_deref()) {
            None | Some("SingleStack") => FamilyPolicy::SingleStack,
            Some("PreferDualStack") => FamilyPolicy::PreferDualStack,
            Some("RequireDualStack") => FamilyPolicy::RequireDualStack,
            Some(other) => {
                problems.push(format!("spec.ipFamilyPolicy: unknown policy {other:?}"));
                FamilyPolicy::SingleStack
            }
        };
        req.current = svc
            .status
            .as_ref()
            .and_then(|s| s.load_balancer.as_ref())
            .and_then(|lb| lb.ingress.as_ref())
            .into_iter()
            .flatten()
            .filter_map(|i| i.ip.as_deref()?.parse().ok())
            .collect();
        if !problems.is_empty() {
            req.bad_request = Some(problems.join("; "));
        }
        req
    }
}

/// Parses a comma-separated list of addresses, at most one per family.
pub fn parse_requested(what: &str, value: &str) -> Result<Vec<IpAddr>, String> {
    let mut out: Vec<IpAddr> = Vec::new();
    for item in value.split(',') {
        let item = item.trim();
        let ip: IpAddr = item
            .parse()
            .map_err(|_| format!("{what}: {item:?} is not an IP address"))?;
        if let Some(prev) = out.iter().find(|p| Family::of(**p) == Family::of(ip)) {
            return Err(format!(
                "{what}: two {} addresses ({prev} and {ip}); give at most one per family",
                Family::of(ip)
            ));
        }
        out.push(ip);
    }
    Ok(out)
}

/// Why a Service has no (or not all of its) addresses. The names are the
/// condition reasons and Event reasons the allocator writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FailureReason {
    /// No pool to take an address from (none auto-assigns, or the named one
    /// does not exist or is invalid).
    NoPool,
    /// The pools that could serve it have no free address of the family.
    PoolExhausted,
    /// The requested address belongs to another Service.
    AddressInUse,
    /// The requested address is in no pool (or not in the named one).
    AddressNotInPool,
    /// A malformed annotation or field.
    BadRequest,
    /// No pool has addresses of a family the Service needs.
    NoFamily,
    /// The named pool, or the pool of the requested address, is limited to
    /// other namespaces or Services (`serviceAllocation`).
    PoolNotAllowed,
}

impl FailureReason {
    pub const ALL: [FailureReason; 7] = [
        FailureReason::NoPool,
        FailureReason::PoolExhausted,
        FailureReason::AddressInUse,
        FailureReason::AddressNotInPool,
        FailureReason::BadRequest,
        FailureReason::NoFamily,
        FailureReason::PoolNotAllowed,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::NoPool => "NoPool",
            FailureReason::PoolExhausted => "PoolExhausted",
            FailureReason::AddressInUse => "AddressInUse",
            FailureReason::AddressNotInPool => "AddressNotInPool",
            FailureReason::BadRequest => "BadRequest",
            FailureReason::NoFamily => "NoFamily",
            FailureReason::PoolNotAllowed => "PoolNotAllowed",
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A reason and a message that stays the same while the problem does (it
/// becomes an Event only when it changes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    pub reason: FailureReason,
    pub message: String,
}

impl Failure {
    fn new(reason: FailureReason, message: impl Into<String>) -> Failure {
        Failure {
            reason,
            message: message.into(),
        }
    }
}

/// The outcome for one Service.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// The addresses it holds, primary family first.
    pub addresses: Vec<IpAddr>,
    /// Set when the Service did not get what it asked for. A Service with a
    /// malformed request keeps the addresses it had.
    pub failure: Option<Failure>,
    /// A second family PreferDualStack could not get.
    pub missing_optional: Option<Failure>,
}

/// The outcome for all Services.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    pub decisions: BTreeMap<ServiceName, Decision>,
    /// Addresses in use per usable pool (every usable pool is listed).
    pub in_use: BTreeMap<String, u64>,
}

/// What one Service needs, once its request is understood.
struct Plan<'p> {
    required: Vec<Family>,
    optional: Option<Family>,
    /// `Some`: the named pool; `None`: any pool for requests and current
    /// addresses, auto-assign pools for new ones.
    named: Option<&'p Pool>,
    requested: BTreeMap<Family, IpAddr>,
}

impl Plan<'_> {
    fn wants(&self, family: Family) -> bool {
        self.required.contains(&family) || self.optional == Some(family)
    }
}

fn plan<'p>(req: &ServiceRequest, pools: &'p Pools) -> Result<Plan<'p>, Failure> {
    if let Some(bad) = &req.bad_request {
        return Err(Failure::new(FailureReason::BadRequest, bad.clone()));
    }
    let named = match &req.pool {
        None => None,
        Some(name) => match (pools.get(name), pools.error(name)) {
            (Some(pool), _) => match pool.refuses(req) {
                None => Some(pool),
                Some(why) => {
                    return Err(Failure::new(
                        FailureReason::PoolNotAllowed,
                        format!("pool {name:?} may not serve Service {}: {why}", req.key),
                    ))
                }
            },
            (None, Some(err)) => {
                return Err(Failure::new(
                    FailureReason::NoPool,
                    format!("pool {name:?} is invalid: {err}"),
                ))
            }
            (None, None) => {
                return Err(Failure::new(
                    FailureReason::NoPool,
                    format!("pool {name:?} does not exist"),
                ))
            }
        },
    };
    // Preference order: spec.ipFamilies as the API server defaulted it;
    // without it (an object no API server defaulted), the requested
    // address's family, else IPv4, then the other.
    let explicit = !req.families.is_empty();
    let order: Vec<Family> = if explicit {
        req.families.clone()
    } else {
        let first = req
            .requested
            .first()
            .map_or(Family::V4, |ip| Family::of(*ip));
        vec![first, first.other()]
    };
    let (required, optional) = match req.policy {
        FamilyPolicy::SingleStack => (vec![order[0]], None),
        FamilyPolicy::PreferDualStack => (vec![order[0]], order.get(1).copied()),
        FamilyPolicy::RequireDualStack => (
            vec![order[0], order.get(1).copied().unwrap_or(order[0].other())],
            None,
        ),
    };
    let mut requested = BTreeMap::new();
    for ip in &req.requested {
        let family = Family::of(*ip);
        if !(required.contains(&family) || optional == Some(family)) {
            return Err(Failure::new(
                FailureReason::BadRequest,
                format!(
                    "requested address {ip} is {family} but the Service's families are {}",
                    required
                        .iter()
                        .chain(optional.iter())
                        .map(|f| pools::k8s_name(*f))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        requested.insert(family, *ip);
    }
    Ok(Plan {
        required,
        optional,
        named,
        requested,
    })
}

/// Address -> indexes of the Services holding it (more than one: shared).
type Holders = BTreeMap<IpAddr, Vec<usize>>;

/// Why Service `i` may not join the holders of an address, if so.
fn may_join(services: &[ServiceRequest], holders: &[usize], i: usize) -> Result<(), String> {
    holders.iter().filter(|&&h| h != i).try_for_each(|&h| {
        services[i]
            .sharing
            .compatible(&services[h].sharing, &services[h].key.to_string())
    })
}

fn hold(used: &mut Holders, ip: IpAddr, i: usize) {
    let h = used.entry(ip).or_default();
    if !h.contains(&i) {
        h.push(i);
    }
}

fn unhold(used: &mut Holders, ip: IpAddr, i: usize) {
    if let Some(h) = used.get_mut(&ip) {
        h.retain(|&x| x != i);
        if h.is_empty() {
            used.remove(&ip);
        }
    }
}

/// Working state of one Service during [`allocate`].
struct State<'p> {
    plan: Result<Plan<'p>, Failure>,
    got: BTreeMap<Family, IpAddr>,
    failure: Option<Failure>,
    missing_optional: Option<Failure>,
}

/// Decides every Service's addresses. See the module docs for the rules.
pub fn allocate(services: &[ServiceRequest], pools: &Pools) -> Allocation {
    let mut order: Vec<usize> = (0..services.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&services[a], &services[b]);
        (a.created.is_none(), a.created, &a.key).cmp(&(b.created.is_none(), b.created, &b.key))
    });
    let mut states: Vec<State> = services
        .iter()
        .map(|req| State {
            plan: plan(req, pools),
            got: BTreeMap::new(),
            failure: None,
            missing_optional: None,
        })
        .collect();
    let mut used: Holders = BTreeMap::new();

    keep_current(services, pools, &order, &mut states, &mut used);
    grant_requested(services, pools, &order, &mut states, &mut used);
    assign_new(services, pools, &order, &mut states, &mut used);
    results(services, pools, &order, states, &used)
}

type Order<'a> = &'a [usize];

/// Phase 1: what Services hold now and may keep, older first.
fn keep_current(
    services: &[ServiceRequest],
    pools: &Pools,
    order: Order<'_>,
    states: &mut [State],
    used: &mut Holders,
) {
    for &i in order.iter() {
        let st = &mut states[i];
        for &ip in &services[i].current {
            let family = Family::of(ip);
            if st.got.contains_key(&family)
                || used
                    .get(&ip)
                    .is_some_and(|h| may_join(services, h, i).is_err())
            {
                continue;
            }
            let keep = match &st.plan {
                // A Service whose request cannot be read keeps what it has.
                Err(_) => pools.pool_keeping(ip).is_some(),
                Ok(plan) => {
                    plan.wants(family)
                        && plan.requested.get(&family).is_none_or(|r| *r == ip)
                        && match plan.named {
                            Some(pool) => pool.may_keep(ip),
                            None => pools
                                .pool_keeping(ip)
                                .is_some_and(|p| p.refuses(&services[i]).is_none()),
                        }
                }
            };
            if keep {
                st.got.insert(family, ip);
                hold(used, ip, i);
            }
        }
    }
}

/// Phase 2: requested addresses, older first; only free (or shareable) ones.
fn grant_requested(
    services: &[ServiceRequest],
    pools: &Pools,
    order: Order<'_>,
    states: &mut [State],
    used: &mut Holders,
) {
    for &i in order.iter() {
        let st = &mut states[i];
        let Ok(plan) = &st.plan else { continue };
        let mut failure = None;
        for (&family, &ip) in &plan.requested {
            if st.got.get(&family) == Some(&ip) {
                continue;
            }
            let in_pool = match plan.named {
                Some(pool) => pool.contains(ip),
                None => pools.pool_of(ip).is_some(),
            };
            if let Some((pool, why)) = pools
                .pool_of(ip)
                .and_then(|p| Some((p, p.refuses(&services[i])?)))
            {
                failure = Some(Failure::new(
                    FailureReason::PoolNotAllowed,
                    format!(
                        "{ip} is in pool {:?}, which may not serve it: {why}",
                        pool.name
                    ),
                ));
                break;
            }
            if !in_pool {
                let in_range = match plan.named {
                    Some(pool) => pool.ranges().iter().any(|r| r.contains(ip)),
                    None => pools.in_any_range(ip),
                };
                failure = Some(Failure::new(
                    FailureReason::AddressNotInPool,
                    match plan.named {
                        _ if in_range => format!(
                            "{ip} is not handed out: the network or broadcast address \
                             of an IPv4 CIDR, or skipped by avoidBuggyIPs"
                        ),
                        Some(pool) => format!("{ip} is not in pool {:?}", pool.name),
                        None => format!("{ip} is in no pool"),
                    },
                ));
                break;
            }
            if let Some(Err(why)) = used.get(&ip).map(|h| may_join(services, h, i)) {
                failure = Some(Failure::new(
                    FailureReason::AddressInUse,
                    format!("{ip} is taken: {why}"),
                ));
                break;
            }
            st.got.insert(family, ip);
            hold(used, ip, i);
        }
        if let Some(f) = failure {
            release(st, used, i);
            st.failure = Some(f);
        }
    }
}

/// Phase 3: new addresses for the families still missing, older first.
fn assign_new(
    services: &[ServiceRequest],
    pools: &Pools,
    order: Order<'_>,
    states: &mut [State],
    used: &mut Holders,
) {
    let mut auto_pools: Vec<&Pool> = pools.valid().filter(|p| p.auto_assign).collect();
    // Scoped pools by priority first; the catch-all pools last.
    auto_pools.sort_by_key(|p| p.order_key());
    let mut exhausted: BTreeSet<(String, Family)> = BTreeSet::new();
    for &i in order.iter() {
        let st = &mut states[i];
        if st.failure.is_some() {
            continue;
        }
        let Ok(plan) = &st.plan else { continue };
        let mut picks: Vec<(Family, IpAddr)> = Vec::new();
        let mut failure = None;
        let mut missing_optional = None;
        let needed = plan.required.iter().map(|f| (*f, true));
        for (family, required) in needed.chain(plan.optional.map(|f| (f, false))) {
            if st.got.contains_key(&family) {
                continue;
            }
            let candidates: Vec<&Pool> = match plan.named {
                Some(pool) => vec![pool],
                None => auto_pools
                    .iter()
                    .copied()
                    .filter(|p| p.refuses(&services[i]).is_none())
                    .collect(),
            };
            let with_family: Vec<&Pool> = candidates
                .iter()
                .copied()
                .filter(|p| p.has_family(family))
                .collect();
            // A Service that may share first joins an address its partners hold.
            let shared = services[i].sharing.key.as_ref().and_then(|_| {
                used.iter()
                    .find(|(ip, h)| {
                        Family::of(**ip) == family
                            && with_family.iter().any(|p| p.contains(**ip))
                            && may_join(services, h, i).is_ok()
                    })
                    .map(|(ip, _)| *ip)
            });
            let pick = shared.or_else(|| {
                with_family.iter().find_map(|p| {
                    let key = (p.name.clone(), family);
                    if exhausted.contains(&key) {
                        return None;
                    }
                    let ip = p.first_free(family, used);
                    if ip.is_none() {
                        exhausted.insert(key);
                    }
                    ip
                })
            });
            match pick {
                Some(ip) => {
                    picks.push((family, ip));
                    // Reserved now so the Service's other family cannot
                    // take it; undone below if the Service fails.
                    hold(used, ip, i);
                }
                None => {
                    let f = if plan.named.is_none()
                        && candidates.is_empty()
                        && !auto_pools.is_empty()
                    {
                        not_served(&services[i], &auto_pools)
                    } else {
                        no_address(family, plan.named, &candidates, &with_family)
                    };
                    if required {
                        failure = Some(f);
                        break;
                    }
                    missing_optional = Some(f);
                }
            }
        }
        match failure {
            None => {
                st.got.extend(picks);
                st.missing_optional = missing_optional;
            }
            Some(f) => {
                for (_, ip) in picks {
                    unhold(used, ip, i);
                }
                release(st, used, i);
                st.failure = Some(f);
                // What it gave back may serve a younger Service.
                exhausted.clear();
            }
        }
    }
}

/// Phase 4: the decisions, and the addresses in use per pool.
fn results(
    services: &[ServiceRequest],
    pools: &Pools,
    order: Order<'_>,
    states: Vec<State>,
    used: &Holders,
) -> Allocation {
    let mut allocation = Allocation::default();
    for pool in pools.valid() {
        allocation.in_use.insert(pool.name.clone(), 0);
    }
    for (i, st) in states.into_iter().enumerate() {
        let mut decision = Decision::default();
        let family_order: Vec<Family> = match &st.plan {
            Ok(plan) => plan
                .required
                .iter()
                .chain(plan.optional.iter())
                .copied()
                .collect(),
            Err(_) => services[i]
                .current
                .iter()
                .map(|ip| Family::of(*ip))
                .chain([Family::V4, Family::V6])
                .collect(),
        };
        for family in family_order {
            if let Some(ip) = st.got.get(&family) {
                if !decision.addresses.contains(ip) {
                    decision.addresses.push(*ip);
                }
            }
        }
        for ip in &decision.addresses {
            // A shared address counts once, for its oldest holder.
            let first_holder = order
                .iter()
                .find(|&&j| used.get(ip).is_some_and(|h| h.contains(&j)));
            if first_holder != Some(&i) {
                continue;
            }
            if let Some(pool) = pools.pool_keeping(*ip) {
                *allocation.in_use.entry(pool.name.clone()).or_default() += 1;
            }
        }
        decision.failure = st.failure.or(st.plan.err());
        decision.missing_optional = st.missing_optional;
        allocation
            .decisions
            .insert(services[i].key.clone(), decision);
    }
    allocation
}

fn release(st: &mut State, used: &mut Holders, i: usize) {
    for ip in std::mem::take(&mut st.got).into_values() {
        unhold(used, ip, i);
    }
}

/// Every auto-assign pool is scoped away from the Service: says why, per pool.
fn not_served(req: &ServiceRequest, auto_pools: &[&Pool]) -> Failure {
    let why: Vec<String> = auto_pools
        .iter()
        .filter_map(|p| Some(format!("pool {:?}: {}", p.name, p.refuses(req)?)))
        .collect();
    Failure::new(
        FailureReason::NoPool,
        format!(
            "no auto-assign pool serves Service {} ({})",
            req.key,
            why.join("; ")
        ),
    )
}

/// Why no address of `family` could be found.
fn no_address(
    family: Family,
    named: Option<&Pool>,
    candidates: &[&Pool],
    with_family: &[&Pool],
) -> Failure {
    match named {
        Some(pool) if with_family.is_empty() => Failure::new(
            FailureReason::NoFamily,
            format!("pool {:?} has no {family} addresses", pool.name),
        ),
        Some(pool) => Failure::new(
            FailureReason::PoolExhausted,
            format!("pool {:?} has no free {family} address", pool.name),
        ),
        None if candidates.is_empty() => Failure::new(
            FailureReason::NoPool,
            format!(
                "no pool with autoAssign exists; name one with the {POOL_ANNOTATION} annotation"
            ),
        ),
        None if with_family.is_empty() => Failure::new(
            FailureReason::NoFamily,
            format!("no auto-assign pool has {family} addresses"),
        ),
        None => Failure::new(
            FailureReason::PoolExhausted,
            format!("auto-assign pools have no free {family} address"),
        ),
    }
}

#[cfg(test)]
mod tests;
