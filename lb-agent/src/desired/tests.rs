//! The decisions the agent's reconcile makes, case by case, without root.

use std::time::{Duration, Instant};

use super::*;
use crate::{
    health::Health,
    load_aware::{controller::Decision, BackendLoad, ServiceLoad},
    service::{AgentCheck, CheckKind, HealthCheck},
};

const CONFIG: &str = "\
interfaces: [eth0]
snat_ipv4: 10.0.0.1
snat_ipv6: fd00::1
";

fn config() -> AgentConfig {
    AgentConfig::parse(CONFIG).expect("the test config")
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// A service on `vip`:80/tcp with backends `10.2.0.N:8080`, weight 1.
fn service(name: &str, vip: &str, mode: Mode, backends: &[u8]) -> DesiredService {
    let s = DesiredService {
        mode,
        ..DesiredService::for_test(name, vip.parse().unwrap(), 80)
    };
    backends.iter().fold(s, |s, n| {
        s.with_backend(IpAddr::from([10, 2, 0, *n]), 8080, 1)
    })
}

fn checked(mut s: DesiredService) -> DesiredService {
    s.health_check = Some(HealthCheck {
        kind: CheckKind::Tcp { port: None },
        interval: Duration::from_secs(1),
        timeout: Duration::from_millis(500),
        rise: 2,
        fall: 2,
    });
    s
}

fn cluster(services: Vec<DesiredService>) -> Desired {
    let mut d = Desired::default();
    d.services = services.into_iter().map(Arc::new).collect();
    d
}

fn never_overlay(_: IpAddr) -> bool {
    false
}

/// Computes with `file` and `cluster` in `context` after `previous`.
fn run(
    file: &[Arc<DesiredService>],
    cluster: Option<&Desired>,
    context: &Context,
    previous: &State,
) -> State {
    let config = config();
    compute(
        &Inputs {
            file,
            cluster,
            config: &config,
            context: context.clone(),
            overlay: &never_overlay,
        },
        previous,
    )
}

fn key(vip: &str) -> ServiceKey {
    service_key(vip.parse().unwrap(), 80, Protocol::Tcp.number())
}

fn backends(spec: &ServiceSpec) -> Vec<(SocketAddr, u32)> {
    spec.backends.iter().map(|b| (b.addr, b.weight)).collect()
}

fn health(unhealthy: &[&str]) -> HealthSnapshot {
    let now = Instant::now();
    Arc::new(
        unhealthy
            .iter()
            .map(|a| {
                let h = Health {
                    healthy: false,
                    since: now,
                    last_error: Some("refused".into()),
                    checks: 3,
                    latency: None,
                };
                (addr(a), h)
            })
            .collect(),
    )
}

#[test]
fn a_file_service_becomes_its_spec_with_the_nodes_snat_address() {
    let file = [Arc::new(service("web", "192.0.2.10", Mode::Snat, &[2, 3]))];
    let s = run(&file, None, &Context::default(), &State::default());
    let w = &s.services[&key("192.0.2.10")];
    assert_eq!(w.spec.snat, Some("10.0.0.1".parse().unwrap()));
    assert_eq!(
        backends(&w.spec),
        [(addr("10.2.0.2:8080"), 1), (addr("10.2.0.3:8080"), 1)]
    );
    assert_eq!(s.changed, BTreeSet::from([key("192.0.2.10")]));
    assert!(w.load_target.is_none());
}

#[test]
fn the_file_wins_an_address_kubernetes_also_asks_for() {
    let file = [Arc::new(service("file-web", "192.0.2.10", Mode::Nat, &[2]))];
    let k8s = cluster(vec![
        service("shop/web:http", "192.0.2.10", Mode::Snat, &[7]),
        service("shop/api:http", "192.0.2.11", Mode::Nat, &[8]),
    ]);
    let s = run(&file, Some(&k8s), &Context::default(), &State::default());
    assert_eq!(s.services[&key("192.0.2.10")].service.name, "file-web");
    assert_eq!(s.services[&key("192.0.2.11")].service.name, "shop/api:http");
    assert_eq!(
        s.shadowed.values().collect::<Vec<_>>(),
        ["shop/web:http"],
        "{:?}",
        s.shadowed
    );
}

#[test]
fn failing_backends_leave_only_services_that_check_them() {
    let file = [
        Arc::new(checked(service(
            "checked",
            "192.0.2.10",
            Mode::Nat,
            &[2, 3],
        ))),
        Arc::new(service("unchecked", "192.0.2.11", Mode::Nat, &[2, 3])),
    ];
    let context = Context {
        health: health(&["10.2.0.2:8080"]),
        ..Default::default()
    };
    let s = run(&file, None, &context, &State::default());
    let c = &s.services[&key("192.0.2.10")];
    assert_eq!(backends(&c.spec), [(addr("10.2.0.3:8080"), 1)]);
    // Still configured: its metrics read unhealthy rather than vanish.
    assert_eq!(c.configured().count(), 2);
    assert_eq!(backends(&s.services[&key("192.0.2.11")].spec).len(), 2);
}

#[test]
fn load_aware_weights_come_from_the_controller_and_down_backends_leave() {
    let mut svc = service("la", "192.0.2.10", Mode::Nat, &[2, 3, 4]);
    svc.balance = Balance::LoadAware {
        agent_check: Some(AgentCheck { port: 9000 }),
    };
    let file = [Arc::new(svc)];
    let decision = |weight, down| BackendLoad {
        decision: Decision {
            weight,
            down,
            factor: 1.0,
            pressure: 1.0,
        },
        signals: Default::default(),
    };
    let load = ServiceLoad {
        name: "la".into(),
        backends: BTreeMap::from([
            (addr("10.2.0.2:8080"), decision(700, false)),
            (addr("10.2.0.3:8080"), decision(0, true)),
        ]),
        all_draining: false,
    };
    let context = Context {
        load: Arc::new(BTreeMap::from([(key("192.0.2.10"), load)])),
        ..Default::default()
    };
    let s = run(&file, None, &context, &State::default());
    let w = &s.services[&key("192.0.2.10")];
    let ramp = Params::for_service(w.spec.least_loaded).ramp_start;
    let unseen = (SCALE * ramp).round() as u32;
    assert_eq!(
        backends(&w.spec),
        [
            (addr("10.2.0.2:8080"), 700),
            (addr("10.2.0.4:8080"), unseen)
        ],
        "the controller's weight; the down one out; the unseen one at the ramp"
    );
    // The controller balances every backend health checks left in.
    let target = w.load_target.as_ref().expect("a load target");
    assert_eq!(target.backends.len(), 3);
    assert_eq!(target.agent_check, Some(AgentCheck { port: 9000 }));
    assert_eq!(s.load_targets().len(), 1);
}

#[test]
fn nat_behind_an_overlay_is_served_in_snat_but_not_the_files() {
    let config = config();
    let behind = |ip: IpAddr| ip == IpAddr::from([10, 2, 0, 3]);
    let file = [Arc::new(service("file-nat", "192.0.2.10", Mode::Nat, &[3]))];
    let k8s = cluster(vec![
        service("shop/web:http", "192.0.2.11", Mode::Nat, &[2, 3]),
        service("shop/local:http", "192.0.2.12", Mode::Nat, &[2]),
    ]);
    let s = compute(
        &Inputs {
            file: &file,
            cluster: Some(&k8s),
            config: &config,
            context: Context::default(),
            overlay: &behind,
        },
        &State::default(),
    );
    assert_eq!(s.services[&key("192.0.2.10")].spec.snat, None);
    assert_eq!(
        s.services[&key("192.0.2.11")].spec.snat,
        Some("10.0.0.1".parse().unwrap())
    );
    assert_eq!(s.services[&key("192.0.2.12")].spec.snat, None);
    assert_eq!(
        s.nat_over_overlay(),
        BTreeSet::from(["shop/web:http".to_string()])
    );
}

#[test]
fn a_vip_is_announced_every_way_one_of_its_services_asks() {
    let mut bgp = service("a", "192.0.2.10", Mode::Nat, &[2]);
    bgp.announce = Announce::Bgp;
    let mut l2 = service("b", "192.0.2.10", Mode::Nat, &[2]);
    l2.port = 443;
    l2.announce = Announce::L2;
    let mut only_l2 = service("c", "192.0.2.11", Mode::Nat, &[2]);
    only_l2.announce = Announce::L2;
    let file = [Arc::new(bgp), Arc::new(l2), Arc::new(only_l2)];
    let s = run(&file, None, &Context::default(), &State::default());
    assert_eq!(
        s.announce_by_vip,
        BTreeMap::from([
            ("192.0.2.10".parse().unwrap(), Announce::Both),
            ("192.0.2.11".parse().unwrap(), Announce::L2),
        ])
    );
}

#[test]
fn an_unchanged_service_is_reused_and_not_compared_again() {
    let web = Arc::new(service("web", "192.0.2.10", Mode::Nat, &[2]));
    let checked_svc = Arc::new(checked(service("db", "192.0.2.11", Mode::Nat, &[2, 3])));
    let file = [web.clone(), checked_svc.clone()];
    let context = Context::default();
    let first = run(&file, None, &context, &State::default());
    assert_eq!(first.changed.len(), 2);

    // Nothing new: nothing computed, nothing to write.
    let again = run(&file, None, &context, &first);
    assert!(again.changed.is_empty(), "{:?}", again.changed);

    // New health: only the service that reads it.
    let context = Context {
        health: health(&["10.2.0.3:8080"]),
        ..Default::default()
    };
    let health_changed = run(&file, None, &context, &again);
    assert_eq!(health_changed.changed, BTreeSet::from([key("192.0.2.11")]));

    // A new generation (a reload): all of them.
    let context = Context {
        generation: 1,
        ..context
    };
    let reloaded = run(&file, None, &context, &health_changed);
    assert_eq!(reloaded.changed.len(), 2);

    // A new version of one service (a new Arc, equal or not): that one.
    let file = [Arc::new((*web).clone()), checked_svc];
    let replaced = run(&file, None, &context, &reloaded);
    assert_eq!(replaced.changed, BTreeSet::from([key("192.0.2.10")]));

    // A failed write is computed afresh next time.
    let mut failed = replaced.clone();
    failed.retry(key("192.0.2.11"));
    let retried = run(&file, None, &context, &failed);
    assert_eq!(retried.changed, BTreeSet::from([key("192.0.2.11")]));
}

#[test]
fn the_plan_writes_what_changed_and_removes_what_is_neither_desired_nor_held() {
    let mut reset = service("reset", "192.0.2.10", Mode::Nat, &[2, 3]);
    reset.removed_backend_flows = RemovedBackendFlows::Reset;
    let keep = service("keep", "192.0.2.11", Mode::Nat, &[2, 3]);
    let file = [Arc::new(reset.clone()), Arc::new(keep.clone())];
    let before = run(&file, None, &Context::default(), &State::default());

    // The data plane has both, plus one gone and one held.
    let mut current: BTreeMap<ServiceKey, ServiceSpec> = before
        .services
        .iter()
        .map(|(k, w)| (*k, (*w.spec).clone()))
        .collect();
    let gone = service("gone", "192.0.2.12", Mode::Nat, &[2]);
    let held = service("held", "192.0.2.13", Mode::Nat, &[2]);
    for s in [&gone, &held] {
        current.insert(key(&s.vip.to_string()), config().service_spec(s));
    }
    let mut k8s = cluster(Vec::new());
    k8s.held.insert((held.vip, 80, Protocol::Tcp));

    // Each loses backend .3; a new service appears.
    reset.backends.truncate(1);
    let mut keep2 = keep;
    keep2.backends.truncate(1);
    let new = service("new", "192.0.2.14", Mode::Nat, &[2]);
    let file = [Arc::new(reset), Arc::new(keep2), Arc::new(new)];
    let after = run(&file, Some(&k8s), &Context::default(), &before);
    let plan = plan(&current, &after);
    assert_eq!(
        plan.set,
        [
            (key("192.0.2.10"), vec![addr("10.2.0.3:8080")]),
            (key("192.0.2.11"), vec![]),
            (key("192.0.2.14"), vec![]),
        ],
        "reset flows only where the service asks; the new one written"
    );
    assert_eq!(plan.remove, [key("192.0.2.12")]);

    // Written as planned, the next plan is empty.
    for (k, _) in &plan.set {
        current.insert(*k, (*after.services[k].spec).clone());
    }
    current.remove(&key("192.0.2.12"));
    assert_eq!(super::plan(&current, &after), Plan::default());
}

#[test]
fn a_service_changed_back_to_what_the_data_plane_has_is_not_written() {
    let file = [Arc::new(service("web", "192.0.2.10", Mode::Nat, &[2]))];
    let s = run(&file, None, &Context::default(), &State::default());
    let current: BTreeMap<ServiceKey, ServiceSpec> = s
        .services
        .iter()
        .map(|(k, w)| (*k, (*w.spec).clone()))
        .collect();
    assert!(s.changed.contains(&key("192.0.2.10")));
    assert_eq!(plan(&current, &s), Plan::default());
}

#[test]
fn only_vips_with_a_weighted_backend_are_announced_and_each_by_its_way() {
    let mut drained = service("drained", "192.0.2.11", Mode::Nat, &[2]);
    drained.backends[0].weight = 0;
    let mut l2 = service("l2", "192.0.2.12", Mode::Nat, &[2]);
    l2.announce = Announce::L2;
    let file = [
        Arc::new(service("web", "192.0.2.10", Mode::Nat, &[2])),
        Arc::new(drained),
        Arc::new(l2),
        Arc::new(service("v6", "2001:db8::10", Mode::Nat, &[2])),
    ];
    let s = run(&file, None, &Context::default(), &State::default());
    let specs = s.services.values().map(|w| &*w.spec);
    let bgp_vips = servable_vips(specs.clone(), &s.announce_by_vip, Announce::by_bgp);
    let l2_vips = servable_vips(specs, &s.announce_by_vip, Announce::by_l2);
    let ip = |s: &str| -> IpAddr { s.parse().unwrap() };
    assert_eq!(
        bgp_vips,
        BTreeSet::from([ip("192.0.2.10"), ip("2001:db8::10")])
    );
    assert_eq!(
        l2_vips,
        BTreeSet::from([ip("192.0.2.10"), ip("192.0.2.12"), ip("2001:db8::10")])
    );

    let bgp = AgentConfig::parse(
        "interfaces: [eth0]\nbgp:\n  driver: gobgp\n  communities: ['65000:100']\n  local_pref: 200\n  peers: [{ address: 10.0.0.254, asn: 65000 }]\n",
    )
    .expect("a BGP config")
    .bgp
    .expect("bgp");
    let (routes, no_hop) = routes(&bgp_vips, &bgp, Some(ip("10.0.0.1")), None);
    assert_eq!(no_hop, [ip("2001:db8::10")], "no IPv6 next hop");
    let route = routes.iter().next().expect("one route");
    assert_eq!(routes.len(), 1);
    assert_eq!(
        (route.prefix.addr(), route.next_hop, route.local_pref),
        (ip("192.0.2.10"), ip("10.0.0.1"), Some(200))
    );
    assert_eq!(route.communities, [(65000, 100)]);
}
