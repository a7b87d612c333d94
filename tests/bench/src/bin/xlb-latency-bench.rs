//! `cargo xtask bench latency` (also part of `cargo xtask bench`): the two
//! measurements of the seed papers that the other benchmarks lack.
//!
//! * Latency at a constant request rate (the CNI study's table). An
//!   open-loop client written here (no tcpkali or wrk2 in Debian): K
//!   keep-alive HTTP/1.1 connections from the client namespace, requests
//!   scheduled at fixed intervals and handed to whichever connection is
//!   idle (one request in flight per connection; when none is idle they
//!   queue in the client), each request's latency counted from its
//!   *scheduled* send time, so that a slow answer delays the requests
//!   behind it and shows in their latency too (no coordinated omission).
//!   The rates are 30 %, 50 % and 70 % of the topology's maximum, measured
//!   first with the same client in closed loop (each connection sends its
//!   next request when the answer arrives) straight to the backends. The
//!   cases: no balancer (the client connects straight to the 3 nginx
//!   backends, spread over them; the study's `--net=host` reference), xlb
//!   (lb-agent, nat mode) and nftables DNAT as kube-proxy's nftables mode
//!   writes it, run interleaved in rounds (the order rotating), set up and
//!   torn down as in `xlb-e2e-bench`. IPVS is not measured: this kernel has
//!   no ip_vs (CONFIG_IP_VS off, no modules to load).
//! * TCP throughput (the field report's table): `iperf3 -P 1` and `-P 8`
//!   from the client to a Pod on the balancer's node (a namespace behind a
//!   veth of the LB namespace, as a CNI attaches a Pod) and to a Pod on a
//!   second node (a router namespace one veth further, with its Pod behind
//!   it), through xlb in nat and in snat mode and with no balancer at all
//!   (the client straight to the Pod, routed by the same namespaces), in
//!   rounds alternating which comes first.
//!
//! Prints markdown tables and a line per goal.

use std::{
    collections::VecDeque,
    fmt::Write as _,
    io::{ErrorKind, Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream},
    os::fd::AsRawFd,
    path::Path,
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

use clap::Parser;
use xlb_bench::{
    args::{positive, Mech},
    support::{
        self, attach_pinned, check_interrupt, cmd_line, detach_xdp, http_get, install_sigint_flag,
        interrupted, iperf3_json, ipvs_not_measured,
        mechanisms::{check_serves, start, stop, Ctx, Running, BACKENDS},
        median, pin_bench_programs, run_in, sh_in, xdp_attached, Agent, Bins, Res, REMOTE_POD,
    },
};
use xlb_tests::{
    netns::Netns,
    topology::{backend_ip, Topology, BACKEND_PORT, VIP},
    traffic::poll_until,
};

const PREFIX: &str = "xlat";
/// The throughput part's agent (its own metrics address and pins).
const TP_METRICS: &str = "127.0.0.1:9471";
const IPERF_PORT: u16 = 5201;
/// The Pod on the second node.
/// The LB node's address the snat services translate to.
const SNAT_IP: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);

/// Latency at 30/50/70 % of the maximum request rate (open loop) through
/// xlb, nftables DNAT and no balancer; iperf3 throughput through xlb (nat,
/// snat) to a Pod on the balancer's node and on another node.
#[derive(Parser, Debug)]
#[command(name = "xlb-latency-bench", args_override_self = true)]
struct Opts {
    /// Interleaved rounds of the latency cases
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = positive::<usize>)]
    rounds: usize,
    /// Measured seconds per open-loop run (after --warmup)
    #[arg(long, value_name = "SECS", default_value_t = 2.0, value_parser = positive::<f64>)]
    duration: f64,
    /// Seconds of each run before the measured ones (requests sent, not counted)
    #[arg(long, value_name = "SECS", default_value_t = 0.5)]
    warmup: f64,
    /// Measured seconds of the closed-loop run that finds the maximum rate
    #[arg(long, value_name = "SECS", default_value_t = 3.0, value_parser = positive::<f64>)]
    max_duration: f64,
    /// Keep-alive connections of the client
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = positive::<usize>)]
    connections: usize,
    /// Client threads, each with its share of the connections and the rate
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = positive::<usize>)]
    threads: usize,
    /// Loads, in percent of the maximum rate, comma-separated
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_values_t = [30u32, 50, 70],
          value_parser = positive::<u32>)]
    loads: Vec<u32>,
    /// Rounds of the throughput part
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = positive::<usize>)]
    tp_rounds: usize,
    /// Seconds per iperf3 run
    #[arg(long, value_name = "SECS", default_value_t = 2, value_parser = positive::<u32>)]
    tp_duration: u32,
    /// Skip the latency part
    #[arg(long)]
    no_latency: bool,
    /// Skip the throughput part
    #[arg(long)]
    no_throughput: bool,
    /// Run the client's threads at real-time priority (SCHED_FIFO 10), so
    /// that they send on schedule when the machine's CPUs are busy
    #[arg(long)]
    client_fifo: bool,
    // E.g. a build of another commit.
    /// The lb-agent binary to measure (default: the one next to this binary)
    #[arg(long, value_name = "PATH")]
    lb_agent: Option<std::path::PathBuf>,
}

