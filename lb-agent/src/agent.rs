//! The standalone agent: config file -> desired state -> data plane, with
//! health checks, metrics, reload on SIGHUP or file change.
//!
//! This is the event loop: it gathers what the decisions need (the config,
//! Kubernetes' desired state, health, load, the node's routes), has the
//! pure core in `crate::desired` compute the desired state and the plan,
//! and applies them. A config that does not validate changes nothing.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use anyhow::Context as _;
use aya::programs::XdpMode;
use tokio::{
    signal::unix::{signal, SignalKind},
    sync::watch,
};
use tracing::{error, info, warn};

use crate::{
    bgp::{task::AnnounceTask, Route},
    config::{AgentConfig, XdpAttachMode},
    dataplane::{Dataplane, Handing, MapSizes},
    desired,
    health::{HealthChecker, HealthSnapshot},
    k8s::{desired::SourceOptions, watch::DesiredRx},
    load_aware::{controller::Report, LoadTask, LoadWeights},
    metrics::{
        BackendSample, BackendState, BackendValue, DataplaneSnapshot, LoadSamples, Metrics,
        ServiceSample,
    },
    netif::interface_address,
    service::{Announce, DesiredService},
};

pub struct AgentOptions {
    pub config_path: PathBuf,
    pub pin_dir: PathBuf,
}

pub struct Agent {
    opts: AgentOptions,
    config: AgentConfig,
    /// The config file's bytes last loaded (change detection).
    config_bytes: Vec<u8>,
    /// The key files' bytes last loaded: a Secret's update (a key
    /// rotation's step) is taken without a restart.
    key_bytes: Vec<u8>,
    dp: Arc<Mutex<Dataplane>>,
    health: HealthChecker,
    health_rx: watch::Receiver<HealthSnapshot>,
    /// Weights of the load-aware services, and what the task runs with
    /// (its interval and cgroup root).
    load: LoadTask,
    load_rx: watch::Receiver<LoadWeights>,
    load_settings: (Duration, PathBuf),
    metrics: Arc<Metrics>,
    ready: Arc<AtomicBool>,
    /// Service names and health by key, read by the metrics snapshot.
    labels: Arc<Mutex<Labels>>,
    attached: BTreeSet<String>,
    /// The pod-side interfaces the program is attached to, with the index
    /// each had then (`podnet`).
    pod_attached: BTreeMap<String, u32>,
    /// The `xdp_mode` the interfaces in `attached` were attached with.
    attached_mode: Option<XdpAttachMode>,
    /// Announcing VIPs through the BGP speaker, when configured.
    announce: Option<AnnounceTask>,
    /// Answering ARP/NDP for the VIPs (L2 mode), when configured.
    l2: Option<crate::l2::L2Task>,
    /// L2 mode's membership Lease and the peers from the others'.
    l2_members: Option<crate::k8s::members::Members>,
    /// Services from Kubernetes, when configured.
    k8s: Option<DesiredRx>,
    /// This agent's candidacy for handing out LoadBalancer addresses.
    allocator: Option<crate::k8s::allocator::Running>,
    /// The desired state last applied.
    state: Arc<desired::State>,
    /// The config file's services, shared with the desired state.
    file_services: Vec<Arc<DesiredService>>,
    /// Bumped when the config or the overlay's routes change
    /// ([`desired::Context::generation`]).
    generation: u64,
    /// The main table's routes and the interfaces' sides, when nat services
    /// need them to find backends behind an overlay.
    overlay: (
        Vec<crate::netif::MainRoute>,
        BTreeMap<u32, (String, crate::podnet::Side)>,
    ),
    /// Whether the Node is being taken out, as last logged (Kubernetes).
    node_leaving: bool,
    /// SNAT flows shared with the other agents (`flow_sync:`).
    flow_sync: Option<crate::flow_sync::Exchange>,
    /// This agent's flow exchange Lease, when its peers are discovered.
    flow_members: Option<crate::k8s::members::Members>,
    /// In a Pod: its DaemonSet, which tells an uninstall from a restart.
    owner: Option<crate::k8s::uninstall::OwnerWatch>,
    /// `snat_ipv4` and `snat_ipv6` as the file sets them; with Kubernetes,
    /// what is unset follows the node's addresses ([`Agent::node_snat`]).
    snat_in_file: (Option<IpAddr>, Option<IpAddr>),
    /// What the `notrack` table last said, when set.
    notrack: Option<Vec<crate::notrack::Untracked>>,
    /// The uplinks' gateways the kernel is asked to keep resolved.
    gateways: BTreeSet<(u32, IpAddr)>,
}

#[derive(Default)]
struct Labels {
    /// Names, and every configured backend, also those health checks took
    /// out of the data plane: their `xlb_backend_healthy` must read 0, not
    /// vanish.
    state: Arc<desired::State>,
    health: HealthSnapshot,
    load: LoadWeights,
    /// `backend_metrics: false` leaves the per-backend series out.
    no_backend_series: bool,
}

/// When the FIB has no neighbour entry for a backend yet, the data plane
/// hands the rewritten packet to the kernel to forward (and resolve the
/// neighbour). In snat mode that packet's source is this node's own address,
/// which the kernel drops as a martian unless the interface accepts local
/// sources. (IPv4 only: IPv6 has no such switch.) Set through rtnetlink, so
/// CAP_NET_ADMIN is enough and no privileged container is needed.
fn accept_local(iface: &str) {
    let set = crate::netif::ifindex(iface)
        .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::NotFound))
        .and_then(|index| crate::netif::set_accept_local(index, true));
    if let Err(e) = set {
        warn!(interface = %iface, "setting accept_local: {e}; packets from this node's own addresses are dropped there (snat flows to backends with no neighbour entry yet, flows handed over by this node) and stall");
    }
}

/// The contents of the config's key files, one after the other.
fn key_file_bytes(config: &AgentConfig) -> Vec<u8> {
    let l2 = config.l2.as_ref().map(|l| &l.key_file);
    let fs = config.flow_sync.as_ref().map(|f| &f.key_file);
    l2.into_iter()
        .chain(fs)
        .flat_map(|path| {
            let mut b = std::fs::read(path).unwrap_or_default();
            b.push(0);
            b
        })
        .collect()
}

/// The first sync decodes every Service and EndpointSlice of the cluster at
/// once, and a reload parses the whole file and rebuilds changed tables;
/// glibc keeps the freed pages of such a peak unless asked to return them.
/// (musl, the image's libc, returns them by itself.)
fn release_free_memory() {
    crate::sys::malloc_trim();
}

/// This agent's Pod (`POD_NAMESPACE`, `POD_NAME`; the chart sets both from
/// the downward API), when it runs in one.
fn pod_identity() -> Option<(String, String)> {
    let var = |name| std::env::var(name).ok().filter(|v| !v.is_empty());
    Some((var("POD_NAMESPACE")?, var("POD_NAME")?))
}

