//! The test API server against the real kube-rs client: what xlb's
//! Kubernetes tests rely on it to do like a real API server.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::{
    LoadBalancerIngress, LoadBalancerStatus, Service, ServicePort, ServiceSpec, ServiceStatus,
};
use kube::api::{
    Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, WatchEvent,
    WatchParams,
};
use kube::runtime::{reflector, watcher, WatchStreamExt};
use kube::ResourceExt;
use lb_agent::k8s::crd::{LoadBalancerPool, LoadBalancerPoolSpec, LoadBalancerPoolStatus};
use serde_json::{json, Value};
use xlb_tests::apiserver::{Fault, ServerOptions, TestApiServer};

const DEADLINE: Duration = Duration::from_secs(10);

fn service(name: &str, labels: &[(&str, &str)]) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            ),
            ..Default::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("LoadBalancer".into()),
            ports: Some(vec![ServicePort {
                port: 80,
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn ingress_status(ip: &str) -> ServiceStatus {
    ServiceStatus {
        load_balancer: Some(LoadBalancerStatus {
            ingress: Some(vec![LoadBalancerIngress {
                ip: Some(ip.into()),
                ..Default::default()
            }]),
        }),
        ..Default::default()
    }
}

fn api_code(err: kube::Error) -> (u16, String) {
    match err {
        kube::Error::Api(status) => (status.code, status.reason),
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn rv(object: &impl kube::Resource) -> u64 {
    object.resource_version().unwrap().parse().unwrap()
}

#[tokio::test]
async fn crud_round_trip_with_server_set_metadata() {
    let server = TestApiServer::start().await;
    let api: Api<Service> = Api::namespaced(server.client(), "default");

    let created = api
        .create(&PostParams::default(), &service("web", &[("app", "web")]))
        .await
        .unwrap();
    assert!(created.uid().is_some_and(|u| u.len() == 36));
    assert!(created.creation_timestamp().is_some());
    assert_eq!(created.metadata.generation, Some(1));
    assert_eq!(rv(&created), server.resource_version());
    // Defaults and allocations the real server makes.
    let spec = created.spec.as_ref().unwrap();
    let port = &spec.ports.as_ref().unwrap()[0];
    assert_eq!(port.protocol.as_deref(), Some("TCP"));
    assert!(port.node_port.is_some_and(|p| p >= 30000));
    assert!(spec
        .cluster_ip
        .as_deref()
        .is_some_and(|ip| ip.starts_with("10.96.")));
    assert_eq!(created.status, Some(ingress_status_empty()));

    let fetched = api.get("web").await.unwrap();
    assert_eq!(fetched, created);
    let list = api.list(&ListParams::default()).await.unwrap();
    assert_eq!(list.items, vec![created.clone()]);
    assert_eq!(
        list.metadata.resource_version.as_deref(),
        Some(server.resource_version().to_string().as_str())
    );

    let mut changed = fetched.clone();
    changed.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 8080;
    let replaced = api
        .replace("web", &PostParams::default(), &changed)
        .await
        .unwrap();
    assert_eq!(replaced.metadata.generation, Some(2));
    assert!(rv(&replaced) > rv(&created));
    assert_eq!(replaced.uid(), created.uid());

    let patched = api
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"tier": "front"}}})),
        )
        .await
        .unwrap();
    assert_eq!(
        patched.labels().get("tier").map(String::as_str),
        Some("front")
    );
    assert_eq!(patched.labels().get("app").map(String::as_str), Some("web"));
    // A label change is not a spec change.
    assert_eq!(patched.metadata.generation, Some(2));

    // kube is built without its jsonpatch feature: send an RFC 6902 patch by hand.
    let request = hyper::http::Request::patch("/api/v1/namespaces/default/services/web")
        .header("content-type", "application/json-patch+json")
        .body(
            json!([
                {"op": "replace", "path": "/spec/ports/0/port", "value": 9090},
                {"op": "remove", "path": "/metadata/labels/tier"},
            ])
            .to_string()
            .into_bytes(),
        )
        .unwrap();
    let patched: Service = server.client().request(request).await.unwrap();
    assert_eq!(
        patched.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port,
        9090
    );
    assert!(!patched.labels().contains_key("tier"));

    // Writing the same object again is a no-op: no new resourceVersion.
    let before = server.resource_version();
    let same = api.get("web").await.unwrap();
    let again = api
        .replace("web", &PostParams::default(), &same)
        .await
        .unwrap();
    assert_eq!(rv(&again), before);
    assert_eq!(server.resource_version(), before);

    let deleted = api.delete("web", &DeleteParams::default()).await.unwrap();
    let deleted = deleted.left().expect("delete returns the object");
    assert_eq!(deleted.name_any(), "web");
    assert_eq!(api_code(api.get("web").await.unwrap_err()).0, 404);
    assert!(server.get::<Service>(Some("default"), "web").is_none());
    let (code, reason) = api_code(
        api.delete("web", &DeleteParams::default())
            .await
            .unwrap_err(),
    );
    assert_eq!((code, reason.as_str()), (404, "NotFound"));
}

