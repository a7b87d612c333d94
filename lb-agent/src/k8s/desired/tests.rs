//! Desired state from objects shaped as real clusters serve them
//! (`kubectl get -o json` of Services, EndpointSlices and Nodes, in testdata/).

use std::net::IpAddr;

use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use serde_json::{json, Value};

use super::*;
use crate::k8s::slice::Slice;

struct Objects {
    services: Vec<Service>,
    slices: Vec<EndpointSlice>,
    nodes: Vec<Node>,
}

fn load(text: &str) -> Objects {
    let list: Value = serde_json::from_str(text).unwrap();
    let mut o = Objects {
        services: vec![],
        slices: vec![],
        nodes: vec![],
    };
    for item in list["items"].as_array().unwrap() {
        match item["kind"].as_str().unwrap() {
            "Service" => o
                .services
                .push(serde_json::from_value(item.clone()).unwrap()),
            "EndpointSlice" => o.slices.push(serde_json::from_value(item.clone()).unwrap()),
            "Node" => o.nodes.push(serde_json::from_value(item.clone()).unwrap()),
            k => panic!("unexpected kind {k}"),
        }
    }
    o
}

fn opts(node: &str) -> SourceOptions {
    SourceOptions {
        load_balancer_class: "xlb.dev/xlb".into(),
        default_class: false,
        mode: Mode::Snat,
        node_name: node.into(),
    }
}

/// What the API server does on every write: a new resourceVersion for an
/// object that changed, the same for one that did not.
fn versioned<K: kube::Resource + serde::Serialize + Clone>(objects: &[K]) -> Vec<K> {
    use std::hash::{Hash, Hasher};
    objects
        .iter()
        .map(|o| {
            let mut o = o.clone();
            o.meta_mut().resource_version = None;
            let mut h = std::collections::hash_map::DefaultHasher::new();
            serde_json::to_string(&o).unwrap().hash(&mut h);
            o.meta_mut().resource_version = Some(h.finish().to_string());
            o
        })
        .collect()
}

fn compute(o: &Objects, opts: &SourceOptions, previous: &Desired) -> Desired {
    let services = versioned(&o.services);
    let slices: Vec<Slice> = versioned(&o.slices).into_iter().map(Slice::from).collect();
    let services: Vec<&Service> = services.iter().collect();
    let slices: Vec<&Slice> = slices.iter().collect();
    let node = o
        .nodes
        .iter()
        .find(|n| n.metadata.name.as_deref() == Some(&opts.node_name));
    desired_services(
        &ClusterView {
            services: &services,
            slices: &slices,
            node,
        },
        opts,
        previous,
    )
}

fn backends(d: &Desired, name: &str, vip: &str) -> Vec<(String, u32)> {
    let vip: IpAddr = vip.parse().unwrap();
    let s = d
        .services
        .iter()
        .find(|s| s.name == name && s.vip == vip)
        .unwrap_or_else(|| panic!("no {name} on {vip} in {:#?}", d.services));
    s.backends
        .iter()
        .map(|b| (b.addr().to_string(), b.weight))
        .collect()
}

const WEB: &str = include_str!("../testdata/web.json");
const DNS: &str = include_str!("../testdata/dual-stack-local.json");

#[test]
fn named_target_ports_resolve_through_each_slice() {
    let d = compute(&load(WEB), &opts("worker-1"), &Desired::default());
    assert_eq!(d.services.len(), 2, "{:#?}", d.services);
    // Port "http" targets a named container port: 8080 per the slices.
    // Both slices contribute; 10.244.1.12 is in both and counts once;
    // 10.244.3.4 has empty conditions (ready unset = ready); the
    // terminating-but-serving pod keeps its flows (weight 0); the pod
    // neither ready nor serving is left out.
    assert_eq!(
        backends(&d, "shop/web:http", "192.0.2.10"),
        vec![
            ("10.244.1.12:8080".into(), 1),
            ("10.244.2.7:8080".into(), 0),
            ("10.244.3.4:8080".into(), 1),
        ]
    );
    assert_eq!(
        backends(&d, "shop/web:https", "192.0.2.10"),
        vec![
            ("10.244.1.12:8443".into(), 1),
            ("10.244.2.7:8443".into(), 0),
            ("10.244.3.4:8443".into(), 1),
        ]
    );
    let web = &d.services[0];
    let terminating: Vec<String> = web
        .backends
        .iter()
        .filter(|b| b.terminating)
        .map(|b| b.addr().to_string())
        .collect();
    assert_eq!(
        terminating,
        ["10.244.2.7:8080"],
        "lbctl shows it terminating"
    );
    assert_eq!(
        (web.port, web.protocol, web.mode),
        (80, Protocol::Tcp, Mode::Snat)
    );
    assert_eq!(web.removed_backend_flows, RemovedBackendFlows::Keep);
    assert!(d.problems.is_empty(), "{:?}", d.problems);
}

