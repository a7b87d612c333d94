//! The chaos run: the ECMP lab ([`crate::ecmp`]: a BIRD router spreading
//! the VIP over three nodes, three nginx backends) under keep-alive
//! connections and a stream of new ones, taken through events in a seeded
//! random order. `cargo xtask bench chaos` runs 200 events a lab;
//! `tests/tests/chaos_e2e.rs` runs 20.
//!
//! The events, each on a node (or backend) drawn among those it can happen to:
//!
//! * `agent-kill`: the agent is SIGKILLed (an OOM kill) and started again;
//!   the program stays attached and forwards meanwhile;
//! * `agent-term`: SIGTERM (withdraw, drain, exit) and a new agent: a Pod
//!   replaced by a rollout;
//! * `agent-restart`: SIGUSR2 (exit keeping the program and the routes) and
//!   a new agent;
//! * `speaker-kill`: the node's BGP speaker is SIGKILLed and started again.
//!   The lab runs without graceful restart, so the router drops the node's
//!   routes at once and takes them back when the session returns;
//! * `leave`: SIGTERM; the node stays out until a `join`;
//! * `join`: a node that left starts its agent again;
//! * `link-cut`: the node's cable to the router goes down until the
//!   router's hold timer (3 s) has dropped the node, then comes back;
//! * `backend-death`: a backend's Pod ends as Kubernetes ends one: it
//!   leaves every node's config (the EndpointSlice update), then its nginx
//!   gets SIGQUIT (finishes what it is doing, closes idle keep-alive
//!   connections, exits), and a new one takes its place and its config entry;
//! * `config-reload`: a backend's weight flips between 1 and 2 in every
//!   node's config, node after node.
//!
//! Events come one after another, 0-0.5 s apart, but do not wait for what
//! they start to settle: a speaker killed is still reconnecting, a link
//! just healed is still without its session, when the next event comes, and
//! a node that left stays out across other events. Two rules keep a path to
//! the VIP: an event that takes a node out of the router's FIB
//! (`agent-term`, `speaker-kill`, `leave`, `link-cut`) happens only when two
//! nodes are in, after the FIB has them all; a backend dies only when
//! another is present. The kind drawn is the least used of those that can
//! happen (ties at random), so a short run has every kind.
//!
//! What is counted:
//!
//! * lost: a keep-alive connection that failed (an error, or no answer
//!   within [`CLIENT_TIMEOUT`]) while its backend lived. One whose backend
//!   was stopped after it opened ended with its backend (counted apart:
//!   nginx closes every connection it holds when it stops, and no load
//!   balancer keeps them);
//! * failed new: a new connection (the stream, or one replacing a
//!   keep-alive connection) whose request failed or got no answer within
//!   [`CLIENT_TIMEOUT`];
//! * (printed, not counted) after each event, every keep-alive flow opened
//!   2 s before or more that a node that is in lacks or translates
//!   otherwise: every node should have every flow;
//! * invariant breaks: a keep-alive connection answered by another backend
//!   than before; an agent that exited by itself; the router's FIB not back
//!   to the nodes that are in within 30 s; a node's Maglev table not
//!   following a config change within 10 s, or, at the end, the nodes'
//!   tables differing.

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use rand::{rngs::SmallRng, seq::IndexedRandom, Rng, SeedableRng};

use crate::{
    ecmp::{backend_ip, request_from_within, Driver, EcmpLab, BACKENDS, NODES, VIP, VIP_PORT},
    topology::{in_netns, HttpConn, BACKEND_PORT},
    traffic::poll_until,
};

/// The events, by name.
pub const KINDS: [&str; 9] = [
    "agent-kill",
    "agent-term",
    "agent-restart",
    "speaker-kill",
    "leave",
    "join",
    "link-cut",
    "backend-death",
    "config-reload",
];

/// How long a client waits for a connection, and then for each answer,
/// before it counts a failure: long enough for TCP to retransmit over a
/// path the router has not yet given up (a SYN is resent at 1, 3 and 7 s),
/// as real clients wait.
pub const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

