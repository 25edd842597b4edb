//! Bad parameters come back as a `ConfigError` naming the parameter and its range.

use bloomguard::{AtomicBloom, ConfigError, FilterBuilder, plan};

fn parameter_of(err: ConfigError) -> &'static str {
    match err {
        ConfigError::OutOfRange { parameter, .. } => parameter,
        other => panic!("expected OutOfRange, got {other:?}"),
    }
}

#[test]
fn rates_outside_zero_to_one_are_refused() {
    for p in [
        0.0,
        1.0,
        -0.01,
        1.5,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
    ] {
        let err = AtomicBloom::new(1_000, p).unwrap_err();
        let message = err.to_string();
        assert_eq!(parameter_of(err), "false_positive_rate");
        assert!(message.contains("[1e-8, 1)"), "{message}");
    }
}

#[test]
fn zero_items_bits_or_hashes_are_refused() {
    assert_eq!(
        parameter_of(AtomicBloom::new(0, 0.01).unwrap_err()),
        "expected_items"
    );
    assert_eq!(parameter_of(plan(0, 0.01).unwrap_err()), "expected_items");
    assert_eq!(
        parameter_of(AtomicBloom::with_params(0, 4).unwrap_err()),
        "bits"
    );
    assert_eq!(
        parameter_of(AtomicBloom::with_params(512, 0).unwrap_err()),
        "k"
    );
    assert_eq!(
        parameter_of(AtomicBloom::with_params(512, 33).unwrap_err()),
        "k"
    );
}

#[test]
fn sizes_over_the_budget_are_refused_without_allocating() {
    let err = AtomicBloom::new(u64::MAX / 2, 1e-8).unwrap_err();
    assert!(matches!(err, ConfigError::TooLarge { .. }), "{err:?}");
    let err = FilterBuilder::for_items(1_000_000, 0.01)
        .max_bytes(1 << 20)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("max_bytes = 1048576"), "{err}");
    assert!(
        FilterBuilder::for_items(1_000_000, 0.01)
            .max_bytes(2 << 20)
            .build()
            .is_ok()
    );
}

#[test]
fn plan_matches_what_is_built() {
    let plan = plan(123_456, 0.005).unwrap();
    let filter = AtomicBloom::new(123_456, 0.005).unwrap();
    assert_eq!((plan.bits, plan.k), (filter.bits(), filter.k()));
    assert_eq!(plan.bytes * 8, plan.bits);
    let stats = filter.stats();
    assert_eq!(
        (stats.capacity, stats.target_fpr),
        (Some(123_456), Some(0.005))
    );
}

#[test]
fn explicit_bits_round_up_to_whole_blocks() {
    let filter = AtomicBloom::with_params(513, 3).unwrap();
    assert_eq!(filter.bits(), 1024);
    assert_eq!(filter.stats().capacity, None);
}

#[test]
fn random_seeds_differ() {
    let a = AtomicBloom::new(10, 0.01).unwrap();
    let b = AtomicBloom::new(10, 0.01).unwrap();
    assert_ne!(a.seed(), b.seed());
}
