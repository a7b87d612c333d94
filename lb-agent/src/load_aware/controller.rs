//! The rule that turns load signals into weights, for one service. Pure:
//! signals in, weights out, state carried between steps. docs/load-aware.md
//! states the rule and why each default is what it is.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

/// What a backend said through its agent check (HAProxy's convention).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    /// `75%`: the configured weight scaled by this much (0 counts as drain).
    Percent(u32),
    /// `drain`: no new flows; established ones stay.
    Drain,
    /// `down` (also `fail`, `stopped`, `maint`): out, as a failed health check.
    Down,
}

/// One backend's signals at one step; `None`: not known (not configured,
/// or not measured yet).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Signals {
    /// The configured weight; 0 stays 0.
    pub weight: u32,
    /// Open flows (the data plane's count).
    pub open_flows: Option<f64>,
    /// How long its flows stay open: open flows over new flows a second
    /// (Little's law). Where new flows go to the least loaded candidate,
    /// open flows even out across backends and this is what still tells a
    /// slow backend: it takes few flows and holds them long.
    pub flow_time: Option<Duration>,
    /// The health check's latency.
    pub latency: Option<Duration>,
    /// The agent check's latest answer.
    pub report: Option<Report>,
    /// CPU use of the backend's cgroup against its limit (1.0: all of it).
    pub cpu: Option<f64>,
    /// The latest health check failed (an overloaded backend answering 503
    /// is loaded, not idle, though it holds few flows).
    pub probe_failed: bool,
}

/// The pressure a failed probe counts as, at least.
pub const FAILED_PROBE_PRESSURE: f64 = 2.0;

/// The weight decided for one backend, and why.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    /// What the data plane gets; 0: no new flows (drain).
    pub weight: u32,
    /// Out of the service (the backend reported `down`).
    pub down: bool,
    /// The load factor (floor..=1) before any report's percentage.
    pub factor: f64,
    /// How loaded it looked against the others (1: as loaded as the mean).
    pub pressure: f64,
}

/// The rule's constants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    /// The smallest factor: a slow backend keeps a trickle of new flows, so
    /// the open-flow signal can show that it recovered.
    pub floor: f64,
    /// How strongly one step follows the pressure: factor × pressure^-gain.
    pub gain: f64,
    /// The most a factor changes in one step (× or ÷).
    pub max_step: f64,
    /// Pressure up to 1 + this does not lower a factor (no chasing noise)
    /// but raises it by `recover`, so that equal load ends at the
    /// configured weights.
    pub deadband: f64,
    /// Weight of the newest sample in the smoothed signals.
    pub smoothing: f64,
    /// Below this many open flows per backend (mean), the flow signal is
    /// noise and not used.
    pub min_flows: f64,
    /// Added to every backend's open flows (per unit of weight) before
    /// comparing: a count of a few flows swings by its square root from one
    /// sample to the next, which is not load.
    pub pseudo_flows: f64,
    /// Added to every latency before comparing: sub-millisecond jitter of
    /// idle backends is not load.
    pub latency_slack: Duration,
    /// A backend that joins a service with others starts at this factor.
    pub ramp_start: f64,
    /// The least a factor grows per step while no signal calls the
    /// backend loaded (pressure at most 1).
    pub recover: f64,
}

impl Params {
    /// The defaults, but a service whose data plane places each new flow
    /// on the least loaded of its candidates (`SERVICE_F_LEAST_LOADED`)
    /// gives a joining backend its full weight at once: the per-connection
    /// choice already keeps it from being flooded (it takes new flows only
    /// while it has fewer open ones), and a ramp would only keep it a rare
    /// candidate while the others overflow (measured in the scaling
    /// benchmark).
    pub fn for_service(least_loaded: bool) -> Self {
        let p = Params::default();
        if least_loaded {
            Params {
                ramp_start: 1.0,
                ..p
            }
        } else {
            p
        }
    }
}

impl Default for Params {
    fn default() -> Self {
        Params {
            floor: 0.05,
            gain: 0.5,
            max_step: 1.5,
            deadband: 0.25,
            smoothing: 0.3,
            min_flows: 2.0,
            pseudo_flows: 2.0,
            latency_slack: Duration::from_millis(2),
            ramp_start: 0.5,
            recover: 1.1,
        }
    }
}

