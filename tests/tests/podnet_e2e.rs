//! End to end: Pods behind a Linux bridge the agent was not told about
//! (`pod_interfaces: auto`), made after the agent started, as the bridge
//! CNI does; see `xlb_tests::podnet_lab` for the layout. Their replies
//! enter the node through the bridge, never through an uplink, and must be
//! translated there (snat and nat, TCP and UDP), also the replies of a
//! Pod behind the other node; the bridge going away and coming back is
//! followed; a Pod's own traffic passes untouched.
//!
//! Needs root, iproute2, ethtool and bpffs at /sys/fs/bpf. Namespaces are
//! `pn-*`. Waits poll their condition with a deadline.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener},
    time::Duration,
};

use xlb_tests::{
    podnet_lab::{
        config, http_get, pinned_link, pod_ip, udp_echo, PodLab, ATTACHED, ATTACHED_OVERLAY,
        CLIENT, DETACHED,
    },
    topology::{in_netns, AgentHandle},
    traffic::wait_until,
};

/// Large enough that the Pod's TCP sends segmentation-offload skbs of
/// many MTUs through the bridge.
const LARGE: usize = 2 << 20;

fn vip(last: u8, port: u16) -> SocketAddr {
    SocketAddr::from(([192, 0, 2, last], port))
}

/// From the client: TCP (small and large answers) and UDP through every
/// service of node 1's Pods, in snat and nat; each Pod must answer some.
fn check_local_pods(lab: &PodLab, agent: &AgentHandle, when: &str) {
    let result = in_netns(&lab.client, move || -> Result<(), String> {
        for (port, mode) in [(80, "snat"), (81, "nat")] {
            let mut seen = std::collections::BTreeSet::new();
            for i in 0..16 {
                let body = http_get(vip(10, port), 0)
                    .map_err(|e| format!("{mode} TCP request {i}: {e}"))?;
                seen.insert(body);
            }
            if seen.len() != 2 {
                return Err(format!("{mode} TCP: answered by {seen:?}, not both Pods"));
            }
            let body = http_get(vip(10, port), LARGE)
                .map_err(|e| format!("{mode} TCP, a {LARGE}-byte answer: {e}"))?;
            if body.len() != LARGE {
                return Err(format!("{mode} TCP: {} bytes of {LARGE}", body.len()));
            }
        }
        for (port, mode) in [(53, "snat"), (54, "nat")] {
            let mut seen = std::collections::BTreeSet::new();
            for i in 0..16 {
                let echo = udp_echo(vip(10, port), &format!("q{i}"))
                    .map_err(|e| format!("{mode} UDP datagram {i}: {e}"))?;
                let (pod, payload) = echo.split_once(':').unwrap_or(("", ""));
                if payload != format!("q{i}") {
                    return Err(format!("{mode} UDP: echo {echo:?}"));
                }
                seen.insert(pod.to_string());
            }
            if seen.len() != 2 {
                return Err(format!("{mode} UDP: answered by {seen:?}, not both Pods"));
            }
        }
        Ok(())
    })
    .join()
    .unwrap();
    if let Err(e) = result {
        panic!("{when}: {e}\nnode 1's agent:\n{}", agent.log());
    }
}

/// Waits until node 1's services answer again (the node re-learns its
/// Pods' neighbours after the bridge came back).
fn wait_serving(lab: &PodLab) {
    let client = lab.client.name.clone();
    wait_until(
        "node 1's Pods answer through the VIP",
        Duration::from_secs(15),
        || {
            let c = client.clone();
            std::thread::spawn(move || {
                xlb_tests::netns::Netns::enter_by_name(&c);
                http_get(vip(10, 80), 0).is_ok() && http_get(vip(10, 81), 0).is_ok()
            })
            .join()
            .unwrap()
            .then_some(())
        },
    );
}

