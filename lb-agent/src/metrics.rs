//! Prometheus metrics and the agent's small HTTP endpoint.
//!
//! [`Metrics`] owns a [`prometheus::Registry`]. Two kinds of metrics live in it:
//!
//! * the agent's own metrics (config reloads, readiness), updated in place by
//!   [`Metrics::record_reload`] and [`Metrics::set_ready`];
//! * the data-plane families (service, backend, reason and conntrack
//!   counters), which mirror counters kept by the kernel. They are produced by
//!   a custom [`Collector`] at scrape time from a [`DataplaneSnapshot`] that the
//!   agent supplies through [`Metrics::set_snapshot_source`], so they are always
//!   current and never drift from the maps.
//!
//! [`crate::http`] serves them, with `/healthz` and `/readyz`.
//!
//! Naming: every family is `xlb_<subsystem>_<name>`; only counters end in `_total`.

use std::fmt;
use std::net::IpAddr;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lb_common::{Reason, TrafficStats, REASON_COUNT};
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};
use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
    TextEncoder,
};

// ---------------------------------------------------------------------------
// Snapshot types: plain data the agent fills from the Dataplane.
// ---------------------------------------------------------------------------

/// Counters of one service, summed over CPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceSample {
    /// The service's name in the configuration (`service` label).
    pub name: String,
    pub vip: IpAddr,
    pub port: u16,
    /// `"tcp"` or `"udp"`.
    pub protocol: String,
    pub stats: TrafficStats,
}

/// Counters and health of one backend of one service, summed over CPUs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendSample {
    /// Name of the service the backend belongs to (`service` label).
    pub service: String,
    /// The backend's address, e.g. `10.0.0.7:8080` (`backend` label).
    pub backend: String,
    pub healthy: bool,
    /// The weight in the data plane now (load-aware: the controller's).
    pub weight: u32,
    pub state: BackendState,
    pub stats: TrafficStats,
    /// Flows its clients closed (FIN or RST), summed over CPUs.
    pub closed_flows: u64,
}

/// What a backend is doing now (`xlb_backend_state`, `lbctl backends`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendState {
    /// Takes new flows.
    #[default]
    Active,
    /// Weight 0 (configured, or the load controller's): keeps its flows,
    /// takes no new ones.
    Draining,
    /// A Kubernetes endpoint that is terminating but still serving: keeps
    /// its flows, takes no new ones.
    Terminating,
    /// Fails its health checks: out of the table, its flows kept.
    Unhealthy,
}

impl BackendState {
    pub fn name(self) -> &'static str {
        match self {
            BackendState::Active => "active",
            BackendState::Draining => "draining",
            BackendState::Terminating => "terminating",
            BackendState::Unhealthy => "unhealthy",
        }
    }

    /// The state of a backend with `weight` in the data plane: failing
    /// checks first, then terminating, then a weight of 0.
    pub fn of(healthy: bool, terminating: bool, weight: u32) -> BackendState {
        if !healthy {
            BackendState::Unhealthy
        } else if terminating {
            BackendState::Terminating
        } else if weight == 0 {
            BackendState::Draining
        } else {
            BackendState::Active
        }
    }
}

/// One value of one backend of one service.
#[derive(Clone, Debug, PartialEq)]
pub struct BackendValue {
    pub service: String,
    pub backend: String,
    pub value: f64,
}

/// The load-aware services' signals and decisions (`crate::load`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadSamples {
    pub open_flows: Vec<BackendValue>,
    pub factor: Vec<BackendValue>,
    pub pressure: Vec<BackendValue>,
    /// Only backends whose health check measured one.
    pub probe_latency: Vec<BackendValue>,
    /// Only backends with enough new flows in the step to time them.
    pub flow_time: Vec<BackendValue>,
    /// Only backends whose agent check answered a percentage (drain: 0).
    pub reported_ratio: Vec<BackendValue>,
    /// Only local backends whose cgroup was read.
    pub cpu: Vec<BackendValue>,
    /// Per service (`backend` empty): 1 when every backend reports drain.
    pub all_draining: Vec<BackendValue>,
}

/// Everything the data-plane metric families are built from, read at scrape time.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DataplaneSnapshot {
    pub services: Vec<ServiceSample>,
    pub backends: Vec<BackendSample>,
    /// Packets per reason name (see [`Reason::name`]), summed over CPUs.
    /// [`DataplaneSnapshot::reasons_from_counts`] builds it from
    /// `Dataplane::reason_counts()`.
    pub reasons: Vec<(String, u64)>,
    /// Live flow-table entries.
    pub conntrack_entries: u64,
    /// Flow-table capacity (beyond it the least recently used flow goes).
    pub conntrack_capacity: u64,
    /// TCP packets (not SYNs) whose flow was not in the table: re-picked.
    pub flows_repicked: u64,
    pub flows_untracked: u64,
    pub load: LoadSamples,
}

