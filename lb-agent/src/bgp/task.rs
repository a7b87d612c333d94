//! The agent side of announcing: a task that owns the speaker driver, keeps
//! the speaker's announced set equal to the latest desired set (re-applying
//! it every `resync_interval`, which heals a restarted speaker), and on
//! shutdown withdraws everything before the agent exits.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};
use tokio::sync::{mpsc, oneshot, watch};
use tracing::{info, warn};

use super::{advertise, peer_limits, Advertisement, Announcer, PeerLimit, Route};
use crate::config::BgpPeer;

/// The well-known community GRACEFUL_SHUTDOWN (RFC 8326): a router that
/// honours it lowers the route's LOCAL_PREF to 0, so that it moves traffic
/// to the other paths before the route is withdrawn.
pub const GRACEFUL_SHUTDOWN: (u16, u16) = (65535, 0);

enum Command {
    /// The node's host routes, and the VIPs of them that no advertisement
    /// may aggregate.
    Apply(BTreeSet<Route>, BTreeSet<IpAddr>),
    /// The peers the agent configures in the speaker (BGPPeers changed).
    Peers(Vec<BgpPeer>),
    /// What BGPAdvertisements add to the routes of their pools' VIPs.
    Advertisements(Vec<Advertisement>),
    /// From now on announce every route with GRACEFUL_SHUTDOWN, then answer.
    GracefulShutdown(oneshot::Sender<()>),
    /// Withdraw everything, then answer.
    Withdraw(oneshot::Sender<()>),
}

/// Handle to the announcing task.
#[derive(Clone)]
pub struct AnnounceTask {
    tx: mpsc::UnboundedSender<Command>,
    sessions: watch::Receiver<Sessions>,
}

/// The speaker's BGP sessions as last read: peer → established. Empty while
/// the speaker cannot be asked.
pub type Sessions = BTreeMap<IpAddr, bool>;

struct AnnounceMetrics {
    announced: IntGauge,
    peer_up: IntGaugeVec,
    peer_uptime: IntGaugeVec,
    peer_prefixes_sent: IntGaugeVec,
    changes: IntCounterVec,
    errors: IntCounterVec,
}

impl AnnounceMetrics {
    fn new(registry: &Registry) -> Self {
        let announced = IntGauge::new(
            "xlb_bgp_announced_prefixes",
            "VIP prefixes the BGP speaker announces for this node",
        )
        .expect("metric");
        let changes = IntCounterVec::new(
            Opts::new(
                "xlb_bgp_route_changes_total",
                "Routes announced and withdrawn through the speaker",
            ),
            &["action"],
        )
        .expect("metric");
        let errors = IntCounterVec::new(
            Opts::new(
                "xlb_bgp_errors_total",
                "Failed attempts to apply the announced set",
            ),
            &["kind"],
        )
        .expect("metric");
        let peer_up = IntGaugeVec::new(
            Opts::new(
                "xlb_bgp_peer_up",
                "1 while the speaker's BGP session with the peer is established",
            ),
            &["peer"],
        )
        .expect("metric");
        let peer_uptime = IntGaugeVec::new(
            Opts::new(
                "xlb_bgp_peer_uptime_seconds",
                "How long the BGP session with the peer has been established (0 while it is not)",
            ),
            &["peer"],
        )
        .expect("metric");
        let peer_prefixes_sent = IntGaugeVec::new(
            Opts::new(
                "xlb_bgp_peer_prefixes_sent",
                "Prefixes the BGP speaker sends the peer now, as the speaker counts them",
            ),
            &["peer"],
        )
        .expect("metric");
        // Registering twice (a second task in tests) is harmless: keep the first.
        let _ = registry.register(Box::new(peer_up.clone()));
        let _ = registry.register(Box::new(peer_uptime.clone()));
        let _ = registry.register(Box::new(peer_prefixes_sent.clone()));
        let _ = registry.register(Box::new(announced.clone()));
        let _ = registry.register(Box::new(changes.clone()));
        let _ = registry.register(Box::new(errors.clone()));
        Self {
            announced,
            peer_up,
            peer_uptime,
            peer_prefixes_sent,
            changes,
            errors,
        }
    }
}