#[test]
fn slices_of_another_namespace_do_not_count() {
    let d = compute(&load(WEB), &opts("worker-1"), &Desired::default());
    assert!(d
        .services
        .iter()
        .flat_map(|s| &s.backends)
        .all(|b| b.ip.to_string() != "10.244.9.9"));
}

#[test]
fn dual_stack_local_policy_keeps_this_nodes_endpoints_per_family() {
    let o = load(DNS);
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    // Two ports (UDP and TCP 53) on two VIPs.
    assert_eq!(d.services.len(), 4);
    assert_eq!(
        backends(&d, "infra/dns:dns", "192.0.2.53"),
        vec![("10.244.1.20:5353".into(), 1)]
    );
    assert_eq!(
        backends(&d, "infra/dns:dns-tcp", "2001:db8::53"),
        vec![("[fd00:10:244:1::20]:5353".into(), 1)]
    );
    let udp = d
        .services
        .iter()
        .find(|s| s.name == "infra/dns:dns")
        .unwrap();
    assert_eq!((udp.protocol, udp.mode), (Protocol::Udp, Mode::Nat));
    // A node with no local endpoint has services with no backends: it
    // reports that it cannot serve (and so announces nothing).
    let d3 = compute(&o, &opts("worker-3"), &Desired::default());
    assert_eq!(d3.services.len(), 4);
    assert!(d3.services.iter().all(|s| s.backends.is_empty()));
    assert!(serving_vips(&d3).is_empty());
    assert_eq!(serving_vips(&d).len(), 2);
}

#[test]
fn cluster_policy_takes_every_node() {
    let mut o = load(DNS);
    o.services[0].spec.as_mut().unwrap().external_traffic_policy = Some("Cluster".into());
    let d = compute(&o, &opts("worker-3"), &Desired::default());
    assert_eq!(backends(&d, "infra/dns:dns", "192.0.2.53").len(), 2);
}

#[test]
fn missing_slices_give_a_service_without_backends() {
    let mut o = load(WEB);
    o.slices.clear();
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert_eq!(d.services.len(), 2);
    assert!(d.services.iter().all(|s| s.backends.is_empty()));
}

#[test]
fn no_ingress_yet_means_nothing_to_serve() {
    let mut o = load(WEB);
    o.services[0].status = None;
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(d.services.is_empty());
    assert_eq!(d.by_service.get("shop/web"), Some(&vec![]));
}

#[test]
fn class_decides_ownership() {
    let mut o = load(WEB);
    o.services[0].spec.as_mut().unwrap().load_balancer_class = Some("other.io/lb".into());
    assert!(compute(&o, &opts("worker-1"), &Desired::default())
        .services
        .is_empty());
    o.services[0].spec.as_mut().unwrap().load_balancer_class = None;
    assert!(compute(&o, &opts("worker-1"), &Desired::default())
        .services
        .is_empty());
    let mut with_default = opts("worker-1");
    with_default.default_class = true;
    assert_eq!(
        compute(&o, &with_default, &Desired::default())
            .services
            .len(),
        2
    );
    o.services[0].spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
    assert!(compute(&o, &with_default, &Desired::default())
        .services
        .is_empty());
}

#[test]
fn excluded_node_serves_nothing() {
    let mut o = load(DNS);
    o.nodes[0]
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(EXCLUDE_LABEL.into(), "true".into());
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(d.excluded);
    assert!(d.services.is_empty());
}

#[test]
fn a_bad_update_keeps_the_previous_state() {
    let mut o = load(WEB);
    let good = compute(&o, &opts("worker-1"), &Desired::default());
    o.services[0]
        .metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(MODE_ANNOTATION.into(), "dsr".into());
    let d = compute(&o, &opts("worker-1"), &good);
    assert_eq!(d.services, good.services);
    assert!(
        d.problems
            .iter()
            .any(|p| p.contains("shop/web") && p.contains("dsr")),
        "{:?}",
        d.problems
    );
    assert!(d.held.is_empty(), "a last good state is used, not held");
    // With nothing to fall back on (an agent started under the broken
    // Service), nothing is served anew, and whatever the data plane has on
    // its addresses is held as it is.
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(d.services.is_empty());
    let vip: IpAddr = "192.0.2.10".parse().unwrap();
    assert_eq!(
        d.held.iter().copied().collect::<Vec<_>>(),
        vec![(vip, 80, Protocol::Tcp), (vip, 443, Protocol::Tcp)]
    );
    assert!(
        d.problems.iter().any(|p| p.contains("is left as it is")),
        "{:?}",
        d.problems
    );
}

