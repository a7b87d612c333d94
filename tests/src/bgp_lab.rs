//! Helpers of the BGP driver tests (`announce_*_needs_root.rs`): commands,
//! kernel routes, waits, metrics pages, routes.

use std::{
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use lb_agent::bgp::Route;

/// The longest any one wait of these tests may take.
pub const WAIT: Duration = Duration::from_secs(30);
/// How often the waits below look again.
const POLL_EVERY: Duration = Duration::from_millis(100);

/// Runs `cmd`; panics (with its output) unless it succeeds. Returns stdout.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("running {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `ip ARGS`, which must succeed; returns stdout.
pub fn ip(args: &[&str]) -> String {
    run(Command::new("ip").args(args))
}

/// Brings up `lo` and the veth end `dev` in `ns` with the addresses
/// `v4_cidr` and `v6_cidr` (without duplicate address detection, so the
/// IPv6 address is usable at once).
pub fn set_up_veth_end(ns: &str, dev: &str, v4_cidr: &str, v6_cidr: &str) {
    ip(&["-n", ns, "link", "set", "lo", "up"]);
    ip(&["-n", ns, "addr", "add", v4_cidr, "dev", dev]);
    ip(&["-n", ns, "addr", "add", v6_cidr, "dev", dev, "nodad"]);
    ip(&["-n", ns, "link", "set", dev, "up"]);
}

/// The kernel route for `dst` in `ns` (`ip route show DST`), "" if none.
pub fn kernel_route(ns: &str, dst: &str) -> String {
    let family = if dst.contains(':') { "-6" } else { "-4" };
    ip(&["-n", ns, family, "route", "show", dst])
        .trim()
        .to_string()
}

/// Polls `check` until it gives `Ok`, or panics after `limit` with its last
/// `Err` (what it saw instead).
pub async fn wait_until<T>(
    what: &str,
    limit: Duration,
    mut check: impl AsyncFnMut() -> Result<T, String>,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        match check().await {
            Ok(v) => return v,
            Err(last) if Instant::now() >= deadline => {
                panic!("timed out after {limit:?} waiting for {what}; last: {last}")
            }
            Err(_) => tokio::time::sleep(POLL_EVERY).await,
        }
    }
}

/// [`wait_until`] for callers outside a runtime: sleeps the thread between
/// checks.
pub fn wait_until_blocking<T>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> Result<T, String>,
) -> T {
    let deadline = Instant::now() + limit;
    loop {
        match check() {
            Ok(v) => return v,
            Err(last) if Instant::now() >= deadline => {
                panic!("timed out after {limit:?} waiting for {what}; last: {last}")
            }
            Err(_) => thread::sleep(POLL_EVERY),
        }
    }
}

/// The agent's Prometheus page from `registry`.
pub fn metrics_page(registry: &prometheus::Registry) -> String {
    prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .unwrap()
}

/// Waits (at most `limit`) until the page of `registry` holds every line of
/// `want`. Async so that the announce task filling it runs meanwhile.
pub async fn wait_metrics(
    what: &str,
    limit: Duration,
    registry: &prometheus::Registry,
    want: &[&str],
) {
    wait_until(what, limit, async || {
        let page = metrics_page(registry);
        if want.iter().all(|w| page.contains(w)) {
            Ok(())
        } else {
            Err(format!("want {want:?} in:\n{page}"))
        }
    })
    .await
}

/// A route from its text form: `prefix` is a VIP (a host route) or a
/// prefix (`192.0.2.64/27`, a pool's covering prefix).
pub fn route(prefix: &str, nh: &str, communities: &[(u16, u16)], local_pref: Option<u32>) -> Route {
    Route {
        prefix: parse_prefix(prefix),
        next_hop: nh.parse().unwrap(),
        communities: communities.to_vec(),
        large_communities: vec![],
        local_pref,
    }
}

/// A peer the agent writes a session for: 3 s hold time, 1 s keepalive,
/// nothing else.
pub fn peer(address: &str, asn: u32) -> lb_agent::config::BgpPeer {
    lb_agent::config::BgpPeer {
        address: address.parse().unwrap(),
        asn,
        port: None,
        hold_time: Duration::from_secs(3),
        keepalive: Duration::from_secs(1),
        password: None,
        multihop_ttl: None,
        graceful_restart: None,
        bfd: None,
    }
}