impl AnnounceTask {
    /// Starts the task; nothing is announced until the first `apply`.
    pub fn start(announcer: Box<dyn Announcer>, resync: Duration, registry: &Registry) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let (sessions_tx, sessions) = watch::channel(Sessions::new());
        let metrics = AnnounceMetrics::new(registry);
        tokio::spawn(run(announcer, rx, resync, metrics, sessions_tx));
        Self { tx, sessions }
    }

    /// The speaker's sessions, updated after every apply and resync.
    pub fn sessions(&self) -> watch::Receiver<Sessions> {
        self.sessions.clone()
    }

    /// Sets the routes this node should announce now: a host route for
    /// each VIP it serves; `host_only` are the VIPs that only some nodes
    /// serve, which stay host routes where an advertisement aggregates.
    pub fn apply(&self, routes: BTreeSet<Route>, host_only: BTreeSet<IpAddr>) {
        let _ = self.tx.send(Command::Apply(routes, host_only));
    }

    /// Sets the peers the agent configures in the speaker; the speaker's
    /// sessions follow at once (a refusal is logged and the old peers stay).
    pub fn set_peers(&self, peers: Vec<BgpPeer>) {
        let _ = self.tx.send(Command::Peers(peers));
    }

    /// Sets what advertisements add to the routes; applied at once.
    pub fn set_advertisements(&self, adverts: Vec<Advertisement>) {
        let _ = self.tx.send(Command::Advertisements(adverts));
    }

    /// Re-announces every route with GRACEFUL_SHUTDOWN and waits until the
    /// speaker took it (or gave up); routes applied later carry it too.
    pub async fn graceful_shutdown(&self) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Command::GracefulShutdown(done)).is_ok() {
            let _ = wait.await;
        }
    }

    /// Withdraws everything and waits until the speaker took it (or gave up).
    pub async fn withdraw_all(&self) {
        let (done, wait) = oneshot::channel();
        if self.tx.send(Command::Withdraw(done)).is_ok() {
            let _ = wait.await;
        }
    }
}

async fn run(
    mut announcer: Box<dyn Announcer>,
    mut rx: mpsc::UnboundedReceiver<Command>,
    resync: Duration,
    metrics: AnnounceMetrics,
    sessions: watch::Sender<Sessions>,
) {
    let mut desired: Option<BTreeSet<Route>> = None;
    let mut host_only: BTreeSet<IpAddr> = BTreeSet::new();
    let mut adverts: Vec<Advertisement> = Vec::new();
    let mut limits: Vec<PeerLimit> = Vec::new();
    // Limited prefixes the speaker cannot keep from other peers: their
    // routes are not announced at all.
    let mut withheld: Vec<PeerLimit> = Vec::new();
    let mut shutting_down = false;
    let mut known_peers: BTreeSet<IpAddr> = BTreeSet::new();
    // The sessions the agent configures, and the others last warned of.
    let mut agent_peers: BTreeSet<IpAddr> = BTreeSet::new();
    let mut unheld_warned: BTreeSet<IpAddr> = BTreeSet::new();
    let mut tick = tokio::time::interval(resync);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            cmd = rx.recv() => match cmd {
                None => return,
                Some(Command::Apply(routes, only)) => {
                    desired = Some(routes);
                    host_only = only;
                }
                Some(Command::Advertisements(a)) => {
                    let new_limits = peer_limits(&a);
                    adverts = a;
                    if new_limits != limits {
                        withheld = match announcer.set_peer_limits(&new_limits) {
                            Ok(()) => Vec::new(),
                            Err(e) => {
                                warn!(
                                    speaker = announcer.name(),
                                    "BGPAdvertisement peerSelector: {e}; the VIPs it limits are not announced"
                                );
                                new_limits.clone()
                            }
                        };
                        limits = new_limits;
                    }
                }
                Some(Command::Peers(peers)) => {
                    if let Err(e) = announcer.set_peers(&peers) {
                        warn!(speaker = announcer.name(), "the BGP peers cannot be set: {e}");
                        continue;
                    }
                    agent_peers = peers.iter().map(|p| p.address).collect();
                }
                Some(Command::GracefulShutdown(done)) => {
                    shutting_down = true;
                    if let Some(d) = &desired {
                        let d = with_graceful_shutdown(&announced(d, &adverts, &host_only, &withheld));
                        apply(announcer.as_mut(), &d, &metrics).await;
                    }
                    let _ = done.send(());
                    continue;
                }
                Some(Command::Withdraw(done)) => {
                    desired = Some(BTreeSet::new());
                    apply(announcer.as_mut(), &BTreeSet::new(), &metrics).await;
                    let _ = done.send(());
                    continue;
                }
            },
            _ = tick.tick() => {}
        }
        match &desired {
            Some(d) if shutting_down => {
                let d = with_graceful_shutdown(&announced(d, &adverts, &host_only, &withheld));
                apply(announcer.as_mut(), &d, &metrics).await
            }
            Some(d) => {
                let d = announced(d, &adverts, &host_only, &withheld);
                apply(announcer.as_mut(), &d, &metrics).await
            }
            None => {}
        }
        update_peers(announcer.as_mut(), &metrics, &mut known_peers, &sessions).await;
        // A limit the speaker keeps only on the agent's sessions: the
        // others may leak the limited VIPs.
        let in_force = !limits.is_empty() && withheld.is_empty();
        let unheld = unheld_sessions(
            in_force && !announcer.limits_every_session(),
            &known_peers,
            &agent_peers,
        );
        if !unheld.is_empty() && unheld != unheld_warned {
            warn!(
                speaker = announcer.name(),
                sessions = ?unheld,
                "BGP sessions the agent does not configure are not held to the BGPAdvertisement peerSelector limits: their own export filters decide whether they get the limited VIPs"
            );
        }
        unheld_warned = unheld;
    }
}

