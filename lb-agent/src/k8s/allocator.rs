//! The controller that hands out LoadBalancer addresses.
//!
//! While this agent leads (see [`super::leader`]), it watches every Service
//! and every `LoadBalancerPool`, decides all addresses at once with
//! [`ipam::allocate`], and writes what changed:
//!
//! - each Service xlb serves gets `status.loadBalancer.ingress` (`ip`,
//!   `ipMode: VIP`) and the condition `xlb.dev/AddressAllocated`, by a merge
//!   patch of the status subresource that carries the resourceVersion it was
//!   computed from (a 409 means "read again", and is retried);
//! - a Service without its address gets a `False` condition and one Warning
//!   Event per distinct problem (reason = the failure reason);
//! - a Service that stops being xlb's loses the ingress xlb wrote, and the
//!   condition;
//! - each pool gets `status.size`, `status.inUse`, `status.error`;
//! - metrics `xlb_pool_addresses{pool}`, `xlb_pool_addresses_in_use{pool}`,
//!   `xlb_services_without_address{reason}` (only the leader reports them).
//!
//! Writes that take an address away go out before writes that give one, and
//! an address still shown on one Service is not given to another, so no two
//! Services show one address even for a moment. Failed writes (an API
//! server outage, a conflict) are retried with backoff; nothing is decided
//! before both watches have listed everything.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use futures::{stream, StreamExt};
use k8s_openapi::api::core::v1::{LoadBalancerIngress, Namespace, Service};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::reflector::{self, Store};
use kube::runtime::utils::Backoff;
use kube::runtime::watcher::{self, watcher};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, Resource, ResourceExt};
use prometheus::{IntGauge, IntGaugeVec, Opts, Registry};
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::{sleep_until, Instant};
use tracing::{debug, info, warn};

use super::api_health::{api_health, QuickRetry};
use super::crd::{LoadBalancerPool, LoadBalancerPoolStatus};
use super::ipam::{self, Allocation, Decision, Failure, FailureReason, PoolInput, Pools};
use super::ipam::{ServiceName, ServiceRequest};
use super::leader::{Elector, LeaseConfig};
use super::{serves, ALLOCATED_CONDITION, CONTROLLER_NAME};
use crate::config::KubernetesConfig;

/// The `ipMode` xlb writes: traffic to the address reaches the node as is.
const IP_MODE: &str = "VIP";
/// Condition reason when a Service has its addresses.
const ALLOCATED_REASON: &str = "Allocated";
/// Event reason for a pool whose spec is unusable.
const INVALID_POOL_REASON: &str = "InvalidPool";
/// Event reason for a Service field the data plane cannot use.
const INVALID_SERVICE_REASON: &str = "InvalidService";
/// Where a watcher event leaves its (re-)list: `Init` is sent before any
/// request is answered, `InitDone` once the list is complete.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ListProgress {
    Starting,
    Done,
    Other,
}

impl ListProgress {
    fn of<K>(e: &watcher::Event<K>) -> Self {
        match e {
            watcher::Event::Init => ListProgress::Starting,
            watcher::Event::InitDone => ListProgress::Done,
            _ => ListProgress::Other,
        }
    }
}

/// Changes arriving within this window are handled together.
const DEBOUNCE: Duration = Duration::from_millis(50);
/// The longest wait before writing again after a failed write.
const RETRY_MAX: Duration = Duration::from_secs(30);
/// How long a status we wrote stands in for the watch's older copy.
const WRITTEN_TTL: Duration = Duration::from_secs(30);

/// Which Services are xlb's, and who reports Events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllocatorConfig {
    pub load_balancer_class: String,
    pub default_class: bool,
    /// The Events' `reportingInstance` (the node or pod name).
    pub identity: String,
}

impl AllocatorConfig {
    pub fn from_kubernetes(cfg: &KubernetesConfig, identity: &str) -> AllocatorConfig {
        AllocatorConfig {
            load_balancer_class: cfg.load_balancer_class.clone(),
            default_class: cfg.default_class,
            identity: identity.to_string(),
        }
    }
}