impl DataplaneSnapshot {
    /// Names every [`Reason`] with its count, in [`Reason::ALL`] order.
    pub fn reasons_from_counts(counts: &[u64; REASON_COUNT as usize]) -> Vec<(String, u64)> {
        Reason::ALL
            .iter()
            .map(|r| (r.name().to_owned(), counts[*r as usize]))
            .collect()
    }
}

type SnapshotFn = dyn Fn() -> DataplaneSnapshot + Send + Sync;
type SourceSlot = Arc<RwLock<Option<Arc<SnapshotFn>>>>;

// ---------------------------------------------------------------------------
// The data-plane collector.
// ---------------------------------------------------------------------------

const SERVICE_LABELS: &[&str] = &["service", "vip", "port", "protocol"];
const BACKEND_LABELS: &[&str] = &["service", "backend"];
const BACKEND_STATE_LABELS: &[&str] = &["service", "backend", "state"];
const REASON_LABELS: &[&str] = &["reason"];
const SERVICE_NAME_LABELS: &[&str] = &["service"];

/// Where a data-plane family takes its samples from.
#[derive(Clone, Copy)]
enum Source {
    Service(fn(&TrafficStats) -> u64),
    Backend(fn(&TrafficStats) -> u64),
    BackendHealthy,
    BackendWeight,
    BackendState,
    BackendClosed,
    Load(fn(&LoadSamples) -> &Vec<BackendValue>),
    AllDraining,
    Reason,
    ConntrackEntries,
    ConntrackCapacity,
    FlowsRepicked,
    FlowsUntracked,
}

impl Source {
    fn labels(self) -> &'static [&'static str] {
        match self {
            Source::Service(_) => SERVICE_LABELS,
            Source::Backend(_)
            | Source::BackendHealthy
            | Source::BackendWeight
            | Source::BackendClosed
            | Source::Load(_) => BACKEND_LABELS,
            Source::BackendState => BACKEND_STATE_LABELS,
            Source::AllDraining => SERVICE_NAME_LABELS,
            Source::Reason => REASON_LABELS,
            Source::ConntrackEntries
            | Source::ConntrackCapacity
            | Source::FlowsRepicked
            | Source::FlowsUntracked => &[],
        }
    }
}

struct DpFamily {
    name: &'static str,
    help: &'static str,
    kind: MetricType,
    source: Source,
}

const fn counter(name: &'static str, help: &'static str, source: Source) -> DpFamily {
    DpFamily {
        name,
        help,
        kind: MetricType::COUNTER,
        source,
    }
}

const fn gauge(name: &'static str, help: &'static str, source: Source) -> DpFamily {
    DpFamily {
        name,
        help,
        kind: MetricType::GAUGE,
        source,
    }
}

fn packets(s: &TrafficStats) -> u64 {
    s.packets
}
fn bytes(s: &TrafficStats) -> u64 {
    s.bytes
}
fn new_flows(s: &TrafficStats) -> u64 {
    s.new_flows
}
fn reply_packets(s: &TrafficStats) -> u64 {
    s.reply_packets
}
fn reply_bytes(s: &TrafficStats) -> u64 {
    s.reply_bytes
}

