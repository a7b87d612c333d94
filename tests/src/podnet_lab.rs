//! Two Kubernetes-like nodes with their Pods behind a Linux bridge `cni0`
//! (the bridge CNI, flannel), for the pod-side interface tests
//! (tests/tests/podnet_e2e.rs) and the Pod egress benchmark
//! (`xlb-podnet-bench`, `cargo xtask bench podnet`):
//!
//! ```text
//!  <p>-c client            <p>-r router                  <p>-n1 node 1 (lb-agent)            <p>-p1, <p>-p2
//!  eth0 10.9.0.2 ──veth── rc 10.9.0.1 (tx off)
//!                         r1 10.0.0.254 ──veth──────── eth0 10.0.0.1 (uplink, XDP native)
//!                                                      cni0 10.244.1.1/24 (bridge, made later) ── vp1/vp2 ── eth0 10.244.1.2 / .3
//!                                                      flannel.1 (VXLAN over nn 10.0.9.1)
//!                         r2 10.0.1.254 ──veth──────── <p>-n2 node 2: eth0 10.0.1.1, cni0 10.244.2.1/24 ── vp3 ── <p>-p3 eth0 10.244.2.2
//! ```
//!
//! The router sends the VIPs (192.0.2.0/24) to node 1; each node's default
//! route is its own uplink, so a Pod of node 2 answers a client through
//! node 2, not the node that forwarded the request. The router's link to
//! the client has TX checksum offload off: a packet that reaches it with
//! an unfinished checksum (a Pod's, CHECKSUM_PARTIAL) is finished there in
//! software from what the packet holds, so a wrong pseudo-header sum
//! becomes a wrong checksum and the client drops the packet. Pods keep
//! their veths' offloads on (TSO and TX checksum offload, as a container
//! runtime leaves them).
//!
//! Every Pod serves HTTP on 8080 and 8081 (`GET /N` answers the Pod's name
//! padded to N bytes) and UDP echo (with its name) on 5353 and 5354.