/// The allocator's metrics, registered once.
#[derive(Clone)]
struct Metrics {
    leader: IntGauge,
    pool_addresses: IntGaugeVec,
    pool_in_use: IntGaugeVec,
    without_address: IntGaugeVec,
}

impl Metrics {
    fn register(registry: &Registry) -> prometheus::Result<Metrics> {
        let pool_addresses = IntGaugeVec::new(
            Opts::new(
                "xlb_pool_addresses",
                "Addresses a LoadBalancerPool can hand out (capped at 2^32); reported by the allocating agent.",
            ),
            &["pool"],
        )?;
        let pool_in_use = IntGaugeVec::new(
            Opts::new(
                "xlb_pool_addresses_in_use",
                "Addresses of a LoadBalancerPool that Services hold; reported by the allocating agent.",
            ),
            &["pool"],
        )?;
        let without_address = IntGaugeVec::new(
            Opts::new(
                "xlb_services_without_address",
                "LoadBalancer Services xlb serves that have no address, by reason; reported by the allocating agent.",
            ),
            &["reason"],
        )?;
        let leader = IntGauge::new(
            "xlb_allocator_leader",
            "1 while this agent holds the allocator's Lease and hands out LoadBalancer addresses",
        )?;
        registry.register(Box::new(leader.clone()))?;
        registry.register(Box::new(pool_addresses.clone()))?;
        registry.register(Box::new(pool_in_use.clone()))?;
        registry.register(Box::new(without_address.clone()))?;
        Ok(Metrics {
            leader,
            pool_addresses,
            pool_in_use,
            without_address,
        })
    }

    fn update(&self, pools: &Pools, allocation: &Allocation) {
        self.pool_addresses.reset();
        self.pool_in_use.reset();
        for pool in pools.valid() {
            let in_use = allocation.in_use.get(&pool.name).copied().unwrap_or(0);
            self.pool_addresses
                .with_label_values(&[pool.name.as_str()])
                .set(pool.size() as i64);
            self.pool_in_use
                .with_label_values(&[pool.name.as_str()])
                .set(in_use as i64);
        }
        for (name, _) in pools.invalid() {
            self.pool_addresses.with_label_values(&[name]).set(0);
            self.pool_in_use.with_label_values(&[name]).set(0);
        }
        let mut counts: BTreeMap<FailureReason, i64> =
            FailureReason::ALL.iter().map(|r| (*r, 0)).collect();
        for decision in allocation.decisions.values() {
            if let (Some(f), true) = (&decision.failure, decision.addresses.is_empty()) {
                *counts.entry(f.reason).or_default() += 1;
            }
        }
        for (reason, n) in counts {
            self.without_address
                .with_label_values(&[reason.as_str()])
                .set(n);
        }
    }

    /// A follower reports nothing: sums over agents stay right.
    fn clear(&self) {
        self.pool_addresses.reset();
        self.pool_in_use.reset();
        self.without_address.reset();
    }
}

/// The allocation controller. Build it with [`Allocator::new`] (which
/// registers its metrics), then spawn [`Allocator::run`].
pub struct Allocator {
    client: Client,
    cfg: AllocatorConfig,
    metrics: Metrics,
}

impl Allocator {
    pub fn new(
        client: Client,
        cfg: AllocatorConfig,
        registry: &Registry,
    ) -> prometheus::Result<Allocator> {
        Ok(Allocator {
            client,
            cfg,
            metrics: Metrics::register(registry)?,
        })
    }

