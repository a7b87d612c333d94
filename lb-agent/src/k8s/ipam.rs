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
//! holds (in its `status.loadBalancer.ingress`) is not free for anyone else;
//! between two holders, or two requesters of a free address, the older
//! Service (creation time, then namespace/name) wins. The result does not
//! depend on the order of the inputs.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::core::v1::Service;
use k8s_openapi::jiff::Timestamp;

use super::crd::LoadBalancerPoolSpec;
use super::IP_ANNOTATION;
use super::POOL_ANNOTATION;

/// What a pool reports as its size at most (a /64 would not fit a gauge).
pub const SIZE_CAP: u64 = 1 << 32;

/// An IP address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    pub fn of(ip: &IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    pub fn other(self) -> Family {
        match self {
            Family::V4 => Family::V6,
            Family::V6 => Family::V4,
        }
    }

    fn bits(self) -> u32 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }

    /// The name Kubernetes uses in `spec.ipFamilies`.
    pub fn k8s_name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }

    fn from_k8s_name(s: &str) -> Option<Family> {
        match s {
            "IPv4" => Some(Family::V4),
            "IPv6" => Some(Family::V6),
            _ => None,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.k8s_name())
    }
}

fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u32::from(a) as u128,
        IpAddr::V6(a) => u128::from(a),
    }
}

fn from_u128(family: Family, n: u128) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::from(n as u32)),
        Family::V6 => IpAddr::V6(Ipv6Addr::from(n)),
    }
}

/// IPv4 addresses ending in .0 or .255, which some clients and routers
/// mishandle (they look like network or broadcast addresses).
fn is_buggy(family: Family, n: u128) -> bool {
    family == Family::V4 && matches!(n & 0xff, 0 | 0xff)
}

/// An inclusive range of addresses of one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AddressRange {
    family: Family,
    first: u128,
    last: u128,
}

impl AddressRange {
    /// Parses a CIDR (`192.0.2.0/24`), an inclusive range
    /// (`192.0.2.10-192.0.2.20`) or a single address.
    pub fn parse(entry: &str) -> Result<AddressRange, String> {
        let entry = entry.trim();
        if entry.is_empty() {
            return Err("empty address entry".into());
        }
        let parse_ip = |s: &str| -> Result<IpAddr, String> {
            s.trim()
                .parse::<IpAddr>()
                .map_err(|_| format!("{entry:?}: {:?} is not an IP address", s.trim()))
        };
        if let Some((addr, prefix)) = entry.split_once('/') {
            let ip = parse_ip(addr)?;
            let family = Family::of(&ip);
            let prefix: u32 = prefix
                .trim()
                .parse()
                .map_err(|_| format!("{entry:?}: prefix length {prefix:?} is not a number"))?;
            if prefix > family.bits() {
                return Err(format!(
                    "{entry:?}: prefix length {prefix} is longer than {} bits",
                    family.bits()
                ));
            }
            let host_bits = family.bits() - prefix;
            let host_mask = if host_bits == 128 {
                u128::MAX
            } else {
                (1u128 << host_bits) - 1
            };
            let first = to_u128(ip);
            if first & host_mask != 0 {
                let network = from_u128(family, first & !host_mask);
                return Err(format!(
                    "{entry:?}: host bits are set (the network is {network}/{prefix})"
                ));
            }
            return Ok(AddressRange {
                family,
                first,
                last: first | host_mask,
            });
        }
        if let Some((a, b)) = entry.split_once('-') {
            let (a, b) = (parse_ip(a)?, parse_ip(b)?);
            if Family::of(&a) != Family::of(&b) {
                return Err(format!("{entry:?}: the range mixes IPv4 and IPv6"));
            }
            let (first, last) = (to_u128(a), to_u128(b));
            if first > last {
                return Err(format!("{entry:?}: the range ends before it starts"));
            }
            return Ok(AddressRange {
                family: Family::of(&a),
                first,
                last,
            });
        }
        let ip = parse_ip(entry)
            .map_err(|_| format!("{entry:?} is not a CIDR, a range (A-B) or an IP address"))?;
        Ok(AddressRange {
            family: Family::of(&ip),
            first: to_u128(ip),
            last: to_u128(ip),
        })
    }

    pub fn family(&self) -> Family {
        self.family
    }

    pub fn first(&self) -> IpAddr {
        from_u128(self.family, self.first)
    }

    pub fn last(&self) -> IpAddr {
        from_u128(self.family, self.last)
    }

    /// Whether `ip` lies in the range (avoidBuggyIPs not considered).
    pub fn contains(&self, ip: IpAddr) -> bool {
        Family::of(&ip) == self.family && (self.first..=self.last).contains(&to_u128(ip))
    }

    pub fn overlaps(&self, other: &AddressRange) -> bool {
        self.family == other.family && self.first <= other.last && other.first <= self.last
    }

    /// The first address at or after `from` that is usable, within the range.
    fn usable_from(&self, from: u128, avoid_buggy: bool) -> Option<u128> {
        let mut n = from.max(self.first);
        if avoid_buggy && is_buggy(self.family, n) {
            // .0 -> .1, .255 -> next .1
            n = n.checked_add(if n & 0xff == 0 { 1 } else { 2 })?;
        }
        (n <= self.last).then_some(n)
    }

    /// How many usable addresses the range holds (saturating).
    fn size(&self, avoid_buggy: bool) -> u128 {
        let all = (self.last - self.first).saturating_add(1);
        if !(avoid_buggy && self.family == Family::V4) {
            return all;
        }
        // Addresses n <= x with n % 256 == r.
        let up_to = |x: u128, r: u128| if x < r { 0 } else { (x - r) / 256 + 1 };
        let within = |r: u128| {
            up_to(self.last, r)
                - if self.first == 0 {
                    0
                } else {
                    up_to(self.first - 1, r)
                }
        };
        all - within(0) - within(255)
    }
}

impl fmt::Display for AddressRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first())
        } else {
            write!(f, "{}-{}", self.first(), self.last())
        }
    }
}

/// A usable pool: its ranges sorted (IPv4 first), none overlapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pool {
    pub name: String,
    ranges: Vec<AddressRange>,
    pub avoid_buggy_ips: bool,
    pub auto_assign: bool,
}

