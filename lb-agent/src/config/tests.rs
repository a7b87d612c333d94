//! The file's rules, one field at a time.

use super::*;
use crate::dataplane::Protocol;

/// The example of docs/config.md, every field set.
const FULL: &str = "\
interfaces: [eth0, eth1]
snat_ipv4: 10.0.0.1
snat_ipv6: fd00::1
snat_ports: 20000-29999
metrics_addr: 0.0.0.0:9469
xdp_mode: generic
pod_interfaces: [cni0]
timeouts: { tcp: 15m, tcp_closing: 10s, udp: 60s }
services:
  - name: web
    vip: 192.0.2.10
    port: 80
    protocol: tcp
    mode: nat
    table_size: 16381
    on_backend_removed: keep
    backends:
      - { ip: 10.2.0.2, port: 8080, weight: 1 }
      - { ip: 10.2.0.3, port: 8080, weight: 0 }
    health_check: { type: tcp, interval: 1s, timeout: 500ms, rise: 2, fall: 2 }
  - name: dns6
    vip: 2001:db8::53
    port: 53
    protocol: udp
    mode: snat
    on_backend_removed: reset
    backends:
      - ip: fd00::2
        port: 53
        weight: 1000
    health_check:
      type: http
      path: /healthz
      expect_status: 204
      port: 8081
      interval: 2s
      timeout: 1s
      rise: 3
      fall: 4
";

/// Small and valid; the rejection tests break one thing in it.
/// Line numbers matter: the tests assert them.
const BASE: &str = "\
interfaces: [eth0]
snat_ipv4: 10.0.0.1
services:
  - name: web
    vip: 192.0.2.10
    port: 80
    backends:
      - { ip: 10.2.0.2, port: 8080 }
      - ip: 10.2.0.3
        port: 8080
  - name: api
    vip: 192.0.2.11
    port: 443
    backends:
      - { ip: 10.2.0.4, port: 8443 }
";

fn v4(s: &str) -> IpAddr {
    IpAddr::V4(s.parse().unwrap())
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// Replaces exactly one occurrence of `from` in `text`.
fn edit(text: &str, from: &str, to: &str) -> String {
    assert_eq!(text.matches(from).count(), 1, "{from:?} must occur once");
    text.replacen(from, to, 1)
}

/// Asserts that `text` is rejected at `line` about `field`, with a
/// message containing `needle`; returns the message.
#[track_caller]
fn rejects(text: &str, line: usize, field: &str, needle: &str) -> String {
    let e = AgentConfig::parse(text).expect_err("must be rejected");
    let msg = e.to_string();
    assert_eq!(e.line(), Some(line), "wrong line in {msg:?}");
    assert_eq!(e.field(), Some(field), "wrong field in {msg:?}");
    assert!(
        msg.starts_with(&format!("line {line}, {field}: ")),
        "bad format: {msg:?}"
    );
    assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    msg
}

#[test]
fn full_example() {
    let c = AgentConfig::parse(FULL).unwrap();
    let expected = AgentConfig {
        backend_metrics: true,
        interfaces: vec!["eth0".into(), "eth1".into()],
        snat_ipv4: Some("10.0.0.1".parse().unwrap()),
        snat_ipv6: Some("fd00::1".parse().unwrap()),
        snat_ports: (20000, 29999),
        metrics_addr: "0.0.0.0:9469".parse().unwrap(),
        xdp_mode: XdpAttachMode::Generic,
        pod_interfaces: PodInterfaces::Named(vec!["cni0".into()]),
        tcp_timeout: Duration::from_secs(900),
        tcp_closing_timeout: Duration::from_secs(10),
        udp_timeout: Duration::from_secs(60),
        maglev_pool_entries: lb_common::MAGLEV_POOL_ENTRIES,
        flow_table_entries: lb_common::FLOWS_ENTRIES,
        flood_threshold: lb_common::DEFAULT_FLOOD_THRESHOLD,
        bgp: None,
        kubernetes: None,
        load_interval: DEFAULT_LOAD_INTERVAL,
        cgroup_root: PathBuf::from(DEFAULT_CGROUP_ROOT),
        l2: None,
        flow_sync: None,
        services: vec![
            DesiredService {
                health_check: Some(HealthCheck {
                    kind: CheckKind::Tcp { port: None },
                    interval: Duration::from_secs(1),
                    timeout: Duration::from_millis(500),
                    rise: 2,
                    fall: 2,
                }),
                table_size: Some(16381),
                ..DesiredService::for_test("web", v4("192.0.2.10"), 80)
                    .with_backend(v4("10.2.0.2"), 8080, 1)
                    .with_backend(v4("10.2.0.3"), 8080, 0)
            },
            DesiredService {
                protocol: Protocol::Udp,
                mode: Mode::Snat,
                health_check: Some(HealthCheck {
                    kind: CheckKind::Http {
                        port: Some(8081),
                        path: "/healthz".into(),
                        expect_status: 204,
                    },
                    interval: Duration::from_secs(2),
                    timeout: Duration::from_secs(1),
                    rise: 3,
                    fall: 4,
                }),
                removed_backend_flows: RemovedBackendFlows::Reset,
                ..DesiredService::for_test("dns6", ip("2001:db8::53"), 53).with_backend(
                    ip("fd00::2"),
                    53,
                    1000,
                )
            },
        ],
    };
    assert_eq!(c, expected);
    let dp = c.dataplane_config();
    assert_eq!(
        (dp.snat_port_min, dp.snat_port_max, dp.tcp_timeout_s),
        (20000, 29999, 900)
    );
    assert_eq!((dp.tcp_closing_timeout_s, dp.udp_timeout_s), (10, 60));
}

#[test]
fn defaults() {
    let c = AgentConfig::parse(
        "interfaces: [eth0]\n\
             services:\n\
             - name: a\n  vip: 192.0.2.1\n  port: 53\n  backends: [{ ip: 10.0.0.1, port: 53 }]\n  \
               health_check: { type: http }\n",
    )
    .unwrap();
    assert_eq!(c.snat_ipv4, None);
    assert_eq!(c.snat_ipv6, None);
    assert_eq!(c.snat_ports, (10000, 32767));
    assert_eq!(c.metrics_addr, "127.0.0.1:9469".parse().unwrap());
    assert_eq!(c.xdp_mode, XdpAttachMode::Native);
    assert_eq!(c.tcp_timeout, Duration::from_secs(900));
    assert_eq!(c.tcp_closing_timeout, Duration::from_secs(10));
    assert_eq!(c.udp_timeout, Duration::from_secs(60));
    assert_eq!(c.dataplane_config(), lb_common::Config::default());
    let s = &c.services[0];
    assert_eq!(s.protocol, Protocol::Tcp);
    assert_eq!(s.mode, Mode::Nat);
    assert_eq!(s.table_size, None);
    assert_eq!(s.removed_backend_flows, RemovedBackendFlows::Keep);
    assert_eq!(s.backends[0].weight, 1);
    assert_eq!(
        s.health_check,
        Some(HealthCheck {
            kind: CheckKind::Http {
                port: None,
                path: "/".into(),
                expect_status: 200
            },
            interval: Duration::from_secs(1),
            timeout: Duration::from_millis(500),
            rise: 2,
            fall: 3,
        })
    );
    // A tcp check with only an interval: timeout is half of it.
    let c = AgentConfig::parse(&edit(
        BASE,
        "    port: 443\n",
        "    port: 443\n    health_check: { type: tcp, interval: 10s }\n",
    ))
    .unwrap();
    let h = c.services[1].health_check.as_ref().unwrap();
    assert_eq!(h.kind, CheckKind::Tcp { port: None });
    assert_eq!(h.timeout, Duration::from_secs(5));
    // No services at all is valid (an idle agent).
    let c = AgentConfig::parse("interfaces: [eth0]\n").unwrap();
    assert!(c.services.is_empty());
}

#[test]
fn base_is_valid() {
    let c = AgentConfig::parse(BASE).unwrap();
    assert_eq!(c.services.len(), 2);
    // Same VIP and port with another protocol is another service.
    let text = edit(
        BASE,
        "    vip: 192.0.2.11\n    port: 443\n",
        "    vip: 192.0.2.10\n    port: 80\n    protocol: udp\n",
    );
    AgentConfig::parse(&text).unwrap();
}

#[test]
fn service_specs_validate() {
    for text in [FULL, BASE] {
        let c = AgentConfig::parse(text).unwrap();
        let specs = c.service_specs();
        assert_eq!(specs.len(), c.services.len());
        for spec in &specs {
            spec.validate().unwrap();
        }
    }
    let c = AgentConfig::parse(FULL).unwrap();
    let specs = c.service_specs();
    assert_eq!(specs[0].snat, None);
    assert_eq!(specs[0].table_size, Some(16381));
    assert_eq!(
        specs[0].backends,
        vec![
            BackendSpec {
                addr: "10.2.0.2:8080".parse().unwrap(),
                weight: 1
            },
            BackendSpec {
                addr: "10.2.0.3:8080".parse().unwrap(),
                weight: 0
            },
        ]
    );
    assert_eq!(specs[1].snat, Some(ip("fd00::1")));
    assert_eq!(specs[1].protocol, Protocol::Udp);
    assert_eq!(specs[1].table_size, None);
    // An IPv4 snat service gets the IPv4 address.
    let text = edit(BASE, "    port: 443\n", "    port: 443\n    mode: snat\n");
    let specs = AgentConfig::parse(&text).unwrap().service_specs();
    assert_eq!(specs[1].snat, Some(v4("10.0.0.1")));
    specs[1].validate().unwrap();
    // The largest service the default table takes.
    let mut text = String::from(
        "interfaces: [eth0]\nservices:\n- name: big\n  vip: 192.0.2.1\n  port: 80\n  backends:\n",
    );
    for j in 0..655 {
        text += &format!("  - {{ ip: 10.1.{}.{}, port: 80 }}\n", j / 256, j % 256);
    }
    let specs = AgentConfig::parse(&text).unwrap().service_specs();
    specs[0].validate().unwrap();
}

#[test]
fn yaml_syntax_error() {
    let text = edit(BASE, "    vip: 192.0.2.11\n", "    vip: 192.0.2.11: 5\n");
    let e = AgentConfig::parse(&text).unwrap_err();
    assert!(matches!(e, ConfigError::Syntax { .. }), "{e}");
    assert_eq!(e.line(), Some(12));
    assert_eq!(
        e.to_string(),
        "line 12, column 20: YAML syntax error: mapping values are not allowed in this context"
    );
    // Bad indentation: libyaml only notices on the next line; serde_yaml
    // would have reported a missing field of the service before it.
    let text = edit(BASE, "    port: 80\n", "    port: 80\n   vip: 1.2.3.4\n");
    let e = AgentConfig::parse(&text).unwrap_err();
    assert!(matches!(e, ConfigError::Syntax { line: 7, .. }), "{e}");
    assert!(
        e.to_string()
            .contains("did not find expected '-' indicator"),
        "{e}"
    );
    let text = edit(BASE, "    port: 80\n", "    port: 80\n\tvip: 1.2.3.4\n");
    let e = AgentConfig::parse(&text).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("line 7, column 1: YAML syntax error: found a tab"),
        "{e}"
    );
    let e = AgentConfig::parse("a: 1\n---\nb: 2\n").unwrap_err();
    assert!(e.to_string().contains("more than one document"), "{e}");
    let e = AgentConfig::parse("interfaces: *x\n").unwrap_err();
    assert!(
        e.to_string()
            .contains("line 1, column 13: YAML syntax error: unknown anchor"),
        "{e}"
    );
}

