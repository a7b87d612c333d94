//! End to end, Kubernetes to BGP: with the cluster as the source, a node
//! announces a Service's VIP only while it can serve it, and for
//! `externalTrafficPolicy: Local` only while it has a local endpoint that
//! takes new flows.
//!
//! The agents' single-LB topology with the real control plane
//! (`xlb_tests::k8s_topology`: the EndpointSlice controller writes every
//! slice from Pods) and, in the LB namespace, a real `gobgpd` without
//! peers: the agent's paths land in gobgpd's global RIB, which is what the
//! node would send to its routers. Every check reads that RIB with the
//! `gobgp` CLI, polled with a deadline.

use std::{
    collections::BTreeMap,
    fs::File,
    net::{Ipv4Addr, SocketAddr},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use xlb_tests::{
    cluster::Pod,
    k8s_topology::{K8sTopology, NODE, NS},
    topology::{backend_ip, wait_for_port, Topology, BACKEND_PORT, CLIENT_IP, LB_CLIENT_SIDE, VIP},
    traffic::{poll_until, wait_until},
};

const OTHER_NODE: &str = "node-2";
const EXCLUDE_LABEL: &str = "node.kubernetes.io/exclude-from-external-load-balancers";
const ANNOUNCE_ANNOTATION: &str = "xlb.dev/announce";
/// Service `shop/web`, `externalTrafficPolicy: Cluster`.
const CLUSTER_SVC: &str = "web";
const CLUSTER_VIP: Ipv4Addr = VIP;
/// Service `shop/web-local`, `externalTrafficPolicy: Local`.
const LOCAL_SVC: &str = "web-local";
const LOCAL_VIP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 11);
/// gobgpd's API, on 127.0.0.1 in the LB namespace (not the default port,
/// so it stands out from the other BGP tests' daemons in their namespaces).
const GOBGP_PORT: u16 = 50061;
/// The next hop the agent is told to announce.
const NEXT_HOP: Ipv4Addr = LB_CLIENT_SIDE;
/// The agent re-applies its routes this often; a VIP that must stay
/// unannounced is watched for longer than that.
const RESYNC: Duration = Duration::from_secs(1);
const CHANGE_TIMEOUT: Duration = Duration::from_secs(15);

/// Starts gobgpd (AS 65001, no peers) in the LB namespace, logging to the
/// topology's directory and stopped with it; waits until its API listens.
fn start_gobgpd(t: &mut Topology) {
    let conf = t.dir.join("gobgpd.toml");
    std::fs::write(
        &conf,
        format!("[global.config]\n  as = 65001\n  router-id = \"{NEXT_HOP}\"\n"),
    )
    .unwrap();
    let log = File::create(t.dir.join("gobgpd.log")).unwrap();
    let child = Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{}", t.lb.name))
        .arg("gobgpd")
        .arg("-f")
        .arg(&conf)
        .args(["--api-hosts", &format!("127.0.0.1:{GOBGP_PORT}")])
        .args(["--pprof-disable", "-p"])
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start gobgpd (Debian package gobgpd)");
    t.adopt_child(child);
    wait_for_port(&t.lb, SocketAddr::from((Ipv4Addr::LOCALHOST, GOBGP_PORT)));
}

/// gobgpd's global IPv4 RIB: prefix → next hops of its paths.
fn rib(t: &Topology) -> BTreeMap<String, Vec<String>> {
    let port = GOBGP_PORT.to_string();
    let out = t.output_in(
        &t.lb,
        "gobgp",
        &["-p", &port, "global", "rib", "-a", "ipv4", "-j"],
    );
    assert!(
        out.status.success(),
        "gobgp global rib: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "gobgp global rib -j is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    });
    let table = v.as_object().unwrap_or_else(|| panic!("RIB: {v}"));
    table
        .iter()
        .map(|(prefix, paths)| {
            let hops = paths
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|p| p["attrs"].as_array().cloned().unwrap_or_default())
                .filter_map(|a| a["nexthop"].as_str().map(String::from))
                .collect();
            (prefix.clone(), hops)
        })
        .collect()
}

fn host_route(vip: Ipv4Addr) -> String {
    format!("{vip}/32")
}

