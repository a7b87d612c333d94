//! `lbctl conntrack`: the flow table (client flow -> backend), shared by
//! every CPU.

use std::net::{IpAddr, SocketAddr};

use anyhow::{Context, Result};
use lb_agent::maps::{self, PinnedMaps};
use lb_common::{
    net::{ip_words, protocol_name, words_socket, Family},
    Flow, FlowKey, ServiceKey, FLOW_F_CLOSED, FLOW_F_HANDED,
};
use serde::Serialize;

use crate::{
    services::{self, Names, ServiceRef},
    table::{self, Align, Table},
    Render,
};

#[derive(clap::Args)]
pub struct Args {
    /// Only flows to this service: VIP:PORT/PROTO, or its name.
    #[arg(long, value_name = "VIP:PORT/PROTO|NAME")]
    pub service: Option<ServiceRef>,
    /// Only flows sent to this backend, as IP:PORT ([IPv6]:PORT).
    #[arg(long, value_name = "IP:PORT")]
    pub backend: Option<SocketAddr>,
    /// Only flows from this client address.
    #[arg(long, value_name = "IP")]
    pub client: Option<IpAddr>,
    /// Show at most N entries (all matching entries are still counted).
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
}

/// Which entries to show, in the maps' representation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Filter {
    pub service: Option<ServiceKey>,
    /// Address words, network-order port, family.
    pub backend: Option<([u32; 4], u16, u8)>,
    pub client: Option<([u32; 4], u8)>,
}

impl Filter {
    pub fn from_args(args: &Args, names: &Names) -> Result<Self> {
        let service = args
            .service
            .as_ref()
            .map(|s| s.resolve(names))
            .transpose()?;
        Ok(Self {
            service: service.map(|s| s.key()),
            backend: args.backend.map(|b| {
                (
                    ip_words(b.ip()),
                    b.port().to_be(),
                    Family::of(b.ip()).number(),
                )
            }),
            client: args.client.map(|c| (ip_words(c), Family::of(c).number())),
        })
    }

    pub fn matches(&self, key: &FlowKey, flow: &Flow) -> bool {
        if let Some(s) = &self.service {
            if key.dst != s.addr
                || key.dport != s.port
                || key.proto != s.proto
                || key.family != s.family
            {
                return false;
            }
        }
        if let Some((addr, port, fam)) = &self.backend {
            if flow.backend_addr != *addr || flow.backend_port != *port || key.family != *fam {
                return false;
            }
        }
        if let Some((addr, fam)) = &self.client {
            if key.src != *addr || key.family != *fam {
                return false;
            }
        }
        true
    }
}

#[derive(Serialize)]
pub struct Entry {
    pub protocol: String,
    pub client: SocketAddr,
    pub vip: SocketAddr,
    pub backend: SocketAddr,
    pub backend_id: u32,
    pub service_id: u32,
    /// `client_ip` when the flow's service has session affinity: its
    /// backend was picked by the client address alone.
    pub affinity: Option<&'static str>,
    /// SNAT source port (host order); absent in NAT mode.
    pub snat_port: Option<u16>,
    /// SNAT source address and port: the service's SNAT address on the
    /// node that opened the flow (another node's for a flow it handed over).
    pub snat: Option<SocketAddr>,
    /// Another node opened the flow and handed it over (`flow_sync`).
    pub handed: bool,
    /// The client sent a FIN or RST (here, or on the node that handed it).
    pub closed: bool,
    /// Since the flow was created / since its timestamp was last refreshed
    /// (the data plane refreshes it at most once a second).
    pub age_ns: u64,
    pub idle_ns: u64,
}

pub fn entry(key: &FlowKey, flow: &Flow, now_ns: u64) -> Entry {
    Entry {
        protocol: protocol_name(key.proto),
        client: words_socket(&key.src, key.sport, key.family),
        vip: words_socket(&key.dst, key.dport, key.family),
        backend: words_socket(&flow.backend_addr, flow.backend_port, key.family),
        backend_id: flow.backend_id,
        service_id: flow.service_id,
        affinity: None,
        snat_port: (flow.snat_port != 0).then(|| u16::from_be(flow.snat_port)),
        snat: (flow.snat_port != 0)
            .then(|| words_socket(&flow.snat_addr, flow.snat_port, key.family)),
        handed: flow.flags & FLOW_F_HANDED != 0,
        closed: flow.flags & FLOW_F_CLOSED != 0,
        age_ns: now_ns.saturating_sub(flow.created_ns),
        idle_ns: now_ns.saturating_sub(flow.last_seen_ns),
    }
}

#[derive(Serialize)]
pub struct ConntrackReport {
    /// Entries that matched the filters.
    pub count: usize,
    /// Entries listed (fewer than `count` with --limit).
    pub shown: usize,
    pub entries: Vec<Entry>,
}

pub fn run(maps: &PinnedMaps, args: &Args, names: &Names) -> Result<ConntrackReport> {
    let map = maps.shared_flows()?;
    let filter = Filter::from_args(args, names)?;
    let now = maps::coarse_now_ns();
    let limit = args.limit.unwrap_or(usize::MAX);
    // Service id -> its affinity, from the live services.
    let affinity: std::collections::BTreeMap<u32, Option<&'static str>> =
        services::listed(&maps.services()?)?
            .into_iter()
            .map(|(_, info)| (info.id, services::affinity(&info)))
            .collect();
    let mut count = 0;
    let mut entries = Vec::new();
    for item in map.iter() {
        let (key, flow) = item.context("reading FLOWS")?;
        if !filter.matches(&key, &flow) {
            continue;
        }
        count += 1;
        if entries.len() < limit {
            let mut e = entry(&key, &flow, now);
            e.affinity = affinity.get(&flow.service_id).copied().flatten();
            entries.push(e);
        }
    }
    entries.sort_by_key(|a| (a.vip, a.client));
    Ok(ConntrackReport {
        count,
        shown: entries.len(),
        entries,
    })
}