    /// Allocates while `leader` says `true`; idle otherwise. Returns when
    /// the leader channel closes.
    pub async fn run(self, mut leader: watch::Receiver<bool>) {
        loop {
            if leader.wait_for(|leading| *leading).await.is_err() {
                return;
            }
            info!("leading: handing out LoadBalancer addresses");
            self.metrics.leader.set(1);
            let mut term = Term::new(&self);
            term.run(&mut leader).await;
            self.metrics.clear();
            self.metrics.leader.set(0);
            info!("not leading: stopped handing out LoadBalancer addresses");
            // The elector is gone (the agent is stopping). Its last value
            // may still be `true`, which `wait_for` would take at once,
            // again and again.
            if leader.has_changed().is_err() {
                return;
            }
        }
    }
}

/// A running election candidate with its allocator.
pub struct Running {
    elector: Elector,
    allocator: JoinHandle<()>,
}

impl Running {
    /// Whether this agent leads now.
    pub fn leading(&self) -> watch::Receiver<bool> {
        self.elector.leading()
    }

    /// Stops allocating and frees the Lease for another agent.
    pub async fn stop(self) {
        self.elector.step_down().await;
        // The leader channel is closed now; the allocator returns.
        let _ = self.allocator.await;
    }
}

/// Starts this agent's candidacy on the Lease of `cfg` and the allocator
/// that works while it leads. Call from within a tokio runtime.
pub fn start(
    client: Client,
    cfg: &KubernetesConfig,
    identity: &str,
    registry: &Registry,
) -> prometheus::Result<Running> {
    let allocator = Allocator::new(
        client.clone(),
        AllocatorConfig::from_kubernetes(cfg, identity),
        registry,
    )?;
    let elector = Elector::start(
        client,
        LeaseConfig::new(
            &cfg.lease_namespace,
            &cfg.lease_name,
            identity,
            cfg.lease_duration,
        ),
    );
    let allocator = tokio::spawn(allocator.run(elector.leading()));
    Ok(Running { elector, allocator })
}

/// A status this leader wrote, standing in for the watch's copy until the
/// watch catches up.
struct Written {
    uid: Option<String>,
    resource_version: Option<String>,
    at: Instant,
    addresses: Vec<IpAddr>,
    condition: Option<ConditionCore>,
}

/// The parts of a condition whose change is worth a write.
#[derive(Clone, Debug, PartialEq, Eq)]
struct ConditionCore {
    status: String,
    reason: String,
    message: String,
    observed_generation: Option<i64>,
}

impl ConditionCore {
    fn of(c: &Condition) -> ConditionCore {
        ConditionCore {
            status: c.status.clone(),
            reason: c.reason.clone(),
            message: c.message.clone(),
            observed_generation: c.observed_generation,
        }
    }
}

/// An Event to publish (until it succeeds).
struct PendingEvent {
    uid: Option<String>,
    reference: k8s_openapi::api::core::v1::ObjectReference,
    reason: String,
    note: String,
}

/// One term as leader: its own watches and caches.
struct Term<'a> {
    allocator: &'a Allocator,
    recorder: Recorder,
    written: HashMap<ServiceName, Written>,
    /// Problems already published as Events: key -> (uid, reason, note).
    reported: HashMap<String, (Option<String>, String, String)>,
    pending: BTreeMap<String, PendingEvent>,
}

