//! What a guard measures of itself: [`GuardStats`].

use tokio::time::Instant;

use super::{Guard, RebuildReport, Verdict};

/// The guard's striped counters, one slot each in every stripe.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter {
    Absent,
    MaybePresent,
    Warming,
    Inserts,
    Found,
    FalsePositives,
    StaleNegatives,
    Removed,
    ConfirmedAbsentHits,
    RedundantInserts,
}

impl Counter {
    pub(crate) const COUNT: usize = 10;

    #[inline]
    pub(crate) fn for_verdict(verdict: Verdict) -> usize {
        match verdict {
            Verdict::Absent => Self::Absent as usize,
            Verdict::MaybePresent => Self::MaybePresent as usize,
            Verdict::Warming => Self::Warming as usize,
        }
    }
}

/// What the guard remembers between rebuilds.
#[derive(Debug, Default)]
pub(crate) struct History {
    pub(crate) last_rebuild: Option<RebuildReport>,
    pub(crate) last_success_at: Option<Instant>,
    /// Keys the last successful rebuild read from the source.
    pub(crate) last_counted: Option<u64>,
    pub(crate) rebuilds: RebuildCounts,
    /// Counter values when the live filter was last rebuilt: observed rates
    /// and removals are measured from here.
    pub(crate) baseline: Baseline,
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Baseline {
    pub(crate) absent: u64,
    pub(crate) false_positives: u64,
    pub(crate) removed: u64,
}

/// Checks by verdict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerdictCounts {
    /// Answered "certainly absent": backend calls avoided.
    pub absent: u64,
    /// Answered "maybe present".
    pub maybe_present: u64,
    /// Answered while no filter was built yet.
    pub warming: u64,
}

impl VerdictCounts {
    /// All checks.
    pub fn total(&self) -> u64 {
        self.absent + self.maybe_present + self.warming
    }
}

/// Rebuilds by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RebuildCounts {
    /// Completed and swapped in.
    pub succeeded: u64,
    /// Stopped by a source error or a bad size; the old filter kept serving.
    pub failed: u64,
    /// Ran past the policy's timeout; the old filter kept serving.
    pub timed_out: u64,
    /// Dropped before completing (shutdown); the old filter kept serving.
    pub cancelled: u64,
}

/// A guard's view of itself, from [`Guard::stats`].
///
/// Counts are cumulative since the guard was built, except where a field
/// says "since the last rebuild".
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct GuardStats {
    /// The guard's name.
    pub name: String,
    /// Checks by verdict.
    pub checks: VerdictCounts,
    /// Calls of `insert` (and `begin_write`).
    pub inserts: u64,
    /// Inserts that set no new bit in the newest filter: a key inserted
    /// before, or (about the false-positive rate of the time) one whose
    /// bits others had set.
    pub redundant_inserts: u64,
    /// `redundant_inserts ÷ inserts`. Near the FPR for distinct keys spread
    /// by a secret seed; near 1 when the same keys are inserted again and
    /// again, or when keys crafted with a known seed crowd a few blocks,
    /// which the fill-based estimates cannot see (see SECURITY.md).
    pub redundant_insert_ratio: f64,
    /// Backend answers "found" after a check that passed.
    pub found: u64,
    /// Backend answers "not found" after `MaybePresent`: false positives.
    pub false_positives: u64,
    /// Keys the staleness check found in the store after an `Absent` answer.
    pub stale_negatives: u64,
    /// `MaybePresent` answers turned into "absent" by the cache of confirmed
    /// false positives, without a backend call.
    pub confirmed_absent_hits: u64,
    /// Entries in that cache (answers and insert marks).
    pub confirmed_absent_entries: usize,
    /// Keys reported removed since the last rebuild.
    pub removed_since_rebuild: u64,
    /// Share of checks that went on to the backend (`MaybePresent` or `Warming`).
    pub pass_through_ratio: f64,
    /// False positives ÷ (false positives + `Absent` answers), since the
    /// last rebuild; `None` before any of either.
    pub observed_fpr: Option<f64>,
    /// The false-positive rate the live filters' fill implies (their OR when
    /// there are several).
    pub estimated_fpr: f64,
    /// The target false-positive rate.
    pub target_fpr: f64,
    /// `observed_fpr ÷ target_fpr`.
    pub observed_drift: Option<f64>,
    /// `estimated_fpr ÷ target_fpr`: above 1 the filter holds more than it was sized for.
    pub estimated_drift: f64,
    /// Share of bits set in the newest filter.
    pub fill_ratio: f64,
    /// Distinct keys the live filters' fill implies, summed over generations.
    pub estimated_items: f64,
    /// Keys the live filters were sized for, summed over generations.
    pub capacity: u64,
    /// Whether the guard has not yet completed a pass over its source
    /// (every check answers `Warming`).
    pub warming: bool,
    /// Whether a maintenance task is running. `false` after
    /// [`Guard::spawn_maintenance`] means the task stopped, or died (its
    /// handle says which): no more rebuilds or rotations happen.
    pub maintenance_running: bool,
    /// Live filters (generations); 0 while warming, unless a filter was
    /// merged in before the first build.
    pub generations: usize,
    /// Changes at every swap of the live filters (rebuild, rotation, growth).
    pub generation: u64,
    /// Bytes of the live filters, and of the one being built if any.
    pub memory_bytes: usize,
    /// Whether a rebuild is filling a new filter now.
    pub rebuilding: bool,
    /// Rebuilds by outcome.
    pub rebuilds: RebuildCounts,
    /// The last rebuild attempt, if any.
    pub last_rebuild: Option<RebuildReport>,
}

