//! `lbctl services`, and the service naming shared by the other commands:
//! `VIP:PORT/PROTO` (`192.0.2.10:80/tcp`, `[2001:db8::10]:80/udp`), or
//! the agent's name for the service (`shop/web:http`, `web`).

use std::{
    collections::BTreeMap,
    fmt,
    net::{IpAddr, SocketAddr},
    str::FromStr,
};

use anyhow::{bail, Context, Result};
use lb_agent::maps::{self, PinnedMaps};
use lb_common::{
    map_names as names,
    net::{protocol_name, service_key, words_ip, Protocol},
    ServiceInfo, ServiceKey, SERVICE_F_CLIENT_AFFINITY, SERVICE_F_FLOW_LIMIT, SERVICE_F_SNAT,
    SERVICE_F_SOURCE_RANGES,
};
use serde::Serialize;

use crate::{
    table::{self, Align, Table},
    watch::{Rates, Watched},
    Render,
};

/// A service named on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServiceArg {
    pub vip: IpAddr,
    pub port: u16,
    pub proto: u8,
}

impl ServiceArg {
    pub fn key(&self) -> ServiceKey {
        service_key(self.vip, self.port, self.proto)
    }
}

impl FromStr for ServiceArg {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = |why: &str| {
            format!(
                "invalid service {s:?}: {why} (expected VIP:PORT/PROTO, e.g. \
                 192.0.2.10:80/tcp or [2001:db8::10]:80/tcp)"
            )
        };
        let (addr, proto) = s.rsplit_once('/').ok_or_else(|| bad("no /PROTO"))?;
        let proto = proto
            .parse::<Protocol>()
            .map_err(|_| bad("PROTO must be tcp or udp"))?
            .number();
        let sa: SocketAddr = addr
            .parse()
            .map_err(|_| bad("VIP:PORT is not an address and port (IPv6 needs brackets)"))?;
        Ok(Self {
            vip: sa.ip(),
            port: sa.port(),
            proto,
        })
    }
}

impl fmt::Display for ServiceArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}",
            SocketAddr::new(self.vip, self.port),
            protocol_name(self.proto)
        )
    }
}

/// A service on the command line: its address, or the agent's name for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServiceRef {
    Address(ServiceArg),
    Name(String),
}

impl FromStr for ServiceRef {
    type Err = String;

    /// An address when it reads as one; anything else is a name, which
    /// the agent's answer resolves ([`ServiceRef::resolve`]).
    fn from_str(s: &str) -> Result<Self, String> {
        match s.parse() {
            Ok(a) => Ok(ServiceRef::Address(a)),
            Err(_) if !s.trim().is_empty() => Ok(ServiceRef::Name(s.trim().to_owned())),
            Err(e) => Err(e),
        }
    }
}

impl fmt::Display for ServiceRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ServiceRef::Address(a) => a.fmt(f),
            ServiceRef::Name(n) => f.write_str(n),
        }
    }
}

impl ServiceRef {
    pub fn is_name(&self) -> bool {
        matches!(self, ServiceRef::Name(_))
    }

    /// The address of the service so named: the name whole (`shop/web:http`,
    /// `web`), or a Kubernetes Service without its port (`shop/web`) when
    /// it has one port.
    pub fn resolve(&self, names: &Names) -> Result<ServiceArg> {
        let name = match self {
            ServiceRef::Address(a) => return Ok(*a),
            ServiceRef::Name(n) => n,
        };
        if names.is_empty() {
            bail!(
                "{name:?} is not VIP:PORT/PROTO, and service names come from the agent, \
                 which did not answer (see --agent)"
            );
        }
        let address = |(vip, port, proto): &(IpAddr, u16, String)| -> Result<ServiceArg> {
            let proto = proto
                .parse::<Protocol>()
                .map_err(|_| anyhow::anyhow!("the agent named a protocol {proto:?}"))?;
            Ok(ServiceArg {
                vip: *vip,
                port: *port,
                proto: proto.number(),
            })
        };
        let exact: Vec<_> = names.iter().filter(|(_, n)| *n == name).collect();
        let by_port: Vec<_> = names
            .iter()
            .filter(|(_, n)| {
                n.strip_prefix(name.as_str())
                    .is_some_and(|r| r.starts_with(':'))
            })
            .collect();
        let found = if exact.is_empty() { by_port } else { exact };
        match found.as_slice() {
            [] => bail!("no service named {name:?} (lbctl services lists them)"),
            [(addr, _)] => address(addr),
            several => {
                let mut list: Vec<String> = several
                    .iter()
                    .map(|(a, n)| Ok(format!("{n} ({})", address(a)?)))
                    .collect::<Result<_>>()?;
                list.sort();
                bail!("{name:?} names several services: {}", list.join(", "))
            }
        }
    }
}