impl<'a> Term<'a> {
    fn new(allocator: &'a Allocator) -> Term<'a> {
        let reporter = Reporter {
            controller: CONTROLLER_NAME.to_string(),
            instance: Some(allocator.cfg.identity.clone()),
        };
        Term {
            allocator,
            recorder: Recorder::new(allocator.client.clone(), reporter),
            written: HashMap::new(),
            reported: HashMap::new(),
            pending: BTreeMap::new(),
        }
    }

    /// Watches and reconciles until leadership ends.
    async fn run(&mut self, leader: &mut watch::Receiver<bool>) {
        let client = self.allocator.client.clone();
        let (services, svc_writer) = reflector::store::<Service>();
        let (pools, pool_writer) = reflector::store::<LoadBalancerPool>();
        let svc_events = reflector::reflector(
            svc_writer,
            watcher(
                Api::<Service>::all(client.clone()),
                watcher::Config::default(),
            )
            .backoff(QuickRetry::default()),
        )
        .map(|e| e.map(|e| (Kind::Service, ListProgress::of(&e))));
        let pool_events = reflector::reflector(
            pool_writer,
            watcher(
                Api::<LoadBalancerPool>::all(client.clone()),
                watcher::Config::default(),
            )
            .backoff(QuickRetry::default()),
        )
        .map(|e| e.map(|e| (Kind::Pool, ListProgress::of(&e))));
        // Namespaces' labels, for pools scoped by namespaceSelectors.
        let (namespaces, ns_writer) = reflector::store::<Namespace>();
        let ns_events = reflector::reflector(
            ns_writer,
            watcher(Api::<Namespace>::all(client), watcher::Config::default())
                .backoff(QuickRetry::default()),
        )
        .map(|e| e.map(|e| (Kind::Namespace, ListProgress::of(&e))));
        let mut changes = stream::select(
            stream::select(svc_events.boxed(), pool_events.boxed()),
            ns_events.boxed(),
        );

        let (mut services_listed, mut pools_listed, mut namespaces_listed) = (false, false, false);
        let mut dirty = true;
        let mut next_attempt = Instant::now();
        let mut retry = QuickRetry::up_to(RETRY_MAX);
        loop {
            let ready = services_listed && pools_listed && namespaces_listed && dirty;
            tokio::select! {
                changed = leader.changed() => {
                    if changed.is_err() || !*leader.borrow() {
                        return;
                    }
                }
                item = changes.next() => match item {
                    Some(Ok((kind, progress))) => {
                        if progress != ListProgress::Starting {
                            api_health().succeeded("allocator");
                        }
                        if progress == ListProgress::Done {
                            match kind {
                                Kind::Service => services_listed = true,
                                Kind::Pool => pools_listed = true,
                                Kind::Namespace => namespaces_listed = true,
                            }
                        }
                        let soon = Instant::now() + DEBOUNCE;
                        next_attempt = if dirty { next_attempt.min(soon) } else { soon };
                        dirty = true;
                    }
                    Some(Err(e)) => api_health().watch_failed("allocator", &e),
                    None => return,
                },
                _ = sleep_until(next_attempt), if ready => {
                    let outcome = tokio::select! {
                        ok = self.reconcile(&services, &pools, &namespaces) => ok,
                        _ = leader.wait_for(|leading| !*leading) => return,
                    };
                    if outcome {
                        dirty = false;
                        retry.reset();
                    } else {
                        let delay = retry.next().unwrap_or(RETRY_MAX);
                        debug!(?delay, "some writes failed; retrying");
                        next_attempt = Instant::now() + delay;
                    }
                }
            }
        }
    }

    /// Decides every address and writes what differs. `false`: something
    /// failed and should be retried.
    async fn reconcile(
        &mut self,
        services: &Store<Service>,
        pools: &Store<LoadBalancerPool>,
        namespaces: &Store<Namespace>,
    ) -> bool {
        let cfg = &self.allocator.cfg;
        let mut pool_objects = pools.state();
        pool_objects.sort_by_key(|p| p.name_any());
        let model = Pools::build(pool_objects.iter().map(|p| PoolInput {
            name: p.metadata.name.as_deref().unwrap_or_default(),
            spec: &p.spec,
            created: p.metadata.creation_timestamp.as_ref().map(|t| t.0),
        }));
        let mut all = services.state();
        all.sort_by_key(|s| key_of(s));
        let (served, others): (Vec<Arc<Service>>, Vec<Arc<Service>>) = all
            .into_iter()
            .partition(|s| serves(s, &cfg.load_balancer_class, cfg.default_class));

        let requests: Vec<ServiceRequest> = served
            .iter()
            .map(|svc| {
                let mut req = ServiceRequest::from_service(svc);
                let ns = kube::runtime::reflector::ObjectRef::new(&req.key.namespace);
                req.namespace_labels = namespaces
                    .get(&ns)
                    .and_then(|n| n.metadata.labels.clone())
                    .unwrap_or_default();
                if let Some(addresses) = self.written_addresses(svc, &req) {
                    req.current = addresses;
                }
                req
            })
            .collect();
        let allocation = ipam::allocate(&requests, &model);
        // Metrics follow the decision (set before any write goes out).
        self.allocator.metrics.update(&model, &allocation);
        let mut ok = true;

        // Writes that take addresses away first; an address whose removal
        // did not go through is not given to anyone else (Services that
        // keep sharing it do not block each other).
        let mut still_shown: BTreeMap<IpAddr, BTreeSet<ServiceName>> = BTreeMap::new();
        for req in &requests {
            for ip in &req.current {
                still_shown.entry(*ip).or_default().insert(req.key.clone());
            }
        }
        let mut order: Vec<(usize, bool)> = requests
            .iter()
            .enumerate()
            .map(|(i, req)| {
                let decision = &allocation.decisions[&req.key];
                let releases = req
                    .current
                    .iter()
                    .any(|ip| !decision.addresses.contains(ip));
                (i, !releases)
            })
            .collect();
        order.sort_by_key(|(i, grants_only)| (*grants_only, *i));
        for (i, _) in order {
            let (svc, req) = (&served[i], &requests[i]);
            let decision = &allocation.decisions[&req.key];
            if let Some((ip, holder)) = decision.addresses.iter().find_map(|ip| {
                let releasing = still_shown
                    .get(ip)?
                    .iter()
                    .find(|k| **k != req.key && !allocation.decisions[*k].addresses.contains(ip))?;
                Some((ip, releasing))
            }) {
                debug!(service = %req.key, %ip, %holder, "address not yet released; later");
                ok = false;
                continue;
            }
            match self.write_service(svc, req, decision, &model).await {
                Ok(()) => {
                    for ip in &req.current {
                        if !decision.addresses.contains(ip) {
                            if let Some(keys) = still_shown.get_mut(ip) {
                                keys.remove(&req.key);
                            }
                        }
                    }
                }
                Err(e) => {
                    warn!(service = %req.key, "could not update the Service's status: {e}");
                    ok = false;
                }
            }
        }

        for svc in &others {
            if let Err(e) = self.release_foreign(svc, &model).await {
                warn!(service = %key_of(svc), "could not clear the Service's status: {e}");
                ok = false;
            }
        }

        for pool in &pool_objects {
            if let Err(e) = self.write_pool(pool, &model, &allocation).await {
                warn!(pool = %pool.name_any(), "could not update the pool's status: {e}");
                ok = false;
            }
        }

        self.queue_spec_events(&served, &requests);

        self.forget_gone(&requests, &pool_objects);
        ok &= self.publish_events().await;
        ok
    }

    /// Drops what is remembered of Services and pools that are gone.
    fn forget_gone(&mut self, requests: &[ServiceRequest], pools: &[Arc<LoadBalancerPool>]) {
        let live: BTreeSet<ServiceName> = requests.iter().map(|r| r.key.clone()).collect();
        self.written.retain(|k, _| live.contains(k));
        let live_keys: BTreeSet<String> = live
            .iter()
            .flat_map(|k| [service_event_key(k), spec_event_key(k)])
            .chain(pools.iter().map(|p| pool_event_key(&p.name_any())))
            .collect();
        self.reported.retain(|k, _| live_keys.contains(k));
        self.pending.retain(|k, _| live_keys.contains(k));
    }

    /// Queues one Warning Event per Service field the data plane cannot
    /// use (every agent logs it and keeps the Service's last good state).
    fn queue_spec_events(&mut self, served: &[Arc<Service>], requests: &[ServiceRequest]) {
        for (svc, req) in served.iter().zip(requests) {
            let key = spec_event_key(&req.key);
            match super::desired::spec_problem(svc) {
                Some(problem) => {
                    let note = format!("{problem}; every node keeps serving the Service as it was");
                    let fingerprint = (
                        svc.metadata.uid.clone(),
                        INVALID_SERVICE_REASON.to_string(),
                        note.clone(),
                    );
                    if self.reported.get(&key) != Some(&fingerprint) {
                        self.pending.insert(
                            key,
                            PendingEvent {
                                uid: svc.metadata.uid.clone(),
                                reference: svc.object_ref(&()),
                                reason: INVALID_SERVICE_REASON.to_string(),
                                note,
                            },
                        );
                    }
                }
                None => {
                    self.reported.remove(&key);
                    self.pending.remove(&key);
                }
            }
        }
    }

    /// What we wrote for `svc`, when the watch has not shown it yet.
    fn written_addresses(&mut self, svc: &Service, req: &ServiceRequest) -> Option<Vec<IpAddr>> {
        let w = self.written.get(&req.key)?;
        let caught_up = w.uid != svc.metadata.uid
            || w.resource_version == svc.metadata.resource_version
            || w.at.elapsed() > WRITTEN_TTL
            || w.addresses == req.current;
        if caught_up {
            self.written.remove(&req.key);
            return None;
        }
        Some(w.addresses.clone())
    }

    async fn write_service(
        &mut self,
        svc: &Service,
        req: &ServiceRequest,
        decision: &Decision,
        pools: &Pools,
    ) -> Result<(), kube::Error> {
        let live_condition = our_condition(svc);
        let condition = desired_condition(decision, pools, svc.metadata.generation, live_condition);
        let core = ConditionCore::of(&condition);
        let live_ingress = ingress_of(svc);
        let desired_ingress: Vec<(String, Option<String>)> = decision
            .addresses
            .iter()
            .map(|ip| (ip.to_string(), Some(IP_MODE.to_string())))
            .collect();

        // Queue an Event for a problem not yet reported.
        let event_key = service_event_key(&req.key);
        match &decision.failure {
            Some(f) => {
                let fingerprint = (
                    svc.metadata.uid.clone(),
                    f.reason.to_string(),
                    condition.message.clone(),
                );
                let live_same = live_condition.is_some_and(|c| ConditionCore::of(c) == core);
                if !live_same && self.reported.get(&event_key) != Some(&fingerprint) {
                    self.pending.insert(
                        event_key,
                        PendingEvent {
                            uid: svc.metadata.uid.clone(),
                            reference: svc.object_ref(&()),
                            reason: f.reason.to_string(),
                            note: condition.message.clone(),
                        },
                    );
                }
            }
            None => {
                self.reported.remove(&event_key);
                self.pending.remove(&event_key);
            }
        }

        let up_to_date = |addresses: &[IpAddr], c: Option<&ConditionCore>| {
            addresses == decision.addresses.as_slice() && c == Some(&core)
        };
        if live_ingress == desired_ingress
            && live_condition.map(ConditionCore::of).as_ref() == Some(&core)
        {
            return Ok(());
        }
        if let Some(w) = self.written.get(&req.key) {
            if w.uid == svc.metadata.uid && up_to_date(&w.addresses, w.condition.as_ref()) {
                return Ok(());
            }
        }

        let ingress: Vec<LoadBalancerIngress> = decision
            .addresses
            .iter()
            .map(|ip| LoadBalancerIngress {
                ip: Some(ip.to_string()),
                ip_mode: Some(IP_MODE.to_string()),
                ..Default::default()
            })
            .collect();
        let conditions = replace_condition(svc, Some(condition));
        let patch = json!({
            "metadata": {"resourceVersion": svc.metadata.resource_version},
            "status": {
                "loadBalancer": {"ingress": if ingress.is_empty() { Value::Null } else { json!(ingress) }},
                "conditions": conditions,
            }
        });
        let api: Api<Service> = Api::namespaced(self.allocator.client.clone(), &req.key.namespace);
        let updated = api
            .patch_status(
                &req.key.name,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            )
            .await?;
        match &decision.failure {
            None => {
                info!(service = %req.key, addresses = ?decision.addresses, "addresses allocated")
            }
            Some(f) => warn!(service = %req.key, reason = %f.reason, "{}", f.message),
        }
        self.written.insert(
            req.key.clone(),
            Written {
                uid: updated.metadata.uid.clone(),
                resource_version: updated.metadata.resource_version.clone(),
                at: Instant::now(),
                addresses: decision.addresses.clone(),
                condition: Some(core),
            },
        );
        Ok(())
    }

    /// A Service that is no longer xlb's: drop the condition and the
    /// ingress entries from xlb's pools.
    async fn release_foreign(&mut self, svc: &Service, pools: &Pools) -> Result<(), kube::Error> {
        if our_condition(svc).is_none() {
            return Ok(());
        }
        let key = key_of(svc);
        let kept: Vec<LoadBalancerIngress> = super::ingress(svc)
            .iter()
            .filter(|i| {
                let ip: Option<IpAddr> = i.ip.as_deref().and_then(|s| s.parse().ok());
                !ip.is_some_and(|ip| pools.in_any_range(ip))
            })
            .cloned()
            .collect();
        let patch = json!({
            "metadata": {"resourceVersion": svc.metadata.resource_version},
            "status": {
                "loadBalancer": {"ingress": if kept.is_empty() { Value::Null } else { json!(kept) }},
                "conditions": replace_condition(svc, None),
            }
        });
        let api: Api<Service> = Api::namespaced(self.allocator.client.clone(), &key.namespace);
        api.patch_status(&key.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        info!(service = %key, "no longer served by xlb; its address is released");
        self.written.remove(&key);
        Ok(())
    }

    async fn write_pool(
        &mut self,
        pool: &LoadBalancerPool,
        model: &Pools,
        allocation: &Allocation,
    ) -> Result<(), kube::Error> {
        let name = pool.name_any();
        let desired = match (model.get(&name), model.error(&name)) {
            (Some(p), _) => LoadBalancerPoolStatus {
                size: p.size(),
                in_use: allocation.in_use.get(&name).copied().unwrap_or(0),
                error: None,
            },
            (None, error) => LoadBalancerPoolStatus {
                size: 0,
                in_use: 0,
                error: Some(error.unwrap_or("unusable").to_string()),
            },
        };
        let event_key = pool_event_key(&name);
        if let Some(error) = &desired.error {
            let fingerprint = (
                pool.metadata.uid.clone(),
                INVALID_POOL_REASON.to_string(),
                error.clone(),
            );
            let live_error = pool.status.as_ref().and_then(|s| s.error.as_ref());
            if live_error != Some(error) && self.reported.get(&event_key) != Some(&fingerprint) {
                warn!(pool = %name, "pool is unusable: {error}");
                self.pending.insert(
                    event_key,
                    PendingEvent {
                        uid: pool.metadata.uid.clone(),
                        reference: pool.object_ref(&()),
                        reason: INVALID_POOL_REASON.to_string(),
                        note: format!("pool {name:?} is unusable: {error}"),
                    },
                );
            }
        } else {
            self.reported.remove(&event_key);
            self.pending.remove(&event_key);
        }
        if pool.status.as_ref() == Some(&desired) {
            return Ok(());
        }
        let patch = json!({
            "status": {"size": desired.size, "inUse": desired.in_use, "error": desired.error}
        });
        let api: Api<LoadBalancerPool> = Api::all(self.allocator.client.clone());
        api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }

    /// Publishes queued Events; `false` if one failed (kept for a retry).
    async fn publish_events(&mut self) -> bool {
        let mut ok = true;
        let keys: Vec<String> = self.pending.keys().cloned().collect();
        for key in keys {
            let event = &self.pending[&key];
            let result = self
                .recorder
                .publish(
                    &KubeEvent {
                        type_: EventType::Warning,
                        reason: event.reason.clone(),
                        note: Some(event.note.clone()),
                        action: "Allocate".into(),
                        secondary: None,
                    },
                    &event.reference,
                )
                .await;
            match result {
                Ok(()) => {
                    let event = self.pending.remove(&key).expect("queued");
                    self.reported
                        .insert(key, (event.uid, event.reason, event.note));
                }
                Err(e) => {
                    warn!(%key, "could not publish an Event: {e}");
                    ok = false;
                }
            }
        }
        ok
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Service,
    Pool,
    Namespace,
}

fn key_of(svc: &Service) -> ServiceName {
    ServiceName::new(
        svc.metadata.namespace.as_deref().unwrap_or("default"),
        svc.metadata.name.as_deref().unwrap_or_default(),
    )
}

fn service_event_key(key: &ServiceName) -> String {
    format!("service/{key}")
}

/// Events about a Service's spec (not its address) are tracked apart.
fn spec_event_key(key: &ServiceName) -> String {
    format!("{}#spec", service_event_key(key))
}

fn pool_event_key(name: &str) -> String {
    format!("pool/{name}")
}

fn our_condition(svc: &Service) -> Option<&Condition> {
    svc.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == ALLOCATED_CONDITION)
}

/// The ingress entries as (ip, ipMode); hostnames count as a difference.
fn ingress_of(svc: &Service) -> Vec<(String, Option<String>)> {
    super::ingress(svc)
        .iter()
        .map(|i| {
            (
                i.ip.clone().unwrap_or_else(|| {
                    format!("hostname:{}", i.hostname.clone().unwrap_or_default())
                }),
                i.ip_mode.clone(),
            )
        })
        .collect()
}

/// The Service's conditions with ours replaced (or removed), others kept in
/// place; `null` when none remain. A merge patch replaces the whole list.
fn replace_condition(svc: &Service, ours: Option<Condition>) -> Value {
    let mut conditions: Vec<Condition> = svc
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    let at = conditions
        .iter()
        .position(|c| c.type_ == ALLOCATED_CONDITION);
    match (at, ours) {
        (Some(i), Some(c)) => conditions[i] = c,
        (Some(i), None) => {
            conditions.remove(i);
        }
        (None, Some(c)) => conditions.push(c),
        (None, None) => {}
    }
    if conditions.is_empty() {
        Value::Null
    } else {
        json!(conditions)
    }
}

/// The `xlb.dev/AddressAllocated` condition for a decision. Its
/// lastTransitionTime moves only when its status does.
fn desired_condition(
    decision: &Decision,
    pools: &Pools,
    generation: Option<i64>,
    live: Option<&Condition>,
) -> Condition {
    let describe = |ips: &[IpAddr]| {
        ips.iter()
            .map(|ip| match pools.pool_keeping(*ip) {
                Some(p) => format!("{ip} (pool {})", p.name),
                None => ip.to_string(),
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (status, reason, message) = match &decision.failure {
        None => {
            let mut message = describe(&decision.addresses);
            if let Some(Failure {
                reason,
                message: why,
            }) = &decision.missing_optional
            {
                message.push_str(&format!("; no second family ({reason}: {why})"));
            }
            ("True", ALLOCATED_REASON.to_string(), message)
        }
        Some(f) => {
            let mut message = f.message.clone();
            if !decision.addresses.is_empty() {
                message.push_str(&format!("; keeping {}", describe(&decision.addresses)));
            }
            ("False", f.reason.to_string(), message)
        }
    };
    let last_transition_time = match live {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Time(Timestamp::now()),
    };
    Condition {
        type_: ALLOCATED_CONDITION.to_string(),
        status: status.to_string(),
        reason,
        message,
        observed_generation: generation,
        last_transition_time,
    }
}

#[cfg(test)]
mod tests;
