//! The ExaBGP driver against real daemons (needs root, `exabgp` 4.2 and
//! `bird` 2 installed). Two network namespaces joined by a veth: the node
//! runs ExaBGP (AS 65001) with its API pipes in a temporary directory; the
//! router runs BIRD 2 (AS 65000), which exports what it learns to its kernel
//! table, so the checks read the router's real FIB.

use std::{
    collections::BTreeSet,
    fs::{self, File, OpenOptions},
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    thread,
    time::Duration,
};

use ipnet::IpNet;
use lb_agent::bgp::{exabgp::ExaBgpAnnouncer, task::AnnounceTask, AnnounceError, Announcer, Route};
use xlb_tests::bgp_lab::{
    ip, kernel_route, prefixes_sent, route, run, states, wait_metrics, wait_until_blocking, WAIT,
};

const NODE_V4: &str = "10.200.0.2";
const ROUTER_V4: &str = "10.200.0.1";
const NODE_V6: &str = "fd00:200::2";
const ROUTER_V6: &str = "fd00:200::1";

/// Two namespaces, a veth, the daemons and their files. Dropping it (also
/// when a check panics) kills the daemons and removes everything.
struct Lab {
    node: String,
    router: String,
    veth_node: String,
    veth_router: String,
    dir: PathBuf,
    pipe_name: String,
    exabgp: Option<Child>,
    bird: Option<Child>,
}

impl Lab {
    fn new(tag: &str) -> Lab {
        let pid = std::process::id();
        let dir = std::env::temp_dir().join(format!("xlb-exabgp-{pid}-{tag}"));
        let lab = Lab {
            node: format!("xlb-exa-node-{pid}-{tag}"),
            router: format!("xlb-exa-rtr-{pid}-{tag}"),
            veth_node: format!("xen{pid}{tag}"),
            veth_router: format!("xer{pid}{tag}"),
            pipe_name: format!("xlb{pid}{tag}"),
            dir,
            exabgp: None,
            bird: None,
        };
        let (n, r, vn, vr) = (
            lab.node.as_str(),
            lab.router.as_str(),
            lab.veth_node.as_str(),
            lab.veth_router.as_str(),
        );
        fs::create_dir_all(lab.dir.join("run")).unwrap();
        ip(&["netns", "add", n]);
        ip(&["netns", "add", r]);
        ip(&[
            "link", "add", vn, "netns", n, "type", "veth", "peer", "name", vr, "netns", r,
        ]);
        for (ns, dev, v4, v6) in [(n, vn, NODE_V4, NODE_V6), (r, vr, ROUTER_V4, ROUTER_V6)] {
            xlb_tests::bgp_lab::set_up_veth_end(ns, dev, &format!("{v4}/24"), &format!("{v6}/64"));
        }

        // The API pipes, where ExaBGP looks for them under --root.
        for end in ["in", "out"] {
            let path = lab.pipes().join(format!("{}.{end}", lab.pipe_name));
            run(Command::new("mkfifo").args(["-m", "0600"]).arg(&path));
        }
        fs::write(
            lab.dir.join("exabgp.conf"),
            format!(
                "neighbor {ROUTER_V4} {{\n\
                 \trouter-id {NODE_V4};\n\
                 \tlocal-address {NODE_V4};\n\
                 \tlocal-as 65001;\n\
                 \tpeer-as 65000;\n\
                 \thold-time 6;\n\
                 \tfamily {{\n\t\tipv4 unicast;\n\t\tipv6 unicast;\n\t}}\n\
                 }}\n"
            ),
        )
        .unwrap();
        fs::write(
            lab.dir.join("bird.conf"),
            format!(
                "router id {ROUTER_V4};\n\
                 protocol device {{ }}\n\
                 protocol kernel {{ ipv4 {{ export all; }}; }}\n\
                 protocol kernel {{ ipv6 {{ export all; }}; }}\n\
                 protocol bgp node {{\n\
                 \tlocal {ROUTER_V4} as 65000;\n\
                 \tneighbor {NODE_V4} as 65001;\n\
                 \thold time 6;\n\
                 \tconnect retry time 1;\n\
                 \terror wait time 1, 2;\n\
                 \tipv4 {{ import all; export none; }};\n\
                 \tipv6 {{ import all; export none; }};\n\
                 }}\n"
            ),
        )
        .unwrap();
        lab
    }

