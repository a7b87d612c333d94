//! The L2 topology: a switch (a bridge in its own namespace) with a client,
//! three xlb nodes and a backend on one segment, and no router.
//!
//! ```text
//!  <p>-sw  switch      br0 (ports c, n1, n2, n3, b; no multicast snooping)
//!  <p>-c   client      eth0 10.9.0.100/24, fd00:9::100/64
//!  <p>-nI  node I=1..3 lan 10.9.0.1I/24, fd00:9::1I/64, MAC 02:00:00:00:09:0I
//!                      (XDP; lb-agent in L2 mode, membership on 10.9.0.1I:7946)
//!  <p>-b   backend     eth0 10.9.0.201/24, fd00:9::201/64, nginx on 8080 ("b1")
//! ```
//!
//! The VIPs (10.9.0.50-55, fd00:9::50) are on the segment's subnet, so the
//! client asks for them by ARP/NDP and sends to whichever MAC answered. The
//! nodes forward in snat mode, out of the interface the packet came in on.
//! The switch floods unknown unicast to the nodes too (veth hands it to
//! XDP as a promiscuous NIC would). The switch ports of the nodes have GRO on (XDP_TX into a veth needs it);
//! client and backend have TX checksum offload off (XDP cannot complete
//! partial checksums).

pub use crate::traffic::ConnectionStream;
use std::{
    collections::{BTreeMap, BTreeSet},
    fs, io,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    process::Child,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::{
    ecmp::{kill_child, spawn_agent_in, spawn_in},
    netns::Netns,
    topology::{cleanup_pins, http_get, in_netns, strip_ansi, write_atomic},
    traffic::poll_until,
};

pub const CLIENT_V4: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 100);
pub const CLIENT_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 9, 0, 0, 0, 0, 0, 0x100);
pub const BACKEND_V4: Ipv4Addr = Ipv4Addr::new(10, 9, 0, 201);
pub const BACKEND_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 9, 0, 0, 0, 0, 0, 0x201);
/// The first VIP; `vip(k)` for the others.
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 9, 0, 0, 0, 0, 0, 0x50);
pub const VIPS: usize = 6;
pub const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 9, 0x64];
/// UDP port of the echo service on the first VIP (the backend echoes).
pub const ECHO_PORT: u16 = 9000;
const METRICS_PORT: u16 = 9469;

/// Runs the calling thread under SCHED_FIFO, so that a timing stream
/// (the failover benchmark's sender, receiver and echo) is not delayed by
/// the agents and the kernel's other work on this small machine: its gaps
/// then show the failover, not the scheduler. Best effort.
pub fn realtime_priority() {
    let param = libc::sched_param { sched_priority: 10 };
    // SAFETY: a valid sched_param for the calling thread (pid 0).
    unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
}

/// VIP `k` (0-based): 10.9.0.50 + k.
pub fn vip(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 9, 0, 50 + k as u8)
}

pub fn node_v4(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 9, 0, 10 + i as u8)
}

pub fn node_mac(i: usize) -> [u8; 6] {
    [2, 0, 0, 0, 9, i as u8]
}

/// The node (1-based) a MAC belongs to.
pub fn node_of(mac: [u8; 6]) -> Option<usize> {
    (1..=3).find(|i| node_mac(*i) == mac)
}

pub struct L2Node {
    pub index: usize,
    pub ns: Netns,
    pub pin_dir: PathBuf,
    config_path: PathBuf,
    log_path: PathBuf,
    agent: Option<Child>,
}

impl L2Node {
    pub fn agent_pid(&self) -> i32 {
        self.agent.as_ref().expect("agent running").id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child.
        let rc = unsafe { libc::kill(self.agent_pid(), sig) };
        assert_eq!(rc, 0, "kill: {}", io::Error::last_os_error());
    }

    pub fn kill_agent(&mut self) {
        kill_child(&mut self.agent);
    }

    /// SIGTERM, and wait (at most `timeout`) for the exit.
    pub fn stop_agent(&mut self, timeout: Duration) {
        self.signal(libc::SIGTERM);
        let child = self.agent.as_mut().expect("agent");
        poll_until(timeout, Duration::from_millis(10), || {
            child.try_wait().expect("wait").ok_or(())
        })
        .unwrap_or_else(|()| panic!("node {}: no exit within {timeout:?}", self.index));
        self.agent = None;
    }

