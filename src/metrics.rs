//! Guard statistics through the [`metrics`](https://docs.rs/metrics) facade
//! (the `metrics` feature), labelled `guard = <name>`.
//!
//! Nothing is published from the request path: [`Guard::publish_metrics`]
//! copies [`Guard::stats`] into counters and gauges, and the maintenance task
//! calls it at every tick. Install any recorder (Prometheus, StatsD…) to
//! collect them; without one, publishing costs next to nothing.
//!
//! ```
//! let guard = bloomguard::Guard::builder().name("items").build()?;
//! let _ = guard.check("item:1");
//! guard.publish_metrics(); // bloomguard_checks_total{guard="items",verdict="absent"} 1, …
//! # Ok::<(), bloomguard::ConfigError>(())
//! ```

use metrics::{
    Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram,
};

use crate::guard::{Guard, RebuildOutcome, RebuildReport};

/// Checks, by `verdict` (`absent`, `maybe_present`, `warming`).
pub const CHECKS_TOTAL: &str = "bloomguard_checks_total";
/// Keys inserted.
pub const INSERTS_TOTAL: &str = "bloomguard_inserts_total";
/// Backend answers "not found" after `MaybePresent`, and those a loader's
/// confirmed-absent cache remembered (for keys the verification samples).
pub const FALSE_POSITIVES_TOTAL: &str = "bloomguard_false_positives_total";
/// Keys found in the store after an `Absent` answer (staleness check).
pub const STALE_NEGATIVES_TOTAL: &str = "bloomguard_stale_negatives_total";
/// Staleness checks that got no answer from the store (error, timeout, panic).
pub const STALENESS_CHECKS_FAILED_TOTAL: &str = "bloomguard_staleness_checks_failed_total";
/// Rebuild attempts, by `outcome` (`succeeded`, `failed`, `timed_out`, `cancelled`).
pub const REBUILDS_TOTAL: &str = "bloomguard_rebuilds_total";
/// How long rebuild attempts took.
pub const REBUILD_DURATION_SECONDS: &str = "bloomguard_rebuild_duration_seconds";
/// Share of bits set in the newest filter.
pub const FILL_RATIO: &str = "bloomguard_fill_ratio";
/// Distinct keys the fill implies.
pub const ESTIMATED_ITEMS: &str = "bloomguard_estimated_items";
/// False-positive rate the fill implies.
pub const ESTIMATED_FPR: &str = "bloomguard_estimated_false_positive_ratio";
/// False positives ÷ (false positives + absent answers) since the last
/// rebuild; NaN while there is none of either (after a rebuild, say), and
/// for good where no positive is verified (`Verify::None`).
pub const OBSERVED_FPR: &str = "bloomguard_observed_false_positive_ratio";
/// Share of checks the guard let through (`maybe_present` or `warming`):
/// see [`GuardStats::pass_through_ratio`](crate::GuardStats::pass_through_ratio)
/// for the ones that do not reach the backend.
pub const PASS_THROUGH_RATIO: &str = "bloomguard_pass_through_ratio";
/// The larger of estimated and observed FPR over the target; the observed
/// one as the drift rebuild's trigger takes it: once it rests on enough
/// answers, and without the false positives a loader's confirmed-absent
/// cache answered.
pub const DRIFT_RATIO: &str = "bloomguard_drift_ratio";
/// Live filters.
pub const GENERATIONS: &str = "bloomguard_generations";
/// Bytes of the filters.
pub const MEMORY_BYTES: &str = "bloomguard_memory_bytes";
/// Inserts that set no new bit (repeated keys, or keys crowding a few blocks).
pub const REDUNDANT_INSERTS_TOTAL: &str = "bloomguard_redundant_inserts_total";
/// 1 while the guard has not completed its first build (answering every check "maybe").
pub const WARMING: &str = "bloomguard_warming";
/// 1 while a maintenance task runs; 0 once it stopped or died.
pub const MAINTENANCE_RUNNING: &str = "bloomguard_maintenance_running";
/// 1 while a rebuild is filling a new filter.
pub const REBUILDING: &str = "bloomguard_rebuilding";
/// When the last rebuild succeeded, in seconds since the Unix epoch.
pub const LAST_REBUILD_SUCCESS_SECONDS: &str = "bloomguard_last_rebuild_success_timestamp_seconds";
/// `MaybePresent` answers trusted as present without a backend call (`Verify`).
pub const UNVERIFIED_POSITIVES_TOTAL: &str = "bloomguard_unverified_positives_total";
/// Trusted positives estimated false: absent keys answered present.
pub const OVER_FILTERED: &str = "bloomguard_over_filtered";
/// Over-filtered keys ÷ absent keys checked; NaN before any was checked.
pub const OVER_FILTERING_RATIO: &str = "bloomguard_over_filtering_ratio";
/// `Absent` answers passed on to the backend anyway (shadow mode).
pub const SHADOWED_ABSENT_TOTAL: &str = "bloomguard_shadowed_absent_total";
/// Keys the backend found after an `Absent` answer in shadow mode.
pub const WOULD_BE_FALSE_NEGATIVES_TOTAL: &str = "bloomguard_would_be_false_negatives_total";

