//! The `metrics` feature: every statistic reaches the recorder, labelled with the guard.

use std::collections::HashMap;

use bloomguard::metrics::{
    CHECKS_TOTAL, DRIFT_RATIO, ESTIMATED_FPR, FALSE_POSITIVES_TOTAL, FILL_RATIO, GENERATIONS,
    INSERTS_TOTAL, LAST_REBUILD_SUCCESS_SECONDS, MEMORY_BYTES, OBSERVED_FPR, PASS_THROUGH_RATIO,
    REBUILD_DURATION_SECONDS, REBUILDING, REBUILDS_TOTAL,
};
use bloomguard::{Guard, source};
use metrics::Unit;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

#[test]
fn publish_reports_the_stats_with_the_guard_label_and_units() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let keys: Vec<String> = (0..1_000).map(|i| format!("item:{i}")).collect();
    let listed = keys.clone();
    let guard = Guard::builder()
        .name("items")
        .expected_items(10_000)
        .source(source::from_fn(move || listed.clone()))
        .build()
        .unwrap();

    metrics::with_local_recorder(&recorder, || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(guard.rebuild()).unwrap();
        for key in &keys[..10] {
            assert!(!guard.check(key).is_absent());
        }
        guard.record_outcome(false);
        guard.insert("item:new");
        guard.publish_metrics();
    });

    let snapshot = snapshotter.snapshot().into_vec();
    let mut values = HashMap::new();
    let mut units = HashMap::new();
    for (key, unit, _, value) in snapshot {
        let (_, key) = key.into_parts();
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        assert!(
            labels.contains(&"guard=items".to_owned()),
            "{key:?} lacks the guard label"
        );
        let extra: Vec<_> = labels
            .iter()
            .filter(|l| !l.starts_with("guard="))
            .cloned()
            .collect();
        units.insert(key.name().to_owned(), unit);
        values.insert((key.name().to_owned(), extra.join(",")), value);
    }
    let get = |name: &str, label: &str| values.get(&(name.to_owned(), label.to_owned()));
    assert_eq!(
        get(CHECKS_TOTAL, "verdict=maybe_present"),
        Some(&DebugValue::Counter(10))
    );
    assert_eq!(
        get(CHECKS_TOTAL, "verdict=absent"),
        Some(&DebugValue::Counter(0))
    );
    assert_eq!(get(INSERTS_TOTAL, ""), Some(&DebugValue::Counter(1)));
    assert_eq!(
        get(FALSE_POSITIVES_TOTAL, ""),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(
        get(REBUILDS_TOTAL, "outcome=succeeded"),
        Some(&DebugValue::Counter(1))
    );
    assert_eq!(get(GENERATIONS, ""), Some(&DebugValue::Gauge(1.0.into())));
    assert_eq!(
        get(OBSERVED_FPR, ""),
        Some(&DebugValue::Gauge(1.0.into())),
        "1 false positive, 0 absent"
    );
    assert_eq!(
        get(PASS_THROUGH_RATIO, ""),
        Some(&DebugValue::Gauge(1.0.into()))
    );
    // One false positive is no evidence of drift: the observed rate (100
    // times the target) waits for enough answers, as the drift rebuild
    // does, rather than spike the gauge.
    match get(DRIFT_RATIO, "") {
        Some(DebugValue::Gauge(drift)) => assert!(drift.0 < 1.0, "drift {drift}"),
        other => panic!("drift: {other:?}"),
    }
    for gauge in [FILL_RATIO, ESTIMATED_FPR, DRIFT_RATIO, MEMORY_BYTES] {
        match get(gauge, "") {
            Some(DebugValue::Gauge(value)) => assert!(value.0 > 0.0, "{gauge} = {value}"),
            other => panic!("{gauge}: {other:?}"),
        }
    }
    match get(REBUILD_DURATION_SECONDS, "outcome=succeeded") {
        Some(DebugValue::Histogram(samples)) => assert_eq!(samples.len(), 1),
        other => panic!("rebuild duration: {other:?}"),
    }
    assert_eq!(get(REBUILDING, ""), Some(&DebugValue::Gauge(0.0.into())));
    match get(LAST_REBUILD_SUCCESS_SECONDS, "") {
        // After 2020: a wall-clock time, not a duration.
        Some(DebugValue::Gauge(at)) => assert!(at.0 > 1.6e9, "{at}"),
        other => panic!("last rebuild: {other:?}"),
    }
    assert_eq!(units[MEMORY_BYTES], Some(Unit::Bytes));
    // A ratio is neither a count nor a percentage: no unit.
    for ratio in [
        FILL_RATIO,
        ESTIMATED_FPR,
        OBSERVED_FPR,
        PASS_THROUGH_RATIO,
        DRIFT_RATIO,
    ] {
        assert!(ratio.ends_with("_ratio"), "{ratio}");
        assert_eq!(units[ratio], None, "{ratio}");
    }
    assert_eq!(units[REBUILD_DURATION_SECONDS], Some(Unit::Seconds));
    assert_eq!(units[CHECKS_TOTAL], Some(Unit::Count));
}