// ---------------------------------------------------------------------------
// The open-loop (and closed-loop) HTTP client.

/// What one run of the client measured.
#[derive(Default, Debug)]
struct Load {
    /// Latency of each request scheduled in the measured window, in ns,
    /// from its scheduled send time (closed loop: from its send time).
    lat_ns: Vec<u64>,
    /// Requests of the window still unanswered 2 s after it (their
    /// latency, counted up to then, is in `lat_ns`: a lower bound).
    unfinished: u64,
    /// Answers other than 200, and connections that broke.
    errors: u64,
    /// Answers completed within the measured window, per second.
    done_per_s: f64,
    /// How late the client itself sent each request of the window (its
    /// send time minus its scheduled time), in ns: the client's share of
    /// the latency.
    lag_ns: Vec<u64>,
}

/// A complete HTTP/1.1 response at the start of `buf`: its length and
/// status. `Ok(None)`: not all of it yet.
fn parse_response(buf: &[u8]) -> Res<Option<(usize, u16)>> {
    let Some(h) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Ok(None);
    };
    let head = std::str::from_utf8(&buf[..h]).map_err(|_| "response head is not UTF-8")?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("not an HTTP response: {head:.60}"))?;
    let len = lines
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .ok_or_else(|| format!("response without Content-Length: {head:.80}"))?;
    let total = h + 4 + len;
    Ok((buf.len() >= total).then_some((total, status)))
}

/// The `p`-th percentile (nearest rank) of sorted `v`, in µs.
fn percentile_us(sorted: &[u64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    // (The small margin keeps 99.9 % of 1000 at 999 despite rounding.)
    let rank = (p * sorted.len() as f64 / 100.0 - 1e-9).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1] as f64 / 1000.0
}

struct Conn {
    stream: TcpStream,
    /// Scheduled time of the request in flight.
    inflight: Option<Instant>,
    buf: Vec<u8>,
}

/// `epoll_pwait2` (a timeout in ns; `epoll_wait`'s is in ms, coarser than
/// the latencies measured here).
fn epoll_wait_ns(epfd: i32, events: &mut [libc::epoll_event], timeout: Duration) -> Res<usize> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: valid epoll fd, event buffer and timespec; no signal mask.
    let n = unsafe {
        libc::syscall(
            libc::SYS_epoll_pwait2,
            epfd,
            events.as_mut_ptr(),
            events.len() as libc::c_int,
            &ts as *const libc::timespec,
            std::ptr::null::<libc::sigset_t>(),
            0usize,
        )
    };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        if e.kind() == ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(format!("epoll_pwait2: {e}"));
    }
    Ok(n as usize)
}