#[test]
fn unknown_fields() {
    let text = edit(BASE, "port: 8080 }", "port: 8080, wieght: 2 }");
    rejects(
        &text,
        8,
        "services[0].backends[0].wieght",
        "unknown field `wieght`",
    );
    let text = edit(BASE, "snat_ipv4: 10.0.0.1\n", "snat_ip: 10.0.0.1\n");
    rejects(
        &text,
        2,
        "snat_ip",
        "unknown field `snat_ip`, expected one of",
    );
    let text = edit(
        BASE,
        "    port: 443\n",
        "    port: 443\n    health_check: { type: tcp, intreval: 1s }\n",
    );
    rejects(
        &text,
        14,
        "services[1].health_check.intreval",
        "unknown field",
    );
    let text = edit(
        BASE,
        "snat_ipv4: 10.0.0.1\n",
        "timeouts:\n  tcp: 1m\n  icmp: 1m\n",
    );
    rejects(&text, 4, "timeouts.icmp", "unknown field `icmp`");
    let text = edit(BASE, "    port: 443\n", "    port: 443\n    port: 444\n");
    rejects(&text, 11, "services[1].port", "duplicate field `port`");
}

#[test]
fn wrong_types_and_missing_fields() {
    let text = edit(BASE, "    port: 80\n", "    port: http\n");
    rejects(
        &text,
        6,
        "services[0].port",
        "invalid type: string \"http\", expected an integer",
    );
    let text = edit(BASE, "interfaces: [eth0]", "interfaces: eth0");
    rejects(&text, 1, "interfaces", "invalid type");
    let text = edit(
        BASE,
        "    port: 443\n",
        "    port: 443\n    protocol: sctp\n",
    );
    rejects(
        &text,
        14,
        "services[1].protocol",
        "unknown variant `sctp`, expected `tcp` or `udp`",
    );
    let text = edit(BASE, "    port: 443\n", "    port: 443\n    mode: dsr\n");
    rejects(&text, 14, "services[1].mode", "unknown variant `dsr`");
    let text = edit(BASE, "snat_ipv4: 10.0.0.1\n", "xdp_mode: offload\n");
    rejects(&text, 2, "xdp_mode", "unknown variant `offload`");
    let text = edit(
        BASE,
        "    port: 443\n",
        "    port: 443\n    on_backend_removed: drop\n",
    );
    rejects(
        &text,
        14,
        "services[1].on_backend_removed",
        "unknown variant `drop`",
    );
    let text = edit(
        BASE,
        "    port: 443\n",
        "    port: 443\n    health_check: { type: icmp }\n",
    );
    rejects(
        &text,
        14,
        "services[1].health_check.type",
        "unknown variant `icmp`",
    );
    // Missing: reported at the mapping that lacks it.
    let text = edit(BASE, "    vip: 192.0.2.11\n", "");
    rejects(&text, 11, "services[1].vip", "missing field `vip`");
    let text = edit(BASE, "interfaces: [eth0]\n", "");
    rejects(&text, 1, "interfaces", "missing field `interfaces`");
    rejects("", 1, "interfaces", "missing field `interfaces`");
    let msg = rejects("- eth0\n", 1, "(top level)", "invalid type: sequence");
    assert!(
        msg.contains("expected a mapping of configuration fields"),
        "{msg}"
    );
    let text = edit(
        BASE,
        "  - name: api\n",
        "  - name: api\n    table_size: 1.5\n",
    );
    rejects(
        &text,
        12,
        "services[1].table_size",
        "invalid type: floating point",
    );
}

#[test]
fn map_sizes() {
    let text = edit(BASE, "snat_ipv4: 10.0.0.1", "flow_table_entries: 4096");
    assert_eq!(AgentConfig::parse(&text).unwrap().flow_table_entries, 4096);
    let text = edit(BASE, "snat_ipv4: 10.0.0.1", "flow_table_entries: 100");
    rejects(
        &text,
        2,
        "flow_table_entries",
        "100 is outside 1024..=67108864",
    );
    let text = edit(BASE, "snat_ipv4: 10.0.0.1", "maglev_pool_entries: 1000");
    rejects(&text, 2, "maglev_pool_entries", "1000 is outside");
}

