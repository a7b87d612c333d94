//! Address pools: families, ranges, the `LoadBalancerPool` specs parsed
//! into usable pools (with their `serviceAllocation` scope), and the set
//! of all pools.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use k8s_openapi::jiff::Timestamp;
use kube::core::{Selector, SelectorExt};

use super::{Holders, ServiceRequest};
use crate::k8s::crd::LoadBalancerPoolSpec;

/// What a pool reports as its size at most (a /64 would not fit a gauge).
pub const SIZE_CAP: u64 = 1 << 32;

pub use lb_common::net::Family;

/// The name Kubernetes gives a family in `spec.ipFamilies`.
pub fn k8s_name(family: Family) -> &'static str {
    match family {
        Family::V4 => "IPv4",
        Family::V6 => "IPv6",
    }
}

pub(super) fn from_k8s_name(s: &str) -> Option<Family> {
    match s {
        "IPv4" => Some(Family::V4),
        "IPv6" => Some(Family::V6),
        _ => None,
    }
}

pub(crate) fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u32::from(a) as u128,
        IpAddr::V6(a) => u128::from(a),
    }
}

pub(crate) fn from_u128(family: Family, n: u128) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::from(n as u32)),
        Family::V6 => IpAddr::V6(Ipv6Addr::from(n)),
    }
}

/// IPv4 addresses ending in .0 or .255, which some clients and routers
/// mishandle (they look like network or broadcast addresses).
pub(crate) fn is_buggy(family: Family, n: u128) -> bool {
    family == Family::V4 && matches!(n & 0xff, 0 | 0xff)
}

/// An inclusive range of addresses of one family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AddressRange {
    family: Family,
    first: u128,
    last: u128,
    /// The first and last address are not handed out: the network and
    /// broadcast addresses of an IPv4 CIDR of /30 or shorter, which hosts
    /// on that network treat as such (a /31 or /32 has neither, RFC 3021).
    edges_reserved: bool,
}

