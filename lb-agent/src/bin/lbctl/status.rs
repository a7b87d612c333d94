//! `lbctl status`: the agent itself, from its `/metrics`: ready or not, the
//! Kubernetes API, BGP sessions, the allocator's Lease, the L2 VIPs it
//! answers for, its flow-sync peers and their last exchange, the config.

use std::{collections::BTreeMap, fmt::Write as _, net::SocketAddr};

use anyhow::Result;
use serde::Serialize;

use crate::{
    agent::{age, family, scrape, value, Sample},
    table::{Align, Table},
    Render,
};

#[derive(Serialize)]
pub struct StatusReport {
    /// The metrics address read.
    pub agent: SocketAddr,
    /// Whether the agent says it is ready (`/readyz`).
    pub ready: bool,
    /// `None` without a `kubernetes` section.
    pub kubernetes_api_up: Option<bool>,
    /// Whether this agent holds the allocator's Lease; `None`: it does not
    /// take part (no `kubernetes` section, or `allocate_addresses: false`).
    pub allocator_leader: Option<bool>,
    /// `None` without a `bgp` section.
    pub bgp: Option<Bgp>,
    /// `None` without an `l2` section.
    pub l2: Option<L2>,
    /// The flow exchange's peers this agent has pushed to or pulled from.
    pub flow_sync: Vec<FlowSyncPeer>,
    pub conntrack_entries: Option<u64>,
    pub conntrack_capacity: Option<u64>,
    /// Seconds since the config was last reloaded; `None`: not since the
    /// agent started.
    pub config_reloaded_seconds_ago: Option<f64>,
    pub config_reload_errors: u64,
}

#[derive(Serialize)]
pub struct Bgp {
    pub announced_prefixes: u64,
    pub peers: Vec<BgpPeer>,
}

#[derive(Serialize)]
pub struct BgpPeer {
    pub peer: String,
    pub up: bool,
    /// Seconds the session has been established (0 while it is not).
    pub uptime_seconds: Option<u64>,
    /// Prefixes the speaker sends the peer; `None` while the session is
    /// down or the speaker cannot be asked.
    pub prefixes_sent: Option<u64>,
}

#[derive(Serialize)]
pub struct L2 {
    pub members: u64,
    pub quorum: bool,
    /// The VIPs this node answers ARP/NDP for.
    pub owned: Vec<String>,
}

#[derive(Serialize)]
pub struct FlowSyncPeer {
    pub peer: String,
    /// Seconds since a push or pull last succeeded; `None`: never.
    pub last_exchange_seconds_ago: Option<f64>,
    pub ok: u64,
    pub errors: u64,
}

pub fn run(addr: SocketAddr) -> Result<StatusReport> {
    Ok(report(addr, &scrape(addr)?))
}

fn report(agent: SocketAddr, all: &[Sample]) -> StatusReport {
    let flag = |name: &str| value(all, name).map(|v| v == 1.0);
    let count = |name: &str| value(all, name).map(|v| v as u64);
    let bgp = value(all, "xlb_bgp_announced_prefixes").map(|n| Bgp {
        announced_prefixes: n as u64,
        peers: family(all, "xlb_bgp_peer_up")
            .map(|s| {
                let peer = s.label("peer");
                let of = |name: &str| {
                    family(all, name)
                        .find(|p| p.label("peer") == peer)
                        .map(|p| p.value as u64)
                };
                BgpPeer {
                    peer: peer.to_string(),
                    up: s.value == 1.0,
                    uptime_seconds: of("xlb_bgp_peer_uptime_seconds"),
                    prefixes_sent: of("xlb_bgp_peer_prefixes_sent"),
                }
            })
            .collect(),
    });
    let l2 = value(all, "xlb_l2_members").map(|members| L2 {
        members: members as u64,
        quorum: flag("xlb_l2_quorum") == Some(true),
        owned: family(all, "xlb_l2_vip_owned")
            .filter(|s| s.value == 1.0)
            .map(|s| s.label("vip").to_string())
            .collect(),
    });
    let mut peers: BTreeMap<String, FlowSyncPeer> = BTreeMap::new();
    fn peer<'a>(peers: &'a mut BTreeMap<String, FlowSyncPeer>, name: &str) -> &'a mut FlowSyncPeer {
        peers
            .entry(name.to_string())
            .or_insert_with(|| FlowSyncPeer {
                peer: name.to_string(),
                last_exchange_seconds_ago: None,
                ok: 0,
                errors: 0,
            })
    }
    for s in family(all, "xlb_flow_sync_exchanges_total") {
        let p = peer(&mut peers, s.label("peer"));
        match s.label("result") {
            "ok" => p.ok = s.value as u64,
            _ => p.errors = s.value as u64,
        }
    }
    for s in family(all, "xlb_flow_sync_last_exchange_timestamp_seconds") {
        peer(&mut peers, s.label("peer")).last_exchange_seconds_ago = Some(age(s.value));
    }
    StatusReport {
        agent,
        ready: flag("xlb_agent_ready") == Some(true),
        kubernetes_api_up: flag("xlb_kubernetes_api_up"),
        allocator_leader: flag("xlb_allocator_leader"),
        bgp,
        l2,
        flow_sync: peers.into_values().collect(),
        conntrack_entries: count("xlb_conntrack_entries"),
        conntrack_capacity: count("xlb_conntrack_capacity"),
        // 0: not reloaded since the agent started.
        config_reloaded_seconds_ago: value(all, "xlb_config_last_reload_success_timestamp_seconds")
            .filter(|t| *t > 0.0)
            .map(age),
        config_reload_errors: family(all, "xlb_config_reloads_total")
            .filter(|s| s.label("result") == "error")
            .map(|s| s.value as u64)
            .sum(),
    }
}

