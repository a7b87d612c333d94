//! End to end with Kubernetes as the source: Services, EndpointSlices and a
//! LoadBalancerPool written to the test API server (`xlb_tests::apiserver`;
//! no kube-apiserver can run here) drive real traffic through lb-agent's XDP
//! data plane in the agent tests' topology (`xlb_tests::topology`).
//!
//! The API server runs inside the LB namespace (its thread is started from
//! there), so the agent reaches it on 127.0.0.1; the test writes objects
//! through the server's store, which produces the same watch events as HTTP.

use std::{
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use k8s_openapi::api::core::v1::Service;
use serde_json::{json, Value};
use xlb_tests::{
    apiserver::TestApiServer,
    topology::{backend_ip, in_netns, AgentHandle, Topology, BACKEND_PORT, VIP},
    traffic::{count, keepalive_to, requests_on, wait_until},
};

const NODE: &str = "node-1";
const NS: &str = "shop";

fn vip() -> SocketAddr {
    SocketAddr::from((VIP, 80))
}

/// A test API server whose listening socket lives in the LB namespace.
fn api_server_in_lb(t: &Topology) -> TestApiServer {
    in_netns(&t.lb, TestApiServer::start_blocking)
        .join()
        .expect("start the test API server")
}

/// The cluster before the agent starts: this node, a pool holding just the
/// topology's VIP, and the Service `shop/web` (port 80 → the pods' named
/// port `http`) with no address yet.
fn seed(api: &TestApiServer) {
    api.create_json(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
    }))
    .unwrap();
    api.create_json(json!({
        "apiVersion": "xlb.dev/v1alpha1", "kind": "LoadBalancerPool",
        "metadata": {"name": "edge"},
        "spec": {"addresses": [format!("{VIP}/32")]},
    }))
    .unwrap();
    api.create_json(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": NS},
        "spec": {
            "type": "LoadBalancer",
            "loadBalancerClass": "xlb.dev/xlb",
            "selector": {"app": "web"},
            "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
        },
    }))
    .unwrap();
}

/// An endpoint of backend `n` with its conditions.
fn endpoint(n: usize, ready: bool, serving: bool, terminating: bool) -> Value {
    json!({
        "addresses": [backend_ip(n).to_string()],
        "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
        "nodeName": NODE,
        "targetRef": {"kind": "Pod", "namespace": NS, "name": format!("web-{n}")},
    })
}

fn ready(n: usize) -> Value {
    endpoint(n, true, true, false)
}

/// Creates or replaces the Service's one EndpointSlice.
fn set_slice(api: &TestApiServer, endpoints: Vec<Value>) {
    let slice = json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": "web-x7k2p", "namespace": NS,
            "labels": {
                "kubernetes.io/service-name": "web",
                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": BACKEND_PORT, "protocol": "TCP"}],
        "endpoints": endpoints,
    });
    if api
        .get_json(
            "discovery.k8s.io/v1",
            "EndpointSlice",
            Some(NS),
            "web-x7k2p",
        )
        .is_some()
    {
        api.update_json(slice).unwrap();
    } else {
        api.create_json(slice).unwrap();
    }
}

/// The agent's config: the topology's interfaces and the test cluster.
fn agent_config(t: &Topology, api: &TestApiServer) -> String {
    let kubeconfig = t.dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig).unwrap();
    let ifaces = t.lb_interfaces().join(", ");
    format!(
        "interfaces: [{ifaces}]\n\
         kubernetes:\n  kubeconfig: {}\n  node_name: {NODE}\n  mode: nat\n  lease_duration: 4s\n",
        kubeconfig.display()
    )
}

fn start_agent(t: &mut Topology, api: &TestApiServer) -> AgentHandle {
    let config = agent_config(t, api);
    t.start_agent(&config)
}

/// Backends that answered `n` new connections (from both CPUs).
fn answered_by(t: &Topology, n: usize) -> std::collections::BTreeMap<String, usize> {
    let mut all = requests_on(t, vip(), n / 2, Some(0));
    all.extend(requests_on(t, vip(), n - n / 2, Some(1 % cpus())));
    count(&all)
}

fn cpus() -> usize {
    xlb_tests::topology::allowed_cpus().len().max(1)
}

fn names(m: &std::collections::BTreeMap<String, usize>) -> Vec<&str> {
    m.keys().map(String::as_str).collect()
}

/// Waits until the data plane has the web service (before that, the LB
/// namespace answers the VIP with ICMP unreachable).
fn wait_programmed(t: &Topology) {
    wait_until(
        "the data plane has the VIP",
        Duration::from_secs(10),
        || {
            let v = t.lbctl_json(&["services"]);
            v["services"]
                .as_array()
                .is_some_and(|a| !a.is_empty())
                .then_some(())
        },
    );
}

/// The address the allocator wrote into the Service's status.
fn ingress_ip(api: &TestApiServer) -> Option<IpAddr> {
    let svc: Service = api.get(Some(NS), "web")?;
    lb_agent::k8s::ingress(&svc)
        .first()?
        .ip
        .as_deref()?
        .parse()
        .ok()
}

