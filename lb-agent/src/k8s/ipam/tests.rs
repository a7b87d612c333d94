//! Allocation rules, one decision at a time.

use super::*;
use std::net::Ipv4Addr;

use crate::k8s::{crd::LoadBalancerPoolSpec, sharing::Sharing};

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
        service_allocation: None,
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
    &a.decisions[&ServiceName::new("ns", name)]
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
    assert_eq!(
        r.size(false),
        (1 << 32) - 2,
        "network and broadcast reserved"
    );
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
fn ipv4_cidrs_of_slash_30_or_shorter_keep_their_first_and_last_address() {
    let all = |entry: &str| -> Vec<IpAddr> {
        Pool::parse("p", &spec(&[entry]))
            .unwrap()
            .addresses()
            .collect()
    };
    let sixteen = |first: &str| {
        let first: Ipv4Addr = first.parse().unwrap();
        (0..16)
            .map(|i| IpAddr::V4((u32::from(first) + i).into()))
            .collect::<Vec<_>>()
    };
    // The network and broadcast address of a /28 are not handed out...
    assert_eq!(all("192.0.2.0/28"), sixteen("192.0.2.0")[1..15].to_vec());
    assert_eq!(all("192.0.2.0/30"), ips(&["192.0.2.1", "192.0.2.2"]));
    // ...a /31 and a /32 have neither (RFC 3021)...
    assert_eq!(all("192.0.2.0/31"), ips(&["192.0.2.0", "192.0.2.1"]));
    assert_eq!(all("192.0.2.7/32"), ips(&["192.0.2.7"]));
    // ...a range is taken as written, and IPv6 has no broadcast address.
    assert_eq!(all("192.0.2.0-192.0.2.15"), sixteen("192.0.2.0"));
    assert_eq!(all("2001:db8::/126").len(), 4);
    assert_eq!(all("2001:db8::/126")[0], ip("2001:db8::"));

    let pool = Pool::parse("p", &spec(&["192.0.2.0/28"])).unwrap();
    assert_eq!(pool.size(), 14);
    assert!(!pool.contains(ip("192.0.2.0")) && !pool.contains(ip("192.0.2.15")));
    assert!(pool.contains(ip("192.0.2.1")) && pool.contains(ip("192.0.2.14")));
    // With avoidBuggyIPs the edges of a /24 are counted once.
    let mut s = spec(&["192.0.2.0/24", "198.51.100.128/25"]);
    s.avoid_buggy_ips = true;
    let pool = Pool::parse("p", &s).unwrap();
    assert_eq!(pool.size(), 254 + 126);
    assert_eq!(pool.size(), pool.addresses().count() as u64);
    assert_eq!(pool.addresses().nth(254), Some(ip("198.51.100.129")));
}

