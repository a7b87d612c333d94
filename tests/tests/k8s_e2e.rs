//! End to end with Kubernetes as the source, on the real control plane
//! (`xlb_tests::cluster`: etcd, kube-apiserver, the EndpointSlice
//! controller): a Service and its Pods drive real traffic through
//! lb-agent's XDP data plane in the agent tests' topology. The agent runs
//! as the chart's ServiceAccount, so anything it does that the chart's RBAC
//! does not allow fails here. Every EndpointSlice is the controller's.

use std::{
    net::{IpAddr, SocketAddr},
    time::{Duration, Instant},
};

use serde_json::json;
use xlb_tests::{
    k8s_topology::{K8sTopology, NS, SERVICE},
    topology::{backend_ip, BACKEND_PORT, VIP},
    traffic::{keepalive_to, wait_until},
};

fn vip() -> SocketAddr {
    SocketAddr::from((VIP, 80))
}

/// The goal of the real-control-plane issue: once the objects that carry a
/// change are in the API, it forwards within this.
const CHANGE_DEADLINE: Duration = Duration::from_secs(2);

#[test]
fn services_and_pods_drive_traffic_and_scaling_spares_established_flows() {
    let mut k = K8sTopology::new("k8e", 3);
    k.create_service(SERVICE, json!({}));
    k.cluster.run_pod(&k.pod(1, true));
    k.cluster.run_pod(&k.pod(2, true));
    let _agent = k.start_agent();

    // The elected agent gives the Service the pool's address, and serves
    // it on the two ready Pods.
    let ip = wait_until(
        "the Service gets an address",
        Duration::from_secs(20),
        || k.ingress_ip(SERVICE),
    );
    assert_eq!(ip, IpAddr::V4(VIP));
    k.wait_programmed(1);
    k.wait_answered_by("both Pods answer", &["b1", "b2"], Duration::from_secs(20));

    // An established connection, kept alive across every change below.
    let mut kept = keepalive_to(&k.t, vip(), "b1");

    // Scale up: new connections reach the new Pod; the old one stays put.
    k.cluster.run_pod(&k.pod(3, true));
    k.wait_answered_by(
        "b3 takes new connections",
        &["b1", "b2", "b3"],
        Duration::from_secs(20),
    );
    assert_eq!(kept.get().unwrap(), "b1", "after scaling up");

    // A Pod turning not ready gets no new connections, and comes back.
    k.cluster.set_pod_ready(&k.pod(2, false), false);
    k.wait_answered_by(
        "not-ready b2 is skipped",
        &["b1", "b3"],
        Duration::from_secs(20),
    );
    k.cluster.set_pod_ready(&k.pod(2, true), true);
    k.wait_answered_by(
        "ready b2 is back",
        &["b1", "b2", "b3"],
        Duration::from_secs(20),
    );

    // b1's Pod terminates: the controller marks it serving, not ready. Its
    // flow goes on, but it gets no new connections.
    k.cluster.terminate_pod(&k.pod(1, true));
    wait_until(
        "the slice shows b1 terminating",
        Duration::from_secs(30),
        || {
            k.cluster
                .slices(NS, SERVICE)
                .iter()
                .flat_map(|s| s["endpoints"].as_array().cloned().unwrap_or_default())
                .find(|e| e["addresses"][0] == backend_ip(1).to_string())
                .filter(|e| {
                    e["conditions"] == json!({"ready": false, "serving": true, "terminating": true})
                })
        },
    );
    k.wait_answered_by(
        "b1 takes no new connections",
        &["b2", "b3"],
        Duration::from_secs(20),
    );
    assert_eq!(kept.get().unwrap(), "b1", "while b1 terminates");

    // Gone from the slices altogether: established flows are still kept.
    k.cluster.remove_pod(&k.pod(1, true));
    wait_until("the data plane drops b1", Duration::from_secs(20), || {
        let text = k.t.lbctl_json(&["backends"]).to_string();
        (!text.contains(&format!("{}:{BACKEND_PORT}", backend_ip(1)))).then_some(())
    });
    assert_eq!(kept.get().unwrap(), "b1", "after b1 left the slice");
    k.wait_answered_by("b2 and b3 answer", &["b2", "b3"], Duration::from_secs(5));

    // Deleting the Service removes it from the data plane and frees its
    // address (the pool's status counts it).
    k.cluster.delete("service", Some(NS), SERVICE);
    k.wait_programmed(0);
    wait_until(
        "the pool's address is free again",
        Duration::from_secs(20),
        || {
            let pool = k.cluster.get("loadbalancerpool", None, "edge")?;
            (pool["status"]["inUse"] == 0).then_some(())
        },
    );
}

