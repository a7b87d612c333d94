//! The Service fields users rely on, on the real control plane
//! (`xlb_tests::cluster`): `loadBalancerSourceRanges` (and kube-proxy's
//! annotation) refuse clients outside them in the XDP program, and
//! `sessionAffinity: ClientIP` keeps every connection of a client on one
//! backend; a load-aware Service reads its local Pods' CPU from the cgroups
//! kubelet would give them. Traffic is real: HTTP from the client namespace,
//! which holds two addresses (10.0.0.2, the default source, and 10.0.0.3).

use std::{net::SocketAddr, time::Duration};

use serde_json::{json, Value};
use xlb_tests::{
    cgroup::{Burner, CpuLimit},
    k8s_topology::{K8sTopology, NS, SERVICE},
    topology::{AgentHandle, VIP},
    traffic::{keepalive_to, wait_until},
};

const OTHER_CLIENT: &str = "10.0.0.3";

fn vip() -> SocketAddr {
    SocketAddr::from((VIP, 80))
}

/// One `GET /` from the client address `src`: the backend's name, or
/// `None` when no answer came within a second.
fn get_from(k: &K8sTopology, src: &str) -> Option<String> {
    let url = format!("http://{VIP}/");
    let out = k.t.output_in(
        &k.t.client,
        "curl",
        &["-s", "--max-time", "1", "--interface", src, &url],
    );
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Packets dropped under `drop_source_range`, from `lbctl stats`.
fn refused(k: &K8sTopology) -> u64 {
    dropped(k, "drop_source_range")
}

/// Packets counted under `reason`, from `lbctl stats`.
fn dropped(k: &K8sTopology, reason: &str) -> u64 {
    let v = k.t.lbctl_json(&["stats"]);
    v["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["reason"] == reason)
        .map_or(0, |r| r["total"].as_u64().unwrap())
}

/// The data plane's one service row (`lbctl services`).
fn service_row(k: &K8sTopology) -> Value {
    k.t.lbctl_json(&["services"])["services"][0].clone()
}

fn patch_service(k: &K8sTopology, patch: Value) {
    k.cluster.patch("service", Some(NS), SERVICE, &patch, false);
}

/// How many of `n` connections in a row from 10.0.0.2 are answered.
fn answered_at_once(k: &K8sTopology, n: usize) -> usize {
    (0..n).filter(|_| get_from(k, "10.0.0.2").is_some()).count()
}

/// Waits until `src` is answered (`true`) or refused (`false`).
fn wait_served(k: &K8sTopology, src: &str, served: bool) {
    wait_until(
        &format!("{src} is {}", if served { "served" } else { "refused" }),
        Duration::from_secs(20),
        || (get_from(k, src).is_some() == served).then_some(()),
    );
}

/// A topology whose client also has `OTHER_CLIENT`, the Service with
/// `spec` over `pods` ready Pods, and its agent, once 10.0.0.2 is served.
fn serving_two_clients(name: &str, spec: Value, pods: usize) -> (K8sTopology, AgentHandle) {
    let mut k = K8sTopology::new(name, 2);
    k.t.client
        .run(&format!("ip addr add {OTHER_CLIENT}/24 dev eth0"));
    k.create_service(SERVICE, spec);
    for n in 1..=pods {
        k.cluster.run_pod(&k.pod(n, true));
    }
    let agent = k.start_agent();
    wait_until(
        "the Service gets an address",
        Duration::from_secs(20),
        || k.ingress_ip(SERVICE),
    );
    k.wait_programmed(1);
    wait_served(&k, "10.0.0.2", true);
    (k, agent)
}

#[test]
fn source_ranges_refuse_outside_clients_and_follow_changes() {
    let (k, agent) = serving_two_clients(
        "k8r",
        json!({"loadBalancerSourceRanges": ["10.0.0.2/32"]}),
        2,
    );
    assert_eq!(service_row(&k)["source_ranges"], json!(["10.0.0.2/32"]));

    // A client outside the ranges gets nothing, and is counted.
    let before = refused(&k);
    assert_eq!(get_from(&k, OTHER_CLIENT), None);
    assert!(refused(&k) > before, "refused SYNs are counted");
    assert!(
        agent
            .metrics()
            .lines()
            .any(|l| l.contains("reason=\"drop_source_range\"") && !l.ends_with(" 0")),
        "the metric shows the refusals"
    );

    // The ranges change: the other client gets in, and the first one's
    // established connection is cut at its next packet.
    let mut kept = keepalive_to(&k.t, vip(), "b1");
    kept.stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    patch_service(
        &k,
        json!({"spec": {"loadBalancerSourceRanges": [format!("{OTHER_CLIENT}/32")]}}),
    );
    wait_served(&k, OTHER_CLIENT, true);
    assert_eq!(get_from(&k, "10.0.0.2"), None);
    assert!(
        kept.get().is_err(),
        "a connection from a client no longer allowed is cut"
    );

    // With the field empty, kube-proxy's annotation applies.
    patch_service(
        &k,
        json!({
            "metadata": {"annotations": {
                "service.beta.kubernetes.io/load-balancer-source-ranges": "10.0.0.2/32"}},
            "spec": {"loadBalancerSourceRanges": null},
        }),
    );
    wait_served(&k, "10.0.0.2", true);
    wait_served(&k, OTHER_CLIENT, false);

    // No ranges at all: open to everyone.
    patch_service(
        &k,
        json!({"metadata": {"annotations": {
            "service.beta.kubernetes.io/load-balancer-source-ranges": null}}}),
    );
    wait_served(&k, OTHER_CLIENT, true);
    assert_eq!(service_row(&k)["source_ranges"], Value::Null);
    assert!(get_from(&k, "10.0.0.2").is_some());
}

#[test]
fn client_ip_affinity_keeps_each_client_on_one_backend() {
    let mut k = K8sTopology::new("k8a", 3);
    k.t.client
        .run(&format!("ip addr add {OTHER_CLIENT}/24 dev eth0"));
    k.create_service(
        SERVICE,
        json!({
            "sessionAffinity": "ClientIP",
            "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 600}},
        }),
    );
    for n in 1..=3 {
        k.cluster.run_pod(&k.pod(n, true));
    }
    let _agent = k.start_agent();
    k.wait_slices_ready(&[1, 2, 3]);
    wait_until(
        "the data plane has the Service with three backends and affinity",
        Duration::from_secs(20),
        || {
            let row = service_row(&k);
            (row["backends"] == 3 && row["affinity"] == "client_ip").then_some(())
        },
    );

    // 50 connections from one client, from both CPUs: one backend.
    let seen = k.answered_by(50);
    assert_eq!(seen.len(), 1, "one client, one backend: {seen:?}");
    assert_eq!(seen.values().sum::<usize>(), 50);
    let other: std::collections::BTreeSet<String> = (0..20)
        .map(|_| get_from(&k, OTHER_CLIENT).expect("the other client is served"))
        .collect();
    assert_eq!(other.len(), 1, "the other client, one backend: {other:?}");

    // Without affinity the same client's connections spread again.
    patch_service(&k, json!({"spec": {"sessionAffinity": "None"}}));
    wait_until(
        "connections spread once affinity is off",
        Duration::from_secs(20),
        || (k.answered_by(30).len() >= 2).then_some(()),
    );
}

/// A Service on port 53 of `protocol` to the Pods' port `target`.
fn dns_service(name: &str, protocol: &str, target: u16, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS, "annotations": annotations},
        "spec": {
            "type": "LoadBalancer",
            "loadBalancerClass": "xlb.dev/xlb",
            "selector": {"app": "web"},
            "ports": [{"name": "dns", "port": 53, "targetPort": target, "protocol": protocol}],
        },
    })
}