/// Sessions as (peer, established), for comparing states only.
pub fn states(sessions: &[lb_agent::bgp::Session]) -> Vec<(std::net::IpAddr, bool)> {
    sessions.iter().map(|s| (s.peer, s.established)).collect()
}

/// Whether the established sessions of `sessions` send `want` prefixes
/// (peer → count), each with an uptime; `Err` says what they are instead.
pub fn prefixes_sent(
    sessions: &[lb_agent::bgp::Session],
    want: &[(&str, u64)],
) -> Result<(), String> {
    let want: Vec<(std::net::IpAddr, Option<u64>)> = want
        .iter()
        .map(|(p, n)| (p.parse().unwrap(), Some(*n)))
        .collect();
    let got: Vec<(std::net::IpAddr, Option<u64>)> = sessions
        .iter()
        .filter(|s| s.established)
        .map(|s| (s.peer, s.prefixes_sent))
        .collect();
    if got == want
        && sessions
            .iter()
            .all(|s| !s.established || s.uptime.is_some())
    {
        Ok(())
    } else {
        Err(format!("want {want:?} sent; sessions {sessions:?}"))
    }
}

/// `192.0.2.10` as a host route, or `192.0.2.64/27` as it is.
pub fn parse_prefix(text: &str) -> ipnet::IpNet {
    text.parse().unwrap_or_else(|_| {
        ipnet::IpNet::from(
            text.parse::<std::net::IpAddr>()
                .unwrap_or_else(|e| panic!("{text}: {e}")),
        )
    })
}

/// The arguments that run FRR's daemon `name` (`zebra`, `bgpd`, `bfdd`) in
/// the foreground with everything in `dir`: `frr.conf`, the vty sockets,
/// zebra's socket and the pid files; logs on stdout. The daemons run as
/// the `frr` user (root is not in FRR's vty group), so `dir` must be
/// theirs.
pub fn frr_daemon_args(dir: &Path, name: &str) -> Vec<String> {
    let d = dir.display();
    [
        "-u".to_string(),
        "frr".into(),
        "-g".into(),
        "frr".into(),
        "-P".into(),
        "0".into(),
        "-f".into(),
        format!("{d}/frr.conf"),
        "--vty_socket".into(),
        d.to_string(),
        "-z".into(),
        format!("{d}/zserv.api"),
        "-i".into(),
        format!("{d}/{name}.pid"),
        "--log".into(),
        "stdout".into(),
    ]
    .into()
}

/// FRR's daemon `name`, installed by Debian's frr package.
pub fn frr_daemon(name: &str) -> std::path::PathBuf {
    Path::new("/usr/lib/frr").join(name)
}

/// The router of the driver tests: BIRD in a namespace at 10.99.0.2 and
/// fd99::2, peering with the node at 10.99.0.1 (eBGP, AS 65000 to 65001:
/// into its kernel FIB, where `ip route` sees it) and at fd99::1 (iBGP in
/// AS 65001: into the tables ibgp4 and ibgp6 only, where LOCAL_PREF and
/// the iBGP next hop are seen).
pub const BIRD_ROUTER_CONF: &str = r#"
log stderr all;
router id 10.99.0.2;
ipv4 table ibgp4;
ipv6 table ibgp6;

protocol device {}

protocol kernel {
    ipv4 { export where proto = "node"; };
}
protocol kernel {
    ipv6 { export where proto = "node"; };
}

protocol bgp node {
    local 10.99.0.2 as 65000;
    neighbor 10.99.0.1 as 65001;
    connect delay time 1;
    connect retry time 1;
    error wait time 1, 2;
    ipv4 { import all; export none; };
    ipv6 { import all; export none; };
}

protocol bgp node_ibgp {
    local fd99::2 as 65001;
    neighbor fd99::1 as 65001;
    direct;
    connect delay time 1;
    connect retry time 1;
    error wait time 1, 2;
    ipv4 { table ibgp4; gateway direct; import all; export none; };
    ipv6 { table ibgp6; gateway direct; import all; export none; };
}
"#;