/// The recorder's values now, by metric name.
fn by_name(snapshotter: &Snapshotter) -> HashMap<String, DebugValue> {
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| (key.key().name().to_owned(), value))
        .collect()
}

/// A rate with nothing to count yet (after a rebuild) is published as NaN:
/// it was left out, and the exporter kept the value from before the
/// rebuild.
#[test]
fn a_rate_with_nothing_counted_is_published_as_nan() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let guard = Guard::builder().name("idle").build().unwrap();
    metrics::with_local_recorder(&recorder, || guard.publish_metrics());
    let observed = by_name(&snapshotter).remove(OBSERVED_FPR);
    assert!(
        matches!(observed, Some(DebugValue::Gauge(rate)) if rate.0.is_nan()),
        "{observed:?}"
    );
}

#[test]
fn the_product_modes_reach_the_recorder() {
    use bloomguard::metrics::{
        OVER_FILTERED, OVER_FILTERING_RATIO, SHADOWED_ABSENT_TOTAL, UNVERIFIED_POSITIVES_TOTAL,
        WOULD_BE_FALSE_NEGATIVES_TOTAL,
    };
    use bloomguard::{GuardedLoader, Verify};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let guard = Guard::builder()
        .name("seen")
        .expected_items(1_000)
        .seed(7)
        .build()
        .unwrap();
    for i in 0..1_000 {
        guard.insert(format!("seen:{i}"));
    }
    let store = |key: String| async move {
        Ok::<_, std::convert::Infallible>(key.starts_with("seen:").then_some(()))
    };
    let trusting = GuardedLoader::new(guard.clone(), store)
        .verify(Verify::None)
        .unwrap();
    let shadowing = GuardedLoader::new(guard.clone(), store).shadow();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let keys: Vec<String> = (0..1_000)
            .map(|i| format!("seen:{i}"))
            .chain((0..10_000).map(|i| format!("other:{i}")))
            .collect();
        trusting.contains_many(&keys).await.unwrap();
        // Written behind the guard's back: shadow mode catches it.
        assert!(shadowing.contains("seen:late").await.unwrap());
    });
    metrics::with_local_recorder(&recorder, || guard.publish_metrics());

    let stats = guard.stats();
    let values = by_name(&snapshotter);
    assert!(stats.unverified_positives >= 1_000);
    assert_eq!(
        values[UNVERIFIED_POSITIVES_TOTAL],
        DebugValue::Counter(stats.unverified_positives)
    );
    assert_eq!(
        values[OVER_FILTERED],
        DebugValue::Gauge(stats.over_filtered.into())
    );
    assert!(stats.over_filtered > 0.0);
    assert_eq!(
        values[OVER_FILTERING_RATIO],
        DebugValue::Gauge(stats.over_filtering_rate.unwrap().into())
    );
    assert_eq!(values[SHADOWED_ABSENT_TOTAL], DebugValue::Counter(1));
    assert_eq!(
        values[WOULD_BE_FALSE_NEGATIVES_TOTAL],
        DebugValue::Counter(1)
    );
}

/// The maintenance task published the guard's metrics after each tick's
/// work, and it awaits its rebuilds: a first build that took minutes left
/// every gauge unpublished until it ended (`bloomguard_warming` among them),
/// and `bloomguard_rebuilding` never read 1 for the task's own rebuilds.
/// It now publishes as a rebuild starts and every interval while it runs,
/// and `bloomguard_rebuilding` reads 0 once the task stops.
#[test]
fn the_gauges_are_published_while_the_task_rebuilds() {
    use bloomguard::metrics::WARMING;
    use bloomguard::source::{KeySource, KeyStream};

    /// A pass that never ends.
    struct Hangs;
    impl KeySource for Hangs {
        fn scan(&self) -> KeyStream<'_> {
            Box::pin(futures_util::stream::pending())
        }
    }

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // The task runs on this thread, where the recorder is installed.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let guard = Guard::builder()
                .name("slow")
                .source(Hangs)
                .maintenance_interval(std::time::Duration::from_millis(20))
                .build()
                .unwrap();
            let maintenance = guard.spawn_maintenance();
            let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
            loop {
                // One snapshot for both gauges: taking one resets what it read.
                let published = by_name(&snapshotter);
                let gauge = |name: &str| match published.get(name) {
                    Some(DebugValue::Gauge(value)) => Some(value.0),
                    _ => None,
                };
                if gauge(REBUILDING) == Some(1.0) {
                    assert_eq!(gauge(WARMING), Some(1.0), "{published:?}");
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "published while the first build runs: {published:?}"
                );
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            assert!(guard.is_warming());
            maintenance.shutdown().await;
            // Its rebuild ended with it: the gauge stayed at 1 before.
            let published = by_name(&snapshotter);
            assert!(
                matches!(published.get(REBUILDING), Some(DebugValue::Gauge(value)) if value.0 == 0.0),
                "{published:?}"
            );
        });
    });
}
