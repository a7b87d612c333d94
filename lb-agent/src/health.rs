//! Active health checks of backends, as keepalived does for IPVS.
//!
//! [`HealthChecker`] runs one tokio task per checked backend. Each task
//! probes its backend every `interval` (the first probe at once) with a TCP
//! connect or an HTTP/1.1 GET, and keeps a verdict with hysteresis: `fall`
//! consecutive failures take a healthy backend out, `rise` consecutive
//! successes bring an unhealthy one back. Verdicts are published as a
//! [`HealthSnapshot`] on a `tokio::sync::watch` channel.
//!
//! # Choices
//!
//! - **A new backend starts healthy** ("innocent until proven guilty"): when
//!   the agent starts or reloads, backends that serve traffic keep serving it
//!   instead of being dropped until they pass `rise` checks. A backend that
//!   is really dead is taken out after `fall` checks, as if it had just died.
//! - **A backend whose check changed** gets a new task with fresh counters,
//!   but keeps its current verdict (and `since`, `checks`): a reload that
//!   edits the check neither sends traffic to a backend known to be dead nor
//!   drops traffic from a live one.
//! - **Receivers are woken on transitions only** (and when targets are added
//!   or removed). `checks` and `last_error` are updated in place after every
//!   check without waking anyone: they are current whenever read, but a
//!   change of them alone is not an event.
//! - **Detection bound.** A backend that dies is reported unhealthy within
//!   `fall × interval + timeout` of dying. This needs every check to end
//!   before the next tick, so one deadline covers the whole check (connect,
//!   request, status line) and that deadline is `min(timeout, interval)`:
//!   a `timeout` longer than the `interval` is cut to the interval (with a
//!   warning), otherwise hanging checks would run back to back and stretch
//!   the bound to `fall × timeout`.
//! - `rise` and `fall` of 0 count as 1; an `interval` under 1 ms counts as
//!   1 ms.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tokio::{
    io::{AsyncBufRead, AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
    sync::watch,
    task::JoinHandle,
    time::MissedTickBehavior,
};

use crate::service::{CheckKind, HealthCheck};

/// The health of every checked backend, by address. Cheap to clone (an
/// `Arc`); the checker copies the map on write when a clone is held.
pub type HealthSnapshot = Arc<BTreeMap<SocketAddr, Health>>;

/// The health of one backend.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Health {
    /// The verdict: `false` once `fall` consecutive checks failed, `true`
    /// again after `rise` consecutive successes. New backends start healthy.
    pub healthy: bool,
    /// When the verdict last changed (or the backend was first checked).
    pub since: Instant,
    /// Why the most recent check failed; `None` if it succeeded (or none ran).
    pub last_error: Option<String>,
    /// Checks completed so far.
    pub checks: u64,
    /// How long the most recent check took (connect, or connect, request and
    /// status line) if it succeeded: a load signal (`crate::load`).
    pub latency: Option<Duration>,
}

impl Health {
    fn new(now: Instant) -> Health {
        Health {
            healthy: true,
            since: now,
            last_error: None,
            checks: 0,
            latency: None,
        }
    }
}

/// Runs the health checks; dropping it stops them all (and closes the
/// channel once the tasks are gone).
pub struct HealthChecker {
    tx: watch::Sender<HealthSnapshot>,
    tasks: BTreeMap<SocketAddr, Task>,
}

struct Task {
    check: HealthCheck,
    /// Cleared (before the abort) when the task is stopped. The task checks
    /// it under the channel's lock before writing, so a task stopped while
    /// running on another thread never writes over its successor's entry or
    /// brings back a removed one.
    alive: Arc<AtomicBool>,
    handle: JoinHandle<()>,
}

impl Task {
    fn stop(&self) {
        self.alive.store(false, Ordering::Release);
        self.handle.abort();
    }
}

/// The shortest interval a check runs at.
const MIN_INTERVAL: Duration = Duration::from_millis(1);
/// The most of an HTTP response read (status line, and the heads of any
/// interim 1xx responses before it).
const MAX_RESPONSE_HEAD: u64 = 8 * 1024;

