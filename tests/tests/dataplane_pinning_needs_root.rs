//! Pinned maps survive the driver and are adopted by the next one (root:
//! loads the real program and pins under /sys/fs/bpf).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use lb_agent::dataplane::{Dataplane, MapSizes, Protocol, ServiceSpec};

struct PinDir(std::path::PathBuf);

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = Dataplane::cleanup(&self.0);
    }
}

fn spec(port: u16, snat: Option<IpAddr>, backends: &[u8]) -> ServiceSpec {
    let vip = Ipv4Addr::new(192, 0, 2, 50).into();
    let addrs = backends
        .iter()
        .map(|&n| SocketAddr::new(Ipv4Addr::new(10, 9, 0, n).into(), 8080));
    ServiceSpec {
        snat,
        ..ServiceSpec::new(vip, port, Protocol::Tcp, addrs)
    }
}

#[test]
fn a_new_driver_adopts_pinned_services_and_tables() {
    let dir = PinDir(format!("/sys/fs/bpf/xlb-test-adopt-{}", std::process::id()).into());
    let mut web = spec(80, None, &[1, 2, 3]);
    web.new_flow_limit = Some(lb_agent::dataplane::NewFlowLimit {
        per_second: 300,
        burst: 50,
        ipv4_prefix: 24,
        ipv6_prefix: 56,
    });
    let api = spec(443, Some(Ipv4Addr::new(10, 9, 0, 254).into()), &[4, 5]);
    let (web_table, web_info, api_table, reverse) = {
        let mut dp = Dataplane::open(Some(&dir.0)).expect("open (root needed)");
        dp.set_service(&web).unwrap();
        dp.set_service(&api).unwrap();
        (
            dp.live_table(&web.key()).unwrap(),
            dp.service_info(&web.key()).unwrap(),
            dp.live_table(&api.key()).unwrap(),
            dp.reverse_entries(),
        )
    };
    // The NAT service's three backends have reverse translations; the SNAT
    // service's have none.
    assert_eq!(reverse.len(), 3, "{reverse:?}");
    for map in lb_common::map_names::ALL {
        assert!(dir.0.join(map).exists(), "{map} is pinned");
    }

    let mut dp = Dataplane::open(Some(&dir.0)).unwrap();
    let adopted: Vec<_> = dp.services().map(|(k, s)| (*k, s.clone())).collect();
    assert_eq!(adopted.len(), 2, "both services adopted: {adopted:?}");
    let adopted_web = &adopted.iter().find(|(k, _)| *k == web.key()).unwrap().1;
    let mut addrs: Vec<_> = adopted_web.backends.iter().map(|b| b.addr).collect();
    addrs.sort();
    assert_eq!(
        addrs,
        web.backends.iter().map(|b| b.addr).collect::<Vec<_>>()
    );
    assert_eq!(
        adopted_web.new_flow_limit, web.new_flow_limit,
        "limit adopted"
    );
    let adopted_api = &adopted.iter().find(|(k, _)| *k == api.key()).unwrap().1;
    assert_eq!(
        adopted_api.snat, api.snat,
        "snat address recovered from the map"
    );
    assert_eq!(dp.live_table(&web.key()).unwrap(), web_table);
    assert_eq!(dp.live_table(&api.key()).unwrap(), api_table);
    assert_eq!(
        dp.reverse_entries(),
        reverse,
        "reverse translations adopted"
    );

    // Applying the same spec again: same service id, same table contents
    // (Maglev is deterministic), written to a table no packet reads: the
    // inactive half, or a fresh region while the adopted table is new.
    // The half it retires is retired within this call: no earlier than
    // `retired` (taken before it; CI once took more than the quarantine
    // between the flip and the call's return, so a clock started after
    // the call measured less than the data plane did).
    let retired = std::time::Instant::now();
    dp.set_service(&web).unwrap();
    let info = dp.service_info(&web.key()).unwrap();
    assert_eq!(info.id, web_info.id);
    assert_ne!(
        (info.table_base, info.active),
        (web_info.table_base, web_info.active),
        "the update went to the live table"
    );
    assert_eq!(dp.live_table(&web.key()).unwrap(), web_table);

    // A change at once: the half just retired may still be read by a
    // packet, so it is not written within the quarantine (20 ms); the
    // change goes to a fresh region instead of waiting.
    let web = spec(80, None, &[1, 2, 3, 7]);
    dp.set_service(&web).unwrap();
    let again = dp.service_info(&web.key()).unwrap();
    if (again.table_base, again.active) == (info.table_base, 1 - info.active) {
        assert!(
            retired.elapsed() >= std::time::Duration::from_millis(20),
            "the retired half was rewritten within the quarantine"
        );
    }
    assert_ne!(
        (again.table_base, again.active),
        (info.table_base, info.active),
        "the update went to the live table"
    );
    let seven = dp
        .backend_id(&web.key(), "10.9.0.7:8080".parse().unwrap())
        .unwrap();
    assert!(dp.live_table(&web.key()).unwrap().contains(&seven));
    let info = again;

    // A new service does not collide with adopted ids or table regions.
    let other = spec(8443, None, &[6]);
    dp.set_service(&other).unwrap();
    let oi = dp.service_info(&other.key()).unwrap();
    assert_ne!(oi.id, info.id);
    let ranges = [
        (info.table_base, 2 * info.table_size),
        (oi.table_base, 2 * oi.table_size),
    ];
    assert!(
        ranges[0].0 + ranges[0].1 <= ranges[1].0 || ranges[1].0 + ranges[1].1 <= ranges[0].0,
        "{ranges:?}"
    );

    dp.remove_service(&api.key()).unwrap();
    assert!(
        dp.service_info(&api.key()).is_err(),
        "removed from the kernel map"
    );
    drop(dp);
    let removed = Dataplane::cleanup(&dir.0).unwrap();
    assert!(removed.contains(&"SERVICES".to_string()));
    assert!(!dir.0.exists());
}

