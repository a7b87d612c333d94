//! BIRD 2 driver: the agent writes the VIP routes into files that BIRD's
//! configuration includes, and asks BIRD to re-read its configuration with
//! `configure`. What BIRD announces is read back from BIRD itself (`show
//! route protocol ... all`), never from the files. The commands go over
//! BIRD's control socket, as `birdc` sends them, without `birdc` itself
//! (the Helm chart's agent container has none; BIRD runs in a sidecar).
//!
//! # The BIRD configuration the driver expects
//!
//! A BIRD static protocol has exactly one channel, so IPv4 and IPv6 VIPs
//! live in two files and two protocols. With the defaults
//! (`protocol = "xlb_vips"`) and `routes_file = "/etc/bird/xlb-vips"`:
//!
//! | family | file the agent writes  | static protocol |
//! |--------|------------------------|-----------------|
//! | IPv4   | `/etc/bird/xlb-vips4`  | `xlb_vips4`     |
//! | IPv6   | `/etc/bird/xlb-vips6`  | `xlb_vips6`     |
//!
//! ```text
//! # The VIPs of this node (managed by lb-agent; the two protocol blocks
//! # are what BirdAnnouncer::static_protocols_config() prints). BIRD's
//! # `include` must start its own line.
//! protocol static xlb_vips4 {
//!     ipv4;
//!     include "/etc/bird/xlb-vips4";
//! }
//! protocol static xlb_vips6 {
//!     ipv6;
//!     include "/etc/bird/xlb-vips6";
//! }
//!
//! # One BGP session per upstream router; MP-BGP carries both families.
//! protocol bgp upstream {
//!     local 10.0.0.1 as 65001;
//!     neighbor 10.0.0.254 as 65000;
//!     ipv4 { import none; export where proto = "xlb_vips4"; };
//!     ipv6 { import none; export where proto = "xlb_vips6"; };
//! }
//!
//! # If BIRD also programs this node's kernel, keep the VIP routes out of
//! # it: they are `blackhole` routes (see below).
//! protocol kernel {
//!     ipv4 { export where proto != "xlb_vips4"; };
//! }
//! ```
//!
//! Each file holds one static route per VIP, carrying everything the
//! agent's [`Route`] says as BGP attributes:
//!
//! ```text
//! route 192.0.2.10/32 blackhole { bgp_next_hop = 10.0.0.1; bgp_community.add((65000,100)); bgp_local_pref = 200; };
//! ```
//!
//! * Next hop: BIRD keeps a `bgp_next_hop` set on a static route when it
//!   exports the route to BGP, for eBGP and iBGP peers alike (checked with
//!   BIRD 2.0.12, including a third-party next hop), so
//!   [`Route::next_hop`] is what the router uses. Do not set
//!   `next hop self` (or a `bgp_next_hop` in the export filter) on the
//!   BGP channels: it would override the agent's next hop.
//! * Communities are sent to every peer; `bgp_local_pref` only to iBGP
//!   peers (BGP never carries LOCAL_PREF over eBGP).
//! * `blackhole` is only the route's local destination: BIRD needs one,
//!   and the route must never reach the node's kernel table (a local
//!   process talking to the VIP would be dropped), hence the kernel
//!   protocol's filter above. XDP handles VIP traffic before the kernel
//!   routes it.
//! * Both files must exist before BIRD starts (BIRD refuses a config that
//!   includes a missing file): [`BirdAnnouncer::ensure_files`] creates them
//!   empty.
//! * Use absolute paths: BIRD resolves a relative `include` against the
//!   directory of the including file, the agent against its own cwd.
//!
//! # How `apply` works
//!
//! 1. The desired set is checked (next hop of the VIP's family, not
//!    unspecified, one route per VIP), else [`AnnounceError::Refused`]
//!    without touching anything. Communities are sorted and deduplicated,
//!    as BIRD keeps them.
//! 2. The announced set is read from BIRD; BIRD down gives
//!    [`AnnounceError::Unreachable`].
//! 3. If BIRD already announces the desired set and the files already hold
//!    it, nothing is done: `(0, 0)`, no reconfiguration.
//! 4. Otherwise the changed files are replaced atomically (temporary file
//!    and rename), `birdc configure check` validates BIRD's whole config,
//!    and `birdc configure` makes it effective. If either fails, the
//!    previous files are put back and BIRD's message is returned as
//!    [`AnnounceError::Refused`] (or `Unreachable` if BIRD went away).
//!
//! `birdc configure` re-reads BIRD's whole configuration, so an operator's
//! pending edits elsewhere in it become effective (or, if broken, make
//! every apply fail with BIRD's parse error) at the agent's next change.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::{Path, PathBuf},
    time::Duration,
};

use ipnet::IpNet;
use lb_common::net::Family;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};

