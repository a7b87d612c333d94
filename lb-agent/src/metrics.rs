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
//! [`serve`] answers `GET /metrics`, `/healthz` and `/readyz` over a minimal
//! HTTP/1.1 implementation: one request per connection, then close.
//!
//! Naming: every family is `xlb_<subsystem>_<name>`; only counters end in `_total`.

use std::fmt;
use std::io;
use std::net::IpAddr;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lb_common::{Reason, TrafficStats, REASON_COUNT};
use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};
use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::timeout;

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
    pub stats: TrafficStats,
}

/// Everything the data-plane metric families are built from, read at scrape time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DataplaneSnapshot {
    pub services: Vec<ServiceSample>,
    pub backends: Vec<BackendSample>,
    /// Packets per reason name (see [`Reason::name`]), summed over CPUs.
    /// [`DataplaneSnapshot::reasons_from_counts`] builds it from
    /// `Dataplane::reason_counts()`.
    pub reasons: Vec<(String, u64)>,
    /// Live connection-table entries (over all CPUs).
    pub conntrack_entries: u64,
    /// Connection-table capacity (over all CPUs: `CONNTRACK_ENTRIES` times
    /// the number of possible CPUs, the map being per-CPU).
    pub conntrack_capacity: u64,
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
const REASON_LABELS: &[&str] = &["reason"];

/// Where a data-plane family takes its samples from.
#[derive(Clone, Copy)]
enum Source {
    Service(fn(&TrafficStats) -> u64),
    Backend(fn(&TrafficStats) -> u64),
    BackendHealthy,
    Reason,
    ConntrackEntries,
    ConntrackCapacity,
}

impl Source {
    fn labels(self) -> &'static [&'static str] {
        match self {
            Source::Service(_) => SERVICE_LABELS,
            Source::Backend(_) | Source::BackendHealthy => BACKEND_LABELS,
            Source::Reason => REASON_LABELS,
            Source::ConntrackEntries | Source::ConntrackCapacity => &[],
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
    gauge(
        "xlb_backend_healthy",
        "Whether the backend passes its health checks (1) or not (0).",
        Source::BackendHealthy,
    ),
    counter(
        "xlb_datapath_packets_total",
        "Packets seen by the XDP program, by the reason for its verdict (pass, tx, redirect, drop).",
        Source::Reason,
    ),
    gauge(
        "xlb_conntrack_entries",
        "Live entries in the connection table, over all CPUs.",
        Source::ConntrackEntries,
    ),
    gauge(
        "xlb_conntrack_capacity",
        "Capacity of the connection table, over all CPUs.",
        Source::ConntrackCapacity,
    ),
];

/// Produces the data-plane families from a snapshot taken at collect time.
struct DataplaneCollector {
    source: SourceSlot,
    /// One per entry of `DP_FAMILIES`, same order.
    descs: Vec<Desc>,
}

impl DataplaneCollector {
    fn new(source: SourceSlot) -> prometheus::Result<Self> {
        let descs = DP_FAMILIES
            .iter()
            .map(|f| {
                Desc::new(
                    f.name.to_owned(),
                    f.help.to_owned(),
                    f.source.labels().iter().map(|l| (*l).to_owned()).collect(),
                    Default::default(),
                )
            })
            .collect::<prometheus::Result<Vec<_>>>()?;
        Ok(Self { source, descs })
    }
}

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

fn dp_families(snap: &DataplaneSnapshot) -> Vec<MetricFamily> {
    let mut out = Vec::with_capacity(DP_FAMILIES.len());
    for f in DP_FAMILIES {
        let labels = f.source.labels();
        let metrics: Vec<proto::Metric> = match f.source {
            Source::Service(field) => snap
                .services
                .iter()
                .map(|s| {
                    let (vip, port) = (s.vip.to_string(), s.port.to_string());
                    let values = [s.name.as_str(), &vip, &port, &s.protocol];
                    sample(f.kind, labels, &values, field(&s.stats) as f64)
                })
                .collect(),
            Source::Backend(field) => snap
                .backends
                .iter()
                .map(|b| {
                    let values = [b.service.as_str(), &b.backend];
                    sample(f.kind, labels, &values, field(&b.stats) as f64)
                })
                .collect(),
            Source::BackendHealthy => snap
                .backends
                .iter()
                .map(|b| {
                    let values = [b.service.as_str(), &b.backend];
                    sample(f.kind, labels, &values, if b.healthy { 1.0 } else { 0.0 })
                })
                .collect(),
            Source::Reason => snap
                .reasons
                .iter()
                .map(|(r, n)| sample(f.kind, labels, &[r.as_str()], *n as f64))
                .collect(),
            Source::ConntrackEntries => {
                vec![sample(f.kind, &[], &[], snap.conntrack_entries as f64)]
            }
            Source::ConntrackCapacity => {
                vec![sample(f.kind, &[], &[], snap.conntrack_capacity as f64)]
            }
        };
        let mut mf = MetricFamily::default();
        mf.set_name(f.name.to_owned());
        mf.set_help(f.help.to_owned());
        mf.set_field_type(f.kind);
        mf.set_metric(metrics);
        out.push(mf);
    }
    out
}

impl Collector for DataplaneCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        // Clone the source out so that no lock is held while it runs.
        let source = self
            .source
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match source {
            Some(source) => dp_families(&source()),
            // No data plane yet: leave the families out rather than report zeros.
            None => Vec::new(),
        }
    }
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

        registry.register(Box::new(reloads.clone()))?;
        registry.register(Box::new(reload_duration.clone()))?;
        registry.register(Box::new(last_reload_success.clone()))?;
        registry.register(Box::new(ready.clone()))?;
        registry.register(Box::new(DataplaneCollector::new(source.clone())?))?;

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

    /// Everything in the Prometheus text format (version 0.0.4). Reads the
    /// data plane through the snapshot source.
    pub fn render(&self) -> String {
        let families = self.registry.gather();
        let mut out = String::new();
        if let Err(e) = TextEncoder::new().encode_utf8(&families, &mut out) {
            tracing::warn!(error = %e, "encoding metrics failed");
        }
        out
    }
}

