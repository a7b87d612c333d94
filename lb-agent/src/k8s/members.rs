//! Peers from Kubernetes, for L2 mode's membership and for the flow
//! exchange: every agent keeps a Lease `<prefix>-<node>` in the agent's
//! namespace that names its address, and takes the other agents' fresh
//! Leases as its peers, so that nodes join and leave without a config
//! change. In L2 mode SWIM stays the failure detector (sub-second); the
//! Leases only say whom to gossip with, and they are the slow fallback
//! view: a node whose Lease is stale is no longer a peer and no longer
//! counts towards the quorum.

use std::{collections::BTreeMap, net::SocketAddr, sync::Arc, time::Duration};

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::{
    api::{DeleteParams, Patch, PatchParams},
    runtime::{reflector, watcher, WatchStreamExt},
    Api, Client,
};
use serde_json::json;
use tokio::sync::Notify;
use tracing::{debug, info, warn};

use super::{api_health::QuickRetry, watch::drive};

/// One set of Leases: what they are for.
#[derive(Clone, Copy, Debug)]
pub struct Roster {
    /// For the logs.
    pub what: &'static str,
    /// Leases are `<prefix>-<node>`; also the field manager.
    pub prefix: &'static str,
    /// Marks the Leases (and selects them).
    pub label: &'static str,
    /// The agent's address (`ip:port`).
    pub annotation: &'static str,
}

/// L2 mode's membership (docs/l2.md).
pub const L2: Roster = Roster {
    what: "L2 membership",
    prefix: "xlb-l2",
    label: "xlb.dev/l2-member",
    annotation: "xlb.dev/l2-address",
};

/// The flow exchange's peers (`flow_sync:`, docs/bgp.md).
pub const FLOW_SYNC: Roster = Roster {
    what: "flow exchange",
    prefix: "xlb-flows",
    label: "xlb.dev/flow-sync-member",
    annotation: "xlb.dev/flow-sync-address",
};

/// How long a Lease counts without renewal; renewed every third of it.
pub const LEASE_SECONDS: i64 = 15;

impl Roster {
    pub fn lease_name(&self, node: &str) -> String {
        format!("{}-{node}", self.prefix)
    }
}

/// This agent's Lease, and the others'.
pub struct Members {
    api: Api<Lease>,
    roster: Roster,
    name: String,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Members {
    /// Starts renewing this node's Lease and watching the others'; each new
    /// peer list (sorted, this node left out) goes to `on_peers`, the first
    /// once the Leases have been listed.
    pub fn start(
        roster: Roster,
        client: Client,
        namespace: &str,
        node: &str,
        addr: SocketAddr,
        on_peers: impl Fn(Vec<SocketAddr>) + Send + Sync + 'static,
    ) -> Self {
        let api: Api<Lease> = Api::namespaced(client, namespace);
        let name = roster.lease_name(node);
        info!(lease = %name, %namespace, %addr, "{}: peers from the agents' Leases", roster.what);
        let renew = tokio::spawn(renew(
            roster,
            api.clone(),
            name.clone(),
            node.to_string(),
            addr,
        ));
        let watch = tokio::spawn(watch_peers(
            roster,
            api.clone(),
            name.clone(),
            Arc::new(on_peers),
        ));
        Members {
            api,
            roster,
            name,
            tasks: vec![renew, watch],
        }
    }

    /// Stops renewing and deletes this node's Lease (a graceful stop), so
    /// the others stop counting it at once.
    pub async fn leave(self) {
        for t in &self.tasks {
            t.abort();
        }
        match self.api.delete(&self.name, &DeleteParams::default()).await {
            Ok(_) => info!(lease = %self.name, "{} Lease deleted", self.roster.what),
            Err(e) => warn!(lease = %self.name, "deleting the {} Lease: {e}", self.roster.what),
        }
    }
}

impl Drop for Members {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The Lease as this node writes it (server-side apply: created if missing).
fn lease_object(
    roster: Roster,
    name: &str,
    node: &str,
    addr: SocketAddr,
    now: Timestamp,
) -> serde_json::Value {
    json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "labels": { roster.label: "true" },
            "annotations": { roster.annotation: addr.to_string() },
        },
        "spec": {
            "holderIdentity": node,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": MicroTime(now),
        },
    })
}