use super::{AnnounceError, AnnounceResult, Announcer, BoxFuture, PeerLimit, Route, Session};
use crate::config::BgpPeer;

/// The default base name of the two static protocols (`xlb_vips4`, `xlb_vips6`).
pub const DEFAULT_PROTOCOL: &str = "xlb_vips";
/// The default limit for one `birdc` command.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// Drives BIRD 2 through included route files and `birdc`.
///
/// The IPv4 routes go to `<routes_file>4`, announced by
/// `protocol static <protocol>4`, the IPv6 routes to `<routes_file>6`,
/// announced by `protocol static <protocol>6`. BIRD's configuration must
/// contain (see the [module documentation](self) for the BGP side):
///
/// ```text
/// protocol static xlb_vips4 {
///     ipv4;
///     include "/etc/bird/xlb-vips4";
/// }
/// protocol static xlb_vips6 {
///     ipv6;
///     include "/etc/bird/xlb-vips6";
/// }
/// ```
///
/// ```no_run
/// # use lb_agent::bgp::bird::BirdAnnouncer;
/// let bird = BirdAnnouncer::new("/etc/bird/xlb-vips", "/run/bird/bird.ctl");
/// bird.ensure_files()?;
/// print!("{}", bird.static_protocols_config());
/// # Ok::<(), std::io::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct BirdAnnouncer {
    routes_file: PathBuf,
    control_socket: PathBuf,
    protocol: String,
    timeout: Duration,
    sessions: Option<Sessions>,
}

/// The BGP sessions the agent writes for BIRD: one `protocol bgp` block per
/// peer (and a `protocol bfd` if any peer has BFD) in a file that BIRD's
/// configuration includes at its top level.
#[derive(Clone, Debug)]
struct Sessions {
    file: PathBuf,
    local_asn: u32,
    peers: Vec<BgpPeer>,
    /// What each session may export of the limited prefixes.
    limits: Vec<PeerLimit>,
}

/// What BIRD calls a family: the file suffix and protocol name suffix
/// (`4`/`6`) and the channel (`ipv4`/`ipv6`).
trait BirdFamily {
    fn suffix(self) -> &'static str;
    fn channel(self) -> &'static str;
    fn unspecified(self) -> IpAddr;
}

impl BirdFamily for Family {
    fn suffix(self) -> &'static str {
        match self {
            Family::V4 => "4",
            Family::V6 => "6",
        }
    }

    fn channel(self) -> &'static str {
        match self {
            Family::V4 => "ipv4",
            Family::V6 => "ipv6",
        }
    }

    fn unspecified(self) -> IpAddr {
        match self {
            Family::V4 => Ipv4Addr::UNSPECIFIED.into(),
            Family::V6 => Ipv6Addr::UNSPECIFIED.into(),
        }
    }
}

impl BirdAnnouncer {
    /// A driver writing `<routes_file>4` and `<routes_file>6`, talking to
    /// BIRD's control socket `control_socket` with `birdc` from `PATH`, for
    /// the static protocols `xlb_vips4` and `xlb_vips6`.
    pub fn new(routes_file: impl Into<PathBuf>, control_socket: impl Into<PathBuf>) -> Self {
        Self {
            routes_file: routes_file.into(),
            control_socket: control_socket.into(),
            protocol: DEFAULT_PROTOCOL.into(),
            timeout: DEFAULT_TIMEOUT,
            sessions: None,
        }
    }

    /// Also writes the BGP sessions to `peers` (this node in `local_asn`)
    /// into `file`, which BIRD's configuration must include (`include
    /// "FILE";` on a line of its own, outside any block). No peers: the
    /// file holds only its header.
    pub fn with_sessions(
        mut self,
        file: impl Into<PathBuf>,
        local_asn: u32,
        peers: Vec<BgpPeer>,
    ) -> Self {
        self.sessions = Some(Sessions {
            file: file.into(),
            local_asn,
            peers,
            limits: Vec::new(),
        });
        self
    }

    /// The contents of the sessions file, if the agent writes one.
    pub fn render_sessions(&self) -> Option<String> {
        self.sessions.as_ref().map(|s| render_sessions(self, s))
    }

    /// Uses the static protocols `<protocol>4` and `<protocol>6`.
    pub fn with_protocol(mut self, protocol: impl Into<String>) -> Self {
        self.protocol = protocol.into();
        self
    }

    /// Gives up on a `birdc` command after `timeout` (BIRD hung:
    /// [`AnnounceError::Unreachable`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// BIRD's control socket.
    pub fn control_socket(&self) -> &Path {
        &self.control_socket
    }

    /// The file holding the IPv4 routes: `<routes_file>4`.
    pub fn routes_file_v4(&self) -> PathBuf {
        self.file(Family::V4)
    }

    /// The file holding the IPv6 routes: `<routes_file>6`.
    pub fn routes_file_v6(&self) -> PathBuf {
        self.file(Family::V6)
    }