fn seconds(s: f64) -> String {
    if s < 60.0 {
        format!("{s:.1} s ago")
    } else if s < 3600.0 {
        format!("{:.0} min ago", s / 60.0)
    } else {
        format!("{:.1} h ago", s / 3600.0)
    }
}

/// A session's age: `42 s`, `17 min`, `5.5 h`, `3.2 d`.
fn span(s: u64) -> String {
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min", s / 60),
        3600..86_400 => format!("{:.1} h", s as f64 / 3600.0),
        _ => format!("{:.1} d", s as f64 / 86_400.0),
    }
}

fn yes(b: bool, yes: &str, no: &str) -> String {
    if b { yes } else { no }.to_string()
}

impl Render for StatusReport {
    fn human(&self) -> String {
        let mut out = String::new();
        let mut line = |k: &str, v: String| {
            let _ = writeln!(out, "{k:<14}{v}");
        };
        line(
            "agent",
            format!("{} {}", self.agent, yes(self.ready, "ready", "NOT READY")),
        );
        if let Some(up) = self.kubernetes_api_up {
            line("kubernetes", yes(up, "API reachable", "API UNREACHABLE"));
        }
        if let Some(l) = self.allocator_leader {
            line(
                "allocator",
                yes(l, "leading (hands out addresses)", "not leading"),
            );
        }
        if let Some(b) = &self.bgp {
            let up = b.peers.iter().filter(|p| p.up).count();
            line(
                "bgp",
                format!(
                    "{} prefixes announced, {up} of {} sessions up",
                    b.announced_prefixes,
                    b.peers.len()
                ),
            );
        }
        if let Some(l) = &self.l2 {
            line(
                "l2",
                format!(
                    "{} members, {}, answers for {}",
                    l.members,
                    yes(l.quorum, "quorum", "NO QUORUM (answers for nothing)"),
                    if l.owned.is_empty() {
                        "no VIP".to_string()
                    } else {
                        l.owned.join(", ")
                    }
                ),
            );
        }
        if let (Some(n), Some(cap)) = (self.conntrack_entries, self.conntrack_capacity) {
            line("flows", format!("{n} of {cap}"));
        }
        let reloaded = self
            .config_reloaded_seconds_ago
            .map_or("not reloaded since the start".into(), |ago| {
                format!("reloaded {}", seconds(ago))
            });
        line(
            "config",
            format!("{reloaded}, {} reload errors", self.config_reload_errors),
        );
        if let Some(b) = self.bgp.as_ref().filter(|b| !b.peers.is_empty()) {
            let mut t = Table::new(&[
                ("BGP PEER", Align::Left),
                ("SESSION", Align::Left),
                ("UP FOR", Align::Right),
                ("PREFIXES SENT", Align::Right),
            ]);
            for p in &b.peers {
                let up_for = match p.uptime_seconds {
                    Some(s) if p.up => span(s),
                    _ => "-".into(),
                };
                t.row(vec![
                    p.peer.clone(),
                    yes(p.up, "up", "DOWN"),
                    up_for,
                    p.prefixes_sent.map_or("-".into(), |n| n.to_string()),
                ]);
            }
            out.push('\n');
            out.push_str(&t.render());
        }
        if !self.flow_sync.is_empty() {
            let mut t = Table::new(&[
                ("FLOW-SYNC PEER", Align::Left),
                ("LAST EXCHANGE", Align::Left),
                ("OK", Align::Right),
                ("ERRORS", Align::Right),
            ]);
            for p in &self.flow_sync {
                t.row(vec![
                    p.peer.clone(),
                    p.last_exchange_seconds_ago.map_or("never".into(), seconds),
                    p.ok.to_string(),
                    p.errors.to_string(),
                ]);
            }
            out.push('\n');
            out.push_str(&t.render());
        }
        out
    }

