//! A Kubernetes cluster of real nodes on this machine: the control plane of
//! [`cluster`](crate::cluster) plus kube-scheduler, and per node a kubelet,
//! containerd (with Debian's runc and CNI plugins), flanneld and kube-proxy.
//! The chart is installed into it with the real helm, as docs/helm.md says.
//!
//! # What a node is here
//!
//! A network namespace and a mount namespace of its own. Everything of the
//! node runs in both (`nsenter`), so that:
//! - hostNetwork Pods (the agent) see the node's `eth0`, not the host's;
//! - the node has its own bpffs at `/sys/fs/bpf`, a shared mount as the
//!   chart's `HostToContainer` propagation needs (systemd makes it so on
//!   real nodes), and two agents do not share pins;
//! - the kubelet's volume mounts are seen by containerd's containers.
//!
//! cgroups are the host's: each kubelet gets a `cgroupRoot` of its own
//! (this machine is cgroup v1, so `failCgroupV1: false`).
//!
//! # The network
//!
//! ```text
//!   client 10.81.0.2 ── 10.81.0.1 router (BIRD in BGP mode) 10.80.0.1 ── br0
//!                                                     ├─ eth0 10.80.0.11  node 1
//!                                                     └─ eth0 10.80.0.12  node 2
//! ```
//! and the same in IPv6 (fd00:81::2, fd00:81::1 and fd00:80::1, the nodes
//! fd00:80::11 and ::12): the cluster is dual-stack.
//!
//! [`NodeCluster::start_rack_b_router`] adds a second rack's router on the
//! same LAN, also in front of the client (IPv4 only):
//!
//! ```text
//!   client eth1 10.83.0.2 ── 10.83.0.1 router B (BIRD) 10.80.0.2 ── br0
//! ```
//! Which router a node peers with is up to the BGPPeers that select it.
//! The nodes' Pods get 10.244.N.0/24 and fd00:10:244:N::/64 from the
//! controller-manager; flanneld
//! (VXLAN, or host-gw) carries Pod traffic between nodes. Pod networking is
//! the bridge plugin over flannel's subnet, written as the flannel CNI plugin
//! would delegate it (that plugin is not served as a Go module): bridge
//! `cni0`, gateway, host-local addresses from `/run/flannel/subnet.env`.
//!
//! Nothing here imitates Kubernetes: Pods are started by kubelets from
//! images imported into containerd (`cargo xtask image` builds them).

use std::{
    fs,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::Duration,
};

use serde_json::Value;

use crate::{
    cluster::{k8s_bin, Cluster, AGENT_NAMESPACE, API_HOST},
    netns::{sh, Netns},
    topology::workspace_root,
    traffic::poll_until,
};

pub const ROUTER_LAN: Ipv4Addr = Ipv4Addr::new(10, 80, 0, 1);
pub const ROUTER_CLIENT_SIDE: Ipv4Addr = Ipv4Addr::new(10, 81, 0, 1);
pub const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 81, 0, 2);
/// Rack B's router ([`NodeCluster::start_rack_b_router`]).
pub const ROUTER_B_LAN: Ipv4Addr = Ipv4Addr::new(10, 80, 0, 2);
pub const ROUTER_B_CLIENT_SIDE: Ipv4Addr = Ipv4Addr::new(10, 83, 0, 1);
pub const CLIENT_B_SIDE: Ipv4Addr = Ipv4Addr::new(10, 83, 0, 2);
pub const POD_NETWORK: &str = "10.244.0.0/16";
pub const POD_NETWORK6: &str = "fd00:10:244::/56";
pub const ROUTER_LAN6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x80, 0, 0, 0, 0, 0, 1);
pub const ROUTER_CLIENT_SIDE6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x81, 0, 0, 0, 0, 0, 1);
pub const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x81, 0, 0, 0, 0, 0, 2);
/// The router's AS and the cluster's (the chart's `bgpSpeaker.asn`).
pub const ROUTER_ASN: u32 = 65000;
pub const CLUSTER_ASN: u32 = 64512;
/// The node-namespace directory root: per node `<ROOT>/<node>/`.
const ROOT: &str = "/run/xlb-nodes";
/// State that must not be on a tmpfs the size of RAM (images, snapshots).
const STATE_ROOT: &str = "/var/lib/xlb-nodes";
const READY: Duration = Duration::from_secs(120);

pub fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 80, 0, 10 + i as u8)
}

pub fn node_ip6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x80, 0, 0, 0, 0, 0, 0x10 + i as u16)
}

/// flannel's backends the tests run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodNetwork {
    Vxlan,
    HostGw,
}

impl PodNetwork {
    fn backend(self) -> &'static str {
        match self {
            PodNetwork::Vxlan => "vxlan",
            PodNetwork::HostGw => "host-gw",
        }
    }
}

/// The images `cargo xtask image` saved as OCI archives, as the chart and
/// the tests name them.
pub fn image(name: &str) -> String {
    format!("localhost/{name}:{}", workspace_version())
}

fn workspace_version() -> String {
    let manifest = fs::read_to_string(workspace_root().join("Cargo.toml")).unwrap();
    let in_package = manifest
        .split("[workspace.package]")
        .nth(1)
        .expect("a [workspace.package] table");
    in_package
        .lines()
        .find_map(|l| l.trim().strip_prefix("version = "))
        .map(|v| v.trim_matches('"').to_string())
        .expect("a workspace version")
}