/// The weights are the configured ones times the factor on this scale, so
/// that a factor of 0.05 is still a whole number.
pub const SCALE: f64 = 100.0;

#[derive(Clone, Copy, Debug)]
struct State {
    factor: f64,
    /// Added at this step: its signals say nothing yet (no flows is not
    /// the same as little load).
    fresh: bool,
    flows: Option<f64>,
    latency: Option<f64>,
    flow_time: Option<f64>,
}

/// One service's controller.
#[derive(Clone, Debug, Default)]
pub struct Controller {
    params: Params,
    state: BTreeMap<SocketAddr, State>,
    /// Every backend with a weight reported drain or down at the last step.
    pub all_draining: bool,
}

fn smooth(prev: Option<f64>, now: Option<f64>, alpha: f64) -> Option<f64> {
    match (prev, now) {
        (Some(p), Some(n)) => Some(alpha * n + (1.0 - alpha) * p),
        (_, n) => n,
    }
}

/// Each value against the mean of them all; `None` where not comparable
/// (unknown, or fewer than two known).
fn ratios(values: &[Option<f64>]) -> Vec<Option<f64>> {
    let known: Vec<f64> = values.iter().flatten().copied().collect();
    let mean = known.iter().sum::<f64>() / known.len().max(1) as f64;
    values
        .iter()
        .map(|v| match v {
            Some(v) if known.len() >= 2 && mean > 0.0 => Some(v / mean),
            _ => None,
        })
        .collect()
}

impl Controller {
    pub fn new(params: Params) -> Controller {
        Controller {
            params,
            ..Default::default()
        }
    }

    /// One step: new weights from the signals. Backends missing from
    /// `signals` are forgotten; new ones ramp up from `ramp_start`.
    pub fn step(
        &mut self,
        signals: &BTreeMap<SocketAddr, Signals>,
    ) -> BTreeMap<SocketAddr, Decision> {
        let p = self.params;
        self.state.retain(|a, _| signals.contains_key(a));
        let had_others = !self.state.is_empty();
        for (addr, s) in signals {
            let st = self.state.entry(*addr).or_insert(State {
                factor: if had_others { p.ramp_start } else { 1.0 },
                fresh: true,
                flows: None,
                latency: None,
                flow_time: None,
            });
            st.flows = smooth(st.flows, s.open_flows, p.smoothing);
            st.latency = smooth(
                st.latency,
                s.latency.map(|l| (l + p.latency_slack).as_secs_f64()),
                p.smoothing,
            );
            // A step with too few new flows to time keeps the last value: a
            // backend whose weight was cut gets few, and its flows' time
            // is still the best known.
            let flow_time = s.flow_time.map(|t| (t + p.latency_slack).as_secs_f64());
            st.flow_time = smooth(st.flow_time, flow_time, p.smoothing).or(st.flow_time);
        }
        // Who takes part in the comparison: configured in, not reported out.
        let active: Vec<SocketAddr> = signals
            .iter()
            .filter(|(_, s)| s.weight > 0 && !matches!(s.report, Some(Report::Down)))
            .map(|(a, _)| *a)
            .collect();
        let pressure = self.pressures(&active, signals);
        for (addr, pr) in active.iter().zip(&pressure) {
            let st = self.state.get_mut(addr).expect("state for every signal");
            if st.fresh {
                st.fresh = false;
            } else {
                // Nothing calling a backend loaded gives it weight back,
                // at least ×recover a step: within the dead band too, or a
                // backend cut for a slow flow time or probe (which do not
                // fall below the others' when it recovers) would stay cut.
                let mut next = st.factor * pr.powf(-p.gain);
                if *pr <= 1.0 + p.deadband {
                    next = next.max(st.factor * p.recover);
                }
                st.factor = next
                    .clamp(st.factor / p.max_step, st.factor * p.max_step)
                    .min(1.0);
            }
        }
        // Only the ratios matter: when every factor fell, the least loaded
        // backend gets its full weight back.
        let top = active
            .iter()
            .map(|a| self.state[a].factor)
            .fold(0.0, f64::max);
        for a in &active {
            let st = self.state.get_mut(a).expect("state for every signal");
            if top > 0.0 {
                st.factor /= top;
            }
            st.factor = st.factor.clamp(p.floor, 1.0);
        }
        self.decide(signals, &active, &pressure)
    }

