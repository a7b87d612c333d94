//! Whether the agent can reach the Kubernetes API, as one state shared by
//! every part that talks to it (the watchers, the Lease, the allocator).
//!
//! An outage is logged once when it starts and once when it ends; in
//! between, `xlb_kubernetes_api_up` reads 0 and
//! `xlb_kubernetes_api_errors_total` counts the failed attempts. A watch
//! whose history expired (410 Gone) is not an outage: the watcher lists
//! again, and that is logged at info.

use std::{
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

use kube::runtime::{utils::Backoff, watcher};
use prometheus::{IntCounterVec, IntGauge, Opts, Registry};
use tracing::{debug, info, warn};

pub struct ApiHealth {
    /// When the current outage began and what first failed.
    down_since: Mutex<Option<Instant>>,
    up: IntGauge,
    errors: IntCounterVec,
}

/// The process's one view of the API.
pub fn api_health() -> &'static ApiHealth {
    static HEALTH: OnceLock<ApiHealth> = OnceLock::new();
    HEALTH.get_or_init(|| {
        let up = IntGauge::new(
            "xlb_kubernetes_api_up",
            "1 while the last request to the Kubernetes API succeeded, 0 during an outage",
        )
        .expect("valid metric");
        up.set(1);
        let errors = IntCounterVec::new(
            Opts::new(
                "xlb_kubernetes_api_errors_total",
                "Failed requests and watches to the Kubernetes API, by who made them",
            ),
            &["client"],
        )
        .expect("valid metric");
        ApiHealth {
            down_since: Mutex::new(None),
            up,
            errors,
        }
    })
}

impl ApiHealth {
    /// Adds the metrics to the agent's registry (once per registry).
    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.up.clone()))?;
        registry.register(Box::new(self.errors.clone()))
    }

    /// A request or watch by `client` failed.
    pub fn failed(&self, client: &str, error: &dyn std::fmt::Display) {
        self.errors.with_label_values(&[client]).inc();
        let mut down = self.down_since.lock().unwrap_or_else(|p| p.into_inner());
        if down.is_none() {
            *down = Some(Instant::now());
            self.up.set(0);
            warn!(
                client,
                "lost the Kubernetes API: {error} (retrying every {}s; the data plane keeps its state)",
                RETRY_MAX.as_secs()
            );
        } else {
            debug!(client, "Kubernetes API still failing: {error}");
        }
    }

    /// A request or watch by `client` succeeded.
    pub fn succeeded(&self, client: &str) {
        let mut down = self.down_since.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(since) = down.take() {
            self.up.set(1);
            info!(client, outage = ?since.elapsed(), "the Kubernetes API is back");
        }
    }

    /// Sorts a watcher's error: an expired history is routine, anything
    /// else counts against the API.
    pub fn watch_failed(&self, client: &str, error: &watcher::Error) {
        match error {
            watcher::Error::WatchError(status) if status.code == 410 => {
                info!(client, "watch history expired (410 Gone); listing again")
            }
            other => self.failed(client, other),
        }
    }
}

/// The longest wait between two attempts while the API fails.
pub const RETRY_MAX: Duration = Duration::from_secs(1);
const RETRY_MIN: Duration = Duration::from_millis(200);

/// Watch retry delays: 0.2 s doubling to 1 s, with ±20% jitter so a
/// cluster's agents do not retry in step. kube-rs's default grows to 30 s,
/// which after an API server restart kept the agent's watches down for up
/// to 30 s while the Services it serves changed. A failed attempt against a
/// down server costs one refused connection, so once a second per watch is
/// cheap even for a large cluster.
#[derive(Debug)]
pub struct QuickRetry {
    next: Duration,
    max: Duration,
    seed: u64,
}

impl QuickRetry {
    /// The same delays, doubling up to `max` instead of [`RETRY_MAX`].
    pub fn up_to(max: Duration) -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            | 1;
        QuickRetry {
            next: RETRY_MIN,
            max,
            seed,
        }
    }
}

impl Default for QuickRetry {
    fn default() -> Self {
        Self::up_to(RETRY_MAX)
    }
}

impl Iterator for QuickRetry {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        // xorshift: jitter needs no cryptographic randomness.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let jitter = 0.8 + (self.seed % 1000) as f64 / 2500.0;
        let delay = self.next.mul_f64(jitter);
        self.next = (self.next * 2).min(self.max);
        Some(delay)
    }
}

impl Backoff for QuickRetry {
    fn reset(&mut self) {
        self.next = RETRY_MIN;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retries_double_to_a_one_second_cap_and_reset() {
        let mut b = QuickRetry::default();
        let delays: Vec<Duration> = b.by_ref().take(6).collect();
        for (d, base) in delays.iter().zip([200, 400, 800, 1000, 1000, 1000]) {
            let base = Duration::from_millis(base);
            assert!(
                *d >= base.mul_f64(0.8) && *d <= base.mul_f64(1.2),
                "{delays:?}"
            );
        }
        b.reset();
        assert!(b.next().unwrap() <= Duration::from_millis(240));
    }

    #[test]
    fn a_longer_cap_keeps_doubling() {
        let delays: Vec<Duration> = QuickRetry::up_to(Duration::from_secs(30)).take(9).collect();
        for (d, base) in delays
            .iter()
            .zip([200, 400, 800, 1600, 3200, 6400, 12800, 25600, 30000])
        {
            let base = Duration::from_millis(base);
            assert!(
                *d >= base.mul_f64(0.8) && *d <= base.mul_f64(1.2),
                "{delays:?}"
            );
        }
    }

    #[test]
    fn an_outage_is_one_transition_each_way() {
        let h = ApiHealth {
            down_since: Mutex::new(None),
            up: IntGauge::new("up", "h").unwrap(),
            errors: IntCounterVec::new(Opts::new("e", "h"), &["client"]).unwrap(),
        };
        h.up.set(1);
        h.failed("services", &"refused");
        h.failed("leases", &"refused");
        assert_eq!(h.up.get(), 0);
        assert_eq!(h.errors.with_label_values(&["services"]).get(), 1);
        assert!(h.down_since.lock().unwrap().is_some());
        h.succeeded("services");
        assert_eq!(h.up.get(), 1);
        assert!(h.down_since.lock().unwrap().is_none());
    }
}
