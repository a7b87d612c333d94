//! `lbctl l2`: the VIPs this node answers ARP/NDP for (L2 mode), and on
//! which interfaces, with the MAC and whether the agent's deadline holds.

use anyhow::Result;
use lb_agent::maps::{self, PinnedMaps};
use serde::Serialize;

use crate::{
    table::{Align, Table},
    Render,
};

#[derive(Serialize)]
pub struct L2Vip {
    pub vip: String,
    pub ifindex: u32,
    pub interface: String,
}

#[derive(Serialize)]
pub struct L2Interface {
    pub ifindex: u32,
    pub interface: String,
    pub mac: String,
    /// The agent's deadline has not passed: the program answers.
    pub answering: bool,
    /// Milliseconds left (negative: passed).
    pub deadline_ms: i64,
}

#[derive(Serialize)]
pub struct L2Report {
    pub vips: Vec<L2Vip>,
    pub interfaces: Vec<L2Interface>,
}

fn ifname(index: u32) -> String {
    match lb_agent::sys::if_indextoname(index) {
        Some(name) => String::from_utf8_lossy(&name).into_owned(),
        None => format!("#{index}"),
    }
}

pub fn run(pins: &PinnedMaps) -> Result<L2Report> {
    let (Some(vips), Some(ifaces)) = (pins.l2_vips()?, pins.l2_ifaces()?) else {
        return Ok(L2Report {
            vips: Vec::new(),
            interfaces: Vec::new(),
        });
    };
    let now = maps::monotonic_now_ns() as i64;
    let mut interfaces = Vec::new();
    for item in ifaces.iter() {
        let (ifindex, v) = item?;
        let left = (v.valid_until_ns as i64 - now) / 1_000_000;
        interfaces.push(L2Interface {
            ifindex,
            interface: ifname(ifindex),
            mac: v
                .mac
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<Vec<_>>()
                .join(":"),
            answering: left > 0,
            deadline_ms: left,
        });
    }
    interfaces.sort_by_key(|i| i.ifindex);
    let vips = maps::l2_vips(&vips)?
        .into_iter()
        .map(|(vip, ifindex)| L2Vip {
            vip: vip.to_string(),
            ifindex,
            interface: ifname(ifindex),
        })
        .collect();
    Ok(L2Report { vips, interfaces })
}

impl Render for L2Report {
    fn human(&self) -> String {
        if self.interfaces.is_empty() {
            return "L2 mode is off here (no L2 interface in the maps)\n".into();
        }
        let mut t = Table::new(&[
            ("INTERFACE", Align::Left),
            ("MAC", Align::Left),
            ("ANSWERING", Align::Left),
        ]);
        for i in &self.interfaces {
            let state = if i.answering {
                format!("yes ({} ms left)", i.deadline_ms)
            } else {
                "no (the agent's deadline passed)".into()
            };
            t.row(vec![i.interface.clone(), i.mac.clone(), state]);
        }
        let mut s = t.render();
        s.push('\n');
        let mut t = Table::new(&[("OWNED VIP", Align::Left), ("INTERFACE", Align::Left)]);
        for v in &self.vips {
            t.row(vec![v.vip.clone(), v.interface.clone()]);
        }
        s.push_str(&t.render());
        s
    }
}
