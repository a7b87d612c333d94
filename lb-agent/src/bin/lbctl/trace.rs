//! `lbctl trace SRC DST SPORT DPORT PROTO`: where a client flow goes now,
//! worked out from the live maps the way the XDP program does it
//! (lb-ebpf/src/conntrack.rs: `lookup_or_create`, `pick`,
//! `claim_snat_port`): the flow's FLOWS entry if there is a usable
//! one, else
//! `MAGLEV[table_base + active * M + maglev_hash(key, flags) % M]` (the
//! hash is of the client address alone under session affinity). A client
//! outside the service's source ranges is dropped before any of it.

use std::net::{IpAddr, SocketAddr};

use anyhow::{bail, Context, Result};
use lb_agent::maps::{self, PinnedMaps};
use lb_common::{
    hash::{flow_hash, maglev_hash, snat_port_candidate},
    net::{ip_words, protocol_name, service_key, words_ip, words_socket, Family, Protocol},
    Config, FlowKey, ReplyNat, ServiceInfo, PORT_F_SERVICE, PROTO_TCP, SERVICE_F_CLIENT_AFFINITY,
    SERVICE_F_LEAST_LOADED, SNAT_PROBES,
};
use serde::Serialize;

use crate::{
    services::{self, ServiceArg},
    table, Render,
};

#[derive(clap::Args)]
pub struct Args {
    /// Client address.
    pub src: IpAddr,
    /// VIP.
    pub dst: IpAddr,
    /// Client port.
    pub sport: u16,
    /// Service port.
    pub dport: u16,
    #[arg(value_parser = protocol_arg())]
    pub proto: Protocol,
}

/// `tcp` or `udp`, listed in `--help`.
fn protocol_arg() -> impl clap::builder::TypedValueParser<Value = Protocol> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(["tcp", "udp"])
        .map(|s| s.parse::<Protocol>().expect("one of the possible values"))
}

/// The flow's key exactly as the XDP program builds it from a packet:
/// addresses as stored words, ports in network order, padding zero.
pub fn flow_key(src: IpAddr, dst: IpAddr, sport: u16, dport: u16, proto: u8) -> Result<FlowKey> {
    if src.is_ipv4() != dst.is_ipv4() {
        bail!("SRC {src} and DST {dst} are not of the same address family");
    }
    Ok(FlowKey {
        src: ip_words(src),
        dst: ip_words(dst),
        sport: sport.to_be(),
        dport: dport.to_be(),
        proto,
        family: Family::of(src).number(),
        _pad: [0; 2],
    })
}

/// Where a flow hash lands in a service's live table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TableIndex {
    /// Entry within the table (`hash % M`).
    pub entry: u32,
    /// Index in the `MAGLEV` pool (`table_base + active * M + entry`).
    pub pool_index: u32,
}

/// `None` when the service has no live table (new flows are dropped).
pub fn table_index(info: &ServiceInfo, hash: u32) -> Option<TableIndex> {
    if info.backend_count == 0 || info.table_size == 0 {
        return None;
    }
    let m = info.table_size;
    let entry = hash % m;
    Some(TableIndex {
        entry,
        pool_index: info.table_base + info.active * m + entry,
    })
}

/// Idle time after which the data plane no longer trusts an SNAT flow's
/// entry (its port may have gone to another flow) and re-picks.
pub fn snat_flow_lifetime_ns(cfg: &Config, proto: u8) -> u64 {
    let s = if proto == PROTO_TCP {
        cfg.tcp_timeout_s
    } else {
        cfg.udp_timeout_s
    };
    s as u64 * 1_000_000_000
}

/// The reply-direction key of an SNAT flow using `port_be`.
pub fn snat_reply_key(
    key: &FlowKey,
    snat_addr: [u32; 4],
    backend: &lb_common::Backend,
    port_be: u16,
) -> FlowKey {
    FlowKey {
        src: backend.addr,
        dst: snat_addr,
        sport: backend.port,
        dport: port_be,
        proto: key.proto,
        family: key.family,
        _pad: [0; 2],
    }
}

fn same_client(r: &ReplyNat, key: &FlowKey) -> bool {
    r.client == key.src && r.cport == key.sport && r.vip == key.dst && r.vport == key.dport
}