#[test]
fn sctp_is_refused_clearly() {
    let mut o = load(WEB);
    o.services[0].spec.as_mut().unwrap().ports.as_mut().unwrap()[1].protocol = Some("SCTP".into());
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(d.services.is_empty());
    assert!(
        d.problems.iter().any(|p| p.contains("SCTP")),
        "{:?}",
        d.problems
    );
}

#[test]
fn two_services_on_one_vip_port_older_wins() {
    let mut o = load(WEB);
    let mut newer = o.services[0].clone();
    newer.metadata.name = Some("web-copy".into());
    newer.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2026-10-03T00:00:00Z".parse().unwrap(),
    ));
    o.services.insert(0, newer);
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert_eq!(d.services.len(), 2);
    assert!(d.services.iter().all(|s| s.name.starts_with("shop/web:")));
    assert!(d.problems.iter().any(|p| p.contains("shop/web-copy")));
}

fn ranges_of(d: &Desired, vip: &str) -> Vec<Option<Vec<String>>> {
    let vip: IpAddr = vip.parse().unwrap();
    d.services
        .iter()
        .filter(|s| s.vip == vip)
        .map(|s| {
            s.source_ranges
                .as_ref()
                .map(|r| r.iter().map(|n| n.to_string()).collect())
        })
        .collect()
}

#[test]
fn source_ranges_come_per_family_from_the_field_or_the_annotation() {
    let mut o = load(DNS);
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(
        d.services.iter().all(|s| s.source_ranges.is_none()),
        "open by default"
    );

    // The annotation, as kube-proxy reads it when the field is empty.
    o.services[0]
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(
            SOURCE_RANGES_ANNOTATION.into(),
            " 10.1.0.0/16 , 2001:db8:1::/48".into(),
        );
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert_eq!(
        ranges_of(&d, "192.0.2.53"),
        vec![Some(vec!["10.1.0.0/16".into()]); 2]
    );
    assert_eq!(
        ranges_of(&d, "2001:db8::53"),
        vec![Some(vec!["2001:db8:1::/48".into()]); 2]
    );

    // The field wins over the annotation; host bits are cleared as kube-proxy
    // does. A family without ranges admits no one (kube-proxy would leave it open).
    o.services[0]
        .spec
        .as_mut()
        .unwrap()
        .load_balancer_source_ranges = Some(vec!["203.0.113.9/24".into()]);
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert_eq!(
        ranges_of(&d, "192.0.2.53"),
        vec![Some(vec!["203.0.113.0/24".into()]); 2]
    );
    assert_eq!(ranges_of(&d, "2001:db8::53"), vec![Some(vec![]); 2]);

    // A range that is not a CIDR: the Service keeps its last good state.
    let good = d.clone();
    o.services[0]
        .spec
        .as_mut()
        .unwrap()
        .load_balancer_source_ranges = Some(vec!["203.0.113.0/24".into(), "everyone".into()]);
    let d = compute(&o, &opts("worker-1"), &good);
    assert_eq!(d.services, good.services);
    assert!(
        d.problems
            .iter()
            .any(|p| p.contains("\"everyone\" is not a CIDR")
                && p.contains("keeping its previous state")),
        "{:?}",
        d.problems
    );
}

#[test]
fn client_ip_affinity_and_its_timeout() {
    let mut o = load(DNS);
    let spec = o.services[0].spec.as_mut().unwrap();
    spec.session_affinity = Some("ClientIP".into());
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(d
        .services
        .iter()
        .all(|s| s.affinity.map(|a| a.timeout) == Some(DEFAULT_AFFINITY_TIMEOUT)));

    let spec = o.services[0].spec.as_mut().unwrap();
    spec.session_affinity_config = Some(
        serde_json::from_value(serde_json::json!({"clientIP": {"timeoutSeconds": 60}})).unwrap(),
    );
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(d
        .services
        .iter()
        .all(|s| s.affinity.map(|a| a.timeout.as_secs()) == Some(60)));

    let good = d.clone();
    let spec = o.services[0].spec.as_mut().unwrap();
    spec.session_affinity_config = Some(
        serde_json::from_value(serde_json::json!({"clientIP": {"timeoutSeconds": 90000}})).unwrap(),
    );
    let d = compute(&o, &opts("worker-1"), &good);
    assert_eq!(d.services, good.services);
    assert!(d
        .problems
        .iter()
        .any(|p| p.contains("timeoutSeconds 90000 is out of range")));
}

