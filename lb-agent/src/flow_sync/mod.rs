//! SNAT flows shared between agents (`flow_sync:`, docs/bgp.md), so that
//! whichever node the router sends a flow to translates it as the node that
//! opened it. When the router's ECMP set changes, flows move between every
//! pair of nodes, not only from or to the one that left or joined (hash-
//! threshold multipath re-cuts every node's share): each node pushes the
//! flows it opened to the others every interval. A node that leaves pushes
//! all it has before it withdraws, and a node that starts pulls the others'
//! before it announces; a node that takes such a push or answers such a
//! pull first pushes its own newest flows to every peer, so that when the
//! set changes every node has every flow.
//! Over TCP, every frame signed with the cluster key (`wire`).

pub mod wire;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};
use rand::TryRngCore;
use tokio::{
    io::BufReader,
    net::{TcpListener, TcpStream},
    sync::{mpsc, oneshot, watch, Semaphore},
};
use tracing::{info, warn};

use self::wire::{Frame, Nonce, WireError, FLOWS_PER_FRAME};
use crate::dataplane::{Dataplane, FlowTable, HandedFlow, Handing, Imported};
use crate::seal::{Keyring, Purpose, SharedKeys};

/// The exchange as the agent drives it: its peers and this node's side.
#[derive(Clone)]
pub struct Exchange {
    pub peers: Peers,
    local: Local,
}

impl Exchange {
    /// Listens, and starts the periodic push.
    pub async fn start(
        cfg: &crate::config::FlowSyncConfig,
        dp: Arc<Mutex<Dataplane>>,
    ) -> anyhow::Result<Self> {
        use anyhow::Context as _;
        let listener = TcpListener::bind(cfg.listen)
            .await
            .with_context(|| format!("binding the flow exchange {}", cfg.listen))?;
        let local = Local::new(dp).context("a handle on the flow table")?;
        let listed = (!cfg.discover_peers).then(|| cfg.peers.clone());
        let peers = Peers::new(&cfg.keys, listed);
        let sync_now = start_sync(peers.clone(), local.clone(), cfg.interval);
        start_forgetting(local.clone(), cfg.listen.port(), cfg.forget_after);
        tokio::spawn(serve(listener, peers.keys.clone(), local.clone(), sync_now));
        Ok(Self { peers, local })
    }

    /// Pulls every peer's flows and imports them.
    pub async fn take_from_peers(&self) -> Imported {
        take_from_peers(&self.peers, &self.local).await
    }

    /// Pushes the flows `which` names to every peer.
    pub async fn give_to_peers(&self, which: Handing) {
        give_to_peers(&self.peers, &self.local, which).await
    }

    /// The SNAT addresses of every flow taken from a peer so far: the
    /// sources this node sends from when it forwards a peer's flow.
    pub fn snat_addresses(&self) -> BTreeSet<IpAddr> {
        self.local.snat_seen.lock().expect("snat lock").clone()
    }
}

/// This node's side: the data plane (for its ids, briefly) and a handle of
/// the flow table's own, walked and written without the data plane's lock.
#[derive(Clone)]
struct Local {
    dp: Arc<Mutex<Dataplane>>,
    table: Arc<Mutex<FlowTable>>,
    snat_seen: Arc<Mutex<BTreeSet<IpAddr>>>,
}

impl Local {
    fn new(dp: Arc<Mutex<Dataplane>>) -> Result<Self, crate::dataplane::DataplaneError> {
        let table = dp.lock().expect("data plane lock").flow_table()?;
        Ok(Self {
            dp,
            table: Arc::new(Mutex::new(table)),
            snat_seen: Arc::default(),
        })
    }

    /// Blocks for a walk of the flow table.
    fn export(&self, which: Handing) -> Result<Vec<HandedFlow>, String> {
        let lifetimes = self
            .dp
            .lock()
            .expect("data plane lock")
            .handoff_ids()
            .lifetimes();
        let table = self.table.lock().expect("flow table lock");
        table
            .handed_flows(&lifetimes, which)
            .map_err(|e| e.to_string())
    }

