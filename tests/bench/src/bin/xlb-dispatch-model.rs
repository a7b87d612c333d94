//! A model of the load-aware benchmark's initialization pattern, to compare
//! per-connection dispatch policies without the noise of a real run: three
//! backends, each held to 30 % of a core by a CFS quota (runs at full speed
//! until its 30 ms of each 100 ms period are used), 4 workers sharing the
//! CPU and 4 queued requests (the next is refused), a tenth of the requests
//! 40 ms of CPU and the rest 2 ms, Poisson arrivals at 70 % of capacity.
//! It is what `xlb-work-server` under its quota does, without the network.
//!
//! `cargo run --release -p xlb-bench --bin xlb-dispatch-model -- [--seconds S] [--seeds N]`

use std::collections::VecDeque;

use clap::Parser;

const BACKENDS: usize = 3;
const WORKERS: usize = 4;
const QUEUED: usize = 4;
const QUOTA_SHARE: f64 = 0.3;
const PERIOD_S: f64 = 0.1;
const CHEAP_S: f64 = 0.002;
const COSTLY_S: f64 = 0.040;
const COSTLY_SHARE: f64 = 0.1;
const LOAD: f64 = 0.7;
const STEP_S: f64 = 0.0005;

/// splitmix64: a fixed seed gives the same arrivals to every policy.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Clone, Copy)]
enum Policy {
    /// One weighted draw: static weights.
    OneDraw,
    /// The less loaded of two distinct candidates (the second drawn up to
    /// three times while it is the first).
    TwoChoices,
    /// The least loaded of all three (what xlb does with three backends).
    ThreeChoices,
    /// As three, but each open flow also counts its age over this many
    /// seconds.
    AgeWeighted(f64),
}

impl Policy {
    fn name(self) -> String {
        match self {
            Policy::OneDraw => "one Maglev draw (static weights)".into(),
            Policy::TwoChoices => "less loaded of two distinct candidates".into(),
            Policy::ThreeChoices => "least loaded of all three".into(),
            Policy::AgeWeighted(tau) => format!(
                "least loaded of three, {} ms of age counting as a flow",
                tau * 1000.0
            ),
        }
    }
}

struct Job {
    left_s: f64,
    arrived_s: f64,
}

#[derive(Default)]
struct Backend {
    running: Vec<Job>,
    queued: VecDeque<Job>,
    period: u64,
    used_s: f64,
}

impl Backend {
    fn open(&self) -> usize {
        self.running.len() + self.queued.len()
    }
    fn load(&self, now: f64, policy: Policy) -> f64 {
        let count = self.open() as f64;
        match policy {
            Policy::AgeWeighted(tau) => {
                let age: f64 = self
                    .running
                    .iter()
                    .chain(&self.queued)
                    .map(|j| now - j.arrived_s)
                    .sum();
                count + age / tau
            }
            _ => count,
        }
    }
    /// Runs one step: full speed while the period's quota lasts, shared
    /// equally by the running jobs; returns the latencies of those done.
    fn serve(&mut self, now: f64, done: &mut Vec<f64>) {
        let period = (now / PERIOD_S) as u64;
        if period != self.period {
            (self.period, self.used_s) = (period, 0.0);
        }
        if self.running.is_empty() || self.used_s >= QUOTA_SHARE * PERIOD_S {
            return;
        }
        self.used_s += STEP_S;
        let share = STEP_S / self.running.len() as f64;
        let mut i = 0;
        while i < self.running.len() {
            self.running[i].left_s -= share;
            if self.running[i].left_s <= 0.0 {
                let job = self.running.swap_remove(i);
                done.push(now + STEP_S - job.arrived_s);
            } else {
                i += 1;
            }
        }
        while self.running.len() < WORKERS {
            let Some(next) = self.queued.pop_front() else {
                break;
            };
            self.running.push(next);
        }
    }
}

fn choose(policy: Policy, backends: &[Backend], now: f64, rng: &mut Rng) -> usize {
    let first = rng.below(BACKENDS);
    let load = |k: usize| backends[k].load(now, policy);
    match policy {
        Policy::OneDraw => first,
        Policy::TwoChoices => {
            let mut second = rng.below(BACKENDS);
            for _ in 0..2 {
                if second != first {
                    break;
                }
                second = rng.below(BACKENDS);
            }
            if load(second) < load(first) {
                second
            } else {
                first
            }
        }
        Policy::ThreeChoices | Policy::AgeWeighted(_) => {
            (0..BACKENDS).fold(first, |best, k| if load(k) < load(best) { k } else { best })
        }
    }
}

