//! L2 mode (docs/l2.md): one node per VIP answers ARP and Neighbor
//! Solicitations for it, from the XDP program, with its interface's MAC.
//!
//! The owner is a pure function of the membership (`owner`), which SWIM
//! keeps among the agents (`gossip`) without the Kubernetes API. Two rules
//! keep two nodes from answering at once:
//! - a node answers only while it sees a quorum of members, and only after
//!   having seen it for `claim_hold` (time for the member it takes a VIP
//!   back from to learn that it is back);
//! - the program answers only until a deadline the agent renews
//!   (`L2Iface::valid_until_ns`), shorter than the time the others take to
//!   declare a silent node down. A crashed or frozen agent's node falls
//!   silent before anyone takes over.

pub mod announce;
pub mod gossip;
pub mod owner;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use foca::{AccumulatingRuntime, Foca, NoCustomBroadcast, OwnedNotification, PostcardCodec, Timer};
use ipnet::IpNet;
use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use rand::{rngs::SmallRng, SeedableRng};
use tokio::{
    net::UdpSocket,
    sync::{mpsc, oneshot},
    time::Instant,
};
use tracing::{info, warn};

use self::{
    gossip::Member,
    owner::{owned_by, Eligible},
};
use crate::{
    config::L2Config,
    dataplane::Dataplane,
    maps::monotonic_now_ns,
    netif,
    seal::{Keyring, Purpose, SharedKeys},
};

/// The VIPs L2 mode answers for, each with the nodes that may own it.
pub type L2Vips = BTreeMap<IpAddr, Eligible>;

/// When a VIP is taken over, it is announced at once and again after these
/// delays (a lost frame, a host that was busy), then every `announce_interval`.
const REANNOUNCE: [Duration; 3] = [
    Duration::from_millis(200),
    Duration::from_secs(1),
    Duration::from_secs(3),
];
/// Interfaces (index, MAC, subnets) are looked up again this often.
const IFACE_REFRESH: Duration = Duration::from_secs(1);

enum Command {
    SetVips(L2Vips),
    /// The membership peers, discovered (`L2Config::discover_peers`).
    SetPeers(Vec<SocketAddr>),
    /// Hand over: stop answering, tell the others, then answer.
    Leave(oneshot::Sender<()>),
}

/// Handle to the L2 task.
#[derive(Clone)]
pub struct L2Task {
    tx: mpsc::UnboundedSender<Command>,
    bind: SocketAddr,
    keys: SharedKeys,
}

