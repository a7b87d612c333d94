//! The Helm chart against the real kube-apiserver (`xlb_tests::cluster`,
//! started with `--allow-privileged=false` as a hardened cluster is): every
//! object `helm template` renders, with the default values, with the BGP
//! sidecar and in L2 mode, is accepted by `kubectl apply --dry-run=server`
//! (admission and validation included; the namespace, ServiceAccount, RBAC
//! and CRD are applied for real first), and its Pod declares the ports in
//! use and listens on the node's address. Pod Security: the agent needs the host network,
//! a bpffs hostPath and NET_ADMIN/BPF, which `baseline` forbids; the
//! namespace must be `privileged`, and this test shows both halves.

use serde_json::json;
use xlb_tests::cluster::{Cluster, AGENT_NAMESPACE};

fn dry_run(cluster: &Cluster, manifest: &str) -> Result<String, String> {
    let out = cluster.kubectl_with_input(
        &[
            "apply",
            "--dry-run=server",
            "-n",
            AGENT_NAMESPACE,
            "-f",
            "-",
        ],
        Some(manifest.as_bytes()),
    );
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn set_pod_security(cluster: &Cluster, level: &str) {
    cluster.kubectl_ok(&[
        "label",
        "namespace",
        AGENT_NAMESPACE,
        &format!("pod-security.kubernetes.io/enforce={level}"),
        "--overwrite",
    ]);
}

fn daemonset(rendered: &str) -> serde_json::Value {
    rendered
        .split("\n---")
        .filter_map(|d| serde_yaml::from_str(d).ok())
        .find(|d: &serde_json::Value| d["kind"] == "DaemonSet")
        .expect("a DaemonSet")
}

fn pod_spec(rendered: &str) -> serde_json::Value {
    daemonset(rendered)["spec"]["template"]["spec"].clone()
}

/// A container's ports as `name/protocol/port`.
fn ports(container: &serde_json::Value) -> Vec<String> {
    container["ports"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| {
            format!(
                "{}/{}/{}",
                p["name"].as_str().unwrap(),
                p["protocol"].as_str().unwrap(),
                p["containerPort"]
            )
        })
        .collect()
}

/// The Pod the DaemonSet controller would create: the template's spec.
fn agent_pod(cluster: &Cluster) -> String {
    let daemonset = daemonset(&cluster.helm_template(&[]));
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "xlb-agent", "namespace": AGENT_NAMESPACE,
                     "labels": daemonset["spec"]["template"]["metadata"]["labels"]},
        "spec": daemonset["spec"]["template"]["spec"],
    })
    .to_string()
}

#[test]
fn every_rendered_object_is_accepted_by_the_real_api_server() {
    let mut cluster = Cluster::start("chart");
    cluster.install_chart_identity();
    set_pod_security(&cluster, "privileged");
    let bgp = xlb_tests::topology::workspace_root().join("charts/xlb/ci/bgp-values.yaml");
    let bgp_179 =
        xlb_tests::topology::workspace_root().join("charts/xlb/ci/bgp-router-id-values.yaml");
    let l2 = [
        "--set=config.l2.interfaces={eth0}",
        "--set=config.l2.key_file=/etc/xlb-l2/key",
        "--set=config.l2.share_flows=true",
    ];
    // The ports each Pod declares, by container: only those in use.
    for (what, extra, agent_ports, sidecar_ports) in [
        ("default values", vec![], vec!["metrics/TCP/9469"], vec![]),
        (
            "BGP sidecar, outgoing sessions only",
            vec!["-f", bgp.to_str().unwrap()],
            vec!["metrics/TCP/9469"],
            vec![],
        ),
        (
            "BGP sidecar on port 179",
            vec!["-f", bgp_179.to_str().unwrap()],
            vec!["metrics/TCP/9469"],
            vec!["bgp/TCP/179"],
        ),
        (
            "L2 mode sharing flows",
            l2.to_vec(),
            vec![
                "metrics/TCP/9469",
                "l2-members/UDP/7946",
                "flow-sync/TCP/7947",
            ],
            vec![],
        ),
    ] {
        let rendered = cluster.helm_template(&extra);
        let pod = pod_spec(&rendered);
        assert_eq!(ports(&pod["containers"][0]), agent_ports, "{what}");
        assert_eq!(ports(&pod["initContainers"][0]), sidecar_ports, "{what}");
        let accepted = dry_run(&cluster, &rendered)
            .unwrap_or_else(|e| panic!("{what}: the server refused the chart:\n{e}"));
        for kind in [
            "daemonset.apps/xlb",
            "configmap/xlb-config",
            "clusterrole.rbac.authorization.k8s.io/xlb",
        ] {
            assert!(accepted.contains(kind), "{what}: {kind} not in\n{accepted}");
        }
        // No container asks for privileged: the server runs with
        // --allow-privileged=false and accepted it.
        assert!(!rendered.contains("privileged: true"), "{what}");
    }

    // Metrics and probes on the node's own address: the agent listens on
    // status.hostIP, and the probes, with no host, go to the Pod's IP,
    // which on the host network is that same address.
    let agent = &pod_spec(&cluster.helm_template(&[]))["containers"][0];
    let args: Vec<&str> = agent["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert!(args.contains(&"--metrics-addr=$(HOST_IP):9469"), "{args:?}");
    let host_ip = agent["env"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "HOST_IP")
        .expect("HOST_IP");
    assert_eq!(
        host_ip["valueFrom"]["fieldRef"]["fieldPath"],
        "status.hostIP"
    );
    for probe in ["livenessProbe", "readinessProbe"] {
        assert!(
            agent[probe]["httpGet"]["host"].is_null(),
            "{probe}: {}",
            agent[probe]
        );
        assert_eq!(agent[probe]["httpGet"]["port"], 9469, "{probe}");
    }

    // Pod Security judges Pods: under `baseline` the Pods the DaemonSet
    // would create are refused for what the agent cannot do without
    // (docs/helm.md says to label the namespace privileged).
    let pod = agent_pod(&cluster);
    set_pod_security(&cluster, "baseline");
    let refused = dry_run(&cluster, &pod).expect_err("baseline admits the agent's Pod");
    assert!(refused.contains("host namespaces"), "{refused}");
    assert!(refused.contains("hostPath"), "{refused}");
    set_pod_security(&cluster, "privileged");
    dry_run(&cluster, &pod).expect("the agent's Pod under privileged");
    // On the host network the server makes each declared port a host port
    // too: the scheduler keeps a second agent off the node.
    let out = cluster.kubectl_with_input(
        &["create", "--dry-run=server", "-o", "json", "-f", "-"],
        Some(pod.as_bytes()),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let created: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        created["spec"]["containers"][0]["ports"][0]["hostPort"], 9469,
        "{}",
        created["spec"]["containers"][0]
    );

    // A privileged container is refused by this server even in a
    // privileged namespace: what the chart no longer needs.
    set_pod_security(&cluster, "privileged");
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "privileged", "namespace": AGENT_NAMESPACE},
        "spec": {"containers": [{"name": "c", "image": "x", "securityContext": {"privileged": true}}]},
    });
    let refused = dry_run(&cluster, &pod.to_string()).expect_err("a privileged Pod was admitted");
    assert!(refused.contains("privileged"), "{refused}");
}
