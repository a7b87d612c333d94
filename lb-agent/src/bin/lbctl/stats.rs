//! `lbctl stats`: packets per verdict reason and CPU, and how evenly the
//! CPUs share the work.

use anyhow::{Context, Result};
use lb_agent::maps::{self, PinnedMaps};
use lb_common::{Reason, REASON_COUNT};
use serde::Serialize;

use crate::{
    table::{self, Align, Table},
    watch::Watched,
    Render,
};

/// Above this share of all packets on one CPU, RSS is probably off.
const SKEW_SHARE: f64 = 80.0;
/// Below this many packets the shares say nothing.
const SKEW_MIN_PACKETS: u64 = 1000;

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Skew {
    pub cpu: usize,
    pub share_pct: f64,
}

/// The CPU that processed more than 80% of the packets, when the machine
/// has more than one CPU and there were at least 1000 packets.
pub fn cpu_skew(per_cpu_packets: &[u64], machine_cpus: usize) -> Option<Skew> {
    let total: u64 = per_cpu_packets.iter().sum();
    if machine_cpus <= 1 || total < SKEW_MIN_PACKETS {
        return None;
    }
    let (cpu, &max) = per_cpu_packets.iter().enumerate().max_by_key(|(_, &n)| n)?;
    let share_pct = max as f64 * 100.0 / total as f64;
    (share_pct > SKEW_SHARE).then_some(Skew { cpu, share_pct })
}

pub fn skew_warning(s: &Skew) -> String {
    format!(
        "CPU {} handled {:.1}% of packets: the NIC's receive queues are probably \
         not spread over CPUs (check `ethtool -l` / RSS)",
        s.cpu, s.share_pct
    )
}

/// CPUs to show: the online ones, and any other that counted packets.
pub fn shown_cpus(per_cpu_packets: &[u64], online: Option<&[usize]>) -> Vec<usize> {
    (0..per_cpu_packets.len())
        .filter(|&c| online.is_none_or(|o| o.contains(&c)) || per_cpu_packets[c] != 0)
        .collect()
}

#[derive(Serialize)]
pub struct ReasonRow {
    pub reason: &'static str,
    /// Aligned with `StatsReport::cpus`.
    pub per_cpu: Vec<u64>,
    pub total: u64,
    /// With `--watch`: packets a second since the previous report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_second: Option<f64>,
}

#[derive(Serialize)]
pub struct CpuShare {
    pub cpu: usize,
    pub packets: u64,
    pub share_pct: f64,
}

#[derive(Serialize)]
pub struct StatsReport {
    /// CPU numbers of the `per_cpu` columns.
    pub cpus: Vec<usize>,
    pub reasons: Vec<ReasonRow>,
    pub total_packets: u64,
    /// TCP packets (not SYNs) whose flow was not in the flow table (evicted
    /// when it was full, or begun before this node saw it), re-picked by
    /// Maglev; `None` when the pinned maps predate the counter.
    pub flows_repicked: Option<u64>,
    /// Packets forwarded in flood mode without a flow-table entry; `None`
    /// when the pinned maps predate the counter.
    pub flows_untracked: Option<u64>,
    pub cpu_shares: Vec<CpuShare>,
    /// With `--watch`: all packets a second since the previous report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub packets_per_second: Option<f64>,
    /// The CPU that took most of the packets, when it took over 80% of them.
    pub skew: Option<Skew>,
    pub warning: Option<String>,
}

pub fn report(
    counts: &[[u64; REASON_COUNT as usize]],
    online: Option<&[usize]>,
    machine_cpus: usize,
) -> StatsReport {
    let per_cpu_packets: Vec<u64> = counts.iter().map(|c| c.iter().sum()).collect();
    let total: u64 = per_cpu_packets.iter().sum();
    let cpus = shown_cpus(&per_cpu_packets, online);
    let reasons = Reason::ALL
        .iter()
        .map(|&r| {
            let per_cpu: Vec<u64> = cpus.iter().map(|&c| counts[c][r as usize]).collect();
            ReasonRow {
                reason: r.name(),
                total: counts.iter().map(|c| c[r as usize]).sum(),
                per_cpu,
                per_second: None,
            }
        })
        .collect();
    let cpu_shares = cpus
        .iter()
        .map(|&cpu| CpuShare {
            cpu,
            packets: per_cpu_packets[cpu],
            share_pct: if total == 0 {
                0.0
            } else {
                per_cpu_packets[cpu] as f64 * 100.0 / total as f64
            },
        })
        .collect();
    let skew = cpu_skew(&per_cpu_packets, machine_cpus);
    StatsReport {
        cpus,
        reasons,
        total_packets: total,
        flows_repicked: None,
        flows_untracked: None,
        cpu_shares,
        packets_per_second: None,
        warning: skew.as_ref().map(skew_warning),
        skew,
    }
}

pub fn run(maps: &PinnedMaps) -> Result<StatsReport> {
    let counts =
        maps::reason_counts_per_cpu(&maps.reason_stats()?).context("reading REASON_STATS")?;
    let online = maps::online_cpus();
    let machine_cpus = online.as_ref().map_or(counts.len(), Vec::len);
    let mut r = report(&counts, online.as_deref(), machine_cpus);
    if let Some(m) = maps.flow_events()? {
        r.flows_repicked = Some(
            maps::flow_event(&m, lb_common::FLOW_EVENT_REPICKED).context("reading FLOW_EVENTS")?,
        );
        // Pins of a version before flood mode have no slot for it.
        r.flows_untracked = maps::flow_event(&m, lb_common::FLOW_EVENT_UNTRACKED).ok();
    }
    Ok(r)
}