impl L2Task {
    /// Binds the membership socket and starts the task. This node answers
    /// for nothing until it has seen a quorum for `claim_hold`.
    pub async fn start(
        cfg: L2Config,
        dp: Arc<Mutex<Dataplane>>,
        registry: &Registry,
    ) -> anyhow::Result<Self> {
        let bind = match cfg.bind {
            Some(b) => b,
            None => {
                let iface = &cfg.interfaces[0];
                let ip = netif::node_address(iface).ok_or_else(|| {
                    anyhow::anyhow!(
                        "l2: bind is not set and {iface} has no IPv4 or global IPv6 address to bind to; set l2.bind"
                    )
                })?;
                SocketAddr::new(ip, crate::config::DEFAULT_L2_PORT)
            }
        };
        let socket = UdpSocket::bind(bind)
            .await
            .map_err(|e| anyhow::anyhow!("l2: binding the membership socket {bind}: {e}"))?;
        let sender = announce::Sender::new()
            .map_err(|e| anyhow::anyhow!("l2: opening a packet socket for announcements: {e}"))?;
        // Nothing is owned until the membership says so (a restarted agent
        // finds the last run's VIPs in the pinned map).
        {
            let mut dp = dp.lock().expect("data plane lock");
            for vip in dp.l2_vips()?.into_keys() {
                dp.remove_l2_vip(vip)?;
            }
        }
        let me = Member {
            name: cfg.node_name.clone(),
            addr: bind,
            generation: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
        };
        info!(node = %me.name, %bind, peers = cfg.peers.len(), quorum = cfg.quorum, "L2 mode: joining the membership");
        let foca = Foca::new(
            me,
            gossip::swim_config(&cfg),
            SmallRng::from_os_rng(),
            PostcardCodec,
        );
        let (tx, rx) = mpsc::unbounded_channel();
        let keys = SharedKeys::new(Keyring::new(&cfg.keys, Purpose::L2));
        let holder_window = cfg.probe_interval + cfg.suspect_timeout;
        let cfg_discovers = cfg.discover_peers;
        let runner = Runner {
            metrics: L2Metrics::new(registry),
            claim_hold: cfg.probe_interval * 4,
            contact_window: cfg.probe_interval * 2,
            valid_for: cfg.suspect_timeout,
            cfg,
            keys: keys.clone(),
            dp,
            foca,
            runtime: AccumulatingRuntime::new(),
            socket,
            sender,
            groups: announce::Groups::default(),
            timers: Vec::new(),
            ifaces: BTreeMap::new(),
            vips: BTreeMap::new(),
            owned: BTreeMap::new(),
            quorum_since: None,
            announce_at: BTreeMap::new(),
            warned: BTreeSet::new(),
            last_renew: None,
            last_heard: None,
            peers: BTreeMap::new(),
            peers_known: !cfg_discovers,
            holder_window,
        };
        tokio::spawn(runner.run(rx));
        Ok(Self { tx, bind, keys })
    }

    /// Seals with the first of `secrets` from now on, and opens with any
    /// (a key rotation's step).
    pub fn set_keys(&self, secrets: &[Vec<u8>]) {
        self.keys.set(Keyring::new(secrets, Purpose::L2));
    }

    /// Where this node's membership traffic is received.
    pub fn bind(&self) -> SocketAddr {
        self.bind
    }

    /// The VIPs this node can serve now, and who may own each.
    pub fn set_vips(&self, vips: L2Vips) {
        let _ = self.tx.send(Command::SetVips(vips));
    }

    /// The other agents' membership addresses, when discovered.
    pub fn set_peers(&self, peers: Vec<SocketAddr>) {
        let _ = self.tx.send(Command::SetPeers(peers));
    }