fn ingress_status_empty() -> ServiceStatus {
    ServiceStatus {
        load_balancer: Some(LoadBalancerStatus::default()),
        ..Default::default()
    }
}

#[tokio::test]
async fn conflicts_on_existing_names_and_stale_versions() {
    let server = TestApiServer::start().await;
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    let first = api
        .create(&PostParams::default(), &service("web", &[]))
        .await
        .unwrap();
    let err = api
        .create(&PostParams::default(), &service("web", &[]))
        .await
        .unwrap_err();
    assert_eq!(api_code(err), (409, "AlreadyExists".into()));

    let mut newer = first.clone();
    newer.metadata.labels = Some(BTreeMap::from([("v".into(), "2".into())]));
    api.replace("web", &PostParams::default(), &newer)
        .await
        .unwrap();
    // `first` carries the old resourceVersion now.
    let mut stale = first.clone();
    stale.metadata.labels = Some(BTreeMap::from([("v".into(), "3".into())]));
    let err = api
        .replace("web", &PostParams::default(), &stale)
        .await
        .unwrap_err();
    assert_eq!(api_code(err), (409, "Conflict".into()));
    // A stale resourceVersion in a patch is a precondition too.
    let err = api
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"resourceVersion": first.resource_version(), "labels": {"v": "4"}}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(err).0, 409);
    assert_eq!(
        server
            .get::<Service>(Some("default"), "web")
            .unwrap()
            .labels()["v"],
        "2"
    );

    // Creating with a resourceVersion, bad names and name mismatches are refused.
    let err = api
        .create(&PostParams::default(), &first)
        .await
        .unwrap_err();
    assert_eq!(api_code(err).0, 500);
    let err = api
        .create(&PostParams::default(), &service("Bad_Name", &[]))
        .await
        .unwrap_err();
    assert_eq!(api_code(err), (422, "Invalid".into()));
    let err = api
        .replace("other", &PostParams::default(), &newer)
        .await
        .unwrap_err();
    assert_eq!(api_code(err).0, 400);

    // Custom resources require a resourceVersion on update.
    let pools: Api<LoadBalancerPool> = Api::all(server.client());
    let mut pool = pools
        .create(&PostParams::default(), &pool("public", &["192.0.2.0/24"]))
        .await
        .unwrap();
    pool.metadata.resource_version = None;
    let err = pools
        .replace("public", &PostParams::default(), &pool)
        .await
        .unwrap_err();
    assert_eq!(api_code(err), (422, "Invalid".into()));
}

fn pool(name: &str, addresses: &[&str]) -> LoadBalancerPool {
    LoadBalancerPool::new(
        name,
        LoadBalancerPoolSpec {
            addresses: addresses.iter().map(|a| a.to_string()).collect(),
            avoid_buggy_ips: false,
            auto_assign: true,
        },
    )
}

