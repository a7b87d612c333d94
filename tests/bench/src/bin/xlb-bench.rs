//! `cargo xtask bench`: nanoseconds per packet of the XDP program, measured
//! with BPF_PROG_TEST_RUN, `repeat` = 1 per call so that every call sees the
//! original packet (with `repeat` > 1 the kernel would rerun the program on
//! the packet it has just rewritten). Cases are interleaved in rounds so
//! machine noise hits them alike; the floor is a program that only returns
//! XDP_PASS, measured the same way. Every call's verdict is checked.

use std::net::{Ipv4Addr, SocketAddr};

use aya::programs::Xdp;
use clap::{error::ErrorKind, CommandFactory, Parser};
use lb_agent::dataplane::{
    Dataplane, HandedFlow, Handing, Protocol, ServiceSpec, FLOOR_PROGRAM, PROGRAM, STEP_PROGRAMS,
};
use lb_common::{Config, FLOWS_ENTRIES};
use xlb_bench::args::E2eArgs;
use xlb_tests::{
    packet::{tcp_flags, Ipv4, PacketBuilder, Tcp, Udp},
    xdp::{test_run, FixtureBed},
};

const XDP_PASS: u32 = 2;
const XDP_REDIRECT: u32 = 4;
const ROUNDS: usize = 40;
const CALLS_PER_ROUND: usize = 2500;

const CL0_MAC: [u8; 6] = [2, 0, 0, 0, 1, 0];
const BE0_MAC: [u8; 6] = [2, 0, 0, 0, 2, 0];
const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 1, 2];
const B2_MAC: [u8; 6] = [2, 0, 0, 0, 2, 2];
const CLIENT: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);
const VIP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const B2: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 2);
const B3: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 3);
const SNAT: Ipv4Addr = Ipv4Addr::new(10, 2, 0, 1);

fn run(prog: &Xdp, ingress: u32, input: &[u8]) -> (u32, u64) {
    let (verdict, _, duration) = test_run(prog, ingress, input);
    (verdict, duration.as_nanos() as u64)
}

struct Case {
    name: &'static str,
    katran: Option<u64>,
    /// The data-plane speed issue's goal, ns above the floor.
    goal: Option<u64>,
    /// The program run: the data path, the floor, or one step alone.
    program: &'static str,
    ingress: u32,
    verdict: u32,
    /// Packet for call number i.
    packet: Box<dyn Fn(usize) -> Vec<u8>>,
    samples: Vec<u64>,
}

/// Nanoseconds per packet of the XDP program (BPF_PROG_TEST_RUN), case by
/// case, against a floor that only returns XDP_PASS.
#[derive(Parser, Debug)]
#[command(name = "xlb-bench", args_override_self = true)]
struct Cli {
    /// Run one case alone for SECONDS, for `perf record` (docs/benchmarks.md)
    #[arg(long, num_args = 2, value_names = ["CASE", "SECONDS"])]
    profile: Option<Vec<String>>,
    /// `cargo xtask bench ARGS` passes ARGS to this benchmark and to
    /// xlb-e2e-bench: accepted (so that a typo fails at once) and ignored.
    #[command(
        flatten,
        next_help_heading = "xlb-e2e-bench's options (accepted and ignored: `cargo xtask bench ARGS` passes ARGS to both)"
    )]
    _e2e: E2eArgs,
}