    /// Blocks for a system call per flow.
    fn import(&self, flows: &[HandedFlow]) -> Result<Imported, String> {
        let ids = self.dp.lock().expect("data plane lock").handoff_ids();
        self.snat_seen
            .lock()
            .expect("snat lock")
            .extend(flows.iter().filter_map(|f| f.snat.map(|a| a.ip())));
        let mut table = self.table.lock().expect("flow table lock");
        table.import_flows(&ids, flows).map_err(|e| e.to_string())
    }

    /// The peers' SNAT addresses that came with their flows, not this
    /// node's own (a flow that comes home has this node's).
    fn peer_snat_addresses(&self) -> Vec<IpAddr> {
        let own = self
            .dp
            .lock()
            .expect("data plane lock")
            .handoff_ids()
            .own_snat_addresses();
        let seen = self.snat_seen.lock().expect("snat lock");
        seen.iter().filter(|a| !own.contains(a)).copied().collect()
    }

    /// Forgets the flows `which` names translated with a peer's SNAT
    /// address (all of them: the address too); how many flows. Blocks for
    /// a walk of the flow table.
    fn forget(&self, snat: IpAddr, which: Forget) -> Result<usize, String> {
        if which == Forget::All {
            self.snat_seen.lock().expect("snat lock").remove(&snat);
        }
        let mut table = self.table.lock().expect("flow table lock");
        table
            .forget_handed(snat, which == Forget::Udp)
            .map_err(|e| e.to_string())
    }

    async fn export_async(&self, which: Handing) -> Result<Vec<HandedFlow>, String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.export(which))
            .await
            .map_err(|e| e.to_string())?
    }

    async fn import_async(&self, flows: Vec<HandedFlow>) -> Result<Imported, String> {
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.import(&flows))
            .await
            .map_err(|e| e.to_string())?
    }
}

/// Exchanges served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 8;
/// Time an exchange may take on the serving side: beyond the longest push
/// a peer makes ([`MAX_PUSH_TIMEOUT`]).
const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(10);
/// Time a periodic push of `flows` may take: a second, and the time a busy
/// peer takes to import them (a backlog: a peer back after a partition, a
/// node's first round), up to `MAX_PUSH_TIMEOUT`. The rounds that start
/// meanwhile skip that peer only; a silent peer fails at its first step.
fn push_timeout(flows: usize) -> Duration {
    (STEP_TIMEOUT + IMPORT_TIME_PER_FLOW * flows as u32).min(MAX_PUSH_TIMEOUT)
}
const MAX_PUSH_TIMEOUT: Duration = Duration::from_secs(5);
/// A debug build's import on a loaded two-core machine took about 130 µs a
/// flow; a release build's takes a tenth of that.
const IMPORT_TIME_PER_FLOW: Duration = Duration::from_micros(200);
/// Time one step of an exchange may take ([`step`]): connecting.
const STEP_TIMEOUT: Duration = Duration::from_secs(1);
/// Time writing a frame may take: once the sockets' buffers are full, a
/// write waits for the peer to import a frame before (up to
/// `FLOWS_PER_FRAME` flows, 0.8 s at `IMPORT_TIME_PER_FLOW`), behind any
/// other peer's push it takes at the same time.
const FRAME_TIMEOUT: Duration = Duration::from_secs(3);
/// Time a leaving node's push may take (the peer pushes its own first): its
/// withdrawal waits for it.
const LEAVING_PUSH_TIMEOUT: Duration = Duration::from_secs(2);
/// Which of a silent peer's flows to forget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Forget {
    Udp,
    All,
}

/// Time a pull may take: a starting node's first announcement waits for it
/// (a silent peer fails at the first step).
const PULL_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a peer's SNAT address is probed, and how long a probe waits:
/// a UDP flow of a node that died goes at its first silent probe, so
/// this bounds its outage beside the VIP's takeover (about 400 ms). A
/// probe that is only slow costs UDP flows their source port, no more.
const PROBE_INTERVAL: Duration = Duration::from_millis(200);
const PROBE_TIMEOUT: Duration = Duration::from_millis(300);

