//! `cargo xtask bench l2`: how long the client's traffic stops when the
//! node that answers for its VIP in L2 mode goes away, in the L2 lab
//! (`xlb_tests::l2_lab`: a switch, a client, three nodes, a backend).
//!
//! The client sends a UDP datagram to the VIP every millisecond; the
//! backend echoes it back through the owner. For each event the owner of
//! the VIP is
//!
//! * crash: its agent SIGKILLed and its switch port set down (a node that
//!   lost its power: neither the agent nor the data plane nor the kernel
//!   answers or forwards);
//! * link-cut: its switch port set down (the node lives on, cut off);
//! * graceful: its agent stopped with SIGTERM (it hands over).
//!
//! The failover time is the longest gap between two echoes the client
//! received from just before the event until traffic flows through the
//! new owner. While each event and its undoing run, the client also asks
//! for the VIP by ARP every 10 ms: a request answered by two MACs counts
//! as a double owner. Then the node is restored (link up, agent started)
//! and takes its VIP back before the next event.
//!
//! Before each event the stream runs quiet for half a second; the longest
//! gap then is the baseline, this machine's own jitter (veth and softirq
//! batching deliver echoes in bursts of up to tens of milliseconds here).
//!
//! Before each event 10 keep-alive HTTP connections are opened through the
//! owner; a request on each across the event tells whether it was reset
//! (the nodes share their flows by default: `l2.share_flows`).
//!
//! Prints a table (events, median, p99, max, baseline p99, double owners,
//! keep-alive connections reset) and the line
//! `l2 failover: crash p99 X ms, link-cut p99 Y ms, graceful p99 Z ms,
//! double owners N`, and writes a histogram (docs/benchmarks-l2.svg).

use std::{
    fmt::Write as _,
    net::{SocketAddr, UdpSocket},
    process::ExitCode,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use clap::{Parser, ValueEnum};
use xlb_bench::{
    args::Svg,
    support::{install_sigint_flag, interrupted},
};
use xlb_tests::{
    l2_lab::{realtime_priority, vip, L2Lab, ECHO_PORT},
    topology::in_netns,
    traffic::poll_until,
};

/// The histogram, relative to the workspace root.
const SVG: &str = "docs/benchmarks-l2.svg";

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Kind {
    Crash,
    LinkCut,
    Graceful,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::Crash, Kind::LinkCut, Kind::Graceful];

    fn name(self) -> &'static str {
        match self {
            Kind::Crash => "crash",
            Kind::LinkCut => "link-cut",
            Kind::Graceful => "graceful",
        }
    }

    fn color(self) -> &'static str {
        match self {
            Kind::Crash => "#d62728",
            Kind::LinkCut => "#1f77b4",
            Kind::Graceful => "#2ca02c",
        }
    }
}

/// How long the client's traffic stops when the node that answers for its
/// VIP in L2 mode goes away (crash, link cut, graceful stop).
#[derive(Parser, Debug)]
#[command(
    name = "xlb-l2-bench",
    args_override_self = true,
    mut_arg("svg", |a| a.help(format!("Where to write the histogram [default: {SVG}]")))
)]
struct Options {
    /// Events per kind
    #[arg(long, value_name = "N", default_value_t = 50)]
    events: usize,
    /// Kinds of event, comma-separated [default: all]
    #[arg(long, value_name = "LIST", value_enum, value_delimiter = ',',
          default_values_t = Kind::ALL, hide_default_value = true)]
    kinds: Vec<Kind>,
    #[command(flatten)]
    svg: Svg,
}

/// The client's stream: a datagram every millisecond, and when each echo came back.
struct Stream {
    stop: Arc<AtomicBool>,
    echoes: Arc<Mutex<Vec<Instant>>>,
    threads: Vec<JoinHandle<()>>,
}