/// 1 while the guard's fleet member is fenced (answering every check "maybe").
pub const FLEET_FENCED: &str = "bloomguard_fleet_fenced";
/// Fleet inserts, by `origin` (`local`: made through this member; `remote`: applied from others).
pub const FLEET_INSERTS_TOTAL: &str = "bloomguard_fleet_inserts_total";
/// Stream entries the member's last read found behind its position.
pub const FLEET_LAG_ENTRIES: &str = "bloomguard_fleet_lag_entries";
/// How far the member's position is behind the stream's newest entry.
pub const FLEET_LAG_SECONDS: &str = "bloomguard_fleet_lag_seconds";
/// Time since the member's lease was last renewed.
pub const FLEET_LEASE_AGE_SECONDS: &str = "bloomguard_fleet_lease_age_seconds";
/// Members holding a live lease.
pub const FLEET_MEMBERS: &str = "bloomguard_fleet_members";
/// Time from a fleet write's append to its acknowledgement by every member.
pub const FLEET_ACK_SECONDS: &str = "bloomguard_fleet_ack_seconds";

/// Describes every metric (name, unit, help) to the installed recorder;
/// [`Guard::publish_metrics`] calls it each time, so a recorder installed
/// late still learns the units.
pub fn describe() {
    describe_counter!(CHECKS_TOTAL, Unit::Count, "Guard checks, by verdict");
    describe_counter!(INSERTS_TOTAL, Unit::Count, "Keys inserted into the guard");
    describe_counter!(
        FALSE_POSITIVES_TOTAL,
        Unit::Count,
        "Backend misses after a maybe-present verdict (and its confirmed-absent cache's answers)"
    );
    describe_counter!(
        STALE_NEGATIVES_TOTAL,
        Unit::Count,
        "Keys found in the store after an absent verdict (stale filter)"
    );
    describe_counter!(
        STALENESS_CHECKS_FAILED_TOTAL,
        Unit::Count,
        "Staleness checks the store did not answer (error, timeout, panic)"
    );
    describe_counter!(REBUILDS_TOTAL, Unit::Count, "Rebuild attempts, by outcome");
    describe_histogram!(
        REBUILD_DURATION_SECONDS,
        Unit::Seconds,
        "Duration of rebuild attempts"
    );
    describe_gauge!(FILL_RATIO, "Share of bits set in the newest filter");
    describe_gauge!(
        ESTIMATED_ITEMS,
        Unit::Count,
        "Distinct keys implied by the fill"
    );
    describe_gauge!(ESTIMATED_FPR, "False-positive rate implied by the fill");
    describe_gauge!(
        OBSERVED_FPR,
        "False positives / (false positives + absent verdicts) since the last rebuild (NaN: none yet, or none verified)"
    );
    describe_gauge!(
        PASS_THROUGH_RATIO,
        "Share of checks the guard let through (maybe_present or warming)"
    );
    describe_gauge!(
        DRIFT_RATIO,
        "Larger of estimated and observed false-positive rate over the target"
    );
    describe_gauge!(GENERATIONS, Unit::Count, "Live filters");
    describe_gauge!(MEMORY_BYTES, Unit::Bytes, "Bytes held by the filters");
    describe_counter!(
        REDUNDANT_INSERTS_TOTAL,
        Unit::Count,
        "Inserts that set no new bit: repeated keys, or keys crowding a few blocks"
    );
    describe_gauge!(
        REBUILDING,
        Unit::Count,
        "1 while a rebuild is filling a new filter"
    );
    describe_gauge!(
        LAST_REBUILD_SUCCESS_SECONDS,
        Unit::Seconds,
        "When the last rebuild succeeded, in seconds since the Unix epoch"
    );
    describe_gauge!(
        WARMING,
        Unit::Count,
        "1 while the first build has not completed (every check passes)"
    );
    describe_gauge!(
        MAINTENANCE_RUNNING,
        Unit::Count,
        "1 while a maintenance task runs, 0 once it stopped or died"
    );
    describe_counter!(
        UNVERIFIED_POSITIVES_TOTAL,
        Unit::Count,
        "Maybe-present verdicts trusted as present without a backend call"
    );
    describe_gauge!(
        OVER_FILTERED,
        Unit::Count,
        "Trusted positives estimated false (absent keys answered present)"
    );
    describe_gauge!(
        OVER_FILTERING_RATIO,
        "Over-filtered keys / absent keys checked"
    );
    describe_counter!(
        SHADOWED_ABSENT_TOTAL,
        Unit::Count,
        "Absent verdicts passed on to the backend in shadow mode (calls the guard would save)"
    );
    describe_counter!(
        WOULD_BE_FALSE_NEGATIVES_TOTAL,
        Unit::Count,
        "Keys found by the backend after an absent verdict in shadow mode"
    );
    describe_gauge!(
        FLEET_FENCED,
        Unit::Count,
        "1 while the fleet member is fenced (behind acknowledged inserts: every check passes)"
    );
    describe_counter!(
        FLEET_INSERTS_TOTAL,
        Unit::Count,
        "Fleet inserts, by origin (local or remote)"
    );
    describe_gauge!(
        FLEET_LAG_ENTRIES,
        Unit::Count,
        "Stream entries the last read found behind the member's position"
    );
    describe_gauge!(
        FLEET_LAG_SECONDS,
        Unit::Seconds,
        "How far the member's position is behind the stream's newest entry"
    );
    describe_gauge!(
        FLEET_LEASE_AGE_SECONDS,
        Unit::Seconds,
        "Time since the member's lease was last renewed"
    );
    describe_gauge!(FLEET_MEMBERS, Unit::Count, "Members holding a live lease");
    describe_histogram!(
        FLEET_ACK_SECONDS,
        Unit::Seconds,
        "Time from a fleet write's append to its acknowledgement by every member"
    );
}