/// Waits until gobgpd holds exactly `vips` (each with this node's next hop).
fn wait_announced(t: &Topology, what: &str, vips: &[Ipv4Addr]) {
    let want: BTreeMap<String, Vec<String>> = vips
        .iter()
        .map(|&v| (host_route(v), vec![NEXT_HOP.to_string()]))
        .collect();
    let deadline = Instant::now() + CHANGE_TIMEOUT;
    loop {
        let last = rib(t);
        if last == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: gobgpd holds {last:?}, want {want:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Checks over more than one resync interval that gobgpd holds exactly `vips`.
fn stays_announced(t: &Topology, what: &str, vips: &[Ipv4Addr]) {
    let want: Vec<String> = vips.iter().map(|&v| host_route(v)).collect();
    let until = Instant::now() + RESYNC * 2;
    while Instant::now() < until {
        let held: Vec<String> = rib(t).into_keys().collect();
        assert_eq!(held, want, "{what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The data plane (read with lbctl) has a service on `vip`.
fn programmed(t: &Topology, vip: Ipv4Addr) -> bool {
    let v = t.lbctl_json(&["services"]);
    v["services"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|s| s["vip"].as_str() == Some(vip.to_string().as_str()))
}

/// A LoadBalancer Service of xlb's class with the given policy, selecting
/// Pods labelled `<name>: "yes"`, its address written into the status by
/// the test (the allocator is off here).
fn create_service(k: &K8sTopology, name: &str, policy: &str, vip: Ipv4Addr) {
    k.cluster.create(&json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "type": "LoadBalancer",
            "loadBalancerClass": "xlb.dev/xlb",
            "externalTrafficPolicy": policy,
            "selector": {name: "yes"},
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }));
    k.cluster.patch(
        "service",
        Some(NS),
        name,
        &json!({"status": {"loadBalancer": {"ingress": [{"ip": vip.to_string()}]}}}),
        true,
    );
}

/// Backend `n`'s Pod on `node`, in the Services named by `services`.
fn pod(n: usize, node: &str, services: &[&str]) -> Pod {
    let labels: serde_json::Map<String, Value> = services
        .iter()
        .map(|s| (s.to_string(), json!("yes")))
        .collect();
    Pod {
        namespace: NS.into(),
        name: format!("web-{n}"),
        labels: Value::Object(labels),
        node: node.into(),
        ip: backend_ip(n).into(),
        port: BACKEND_PORT,
        ready: true,
    }
}

/// The agent's config: Kubernetes without the allocator, BGP through the
/// test's gobgpd, and `bgp_extra` (lines of the `bgp` mapping).
fn agent_config(k: &mut K8sTopology, bgp_extra: &str) -> String {
    k.agent_config(&format!(
        "  allocate_addresses: false\n\
         bgp:\n\
         \x20 driver: gobgp\n\
         \x20 next_hop_ipv4: {NEXT_HOP}\n\
         \x20 drain_time: 0s\n\
         \x20 resync_interval: {resync}ms\n\
         {bgp_extra}\
         \x20 gobgp:\n\
         \x20   address: http://127.0.0.1:{GOBGP_PORT}\n",
        resync = RESYNC.as_millis(),
    ))
}

/// Sets (`Some("")`) or removes (`None`) the exclusion label on this node.
fn set_excluded(k: &K8sTopology, excluded: bool) {
    let value = if excluded { json!("") } else { Value::Null };
    k.cluster.patch(
        "node",
        None,
        NODE,
        &json!({"metadata": {"labels": {EXCLUDE_LABEL: value}}}),
        false,
    );
}

/// Puts Pod `n` into or out of a Service by its label.
fn set_member(k: &K8sTopology, n: usize, service: &str, member: bool) {
    let value = if member { json!("yes") } else { Value::Null };
    k.cluster.patch(
        "pod",
        Some(NS),
        &format!("web-{n}"),
        &json!({"metadata": {"labels": {service: value}}}),
        false,
    );
}

#[test]
fn vips_are_announced_only_while_this_node_can_serve_them() {
    let mut k = K8sTopology::new("k8b", 2);
    k.cluster.add_node(OTHER_NODE, "zone-b");
    create_service(&k, CLUSTER_SVC, "Cluster", CLUSTER_VIP);
    create_service(&k, LOCAL_SVC, "Local", LOCAL_VIP);
    // The same Pod, on the other node, behind both Services.
    k.cluster
        .run_pod(&pod(1, OTHER_NODE, &[CLUSTER_SVC, LOCAL_SVC]));

    start_gobgpd(&mut k.t);
    let config = agent_config(&mut k, "");
    let mut agent = k.t.start_agent(&config);
    let t = &k.t;

    // 1. The Cluster Service is announced: the agent talks to gobgpd. The
    //    Local one is in the data plane (so the agent has seen it) but has
    //    no endpoint here: not announced, and it stays that way.
    wait_announced(t, "the Cluster VIP is announced", &[CLUSTER_VIP]);
    wait_until(
        "the Local Service is in the data plane",
        CHANGE_TIMEOUT,
        || programmed(t, LOCAL_VIP).then_some(()),
    );
    stays_announced(t, "Local VIP without a local endpoint", &[CLUSTER_VIP]);

    // 2. A ready Pod on this node: the Local VIP is announced, with this
    //    node as next hop.
    let local = pod(2, NODE, &[LOCAL_SVC]);
    k.cluster.run_pod(&local);
    wait_announced(
        t,
        "the Local VIP after a local endpoint became ready",
        &[CLUSTER_VIP, LOCAL_VIP],
    );

    // 3. That Pod terminates (still serving its flows, taking no new ones):
    //    this node can no longer take new flows for the VIP.
    k.cluster.terminate_pod(&local);
    wait_announced(
        t,
        "the Local VIP after its local endpoint started terminating",
        &[CLUSTER_VIP],
    );

    // 4. The Cluster Service loses all its endpoints: withdrawn too.
    set_member(&k, 1, CLUSTER_SVC, false);
    wait_announced(t, "the Cluster VIP without endpoints", &[]);

    // 5. Both servable again, then the node is excluded from external load
    //    balancers: nothing is announced; lifting the label brings them back.
    set_member(&k, 1, CLUSTER_SVC, true);
    k.cluster.remove_pod(&local);
    wait_until("the terminated Pod is gone", CHANGE_TIMEOUT, || {
        k.cluster
            .get("pod", Some(NS), &local.name)
            .is_none()
            .then_some(())
    });
    k.cluster.run_pod(&local);
    wait_announced(
        t,
        "both VIPs once servable again",
        &[CLUSTER_VIP, LOCAL_VIP],
    );
    set_excluded(&k, true);
    wait_announced(t, "the node labelled as excluded", &[]);
    stays_announced(t, "the node labelled as excluded", &[]);
    set_excluded(&k, false);
    wait_announced(t, "the exclusion label removed", &[CLUSTER_VIP, LOCAL_VIP]);

    // 6. `xlb.dev/announce: l2` on a node without L2 mode: the VIP stays in
    //    the data plane but BGP no longer announces it; `bgp` brings it
    //    back, and a value xlb does not know keeps the last good one.
    set_announce(&k, CLUSTER_SVC, "l2");
    wait_announced(t, "the Cluster VIP announced only by L2", &[LOCAL_VIP]);
    assert!(programmed(t, CLUSTER_VIP), "still served");
    set_announce(&k, CLUSTER_SVC, "bgp");
    wait_announced(
        t,
        "the Cluster VIP announced by BGP",
        &[CLUSTER_VIP, LOCAL_VIP],
    );
    set_announce(&k, CLUSTER_SVC, "arp");
    stays_announced(t, "an unknown announce value", &[CLUSTER_VIP, LOCAL_VIP]);

    // 7. A rollout SIGTERMs the agent of a node that stays in service: a
    //    restart, which leaves the routes to the next agent. Once the node
    //    is cordoned, a SIGTERM means leaving: the routes are withdrawn.
    //    (The annotation first gets a good value again: an agent that
    //    starts has no last good state to keep for a bad one.)
    set_announce(&k, CLUSTER_SVC, "bgp");
    let both = [CLUSTER_VIP, LOCAL_VIP];
    let status = agent.sigterm_and_wait();
    assert!(status.success(), "{status}\n{}", agent.log());
    assert!(
        agent.log().contains("restarting, not leaving"),
        "{}",
        agent.log()
    );
    stays_announced(t, "after a rollout's SIGTERM", &both);
    drop(agent);
    let mut agent = k.t.start_agent(&config);
    let t = &k.t;
    wait_announced(t, "the next agent", &both);
    k.cluster.patch(
        "node",
        None,
        NODE,
        &json!({"spec": {"unschedulable": true}}),
        false,
    );
    agent.wait_for_log("this node is being taken out", 1, CHANGE_TIMEOUT);
    let status = agent.sigterm_and_wait();
    assert!(status.success(), "{status}\n{}", agent.log());
    wait_announced(t, "after SIGTERM on a cordoned node", &[]);
}

fn set_announce(k: &K8sTopology, service: &str, how: &str) {
    k.cluster.patch(
        "service",
        Some(NS),
        service,
        &json!({"metadata": {"annotations": {ANNOUNCE_ANNOTATION: how}}}),
        false,
    );
}

/// gobgpd's neighbours: address → AS.
fn neighbors(t: &Topology) -> BTreeMap<String, u64> {
    let port = GOBGP_PORT.to_string();
    let out = t.output_in(&t.lb, "gobgp", &["-p", &port, "neighbor", "-j"]);
    assert!(
        out.status.success(),
        "gobgp neighbor: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| {
            let conf = &n["conf"];
            Some((
                conf["neighbor_address"].as_str()?.to_string(),
                conf["peer_asn"].as_u64()?,
            ))
        })
        .collect()
}

fn wait_neighbors(t: &Topology, what: &str, want: &[(&str, u64)]) {
    let want: BTreeMap<String, u64> = want.iter().map(|(a, n)| (a.to_string(), *n)).collect();
    let mut last = BTreeMap::new();
    let seen = poll_until(CHANGE_TIMEOUT, Duration::from_millis(50), || {
        last = neighbors(t);
        if last == want {
            Ok(())
        } else {
            Err(())
        }
    });
    assert!(
        seen.is_ok(),
        "{what}: gobgpd's neighbours {last:?}, want {want:?}"
    );
}

fn set_rack(k: &K8sTopology, rack: Option<&str>) {
    let value = rack.map_or(Value::Null, |r| json!(r));
    k.cluster.patch(
        "node",
        None,
        NODE,
        &json!({"metadata": {"labels": {"rack": value}}}),
        false,
    );
}

/// BGPPeers give each node the routers its labels select, with the chart's
/// RBAC: a node in rack a peers with rack a's router and the one every node
/// peers with; relabelled to rack b, it drops rack a's session and opens
/// rack b's, without a restart. A BGPPeer that cannot be used (its password
/// Secret is missing, a field is wrong) is left out with a log line naming
/// it and why; the others are untouched, and it joins once it is fixed.
#[test]
fn bgppeers_follow_the_nodes_labels() {
    let mut k = K8sTopology::new("k8p", 1);
    start_gobgpd(&mut k.t);
    let config = agent_config(&mut k, "  peers: [{ address: 10.0.0.1, asn: 65100 }]\n");
    let peer = |name: &str, spec: Value| {
        json!({"apiVersion": "xlb.dev/v1alpha1", "kind": "BGPPeer",
               "metadata": {"name": name}, "spec": spec})
    };
    k.cluster.apply(&peer(
        "rack-a",
        json!({"address": "10.0.1.254", "asn": 65000, "holdTime": "6s",
               "nodeSelector": {"matchLabels": {"rack": "a"}}}),
    ));
    k.cluster.apply(&peer(
        "rack-b",
        json!({"address": "10.0.2.254", "asn": 65000,
               "nodeSelector": {"matchExpressions": [{"key": "rack", "operator": "In", "values": ["b"]}]}}),
    ));
    k.cluster.apply(&peer(
        "edge",
        json!({"address": "10.0.9.1", "asn": 65200,
               "passwordSecret": {"name": "bgp-auth", "key": "edge"}}),
    ));
    k.cluster.apply(&peer(
        "typo",
        json!({"address": "10.0.9.2", "asn": 65200, "holdTime": "1s"}),
    ));
    set_rack(&k, Some("a"));
    let mut agent = k.t.start_agent(&config);
    let t = &k.t;

    // Rack a's router, and the config file's; the edge router waits for its
    // Secret, the typo is refused: each said once, by name.
    wait_neighbors(
        t,
        "a node in rack a",
        &[("10.0.0.1", 65100), ("10.0.1.254", 65000)],
    );
    agent.wait_for_log(
        "BGPPeer not used on this node: password Secret xlb-system/bgp-auth is missing",
        1,
        CHANGE_TIMEOUT,
    );
    agent.wait_for_log("bgppeer=typo", 1, CHANGE_TIMEOUT);
    assert!(
        agent.log().contains("hold_time must be at least 3s"),
        "{}",
        agent.log()
    );

    // Relabelled: rack a's session goes, rack b's comes.
    set_rack(&k, Some("b"));
    wait_neighbors(
        t,
        "the node moved to rack b",
        &[("10.0.0.1", 65100), ("10.0.2.254", 65000)],
    );

    // The Secret appears (read when a BGPPeer changes, or within 30 s):
    // the edge router joins; no label: no rack router.
    k.cluster
        .apply(&json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "bgp-auth", "namespace": "xlb-system"},
        "stringData": {"edge": "s3cret"}}));
    set_rack(&k, None);
    wait_neighbors(
        t,
        "the Secret created, the rack label removed",
        &[("10.0.0.1", 65100), ("10.0.9.1", 65200)],
    );
    let status = agent.sigterm_and_wait();
    assert!(status.success(), "{status}\n{}", agent.log());
}