    /// The static protocol announcing the IPv4 routes: `<protocol>4`.
    pub fn protocol_v4(&self) -> String {
        self.proto(Family::V4)
    }

    /// The static protocol announcing the IPv6 routes: `<protocol>6`.
    pub fn protocol_v6(&self) -> String {
        self.proto(Family::V6)
    }

    fn file(&self, family: Family) -> PathBuf {
        let mut name = self.routes_file.clone().into_os_string();
        name.push(family.suffix());
        name.into()
    }

    fn proto(&self, family: Family) -> String {
        format!("{}{}", self.protocol, family.suffix())
    }

    /// The two `protocol static` blocks BIRD's configuration must contain.
    pub fn static_protocols_config(&self) -> String {
        let mut out = String::new();
        for family in Family::ALL {
            let _ = write!(
                out,
                "protocol static {} {{\n    {};\n    include \"{}\";\n}}\n",
                self.proto(family),
                family.channel(),
                self.file(family).display()
            );
        }
        out
    }

    /// Creates the route files that do not exist yet, empty (no routes),
    /// so that BIRD can start. Existing files are left alone.
    pub fn ensure_files(&self) -> io::Result<()> {
        for family in Family::ALL {
            let path = self.file(family);
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    use std::io::Write;
                    f.write_all(render(self, family, &BTreeSet::new()).as_bytes())?;
                    f.sync_all()?;
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
            }
        }
        if let Some(sessions) = &self.sessions {
            // Written whole: BIRD starting before the agent's first apply
            // already has its sessions.
            let content = render_sessions(self, sessions);
            if std::fs::read(&sessions.file).ok().as_deref() != Some(content.as_bytes()) {
                std::fs::write(&sessions.file, content).map_err(|e| {
                    io::Error::new(e.kind(), format!("{}: {e}", sessions.file.display()))
                })?;
            }
        }
        Ok(())
    }

    /// The contents of `<routes_file>4` and `<routes_file>6` for `routes`
    /// (which should be valid: see [`Announcer::apply`]).
    pub fn render(&self, routes: &BTreeSet<Route>) -> (String, String) {
        let routes: BTreeSet<Route> = routes.iter().map(Route::normalized).collect();
        (
            render(self, Family::V4, &routes),
            render(self, Family::V6, &routes),
        )
    }

    /// Sends the command `args` (as `birdc ARGS...` would) on BIRD's
    /// control socket and returns its reply. The socket speaks lines: a
    /// greeting, then per command reply lines `CODE-text` (more follow),
    /// ` text` (continuing the last code) and `CODE text` (the last). No
    /// `birdc` is needed, so the agent's container has none.
    async fn birdc(&self, args: &[&str]) -> AnnounceResult<Reply> {
        let what = format!("birdc {}", args.join(" "));
        let unreachable = |e: String| {
            AnnounceError::Unreachable(format!("{} ({what}): {e}", self.control_socket.display()))
        };
        let exchange = async {
            let stream = tokio::net::UnixStream::connect(&self.control_socket)
                .await
                .map_err(|e| unreachable(format!("connecting: {e}")))?;
            let (read, mut write) = stream.into_split();
            let mut lines = tokio::io::BufReader::new(read).lines();
            let mut text = String::new();
            // The greeting, then the reply to the command.
            for send in [None, Some(args.join(" "))] {
                if let Some(command) = send {
                    write
                        .write_all(format!("{command}\n").as_bytes())
                        .await
                        .map_err(|e| unreachable(format!("sending: {e}")))?;
                }
                loop {
                    let line = lines
                        .next_line()
                        .await
                        .map_err(|e| unreachable(format!("reading: {e}")))?
                        .ok_or_else(|| unreachable("BIRD closed the connection".into()))?;
                    if let Some(more) = line.strip_prefix(' ') {
                        // As `birdc -v` prints a continuation line.
                        text.push_str("     ");
                        text.push_str(more);
                        text.push('\n');
                        continue;
                    }
                    if line.starts_with('+') {
                        continue; // an asynchronous message
                    }
                    text.push_str(&line);
                    text.push('\n');
                    if line.len() >= 5 && line.as_bytes()[4] == b' ' {
                        break;
                    }
                }
            }
            Ok::<_, AnnounceError>(text)
        };
        let text = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| unreachable(format!("no answer within {:?}", self.timeout)))??;
        tracing::trace!(command = %what, reply = %text, "bird");
        let reply = Reply::parse(&text);
        if !reply.has(CODE_WELCOME) {
            return Err(unreachable(format!(
                "no greeting from BIRD: {}",
                text.trim()
            )));
        }
        let errors = reply.errors();
        if !errors.is_empty() {
            return Err(AnnounceError::Refused(format!(
                "`{what}`: {}",
                errors.join("; ")
            )));
        }
        Ok(reply)
    }

    async fn announced_now(&self) -> AnnounceResult<BTreeSet<Route>> {
        let mut all = BTreeSet::new();
        for family in Family::ALL {
            let proto = self.proto(family);
            let reply = self
                .birdc(&["show", "route", "protocol", &proto, "all"])
                .await
                .map_err(|e| match e {
                    AnnounceError::Refused(m) => AnnounceError::Refused(format!(
                        "{m} (does BIRD's config have `protocol static {proto}`?)"
                    )),
                    e => e,
                })?;
            all.extend(parse_routes(&reply, family));
        }
        Ok(all)
    }

    async fn apply_now(&self, desired: &BTreeSet<Route>) -> AnnounceResult<(usize, usize)> {
        let desired = validate(desired)?;
        let current = self.announced_now().await?;
        let added = desired.difference(&current).count();
        let withdrawn = current.difference(&desired).count();

        let mut changed = Vec::new();
        for family in Family::ALL {
            let path = self.file(family);
            let content = render(self, family, &desired);
            let old = read_if_exists(&path)
                .await
                .map_err(|e| AnnounceError::Refused(format!("reading {}: {e}", path.display())))?;
            if old.as_deref() != Some(content.as_bytes()) {
                changed.push(Changed { path, old, content });
            }
        }
        if let Some(sessions) = &self.sessions {
            let content = render_sessions(self, sessions);
            let path = sessions.file.clone();
            let old = read_if_exists(&path)
                .await
                .map_err(|e| AnnounceError::Refused(format!("reading {}: {e}", path.display())))?;
            if old.as_deref() != Some(content.as_bytes()) {
                tracing::info!(peers = sessions.peers.len(), file = %path.display(), "bird: writing the BGP sessions");
                changed.push(Changed { path, old, content });
            }
        }
        if changed.is_empty() && added == 0 && withdrawn == 0 {
            tracing::debug!(routes = desired.len(), "bird: already announced");
            return Ok((0, 0));
        }

        for (i, c) in changed.iter().enumerate() {
            if let Err(e) = write_atomic(&c.path, c.content.as_bytes()).await {
                let restore = restore(&changed[..i]).await;
                return Err(AnnounceError::Refused(format!(
                    "writing {}: {e}{restore}",
                    c.path.display()
                )));
            }
        }
        let result = async {
            self.birdc(&["configure", "check"]).await?;
            let reply = self.birdc(&["configure"]).await?;
            if reply.has(CODE_RECONFIGURED) {
                Ok(())
            } else if let Some(code) = CODES_IN_PROGRESS.iter().find(|c| reply.has(**c)) {
                tracing::info!(code, reply = %reply.text(), "bird: reconfiguration pending");
                Ok(())
            } else if reply.has(CODE_SHUTTING_DOWN) {
                Err(AnnounceError::Unreachable(format!(
                    "BIRD is shutting down: {}",
                    reply.text()
                )))
            } else {
                Err(AnnounceError::Refused(format!(
                    "unexpected reply to `birdc configure`: {}",
                    reply.text()
                )))
            }
        }
        .await;
        if let Err(e) = result {
            let restore = restore(&changed).await;
            return Err(match e {
                AnnounceError::Refused(m) => AnnounceError::Refused(format!("{m}{restore}")),
                AnnounceError::Unreachable(m) => {
                    AnnounceError::Unreachable(format!("{m}{restore}"))
                }
            });
        }
        tracing::info!(
            added,
            withdrawn,
            routes = desired.len(),
            "bird: reconfigured"
        );
        Ok((added, withdrawn))
    }
}

