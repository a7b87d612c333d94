//! `--watch SECONDS`: a report again every interval, with rates per second
//! from the counters' growth since the previous one. Text on a terminal
//! redraws the screen; `--json` prints one document per line.

use std::{
    io::{IsTerminal, Write},
    process::ExitCode,
    time::{Duration, Instant},
};

use anyhow::Result;
use serde::Serialize;

use crate::Render;

/// Counter growth per second, as a report shows it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Rates {
    pub packets_per_second: f64,
    pub bytes_per_second: f64,
    pub new_flows_per_second: f64,
    pub reply_packets_per_second: f64,
}

impl Rates {
    /// From `(packets, bytes, new flows, reply packets)` now and before. A
    /// counter that went down (the service was replaced) counts from 0.
    pub fn between(now: [u64; 4], before: [u64; 4], seconds: f64) -> Rates {
        let r = |i: usize| {
            let grown = now[i].checked_sub(before[i]).unwrap_or(now[i]);
            grown as f64 / seconds
        };
        Rates {
            packets_per_second: r(0),
            bytes_per_second: r(1),
            new_flows_per_second: r(2),
            reply_packets_per_second: r(3),
        }
    }

    /// PKT/S, NEW/S and BYTES/S cells; dashes before the first interval.
    pub fn cells(rates: Option<&Rates>) -> Vec<String> {
        match rates {
            None => vec!["-".into(); 3],
            Some(r) => vec![
                format!("{:.0}", r.packets_per_second),
                format!("{:.0}", r.new_flows_per_second),
                format!("{}/s", crate::table::bytes(r.bytes_per_second as u64)),
            ],
        }
    }
}

/// A report whose counters become rates against an earlier one.
pub trait Watched: Render + Sized {
    fn set_rates(&mut self, earlier: &Self, seconds: f64);
}

/// Prints `make()`'s report every `every`, `count` times (forever without).
pub fn run<R: Watched>(
    json: bool,
    every: Duration,
    count: Option<u64>,
    mut make: impl FnMut() -> Result<R>,
) -> Result<ExitCode> {
    let mut out = std::io::stdout().lock();
    let redraw = !json && out.is_terminal();
    let mut earlier: Option<(Instant, R)> = None;
    let mut shown = 0u64;
    loop {
        let at = Instant::now();
        let mut report = make()?;
        if let Some((t, e)) = &earlier {
            report.set_rates(e, at.duration_since(*t).as_secs_f64());
        }
        if json {
            serde_json::to_writer(&mut out, &report)?;
            writeln!(out)?;
        } else if redraw {
            write!(out, "\x1b[H\x1b[2J{}", report.human())?;
        } else {
            if shown > 0 {
                writeln!(out)?;
            }
            write!(out, "{}", report.human())?;
        }
        out.flush()?;
        shown += 1;
        if count.is_some_and(|c| shown >= c) {
            return Ok(ExitCode::from(report.exit_code()));
        }
        earlier = Some((at, report));
        std::thread::sleep(every.saturating_sub(at.elapsed()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_growth_per_second_and_survive_a_reset() {
        let r = Rates::between([300, 3000, 30, 200], [100, 1000, 10, 0], 2.0);
        assert_eq!(
            r,
            Rates {
                packets_per_second: 100.0,
                bytes_per_second: 1000.0,
                new_flows_per_second: 10.0,
                reply_packets_per_second: 100.0,
            }
        );
        // A counter that restarted (a replaced service) counts from 0.
        assert_eq!(
            Rates::between([5, 0, 0, 0], [100, 0, 0, 0], 1.0).packets_per_second,
            5.0
        );
        assert_eq!(Rates::cells(None), vec!["-", "-", "-"]);
    }
}
