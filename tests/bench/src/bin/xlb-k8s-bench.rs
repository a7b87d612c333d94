//! `cargo xtask bench` (Kubernetes part), on the real control plane
//! (`xlb_tests::cluster`: etcd, kube-apiserver, the EndpointSlice
//! controller), with lb-agent (release build) as the chart's ServiceAccount
//! in the LB namespace of the end-to-end topology.
//!
//! 1. Latency: a Pod of the measured Service turns ready or not ready (its
//!    status patched, as a kubelet would). Three instants: the patch is
//!    sent; the controller's EndpointSlice reaches this process's own watch;
//!    the pinned `SERVICES` entry (the data plane's atomic switch) shows the
//!    new backend count. The controller's part and xlb's part are reported
//!    apart. Run with no other Services and with `--services N` (default
//!    1000) others, whose slices are written in the controller's shape
//!    (Pods for all of them would measure the controller, not xlb).
//! 2. Scale: `--scale-services S` (default 1000) Services × `--endpoints E`
//!    (default 100) endpoints, slices in the controller's shape: the agent's
//!    time from start to ready, VmRSS once ready, and its peak (VmHWM).
//!
//! `--only latency` or `--only scale` runs one part.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::Path,
    process::ExitCode,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use aya::maps::{HashMap, Map, MapData};
use clap::{Parser, ValueEnum};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::{core::v1::Service, discovery::v1::EndpointSlice};
use kube::{
    api::{Patch, PatchParams, PostParams},
    runtime::{watcher, WatchStreamExt},
    Api, Client,
};
use lb_common::{map_names, ServiceInfo, ServiceKey, PROTO_TCP};
use serde_json::{json, Value};
use xlb_tests::{
    cluster::{Cluster, Pod, API_HOST},
    topology::{Topology, VIP},
};

const NS: &str = "bench";
const NODE: &str = "node-1";
const CONCURRENCY: usize = 16;

fn service(name: &str, selector: Option<Value>) -> Value {
    let mut svc = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "type": "LoadBalancer", "loadBalancerClass": "xlb.dev/xlb",
            "ports": [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
        },
    });
    if let Some(sel) = selector {
        svc["spec"]["selector"] = sel;
    }
    svc
}

/// An EndpointSlice as the controller writes it (its fields and labels; the
/// managed-by label names this bench so the controller leaves it alone).
fn slice(service: &str, index: usize, endpoints: usize) -> Value {
    let eps: Vec<Value> = (0..endpoints)
        .map(|j| {
            json!({
                "addresses": [format!("10.{}.{}.{}", 64 + index / 256, index % 256, j + 1)],
                "conditions": {"ready": true, "serving": true, "terminating": false},
                "nodeName": NODE,
                "zone": "zone-a",
                "targetRef": {"kind": "Pod", "namespace": NS, "name": format!("{service}-{j}")},
            })
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-x7k2p"), "namespace": NS,
                     "labels": {"kubernetes.io/service-name": service,
                                "endpointslice.kubernetes.io/managed-by": "xlb-bench"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": eps,
    })
}

fn vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, (i / 250) as u8, (i % 250 + 1) as u8)
}

async fn set_ingress(services: &Api<Service>, name: &str, ip: Ipv4Addr) -> kube::Result<()> {
    let status =
        json!({"status": {"loadBalancer": {"ingress": [{"ip": ip.to_string(), "ipMode": "VIP"}]}}});
    services
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map(|_| ())
}

/// `count` selector-less Services with `endpoints` endpoints each.
async fn add_services(client: &Client, count: usize, endpoints: usize) -> Result<(), String> {
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    futures::stream::iter(0..count)
        .map(|i| {
            let (services, slices) = (services.clone(), slices.clone());
            async move {
                let name = format!("other-{i}");
                let svc: Service = serde_json::from_value(service(&name, None)).unwrap();
                services.create(&PostParams::default(), &svc).await?;
                set_ingress(&services, &name, vip(i)).await?;
                let s: EndpointSlice = serde_json::from_value(slice(&name, i, endpoints)).unwrap();
                slices.create(&PostParams::default(), &s).await.map(|_| ())
            }
        })
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<()>>()
        .await
        .map(|_| ())
        .map_err(|e| format!("creating Services: {e}"))
}