    /// Hands this node's VIPs over (graceful stop): it stops answering and
    /// tells the others, who take over at once.
    pub async fn leave(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::Leave(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}

struct L2Metrics {
    owned: IntGaugeVec,
    members: IntGauge,
    quorum: IntGauge,
    announcements: IntCounterVec,
    refused: IntCounterVec,
    unplaced: IntGauge,
    iface_up: IntGaugeVec,
}

impl L2Metrics {
    fn new(registry: &Registry) -> Self {
        let owned = IntGaugeVec::new(
            Opts::new(
                "xlb_l2_vip_owned",
                "1 while this node answers ARP/NDP for the VIP (L2 mode)",
            ),
            &["vip"],
        )
        .expect("metric");
        let members = IntGauge::new(
            "xlb_l2_members",
            "Members this node sees alive in the L2 membership, itself included",
        )
        .expect("metric");
        let quorum = IntGauge::new(
            "xlb_l2_quorum",
            "1 while this node sees a quorum of members (it answers only then)",
        )
        .expect("metric");
        let announcements = IntCounterVec::new(
            Opts::new(
                "xlb_l2_announcements_total",
                "Gratuitous ARPs (ipv4) and unsolicited neighbor advertisements (ipv6) sent",
            ),
            &["family"],
        )
        .expect("metric");
        let refused = IntCounterVec::new(
            Opts::new(
                "xlb_l2_gossip_refused_total",
                "Membership datagrams refused: malformed, or sealed with another key",
            ),
            &["reason"],
        )
        .expect("metric");
        let unplaced = IntGauge::new(
            "xlb_l2_vips_unplaced",
            "L2 VIPs in no subnet of the L2 interfaces: never answered here",
        )
        .expect("metric");
        let iface_up = IntGaugeVec::new(
            Opts::new(
                "xlb_l2_interface_up",
                "1 while the L2 interface exists and has a MAC",
            ),
            &["interface"],
        )
        .expect("metric");
        for m in [
            Box::new(owned.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(members.clone()),
            Box::new(quorum.clone()),
            Box::new(announcements.clone()),
            Box::new(refused.clone()),
            Box::new(unplaced.clone()),
            Box::new(iface_up.clone()),
        ] {
            let _ = registry.register(m);
        }
        Self {
            owned,
            members,
            quorum,
            announcements,
            refused,
            unplaced,
            iface_up,
        }
    }
}

/// What another node's last heartbeat said.
struct Peer {
    at: Instant,
    serves: BTreeSet<IpAddr>,
    holds: BTreeSet<IpAddr>,
}

/// An L2 interface as last looked up.
struct Iface {
    index: u32,
    mac: [u8; 6],
    nets: Vec<IpNet>,
}

struct Runner {
    cfg: L2Config,
    /// `cfg.keys`, as reloads leave them.
    keys: SharedKeys,
    metrics: L2Metrics,
    dp: Arc<Mutex<Dataplane>>,
    foca: Foca<Member, PostcardCodec, SmallRng, NoCustomBroadcast>,
    runtime: AccumulatingRuntime<Member>,
    socket: UdpSocket,
    sender: announce::Sender,
    groups: announce::Groups,
    timers: Vec<(Instant, Timer<Member>)>,
    ifaces: BTreeMap<String, Iface>,
    vips: L2Vips,
    /// VIPs this node answers for, with the ifindex.
    owned: BTreeMap<IpAddr, u32>,
    /// Since when this node has seen a quorum.
    quorum_since: Option<Instant>,
    /// Owned VIPs' next announcement and how many were sent since takeover.
    announce_at: BTreeMap<IpAddr, (Instant, usize)>,
    claim_hold: Duration,
    /// How long the program may answer after a renewal.
    valid_for: Duration,
    /// Problems logged once until they go away (interfaces, VIPs).
    warned: BTreeSet<String>,
    /// When the deadlines were last renewed.
    last_renew: Option<Instant>,
    /// When a signed datagram last came from another member.
    last_heard: Option<Instant>,
    /// Each other node's last heartbeat.
    peers: BTreeMap<String, Peer>,
    /// The peer list is known (configured, or discovered once): until then
    /// a quorum of one would let a starting node answer beside the owners.
    peers_known: bool,
    /// A heartbeat older than this no longer holds a VIP: by then its
    /// sender, if cut off or frozen, has fallen silent (two probe intervals,
    /// or the answer deadline), and the others declare it down.
    holder_window: Duration,
    /// Without a word from any member for this long, this node is cut off
    /// and answers for nothing: shorter than the time the others take to
    /// declare it down (`probe_interval + suspect_timeout`), so that it
    /// falls silent first.
    contact_window: Duration,
}

impl Runner {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Command>) {
        self.refresh_ifaces();
        for peer in self.cfg.peers.clone() {
            self.announce_to(peer);
        }
        self.flush().await;
        let mut buf = vec![0u8; 65536];
        let mut renew = tokio::time::interval(self.valid_for / 6);
        renew.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut refresh = tokio::time::interval(IFACE_REFRESH);
        refresh.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let next_timer = self
                .timers
                .iter()
                .map(|(at, _)| *at)
                .min()
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                r = self.socket.recv_from(&mut buf) => match r {
                    Ok((n, from)) => self.datagram(&buf[..n], from),
                    Err(e) => warn!("l2: receiving membership traffic: {e}"),
                },
                _ = tokio::time::sleep_until(next_timer) => self.fire_timers(),
                _ = renew.tick() => {
                    self.heartbeat().await;
                    self.renew_deadlines();
                    self.announce_due();
                }
                _ = refresh.tick() => {
                    self.refresh_ifaces();
                    self.rejoin_missing_peers();
                }
                cmd = rx.recv() => match cmd {
                    Some(Command::SetVips(v)) => {
                        self.vips = v;
                        self.join_groups();
                    }
                    Some(Command::SetPeers(p)) => self.set_peers(p),
                    Some(Command::Leave(done)) => {
                        self.leave().await;
                        let _ = done.send(());
                        return;
                    }
                    None => return,
                },
            }
            self.flush().await;
            self.update_ownership();
        }
    }