/// Pins a map `name` of `kind` (4-byte keys, `value`-byte values) in
/// `dir`, as another xlb version might have left it.
fn pin_map(dir: &PinDir, name: &str, kind: &str, value: usize) {
    let value = value.to_string();
    let out = std::process::Command::new("bpftool")
        .args(["map", "create"])
        .arg(dir.0.join(name))
        .args(["type", kind, "key", "4", "value", &value, "entries", "16"])
        .args(["name", name])
        .output()
        .expect("bpftool");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Pins `web` in a fresh directory named for `what`, as a running agent
/// of this version leaves it.
fn pinned_with_a_service(what: &str) -> PinDir {
    let dir = PinDir(format!("/sys/fs/bpf/xlb-test-{what}-{}", std::process::id()).into());
    let mut dp = Dataplane::open(Some(&dir.0)).expect("open (root needed)");
    dp.set_service(&spec(80, None, &[1, 2, 3])).unwrap();
    dir
}

/// An upgrade across a change of the flow table's layout: the agent does
/// not refuse (a DaemonSet would crash-loop), it starts the whole data
/// plane afresh, counters too, and pins this version's layout.
#[test]
fn a_state_map_of_another_layout_starts_the_data_plane_afresh() {
    let dir = pinned_with_a_service("layout");
    std::fs::remove_file(dir.0.join("FLOWS")).unwrap();
    // A flow table with a layout no xlb version uses.
    pin_map(&dir, "FLOWS", "lru_hash", 8);
    let stats_before = aya::maps::MapInfo::from_pin(dir.0.join("SERVICE_STATS"))
        .unwrap()
        .id();
    let dp = Dataplane::open(Some(&dir.0)).expect("another layout is no reason to refuse");
    assert_eq!(dp.services().count(), 0, "the old services are not adopted");
    drop(dp);
    let maps = lb_agent::maps::PinnedMaps::open(&dir.0).expect("this version's layout pinned");
    assert_eq!(maps.shared_flows().unwrap().keys().count(), 0);
    assert_ne!(
        aya::maps::MapInfo::from_pin(dir.0.join("SERVICE_STATS"))
            .unwrap()
            .id(),
        stats_before,
        "the counters are started afresh with the state"
    );
}

/// The load-aware record is the agent's alone (the program never reads it):
/// one laid out by an older version (smaller) is started afresh, and the
/// rest, services included, is adopted.
#[test]
fn a_counter_of_another_layout_is_started_afresh_alone() {
    let dir = pinned_with_a_service("load");
    std::fs::remove_file(dir.0.join("BACKEND_LOAD")).unwrap();
    pin_map(
        &dir,
        "BACKEND_LOAD",
        "array",
        std::mem::size_of::<lb_common::BackendLoad>() - 4,
    );
    let dp = Dataplane::open(Some(&dir.0)).expect("an old load record is no reason to refuse");
    assert_eq!(dp.services().count(), 1, "the service is adopted");
    drop(dp);
    let maps = lb_agent::maps::PinnedMaps::open(&dir.0).unwrap();
    assert!(
        maps.backend_load().unwrap().is_some(),
        "a new record is pinned"
    );
}

/// Quick successive changes retire regions into the quarantine; a service
/// added while they fill the pool waits for them instead of failing with
/// "MAGLEV is full".
#[test]
fn quarantined_regions_do_not_make_the_pool_look_full() {
    let m = 211; // prime, room for 2 backends
    let sized = |port: u16, backends: &[u8]| ServiceSpec {
        table_size: Some(m),
        ..spec(port, None, backends)
    };
    // Room for exactly two services (two tables of M each).
    let mut dp = Dataplane::open_with(
        None,
        MapSizes {
            maglev_pool_entries: 4 * m,
            ..MapSizes::default()
        },
    )
    .expect("open (root needed)");
    let a = sized(80, &[1, 2]);
    dp.set_service(&a).unwrap();
    // Changed again at once: a fresh region, the first one quarantined.
    dp.set_service(&sized(80, &[1])).unwrap();
    // The pool is now full (a's live region + the quarantined one), until
    // the quarantine ends.
    let b = sized(81, &[3]);
    dp.set_service(&b)
        .expect("waits for the quarantined region");
    assert_eq!(dp.live_table(&b.key()).unwrap().len(), m as usize);
    assert_eq!(dp.live_table(&a.key()).unwrap().len(), m as usize);
    // A third service does not fit whatever happens: a clear error.
    let c = sized(82, &[4]);
    assert!(dp.set_service(&c).is_err(), "the pool holds two services");
}

/// A restarted agent adopts each service's source ranges and affinity, and
/// entries no live service uses are removed.
#[test]
fn source_ranges_and_affinity_are_adopted() {
    let dir = PinDir(format!("/sys/fs/bpf/xlb-test-adopt-ranges-{}", std::process::id()).into());
    let mut web = spec(80, None, &[1, 2]);
    web.source_ranges = Some(vec![
        "198.51.100.0/24".parse().unwrap(),
        "203.0.113.0/25".parse().unwrap(),
    ]);
    web.client_affinity = true;
    let mut closed = spec(81, None, &[3]);
    closed.source_ranges = Some(vec![]);
    {
        let mut dp = Dataplane::open(Some(&dir.0)).expect("open (root needed)");
        dp.set_service(&web).unwrap();
        dp.set_service(&closed).unwrap();
        // A change leaves the previous scope's entries behind for a while.
        web.source_ranges = Some(vec!["198.51.100.0/24".parse().unwrap()]);
        dp.set_service(&web).unwrap();
    }
    let dp = Dataplane::open(Some(&dir.0)).unwrap();
    let adopted = |k| dp.services().find(|(key, _)| **key == k).unwrap().1.clone();
    let w = adopted(web.key());
    assert_eq!(w.source_ranges, web.source_ranges);
    assert!(w.client_affinity);
    let c = adopted(closed.key());
    assert_eq!(
        c.source_ranges,
        Some(vec![]),
        "no ranges still means closed"
    );
    assert!(!c.client_affinity);
    let trie = aya::maps::lpm_trie::LpmTrie::<_, lb_common::RangeKey, u8>::try_from(
        aya::maps::Map::LpmTrie(
            aya::maps::MapData::from_pin(dir.0.join(lb_common::map_names::SOURCE_RANGES)).unwrap(),
        ),
    )
    .unwrap();
    assert_eq!(
        trie.keys().count(),
        1,
        "only the live scope's entry is left"
    );
}

/// Drops CAP_SYS_ADMIN from the calling thread's effective set (capabilities
/// are per thread, so only this thread loses it).
fn drop_sys_admin_here() {
    const CAP_SYS_ADMIN: u32 = 21;
    const VERSION_3: u32 = 0x2008_0522;
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: header and two data words, as capget(2) takes for version 3.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    assert_eq!(rc, 0, "capget: {}", std::io::Error::last_os_error());
    data[0].effective &= !(1 << CAP_SYS_ADMIN);
    // SAFETY: as above.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    assert_eq!(rc, 0, "capset: {}", std::io::Error::last_os_error());
    let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    assert_eq!(
        eff & (1 << CAP_SYS_ADMIN),
        0,
        "CAP_SYS_ADMIN still effective"
    );
}

/// The chart grants no CAP_SYS_ADMIN: the flow table's own handle (open
/// flow counts, the flow exchange) must open without it.
#[test]
fn the_flow_table_opens_without_cap_sys_admin() {
    let dir = PinDir(format!("/sys/fs/bpf/xlb-test-nosysadmin-{}", std::process::id()).into());
    let mut dp = Dataplane::open(Some(&dir.0)).expect("open (root needed)");
    dp.set_service(&spec(
        80,
        Some(Ipv4Addr::new(10, 9, 0, 254).into()),
        &[1, 2],
    ))
    .unwrap();
    let dp = std::thread::spawn(move || {
        drop_sys_admin_here();
        let table = dp
            .flow_table()
            .expect("flow table handle without CAP_SYS_ADMIN");
        assert!(table.entries().expect("walk the flow table").is_empty());
        dp.open_flows_by_backend(std::time::Duration::from_secs(10))
            .expect("open flows without CAP_SYS_ADMIN");
        dp
    })
    .join()
    .expect("thread without CAP_SYS_ADMIN");
    drop(dp);
}

/// The start-up check asks the kernel about bpf_loop when the release says
/// it is older than 5.17 (a distribution kernel with backports): the probe
/// must find it on a kernel that has it.
#[test]
fn the_kernel_check_finds_bpf_loop_on_this_kernel() {
    use lb_agent::dataplane::kernel;
    let release = kernel::running_release();
    assert!(
        kernel::parse_release(&release).is_some_and(|v| v >= kernel::MINIMUM),
        "{release}"
    );
    assert!(kernel::has_bpf_loop(), "bpf_loop probe on {release}");
}

/// `BACKEND_REVERSE` as the kernel holds it, by backend port and last
/// address byte: the service id of its one NAT service.
fn kernel_reverse(dir: &std::path::Path) -> std::collections::BTreeMap<(u8, u16), u32> {
    use aya::maps::{HashMap, Map, MapData};
    use lb_common::{map_names, ReverseKey, ReverseNat};
    let data = MapData::from_pin(dir.join(map_names::BACKEND_REVERSE)).expect("pinned map");
    let map: HashMap<MapData, ReverseKey, ReverseNat> =
        HashMap::try_from(Map::HashMap(data)).expect("a hash map");
    map.iter()
        .map(|e| {
            let (k, v) = e.expect("entry");
            let last = k.addr[0].to_ne_bytes()[3];
            ((last, u16::from_be(k.port)), v.service_id)
        })
        .collect()
}

/// Each service change writes only its own backends' reverse translations,
/// and a backend shared by two NAT services has none until one of them
/// lets it go: then it is the other's again. An snat service has none.
#[test]
fn reverse_translations_follow_services_sharing_and_leaving_a_backend() {
    let dir = PinDir(format!("/sys/fs/bpf/xlb-test-reverse-{}", std::process::id()).into());
    let mut dp = Dataplane::open(Some(&dir.0)).expect("open (root needed)");
    let web = spec(80, None, &[1, 2]);
    dp.set_service(&web).unwrap();
    let web_id = dp.service_id(&web.key()).unwrap();
    let want = |pairs: &[(u8, u32)]| -> std::collections::BTreeMap<(u8, u16), u32> {
        pairs.iter().map(|&(b, id)| ((b, 8080), id)).collect()
    };
    assert_eq!(kernel_reverse(&dir.0), want(&[(1, web_id), (2, web_id)]));

    // 2 is shared: ambiguous, so it has no entry.
    let api = spec(81, None, &[2, 3]);
    dp.set_service(&api).unwrap();
    let api_id = dp.service_id(&api.key()).unwrap();
    assert_eq!(kernel_reverse(&dir.0), want(&[(1, web_id), (3, api_id)]));
    assert_eq!(dp.reverse_entries().len(), 2);

    // web lets 2 go: it is api's alone again.
    dp.set_service(&spec(80, None, &[1, 4])).unwrap();
    assert_eq!(
        kernel_reverse(&dir.0),
        want(&[(1, web_id), (2, api_id), (3, api_id), (4, web_id)])
    );

    // api turns snat: its backends' replies go to the node's address.
    let snat = Some(Ipv4Addr::new(10, 9, 0, 254).into());
    dp.set_service(&spec(81, snat, &[2, 3])).unwrap();
    assert_eq!(kernel_reverse(&dir.0), want(&[(1, web_id), (4, web_id)]));

    // Shared again, then the sharer leaves.
    let other = spec(82, None, &[4]);
    dp.set_service(&other).unwrap();
    assert_eq!(kernel_reverse(&dir.0), want(&[(1, web_id)]));
    dp.remove_service(&other.key()).unwrap();
    assert_eq!(kernel_reverse(&dir.0), want(&[(1, web_id), (4, web_id)]));
    dp.remove_service(&web.key()).unwrap();
    assert_eq!(kernel_reverse(&dir.0), want(&[]));
    assert!(dp.reverse_entries().is_empty());
}
