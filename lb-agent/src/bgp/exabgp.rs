//! The ExaBGP 4.x driver: talks to ExaBGP through the named pipes of its
//! CLI API (the pipes `exabgpcli` uses).
//!
//! # How ExaBGP 4.2 exposes its API
//!
//! With `exabgp.api.cli=true` (the default), ExaBGP looks at start-up for a
//! pair of FIFOs `<name>.in` and `<name>.out` (`<name>` is
//! `exabgp.api.pipename`, by default `exabgp`) in the first of these
//! directories that holds both: `/run/exabgp/`, `/run/<uid>/`, `/run/`,
//! `/var/run/exabgp/`, `/var/run/<uid>/`, `/var/run/`, then the same six
//! under the `--root` folder (`<root>/run/exabgp/`, ...). It does **not**
//! create them: when none is found it logs `could not find the named pipes
//! ... required for the cli` and runs without an API. When found, it starts
//! an internal helper process (`api-internal-cli-...`, a second
//! `/usr/sbin/exabgp` with `exabgp_cli_pipe` set) that reads command lines
//! from `<name>.in` and writes every answer line to `<name>.out`.
//!
//! With `exabgp.api.ack=true` (the default) every command is answered by a
//! last line `done` or `error` (ExaBGP logs the reason of an `error`), after
//! the command's own output lines; while exiting ExaBGP writes
//! `shutdown <pid> <ppid>`. The driver relies on the acknowledgements: it
//! sends one command, reads up to its `done`/`error`, then sends the next.
//!
//! Commands used:
//!
//! ```text
//! announce route 192.0.2.10/32 next-hop 10.0.0.1 local-preference 200 community [65000:100 65000:200]
//! withdraw route 192.0.2.10/32 next-hop 10.0.0.1
//! show adj-rib out extensive
//! ```
//!
//! `show adj-rib out extensive` prints one line per route and neighbor:
//!
//! ```text
//! neighbor 10.0.0.254 local-ip 10.0.0.1 local-as 65001 peer-as 65000 router-id 10.0.0.1 family-allowed in-open ipv4 unicast 192.0.2.10/32 next-hop 10.0.0.1 local-preference 200 community [ 65000:100 65000:200 ]
//! ```
//!
//! Routes announced through the API go to *every* neighbor of the ExaBGP
//! instance that has the route's family configured, are kept in ExaBGP's
//! adj-rib-out (also while a session is down, and sent again when it comes
//! back), and are lost when ExaBGP restarts: the next [`Announcer::apply`]
//! then finds an empty adj-rib-out and announces everything again.
//!
//! # What the agent expects from the operator
//!
//! The environment (in `/etc/exabgp/exabgp.env`, section `[exabgp.api]`, or
//! as environment variables `exabgp.api.cli=true` or `exabgp_api_cli=true`):
//!
//! ```ini
//! [exabgp.api]
//! # the API helper on the named pipes (default)
//! cli = true
//! # every command answered by done/error (default; required by the driver)
//! ack = true
//! # the pipes' name: must match ExaBgpAnnouncer::pipe_name
//! pipename = 'exabgp'
//! ```
//!
//! (ExaBGP reads the first that exists of `--env FILE`,
//! `<root>/etc/exabgp/exabgp.env` with `--root`, and
//! `/etc/exabgp/exabgp.env`; environment variables override it. Comments
//! must be on lines of their own.)
//!
//! The pipes, created before ExaBGP starts (ExaBGP only opens them), owned by
//! the user ExaBGP runs as (`exabgp.daemon.user`; ExaBGP drops privileges to
//! it when started as root) and writable by the agent:
//!
//! ```sh
//! mkdir -p /run/exabgp
//! mkfifo /run/exabgp/exabgp.in /run/exabgp/exabgp.out
//! chown exabgp:exabgp /run/exabgp /run/exabgp/exabgp.in /run/exabgp/exabgp.out
//! chmod 0660 /run/exabgp/exabgp.in /run/exabgp/exabgp.out   # agent in group exabgp, or root
//! ```
//!
//! Debian's `exabgp.service` already does this (`RuntimeDirectory=exabgp`
//! and `ExecStartPre=mkfifo /run/exabgp/exabgp.{in,out}`, as `User=exabgp`);
//! an agent running as root can use those pipes as they are. The pipe
//! directory is recreated at each start of that unit: the driver opens the
//! pipes anew for every call, so it follows.
//!
//! `exabgp.conf` declares the sessions and nothing the agent manages:
//!
//! ```text
//! neighbor 10.0.0.254 {
//!     router-id 10.0.0.1;
//!     local-address 10.0.0.1;
//!     local-as 65001;
//!     peer-as 65000;
//!     family {
//!         ipv4 unicast;
//!         ipv6 unicast;   # needed for IPv6 VIPs (else they are refused)
//!     }
//! }
//! ```
//!
//! No `process` section is needed for the agent (the CLI helper is added by
//! ExaBGP itself), `adj-rib-out` must stay enabled (the default: the driver
//! lists what is announced from it), and no static `/32` or `/128` routes
//! should be configured: the driver owns every host route of the
//! adj-rib-out and withdraws those it did not ask for. Shorter prefixes are
//! ignored (neither listed nor withdrawn).
//!
//! # Caveats
//!
//! * The pipes carry no request identifiers, and ExaBGP's helper keeps an
//!   answer line it could not deliver (nobody reading `<name>.out`) and
//!   delivers it to the next reader. The driver must be the pipes' only
//!   user: an `exabgpcli` run at the same time may read the driver's
//!   answers (and the driver its). After a command timed out, its late
//!   answer could be taken for the next one's, so the next call first
//!   drains the answer pipe until it has been quiet for 1.5 s; an answer
//!   that cannot be the command's (output lines for an `announce`, anything
//!   but routes for a `show`) is [`AnnounceError::Unreachable`] and makes
//!   the next call drain too.
//! * `local-preference` is stored and listed, but ExaBGP only sends it on
//!   iBGP sessions (eBGP peers ignore LOCAL_PREF).
//! * A route's next hop must have the VIP's family (IPv4 VIP, IPv4 next hop):
//!   ExaBGP accepts a mixed route without complaint, but the peer drops it.
//!   [`Announcer::apply`] refuses such a set, and a set with two routes for
//!   one VIP, before sending anything.
//! * A neighbor added by a configuration reload (SIGUSR1) starts with an
//!   empty adj-rib-out while the others still list the routes, so the
//!   driver sees nothing missing: restart ExaBGP instead of reloading it.
//! * Communities are compared as sets: ExaBGP prints them sorted, and the
//!   driver sends them sorted and without duplicates.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    net::IpAddr,
    path::{Path, PathBuf},
    sync::Mutex,
    time::Duration,
};