/// The Events the agent published about its Node with this reason, as
/// `kubectl get events` lists them: their notes.
fn node_events(k: &K8sTopology, reason: &str) -> Vec<String> {
    let out = k.cluster.kubectl_ok(&["get", "events", "-A", "-o", "json"]);
    let v: Value = serde_json::from_str(&out).expect("kubectl get events -o json");
    v["items"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|e| {
            e["reason"] == reason
                && e["involvedObject"]["kind"] == "Node"
                && e["involvedObject"]["name"] == NODE
        })
        .filter_map(|e| e["message"].as_str().map(String::from))
        .collect()
}

/// A node's BGP sessions as `kubectl` shows them: an Event on its Node when
/// a session comes up and when it goes down. The router is a real BIRD in
/// the client's namespace, peering with the node's gobgpd through a
/// BGPPeer.
#[test]
fn bgp_sessions_show_as_events_on_the_node() {
    let mut k = K8sTopology::new("k8s", 1);
    start_gobgpd(&mut k.t);
    let conf = k.t.dir.join("router-bird.conf");
    std::fs::write(
        &conf,
        format!(
            "router id {CLIENT_IP};\nprotocol device {{}}\n\
             protocol bgp node {{\n  local {CLIENT_IP} as 65000;\n  neighbor {NEXT_HOP} as 65001;\n  \
             hold time 3;\n  keepalive time 1;\n  connect delay time 1;\n  connect retry time 1;\n  \
             error wait time 1, 2;\n  ipv4 {{ import all; export none; }};\n}}\n"
        ),
    )
    .unwrap();
    let ctl = k.t.dir.join("router-bird.ctl");
    let (conf_s, ctl_s) = (conf.display().to_string(), ctl.display().to_string());
    let router =
        k.t.spawn_in(&k.t.client, "bird", &["-f", "-c", &conf_s, "-s", &ctl_s]);
    let router_pid = router.id() as i32;
    k.t.adopt_child(router);
    let config = agent_config(&mut k, "");
    k.cluster
        .apply(&json!({"apiVersion": "xlb.dev/v1alpha1", "kind": "BGPPeer",
        "metadata": {"name": "client-router"},
        "spec": {"address": CLIENT_IP.to_string(), "asn": 65000, "holdTime": "3s"}}));
    let mut agent = k.t.start_agent(&config);
    let note = format!("BGP session with {CLIENT_IP} established");
    // gobgpd's first attempt comes 5-10 s after the neighbour is added; the
    // router connects every second.
    wait_until("the session's Event", Duration::from_secs(30), || {
        node_events(&k, "BGPSessionEstablished")
            .contains(&note)
            .then_some(())
    });
    agent.wait_for_log("BGP session established", 1, CHANGE_TIMEOUT);

    // The router dies: its kernel closes the session, the node says so.
    // SAFETY: kill(2) on a child of this process (nsenter exec'd BIRD).
    assert_eq!(unsafe { libc::kill(router_pid, libc::SIGKILL) }, 0);
    let down = format!("BGP session with {CLIENT_IP} went down");
    wait_until("the session's down Event", CHANGE_TIMEOUT, || {
        node_events(&k, "BGPSessionDown")
            .contains(&down)
            .then_some(())
    });
    let status = agent.sigterm_and_wait();
    assert!(status.success(), "{status}\n{}", agent.log());
}

