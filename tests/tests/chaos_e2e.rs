//! The short chaos run of `cargo xtask test`: ten events in each of two
//! ECMP labs (GoBGP nodes with an snat service, BIRD nodes with a nat
//! service, both with flow sync), every kind of event in each (see
//! `xlb_tests::chaos`), under 50 keep-alive connections and a stream of new
//! ones. The seeds are fixed so that a run can be repeated
//! (`XLB_CHAOS_SEED` picks others); the timing between events is not.
//!
//! Asserted, as the 200-event runs measure (docs/benchmarks.md, "Chaos"):
//! no invariant breaks (no connection answered by two backends, no agent
//! exiting on its own, the router's FIB and every node's Maglev table back
//! where they belong), no connection lost and no new connection failed, in
//! either mode.

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
fn twenty_random_events_break_nothing_and_lose_no_connection() {
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
        assert_eq!(
            (outcome.lost, outcome.new_failed),
            (0, 0),
            "{mode}: {}",
            outcome.line()
        );
        total.add(&outcome);
    }
    println!("{}", total.line());
}