/// Every service (echo markers left out) in listing order.
pub fn listed(map: &maps::ServicesMap) -> Result<Vec<(ServiceKey, ServiceInfo)>> {
    let mut out = maps::services(map).context("reading SERVICES")?;
    out.sort_by_key(|a| sort_key(&a.0));
    Ok(out)
}

pub fn service_arg(key: &ServiceKey) -> ServiceArg {
    ServiceArg {
        vip: words_ip(&key.addr, key.family),
        port: u16::from_be(key.port),
        proto: key.proto,
    }
}

pub fn service_name(key: &ServiceKey) -> String {
    service_arg(key).to_string()
}

/// Listing order: IPv4 before IPv6, then address, port, protocol.
pub fn sort_key(key: &ServiceKey) -> (u8, IpAddr, u16, u8) {
    let a = service_arg(key);
    (key.family, a.vip, a.port, a.proto)
}

/// The client networks a service admits; `None`: all.
pub fn source_ranges(
    maps: &PinnedMaps,
    key: &ServiceKey,
    info: &ServiceInfo,
) -> Result<Option<Vec<String>>> {
    if info.flags & SERVICE_F_SOURCE_RANGES == 0 {
        return Ok(None);
    }
    let trie = maps.source_ranges()?;
    let nets = maps::ranges::read_ranges(&trie, info.range_scope(), key.family)?;
    Ok(Some(nets.iter().map(ToString::to_string).collect()))
}

/// `client_ip` when the service has session affinity by client address.
pub fn affinity(info: &ServiceInfo) -> Option<&'static str> {
    (info.flags & SERVICE_F_CLIENT_AFFINITY != 0).then_some("client_ip")
}

pub fn is_snat(info: &ServiceInfo) -> bool {
    info.flags & SERVICE_F_SNAT != 0
}

/// `nat`, or `snat <address>`.
pub fn mode(key: &ServiceKey, info: &ServiceInfo) -> String {
    if is_snat(info) {
        format!("snat {}", words_ip(&info.snat_addr, key.family))
    } else {
        "nat".into()
    }
}

/// Service names from the agent, by `(VIP, port, protocol)`.
pub type Names = BTreeMap<(IpAddr, u16, String), String>;

/// The agent's name of the service, if it gave one.
pub fn name_of(names: &Names, key: &ServiceKey) -> Option<String> {
    let a = service_arg(key);
    names.get(&(a.vip, a.port, protocol_name(a.proto))).cloned()
}

#[derive(Serialize)]
pub struct ServiceRow {
    /// The agent's name (`namespace/name:port` in Kubernetes); `None`
    /// when the agent did not answer.
    pub name: Option<String>,
    pub service: String,
    pub vip: IpAddr,
    pub port: u16,
    pub protocol: String,
    /// `nat` or `snat`.
    pub mode: &'static str,
    pub snat_addr: Option<IpAddr>,
    /// `client_ip`: every connection of a client goes to one backend.
    pub affinity: Option<&'static str>,
    /// Client networks admitted; `None`: all (`[]`: none).
    pub source_ranges: Option<Vec<String>>,
    /// New flows a second per client prefix; `None`: unlimited.
    pub new_flow_limit: Option<NewFlowLimitRow>,
    pub service_id: u32,
    pub table_size: u32,
    /// Backends in the live Maglev table (0: new flows are dropped).
    pub backends: u32,
    pub packets: u64,
    pub bytes: u64,
    pub new_flows: u64,
    pub reply_packets: u64,
    pub reply_bytes: u64,
    /// With `--watch`: growth per second since the previous report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rates: Option<Rates>,
}

impl ServiceRow {
    fn counters(&self) -> [u64; 4] {
        [self.packets, self.bytes, self.new_flows, self.reply_packets]
    }
}