fn xdp_mode(m: XdpAttachMode) -> XdpMode {
    match m {
        XdpAttachMode::Native => XdpMode::Driver,
        XdpAttachMode::Generic => XdpMode::Skb,
    }
}

impl Agent {
    /// Loads (or adopts) the data plane, attaches, starts health checks and
    /// the metrics endpoint, and applies the config once.
    pub async fn start(opts: AgentOptions, config: AgentConfig) -> anyhow::Result<Self> {
        let snat_in_file = snat_in_file(&config);
        let config = with_node_addresses(config);
        let config_bytes = std::fs::read(&opts.config_path).unwrap_or_default();
        let key_bytes = key_file_bytes(&config);
        let sizes = MapSizes {
            maglev_pool_entries: config.maglev_pool_entries,
            flow_table_entries: config.flow_table_entries,
        };
        // First, before the pins are touched: on a node the port is held by
        // one agent at a time, so a new release's agent cannot adopt the
        // pins while the old one, uninstalled, is still removing them.
        let listener = tokio::net::TcpListener::bind(config.metrics_addr)
            .await
            .with_context(|| format!("binding the metrics endpoint {}", config.metrics_addr))?;
        let mut dp =
            Dataplane::open_with(Some(&opts.pin_dir), sizes).context("loading the XDP program")?;
        let adopted = dp.services().count();
        if adopted > 0 {
            info!(
                services = adopted,
                "adopted the running data plane from {}",
                opts.pin_dir.display()
            );
        }
        dp.set_config(config.dataplane_config())?;
        dp.set_flood_threshold(config.flood_threshold)?;
        let dp = Arc::new(Mutex::new(dp));
        let metrics = Arc::new(Metrics::new());
        let ready = Arc::new(AtomicBool::new(false));
        let labels = Arc::new(Mutex::new(Labels::default()));
        {
            let (dp, labels) = (dp.clone(), labels.clone());
            metrics.set_snapshot_source(move || snapshot(&dp, &labels));
        }
        {
            let ready = ready.clone();
            let probe: Arc<dyn Fn() -> (bool, bool) + Send + Sync> =
                Arc::new(move || (true, ready.load(Ordering::Relaxed)));
            tokio::spawn(crate::http::serve(listener, metrics.clone(), probe));
        }
        let flow_sync = match &config.flow_sync {
            Some(fs) => {
                let exchange = crate::flow_sync::Exchange::start(fs, dp.clone()).await?;
                exchange
                    .peers
                    .register_metrics(metrics.registry())
                    .context("registering the flow exchange's metrics")?;
                Some(exchange)
            }
            None => None,
        };
        let (health, health_rx) = HealthChecker::new();
        let load_settings = (config.load_interval, config.cgroup_root.clone());
        let (load, load_rx) = start_load(&dp, &health_rx, &load_settings);
        let mut agent = Self {
            opts,
            config,
            config_bytes,
            key_bytes,
            dp,
            health,
            health_rx,
            load,
            load_rx,
            load_settings,
            metrics,
            ready,
            labels,
            attached: BTreeSet::new(),
            pod_attached: BTreeMap::new(),
            attached_mode: None,
            announce: None,
            l2: None,
            l2_members: None,
            k8s: None,
            allocator: None,
            state: Arc::default(),
            file_services: Vec::new(),
            generation: 0,
            overlay: Default::default(),
            node_leaving: false,
            flow_sync,
            flow_members: None,
            owner: None,
            snat_in_file,
            notrack: None,
            gateways: BTreeSet::new(),
        };
        agent.config_changed();
        let mut kube_client = None;
        if let Some(kcfg) = agent.config.kubernetes.clone() {
            let client = crate::k8s::watch::client(&kcfg).await?;
            kube_client = Some(client.clone());
            crate::k8s::api_health::api_health()
                .register(agent.metrics.registry())
                .context("registering the Kubernetes API metrics")?;
            let node_name = crate::k8s::watch::node_name(&kcfg);
            agent.discover_flow_peers(&client, &kcfg, &node_name);
            agent.owner = pod_identity().map(|(namespace, pod)| {
                crate::k8s::uninstall::OwnerWatch::start(client.clone(), &namespace, &pod)
            });
            info!(node = %node_name, class = %kcfg.load_balancer_class, "taking Services from Kubernetes");
            let mut rx = crate::k8s::watch::spawn(
                client.clone(),
                SourceOptions {
                    load_balancer_class: kcfg.load_balancer_class.clone(),
                    default_class: kcfg.default_class,
                    mode: kcfg.mode,
                    node_name: node_name.clone(),
                },
            );
            if kcfg.allocate_addresses {
                agent.allocator = Some(
                    crate::k8s::allocator::start(
                        client,
                        &kcfg,
                        &node_name,
                        agent.metrics.registry(),
                    )
                    .context("registering the allocator's metrics")?,
                );
            } else {
                info!("allocate_addresses is off: this agent hands out no addresses");
            }
            // Until the cluster's state is known, the data plane keeps what it
            // has (a restart during an API server outage changes nothing).
            info!("waiting for the first sync with the Kubernetes API server");
            rx.wait_for(Option::is_some)
                .await
                .context("the Kubernetes watcher stopped")?;
            agent.k8s = Some(rx);
            // The node's Pod CIDR address before anything is programmed:
            // the uplink's meanwhile would be written into the services and
            // the notrack table, then replaced.
            agent.follow_node_snat();
        }
        // Maps started afresh run in no program yet (the links keep the old
        // one): the services go in first, so that the program taking the
        // links over finds them. Else the packets of those few
        // milliseconds reached the kernel, and kube-proxy's rules for the
        // LoadBalancer IP sent them to a Pod that reset them.
        if agent.dp.lock().expect("data plane lock").started_afresh() {
            if let Err(e) = agent.reconcile() {
                warn!("programming the services before the first attach: {e:#}");
            }
            // This node's flows too, back from the peers with their reply
            // translations, while the old program still serves: else the
            // backends' replies to this node's SNAT address found no
            // translation until the pull, and reached the kernel.
            if let Some(exchange) = agent.flow_sync.clone() {
                if exchange.peers.known(Duration::from_secs(5)).await {
                    let got = exchange.take_from_peers().await;
                    info!(
                        ?got,
                        "flow exchange: flows taken back before the first attach"
                    );
                }
            }
        }
        agent.announce_with_peers_flows(kube_client).await?;
        agent.ready.store(true, Ordering::Relaxed);
        agent.metrics.set_ready(true);
        release_free_memory();
        info!("ready");
        Ok(agent)
    }