impl HealthChecker {
    /// A checker with no targets, and the receiver of its snapshots.
    pub fn new() -> (HealthChecker, watch::Receiver<HealthSnapshot>) {
        let (tx, rx) = watch::channel(HealthSnapshot::default());
        (
            HealthChecker {
                tx,
                tasks: BTreeMap::new(),
            },
            rx,
        )
    }

    /// Another receiver of the snapshots.
    pub fn subscribe(&self) -> watch::Receiver<HealthSnapshot> {
        self.tx.subscribe()
    }

    /// Makes the checked set `targets`: starts checking new backends
    /// (healthy at first), stops checking those not listed (they leave the
    /// snapshot), restarts those whose check changed (keeping their verdict),
    /// and leaves the others untouched, task and state. If an address is
    /// listed twice, the last entry wins. Publishes a snapshot if the set
    /// changed.
    ///
    /// Must be called within a tokio runtime (it spawns the tasks).
    pub fn set_targets(&mut self, targets: Vec<(SocketAddr, HealthCheck)>) {
        let mut start: BTreeMap<SocketAddr, HealthCheck> = targets.into_iter().collect();
        self.tasks.retain(|addr, task| {
            let keep = start.get(addr) == Some(&task.check);
            if !keep {
                task.stop();
            }
            keep
        });
        start.retain(|addr, _| !self.tasks.contains_key(addr));

        let now = Instant::now();
        let kept = &self.tasks;
        let mut initial = Vec::with_capacity(start.len());
        self.tx.send_if_modified(|snapshot| {
            let mut changed = false;
            if snapshot
                .keys()
                .any(|a| !kept.contains_key(a) && !start.contains_key(a))
            {
                Arc::make_mut(snapshot)
                    .retain(|a, _| kept.contains_key(a) || start.contains_key(a));
                changed = true;
            }
            for addr in start.keys() {
                match snapshot.get(addr) {
                    // Restarted with a changed check: same verdict.
                    Some(h) => initial.push(h.healthy),
                    None => {
                        Arc::make_mut(snapshot).insert(*addr, Health::new(now));
                        initial.push(true);
                        changed = true;
                    }
                }
            }
            changed
        });

        for ((addr, check), healthy) in start.into_iter().zip(initial) {
            if check.timeout > check.interval {
                tracing::warn!(
                    backend = %addr,
                    timeout = ?check.timeout,
                    interval = ?check.interval,
                    "health check timeout longer than its interval; checks time out after the interval"
                );
            }
            let alive = Arc::new(AtomicBool::new(true));
            let handle = tokio::spawn(run(
                addr,
                check.clone(),
                healthy,
                self.tx.clone(),
                alive.clone(),
            ));
            self.tasks.insert(
                addr,
                Task {
                    check,
                    alive,
                    handle,
                },
            );
        }
    }
}

impl Drop for HealthChecker {
    fn drop(&mut self) {
        for task in self.tasks.values() {
            task.stop();
        }
    }
}

/// The verdict with hysteresis.
#[derive(Clone, Copy, Debug)]
struct Tracker {
    healthy: bool,
    /// Consecutive results contrary to the verdict.
    streak: u32,
    rise: u32,
    fall: u32,
}

impl Tracker {
    fn new(healthy: bool, rise: u32, fall: u32) -> Tracker {
        Tracker {
            healthy,
            streak: 0,
            rise: rise.max(1),
            fall: fall.max(1),
        }
    }

    /// Records one result; true if the verdict changed.
    fn record(&mut self, ok: bool) -> bool {
        if ok == self.healthy {
            self.streak = 0;
            return false;
        }
        self.streak += 1;
        let needed = if self.healthy { self.fall } else { self.rise };
        if self.streak < needed {
            return false;
        }
        self.healthy = ok;
        self.streak = 0;
        true
    }
}

