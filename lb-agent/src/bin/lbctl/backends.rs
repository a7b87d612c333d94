//! `lbctl backends [SERVICE]`: the backends of each service's live table,
//! with their table share and traffic.

use std::net::SocketAddr;

use anyhow::{anyhow, Context, Result};
use lb_agent::maps::{self, PinnedMaps};
use lb_common::{map_names as names, net::words_socket};
use serde::Serialize;

use crate::{
    maglev::shares,
    services::{self, ServiceArg},
    table::{self, Align, Table},
    Render,
};

#[derive(clap::Args)]
pub struct Args {
    /// Only this service, as VIP:PORT/PROTO (e.g. 192.0.2.10:80/tcp).
    pub service: Option<ServiceArg>,
}

#[derive(Serialize)]
pub struct BackendRow {
    pub address: SocketAddr,
    pub backend_id: u32,
    pub entries: u32,
    pub share_pct: f64,
    pub packets: u64,
    pub bytes: u64,
    pub new_flows: u64,
    pub reply_packets: u64,
    pub reply_bytes: u64,
}

#[derive(Serialize)]
pub struct ServiceBackends {
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

pub fn run(maps: &PinnedMaps, args: &Args) -> Result<BackendsReport> {
    let services_map = maps.services()?;
    let list = match &args.service {
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
            rows.push(BackendRow {
                address: words_socket(&b.addr, b.port, b.family),
                backend_id: s.backend_id,
                entries: s.entries,
                share_pct: s.share_pct,
                packets: t.packets,
                bytes: t.bytes,
                new_flows: t.new_flows,
                reply_packets: t.reply_packets,
                reply_bytes: t.reply_bytes,
            });
        }
        rows.sort_by_key(|r| r.address);
        out.push(ServiceBackends {
            service: services::service_name(&key),
            service_id: info.id,
            mode: services::mode(&key, &info),
            table_size: info.table_size,
            backends: rows,
        });
    }
    Ok(BackendsReport { services: out })
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
            s.push_str(&format!(
                "{} (id {}, {}, table {})\n",
                svc.service, svc.service_id, svc.mode, svc.table_size
            ));
            if svc.backends.is_empty() {
                s.push_str("  no backends in the table: new flows are dropped\n");
                continue;
            }
            let mut t = Table::new(&[
                ("BACKEND", Align::Left),
                ("ID", Align::Right),
                ("SHARE", Align::Right),
                ("PACKETS", Align::Right),
                ("BYTES", Align::Right),
                ("NEW FLOWS", Align::Right),
                ("REPLY PKTS", Align::Right),
            ]);
            for b in &svc.backends {
                t.row(vec![
                    b.address.to_string(),
                    b.backend_id.to_string(),
                    table::pct(b.share_pct),
                    b.packets.to_string(),
                    table::bytes(b.bytes),
                    b.new_flows.to_string(),
                    b.reply_packets.to_string(),
                ]);
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