use ipnet::IpNet;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::unix::pipe,
    time::Instant,
};

use super::{AnnounceError, AnnounceResult, Announcer, BoxFuture, Route, Session as BgpSession};

/// How long the answer pipe must stay quiet before a call that follows an
/// unanswered command trusts it. ExaBGP's CLI helper retries an answer line
/// it could not deliver about once a second.
const STALE_QUIET: Duration = Duration::from_millis(1500);

/// Drives ExaBGP 4.x through its CLI named pipes
/// (`<pipe_dir>/<pipe_name>.in` and `<pipe_dir>/<pipe_name>.out`).
#[derive(Clone, Debug)]
pub struct ExaBgpAnnouncer {
    /// The directory holding the pipes, e.g. `/run/exabgp`.
    pub pipe_dir: PathBuf,
    /// `exabgp.api.pipename`: the pipes are `<pipe_name>.in` and `.out`.
    pub pipe_name: String,
    /// How long to wait for each answer line (and for the pipe to accept a
    /// command) before calling ExaBGP unreachable.
    pub timeout: Duration,
}

impl ExaBgpAnnouncer {
    /// Where Debian's `exabgp.service` has the pipes.
    pub const DEFAULT_PIPE_DIR: &'static str = "/run/exabgp";
    /// ExaBGP's default `exabgp.api.pipename`.
    pub const DEFAULT_PIPE_NAME: &'static str = "exabgp";
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

    /// A driver for the pipes `exabgp.in`/`exabgp.out` in `pipe_dir`.
    pub fn new(pipe_dir: impl Into<PathBuf>) -> Self {
        ExaBgpAnnouncer {
            pipe_dir: pipe_dir.into(),
            pipe_name: Self::DEFAULT_PIPE_NAME.to_string(),
            timeout: Self::DEFAULT_TIMEOUT,
        }
    }

    pub fn with_pipe_name(mut self, name: impl Into<String>) -> Self {
        self.pipe_name = name.into();
        self
    }

    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The pipe the driver writes commands to (`<name>.in`).
    pub fn command_pipe(&self) -> PathBuf {
        self.pipe_dir.join(format!("{}.in", self.pipe_name))
    }

    /// The pipe the driver reads answers from (`<name>.out`).
    pub fn answer_pipe(&self) -> PathBuf {
        self.pipe_dir.join(format!("{}.out", self.pipe_name))
    }

    /// Sends one raw API command and returns its output lines (without the
    /// final `done`). `error` is [`AnnounceError::Refused`].
    pub async fn command(&mut self, command: &str) -> AnnounceResult<Vec<String>> {
        let mut session = self.session().await?;
        session.command(command).await
    }

    async fn session(&self) -> AnnounceResult<Session> {
        Session::open(self).await
    }

    async fn list(&mut self) -> AnnounceResult<BTreeSet<Route>> {
        let mut session = self.session().await?;
        session.list().await
    }