/// This agent's side of the exchange: its keys and its peers.
#[derive(Clone)]
pub struct Peers {
    keys: SharedKeys,
    /// `None` until discovered peers are first known.
    list: Arc<watch::Sender<Option<Vec<SocketAddr>>>>,
    stats: PeerStats,
}

/// What became of this agent's pushes and pulls, per peer (`/metrics`,
/// `lbctl status`).
#[derive(Clone)]
struct PeerStats {
    last_ok: GaugeVec,
    exchanges: IntCounterVec,
}

impl PeerStats {
    fn new() -> Self {
        let last_ok = GaugeVec::new(
            Opts::new(
                "xlb_flow_sync_last_exchange_timestamp_seconds",
                "When a push to or a pull from the peer last succeeded (Unix time)",
            ),
            &["peer"],
        )
        .expect("metric");
        let exchanges = IntCounterVec::new(
            Opts::new(
                "xlb_flow_sync_exchanges_total",
                "Pushes to and pulls from the peer, by result (ok or error)",
            ),
            &["peer", "result"],
        )
        .expect("metric");
        Self { last_ok, exchanges }
    }

    fn record<T>(&self, results: &[(SocketAddr, Result<T, String>)]) {
        for (peer, r) in results {
            let peer = peer.to_string();
            let result = if r.is_ok() { "ok" } else { "error" };
            self.exchanges.with_label_values(&[&peer, result]).inc();
            if r.is_ok() {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default();
                self.last_ok
                    .with_label_values(&[&peer])
                    .set(now.as_secs_f64());
            }
        }
    }
}

impl Peers {
    /// `peers`: `None` when they are to be discovered ([`Peers::set`]).
    pub fn new(secrets: &[Vec<u8>], peers: Option<Vec<SocketAddr>>) -> Self {
        Self {
            keys: SharedKeys::new(Keyring::new(secrets, Purpose::FlowSync)),
            list: Arc::new(watch::Sender::new(peers)),
            stats: PeerStats::new(),
        }
    }

    /// Adds the exchange's per-peer series to `registry`.
    pub fn register_metrics(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.stats.last_ok.clone()))?;
        registry.register(Box::new(self.stats.exchanges.clone()))
    }

    /// The peers, as discovered now.
    /// Seals with the first of `secrets` from now on, and opens with any
    /// (a key rotation's step).
    pub fn set_keys(&self, secrets: &[Vec<u8>]) {
        self.keys.set(Keyring::new(secrets, Purpose::FlowSync));
    }

    pub fn set(&self, peers: Vec<SocketAddr>) {
        self.list.send_replace(Some(peers));
    }

    /// Waits (at most `within`) until the peers are known; whether they are.
    pub async fn known(&self, within: Duration) -> bool {
        let mut rx = self.list.subscribe();
        let known = tokio::time::timeout(within, rx.wait_for(Option::is_some)).await;
        known.is_ok()
    }

    fn current(&self) -> Vec<SocketAddr> {
        self.list.borrow().clone().unwrap_or_default()
    }

    /// Sends `flows` to every peer at once; each peer's count taken, or why
    /// not. `leaving`: this node is about to leave the ECMP set.
    pub async fn push(
        &self,
        flows: &[HandedFlow],
        leaving: bool,
    ) -> Vec<(SocketAddr, Result<u32, String>)> {
        self.push_to(&self.current(), flows, leaving).await
    }

    /// As [`Peers::push`], to the peers `to` only.
    async fn push_to(
        &self,
        to: &[SocketAddr],
        flows: &[HandedFlow],
        leaving: bool,
    ) -> Vec<(SocketAddr, Result<u32, String>)> {
        let flows = Arc::new(flows.to_vec());
        let all = to.iter().copied().map(|p| {
            let (key, flows) = (self.keys.get(), flows.clone());
            let t = if leaving {
                LEAVING_PUSH_TIMEOUT
            } else {
                push_timeout(flows.len())
            };
            async move {
                let r = tokio::time::timeout(t, push_to(p, &key, &flows, leaving)).await;
                (p, flatten(r, t))
            }
        });
        let results = futures::future::join_all(all).await;
        self.stats.record(&results);
        results
    }

    /// Asks every peer for its SNAT flows at once.
    pub async fn pull(&self) -> Vec<(SocketAddr, Result<Vec<HandedFlow>, String>)> {
        let all = self.current().into_iter().map(|p| {
            let key = self.keys.get();
            let t = PULL_TIMEOUT;
            async move {
                let r = tokio::time::timeout(t, pull_from(p, &key)).await;
                (p, flatten(r, t))
            }
        });
        let results = futures::future::join_all(all).await;
        self.stats.record(&results);
        results
    }
}

