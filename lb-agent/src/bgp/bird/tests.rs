use super::*;

fn route(vip: &str, nh: &str, communities: &[(u16, u16)], lp: Option<u32>) -> Route {
    Route {
        prefix: ipnet::IpNet::from(vip.parse::<std::net::IpAddr>().unwrap()),
        next_hop: nh.parse().unwrap(),
        communities: communities.to_vec(),
        large_communities: vec![],
        local_pref: lp,
    }
}

// Captured from BIRD 2.0.12 (`birdc -v ... show route protocol xlb_vips4 all`),
// with two routes for 192.0.2.11/32 and a wrapped community list added.
const SHOW_ROUTE: &str = "0001 BIRD 2.0.12 ready.
1007-Table master4:
     192.0.2.11/32        blackhole [xlb_vips4 22:30:45.890] * (200)
1008-\tType: static univ
1012-\tBGP.next_hop: 10.99.0.5
1007-                     blackhole [xlb_vips4 22:30:53.429] (200)
1008-\tType: static univ
1012-\tBGP.next_hop: 10.99.0.1
     \tBGP.community: (1,1)
1007-192.0.2.10/32        blackhole [xlb_vips4 22:30:32.432] * (200)
1008-\tType: static univ
1012-\tBGP.next_hop: 10.99.0.1
     \tBGP.local_pref: 200
     \tBGP.community: (65000,100) (65000,7)
     \t\t(65000,1) (65000,7)
1007-192.0.2.12/32        unicast [xlb_vips4 22:30:32.432] * (200)
     \tvia 10.99.0.7 on eth0
1008-\tType: static univ
1007-192.0.2.0/24         blackhole [xlb_vips4 22:30:32.432] * (200)
1008-\tType: static univ
1007-192.0.2.13/32        via 10.99.0.8 on eth0 [xlb_vips4 22:30:32.432] * (200)
1008-\tType: static univ
";

#[test]
fn reads_birds_show_route() {
    let reply = Reply::parse(SHOW_ROUTE);
    assert!(reply.has(CODE_WELCOME));
    assert!(reply.errors().is_empty());
    let routes = parse_routes(&reply, Family::V4);
    assert_eq!(
        routes,
        vec![
            route("192.0.2.11", "10.99.0.5", &[], None),
            route("192.0.2.11", "10.99.0.1", &[(1, 1)], None),
            route(
                "192.0.2.10",
                "10.99.0.1",
                &[(65000, 1), (65000, 7), (65000, 100)],
                Some(200)
            ),
            route("192.0.2.12", "10.99.0.7", &[], None),
            // A covering prefix (aggregation); without a BGP next hop, as
            // the agent never writes it: replaced on the next apply.
            Route {
                prefix: "192.0.2.0/24".parse().unwrap(),
                ..route("192.0.2.0", "0.0.0.0", &[], None)
            },
            route("192.0.2.13", "10.99.0.8", &[], None),
        ]
    );
    assert!(parse_routes(&reply, Family::V6).is_empty());
}

// Captured from BIRD 2.0.12 (`birdc -v show protocols all`), shortened:
// one session up (two channels, with their route counts), one trying to
// connect, a non-BGP protocol between.
const SHOW_PROTOCOLS: &str = "0001 BIRD 2.0.12 ready.
2002-Name       Proto      Table      State  Since         Info
1002-device1    Device     ---        up     23:47:00.160  
1006-
1002-node       BGP        ---        up     23:47:00.406  Established   
1006-  BGP state:          Established
         Neighbor address: 10.210.0.2
         Neighbor AS:      65001
         Local AS:         65000
         Hold timer:       4.070/6
       Channel ipv4
         State:          UP
         Routes:         0 imported, 3 exported, 0 preferred
         BGP Next hop:   10.210.0.1
       Channel ipv6
         State:          UP
         Routes:         0 imported, 1 exported, 0 preferred
     
1002-upstream2  BGP        ---        start  23:47:00.160  Connect       
1006-  BGP state:          Connect
         Neighbor address: fd00::7
         Neighbor AS:      65001
       Channel ipv4
         State:          DOWN
     