/// One backend's task: checks every interval until aborted.
async fn run(
    addr: SocketAddr,
    check: HealthCheck,
    healthy: bool,
    tx: watch::Sender<HealthSnapshot>,
    alive: Arc<AtomicBool>,
) {
    let interval = check.interval.max(MIN_INTERVAL);
    let timeout = check.timeout.min(interval);
    let mut tracker = Tracker::new(healthy, check.rise, check.fall);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let started = Instant::now();
        let result = match tokio::time::timeout(timeout, probe(addr, &check.kind)).await {
            Ok(result) => result,
            Err(_) => Err(format!("timed out after {timeout:?}")),
        };
        let transition = tracker.record(result.is_ok());
        let now = Instant::now();
        let latency = result.is_ok().then(|| now - started);
        let mut applied = false;
        tx.send_if_modified(|snapshot| {
            if !alive.load(Ordering::Acquire) || !snapshot.contains_key(&addr) {
                return false;
            }
            let Some(health) = Arc::make_mut(snapshot).get_mut(&addr) else {
                return false;
            };
            applied = true;
            health.checks += 1;
            health.last_error = result.as_ref().err().cloned();
            health.latency = latency;
            if transition {
                health.healthy = tracker.healthy;
                health.since = now;
            }
            transition
        });
        if !applied {
            continue;
        }
        match (&result, transition) {
            (Ok(()), true) => tracing::info!(
                backend = %addr,
                healthy = true,
                reason = %format!("{} consecutive successful checks", tracker.rise),
                "backend is healthy"
            ),
            (Err(e), true) => tracing::info!(
                backend = %addr,
                healthy = false,
                reason = %format!("{} consecutive failed checks, last: {e}", tracker.fall),
                "backend is unhealthy"
            ),
            (Err(e), false) => tracing::debug!(backend = %addr, error = %e, "health check failed"),
            (Ok(()), false) => {}
        }
    }
}

/// One check, without its deadline.
async fn probe(addr: SocketAddr, kind: &CheckKind) -> Result<(), String> {
    match kind {
        CheckKind::Tcp { port } => {
            connect(SocketAddr::new(addr.ip(), port.unwrap_or(addr.port()))).await?;
            Ok(())
        }
        CheckKind::Http {
            port,
            path,
            expect_status,
        } => {
            let target = SocketAddr::new(addr.ip(), port.unwrap_or(addr.port()));
            http_probe(target, path, *expect_status).await
        }
    }
}

async fn connect(target: SocketAddr) -> Result<TcpStream, String> {
    let stream = TcpStream::connect(target)
        .await
        .map_err(|e| format!("connect to {target}: {e}"))?;
    // A connect to a closed local port can meet itself (TCP simultaneous
    // open) when the kernel picks that port as the source port.
    if stream.local_addr().ok() == Some(target) {
        return Err(format!(
            "connect to {target}: connected to itself (nothing listening)"
        ));
    }
    Ok(stream)
}

async fn http_probe(target: SocketAddr, path: &str, expect_status: u16) -> Result<(), String> {
    if !valid_path(path) {
        return Err(format!("invalid HTTP path {path:?}"));
    }
    let mut stream = connect(target).await?;
    stream
        .write_all(http_request(target.ip(), path).as_bytes())
        .await
        .map_err(|e| format!("sending the request to {target}: {e}"))?;
    let mut reader = BufReader::new(stream).take(MAX_RESPONSE_HEAD);
    let mut line = Vec::new();
    loop {
        read_line(&mut reader, &mut line).await?;
        let status = parse_status_line(&line)?;
        if is_interim(status) && !is_interim(expect_status) {
            // 100 Continue, 103 Early Hints...: skip the head, the final
            // response follows.
            loop {
                read_line(&mut reader, &mut line).await?;
                if line == b"\r\n" || line == b"\n" {
                    break;
                }
            }
            continue;
        }
        return if status == expect_status {
            Ok(())
        } else {
            Err(format!("HTTP status {status}, expected {expect_status}"))
        };
    }
}