/// The allocator's condition on a Service: (status, reason, message).
fn allocated_condition(k: &K8sTopology, name: &str) -> Option<(String, String, String)> {
    let svc = k.cluster.get("service", Some(NS), name)?;
    svc["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "xlb.dev/AddressAllocated")
        .map(|c| {
            let s = |f: &str| c[f].as_str().unwrap_or_default().to_string();
            (s("status"), s("reason"), s("message"))
        })
}

/// The classic: DNS on TCP and UDP port 53 as two Services on one address
/// (the pool holds just that one), both served by the data plane; a third
/// Service that asks for the address without the sharing key is refused
/// with a condition and an Event naming a holder.
#[test]
fn two_services_share_one_address_on_tcp_and_udp_53() {
    let mut k = K8sTopology::new("k8h", 2);
    k.t.start_udp_echo(5353);
    let key = json!({"xlb.dev/allow-shared-ip": "dns"});
    k.cluster
        .create(&dns_service("dns-tcp", "TCP", 8080, key.clone()));
    k.cluster.create(&dns_service("dns-udp", "UDP", 5353, key));
    k.cluster.run_pod(&k.pod(1, true));
    k.cluster.run_pod(&k.pod(2, true));
    let agent = k.start_agent();
    for name in ["dns-tcp", "dns-udp"] {
        let ip = wait_until(
            &format!("{name} gets the shared address"),
            Duration::from_secs(20),
            || k.ingress_ip(name),
        );
        assert_eq!(ip, std::net::IpAddr::V4(VIP), "{name}");
    }
    k.wait_programmed(2);

    // TCP 53 reaches nginx, UDP 53 the echo servers, through one VIP.
    let dns = SocketAddr::from((VIP, 53));
    wait_until("TCP 53 answers", Duration::from_secs(20), || {
        let answer = xlb_tests::topology::in_netns(&k.t.client, move || {
            xlb_tests::traffic::one_request(dns)
        })
        .join()
        .unwrap();
        answer.ok().filter(|(_, body)| body.starts_with('b'))
    });
    let echoed = xlb_tests::topology::in_netns(&k.t.client, move || {
        let sock = std::net::UdpSocket::bind("10.0.0.2:0").unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut buf = [0u8; 64];
        (0..20).find_map(|_| {
            sock.send_to(b"query", dns).ok()?;
            let (n, from) = sock.recv_from(&mut buf).ok()?;
            (from == dns).then(|| buf[..n].to_vec())
        })
    })
    .join()
    .unwrap();
    assert_eq!(
        echoed.as_deref(),
        Some(&b"query"[..]),
        "UDP 53 echoes from the VIP"
    );

    // Without the key, the address is refused, naming a holder.
    k.cluster.create(&dns_service(
        "intruder",
        "UDP",
        5353,
        json!({"xlb.dev/ip": VIP.to_string()}),
    ));
    let (status, reason, message) =
        wait_until("the intruder is refused", Duration::from_secs(20), || {
            allocated_condition(&k, "intruder").filter(|c| c.0 == "False")
        });
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "AddressInUse")
    );
    assert!(
        message.contains("shop/dns-tcp") && message.contains("shares it only with"),
        "{message}"
    );
    let events = k.cluster.list("events.v1.events.k8s.io", NS);
    assert!(
        events.iter().any(|e| e["regarding"]["name"] == "intruder"
            && e["reason"] == "AddressInUse"
            && e["note"]
                .as_str()
                .unwrap_or_default()
                .contains("shop/dns-tcp")),
        "an Event names the holder: {events:#?}"
    );
    assert_eq!(k.ingress_ip("intruder"), None);

    // A restarted agent (killed, so it leaves its lease to expire) keeps
    // both shares and still refuses the intruder; a third partner that
    // arrives afterwards joins the same address.
    let mut agent = agent;
    agent.sigkill();
    let agent = k.start_agent();
    agent.wait_for_log(
        "leading: handing out LoadBalancer addresses",
        1,
        Duration::from_secs(30),
    );
    k.cluster.create(&dns_service(
        "dns-alt",
        "TCP",
        8080,
        json!({"xlb.dev/allow-shared-ip": "dns"}),
    ));
    // A second port 53 would clash: the partner serves 5353.
    k.cluster.patch(
        "service",
        Some(NS),
        "dns-alt",
        &json!({"spec": {"ports": [{"name": "dns", "port": 5353, "targetPort": 8080, "protocol": "TCP"}]}}),
        false,
    );
    let ip = wait_until("the new partner joins", Duration::from_secs(20), || {
        k.ingress_ip("dns-alt")
    });
    assert_eq!(ip, std::net::IpAddr::V4(VIP));
    for name in ["dns-tcp", "dns-udp"] {
        assert_eq!(
            k.ingress_ip(name),
            Some(std::net::IpAddr::V4(VIP)),
            "{name} kept it"
        );
    }
    assert_eq!(k.ingress_ip("intruder"), None);
    assert_eq!(
        allocated_condition(&k, "intruder").map(|c| c.1),
        Some("AddressInUse".to_string())
    );
}