#[tokio::test]
async fn status_subresource_is_isolated() {
    let server = TestApiServer::start().await;
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    let mut with_status = service("web", &[]);
    with_status.status = Some(ingress_status("192.0.2.1"));
    let created = api
        .create(&PostParams::default(), &with_status)
        .await
        .unwrap();
    assert_eq!(
        created.status,
        Some(ingress_status_empty()),
        "create drops status"
    );

    // PUT to the object: spec changes, status does not.
    let mut change = created.clone();
    change.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 81;
    change.status = Some(ingress_status("192.0.2.2"));
    let replaced = api
        .replace("web", &PostParams::default(), &change)
        .await
        .unwrap();
    assert_eq!(
        replaced.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port,
        81
    );
    assert_eq!(replaced.status, Some(ingress_status_empty()));

    // PATCH to /status: status changes, spec does not, generation stays.
    let patched = api
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({
                "spec": {"ports": [{"port": 99}]},
                "status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.3"}]}},
            })),
        )
        .await
        .unwrap();
    assert_eq!(patched.status, Some(ingress_status("192.0.2.3")));
    assert_eq!(
        patched.spec.as_ref().unwrap().ports.as_ref().unwrap()[0].port,
        81
    );
    assert_eq!(patched.metadata.generation, replaced.metadata.generation);

    // PUT to /status with the fresh object.
    let mut fresh = api.get("web").await.unwrap();
    fresh.status = Some(ingress_status("192.0.2.4"));
    fresh.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].port = 1;
    let replaced = api
        .replace_status("web", &PostParams::default(), &fresh)
        .await
        .unwrap();
    assert_eq!(replaced.status, Some(ingress_status("192.0.2.4")));
    assert_eq!(replaced.spec.unwrap().ports.unwrap()[0].port, 81);

    // The agent's kind of write shows in the request log.
    let status_patch = server
        .requests()
        .into_iter()
        .find(|r| r.verb == "patch" && r.path.ends_with("/services/web/status"))
        .unwrap();
    assert_eq!(
        status_patch.content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    assert_eq!(
        status_patch.body.unwrap()["status"]["loadBalancer"]["ingress"][0]["ip"],
        "192.0.2.3"
    );

    // Resources without a status subresource have no /status path.
    let leases: Api<Lease> = Api::namespaced(server.client(), "default");
    leases
        .create(&PostParams::default(), &lease("l", "a"))
        .await
        .unwrap();
    let err = leases
        .patch_status("l", &PatchParams::default(), &Patch::Merge(json!({})))
        .await
        .unwrap_err();
    assert_eq!(api_code(err).0, 404);
}

#[tokio::test]
async fn label_and_field_selectors() {
    let server = TestApiServer::start().await;
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    for (name, labels) in [
        ("a", vec![("app", "web"), ("tier", "front")]),
        ("b", vec![("app", "web")]),
        ("c", vec![("app", "db")]),
    ] {
        server.create(&service(name, &labels)).unwrap();
    }
    let mut other_ns = service("a", &[("app", "web")]);
    other_ns.metadata.namespace = Some("other".into());
    server.create(&other_ns).unwrap();

    let names = |list: kube::core::ObjectList<Service>| {
        list.items
            .iter()
            .map(|s| format!("{}/{}", s.namespace().unwrap(), s.name_any()))
            .collect::<Vec<_>>()
    };
    for (selector, expected) in [
        ("app=web", vec!["default/a", "default/b"]),
        ("app==web,tier", vec!["default/a"]),
        ("app!=web", vec!["default/c"]),
        ("!tier", vec!["default/b", "default/c"]),
        ("app in (db,cache)", vec!["default/c"]),
        ("app notin (db)", vec!["default/a", "default/b"]),
    ] {
        let list = api
            .list(&ListParams::default().labels(selector))
            .await
            .unwrap();
        assert_eq!(names(list), expected, "{selector}");
    }
    let list = api
        .list(&ListParams::default().fields("metadata.name=b"))
        .await
        .unwrap();
    assert_eq!(names(list), ["default/b"]);
    let all: Api<Service> = Api::all(server.client());
    let list = all
        .list(&ListParams::default().fields("metadata.namespace!=default"))
        .await
        .unwrap();
    assert_eq!(names(list), ["other/a"]);
    let list = all
        .list(&ListParams::default().labels("app=web"))
        .await
        .unwrap();
    assert_eq!(names(list), ["default/a", "default/b", "other/a"]);

    let err = api
        .list(&ListParams::default().fields("spec.nonsense=1"))
        .await
        .unwrap_err();
    assert_eq!(api_code(err), (400, "BadRequest".into()));
    let err = api
        .list(&ListParams::default().labels("app in (web"))
        .await
        .unwrap_err();
    assert_eq!(api_code(err).0, 400);
}