fn node(name: &str, zone: &str) -> Node {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "labels": {ZONE_LABEL: zone}},
    }))
    .unwrap()
}

#[test]
fn traffic_distribution_prefers_this_node_then_its_zone_then_all() {
    let mut o = load(WEB);
    let zone_of = |n: &str| if n == "worker-3" { "rack-b" } else { "rack-a" };
    // The hints the EndpointSlice controller writes for PreferSameNode.
    for s in &mut o.slices {
        for ep in &mut s.endpoints {
            let n = ep.node_name.clone().unwrap();
            ep.hints = Some(
                serde_json::from_value(serde_json::json!({
                    "forNodes": [{"name": n}], "forZones": [{"name": zone_of(&n)}],
                }))
                .unwrap(),
            );
        }
    }
    o.nodes = vec![
        node("worker-1", "rack-a"),
        node("worker-2", "rack-a"),
        node("worker-3", "rack-b"),
        node("worker-4", "rack-c"),
    ];
    let http = |o: &Objects, n: &str| {
        backends(
            &compute(o, &opts(n), &Desired::default()),
            "shop/web:http",
            "192.0.2.10",
        )
    };
    let all = http(&o, "worker-1");
    assert_eq!(
        all.len(),
        3,
        "without trafficDistribution: all endpoints {all:?}"
    );

    o.services[0].spec.as_mut().unwrap().traffic_distribution = Some("PreferSameNode".into());
    assert_eq!(http(&o, "worker-1"), vec![("10.244.1.12:8080".into(), 1)]);
    // No ready endpoint on worker-2: its zone's (the terminating one drains there).
    assert_eq!(
        http(&o, "worker-2"),
        vec![
            ("10.244.1.12:8080".into(), 1),
            ("10.244.2.7:8080".into(), 0)
        ]
    );
    // No endpoint in rack-c: everything (unlike externalTrafficPolicy: Local).
    assert_eq!(http(&o, "worker-4"), all);

    o.services[0].spec.as_mut().unwrap().traffic_distribution = Some("PreferClose".into());
    assert_eq!(http(&o, "worker-3"), vec![("10.244.3.4:8080".into(), 1)]);
    assert_eq!(http(&o, "worker-1").len(), 2, "rack-a's two");

    // A ready endpoint without hints: the hints are not trusted.
    for s in &mut o.slices {
        for ep in &mut s.endpoints {
            if ep.addresses[0] == "10.244.3.4" {
                ep.hints = None;
            }
        }
    }
    assert_eq!(http(&o, "worker-3"), all);
}

#[test]
fn balance_and_agent_check_annotations() {
    let mut o = load(WEB);
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(d.services.iter().all(|s| s.balance == Balance::Static));
    let set = |o: &mut Objects, k: &str, v: &str| {
        o.services[0]
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(k.into(), v.into());
    };
    set(&mut o, BALANCE_ANNOTATION, "load-aware");
    set(&mut o, AGENT_CHECK_PORT_ANNOTATION, "9999");
    let good = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(!good.services.is_empty());
    assert!(good.services.iter().all(|s| s.balance
        == Balance::LoadAware {
            agent_check: Some(AgentCheck { port: 9999 })
        }));
    for (k, v, why) in [
        (
            BALANCE_ANNOTATION,
            "least-conn",
            "neither static nor load-aware",
        ),
        (AGENT_CHECK_PORT_ANNOTATION, "http", "is not a port"),
        (
            BALANCE_ANNOTATION,
            "static",
            "needs xlb.dev/balance: load-aware",
        ),
    ] {
        let mut bad = load(WEB);
        set(&mut bad, BALANCE_ANNOTATION, "load-aware");
        set(&mut bad, AGENT_CHECK_PORT_ANNOTATION, "9999");
        set(&mut bad, k, v);
        let d = compute(&bad, &opts("worker-1"), &good);
        assert_eq!(d.services, good.services, "{v}: keeps the last good state");
        assert!(
            d.problems.iter().any(|p| p.contains(why)),
            "{v}: {:?}",
            d.problems
        );
    }
}