/// `trafficDistribution: PreferSameNode`: the controller hints each endpoint
/// for its node and zone, and this node (node-1, zone-a) sends new flows to
/// its own Pod while it is ready, else to its zone's (node-3), else to all
/// (a fallback, not a withdrawal as with `externalTrafficPolicy: Local`).
/// `PreferSameZone` prefers the zone's Pods.
#[test]
fn traffic_distribution_keeps_new_flows_on_this_node() {
    let mut k = K8sTopology::new("k8d", 3);
    k.cluster.add_node("node-2", "zone-b");
    k.cluster.add_node("node-3", "zone-a");
    k.create_service(SERVICE, json!({"trafficDistribution": "PreferSameNode"}));
    k.cluster.run_pod(&k.pod(1, true));
    let on = |mut pod: xlb_tests::cluster::Pod, node: &str| {
        pod.node = node.into();
        pod
    };
    let (pod2, pod3) = (on(k.pod(2, true), "node-2"), on(k.pod(3, true), "node-3"));
    k.cluster.run_pod(&pod2);
    k.cluster.run_pod(&pod3);
    let _agent = k.start_agent();
    k.wait_slices_ready(&[1, 2, 3]);
    k.wait_programmed(1);
    let within = Duration::from_secs(20);
    k.wait_answered_by("only this node's Pod", &["b1"], within);

    k.cluster.set_pod_ready(&k.pod(1, false), false);
    k.wait_answered_by("this zone's Pod", &["b3"], within);
    k.cluster.set_pod_ready(&pod3, false);
    k.wait_answered_by("any ready Pod", &["b2"], within);

    k.cluster.set_pod_ready(&k.pod(1, true), true);
    k.cluster.set_pod_ready(&pod3, true);
    patch_service(
        &k,
        json!({"spec": {"trafficDistribution": "PreferSameZone"}}),
    );
    k.wait_answered_by("this zone's Pods", &["b1", "b3"], within);
}

