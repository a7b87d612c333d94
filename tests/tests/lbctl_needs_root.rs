//! lbctl against real pinned maps (needs root: loads the XDP program and
//! pins its maps under a temporary directory in /sys/fs/bpf). Every
//! subcommand's `--json` output is checked against the Dataplane's own view.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    path::{Path, PathBuf},
    process::{Command, Output},
};

use aya::maps::{Map, MapData, PerCpuArray, PerCpuValues};
use lb_agent::{
    dataplane::{Dataplane, Protocol, ServiceSpec},
    maps::possible_cpus,
};
use lb_common::{
    hash::{flow_hash, snat_port_candidate},
    map_names as names,
    net::{ip_words, Family},
    Flow, FlowKey, Reason, ServiceKey, DEFAULT_SNAT_PORT_MAX, DEFAULT_SNAT_PORT_MIN, PROTO_TCP,
    REASON_COUNT,
};
use serde_json::Value;

/// Removes the pin directory when the test ends, passed or not.
struct PinDir(PathBuf);

impl Drop for PinDir {
    fn drop(&mut self) {
        if self.0.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.0) {
                eprintln!("removing {}: {e}", self.0.display());
            }
        }
    }
}

fn lbctl(pin_dir: &Path, args: &[&str]) -> Output {
    Command::new(xlb_tests::topology::lbctl_bin())
        .arg("--pin-dir")
        .arg(pin_dir)
        .args(args)
        .output()
        .expect("run lbctl")
}

/// Runs `lbctl --json ARGS`, expects `code`, returns the parsed document.
fn lbctl_json(pin_dir: &Path, args: &[&str], code: i32) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    let out = lbctl(pin_dir, &all);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(code),
        "lbctl {args:?}: stdout {stdout}\nstderr {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("lbctl {args:?}: {e}: {stdout}"))
}

fn spec(vip: &str, port: u16, snat: Option<&str>, backends: &[&str]) -> ServiceSpec {
    let addrs = backends.iter().map(|b| b.parse().unwrap());
    ServiceSpec {
        snat: snat.map(|s| s.parse().unwrap()),
        ..ServiceSpec::new(vip.parse().unwrap(), port, Protocol::Tcp, addrs)
    }
}

fn flow_key(src: &str, sport: u16, svc: &ServiceSpec) -> FlowKey {
    let src: IpAddr = src.parse().unwrap();
    FlowKey {
        src: ip_words(src),
        dst: ip_words(svc.vip),
        sport: sport.to_be(),
        dport: svc.port.to_be(),
        proto: PROTO_TCP,
        family: Family::of(svc.vip).number(),
        _pad: [0; 2],
    }
}

/// The backend the data plane picks for a new flow, from the Dataplane's view.
fn expected_pick(dp: &Dataplane, svc: &ServiceSpec, key: &FlowKey) -> (u32, SocketAddr, u32) {
    let table = dp.live_table(&svc.key()).unwrap();
    let entry = flow_hash(key) % table.len() as u32;
    let id = table[entry as usize];
    let addr = svc
        .backends
        .iter()
        .map(|b| b.addr)
        .find(|a| dp.backend_id(&svc.key(), *a) == Some(id))
        .expect("the table's backend id is one of the service's");
    (id, addr, entry)
}

fn service_name(svc: &ServiceSpec) -> String {
    format!("{}/tcp", SocketAddr::new(svc.vip, svc.port))
}

fn as_sockaddr(v: &Value) -> SocketAddr {
    v.as_str().unwrap().parse().unwrap()
}

