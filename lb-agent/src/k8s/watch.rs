//! Reflectors over Services, EndpointSlices and this node, publishing the
//! desired state whenever any of them changes.
//!
//! kube-rs's watcher does the API work: list, then watch from the list's
//! resourceVersion, re-list after 410 Gone, back off on errors. The stores
//! keep the last state they saw, so an API server outage publishes nothing
//! new and the data plane stays as it was. Nothing is published before all
//! three stores have synced once: an agent restarting during an outage must
//! not mistake empty stores for "no Services".

use std::{collections::BTreeSet, sync::Arc, time::Instant};

use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::api::{
    core::v1::{Node, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    runtime::{reflector, watcher, WatchStreamExt},
    Api, Client, Resource,
};
use tokio::sync::{watch, Notify};
use tracing::{debug, info, warn};

use super::{
    api_health::{api_health, QuickRetry},
    desired::{desired_services, ClusterView, Desired, SourceOptions},
    slice::Slice,
    SERVICE_NAME_LABEL,
};
use crate::config::KubernetesConfig;

/// The desired state from the cluster: `None` until the first full sync.
pub type DesiredRx = watch::Receiver<Option<Arc<Desired>>>;

/// A client for the configured cluster: the kubeconfig file if one is set,
/// else in-cluster config, else $KUBECONFIG / ~/.kube/config.
pub async fn client(cfg: &KubernetesConfig) -> anyhow::Result<Client> {
    use anyhow::Context as _;
    let config = match &cfg.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading the kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .with_context(|| format!("using the kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("finding the cluster (in-cluster, $KUBECONFIG, ~/.kube/config)")?,
    };
    Client::try_from(config).context("creating the Kubernetes client")
}

/// This node's name: the config's, else $NODE_NAME (the Helm chart sets it
/// from the downward API), else the host name.
pub fn node_name(cfg: &KubernetesConfig) -> String {
    cfg.node_name
        .clone()
        .or_else(crate::config::this_node)
        .unwrap_or_default()
}

/// Starts the reflectors and the task that turns their stores into the
/// desired state. Runs until the runtime stops.
pub fn spawn(client: Client, opts: SourceOptions) -> DesiredRx {
    let (tx, rx) = watch::channel(None);
    let changed = Arc::new(Notify::new());

    let (services, services_w) = reflector::store::<Service>();
    let (slices, slices_w) = reflector::store::<Slice>();
    let (nodes, nodes_w) = reflector::store::<Node>();
    drive(
        "services",
        watcher(
            Api::<Service>::all(client.clone()),
            watcher::Config::default(),
        )
        .modify(strip)
        .backoff(QuickRetry::default())
        .reflect(services_w),
        changed.clone(),
    );
    drive(
        "endpointslices",
        watcher(
            Api::<EndpointSlice>::all(client.clone()),
            // Only slices that belong to a Service.
            // Small pages: a slice of 100 endpoints is ~20 kB of JSON, and a
            // page is held whole while it is decoded.
            watcher::Config::default()
                .labels(SERVICE_NAME_LABEL)
                .page_size(SLICE_PAGE),
        )
        .backoff(QuickRetry::default())
        .map_ok(compact)
        .reflect(slices_w),
        changed.clone(),
    );
    drive(
        "nodes",
        watcher(
            Api::<Node>::all(client),
            watcher::Config::default().fields(&format!("metadata.name={}", opts.node_name)),
        )
        .modify(strip)
        .backoff(QuickRetry::default())
        .reflect(nodes_w),
        changed.clone(),
    );

    tokio::spawn(async move {
        let started = Instant::now();
        let synced = futures::future::join3(
            services.wait_until_ready(),
            slices.wait_until_ready(),
            nodes.wait_until_ready(),
        )
        .await;
        if synced.0.is_err() || synced.1.is_err() || synced.2.is_err() {
            return;
        }
        info!(took = ?started.elapsed(), "Kubernetes stores synced");
        let mut last = Arc::new(Desired::default());
        let mut logged: BTreeSet<String> = BTreeSet::new();
        loop {
            let svc_state = services.state();
            let slice_state = slices.state();
            let node_state = nodes.state();
            let svc_refs: Vec<&Service> = svc_state.iter().map(Arc::as_ref).collect();
            let slice_refs: Vec<&Slice> = slice_state.iter().map(Arc::as_ref).collect();
            let node = node_state
                .iter()
                .find(|n| n.metadata.name.as_deref() == Some(opts.node_name.as_str()))
                .map(Arc::as_ref);
            let desired = desired_services(
                &ClusterView {
                    services: &svc_refs,
                    slices: &slice_refs,
                    node,
                },
                &opts,
                &last,
            );
            // Each problem is logged once, while it lasts.
            let now: BTreeSet<String> = desired.problems.iter().cloned().collect();
            for p in now.difference(&logged) {
                warn!("{p}");
            }
            logged = now;
            let publish = tx.borrow().is_none()
                || desired.services != last.services
                || desired.leaving != last.leaving;
            last = Arc::new(desired);
            if publish {
                debug!(
                    services = last.services.len(),
                    "desired state from Kubernetes"
                );
                if tx.send(Some(last.clone())).is_err() {
                    return;
                }
            }
            changed.notified().await;
        }
    });
    rx
}

/// Drops what the agent never reads before an object enters a store: the
/// field-manager records and kubectl's copy of the last applied object are
/// most of a small object's size, and the stores hold every Service and
/// EndpointSlice of the cluster.
fn strip<K: Resource>(object: &mut K) {
    let meta = object.meta_mut();
    meta.managed_fields = None;
    if let Some(annotations) = &mut meta.annotations {
        annotations.remove(LAST_APPLIED);
    }
}

const SLICE_PAGE: u32 = 50;

/// A slice's event with the slice made compact ([`Slice`]) before the
/// cache keeps it.
fn compact(event: watcher::Event<EndpointSlice>) -> watcher::Event<Slice> {
    use watcher::Event::*;
    match event {
        Apply(s) => Apply(s.into()),
        Delete(s) => Delete(s.into()),
        InitApply(s) => InitApply(s.into()),
        Init => Init,
        InitDone => InitDone,
    }
}

const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// A store of the `K` objects `config` selects, kept by a reflector
/// (driven as [`drive`] does) that wakes `changed` on every event.
pub(super) fn store<K>(
    what: &'static str,
    api: Api<K>,
    config: watcher::Config,
    changed: &Arc<Notify>,
) -> reflector::Store<K>
where
    K: Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone,
{
    let (store, writer) = reflector::store::<K>();
    drive(
        what,
        watcher(api, config)
            .backoff(QuickRetry::default())
            .reflect(writer),
        changed.clone(),
    );
    store
}

/// The watcher config that selects only the Node named `node_name`.
pub(super) fn this_node(node_name: &str) -> watcher::Config {
    watcher::Config::default().fields(&format!("metadata.name={node_name}"))
}

/// Polls one reflector stream forever, waking the desired-state task on
/// every event. Errors go to the shared API health (logged once per
/// outage); the watcher retries within a second.
pub(super) fn drive<K, S>(what: &'static str, stream: S, changed: Arc<Notify>)
where
    K: Resource + Send + Sync + 'static,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            match event {
                // Init only says a list is about to start: no request was answered yet.
                Ok(watcher::Event::Init) => {}
                Ok(event) => {
                    api_health().succeeded(what);
                    if !matches!(event, watcher::Event::InitApply(_)) {
                        changed.notify_one();
                    }
                }
                Err(e) => api_health().watch_failed(what, &e),
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_keep_what_desired_state_reads_and_drop_the_rest() {
        let mut svc: Service = serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "web", "namespace": "shop",
                "annotations": {"xlb.dev/mode": "nat", LAST_APPLIED: "{\"big\": true}"},
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}],
            },
            "spec": {"type": "LoadBalancer"},
        }))
        .unwrap();
        strip(&mut svc);
        assert_eq!(svc.metadata.managed_fields, None);
        let annotations = svc.metadata.annotations.unwrap();
        assert_eq!(annotations.len(), 1);
        assert_eq!(annotations["xlb.dev/mode"], "nat");
        assert_eq!(svc.spec.unwrap().type_.as_deref(), Some("LoadBalancer"));
    }
}
