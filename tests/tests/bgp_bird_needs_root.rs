//! The BIRD 2 driver against real BIRD daemons (needs root and bird2:
//! creates network namespaces).
//!
//! Topology: two namespaces joined by a veth, each running its own BIRD.
//!
//! ```text
//!  node ns (10.99.0.1, fd99::1)              router ns (10.99.0.2, fd99::2)
//!  bird -c node.conf                         bird -c router.conf
//!   static xlb_vips4/6 <- files               eBGP (AS 65000) <- node AS 65001
//!   eBGP over 10.99.0.x, AS 65001   ------->    -> master4/6 -> kernel FIB
//!   iBGP over fd99::x,   AS 65001   ------->  iBGP (AS 65001, v6 transport)
//!                                               -> tables ibgp4/ibgp6 only
//! ```
//!
//! The eBGP session feeds the router's kernel FIB (checked with `ip route`)
//! and shows communities. LOCAL_PREF never crosses eBGP, so a second, iBGP
//! session (over IPv6 transport, so it does not collide with the eBGP one)
//! lands in separate tables on the router that are not exported anywhere,
//! where the local preference (and the next hop over iBGP) is checked.

use std::{
    collections::BTreeSet,
    fs,
    future::Future,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use lb_agent::bgp::{
    bird::BirdAnnouncer, task::AnnounceTask, AnnounceError, Announcer, PeerLimit, Route,
};
use xlb_tests::bgp_lab::{
    ip, kernel_route, peer, prefixes_sent, route, states, wait_metrics, wait_until,
    wait_until_blocking, BIRD_ROUTER_CONF, WAIT,
};

const NODE_CONF_TAIL: &str = r#"
protocol bgp upstream {
    local 10.99.0.1 as 65001;
    neighbor 10.99.0.2 as 65000;
    connect delay time 1;
    connect retry time 1;
    error wait time 1, 2;
    ipv4 { import none; export where proto = "xlb_vips4"; };
    ipv6 { import none; export where proto = "xlb_vips6"; };
}

protocol bgp upstream_ibgp {
    local fd99::1 as 65001;
    neighbor fd99::2 as 65001;
    direct;
    connect delay time 1;
    connect retry time 1;
    error wait time 1, 2;
    ipv4 { import none; export where proto = "xlb_vips4"; };
    ipv6 { import none; export where proto = "xlb_vips6"; };
}
"#;

/// A BIRD running in a namespace; killed (and reaped) when dropped.
struct Bird {
    child: Child,
    ctl: PathBuf,
    log: PathBuf,
}

impl Bird {
    fn start(ns: &str, conf: &Path, ctl: &Path, log: &Path) -> Bird {
        let _ = fs::remove_file(ctl);
        let log_file = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", ns, "bird", "-f", "-c"])
            .arg(conf)
            .arg("-s")
            .arg(ctl)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("start bird (is bird2 installed?)");
        Bird {
            child,
            ctl: ctl.into(),
            log: log.into(),
        }
    }

    /// `birdc -s CTL ARGS`: stdout, or the error output.
    fn birdc(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("birdc")
            .arg("-s")
            .arg(&self.ctl)
            .args(args)
            .output()
            .expect("run birdc");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            Ok(stdout)
        } else {
            Err(format!("{stdout}{}", String::from_utf8_lossy(&out.stderr)))
        }
    }

    /// Stops BIRD the way systemd does (SIGTERM) and waits for it.
    fn stop(mut self) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        wait_until_blocking("bird to stop on SIGTERM", WAIT, || {
            match self.child.try_wait().unwrap() {
                Some(_) => Ok(()),
                None => Err("still running".into()),
            }
        });
    }
}

impl Drop for Bird {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "--- {} ---\n{}",
                self.log.display(),
                fs::read_to_string(&self.log).unwrap_or_default()
            );
        }
    }
}