#[derive(Serialize)]
pub struct MaglevPick {
    /// The hash that indexes the table, and what it is of: `flow` (the
    /// whole tuple) or `client` (session affinity).
    pub hash: u32,
    pub hashed_on: &'static str,
    pub table_size: u32,
    #[serde(flatten)]
    pub index: TableIndex,
    pub backend_id: u32,
    pub backend: Option<SocketAddr>,
    /// Set when the data plane would fail here (`drop_table_error`).
    pub error: Option<String>,
    /// A load-aware service's candidates (least connections over up to
    /// three distinct Maglev draws), and which one a new flow takes.
    pub least_loaded: Option<LeastLoaded>,
}

#[derive(Serialize)]
pub struct LeastLoaded {
    /// The candidates in draw order; the first is Maglev's own pick.
    pub candidates: Vec<Candidate>,
    /// Index into `candidates` of the one a new flow goes to: the first
    /// with the fewest open flows.
    pub taken: usize,
}

#[derive(Serialize)]
pub struct Candidate {
    pub hash: u32,
    #[serde(flatten)]
    pub index: TableIndex,
    pub backend_id: u32,
    pub backend: Option<SocketAddr>,
    /// Its `BACKEND_ACTIVE` count.
    pub open_flows: i64,
}

/// The flow's `FLOWS` entry (used for any packet but a TCP SYN).
#[derive(Serialize)]
pub struct FlowHit {
    pub backend: SocketAddr,
    pub backend_id: u32,
    pub snat_port: Option<u16>,
    /// The SNAT source: another node's address for a flow it handed over.
    pub snat: Option<SocketAddr>,
    pub age_ns: u64,
    pub idle_ns: u64,
    /// Why the data plane would not use it (then it picks again), if so.
    pub unusable: Option<String>,
}

#[derive(Serialize)]
pub struct SnatInfo {
    pub snat_addr: IpAddr,
    pub port_min: u16,
    pub port_max: u16,
    /// The first port the data plane tries for this flow (probe 0); a taken
    /// port moves it to the next probe, up to `SNAT_PROBES`.
    pub first_candidate: u16,
    /// The port a REPLY_NAT entry of this flow holds now, and its probe.
    pub port_in_use: Option<u16>,
    pub probe: Option<u32>,
}

#[derive(Serialize)]
pub struct TraceReport {
    pub flow: String,
    pub protocol: String,
    pub service: String,
    /// Whether a service matches the flow's destination.
    pub matched: bool,
    pub service_id: Option<u32>,
    pub mode: Option<String>,
    /// Whether PORT_FLAGS marks DPORT as a service port (without it the
    /// data plane never looks the service up).
    pub port_flag_set: Option<bool>,
    /// `client_ip` under session affinity: the Maglev hash is of the client
    /// address alone.
    pub affinity: Option<&'static str>,
    /// The service's source ranges (`None`: open to all).
    pub source_ranges: Option<Vec<String>>,
    /// Whether the ranges admit the client (`None`: no ranges).
    pub source_allowed: Option<bool>,
    /// The flow's entry in the flow table.
    pub conntrack: Option<FlowHit>,
    pub maglev: Option<MaglevPick>,
    /// `conntrack` (the flow table), `maglev`, or `none` (the flow is
    /// dropped or passed).
    pub decided_by: &'static str,
    pub backend: Option<SocketAddr>,
    pub backend_id: Option<u32>,
    pub snat: Option<SnatInfo>,
    pub note: Option<String>,
}

/// This flow's FLOWS entry, and whether the data plane would use it.
fn flow_hit(
    maps: &PinnedMaps,
    key: &FlowKey,
    info: &ServiceInfo,
    cfg: &Config,
    now: u64,
) -> Result<Option<FlowHit>> {
    let flow = maps::optional(maps.shared_flows()?.get(key, 0)).context("reading FLOWS")?;
    Ok(flow.map(|f| {
        let e = crate::conntrack::entry(key, &f, now);
        let unusable = if f.service_id != info.id {
            Some(format!(
                "it names service id {}, not {}: the service was re-created",
                f.service_id, info.id
            ))
        } else if services::is_snat(info) && e.idle_ns > snat_flow_lifetime_ns(cfg, key.proto) {
            Some("idle past the SNAT lifetime: its port may have gone to another flow".into())
        } else {
            None
        };
        FlowHit {
            backend: e.backend,
            backend_id: f.backend_id,
            snat_port: e.snat_port,
            snat: e.snat,
            age_ns: e.age_ns,
            idle_ns: e.idle_ns,
            unusable,
        }
    }))
}