#[tokio::test]
async fn paging_is_a_consistent_snapshot() {
    let server = TestApiServer::start().await;
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    for i in 0..7 {
        server.create(&service(&format!("s{i}"), &[])).unwrap();
    }
    let first = api.list(&ListParams::default().limit(3)).await.unwrap();
    assert_eq!(first.items.len(), 3);
    assert_eq!(first.metadata.remaining_item_count, Some(4));
    let token = first.metadata.continue_.clone().unwrap();
    // Changes after the first page do not show in later pages.
    server.delete::<Service>(Some("default"), "s4").unwrap();
    server.create(&service("s9", &[])).unwrap();
    let second = api
        .list(&ListParams::default().limit(3).continue_token(&token))
        .await
        .unwrap();
    let third = api
        .list(
            &ListParams::default()
                .limit(3)
                .continue_token(second.metadata.continue_.as_deref().unwrap()),
        )
        .await
        .unwrap();
    assert!(third.metadata.continue_.is_none());
    let names: Vec<String> = [first.items, second.items, third.items]
        .concat()
        .iter()
        .map(|s| s.name_any())
        .collect();
    assert_eq!(names, ["s0", "s1", "s2", "s3", "s4", "s5", "s6"]);
    assert_eq!(
        second.metadata.resource_version,
        first.metadata.resource_version
    );

    // Once compacted, the token has expired.
    server.compact();
    let err = api
        .list(&ListParams::default().limit(3).continue_token(&token))
        .await
        .unwrap_err();
    assert_eq!(api_code(err), (410, "Expired".into()));
}

/// Waits for the next watcher event that is not an error.
async fn next_event<S>(stream: &mut S) -> watcher::Event<Service>
where
    S: futures::Stream<Item = Result<watcher::Event<Service>, watcher::Error>> + Unpin,
{
    loop {
        match tokio::time::timeout(DEADLINE, stream.next()).await {
            Ok(Some(Ok(event))) => return event,
            Ok(Some(Err(_))) => continue,
            Ok(None) => panic!("watcher ended"),
            Err(_) => panic!("no watcher event within {DEADLINE:?}"),
        }
    }
}

#[tokio::test]
async fn watcher_sees_added_modified_deleted() {
    let server = TestApiServer::start().await;
    server.create(&service("existing", &[])).unwrap();
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    let mut events = watcher(api.clone(), watcher::Config::default()).boxed();
    assert!(matches!(
        next_event(&mut events).await,
        watcher::Event::Init
    ));
    assert!(
        matches!(next_event(&mut events).await, watcher::Event::InitApply(s) if s.name_any() == "existing")
    );
    assert!(matches!(
        next_event(&mut events).await,
        watcher::Event::InitDone
    ));
    // The watch starts from the list's resourceVersion when the stream is
    // next polled, so nothing written from here on can be missed.

    // Writes over HTTP and through the store both reach the watcher.
    api.create(&PostParams::default(), &service("web", &[]))
        .await
        .unwrap();
    match next_event(&mut events).await {
        watcher::Event::Apply(s) => assert_eq!(s.name_any(), "web"),
        other => panic!("expected Apply(web), got {other:?}"),
    }
    server
        .patch_status::<Service>(
            Some("default"),
            "web",
            &json!({"status": {"loadBalancer": {"ingress": [{"ip": "192.0.2.9"}]}}}),
        )
        .unwrap();
    match next_event(&mut events).await {
        watcher::Event::Apply(s) => assert_eq!(s.status, Some(ingress_status("192.0.2.9"))),
        other => panic!("expected Apply with status, got {other:?}"),
    }
    server
        .delete::<Service>(Some("default"), "existing")
        .unwrap();
    match next_event(&mut events).await {
        watcher::Event::Delete(s) => {
            assert_eq!(s.name_any(), "existing");
            assert_eq!(rv(&s), server.resource_version());
        }
        other => panic!("expected Delete(existing), got {other:?}"),
    }
    // The watcher listed first, then watched from the list's resourceVersion.
    let requests = server.requests();
    let list = requests.iter().find(|r| r.verb == "list").unwrap();
    let watch = requests.iter().find(|r| r.verb == "watch").unwrap();
    assert_eq!(watch.param("allowWatchBookmarks").as_deref(), Some("true"));
    assert!(watch.param("resourceVersion").is_some());
    assert!(list.param("limit").is_some());
}

