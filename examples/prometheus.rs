//! A guard's metrics in Prometheus text format.
//!
//! ```text
//! cargo run --example prometheus --features metrics
//! ```
//!
//! Installs the Prometheus recorder (no HTTP listener: the text is printed),
//! builds a guard from an in-memory store, sends it some traffic and prints
//! what a scrape would see.

use std::collections::HashSet;
use std::time::Duration;

use bloomguard::{Guard, RebuildPolicy, source};
use metrics_exporter_prometheus::PrometheusBuilder;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let prometheus = PrometheusBuilder::new().install_recorder()?;

    let store: HashSet<String> = (0..100_000).map(|i| format!("item:{i}")).collect();
    let listed = store.clone();
    let guard = Guard::builder()
        .name("items")
        .expected_items(100_000)
        .false_positive_rate(0.01)
        .source(source::from_fn(move || {
            listed.iter().cloned().collect::<Vec<_>>()
        }))
        .rebuild_policy(RebuildPolicy::default().when_drift_exceeds(2.0))
        .maintenance_interval(Duration::from_millis(100))
        .build()?;
    let maintenance = guard.spawn_maintenance();
    guard.ready().await;

    // 97 % of lookups are for ids the store does not have.
    for i in 0..100_000u64 {
        let id = if i % 100 < 3 { i } else { 1_000_000 + i };
        let key = format!("item:{id}");
        if !guard.check(&key).is_absent() {
            guard.record_outcome(store.contains(&key));
        }
    }
    guard.publish_metrics();
    maintenance.shutdown().await;

    print!("{}", prometheus.render());
    Ok(())
}