fn is_interim(status: u16) -> bool {
    (100..200).contains(&status) && status != 101
}

/// An origin-form path: starts with '/', visible ASCII only (no spaces or
/// control characters that would break the request line).
fn valid_path(path: &str) -> bool {
    path.starts_with('/') && path.bytes().all(|b| b.is_ascii_graphic())
}

fn http_request(ip: IpAddr, path: &str) -> String {
    let host = match ip {
        IpAddr::V4(ip) => ip.to_string(),
        IpAddr::V6(ip) => format!("[{ip}]"),
    };
    format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nUser-Agent: xlb-health\r\n\r\n")
}

/// Reads one line, with its '\n', into `line`.
async fn read_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    line: &mut Vec<u8>,
) -> Result<(), String> {
    line.clear();
    let n = reader
        .read_until(b'\n', line)
        .await
        .map_err(|e| format!("reading the response: {e}"))?;
    if n == 0 {
        return Err("connection closed before the end of the response head".to_string());
    }
    if !line.ends_with(b"\n") {
        return Err("response head truncated or too long".to_string());
    }
    Ok(())
}

/// Parses `HTTP/1.x SP 3DIGIT [SP reason]` followed by CRLF (or a bare LF)
/// and returns the status code.
fn parse_status_line(line: &[u8]) -> Result<u16, String> {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    let malformed = || {
        let shown = String::from_utf8_lossy(&line[..line.len().min(64)]);
        format!("malformed status line {shown:?}")
    };
    let rest = line.strip_prefix(b"HTTP/1.").ok_or_else(malformed)?;
    let [minor, b' ', d0, d1, d2, rest @ ..] = rest else {
        return Err(malformed());
    };
    if !minor.is_ascii_digit() || ![d0, d1, d2].iter().all(|d| d.is_ascii_digit()) {
        return Err(malformed());
    }
    let reason_ok = match rest {
        [] => true,
        [b' ', reason @ ..] => reason
            .iter()
            .all(|&b| b == b'\t' || b == b' ' || b.is_ascii_graphic() || b >= 0x80),
        _ => false,
    };
    if !reason_ok {
        return Err(malformed());
    }
    let status = [d0, d1, d2]
        .iter()
        .fold(0u16, |n, &&d| n * 10 + u16::from(d - b'0'));
    if !(100..=599).contains(&status) {
        return Err(format!("invalid HTTP status code {status}"));
    }
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{io::ErrorKind, sync::atomic::AtomicU64};
    use tokio::{
        net::TcpListener,
        sync::{mpsc, watch::Receiver},
        time::timeout,
    };

    /// How long a test waits for an event that should come much sooner.
    const PATIENCE: Duration = Duration::from_secs(10);
    /// Timer lateness allowed over the detection bound (tokio timers have a
    /// millisecond granularity and fire late, never early).
    const SLACK: Duration = Duration::from_millis(20);

    fn check(
        kind: CheckKind,
        interval_ms: u64,
        timeout_ms: u64,
        rise: u32,
        fall: u32,
    ) -> HealthCheck {
        HealthCheck {
            kind,
            interval: Duration::from_millis(interval_ms),
            timeout: Duration::from_millis(timeout_ms),
            rise,
            fall,
        }
    }

    fn tcp() -> CheckKind {
        CheckKind::Tcp { port: None }
    }

    fn http() -> CheckKind {
        CheckKind::Http {
            port: None,
            path: "/healthz".to_string(),
            expect_status: 200,
        }
    }

    /// Waits (via the channel) until `pred` holds for `addr`'s entry.
    async fn wait_for(
        rx: &mut Receiver<HealthSnapshot>,
        addr: SocketAddr,
        pred: impl Fn(Option<&Health>) -> bool,
    ) -> Option<Health> {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            {
                let snapshot = rx.borrow_and_update();
                if pred(snapshot.get(&addr)) {
                    return snapshot.get(&addr).cloned();
                }
            }
            tokio::time::timeout_at(deadline, rx.changed())
                .await
                .expect("timed out waiting for a health change")
                .expect("channel closed");
        }
    }

    async fn wait_healthy(
        rx: &mut Receiver<HealthSnapshot>,
        addr: SocketAddr,
        healthy: bool,
    ) -> Health {
        wait_for(rx, addr, |h| h.is_some_and(|h| h.healthy == healthy))
            .await
            .unwrap()
    }

    /// Accepts what is queued on a (non-blocking) listener, without waiting.
    fn drain(listener: &std::net::TcpListener) -> usize {
        let mut n = 0;
        loop {
            match listener.accept() {
                Ok(_) => n += 1,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return n,
                Err(e) => panic!("accept: {e}"),
            }
        }
    }

    /// A port with nothing listening on it (just freed).
    fn closed_port() -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }

    /// A TCP backend that accepts everything, counting connections.
    struct TcpBackend {
        addr: SocketAddr,
        accepted: mpsc::UnboundedReceiver<()>,
        task: JoinHandle<()>,
    }

    impl Drop for TcpBackend {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    async fn tcp_backend() -> TcpBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, accepted) = mpsc::unbounded_channel();
        let task = tokio::spawn(async move {
            while let Ok((_conn, _)) = listener.accept().await {
                let _ = tx.send(());
            }
        });
        TcpBackend {
            addr,
            accepted,
            task,
        }
    }

    async fn accepted(backend: &mut TcpBackend, n: usize) {
        for _ in 0..n {
            timeout(PATIENCE, backend.accepted.recv())
                .await
                .expect("no check came")
                .unwrap();
        }
    }

    #[derive(Clone, Copy)]
    enum Reply {
        /// `200 OK` or `503 Service Unavailable` per the flag.
        Status,
        /// Reads the request and never answers.
        Silent,
        /// Not HTTP.
        Garbage,
    }

    /// A tiny HTTP server; sends every status it serves on `served`.
    struct HttpBackend {
        addr: SocketAddr,
        ok: Arc<AtomicBool>,
        served: mpsc::UnboundedReceiver<u16>,
        requests: Arc<AtomicU64>,
        task: JoinHandle<()>,
    }

    impl Drop for HttpBackend {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    impl HttpBackend {
        /// Every status served so far.
        fn served_so_far(&mut self, log: &mut Vec<u16>) {
            while let Ok(s) = self.served.try_recv() {
                log.push(s);
            }
        }
    }

    async fn http_backend(reply: Reply) -> HttpBackend {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let ok = Arc::new(AtomicBool::new(true));
        let requests = Arc::new(AtomicU64::new(0));
        let (tx, served) = mpsc::unbounded_channel();
        let (ok2, requests2) = (ok.clone(), requests.clone());
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((mut conn, _)) = listener.accept().await {
                let (ok, tx, requests) = (ok2.clone(), tx.clone(), requests2.clone());
                conns.spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match conn.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    assert!(head.starts_with(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"), "{head:?}");
                    requests.fetch_add(1, Ordering::Relaxed);
                    let response = match reply {
                        Reply::Status => {
                            let status = if ok.load(Ordering::SeqCst) { 200 } else { 503 };
                            let _ = tx.send(status);
                            let reason = if status == 200 { "OK" } else { "Service Unavailable" };
                            format!("HTTP/1.1 {status} {reason}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                        }
                        Reply::Garbage => "SSH-2.0-OpenSSH_9.6\r\n".to_string(),
                        Reply::Silent => {
                            // Hold the connection until the checker gives up.
                            while let Ok(n) = conn.read(&mut buf).await {
                                if n == 0 {
                                    break;
                                }
                            }
                            return;
                        }
                    };
                    let _ = conn.write_all(response.as_bytes()).await;
                });
            }
        });
        HttpBackend {
            addr,
            ok,
            served,
            requests,
            task,
        }
    }

    #[tokio::test]
    async fn healthy_backend_stays_healthy() {
        let mut backend = tcp_backend().await;
        let (mut hc, mut rx) = HealthChecker::new();
        hc.set_targets(vec![(backend.addr, check(tcp(), 20, 20, 2, 2))]);
        let h = wait_for(&mut rx, backend.addr, |h| h.is_some())
            .await
            .unwrap();
        assert!(h.healthy);
        accepted(&mut backend, 5).await;
        // No transition was published, and the entry is fresh.
        assert!(!rx.has_changed().unwrap());
        let h2 = rx.borrow()[&backend.addr].clone();
        assert!(h2.healthy);
        assert_eq!(h2.since, h.since);
        assert_eq!(h2.last_error, None);
        assert!(h2.checks >= 4, "{h2:?}");
    }

    #[tokio::test]
    async fn dead_backend_goes_down_after_fall_checks_and_back_after_rise() {
        let (interval, tmo, rise, fall) = (50, 50, 2, 3);
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (mut hc, mut rx) = HealthChecker::new();
        hc.set_targets(vec![(addr, check(tcp(), interval, tmo, rise, fall))]);
        for _ in 0..3 {
            timeout(PATIENCE, listener.accept())
                .await
                .expect("no check came")
                .unwrap();
        }
        // Every successful check so far: accepted, or queued. The test runs
        // on a current-thread runtime: no check runs until the next await.
        let listener = listener.into_std().unwrap();
        let succeeded = 3 + drain(&listener) as u64;
        let died = Instant::now();
        drop(listener);

        let down = wait_healthy(&mut rx, addr, false).await;
        assert_eq!(
            down.checks,
            succeeded + u64::from(fall),
            "exactly `fall` failed checks: {down:?}"
        );
        let took = down.since.duration_since(died);
        let bound = Duration::from_millis(u64::from(fall) * interval + tmo);
        assert!(
            took <= bound + SLACK,
            "detected after {took:?}, bound {bound:?}"
        );
        assert!(
            down.last_error.as_deref().unwrap().contains("connect to"),
            "{down:?}"
        );

        // Back on the same port: exactly `rise` successes bring it back.
        let listener = std::net::TcpListener::bind(addr).unwrap();
        listener.set_nonblocking(true).unwrap();
        let up = wait_healthy(&mut rx, addr, true).await;
        assert_eq!(drain(&listener), rise as usize, "{up:?}");
        assert!(up.checks >= down.checks + u64::from(rise));
        assert_eq!(up.last_error, None);
    }

    #[tokio::test]
    async fn http_status_decides() {
        let (rise, fall) = (2, 2);
        let mut backend = http_backend(Reply::Status).await;
        let (mut hc, mut rx) = HealthChecker::new();
        hc.set_targets(vec![(backend.addr, check(http(), 30, 30, rise, fall))]);
        for _ in 0..2 {
            assert_eq!(
                timeout(PATIENCE, backend.served.recv()).await.unwrap(),
                Some(200)
            );
        }
        let mut log = vec![200, 200];
        assert!(rx.borrow()[&backend.addr].healthy);

        backend.ok.store(false, Ordering::SeqCst);
        let down = wait_healthy(&mut rx, backend.addr, false).await;
        backend.served_so_far(&mut log);
        assert_eq!(log.len() as u64, down.checks, "{log:?}");
        let (before, last) = log.split_at(log.len() - fall as usize);
        assert!(
            last.iter().all(|&s| s == 503) && before.last() == Some(&200),
            "{log:?}"
        );
        assert_eq!(
            down.last_error.as_deref(),
            Some("HTTP status 503, expected 200")
        );

        backend.ok.store(true, Ordering::SeqCst);
        let up = wait_healthy(&mut rx, backend.addr, true).await;
        backend.served_so_far(&mut log);
        assert_eq!(log.len() as u64, up.checks, "{log:?}");
        let (before, last) = log.split_at(log.len() - rise as usize);
        assert!(
            last.iter().all(|&s| s == 200) && before.last() == Some(&503),
            "{log:?}"
        );
        assert_eq!(up.last_error, None);
    }

    #[tokio::test]
    async fn silent_server_times_out() {
        let (interval, tmo, fall) = (50, 30, 2);
        let backend = http_backend(Reply::Silent).await;
        let (mut hc, mut rx) = HealthChecker::new();
        let started = Instant::now();
        hc.set_targets(vec![(backend.addr, check(http(), interval, tmo, 1, fall))]);
        let down = wait_healthy(&mut rx, backend.addr, false).await;
        assert_eq!(down.checks, u64::from(fall));
        assert_eq!(down.last_error.as_deref(), Some("timed out after 30ms"));
        assert_eq!(backend.requests.load(Ordering::Relaxed), u64::from(fall));
        // Dead from the start: the first check is immediate.
        let took = down.since.duration_since(started);
        let bound = Duration::from_millis(u64::from(fall - 1) * interval + tmo);
        assert!(
            took <= bound + SLACK,
            "detected after {took:?}, bound {bound:?}"
        );
    }

    #[tokio::test]
    async fn timeout_longer_than_interval_keeps_the_bound() {
        // Asks for 200 ms timeouts every 40 ms: checks are cut at 40 ms.
        let (interval, fall) = (40, 3);
        let backend = http_backend(Reply::Silent).await;
        let (mut hc, mut rx) = HealthChecker::new();
        let started = Instant::now();
        hc.set_targets(vec![(backend.addr, check(http(), interval, 200, 1, fall))]);
        let down = wait_healthy(&mut rx, backend.addr, false).await;
        assert_eq!(down.checks, u64::from(fall));
        let took = down.since.duration_since(started);
        let bound = Duration::from_millis(u64::from(fall) * interval);
        assert!(
            took <= bound + SLACK,
            "detected after {took:?}, bound {bound:?}"
        );
    }

    #[tokio::test]
    async fn garbage_status_line_fails() {
        let backend = http_backend(Reply::Garbage).await;
        let (mut hc, mut rx) = HealthChecker::new();
        hc.set_targets(vec![(backend.addr, check(http(), 30, 30, 1, 1))]);
        let down = wait_healthy(&mut rx, backend.addr, false).await;
        let err = down.last_error.unwrap();
        assert!(err.starts_with("malformed status line \"SSH-2.0"), "{err}");
    }

    #[tokio::test]
    async fn set_targets_reconciles() {
        let mut live = tcp_backend().await;
        let dead = closed_port();
        let fresh = closed_port();
        let (mut hc, mut rx) = HealthChecker::new();
        let fast = check(tcp(), 20, 20, 1, 1);
        hc.set_targets(vec![(live.addr, fast.clone()), (dead, fast.clone())]);
        let down = wait_healthy(&mut rx, dead, false).await;
        let live_before = rx.borrow()[&live.addr].clone();

        // Unchanged targets keep their task and state; a new one starts healthy.
        hc.set_targets(vec![
            (dead, fast.clone()),
            (fresh, check(tcp(), 10_000, 20, 1, 1)),
            (live.addr, fast.clone()),
        ]);
        {
            let snapshot = rx.borrow_and_update();
            assert_eq!(snapshot.len(), 3);
            let d = &snapshot[&dead];
            assert!(
                !d.healthy && d.since == down.since && d.checks >= down.checks,
                "{d:?}"
            );
            let l = &snapshot[&live.addr];
            assert!(
                l.healthy && l.since == live_before.since && l.checks >= live_before.checks,
                "{l:?}"
            );
            let f = &snapshot[&fresh];
            assert!(
                f.healthy && f.checks == 0 && f.last_error.is_none(),
                "{f:?}"
            );
        }

        // A changed check restarts the task, the verdict stays: `dead` now
        // checks the live port and comes back after `rise` successes.
        hc.set_targets(vec![(
            dead,
            check(
                CheckKind::Tcp {
                    port: Some(live.addr.port()),
                },
                20,
                20,
                2,
                1,
            ),
        )]);
        {
            let snapshot = rx.borrow_and_update();
            assert_eq!(snapshot.keys().copied().collect::<Vec<_>>(), vec![dead]);
            assert!(!snapshot[&dead].healthy);
        }
        let up = wait_healthy(&mut rx, dead, true).await;
        assert!(up.checks >= down.checks + 2);

        // Removed targets stay gone: their tasks were stopped. (Only `dead`
        // connects to `live` now: 5 fresh accepts take 4 intervals.)
        while live.accepted.try_recv().is_ok() {}
        accepted(&mut live, 5).await;
        let snapshot = rx.borrow().clone();
        assert_eq!(snapshot.keys().copied().collect::<Vec<_>>(), vec![dead]);

        hc.set_targets(Vec::new());
        assert!(rx.has_changed().unwrap());
        assert!(rx.borrow_and_update().is_empty());
    }

    #[tokio::test]
    async fn dropping_the_checker_closes_the_channel() {
        let backend = tcp_backend().await;
        let (mut hc, mut rx) = HealthChecker::new();
        hc.set_targets(vec![(backend.addr, check(tcp(), 20, 20, 1, 1))]);
        rx.borrow_and_update();
        drop(hc);
        let closed = timeout(PATIENCE, rx.changed())
            .await
            .expect("tasks still running");
        assert!(closed.is_err());
    }

    #[test]
    fn tracker_hysteresis() {
        let mut t = Tracker::new(true, 2, 3);
        let changes: Vec<bool> = [
            false, false, true, false, false, false, true, false, true, true,
        ]
        .iter()
        .map(|&ok| t.record(ok))
        .collect();
        assert_eq!(
            changes,
            [false, false, false, false, false, true, false, false, false, true]
        );
        assert!(t.healthy);
        let mut zero = Tracker::new(true, 0, 0);
        assert!(zero.record(false) && zero.record(true));
    }

    #[test]
    fn status_lines() {
        for (line, status) in [
            (&b"HTTP/1.1 200 OK\r\n"[..], 200),
            (b"HTTP/1.0 503 Service Unavailable\r\n", 503),
            (b"HTTP/1.1 204\r\n", 204),
            (b"HTTP/1.1 200 \r\n", 200),
            (b"HTTP/1.1 404 Not\tFound \xc3\xa9\n", 404),
        ] {
            assert_eq!(parse_status_line(line), Ok(status), "{line:?}");
        }
        for line in [
            &b""[..],
            b"\r\n",
            b"garbage\r\n",
            b"HTTP/2 200 OK\r\n",
            b"HTTP/1.1 200OK\r\n",
            b"HTTP/1.1  200 OK\r\n",
            b"HTTP/1.1 20 OK\r\n",
            b"HTTP/1.1 2000 OK\r\n",
            b"HTTP/1.1 +20 OK\r\n",
            b"HTTP/1.1 099 Low\r\n",
            b"HTTP/1.1 600 High\r\n",
            b"HTTP/1.x 200 OK\r\n",
            b"http/1.1 200 OK\r\n",
            b" HTTP/1.1 200 OK\r\n",
            b"HTTP/1.1 200 O\0K\r\n",
            b"HTTP/1.1 200 OK\r\r\n",
        ] {
            assert!(parse_status_line(line).is_err(), "{line:?}");
        }
    }

    #[test]
    fn requests() {
        assert_eq!(
            http_request("10.0.0.1".parse().unwrap(), "/healthz"),
            "GET /healthz HTTP/1.1\r\nHost: 10.0.0.1\r\nConnection: close\r\nUser-Agent: xlb-health\r\n\r\n"
        );
        assert!(http_request("fd00::1".parse().unwrap(), "/").contains("\r\nHost: [fd00::1]\r\n"));
        assert!(valid_path("/a?b=c"));
        for bad in ["", "healthz", "/a b", "/a\r\nX: y", "/é"] {
            assert!(!valid_path(bad), "{bad:?}");
        }
    }
}