impl Watched for StatsReport {
    fn set_rates(&mut self, earlier: &Self, seconds: f64) {
        let rate = |now: u64, before: u64| now.checked_sub(before).unwrap_or(now) as f64 / seconds;
        for r in &mut self.reasons {
            if let Some(e) = earlier.reasons.iter().find(|e| e.reason == r.reason) {
                r.per_second = Some(rate(r.total, e.total));
            }
        }
        self.packets_per_second = Some(rate(self.total_packets, earlier.total_packets));
    }
}

impl Render for StatsReport {
    fn human(&self) -> String {
        let mut headers = vec![("REASON".to_string(), Align::Left)];
        headers.extend(self.cpus.iter().map(|c| (format!("CPU{c}"), Align::Right)));
        headers.push(("TOTAL".into(), Align::Right));
        let watched = self.packets_per_second.is_some();
        if watched {
            headers.push(("PER S".into(), Align::Right));
        }
        let mut t = Table::with_columns(headers);
        for r in &self.reasons {
            let mut row = vec![r.reason.to_string()];
            row.extend(r.per_cpu.iter().map(u64::to_string));
            row.push(r.total.to_string());
            if watched {
                row.push(r.per_second.map_or("-".into(), |p| format!("{p:.0}")));
            }
            t.row(row);
        }
        let mut s = t.render();
        s.push('\n');
        let mut t = Table::new(&[
            ("CPU", Align::Right),
            ("PACKETS", Align::Right),
            ("SHARE", Align::Right),
        ]);
        for c in &self.cpu_shares {
            t.row(vec![
                c.cpu.to_string(),
                c.packets.to_string(),
                table::pct(c.share_pct),
            ]);
        }
        s.push_str(&t.render());
        s.push_str(&format!("total packets: {}", self.total_packets));
        match self.packets_per_second {
            Some(p) => s.push_str(&format!(" ({p:.0} a second)\n")),
            None => s.push('\n'),
        }
        if let Some(n) = self.flows_repicked {
            s.push_str(&format!(
                "flows re-picked (TCP mid-connection, not in the flow table): {n}\n"
            ));
        }
        if let Some(n) = self.flows_untracked.filter(|n| *n > 0) {
            s.push_str(&format!(
                "packets forwarded untracked (flood mode, no flow-table entry): {n}\n"
            ));
        }
        if let Some(w) = &self.warning {
            s.push_str(&format!("WARNING: {w}\n"));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skew_needs_many_cpus_many_packets_and_over_80_percent() {
        let s = cpu_skew(&[50, 950], 2).unwrap();
        assert_eq!(s.cpu, 1);
        assert!((s.share_pct - 95.0).abs() < 1e-9);
        assert_eq!(cpu_skew(&[50, 950], 1), None, "one CPU");
        assert_eq!(cpu_skew(&[5, 95], 2), None, "too few packets");
        assert_eq!(cpu_skew(&[200, 800], 2), None, "exactly 80% is not over");
        assert_eq!(cpu_skew(&[500, 500], 2), None);
        assert_eq!(cpu_skew(&[], 4), None);
        assert!(cpu_skew(&[0, 0, 1000, 0], 4).is_some());
    }

    #[test]
    fn warning_text() {
        let w = skew_warning(&Skew {
            cpu: 3,
            share_pct: 97.24,
        });
        assert_eq!(
            w,
            "CPU 3 handled 97.2% of packets: the NIC's receive queues are probably not \
             spread over CPUs (check `ethtool -l` / RSS)"
        );
    }

    #[test]
    fn report_sums_and_shares() {
        let mut counts = vec![[0u64; REASON_COUNT as usize]; 4];
        counts[0][Reason::Tx as usize] = 900;
        counts[0][Reason::PassNotIp as usize] = 100;
        counts[3][Reason::Tx as usize] = 100; // offline CPU that counted
        let r = report(&counts, Some(&[0, 1]), 2);
        assert_eq!(r.cpus, vec![0, 1, 3]);
        assert_eq!(r.total_packets, 1100);
        let tx = r.reasons.iter().find(|x| x.reason == "tx").unwrap();
        assert_eq!((tx.per_cpu.clone(), tx.total), (vec![900, 0, 100], 1000));
        let shares: f64 = r.cpu_shares.iter().map(|c| c.share_pct).sum();
        assert!((shares - 100.0).abs() < 1e-9);
        assert_eq!(r.skew.map(|s| s.cpu), Some(0));
        assert!(r
            .warning
            .unwrap()
            .starts_with("CPU 0 handled 90.9% of packets"));
    }

    #[test]
    fn empty_counters_have_no_warning() {
        let counts = vec![[0u64; REASON_COUNT as usize]; 2];
        let r = report(&counts, None, 2);
        assert_eq!(r.cpus, vec![0, 1]);
        assert!(r.warning.is_none());
        assert!(r.cpu_shares.iter().all(|c| c.share_pct == 0.0));
    }
}
