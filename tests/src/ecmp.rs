//! The ECMP topology: one router spreading a VIP over three `lb-agent`
//! nodes that announce it through their own BGP speaker, in front of three
//! nginx backends. The speaker is one of the agent's drivers ([`Driver`]):
//! `gobgpd` (the Helm chart's sidecar), BIRD 2 or ExaBGP 4.
//!
//! ```text
//!  <p>-c  client       eth0 10.100.0.2/24, default via 10.100.0.1
//!           │ veth
//!  <p>-r  router       rc 10.100.0.1/24; br0 10.101.0.1/24 (bridge; ports n1 n2 n3)
//!           │ veth nI ── uplink (XDP) 10.101.0.1I/24
//!  <p>-nI node I=1..3  uplink 10.101.0.1I/24, lan 10.102.0.1I/24 (both XDP),
//!           │          default via 10.101.0.1
//!           │ veth lan ── nI
//!  <p>-bl backend LAN  br0 (bridge; ports n1 n2 n3 b1 b2 b3)
//!           │ veth bN ── eth0
//!  <p>-bN backend N    eth0 10.102.0.2N/24, nginx on 8080 answering "bN";
//!                      10.100.0.0/24 via the three nodes (nat-mode replies)
//! ```
//!
//! Every node runs its speaker (router id = its uplink address) and
//! `lb-agent` with its own pin directory (`/sys/fs/bpf/xlb-<p>-nI`), XDP on
//! `uplink` and `lan`:
//!
//! * GoBGP: `gobgpd` with no neighbour (API on 127.0.0.1:50051 inside the
//!   node's namespace); the agent adds the router as its peer.
//! * BIRD: a node BIRD (socket `bird.ctl` in the node's directory) whose own
//!   config holds the session to the router and the two static protocols
//!   `xlb_vips4`/`xlb_vips6` that include the agent's routes files
//!   (`xlb-vips4`/`xlb-vips6`, created empty before BIRD starts), as
//!   `lb_agent::bgp::bird` documents.
//!   With [`Sessions::Agent`] ([`EcmpLab::start_agent_sessions`]) the node
//!   BIRD's config includes `bird-peers` instead, the session the agent
//!   writes from `bgp.peers` (with BFD, and BFD on the router's side too).
//! * ExaBGP: `exabgp` with `--root` the node's directory (its API pipes
//!   `<p>-nI.in`/`.out`, made with mkfifo before it starts, in `run/`) and
//!   `exabgp.env` (`[exabgp.api] cli, ack, pipename`); its config holds the
//!   session to the router.
//!
//! With [`Topology::RouteReflector`] (the paper's topology) a fifth kind of
//! namespace joins the router's bridge:
//!
//! ```text
//!  <p>-rr  route reflector  eth0 10.101.0.2/24 (port rr of the router's br0),
//!                           gobgpd (API on 127.0.0.1:50051), AS 65000
//! ```
//!
//! and every BGP session changes: the nodes' speakers (AS 65000) peer with
//! the reflector, which takes them as dynamic neighbours (10.101.0.8/29) and
//! reflects their paths to the router over one iBGP session with ADD-PATH
//! (see [`EcmpLab::rr_config`]); the router's BIRD has that one session
//! (`add paths rx`). Traffic still flows router -> node directly.
//!
//! Every session has a hold time of 3 s. The router's BIRD peers with the
//! three nodes over the bridge and installs what it learns into its kernel
//! table with `merge paths on` (ECMP), and hashes flows over the next hops
//! by L4 (`fib_multipath_hash_policy=1`).
//!
//! The ends of the node veths that have no XDP program (the router's and the
//! backend LAN's bridge ports) have GRO on (XDP_REDIRECT into a veth needs
//! it), and every non-XDP end has TX checksum offload off (XDP cannot complete
//! partial checksums). Processes are started with `nsenter --net` (not `ip
//! netns exec`, which remounts /sys and hides bpffs).
//!
//! Names are `xe<pid><d>-...` (`<d>`: `g`, `b` or `x`, the driver; `xe<pid>r<d>` for
//! the route reflector topology), so
//! parallel runs, and the three drivers' tests in one run, do not collide;
//! leftovers of a killed run (its pid gone) are removed by the next one. Dropping the lab
//! (test passed or panicked) kills every process it started, detaches and
//! unpins the agents' programs (`lb-agent --cleanup`) and deletes the
//! namespaces.

use std::{
    collections::BTreeSet,
    fs,
    io::{self, Read, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Output, Stdio},
    time::{Duration, Instant},
};

use crate::{
    netns::{sh, Netns},
    topology::{agent_bin, http_get, in_netns, strip_ansi, wait_for_port, write_atomic},
    traffic::poll_until,
};

pub use crate::topology::{BACKEND_PORT, VIP};

/// Number of LB nodes.
pub const NODES: usize = 3;
/// Number of nginx backends.
pub const BACKENDS: usize = 3;
pub const ROUTER_ASN: u32 = 65000;
pub const NODE_ASN: u32 = 65001;
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(10, 100, 0, 2);
/// The restart time of [`EcmpLab::start_graceful`]'s speakers.
pub const GRACEFUL_RESTART_TIME: Duration = Duration::from_secs(30);
/// The client's network; the backends route it over the three nodes.
const CLIENT_NET: &str = "10.100.0.0/24";
/// The router's address on the nodes' segment (their BGP neighbour).
pub const ROUTER_IP: Ipv4Addr = Ipv4Addr::new(10, 101, 0, 1);
/// The BGP hold time of the node-router sessions (both sides propose it).
pub const HOLD_TIME: Duration = Duration::from_secs(3);
/// gobgpd's API port, on 127.0.0.1 in each node namespace.
pub const GOBGP_API_PORT: u16 = 50051;
/// The agents' metrics port, on 127.0.0.1 in each node namespace.
pub const METRICS_PORT: u16 = 9469;
/// Where each node's agent shares SNAT flows with the others (on its LAN
/// address, `flow_sync:`).
pub const FLOW_SYNC_PORT: u16 = 7947;
/// The VIP's service port.
pub const VIP_PORT: u16 = 80;

/// The route reflector's address on the nodes' segment
/// ([`Topology::RouteReflector`]).
pub const RR_IP: Ipv4Addr = Ipv4Addr::new(10, 101, 0, 2);
/// The addresses the route reflector accepts sessions from without a
/// neighbour entry each (its dynamic neighbours): 10.101.0.8-15, the nodes.
pub const RR_DYNAMIC_RANGE: &str = "10.101.0.8/29";
/// The route reflector's gobgpd API port, on 127.0.0.1 in its namespace.
pub const RR_API_PORT: u16 = 50051;

/// How the nodes reach the router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Topology {
    /// Every node's speaker peers with the router (eBGP, AS 65001 to 65000).
    Direct,
    /// As in the paper (IEICE 2019, Fig. 4 and Appendix C): every node's
    /// speaker peers with a GoBGP route reflector (iBGP, all in AS 65000),
    /// which accepts them as dynamic neighbours of a peer group (no entry
    /// per node) and passes all their paths for a VIP to the router with
    /// ADD-PATH; the router's BIRD receives them (`add paths rx`) and merges
    /// them into one ECMP route.
    RouteReflector,
}

/// The BGP speaker on the nodes, driven by the agent's `bgp.driver`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Driver {
    GoBgp,
    Bird,
    ExaBgp,
    /// FRR's bgpd (with zebra and bfdd beside it), driven through vtysh.
    Frr,
}

impl Driver {
    /// The `bgp.driver` value.
    pub fn name(self) -> &'static str {
        match self {
            Driver::GoBgp => "gobgp",
            Driver::Bird => "bird",
            Driver::ExaBgp => "exabgp",
            Driver::Frr => "frr",
        }
    }

    /// The letter after the pid in the lab's names.
    fn tag(self) -> char {
        match self {
            Driver::GoBgp => 'g',
            Driver::Bird => 'b',
            Driver::ExaBgp => 'x',
            Driver::Frr => 'f',
        }
    }

    /// The speaker's process name (for messages).
    pub fn daemon(self) -> &'static str {
        match self {
            Driver::GoBgp => "gobgpd",
            Driver::Bird => "bird",
            Driver::ExaBgp => "exabgp",
            Driver::Frr => "bgpd",
        }
    }
}

/// Node `i`'s (1-based) uplink address: its next hop and BGP router id.
pub fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 101, 0, 10 + i as u8)
}

/// Node `i`'s address on the backend LAN (its SNAT address).
pub fn node_backend_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 102, 0, 10 + i as u8)
}

/// Backend `n`'s (1-based) address.
pub fn backend_ip(n: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 102, 0, 20 + n as u8)
}

/// The node (1-based) whose uplink address is `hop`.
pub fn node_of_hop(hop: Ipv4Addr) -> Option<usize> {
    (1..=NODES).find(|&i| node_ip(i) == hop)
}