/// One run: (requests, refused, p99 latency in ms).
fn run(policy: Policy, seed: u64, seconds: f64) -> (usize, usize, f64) {
    let mut rng = Rng(seed);
    let mean_cost = COSTLY_SHARE * COSTLY_S + (1.0 - COSTLY_SHARE) * CHEAP_S;
    let rate = LOAD * BACKENDS as f64 * QUOTA_SHARE / mean_cost;
    let mut backends: Vec<Backend> = (0..BACKENDS).map(|_| Backend::default()).collect();
    let (mut sent, mut refused, mut latencies) = (0, 0, Vec::new());
    let mut next_arrival = -rng.unit().ln() / rate;
    let mut now = 0.0;
    while now < seconds {
        while next_arrival < now + STEP_S {
            sent += 1;
            let cost = if rng.unit() < COSTLY_SHARE {
                COSTLY_S
            } else {
                CHEAP_S
            };
            let k = choose(policy, &backends, next_arrival, &mut rng);
            let b = &mut backends[k];
            let job = Job {
                left_s: cost,
                arrived_s: next_arrival,
            };
            if b.open() >= WORKERS + QUEUED {
                refused += 1;
            } else if b.running.len() < WORKERS {
                b.running.push(job);
            } else {
                b.queued.push_back(job);
            }
            next_arrival += -rng.unit().ln() / rate;
        }
        for b in &mut backends {
            b.serve(now, &mut latencies);
        }
        now += STEP_S;
    }
    latencies.sort_by(f64::total_cmp);
    let p99 = latencies[latencies.len() * 99 / 100] * 1000.0;
    (sent, refused, p99)
}

/// A model of the load-aware benchmark's initialization pattern: per-connection
/// dispatch policies compared without the noise of a real run.
#[derive(Parser, Debug)]
#[command(name = "xlb-dispatch-model", args_override_self = true)]
struct Cli {
    /// Simulated seconds per policy and seed
    #[arg(long, value_name = "S", default_value_t = 200.0)]
    seconds: f64,
    /// Seeds (runs) per policy
    #[arg(long, value_name = "N", default_value_t = 3)]
    seeds: u64,
}

fn main() {
    let Cli { seconds, seeds } = Cli::parse();
    println!(
        "# dispatch model: {BACKENDS} backends at {}% of a core (CFS period {} ms), {WORKERS} workers + {QUEUED} queued, \
         {}% of requests {} ms else {} ms, {}% load, {seeds} seeds x {seconds} s",
        QUOTA_SHARE * 100.0,
        PERIOD_S * 1000.0,
        COSTLY_SHARE * 100.0,
        COSTLY_S * 1000.0,
        CHEAP_S * 1000.0,
        LOAD * 100.0
    );
    println!("\n| policy | p99 ms | refused |\n|---|---:|---:|");
    for policy in [
        Policy::OneDraw,
        Policy::TwoChoices,
        Policy::ThreeChoices,
        Policy::AgeWeighted(0.1),
        Policy::AgeWeighted(0.005),
    ] {
        let runs: Vec<_> = (1..=seeds).map(|s| run(policy, s, seconds)).collect();
        let p99: Vec<f64> = runs.iter().map(|r| r.2).collect();
        let refused: Vec<f64> = runs
            .iter()
            .map(|r| 100.0 * r.1 as f64 / r.0 as f64)
            .collect();
        let range = |v: &[f64], digits: usize| {
            let min = v.iter().copied().fold(f64::INFINITY, f64::min);
            let max = v.iter().copied().fold(0.0, f64::max);
            format!("{min:.digits$}-{max:.digits$}")
        };
        println!(
            "| {} | {} | {} % |",
            policy.name(),
            range(&p99, 0),
            range(&refused, 2)
        );
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::Cli;

    #[test]
    fn documented_invocations_parse() {
        Cli::command().debug_assert();
        let c = Cli::try_parse_from(["xlb-dispatch-model"]).unwrap();
        assert_eq!((c.seconds, c.seeds), (200.0, 3));
        let c =
            Cli::try_parse_from(["xlb-dispatch-model", "--seconds", "20", "--seeds", "5"]).unwrap();
        assert_eq!((c.seconds, c.seeds), (20.0, 5));
        Cli::try_parse_from(["xlb-dispatch-model", "--seed", "5"]).unwrap_err();
    }
}
