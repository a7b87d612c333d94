//! `lbctl backends [SERVICE]`: every backend of each service with its
//! state, table share, open flows and traffic: those of the live Maglev
//! table from the maps, and those out of it that still carry flows
//! (draining, terminating, unhealthy) from the agent.

use std::{collections::BTreeMap, net::SocketAddr};

use anyhow::{anyhow, Context, Result};
use lb_agent::maps::{self, PinnedMaps};
use lb_common::{map_names as names, net::words_socket};
use serde::Serialize;

use crate::{
    agent::AgentBackend,
    maglev::shares,
    services::{self, ServiceRef},
    table::{self, Align, Table},
    watch::{Rates, Watched},
    Render,
};

#[derive(clap::Args)]
pub struct Args {
    /// Only this service: VIP:PORT/PROTO (e.g. 192.0.2.10:80/tcp), or its
    /// name (e.g. shop/web:http).
    pub service: Option<ServiceRef>,
}

#[derive(Serialize)]
pub struct BackendRow {
    pub address: SocketAddr,
    /// `active`, `draining` (weight 0), `terminating` (a Kubernetes
    /// endpoint shutting down) or `unhealthy` (failing its checks), as the
    /// agent says; `None` when it did not answer.
    pub state: Option<String>,
    /// `None`: out of the live table (no new flows), as the agent reports it.
    pub backend_id: Option<u32>,
    pub entries: u32,
    pub share_pct: f64,
    pub packets: u64,
    pub bytes: u64,
    pub new_flows: u64,
    pub reply_packets: u64,
    pub reply_bytes: u64,
    /// Flows opened minus flows their clients closed (the data plane's
    /// counters; flows that vanished without a FIN still count).
    pub open_flows: u64,
    /// Load-aware services: the controller's decision and its signals.
    pub load: Option<LoadRow>,
    /// With `--watch`: growth per second since the previous report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rates: Option<Rates>,
}

impl BackendRow {
    fn counters(&self) -> [u64; 4] {
        [self.packets, self.bytes, self.new_flows, self.reply_packets]
    }
}

impl Watched for BackendsReport {
    fn set_rates(&mut self, earlier: &Self, seconds: f64) {
        for svc in &mut self.services {
            let Some(e) = earlier.services.iter().find(|e| e.service == svc.service) else {
                continue;
            };
            for b in &mut svc.backends {
                if let Some(eb) = e.backends.iter().find(|eb| eb.address == b.address) {
                    b.rates = Some(Rates::between(b.counters(), eb.counters(), seconds));
                }
            }
        }
    }
}

#[derive(Serialize)]
pub struct LoadRow {
    pub weight: u32,
    pub factor: f64,
    pub pressure: f64,
    /// Open flows as the agent counts them (corrected by table walks).
    pub open_flows: u32,
    pub probe_latency_ms: Option<f64>,
    /// Its cgroup's CPU load (1: all of its limit; up to 2: held back as
    /// well); `None`: not a local backend with a known cgroup.
    pub cpu: Option<f64>,
    /// The agent check's answer: `75%`, `drain`, `down`; `None`: none.
    pub reported: Option<String>,
}

impl LoadRow {
    fn from(l: &lb_common::BackendLoad) -> Option<LoadRow> {
        if l.flags & lb_common::LOAD_F_SET == 0 {
            return None;
        }
        Some(LoadRow {
            weight: l.weight,
            factor: l.factor_milli as f64 / 1000.0,
            pressure: l.pressure_milli as f64 / 1000.0,
            open_flows: l.open_flows,
            probe_latency_ms: (l.latency_us != u32::MAX).then(|| l.latency_us as f64 / 1000.0),
            cpu: (l.cpu_milli != u32::MAX).then(|| l.cpu_milli as f64 / 1000.0),
            reported: match l.report {
                lb_common::LOAD_REPORT_PERCENT => Some(format!("{}%", l.report_pct)),
                lb_common::LOAD_REPORT_DRAIN => Some("drain".into()),
                lb_common::LOAD_REPORT_DOWN => Some("down".into()),
                _ => None,
            },
        })
    }
}