/// One chaos run.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The nodes' speaker.
    pub driver: Driver,
    /// The service's mode: `snat` (with flow sync) or `nat`.
    pub mode: &'static str,
    pub seed: u64,
    pub events: usize,
    /// Keep-alive connections.
    pub conns: usize,
}

/// What a run counted.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub events: usize,
    /// Keep-alive connections established (the first ones and those that
    /// replaced a failed one).
    pub established: u64,
    pub lost: u64,
    /// Keep-alive connections that ended with their backend's Pod.
    pub ended_with_backend: u64,
    pub new_made: u64,
    pub new_failed: u64,
    pub breaks: Vec<String>,
    /// Events by kind.
    pub kinds: BTreeMap<&'static str, usize>,
}

impl Outcome {
    /// `chaos: N events, lost X of Y established, failed Z of W new, invariant breaks B`.
    pub fn line(&self) -> String {
        format!(
            "chaos: {} events, lost {} of {} established, failed {} of {} new, invariant breaks {}",
            self.events,
            self.lost,
            self.established,
            self.new_failed,
            self.new_made,
            self.breaks.len()
        )
    }

    /// This and `other` together.
    pub fn add(&mut self, other: &Outcome) {
        self.events += other.events;
        self.established += other.established;
        self.lost += other.lost;
        self.ended_with_backend += other.ended_with_backend;
        self.new_made += other.new_made;
        self.new_failed += other.new_failed;
        self.breaks.extend(other.breaks.iter().cloned());
        for (k, n) in &other.kinds {
            *self.kinds.entry(k).or_default() += n;
        }
    }

    /// Whether the goal holds: nothing lost, failed or broken.
    pub fn clean(&self) -> bool {
        self.lost == 0 && self.new_failed == 0 && self.breaks.is_empty()
    }
}

/// The client's side, shared by its two threads and the run.
struct Client {
    start: Instant,
    stop: AtomicBool,
    established: AtomicU64,
    lost: AtomicU64,
    ended_with_backend: AtomicU64,
    new_made: AtomicU64,
    new_failed: AtomicU64,
    /// Full passes over the keep-alive connections.
    passes: AtomicU64,
    /// When each backend (`b1`...) was last stopped.
    deaths: Mutex<BTreeMap<String, Instant>>,
    breaks: Mutex<Vec<String>>,
    /// The nodes' pin directories (for `lbctl` when something fails).
    pin_dirs: Vec<std::path::PathBuf>,
    /// The keep-alive connections' client ports, with when they opened.
    open_ports: Mutex<BTreeMap<u16, Instant>>,
    /// Keep-alive connections opened from each client port.
    ports_used: Mutex<BTreeMap<u16, u32>>,
}

impl Client {
    fn say(&self, what: &str) {
        println!("{:8.1} s    {what}", self.start.elapsed().as_secs_f64());
    }

    fn broke(&self, what: String) {
        self.say(&format!("INVARIANT BROKEN: {what}"));
        self.breaks.lock().unwrap().push(what);
    }

    /// Prints, at once, what each node's program has said so far that is
    /// neither a forward nor a packet for someone else, and its flow of
    /// the client's `port`: what a failure needs to be understood before
    /// the port is used again.
    fn explain(&self, port: u16) {
        let client_ip = crate::ecmp::CLIENT_IP.to_string();
        for (i, pin_dir) in self.pin_dirs.iter().enumerate() {
            let lbctl = |args: &[&str]| crate::topology::lbctl_json_in(None, pin_dir, args).1;
            let odd: Vec<String> = lbctl(&["stats"])["reasons"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|r| r["total"].as_u64().unwrap_or(0) > 0)
                .filter_map(|r| r["reason"].as_str().map(|n| (n, r["total"].clone())))
                .filter(|(n, _)| {
                    !matches!(*n, "tx" | "redirect" | "pass_no_service" | "pass_not_ip")
                })
                .map(|(n, t)| format!("{n} {t}"))
                .collect();
            self.say(&format!(
                "  node {}'s other verdicts: {}",
                i + 1,
                odd.join(", ")
            ));
            let flows = lbctl(&["conntrack", "--client", &client_ip]);
            for e in flows["entries"].as_array().into_iter().flatten() {
                let p = e["client"]
                    .as_str()
                    .and_then(|c| c.parse::<SocketAddr>().ok())
                    .map(|c| c.port());
                if p == Some(port) {
                    self.say(&format!("  node {}'s flow: {e}", i + 1));
                }
            }
        }
    }