fn flatten<T>(
    r: Result<Result<T, WireError>, tokio::time::error::Elapsed>,
    t: Duration,
) -> Result<T, String> {
    match r {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {t:?}")),
    }
}

fn nonce() -> Nonce {
    let mut n = [0u8; 16];
    rand::rngs::OsRng
        .try_fill_bytes(&mut n)
        .expect("the OS random source");
    n
}

async fn push_to(
    peer: SocketAddr,
    key: &Keyring,
    flows: &[HandedFlow],
    leaving: bool,
) -> Result<u32, WireError> {
    let n = nonce();
    let mut s = step(STEP_TIMEOUT, TcpStream::connect(peer)).await?;
    let _ = s.set_nodelay(true);
    if leaving {
        step(FRAME_TIMEOUT, wire::write(&mut s, key, &n, &Frame::Leaving)).await?;
    }
    for chunk in flows.chunks(FLOWS_PER_FRAME) {
        let frame = Frame::Flows(chunk.to_vec());
        step(FRAME_TIMEOUT, wire::write(&mut s, key, &n, &frame)).await?;
    }
    let done = Frame::Done(flows.len() as u32);
    step(FRAME_TIMEOUT, wire::write(&mut s, key, &n, &done)).await?;
    // Not a step: the answer comes once the peer has imported every frame
    // (most of them may wait in the sockets' buffers), and a leaving node's
    // once the peer has pushed its own flows too (`answer`).
    match wire::read(&mut BufReader::new(s), key, Some(&n)).await? {
        (_, Frame::Done(taken)) => Ok(taken),
        _ => Err(WireError::Malformed),
    }
}

/// One step of an exchange (a connection, a frame written), given at
/// most `t`: a peer that is silent or stalled ends the exchange early, not
/// at its whole timeout.
async fn step<T, E: Into<WireError>>(
    t: Duration,
    f: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, WireError> {
    match tokio::time::timeout(t, f).await {
        Ok(r) => r.map_err(Into::into),
        Err(_) => Err(WireError::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no progress within {t:?}"),
        ))),
    }
}

async fn pull_from(peer: SocketAddr, key: &Keyring) -> Result<Vec<HandedFlow>, WireError> {
    let n = nonce();
    let mut s = step(STEP_TIMEOUT, TcpStream::connect(peer)).await?;
    let _ = s.set_nodelay(true);
    wire::write(&mut s, key, &n, &Frame::Pull).await?;
    let mut r = BufReader::new(s);
    let mut out = Vec::new();
    loop {
        match wire::read(&mut r, key, Some(&n)).await? {
            (_, Frame::Flows(f)) => out.extend(f),
            (_, Frame::Done(sent)) if sent as usize == out.len() => return Ok(out),
            _ => return Err(WireError::Malformed),
        }
    }
}

/// Asks the periodic sync to push this node's newest flows at once, and
/// waits until it has.
#[derive(Clone)]
pub struct SyncNow(mpsc::Sender<oneshot::Sender<()>>);

impl SyncNow {
    /// As [`SyncNow::run`], waiting `STEP_TIMEOUT` at most: the peer that
    /// asked waits for the answer, and a slow push to a third node must
    /// not make it give up (the push goes on).
    async fn run_awhile(&self) {
        let _ = tokio::time::timeout(STEP_TIMEOUT, self.run()).await;
    }