/// The longest IPv4 prefix whose first and last address are reserved.
const EDGES_RESERVED_UP_TO: u32 = 30;

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
            let family = Family::of(ip);
            let prefix: u32 = prefix
                .trim()
                .parse()
                .map_err(|_| format!("{entry:?}: prefix length {prefix:?} is not a number"))?;
            let net = u8::try_from(prefix)
                .ok()
                .and_then(|p| IpNet::new(ip, p).ok())
                .ok_or_else(|| {
                    format!(
                        "{entry:?}: prefix length {prefix} is longer than {} bits",
                        family.bits()
                    )
                })?;
            if net.trunc() != net {
                return Err(format!(
                    "{entry:?}: host bits are set (the network is {})",
                    net.trunc()
                ));
            }
            return Ok(AddressRange {
                family,
                first: to_u128(net.network()),
                last: to_u128(net.broadcast()),
                edges_reserved: family == Family::V4 && prefix <= EDGES_RESERVED_UP_TO,
            });
        }
        if let Some((a, b)) = entry.split_once('-') {
            let (a, b) = (parse_ip(a)?, parse_ip(b)?);
            if Family::of(a) != Family::of(b) {
                return Err(format!("{entry:?}: the range mixes IPv4 and IPv6"));
            }
            let (first, last) = (to_u128(a), to_u128(b));
            if first > last {
                return Err(format!("{entry:?}: the range ends before it starts"));
            }
            return Ok(AddressRange {
                family: Family::of(a),
                first,
                last,
                edges_reserved: false,
            });
        }
        let ip = parse_ip(entry)
            .map_err(|_| format!("{entry:?} is not a CIDR, a range (A-B) or an IP address"))?;
        Ok(AddressRange {
            family: Family::of(ip),
            first: to_u128(ip),
            last: to_u128(ip),
            edges_reserved: false,
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

    /// Whether `ip` lies in the range (reserved addresses and avoidBuggyIPs
    /// not considered).
    pub fn contains(&self, ip: IpAddr) -> bool {
        Family::of(ip) == self.family && (self.first..=self.last).contains(&to_u128(ip))
    }

    /// Whether `n` is in the range but not handed out.
    fn skips(&self, n: u128, avoid_buggy: bool) -> bool {
        (avoid_buggy && is_buggy(self.family, n))
            || (self.edges_reserved && (n == self.first || n == self.last))
    }

    pub fn overlaps(&self, other: &AddressRange) -> bool {
        self.family == other.family && self.first <= other.last && other.first <= self.last
    }

    /// The first address at or after `from` that is usable, within the range.
    pub(crate) fn usable_from(&self, from: u128, avoid_buggy: bool) -> Option<u128> {
        let mut n = from.max(self.first);
        // At most three in a row: .255, .0 and a reserved edge.
        while n <= self.last && self.skips(n, avoid_buggy) {
            n = n.checked_add(1)?;
        }
        (n <= self.last).then_some(n)
    }

    /// How many usable addresses the range holds (saturating).
    pub(crate) fn size(&self, avoid_buggy: bool) -> u128 {
        let all = (self.last - self.first).saturating_add(1);
        // Reserved edges that avoidBuggyIPs does not already skip (a /30 or
        // shorter has two distinct edges).
        let edges = if self.edges_reserved {
            [self.first, self.last]
                .iter()
                .filter(|&&n| !(avoid_buggy && is_buggy(self.family, n)))
                .count() as u128
        } else {
            0
        };
        let all = all - edges;
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
    /// `serviceAllocation`; `None`: every Service, tried last.
    pub scope: Option<PoolScope>,
}

/// A pool's `serviceAllocation`, with its selectors parsed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolScope {
    pub priority: Option<i32>,
    pub namespaces: BTreeSet<String>,
    pub namespace_selectors: Vec<Selector>,
    pub service_selectors: Vec<Selector>,
}

impl PoolScope {
    pub(crate) fn parse(a: &crate::k8s::crd::ServiceAllocation) -> Result<PoolScope, String> {
        let selectors =
            |list: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector],
             field: &str| {
                list.iter()
                    .enumerate()
                    .map(|(i, s)| {
                        Selector::try_from(s.clone()).map_err(|e| {
                            format!(
                                "spec.serviceAllocation.{field}[{i}] is not a valid selector: {e}"
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()
            };
        Ok(PoolScope {
            priority: a.priority,
            namespaces: a.namespaces.iter().map(|n| n.trim().to_string()).collect(),
            namespace_selectors: selectors(&a.namespace_selectors, "namespaceSelectors")?,
            service_selectors: selectors(&a.service_selectors, "serviceSelectors")?,
        })
    }

    /// Why the pool does not serve `req`, if it does not.
    pub(crate) fn refuses(&self, req: &ServiceRequest) -> Option<String> {
        let ns = &req.key.namespace;
        let any_ns = self.namespaces.is_empty() && self.namespace_selectors.is_empty();
        let ns_ok = any_ns
            || self.namespaces.contains(ns)
            || self
                .namespace_selectors
                .iter()
                .any(|s| s.matches(&req.namespace_labels));
        if !ns_ok {
            return Some(format!("it does not serve namespace {ns}"));
        }
        let svc_ok = self.service_selectors.is_empty()
            || self
                .service_selectors
                .iter()
                .any(|s| s.matches(&req.labels));
        (!svc_ok).then(|| "the Service's labels match none of its serviceSelectors".to_string())
    }
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
        let scope = match &spec.service_allocation {
            None => None,
            Some(a) => Some(PoolScope::parse(a)?),
        };
        let pool = Pool {
            name: name.to_string(),
            ranges: parsed.into_iter().map(|(_, r)| r).collect(),
            avoid_buggy_ips: spec.avoid_buggy_ips,
            auto_assign: spec.auto_assign,
            scope,
        };
        if pool.size() == 0 {
            return Err("no usable address (avoidBuggyIPs leaves none)".into());
        }
        Ok(pool)
    }

    pub fn ranges(&self) -> &[AddressRange] {
        &self.ranges
    }

    /// Why the pool may not give `req` an address, if so.
    pub fn refuses(&self, req: &ServiceRequest) -> Option<String> {
        self.scope.as_ref()?.refuses(req)
    }

    /// Order in which pools are tried: by priority, then unscoped pools.
    pub(super) fn order_key(&self) -> (bool, i32) {
        let p = self.scope.as_ref().and_then(|s| s.priority);
        (p.is_none(), p.unwrap_or_default())
    }

    /// Whether the pool may hand out `ip` (reserved addresses and
    /// avoidBuggyIPs considered).
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.ranges
            .iter()
            .any(|r| r.contains(ip) && !r.skips(to_u128(ip), self.avoid_buggy_ips))
    }

    /// Whether a Service that holds `ip` keeps it: as [`Pool::contains`],
    /// but a reserved network or broadcast address handed out before they
    /// were reserved is kept, so that an upgrade moves no Service.
    pub fn may_keep(&self, ip: IpAddr) -> bool {
        !(self.avoid_buggy_ips && is_buggy(Family::of(ip), to_u128(ip)))
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
    pub(super) fn first_free(&self, family: Family, used: &Holders) -> Option<IpAddr> {
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

    /// The usable pool in which a holder of `ip` keeps it ([`Pool::may_keep`]).
    pub fn pool_keeping(&self, ip: IpAddr) -> Option<&Pool> {
        self.valid.values().find(|p| p.may_keep(ip))
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
pub(crate) fn age_key(created: Option<Timestamp>, name: &str) -> (bool, Option<Timestamp>, &str) {
    (created.is_none(), created, name)
}