impl Guard {
    /// Publishes the guard's statistics to the installed `metrics` recorder.
    pub fn publish_metrics(&self) {
        describe();
        let stats = self.stats();
        let name = stats.name.clone();
        for (verdict, value) in [
            ("absent", stats.checks.absent),
            ("maybe_present", stats.checks.maybe_present),
            ("warming", stats.checks.warming),
        ] {
            counter!(CHECKS_TOTAL, "guard" => name.clone(), "verdict" => verdict).absolute(value);
        }
        counter!(INSERTS_TOTAL, "guard" => name.clone()).absolute(stats.inserts);
        counter!(FALSE_POSITIVES_TOTAL, "guard" => name.clone()).absolute(stats.false_positives);
        counter!(STALE_NEGATIVES_TOTAL, "guard" => name.clone()).absolute(stats.stale_negatives);
        counter!(STALENESS_CHECKS_FAILED_TOTAL, "guard" => name.clone())
            .absolute(stats.staleness_checks_failed);
        for (outcome, value) in [
            ("succeeded", stats.rebuilds.succeeded),
            ("failed", stats.rebuilds.failed),
            ("timed_out", stats.rebuilds.timed_out),
            ("cancelled", stats.rebuilds.cancelled),
        ] {
            counter!(REBUILDS_TOTAL, "guard" => name.clone(), "outcome" => outcome).absolute(value);
        }
        gauge!(FILL_RATIO, "guard" => name.clone()).set(stats.fill_ratio);
        gauge!(ESTIMATED_ITEMS, "guard" => name.clone()).set(stats.estimated_items);
        gauge!(ESTIMATED_FPR, "guard" => name.clone()).set(stats.estimated_fpr);
        // NaN rather than the value from before the last rebuild.
        gauge!(OBSERVED_FPR, "guard" => name.clone()).set(stats.observed_fpr.unwrap_or(f64::NAN));
        gauge!(PASS_THROUGH_RATIO, "guard" => name.clone()).set(stats.pass_through_ratio);
        let drift = self
            .evidenced_fpr_since_rebuild()
            .map_or(stats.estimated_drift, |observed| {
                (observed / stats.target_fpr).max(stats.estimated_drift)
            });
        gauge!(DRIFT_RATIO, "guard" => name.clone()).set(drift);
        gauge!(GENERATIONS, "guard" => name.clone()).set(stats.generations as f64);
        gauge!(MEMORY_BYTES, "guard" => name.clone()).set(stats.memory_bytes as f64);
        counter!(REDUNDANT_INSERTS_TOTAL, "guard" => name.clone())
            .absolute(stats.redundant_inserts);
        gauge!(WARMING, "guard" => name.clone()).set(f64::from(u8::from(stats.warming)));
        gauge!(MAINTENANCE_RUNNING, "guard" => name.clone())
            .set(f64::from(u8::from(stats.maintenance_running)));
        gauge!(REBUILDING, "guard" => name.clone()).set(f64::from(u8::from(stats.rebuilding)));
        if let Some(at) = stats.last_rebuild_succeeded_at
            && let Ok(since_epoch) = at.duration_since(std::time::UNIX_EPOCH)
        {
            gauge!(LAST_REBUILD_SUCCESS_SECONDS, "guard" => name.clone())
                .set(since_epoch.as_secs_f64());
        }
        counter!(UNVERIFIED_POSITIVES_TOTAL, "guard" => name.clone())
            .absolute(stats.unverified_positives);
        gauge!(OVER_FILTERED, "guard" => name.clone()).set(stats.over_filtered);
        gauge!(OVER_FILTERING_RATIO, "guard" => name.clone())
            .set(stats.over_filtering_rate.unwrap_or(f64::NAN));
        counter!(SHADOWED_ABSENT_TOTAL, "guard" => name.clone()).absolute(stats.shadowed_absent);
        counter!(WOULD_BE_FALSE_NEGATIVES_TOTAL, "guard" => name)
            .absolute(stats.would_be_false_negatives);
    }
}