    fn datagram(&mut self, data: &[u8], from: SocketAddr) {
        match gossip::open(&self.keys.get(), data) {
            Ok((kind, payload)) => {
                self.last_heard = Some(Instant::now());
                match kind {
                    gossip::Kind::Swim => {
                        if let Err(e) = self.foca.handle_data(&payload, &mut self.runtime) {
                            tracing::debug!(%from, "l2: membership datagram not applied: {e}");
                        }
                    }
                    gossip::Kind::Heartbeat => {
                        match serde_json::from_slice::<gossip::Heartbeat>(&payload) {
                            Ok(beat) if beat.name != self.cfg.node_name => {
                                let peer = Peer {
                                    at: Instant::now(),
                                    serves: beat.serves.into_iter().collect(),
                                    holds: beat.holds.into_iter().collect(),
                                };
                                self.peers.insert(beat.name, peer);
                            }
                            Ok(_) => {}
                            Err(e) => tracing::debug!(%from, "l2: a heartbeat not understood: {e}"),
                        }
                    }
                }
            }
            Err(why) => {
                self.metrics_refused(why);
                if self.warned.insert(format!("refused {from}")) {
                    warn!(%from, reason = why.label(), "l2: refused a membership datagram (another cluster's key, or not xlb); further ones from there are only counted");
                }
            }
        }
    }

    /// Whether another member said, recently enough to be alive, that it
    /// answers for `vip`.
    fn held_elsewhere(&self, vip: IpAddr, now: Instant) -> bool {
        self.fresh_peers(now).any(|(_, p)| p.holds.contains(&vip))
    }

    fn fresh_peers(&self, now: Instant) -> impl Iterator<Item = (&String, &Peer)> {
        self.peers
            .iter()
            .filter(move |(_, p)| now.duration_since(p.at) < self.holder_window)
    }

    /// Each VIP this node can serve, with the nodes that can serve it:
    /// this one and the peers whose fresh heartbeat says so.
    fn eligible(&self, now: Instant) -> L2Vips {
        self.vips
            .keys()
            .map(|vip| {
                let mut nodes: BTreeSet<String> = self
                    .fresh_peers(now)
                    .filter(|(_, p)| p.serves.contains(vip))
                    .map(|(n, _)| n.clone())
                    .collect();
                nodes.insert(self.cfg.node_name.clone());
                (*vip, Some(nodes))
            })
            .collect()
    }

    fn metrics_refused(&self, why: gossip::Refused) {
        self.metrics.refused.with_label_values(&[why.label()]).inc();
    }

