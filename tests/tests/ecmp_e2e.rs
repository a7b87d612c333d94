//! End to end: three `lb-agent` nodes announce one VIP through their own
//! BGP speaker to a BIRD router that spreads client flows over them by ECMP
//! (L4 hash). One test per speaker driver, with the same topology and
//! scenario: `gobgpd` (the GoBGP driver, as the Helm chart's sidecar runs
//! it; the agent adds the router as its peer), BIRD 2 and ExaBGP 4 (their
//! own configs hold the session to the router; the agent only feeds them
//! routes). See `xlb_tests::ecmp` for the layout. The three tests can run
//! concurrently (their names and addresses live in their own namespaces).
//!
//! Covered, in order, for every driver:
//! 1. the router's FIB has the VIP with the three nodes as next hops;
//! 2. 300 client connections (distinct source ports) all succeed, every
//!    flow is handled by exactly one node, and every node gets flows; the
//!    speaker holds the route (gobgpd's RIB, the node BIRD's static
//!    protocol; ExaBGP's API pipes belong to the agent, so there only the
//!    router's view and the agent's metric are checked);
//! 3. the nodes' Maglev tables are identical: `lbctl trace` names the same
//!    backend on every node, and a real connection is answered by it;
//! 4. SIGTERM on one agent withdraws its next hop (within the hold time,
//!    before the agent exits), and new flows avoid that node;
//! 5. a node dying with its speaker (agent and speaker SIGKILLed): its
//!    next hop leaves within the hold time + 2 s;
//! 6. starting the agents (and the speaker) again brings the next hops
//!    back (gobgpd: the agent adds its neighbour again; BIRD: announces the
//!    routes file the killed agent left; ExaBGP: restarts empty, the agent
//!    announces again); then a node that vanishes without closing its session (its
//!    port on the router's bridge goes down) is withdrawn by the router's
//!    hold timer (BIRD's own record says so; the FIB within twice the hold
//!    time plus 2 s, below any default hold time), and comes back with it;
//! 7. a service without usable backends (all weights 0) is withdrawn
//!    everywhere: the router has no route to the VIP.
//!
//! A fourth test runs the paper's topology: the nodes' gobgpd peer with a
//! GoBGP route reflector (dynamic neighbours, ADD-PATH towards the router),
//! and the router learns every node's path over its one session with it
//! (`ecmp_through_a_gobgp_route_reflector`).
//!
//! Needs root, bpffs at /sys/fs/bpf, nginx, ethtool, iproute2, `gobgpd` and
//! `gobgp` 3.x, BIRD 2 and ExaBGP 4.2. Every wait polls its condition with a deadline.
//!
//! Also: with sessions the agent writes for BIRD (`bgp.peers` with `bfd`),
//! a node silenced with its link up leaves the ECMP set by BFD.

