//! `cargo xtask bench` (Kubernetes part): how long an EndpointSlice change
//! takes to reach the data plane.
//!
//! lb-agent (release build) runs in the LB namespace of the end-to-end
//! topology, watching the test API server (`xlb_tests::apiserver`, started in
//! the same namespace). Each change adds or removes one endpoint of the
//! measured Service through the server's store; the clock stops when the
//! pinned `SERVICES` map shows the new backend count (that entry is the
//! data plane's atomic switch to the new Maglev table). The same run is made
//! with 1 and with `--services N` (default 500) other xlb Services in the
//! cluster, since every change recomputes the whole desired state.
//!
//! Changes are 50 ms apart, and in a third run back to back (each made as
//! soon as the previous one is seen): a Service changed again within 20 ms
//! of its last table switch may not reuse the table it just retired (a
//! packet may still read it), so the agent writes a fresh region instead.
//!
//! Goal (docs/benchmarks.md): p99 under 100 ms; the IPVS controller in our
//! reference paper polled every second and then reloaded keepalived.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::Path,
    process::ExitCode,
    time::{Duration, Instant},
};

use aya::maps::{HashMap, Map, MapData};
use lb_common::{map_names, ServiceInfo, ServiceKey, PROTO_TCP};
use serde_json::{json, Value};
use xlb_tests::{
    apiserver::TestApiServer,
    topology::{in_netns, Topology, VIP},
};

const NS: &str = "bench";
const NODE: &str = "node-1";

fn service(name: &str, ip: Ipv4Addr) -> (Value, Value) {
    let svc = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "type": "LoadBalancer", "loadBalancerClass": "xlb.dev/xlb",
            "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
        },
    });
    let status = json!({"loadBalancer": {"ingress": [{"ip": ip.to_string(), "ipMode": "VIP"}]}});
    (svc, status)
}

fn slice(name: &str, endpoints: usize) -> Value {
    let eps: Vec<Value> = (0..endpoints)
        .map(|i| {
            json!({
                "addresses": [format!("10.2.1.{}", 10 + i)],
                "conditions": {"ready": true},
                "nodeName": NODE,
            })
        })
        .collect();
    json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{name}-slice"), "namespace": NS,
                     "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": eps,
    })
}

fn add_service(api: &TestApiServer, name: &str, ip: Ipv4Addr, endpoints: usize) {
    let (svc, status) = service(name, ip);
    api.create_json(svc).expect("create Service");
    api.patch_json(
        "v1",
        "Service",
        Some(NS),
        name,
        xlb_tests::apiserver::PatchType::Merge,
        &json!({ "status": status }),
        true,
    )
    .expect("set the Service's ingress");
    api.create_json(slice(name, endpoints))
        .expect("create EndpointSlice");
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

/// One run: `others` extra Services, then `changes` endpoint changes on the
/// measured one. Returns the latencies.
fn run(others: usize, changes: usize, gap: Duration) -> Result<Vec<Duration>, String> {
    let mut t = Topology::new("xk8l", 1);
    let api = in_netns(&t.lb, TestApiServer::start_blocking)
        .join()
        .map_err(|_| "starting the test API server failed")?;
    api.create_json(json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}))
        .map_err(|e| format!("{e:?}"))?;
    for i in 0..others {
        let ip = Ipv4Addr::new(198, 18, (i / 250) as u8, (i % 250 + 1) as u8);
        add_service(&api, &format!("other-{i}"), ip, 3);
    }
    add_service(&api, "measured", VIP, 1);
    let kubeconfig = t.dir.join("kubeconfig");
    api.write_kubeconfig(&kubeconfig)
        .map_err(|e| e.to_string())?;
    let ifaces = t.lb_interfaces().join(", ");
    let _agent = t.start_agent(&format!(
        "interfaces: [{ifaces}]\nkubernetes:\n  kubeconfig: {}\n  node_name: {NODE}\n  mode: nat\n  allocate_addresses: false\n",
        kubeconfig.display()
    ));
    let key = lb_agent::dataplane::service_key(IpAddr::V4(VIP), 80, PROTO_TCP);
    let wait_for = |want: u32| -> Option<Duration> {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if backend_count(&t.pin_dir, &key) == Some(want) {
                return Some(start.elapsed());
            }
            std::hint::spin_loop();
        }
        None
    };
    wait_for(1).ok_or("the measured Service never reached the data plane")?;
    let mut latencies = Vec::with_capacity(changes);
    for i in 0..changes {
        std::thread::sleep(gap);
        let want = if i % 2 == 0 { 2 } else { 1 };
        let mut s = slice("measured", want as usize);
        let current = api
            .get_json(
                "discovery.k8s.io/v1",
                "EndpointSlice",
                Some(NS),
                "measured-slice",
            )
            .ok_or("the slice vanished")?;
        s["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"].clone();
        let start = Instant::now();
        api.update_json(s).map_err(|e| format!("{e:?}"))?;
        let seen = loop {
            if backend_count(&t.pin_dir, &key) == Some(want) {
                break start.elapsed();
            }
            if start.elapsed() > Duration::from_secs(10) {
                return Err(format!("change {i} did not reach the data plane in 10 s"));
            }
        };
        latencies.push(seen);
    }
    Ok(latencies)
}

fn main() -> ExitCode {
    let mut others = 500;
    let mut changes = 200;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let value = |it: &mut std::slice::Iter<String>| it.next().and_then(|v| v.parse().ok());
        match a.as_str() {
            "--services" => others = value(&mut it).unwrap_or(others),
            "--changes" => changes = value(&mut it).unwrap_or(changes),
            _ => {} // other benchmarks' arguments
        }
    }
    println!("\n## EndpointSlice change → data plane (lb-agent watching the test API server)\n");
    println!(
        "| other Services | gap between changes | changes | median ms | p99 ms | max ms | goal |"
    );
    println!("|---|---|---|---|---|---|---|");
    let spaced = Duration::from_millis(50);
    for (n, gap) in [(0, spaced), (others, spaced), (0, Duration::ZERO)] {
        match run(n, changes, gap) {
            Ok(mut l) => {
                l.sort();
                let p99 = percentile(&l, 0.99);
                println!(
                    "| {n} | {} ms | {} | {} | {} | {} | p99 < 100 ms: {} |",
                    gap.as_millis(),
                    l.len(),
                    ms(percentile(&l, 0.5)),
                    ms(p99),
                    ms(*l.last().unwrap()),
                    if p99 < Duration::from_millis(100) {
                        "met"
                    } else {
                        "not met"
                    }
                );
            }
            Err(e) => {
                eprintln!("xlb-k8s-latency-bench: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