impl Announcer for BirdAnnouncer {
    fn name(&self) -> &'static str {
        "bird"
    }

    /// Every BGP protocol of BIRD's config with a neighbour address, up
    /// while its BGP state is `Established` (`birdc show protocols all`).
    fn peers(&mut self) -> BoxFuture<'_, AnnounceResult<Vec<Session>>> {
        Box::pin(async move {
            let reply = self.birdc(&["show", "protocols", "all"]).await?;
            Ok(parse_bgp_sessions(&reply, local_time_of_day()))
        })
    }

    fn announced(&mut self) -> BoxFuture<'_, AnnounceResult<BTreeSet<Route>>> {
        Box::pin(self.announced_now())
    }

    /// Written into the export filters of the sessions the agent writes.
    /// Sessions of BIRD's own config export what their filters say.
    fn set_peer_limits(&mut self, limits: &[PeerLimit]) -> Result<(), String> {
        match &mut self.sessions {
            Some(s) => {
                s.limits = limits.to_vec();
                Ok(())
            }
            None if limits.is_empty() => Ok(()),
            None => Err(
                "this BIRD driver writes no sessions (no peers file), so it cannot limit them"
                    .into(),
            ),
        }
    }

    fn set_peers(&mut self, peers: &[BgpPeer]) -> Result<(), String> {
        match &mut self.sessions {
            Some(s) if s.local_asn == 0 && !peers.is_empty() => {
                Err("bgp.asn (this node's AS number) is required to write BIRD's sessions".into())
            }
            Some(s) => {
                s.peers = peers.to_vec();
                Ok(())
            }
            None if peers.is_empty() => Ok(()),
            None => Err("this BIRD driver writes no sessions (no peers file)".into()),
        }
    }

    fn apply<'a>(
        &'a mut self,
        desired: &'a BTreeSet<Route>,
    ) -> BoxFuture<'a, AnnounceResult<(usize, usize)>> {
        Box::pin(self.apply_now(desired))
    }
}