/// The SNAT port the data plane tries first, and the one this flow holds.
fn snat_info(
    maps: &PinnedMaps,
    key: &FlowKey,
    info: &ServiceInfo,
    cfg: &Config,
    chosen: Option<lb_common::Backend>,
) -> Result<SnatInfo> {
    // Ports come from the whole tuple's hash, affinity or not.
    let hash = flow_hash(key);
    let mut s = SnatInfo {
        snat_addr: words_ip(&info.snat_addr, key.family),
        port_min: cfg.snat_port_min,
        port_max: cfg.snat_port_max,
        first_candidate: snat_port_candidate(hash, 0, cfg.snat_port_min, cfg.snat_port_max),
        port_in_use: None,
        probe: None,
    };
    if let Some(b) = chosen {
        let reply = maps.reply_nat()?;
        for probe in 0..SNAT_PROBES {
            let port = snat_port_candidate(hash, probe, cfg.snat_port_min, cfg.snat_port_max);
            let rk = snat_reply_key(key, info.snat_addr, &b, port.to_be());
            if let Ok(r) = reply.get(&rk, 0) {
                if same_client(&r, key) {
                    s.port_in_use = Some(port);
                    s.probe = Some(probe);
                    break;
                }
            }
        }
    }
    Ok(s)
}

/// Maglev's entry for the flow, which a new flow (or a packet no table
/// knows, or a TCP SYN) gets.
fn maglev_pick(
    maps: &PinnedMaps,
    key: &FlowKey,
    info: &ServiceInfo,
    backends: &aya::maps::Array<aya::maps::MapData, lb_common::BackendEntry>,
) -> Result<MaglevOutcome> {
    let hash = maglev_hash(key, info.flags);
    let Some(index) = table_index(info, hash) else {
        return Ok((None, None));
    };
    {
        let id = maps.maglev()?.get(index.pool_index)?;
        let (backend, error) = match backends.get(&id, 0).map(|e| e.backend) {
            Ok(b) if b.family == key.family => (Some(b), None),
            Ok(_) => (
                None,
                Some(format!(
                    "BACKENDS[{id}] is not of the flow's address family: \
                     the data plane drops the packet (drop_table_error)"
                )),
            ),
            Err(e) => (
                None,
                Some(format!(
                    "BACKENDS[{id}] unreadable ({e}): the data plane drops the packet \
                     (drop_table_error)"
                )),
            ),
        };
        let mut picked = backend.map(|b| (id, b));
        let least_loaded = match picked {
            Some(first) if info.flags & SERVICE_F_LEAST_LOADED != 0 => {
                least_loaded_pick(maps, key, info, backends, (hash, index), first)?
            }
            _ => None,
        };
        if let Some((_, taken)) = &least_loaded {
            picked = Some(*taken);
        }
        let pick = MaglevPick {
            least_loaded: least_loaded.map(|(l, _)| l),
            hash,
            hashed_on: if info.flags & SERVICE_F_CLIENT_AFFINITY != 0 {
                "client"
            } else {
                "flow"
            },
            table_size: info.table_size,
            index,
            backend_id: id,
            backend: backend.map(|b| words_socket(&b.addr, b.port, b.family)),
            error,
        };
        Ok((Some(pick), picked))
    }
}

/// A load-aware service's new-flow candidates: Maglev's pick, then further
/// draws, skipping backends already drawn, until
/// `LEAST_LOADED_CANDIDATES` distinct ones (or the service's backend count)
/// or `CANDIDATE_DRAWS` draws; the program takes the first with the fewest
/// open flows (`conntrack::pick_new`). `None` where the program would fall
/// back on the first (one backend, or a draw it cannot read).
fn least_loaded_pick(
    maps: &PinnedMaps,
    key: &FlowKey,
    info: &ServiceInfo,
    backends: &aya::maps::Array<aya::maps::MapData, lb_common::BackendEntry>,
    (first_hash, first_index): (u32, TableIndex),
    first: (u32, lb_common::Backend),
) -> Result<Option<(LeastLoaded, (u32, lb_common::Backend))>> {
    use lb_common::hash::{next_candidate, CANDIDATE_DRAWS, LEAST_LOADED_CANDIDATES};
    if info.backend_count < 2 {
        return Ok(None);
    }
    let maglev = maps.maglev()?;
    let active = maps.backend_active()?;
    let open = |id: u32| {
        active
            .as_ref()
            .and_then(|a| a.get(&id, 0).ok())
            .unwrap_or(0)
    };
    let candidate = |hash, index, id, b: &lb_common::Backend| Candidate {
        hash,
        index,
        backend_id: id,
        backend: Some(words_socket(&b.addr, b.port, b.family)),
        open_flows: open(id),
    };
    let mut drawn = vec![first];
    let mut candidates = vec![candidate(first_hash, first_index, first.0, &first.1)];
    let wanted = info.backend_count.min(LEAST_LOADED_CANDIDATES) as usize;
    let mut hash = first_hash;
    for _ in 0..CANDIDATE_DRAWS {
        if candidates.len() >= wanted {
            break;
        }
        hash = next_candidate(hash);
        let Some(index) = table_index(info, hash) else {
            break;
        };
        let id = maglev.get(index.pool_index)?;
        let Ok(b) = backends.get(&id, 0).map(|e| e.backend) else {
            break;
        };
        if b.family != key.family {
            break;
        }
        if drawn.iter().any(|(seen, _)| *seen == id) {
            continue;
        }
        candidates.push(candidate(hash, index, id, &b));
        drawn.push((id, b));
    }
    let fewest = candidates.iter().map(|c| c.open_flows).min().unwrap_or(0);
    let taken = candidates
        .iter()
        .position(|c| c.open_flows == fewest)
        .unwrap_or(0);
    Ok(Some((LeastLoaded { candidates, taken }, drawn[taken])))
}