    pub fn log(&self) -> String {
        strip_ansi(&fs::read_to_string(&self.log_path).unwrap_or_default())
    }

    pub fn metrics(&self) -> String {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, METRICS_PORT));
        in_netns(&self.ns, move || {
            http_get(addr, "/metrics", Duration::from_secs(5))
        })
        .join()
        .expect("metrics thread")
        .map(|(_, body)| body)
        .unwrap_or_default()
    }

    /// A metric's value (the first line starting with `series`).
    pub fn metric(&self, series: &str) -> Option<f64> {
        self.metrics()
            .lines()
            .find(|l| l.starts_with(series))
            .and_then(|l| l.rsplit(' ').next()?.parse().ok())
    }

    pub fn lbctl_json(&self, args: &[&str]) -> serde_json::Value {
        crate::topology::lbctl_json_in(None, &self.pin_dir, args).1
    }

    /// `lbctl --json ARGS` in the node's network namespace, where the
    /// agent's metrics address (lbctl's default, 127.0.0.1:9469) is: its
    /// exit code and output.
    pub fn lbctl_with_agent(&self, args: &[&str]) -> (i32, serde_json::Value) {
        crate::topology::lbctl_json_in(Some(&self.ns.name), &self.pin_dir, args)
    }

    /// Cuts the node off the switch (its port goes down).
    pub fn cut(&self, sw: &Netns, prefix: &str) {
        sw.run(&format!("ip link set {prefix}n{} down", self.index));
    }

    pub fn heal(&self, sw: &Netns, prefix: &str) {
        sw.run(&format!("ip link set {prefix}n{} up", self.index));
    }
}

pub struct L2Lab {
    pub prefix: String,
    pub dir: PathBuf,
    pub switch: Netns,
    pub client: Netns,
    pub backend: Netns,
    pub nodes: Vec<L2Node>,
    nginx: Option<Child>,
    echo: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
    /// XDP_PASS on the switch's node ports ([`crate::xdp::attach_pass`]).
    port_xdp: Option<aya::Ebpf>,
}

impl L2Lab {
    /// Builds the segment and starts the backend; no agent runs yet.
    pub fn start(prefix: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("xlb-{prefix}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        for i in 1..=3 {
            fs::write(key_path(&dir, i), format!("{LAB_KEY}\n")).unwrap();
        }
        let switch = Netns::new(&format!("{prefix}-sw"));
        switch.run(
            "ip link add br0 type bridge mcast_snooping 0 && ip link set br0 up && \
             sysctl -qw net.ipv6.conf.all.disable_ipv6=1",
        );
        let port = |ns: &Netns, port: &str, inner: &str| {
            crate::netns::sh(&format!(
                "ip link add {port} netns {sw} type veth peer name {inner} netns {ns}",
                sw = switch.name,
                ns = ns.name
            ));
            switch.run(&format!(
                "ip link set {port} master br0 && ip link set {port} up && \
                 ethtool -K {port} gro on >/dev/null"
            ));
        };
        let client = Netns::new(&format!("{prefix}-c"));
        port(&client, &format!("{prefix}c"), "eth0");
        client.run(&format!(
            "ip link set eth0 address 02:00:00:00:09:64 && \
             ip addr add {CLIENT_V4}/24 dev eth0 && ip addr add {CLIENT_V6}/64 dev eth0 nodad && \
             ip link set eth0 up && ethtool -K eth0 gro on tx off >/dev/null"
        ));
        let backend = Netns::new(&format!("{prefix}-b"));
        port(&backend, &format!("{prefix}b"), "eth0");
        backend.run(&format!(
            "ip addr add {BACKEND_V4}/24 dev eth0 && ip addr add {BACKEND_V6}/64 dev eth0 nodad && \
             ip link set eth0 up && ethtool -K eth0 gro on tx off >/dev/null"
        ));
        let mut nodes = Vec::new();
        for i in 1..=3 {
            let ns = Netns::new(&format!("{prefix}-n{i}"));
            port(&ns, &format!("{prefix}n{i}"), "lan");
            // The switch floods unknown unicast to the nodes, as a real
            // one does once a cut owner's port is gone: the program must
            // pass frames addressed to another node's MAC untouched.
            ns.run(&format!(
                "ip link set lan address 02:00:00:00:09:0{i} && \
                 ip addr add {}/24 dev lan && ip addr add fd00:9::1{i}/64 dev lan nodad && \
                 ip link set lan up && ethtool -K lan tx off >/dev/null && \
                 sysctl -qw net.ipv4.ip_forward=1 net.ipv6.conf.all.forwarding=1",
                node_v4(i)
            ));
            let pin_dir = PathBuf::from(format!("/sys/fs/bpf/xlb-{prefix}-n{i}"));
            cleanup_pins(&pin_dir);
            nodes.push(L2Node {
                index: i,
                ns,
                pin_dir,
                config_path: dir.join(format!("n{i}.yaml")),
                log_path: dir.join(format!("n{i}.log")),
                agent: None,
            });
        }
        let conf = dir.join("nginx.conf");
        fs::write(
            &conf,
            format!(
                "daemon off; master_process off; pid {d}/pid; error_log {d}/error.log;\n\
                 events {{ worker_connections 1024; }}\n\
                 http {{ access_log off; client_body_temp_path {d}; proxy_temp_path {d}; \
                 fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};\n\
                 server {{ listen 8080; listen [::]:8080; location / {{ return 200 \"b1\\n\"; }} }} }}\n",
                d = dir.display()
            ),
        )
        .unwrap();
        let nginx = spawn_in(
            &backend,
            &dir.join("nginx.log"),
            Path::new("nginx"),
            &["-c", conf.to_str().unwrap()],
        );
        let mut lab = Self {
            prefix: prefix.to_string(),
            dir,
            switch,
            client,
            backend,
            nodes,
            nginx: Some(nginx),
            echo: None,
            port_xdp: None,
        };
        crate::topology::wait_for_port(&lab.backend, SocketAddr::from((BACKEND_V4, 8080)));
        lab.port_xdp = Some(crate::xdp::attach_pass(
            &lab.switch,
            &(1..=3).map(|i| format!("{prefix}n{i}")).collect::<Vec<_>>(),
        ));
        lab
    }

