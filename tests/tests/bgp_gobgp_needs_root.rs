//! The GoBGP driver against real daemons (needs root, `gobgpd`/`gobgp` 3.x
//! and `bird` 2): two network namespaces joined by a veth. The node
//! namespace runs `gobgpd` (AS 65001, API on 127.0.0.1 inside the node
//! namespace, which the driver reaches from a thread that entered it with
//! setns(2)); the router namespace runs BIRD (AS 65000), which installs what
//! it learns into its kernel table. The session is set up through the
//! driver's AddPeer, never the config file, and every check polls the
//! router's FIB or the speaker with a deadline.

use std::{
    collections::BTreeSet,
    fs::File,
    future::Future,
    net::IpAddr,
    os::fd::AsRawFd,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::Mutex,
    time::Duration,
};

use lb_agent::bgp::{
    gobgp::{
        AddressFamily, GoBgpAnnouncer, GoBgpConfig, Ownership, PeerConfig, PeerEvents, SessionState,
    },
    AnnounceError, Announcer, PeerLimit, Route,
};
use xlb_tests::bgp_lab::{ip, kernel_route, prefixes_sent, run, wait_until, WAIT};

const NODE_V4: &str = "10.201.0.1";
const ROUTER_V4: &str = "10.201.0.2";
const NODE_V6: &str = "fd00:201::1";
const ROUTER_V6: &str = "fd00:201::2";
const API_PORT: u16 = 50051;
const NODE_ASN: u32 = 65001;
const ROUTER_ASN: u32 = 65000;
const PASSWORD: &str = "xlb-test-secret";
/// Marks the agent's paths in gobgpd (the driver's `Ownership::Marked`).
const MARKER: (u16, u16) = (65001, 1);
/// Injected with the `gobgp` CLI: local but not ours.
const FOREIGN: &str = "198.51.100.7";
/// Announced by the router: learned from a peer, never ours.
const LEARNED: &str = "203.0.113.5";

/// The two namespaces, the daemons and their files. Dropping it (test passed
/// or not) stops the daemons and removes the namespaces (and with them the
/// veth) and the directory.
struct Lab {
    node: String,
    router: String,
    dir: PathBuf,
    gobgpd: Mutex<Option<Child>>,
    bird: Mutex<Option<Child>>,
}

impl Lab {
    fn new() -> Lab {
        let pid = std::process::id();
        let dir = std::env::temp_dir().join(format!("xlb-gobgp-test-{pid}"));
        let lab = Lab {
            node: format!("xlb-gbn-{pid}"),
            router: format!("xlb-gbr-{pid}"),
            dir,
            gobgpd: Mutex::new(None),
            bird: Mutex::new(None),
        };
        std::fs::create_dir_all(&lab.dir).unwrap();
        let (vn, vr) = (format!("xgbn{pid}"), format!("xgbr{pid}"));
        ip(&["netns", "add", &lab.node]);
        ip(&["netns", "add", &lab.router]);
        ip(&[
            "link",
            "add",
            &vn,
            "netns",
            &lab.node,
            "type",
            "veth",
            "peer",
            "name",
            &vr,
            "netns",
            &lab.router,
        ]);
        for (ns, dev, v4, v6) in [
            (&lab.node, &vn, NODE_V4, NODE_V6),
            (&lab.router, &vr, ROUTER_V4, ROUTER_V6),
        ] {
            xlb_tests::bgp_lab::set_up_veth_end(ns, dev, &format!("{v4}/24"), &format!("{v6}/64"));
        }
        std::fs::write(
            lab.dir.join("gobgpd.toml"),
            format!("[global.config]\n  as = {NODE_ASN}\n  router-id = \"{NODE_V4}\"\n"),
        )
        .unwrap();
        std::fs::write(lab.dir.join("bird.conf"), lab.bird_conf()).unwrap();
        lab.start_bird();
        lab.start_gobgpd();
        lab
    }