#[test]
fn size_matches_iteration_for_cidrs() {
    for prefix in 20..=32 {
        for base in ["192.0.2.0", "10.0.0.0", "255.255.255.0"] {
            let base: Ipv4Addr = base.parse().unwrap();
            let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
            let entry = format!("{}/{prefix}", Ipv4Addr::from(u32::from(base) & mask));
            for avoid in [false, true] {
                let mut s = spec(&[&entry]);
                s.avoid_buggy_ips = avoid;
                let Ok(pool) = Pool::parse("p", &s) else {
                    assert!(avoid && prefix == 32, "{entry} avoid={avoid}");
                    continue;
                };
                assert_eq!(
                    pool.size(),
                    pool.addresses().count() as u64,
                    "{entry} avoid={avoid}"
                );
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
    assert_eq!(r.key, ServiceName::new("web", "front"));
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
    // A range is taken as written: its .0 is handed out unless avoided.
    let mut s = spec(&["192.0.2.0-192.0.2.255"]);
    let a = allocate(&[svc("a", 1)], &pools(&[("p", s.clone())]));
    assert_eq!(decision(&a, "a").addresses, ips(&["192.0.2.0"]));
    s.avoid_buggy_ips = true;
    let a = allocate(&[svc("a", 1)], &pools(&[("p", s)]));
    assert_eq!(decision(&a, "a").addresses, ips(&["192.0.2.1"]));
}

#[test]
fn a_cidr_pool_hands_out_neither_its_network_nor_its_broadcast_address() {
    let p = one_pool(&["192.0.2.0/30"]);
    let alloc = allocate(&[svc("a", 1), svc("b", 2), svc("c", 3)], &p);
    assert_eq!(decision(&alloc, "a").addresses, ips(&["192.0.2.1"]));
    assert_eq!(decision(&alloc, "b").addresses, ips(&["192.0.2.2"]));
    assert_eq!(reason(&alloc, "c"), Some(FailureReason::PoolExhausted));

    // Nor on request, and the failure says why.
    let mut d = svc("d", 4);
    d.requested = ips(&["192.0.2.3"]);
    let alloc = allocate(&[d], &p);
    let failure = decision(&alloc, "d").failure.clone().unwrap();
    assert_eq!(failure.reason, FailureReason::AddressNotInPool);
    assert!(
        failure.message.contains("network or broadcast address"),
        "{}",
        failure.message
    );

    // One handed out before the rule is kept: an upgrade moves no Service.
    let mut e = svc("e", 5);
    e.current = ips(&["192.0.2.0"]);
    let alloc = allocate(&[e], &p);
    assert_eq!(decision(&alloc, "e").addresses, ips(&["192.0.2.0"]));
    assert_eq!(decision(&alloc, "e").failure, None);
    assert_eq!(alloc.in_use["main"], 1);
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
        alloc.decisions[&ServiceName::new("a-ns", "z")].addresses,
        ips(&["192.0.2.10"])
    );
    assert_eq!(
        alloc.decisions[&ServiceName::new("b-ns", "a")]
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
    assert_eq!(
        f.message,
        "192.0.2.15 is taken: it is used by Service ns/holder, which does not allow sharing \
         (annotation xlb.dev/allow-shared-ip)"
    );
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
                service_allocation: None,
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
                service_allocation: None,
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
                service_allocation: None,
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
    b.key = ServiceName::new("ns", "b");
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
    assert_eq!(decision(&alloc, "b").addresses, ips(&["192.0.2.1"]));
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
        ips(&["192.0.2.1", "2001:db8::42"])
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
    assert_eq!(decision(&alloc, "a").addresses, ips(&["198.51.100.1"]));
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
                service_allocation: None,
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

// --- Shared addresses ------------------------------------------------------

fn sharing(key: Option<&str>, ports: &[(i32, &str)]) -> Sharing {
    Sharing {
        key: key.map(str::to_string),
        ports: ports.iter().map(|(p, s)| (*p, s.to_string())).collect(),
        ..Default::default()
    }
}

fn shared_svc(
    name: &str,
    created: i64,
    key: Option<&str>,
    ports: &[(i32, &str)],
) -> ServiceRequest {
    let mut r = svc(name, created);
    r.sharing = sharing(key, ports);
    r
}

#[test]
fn dns_on_tcp_and_udp_shares_one_address_and_counts_once() {
    let p = one_pool(&["192.0.2.10-192.0.2.20"]);
    let tcp = shared_svc("dns-tcp", 1, Some("dns"), &[(53, "TCP")]);
    let udp = shared_svc("dns-udp", 2, Some("dns"), &[(53, "UDP")]);
    let web = svc("web", 3);
    for input in [
        vec![tcp.clone(), udp.clone(), web.clone()],
        vec![web.clone(), udp.clone(), tcp.clone()],
    ] {
        let alloc = allocate(&input, &p);
        assert_eq!(decision(&alloc, "dns-tcp").addresses, ips(&["192.0.2.10"]));
        assert_eq!(decision(&alloc, "dns-udp").addresses, ips(&["192.0.2.10"]));
        assert_eq!(decision(&alloc, "web").addresses, ips(&["192.0.2.11"]));
        assert_eq!(alloc.in_use["main"], 2, "a shared address counts once");
    }
}

#[test]
fn sharing_needs_both_sides_the_same_key_and_no_port_clash() {
    let p = one_pool(&["192.0.2.10"]);
    let mut holder = shared_svc("holder", 1, Some("k"), &[(53, "TCP")]);
    holder.current = ips(&["192.0.2.10"]);
    for (name, key, port, why) in [
        (
            "nokey",
            None,
            80,
            "shares it only with xlb.dev/allow-shared-ip: \"k\"",
        ),
        ("otherkey", Some("j"), 80, "under the key \"k\""),
        (
            "clash",
            Some("k"),
            53,
            "port 53/TCP is also a port of Service ns/holder",
        ),
    ] {
        let mut wants = shared_svc(name, 2, key, &[(port, "TCP")]);
        wants.requested = ips(&["192.0.2.10"]);
        let alloc = allocate(&[holder.clone(), wants], &p);
        assert_eq!(decision(&alloc, "holder").addresses, ips(&["192.0.2.10"]));
        let f = decision(&alloc, name).failure.clone().unwrap();
        assert_eq!(f.reason, FailureReason::AddressInUse, "{name}");
        assert!(
            f.message.contains("Service ns/holder") && f.message.contains(why),
            "{name}: {}",
            f.message
        );
    }
    // Requested and compatible: joins.
    let mut ok = shared_svc("ok", 2, Some("k"), &[(53, "UDP")]);
    ok.requested = ips(&["192.0.2.10"]);
    let alloc = allocate(&[holder.clone(), ok], &p);
    assert_eq!(decision(&alloc, "ok").addresses, ips(&["192.0.2.10"]));
}

#[test]
fn of_two_incompatible_holders_the_older_keeps_the_address() {
    let p = one_pool(&["192.0.2.10-192.0.2.11"]);
    let mut old = shared_svc("old", 1, Some("k"), &[(53, "TCP")]);
    old.current = ips(&["192.0.2.10"]);
    // Its key changed after both got the address: it moves.
    let mut young = shared_svc("young", 2, Some("j"), &[(53, "UDP")]);
    young.current = ips(&["192.0.2.10"]);
    let alloc = allocate(&[young, old], &p);
    assert_eq!(decision(&alloc, "old").addresses, ips(&["192.0.2.10"]));
    assert_eq!(decision(&alloc, "young").addresses, ips(&["192.0.2.11"]));
}

// --- Scoped pools ------------------------------------------------------------

fn scoped(addresses: &[&str], allocation: serde_json::Value) -> LoadBalancerPoolSpec {
    LoadBalancerPoolSpec {
        service_allocation: Some(serde_json::from_value(allocation).unwrap()),
        ..spec(addresses)
    }
}

fn in_ns(namespace: &str, name: &str, created: i64) -> ServiceRequest {
    let mut r = ServiceRequest::new(namespace, name);
    r.created = at(created);
    r
}

#[test]
fn a_team_pool_serves_only_its_namespaces_and_comes_before_the_default() {
    let p = pools(&[
        ("default", spec(&["192.0.2.10-192.0.2.19"])),
        (
            "team-a",
            scoped(
                &["198.51.100.0/30"],
                serde_json::json!({"priority": 10, "namespaces": ["team-a"]}),
            ),
        ),
        (
            "labelled",
            scoped(
                &["203.0.113.0/30"],
                serde_json::json!({"priority": 5,
                    "namespaceSelectors": [{"matchLabels": {"team": "b"}}],
                    "serviceSelectors": [{"matchExpressions": [
                        {"key": "exposure", "operator": "In", "values": ["public"]}]}]}),
            ),
        ),
    ]);
    let a = in_ns("team-a", "web", 1);
    let other = in_ns("shop", "web", 2);
    let mut b = in_ns("team-b", "web", 3);
    b.namespace_labels = [("team".to_string(), "b".to_string())].into();
    b.labels = [("exposure".to_string(), "public".to_string())].into();
    let mut b_private = b.clone();
    b_private.key.name = "private".into();
    b_private.labels.clear();
    let alloc = allocate(&[a, other, b, b_private], &p);
    let got = |ns: &str, name: &str| {
        alloc.decisions[&ServiceName::new(ns, name)]
            .addresses
            .clone()
    };
    assert_eq!(got("team-a", "web"), ips(&["198.51.100.1"]));
    assert_eq!(
        got("shop", "web"),
        ips(&["192.0.2.10"]),
        "the catch-all pool"
    );
    assert_eq!(got("team-b", "web"), ips(&["203.0.113.1"]));
    assert_eq!(
        got("team-b", "private"),
        ips(&["192.0.2.11"]),
        "service selector"
    );
}

#[test]
fn a_service_no_pool_may_serve_is_told_why() {
    let p = pools(&[(
        "team-a",
        scoped(
            &["198.51.100.0/30"],
            serde_json::json!({"namespaces": ["team-a"]}),
        ),
    )]);
    let alloc = allocate(&[in_ns("shop", "web", 1)], &p);
    let f = alloc.decisions[&ServiceName::new("shop", "web")]
        .failure
        .clone()
        .unwrap();
    assert_eq!(f.reason, FailureReason::NoPool);
    assert_eq!(
        f.message,
        "no auto-assign pool serves Service shop/web (pool \"team-a\": it does not serve namespace shop)"
    );
    // Naming the pool, or asking for one of its addresses, does not get around it.
    let mut named = in_ns("shop", "named", 2);
    named.pool = Some("team-a".into());
    let mut asks = in_ns("shop", "asks", 3);
    asks.requested = ips(&["198.51.100.1"]);
    let alloc = allocate(&[named, asks], &p);
    for name in ["named", "asks"] {
        let d = &alloc.decisions[&ServiceName::new("shop", name)];
        assert!(d.addresses.is_empty(), "{name}");
        assert_eq!(
            d.failure.as_ref().unwrap().reason,
            FailureReason::PoolNotAllowed,
            "{name}"
        );
    }
}

#[test]
fn a_bad_selector_makes_the_pool_invalid() {
    let p = pools(&[(
        "bad",
        scoped(
            &["198.51.100.0/30"],
            serde_json::json!({"serviceSelectors": [{"matchExpressions": [
                {"key": "x", "operator": "Sometimes", "values": ["y"]}]}]}),
        ),
    )]);
    assert!(p.get("bad").is_none());
    assert!(
        p.error("bad")
            .unwrap()
            .contains("spec.serviceAllocation.serviceSelectors[0]"),
        "{:?}",
        p.error("bad")
    );
}

#[test]
fn a_held_address_whose_pool_no_longer_serves_the_service_moves() {
    let p = pools(&[
        ("default", spec(&["192.0.2.10-192.0.2.19"])),
        (
            "team-a",
            scoped(
                &["198.51.100.0/30"],
                serde_json::json!({"namespaces": ["team-a"]}),
            ),
        ),
    ]);
    let mut held = in_ns("shop", "web", 1);
    held.current = ips(&["198.51.100.0"]);
    let alloc = allocate(&[held], &p);
    assert_eq!(
        alloc.decisions[&ServiceName::new("shop", "web")].addresses,
        ips(&["192.0.2.10"])
    );
}