fn main() {
    // `--profile CASE SECONDS`: run one case alone for a while.
    let profile = Cli::parse().profile.map(|v| {
        let seconds = v[1].parse::<u64>().unwrap_or_else(|e| {
            Cli::command()
                .error(
                    ErrorKind::ValueValidation,
                    format!("--profile: SECONDS {:?}: {e}", v[1]),
                )
                .exit()
        });
        (v[0].clone(), seconds)
    });
    let FixtureBed {
        mut dp,
        cl0,
        be0,
        ns: _ns,
    } = FixtureBed::new("xlb-bench");
    // Port 81: the same service behind 1,000 source ranges, the client's
    // the most specific, to show what `loadBalancerSourceRanges` costs.
    let mut ranges: Vec<ipnet::IpNet> = (0..999u32)
        .map(|i| {
            format!("172.{}.{}.0/24", 16 + i / 256, i % 256)
                .parse()
                .unwrap()
        })
        .collect();
    ranges.push("10.0.0.0/30".parse().unwrap());
    // Ports 83 and 84 share a backend: a reply from it cannot tell the
    // services apart, so their new flows also write a reply entry (what
    // every NAT flow did before `BACKEND_REVERSE`).
    for (port, protocol, backend, ranges) in [
        (80, Protocol::Tcp, (B2, 8080), None),
        (53, Protocol::Udp, (B2, 5353), None),
        (81, Protocol::Tcp, (B2, 8081), Some(ranges)),
        (83, Protocol::Tcp, (B3, 8080), None),
        (84, Protocol::Tcp, (B3, 8080), None),
    ] {
        let backend = SocketAddr::new(backend.0.into(), backend.1);
        dp.set_service(&ServiceSpec {
            source_ranges: ranges,
            ..ServiceSpec::new(VIP.into(), port, protocol, [backend])
        })
        .unwrap();
    }
    // Port 86: snat mode, 8 backend ports on B2 (each its own space of
    // source ports) and the whole port range, so that 100 000 new flows
    // fill a fifth of it and find a free port in one probe or two.
    let backends = (9001..=9008).map(|port| SocketAddr::new(B2.into(), port));
    dp.set_service(&ServiceSpec {
        snat: Some(SNAT.into()),
        ..ServiceSpec::new(VIP.into(), 86, Protocol::Tcp, backends)
    })
    .unwrap();
    dp.set_config(Config {
        snat_port_min: 1024,
        snat_port_max: 65535,
        ..Config::default()
    })
    .unwrap();
    let tcp = |src: Ipv4Addr,
               dst: Ipv4Addr,
               sport: u16,
               dport: u16,
               flags: u8,
               macs: ([u8; 6], [u8; 6])| {
        PacketBuilder::new()
            .eth(macs.0, macs.1)
            .ipv4(Ipv4::new(src, dst))
            .tcp(
                Tcp::new(sport, dport)
                    .seq(1)
                    .ack(1)
                    .flags(flags)
                    .payload(&[0u8; 20]),
            )
            .build()
    };
    let client = (CLIENT_MAC, CL0_MAC);
    let backend = (B2_MAC, BE0_MAC);
    let udp = PacketBuilder::new()
        .eth(CLIENT_MAC, CL0_MAC)
        .ipv4(Ipv4::new(CLIENT, VIP))
        .udp(Udp::new(40001, 53).payload(&[0u8; 32]))
        .build();
    // Fill the flow table first: a node that has run a while has a full
    // table (flows leave it only when evicted), so every new flow also
    // evicts one. Measured on an empty table, a new flow looked 10-20 %
    // cheaper (docs/benchmarks.md).
    let prog = dp.program();
    for i in 0..FLOWS_ENTRIES as usize {
        let src = Ipv4Addr::from(0x0a09_0000 + (i as u32 / 50_000));
        let syn = tcp(
            src,
            VIP,
            1024 + (i % 50_000) as u16,
            80,
            tcp_flags::SYN,
            client,
        );
        assert_eq!(run(prog, cl0, &syn).0, XDP_REDIRECT);
    }
    // Establish the flows the "established" and "reply" cases use.
    let syn = tcp(CLIENT, VIP, 40000, 80, tcp_flags::SYN, client);
    assert_eq!(run(prog, cl0, &syn).0, XDP_REDIRECT);
    assert_eq!(run(prog, cl0, &udp).0, XDP_REDIRECT);
    let syn81 = tcp(CLIENT, VIP, 40002, 81, tcp_flags::SYN, client);
    assert_eq!(run(prog, cl0, &syn81).0, XDP_REDIRECT);

    let est = tcp(CLIENT, VIP, 40000, 80, tcp_flags::ACK, client);
    let reply = tcp(B2, CLIENT, 8080, 40000, tcp_flags::ACK, backend);
    let nonvip = tcp(
        CLIENT,
        Ipv4Addr::new(10, 0, 0, 1),
        40000,
        22,
        tcp_flags::ACK,
        client,
    );
    let udp_est = udp.clone();
    let est_step = tcp(CLIENT, VIP, 40000, 80, tcp_flags::ACK, client);
    // A new source address and port each call: a flow never seen before.
    // `net`: the first source address (a /16 of its own per case).
    let new_flows = |net: u32, dport: u16| -> Box<dyn Fn(usize) -> Vec<u8>> {
        Box::new(move |i| {
            let src = Ipv4Addr::from(net + (i as u32 / 50_000));
            let sport = 1024 + (i % 50_000) as u16;
            tcp(src, VIP, sport, dport, tcp_flags::SYN, client)
        })
    };
    let mut cases = [
        Case {
            name: "floor (XDP_PASS only)",
            katran: Some(7),
            goal: None,
            ingress: cl0,
            verdict: XDP_PASS,
            packet: Box::new(move |_| est.clone()),
            program: FLOOR_PROGRAM,
            samples: vec![],
        },
        Case {
            name: "TCP established flow",
            katran: Some(69),
            goal: Some(60),
            ingress: cl0,
            verdict: XDP_REDIRECT,
            packet: Box::new({
                let p = tcp(CLIENT, VIP, 40000, 80, tcp_flags::ACK, client);
                move |_| p.clone()
            }),
            program: PROGRAM,
            samples: vec![],
        },
        Case {
            name: "TCP established flow, 1,000 source ranges",
            katran: None,
            goal: None,
            ingress: cl0,
            verdict: XDP_REDIRECT,
            packet: Box::new({
                let p = tcp(CLIENT, VIP, 40002, 81, tcp_flags::ACK, client);
                move |_| p.clone()
            }),
            program: PROGRAM,
            samples: vec![],
        },
        Case {
            name: "UDP established flow",
            katran: Some(102),
            goal: Some(60),
            ingress: cl0,
            verdict: XDP_REDIRECT,
            packet: Box::new(move |_| udp_est.clone()),
            program: PROGRAM,
            samples: vec![],
        },
        Case {
            name: "TCP SYN, new flow",
            katran: Some(195),
            goal: Some(200),
            ingress: cl0,
            verdict: XDP_REDIRECT,
            packet: new_flows(0x0a01_0000, 80),
            program: PROGRAM,
            samples: vec![],
        },
        Case {
            name: "TCP SYN, new flow, snat",
            katran: None,
            goal: None,
            ingress: cl0,
            verdict: XDP_REDIRECT,
            packet: new_flows(0x0a03_0000, 86),
            program: PROGRAM,
            samples: vec![],
        },
        Case {
            name: "TCP SYN, new flow, backend of two services",
            katran: None,
            goal: None,
            ingress: cl0,
            verdict: XDP_REDIRECT,
            packet: new_flows(0x0a02_0000, 83),
            program: PROGRAM,
            samples: vec![],
        },
        Case {
            name: "reply translation",
            katran: None,
            goal: Some(50),
            ingress: be0,
            verdict: XDP_REDIRECT,
            packet: Box::new(move |_| reply.clone()),
            program: PROGRAM,
            samples: vec![],
        },
        Case {
            name: "non-VIP pass",
            katran: Some(32),
            goal: Some(10),
            ingress: cl0,
            verdict: XDP_PASS,
            packet: Box::new(move |_| nonvip.clone()),
            program: PROGRAM,
            samples: vec![],
        },
        step(STEP_CLOCK, "clock read", cl0, {
            let p = est_step.clone();
            Box::new(move |_| p.clone())
        }),
        step(STEP_MAC, "MAC check (frame for this node)", cl0, {
            let p = est_step.clone();
            Box::new(move |_| p.clone())
        }),
        step(STEP_SERVICE, "service lookup (hit)", cl0, {
            let p = est_step.clone();
            Box::new(move |_| p.clone())
        }),
        step(STEP_FLOW_LOOKUP, "flow lookup (hit)", cl0, {
            let p = est_step.clone();
            Box::new(move |_| p.clone())
        }),
        step(
            STEP_FLOW_INSERT,
            "flow insert (table full: evicts one)",
            cl0,
            new_flows(0x0a04_0000, 80),
        ),
    ];
    let mut call = 0usize;
    // `--profile`: for `perf record` to show where one case's time goes
    // (docs/benchmarks.md).
    if let Some((name, seconds)) = profile {
        let c = cases
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no case named {name:?}"));
        let until = std::time::Instant::now() + std::time::Duration::from_secs(seconds);
        let mut samples = Vec::new();
        while std::time::Instant::now() < until {
            for _ in 0..1000 {
                let pkt = (c.packet)(call);
                call += 1;
                let (verdict, ns) = run(program(&mut dp, c.program), c.ingress, &pkt);
                assert_eq!(verdict, c.verdict);
                samples.push(ns);
            }
        }
        // The last half: for new flows, a full flow table by then.
        let mut tail = samples.split_off(samples.len() / 2);
        tail.sort_unstable();
        println!(
            "{name}: {call} calls, median of the last half {} ns (floor not subtracted)",
            tail[tail.len() / 2]
        );
        return;
    }
    for _ in 0..ROUNDS {
        for c in cases.iter_mut() {
            let prog = program(&mut dp, c.program);
            for _ in 0..CALLS_PER_ROUND {
                let pkt = (c.packet)(call);
                call += 1;
                let (v, ns) = run(prog, c.ingress, &pkt);
                assert_eq!(v, c.verdict, "{}: unexpected verdict", c.name);
                c.samples.push(ns);
            }
        }
    }
    print_tables(&mut cases);
    // How close the program is to the verifier's limits: what any new
    // branch in the data path has to fit in.
    let info = dp.program().info().expect("program info");
    println!(
        "\nprogram: {} instructions verified (the kernel's limit: 1,000,000), {} bytes translated",
        info.verified_instruction_count()
            .map_or("?".to_string(), |n| n.to_string()),
        info.size_translated().map_or(0, |n| n)
    );
    flow_exchange_cost(&mut dp);
}