fn archive(name: &str) -> PathBuf {
    let path = workspace_root().join(format!("target/image/oci/{name}.tar"));
    assert!(
        path.exists(),
        "{} is missing: run `cargo xtask image` (`cargo xtask test` does it first)",
        path.display()
    );
    path
}

fn spawn(cmd: &mut Command, log: &Path) -> Child {
    let log = fs::File::create(log).expect("create log");
    cmd.stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup log"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("start {cmd:?}: {e}"))
}

fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn kill(child: &mut Option<Child>) {
    if let Some(mut c) = child.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// One kubelet node.
pub struct Node {
    pub name: String,
    pub ns: Netns,
    pub ip: Ipv4Addr,
    /// Logs, configs, sockets: `/run/xlb-nodes/<name>`.
    pub dir: PathBuf,
    state: PathBuf,
    mount_ns: PathBuf,
    cgroup_root: String,
    containerd: Option<Child>,
    kubelet: Option<Child>,
    flanneld: Option<Child>,
    kube_proxy: Option<Child>,
}

impl Node {
    /// A command run in the node's network and mount namespaces.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net=/run/netns/{}", self.ns.name))
            .arg(format!("--mount={}", self.mount_ns.display()))
            .arg("--")
            .arg(program)
            .env(
                "PATH",
                format!("{}:/usr/sbin:/usr/bin:/sbin:/bin", bin_dir().display()),
            );
        cmd
    }

    /// A shell command in the node; its output, panicking if it fails.
    pub fn sh(&self, script: &str) -> String {
        let out = self.command("sh").arg("-c").arg(script).output().unwrap();
        assert!(
            out.status.success(),
            "on {}: `{script}` failed: {}{}",
            self.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// `ctr` against this node's containerd, in the CRI's namespace.
    pub fn ctr(&self, args: &[&str]) -> Output {
        self.command(k8s_bin("ctr"))
            .arg("--address")
            .arg(self.socket())
            .args(["-n", "k8s.io"])
            .args(args)
            .output()
            .unwrap()
    }

    /// What the agent pinned in this node's bpffs (under `/sys/fs/bpf/xlb`).
    pub fn pins(&self) -> Vec<String> {
        let out = self.sh("cd /sys/fs/bpf && find xlb -mindepth 0 2>/dev/null | sort");
        out.lines().map(String::from).collect()
    }

    /// The node's nf_tables tables (`nft list tables`), one per line.
    pub fn nft_tables(&self) -> Vec<String> {
        let out = self.sh("nft list tables");
        out.lines().map(String::from).collect()
    }

    /// `ip -d link show` in the node: which interfaces carry an XDP program.
    pub fn xdp_interfaces(&self) -> Vec<String> {
        let out = Command::new("ip")
            .args(["-n", &self.ns.name, "-j", "link", "show"])
            .output()
            .unwrap();
        let links: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        links
            .as_array()
            .into_iter()
            .flatten()
            .filter(|l| l.get("xdp").is_some())
            .filter_map(|l| l["ifname"].as_str().map(String::from))
            .collect()
    }

    /// The last lines of every container log of `namespace`'s Pods on this
    /// node, read from the kubelet's log directory.
    pub fn container_logs(&self, namespace: &str) -> String {
        let dir = self.state.join("pod-logs");
        let mut out = String::new();
        for pod in fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = pod.file_name().to_string_lossy().into_owned();
            if !name.starts_with(&format!("{namespace}_")) {
                continue;
            }
            for container in fs::read_dir(pod.path()).into_iter().flatten().flatten() {
                let mut logs: Vec<PathBuf> = fs::read_dir(container.path())
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path())
                    .collect();
                logs.sort();
                if let Some(last) = logs.last() {
                    out.push_str(&format!("{}:\n{}\n", last.display(), tail(last, 30)));
                }
            }
        }
        out
    }

    /// An interface's MAC address in the node.
    pub fn mac(&self, iface: &str) -> String {
        let out = Command::new("ip")
            .args(["-n", &self.ns.name, "-j", "link", "show", iface])
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        v[0]["address"].as_str().unwrap_or_default().to_string()
    }

    pub fn log(&self, what: &str) -> String {
        tail(&self.dir.join(format!("{what}.log")), 60)
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // The kubelet first, so it does not restart what goes next.
        kill(&mut self.kubelet);
        kill(&mut self.kube_proxy);
        kill(&mut self.flanneld);
        // Pods: their shims outlive containerd; kill what runs in the
        // node's cgroups, then the groups.
        kill(&mut self.containerd);
        remove_cgroups(&self.cgroup_root);
        // The shims outlive containerd; they run in the node's namespace.
        for pid in crate::netns::pids(&self.ns.name) {
            // SAFETY: kill(2) on a process of this test's node namespace.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = Command::new("umount")
            .arg("-l")
            .arg(&self.mount_ns)
            .status();
        // The state stays for a look after a failure; the next start removes it.
    }
}

fn bin_dir() -> PathBuf {
    k8s_bin("kubelet").parent().unwrap().to_path_buf()
}

/// The cgroup v1 hierarchies (`/sys/fs/cgroup/<controller>`), and the v2
/// one systemd-less hosts also mount at `unified`.
fn cgroup_hierarchies() -> Vec<PathBuf> {
    fs::read_dir("/sys/fs/cgroup")
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir() && !p.is_symlink())
                .collect()
        })
        .unwrap_or_default()
}