/// One client thread (already in the client's namespace): `conns`
/// connections, the `i`-th to `targets[(first + i) % len]`. With `rate`
/// (requests/s of this thread) open loop, the first request at
/// `t0 + phase`; without, closed loop.
#[allow(clippy::too_many_arguments)]
fn client_thread(
    targets: &[SocketAddr],
    first: usize,
    conns: usize,
    rate: Option<f64>,
    phase: Duration,
    t0: Instant,
    warmup: Duration,
    duration: Duration,
    fifo: bool,
) -> Res<Load> {
    if fifo {
        let param = libc::sched_param { sched_priority: 10 };
        // SAFETY: sched_setscheduler on the calling thread (pid 0).
        if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
            return Err(format!("SCHED_FIFO: {}", std::io::Error::last_os_error()));
        }
    }
    // Wake-ups on time: the default 50 µs timer slack would add to every latency.
    // SAFETY: prctl on the calling thread.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
    }
    // SAFETY: plain epoll_create1; the fd is closed below.
    let epfd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if epfd < 0 {
        return Err(format!(
            "epoll_create1: {}",
            std::io::Error::last_os_error()
        ));
    }
    struct Fd(i32);
    impl Drop for Fd {
        fn drop(&mut self) {
            // SAFETY: closing the fd this guard owns.
            unsafe { libc::close(self.0) };
        }
    }
    let _epfd = Fd(epfd);
    let mut cs = Vec::with_capacity(conns);
    for i in 0..conns {
        let addr = targets[(first + i) % targets.len()];
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2))
            .map_err(|e| format!("connect {addr}: {e}"))?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        stream.set_nonblocking(true).map_err(|e| e.to_string())?;
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: i as u64,
        };
        // SAFETY: registering a valid socket fd with a valid epoll fd.
        if unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, stream.as_raw_fd(), &mut ev) } < 0 {
            return Err(format!("epoll_ctl: {}", std::io::Error::last_os_error()));
        }
        cs.push(Some(Conn {
            stream,
            inflight: None,
            buf: Vec::with_capacity(512),
        }));
    }
    let request = b"GET / HTTP/1.1\r\nHost: xlb-bench\r\n\r\n";
    let measure_from = t0 + warmup;
    let end = measure_from + duration;
    let give_up = end + Duration::from_secs(2);
    let interval = rate.map(|r| Duration::from_secs_f64(1.0 / r));
    let mut next = t0 + phase;
    let mut queue: VecDeque<Instant> = VecDeque::new();
    let mut idle: Vec<usize> = (0..conns).collect();
    let mut load = Load::default();
    let mut done_in_window = 0u64;
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; conns.max(1)];
    // Sends on connection `c` a request scheduled at `sched`.
    let send = |c: &mut Conn, sched: Instant| -> bool {
        match c.stream.write(request) {
            Ok(n) if n == request.len() => {
                c.inflight = Some(sched);
                true
            }
            // One request at a time on an idle connection: its send buffer
            // is empty, so a short write means the connection is broken.
            _ => false,
        }
    };
    std::thread::sleep(t0.saturating_duration_since(Instant::now()));
    loop {
        let now = Instant::now();
        match interval {
            Some(iv) => {
                while next <= now && next < end {
                    queue.push_back(next);
                    next += iv;
                }
            }
            None => {
                if now < end {
                    queue.extend(std::iter::repeat_n(now, idle.len()));
                }
            }
        }
        while !queue.is_empty() {
            let Some(i) = idle.pop() else { break };
            let sched = queue.pop_front().expect("not empty");
            let c = cs[i].as_mut().expect("idle connections are open");
            if !send(c, sched) {
                load.errors += 1;
                cs[i] = None;
                queue.push_front(sched);
            } else if sched >= measure_from && sched < end {
                load.lag_ns.push((now - sched).as_nanos() as u64);
            }
        }
        let inflight = cs.iter().flatten().filter(|c| c.inflight.is_some()).count();
        if now >= end && queue.is_empty() && inflight == 0 {
            break;
        }
        if now >= give_up || (cs.iter().all(Option::is_none) && now >= end) {
            // What is left of the window counts as unanswered until now.
            let left = queue
                .iter()
                .copied()
                .chain(cs.iter().flatten().filter_map(|c| c.inflight));
            for sched in left.filter(|s| *s >= measure_from && *s < end) {
                load.unfinished += 1;
                load.lat_ns.push((now - sched).as_nanos() as u64);
            }
            break;
        }
        if cs.iter().all(Option::is_none) {
            return Err("every connection broke".into());
        }
        let wake = match interval {
            Some(_) if next < end => next,
            _ if now < end => end,
            _ => give_up,
        };
        let n = epoll_wait_ns(epfd, &mut events, wake.saturating_duration_since(now))?;
        let now = Instant::now();
        for ev in &events[..n] {
            let i = ev.u64 as usize;
            let Some(c) = cs[i].as_mut() else { continue };
            let mut broken = false;
            let mut chunk = [0u8; 4096];
            loop {
                match c.stream.read(&mut chunk) {
                    Ok(0) => {
                        broken = true;
                        break;
                    }
                    Ok(k) => c.buf.extend_from_slice(&chunk[..k]),
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(_) => {
                        broken = true;
                        break;
                    }
                }
            }
            match parse_response(&c.buf) {
                Ok(Some((len, status))) => {
                    c.buf.drain(..len);
                    if status != 200 {
                        load.errors += 1;
                    }
                    if let Some(sched) = c.inflight.take() {
                        if sched >= measure_from && sched < end {
                            load.lat_ns.push((now - sched).as_nanos() as u64);
                        }
                        if now >= measure_from && now < end {
                            done_in_window += 1;
                        }
                    }
                    if !broken {
                        idle.push(i);
                    }
                }
                Ok(None) => {}
                Err(_) => broken = true,
            }
            if broken {
                load.errors += 1;
                if let Some(sched) = c.inflight.take() {
                    // Sent again on another connection, still from its schedule.
                    queue.push_front(sched);
                }
                idle.retain(|&x| x != i);
                cs[i] = None;
            }
        }
    }
    load.done_per_s = done_in_window as f64 / duration.as_secs_f64();
    Ok(load)
}

/// A run of the client in namespace `ns` with `threads` threads: open
/// loop at `rate` requests/s in all, or closed loop without.
fn run_client(
    ns: &Netns,
    targets: &[SocketAddr],
    o: &Opts,
    rate: Option<f64>,
    duration: f64,
) -> Res<Load> {
    let threads = o.threads.min(o.connections);
    let t0 = Instant::now() + Duration::from_millis(300);
    let handles: Vec<_> = (0..threads)
        .map(|k| {
            let targets = targets.to_vec();
            // Connections k, k + threads, ...: the thread's share, spread over the targets.
            let conns = (o.connections - k).div_ceil(threads);
            let first = k;
            let per_thread = rate.map(|r| r / threads as f64);
            // Thread k's schedule sits between the others': together one even stream.
            let phase = rate.map_or(Duration::ZERO, |r| Duration::from_secs_f64(k as f64 / r));
            let fifo = o.client_fifo;
            let (warmup, dur) = (
                Duration::from_secs_f64(o.warmup),
                Duration::from_secs_f64(duration),
            );
            xlb_bench::support::in_ns(&ns.name, move || {
                client_thread(
                    &targets, first, conns, per_thread, phase, t0, warmup, dur, fifo,
                )
            })
        })
        .collect();
    let mut all = Load::default();
    for h in handles {
        let l = h
            .join()
            .map_err(|_| "a client thread panicked".to_string())??;
        all.lat_ns.extend(l.lat_ns);
        all.unfinished += l.unfinished;
        all.errors += l.errors;
        all.done_per_s += l.done_per_s;
        all.lag_ns.extend(l.lag_ns);
    }
    all.lat_ns.sort_unstable();
    all.lag_ns.sort_unstable();
    check_interrupt()?;
    Ok(all)
}

