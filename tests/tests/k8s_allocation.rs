//! The address allocator and the Lease election against the test API server
//! (real HTTP, the real kube-rs client): what the server ends up storing.

use std::net::IpAddr;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use lb_agent::k8s::allocator::{Allocator, AllocatorConfig};
use lb_agent::k8s::crd::LoadBalancerPool;
use lb_agent::k8s::leader::{Elector, LeaseConfig};
use lb_agent::metrics::Metrics;
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use xlb_tests::apiserver::{Fault, TestApiServer};

const CLASS: &str = "xlb.dev/xlb";
const LEASE_NS: &str = "xlb-system";
const LEASE_NAME: &str = "xlb-allocator";
const DEADLINE: Duration = Duration::from_secs(15);

/// One agent's allocation side: a Lease candidate and the allocator.
struct Agent {
    elector: Option<Elector>,
    task: JoinHandle<()>,
    metrics: Metrics,
}

impl Agent {
    fn start(server: &TestApiServer, identity: &str, lease: Duration) -> Agent {
        let client = server.client();
        let metrics = Metrics::new();
        let allocator = Allocator::new(
            client.clone(),
            AllocatorConfig {
                load_balancer_class: CLASS.into(),
                default_class: false,
                identity: identity.into(),
            },
            metrics.registry(),
        )
        .expect("metrics register");
        let elector = Elector::start(
            client,
            LeaseConfig::new(LEASE_NS, LEASE_NAME, identity, lease),
        );
        let task = tokio::spawn(allocator.run(elector.leading()));
        Agent {
            elector: Some(elector),
            task,
            metrics,
        }
    }

    fn leading(&self) -> watch::Receiver<bool> {
        self.elector.as_ref().unwrap().leading()
    }

    async fn wait_leading(&self, want: bool, within: Duration) {
        let mut rx = self.leading();
        tokio::time::timeout(within, rx.wait_for(|l| *l == want))
            .await
            .unwrap_or_else(|_| panic!("leading did not become {want} within {within:?}"))
            .expect("elector running");
    }

    /// A metric's value, if the agent reports the series.
    fn metric(&self, name: &str, label: &str, value: &str) -> Option<f64> {
        let prefix = format!("{name}{{{label}=\"{value}\"}} ");
        self.metrics
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(&prefix).map(|v| v.parse().unwrap()))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // As a crash: no step-down, the Lease expires.
        self.task.abort();
    }
}

fn pool(server: &TestApiServer, name: &str, addresses: &[&str]) {
    server
        .create_json(json!({
            "apiVersion": "xlb.dev/v1alpha1", "kind": "LoadBalancerPool",
            "metadata": {"name": name},
            "spec": {"addresses": addresses},
        }))
        .expect("pool created");
}

fn lb_service(name: &str, annotations: Value, spec: Value) -> Value {
    let mut s = json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "default", "annotations": annotations},
        "spec": {"type": "LoadBalancer", "loadBalancerClass": CLASS,
                 "ports": [{"port": 80}], "selector": {"app": name}},
    });
    for (k, v) in spec.as_object().unwrap() {
        s["spec"][k] = v.clone();
    }
    s
}

fn create(server: &TestApiServer, svc: Value) -> Service {
    serde_json::from_value(server.create_json(svc).expect("service created")).unwrap()
}

fn get(server: &TestApiServer, name: &str) -> Option<Service> {
    server.get::<Service>(Some("default"), name)
}

fn ingress_ips(svc: &Service) -> Vec<String> {
    lb_agent::k8s::ingress(svc)
        .iter()
        .filter_map(|i| i.ip.clone())
        .collect()
}

fn condition(svc: &Service) -> Option<Condition> {
    svc.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "xlb.dev/AddressAllocated")
        .cloned()
}