#[test]
fn flood_threshold() {
    assert_eq!(
        AgentConfig::parse(BASE).unwrap().flood_threshold,
        lb_common::DEFAULT_FLOOD_THRESHOLD
    );
    let text = edit(BASE, "snat_ipv4: 10.0.0.1", "flood_threshold: 0");
    assert_eq!(AgentConfig::parse(&text).unwrap().flood_threshold, 0);
    let text = edit(BASE, "snat_ipv4: 10.0.0.1", "flood_threshold: 2000000000");
    rejects(
        &text,
        2,
        "flood_threshold",
        "2000000000 is above 1000000000",
    );
    let text = edit(BASE, "snat_ipv4: 10.0.0.1", "flood_threshold: -1");
    rejects(&text, 2, "flood_threshold", "expected u32");
}

#[test]
fn bad_addresses() {
    let text = edit(BASE, "      - ip: 10.2.0.3\n", "      - ip: 10.2.0.x\n");
    let msg = rejects(
        &text,
        9,
        "services[0].backends[1].ip",
        "\"10.2.0.x\" is not an IP address",
    );
    assert_eq!(
        msg,
        "line 9, services[0].backends[1].ip: \"10.2.0.x\" is not an IP address"
    );
    let text = edit(BASE, "    vip: 192.0.2.11\n", "    vip: 192.0.2.256\n");
    rejects(&text, 12, "services[1].vip", "is not an IP address");
    let text = edit(BASE, "    vip: 192.0.2.11\n", "    vip: 12\n");
    rejects(&text, 12, "services[1].vip", "\"12\" is not an IP address");
    let text = edit(BASE, "snat_ipv4: 10.0.0.1", "snat_ipv4: fd00::1");
    rejects(&text, 2, "snat_ipv4", "is not an IPv4 address");
    let text = edit(BASE, "snat_ipv4: 10.0.0.1", "snat_ipv6: 10.0.0.1");
    rejects(&text, 2, "snat_ipv6", "is not an IPv6 address");
    let text = edit(BASE, "snat_ipv4: 10.0.0.1", "metrics_addr: localhost:9469");
    rejects(&text, 2, "metrics_addr", "is not an address:port");
    let text = edit(BASE, "snat_ipv4: 10.0.0.1", "metrics_addr: \"[::1]:9469\"");
    assert_eq!(
        AgentConfig::parse(&text).unwrap().metrics_addr,
        "[::1]:9469".parse().unwrap()
    );
}

#[test]
fn bad_ports() {
    let text = edit(BASE, "        port: 8080\n", "        port: 0\n");
    rejects(
        &text,
        10,
        "services[0].backends[1].port",
        "0 is not a port (1 to 65535)",
    );
    let text = edit(BASE, "        port: 8080\n", "        port: 70000\n");
    rejects(
        &text,
        10,
        "services[0].backends[1].port",
        "70000 is not a port",
    );
    let text = edit(BASE, "    port: 443\n", "    port: -1\n");
    rejects(&text, 13, "services[1].port", "-1 is not a port");
    let text = edit(
        BASE,
        "    port: 443\n",
        "    port: 443\n    health_check: { type: tcp, port: 65536 }\n",
    );
    rejects(
        &text,
        14,
        "services[1].health_check.port",
        "65536 is not a port",
    );
}

#[test]
fn interfaces() {
    let text = edit(BASE, "interfaces: [eth0]", "interfaces: []");
    rejects(&text, 1, "interfaces", "at least one interface");
    let text = edit(
        BASE,
        "interfaces: [eth0]",
        "interfaces:\n  - eth0\n  - a-very-long-name0",
    );
    rejects(&text, 3, "interfaces[1]", "is not an interface name");
    let text = edit(BASE, "interfaces: [eth0]", "interfaces: [eth0, eth0]");
    rejects(&text, 1, "interfaces[1]", "listed twice");
    let text = edit(BASE, "interfaces: [eth0]", "interfaces: [\"et h0\"]");
    rejects(&text, 1, "interfaces[0]", "is not an interface name");
}

#[test]
fn service_names() {
    let text = edit(BASE, "  - name: api\n", "  - name: web\n");
    let msg = rejects(
        &text,
        11,
        "services[1].name",
        "duplicate service name \"web\"",
    );
    assert!(msg.ends_with("(also services[0] at line 4)"), "{msg}");
    let text = edit(BASE, "  - name: api\n", "  - name: Api\n");
    rejects(&text, 11, "services[1].name", "is not a service name");
    let long = "x".repeat(64);
    let text = edit(BASE, "  - name: api\n", &format!("  - name: {long}\n"));
    rejects(&text, 11, "services[1].name", "is not a service name");
    let text = edit(BASE, "  - name: api\n", "  - name: \"\"\n");
    rejects(&text, 11, "services[1].name", "is not a service name");
    let text = edit(
        BASE,
        "  - name: api\n",
        &format!("  - name: a-b_c.{}\n", "9".repeat(57)),
    );
    AgentConfig::parse(&text).unwrap();
}

#[test]
fn duplicate_vip() {
    let text = edit(
        BASE,
        "    vip: 192.0.2.11\n    port: 443\n",
        "    vip: 192.0.2.10\n    port: 80\n",
    );
    let msg = rejects(&text, 11, "services[1]", "duplicate VIP");
    assert_eq!(
        msg,
        "line 11, services[1]: duplicate VIP 192.0.2.10:80/tcp (also in service \"web\" at line 4)"
    );
    let text = edit(
        BASE,
        "    vip: 192.0.2.11\n    port: 443\n",
        "    vip: 192.0.2.10\n    port: 80\n    protocol: tcp\n",
    );
    rejects(&text, 11, "services[1]", "duplicate VIP 192.0.2.10:80/tcp");
}

#[test]
fn backends() {
    let text = edit(
        BASE,
        "    backends:\n      - { ip: 10.2.0.4, port: 8443 }\n",
        "    backends: []\n",
    );
    rejects(&text, 14, "services[1].backends", "at least one backend");
    let text = edit(BASE, "10.2.0.4", "fd00::4");
    rejects(
        &text,
        15,
        "services[1].backends[0].ip",
        "fd00::4 is IPv6 but the VIP 192.0.2.11 is IPv4",
    );
    let text = edit(BASE, "    vip: 192.0.2.11\n", "    vip: 2001:db8::1\n");
    rejects(
        &text,
        15,
        "services[1].backends[0].ip",
        "10.2.0.4 is IPv4 but the VIP 2001:db8::1 is IPv6",
    );
    let text = edit(BASE, "      - ip: 10.2.0.3\n", "      - ip: 10.2.0.2\n");
    let msg = rejects(
        &text,
        9,
        "services[0].backends[1]",
        "duplicate backend 10.2.0.2:8080",
    );
    assert!(msg.ends_with("(also backends[0] at line 8)"), "{msg}");
    // Same address, other port: fine.
    let text = edit(
        BASE,
        "      - ip: 10.2.0.3\n        port: 8080\n",
        "      - ip: 10.2.0.2\n        port: 8081\n",
    );
    AgentConfig::parse(&text).unwrap();
    let text = edit(BASE, "port: 8443 }", "port: 8443, weight: 1001 }");
    rejects(
        &text,
        15,
        "services[1].backends[0].weight",
        "weight 1001 is out of range (0 to 1000",
    );
    let text = edit(BASE, "port: 8443 }", "port: 8443, weight: -1 }");
    rejects(
        &text,
        15,
        "services[1].backends[0].weight",
        "weight -1 is out of range",
    );
    let text = edit(BASE, "port: 8443 }", "port: 8443, weight: 0 }");
    assert_eq!(
        AgentConfig::parse(&text).unwrap().services[1].backends[0].weight,
        0
    );
}

