//! The chart on real nodes (tests/src/nodes.rs): kubelets, containerd,
//! flannel and kube-proxy run it, installed with helm as docs/helm.md says,
//! and a client outside the cluster reaches a Deployment's Pods on every
//! node through a LoadBalancer Service.

use std::{
    collections::BTreeSet,
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket},
    time::Duration,
};

use serde_json::{json, Value};
use xlb_tests::{
    cluster::AGENT_NAMESPACE,
    nodes::{from_client, image, node_ip, NodeCluster, PodNetwork, CLIENT},
    traffic::poll_until,
};

const APP_NS: &str = "shop";
/// The L2 pool: addresses on the nodes' LAN, answered by ARP.
const L2_POOL: &str = "10.80.0.200/29";

/// The backend Deployment: `replicas` Pods spread over the nodes.
fn deploy_backend(c: &NodeCluster, replicas: usize) {
    c.cp.create_namespace(APP_NS);
    c.cp.apply(&json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": APP_NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {"labels": {"app": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "topologySpreadConstraints": [{
                        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                        "whenUnsatisfiable": "DoNotSchedule",
                        "labelSelector": {"matchLabels": {"app": "web"}},
                    }],
                    "containers": [{
                        "name": "web", "image": image("xlb-backend"),
                        "imagePullPolicy": "Never",
                        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                        "ports": [
                            {"name": "http", "containerPort": 8080, "protocol": "TCP"},
                            {"name": "echo", "containerPort": 8080, "protocol": "UDP"},
                        ],
                        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                    }],
                },
            },
        },
    }));
    c.cp.kubectl_ok(&[
        "-n",
        APP_NS,
        "rollout",
        "status",
        "deployment/web",
        "--timeout=120s",
    ]);
}

/// Pod name -> node name of the backend's Pods.
fn backend_pods(c: &NodeCluster) -> Vec<(String, String)> {
    c.cp.list("pods", APP_NS)
        .iter()
        .map(|p| {
            (
                p["metadata"]["name"].as_str().unwrap().to_string(),
                p["spec"]["nodeName"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

/// `shop/web`, TCP and UDP on port 80, with `annotations`.
fn create_service(c: &NodeCluster, annotations: Value) -> Ipv4Addr {
    c.cp.apply(&json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": APP_NS, "annotations": annotations},
        "spec": {
            "type": "LoadBalancer",
            "loadBalancerClass": "xlb.dev/xlb",
            "selector": {"app": "web"},
            "ports": [
                {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"},
                {"name": "echo", "port": 80, "targetPort": "echo", "protocol": "UDP"},
            ],
        },
    }));
    let ip = poll_until(Duration::from_secs(60), Duration::from_millis(200), || {
        let svc = c.cp.get("service", Some(APP_NS), "web").ok_or(())?;
        svc["status"]["loadBalancer"]["ingress"][0]["ip"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .ok_or(())
    })
    .unwrap_or_else(|()| panic!("shop/web got no address:\n{}", c.describe_agents()));
    ip
}

/// One HTTP request on a new connection; the backend's answer line.
fn http_once(vip: SocketAddr) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&vip, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(3)))?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    loop {
        match s.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&buf);
                if text.contains("\r\n\r\n") && text.ends_with('\n') && text.contains("pod=") {
                    break;
                }
            }
            Err(e) => return Err(e),
        }
    }
    let text = String::from_utf8_lossy(&buf).into_owned();
    text.split_once("\r\n\r\n")
        .filter(|(head, _)| head.starts_with("HTTP/1.1 200"))
        .map(|(_, body)| body.trim().to_string())
        .ok_or_else(|| std::io::Error::other(format!("bad answer {text:?}")))
}

fn udp_once(vip: SocketAddr) -> std::io::Result<String> {
    let s = UdpSocket::bind("0.0.0.0:0")?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.send_to(b"ping", vip)?;
    let mut buf = [0u8; 512];
    let (n, _) = s.recv_from(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).trim().to_string())
}

/// `pod=NAME client=ADDR:PORT` -> (NAME, ADDR).
fn parse_answer(answer: &str) -> (String, String) {
    let field = |k: &str| {
        answer
            .split_whitespace()
            .find_map(|f| f.strip_prefix(k))
            .unwrap_or_else(|| panic!("no {k} in {answer:?}"))
            .to_string()
    };
    let client = field("client=");
    let addr = client.rsplit_once(':').map(|(a, _)| a.to_string()).unwrap();
    (field("pod="), addr)
}

