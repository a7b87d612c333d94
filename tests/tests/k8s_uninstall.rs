//! `helm uninstall` on the real control plane: the chart installed and
//! uninstalled by Helm itself, kube-controller-manager's garbage collector
//! deleting the agent's Pod after its DaemonSet. No kubelet runs, so the
//! test does the kubelet's part: a Pod owned by the chart's DaemonSet
//! (as the DaemonSet controller makes it), bound to this node, and a
//! SIGTERM to the agent once the Pod is being deleted. The agent runs in
//! the agents' topology as the chart's ServiceAccount, with `POD_NAME` and
//! `POD_NAMESPACE` as the chart sets them.
//!
//! A SIGTERM while the DaemonSet exists (a rollout, a drain) keeps XDP and
//! the pins; one after `helm uninstall` detaches XDP and removes them.

use std::time::{Duration, Instant};

use serde_json::json;
use xlb_tests::{
    cluster::{Cluster, AGENT_NAMESPACE},
    k8s_topology::{K8sTopology, NODE, NS, SERVICE},
    topology::{AgentHandle, Topology, VIP},
    traffic::wait_until,
};

const POD: &str = "xlb-7xk2p";

/// How XDP sits on `iface` in the LB namespace (`xdp`, `xdpgeneric`, None).
fn xdp_on(t: &Topology, iface: &str) -> Option<String> {
    let out = t.output_in(&t.lb, "ip", &["link", "show", "dev", iface]);
    assert!(out.status.success(), "ip link show {iface}");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .find(|w| w.starts_with("xdp"))
        .map(str::to_string)
}

/// The topology with the chart installed by Helm (instead of the identity
/// objects alone), the garbage collector running, a Service on one Pod,
/// and the agent's Pod owned by the chart's DaemonSet.
fn installed(prefix: &str) -> K8sTopology {
    let t = Topology::new(prefix, 1);
    let mut cluster = Cluster::start_with_controllers(prefix, &["garbage-collector-controller"]);
    cluster.reach_from(&t.lb);
    cluster.helm_install(&[]);
    cluster.add_node(NODE, "zone-a");
    cluster.create_namespace(NS);
    cluster.create(&json!({
        "apiVersion": "xlb.dev/v1alpha1", "kind": "LoadBalancerPool",
        "metadata": {"name": "edge"},
        "spec": {"addresses": [format!("{VIP}/32")]},
    }));
    let ds = cluster
        .get("daemonset", Some(AGENT_NAMESPACE), "xlb")
        .expect("helm created DaemonSet xlb");
    // As the DaemonSet controller makes it: the template's labels, the
    // DaemonSet as controlling owner, bound to the node.
    cluster.create(&json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": POD, "namespace": AGENT_NAMESPACE,
            "labels": ds["spec"]["template"]["metadata"]["labels"],
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "DaemonSet", "name": "xlb",
                "uid": ds["metadata"]["uid"], "controller": true, "blockOwnerDeletion": true,
            }],
        },
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": "agent", "image": "localhost/xlb-agent:test"}],
        },
    }));
    let k = K8sTopology { t, cluster };
    k.create_service(SERVICE, json!({}));
    k.cluster.run_pod(&k.pod(1, true));
    k
}

fn start_agent_in_pod(k: &mut K8sTopology) -> AgentHandle {
    let config = k.agent_config("");
    let pod_name = format!("POD_NAME={POD}");
    let pod_namespace = format!("POD_NAMESPACE={AGENT_NAMESPACE}");
    let agent =
        k.t.start_agent_wrapped(&["env", &pod_name, &pod_namespace], &config);
    agent.wait_for_log(
        "watching this agent's DaemonSet",
        1,
        Duration::from_secs(20),
    );
    // Ready comes before the allocator has given the Service its address.
    k.wait_programmed(1);
    agent
}

#[test]
fn sigterm_keeps_the_pins_while_the_daemonset_lives_and_removes_them_after_helm_uninstall() {
    let mut k = installed("unin");
    let pins = k.t.pin_dir.clone();

    // A rollout or a drain: the DaemonSet stays. XDP and the pins stay,
    // and the node keeps forwarding with no agent.
    let mut agent = start_agent_in_pod(&mut k);
    k.wait_answered_by("b1 answers", &["b1"], Duration::from_secs(30));
    assert!(agent.sigterm_and_wait().success(), "{}", agent.log());
    let log = agent.log();
    assert!(
        log.contains("not an uninstall: DaemonSet xlb is still there"),
        "{log}"
    );
    assert!(
        pins.join("link_lbc").exists(),
        "pins removed on a restart; log:\n{log}"
    );
    assert_eq!(xdp_on(&k.t, "lbc").as_deref(), Some("xdp"), "{log}");
    k.wait_answered_by(
        "b1 answers with the agent stopped",
        &["b1"],
        Duration::from_secs(5),
    );

    // helm uninstall: Helm deletes the DaemonSet (background propagation),
    // then the RBAC and the ServiceAccount; the garbage collector then
    // deletes the Pod, which is when the kubelet sends SIGTERM.
    let mut agent = start_agent_in_pod(&mut k);
    k.wait_answered_by("b1 answers again", &["b1"], Duration::from_secs(30));
    let uninstalled = Instant::now();
    k.cluster.helm_uninstall();
    wait_until(
        "the garbage collector deletes the agent's Pod",
        Duration::from_secs(60),
        || {
            let pod = k.cluster.get("pod", Some(AGENT_NAMESPACE), POD)?;
            (!pod["metadata"]["deletionTimestamp"].is_null()).then_some(())
        },
    );
    println!(
        "the Pod was being deleted {:?} after helm uninstall",
        uninstalled.elapsed()
    );
    // What the agent's SIGTERM meets: no DaemonSet, and neither the
    // permissions nor the ServiceAccount it was running with.
    assert!(k
        .cluster
        .get("daemonset", Some(AGENT_NAMESPACE), "xlb")
        .is_none());
    assert!(k
        .cluster
        .get("serviceaccount", Some(AGENT_NAMESPACE), "xlb")
        .is_none());
    assert!(agent.is_running());
    assert!(agent.sigterm_and_wait().success(), "{}", agent.log());
    let log = agent.log();
    assert!(log.contains("uninstalling: DaemonSet xlb is gone"), "{log}");
    assert!(log.contains("XDP detached and the pins removed"), "{log}");
    assert!(
        !pins.exists(),
        "pins left after helm uninstall; log:\n{log}"
    );
    assert_eq!(xdp_on(&k.t, "lbc"), None, "XDP still attached; log:\n{log}");
}