/// gobgpd's global IPv4 RIB: prefix → (communities as ASN:VALUE, then
/// large communities as GLOBAL:LOCAL1:LOCAL2, LOCAL_PREF).
fn rib_attributes(t: &Topology) -> BTreeMap<String, (Vec<String>, Option<u64>)> {
    let port = GOBGP_PORT.to_string();
    let out = t.output_in(
        &t.lb,
        "gobgp",
        &["-p", &port, "global", "rib", "-a", "ipv4", "-j"],
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    v.as_object()
        .into_iter()
        .flatten()
        .map(|(prefix, paths)| {
            let attrs: Vec<Value> = paths
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|p| p["attrs"].as_array().cloned().unwrap_or_default())
                .collect();
            let mut communities: Vec<String> = attrs
                .iter()
                .filter(|a| a["type"] == 8)
                .flat_map(|a| a["communities"].as_array().cloned().unwrap_or_default())
                .filter_map(|c| c.as_u64())
                .map(|c| format!("{}:{}", c >> 16, c & 0xffff))
                .collect();
            communities.extend(
                attrs
                    .iter()
                    .filter(|a| a["type"] == 32)
                    .flat_map(|a| a["value"].as_array().cloned().unwrap_or_default())
                    .map(|c| format!("{}:{}:{}", c["ASN"], c["LocalData1"], c["LocalData2"])),
            );
            let local_pref = attrs
                .iter()
                .find(|a| a["type"] == 5)
                .and_then(|a| a["value"].as_u64());
            (prefix.clone(), (communities, local_pref))
        })
        .collect()
}