/// Checks that a stopped agent left nothing in the LB namespace:
/// `Agent::stop` runs `lb-agent --cleanup` there, which also removes the
/// agent's nf_tables table `xlb` (notrack rules for its VIPs and SNAT
/// address).
fn check_agent_gone(t: &Topology) -> Res<()> {
    let rules = sh_in(&t.lb, "nft list ruleset")?;
    if !rules.trim().is_empty() {
        return Err(format!("rules left after the agent stopped:\n{rules}"));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The latency part.

/// A latency case: no balancer, or one of the end-to-end mechanisms.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Case {
    None,
    Mech(Mech),
}

const CASES: [Case; 3] = [
    Case::None,
    Case::Mech(Mech::Xlb),
    Case::Mech(Mech::Nftables),
];

impl Case {
    fn label(self) -> String {
        match self {
            Case::None => "no balancer (client straight to the backends)".into(),
            Case::Mech(m) => m.label("native"),
        }
    }
    fn short(self) -> &'static str {
        match self {
            Case::None => "none",
            Case::Mech(m) => m.short(),
        }
    }
}

/// One open-loop run's figures.
#[derive(Clone, Copy, Debug)]
struct Lat {
    rate: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    /// p99 of the client's own send lag.
    lag99: f64,
    errors: u64,
    unfinished: u64,
    n: usize,
}

fn backends() -> Vec<SocketAddr> {
    (1..=BACKENDS)
        .map(|n| SocketAddr::new(backend_ip(n).into(), BACKEND_PORT))
        .collect()
}

