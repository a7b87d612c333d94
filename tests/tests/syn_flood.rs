//! A SYN flood through xlb while established connections carry data (needs
//! root). The flood is the forwarding benchmark's generator at its highest
//! rate (BPF_PROG_RUN live frames from the client's eth0: every frame a SYN
//! to the VIP from the next source port of a second client address); 50
//! keep-alive connections keep sending requests all through it. None of them
//! may be reset or stall, and the flood must show in the service's new-flow
//! count.

use std::{
    net::{Ipv4Addr, SocketAddr},
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use lb_agent::netif::ifindex;
use xlb_tests::{
    netns::Netns,
    packet::{Ipv4, PacketBuilder, Tcp},
    topology::{backend_ip, HttpConn, Topology, BACKEND_PORT, LB_CLIENT_SIDE, VIP},
    xdp::{generate_live, load_bench_programs},
};

const SVC: &str = "192.0.2.10:80/tcp";
/// The flood's source: an address on the client's link that no host owns, so
/// that its SYNs never share a tuple with the real client's connections.
const FLOOD_SRC: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 77);
/// Where the backends' SYN-ACKs to the flood go: a MAC nobody has, so the
/// client's interface discards them without work for its stack.
const NOBODY_MAC: &str = "02:00:00:00:00:77";
const CONNECTIONS: usize = 50;
const FLOOD_FOR: Duration = Duration::from_secs(4);

fn mac_bytes(text: &str) -> [u8; 6] {
    let mut mac = [0u8; 6];
    for (b, h) in mac.iter_mut().zip(text.trim().split(':')) {
        *b = u8::from_str_radix(h, 16).unwrap();
    }
    mac
}

fn mac_of(ns: &Netns, iface: &str) -> [u8; 6] {
    let out = std::process::Command::new("ip")
        .args(["-n", &ns.name, "-j", "link", "show", "dev", iface])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    mac_bytes(v[0]["address"].as_str().unwrap())
}

fn new_flows(t: &Topology) -> u64 {
    let v = t.lbctl_json(&["backends", SVC]);
    v["services"][0]["backends"]
        .as_array()
        .unwrap_or_else(|| panic!("lbctl backends: {v}"))
        .iter()
        .map(|b| b["new_flows"].as_u64().unwrap())
        .sum()
}

/// Runs the generator in the client namespace until `stop`; counts frames.
fn flood(t: &Topology, stop: Arc<AtomicBool>, sent: Arc<AtomicU64>) -> std::thread::JoinHandle<()> {
    let frame = PacketBuilder::new()
        .eth(mac_of(&t.client, "eth0"), mac_of(&t.lb, "lbc"))
        .ipv4(Ipv4::new(FLOOD_SRC, VIP))
        .tcp(Tcp::new(1024, 80).seq(1).flags(0x02).window(64240))
        .build();
    let client = t.client.name.clone();
    std::thread::spawn(move || {
        Netns::enter_by_name(&client);
        let mut ebpf = load_bench_programs().expect("load the generator (root needed)");
        let eth0 = ifindex("eth0").expect("eth0");
        while !stop.load(Ordering::Relaxed) {
            const BATCH: u32 = 100_000;
            generate_live(&mut ebpf, eth0, &frame, BATCH).expect("generate");
            sent.fetch_add(BATCH as u64, Ordering::Relaxed);
        }
    })
}

#[test]
fn a_syn_flood_resets_and_stalls_no_established_connection_needs_root() {
    let mut t = Topology::new("xfl", 3);
    let mut cfg = format!(
        "interfaces: [lbc, lbb1, lbb2, lbb3]\nsnat_ipv4: {LB_CLIENT_SIDE}\nservices:\n  - name: web\n    vip: {VIP}\n    port: 80\n    protocol: tcp\n    mode: nat\n    backends:\n"
    );
    for n in 1..=3 {
        cfg.push_str(&format!(
            "      - {{ ip: {}, port: {BACKEND_PORT} }}\n",
            backend_ip(n)
        ));
    }
    let _agent = t.start_agent(&cfg);
    t.lb.run(&format!(
        "ip neigh replace {FLOOD_SRC} lladdr {NOBODY_MAC} dev lbc nud permanent"
    ));
    let vip = SocketAddr::from((VIP, 80));
    let mut conns: Vec<HttpConn> = (0..CONNECTIONS)
        .map(|_| HttpConn::connect_in(&t.client, vip).expect("connect"))
        .collect();
    for c in &mut conns {
        c.stream
            .set_read_timeout(Some(Duration::from_secs(3)))
            .unwrap();
        c.get().expect("a request before the flood");
    }
    let flows_before = new_flows(&t);
    let lbc_before = lbc_rx(&t);

    let (stop, sent) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
    );
    let flooder = flood(&t, stop.clone(), sent.clone());
    // Requests on every connection, round after round, for as long as the
    // flood runs: each must be answered within the read timeout.
    let start = Instant::now();
    let mut rounds = 0;
    let mut failures = Vec::new();
    while start.elapsed() < FLOOD_FOR {
        for (i, c) in conns.iter_mut().enumerate() {
            if let Err(e) = c.get() {
                failures.push(format!("connection {i}, round {rounds}: {e}"));
            }
        }
        rounds += 1;
    }
    let during = sent.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    flooder.join().expect("flood thread");
    let sent = sent.load(Ordering::Relaxed);
    for (i, c) in conns.iter_mut().enumerate() {
        if let Err(e) = c.get() {
            failures.push(format!("connection {i}, after the flood: {e}"));
        }
    }
    assert!(failures.is_empty(), "failed requests: {failures:#?}");
    assert!(
        during >= 100_000,
        "the flood must run while the connections carry data ({during} SYNs by then)"
    );
    assert!(rounds >= 2, "{rounds} rounds of requests during the flood");
    // Every flood SYN that reaches xlb is a new flow (after the 64,512
    // ports wrap it replaces its own earlier flow, which counts again). The
    // generator outruns the LB's veth queue, which drops the excess before
    // XDP (counted in lbc's rx_dropped); what lbc received, less the
    // connections' own packets (at most 3 per request), must be counted.
    let (received, dropped) = {
        let (p, d) = lbc_rx(&t);
        (p - lbc_before.0, d - lbc_before.1)
    };
    let connection_packets = (rounds as u64 + 2) * CONNECTIONS as u64 * 3;
    let syns_seen = received.saturating_sub(connection_packets);
    assert!(
        syns_seen >= 100_000,
        "the flood reached xlb: {received} packets received, {dropped} dropped at the veth"
    );
    let counted = new_flows(&t) - flows_before;
    assert!(
        counted * 10 >= syns_seen * 9,
        "the flood is counted: {counted} new flows for at least {syns_seen} SYNs received"
    );
    eprintln!(
        "flood: {sent} SYNs sent in {:.1} s, {received} packets reached xlb ({dropped} dropped at the veth), \
         {counted} new flows counted; {rounds} rounds of {CONNECTIONS} requests, none failed",
        start.elapsed().as_secs_f64()
    );
}

/// Packets received and dropped on the LB's client-side interface.
fn lbc_rx(t: &Topology) -> (u64, u64) {
    let out = std::process::Command::new("ip")
        .args(["-n", &t.lb.name, "-s", "-j", "link", "show", "dev", "lbc"])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rx = &v[0]["stats64"]["rx"];
    (
        rx["packets"].as_u64().unwrap(),
        rx["dropped"].as_u64().unwrap(),
    )
}