    async fn apply_set(&mut self, desired: &BTreeSet<Route>) -> AnnounceResult<(usize, usize)> {
        let desired = check_desired(desired)?;
        let mut session = self.session().await?;
        let current = session.list().await?;

        let want: BTreeSet<Route> = desired.values().cloned().collect();
        let to_add: Vec<&Route> = want.difference(&current).collect();
        let extra: Vec<&Route> = current.difference(&want).collect();
        // A route whose prefix stays desired is replaced by its new
        // announce: withdrawing it first would only make it flap.
        let withdrawn: BTreeMap<IpNet, &Route> = extra
            .iter()
            .filter(|r| !desired.contains_key(&r.prefix))
            .map(|r| (r.prefix, *r))
            .collect();

        if to_add.is_empty() && extra.is_empty() {
            return Ok((0, 0));
        }

        let mut refused: Vec<String> = Vec::new();
        for route in &to_add {
            let cmd = announce_command(route);
            match session.ack(&cmd).await {
                Ok(()) => tracing::debug!(route = %route, "exabgp: announced"),
                Err(AnnounceError::Refused(e)) => refused.push(e),
                Err(e) => return Err(e),
            }
        }
        for route in withdrawn.values() {
            let cmd = withdraw_command(route);
            match session.ack(&cmd).await {
                Ok(()) => tracing::debug!(route = %route, "exabgp: withdrew"),
                Err(AnnounceError::Refused(e)) => refused.push(e),
                Err(e) => return Err(e),
            }
        }
        if let Some(first) = refused.first() {
            let more = match refused.len() {
                1 => String::new(),
                n => format!(" (and {} more commands)", n - 1),
            };
            return Err(AnnounceError::Refused(format!("{first}{more}")));
        }

        // ExaBGP acknowledges a route of a family no neighbor carries (it
        // only logs it): check that the adj-rib-out now is what we asked.
        let now = session.list().await?;
        if now != want {
            let missing: Vec<String> = want.difference(&now).map(|r| r.to_string()).collect();
            let left: Vec<String> = now.difference(&want).map(|r| r.to_string()).collect();
            return Err(AnnounceError::Refused(format!(
                "exabgp acknowledged every command but its adj-rib-out differs: \
                 missing [{}] (is the family configured on a neighbor?), unexpected [{}]",
                missing.join(", "),
                left.join(", ")
            )));
        }
        Ok((to_add.len(), extra.len()))
    }
}

impl Announcer for ExaBgpAnnouncer {
    fn name(&self) -> &'static str {
        "exabgp"
    }

    fn announced(&mut self) -> BoxFuture<'_, AnnounceResult<BTreeSet<Route>>> {
        Box::pin(self.list())
    }

    /// Every neighbor of ExaBGP's config, up while its state is
    /// `ESTABLISHED` (`show neighbor extensive`; `show neighbor summary`
    /// lists only the established ones).
    fn peers(&mut self) -> BoxFuture<'_, AnnounceResult<Vec<BgpSession>>> {
        Box::pin(async move {
            let mut session = self.session().await?;
            session.peers().await
        })
    }

    fn apply<'a>(
        &'a mut self,
        desired: &'a BTreeSet<Route>,
    ) -> BoxFuture<'a, AnnounceResult<(usize, usize)>> {
        Box::pin(self.apply_set(desired))
    }
}

/// Parses `show neighbor extensive` (ExaBGP 4.2):
///
/// ```text
/// Neighbor 10.210.0.1
///
///   Session                         Local
///    local                     10.210.0.2
///    state                    ESTABLISHED
///    up for                       0:00:10
///
///   Setup                           Local          Remote
/// ...
/// ```
///
/// One block per neighbor; the session is up when `state` is
/// `ESTABLISHED` (the others: IDLE, ACTIVE, CONNECT, OPENSENT,
/// OPENCONFIRM), for `up for` (`H:MM:SS`, after `N day(s),` past a day;
/// in the first second ExaBGP says `down for 0:00:00` of it).
/// `None` if a line cannot belong to this answer.
fn parse_neighbors<S: AsRef<str>>(lines: &[S]) -> Option<Vec<BgpSession>> {
    let mut sessions: BTreeMap<IpAddr, BgpSession> = BTreeMap::new();
    let mut cur: Option<IpAddr> = None;
    for line in lines {
        let line = line.as_ref();
        if let Some(addr) = line.strip_prefix("Neighbor ") {
            let addr: IpAddr = addr.trim().parse().ok()?;
            sessions
                .entry(addr)
                .or_insert_with(|| BgpSession::new(addr, false));
            cur = Some(addr);
        } else if line.trim().is_empty() {
            continue;
        } else if line.starts_with(' ') {
            let Some(s) = cur.and_then(|a| sessions.get_mut(&a)) else {
                continue;
            };
            let text = line.trim();
            if let Some(state) = text.strip_prefix("state ") {
                s.established = state.trim() == "ESTABLISHED";
            } else if let Some(up) = text
                .strip_prefix("up for ")
                // ExaBGP 4.2 says `down for 0:00:00` of a session
                // established less than a second ago.
                .or_else(|| text.strip_prefix("down for "))
            {
                s.uptime = parse_up_for(up.trim());
            }
        } else {
            return None;
        }
    }
    Some(
        sessions
            .into_values()
            .map(|mut s| {
                if !s.established {
                    s.uptime = None;
                }
                s
            })
            .collect(),
    )
}