1002-xlb_vips4  Static     master4    up     23:47:00.160  
1006-  Channel ipv4
         State:          UP
";

#[test]
fn reads_bgp_session_states() {
    let reply = Reply::parse(SHOW_PROTOCOLS);
    // 90 s after the session came up.
    let now = Duration::from_secs(23 * 3600 + 48 * 60 + 30) + Duration::from_millis(406);
    assert_eq!(
        parse_bgp_sessions(&reply, now),
        vec![
            Session {
                peer: "10.210.0.2".parse().unwrap(),
                established: true,
                uptime: Some(Duration::from_secs(90)),
                prefixes_sent: Some(4),
            },
            Session::new("fd00::7".parse().unwrap(), false),
        ]
    );
    assert!(parse_bgp_sessions(&Reply::parse("0001 BIRD 2.0.12 ready.\n"), now).is_empty());
}

#[test]
fn a_since_time_of_day_is_an_uptime_and_a_date_is_none() {
    let at = |h: u64, m: u64| Duration::from_secs(h * 3600 + m * 60);
    assert_eq!(
        since("06:56:09.500", at(6, 57)),
        Some(Duration::from_millis(50_500))
    );
    // Yesterday, before midnight.
    assert_eq!(since("23:59:00", at(0, 1)), Some(Duration::from_secs(120)));
    // BIRD read its clock a moment after ours: no time yet, not a day.
    assert_eq!(since("06:57:00.300", at(6, 57)), Some(Duration::ZERO));
    for odd in ["2026-11-27", "25:00:00", "06:56", "06:56:09.x", ""] {
        assert_eq!(since(odd, at(6, 57)), None, "{odd}");
    }
}

#[test]
fn reads_v6_next_hops_and_empty_protocols() {
    let out = "0001 BIRD 2.0.12 ready.
1007-Table master6:
     2001:db8::10/128     blackhole [xlb_vips6 22:30:32.432] * (200)
1008-\tType: static univ
1012-\tBGP.next_hop: fd99::1 fe80::1
     \tBGP.local_pref: 200
";
    let routes = parse_routes(&Reply::parse(out), Family::V6);
    assert_eq!(
        routes,
        vec![route("2001:db8::10", "fd99::1", &[], Some(200))]
    );
    let empty = Reply::parse("0001 BIRD 2.0.12 ready.\n");
    assert!(parse_routes(&empty, Family::V6).is_empty());
}

#[test]
fn reads_errors_and_configure_replies() {
    let err = Reply::parse(
            "0001 BIRD 2.0.12 ready.\n0002-Reading configuration from /etc/bird.conf\n8002 /etc/xlb-vips6:3:61 syntax error, unexpected '}'\n",
        );
    assert_eq!(
        err.errors(),
        vec!["/etc/xlb-vips6:3:61 syntax error, unexpected '}'"]
    );
    let ok = Reply::parse(
        "0001 BIRD 2.0.12 ready.\n0002-Reading configuration from node.conf\n0003 Reconfigured\n",
    );
    assert!(ok.has(CODE_RECONFIGURED) && ok.errors().is_empty());
    assert_eq!(
        ok.text(),
        "Reading configuration from node.conf; Reconfigured"
    );
}

#[test]
fn renders_one_static_route_per_vip_and_family() {
    let bird = BirdAnnouncer::new("/etc/bird/xlb-vips", "/run/bird.ctl");
    let routes: BTreeSet<_> = [
        route(
            "192.0.2.10",
            "10.0.0.1",
            &[(65000, 100), (65000, 7), (65000, 7)],
            Some(200),
        ),
        route("192.0.2.11", "10.0.0.1", &[], None),
        route("2001:db8::10", "fd00::1", &[(65000, 1)], None),
    ]
    .into();
    let (v4, v6) = bird.render(&routes);
    assert_eq!(
            v4,
            "# Written by lb-agent (xlb) for `protocol static xlb_vips4`; every change is overwritten.
route 192.0.2.10/32 blackhole { bgp_next_hop = 10.0.0.1; bgp_community.add((65000,7)); bgp_community.add((65000,100)); bgp_local_pref = 200; };
route 192.0.2.11/32 blackhole { bgp_next_hop = 10.0.0.1; };
"
        );
    assert!(v6.ends_with(
            "\nroute 2001:db8::10/128 blackhole { bgp_next_hop = fd00::1; bgp_community.add((65000,1)); };\n"
        ));
    assert_eq!(bird.routes_file_v4(), PathBuf::from("/etc/bird/xlb-vips4"));
    assert_eq!(bird.protocol_v6(), "xlb_vips6");
    assert_eq!(
        bird.static_protocols_config(),
        "protocol static xlb_vips4 {\n    ipv4;\n    include \"/etc/bird/xlb-vips4\";\n}\n\
             protocol static xlb_vips6 {\n    ipv6;\n    include \"/etc/bird/xlb-vips6\";\n}\n"
    );
}