// ---------------------------------------------------------------------------
// HTTP endpoint.
// ---------------------------------------------------------------------------

/// Returns `(alive, ready)`. Called on every health request from the async
/// runtime: it must be cheap and must not block.
pub type HealthFn = dyn Fn() -> (bool, bool) + Send + Sync;

#[derive(Clone, Copy, Debug)]
struct Limits {
    /// Largest request head (request line and headers) accepted.
    max_head: usize,
    /// Time allowed to receive the whole request head.
    head_timeout: Duration,
    /// Time allowed to send the response.
    write_timeout: Duration,
    /// After answering, how long and how much of the client's leftover input
    /// is read and discarded, so that closing does not reset the connection
    /// before the client has read the response.
    linger: Duration,
    linger_bytes: usize,
    /// Connections handled at once; further ones wait in the listen backlog.
    max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_head: 8 * 1024,
            head_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(10),
            linger: Duration::from_secs(2),
            linger_bytes: 1 << 20,
            max_connections: 64,
        }
    }
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `listener` until the task
/// is dropped or aborted. One request per connection; each connection is
/// handled by its own task.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, health: Arc<HealthFn>) {
    serve_with_limits(listener, metrics, health, Limits::default()).await
}

async fn serve_with_limits(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    health: Arc<HealthFn>,
    limits: Limits,
) {
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return; // The semaphore is never closed.
        };
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // Typically EMFILE/ENFILE: back off instead of spinning.
                tracing::warn!(error = %e, "metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let metrics = metrics.clone();
        let health = health.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if let Err(e) = handle_connection(stream, metrics, health, limits).await {
                tracing::debug!(%peer, error = %e, "metrics endpoint: connection failed");
            }
        });
    }
}

enum Head {
    /// The client closed before sending anything.
    Closed,
    /// The client closed in the middle of the head.
    Incomplete,
    TooLarge,
    TimedOut,
    /// The head, up to and including its terminating empty line.
    Complete(Vec<u8>),
}

/// End of the head (index just past the empty line), accepting CRLF or bare LF.
fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.iter().enumerate().find_map(|(i, &c)| {
        if c != b'\n' {
            return None;
        }
        match &buf[i + 1..] {
            [b'\n', ..] => Some(i + 2),
            [b'\r', b'\n', ..] => Some(i + 3),
            _ => None,
        }
    })
}