impl Pool {
    /// Parses a pool's spec; the error says which entry is wrong and why.
    pub fn parse(name: &str, spec: &LoadBalancerPoolSpec) -> Result<Pool, String> {
        if spec.addresses.is_empty() {
            return Err("spec.addresses is empty".into());
        }
        let mut parsed = Vec::with_capacity(spec.addresses.len());
        for entry in &spec.addresses {
            parsed.push((entry.trim(), AddressRange::parse(entry)?));
        }
        parsed.sort_by_key(|(_, r)| *r);
        for pair in parsed.windows(2) {
            if pair[0].1.overlaps(&pair[1].1) {
                return Err(format!("{:?} and {:?} overlap", pair[0].0, pair[1].0));
            }
        }
        let pool = Pool {
            name: name.to_string(),
            ranges: parsed.into_iter().map(|(_, r)| r).collect(),
            avoid_buggy_ips: spec.avoid_buggy_ips,
            auto_assign: spec.auto_assign,
        };
        if pool.size() == 0 {
            return Err("no usable address (avoidBuggyIPs leaves none)".into());
        }
        Ok(pool)
    }

    pub fn ranges(&self) -> &[AddressRange] {
        &self.ranges
    }

    /// Whether the pool may hand out `ip` (avoidBuggyIPs considered).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let family = Family::of(&ip);
        !(self.avoid_buggy_ips && is_buggy(family, to_u128(ip)))
            && self.ranges.iter().any(|r| r.contains(ip))
    }

    /// Whether the pool has any usable address of `family`.
    pub fn has_family(&self, family: Family) -> bool {
        self.ranges
            .iter()
            .any(|r| r.family == family && r.usable_from(r.first, self.avoid_buggy_ips).is_some())
    }

    /// Usable addresses, capped at [`SIZE_CAP`].
    pub fn size(&self) -> u64 {
        let total = self.ranges.iter().fold(0u128, |acc, r| {
            acc.saturating_add(r.size(self.avoid_buggy_ips))
        });
        total.min(SIZE_CAP as u128) as u64
    }

    /// Every usable address, in the order they are handed out.
    pub fn addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        let avoid = self.avoid_buggy_ips;
        self.ranges.iter().flat_map(move |r| {
            std::iter::successors(r.usable_from(r.first, avoid), move |&n| {
                r.usable_from(n.checked_add(1)?, avoid)
            })
            .map(move |n| from_u128(r.family, n))
        })
    }

    /// The first usable address of `family` not in `used`.
    fn first_free(&self, family: Family, used: &BTreeMap<IpAddr, usize>) -> Option<IpAddr> {
        for r in self.ranges.iter().filter(|r| r.family == family) {
            let mut next = r.usable_from(r.first, self.avoid_buggy_ips);
            while let Some(n) = next {
                let ip = from_u128(family, n);
                if !used.contains_key(&ip) {
                    return Some(ip);
                }
                next = n
                    .checked_add(1)
                    .and_then(|m| r.usable_from(m, self.avoid_buggy_ips));
            }
        }
        None
    }
}

/// One `LoadBalancerPool` as read from the API server.
#[derive(Clone, Debug)]
pub struct PoolInput<'a> {
    pub name: &'a str,
    pub spec: &'a LoadBalancerPoolSpec,
    pub created: Option<Timestamp>,
}

/// All pools: the usable ones, and why the others are not.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pools {
    valid: BTreeMap<String, Pool>,
    invalid: BTreeMap<String, String>,
}

impl Pools {
    /// Parses every pool. A pool overlapping an older one (creation time,
    /// then name) is invalid: adding a pool never takes addresses from one
    /// that is already in use.
    pub fn build<'a>(inputs: impl IntoIterator<Item = PoolInput<'a>>) -> Pools {
        let mut inputs: Vec<PoolInput<'a>> = inputs.into_iter().collect();
        inputs.sort_by(|a, b| age_key(a.created, a.name).cmp(&age_key(b.created, b.name)));
        let mut pools = Pools::default();
        for input in inputs {
            let pool = Pool::parse(input.name, input.spec).and_then(|pool| {
                for other in pools.valid.values() {
                    for r in &pool.ranges {
                        if let Some(o) = other.ranges.iter().find(|o| o.overlaps(r)) {
                            return Err(format!(
                                "{r} overlaps {o} of the older pool {:?}",
                                other.name
                            ));
                        }
                    }
                }
                Ok(pool)
            });
            match pool {
                Ok(pool) => {
                    pools.valid.insert(input.name.to_string(), pool);
                }
                Err(e) => {
                    pools.invalid.insert(input.name.to_string(), e);
                }
            }
        }
        pools
    }

    pub fn get(&self, name: &str) -> Option<&Pool> {
        self.valid.get(name)
    }

    /// Why the pool `name` is unusable, if it exists and is.
    pub fn error(&self, name: &str) -> Option<&str> {
        self.invalid.get(name).map(String::as_str)
    }

    /// Usable pools, by name.
    pub fn valid(&self) -> impl Iterator<Item = &Pool> {
        self.valid.values()
    }

    /// Unusable pools and why, by name.
    pub fn invalid(&self) -> impl Iterator<Item = (&str, &str)> {
        self.invalid.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// The usable pool that may hand out `ip` (pools do not overlap).
    pub fn pool_of(&self, ip: IpAddr) -> Option<&Pool> {
        self.valid.values().find(|p| p.contains(ip))
    }

    /// Whether `ip` lies in any usable pool's ranges (avoidBuggyIPs ignored):
    /// the addresses xlb may have written.
    pub fn in_any_range(&self, ip: IpAddr) -> bool {
        self.valid
            .values()
            .any(|p| p.ranges.iter().any(|r| r.contains(ip)))
    }
}

/// Older first; objects without a creation time (never from a real API
/// server) last; then by name.
fn age_key(created: Option<Timestamp>, name: &str) -> (bool, Option<Timestamp>, &str) {
    (created.is_none(), created, name)
}

/// A Service's namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServiceKey {
    pub namespace: String,
    pub name: String,
}

impl ServiceKey {
    pub fn new(namespace: &str, name: &str) -> ServiceKey {
        ServiceKey {
            namespace: namespace.to_string(),
            name: name.to_string(),
        }
    }
}

impl fmt::Display for ServiceKey {
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
    pub key: ServiceKey,
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
}