    /// A new connection to the VIP and its first answer (the backend's
    /// name), counted as a new connection.
    fn open(&self) -> Option<KeepAlive> {
        self.new_made.fetch_add(1, Ordering::Relaxed);
        let sent = Instant::now();
        let vip = SocketAddr::from((VIP, VIP_PORT));
        let opened = HttpConn::connect(vip, CLIENT_TIMEOUT).and_then(|mut http| {
            let backend = http.get()?;
            Ok((http, backend))
        });
        match opened {
            Ok((http, backend)) => {
                self.established.fetch_add(1, Ordering::Relaxed);
                if let Ok(a) = http.stream.local_addr() {
                    *self.ports_used.lock().unwrap().entry(a.port()).or_default() += 1;
                    self.open_ports
                        .lock()
                        .unwrap()
                        .insert(a.port(), Instant::now());
                }
                Some(KeepAlive {
                    http,
                    backend,
                    opened: sent,
                })
            }
            Err(e) => {
                self.new_failed.fetch_add(1, Ordering::Relaxed);
                self.say(&format!(
                    "FAILED: a new keep-alive connection, after {:.1} s: {e}",
                    sent.elapsed().as_secs_f64()
                ));
                None
            }
        }
    }

    /// The keep-alive connections: `conns` of them, each making a request
    /// on every pass; one that fails is counted and replaced.
    fn keep_alive(&self, conns: usize) {
        let mut conns: Vec<Option<KeepAlive>> = (0..conns).map(|_| None).collect();
        while !self.stop.load(Ordering::Relaxed) {
            for slot in conns.iter_mut() {
                if let Some(c) = slot {
                    let asked = Instant::now();
                    let port = c.http.stream.local_addr().map(|a| a.port()).unwrap_or(0);
                    let answer = c.http.get();
                    if answer.is_err() {
                        self.open_ports.lock().unwrap().remove(&port);
                    }
                    match answer {
                        Ok(b) if b == c.backend => {}
                        Ok(b) => {
                            self.broke(format!(
                                "a keep-alive connection of {} was answered by {b}",
                                c.backend
                            ));
                            *slot = None;
                        }
                        Err(e) => {
                            let died = self.deaths.lock().unwrap().get(&c.backend).copied();
                            // Its nginx closes every connection it holds
                            // when stopped, and none opens to it between its
                            // leaving the tables and its death.
                            if died.is_some_and(|d| d > c.opened) {
                                self.ended_with_backend.fetch_add(1, Ordering::Relaxed);
                            } else {
                                self.lost.fetch_add(1, Ordering::Relaxed);
                                let before = self.ports_used.lock().unwrap().get(&port).copied();
                                self.say(&format!(
                                    "LOST: keep-alive connection from port {port} to {} after {:.1} s: {e} \
                                     (the port's connections so far: {})",
                                    c.backend,
                                    asked.elapsed().as_secs_f64(),
                                    before.unwrap_or(0)
                                ));
                                self.explain(port);
                            }
                            *slot = None;
                        }
                    }
                }
                if slot.is_none() {
                    *slot = self.open();
                }
            }
            self.passes.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// New connections one after another, each from its own port (below
    /// the ephemeral range the keep-alive connections use), one request each.
    fn new_connections(&self) {
        let mut port = 10000u16;
        while !self.stop.load(Ordering::Relaxed) {
            let sent = Instant::now();
            match request_from_within(port, CLIENT_TIMEOUT) {
                Ok(_) => {
                    self.new_made.fetch_add(1, Ordering::Relaxed);
                }
                // The port's previous connection still lingers in the
                // client's kernel: nothing was sent; the next port is tried.
                Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {}
                Err(e) => {
                    self.new_made.fetch_add(1, Ordering::Relaxed);
                    self.new_failed.fetch_add(1, Ordering::Relaxed);
                    self.say(&format!(
                        "FAILED: new connection from port {port} after {:.1} s: {e}",
                        sent.elapsed().as_secs_f64()
                    ));
                    self.explain(port);
                }
            }
            port = if port == 30000 { 10000 } else { port + 1 };
        }
    }
}

struct KeepAlive {
    http: HttpConn,
    /// The backend that answered its first request.
    backend: String,
    opened: Instant,
}

/// What the run has made of the lab: which nodes are in, which backends
/// are present, with which weights.
struct World {
    mode: &'static str,
    node_in: [bool; NODES],
    present: [bool; BACKENDS],
    weights: [u32; BACKENDS],
}

impl World {
    fn nodes_in(&self) -> Vec<usize> {
        (1..=NODES).filter(|&i| self.node_in[i - 1]).collect()
    }

    fn config(&self, lab: &EcmpLab, i: usize) -> String {
        let backends: Vec<(usize, u32)> = (1..=BACKENDS)
            .filter(|&n| self.present[n - 1])
            .map(|n| (n, self.weights[n - 1]))
            .collect();
        lab.agent_config_with(i, self.mode, &backends)
    }

    /// Whether `kind` can happen now.
    fn can(&self, kind: &str) -> bool {
        let nodes_in = self.nodes_in().len();
        match kind {
            "join" => nodes_in < NODES,
            "agent-term" | "speaker-kill" | "leave" | "link-cut" => nodes_in >= 2,
            "backend-death" => self.present.iter().filter(|&&p| p).count() >= 2,
            _ => true,
        }
    }
}

/// Runs `plan` in a fresh lab; prints the seed, each event with its time,
/// and what went wrong when it did.
pub fn run(plan: &Plan) -> Outcome {
    let tag = if plan.mode == "nat" { 'd' } else { 'c' };
    let mut lab = EcmpLab::start_tagged(plan.driver, tag);
    let mut world = World {
        mode: plan.mode,
        node_in: [true; NODES],
        present: [true; BACKENDS],
        weights: [1; BACKENDS],
    };
    for i in 1..=NODES {
        let c = world.config(&lab, i);
        lab.node(i).spawn_agent(&c);
    }
    for i in 1..=NODES {
        lab.node(i).wait_agent_ready();
    }
    if let Err(e) = wait_fib(&lab, &world) {
        panic!("the lab did not start: {e}\n{}", lab.logs());
    }

    let client = Arc::new(Client {
        start: Instant::now(),
        stop: AtomicBool::new(false),
        established: AtomicU64::new(0),
        lost: AtomicU64::new(0),
        ended_with_backend: AtomicU64::new(0),
        new_made: AtomicU64::new(0),
        new_failed: AtomicU64::new(0),
        passes: AtomicU64::new(0),
        deaths: Mutex::new(BTreeMap::new()),
        breaks: Mutex::new(Vec::new()),
        pin_dirs: lab.nodes.iter().map(|n| n.pin_dir.clone()).collect(),
        open_ports: Mutex::new(BTreeMap::new()),
        ports_used: Mutex::new(BTreeMap::new()),
    });
    client.say(&format!(
        "chaos: {}-{}, seed {}, {} events, {} keep-alive connections",
        plan.driver.name(),
        plan.mode,
        plan.seed,
        plan.events,
        plan.conns
    ));
    let threads = ClientThreads::start(&lab, &client, plan.conns);
    wait_passes(&client, 1);

    let mut rng = SmallRng::seed_from_u64(plan.seed);
    let mut kinds: BTreeMap<&'static str, usize> = BTreeMap::new();
    for k in 1..=plan.events {
        std::thread::sleep(Duration::from_millis(rng.random_range(0..500)));
        let kind = draw(&mut rng, &world, &kinds);
        *kinds.entry(kind).or_default() += 1;
        if let Err(e) = happen(&mut lab, &mut world, &client, &mut rng, k, kind) {
            client.broke(format!("#{k} {kind}: {e}"));
        }
        missing_flows(&lab, &world, &client, k, kind);
        for i in world.nodes_in() {
            if !lab.node(i).agent_running() {
                client.broke(format!(
                    "after #{k} {kind}: node {i}'s agent exited by itself; its log:\n{}",
                    lab.node(i).agent_log()
                ));
                lab.node(i).wait_agent_exit(Duration::from_secs(1));
                let c = world.config(&lab, i);
                lab.node(i).start_agent(&c);
            }
        }
    }

    // The end: every node in, the FIB whole, the tables alike, and one more
    // full pass over the keep-alive connections after all that.
    for i in 1..=NODES {
        if !world.node_in[i - 1] {
            client.say(&format!("end: node {i} joins"));
            let c = world.config(&lab, i);
            lab.node(i).start_agent(&c);
            world.node_in[i - 1] = true;
        }
    }
    if let Err(e) = wait_fib(&lab, &world) {
        client.broke(format!("end: {e}"));
    }
    if let Err(e) = wait_tables(&lab, &world) {
        client.broke(format!("end: {e}"));
    }
    let passes = client.passes.load(Ordering::Relaxed);
    wait_passes(&client, passes + 2);
    drop(threads);

    let outcome = Outcome {
        events: plan.events,
        established: client.established.load(Ordering::Relaxed),
        lost: client.lost.load(Ordering::Relaxed),
        ended_with_backend: client.ended_with_backend.load(Ordering::Relaxed),
        new_made: client.new_made.load(Ordering::Relaxed),
        new_failed: client.new_failed.load(Ordering::Relaxed),
        breaks: client.breaks.lock().unwrap().clone(),
        kinds,
    };
    client.say(&format!(
        "{} ({} keep-alive connections ended with their backend)",
        outcome.line(),
        outcome.ended_with_backend
    ));
    if !outcome.clean() {
        // Every agent's and speaker's whole log, which the lab removes.
        let kept = std::env::temp_dir().join(format!("xlb-chaos-{}-{}", plan.mode, plan.seed));
        let _ = std::fs::remove_dir_all(&kept);
        let copied = std::process::Command::new("cp")
            .arg("-r")
            .arg(&lab.dir)
            .arg(&kept)
            .status();
        println!(
            "{}\nthe lab's logs: {} ({copied:?})",
            lab.logs(),
            kept.display()
        );
    }
    outcome
}

/// Prints the keep-alive connections (opened 2 s ago or more) whose flow a
/// node that is in lacks, or translates otherwise than the others: every
/// node should have every flow.
fn missing_flows(lab: &EcmpLab, world: &World, client: &Client, k: usize, kind: &str) {
    let ports: Vec<u16> = client
        .open_ports
        .lock()
        .unwrap()
        .iter()
        .filter(|(_, t)| t.elapsed() > Duration::from_secs(2))
        .map(|(p, _)| *p)
        .collect();
    let client_ip = crate::ecmp::CLIENT_IP.to_string();
    let mut seen: BTreeMap<u16, Vec<(usize, String)>> = BTreeMap::new();
    for i in world.nodes_in() {
        let flows = lab.nodes[i - 1].lbctl_json(&["conntrack", "--client", &client_ip]);
        for e in flows["entries"].as_array().into_iter().flatten() {
            let Some(p) = e["client"]
                .as_str()
                .and_then(|c| c.parse::<SocketAddr>().ok())
                .map(|c| c.port())
            else {
                continue;
            };
            if ports.contains(&p) {
                seen.entry(p)
                    .or_default()
                    .push((i, format!("{} {}", e["backend"], e["snat"])));
            }
        }
    }
    let nodes = world.nodes_in().len();
    for p in ports {
        let got = seen.get(&p).cloned().unwrap_or_default();
        let alike = got.windows(2).all(|w| w[0].1 == w[1].1);
        if got.len() != nodes || !alike {
            client.say(&format!(
                "  after #{k} {kind}: keep-alive port {p}'s flow on the nodes in: {got:?}"
            ));
        }
    }
}

/// The client's two threads, in the client namespace; stopped and joined
/// when dropped.
struct ClientThreads {
    client: Arc<Client>,
    threads: Vec<JoinHandle<()>>,
}

impl ClientThreads {
    fn start(lab: &EcmpLab, client: &Arc<Client>, conns: usize) -> Self {
        let (a, b) = (client.clone(), client.clone());
        Self {
            client: client.clone(),
            threads: vec![
                in_netns(&lab.client, move || a.keep_alive(conns)),
                in_netns(&lab.client, move || b.new_connections()),
            ],
        }
    }
}

impl Drop for ClientThreads {
    fn drop(&mut self) {
        self.client.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Waits until the keep-alive thread has made `n` passes (a pass takes
/// at most 50 × [`CLIENT_TIMEOUT`] when every connection stalls).
fn wait_passes(client: &Client, n: u64) {
    poll_until(Duration::from_secs(900), Duration::from_millis(20), || {
        (client.passes.load(Ordering::Relaxed) >= n)
            .then_some(())
            .ok_or(())
    })
    .expect("the keep-alive connections make no progress");
}

/// The least used kind of those that can happen now; ties at random.
fn draw(rng: &mut SmallRng, world: &World, used: &BTreeMap<&'static str, usize>) -> &'static str {
    let possible: Vec<&'static str> = KINDS.into_iter().filter(|k| world.can(k)).collect();
    let least = possible
        .iter()
        .map(|k| used.get(k).copied().unwrap_or(0))
        .min()
        .expect("agent-kill can always happen");
    let candidates: Vec<&'static str> = possible
        .into_iter()
        .filter(|k| used.get(k).copied().unwrap_or(0) == least)
        .collect();
    candidates.choose(rng).copied().expect("a candidate")
}

/// Makes event `k` of `kind` happen.
fn happen(
    lab: &mut EcmpLab,
    world: &mut World,
    client: &Client,
    rng: &mut SmallRng,
    k: usize,
    kind: &'static str,
) -> Result<(), String> {
    let nodes_in = world.nodes_in();
    let takes_out = matches!(kind, "agent-term" | "speaker-kill" | "leave" | "link-cut");
    if takes_out {
        // Two paths before one goes.
        wait_fib(lab, world)?;
    }
    match kind {
        "join" => {
            let out: Vec<usize> = (1..=NODES).filter(|&i| !world.node_in[i - 1]).collect();
            let i = *out.choose(rng).expect("a node out");
            client.say(&format!("#{k} node {i}: join"));
            let c = world.config(lab, i);
            lab.node(i).start_agent(&c);
            world.node_in[i - 1] = true;
        }
        "backend-death" => {
            let present: Vec<usize> = (1..=BACKENDS).filter(|&n| world.present[n - 1]).collect();
            let n = *present.choose(rng).expect("a backend");
            client.say(&format!("#{k} backend b{n}: death"));
            world.present[n - 1] = false;
            write_configs(lab, world, rng);
            wait_tables(lab, world)?;
            client
                .deaths
                .lock()
                .unwrap()
                .insert(format!("b{n}"), Instant::now());
            lab.stop_backend(n);
            lab.start_backend(n);
            world.present[n - 1] = true;
            write_configs(lab, world, rng);
            wait_tables(lab, world)?;
        }
        "config-reload" => {
            let n = rng.random_range(1..=BACKENDS);
            world.weights[n - 1] = if world.weights[n - 1] == 1 { 2 } else { 1 };
            client.say(&format!(
                "#{k} config reload: b{n}'s weight {}",
                world.weights[n - 1]
            ));
            write_configs(lab, world, rng);
            wait_tables(lab, world)?;
        }
        _ => {
            let i = *nodes_in.choose(rng).expect("a node in");
            client.say(&format!("#{k} node {i}: {kind}"));
            node_event(lab, world, i, kind)?;
        }
    }
    Ok(())
}

/// An event of node `i`'s own.
fn node_event(lab: &mut EcmpLab, world: &mut World, i: usize, kind: &str) -> Result<(), String> {
    let config = world.config(lab, i);
    match kind {
        "agent-kill" => {
            lab.node(i).kill_agent();
            lab.node(i).start_agent(&config);
        }
        "agent-restart" | "agent-term" | "leave" => {
            let signal = if kind == "agent-restart" {
                libc::SIGUSR2
            } else {
                libc::SIGTERM
            };
            lab.node(i).signal_agent(signal);
            let st = lab.node(i).wait_agent_exit(Duration::from_secs(10));
            if !st.success() {
                return Err(format!("node {i}'s agent exited with {st}"));
            }
            if kind == "leave" {
                world.node_in[i - 1] = false;
            } else {
                lab.node(i).start_agent(&config);
            }
        }
        "speaker-kill" => {
            lab.node(i).kill_speaker();
            lab.node(i).start_speaker();
        }
        "link-cut" => {
            lab.router.run(&format!("ip link set n{i} down"));
            let hop = crate::ecmp::node_ip(i);
            let dropped = poll_until(Duration::from_secs(10), Duration::from_millis(20), || {
                if lab.router_next_hops().contains(&hop) {
                    Err(lab.router_route())
                } else {
                    Ok(())
                }
            });
            lab.router.run(&format!("ip link set n{i} up"));
            dropped.map_err(|fib| {
                format!("the router kept node {i} 10 s after its link went down: {fib}")
            })?;
        }
        other => unreachable!("not a node's event: {other}"),
    }
    Ok(())
}

/// Writes every node's config (those out too, for when they join), in a
/// random order, as a ConfigMap change reaches the nodes.
fn write_configs(lab: &EcmpLab, world: &World, rng: &mut SmallRng) {
    let mut order: Vec<usize> = (1..=NODES).collect();
    rand::seq::SliceRandom::shuffle(order.as_mut_slice(), rng);
    for i in order {
        lab.nodes[i - 1].write_config(&world.config(lab, i));
    }
}

/// Waits (at most 30 s) until the router's FIB has exactly the nodes that are in.
fn wait_fib(lab: &EcmpLab, world: &World) -> Result<(), String> {
    lab.wait_next_hops(&world.nodes_in())
}

/// Waits (at most 10 s) until every node that is in has a Maglev table of
/// the present backends, where one of weight 2 has more entries than one of
/// weight 1, and all those tables are alike.
fn wait_tables(lab: &EcmpLab, world: &World) -> Result<(), String> {
    let svc = format!("{VIP}:{VIP_PORT}/tcp");
    poll_until(Duration::from_secs(10), Duration::from_millis(50), || {
        let tables: Vec<BTreeMap<u8, u64>> = world
            .nodes_in()
            .into_iter()
            .map(|i| maglev_entries(&lab.nodes[i - 1].lbctl_json(&["maglev", &svc])))
            .collect();
        let right = |t: &BTreeMap<u8, u64>| {
            let keys: Vec<u8> = t.keys().copied().collect();
            let want: Vec<u8> = (1..=BACKENDS as u8)
                .filter(|&n| world.present[n as usize - 1])
                .collect();
            let heavier = |a: u8, b: u8| {
                world.weights[a as usize - 1] <= world.weights[b as usize - 1] || t[&a] > t[&b]
            };
            keys == want && keys.iter().all(|&a| keys.iter().all(|&b| heavier(a, b)))
        };
        if tables.iter().all(right) && tables.windows(2).all(|w| w[0] == w[1]) {
            Ok(())
        } else {
            Err(tables)
        }
    })
    .map(|_| ())
    .map_err(|tables| {
        format!(
            "the nodes' Maglev tables (backend -> entries) are {tables:?} 10 s on; \
             present {:?}, weights {:?}",
            world.present, world.weights
        )
    })
}

/// `lbctl maglev` JSON as backend number -> entries.
fn maglev_entries(v: &serde_json::Value) -> BTreeMap<u8, u64> {
    let mut t = BTreeMap::new();
    for b in v["backends"].as_array().into_iter().flatten() {
        let addr = b["address"].as_str().unwrap_or_default();
        if let Some(n) = (1..=BACKENDS)
            .find(|&n| addr == SocketAddr::from((backend_ip(n), BACKEND_PORT)).to_string())
        {
            t.insert(n as u8, b["entries"].as_u64().unwrap_or(0));
        }
    }
    t
}
