//! The FRR driver against a real FRR (Debian's frr: zebra and bgpd) and a
//! real BIRD router (needs root: creates network namespaces).
//!
//! ```text
//!  node ns (10.99.0.1, fd99::1)               router ns (10.99.0.2, fd99::2)
//!  zebra + bgpd (router bgp 65001)            bird (bgp_lab::BIRD_ROUTER_CONF)
//!   the agent's sessions, through vtysh:
//!   eBGP to 10.99.0.2, AS 65000   -------->    -> kernel FIB (ip route)
//!   iBGP to fd99::2, AS 65001     -------->    -> tables ibgp4/ibgp6 only
//! ```
//!
//! The eBGP session carries the IPv4 VIPs (and their communities) into the
//! router's FIB; the iBGP session, over IPv6, carries the IPv6 VIP, whose
//! LOCAL_PREF shows in the router's ibgp6 table.

use std::{
    collections::BTreeSet,
    fs,
    future::Future,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use lb_agent::bgp::{frr::FrrAnnouncer, AnnounceError, Announcer, PeerLimit, Route};
use xlb_tests::bgp_lab::{
    frr_daemon, frr_daemon_args, ip, kernel_route, peer, prefixes_sent, route, set_up_veth_end,
    states, wait_until, wait_until_blocking, BIRD_ROUTER_CONF, WAIT,
};

/// The namespaces, FRR's daemons, the router's BIRD and the working
/// directory; all removed when dropped.
struct Topology {
    node_ns: String,
    router_ns: String,
    dir: PathBuf,
    zebra: Option<Child>,
    bgpd: Option<Child>,
    router: Option<Child>,
}

impl Topology {
    fn new() -> Topology {
        let pid = std::process::id();
        let topo = Topology {
            node_ns: format!("xfrr-n-{pid}"),
            router_ns: format!("xfrr-r-{pid}"),
            dir: std::env::temp_dir().join(format!("xlb-frr-test-{pid}")),
            zebra: None,
            bgpd: None,
            router: None,
        };
        let _ = fs::remove_dir_all(&topo.dir);
        fs::create_dir_all(topo.frr_dir()).unwrap();
        xlb_tests::bgp_lab::run(Command::new("chown").arg("frr:frr").arg(topo.frr_dir()));
        let (n, r) = (topo.node_ns.as_str(), topo.router_ns.as_str());
        ip(&["netns", "add", n]);
        ip(&["netns", "add", r]);
        ip(&[
            "-n", n, "link", "add", "veth0", "type", "veth", "peer", "name", "veth0", "netns", r,
        ]);
        set_up_veth_end(n, "veth0", "10.99.0.1/24", "fd99::1/64");
        set_up_veth_end(r, "veth0", "10.99.0.2/24", "fd99::2/64");
        topo
    }

    fn frr_dir(&self) -> PathBuf {
        self.dir.join("frr")
    }

    fn spawn(&self, ns: &str, program: &std::path::Path, args: &[String], log: &str) -> Child {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(log))
            .unwrap();
        Command::new("ip")
            .args(["netns", "exec", ns])
            .arg(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", program.display()))
    }

    /// zebra, then bgpd, with FRR's own config: the BGP instance only.
    fn start_frr(&mut self) {
        let conf = self.frr_dir().join("frr.conf");
        if !conf.exists() {
            fs::write(
                &conf,
                "frr defaults traditional\nrouter bgp 65001\n bgp router-id 10.99.0.1\n \
                 bgp graceful-restart-disable\nexit\n",
            )
            .unwrap();
        }
        fs::write(
            self.frr_dir().join("vtysh.conf"),
            "service integrated-vtysh-config\n",
        )
        .unwrap();
        if self.zebra.is_none() {
            let args = frr_daemon_args(&self.frr_dir(), "zebra");
            self.zebra = Some(self.spawn(&self.node_ns, &frr_daemon("zebra"), &args, "zebra.log"));
            let sock = self.frr_dir().join("zserv.api");
            wait_until_blocking("zebra's socket", WAIT, || {
                sock.exists().then_some(()).ok_or_else(|| "absent".into())
            });
        }
        let args = frr_daemon_args(&self.frr_dir(), "bgpd");
        self.bgpd = Some(self.spawn(&self.node_ns, &frr_daemon("bgpd"), &args, "bgpd.log"));
        wait_until_blocking("bgpd answering vtysh", WAIT, || {
            let out = self.vtysh("show running-config");
            out.contains("router bgp 65001").then_some(()).ok_or(out)
        });
    }

    fn start_router(&mut self) {
        fs::write(self.dir.join("router.conf"), BIRD_ROUTER_CONF).unwrap();
        let args: Vec<String> = [
            "-f",
            "-c",
            &self.dir.join("router.conf").display().to_string(),
            "-s",
            &self.dir.join("router.ctl").display().to_string(),
        ]
        .map(String::from)
        .into();
        self.router = Some(self.spawn(
            &self.router_ns,
            std::path::Path::new("bird"),
            &args,
            "router.log",
        ));
    }

    /// `vtysh -c COMMAND` against the node's FRR: output and errors.
    fn vtysh(&self, command: &str) -> String {
        let out = Command::new("vtysh")
            .arg("--vty_socket")
            .arg(self.frr_dir())
            .args(["-c", command])
            .output()
            .expect("run vtysh");
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    fn birdc(&self, args: &[&str]) -> String {
        let out = Command::new("birdc")
            .arg("-s")
            .arg(self.dir.join("router.ctl"))
            .args(args)
            .output()
            .expect("run birdc");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn router_fib(&self, dst: &str) -> String {
        kernel_route(&self.router_ns, dst)
    }

    async fn wait_fib(&self, dst: &str, via: Option<&str>) {
        let what = format!("{dst} via {via:?} in the router's FIB");
        wait_until(&what, WAIT, async || {
            let got = self.router_fib(dst);
            let ok = match via {
                Some(via) => got.starts_with(&format!("{dst} via {via} ")),
                None => got.is_empty(),
            };
            if ok {
                Ok(())
            } else {
                Err(got)
            }
        })
        .await;
    }

    /// Polls until `birdc show route ARGS all` on the router has all of `want`.
    async fn wait_router_route(&self, args: &[&str], want: &[&str]) -> String {
        let mut cmd = vec!["show", "route"];
        cmd.extend_from_slice(args);
        cmd.push("all");
        let what = format!("router: `{}` shows {want:?}", cmd.join(" "));
        wait_until(&what, WAIT, async || {
            let out = self.birdc(&cmd);
            if want.iter().all(|w| out.contains(w)) {
                Ok(out)
            } else {
                Err(out)
            }
        })
        .await
    }

    fn signal_bgpd(&self, sig: i32) {
        let pid: i32 = fs::read_to_string(self.frr_dir().join("bgpd.pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // SAFETY: kill(2) on the bgpd this test started.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
    }

    fn kill_bgpd(&mut self) {
        if let Some(mut c) = self.bgpd.take() {
            self.signal_bgpd(libc::SIGKILL);
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for log in ["bgpd.log", "zebra.log", "router.log"] {
                eprintln!(
                    "--- {log} ---\n{}",
                    fs::read_to_string(self.dir.join(log)).unwrap_or_default()
                );
            }
        }
        for ns in [&self.node_ns, &self.router_ns] {
            // Everything started in them (ip netns exec leaves the daemons
            // as its children's children).
            let pids = Command::new("ip").args(["netns", "pids", ns]).output();
            if let Ok(p) = pids {
                for pid in String::from_utf8_lossy(&p.stdout).split_whitespace() {
                    if let Ok(pid) = pid.parse::<i32>() {
                        // SAFETY: kill(2) on a process in our namespace.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                }
            }
        }
        for c in [&mut self.zebra, &mut self.bgpd, &mut self.router]
            .into_iter()
            .flatten()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
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

fn set(routes: &[&Route]) -> BTreeSet<Route> {
    routes.iter().map(|r| (*r).clone()).collect()
}

#[tokio::test]
async fn frr_announces_changes_and_withdraws_what_the_agent_asks_and_survives_restarts() {
    let mut topo = Topology::new();
    topo.start_router();
    topo.start_frr();
    let peers = vec![peer("10.99.0.2", 65000), peer("fd99::2", 65001)];
    let mut frr = FrrAnnouncer::new(topo.frr_dir(), Some(65001))
        .with_config_dir(topo.frr_dir())
        .with_peers(peers.clone())
        .with_timeout(Duration::from_secs(2));

    // Nothing yet; the sessions come with the first apply.
    assert_eq!(
        with_deadline(frr.announced()).await.unwrap(),
        BTreeSet::new()
    );
    let mut a = route("192.0.2.10", "10.99.0.1", &[(65000, 100), (65000, 1)], None);
    a.large_communities = vec![(65000, 1, 2), (65000, 0, 1)];
    let b = route("192.0.2.11", "10.99.0.1", &[], None);
    let v6 = route("2001:db8::10", "fd99::1", &[(65000, 6)], Some(300));
    // A pool's covering prefix (a BGPAdvertisement's aggregationLength).
    let covering = route("192.0.2.64/28", "10.99.0.1", &[(65000, 28)], None);
    let desired = set(&[&a, &b, &v6, &covering]);
    assert_eq!(with_deadline(frr.apply(&desired)).await.unwrap(), (4, 0));
    assert_eq!(
        with_deadline(frr.announced()).await.unwrap(),
        desired.iter().map(Route::normalized).collect()
    );
    topo.wait_fib("192.0.2.10", Some("10.99.0.1")).await;
    topo.wait_fib("192.0.2.11", Some("10.99.0.1")).await;
    topo.wait_fib("192.0.2.64/28", Some("10.99.0.1")).await;
    topo.wait_router_route(&["192.0.2.64/28", "protocol", "node"], &["(65000,28)"])
        .await;
    topo.wait_router_route(
        &["192.0.2.10/32", "protocol", "node"],
        &[
            "BGP.community: (65000,1) (65000,100)",
            "BGP.large_community: (65000, 0, 1) (65000, 1, 2)",
        ],
    )
    .await;
    // LOCAL_PREF crosses iBGP only: the IPv6 VIP over the IPv6 session.
    topo.wait_router_route(
        &["table", "ibgp6", "2001:db8::10/128"],
        &["BGP.local_pref: 300", "BGP.community: (65000,6)"],
    )
    .await;
    let sessions = with_deadline(frr.peers()).await.unwrap();
    assert_eq!(
        states(&sessions),
        [
            ("10.99.0.2".parse().unwrap(), true),
            ("fd99::2".parse().unwrap(), true)
        ],
        "{}",
        topo.vtysh("show bgp summary")
    );
    // FRR's counts: the IPv4 session carries the three IPv4 routes, the
    // IPv6 one those and the IPv6 VIP.
    wait_until("FRR's sent-prefix counts", WAIT, async || {
        let sessions = with_deadline(frr.peers())
            .await
            .map_err(|e| e.to_string())?;
        prefixes_sent(&sessions, &[("10.99.0.2", 3), ("fd99::2", 4)])
    })
    .await;

    // Peer limits (a BGPAdvertisement's peerSelector) become the sessions'
    // outbound route maps, in both families. The router's FIB has what the
    // eBGP session (10.99.0.2) brings, its table ibgp4 what the iBGP one
    // (fd99::2) brings.
    let in_ibgp4 = |want: bool| {
        let topo = &topo;
        async move {
            let what = format!("192.0.2.64/28 in the router's ibgp4: {want}");
            wait_until(&what, WAIT, async || {
                let out = topo.birdc(&["show", "route", "table", "ibgp4", "192.0.2.64/28"]);
                if out.contains("192.0.2.64/28") == want {
                    Ok(())
                } else {
                    Err(out)
                }
            })
            .await
        }
    };
    let limit = |peers: &[&str]| PeerLimit {
        prefix: "192.0.2.64/26".parse().unwrap(),
        peers: peers.iter().map(|p| p.parse().unwrap()).collect(),
    };
    for (limits, ebgp, ibgp) in [
        (vec![limit(&["fd99::2"])], false, true),
        (vec![limit(&[])], false, false),
        (vec![limit(&["10.99.0.2"])], true, false),
        (vec![], true, true),
    ] {
        frr.set_peer_limits(&limits).unwrap();
        assert_eq!(with_deadline(frr.apply(&desired)).await.unwrap(), (0, 0));
        topo.wait_fib("192.0.2.64/28", ebgp.then_some("10.99.0.1"))
            .await;
        in_ibgp4(ibgp).await;
        // The other routes stay.
        topo.wait_fib("192.0.2.10", Some("10.99.0.1")).await;
    }

    // The same set again: nothing sent (the saved config is not rewritten).
    let saved = fs::metadata(topo.frr_dir().join("frr.conf"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(with_deadline(frr.apply(&desired)).await.unwrap(), (0, 0));
    let saved_again = fs::metadata(topo.frr_dir().join("frr.conf"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(saved, saved_again);

    // Withdraw b and the covering prefix; a gets another community
    // (replaced: one in, one out).
    let a2 = route("192.0.2.10", "10.99.0.1", &[(65000, 7)], None);
    let desired = set(&[&a2, &v6]);
    assert_eq!(with_deadline(frr.apply(&desired)).await.unwrap(), (1, 3));
    topo.wait_fib("192.0.2.11", None).await;
    topo.wait_fib("192.0.2.64/28", None).await;
    topo.wait_router_route(
        &["192.0.2.10/32", "protocol", "node"],
        &["BGP.community: (65000,7)\n"],
    )
    .await;
    let running = topo.vtysh("show running-config");
    assert_eq!(
        running.matches("route-map xlb-vip-").count(),
        // Each VIP's network statement and its map: no map left behind.
        2 * 2,
        "{running}"
    );

    // A route FRR would not announce as meant is refused before anything
    // is sent.
    let bad = route("2001:db8::11", "10.99.0.1", &[], None);
    match with_deadline(frr.apply(&set(&[&a2, &v6, &bad]))).await {
        Err(AnnounceError::Refused(m)) => assert!(m.contains("family"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(with_deadline(frr.announced()).await.unwrap(), desired);

    // FRR itself refuses: BFD without bfdd running. FRR's message comes
    // back; the routes stay as they were.
    let mut with_bfd = peers.clone();
    with_bfd[0].bfd = Some(lb_agent::config::Bfd::DEFAULT);
    frr.set_peers(&with_bfd).unwrap();
    match with_deadline(frr.apply(&desired)).await {
        Err(AnnounceError::Refused(m)) => assert!(m.contains("bfdd is not running"), "{m}"),
        other => panic!("BFD without bfdd: {other:?}"),
    }
    frr.set_peers(&peers).unwrap();
    assert_eq!(with_deadline(frr.apply(&desired)).await.unwrap(), (0, 0));
    topo.wait_fib("192.0.2.10", Some("10.99.0.1")).await;

    // A hung bgpd (SIGSTOP): Unreachable after the timeout.
    topo.signal_bgpd(libc::SIGSTOP);
    let hung = with_deadline(frr.apply(&desired)).await;
    topo.signal_bgpd(libc::SIGCONT);
    match hung {
        Err(AnnounceError::Unreachable(m)) => assert!(m.contains("no answer"), "{m}"),
        other => panic!("hung bgpd: {other:?}"),
    }

    // bgpd gone: Unreachable; the router loses the routes.
    topo.kill_bgpd();
    match with_deadline(frr.apply(&desired)).await {
        Err(AnnounceError::Unreachable(m)) => {
            assert!(m.contains(&topo.frr_dir().display().to_string()), "{m}")
        }
        other => panic!("bgpd killed: {other:?}"),
    }
    topo.wait_fib("192.0.2.10", None).await;

    // bgpd restarted reads the config the agent saved: the VIPs and the
    // sessions are back before the next apply, which then sends nothing.
    topo.start_frr();
    assert_eq!(with_deadline(frr.announced()).await.unwrap(), desired);
    topo.wait_fib("192.0.2.10", Some("10.99.0.1")).await;
    assert_eq!(with_deadline(frr.apply(&desired)).await.unwrap(), (0, 0));

    // The agent leaves: everything withdrawn, its sessions removed.
    frr.set_peers(&[]).unwrap();
    assert_eq!(
        with_deadline(frr.apply(&BTreeSet::new())).await.unwrap(),
        (0, 2)
    );
    topo.wait_fib("192.0.2.10", None).await;
    let running = topo.vtysh("show running-config");
    assert!(
        !running.contains("xlb") && running.contains("router bgp 65001"),
        "{running}"
    );
}