const DP_FAMILIES: &[DpFamily] = &[
    counter(
        "xlb_service_packets_total",
        "Packets from clients to the service (client to backend direction), summed over CPUs.",
        Source::Service(packets),
    ),
    counter(
        "xlb_service_bytes_total",
        "Bytes from clients to the service (client to backend direction), summed over CPUs.",
        Source::Service(bytes),
    ),
    counter(
        "xlb_service_new_flows_total",
        "New flows assigned to a backend of the service, summed over CPUs.",
        Source::Service(new_flows),
    ),
    counter(
        "xlb_service_reply_packets_total",
        "Reply packets from the service's backends translated back to clients, summed over CPUs.",
        Source::Service(reply_packets),
    ),
    counter(
        "xlb_service_reply_bytes_total",
        "Reply bytes from the service's backends translated back to clients, summed over CPUs.",
        Source::Service(reply_bytes),
    ),
    counter(
        "xlb_backend_packets_total",
        "Packets forwarded to the backend, summed over CPUs.",
        Source::Backend(packets),
    ),
    counter(
        "xlb_backend_bytes_total",
        "Bytes forwarded to the backend, summed over CPUs.",
        Source::Backend(bytes),
    ),
    counter(
        "xlb_backend_new_flows_total",
        "New flows assigned to the backend, summed over CPUs.",
        Source::Backend(new_flows),
    ),
    counter(
        "xlb_backend_reply_packets_total",
        "Reply packets from the backend translated back to clients, summed over CPUs.",
        Source::Backend(reply_packets),
    ),
    counter(
        "xlb_backend_reply_bytes_total",
        "Reply bytes from the backend translated back to clients, summed over CPUs.",
        Source::Backend(reply_bytes),
    ),
    counter(
        "xlb_backend_closed_flows_total",
        "Flows to the backend its clients closed (FIN or RST), summed over CPUs; new flows minus these are its open flows, less those that ended without a FIN.",
        Source::BackendClosed,
    ),
    gauge(
        "xlb_backend_healthy",
        "Whether the backend passes its health checks (1) or not (0).",
        Source::BackendHealthy,
    ),
    gauge(
        "xlb_backend_weight",
        "The backend's weight in the data plane now (load-aware services: the controller's, on a scale of 100 per configured unit).",
        Source::BackendWeight,
    ),
    gauge(
        "xlb_backend_state",
        "1 for the backend's state now: active (takes new flows), draining (weight 0), terminating (a Kubernetes endpoint shutting down) or unhealthy (failing its checks); the last three keep their flows.",
        Source::BackendState,
    ),
    gauge(
        "xlb_backend_open_flows",
        "Load-aware: the backend's open flows (opened minus closed by FIN or RST, corrected by walks of the flow table).",
        Source::Load(|l| &l.open_flows),
    ),
    gauge(
        "xlb_backend_load_factor_ratio",
        "Load-aware: the factor (0.05 to 1) the configured weight is scaled by.",
        Source::Load(|l| &l.factor),
    ),
    gauge(
        "xlb_backend_load_pressure",
        "Load-aware: how loaded the backend looks against its service's mean (1: as loaded as the mean).",
        Source::Load(|l| &l.pressure),
    ),
    gauge(
        "xlb_backend_probe_latency_seconds",
        "Load-aware: how long the backend's latest successful health check took.",
        Source::Load(|l| &l.probe_latency),
    ),
    gauge(
        "xlb_backend_flow_time_seconds",
        "Load-aware: how long the backend's flows stay open (open flows over new flows a second, Little's law).",
        Source::Load(|l| &l.flow_time),
    ),
    gauge(
        "xlb_backend_reported_load_ratio",
        "Load-aware: the weight the backend's agent check reported, as a share of the configured one (75%: 0.75; drain: 0).",
        Source::Load(|l| &l.reported_ratio),
    ),
    gauge(
        "xlb_backend_cpu_load",
        "Load-aware, local backends: CPU used against the cgroup's limit (1: all of it), plus the share of time it was held back by throttling or CPU pressure (up to 2).",
        Source::Load(|l| &l.cpu),
    ),
    gauge(
        "xlb_service_all_backends_draining",
        "Load-aware: 1 when every backend of the service reports drain; the reports are set aside so that new flows keep a backend.",
        Source::AllDraining,
    ),
    counter(
        "xlb_datapath_packets_total",
        "Packets seen by the XDP program, by the reason for its verdict (pass, tx, redirect, drop).",
        Source::Reason,
    ),
    gauge(
        "xlb_conntrack_entries",
        "Live entries in the flow table.",
        Source::ConntrackEntries,
    ),
    gauge(
        "xlb_conntrack_capacity",
        "Capacity of the flow table: beyond it, the least recently used flow is evicted.",
        Source::ConntrackCapacity,
    ),
    counter(
        "xlb_flows_repicked_total",
        "TCP packets (not SYNs) whose flow was not in the flow table (evicted when it was full, or begun before this node saw it): sent where Maglev says now.",
        Source::FlowsRepicked,
    ),
    counter(
        "xlb_flows_untracked_total",
        "Packets forwarded in flood mode without a flow-table entry: new flows above flood_threshold a second on a CPU, and the later packets of those flows, which Maglev picks again.",
        Source::FlowsUntracked,
    ),
];

fn sample(kind: MetricType, labels: &[&str], values: &[&str], value: f64) -> proto::Metric {
    let pairs = labels
        .iter()
        .zip(values)
        .map(|(name, value)| {
            let mut lp = LabelPair::default();
            lp.set_name((*name).to_owned());
            lp.set_value((*value).to_owned());
            lp
        })
        .collect();
    let mut m = proto::Metric::from_label(pairs);
    if kind == MetricType::COUNTER {
        let mut c = proto::Counter::default();
        c.set_value(value);
        m.set_counter(c);
    } else {
        let mut g = proto::Gauge::default();
        g.set_value(value);
        m.set_gauge(g);
    }
    m
}

