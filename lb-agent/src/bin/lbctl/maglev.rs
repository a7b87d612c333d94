//! `lbctl maglev SERVICE`: a service's live Maglev table, backend by backend.

use std::{collections::BTreeMap, net::SocketAddr};

use anyhow::{anyhow, Context, Result};
use lb_agent::maps::{self, PinnedMaps};
use lb_common::net::words_socket;
use serde::Serialize;

use crate::{
    services::{Names, ServiceRef},
    table::{self, Align, Table},
    Render,
};

#[derive(clap::Args)]
pub struct Args {
    /// The service: VIP:PORT/PROTO (e.g. 192.0.2.10:80/tcp,
    /// [2001:db8::10]:80/tcp), or its name (e.g. shop/web:http).
    pub service: ServiceRef,
}

/// A backend's part of a table.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Share {
    pub backend_id: u32,
    pub entries: u32,
    /// Percentage of the table's entries.
    pub share_pct: f64,
}

/// Entries per backend id in `table`, by backend id.
pub fn shares(table: &[u32]) -> Vec<Share> {
    let mut counts: BTreeMap<u32, u32> = BTreeMap::new();
    for &id in table {
        *counts.entry(id).or_default() += 1;
    }
    let total = table.len().max(1) as f64;
    counts
        .into_iter()
        .map(|(backend_id, entries)| Share {
            backend_id,
            entries,
            share_pct: entries as f64 * 100.0 / total,
        })
        .collect()
}

#[derive(Serialize)]
pub struct MaglevBackend {
    pub backend_id: u32,
    pub address: SocketAddr,
    pub entries: u32,
    pub share_pct: f64,
}

#[derive(Serialize)]
pub struct MaglevReport {
    pub service: String,
    pub service_id: u32,
    pub table_size: u32,
    /// Which of the service's two tables is live (0 or 1).
    pub active: u32,
    /// Index in the MAGLEV pool of the live table's first entry.
    pub live_table_start: u32,
    pub backends: Vec<MaglevBackend>,
}

pub fn run(maps: &PinnedMaps, args: &Args, names: &Names) -> Result<MaglevReport> {
    let service = args.service.resolve(names)?;
    let services = maps.services()?;
    let key = service.key();
    let info = maps::service(&services, &key)
        .context("reading SERVICES")?
        .ok_or_else(|| anyhow!("no service {service} in SERVICES"))?;
    let table = maps.maglev()?.live_table(&info)?;
    let backends = maps.backends()?;
    let mut out = Vec::new();
    for s in shares(&table) {
        let b = backends
            .get(&s.backend_id, 0)
            .with_context(|| format!("reading BACKENDS[{}]", s.backend_id))?
            .backend;
        out.push(MaglevBackend {
            backend_id: s.backend_id,
            address: words_socket(&b.addr, b.port, b.family),
            entries: s.entries,
            share_pct: s.share_pct,
        });
    }
    Ok(MaglevReport {
        service: service.to_string(),
        service_id: info.id,
        table_size: info.table_size,
        active: info.active,
        live_table_start: info.table_base + info.active * info.table_size,
        backends: out,
    })
}

impl Render for MaglevReport {
    fn human(&self) -> String {
        let mut s = format!(
            "{} (id {}): table size {}, live table {} at MAGLEV[{}]\n",
            self.service, self.service_id, self.table_size, self.active, self.live_table_start
        );
        if self.backends.is_empty() {
            s.push_str("no backends in the table: new flows are dropped\n");
            return s;
        }
        let mut t = Table::new(&[
            ("BACKEND", Align::Left),
            ("ID", Align::Right),
            ("ENTRIES", Align::Right),
            ("SHARE", Align::Right),
        ]);
        for b in &self.backends {
            t.row(vec![
                b.address.to_string(),
                b.backend_id.to_string(),
                b.entries.to_string(),
                table::pct(b.share_pct),
            ]);
        }
        s.push_str(&t.render());
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_count_and_sum_to_100() {
        let table = [7, 3, 7, 7, 3, 9, 7];
        let s = shares(&table);
        assert_eq!(
            s.iter()
                .map(|x| (x.backend_id, x.entries))
                .collect::<Vec<_>>(),
            vec![(3, 2), (7, 4), (9, 1)]
        );
        let sum: f64 = s.iter().map(|x| x.share_pct).sum();
        assert!((sum - 100.0).abs() < 1e-9);
        assert!((s[1].share_pct - 400.0 / 7.0).abs() < 1e-9);
    }

    #[test]
    fn empty_table_has_no_shares() {
        assert!(shares(&[]).is_empty());
    }
}