/// The two namespaces, their BIRDs and the working directory; all removed
/// when dropped, test passed or not.
struct Topology {
    node_ns: String,
    router_ns: String,
    dir: PathBuf,
    node: Option<Bird>,
    router: Option<Bird>,
}

impl Topology {
    /// `tag` keeps the tests of this file (one process) apart.
    fn new(tag: &str) -> Topology {
        let pid = std::process::id();
        let topo = Topology {
            node_ns: format!("xbird-n-{pid}{tag}"),
            router_ns: format!("xbird-r-{pid}{tag}"),
            dir: std::env::temp_dir().join(format!("xlb-bird-test-{pid}{tag}")),
            node: None,
            router: None,
        };
        let _ = fs::remove_dir_all(&topo.dir);
        fs::create_dir_all(&topo.dir).unwrap();
        let (n, r) = (topo.node_ns.as_str(), topo.router_ns.as_str());
        ip(&["netns", "add", n]);
        ip(&["netns", "add", r]);
        ip(&[
            "-n", n, "link", "add", "veth0", "type", "veth", "peer", "name", "veth0", "netns", r,
        ]);
        xlb_tests::bgp_lab::set_up_veth_end(n, "veth0", "10.99.0.1/24", "fd99::1/64");
        xlb_tests::bgp_lab::set_up_veth_end(r, "veth0", "10.99.0.2/24", "fd99::2/64");
        topo
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    fn start_node(&mut self) {
        assert!(self.node.is_none());
        self.node = Some(Bird::start(
            &self.node_ns,
            &self.path("node.conf"),
            &self.path("node.ctl"),
            &self.path("node.log"),
        ));
    }

    fn start_router(&mut self) {
        fs::write(self.path("router.conf"), BIRD_ROUTER_CONF).unwrap();
        self.router = Some(Bird::start(
            &self.router_ns,
            &self.path("router.conf"),
            &self.path("router.ctl"),
            &self.path("router.log"),
        ));
    }

    fn node(&self) -> &Bird {
        self.node.as_ref().expect("node bird running")
    }

    fn router(&self) -> &Bird {
        self.router.as_ref().expect("router bird running")
    }

    /// The router's kernel route for `dst` (`ip route show DST`), "" if none.
    fn router_fib(&self, dst: &str) -> String {
        kernel_route(&self.router_ns, dst)
    }

    /// Polls until both of the node's sessions are up.
    async fn wait_established(&mut self) {
        wait_until("both BGP sessions Established", WAIT, async || {
            for bird in [&mut self.node, &mut self.router].into_iter().flatten() {
                if let Some(status) = bird.child.try_wait().unwrap() {
                    panic!("bird {} exited: {status}", bird.ctl.display());
                }
            }
            let out = self.node().birdc(&["show", "protocols"])?;
            let up = out
                .lines()
                .filter(|l| l.starts_with("upstream") && l.contains("Established"))
                .count();
            if up == 2 {
                Ok(())
            } else {
                Err(out)
            }
        })
        .await;
    }

    /// Polls until the router's FIB holds `dst` via `via`.
    async fn wait_fib(&self, dst: &str, via: &str) {
        let want = format!("{dst} via {via} ");
        let what = format!("{dst} via {via} in the router's FIB");
        wait_until(&what, WAIT, async || {
            let got = self.router_fib(dst);
            if got.starts_with(&want) {
                Ok(())
            } else {
                Err(got)
            }
        })
        .await;
    }

    /// Polls until the router's FIB has no route for `dst`.
    async fn wait_no_fib(&self, dst: &str) {
        let what = format!("{dst} gone from the router's FIB");
        wait_until(&what, WAIT, async || {
            let got = self.router_fib(dst);
            if got.is_empty() {
                Ok(())
            } else {
                Err(got)
            }
        })
        .await;
    }

    /// Polls until `birdc show route ARGS all` on the router contains all of `want`.
    async fn wait_router_route(&self, args: &[&str], want: &[&str]) -> String {
        let mut cmd = vec!["show", "route"];
        cmd.extend_from_slice(args);
        cmd.push("all");
        let what = format!("router: `{}` shows {want:?}", cmd.join(" "));
        wait_until(&what, WAIT, async || {
            let out = self.router().birdc(&cmd)?;
            if want.iter().all(|w| out.contains(w)) {
                Ok(out)
            } else {
                Err(out)
            }
        })
        .await
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        drop(self.node.take());
        drop(self.router.take());
        for ns in [&self.node_ns, &self.router_ns] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

async fn with_deadline<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, f)
        .await
        .expect("announcer call hung")
}

/// The node's BIRD configured with the announcer's static protocols, both
/// daemons started, the session up; returns the announcer.
async fn start_established(topo: &mut Topology) -> BirdAnnouncer {
    let bird = BirdAnnouncer::new(topo.path("xlb-vips"), topo.path("node.ctl"));
    bird.ensure_files().unwrap();
    fs::write(
        topo.path("node.conf"),
        format!(
            "log stderr all;\nrouter id 10.99.0.1;\nprotocol device {{}}\n\n{}{NODE_CONF_TAIL}",
            bird.static_protocols_config()
        ),
    )
    .unwrap();
    topo.start_router();
    topo.start_node();
    topo.wait_established().await;
    bird
}

fn set(routes: &[&Route]) -> BTreeSet<Route> {
    routes.iter().map(|r| (*r).clone()).collect()
}

#[tokio::test]
async fn bird_announces_withdraws_refuses_and_recovers() {
    let mut topo = Topology::new("a");
    let mut bird = start_established(&mut topo).await;

    // Nothing announced yet.
    assert_eq!(
        with_deadline(bird.announced()).await.unwrap(),
        BTreeSet::new()
    );

    // Two v4 VIPs and one v6 VIP. Communities out of order and repeated:
    // BIRD keeps a sorted set, and so does announced().
    let mut a = route(
        "192.0.2.10",
        "10.99.0.1",
        &[(65000, 100), (65000, 7), (65000, 100)],
        Some(200),
    );
    a.large_communities = vec![(65000, 1, 2), (65000, 0, 1), (65000, 1, 2)];
    let mut a_norm = route(
        "192.0.2.10",
        "10.99.0.1",
        &[(65000, 7), (65000, 100)],
        Some(200),
    );
    a_norm.large_communities = vec![(65000, 0, 1), (65000, 1, 2)];
    let b = route("192.0.2.11", "10.99.0.1", &[], None);
    let c = route("2001:db8::10", "fd99::1", &[(65000, 600)], Some(150));
    // A pool's covering prefix (a BGPAdvertisement's aggregationLength).
    let covering = route("192.0.2.64/28", "10.99.0.1", &[(65000, 28)], None);
    let desired = set(&[&a, &b, &c, &covering]);
    assert_eq!(with_deadline(bird.apply(&desired)).await.unwrap(), (4, 0));
    assert_eq!(
        with_deadline(bird.announced()).await.unwrap(),
        set(&[&a_norm, &b, &c, &covering])
    );
    topo.wait_fib("192.0.2.10", "10.99.0.1").await;
    topo.wait_fib("192.0.2.11", "10.99.0.1").await;
    topo.wait_fib("192.0.2.64/28", "10.99.0.1").await;
    // What BIRD counts: each session exports the three IPv4 routes and the
    // IPv6 one.
    wait_until("BIRD's export counts", WAIT, async || {
        let sessions = with_deadline(bird.peers())
            .await
            .map_err(|e| e.to_string())?;
        prefixes_sent(&sessions, &[("10.99.0.2", 4), ("fd99::2", 4)])
    })
    .await;
    topo.wait_fib("2001:db8::10", "fd99::1").await;

    // Communities crossed eBGP; LOCAL_PREF and the next hop crossed iBGP.
    let router_shows: [(&[&str], &[&str]); 4] = [
        (
            &["192.0.2.10/32", "protocol", "node"],
            &[
                "BGP.community: (65000,7) (65000,100)",
                "BGP.large_community: (65000, 0, 1) (65000, 1, 2)",
                "BGP.next_hop: 10.99.0.1",
            ],
        ),
        (
            &["2001:db8::10/128", "protocol", "node"],
            &["BGP.community: (65000,600)", "BGP.next_hop: fd99::1"],
        ),
        (
            &["table", "ibgp4", "192.0.2.10/32"],
            &[
                "BGP.local_pref: 200",
                "BGP.next_hop: 10.99.0.1",
                "(65000,100)",
            ],
        ),
        (
            &["table", "ibgp6", "2001:db8::10/128"],
            &["BGP.local_pref: 150", "BGP.next_hop: fd99::1"],
        ),
    ];
    for (query, want) in router_shows {
        topo.wait_router_route(query, want).await;
    }
    let no_lp = topo
        .wait_router_route(
            &["table", "ibgp4", "192.0.2.11/32"],
            &["BGP.local_pref: 100"],
        )
        .await;
    assert!(!no_lp.contains("BGP.community"), "{no_lp}");

    // The same set again: nothing to do, the files stay as they are. (BIRD's
    // "last reconfiguration" time is not compared: the previous apply's
    // reconfiguration may still be finishing when it is read.)
    let file_v4 = fs::read(bird.routes_file_v4()).unwrap();
    assert_eq!(with_deadline(bird.apply(&desired)).await.unwrap(), (0, 0));
    assert_eq!(fs::read(bird.routes_file_v4()).unwrap(), file_v4);

    // Withdraw one VIP and the covering prefix.
    let desired = set(&[&a, &c]);
    assert_eq!(with_deadline(bird.apply(&desired)).await.unwrap(), (0, 2));
    topo.wait_no_fib("192.0.2.11").await;
    topo.wait_no_fib("192.0.2.64/28").await;
    topo.wait_fib("192.0.2.10", "10.99.0.1").await;
    topo.wait_fib("2001:db8::10", "fd99::1").await;

    // Changing a route's attributes replaces it: one added, one withdrawn.
    let a2 = route("192.0.2.10", "10.99.0.1", &[(65000, 7)], Some(300));
    let desired = set(&[&a2, &c]);
    assert_eq!(with_deadline(bird.apply(&desired)).await.unwrap(), (1, 1));
    let shown = topo
        .wait_router_route(
            &["table", "ibgp4", "192.0.2.10/32"],
            &["BGP.local_pref: 300"],
        )
        .await;
    assert!(shown.contains("BGP.community: (65000,7)\n"), "{shown}");

    // A route BIRD would take but not announce as meant (an IPv4 next hop
    // for an IPv6 VIP: BIRD's BGP would drop it at export) is refused
    // before anything is written.
    let files_before = (
        fs::read(bird.routes_file_v4()).unwrap(),
        fs::read(bird.routes_file_v6()).unwrap(),
    );
    let bad = route("2001:db8::99", "10.99.0.1", &[], None);
    match with_deadline(bird.apply(&set(&[&a2, &c, &bad]))).await {
        Err(AnnounceError::Refused(m)) => assert!(m.contains("family"), "{m}"),
        other => panic!("expected Refused, got {other:?}"),
    }
    assert_eq!(
        (
            fs::read(bird.routes_file_v4()).unwrap(),
            fs::read(bird.routes_file_v6()).unwrap()
        ),
        files_before
    );

    // BIRD itself refuses: its config is broken (an operator's bad edit).
    // The previous files are put back and BIRD keeps announcing the old set.
    let node_conf = fs::read_to_string(topo.path("node.conf")).unwrap();
    fs::write(
        topo.path("node.conf"),
        format!("{node_conf}\nthis is not a bird statement;\n"),
    )
    .unwrap();
    let d = route("192.0.2.12", "10.99.0.1", &[], None);
    match with_deadline(bird.apply(&set(&[&a2, &c, &d]))).await {
        Err(AnnounceError::Refused(m)) => {
            assert!(m.contains("node.conf") && m.contains("syntax error"), "{m}")
        }
        other => panic!("expected Refused, got {other:?}"),
    }
    assert_eq!(
        (
            fs::read(bird.routes_file_v4()).unwrap(),
            fs::read(bird.routes_file_v6()).unwrap()
        ),
        files_before,
        "the previous routes files are restored"
    );
    assert_eq!(with_deadline(bird.announced()).await.unwrap(), desired);
    assert_eq!(topo.router_fib("192.0.2.12"), "");
    topo.wait_fib("192.0.2.10", "10.99.0.1").await;
    // Config fixed: the same apply goes through.
    fs::write(topo.path("node.conf"), &node_conf).unwrap();
    assert_eq!(
        with_deadline(bird.apply(&set(&[&a2, &c, &d])))
            .await
            .unwrap(),
        (1, 0)
    );
    topo.wait_fib("192.0.2.12", "10.99.0.1").await;
    let desired = set(&[&a2, &c, &d]);

    // A config without the static protocols: Refused, saying what is missing.
    let mut unknown =
        BirdAnnouncer::new(topo.path("other"), topo.path("node.ctl")).with_protocol("no_such_vips");
    match with_deadline(unknown.announced()).await {
        Err(AnnounceError::Refused(m)) => {
            assert!(m.contains("protocol static no_such_vips4"), "{m}")
        }
        other => panic!("expected Refused, got {other:?}"),
    }

    // A hung BIRD (SIGSTOP): Unreachable after the timeout, files untouched.
    let pid = topo.node().child.id() as i32;
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let mut impatient = bird.clone().with_timeout(Duration::from_millis(500));
    let result = with_deadline(impatient.apply(&set(&[&a2]))).await;
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    match result {
        Err(AnnounceError::Unreachable(m)) => assert!(m.contains("no answer"), "{m}"),
        other => panic!("expected Unreachable, got {other:?}"),
    }
    assert_eq!(with_deadline(bird.announced()).await.unwrap(), desired);

    // BIRD stopped: Unreachable, files untouched; the router loses the routes.
    topo.node.take().unwrap().stop();
    let files_before = (
        fs::read(bird.routes_file_v4()).unwrap(),
        fs::read(bird.routes_file_v6()).unwrap(),
    );
    match with_deadline(bird.apply(&set(&[&a2]))).await {
        Err(AnnounceError::Unreachable(m)) => assert!(m.contains("node.ctl"), "{m}"),
        other => panic!("expected Unreachable, got {other:?}"),
    }
    match with_deadline(bird.announced()).await {
        Err(AnnounceError::Unreachable(_)) => {}
        other => panic!("expected Unreachable, got {other:?}"),
    }
    assert_eq!(
        (
            fs::read(bird.routes_file_v4()).unwrap(),
            fs::read(bird.routes_file_v6()).unwrap()
        ),
        files_before
    );
    topo.wait_no_fib("192.0.2.10").await;
    topo.wait_no_fib("2001:db8::10").await;

    // BIRD restarted with the files in place announces them by itself:
    // the next apply finds them (announced() asks BIRD) and does nothing.
    topo.start_node();
    topo.wait_established().await;
    topo.wait_fib("192.0.2.10", "10.99.0.1").await;
    topo.wait_fib("2001:db8::10", "fd99::1").await;
    assert_eq!(with_deadline(bird.announced()).await.unwrap(), desired);
    assert_eq!(with_deadline(bird.apply(&desired)).await.unwrap(), (0, 0));

    // BIRD restarted empty (a fresh node: the files are gone). BIRD cannot
    // even start while an included file is missing; ensure_files() creates
    // them empty, and the next apply announces everything again.
    topo.node.take().unwrap().stop();
    fs::remove_file(bird.routes_file_v4()).unwrap();
    fs::remove_file(bird.routes_file_v6()).unwrap();
    let check = Command::new("bird")
        .arg("-p")
        .arg("-c")
        .arg(topo.path("node.conf"))
        .output()
        .unwrap();
    assert!(!check.status.success(), "bird -p accepts a missing include");
    bird.ensure_files().unwrap();
    topo.start_node();
    topo.wait_established().await;
    assert_eq!(
        with_deadline(bird.announced()).await.unwrap(),
        BTreeSet::new()
    );
    assert_eq!(topo.router_fib("192.0.2.10"), "");
    assert_eq!(with_deadline(bird.apply(&desired)).await.unwrap(), (3, 0));
    topo.wait_fib("192.0.2.10", "10.99.0.1").await;
    topo.wait_fib("192.0.2.12", "10.99.0.1").await;
    topo.wait_fib("2001:db8::10", "fd99::1").await;
    assert_eq!(with_deadline(bird.apply(&desired)).await.unwrap(), (0, 0));
}

/// Per-peer session state: BIRD's two sessions are read from `birdc show
/// protocols all`, and the announce task exports them as `xlb_bgp_peer_up`:
/// 1 while established, 0 once the router is gone, 0 too while the node's
/// BIRD cannot be asked, and 1 again when everything is back.
#[tokio::test]
async fn bird_session_state_per_peer() {
    let mut topo = Topology::new("p");
    let mut bird = start_established(&mut topo).await;

    let v4: std::net::IpAddr = "10.99.0.2".parse().unwrap();
    let v6: std::net::IpAddr = "fd99::2".parse().unwrap();
    let sessions = with_deadline(bird.peers()).await.unwrap();
    assert_eq!(states(&sessions), vec![(v4, true), (v6, true)]);
    // Nothing announced here; up for less than the test has run.
    prefixes_sent(&sessions, &[("10.99.0.2", 0), ("fd99::2", 0)]).unwrap();
    assert!(
        sessions.iter().all(|s| s.uptime < Some(WAIT * 2)),
        "{sessions:?}"
    );

    let registry = prometheus::Registry::new();
    let task = AnnounceTask::start(
        Box::new(bird.clone()),
        Duration::from_millis(200),
        &registry,
    );
    let up = [
        "xlb_bgp_peer_up{peer=\"10.99.0.2\"} 1",
        "xlb_bgp_peer_up{peer=\"fd99::2\"} 1",
        // Nothing announced in this test.
        "xlb_bgp_peer_prefixes_sent{peer=\"10.99.0.2\"} 0",
        "xlb_bgp_peer_prefixes_sent{peer=\"fd99::2\"} 0",
    ];
    let down = [
        "xlb_bgp_peer_up{peer=\"10.99.0.2\"} 0",
        "xlb_bgp_peer_up{peer=\"fd99::2\"} 0",
        "xlb_bgp_peer_uptime_seconds{peer=\"10.99.0.2\"} 0",
        "xlb_bgp_peer_uptime_seconds{peer=\"fd99::2\"} 0",
    ];
    wait_metrics("both peers up", WAIT, &registry, &up).await;

    // The router goes away: the node's sessions leave Established.
    topo.router.take().unwrap().stop();
    wait_until("both sessions down", WAIT, async || {
        let peers = with_deadline(bird.peers()).await.unwrap();
        if states(&peers) == vec![(v4, false), (v6, false)] {
            Ok(())
        } else {
            Err(format!("{peers:?}"))
        }
    })
    .await;
    wait_metrics("both peers down", WAIT, &registry, &down).await;

    // The router comes back: up again.
    topo.start_router();
    topo.wait_established().await;
    wait_metrics("both peers up again", WAIT, &registry, &up).await;

    // The node's BIRD stops: it cannot be asked, so its peers read 0.
    topo.node.take().unwrap().stop();
    assert!(matches!(
        with_deadline(bird.peers()).await,
        Err(AnnounceError::Unreachable(_))
    ));
    wait_metrics("peers 0 while BIRD is gone", WAIT, &registry, &down).await;
    drop(task);
}

/// Peer limits (a BGPAdvertisement's peerSelector) are written into the
/// export filters of the sessions the agent writes: a covering prefix
/// limited to no session of its family leaves the router while the other
/// routes stay; allowed again, it comes back; an IPv6 limit takes the
/// IPv6 VIP from the IPv6 session.
#[tokio::test]
async fn bird_holds_limited_routes_back_from_the_sessions_it_writes() {
    let mut topo = Topology::new("l");
    let sessions_file = topo.path("xlb-sessions.conf");
    let mut bird = BirdAnnouncer::new(topo.path("xlb-vips"), topo.path("node.ctl")).with_sessions(
        &sessions_file,
        65001,
        vec![peer("10.99.0.2", 65000), peer("fd99::2", 65001)],
    );
    bird.ensure_files().unwrap();
    fs::write(
        topo.path("node.conf"),
        format!(
            "log stderr all;\nrouter id 10.99.0.1;\nprotocol device {{}}\n\n{}\ninclude \"{}\";\n",
            bird.static_protocols_config(),
            sessions_file.display()
        ),
    )
    .unwrap();
    topo.start_router();
    topo.start_node();
    // BIRD's control socket is there once it answers.
    wait_until("the node's BIRD to answer", WAIT, async || {
        with_deadline(bird.peers()).await.map_err(|e| e.to_string())
    })
    .await;

    let vip = route("192.0.2.10", "10.99.0.1", &[], None);
    let covering = route("192.0.2.64/28", "10.99.0.1", &[], None);
    let v6 = route("2001:db8::10", "fd99::1", &[], None);
    let desired = set(&[&vip, &covering, &v6]);
    let limit = |prefix: &str, peers: &[&str]| PeerLimit {
        prefix: prefix.parse().unwrap(),
        peers: peers.iter().map(|p| p.parse().unwrap()).collect(),
    };
    let steps = [
        // First everything, so that what goes is seen going.
        (
            vec![],
            vec!["192.0.2.10", "192.0.2.64/28", "2001:db8::10"],
            vec![],
        ),
        // Allowed on the IPv6 session only, which carries no IPv4.
        (
            vec![limit("192.0.2.64/26", &["fd99::2"])],
            vec!["192.0.2.10", "2001:db8::10"],
            vec!["192.0.2.64/28"],
        ),
        (
            vec![limit("192.0.2.64/26", &["10.99.0.2"])],
            vec!["192.0.2.64/28", "2001:db8::10"],
            vec![],
        ),
        (
            vec![limit("2001:db8::/64", &[])],
            vec!["192.0.2.10", "192.0.2.64/28"],
            vec!["2001:db8::10"],
        ),
        (vec![], vec!["192.0.2.64/28", "2001:db8::10"], vec![]),
    ];
    for (limits, present, absent) in steps {
        bird.set_peer_limits(&limits).unwrap();
        with_deadline(bird.apply(&desired)).await.unwrap();
        // IPv4 over the eBGP session lands in the router's FIB; IPv6 over
        // the iBGP session in its table ibgp6.
        let v6_table = |dst: &str| format!("{dst}/128");
        for dst in present {
            if dst.contains(':') {
                topo.wait_router_route(
                    &["table", "ibgp6", &v6_table(dst)],
                    &["BGP.next_hop: fd99::1"],
                )
                .await;
            } else {
                topo.wait_fib(dst, "10.99.0.1").await;
            }
        }
        for dst in absent {
            if dst.contains(':') {
                let query = ["show", "route", "table", "ibgp6", &v6_table(dst)];
                wait_until("the IPv6 VIP gone from ibgp6", WAIT, async || {
                    match topo.router().birdc(&query) {
                        Err(e) if e.contains("Network not found") => Ok(()),
                        Err(e) => Err(e),
                        Ok(out) => Err(out),
                    }
                })
                .await;
            } else {
                topo.wait_no_fib(dst).await;
            }
        }
    }
}