async fn read_head(stream: &mut TcpStream, max: usize) -> io::Result<Head> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(if buf.is_empty() {
                Head::Closed
            } else {
                Head::Incomplete
            });
        }
        // The terminator may straddle the previous read.
        let from = buf.len().saturating_sub(3);
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = find_head_end(&buf[from..]) {
            let end = from + end;
            if end > max {
                return Ok(Head::TooLarge);
            }
            buf.truncate(end);
            return Ok(Head::Complete(buf));
        }
        if buf.len() > max {
            return Ok(Head::TooLarge);
        }
    }
}

struct Response {
    status: u16,
    content_type: &'static str,
    body: String,
    allow: bool,
}

impl Response {
    fn text(status: u16, body: &str) -> Self {
        Self {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.to_owned(),
            allow: false,
        }
    }

    fn encode(&self, head_only: bool) -> Vec<u8> {
        let mut head = format!(
            "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n",
            self.status,
            reason_phrase(self.status),
            self.content_type,
            self.body.len()
        );
        if self.allow {
            head.push_str("Allow: GET, HEAD\r\n");
        }
        head.push_str("\r\n");
        let mut out = head.into_bytes();
        if !head_only {
            out.extend_from_slice(self.body.as_bytes());
        }
        out
    }
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "Unknown",
    }
}

/// RFC 9110 `tchar`.
fn is_tchar(c: u8) -> bool {
    c.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&c)
}

fn is_token(s: &[u8]) -> bool {
    !s.is_empty() && s.iter().all(|&c| is_tchar(c))
}

#[derive(Debug, PartialEq, Eq)]
enum Route {
    Metrics,
    Healthz,
    Readyz,
}

/// What a request head asks for: `Ok((route, is_head))` or the error response.
fn parse_request(head: &[u8]) -> Result<(Route, bool), Response> {
    let bad = || Response::text(400, "bad request\n");
    let mut lines = head
        .split(|&c| c == b'\n')
        .map(|l| l.strip_suffix(b"\r").unwrap_or(l));
    let line = lines.next().unwrap_or_default();
    // Header fields: `name: value`; only their shape is checked.
    for field in lines.filter(|l| !l.is_empty()) {
        let Some(colon) = field.iter().position(|&c| c == b':') else {
            return Err(bad());
        };
        if !is_token(&field[..colon]) {
            return Err(bad());
        }
    }

    let mut parts = line.split(|&c| c == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    if !is_token(method) || target.is_empty() || !target.iter().all(|c| c.is_ascii_graphic()) {
        return Err(bad());
    }
    match version {
        b"HTTP/1.0" | b"HTTP/1.1" => {}
        [b'H', b'T', b'T', b'P', b'/', major, b'.', minor]
            if major.is_ascii_digit() && minor.is_ascii_digit() =>
        {
            return Err(Response::text(505, "HTTP version not supported\n"));
        }
        _ => return Err(bad()),
    }
    let is_head = match method {
        b"GET" => false,
        b"HEAD" => true,
        _ => {
            let mut r = Response::text(405, "method not allowed\n");
            r.allow = true;
            return Err(r);
        }
    };
    if target[0] != b'/' {
        return Err(bad());
    }
    let path = target.split(|&c| c == b'?').next().unwrap_or_default();
    match path {
        b"/metrics" => Ok((Route::Metrics, is_head)),
        b"/healthz" => Ok((Route::Healthz, is_head)),
        b"/readyz" => Ok((Route::Readyz, is_head)),
        _ => Err(Response::text(404, "not found\n")),
    }
}

async fn respond(head: &[u8], metrics: &Arc<Metrics>, health: &Arc<HealthFn>) -> (Response, bool) {
    let (route, is_head) = match parse_request(head) {
        Ok(x) => x,
        Err(resp) => return (resp, false),
    };
    let resp = match route {
        Route::Metrics => {
            // The snapshot source reads BPF maps and may block on a lock.
            let m = metrics.clone();
            match tokio::task::spawn_blocking(move || m.render()).await {
                Ok(body) => Response {
                    status: 200,
                    content_type: "text/plain; version=0.0.4; charset=utf-8",
                    body,
                    allow: false,
                },
                Err(e) => {
                    tracing::error!(error = %e, "rendering metrics failed");
                    Response::text(500, "internal error\n")
                }
            }
        }
        Route::Healthz if health().0 => Response::text(200, "ok\n"),
        Route::Healthz => Response::text(503, "not alive\n"),
        Route::Readyz if health().1 => Response::text(200, "ready\n"),
        Route::Readyz => Response::text(503, "not ready\n"),
    };
    (resp, is_head)
}

async fn handle_connection(
    mut stream: TcpStream,
    metrics: Arc<Metrics>,
    health: Arc<HealthFn>,
    limits: Limits,
) -> io::Result<()> {
    let head = timeout(limits.head_timeout, read_head(&mut stream, limits.max_head))
        .await
        .unwrap_or(Ok(Head::TimedOut))?;
    let (resp, head_only) = match head {
        Head::Closed => return Ok(()),
        Head::Incomplete => (Response::text(400, "bad request\n"), false),
        Head::TooLarge => (Response::text(431, "request head too large\n"), false),
        Head::TimedOut => (Response::text(408, "request timeout\n"), false),
        Head::Complete(head) => respond(&head, &metrics, &health).await,
    };
    let bytes = resp.encode(head_only);
    timeout(limits.write_timeout, async {
        stream.write_all(&bytes).await?;
        stream.shutdown().await
    })
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "writing the response timed out"))??;

    // Lingering close: consume what the client still sends (a body, the rest
    // of an oversized head) until it closes, so that our close does not turn
    // into a reset that could destroy the response in flight.
    let _ = timeout(limits.linger, async {
        let mut sink = [0u8; 4096];
        let mut left = limits.linger_bytes;
        while left > 0 {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => left = left.saturating_sub(n),
            }
        }
    })
    .await;
    Ok(())
}