    /// Programs the services and starts announcing them. With `flow_sync`,
    /// the services first, announced nowhere yet, so that the peers' flows
    /// find them; then the flows, before the routers can send any of them
    /// here; then the announcement.
    async fn announce_with_peers_flows(
        &mut self,
        kube: Option<kube::Client>,
    ) -> anyhow::Result<()> {
        if let Some(exchange) = self.flow_sync.clone() {
            self.apply_at_start()?;
            if !exchange.peers.known(Duration::from_secs(5)).await {
                warn!("flow exchange: no peer Leases read within 5s; announcing without the others' flows");
            }
            exchange.take_from_peers().await;
        }
        self.start_announcing(kube).await?;
        self.apply_at_start()?;
        if let Some(exchange) = self.flow_sync.clone() {
            // Flows the peers opened between the pull and the routers'
            // taking this node in: pulled again at once and once the routers
            // have had a second.
            tokio::spawn(async move {
                exchange.take_from_peers().await;
                tokio::time::sleep(Duration::from_secs(1)).await;
                exchange.take_from_peers().await;
                info!("flow exchange: the start's pulls are done; from now on the peers push");
            });
        }
        Ok(())
    }

    /// With `flow_sync` and no peers listed: keeps this agent's flow
    /// exchange Lease, naming where it listens, and takes the others' as
    /// the peers.
    fn discover_flow_peers(
        &mut self,
        client: &kube::Client,
        kcfg: &crate::config::KubernetesConfig,
        node: &str,
    ) {
        let (Some(fs), Some(exchange)) = (&self.config.flow_sync, &self.flow_sync) else {
            return;
        };
        if !fs.discover_peers {
            return;
        }
        let mut advertised = fs.listen;
        if advertised.ip().is_unspecified() {
            let first = self.config.interfaces.first();
            match first.and_then(|i| crate::netif::node_address(i)) {
                Some(ip) => advertised.set_ip(ip),
                None => {
                    warn!("flow exchange: no IPv4 or global IPv6 address on the first interface to tell the peers; set flow_sync.listen (or l2.bind)");
                    return;
                }
            }
        }
        let peers = exchange.peers.clone();
        self.flow_members = Some(crate::k8s::members::Members::start(
            crate::k8s::members::FLOW_SYNC,
            client.clone(),
            &kcfg.lease_namespace,
            node,
            advertised,
            move |found| peers.set(found),
        ));
    }

    /// Applies the config at start. Without its interfaces the agent is
    /// useless: an error. A service the data plane refuses (a full table)
    /// must not take the others down: logged.
    fn apply_at_start(&mut self) -> anyhow::Result<()> {
        if let Err(e) = self.apply_config() {
            if self.attached.len() < self.config.interfaces.len() {
                return Err(e);
            }
            error!("some services could not be programmed: {e:#}");
        }
        Ok(())
    }

    /// Starts what tells the network about the VIPs: the BGP speaker's
    /// driver and L2 mode, as configured.
    async fn start_announcing(&mut self, kube: Option<kube::Client>) -> anyhow::Result<()> {
        if let Some(bgp) = &self.config.bgp {
            let announcer = crate::bgp::from_config(bgp).map_err(anyhow::Error::msg)?;
            info!(speaker = announcer.name(), "announcing VIPs through BGP");
            let task = AnnounceTask::start(announcer, bgp.resync_interval, self.metrics.registry());
            // In a cluster, BGPPeer objects add peers by this node's labels.
            if let (Some(client), Some(kcfg)) = (kube.clone(), &self.config.kubernetes) {
                let mut peers = crate::k8s::bgp_peer::spawn(
                    client.clone(),
                    crate::k8s::watch::node_name(kcfg),
                    kcfg.lease_namespace.clone(),
                    bgp.peers.clone(),
                );
                let to = task.clone();
                tokio::spawn(async move {
                    while peers.changed().await.is_ok() {
                        let now = peers.borrow_and_update().clone();
                        to.set_peers(now);
                    }
                });
                crate::k8s::bgp_peer::report_sessions(
                    client.clone(),
                    crate::k8s::watch::node_name(kcfg),
                    task.sessions(),
                );
                let mut adverts = crate::k8s::bgp_advertisement::spawn(
                    client,
                    crate::k8s::watch::node_name(kcfg),
                );
                let to = task.clone();
                tokio::spawn(async move {
                    while adverts.changed().await.is_ok() {
                        let now = adverts.borrow_and_update().clone();
                        to.set_advertisements(now);
                    }
                });
            }
            self.announce = Some(task);
        }
        if let Some(l2) = self.config.l2.clone() {
            let task =
                crate::l2::L2Task::start(l2.clone(), self.dp.clone(), self.metrics.registry())
                    .await?;
            if let (true, Some(client), Some(kcfg)) =
                (l2.discover_peers, kube, &self.config.kubernetes)
            {
                let to = task.clone();
                self.l2_members = Some(crate::k8s::members::Members::start(
                    crate::k8s::members::L2,
                    client,
                    &kcfg.lease_namespace,
                    &l2.node_name,
                    task.bind(),
                    move |peers| to.set_peers(peers),
                ));
            }
            self.l2 = Some(task);
        }
        Ok(())
    }