#[test]
fn refuses_what_bird_would_not_announce_as_meant() {
    let bad = |r: Route| validate(&[r].into()).unwrap_err().to_string();
    assert!(bad(route("2001:db8::1", "10.0.0.1", &[], None)).contains("family"));
    assert!(bad(route("192.0.2.1", "0.0.0.0", &[], None)).contains("unspecified"));
    let two: BTreeSet<_> = [
        route("192.0.2.1", "10.0.0.1", &[], None),
        route("192.0.2.1", "10.0.0.2", &[], None),
    ]
    .into();
    assert!(validate(&two)
        .unwrap_err()
        .to_string()
        .contains("two routes for one prefix"));
}

#[test]
fn renders_the_agents_sessions_with_bfd_and_what_bird_parses() {
    use crate::config::{Bfd, BgpPeer};
    let peer = |address: &str, bfd: Option<Bfd>| BgpPeer {
        address: address.parse().unwrap(),
        asn: 65000,
        port: None,
        hold_time: Duration::from_secs(9),
        keepalive: Duration::from_secs(3),
        password: None,
        multihop_ttl: None,
        graceful_restart: None,
        bfd,
    };
    let dir = std::env::temp_dir().join(format!("xlb-bird-sessions-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bird = BirdAnnouncer::new(dir.join("routes"), dir.join("bird.ctl"));
    // Without peers: a header only, no BFD protocol.
    let none = bird
        .clone()
        .with_sessions(dir.join("peers"), 65001, vec![])
        .render_sessions()
        .unwrap();
    assert!(!none.contains("protocol"), "{none}");
    let mut second = peer("fd00::fe", None);
    second.port = Some(1179);
    second.password = Some("s3cret".into());
    second.multihop_ttl = Some(2);
    second.graceful_restart = Some(Duration::from_secs(30));
    let bird = bird.with_sessions(
        dir.join("peers"),
        65001,
        vec![peer("10.0.0.254", Some(Bfd::DEFAULT)), second],
    );
    let text = bird.render_sessions().unwrap();
    for want in [
        "protocol bfd xlb_bfd {",
        "protocol bgp xlb_peer1 {",
        "    local as 65001;\n    neighbor 10.0.0.254 as 65000;",
        "    hold time 9;\n    keepalive time 3;",
        "    bfd { min rx interval 100 ms; min tx interval 100 ms; multiplier 3; };",
        "    ipv4 { import none; export where proto = \"xlb_vips4\"; };",
        "protocol bgp xlb_peer2 {",
        "    neighbor fd00::fe port 1179 as 65000;",
        "    multihop 2;",
        "    password \"s3cret\";",
        "    graceful restart on;\n    graceful restart time 30;",
        "    ipv6 { import none; export where proto = \"xlb_vips6\"; };",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    assert_eq!(text.matches("    bfd {").count(), 1, "{text}");
    // BIRD itself accepts the file beside the static protocols it exports.
    bird.ensure_files().unwrap();
    let conf = dir.join("bird.conf");
    std::fs::write(
        &conf,
        format!(
            "router id 10.0.0.1;\nprotocol device {{}}\n{}include \"{}\";\n",
            bird.static_protocols_config(),
            dir.join("peers").display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new("bird")
        .args(["-p", "-c"])
        .arg(&conf)
        .output()
        .expect("bird -p (BIRD 2 is installed by the test command)");
    assert!(
        out.status.success(),
        "bird -p: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}