/// `0:00:10`, `1 day, 2:03:04`, `3 days, 0:00:01` (Python's timedelta).
fn parse_up_for(text: &str) -> Option<Duration> {
    let (days, hms) = match text.split_once(',') {
        Some((d, hms)) => {
            let n = d.split_whitespace().next()?.parse::<u64>().ok()?;
            (n, hms.trim())
        }
        None => (0, text),
    };
    let (h, m, s) = super::parse_hms(hms)?;
    Some(Duration::from_secs(((days * 24 + h) * 60 + m) * 60 + s))
}

/// Routes per neighbor address in `show adj-rib out extensive`.
fn count_adj_rib_out<S: AsRef<str>>(lines: &[S]) -> BTreeMap<IpAddr, u64> {
    let mut counts = BTreeMap::new();
    for line in lines {
        if let Some((neighbor, _)) = parse_route_line(line.as_ref()) {
            if let Some(addr) = neighbor
                .split_whitespace()
                .nth(1)
                .and_then(|a| a.parse().ok())
            {
                *counts.entry(addr).or_insert(0) += 1;
            }
        }
    }
    counts
}

/// Validates the desired set and normalises it (communities sorted and
/// deduplicated, as ExaBGP lists them), by VIP.
fn check_desired(desired: &BTreeSet<Route>) -> AnnounceResult<BTreeMap<IpNet, Route>> {
    super::check_routes(desired)
}

/// `announce route 192.0.2.10/32 next-hop 10.0.0.1 local-preference 200 community [65000:100]`
fn announce_command(route: &Route) -> String {
    let mut cmd = format!(
        "announce route {} next-hop {}",
        route.prefix, route.next_hop
    );
    if let Some(lp) = route.local_pref {
        cmd.push_str(&format!(" local-preference {lp}"));
    }
    if !route.communities.is_empty() {
        let list: Vec<String> = route
            .communities
            .iter()
            .map(|(a, v)| format!("{a}:{v}"))
            .collect();
        cmd.push_str(&format!(" community [{}]", list.join(" ")));
    }
    if !route.large_communities.is_empty() {
        let list: Vec<String> = route
            .large_communities
            .iter()
            .map(|(g, l1, l2)| format!("{g}:{l1}:{l2}"))
            .collect();
        cmd.push_str(&format!(" large-community [{}]", list.join(" ")));
    }
    cmd
}

/// `withdraw route 192.0.2.10/32 next-hop 10.0.0.1`
fn withdraw_command(route: &Route) -> String {
    format!(
        "withdraw route {} next-hop {}",
        route.prefix, route.next_hop
    )
}

/// Parses the output of `show adj-rib out extensive`: the routes of the
/// IPv4 and IPv6 unicast families, over all neighbors (every one is the
/// agent's: `exabgp.conf` declares no routes). Other lines (other
/// families) are skipped.
pub fn parse_adj_rib_out<S: AsRef<str>>(lines: &[S]) -> BTreeSet<Route> {
    let mut routes = BTreeSet::new();
    for line in lines {
        let line = line.as_ref();
        match parse_route_line(line) {
            Some((_, route)) => {
                routes.insert(route);
            }
            None => tracing::trace!(line, "exabgp: skipping adj-rib-out line"),
        }
    }
    routes
}