    /// Serves until SIGTERM/SIGINT. The program stays attached on exit.
    pub async fn run(mut self) -> anyhow::Result<()> {
        let mut hup = signal(SignalKind::hangup())?;
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let mut usr2 = signal(SignalKind::user_defined2())?;
        let mut poll = tokio::time::interval(Duration::from_millis(500));
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut uninstall = false;
        let leaving = loop {
            tokio::select! {
                _ = hup.recv() => self.reload("SIGHUP"),
                _ = poll.tick() => {
                    {
                        let mut dp = self.dp.lock().expect("data plane lock");
                        dp.flush_logs();
                        match dp.refresh_interface_macs() {
                            Ok(changed) => for iface in changed {
                                info!(interface = %iface, "the interface's MAC changed: the program now takes the frames addressed to the new one");
                            },
                            Err(e) => warn!("reading the interfaces' MACs: {e:#}"),
                        }
                    }
                    if std::fs::read(&self.opts.config_path).is_ok_and(|b| b != self.config_bytes) {
                        self.reload("the file changed");
                    } else if key_file_bytes(&self.config) != self.key_bytes {
                        self.reload("a key file changed");
                    }
                    // A CNI bridge appears with the first Pod, often after
                    // the agent started; Pod veths come and go.
                    self.sync_pod_interfaces();
                    if self.follow_node_snat() {
                        if let Err(e) = self.reconcile() {
                            error!("applying a new SNAT address: {e:#}");
                        }
                    }
                }
                Some(()) = k8s_changed(&mut self.k8s) => {
                    self.follow_node_snat();
                    if let Err(e) = self.reconcile() {
                        error!("applying a change from Kubernetes: {e:#}");
                    }
                    self.sync_pod_interfaces();
                    self.log_node_leaving();
                }
                changed = self.health_rx.changed() => {
                    if changed.is_ok() {
                        if let Err(e) = self.reconcile() {
                            error!("applying a health change: {e:#}");
                        }
                    }
                }
                changed = self.load_rx.changed() => {
                    if changed.is_ok() {
                        self.load_changed();
                    }
                }
                _ = term.recv() => {
                    uninstall = self.sigterm_means_uninstall(false).await;
                    break uninstall || self.sigterm_means_leaving();
                }
                _ = int.recv() => break true,
                _ = usr2.recv() => break false,
            }
        };
        // Withdraw at once, so the router stops sending before we stop
        // managing the node, and give it the drain time to converge. The
        // Lease is freed (so another agent allocates at once) meanwhile: an
        // allocator finishing its work must delay neither the withdrawal nor
        // the exit.
        let allocator = self.allocator.take();
        let step_down = async {
            if let Some(allocator) = allocator {
                allocator.stop().await;
            }
        };
        if !leaving {
            info!("restarting, not leaving: the routes stay announced and the data plane keeps forwarding until the next agent adopts it");
        }
        // A node that leaves gives its SNAT flows to the others before the
        // routers send them there, then those it opened meanwhile, and at
        // the end of the drain those that still reached it.
        // L2 hands its VIPs over on every stop, a restart included.
        let exchange = self
            .flow_sync
            .clone()
            .filter(|_| leaving || self.l2.is_some());
        let give = |which: Handing| {
            let exchange = exchange.clone();
            async move {
                if let Some(x) = exchange {
                    x.give_to_peers(which).await;
                }
            }
        };
        let before = crate::maps::coarse_now_ns();
        give(Handing::All).await;
        let withdraw_and_drain = async {
            if let (true, Some(task), Some(bgp)) = (leaving, &self.announce, &self.config.bgp) {
                if !bgp.graceful_shutdown.is_zero() {
                    let end = tokio::time::Instant::now() + bgp.graceful_shutdown;
                    task.graceful_shutdown().await;
                    info!(wait = ?bgp.graceful_shutdown, "VIPs announced with GRACEFUL_SHUTDOWN (RFC 8326); withdrawing after the wait");
                    // The routers move the flows now, not at the withdrawal:
                    // those opened since the first push go at once, as below.
                    let _ =
                        tokio::time::timeout_at(end, give(Handing::OpenedHereSince(before))).await;
                    tokio::time::sleep_until(end).await;
                }
                task.withdraw_all().await;
                let withdrawn = crate::maps::coarse_now_ns();
                let end = tokio::time::Instant::now() + bgp.drain_time;
                let _ = tokio::time::timeout_at(end, give(Handing::OpenedHereSince(before))).await;
                info!(drain = ?bgp.drain_time, "VIPs withdrawn; draining");
                tokio::time::sleep(bgp.drain_time * 3 / 4).await;
                let _ =
                    tokio::time::timeout_at(end, give(Handing::OpenedHereSince(withdrawn))).await;
                tokio::time::sleep_until(end).await;
            }
        };
        // L2: the others take this node's VIPs over as soon as it leaves;
        // its data plane keeps forwarding for clients that still send here.
        let members = self.l2_members.take();
        let flow_members = self.flow_members.take().filter(|_| leaving);
        let hand_over = async {
            if let Some(l2) = &self.l2 {
                l2.leave().await;
                // Flows opened while the others took over.
                give(Handing::OpenedHereSince(before)).await;
            }
            if let Some(members) = members {
                members.leave().await;
            }
        };
        tokio::join!(step_down, withdraw_and_drain, hand_over);
        // Gone for good: the others stop pushing to this node at once.
        if let Some(m) = flow_members {
            m.leave().await;
        }
        if uninstall && self.sigterm_means_uninstall(true).await {
            // As `lb-agent --cleanup`; under the lock, so that no task of
            // this agent writes a map meanwhile.
            let _dp = self.dp.lock().expect("data plane lock");
            if let Err(e) = crate::notrack::remove() {
                error!(
                    "uninstalled, but removing the nf_tables table {} failed: {e}",
                    crate::notrack::TABLE
                );
            }
            match Dataplane::cleanup(&self.opts.pin_dir) {
                Ok(removed) => info!(dir = %self.opts.pin_dir.display(), ?removed, "uninstalled: XDP detached and the pins removed"),
                Err(e) => error!("uninstalled, but removing the pins failed: {e} (lb-agent --cleanup removes them)"),
            }
            return Ok(());
        }
        info!("exiting; the XDP program stays attached and keeps forwarding (lb-agent --cleanup detaches it)");
        Ok(())
    }

    /// In a Pod of the chart: whether its DaemonSet is gone, so that this
    /// SIGTERM is `helm uninstall` and not a restart (k8s::uninstall).
    /// Asked again (`again`) just before the pins go, in case a new
    /// DaemonSet of the same name appeared during the drain.
    async fn sigterm_means_uninstall(&self, again: bool) -> bool {
        use crate::k8s::uninstall::Verdict;
        let Some(owner) = &self.owner else {
            return false;
        };
        match (owner.verdict().await, again) {
            (Verdict::Uninstall(why), false) => {
                info!(
                    "uninstalling: {why}; XDP is detached and the pins removed after the shutdown"
                );
                true
            }
            (Verdict::Uninstall(_), true) => true,
            (Verdict::Keep(why), _) => {
                info!("not an uninstall: {why}; the pins stay");
                false
            }
        }
    }

    /// Says when the Node starts or stops being taken out: what a SIGTERM
    /// will then do.
    fn log_node_leaving(&mut self) {
        let leaving = match &self.k8s {
            Some(rx) => rx.borrow().as_ref().is_some_and(|d| d.leaving),
            None => return,
        };
        if leaving != self.node_leaving {
            self.node_leaving = leaving;
            if leaving {
                info!("this node is being taken out (cordoned, deleted or tainted to go): a SIGTERM withdraws its routes and drains");
            } else {
                info!("this node is in service: a SIGTERM is a restart and keeps its routes");
            }
        }
    }

    /// Whether a SIGTERM takes this node out (withdraw, drain) or is a
    /// restart (routes and data plane stay for the next agent). From a
    /// file: out, as `systemctl stop` means; SIGUSR2 restarts. In
    /// Kubernetes, where a rollout sends SIGTERM too: out only if the node
    /// is cordoned, being deleted or tainted to go (`k8s::desired::node_is_leaving`).
    fn sigterm_means_leaving(&self) -> bool {
        match &self.k8s {
            None => true,
            Some(rx) => rx.borrow().as_ref().is_none_or(|d| d.leaving),
        }
    }

    /// A step of the load controllers. The data plane changes only if a
    /// weight did, and then the metrics and lbctl show the step once the
    /// data plane has it (`reconcile`): shown earlier, a weight of 0 would
    /// claim that no new connection reaches a backend while the old table
    /// still sends them there. Signals alone are shown at once.
    fn load_changed(&mut self) {
        let new = self.load_rx.borrow_and_update().clone();
        let mut labels = self.labels.lock().expect("labels lock");
        let differ = crate::load_aware::weights_differ(&labels.load, &new);
        if !differ {
            labels.load = new.clone();
        }
        drop(labels);
        if !differ {
            crate::load_aware::record(&mut self.dp.lock().expect("data plane lock"), &new);
        }
        if differ {
            if let Err(e) = self.reconcile() {
                error!("applying load-aware weights: {e:#}");
            }
        }
    }