impl ServiceRequest {
    /// A request with defaults, for building by hand.
    pub fn new(namespace: &str, name: &str) -> ServiceRequest {
        ServiceRequest {
            key: ServiceKey::new(namespace, name),
            created: None,
            pool: None,
            requested: Vec::new(),
            families: Vec::new(),
            policy: FamilyPolicy::SingleStack,
            current: Vec::new(),
            bad_request: None,
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
            match Family::from_k8s_name(name) {
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
        if let Some(prev) = out.iter().find(|p| Family::of(p) == Family::of(&ip)) {
            return Err(format!(
                "{what}: two {} addresses ({prev} and {ip}); give at most one per family",
                Family::of(&ip)
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
}

impl FailureReason {
    pub const ALL: [FailureReason; 6] = [
        FailureReason::NoPool,
        FailureReason::PoolExhausted,
        FailureReason::AddressInUse,
        FailureReason::AddressNotInPool,
        FailureReason::BadRequest,
        FailureReason::NoFamily,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailureReason::NoPool => "NoPool",
            FailureReason::PoolExhausted => "PoolExhausted",
            FailureReason::AddressInUse => "AddressInUse",
            FailureReason::AddressNotInPool => "AddressNotInPool",
            FailureReason::BadRequest => "BadRequest",
            FailureReason::NoFamily => "NoFamily",
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
    pub decisions: BTreeMap<ServiceKey, Decision>,
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
            (Some(pool), _) => Some(pool),
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
        let first = req.requested.first().map_or(Family::V4, Family::of);
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
        let family = Family::of(ip);
        if !(required.contains(&family) || optional == Some(family)) {
            return Err(Failure::new(
                FailureReason::BadRequest,
                format!(
                    "requested address {ip} is {family} but the Service's families are {}",
                    required
                        .iter()
                        .chain(optional.iter())
                        .map(|f| f.k8s_name())
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
    // Address -> index of the Service holding it.
    let mut used: BTreeMap<IpAddr, usize> = BTreeMap::new();

    // 1. What Services hold now and may keep, older first.
    for &i in &order {
        let st = &mut states[i];
        for &ip in &services[i].current {
            let family = Family::of(&ip);
            if st.got.contains_key(&family) || used.contains_key(&ip) {
                continue;
            }
            let keep = match &st.plan {
                // A Service whose request cannot be read keeps what it has.
                Err(_) => pools.pool_of(ip).is_some(),
                Ok(plan) => {
                    plan.wants(family)
                        && plan.requested.get(&family).is_none_or(|r| *r == ip)
                        && match plan.named {
                            Some(pool) => pool.contains(ip),
                            None => pools.pool_of(ip).is_some(),
                        }
                }
            };
            if keep {
                st.got.insert(family, ip);
                used.insert(ip, i);
            }
        }
    }

    // 2. Requested addresses, older first; only free ones.
    for &i in &order {
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
            if !in_pool {
                failure = Some(Failure::new(
                    FailureReason::AddressNotInPool,
                    match plan.named {
                        Some(pool) => format!("{ip} is not in pool {:?}", pool.name),
                        None => format!("{ip} is in no pool"),
                    },
                ));
                break;
            }
            if let Some(&holder) = used.get(&ip) {
                failure = Some(Failure::new(
                    FailureReason::AddressInUse,
                    format!("{ip} is used by Service {}", services[holder].key),
                ));
                break;
            }
            st.got.insert(family, ip);
            used.insert(ip, i);
        }
        if let Some(f) = failure {
            release(st, &mut used);
            st.failure = Some(f);
        }
    }

    // 3. New addresses for the families still missing, older first.
    let auto_pools: Vec<&Pool> = pools.valid().filter(|p| p.auto_assign).collect();
    let mut exhausted: BTreeSet<(String, Family)> = BTreeSet::new();
    for &i in &order {
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
                None => auto_pools.clone(),
            };
            let with_family: Vec<&Pool> = candidates
                .iter()
                .copied()
                .filter(|p| p.has_family(family))
                .collect();
            let pick = with_family.iter().find_map(|p| {
                let key = (p.name.clone(), family);
                if exhausted.contains(&key) {
                    return None;
                }
                let ip = p.first_free(family, &used);
                if ip.is_none() {
                    exhausted.insert(key);
                }
                ip
            });
            match pick {
                Some(ip) => {
                    picks.push((family, ip));
                    // Reserved now so the Service's other family cannot
                    // take it; undone below if the Service fails.
                    used.insert(ip, i);
                }
                None => {
                    let f = no_address(family, plan.named, &candidates, &with_family);
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
                    used.remove(&ip);
                }
                release(st, &mut used);
                st.failure = Some(f);
                // What it gave back may serve a younger Service.
                exhausted.clear();
            }
        }
    }

    // 4. Results.
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
                .map(Family::of)
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
            if let Some(pool) = pools.pool_of(*ip) {
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

fn release(st: &mut State, used: &mut BTreeMap<IpAddr, usize>) {
    for ip in std::mem::take(&mut st.got).into_values() {
        used.remove(&ip);
    }
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
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| ip(s)).collect()
    }

    fn spec(addresses: &[&str]) -> LoadBalancerPoolSpec {
        LoadBalancerPoolSpec {
            addresses: addresses.iter().map(|s| s.to_string()).collect(),
            avoid_buggy_ips: false,
            auto_assign: true,
        }
    }

    fn at(second: i64) -> Option<Timestamp> {
        Some(Timestamp::from_second(second).unwrap())
    }

    /// Pools from (name, spec), created in list order.
    fn pools(list: &[(&str, LoadBalancerPoolSpec)]) -> Pools {
        Pools::build(list.iter().enumerate().map(|(i, (name, spec))| PoolInput {
            name,
            spec,
            created: at(i as i64),
        }))
    }

    fn one_pool(addresses: &[&str]) -> Pools {
        pools(&[("main", spec(addresses))])
    }

    fn svc(name: &str, created: i64) -> ServiceRequest {
        let mut r = ServiceRequest::new("ns", name);
        r.created = at(created);
        r
    }

    fn decision<'a>(a: &'a Allocation, name: &str) -> &'a Decision {
        &a.decisions[&ServiceKey::new("ns", name)]
    }

    fn reason(a: &Allocation, name: &str) -> Option<FailureReason> {
        decision(a, name).failure.as_ref().map(|f| f.reason)
    }

    // --- Parsing -----------------------------------------------------------

    #[test]
    fn parses_cidrs_ranges_and_single_addresses() {
        let r = AddressRange::parse("192.0.2.0/24").unwrap();
        assert_eq!((r.first(), r.last()), (ip("192.0.2.0"), ip("192.0.2.255")));
        let r = AddressRange::parse(" 192.0.2.10 - 192.0.2.20 ").unwrap();
        assert_eq!((r.first(), r.last()), (ip("192.0.2.10"), ip("192.0.2.20")));
        assert_eq!(r.size(false), 11);
        let r = AddressRange::parse("2001:db8::/120").unwrap();
        assert_eq!(
            (r.first(), r.last()),
            (ip("2001:db8::"), ip("2001:db8::ff"))
        );
        assert_eq!(r.family(), Family::V6);
        let r = AddressRange::parse("2001:db8::5-2001:db8::7").unwrap();
        assert_eq!(r.size(false), 3);
        let r = AddressRange::parse("198.51.100.7").unwrap();
        assert_eq!(
            (r.first(), r.last()),
            (ip("198.51.100.7"), ip("198.51.100.7"))
        );
        let r = AddressRange::parse("198.51.100.7/32").unwrap();
        assert_eq!(r.size(false), 1);
        let r = AddressRange::parse("0.0.0.0/0").unwrap();
        assert_eq!(r.size(false), 1 << 32);
        let r = AddressRange::parse("::/0").unwrap();
        assert_eq!(r.size(false), u128::MAX, "saturates instead of overflowing");
    }

    #[test]
    fn bad_entries_say_what_is_wrong() {
        let cases = [
            (
                "192.0.2.5/24",
                "host bits are set (the network is 192.0.2.0/24)",
            ),
            ("192.0.2.0/33", "prefix length 33 is longer than 32 bits"),
            ("2001:db8::/129", "longer than 128 bits"),
            ("192.0.2.0/x", "prefix length \"x\" is not a number"),
            ("192.0.2.300/24", "\"192.0.2.300\" is not an IP address"),
            ("192.0.2.1-2001:db8::1", "mixes IPv4 and IPv6"),
            ("192.0.2.20-192.0.2.10", "ends before it starts"),
            ("192.0.2.1-", "\"\" is not an IP address"),
            ("  ", "empty address entry"),
            ("public", "is not a CIDR, a range (A-B) or an IP address"),
        ];
        for (entry, want) in cases {
            let err = AddressRange::parse(entry).unwrap_err();
            assert!(err.contains(want), "{entry:?}: {err:?} lacks {want:?}");
        }
    }

    #[test]
    fn pool_errors() {
        let err = Pool::parse("p", &spec(&[])).unwrap_err();
        assert_eq!(err, "spec.addresses is empty");
        let err = Pool::parse(
            "p",
            &spec(&["192.0.2.0/24", "10.0.0.0/8", "192.0.2.128/25"]),
        )
        .unwrap_err();
        assert_eq!(err, "\"192.0.2.0/24\" and \"192.0.2.128/25\" overlap");
        let err = Pool::parse("p", &spec(&["192.0.2.0/24", "bogus"])).unwrap_err();
        assert!(err.contains("\"bogus\""), "{err}");
        let mut s = spec(&["192.0.2.0", "192.0.2.255"]);
        s.avoid_buggy_ips = true;
        let err = Pool::parse("p", &s).unwrap_err();
        assert!(err.contains("no usable address"), "{err}");
        // Touching ranges are fine.
        Pool::parse(
            "p",
            &spec(&["192.0.2.0-192.0.2.9", "192.0.2.10-192.0.2.20"]),
        )
        .unwrap();
    }

    #[test]
    fn iterates_in_a_stable_order_v4_first() {
        let pool = Pool::parse(
            "p",
            &spec(&[
                "2001:db8::1-2001:db8::2",
                "192.0.2.9-192.0.2.10",
                "10.0.0.1",
            ]),
        )
        .unwrap();
        let all: Vec<IpAddr> = pool.addresses().collect();
        assert_eq!(
            all,
            ips(&[
                "10.0.0.1",
                "192.0.2.9",
                "192.0.2.10",
                "2001:db8::1",
                "2001:db8::2"
            ])
        );
        assert_eq!(pool.size(), 5);
    }

    #[test]
    fn avoid_buggy_ips_skips_dot_zero_and_dot_255() {
        let mut s = spec(&["192.0.2.250-192.0.3.2", "2001:db8::ff-2001:db8::100"]);
        s.avoid_buggy_ips = true;
        let pool = Pool::parse("p", &s).unwrap();
        let all: Vec<IpAddr> = pool.addresses().collect();
        assert_eq!(
            all,
            ips(&[
                "192.0.2.250",
                "192.0.2.251",
                "192.0.2.252",
                "192.0.2.253",
                "192.0.2.254",
                "192.0.3.1",
                "192.0.3.2",
                // IPv6 has no such problem.
                "2001:db8::ff",
                "2001:db8::100",
            ])
        );
        assert_eq!(pool.size(), 9);
        assert!(!pool.contains(ip("192.0.2.255")));
        assert!(!pool.contains(ip("192.0.3.0")));
        assert!(pool.contains(ip("192.0.3.1")));
        assert!(pool.contains(ip("2001:db8::100")));
        s.avoid_buggy_ips = false;
        let pool = Pool::parse("p", &s).unwrap();
        assert_eq!(pool.size(), 11);
        assert!(pool.contains(ip("192.0.2.255")));
    }

    #[test]
    fn size_matches_iteration_with_and_without_avoid() {
        // Many small ranges around .0/.255 boundaries.
        for start in [0u32, 1, 254, 255, 256, 510, 511, 0xffff_ff00] {
            for len in [1u32, 2, 3, 255, 256, 257, 300] {
                let Some(end) = start.checked_add(len - 1) else {
                    continue;
                };
                for avoid in [false, true] {
                    let entry = format!("{}-{}", Ipv4Addr::from(start), Ipv4Addr::from(end));
                    let mut s = spec(&[&entry]);
                    s.avoid_buggy_ips = avoid;
                    let Ok(pool) = Pool::parse("p", &s) else {
                        assert!(avoid && len <= 2, "{entry} avoid={avoid}");
                        continue;
                    };
                    assert_eq!(
                        pool.size(),
                        pool.addresses().count() as u64,
                        "{entry} avoid={avoid}"
                    );
                    for a in pool.addresses() {
                        assert!(pool.contains(a));
                    }
                }
            }
        }
    }

    #[test]
    fn size_is_capped_for_large_ipv6_pools() {
        let pool = Pool::parse("p", &spec(&["2001:db8::/64", "192.0.2.0/24"])).unwrap();
        assert_eq!(pool.size(), SIZE_CAP);
        let pool = Pool::parse("p", &spec(&["2001:db8::/96"])).unwrap();
        assert_eq!(pool.size(), SIZE_CAP);
        let pool = Pool::parse("p", &spec(&["2001:db8::/97"])).unwrap();
        assert_eq!(pool.size(), 1 << 31);
    }

    #[test]
    fn the_older_of_two_overlapping_pools_wins() {
        let a = spec(&["192.0.2.0/24"]);
        let b = spec(&["198.51.100.0/24", "192.0.2.128-192.0.2.130"]);
        let c = spec(&["203.0.113.0/24"]);
        let build = |order: &[(&str, &LoadBalancerPoolSpec, i64)]| {
            Pools::build(order.iter().map(|(name, spec, t)| PoolInput {
                name,
                spec,
                created: at(*t),
            }))
        };
        let one = build(&[("a", &a, 2), ("b", &b, 1), ("c", &c, 3)]);
        let two = build(&[("c", &c, 3), ("a", &a, 2), ("b", &b, 1)]);
        assert_eq!(one, two, "input order does not matter");
        assert!(one.get("b").is_some(), "b is older");
        assert_eq!(
            one.error("a").unwrap(),
            "192.0.2.0-192.0.2.255 overlaps 192.0.2.128-192.0.2.130 of the older pool \"b\""
        );
        assert!(one.get("c").is_some());
        // Same age: by name.
        let same = build(&[("z", &a, 1), ("y", &b, 1)]);
        assert!(same.get("y").is_some() && same.error("z").is_some());
        assert_eq!(same.pool_of(ip("192.0.2.129")).unwrap().name, "y");
        assert!(same.pool_of(ip("192.0.2.1")).is_none(), "z is not usable");
    }

    // --- Reading a Service ---------------------------------------------------

    fn service(json: serde_json::Value) -> Service {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn reads_a_service() {
        let s = service(serde_json::json!({
            "metadata": {"namespace": "web", "name": "front",
                         "creationTimestamp": "2026-01-02T03:04:05Z",
                         "annotations": {"xlb.dev/pool": " public ", "xlb.dev/ip": "192.0.2.7, 2001:db8::7"}},
            "spec": {"type": "LoadBalancer", "ipFamilies": ["IPv6", "IPv4"],
                     "ipFamilyPolicy": "PreferDualStack"},
            "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.9"}, {"hostname": "x.example"}]}}
        }));
        let r = ServiceRequest::from_service(&s);
        assert_eq!(r.key, ServiceKey::new("web", "front"));
        assert_eq!(r.created, Some("2026-01-02T03:04:05Z".parse().unwrap()));
        assert_eq!(r.pool.as_deref(), Some("public"));
        assert_eq!(r.requested, ips(&["192.0.2.7", "2001:db8::7"]));
        assert_eq!(r.families, vec![Family::V6, Family::V4]);
        assert_eq!(r.policy, FamilyPolicy::PreferDualStack);
        assert_eq!(r.current, ips(&["192.0.2.9"]));
        assert_eq!(r.bad_request, None);
    }

    #[test]
    fn load_balancer_ip_is_honoured_and_must_agree_with_the_annotation() {
        let s = service(serde_json::json!({
            "metadata": {"name": "a"}, "spec": {"loadBalancerIP": "192.0.2.7"}}));
        let r = ServiceRequest::from_service(&s);
        assert_eq!((r.requested, r.bad_request), (ips(&["192.0.2.7"]), None));
        let s = service(serde_json::json!({
            "metadata": {"name": "a", "annotations": {"xlb.dev/ip": "192.0.2.7"}},
            "spec": {"loadBalancerIP": "192.0.2.7"}}));
        assert_eq!(ServiceRequest::from_service(&s).bad_request, None);
        let s = service(serde_json::json!({
            "metadata": {"name": "a", "annotations": {"xlb.dev/ip": "192.0.2.8"}},
            "spec": {"loadBalancerIP": "192.0.2.7"}}));
        let bad = ServiceRequest::from_service(&s).bad_request.unwrap();
        assert!(bad.contains("ask for different addresses"), "{bad}");
        // Empty values mean "not set".
        let s = service(serde_json::json!({
            "metadata": {"name": "a", "annotations": {"xlb.dev/ip": ""}},
            "spec": {"loadBalancerIP": ""}}));
        let r = ServiceRequest::from_service(&s);
        assert_eq!((r.requested, r.bad_request), (vec![], None));
    }

    #[test]
    fn malformed_requests_are_bad_requests() {
        let cases = [
            (
                serde_json::json!({"metadata": {"name": "a", "annotations": {"xlb.dev/ip": "192.0.2.7,,"}}}),
                "xlb.dev/ip: \"\" is not an IP address",
            ),
            (
                serde_json::json!({"metadata": {"name": "a", "annotations": {"xlb.dev/ip": "192.0.2.7,192.0.2.8"}}}),
                "two IPv4 addresses (192.0.2.7 and 192.0.2.8)",
            ),
            (
                serde_json::json!({"metadata": {"name": "a", "annotations": {"xlb.dev/ip": "web"}}}),
                "\"web\" is not an IP address",
            ),
            (
                serde_json::json!({"metadata": {"name": "a"}, "spec": {"loadBalancerIP": "1.2.3"}}),
                "spec.loadBalancerIP: \"1.2.3\" is not an IP address",
            ),
            (
                serde_json::json!({"metadata": {"name": "a"}, "spec": {"ipFamilies": ["IPv5"]}}),
                "unknown family \"IPv5\"",
            ),
            (
                serde_json::json!({"metadata": {"name": "a"}, "spec": {"ipFamilyPolicy": "Both"}}),
                "unknown policy \"Both\"",
            ),
        ];
        for (json, want) in cases {
            let r = ServiceRequest::from_service(&service(json.clone()));
            let bad = r.bad_request.unwrap_or_default();
            assert!(bad.contains(want), "{json}: {bad:?} lacks {want:?}");
        }
    }

    // --- Allocation ----------------------------------------------------------

    #[test]
    fn hands_out_the_first_free_addresses_oldest_service_first() {
        let p = one_pool(&["192.0.2.10-192.0.2.12"]);
        // Listed youngest first: the order of the input does not matter.
        let a = allocate(&[svc("young", 20), svc("old", 10)], &p);
        assert_eq!(decision(&a, "old").addresses, ips(&["192.0.2.10"]));
        assert_eq!(decision(&a, "young").addresses, ips(&["192.0.2.11"]));
        assert_eq!(decision(&a, "old").failure, None);
        assert_eq!(a.in_use["main"], 2);
    }

    #[test]
    fn avoid_buggy_ips_changes_the_first_address() {
        let mut s = spec(&["192.0.2.0/24"]);
        let a = allocate(&[svc("a", 1)], &pools(&[("p", s.clone())]));
        assert_eq!(decision(&a, "a").addresses, ips(&["192.0.2.0"]));
        s.avoid_buggy_ips = true;
        let a = allocate(&[svc("a", 1)], &pools(&[("p", s)]));
        assert_eq!(decision(&a, "a").addresses, ips(&["192.0.2.1"]));
    }

    #[test]
    fn keeps_a_current_address_even_if_a_lower_one_is_free() {
        let p = one_pool(&["192.0.2.10-192.0.2.12"]);
        let mut a = svc("a", 1);
        a.current = ips(&["192.0.2.12"]);
        let alloc = allocate(&[a, svc("b", 2)], &p);
        assert_eq!(decision(&alloc, "a").addresses, ips(&["192.0.2.12"]));
        assert_eq!(decision(&alloc, "b").addresses, ips(&["192.0.2.10"]));
    }

    #[test]
    fn a_held_address_is_not_taken_by_an_older_service() {
        // b (younger) holds .10; a (older, new to xlb) gets .11.
        let p = one_pool(&["192.0.2.10-192.0.2.12"]);
        let mut b = svc("b", 2);
        b.current = ips(&["192.0.2.10"]);
        let alloc = allocate(&[svc("a", 1), b], &p);
        assert_eq!(decision(&alloc, "a").addresses, ips(&["192.0.2.11"]));
        assert_eq!(decision(&alloc, "b").addresses, ips(&["192.0.2.10"]));
    }

    #[test]
    fn an_address_outside_every_pool_is_replaced() {
        let p = one_pool(&["192.0.2.10-192.0.2.12"]);
        let mut a = svc("a", 1);
        a.current = ips(&["198.51.100.1"]);
        let alloc = allocate(&[a], &p);
        assert_eq!(decision(&alloc, "a").addresses, ips(&["192.0.2.10"]));
    }

    #[test]
    fn two_holders_of_one_address_the_older_keeps_it() {
        let p = one_pool(&["192.0.2.10-192.0.2.12"]);
        let mut a = svc("a", 5);
        a.current = ips(&["192.0.2.11"]);
        let mut b = svc("b", 3);
        b.current = ips(&["192.0.2.11"]);
        let alloc = allocate(&[a, b], &p);
        assert_eq!(decision(&alloc, "b").addresses, ips(&["192.0.2.11"]));
        assert_eq!(decision(&alloc, "a").addresses, ips(&["192.0.2.10"]));
        assert_eq!(decision(&alloc, "a").failure, None);
    }

    #[test]
    fn same_creation_time_breaks_ties_by_namespace_and_name() {
        let p = one_pool(&["192.0.2.10"]);
        let mut x = ServiceRequest::new("b-ns", "a");
        x.created = at(1);
        let mut y = ServiceRequest::new("a-ns", "z");
        y.created = at(1);
        let alloc = allocate(&[x, y], &p);
        assert_eq!(
            alloc.decisions[&ServiceKey::new("a-ns", "z")].addresses,
            ips(&["192.0.2.10"])
        );
        assert_eq!(
            alloc.decisions[&ServiceKey::new("b-ns", "a")]
                .failure
                .as_ref()
                .unwrap()
                .reason,
            FailureReason::PoolExhausted
        );
    }

    #[test]
    fn honours_a_requested_address() {
        let p = one_pool(&["192.0.2.10-192.0.2.20"]);
        let mut a = svc("a", 1);
        a.requested = ips(&["192.0.2.15"]);
        a.current = ips(&["192.0.2.10"]);
        let alloc = allocate(&[a, svc("b", 2)], &p);
        assert_eq!(decision(&alloc, "a").addresses, ips(&["192.0.2.15"]));
        // The address a gave up is free again.
        assert_eq!(decision(&alloc, "b").addresses, ips(&["192.0.2.10"]));
    }

    #[test]
    fn a_requested_address_in_use_is_refused_naming_the_holder() {
        let p = one_pool(&["192.0.2.10-192.0.2.20"]);
        let mut holder = svc("holder", 5);
        holder.current = ips(&["192.0.2.15"]);
        let mut wants = svc("wants", 1);
        wants.requested = ips(&["192.0.2.15"]);
        let alloc = allocate(&[holder, wants], &p);
        assert_eq!(decision(&alloc, "holder").addresses, ips(&["192.0.2.15"]));
        let d = decision(&alloc, "wants");
        assert_eq!(d.addresses, ips(&[]));
        let f = d.failure.as_ref().unwrap();
        assert_eq!(f.reason, FailureReason::AddressInUse);
        assert_eq!(f.message, "192.0.2.15 is used by Service ns/holder");
    }

    #[test]
    fn two_requesters_of_one_free_address_the_older_gets_it() {
        let p = one_pool(&["192.0.2.10-192.0.2.20"]);
        let mut young = svc("young", 9);
        young.requested = ips(&["192.0.2.15"]);
        let mut old = svc("old", 1);
        old.requested = ips(&["192.0.2.15"]);
        for input in [
            vec![young.clone(), old.clone()],
            vec![old.clone(), young.clone()],
        ] {
            let alloc = allocate(&input, &p);
            assert_eq!(decision(&alloc, "old").addresses, ips(&["192.0.2.15"]));
            assert_eq!(reason(&alloc, "young"), Some(FailureReason::AddressInUse));
            assert_eq!(decision(&alloc, "young").addresses, ips(&[]));
        }
    }

    #[test]
    fn a_requested_address_must_be_in_a_pool() {
        let p = pools(&[
            ("auto", spec(&["192.0.2.0/24"])),
            (
                "manual",
                LoadBalancerPoolSpec {
                    auto_assign: false,
                    ..spec(&["198.51.100.0/24"])
                },
            ),
        ]);
        let mut outside = svc("outside", 1);
        outside.requested = ips(&["203.0.113.1"]);
        // Any pool will do, even one that does not auto-assign.
        let mut manual = svc("manual", 2);
        manual.requested = ips(&["198.51.100.5"]);
        // But a named pool must hold it.
        let mut named = svc("named", 3);
        named.requested = ips(&["198.51.100.6"]);
        named.pool = Some("auto".into());
        let alloc = allocate(&[outside, manual, named], &p);
        let f = decision(&alloc, "outside").failure.clone().unwrap();
        assert_eq!(
            (f.reason, f.message.as_str()),
            (FailureReason::AddressNotInPool, "203.0.113.1 is in no pool")
        );
        assert_eq!(decision(&alloc, "manual").addresses, ips(&["198.51.100.5"]));
        let f = decision(&alloc, "named").failure.clone().unwrap();
        assert_eq!(
            (f.reason, f.message.as_str()),
            (
                FailureReason::AddressNotInPool,
                "198.51.100.6 is not in pool \"auto\""
            )
        );
        assert_eq!(alloc.in_use["manual"], 1);
        assert_eq!(alloc.in_use["auto"], 0);
    }

    #[test]
    fn a_requested_buggy_address_is_not_in_an_avoiding_pool() {
        let p = pools(&[(
            "p",
            LoadBalancerPoolSpec {
                avoid_buggy_ips: true,
                ..spec(&["192.0.2.0/24"])
            },
        )]);
        let mut a = svc("a", 1);
        a.requested = ips(&["192.0.2.255"]);
        assert_eq!(
            reason(&allocate(&[a], &p), "a"),
            Some(FailureReason::AddressNotInPool)
        );
    }

    #[test]
    fn exhausting_a_pool_and_freeing_by_deletion() {
        let p = one_pool(&["192.0.2.10-192.0.2.11"]);
        let services = vec![svc("a", 1), svc("b", 2), svc("c", 3)];
        let alloc = allocate(&services, &p);
        assert_eq!(decision(&alloc, "a").addresses, ips(&["192.0.2.10"]));
        assert_eq!(decision(&alloc, "b").addresses, ips(&["192.0.2.11"]));
        let f = decision(&alloc, "c").failure.clone().unwrap();
        assert_eq!(f.reason, FailureReason::PoolExhausted);
        assert_eq!(f.message, "auto-assign pools have no free IPv4 address");
        assert_eq!(alloc.in_use["main"], 2);

        // a is deleted; b keeps its address, c gets a's.
        let mut b = svc("b", 2);
        b.current = ips(&["192.0.2.11"]);
        let alloc = allocate(&[b, svc("c", 3)], &p);
        assert_eq!(decision(&alloc, "b").addresses, ips(&["192.0.2.11"]));
        assert_eq!(decision(&alloc, "c").addresses, ips(&["192.0.2.10"]));
        assert_eq!(decision(&alloc, "c").failure, None);
    }

    #[test]
    fn auto_assign_pools_are_tried_by_name_and_named_pools_always_serve() {
        let p = pools(&[
            ("b-second", spec(&["198.51.100.1"])),
            ("a-first", spec(&["192.0.2.1"])),
            (
                "manual",
                LoadBalancerPoolSpec {
                    auto_assign: false,
                    ..spec(&["203.0.113.1"])
                },
            ),
        ]);
        let mut named = svc("named", 0);
        named.pool = Some("manual".into());
        let alloc = allocate(&[svc("x", 1), svc("y", 2), svc("z", 3), named], &p);
        assert_eq!(decision(&alloc, "x").addresses, ips(&["192.0.2.1"]));
        assert_eq!(decision(&alloc, "y").addresses, ips(&["198.51.100.1"]));
        assert_eq!(reason(&alloc, "z"), Some(FailureReason::PoolExhausted));
        assert_eq!(decision(&alloc, "named").addresses, ips(&["203.0.113.1"]));
    }

    #[test]
    fn no_pool_failures() {
        let p = pools(&[
            (
                "manual",
                LoadBalancerPoolSpec {
                    auto_assign: false,
                    ..spec(&["203.0.113.0/24"])
                },
            ),
            ("broken", spec(&["not-an-address"])),
        ]);
        let mut missing = svc("missing", 1);
        missing.pool = Some("nope".into());
        let mut broken = svc("broken", 2);
        broken.pool = Some("broken".into());
        let alloc = allocate(&[svc("plain", 0), missing, broken], &p);
        let msg = |n: &str| decision(&alloc, n).failure.clone().unwrap();
        assert_eq!(msg("plain").reason, FailureReason::NoPool);
        assert!(msg("plain").message.contains("no pool with autoAssign"));
        assert_eq!(msg("missing").reason, FailureReason::NoPool);
        assert_eq!(msg("missing").message, "pool \"nope\" does not exist");
        assert_eq!(msg("broken").reason, FailureReason::NoPool);
        assert!(
            msg("broken")
                .message
                .starts_with("pool \"broken\" is invalid: "),
            "{}",
            msg("broken").message
        );
        let no_pools = allocate(&[svc("plain", 0)], &Pools::default());
        assert_eq!(reason(&no_pools, "plain"), Some(FailureReason::NoPool));
    }

    #[test]
    fn moving_to_a_named_pool_releases_the_old_address() {
        let p = pools(&[
            ("old", spec(&["192.0.2.1"])),
            ("new", spec(&["198.51.100.1"])),
        ]);
        let mut a = svc("a", 1);
        a.current = ips(&["192.0.2.1"]);
        a.pool = Some("new".into());
        let alloc = allocate(&[a, svc("b", 2)], &p);
        assert_eq!(decision(&alloc, "a").addresses, ips(&["198.51.100.1"]));
        assert_eq!(decision(&alloc, "b").addresses, ips(&["192.0.2.1"]));
    }

    #[test]
    fn single_stack_takes_the_first_family() {
        let p = one_pool(&["192.0.2.1", "2001:db8::1"]);
        let mut v6 = svc("v6", 1);
        v6.families = vec![Family::V6];
        let alloc = allocate(&[v6, svc("v4", 2)], &p);
        assert_eq!(decision(&alloc, "v6").addresses, ips(&["2001:db8::1"]));
        assert_eq!(decision(&alloc, "v4").addresses, ips(&["192.0.2.1"]));
    }

    #[test]
    fn a_family_no_pool_has_is_no_family() {
        let p = one_pool(&["192.0.2.0/24"]);
        let mut v6 = svc("v6", 1);
        v6.families = vec![Family::V6];
        let alloc = allocate(&[v6], &p);
        let f = decision(&alloc, "v6").failure.clone().unwrap();
        assert_eq!(f.reason, FailureReason::NoFamily);
        assert_eq!(f.message, "no auto-assign pool has IPv6 addresses");
        let mut named = svc("named", 1);
        named.families = vec![Family::V6];
        named.pool = Some("main".into());
        let f = decision(&allocate(&[named], &p), "named")
            .failure
            .clone()
            .unwrap();
        assert_eq!(f.reason, FailureReason::NoFamily);
        assert_eq!(f.message, "pool \"main\" has no IPv6 addresses");
    }

    #[test]
    fn prefer_dual_stack_takes_both_in_the_services_order() {
        let p = one_pool(&["192.0.2.1-192.0.2.3", "2001:db8::1-2001:db8::3"]);
        let mut a = svc("a", 1);
        a.families = vec![Family::V6, Family::V4];
        a.policy = FamilyPolicy::PreferDualStack;
        // Not defaulted by an API server: IPv4 first, both families.
        let mut b = svc("b", 2);
        b.policy = FamilyPolicy::PreferDualStack;
        // A single-stack cluster lists one family: only that one.
        let mut c = svc("c", 3);
        c.families = vec![Family::V4];
        c.policy = FamilyPolicy::PreferDualStack;
        let alloc = allocate(&[a, b, c], &p);
        assert_eq!(
            decision(&alloc, "a").addresses,
            ips(&["2001:db8::1", "192.0.2.1"])
        );
        assert_eq!(
            decision(&alloc, "b").addresses,
            ips(&["192.0.2.2", "2001:db8::2"])
        );
        let c = decision(&alloc, "c");
        assert_eq!(c.addresses, ips(&["192.0.2.3"]));
        assert_eq!((&c.failure, &c.missing_optional), (&None, &None));
    }

    #[test]
    fn prefer_dual_stack_settles_for_one_family() {
        let p = one_pool(&["192.0.2.1"]);
        let mut a = svc("a", 1);
        a.families = vec![Family::V4, Family::V6];
        a.policy = FamilyPolicy::PreferDualStack;
        let alloc = allocate(&[a], &p);
        let d = decision(&alloc, "a");
        assert_eq!(d.addresses, ips(&["192.0.2.1"]));
        assert_eq!(d.failure, None);
        assert_eq!(
            d.missing_optional.as_ref().map(|f| f.reason),
            Some(FailureReason::NoFamily)
        );
    }

    #[test]
    fn require_dual_stack_gets_both_or_nothing() {
        let p = one_pool(&["192.0.2.1-192.0.2.2", "2001:db8::1"]);
        let mut a = svc("a", 1);
        a.families = vec![Family::V4, Family::V6];
        a.policy = FamilyPolicy::RequireDualStack;
        let mut b = a.clone();
        b.key = ServiceKey::new("ns", "b");
        b.created = at(2);
        b.current = ips(&["192.0.2.2"]);
        let single = svc("single", 3);
        let alloc = allocate(&[a, b, single], &p);
        assert_eq!(
            decision(&alloc, "a").addresses,
            ips(&["192.0.2.1", "2001:db8::1"])
        );
        let d = decision(&alloc, "b");
        assert_eq!(
            d.addresses,
            ips(&[]),
            "no half allocation, even of what it held"
        );
        assert_eq!(
            d.failure.as_ref().map(|f| f.message.as_str()),
            Some("auto-assign pools have no free IPv6 address")
        );
        // b gave back .2; the younger single-stack Service gets it.
        assert_eq!(decision(&alloc, "single").addresses, ips(&["192.0.2.2"]));
        assert_eq!(alloc.in_use["main"], 3);
    }

    #[test]
    fn require_dual_stack_without_a_second_family_pool_is_no_family() {
        let p = one_pool(&["192.0.2.0/24"]);
        let mut a = svc("a", 1);
        a.policy = FamilyPolicy::RequireDualStack;
        let alloc = allocate(&[a, svc("b", 2)], &p);
        assert_eq!(reason(&alloc, "a"), Some(FailureReason::NoFamily));
        assert_eq!(decision(&alloc, "a").addresses, ips(&[]));
        // The IPv4 address a could not use went to b.
        assert_eq!(decision(&alloc, "b").addresses, ips(&["192.0.2.0"]));
    }

    #[test]
    fn requests_per_family_with_the_other_family_automatic() {
        let p = one_pool(&["192.0.2.0/24", "2001:db8::/120"]);
        let mut a = svc("a", 1);
        a.families = vec![Family::V4, Family::V6];
        a.policy = FamilyPolicy::RequireDualStack;
        a.requested = ips(&["2001:db8::42"]);
        let alloc = allocate(&[a], &p);
        assert_eq!(
            decision(&alloc, "a").addresses,
            ips(&["192.0.2.0", "2001:db8::42"])
        );
    }

    #[test]
    fn a_requested_family_the_service_does_not_have_is_a_bad_request() {
        let p = one_pool(&["192.0.2.0/24", "2001:db8::/120"]);
        let mut a = svc("a", 1);
        a.families = vec![Family::V4];
        a.requested = ips(&["2001:db8::42"]);
        let f = decision(&allocate(&[a], &p), "a").failure.clone().unwrap();
        assert_eq!(f.reason, FailureReason::BadRequest);
        assert_eq!(
            f.message,
            "requested address 2001:db8::42 is IPv6 but the Service's families are IPv4"
        );
        // Without spec.ipFamilies the request's family is the Service's.
        let mut b = svc("b", 1);
        b.requested = ips(&["2001:db8::42"]);
        let alloc = allocate(&[b], &p);
        assert_eq!(decision(&alloc, "b").addresses, ips(&["2001:db8::42"]));
    }

    #[test]
    fn a_bad_request_keeps_what_the_service_had() {
        let p = one_pool(&["192.0.2.1-192.0.2.2"]);
        let mut a = svc("a", 5);
        a.current = ips(&["192.0.2.1"]);
        a.bad_request = Some("xlb.dev/ip: \"x\" is not an IP address".into());
        let alloc = allocate(&[a, svc("b", 1), svc("c", 2)], &p);
        let d = decision(&alloc, "a");
        assert_eq!(d.addresses, ips(&["192.0.2.1"]));
        assert_eq!(
            d.failure.as_ref().map(|f| f.reason),
            Some(FailureReason::BadRequest)
        );
        assert_eq!(decision(&alloc, "b").addresses, ips(&["192.0.2.2"]));
        assert_eq!(reason(&alloc, "c"), Some(FailureReason::PoolExhausted));
    }

    #[test]
    fn a_deleted_pool_releases_its_addresses() {
        let p = one_pool(&["198.51.100.0/24"]);
        let mut a = svc("a", 1);
        a.current = ips(&["192.0.2.1"]);
        let alloc = allocate(&[a], &p);
        assert_eq!(decision(&alloc, "a").addresses, ips(&["198.51.100.0"]));
    }

    #[test]
    fn the_decision_does_not_depend_on_input_order() {
        let p = pools(&[
            (
                "p",
                spec(&["192.0.2.1-192.0.2.4", "2001:db8::1-2001:db8::2"]),
            ),
            (
                "q",
                LoadBalancerPoolSpec {
                    auto_assign: false,
                    ..spec(&["198.51.100.1-198.51.100.2"])
                },
            ),
        ]);
        let mut services = Vec::new();
        for i in 0..8 {
            let mut s = svc(&format!("s{i}"), (i * 7 % 5) as i64);
            match i % 4 {
                0 => s.policy = FamilyPolicy::PreferDualStack,
                1 => s.requested = ips(&["192.0.2.3"]),
                2 => s.pool = Some("q".into()),
                _ => s.current = ips(&["192.0.2.4"]),
            }
            services.push(s);
        }
        let base = allocate(&services, &p);
        // No address is given twice.
        let mut seen = BTreeSet::new();
        for d in base.decisions.values() {
            for a in &d.addresses {
                assert!(seen.insert(*a), "{a} given twice: {base:#?}");
            }
        }
        for rotation in 1..services.len() {
            let mut shuffled = services.clone();
            shuffled.rotate_left(rotation);
            shuffled.swap(0, services.len() - 1);
            assert_eq!(allocate(&shuffled, &p), base);
        }
    }

    #[test]
    fn allocating_again_from_the_result_changes_nothing() {
        let p = one_pool(&["192.0.2.1-192.0.2.3", "2001:db8::1"]);
        let mut services = vec![svc("a", 3), svc("b", 2), svc("c", 1), svc("d", 4)];
        services[1].policy = FamilyPolicy::PreferDualStack;
        services[2].requested = ips(&["192.0.2.3"]);
        let first = allocate(&services, &p);
        for s in &mut services {
            s.current = first.decisions[&s.key].addresses.clone();
        }
        assert_eq!(allocate(&services, &p), first);
    }
}