impl Watched for ServicesReport {
    fn set_rates(&mut self, earlier: &Self, seconds: f64) {
        for row in &mut self.services {
            if let Some(e) = earlier.services.iter().find(|e| e.service == row.service) {
                row.rates = Some(Rates::between(row.counters(), e.counters(), seconds));
            }
        }
    }
}

#[derive(Serialize)]
pub struct NewFlowLimitRow {
    pub per_second: u32,
    pub burst: u32,
    pub ipv4_prefix: u8,
    pub ipv6_prefix: u8,
}

/// The service's `new_flow_limit`, if it has one.
fn new_flow_limit(maps: &PinnedMaps, info: &ServiceInfo) -> Result<Option<NewFlowLimitRow>> {
    if info.flags & SERVICE_F_FLOW_LIMIT == 0 {
        return Ok(None);
    }
    let Some(limits) = maps.flow_limits()? else {
        return Ok(None);
    };
    let l = limits
        .get(&info.id, 0)
        .with_context(|| format!("reading {}[{}]", names::FLOW_LIMITS, info.id))?;
    Ok(Some(NewFlowLimitRow {
        per_second: l.per_second,
        burst: l.burst,
        ipv4_prefix: l.prefix_v4,
        ipv6_prefix: l.prefix_v6,
    }))
}

#[derive(Serialize)]
pub struct ServicesReport {
    pub services: Vec<ServiceRow>,
}

pub fn run(maps: &PinnedMaps, names: &Names) -> Result<ServicesReport> {
    let services = maps.services()?;
    let stats = maps.service_stats()?;
    let mut rows = Vec::new();
    for (key, info) in listed(&services)? {
        let a = service_arg(&key);
        let t = maps::traffic(&stats, info.id)
            .with_context(|| format!("reading {}[{}]", names::SERVICE_STATS, info.id))?;
        rows.push(ServiceRow {
            name: name_of(names, &key),
            service: a.to_string(),
            vip: a.vip,
            port: a.port,
            protocol: protocol_name(a.proto),
            mode: if is_snat(&info) { "snat" } else { "nat" },
            snat_addr: is_snat(&info).then(|| words_ip(&info.snat_addr, key.family)),
            affinity: affinity(&info),
            source_ranges: source_ranges(maps, &key, &info)?,
            new_flow_limit: new_flow_limit(maps, &info)?,
            service_id: info.id,
            table_size: info.table_size,
            backends: info.backend_count,
            packets: t.packets,
            bytes: t.bytes,
            new_flows: t.new_flows,
            reply_packets: t.reply_packets,
            reply_bytes: t.reply_bytes,
            rates: None,
        });
    }
    Ok(ServicesReport { services: rows })
}