    /// Re-reads the config file; on any error the running state stays as it was.
    fn reload(&mut self, why: &str) {
        let started = Instant::now();
        let bytes = std::fs::read(&self.opts.config_path).unwrap_or_default();
        self.config_bytes = bytes;
        // A key file that does not validate is not read again until it changes.
        let keys_before = std::mem::replace(&mut self.key_bytes, key_file_bytes(&self.config));
        let result = AgentConfig::load(&self.opts.config_path)
            .map_err(anyhow::Error::from)
            .and_then(|c| {
                self.snat_in_file = snat_in_file(&c);
                let mut c = with_node_addresses(c);
                (c.snat_ipv4, c.snat_ipv6) = self.node_snat(&c);
                let old = std::mem::replace(&mut self.config, c);
                match self.apply_config() {
                    Ok(()) => {
                        self.reload_flow_sync(old.flow_sync.as_ref());
                        self.reload_keys(&keys_before);
                        Ok(())
                    }
                    Err(e) => {
                        self.config = old;
                        self.config_changed();
                        Err(e)
                    }
                }
            });
        let ok = result.is_ok();
        release_free_memory();
        match result {
            Ok(()) => info!(reason = why, took = ?started.elapsed(), "config reloaded"),
            Err(e) => error!(
                reason = why,
                "config rejected, running state unchanged: {e:#}"
            ),
        }
        self.metrics.record_reload(ok, started.elapsed());
    }

    /// Gives L2 mode and the flow exchange the keys as reloaded: the first
    /// to seal with, all to open with.
    fn reload_keys(&mut self, before: &[u8]) {
        self.key_bytes = key_file_bytes(&self.config);
        if self.key_bytes == before {
            return;
        }
        if let (Some(cfg), Some(l2)) = (&self.config.l2, &self.l2) {
            l2.set_keys(&cfg.keys);
            info!(
                keys = cfg.keys.len(),
                "l2: cluster keys reloaded; sealing with the first"
            );
        }
        if let (Some(cfg), Some(exchange)) = (&self.config.flow_sync, &self.flow_sync) {
            exchange.peers.set_keys(&cfg.keys);
            info!(
                keys = cfg.keys.len(),
                "flow exchange: cluster keys reloaded; sealing with the first"
            );
        }
    }

    /// Gives the running flow exchange the reloaded peers; any other change
    /// to `flow_sync` waits for a restart, and says so.
    fn reload_flow_sync(&self, before: Option<&crate::config::FlowSyncConfig>) {
        use crate::config::{FlowSyncConfig, FlowSyncReload};
        match FlowSyncConfig::reload(before, self.config.flow_sync.as_ref()) {
            FlowSyncReload::Unchanged => {}
            FlowSyncReload::Peers(peers) => {
                if let Some(exchange) = &self.flow_sync {
                    info!(?peers, "flow exchange: peers reloaded");
                    exchange.peers.set(peers);
                }
            }
            FlowSyncReload::NeedsRestart(what) => warn!(
                "flow_sync: {what} changed; the flow exchange runs as it started until the agent restarts"
            ),
        }
    }

    /// Interfaces, data-plane settings, health targets, then services.
    fn apply_config(&mut self) -> anyhow::Result<()> {
        self.config_changed();
        {
            let mut dp = self.dp.lock().expect("data plane lock");
            // A changed mode re-attaches every interface (`attach` replaces
            // a link of the other mode).
            if self.attached_mode != Some(self.config.xdp_mode) {
                self.attached.clear();
                self.attached_mode = Some(self.config.xdp_mode);
            }
            // Interfaces no longer listed, also those pinned by an earlier
            // agent: left attached, redirects to them would vanish. Pod-side
            // ones (attached, or pinned and still wanted) are
            // `sync_pod_interfaces`' to keep or let go: detached here, a
            // restart would leave local Pods' replies untranslated meanwhile.
            let pod_side: BTreeSet<String> = self
                .pod_attached
                .keys()
                .cloned()
                .chain(self.wanted_pod_interfaces(&dp).into_keys())
                .collect();
            let gone: BTreeSet<String> = self
                .attached
                .iter()
                .cloned()
                .chain(dp.pinned_interfaces())
                .filter(|i| !self.config.interfaces.contains(i) && !pod_side.contains(i))
                .collect();
            for iface in gone {
                dp.detach(&iface)
                    .with_context(|| format!("detaching from {iface}"))?;
                info!(interface = %iface, "XDP program detached: no longer in interfaces");
                self.attached.remove(&iface);
            }
            for iface in &self.config.interfaces {
                if !self.attached.contains(iface) {
                    let mode = dp
                        .attach(iface, xdp_mode(self.config.xdp_mode))
                        .with_context(|| format!("attaching to {iface}"))?;
                    accept_local(iface);
                    info!(interface = %iface, ?mode, "XDP program attached");
                    if crate::netif::driver(iface).is_ok_and(|d| d == "veth") {
                        warn!(
                            interface = %iface,
                            "a veth: TCP packets its peer sends with TX checksum offload on (the \
                             default) carry unfinished checksums that XDP forwards as they are, \
                             and the receiver drops them; turn it off on the peer with \
                             `ethtool -K <peer> tx off` (docs/datapath.md)"
                        );
                    }
                    self.attached.insert(iface.clone());
                }
            }
            dp.set_config(self.config.dataplane_config())?;
            dp.set_flood_threshold(self.config.flood_threshold)?;
        }
        let mut targets = Vec::new();
        for s in &self.config.services {
            if let Some(hc) = &s.health_check {
                for b in &s.backends {
                    targets.push((b.addr(), hc.clone()));
                }
            }
        }
        targets.sort_by_key(|t| t.0);
        targets.dedup_by_key(|t| t.0);
        self.health.set_targets(targets);
        let load_settings = (self.config.load_interval, self.config.cgroup_root.clone());
        if load_settings != self.load_settings {
            (self.load, self.load_rx) = start_load(&self.dp, &self.health_rx, &load_settings);
            self.load_settings = load_settings;
        }
        let applied = self.reconcile();
        self.sync_pod_interfaces();
        applied
    }

    /// The SNAT addresses for `config` on this node: the file's, else with
    /// Kubernetes this node's address inside its Pod CIDRs (the pod network
    /// routes it back here, through an overlay too, and flannel does not
    /// masquerade it), else the first interface's as `with_node_addresses`
    /// found it.
    fn node_snat(
        &self,
        config: &AgentConfig,
    ) -> (Option<std::net::Ipv4Addr>, Option<std::net::Ipv6Addr>) {
        let (file4, file6) = self.snat_in_file;
        let current = (config.snat_ipv4, config.snat_ipv6);
        let Some(rx) = self.k8s.as_ref() else {
            return current;
        };
        let pod_cidrs = rx
            .borrow()
            .as_ref()
            .map(|d| d.pod_cidrs.clone())
            .unwrap_or_default();
        if pod_cidrs.is_empty() {
            return current;
        }
        let local = crate::netif::local_addresses();
        let first = config
            .interfaces
            .first()
            .map(String::as_str)
            .unwrap_or_default();
        let pick = |file: Option<IpAddr>, v4: bool| {
            file.or_else(|| crate::podnet::pod_network_address(&pod_cidrs, &local, v4))
                .or_else(|| interface_address(first, v4))
        };
        let v4 = match pick(file4, true) {
            Some(IpAddr::V4(a)) => Some(a),
            _ => current.0,
        };
        let v6 = match pick(file6, false) {
            Some(IpAddr::V6(a)) => Some(a),
            _ => current.1,
        };
        (v4, v6)
    }