/// `xlb.dev/new-flow-limit`: a client's new connections beyond the burst
/// are dropped in the XDP program (`drop_flow_limit`), another client (its
/// own /32) is not held back, and without the annotation nobody is.
#[test]
fn new_connections_beyond_the_annotations_limit_are_dropped() {
    let (k, _agent) = serving_two_clients("k8f", json!({}), 1);
    assert_eq!(dropped(&k, "drop_flow_limit"), 0);

    // A burst of 3, then one a second: four connections at once do not
    // all get through once the agent has applied the annotation.
    patch_service(
        &k,
        json!({"metadata": {"annotations": {
            "xlb.dev/new-flow-limit": "per-second=1, burst=3, ipv4-prefix=32"}}}),
    );
    wait_until(
        "a fourth connection at once is dropped",
        Duration::from_secs(20),
        || (answered_at_once(&k, 4) < 4).then_some(()),
    );
    assert!(dropped(&k, "drop_flow_limit") > 0, "the drops are counted");
    assert!(
        get_from(&k, OTHER_CLIENT).is_some(),
        "another /32 has its own budget"
    );

    // Without the annotation: five at once all get through.
    patch_service(
        &k,
        json!({"metadata": {"annotations": {"xlb.dev/new-flow-limit": null}}}),
    );
    wait_until(
        "five connections at once all answered",
        Duration::from_secs(20),
        || (answered_at_once(&k, 5) == 5).then_some(()),
    );
}