/// One line of `show adj-rib out extensive`: the neighbor's description
/// (everything before the family) and the route, if it is a unicast host
/// route with a next hop.
fn parse_route_line(line: &str) -> Option<(String, Route)> {
    let tokens: Vec<&str> = line.split_whitespace().collect();
    if tokens.first() != Some(&"neighbor") {
        return None;
    }
    // The neighbor description ends with `family-allowed <value>`; the
    // family (`ipv4 unicast`) follows.
    let start = tokens.iter().position(|t| *t == "family-allowed")? + 2;
    let family = (start..tokens.len().saturating_sub(2))
        .find(|&i| matches!(tokens[i], "ipv4" | "ipv6") && tokens[i + 1] == "unicast")?;
    let neighbor = tokens[..family].join(" ");

    let prefix: IpNet = tokens[family + 2].parse::<IpNet>().ok()?.trunc();

    let mut next_hop = None;
    let mut local_pref = None;
    let mut communities = Vec::new();
    let mut large_communities = Vec::new();
    let mut i = family + 3;
    while i < tokens.len() {
        match tokens[i] {
            "next-hop" => {
                next_hop = tokens.get(i + 1)?.parse::<IpAddr>().ok();
                i += 2;
            }
            "local-preference" => {
                local_pref = Some(tokens.get(i + 1)?.parse::<u32>().ok()?);
                i += 2;
            }
            "community" => {
                let first = *tokens.get(i + 1)?;
                if first == "[" {
                    i += 2;
                    while i < tokens.len() && tokens[i] != "]" {
                        communities.push(parse_community(tokens[i])?);
                        i += 1;
                    }
                    i += 1;
                } else {
                    communities.push(parse_community(first)?);
                    i += 2;
                }
            }
            "large-community" => {
                let first = *tokens.get(i + 1)?;
                if first == "[" {
                    i += 2;
                    while i < tokens.len() && tokens[i] != "]" {
                        large_communities.push(crate::config::parse_large_community(tokens[i])?);
                        i += 1;
                    }
                    i += 1;
                } else {
                    large_communities.push(crate::config::parse_large_community(first)?);
                    i += 2;
                }
            }
            // Groups of other attributes: `aggregator ( ... )`,
            // `attribute [ ... ]`.
            "[" | "(" => {
                let close = if tokens[i] == "[" { "]" } else { ")" };
                while i < tokens.len() && tokens[i] != close {
                    i += 1;
                }
                i += 1;
            }
            _ => i += 1,
        }
    }
    let route = Route::normalized(&Route {
        prefix,
        next_hop: next_hop?,
        communities,
        large_communities,
        local_pref,
    });
    Some((neighbor, route))
}

/// `65000:100`, or the names ExaBGP prints for the well-known communities.
fn parse_community(token: &str) -> Option<(u16, u16)> {
    match token {
        "no-export" => Some((0xffff, 0xff01)),
        "no-advertise" => Some((0xffff, 0xff02)),
        "no-export-subconfed" => Some((0xffff, 0xff03)),
        "no-peer" => Some((0xffff, 0xff04)),
        "blackhole" => Some((0xffff, 0x029a)),
        _ => {
            let (a, v) = token.split_once(':')?;
            Some((a.parse().ok()?, v.parse().ok()?))
        }
    }
}

/// The answer pipes that may still receive answers to commands sent
/// earlier (a command timed out, or answers went out of step), for every
/// driver of this process: the next session on one drains it first.
static STALE: Mutex<BTreeSet<PathBuf>> = Mutex::new(BTreeSet::new());

fn is_stale(answers: &Path) -> bool {
    STALE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(answers)
}

fn set_stale(answers: &Path, stale: bool) {
    let mut set = STALE.lock().unwrap_or_else(|e| e.into_inner());
    if stale {
        set.insert(answers.to_path_buf());
    } else {
        set.remove(answers);
    }
}

/// Both pipes open for a series of commands.
struct Session {
    rx: pipe::Receiver,
    tx: pipe::Sender,
    buf: Vec<u8>,
    timeout: Duration,
    /// The answer pipe's path, the key of [`STALE`].
    answers: PathBuf,
}

impl Session {
    async fn open(ann: &ExaBgpAnnouncer) -> AnnounceResult<Session> {
        let (in_path, out_path) = (ann.command_pipe(), ann.answer_pipe());
        // The answer pipe first: ExaBGP's helper can only deliver an answer
        // while someone has it open for reading. Read-write, so that the
        // pipe never reads as closed between two of its writes.
        let mut rx = pipe::OpenOptions::new()
            .read_write(true)
            .open_receiver(&out_path)
            .map_err(|e| open_error(&out_path, e))?;
        // Answers to earlier commands left in the pipe.
        let mut scratch = [0u8; 4096];
        let mut drained = 0usize;
        loop {
            match rx.try_read(&mut scratch) {
                Ok(0) => break,
                Ok(n) => drained += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(io_error(&out_path, e)),
            }
        }
        if is_stale(&out_path) {
            // A command timed out last time: its answer may still come.
            let deadline = Instant::now() + ann.timeout + STALE_QUIET;
            loop {
                let quiet = STALE_QUIET.min(deadline.saturating_duration_since(Instant::now()));
                match tokio::time::timeout(quiet, rx.read(&mut scratch)).await {
                    Ok(Ok(n)) if n > 0 && Instant::now() < deadline => drained += n,
                    Ok(Err(e)) => return Err(io_error(&out_path, e)),
                    _ => break,
                }
            }
        }
        if drained > 0 {
            tracing::debug!(bytes = drained, "exabgp: dropped stale answers");
        }
        let tx = pipe::OpenOptions::new()
            .open_sender(&in_path)
            .map_err(|e| open_error(&in_path, e))?;
        set_stale(&out_path, false);
        Ok(Session {
            rx,
            tx,
            buf: Vec::new(),
            timeout: ann.timeout,
            answers: out_path,
        })
    }