fn coarse_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[test]
fn lbctl_reads_pinned_maps_needs_root() {
    let pin_dir = PinDir(PathBuf::from(format!(
        "/sys/fs/bpf/xlb-test-lbctl-{}",
        std::process::id()
    )));
    let dir = pin_dir.0.clone();

    // No maps pinned yet: a clear error and exit code 1.
    let out = lbctl(&dir, &["services"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("no pinned xlb maps under {}", dir.display()))
            && err.contains("is lb-agent running or has it run on this node?"),
        "{err}"
    );

    let mut dp = Dataplane::open(Some(&dir)).expect("load the XDP program and pin maps (root)");
    let nat = spec(
        "192.0.2.10",
        80,
        None,
        &["10.2.0.2:8080", "10.2.0.3:8080", "10.2.0.4:8080"],
    );
    let snat = spec(
        "2001:db8::10",
        443,
        Some("fd02::1"),
        &["[fd02::2]:8443", "[fd02::3]:8443"],
    );
    dp.set_service(&nat).unwrap();
    dp.set_service(&snat).unwrap();
    let services = [&nat, &snat];

    // services: one row per service (the echo markers are not listed).
    let v = lbctl_json(&dir, &["services"], 0);
    let rows = v["services"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "{v}");
    for svc in services {
        let row = rows
            .iter()
            .find(|r| r["service"] == service_name(svc))
            .unwrap_or_else(|| panic!("{} missing: {v}", service_name(svc)));
        let info = dp.service_info(&svc.key()).unwrap();
        assert_eq!(row["service_id"], info.id);
        assert_eq!(row["table_size"], info.table_size);
        assert_eq!(row["backends"], svc.backends.len());
        assert_eq!(row["port"], svc.port);
        assert_eq!(row["protocol"], "tcp");
        match svc.snat {
            Some(a) => {
                assert_eq!(row["mode"], "snat");
                assert_eq!(row["snat_addr"], a.to_string());
            }
            None => assert_eq!(row["mode"], "nat"),
        }
        assert_eq!(row["packets"], 0);
    }
    let human = lbctl(&dir, &["services"]);
    assert!(human.status.success());
    assert!(String::from_utf8_lossy(&human.stdout).contains("192.0.2.10"));

    // maglev: entries per backend equal the live table's; shares sum to 100%.
    for svc in services {
        let name = service_name(svc);
        let v = lbctl_json(&dir, &["maglev", &name], 0);
        let table = dp.live_table(&svc.key()).unwrap();
        let mut counts: BTreeMap<u32, u64> = BTreeMap::new();
        for id in &table {
            *counts.entry(*id).or_default() += 1;
        }
        assert_eq!(v["table_size"], table.len());
        let backends = v["backends"].as_array().unwrap();
        assert_eq!(backends.len(), svc.backends.len(), "{v}");
        let mut sum = 0.0;
        for b in backends {
            let id = b["backend_id"].as_u64().unwrap() as u32;
            assert_eq!(b["entries"].as_u64(), counts.get(&id).copied(), "{v}");
            assert_eq!(
                dp.backend_id(&svc.key(), as_sockaddr(&b["address"])),
                Some(id)
            );
            sum += b["share_pct"].as_f64().unwrap();
        }
        assert!((sum - 100.0).abs() < 1e-6, "shares sum to {sum}");
    }

    // backends: all services, and one.
    let v = lbctl_json(&dir, &["backends"], 0);
    assert_eq!(v["services"].as_array().unwrap().len(), 2);
    let v = lbctl_json(&dir, &["backends", &service_name(&nat)], 0);
    let svcs = v["services"].as_array().unwrap();
    assert_eq!(svcs.len(), 1);
    let listed: Vec<SocketAddr> = svcs[0]["backends"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| as_sockaddr(&b["address"]))
        .collect();
    let mut want: Vec<SocketAddr> = nat.backends.iter().map(|b| b.addr).collect();
    want.sort();
    assert_eq!(listed, want);
    for b in svcs[0]["backends"].as_array().unwrap() {
        assert_eq!(
            dp.backend_id(&nat.key(), as_sockaddr(&b["address"])),
            b["backend_id"].as_u64().map(|x| x as u32)
        );
    }
    // An unknown service is an error.
    let out = lbctl(&dir, &["backends", "192.0.2.99:80/tcp"]);
    assert_eq!(out.status.code(), Some(1));

    // trace, no flow state: the Maglev pick.
    for (client, sport) in [("198.51.100.7", 40000), ("198.51.100.8", 1234)] {
        let key = flow_key(client, sport, &nat);
        let (id, addr, entry) = expected_pick(&dp, &nat, &key);
        let v = lbctl_json(
            &dir,
            &[
                "trace",
                client,
                "192.0.2.10",
                &sport.to_string(),
                "80",
                "tcp",
            ],
            0,
        );
        assert_eq!(v["matched"], true);
        assert_eq!(v["decided_by"], "maglev", "{v}");
        assert_eq!(v["backend_id"], id);
        assert_eq!(as_sockaddr(&v["backend"]), addr);
        assert_eq!(v["maglev"]["entry"], entry);
        assert_eq!(v["maglev"]["hash"], flow_hash(&key));
        assert!(v["snat"].is_null());
    }
    // trace on the SNAT service: the first port candidate too.
    let key = flow_key("2001:db8:1::7", 50000, &snat);
    let (id, addr, _) = expected_pick(&dp, &snat, &key);
    let v = lbctl_json(
        &dir,
        &[
            "trace",
            "2001:db8:1::7",
            "2001:db8::10",
            "50000",
            "443",
            "tcp",
        ],
        0,
    );
    assert_eq!(v["backend_id"], id);
    assert_eq!(as_sockaddr(&v["backend"]), addr);
    assert_eq!(
        v["snat"]["first_candidate"],
        snat_port_candidate(
            flow_hash(&key),
            0,
            DEFAULT_SNAT_PORT_MIN,
            DEFAULT_SNAT_PORT_MAX
        )
    );
    assert_eq!(v["snat"]["snat_addr"], "fd02::1");

    // trace of a flow to no service: exit code 2.
    let v = lbctl_json(
        &dir,
        &["trace", "198.51.100.7", "192.0.2.10", "40000", "81", "tcp"],
        2,
    );
    assert_eq!(v["matched"], false);

    // A flow-table entry naming another backend than Maglev's: it wins in
    // trace, and conntrack lists it.
    // Maglev's pick for a flow, and a backend of the service other than it.
    let maglev_and_other = |key: &FlowKey| {
        let (maglev_id, _, _) = expected_pick(&dp, &nat, key);
        let other = nat
            .backends
            .iter()
            .map(|b| b.addr)
            .find(|a| dp.backend_id(&nat.key(), *a) != Some(maglev_id))
            .unwrap();
        (maglev_id, other, dp.backend_id(&nat.key(), other).unwrap())
    };
    let key = flow_key("198.51.100.7", 40000, &nat);
    let (maglev_id, other, other_id) = maglev_and_other(&key);
    let now = coarse_now_ns();
    let flow = Flow {
        backend_addr: ip_words(other.ip()),
        backend_port: other.port().to_be(),
        snat_port: 0,
        backend_id: other_id,
        service_id: dp.service_id(&nat.key()).unwrap(),
        flags: 0,
        created_ns: now.saturating_sub(5_000_000_000),
        last_seen_ns: now.saturating_sub(1_000_000_000),
        ..Flow::default()
    };
    insert_flow(&dir, key, flow);
    let v = lbctl_json(
        &dir,
        &["trace", "198.51.100.7", "192.0.2.10", "40000", "80", "tcp"],
        0,
    );
    assert_eq!(v["decided_by"], "conntrack", "{v}");
    assert_eq!(v["backend_id"], other_id);
    assert_eq!(as_sockaddr(&v["backend"]), other);
    assert_eq!(v["conntrack"]["backend_id"], other_id);
    assert!(v["conntrack"]["unusable"].is_null(), "{v}");
    assert_eq!(v["maglev"]["backend_id"], maglev_id);

    let v = lbctl_json(&dir, &["conntrack"], 0);
    assert_eq!(v["count"], 1, "{v}");
    let e = &v["entries"][0];
    assert_eq!(
        as_sockaddr(&e["client"]),
        "198.51.100.7:40000".parse().unwrap()
    );
    assert_eq!(as_sockaddr(&e["vip"]), "192.0.2.10:80".parse().unwrap());
    assert_eq!(as_sockaddr(&e["backend"]), other);
    let age = e["age_ns"].as_u64().unwrap();
    assert!((4_000_000_000..60_000_000_000).contains(&age), "age {age}");
    let other_s = other.to_string();
    for (filter, n) in [
        (vec!["--client", "198.51.100.7"], 1),
        (vec!["--client", "198.51.100.9"], 0),
        (vec!["--service", "192.0.2.10:80/tcp"], 1),
        (vec!["--service", "[2001:db8::10]:443/tcp"], 0),
        (vec!["--backend", &other_s], 1),
    ] {
        let mut args = vec!["conntrack"];
        args.extend(filter.iter().copied());
        let v = lbctl_json(&dir, &args, 0);
        assert_eq!(v["count"], n, "{args:?}: {v}");
    }
    let v = lbctl_json(&dir, &["conntrack", "--limit", "0"], 0);
    assert_eq!(
        (v["count"].as_u64(), v["shown"].as_u64()),
        (Some(1), Some(0))
    );

    // An entry naming another service id (the service was re-created on
    // the same VIP:port) is not used: Maglev decides.
    let key = flow_key("198.51.100.8", 1234, &nat);
    let (maglev_id, other, other_id) = maglev_and_other(&key);
    let service_id = dp.service_id(&nat.key()).unwrap();
    let entry = |service_id: u32| Flow {
        backend_addr: ip_words(other.ip()),
        backend_port: other.port().to_be(),
        backend_id: other_id,
        service_id,
        created_ns: coarse_now_ns().saturating_sub(2_000_000_000),
        last_seen_ns: coarse_now_ns(),
        ..Flow::default()
    };
    let trace = || {
        lbctl_json(
            &dir,
            &["trace", "198.51.100.8", "192.0.2.10", "1234", "80", "tcp"],
            0,
        )
    };
    insert_flow(&dir, key, entry(service_id));
    let v = trace();
    assert_eq!(v["decided_by"], "conntrack", "{v}");
    assert_eq!(v["backend_id"], other_id);
    insert_flow(&dir, key, entry(service_id + 1000));
    let v = trace();
    assert_eq!(v["decided_by"], "maglev", "{v}");
    assert_eq!(v["backend_id"], maglev_id);
    assert_eq!(as_sockaddr(&v["conntrack"]["backend"]), other);
    assert!(v["conntrack"]["unusable"].is_string(), "{v}");

    // stats: every reason, zero counters, no warning.
    let v = lbctl_json(&dir, &["stats"], 0);
    let reasons: Vec<&str> = v["reasons"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["reason"].as_str().unwrap())
        .collect();
    let want: Vec<&str> = Reason::ALL.iter().map(|r| r.name()).collect();
    assert_eq!(reasons, want);
    assert_eq!(v["total_packets"], 0);
    assert_eq!(v["flows_repicked"], 0);
    assert!(v["warning"].is_null());
    // Counters skewed to one CPU: the RSS warning (on a machine with >1 CPU).
    let online = aya::util::online_cpus().unwrap();
    if online.len() > 1 {
        let cpu = online[0] as usize;
        let data = MapData::from_pin(dir.join(names::REASON_STATS)).unwrap();
        let mut rs: PerCpuArray<MapData, u64> =
            PerCpuArray::try_from(Map::from_map_data(data).unwrap()).unwrap();
        let mut values = vec![0u64; possible_cpus()];
        values[cpu] = 5000;
        rs.set(
            Reason::Tx as u32,
            PerCpuValues::try_from(values).unwrap(),
            0,
        )
        .unwrap();
        let v = lbctl_json(&dir, &["stats"], 0);
        assert_eq!(v["total_packets"], 5000);
        assert_eq!(v["skew"]["cpu"], cpu);
        let w = v["warning"].as_str().unwrap();
        assert!(
            w.starts_with(&format!("CPU {cpu} handled 100.0% of packets")),
            "{w}"
        );
        let human = lbctl(&dir, &["stats"]);
        assert!(String::from_utf8_lossy(&human.stdout).contains("WARNING: CPU"));
        assert_eq!(dp.reason_counts().unwrap()[Reason::Tx as usize], 5000);
    }
    assert_eq!(REASON_COUNT as usize, want.len());

    // lbctl works without the agent: drop the Dataplane, the pins remain.
    let nat_key: ServiceKey = nat.key();
    let nat_id = dp.service_id(&nat_key).unwrap();
    drop(dp);
    let v = lbctl_json(&dir, &["services"], 0);
    assert!(v["services"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["service_id"] == nat_id));
}