/// Starts `lb-agent` in `ns` with `config` and `pin_dir`, output to `log`,
/// at the log level `XLB_AGENT_LOG` names (default `info`).
pub(crate) fn spawn_agent_in(ns: &Netns, log: &Path, config: &Path, pin_dir: &Path) -> Child {
    let level = std::env::var("XLB_AGENT_LOG").unwrap_or_else(|_| "info".into());
    spawn_in(
        ns,
        log,
        &agent_bin(),
        &[
            "--config",
            config.to_str().unwrap(),
            "--pin-dir",
            pin_dir.to_str().unwrap(),
            "--log",
            &level,
        ],
    )
}

/// Starts `program` in `ns` (its network namespace only), output to `log`.
pub(crate) fn spawn_in(ns: &Netns, log: &Path, program: &Path, args: &[&str]) -> Child {
    let log = fs::File::options()
        .create(true)
        .append(true)
        .open(log)
        .unwrap_or_else(|e| panic!("open {}: {e}", log.display()));
    Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{}", ns.name))
        .arg(program)
        .args(args)
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup log"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()))
}

/// Runs `program` in `ns` to completion.
fn output_in(ns: &Netns, program: &str, args: &[&str]) -> Output {
    Command::new("nsenter")
        .arg(format!("--net=/var/run/netns/{}", ns.name))
        .arg(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"))
}

pub(crate) fn kill_child(c: &mut Option<Child>) {
    if let Some(mut c) = c.take() {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// The last `n` lines of a file (for failure reports).
fn tail(path: &Path, n: usize) -> String {
    let text = strip_ansi(&fs::read_to_string(path).unwrap_or_default());
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// One LB node: its namespace, BGP speaker and `lb-agent`.
pub struct Node {
    /// 1-based.
    pub index: usize,
    pub driver: Driver,
    pub ns: Netns,
    pub pin_dir: PathBuf,
    pub config_path: PathBuf,
    dir: PathBuf,
    /// The lab's prefix (`xe<pid><d>`).
    prefix: String,
    /// The speaker's BGP neighbour (the router, or the route reflector),
    /// its AS, and the node's own AS.
    pub peer_ip: Ipv4Addr,
    pub peer_asn: u32,
    pub asn: u32,
    agent: Option<Child>,
    speaker: Option<Child>,
    /// FRR's zebra and bfdd (bgpd is `speaker`): they keep running when
    /// bgpd is killed, as under FRR's watchfrr.
    frr_helpers: Vec<Child>,
    agent_starts: usize,
    speaker_starts: usize,
    /// The speaker runs with BGP graceful restart (see
    /// [`EcmpLab::start_graceful`]).
    graceful_restart: bool,
    /// Who writes the speaker's session to the router.
    sessions: Sessions,
}

/// Who configures a node speaker's BGP session to the router.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sessions {
    /// The speaker's own config (BIRD, ExaBGP) or the agent's `bgp.peers`
    /// (GoBGP): how each driver has always run in the lab.
    Speaker,
    /// The agent's `bgp.peers` (with `bfd` if set) for BIRD: the agent
    /// writes the node BIRD's `protocol bgp` into `bird-peers` (which the
    /// node's bird.conf includes) and the session comes up with the agent.
    /// With `bfd`, the router runs BFD with the nodes too.
    Agent { bfd: bool },
}

impl Node {
    pub fn ip(&self) -> Ipv4Addr {
        node_ip(self.index)
    }

    fn agent_log_path(&self) -> PathBuf {
        self.dir.join(format!("agent-{}.log", self.agent_starts))
    }

    fn speaker_log_path(&self) -> PathBuf {
        self.dir.join(format!(
            "{}-{}.log",
            self.driver.daemon(),
            self.speaker_starts
        ))
    }

    /// The base of the BIRD driver's routes files (`<base>4`, `<base>6`).
    pub fn bird_routes_file(&self) -> PathBuf {
        self.dir.join("xlb-vips")
    }

    /// FRR's directory (its config, vty sockets and pid files), owned
    /// by the `frr` user its daemons run as.
    pub fn frr_dir(&self) -> PathBuf {
        self.dir.join("frr")
    }

    /// The node BIRD's control socket.
    pub fn bird_socket(&self) -> PathBuf {
        self.dir.join("bird.ctl")
    }

    /// ExaBGP's pipe directory (`run/` under its `--root`).
    pub fn exabgp_pipe_dir(&self) -> PathBuf {
        self.dir.join("run")
    }

    /// ExaBGP's pipe name: unique, as ExaBGP looks in /run first.
    pub fn exabgp_pipe_name(&self) -> String {
        format!("{}-n{}", self.prefix, self.index)
    }

    /// The driver's part of the agent's `bgp` mapping (GoBGP's `peers`, the
    /// `bird` or `exabgp` key, indented for `bgp:`), ending with a newline.
    pub fn speaker_config(&self) -> String {
        match self.driver {
            Driver::GoBgp => format!(
                "  peers:\n\
                 \x20   - {{ address: {peer}, asn: {asn}, hold_time: {hold}s{gr} }}\n",
                peer = self.peer_ip,
                asn = self.peer_asn,
                hold = HOLD_TIME.as_secs(),
                gr = if self.graceful_restart {
                    format!(", graceful_restart: {}s", GRACEFUL_RESTART_TIME.as_secs())
                } else {
                    String::new()
                }
            ),
            Driver::Bird => {
                let mut s = format!(
                    "  bird:\n\
                     \x20   routes_file: {}\n\
                     \x20   socket: {}\n\
                     \x20   protocol: xlb_vips\n",
                    self.bird_routes_file().display(),
                    self.bird_socket().display()
                );
                if let Sessions::Agent { bfd } = self.sessions {
                    s.push_str(&format!("  asn: {}\n", self.asn));
                    s.push_str(&self.agent_peers(bfd));
                }
                s
            }
            Driver::ExaBgp => format!(
                "  exabgp:\n\
                 \x20   pipe_dir: {}\n\
                 \x20   pipe_name: {}\n",
                self.exabgp_pipe_dir().display(),
                self.exabgp_pipe_name()
            ),
            Driver::Frr => {
                let mut s = format!(
                    "  asn: {}\n\
                     \x20 frr:\n\
                     \x20   socket_dir: {dir}\n\
                     \x20   config_dir: {dir}\n",
                    self.asn,
                    dir = self.frr_dir().display()
                );
                if let Sessions::Agent { bfd } = self.sessions {
                    s.push_str(&self.agent_peers(bfd));
                }
                s
            }
        }
    }

    /// The agent's `bgp.peers`: the router, with BFD if `bfd`.
    fn agent_peers(&self, bfd: bool) -> String {
        format!(
            "  peers:\n\
             \x20   - {{ address: {peer}, asn: {peer_asn}, hold_time: {hold}s, keepalive: 1s{bfd}{gr} }}\n",
            peer = self.peer_ip,
            peer_asn = self.peer_asn,
            hold = HOLD_TIME.as_secs(),
            bfd = if bfd { ", bfd: {}" } else { "" },
            gr = if self.graceful_restart {
                format!(", graceful_restart: {}s", GRACEFUL_RESTART_TIME.as_secs())
            } else {
                String::new()
            }
        )
    }

    /// Writes the speaker's configuration files (and, for BIRD, the empty
    /// routes files; for ExaBGP, its pipes).
    fn prepare_speaker(&self) {
        let hold = HOLD_TIME.as_secs();
        let ip = self.ip();
        let (peer, peer_asn, asn) = (self.peer_ip, self.peer_asn, self.asn);
        match self.driver {
            Driver::GoBgp => fs::write(
                self.dir.join("gobgpd.toml"),
                format!("[global.config]\n  as = {asn}\n  router-id = \"{ip}\"\n"),
            )
            .unwrap(),
            Driver::Bird => {
                // Empty at first; a restarted BIRD finds what the agent wrote.
                let base = self.bird_routes_file().display().to_string();
                let peers_file = self.dir.join("bird-peers").display().to_string();
                for path in [format!("{base}4"), format!("{base}6"), peers_file.clone()] {
                    if !Path::new(&path).exists() {
                        fs::write(path, "").unwrap();
                    }
                }
                let session = match self.sessions {
                    Sessions::Agent { .. } => format!(
                        "# The session to the router: the agent's bgp.peers.\ninclude \"{peers_file}\";\n"
                    ),
                    Sessions::Speaker => format!(
                        r#"protocol bgp upstream {{
  local {ip} as {asn};
  neighbor {peer} as {peer_asn};
  hold time {hold};
  keepalive time 1;
  connect delay time 1;
  connect retry time 1;
  error wait time 1, 2;
  {gr}
  ipv4 {{ import none; export where proto = "xlb_vips4"; }};
}}
"#,
                        gr = if self.graceful_restart {
                            format!(
                                "graceful restart on; graceful restart time {};",
                                GRACEFUL_RESTART_TIME.as_secs()
                            )
                        } else {
                            String::new()
                        }
                    ),
                };
                fs::write(
                    self.dir.join("bird.conf"),
                    format!(
                        r#"router id {ip};
log "{log}" all;
protocol device {{ scan time 1; }}
# The VIPs' blackhole routes must never reach the node's kernel table.
protocol kernel {{
  ipv4 {{ import none; export where proto != "xlb_vips4"; }};
}}
protocol static xlb_vips4 {{
  ipv4;
  include "{base}4";
}}
protocol static xlb_vips6 {{
  ipv6;
  include "{base}6";
}}
{session}"#,
                        log = self.dir.join("bird.log").display(),
                    ),
                )
                .unwrap();
            }
            Driver::Frr => {
                let dir = self.frr_dir();
                fs::create_dir_all(&dir).unwrap();
                sh(&format!("chown frr:frr {}", dir.display()));
                // The instance is FRR's own; the agent adds its VIPs (and,
                // with agent sessions, the router) to it.
                let session = match self.sessions {
                    Sessions::Agent { .. } => String::new(),
                    Sessions::Speaker => format!(
                        " neighbor {peer} remote-as {peer_asn}\n \
                         neighbor {peer} timers 1 {hold}\n \
                         neighbor {peer} timers connect 1\n{gr}",
                        gr = if self.graceful_restart {
                            format!(" neighbor {peer} graceful-restart\n")
                        } else {
                            String::new()
                        }
                    ),
                };
                let gr = if self.graceful_restart {
                    format!(
                        " bgp graceful-restart restart-time {}\n \
                         bgp graceful-restart preserve-fw-state\n",
                        GRACEFUL_RESTART_TIME.as_secs()
                    )
                } else {
                    // FRR offers graceful restart (as a helper) by default,
                    // and the router would keep a killed bgpd's routes for
                    // its restart time (120 s): off, as in the other labs.
                    " bgp graceful-restart-disable\n".to_string()
                };
                // vtysh saves the whole config into frr.conf (the agent's
                // `write memory`); a restarted FRR reads what was saved.
                fs::write(dir.join("vtysh.conf"), "service integrated-vtysh-config\n").unwrap();
                if dir.join("frr.conf").exists() {
                    return;
                }
                fs::write(
                    dir.join("frr.conf"),
                    format!(
                        "frr defaults traditional\n\
                         hostname n{i}\n\
                         !\n\
                         router bgp {asn}\n \
                         bgp router-id {ip}\n \
                         no bgp ebgp-requires-policy\n\
                         {gr}{session}\
                         exit\n",
                        i = self.index
                    ),
                )
                .unwrap();
            }
            Driver::ExaBgp => {
                let pipes = self.exabgp_pipe_dir();
                fs::create_dir_all(&pipes).unwrap();
                for end in ["in", "out"] {
                    let p = pipes.join(format!("{}.{end}", self.exabgp_pipe_name()));
                    if !p.exists() {
                        sh(&format!("mkfifo -m 0600 {}", p.display()));
                    }
                }
                fs::write(
                    self.dir.join("exabgp.env"),
                    format!(
                        "[exabgp.api]\n\
                         cli = true\n\
                         ack = true\n\
                         pipename = '{}'\n\
                         \n\
                         [exabgp.daemon]\n\
                         daemonize = false\n\
                         user = 'root'\n\
                         pid = ''\n\
                         \n\
                         [exabgp.log]\n\
                         destination = 'stdout'\n\
                         \n\
                         [exabgp.tcp]\n\
                         bind = ''\n",
                        self.exabgp_pipe_name()
                    ),
                )
                .unwrap();
                fs::write(
                    self.dir.join("exabgp.conf"),
                    format!(
                        "neighbor {peer} {{\n\
                         \x20   router-id {ip};\n\
                         \x20   local-address {ip};\n\
                         \x20   local-as {asn};\n\
                         \x20   peer-as {peer_asn};\n\
                         \x20   hold-time {hold};\n\
                         \x20   family {{\n\
                         \x20       ipv4 unicast;\n\
                         \x20   }}\n\
                         {gr}\
                         }}\n",
                        gr = if self.graceful_restart {
                            format!(
                                "    capability {{\n        graceful-restart {};\n    }}\n",
                                GRACEFUL_RESTART_TIME.as_secs()
                            )
                        } else {
                            String::new()
                        }
                    ),
                )
                .unwrap();
            }
        }
    }

    /// Starts the speaker. GoBGP: `gobgpd` with an empty RIB and no
    /// neighbours (the agent adds the router); waits until its API accepts
    /// connections. BIRD and ExaBGP: the daemon with its session to the
    /// router (see [`EcmpLab::wait_sessions`]).
    pub fn start_speaker(&mut self) {
        assert!(
            self.speaker.is_none(),
            "node {}: {} running",
            self.index,
            self.driver.daemon()
        );
        self.prepare_speaker();
        let restarted = self.speaker_starts > 0;
        self.speaker_starts += 1;
        let log = self.speaker_log_path();
        let d = |f: &str| self.dir.join(f).display().to_string();
        let child = match self.driver {
            Driver::GoBgp => {
                let api = format!("127.0.0.1:{GOBGP_API_PORT}");
                let mut args = vec![
                    "-f".to_string(),
                    d("gobgpd.toml"),
                    "--api-hosts".into(),
                    api,
                    "--pprof-disable".into(),
                    "-p".into(),
                    "-l".into(),
                    "info".into(),
                ];
                if self.graceful_restart {
                    // As the chart runs it: a start cannot tell a restart.
                    args.push("-r".into());
                }
                let args: Vec<&str> = args.iter().map(String::as_str).collect();
                spawn_in(&self.ns, &log, Path::new("gobgpd"), &args)
            }
            Driver::Bird => {
                let (conf, ctl) = (d("bird.conf"), d("bird.ctl"));
                let mut args = vec!["-f", "-c", &conf, "-s", &ctl];
                if self.graceful_restart && restarted {
                    args.push("-R");
                }
                spawn_in(&self.ns, &log, Path::new("bird"), &args)
            }
            Driver::Frr => {
                let dir = self.frr_dir();
                let daemon = |name: &str| {
                    let args = crate::bgp_lab::frr_daemon_args(&dir, name);
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    let log = self.dir.join(format!("{name}-{}.log", self.speaker_starts));
                    spawn_in(&self.ns, &log, &crate::bgp_lab::frr_daemon(name), &args)
                };
                if self.frr_helpers.is_empty() {
                    let zebra = daemon("zebra");
                    let sock = self.frr_dir().join("zserv.api");
                    poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
                        sock.exists().then_some(()).ok_or(())
                    })
                    .unwrap_or_else(|()| panic!("node {}: zebra did not start", self.index));
                    self.frr_helpers = vec![zebra, daemon("bfdd")];
                }
                daemon("bgpd")
            }
            Driver::ExaBgp => spawn_in(
                &self.ns,
                &log,
                Path::new("exabgp"),
                &[
                    "--root",
                    &self.dir.display().to_string(),
                    "--env",
                    &d("exabgp.env"),
                    &d("exabgp.conf"),
                ],
            ),
        };
        self.speaker = Some(child);
        match self.driver {
            Driver::GoBgp => wait_for_port(
                &self.ns,
                SocketAddr::from((Ipv4Addr::LOCALHOST, GOBGP_API_PORT)),
            ),
            Driver::Bird => {
                let sock = self.bird_socket();
                poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
                    if sock.exists() {
                        return Ok(());
                    }
                    let child = self.speaker.as_mut().unwrap();
                    if let Ok(Some(st)) = child.try_wait() {
                        panic!(
                            "node {}: BIRD exited ({st}): {}",
                            self.index,
                            tail(&self.speaker_log_path(), 20)
                        );
                    }
                    Err(())
                })
                .unwrap_or_else(|()| {
                    panic!(
                        "node {}: BIRD did not start: {}",
                        self.index,
                        tail(&self.speaker_log_path(), 20)
                    )
                });
            }
            Driver::Frr => {
                poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
                    if self
                        .vtysh(&["show", "running-config"])
                        .contains("\nrouter bgp ")
                    {
                        return Ok(());
                    }
                    let child = self.speaker.as_mut().unwrap();
                    if let Ok(Some(st)) = child.try_wait() {
                        panic!(
                            "node {}: bgpd exited ({st}): {}",
                            self.index,
                            tail(&self.speaker_log_path(), 20)
                        );
                    }
                    Err(())
                })
                .unwrap_or_else(|()| {
                    panic!(
                        "node {}: bgpd did not start: {}",
                        self.index,
                        tail(&self.speaker_log_path(), 20)
                    )
                });
            }
            Driver::ExaBgp => {}
        }
    }

    /// [`start_speaker`](Self::start_speaker) of a GoBGP node.
    pub fn start_gobgpd(&mut self) {
        assert_eq!(self.driver, Driver::GoBgp);
        self.start_speaker();
    }

    /// [`kill_speaker`](Self::kill_speaker) of a GoBGP node.
    pub fn kill_gobgpd(&mut self) {
        assert_eq!(self.driver, Driver::GoBgp);
        self.kill_speaker();
    }

    /// SIGKILLs the speaker (its TCP sessions are closed by the kernel).
    /// For ExaBGP, also waits until its API helper process (which holds the
    /// pipes) has noticed and exited.
    pub fn kill_speaker(&mut self) {
        assert!(
            self.speaker.is_some(),
            "node {}: no {}",
            self.index,
            self.driver.daemon()
        );
        kill_child(&mut self.speaker);
        match self.driver {
            Driver::GoBgp | Driver::Frr => return,
            Driver::Bird => {
                let _ = fs::remove_file(self.bird_socket());
                return;
            }
            Driver::ExaBgp => {}
        }
        poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
            let agent = self.agent_pid();
            let left: Vec<i32> = crate::netns::pids(&self.ns.name)
                .into_iter()
                .filter(|p| Some(*p) != agent)
                .collect();
            if left.is_empty() {
                Ok(())
            } else {
                Err(left)
            }
        })
        .unwrap_or_else(|left| {
            panic!(
                "node {}: processes {left:?} still run after killing {}",
                self.index,
                self.driver.daemon()
            )
        });
    }

    /// Writes the agent's config file (atomically; a running agent notices
    /// within 500 ms).
    pub fn write_config(&self, yaml: &str) {
        write_atomic(&self.config_path, yaml);
    }

    /// Starts `lb-agent` with `yaml` as its config (which must set
    /// `metrics_addr: 127.0.0.1:9469`); does not wait (see
    /// [`wait_agent_ready`](Self::wait_agent_ready)).
    pub fn spawn_agent(&mut self, yaml: &str) {
        assert!(self.agent.is_none(), "node {}: agent running", self.index);
        self.write_config(yaml);
        self.agent_starts += 1;
        let log = self.agent_log_path();
        let _ = fs::remove_file(&log);
        let child = spawn_agent_in(&self.ns, &log, &self.config_path, &self.pin_dir);
        self.agent = Some(child);
    }

    /// Waits (at most 30 s) until the agent's /readyz answers 200.
    pub fn wait_agent_ready(&mut self) {
        poll_until(Duration::from_secs(30), Duration::from_millis(50), || {
            let child = self.agent.as_mut().expect("agent started");
            if let Some(st) = child.try_wait().expect("wait lb-agent") {
                panic!(
                    "node {}: lb-agent exited ({st}) before ready; log:\n{}",
                    self.index,
                    self.agent_log()
                );
            }
            match self.get("/readyz") {
                Ok((200, _)) => Ok(()),
                _ => Err(()),
            }
        })
        .unwrap_or_else(|()| {
            panic!(
                "node {}: lb-agent not ready within 30 s; log:\n{}",
                self.index,
                self.agent_log()
            )
        });
    }

    /// [`spawn_agent`](Self::spawn_agent) and wait until ready.
    pub fn start_agent(&mut self, yaml: &str) {
        self.spawn_agent(yaml);
        self.wait_agent_ready();
    }

    pub fn agent_pid(&self) -> Option<i32> {
        self.agent.as_ref().map(|c| c.id() as i32)
    }

    /// Whether the agent process runs.
    pub fn agent_running(&mut self) -> bool {
        self.agent
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Sends SIGTERM to the agent (does not wait).
    pub fn sigterm_agent(&self) {
        self.signal_agent(libc::SIGTERM);
    }

    /// Sends `sig` to the agent (does not wait).
    pub fn signal_agent(&self, sig: i32) {
        let pid = self.agent_pid().expect("agent running");
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(pid, sig) };
        assert_eq!(rc, 0, "kill: {}", io::Error::last_os_error());
    }

    /// Waits (at most `timeout`) for the agent to exit; returns its status.
    pub fn wait_agent_exit(&mut self, timeout: Duration) -> ExitStatus {
        let exited = poll_until(timeout, Duration::from_millis(10), || {
            let child = self.agent.as_mut().expect("agent started");
            child.try_wait().expect("wait lb-agent").ok_or(())
        });
        match exited {
            Ok(st) => {
                self.agent = None;
                st
            }
            Err(()) => {
                let log = self.agent_log();
                kill_child(&mut self.agent);
                panic!(
                    "node {}: lb-agent did not exit within {timeout:?}; log:\n{log}",
                    self.index
                );
            }
        }
    }

    /// SIGKILLs the agent (no withdraw; the program stays attached).
    pub fn kill_agent(&mut self) {
        assert!(self.agent.is_some(), "node {}: no agent", self.index);
        kill_child(&mut self.agent);
    }

    /// When the current (or last) agent logged its last line containing
    /// `text` (from the line's timestamp): when the agent did something,
    /// whatever the test was doing meanwhile.
    pub fn agent_logged_at(&self, text: &str) -> Option<std::time::SystemTime> {
        let log = self.agent_log();
        let line = log.lines().rev().find(|l| l.contains(text))?;
        humantime::parse_rfc3339_weak(line.split_whitespace().next()?).ok()
    }

    /// The current (or last) agent's output.
    pub fn agent_log(&self) -> String {
        strip_ansi(&fs::read_to_string(self.agent_log_path()).unwrap_or_default())
    }

    /// GET `path` from the agent's metrics endpoint (inside the node namespace).
    pub fn get(&self, path: &str) -> io::Result<(u16, String)> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, METRICS_PORT));
        let path = path.to_string();
        in_netns(&self.ns, move || {
            http_get(addr, &path, Duration::from_secs(5))
        })
        .join()
        .expect("metrics thread")
    }

    /// `lbctl --pin-dir <this node's> --json ARGS`, parsed.
    pub fn lbctl_json(&self, args: &[&str]) -> serde_json::Value {
        crate::topology::lbctl_json_in(None, &self.pin_dir, args).1
    }

    /// `birdc` against this node's BIRD (BIRD driver).
    pub fn birdc(&self, args: &[&str]) -> String {
        let out = Command::new("birdc")
            .arg("-s")
            .arg(self.bird_socket())
            .args(args)
            .output()
            .expect("run birdc");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `vtysh -c "ARGS"` against this node's FRR (output and errors).
    pub fn vtysh(&self, args: &[&str]) -> String {
        let out = Command::new("vtysh")
            .arg("--vty_socket")
            .arg(self.frr_dir())
            .arg("-c")
            .arg(args.join(" "))
            .output()
            .expect("run vtysh");
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// The `gobgp` CLI against this node's `gobgpd`.
    pub fn gobgp(&self, args: &[&str]) -> String {
        let port = GOBGP_API_PORT.to_string();
        let mut a = vec!["-p", &port];
        a.extend_from_slice(args);
        let out = output_in(&self.ns, "gobgp", &a);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
}

/// The whole lab. See the module documentation.
pub struct EcmpLab {
    pub prefix: String,
    /// Configs and logs.
    pub dir: PathBuf,
    pub client: Netns,
    pub router: Netns,
    pub lan: Netns,
    pub backends: Vec<Netns>,
    pub nodes: Vec<Node>,
    pub topology: Topology,
    /// The route reflector's namespace and gobgpd ([`Topology::RouteReflector`]).
    pub rr: Option<Netns>,
    rr_gobgpd: Option<Child>,
    bird: Option<Child>,
    /// `ip -ts monitor route` in the router (its FIB's history, for failure reports).
    route_monitor: Option<Child>,
    nginx: Vec<Option<Child>>,
    /// `bgp.graceful_shutdown` in the agents' configs (none: off).
    pub graceful_shutdown: Option<Duration>,
    /// The router runs BFD with the nodes ([`Sessions::Agent`] with `bfd`).
    pub bfd: bool,
}

/// Removes the namespaces, pins and processes of earlier runs that were
/// killed before their `Drop` ran (their pid no longer exists).
fn sweep_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    let mut stale_prefixes = BTreeSet::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix("xe") else {
            continue;
        };
        let Some((id, _)) = rest.split_once('-') else {
            continue;
        };
        // `<pid>`, `<pid><driver letter>` or `<pid><tag><driver letter>`.
        let pid = id.trim_end_matches(|c: char| c.is_ascii_lowercase());
        if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) || id.len() > pid.len() + 2 {
            continue;
        }
        if Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        // Processes left in it (speakers, bird, nginx, lb-agent).
        if let Ok(p) = Command::new("ip").args(["netns", "pids", name]).output() {
            for pid in String::from_utf8_lossy(&p.stdout).split_whitespace() {
                if let Ok(pid) = pid.parse::<i32>() {
                    // SAFETY: kill(2); the process is in a namespace of ours.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
            }
        }
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        let _ = fs::remove_dir_all(std::env::temp_dir().join(format!("xlb-xe{id}")));
        stale_prefixes.insert(format!("xe{id}-"));
    }
    if let Ok(entries) = fs::read_dir("/sys/fs/bpf") {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(rest) = name.strip_prefix("xlb-") {
                if stale_prefixes.iter().any(|p| rest.starts_with(p.as_str())) {
                    let _ = Command::new(agent_bin())
                        .arg("--cleanup")
                        .arg("--pin-dir")
                        .arg(e.path())
                        .output();
                }
            }
        }
    }
}