fn backend_count(pin_dir: &Path, key: &ServiceKey) -> Option<u32> {
    let map = MapData::from_pin(pin_dir.join(map_names::SERVICES)).ok()?;
    let map: HashMap<MapData, ServiceKey, ServiceInfo> =
        HashMap::try_from(Map::HashMap(map)).ok()?;
    map.get(key, 0).ok().map(|info| info.backend_count)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

/// The topology with one backend, a cluster reachable from its LB
/// namespace, this node, the bench namespace.
fn bed(prefix: &str) -> (Topology, Cluster) {
    let t = Topology::new(prefix, 1);
    let mut cluster = Cluster::start(prefix);
    cluster.reach_from(&t.lb);
    cluster.install_chart_identity();
    cluster.add_node(NODE, "zone-a");
    cluster.create_namespace(NS);
    (t, cluster)
}

/// `extra`: top-level config lines.
fn agent_config(t: &Topology, cluster: &mut Cluster, extra: &str) -> String {
    let kubeconfig = t.dir.join("kubeconfig");
    cluster.write_agent_kubeconfig(&kubeconfig, API_HOST);
    format!(
        "interfaces: [{}]\n{extra}kubernetes:\n  kubeconfig: {}\n  node_name: {NODE}\n  mode: nat\n  allocate_addresses: false\n",
        t.lb_interfaces().join(", "),
        kubeconfig.display()
    )
}

/// Maglev entries for `services` Services of `endpoints` endpoints: each
/// takes two tables of the size the agent picks (docs/config.md).
fn pool_entries(services: usize, endpoints: usize) -> usize {
    let table = if endpoints <= 32 { 16381 } else { 65537 };
    (services * 2 * table).clamp(4_194_304, 268_435_456)
}

struct Latencies {
    controller: Vec<Duration>,
    xlb: Vec<Duration>,
}

/// One latency run: `others` other Services, then `changes` readiness flips.
fn latency_run(others: usize, changes: usize) -> Result<Latencies, String> {
    let (mut t, mut cluster) = bed("xk8l");
    let rt = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    let client = rt.block_on(cluster.admin_client());
    rt.block_on(add_services(&client, others, 3))?;
    cluster.create(&service("measured", Some(json!({"app": "measured"}))));
    let services: Api<Service> = Api::namespaced(client.clone(), NS);
    rt.block_on(set_ingress(&services, "measured", VIP))
        .map_err(|e| e.to_string())?;
    let pod = |n: usize, ready: bool| Pod {
        namespace: NS.into(),
        name: format!("measured-{n}"),
        labels: json!({"app": "measured"}),
        node: NODE.into(),
        ip: IpAddr::V4(Ipv4Addr::new(10, 2, 1, 10 + n as u8)),
        port: 8080,
        ready,
    };
    cluster.run_pod(&pod(0, true));
    cluster.run_pod(&pod(1, false));

    // This process's own watch on the measured Service's slices: when did
    // a slice with `n` ready endpoints first arrive?
    let seen: Arc<Mutex<Vec<(usize, Instant)>>> = Arc::default();
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), NS);
    let record = seen.clone();
    rt.spawn(async move {
        let cfg = watcher::Config::default().labels("kubernetes.io/service-name=measured");
        let mut stream = std::pin::pin!(watcher(slices, cfg).default_backoff().applied_objects());
        while let Some(Ok(s)) = stream.next().await {
            let ready = s
                .endpoints
                .iter()
                .filter(|e| e.conditions.as_ref().and_then(|c| c.ready) != Some(false))
                .count();
            record.lock().unwrap().push((ready, Instant::now()));
        }
    });

    let config = agent_config(&t, &mut cluster, "");
    let _agent = t.start_agent(&config);
    let key = lb_common::net::service_key(IpAddr::V4(VIP), 80, PROTO_TCP);
    let deadline = Instant::now() + Duration::from_secs(30);
    while backend_count(&t.pin_dir, &key) != Some(1) {
        if Instant::now() > deadline {
            return Err("the measured Service never reached the data plane".into());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut out = Latencies {
        controller: Vec::new(),
        xlb: Vec::new(),
    };
    for i in 0..changes {
        // Spaced so each change is its own slice update (the controller
        // batches nothing by default, but its queue may merge quick ones).
        std::thread::sleep(Duration::from_millis(100));
        let ready = i % 2 == 0;
        let want = if ready { 2 } else { 1 };
        seen.lock().unwrap().clear();
        let sent = Instant::now();
        cluster.set_pod_ready(&pod(1, ready), ready);
        let switched = loop {
            if backend_count(&t.pin_dir, &key) == Some(want) {
                break Instant::now();
            }
            if sent.elapsed() > Duration::from_secs(30) {
                return Err(format!("change {i} did not reach the data plane in 30 s"));
            }
        };
        // Our watch may see the slice a moment after the agent's did.
        let in_api = loop {
            if let Some(&(_, at)) = seen
                .lock()
                .unwrap()
                .iter()
                .find(|(n, _)| *n == want as usize)
            {
                break at;
            }
            if sent.elapsed() > Duration::from_secs(30) {
                return Err(format!("change {i}: the slice never reached this process"));
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        out.controller.push(in_api.saturating_duration_since(sent));
        out.xlb.push(switched.saturating_duration_since(in_api));
    }
    Ok(out)
}

struct Scale {
    ready_after: Duration,
    rss_kib: u64,
    hwm_kib: u64,
}

fn status_kib(pid: i32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches(" kB").trim().parse().ok())
}

fn scale_run(count: usize, endpoints: usize) -> Result<Scale, String> {
    let (mut t, mut cluster) = bed("xk8s");
    let rt = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    let client = rt.block_on(cluster.admin_client());
    rt.block_on(add_services(&client, count, endpoints))?;
    // The default pool holds 32 Services of 100 endpoints (65537-entry tables).
    let pool = format!("maglev_pool_entries: {}\n", pool_entries(count, endpoints));
    let config = agent_config(&t, &mut cluster, &pool);
    // Built (if it must be) before the clock starts.
    xlb_tests::topology::agent_bin();
    let started = Instant::now();
    let agent = t.start_agent(&config);
    let ready_after = started.elapsed();
    let pid = agent.pid();
    let programmed = t.lbctl_json(&["services"])["services"]
        .as_array()
        .map_or(0, Vec::len);
    if programmed != count {
        return Err(format!("{programmed} of {count} Services programmed"));
    }
    Ok(Scale {
        ready_after,
        rss_kib: status_kib(pid, "VmRSS:").ok_or("no VmRSS")?,
        hwm_kib: status_kib(pid, "VmHWM:").ok_or("no VmHWM")?,
    })
}

/// One part of the benchmark: Pod readiness to the data plane, or many
/// Services' start and memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Part {
    Latency,
    Scale,
}

/// xlb on the real Kubernetes control plane: a Pod's change to the data
/// plane, and many Services' start and memory.
#[derive(Parser, Debug)]
#[command(name = "xlb-k8s-bench", args_override_self = true)]
struct Cli {
    /// Other Services in the latency part's second run
    #[arg(long = "services", value_name = "N", default_value_t = 1000)]
    others: usize,
    /// Readiness changes per latency run
    #[arg(long, value_name = "N", default_value_t = 100)]
    changes: usize,
    /// Services of the scale part
    #[arg(long = "scale-services", value_name = "N", default_value_t = 1000)]
    scale: usize,
    /// Endpoints per Service in the scale part
    #[arg(long, value_name = "N", default_value_t = 100)]
    endpoints: usize,
    /// Run only this part [default: both]
    #[arg(long, value_name = "PART", value_enum)]
    only: Option<Part>,
}

fn main() -> ExitCode {
    let Cli {
        others,
        changes,
        scale,
        endpoints,
        only,
    } = Cli::parse();
    println!(
        "\n## Pod readiness → EndpointSlice → data plane (real kube-apiserver and controller)\n"
    );
    println!("| other Services | changes | controller: median / p99 ms | xlb: median / p99 / max ms | goal (xlb p99 < 20 ms) |");
    println!("|---|---|---|---|---|");
    let runs: &[usize] = if only == Some(Part::Scale) {
        &[]
    } else {
        &[0, others]
    };
    for &n in runs {
        match latency_run(n, changes) {
            Ok(mut l) => {
                l.controller.sort();
                l.xlb.sort();
                let p99 = percentile(&l.xlb, 0.99);
                println!(
                    "| {n} | {} | {} / {} | {} / {} / {} | {} |",
                    l.xlb.len(),
                    ms(percentile(&l.controller, 0.5)),
                    ms(percentile(&l.controller, 0.99)),
                    ms(percentile(&l.xlb, 0.5)),
                    ms(p99),
                    ms(*l.xlb.last().unwrap()),
                    if p99 < Duration::from_millis(20) {
                        "met"
                    } else {
                        "not met"
                    }
                );
            }
            Err(e) => {
                eprintln!("xlb-k8s-bench: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if only == Some(Part::Latency) {
        return ExitCode::SUCCESS;
    }
    println!("\n## {scale} Services × {endpoints} endpoints: the agent's start and memory\n");
    println!("| start → ready | VmRSS when ready | peak (VmHWM) | goal (peak < 100 MB, steady < 60 MB) |");
    println!("|---|---|---|---|");
    match scale_run(scale, endpoints) {
        Ok(s) => {
            let mb = |kib: u64| kib as f64 / 1024.0;
            println!(
                "| {:.1} s | {:.1} MiB | {:.1} MiB | peak {}, steady {} |",
                s.ready_after.as_secs_f64(),
                mb(s.rss_kib),
                mb(s.hwm_kib),
                if mb(s.hwm_kib) < 100.0 {
                    "met"
                } else {
                    "not met"
                },
                if mb(s.rss_kib) < 60.0 {
                    "met"
                } else {
                    "not met"
                },
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("xlb-k8s-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::{Cli, Part};

    #[test]
    fn documented_invocations_parse() {
        Cli::command().debug_assert();
        let only = |p: &str| Cli::try_parse_from(["xlb-k8s-bench", "--only", p]).map(|c| c.only);
        // docs/benchmarks.md, README.md
        assert_eq!(only("latency").unwrap(), Some(Part::Latency));
        assert_eq!(only("scale").unwrap(), Some(Part::Scale));
        only("both").unwrap_err();
        let c = Cli::try_parse_from(["xlb-k8s-bench"]).unwrap();
        assert_eq!(
            (c.others, c.changes, c.scale, c.endpoints),
            (1000, 100, 1000, 100)
        );
        assert!(c.only.is_none());
        let c = Cli::try_parse_from([
            "xlb-k8s-bench",
            "--services",
            "10",
            "--changes",
            "5",
            "--scale-services",
            "20",
            "--endpoints",
            "3",
        ])
        .unwrap();
        assert_eq!((c.others, c.changes, c.scale, c.endpoints), (10, 5, 20, 3));
    }
}
