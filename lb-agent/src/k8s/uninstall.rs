//! Whether a SIGTERM means the chart is being uninstalled (detach XDP and
//! remove the pins) or the agent is only restarting (rollout, node drain,
//! crash restart: the pins stay for the next agent, by design).
//!
//! The agent's Pod names its DaemonSet (controller ownerReference, with
//! uid); read at start, since at SIGTERM the chart's RBAC may be gone:
//! `helm uninstall` deletes the DaemonSet, then at once the RoleBinding,
//! Role and ServiceAccount, while the garbage collector deletes the Pods
//! only after the DaemonSet is gone. So the DaemonSet is watched while the
//! agent runs (a watch opened before keeps delivering after its permission
//! goes), and read again at SIGTERM when the API still answers.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Pod};
use kube::{
    runtime::{watcher, WatchStreamExt},
    Api, Client,
};
use tokio::sync::watch;
use tracing::{debug, info, warn};

use super::api_health::QuickRetry;

/// What runs this agent, as its Pod says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Owner {
    /// Not read yet (the API did not answer, or the Pod is not readable).
    Unknown(String),
    /// The Pod has no DaemonSet as its controller (run some other way).
    NotADaemonSet,
    DaemonSet {
        name: String,
        uid: String,
    },
}

/// The DaemonSet of that name, as last seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Never read: no answer from the API yet.
    Unknown,
    Absent,
    Present {
        uid: String,
        deleting: bool,
    },
}

impl Seen {
    fn of(ds: &DaemonSet) -> Seen {
        Seen::Present {
            uid: ds.metadata.uid.clone().unwrap_or_default(),
            deleting: ds.metadata.deletion_timestamp.is_some(),
        }
    }
}

/// What a SIGTERM does with the data plane, and why (for the log).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Keep the pins: the next agent on this node adopts them.
    Keep(String),
    /// The release is gone: withdraw, drain, then detach and unpin.
    Uninstall(String),
}

/// The decision. In doubt, keep: pins left behind cost a `lb-agent
/// --cleanup`, pins removed under a running release cut every connection
/// through the node.
pub fn decide(owner: &Owner, seen: &Seen) -> Verdict {
    let (name, uid) = match owner {
        Owner::Unknown(why) => {
            return Verdict::Keep(format!(
                "this agent's Pod could not be read ({why}), so its DaemonSet is unknown"
            ))
        }
        Owner::NotADaemonSet => {
            return Verdict::Keep("this agent's Pod does not belong to a DaemonSet".into())
        }
        Owner::DaemonSet { name, uid } => (name, uid),
    };
    match seen {
        Seen::Unknown => Verdict::Keep(format!(
            "DaemonSet {name} could not be read: the API did not answer"
        )),
        Seen::Absent => Verdict::Uninstall(format!("DaemonSet {name} is gone")),
        Seen::Present { deleting: true, .. } => {
            Verdict::Uninstall(format!("DaemonSet {name} is being deleted"))
        }
        // `helm upgrade --force` or an uninstall followed by an install:
        // the new DaemonSet's Pod on this node adopts the pins.
        Seen::Present { uid: now, .. } if now != uid => Verdict::Keep(format!(
            "DaemonSet {name} was replaced by a new one (uid {now}), whose agent takes the pins over"
        )),
        Seen::Present { .. } => Verdict::Keep(format!(
            "DaemonSet {name} is still there (a rollout, a drain or a restart)"
        )),
    }
}

/// The controller ownerReference of kind DaemonSet, if any.
pub fn owner_of(pod: &Pod) -> Owner {
    pod.metadata
        .owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true) && r.kind == "DaemonSet")
        .map_or(Owner::NotADaemonSet, |r| Owner::DaemonSet {
            name: r.name.clone(),
            uid: r.uid.clone(),
        })
}

/// How long the read at SIGTERM may take before the watch's view is used.
const READ_TIMEOUT: Duration = Duration::from_secs(3);

/// Reads this agent's Pod, then watches its DaemonSet, until dropped.
pub struct OwnerWatch {
    client: Client,
    namespace: String,
    owner: watch::Receiver<Owner>,
    seen: watch::Receiver<Seen>,
    task: tokio::task::JoinHandle<()>,
}

impl OwnerWatch {
    /// For the Pod `namespace/pod` (`POD_NAMESPACE`, `POD_NAME` from the
    /// downward API). Call from within a tokio runtime.
    pub fn start(client: Client, namespace: &str, pod: &str) -> OwnerWatch {
        let (owner_tx, owner) = watch::channel(Owner::Unknown("not read yet".into()));
        let (seen_tx, seen) = watch::channel(Seen::Unknown);
        let task = tokio::spawn(run(
            client.clone(),
            namespace.to_string(),
            pod.to_string(),
            owner_tx,
            seen_tx,
        ));
        OwnerWatch {
            client,
            namespace: namespace.to_string(),
            owner,
            seen,
            task,
        }
    }