/// BIRD's reply codes (doc/reply_codes in BIRD's sources).
const CODE_WELCOME: u16 = 1;
const CODE_RECONFIGURED: u16 = 3;
/// In progress (4), queued behind a running one (5), a queued one dropped
/// because this one equals the running config (17), confirmed (18).
const CODES_IN_PROGRESS: [u16; 4] = [4, 5, 17, 18];
const CODE_SHUTTING_DOWN: u16 = 6;

/// BIRD's reply to one command, as `birdc -v` prints it: `CODE-text` or
/// `CODE text` lines, and continuation lines (five spaces, then the text)
/// that belong to the previous code.
#[derive(Debug, Default)]
struct Reply {
    lines: Vec<(u16, String)>,
}

impl Reply {
    fn parse(out: &str) -> Self {
        let mut lines = Vec::new();
        let mut last = 0;
        for line in out.lines() {
            let b = line.as_bytes();
            if let Some(text) = line.strip_prefix("     ") {
                lines.push((last, text.to_string()));
            } else if b.len() >= 5
                && b[..4].iter().all(u8::is_ascii_digit)
                && matches!(b[4], b'-' | b' ')
            {
                last = line[..4].parse().unwrap_or(0);
                lines.push((last, line[5..].to_string()));
            } else if b.len() == 4 && b.iter().all(u8::is_ascii_digit) {
                last = line.parse().unwrap_or(0);
                lines.push((last, String::new()));
            } else if !line.is_empty() {
                tracing::debug!(line, "birdc: unexpected line");
            }
        }
        Self { lines }
    }

    fn has(&self, code: u16) -> bool {
        self.lines.iter().any(|(c, _)| *c == code)
    }

    /// The texts of the error replies (codes 8000-9999).
    fn errors(&self) -> Vec<&str> {
        self.lines
            .iter()
            .filter(|(c, _)| *c >= 8000)
            .map(|(_, t)| t.trim())
            .collect()
    }

