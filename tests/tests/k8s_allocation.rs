//! The address allocator and the Lease election on the real control plane
//! (`xlb_tests::cluster`): the allocator and the elector run in-process as
//! the chart's ServiceAccount (so the chart's RBAC must allow all they do),
//! and the tests read what kube-apiserver ends up storing.

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
use xlb_tests::cluster::{Cluster, AGENT_NAMESPACE};
use xlb_tests::traffic::poll_until;

const CLASS: &str = "xlb.dev/xlb";
const LEASE_NS: &str = AGENT_NAMESPACE;
/// The chart's Role allows exactly this Lease.
const LEASE_NAME: &str = "xlb-address-allocator";
const DEADLINE: Duration = Duration::from_secs(20);

/// A cluster with the chart's identity installed.
fn cluster(name: &str) -> Cluster {
    let mut c = Cluster::start(name);
    c.install_chart_identity();
    c
}

/// One agent's allocation side: a Lease candidate and the allocator.
struct Agent {
    elector: Option<Elector>,
    task: JoinHandle<()>,
    metrics: Metrics,
}

impl Agent {
    async fn start(cluster: &mut Cluster, identity: &str, lease: Duration) -> Agent {
        let client = cluster.agent_client().await;
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

/// Polls `f` (blocking; the tests run on a multi-thread runtime, so the
/// agent's tasks go on meanwhile) until it returns Some, at most `timeout`.
fn wait_for<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    poll_until(timeout, Duration::from_millis(100), || f().ok_or(())).ok()
}

fn pool(c: &Cluster, name: &str, addresses: &[&str]) {
    c.create(&json!({
        "apiVersion": "xlb.dev/v1alpha1", "kind": "LoadBalancerPool",
        "metadata": {"name": name},
        "spec": {"addresses": addresses},
    }));
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

fn create(c: &Cluster, svc: Value) -> Service {
    let name = svc["metadata"]["name"].as_str().unwrap().to_string();
    c.create(&svc);
    get(c, &name).expect("the Service just created")
}

fn get(c: &Cluster, name: &str) -> Option<Service> {
    serde_json::from_value(c.get("service", Some("default"), name)?).ok()
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
fn wait_allocated(c: &Cluster, name: &str, ips: &[&str]) -> Service {
    let want: Vec<String> = ips.iter().map(|s| s.to_string()).collect();
    wait_for(DEADLINE, || {
        let svc = get(c, name)?;
        let cond = condition(&svc)?;
        (ingress_ips(&svc) == want && cond.status == "True").then_some(svc)
    })
    .unwrap_or_else(|| {
        panic!(
            "{name} did not get {ips:?}; it has {:#?}",
            get(c, name).and_then(|s| s.status)
        )
    })
}

/// Waits until the Service's condition is False with `reason`.
fn wait_failed(c: &Cluster, name: &str, reason: &str) -> Condition {
    wait_for(DEADLINE, || {
        let cond = condition(&get(c, name)?)?;
        (cond.status == "False" && cond.reason == reason).then_some(cond)
    })
    .unwrap_or_else(|| {
        panic!(
            "{name} did not fail with {reason}; it has {:#?}",
            get(c, name).and_then(|s| s.status)
        )
    })
}

/// Warning Events about a Service, as (reason, note).
fn events_about(c: &Cluster, name: &str) -> Vec<(String, String)> {
    c.list("events.v1.events.k8s.io", "default")
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

/// Waits for the first Events about a Service.
fn wait_events(c: &Cluster, name: &str) -> Vec<(String, String)> {
    wait_for(DEADLINE, || {
        let e = events_about(c, name);
        (!e.is_empty()).then_some(e)
    })
    .unwrap_or_else(|| panic!("no Event about {name}"))
}

/// No address is shown by two Services.
fn assert_no_address_twice(c: &Cluster) {
    let mut seen: Vec<(IpAddr, String)> = Vec::new();
    for v in c.list("services", "default") {
        let svc: Service = serde_json::from_value(v).unwrap();
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

fn pool_status(c: &Cluster, name: &str) -> Option<(u64, u64, Option<String>)> {
    let p: LoadBalancerPool =
        serde_json::from_value(c.get("loadbalancerpool", None, name)?).ok()?;
    let s = p.status?;
    Some((s.size, s.in_use, s.error))
}

fn stored_lease(c: &Cluster) -> Lease {
    serde_json::from_value(
        c.get("lease", Some(LEASE_NS), LEASE_NAME)
            .expect("the Lease"),
    )
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_gets_an_address_and_the_status_patch_is_what_the_server_stores() {
    let mut server = cluster(&format!("alloc-{}", line!()));
    pool(&server, "public", &["192.0.2.0/30"]);
    let agent = Agent::start(&mut server, "node-a", Duration::from_secs(15)).await;
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
        lb_service(
            "internal",
            json!({}),
            json!({"type": "ClusterIP", "loadBalancerClass": null}),
        ),
    );

    let svc = wait_allocated(&server, "web", &["192.0.2.1"]);
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
        json!([{"ip": "192.0.2.1", "ipMode": "VIP"}])
    );
    let c = condition(&svc).unwrap();
    assert_eq!(c.reason, "Allocated");
    assert_eq!(c.message, "192.0.2.1 (pool public)");
    // kube-apiserver keeps no metadata.generation for Services (the test
    // server this suite used to run against did), so there is none to echo.
    assert_eq!(c.observed_generation, created.metadata.generation);

    // Services that are not xlb's are left alone.
    for name in ["other", "internal"] {
        let svc = get(&server, name).unwrap();
        assert!(
            ingress_ips(&svc).is_empty() && condition(&svc).is_none(),
            "{name}"
        );
    }

    let status = wait_for(DEADLINE, || {
        pool_status(&server, "public").filter(|(_, in_use, _)| *in_use == 1)
    });
    assert_eq!(status, Some((2, 1, None)));
    assert_eq!(
        agent.metric("xlb_pool_addresses", "pool", "public"),
        Some(2.0)
    );
    assert_eq!(
        agent.metric("xlb_pool_addresses_in_use", "pool", "public"),
        Some(1.0)
    );

    // A Service that stops being xlb's loses the address and the condition.
    server.patch(
        "service",
        Some("default"),
        "web",
        &json!({"spec": {"type": "NodePort", "loadBalancerClass": null}}),
        false,
    );
    wait_for(DEADLINE, || {
        let svc = get(&server, "web")?;
        (ingress_ips(&svc).is_empty() && condition(&svc).is_none()).then_some(())
    })
    .expect("the address xlb wrote is cleared");
    wait_for(DEADLINE, || {
        pool_status(&server, "public").filter(|(_, in_use, _)| *in_use == 0)
    })
    .expect("the pool counts it free");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requested_addresses_are_honoured_or_refused_with_a_reason() {
    let mut server = cluster(&format!("alloc-{}", line!()));
    pool(&server, "public", &["192.0.2.0/29"]);
    let _agent = Agent::start(&mut server, "node-a", Duration::from_secs(15)).await;

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
    wait_allocated(&server, "by-annotation", &["192.0.2.5"]);
    wait_allocated(&server, "by-field", &["192.0.2.6"]);

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
    let c = wait_failed(&server, "taken", "AddressInUse");
    assert_eq!(
        c.message,
        "192.0.2.5 is taken: it is used by Service default/by-annotation, which does not \
         allow sharing (annotation xlb.dev/allow-shared-ip)"
    );
    let c = wait_failed(&server, "outside", "AddressNotInPool");
    assert_eq!(c.message, "203.0.113.1 is in no pool");
    let c = wait_failed(&server, "malformed", "BadRequest");
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
        let events = wait_events(&server, name);
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].0, reason);
    }
    assert_no_address_twice(&server);

    // Fixing the annotation fixes the Service.
    server.patch(
        "service",
        Some("default"),
        "malformed",
        &json!({"metadata": {"annotations": {"xlb.dev/ip": "192.0.2.4"}}}),
        false,
    );
    wait_allocated(&server, "malformed", &["192.0.2.4"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exhausted_pool_is_reported_and_a_deleted_service_frees_its_address() {
    let mut server = cluster(&format!("alloc-{}", line!()));
    pool(&server, "tiny", &["192.0.2.10/32"]);
    let agent = Agent::start(&mut server, "node-a", Duration::from_secs(15)).await;

    create(&server, lb_service("first", json!({}), json!({})));
    wait_allocated(&server, "first", &["192.0.2.10"]);
    create(&server, lb_service("second", json!({}), json!({})));
    let c = wait_failed(&server, "second", "PoolExhausted");
    assert_eq!(c.message, "auto-assign pools have no free IPv4 address");
    assert!(ingress_ips(&get(&server, "second").unwrap()).is_empty());
    let events = wait_events(&server, "second");
    assert_eq!(
        events,
        vec![(
            "PoolExhausted".to_string(),
            "auto-assign pools have no free IPv4 address".to_string()
        )]
    );
    wait_for(DEADLINE, || {
        (agent.metric("xlb_services_without_address", "reason", "PoolExhausted") == Some(1.0))
            .then_some(())
    })
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
        wait_failed(&server, &name, "PoolExhausted");
    }
    assert_eq!(events_about(&server, "second").len(), 1);
    assert_eq!(
        get(&server, "second").unwrap().metadata.resource_version,
        second_version
    );

    // Deleting first frees its address for the oldest waiting Service.
    server.delete("service", Some("default"), "first");
    let svc = wait_allocated(&server, "second", &["192.0.2.10"]);
    assert_eq!(condition(&svc).unwrap().reason, "Allocated");
    wait_for(DEADLINE, || {
        (agent.metric("xlb_services_without_address", "reason", "PoolExhausted") == Some(3.0))
            .then_some(())
    })
    .expect("the three younger Services still wait");
    assert_no_address_twice(&server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_pool_gets_an_error_and_changes_nothing_else() {
    let mut server = cluster(&format!("alloc-{}", line!()));
    pool(&server, "good", &["192.0.2.0/30"]);
    pool(&server, "bad", &["192.0.2.0/33"]);
    let _agent = Agent::start(&mut server, "node-a", Duration::from_secs(15)).await;
    create(&server, lb_service("web", json!({}), json!({})));
    wait_allocated(&server, "web", &["192.0.2.1"]);
    let status = wait_for(DEADLINE, || {
        pool_status(&server, "bad").filter(|(_, _, e)| e.is_some())
    })
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
    let c = wait_failed(&server, "wants-bad", "NoPool");
    assert!(
        c.message.starts_with("pool \"bad\" is invalid: "),
        "{}",
        c.message
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dual_stack_services_get_one_address_per_family() {
    let mut server = cluster(&format!("alloc-{}", line!()));
    pool(&server, "v4", &["192.0.2.1-192.0.2.2"]);
    pool(&server, "v6", &["2001:db8::/126"]);
    let _agent = Agent::start(&mut server, "node-a", Duration::from_secs(15)).await;
    create(
        &server,
        lb_service(
            "dual",
            json!({}),
            json!({"ipFamilies": ["IPv6", "IPv4"], "ipFamilyPolicy": "RequireDualStack"}),
        ),
    );
    wait_allocated(&server, "dual", &["2001:db8::", "192.0.2.1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_writer_conflicts_and_the_status_patch_is_retried() {
    let mut server = cluster("alloc-conflict");
    pool(&server, "public", &["192.0.2.0/30"]);
    create(&server, lb_service("web", json!({}), json!({})));
    // Another controller keeps rewriting the Service's metadata, so the
    // allocator's status patch (conditional on the version it read) meets
    // real 409 Conflicts until it re-reads and tries again.
    let admin = server.admin_client().await;
    let services: kube::Api<Service> = kube::Api::namespaced(admin, "default");
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let writer = tokio::spawn(async move {
        let mut n = 0u64;
        while !*stop_rx.borrow_and_update() {
            n += 1;
            let patch =
                json!({"metadata": {"annotations": {"example.com/generation": n.to_string()}}});
            services
                .patch(
                    "web",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(&patch),
                )
                .await
                .expect("the writer's patch");
        }
        n
    });
    let _agent = Agent::start(&mut server, "node-a", Duration::from_secs(15)).await;
    wait_allocated(&server, "web", &["192.0.2.1"]);
    stop_tx.send(true).unwrap();
    let writes = writer.await.unwrap();
    assert!(writes > 1, "the writer ran alongside the allocator");
    // Neither clobbered the other: the writer's last annotation and the
    // allocator's status are both stored.
    let svc = get(&server, "web").unwrap();
    assert_eq!(
        svc.metadata.annotations.as_ref().unwrap()["example.com/generation"],
        writes.to_string()
    );
    assert_eq!(ingress_ips(&svc), vec!["192.0.2.1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_at_a_time_and_a_takeover_after_the_lease_expires() {
    let mut server = cluster(&format!("alloc-{}", line!()));
    pool(&server, "public", &["192.0.2.0/29"]);
    let lease = Duration::from_secs(2);
    let a = Agent::start(&mut server, "node-a", lease).await;
    let b = Agent::start(&mut server, "node-b", lease).await;

    let (leader_rx, follower_rx) = (a.leading(), b.leading());
    wait_for(DEADLINE, || {
        (*leader_rx.borrow() || *follower_rx.borrow()).then_some(())
    })
    .expect("someone leads");
    let (leader, follower) = if *leader_rx.borrow() { (a, b) } else { (b, a) };
    let holder = stored_lease(&server);
    let leader_name = holder.spec.unwrap().holder_identity.unwrap();
    assert!(leader_name == "node-a" || leader_name == "node-b");
    create(&server, lb_service("web", json!({}), json!({})));
    wait_allocated(&server, "web", &["192.0.2.1"]);

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
    let held = stored_lease(&server);
    let held = held.spec.unwrap();
    assert_eq!(held.holder_identity.as_deref(), Some(leader_name.as_str()));
    assert_eq!(held.lease_duration_seconds, Some(2));

    // The leader dies without stepping down; the follower waits out the lease.
    let last_renew = {
        let l = stored_lease(&server);
        l.spec.unwrap().renew_time.unwrap().0
    };
    drop(leader);
    follower.wait_leading(true, DEADLINE).await;
    let taken = stored_lease(&server);
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
    wait_allocated(&server, "api", &["192.0.2.2"]);
    assert_eq!(
        ingress_ips(&get(&server, "web").unwrap()),
        vec!["192.0.2.1"]
    );

    // Stepping down frees the Lease at once: a newcomer need not wait for
    // it to expire.
    let mut follower = follower;
    let elector = follower.elector.take().unwrap();
    elector.step_down().await;
    let freed = stored_lease(&server);
    assert_eq!(freed.spec.unwrap().holder_identity, None);
    let started = tokio::time::Instant::now();
    let c = Agent::start(&mut server, "node-c", lease).await;
    c.wait_leading(true, DEADLINE).await;
    assert!(
        started.elapsed() < lease,
        "a freed lease is taken at once, not after {:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_server_outage_leaves_allocations_intact() {
    let mut server = cluster(&format!("alloc-{}", line!()));
    pool(&server, "public", &["192.0.2.0/30"]);
    let lease = Duration::from_secs(2);
    let agent = Agent::start(&mut server, "node-a", lease).await;
    create(&server, lb_service("a", json!({}), json!({})));
    wait_allocated(&server, "a", &["192.0.2.1"]);
    create(&server, lb_service("b", json!({}), json!({})));
    let b_before = wait_allocated(&server, "b", &["192.0.2.2"]);

    server.stop_apiserver();
    // It cannot renew: it stops leading before the lease could expire.
    agent.wait_leading(false, DEADLINE).await;
    // Back: a goes, c comes, straight away (before the agent leads again).
    server.start_apiserver();
    server.delete("service", Some("default"), "a");
    create(&server, lb_service("c", json!({}), json!({})));

    agent.wait_leading(true, DEADLINE).await;
    wait_allocated(&server, "c", &["192.0.2.1"]);
    let b_after = get(&server, "b").unwrap();
    assert_eq!(ingress_ips(&b_after), vec!["192.0.2.2"]);
    assert_eq!(
        b_after.metadata.resource_version, b_before.metadata.resource_version,
        "b was not rewritten"
    );
    assert_no_address_twice(&server);
}

/// The addresses in a Service's status, in namespace `ns`.
fn ips_in(c: &Cluster, ns: &str, name: &str) -> Vec<String> {
    c.get("service", Some(ns), name)
        .and_then(|v| serde_json::from_value::<Service>(v).ok())
        .map(|s| ingress_ips(&s))
        .unwrap_or_default()
}

fn wait_ips_in(c: &Cluster, ns: &str, name: &str, want: &[&str]) {
    wait_for(DEADLINE, || (ips_in(c, ns, name) == want).then_some(()))
        .unwrap_or_else(|| panic!("{ns}/{name} has {:?}, not {want:?}", ips_in(c, ns, name)));
}

/// Team pools serve only their namespaces (by name, and by label through
/// the Namespace objects the chart's RBAC lets the agent watch) before the
/// catch-all pool; a Service in another namespace that names a team's pool
/// is refused with a condition and an Event. Shared and scoped allocations
/// survive a leader change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoped_pools_serve_their_namespaces_and_survive_a_leader_change() {
    let mut server = cluster(&format!("alloc-{}", line!()));
    for (ns, labels) in [
        ("team-a", json!({})),
        ("team-b", json!({"team": "b"})),
        ("shop", json!({})),
    ] {
        server.create(&json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": ns, "labels": labels}}));
    }
    pool(&server, "default", &["192.0.2.0/29"]);
    for (name, range, allocation) in [
        (
            "team-a",
            "198.51.100.0/30",
            json!({"priority": 10, "namespaces": ["team-a"]}),
        ),
        (
            "team-b",
            "203.0.113.0/30",
            json!({"priority": 5, "namespaceSelectors": [{"matchLabels": {"team": "b"}}]}),
        ),
    ] {
        server.create(&json!({
            "apiVersion": "xlb.dev/v1alpha1", "kind": "LoadBalancerPool",
            "metadata": {"name": name},
            "spec": {"addresses": [range], "serviceAllocation": allocation},
        }));
    }
    let in_ns = |ns: &str, name: &str, annotations: Value, protocol: &str| {
        let mut s = lb_service(name, annotations, json!({}));
        s["metadata"]["namespace"] = json!(ns);
        s["spec"]["ports"] = json!([{"port": 53, "protocol": protocol}]);
        s
    };
    let lease = Duration::from_secs(2);
    let a = Agent::start(&mut server, "node-a", lease).await;
    a.wait_leading(true, DEADLINE).await;
    let dns = json!({"xlb.dev/allow-shared-ip": "dns"});
    server.create(&in_ns("team-a", "dns-tcp", dns.clone(), "TCP"));
    server.create(&in_ns("team-a", "dns-udp", dns, "UDP"));
    server.create(&in_ns("team-b", "web", json!({}), "TCP"));
    server.create(&in_ns("shop", "web", json!({}), "TCP"));
    server.create(&in_ns(
        "shop",
        "sneaky",
        json!({"xlb.dev/pool": "team-a"}),
        "TCP",
    ));
    wait_ips_in(&server, "team-a", "dns-tcp", &["198.51.100.1"]);
    wait_ips_in(&server, "team-a", "dns-udp", &["198.51.100.1"]);
    wait_ips_in(&server, "team-b", "web", &["203.0.113.1"]);
    wait_ips_in(&server, "shop", "web", &["192.0.2.1"]);
    let refused = wait_for(DEADLINE, || {
        let svc: Service =
            serde_json::from_value(server.get("service", Some("shop"), "sneaky")?).ok()?;
        condition(&svc).filter(|c| c.status == "False")
    })
    .expect("the sneaky Service gets a condition");
    assert_eq!(refused.reason, "PoolNotAllowed");
    assert!(
        refused.message.contains("does not serve namespace shop"),
        "{}",
        refused.message
    );
    let events = server.list("events.v1.events.k8s.io", "shop");
    assert!(
        events
            .iter()
            .any(|e| e["regarding"]["name"] == "sneaky" && e["reason"] == "PoolNotAllowed"),
        "{events:#?}"
    );

    // The leader dies; another agent takes over and changes nothing.
    let versions: Vec<Value> = ["dns-tcp", "dns-udp"]
        .iter()
        .map(|n| {
            server.get("service", Some("team-a"), n).unwrap()["metadata"]["resourceVersion"].clone()
        })
        .collect();
    drop(a);
    let b = Agent::start(&mut server, "node-b", lease).await;
    b.wait_leading(true, DEADLINE).await;
    server.create(&in_ns("team-a", "late", json!({}), "TCP"));
    wait_ips_in(&server, "team-a", "late", &["198.51.100.2"]);
    wait_ips_in(&server, "team-a", "dns-tcp", &["198.51.100.1"]);
    wait_ips_in(&server, "team-a", "dns-udp", &["198.51.100.1"]);
    wait_ips_in(&server, "team-b", "web", &["203.0.113.1"]);
    wait_ips_in(&server, "shop", "web", &["192.0.2.1"]);
    let after: Vec<Value> = ["dns-tcp", "dns-udp"]
        .iter()
        .map(|n| {
            server.get("service", Some("team-a"), n).unwrap()["metadata"]["resourceVersion"].clone()
        })
        .collect();
    assert_eq!(versions, after, "the new leader rewrote nothing");
}

/// A Service field the data plane cannot use (here an unknown
/// `xlb.dev/mode`; the API server validates source ranges and affinity
/// timeouts itself) gets one Warning Event from the leader, while the
/// address is still allocated; fixing it stops the Events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unusable_service_field_gets_one_event() {
    let mut server = cluster(&format!("alloc-{}", line!()));
    pool(&server, "public", &["192.0.2.0/30"]);
    let a = Agent::start(&mut server, "node-a", Duration::from_secs(2)).await;
    a.wait_leading(true, DEADLINE).await;
    create(
        &server,
        lb_service("odd", json!({"xlb.dev/mode": "bogus"}), json!({})),
    );
    wait_allocated(&server, "odd", &["192.0.2.1"]);
    let events = wait_events(&server, "odd");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].0, "InvalidService");
    assert!(
        events[0].1.contains("\"bogus\" is neither nat nor snat")
            && events[0].1.contains("keeps serving the Service as it was"),
        "{}",
        events[0].1
    );
    // Later reconciles (another Service arrives) do not repeat it.
    create(&server, lb_service("other", json!({}), json!({})));
    wait_allocated(&server, "other", &["192.0.2.2"]);
    assert_eq!(events_about(&server, "odd").len(), 1);
}