#[test]
fn snat_needs_its_address() {
    let text = edit(BASE, "snat_ipv4: 10.0.0.1\n", "snat_ipv6: fd00::1\n");
    let text = edit(&text, "    port: 443\n", "    port: 443\n    mode: snat\n");
    rejects(&text, 14, "services[1].mode", "needs snat_ipv4");
    let text = edit(BASE, "    vip: 192.0.2.11\n", "    vip: 2001:db8::1\n");
    let text = edit(&text, "10.2.0.4", "fd00::4");
    let text = edit(&text, "    port: 443\n", "    port: 443\n    mode: snat\n");
    rejects(
        &text,
        14,
        "services[1].mode",
        "mode snat with the IPv6 VIP 2001:db8::1 needs snat_ipv6",
    );
    // nat mode needs neither.
    let text = edit(BASE, "snat_ipv4: 10.0.0.1\n", "");
    AgentConfig::parse(&text).unwrap();
}

#[test]
fn source_ranges_and_affinity() {
    let with = |extra: &str| edit(BASE, "  - name: web\n", &format!("  - name: web\n{extra}"));
    let ok = AgentConfig::parse(&with(
        "    source_ranges: [203.0.113.0/24, 10.0.0.0/8, 198.51.100.7]\n    affinity: client_ip\n",
    ))
    .unwrap();
    let web = &ok.services[0];
    let nets: Vec<String> = web
        .source_ranges
        .iter()
        .flatten()
        .map(|n| n.to_string())
        .collect();
    assert_eq!(nets, ["10.0.0.0/8", "198.51.100.7/32", "203.0.113.0/24"]);
    assert_eq!(
        web.affinity,
        Some(ClientAffinity {
            timeout: DEFAULT_AFFINITY_TIMEOUT
        })
    );
    let spec = ok.service_spec(web);
    assert!(spec.client_affinity);
    assert_eq!(spec.source_ranges.as_ref().map(Vec::len), Some(3));
    assert_eq!(ok.services[1].source_ranges, None, "open unless restricted");
    assert!(!ok.service_spec(&ok.services[1]).client_affinity);

    rejects(
        &with("    source_ranges: [10.0.0.1/8]\n"),
        5,
        "services[0].source_ranges[0]",
        "host bits set (the network is 10.0.0.0/8)",
    );
    rejects(
        &with("    source_ranges: [2001:db8::/32]\n"),
        5,
        "services[0].source_ranges[0]",
        "is IPv6 but the VIP 192.0.2.10 is IPv4",
    );
    rejects(
        &with("    source_ranges: [10.0.0.0/33]\n"),
        5,
        "services[0].source_ranges[0]",
        "is not a CIDR",
    );
    rejects(
        &with("    source_ranges: []\n"),
        5,
        "services[0].source_ranges",
        "refuse every client",
    );
    rejects(
        &with("    affinity: client_ip\n    affinity_timeout: 2d\n"),
        6,
        "services[0].affinity_timeout",
        "out of range",
    );
    rejects(
        &with("    affinity_timeout: 1h\n"),
        5,
        "services[0].affinity_timeout",
        "needs affinity: client_ip",
    );
    let t = AgentConfig::parse(&with(
        "    affinity: client_ip\n    affinity_timeout: 10m\n",
    ))
    .unwrap();
    assert_eq!(
        t.services[0].affinity.unwrap().timeout,
        Duration::from_secs(600)
    );
}

#[test]
fn balance_and_agent_check() {
    let with = |extra: &str| edit(BASE, "  - name: web\n", &format!("  - name: web\n{extra}"));
    let ok = AgentConfig::parse(&with(
        "    balance: load-aware\n    agent_check: {port: 9999}\n",
    ))
    .unwrap();
    assert_eq!(
        ok.services[0].balance,
        Balance::LoadAware {
            agent_check: Some(AgentCheck { port: 9999 })
        }
    );
    assert_eq!(
        ok.services[1].balance,
        Balance::Static,
        "static unless chosen"
    );
    assert_eq!(ok.load_interval, DEFAULT_LOAD_INTERVAL);
    let ok = AgentConfig::parse(&edit(
        &with("    balance: static\n"),
        "snat_ipv4: 10.0.0.1\n",
        "snat_ipv4: 10.0.0.1\nload_aware: {interval: 250ms}\n",
    ))
    .unwrap();
    assert_eq!(ok.load_interval, Duration::from_millis(250));
    rejects(
        &with("    balance: least-conn\n"),
        5,
        "services[0].balance",
        "`static` or `load-aware`",
    );
    rejects(
        &with("    agent_check: {port: 9999}\n"),
        5,
        "services[0].agent_check",
        "needs balance: load-aware",
    );
    rejects(
        &with("    balance: load-aware\n    agent_check: {port: 0}\n"),
        6,
        "services[0].agent_check.port",
        "",
    );
    rejects(
        &edit(
            BASE,
            "snat_ipv4: 10.0.0.1\n",
            "snat_ipv4: 10.0.0.1\nload_aware: {interval: 5ms}\n",
        ),
        3,
        "load_aware.interval",
        "outside 100ms..=60s",
    );
}

#[test]
fn backend_cgroups_and_their_root() {
    let with = |backend: &str, balance: &str| {
        edit(
            &edit(BASE, "      - { ip: 10.2.0.2, port: 8080 }\n", backend),
            "  - name: web\n",
            &format!("  - name: web\n{balance}"),
        )
    };
    let load_aware = "    balance: load-aware\n";
    let ok = AgentConfig::parse(&with(
        "      - { ip: 10.2.0.2, port: 8080, cgroup: /system.slice/web.service }\n",
        load_aware,
    ))
    .unwrap();
    let b = &ok.services[0].backends;
    assert_eq!(
        (&b[0].cgroup, &b[1].cgroup),
        (
            &Some(Box::new(BackendCgroup::Path(
                "system.slice/web.service".into()
            ))),
            &None
        )
    );
    assert_eq!(ok.cgroup_root, PathBuf::from("/sys/fs/cgroup"));
    let ok = AgentConfig::parse(&edit(
        BASE,
        "snat_ipv4: 10.0.0.1\n",
        "snat_ipv4: 10.0.0.1\nload_aware: {cgroup_root: /host/cgroup}\n",
    ))
    .unwrap();
    assert_eq!(ok.cgroup_root, PathBuf::from("/host/cgroup"));
    rejects(
        &with("      - { ip: 10.2.0.2, port: 8080, cgroup: web }\n", ""),
        8,
        "services[0].backends[0].cgroup",
        "needs balance: load-aware",
    );
    for bad in ["../etc", "/", "a/./b"] {
        rejects(
            &with(
                &format!("      - {{ ip: 10.2.0.2, port: 8080, cgroup: \"{bad}\" }}\n"),
                load_aware,
            ),
            9,
            "services[0].backends[0].cgroup",
            "is not a cgroup path",
        );
    }
    rejects(
        &edit(
            BASE,
            "snat_ipv4: 10.0.0.1\n",
            "snat_ipv4: 10.0.0.1\nload_aware: {cgroup_root: sys/fs/cgroup}\n",
        ),
        3,
        "load_aware.cgroup_root",
        "not an absolute path",
    );
}

#[test]
fn table_sizes() {
    let with = |m: &str| {
        edit(
            BASE,
            "  - name: web\n",
            &format!("  - name: web\n    table_size: {m}\n"),
        )
    };
    rejects(&with("16380"), 5, "services[0].table_size", "not a prime");
    rejects(&with("65539"), 5, "services[0].table_size", "exceeds 65537");
    rejects(
        &with("101"),
        5,
        "services[0].table_size",
        "below 100 x 2 backends",
    );
    rejects(&with("-7"), 5, "services[0].table_size", "not a prime");
    rejects(
        &with("4294967311"),
        5,
        "services[0].table_size",
        "not a prime",
    );
    assert_eq!(
        AgentConfig::parse(&with("211")).unwrap().services[0].table_size,
        Some(211)
    );
    // Without a size, the default must hold the backends.
    let mut text = String::from(
        "interfaces: [eth0]\nservices:\n- name: big\n  vip: 192.0.2.1\n  port: 80\n  backends:\n",
    );
    for j in 0..656 {
        text += &format!("  - {{ ip: 10.1.{}.{}, port: 80 }}\n", j / 256, j % 256);
    }
    rejects(
        &text,
        6,
        "services[0].backends",
        "656 backends are too many",
    );
}

