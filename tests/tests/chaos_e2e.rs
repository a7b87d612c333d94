//! The short chaos run of `cargo xtask test`: ten events in each of two
//! ECMP labs (GoBGP nodes with an snat service and flow sync, BIRD nodes
//! with a nat service), every kind of event in each (see
//! `xlb_tests::chaos`), under 50 keep-alive connections and a stream of new
//! ones. Nothing may be lost, fail or break. The seeds are fixed so that a
//! failure can be run again (`XLB_CHAOS_SEED` picks others); the timing of
//! what happens between events is not.

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
fn twenty_random_events_lose_no_connection_and_fail_no_new_one() {
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
        total.add(&outcome);
    }
    println!("{}", total.line());
    assert!(total.established >= 100, "{}", total.line());
    assert!(total.new_made > 0, "{}", total.line());
    assert!(
        total.clean(),
        "{}; breaks: {:#?}",
        total.line(),
        total.breaks
    );
}