    /// Moves the SNAT addresses the file leaves unset to [`Agent::node_snat`]'s;
    /// whether they changed. Flows keep the address they were made with.
    fn follow_node_snat(&mut self) -> bool {
        let new = self.node_snat(&self.config);
        if new == (self.config.snat_ipv4, self.config.snat_ipv6) {
            return false;
        }
        info!(
            snat_ipv4 = ?new.0,
            snat_ipv6 = ?new.1,
            "SNAT source follows this node's address in its Pod CIDR (or its first interface's)"
        );
        (self.config.snat_ipv4, self.config.snat_ipv6) = new;
        self.config_changed();
        true
    }

    /// The pod-side interfaces wanted now (`pod_interfaces`); none when
    /// they cannot be read (logged).
    fn wanted_pod_interfaces(&self, dp: &Dataplane) -> BTreeMap<String, u32> {
        // Every backend, drained and failing ones too: their flows go on.
        let mut backends: BTreeSet<IpAddr> = dp
            .services()
            .flat_map(|(_, s)| s.backends.iter().map(|b| b.addr.ip()))
            .collect();
        let file = self.config.services.iter();
        backends.extend(file.flat_map(|s| s.backends.iter().map(|b| b.ip)));
        if let Some(rx) = &self.k8s {
            let desired = rx.borrow();
            let services = desired.iter().flat_map(|d| &d.services);
            backends.extend(services.flat_map(|s| s.backends.iter().map(|b| b.ip)));
        }
        match crate::podnet::desired(
            &self.config.pod_interfaces,
            &self.config.interfaces,
            backends,
        ) {
            Ok(w) => w,
            Err(e) => {
                warn!("reading the routes to find the pod-side interfaces: {e}");
                BTreeMap::new()
            }
        }
    }

    /// Keeps conntrack off what the data plane translated and hands to the
    /// kernel: packets from the SNAT addresses (to Pods) and from the VIPs
    /// (replies without a neighbour entry yet) ([`crate::notrack`]);
    /// written only when the addresses change.
    fn sync_notrack(&mut self) {
        let snat: Vec<IpAddr> = [
            self.config.snat_ipv4.map(IpAddr::V4),
            self.config.snat_ipv6.map(IpAddr::V6),
        ]
        .into_iter()
        .flatten()
        .collect();
        // The peers' too: a flow a peer handed over keeps its SNAT address,
        // and forwarded by the kernel (through an overlay) it would be
        // masqueraded there (flannel masquerades another node's Pod
        // addresses leaving this one) and the backend would reset it.
        let peers = self
            .flow_sync
            .as_ref()
            .map(|e| e.snat_addresses())
            .unwrap_or_default();
        // The replies to a peer's address too: this node forwards those of
        // its own Pods to the peer (whose program translates them), and a
        // SYN-ACK seen first by conntrack is INVALID. Not to this node's
        // own: kube-proxy's masquerade to it needs conntrack.
        use crate::notrack::Untracked;
        let own: BTreeSet<IpAddr> = snat.iter().copied().collect();
        let peers = peers.into_iter().filter(|a| !own.contains(a));
        let rules: BTreeSet<Untracked> = snat
            .iter()
            .chain(self.state.announce_by_vip.keys())
            .map(|a| Untracked::From(*a))
            .chain(peers.flat_map(|a| [Untracked::From(a), Untracked::To(a)]))
            .collect();
        let wanted: Vec<Untracked> = rules.into_iter().collect();
        if self.notrack.as_ref() == Some(&wanted) {
            return;
        }
        match crate::notrack::set(&wanted) {
            Ok(()) => {
                info!(rules = ?wanted, "conntrack skips packets from the SNAT addresses and VIPs, and to the peers' SNAT addresses (nf_tables table {})", crate::notrack::TABLE);
                self.notrack = Some(wanted);
            }
            Err(e) => {
                warn!("writing the nf_tables table {}: {e}; where INVALID packets are dropped (kube-proxy), snat connections to Pods behind an overlay stall, and so do replies to a client whose next hop has no neighbour entry yet", crate::notrack::TABLE);
                self.notrack = Some(wanted);
            }
        }
    }

    /// Has the kernel keep the uplinks' gateways resolved (managed
    /// neighbour entries): the data plane forwards only to a next hop with
    /// a neighbour entry, and it takes the client packets that would have
    /// made the kernel resolve the router. Without one, a reply goes
    /// through the kernel, and one translated on a bridge carries the
    /// INVALID verdict br_netfilter gave its untranslated form (kube-proxy
    /// drops it): the first connections after a start timed out. Each
    /// gateway is asked for once (asking again resets its entry).
    fn keep_gateways_resolved(&mut self) {
        let Ok(routes) = crate::netif::main_routes() else {
            return;
        };
        let uplinks: BTreeSet<u32> = self
            .config
            .interfaces
            .iter()
            .filter_map(|i| crate::netif::ifindex(i))
            .collect();
        for r in routes {
            let (Some(index), Some(via)) = (r.gateway, r.via) else {
                continue;
            };
            if !uplinks.contains(&index) || !self.gateways.insert((index, via)) {
                continue;
            }
            match crate::netif::keep_neighbour_resolved(index, via) {
                Ok(()) => {
                    info!(gateway = %via, ifindex = index, "the kernel keeps this gateway's neighbour entry resolved")
                }
                Err(e) => {
                    warn!(gateway = %via, "keeping the gateway's neighbour entry resolved: {e}; replies through it go through the kernel until it is resolved")
                }
            }
        }
    }