#[derive(Serialize)]
pub struct ServiceBackends {
    /// The agent's name of the service; `None` when it did not answer.
    pub name: Option<String>,
    pub service: String,
    pub service_id: u32,
    pub mode: String,
    pub table_size: u32,
    pub backends: Vec<BackendRow>,
}

#[derive(Serialize)]
pub struct BackendsReport {
    pub services: Vec<ServiceBackends>,
}

/// The backends of `args`' service (or every service) from the maps, and
/// from `agent` those out of the table.
pub fn run(
    maps: &PinnedMaps,
    args: &Args,
    names: &services::Names,
    agent: &BTreeMap<(String, SocketAddr), AgentBackend>,
) -> Result<BackendsReport> {
    let services_map = maps.services()?;
    let service = args
        .service
        .as_ref()
        .map(|s| s.resolve(names))
        .transpose()?;
    let list = match &service {
        Some(a) => {
            let info = maps::service(&services_map, &a.key())
                .context("reading SERVICES")?
                .ok_or_else(|| anyhow!("no service {a} in SERVICES"))?;
            vec![(a.key(), info)]
        }
        None => services::listed(&services_map)?,
    };
    let maglev = maps.maglev()?;
    let backends = maps.backends()?;
    let stats = maps.backend_stats()?;
    let closed = maps.backend_closed()?;
    let load = maps.backend_load()?;
    let mut out = Vec::new();
    for (key, info) in list {
        let table = maglev.live_table(&info)?;
        let mut rows = Vec::new();
        for s in shares(&table) {
            let b = backends
                .get(&s.backend_id, 0)
                .with_context(|| format!("reading BACKENDS[{}]", s.backend_id))?
                .backend;
            let t = maps::traffic(&stats, s.backend_id)
                .with_context(|| format!("reading {}[{}]", names::BACKEND_STATS, s.backend_id))?;
            let closed = match &closed {
                Some(m) => maps::flow_event(m, s.backend_id).with_context(|| {
                    format!("reading {}[{}]", names::BACKEND_CLOSED, s.backend_id)
                })?,
                None => 0,
            };
            let load = match &load {
                Some(m) => LoadRow::from(&m.get(&s.backend_id, 0).with_context(|| {
                    format!("reading {}[{}]", names::BACKEND_LOAD, s.backend_id)
                })?),
                None => None,
            };
            let address = words_socket(&b.addr, b.port, b.family);
            rows.push(BackendRow {
                address,
                state: None,
                backend_id: Some(s.backend_id),
                entries: s.entries,
                share_pct: s.share_pct,
                packets: t.packets,
                bytes: t.bytes,
                new_flows: t.new_flows,
                reply_packets: t.reply_packets,
                reply_bytes: t.reply_bytes,
                open_flows: t.new_flows.saturating_sub(closed),
                load,
                rates: None,
            });
        }
        let name = services::name_of(names, &key);
        if let Some(name) = &name {
            add_from_agent(&mut rows, name, agent);
        }
        rows.sort_by_key(|r| r.address);
        out.push(ServiceBackends {
            name,
            service: services::service_name(&key),
            service_id: info.id,
            mode: services::mode(&key, &info),
            table_size: info.table_size,
            backends: rows,
        });
    }
    Ok(BackendsReport { services: out })
}

