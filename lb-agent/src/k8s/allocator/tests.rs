use super::*;
use crate::k8s::crd::LoadBalancerPoolSpec;

fn pools() -> Pools {
    let spec = LoadBalancerPoolSpec {
        addresses: vec!["192.0.2.0/24".into()],
        avoid_buggy_ips: false,
        auto_assign: true,
        service_allocation: None,
    };
    Pools::build([PoolInput {
        name: "public",
        spec: &spec,
        created: None,
    }])
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn condition_messages_and_transition_time() {
    let ok = Decision {
        addresses: vec![ip("192.0.2.1")],
        failure: None,
        missing_optional: None,
    };
    let c = desired_condition(&ok, &pools(), Some(3), None);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str(), c.message.as_str()),
        ("True", "Allocated", "192.0.2.1 (pool public)")
    );
    assert_eq!(c.observed_generation, Some(3));
    assert_eq!(c.type_, "xlb.dev/AddressAllocated");

    // Same status: the transition time stays; new status: it moves.
    let mut earlier = c.clone();
    earlier.last_transition_time = Time(Timestamp::from_second(1000).unwrap());
    earlier.message = "something else".into();
    let again = desired_condition(&ok, &pools(), Some(4), Some(&earlier));
    assert_eq!(again.last_transition_time, earlier.last_transition_time);
    let failed = Decision {
        addresses: vec![],
        failure: Some(Failure {
            reason: FailureReason::PoolExhausted,
            message: "auto-assign pools have no free IPv4 address".into(),
        }),
        missing_optional: None,
    };
    let f = desired_condition(&failed, &pools(), Some(4), Some(&earlier));
    assert_ne!(f.last_transition_time, earlier.last_transition_time);
    assert_eq!(
        (f.status.as_str(), f.reason.as_str(), f.message.as_str()),
        (
            "False",
            "PoolExhausted",
            "auto-assign pools have no free IPv4 address"
        )
    );
}

#[test]
fn conditions_of_others_are_kept() {
    let svc: Service = serde_json::from_value(json!({
            "metadata": {"name": "a"},
            "status": {"conditions": [
                {"type": "other.example/Ready", "status": "True", "reason": "R", "message": "",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "xlb.dev/AddressAllocated", "status": "False", "reason": "NoPool", "message": "x",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"}
            ]}
        }))
        .unwrap();
    let removed = replace_condition(&svc, None);
    assert_eq!(removed.as_array().unwrap().len(), 1);
    assert_eq!(removed[0]["type"], "other.example/Ready");
    let ok = Decision {
        addresses: vec![ip("192.0.2.1")],
        ..Default::default()
    };
    let replaced = replace_condition(
        &svc,
        Some(desired_condition(&ok, &pools(), None, our_condition(&svc))),
    );
    assert_eq!(replaced.as_array().unwrap().len(), 2);
    assert_eq!(replaced[1]["status"], "True");
    let bare: Service = serde_json::from_value(json!({"metadata": {"name": "a"}})).unwrap();
    assert_eq!(replace_condition(&bare, None), Value::Null);
}

#[test]
fn metrics_count_services_without_address_by_reason() {
    let registry = Registry::new();
    let metrics = Metrics::register(&registry).unwrap();
    let mut allocation = Allocation::default();
    allocation.in_use.insert("public".into(), 1);
    allocation.decisions.insert(
        ServiceName::new("ns", "a"),
        Decision {
            addresses: vec![ip("192.0.2.1")],
            ..Default::default()
        },
    );
    allocation.decisions.insert(
        ServiceName::new("ns", "b"),
        Decision {
            failure: Some(Failure {
                reason: FailureReason::PoolExhausted,
                message: String::new(),
            }),
            ..Default::default()
        },
    );
    metrics.update(&pools(), &allocation);
    assert_eq!(
        metrics.pool_addresses.with_label_values(&["public"]).get(),
        254
    );
    assert_eq!(metrics.pool_in_use.with_label_values(&["public"]).get(), 1);
    assert_eq!(
        metrics
            .without_address
            .with_label_values(&["PoolExhausted"])
            .get(),
        1
    );
    assert_eq!(
        metrics.without_address.with_label_values(&["NoPool"]).get(),
        0
    );
    metrics.clear();
    assert!(registry
        .gather()
        .iter()
        .filter(|f| f.name() != "xlb_allocator_leader")
        .all(|f| f.get_metric().is_empty()));
    assert_eq!(metrics.leader.get(), 0, "a new allocator does not lead");
    assert!(Metrics::register(&registry).is_err(), "registered once");
}

/// On the way out the elector goes while its last word is "leading": the
/// allocator must stop, not take that word again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_returns_when_the_leader_channel_closes_while_leading() {
    // Never reached: the term ends before its watchers get anywhere.
    let config = kube::Config::new("http://127.0.0.1:9".parse().unwrap());
    let client = Client::try_from(config).unwrap();
    let cfg = AllocatorConfig {
        load_balancer_class: "xlb.dev/xlb".into(),
        default_class: false,
        identity: "test".into(),
    };
    let allocator = Allocator::new(client, cfg, &Registry::new()).unwrap();
    let (tx, rx) = watch::channel(true);
    drop(tx);
    let run = tokio::spawn(allocator.run(rx));
    tokio::time::timeout(std::time::Duration::from_secs(5), run)
        .await
        .expect("the allocator kept running after its leader channel closed")
        .unwrap();
}