    async fn list(&mut self) -> AnnounceResult<BTreeSet<Route>> {
        let command = "show adj-rib out extensive";
        let lines = self.command(command).await?;
        if let Some(odd) = lines.iter().find(|l| !l.starts_with("neighbor ")) {
            return Err(self.out_of_step(command, odd));
        }
        Ok(parse_adj_rib_out(&lines))
    }

    /// The sessions, with the routes the adj-rib-out holds for each
    /// established one as its prefixes sent.
    async fn peers(&mut self) -> AnnounceResult<Vec<BgpSession>> {
        let command = "show neighbor extensive";
        let lines = self.command(command).await?;
        let mut sessions = match parse_neighbors(&lines) {
            Some(sessions) => sessions,
            None => {
                let odd = lines
                    .iter()
                    .find(|l| parse_neighbors(&[l.as_str()]).is_none())
                    .cloned()
                    .unwrap_or_default();
                return Err(self.out_of_step(command, &odd));
            }
        };
        if sessions.iter().any(|s| s.established) {
            let command = "show adj-rib out extensive";
            let lines = self.command(command).await?;
            if let Some(odd) = lines.iter().find(|l| !l.starts_with("neighbor ")) {
                return Err(self.out_of_step(command, odd));
            }
            let counts = count_adj_rib_out(&lines);
            for s in sessions.iter_mut().filter(|s| s.established) {
                s.prefixes_sent = Some(counts.get(&s.peer).copied().unwrap_or(0));
            }
        }
        Ok(sessions)
    }

    /// Sends a command that answers nothing but its acknowledgement.
    async fn ack(&mut self, command: &str) -> AnnounceResult<()> {
        let lines = self.command(command).await?;
        match lines.first() {
            None => Ok(()),
            Some(odd) => Err(self.out_of_step(command, odd)),
        }
    }

    /// An answer that cannot be the command's: the answers of an earlier
    /// command that timed out are still coming. The next call drains them.
    fn out_of_step(&mut self, command: &str, line: &str) -> AnnounceError {
        set_stale(&self.answers, true);
        AnnounceError::Unreachable(format!(
            "exabgp's answers are out of step (`{line}` for `{command}`): \
             is another program using its pipes?"
        ))
    }

    /// Sends `command`, returns the lines before its `done`.
    async fn command(&mut self, command: &str) -> AnnounceResult<Vec<String>> {
        if command.contains('\n') {
            return Err(AnnounceError::Refused(format!(
                "not sending a command with a newline: {command:?}"
            )));
        }
        tracing::trace!(command, "exabgp: sending");
        set_stale(&self.answers, true);
        let line = format!("{command}\n");
        match tokio::time::timeout(self.timeout, self.tx.write_all(line.as_bytes())).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if e.kind() == io::ErrorKind::BrokenPipe => {
                set_stale(&self.answers, false);
                return Err(AnnounceError::Unreachable(
                    "exabgp closed its command pipe (not running?)".into(),
                ));
            }
            Ok(Err(e)) => {
                return Err(AnnounceError::Unreachable(format!(
                    "writing `{command}` to exabgp: {e}"
                )))
            }
            Err(_) => {
                return Err(AnnounceError::Unreachable(format!(
                    "exabgp did not take `{command}` within {:?}",
                    self.timeout
                )))
            }
        }

        let mut output = Vec::new();
        loop {
            let line = self.read_line(command).await?;
            match line.as_str() {
                "done" => {
                    set_stale(&self.answers, false);
                    return Ok(output);
                }
                "error" => {
                    set_stale(&self.answers, false);
                    return Err(AnnounceError::Refused(format!(
                        "exabgp answered error to `{command}` (see its log)"
                    )));
                }
                l if l == "shutdown" || l.starts_with("shutdown ") => {
                    return Err(AnnounceError::Unreachable(format!(
                        "exabgp is shutting down (while running `{command}`)"
                    )));
                }
                _ => output.push(line),
            }
        }
    }

    /// The next answer line: waits at most `timeout` for each piece.
    async fn read_line(&mut self, command: &str) -> AnnounceResult<String> {
        loop {
            if let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
                let raw: Vec<u8> = self.buf.drain(..=pos).collect();
                let text = String::from_utf8_lossy(&raw[..pos]);
                return Ok(text.trim_end_matches('\r').to_string());
            }
            let mut chunk = [0u8; 8192];
            match tokio::time::timeout(self.timeout, self.rx.read(&mut chunk)).await {
                Ok(Ok(0)) => {
                    return Err(AnnounceError::Unreachable(format!(
                        "exabgp's answer pipe closed while running `{command}`"
                    )))
                }
                Ok(Ok(n)) => self.buf.extend_from_slice(&chunk[..n]),
                Ok(Err(e)) => {
                    return Err(AnnounceError::Unreachable(format!(
                        "reading exabgp's answer to `{command}`: {e}"
                    )))
                }
                Err(_) => {
                    return Err(AnnounceError::Unreachable(format!(
                        "no answer from exabgp to `{command}` within {:?} \
                         (not running, or exabgp.api.ack=false?)",
                        self.timeout
                    )))
                }
            }
        }
    }
}