/// The kubelet wants its `cgroupRoot` in every hierarchy; cpuset groups
/// start with no CPUs and must get the root's.
fn make_cgroups(root: &str) {
    remove_cgroups(root);
    for h in cgroup_hierarchies() {
        let dir = h.join(root.trim_start_matches('/'));
        if fs::create_dir_all(&dir).is_err() {
            continue;
        }
        for file in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(v) = fs::read_to_string(h.join(file)) {
                let _ = fs::write(dir.join(file), v.trim());
            }
        }
    }
}

/// Kills every process left in the groups under `root` and removes them,
/// deepest first.
fn remove_cgroups(root: &str) {
    for h in cgroup_hierarchies() {
        let top = h.join(root.trim_start_matches('/'));
        if !top.exists() {
            continue;
        }
        let mut dirs = Vec::new();
        let mut stack = vec![top];
        while let Some(d) = stack.pop() {
            if let Ok(entries) = fs::read_dir(&d) {
                stack.extend(entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()));
            }
            dirs.push(d);
        }
        for d in &dirs {
            for pid in fs::read_to_string(d.join("cgroup.procs"))
                .unwrap_or_default()
                .lines()
            {
                if let Ok(pid) = pid.trim().parse::<i32>() {
                    // SAFETY: kill(2) on a pid read from the node's own group.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        for d in dirs.iter().rev() {
            let _ = poll_until(Duration::from_secs(5), Duration::from_millis(20), || {
                fs::remove_dir(d).map_err(|_| ())
            });
        }
    }
}

/// A cluster of `n` real nodes behind a router, with a client outside.
pub struct NodeCluster {
    pub prefix: String,
    pub cp: Cluster,
    pub router: Netns,
    pub client: Netns,
    pub nodes: Vec<Node>,
    pub network: PodNetwork,
    bird: Option<Child>,
    /// Rack B's router and its BIRD ([`NodeCluster::start_rack_b_router`]).
    pub router_b: Option<Netns>,
    bird_b: Option<Child>,
    /// XDP_PASS on the router's node ports ([`crate::xdp::attach_pass`]).
    port_xdp: Option<aya::Ebpf>,
}

impl NodeCluster {
    /// The control plane, the router and client, and `n` nodes, each Ready
    /// (its Pod network up) with the test images imported.
    pub fn start(prefix: &str, n: usize, network: PodNetwork) -> NodeCluster {
        let cp = Cluster::start_for_nodes(prefix);
        let router = Netns::new(&format!("{prefix}-rt"));
        let client = Netns::new(&format!("{prefix}-cl"));
        router.run(&format!(
            "ip link add br0 type bridge && ip link set br0 up && \
             ip addr add {ROUTER_LAN}/24 dev br0 && sysctl -qw net.ipv4.ip_forward=1 && \
             sysctl -qw net.ipv6.conf.all.forwarding=1 && \
             ip -6 addr add {ROUTER_LAN6}/64 dev br0 nodad"
        ));
        sh(&format!(
            "ip link add {p}-clv type veth peer name eth0 netns {c} && \
             ip link set {p}-clv netns {r}",
            p = prefix,
            c = client.name,
            r = router.name
        ));
        router.run(&format!(
            "ip link set {prefix}-clv name cl0 && ip addr add {ROUTER_CLIENT_SIDE}/24 dev cl0 && \
             ip -6 addr add {ROUTER_CLIENT_SIDE6}/64 dev cl0 nodad && \
             ip link set cl0 up && ethtool -K cl0 tx off >/dev/null"
        ));
        client.run(&format!(
            "ip addr add {CLIENT}/24 dev eth0 && ip -6 addr add {CLIENT6}/64 dev eth0 nodad && \
             ip link set eth0 up && ethtool -K eth0 tx off >/dev/null && \
             ip route add default via {ROUTER_CLIENT_SIDE} && \
             ip -6 route add default via {ROUTER_CLIENT_SIDE6}"
        ));
        let mut cluster = NodeCluster {
            prefix: prefix.to_string(),
            cp,
            router,
            client,
            nodes: Vec::new(),
            network,
            bird: None,
            router_b: None,
            bird_b: None,
            port_xdp: None,
        };
        sh(&format!(
            "mkdir -p {ROOT} && (mountpoint -q {ROOT} || mount --bind {ROOT} {ROOT}) && \
             mount --make-private {ROOT}"
        ));
        for i in 1..=n {
            let node = cluster.make_node(i);
            cluster.nodes.push(node);
        }
        // What a node sends back out of its uplink with XDP_TX (hairpin,
        // host-gw) reached the router only with the next packet, up to a
        // second later, with GRO alone on the port: a veth takes such
        // frames at once only when it runs a program.
        let ports: Vec<String> = cluster
            .nodes
            .iter()
            .map(|n| format!("{}e", n.name))
            .collect();
        cluster.port_xdp = Some(crate::xdp::attach_pass(&cluster.router, &ports));
        for i in 0..n {
            cluster.start_node(i);
        }
        for node in &cluster.nodes {
            cluster.wait_node_ready(node);
        }
        cluster
    }

    fn make_node(&self, i: usize) -> Node {
        let name = format!("{}-n{i}", self.prefix);
        // A killed run leaves its node running: its processes go first.
        for pid in crate::netns::pids(&name) {
            // SAFETY: kill(2) on a process of a leftover test namespace.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let ns = Netns::new(&name);
        let ip = node_ip(i);
        // The LAN is veths: the frames XDP sends (XDP_TX, redirects) reach
        // a veth's peer only with GRO on there (docs/datapath.md); real
        // NICs need nothing. TX checksum offload off for the same reason.
        sh(&format!(
            "ip link add {name}e type veth peer name eth0 netns {ns} && \
             ip link set {name}e netns {r}",
            ns = ns.name,
            r = self.router.name
        ));
        self.router.run(&format!(
            "ip link set {name}e master br0 && ip link set {name}e up && \
             ethtool -K {name}e gro on tx off >/dev/null"
        ));
        ns.run(&format!(
            "sysctl -qw net.ipv4.ip_forward=1 && sysctl -qw net.ipv6.conf.all.forwarding=1 && \
             ip addr add {ip}/24 dev eth0 && ip -6 addr add {ip6}/64 dev eth0 nodad && \
             ip link set eth0 up && \
             ethtool -K eth0 gro on tx off >/dev/null && ip route add default via {ROUTER_LAN} && \
             ip -6 route add default via {ROUTER_LAN6}",
            ip6 = node_ip6(i)
        ));
        // The API server reaches the kubelet too (logs, exec).
        let host_if = self.cp.reach_from(&ns);
        sh(&format!("ip route replace {ip}/32 dev {host_if}"));

        let dir = Path::new(ROOT).join(&name);
        let state = Path::new(STATE_ROOT).join(&name);
        let _ = fs::remove_dir_all(&state);
        fs::create_dir_all(&state).unwrap();
        if dir.exists() {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(dir.join("mnt"))
                .status();
            let _ = fs::remove_dir_all(&dir);
        }
        fs::create_dir_all(&dir).unwrap();
        // A mount namespace kept by a bind mount of its file, with a bpffs
        // of its own in place of the host's (containerd reads the first
        // mount at a path). Every mount shared, as systemd makes them: the
        // chart's HostToContainer mounts need that (docs/helm.md).
        let mount_ns = dir.join("mnt");
        fs::write(&mount_ns, "").unwrap();
        sh(&format!(
            "unshare --mount={m} --propagation slave true && \
             nsenter --mount={m} -- sh -c 'umount /sys/fs/bpf; mount -t bpf bpf /sys/fs/bpf && \
             mount --make-rshared /'",
            m = mount_ns.display()
        ));
        let cgroup_root = format!("/xlb-{name}");
        make_cgroups(&cgroup_root);
        Node {
            name,
            ns,
            ip,
            dir,
            state,
            mount_ns,
            cgroup_root,
            containerd: None,
            kubelet: None,
            flanneld: None,
            kube_proxy: None,
        }
    }

    fn start_node(&mut self, i: usize) {
        self.start_containerd(i);
        self.import_images(i);
        self.start_kubelet(i);
        self.wait_pod_cidr(i);
        self.start_flanneld(i);
        self.start_kube_proxy(i);
    }

    fn start_containerd(&mut self, i: usize) {
        let node = &self.nodes[i];
        let d = |p: &str| node.dir.join(p).display().to_string();
        let s = |p: &str| node.state.join(p).display().to_string();
        fs::create_dir_all(node.dir.join("cni")).unwrap();
        let config = format!(
            r#"version = 3
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins]
  [plugins.'io.containerd.nri.v1.nri']
    disable = true
  [plugins.'io.containerd.cri.v1.images']
    # No overlay mounts inside this machine's container.
    snapshotter = "native"
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = "{pause}"
  [plugins.'io.containerd.cri.v1.runtime']
    # Root here lacks CAP_SYS_RESOURCE: runc may not lower oom_score_adj.
    restrict_oom_score_adj = true
    netns_mounts_under_state_dir = true
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = "runc"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = "/usr/sbin/runc"
          # The shims share /run/containerd whatever root and state say.
          Root = "{runc}"
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ["/usr/lib/cni"]
      conf_dir = "{cni}"
  [plugins.'io.containerd.transfer.v1.local']
    [[plugins.'io.containerd.transfer.v1.local'.unpack_config]]
      platform = "linux/amd64"
      snapshotter = "native"
"#,
            root = s("containerd"),
            state = d("containerd-state"),
            sock = node.socket().display(),
            pause = image("xlb-pause"),
            runc = d("runc"),
            cni = d("cni"),
        );
        let path = node.dir.join("containerd.toml");
        fs::write(&path, config).unwrap();
        let child = spawn(
            node.command(k8s_bin("containerd"))
                .arg("--config")
                .arg(&path),
            &node.dir.join("containerd.log"),
        );
        self.nodes[i].containerd = Some(child);
        let node = &self.nodes[i];
        poll_until(Duration::from_secs(30), Duration::from_millis(100), || {
            node.ctr(&["version"])
                .status
                .success()
                .then_some(())
                .ok_or(())
        })
        .unwrap_or_else(|()| panic!("containerd on {}: {}", node.name, node.log("containerd")));
    }

    fn import_images(&self, i: usize) {
        let node = &self.nodes[i];
        for name in [
            "xlb-pause",
            "xlb-agent",
            "xlb-gobgpd",
            "xlb-bird",
            "xlb-frr",
            "xlb-backend",
        ] {
            let out = node.ctr(&[
                "images",
                "import",
                "--snapshotter",
                "native",
                &archive(name).display().to_string(),
            ]);
            assert!(
                out.status.success(),
                "importing {name} on {}: {}",
                node.name,
                String::from_utf8_lossy(&out.stderr)
            );
            let listed = node.ctr(&["images", "ls", "-q"]);
            let listed = String::from_utf8_lossy(&listed.stdout);
            assert!(
                listed.lines().any(|l| l == image(name)),
                "{} not among the images of {}:\n{listed}",
                image(name),
                node.name
            );
        }
    }

    fn start_kubelet(&mut self, i: usize) {
        let node = &self.nodes[i];
        let kubeconfig = self.cp.cert_kubeconfig_for(
            &format!("kubelet-{}", node.name),
            &format!("/O=system:nodes/CN=system:node:{}", node.name),
            API_HOST,
        );
        let config = format!(
            r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {ip}
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: {cgroup_root}
failSwapOn: false
containerRuntimeEndpoint: unix://{sock}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: AlwaysAllow}}
resolvConf: ""
# The host's disk is shared by everything; eviction would act on its use.
evictionHard: {{memory.available: "1Mi", nodefs.available: "0%", imagefs.available: "0%"}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
nodeStatusUpdateFrequency: 2s
syncFrequency: 5s
fileCheckFrequency: 5s
serializeImagePulls: false
localStorageCapacityIsolation: false
podLogsDir: {logs}
"#,
            logs = node.state.join("pod-logs").display(),
            ip = node.ip,
            cgroup_root = node.cgroup_root,
            sock = node.socket().display(),
            ca = self.cp.ca_file().display(),
        );
        let path = node.dir.join("kubelet.yaml");
        fs::write(&path, config).unwrap();
        let child = spawn(
            node.command(k8s_bin("kubelet"))
                .arg(format!("--config={}", path.display()))
                .arg(format!("--kubeconfig={}", kubeconfig.display()))
                .arg(format!(
                    "--root-dir={}",
                    node.state.join("kubelet").display()
                ))
                .arg(format!("--cert-dir={}", node.dir.join("pki").display()))
                .arg(format!("--hostname-override={}", node.name))
                .arg(format!("--node-ip={},{}", node.ip, node_ip6(i + 1)))
                .arg("--v=1"),
            &node.dir.join("kubelet.log"),
        );
        self.nodes[i].kubelet = Some(child);
    }

    /// The controller-manager's node IPAM gives each Node its Pod CIDR.
    fn wait_pod_cidr(&self, i: usize) {
        let node = &self.nodes[i];
        poll_until(READY, Duration::from_millis(200), || {
            self.cp
                .get("node", None, &node.name)
                .filter(|n| {
                    n["spec"]["podCIDRs"]
                        .as_array()
                        .is_some_and(|c| c.len() == 2)
                })
                .and_then(|n| n["spec"]["podCIDR"].as_str().map(String::from))
                .ok_or(())
        })
        .unwrap_or_else(|()| {
            panic!(
                "{} got no Pod CIDR; kubelet log:\n{}\ncontroller-manager log:\n{}",
                node.name,
                node.log("kubelet"),
                self.cp.log("kube-controller-manager.log")
            )
        });
    }

    fn start_flanneld(&mut self, i: usize) {
        let node = &self.nodes[i];
        let kubeconfig =
            self.cp
                .cert_kubeconfig_for("flannel", "/O=system:masters/CN=flannel", API_HOST);
        let net_conf = node.dir.join("net-conf.json");
        fs::write(
            &net_conf,
            format!(
                r#"{{"Network": "{POD_NETWORK}", "EnableIPv4": true, "IPv6Network": "{POD_NETWORK6}", "EnableIPv6": true, "Backend": {{"Type": "{}"}}}}"#,
                self.network.backend()
            ),
        )
        .unwrap();
        let subnet_env = node.dir.join("subnet.env");
        let child = spawn(
            node.command(k8s_bin("flanneld"))
                .env("NODE_NAME", &node.name)
                .arg("--kube-subnet-mgr")
                .arg(format!("--kubeconfig-file={}", kubeconfig.display()))
                .arg(format!("--net-config-path={}", net_conf.display()))
                .arg(format!("--subnet-file={}", subnet_env.display()))
                .arg("--iface=eth0")
                .arg("--ip-masq"),
            &node.dir.join("flanneld.log"),
        );
        self.nodes[i].flanneld = Some(child);
        let node = &self.nodes[i];
        let env = poll_until(READY, Duration::from_millis(100), || {
            fs::read_to_string(&subnet_env).map_err(|_| ())
        })
        .unwrap_or_else(|()| panic!("flanneld on {}: {}", node.name, node.log("flanneld")));
        let var = |k: &str| {
            env.lines()
                .find_map(|l| l.strip_prefix(&format!("{k}=")))
                .unwrap_or_else(|| panic!("{k} missing from {env}"))
                .to_string()
        };
        // What the flannel CNI plugin hands to the bridge plugin: Pods get
        // the bridge as their default gateway.
        let conflist = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": "cbr0",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": true,
                    "isDefaultGateway": true,
                    "ipMasq": false,
                    "hairpinMode": true,
                    "mtu": var("FLANNEL_MTU").parse::<u32>().unwrap(),
                    "ipam": {
                        "type": "host-local",
                        // flannel writes its gateway (10.244.1.1/24); the
                        // plugin wants the network.
                        "ranges": [
                            [{"subnet": network_of(&var("FLANNEL_SUBNET"))}],
                            [{"subnet": network_of(&var("FLANNEL_IPV6_SUBNET"))}],
                        ],
                        "routes": [
                            {"dst": var("FLANNEL_NETWORK")},
                            {"dst": var("FLANNEL_IPV6_NETWORK")},
                        ],
                        "dataDir": node.state.join("cni-ipam").display().to_string(),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": true}},
            ],
        });
        fs::write(
            node.dir.join("cni/10-flannel.conflist"),
            serde_json::to_string_pretty(&conflist).unwrap(),
        )
        .unwrap();
    }

    fn start_kube_proxy(&mut self, i: usize) {
        let node = &self.nodes[i];
        let kubeconfig =
            self.cp
                .cert_kubeconfig_for("kube-proxy", "/CN=system:kube-proxy", API_HOST);
        let config = format!(
            r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clusterCIDR: {POD_NETWORK},{POD_NETWORK6}
hostnameOverride: {name}
clientConnection:
  kubeconfig: {kubeconfig}
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
# The conntrack table is the host's: leave its size alone.
conntrack:
  maxPerCore: 0
"#,
            name = node.name,
            kubeconfig = kubeconfig.display(),
        );
        let path = node.dir.join("kube-proxy.yaml");
        fs::write(&path, config).unwrap();
        let child = spawn(
            node.command(k8s_bin("kube-proxy"))
                .arg(format!("--config={}", path.display())),
            &node.dir.join("kube-proxy.log"),
        );
        self.nodes[i].kube_proxy = Some(child);
    }

    fn wait_node_ready(&self, node: &Node) {
        poll_until(READY, Duration::from_millis(200), || {
            let n = self.cp.get("node", None, &node.name).ok_or(())?;
            let ready = n["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            ready.then_some(()).ok_or(())
        })
        .unwrap_or_else(|()| {
            panic!(
                "node {} not Ready; kubelet log:\n{}\ncontainerd log:\n{}",
                node.name,
                node.log("kubelet"),
                node.log("containerd")
            )
        });
    }

    /// BIRD on the router, peering with every node's speaker (the chart's
    /// gobgpd sidecar) and installing what they announce as ECMP routes:
    /// IPv4 and IPv6 VIPs over one IPv4 session per node (MP-BGP).
    pub fn start_bird(&mut self) {
        self.bird = Some(self.spawn_bird(&self.router, "router", ROUTER_LAN));
    }

    /// Rack B's router: a second router on the nodes' LAN (its port on
    /// the first router's bridge) with a link of its own to the client,
    /// running BIRD as the first one does. The first router routes the
    /// client's second address through it, so that answers to what the
    /// client sends this way come back.
    pub fn start_rack_b_router(&mut self) {
        let ns = Netns::new(&format!("{}-rt2", self.prefix));
        let p = &self.prefix;
        sh(&format!(
            "ip link add {p}-r2e type veth peer name lan0 netns {b} && \
             ip link set {p}-r2e netns {r} && \
             ip link add {p}-c2v type veth peer name eth1 netns {c} && \
             ip link set {p}-c2v netns {b}",
            b = ns.name,
            r = self.router.name,
            c = self.client.name
        ));
        self.router.run(&format!(
            "ip link set {p}-r2e master br0 && ip link set {p}-r2e up && \
             ethtool -K {p}-r2e tx off >/dev/null && \
             ip route add {CLIENT_B_SIDE}/32 via {ROUTER_B_LAN}"
        ));
        ns.run(&format!(
            "sysctl -qw net.ipv4.ip_forward=1 && \
             ip addr add {ROUTER_B_LAN}/24 dev lan0 && ip link set lan0 up && \
             ethtool -K lan0 tx off >/dev/null && \
             ip link set {p}-c2v name cl0 && ip addr add {ROUTER_B_CLIENT_SIDE}/24 dev cl0 && \
             ip link set cl0 up && ethtool -K cl0 tx off >/dev/null"
        ));
        self.client.run(&format!(
            "ip addr add {CLIENT_B_SIDE}/24 dev eth1 && ip link set eth1 up && \
             ethtool -K eth1 tx off >/dev/null"
        ));
        self.bird_b = Some(self.spawn_bird(&ns, "router-b", ROUTER_B_LAN));
        self.router_b = Some(ns);
    }

    /// BIRD in `ns` with its files in `<ROOT>/<prefix>-<name>`, speaking
    /// from `lan` to every node.
    fn spawn_bird(&self, ns: &Netns, name: &str, lan: Ipv4Addr) -> Child {
        let dir = Path::new(ROOT).join(format!("{}-{name}", self.prefix));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let mut conf = format!(
            r#"router id {lan};
log "{log}" all;
protocol device {{ scan time 1; }}
protocol kernel {{
  ipv4 {{ import none; export all; }};
  merge paths on;
}}
protocol kernel {{
  ipv6 {{ import none; export all; }};
  merge paths on;
}}
template bgp node {{
  local {lan} as {ROUTER_ASN};
  hold time 9;
  keepalive time 3;
  connect retry time 1;
  error wait time 1, 2;
  graceful restart aware;
  ipv4 {{ import all; export none; }};
  ipv6 {{ import all; export none; }};
}}
"#,
            log = dir.join("bird.log").display()
        );
        for (i, n) in self.nodes.iter().enumerate() {
            conf.push_str(&format!(
                "protocol bgp n{} from node {{ neighbor {} as {CLUSTER_ASN}; }}\n",
                i + 1,
                n.ip
            ));
        }
        let path = dir.join("bird.conf");
        fs::write(&path, conf).unwrap();
        let sock = dir.join("bird.ctl");
        let child = spawn(
            Command::new("ip")
                .args(["netns", "exec", &ns.name, "bird", "-f", "-c"])
                .arg(&path)
                .arg("-s")
                .arg(&sock),
            &dir.join("bird.out"),
        );
        poll_until(Duration::from_secs(10), Duration::from_millis(50), || {
            sock.exists().then_some(()).ok_or(())
        })
        .unwrap_or_else(|()| panic!("BIRD did not start: {}", tail(&dir.join("bird.out"), 20)));
        child
    }

    /// `birdc ARGS` against the router's BIRD.
    pub fn birdc(&self, args: &[&str]) -> String {
        self.birdc_of("router", args)
    }

    /// `birdc ARGS` against rack B's router's BIRD.
    pub fn birdc_b(&self, args: &[&str]) -> String {
        self.birdc_of("router-b", args)
    }

    fn birdc_of(&self, name: &str, args: &[&str]) -> String {
        let sock = Path::new(ROOT)
            .join(format!("{}-{name}", self.prefix))
            .join("bird.ctl");
        let out = Command::new("birdc")
            .arg("-s")
            .arg(sock)
            .args(args)
            .output()
            .expect("run birdc");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The router's next hops for `route` (an address, or a prefix: the
    /// nodes that announce it).
    pub fn router_next_hops(&self, route: impl ToString) -> Vec<IpAddr> {
        next_hops(&self.router, &route.to_string())
    }

    /// Rack B's router's next hops for `route`.
    pub fn router_b_next_hops(&self, route: impl ToString) -> Vec<IpAddr> {
        next_hops(
            self.router_b.as_ref().expect("rack B's router"),
            &route.to_string(),
        )
    }

    /// The node whose MAC the router learned for `vip` (L2 mode's owner).
    pub fn l2_owner(&self, vip: impl Into<IpAddr>) -> String {
        let vip: IpAddr = vip.into();
        let any = if vip.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
        let mac = poll_until(Duration::from_secs(30), Duration::from_millis(200), || {
            // Any datagram makes the router resolve the VIP's MAC (ARP, NDP).
            let _ = crate::topology::in_netns(&self.router, move || {
                std::net::UdpSocket::bind(any)
                    .and_then(|s| s.send_to(b"arp", (vip, 9)))
                    .ok()
            })
            .join();
            let out = Command::new("ip")
                .args(["-n", &self.router.name, "-j", "neigh", "show"])
                .arg(vip.to_string())
                .output()
                .unwrap();
            let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
            v[0]["lladdr"].as_str().map(String::from).ok_or(())
        })
        .unwrap_or_else(|()| panic!("nobody answers ARP for {vip}"));
        self.nodes
            .iter()
            .find(|n| n.mac("eth0") == mac)
            .map(|n| n.name.clone())
            .unwrap_or_else(|| panic!("{mac} is no node's eth0"))
    }

    /// The node the router sends the client's packets for `vip` to (its
    /// ECMP hash is over addresses only, so every flow of the client goes
    /// one way): `ip route get` on the router.
    pub fn receiver_of_client(&self, vip: Ipv4Addr) -> String {
        let out = Command::new("ip")
            .args(["-n", &self.router.name, "-j", "route", "get"])
            .arg(vip.to_string())
            .args(["from", &CLIENT.to_string(), "iif", "cl0"])
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        let hop: Ipv4Addr = v[0]["gateway"]
            .as_str()
            .and_then(|g| g.parse().ok())
            .unwrap_or_else(|| panic!("no route to {vip} from the client: {v}"));
        self.nodes
            .iter()
            .find(|n| n.ip == hop)
            .map(|n| n.name.clone())
            .unwrap_or_else(|| panic!("{hop} is no node"))
    }

    /// `helm ARGS` as the cluster's administrator.
    pub fn helm(&self, args: &[&str]) -> Output {
        Command::new("helm")
            .arg("--kubeconfig")
            .arg(self.cp.admin_kubeconfig())
            .args(args)
            .output()
            .expect("run helm (cargo xtask setup installs it)")
    }

    pub fn helm_ok(&self, args: &[&str]) -> String {
        let out = self.helm(args);
        assert!(
            out.status.success(),
            "helm {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The chart in this checkout.
    pub fn chart() -> PathBuf {
        workspace_root().join("charts/xlb")
    }

    /// Waits until the DaemonSet's Pods run and are Ready on every node.
    pub fn wait_agents_ready(&self) {
        let want = self.nodes.len() as u64;
        poll_until(READY, Duration::from_millis(500), || {
            let ds = self
                .cp
                .get("daemonset", Some(AGENT_NAMESPACE), "xlb")
                .ok_or(())?;
            let st = &ds["status"];
            let gen_ok = st["observedGeneration"] == ds["metadata"]["generation"];
            (gen_ok
                && st["numberReady"].as_u64() == Some(want)
                && st["updatedNumberScheduled"].as_u64() == Some(want))
            .then_some(())
            .ok_or(())
        })
        .unwrap_or_else(|()| panic!("the agents are not Ready:\n{}", self.describe_agents()));
    }

    /// What an operator looks at when traffic does not get through: the
    /// router's neighbours, and per node its interfaces with XDP, routes,
    /// and what the data plane counted (`lbctl stats`, `lbctl services`).
    pub fn describe_traffic(&self) -> String {
        let mut out = String::new();
        let neigh = Command::new("ip")
            .args(["-n", &self.router.name, "neigh"])
            .output()
            .unwrap();
        out.push_str(&format!(
            "--- router neighbours:\n{}",
            String::from_utf8_lossy(&neigh.stdout)
        ));
        let lbctl = crate::topology::lbctl_bin();
        for n in &self.nodes {
            let run = |args: &[&str]| {
                let o = n.command(&lbctl).args(args).output().unwrap();
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                )
            };
            out.push_str(&format!(
                "--- {} XDP on {:?}\n{}\n{}\n{}\n",
                n.name,
                n.xdp_interfaces(),
                n.sh("ip -br addr; ip route"),
                run(&["stats"]),
                run(&["l2"]),
            ));
        }
        out
    }

    /// What a user looks at when the agents do not come up.
    pub fn describe_agents(&self) -> String {
        let pods = self
            .cp
            .kubectl(&["-n", AGENT_NAMESPACE, "describe", "pods"]);
        let logs = self.cp.kubectl(&[
            "-n",
            AGENT_NAMESPACE,
            "logs",
            "-l",
            "app.kubernetes.io/name=xlb",
            "-c",
            "agent",
            "--tail=40",
        ]);
        let kubelets: String = self
            .nodes
            .iter()
            .map(|n| {
                format!(
                    "--- kubelet {}:\n{}\n--- agent logs on {}:\n{}\n",
                    n.name,
                    n.log("kubelet"),
                    n.name,
                    n.container_logs(AGENT_NAMESPACE)
                )
            })
            .collect();
        format!(
            "{}\n{}{}\n{kubelets}",
            String::from_utf8_lossy(&pods.stdout),
            String::from_utf8_lossy(&logs.stdout),
            String::from_utf8_lossy(&logs.stderr)
        )
    }
}

impl Drop for NodeCluster {
    fn drop(&mut self) {
        kill(&mut self.bird);
        kill(&mut self.bird_b);
        // Nodes before the control plane (the Cluster field drops after).
        self.nodes.clear();
    }
}

/// `10.244.1.1/24` -> `10.244.1.0/24`.
fn network_of(cidr: &str) -> String {
    let (ip, len) = cidr.split_once('/').expect("address/length");
    let len: u32 = len.parse().expect("a prefix length");
    let network = match ip.parse().expect("an address") {
        IpAddr::V4(ip) => {
            let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
            Ipv4Addr::from(u32::from(ip) & mask).to_string()
        }
        IpAddr::V6(ip) => {
            let mask = u128::MAX.checked_shl(128 - len).unwrap_or(0);
            Ipv6Addr::from(u128::from(ip) & mask).to_string()
        }
    };
    format!("{network}/{len}")
}

/// Runs `f` on a thread inside the network namespace of the Pod `pod`
/// (found by its backend process, whose host name is the Pod's name): a
/// client inside the cluster, as a container of that Pod would be.
pub fn from_pod<T: Send + 'static>(pod: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let pids = Command::new("pgrep")
        .args(["-x", "backend"])
        .output()
        .expect("pgrep");
    let pid = String::from_utf8_lossy(&pids.stdout)
        .split_whitespace()
        .find(|pid| {
            Command::new("nsenter")
                .args(["-t", pid, "-u", "hostname"])
                .output()
                .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == pod)
        })
        .unwrap_or_else(|| panic!("no backend process of Pod {pod}"))
        .to_string();
    std::thread::spawn(move || {
        crate::netns::Netns::enter_path(&format!("/proc/{pid}/ns/net"));
        f()
    })
    .join()
    .expect("Pod thread")
}

/// Runs `f` on a thread inside `node`'s network namespace: a host-network
/// client (kubelet, a `hostNetwork` Pod).
pub fn from_node<T: Send + 'static>(node: &Node, f: impl FnOnce() -> T + Send + 'static) -> T {
    crate::topology::in_netns(&node.ns, f)
        .join()
        .expect("node thread")
}

/// Runs `f` in the client namespace.
pub fn from_client<T: Send + 'static>(
    cluster: &NodeCluster,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    crate::topology::in_netns(&cluster.client, f)
        .join()
        .expect("client thread")
}

/// `ns`'s next hops for `route` (its kernel's route of exactly that
/// address or prefix, ECMP or not).
fn next_hops(ns: &Netns, route: &str) -> Vec<IpAddr> {
    let family = if route.contains(':') { "-6" } else { "-4" };
    let out = Command::new("ip")
        .args(["-n", &ns.name, "-j", family, "route", "show"])
        .arg(route)
        .output()
        .unwrap();
    let routes: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    let mut hops: Vec<IpAddr> = routes
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|r| {
            let mut v: Vec<Value> = r["nexthops"].as_array().cloned().unwrap_or_default();
            if r.get("gateway").is_some() {
                v.push(r.clone());
            }
            v
        })
        .filter_map(|h| h["gateway"].as_str()?.parse().ok())
        .collect();
    hops.sort();
    hops
}