    /// Attaches the program to the pod-side interfaces wanted now and
    /// detaches it from those no longer wanted (gone, or made again under
    /// a new index: their link was severed), with the uplinks' detach.
    fn sync_pod_interfaces(&mut self) {
        self.sync_notrack();
        self.keep_gateways_resolved();
        let mut dp = self.dp.lock().expect("data plane lock");
        let wanted = self.wanted_pod_interfaces(&dp);
        let (detach, attach) = crate::podnet::changes(&self.pod_attached, &wanted);
        for iface in detach {
            match dp.detach(&iface) {
                Ok(()) => {
                    info!(interface = %iface, "XDP program detached from a pod-side interface (gone, or no backend behind it)");
                    self.pod_attached.remove(&iface);
                }
                Err(e) => warn!(interface = %iface, "detaching from a pod-side interface: {e:#}"),
            }
        }
        for iface in attach {
            match dp.attach_pod_side(&iface) {
                Ok(()) => {
                    info!(interface = %iface, "XDP program attached to a pod-side interface (generic mode): local Pods' replies are translated there");
                    // A flow handed over by this node (L2 failover, a
                    // drain) keeps this node's SNAT address: the node that
                    // took it forwards it to this node's Pods through the
                    // overlay, from an address of this node's own.
                    if crate::podnet::side(&iface, &self.config.interfaces)
                        == crate::podnet::Side::Overlay
                    {
                        accept_local(&iface);
                    }
                    self.pod_attached.insert(iface.clone(), wanted[&iface]);
                }
                Err(e) => warn!(interface = %iface, "attaching to a pod-side interface: {e:#}"),
            }
        }
    }

    /// Desired = config services minus unhealthy backends; apply the difference.
    /// Computes the desired state ([`crate::desired`]) and applies it: the
    /// data plane's writes, the load controller's targets, the routes and
    /// the L2 VIPs. A service the data plane refuses is retried next time;
    /// the others are applied.
    fn reconcile(&mut self) -> anyhow::Result<()> {
        let cluster = self.k8s.as_ref().and_then(|rx| rx.borrow().clone());
        self.follow_overlay(cluster.as_deref());
        let context = desired::Context {
            generation: self.generation,
            health: self.health_rx.borrow().clone(),
            load: self.load_rx.borrow_and_update().clone(),
        };
        let (routes, sides) = &self.overlay;
        let overlay = |ip| {
            crate::podnet::through_overlay(routes, ip, |i| {
                sides.get(&i).map_or(crate::podnet::Side::Never, |s| s.1)
            })
        };
        let mut state = desired::compute(
            &desired::Inputs {
                file: &self.file_services,
                cluster: cluster.as_deref(),
                config: &self.config,
                context,
                overlay: &overlay,
            },
            &self.state,
        );
        self.log_new_decisions(&state);
        self.load.set_targets(state.load_targets());

        let mut dp = self.dp.lock().expect("data plane lock");
        let plan = desired::plan(dp.services(), &state);
        let mut errors = Vec::new();
        for (key, reset) in &plan.set {
            let want = &state.services[key];
            let name = &want.service.name;
            match dp.set_shared_service(&want.spec) {
                Ok(()) => {
                    info!(service = %name, backends = want.spec.backends.len(), "service programmed");
                    for &b in reset {
                        match dp.reset_flows_to(b) {
                            Ok(n) => info!(service = %name, backend = %b, flows = n, "flows reset"),
                            Err(e) => warn!(service = %name, backend = %b, "resetting flows: {e}"),
                        }
                    }
                }
                Err(e) => {
                    errors.push(format!("{name}: {e}"));
                    state.retry(*key);
                }
            }
        }
        for key in &plan.remove {
            if let Err(e) = dp.remove_service(key) {
                errors.push(format!("removing a service: {e}"));
            }
        }
        let programmed = || dp.services().map(|(_, spec)| spec);
        let bgp_vips =
            desired::servable_vips(programmed(), &state.announce_by_vip, Announce::by_bgp);
        let l2_vips = desired::servable_vips(programmed(), &state.announce_by_vip, Announce::by_l2);
        drop(dp);
        let host_only: BTreeSet<IpAddr> = bgp_vips
            .intersection(&state.host_route_vips)
            .copied()
            .collect();

        let state = Arc::new(state);
        self.state = state.clone();
        let mut labels = self.labels.lock().expect("labels lock");
        labels.no_backend_series = !self.config.backend_metrics;
        labels.health = state.context().health.clone();
        labels.load = state.context().load.clone();
        labels.state = state.clone();
        drop(labels);
        crate::load_aware::record(
            &mut self.dp.lock().expect("data plane lock"),
            &state.context().load,
        );
        if let Some(task) = &self.announce {
            task.apply(self.routes(&bgp_vips), host_only);
        }
        if let Some(l2) = &self.l2 {
            l2.set_vips(l2_vips.into_iter().map(|v| (v, None)).collect());
        }
        if errors.is_empty() {
            Ok(())
        } else {
            anyhow::bail!("{}", errors.join("; "))
        }
    }

    /// Logs what a new desired state decided that the last did not:
    /// Kubernetes Services the file shadows, nat services served in snat.
    fn log_new_decisions(&self, state: &desired::State) {
        for (address, name) in &state.shadowed {
            let (vip, port, _) = address;
            if !self.state.shadowed.contains_key(address) {
                warn!(service = %name, vip = %vip, port = port, "the config file already defines this VIP; the Kubernetes Service is not applied");
            }
        }
        let before = self.state.nat_over_overlay();
        for name in state.nat_over_overlay().difference(&before) {
            warn!(service = %name, "nat mode, but backends on other nodes are behind the pod network's overlay, which masquerades what the node forwards there: served in snat on this node (externalTrafficPolicy: Local keeps the client's address)");
        }
    }

    /// Reads the routes that tell whether a backend is behind an Ethernet
    /// overlay (flannel's VXLAN), when it matters: with nat services and
    /// pod-side interfaces found automatically. Changed routes compute
    /// every service afresh.
    fn follow_overlay(&mut self, cluster: Option<&crate::k8s::desired::Desired>) {
        let nat = |s: &Arc<DesiredService>| s.mode == crate::service::Mode::Nat;
        let wanted = self.config.pod_interfaces == crate::podnet::PodInterfaces::Auto
            && (self.file_services.iter().any(nat)
                || cluster.is_some_and(|d| d.services.iter().any(nat)));
        let routes = if wanted {
            crate::netif::main_routes().unwrap_or_default()
        } else {
            Vec::new()
        };
        let sides = crate::podnet::sides(&routes, &self.config.interfaces);
        let overlay = (routes, sides);
        if overlay != self.overlay {
            self.overlay = overlay;
            self.generation += 1;
        }
    }

    /// The config changed (a reload, a new SNAT address): every service is
    /// computed afresh.
    fn config_changed(&mut self) {
        self.file_services = self.config.services.iter().cloned().map(Arc::new).collect();
        self.generation += 1;
    }

    /// The BGP routes for `vips`: this node as next hop, the configured
    /// one or the first interface's address of the VIP's family.
    fn routes(&self, vips: &BTreeSet<IpAddr>) -> BTreeSet<Route> {
        let Some(bgp) = &self.config.bgp else {
            return BTreeSet::new();
        };
        let first_iface = self
            .config
            .interfaces
            .first()
            .map(String::as_str)
            .unwrap_or("");
        let hop4 = bgp
            .next_hop_ipv4
            .map(IpAddr::V4)
            .or_else(|| interface_address(first_iface, true));
        let hop6 = bgp
            .next_hop_ipv6
            .map(IpAddr::V6)
            .or_else(|| interface_address(first_iface, false));
        let (routes, no_hop) = desired::routes(vips, bgp, hop4, hop6);
        for vip in no_hop {
            warn!(vip = %vip, "no next hop of this family: set bgp.next_hop_ipv4/6");
        }
        routes
    }
}