/// What [`maglev_pick`] found, and the backend it names.
type MaglevOutcome = (Option<MaglevPick>, Option<(u32, lb_common::Backend)>);

pub fn run(maps: &PinnedMaps, args: &Args) -> Result<TraceReport> {
    let proto = args.proto.number();
    let key = flow_key(args.src, args.dst, args.sport, args.dport, proto)?;
    let svc_arg = ServiceArg {
        vip: args.dst,
        port: args.dport,
        proto,
    };
    let mut report = TraceReport {
        flow: format!(
            "{} -> {}/{}",
            SocketAddr::new(args.src, args.sport),
            SocketAddr::new(args.dst, args.dport),
            protocol_name(proto)
        ),
        protocol: protocol_name(proto),
        service: svc_arg.to_string(),
        matched: false,
        service_id: None,
        mode: None,
        port_flag_set: None,
        affinity: None,
        source_ranges: None,
        source_allowed: None,
        conntrack: None,
        maglev: None,
        decided_by: "none",
        backend: None,
        backend_id: None,
        snat: None,
        note: None,
    };
    let svc_key = service_key(args.dst, args.dport, proto);
    let Some(info) = maps::service(&maps.services()?, &svc_key).context("reading SERVICES")? else {
        report.note = Some(format!(
            "no service matches {svc_arg}: the data plane passes the packet on (pass_no_service)"
        ));
        return Ok(report);
    };
    report.matched = true;
    report.service_id = Some(info.id);
    report.mode = Some(services::mode(&svc_key, &info));
    let flags = maps.port_flags()?.get(&(args.dport as u32), 0).ok();
    report.port_flag_set = flags.map(|f| f & PORT_F_SERVICE != 0);
    report.affinity = services::affinity(&info);
    report.source_ranges = services::source_ranges(maps, &svc_key, &info)?;
    if report.source_ranges.is_some() {
        let trie = maps.source_ranges()?;
        let allowed =
            maps::ranges::admits(&trie, info.range_scope(), key.src).context("SOURCE_RANGES")?;
        report.source_allowed = Some(allowed);
        if !allowed {
            report.note = Some(format!(
                "client {} is outside the service's source ranges: the data plane drops \
                 the packet before any flow state (drop_source_range)",
                args.src
            ));
            return Ok(report);
        }
    }

    let cfg = maps::config(&maps.config()?).context("reading CONFIG[0]")?;
    let snat = services::is_snat(&info);
    let backends = maps.backends()?;

    // The flow table first, as the data plane does.
    report.conntrack = flow_hit(maps, &key, &info, &cfg, maps::coarse_now_ns())?;

    // The Maglev pick, which a new flow (or a packet no table knows, or a
    // TCP SYN) gets.
    let (pick, picked) = maglev_pick(maps, &key, &info, &backends)?;
    report.maglev = pick;

    // A remembered flow wins.
    let remembered = report.conntrack.as_ref().filter(|h| h.unusable.is_none());
    let chosen = if let Some(h) = remembered {
        let id = h.backend_id;
        report.decided_by = "conntrack";
        report.backend = Some(h.backend);
        report.backend_id = Some(id);
        backends.get(&id, 0).ok().map(|e| (id, e.backend))
    } else if let Some((id, b)) = picked {
        report.decided_by = "maglev";
        report.backend = Some(words_socket(&b.addr, b.port, b.family));
        report.backend_id = Some(id);
        Some((id, b))
    } else {
        if info.backend_count == 0 || info.table_size == 0 {
            report.note =
                Some("the service has no backends: new flows are dropped (drop_no_backend)".into());
        }
        None
    };

    if snat {
        report.snat = Some(snat_info(maps, &key, &info, &cfg, chosen.map(|c| c.1))?);
    }
    Ok(report)
}