/// `services`, `trace` and `conntrack` show source ranges and session
/// affinity as the data plane holds them, and trace's verdicts match the
/// kernel's: an outside client is refused, an inside one is placed by the
/// hash of its address alone.
#[test]
fn lbctl_shows_source_ranges_and_affinity_needs_root() {
    let pin_dir = PinDir(PathBuf::from(format!(
        "/sys/fs/bpf/xlb-test-lbctl-policy-{}",
        std::process::id()
    )));
    let dir = pin_dir.0.clone();
    let mut dp = Dataplane::open(Some(&dir)).expect("load the XDP program and pin maps (root)");
    let mut svc = spec(
        "192.0.2.20",
        80,
        None,
        &["10.2.0.2:8080", "10.2.0.3:8080", "10.2.0.4:8080"],
    );
    svc.source_ranges = Some(vec![
        "198.51.100.0/24".parse().unwrap(),
        "203.0.113.7/32".parse().unwrap(),
    ]);
    svc.client_affinity = true;
    svc.new_flow_limit = Some(lb_agent::dataplane::NewFlowLimit {
        per_second: 50,
        burst: 80,
        ipv4_prefix: 24,
        ipv6_prefix: 64,
    });
    dp.set_service(&svc).unwrap();

    let v = lbctl_json(&dir, &["services"], 0);
    let row = &v["services"][0];
    assert_eq!(row["affinity"], "client_ip", "{v}");
    assert_eq!(
        row["new_flow_limit"],
        serde_json::json!({"per_second": 50, "burst": 80, "ipv4_prefix": 24, "ipv6_prefix": 64})
    );
    assert_eq!(
        row["source_ranges"],
        serde_json::json!(["198.51.100.0/24", "203.0.113.7/32"])
    );
    let human = String::from_utf8_lossy(&lbctl(&dir, &["services"]).stdout).into_owned();
    assert!(
        human.contains("client_ip")
            && human.contains("198.51.100.0/24,203.0.113.7/32")
            && human.contains("50/s burst 80 per /24"),
        "{human}"
    );

    // Outside the ranges: refused before any flow state.
    let v = lbctl_json(
        &dir,
        &["trace", "192.0.2.99", "192.0.2.20", "40000", "80", "tcp"],
        0,
    );
    assert_eq!(v["source_allowed"], false, "{v}");
    assert_eq!(v["decided_by"], "none");
    assert!(v["note"].as_str().unwrap().contains("drop_source_range"));

    // Inside: the Maglev entry of the client-address hash, for any port.
    let table = dp.live_table(&svc.key()).unwrap();
    for sport in [40000u16, 40001, 55555] {
        let key = flow_key("198.51.100.7", sport, &svc);
        let h = lb_common::hash::client_hash(&key);
        let v = lbctl_json(
            &dir,
            &[
                "trace",
                "198.51.100.7",
                "192.0.2.20",
                &sport.to_string(),
                "80",
                "tcp",
            ],
            0,
        );
        assert_eq!(v["source_allowed"], true);
        assert_eq!(v["maglev"]["hashed_on"], "client");
        assert_eq!(v["maglev"]["hash"], h);
        assert_eq!(v["backend_id"], table[(h % table.len() as u32) as usize]);
    }

    // A flow in the flow table is listed with its service's affinity.
    let key = flow_key("198.51.100.7", 40000, &svc);
    let now = coarse_now_ns();
    let flow = Flow {
        backend_addr: ip_words("10.2.0.2".parse().unwrap()),
        backend_port: 8080u16.to_be(),
        backend_id: dp
            .backend_id(&svc.key(), "10.2.0.2:8080".parse().unwrap())
            .unwrap(),
        service_id: dp.service_id(&svc.key()).unwrap(),
        created_ns: now,
        last_seen_ns: now,
        ..Default::default()
    };
    insert_flow(&dir, key, flow);
    let v = lbctl_json(&dir, &["conntrack"], 0);
    assert_eq!(v["entries"][0]["affinity"], "client_ip", "{v}");
}

/// Writes `flow` into the pinned flow table under `dir`, as the data plane would.
fn insert_flow(dir: &Path, key: FlowKey, flow: Flow) {
    let data = MapData::from_pin(dir.join(names::FLOWS)).unwrap();
    let mut m: aya::maps::HashMap<MapData, FlowKey, Flow> =
        aya::maps::HashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
    m.insert(key, flow, 0).unwrap();
}