/// BGPAdvertisements give the VIPs of the pools they select their
/// communities and LOCAL_PREF, on the nodes they select: the public pool's
/// VIP carries the edge's community while this node is in rack a, the
/// internal pool's never; relabelled, the node announces it plain. One
/// with a bad community is left out with a log line naming it.
#[test]
fn bgpadvertisements_give_a_pools_vips_their_attributes() {
    let mut k = K8sTopology::new("k8v", 1);
    create_service(&k, CLUSTER_SVC, "Cluster", CLUSTER_VIP);
    create_service(&k, LOCAL_SVC, "Cluster", LOCAL_VIP);
    k.cluster.run_pod(&pod(1, NODE, &[CLUSTER_SVC, LOCAL_SVC]));
    let pool = |name: &str, labels: Value, vip: Ipv4Addr| {
        json!({"apiVersion": "xlb.dev/v1alpha1", "kind": "LoadBalancerPool",
               "metadata": {"name": name, "labels": labels},
               "spec": {"addresses": [format!("{vip}/32")]}})
    };
    k.cluster
        .apply(&pool("public", json!({"exposure": "public"}), CLUSTER_VIP));
    k.cluster.apply(&pool("internal", json!({}), LOCAL_VIP));
    let advert = |name: &str, spec: Value| {
        json!({"apiVersion": "xlb.dev/v1alpha1", "kind": "BGPAdvertisement",
               "metadata": {"name": name}, "spec": spec})
    };
    k.cluster.apply(&advert(
        "public-edge",
        json!({"poolSelector": {"matchLabels": {"exposure": "public"}},
               "nodeSelector": {"matchLabels": {"rack": "a"}},
               "communities": ["65000:100"], "largeCommunities": ["65000:100:1"],
               "localPref": 200}),
    ));
    k.cluster
        .apply(&advert("typo", json!({"communities": ["65000:lots"]})));
    set_rack(&k, Some("a"));
    start_gobgpd(&mut k.t);
    let config = agent_config(&mut k, "  communities: [\"65000:1\"]\n");
    let mut agent = k.t.start_agent(&config);
    let t = &k.t;
    let public = host_route(CLUSTER_VIP);
    let internal = host_route(LOCAL_VIP);
    let attrs = |want_public: (&[&str], Option<u64>)| {
        let mut last = BTreeMap::new();
        let ok = poll_until(CHANGE_TIMEOUT, Duration::from_millis(50), || {
            last = rib_attributes(t);
            let is = |prefix: &str, c: &[&str], lp: Option<u64>| {
                last.get(prefix)
                    .is_some_and(|(have, l)| have == c && *l == lp)
            };
            if is(&public, want_public.0, want_public.1) && is(&internal, &["65000:1"], None) {
                Ok(())
            } else {
                Err(())
            }
        });
        assert!(
            ok.is_ok(),
            "want {public} with {want_public:?}; RIB {last:?}"
        );
    };
    attrs((&["65000:1", "65000:100", "65000:100:1"], Some(200)));
    agent.wait_for_log("bgpadvertisement=typo", 1, CHANGE_TIMEOUT);
    assert!(agent.log().contains("65000:lots"), "{}", agent.log());

    // Another rack: the advertisement no longer selects this node.
    set_rack(&k, Some("b"));
    attrs((&["65000:1"], None));
    let status = agent.sigterm_and_wait();
    assert!(status.success(), "{status}\n{}", agent.log());
}

/// Waits until gobgpd's RIB holds exactly `want`: prefix → communities.
fn wait_rib_communities(t: &Topology, what: &str, want: &[(&str, &[&str])]) {
    let want: BTreeMap<String, Vec<String>> = want
        .iter()
        .map(|(p, c)| (p.to_string(), c.iter().map(|s| s.to_string()).collect()))
        .collect();
    let mut last = BTreeMap::new();
    let seen = poll_until(CHANGE_TIMEOUT, Duration::from_millis(50), || {
        last = rib_attributes(t)
            .into_iter()
            .map(|(p, (c, _))| (p, c))
            .collect();
        if last == want {
            Ok(())
        } else {
            Err(())
        }
    });
    assert!(seen.is_ok(), "{what}: RIB {last:?}, want {want:?}");
}

