//! Lease-based leader election (`coordination.k8s.io/v1`).
//!
//! Every agent that may hand out addresses runs an [`Elector`] on the same
//! Lease. The holder renews it every `lease_duration / 3` with a `replace`
//! that carries the `resourceVersion` it read, so two writers cannot both
//! win (the loser gets 409 and reads again). A candidate takes the Lease
//! over only when it is free, or when the holder's `renewTime` plus
//! `leaseDurationSeconds` has passed *and* the candidate itself has seen the
//! record unchanged for that long (its own monotonic clock, so a skewed wall
//! clock cannot make it take over early).
//!
//! A leader that cannot renew stops leading after `renew_deadline`, which is
//! shorter than the lease duration: it stops before anyone else may start.
//! [`Elector::step_down`] clears the holder so another agent takes over at
//! once; dropping the [`Elector`] (as a crash would) leaves the Lease to
//! expire.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::PostParams;
use kube::{Api, Client};

use super::api_health::api_health;
use tokio::sync::{oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, timeout, Instant};
use tracing::{debug, info, warn};

/// Where the Lease is and how the election is timed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    pub namespace: String,
    pub name: String,
    /// This candidate's `holderIdentity` (the node or pod name).
    pub identity: String,
    /// `leaseDurationSeconds` (whole seconds, at least 1).
    pub lease_duration: Duration,
    /// A leader that has not renewed for this long stops leading.
    /// Must be shorter than `lease_duration`.
    pub renew_deadline: Duration,
    /// How often a leader renews.
    pub renew_interval: Duration,
    /// How often a candidate looks at the Lease, and a failing leader retries.
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// Timings derived from the lease duration: renew every third of it,
    /// give up leading after two thirds.
    pub fn new(namespace: &str, name: &str, identity: &str, lease_duration: Duration) -> Self {
        let lease_duration =
            Duration::from_secs(lease_duration.as_secs_f64().ceil().max(1.0) as u64);
        LeaseConfig {
            namespace: namespace.to_string(),
            name: name.to_string(),
            identity: identity.to_string(),
            lease_duration,
            renew_deadline: lease_duration * 2 / 3,
            renew_interval: lease_duration / 3,
            retry_period: lease_duration / 6,
        }
    }

    fn duration_seconds(&self) -> i32 {
        self.lease_duration.as_secs().clamp(1, i32::MAX as u64) as i32
    }
}