impl EcmpLab {
    /// [`start_with`](Self::start_with) the GoBGP driver.
    pub fn start() -> Self {
        Self::start_with(Driver::GoBgp)
    }

    /// Builds the namespaces and links, starts the backends' nginx, the
    /// router's BIRD and every node's speaker (for BIRD and ExaBGP, waits
    /// until their sessions are established). No agent runs yet.
    pub fn start_with(driver: Driver) -> Self {
        Self::start_with_topology(driver, Topology::Direct)
    }

    /// [`start_with`](Self::start_with) in the given topology. With
    /// [`Topology::RouteReflector`], the route reflector starts before the
    /// nodes' speakers, and its session with the router is established
    /// before this returns.
    pub fn start_with_topology(driver: Driver, topology: Topology) -> Self {
        let tag = match topology {
            Topology::Direct => None,
            Topology::RouteReflector => Some('r'),
        };
        Self::start_lab(driver, topology, tag, false, Sessions::Speaker)
    }

    /// A lab with directly peered nodes whose names carry `tag` (a lowercase
    /// letter other than `r`), so that it can run beside the plain lab of
    /// the same driver in one test process.
    pub fn start_tagged(driver: Driver, tag: char) -> Self {
        assert!(tag.is_ascii_lowercase() && tag != 'r', "tag {tag:?}");
        Self::start_lab(
            driver,
            Topology::Direct,
            Some(tag),
            false,
            Sessions::Speaker,
        )
    }