#[test]
fn services_and_slices_drive_traffic_and_scaling_spares_established_flows() {
    let mut t = Topology::new("k8e", 3);
    let api = api_server_in_lb(&t);
    seed(&api);
    set_slice(&api, vec![ready(1), ready(2)]);
    let _agent = start_agent(&mut t, &api);

    // The elected agent gives the Service the pool's address, and every
    // agent then serves it on the two ready endpoints.
    let ip = wait_until(
        "the Service gets an address",
        Duration::from_secs(20),
        || ingress_ip(&api),
    );
    assert_eq!(ip, IpAddr::V4(VIP));
    wait_programmed(&t);
    wait_until("both endpoints answer", Duration::from_secs(10), || {
        let m = answered_by(&t, 40);
        (names(&m) == ["b1", "b2"]).then_some(())
    });

    // An established connection, kept alive across every change below.
    let mut kept = keepalive_to(&t, vip(), "b1");

    // Scale up: new connections reach the new pod; the old one stays put.
    set_slice(&api, vec![ready(1), ready(2), ready(3)]);
    wait_until("b3 takes new connections", Duration::from_secs(10), || {
        answered_by(&t, 60).contains_key("b3").then_some(())
    });
    assert_eq!(kept.get().unwrap(), "b1", "after scaling up");

    // b1's pod terminates: still serving, so its flow goes on, but it gets
    // no new connections.
    set_slice(
        &api,
        vec![endpoint(1, false, true, true), ready(2), ready(3)],
    );
    wait_until(
        "b1 takes no new connections",
        Duration::from_secs(10),
        || {
            let m = answered_by(&t, 60);
            (names(&m) == ["b2", "b3"]).then_some(())
        },
    );
    assert_eq!(kept.get().unwrap(), "b1", "while b1 terminates");

    // Gone from the slice altogether: established flows are still kept.
    set_slice(&api, vec![ready(2), ready(3)]);
    wait_until("the data plane drops b1", Duration::from_secs(10), || {
        let v = t.lbctl_json(&["backends"]);
        let text = v.to_string();
        (!text.contains(&format!("{}:{BACKEND_PORT}", backend_ip(1)))).then_some(())
    });
    assert_eq!(kept.get().unwrap(), "b1", "after b1 left the slice");
    let m = answered_by(&t, 60);
    assert_eq!(names(&m), ["b2", "b3"]);

    // Deleting the Service removes it from the data plane and frees its
    // address (the pool's status counts it).
    api.delete_json("v1", "Service", Some(NS), "web").unwrap();
    wait_until("the VIP is gone", Duration::from_secs(10), || {
        let v = t.lbctl_json(&["services"]);
        v["services"]
            .as_array()
            .is_some_and(|a| a.is_empty())
            .then_some(())
    });
    wait_until(
        "the pool's address is free again",
        Duration::from_secs(10),
        || {
            let pool = api.get_json("xlb.dev/v1alpha1", "LoadBalancerPool", None, "edge")?;
            (pool["status"]["inUse"] == 0).then_some(())
        },
    );
}

#[test]
fn api_server_outage_and_expired_watches_change_nothing_then_recover() {
    let mut t = Topology::new("k8f", 3);
    let api = api_server_in_lb(&t);
    seed(&api);
    set_slice(&api, vec![ready(1), ready(2)]);
    let mut agent = start_agent(&mut t, &api);
    wait_until(
        "the Service gets an address",
        Duration::from_secs(20),
        || ingress_ip(&api),
    );
    wait_programmed(&t);
    wait_until("both endpoints answer", Duration::from_secs(20), || {
        let m = answered_by(&t, 40);
        (names(&m) == ["b1", "b2"]).then_some(())
    });

    // The API server goes away: the data plane keeps serving as it was, and
    // a change made meanwhile (in the store) is not seen yet.
    api.set_down(true);
    set_slice(&api, vec![ready(3)]);
    agent.wait_for_log("watch failed", 1, Duration::from_secs(20));
    let m = answered_by(&t, 40);
    assert_eq!(names(&m), ["b1", "b2"], "during the outage");
    assert!(agent.is_running());

    // Back: the watchers resume and apply what changed.
    api.set_down(false);
    wait_until(
        "the change made during the outage applies",
        Duration::from_secs(30),
        || {
            let m = answered_by(&t, 40);
            (names(&m) == ["b3"]).then_some(())
        },
    );

    // An API server restart that lost the history: every watch is cut, a
    // change is made that no watch has seen, and the history is compacted
    // past it. The resumed watches get 410 Gone, the agent re-lists, and the
    // change is applied. (Compacting while a watch is open could race with
    // a bookmark that brings the watch up to date, and then no 410 is due.)
    api.set_down(true);
    api.clear_requests();
    set_slice(&api, vec![ready(1), ready(3)]);
    api.compact();
    api.set_down(false);
    wait_until(
        "the change after the 410 applies",
        Duration::from_secs(30),
        || {
            let m = answered_by(&t, 40);
            (names(&m) == ["b1", "b3"]).then_some(())
        },
    );
    let gone = api
        .requests()
        .iter()
        .filter(|r| r.watch_error == Some(410))
        .count();
    assert!(gone > 0, "no watch was answered 410 after compaction");

    // A restart during an outage: the agent adopts the pinned data plane
    // and waits for the cluster; forwarding never stops.
    assert!(agent.sigterm_and_wait().success());
    api.set_down(true);
    let config = agent_config(&t, &api);
    let restarted = t.spawn_agent(&config);
    restarted.wait_for_log("waiting for the first sync", 1, Duration::from_secs(20));
    assert!(
        matches!(restarted.get("/readyz"), Ok((503, _))),
        "ready before it could sync with the cluster"
    );
    let m = answered_by(&t, 40);
    assert_eq!(names(&m), ["b1", "b3"], "restarted agent, API server down");
    api.set_down(false);
    wait_until("the restarted agent syncs", Duration::from_secs(30), || {
        matches!(restarted.get("/readyz"), Ok((200, _))).then_some(())
    });
}