    fn bird_conf(&self) -> String {
        format!(
            r#"
router id {ROUTER_V4};
log "{log}" all;
protocol device {{ scan time 1; }}
protocol kernel kernel4 {{ ipv4 {{ import none; export all; }}; }}
protocol kernel kernel6 {{ ipv6 {{ import none; export all; }}; }}
protocol static statics {{ ipv4; route {LEARNED}/32 blackhole; }}
protocol bgp node {{
  local {ROUTER_V4} as {ROUTER_ASN};
  neighbor {NODE_V4} as {NODE_ASN};
  password "{PASSWORD}";
  hold time 9;
  keepalive time 3;
  connect delay time 1;
  connect retry time 2;
  error wait time 1, 2;
  ipv4 {{ import all; export where proto = "statics"; }};
  ipv6 {{ import all; export none; }};
}}
"#,
            log = self.dir.join("bird.log").display()
        )
    }

    fn spawn_in(&self, ns: &str, log: &str, args: &[&str]) -> Child {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.dir.join(log))
            .unwrap();
        Command::new("ip")
            .args(["netns", "exec", ns])
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {args:?}: {e}"))
    }

    fn start_bird(&self) {
        let conf = self.dir.join("bird.conf");
        let sock = self.dir.join("bird.ctl");
        let child = self.spawn_in(
            &self.router,
            "bird.out",
            &[
                "bird",
                "-f",
                "-c",
                conf.to_str().unwrap(),
                "-s",
                sock.to_str().unwrap(),
            ],
        );
        *self.bird.lock().unwrap() = Some(child);
    }

    /// Starts gobgpd with an empty RIB and no peers.
    fn start_gobgpd(&self) {
        let conf = self.dir.join("gobgpd.toml");
        let api = format!("127.0.0.1:{API_PORT}");
        let child = self.spawn_in(
            &self.node,
            "gobgpd.log",
            &[
                "gobgpd",
                "-f",
                conf.to_str().unwrap(),
                "--api-hosts",
                &api,
                "--pprof-disable",
                "-p",
                "-l",
                "debug",
            ],
        );
        *self.gobgpd.lock().unwrap() = Some(child);
    }

    /// SIGKILLs gobgpd (`ip netns exec` execs it: same pid).
    fn kill_gobgpd(&self) {
        if let Some(mut child) = self.gobgpd.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The gobgp CLI against the node's gobgpd.
    fn gobgp_cli(&self, args: &[&str]) -> String {
        let port = API_PORT.to_string();
        run(Command::new("ip")
            .args(["netns", "exec", &self.node, "gobgp", "-p", &port])
            .args(args))
    }

    fn birdc(&self, args: &[&str]) -> String {
        let sock = self.dir.join("bird.ctl");
        run(Command::new("birdc").arg("-s").arg(&sock).args(args))
    }

    /// The router's kernel route to `vip` (`ip route show`), if any.
    fn router_route(&self, vip: &str) -> Option<String> {
        let route = kernel_route(&self.router, vip);
        (!route.is_empty()).then_some(route)
    }

    /// Runs `f` on a thread that entered the node namespace, on a runtime
    /// of its own (whose sockets are therefore in the node namespace).
    fn in_node<F: Future<Output = ()>>(&self, f: impl FnOnce() -> F + Send) {
        std::thread::scope(|s| {
            s.spawn(|| {
                let ns = File::open(format!("/run/netns/{}", self.node)).unwrap();
                // SAFETY: a valid namespace fd; only this thread changes.
                let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
                    .block_on(f());
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        });
    }

    fn dump_logs(&self) {
        for name in ["gobgpd.log", "bird.log", "bird.out"] {
            if let Ok(text) = std::fs::read_to_string(self.dir.join(name)) {
                let tail: Vec<_> = text.lines().rev().take(40).collect();
                eprintln!("--- {name} (last lines) ---");
                for l in tail.into_iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.dump_logs();
        }
        for child in [&mut self.gobgpd, &mut self.bird] {
            let child = child.get_mut().unwrap_or_else(|p| p.into_inner());
            if let Some(mut c) = child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        for ns in [&self.node, &self.router] {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls the speaker until its API answers (e.g. right after a start).
async fn wait_api(gobgp: &mut GoBgpAnnouncer) {
    wait_until("gobgpd's API", Duration::from_secs(15), async || {
        gobgp
            .list_peers()
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    })
    .await
}

async fn wait_established(gobgp: &mut GoBgpAnnouncer, peer: IpAddr) {
    let what = format!("peer {peer} established");
    wait_until(&what, WAIT, async || {
        let peers = gobgp.list_peers().await.expect("ListPeer");
        if peers.contains(&(peer, SessionState::Established)) {
            Ok(())
        } else {
            Err(format!("{peers:?}"))
        }
    })
    .await
}

/// Reads `events` until one says `peer` is Established.
async fn watch_established(events: &mut PeerEvents, peer: IpAddr) {
    let wait = async {
        loop {
            let ev = events
                .next()
                .await
                .expect("WatchEvent stream")
                .expect("WatchEvent stream ended");
            if ev.address == Some(peer) && ev.state == SessionState::Established {
                return;
            }
        }
    };
    tokio::time::timeout(WAIT, wait)
        .await
        .unwrap_or_else(|_| panic!("no Established event for {peer} within {WAIT:?}"));
}

fn peer_config() -> PeerConfig {
    PeerConfig {
        hold_time: Some(Duration::from_secs(9)),
        keepalive: Some(Duration::from_secs(3)),
        password: Some(PASSWORD.into()),
        // Direct neighbor, but exercise the field: BIRD does not check the
        // TTL it receives.
        multihop_ttl: Some(2),
        // IPv6 VIPs ride the IPv4 session.
        families: vec![AddressFamily::Ipv4Unicast, AddressFamily::Ipv6Unicast],
        ..PeerConfig::new(ROUTER_V4.parse().unwrap(), ROUTER_ASN)
    }
}

fn vip(addr: &str, extra_community: Option<(u16, u16)>) -> Route {
    let next_hop = if addr.contains(':') { NODE_V6 } else { NODE_V4 };
    let mut communities = vec![(65001, 100)];
    communities.extend(extra_community);
    Route {
        prefix: xlb_tests::bgp_lab::parse_prefix(addr),
        next_hop: next_hop.parse().unwrap(),
        communities,
        // Carried by gobgpd's API both ways (RFC 8092).
        large_communities: vec![(65001, 1, 100)],
        local_pref: Some(200),
    }
}

/// Waits until the router's FIB has every route of `present` via the node
/// and none of `absent`.
async fn router_converges(lab: &Lab, present: &[&str], absent: &[&str]) {
    let what = format!("router FIB with {present:?} and without {absent:?}");
    wait_until(&what, WAIT, async || {
        for v in present {
            let via = if v.contains(':') { NODE_V6 } else { NODE_V4 };
            let got = lab.router_route(v);
            if !got
                .as_ref()
                .is_some_and(|r| r.contains(&format!("via {via} ")))
            {
                return Err(format!("{v}: {got:?}"));
            }
        }
        for v in absent {
            if let Some(got) = lab.router_route(v) {
                return Err(format!("{v} still routed: {got}"));
            }
        }
        Ok(())
    })
    .await
}

#[test]
fn gobgp_driver_against_gobgpd_and_bird_needs_root() {
    let lab = Lab::new();
    let router: IpAddr = ROUTER_V4.parse().unwrap();
    lab.in_node(|| async {
        let config = GoBgpConfig {
            endpoint: format!("http://127.0.0.1:{API_PORT}"),
            ownership: Ownership::Marked(MARKER.0, MARKER.1),
            // Re-added by apply after a gobgpd restart.
            peers: vec![peer_config()],
            ..GoBgpConfig::default()
        };
        let mut gobgp = GoBgpAnnouncer::new(config.clone()).unwrap();
        assert_eq!(gobgp.name(), "gobgp");
        wait_api(&mut gobgp).await;
        assert_eq!(gobgp.list_peers().await.unwrap(), vec![]);

        // AddPeer → Established, in ListPeer and as a WatchEvent.
        let mut events = gobgp.watch_peer_events().await.unwrap();
        gobgp.add_peer(&peer_config()).await.unwrap();
        wait_established(&mut gobgp, router).await;
        watch_established(&mut events, router).await;
        // A second AddPeer for the same neighbor is refused.
        assert!(matches!(
            gobgp.add_peer(&peer_config()).await,
            Err(AnnounceError::Refused(_))
        ));

        // A host route learned from the router.
        wait_until("gobgpd to learn the router's route", WAIT, async || {
            let rib = lab.gobgp_cli(&["global", "rib", "-j"]);
            if rib.contains(&format!("\"{LEARNED}/32\"")) {
                Ok(())
            } else {
                Err(rib)
            }
        })
        .await;

        // A local path that is not ours (no marker).
        lab.gobgp_cli(&[
            "global",
            "rib",
            "add",
            &format!("{FOREIGN}/32"),
            "nexthop",
            NODE_V4,
        ]);

        // Announce two IPv4 VIPs and one IPv6 VIP.
        let full: BTreeSet<Route> = [
            vip("192.0.2.10", None),
            vip("192.0.2.11", Some((65001, 200))),
            vip("2001:db8::10", None),
        ]
        .into();
        assert_eq!(gobgp.apply(&full).await.unwrap(), (3, 0));
        assert_eq!(gobgp.announced().await.unwrap(), full);
        router_converges(
            &lab,
            &["192.0.2.10", "192.0.2.11", "2001:db8::10", FOREIGN],
            &[],
        )
        .await;
        // gobgpd's count of what it advertises the router: the three VIPs
        // and the foreign path.
        wait_until("gobgpd's advertised count", WAIT, async || {
            let sessions = gobgp.peers().await.map_err(|e| e.to_string())?;
            prefixes_sent(&sessions, &[(ROUTER_V4, 4)])
        })
        .await;
        // Communities reach the router (local-pref does not cross eBGP),
        // the marker included.
        let shown = lab.birdc(&["show", "route", "for", "192.0.2.11", "all"]);
        for c in ["(65001,100)", "(65001,200)", "(65001,1)"] {
            assert!(shown.contains(c), "{c} missing at the router: {shown}");
        }
        assert!(
            shown.contains("BGP.large_community: (65001, 1, 100)"),
            "the large community missing at the router: {shown}"
        );

        // Same set: nothing to do.
        assert_eq!(gobgp.apply(&full).await.unwrap(), (0, 0));

        // A pool's covering prefix (a BGPAdvertisement's aggregationLength)
        // is announced and withdrawn like a VIP.
        let mut with_covering = full.clone();
        with_covering.insert(vip("192.0.2.64/28", None));
        assert_eq!(gobgp.apply(&with_covering).await.unwrap(), (1, 0));
        assert_eq!(gobgp.announced().await.unwrap(), with_covering);
        router_converges(&lab, &["192.0.2.64/28"], &[]).await;

        // Peer limits (a BGPAdvertisement's peerSelector) live in gobgpd's
        // export policy: limited to no peer, or to another, the router
        // loses the prefix and keeps the rest; limited to the router, it
        // has it; without limits, nothing of the agent's stays in gobgpd.
        let limit = |prefix: &str, peers: &[IpAddr]| PeerLimit {
            prefix: prefix.parse().unwrap(),
            peers: peers.iter().copied().collect(),
        };
        let elsewhere: IpAddr = "10.201.0.99".parse().unwrap();
        for (limits, present, absent) in [
            (
                vec![limit("192.0.2.64/26", &[])],
                "192.0.2.10",
                "192.0.2.64/28",
            ),
            (vec![limit("192.0.2.64/26", &[router])], "192.0.2.64/28", ""),
            (
                vec![limit("192.0.2.64/28", &[elsewhere])],
                "192.0.2.10",
                "192.0.2.64/28",
            ),
            (vec![], "192.0.2.64/28", ""),
        ] {
            gobgp.set_peer_limits(&limits).unwrap();
            assert_eq!(gobgp.apply(&with_covering).await.unwrap(), (0, 0));
            let absent: &[&str] = if absent.is_empty() { &[] } else { &[absent] };
            router_converges(&lab, &[present, "2001:db8::10"], absent).await;
            let policies = lab.gobgp_cli(&["policy"]);
            assert_eq!(
                policies.contains("xlb-peer-limits"),
                !limits.is_empty(),
                "{limits:?}: {policies}"
            );
        }
        assert_eq!(gobgp.apply(&full).await.unwrap(), (0, 1));
        router_converges(&lab, &[], &["192.0.2.64/28"]).await;

        // Withdraw one VIP; the others and the foreign path stay.
        let mut fewer = full.clone();
        fewer.retain(|r| r.prefix.to_string() != "192.0.2.11/32");
        assert_eq!(gobgp.apply(&fewer).await.unwrap(), (0, 1));
        assert_eq!(gobgp.announced().await.unwrap(), fewer);
        router_converges(
            &lab,
            &["192.0.2.10", "2001:db8::10", FOREIGN],
            &["192.0.2.11"],
        )
        .await;

        // Without a marker, every local host route counts as the agent's,
        // but never a route learned from a peer.
        let mut all_local = GoBgpAnnouncer::new(GoBgpConfig {
            ownership: Ownership::LocallyOriginated,
            peers: vec![],
            ..config.clone()
        })
        .unwrap();
        let seen = all_local.announced().await.unwrap();
        let vips: BTreeSet<String> = seen.iter().map(|r| r.prefix.addr().to_string()).collect();
        assert_eq!(
            vips,
            ["192.0.2.10", "2001:db8::10", FOREIGN]
                .map(String::from)
                .into()
        );
        assert_eq!(all_local.apply(&seen).await.unwrap(), (0, 0));
        let rib = lab.gobgp_cli(&["global", "rib", "-j"]);
        assert!(rib.contains(&format!("\"{LEARNED}/32\"")), "{rib}");

        // gobgpd gone: Unreachable, not Refused.
        lab.kill_gobgpd();
        match gobgp.apply(&full).await {
            Err(AnnounceError::Unreachable(_)) => {}
            other => panic!("apply with gobgpd down: {other:?}"),
        }
        assert!(matches!(
            gobgp.list_peers().await,
            Err(AnnounceError::Unreachable(_))
        ));
        router_converges(&lab, &[], &["192.0.2.10", "2001:db8::10", FOREIGN]).await;

        // gobgpd back, empty: apply re-adds the configured peer and the
        // whole set, and the router gets everything back.
        lab.start_gobgpd();
        wait_api(&mut gobgp).await;
        assert_eq!(gobgp.list_peers().await.unwrap(), vec![]);
        assert_eq!(gobgp.announced().await.unwrap(), BTreeSet::new());
        let mut events = gobgp.watch_peer_events().await.unwrap();
        assert_eq!(gobgp.apply(&full).await.unwrap(), (3, 0));
        watch_established(&mut events, router).await;
        wait_established(&mut gobgp, router).await;
        assert_eq!(gobgp.ensure_peers().await.unwrap(), 0);
        assert_eq!(gobgp.apply(&full).await.unwrap(), (0, 0));
        assert_eq!(gobgp.announced().await.unwrap(), full);
        router_converges(
            &lab,
            &["192.0.2.10", "192.0.2.11", "2001:db8::10"],
            &[FOREIGN],
        )
        .await;
    });
}