/// A running candidate. Leadership is published on [`Elector::leading`].
pub struct Elector {
    leading: watch::Receiver<bool>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Elector {
    /// Starts campaigning in a background task.
    pub fn start(client: Client, cfg: LeaseConfig) -> Elector {
        let (tx, rx) = watch::channel(false);
        let (stop_tx, stop_rx) = oneshot::channel();
        let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
        let task = tokio::spawn(campaign(api, cfg, tx, stop_rx));
        Elector {
            leading: rx,
            stop: Some(stop_tx),
            task: Some(task),
        }
    }

    /// `true` while this candidate leads. Closed when the elector stops.
    pub fn leading(&self) -> watch::Receiver<bool> {
        self.leading.clone()
    }

    pub fn is_leader(&self) -> bool {
        *self.leading.borrow()
    }

    /// Stops campaigning; a leader stops leading first, then frees the Lease
    /// so another candidate need not wait for it to expire.
    pub async fn step_down(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Elector {
    /// Without [`Elector::step_down`]: stop at once, as a crash would; the
    /// Lease expires.
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// The Lease record as last seen, and when (on this host's monotonic clock).
struct Observed {
    holder: Option<String>,
    renew_time: Option<MicroTime>,
    resource_version: Option<String>,
    since: Instant,
}

async fn campaign(
    api: Api<Lease>,
    cfg: LeaseConfig,
    leading: watch::Sender<bool>,
    mut stop: oneshot::Receiver<()>,
) {
    let mut observed: Option<Observed> = None;
    // Start of the last successful acquire or renew, while leading.
    let mut renewed_at: Option<Instant> = None;
    loop {
        let started = Instant::now();
        // A leader's attempt must end by its deadline; a candidate's within
        // one lease duration.
        let limit = match renewed_at {
            Some(t) => (t + cfg.renew_deadline).saturating_duration_since(started),
            None => cfg.lease_duration,
        };
        let outcome = timeout(limit, try_acquire_or_renew(&api, &cfg, &mut observed)).await;
        let next = match outcome {
            Ok(Ok(true)) => {
                api_health().succeeded("lease");
                if renewed_at.is_none() {
                    info!(lease = %cfg.name, identity = %cfg.identity, "became the leader");
                }
                renewed_at = Some(started);
                leading.send_if_modified(|l| !std::mem::replace(l, true));
                started + cfg.renew_interval
            }
            Ok(Ok(false)) => {
                api_health().succeeded("lease");
                if renewed_at.take().is_some() {
                    warn!(lease = %cfg.name, "lost the lease to another candidate");
                }
                leading.send_if_modified(|l| std::mem::replace(l, false));
                Instant::now() + cfg.retry_period
            }
            Ok(Err(e)) => {
                api_health().failed("lease", &e);
                Instant::now() + cfg.retry_period
            }
            Err(_) => {
                api_health().failed("lease", &"the lease update timed out");
                Instant::now()
            }
        };
        // A leader that could not renew by its deadline stops leading,
        // before the lease expires for the others.
        let next = match renewed_at {
            Some(t) if Instant::now() >= t + cfg.renew_deadline => {
                warn!(lease = %cfg.name, "could not renew the lease in time; no longer leading");
                renewed_at = None;
                leading.send_if_modified(|l| std::mem::replace(l, false));
                Instant::now() + cfg.retry_period
            }
            Some(t) => next.min(t + cfg.renew_deadline),
            None => next,
        };
        tokio::select! {
            _ = sleep_until(next) => {}
            _ = &mut stop => {
                // Stop allocating first, then free the Lease.
                if leading.send_replace(false) {
                    release(&api, &cfg).await;
                }
                return;
            }
        }
    }
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// One round: create, renew or take over the Lease. `Ok(true)`: we lead.
async fn try_acquire_or_renew(
    api: &Api<Lease>,
    cfg: &LeaseConfig,
    observed: &mut Option<Observed>,
) -> Result<bool, kube::Error> {
    // A 409 means the record changed under us: read it again, once.
    for _ in 0..2 {
        let now = Timestamp::now();
        let Some(lease) = api.get_opt(&cfg.name).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(cfg.name.clone()),
                    namespace: Some(cfg.namespace.clone()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(cfg.identity.clone()),
                    lease_duration_seconds: Some(cfg.duration_seconds()),
                    acquire_time: Some(MicroTime(now)),
                    renew_time: Some(MicroTime(now)),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            match api.create(&PostParams::default(), &lease).await {
                Ok(_) => return Ok(true),
                Err(e) if is_conflict(&e) => {
                    debug!(lease = %cfg.name, "another candidate created the lease first");
                    continue;
                }
                Err(e) => return Err(e),
            }
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let changed = observed.as_ref().is_none_or(|o| {
            o.holder != holder
                || o.renew_time != spec.renew_time
                || o.resource_version != lease.metadata.resource_version
        });
        if changed {
            *observed = Some(Observed {
                holder: holder.clone(),
                renew_time: spec.renew_time.clone(),
                resource_version: lease.metadata.resource_version.clone(),
                since: Instant::now(),
            });
        }
        let ours = holder.as_deref() == Some(cfg.identity.as_str());
        if !ours && holder.is_some() {
            let seen_since = observed.as_ref().map_or_else(Instant::now, |o| o.since);
            if !expired(&spec, seen_since, now, cfg) {
                return Ok(false);
            }
            info!(lease = %cfg.name, holder = ?holder, "the lease expired; taking over");
        }
        let mut updated = lease.clone();
        let mut new_spec = spec.clone();
        new_spec.holder_identity = Some(cfg.identity.clone());
        new_spec.lease_duration_seconds = Some(cfg.duration_seconds());
        new_spec.renew_time = Some(MicroTime(now));
        if !ours {
            new_spec.acquire_time = Some(MicroTime(now));
            new_spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        updated.spec = Some(new_spec);
        // The resourceVersion we read makes this conditional.
        match api
            .replace(&cfg.name, &PostParams::default(), &updated)
            .await
        {
            Ok(_) => return Ok(true),
            Err(e) if is_conflict(&e) => {
                debug!(lease = %cfg.name, "lease changed while updating it; reading again");
                continue;
            }
            Err(e) => return Err(e),
        }
    }
    Ok(false)
}

/// Whether another holder's lease has run out: by its `renewTime` on our
/// wall clock, and by how long we have seen it unchanged.
fn expired(spec: &LeaseSpec, seen_since: Instant, now: Timestamp, cfg: &LeaseConfig) -> bool {
    let duration = spec
        .lease_duration_seconds
        .filter(|s| *s > 0)
        .map_or(cfg.lease_duration, |s| Duration::from_secs(s as u64));
    let by_record = spec.renew_time.as_ref().is_none_or(|renewed| {
        let ends = renewed
            .0
            .checked_add(SignedDuration::try_from(duration).unwrap_or(SignedDuration::MAX))
            .unwrap_or(Timestamp::MAX);
        ends <= now
    });
    by_record && seen_since.elapsed() >= duration
}

/// Clears the holder if it is still us, so the next candidate need not wait.
async fn release(api: &Api<Lease>, cfg: &LeaseConfig) {
    let result = async {
        let Some(mut lease) = api.get_opt(&cfg.name).await? else {
            return Ok(());
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
            return Ok(());
        }
        spec.holder_identity = None;
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        api.replace(&cfg.name, &PostParams::default(), &lease)
            .await
            .map(|_| ())
    };
    match timeout(cfg.renew_deadline, result).await {
        Ok(Ok(())) => info!(lease = %cfg.name, "stepped down"),
        Ok(Err(e)) => warn!(lease = %cfg.name, "could not release the lease (it will expire): {e}"),
        Err(_) => warn!(lease = %cfg.name, "releasing the lease timed out (it will expire)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> LeaseConfig {
        LeaseConfig::new("xlb", "xlb-allocator", "node-a", Duration::from_secs(15))
    }

    #[test]
    fn timings_follow_the_lease_duration() {
        let c = cfg();
        assert_eq!(c.renew_interval, Duration::from_secs(5));
        assert_eq!(c.renew_deadline, Duration::from_secs(10));
        assert!(c.renew_deadline < c.lease_duration);
        // Whole seconds, at least one.
        let c = LeaseConfig::new("n", "l", "i", Duration::from_millis(1500));
        assert_eq!(c.lease_duration, Duration::from_secs(2));
        assert_eq!(c.duration_seconds(), 2);
        let c = LeaseConfig::new("n", "l", "i", Duration::ZERO);
        assert_eq!(c.duration_seconds(), 1);
    }

    fn spec(renewed_secs_ago: i64, duration: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some("other".into()),
            lease_duration_seconds: Some(duration),
            renew_time: Some(MicroTime(
                Timestamp::now() - SignedDuration::from_secs(renewed_secs_ago),
            )),
            ..Default::default()
        }
    }

    #[test]
    fn expiry_needs_both_the_record_and_our_own_observation() {
        let c = cfg();
        let now = Timestamp::now();
        let just_seen = Instant::now();
        let seen_long_ago = Instant::now().checked_sub(Duration::from_secs(16)).unwrap();
        // Renewed long ago, but we only just saw it: not yet.
        assert!(!expired(&spec(100, 15), just_seen, now, &c));
        assert!(expired(&spec(100, 15), seen_long_ago, now, &c));
        // Seen unchanged for long enough, but the record says it was renewed
        // recently (our clock is behind): not yet.
        assert!(!expired(&spec(3, 15), seen_long_ago, now, &c));
        // The holder's own duration counts, not ours.
        assert!(!expired(&spec(20, 30), seen_long_ago, now, &c));
        // No renewTime at all: our observation decides.
        let mut s = spec(0, 15);
        s.renew_time = None;
        assert!(expired(&s, seen_long_ago, now, &c));
        assert!(!expired(&s, just_seen, now, &c));
    }
}