    /// Node `i`'s config: every VIP (port 80, snat) to the backend, L2 mode
    /// with the two other nodes as peers, plus `extra` lines in `l2:`.
    pub fn config(&self, i: usize, extra: &str) -> String {
        let mut s = format!(
            "interfaces: [lan]\nsnat_ipv4: {}\nsnat_ipv6: fd00:9::1{i}\nmetrics_addr: 127.0.0.1:{METRICS_PORT}\nservices:\n",
            node_v4(i)
        );
        for k in 0..VIPS {
            s.push_str(&format!(
                "  - {{ name: web{k}, vip: {}, port: 80, mode: snat, backends: [{{ ip: {BACKEND_V4}, port: 8080 }}] }}\n",
                vip(k)
            ));
        }
        s.push_str(&format!(
            "  - {{ name: web6, vip: \"{VIP6}\", port: 80, mode: snat, backends: [{{ ip: \"{BACKEND_V6}\", port: 8080 }}] }}\n"
        ));
        s.push_str(&format!(
            "  - {{ name: echo, vip: {}, port: {ECHO_PORT}, protocol: udp, mode: snat, backends: [{{ ip: {BACKEND_V4}, port: {ECHO_PORT} }}] }}\n",
            vip(0)
        ));
        let peers: Vec<String> = (1..=3)
            .filter(|p| *p != i)
            .map(|p| node_v4(p).to_string())
            .collect();
        s.push_str(&format!(
            "l2:\n  interfaces: [lan]\n  node_name: n{i}\n  bind: {}\n  peers: [{}]\n  key_file: {}\n{extra}",
            node_v4(i),
            peers.join(", "),
            key_path(&self.dir, i).display()
        ));
        s
    }

    /// Replaces node `i`'s key file with `keys`, one a line (a rotation's
    /// step); the agent takes them within half a second.
    pub fn write_keys(&self, i: usize, keys: &[&str]) {
        let mut text = keys.join("\n");
        text.push('\n');
        write_atomic(&key_path(&self.dir, i), &text);
    }

    /// Records, until stopped, every frame node `i` sends or receives on
    /// its LAN interface.
    pub fn capture(&self, i: usize) -> Capture {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let (started, ready) = std::sync::mpsc::channel();
        let thread = in_netns(&self.nodes[i - 1].ns, move || {
            let sock = RawSocket::open("lan");
            let _ = started.send(());
            let mut frames = Vec::new();
            while !s.load(Ordering::Relaxed) {
                frames.extend(sock.frames(Duration::from_millis(50)));
            }
            frames
        });
        let _ = ready.recv();
        Capture { stop, thread }
    }

