//! The Helm chart against the real kube-apiserver (`xlb_tests::cluster`,
//! started with `--allow-privileged=false` as a hardened cluster is): every
//! object `helm template` renders, with the default values and with the BGP
//! sidecar, is accepted by `kubectl apply --dry-run=server` (admission and
//! validation included; the namespace, ServiceAccount, RBAC and CRD are
//! applied for real first). Pod Security: the agent needs the host network,
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

/// The Pod the DaemonSet controller would create: the template's spec.
fn agent_pod(cluster: &Cluster) -> String {
    let rendered = cluster.helm_template(&[]);
    let daemonset: serde_json::Value = rendered
        .split("\n---")
        .filter_map(|d| serde_yaml::from_str(d).ok())
        .find(|d: &serde_json::Value| d["kind"] == "DaemonSet")
        .expect("a DaemonSet");
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
    for (what, extra) in [
        ("default values", vec![]),
        ("BGP sidecar", vec!["-f", bgp.to_str().unwrap()]),
    ] {
        let rendered = cluster.helm_template(&extra);
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