    /// [`start_tagged`](Self::start_tagged), the nodes' speakers with BGP
    /// graceful restart ([`GRACEFUL_RESTART_TIME`]): GoBGP's peer gets
    /// `graceful_restart` in the agent's config and `gobgpd` always runs with
    /// `-r`; BIRD has `graceful restart on` and runs with `-R` when
    /// restarted; ExaBGP has `capability { graceful-restart }` (its routes
    /// come back only with the agent's next apply: docs/bgp.md). The
    /// router's BIRD is a helper by its default (`graceful restart aware`).
    pub fn start_graceful(driver: Driver, tag: char) -> Self {
        assert!(tag.is_ascii_lowercase() && tag != 'r', "tag {tag:?}");
        Self::start_lab(driver, Topology::Direct, Some(tag), true, Sessions::Speaker)
    }

    /// A lab of BIRD nodes whose sessions to the router the agents write
    /// (`bgp.peers`, with BFD if `bfd`; the router then runs BFD with
    /// them: 100 ms both ways, 3 missed). The sessions come up with the
    /// agents, not before.
    pub fn start_agent_sessions(tag: char, bfd: bool) -> Self {
        Self::start_agent_sessions_with(Driver::Bird, tag, bfd)
    }

    /// [`start_agent_sessions`](Self::start_agent_sessions) with BIRD or
    /// FRR on the nodes.
    pub fn start_agent_sessions_with(driver: Driver, tag: char, bfd: bool) -> Self {
        assert!(tag.is_ascii_lowercase() && tag != 'r', "tag {tag:?}");
        assert!(matches!(driver, Driver::Bird | Driver::Frr), "{driver:?}");
        Self::start_lab(
            driver,
            Topology::Direct,
            Some(tag),
            false,
            Sessions::Agent { bfd },
        )
    }