#[test]
fn timeouts() {
    let with = |t: &str| {
        edit(
            BASE,
            "snat_ipv4: 10.0.0.1\n",
            &format!("timeouts:\n  {t}\n"),
        )
    };
    rejects(
        &with("tcp: 15 parsecs"),
        3,
        "timeouts.tcp",
        "\"15 parsecs\" is not a duration",
    );
    rejects(
        &with("udp: 500ms"),
        3,
        "timeouts.udp",
        "500ms is shorter than 1s",
    );
    rejects(
        &with("tcp_closing: 0s"),
        3,
        "timeouts.tcp_closing",
        "shorter than 1s",
    );
    rejects(
        &with("udp: 60"),
        3,
        "timeouts.udp",
        "\"60\" is not a duration",
    );
    rejects(&with("udp: 200years"), 3, "timeouts.udp", "is longer than");
    let c = AgentConfig::parse(&with("tcp: 1h 30m")).unwrap();
    assert_eq!(c.tcp_timeout, Duration::from_secs(5400));
    assert_eq!(c.udp_timeout, DEFAULT_UDP_TIMEOUT);
}

#[test]
fn health_checks() {
    let with = |h: &str| {
        edit(
            BASE,
            "    port: 443\n",
            &format!("    port: 443\n    health_check:\n      {h}\n"),
        )
    };
    let hc = "services[1].health_check";
    rejects(
        &with("{ type: tcp, interval: 50ms }"),
        15,
        &format!("{hc}.interval"),
        "50ms is shorter than 100ms",
    );
    rejects(
        &with("{ type: tcp, interval: 1x }"),
        15,
        &format!("{hc}.interval"),
        "is not a duration",
    );
    rejects(
        &with("{ type: tcp, timeout: 0s }"),
        15,
        &format!("{hc}.timeout"),
        "must be above 0",
    );
    rejects(
        &with("{ type: tcp, interval: 1s, timeout: 2s }"),
        15,
        &format!("{hc}.timeout"),
        "at most the interval (1s)",
    );
    rejects(
        &with("{ type: tcp, rise: 0 }"),
        15,
        &format!("{hc}.rise"),
        "0 is not a count of at least 1",
    );
    rejects(
        &with("{ type: tcp, fall: -2 }"),
        15,
        &format!("{hc}.fall"),
        "-2 is not a count",
    );
    rejects(
        &with("{ type: http, path: healthz }"),
        15,
        &format!("{hc}.path"),
        "\"healthz\" is not an HTTP path",
    );
    rejects(
        &with("{ type: http, path: \"/a b\" }"),
        15,
        &format!("{hc}.path"),
        "is not an HTTP path",
    );
    rejects(
        &with("{ type: http, expect_status: 99 }"),
        15,
        &format!("{hc}.expect_status"),
        "99 is not an HTTP status",
    );
    rejects(
        &with("{ type: tcp, path: /x }"),
        15,
        &format!("{hc}.path"),
        "only http checks",
    );
    rejects(
        &with("{ type: tcp, expect_status: 200 }"),
        15,
        &format!("{hc}.expect_status"),
        "only http checks",
    );
    // Block style: the line of the field itself.
    let text = with("type: http\n      path: /ok\n      interval: 1s\n      timeout: 5s");
    rejects(&text, 18, &format!("{hc}.timeout"), "at most the interval");
}

#[test]
fn snat_ports() {
    let with = |p: &str| {
        edit(
            BASE,
            "snat_ipv4: 10.0.0.1\n",
            &format!("snat_ipv4: 10.0.0.1\nsnat_ports: {p}\n"),
        )
    };
    for bad in [
        "80-90",
        "30000-20000",
        "abc",
        "10000-70000",
        "10000",
        "1023-2000",
    ] {
        rejects(&with(bad), 3, "snat_ports", "is not a port range MIN-MAX");
    }
    assert_eq!(
        AgentConfig::parse(&with("1024-65535")).unwrap().snat_ports,
        (1024, 65535)
    );
    assert_eq!(
        AgentConfig::parse(&with("5000-5000")).unwrap().snat_ports,
        (5000, 5000)
    );
}

#[test]
fn lines_in_flow_style_and_with_comments() {
    // The whole file on few lines, in flow style, with comments and
    // blank lines: the line is still the value's.
    let text = "# xlb\n\ninterfaces: [eth0]   # the uplink\n\
                    services: [ { name: a, vip: 192.0.2.1, port: 80, backends: [ { ip: 10.0.0.1, port: 80 } ] },\n\
                    \n  # the second\n\
                    { name: b, vip: 192.0.2.2, port: 80, backends: [ { ip: 10.0.0.1, port: 80 },\n\
                    { ip: 10.0.0.x, port: 80 } ] } ]\n";
    rejects(
        text,
        8,
        "services[1].backends[1].ip",
        "\"10.0.0.x\" is not an IP address",
    );
    // Anchors and aliases.
    let text = "interfaces: [eth0]\nservices:\n- name: a\n  vip: 192.0.2.1\n  port: 80\n  \
                    backends: &bs\n  - { ip: 10.0.0.1, port: 80 }\n  - { ip: 10.0.0.1, port: 80 }\n";
    rejects(text, 8, "services[0].backends[1]", "duplicate backend");
}