impl Stream {
    fn start(lab: &L2Lab) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let echoes = Arc::new(Mutex::new(Vec::new()));
        let target = SocketAddr::from((vip(0), ECHO_PORT));
        let sock = in_netns(&lab.client, move || {
            let s = UdpSocket::bind("0.0.0.0:0").expect("bind");
            s.connect(target).expect("connect");
            s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            s
        })
        .join()
        .expect("socket thread");
        let tx = sock.try_clone().unwrap();
        let (s1, s2) = (stop.clone(), stop.clone());
        let e = echoes.clone();
        let sender = std::thread::spawn(move || {
            realtime_priority();
            let mut seq: u64 = 0;
            let start = Instant::now();
            while !s1.load(Ordering::Relaxed) {
                seq += 1;
                let _ = tx.send(&seq.to_be_bytes());
                // Paced by the clock, not by sleeps adding up.
                let next = start + Duration::from_millis(seq);
                if let Some(d) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(d);
                }
            }
        });
        let receiver = std::thread::spawn(move || {
            realtime_priority();
            let mut buf = [0u8; 64];
            while !s2.load(Ordering::Relaxed) {
                if sock.recv(&mut buf).is_ok() {
                    e.lock().unwrap().push(Instant::now());
                }
            }
        });
        Self {
            stop,
            echoes,
            threads: vec![sender, receiver],
        }
    }

    /// An echo arrived after `t`.
    fn flowing_since(&self, t: Instant) -> bool {
        self.echoes.lock().unwrap().last().is_some_and(|e| *e > t)
    }

    /// The longest gap between consecutive echoes from `from` on (the
    /// first counted from `from` itself).
    fn longest_gap(&self, from: Instant) -> (Duration, Duration) {
        self.longest_gap_between(from, Instant::now() + Duration::from_secs(3600))
    }

    fn longest_gap_between(&self, from: Instant, to: Instant) -> (Duration, Duration) {
        let e = self.echoes.lock().unwrap();
        let mut prev = from;
        let mut longest = (Duration::ZERO, Duration::ZERO);
        for t in e.iter().filter(|t| **t > from && **t <= to) {
            if t.duration_since(prev) > longest.0 {
                longest = (t.duration_since(prev), prev.duration_since(from));
            }
            prev = *t;
        }
        longest
    }

    fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
    }
}

struct Sample {
    kind: Kind,
    gap: Duration,
    /// The longest gap in the quiet half second before the event: what
    /// this machine's jitter alone gives.
    baseline: Duration,
    doubles: usize,
    /// Of the `KEEPALIVE` connections open through the owner (and held by
    /// the others) before the event, those a request across it found reset.
    reset: usize,
}

/// Keep-alive connections through the owner at each event.
const KEEPALIVE: usize = 10;

/// Quiet time before each event, whose longest gap is the baseline.
const QUIET: Duration = Duration::from_millis(500);

/// One event: take the owner away, measure, bring it back.
fn event(lab: &mut L2Lab, stream: &Stream, kind: Kind) -> Result<Sample, String> {
    let owner = lab.wait_owner(vip(0), Duration::from_secs(10));
    let conns = lab.keepalive(SocketAddr::from((vip(0), 80)), KEEPALIVE, None)?;
    // Steady before the event: echoes within the last 50 ms.
    poll_until(Duration::from_secs(10), Duration::from_millis(5), || {
        stream
            .flowing_since(Instant::now() - Duration::from_millis(20))
            .then_some(())
            .ok_or(())
    })
    .map_err(|()| "no traffic before the event".to_string())?;
    let quiet = Instant::now();
    std::thread::sleep(QUIET);
    let watch = lab.watch_arp(vip(0), Duration::from_millis(10));
    let prefix = lab.prefix.clone();
    let t0 = Instant::now();
    let (baseline, _) = stream.longest_gap_between(quiet, t0);
    match kind {
        Kind::Crash => {
            lab.node(owner).kill_agent();
            lab.nodes[owner - 1].cut(&lab.switch, &prefix);
        }
        Kind::LinkCut => lab.nodes[owner - 1].cut(&lab.switch, &prefix),
        Kind::Graceful => lab.node(owner).stop_agent(Duration::from_secs(10)),
    }
    // Another node answers, and traffic flows after that.
    let next = poll_until(Duration::from_secs(15), Duration::from_millis(10), || {
        let o = lab.wait_owner(vip(0), Duration::from_secs(15));
        (o != owner).then_some(o).ok_or(())
    })
    .map_err(|()| format!("{}: no takeover", kind.name()))?;
    let taken = Instant::now();
    eprintln!(
        "  node {next} answers {} ms after the event",
        ms(taken - t0)
    );
    poll_until(Duration::from_secs(15), Duration::from_millis(5), || {
        stream.flowing_since(taken).then_some(()).ok_or(())
    })
    .map_err(|()| format!("{}: no traffic through node {next}", kind.name()))?;
    std::thread::sleep(Duration::from_millis(100));
    let (gap, at) = stream.longest_gap(t0);
    eprintln!(
        "  longest gap {} ms, from {} ms after the event",
        ms(gap),
        ms(at)
    );
    // A request on each keep-alive connection through the new owner while
    // the node comes back (after a crash or cut the backend's replies go to
    // its SNAT address and wait for it: docs/l2.md).
    let requests: Vec<_> = conns
        .into_iter()
        .map(|mut c| {
            std::thread::spawn(move || {
                let _ = c.stream.set_read_timeout(Some(Duration::from_secs(20)));
                c.get().is_err()
            })
        })
        .collect();
    // Undo, and let the node take its VIP back.
    match kind {
        Kind::Crash => {
            lab.nodes[owner - 1].heal(&lab.switch, &prefix);
            let c = lab.config(owner, "");
            lab.start_agent(owner, &c);
        }
        Kind::LinkCut => lab.nodes[owner - 1].heal(&lab.switch, &prefix),
        Kind::Graceful => {
            let c = lab.config(owner, "");
            lab.start_agent(owner, &c);
        }
    }
    poll_until(Duration::from_secs(15), Duration::from_millis(20), || {
        (lab.wait_owner(vip(0), Duration::from_secs(15)) == owner)
            .then_some(())
            .ok_or(())
    })
    .map_err(|()| format!("{}: node {owner} did not take its VIP back", kind.name()))?;
    let reset = requests
        .into_iter()
        .map(|r| r.join().unwrap_or(true))
        .filter(|broken| *broken)
        .count();
    let rounds = watch.stop();
    let wall0 = std::time::SystemTime::now() - t0.elapsed();
    let doubles = rounds.iter().filter(|(_, m)| m.len() > 1).count();
    for (at, macs) in rounds.iter().filter(|(_, m)| m.len() > 1) {
        let wall = wall0 + at.duration_since(t0);
        eprintln!(
            "  two owners {} ms after the event ({:?}): {:?}",
            ms(at.duration_since(t0)),
            wall.duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default(),
            macs.iter().map(|m| m[5]).collect::<Vec<_>>()
        );
    }
    Ok(Sample {
        kind,
        gap,
        baseline,
        doubles,
        reset,
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 * p).ceil() as usize).clamp(1, sorted.len()) - 1;
    sorted[i]
}