/// Every backend answers straight from the client (the no-balancer path).
fn check_direct(t: &Topology) -> Res<()> {
    let addrs = backends();
    run_in(&t.client, move || {
        for a in addrs {
            match http_get(a, "/", Duration::from_secs(2)) {
                Ok((200, _)) => {}
                Ok((s, _)) => return Err(format!("{a}: HTTP {s}")),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    })?
}

/// latency[load][case] = one `Lat` per round.
type LatRuns = Vec<Vec<Vec<Lat>>>;

fn latency_part(t: &Topology, bins: &Bins, o: &Opts, md: &mut String) -> Res<Vec<String>> {
    let ctx = Ctx {
        t,
        bins,
        xdp_mode: "native".into(),
    };
    // The client reaches the backends through the LB namespace, routed.
    t.client.run("ip route add 10.2.0.0/16 via 10.0.0.1");
    check_direct(t)?;
    let vip = vec![SocketAddr::new(VIP.into(), 80)];
    let direct = backends();
    println!(
        "\nmaximum rate: closed loop, {} connections over {} threads, straight to the {BACKENDS} backends, {} s",
        o.connections, o.threads, o.max_duration
    );
    let max = run_client(&t.client, &direct, o, None, o.max_duration)?;
    if max.errors > 0 || max.done_per_s <= 0.0 {
        return Err(format!(
            "the closed-loop run had {} errors and {:.0} answers/s",
            max.errors, max.done_per_s
        ));
    }
    let max_rate = max.done_per_s;
    println!(
        "  {max_rate:.0} requests/s (p50 {:.0} µs, p99 {:.0} µs in closed loop)",
        percentile_us(&max.lat_ns, 50.0),
        percentile_us(&max.lat_ns, 99.0)
    );
    let mut runs: LatRuns = vec![vec![Vec::new(); CASES.len()]; o.loads.len()];
    for round in 0..o.rounds {
        println!("round {}/{}", round + 1, o.rounds);
        for k in 0..CASES.len() {
            // Rotate: no case always runs first or after the same one.
            let ci = (k + round) % CASES.len();
            let case = CASES[ci];
            check_interrupt()?;
            let mut running: Option<(Mech, Running)> = None;
            let result = (|| -> Res<Vec<Lat>> {
                let targets = match case {
                    Case::None => {
                        check_direct(t)?;
                        &direct
                    }
                    Case::Mech(m) => {
                        running = Some((m, start(&ctx, m)?));
                        let seen = check_serves(t, 30)?;
                        if seen < BACKENDS {
                            return Err(format!(
                                "only {seen} of {BACKENDS} backends answered 30 requests"
                            ));
                        }
                        &vip
                    }
                };
                let mut out = Vec::new();
                for &pct in &o.loads {
                    let rate = max_rate * pct as f64 / 100.0;
                    let l = run_client(&t.client, targets, o, Some(rate), o.duration)?;
                    let lat = Lat {
                        rate: l.done_per_s,
                        p50: percentile_us(&l.lat_ns, 50.0),
                        p99: percentile_us(&l.lat_ns, 99.0),
                        p999: percentile_us(&l.lat_ns, 99.9),
                        lag99: percentile_us(&l.lag_ns, 99.0),
                        errors: l.errors,
                        unfinished: l.unfinished,
                        n: l.lat_ns.len(),
                    };
                    println!(
                        "  {:<46} {pct:>3} % ({rate:>6.0}/s): {:>6.0}/s answered, p50 {:>7.0} µs, p99 {:>7.0} µs, p99.9 {:>7.0} µs, send lag p99 {:>6.0} µs, {} requests, {} errors, {} unanswered",
                        case.label(),
                        lat.rate,
                        lat.p50,
                        lat.p99,
                        lat.p999,
                        lat.lag99,
                        lat.n,
                        lat.errors,
                        lat.unfinished
                    );
                    out.push(lat);
                }
                Ok(out)
            })();
            if let Some((m, mut r)) = running {
                stop(&ctx, m, &mut r).map_err(|e| format!("removing {}: {e}", m.id()))?;
                if m == Mech::Xlb {
                    check_agent_gone(t)?;
                }
            }
            let lats = result.map_err(|e| format!("{}: {e}", case.label()))?;
            for (li, l) in lats.into_iter().enumerate() {
                runs[li][ci].push(l);
            }
        }
    }
    t.client.run("ip route del 10.2.0.0/16 via 10.0.0.1");
    Ok(latency_report(o, max_rate, &runs, md))
}

fn spread(v: &[f64]) -> (f64, f64) {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lo, hi)
}

/// The latency table and the goal lines.
fn latency_report(o: &Opts, max_rate: f64, runs: &LatRuns, md: &mut String) -> Vec<String> {
    let _ = writeln!(
        md,
        "Latency at a constant rate (open loop, from each request's scheduled time): {} keep-alive \
         connections over {} client threads{}, {} s measured after {} s, {} interleaved rounds; \
         maximum rate {:.0} requests/s (closed loop, same client, no balancer, {} s). Medians over \
         the rounds; added p99 = the case's p99 minus no balancer's in the same round, median \
         [lowest, highest]:\n",
        o.connections,
        o.threads,
        if o.client_fifo { " (SCHED_FIFO)" } else { "" },
        o.duration,
        o.warmup,
        o.rounds,
        max_rate,
        o.max_duration
    );
    md.push_str("| load | case | answered/s | p50 µs | p99 µs | p99.9 µs | added p99 µs | client's send lag p99 µs | errors, unanswered |\n");
    md.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|\n");
    // added[load][case] = per-round added p99.
    let mut added: Vec<Vec<Vec<f64>>> = Vec::new();
    for (li, &pct) in o.loads.iter().enumerate() {
        let none = &runs[li][0];
        let mut per_case = Vec::new();
        for (ci, case) in CASES.iter().enumerate() {
            let r = &runs[li][ci];
            let med = |f: fn(&Lat) -> f64| median(&r.iter().map(f).collect::<Vec<_>>());
            let add: Vec<f64> = r.iter().zip(none).map(|(a, b)| a.p99 - b.p99).collect();
            let add_s = if ci == 0 {
                "-".to_string()
            } else {
                let (lo, hi) = spread(&add);
                format!("{:+.0} [{lo:+.0}, {hi:+.0}]", median(&add))
            };
            let errs: u64 = r.iter().map(|l| l.errors).sum();
            let unans: u64 = r.iter().map(|l| l.unfinished).sum();
            let _ = writeln!(
                md,
                "| {pct} % ({:.0}/s) | {} | {:.0} | {:.0} | {:.0} | {:.0} | {add_s} | {:.0} | {errs}, {unans} |",
                max_rate * pct as f64 / 100.0,
                case.short(),
                med(|l| l.rate),
                med(|l| l.p50),
                med(|l| l.p99),
                med(|l| l.p999),
                med(|l| l.lag99),
            );
            per_case.push(add);
        }
        added.push(per_case);
    }
    md.push_str(
        "\nIPVS (kube-proxy's ipvs mode) is not measured: this kernel has no ip_vs \
         (CONFIG_IP_VS is off: no /proc/net/ip_vs) and no modules can be loaded.\n\n",
    );
    let mut goals = Vec::new();
    if let Some(li) = o.loads.iter().position(|&p| p == 50) {
        let xi = CASES
            .iter()
            .position(|c| *c == Case::Mech(Mech::Xlb))
            .unwrap();
        let ni = CASES
            .iter()
            .position(|c| *c == Case::Mech(Mech::Nftables))
            .unwrap();
        let (x, n) = (median(&added[li][xi]), median(&added[li][ni]));
        let lowest = CASES
            .iter()
            .enumerate()
            .skip(1)
            .all(|(ci, _)| ci == xi || x < median(&added[li][ci]));
        goals.push(format!(
            "latency goal: xlb's added p99 at 50 % load is the lowest of the balancers \
             (xlb {x:+.0} µs, nftables {n:+.0} µs; IPVS not measured): {}",
            if lowest { "met" } else { "not met" }
        ));
        // Noise: how far a case's added p99 moved between rounds.
        let (xl, xh) = spread(&added[li][xi]);
        let (nl, nh) = spread(&added[li][ni]);
        let noise = (xh - xl).max(nh - nl);
        goals.push(format!(
            "latency goal: xlb ahead of nftables by more than the noise in added p99 at 50 % load \
             (ahead by {:.0} µs; noise, the larger spread over rounds, {noise:.0} µs): {}",
            n - x,
            if o.rounds < 2 {
                "not judged (one round shows no spread)"
            } else if n - x > noise {
                "met"
            } else {
                "not met"
            }
        ));
    } else {
        goals.push("latency goals: not judged (50 % is not among --loads)".into());
    }
    goals.push(format!("IPVS: not measured ({})", ipvs_not_measured()));
    goals
}

// ---------------------------------------------------------------------------
// The throughput part.

/// The second node and its Pod (`support::add_remote_node`); the client
/// routes the Pods through the LB.
fn add_remote_node(t: &Topology) -> (Netns, Netns) {
    let (n2, pod) = support::add_remote_node(t, PREFIX);
    t.client
        .run("ip route add 10.2.1.0/24 via 10.0.0.1 && ip route add 10.4.0.0/24 via 10.0.0.1");
    (n2, pod)
}

/// A throughput case: xlb in a mode, no balancer, or no balancer with a
/// plain XDP router (`xlb_route_only`) where xlb runs: what XDP on these
/// veths costs without any balancing.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Via {
    Nat,
    Snat,
    None,
    Route,
}