impl Guard {
    /// Reads the guard's statistics: sums the striped counters and reads each
    /// live filter's fill. Costs microseconds; meant for a dashboard or a
    /// maintenance tick, not for every request.
    pub fn stats(&self) -> GuardStats {
        let counters = &self.inner.counters;
        let count = |counter: Counter| counters.sum(counter as usize);
        let checks = VerdictCounts {
            absent: count(Counter::Absent),
            maybe_present: count(Counter::MaybePresent),
            warming: count(Counter::Warming),
        };
        let false_positives = count(Counter::FalsePositives);
        let removed = count(Counter::Removed);
        let (baseline, rebuilds, last_rebuild) = {
            let history = self.history();
            (
                history.baseline,
                history.rebuilds,
                history.last_rebuild.clone(),
            )
        };

        let live = self.inner.live.load();
        let mut estimated_items = 0.0;
        let mut capacity = 0;
        let mut all_clear = 1.0;
        for generation in &live.generations {
            let filter = generation.filter.stats();
            estimated_items += filter.estimated_items;
            capacity += generation.capacity;
            all_clear *= 1.0 - filter.estimated_fpr;
        }
        let estimated_fpr = if live.generations.is_empty() {
            0.0
        } else {
            1.0 - all_clear
        };
        let fill_ratio = live
            .newest()
            .map_or(0.0, |newest| newest.filter.stats().fill_ratio);

        let target = self.inner.target_fpr;
        let observed_fpr = observed_rate(
            false_positives.saturating_sub(baseline.false_positives),
            checks.absent.saturating_sub(baseline.absent),
        );
        let passed = checks.maybe_present + checks.warming;
        let inserts = count(Counter::Inserts);
        let redundant_inserts = count(Counter::RedundantInserts);
        GuardStats {
            name: self.inner.name.clone(),
            checks,
            inserts,
            redundant_inserts,
            redundant_insert_ratio: ratio(redundant_inserts, inserts).unwrap_or(0.0),
            found: count(Counter::Found),
            false_positives,
            stale_negatives: count(Counter::StaleNegatives),
            confirmed_absent_hits: count(Counter::ConfirmedAbsentHits),
            confirmed_absent_entries: self.inner.confirmed_absent.as_ref().map_or(0, |c| c.len()),
            removed_since_rebuild: removed.saturating_sub(baseline.removed),
            pass_through_ratio: ratio(passed, checks.total()).unwrap_or(0.0),
            observed_fpr,
            estimated_fpr,
            target_fpr: target,
            observed_drift: observed_fpr.map(|rate| rate / target),
            estimated_drift: estimated_fpr / target,
            fill_ratio,
            estimated_items,
            capacity,
            warming: live.warming,
            maintenance_running: self
                .inner
                .maintenance_tasks
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0,
            generations: live.generations.len(),
            generation: live.number,
            memory_bytes: live.memory_bytes(),
            rebuilding: live.shadow.is_some(),
            rebuilds,
            last_rebuild,
        }
    }

    /// The counter values a rebuild's swap measures from.
    pub(crate) fn baseline_now(&self) -> Baseline {
        let counters = &self.inner.counters;
        Baseline {
            absent: counters.sum(Counter::Absent as usize),
            false_positives: counters.sum(Counter::FalsePositives as usize),
            removed: counters.sum(Counter::Removed as usize),
        }
    }
}

/// False positives ÷ (false positives + true negatives).
pub(crate) fn observed_rate(false_positives: u64, true_negatives: u64) -> Option<f64> {
    ratio(false_positives, false_positives + true_negatives)
}

fn ratio(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}