fn ms(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1000.0)
}

/// Buckets of the histogram: (upper bound, label).
const BUCKETS: [(Duration, &str); 9] = [
    (Duration::from_millis(5), "< 5 ms"),
    (Duration::from_millis(50), "5-50 ms"),
    (Duration::from_millis(200), "50-200 ms"),
    (Duration::from_millis(400), "200-400 ms"),
    (Duration::from_millis(600), "400-600 ms"),
    (Duration::from_millis(800), "600-800 ms"),
    (Duration::from_millis(1000), "0.8-1 s"),
    (Duration::from_millis(2000), "1-2 s"),
    (Duration::MAX, "> 2 s"),
];

fn svg(samples: &[Sample], kinds: &[Kind], caption: &str) -> String {
    let (w, h) = (1000.0, 420.0);
    let (left, right, up, down) = (50.0, 170.0, 40.0, 60.0);
    let (pw, ph) = (w - left - right, h - up - down);
    let mut counts = vec![vec![0usize; BUCKETS.len()]; kinds.len()];
    for s in samples {
        let k = kinds.iter().position(|k| *k == s.kind).unwrap();
        let b = BUCKETS.iter().position(|(up, _)| s.gap < *up).unwrap();
        counts[k][b] += 1;
    }
    let top = counts.iter().flatten().copied().max().unwrap_or(1).max(1);
    let slot = pw / BUCKETS.len() as f64;
    let bar = (slot - 6.0) / kinds.len() as f64;
    let y = |c: usize| up + ph - ph * c as f64 / top as f64;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"22\" font-size=\"15\" font-weight=\"bold\">L2 mode: longest gap in the client's traffic when the VIP's owner goes away</text>\n"
    );
    for (b, (_, label)) in BUCKETS.iter().enumerate() {
        for (k, kind) in kinds.iter().enumerate() {
            let n = counts[k][b];
            if n > 0 {
                let _ = writeln!(
                    s,
                    "<rect x=\"{x:.1}\" y=\"{yy:.1}\" width=\"{bar:.1}\" height=\"{hh:.1}\" fill=\"{c}\"><title>{name}, {label}: {n}</title></rect>",
                    x = left + slot * b as f64 + 3.0 + bar * k as f64,
                    yy = y(n),
                    hh = up + ph - y(n),
                    c = kind.color(),
                    name = kind.name()
                );
            }
        }
        let _ = writeln!(
            s,
            "<text x=\"{x:.1}\" y=\"{ty}\" text-anchor=\"middle\" font-size=\"11\">{label}</text>",
            x = left + slot * (b as f64 + 0.5),
            ty = up + ph + 16.0
        );
    }
    let _ = writeln!(
        s,
        "<line x1=\"{left}\" y1=\"{yb}\" x2=\"{x2}\" y2=\"{yb}\" stroke=\"black\"/>\
         <line x1=\"{left}\" y1=\"{up}\" x2=\"{left}\" y2=\"{yb}\" stroke=\"black\"/>\
         <text x=\"{left}\" y=\"{up}\" dy=\"-4\">{top} events</text>\
         <text x=\"{cx}\" y=\"{lt}\" text-anchor=\"middle\">longest gap between two echoes (1 datagram/ms)</text>\
         <text x=\"{left}\" y=\"{ct}\" fill=\"#555\">{caption}</text>",
        yb = up + ph,
        x2 = left + pw,
        cx = left + pw / 2.0,
        lt = up + ph + 34.0,
        ct = h - 8.0,
    );
    for (k, kind) in kinds.iter().enumerate() {
        let yy = up + 20.0 * k as f64;
        let _ = writeln!(
            s,
            "<rect x=\"{x}\" y=\"{yy}\" width=\"12\" height=\"12\" fill=\"{c}\"/><text x=\"{tx}\" y=\"{ty}\">{n}</text>",
            x = w - right + 20.0,
            c = kind.color(),
            tx = w - right + 38.0,
            ty = yy + 11.0,
            n = kind.name()
        );
    }
    s.push_str("</svg>\n");
    s
}