#[test]
fn announce_annotation() {
    let mut o = load(WEB);
    let d = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(d.services.iter().all(|s| s.announce == Announce::Both));
    o.services[0]
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(ANNOUNCE_ANNOTATION.into(), " l2".into());
    let good = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(!good.services.is_empty());
    assert!(good.services.iter().all(|s| s.announce == Announce::L2));
    o.services[0]
        .metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert(ANNOUNCE_ANNOTATION.into(), "arp".into());
    let bad = compute(&o, &opts("worker-1"), &good);
    assert_eq!(bad.services, good.services, "keeps the last good state");
    assert!(
        bad.problems
            .iter()
            .any(|p| p.contains("none of bgp, l2, both")),
        "{:?}",
        bad.problems
    );
}

#[test]
fn a_cordoned_tainted_or_deleted_node_is_leaving() {
    let node = |spec: Value, meta: Value| -> Node {
        let mut m = json!({"name": "worker-1"});
        m.as_object_mut()
            .unwrap()
            .extend(meta.as_object().unwrap().clone());
        serde_json::from_value(json!({"metadata": m, "spec": spec})).unwrap()
    };
    assert!(!node_is_leaving(&node(json!({}), json!({}))));
    assert!(node_is_leaving(&node(
        json!({"unschedulable": true}),
        json!({})
    )));
    assert!(node_is_leaving(&node(
        json!({"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}),
        json!({})
    )));
    assert!(!node_is_leaving(&node(
        json!({"taints": [{"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]}),
        json!({})
    )));
    assert!(node_is_leaving(&node(
        json!({}),
        json!({"deletionTimestamp": "2026-11-25T00:00:00Z"})
    )));
}

#[test]
fn new_flow_limit_annotation() {
    let mut o = load(WEB);
    let set = |o: &mut Objects, v: &str| {
        o.services[0]
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(NEW_FLOW_LIMIT_ANNOTATION.into(), v.into());
    };
    set(&mut o, "per-second=100, ipv4-prefix=24");
    let good = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(!good.services.is_empty());
    let want = Some(crate::dataplane::NewFlowLimit {
        per_second: 100,
        burst: 100,
        ipv4_prefix: 24,
        ipv6_prefix: 64,
    });
    assert!(good.services.iter().all(|s| s.new_flow_limit == want));
    for (bad, why) in [
        ("burst=5", "per-second is required"),
        ("per-second=0", "per-second must be 1 to"),
        (
            "per-second=10,ipv4-prefix=40",
            "ipv4-prefix must be 0 to 32",
        ),
        ("per-second=ten", "is not a number"),
        ("per-second=10,prefix=24", "unknown key"),
    ] {
        set(&mut o, bad);
        let d = compute(&o, &opts("worker-1"), &good);
        assert_eq!(
            d.services, good.services,
            "{bad}: keeps the last good state"
        );
        assert!(
            d.problems.iter().any(|p| p.contains(why)),
            "{bad}: {:?}",
            d.problems
        );
    }
}

#[test]
fn a_pod_on_this_node_is_known_by_its_uid() {
    let o = load(WEB);
    let cgroups = |node: &str| -> Vec<(String, Option<BackendCgroup>)> {
        let d = compute(&o, &opts(node), &Desired::default());
        let s = d.services.iter().find(|s| s.port == 80).unwrap();
        s.backends
            .iter()
            .map(|b| (b.addr().to_string(), b.cgroup.as_deref().cloned()))
            .collect()
    };
    let pod = |n: u8| {
        Some(BackendCgroup::Pod(format!(
            "0b7f6c0c-8a1e-4b8b-9d55-3a0b0d7c1a0{n}"
        )))
    };
    // 10.244.1.12 is also in a slice without its Pod's reference.
    assert_eq!(
        cgroups("worker-1"),
        vec![
            ("10.244.1.12:8080".into(), pod(1)),
            ("10.244.2.7:8080".into(), None),
            ("10.244.3.4:8080".into(), None),
        ]
    );
    assert_eq!(
        cgroups("worker-2"),
        vec![
            ("10.244.1.12:8080".into(), None),
            ("10.244.2.7:8080".into(), pod(2)),
            ("10.244.3.4:8080".into(), None),
        ]
    );
}

#[test]
fn an_unchanged_service_keeps_its_result_and_a_changed_one_is_made_afresh() {
    let mut o = load(WEB);
    let dns = load(DNS);
    o.services.extend(dns.services);
    o.slices.extend(dns.slices);
    o.nodes.extend(dns.nodes);
    let first = compute(&o, &opts("worker-1"), &Desired::default());
    assert!(first
        .services
        .iter()
        .any(|s| s.name.starts_with("shop/web:")));
    assert!(first
        .services
        .iter()
        .any(|s| !s.name.starts_with("shop/web:")));
    let again = compute(&o, &opts("worker-1"), &first);
    assert!(!first.services.is_empty());
    for (a, b) in first.services.iter().zip(&again.services) {
        assert!(Arc::ptr_eq(a, b), "{} made afresh", a.name);
    }
    // A slice changes: its Service is made afresh, with the new endpoint state.
    let slice = &mut o.slices[0];
    let service = slice.metadata.labels.as_ref().unwrap()[SERVICE_NAME_LABEL].clone();
    let endpoint = &mut slice.endpoints[0];
    endpoint.conditions.get_or_insert_default().ready = Some(false);
    endpoint.conditions.get_or_insert_default().serving = Some(false);
    let changed = compute(&o, &opts("worker-1"), &again);
    assert_ne!(changed.services, again.services);
    for (a, b) in again.services.iter().zip(&changed.services) {
        let ours = a.name.starts_with(&format!("shop/{service}:"));
        assert_eq!(!Arc::ptr_eq(a, b), ours, "{}", a.name);
    }
}

mod generated {
    //! Generated input (`cargo xtask fuzz` runs these long): the web
    //! Service with arbitrary xlb.dev annotations, source ranges and
    //! affinity timeout. Nothing panics, and the Service always has a
    //! result: the new one, or its last good one with the problem named.
    use k8s_openapi::api::core::v1::{ClientIPConfig, SessionAffinityConfig};
    use proptest::{collection::vec, option, prelude::*};

    use super::*;

    fn one_of(valid: &'static [&'static str]) -> BoxedStrategy<String> {
        prop_oneof![
            proptest::sample::select(valid).prop_map(str::to_string),
            "[a-z0-9=,./:-]{0,24}",
            "\\PC{0,12}",
        ]
        .boxed()
    }

    proptest! {
        #[test]
        fn generated_annotations_never_panic_and_keep_a_result(
            mode in option::of(one_of(&["nat", "snat"])),
            balance in option::of(one_of(&["static", "load-aware"])),
            agent_port in option::of(one_of(&["8081", "0", "65536"])),
            announce in option::of(one_of(&["bgp", "l2", "both"])),
            limit in option::of(one_of(&[
                "per-second=100",
                "per-second=100,burst=20",
                "per-second=5,ipv4-prefix=24,ipv6-prefix=64",
                "burst=1",
            ])),
            ip in option::of(one_of(&["192.0.2.10", "192.0.2.10,2001:db8::10", "::"])),
            ranges in option::of(vec(one_of(&["10.0.0.0/8", "192.0.2.7", "2001:db8::/32"]), 0..3)),
            affinity in option::of(any::<i32>()),
        ) {
            let good = compute(&load(WEB), &opts("worker-1"), &Desired::default());
            let mut o = load(WEB);
            let svc = &mut o.services[0];
            let notes = svc.metadata.annotations.get_or_insert_with(Default::default);
            for (key, value) in [
                (crate::k8s::MODE_ANNOTATION, mode),
                (crate::k8s::BALANCE_ANNOTATION, balance),
                (crate::k8s::AGENT_CHECK_PORT_ANNOTATION, agent_port),
                (crate::k8s::ANNOUNCE_ANNOTATION, announce),
                (crate::k8s::NEW_FLOW_LIMIT_ANNOTATION, limit),
                (crate::k8s::IP_ANNOTATION, ip),
            ] {
                if let Some(v) = value {
                    notes.insert(key.to_string(), v);
                }
            }
            let spec = svc.spec.as_mut().expect("a spec");
            spec.load_balancer_source_ranges = ranges;
            if let Some(t) = affinity {
                spec.session_affinity = Some("ClientIP".into());
                spec.session_affinity_config = Some(SessionAffinityConfig {
                    client_ip: Some(ClientIPConfig { timeout_seconds: Some(t) }),
                });
            }
            let d = compute(&o, &opts("worker-1"), &good);
            let kept = d.by_service.get("shop/web").is_some_and(|s| !s.is_empty());
            prop_assert!(kept, "no result for shop/web: {:?}", d.problems);
        }
    }
}