impl TraceReport {
    /// The flow table's line of the human output.
    fn flow_lines(&self, s: &mut String) {
        match &self.conntrack {
            None => s.push_str("conntrack not in FLOWS\n"),
            Some(h) => s.push_str(&format!(
                "conntrack backend {} (id {}){}, age {}, idle {}{}\n",
                h.backend,
                h.backend_id,
                h.snat
                    .map(|a| format!(", snat source {a}"))
                    .unwrap_or_default(),
                table::duration_ns(h.age_ns),
                table::duration_ns(h.idle_ns),
                h.unusable
                    .as_ref()
                    .map(|u| format!(" (not used: {u})"))
                    .unwrap_or_default()
            )),
        }
    }
}

impl Render for TraceReport {
    fn human(&self) -> String {
        let mut s = format!("flow      {}\n", self.flow);
        if !self.matched {
            if let Some(n) = &self.note {
                s.push_str(&format!("result    {n}\n"));
            }
            return s;
        }
        s.push_str(&format!(
            "service   {} (id {}, {})\n",
            self.service,
            self.service_id.unwrap_or_default(),
            self.mode.as_deref().unwrap_or("?")
        ));
        if self.port_flag_set == Some(false) {
            s.push_str(
                "WARNING: PORT_FLAGS does not mark the port as a service port: \
                 the data plane skips the service lookup\n",
            );
        }
        if let Some(r) = &self.source_ranges {
            let list = if r.is_empty() {
                "none".to_string()
            } else {
                r.join(", ")
            };
            let verdict = match self.source_allowed {
                Some(true) => "client admitted",
                _ => "client NOT admitted",
            };
            s.push_str(&format!("sources   {list}: {verdict}\n"));
        }
        if self.source_allowed == Some(false) {
            if let Some(n) = &self.note {
                s.push_str(&format!("result    {n}\n"));
            }
            return s;
        }
        if let Some(a) = self.affinity {
            s.push_str(&format!(
                "affinity  {a}: new connections hash on the client address alone\n"
            ));
        }
        self.flow_lines(&mut s);
        if let Some(m) = &self.maglev {
            s.push_str(&format!(
                "maglev    hash {:#010x}: entry {} of {} (MAGLEV[{}]) -> {} (id {})\n",
                m.hash,
                m.index.entry,
                m.table_size,
                m.index.pool_index,
                m.backend
                    .map(|b| b.to_string())
                    .unwrap_or_else(|| "?".into()),
                m.backend_id
            ));
            if let Some(e) = &m.error {
                s.push_str(&format!("ERROR: {e}\n"));
            }
            if let Some(l) = &m.least_loaded {
                let list: Vec<String> = l
                    .candidates
                    .iter()
                    .map(|c| {
                        format!(
                            "{} (id {}, entry {}) {} open",
                            c.backend
                                .map(|b| b.to_string())
                                .unwrap_or_else(|| "?".into()),
                            c.backend_id,
                            c.index.entry,
                            c.open_flows
                        )
                    })
                    .collect();
                s.push_str(&format!(
                    "          least loaded of {}: {}; a new flow takes candidate {}\n",
                    list.len(),
                    list.join(", "),
                    l.taken + 1
                ));
            }
        }
        if let Some(sn) = &self.snat {
            s.push_str(&format!(
                "snat      source {}, first port candidate {} (range {}-{})",
                sn.snat_addr, sn.first_candidate, sn.port_min, sn.port_max
            ));
            if let (Some(p), Some(probe)) = (sn.port_in_use, sn.probe) {
                s.push_str(&format!("; REPLY_NAT holds port {p} (probe {probe})"));
            }
            s.push('\n');
        }
        match (self.backend, self.backend_id) {
            (Some(b), Some(id)) => {
                s.push_str(&format!(
                    "backend   {b} (id {id}, by {})\n",
                    self.decided_by
                ));
                if self.decided_by != "maglev" {
                    if let Some(m) = self.maglev.as_ref().and_then(|m| m.backend) {
                        let tcp = self.protocol == "tcp";
                        if Some(m) != self.backend || tcp {
                            s.push_str(&format!(
                                "          (a new flow{} would go to {m} by Maglev)\n",
                                if tcp {
                                    ", or a TCP SYN without ACK,"
                                } else {
                                    ""
                                }
                            ));
                        }
                    }
                }
            }
            _ => s.push_str("backend   none\n"),
        }
        if let Some(n) = &self.note {
            s.push_str(&format!("note      {n}\n"));
        }
        s
    }

