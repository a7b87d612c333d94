//! The end-to-end topology (agent tests, demo, benchmarks):
//!
//! ```text
//!   <p>-c (client)              <p>-lb (lb-agent, XDP on every interface)          <p>-bN (nginx "bN")
//!   eth0 10.0.0.2/24  <──veth──>  lbc 10.0.0.1/24
//!                                 lbb1 10.2.1.1/24  <──veth──>  eth0 10.2.1.2/24 (default via 10.2.1.1)
//!                                 lbb2 10.2.2.1/24  <──veth──>  eth0 10.2.2.2/24
//!                                 lbb3 10.2.3.1/24  <──veth──>  eth0 10.2.3.2/24
//! ```
//!
//! The client routes 192.0.2.0/24 (the VIPs) to the LB; backends route
//! everything back through the LB, so NAT mode works. The client and
//! backend ends of the veths have GRO on (XDP_REDIRECT into a veth needs it)
//! and TX checksum offload off: veth otherwise hands over packets with only
//! partial checksums, which XDP cannot complete (real NICs deliver full ones).
//!
//! Everything is removed on drop, also when a test panics. Processes are
//! started in a namespace with `nsenter --net` (not `ip netns exec`, which
//! remounts /sys and would hide the host's bpffs and the agent's pins).

use std::{
    fs,
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use crate::netns::{sh, Netns};

pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
pub const LB_CLIENT_SIDE: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
pub const VIP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
pub const BACKEND_PORT: u16 = 8080;

/// Address of backend `n` (1-based).
pub fn backend_ip(n: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 2, n as u8, 2)
}

pub struct Topology {
    pub prefix: String,
    pub client: Netns,
    pub lb: Netns,
    pub backends: Vec<Netns>,
    /// Working directory for configs and logs.
    pub dir: PathBuf,
    /// Pin directory of this topology's agent (under /sys/fs/bpf).
    pub pin_dir: PathBuf,
    children: Vec<Child>,
    nginx: Vec<Option<Child>>,
}

impl Topology {
    /// Builds the namespaces and links and starts one nginx per backend,
    /// answering `GET /` with `b<N>` and keeping connections open for long.
    /// `prefix` must be short (interface names are limited to 15 bytes).
    pub fn new(prefix: &str, backends: usize) -> Self {
        let dir = std::env::temp_dir().join(format!("xlb-{prefix}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/xlb-{prefix}"));
        cleanup_pins(&pin_dir);
        let client = Netns::new(&format!("{prefix}-c"));
        let lb = Netns::new(&format!("{prefix}-lb"));
        sh(&format!(
            "ip link add lbc netns {lb} type veth peer name eth0 netns {c}",
            lb = lb.name,
            c = client.name
        ));
        lb.run("ip addr add 10.0.0.1/24 dev lbc && ip link set lbc up && sysctl -qw net.ipv4.ip_forward=1");
        client.run(
            "ip addr add 10.0.0.2/24 dev eth0 && ip link set eth0 up && ip route add 192.0.2.0/24 via 10.0.0.1 \
             && ethtool -K eth0 gro on tx off >/dev/null",
        );
        let mut ns_backends = Vec::new();
        for n in 1..=backends {
            let b = Netns::new(&format!("{prefix}-b{n}"));
            sh(&format!(
                "ip link add lbb{n} netns {lb} type veth peer name eth0 netns {b}",
                lb = lb.name,
                b = b.name
            ));
            lb.run(&format!(
                "ip addr add 10.2.{n}.1/24 dev lbb{n} && ip link set lbb{n} up"
            ));
            b.run(&format!(
                "ip addr add 10.2.{n}.2/24 dev eth0 && ip link set eth0 up && ip route add default via 10.2.{n}.1 \
                 && ethtool -K eth0 gro on tx off >/dev/null"
            ));
            ns_backends.push(b);
        }
        let mut t = Topology {
            prefix: prefix.to_string(),
            client,
            lb,
            backends: ns_backends,
            dir,
            pin_dir,
            children: Vec::new(),
            nginx: Vec::new(),
        };
        for n in 1..=backends {
            let child = t.start_nginx(n);
            t.nginx.push(Some(child));
        }
        for n in 1..=backends {
            wait_for_port(
                &t.backends[n - 1],
                SocketAddr::new(backend_ip(n).into(), BACKEND_PORT),
            );
        }
        t
    }

    /// The interfaces the agent attaches to.
    pub fn lb_interfaces(&self) -> Vec<String> {
        let mut v = vec!["lbc".to_string()];
        v.extend((1..=self.backends.len()).map(|n| format!("lbb{n}")));
        v
    }

    fn start_nginx(&self, n: usize) -> Child {
        let d = self.dir.join(format!("nginx-b{n}"));
        fs::create_dir_all(&d).unwrap();
        let conf = format!(
            "daemon off; pid {d}/pid; error_log {d}/error.log; worker_processes 1;\n\
             events {{ worker_connections 4096; }}\n\
             http {{ access_log off; keepalive_timeout 600s; keepalive_requests 1000000;\n\
               client_body_temp_path {d}; proxy_temp_path {d}; fastcgi_temp_path {d}; uwsgi_temp_path {d}; scgi_temp_path {d};\n\
               server {{ listen {port} reuseport; location / {{ return 200 \"b{n}\\n\"; }} }} }}\n",
            d = d.display(),
            port = BACKEND_PORT
        );
        fs::write(d.join("nginx.conf"), conf).unwrap();
        self.spawn_in(
            &self.backends[n - 1],
            "nginx",
            &["-c", &d.join("nginx.conf").to_string_lossy()],
        )
    }

    /// Kills backend `n`'s nginx (1-based).
    pub fn kill_backend(&mut self, n: usize) {
        if let Some(mut c) = self.nginx[n - 1].take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts a process in `ns` (joining only its network namespace).
    pub fn spawn_in(&self, ns: &Netns, program: &str, args: &[&str]) -> Child {
        Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", ns.name))
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"))
    }

    /// Runs a process to completion in `ns` and returns its stdout.
    pub fn output_in(&self, ns: &Netns, program: &str, args: &[&str]) -> std::process::Output {
        Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", ns.name))
            .arg(program)
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("run {program}: {e}"))
    }

    /// Keeps a child to be killed when the topology goes.
    pub fn adopt_child(&mut self, c: Child) {
        self.children.push(c);
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        for c in self
            .children
            .iter_mut()
            .chain(self.nginx.iter_mut().flatten())
        {
            let _ = c.kill();
            let _ = c.wait();
        }
        cleanup_pins(&self.pin_dir);
        // Netns drops delete the namespaces (and with them the veths).
    }
}

/// Detaches and removes an agent's pins (what `lb-agent --cleanup` does).
pub fn cleanup_pins(dir: &std::path::Path) {
    if dir.exists() {
        let _ = lb_agent::dataplane::Dataplane::cleanup(dir);
    }
}

/// Waits until `addr` accepts TCP connections from inside `ns`.
pub fn wait_for_port(ns: &Netns, addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let ns_name = ns.name.clone();
    let ok = std::thread::spawn(move || {
        Netns::enter_by_name(&ns_name);
        while Instant::now() < deadline {
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    })
    .join()
    .unwrap();
    assert!(ok, "{addr} did not start listening in {}", ns.name);
}

/// Runs `f` on a thread inside `ns` (sockets it opens live in that namespace).
pub fn in_netns<T: Send + 'static>(
    ns: &Netns,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let name = ns.name.clone();
    std::thread::spawn(move || {
        Netns::enter_by_name(&name);
        f()
    })
}