#[tokio::test]
async fn streaming_list_watcher_gets_initial_events_then_changes() {
    let server = TestApiServer::start().await;
    server.create(&service("a", &[])).unwrap();
    server.create(&service("b", &[])).unwrap();
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    let config = watcher::Config::default().streaming_lists();
    let mut events = watcher(api, config).boxed();
    assert!(matches!(
        next_event(&mut events).await,
        watcher::Event::Init
    ));
    let mut initial = Vec::new();
    loop {
        match next_event(&mut events).await {
            watcher::Event::InitApply(s) => initial.push(s.name_any()),
            watcher::Event::InitDone => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(initial, ["a", "b"]);
    server.create(&service("c", &[])).unwrap();
    assert!(
        matches!(next_event(&mut events).await, watcher::Event::Apply(s) if s.name_any() == "c")
    );
    let watch = server
        .requests()
        .into_iter()
        .find(|r| r.verb == "watch")
        .unwrap();
    assert_eq!(watch.param("sendInitialEvents").as_deref(), Some("true"));
    assert!(!server.requests().iter().any(|r| r.verb == "list"));
}

#[tokio::test]
async fn watch_replays_history_and_selectors_move_objects() {
    let server = TestApiServer::start().await;
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    let start = server.resource_version().to_string();
    server.create(&service("a", &[("app", "web")])).unwrap();
    server
        .patch::<Service>(
            Some("default"),
            "a",
            &json!({"metadata": {"labels": {"app": "db"}}}),
        )
        .unwrap();
    server
        .patch::<Service>(
            Some("default"),
            "a",
            &json!({"metadata": {"labels": {"app": "web"}}}),
        )
        .unwrap();
    let stream = api
        .watch(&WatchParams::default().labels("app=web").timeout(1), &start)
        .await
        .unwrap();
    let events: Vec<WatchEvent<Service>> = stream.try_collect().await.unwrap();
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| match e {
            WatchEvent::Added(_) => "ADDED",
            WatchEvent::Modified(_) => "MODIFIED",
            WatchEvent::Deleted(_) => "DELETED",
            WatchEvent::Bookmark(_) => "BOOKMARK",
            WatchEvent::Error(_) => "ERROR",
        })
        .collect();
    // Leaving the selector is a DELETED, coming back an ADDED; the
    // watch ends at timeoutSeconds with a bookmark.
    let (changes, bookmarks) = kinds.split_at(3);
    assert_eq!(changes, ["ADDED", "DELETED", "ADDED"]);
    assert!(!bookmarks.is_empty() && bookmarks.iter().all(|k| *k == "BOOKMARK"));

    // Without a resourceVersion, existing objects come as ADDED first.
    let stream = api
        .watch(&WatchParams::default().timeout(1).disable_bookmarks(), "0")
        .await
        .unwrap();
    let events: Vec<WatchEvent<Service>> = stream.try_collect().await.unwrap();
    assert!(matches!(&events[..], [WatchEvent::Added(s)] if s.name_any() == "a"));
}

#[tokio::test]
async fn bookmarks_carry_the_current_resource_version() {
    let server = TestApiServer::start_with(ServerOptions {
        bookmark_interval: Duration::from_millis(100),
        ..Default::default()
    })
    .await;
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    let start = server.resource_version().to_string();
    let mut stream = api
        .watch(&WatchParams::default(), &start)
        .await
        .unwrap()
        .boxed();
    // A change elsewhere moves the resourceVersion the bookmark reports.
    let leases: Api<Lease> = Api::namespaced(server.client(), "default");
    leases
        .create(&PostParams::default(), &lease("l", "a"))
        .await
        .unwrap();
    let wanted = server.resource_version().to_string();
    loop {
        let event = tokio::time::timeout(DEADLINE, stream.try_next())
            .await
            .expect("a bookmark in time")
            .unwrap()
            .expect("the watch stays open");
        match event {
            WatchEvent::Bookmark(b) if b.metadata.resource_version == wanted => break,
            WatchEvent::Bookmark(_) => continue,
            other => panic!("unexpected {other:?}"),
        }
    }
}

#[tokio::test]
async fn compaction_makes_watchers_relist_and_converge() {
    let server = TestApiServer::start().await;
    for i in 0..3 {
        server.create(&service(&format!("s{i}"), &[])).unwrap();
    }
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    let (reader, writer) = reflector::store();
    let mut events = reflector(writer, watcher(api, watcher::Config::default()))
        .default_backoff()
        .boxed();
    let drive = tokio::spawn(async move { while events.next().await.is_some() {} });
    let names = |reader: &reflector::Store<Service>| {
        let mut n: Vec<String> = reader.state().iter().map(|s| s.name_any()).collect();
        n.sort();
        n
    };
    reader.wait_until_ready().await.unwrap();
    server
        .wait_for(DEADLINE, |s| (s.open_watches() == 1).then_some(()))
        .await
        .expect("the watcher watches");
    server.clear_requests();

    // While the watch is cut off, things change and the history goes.
    server.compact();
    server.drop_watches();
    server.delete::<Service>(Some("default"), "s0").unwrap();
    server.create(&service("s7", &[])).unwrap();
    server.compact();

    server
        .wait_for(DEADLINE, |s| {
            let expired = s.requests().iter().any(|r| r.watch_error == Some(410));
            let relisted = s.requests().iter().any(|r| r.verb == "list");
            (expired && relisted).then_some(())
        })
        .await
        .expect("a 410 on the resumed watch, then a new list");
    let expected: Vec<String> = server
        .list::<Service>(Some("default"))
        .iter()
        .map(|s| s.name_any())
        .collect();
    assert_eq!(expected, ["s1", "s2", "s7"]);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while names(&reader) != expected {
        assert!(
            tokio::time::Instant::now() < deadline,
            "reflector: {:?}",
            names(&reader)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let expired = server
        .requests()
        .into_iter()
        .find(|r| r.watch_error == Some(410))
        .unwrap();
    assert_eq!(expired.status, 200);
    drive.abort();
}

#[tokio::test]
async fn injected_failures_reach_the_client() {
    let server = TestApiServer::start().await;
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    server.create(&service("web", &[])).unwrap();

    server.fail_next(1, 500);
    assert_eq!(
        api_code(api.get("web").await.unwrap_err()),
        (500, "InternalError".into())
    );
    api.get("web").await.expect("only one request failed");

    server.inject(Fault::new(409).method("PATCH").path_contains("/status"));
    api.get("web").await.expect("a GET does not match the rule");
    let err = api
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(err), (409, "Conflict".into()));
    assert!(server.pending_faults().is_empty());

    // Rules can target a Kubernetes verb: a list fails, a get does not.
    server.inject(Fault::new(500).verb("list"));
    api.get("web").await.expect("a get is not a list");
    let err = api.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(api_code(err).0, 500);

    // kube-rs retries 503 by itself: two failures, then success.
    server.clear_requests();
    server.fail_next(2, 503);
    api.get("web").await.expect("retried past the 503s");
    let codes: Vec<(u16, bool)> = server
        .requests()
        .iter()
        .map(|r| (r.status, r.injected))
        .collect();
    assert_eq!(codes, [(503, true), (503, true), (200, false)]);

    // Without the client's retries, a 429 arrives with its Retry-After.
    let mut config = server.client_config();
    config.default_retry = false;
    let no_retry: Api<Service> =
        Api::namespaced(kube::Client::try_from(config).unwrap(), "default");
    server.inject(Fault::new(429).retry_after(7));
    match no_retry.get("web").await.unwrap_err() {
        kube::Error::Api(status) => {
            assert_eq!(
                (status.code, status.reason.as_str()),
                (429, "TooManyRequests")
            );
            assert_eq!(status.details.unwrap().retry_after_seconds, 7);
        }
        other => panic!("expected a 429, got {other:?}"),
    }
}

#[tokio::test]
async fn outage_fails_requests_and_watchers_recover() {
    let server = TestApiServer::start().await;
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    let (reader, writer) = reflector::store();
    let mut events = reflector(writer, watcher(api.clone(), watcher::Config::default()))
        .default_backoff()
        .boxed();
    let drive = tokio::spawn(async move { while events.next().await.is_some() {} });
    reader.wait_until_ready().await.unwrap();

    server.set_down(true);
    assert!(server.is_down());
    match api.get("web").await.unwrap_err() {
        kube::Error::Api(status) => panic!("expected a connection error, got {status:?}"),
        _connection_error => {}
    }
    assert!(
        std::net::TcpStream::connect(server.addr()).is_err(),
        "port is closed"
    );
    server.create(&service("web", &[])).unwrap();

    server.set_down(false);
    api.get("web")
        .await
        .expect("the server is back with its store");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while reader
        .get(&reflector::ObjectRef::new("web").within("default"))
        .is_none()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the watcher did not recover"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drive.abort();
}

fn lease(name: &str, holder: &str) -> Lease {
    Lease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("default".into()),
            ..Default::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(holder.into()),
            lease_duration_seconds: Some(15),
            ..Default::default()
        }),
    }
}

