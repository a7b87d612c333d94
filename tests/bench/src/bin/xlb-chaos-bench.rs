//! `cargo xtask bench chaos`: the chaos run (`xlb_tests::chaos`) in the
//! ECMP lab, once per lab (by default GoBGP nodes with an snat service and
//! flow sync, then BIRD nodes with a nat service), each a fresh lab with
//! its own events in a seeded random order under keep-alive connections
//! and a stream of new ones.
//!
//! Prints the seed, every event with its time, and per lab its events by
//! kind and its `chaos:` line; the last line is the labs' total:
//! `chaos: N events, lost X of Y established, failed Z of W new, invariant breaks B`.
//! Exits with failure when any of X, Z, B is not 0.

use std::{collections::BTreeMap, process::ExitCode};

use clap::{
    builder::{PossibleValuesParser, TypedValueParser},
    Parser,
};
use xlb_bench::args::positive;
use xlb_tests::{
    chaos::{self, Outcome, Plan, KINDS},
    ecmp::Driver,
};

/// The labs, by name in `--labs`: the nodes' speaker and the service's mode.
const LABS: [(&str, Driver, &str); 4] = [
    ("gobgp-snat", Driver::GoBgp, "snat"),
    ("bird-nat", Driver::Bird, "nat"),
    ("gobgp-nat", Driver::GoBgp, "nat"),
    ("bird-snat", Driver::Bird, "snat"),
];

/// Connections lost, new connections failed and invariants broken in the
/// ECMP lab through random events.
#[derive(Parser, Debug)]
#[command(name = "xlb-chaos-bench", args_override_self = true)]
struct Opts {
    /// Labs, comma-separated
    #[arg(long, value_name = "LIST", value_delimiter = ',', value_parser = lab_parser(),
          default_values = ["gobgp-snat", "bird-nat"])]
    labs: Vec<(Driver, &'static str)>,
    /// Events in each lab
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = positive::<usize>)]
    events: usize,
    /// Keep-alive connections
    #[arg(long, value_name = "N", default_value_t = 50, value_parser = positive::<usize>)]
    conns: usize,
    /// The first lab's seed (the next lab's is one more) [default: from the clock]
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
}

/// `--labs`' parser: a lab by its name, as its speaker and mode.
fn lab_parser() -> impl TypedValueParser<Value = (Driver, &'static str)> {
    PossibleValuesParser::new(LABS.map(|l| l.0)).map(|name| {
        let (_, driver, mode) = LABS.into_iter().find(|l| l.0 == name).expect("a lab");
        (driver, mode)
    })
}

fn main() -> ExitCode {
    let o = Opts::parse();
    let seed = o.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(1)
    });
    println!("chaos: seed {seed} (again with --seed {seed})");
    let mut total = Outcome::default();
    let mut lines = Vec::new();
    let mut by_kind: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (k, &(driver, mode)) in o.labs.iter().enumerate() {
        let plan = Plan {
            driver,
            mode,
            seed: seed + k as u64,
            events: o.events,
            conns: o.conns,
        };
        let outcome = chaos::run(&plan);
        for kind in KINDS {
            by_kind
                .entry(kind)
                .or_default()
                .push(outcome.kinds.get(kind).copied().unwrap_or(0));
        }
        lines.push(format!(
            "{}-{mode} (seed {}): {}; {} ended with their backend",
            driver.name(),
            plan.seed,
            outcome.line(),
            outcome.ended_with_backend
        ));
        total.add(&outcome);
    }
    println!();
    let names: Vec<String> = o
        .labs
        .iter()
        .map(|(d, m)| format!("{}-{m}", d.name()))
        .collect();
    println!("| event | {} |", names.join(" | "));
    println!("|---|{}", "---:|".repeat(names.len()));
    for kind in KINDS {
        let counts: Vec<String> = by_kind[kind].iter().map(|n| n.to_string()).collect();
        println!("| {kind} | {} |", counts.join(" | "));
    }
    println!();
    for b in &total.breaks {
        println!("invariant broken: {b}");
    }
    for l in lines {
        println!("{l}");
    }
    println!("{}", total.line());
    if total.clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::*;

    fn parse(args: &[&str]) -> Result<Opts, clap::Error> {
        Opts::try_parse_from(std::iter::once("xlb-chaos-bench").chain(args.iter().copied()))
    }

    #[test]
    fn documented_invocations_parse() {
        Opts::command().debug_assert();
        let o = parse(&[]).unwrap();
        assert_eq!(o.labs, [(Driver::GoBgp, "snat"), (Driver::Bird, "nat")]);
        assert_eq!((o.events, o.conns, o.seed), (100, 50, None));
        // docs/benchmarks.md
        let o = parse(&["--seed", "7", "--events", "10", "--labs", "bird-snat"]).unwrap();
        assert_eq!((o.seed, o.events), (Some(7), 10));
        assert_eq!(o.labs, [(Driver::Bird, "snat")]);
        parse(&["--events", "0"]).unwrap_err();
        parse(&["--labs", "exabgp-nat"]).unwrap_err();
    }
}