    async fn run(&self) {
        let (tx, rx) = oneshot::channel();
        if self.0.send(tx).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// Serves pushes and pulls until the task is dropped or aborted.
async fn serve(listener: TcpListener, keys: SharedKeys, local: Local, sync_now: SyncNow) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                warn!(error = %e, "flow exchange: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (key, local, sync_now) = (keys.get(), local.clone(), sync_now.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let exchange = answer(stream, &key, &local, &sync_now);
            match tokio::time::timeout(EXCHANGE_TIMEOUT, exchange).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => warn!(%peer, "flow exchange refused: {e}"),
                Err(_) => {
                    warn!(%peer, "flow exchange: no complete exchange within {EXCHANGE_TIMEOUT:?}")
                }
            }
        });
    }
}

/// One exchange: a pull answered with this node's SNAT flows, or a push
/// imported. A pull (a node starting) or a leaving node's push means the
/// ECMP set is about to change: this node's newest flows go to every peer
/// before the answer.
async fn answer(
    stream: TcpStream,
    key: &Keyring,
    local: &Local,
    sync_now: &SyncNow,
) -> Result<(), WireError> {
    let _ = stream.set_nodelay(true);
    let (r, mut w) = stream.into_split();
    let mut r = BufReader::new(r);
    // Closed before a byte: a peer's probe (`answers`), not an exchange.
    if tokio::io::AsyncBufReadExt::fill_buf(&mut r)
        .await?
        .is_empty()
    {
        return Ok(());
    }
    let (n, mut first) = wire::read(&mut r, key, None).await?;
    let leaving = first == Frame::Leaving;
    if leaving {
        first = wire::read(&mut r, key, Some(&n)).await?.1;
    }
    if first == Frame::Pull && !leaving {
        sync_now.run_awhile().await;
        let flows = local
            .export_async(Handing::All)
            .await
            .map_err(|e| WireError::Io(std::io::Error::other(e)))?;
        for chunk in flows.chunks(FLOWS_PER_FRAME) {
            wire::write(&mut w, key, &n, &Frame::Flows(chunk.to_vec())).await?;
        }
        wire::write(&mut w, key, &n, &Frame::Done(flows.len() as u32)).await?;
        info!(
            flows = flows.len(),
            "flow exchange: sent this node's flows to a starting node"
        );
        return Ok(());
    }
    let mut total = Imported::default();
    let mut frame = first;
    loop {
        match frame {
            Frame::Flows(flows) => {
                let got = local
                    .import_async(flows)
                    .await
                    .map_err(|e| WireError::Io(std::io::Error::other(e)))?;
                add(&mut total, got);
            }
            Frame::Done(_) => break,
            Frame::Pull | Frame::Leaving => return Err(WireError::Malformed),
        }
        frame = wire::read(&mut r, key, Some(&n)).await?.1;
    }
    if leaving {
        info!(?total, "flow exchange: took a leaving node's flows");
        sync_now.run_awhile().await;
    }
    let taken = (total.added + total.present) as u32;
    wire::write(&mut w, key, &n, &Frame::Done(taken)).await?;
    Ok(())
}

/// Pulls every peer's flows and imports them; logs what each gave.
async fn take_from_peers(peers: &Peers, local: &Local) -> Imported {
    let mut total = Imported::default();
    for (peer, r) in peers.pull().await {
        match r {
            Ok(flows) => match local.import_async(flows).await {
                Ok(got) => {
                    info!(%peer, ?got, "flow exchange: took a peer's flows");
                    add(&mut total, got);
                }
                Err(e) => warn!(%peer, "flow exchange: importing a peer's flows: {e}"),
            },
            Err(e) => warn!(%peer, "flow exchange: no flows from this peer: {e}"),
        }
    }
    total
}

/// Pushes the SNAT flows `which` names to every peer; with `Handing::All`,
/// as a node about to leave.
async fn give_to_peers(peers: &Peers, local: &Local, which: Handing) {
    let flows = match local.export_async(which).await {
        Ok(f) => f,
        Err(e) => {
            warn!("flow exchange: reading this node's flows: {e}");
            return;
        }
    };
    if flows.is_empty() && which != Handing::All {
        return;
    }
    for (peer, r) in peers.push(&flows, which == Handing::All).await {
        match r {
            Ok(taken) if which == Handing::All => {
                info!(%peer, sent = flows.len(), taken, "flow exchange: gave all flows")
            }
            Ok(_) => {}
            Err(e) => {
                warn!(%peer, sent = flows.len(), "flow exchange: this peer did not take our flows: {e}")
            }
        }
    }
}