/// How many series of a family the snapshot has.
fn series_count(source: Source, snap: &DataplaneSnapshot) -> usize {
    match source {
        Source::Service(_) => snap.services.len(),
        Source::Backend(_)
        | Source::BackendHealthy
        | Source::BackendWeight
        | Source::BackendState
        | Source::BackendClosed => snap.backends.len(),
        Source::Load(values) => values(&snap.load).len(),
        Source::AllDraining => snap.load.all_draining.len(),
        Source::Reason => snap.reasons.len(),
        Source::ConntrackEntries
        | Source::ConntrackCapacity
        | Source::FlowsRepicked
        | Source::FlowsUntracked => 1,
    }
}

/// Series `i` of family `f`.
fn series(f: &DpFamily, snap: &DataplaneSnapshot, i: usize) -> proto::Metric {
    let labels = f.source.labels();
    match f.source {
        Source::Service(field) => {
            let s = &snap.services[i];
            let (vip, port) = (s.vip.to_string(), s.port.to_string());
            let values = [s.name.as_str(), &vip, &port, &s.protocol];
            sample(f.kind, labels, &values, field(&s.stats) as f64)
        }
        Source::Backend(field) => {
            let b = &snap.backends[i];
            let values = [b.service.as_str(), &b.backend];
            sample(f.kind, labels, &values, field(&b.stats) as f64)
        }
        Source::BackendHealthy => {
            let b = &snap.backends[i];
            let values = [b.service.as_str(), &b.backend];
            sample(f.kind, labels, &values, if b.healthy { 1.0 } else { 0.0 })
        }
        Source::BackendWeight => {
            let b = &snap.backends[i];
            let values = [b.service.as_str(), &b.backend];
            sample(f.kind, labels, &values, b.weight as f64)
        }
        Source::BackendClosed => {
            let b = &snap.backends[i];
            let values = [b.service.as_str(), &b.backend];
            sample(f.kind, labels, &values, b.closed_flows as f64)
        }
        Source::BackendState => {
            let b = &snap.backends[i];
            let values = [b.service.as_str(), &b.backend, b.state.name()];
            sample(f.kind, labels, &values, 1.0)
        }
        Source::Load(values) => {
            let v = &values(&snap.load)[i];
            sample(f.kind, labels, &[v.service.as_str(), &v.backend], v.value)
        }
        Source::AllDraining => {
            let v = &snap.load.all_draining[i];
            sample(f.kind, labels, &[v.service.as_str()], v.value)
        }
        Source::Reason => {
            let (r, n) = &snap.reasons[i];
            sample(f.kind, labels, &[r.as_str()], *n as f64)
        }
        Source::ConntrackEntries => sample(f.kind, &[], &[], snap.conntrack_entries as f64),
        Source::ConntrackCapacity => sample(f.kind, &[], &[], snap.conntrack_capacity as f64),
        Source::FlowsRepicked => sample(f.kind, &[], &[], snap.flows_repicked as f64),
        Source::FlowsUntracked => sample(f.kind, &[], &[], snap.flows_untracked as f64),
    }
}

/// Series handed to the encoder at a time. A node with 100,000 backends has
/// 600,000 backend series; built all at once as the client library's
/// structures they took about 250 MB for one scrape, in chunks a few MB.
const SERIES_PER_CHUNK: usize = 2048;