/// Polls the controller's slices until backend `n` is listed ready;
/// returns when that was first seen.
fn wait_slice_has(k: &K8sTopology, n: usize) -> Instant {
    let ip = backend_ip(n).to_string();
    wait_until(
        &format!("the controller lists {ip} ready"),
        Duration::from_secs(90),
        || {
            k.cluster
                .ready_addresses(NS, SERVICE)
                .contains(&ip)
                .then(Instant::now)
        },
    )
}

/// Polls new connections until backend `bN` answers one; returns when.
fn wait_forwarded_to(k: &K8sTopology, n: usize, timeout: Duration) -> Instant {
    let name = format!("b{n}");
    wait_until(&format!("{name} answers"), timeout, || {
        k.answered_by(10).contains_key(&name).then(Instant::now)
    })
}

#[test]
fn api_server_restarts_change_nothing_then_changes_apply_within_two_seconds() {
    let mut k = K8sTopology::new("k8f", 3);
    k.create_service(SERVICE, json!({}));
    k.cluster.run_pod(&k.pod(1, true));
    let mut agent = k.start_agent();
    wait_until(
        "the Service gets an address",
        Duration::from_secs(20),
        || k.ingress_ip(SERVICE),
    );
    k.wait_answered_by("b1 answers", &["b1"], Duration::from_secs(20));

    // The API server goes away for long enough that a growing watch backoff
    // would reach several seconds: the data plane keeps serving as it was,
    // and the agent says so once, not on every retry.
    k.cluster.stop_apiserver();
    agent.wait_for_log("lost the Kubernetes API", 1, Duration::from_secs(20));
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(12) {
        k.wait_answered_by(
            "b1 answers during the outage",
            &["b1"],
            Duration::from_secs(5),
        );
    }
    assert!(agent.is_running());
    let log = agent.log();
    assert_eq!(log.matches("lost the Kubernetes API").count(), 1, "{log}");
    assert!(
        !log.contains("ERROR"),
        "errors logged during an outage:\n{log}"
    );

    // Back, with the history compacted past what the agent saw (a restore
    // or a long outage): resumed watches get 410 Gone and re-list. A change
    // made right after forwards within the deadline of its slice appearing
    // (the controller's own recovery is not the agent's to count).
    let revision = k
        .cluster
        .etcdctl(&["endpoint", "status", "--write-out=json"]);
    let status: serde_json::Value = serde_json::from_slice(&revision.stdout).unwrap();
    let rev = status[0]["Status"]["header"]["revision"].as_u64().unwrap();
    assert!(k
        .cluster
        .etcdctl(&["compact", &rev.to_string()])
        .status
        .success());
    k.cluster.start_apiserver();
    // The whole control plane restarts, as in an upgrade: the controller
    // would otherwise take minutes to retry (its own backoff, not xlb's).
    k.cluster.restart_controllers();
    k.cluster.run_pod(&k.pod(2, true));
    let in_api = wait_slice_has(&k, 2);
    let forwarded = wait_forwarded_to(&k, 2, Duration::from_secs(30));
    let took = forwarded.saturating_duration_since(in_api);
    println!("after the restart: forwarded {took:?} after the slice was in the API");
    assert!(
        took <= CHANGE_DEADLINE,
        "forwarded {took:?} after the slice was in the API; log:\n{}",
        agent.log()
    );
    agent.wait_for_log("Kubernetes API is back", 1, Duration::from_secs(10));
    // The resumed watches met the compaction: a real 410, then a re-list.
    agent.wait_for_log(
        "watch history expired (410 Gone)",
        1,
        Duration::from_secs(10),
    );

    // A restart during an outage: the agent adopts the pinned data plane
    // and waits for the cluster; forwarding never stops, and it is not
    // ready until it has synced.
    let config = k.agent_config("");
    assert!(agent.sigterm_and_wait().success());
    k.cluster.stop_apiserver();
    let restarted = k.t.spawn_agent(&config);
    restarted.wait_for_log("waiting for the first sync", 1, Duration::from_secs(20));
    assert!(
        matches!(restarted.get("/readyz"), Ok((503, _))),
        "ready before it could sync with the cluster"
    );
    k.wait_answered_by(
        "restarted agent, API server down",
        &["b1", "b2"],
        Duration::from_secs(5),
    );
    k.cluster.start_apiserver();
    k.cluster.restart_controllers();
    wait_until("the restarted agent syncs", Duration::from_secs(30), || {
        matches!(restarted.get("/readyz"), Ok((200, _))).then_some(())
    });
    k.cluster.set_pod_ready(&k.pod(1, false), false);
    wait_until("b1 leaves the slices", Duration::from_secs(90), || {
        (k.cluster.ready_addresses(NS, SERVICE) == [backend_ip(2).to_string()]).then_some(())
    });
    k.wait_answered_by(
        "the restarted agent applies changes",
        &["b2"],
        Duration::from_secs(5),
    );
}
