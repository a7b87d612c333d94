//! End to end, Kubernetes to BGP: with the cluster as the source, a node
//! announces a Service's VIP only while it can serve it, and for
//! `externalTrafficPolicy: Local` only while it has a local endpoint that
//! takes new flows.
//!
//! The agents' single-LB topology (`xlb_tests::topology`) with, in the LB
//! namespace, the test API server (`xlb_tests::apiserver`; no kube-apiserver
//! can run here) and a real `gobgpd` without peers: the agent's paths land
//! in gobgpd's global RIB, which is what the node would send to its routers.
//! Every check reads that RIB with the `gobgp` CLI, polled with a deadline.

use std::{
    collections::BTreeMap,
    fs::File,
    net::{Ipv4Addr, SocketAddr},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use xlb_tests::{
    apiserver::{PatchType, TestApiServer},
    topology::{backend_ip, in_netns, wait_for_port, Topology, BACKEND_PORT, LB_CLIENT_SIDE, VIP},
    traffic::wait_until,
};

const NODE: &str = "node-1";
const OTHER_NODE: &str = "node-2";
const NS: &str = "shop";
const EXCLUDE_LABEL: &str = "node.kubernetes.io/exclude-from-external-load-balancers";
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

/// A LoadBalancer Service of xlb's class with the given policy, its address
/// written into the status (the allocator is off in this test).
fn create_service(api: &TestApiServer, name: &str, policy: &str, vip: Ipv4Addr) {
    api.create_json(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "type": "LoadBalancer",
            "loadBalancerClass": "xlb.dev/xlb",
            "externalTrafficPolicy": policy,
            "selector": {"app": "web"},
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }))
    .unwrap();
    api.patch_json(
        "v1",
        "Service",
        Some(NS),
        name,
        PatchType::Merge,
        &json!({"status": {"loadBalancer": {"ingress": [{"ip": vip.to_string()}]}}}),
        true,
    )
    .unwrap();
}

/// Backend `n`'s endpoint on `node` with its conditions.
fn endpoint(n: usize, node: &str, ready: bool, serving: bool, terminating: bool) -> Value {
    json!({
        "addresses": [backend_ip(n).to_string()],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
        "nodeName": node,
        "targetRef": {"kind": "Pod", "namespace": NS, "name": format!("web-{n}")},
    })
}

fn ready(n: usize, node: &str) -> Value {
    endpoint(n, node, true, true, false)
}

/// Creates or replaces Service `service`'s one EndpointSlice.
fn set_slice(api: &TestApiServer, service: &str, endpoints: Vec<Value>) {
    let name = format!("{service}-abc12");
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": name, "namespace": NS,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": BACKEND_PORT, "protocol": "TCP"}],
        "endpoints": endpoints,
    });
    if api
        .get_json("discovery.k8s.io/v1", "EndpointSlice", Some(NS), &name)
        .is_some()
    {
        api.update_json(slice).unwrap();
    } else {
        api.create_json(slice).unwrap();
    }
}

/// Sets (`Some("")`) or removes (`None`) the exclusion label on this node.
fn set_excluded(api: &TestApiServer, excluded: bool) {
    let value = if excluded { json!("") } else { Value::Null };
    api.patch_json(
        "v1",
        "Node",
        None,
        NODE,
        PatchType::Merge,
        &json!({"metadata": {"labels": {EXCLUDE_LABEL: value}}}),
        false,
    )
    .unwrap();
}

#[test]
fn vips_are_announced_only_while_this_node_can_serve_them() {
    let mut t = Topology::new("k8b", 2);
    let api = in_netns(&t.lb, TestApiServer::start_blocking)
        .join()
        .expect("start the test API server");
    for node in [NODE, OTHER_NODE] {
        api.create_json(json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node, "labels": {"kubernetes.io/hostname": node}},
        }))
        .unwrap();
    }
    create_service(&api, CLUSTER_SVC, "Cluster", CLUSTER_VIP);
    create_service(&api, LOCAL_SVC, "Local", LOCAL_VIP);
    // The same pod, on the other node, behind both Services.
    set_slice(&api, CLUSTER_SVC, vec![ready(1, OTHER_NODE)]);
    set_slice(&api, LOCAL_SVC, vec![ready(1, OTHER_NODE)]);

    start_gobgpd(&mut t);
    let kubeconfig = t.dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let config = format!(
        "interfaces: [{ifaces}]\n\
         kubernetes:\n\
         \x20 kubeconfig: {kubeconfig}\n\
         \x20 node_name: {NODE}\n\
         \x20 mode: nat\n\
         \x20 allocate_addresses: false\n\
         bgp:\n\
         \x20 driver: gobgp\n\
         \x20 next_hop_ipv4: {NEXT_HOP}\n\
         \x20 drain_time: 0s\n\
         \x20 resync_interval: {resync}ms\n\
         \x20 gobgp:\n\
         \x20   address: http://127.0.0.1:{GOBGP_PORT}\n",
        ifaces = t.lb_interfaces().join(", "),
        kubeconfig = kubeconfig.display(),
        resync = RESYNC.as_millis(),
    );
    let _agent = t.start_agent(&config);

    // 1. The Cluster Service is announced: the agent talks to gobgpd. The
    //    Local one is in the data plane (so the agent has seen it) but has
    //    no endpoint here: not announced, and it stays that way.
    wait_announced(&t, "the Cluster VIP is announced", &[CLUSTER_VIP]);
    wait_until(
        "the Local Service is in the data plane",
        CHANGE_TIMEOUT,
        || programmed(&t, LOCAL_VIP).then_some(()),
    );
    stays_announced(&t, "Local VIP without a local endpoint", &[CLUSTER_VIP]);

    // 2. A ready endpoint on this node: the Local VIP is announced, with
    //    this node as next hop.
    set_slice(&api, LOCAL_SVC, vec![ready(1, OTHER_NODE), ready(2, NODE)]);
    wait_announced(
        &t,
        "the Local VIP after a local endpoint became ready",
        &[CLUSTER_VIP, LOCAL_VIP],
    );

    // 3. That endpoint terminates (still serving its flows, taking no new
    //    ones): this node can no longer take new flows for the VIP.
    set_slice(
        &api,
        LOCAL_SVC,
        vec![ready(1, OTHER_NODE), endpoint(2, NODE, false, true, true)],
    );
    wait_announced(
        &t,
        "the Local VIP after its local endpoint started terminating",
        &[CLUSTER_VIP],
    );

    // 4. The Cluster Service loses all its endpoints: withdrawn too.
    set_slice(&api, CLUSTER_SVC, vec![]);
    wait_announced(&t, "the Cluster VIP without endpoints", &[]);

    // 5. Both servable again, then the node is excluded from external load
    //    balancers: nothing is announced; lifting the label brings them back.
    set_slice(&api, CLUSTER_SVC, vec![ready(1, OTHER_NODE)]);
    set_slice(&api, LOCAL_SVC, vec![ready(1, OTHER_NODE), ready(2, NODE)]);
    wait_announced(
        &t,
        "both VIPs once servable again",
        &[CLUSTER_VIP, LOCAL_VIP],
    );
    set_excluded(&api, true);
    wait_announced(&t, "the node labelled as excluded", &[]);
    stays_announced(&t, "the node labelled as excluded", &[]);
    set_excluded(&api, false);
    wait_announced(&t, "the exclusion label removed", &[CLUSTER_VIP, LOCAL_VIP]);
}