/// The interfaces xlb (and the plain XDP router) runs on.
const TP_IFACES: [&str; 3] = ["lbc", "lbb1", "lbn2"];
/// Where the throughput part pins the benchmark programs.
const TP_PROG_DIR: &str = "/sys/fs/bpf/xlb-latbench-progs";

/// The services: (VIP, mode, remote Pod?).
const TP_SERVICES: [(Ipv4Addr, Via, bool); 4] = [
    (Ipv4Addr::new(192, 0, 2, 20), Via::Nat, false),
    (Ipv4Addr::new(192, 0, 2, 21), Via::Nat, true),
    (Ipv4Addr::new(192, 0, 2, 22), Via::Snat, false),
    (Ipv4Addr::new(192, 0, 2, 23), Via::Snat, true),
];

fn pod_ip(remote: bool) -> Ipv4Addr {
    if remote {
        REMOTE_POD
    } else {
        backend_ip(1)
    }
}

fn tp_config() -> String {
    let mut s = format!(
        "interfaces: [{}]\nxdp_mode: native\nmetrics_addr: {TP_METRICS}\nsnat_ipv4: {SNAT_IP}\nservices:\n",
        TP_IFACES.join(", ")
    );
    for (i, (vip, via, remote)) in TP_SERVICES.iter().enumerate() {
        let _ = writeln!(
            s,
            "  - name: tp{i}\n    vip: {vip}\n    port: {IPERF_PORT}\n    mode: {}\n    backends:\n      - {{ ip: {}, port: {IPERF_PORT} }}",
            if *via == Via::Snat { "snat" } else { "nat" },
            pod_ip(*remote)
        );
    }
    s
}

/// `iperf3 -c ADDR -P STREAMS -t SECS` from the client: Gbit/s received.
/// Retried for up to 10 s while the server is not listening yet.
fn iperf(t: &Topology, addr: Ipv4Addr, streams: u32, secs: u32) -> Res<f64> {
    poll_until(Duration::from_secs(10), Duration::from_millis(200), || {
        check_interrupt()?;
        let out = Command::new("nsenter")
            .arg(format!("--net=/var/run/netns/{}", t.client.name))
            .args(["iperf3", "-J", "-c", &addr.to_string()])
            .args(["-p", &IPERF_PORT.to_string()])
            .args(["-P", &streams.to_string(), "-t", &secs.to_string()])
            .output()
            .map_err(|e| format!("running iperf3: {e}"))?;
        let v = iperf3_json(&out).map_err(|e| format!("-c {addr}: {e}"))?;
        v["end"]["sum_received"]["bits_per_second"]
            .as_f64()
            .map(|b| b / 1e9)
            .ok_or_else(|| format!("iperf3's output has no result: {}", v["end"]))
    })
}

/// Gbit/s per (via, remote, streams) and round.
type TpRuns = Vec<((Via, bool, u32), Vec<f64>)>;