/// Waits until the Service shows exactly these addresses and a True condition.
async fn wait_allocated(server: &TestApiServer, name: &str, ips: &[&str]) -> Service {
    let want: Vec<String> = ips.iter().map(|s| s.to_string()).collect();
    server
        .wait_for(DEADLINE, |s| {
            let svc = get(s, name)?;
            let c = condition(&svc)?;
            (ingress_ips(&svc) == want && c.status == "True").then_some(svc)
        })
        .await
        .unwrap_or_else(|| {
            panic!(
                "{name} did not get {ips:?}; it has {:#?}",
                get(server, name).and_then(|s| s.status)
            )
        })
}

/// Waits until the Service's condition is False with `reason`.
async fn wait_failed(server: &TestApiServer, name: &str, reason: &str) -> Condition {
    server
        .wait_for(DEADLINE, |s| {
            let c = condition(&get(s, name)?)?;
            (c.status == "False" && c.reason == reason).then_some(c)
        })
        .await
        .unwrap_or_else(|| {
            panic!(
                "{name} did not fail with {reason}; it has {:#?}",
                get(server, name).and_then(|s| s.status)
            )
        })
}

/// Warning Events about a Service, as (reason, note).
fn events_about(server: &TestApiServer, name: &str) -> Vec<(String, String)> {
    server
        .list_json("events.k8s.io/v1", "Event", Some("default"))
        .into_iter()
        .filter(|e| e["regarding"]["name"] == name && e["regarding"]["kind"] == "Service")
        .map(|e| {
            assert_eq!(e["type"], "Warning", "{e}");
            assert_eq!(e["reportingController"], "xlb.dev/lb-agent", "{e}");
            // Published once: a repeat would have made it a series.
            assert!(e["series"].is_null(), "the Event was published again: {e}");
            (
                e["reason"].as_str().unwrap_or_default().to_string(),
                e["note"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// No address is shown by two Services.
fn assert_no_address_twice(server: &TestApiServer) {
    let mut seen: Vec<(IpAddr, String)> = Vec::new();
    for svc in server.list::<Service>(None) {
        for ip in ingress_ips(&svc) {
            let ip: IpAddr = ip.parse().unwrap();
            let name = svc.metadata.name.clone().unwrap();
            if let Some((_, other)) = seen.iter().find(|(i, _)| *i == ip) {
                panic!("{ip} is shown by both {other} and {name}");
            }
            seen.push((ip, name));
        }
    }
}

fn pool_status(server: &TestApiServer, name: &str) -> Option<(u64, u64, Option<String>)> {
    let p = server.get::<LoadBalancerPool>(None, name)?;
    let s = p.status?;
    Some((s.size, s.in_use, s.error))
}

#[tokio::test]
async fn a_service_gets_an_address_and_the_status_patch_is_what_the_server_stores() {
    let server = TestApiServer::start().await;
    pool(&server, "public", &["192.0.2.0/30"]);
    let agent = Agent::start(&server, "node-a", Duration::from_secs(15));
    agent.wait_leading(true, DEADLINE).await;

    let created = create(&server, lb_service("web", json!({}), json!({})));
    // Not xlb's: another class, and a ClusterIP Service.
    create(
        &server,
        lb_service(
            "other",
            json!({}),
            json!({"loadBalancerClass": "example.com/lb"}),
        ),
    );
    create(
        &server,
        lb_service("internal", json!({}), json!({"type": "ClusterIP"})),
    );

    let svc = wait_allocated(&server, "web", &["192.0.2.0"]).await;
    let ingress = &svc
        .status
        .as_ref()
        .unwrap()
        .load_balancer
        .as_ref()
        .unwrap()
        .ingress;
    assert_eq!(
        serde_json::to_value(ingress).unwrap(),
        json!([{"ip": "192.0.2.0", "ipMode": "VIP"}])
    );
    let c = condition(&svc).unwrap();
    assert_eq!(c.reason, "Allocated");
    assert_eq!(c.message, "192.0.2.0 (pool public)");
    assert_eq!(c.observed_generation, created.metadata.generation);
    assert!(c.observed_generation.is_some());

    // The allocator merge-patched the status subresource, and what the
    // server stores is what it sent.
    // (The log entry is written once the response is sent: wait for it.)
    let patches = server
        .wait_for(DEADLINE, |s| {
            let patches: Vec<_> = s
                .requests()
                .into_iter()
                .filter(|r| {
                    r.method == "PATCH"
                        && r.path == "/api/v1/namespaces/default/services/web/status"
                })
                .collect();
            (!patches.is_empty()).then_some(patches)
        })
        .await
        .expect("the PATCH is logged");
    assert_eq!(patches.len(), 1, "{patches:#?}");
    let patch = &patches[0];
    assert_eq!(patch.status, 200);
    assert_eq!(
        patch.content_type.as_deref(),
        Some("application/merge-patch+json")
    );
    let body = patch.body.as_ref().unwrap();
    let stored = serde_json::to_value(svc.status.as_ref().unwrap()).unwrap();
    assert_eq!(body["status"]["loadBalancer"], stored["loadBalancer"]);
    assert_eq!(body["status"]["conditions"], stored["conditions"]);
    assert_eq!(
        body["metadata"]["resourceVersion"],
        json!(created.metadata.resource_version),
        "the patch is conditional on the version it was computed from"
    );

    // Services that are not xlb's are left alone.
    for name in ["other", "internal"] {
        let svc = get(&server, name).unwrap();
        assert!(
            ingress_ips(&svc).is_empty() && condition(&svc).is_none(),
            "{name}"
        );
    }

    let status = server
        .wait_for(DEADLINE, |s| {
            pool_status(s, "public").filter(|(_, in_use, _)| *in_use == 1)
        })
        .await;
    assert_eq!(status, Some((4, 1, None)));
    assert_eq!(
        agent.metric("xlb_pool_addresses", "pool", "public"),
        Some(4.0)
    );
    assert_eq!(
        agent.metric("xlb_pool_addresses_in_use", "pool", "public"),
        Some(1.0)
    );

    // A Service that stops being xlb's loses the address and the condition.
    let mut changed = get(&server, "web").unwrap();
    changed.spec.as_mut().unwrap().type_ = Some("NodePort".into());
    changed.spec.as_mut().unwrap().load_balancer_class = None;
    server.update(&changed).unwrap();
    server
        .wait_for(DEADLINE, |s| {
            let svc = get(s, "web")?;
            (ingress_ips(&svc).is_empty() && condition(&svc).is_none()).then_some(())
        })
        .await
        .expect("the address xlb wrote is cleared");
    server
        .wait_for(DEADLINE, |s| {
            pool_status(s, "public").filter(|(_, in_use, _)| *in_use == 0)
        })
        .await
        .expect("the pool counts it free");
}

#[tokio::test]
async fn requested_addresses_are_honoured_or_refused_with_a_reason() {
    let server = TestApiServer::start().await;
    pool(&server, "public", &["192.0.2.0/29"]);
    let _agent = Agent::start(&server, "node-a", Duration::from_secs(15));

    create(
        &server,
        lb_service(
            "by-annotation",
            json!({"xlb.dev/ip": "192.0.2.5"}),
            json!({}),
        ),
    );
    create(
        &server,
        lb_service(
            "by-field",
            json!({}),
            json!({"loadBalancerIP": "192.0.2.6"}),
        ),
    );
    wait_allocated(&server, "by-annotation", &["192.0.2.5"]).await;
    wait_allocated(&server, "by-field", &["192.0.2.6"]).await;

    create(
        &server,
        lb_service("taken", json!({"xlb.dev/ip": "192.0.2.5"}), json!({})),
    );
    create(
        &server,
        lb_service("outside", json!({"xlb.dev/ip": "203.0.113.1"}), json!({})),
    );
    create(
        &server,
        lb_service("malformed", json!({"xlb.dev/ip": "192.0.2.x"}), json!({})),
    );
    let c = wait_failed(&server, "taken", "AddressInUse").await;
    assert_eq!(
        c.message,
        "192.0.2.5 is used by Service default/by-annotation"
    );
    let c = wait_failed(&server, "outside", "AddressNotInPool").await;
    assert_eq!(c.message, "203.0.113.1 is in no pool");
    let c = wait_failed(&server, "malformed", "BadRequest").await;
    assert_eq!(c.message, "xlb.dev/ip: \"192.0.2.x\" is not an IP address");
    for name in ["taken", "outside", "malformed"] {
        assert!(
            ingress_ips(&get(&server, name).unwrap()).is_empty(),
            "{name}"
        );
    }
    for (name, reason) in [
        ("taken", "AddressInUse"),
        ("outside", "AddressNotInPool"),
        ("malformed", "BadRequest"),
    ] {
        let events = server
            .wait_for(DEADLINE, |s| {
                let e = events_about(s, name);
                (!e.is_empty()).then_some(e)
            })
            .await
            .unwrap_or_else(|| panic!("no Event about {name}"));
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].0, reason);
    }
    assert_no_address_twice(&server);

    // Fixing the annotation fixes the Service.
    server
        .patch::<Service>(
            Some("default"),
            "malformed",
            &json!({"metadata": {"annotations": {"xlb.dev/ip": "192.0.2.7"}}}),
        )
        .unwrap();
    wait_allocated(&server, "malformed", &["192.0.2.7"]).await;
}

#[tokio::test]
async fn an_exhausted_pool_is_reported_and_a_deleted_service_frees_its_address() {
    let server = TestApiServer::start().await;
    pool(&server, "tiny", &["192.0.2.10/32"]);
    let agent = Agent::start(&server, "node-a", Duration::from_secs(15));

    create(&server, lb_service("first", json!({}), json!({})));
    wait_allocated(&server, "first", &["192.0.2.10"]).await;
    create(&server, lb_service("second", json!({}), json!({})));
    let c = wait_failed(&server, "second", "PoolExhausted").await;
    assert_eq!(c.message, "auto-assign pools have no free IPv4 address");
    assert!(ingress_ips(&get(&server, "second").unwrap()).is_empty());
    let events = server
        .wait_for(DEADLINE, |s| {
            let e = events_about(s, "second");
            (!e.is_empty()).then_some(e)
        })
        .await
        .expect("an Event about second");
    assert_eq!(
        events,
        vec![(
            "PoolExhausted".to_string(),
            "auto-assign pools have no free IPv4 address".to_string()
        )]
    );
    server
        .wait_for(DEADLINE, |_| {
            (agent.metric("xlb_services_without_address", "reason", "PoolExhausted") == Some(1.0))
                .then_some(())
        })
        .await
        .expect("xlb_services_without_address{reason=PoolExhausted} 1");
    assert_eq!(
        agent.metric("xlb_services_without_address", "reason", "NoPool"),
        Some(0.0)
    );

    // More reconciles with the same problem: no more Events, no rewrites.
    // (Named to sort after "second": creation times have whole seconds.)
    let second_version = get(&server, "second").unwrap().metadata.resource_version;
    for i in 0..3 {
        let name = format!("waiting-{i}");
        create(&server, lb_service(&name, json!({}), json!({})));
        wait_failed(&server, &name, "PoolExhausted").await;
    }
    assert_eq!(events_about(&server, "second").len(), 1);
    assert_eq!(
        get(&server, "second").unwrap().metadata.resource_version,
        second_version
    );

    // Deleting first frees its address for the oldest waiting Service.
    server.delete::<Service>(Some("default"), "first").unwrap();
    let svc = wait_allocated(&server, "second", &["192.0.2.10"]).await;
    assert_eq!(condition(&svc).unwrap().reason, "Allocated");
    server
        .wait_for(DEADLINE, |_| {
            (agent.metric("xlb_services_without_address", "reason", "PoolExhausted") == Some(3.0))
                .then_some(())
        })
        .await
        .expect("the three younger Services still wait");
    assert_no_address_twice(&server);
}

#[tokio::test]
async fn a_bad_pool_gets_an_error_and_changes_nothing_else() {
    let server = TestApiServer::start().await;
    pool(&server, "good", &["192.0.2.0/30"]);
    pool(&server, "bad", &["192.0.2.0/33"]);
    let _agent = Agent::start(&server, "node-a", Duration::from_secs(15));
    create(&server, lb_service("web", json!({}), json!({})));
    wait_allocated(&server, "web", &["192.0.2.0"]).await;
    let status = server
        .wait_for(DEADLINE, |s| {
            pool_status(s, "bad").filter(|(_, _, e)| e.is_some())
        })
        .await
        .expect("the bad pool's status says why");
    assert_eq!(
        status,
        (
            0,
            0,
            Some("\"192.0.2.0/33\": prefix length 33 is longer than 32 bits".into())
        )
    );
    create(
        &server,
        lb_service("wants-bad", json!({"xlb.dev/pool": "bad"}), json!({})),
    );
    let c = wait_failed(&server, "wants-bad", "NoPool").await;
    assert!(
        c.message.starts_with("pool \"bad\" is invalid: "),
        "{}",
        c.message
    );
}

#[tokio::test]
async fn dual_stack_services_get_one_address_per_family() {
    let server = TestApiServer::start().await;
    pool(&server, "v4", &["192.0.2.1-192.0.2.2"]);
    pool(&server, "v6", &["2001:db8::/126"]);
    let _agent = Agent::start(&server, "node-a", Duration::from_secs(15));
    create(
        &server,
        lb_service(
            "dual",
            json!({}),
            json!({"ipFamilies": ["IPv6", "IPv4"], "ipFamilyPolicy": "RequireDualStack"}),
        ),
    );
    wait_allocated(&server, "dual", &["2001:db8::", "192.0.2.1"]).await;
}

#[tokio::test]
async fn a_conflict_on_the_status_patch_is_retried() {
    let server = TestApiServer::start().await;
    pool(&server, "public", &["192.0.2.0/30"]);
    server.inject(
        Fault::new(409)
            .times(2)
            .method("PATCH")
            .path_contains("/services/web/status"),
    );
    let _agent = Agent::start(&server, "node-a", Duration::from_secs(15));
    create(&server, lb_service("web", json!({}), json!({})));
    wait_allocated(&server, "web", &["192.0.2.0"]).await;
    // The log entry is written once the response is sent: wait for it.
    let statuses = server
        .wait_for(DEADLINE, |s| {
            let statuses: Vec<(u16, bool)> = s
                .requests()
                .into_iter()
                .filter(|r| r.method == "PATCH" && r.path.ends_with("/services/web/status"))
                .map(|r| (r.status, r.injected))
                .collect();
            statuses
                .iter()
                .any(|(code, _)| *code == 200)
                .then_some(statuses)
        })
        .await
        .expect("a successful PATCH is logged");
    assert_eq!(statuses, vec![(409, true), (409, true), (200, false)]);
    assert!(server.pending_faults().is_empty());
}

#[tokio::test]
async fn one_leader_at_a_time_and_a_takeover_after_the_lease_expires() {
    let server = TestApiServer::start().await;
    pool(&server, "public", &["192.0.2.0/29"]);
    let lease = Duration::from_secs(2);
    let a = Agent::start(&server, "node-a", lease);
    let b = Agent::start(&server, "node-b", lease);

    let (leader_rx, follower_rx) = (a.leading(), b.leading());
    server
        .wait_for(DEADLINE, |_| {
            (*leader_rx.borrow() || *follower_rx.borrow()).then_some(())
        })
        .await
        .expect("someone leads");
    let (leader, follower) = if *leader_rx.borrow() { (a, b) } else { (b, a) };
    let holder: Lease = server.get(Some(LEASE_NS), LEASE_NAME).unwrap();
    let leader_name = holder.spec.unwrap().holder_identity.unwrap();
    assert!(leader_name == "node-a" || leader_name == "node-b");
    create(&server, lb_service("web", json!({}), json!({})));
    wait_allocated(&server, "web", &["192.0.2.0"]).await;

    // Over several renewals, never two leaders; the follower reports no
    // allocation metrics.
    let until = tokio::time::Instant::now() + lease * 2;
    let (mut lr, mut fr) = (leader.leading(), follower.leading());
    while tokio::time::Instant::now() < until {
        assert!(*lr.borrow_and_update(), "the leader kept leading");
        assert!(!*fr.borrow_and_update(), "the follower never led");
        tokio::select! {
            _ = lr.changed() => {}
            _ = fr.changed() => {}
            _ = tokio::time::sleep(Duration::from_millis(50)) => {}
        }
    }
    assert_eq!(
        follower.metric("xlb_pool_addresses", "pool", "public"),
        None
    );
    let held: Lease = server.get(Some(LEASE_NS), LEASE_NAME).unwrap();
    let held = held.spec.unwrap();
    assert_eq!(held.holder_identity.as_deref(), Some(leader_name.as_str()));
    assert_eq!(held.lease_duration_seconds, Some(2));

    // The leader dies without stepping down; the follower waits out the lease.
    let last_renew = {
        let l: Lease = server.get(Some(LEASE_NS), LEASE_NAME).unwrap();
        l.spec.unwrap().renew_time.unwrap().0
    };
    drop(leader);
    follower.wait_leading(true, DEADLINE).await;
    let taken: Lease = server.get(Some(LEASE_NS), LEASE_NAME).unwrap();
    let taken = taken.spec.unwrap();
    assert_ne!(taken.holder_identity.as_deref(), Some(leader_name.as_str()));
    let acquired = taken.acquire_time.unwrap().0;
    assert!(
        acquired >= last_renew + k8s_openapi::jiff::SignedDuration::from_secs(2),
        "taken over at {acquired}, before the lease renewed at {last_renew} expired"
    );
    assert_eq!(
        taken.lease_transitions,
        Some(held.lease_transitions.unwrap() + 1)
    );

    // The new leader keeps the existing allocation and serves new Services.
    create(&server, lb_service("api", json!({}), json!({})));
    wait_allocated(&server, "api", &["192.0.2.1"]).await;
    assert_eq!(
        ingress_ips(&get(&server, "web").unwrap()),
        vec!["192.0.2.0"]
    );

    // Stepping down frees the Lease at once: a newcomer need not wait for
    // it to expire.
    let mut follower = follower;
    let elector = follower.elector.take().unwrap();
    elector.step_down().await;
    let freed: Lease = server.get(Some(LEASE_NS), LEASE_NAME).unwrap();
    assert_eq!(freed.spec.unwrap().holder_identity, None);
    let started = tokio::time::Instant::now();
    let c = Agent::start(&server, "node-c", lease);
    c.wait_leading(true, DEADLINE).await;
    assert!(
        started.elapsed() < lease,
        "a freed lease is taken at once, not after {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn an_api_server_outage_leaves_allocations_intact() {
    let server = TestApiServer::start().await;
    pool(&server, "public", &["192.0.2.0/30"]);
    let lease = Duration::from_secs(2);
    let agent = Agent::start(&server, "node-a", lease);
    create(&server, lb_service("a", json!({}), json!({})));
    wait_allocated(&server, "a", &["192.0.2.0"]).await;
    create(&server, lb_service("b", json!({}), json!({})));
    let b_before = wait_allocated(&server, "b", &["192.0.2.1"]).await;

    server.set_down(true);
    // It cannot renew: it stops leading before the lease could expire.
    agent.wait_leading(false, DEADLINE).await;
    // Meanwhile (straight into the store): a goes, c comes.
    server.delete::<Service>(Some("default"), "a").unwrap();
    create(&server, lb_service("c", json!({}), json!({})));
    // Back, but listing pools fails for a while: nothing is decided from
    // Services alone (that would take every address away).
    server.inject(
        Fault::new(500)
            .times(2)
            .method("GET")
            .path_contains("/loadbalancerpools")
            .non_watches_only(),
    );
    server.set_down(false);

    agent.wait_leading(true, DEADLINE).await;
    wait_allocated(&server, "c", &["192.0.2.0"]).await;
    let b_after = get(&server, "b").unwrap();
    assert_eq!(ingress_ips(&b_after), vec!["192.0.2.1"]);
    assert_eq!(
        b_after.metadata.resource_version, b_before.metadata.resource_version,
        "b was not rewritten"
    );
    assert_no_address_twice(&server);
    assert!(
        server.pending_faults().is_empty(),
        "the pool lists did fail"
    );
}
