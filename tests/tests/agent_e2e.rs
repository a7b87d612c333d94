//! End to end: `lb-agent` (XDP on the LB namespace's interfaces) between a
//! client namespace and three nginx backends, inspected with `lbctl` and
//! the agent's metrics. See `xlb_tests::topology` for the layout.
//!
//! Needs root, nginx, ethtool, iproute2 and bpffs at /sys/fs/bpf. Every test
//! builds its own topology (its own namespaces, pin directory and agent), so
//! the tests may run in parallel. Waits poll their condition with a
//! deadline; nothing sleeps in place of a readiness check.

use std::{
    collections::BTreeMap,
    io::{self, Read, Write},
    net::{SocketAddr, TcpStream, UdpSocket},
    process::Command,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use xlb_tests::topology::{
    agent_bin, allowed_cpus, backend_ip, in_netns, set_affinity, set_rcvbuf, HttpConn, Topology,
    BACKEND_PORT, CLIENT_IP, LB_CLIENT_SIDE, VIP,
};
use xlb_tests::traffic::{self, count, wait_until};

const SVC: &str = "192.0.2.10:80/tcp";
const UDP_SVC: &str = "192.0.2.10:53/udp";
const UDP_BACKEND_PORT: u16 = 5353;

fn vip() -> SocketAddr {
    SocketAddr::from((VIP, 80))
}

fn backend_addr(n: usize) -> String {
    format!("{}:{BACKEND_PORT}", backend_ip(n))
}

fn backend_name(n: usize) -> String {
    format!("b{n}")
}

// ---------------------------------------------------------------------------
// Configs.

/// A whole config file: the topology's interfaces, an SNAT address, and `services`.
fn config(services: &[String]) -> String {
    format!(
        "interfaces: [lbc, lbb1, lbb2, lbb3]\nsnat_ipv4: {LB_CLIENT_SIDE}\nservices:\n{}",
        services.concat()
    )
}

/// The web service 192.0.2.10:80/tcp on backends `(n, weight)`, port 8080.
/// `extra`: more fields of the service, each line indented by four spaces.
fn web(mode: &str, backends: &[(usize, u32)], extra: &str) -> String {
    let mut s = format!(
        "  - name: web\n    vip: {VIP}\n    port: 80\n    protocol: tcp\n    mode: {mode}\n{extra}    backends:\n"
    );
    for (n, w) in backends {
        s.push_str(&format!(
            "      - {{ ip: {}, port: {BACKEND_PORT}, weight: {w} }}\n",
            backend_ip(*n)
        ));
    }
    s
}

/// The DNS-like service 192.0.2.10:53/udp on every backend's UDP echo server.
fn dns(mode: &str) -> String {
    let mut s = format!(
        "  - name: dns\n    vip: {VIP}\n    port: 53\n    protocol: udp\n    mode: {mode}\n    backends:\n"
    );
    for n in 1..=3 {
        s.push_str(&format!(
            "      - {{ ip: {}, port: {UDP_BACKEND_PORT} }}\n",
            backend_ip(n)
        ));
    }
    s
}

// ---------------------------------------------------------------------------
// Client traffic.

/// [`traffic::requests_on`] to the web VIP from any CPU.
fn requests(t: &Topology, n: usize) -> Vec<(u16, String)> {
    requests_on(t, n, None)
}

fn requests_on(t: &Topology, n: usize, cpu: Option<usize>) -> Vec<(u16, String)> {
    traffic::requests_on(t, vip(), n, cpu)
}

fn keepalive(t: &Topology) -> HttpConn {
    HttpConn::connect_in(&t.client, vip()).expect("keep-alive connection")
}

fn keepalive_to(t: &Topology, n: usize) -> HttpConn {
    traffic::keepalive_to(t, vip(), &backend_name(n))
}

/// Restores the calling thread's CPU affinity when dropped.
struct AffinityGuard(Vec<usize>);

impl AffinityGuard {
    fn new() -> Self {
        AffinityGuard(allowed_cpus())
    }
}

impl Drop for AffinityGuard {
    fn drop(&mut self) {
        set_affinity(0, &self.0);
    }
}

/// `k` requests on `c`, each must be answered by `expected`. The requests
/// are sent from each CPU in turn: the data plane's flow table is per CPU,
/// and a veth hands a packet to XDP on the CPU that sent it, so this makes
/// every CPU's entry for the flow carry it.
fn assert_sticky(c: &mut HttpConn, expected: &str, k: usize, when: &str) {
    let guard = AffinityGuard::new();
    for i in 0..k {
        set_affinity(0, &[guard.0[i % guard.0.len()]]);
        match c.get() {
            Ok(b) => assert_eq!(
                b, expected,
                "{when}: request {i} on the keep-alive connection went to {b}, not {expected}"
            ),
            Err(e) => {
                panic!("{when}: request {i} on the keep-alive connection ({expected}) failed: {e}")
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Waiting, lbctl, metrics.

/// The backend addresses in the service's live Maglev table.
fn table_backends(t: &Topology, svc: &str) -> Vec<String> {
    let v = t.lbctl_json(&["maglev", svc]);
    v["backends"]
        .as_array()
        .unwrap_or_else(|| panic!("lbctl maglev {svc}: {v}"))
        .iter()
        .map(|b| b["address"].as_str().expect("address").to_string())
        .collect()
}

/// `lbctl backends SVC --json`: backend address -> its row.
fn backend_rows(t: &Topology, svc: &str) -> BTreeMap<String, Value> {
    let v = t.lbctl_json(&["backends", svc]);
    let services = v["services"].as_array().unwrap_or_else(|| panic!("{v}"));
    assert_eq!(services.len(), 1, "{v}");
    services[0]["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| (b["address"].as_str().unwrap().to_string(), b.clone()))
        .collect()
}

/// The value of the sample `name{labels}` in a Prometheus text page.
fn metric(page: &str, name: &str, labels: &str) -> Option<f64> {
    let prefix = if labels.is_empty() {
        format!("{name} ")
    } else {
        format!("{name}{{{labels}}} ")
    };
    page.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.trim().parse().expect("metric value"))
}

fn web_backend_labels(n: usize) -> String {
    format!(r#"service="web",backend="{}""#, backend_addr(n))
}

/// No packet was dropped by the data plane, or handed to the kernel for
/// want of a route (what a flow rewritten to a bogus backend gets).
fn assert_no_drops(t: &Topology, when: &str) {
    let stats = t.lbctl_json(&["stats"]);
    let reasons: BTreeMap<String, u64> = stats["reasons"]
        .as_array()
        .unwrap_or_else(|| panic!("lbctl stats: {stats}"))
        .iter()
        .map(|r| {
            (
                r["reason"].as_str().unwrap().into(),
                r["total"].as_u64().unwrap(),
            )
        })
        .collect();
    let bad: Vec<_> = reasons
        .iter()
        .filter(|(r, n)| **n > 0 && (r.starts_with("drop_") || *r == "pass_fib_failed"))
        .collect();
    assert!(bad.is_empty(), "{when}: {bad:?} (all: {reasons:?})");
}

/// `ss` in backend `n`'s namespace: the peers of its established
/// connections on `port`.
fn backend_peers(t: &Topology, n: usize, port: u16) -> Vec<SocketAddr> {
    let out = t.output_in(
        &t.backends[n - 1],
        "ss",
        &[
            "-tnH",
            "state",
            "established",
            &format!("( sport = :{port} )"),
        ],
    );
    assert!(out.status.success(), "ss: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last()?.parse().ok())
        .collect()
}

// ---------------------------------------------------------------------------
// 1. Weighted spread and sticky keep-alive, in both modes.

/// Makes the LB namespace resolve every backend's MAC address (a
/// connection from the LB to each, as health checks do).
///
/// SNAT needs this (bug): while the LB has no neighbour entry for a
/// backend, the XDP program passes the rewritten packet to the kernel
/// (`pass_no_neigh`) for it to resolve the neighbour and forward, but an
/// SNAT packet's source is the LB's own address, so the kernel drops it as
/// a martian and never resolves the neighbour: the service stays a black
/// hole. See `snat_works_with_cold_neighbour_table`.
fn warm_neighbours(t: &Topology) {
    for n in 1..=t.backends.len() {
        let addr = SocketAddr::from((backend_ip(n), BACKEND_PORT));
        let r = in_netns(&t.lb, move || {
            xlb_tests::topology::http_get(addr, "/", Duration::from_secs(5))
        })
        .join()
        .unwrap();
        assert!(matches!(r, Ok((200, _))), "b{n} from the LB: {r:?}");
    }
}

fn spread_and_sticky(prefix: &str, mode: &str) {
    let mut t = Topology::new(prefix, 3);
    let agent = t.start_agent(&config(&[web(mode, &[(1, 1), (2, 2), (3, 3)], "")]));
    if mode == "snat" {
        warm_neighbours(&t);
    }

    let started = Instant::now();
    let mut conn = keepalive(&t);
    let sticky = conn.get().expect("first keep-alive request");
    let sticky_n: usize = sticky[1..].parse().expect("backend name");
    let local_port = conn.stream.local_addr().unwrap().port();

    // 600 short connections (3.4 standard deviations of a binomial share of
    // 1/2 are 7 points), with keep-alive requests in between.
    const N: usize = 600;
    let mut results = Vec::new();
    for _ in 0..30 {
        results.extend(requests(&t, N / 30));
        assert_sticky(&mut conn, &sticky, 2, "between short connections");
    }
    let counts = count(&results);
    eprintln!(
        "{mode}: {N} connections in {:?}: {counts:?}, keep-alive on {sticky}",
        started.elapsed()
    );
    for (n, weight) in [(1, 1.0), (2, 2.0), (3, 3.0)] {
        let got = counts.get(&backend_name(n)).copied().unwrap_or(0);
        let share = got as f64 * 100.0 / N as f64;
        let want = weight * 100.0 / 6.0;
        assert!(
            (share - want).abs() <= 7.0,
            "{mode}: b{n} (weight {weight}) got {share:.1}% of new connections, want {want:.1}% ± 7: {counts:?}"
        );
    }
    assert_eq!(counts.values().sum::<usize>(), N, "{counts:?}");

    // What the backend sees: the client (nat) or the SNAT address (snat).
    let peers = backend_peers(&t, sticky_n, BACKEND_PORT);
    let trace = t.lbctl_json(&[
        "trace",
        &CLIENT_IP.to_string(),
        &VIP.to_string(),
        &local_port.to_string(),
        "80",
        "tcp",
    ]);
    assert_eq!(
        trace["backend"].as_str(),
        Some(backend_addr(sticky_n).as_str()),
        "trace of the keep-alive flow: {trace}"
    );
    assert_eq!(trace["decided_by"], "conntrack", "{trace}");
    if mode == "nat" {
        assert!(
            peers.contains(&SocketAddr::from((CLIENT_IP, local_port))),
            "nat: b{sticky_n} should see the client {CLIENT_IP}:{local_port}, sees {peers:?}"
        );
    } else {
        let snat_port = trace["snat"]["port_in_use"]
            .as_u64()
            .unwrap_or_else(|| panic!("snat: no port in use in {trace}"));
        assert!(
            peers.contains(&SocketAddr::from((LB_CLIENT_SIDE, snat_port as u16))),
            "snat: b{sticky_n} should see {LB_CLIENT_SIDE}:{snat_port}, sees {peers:?}"
        );
        assert!(
            peers.iter().all(|p| p.ip() == LB_CLIENT_SIDE),
            "snat: b{sticky_n} sees a peer other than {LB_CLIENT_SIDE}: {peers:?}"
        );
    }

    assert_no_drops(&t, mode);

    let page = agent.metrics();
    assert_eq!(metric(&page, "xlb_agent_ready", ""), Some(1.0), "{page}");
    for n in 1..=3 {
        let packets = metric(&page, "xlb_backend_packets_total", &web_backend_labels(n));
        assert!(
            packets.is_some_and(|p| p > 0.0),
            "xlb_backend_packets_total for b{n}: {packets:?}\n{page}"
        );
    }
    let svc_labels = format!(r#"service="web",vip="{VIP}",port="80",protocol="tcp""#);
    let new_flows = metric(&page, "xlb_service_new_flows_total", &svc_labels);
    assert!(
        new_flows.is_some_and(|f| f >= (N + 1) as f64),
        "xlb_service_new_flows_total {new_flows:?} < {}",
        N + 1
    );
}

#[test]
fn nat_spreads_by_weight_and_keepalive_sticks() {
    spread_and_sticky("e2nat", "nat");
}

#[test]
fn snat_spreads_by_weight_and_keepalive_sticks() {
    spread_and_sticky("e2snat", "snat");
}

/// A fresh node (no neighbour entries for the backends) must forward SNAT
/// flows: the first connections (each gets two SYN retransmissions within
/// its 4 s) must be answered. Fails while the data plane hands an SNATed
/// packet without a neighbour entry to the kernel, which drops it
/// ("martian source 10.2.N.2 from 10.0.0.1, on dev lbc").
#[test]
fn snat_works_with_cold_neighbour_table() {
    let mut t = Topology::new("e2cold", 3);
    let _agent = t.start_agent(&config(&[web("snat", &[(1, 1), (2, 1), (3, 1)], "")]));
    let results = in_netns(&t.client, || {
        (0..3)
            .map(|_| {
                let mut s = TcpStream::connect_timeout(&vip(), Duration::from_secs(4))?;
                s.set_read_timeout(Some(Duration::from_secs(4)))?;
                s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
                let mut buf = String::new();
                s.read_to_string(&mut buf)?;
                Ok(buf.lines().last().unwrap_or_default().to_string())
            })
            .collect::<Vec<io::Result<String>>>()
    })
    .join()
    .unwrap();
    let stats = t.lbctl_json(&["stats"]);
    let failed = results.iter().filter(|r| r.is_err()).count();
    assert_eq!(
        failed, 0,
        "{failed} of 3 SNAT connections failed on a cold neighbour table: {results:?}\nlbctl stats: {stats}"
    );
}

// ---------------------------------------------------------------------------
// 2. Backends removed by a reload: file change, then SIGHUP.

#[test]
fn reload_removes_backend_and_keeps_established_flows() {
    let mut t = Topology::new("e2rl", 3);
    let all = [(1, 1), (2, 1), (3, 1)];
    let agent = t.start_agent(&config(&[web("nat", &all, "")]));

    // A long-lived connection on `keep`, and one on the backend removed first.
    let mut a = keepalive(&t);
    let keep_name = a.get().expect("first keep-alive request");
    let keep: usize = keep_name[1..].parse().unwrap();
    let others: Vec<usize> = (1..=3).filter(|&n| n != keep).collect();
    let (gone1, gone2) = (others[0], others[1]);
    let mut on_gone1 = keepalive_to(&t, gone1);
    // From every CPU, so that every CPU's flow table holds both flows (a CPU
    // that has not seen a flow picks its backend again, by the new table).
    assert_sticky(&mut a, &keep_name, 4, "before the reload");
    assert_sticky(&mut on_gone1, &backend_name(gone1), 4, "before the reload");

    // Remove `gone1` by rewriting the file (the agent polls it).
    let rest: Vec<(usize, u32)> = all.iter().copied().filter(|b| b.0 != gone1).collect();
    let started = Instant::now();
    agent.write_config(&config(&[web("nat", &rest, "")]));
    wait_until(
        &format!("b{gone1} out of the Maglev table"),
        Duration::from_secs(5),
        || (!table_backends(&t, SVC).contains(&backend_addr(gone1))).then_some(()),
    );
    let took = started.elapsed();
    agent.wait_for_log(
        r#"config reloaded reason="the file changed""#,
        1,
        Duration::from_secs(5),
    );
    let counts = count(&requests(&t, 100));
    eprintln!("file reload applied in {took:?}; 100 connections: {counts:?}");
    assert!(
        !counts.contains_key(&backend_name(gone1)),
        "b{gone1} removed, still got new connections: {counts:?}"
    );
    assert_sticky(&mut a, &keep_name, 5, "after removing b{gone1} (file)");
    // on_backend_removed: keep (the default): its established flow carries on.
    assert_sticky(
        &mut on_gone1,
        &backend_name(gone1),
        5,
        "removed backend, keep",
    );

    // Remove `gone2` too, by SIGHUP right after writing the file (the poll
    // would notice within 500 ms; SIGHUP is normally first).
    let started = Instant::now();
    agent.write_config(&config(&[web("nat", &[(keep, 1)], "")]));
    agent.sighup();
    wait_until(
        &format!("b{gone2} out of the Maglev table"),
        Duration::from_secs(5),
        || (table_backends(&t, SVC) == vec![backend_addr(keep)]).then_some(()),
    );
    let took = started.elapsed();
    let log = agent.wait_for_log(
        r#"config reloaded reason="SIGHUP""#,
        1,
        Duration::from_secs(5),
    );
    let counts = count(&requests(&t, 100));
    eprintln!("SIGHUP reload applied in {took:?}; 100 connections: {counts:?}");
    assert_eq!(
        counts,
        BTreeMap::from([(keep_name.clone(), 100)]),
        "only {keep_name} is left"
    );
    assert_sticky(&mut a, &keep_name, 5, "after removing b{gone2} (SIGHUP)");
    assert!(!log.contains("config rejected"), "{log}");
    assert_no_drops(&t, "reloads");
}

// ---------------------------------------------------------------------------
// 3. Health checks take a dead backend out.

#[test]
fn health_check_removes_killed_backend() {
    let mut t = Topology::new("e2hc", 3);
    let hc = "    health_check: { type: tcp, interval: 500ms, timeout: 300ms, rise: 2, fall: 2 }\n";
    let agent = t.start_agent(&config(&[web("nat", &[(1, 1), (2, 1), (3, 1)], hc)]));
    let counts = count(&requests(&t, 60));
    assert_eq!(counts.len(), 3, "all backends up: {counts:?}");

    let dead = backend_addr(2);
    t.kill_backend(2);
    let killed = Instant::now();
    wait_until(
        "b2 out of the Maglev table",
        Duration::from_secs(10),
        || (!table_backends(&t, SVC).contains(&dead)).then_some(()),
    );
    let took = killed.elapsed();
    eprintln!("killed backend out of the table after {took:?}");
    // fall × interval = 1 s, plus the agent's reconcile and the poll.
    assert!(
        took <= Duration::from_millis(2500),
        "b2 left the table {took:?} after its server was killed (fall 2 x 500ms)"
    );
    assert_eq!(table_backends(&t, SVC).len(), 2);

    let counts = count(&requests(&t, 100));
    assert!(!counts.contains_key("b2"), "{counts:?}");
    assert_eq!(counts.values().sum::<usize>(), 100);
    let log = agent.wait_for_log("backend is unhealthy", 1, Duration::from_secs(1));
    assert!(log.contains(&dead), "{log}");
    let page = agent.metrics();
    assert_eq!(metric(&page, "xlb_agent_ready", ""), Some(1.0));
    for n in [1, 3] {
        assert_eq!(
            metric(&page, "xlb_backend_healthy", &web_backend_labels(n)),
            Some(1.0),
            "{page}"
        );
    }
}

/// `lbctl backends` lists every backend with its state and open flows:
/// one drained to weight 0 still carrying a connection, and one its health
/// checks took out, beside those in the table.
#[test]
fn lbctl_backends_shows_every_state_and_open_flows() {
    let mut t = Topology::new("e2bs", 3);
    let hc = "    health_check: { type: tcp, interval: 500ms, timeout: 300ms, rise: 2, fall: 2 }\n";
    let agent = t.start_agent(&config(&[web("nat", &[(1, 1), (2, 1), (3, 1)], hc)]));
    let mut on_b1 = keepalive_to(&t, 1);
    assert_sticky(&mut on_b1, "b1", 2, "before the drain");

    agent.write_config(&config(&[web("nat", &[(1, 0), (2, 1), (3, 1)], hc)]));
    wait_until("b1 out of the Maglev table", Duration::from_secs(5), || {
        (!table_backends(&t, SVC).contains(&backend_addr(1))).then_some(())
    });
    t.kill_backend(3);
    wait_until(
        "b3 out of the Maglev table",
        Duration::from_secs(10),
        || (!table_backends(&t, SVC).contains(&backend_addr(3))).then_some(()),
    );

    // The service by its name, as the agent gives it.
    let v = t.lbctl_json_with(&agent, &["backends", "web"]);
    let rows: BTreeMap<String, &Value> = v["services"][0]["backends"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|b| (b["address"].as_str().unwrap().to_string(), b))
        .collect();
    let state = |n| rows.get(&backend_addr(n)).map(|b| b["state"].clone());
    assert_eq!(v["services"][0]["name"], "web", "{v}");
    assert_eq!(v["services"][0]["service"], SVC, "{v}");
    assert_eq!(state(1), Some(json!("draining")), "{v}");
    assert_eq!(state(2), Some(json!("active")), "{v}");
    assert_eq!(state(3), Some(json!("unhealthy")), "{v}");
    let b1 = rows[&backend_addr(1)];
    assert_eq!(b1["backend_id"], Value::Null, "out of the table: {v}");
    assert!(
        b1["open_flows"].as_u64().unwrap() >= 1,
        "the drained backend's connection is open: {v}"
    );
    assert!(rows[&backend_addr(2)]["backend_id"].is_u64(), "{v}");
    // Its connection goes on.
    assert_sticky(&mut on_b1, "b1", 2, "after the drain");
}

/// `xlb_backend_healthy` is documented as 1 or 0 by the backend's health
/// checks: a backend its checks took out must be reported with 0 (not
/// disappear from the metrics, which would leave no series to alert on).
#[test]
fn metrics_report_unhealthy_backend() {
    let mut t = Topology::new("e2uh", 3);
    let hc = "    health_check: { type: tcp, interval: 500ms, timeout: 300ms, rise: 2, fall: 2 }\n";
    let agent = t.start_agent(&config(&[web("nat", &[(1, 1), (2, 1), (3, 1)], hc)]));
    let page = agent.metrics();
    for n in 1..=3 {
        assert_eq!(
            metric(&page, "xlb_backend_healthy", &web_backend_labels(n)),
            Some(1.0),
            "{page}"
        );
    }
    t.kill_backend(2);
    agent.wait_for_log("backend is unhealthy", 1, Duration::from_secs(10));
    wait_until(
        "b2 out of the Maglev table",
        Duration::from_secs(10),
        || (!table_backends(&t, SVC).contains(&backend_addr(2))).then_some(()),
    );
    let page = agent.metrics();
    let series: Vec<&str> = page
        .lines()
        .filter(|l| l.starts_with("xlb_backend_healthy{"))
        .collect();
    assert_eq!(
        metric(&page, "xlb_backend_healthy", &web_backend_labels(2)),
        Some(0.0),
        "b2 failed its health checks; xlb_backend_healthy series: {series:#?}"
    );
    // The agent's version and its process.
    let version = format!(
        "xlb_build_info{{version=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION")
    );
    assert!(page.lines().any(|l| l == version), "no {version:?}");
    let rss = metric(&page, "process_resident_memory_bytes", "").unwrap_or(0.0);
    assert!(rss > 1e6, "process_resident_memory_bytes {rss}");

    // `backend_metrics: false` (a reload): the per-backend series go, the
    // per-service ones stay.
    let off = config(&[web("nat", &[(1, 1), (2, 1), (3, 1)], hc)]);
    agent.write_config(&format!("backend_metrics: false\n{off}"));
    wait_until("the backend series gone", Duration::from_secs(10), || {
        let page = agent.metrics();
        (!page.contains("\nxlb_backend_") && page.contains("\nxlb_service_packets_total{"))
            .then_some(())
    });
}

// ---------------------------------------------------------------------------
// 4. Agent restarts (SIGTERM, SIGKILL) do not disturb traffic.

/// A steady UDP stream from the client to 192.0.2.10:53: sequence-numbered
/// datagrams at `rate` per second until stopped (and at least `min`), and
/// their echoes counted.
struct UdpStream {
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    echoed: Arc<AtomicU64>,
    thread: JoinHandle<io::Result<UdpReport>>,
}

struct UdpReport {
    sent: u64,
    echoed: u64,
    /// Sequence numbers sent and not echoed, as inclusive ranges.
    missing: Vec<(u64, u64)>,
}

impl UdpStream {
    fn start(t: &Topology, rate: u64, min: u64) -> UdpStream {
        const MAX: usize = 1 << 20;
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let echoed = Arc::new(AtomicU64::new(0));
        let (stop_c, sent_c, echoed_c) = (stop.clone(), sent.clone(), echoed.clone());
        let thread = in_netns(&t.client, move || {
            let sock = UdpSocket::bind((CLIENT_IP, 0))?;
            sock.connect((VIP, 53))?;
            set_rcvbuf(&sock, 4 << 20);
            let rx = sock.try_clone()?;
            rx.set_read_timeout(Some(Duration::from_millis(100)))?;
            let done_sending = Arc::new(AtomicBool::new(false));
            let done = done_sending.clone();
            let sent_r = sent_c.clone();
            let receiver = std::thread::spawn(move || {
                let mut seen = vec![false; MAX];
                let mut unique = 0u64;
                let mut deadline = None;
                let mut buf = [0u8; 64];
                loop {
                    if let Ok(n) = rx.recv(&mut buf) {
                        if n >= 8 {
                            let seq = u64::from_be_bytes(buf[..8].try_into().unwrap()) as usize;
                            if seq < MAX && !seen[seq] {
                                seen[seq] = true;
                                unique += 1;
                                echoed_c.store(unique, Ordering::Relaxed);
                            }
                        }
                    }
                    // Late echoes: wait until all are in, at most 3 s.
                    if done.load(Ordering::Relaxed) {
                        let d = *deadline.get_or_insert(Instant::now() + Duration::from_secs(3));
                        if unique >= sent_r.load(Ordering::Relaxed) || Instant::now() > d {
                            return seen;
                        }
                    }
                }
            });
            let mut start = Instant::now();
            let mut i = 0u64;
            while !(stop_c.load(Ordering::Relaxed) && i >= min) && (i as usize) < MAX {
                // Paced: datagram i leaves at start + i / rate. After a stall
                // (a busy machine) the schedule moves on instead of bursting.
                let at = start + Duration::from_micros(i * 1_000_000 / rate);
                let now = Instant::now();
                if at > now {
                    std::thread::sleep(at - now);
                } else if now - at > Duration::from_millis(20) {
                    start += now - at;
                }
                let mut d = [0u8; 32];
                d[..8].copy_from_slice(&i.to_be_bytes());
                // A send error (an ICMP error reported on the socket) is a loss.
                let _ = sock.send(&d);
                i += 1;
                sent_c.store(i, Ordering::Relaxed);
            }
            done_sending.store(true, Ordering::Relaxed);
            let seen = receiver.join().expect("receiver");
            let mut missing: Vec<(u64, u64)> = Vec::new();
            for seq in 0..i {
                if !seen[seq as usize] {
                    match missing.last_mut() {
                        Some(r) if r.1 + 1 == seq => r.1 = seq,
                        _ => missing.push((seq, seq)),
                    }
                }
            }
            let echoed = seen.iter().filter(|&&s| s).count() as u64;
            Ok(UdpReport {
                sent: i,
                echoed,
                missing,
            })
        });
        UdpStream {
            stop,
            sent,
            echoed,
            thread,
        }
    }

    /// Stops sending, waits for the late echoes.
    fn finish(self) -> UdpReport {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .expect("UDP client thread")
            .expect("UDP client")
    }
}

/// `lbctl --watch`: under a steady stream of 500 UDP datagrams a second,
/// `services`, `backends` and `stats` print one JSON document per
/// interval, `--count` of them; from the second on they carry rates, and
/// the dns service's packets a second are the stream's (each datagram
/// crosses once each way: its echo is a reply packet).
#[test]
fn lbctl_watch_shows_rates_per_second() {
    let mut t = Topology::new("e2wt", 3);
    t.start_udp_echo(UDP_BACKEND_PORT);
    let _agent = t.start_agent(&config(&[dns("nat")]));
    let stream = UdpStream::start(&t, 500, 0);
    wait_until("UDP echoes flowing", Duration::from_secs(10), || {
        (stream.echoed.load(Ordering::Relaxed) >= 100).then_some(())
    });
    let watch = |args: &[&str]| -> Vec<serde_json::Value> {
        let out = std::process::Command::new(xlb_tests::topology::lbctl_bin())
            .arg("--pin-dir")
            .arg(&t.pin_dir)
            .args(["--json", "--watch", "1", "--count", "3"])
            .args(args)
            .output()
            .expect("run lbctl");
        assert!(out.status.success(), "lbctl {args:?}: {out:?}");
        let docs: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        assert_eq!(docs.len(), 3, "lbctl {args:?} --count 3: {docs:?}");
        docs
    };
    let near = |rate: &serde_json::Value, what: &str| {
        let r = rate.as_f64().unwrap_or_else(|| panic!("{what}: no rate"));
        assert!(
            (350.0..=650.0).contains(&r),
            "{what}: {r} a second, the stream sends 500"
        );
    };
    let services = watch(&["services"]);
    let dns_row = |doc: &serde_json::Value| doc["services"][0].clone();
    assert!(
        dns_row(&services[0]).get("rates").is_none(),
        "{}",
        services[0]
    );
    for doc in &services[1..] {
        let row = dns_row(doc);
        assert_eq!(row["service"], UDP_SVC, "{doc}");
        near(&row["rates"]["packets_per_second"], "service packets");
        near(
            &row["rates"]["reply_packets_per_second"],
            "service reply packets",
        );
    }
    let backends = watch(&["backends", UDP_SVC]);
    for doc in &backends[1..] {
        let sum: f64 = doc["services"][0]["backends"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["rates"]["packets_per_second"].as_f64().unwrap())
            .sum();
        near(&json!(sum), "backends' packets together");
    }
    let stats = watch(&["stats"]);
    for doc in &stats[1..] {
        // Datagrams and echoes, each forwarded: at least the stream's rate.
        let all = doc["packets_per_second"].as_f64().unwrap();
        assert!(all >= 700.0, "stats: {all} packets a second: {doc}");
    }
    stream.finish();
}

#[test]
fn agent_restart_and_kill_keep_flows() {
    let mut t = Topology::new("e2rs", 3);
    t.start_udp_echo(UDP_BACKEND_PORT);
    let cfg = config(&[web("nat", &[(1, 1), (2, 1), (3, 1)], ""), dns("nat")]);
    let mut agent = t.start_agent(&cfg);

    let mut conn = keepalive(&t);
    let name = conn.get().expect("first keep-alive request");
    let stream = UdpStream::start(&t, 2000, 5000);
    wait_until("UDP echoes flowing", Duration::from_secs(10), || {
        (stream.echoed.load(Ordering::Relaxed) >= 200).then_some(())
    });
    let started = Instant::now();
    // (event, datagrams sent by then), to place losses in the failure message.
    let mut marks = vec![("SIGTERM", stream.sent.load(Ordering::Relaxed))];

    // SIGTERM: clean exit, the program stays attached.
    let st = agent.sigterm_and_wait();
    assert!(
        st.success(),
        "lb-agent exited with {st} on SIGTERM:\n{}",
        agent.log()
    );
    assert!(agent.log().contains("stays attached"), "{}", agent.log());
    assert_sticky(&mut conn, &name, 3, "agent stopped (SIGTERM)");
    let stopped_at = stream.sent.load(Ordering::Relaxed);
    wait_until(
        "UDP echoes while no agent runs",
        Duration::from_secs(5),
        || (stream.echoed.load(Ordering::Relaxed) > stopped_at + 100).then_some(()),
    );
    marks.push(("start", stream.sent.load(Ordering::Relaxed)));
    let mut agent = t.start_agent(&cfg);
    marks.push(("ready", stream.sent.load(Ordering::Relaxed)));
    assert!(
        agent.log().contains("adopted the running data plane"),
        "{}",
        agent.log()
    );
    assert_sticky(&mut conn, &name, 3, "agent restarted after SIGTERM");

    // SIGKILL, then start again.
    marks.push(("SIGKILL", stream.sent.load(Ordering::Relaxed)));
    agent.sigkill();
    assert_sticky(&mut conn, &name, 3, "agent killed (SIGKILL)");
    marks.push(("start", stream.sent.load(Ordering::Relaxed)));
    let agent = t.start_agent(&cfg);
    marks.push(("ready", stream.sent.load(Ordering::Relaxed)));
    assert!(agent.log().contains("adopted the running data plane"));
    assert_sticky(&mut conn, &name, 3, "agent restarted after SIGKILL");
    let restarts = started.elapsed();

    let r = stream.finish();
    let lost = r.sent - r.echoed;
    eprintln!(
        "restarts took {restarts:?}; UDP: {} sent, {} echoed, {lost} lost ({:.3}%)",
        r.sent,
        r.echoed,
        lost as f64 * 100.0 / r.sent as f64
    );
    assert!(r.sent >= 5000);
    if lost * 1000 > r.sent {
        let svc = t.lbctl_json(&["services"]);
        let udp = svc["services"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["service"] == UDP_SVC)
            .cloned();
        panic!(
            "UDP lost {lost} of {} datagrams (> 0.1%) across the agent restarts \
             (restarts took {restarts:?}); missing sequence numbers {:?}{}; \
             datagrams sent at the events: {marks:?}; lbctl services (dns): {udp:?}",
            r.sent,
            &r.missing[..r.missing.len().min(20)],
            if r.missing.len() > 20 { " ..." } else { "" },
        );
    }
    // The UDP service kept its counters over the restarts, and new
    // connections still spread.
    let services = t.lbctl_json(&["services"]);
    let udp = services["services"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["service"] == UDP_SVC)
        .unwrap_or_else(|| panic!("{services}"));
    assert!(udp["packets"].as_u64().unwrap() >= r.sent, "{udp}");
    assert_eq!(count(&requests(&t, 60)).len(), 3);
    assert_no_drops(&t, "agent restarts");
}

// ---------------------------------------------------------------------------
// 5. Bad config files.

/// The 1-based number of the first line of `yaml` containing `needle`.
fn line_of(yaml: &str, needle: &str) -> usize {
    yaml.lines()
        .position(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("{needle:?} not in\n{yaml}"))
        + 1
}

/// (what, file, expected fragments of the error).
fn bad_configs() -> Vec<(&'static str, String, Vec<String>)> {
    let good = |b: &[(usize, u32)]| web("nat", b, "");
    let all = [(1, 1), (2, 1), (3, 1)];
    let syntax =
        config(&[good(&all)]).replace("    port: 80\n", "    port: 80\n   protocol tcp: :\n");
    let unknown = config(&[good(&all)]).replacen("weight: 1", "wieght: 1", 1);
    let address = config(&[good(&all)]).replacen("ip: 10.2.2.2", "ip: 10.2.2.x", 1);
    let duplicate = config(&[good(&all), good(&all).replace("name: web", "name: web2")]);
    let empty = config(&[good(&[])]).replace("    backends:\n", "    backends: []\n");
    vec![
        (
            "syntax error",
            syntax.clone(),
            vec![
                format!("line {}", line_of(&syntax, "protocol tcp")),
                "YAML syntax error".into(),
            ],
        ),
        (
            "unknown field",
            unknown.clone(),
            vec![
                format!("line {}", line_of(&unknown, "wieght")),
                "services[0].backends[0].wieght".into(),
                "unknown field".into(),
            ],
        ),
        (
            "bad address",
            address.clone(),
            vec![
                format!("line {}", line_of(&address, "10.2.2.x")),
                "services[0].backends[1].ip".into(),
                "10.2.2.x".into(),
            ],
        ),
        (
            "duplicate VIP",
            duplicate.clone(),
            vec![
                format!("line {}", line_of(&duplicate, "name: web2")),
                "services[1]".into(),
                "duplicate VIP 192.0.2.10:80/tcp".into(),
            ],
        ),
        (
            "zero backends",
            empty.clone(),
            vec![
                format!("line {}", line_of(&empty, "backends: []")),
                "services[0].backends".into(),
            ],
        ),
    ]
}

/// The agent is killed, an interface it was attached to is deleted and
/// created again (a rebuilt namespace, bond or VLAN, a reloaded driver): the
/// kernel severs the pinned link. The next agent replaces that link, says
/// so, keeps the maps (an established flow keeps its backend) and forwards
/// through the new interface.
#[test]
fn a_recreated_interface_gets_a_new_link_and_flows_stay() {
    let mut t = Topology::new("e2sv", 3);
    let cfg = config(&[web("nat", &[(1, 1), (2, 1), (3, 1)], "")]);
    let mut agent = t.start_agent(&cfg);
    let mut conn = keepalive_to(&t, 1);
    agent.sigkill();

    t.recreate_backend_link(3);
    let agent = t.start_agent(&cfg);
    assert!(
        agent
            .log()
            .contains("the pinned XDP link of lbb3 was severed"),
        "{}",
        agent.log()
    );
    assert!(
        agent
            .log()
            .contains("a veth: TCP packets its peer sends with TX checksum offload on"),
        "attaching to a veth warns about checksum offload:\n{}",
        agent.log()
    );
    assert_sticky(&mut conn, "b1", 3, "after the link was replaced");
    // b3's replies come back through the new lbb3: XDP must translate them.
    wait_until("all three backends answer", Duration::from_secs(10), || {
        (count(&requests(&t, 60)).len() == 3).then_some(())
    });
}

/// Under `ip netns exec`, which mounts a fresh /sys without bpffs, the agent
/// cannot pin its maps: it says so and names both ways out, instead of
/// "No such file or directory".
#[test]
fn a_missing_bpffs_is_explained() {
    let t = Topology::new("e2fs", 1);
    let cfg = t.dir.join("bpffs.yaml");
    std::fs::write(&cfg, config(&[web("nat", &[(1, 1)], "")])).unwrap();
    let out = Command::new("ip")
        .args(["netns", "exec", &t.lb.name])
        .arg(agent_bin())
        .arg("--config")
        .arg(&cfg)
        .arg("--pin-dir")
        .arg("/sys/fs/bpf/xlb-e2fs")
        .env("NO_COLOR", "1")
        .output()
        .expect("run lb-agent under ip netns exec");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "it started: {stderr}");
    for needle in [
        "/sys/fs/bpf/xlb-e2fs is not on a BPF filesystem (bpffs)",
        "mount -t bpf bpffs /sys/fs/bpf",
        "nsenter --net=/var/run/netns/NAME",
    ] {
        assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
    }
}

#[test]
fn bad_config_at_start_exits_with_the_line_and_field() {
    let dir = std::env::temp_dir().join("xlb-e2bad");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let pin_dir = std::path::PathBuf::from("/sys/fs/bpf/xlb-e2bad");
    let _ = std::fs::remove_dir_all(&pin_dir);
    for (i, (what, yaml, expect)) in bad_configs().into_iter().enumerate() {
        let path = dir.join(format!("bad{i}.yaml"));
        std::fs::write(&path, &yaml).unwrap();
        let out = Command::new(agent_bin())
            .arg("--config")
            .arg(&path)
            .arg("--pin-dir")
            .arg(&pin_dir)
            .env("NO_COLOR", "1")
            .output()
            .expect("run lb-agent");
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprintln!("{what}: {}", stderr.trim());
        assert!(
            !out.status.success(),
            "{what}: lb-agent started with:\n{yaml}"
        );
        for e in &expect {
            assert!(
                stderr.contains(e),
                "{what}: {e:?} not in {stderr:?}\nfile:\n{yaml}"
            );
        }
        assert!(
            !pin_dir.exists(),
            "{what}: lb-agent touched {}",
            pin_dir.display()
        );
        // --check agrees.
        let out = Command::new(agent_bin())
            .arg("--check")
            .arg(&path)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{what}: --check accepted it");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `lbctl services --json` without the traffic counters (late packets of
/// closed connections may still count).
fn programmed(t: &Topology) -> Value {
    let mut v = t.lbctl_json(&["services"]);
    for s in v["services"].as_array_mut().expect("services") {
        let o = s.as_object_mut().unwrap();
        for k in [
            "packets",
            "bytes",
            "new_flows",
            "reply_packets",
            "reply_bytes",
        ] {
            assert!(o.remove(k).is_some(), "no {k} in {o:?}");
        }
    }
    v
}

#[test]
fn bad_config_on_reload_changes_nothing() {
    let mut t = Topology::new("e2rj", 3);
    let all = [(1, 1), (2, 1), (3, 1)];
    let agent = t.start_agent(&config(&[web("nat", &all, "")]));
    assert_eq!(count(&requests(&t, 30)).len(), 3);

    let bad = bad_configs();
    for (i, (what, yaml, expect)) in bad.iter().enumerate() {
        let before = (programmed(&t), t.lbctl_json(&["maglev", SVC]));
        agent.write_config(yaml);
        let log = agent.wait_for_log("config rejected", i + 1, Duration::from_secs(5));
        let line = log
            .lines()
            .rfind(|l| l.contains("config rejected"))
            .unwrap();
        // The line numbers are those of the file as written (the metrics
        // address goes at its end).
        for e in expect {
            assert!(line.contains(e), "{what}: {e:?} not in {line:?}");
        }
        let after = (programmed(&t), t.lbctl_json(&["maglev", SVC]));
        assert_eq!(before, after, "{what}: the running state changed");
        let counts = count(&requests(&t, 30));
        assert_eq!(
            counts.len(),
            3,
            "{what}: traffic after the rejection: {counts:?}"
        );
    }
    let page = agent.metrics();
    assert_eq!(
        metric(&page, "xlb_config_reloads_total", r#"result="error""#),
        Some(bad.len() as f64),
        "{page}"
    );
    assert_eq!(metric(&page, "xlb_agent_ready", ""), Some(1.0));

    // A good file after the bad ones applies.
    agent.write_config(&config(&[web("nat", &[(1, 1), (3, 1)], "")]));
    wait_until("b2 removed by a good file", Duration::from_secs(5), || {
        (table_backends(&t, SVC) == vec![backend_addr(1), backend_addr(3)]).then_some(())
    });
}

// ---------------------------------------------------------------------------
// 6. lbctl agrees with the traffic.

#[test]
fn lbctl_counts_and_traces_match_traffic() {
    let mut t = Topology::new("e2ct", 3);
    let agent = t.start_agent(&config(&[web("nat", &[(1, 1), (2, 1), (3, 1)], "")]));
    let rows = backend_rows(&t, SVC);
    assert_eq!(rows.len(), 3, "{rows:?}");
    assert!(rows.values().all(|r| r["new_flows"] == 0), "{rows:?}");

    // One CPU for the client and the servers: the flow table (and so the
    // new-flow count) is per CPU, and a veth hands a packet to XDP on the
    // CPU that sent it, so this way every connection is one flow.
    let cpu = allowed_cpus()[0];
    t.pin_backends(&[cpu]);
    const N: usize = 150;
    let results = requests_on(&t, N, Some(cpu));
    let counts = count(&results);
    let rows = backend_rows(&t, SVC);
    for n in 1..=3 {
        let served = counts.get(&backend_name(n)).copied().unwrap_or(0) as u64;
        let row = &rows[&backend_addr(n)];
        // Exactly one new flow per connection: a packet the kernel sends from
        // a TCP timer on another CPU (a delayed ACK) finds the flow in the
        // table every CPU shares and is not counted again.
        let new_flows = row["new_flows"].as_u64().unwrap();
        assert_eq!(
            new_flows, served,
            "b{n} served {served} connections, lbctl counts {new_flows} new flows; lbctl backends: {row}"
        );
        assert!(row["packets"].as_u64().unwrap() >= 3 * served, "{row}");
        assert!(
            row["reply_packets"].as_u64().unwrap() >= 3 * served,
            "{row}"
        );
    }
    let svc = &t.lbctl_json(&["services"])["services"][0];
    assert_eq!(svc["new_flows"].as_u64(), Some(N as u64), "{svc}");

    // Metrics agree with lbctl.
    let page = agent.metrics();
    for n in 1..=3 {
        let served = counts.get(&backend_name(n)).copied().unwrap_or(0) as f64;
        assert_eq!(
            metric(&page, "xlb_backend_new_flows_total", &web_backend_labels(n)),
            Some(served),
            "{page}"
        );
    }

    // trace names the backend that answered, for closed flows and a live one.
    let trace = |port: u16| {
        t.lbctl_json(&[
            "trace",
            &CLIENT_IP.to_string(),
            &VIP.to_string(),
            &port.to_string(),
            "80",
            "tcp",
        ])
    };
    for (port, name) in results.iter().step_by(10) {
        let tr = trace(*port);
        let n: usize = name[1..].parse().unwrap();
        assert_eq!(
            tr["backend"].as_str(),
            Some(backend_addr(n).as_str()),
            "flow from port {port} was answered by {name}: {tr}"
        );
    }
    let mut c = keepalive(&t);
    let name = c.get().expect("first keep-alive request");
    let port = c.stream.local_addr().unwrap().port();
    let tr = trace(port);
    assert_eq!(tr["decided_by"], "conntrack", "{tr}");
    assert_eq!(
        tr["backend"].as_str(),
        Some(backend_addr(name[1..].parse().unwrap()).as_str()),
        "{tr}"
    );
    assert_no_drops(&t, "lbctl test traffic");
}

/// The Helm chart gives the agent only BPF, NET_ADMIN and PERFMON (no
/// SYS_ADMIN by default): with exactly those, it loads, attaches, pins and
/// forwards.
#[test]
fn agent_runs_with_only_the_charts_capabilities() {
    let mut t = Topology::new("caps", 3);
    // The agent turns accept_local on by itself (rtnetlink, NET_ADMIN): the
    // chart needs no privileged container for it.
    let ifaces = t.lb_interfaces();
    for iface in &ifaces {
        t.lb.run(&format!("sysctl -qw net.ipv4.conf.{iface}.accept_local=0"));
    }
    let agent = t.start_agent_wrapped(
        &[
            "setpriv",
            "--bounding-set",
            "-all,+bpf,+net_admin,+perfmon",
            "--",
        ],
        &config(&[web("snat", &[(1, 1), (2, 1), (3, 1)], "")]),
    );
    // The process really runs with that set and nothing more.
    let status = std::fs::read_to_string(format!("/proc/{}/status", agent.pid())).unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    const CAP_NET_ADMIN: u32 = 12;
    const CAP_PERFMON: u32 = 38;
    const CAP_BPF: u32 = 39;
    assert_eq!(
        eff,
        (1 << CAP_NET_ADMIN) | (1 << CAP_PERFMON) | (1 << CAP_BPF),
        "CapEff of the agent"
    );
    warm_neighbours(&t);
    let counts = count(&requests(&t, 60));
    assert_eq!(counts.len(), 3, "every backend answers: {counts:?}");
    assert!(
        !agent.log().contains("setting accept_local"),
        "{}",
        agent.log()
    );
    for iface in &ifaces {
        let out = t.output_in(
            &t.lb,
            "sysctl",
            &["-n", &format!("net.ipv4.conf.{iface}.accept_local")],
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "1",
            "accept_local on {iface}"
        );
    }
}

// ---------------------------------------------------------------------------
// Interfaces that come, go and change mode.

/// How XDP sits on `iface` in the LB namespace, as `ip link` shows it:
/// `xdp` (native), `xdpgeneric`, or None.
fn xdp_on(t: &Topology, iface: &str) -> Option<String> {
    let out = t.output_in(&t.lb, "ip", &["link", "show", "dev", iface]);
    assert!(out.status.success(), "ip link show {iface}");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .find(|w| w.starts_with("xdp"))
        .map(str::to_string)
}

/// The ifindexes `TX_PORTS` lets the program redirect to.
fn tx_ports(t: &Topology) -> Vec<u64> {
    let out = Command::new("bpftool")
        .args(["-j", "map", "dump", "pinned"])
        .arg(t.pin_dir.join("TX_PORTS"))
        .output()
        .expect("bpftool");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|e| match &e["key"] {
            Value::Number(n) => n.as_u64().unwrap(),
            // Without BTF: the key's bytes, little-endian, as "0x05".
            Value::Array(bytes) => bytes.iter().rev().fold(0, |acc, b| {
                acc << 8
                    | u64::from_str_radix(b.as_str().unwrap().trim_start_matches("0x"), 16).unwrap()
            }),
            other => panic!("TX_PORTS key {other}"),
        })
        .collect()
}

fn ifindex_in(t: &Topology, iface: &str) -> u64 {
    let out = t.output_in(&t.lb, "ip", &["-j", "link", "show", "dev", iface]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0]["ifindex"].as_u64().expect("an ifindex")
}

/// A Linux bridge cannot take native XDP: the agent attaches it in generic
/// mode and says so, instead of crash-looping, and does not redirect to it.
/// Interfaces removed from the file are detached on reload (link, pin and
/// redirects). `xdp_mode` changed by a reload or across a restart replaces
/// the pinned links of the other mode.
#[test]
fn interfaces_fall_back_are_detached_and_change_mode() {
    let mut t = Topology::new("e2if", 1);
    t.lb.run("ip link add xbr0 type bridge && ip link set xbr0 up");
    t.lb.run(
        "ip link add xve0 type veth peer name xve1 && ip link set xve0 up && ip link set xve1 up",
    );
    let cfg = |ifaces: &str, mode: &str| {
        format!(
            "interfaces: [lbc, lbb1{ifaces}]\nxdp_mode: {mode}\nsnat_ipv4: {LB_CLIENT_SIDE}\nservices:\n{}",
            web("nat", &[(1, 1)], "")
        )
    };
    let mut agent = t.start_agent(&cfg(", xbr0, xve0", "native"));
    assert!(
        agent.log().contains("xbr0 cannot take native XDP"),
        "{}",
        agent.log()
    );
    assert_eq!(xdp_on(&t, "xbr0").as_deref(), Some("xdpgeneric"));
    assert_eq!(xdp_on(&t, "xve0").as_deref(), Some("xdp"));
    assert_eq!(xdp_on(&t, "lbc").as_deref(), Some("xdp"));
    let (br, ve) = (ifindex_in(&t, "xbr0"), ifindex_in(&t, "xve0"));
    let ports = tx_ports(&t);
    assert!(!ports.contains(&br) && ports.contains(&ve), "{ports:?}");
    assert_eq!(count(&requests(&t, 10)).len(), 1);

    // Reload without them: detached, unpinned, no redirects to them.
    agent.write_config(&cfg("", "native"));
    agent.wait_for_log("no longer in interfaces", 2, Duration::from_secs(10));
    for iface in ["xbr0", "xve0"] {
        assert_eq!(xdp_on(&t, iface), None, "{iface}");
        assert!(!t.pin_dir.join(format!("link_{iface}")).exists(), "{iface}");
    }
    assert!(!tx_ports(&t).contains(&ve));

    // generic by reload: the native links are replaced.
    agent.write_config(&cfg("", "generic"));
    agent.wait_for_log("is configured: replacing it", 2, Duration::from_secs(10));
    for iface in ["lbc", "lbb1"] {
        assert_eq!(xdp_on(&t, iface).as_deref(), Some("xdpgeneric"), "{iface}");
    }
    assert_eq!(count(&requests(&t, 10)).len(), 1);

    // native again across a restart (an upgrade changing the value).
    agent.sigterm_and_wait();
    let agent = t.start_agent(&cfg("", "native"));
    assert_eq!(
        agent.log().matches("is configured: replacing it").count(),
        2,
        "{}",
        agent.log()
    );
    for iface in ["lbc", "lbb1"] {
        assert_eq!(xdp_on(&t, iface).as_deref(), Some("xdp"), "{iface}");
    }
    assert_eq!(count(&requests(&t, 10)).len(), 1);
}