/// A load-aware Service's Pods on this node are found in the cgroups
/// kubelet makes for them (`kubepods/<class>/pod<UID>`, here by the test
/// as kubelet would), from the UID in the EndpointSlice: their CPU shows in
/// lbctl, and a Pod out of CPU loses weight.
#[test]
fn local_pods_cpu_is_read_from_their_cgroups() {
    let (k, _agent) = serving_two_clients("k8cpu", json!({}), 2);
    let groups: Vec<CpuLimit> = (1..=2)
        .map(|n| {
            let pod = k.cluster.get("pod", Some(NS), &format!("web-{n}")).unwrap();
            let uid = pod["metadata"]["uid"].as_str().unwrap();
            let quota = if n == 1 { 20.0 } else { 100.0 };
            let g = CpuLimit::new(&format!("kubepods/burstable/pod{uid}"), quota);
            g.add(k.t.backend_pid(n));
            g
        })
        .collect();
    patch_service(
        &k,
        json!({"metadata": {"annotations": {"xlb.dev/balance": "load-aware"}}}),
    );
    let rows = || -> Vec<Value> {
        let v = k.t.lbctl_json(&["backends"]);
        v["services"][0]["backends"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    };
    wait_until("both Pods' CPU read", Duration::from_secs(20), || {
        let r = rows();
        (r.len() == 2 && r.iter().all(|b| b["load"]["cpu"].is_f64())).then_some(())
    });
    let _burner = Burner::start_in(&groups[0]);
    let weight = |n: usize| {
        let ip = format!("{}:", xlb_tests::topology::backend_ip(n));
        rows()
            .iter()
            .find(|b| b["address"].as_str().is_some_and(|a| a.starts_with(&ip)))
            .and_then(|b| b["load"]["weight"].as_u64())
    };
    wait_until(
        "the Pod out of CPU loses weight",
        Duration::from_secs(20),
        || (weight(1)? <= 25 && weight(2)? == 100).then_some(()),
    );
}

/// A Service whose annotation went bad keeps its last good state; an agent
/// restarted under it (a rollout) has no last good state, and leaves what
/// the last agent programmed as it is instead of dropping it: the
/// established connection and new ones are still served. Fixing the
/// annotation takes effect as usual.
#[test]
fn an_agent_restarted_under_a_broken_service_keeps_serving_it() {
    let (mut k, mut agent) = serving_two_clients("k8held", json!({}), 1);
    let mut held = keepalive_to(&k.t, vip(), "b1");
    patch_service(
        &k,
        json!({"metadata": {"annotations": {"xlb.dev/new-flow-limit": "fast"}}}),
    );
    agent.wait_for_log("keeping its previous state", 1, Duration::from_secs(20));

    assert!(agent.sigterm_and_wait().success());
    let config = k.agent_config("");
    let restarted = k.t.start_agent(&config);
    restarted.wait_for_log("is left as it is", 1, Duration::from_secs(20));
    assert_eq!(
        held.get().unwrap(),
        "b1",
        "the established connection survives the restart"
    );
    assert_eq!(
        get_from(&k, "10.0.0.2").as_deref(),
        Some("b1"),
        "new connections"
    );
    let row = service_row(&k);
    assert!(
        row["backends"] == 1 && row["new_flow_limit"].is_null(),
        "the service is as the last agent left it: {row}"
    );

    // Fixed: applied as any change (the limit now drops a burst).
    patch_service(
        &k,
        json!({"metadata": {"annotations": {"xlb.dev/new-flow-limit": "per-second=1, burst=1"}}}),
    );
    wait_until(
        "the fixed annotation applies",
        Duration::from_secs(20),
        || (answered_at_once(&k, 3) < 3).then_some(()),
    );
    drop(restarted);
}