use std::{
    collections::{BTreeMap, BTreeSet},
    ops::Range,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde_json::Value;
use xlb_tests::cluster::{Cluster, AGENT_NAMESPACE, API_HOST};
use xlb_tests::ecmp::{
    backend_ip, node_backend_ip, node_ip, node_of_hop, request_from, Driver, EcmpLab, Node,
    Topology, BACKENDS, BACKEND_PORT, CLIENT_IP, FLOW_SYNC_PORT, HOLD_TIME, NODES, ROUTER_IP,
    RR_IP, VIP,
};
use xlb_tests::topology::{agent_bin, in_netns, lbctl_bin, HttpConn};
use xlb_tests::traffic::poll_until;

const SVC: &str = "192.0.2.10:80/tcp";

/// Starts the agents of `nodes` (concurrently) with weight 1 everywhere,
/// and waits until they are ready.
fn start_agents(lab: &mut EcmpLab, nodes: &[usize]) {
    for &i in nodes {
        let c = lab.agent_config(i, 1);
        lab.node(i).spawn_agent(&c);
    }
    for &i in nodes {
        lab.node(i).wait_agent_ready();
    }
}

/// The IPv4 routes file the BIRD driver of node `i` writes.
fn bird_routes(lab: &EcmpLab, i: usize) -> String {
    let mut p = lab.nodes[i - 1].bird_routes_file().into_os_string();
    p.push("4");
    std::fs::read_to_string(p).unwrap_or_default()
}

/// Checks what node `i`'s speaker itself holds: the VIP via the node
/// (`announced`), or nothing. ExaBGP's API pipes belong to the agent (a
/// second reader would take its answers): nothing to check there.
fn check_speaker(lab: &EcmpLab, i: usize, announced: bool) {
    let node = &lab.nodes[i - 1];
    let vip = format!("{VIP}/32");
    match node.driver {
        Driver::GoBgp => {
            let rib = node.gobgp(&["global", "rib", "-a", "ipv4"]);
            if announced {
                assert!(
                    rib.contains(&vip) && rib.contains(&node.ip().to_string()),
                    "node {i}: gobgpd's RIB: {rib}"
                );
            } else {
                assert!(
                    !rib.contains(&VIP.to_string()),
                    "node {i}: gobgpd still has the VIP: {rib}"
                );
            }
        }
        Driver::Bird => {
            let shown = node.birdc(&["show", "route", "protocol", "xlb_vips4", "all"]);
            let file = bird_routes(lab, i);
            if announced {
                assert!(
                    shown.contains(&vip) && shown.contains(&format!("BGP.next_hop: {}", node.ip())),
                    "node {i}: BIRD's xlb_vips4: {shown}"
                );
                assert!(file.contains(&vip), "node {i}: routes file: {file:?}");
            } else {
                assert!(
                    !shown.contains(&vip),
                    "node {i}: BIRD's xlb_vips4 still has the VIP: {shown}"
                );
                assert!(!file.contains(&vip), "node {i}: routes file: {file:?}");
            }
        }
        Driver::Frr => {
            // bgpd's table: the VIP from the agent's `network`, via the node.
            let table = node.vtysh(&["show", "bgp", "ipv4", "unicast"]);
            let has = table
                .lines()
                .any(|l| l.contains(&vip) && l.contains(&node.ip().to_string()));
            assert_eq!(has, announced, "node {i}: bgpd's table:\n{table}");
        }
        Driver::ExaBgp => {}
    }
}

/// The backend name (`bN`) of a backend address `10.102.0.2N:8080`.
fn backend_name(addr: &str) -> String {
    (1..=BACKENDS)
        .find(|&n| addr == format!("{}:{BACKEND_PORT}", backend_ip(n)))
        .map(|n| format!("b{n}"))
        .unwrap_or_else(|| panic!("{addr:?} is no backend"))
}

/// Polls `f` every 20 ms until it returns `Some`, at most `timeout`;
/// returns the value and how long it took. `what` and `state` (called on
/// timeout) explain a failure.
fn wait_until<T>(
    what: &str,
    timeout: Duration,
    mut f: impl FnMut() -> Option<T>,
    state: impl FnOnce() -> String,
) -> (T, Duration) {
    let start = Instant::now();
    let v = poll_until(timeout, Duration::from_millis(20), || f().ok_or(()))
        .unwrap_or_else(|()| panic!("timed out after {timeout:?}: {what}\n{}", state()));
    (v, start.elapsed())
}

/// Waits (at most 5 s) until `node`'s `xlb_bgp_announced_prefixes` is `want`.
fn wait_announced_prefixes(node: &Node, want: u32) {
    wait_until(
        &format!("node {}: xlb_bgp_announced_prefixes {want}", node.index),
        Duration::from_secs(5),
        || {
            let page = node.get("/metrics").ok()?.1;
            (metric(&page, "xlb_bgp_announced_prefixes") == Some(f64::from(want))).then_some(())
        },
        || node.get("/metrics").map(|r| r.1).unwrap_or_default(),
    );
}

/// SIGTERM to node 1's agent; waits until the router's FIB has only nodes 2
/// and 3. Returns whether the agent was still running (draining) when its
/// next hop left, and how long that took.
fn sigterm_node_1(lab: &mut EcmpLab) -> (bool, Duration) {
    lab.node(1).sigterm_agent();
    let sent = Instant::now();
    loop {
        let running = lab.node(1).agent_running();
        if lab.router_next_hops() == EcmpLab::hops(&[2, 3]) {
            return (running, sent.elapsed());
        }
        assert!(
            sent.elapsed() < HOLD_TIME + Duration::from_secs(5),
            "SIGTERM on node 1: its next hop did not leave the router's FIB\n{}",
            fib_state(lab)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn fib_state(lab: &EcmpLab) -> String {
    format!(
        "router FIB: {:?}\nbirdc show protocols:\n{}",
        lab.router_route(),
        lab.birdc(&["show", "protocols"])
    )
}

/// Waits until the router's route to the VIP has exactly the next hops of
/// `nodes` (none: no route); returns how long it took.
fn wait_fib(lab: &EcmpLab, nodes: &[usize], timeout: Duration, what: &str) -> Duration {
    let want = EcmpLab::hops(nodes);
    let (_, took) = wait_until(
        &format!("{what}: router FIB next hops {want:?}"),
        timeout,
        || (lab.router_next_hops() == want).then_some(()),
        || fib_state(lab),
    );
    took
}

/// One connection per port of `ports`, one after another, from the client.
/// Every one must be answered. Returns port -> backend name.
fn requests(lab: &EcmpLab, ports: Range<u16>, when: &str) -> BTreeMap<u16, String> {
    let results = lab.in_client(move || {
        ports
            .map(|p| (p, request_from(p)))
            .collect::<Vec<(u16, std::io::Result<String>)>>()
    });
    let n = results.len();
    let failed: Vec<String> = results
        .iter()
        .filter_map(|(p, r)| r.as_ref().err().map(|e| format!("port {p}: {e}")))
        .collect();
    assert!(
        failed.is_empty(),
        "{when}: {} of {n} connections failed, e.g. {:?}\n{}",
        failed.len(),
        &failed[..failed.len().min(5)],
        fib_state(lab)
    );
    results.into_iter().map(|(p, r)| (p, r.unwrap())).collect()
}

/// For every client port in `ports`: the nodes whose connection table
/// holds that flow, each with its entry.
/// The nodes that opened each flow of `ports`, with their entry (flows
/// handed over by the flow exchange left out: [`flow_holders`] has them).
fn flow_owners(lab: &EcmpLab, ports: &BTreeSet<u16>) -> BTreeMap<u16, Vec<(usize, Value)>> {
    let mut owners = flow_holders(lab, ports);
    for held in owners.values_mut() {
        held.retain(|(_, e)| e["handed"] != true);
    }
    owners.retain(|_, held| !held.is_empty());
    owners
}

/// The nodes whose flow table has each flow of `ports`, with their entry.
fn flow_holders(lab: &EcmpLab, ports: &BTreeSet<u16>) -> BTreeMap<u16, Vec<(usize, Value)>> {
    let mut owners: BTreeMap<u16, Vec<(usize, Value)>> = BTreeMap::new();
    for node in &lab.nodes {
        let v = node.lbctl_json(&[
            "conntrack",
            "--service",
            SVC,
            "--client",
            &CLIENT_IP.to_string(),
        ]);
        let entries = v["entries"]
            .as_array()
            .unwrap_or_else(|| panic!("node {}: lbctl conntrack: {v}", node.index));
        let mut seen: BTreeSet<u16> = BTreeSet::new();
        for e in entries {
            let client: std::net::SocketAddr = e["client"].as_str().unwrap().parse().unwrap();
            let port = client.port();
            if ports.contains(&port) && seen.insert(port) {
                owners
                    .entry(port)
                    .or_default()
                    .push((node.index, e.clone()));
            }
        }
    }
    owners
}

/// Checks that every flow of `answers` was handled by exactly one node,
/// one of `serving`, which sent it to the backend that answered; returns
/// the flows per node.
///
/// A flow on two nodes means that its first packets were lost: the
/// client's TCP re-hashes a connection on a retransmission timeout
/// (`net.core.txrehash`), and over veths the router's ECMP uses that
/// socket hash, so the retransmitted SYN may take another next hop.
fn assert_flows_on(
    lab: &EcmpLab,
    answers: &BTreeMap<u16, String>,
    serving: &[usize],
    when: &str,
) -> BTreeMap<usize, usize> {
    let ports: BTreeSet<u16> = answers.keys().copied().collect();
    let owners = flow_owners(lab, &ports);
    let mut per_node: BTreeMap<usize, usize> = serving.iter().map(|&i| (i, 0)).collect();
    for (port, answered_by) in answers {
        let o = owners.get(port).cloned().unwrap_or_default();
        assert!(
            o.len() == 1,
            "{when}: the flow from port {port} is in the connection tables of {} nodes \
             (exactly one expected; on several, its first packets were lost and the \
             client's retransmission took another path): {o:?}\n{}",
            o.len(),
            fib_state(lab)
        );
        let (node, entry) = &o[0];
        let backend = backend_name(entry["backend"].as_str().unwrap());
        assert!(
            serving.contains(node),
            "{when}: the flow from port {port} reached node {node}, not one of {serving:?}"
        );
        assert_eq!(
            &backend, answered_by,
            "{when}: node {node} sent the flow from port {port} to {backend}, \
             but {answered_by} answered"
        );
        *per_node.get_mut(node).unwrap() += 1;
    }
    per_node
}

/// `lbctl services --json` on node `i`: the web service's
/// (packets, new_flows, reply_packets).
fn counters(lab: &EcmpLab, i: usize) -> (u64, u64, u64) {
    let v = lab.nodes[i - 1].lbctl_json(&["services"]);
    let s = v["services"]
        .as_array()
        .and_then(|a| a.iter().find(|s| s["service"] == SVC))
        .unwrap_or_else(|| panic!("node {i}: no {SVC} in {v}"));
    let get = |k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k} in {s}"));
    (get("packets"), get("new_flows"), get("reply_packets"))
}

/// `lbctl maglev` on node `i`: (backend address, entries), by address.
fn maglev_table(lab: &EcmpLab, i: usize) -> Vec<(String, u64)> {
    let v = lab.nodes[i - 1].lbctl_json(&["maglev", SVC]);
    let mut t: Vec<(String, u64)> = v["backends"]
        .as_array()
        .unwrap_or_else(|| panic!("node {i}: lbctl maglev: {v}"))
        .iter()
        .map(|b| {
            (
                b["address"].as_str().unwrap().to_string(),
                b["entries"].as_u64().unwrap(),
            )
        })
        .collect();
    t.sort();
    t
}

/// `lbctl trace` of the client's flow from `port` on node `i`.
fn trace(lab: &EcmpLab, i: usize, port: u16) -> Value {
    lab.nodes[i - 1].lbctl_json(&[
        "trace",
        &CLIENT_IP.to_string(),
        &VIP.to_string(),
        &port.to_string(),
        "80",
        "tcp",
    ])
}

/// The value of the sample `name` (no labels) in a Prometheus page.
fn metric(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .map(|v| v.trim().parse().expect("metric value"))
}

fn hops_of(lab: &EcmpLab) -> Vec<usize> {
    lab.router_next_hops()
        .into_iter()
        .map(|h| node_of_hop(h).unwrap_or_else(|| panic!("next hop {h} is no node")))
        .collect()
}

#[test]
fn ecmp_over_three_nodes_with_gobgp() {
    ecmp_over_three_nodes(Driver::GoBgp);
}

#[test]
fn ecmp_over_three_nodes_with_bird() {
    ecmp_over_three_nodes(Driver::Bird);
}

#[test]
fn ecmp_over_three_nodes_with_exabgp() {
    ecmp_over_three_nodes(Driver::ExaBgp);
}

#[test]
fn ecmp_over_three_nodes_with_frr() {
    ecmp_over_three_nodes(Driver::Frr);
}

fn ecmp_over_three_nodes(driver: Driver) {
    // Build the binaries (if the sources changed) before the clock starts.
    let _ = (agent_bin(), lbctl_bin());
    let t0 = Instant::now();
    let mut timings: Vec<(String, Duration)> = Vec::new();
    let mut mark = |what: &str, since: &mut Instant| {
        timings.push((what.to_string(), since.elapsed()));
        *since = Instant::now();
    };
    let mut phase = Instant::now();

    let mut lab = EcmpLab::start_with(driver);
    let speaker = driver.daemon();
    mark(&format!("topology, nginx, BIRD, {speaker}s"), &mut phase);
    start_agents(&mut lab, &[1, 2, 3]);
    mark("agents ready", &mut phase);

    // 1. Three next hops.
    let took = wait_fib(&lab, &[1, 2, 3], Duration::from_secs(30), "start");
    eprintln!(
        "router FIB after {took:?}:\n{}\n{}",
        lab.router_route(),
        lab.birdc(&["show", "route", "for", &VIP.to_string(), "all"])
    );
    for node in &lab.nodes {
        wait_announced_prefixes(node, 1);
        check_speaker(&lab, node.index, true);
    }
    mark("1. FIB has 3 next hops", &mut phase);
    lab.wait_start_pulls(&[1, 2, 3]);

    // 2. 300 connections, spread over the three nodes, each on one node.
    let answers = requests(&lab, 20000..20300, "three nodes");
    let per_node = assert_flows_on(&lab, &answers, &[1, 2, 3], "three nodes");
    let by_backend = answers.values().fold(BTreeMap::new(), |mut m, b| {
        *m.entry(b.clone()).or_insert(0) += 1;
        m
    });
    eprintln!("300 flows per node {per_node:?}, per backend {by_backend:?}");
    for i in 1..=NODES {
        // Expected 100 each; 30 is more than 8 standard deviations off.
        assert!(
            per_node[&i] >= 30,
            "node {i} got {} of 300 flows: {per_node:?} (ECMP not spreading?)\n{}",
            per_node[&i],
            fib_state(&lab)
        );
        let (packets, new_flows, replies) = counters(&lab, i);
        assert!(
            packets >= 3 * per_node[&i] as u64 && new_flows >= per_node[&i] as u64 && replies > 0,
            "node {i} handled {} flows, but lbctl services counts packets {packets}, \
             new_flows {new_flows}, reply_packets {replies}",
            per_node[&i]
        );
    }
    assert_eq!(by_backend.len(), BACKENDS, "{by_backend:?}");
    mark("2. 300 connections", &mut phase);

    // 3. Identical Maglev tables: same shares, and the same pick for flows
    // on every node, which a real connection then confirms.
    let table = maglev_table(&lab, 1);
    assert_eq!(table.len(), BACKENDS, "{table:?}");
    for i in 2..=NODES {
        assert_eq!(
            maglev_table(&lab, i),
            table,
            "node {i}'s Maglev table differs from node 1's"
        );
    }
    let fresh = 21000..21030u16;
    let mut picks = BTreeMap::new();
    for port in fresh.clone() {
        let traces: Vec<Value> = (1..=NODES).map(|i| trace(&lab, i, port)).collect();
        for (i, tr) in traces.iter().enumerate() {
            assert_eq!(tr["decided_by"], "maglev", "node {}: {tr}", i + 1);
        }
        let backends: Vec<&str> = traces
            .iter()
            .map(|t| t["backend"].as_str().unwrap_or("none"))
            .collect();
        assert!(
            backends.iter().all(|b| *b == backends[0]),
            "port {port}: the nodes pick different backends {backends:?}"
        );
        picks.insert(port, backend_name(backends[0]));
    }
    let answered = requests(&lab, fresh.clone(), "Maglev check");
    assert_eq!(
        answered, picks,
        "real connections vs the backends every node's lbctl trace named"
    );
    // And the flows of step 2 that a node handled: every node names the
    // backend that answered.
    for (port, name) in answers.iter().step_by(15) {
        for i in 1..=NODES {
            let tr = trace(&lab, i, *port);
            assert_eq!(
                tr["backend"].as_str().map(backend_name).as_deref(),
                Some(name.as_str()),
                "node {i}, flow from port {port} (answered by {name}): {tr}"
            );
        }
    }
    mark("3. Maglev identical", &mut phase);

    // 4. SIGTERM on node 1: withdrawn before the agent exits, within the
    // hold time; new flows avoid node 1.
    let sent = std::time::SystemTime::now();
    let (running_when_withdrawn, took) = sigterm_node_1(&mut lab);
    eprintln!("SIGTERM: next hop withdrawn after {took:?}");
    assert!(
        took < HOLD_TIME,
        "SIGTERM: node 1's next hop left after {took:?}, not within the hold time {HOLD_TIME:?}"
    );
    assert!(
        running_when_withdrawn,
        "node 1's agent exited before its next hop left the router's FIB \
         (withdraw, then drain_time, then exit); log:\n{}",
        lab.nodes[0].agent_log()
    );
    let st = lab.node(1).wait_agent_exit(Duration::from_secs(10));
    // From the agent's own last line, as the test's steps take their time.
    let exited_after = lab.nodes[0]
        .agent_logged_at("exiting")
        .and_then(|t| t.duration_since(sent).ok())
        .unwrap_or_else(|| {
            panic!(
                "node 1's agent logged no exit:\n{}",
                lab.nodes[0].agent_log()
            )
        });
    eprintln!("SIGTERM: node 1's agent exited after {exited_after:?}");
    assert!(st.success(), "node 1's agent exited with {st}");
    let log = lab.nodes[0].agent_log();
    assert!(log.contains("VIPs withdrawn; draining"), "{log}");
    assert!(
        exited_after >= Duration::from_secs(1),
        "node 1's agent exited {exited_after:?} after SIGTERM, before its drain_time (1s)"
    );
    assert!(
        exited_after < Duration::from_millis(2500),
        "node 1's agent exited {exited_after:?} after SIGTERM: its drain_time (1s) is \
         the only wait it should add (and the hand-offs around it)"
    );
    assert_eq!(hops_of(&lab), vec![2, 3]);
    let before = counters(&lab, 1);
    let answers = requests(&lab, 22000..22150, "node 1 stopped");
    let per_node = assert_flows_on(&lab, &answers, &[2, 3], "node 1 stopped");
    eprintln!("node 1 stopped: 150 flows per node {per_node:?}");
    assert!(per_node.values().all(|&n| n >= 15), "{per_node:?}");
    assert_eq!(
        counters(&lab, 1),
        before,
        "node 1's counters (packets, new_flows, reply_packets) moved after its withdrawal"
    );
    mark("4. SIGTERM node 1", &mut phase);

    // 5. Node 2 dies with its speaker: the session drops, the router
    // withdraws within the hold time (+2 s).
    lab.node(2).kill_agent();
    lab.node(2).kill_speaker();
    let took = wait_fib(
        &lab,
        &[3],
        HOLD_TIME + Duration::from_secs(2),
        &format!("{speaker} killed"),
    );
    eprintln!("{speaker} SIGKILL: next hop withdrawn after {took:?}");
    let answers = requests(&lab, 23000..23060, "node 1 stopped, node 2 dead");
    assert_flows_on(&lab, &answers, &[3], "node 1 stopped, node 2 dead");
    if driver == Driver::Bird {
        // The killed agent's routes file stays (BIRD reads it at start).
        let file = bird_routes(&lab, 2);
        assert!(file.contains(&format!("{VIP}/32")), "node 2: {file:?}");
    }
    mark(
        &format!("5. SIGKILL node 2 (agent + {speaker})"),
        &mut phase,
    );

    // 6. Both come back: node 1's agent (its speaker kept running), node 2's
    // speaker and agent. Both adopt their running data plane.
    let restarted = Instant::now();
    lab.node(2).start_speaker();
    start_agents(&mut lab, &[1, 2]);
    let took = wait_fib(&lab, &[1, 2, 3], Duration::from_secs(30), "restart");
    let took_total = restarted.elapsed();
    eprintln!("restart: 3 next hops {took:?} after the agents were ready, {took_total:?} after the restart began");
    for i in [1, 2] {
        let log = lab.nodes[i - 1].agent_log();
        assert!(
            log.contains("adopted the running data plane"),
            "node {i}: {log}"
        );
    }
    let log = lab.nodes[1].agent_log();
    match driver {
        // The restarted gobgpd came up empty: the agent added the router again.
        Driver::GoBgp => assert!(log.contains("gobgp: adding BGP neighbor"), "node 2: {log}"),
        // The restarted ExaBGP came up empty: the agent announced again.
        Driver::ExaBgp => assert!(log.contains("BGP routes updated"), "node 2: {log}"),
        // BIRD announced the routes file again by itself, bgpd the
        // config the agent saved.
        Driver::Bird | Driver::Frr => {}
    }
    for i in [1, 2] {
        check_speaker(&lab, i, true);
    }
    let answers = requests(&lab, 24000..24150, "all nodes back");
    let per_node = assert_flows_on(&lab, &answers, &[1, 2, 3], "all nodes back");
    eprintln!("all back: 150 flows per node {per_node:?}");
    assert!(per_node.values().all(|&n| n >= 10), "{per_node:?}");
    for i in 2..=NODES {
        assert_eq!(maglev_table(&lab, i), maglev_table(&lab, 1), "node {i}");
    }
    mark("6. restart", &mut phase);

    // 6b. Node 3 vanishes without closing its session (its port on the
    // router's bridge goes down; the node keeps its addresses and routes):
    // the router's hold timer withdraws it. BIRD fires it at most HOLD_TIME
    // after node 3's last keepalive (its RFC 4271 jitter only shortens it),
    // which leaves the BIRD loop, the table prune, the kernel export and
    // this poll 2 s under HOLD_TIME + 2 s: too little on two CPUs shared
    // with the whole suite. That the hold timer did it is read from BIRD
    // itself; the deadline only tells a 3 s hold time from any default
    // (the agent's 9 s, BIRD's 240 s).
    lab.router.run("ip link set n3 down");
    let took = wait_fib(
        &lab,
        &[1, 2],
        2 * HOLD_TIME + Duration::from_secs(2),
        "node 3 link down",
    );
    eprintln!("node 3 link down: next hop withdrawn after {took:?}");
    let n3 = lab.birdc(&["show", "protocols", "all", "n3"]);
    assert!(
        n3.contains("Hold timer expired"),
        "node 3 link down: the router's session n3 did not end by its hold timer:\n{n3}"
    );
    let answers = requests(&lab, 25000..25060, "node 3 unreachable");
    assert_flows_on(&lab, &answers, &[1, 2], "node 3 unreachable");
    lab.router.run("ip link set n3 up");
    let took = wait_fib(&lab, &[1, 2, 3], Duration::from_secs(60), "node 3 link up");
    eprintln!("node 3 link up: next hop back after {took:?}");
    let answers = requests(&lab, 26000..26060, "node 3 back");
    assert_flows_on(&lab, &answers, &[1, 2, 3], "node 3 back");
    mark("6b. node 3 link down/up", &mut phase);

    // 7. No backend with weight on any node: withdrawn everywhere.
    for i in 1..=NODES {
        let c = lab.agent_config(i, 0);
        lab.nodes[i - 1].write_config(&c);
    }
    let took = wait_fib(&lab, &[], Duration::from_secs(10), "all weights 0");
    eprintln!("all weights 0: route gone after {took:?}");
    assert_eq!(lab.router_route(), "", "the router still routes the VIP");
    for node in &lab.nodes {
        wait_announced_prefixes(node, 0);
        check_speaker(&lab, node.index, false);
    }
    mark("7. all weights 0", &mut phase);

    let total = t0.elapsed();
    eprintln!("timings ({speaker}):");
    for (what, d) in &timings {
        eprintln!("  {what:<40} {d:?}");
    }
    eprintln!("  total {total:?}");
    assert!(total < Duration::from_secs(90), "took {total:?}");
}

/// The paper's topology (IEICE 2019, Fig. 4, Appendix C): the nodes' gobgpd
/// (driven by the agent, as the Helm chart's sidecar) peer with a GoBGP
/// route reflector that knows them only as dynamic neighbours of a peer
/// group; the reflector sends every node's path to the router with
/// ADD-PATH, and the router's BIRD (`add paths rx`, `merge paths on`)
/// installs one ECMP route. Checked: one next hop per node over the single
/// router session; flows spread over the three nodes (per-node counters);
/// SIGTERM removes the node's next hop before the agent exits and no new
/// flow reaches it; SIGKILL of agent and gobgpd removes it within the hold
/// time; restarting brings both back.
#[test]
fn ecmp_through_a_gobgp_route_reflector() {
    let _ = (agent_bin(), lbctl_bin());
    let t0 = Instant::now();
    let mut lab = EcmpLab::start_with_topology(Driver::GoBgp, Topology::RouteReflector);
    start_agents(&mut lab, &[1, 2, 3]);

    // 1. One next hop per node, all learnt over the one session with the
    // reflector: BIRD holds three paths for the VIP from protocol `reflector`.
    let took = wait_fib(&lab, &[1, 2, 3], Duration::from_secs(30), "start");
    let shown = lab.birdc(&["show", "route", "for", &VIP.to_string(), "all"]);
    eprintln!(
        "router FIB after {took:?}:\n{}\n{shown}",
        lab.router_route()
    );
    assert_eq!(
        shown.matches("[reflector ").count(),
        NODES,
        "the router should hold one path per node from the reflector:\n{shown}"
    );
    for i in 1..=NODES {
        assert!(
            shown.contains(&format!("BGP.next_hop: {}", node_ip(i))),
            "node {i}'s path: {shown}"
        );
    }
    let protocols = lab.birdc(&["show", "protocols"]);
    assert!(
        protocols.lines().filter(|l| l.contains(" BGP ")).count() == 1,
        "the router has one BGP session, with the reflector: {protocols}"
    );
    // The reflector: the nodes are dynamic neighbours (no entry of their
    // own in its config), and it sends the router all three paths.
    lab.wait_sessions(&[1, 2, 3], Duration::from_secs(10));
    let rr_config = EcmpLab::rr_config();
    for i in 1..=NODES {
        assert!(!rr_config.contains(&node_ip(i).to_string()), "{rr_config}");
    }
    let adj_out = lab.rr_gobgp(&["neighbor", &ROUTER_IP.to_string(), "adj-out"]);
    assert_eq!(
        adj_out
            .lines()
            .filter(|l| l.contains(&format!("{VIP}/32")))
            .count(),
        NODES,
        "the reflector's adj-rib-out towards the router: {adj_out}"
    );
    for node in &lab.nodes {
        wait_until(
            &format!(
                "node {}: its session with the reflector in xlb_bgp_peer_up",
                node.index
            ),
            Duration::from_secs(10),
            || {
                let page = node.get("/metrics").ok()?.1;
                page.contains(&format!("xlb_bgp_peer_up{{peer=\"{RR_IP}\"}} 1"))
                    .then_some(())
            },
            || node.get("/metrics").map(|r| r.1).unwrap_or_default(),
        );
    }

    // 2. Flows from 300 client ports spread over the three nodes.
    let answers = requests(&lab, 30000..30300, "three nodes (RR)");
    let per_node = assert_flows_on(&lab, &answers, &[1, 2, 3], "three nodes (RR)");
    eprintln!("RR: 300 flows per node {per_node:?}");
    for i in 1..=NODES {
        assert!(per_node[&i] >= 30, "node {i}: {per_node:?}");
        let (packets, new_flows, replies) = counters(&lab, i);
        assert!(
            packets >= 3 * per_node[&i] as u64 && new_flows >= per_node[&i] as u64 && replies > 0,
            "node {i} handled {} flows, but lbctl services counts packets {packets}, \
             new_flows {new_flows}, reply_packets {replies}",
            per_node[&i]
        );
    }

    // 3. SIGTERM on node 1: the reflector withdraws its path, the router
    // drops the next hop while the agent still drains; no new flow reaches it.
    let (running_when_withdrawn, took) = sigterm_node_1(&mut lab);
    eprintln!("RR: SIGTERM, next hop withdrawn after {took:?}");
    assert!(took < HOLD_TIME, "SIGTERM: withdrawn after {took:?}");
    assert!(
        running_when_withdrawn,
        "node 1's agent exited before its withdrawal"
    );
    assert!(lab
        .node(1)
        .wait_agent_exit(Duration::from_secs(10))
        .success());
    let before = counters(&lab, 1);
    let answers = requests(&lab, 31000..31150, "node 1 stopped (RR)");
    let per_node = assert_flows_on(&lab, &answers, &[2, 3], "node 1 stopped (RR)");
    assert!(per_node.values().all(|&n| n >= 15), "{per_node:?}");
    assert_eq!(
        counters(&lab, 1),
        before,
        "node 1's counters moved after its withdrawal"
    );

    // 4. Node 2 dies with its gobgpd: the reflector loses the session at
    // once (the kernel closes it), or at the latest when its hold timer
    // expires, and withdraws the path.
    lab.node(2).kill_agent();
    lab.node(2).kill_speaker();
    let took = wait_fib(
        &lab,
        &[3],
        HOLD_TIME + Duration::from_secs(1),
        "node 2 killed (RR)",
    );
    eprintln!("RR: SIGKILL, next hop withdrawn after {took:?}");
    let answers = requests(&lab, 32000..32060, "node 2 killed (RR)");
    assert_flows_on(&lab, &answers, &[3], "node 2 killed (RR)");

    // 5. Both come back: node 1's agent, node 2's gobgpd and agent (which
    // adds the reflector as its neighbour again).
    lab.node(2).start_speaker();
    start_agents(&mut lab, &[1, 2]);
    let took = wait_fib(&lab, &[1, 2, 3], Duration::from_secs(30), "restart (RR)");
    eprintln!("RR: restart, 3 next hops {took:?} after the agents were ready");
    let answers = requests(&lab, 33000..33150, "all back (RR)");
    let per_node = assert_flows_on(&lab, &answers, &[1, 2, 3], "all back (RR)");
    assert!(per_node.values().all(|&n| n >= 10), "{per_node:?}");
    let total = t0.elapsed();
    eprintln!("route reflector test: {total:?}");
    assert!(total < Duration::from_secs(90), "took {total:?}");
}

/// A rolling restart of the three nodes' agents (SIGUSR2, then a new
/// agent), one after another, while 50 keep-alive connections spread over
/// the nodes carry requests and new connections keep coming: the routes
/// stay, no established connection is reset and no new one fails (snat
/// mode, which no other node could take over).
#[test]
fn a_rolling_restart_loses_no_connection_with_bird() {
    rolling_restart(Driver::Bird, "snat");
}

#[test]
fn a_rolling_restart_loses_no_connection_with_gobgp() {
    rolling_restart(Driver::GoBgp, "snat");
}

#[test]
fn a_rolling_restart_loses_no_connection_with_frr() {
    rolling_restart(Driver::Frr, "snat");
}

/// In nat mode the replies come back through any node (the backends route
/// the client over all three), so this also shows every node translating
/// replies of flows it did not forward.
#[test]
fn a_rolling_restart_loses_no_connection_in_nat_mode_with_bird() {
    rolling_restart(Driver::Bird, "nat");
}

#[test]
fn a_rolling_restart_loses_no_connection_in_nat_mode_with_gobgp() {
    rolling_restart(Driver::GoBgp, "nat");
}

/// Keep-alive connections the rollout tests hold (the figure).
const KEEP_ALIVE: usize = 50;

/// Starts the agents of all three nodes with the service in `mode`, and
/// opens [`KEEP_ALIVE`] keep-alive connections that reach every node.
fn lab_with_connections(driver: Driver, tag: char, mode: &str) -> (EcmpLab, Vec<HttpConn>) {
    with_connections(EcmpLab::start_tagged(driver, tag), mode)
}

/// [`lab_with_connections`] on a lab already started.
fn with_connections(lab: EcmpLab, mode: &str) -> (EcmpLab, Vec<HttpConn>) {
    with_connections_configured(lab, |lab, i| lab.agent_config_in(i, 1, mode))
}

/// [`with_connections`], node `i`'s agent config from `config`.
fn with_connections_configured(
    mut lab: EcmpLab,
    config: impl Fn(&EcmpLab, usize) -> String,
) -> (EcmpLab, Vec<HttpConn>) {
    for i in 1..=NODES {
        let c = config(&lab, i);
        lab.node(i).spawn_agent(&c);
    }
    for i in 1..=NODES {
        lab.node(i).wait_agent_ready();
    }
    wait_fib(&lab, &[1, 2, 3], Duration::from_secs(30), "start");
    let conns = open_keep_alive(&lab);
    let on: BTreeSet<usize> = flow_owners(&lab, &conn_ports(&conns))
        .values()
        .flat_map(|o| o.iter().map(|(n, _)| *n))
        .collect();
    assert_eq!(
        on.len(),
        NODES,
        "{KEEP_ALIVE} connections on the nodes {on:?}"
    );
    (lab, conns)
}

/// [`KEEP_ALIVE`] keep-alive connections to the VIP, each answered once.
fn open_keep_alive(lab: &EcmpLab) -> Vec<HttpConn> {
    let vip = std::net::SocketAddr::from((VIP, 80));
    let mut conns: Vec<HttpConn> = (0..KEEP_ALIVE)
        .map(|_| HttpConn::connect_in(&lab.client, vip).expect("keep-alive connection"))
        .collect();
    for c in &mut conns {
        c.get().expect("first request");
    }
    conns
}

fn conn_ports(conns: &[HttpConn]) -> BTreeSet<u16> {
    conns
        .iter()
        .map(|c| c.stream.local_addr().unwrap().port())
        .collect()
}

/// New connections from the client until `stop`, each from the next port
/// (below the ephemeral range the keep-alive connections took theirs
/// from); joins to (succeeded, failures).
fn new_connections(
    lab: &EcmpLab,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u32, Vec<String>)> {
    in_netns(&lab.client, move || {
        let (mut ok, mut failed) = (0u32, Vec::new());
        let mut port = 10000u16;
        while !stop.load(Ordering::Relaxed) {
            match request_from(port) {
                Ok(_) => ok += 1,
                Err(e) => failed.push(format!("port {port}: {e}")),
            }
            port = if port == 30000 { 10000 } else { port + 1 };
        }
        (ok, failed)
    })
}

/// One request on every keep-alive connection; each must be answered.
fn all_answer(conns: &mut [HttpConn], when: &str) {
    for (k, c) in conns.iter_mut().enumerate() {
        c.get()
            .unwrap_or_else(|e| panic!("connection {k} {when}: {e}"));
    }
}

/// Stops the stream of [`new_connections`]: none may have failed. Returns
/// how many were answered.
fn no_new_connection_failed(
    stop: Arc<AtomicBool>,
    fresh: std::thread::JoinHandle<(u32, Vec<String>)>,
    during: &str,
) -> u32 {
    stop.store(true, Ordering::Relaxed);
    let (ok, failed) = fresh.join().expect("new connections");
    assert!(
        failed.is_empty(),
        "{} of {} new connections failed {during}: {:?}",
        failed.len(),
        ok as usize + failed.len(),
        &failed[..failed.len().min(5)]
    );
    ok
}

fn rolling_restart(driver: Driver, mode: &str) {
    // Tagged: the three-node test of the same driver runs at the same time.
    let tag = if mode == "nat" { 'n' } else { 'k' };
    let (mut lab, mut conns) = lab_with_connections(driver, tag, mode);
    let stop = Arc::new(AtomicBool::new(false));
    let fresh = new_connections(&lab, stop.clone());

    for i in 1..=NODES {
        lab.node(i).signal_agent(libc::SIGUSR2);
        lab.node(i).wait_agent_exit(Duration::from_secs(5));
        assert_eq!(
            lab.router_next_hops(),
            EcmpLab::hops(&[1, 2, 3]),
            "node {i} restarting: its route must stay\n{}",
            fib_state(&lab)
        );
        all_answer(&mut conns, &format!("while node {i} restarts"));
        let config = lab.agent_config_in(i, 1, mode);
        lab.node(i).start_agent(&config);
        all_answer(&mut conns, &format!("after node {i} restarted"));
        assert_eq!(lab.router_next_hops(), EcmpLab::hops(&[1, 2, 3]));
    }
    let ok = no_new_connection_failed(stop, fresh, "during the rolling restart");
    assert!(
        ok >= 30,
        "only {ok} new connections during the rolling restart"
    );
}

/// A node that leaves for good (SIGTERM to an agent run from a file) and
/// comes back, in nat mode: it withdraws, the router moves its connections
/// to the other nodes, which pick the same backend (Maglev is the same
/// everywhere) and translate the replies. The agent exits when its drain
/// time (1 s) is over. With node 1 out, 50 more connections open; then node
/// 1 joins again and the router moves some of every connection's kind back
/// to it. No connection is reset and no new one fails.
#[test]
fn a_node_leaving_and_joining_keeps_its_connections_in_nat_mode_with_bird() {
    node_leaves_and_joins(Driver::Bird, "nat");
}

#[test]
fn a_node_leaving_and_joining_keeps_its_connections_in_nat_mode_with_gobgp() {
    node_leaves_and_joins(Driver::GoBgp, "nat");
}

#[test]
fn a_node_leaving_and_joining_keeps_its_connections_in_nat_mode_with_frr() {
    node_leaves_and_joins(Driver::Frr, "nat");
}

/// The same in snat mode, where the backends know each connection by the
/// SNAT address and port of the node that opened it: before it withdraws,
/// node 1 gives its flows to the others (`flow_sync:`), which translate them
/// as node 1 did; the backends' replies still go to node 1, whose data
/// plane keeps translating them after its agent is gone. A node that joins
/// takes the others' flows before it announces, so the connections opened
/// while it was out keep their SNAT source when the router moves them to it.
#[test]
fn a_node_leaving_and_joining_keeps_its_connections_in_snat_mode_with_bird() {
    node_leaves_and_joins(Driver::Bird, "snat");
}

#[test]
fn a_node_leaving_and_joining_keeps_its_connections_in_snat_mode_with_gobgp() {
    node_leaves_and_joins(Driver::GoBgp, "snat");
}

fn node_leaves_and_joins(driver: Driver, mode: &str) {
    let tag = if mode == "nat" { 'd' } else { 'h' };
    let (mut lab, mut conns) = lab_with_connections(driver, tag, mode);
    let on_node1: BTreeSet<u16> = flow_owners(&lab, &conn_ports(&conns))
        .into_iter()
        .filter(|(_, o)| o.iter().any(|(n, _)| *n == 1))
        .map(|(p, _)| p)
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let fresh = new_connections(&lab, stop.clone());

    let signalled = std::time::SystemTime::now();
    lab.node(1).sigterm_agent();
    wait_fib(&lab, &[2, 3], Duration::from_secs(10), "node 1 left");
    all_answer(&mut conns, "after node 1 left");
    let status = lab.node(1).wait_agent_exit(Duration::from_secs(10));
    // From the agent's own last line: the test's own steps above take
    // their time on a loaded machine, and would count too.
    let exited_after = lab.nodes[0]
        .agent_logged_at("exiting")
        .and_then(|t| t.duration_since(signalled).ok())
        .unwrap_or_else(|| {
            panic!(
                "node 1's agent logged no exit:\n{}",
                lab.nodes[0].agent_log()
            )
        });
    eprintln!("node 1's agent exited {exited_after:?} after SIGTERM");
    assert!(status.success(), "node 1's agent: {status}");
    // Its connections now live on the other nodes.
    let moved = flow_holders(&lab, &on_node1);
    for (port, owners) in &moved {
        assert!(
            owners.iter().any(|(n, _)| *n != 1),
            "connection from port {port} is on no other node: {owners:?}"
        );
    }
    all_answer(&mut conns, "after node 1 exited");
    assert!(!on_node1.is_empty(), "no connection went through node 1");
    // The drain (1 s), the hand-offs before and after it, and leaving the
    // flow exchange; seen at 1.3-1.4 s alone and 1.8 s with the whole
    // suite on two cores. What this catches is a wait that does not
    // belong: a resync interval (5 s), a hold time, a hang.
    assert!(
        exited_after < Duration::from_millis(2500),
        "the agent exited {exited_after:?} after SIGTERM with drain_time 1s"
    );

    let vip = std::net::SocketAddr::from((VIP, 80));
    let mut opened_while_out: Vec<HttpConn> = (0..KEEP_ALIVE)
        .map(|_| HttpConn::connect_in(&lab.client, vip).expect("keep-alive connection"))
        .collect();
    all_answer(&mut opened_while_out, "opened while node 1 was out");
    let config = lab.agent_config_in(1, 1, mode);
    lab.node(1).start_agent(&config);
    wait_fib(&lab, &[1, 2, 3], Duration::from_secs(30), "node 1 joined");
    all_answer(&mut conns, "after node 1 joined");
    all_answer(
        &mut opened_while_out,
        "after node 1 joined (opened while it was out)",
    );
    // In snat mode a connection the routers move between nodes before the
    // flow exchange has carried it is held, not reset, until it has
    // (`SERVICE_F_HOLD_UNKNOWN`): the client's retransmission goes through.
    no_new_connection_failed(stop, fresh, "while node 1 left and joined");
}

/// A reload gives the running flow exchange its new peers: node 1 starts
/// with node 2 as its only peer, so node 3 gets none of the flows node 1
/// opens; once node 1's config lists node 3 too (rewritten, and SIGHUP),
/// the flows it opens from then on reach node 3 as well. (A starting node
/// pulls every peer's flows, so the connections are opened once the
/// agents' start-up pulls are done.)
#[test]
fn a_reload_gives_the_flow_exchange_its_new_peers() {
    let node3 = format!(", {}:{FLOW_SYNC_PORT}", node_backend_ip(3));
    let lab = EcmpLab::start_tagged(Driver::Bird, 'p');
    let (mut lab, _) = with_connections_configured(lab, |lab, i| {
        let c = lab.agent_config_in(i, 1, "snat");
        if i == 1 {
            assert!(c.contains(&node3), "node 1 lists node 3: {c}");
            c.replace(&node3, "")
        } else {
            c
        }
    });
    let logged = |lab: &EcmpLab, node: usize, line: &str| {
        poll_until(Duration::from_secs(10), Duration::from_millis(50), || {
            lab.nodes[node - 1]
                .agent_log()
                .contains(line)
                .then_some(())
                .ok_or(())
        })
        .unwrap_or_else(|()| {
            panic!(
                "node {node} did not log {line:?}:\n{}",
                lab.nodes[node - 1].agent_log()
            )
        })
    };
    for node in 1..=NODES {
        logged(&lab, node, "flow exchange: the start's pulls are done");
    }
    // The flows of `conns` node 1 opened, and those of them `node` holds.
    let handed_to = |lab: &EcmpLab, conns: &[HttpConn], node: usize| {
        let opened: BTreeSet<u16> = flow_owners(lab, &conn_ports(conns))
            .into_iter()
            .filter(|(_, o)| o.iter().any(|(n, _)| *n == 1))
            .map(|(p, _)| p)
            .collect();
        let held: BTreeSet<u16> = flow_holders(lab, &opened)
            .into_iter()
            .filter(|(_, h)| h.iter().any(|(n, _)| *n == node))
            .map(|(p, _)| p)
            .collect();
        (opened, held)
    };
    let all_handed = |lab: &EcmpLab, conns: &[HttpConn], node: usize| {
        poll_until(Duration::from_secs(10), Duration::from_millis(100), || {
            let (opened, held) = handed_to(lab, conns, node);
            (!opened.is_empty() && opened == held)
                .then_some(())
                .ok_or(())
        })
        .unwrap_or_else(|()| {
            panic!(
                "node {node} does not hold node 1's flows (opened, held): {:?}",
                handed_to(lab, conns, node)
            )
        })
    };
    let before = open_keep_alive(&lab);
    all_handed(&lab, &before, 2);
    let (opened, on3) = handed_to(&lab, &before, 3);
    assert!(
        on3.is_empty(),
        "node 3 holds {on3:?} of node 1's flows {opened:?}, though not its peer"
    );

    let full = lab.agent_config_in(1, 1, "snat");
    lab.node(1).write_config(&full);
    lab.node(1).signal_agent(libc::SIGHUP);
    logged(&lab, 1, "flow exchange: peers reloaded");
    let after = open_keep_alive(&lab);
    all_handed(&lab, &after, 3);
}

/// The flow exchange's peers from the agents' Leases, on the real control
/// plane with the chart's RBAC: `flow_sync:` with neither `listen` nor
/// `peers`, each agent keeps a Lease `xlb-flows-<node>` naming the first
/// address of its first interface and takes the others' as its peers. A
/// node taken out (cordoned, then SIGTERM) hands its snat connections over
/// as with listed peers, and deletes its Lease.
#[test]
fn flow_sync_peers_come_from_the_agents_leases_on_the_real_control_plane() {
    let lab = EcmpLab::start_tagged(Driver::Bird, 'f');
    let mut cluster = Cluster::start(&format!("fsk{}", std::process::id() % 10000));
    cluster.install_chart_identity_with(&["--set", "config.flow_sync.key_file=/etc/xlb-flows/key"]);
    for i in 1..=NODES {
        cluster.add_node(&format!("n{i}"), "zone-a");
        cluster.reach_from(&lab.nodes[i - 1].ns);
        cluster.write_agent_kubeconfig(&lab.dir.join(format!("n{i}.kubeconfig")), API_HOST);
    }
    let (mut lab, mut conns) = with_connections_configured(lab, |lab, i| {
        let listed: String = lab
            .agent_config_in(i, 1, "snat")
            .lines()
            .filter(|l| !l.starts_with("  listen:") && !l.starts_with("  peers:"))
            .map(|l| format!("{l}\n"))
            .collect();
        format!(
            "{listed}kubernetes:\n  kubeconfig: {}\n  node_name: n{i}\n  allocate_addresses: false\n  lease_namespace: {AGENT_NAMESPACE}\n",
            lab.dir.join(format!("n{i}.kubeconfig")).display()
        )
    });
    let lease = |i: usize| cluster.get("lease", Some(AGENT_NAMESPACE), &format!("xlb-flows-n{i}"));
    for i in 1..=NODES {
        let l = lease(i).unwrap_or_else(|| panic!("node {i}'s flow exchange Lease"));
        assert_eq!(
            l["metadata"]["annotations"]["xlb.dev/flow-sync-address"],
            format!("{}:7947", node_ip(i)),
            "node {i} tells its uplink address"
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    let fresh = new_connections(&lab, stop.clone());
    cluster.patch(
        "node",
        None,
        "n1",
        &serde_json::json!({"spec": {"unschedulable": true}}),
        false,
    );
    poll_until(Duration::from_secs(20), Duration::from_millis(50), || {
        lab.node(1)
            .agent_log()
            .contains("this node is being taken out")
            .then_some(())
            .ok_or(())
    })
    .unwrap_or_else(|()| {
        panic!(
            "node 1 did not see its Node cordoned:\n{}",
            lab.node(1).agent_log()
        )
    });
    lab.node(1).sigterm_agent();
    wait_fib(&lab, &[2, 3], Duration::from_secs(10), "node 1 left");
    all_answer(&mut conns, "after node 1 left");
    let status = lab.node(1).wait_agent_exit(Duration::from_secs(10));
    assert!(status.success(), "node 1's agent: {status}");
    assert!(lease(1).is_none(), "node 1's Lease outlived its leaving");
    all_answer(&mut conns, "after node 1 exited");
    no_new_connection_failed(stop, fresh, "while node 1 left");
}

/// A node's agent and speaker restarting together, as the chart's Pod
/// does in a rollout (the speaker killed: a NOTIFICATION would end graceful
/// restart), one node after another, in snat mode: with BGP graceful
/// restart the router keeps the node's route while its speaker is down
/// (the node's data plane forwards on its own meanwhile) and takes the
/// restarted speaker's route in its place; no connection is reset and no
/// new one fails.
#[test]
fn a_speaker_restart_keeps_routes_and_connections_with_gobgp() {
    speaker_restart(Driver::GoBgp);
}

#[test]
fn a_speaker_restart_keeps_routes_and_connections_with_bird() {
    speaker_restart(Driver::Bird);
}

#[test]
fn a_speaker_restart_keeps_routes_and_connections_with_frr() {
    speaker_restart(Driver::Frr);
}

fn speaker_restart(driver: Driver) {
    let (mut lab, mut conns) = with_connections(EcmpLab::start_graceful(driver, 'g'), "snat");
    let stop = Arc::new(AtomicBool::new(false));
    let fresh = new_connections(&lab, stop.clone());
    for i in 1..=NODES {
        lab.node(i).signal_agent(libc::SIGUSR2);
        lab.node(i).wait_agent_exit(Duration::from_secs(5));
        lab.node(i).kill_speaker();
        wait_until(
            &format!("node {i}'s session down"),
            Duration::from_secs(10),
            || {
                (!lab
                    .birdc(&["show", "protocols", &format!("n{i}")])
                    .contains("Established"))
                .then_some(())
            },
            || fib_state(&lab),
        );
        assert_eq!(
            lab.router_next_hops(),
            EcmpLab::hops(&[1, 2, 3]),
            "node {i}'s speaker is down: the router must keep its route\n{}",
            fib_state(&lab)
        );
        all_answer(&mut conns, &format!("while node {i}'s speaker is down"));
        lab.node(i).start_speaker();
        let config = lab.agent_config_in(i, 1, "snat");
        lab.node(i).start_agent(&config);
        // Graceful restart ends with the restarted speaker's End-of-RIB:
        // the router then drops what it kept and was not announced again.
        lab.wait_graceful_restart_over(i, Duration::from_secs(20));
        // The router's kernel table follows its BGP table a moment later;
        // on a loaded machine the router has also been seen to drop the
        // stale route before the new session was up (BIRD as helper), so
        // the route must come back, not merely have stayed.
        wait_until(
            &format!("node {i} restarted: its route back in the router's FIB"),
            Duration::from_secs(10),
            || (lab.router_next_hops() == EcmpLab::hops(&[1, 2, 3])).then_some(()),
            || fib_state(&lab),
        );
        all_answer(&mut conns, &format!("after node {i} restarted"));
    }
    no_new_connection_failed(stop, fresh, "while the speakers restarted");
}

/// A node that leaves with `bgp.graceful_shutdown` (RFC 8326) first
/// announces its VIP again marked GRACEFUL_SHUTDOWN (65535:0); the router,
/// whose import filter honours the community as RFC 8326 asks, lowers that
/// path's LOCAL_PREF to 0, which takes it out of the ECMP set while it is
/// still announced. The withdrawal comes `graceful_shutdown` later. No
/// connection is reset and no new one fails. Per speaker: each carries the
/// community its own way.
#[test]
fn a_leaving_node_announces_graceful_shutdown_before_it_withdraws_with_gobgp() {
    graceful_shutdown(Driver::GoBgp);
}

#[test]
fn a_leaving_node_announces_graceful_shutdown_before_it_withdraws_with_bird() {
    graceful_shutdown(Driver::Bird);
}

#[test]
fn a_leaving_node_announces_graceful_shutdown_before_it_withdraws_with_exabgp() {
    graceful_shutdown(Driver::ExaBgp);
}

#[test]
fn a_leaving_node_announces_graceful_shutdown_before_it_withdraws_with_frr() {
    graceful_shutdown(Driver::Frr);
}

fn graceful_shutdown(driver: Driver) {
    const WAIT: Duration = Duration::from_secs(2);
    let mut lab = EcmpLab::start_tagged(driver, 'g');
    lab.graceful_shutdown = Some(WAIT);
    let (mut lab, mut conns) = with_connections(lab, "snat");
    let stop = Arc::new(AtomicBool::new(false));
    let fresh = new_connections(&lab, stop.clone());
    let signalled = std::time::Instant::now();
    lab.node(1).sigterm_agent();
    wait_fib(
        &lab,
        &[2, 3],
        Duration::from_secs(10),
        "node 1 shutting down",
    );
    let out_of_fib = signalled.elapsed();
    // Out of the ECMP set, and still announced: marked, and least preferred.
    let path = lab.router_path_from(1).unwrap_or_default();
    assert!(
        path.contains("BGP.community: (65535,0)") && path.contains("BGP.local_pref: 0"),
        "node 1's path once the router stopped using it ({out_of_fib:?} after SIGTERM):\n{path}\n{}",
        fib_state(&lab)
    );
    all_answer(&mut conns, "while node 1 shuts down gracefully");
    wait_until(
        "node 1's path withdrawn",
        Duration::from_secs(10),
        || lab.router_path_from(1).is_none().then_some(()),
        || fib_state(&lab),
    );
    let withdrawn = signalled.elapsed();
    assert!(
        withdrawn >= out_of_fib + WAIT / 2,
        "node 1 withdrew {withdrawn:?} after SIGTERM, {out_of_fib:?} after it left the ECMP set: \
         graceful_shutdown is {WAIT:?}"
    );
    let status = lab.node(1).wait_agent_exit(Duration::from_secs(10));
    assert!(status.success(), "node 1's agent: {status}");
    all_answer(&mut conns, "after node 1 left");
    no_new_connection_failed(stop, fresh, "while node 1 shut down gracefully");
}

/// The agent writes BIRD's sessions (`bgp.peers`) with BFD, and a node
/// that goes silent with its link up (the router's bridge drops its frames
/// both ways) leaves the router's ECMP set once BFD misses 3 packets of
/// 100 ms, far within the 3 s hold time that is all a session without BFD
/// has. When the node speaks again, its session and next hop come back.
/// The figures against the goal (under 500 ms) are the convergence
/// benchmark's (`--drivers bird-bfd`); the bound here only tells BFD from
/// the hold timer.
#[test]
fn a_silent_node_leaves_the_ecmp_set_by_bfd_with_sessions_the_agent_writes() {
    silent_node_leaves_by_bfd(Driver::Bird);
}

/// As above, the agent configuring FRR's bgpd and bfdd through vtysh.
#[test]
fn a_silent_node_leaves_the_ecmp_set_by_bfd_with_sessions_the_agent_writes_with_frr() {
    silent_node_leaves_by_bfd(Driver::Frr);
}

fn silent_node_leaves_by_bfd(driver: Driver) {
    let mut lab = EcmpLab::start_agent_sessions_with(driver, 'b', true);
    start_agents(&mut lab, &[1, 2, 3]);
    wait_fib(&lab, &[1, 2, 3], Duration::from_secs(20), "agents up");
    // The sessions are the agent's, with BFD.
    if driver == Driver::Bird {
        // BIRD has them from bird-peers.
        let peers = std::fs::read_to_string(lab.dir.join("n2/bird-peers")).unwrap();
        assert!(
            peers.contains("protocol bgp xlb_peer1")
                && peers.contains(&format!("neighbor {ROUTER_IP} as 65000"))
                && peers.contains(
                    "bfd { min rx interval 100 ms; min tx interval 100 ms; multiplier 3; }"
                ),
            "node 2's sessions file:\n{peers}"
        );
    } else {
        // FRR has them in its running config, marked as the agent's.
        let running = lab.nodes[1].vtysh(&["show", "running-config"]);
        for want in [
            format!("neighbor {ROUTER_IP} remote-as 65000"),
            format!("neighbor {ROUTER_IP} description xlb:"),
            format!("neighbor {ROUTER_IP} bfd profile xlb-bfd-3-100-100"),
            " profile xlb-bfd-3-100-100\n".to_string(),
        ] {
            assert!(
                running.contains(&want),
                "node 2's FRR lacks {want:?}:\n{running}"
            );
        }
    }
    wait_until(
        "three BFD sessions up at the router",
        Duration::from_secs(10),
        || {
            let s = lab.birdc(&["show", "bfd", "sessions"]);
            (s.matches(" Up ").count() == NODES).then_some(())
        },
        || lab.birdc(&["show", "bfd", "sessions"]),
    );
    // The agent reports the session it wrote (BIRD's `show protocols all`,
    // read at each resync).
    let up = format!("xlb_bgp_peer_up{{peer=\"{ROUTER_IP}\"}}");
    wait_until(
        "node 2 reporting its session up",
        Duration::from_secs(5),
        || {
            let (_, page) = lab.nodes[1].get("/metrics").ok()?;
            (metric(&page, &up) == Some(1.0)).then_some(())
        },
        || {
            lab.nodes[1]
                .get("/metrics")
                .map(|(_, p)| p)
                .unwrap_or_default()
        },
    );

    let silenced = std::time::Instant::now();
    lab.silence(2).unwrap();
    let took = wait_fib(&lab, &[1, 3], Duration::from_secs(10), "node 2 silent");
    assert!(
        took < HOLD_TIME / 2,
        "node 2 left the ECMP set {took:?} after it went silent: BFD should take ~300 ms, \
         the hold time is {HOLD_TIME:?}\n{}",
        lab.birdc(&["show", "bfd", "sessions"])
    );
    assert!(
        lab.router_path_from(2).is_none(),
        "the router still has node 2's path {:?} after it went silent",
        silenced.elapsed()
    );
    lab.unsilence(2).unwrap();
    wait_fib(
        &lab,
        &[1, 2, 3],
        Duration::from_secs(20),
        "node 2 speaking again",
    );
}

/// A node that leaves just after its session to the router came up still
/// withdraws. FRR 8.4 loses a withdrawal made within its subgroup coalesce
/// time (1 s) after a session is established: it showed the route as still
/// advertised with none in its table, and the router kept it (1 in 3 of
/// these stops before the driver set `coalesce-time 0`). Five fresh labs,
/// each stopped as soon as the router has all three nodes.
#[test]
fn a_node_leaving_as_its_session_comes_up_withdraws_with_frr() {
    for round in 1..=5 {
        let mut lab = EcmpLab::start_agent_sessions_with(Driver::Frr, 'w', false);
        start_agents(&mut lab, &[1, 2, 3]);
        wait_fib(&lab, &[1, 2, 3], Duration::from_secs(20), "agents up");
        lab.node(2).sigterm_agent();
        wait_until(
            &format!("round {round}: node 2 withdrawn"),
            Duration::from_secs(8),
            || (lab.router_next_hops() == EcmpLab::hops(&[1, 3])).then_some(()),
            || {
                format!(
                    "{}\nnode 2 advertises: {}",
                    fib_state(&lab),
                    lab.nodes[1].vtysh(&[
                        "show bgp ipv4 unicast neighbors",
                        &ROUTER_IP.to_string(),
                        "advertised-routes"
                    ])
                )
            },
        );
        let status = lab.node(2).wait_agent_exit(Duration::from_secs(10));
        assert!(status.success(), "round {round}: node 2's agent: {status}");
    }
}