    /// 0 when the agent is ready, 4 when it answered but is not.
    fn exit_code(&self) -> u8 {
        if self.ready {
            0
        } else {
            4
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::parse;

    #[test]
    fn reads_the_agents_state_from_its_series() {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let text = format!(
            "xlb_agent_ready 1\n\
             xlb_allocator_leader 0\n\
             xlb_l2_members 3\nxlb_l2_quorum 1\n\
             xlb_l2_vip_owned{{vip=\"10.0.0.200\"}} 1\nxlb_l2_vip_owned{{vip=\"10.0.0.201\"}} 0\n\
             xlb_flow_sync_exchanges_total{{peer=\"10.0.0.12:7947\",result=\"ok\"}} 7\n\
             xlb_flow_sync_exchanges_total{{peer=\"10.0.0.12:7947\",result=\"error\"}} 2\n\
             xlb_flow_sync_exchanges_total{{peer=\"10.0.0.13:7947\",result=\"error\"}} 5\n\
             xlb_flow_sync_last_exchange_timestamp_seconds{{peer=\"10.0.0.12:7947\"}} {}\n",
            now - 2.0
        );
        let r = report("10.0.0.11:9469".parse().unwrap(), &parse(&text));
        assert!(r.ready && r.allocator_leader == Some(false) && r.bgp.is_none());
        let l2 = r.l2.as_ref().unwrap();
        assert_eq!((l2.members, l2.quorum), (3, true));
        assert_eq!(l2.owned, vec!["10.0.0.200".to_string()]);
        assert_eq!(r.flow_sync.len(), 2);
        let (a, b) = (&r.flow_sync[0], &r.flow_sync[1]);
        assert_eq!((a.ok, a.errors), (7, 2));
        assert!(a.last_exchange_seconds_ago.unwrap() >= 2.0);
        assert_eq!((b.ok, b.errors, b.last_exchange_seconds_ago), (0, 5, None));
        assert_eq!(r.exit_code(), 0);
        let human = r.human();
        assert!(human.contains("answers for 10.0.0.200\n"), "{human}");
        assert!(human.contains("never"), "{human}");
    }

    #[test]
    fn bgp_sessions_show_their_uptime_and_prefixes_sent() {
        let text = "xlb_agent_ready 1\nxlb_bgp_announced_prefixes 3\n\
                    xlb_bgp_peer_up{peer=\"10.0.0.254\"} 1\n\
                    xlb_bgp_peer_up{peer=\"fd00::fe\"} 0\n\
                    xlb_bgp_peer_uptime_seconds{peer=\"10.0.0.254\"} 5400\n\
                    xlb_bgp_peer_uptime_seconds{peer=\"fd00::fe\"} 0\n\
                    xlb_bgp_peer_prefixes_sent{peer=\"10.0.0.254\"} 3\n";
        let r = report("10.0.0.11:9469".parse().unwrap(), &parse(text));
        let bgp = r.bgp.as_ref().unwrap();
        let (up, down) = (&bgp.peers[0], &bgp.peers[1]);
        assert_eq!(
            (up.up, up.uptime_seconds, up.prefixes_sent),
            (true, Some(5400), Some(3))
        );
        assert_eq!((down.up, down.prefixes_sent), (false, None));
        let human = r.human();
        assert!(human.contains("1 of 2 sessions up"), "{human}");
        let row = |peer: &str| {
            human
                .lines()
                .find(|l| l.starts_with(peer))
                .unwrap_or_else(|| panic!("{peer}: {human}"))
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(row("10.0.0.254"), "10.0.0.254 up 1.5 h 3");
        assert_eq!(row("fd00::fe"), "fd00::fe DOWN - -");
    }

    #[test]
    fn an_agent_not_ready_exits_4_and_says_so() {
        let r = report(
            "10.0.0.11:9469".parse().unwrap(),
            &parse("xlb_agent_ready 0\nxlb_kubernetes_api_up 0\n"),
        );
        assert_eq!((r.ready, r.kubernetes_api_up), (false, Some(false)));
        assert_eq!(r.exit_code(), 4);
        let human = r.human();
        assert!(
            human.contains("NOT READY") && human.contains("API UNREACHABLE"),
            "{human}"
        );
    }
}