    /// Starts node `i`'s agent with `yaml` and waits until it is ready.
    pub fn start_agent(&mut self, i: usize, yaml: &str) {
        let n = &mut self.nodes[i - 1];
        assert!(n.agent.is_none(), "node {i}: agent running");
        write_atomic(&n.config_path, yaml);
        let child = spawn_agent_in(&n.ns, &n.log_path, &n.config_path, &n.pin_dir);
        n.agent = Some(child);
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, METRICS_PORT));
        let ns = n.ns.name.clone();
        poll_until(Duration::from_secs(30), Duration::from_millis(50), || {
            let ns = ns.clone();
            let r = std::thread::spawn(move || {
                Netns::enter_by_name(&ns);
                http_get(addr, "/readyz", Duration::from_secs(2))
            })
            .join()
            .expect("thread");
            match r {
                Ok((200, _)) => Ok(()),
                _ => Err(()),
            }
        })
        .unwrap_or_else(|()| {
            panic!(
                "node {i}: not ready in 30 s; log:\n{}",
                self.nodes[i - 1].log()
            )
        });
    }

    /// Rewrites node `i`'s config; the agent reloads it within half a second.
    pub fn rewrite_config(&self, i: usize, yaml: &str) {
        write_atomic(&self.nodes[i - 1].config_path, yaml);
    }

    pub fn start_all(&mut self) {
        for i in 1..=3 {
            let c = self.config(i, "");
            self.start_agent(i, &c);
        }
    }

    /// Starts a UDP echo server on the backend (`ECHO_PORT`), once.
    pub fn start_udp_echo(&mut self) {
        if self.echo.is_some() {
            return;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let (bound, ready) = std::sync::mpsc::channel();
        let thread = in_netns(&self.backend, move || {
            realtime_priority();
            let sock = std::net::UdpSocket::bind((BACKEND_V4, ECHO_PORT)).expect("bind echo");
            sock.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            let _ = bound.send(());
            let mut buf = [0u8; 2048];
            while !s.load(Ordering::Relaxed) {
                if let Ok((n, from)) = sock.recv_from(&mut buf) {
                    let _ = sock.send_to(&buf[..n], from);
                }
            }
        });
        ready.recv().expect("echo server started");
        self.echo = Some((stop, thread));
    }

    pub fn node(&mut self, i: usize) -> &mut L2Node {
        &mut self.nodes[i - 1]
    }

    /// Who answers an ARP request for `ip` from the client within `wait`.
    pub fn arp(&self, ip: Ipv4Addr, wait: Duration) -> BTreeSet<[u8; 6]> {
        in_netns(&self.client, move || {
            let s = RawSocket::open("eth0");
            s.send(&arp_request(ip, CLIENT_V4));
            s.answers(wait, |f| arp_answer(f, ip, CLIENT_V4))
        })
        .join()
        .expect("arp thread")
    }

    /// Who answers a Neighbor Solicitation for `ip` from the client within `wait`.
    pub fn ndp(&self, ip: Ipv6Addr, wait: Duration) -> BTreeSet<[u8; 6]> {
        in_netns(&self.client, move || {
            let s = RawSocket::open("eth0");
            s.send(&neighbor_solicitation(ip));
            s.answers(wait, |f| na_answer(f, ip))
        })
        .join()
        .expect("ndp thread")
    }

    /// Polls (every 20 ms, at most `timeout`) until exactly one node
    /// answers ARP for `ip`, and returns it.
    pub fn wait_owner(&self, ip: Ipv4Addr, timeout: Duration) -> usize {
        poll_until(timeout, Duration::from_millis(20), || {
            let a = self.arp(ip, Duration::from_millis(30));
            match a.iter().collect::<Vec<_>>()[..] {
                [mac] => node_of(*mac).ok_or(()),
                _ => Err(()),
            }
        })
        .unwrap_or_else(|()| {
            panic!(
                "{ip}: no single owner within {timeout:?}; logs:\n{}",
                self.logs()
            )
        })
    }

    pub fn logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| format!("--- node {}\n{}", n.index, n.log()))
            .collect()
    }

    /// `GET http://addr/` from the client.
    pub fn get(&self, addr: SocketAddr, timeout: Duration) -> io::Result<(u16, String)> {
        in_netns(&self.client, move || http_get(addr, "/", timeout))
            .join()
            .expect("client thread")
    }

    /// Forgets the client's neighbour entries, so that its next packet asks again.
    pub fn flush_client_neighbours(&self) {
        self.client.run("ip neigh flush dev eth0");
    }

    /// Sends an ARP request for `ip` every `every` until stopped, and
    /// records who answered each one.
    pub fn watch_arp(&self, ip: Ipv4Addr, every: Duration) -> ArpWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let (started, first_round) = std::sync::mpsc::channel();
        let thread = in_netns(&self.client, move || {
            let sock = RawSocket::open("eth0");
            let mut rounds = Vec::new();
            let mut seq: u16 = 0;
            while !s.load(Ordering::Relaxed) {
                // Each request asks from its own address (10.9.0.128-191,
                // which nothing else uses), and the answer goes back to it:
                // answers that waited in the socket (this thread starved)
                // are not counted with a later request's. (Not the hardware
                // address: the nodes' kernels learn it for that IP.)
                seq = seq.wrapping_add(1);
                let from = watch_source(seq);
                sock.send(&arp_request(ip, from));
                let at = Instant::now();
                rounds.push((at, sock.answers(every, |f| arp_answer(f, ip, from))));
                let _ = started.send(());
            }
            rounds
        });
        // Whatever the caller does next happens after the first request.
        let _ = first_round.recv();
        ArpWatch { stop, thread }
    }
}