    fn exit_code(&self) -> u8 {
        if self.matched {
            0
        } else {
            2
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::PROTO_UDP;
    use lb_common::{addr_from_v4, addr_from_v6, FAMILY_V4, FAMILY_V6};

    #[test]
    fn key_is_built_like_the_data_plane() {
        let k = flow_key(
            "198.51.100.7".parse().unwrap(),
            "192.0.2.10".parse().unwrap(),
            40000,
            80,
            PROTO_TCP,
        )
        .unwrap();
        assert_eq!(k.src, addr_from_v4([198, 51, 100, 7]));
        assert_eq!(k.dst, addr_from_v4([192, 0, 2, 10]));
        // Network order, as read from the packet.
        assert_eq!(k.sport.to_ne_bytes(), 40000u16.to_be_bytes());
        assert_eq!(k.dport.to_ne_bytes(), 80u16.to_be_bytes());
        assert_eq!((k.proto, k.family, k._pad), (PROTO_TCP, FAMILY_V4, [0, 0]));

        let k = flow_key(
            "2001:db8::7".parse().unwrap(),
            "2001:db8::10".parse().unwrap(),
            1,
            2,
            PROTO_UDP,
        )
        .unwrap();
        let o: std::net::Ipv6Addr = "2001:db8::10".parse().unwrap();
        assert_eq!(k.dst, addr_from_v6(o.octets()));
        assert_eq!(k.family, FAMILY_V6);

        assert!(flow_key(
            "10.0.0.1".parse().unwrap(),
            "2001:db8::10".parse().unwrap(),
            1,
            2,
            PROTO_TCP
        )
        .is_err());
    }

    #[test]
    fn index_uses_the_live_half() {
        let info = ServiceInfo {
            table_base: 1000,
            table_size: 13,
            active: 1,
            backend_count: 2,
            ..Default::default()
        };
        assert_eq!(
            table_index(&info, 100),
            Some(TableIndex {
                entry: 100 % 13,
                pool_index: 1000 + 13 + 100 % 13
            })
        );
        let info0 = ServiceInfo { active: 0, ..info };
        assert_eq!(table_index(&info0, 13).unwrap().pool_index, 1000);
        assert_eq!(
            table_index(
                &ServiceInfo {
                    backend_count: 0,
                    ..info
                },
                5
            ),
            None
        );
    }

    #[test]
    fn snat_lifetime_by_protocol() {
        let cfg = Config::default();
        assert_eq!(
            snat_flow_lifetime_ns(&cfg, PROTO_TCP),
            cfg.tcp_timeout_s as u64 * 1_000_000_000
        );
        assert_eq!(
            snat_flow_lifetime_ns(&cfg, PROTO_UDP),
            cfg.udp_timeout_s as u64 * 1_000_000_000
        );
    }

    #[test]
    fn reply_key_points_back_at_the_snat_address() {
        let k = flow_key(
            "198.51.100.7".parse().unwrap(),
            "192.0.2.10".parse().unwrap(),
            40000,
            80,
            PROTO_TCP,
        )
        .unwrap();
        let b = lb_common::Backend {
            addr: addr_from_v4([10, 2, 0, 3]),
            port: 8080u16.to_be(),
            family: FAMILY_V4,
            _pad: 0,
        };
        let snat = addr_from_v4([10, 2, 0, 1]);
        let rk = snat_reply_key(&k, snat, &b, 12345u16.to_be());
        assert_eq!((rk.src, rk.dst), (b.addr, snat));
        assert_eq!((rk.sport, rk.dport), (b.port, 12345u16.to_be()));
        let r = ReplyNat {
            vip: k.dst,
            client: k.src,
            vport: k.dport,
            cport: k.sport,
            ..Default::default()
        };
        assert!(same_client(&r, &k));
        assert!(!same_client(&ReplyNat { cport: 1, ..r }, &k));
    }
}