    fn pipes(&self) -> PathBuf {
        self.dir.join("run")
    }

    fn log(&self, name: &str) -> File {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(name))
            .unwrap()
    }

    fn announcer(&self) -> ExaBgpAnnouncer {
        ExaBgpAnnouncer::new(self.pipes())
            .with_pipe_name(&self.pipe_name)
            .with_timeout(Duration::from_secs(5))
    }

    fn start_bird(&mut self) {
        let dir = &self.dir;
        let child = Command::new("ip")
            .args(["netns", "exec", &self.router, "bird", "-f", "-c"])
            .arg(dir.join("bird.conf"))
            .arg("-s")
            .arg(dir.join("bird.ctl"))
            .arg("-P")
            .arg(dir.join("bird.pid"))
            .stdin(Stdio::null())
            .stdout(self.log("bird.log"))
            .stderr(self.log("bird.log"))
            .spawn()
            .expect("start bird");
        self.bird = Some(child);
        wait_until_blocking("bird's control socket", WAIT, || {
            self.birdc(&["show", "status"])
                .filter(|s| s.contains("Daemon is up"))
                .ok_or_else(|| "not up".to_string())
        });
    }

    fn start_exabgp(&mut self) {
        // `ip netns exec` execs the command: the child is ExaBGP itself.
        let child = Command::new("ip")
            .args(["netns", "exec", &self.node, "/usr/sbin/exabgp", "--root"])
            .arg(&self.dir)
            .arg(self.dir.join("exabgp.conf"))
            .current_dir(&self.dir)
            .env("exabgp.api.cli", "true")
            .env("exabgp.api.ack", "true")
            .env("exabgp.api.pipename", &self.pipe_name)
            .env("exabgp.daemon.daemonize", "false")
            .env("exabgp.daemon.user", "root")
            .env("exabgp.daemon.pid", "")
            .env("exabgp.tcp.bind", "")
            .env("exabgp.log.destination", "stdout")
            .env("PYTHONUNBUFFERED", "1")
            .env_remove("exabgp_cli_pipe")
            .stdin(Stdio::null())
            .stdout(self.log("exabgp.log"))
            .stderr(self.log("exabgp.log"))
            .spawn()
            .expect("start exabgp");
        self.exabgp = Some(child);
    }

    fn exabgp_pid(&self) -> i32 {
        self.exabgp.as_ref().expect("exabgp runs").id() as i32
    }

    fn kill_exabgp(&mut self) {
        if let Some(mut child) = self.exabgp.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // Its CLI helper notices its parent is gone on its own.
        wait_until_blocking("exabgp's helper to exit", WAIT, || {
            let pids = xlb_tests::netns::pids(&self.node);
            if pids.is_empty() {
                Ok(())
            } else {
                Err(format!("still running: {pids:?}"))
            }
        });
    }

    fn birdc(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("birdc")
            .arg("-s")
            .arg(self.dir.join("bird.ctl"))
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn established(&self) -> Result<(), String> {
        let s = self
            .birdc(&["show", "protocols", "node"])
            .ok_or("birdc failed")?;
        if s.contains("Established") {
            Ok(())
        } else {
            Err(s)
        }
    }

    /// `ip route show <vip>` in the router: the kernel route BIRD installed.
    fn fib(&self, prefix: IpNet) -> String {
        kernel_route(&self.router, &prefix.to_string())
    }

    /// Waits until the router's FIB routes each of `present` via the node,
    /// and none of `absent`.
    fn wait_fib(&self, present: &[&Route], absent: &[IpNet]) {
        wait_until_blocking("the router's FIB", WAIT, || {
            for r in present {
                let got = self.fib(r.prefix);
                let want = format!("via {}", r.next_hop);
                if !(got.contains(&want) && got.contains("proto bird")) {
                    return Err(format!("{}: {got:?}, want {want:?}", r.prefix));
                }
            }
            for vip in absent {
                let got = self.fib(*vip);
                if !got.is_empty() {
                    return Err(format!("{vip} still routed: {got:?}"));
                }
            }
            Ok(())
        })
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if thread::panicking() {
            for name in ["exabgp.log", "bird.log"] {
                let text = fs::read_to_string(self.dir.join(name)).unwrap_or_default();
                let tail = &text[text.len().saturating_sub(6000)..];
                eprintln!("----- {name} (end) -----\n{tail}");
            }
        }
        for child in [self.exabgp.take(), self.bird.take()].into_iter().flatten() {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
        // Whatever the daemons started in our namespaces (ExaBGP's helper).
        for ns in [self.node.clone(), self.router.clone()] {
            for pid in xlb_tests::netns::pids(&ns) {
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            let _ = Command::new("ip")
                .args(["netns", "del", &ns])
                .stderr(Stdio::null())
                .status();
        }
        // In case it was left in the root namespace by a failed setup.
        let _ = Command::new("ip")
            .args(["link", "del", &self.veth_node])
            .stderr(Stdio::null())
            .status();
        let _ = fs::remove_dir_all(&self.dir);
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Waits until ExaBGP answers on its pipes; returns what it announces.
fn wait_api(rt: &tokio::runtime::Runtime, ann: &mut ExaBgpAnnouncer) -> BTreeSet<Route> {
    wait_until_blocking("exabgp's API", WAIT, || {
        rt.block_on(ann.announced()).map_err(|e| e.to_string())
    })
}

fn bird_route_all(lab: &Lab, prefix: &str) -> String {
    lab.birdc(&["show", "route", "all", prefix])
        .unwrap_or_default()
}

#[test]
fn exabgp_announces_to_a_real_router() {
    let rt = rt();
    let mut lab = Lab::new("a");
    lab.start_bird();
    lab.start_exabgp();
    let mut ann = lab.announcer();
    assert_eq!(ann.name(), "exabgp");
    assert!(wait_api(&rt, &mut ann).is_empty());

    let mut a = route("192.0.2.10", NODE_V4, &[(65000, 100)], Some(200));
    a.large_communities = vec![(65000, 1, 2)];
    // Given unsorted: compared as a set, sent sorted.
    let b = route("192.0.2.11", NODE_V4, &[(65000, 200), (65000, 100)], None);
    let v6 = route("2001:db8::10", NODE_V6, &[], None);
    let all: BTreeSet<Route> = [a.clone(), b.clone(), v6.clone()].into();

    // Announce two IPv4 and one IPv6 VIPs.
    assert_eq!(rt.block_on(ann.apply(&all)).unwrap(), (3, 0));
    wait_until_blocking("the BGP session", WAIT, || lab.established());
    lab.wait_fib(&[&a, &b, &v6], &[]);

    // ExaBGP lists them back (communities sorted).
    let mut b_sorted = b.clone();
    b_sorted.communities.sort();
    let listed = rt.block_on(ann.announced()).unwrap();
    assert_eq!(
        listed,
        [a.clone(), b_sorted.clone(), v6.clone()].into(),
        "listed {listed:?}"
    );

    // The same set again is a no-op, with either community order.
    assert_eq!(rt.block_on(ann.apply(&all)).unwrap(), (0, 0));
    let all_sorted: BTreeSet<Route> = [a.clone(), b_sorted.clone(), v6.clone()].into();
    assert_eq!(rt.block_on(ann.apply(&all_sorted)).unwrap(), (0, 0));

    // A pool's covering prefix (a BGPAdvertisement's aggregationLength) is
    // announced, read back and withdrawn like a VIP.
    let covering = route("192.0.2.64/28", NODE_V4, &[(65000, 28)], None);
    let mut with_covering = all.clone();
    with_covering.insert(covering.clone());
    assert_eq!(rt.block_on(ann.apply(&with_covering)).unwrap(), (1, 0));
    assert_eq!(rt.block_on(ann.apply(&with_covering)).unwrap(), (0, 0));
    lab.wait_fib(&[&covering], &[]);
    assert_eq!(rt.block_on(ann.apply(&all)).unwrap(), (0, 1));
    lab.wait_fib(&[], &[covering.prefix]);

    // The communities reached the router.
    let shown = bird_route_all(&lab, "192.0.2.10/32");
    assert!(shown.contains("BGP.community: (65000,100)"), "{shown}");
    assert!(
        shown.contains("BGP.large_community: (65000, 1, 2)"),
        "{shown}"
    );
    let shown = bird_route_all(&lab, "192.0.2.11/32");
    assert!(
        shown.contains("BGP.community: (65000,100) (65000,200)"),
        "{shown}"
    );
    let shown = bird_route_all(&lab, "2001:db8::10/128");
    assert!(
        shown.contains(&format!("BGP.next_hop: {NODE_V6}")),
        "{shown}"
    );

    // Withdraw one: gone from the router's FIB, the others stay.
    let two: BTreeSet<Route> = [a.clone(), v6.clone()].into();
    assert_eq!(rt.block_on(ann.apply(&two)).unwrap(), (0, 1));
    lab.wait_fib(&[&a, &v6], &[b.prefix]);
    assert_eq!(rt.block_on(ann.apply(&two)).unwrap(), (0, 0));

    // Changing a route's communities replaces it (one added, one gone).
    let a2 = route("192.0.2.10", NODE_V4, &[(65000, 300)], Some(200));
    let two: BTreeSet<Route> = [a2.clone(), v6.clone()].into();
    assert_eq!(rt.block_on(ann.apply(&two)).unwrap(), (1, 1));
    wait_until_blocking("the new community on the router", WAIT, || {
        let shown = bird_route_all(&lab, "192.0.2.10/32");
        if shown.contains("BGP.community: (65000,300)") {
            Ok(())
        } else {
            Err(shown)
        }
    });
    lab.wait_fib(&[&a2, &v6], &[b.prefix]);

    // A command ExaBGP rejects is Refused, and the pipes stay usable.
    let err = rt
        .block_on(ann.command("announce route not-an-address"))
        .unwrap_err();
    assert!(matches!(err, AnnounceError::Refused(_)), "{err}");
    assert_eq!(rt.block_on(ann.apply(&two)).unwrap(), (0, 0));

    // An answer that comes too late: ExaBGP stopped while a command is on
    // its way. The late answer must not be taken for a later command's.
    let mut quick = lab.announcer().with_timeout(Duration::from_millis(500));
    let pid = lab.exabgp_pid();
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let err = rt.block_on(quick.announced()).unwrap_err();
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert!(matches!(err, AnnounceError::Unreachable(_)), "{err}");
    quick.timeout = Duration::from_secs(5);
    assert_eq!(rt.block_on(quick.apply(&all)).unwrap(), (2, 1));
    assert_eq!(rt.block_on(quick.apply(&all)).unwrap(), (0, 0));
    lab.wait_fib(&[&a, &b, &v6], &[]);

    // ExaBGP killed: unreachable, and the router drops the routes once the
    // session is gone.
    lab.kill_exabgp();
    let err = rt.block_on(ann.apply(&all)).unwrap_err();
    assert!(matches!(err, AnnounceError::Unreachable(_)), "{err}");
    let err = rt.block_on(ann.announced()).unwrap_err();
    assert!(matches!(err, AnnounceError::Unreachable(_)), "{err}");
    wait_until_blocking("the session to drop", WAIT, || match lab.established() {
        Ok(()) => Err("still established".into()),
        Err(_) => Ok(()),
    });
    lab.wait_fib(&[], &[a.prefix, b.prefix, v6.prefix]);

    // ExaBGP restarted empty: the next apply announces the whole set again.
    lab.start_exabgp();
    assert!(wait_api(&rt, &mut ann).is_empty());
    assert_eq!(rt.block_on(ann.apply(&all)).unwrap(), (3, 0));
    wait_until_blocking("the BGP session again", WAIT, || lab.established());
    lab.wait_fib(&[&a, &b, &v6], &[]);
    assert_eq!(rt.block_on(ann.apply(&all)).unwrap(), (0, 0));

    // And an empty set withdraws everything.
    assert_eq!(rt.block_on(ann.apply(&BTreeSet::new())).unwrap(), (0, 3));
    lab.wait_fib(&[], &[a.prefix, b.prefix, v6.prefix]);
}

#[test]
fn a_family_no_neighbor_carries_is_refused() {
    let rt = rt();
    let mut lab = Lab::new("b");
    // An IPv4-only neighbor.
    let conf = fs::read_to_string(lab.dir.join("exabgp.conf")).unwrap();
    fs::write(
        lab.dir.join("exabgp.conf"),
        conf.replace("\t\tipv6 unicast;\n", ""),
    )
    .unwrap();
    lab.start_exabgp();
    let mut ann = lab.announcer();
    wait_api(&rt, &mut ann);

    let v4 = route("192.0.2.20", NODE_V4, &[], None);
    let v6 = route("2001:db8::20", NODE_V6, &[], None);
    let err = rt
        .block_on(ann.apply(&[v4.clone(), v6].into()))
        .unwrap_err();
    match &err {
        AnnounceError::Refused(msg) => assert!(msg.contains("2001:db8::20"), "{msg}"),
        other => panic!("{other}"),
    }
    // The IPv4 route went through all the same.
    assert_eq!(rt.block_on(ann.announced()).unwrap(), [v4.clone()].into());
    assert_eq!(rt.block_on(ann.apply(&[v4].into())).unwrap(), (0, 0));
}

#[test]
fn missing_or_unread_pipes_are_unreachable() {
    let rt = rt();
    let lab = Lab::new("c");
    // The pipes exist but no ExaBGP reads them.
    let mut ann = lab.announcer();
    let err = rt.block_on(ann.apply(&BTreeSet::new())).unwrap_err();
    assert!(matches!(err, AnnounceError::Unreachable(_)), "{err}");
    assert!(err.to_string().contains("not running"), "{err}");
    // No pipes at all.
    let mut ann = ExaBgpAnnouncer::new(Path::new("/nonexistent-xlb-exabgp"));
    let err = rt.block_on(ann.announced()).unwrap_err();
    assert!(matches!(err, AnnounceError::Unreachable(_)), "{err}");
}

/// Per-peer session state from `show neighbor extensive`: the configured
/// router (up once BIRD answers, down when BIRD is gone) and a configured
/// neighbor nobody answers (always down); the announce task exports them
/// as `xlb_bgp_peer_up`, and as 0 while ExaBGP itself is gone.
#[test]
fn exabgp_session_state_per_peer() {
    let rt = rt();
    let mut lab = Lab::new("p");
    // A second neighbor that never answers.
    let conf = fs::read_to_string(lab.dir.join("exabgp.conf")).unwrap();
    let silent = conf.replace(&format!("neighbor {ROUTER_V4} {{"), "neighbor 10.200.0.9 {");
    fs::write(lab.dir.join("exabgp.conf"), format!("{conf}{silent}")).unwrap();
    lab.start_bird();
    lab.start_exabgp();
    let mut ann = lab.announcer();
    wait_api(&rt, &mut ann);
    let router: IpAddr = ROUTER_V4.parse().unwrap();
    let silent: IpAddr = "10.200.0.9".parse().unwrap();
    let peers = wait_until_blocking("the session with the router", WAIT, || {
        let peers = rt.block_on(ann.peers()).map_err(|e| e.to_string())?;
        if states(&peers).contains(&(router, true)) {
            Ok(peers)
        } else {
            Err(format!("{peers:?}"))
        }
    });
    assert_eq!(states(&peers), vec![(router, true), (silent, false)]);
    // Nothing announced yet; up for some time.
    prefixes_sent(&peers, &[(ROUTER_V4, 0)]).unwrap();
    lab.established().unwrap();

    // BIRD stops: ExaBGP's session leaves ESTABLISHED.
    if let Some(mut bird) = lab.bird.take() {
        let _ = bird.kill();
        let _ = bird.wait();
    }
    wait_until_blocking("the session to drop", WAIT, || {
        let peers = rt.block_on(ann.peers()).map_err(|e| e.to_string())?;
        if states(&peers) == vec![(router, false), (silent, false)] {
            Ok(())
        } else {
            Err(format!("{peers:?}"))
        }
    });
    lab.start_bird();

    // The announce task (now the pipes' only user) exports the states.
    let registry = prometheus::Registry::new();
    let task = rt.block_on(async {
        AnnounceTask::start(
            Box::new(lab.announcer()),
            Duration::from_millis(300),
            &registry,
        )
    });
    // On the current-thread runtime the task runs only while block_on waits.
    rt.block_on(wait_metrics(
        "the router up, the silent neighbor down",
        WAIT,
        &registry,
        &[
            "xlb_bgp_peer_up{peer=\"10.200.0.1\"} 1",
            "xlb_bgp_peer_up{peer=\"10.200.0.9\"} 0",
        ],
    ));
    // ExaBGP killed: nothing can be asked, every peer reads 0.
    lab.kill_exabgp();
    rt.block_on(wait_metrics(
        "every peer down",
        WAIT,
        &registry,
        &[
            "xlb_bgp_peer_up{peer=\"10.200.0.1\"} 0",
            "xlb_bgp_peer_up{peer=\"10.200.0.9\"} 0",
        ],
    ));
    drop(task);
}