/// A BGPAdvertisement's aggregationLength announces its pool's VIPs as one
/// covering prefix with all their attributes; a Service with
/// `externalTrafficPolicy: Local` (only nodes with its endpoints serve it)
/// keeps its host route, which the routers prefer. A length that would
/// announce addresses outside the pool is refused with a log line naming
/// it, and the VIPs go back to host routes; a Service turned Cluster joins
/// the covering prefix.
#[test]
fn an_aggregated_pool_is_one_prefix_and_local_services_stay_host_routes() {
    let mut k = K8sTopology::new("k8g", 1);
    create_service(&k, CLUSTER_SVC, "Cluster", CLUSTER_VIP);
    create_service(&k, LOCAL_SVC, "Local", LOCAL_VIP);
    k.cluster.run_pod(&pod(1, NODE, &[CLUSTER_SVC, LOCAL_SVC]));
    k.cluster.apply(
        &json!({"apiVersion": "xlb.dev/v1alpha1", "kind": "LoadBalancerPool",
        "metadata": {"name": "agg", "labels": {"announce": "aggregated"}},
        "spec": {"addresses": ["192.0.2.0/28"]}}),
    );
    let advert = |len: u8| {
        json!({"apiVersion": "xlb.dev/v1alpha1", "kind": "BGPAdvertisement",
               "metadata": {"name": "agg"},
               "spec": {"poolSelector": {"matchLabels": {"announce": "aggregated"}},
                        "aggregationLength": len, "communities": ["65000:28"]}})
    };
    k.cluster.apply(&advert(28));
    start_gobgpd(&mut k.t);
    let config = agent_config(&mut k, "  communities: [\"65000:1\"]\n");
    let mut agent = k.t.start_agent(&config);
    let t = &k.t;
    let both: &[&str] = &["65000:1", "65000:28"];
    wait_rib_communities(
        t,
        "the pool aggregated, the Local Service's VIP a host route",
        &[("192.0.2.0/28", both), ("192.0.2.11/32", both)],
    );

    // A /27 would take in 192.0.2.16-31, outside the pool: refused.
    k.cluster.apply(&advert(27));
    wait_rib_communities(
        t,
        "the advertisement refused",
        &[
            ("192.0.2.10/32", &["65000:1"]),
            ("192.0.2.11/32", &["65000:1"]),
        ],
    );
    agent.wait_for_log("bgpadvertisement=agg", 1, CHANGE_TIMEOUT);
    assert!(
        agent
            .log()
            .contains("aggregationLength 27 would announce addresses outside the pool range 192.0.2.0-192.0.2.15"),
        "{}",
        agent.log()
    );

    // Fixed, and the Local Service turned Cluster: one prefix for both.
    k.cluster.apply(&advert(28));
    k.cluster.patch(
        "service",
        Some(NS),
        LOCAL_SVC,
        &json!({"spec": {"externalTrafficPolicy": "Cluster"}}),
        false,
    );
    wait_rib_communities(t, "both Services Cluster", &[("192.0.2.0/28", both)]);
    let status = agent.sigterm_and_wait();
    assert!(status.success(), "{status}\n{}", agent.log());
}