fn throughput_part(t: &mut Topology, bins: &Bins, o: &Opts, md: &mut String) -> Res<Vec<String>> {
    // Kept to the end: dropping them deletes the second node.
    let (_n2, remote_pod) = add_remote_node(t);
    let servers = [(&t.backends[0], backend_ip(1)), (&remote_pod, REMOTE_POD)]
        .map(|(ns, ip)| t.spawn_in(ns, "iperf3", &["-s", "-B", &ip.to_string()]));
    for child in servers {
        t.adopt_child(child);
    }
    let cfg = t.dir.join("throughput.yaml");
    std::fs::write(&cfg, tp_config()).map_err(|e| format!("{}: {e}", cfg.display()))?;
    let pin_dir = Path::new("/sys/fs/bpf").join(format!("xlb-{PREFIX}-tp"));
    let prog_dir = Path::new(TP_PROG_DIR);
    // Kept to the end: the pins go with the directory.
    let _programs = pin_bench_programs(prog_dir)?;
    let streams = [1u32, 8];
    let mut runs: TpRuns = Vec::new();
    for via in [Via::Nat, Via::Snat, Via::None, Via::Route] {
        for remote in [false, true] {
            for s in streams {
                runs.push(((via, remote, s), Vec::new()));
            }
        }
    }
    println!(
        "\nthroughput: iperf3 -t {} with 1 and 8 streams, {} rounds",
        o.tp_duration, o.tp_rounds
    );
    // xlb's runs share one agent; each round rotates which phase is first.
    let phases = [Via::Nat, Via::None, Via::Route];
    for round in 0..o.tp_rounds {
        println!("round {}/{}", round + 1, o.tp_rounds);
        for i in 0..phases.len() {
            let phase = phases[(round + i) % phases.len()];
            check_interrupt()?;
            let mut agent = if phase == Via::Nat {
                let mut a = Agent::spawn(
                    bins,
                    &t.lb,
                    &cfg,
                    &pin_dir,
                    TP_METRICS.parse().unwrap(),
                    &t.dir.join("lb-agent-tp.log"),
                )?;
                a.wait_ready(Duration::from_secs(30))?;
                Some(a)
            } else {
                None
            };
            if phase == Via::Route {
                for i in TP_IFACES {
                    attach_pinned(&t.lb, i, prog_dir, "xlb_route_only")?;
                }
            }
            let result = (|| -> Res<()> {
                for ((via, remote, s), v) in runs.iter_mut() {
                    let in_phase = match phase {
                        Via::Nat => matches!(via, Via::Nat | Via::Snat),
                        _ => *via == phase,
                    };
                    if !in_phase {
                        continue;
                    }
                    let addr = match via {
                        Via::None | Via::Route => pod_ip(*remote),
                        _ => {
                            TP_SERVICES
                                .iter()
                                .find(|(_, m, r)| m == via && r == remote)
                                .expect("a service per case")
                                .0
                        }
                    };
                    let g = iperf(t, addr, *s, o.tp_duration)?;
                    println!(
                        "  {:<5} {:<6} {s} stream(s): {g:.2} Gbit/s",
                        format!("{via:?}").to_lowercase(),
                        if *remote { "remote" } else { "local" }
                    );
                    v.push(g);
                }
                Ok(())
            })();
            if phase == Via::Route {
                for i in TP_IFACES {
                    detach_xdp(&t.lb, i)?;
                }
            }
            if let Some(a) = agent.as_mut() {
                a.stop()?;
                if let Some(i) = TP_IFACES.into_iter().find(|i| xdp_attached(&t.lb, i)) {
                    return Err(format!("XDP still attached to {i} after the agent stopped"));
                }
                check_agent_gone(t)?;
            }
            result?;
        }
    }
    Ok(throughput_report(o, &runs, md))
}