    fn text(&self) -> String {
        self.lines
            .iter()
            .filter(|(c, _)| *c != CODE_WELCOME)
            .map(|(_, t)| t.trim())
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// One route of `show route ... all` being read.
struct Parsed {
    prefix: IpNet,
    bgp_next_hop: Option<IpAddr>,
    gateway: Option<IpAddr>,
    communities: Vec<(u16, u16)>,
    large_communities: Vec<(u32, u32, u32)>,
    local_pref: Option<u32>,
}

impl Parsed {
    fn into_route(self, family: Family) -> Option<Route> {
        if Family::of(self.prefix.addr()) != family {
            tracing::warn!(
                prefix = %self.prefix,
                "bird: ignoring a route of the other address family"
            );
            return None;
        }
        Some(
            Route {
                prefix: self.prefix.trunc(),
                next_hop: self
                    .bgp_next_hop
                    .or(self.gateway)
                    .unwrap_or_else(|| family.unspecified()),
                communities: self.communities,
                large_communities: self.large_communities,
                local_pref: self.local_pref,
            }
            .normalized(),
        )
    }
}

/// Reads the routes of `birdc -v show route protocol P all`:
///
/// ```text
/// 1007-Table master4:
///      192.0.2.10/32        blackhole [xlb_vips4 22:30:32.432] * (200)
/// 1008-<TAB>Type: static univ
/// 1012-<TAB>BGP.next_hop: 10.99.0.1
///      <TAB>BGP.local_pref: 200
///      <TAB>BGP.community: (65000,100) (65000,7)
/// 1007-                     blackhole [xlb_vips4 22:30:53.429] (200)
/// ```
///
/// (`<TAB>` is a tab.) A route line starting with blanks is another route
/// for the previous prefix; attribute lines start with a tab, and a long
/// community list goes on over lines starting with two tabs. The next hop is
/// `BGP.next_hop` (its first address), else the route's gateway
/// (`via ADDR on IFACE`), else unspecified (a route the agent did not
/// write, which the next apply withdraws).
fn parse_routes(reply: &Reply, family: Family) -> Vec<Route> {
    let mut routes = Vec::new();
    let mut cur: Option<Parsed> = None;
    let mut prefix: Option<IpNet> = None;
    let mut last_attr = String::new();
    let finish = |cur: &mut Option<Parsed>, routes: &mut Vec<Route>| {
        if let Some(p) = cur.take() {
            routes.extend(p.into_route(family));
        }
    };
    for (code, text) in &reply.lines {
        if !(1000..8000).contains(code) || text.trim().is_empty() {
            continue;
        }
        if text.starts_with("Table ") && text.ends_with(':') {
            finish(&mut cur, &mut routes);
            prefix = None;
            continue;
        }
        if let Some(rest) = text.strip_prefix("\t\t") {
            if let Some(p) = cur.as_mut() {
                match last_attr.as_str() {
                    "BGP.community" => p.communities.extend(parse_communities(rest)),
                    "BGP.large_community" => {
                        p.large_communities.extend(parse_large_communities(rest))
                    }
                    _ => {}
                }
            }
            continue;
        }
        if let Some(attr) = text.strip_prefix('\t') {
            let Some(p) = cur.as_mut() else { continue };
            if let Some(via) = attr.strip_prefix("via ") {
                if p.gateway.is_none() {
                    p.gateway = via.split_whitespace().next().and_then(|a| a.parse().ok());
                }
                continue;
            }
            let Some((name, value)) = attr.split_once(':') else {
                continue;
            };
            let value = value.trim();
            last_attr = name.to_string();
            match name {
                "BGP.next_hop" => {
                    p.bgp_next_hop = value.split_whitespace().next().and_then(|a| a.parse().ok())
                }
                "BGP.local_pref" => p.local_pref = value.parse().ok(),
                "BGP.community" => p.communities.extend(parse_communities(value)),
                "BGP.large_community" => p.large_communities.extend(parse_large_communities(value)),
                _ => {}
            }
            continue;
        }
        // A route line.
        finish(&mut cur, &mut routes);
        last_attr.clear();
        if !text.starts_with(char::is_whitespace) {
            let first = text.split_whitespace().next().unwrap_or_default();
            prefix = first.parse().ok();
            if prefix.is_none() {
                tracing::debug!(line = %text, "bird: unexpected route line");
            }
        }
        if let Some(prefix) = prefix {
            // Older releases print a single next hop on the route line.
            let mut words = text.split_whitespace().take_while(|w| !w.starts_with('['));
            let gateway = words
                .find(|w| *w == "via")
                .and_then(|_| words.next()?.parse().ok());
            cur = Some(Parsed {
                prefix,
                bgp_next_hop: None,
                gateway,
                communities: Vec::new(),
                large_communities: Vec::new(),
                local_pref: None,
            });
        }
    }
    finish(&mut cur, &mut routes);
    routes
}

/// Reads the BGP sessions of `birdc -v show protocols all`:
///
/// ```text
/// 2002-Name       Proto      Table      State  Since         Info
/// 1002-upstream   BGP        ---        up     23:47:00.406  Established
/// 1006-  BGP state:          Established
///          Neighbor address: 10.210.0.1
///          Neighbor AS:      65000
///      ...
/// 1002-device1    Device     ---        up     23:47:00.160
/// ```
///
/// Each `1002` line starts a protocol; a BGP protocol's `1006` block has
/// its state, neighbour and, per channel, `Routes: N imported, M exported`.
/// A protocol without a neighbour address (a template for dynamic peers,
/// `neighbor range`) is skipped; two protocols with the same neighbour
/// give one session, up if either is.
///
/// An established session's `Since` is when it came up, in BIRD's local
/// time: a time of day (BIRD's default `timeformat protocol`, for the last
/// 20 hours) gives the uptime against `now_of_day`, the local time of day
/// now; anything else (a date) gives none.
fn parse_bgp_sessions(reply: &Reply, now_of_day: Duration) -> Vec<Session> {
    let mut sessions: BTreeMap<IpAddr, Session> = BTreeMap::new();
    // The current protocol, if it is a BGP one: its neighbour, and what is
    // known of the session.
    let mut cur: Option<(Option<IpAddr>, Session)> = None;
    let mut finish = |cur: &mut Option<(Option<IpAddr>, Session)>| {
        let Some((Some(addr), mut s)) = cur.take() else {
            return;
        };
        s.peer = addr;
        if s.established {
            // A channel without `Routes:` has exported nothing.
            s.prefixes_sent.get_or_insert(0);
        } else {
            s.uptime = None;
            s.prefixes_sent = None;
        }
        match sessions.get(&addr) {
            Some(old) if old.established => {}
            _ => {
                sessions.insert(addr, s);
            }
        }
    };
    for (code, text) in &reply.lines {
        match code {
            1002 => {
                finish(&mut cur);
                let words: Vec<&str> = text.split_whitespace().collect();
                if words.get(1) == Some(&"BGP") {
                    let mut s = Session::new(IpAddr::from([0u8; 4]), false);
                    s.uptime = words.get(4).and_then(|t| since(t, now_of_day));
                    cur = Some((None, s));
                }
            }
            1006 => {
                let Some((addr, s)) = cur.as_mut() else {
                    continue;
                };
                let Some((key, value)) = text.trim().split_once(':') else {
                    continue;
                };
                let value = value.trim();
                match key {
                    "BGP state" => s.established = value == "Established",
                    "Neighbor address" => *addr = value.parse().ok(),
                    // `0 imported, 3 exported, 0 preferred`
                    "Routes" => {
                        let exported = value
                            .split(',')
                            .find_map(|p| p.trim().strip_suffix(" exported"))
                            .and_then(|n| n.trim().parse::<u64>().ok());
                        if let Some(n) = exported {
                            *s.prefixes_sent.get_or_insert(0) += n;
                        }
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }
    finish(&mut cur);
    sessions.into_values().collect()
}

/// How long before `now_of_day` BIRD's `Since` was: `06:56:09.543` (a
/// time of day, earlier today or else yesterday). `None` for anything
/// else (BIRD prints a date for older times).
fn since(text: &str, now_of_day: Duration) -> Option<Duration> {
    let (hms, frac) = match text.split_once('.') {
        Some((hms, frac)) => (hms, Some(frac)),
        None => (text, None),
    };
    let (h, m, s) = super::parse_hms(hms)?;
    if h > 23 || m > 59 || s > 60 {
        return None;
    }
    let frac = match frac {
        Some(f) if f.bytes().all(|b| b.is_ascii_digit()) && !f.is_empty() => {
            format!("0.{f}").parse::<f64>().ok()?
        }
        Some(_) => return None,
        None => 0.0,
    };
    let then = Duration::from_secs(h * 3600 + m * 60 + s) + Duration::from_secs_f64(frac);
    const DAY: Duration = Duration::from_secs(86_400);
    // A second's slack: BIRD's clock and ours are read at different times.
    Some(if then <= now_of_day + Duration::from_secs(1) {
        now_of_day.saturating_sub(then)
    } else {
        now_of_day + DAY - then
    })
}

/// The local time of day now (BIRD prints its times in local time).
fn local_time_of_day() -> Duration {
    let t = jiff::Zoned::now().time();
    Duration::from_secs(
        u64::from(t.hour().unsigned_abs()) * 3600
            + u64::from(t.minute().unsigned_abs()) * 60
            + u64::from(t.second().unsigned_abs()),
    ) + Duration::from_nanos(u64::from(t.subsec_nanosecond().unsigned_abs()))
}

/// `(65000,100) (65000,7)` → `[(65000, 100), (65000, 7)]`; anything else
/// (large or extended communities) is skipped.
fn parse_communities(s: &str) -> impl Iterator<Item = (u16, u16)> + '_ {
    s.split_whitespace().filter_map(|t| {
        let (a, v) = t.strip_prefix('(')?.strip_suffix(')')?.split_once(',')?;
        Some((a.trim().parse().ok()?, v.trim().parse().ok()?))
    })
}

/// `(65000, 1, 2) (65000, 3, 4)` → `[(65000, 1, 2), (65000, 3, 4)]`.
fn parse_large_communities(s: &str) -> impl Iterator<Item = (u32, u32, u32)> + '_ {
    s.split(')').filter_map(|t| {
        let mut parts = t.trim().strip_prefix('(')?.split(',');
        let mut next = || parts.next()?.trim().parse().ok();
        Some((next()?, next()?, next()?))
    })
}

/// Checks what BIRD would accept but not announce as meant.
fn validate(desired: &BTreeSet<Route>) -> AnnounceResult<BTreeSet<Route>> {
    Ok(super::check_routes(desired)?.into_values().collect())
}

/// One file's contents: a header, then one static route per VIP.
fn render(bird: &BirdAnnouncer, family: Family, routes: &BTreeSet<Route>) -> String {
    let mut out = format!(
        "# Written by lb-agent (xlb) for `protocol static {}`; every change is overwritten.\n",
        bird.proto(family)
    );
    for r in routes
        .iter()
        .filter(|r| Family::of(r.prefix.addr()) == family)
    {
        let _ = write!(
            out,
            "route {} blackhole {{ bgp_next_hop = {};",
            r.prefix, r.next_hop
        );
        for (a, v) in &r.communities {
            let _ = write!(out, " bgp_community.add(({a},{v}));");
        }
        for (g, l1, l2) in &r.large_communities {
            let _ = write!(out, " bgp_large_community.add(({g},{l1},{l2}));");
        }
        if let Some(lp) = r.local_pref {
            let _ = write!(out, " bgp_local_pref = {lp};");
        }
        out.push_str(" };\n");
    }
    out
}

/// The sessions file: a header, a BFD protocol if any peer asks for BFD,
/// then one BGP protocol per peer (`xlb_peer1`, ...), exporting the VIPs of
/// the peer's family.
fn render_sessions(bird: &BirdAnnouncer, sessions: &Sessions) -> String {
    let mut out =
        String::from("# Written by lb-agent (xlb) from bgp.peers; every change is overwritten.\n");
    if sessions.peers.iter().any(|p| p.bfd.is_some()) {
        // BIRD's BGP needs a BFD protocol to run its sessions; the timers
        // are set per session below.
        out.push_str("protocol bfd xlb_bfd {\n}\n");
    }
    for (i, p) in sessions.peers.iter().enumerate() {
        let _ = writeln!(out, "protocol bgp xlb_peer{} {{", i + 1);
        let _ = writeln!(out, "    description \"xlb peer {}\";", p.address);
        let _ = writeln!(out, "    local as {};", sessions.local_asn);
        let _ = write!(out, "    neighbor {}", p.address);
        if let Some(port) = p.port {
            let _ = write!(out, " port {port}");
        }
        let _ = writeln!(out, " as {};", p.asn);
        // BIRD counts these timers in whole seconds.
        let secs = |d: Duration| d.as_secs_f64().ceil().max(1.0) as u64;
        let _ = writeln!(out, "    hold time {};", secs(p.hold_time));
        let _ = writeln!(out, "    keepalive time {};", secs(p.keepalive));
        // BIRD's 120 s connect retry and 60-300 s error wait would keep a
        // node away from its router for minutes after a session drop (a
        // BFD down, a hold-timer expiry): 5 s for both, without back-off,
        // as the GoBGP driver's connect retry (damping flaps is the
        // router's choice).
        let _ = writeln!(out, "    connect retry time 5;");
        let _ = writeln!(out, "    error wait time 5, 5;");
        if let Some(ttl) = p.multihop_ttl {
            let _ = writeln!(out, "    multihop {ttl};");
        }
        if let Some(password) = &p.password {
            let _ = writeln!(out, "    password \"{password}\";");
        }
        if let Some(t) = p.graceful_restart {
            let _ = writeln!(
                out,
                "    graceful restart on;\n    graceful restart time {};",
                secs(t)
            );
        }
        if let Some(b) = p.bfd {
            let _ = writeln!(
                out,
                "    bfd {{ min rx interval {} ms; min tx interval {} ms; multiplier {}; }};",
                b.min_rx.as_millis(),
                b.min_tx.as_millis(),
                b.multiplier
            );
        }
        let family = Family::of(p.address);
        // The limited prefixes (and everything inside) this peer may not
        // have.
        let denied: Vec<String> = sessions
            .limits
            .iter()
            .filter(|l| Family::of(l.prefix.addr()) == family && !l.peers.contains(&p.address))
            .map(|l| format!("{}+", l.prefix))
            .collect();
        let deny = if denied.is_empty() {
            String::new()
        } else {
            format!(" && !(net ~ [ {} ])", denied.join(", "))
        };
        let _ = writeln!(
            out,
            "    {} {{ import none; export where proto = \"{}\"{deny}; }};\n}}",
            family.channel(),
            bird.proto(family)
        );
    }
    out
}

struct Changed {
    path: PathBuf,
    old: Option<Vec<u8>>,
    content: String,
}

async fn read_if_exists(path: &Path) -> io::Result<Option<Vec<u8>>> {
    match tokio::fs::read(path).await {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Replaces `path` by `content` at once: a temporary file next to it,
/// synced, then renamed over it.
async fn write_atomic(path: &Path, content: &[u8]) -> io::Result<()> {
    let mut tmp = path.to_path_buf().into_os_string();
    tmp.push(".xlb-tmp");
    let tmp = PathBuf::from(tmp);
    let result = async {
        let mut f = tokio::fs::File::create(&tmp).await?;
        tokio::io::AsyncWriteExt::write_all(&mut f, content).await?;
        f.sync_all().await?;
        drop(f);
        tokio::fs::rename(&tmp, path).await
    }
    .await;
    if result.is_err() {
        let _ = tokio::fs::remove_file(&tmp).await;
    }
    result
}

/// Puts the files back as they were; returns "" or what could not be
/// restored, to append to the error.
async fn restore(changed: &[Changed]) -> String {
    let mut failed = String::new();
    for c in changed {
        let result = match &c.old {
            Some(old) => write_atomic(&c.path, old).await,
            None => match tokio::fs::remove_file(&c.path).await {
                Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
                _ => Ok(()),
            },
        };
        if let Err(e) = result {
            tracing::error!(path = %c.path.display(), error = %e, "bird: cannot restore the routes file");
            let _ = write!(failed, "; restoring {}: {e}", c.path.display());
        }
    }
    failed
}

#[cfg(test)]
mod tests;
