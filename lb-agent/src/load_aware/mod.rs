//! Load-aware balancing: weights that follow the backends' load.
//!
//! [`LoadTask`] runs every `load_aware.interval` for the services with
//! `balance: load-aware`. It gathers each backend's signals:
//!
//! 1. open flows, from the data plane's counters (flows opened minus flows
//!    whose client sent FIN or RST), corrected by a walk of the flow table
//!    every [`WALK_EVERY`] steps for flows that vanished without a FIN;
//! 2. the health check's latency, when the service has a check;
//! 3. the backend's own report through HAProxy's agent check
//!    ([`agent_check`]), when configured;
//! 4. for a backend on this node whose cgroup is known, its CPU load
//!    ([`cgroup`]);
//!
//! and hands them to one [`controller::Controller`] per service, whose rule
//! docs/load-aware.md describes. The weights it publishes are applied by the
//! agent's reconcile like any other change: the Maglev table is replaced
//! atomically and established flows keep their backend (the flow table).

pub mod agent_check;
pub mod cgroup;
pub mod controller;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use lb_common::{flow_time_bucket_start, FlowTimes, ServiceKey};
use tokio::{sync::watch, task::JoinHandle, time::MissedTickBehavior};
use tracing::{info, warn};

use self::cgroup::{Hierarchies, Sample};
use self::controller::{Controller, Decision, Params, Report, Signals};
use crate::{
    dataplane::Dataplane,
    health::HealthSnapshot,
    service::{AgentCheck, BackendCgroup},
};

/// The flow table is walked every this many steps (a syscall per flow).
pub const WALK_EVERY: u64 = 10;
/// Open flows are sampled this many times per step and averaged: one
/// sample of a few flows says little, and a backend's queue fills and
/// empties faster than a step.
const SAMPLES: u64 = 10;

/// Flows not seen for this long are not counted as open by the walk.
const ACTIVE: Duration = Duration::from_secs(30);

/// A backend's flows are timed over the steps it takes to close this many:
/// fewer say little.
const MIN_TIMED_FLOWS: u32 = 5;

/// A load-aware service, as the agent's reconcile sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadTarget {
    pub key: ServiceKey,
    pub name: String,
    /// Backends in the service (health checks passed) and their configured weights.
    pub backends: Vec<(SocketAddr, u32)>,
    pub agent_check: Option<AgentCheck>,
    /// The backends whose cgroup is on this node.
    pub cgroups: Vec<(SocketAddr, BackendCgroup)>,
    /// The data plane picks the least loaded of three candidates per new flow.
    pub least_loaded: bool,
}

/// What the controller decided for one backend, and the signals behind it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackendLoad {
    pub decision: Decision,
    pub signals: Signals,
}