fn throughput_report(o: &Opts, runs: &TpRuns, md: &mut String) -> Vec<String> {
    let _ = writeln!(
        md,
        "TCP throughput, `iperf3 -c ADDR -P 1|8 -t {}` from the client, {} rounds rotating xlb, \
         no balancer and a plain XDP router (`xlb_route_only` where xlb runs, no balancing); \
         medians in Gbit/s, and the median of the per-round ratios (the same Pod, the same \
         streams):\n",
        o.tp_duration, o.tp_rounds
    );
    md.push_str(
        "| endpoint | streams | no balancer | XDP router | xlb nat | xlb snat | router / none | nat / none | snat / none | nat / router | snat / router | runs (none; router; nat; snat) |\n",
    );
    md.push_str("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    let get = |via: Via, remote: bool, s: u32| -> &Vec<f64> {
        &runs
            .iter()
            .find(|(k, _)| *k == (via, remote, s))
            .expect("every case")
            .1
    };
    let list = |v: &[f64]| {
        v.iter()
            .map(|x| format!("{x:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let ratio =
        |a: &[f64], b: &[f64]| median(&a.iter().zip(b).map(|(a, b)| a / b).collect::<Vec<_>>());
    // The lowest ratio of xlb to no balancer, and to the XDP router.
    let mut worst = [
        (f64::INFINITY, String::new()),
        (f64::INFINITY, String::new()),
    ];
    for remote in [false, true] {
        for s in [1u32, 8] {
            let none = get(Via::None, remote, s);
            let route = get(Via::Route, remote, s);
            let nat = get(Via::Nat, remote, s);
            let snat = get(Via::Snat, remote, s);
            let ep = if remote {
                "Pod on another node"
            } else {
                "Pod on the balancer's node"
            };
            let (rn, rs) = (ratio(nat, none), ratio(snat, none));
            let (qn, qs) = (ratio(nat, route), ratio(snat, route));
            for (w, pairs) in worst
                .iter_mut()
                .zip([[(rn, "nat"), (rs, "snat")], [(qn, "nat"), (qs, "snat")]])
            {
                for (r, mode) in pairs {
                    if r < w.0 {
                        *w = (r, format!("{mode}, {ep}, {s} stream(s)"));
                    }
                }
            }
            let _ = writeln!(
                md,
                "| {ep} | {s} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2}x | {rn:.2}x | {rs:.2}x | {qn:.2}x | {qs:.2}x | {}; {}; {}; {} |",
                median(none),
                median(route),
                median(nat),
                median(snat),
                ratio(route, none),
                list(none),
                list(route),
                list(nat),
                list(snat)
            );
        }
    }
    md.push('\n');
    let [(w, wcase), (q, qcase)] = worst;
    vec![
        format!(
            "throughput goal: xlb >= 90 % of no balancer in every case (lowest: {:.0} %, {wcase}): {}",
            w * 100.0,
            if w >= 0.9 { "met" } else { "not met" }
        ),
        format!(
            "throughput against a plain XDP router on the same interfaces (XDP's own cost on veth \
             set apart; no goal): lowest {:.0} %, {qcase}",
            q * 100.0
        ),
    ]
}

// ---------------------------------------------------------------------------

fn run(o: &Opts) -> Res<()> {
    let bins = Bins::locate_with(o.lb_agent.as_deref())?;
    let started = Instant::now();
    println!(
        "xlb latency and throughput: client -> load balancer -> {BACKENDS} nginx backends in network \
         namespaces (Linux {}, {} CPUs)",
        cmd_line("uname -r"),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    if Path::new("/proc/net/ip_vs").exists() {
        println!("note: this kernel has IPVS, which this benchmark does not measure yet");
    }
    let mut t = Topology::new(PREFIX, BACKENDS);
    let mut md = String::new();
    let mut goals = Vec::new();
    if !o.no_latency {
        goals.extend(latency_part(&t, &bins, o, &mut md)?);
    }
    if !o.no_throughput {
        goals.extend(throughput_part(&mut t, &bins, o, &mut md)?);
    }
    println!("\n---- results (markdown) ----\n");
    print!("{md}");
    for g in goals {
        println!("{g}");
    }
    println!("total time {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn main() -> ExitCode {
    install_sigint_flag();
    let o = Opts::parse();
    let r = run(&o);
    if interrupted() {
        eprintln!("\ninterrupted: namespaces, agents and rules removed");
        return ExitCode::from(130);
    }
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("\nxlb-latency-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    #[test]
    fn documented_invocations_parse() {
        Opts::command().debug_assert();
        let o = Opts::try_parse_from(["xlb-latency-bench"]).unwrap();
        assert_eq!((o.rounds, o.connections, o.threads), (5, 32, 1));
        assert_eq!(o.loads, [30, 50, 70]);
        assert!(!o.no_latency && !o.no_throughput && !o.client_fifo);
        let o = Opts::try_parse_from([
            "xlb-latency-bench",
            "--rounds",
            "5",
            "--loads",
            "50",
            "--no-throughput",
        ])
        .unwrap();
        assert_eq!((o.rounds, o.loads.as_slice()), (5, &[50][..]));
        assert!(o.no_throughput);
        let o = Opts::try_parse_from(["xlb-latency-bench", "--lb-agent", "/a"]).unwrap();
        assert_eq!(o.lb_agent.unwrap(), std::path::Path::new("/a"));
        Opts::try_parse_from(["xlb-latency-bench", "--loads", "0"]).unwrap_err();
        Opts::try_parse_from(["xlb-latency-bench", "--rounds", "0"]).unwrap_err();
    }

    #[test]
    fn responses_parse_whole_or_not_yet() {
        let r = b"HTTP/1.1 200 OK\r\nServer: nginx\r\ncontent-length: 3\r\n\r\nb1\nHTTP/1.1";
        assert_eq!(parse_response(r).unwrap(), Some((r.len() - 8, 200)));
        assert_eq!(parse_response(&r[..r.len() - 10]).unwrap(), None);
        assert_eq!(parse_response(b"HTTP/1.1 200 OK\r\n").unwrap(), None);
        let r = b"HTTP/1.1 503 Busy\r\nContent-Length: 0\r\n\r\n";
        assert_eq!(parse_response(r).unwrap(), Some((r.len(), 503)));
        parse_response(b"HTTP/1.1 200 OK\r\n\r\n").unwrap_err();
        parse_response(b"garbage\r\n\r\n").unwrap_err();
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=1000).map(|i| i * 1000).collect();
        assert_eq!(percentile_us(&v, 50.0), 500.0);
        assert_eq!(percentile_us(&v, 99.0), 990.0);
        assert_eq!(percentile_us(&v, 99.9), 999.0);
        assert_eq!(percentile_us(&v[..1], 99.9), 1.0);
        assert!(percentile_us(&[], 50.0).is_nan());
    }

    #[test]
    fn throughput_config_parses() {
        lb_agent::config::AgentConfig::parse(&tp_config()).unwrap();
    }
}