    fn start_lab(
        driver: Driver,
        topology: Topology,
        tag: Option<char>,
        graceful_restart: bool,
        sessions: Sessions,
    ) -> Self {
        sweep_stale();
        let tag = tag.map(String::from).unwrap_or_default();
        let prefix = format!("xe{}{tag}{}", std::process::id(), driver.tag());
        let dir = std::env::temp_dir().join(format!("xlb-{prefix}"));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        // The nodes' shared secret for the flow exchange.
        fs::write(dir.join("cluster.key"), "xlb-ecmp-lab-flow-sync-key\n").unwrap();

        let client = Netns::new(&format!("{prefix}-c"));
        let router = Netns::new(&format!("{prefix}-r"));
        let lan = Netns::new(&format!("{prefix}-bl"));
        let mut lab = EcmpLab {
            prefix: prefix.clone(),
            dir: dir.clone(),
            client,
            router,
            lan,
            backends: Vec::new(),
            nodes: Vec::new(),
            topology,
            rr: None,
            rr_gobgpd: None,
            bird: None,
            route_monitor: None,
            nginx: Vec::new(),
            graceful_shutdown: None,
            bfd: sessions == Sessions::Agent { bfd: true },
        };
        let (c, r, l) = (
            lab.client.name.clone(),
            lab.router.name.clone(),
            lab.lan.name.clone(),
        );

        // Client <-> router.
        sh(&format!(
            "ip link add rc netns {r} type veth peer name eth0 netns {c}"
        ));
        lab.client.run(
            "ip addr add 10.100.0.2/24 dev eth0 && ip link set eth0 up \
             && ip route add default via 10.100.0.1 && ethtool -K eth0 gro on tx off >/dev/null",
        );
        lab.router.run(
            "ip addr add 10.100.0.1/24 dev rc && ip link set rc up \
             && ethtool -K rc tx off >/dev/null \
             && ip link add br0 type bridge forward_delay 0 && ip addr add 10.101.0.1/24 dev br0 \
             && ip link set br0 up \
             && sysctl -qw net.ipv4.ip_forward=1 net.ipv4.fib_multipath_hash_policy=1",
        );
        // A port that stays up: a bridge whose ports are all down loses its
        // carrier and BIRD drops every session on it at once, where a real
        // segment leaves a vanished node to the hold timer.
        lab.router.run(
            "ip link add keep0 type veth peer name keep1 && ip link set keep0 master br0 \
             && ip link set keep1 up && ip link set keep0 up",
        );
        // The backend LAN.
        lab.lan
            .run("ip link add br0 type bridge forward_delay 0 && ip link set br0 up");
        for n in 1..=BACKENDS {
            let b = Netns::new(&format!("{prefix}-b{n}"));
            sh(&format!(
                "ip link add b{n} netns {l} type veth peer name eth0 netns {b}",
                b = b.name
            ));
            lab.lan.run(&format!(
                "ip link set b{n} master br0 && ethtool -K b{n} gro on tx off >/dev/null && ip link set b{n} up"
            ));
            b.run(&format!(
                "ip addr add {}/24 dev eth0 && ip link set eth0 up && ethtool -K eth0 gro on tx off >/dev/null",
                backend_ip(n)
            ));
            // Replies to the client (nat mode) go back through any node,
            // hashed by L4 ports: rarely the node that forwarded the request.
            b.run(&format!(
                "sysctl -qw net.ipv4.fib_multipath_hash_policy=1 && ip route add {CLIENT_NET} \
                 nexthop via {} nexthop via {} nexthop via {}",
                node_backend_ip(1),
                node_backend_ip(2),
                node_backend_ip(3)
            ));
            lab.backends.push(b);
        }
        // The nodes: uplink to the router's bridge, downlink to the LAN.
        for i in 1..=NODES {
            let ns = Netns::new(&format!("{prefix}-n{i}"));
            let node_dir = dir.join(format!("n{i}"));
            fs::create_dir_all(&node_dir).unwrap();
            sh(&format!(
                "ip link add uplink netns {n} type veth peer name n{i} netns {r}",
                n = ns.name
            ));
            sh(&format!(
                "ip link add lan netns {n} type veth peer name n{i} netns {l}",
                n = ns.name
            ));
            lab.router.run(&format!(
                "ip link set n{i} master br0 && ethtool -K n{i} gro on tx off >/dev/null && ip link set n{i} up"
            ));
            lab.lan.run(&format!(
                "ip link set n{i} master br0 && ethtool -K n{i} gro on tx off >/dev/null && ip link set n{i} up"
            ));
            ns.run(&format!(
                "ip addr add {}/24 dev uplink && ip link set uplink up \
                 && ip addr add {}/24 dev lan && ip link set lan up \
                 && ip route add default via {ROUTER_IP} && sysctl -qw net.ipv4.ip_forward=1",
                node_ip(i),
                node_backend_ip(i)
            ));
            let pin_dir = PathBuf::from(format!("/sys/fs/bpf/xlb-{prefix}-n{i}"));
            let (peer_ip, peer_asn, asn) = match topology {
                Topology::Direct => (ROUTER_IP, ROUTER_ASN, NODE_ASN),
                // iBGP: the reflector and its clients share the router's AS.
                Topology::RouteReflector => (RR_IP, ROUTER_ASN, ROUTER_ASN),
            };
            lab.nodes.push(Node {
                index: i,
                driver,
                ns,
                config_path: node_dir.join("agent.yaml"),
                pin_dir,
                dir: node_dir,
                prefix: prefix.clone(),
                peer_ip,
                peer_asn,
                asn,
                agent: None,
                speaker: None,
                frr_helpers: Vec::new(),
                agent_starts: 0,
                speaker_starts: 0,
                graceful_restart,
                sessions,
            });
        }

        for n in 1..=BACKENDS {
            let child = lab.start_nginx(n);
            lab.nginx.push(Some(child));
        }
        for n in 1..=BACKENDS {
            wait_for_port(
                &lab.backends[n - 1],
                SocketAddr::from((backend_ip(n), BACKEND_PORT)),
            );
        }
        lab.start_bird();
        if topology == Topology::RouteReflector {
            lab.start_route_reflector();
        }
        for node in &mut lab.nodes {
            node.start_speaker();
        }
        if driver != Driver::GoBgp && sessions == Sessions::Speaker {
            let all: Vec<usize> = (1..=NODES).collect();
            lab.wait_sessions(&all, Duration::from_secs(20));
        }
        lab
    }