#[tokio::test]
async fn leases_take_over_only_from_the_latest_version() {
    let server = TestApiServer::start().await;
    let api: Api<Lease> = Api::namespaced(server.client(), "default");
    let mine = api
        .create(&PostParams::default(), &lease("xlb", "node-a"))
        .await
        .unwrap();
    let err = api
        .create(&PostParams::default(), &lease("xlb", "node-b"))
        .await
        .unwrap_err();
    assert_eq!(api_code(err).0, 409);

    // node-b read the lease, then node-a renewed it: node-b's takeover loses.
    let seen_by_b = api.get("xlb").await.unwrap();
    let mut renewed = mine.clone();
    renewed.spec.as_mut().unwrap().lease_transitions = Some(0);
    api.replace("xlb", &PostParams::default(), &renewed)
        .await
        .unwrap();
    let mut takeover = seen_by_b.clone();
    takeover.spec.as_mut().unwrap().holder_identity = Some("node-b".into());
    let err = api
        .replace("xlb", &PostParams::default(), &takeover)
        .await
        .unwrap_err();
    assert_eq!(api_code(err), (409, "Conflict".into()));
    let mut takeover = api.get("xlb").await.unwrap();
    takeover.spec.as_mut().unwrap().holder_identity = Some("node-b".into());
    let taken = api
        .replace("xlb", &PostParams::default(), &takeover)
        .await
        .unwrap();
    assert_eq!(
        taken.spec.unwrap().holder_identity.as_deref(),
        Some("node-b")
    );

    // PUT to a missing Lease creates it, as for the real server.
    let created = api
        .replace("other", &PostParams::default(), &lease("other", "node-c"))
        .await
        .unwrap();
    assert!(created.uid().is_some());
    assert_eq!(
        server.requests().last().map(|r| (r.verb, r.status)),
        Some(("update", 201))
    );
}