impl L2Lab {
    /// Records, until stopped, every SYN the client sends to `vip`:`port`
    /// and every SYN-ACK that comes back. Two SYN-ACKs with different
    /// sequence numbers for one SYN (client port and initial sequence
    /// number, which the SYN-ACK acknowledges) mean two nodes answered one
    /// connection; a SYN-ACK for no SYN was delivered to the wrong port.
    pub fn watch_synacks(&self, vip: Ipv4Addr, port: u16) -> SynAckWatch {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let (started, ready) = std::sync::mpsc::channel();
        let thread = in_netns(&self.client, move || {
            let sock = RawSocket::open("eth0");
            let _ = started.send(());
            let mut seen = Handshakes::default();
            while !s.load(Ordering::Relaxed) {
                for f in sock.frames(Duration::from_millis(50)) {
                    // Ethernet, IPv4 without options, TCP with SYN.
                    if f.len() < 54
                        || f[12..14] != [0x08, 0x00]
                        || f[14] != 0x45
                        || f[23] != 6
                        || f[47] & 0x02 == 0
                    {
                        continue;
                    }
                    let seq = u32::from_be_bytes([f[38], f[39], f[40], f[41]]);
                    let ack = u32::from_be_bytes([f[42], f[43], f[44], f[45]]);
                    let (sport, dport) = (&f[34..36], &f[36..38]);
                    if f[47] & 0x10 == 0 && f[30..34] == vip.octets() && dport == port.to_be_bytes()
                    {
                        seen.syns.insert((u16::from_be_bytes([f[34], f[35]]), seq));
                    } else if f[47] & 0x10 != 0
                        && f[26..30] == vip.octets()
                        && sport == port.to_be_bytes()
                    {
                        let cport = u16::from_be_bytes([f[36], f[37]]);
                        let mut mac = [0u8; 6];
                        mac.copy_from_slice(&f[6..12]);
                        let syn = (cport, ack.wrapping_sub(1));
                        seen.synacks.entry(syn).or_default().insert((seq, mac));
                    }
                }
            }
            seen
        });
        let _ = ready.recv();
        SynAckWatch { stop, thread }
    }

    /// Opens a new connection to `addr` from the client every `every`
    /// ([`ConnectionStream`]).
    pub fn connection_stream(&self, addr: SocketAddr, every: Duration) -> ConnectionStream {
        ConnectionStream::start(&self.client, addr, every)
    }
}

/// A client SYN: (client port, sequence number).
pub type Syn = (u16, u32);

/// What [`L2Lab::watch_synacks`] saw. A client may use a port again once a
/// connection has closed; its new SYN has a new sequence number.
#[derive(Default)]
pub struct Handshakes {
    /// The client's SYNs.
    pub syns: BTreeSet<Syn>,
    /// Per SYN the SYN-ACKs acknowledge, their (sequence number, sender MAC).
    pub synacks: BTreeMap<Syn, BTreeSet<(u32, [u8; 6])>>,
}