#[test]
fn load_from_file() {
    let dir = std::env::temp_dir().join(format!("xlb-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("lb.yaml");
    std::fs::write(&file, BASE).unwrap();
    assert_eq!(
        AgentConfig::load(&file).unwrap(),
        AgentConfig::parse(BASE).unwrap()
    );
    let missing = dir.join("missing.yaml");
    let e = AgentConfig::load(&missing).unwrap_err();
    assert!(matches!(e, ConfigError::Read { .. }), "{e}");
    assert_eq!(e.line(), None);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
// Its speed shows in the e2e bench (reload time); here only correctness.
fn large_config_parses_and_locates_errors() {
    let mut text = String::from("interfaces: [eth0]\nsnat_ipv4: 10.0.0.1\nservices:\n");
    for i in 0..1000 {
        text += &format!(
            "  - name: svc-{i}\n    vip: 192.0.{}.{}\n    port: 80\n    mode: snat\n    \
                 health_check: {{ type: http, path: /healthz }}\n    backends:\n",
            i / 256,
            i % 256
        );
        for j in 0..100 {
            text += &format!(
                "      - {{ ip: 10.{}.{}.{j}, port: 8080, weight: 1 }}\n",
                i / 256,
                i % 256
            );
        }
    }
    let c = AgentConfig::parse(&text).unwrap();
    assert_eq!(c.services.len(), 1000);
    assert_eq!(c.services[999].backends.len(), 100);
    // An error at the very end is located.
    let bad = text.replacen("ip: 10.3.231.99,", "ip: 10.3.231.x,", 1);
    let e = AgentConfig::parse(&bad).unwrap_err();
    assert_eq!(e.field(), Some("services[999].backends[99].ip"));
    assert_eq!(e.line(), Some(text.lines().count()));
}
#[test]
fn kubernetes_section_parses_and_checks() {
    let k = AgentConfig::parse("interfaces: [eth0]\nkubernetes: {}\n")
        .unwrap()
        .kubernetes
        .unwrap();
    assert_eq!(k.load_balancer_class, DEFAULT_LOAD_BALANCER_CLASS);
    assert_eq!(
        (k.default_class, k.mode, k.allocate_addresses),
        (false, Mode::Snat, true)
    );
    assert_eq!(
        (k.lease_namespace.as_str(), k.lease_name.as_str()),
        (DEFAULT_LEASE_NAMESPACE, DEFAULT_LEASE_NAME)
    );
    assert_eq!(k.lease_duration, DEFAULT_LEASE_DURATION);
    assert_eq!((k.kubeconfig, k.node_name), (None, None));

    let full = "interfaces: [eth0]\nkubernetes:\n  kubeconfig: /etc/xlb/kc\n  node_name: worker-1\n  \
                    load_balancer_class: example.com/lb\n  default_class: true\n  mode: nat\n  \
                    allocate_addresses: false\n  lease_namespace: lb\n  lease_name: ipam\n  lease_duration: 30s\n";
    let k = AgentConfig::parse(full).unwrap().kubernetes.unwrap();
    assert_eq!(k.kubeconfig.as_deref(), Some(Path::new("/etc/xlb/kc")));
    assert_eq!(k.node_name.as_deref(), Some("worker-1"));
    assert_eq!(k.load_balancer_class, "example.com/lb");
    assert_eq!(
        (k.default_class, k.mode, k.allocate_addresses),
        (true, Mode::Nat, false)
    );
    assert_eq!(
        (k.lease_namespace.as_str(), k.lease_name.as_str()),
        ("lb", "ipam")
    );
    assert_eq!(k.lease_duration, Duration::from_secs(30));

    let bad = |line: &str| format!("interfaces: [eth0]\nkubernetes:\n  {line}\n");
    rejects(
        &bad("node_name: Worker_1"),
        3,
        "kubernetes.node_name",
        "not a Kubernetes name",
    );
    rejects(
        &bad("lease_namespace: -x"),
        3,
        "kubernetes.lease_namespace",
        "not a Kubernetes name",
    );
    rejects(
        &bad("lease_duration: 1s"),
        3,
        "kubernetes.lease_duration",
        "outside 2s..=1h",
    );
    rejects(
        &bad("load_balancer_class: \"a b\""),
        3,
        "kubernetes.load_balancer_class",
        "not a loadBalancerClass",
    );
    rejects(&bad("mode: dsr"), 3, "kubernetes.mode", "nat");
    rejects(&bad("watch: all"), 3, "kubernetes.watch", "unknown field");
}

#[test]
fn bgp_section_parses_and_checks() {
    let text = format!(
            "{BASE}bgp:\n  driver: gobgp\n  next_hop_ipv4: 10.0.0.1\n  communities: [\"65000:100\"]\n  local_pref: 200\n  drain_time: 2s\n  graceful_shutdown: 3s\n  peers:\n    - {{ address: 10.0.0.254, asn: 65000, hold_time: 6s, graceful_restart: 30s }}\n"
        );
    let c = AgentConfig::parse(&text).unwrap();
    let b = c.bgp.unwrap();
    assert_eq!(b.next_hop_ipv4, Some("10.0.0.1".parse().unwrap()));
    assert_eq!(b.communities, vec![(65000, 100)]);
    assert_eq!(b.local_pref, Some(200));
    assert_eq!(b.drain_time, Duration::from_secs(2));
    assert_eq!(b.graceful_shutdown, Duration::from_secs(3));
    let off = AgentConfig::parse(&text.replace("  graceful_shutdown: 3s\n", "")).unwrap();
    assert_eq!(off.bgp.unwrap().graceful_shutdown, Duration::ZERO);
    match b.speaker {
        Speaker::GoBgp { address } => assert_eq!(address, DEFAULT_GOBGP_ADDRESS),
        other => panic!("{other:?}"),
    }
    let peers = &b.peers;
    assert_eq!(peers.len(), 1);
    assert_eq!(peers[0].hold_time, Duration::from_secs(6));
    assert_eq!(peers[0].keepalive, Duration::from_secs(2));
    assert_eq!(peers[0].graceful_restart, Some(Duration::from_secs(30)));
    assert_eq!(peers[0].bfd, None);
    // The capability has 12 bits for the restart time.
    let bad = text.replace("graceful_restart: 30s", "graceful_restart: 2h");
    let e = AgentConfig::parse(&bad).unwrap_err().to_string();
    assert!(
        e.contains("bgp.peers[0].graceful_restart") && e.contains("4095s"),
        "{e}"
    );
    // GoBGP has no BFD; BIRD does, and needs this node's AS to write the
    // sessions; ExaBGP's neighbours are its own.
    let bfd = text.replace("graceful_restart: 30s", "bfd: { min_rx: 50ms }");
    let e = AgentConfig::parse(&bfd).unwrap_err().to_string();
    assert!(
        e.contains("bgp.peers[0].bfd") && e.contains("GoBGP has no BFD"),
        "{e}"
    );
    let bird = bfd.replace("driver: gobgp", "driver: bird");
    let e = AgentConfig::parse(&bird).unwrap_err().to_string();
    assert!(e.contains("bgp.asn") && e.contains("required"), "{e}");
    let bird = bird.replace("driver: bird", "driver: bird\n  asn: 65001");
    let b = AgentConfig::parse(&bird).unwrap().bgp.unwrap();
    assert_eq!(b.asn, Some(65001));
    assert_eq!(
        b.peers[0].bfd,
        Some(Bfd {
            min_rx: Duration::from_millis(50),
            ..Bfd::DEFAULT
        })
    );
    match b.speaker {
        Speaker::Bird { peers_file, .. } => {
            assert_eq!(peers_file, std::path::Path::new("/run/xlb/bird-peers"))
        }
        other => panic!("{other:?}"),
    }
    for (bad, at, says) in [
        (
            "bfd: { min_rx: 5ms }",
            "bgp.peers[0].bfd.min_rx",
            "10ms to 10s",
        ),
        (
            "bfd: { multiplier: 0 }",
            "bgp.peers[0].bfd.multiplier",
            "1 to 255",
        ),
        ("bfd: { every: 1s }", "bgp.peers[0].bfd", "unknown field"),
        ("password: 'a\"b'", "bgp.peers[0].password", "quotes"),
        ("port: 0", "bgp.peers[0].port", "1 to 65535"),
    ] {
        let e = AgentConfig::parse(&bird.replace("bfd: { min_rx: 50ms }", bad))
            .unwrap_err()
            .to_string();
        assert!(e.contains(at) && e.contains(says), "{bad}: {e}");
    }
    let twice = bird.replace(
        "  peers:\n",
        "  peers:\n    - { address: 10.0.0.254, asn: 65002 }\n",
    );
    let e = AgentConfig::parse(&twice).unwrap_err().to_string();
    assert!(
        e.contains("bgp.peers[1].address") && e.contains("twice"),
        "{e}"
    );
    let exa = text.replace("driver: gobgp", "driver: exabgp");
    let e = AgentConfig::parse(&exa).unwrap_err().to_string();
    assert!(e.contains("bgp.peers") && e.contains("ExaBGP's own"), "{e}");
    // FRR takes BFD too, needs the AS for its sessions, and no spaces in
    // a password (vtysh reads one word).
    let frr = bfd.replace("driver: gobgp", "driver: frr");
    let e = AgentConfig::parse(&frr).unwrap_err().to_string();
    assert!(e.contains("bgp.asn") && e.contains("FRR's sessions"), "{e}");
    let frr = frr.replace("driver: frr", "driver: frr\n  asn: 65001");
    let b = AgentConfig::parse(&frr).unwrap().bgp.unwrap();
    assert!(b.peers[0].bfd.is_some());
    match b.speaker {
        Speaker::Frr {
            socket_dir,
            config_dir,
            vtysh,
        } => {
            assert_eq!(socket_dir, std::path::Path::new("/var/run/frr"));
            assert_eq!(config_dir, std::path::Path::new("/etc/frr"));
            assert_eq!(vtysh, std::path::Path::new("vtysh"));
        }
        other => panic!("{other:?}"),
    }
    let spaced = frr.replace("bfd: { min_rx: 50ms }", "password: 'a b'");
    let e = AgentConfig::parse(&spaced).unwrap_err().to_string();
    assert!(
        e.contains("bgp.peers[0].password") && e.contains("spaces"),
        "{e}"
    );
    let bad = format!("{BASE}bgp:\n  driver: gobgp\n  communities: [\"65000:x\"]\n");
    let e = AgentConfig::parse(&bad).unwrap_err().to_string();
    assert!(
        e.contains("bgp.communities[0]") && e.contains("line"),
        "{e}"
    );
    let large = format!(
        "{BASE}bgp:\n  driver: gobgp\n  large_communities: [\"65000:1:2\", \"4294967295:0:7\"]\n"
    );
    let b = AgentConfig::parse(&large).unwrap().bgp.unwrap();
    assert_eq!(b.large_communities, [(65000, 1, 2), (4294967295, 0, 7)]);
    for bad in ["65000:1", "65000:1:2:3", "4294967296:0:0", "a:b:c"] {
        let text = format!("{BASE}bgp:\n  driver: gobgp\n  large_communities: [\"{bad}\"]\n");
        let e = AgentConfig::parse(&text).unwrap_err().to_string();
        assert!(
            e.contains("bgp.large_communities[0]") && e.contains("GLOBAL:LOCAL1:LOCAL2"),
            "{bad}: {e}"
        );
    }
    let bad = format!("{BASE}bgp:\n  driver: quagga\n");
    let e = AgentConfig::parse(&bad).unwrap_err().to_string();
    assert!(
        e.contains("line") && e.contains("bgp.driver") && e.contains("quagga"),
        "{e}"
    );
    let bad = format!("{BASE}bgp:\n  driver: bird\n  next_hop_ipv4: fd00::1\n");
    let e = AgentConfig::parse(&bad).unwrap_err().to_string();
    assert!(e.contains("bgp.next_hop_ipv4"), "{e}");
}

#[test]
fn l2_section_parses_and_checks() {
    let key = std::env::temp_dir().join(format!("xlb-l2-key-{}", std::process::id()));
    std::fs::write(&key, "0123456789abcdef0123\n").unwrap();
    let short = std::env::temp_dir().join(format!("xlb-l2-short-{}", std::process::id()));
    std::fs::write(&short, "short").unwrap();
    let base = format!(
        "interfaces: [eth0, eth1]
l2:
  interfaces: [eth0]
  node_name: node-a
  bind: 10.0.0.11
  peers: [10.0.0.12, \"10.0.0.13:7000\"]
  key_file: {}
",
        key.display()
    );
    let c = AgentConfig::parse(&base).unwrap();
    let l2 = c.l2.unwrap();
    assert_eq!(l2.bind, Some("10.0.0.11:7946".parse().unwrap()));
    let unbound = AgentConfig::parse(&edit(&base, "  bind: 10.0.0.11\n", "")).unwrap();
    assert_eq!(unbound.l2.unwrap().bind, None);
    assert_eq!(l2.peers[1], "10.0.0.13:7000".parse().unwrap());
    assert_eq!(l2.keys, [b"0123456789abcdef0123".to_vec()]);
    assert_eq!(l2.quorum, 2, "majority of three");
    assert_eq!(l2.probe_interval, Duration::from_millis(100));
    assert_eq!(l2.announce_interval, Duration::from_secs(30));
    assert!(!l2.discover_peers);

    // No peers and a kubernetes section: discovered, any quorum allowed.
    let no_peers = edit(&base, "  peers: [10.0.0.12, \"10.0.0.13:7000\"]\n", "");
    let alone = AgentConfig::parse(&no_peers).unwrap().l2.unwrap();
    assert!(!alone.discover_peers && alone.quorum == 1);
    let k8s = format!("{no_peers}  quorum: 3\nkubernetes: {{ node_name: node-a }}\n");
    let found = AgentConfig::parse(&k8s).unwrap().l2.unwrap();
    assert!(found.discover_peers && found.quorum == 3 && !found.quorum_is_majority);

    rejects(
        &edit(&base, "interfaces: [eth0]", "interfaces: [eth2]"),
        3,
        "l2.interfaces[0]",
        "not in interfaces",
    );
    rejects(
        &edit(&base, "key_file: /", "key_file: /nonexistent/"),
        7,
        "l2.key_file",
        "No such file",
    );
    // One key or several, one a line (a rotation): each long enough, none
    // twice.
    for (contents, why) in [
        ("short", "line 1: a key must have at least 16 bytes"),
        ("\n \n", "holds no key"),
        (
            "0123456789abcdef0123\n0123456789abcdef0123\n",
            "line 2: the same key twice",
        ),
        (
            "0123456789abcdef0123\nshort\n",
            "line 2: a key must have at least 16 bytes",
        ),
    ] {
        std::fs::write(&short, contents).unwrap();
        rejects(
            &edit(
                &base,
                &key.display().to_string(),
                &short.display().to_string(),
            ),
            7,
            "l2.key_file",
            why,
        );
    }
    rejects(
        &format!("{base}  quorum: 4\n"),
        8,
        "l2.quorum",
        "outside 1..=3",
    );
    rejects(
        &format!("{base}  probe_timeout: 100ms\n"),
        8,
        "l2.probe_timeout",
        "shorter than probe_interval",
    );
    rejects(
        &format!("{base}  suspect_timeout: 150ms\n"),
        8,
        "l2.suspect_timeout",
        "at least twice probe_interval",
    );
    rejects(
        &edit(&base, "bind: 10.0.0.11", "bind: eth0"),
        5,
        "l2.bind",
        "not an address",
    );
    rejects(
        &edit(&base, "10.0.0.12,", "10.0.0.11,"),
        6,
        "l2.peers[0]",
        "listed twice",
    );
    let _ = std::fs::remove_file(key);
    let _ = std::fs::remove_file(short);
}

#[test]
fn flow_sync_section_parses_and_checks() {
    let key = std::env::temp_dir().join(format!("xlb-fs-key-{}", std::process::id()));
    std::fs::write(&key, "  0123456789abcdef0123\n").unwrap();
    let base = format!(
        "interfaces: [eth0]
flow_sync:
  peers: [10.0.0.12, \"10.0.0.13:7000\"]
  key_file: {}
",
        key.display()
    );
    let fs = AgentConfig::parse(&base).unwrap().flow_sync.unwrap();
    assert_eq!(fs.listen, "0.0.0.0:7947".parse().unwrap());
    assert_eq!(
        fs.peers,
        vec![
            "10.0.0.12:7947".parse().unwrap(),
            "10.0.0.13:7000".parse().unwrap()
        ]
    );
    assert_eq!(fs.keys, [b"0123456789abcdef0123".to_vec()], "trimmed");
    assert_eq!(fs.interval, Duration::from_millis(500));
    assert_eq!(fs.forget_after, Duration::from_secs(10));
    let tuned = format!("{base}  listen: 10.0.0.11:9000\n  interval: 100ms\n  forget_after: 1m\n");
    let fs = AgentConfig::parse(&tuned).unwrap().flow_sync.unwrap();
    assert_eq!(fs.listen, "10.0.0.11:9000".parse().unwrap());
    assert_eq!(fs.interval, Duration::from_millis(100));
    assert_eq!(fs.forget_after, Duration::from_secs(60));

    rejects(
        &edit(
            &base,
            "  peers: [10.0.0.12, \"10.0.0.13:7000\"]\n",
            "  peers: []\n",
        ),
        3,
        "flow_sync.peers",
        "at least one peer",
    );
    rejects(
        &edit(&base, "10.0.0.12,", "10.0.0.12, 10.0.0.12,"),
        3,
        "flow_sync.peers[1]",
        "listed twice",
    );
    rejects(
        &edit(&base, "key_file: /", "key_file: /nonexistent/"),
        4,
        "flow_sync.key_file",
        "No such file",
    );
    rejects(
        &format!("{base}  interval: 1h\n"),
        5,
        "flow_sync.interval",
        "outside 10ms..=60s",
    );
    rejects(
        &format!("{base}  forget_after: 500ms\n"),
        5,
        "flow_sync.forget_after",
        "outside 1s..=1h",
    );
    rejects(
        &format!("{base}  listen: eth0\n"),
        5,
        "flow_sync.listen",
        "not an address",
    );
    let _ = std::fs::remove_file(key);
}

#[test]
fn announce_per_service() {
    let with = |extra: &str| edit(BASE, "  - name: web\n", &format!("  - name: web\n{extra}"));
    let both = AgentConfig::parse(BASE).unwrap();
    assert_eq!(
        both.services[0].announce,
        Announce::Both,
        "both unless chosen"
    );
    let bgp = format!("{}bgp:\n  driver: bird\n", with("    announce: bgp\n"));
    assert_eq!(
        AgentConfig::parse(&bgp).unwrap().services[0].announce,
        Announce::Bgp
    );
    rejects(
        &with("    announce: l2\n"),
        5,
        "services[0].announce",
        "announce: l2 needs the l2: section",
    );
    rejects(
        &with("    announce: bgp\n"),
        5,
        "services[0].announce",
        "announce: bgp needs the bgp: section",
    );
    rejects(
        &with("    announce: arp\n"),
        5,
        "services[0].announce",
        "one of `both`, `bgp`, `l2`",
    );
}

#[test]
fn new_flow_limit_parses_and_checks() {
    let svc = "services:\n  - name: web\n    vip: 192.0.2.10\n    port: 80\n    backends: [{ ip: 10.0.0.2, port: 8080 }]\n";
    let with = |limit: &str| format!("interfaces: [eth0]\n{svc}    new_flow_limit: {limit}\n");
    let c = AgentConfig::parse(&with("{ per_second: 100, ipv4_prefix: 24 }")).unwrap();
    assert_eq!(
        c.services[0].new_flow_limit,
        Some(crate::dataplane::NewFlowLimit {
            per_second: 100,
            burst: 100,
            ipv4_prefix: 24,
            ipv6_prefix: 64,
        })
    );
    let l = c.service_specs()[0].new_flow_limit.unwrap().to_map();
    assert_eq!((l.period_ns, l.burst_ns), (10_000_000, 990_000_000));
    for (bad, field) in [
        ("{ per_second: 0 }", "per_second"),
        ("{ per_second: 10, ipv4_prefix: 33 }", "ipv4_prefix"),
        ("{ per_second: 10, burst: 0 }", "burst"),
        ("{ per_second: 10, per_prefix: 24 }", "per_prefix"),
    ] {
        let e = AgentConfig::parse(&with(bad)).unwrap_err().to_string();
        assert!(
            e.contains("services[0].new_flow_limit") && e.contains(field),
            "{bad}: {e}"
        );
    }
}

#[test]
fn pod_interfaces_default_to_auto_with_kubernetes_only() {
    let base = "interfaces: [eth0]\n";
    assert_eq!(
        AgentConfig::parse(base).unwrap().pod_interfaces,
        PodInterfaces::None
    );
    let k8s = format!("{base}kubernetes: {{ node_name: n1 }}\n");
    assert_eq!(
        AgentConfig::parse(&k8s).unwrap().pod_interfaces,
        PodInterfaces::Auto
    );
    let off = format!("{k8s}pod_interfaces: none\n");
    assert_eq!(
        AgentConfig::parse(&off).unwrap().pod_interfaces,
        PodInterfaces::None
    );
    let auto = format!("{base}pod_interfaces: auto\n");
    assert_eq!(
        AgentConfig::parse(&auto).unwrap().pod_interfaces,
        PodInterfaces::Auto
    );
    let named = format!("{base}pod_interfaces: [cni0, cbr0]\n");
    assert_eq!(
        AgentConfig::parse(&named).unwrap().pod_interfaces,
        PodInterfaces::Named(vec!["cni0".into(), "cbr0".into()])
    );
}

#[test]
fn pod_interfaces_are_checked() {
    let base = "interfaces: [eth0]\n";
    rejects(
        &format!("{base}pod_interfaces: sometimes\n"),
        2,
        "pod_interfaces",
        "is not auto, none or a list",
    );
    rejects(
        &format!("{base}pod_interfaces: [cni0, eth0]\n"),
        2,
        "pod_interfaces[1]",
        "also in interfaces",
    );
    rejects(
        &format!("{base}pod_interfaces: [cni0, cni0]\n"),
        2,
        "pod_interfaces[1]",
        "listed twice (also pod_interfaces[0])",
    );
    rejects(
        &format!("{base}pod_interfaces: [\"a/b\"]\n"),
        2,
        "pod_interfaces[0]",
        "is not an interface name",
    );
}

#[test]
fn a_listen_address_from_the_command_line() {
    for (text, want) in [
        ("10.0.0.11:9469", "10.0.0.11:9469"),
        ("[2001:db8::11]:9469", "[2001:db8::11]:9469"),
        // $(HOST_IP):9469 on an IPv6 node: no brackets.
        ("2001:db8::11:9469", "[2001:db8::11]:9469"),
        ("::1:9470", "[::1]:9470"),
    ] {
        assert_eq!(parse_listen_addr(text), Ok(want.parse().unwrap()), "{text}");
    }
    for bad in ["10.0.0.11", ":9469", "node-1:9469", "10.0.0.11:70000", ""] {
        assert!(parse_listen_addr(bad).is_err(), "{bad}");
    }
}

#[test]
fn backend_metrics_can_be_turned_off() {
    let on = AgentConfig::parse("interfaces: [eth0]\n").unwrap();
    assert!(on.backend_metrics);
    let off = AgentConfig::parse("interfaces: [eth0]\nbackend_metrics: false\n").unwrap();
    assert!(!off.backend_metrics);
    rejects(
        "interfaces: [eth0]\nbackend_metrics: sometimes\n",
        2,
        "backend_metrics",
        "boolean",
    );
}

mod generated {
    //! Generated input (`cargo xtask fuzz` runs these long): the full
    //! example with lines changed, dropped, repeated or cut short, and
    //! arbitrary text. The parser never panics, and a refusal names a line
    //! of the text.
    use proptest::{prelude::*, sample::Index};

    use super::*;

    fn check(text: &str) -> Result<(), TestCaseError> {
        if let Err(e) = AgentConfig::parse(text) {
            // Lines as YAML counts them: its line breaks include NEL and
            // the Unicode line and paragraph separators.
            let breaks = ['\n', '\r', '\u{85}', '\u{2028}', '\u{2029}'];
            let lines = text.split(breaks).count().max(1);
            if let Some(l) = e.line() {
                prop_assert!(l >= 1 && l <= lines + 1, "line {l} of {lines}: {e}");
            }
            prop_assert!(!e.to_string().is_empty());
        }
        Ok(())
    }

    /// A value of the kinds the file holds, or noise.
    fn any_value() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<i64>().prop_map(|n| n.to_string()),
            "[0-9./:a-f-]{0,24}",
            "[a-z_]{1,12}",
            "\\PC{0,16}",
            Just("[".to_string()),
            Just("{ a: [1, {".to_string()),
            Just("~".to_string()),
            Just("\"\\u0000\"".to_string()),
        ]
    }

    proptest! {
        #[test]
        fn generated_text_never_panics(text in "\\PC{0,300}") {
            check(&text)?;
        }

        #[test]
        fn generated_changes_to_the_full_example_never_panic(
            at in any::<Index>(),
            how in 0u8..4,
            value in any_value(),
        ) {
            let mut lines: Vec<String> = FULL.lines().map(str::to_string).collect();
            let i = at.index(lines.len());
            match how {
                // The value after the line's first colon.
                0 => {
                    let line = &lines[i];
                    lines[i] = match line.split_once(':') {
                        Some((k, _)) => format!("{k}: {value}"),
                        None => value,
                    };
                }
                1 => {
                    lines.remove(i);
                }
                2 => {
                    let l = lines[i].clone();
                    lines.insert(i, l);
                }
                _ => {
                    let l = &lines[i];
                    let cut = value.len() % (l.len() + 1);
                    lines[i] = l.chars().take(cut).collect();
                }
            }
            check(&lines.join("\n"))?;
        }
    }
}