/// What gobgpd holds of the agent's peer limits: its export policy, prefix
/// sets and neighbor sets, as the `gobgp` CLI prints them.
fn gobgp_limits(t: &Topology) -> String {
    let port = GOBGP_PORT.to_string();
    ["policy", "prefix", "neighbor"]
        .iter()
        .map(|what| {
            let args: Vec<&str> = if *what == "policy" {
                vec!["-p", &port, "global", "policy", "export"]
            } else {
                vec!["-p", &port, "policy", what]
            };
            let out = t.output_in(&t.lb, "gobgp", &args);
            String::from_utf8_lossy(&out.stdout).into_owned()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Reads `read` until its text has every one of `want` and none of `not`;
/// fails with `what` and the last text read.
fn wait_text(what: &str, mut read: impl FnMut() -> String, want: &[&str], not: &[&str]) {
    let mut last = String::new();
    let seen = poll_until(CHANGE_TIMEOUT, Duration::from_millis(100), || {
        last = read();
        if want.iter().all(|w| last.contains(w)) && !not.iter().any(|n| last.contains(n)) {
            Ok(())
        } else {
            Err(())
        }
    });
    assert!(
        seen.is_ok(),
        "{what}: want {want:?} and none of {not:?} in\n{last}"
    );
}

/// A BGPAdvertisement's peerSelector picks BGPPeers by their labels, among
/// those that peer with this node: the pool's prefix goes into gobgpd's
/// export policy with the selected router as the only neighbor allowed.
/// Relabelled so that it selects none, the pool goes to no peer (said in
/// the log); the advertisement deleted, nothing of the agent's stays in
/// gobgpd's policy.
#[test]
fn a_peer_selector_keeps_a_pool_to_the_bgppeers_it_selects() {
    let mut k = K8sTopology::new("k8l", 1);
    create_service(&k, CLUSTER_SVC, "Cluster", CLUSTER_VIP);
    k.cluster.run_pod(&pod(1, NODE, &[CLUSTER_SVC]));
    let bgp_peer = |name: &str, role: &str, address: &str| {
        json!({"apiVersion": "xlb.dev/v1alpha1", "kind": "BGPPeer",
               "metadata": {"name": name, "labels": {"role": role}},
               "spec": {"address": address, "asn": 65000}})
    };
    k.cluster.apply(&bgp_peer("tor", "tor", "10.0.1.254"));
    k.cluster.apply(&bgp_peer("edge", "edge", "10.0.9.1"));
    k.cluster.apply(
        &json!({"apiVersion": "xlb.dev/v1alpha1", "kind": "LoadBalancerPool",
        "metadata": {"name": "internal", "labels": {"exposure": "internal"}},
        "spec": {"addresses": ["192.0.2.0/28"]}}),
    );
    let advert = json!({"apiVersion": "xlb.dev/v1alpha1", "kind": "BGPAdvertisement",
        "metadata": {"name": "internal-to-tor"},
        "spec": {"poolSelector": {"matchLabels": {"exposure": "internal"}},
                 "peerSelector": {"matchLabels": {"role": "tor"}}}});
    k.cluster.apply(&advert);
    start_gobgpd(&mut k.t);
    let config = agent_config(&mut k, "  asn: 65001\n");
    let mut agent = k.t.start_agent(&config);
    let t = &k.t;
    wait_announced(t, "the VIP, limited", &[CLUSTER_VIP]);
    let limits = || gobgp_limits(t);
    wait_text(
        "the pool limited to the top of rack router",
        limits,
        &["xlb-peer-limits", "192.0.2.0/28", "10.0.1.254/32"],
        &["10.0.9.1"],
    );

    // The router relabelled: the advertisement selects no peer.
    k.cluster.apply(&bgp_peer("tor", "spine", "10.0.1.254"));
    wait_text(
        "the pool limited to no peer",
        limits,
        &["192.0.2.0/28"],
        &["10.0.1.254/32"],
    );
    agent.wait_for_log(
        "BGPAdvertisement's peerSelector selects no BGPPeer of this node",
        1,
        CHANGE_TIMEOUT,
    );

    // The advertisement deleted: no limits left in gobgpd.
    k.cluster
        .kubectl_ok(&["delete", "bgpadvertisement", "internal-to-tor"]);
    wait_text(
        "no limits",
        limits,
        &[],
        &["xlb-peer-limits", "192.0.2.0/28"],
    );
    stays_announced(t, "the VIP, no longer limited", &[CLUSTER_VIP]);
    let status = agent.sigterm_and_wait();
    assert!(status.success(), "{status}\n{}", agent.log());
}

/// Starts BIRD in the LB namespace with the static protocols of the
/// agent's routes files and an include of its sessions file (both created
/// empty first, as the chart's BIRD sidecar does); returns the agent's
/// `bgp` lines for it. Waits until BIRD answers on its socket.
fn start_bird(t: &mut Topology) -> String {
    let dir = t.dir.join("bird");
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["xlb-vips4", "xlb-vips6", "bird-peers"] {
        std::fs::write(dir.join(f), "").unwrap();
    }
    let conf = dir.join("bird.conf");
    std::fs::write(
        &conf,
        format!(
            "router id {NEXT_HOP};\nprotocol device {{}}\n\
             protocol static xlb_vips4 {{\n  ipv4;\n  include \"{d}/xlb-vips4\";\n}}\n\
             protocol static xlb_vips6 {{\n  ipv6;\n  include \"{d}/xlb-vips6\";\n}}\n\
             include \"{d}/bird-peers\";\n",
            d = dir.display()
        ),
    )
    .unwrap();
    let socket = dir.join("bird.ctl");
    let log = File::create(t.dir.join("bird.log")).unwrap();
    let child = Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{}", t.lb.name))
        .args(["bird", "-f", "-c"])
        .arg(&conf)
        .arg("-s")
        .arg(&socket)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("start bird (Debian package bird2)");
    t.adopt_child(child);
    let sock = socket.to_str().unwrap().to_string();
    poll_until(CHANGE_TIMEOUT, Duration::from_millis(50), || {
        let out = t.output_in(&t.lb, "birdc", &["-s", &sock, "show", "status"]);
        out.status.success().then_some(()).ok_or(())
    })
    .expect("BIRD answers on its socket");
    format!(
        "  asn: 65001\n  bird:\n    routes_file: {d}/xlb-vips\n    peers_file: {d}/bird-peers\n    socket: {sock}\n",
        d = dir.display()
    )
}

/// The agent's config for BIRD: as [`agent_config`] with the bird driver.
fn bird_agent_config(k: &mut K8sTopology, bird: &str) -> String {
    k.agent_config(&format!(
        "  allocate_addresses: false\n\
         bgp:\n\
         \x20 driver: bird\n\
         \x20 next_hop_ipv4: {NEXT_HOP}\n\
         \x20 drain_time: 0s\n\
         \x20 resync_interval: {resync}ms\n\
         {bird}",
        resync = RESYNC.as_millis(),
    ))
}

/// BGPPeers with the BIRD driver: the sessions file the agent writes has
/// the router of the node's rack, with the BFD timers and the password
/// from its Secret, and BIRD runs it (`birdc show protocols all`);
/// relabelled, the node's session moves to the other rack's router.
#[test]
fn bgppeers_become_birds_sessions_with_bfd_and_passwords() {
    let mut k = K8sTopology::new("k8b", 1);
    let bird = start_bird(&mut k.t);
    let config = bird_agent_config(&mut k, &bird);
    k.cluster
        .apply(&json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "bgp-auth", "namespace": "xlb-system"},
        "stringData": {"rack-a": "s3cret"}}));
    let peer = |name: &str, spec: Value| {
        json!({"apiVersion": "xlb.dev/v1alpha1", "kind": "BGPPeer",
               "metadata": {"name": name}, "spec": spec})
    };
    k.cluster.apply(&peer(
        "rack-a",
        json!({"address": "10.0.1.254", "asn": 65000,
               "passwordSecret": {"name": "bgp-auth", "key": "rack-a"},
               "bfd": {"minRx": "200ms", "minTx": "200ms", "multiplier": 4},
               "nodeSelector": {"matchLabels": {"rack": "a"}}}),
    ));
    k.cluster.apply(&peer(
        "rack-b",
        json!({"address": "10.0.2.254", "asn": 65000,
               "nodeSelector": {"matchLabels": {"rack": "b"}}}),
    ));
    set_rack(&k, Some("a"));
    let mut agent = k.t.start_agent(&config);
    let t = &k.t;
    let sessions_file = t.dir.join("bird/bird-peers");
    let sock = t.dir.join("bird/bird.ctl");
    let protocols = || {
        let out = t.output_in(
            &t.lb,
            "birdc",
            &["-s", sock.to_str().unwrap(), "show", "protocols", "all"],
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // The sessions file, then what BIRD runs.
    let written_and_running = || {
        format!(
            "{}\n{}",
            std::fs::read_to_string(&sessions_file).unwrap_or_default(),
            protocols()
        )
    };
    let wait =
        |what: &str, want: &[&str], not: &[&str]| wait_text(what, written_and_running, want, not);
    wait(
        "rack a's router",
        &[
            "neighbor 10.0.1.254 as 65000;",
            "password \"s3cret\";",
            "bfd { min rx interval 200 ms; min tx interval 200 ms; multiplier 4; };",
            "protocol bfd xlb_bfd",
            "Neighbor address: 10.0.1.254",
        ],
        &["10.0.2.254"],
    );
    set_rack(&k, Some("b"));
    wait(
        "moved to rack b",
        &[
            "neighbor 10.0.2.254 as 65000;",
            "Neighbor address: 10.0.2.254",
        ],
        &["10.0.1.254", "password", "bfd"],
    );
    let status = agent.sigterm_and_wait();
    assert!(status.success(), "{status}\n{}", agent.log());
}

/// `vtysh -c COMMAND` against the FRR in `dir`.
fn vtysh(dir: &std::path::Path, command: &str) -> String {
    let out = Command::new("vtysh")
        .arg("--vty_socket")
        .arg(dir)
        .args(["-c", command])
        .output()
        .expect("run vtysh (Debian package frr)");
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// BGPPeers with the FRR driver: bgpd gets the rack's router as a
/// neighbour of the agent's, with the Secret's password; relabelled, the
/// neighbour is replaced by the other rack's.
#[test]
fn bgppeers_become_frr_neighbours_with_passwords() {
    use xlb_tests::bgp_lab::{frr_daemon, frr_daemon_args};
    let mut k = K8sTopology::new("k8f", 1);
    let dir = k.t.dir.join("frr");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("frr.conf"),
        format!("frr defaults traditional\nrouter bgp 65001\n bgp router-id {NEXT_HOP}\nexit\n"),
    )
    .unwrap();
    std::fs::write(dir.join("vtysh.conf"), "service integrated-vtysh-config\n").unwrap();
    let status = Command::new("chown")
        .args(["-R", "frr:frr"])
        .arg(&dir)
        .status()
        .unwrap();
    assert!(status.success());
    for daemon in ["zebra", "bgpd"] {
        let log = File::create(k.t.dir.join(format!("{daemon}.log"))).unwrap();
        let child = Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", k.t.lb.name))
            .arg(frr_daemon(daemon))
            .args(frr_daemon_args(&dir, daemon))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("start FRR (Debian package frr)");
        k.t.adopt_child(child);
        if daemon == "zebra" {
            let sock = dir.join("zserv.api");
            poll_until(CHANGE_TIMEOUT, Duration::from_millis(50), || {
                sock.exists().then_some(()).ok_or(())
            })
            .expect("zebra's socket");
        }
    }
    poll_until(CHANGE_TIMEOUT, Duration::from_millis(100), || {
        vtysh(&dir, "show running-config")
            .contains("router bgp 65001")
            .then_some(())
            .ok_or(())
    })
    .expect("bgpd answering vtysh");
    let config = k.agent_config(&format!(
        "  allocate_addresses: false\n\
         bgp:\n\
         \x20 driver: frr\n\
         \x20 asn: 65001\n\
         \x20 next_hop_ipv4: {NEXT_HOP}\n\
         \x20 drain_time: 0s\n\
         \x20 resync_interval: {resync}ms\n\
         \x20 frr:\n\
         \x20   socket_dir: {d}\n\
         \x20   config_dir: {d}\n",
        resync = RESYNC.as_millis(),
        d = dir.display()
    ));
    k.cluster
        .apply(&json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "bgp-auth", "namespace": "xlb-system"},
        "stringData": {"rack-a": "s3cret"}}));
    let peer = |name: &str, spec: Value| {
        json!({"apiVersion": "xlb.dev/v1alpha1", "kind": "BGPPeer",
               "metadata": {"name": name}, "spec": spec})
    };
    k.cluster.apply(&peer(
        "rack-a",
        json!({"address": "10.0.1.254", "asn": 65000,
               "passwordSecret": {"name": "bgp-auth", "key": "rack-a"},
               "nodeSelector": {"matchLabels": {"rack": "a"}}}),
    ));
    k.cluster.apply(&peer(
        "rack-b",
        json!({"address": "10.0.2.254", "asn": 65000,
               "nodeSelector": {"matchLabels": {"rack": "b"}}}),
    ));
    set_rack(&k, Some("a"));
    let mut agent = k.t.start_agent(&config);
    let wait = |what: &str, want: &[&str], not: &[&str]| {
        wait_text(what, || vtysh(&dir, "show running-config"), want, not)
    };
    wait(
        "rack a's router",
        &[
            "neighbor 10.0.1.254 remote-as 65000",
            "neighbor 10.0.1.254 password s3cret",
            "neighbor 10.0.1.254 description xlb:",
        ],
        &["10.0.2.254"],
    );
    set_rack(&k, Some("b"));
    wait(
        "moved to rack b",
        &["neighbor 10.0.2.254 remote-as 65000"],
        &["10.0.1.254", "s3cret"],
    );
    let status = agent.sigterm_and_wait();
    assert!(status.success(), "{status}\n{}", agent.log());
}