    /// Each active backend's pressure: the worst of its signals against the
    /// service's mean.
    fn pressures(
        &self,
        active: &[SocketAddr],
        signals: &BTreeMap<SocketAddr, Signals>,
    ) -> Vec<f64> {
        let st = |a: &SocketAddr| self.state[a];
        let flows: Vec<Option<f64>> = active
            .iter()
            .map(|a| {
                st(a)
                    .flows
                    .map(|f| f / signals[a].weight as f64 + self.params.pseudo_flows)
            })
            .collect();
        let mean_flows =
            active.iter().filter_map(|a| st(a).flows).sum::<f64>() / active.len().max(1) as f64;
        let flows_known = flows.iter().any(Option::is_some);
        let light = flows_known && mean_flows < self.params.min_flows;
        let (flows, flow_time) = if light {
            // Few flows anywhere: nothing is overloaded, whatever one
            // noisy probe or a few timed flows say.
            (vec![Some(1.0); active.len()], vec![None; active.len()])
        } else {
            // A flow time only tells a slow backend: one as fast as the
            // others leaves the say to its share-dependent signals, which
            // fall below the mean for a recovered backend whose weight was
            // cut (it takes fewer flows), so that it gets its weight back.
            let times: Vec<Option<f64>> = active.iter().map(|a| st(a).flow_time).collect();
            let slow = |r: Option<f64>| r.filter(|&r| r > 1.0 + self.params.deadband);
            (
                ratios(&flows),
                ratios(&times).into_iter().map(slow).collect(),
            )
        };
        let latency = ratios(&active.iter().map(|a| st(a).latency).collect::<Vec<_>>());
        // CPU speaks only of a backend short of it (held back by its limit
        // or waiting for a CPU: above 1), and then as it is, not against
        // the others: a backend using part of its CPU is not loaded
        // however little the others use, and one local backend among
        // remote ones has nothing to be compared with.
        let cpu: Vec<Option<f64>> = active
            .iter()
            .map(|a| signals[a].cpu.filter(|&c| c > 1.0))
            .collect();
        // Open flows (averaged over the step), their time and CPU are
        // measured load; one probe's latency is a single noisy sample, so
        // it counts only where none is known. A failed probe is load
        // whatever else says.
        active
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let p = [flows[i], flow_time[i], cpu[i]]
                    .into_iter()
                    .flatten()
                    .reduce(f64::max)
                    .or(latency[i])
                    .unwrap_or(1.0);
                if signals[a].probe_failed {
                    p.max(FAILED_PROBE_PRESSURE)
                } else {
                    p
                }
            })
            .collect()
    }

    /// The weights: configured × factor, then the agent check's say. When
    /// every backend reports drain (or 0 %), the reports are set aside and
    /// `all_draining` says so: new flows keep a home, as Kubernetes keeps
    /// using terminating endpoints when no other is left.
    fn decide(
        &mut self,
        signals: &BTreeMap<SocketAddr, Signals>,
        active: &[SocketAddr],
        pressure: &[f64],
    ) -> BTreeMap<SocketAddr, Decision> {
        let drains = |s: &Signals| matches!(s.report, Some(Report::Drain | Report::Percent(0)));
        let weighted: Vec<&Signals> = signals.values().filter(|s| s.weight > 0).collect();
        self.all_draining = !weighted.is_empty()
            && weighted
                .iter()
                .all(|s| drains(s) || matches!(s.report, Some(Report::Down)));
        let mut out = BTreeMap::new();
        for (addr, s) in signals {
            let factor = self.state[addr].factor;
            let pressure = active
                .iter()
                .position(|a| a == addr)
                .map_or(1.0, |i| pressure[i]);
            let scaled = |f: f64| ((s.weight as f64 * f * SCALE).round() as u32).max(1);
            let (weight, down) = match s.report {
                _ if s.weight == 0 => (0, false),
                _ if self.all_draining => (scaled(factor), false),
                Some(Report::Down) => (0, true),
                Some(Report::Drain | Report::Percent(0)) => (0, false),
                Some(Report::Percent(pct)) => (scaled(factor * pct as f64 / 100.0), false),
                None => (scaled(factor), false),
            };
            out.insert(
                *addr,
                Decision {
                    weight,
                    down,
                    factor,
                    pressure,
                },
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(n: u8) -> SocketAddr {
        SocketAddr::from(([10, 0, 0, n], 80))
    }

    fn signals(flows: &[f64]) -> BTreeMap<SocketAddr, Signals> {
        flows
            .iter()
            .enumerate()
            .map(|(i, f)| {
                (
                    addr(i as u8 + 1),
                    Signals {
                        weight: 1,
                        open_flows: Some(*f),
                        ..Default::default()
                    },
                )
            })
            .collect()
    }

    fn weights(d: &BTreeMap<SocketAddr, Decision>) -> Vec<u32> {
        d.values().map(|d| d.weight).collect()
    }

    /// A simulated service: open flows follow Little's law, flows = arrival
    /// share × time in service, and backend `slow` takes `slowdown` times as
    /// long. Returns the shares after `steps`.
    fn simulate(c: &mut Controller, times: &[f64], steps: usize) -> Vec<f64> {
        let mut w: Vec<f64> = vec![1.0; times.len()];
        for _ in 0..steps {
            let total: f64 = w.iter().sum();
            let flows: Vec<f64> = w
                .iter()
                .zip(times)
                .map(|(w, t)| 300.0 * w / total * t)
                .collect();
            let d = c.step(&signals(&flows));
            w = d.values().map(|d| d.weight as f64).collect();
        }
        let total: f64 = w.iter().sum();
        w.iter().map(|w| w / total).collect()
    }

    #[test]
    fn equal_load_keeps_the_configured_weights() {
        let mut c = Controller::new(Params::default());
        for _ in 0..20 {
            let d = c.step(&signals(&[30.0, 31.0, 29.0]));
            assert_eq!(weights(&d), vec![100, 100, 100]);
        }
    }

    #[test]
    fn a_slow_backend_loses_share_and_gets_it_back() {
        let mut c = Controller::new(Params::default());
        // Backend 1 takes 4× as long per flow: least-connections' balance
        // point is share ∝ 1/time, i.e. 1/9 for it, 4/9 for the others.
        let shares = simulate(&mut c, &[0.4, 0.1, 0.1], 30);
        assert!(shares[0] < 0.16, "slow backend kept {shares:?}");
        assert!(shares[0] > 0.03, "slow backend starved: {shares:?}");
        // It recovers: back to an equal share.
        let shares = simulate(&mut c, &[0.1, 0.1, 0.1], 30);
        for s in &shares {
            assert!(
                (s - 1.0 / 3.0).abs() < 0.03,
                "not back to equal: {shares:?}"
            );
        }
    }

    #[test]
    fn under_the_per_connection_choice_a_slow_backend_shows_in_its_flow_time() {
        // Least loaded of three: every backend holds the same open flows,
        // the slow one by taking few and holding them 10× as long.
        let timed = |times_ms: [u64; 3]| {
            let mut s = signals(&[4.0, 4.0, 4.0]);
            for (sig, t) in s.values_mut().zip(times_ms) {
                sig.flow_time = Some(Duration::from_millis(t));
            }
            s
        };
        let mut c = Controller::new(Params::for_service(true));
        let mut d = BTreeMap::new();
        for _ in 0..10 {
            d = c.step(&timed([400, 40, 40]));
        }
        assert!(weights(&d)[0] <= 25, "slow backend kept {:?}", weights(&d));
        assert_eq!(weights(&d)[1..], [100, 100]);
        // A step without enough new flows to time keeps the last time.
        let mut untimed = timed([400, 40, 40]);
        untimed.values_mut().next().unwrap().flow_time = None;
        assert!(weights(&c.step(&untimed))[0] <= 25);
        // Recovered: as fast as the others, and, a rarer candidate while
        // its weight is cut, holding fewer flows than they do. The smoothed
        // time takes 9 steps to come within the dead band.
        for _ in 0..20 {
            let mut s = timed([40, 40, 40]);
            let w1 = d[&addr(1)].weight as f64 / 100.0;
            s.get_mut(&addr(1)).unwrap().open_flows = Some(4.0 * w1);
            d = c.step(&s);
        }
        assert_eq!(weights(&d), vec![100, 100, 100]);
        // Few flows anywhere: their times are noise.
        for _ in 0..20 {
            let mut s = timed([400, 40, 40]);
            for sig in s.values_mut() {
                sig.open_flows = Some(0.5);
            }
            d = c.step(&s);
        }
        assert_eq!(weights(&d), vec![100, 100, 100]);
    }

    #[test]
    fn one_step_changes_a_weight_by_at_most_max_step() {
        let mut c = Controller::new(Params::default());
        c.step(&signals(&[10.0, 10.0, 10.0, 10.0]));
        let d = c.step(&signals(&[100_000.0, 10.0, 10.0, 10.0]));
        assert_eq!(weights(&d), vec![67, 100, 100, 100], "÷1.5 at most");
    }

    #[test]
    fn the_floor_holds_however_loaded() {
        let mut c = Controller::new(Params::default());
        let mut d = BTreeMap::new();
        for _ in 0..50 {
            d = c.step(&signals(&[10_000.0, 1.0]));
        }
        assert_eq!(weights(&d), vec![5, 100]);
    }

    #[test]
    fn a_new_backend_ramps_up_instead_of_flooding() {
        let mut c = Controller::new(Params::default());
        c.step(&signals(&[40.0, 40.0]));
        let mut seen = Vec::new();
        for _ in 0..6 {
            let d = c.step(&signals(&[40.0, 40.0, 0.0]));
            seen.push(d[&addr(3)].weight);
        }
        assert!(seen[0] <= 65, "starts low: {seen:?}");
        assert!(seen.windows(2).all(|w| w[1] >= w[0]), "{seen:?}");
        assert!(*seen.last().unwrap() >= 80, "{seen:?}");
    }

    #[test]
    fn with_the_per_connection_choice_a_new_backend_starts_at_full_weight() {
        let mut c = Controller::new(Params::for_service(true));
        c.step(&signals(&[40.0, 40.0]));
        let d = c.step(&signals(&[40.0, 40.0, 0.0]));
        assert!(d[&addr(3)].weight >= 95, "{:?}", d[&addr(3)]);
        assert_eq!(Params::for_service(false), Params::default());
    }

    /// Counts of 8 clients over 3 backends jump between 0 and 8 from one
    /// sample to the next; averaged over a step's ten samples (as
    /// the task does), that must not move the weights much.
    #[test]
    fn sampling_noise_at_low_load_leaves_the_weights_near_full() {
        let mut c = Controller::new(Params::default());
        let mut seed = 12345u64;
        let mut rand = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as f64 / (1u64 << 31) as f64
        };
        let mut lowest = 100;
        let mut w = [100.0; 3];
        for _ in 0..400 {
            // Each client's flow lands by weight; ten samples a step.
            let mut flows = [0.0; 3];
            for _ in 0..80 {
                let x = rand() * w.iter().sum::<f64>();
                let i = if x < w[0] {
                    0
                } else if x < w[0] + w[1] {
                    1
                } else {
                    2
                };
                flows[i] += 0.1;
            }
            let d = c.step(&signals(&flows));
            for (w, d) in w.iter_mut().zip(d.values()) {
                *w = d.weight as f64;
            }
            lowest = lowest.min(*weights(&d).iter().min().unwrap());
        }
        assert!(lowest >= 75, "noise pushed a weight to {lowest}");
    }

    #[test]
    fn a_failed_probe_is_pressure_however_few_its_flows() {
        let mut c = Controller::new(Params::default());
        let mut s = signals(&[2.0, 10.0, 10.0]);
        s.get_mut(&addr(1)).unwrap().probe_failed = true;
        c.step(&s);
        let d = c.step(&s);
        assert!(d[&addr(1)].pressure >= FAILED_PROBE_PRESSURE, "{d:?}");
        assert!(d[&addr(1)].weight < d[&addr(2)].weight, "{d:?}");
    }

    #[test]
    fn few_flows_are_noise() {
        let mut c = Controller::new(Params::default());
        for _ in 0..10 {
            let d = c.step(&signals(&[1.0, 0.0, 0.0]));
            assert_eq!(weights(&d), vec![100, 100, 100]);
        }
    }

    #[test]
    fn a_backend_short_of_cpu_loses_share_and_cpu_it_has_is_no_load() {
        let mut c = Controller::new(Params::default());
        // Few flows anywhere: only the CPU can tell. Using most of its
        // limit, but not held back, is not short of it.
        let mut s = signals(&[1.0, 0.0, 1.0]);
        for (b, cpu) in s.values_mut().zip([0.95, 0.05, 0.1]) {
            b.cpu = Some(cpu);
        }
        for _ in 0..5 {
            assert_eq!(weights(&c.step(&s)), vec![100, 100, 100]);
        }
        // Backend 1 at its quota and throttled half the time.
        s.get_mut(&addr(1)).unwrap().cpu = Some(1.5);
        let mut d = BTreeMap::new();
        for _ in 0..5 {
            d = c.step(&s);
        }
        assert!(
            d[&addr(1)].weight < 50 && d[&addr(1)].pressure == 1.5,
            "{d:?}"
        );
        assert_eq!((d[&addr(2)].weight, d[&addr(3)].weight), (100, 100));
        s.get_mut(&addr(1)).unwrap().cpu = Some(0.2);
        for _ in 0..40 {
            d = c.step(&s);
        }
        assert_eq!(weights(&d), vec![100, 100, 100], "recovered");
    }

    #[test]
    fn a_slow_probe_counts_as_pressure() {
        let mut c = Controller::new(Params::default());
        let mut s = signals(&[0.0, 0.0]);
        for b in s.values_mut() {
            b.open_flows = None;
        }
        s.get_mut(&addr(1)).unwrap().latency = Some(Duration::from_millis(50));
        s.get_mut(&addr(2)).unwrap().latency = Some(Duration::from_millis(1));
        let mut d = BTreeMap::new();
        for _ in 0..5 {
            d = c.step(&s);
        }
        assert!(d[&addr(1)].weight < 50, "{d:?}");
        assert_eq!(d[&addr(2)].weight, 100);
    }

    #[test]
    fn reports_scale_drain_and_take_out() {
        let mut c = Controller::new(Params::default());
        let mut s = signals(&[5.0, 5.0, 5.0, 5.0]);
        s.get_mut(&addr(1)).unwrap().report = Some(Report::Percent(50));
        s.get_mut(&addr(2)).unwrap().report = Some(Report::Drain);
        s.get_mut(&addr(3)).unwrap().report = Some(Report::Down);
        let d = c.step(&s);
        assert_eq!(weights(&d), vec![50, 0, 0, 100]);
        assert!(d[&addr(3)].down && !d[&addr(2)].down);
        assert!(!c.all_draining);
    }

    #[test]
    fn every_backend_draining_sets_the_reports_aside() {
        let mut c = Controller::new(Params::default());
        let mut s = signals(&[5.0, 5.0]);
        s.get_mut(&addr(1)).unwrap().report = Some(Report::Drain);
        s.get_mut(&addr(2)).unwrap().report = Some(Report::Percent(0));
        let d = c.step(&s);
        assert_eq!(weights(&d), vec![100, 100]);
        assert!(c.all_draining);
    }

    #[test]
    fn configured_weights_scale_and_zero_stays_zero() {
        let mut c = Controller::new(Params::default());
        let mut s = signals(&[5.0, 5.0, 5.0]);
        s.get_mut(&addr(1)).unwrap().weight = 3;
        s.get_mut(&addr(3)).unwrap().weight = 0;
        // Backend 1 has three times the weight and three times the flows:
        // equally loaded per unit of weight.
        s.get_mut(&addr(1)).unwrap().open_flows = Some(15.0);
        let d = c.step(&s);
        assert_eq!(weights(&d), vec![300, 100, 0]);
    }
}