    /// The verdict now: the DaemonSet read afresh if the API answers in
    /// time, else as the watch last saw it.
    pub async fn verdict(&self) -> Verdict {
        let owner = self.owner.borrow().clone();
        let fresh = match &owner {
            Owner::DaemonSet { name, .. } => {
                let api = Api::<DaemonSet>::namespaced(self.client.clone(), &self.namespace);
                match tokio::time::timeout(READ_TIMEOUT, api.get_opt(name)).await {
                    Ok(Ok(Some(ds))) => Some(Seen::of(&ds)),
                    Ok(Ok(None)) => Some(Seen::Absent),
                    Ok(Err(e)) => {
                        info!(
                            "reading DaemonSet {name}: {}; deciding on what its watch saw",
                            short(&e)
                        );
                        None
                    }
                    Err(_) => {
                        info!("reading DaemonSet {name}: no answer within {READ_TIMEOUT:?}; deciding on what its watch saw");
                        None
                    }
                }
            }
            _ => None,
        };
        let seen = fresh.unwrap_or_else(|| self.seen.borrow().clone());
        decide(&owner, &seen)
    }
}

impl Drop for OwnerWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(
    client: Client,
    namespace: String,
    pod: String,
    owner_tx: watch::Sender<Owner>,
    seen_tx: watch::Sender<Seen>,
) {
    let pods = Api::<Pod>::namespaced(client.clone(), &namespace);
    let mut retry = QuickRetry::default();
    let owner = loop {
        match pods.get(&pod).await {
            Ok(p) => break owner_of(&p),
            Err(e) => {
                // Logged once at info: a chart without `get pods` keeps
                // failing, and the agent then keeps the pins on SIGTERM.
                if matches!(*owner_tx.borrow(), Owner::Unknown(ref w) if w == "not read yet") {
                    info!("reading this agent's Pod {namespace}/{pod}: {}; retrying (until then a SIGTERM keeps the pins)", short(&e));
                }
                owner_tx.send_replace(Owner::Unknown(short(&e)));
                tokio::time::sleep(retry.next().unwrap_or(Duration::from_secs(1))).await;
            }
        }
    };
    owner_tx.send_replace(owner.clone());
    let Owner::DaemonSet { name, uid } = owner else {
        info!("this agent's Pod belongs to no DaemonSet: a SIGTERM keeps the pins");
        return;
    };
    info!(daemonset = %name, %uid, "watching this agent's DaemonSet: a SIGTERM after it is deleted detaches XDP and removes the pins");
    let api = Api::<DaemonSet>::namespaced(client, &namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = watcher(api, config).backoff(QuickRetry::default()).boxed();
    // Objects listed since the last Init: the list is complete at InitDone.
    let mut listed = None;
    while let Some(event) = events.next().await {
        match event {
            Ok(watcher::Event::Init) => listed = Some(Seen::Absent),
            Ok(watcher::Event::InitApply(ds)) => listed = Some(Seen::of(&ds)),
            Ok(watcher::Event::InitDone) => {
                seen_tx.send_replace(listed.take().unwrap_or(Seen::Absent));
            }
            Ok(watcher::Event::Apply(ds)) => {
                seen_tx.send_replace(Seen::of(&ds));
            }
            Ok(watcher::Event::Delete(_)) => {
                seen_tx.send_replace(Seen::Absent);
            }
            // After an uninstall the re-lists fail (403, 401) and the last
            // view stays, which is what the SIGTERM needs.
            Err(e) => debug!("watching DaemonSet {name}: {e}"),
        }
    }
    warn!("the watch of DaemonSet {name} ended");
}

/// The API's message and code, without the whole Status.
fn short(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} ({})", s.message, s.code),
        e => e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ds_owner() -> Owner {
        Owner::DaemonSet {
            name: "xlb".into(),
            uid: "u1".into(),
        }
    }

    fn present(uid: &str, deleting: bool) -> Seen {
        Seen::Present {
            uid: uid.into(),
            deleting,
        }
    }

    fn uninstalls(owner: &Owner, seen: &Seen) -> bool {
        matches!(decide(owner, seen), Verdict::Uninstall(_))
    }

    #[test]
    fn only_a_deleted_daemonset_uninstalls() {
        assert!(uninstalls(&ds_owner(), &Seen::Absent));
        assert!(uninstalls(&ds_owner(), &present("u1", true)));
        // Foreground deletion of a replacement: both are going.
        assert!(uninstalls(&ds_owner(), &present("u2", true)));
        // Rollout, drain, crash restart: the DaemonSet stays.
        assert!(!uninstalls(&ds_owner(), &present("u1", false)));
        // Replaced (helm upgrade --force, install after uninstall): its
        // agent adopts the pins.
        assert!(!uninstalls(&ds_owner(), &present("u2", false)));
    }

    #[test]
    fn in_doubt_the_pins_stay() {
        assert!(!uninstalls(&ds_owner(), &Seen::Unknown));
        for seen in [Seen::Absent, Seen::Unknown, present("u1", true)] {
            assert!(!uninstalls(&Owner::Unknown("403".into()), &seen));
            assert!(!uninstalls(&Owner::NotADaemonSet, &seen));
        }
        let Verdict::Keep(why) =
            decide(&Owner::Unknown("connection refused".into()), &Seen::Absent)
        else {
            unreachable!()
        };
        assert!(why.contains("connection refused"), "{why}");
    }

    #[test]
    fn the_owner_is_the_controlling_daemonset() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "xlb-abcde", "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": "n1", "uid": "n"},
                {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "other", "uid": "o"},
                {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "xlb", "uid": "u1", "controller": true},
            ]}
        }))
        .unwrap();
        assert_eq!(owner_of(&pod), ds_owner());
        let bare: Pod =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}})).unwrap();
        assert_eq!(owner_of(&bare), Owner::NotADaemonSet);
    }
}