    /// The route reflector: a namespace on the router's bridge (10.101.0.2)
    /// running gobgpd with the config of [`rr_config`](Self::rr_config).
    /// Waits until its session with the router is established.
    fn start_route_reflector(&mut self) {
        let ns = Netns::new(&format!("{}-rr", self.prefix));
        sh(&format!(
            "ip link add rr netns {r} type veth peer name eth0 netns {n}",
            r = self.router.name,
            n = ns.name
        ));
        self.router
            .run("ip link set rr master br0 && ip link set rr up");
        ns.run(&format!(
            "ip addr add {RR_IP}/24 dev eth0 && ip link set eth0 up && ip link set lo up"
        ));
        let conf = self.dir.join("rr-gobgpd.toml");
        fs::write(&conf, Self::rr_config()).unwrap();
        let api = format!("127.0.0.1:{RR_API_PORT}");
        let child = spawn_in(
            &ns,
            &self.dir.join("rr-gobgpd.log"),
            Path::new("gobgpd"),
            &[
                "-f",
                conf.to_str().unwrap(),
                "--api-hosts",
                &api,
                "--pprof-disable",
                "-p",
                "-l",
                "info",
            ],
        );
        self.rr_gobgpd = Some(child);
        wait_for_port(&ns, SocketAddr::from((Ipv4Addr::LOCALHOST, RR_API_PORT)));
        self.rr = Some(ns);
        poll_until(Duration::from_secs(20), Duration::from_millis(20), || {
            let s = self.birdc(&["show", "protocols", "reflector"]);
            if s.contains("Established") {
                Ok(())
            } else {
                Err(s)
            }
        })
        .unwrap_or_else(|s| {
            panic!(
                "the router's session with the route reflector: {s}\n{}",
                self.logs()
            )
        });
    }

    /// The route reflector's gobgpd config (TOML), as the paper's Appendix C
    /// with gobgpd 3.x keys: a peer group of route-reflector clients whose
    /// members are whoever connects from [`RR_DYNAMIC_RANGE`] (gobgpd stays
    /// passive towards them), and the router as an ordinary iBGP neighbour
    /// to which it sends up to 8 paths per prefix (ADD-PATH), so that the
    /// router learns one path per node instead of the reflector's best.
    pub fn rr_config() -> String {
        let hold = HOLD_TIME.as_secs();
        format!(
            r#"[global.config]
  as = {ROUTER_ASN}
  router-id = "{RR_IP}"

[[peer-groups]]
  [peer-groups.config]
    peer-group-name = "lb-nodes"
    peer-as = {ROUTER_ASN}
  [peer-groups.timers.config]
    hold-time = {hold}
    keepalive-interval = 1
  [peer-groups.route-reflector.config]
    route-reflector-client = true
    route-reflector-cluster-id = "{RR_IP}"
  [[peer-groups.afi-safis]]
    [peer-groups.afi-safis.config]
      afi-safi-name = "ipv4-unicast"

[[dynamic-neighbors]]
  [dynamic-neighbors.config]
    prefix = "{RR_DYNAMIC_RANGE}"
    peer-group = "lb-nodes"

[[neighbors]]
  [neighbors.config]
    neighbor-address = "{ROUTER_IP}"
    peer-as = {ROUTER_ASN}
  [neighbors.timers.config]
    connect-retry = 1
    hold-time = {hold}
    keepalive-interval = 1
  [[neighbors.afi-safis]]
    [neighbors.afi-safis.config]
      afi-safi-name = "ipv4-unicast"
    [neighbors.afi-safis.add-paths.config]
      send-max = 8
"#
        )
    }

    /// The `gobgp` CLI against the route reflector's gobgpd.
    pub fn rr_gobgp(&self, args: &[&str]) -> String {
        let ns = self.rr.as_ref().expect("route reflector topology");
        let port = RR_API_PORT.to_string();
        let mut a = vec!["-p", &port];
        a.extend_from_slice(args);
        let out = output_in(ns, "gobgp", &a);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// Waits until the sessions of `nodes` are established: with the router
    /// (`birdc show protocols nI`), or with the route reflector (`gobgp
    /// neighbor`, where a dynamic neighbour appears once connected).
    /// Waits until the router's session with node `i` is established and
    /// its graceful restart is over (BIRD shows no restart timer: the
    /// node's End-of-RIB came, and what it did not announce again is gone).
    pub fn wait_graceful_restart_over(&self, i: usize, timeout: Duration) {
        let protocol = format!("n{i}");
        poll_until(timeout, Duration::from_millis(20), || {
            let p = self.birdc(&["show", "protocols", "all", &protocol]);
            if p.contains("Established") && !p.contains("Restart timer") {
                Ok(())
            } else {
                Err(p)
            }
        })
        .unwrap_or_else(|p| panic!("node {i}: graceful restart not over in {timeout:?}: {p}"));
    }

    pub fn wait_sessions(&self, nodes: &[usize], timeout: Duration) {
        // One deadline for all nodes: each waits only for what is left.
        let deadline = Instant::now() + timeout;
        for &i in nodes {
            let remaining = deadline.saturating_duration_since(Instant::now());
            poll_until(remaining, Duration::from_millis(20), || {
                let s = match self.topology {
                    Topology::Direct => self.birdc(&["show", "protocols", &format!("n{i}")]),
                    Topology::RouteReflector => self.rr_gobgp(&["neighbor"]),
                };
                let up = match self.topology {
                    Topology::Direct => s.contains("Established"),
                    Topology::RouteReflector => s.lines().any(|l| {
                        l.split_whitespace().next() == Some(&node_ip(i).to_string())
                            && l.contains("Establ")
                    }),
                };
                if up {
                    Ok(())
                } else {
                    Err(s)
                }
            })
            .unwrap_or_else(|s| {
                panic!(
                    "node {i}: no session with the router within {timeout:?}: {s}\n{}",
                    self.logs()
                )
            });
        }
    }

    /// Waits (at most 20 s) until the agents of `nodes` have done the flow
    /// exchange's pulls of their start: the last comes a second after the
    /// node announced, and takes the flows the others opened meanwhile.
    /// Connections opened before it may be pulled in the middle of a test
    /// that counts each flow's owner.
    pub fn wait_start_pulls(&self, nodes: &[usize]) {
        for &i in nodes {
            poll_until(Duration::from_secs(20), Duration::from_millis(50), || {
                self.nodes[i - 1]
                    .agent_log()
                    .contains("the start's pulls are done")
                    .then_some(())
                    .ok_or(())
            })
            .unwrap_or_else(|()| {
                panic!(
                    "node {i}: the start's flow pulls not done within 20 s:\n{}",
                    self.nodes[i - 1].agent_log()
                )
            });
        }
    }

    /// Node `i`'s config: the snat web service on every backend with `weight`,
    /// announced through the node's speaker.
    pub fn agent_config(&self, i: usize, weight: u32) -> String {
        self.agent_config_in(i, weight, "snat")
    }

    /// As [`agent_config`](Self::agent_config), the service in `mode`
    /// (`nat` or `snat`). In nat mode the backends' replies reach the
    /// client through any of the nodes (their route to it has all three).
    pub fn agent_config_in(&self, i: usize, weight: u32, mode: &str) -> String {
        let backends: Vec<(usize, u32)> = (1..=BACKENDS).map(|n| (n, weight)).collect();
        self.agent_config_with(i, mode, &backends)
    }

    /// As [`agent_config_in`](Self::agent_config_in) with only the backends
    /// `(n, weight)` of `backends`, in that order.
    pub fn agent_config_with(&self, i: usize, mode: &str, backends: &[(usize, u32)]) -> String {
        let mut s = format!(
            "interfaces: [uplink, lan]\n\
             snat_ipv4: {snat}\n\
             metrics_addr: 127.0.0.1:{METRICS_PORT}\n\
             services:\n\
             \x20 - name: web\n\
             \x20   vip: {VIP}\n\
             \x20   port: 80\n\
             \x20   protocol: tcp\n\
             \x20   mode: {mode}\n\
             \x20   backends:\n",
            snat = node_backend_ip(i)
        );
        for &(n, weight) in backends {
            s.push_str(&format!(
                "      - {{ ip: {}, port: {BACKEND_PORT}, weight: {weight} }}\n",
                backend_ip(n)
            ));
        }
        let peers: Vec<String> = (1..=NODES)
            .filter(|&n| n != i)
            .map(|n| format!("{}:{FLOW_SYNC_PORT}", node_backend_ip(n)))
            .collect();
        s.push_str(&format!(
            "flow_sync:\n\
             \x20 listen: {}:{FLOW_SYNC_PORT}\n\
             \x20 peers: [{}]\n\
             \x20 key_file: {}\n",
            node_backend_ip(i),
            peers.join(", "),
            self.dir.join("cluster.key").display()
        ));
        let node = &self.nodes[i - 1];
        s.push_str(&format!(
            "bgp:\n\
             \x20 driver: {driver}\n\
             \x20 next_hop_ipv4: {hop}\n\
             \x20 drain_time: 1s\n\
             \x20 resync_interval: 1s\n\
             {graceful}\
             {speaker}",
            driver = node.driver.name(),
            hop = node_ip(i),
            graceful = self
                .graceful_shutdown
                .map(|d| format!("  graceful_shutdown: {}ms\n", d.as_millis()))
                .unwrap_or_default(),
            speaker = node.speaker_config()
        ));
        s
    }

    pub fn node(&mut self, i: usize) -> &mut Node {
        &mut self.nodes[i - 1]
    }

    /// Stops backend `n`'s nginx as a Pod's termination does: SIGQUIT (it
    /// finishes the requests under way, closes its idle keep-alive
    /// connections and exits); waits (at most 10 s) for it to exit.
    pub fn stop_backend(&mut self, n: usize) {
        let mut child = self.nginx[n - 1].take().expect("nginx running");
        // SAFETY: kill(2) on our own child's pid.
        let rc = unsafe { libc::kill(child.id() as i32, libc::SIGQUIT) };
        assert_eq!(rc, 0, "kill: {}", io::Error::last_os_error());
        let exited = poll_until(Duration::from_secs(10), Duration::from_millis(10), || {
            child.try_wait().expect("wait nginx").ok_or(())
        });
        if exited.is_err() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("backend {n}: nginx did not exit within 10 s of SIGQUIT");
        }
    }