#[cfg(feature = "redis")]
impl crate::redis::FleetSync {
    /// Publishes the member's [`stats`](Self::stats) to the installed
    /// `metrics` recorder; the member's tasks call it at every lease renewal.
    pub fn publish_metrics(&self) {
        describe();
        let stats = self.stats();
        let name = self.guard().name().to_owned();
        gauge!(FLEET_FENCED, "guard" => name.clone()).set(f64::from(u8::from(stats.fenced)));
        counter!(FLEET_INSERTS_TOTAL, "guard" => name.clone(), "origin" => "local")
            .absolute(stats.local_inserts);
        counter!(FLEET_INSERTS_TOTAL, "guard" => name.clone(), "origin" => "remote")
            .absolute(stats.remote_inserts);
        gauge!(FLEET_LAG_ENTRIES, "guard" => name.clone()).set(stats.lag_entries as f64);
        gauge!(FLEET_LAG_SECONDS, "guard" => name.clone()).set(stats.lag.as_secs_f64());
        if let Some(age) = stats.lease_age {
            gauge!(FLEET_LEASE_AGE_SECONDS, "guard" => name.clone()).set(age.as_secs_f64());
        }
        gauge!(FLEET_MEMBERS, "guard" => name).set(stats.members as f64);
    }
}

/// Records how long a fleet write waited for its acknowledgement.
#[cfg(feature = "redis")]
pub(crate) fn record_fleet_ack(guard: &str, latency: std::time::Duration) {
    histogram!(FLEET_ACK_SECONDS, "guard" => guard.to_owned()).record(latency.as_secs_f64());
}

/// Marks the guard's maintenance as stopped, from the task's last breath
/// (the task publishes the metrics, so nobody else would).
pub(crate) fn record_maintenance_stopped(guard: &str) {
    gauge!(MAINTENANCE_RUNNING, "guard" => guard.to_owned()).set(0.0);
    // Its own rebuild, if one ran, ended with it (dropped).
    gauge!(REBUILDING, "guard" => guard.to_owned()).set(0.0);
}

/// Records a finished rebuild attempt's duration.
pub(crate) fn record_rebuild(guard: &str, report: &RebuildReport) {
    let outcome = match report.outcome {
        RebuildOutcome::Succeeded => "succeeded",
        RebuildOutcome::Failed => "failed",
        RebuildOutcome::TimedOut => "timed_out",
        RebuildOutcome::Cancelled => "cancelled",
    };
    histogram!(REBUILD_DURATION_SECONDS, "guard" => guard.to_owned(), "outcome" => outcome)
        .record(report.duration.as_secs_f64());
}
