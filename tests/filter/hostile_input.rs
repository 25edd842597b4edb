//! What an outsider can do through parameters and keys: rates the layout
//! cannot deliver, filters that claim memory, and keys crafted for one block
//! when the seed is known.

use bloomguard::filter::MIN_FALSE_POSITIVE_RATE;
use bloomguard::{AtomicBloom, ConfigError, FilterBuilder, Guard, Verdict, plan};

#[test]
fn rates_below_what_the_layout_delivers_are_refused_naming_the_lowest() {
    for rate in [MIN_FALSE_POSITIVE_RATE / 2.0, 1e-15, 1e-300, 5e-324] {
        let err = AtomicBloom::new(1_000, rate).unwrap_err();
        match &err {
            ConfigError::OutOfRange {
                parameter,
                accepted,
                ..
            } => {
                assert_eq!(*parameter, "false_positive_rate");
                assert!(accepted.contains("1e-8"), "{err}");
            }
            other => panic!("expected OutOfRange, got {other:?}"),
        }
        assert!(Guard::builder().false_positive_rate(rate).build().is_err());
    }
}

#[test]
fn every_accepted_rate_is_met_by_the_plan() {
    let mut rate = 0.5;
    while rate > MIN_FALSE_POSITIVE_RATE {
        for items in [1, 1_000, 10_000_000] {
            let plan = plan(items, rate).unwrap();
            assert!(plan.predicted_fpr <= rate, "{plan:?}");
        }
        rate /= 1.9;
    }
    let floor = plan(1_000_000, MIN_FALSE_POSITIVE_RATE).unwrap();
    assert!(floor.predicted_fpr <= MIN_FALSE_POSITIVE_RATE, "{floor:?}");
}

fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS in /proc/self/status");
    let kib: u64 = line
        .trim_start_matches("VmRSS:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .unwrap();
    kib * 1024
}

/// The build's docs promise a zeroed allocation that the OS maps lazily: a
/// 1 GiB filter costs resident memory only as its pages are touched.
#[test]
#[cfg(target_os = "linux")]
fn a_new_filter_is_mapped_lazily() {
    const GIB: u64 = 1 << 30;
    let before = resident_bytes();
    let filter = FilterBuilder::with_params(8 * GIB, 6)
        .max_bytes(GIB)
        .build()
        .unwrap();
    let after = resident_bytes();
    assert!(filter.memory_bytes() as u64 >= GIB);
    assert!(
        after.saturating_sub(before) < GIB / 8,
        "building a 1 GiB filter made {} MiB resident",
        (after - before) >> 20
    );
    filter.insert("touches one page");
    assert!(filter.contains("touches one page"));
}

/// Keys named `{prefix}:{n}` whose hash under `seed` lands in the first
/// block of a filter shaped like `shape`: what an attacker who knows the
/// seed computes in a moment.
fn crafted_for_one_block(shape: &AtomicBloom, prefix: &str, count: usize) -> Vec<String> {
    let blocks = shape.bits() / 512;
    let first_block_below = u64::MAX / blocks;
    (0u64..)
        .map(|n| format!("{prefix}:{n}"))
        .filter(|key| shape.hash(key.as_bytes()) < first_block_below)
        .take(count)
        .collect()
}

/// Inserts `inserted` into `guard`, then counts the `probes` it lets through.
fn probes_passing_after(guard: &Guard, inserted: &[String], probes: &[String]) -> usize {
    for key in inserted {
        guard.insert(key);
    }
    probes
        .iter()
        .filter(|k| guard.check(k) == Verdict::MaybePresent)
        .count()
}

#[test]
fn a_known_seed_lets_crafted_keys_defeat_the_guard_and_the_stats_notice() {
    const SEED: u64 = 42;
    let shape = AtomicBloom::with_seed(10_000, 0.01, SEED).unwrap();
    let inserted = crafted_for_one_block(&shape, "crafted", 5_000);
    let probes = crafted_for_one_block(&shape, "probe", 1_000);

    // The seed is known: every crafted key lands in one block.
    let known = Guard::builder()
        .expected_items(10_000)
        .seed(SEED)
        .build()
        .unwrap();
    let passed = probes_passing_after(&known, &inserted, &probes);
    assert_eq!(passed, probes.len(), "crafted absent keys all pass");
    let stats = known.stats();
    assert!(
        stats.estimated_items < 200.0,
        "the fill sees a few hundred keys: {stats:?}"
    );
    assert!(
        stats.redundant_insert_ratio > 0.8,
        "inserts that set no new bit give the load away: {stats:?}"
    );

    // The seed is secret (random): the same keys spread like any others.
    let secret = Guard::builder().expected_items(10_000).build().unwrap();
    let passed = probes_passing_after(&secret, &inserted, &probes);
    assert!(passed < 30, "{passed} of 1000 crafted absent keys pass");
    let stats = secret.stats();
    assert!(
        (4_500.0..5_500.0).contains(&stats.estimated_items),
        "{stats:?}"
    );
    assert!(stats.redundant_insert_ratio < 0.05, "{stats:?}");
}