impl L2Lab {
    /// Opens `n` keep-alive connections to `addr` from the client, one
    /// request each. With `held_beside: Some(owner)` (nodes that share
    /// flows), waits (at most 10 s) until every node but `owner` holds
    /// their flows: the owner's periodic push has reached them.
    pub fn keepalive(
        &self,
        addr: SocketAddr,
        n: usize,
        held_beside: Option<usize>,
    ) -> Result<Vec<crate::topology::HttpConn>, String> {
        let mut conns = Vec::new();
        for _ in 0..n {
            let mut c = crate::topology::HttpConn::connect_in(&self.client, addr)
                .map_err(|e| format!("keep-alive connection: {e}"))?;
            c.get().map_err(|e| format!("first request: {e}"))?;
            conns.push(c);
        }
        let clients: BTreeSet<String> = conns
            .iter()
            .filter_map(|c| c.stream.local_addr().ok())
            .map(|a| a.to_string())
            .collect();
        let Some(owner) = held_beside else {
            return Ok(conns);
        };
        for other in (1..=3).filter(|i| *i != owner) {
            poll_until(Duration::from_secs(10), Duration::from_millis(100), || {
                let ct = self.nodes[other - 1].lbctl_json(&["conntrack"]);
                let held = ct["entries"].as_array().map_or(0, |e| {
                    e.iter()
                        .filter(|f| f["client"].as_str().is_some_and(|c| clients.contains(c)))
                        .count()
                });
                (held == n).then_some(()).ok_or(held)
            })
            .map_err(|held| format!("node {other} holds {held} of the {n} flows"))?;
        }
        Ok(conns)
    }
}

/// The key every node starts with.
pub const LAB_KEY: &str = "l2-lab-key-0123456789abcdef";

fn key_path(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("n{i}.key"))
}

/// A running [`L2Lab::capture`].
pub struct Capture {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<Vec<u8>>>,
}

impl Capture {
    /// The frames seen, in order.
    pub fn stop(self) -> Vec<Vec<u8>> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("capture thread")
    }
}

/// A running [`L2Lab::watch_synacks`].
pub struct SynAckWatch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Handshakes>,
}

impl SynAckWatch {
    /// The SYNs and SYN-ACKs seen.
    pub fn stop(self) -> Handshakes {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("SYN-ACK watch thread")
    }
}

/// A running [`L2Lab::watch_arp`].
pub struct ArpWatch {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<(Instant, BTreeSet<[u8; 6]>)>>,
}

impl ArpWatch {
    /// Each request's send time and the MACs that answered it.
    pub fn stop(self) -> Vec<(Instant, BTreeSet<[u8; 6]>)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("watch thread")
    }
}

impl Drop for L2Lab {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            kill_child(&mut n.agent);
            cleanup_pins(&n.pin_dir);
        }
        kill_child(&mut self.nginx);
        if let Some((stop, thread)) = self.echo.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = thread.join();
        }
        // A failed test keeps its logs; a passed one leaves nothing in /tmp.
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// An AF_PACKET socket on an interface of the calling thread's namespace.
struct RawSocket {
    fd: i32,
    ifindex: i32,
}

impl RawSocket {
    fn open(iface: &str) -> Self {
        let name = std::ffi::CString::new(iface).unwrap();
        // SAFETY: plain syscalls with checked results.
        unsafe {
            let ifindex = libc::if_nametoindex(name.as_ptr()) as i32;
            assert!(ifindex > 0, "no interface {iface}");
            let fd = libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW,
                (libc::ETH_P_ALL as u16).to_be() as i32,
            );
            assert!(fd >= 0, "socket: {}", io::Error::last_os_error());
            let mut sa: libc::sockaddr_ll = std::mem::zeroed();
            sa.sll_family = libc::AF_PACKET as u16;
            sa.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
            sa.sll_ifindex = ifindex;
            let rc = libc::bind(
                fd,
                (&sa as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            );
            assert_eq!(rc, 0, "bind: {}", io::Error::last_os_error());
            Self { fd, ifindex }
        }
    }