impl Render for ServicesReport {
    fn human(&self) -> String {
        if self.services.is_empty() {
            return "no services\n".into();
        }
        let mut t = Table::new(&[
            ("NAME", Align::Left),
            ("VIP", Align::Left),
            ("PORT", Align::Right),
            ("PROTO", Align::Left),
            ("MODE", Align::Left),
            ("AFFINITY", Align::Left),
            ("SOURCES", Align::Left),
            ("NEW FLOW LIMIT", Align::Left),
            ("TABLE", Align::Right),
            ("BACKENDS", Align::Right),
            ("ID", Align::Right),
            ("PACKETS", Align::Right),
            ("BYTES", Align::Right),
            ("NEW FLOWS", Align::Right),
            ("REPLY PKTS", Align::Right),
        ]);
        let watched = self.services.iter().any(|s| s.rates.is_some());
        if watched {
            t = t.with_more(&[
                ("PKT/S", Align::Right),
                ("NEW/S", Align::Right),
                ("BYTES/S", Align::Right),
            ]);
        }
        for s in &self.services {
            let mode = match s.snat_addr {
                Some(a) => format!("snat {a}"),
                None => "nat".into(),
            };
            let mut row = vec![
                s.name.clone().unwrap_or_else(|| "-".into()),
                s.vip.to_string(),
                s.port.to_string(),
                s.protocol.clone(),
                mode,
                s.affinity.unwrap_or("-").to_string(),
                match &s.source_ranges {
                    None => "any".into(),
                    Some(r) if r.is_empty() => "none".into(),
                    Some(r) if r.len() <= 2 => r.join(","),
                    Some(r) => format!("{} ranges", r.len()),
                },
                match &s.new_flow_limit {
                    None => "-".into(),
                    Some(l) => {
                        let prefix = if s.vip.is_ipv4() {
                            l.ipv4_prefix
                        } else {
                            l.ipv6_prefix
                        };
                        format!("{}/s burst {} per /{prefix}", l.per_second, l.burst)
                    }
                },
                s.table_size.to_string(),
                s.backends.to_string(),
                s.service_id.to_string(),
                s.packets.to_string(),
                table::bytes(s.bytes),
                s.new_flows.to_string(),
                s.reply_packets.to_string(),
            ];
            if watched {
                row.extend(Rates::cells(s.rates.as_ref()));
            }
            t.row(row);
        }
        t.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{FAMILY_V6, PROTO_TCP, PROTO_UDP};

    #[test]
    fn parses_v4_and_v6_services() {
        let s: ServiceArg = "192.0.2.10:80/tcp".parse().unwrap();
        assert_eq!(s.vip, "192.0.2.10".parse::<IpAddr>().unwrap());
        assert_eq!((s.port, s.proto), (80, PROTO_TCP));
        let s: ServiceArg = "[2001:db8::10]:53/UDP".parse().unwrap();
        assert_eq!(s.vip, "2001:db8::10".parse::<IpAddr>().unwrap());
        assert_eq!((s.port, s.proto), (53, PROTO_UDP));
        assert_eq!(s.to_string(), "[2001:db8::10]:53/udp");
    }

    #[test]
    fn names_resolve_through_the_agents_names() {
        let v = |s: &str| s.parse::<IpAddr>().unwrap();
        let names = Names::from([
            ((v("192.0.2.10"), 80, "tcp".into()), "shop/web:http".into()),
            (
                (v("192.0.2.10"), 443, "tcp".into()),
                "shop/web:https".into(),
            ),
            ((v("192.0.2.11"), 53, "udp".into()), "kube/dns:dns".into()),
            ((v("192.0.2.12"), 80, "tcp".into()), "web".into()),
        ]);
        let resolve = |s: &str| s.parse::<ServiceRef>().unwrap().resolve(&names);
        let addr = |s: &str| s.parse::<ServiceArg>().unwrap();
        assert_eq!(
            resolve("shop/web:https").unwrap(),
            addr("192.0.2.10:443/tcp")
        );
        assert_eq!(resolve("kube/dns").unwrap(), addr("192.0.2.11:53/udp"));
        assert_eq!(resolve("web").unwrap(), addr("192.0.2.12:80/tcp"));
        assert_eq!(
            resolve("192.0.2.99:80/tcp").unwrap(),
            addr("192.0.2.99:80/tcp")
        );
        let several = resolve("shop/web").unwrap_err().to_string();
        assert!(
            several.contains("shop/web:http (192.0.2.10:80/tcp)"),
            "{several}"
        );
        assert!(resolve("shop/api")
            .unwrap_err()
            .to_string()
            .contains("no service named"));
        let no_agent = "shop/web:http"
            .parse::<ServiceRef>()
            .unwrap()
            .resolve(&Names::new());
        assert!(no_agent.unwrap_err().to_string().contains("did not answer"));
    }

    #[test]
    fn rejects_bad_services() {
        for bad in [
            "192.0.2.10:80",
            "192.0.2.10/tcp",
            "192.0.2.10:80/icmp",
            "2001:db8::10:80/tcp",
            "host:80/tcp",
            "192.0.2.10:99999/tcp",
        ] {
            assert!(bad.parse::<ServiceArg>().is_err(), "{bad} parsed");
        }
    }

    #[test]
    fn key_round_trips() {
        for s in ["192.0.2.10:8080/tcp", "[2001:db8::10]:443/udp"] {
            let a: ServiceArg = s.parse().unwrap();
            let k = a.key();
            assert_eq!(k.port, a.port.to_be());
            assert_eq!(service_name(&k), s);
        }
        let k = "[2001:db8::10]:443/udp"
            .parse::<ServiceArg>()
            .unwrap()
            .key();
        assert_eq!(k.family, FAMILY_V6);
    }
}