    /// Starts backend `n`'s nginx again (after [`stop_backend`](Self::stop_backend))
    /// and waits until it accepts connections.
    pub fn start_backend(&mut self, n: usize) {
        assert!(self.nginx[n - 1].is_none(), "backend {n}: nginx running");
        let child = self.start_nginx(n);
        self.nginx[n - 1] = Some(child);
        wait_for_port(
            &self.backends[n - 1],
            SocketAddr::from((backend_ip(n), BACKEND_PORT)),
        );
    }

    /// nginx answering `GET /` with `b<n>` (as in `topology`).
    fn start_nginx(&self, n: usize) -> Child {
        let d = self.dir.join(format!("nginx-b{n}"));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("nginx.conf"), crate::topology::nginx_config(&d, n)).unwrap();
        spawn_in(
            &self.backends[n - 1],
            &d.join("stderr.log"),
            Path::new("nginx"),
            &["-c", &d.join("nginx.conf").to_string_lossy()],
        )
    }

    fn bird_conf(&self) -> String {
        let mut s = format!(
            r#"router id {ROUTER_IP};
log "{log}" all;
protocol device {{ scan time 1; }}
protocol kernel {{
  ipv4 {{ import none; export all; }};
  merge paths on;
}}
# RFC 8326: a path marked GRACEFUL_SHUTDOWN is the least preferred, so that
# traffic leaves it (it drops out of the ECMP set) before its withdrawal.
filter honour_graceful_shutdown {{
  if (65535, 0) ~ bgp_community then bgp_local_pref = 0;
  accept;
}}
template bgp lbnode {{
  local {ROUTER_IP} as {ROUTER_ASN};
  hold time {hold};
  keepalive time 1;
  connect delay time 1;
  connect retry time 1;
  error wait time 1, 2;
  ipv4 {{ import filter honour_graceful_shutdown; export none; }};
  {bfd}
}}
"#,
            log = self.dir.join("bird.log").display(),
            hold = HOLD_TIME.as_secs(),
            bfd = if self.bfd { "bfd on;" } else { "" }
        );
        if self.bfd {
            s.push_str(
                "protocol bfd {\n  interface \"br0\" { min rx interval 100 ms; \
                 min tx interval 100 ms; multiplier 3; };\n}\n",
            );
        }
        match self.topology {
            Topology::Direct => {
                for i in 1..=NODES {
                    s.push_str(&format!(
                        "protocol bgp n{i} from lbnode {{ neighbor {} as {NODE_ASN}; }}\n",
                        node_ip(i)
                    ));
                }
            }
            // One iBGP session, to the reflector, carrying every node's path
            // (ADD-PATH receive). `direct`: the reflector is on br0, so the
            // next hops (the nodes, on br0 too) are used as they are, where
            // iBGP's default (multihop) would resolve them through an IGP.
            Topology::RouteReflector => s.push_str(&format!(
                r#"protocol bgp reflector {{
  local {ROUTER_IP} as {ROUTER_ASN};
  neighbor {RR_IP} as {ROUTER_ASN};
  hold time {hold};
  keepalive time 1;
  connect delay time 1;
  connect retry time 1;
  error wait time 1, 2;
  direct;
  ipv4 {{ import filter honour_graceful_shutdown; export none; add paths rx; }};
}}
"#,
                hold = HOLD_TIME.as_secs()
            )),
        }
        s
    }

    fn start_bird(&mut self) {
        let conf = self.dir.join("bird.conf");
        fs::write(&conf, self.bird_conf()).unwrap();
        let sock = self.dir.join("bird.ctl");
        let child = spawn_in(
            &self.router,
            &self.dir.join("bird.out"),
            Path::new("bird"),
            &[
                "-f",
                "-c",
                conf.to_str().unwrap(),
                "-s",
                sock.to_str().unwrap(),
            ],
        );
        self.bird = Some(child);
        self.route_monitor = Some(spawn_in(
            &self.router,
            &self.dir.join("routes.log"),
            Path::new("ip"),
            &["-ts", "-4", "monitor", "route"],
        ));
        poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
            if sock.exists() {
                Ok(())
            } else {
                Err(())
            }
        })
        .unwrap_or_else(|()| {
            panic!(
                "BIRD did not start: {}",
                tail(&self.dir.join("bird.out"), 20)
            )
        });
    }

    /// `birdc` against the router's BIRD.
    pub fn birdc(&self, args: &[&str]) -> String {
        let out = Command::new("birdc")
            .arg("-s")
            .arg(self.dir.join("bird.ctl"))
            .args(args)
            .output()
            .expect("run birdc");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The router's BGP path to the VIP from node `i`, with its attributes
    /// (`birdc show route for VIP all protocol n<i>`; a lab with the nodes
    /// peered directly); `None` without one.
    pub fn router_path_from(&self, i: usize) -> Option<String> {
        let (vip, protocol) = (VIP.to_string(), format!("n{i}"));
        let out = self.birdc(&["show", "route", "for", &vip, "all", "protocol", &protocol]);
        // A path names its protocol: `192.0.2.10/32 unicast [n1 12:00:00.000] ...`.
        out.contains(&format!("[{protocol} ")).then_some(out)
    }

    /// Node `i` goes silent with its link up, as a hung node or a broken
    /// forwarding path looks from the router: the router's bridge drops
    /// every frame from and to the node's port (nftables, bridge family),
    /// so that only a timer (BFD, or BGP's hold time) tells. One `nft`
    /// command; [`unsilence`](Self::unsilence) undoes it.
    pub fn silence(&self, i: usize) -> Result<(), String> {
        let rules = self.dir.join(format!("silence-n{i}.nft"));
        fs::write(
            &rules,
            format!(
                "table bridge xlb_silence_n{i} {{\n\
                 \x20 chain through {{ type filter hook forward priority 0; iifname \"n{i}\" drop; oifname \"n{i}\" drop; }}\n\
                 \x20 chain to_router {{ type filter hook input priority 0; iifname \"n{i}\" drop; }}\n\
                 \x20 chain from_router {{ type filter hook output priority 0; oifname \"n{i}\" drop; }}\n\
                 }}\n"
            ),
        )
        .map_err(|e| format!("{}: {e}", rules.display()))?;
        self.nft(&["-f", &rules.display().to_string()])
    }

    /// Undoes [`silence`](Self::silence).
    pub fn unsilence(&self, i: usize) -> Result<(), String> {
        self.nft(&["delete", "table", "bridge", &format!("xlb_silence_n{i}")])
    }

    fn nft(&self, args: &[&str]) -> Result<(), String> {
        let out = Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", self.router.name))
            .arg("nft")
            .args(args)
            .output()
            .map_err(|e| format!("nft: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "nft {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(())
    }

    /// The router's kernel route to the VIP (`ip route show 192.0.2.10`).
    pub fn router_route(&self) -> String {
        let out = Command::new("ip")
            .args(["-n", &self.router.name, "-4", "route", "show"])
            .arg(VIP.to_string())
            .output()
            .expect("run ip route");
        assert!(out.status.success(), "ip route: {out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// The next hops of the router's kernel route to the VIP (empty without one).
    pub fn router_next_hops(&self) -> BTreeSet<Ipv4Addr> {
        let route = self.router_route();
        let words: Vec<&str> = route.split_whitespace().collect();
        words
            .windows(2)
            .filter(|w| w[0] == "via")
            .map(|w| {
                w[1].parse()
                    .unwrap_or_else(|e| panic!("next hop {:?} in {route:?}: {e}", w[1]))
            })
            .collect()
    }

    /// Waits (at most 30 s) until the router's FIB has exactly the next hops
    /// of `nodes`; else says what it has.
    pub fn wait_next_hops(&self, nodes: &[usize]) -> Result<(), String> {
        let want = Self::hops(nodes);
        poll_until(Duration::from_secs(30), Duration::from_millis(20), || {
            if self.router_next_hops() == want {
                Ok(())
            } else {
                Err(self.router_route())
            }
        })
        .map_err(|fib| format!("the router's FIB is {fib:?} 30 s on, not next hops {want:?}"))
    }

    /// The next hops of the nodes `nodes` (1-based).
    pub fn hops(nodes: &[usize]) -> BTreeSet<Ipv4Addr> {
        nodes.iter().map(|&i| node_ip(i)).collect()
    }

    /// Runs `f` on a thread in the client namespace.
    pub fn in_client<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        in_netns(&self.client, f).join().expect("client thread")
    }

    /// The tails of every log (for failure messages).
    pub fn logs(&self) -> String {
        let mut s = String::new();
        let mut add = |name: String, path: PathBuf| {
            if path.exists() {
                s.push_str(&format!("--- {name} ---\n{}\n", tail(&path, 30)));
            }
        };
        add("bird.log".into(), self.dir.join("bird.log"));
        add("bird.out".into(), self.dir.join("bird.out"));
        add("router FIB changes".into(), self.dir.join("routes.log"));
        add(
            "route reflector gobgpd".into(),
            self.dir.join("rr-gobgpd.log"),
        );
        for n in &self.nodes {
            add(
                format!("node {} {}", n.index, n.driver.daemon()),
                n.speaker_log_path(),
            );
            if n.driver == Driver::Bird {
                add(format!("node {} bird.log", n.index), n.dir.join("bird.log"));
            }
            add(format!("node {} lb-agent", n.index), n.agent_log_path());
        }
        s
    }
}

impl Drop for EcmpLab {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        if panicking {
            eprintln!(
                "ECMP lab {} failed; logs under {}:\n{}\n--- birdc show protocols ---\n{}",
                self.prefix,
                self.dir.display(),
                self.logs(),
                self.birdc(&["show", "protocols"])
            );
        }
        for n in &mut self.nodes {
            kill_child(&mut n.agent);
            kill_child(&mut n.speaker);
        }
        // What the speakers started on their own (ExaBGP's API helper).
        for n in &self.nodes {
            for pid in crate::netns::pids(&n.ns.name) {
                // SAFETY: kill(2); the process is in a namespace of ours.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        kill_child(&mut self.rr_gobgpd);
        kill_child(&mut self.bird);
        kill_child(&mut self.route_monitor);
        for c in &mut self.nginx {
            kill_child(c);
        }
        for n in &self.nodes {
            if n.pin_dir.exists() {
                let out = Command::new(agent_bin())
                    .arg("--cleanup")
                    .arg("--pin-dir")
                    .arg(&n.pin_dir)
                    .env("NO_COLOR", "1")
                    .output();
                match out {
                    Ok(o) if o.status.success() => {}
                    other => eprintln!(
                        "lb-agent --cleanup --pin-dir {}: {other:?}",
                        n.pin_dir.display()
                    ),
                }
            }
        }
        if !panicking {
            let _ = fs::remove_dir_all(&self.dir);
        }
        // The Netns fields delete the namespaces (and with them the links).
    }
}

// ---------------------------------------------------------------------------
// Client traffic.

/// A TCP connection from `src` to `dst` (bound to the given source port,
/// so that every connection of a test has a port of its choosing). Call it
/// from a thread in the client namespace.
pub fn connect_from(
    src: SocketAddrV4,
    dst: SocketAddrV4,
    timeout: Duration,
) -> io::Result<TcpStream> {
    fn sockaddr(a: SocketAddrV4) -> libc::sockaddr_in {
        libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: a.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*a.ip()).to_be(),
            },
            sin_zero: [0; 8],
        }
    }
    fn check(rc: libc::c_int) -> io::Result<()> {
        if rc < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor we own (OwnedFd closes it
    // on every path), with properly sized sockaddr_in and option values.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        check(fd)?;
        let fd = OwnedFd::from_raw_fd(fd);
        let socket_option = |name: libc::c_int, value: *const libc::c_void, len: usize| {
            check(libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                name,
                value,
                len as libc::socklen_t,
            ))
        };
        let one: libc::c_int = 1;
        socket_option(
            libc::SO_REUSEADDR,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of_val(&one),
        )?;
        // Linux bounds a blocking connect by the send timeout.
        let tv = libc::timeval {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_usec: timeout.subsec_micros() as libc::suseconds_t,
        };
        socket_option(
            libc::SO_SNDTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of_val(&tv),
        )?;
        let s = sockaddr(src);
        check(libc::bind(
            fd.as_raw_fd(),
            (&s as *const libc::sockaddr_in).cast(),
            len,
        ))?;
        let d = sockaddr(dst);
        let connect = check(libc::connect(
            fd.as_raw_fd(),
            (&d as *const libc::sockaddr_in).cast(),
            len,
        ));
        match connect {
            // A signal to the process (a child's exit) interrupts a connect
            // with a timeout, and the handshake goes on in the kernel: wait
            // for its outcome instead of calling it a failed connection.
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                };
                let deadline = std::time::Instant::now() + timeout;
                loop {
                    let left = deadline.saturating_duration_since(std::time::Instant::now());
                    let rc = libc::poll(&mut p, 1, left.as_millis() as libc::c_int);
                    if rc > 0 {
                        break;
                    }
                    if rc == 0 {
                        return Err(io::Error::from(io::ErrorKind::TimedOut));
                    }
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
                let mut err: libc::c_int = 0;
                let mut err_len = std::mem::size_of_val(&err) as libc::socklen_t;
                check(libc::getsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_ERROR,
                    (&mut err as *mut libc::c_int).cast(),
                    &mut err_len,
                ))?;
                if err != 0 {
                    return Err(io::Error::from_raw_os_error(err));
                }
            }
            other => other?,
        }
        Ok(TcpStream::from(fd))
    }
}

/// One `GET /` to the VIP from client port `port` (on a new connection,
/// which nginx closes after answering); returns the backend's name (`b1`...).
/// Call it from a thread in the client namespace.
pub fn request_from(port: u16) -> io::Result<String> {
    request_from_within(port, Duration::from_secs(5))
}

/// [`request_from`] giving up on the connection, the request and the
/// answer after `timeout` each.
pub fn request_from_within(port: u16, timeout: Duration) -> io::Result<String> {
    let mut s = connect_from(
        SocketAddrV4::new(CLIENT_IP, port),
        SocketAddrV4::new(VIP, VIP_PORT),
        timeout,
    )?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf);
    match text.split_once("\r\n\r\n") {
        Some((head, body)) if head.starts_with("HTTP/1.1 200") => Ok(body.trim().to_string()),
        _ => Err(io::Error::other(format!("bad response {text:?}"))),
    }
}