#[tokio::test]
async fn finalizers_hold_deletion_until_removed() {
    let server = TestApiServer::start().await;
    let api: Api<Service> = Api::namespaced(server.client(), "default");
    let mut svc = service("web", &[]);
    svc.metadata.finalizers = Some(vec!["xlb.dev/release".into()]);
    api.create(&PostParams::default(), &svc).await.unwrap();
    let start = server.resource_version().to_string();

    let marked = api
        .delete("web", &DeleteParams::default())
        .await
        .unwrap()
        .left()
        .unwrap();
    assert!(marked.metadata.deletion_timestamp.is_some());
    assert!(api.get("web").await.is_ok(), "still there while finalized");
    let err = api
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": ["xlb.dev/release", "other"]}})),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(err).0, 422, "no new finalizers while deleting");
    api.patch(
        "web",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .unwrap();
    assert_eq!(api_code(api.get("web").await.unwrap_err()).0, 404);

    let events: Vec<WatchEvent<Service>> = api
        .watch(
            &WatchParams::default().timeout(1).disable_bookmarks(),
            &start,
        )
        .await
        .unwrap()
        .try_collect()
        .await
        .unwrap();
    assert!(matches!(
        &events[..],
        [WatchEvent::Modified(m), WatchEvent::Deleted(d)]
            if m.metadata.deletion_timestamp.is_some() && d.metadata.finalizers.is_none()
    ));
}

#[tokio::test]
async fn apply_creates_then_merges_and_needs_a_field_manager() {
    let server = TestApiServer::start().await;
    let pools: Api<LoadBalancerPool> = Api::all(server.client());
    let params = PatchParams::apply("xlb-test").force();
    let created = pools
        .patch(
            "public",
            &params,
            &Patch::Apply(pool("public", &["192.0.2.0/24"])),
        )
        .await
        .unwrap();
    assert_eq!(created.metadata.generation, Some(1));
    let updated = pools
        .patch(
            "public",
            &params,
            &Patch::Apply(pool("public", &["198.51.100.0/24"])),
        )
        .await
        .unwrap();
    assert_eq!(updated.spec.addresses, ["198.51.100.0/24"]);
    assert_eq!(updated.metadata.generation, Some(2));
    assert_eq!(updated.uid(), created.uid());
    let err = pools
        .patch(
            "public",
            &PatchParams::default(),
            &Patch::Apply(pool("public", &[])),
        )
        .await
        .unwrap_err();
    assert_eq!(api_code(err).0, 422);

    // The status subresource of a cluster-scoped custom resource.
    let status = LoadBalancerPoolStatus {
        size: 256,
        in_use: 1,
        error: None,
    };
    let patched = pools
        .patch_status(
            "public",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": status})),
        )
        .await
        .unwrap();
    assert_eq!(patched.status, Some(status));
    let listed = pools.list(&ListParams::default()).await.unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.items[0].spec, patched.spec);
    assert_eq!(listed.items[0].status, patched.status);
    assert_eq!(listed.items[0].metadata, patched.metadata);
}