/// Starts pushing the flows this node opens to every peer, every
/// `interval` and whenever asked through the returned handle; stops when
/// the runtime does. Each peer is sent what this node opened since its
/// last push that peer took: one cut off (a partition) gets the flows it
/// missed once it answers again, so that connections opened here
/// meanwhile survive the VIP's moving back to it. A push runs on its own:
/// a peer that takes long (a big backlog, a busy node) misses the rounds
/// that start meanwhile and delays no other peer's flows.
fn start_sync(peers: Peers, local: Local, interval: Duration) -> SyncNow {
    let (tx, mut rx) = mpsc::channel::<oneshot::Sender<()>>(16);
    tokio::spawn(async move {
        // The first round hands on every flow opened here: those the
        // program opened while no agent ran, and those an agent that
        // restarted had not pushed yet, are on no other node.
        let mut previous = 0;
        // Kept for peers that drop out of the list too: one discovered
        // again after a partition still gets what it missed.
        let since: Arc<Mutex<BTreeMap<SocketAddr, u64>>> = Arc::default();
        let busy: Arc<Mutex<BTreeSet<SocketAddr>>> = Arc::default();
        let mut wait = interval;
        loop {
            let done = tokio::select! {
                _ = tokio::time::sleep(wait) => None,
                asked = rx.recv() => match asked {
                    Some(done) => Some(done),
                    None => return,
                },
            };
            // Taken before the walk: a flow opened during it goes next time.
            let start = crate::maps::coarse_now_ns();
            let mut groups: BTreeMap<u64, Vec<SocketAddr>> = BTreeMap::new();
            {
                let mut since = since.lock().expect("sync lock");
                let mut busy = busy.lock().expect("sync lock");
                for p in peers.current() {
                    if busy.insert(p) {
                        groups
                            .entry(*since.entry(p).or_insert(previous))
                            .or_default()
                            .push(p);
                    }
                }
            }
            // One walk per distinct watermark, one after the other (they
            // share the table's lock); then the pushes, each on its own.
            let walking = std::time::Instant::now();
            let mut pushes = Vec::new();
            for (t, to) in groups {
                let flows = match local.export_async(Handing::OpenedHereSince(t)).await {
                    Ok(flows) => Arc::new(flows),
                    Err(e) => {
                        warn!("flow exchange: reading this node's flows: {e}");
                        busy.lock().expect("sync lock").retain(|p| !to.contains(p));
                        continue;
                    }
                };
                for peer in to {
                    let (peers, flows) = (peers.clone(), flows.clone());
                    let since = since.clone();
                    let pushing = Pushing(busy.clone(), peer);
                    pushes.push(tokio::spawn(async move {
                        let _pushing = pushing;
                        if push_flows(&peers, &flows, peer).await {
                            since.lock().expect("sync lock").insert(peer, start);
                        }
                    }));
                }
            }
            let walks = walking.elapsed();
            previous = start;
            // A big table's walk (about 0.3 µs an entry) stretches the
            // interval so that the exchange takes a tenth of a core at most.
            // The walks only: a peer that does not answer costs a push
            // timeout, not CPU, and stretching by it would leave the
            // others' flows late for as long as the peer is away.
            wait = interval.max(walks * 9);
            if let Some(done) = done {
                tokio::spawn(async move {
                    futures::future::join_all(pushes).await;
                    let _ = done.send(());
                });
            }
        }
    });
    SyncNow(tx)
}

/// A peer's push under way: it leaves the busy set however the push ends.
struct Pushing(Arc<Mutex<BTreeSet<SocketAddr>>>, SocketAddr);