use std::{
    io::{self, Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use crate::{
    netns::{sh, Netns},
    topology::{cleanup_pins, in_netns, spawn_agent_in, AgentHandle},
};

pub const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 2);
pub const HTTP_PORTS: [u16; 2] = [8080, 8081];
pub const UDP_PORTS: [u16; 2] = [5353, 5354];

/// What the agent logs when it attaches the program to the bridge `cni0`,
/// and when it detaches it (the lab's overlay `flannel.1` is attached too,
/// with lines of its own).
pub const ATTACHED: &str = "replies are translated there interface=cni0";
pub const DETACHED: &str = "no backend behind it) interface=cni0";
/// What it logs when it attaches the program to the overlay.
pub const ATTACHED_OVERLAY: &str = "replies are translated there interface=flannel.1";

/// Node `node`'s agent config: its uplink only, no pod-side interface
/// named (`pod_interfaces: auto`), and the services: TCP and UDP to
/// Pods 1 and 2 in snat and nat on 192.0.2.10 (80 and 53 snat, 81 and 54
/// nat), and `far-nat`, 192.0.2.11:80 to Pod 3 behind node 2 in nat.
pub fn config(node: usize) -> String {
    let mut s = format!(
        "interfaces: [eth0]\nsnat_ipv4: 10.0.{}.1\npod_interfaces: auto\nservices:\n",
        node - 1
    );
    let svc = |name: &str,
               vip: &str,
               port: u16,
               proto: &str,
               mode: &str,
               backends: &[(usize, u16)]| {
        let mut s = format!(
            "  - {{ name: {name}, vip: {vip}, port: {port}, protocol: {proto}, mode: {mode}, backends: ["
        );
        let list: Vec<String> = backends
            .iter()
            .map(|(n, p)| format!("{{ ip: {}, port: {p} }}", pod_ip(*n)))
            .collect();
        s.push_str(&list.join(", "));
        s.push_str("] }\n");
        s
    };
    s += &svc(
        "web-snat",
        "192.0.2.10",
        80,
        "tcp",
        "snat",
        &[(1, 8080), (2, 8080)],
    );
    s += &svc(
        "web-nat",
        "192.0.2.10",
        81,
        "tcp",
        "nat",
        &[(1, 8081), (2, 8081)],
    );
    s += &svc(
        "dns-snat",
        "192.0.2.10",
        53,
        "udp",
        "snat",
        &[(1, 5353), (2, 5353)],
    );
    s += &svc(
        "dns-nat",
        "192.0.2.10",
        54,
        "udp",
        "nat",
        &[(1, 5354), (2, 5354)],
    );
    s += &svc("far-nat", "192.0.2.11", 80, "tcp", "nat", &[(3, 8081)]);
    s
}

/// Pod `n` (1 and 2 on node 1, 3 on node 2).
pub fn pod_ip(n: usize) -> Ipv4Addr {
    match n {
        1 | 2 => Ipv4Addr::new(10, 244, 1, 1 + n as u8),
        _ => Ipv4Addr::new(10, 244, 2, 2),
    }
}

pub fn pod_name(n: usize) -> String {
    format!("p{n}")
}

pub struct PodLab {
    pub prefix: String,
    pub client: Netns,
    pub router: Netns,
    pub nodes: [Netns; 2],
    pub pods: Vec<Netns>,
    pub dir: PathBuf,
    servers: Vec<(Arc<AtomicBool>, JoinHandle<()>)>,
    agent_starts: usize,
}

impl PodLab {
    /// Everything but node 1's bridge (`add_bridge`): the client, the
    /// router, both nodes with their uplinks and VXLAN, node 2's bridge
    /// with Pod 3, and Pods 1 and 2 with their veths not yet on a bridge.
    pub fn new(prefix: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("xlb-{prefix}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let client = Netns::new(&format!("{prefix}-c"));
        let router = Netns::new(&format!("{prefix}-r"));
        let nodes = [
            Netns::new(&format!("{prefix}-n1")),
            Netns::new(&format!("{prefix}-n2")),
        ];
        let pods: Vec<Netns> = (1..=3)
            .map(|n| Netns::new(&format!("{prefix}-p{n}")))
            .collect();
        for n in [&router, &nodes[0], &nodes[1]] {
            n.run("sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0");
        }
        veth(&client, "eth0", &router, "rc");
        client.run("ip addr add 10.9.0.2/24 dev eth0 && ip link set eth0 up && ip route add default via 10.9.0.1 && ethtool -K eth0 tx off >/dev/null");
        router.run("ip addr add 10.9.0.1/24 dev rc && ip link set rc up && ethtool -K rc tx off >/dev/null");
        for (i, node) in nodes.iter().enumerate() {
            let r = format!("r{}", i + 1);
            veth(&router, &r, node, "eth0");
            router.run(&format!(
                "ip addr add 10.0.{i}.254/24 dev {r} && ip link set {r} up && ethtool -K {r} tx off gro on >/dev/null"
            ));
            node.run(&format!(
                "ip addr add 10.0.{i}.1/24 dev eth0 && ip link set eth0 up && ip route add default via 10.0.{i}.254 \
                 && ethtool -K eth0 gro on >/dev/null"
            ));
        }
        // The VIPs to node 1; each node's Pods reachable by their own
        // addresses (routed Pod networks, no masquerading).
        router.run(
            "ip route add 192.0.2.0/24 via 10.0.0.1 && ip route add 10.244.1.0/24 via 10.0.0.1 \
             && ip route add 10.244.2.0/24 via 10.0.1.1",
        );
        // The overlay: VXLAN between the nodes over a link of their own,
        // with flannel's routes (the other node's Pods via its VTEP).
        veth(&nodes[0], "nn", &nodes[1], "nn");
        let macs = ["02:00:00:00:09:01", "02:00:00:00:09:02"];
        for (i, node) in nodes.iter().enumerate() {
            let (me, peer) = (i + 1, 2 - i);
            node.run(&format!(
                "ip addr add 10.0.9.{me}/24 dev nn && ip link set nn up \
                 && ip link add flannel.1 address {mac} type vxlan id 1 local 10.0.9.{me} dev nn dstport 8472 nolearning \
                 && ip addr add 10.244.{me}.0/32 dev flannel.1 && ip link set flannel.1 up \
                 && ip route add 10.244.{peer}.0/24 via 10.244.{peer}.0 dev flannel.1 onlink \
                 && ip neigh add 10.244.{peer}.0 lladdr {pmac} dev flannel.1 nud permanent \
                 && bridge fdb append {pmac} dev flannel.1 dst 10.0.9.{peer}",
                mac = macs[i],
                pmac = macs[peer - 1],
            ));
        }
        for (n, pod) in pods.iter().enumerate().map(|(i, p)| (i + 1, p)) {
            let node = if n == 3 { &nodes[1] } else { &nodes[0] };
            veth(node, &format!("vp{n}"), pod, "eth0");
            let gw = if n == 3 { "10.244.2.1" } else { "10.244.1.1" };
            pod.run(&format!(
                "ip addr add {ip}/24 dev eth0 && ip link set eth0 up && ip route add default via {gw}",
                ip = pod_ip(n)
            ));
        }
        let mut lab = PodLab {
            prefix: prefix.to_string(),
            client,
            router,
            nodes,
            pods,
            dir,
            servers: Vec::new(),
            agent_starts: 0,
        };
        lab.bridge(2, "cni0", &[3]);
        for n in 1..=3 {
            lab.serve(n);
        }
        lab
    }

    /// Makes node `node`'s bridge `name` (10.244.<node>.1/24) with the
    /// veths of `pods` as its ports: what the bridge CNI does for the
    /// first Pod. Made again, it has the same MAC, so the Pods' neighbour
    /// entries for their gateway stay right.
    pub fn bridge(&self, node: usize, name: &str, pods: &[usize]) {
        let ns = &self.nodes[node - 1];
        ns.run(&format!(
            "ip link add {name} address 02:00:00:f4:00:0{node} type bridge && ip addr add 10.244.{node}.1/24 dev {name} && ip link set {name} up"
        ));
        for p in pods {
            ns.run(&format!(
                "ip link set vp{p} master {name} && ip link set vp{p} up"
            ));
        }
    }

    /// Deletes node `node`'s bridge (its ports stay, unbridged).
    pub fn delete_bridge(&self, node: usize, name: &str) {
        self.nodes[node - 1].run(&format!("ip link del {name}"));
    }

    /// Starts `lb-agent` on node `node` with `config_yaml`; waits until ready.
    pub fn start_agent(&mut self, node: usize, config_yaml: &str) -> AgentHandle {
        self.agent_starts += 1;
        let dir = self.dir.join(format!("n{node}"));
        std::fs::create_dir_all(&dir).unwrap();
        let pin_dir = self.pin_dir(node);
        cleanup_pins(&pin_dir);
        let mut a = spawn_agent_in(
            &self.nodes[node - 1].name,
            &dir,
            &pin_dir,
            self.agent_starts,
            &[],
            config_yaml,
        );
        a.wait_ready();
        a
    }

    /// Node `node`'s agent's pin directory.
    pub fn pin_dir(&self, node: usize) -> PathBuf {
        PathBuf::from(format!("/sys/fs/bpf/xlb-{}-n{node}", self.prefix))
    }

    /// Pod `n`'s servers: HTTP on [`HTTP_PORTS`], UDP echo on [`UDP_PORTS`].
    fn serve(&mut self, n: usize) {
        let name = pod_name(n);
        for port in HTTP_PORTS {
            let stop = Arc::new(AtomicBool::new(false));
            let (s, name) = (stop.clone(), name.clone());
            let (tx, rx) = std::sync::mpsc::channel();
            let t = in_netns(&self.pods[n - 1], move || {
                let l = TcpListener::bind((pod_ip(n), port)).expect("bind HTTP");
                l.set_nonblocking(true).unwrap();
                tx.send(()).unwrap();
                while !s.load(Ordering::Relaxed) {
                    match l.accept() {
                        Ok((c, _)) => {
                            let name = name.clone();
                            std::thread::spawn(move || {
                                let _ = answer_http(c, &name);
                            });
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            });
            rx.recv_timeout(Duration::from_secs(10)).unwrap();
            self.servers.push((stop, t));
        }
        for port in UDP_PORTS {
            let stop = Arc::new(AtomicBool::new(false));
            let (s, name) = (stop.clone(), name.clone());
            let (tx, rx) = std::sync::mpsc::channel();
            let t = in_netns(&self.pods[n - 1], move || {
                let sock = UdpSocket::bind((pod_ip(n), port)).expect("bind UDP");
                sock.set_read_timeout(Some(Duration::from_millis(100)))
                    .unwrap();
                tx.send(()).unwrap();
                let mut buf = [0u8; 2048];
                while !s.load(Ordering::Relaxed) {
                    if let Ok((len, from)) = sock.recv_from(&mut buf) {
                        let mut out = name.as_bytes().to_vec();
                        out.push(b':');
                        out.extend_from_slice(&buf[..len]);
                        let _ = sock.send_to(&out, from);
                    }
                }
            });
            rx.recv_timeout(Duration::from_secs(10)).unwrap();
            self.servers.push((stop, t));
        }
    }
}

impl Drop for PodLab {
    fn drop(&mut self) {
        for (stop, _) in &self.servers {
            stop.store(true, Ordering::Relaxed);
        }
        for (_, t) in self.servers.drain(..) {
            let _ = t.join();
        }
        for node in 1..=2 {
            cleanup_pins(&self.pin_dir(node));
        }
        // A failed test keeps its logs; a passed one leaves nothing in /tmp.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn veth(a: &Netns, a_name: &str, b: &Netns, b_name: &str) {
    sh(&format!(
        "ip link add {a_name} netns {} type veth peer name {b_name} netns {}",
        a.name, b.name
    ));
}

/// One HTTP/1.1 exchange: `GET /N` is answered with `name`, padded with
/// dots to N bytes (at least the name), and the connection closed.
fn answer_http(mut c: TcpStream, name: &str) -> io::Result<()> {
    c.set_nonblocking(false)?;
    c.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut req = Vec::new();
    let mut buf = [0u8; 1024];
    while !req.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = c.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        req.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&req);
    let size: usize = text
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.trim_start_matches('/').parse().ok())
        .unwrap_or(0);
    let mut body = name.as_bytes().to_vec();
    body.resize(size.max(body.len()), b'.');
    write!(
        c,
        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )?;
    c.write_all(&body)
}

/// `GET /size` to `addr` on a new connection; the body (name and padding).
pub fn http_get(addr: SocketAddr, size: usize) -> io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET /{size} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    match text.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok(body.to_string()),
        _ => Err(io::Error::other(format!("bad response {text:?}"))),
    }
}

/// One UDP datagram to `addr` and its echo (`name:payload`).
pub fn udp_echo(addr: SocketAddr, payload: &str) -> io::Result<String> {
    let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    s.connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.send(payload.as_bytes())?;
    let mut buf = [0u8; 2048];
    let n = s.recv(&mut buf)?;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Whether `dir` holds the pinned XDP link of `iface`.
pub fn pinned_link(dir: &Path, iface: &str) -> bool {
    // bpffs takes no dots: the agent pins `flannel.1` as `link_flannel:1`.
    dir.join(format!("link_{}", iface.replace('.', ":")))
        .exists()
}