impl Render for ConntrackReport {
    fn human(&self) -> String {
        let mut s = String::new();
        if !self.entries.is_empty() {
            let mut t = Table::new(&[
                ("PROTO", Align::Left),
                ("CLIENT", Align::Left),
                ("VIP", Align::Left),
                ("BACKEND", Align::Left),
                ("SNAT", Align::Left),
                ("AFFINITY", Align::Left),
                ("AGE", Align::Right),
                ("IDLE", Align::Right),
            ]);
            for e in &self.entries {
                t.row(vec![
                    e.protocol.clone(),
                    e.client.to_string(),
                    e.vip.to_string(),
                    e.backend.to_string(),
                    e.snat.map(|a| a.to_string()).unwrap_or_else(|| "-".into()),
                    e.affinity.unwrap_or("-").into(),
                    table::duration_ns(e.age_ns),
                    table::duration_ns(e.idle_ns),
                ]);
            }
            s.push_str(&t.render());
        }
        if self.shown < self.count {
            s.push_str(&format!(
                "{} of {} matching entries shown\n",
                self.shown, self.count
            ));
        } else {
            s.push_str(&format!(
                "{} entr{}\n",
                self.count,
                if self.count == 1 { "y" } else { "ies" }
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lb_common::{addr_from_v4, FAMILY_V4, PROTO_TCP};

    fn flow_key() -> FlowKey {
        FlowKey {
            src: addr_from_v4([198, 51, 100, 7]),
            dst: addr_from_v4([192, 0, 2, 10]),
            sport: 40000u16.to_be(),
            dport: 80u16.to_be(),
            proto: PROTO_TCP,
            family: FAMILY_V4,
            _pad: [0; 2],
        }
    }

    fn flow() -> Flow {
        Flow {
            backend_addr: addr_from_v4([10, 2, 0, 3]),
            backend_port: 8080u16.to_be(),
            snat_port: 0,
            backend_id: 4,
            service_id: 1,
            created_ns: 1_000_000_000,
            last_seen_ns: 3_000_000_000,
            ..Default::default()
        }
    }

    fn args() -> Args {
        Args {
            service: None,
            backend: None,
            client: None,
            limit: None,
        }
    }

    #[test]
    fn filters_match_each_field() {
        let (k, f) = (flow_key(), flow());
        assert!(Filter::from_args(&args(), &Names::new())
            .unwrap()
            .matches(&k, &f));
        let mut a = args();
        a.service = Some("192.0.2.10:80/tcp".parse().unwrap());
        assert!(Filter::from_args(&a, &Names::new())
            .unwrap()
            .matches(&k, &f));
        a.service = Some("192.0.2.10:80/udp".parse().unwrap());
        assert!(!Filter::from_args(&a, &Names::new())
            .unwrap()
            .matches(&k, &f));
        let mut a = args();
        a.backend = Some("10.2.0.3:8080".parse().unwrap());
        assert!(Filter::from_args(&a, &Names::new())
            .unwrap()
            .matches(&k, &f));
        a.backend = Some("10.2.0.3:8081".parse().unwrap());
        assert!(!Filter::from_args(&a, &Names::new())
            .unwrap()
            .matches(&k, &f));
        let mut a = args();
        a.client = Some("198.51.100.7".parse().unwrap());
        assert!(Filter::from_args(&a, &Names::new())
            .unwrap()
            .matches(&k, &f));
        a.client = Some("198.51.100.8".parse().unwrap());
        assert!(!Filter::from_args(&a, &Names::new())
            .unwrap()
            .matches(&k, &f));
    }

    #[test]
    fn entries_read_back_addresses_and_ages() {
        let e = entry(&flow_key(), &flow(), 5_000_000_000);
        assert_eq!(e.client.to_string(), "198.51.100.7:40000");
        assert_eq!(e.vip.to_string(), "192.0.2.10:80");
        assert_eq!(e.backend.to_string(), "10.2.0.3:8080");
        assert_eq!(e.snat_port, None);
        assert_eq!((e.age_ns, e.idle_ns), (4_000_000_000, 2_000_000_000));
        // A coarse clock may lag a timestamp taken just now: no underflow.
        let e = entry(&flow_key(), &flow(), 0);
        assert_eq!((e.age_ns, e.idle_ns), (0, 0));
        let mut f = flow();
        f.snat_port = 12345u16.to_be();
        f.snat_addr = addr_from_v4([10, 9, 0, 1]);
        let e = entry(&flow_key(), &f, 0);
        assert_eq!(e.snat_port, Some(12345));
        assert_eq!(e.snat, Some("10.9.0.1:12345".parse().unwrap()));
        assert!(!e.handed);
        assert!(!e.closed);
        f.flags = lb_common::FLOW_F_HANDED;
        assert!(entry(&flow_key(), &f, 0).handed);
        f.flags = lb_common::FLOW_F_CLOSED;
        assert!(entry(&flow_key(), &f, 0).closed);
    }
}