    fn fire_timers(&mut self) {
        let now = Instant::now();
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.timers)
            .into_iter()
            .partition(|(at, _)| *at <= now);
        self.timers = later;
        for (_, t) in due {
            if let Err(e) = self.foca.handle_timer(t, &mut self.runtime) {
                tracing::debug!("l2: membership timer: {e}");
            }
        }
    }

    /// Sends what foca queued, schedules its timers, logs its news.
    async fn flush(&mut self) {
        while let Some((to, data)) = self.runtime.to_send() {
            let sealed = gossip::seal(&self.keys.get(), gossip::Kind::Swim, &data);
            if let Err(e) = self.socket.send_to(&sealed, to.addr).await {
                tracing::debug!(to = %to.addr, "l2: sending membership traffic: {e}");
            }
        }
        let now = Instant::now();
        while let Some((after, t)) = self.runtime.to_schedule() {
            self.timers.push((now + after, t));
        }
        while let Some(n) = self.runtime.to_notify() {
            match n {
                OwnedNotification::MemberUp(m) => info!(member = ?m, "l2: member up"),
                OwnedNotification::MemberDown(m) => info!(member = ?m, "l2: member down"),
                OwnedNotification::Rename(a, b) => info!(old = ?a, new = ?b, "l2: member rejoined"),
                OwnedNotification::Defunct => {
                    warn!("l2: the others declared this node down; rejoining")
                }
                _ => {}
            }
        }
    }

    /// A signed heartbeat to every peer, naming the VIPs this node answers
    /// for. SWIM's own traffic may leave a member unheard for longer than
    /// `contact_window` (one probe per interval, to a random member), and a
    /// node that hears nobody must tell that it is cut off, not a peer's
    /// random pick. The VIPs let a node that comes back (a healed
    /// partition: it may see some members before others) wait until the
    /// one still answering for a VIP lets it go.
    async fn heartbeat(&mut self) {
        let beat = gossip::Heartbeat {
            name: self.cfg.node_name.clone(),
            serves: self.vips.keys().copied().collect(),
            holds: self.owned.keys().copied().collect(),
        };
        let payload = serde_json::to_vec(&beat).expect("a heartbeat serializes");
        let beat = gossip::seal(&self.keys.get(), gossip::Kind::Heartbeat, &payload);
        for peer in &self.cfg.peers {
            let _ = self.socket.send_to(&beat, peer).await;
        }
    }

    fn set_peers(&mut self, peers: Vec<SocketAddr>) {
        if self.peers_known && peers == self.cfg.peers {
            return;
        }
        let new: Vec<SocketAddr> = peers
            .iter()
            .filter(|p| !self.cfg.peers.contains(p))
            .copied()
            .collect();
        self.cfg.peers = peers;
        if self.cfg.quorum_is_majority {
            self.cfg.quorum = crate::config::majority(self.cfg.peers.len());
        }
        self.peers_known = true;
        info!(peers = ?self.cfg.peers, quorum = self.cfg.quorum, "l2: the membership peers changed");
        for peer in new {
            self.announce_to(peer);
        }
    }

    fn announce_to(&mut self, peer: SocketAddr) {
        let dst = Member {
            name: String::new(),
            addr: peer,
            generation: 0,
        };
        if let Err(e) = self.foca.announce(dst, &mut self.runtime) {
            tracing::debug!(%peer, "l2: announcing: {e}");
        }
    }

    /// Configured peers not in the view are asked to join again: how a
    /// healed partition, or a peer started later, merges.
    fn rejoin_missing_peers(&mut self) {
        let seen: BTreeSet<SocketAddr> = self.foca.iter_members().map(|m| m.id().addr).collect();
        for peer in self.cfg.peers.clone() {
            if !seen.contains(&peer) {
                self.announce_to(peer);
            }
        }
    }

    /// The names of the members seen alive (suspects included), this node's too.
    fn members(&self) -> BTreeSet<String> {
        let mut m: BTreeSet<String> = self
            .foca
            .iter_members()
            .map(|m| m.id().name.clone())
            .collect();
        m.insert(self.cfg.node_name.clone());
        m
    }

    fn update_ownership(&mut self) {
        let members = self.members();
        let now = Instant::now();
        // SWIM keeps a silent member as a suspect for a while; a node that
        // hears nobody at all is cut off sooner than that tells.
        let in_contact = self.cfg.quorum <= 1
            || self
                .last_heard
                .is_some_and(|t| now.duration_since(t) < self.contact_window);
        let in_quorum = self.peers_known && members.len() >= self.cfg.quorum && in_contact;
        self.metrics.members.set(members.len() as i64);
        self.metrics.quorum.set(in_quorum as i64);
        match (in_quorum, self.quorum_since) {
            (true, None) => self.quorum_since = Some(now),
            (false, Some(_)) => {
                warn!(
                    seen = members.len(),
                    quorum = self.cfg.quorum,
                    in_contact,
                    "l2: lost the quorum; answering for no VIP"
                );
                self.quorum_since = None;
            }
            _ => {}
        }
        let may_claim = self
            .quorum_since
            .is_some_and(|since| now.duration_since(since) >= self.claim_hold);
        let mut want = BTreeMap::new();
        let mut unplaced = 0;
        if in_quorum {
            let mine = owned_by(&self.cfg.node_name, &members, &self.eligible(now));
            for vip in mine {
                match self.place(vip) {
                    Some(ifindex) => {
                        // Keep what it holds; claim only after the hold, and
                        // only what no other node says it still answers for.
                        let kept = self.owned.contains_key(&vip);
                        if kept || (may_claim && !self.held_elsewhere(vip, now)) {
                            want.insert(vip, ifindex);
                        }
                    }
                    None => unplaced += 1,
                }
            }
        }
        self.metrics.unplaced.set(unplaced);
        self.apply(want);
    }

    /// The L2 interface whose subnet holds `vip`.
    fn place(&mut self, vip: IpAddr) -> Option<u32> {
        let found = self
            .ifaces
            .values()
            .find(|i| i.nets.iter().any(|n| n.contains(&vip)))
            .map(|i| i.index);
        if found.is_none() && self.warned.insert(format!("unplaced {vip}")) {
            warn!(%vip, interfaces = ?self.cfg.interfaces, "l2: the VIP is in no subnet of the L2 interfaces; not answering for it");
        }
        found
    }

    fn apply(&mut self, want: BTreeMap<IpAddr, u32>) {
        if want == self.owned {
            return;
        }
        let mut dp = self.dp.lock().expect("data plane lock");
        for vip in self.owned.keys().filter(|v| !want.contains_key(v)) {
            match dp.remove_l2_vip(*vip) {
                Ok(()) => info!(%vip, "l2: released"),
                Err(e) => warn!(%vip, "l2: releasing: {e}"),
            }
            self.metrics
                .owned
                .with_label_values(&[&vip.to_string()])
                .set(0);
            self.announce_at.remove(vip);
        }
        let now = Instant::now();
        for (vip, ifindex) in &want {
            if self.owned.get(vip) == Some(ifindex) {
                continue;
            }
            match dp.set_l2_vip(*vip, *ifindex) {
                Ok(()) => info!(%vip, ifindex, "l2: answering for the VIP"),
                Err(e) => warn!(%vip, "l2: claiming: {e}"),
            }
            self.metrics
                .owned
                .with_label_values(&[&vip.to_string()])
                .set(1);
            self.announce_at.insert(*vip, (now, 0));
        }
        drop(dp);
        self.owned = want;
        self.announce_due();
    }

    /// Sends the announcements that are due.
    fn announce_due(&mut self) {
        let now = Instant::now();
        let due: Vec<(IpAddr, usize)> = self
            .announce_at
            .iter()
            .filter(|(_, (at, _))| *at <= now)
            .map(|(v, (_, n))| (*v, *n))
            .collect();
        for (vip, n) in due {
            self.announce(vip);
            let next = REANNOUNCE
                .get(n)
                .copied()
                .unwrap_or(self.cfg.announce_interval);
            self.announce_at.insert(vip, (now + next, n + 1));
        }
    }

    fn announce(&mut self, vip: IpAddr) {
        let Some(ifindex) = self.owned.get(&vip).copied() else {
            return;
        };
        let Some(iface) = self.ifaces.values().find(|i| i.index == ifindex) else {
            return;
        };
        let (dst, frame) = announce::frame(vip, iface.mac);
        match self.sender.send(ifindex, dst, &frame) {
            Ok(()) => {
                let family = if vip.is_ipv4() { "ipv4" } else { "ipv6" };
                self.metrics
                    .announcements
                    .with_label_values(&[family])
                    .inc();
            }
            Err(e) => warn!(%vip, "l2: announcing: {e}"),
        }
    }

    /// Vouches for this node's answers until `valid_for` from now. If the
    /// last deadline has lapsed, this agent was stalled (frozen, starved)
    /// long enough for the others to take its VIPs: it answers for nothing
    /// and qualifies again through the claim hold, in which it learns what
    /// the membership decided meanwhile.
    fn renew_deadlines(&mut self) {
        let now = Instant::now();
        if let Some(last) = self.last_renew.replace(now) {
            let gap = now.duration_since(last);
            if gap >= self.valid_for {
                self.quorum_since = None;
                if !self.owned.is_empty() {
                    warn!(stalled = ?gap, "l2: this agent stalled past its answer deadline; answering for nothing until it qualifies again");
                    self.apply(BTreeMap::new());
                }
                return;
            }
        }
        let until = monotonic_now_ns() + self.valid_for.as_nanos() as u64;
        let mut dp = self.dp.lock().expect("data plane lock");
        for (name, i) in &self.ifaces {
            if let Err(e) = dp.set_l2_iface(i.index, i.mac, until) {
                if self.warned.insert(format!("renew {name}")) {
                    warn!(interface = %name, "l2: renewing the answer deadline: {e}");
                }
            }
        }
    }

    fn refresh_ifaces(&mut self) {
        let mut now = BTreeMap::new();
        for name in &self.cfg.interfaces {
            let found =
                netif::ifindex(name).and_then(|index| Some((index, netif::interface_mac(name)?)));
            let up = found.is_some();
            self.metrics
                .iface_up
                .with_label_values(&[name.as_str()])
                .set(up as i64);
            match found {
                Some((index, mac)) => {
                    if self.warned.remove(&format!("iface {name}")) {
                        info!(interface = %name, "l2: the interface is back");
                    }
                    now.insert(
                        name.clone(),
                        Iface {
                            index,
                            mac,
                            nets: netif::interface_networks(name),
                        },
                    );
                }
                None => {
                    if self.warned.insert(format!("iface {name}")) {
                        warn!(interface = %name, "l2: the interface does not exist (or has no MAC); not answering on it");
                    }
                }
            }
        }
        let gone: Vec<u32> = self
            .ifaces
            .values()
            .filter(|i| !now.values().any(|n| n.index == i.index))
            .map(|i| i.index)
            .collect();
        if !gone.is_empty() {
            let mut dp = self.dp.lock().expect("data plane lock");
            for index in gone {
                let _ = dp.remove_l2_iface(index);
            }
        }
        self.ifaces = now;
        self.renew_deadlines();
        self.join_groups();
    }

    fn join_groups(&mut self) {
        let want = self
            .vips
            .keys()
            .filter_map(|v| match v {
                IpAddr::V6(v6) => Some(announce::solicited_node(*v6)),
                IpAddr::V4(_) => None,
            })
            .flat_map(|g| self.ifaces.values().map(move |i| (g, i.index)))
            .collect();
        for (g, e) in self.groups.set(want) {
            warn!(group = %g, "l2: joining the solicited-node group: {e}");
        }
    }

    /// Stops answering and tells the others in a heartbeat that this node
    /// serves and holds nothing: they choose new owners at once, and the
    /// next one claims as soon as it reads it. The membership learns that
    /// the node is gone as it would after a crash (SWIM's own leave was
    /// tried: a node restarted seconds after leaving was not taken back by
    /// its peers, see docs/l2.md), so a restart rejoins the proven way.
    async fn leave(&mut self) {
        self.apply(BTreeMap::new());
        self.vips.clear();
        self.heartbeat().await;
        info!("l2: handed over; left the membership");
    }
}