/// The agent's states for the table's backends, and rows for those it has
/// out of the table: they take no new flows, their open ones go on.
fn add_from_agent(
    rows: &mut Vec<BackendRow>,
    service: &str,
    agent: &BTreeMap<(String, SocketAddr), AgentBackend>,
) {
    let range = (service.to_owned(), SocketAddr::from(([0; 4], 0)))..;
    let ours = agent.range(range).take_while(|((s, _), _)| s == service);
    for ((_, address), b) in ours {
        if let Some(row) = rows.iter_mut().find(|r| r.address == *address) {
            row.state = Some(b.state.clone());
            continue;
        }
        rows.push(BackendRow {
            address: *address,
            state: Some(b.state.clone()),
            backend_id: None,
            entries: 0,
            share_pct: 0.0,
            packets: b.packets,
            bytes: b.bytes,
            new_flows: b.new_flows,
            reply_packets: b.reply_packets,
            reply_bytes: b.reply_bytes,
            open_flows: b.new_flows.saturating_sub(b.closed_flows),
            load: None,
            rates: None,
        });
    }
}

impl Render for BackendsReport {
    fn human(&self) -> String {
        if self.services.is_empty() {
            return "no services\n".into();
        }
        let mut s = String::new();
        for (i, svc) in self.services.iter().enumerate() {
            if i > 0 {
                s.push('\n');
            }
            if let Some(name) = &svc.name {
                s.push_str(&format!("{name} "));
            }
            s.push_str(&format!(
                "{} (id {}, {}, table {})\n",
                svc.service, svc.service_id, svc.mode, svc.table_size
            ));
            if svc.backends.iter().all(|b| b.backend_id.is_none()) {
                s.push_str("  no backends in the table: new flows are dropped\n");
                if svc.backends.is_empty() {
                    continue;
                }
            }
            let load_aware = svc.backends.iter().any(|b| b.load.is_some());
            let mut columns = vec![
                ("BACKEND", Align::Left),
                ("STATE", Align::Left),
                ("ID", Align::Right),
                ("SHARE", Align::Right),
                ("PACKETS", Align::Right),
                ("BYTES", Align::Right),
                ("NEW FLOWS", Align::Right),
                ("OPEN", Align::Right),
                ("REPLY PKTS", Align::Right),
            ];
            if load_aware {
                columns.extend([
                    ("WEIGHT", Align::Right),
                    ("FACTOR", Align::Right),
                    ("PRESSURE", Align::Right),
                    ("PROBE", Align::Right),
                    ("CPU", Align::Right),
                    ("REPORT", Align::Left),
                ]);
            }
            let watched = svc.backends.iter().any(|b| b.rates.is_some());
            if watched {
                columns.extend([
                    ("PKT/S", Align::Right),
                    ("NEW/S", Align::Right),
                    ("BYTES/S", Align::Right),
                ]);
            }
            let mut t = Table::new(&columns);
            for b in &svc.backends {
                let mut row = vec![
                    b.address.to_string(),
                    b.state.clone().unwrap_or_else(|| "-".into()),
                    b.backend_id.map_or("-".into(), |id| id.to_string()),
                    table::pct(b.share_pct),
                    b.packets.to_string(),
                    table::bytes(b.bytes),
                    b.new_flows.to_string(),
                    b.open_flows.to_string(),
                    b.reply_packets.to_string(),
                ];
                if load_aware {
                    row.extend(load_cells(b.load.as_ref()));
                }
                if watched {
                    row.extend(Rates::cells(b.rates.as_ref()));
                }
                t.row(row);
            }
            for line in t.render().lines() {
                s.push_str("  ");
                s.push_str(line);
                s.push('\n');
            }
        }
        s
    }
}

/// The load-aware columns of one backend.
fn load_cells(l: Option<&LoadRow>) -> Vec<String> {
    let Some(l) = l else {
        return vec!["-".into(); 6];
    };
    vec![
        l.weight.to_string(),
        format!("{:.2}", l.factor),
        format!("{:.2}", l.pressure),
        l.probe_latency_ms
            .map_or("-".into(), |ms| format!("{ms:.1}ms")),
        l.cpu.map_or("-".into(), |c| format!("{c:.2}")),
        l.reported.clone().unwrap_or_else(|| "-".into()),
    ]
}