/// Starts the load task with `settings` (its interval and cgroup root).
fn start_load(
    dp: &Arc<Mutex<Dataplane>>,
    health: &watch::Receiver<HealthSnapshot>,
    (interval, cgroup_root): &(Duration, PathBuf),
) -> (LoadTask, watch::Receiver<LoadWeights>) {
    let cgroups = crate::load_aware::cgroup::Hierarchies::at(cgroup_root);
    LoadTask::start(dp.clone(), health.clone(), *interval, cgroups)
}

/// Resolves when the Kubernetes desired state changed; never without Kubernetes.
async fn k8s_changed(rx: &mut Option<DesiredRx>) -> Option<()> {
    match rx {
        Some(rx) => rx.changed().await.ok(),
        None => std::future::pending().await,
    }
}

/// `snat_ipv4` and `snat_ipv6` as the file sets them.
fn snat_in_file(config: &AgentConfig) -> (Option<IpAddr>, Option<IpAddr>) {
    (
        config.snat_ipv4.map(IpAddr::V4),
        config.snat_ipv6.map(IpAddr::V6),
    )
}

/// With Kubernetes, Services of either family may appear at any time: snat
/// needs a source address, so default it to the first interface's (until
/// the node's Pod CIDRs are known: `Agent::node_snat`).
fn with_node_addresses(mut config: AgentConfig) -> AgentConfig {
    if config.kubernetes.is_some() {
        let first = config.interfaces.first().cloned().unwrap_or_default();
        if config.snat_ipv4.is_none() {
            if let Some(IpAddr::V4(a)) = interface_address(&first, true) {
                config.snat_ipv4 = Some(a);
            }
        }
        if config.snat_ipv6.is_none() {
            if let Some(IpAddr::V6(a)) = interface_address(&first, false) {
                config.snat_ipv6 = Some(a);
            }
        }
        for (family, missing) in [
            ("IPv4", config.snat_ipv4.is_none()),
            ("IPv6", config.snat_ipv6.is_none()),
        ] {
            if missing {
                warn!(interface = %first, "no {family} address to use as SNAT source (set snat_ipv4/snat_ipv6): {family} Services in snat mode are forwarded without SNAT");
            }
        }
    }
    config
}

/// What /metrics shows, read from the maps at scrape time.
fn snapshot(dp: &Mutex<Dataplane>, labels: &Mutex<Labels>) -> DataplaneSnapshot {
    let dp = dp.lock().expect("data plane lock");
    let labels = labels.lock().expect("labels lock");
    let mut snap = DataplaneSnapshot {
        conntrack_capacity: dp.flow_table_capacity() as u64,
        ..Default::default()
    };
    for (key, spec) in dp.services() {
        let wanted = labels.state.services.get(key);
        let name = wanted.map_or_else(|| "(adopted)".into(), |w| w.service.name.clone());
        let Some(id) = dp.service_id(key) else {
            continue;
        };
        snap.services.push(ServiceSample {
            name: name.clone(),
            vip: spec.vip,
            port: spec.port,
            protocol: spec.protocol.name().into(),
            stats: dp.service_stats(id).unwrap_or_default(),
        });
        // Few or none: a Service's endpoints terminate a few at a time.
        let terminating: Vec<SocketAddr> = wanted
            .into_iter()
            .flat_map(|w| &w.service.backends)
            .filter(|b| b.terminating)
            .map(|b| b.addr())
            .collect();
        let healthy = |addr: &SocketAddr| labels.health.get(addr).is_none_or(|h| h.healthy);
        for b in &spec.backends {
            let id = dp.backend_id(key, b.addr);
            let stats = id.and_then(|bid| dp.backend_stats(bid).ok());
            let closed_flows = id
                .and_then(|bid| dp.backend_flows(bid).ok())
                .map_or(0, |(_, closed)| closed);
            let healthy = healthy(&b.addr);
            snap.backends.push(BackendSample {
                service: name.clone(),
                backend: b.addr.to_string(),
                healthy,
                weight: b.weight,
                state: BackendState::of(healthy, terminating.contains(&b.addr), b.weight),
                stats: stats.unwrap_or_default(),
                closed_flows,
            });
        }
        // Configured but out of the data plane (failing its checks).
        for addr in wanted.into_iter().flat_map(|w| w.configured()) {
            if !spec.backends.iter().any(|b| b.addr == addr) {
                let healthy = healthy(&addr);
                snap.backends.push(BackendSample {
                    service: name.clone(),
                    backend: addr.to_string(),
                    healthy,
                    weight: 0,
                    state: BackendState::of(healthy, terminating.contains(&addr), 0),
                    stats: Default::default(),
                    closed_flows: 0,
                });
            }
        }
    }
    if let Ok(reasons) = dp.reason_counts() {
        snap.reasons = DataplaneSnapshot::reasons_from_counts(&reasons);
    }
    snap.conntrack_entries = dp.shared_flows().map(|c| c.len() as u64).unwrap_or(0);
    snap.flows_repicked = dp.flows_repicked().unwrap_or(0);
    snap.flows_untracked = dp.flows_untracked().unwrap_or(0);
    snap.load = load_samples(&labels.load);
    if labels.no_backend_series {
        snap.backends.clear();
        snap.load = LoadSamples {
            all_draining: std::mem::take(&mut snap.load.all_draining),
            ..Default::default()
        };
    }
    snap
}

/// The load-aware services' signals and weights, as metric samples.
fn load_samples(load: &LoadWeights) -> LoadSamples {
    let mut out = LoadSamples::default();
    for s in load.values() {
        out.all_draining.push(BackendValue {
            service: s.name.clone(),
            backend: String::new(),
            value: if s.all_draining { 1.0 } else { 0.0 },
        });
        for (addr, l) in &s.backends {
            let v = |value: f64| BackendValue {
                service: s.name.clone(),
                backend: addr.to_string(),
                value,
            };
            let sig = &l.signals;
            out.open_flows.push(v(sig.open_flows.unwrap_or(0.0)));
            out.factor.push(v(l.decision.factor));
            out.pressure.push(v(l.decision.pressure));
            if let Some(lat) = sig.latency {
                out.probe_latency.push(v(lat.as_secs_f64()));
            }
            if let Some(t) = sig.flow_time {
                out.flow_time.push(v(t.as_secs_f64()));
            }
            if let Some(cpu) = sig.cpu {
                out.cpu.push(v(cpu));
            }
            match sig.report {
                Some(Report::Percent(p)) => out.reported_ratio.push(v(p as f64 / 100.0)),
                Some(Report::Drain) => out.reported_ratio.push(v(0.0)),
                Some(Report::Down) | None => {}
            }
        }
    }
    out
}