/// The speaker's sessions that peer limits in force on the agent's
/// sessions only (`limited_here`) do not hold: the others.
fn unheld_sessions(
    limited_here: bool,
    sessions: &BTreeSet<IpAddr>,
    agent_peers: &BTreeSet<IpAddr>,
) -> BTreeSet<IpAddr> {
    if limited_here {
        sessions.difference(agent_peers).copied().collect()
    } else {
        BTreeSet::new()
    }
}

/// The routes to announce: the desired ones with what the advertisements
/// make of them, less those inside `withheld`.
fn announced(
    desired: &BTreeSet<Route>,
    adverts: &[Advertisement],
    host_only: &BTreeSet<IpAddr>,
    withheld: &[PeerLimit],
) -> BTreeSet<Route> {
    let mut routes = advertise(desired, adverts, host_only);
    routes.retain(|r| !withheld.iter().any(|w| w.prefix.contains(&r.prefix)));
    routes
}

fn with_graceful_shutdown(routes: &BTreeSet<Route>) -> BTreeSet<Route> {
    routes
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.communities.push(GRACEFUL_SHUTDOWN);
            r.normalized()
        })
        .collect()
}

/// Sets `xlb_bgp_peer_up` from the speaker's sessions. A speaker that
/// cannot be asked (stopped, killed) has no session up: its peers read 0
/// until it answers again.
async fn update_peers(
    announcer: &mut dyn Announcer,
    metrics: &AnnounceMetrics,
    known: &mut BTreeSet<IpAddr>,
    sessions: &watch::Sender<Sessions>,
) {
    match announcer.peers().await {
        Ok(peers) => {
            metrics.peer_up.reset();
            metrics.peer_uptime.reset();
            metrics.peer_prefixes_sent.reset();
            known.clear();
            let before = sessions.borrow().clone();
            for s in &peers {
                let (peer, up) = (s.peer, s.established);
                known.insert(peer);
                let label = [peer.to_string()];
                metrics.peer_up.with_label_values(&label).set(up as i64);
                let uptime = s.uptime.filter(|_| up).unwrap_or_default();
                metrics
                    .peer_uptime
                    .with_label_values(&label)
                    .set(uptime.as_secs() as i64);
                if let Some(n) = s.prefixes_sent.filter(|_| up) {
                    metrics
                        .peer_prefixes_sent
                        .with_label_values(&label)
                        .set(n as i64);
                }
                match (before.get(&peer), up) {
                    (Some(false) | None, true) => info!(%peer, "BGP session established"),
                    (Some(true), false) => warn!(%peer, "BGP session down"),
                    _ => {}
                }
            }
            sessions.send_if_modified(|s| {
                let now: Sessions = peers.iter().map(|s| (s.peer, s.established)).collect();
                let changed = *s != now;
                *s = now;
                changed
            });
        }
        Err(e) => {
            tracing::debug!(speaker = announcer.name(), "reading BGP sessions: {e}");
            // Not known now: down, up for no time, prefixes not counted.
            metrics.peer_prefixes_sent.reset();
            for peer in known.iter() {
                let label = [peer.to_string()];
                metrics.peer_up.with_label_values(&label).set(0);
                metrics.peer_uptime.with_label_values(&label).set(0);
            }
            sessions.send_if_modified(|s| {
                let up = s.values().any(|&up| up);
                s.values_mut().for_each(|v| *v = false);
                up
            });
        }
    }
}