impl Drop for Pushing {
    fn drop(&mut self) {
        if let Ok(mut busy) = self.0.lock() {
            busy.remove(&self.1);
        }
    }
}

/// Pushes `flows` to `peer`; whether it took them.
async fn push_flows(peers: &Peers, flows: &[HandedFlow], peer: SocketAddr) -> bool {
    if flows.is_empty() {
        return true;
    }
    match peers.push_to(&[peer], flows, false).await.pop() {
        Some((_, Ok(_))) => true,
        Some((_, Err(e))) => {
            warn!(%peer, sent = flows.len(), "flow exchange: this peer did not take our flows (sent again with the next push): {e}");
            false
        }
        None => false,
    }
}

/// Forgets the flows a peer handed over once the address they are
/// translated with (the peer's SNAT address) answers nothing: the peer is
/// gone (powered off, or cut off), and the backends' replies to that
/// address are lost. A UDP flow goes at the first probe that finds the
/// address silent: picked afresh it loses only its source address and
/// port. A TCP flow picked afresh is reset by its backend, so it waits
/// `after` for the peer to come back (a healed cut, a restart) before it
/// goes and its client reconnects. A node whose agent is down but whose
/// kernel lives answers the probe (an accept or a refusal on the
/// exchange's port): its program still translates those replies, so its
/// flows are kept.
fn start_forgetting(local: Local, port: u16, after: Duration) {
    struct Silence {
        since: std::time::Instant,
        udp_gone: bool,
    }
    tokio::spawn(async move {
        let mut silent: BTreeMap<IpAddr, Silence> = BTreeMap::new();
        loop {
            tokio::time::sleep(PROBE_INTERVAL).await;
            let local2 = local.clone();
            let Ok(theirs) =
                tokio::task::spawn_blocking(move || local2.peer_snat_addresses()).await
            else {
                return;
            };
            silent.retain(|a, _| theirs.contains(a));
            let probed = std::time::Instant::now();
            let probes = theirs
                .iter()
                .map(|&a| async move { (a, answers(SocketAddr::new(a, port)).await) });
            for (addr, answered) in futures::future::join_all(probes).await {
                if answered {
                    silent.remove(&addr);
                    continue;
                }
                let s = silent.entry(addr).or_insert(Silence {
                    since: probed,
                    udp_gone: false,
                });
                let which = if s.since.elapsed() >= after {
                    silent.remove(&addr);
                    Forget::All
                } else if !s.udp_gone {
                    s.udp_gone = true;
                    Forget::Udp
                } else {
                    continue;
                };
                let local = local.clone();
                match tokio::task::spawn_blocking(move || local.forget(addr, which)).await {
                    Ok(Ok(0)) => {}
                    Ok(Ok(n)) if which == Forget::Udp => info!(
                        %addr, forgotten = n, tcp_kept_for = ?after,
                        "flow exchange: a peer's SNAT address answered nothing: its UDP flows are picked afresh here"
                    ),
                    Ok(Ok(n)) => info!(
                        %addr, forgotten = n, ?after,
                        "flow exchange: a peer's SNAT address answered nothing: the flows translated with it are forgotten here"
                    ),
                    Ok(Err(e)) => {
                        warn!(%addr, "flow exchange: forgetting a gone peer's flows: {e}")
                    }
                    Err(e) => warn!(%addr, "flow exchange: forgetting a gone peer's flows: {e}"),
                }
            }
        }
    });
}

/// Whether anything answers at `addr`: a connection accepted or refused
/// (the kernel lives), not silence or an unreachable host.
async fn answers(addr: SocketAddr) -> bool {
    match tokio::time::timeout(PROBE_TIMEOUT, TcpStream::connect(addr)).await {
        Ok(Ok(_)) => true,
        Ok(Err(e)) => e.kind() == std::io::ErrorKind::ConnectionRefused,
        Err(_) => false,
    }
}

fn add(total: &mut Imported, got: Imported) {
    total.added += got.added;
    total.present += got.present;
    total.replaced += got.replaced;
    total.closed += got.closed;
    total.unknown_service += got.unknown_service;
    total.unknown_backend += got.unknown_backend;
}