/// Issue 29's goal for the foreign-frame check, per packet.
const MAC_CHECK_GOAL_NS: u64 = 5;
const STEP_CLOCK: &str = STEP_PROGRAMS[0];
const STEP_MAC: &str = STEP_PROGRAMS[1];
const STEP_SERVICE: &str = STEP_PROGRAMS[2];
const STEP_FLOW_LOOKUP: &str = STEP_PROGRAMS[3];
const STEP_FLOW_INSERT: &str = STEP_PROGRAMS[4];

/// A case that runs one step of the data path alone (lb-ebpf/src/steps.rs).
fn step(
    program: &'static str,
    name: &'static str,
    ingress: u32,
    packet: Box<dyn Fn(usize) -> Vec<u8>>,
) -> Case {
    Case {
        name,
        katran: None,
        goal: None,
        program,
        ingress,
        verdict: XDP_PASS,
        packet,
        samples: vec![],
    }
}

fn program<'a>(dp: &'a mut Dataplane, name: &str) -> &'a Xdp {
    if name == PROGRAM {
        dp.program()
    } else {
        dp.bench_program(name).expect("benchmark program")
    }
}

fn median(s: &mut [u64]) -> u64 {
    s.sort_unstable();
    s[s.len() / 2]
}

/// The per-packet table with the goals, then where the time goes: each
/// step alone above the floor, and what of a case it accounts for.
fn print_tables(cases: &mut [Case]) {
    let floor = median(&mut cases[0].samples);
    let mut above = std::collections::HashMap::new();
    for c in cases.iter_mut() {
        let m = median(&mut c.samples);
        above.insert(c.name, m.saturating_sub(floor));
    }
    println!("xlb per-packet cost, BPF_PROG_TEST_RUN, repeat=1, {} calls per case, {} interleaved rounds, the flow table full", ROUNDS * CALLS_PER_ROUND, ROUNDS);
    println!();
    println!("| case | median ns | p90 ns | median - floor | goal (above floor) | Katran (reference) | ratio to floor |");
    println!("|---|---:|---:|---:|---|---:|---:|");
    for c in cases.iter().filter(|c| !STEP_PROGRAMS.contains(&c.program)) {
        let m = c.samples[c.samples.len() / 2];
        let p90 = c.samples[c.samples.len() * 9 / 10];
        let k = c.katran.map_or("-".into(), |k| format!("{k} ns"));
        let over = above[c.name];
        let goal = c.goal.map_or("-".into(), |g| {
            format!("≤ {g} ns: {}", if over <= g { "met" } else { "not met" })
        });
        println!(
            "| {} | {m} | {p90} | {over} | {goal} | {k} | {:.1}x |",
            c.name,
            m as f64 / floor.max(1) as f64
        );
    }
    println!();
    println!("Where the time goes: each step alone (lb-ebpf/src/steps.rs), on the same maps, in the same rounds");
    println!();
    println!("| step | median - floor |");
    println!("|---|---:|");
    for c in cases.iter().filter(|c| STEP_PROGRAMS.contains(&c.program)) {
        println!("| {} | {} |", c.name, above[c.name]);
    }
    println!();
    let step = |name: &str| above[name];
    let (clock, service) = (step("clock read"), step("service lookup (hit)"));
    let mac = step("MAC check (frame for this node)");
    println!(
        "MAC check: {mac} ns above the floor, goal ≤ {MAC_CHECK_GOAL_NS} ns: {}",
        if mac <= MAC_CHECK_GOAL_NS {
            "met"
        } else {
            "not met"
        }
    );
    let (lookup, insert) = (
        step("flow lookup (hit)"),
        step("flow insert (table full: evicts one)"),
    );
    let account = |case: &str, parts: &[(&str, u64)], rest: &str| {
        let total = above[case];
        let named: u64 = parts.iter().map(|p| p.1).sum();
        let list: Vec<String> = parts.iter().map(|(n, v)| format!("{n} {v}")).collect();
        if parts.is_empty() {
            println!("{case}: {total} ns above the floor: {rest}");
            return;
        }
        println!(
            "{case}: {total} ns above the floor = {} ({named} ns) + {} ns for the rest: {rest}",
            list.join(" + "),
            total as i64 - named as i64
        );
    };
    account(
        "TCP established flow",
        &[
            ("service lookup", service),
            ("flow lookup", lookup),
            ("clock", clock),
            ("MAC check", mac),
        ],
        "parsing, the rewrite and its checksums, counters, the cached route and the redirect",
    );
    account(
        "UDP established flow",
        &[
            ("service lookup", service),
            ("flow lookup", lookup),
            ("clock", clock),
            ("MAC check", mac),
        ],
        "as for TCP",
    );
    account(
        "TCP SYN, new flow",
        &[
            ("service lookup", service),
            ("flow insert", insert),
            ("clock", clock),
            ("MAC check", mac),
        ],
        "an established packet's rest, the Maglev pick (hash, slot read) and the reverse-translation check",
    );
    account(
        "reply translation",
        &[
            ("reply-table lookup, as a flow lookup", lookup),
            ("clock", clock),
            ("MAC check", mac),
        ],
        "parsing, the rewrite and its checksums, counters, the cached route and the redirect",
    );
    account(
        "non-VIP pass",
        &[("MAC check", mac)],
        "parsing and two port-flag reads (this clock reads in 10 ns steps)",
    );
}