fn run(o: &Options) -> Result<(), String> {
    let mut lab = L2Lab::start(&format!("l2x{}", std::process::id() % 10000));
    lab.start_udp_echo();
    lab.start_all();
    let stream = Stream::start(&lab);
    let mut samples = Vec::new();
    for kind in &o.kinds {
        for i in 0..o.events {
            if interrupted() {
                break;
            }
            let s = event(&mut lab, &stream, *kind)
                .map_err(|e| format!("{e}; logs:\n{}", lab.logs()))?;
            eprintln!(
                "{} {}/{}: gap {} ms (baseline {} ms), double owners {}, keep-alive reset {}/{KEEPALIVE}",
                kind.name(),
                i + 1,
                o.events,
                ms(s.gap),
                ms(s.baseline),
                s.doubles,
                s.reset
            );
            samples.push(s);
        }
    }
    stream.stop();
    println!("| event | events | median | p99 | max | baseline p99 | double owners | keep-alive connections reset |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut line = Vec::new();
    let mut doubles = 0;
    for kind in &o.kinds {
        let mut gaps: Vec<Duration> = samples
            .iter()
            .filter(|s| s.kind == *kind)
            .map(|s| s.gap)
            .collect();
        gaps.sort();
        let mut base: Vec<Duration> = samples
            .iter()
            .filter(|s| s.kind == *kind)
            .map(|s| s.baseline)
            .collect();
        base.sort();
        let d: usize = samples
            .iter()
            .filter(|s| s.kind == *kind)
            .map(|s| s.doubles)
            .sum();
        doubles += d;
        let reset: usize = samples
            .iter()
            .filter(|s| s.kind == *kind)
            .map(|s| s.reset)
            .sum();
        println!(
            "| {} | {} | {} ms | {} ms | {} ms | {} ms | {d} | {reset} of {} |",
            kind.name(),
            gaps.len(),
            ms(percentile(&gaps, 0.5)),
            ms(percentile(&gaps, 0.99)),
            ms(gaps.last().copied().unwrap_or_default()),
            ms(percentile(&base, 0.99)),
            gaps.len() * KEEPALIVE
        );
        line.push(format!(
            "{} p99 {} ms",
            kind.name(),
            ms(percentile(&gaps, 0.99))
        ));
    }
    if let Some(path) = o.svg.path(SVG) {
        let caption = format!(
            "{} events per kind; defaults (probe 100 ms, suspect 300 ms); xlb-l2-bench",
            o.events
        );
        std::fs::write(&path, svg(&samples, &o.kinds, &caption))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        println!("histogram: {}", path.display());
    }
    println!("l2 failover: {}, double owners {doubles}", line.join(", "));
    Ok(())
}

fn main() -> ExitCode {
    let o = Options::parse();
    install_sigint_flag();
    match run(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xlb-l2-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    fn parse(args: &[&str]) -> Result<Options, clap::Error> {
        Options::try_parse_from(std::iter::once("xlb-l2-bench").chain(args.iter().copied()))
    }

    #[test]
    fn documented_invocations_parse() {
        Options::command().debug_assert();
        let o = parse(&[]).unwrap();
        assert_eq!((o.events, o.kinds.as_slice()), (50, &Kind::ALL[..]));
        assert!(o.svg.path(SVG).unwrap().ends_with(SVG));
        // docs/benchmarks.md
        let o = parse(&["--events", "10", "--no-svg"]).unwrap();
        assert_eq!((o.events, o.svg.path(SVG)), (10, None));
        assert_eq!(parse(&["--events", "3"]).unwrap().events, 3);
        let o = parse(&["--kinds", "crash,link-cut,graceful"]).unwrap();
        assert_eq!(o.kinds, Kind::ALL);
        assert_eq!(
            parse(&["--kinds", "link-cut"]).unwrap().kinds,
            [Kind::LinkCut]
        );
        parse(&["--kinds", "reboot"]).unwrap_err();
    }
}