/// Hands the data-plane families to `part` in the text format, a chunk of
/// series at a time: each chunk is encoded as a family of its own, and the
/// `# HELP`/`# TYPE` lines of all but the first chunk are left out. Stops
/// early when `part` returns false (the scraper went away).
fn encode_dataplane(
    snap: &DataplaneSnapshot,
    mut part: impl FnMut(&str) -> bool,
) -> prometheus::Result<()> {
    let encoder = TextEncoder::new();
    let mut chunk_text = String::new();
    for f in DP_FAMILIES {
        let count = series_count(f.source, snap);
        for start in (0..count).step_by(SERIES_PER_CHUNK) {
            let end = (start + SERIES_PER_CHUNK).min(count);
            let mut mf = MetricFamily::default();
            mf.set_name(f.name.to_owned());
            mf.set_help(f.help.to_owned());
            mf.set_field_type(f.kind);
            mf.set_metric((start..end).map(|i| series(f, snap, i)).collect());
            chunk_text.clear();
            encoder.encode_utf8(&[mf], &mut chunk_text)?;
            let text = if start == 0 {
                chunk_text.as_str()
            } else {
                skip_lines(&chunk_text, 2)
            };
            if !part(text) {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// `text` without its first `n` lines.
fn skip_lines(text: &str, n: usize) -> &str {
    let mut rest = text;
    for _ in 0..n {
        rest = rest.split_once('\n').map_or("", |(_, r)| r);
    }
    rest
}

// ---------------------------------------------------------------------------
// Metrics.
// ---------------------------------------------------------------------------

/// Buckets of `xlb_config_reload_duration_seconds`.
const RELOAD_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The agent's metrics registry. Share it as `Arc<Metrics>`.
pub struct Metrics {
    registry: Registry,
    source: SourceSlot,
    reloads: IntCounterVec,
    reload_duration: Histogram,
    last_reload_success: Gauge,
    ready: IntGauge,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let has_source = self
            .source
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some();
        f.debug_struct("Metrics")
            .field("registry", &self.registry)
            .field("snapshot_source", &has_source)
            .finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        // Every definition below is static; a failure is a bug caught by the tests.
        Self::build().expect("static metric definitions are valid")
    }

    fn build() -> prometheus::Result<Self> {
        let registry = Registry::new();
        let source: SourceSlot = Arc::new(RwLock::new(None));

        let reloads = IntCounterVec::new(
            Opts::new(
                "xlb_config_reloads_total",
                "Configuration reloads applied to the data plane, by result.",
            ),
            &["result"],
        )?;
        // Both series exist from the start, so rate() and alerts see a 0 -> 1 step.
        reloads.with_label_values(&["ok"]);
        reloads.with_label_values(&["error"]);

        let reload_duration = Histogram::with_opts(
            HistogramOpts::new(
                "xlb_config_reload_duration_seconds",
                "Time taken by configuration reloads (successful or not).",
            )
            .buckets(RELOAD_BUCKETS.to_vec()),
        )?;
        let last_reload_success = Gauge::new(
            "xlb_config_last_reload_success_timestamp_seconds",
            "Unix time of the latest successful configuration reload (0: none yet).",
        )?;
        let ready = IntGauge::new(
            "xlb_agent_ready",
            "Whether the agent is ready to serve traffic (1) or not (0).",
        )?;

        let build = IntGaugeVec::new(
            Opts::new(
                "xlb_build_info",
                "Always 1; the agent's version in its label.",
            ),
            &["version"],
        )?;
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        registry.register(Box::new(build))?;
        // process_cpu_seconds_total, process_resident_memory_bytes, ...
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        registry.register(Box::new(reloads.clone()))?;
        registry.register(Box::new(reload_duration.clone()))?;
        registry.register(Box::new(last_reload_success.clone()))?;
        registry.register(Box::new(ready.clone()))?;

        Ok(Self {
            registry,
            source,
            reloads,
            reload_duration,
            last_reload_success,
            ready,
        })
    }

    /// The underlying registry, for metrics other modules want to add.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Sets (or replaces) the function that reads the data plane. It is called
    /// once per scrape, from a blocking thread when scraped through [`serve`];
    /// it may lock and read maps but should not take seconds.
    pub fn set_snapshot_source(&self, f: impl Fn() -> DataplaneSnapshot + Send + Sync + 'static) {
        *self.source.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(f));
    }

    /// Records one configuration reload: its result and how long it took.
    pub fn record_reload(&self, ok: bool, dur: Duration) {
        self.reloads
            .with_label_values(&[if ok { "ok" } else { "error" }])
            .inc();
        self.reload_duration.observe(dur.as_secs_f64());
        if ok {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default();
            self.last_reload_success.set(now.as_secs_f64());
        }
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.set(i64::from(ready));
    }

    /// Everything in the Prometheus text format (version 0.0.4), as one
    /// string. Reads the data plane through the snapshot source.
    pub fn render(&self) -> String {
        let scrape = self.scrape();
        let mut out = scrape.head.clone();
        scrape.encode(|text| {
            out.push_str(text);
            true
        });
        out
    }

    /// What a scrape reports: the registry's families, encoded, and the data
    /// plane's snapshot, encoded a part at a time by [`Scrape::encode`] (a
    /// node with 100,000 backends has about 45 MB of series; `/metrics`
    /// streams them rather than holding them). Calls the snapshot source,
    /// which may block and may panic.
    pub fn scrape(&self) -> Scrape {
        let families = self.registry.gather();
        let mut head = String::new();
        if let Err(e) = TextEncoder::new().encode_utf8(&families, &mut head) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        // Clone the source out so that no lock is held while it runs. No
        // data plane yet: its families are left out rather than reported as zeros.
        let source = self
            .source
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Scrape {
            head,
            dataplane: source.map(|source| source()),
        }
    }
}

/// One scrape's content; see [`Metrics::scrape`].
pub struct Scrape {
    /// The registry's families in the text format.
    pub head: String,
    dataplane: Option<DataplaneSnapshot>,
}

impl Scrape {
    /// Hands the data-plane families to `part`, a chunk of series at a
    /// time, until `part` returns false.
    pub fn encode(&self, part: impl FnMut(&str) -> bool) {
        if let Some(snap) = &self.dataplane {
            if let Err(e) = encode_dataplane(snap, part) {
                tracing::warn!(error = %e, "encoding data-plane metrics failed");
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Tests.
// ---------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn stats(base: u64) -> TrafficStats {
        TrafficStats {
            packets: base,
            bytes: base * 100,
            new_flows: base / 10,
            reply_packets: base + 1,
            reply_bytes: (base + 1) * 1000,
        }
    }

    fn fake_snapshot(packets: u64) -> DataplaneSnapshot {
        let mut counts = [0u64; REASON_COUNT as usize];
        for (i, c) in counts.iter_mut().enumerate() {
            *c = 1000 + i as u64;
        }
        DataplaneSnapshot {
            services: vec![
                ServiceSample {
                    name: "web".into(),
                    vip: "10.0.0.1".parse().unwrap(),
                    port: 80,
                    protocol: "tcp".into(),
                    stats: stats(packets),
                },
                ServiceSample {
                    name: "dns6".into(),
                    vip: "2001:db8::53".parse().unwrap(),
                    port: 53,
                    protocol: "udp".into(),
                    stats: stats(7),
                },
            ],
            backends: vec![
                BackendSample {
                    service: "web".into(),
                    backend: "10.1.0.1:8080".into(),
                    healthy: true,
                    weight: 1,
                    state: Default::default(),
                    closed_flows: 0,
                    stats: stats(30),
                },
                BackendSample {
                    service: "web".into(),
                    backend: "10.1.0.2:8080".into(),
                    healthy: false,
                    weight: 1,
                    state: BackendState::Unhealthy,
                    closed_flows: 0,
                    stats: stats(0),
                },
            ],
            reasons: DataplaneSnapshot::reasons_from_counts(&counts),
            conntrack_entries: 42,
            conntrack_capacity: 1 << 20,
            flows_repicked: 9,
            flows_untracked: 4,
            load: LoadSamples {
                open_flows: vec![value("10.1.0.1:8080", 12.0)],
                factor: vec![value("10.1.0.1:8080", 0.5)],
                pressure: vec![value("10.1.0.1:8080", 1.25)],
                probe_latency: vec![value("10.1.0.1:8080", 0.003)],
                flow_time: vec![value("10.1.0.1:8080", 0.25)],
                reported_ratio: vec![value("10.1.0.2:8080", 0.4)],
                cpu: vec![value("10.1.0.1:8080", 1.5)],
                all_draining: vec![value("", 0.0)],
            },
        }
    }

    #[test]
    fn a_backend_state_is_its_most_telling_one() {
        use BackendState::*;
        assert_eq!(BackendState::of(true, false, 1), Active);
        assert_eq!(BackendState::of(true, false, 0), Draining);
        assert_eq!(BackendState::of(true, true, 0), Terminating);
        assert_eq!(BackendState::of(false, true, 0), Unhealthy);
        assert_eq!(BackendState::of(false, false, 1), Unhealthy);
    }

    fn value(backend: &str, value: f64) -> BackendValue {
        BackendValue {
            service: "web".into(),
            backend: backend.into(),
            value,
        }
    }

    /// `# TYPE` lines: family name -> type.
    fn types(text: &str) -> BTreeMap<String, String> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .map(|l| {
                let (name, kind) = l.split_once(' ').unwrap();
                (name.to_owned(), kind.to_owned())
            })
            .collect()
    }

    fn has_line(text: &str, line: &str) {
        assert!(
            text.lines().any(|l| l == line),
            "missing line {line:?} in:\n{text}"
        );
    }

    #[tokio::test]
    async fn metrics_scrape_has_families_labels_and_values() {
        let m = Metrics::new();
        let packets = Arc::new(AtomicU64::new(100));
        let p = packets.clone();
        m.set_snapshot_source(move || fake_snapshot(p.load(Ordering::SeqCst)));
        m.record_reload(true, Duration::from_millis(20));
        m.record_reload(false, Duration::from_millis(3));
        m.record_reload(true, Duration::from_secs(2));
        m.set_ready(true);

        let body = m.render();
        let t = &body;

        let web = r#"service="web",vip="10.0.0.1",port="80",protocol="tcp""#;
        has_line(t, &format!("xlb_service_packets_total{{{web}}} 100"));
        has_line(t, &format!("xlb_service_bytes_total{{{web}}} 10000"));
        has_line(t, &format!("xlb_service_new_flows_total{{{web}}} 10"));
        has_line(t, &format!("xlb_service_reply_packets_total{{{web}}} 101"));
        has_line(t, &format!("xlb_service_reply_bytes_total{{{web}}} 101000"));
        let dns = r#"service="dns6",vip="2001:db8::53",port="53",protocol="udp""#;
        has_line(t, &format!("xlb_service_packets_total{{{dns}}} 7"));

        let b1 = r#"service="web",backend="10.1.0.1:8080""#;
        let b2 = r#"service="web",backend="10.1.0.2:8080""#;
        has_line(t, &format!("xlb_backend_packets_total{{{b1}}} 30"));
        has_line(t, &format!("xlb_backend_bytes_total{{{b1}}} 3000"));
        has_line(t, &format!("xlb_backend_new_flows_total{{{b1}}} 3"));
        has_line(t, &format!("xlb_backend_reply_packets_total{{{b1}}} 31"));
        has_line(t, &format!("xlb_backend_reply_bytes_total{{{b1}}} 31000"));
        has_line(t, &format!("xlb_backend_packets_total{{{b2}}} 0"));
        has_line(t, &format!("xlb_backend_healthy{{{b1}}} 1"));
        has_line(t, &format!("xlb_backend_healthy{{{b2}}} 0"));
        has_line(t, &format!("xlb_backend_weight{{{b1}}} 1"));
        has_line(t, &format!("xlb_backend_state{{{b1},state=\"active\"}} 1"));
        has_line(
            t,
            &format!("xlb_backend_state{{{b2},state=\"unhealthy\"}} 1"),
        );
        has_line(t, &format!("xlb_backend_open_flows{{{b1}}} 12"));
        has_line(t, &format!("xlb_backend_load_factor_ratio{{{b1}}} 0.5"));
        has_line(t, &format!("xlb_backend_load_pressure{{{b1}}} 1.25"));
        has_line(
            t,
            &format!("xlb_backend_probe_latency_seconds{{{b1}}} 0.003"),
        );
        has_line(t, &format!("xlb_backend_flow_time_seconds{{{b1}}} 0.25"));
        has_line(t, "xlb_service_all_backends_draining{service=\"web\"} 0");

        for r in Reason::ALL {
            has_line(
                t,
                &format!(
                    "xlb_datapath_packets_total{{reason=\"{}\"}} {}",
                    r.name(),
                    1000 + r as u64
                ),
            );
        }
        has_line(t, "xlb_conntrack_entries 42");
        has_line(t, "xlb_conntrack_capacity 1048576");
        has_line(t, "xlb_flows_repicked_total 9");
        has_line(t, "xlb_flows_untracked_total 4");

        has_line(t, r#"xlb_config_reloads_total{result="ok"} 2"#);
        has_line(t, r#"xlb_config_reloads_total{result="error"} 1"#);
        has_line(t, "xlb_config_reload_duration_seconds_count 3");
        has_line(
            t,
            r#"xlb_config_reload_duration_seconds_bucket{le="0.005"} 1"#,
        );
        has_line(
            t,
            r#"xlb_config_reload_duration_seconds_bucket{le="+Inf"} 3"#,
        );
        has_line(t, "xlb_agent_ready 1");
        let ts: f64 = t
            .lines()
            .find_map(|l| l.strip_prefix("xlb_config_last_reload_success_timestamp_seconds "))
            .unwrap()
            .parse()
            .unwrap();
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(ts > now - 60.0 && ts <= now + 1.0, "{ts} vs {now}");

        // The source is read at scrape time.
        packets.store(250, Ordering::SeqCst);
        m.set_ready(false);
        let t = m.render();
        has_line(&t, &format!("xlb_service_packets_total{{{web}}} 250"));
        has_line(&t, "xlb_agent_ready 0");
    }

    #[tokio::test]
    async fn metric_names_follow_the_naming_rule() {
        let m = Metrics::new();
        m.set_snapshot_source(|| fake_snapshot(1));
        m.record_reload(true, Duration::from_millis(1));
        let text = m.render();
        let mut types = types(&text);
        let expected = [
            "xlb_service_packets_total",
            "xlb_service_bytes_total",
            "xlb_service_new_flows_total",
            "xlb_service_reply_packets_total",
            "xlb_service_reply_bytes_total",
            "xlb_backend_packets_total",
            "xlb_backend_bytes_total",
            "xlb_backend_new_flows_total",
            "xlb_backend_reply_packets_total",
            "xlb_backend_reply_bytes_total",
            "xlb_backend_closed_flows_total",
            "xlb_backend_healthy",
            "xlb_backend_weight",
            "xlb_backend_state",
            "xlb_backend_open_flows",
            "xlb_backend_load_factor_ratio",
            "xlb_backend_load_pressure",
            "xlb_backend_probe_latency_seconds",
            "xlb_backend_flow_time_seconds",
            "xlb_backend_reported_load_ratio",
            "xlb_backend_cpu_load",
            "xlb_service_all_backends_draining",
            "xlb_datapath_packets_total",
            "xlb_conntrack_entries",
            "xlb_conntrack_capacity",
            "xlb_flows_repicked_total",
            "xlb_flows_untracked_total",
            "xlb_config_reloads_total",
            "xlb_config_reload_duration_seconds",
            "xlb_config_last_reload_success_timestamp_seconds",
            "xlb_agent_ready",
            "xlb_build_info",
        ];
        // The client library's process families keep their standard names.
        let process: Vec<String> = types
            .keys()
            .filter(|n| n.starts_with("process_"))
            .cloned()
            .collect();
        assert!(process.len() >= 6, "{process:?}");
        for n in &process {
            types.remove(n);
        }
        for name in expected {
            assert!(types.contains_key(name), "family {name} missing:\n{text}");
        }
        assert_eq!(types.len(), expected.len(), "{types:?}");
        for (name, kind) in &types {
            assert!(name.starts_with("xlb_"), "{name}");
            let rest = name.strip_prefix("xlb_").unwrap();
            assert!(
                rest.contains('_') && !rest.starts_with('_'),
                "{name} is not xlb_<subsystem>_<name>"
            );
            assert_eq!(
                name.ends_with("_total"),
                kind == "counter",
                "{name} is a {kind}: only counters (and all of them) end in _total"
            );
        }
        assert_eq!(types["xlb_config_reload_duration_seconds"], "histogram");
        assert_eq!(types["xlb_backend_healthy"], "gauge");
    }

    #[test]
    fn without_a_source_the_dataplane_families_are_absent() {
        let m = Metrics::new();
        let text = m.render();
        assert!(!text.contains("xlb_service_"), "{text}");
        assert!(!text.contains("xlb_conntrack_"), "{text}");
        has_line(&text, "xlb_agent_ready 0");
        has_line(&text, r#"xlb_config_reloads_total{result="ok"} 0"#);
        has_line(&text, r#"xlb_config_reloads_total{result="error"} 0"#);
        has_line(&text, "xlb_config_last_reload_success_timestamp_seconds 0");
    }

    #[test]
    fn label_values_are_escaped() {
        let m = Metrics::new();
        m.set_snapshot_source(|| DataplaneSnapshot {
            backends: vec![BackendSample {
                service: "we\"ird\\name\n".into(),
                backend: "[2001:db8::1]:443".into(),
                healthy: true,
                weight: 1,
                state: Default::default(),
                closed_flows: 0,
                stats: TrafficStats::default(),
            }],
            ..Default::default()
        });
        has_line(
            &m.render(),
            r#"xlb_backend_healthy{service="we\"ird\\name\n",backend="[2001:db8::1]:443"} 1"#,
        );
    }

    #[test]
    fn a_family_of_many_chunks_is_still_one_family_with_every_series() {
        let m = Metrics::new();
        let n = 2 * SERIES_PER_CHUNK + 3;
        m.set_snapshot_source(move || DataplaneSnapshot {
            backends: (0..n)
                .map(|i| BackendSample {
                    service: "web".into(),
                    backend: format!("10.1.{}.{}:80", i / 256, i % 256),
                    healthy: i % 2 == 0,
                    weight: 1,
                    state: Default::default(),
                    closed_flows: 0,
                    stats: stats(i as u64),
                })
                .collect(),
            ..Default::default()
        });
        let text = m.render();
        for family in ["xlb_backend_packets_total", "xlb_backend_healthy"] {
            let help = format!("# HELP {family} ");
            let kind = format!("# TYPE {family} ");
            assert_eq!(text.lines().filter(|l| l.starts_with(&help)).count(), 1);
            assert_eq!(text.lines().filter(|l| l.starts_with(&kind)).count(), 1);
            let series = format!("{family}{{");
            assert_eq!(text.lines().filter(|l| l.starts_with(&series)).count(), n);
        }
        has_line(
            &text,
            r#"xlb_backend_healthy{service="web",backend="10.1.16.1:80"} 0"#,
        );
    }
}