async fn apply(
    announcer: &mut dyn Announcer,
    desired: &BTreeSet<Route>,
    metrics: &AnnounceMetrics,
) {
    match announcer.apply(desired).await {
        Ok((added, withdrawn)) => {
            metrics.announced.set(desired.len() as i64);
            if added + withdrawn > 0 {
                metrics
                    .changes
                    .with_label_values(&["announce"])
                    .inc_by(added as u64);
                metrics
                    .changes
                    .with_label_values(&["withdraw"])
                    .inc_by(withdrawn as u64);
                info!(
                    speaker = announcer.name(),
                    added,
                    withdrawn,
                    announced = desired.len(),
                    "BGP routes updated"
                );
            }
        }
        Err(e) => {
            let kind = match e {
                super::AnnounceError::Unreachable(_) => "unreachable",
                super::AnnounceError::Refused(_) => "refused",
            };
            metrics.errors.with_label_values(&[kind]).inc();
            warn!(
                speaker = announcer.name(),
                "applying the announced set: {e} (will retry)"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;
    use crate::bgp::{AnnounceError, AnnounceResult, BoxFuture, Session};

    /// A speaker that keeps what it was told in memory, and can be made to
    /// fail: the task's logic (retry, resync, withdraw on shutdown) is what
    /// is tested here; the real speakers have tests of their own.
    #[derive(Clone, Default)]
    struct MemorySpeaker {
        routes: Arc<Mutex<BTreeSet<Route>>>,
        down: Arc<Mutex<bool>>,
    }

    impl Announcer for MemorySpeaker {
        fn name(&self) -> &'static str {
            "memory"
        }
        fn announced(&mut self) -> BoxFuture<'_, AnnounceResult<BTreeSet<Route>>> {
            Box::pin(async move { Ok(self.routes.lock().unwrap().clone()) })
        }
        fn peers(&mut self) -> BoxFuture<'_, AnnounceResult<Vec<Session>>> {
            let down = *self.down.lock().unwrap();
            let sent = self.routes.lock().unwrap().len() as u64;
            Box::pin(async move {
                if down {
                    return Err(AnnounceError::Unreachable("down".into()));
                }
                Ok(vec![Session {
                    peer: "10.0.0.254".parse().unwrap(),
                    established: true,
                    uptime: Some(Duration::from_secs(42)),
                    prefixes_sent: Some(sent),
                }])
            })
        }
        fn apply<'a>(
            &'a mut self,
            desired: &'a BTreeSet<Route>,
        ) -> BoxFuture<'a, AnnounceResult<(usize, usize)>> {
            Box::pin(async move {
                if *self.down.lock().unwrap() {
                    return Err(AnnounceError::Unreachable("down".into()));
                }
                let mut r = self.routes.lock().unwrap();
                let added = desired.difference(&r).count();
                let withdrawn = r.difference(desired).count();
                *r = desired.clone();
                Ok((added, withdrawn))
            })
        }
    }

    fn route(vip: &str) -> Route {
        Route {
            prefix: ipnet::IpNet::from(vip.parse::<IpAddr>().unwrap()),
            next_hop: "10.0.0.1".parse().unwrap(),
            communities: vec![],
            large_communities: vec![],
            local_pref: None,
        }
    }

    async fn eventually(f: impl Fn() -> bool) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while !f() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("condition within 5 s");
    }

    #[tokio::test]
    async fn applies_resyncs_after_a_speaker_restart_and_withdraws_on_shutdown() {
        let speaker = MemorySpeaker::default();
        let registry = Registry::new();
        let task = AnnounceTask::start(
            Box::new(speaker.clone()),
            Duration::from_millis(50),
            &registry,
        );
        let want: BTreeSet<_> = [route("192.0.2.10"), route("192.0.2.11")].into();
        task.apply(want.clone(), BTreeSet::new());
        let r = speaker.routes.clone();
        eventually(|| *r.lock().unwrap() == want).await;
        let gathered = || {
            prometheus::TextEncoder::new()
                .encode_to_string(&registry.gather())
                .unwrap()
        };
        eventually(|| gathered().contains("xlb_bgp_peer_up{peer=\"10.0.0.254\"} 1")).await;
        eventually(|| gathered().contains("xlb_bgp_peer_uptime_seconds{peer=\"10.0.0.254\"} 42"))
            .await;
        eventually(|| gathered().contains("xlb_bgp_peer_prefixes_sent{peer=\"10.0.0.254\"} 2"))
            .await;
        // The speaker restarts empty, and is unreachable for a while: its
        // peer reads 0 meanwhile.
        *speaker.down.lock().unwrap() = true;
        r.lock().unwrap().clear();
        eventually(|| gathered().contains("xlb_bgp_peer_up{peer=\"10.0.0.254\"} 0")).await;
        let text = gathered();
        assert!(
            text.contains("xlb_bgp_peer_uptime_seconds{peer=\"10.0.0.254\"} 0")
                && !text.contains("xlb_bgp_peer_prefixes_sent{"),
            "{text}"
        );
        *speaker.down.lock().unwrap() = false;
        eventually(|| *r.lock().unwrap() == want).await;
        eventually(|| gathered().contains("xlb_bgp_peer_up{peer=\"10.0.0.254\"} 1")).await;
        task.withdraw_all().await;
        assert!(
            r.lock().unwrap().is_empty(),
            "everything withdrawn before shutdown"
        );
        let text = prometheus::TextEncoder::new()
            .encode_to_string(&registry.gather())
            .unwrap();
        assert!(
            text.contains("xlb_bgp_errors_total{kind=\"unreachable\"}"),
            "{text}"
        );
        assert!(
            text.contains("xlb_bgp_route_changes_total{action=\"withdraw\"} 2"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_graceful_shutdown_marks_every_route_until_the_withdrawal() {
        let speaker = MemorySpeaker::default();
        let task = AnnounceTask::start(
            Box::new(speaker.clone()),
            Duration::from_secs(60),
            &Registry::new(),
        );
        let mut tagged = route("192.0.2.10");
        tagged.communities = vec![(65000, 100)];
        task.apply([tagged.clone()].into(), BTreeSet::new());
        let r = speaker.routes.clone();
        eventually(|| r.lock().unwrap().len() == 1).await;
        task.graceful_shutdown().await;
        let mut marked = tagged.clone();
        marked.communities = vec![(65000, 100), GRACEFUL_SHUTDOWN];
        assert_eq!(*r.lock().unwrap(), [marked.clone()].into());
        // A VIP that comes meanwhile is marked too.
        task.apply([tagged, route("192.0.2.11")].into(), BTreeSet::new());
        let mut second = route("192.0.2.11");
        second.communities = vec![GRACEFUL_SHUTDOWN];
        eventually(|| *r.lock().unwrap() == [marked.clone(), second.clone()].into()).await;
        task.withdraw_all().await;
        assert!(r.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_speaker_that_cannot_limit_its_sessions_does_not_get_the_limited_vips() {
        let speaker = MemorySpeaker::default();
        let task = AnnounceTask::start(
            Box::new(speaker.clone()),
            Duration::from_secs(60),
            &Registry::new(),
        );
        task.set_advertisements(vec![Advertisement {
            name: "internal-to-tor".into(),
            covers: vec![("192.0.2.0".parse().unwrap(), "192.0.2.255".parse().unwrap())],
            communities: vec![],
            large_communities: vec![],
            local_pref: None,
            aggregation_length: None,
            aggregation_length_v6: None,
            peers: Some(["10.0.0.254".parse().unwrap()].into()),
        }]);
        task.apply(
            [route("192.0.2.10"), route("198.51.100.1")].into(),
            BTreeSet::new(),
        );
        let r = speaker.routes.clone();
        eventually(|| *r.lock().unwrap() == [route("198.51.100.1")].into()).await;
        // The limit gone: announced.
        task.set_advertisements(Vec::new());
        task.apply(
            [route("192.0.2.10"), route("198.51.100.1")].into(),
            BTreeSet::new(),
        );
        eventually(|| r.lock().unwrap().len() == 2).await;
    }

    #[test]
    fn sessions_the_agent_does_not_configure_are_named_where_limits_miss_them() {
        let set =
            |a: &[&str]| -> BTreeSet<IpAddr> { a.iter().map(|s| s.parse().unwrap()).collect() };
        let sessions = set(&["10.0.1.254", "10.0.9.9"]);
        let agent = set(&["10.0.1.254"]);
        assert_eq!(unheld_sessions(true, &sessions, &agent), set(&["10.0.9.9"]));
        assert!(unheld_sessions(false, &sessions, &agent).is_empty());
    }
}