#[test]
fn pod_side_bridges_are_found_followed_and_translate_replies_needs_root() {
    let mut lab = PodLab::new("pn");
    let a1 = lab.start_agent(1, &config(1));
    let a2 = lab.start_agent(2, &config(2));
    // Node 2 has its bridge from the start; node 1 none yet. Both take
    // flannel.1: the other node's Pods are backends behind it.
    a2.wait_for_log(ATTACHED, 1, Duration::from_secs(5));
    assert!(pinned_link(&lab.pin_dir(2), "cni0"));
    assert!(!pinned_link(&lab.pin_dir(1), "cni0"));
    for (agent, pins) in [(&a1, lab.pin_dir(1)), (&a2, lab.pin_dir(2))] {
        agent.wait_for_log(ATTACHED_OVERLAY, 1, Duration::from_secs(5));
        assert!(pinned_link(&pins, "flannel.1"), "{}", agent.log());
        assert!(
            !pinned_link(&pins, "nn"),
            "nn taken as pod-side:\n{}",
            agent.log()
        );
    }

    // The CNI makes node 1's bridge for its first Pods.
    lab.bridge(1, "cni0", &[1, 2]);
    a1.wait_for_log(ATTACHED, 1, Duration::from_secs(5));
    assert!(pinned_link(&lab.pin_dir(1), "cni0"));
    wait_serving(&lab);
    check_local_pods(&lab, &a1, "with the bridge made after the agent");

    // A nat Pod behind node 2: node 1 forwards over VXLAN, the Pod answers
    // through node 2's uplink, and node 2 translates on its bridge.
    let far = in_netns(&lab.client, || {
        (
            http_get(vip(11, 80), 0),
            http_get(vip(11, 80), LARGE).map(|b| b.len()),
        )
    })
    .join()
    .unwrap();
    match far {
        (Ok(small), Ok(LARGE)) if small == "p3" => {}
        other => panic!(
            "the nat Pod behind node 2: {other:?}\nnode 2's agent:\n{}",
            a2.log()
        ),
    }

    // In-cluster traffic to a nat backend's own address: Pod 1 to Pod 3
    // across the VXLAN. Pod 3's answer is to another Pod, not to a client
    // of the VIP, and must keep Pod 3's address.
    let p3 = SocketAddr::new(pod_ip(3).into(), 8081);
    let direct = in_netns(&lab.pods[0], move || http_get(p3, LARGE).map(|b| b.len()))
        .join()
        .unwrap();
    assert_eq!(direct.ok(), Some(LARGE), "Pod 1 -> Pod 3 directly");

    // A Pod's own traffic to the client (to a port in the SNAT range):
    // through the bridge and the uplink, both ways, untouched.
    ordinary_pod_traffic(&lab, 0);
    ordinary_pod_traffic(&lab, 2);

    // The bridge goes (its last Pod deleted, the CNI cleaning up), then
    // comes back with the next Pods.
    lab.delete_bridge(1, "cni0");
    a1.wait_for_log(DETACHED, 1, Duration::from_secs(5));
    assert!(!pinned_link(&lab.pin_dir(1), "cni0"), "{}", a1.log());
    lab.bridge(1, "cni0", &[1, 2]);
    a1.wait_for_log(ATTACHED, 2, Duration::from_secs(5));
    assert!(pinned_link(&lab.pin_dir(1), "cni0"));
    wait_serving(&lab);
    check_local_pods(&lab, &a1, "with the bridge made again");
    drop(a2);
}

/// Pod `pod` (0-based) sends 4 MB to a server in the client namespace,
/// which answers with 4 MB: a Pod's own egress and its replies.
fn ordinary_pod_traffic(lab: &PodLab, pod: usize) {
    const SIZE: usize = 4 << 20;
    let server = in_netns(&lab.client, || {
        let l = TcpListener::bind((CLIENT, 15000)).expect("bind in the client");
        let (mut c, from) = l.accept().unwrap();
        let mut got = vec![0u8; SIZE];
        c.read_exact(&mut got).unwrap();
        c.write_all(&got).unwrap();
        from
    });
    let to = SocketAddr::new(CLIENT.into(), 15000);
    let n = in_netns(&lab.pods[pod], move || {
        let mut c = wait_until("the client's server", Duration::from_secs(5), || {
            std::net::TcpStream::connect(to).ok()
        });
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let data = vec![7u8; SIZE];
        c.write_all(&data).unwrap();
        let mut back = vec![0u8; SIZE];
        c.read_exact(&mut back).map(|_| back == data)
    })
    .join()
    .unwrap();
    let from = server.join().unwrap();
    assert_eq!(
        from.ip(),
        std::net::IpAddr::from(pod_ip(pod + 1)),
        "the client saw the Pod's own address"
    );
    assert!(n.unwrap(), "the 4 MB came back as sent");
}