    fn send(&self, frame: &[u8]) {
        // SAFETY: as in `open`.
        unsafe {
            let mut sa: libc::sockaddr_ll = std::mem::zeroed();
            sa.sll_family = libc::AF_PACKET as u16;
            sa.sll_ifindex = self.ifindex;
            sa.sll_halen = 6;
            sa.sll_addr[..6].copy_from_slice(&frame[..6]);
            let n = libc::sendto(
                self.fd,
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&sa as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            );
            assert!(n > 0, "sendto: {}", io::Error::last_os_error());
        }
    }

    /// The frames received within `wait`.
    fn frames(&self, wait: Duration) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + wait;
        let mut out = Vec::new();
        let mut buf = [0u8; 2048];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return out;
            }
            let mut pfd = libc::pollfd {
                fd: self.fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd, then a read into our buffer.
            let n = unsafe {
                if libc::poll(&mut pfd, 1, left.as_millis().max(1) as i32) <= 0 {
                    continue;
                }
                libc::recv(self.fd, buf.as_mut_ptr().cast(), buf.len(), 0)
            };
            if n > 0 {
                out.push(buf[..n as usize].to_vec());
            }
        }
    }

    /// The source MACs of the frames `is_answer` accepts, for `wait`.
    fn answers(&self, wait: Duration, is_answer: impl Fn(&[u8]) -> bool) -> BTreeSet<[u8; 6]> {
        self.frames(wait)
            .into_iter()
            .filter(|f| f.len() >= 14 && is_answer(f))
            .map(|f| <[u8; 6]>::try_from(&f[6..12]).expect("six bytes"))
            .collect()
    }
}

impl Drop for RawSocket {
    fn drop(&mut self) {
        // SAFETY: our descriptor.
        unsafe { libc::close(self.fd) };
    }
}

/// The sender address of a watch's request `seq`.
fn watch_source(seq: u16) -> Ipv4Addr {
    Ipv4Addr::new(10, 9, 0, 128 + (seq % 64) as u8)
}

fn arp_request(ip: Ipv4Addr, from: Ipv4Addr) -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&CLIENT_MAC);
    f.extend_from_slice(&[0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1]);
    f.extend_from_slice(&CLIENT_MAC);
    f.extend_from_slice(&from.octets());
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&ip.octets());
    f
}

/// An ARP reply to a request from `from`, telling where `ip` is.
fn arp_answer(f: &[u8], ip: Ipv4Addr, from: Ipv4Addr) -> bool {
    f.len() >= 42
        && f[12..14] == [0x08, 0x06]
        && f[20..22] == [0, 2]
        && f[28..32] == ip.octets()
        && f[32..38] == CLIENT_MAC
        && f[38..42] == from.octets()
        && f[6..12] == f[22..28]
}

fn neighbor_solicitation(target: Ipv6Addr) -> Vec<u8> {
    let group = lb_agent::l2::announce::solicited_node(target);
    let g = group.octets();
    let mut icmp = vec![135, 0, 0, 0, 0, 0, 0, 0];
    icmp.extend_from_slice(&target.octets());
    icmp.extend_from_slice(&[1, 1]);
    icmp.extend_from_slice(&CLIENT_MAC);
    let sum = lb_agent::l2::announce::icmpv6_checksum(CLIENT_V6, group, &icmp);
    icmp[2..4].copy_from_slice(&sum.to_be_bytes());
    let mut f = vec![0x33, 0x33, g[12], g[13], g[14], g[15]];
    f.extend_from_slice(&CLIENT_MAC);
    f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
    f.extend_from_slice(&(icmp.len() as u16).to_be_bytes());
    f.extend_from_slice(&[58, 255]);
    f.extend_from_slice(&CLIENT_V6.octets());
    f.extend_from_slice(&g);
    f.extend_from_slice(&icmp);
    f
}

/// A solicited advertisement for `ip`, to the client, checksum correct.
fn na_answer(f: &[u8], ip: Ipv6Addr) -> bool {
    if f.len() < 86 || f[12..14] != [0x86, 0xdd] || f[20] != 58 || f[54] != 136 {
        return false;
    }
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&f[22..38]).unwrap());
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&f[38..54]).unwrap());
    dst == CLIENT_V6
        && f[62..78] == ip.octets()
        && f[58] & 0x40 != 0
        && lb_agent::l2::announce::icmpv6_checksum(src, dst, &f[54..86]) == 0
        && f[80..86] == f[6..12]
}