// ---------------------------------------------------------------------------
// Tests.
// ---------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

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
                    stats: stats(30),
                },
                BackendSample {
                    service: "web".into(),
                    backend: "10.1.0.2:8080".into(),
                    healthy: false,
                    stats: stats(0),
                },
            ],
            reasons: DataplaneSnapshot::reasons_from_counts(&counts),
            conntrack_entries: 42,
            conntrack_capacity: 1 << 20,
        }
    }

    struct Server {
        addr: SocketAddr,
        metrics: Arc<Metrics>,
        alive: Arc<AtomicBool>,
        ready: Arc<AtomicBool>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    async fn start(limits: Limits) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new());
        let alive = Arc::new(AtomicBool::new(true));
        let ready = Arc::new(AtomicBool::new(false));
        let (a, r) = (alive.clone(), ready.clone());
        let health: Arc<HealthFn> =
            Arc::new(move || (a.load(Ordering::SeqCst), r.load(Ordering::SeqCst)));
        let task = tokio::spawn(serve_with_limits(listener, metrics.clone(), health, limits));
        Server {
            addr,
            metrics,
            alive,
            ready,
            task,
        }
    }

    struct Reply {
        status: u16,
        headers: String,
        body: String,
    }

    async fn raw(addr: SocketAddr, request: &[u8]) -> Reply {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(request).await.unwrap();
        let mut out = Vec::new();
        timeout(Duration::from_secs(10), s.read_to_end(&mut out))
            .await
            .expect("response in time")
            .expect("read response");
        parse_reply(&out)
    }

    fn parse_reply(out: &[u8]) -> Reply {
        let text = String::from_utf8(out.to_vec()).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").expect("complete response");
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("status code");
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("Content-Length: "))
            .and_then(|v| v.parse().ok())
            .expect("content length");
        assert!(head.starts_with("HTTP/1.1 "), "{head}");
        assert!(head.contains("\r\nConnection: close"), "{head}");
        Reply {
            status,
            headers: head.to_owned(),
            body: body.to_owned(),
        }
        .check_len(len)
    }

    impl Reply {
        fn check_len(self, len: usize) -> Self {
            assert_eq!(self.body.len(), len, "Content-Length matches the body");
            self
        }
    }

    async fn get(addr: SocketAddr, path: &str) -> Reply {
        raw(
            addr,
            format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: test\r\n\r\n")
                .as_bytes(),
        )
        .await
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
        let srv = start(Limits::default()).await;
        let packets = Arc::new(AtomicU64::new(100));
        let p = packets.clone();
        srv.metrics
            .set_snapshot_source(move || fake_snapshot(p.load(Ordering::SeqCst)));
        srv.metrics.record_reload(true, Duration::from_millis(20));
        srv.metrics.record_reload(false, Duration::from_millis(3));
        srv.metrics.record_reload(true, Duration::from_secs(2));
        srv.metrics.set_ready(true);

        let r = get(srv.addr, "/metrics").await;
        assert_eq!(r.status, 200);
        assert!(
            r.headers
                .contains("Content-Type: text/plain; version=0.0.4"),
            "{}",
            r.headers
        );
        let t = &r.body;

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
        srv.metrics.set_ready(false);
        let t = get(srv.addr, "/metrics").await.body;
        has_line(&t, &format!("xlb_service_packets_total{{{web}}} 250"));
        has_line(&t, "xlb_agent_ready 0");
    }

    #[tokio::test]
    async fn metric_names_follow_the_naming_rule() {
        let m = Metrics::new();
        m.set_snapshot_source(|| fake_snapshot(1));
        m.record_reload(true, Duration::from_millis(1));
        let text = m.render();
        let types = types(&text);
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
            "xlb_backend_healthy",
            "xlb_datapath_packets_total",
            "xlb_conntrack_entries",
            "xlb_conntrack_capacity",
            "xlb_config_reloads_total",
            "xlb_config_reload_duration_seconds",
            "xlb_config_last_reload_success_timestamp_seconds",
            "xlb_agent_ready",
        ];
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
                stats: TrafficStats::default(),
            }],
            ..Default::default()
        });
        has_line(
            &m.render(),
            r#"xlb_backend_healthy{service="we\"ird\\name\n",backend="[2001:db8::1]:443"} 1"#,
        );
    }

    #[tokio::test]
    async fn health_endpoints_follow_the_closure() {
        let srv = start(Limits::default()).await;

        let r = get(srv.addr, "/healthz").await;
        assert_eq!((r.status, r.body.as_str()), (200, "ok\n"));
        let r = get(srv.addr, "/readyz").await;
        assert_eq!((r.status, r.body.as_str()), (503, "not ready\n"));

        srv.ready.store(true, Ordering::SeqCst);
        let r = get(srv.addr, "/readyz").await;
        assert_eq!((r.status, r.body.as_str()), (200, "ready\n"));
        // Query strings are ignored.
        assert_eq!(get(srv.addr, "/readyz?verbose=1").await.status, 200);

        srv.alive.store(false, Ordering::SeqCst);
        assert_eq!(get(srv.addr, "/healthz").await.status, 503);
        srv.alive.store(true, Ordering::SeqCst);
        assert_eq!(get(srv.addr, "/healthz").await.status, 200);
    }

    #[tokio::test]
    async fn error_statuses() {
        let srv = start(Limits::default()).await;
        let a = srv.addr;

        assert_eq!(get(a, "/").await.status, 404);
        assert_eq!(get(a, "/metricsx").await.status, 404);
        assert_eq!(get(a, "/metrics/").await.status, 404);

        let r = raw(a, b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc").await;
        assert_eq!(r.status, 405);
        assert!(r.headers.contains("\r\nAllow: GET, HEAD"), "{}", r.headers);
        assert_eq!(
            raw(a, b"DELETE /healthz HTTP/1.1\r\n\r\n").await.status,
            405
        );

        for bad in [
            &b"garbage\r\n\r\n"[..],
            b"GET /metrics\r\n\r\n",
            b"GET  /metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.1 extra\r\n\r\n",
            b"GET metrics HTTP/1.1\r\n\r\n",
            b"GET /metrics FTP/1.1\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nno colon here\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\n: empty name\r\n\r\n",
            b"G\xffT /metrics HTTP/1.1\r\n\r\n",
            b"GET /m\xc3\xa9trics HTTP/1.1\r\n\r\n",
            b"\r\n\r\n",
            // The client gives up half-way.
            b"GET /metrics HTTP/1.1\r\nHost: x\r\n",
        ] {
            let mut s = TcpStream::connect(a).await.unwrap();
            s.write_all(bad).await.unwrap();
            s.shutdown().await.unwrap();
            let mut out = Vec::new();
            timeout(Duration::from_secs(10), s.read_to_end(&mut out))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(
                parse_reply(&out).status,
                400,
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        assert_eq!(raw(a, b"GET /metrics HTTP/2.0\r\n\r\n").await.status, 505);

        // HTTP/1.0, bare LF line ends and HEAD are fine.
        assert_eq!(raw(a, b"GET /healthz HTTP/1.0\r\n\r\n").await.status, 200);
        assert_eq!(raw(a, b"GET /healthz HTTP/1.1\n\n").await.status, 200);
        let mut s = TcpStream::connect(a).await.unwrap();
        s.write_all(b"HEAD /healthz HTTP/1.1\r\n\r\n")
            .await
            .unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(text.contains("Content-Length: 3\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\n"), "HEAD has no body: {text:?}");

        // Connecting and closing without a request gets nothing, harms nothing.
        let mut s = TcpStream::connect(a).await.unwrap();
        s.shutdown().await.unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).await.unwrap();
        assert!(out.is_empty());

        assert_eq!(get(a, "/healthz").await.status, 200);
    }

    #[tokio::test]
    async fn huge_head_is_refused_and_the_server_keeps_serving() {
        let srv = start(Limits::default()).await;
        let mut req = b"GET /metrics HTTP/1.1\r\nX-Big: ".to_vec();
        req.extend_from_slice(&vec![b'a'; 200_000]);
        req.extend_from_slice(b"\r\n\r\n");

        // Many at once, with normal requests in between.
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let (addr, req) = (srv.addr, req.clone());
            tasks.push(tokio::spawn(async move { raw(addr, &req).await.status }));
        }
        for _ in 0..8 {
            assert_eq!(get(srv.addr, "/healthz").await.status, 200);
        }
        for t in tasks {
            let status = t.await.unwrap();
            assert!(status == 431 || status == 400, "{status}");
        }
        // A head just over the limit, sent without a terminator.
        let mut s = TcpStream::connect(srv.addr).await.unwrap();
        s.write_all(&[b'x'; 9000]).await.unwrap();
        let mut out = Vec::new();
        timeout(Duration::from_secs(10), s.read_to_end(&mut out))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(parse_reply(&out).status, 431);

        assert_eq!(get(srv.addr, "/metrics").await.status, 200);
    }

    #[tokio::test]
    async fn slow_clients_time_out_without_blocking_others() {
        let srv = start(Limits {
            head_timeout: Duration::from_millis(300),
            ..Limits::default()
        })
        .await;
        let mut slow = TcpStream::connect(srv.addr).await.unwrap();
        slow.write_all(b"GET /metr").await.unwrap();
        assert_eq!(get(srv.addr, "/healthz").await.status, 200);
        let mut out = Vec::new();
        timeout(Duration::from_secs(10), slow.read_to_end(&mut out))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(parse_reply(&out).status, 408);
    }

    #[tokio::test]
    async fn a_panicking_source_gives_500_and_the_server_survives() {
        let srv = start(Limits::default()).await;
        srv.metrics
            .set_snapshot_source(|| panic!("test: the snapshot source failed"));
        assert_eq!(get(srv.addr, "/metrics").await.status, 500);
        assert_eq!(get(srv.addr, "/healthz").await.status, 200);
        srv.metrics.set_snapshot_source(|| fake_snapshot(5));
        let r = get(srv.addr, "/metrics").await;
        assert_eq!(r.status, 200);
        assert!(r.body.contains("xlb_conntrack_entries 42"));
    }

    #[test]
    fn head_end_detection() {
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\n\r\n"), Some(18));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\n\nbody"), Some(16));
        assert_eq!(find_head_end(b"GET / HTTP/1.1\r\nA: b\r\n"), None);
        assert_eq!(find_head_end(b""), None);
        assert_eq!(find_head_end(b"\n"), None);
    }
}