impl BackendLoad {
    /// As `BACKEND_LOAD` holds it.
    pub fn record(&self) -> lb_common::BackendLoad {
        let milli = |x: f64| (x * 1000.0).round().clamp(0.0, u32::MAX as f64) as u32;
        let (report, report_pct) = match self.signals.report {
            None => (lb_common::LOAD_REPORT_NONE, 0),
            Some(Report::Percent(p)) => (lb_common::LOAD_REPORT_PERCENT, p),
            Some(Report::Drain) => (lb_common::LOAD_REPORT_DRAIN, 0),
            Some(Report::Down) => (lb_common::LOAD_REPORT_DOWN, 0),
        };
        lb_common::BackendLoad {
            weight: self.decision.weight,
            factor_milli: milli(self.decision.factor),
            pressure_milli: milli(self.decision.pressure),
            open_flows: self.signals.open_flows.unwrap_or(0.0) as u32,
            latency_us: self
                .signals
                .latency
                .map_or(u32::MAX, |l| l.as_micros().min(u32::MAX as u128 - 1) as u32),
            report,
            report_pct,
            flags: lb_common::LOAD_F_SET,
            cpu_milli: self.signals.cpu.map_or(u32::MAX, milli),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct ServiceLoad {
    pub name: String,
    pub backends: BTreeMap<SocketAddr, BackendLoad>,
    /// Every backend reported drain: the reports are set aside.
    pub all_draining: bool,
}

/// The latest decisions, by service.
pub type LoadWeights = Arc<BTreeMap<ServiceKey, ServiceLoad>>;

/// Runs the controllers; dropping it stops them.
pub struct LoadTask {
    targets: watch::Sender<Vec<LoadTarget>>,
    handle: JoinHandle<()>,
}

impl Drop for LoadTask {
    fn drop(&mut self) {
        self.handle.abort();
    }
}

impl LoadTask {
    /// Starts the task; the receiver wakes at every step.
    pub fn start(
        dp: Arc<Mutex<Dataplane>>,
        health: watch::Receiver<HealthSnapshot>,
        interval: Duration,
        cgroups: Hierarchies,
    ) -> (LoadTask, watch::Receiver<LoadWeights>) {
        let (targets, targets_rx) = watch::channel(Vec::new());
        let (tx, rx) = watch::channel(LoadWeights::default());
        let mut run = Run {
            dp,
            health,
            interval,
            targets: targets_rx,
            tx,
            controllers: BTreeMap::new(),
            flows: BTreeMap::new(),
            timed: BTreeMap::new(),
            agents: BTreeMap::new(),
            cgroups,
            cpu: BTreeMap::new(),
        };
        let handle = tokio::spawn(async move { run.run().await });
        (LoadTask { targets, handle }, rx)
    }

    /// The load-aware services now (sent on when they changed).
    pub fn set_targets(&self, mut targets: Vec<LoadTarget>) {
        targets.sort_by_key(|t| t.key);
        self.targets.send_if_modified(|cur| {
            let changed = *cur != targets;
            if changed {
                *cur = targets;
            }
            changed
        });
    }
}

/// The data plane's counters for one backend at the last walk.
#[derive(Clone, Copy, Debug)]
struct FlowCount {
    id: u32,
    /// Open flows, as the walk set them right.
    base: u64,
    opened: u64,
    closed: u64,
}

/// One backend's data-plane counters, read together.
#[derive(Clone, Copy, Debug)]
struct Counters {
    /// `BACKEND_ACTIVE`: the open-flow count new flows are placed by.
    active: i64,
    /// Flows opened and closed so far (`new_flows`, `BACKEND_CLOSED`).
    opened: u64,
    closed: u64,
}

/// How far a backend's `BACKEND_ACTIVE` is off (positive: too high), as
/// far as a walk of the flow table that found `walked` open flows can
/// prove, from the counters read just before and just after it.
///
/// The count drifts by flows that left the table without a FIN or RST
/// (evicted, expired). The walk is not a snapshot: a flow opened while it
/// ran may or may not be found, and so may one closed while it ran. The
/// drift therefore lies between `before.active - walked - closes` and
/// `before.active - walked + opens`; the walk proves only the part of it
/// outside the churn, and the value nearest 0 in that range is returned.
/// Setting the count to what the walk found instead, as xlb did, was
/// wrong by a few flows a backend at a few thousand flows a second, which
/// least-loaded placement then held against it until the next walk.
fn walk_drift(before: &Counters, walked: u64, after: &Counters) -> i64 {
    let opens = after.opened.saturating_sub(before.opened) as i64;
    let closes = after.closed.saturating_sub(before.closed) as i64;
    let seen = before.active - walked as i64;
    let (low, high) = (seen - closes, seen + opens);
    if low > 0 {
        low
    } else if high < 0 {
        high
    } else {
        0
    }
}

/// One backend's agent check: the latest answer, and the last error logged.
#[derive(Default)]
struct AgentState {
    report: Option<Report>,
    error: Option<String>,
}

/// One local backend's cgroup: where it was found and the last reading.
struct CpuState {
    group: BackendCgroup,
    path: Option<std::path::PathBuf>,
    last: Option<Sample>,
    error: Option<String>,
}

struct Run {
    dp: Arc<Mutex<Dataplane>>,
    health: watch::Receiver<HealthSnapshot>,
    interval: Duration,
    targets: watch::Receiver<Vec<LoadTarget>>,
    tx: watch::Sender<LoadWeights>,
    controllers: BTreeMap<ServiceKey, Controller>,
    flows: BTreeMap<(ServiceKey, SocketAddr), FlowCount>,
    /// Each backend's id and `FLOW_TIMES` when its flows were last timed
    /// (or first seen).
    timed: BTreeMap<(ServiceKey, SocketAddr), (u32, FlowTimes)>,
    agents: BTreeMap<SocketAddr, AgentState>,
    cgroups: Hierarchies,
    cpu: BTreeMap<SocketAddr, CpuState>,
}

impl Run {
    async fn run(&mut self) {
        let mut ticker = tokio::time::interval(self.interval / SAMPLES as u32);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut sums: BTreeMap<(ServiceKey, SocketAddr), (f64, u32)> = BTreeMap::new();
        let mut tick = 0u64;
        loop {
            ticker.tick().await;
            let targets = self.targets.borrow().clone();
            let walk = tick.is_multiple_of(SAMPLES * WALK_EVERY);
            for (k, n) in self.open_flows(&targets, walk) {
                let e = sums.entry(k).or_default();
                e.0 += n as f64;
                e.1 += 1;
            }
            tick += 1;
            if !tick.is_multiple_of(SAMPLES) {
                continue;
            }
            let open = std::mem::take(&mut sums)
                .into_iter()
                .map(|(k, (sum, n))| (k, sum / n as f64))
                .collect();
            self.step(&targets, open).await;
        }
    }

    /// One controller step per service, from the open flows averaged over
    /// the interval and the other signals now.
    async fn step(
        &mut self,
        targets: &[LoadTarget],
        open: BTreeMap<(ServiceKey, SocketAddr), f64>,
    ) {
        self.controllers
            .retain(|k, _| targets.iter().any(|t| t.key == *k));
        self.flows.retain(|(k, a), _| {
            targets
                .iter()
                .any(|t| t.key == *k && t.backends.iter().any(|b| b.0 == *a))
        });
        let flow_times = self.flow_times(targets);
        let reports = self.agent_reports(targets).await;
        let cpu = self.cpu_loads(targets);
        let health = self.health.borrow().clone();
        let mut all = BTreeMap::new();
        for t in targets {
            let signals: BTreeMap<SocketAddr, Signals> = t
                .backends
                .iter()
                .map(|&(addr, weight)| {
                    let s = Signals {
                        weight,
                        open_flows: open.get(&(t.key, addr)).copied(),
                        flow_time: flow_times.get(&(t.key, addr)).copied(),
                        latency: health.get(&addr).and_then(|h| h.latency),
                        probe_failed: health.get(&addr).is_some_and(|h| h.last_error.is_some()),
                        report: reports.get(&(t.key, addr)).copied(),
                        cpu: cpu.get(&addr).copied(),
                    };
                    (addr, s)
                })
                .collect();
            let c = self
                .controllers
                .entry(t.key)
                .or_insert_with(|| Controller::new(Params::for_service(t.least_loaded)));
            let was_draining = c.all_draining;
            let decisions = c.step(&signals);
            if c.all_draining && !was_draining {
                warn!(service = %t.name, "every backend reports drain: the reports are set aside so that new flows still have a backend");
            }
            let backends = decisions
                .into_iter()
                .map(|(a, decision)| {
                    (
                        a,
                        BackendLoad {
                            decision,
                            signals: signals[&a],
                        },
                    )
                })
                .collect();
            all.insert(
                t.key,
                ServiceLoad {
                    name: t.name.clone(),
                    backends,
                    all_draining: c.all_draining,
                },
            );
        }
        // Every step, for the metrics and lbctl; the agent reprograms the
        // data plane only when a weight changed (`weights_differ`), and
        // records the decisions (`record`) once the data plane has them.
        self.tx.send_replace(Arc::new(all));
    }

    /// Open flows per backend: the count set right at the last walk plus
    /// flows opened minus flows closed since.
    fn open_flows(
        &mut self,
        targets: &[LoadTarget],
        walk: bool,
    ) -> BTreeMap<(ServiceKey, SocketAddr), u64> {
        let mut dp = self.dp.lock().expect("data plane lock");
        let ids: Vec<((ServiceKey, SocketAddr), u32)> = targets
            .iter()
            .flat_map(|t| t.backends.iter().map(move |&(addr, _)| (t.key, addr)))
            .filter_map(|k| dp.backend_id(&k.0, k.1).map(|id| (k, id)))
            .collect();
        let counters = |dp: &Dataplane, id: u32| {
            let (opened, closed) = dp.backend_flows(id).ok()?;
            let active = dp.backend_active(id).ok()?;
            Some(Counters {
                active,
                opened,
                closed,
            })
        };
        let corrected: Option<BTreeMap<u32, Counters>> = walk
            .then(|| {
                let before: BTreeMap<u32, Counters> = ids
                    .iter()
                    .filter_map(|&(_, id)| Some((id, counters(&dp, id)?)))
                    .collect();
                let walked = dp
                    .open_flows_by_backend(ACTIVE)
                    .inspect_err(|e| warn!("counting open flows: {e}"))
                    .ok()?;
                let mut out = BTreeMap::new();
                for (&id, b) in &before {
                    let Some(a) = counters(&dp, id) else { continue };
                    let drift = walk_drift(b, walked.get(&id).copied().unwrap_or(0), &a);
                    let set = (a.active - drift).max(0);
                    // The data plane's own count, which new flows are placed
                    // by, loses only what the walk proves it gained or lost.
                    if drift != 0 {
                        if let Err(e) = dp.set_backend_active(id, set as u64) {
                            warn!("setting a backend's open flows: {e}");
                        }
                    }
                    out.insert(id, Counters { active: set, ..a });
                }
                Some(out)
            })
            .flatten();
        let mut out = BTreeMap::new();
        for (key, id) in ids {
            let Ok((opened, closed)) = dp.backend_flows(id) else {
                continue;
            };
            let entry = self.flows.get(&key).filter(|f| f.id == id);
            let count = match (corrected.as_ref().and_then(|c| c.get(&id)), entry) {
                (Some(c), _) => FlowCount {
                    id,
                    base: c.active.max(0) as u64,
                    opened: c.opened,
                    closed: c.closed,
                },
                (None, Some(f)) => *f,
                // A backend id not seen before: count from now.
                (None, None) => FlowCount {
                    id,
                    base: 0,
                    opened,
                    closed,
                },
            };
            self.flows.insert(key, count);
            let open = (count.base + opened.saturating_sub(count.opened))
                .saturating_sub(closed.saturating_sub(count.closed));
            out.insert(key, open);
        }
        out
    }

    /// How long each backend's flows stay open: the mean time of the flows
    /// that closed since it was last timed (`FLOW_TIMES`, `mean_flow_time`). A backend
    /// is timed once at least `MIN_TIMED_FLOWS` closed since then, however
    /// many steps that takes: one whose weight was cut to a trickle is
    /// still timed, so that its flow time can show that it recovered. Not
    /// open flows over new flows a second (Little's law): a few long-lived
    /// flows, which least-loaded placement counts against a backend's new
    /// ones, make that time look longer the fewer new flows a backend gets,
    /// and a cut backend then stayed cut.
    fn flow_times(
        &mut self,
        targets: &[LoadTarget],
    ) -> BTreeMap<(ServiceKey, SocketAddr), Duration> {
        let dp = self.dp.lock().expect("data plane lock");
        let mut baselines = BTreeMap::new();
        let mut out = BTreeMap::new();
        for t in targets {
            for &(addr, _) in &t.backends {
                let key = (t.key, addr);
                let Some(id) = dp.backend_id(&t.key, addr) else {
                    continue;
                };
                let Ok(now) = dp.backend_flow_times(id) else {
                    continue;
                };
                let baseline = match self.timed.get(&key) {
                    Some(&(last_id, last)) if last_id == id => {
                        let closed: FlowTimes =
                            std::array::from_fn(|b| now[b].wrapping_sub(last[b]));
                        match mean_flow_time(&closed) {
                            Some(time) => {
                                out.insert(key, time);
                                (id, now)
                            }
                            None => (id, last),
                        }
                    }
                    _ => (id, now),
                };
                baselines.insert(key, baseline);
            }
        }
        self.timed = baselines;
        out
    }

    /// Each local backend's CPU load since the last step, from its cgroup.
    /// A group that cannot be read drops the signal (the others decide),
    /// logged when the error changes; a group's first reading gives no
    /// rate yet.
    fn cpu_loads(&mut self, targets: &[LoadTarget]) -> BTreeMap<SocketAddr, f64> {
        let wanted: BTreeMap<SocketAddr, &BackendCgroup> = targets
            .iter()
            .flat_map(|t| t.cgroups.iter().map(|(a, g)| (*a, g)))
            .collect();
        self.cpu.retain(|a, st| wanted.get(a) == Some(&&st.group));
        let mut out = BTreeMap::new();
        for (addr, group) in wanted {
            let st = self.cpu.entry(addr).or_insert_with(|| CpuState {
                group: group.clone(),
                path: None,
                last: None,
                error: None,
            });
            let read = match st.path.clone() {
                Some(p) => Ok(p),
                None => self.cgroups.locate(group),
            }
            .and_then(|p| self.cgroups.sample(&p).map(|s| (p, s)));
            match read {
                Ok((path, sample)) => {
                    if st.error.take().is_some() {
                        info!(backend = %addr, "its cgroup can be read again");
                    }
                    if let Some(load) = st.last.and_then(|l| sample.load_since(&l)) {
                        out.insert(addr, load);
                    }
                    (st.path, st.last) = (Some(path), Some(sample));
                }
                Err(e) => {
                    if st.error.as_deref() != Some(&e) {
                        warn!(backend = %addr, "reading its CPU use: {e}; the other signals decide until it can be read");
                    }
                    (st.error, st.path, st.last) = (Some(e), None, None);
                }
            }
        }
        out
    }

    /// Asks every agent check at once, within half an interval. A failed
    /// check drops the backend's report (its other signals decide), logged
    /// when the error changes.
    async fn agent_reports(
        &mut self,
        targets: &[LoadTarget],
    ) -> BTreeMap<(ServiceKey, SocketAddr), Report> {
        let addrs: BTreeSet<SocketAddr> = targets
            .iter()
            .filter_map(|t| t.agent_check.map(|a| (t, a)))
            .flat_map(|(t, a)| {
                t.backends
                    .iter()
                    .map(move |b| SocketAddr::new(b.0.ip(), a.port))
            })
            .collect();
        self.agents.retain(|a, _| addrs.contains(a));
        let timeout = self.interval / 2;
        let answers = futures::future::join_all(
            addrs
                .iter()
                .map(|&a| async move { (a, agent_check::ask(a, timeout).await) }),
        )
        .await;
        for (addr, answer) in answers {
            let st = self.agents.entry(addr).or_default();
            match answer {
                Ok(report) => {
                    if st.error.take().is_some() {
                        info!(agent = %addr, "agent check answers again");
                    }
                    st.report = report;
                }
                Err(e) => {
                    if st.error.as_deref() != Some(&e) {
                        warn!(agent = %addr, "agent check: {e}; its report is not used until it answers");
                    }
                    st.error = Some(e);
                    st.report = None;
                }
            }
        }
        // By backend: the agent's address is the backend's, on the agent port.
        let mut out = BTreeMap::new();
        for t in targets {
            let Some(a) = t.agent_check else { continue };
            for &(b, _) in &t.backends {
                let agent = SocketAddr::new(b.ip(), a.port);
                if let Some(report) = self.agents.get(&agent).and_then(|s| s.report) {
                    out.insert((t.key, b), report);
                }
            }
        }
        out
    }
}

/// Whether the data plane would change: a weight or a `down` differs.
pub fn weights_differ(
    a: &BTreeMap<ServiceKey, ServiceLoad>,
    b: &BTreeMap<ServiceKey, ServiceLoad>,
) -> bool {
    let view = |m: &BTreeMap<ServiceKey, ServiceLoad>| -> Vec<(ServiceKey, SocketAddr, u32, bool)> {
        m.iter()
            .flat_map(|(k, s)| {
                s.backends
                    .iter()
                    .map(move |(a, l)| (*k, *a, l.decision.weight, l.decision.down))
            })
            .collect()
    };
    view(a) != view(b)
}

/// Writes each decision to `BACKEND_LOAD` for lbctl. The agent calls it
/// once the data plane has the weights: recorded earlier, a weight of 0
/// would say that no new connection reaches a backend while the old table
/// still sends them there (a test that trusted it saw one, 2026-11-28).
pub fn record(dp: &mut Dataplane, all: &BTreeMap<ServiceKey, ServiceLoad>) {
    for (key, s) in all {
        for (addr, l) in &s.backends {
            let Some(id) = dp.backend_id(key, *addr) else {
                continue;
            };
            if let Err(e) = dp.set_backend_load(id, &l.record()) {
                warn!("recording a backend's load: {e}");
                return;
            }
        }
    }
}

/// Flows open this long or longer (2^33 ns, 8.6 s: bucket 14 of
/// `FlowTimes` on) are long-lived connections (keep-alive pools,
/// WebSockets), whose time is their client's, not their backend's load.
const LONG_LIVED_BUCKET: usize = 14;

/// The mean time of the closed flows counted in `closed` (a difference of
/// two `FLOW_TIMES` readings), each taken at its bucket's middle (0.5 ms
/// in the first), long-lived ones left out. A mean, not a median: a
/// backend held back now and then (a CPU quota spent early in each period)
/// serves most flows at once and a few late, and the late few are its
/// load. `None` for fewer than `MIN_TIMED_FLOWS`.
fn mean_flow_time(closed: &FlowTimes) -> Option<Duration> {
    let (mut count, mut sum_ns) = (0u64, 0.0);
    for (b, &n) in closed.iter().enumerate().take(LONG_LIVED_BUCKET) {
        let middle = match b {
            0 => flow_time_bucket_start(1) as f64 / 2.0,
            _ => flow_time_bucket_start(b) as f64 * std::f64::consts::SQRT_2,
        };
        count += u64::from(n);
        sum_ns += f64::from(n) * middle;
    }
    (count >= u64::from(MIN_TIMED_FLOWS))
        .then(|| Duration::from_nanos((sum_ns / count as f64) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::flow_time_bucket;

    fn closed(times_ms: &[f64]) -> FlowTimes {
        let mut h = FlowTimes::default();
        for ms in times_ms {
            h[flow_time_bucket((ms * 1e6) as u64)] += 1;
        }
        h
    }

    fn time(times_ms: &[f64]) -> Duration {
        mean_flow_time(&closed(times_ms)).expect("timed")
    }

    fn counters(active: i64, opened: u64, closed: u64) -> Counters {
        Counters {
            active,
            opened,
            closed,
        }
    }

    #[test]
    fn a_quiet_walk_corrects_the_whole_drift() {
        // 3 flows vanished without a FIN; none opened or closed meanwhile.
        let c = counters(10, 50, 40);
        assert_eq!(walk_drift(&c, 7, &c), 3);
        // Flows closed twice over or never counted: too low.
        assert_eq!(
            walk_drift(&counters(4, 50, 46), 6, &counters(4, 50, 46)),
            -2
        );
        assert_eq!(walk_drift(&c, 10, &c), 0);
    }

    #[test]
    fn churn_during_a_walk_is_not_taken_for_drift() {
        // 5 open at the start; 4 closed and 4 opened while the walk ran.
        // It found anything from 1 (closed before their turn, new ones
        // after it) to 9 (the reverse): no drift is proven.
        let (before, after) = (counters(5, 100, 95), counters(5, 104, 99));
        for walked in 1..=9 {
            assert_eq!(walk_drift(&before, walked, &after), 0, "walked {walked}");
        }
        // Beyond what churn explains, only the excess is drift.
        assert_eq!(walk_drift(&before, 0, &after), 1);
        assert_eq!(walk_drift(&before, 12, &after), -3);
        // 2 of 8 gone; 1 closed and 1 opened meanwhile; the walk found 6.
        // It proves 1 of the 2; the next quiet walk finds the other.
        assert_eq!(walk_drift(&counters(8, 20, 12), 6, &counters(8, 21, 13)), 1);
    }

    #[test]
    fn too_few_closed_flows_are_not_timed() {
        assert_eq!(mean_flow_time(&closed(&[5.0; 4])), None);
        assert!(mean_flow_time(&closed(&[5.0; 5])).is_some());
    }

    #[test]
    fn equal_flows_are_timed_within_their_bucket() {
        for ms in [0.2, 1.5, 5.0, 40.0, 300.0, 2500.0] {
            let t = time(&[ms; 9]);
            let b = flow_time_bucket((ms * 1e6) as u64);
            let ns = t.as_nanos() as u64;
            assert!(
                flow_time_bucket_start(b) <= ns && ns <= flow_time_bucket_start(b + 1),
                "{ms} ms gave {t:?}"
            );
        }
    }

    #[test]
    fn long_lived_flows_are_left_out() {
        let long = [3.0, 3.0, 3.0, 3.0, 3.0, 9_000.0, 600_000.0];
        assert_eq!(time(&long), time(&[3.0; 5]));
        assert_eq!(
            mean_flow_time(&closed(&[3.0, 3.0, 3.0, 3.0, 9_000.0])),
            None
        );
    }

    #[test]
    fn a_late_few_are_load() {
        let fast = time(&[0.5; 30]);
        let mut held_back = vec![0.5; 27];
        held_back.extend([90.0; 3]);
        assert!(
            time(&held_back) > fast * 10,
            "{fast:?} and {:?}",
            time(&held_back)
        );
        assert!(time(&[200.0; 20]) > time(&[2.0; 20]) * 50);
    }
}