/// Flows handed over in the flow exchange's cost measurement.
const HANDED_FLOWS: u32 = 100_000;

/// What the flow exchange (`flow_sync`) costs the agent: writing flows
/// another node handed over (a system call each), and the walk of the flow
/// table that finds the flows to hand on (each interval).
fn flow_exchange_cost(dp: &mut Dataplane) {
    dp.clear_dynamic_state().unwrap();
    let flows: Vec<HandedFlow> = (0..HANDED_FLOWS)
        .map(|i| HandedFlow {
            protocol: Protocol::Tcp,
            client: SocketAddr::from(([10, 1, (i >> 8) as u8, i as u8], 1024 + (i % 7) as u16)),
            vip: SocketAddr::from((VIP, 86)),
            backend: SocketAddr::from((B2, 9001 + (i % 8) as u16)),
            snat: Some(SocketAddr::from(([10, 2, 0, 9], 1024 + (i % 60000) as u16))),
            closed: false,
            idle_ms: 0,
        })
        .collect();
    let ids = dp.handoff_ids();
    let mut table = dp.flow_table().unwrap();
    let t = std::time::Instant::now();
    let got = table.import_flows(&ids, &flows).unwrap();
    let import = t.elapsed();
    assert_eq!(got.added, HANDED_FLOWS as usize, "{got:?}");
    let t = std::time::Instant::now();
    let all = table.handed_flows(&ids.lifetimes(), Handing::All).unwrap();
    let walk = t.elapsed();
    assert_eq!(all.len(), HANDED_FLOWS as usize);
    let t = std::time::Instant::now();
    let none = table
        .handed_flows(&ids.lifetimes(), Handing::OpenedHereSince(u64::MAX))
        .unwrap();
    let idle_walk = t.elapsed();
    assert!(none.is_empty());
    let (seal, open, encrypt) = sealing_cost(&all);
    let per = |d: std::time::Duration| d.as_nanos() as f64 / HANDED_FLOWS as f64 / 1000.0;
    println!(
        "flow exchange (flow_sync), {HANDED_FLOWS} snat flows: import {} ms ({:.2} µs a flow); walk handing all {} ms ({:.2} µs an entry); walk handing none {} ms ({:.2} µs an entry); frames sealed {} ms ({:.2} µs an entry, of which encryption {:.2}), opened {} ms ({:.2} µs an entry)",
        import.as_millis(),
        per(import),
        walk.as_millis(),
        per(walk),
        idle_walk.as_millis(),
        per(idle_walk),
        seal.as_millis(),
        per(seal),
        per(encrypt),
        open.as_millis(),
        per(open),
    );
}