/// `n` requests from the client over TCP and `n` over UDP: every one must
/// be answered. Returns the answers (pod, client address as the Pod saw it).
fn requests(c: &NodeCluster, vip: Ipv4Addr, n: usize) -> Vec<(String, String)> {
    let target = SocketAddr::from((vip, 80));
    let answers = from_client(c, move || {
        let mut out = Vec::new();
        for i in 0..n {
            out.push(http_once(target).map_err(|e| format!("TCP request {i}: {e}")));
            out.push(udp_once(target).map_err(|e| format!("UDP request {i}: {e}")));
        }
        out
    });
    let failed: Vec<&String> = answers.iter().filter_map(|a| a.as_ref().err()).collect();
    assert!(
        failed.is_empty(),
        "{} of {} requests to {target} failed: {failed:?}\n{}\n{}",
        failed.len(),
        answers.len(),
        c.describe_traffic(),
        c.describe_agents()
    );
    answers
        .into_iter()
        .map(|a| parse_answer(&a.unwrap()))
        .collect()
}

/// With the chart's defaults (no interface named but eth0), in L2 mode:
/// Pods on the node that owns the VIP and on the other node, across
/// flannel's VXLAN, are reached in snat and in nat, over TCP and UDP.
#[test]
fn l2_install_reaches_pods_on_every_node_in_snat_and_nat() {
    let c = NodeCluster::start("rna", 2, PodNetwork::Vxlan);
    deploy_backend(&c, 4);
    let pods = backend_pods(&c);
    let nodes: BTreeSet<&str> = pods.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(
        nodes.len(),
        2,
        "the backends are not on both nodes: {pods:?}"
    );

    c.cp.create_namespace(AGENT_NAMESPACE);
    c.cp.kubectl_ok(&[
        "-n",
        AGENT_NAMESPACE,
        "create",
        "secret",
        "generic",
        "xlb-l2-key",
        "--from-literal=key=0123456789abcdef0123456789abcdef",
    ]);
    let chart = NodeCluster::chart();
    c.helm_ok(&[
        "install",
        "xlb",
        chart.to_str().unwrap(),
        "--namespace",
        AGENT_NAMESPACE,
        "--set",
        "config.interfaces={eth0}",
        "--set",
        "l2KeySecret=xlb-l2-key",
        "--set-json",
        r#"config.l2={"interfaces":["eth0"],"key_file":"/etc/xlb-l2/key"}"#,
        "--set-json",
        &format!(r#"pools={{"lan":{{"addresses":["{L2_POOL}"]}}}}"#),
    ]);
    c.wait_agents_ready();

    let vip = create_service(&c, json!({}));
    let node_addrs: BTreeSet<String> = (1..=2).map(|i| node_ip(i).to_string()).collect();
    let answers = requests(&c, vip, 12);
    let served: BTreeSet<&str> = answers.iter().map(|(p, _)| p.as_str()).collect();
    let all: BTreeSet<&str> = pods.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(served, all, "snat: not every Pod was reached");
    for (pod, client) in &answers {
        assert!(
            node_addrs.contains(client),
            "snat: {pod} saw the client as {client}, not as a node's address"
        );
    }

    c.cp.patch(
        "service",
        Some(APP_NS),
        "web",
        &json!({"metadata": {"annotations": {"xlb.dev/mode": "nat"}}}),
        false,
    );
    // The agents apply the annotation; until then answers come from snat.
    poll_until(Duration::from_secs(30), Duration::from_millis(200), || {
        let target = SocketAddr::from((vip, 80));
        let a = from_client(&c, move || http_once(target));
        match a {
            Ok(a) if parse_answer(&a).1 == CLIENT.to_string() => Ok(()),
            _ => Err(()),
        }
    })
    .unwrap_or_else(|()| panic!("nat never took effect:\n{}", c.describe_agents()));
    let answers = requests(&c, vip, 12);
    let served: BTreeSet<&str> = answers.iter().map(|(p, _)| p.as_str()).collect();
    assert_eq!(served, all, "nat: not every Pod was reached");
    for (pod, client) in &answers {
        assert_eq!(
            client,
            &CLIENT.to_string(),
            "nat: {pod} did not see the client's own address"
        );
    }
}