async fn renew(roster: Roster, api: Api<Lease>, name: String, node: String, addr: SocketAddr) {
    let every = Duration::from_secs(LEASE_SECONDS as u64 / 3);
    let params = PatchParams::apply(roster.prefix).force();
    let mut failing = false;
    loop {
        let lease = lease_object(roster, &name, &node, addr, Timestamp::now());
        match api.patch(&name, &params, &Patch::Apply(&lease)).await {
            Ok(_) if failing => {
                info!(lease = %name, "{} Lease renewed again", roster.what);
                failing = false;
            }
            Ok(_) => debug!(lease = %name, "{} Lease renewed", roster.what),
            Err(e) if !failing => {
                warn!(lease = %name, "renewing the {} Lease: {e}", roster.what);
                failing = true;
            }
            Err(_) => {}
        }
        tokio::time::sleep(if failing { every / 5 } else { every }).await;
    }
}

async fn watch_peers(
    roster: Roster,
    api: Api<Lease>,
    own: String,
    on_peers: Arc<dyn Fn(Vec<SocketAddr>) + Send + Sync>,
) {
    let (store, writer) = reflector::store::<Lease>();
    let changed = Arc::new(Notify::new());
    let config = watcher::Config::default().labels(&format!("{}=true", roster.label));
    drive(
        roster.prefix,
        watcher(api, config)
            .backoff(QuickRetry::default())
            .reflect(writer),
        changed.clone(),
    );
    if store.wait_until_ready().await.is_err() {
        return;
    }
    let mut last: Option<Vec<SocketAddr>> = None;
    loop {
        let leases: Vec<Arc<Lease>> = store.state();
        let peers = fresh_peers(
            roster,
            leases.iter().map(Arc::as_ref),
            &own,
            Timestamp::now(),
        );
        if last.as_ref() != Some(&peers) {
            on_peers(peers.clone());
            last = Some(peers);
        }
        // Staleness comes with time, not with events: look again every second.
        let _ = tokio::time::timeout(Duration::from_secs(1), changed.notified()).await;
    }
}

/// The membership addresses of the Leases other than `own` that are
/// fresh at `now`, sorted. A Lease without a readable address is skipped.
pub fn fresh_peers<'a>(
    roster: Roster,
    leases: impl Iterator<Item = &'a Lease>,
    own: &str,
    now: Timestamp,
) -> Vec<SocketAddr> {
    let mut by_addr: BTreeMap<SocketAddr, ()> = BTreeMap::new();
    for lease in leases {
        if lease.metadata.name.as_deref() == Some(own) {
            continue;
        }
        let Some(spec) = &lease.spec else { continue };
        let (Some(renewed), Some(secs)) = (&spec.renew_time, spec.lease_duration_seconds) else {
            continue;
        };
        if renewed.0 + SignedDuration::from_secs(secs as i64) < now {
            continue;
        }
        let addr = lease
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(roster.annotation))
            .and_then(|a| a.parse::<SocketAddr>().ok());
        if let Some(addr) = addr {
            by_addr.insert(addr, ());
        }
    }
    by_addr.into_keys().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(name: &str, addr: &str, renewed: Timestamp) -> Lease {
        serde_json::from_value(json!({
            "metadata": {
                "name": name,
                "annotations": { L2.annotation: addr },
            },
            "spec": {
                "holderIdentity": name,
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": MicroTime(renewed),
            },
        }))
        .unwrap()
    }

    #[test]
    fn peers_are_the_other_fresh_leases_with_an_address() {
        let now = Timestamp::now();
        let old = now - SignedDuration::from_secs(LEASE_SECONDS + 1);
        let leases = [
            lease("xlb-l2-a", "10.0.0.11:7946", now),
            lease("xlb-l2-b", "10.0.0.12:7946", now),
            lease("xlb-l2-c", "10.0.0.13:7946", old),
            lease("xlb-l2-d", "not an address", now),
            lease(
                "xlb-l2-e",
                "10.0.0.10:7946",
                now - SignedDuration::from_secs(3),
            ),
        ];
        assert_eq!(
            fresh_peers(L2, leases.iter(), "xlb-l2-a", now),
            vec![
                "10.0.0.10:7946".parse::<SocketAddr>().unwrap(),
                "10.0.0.12:7946".parse().unwrap()
            ]
        );
    }

    #[test]
    fn the_lease_names_its_address_and_is_selected_by_its_label() {
        let now = Timestamp::now();
        let v = lease_object(L2, "xlb-l2-a", "a", "10.0.0.11:7946".parse().unwrap(), now);
        let l: Lease = serde_json::from_value(v).unwrap();
        assert_eq!(l.metadata.labels.as_ref().unwrap()[L2.label], "true");
        assert_eq!(
            fresh_peers(L2, std::iter::once(&l), "other", now),
            vec!["10.0.0.11:7946".parse::<SocketAddr>().unwrap()]
        );
        // The other roster's Leases name their address elsewhere.
        assert!(fresh_peers(FLOW_SYNC, std::iter::once(&l), "other", now).is_empty());
    }
}