/// What the exchange's encryption costs `flows`: framing and sealing them
/// as a push does, reading the frames back as the peer does, and
/// encrypting the same bytes alone.
fn sealing_cost(
    flows: &[HandedFlow],
) -> (
    std::time::Duration,
    std::time::Duration,
    std::time::Duration,
) {
    use lb_agent::{
        flow_sync::wire::{self, Frame, FLOWS_PER_FRAME, RECORD_LEN},
        seal::{Keyring, Purpose},
    };
    let keys = Keyring::new(&[b"bench-key-0123456789abcdef".to_vec()], Purpose::FlowSync);
    let nonce = [7u8; 16];
    let t = std::time::Instant::now();
    let frames: Vec<Vec<u8>> = flows
        .chunks(FLOWS_PER_FRAME)
        .map(|c| wire::seal(&keys, &nonce, &Frame::Flows(c.to_vec())))
        .collect();
    let seal = t.elapsed();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let t = std::time::Instant::now();
    let mut read = 0;
    for f in &frames {
        let mut r = &f[..];
        match rt
            .block_on(wire::read(&mut r, &keys, Some(&nonce)))
            .unwrap()
        {
            (_, Frame::Flows(got)) => read += got.len(),
            other => panic!("{other:?}"),
        }
    }
    let open = t.elapsed();
    assert_eq!(read, flows.len());
    let bytes = vec![0x5au8; FLOWS_PER_FRAME * RECORD_LEN];
    let t = std::time::Instant::now();
    for c in flows.chunks(FLOWS_PER_FRAME) {
        std::hint::black_box(keys.seal(b"header", &bytes[..c.len() * RECORD_LEN]));
    }
    (seal, open, t.elapsed())
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Cli;

    #[test]
    fn documented_invocations_parse() {
        Cli::command().debug_assert();
        let profile = |argv: &[&str]| Cli::try_parse_from(argv).map(|c| c.profile);
        // docs/benchmarks.md
        assert_eq!(
            profile(&["xlb-bench", "--profile", "TCP SYN, new flow", "14"]).unwrap(),
            Some(vec!["TCP SYN, new flow".to_string(), "14".to_string()])
        );
        assert_eq!(profile(&["xlb-bench"]).unwrap(), None);
        // `cargo xtask bench ARGS` gives ARGS to xlb-e2e-bench too.
        profile(&["xlb-bench", "--duration", "5"]).unwrap();
        profile(&["xlb-bench", "--no-memory", "--no-svg", "--no-udp"]).unwrap();
        profile(&["xlb-bench", "--profile", "TCP SYN, new flow"]).unwrap_err();
        profile(&["xlb-bench", "--no-such-flag"]).unwrap_err();
    }
}
