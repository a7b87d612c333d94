//! The short chaos run of `cargo xtask test`: ten events in each of two
//! ECMP labs (GoBGP nodes with an snat service, BIRD nodes with a nat
//! service, both with flow sync), every kind of event in each (see
//! `xlb_tests::chaos`), under 50 keep-alive connections and a stream of new
//! ones. The seeds are fixed so that a run can be repeated
//! (`XLB_CHAOS_SEED` picks others); the timing between events is not.
//!
//! Asserted: no invariant breaks (no connection answered by two backends,
//! no agent exiting on its own, the router's FIB and every node's Maglev
//! table back where they belong), and no nat connection lost. Printed and
//! not asserted: the snat lab's lost connections and both labs' failed new
//! connections. Runs of 200 events (docs/benchmarks.md, "Chaos") still lose
//! about one snat connection in 100 events and fail about one new
//! connection in 500,000, from a cause not found yet (docs/limitations.md);
//! asserted here they would fail one run in five.

use xlb_tests::{
    chaos::{self, Outcome, Plan},
    ecmp::Driver,
};

fn seed() -> u64 {
    std::env::var("XLB_CHAOS_SEED")
        .ok()
        .map(|s| s.parse().expect("XLB_CHAOS_SEED: a number"))
        .unwrap_or(20261127)
}

#[test]
fn twenty_random_events_break_nothing_and_lose_no_nat_connection() {
    let mut total = Outcome::default();
    for (k, (driver, mode)) in [(Driver::GoBgp, "snat"), (Driver::Bird, "nat")]
        .into_iter()
        .enumerate()
    {
        let outcome = chaos::run(&Plan {
            driver,
            mode,
            seed: seed() + k as u64,
            events: 10,
            conns: 50,
        });
        // Every kind happened (a short run draws the least used first).
        for kind in chaos::KINDS {
            assert!(
                outcome.kinds.contains_key(kind),
                "{mode}: no {kind} in {:?}",
                outcome.kinds
            );
        }
        assert!(outcome.established >= 50, "{mode}: {}", outcome.line());
        assert!(outcome.new_made > 0, "{mode}: {}", outcome.line());
        assert!(
            outcome.breaks.is_empty(),
            "{mode}: {}; breaks: {:#?}",
            outcome.line(),
            outcome.breaks
        );
        if mode == "nat" {
            assert_eq!(outcome.lost, 0, "nat: {}", outcome.line());
        }
        total.add(&outcome);
    }
    println!("{}", total.line());
}