#[tokio::test]
async fn unknown_paths_and_missing_tokens_are_refused() {
    let server = TestApiServer::start().await;
    let client = server.client();
    let request = hyper::http::Request::get("/apis/example.com/v1/widgets")
        .body(Vec::new())
        .unwrap();
    let err = client.request::<Value>(request).await.unwrap_err();
    assert_eq!(api_code(err), (404, "NotFound".into()));
    let version = client.apiserver_version().await.unwrap();
    assert_eq!(
        (version.major.as_str(), version.minor.as_str()),
        ("1", "33")
    );

    let mut config = server.client_config();
    config.auth_info = Default::default();
    let anonymous: Api<Service> = Api::all(kube::Client::try_from(config).unwrap());
    let err = anonymous.list(&ListParams::default()).await.unwrap_err();
    assert_eq!(api_code(err), (401, "Unauthorized".into()));
}

#[tokio::test]
async fn kubeconfig_file_works_for_kube_clients() {
    let server = TestApiServer::start().await;
    server.create(&service("web", &[])).unwrap();
    let path = std::env::temp_dir().join(format!("xlb-apiserver-test-{}.yaml", std::process::id()));
    server.write_kubeconfig(&path).unwrap();
    let kubeconfig = kube::config::Kubeconfig::read_from(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
        .await
        .unwrap();
    let client = kube::Client::try_from(config).unwrap();
    let api: Api<Service> = Api::default_namespaced(client);
    assert_eq!(api.get("web").await.unwrap().name_any(), "web");
}

/// Many e2e tests are synchronous: the server runs on its own thread.
#[test]
fn works_from_synchronous_tests() {
    let server = TestApiServer::start_blocking();
    let created = server.create(&lease("l", "a")).unwrap();
    assert_eq!(server.list::<Lease>(Some("default")), vec![created]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let names = runtime.block_on(async {
        let api: Api<Lease> = Api::default_namespaced(server.client());
        api.list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .map(|l| l.name_any())
            .collect::<Vec<_>>()
    });
    assert_eq!(names, ["l"]);
    let found = server.wait_for_blocking(DEADLINE, |s| {
        s.requests().iter().any(|r| r.verb == "list").then_some(())
    });
    assert!(found.is_some());
}