fn open_error(path: &Path, e: io::Error) -> AnnounceError {
    let why = match e.raw_os_error() {
        Some(libc::ENXIO) => "nobody reads it: exabgp is not running, or not with these pipes \
             (exabgp.api.cli, exabgp.api.pipename)"
            .to_string(),
        _ if e.kind() == io::ErrorKind::NotFound => {
            "missing: create the pipes with mkfifo before starting exabgp".to_string()
        }
        _ => e.to_string(),
    };
    AnnounceError::Unreachable(format!("exabgp pipe {}: {why}", path.display()))
}

fn io_error(path: &Path, e: io::Error) -> AnnounceError {
    AnnounceError::Unreachable(format!("exabgp pipe {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEIGHBOR: &str = "neighbor 10.200.0.1 local-ip 10.200.0.2 local-as 65001 peer-as 65000 \
                            router-id 10.200.0.2 family-allowed in-open";

    fn route(vip: &str, nh: &str, communities: &[(u16, u16)], lp: Option<u32>) -> Route {
        Route {
            prefix: IpNet::from(vip.parse::<IpAddr>().unwrap()),
            next_hop: nh.parse().unwrap(),
            communities: communities.to_vec(),
            large_communities: vec![],
            local_pref: lp,
        }
    }

    #[test]
    fn parses_exabgp_4_2_adj_rib_out() {
        // Captured from ExaBGP 4.2.21.
        let lines = [
            format!("{NEIGHBOR} ipv4 unicast 192.0.2.10/32 next-hop 10.200.0.2 local-preference 200 community 65000:100"),
            format!("{NEIGHBOR} ipv4 unicast 192.0.2.11/32 next-hop 10.200.0.2 local-preference 200 community [ 65000:100 65000:100 65000:200 no-export ]"),
            format!("{NEIGHBOR} ipv4 unicast 192.0.2.12/32 next-hop 10.200.0.2"),
            format!("{NEIGHBOR} ipv6 unicast 2001:db8::10/128 next-hop fd00:200::2"),
            format!("{NEIGHBOR} ipv4 unicast 198.51.100.0/24 next-hop 10.200.0.2"),
            format!("{NEIGHBOR} ipv4 flow destination-ipv4 192.0.2.1/32 extended-community [ rate-limit:0 ]"),
            "garbage".to_string(),
        ];
        let got = parse_adj_rib_out(&lines);
        let want: BTreeSet<Route> = [
            route("192.0.2.10", "10.200.0.2", &[(65000, 100)], Some(200)),
            route(
                "192.0.2.11",
                "10.200.0.2",
                &[(65000, 100), (65000, 200), (65535, 65281)],
                Some(200),
            ),
            route("192.0.2.12", "10.200.0.2", &[], None),
            route("2001:db8::10", "fd00:200::2", &[], None),
            Route {
                prefix: "198.51.100.0/24".parse().unwrap(),
                ..route("198.51.100.0", "10.200.0.2", &[], None)
            },
        ]
        .into_iter()
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn reads_neighbor_states() {
        // Captured from ExaBGP 4.2.21 (two neighbors, one up), shortened.
        let lines = [
            "Neighbor 10.210.0.1",
            "",
            "  Session                         Local",
            "   local                     10.210.0.2                                ",
            "   state                    ESTABLISHED                                ",
            "   up for                       0:00:10                                ",
            "",
            "  Setup                           Local          Remote",
            "   AS                             65001           65000                ",
            "   hold-time                          6               6                ",
            "",
            "Neighbor fd00::9",
            "",
            "  Session                         Local",
            "   local                        fd00::2                                ",
            "   state                         ACTIVE                                ",
            "   down for                     0:00:06                                ",
            "",
            "  Families                        Local          Remote        Add-Path",
            "   ipv4 unicast:                enabled             n/a        disabled",
            "",
        ];
        assert_eq!(
            parse_neighbors(&lines),
            Some(vec![
                BgpSession {
                    peer: "10.210.0.1".parse().unwrap(),
                    established: true,
                    uptime: Some(Duration::from_secs(10)),
                    prefixes_sent: None,
                },
                BgpSession::new("fd00::9".parse().unwrap(), false),
            ])
        );
        assert_eq!(
            parse_up_for("2 days, 1:00:05"),
            Some(Duration::from_secs(2 * 86_400 + 3605))
        );
        assert_eq!(parse_up_for("soon"), None);
        let first_second = parse_neighbors(&[
            "Neighbor 10.200.0.1",
            "   state                    ESTABLISHED",
            "   down for                     0:00:00",
        ])
        .unwrap();
        assert_eq!(first_second[0].uptime, Some(Duration::ZERO));
        let rib = [
            format!("{NEIGHBOR} ipv4 unicast 192.0.2.10/32 next-hop 10.200.0.2"),
            format!("{NEIGHBOR} ipv6 unicast 2001:db8::10/128 next-hop fd00:200::2"),
        ];
        let neighbor: IpAddr = NEIGHBOR.split_whitespace().nth(1).unwrap().parse().unwrap();
        assert_eq!(count_adj_rib_out(&rib), [(neighbor, 2)].into());
        assert_eq!(parse_neighbors::<&str>(&[]), Some(vec![]));
        // Answers of other commands are not taken for it.
        assert_eq!(
            parse_neighbors(&[format!(
                "{NEIGHBOR} ipv4 unicast 192.0.2.12/32 next-hop 10.200.0.2"
            )]),
            None
        );
        assert_eq!(
            parse_neighbors(&[
                "Peer            AS        up/down state       |     #sent     #recvd"
            ]),
            None
        );
    }

    #[test]
    fn reads_and_writes_large_communities() {
        let line = format!(
            "{NEIGHBOR} ipv4 unicast 192.0.2.10/32 next-hop 10.200.0.2 \
             large-community [ 65000:1:2 65000:0:1 ]"
        );
        let (_, got) = parse_route_line(&line).unwrap();
        assert_eq!(got.large_communities, [(65000, 0, 1), (65000, 1, 2)]);
        let one = format!(
            "{NEIGHBOR} ipv4 unicast 192.0.2.10/32 next-hop 10.200.0.2 large-community 65000:1:2"
        );
        assert_eq!(
            parse_route_line(&one).unwrap().1.large_communities,
            [(65000, 1, 2)]
        );
        assert_eq!(
            announce_command(&got),
            "announce route 192.0.2.10/32 next-hop 10.200.0.2 large-community [65000:0:1 65000:1:2]"
        );
    }

    #[test]
    fn skips_other_attributes_and_reads_large_communities() {
        let line = format!(
            "{NEIGHBOR} ipv4 unicast 192.0.2.10/32 next-hop 10.200.0.2 origin igp as-path [ 65001 65002 ] \
             med 10 local-preference 50 atomic-aggregate aggregator ( 65001:10.0.0.1 ) \
             community [ 65000:1 blackhole ] large-community [ 65000:1:1 ]"
        );
        let (neighbor, got) = parse_route_line(&line).unwrap();
        assert_eq!(neighbor, NEIGHBOR);
        assert_eq!(
            got,
            Route {
                large_communities: vec![(65000, 1, 1)],
                ..route(
                    "192.0.2.10",
                    "10.200.0.2",
                    &[(65000, 1), (65535, 666)],
                    Some(50)
                )
            }
        );
    }

    #[test]
    fn multisession_neighbors_parse_too() {
        let line = "neighbor fd00::1 local-ip fd00::2 local-as 65001 peer-as 65000 router-id 10.0.0.2 \
                    family-allowed ipv4-unicast/ipv6-unicast ipv6 unicast 2001:db8::1/128 next-hop fd00::2";
        let (_, got) = parse_route_line(line).unwrap();
        assert_eq!(got, route("2001:db8::1", "fd00::2", &[], None));
    }

    #[test]
    fn commands_are_exabgp_syntax() {
        let r = route(
            "192.0.2.10",
            "10.0.0.1",
            &[(65000, 200), (65000, 100)],
            Some(200),
        );
        assert_eq!(
            announce_command(&r.normalized()),
            "announce route 192.0.2.10/32 next-hop 10.0.0.1 local-preference 200 \
             community [65000:100 65000:200]"
        );
        assert_eq!(
            withdraw_command(&r),
            "withdraw route 192.0.2.10/32 next-hop 10.0.0.1"
        );
        let v6 = route("2001:db8::10", "fd00::1", &[], None);
        assert_eq!(
            announce_command(&v6),
            "announce route 2001:db8::10/128 next-hop fd00::1"
        );
    }

    #[test]
    fn desired_sets_are_checked() {
        let mixed: BTreeSet<Route> = [route("2001:db8::10", "10.0.0.1", &[], None)].into();
        assert!(matches!(
            check_desired(&mixed),
            Err(AnnounceError::Refused(_))
        ));
        let twice: BTreeSet<Route> = [
            route("192.0.2.10", "10.0.0.1", &[], None),
            route("192.0.2.10", "10.0.0.2", &[], None),
        ]
        .into();
        assert!(matches!(
            check_desired(&twice),
            Err(AnnounceError::Refused(_))
        ));
    }

    #[tokio::test]
    async fn missing_pipes_are_unreachable() {
        let dir = std::env::temp_dir().join(format!("xlb-exabgp-none-{}", std::process::id()));
        let mut ann = ExaBgpAnnouncer::new(&dir).with_timeout(Duration::from_millis(200));
        let err = ann.announced().await.unwrap_err();
        assert!(matches!(err, AnnounceError::Unreachable(_)), "{err}");
        assert!(err.to_string().contains("missing"), "{err}");
    }
}
