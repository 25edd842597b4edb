//! What a guard measures of itself: [`GuardStats`].

use tokio::time::Instant;

use super::{Guard, RebuildReport, Verdict};

/// The guard's striped counters, one slot each in every stripe.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter {
    /// Every check; `Absent` answers are the checks neither of the next
    /// two counts.
    Checks,
    MaybePresent,
    Warming,
    Inserts,
    Found,
    FalsePositives,
    StaleNegatives,
    /// Confirmed-absent cache hits counted as false positives (those of
    /// keys the verification samples).
    RememberedFalsePositives,
    /// Staleness checks that got no answer: an error, a timeout, a panic.
    StalenessChecksFailed,
    Removed,
    ConfirmedAbsentHits,
    RedundantInserts,
    /// Backend answers "found" after `MaybePresent` (a subset of `Found`).
    TruePositives,
    UnverifiedPositives,
    ShadowedAbsent,
    WouldBeFalseNegatives,
}

impl Counter {
    pub(crate) const COUNT: usize = 16;
}

/// Checks counted, and how many of them answered `MaybePresent` and `Warming`.
///
/// A check adds 1 to a fixed counter and, only when its answer is not
/// `Absent`, 1 to another: a branch the CPU predicts (most checks of a
/// guard answer `Absent`), so counting never waits on the probe's cache
/// miss. Counting into the verdict's own counter did: its address, or the
/// value added, waited on the miss, and the next check's count waited on
/// that, so consecutive checks' misses overlapped less.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct VerdictTally {
    pub(crate) checks: u64,
    pub(crate) maybe_present: u64,
    pub(crate) warming: u64,
}

impl VerdictTally {
    #[inline]
    pub(crate) fn add(&mut self, verdict: Verdict) {
        self.checks += 1;
        match verdict {
            Verdict::Absent => {}
            Verdict::MaybePresent => self.maybe_present += 1,
            Verdict::Warming => self.warming += 1,
        }
    }
}

/// What the guard remembers between rebuilds.
#[derive(Debug, Default)]
pub(crate) struct History {
    pub(crate) last_rebuild: Option<RebuildReport>,
    pub(crate) last_success_at: Option<Instant>,
    /// How long the last successful rebuild of this guard took.
    pub(crate) last_success_took: Option<std::time::Duration>,
    /// The same moment by the wall clock, for dashboards.
    pub(crate) last_success_time: Option<std::time::SystemTime>,
    /// Keys the last whole pass over the source read (a successful
    /// rebuild's, or a first pass whose filter proved too small).
    pub(crate) last_counted: Option<u64>,
    pub(crate) rebuilds: RebuildCounts,
    /// Counter values when the live filter was last rebuilt: observed rates
    /// and removals are measured from here.
    pub(crate) baseline: Baseline,
}

#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Baseline {
    pub(crate) outcomes: Outcomes,
    pub(crate) removed: u64,
}

/// What the checks' answers turned out to be, as far as anyone looked.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Outcomes {
    /// `Absent` verdicts: true negatives.
    pub(crate) absent: u64,
    /// `MaybePresent` verdicts the backend did not confirm.
    pub(crate) false_positives: u64,
    /// `MaybePresent` verdicts the backend confirmed.
    pub(crate) true_positives: u64,
    /// `MaybePresent` verdicts trusted without asking.
    pub(crate) unverified: u64,
    /// Of `false_positives`, those a loader's confirmed-absent cache
    /// answered: a "not found" remembered, not asked again.
    pub(crate) remembered: u64,
}

impl Outcomes {
    fn since(self, before: Self) -> Self {
        Self {
            absent: self.absent.saturating_sub(before.absent),
            false_positives: self.false_positives.saturating_sub(before.false_positives),
            true_positives: self.true_positives.saturating_sub(before.true_positives),
            unverified: self.unverified.saturating_sub(before.unverified),
            remembered: self.remembered.saturating_sub(before.remembered),
        }
    }

    /// [`observed_fpr`](Self::observed_fpr) once it rests on enough
    /// outcomes to tell drift from sampling noise; `None` before.
    pub(crate) fn evidenced_fpr(&self) -> Option<f64> {
        (self.false_positives >= MIN_OBSERVED_FALSE_POSITIVES
            && self.false_positives + self.absent >= MIN_OBSERVED_OUTCOMES)
            .then(|| self.observed_fpr())
            .flatten()
    }

    /// The outcomes the backend answered: without the remembered false
    /// positives, which one key asked again and again can fill.
    pub(crate) fn asked(self) -> Self {
        Self {
            false_positives: self.false_positives.saturating_sub(self.remembered),
            remembered: 0,
            ..self
        }
    }

    /// The share of the verified positives the backend did not confirm;
    /// `None` before any was verified. The verified ones are a hash-chosen
    /// sample, independent of the filter's bits, so the share applies to
    /// the trusted ones too.
    fn verified_false_share(&self) -> Option<f64> {
        ratio(
            self.false_positives,
            self.false_positives + self.true_positives,
        )
    }

    /// False positives among all positives, the trusted ones estimated by
    /// the verified ones' false share. `None` when positives were trusted
    /// and none was verified.
    pub(crate) fn estimated_false_positives(&self) -> Option<f64> {
        if self.unverified == 0 {
            return Some(self.false_positives as f64);
        }
        let false_share = self.verified_false_share()?;
        Some(self.false_positives as f64 + self.unverified as f64 * false_share)
    }

    /// False positives ÷ (false positives + true negatives), the false
    /// positives estimated where some were trusted.
    pub(crate) fn observed_fpr(&self) -> Option<f64> {
        let false_positives = self.estimated_false_positives()?;
        let negatives = false_positives + self.absent as f64;
        (negatives > 0.0).then(|| false_positives / negatives)
    }
}

/// Checks by verdict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerdictCounts {
    /// Answered "certainly absent": backend calls avoided (in shadow mode,
    /// asked anyway).
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
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct GuardStats {
    /// The guard's name.
    pub name: String,
    /// Checks by verdict.
    pub checks: VerdictCounts,
    /// Calls of `insert` (and `begin_write`), and the keys the staleness
    /// check found in the store and inserted.
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
    /// A `MaybePresent` answered by a loader's confirmed-absent cache (a
    /// "not found" remembered) counts as one too, for a key the
    /// verification samples (every key, unless it samples).
    pub false_positives: u64,
    /// Keys the staleness check found in the store after an `Absent` answer.
    pub stale_negatives: u64,
    /// Staleness checks that got no answer from the store (an error, a
    /// timeout, a panic in the check): while they fail, `stale_negatives`
    /// staying at 0 says nothing.
    pub staleness_checks_failed: u64,
    /// `MaybePresent` answers turned into "absent" by a loader's cache of
    /// confirmed false positives (see
    /// [`GuardedLoader::confirmed_absent_cache`](crate::GuardedLoader::confirmed_absent_cache)),
    /// without a backend call (counted in `false_positives` too, where the
    /// verification samples the key).
    pub confirmed_absent_hits: u64,
    /// `MaybePresent` answers trusted as present without a backend call
    /// ([`Verify::Sample`](crate::Verify::Sample), [`Verify::None`](crate::Verify::None)).
    pub unverified_positives: u64,
    /// How many of those were false, estimated: absent keys answered
    /// "present" (over-filtered). From the share of false positives among the
    /// verified positives, or from the filters' fill when none was verified.
    pub over_filtered: f64,
    /// `over_filtered` ÷ the absent keys checked (absent answers, false
    /// positives and over-filtered keys): the share of absent keys hidden,
    /// to hold against the product's tolerance. `None` before any.
    pub over_filtering_rate: Option<f64>,
    /// `Absent` answers passed on to the backend anyway (shadow mode): the
    /// backend calls enforcing would have saved.
    pub shadowed_absent: u64,
    /// Keys found by the backend after an `Absent` answer in shadow mode:
    /// false negatives the guard would have given. Should stay 0.
    pub would_be_false_negatives: u64,
    /// Keys reported removed since the last rebuild.
    pub removed_since_rebuild: u64,
    /// Share of checks the guard let through (`MaybePresent` or `Warming`).
    /// Not all of them reach the backend: a [`Verify`](crate::Verify) mode
    /// trusts some positives, and a loader's confirmed-absent cache answers
    /// others; in shadow mode `Absent` answers reach it too.
    pub pass_through_ratio: f64,
    /// False positives ÷ (false positives + `Absent` answers), since the
    /// last rebuild; `None` before any of either. With positives trusted
    /// unverified, their false ones are estimated from the verified sample;
    /// `None` when none was verified. It counts the false positives a
    /// loader's confirmed-absent cache answered; the drift rebuild leaves
    /// them out (see
    /// [`RebuildPolicy::when_drift_exceeds`](crate::RebuildPolicy::when_drift_exceeds)).
    /// On a guard that does not rebuild (no source, no trigger; a rotation
    /// does not count) it is the average since the guard began, which a
    /// recent change barely moves: for a recent window, take the rate of
    /// the counters (`false_positives`, `checks`) over it.
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
    /// Whether the guard's fleet member is fenced: behind the inserts the
    /// fleet acknowledged, it answers every check `MaybePresent` until it
    /// has caught up (see `redis::fleet`).
    pub fenced: bool,
    /// Whether a maintenance task is running. `false` after
    /// [`Guard::spawn_maintenance`] means the task stopped, or died (its
    /// handle says which): no more rebuilds or rotations happen.
    pub maintenance_running: bool,
    /// Live filters (generations); 0 while warming, unless a filter was
    /// merged in before the first build.
    pub generations: usize,
    /// How many times the live set was replaced (by a rebuild, a rotation
    /// or growth): a change means the filters answering are new.
    pub swaps: u64,
    /// Bytes of the live filters, and of the one being built if any.
    pub memory_bytes: usize,
    /// Whether a rebuild is filling a new filter now.
    pub rebuilding: bool,
    /// Rebuilds by outcome.
    pub rebuilds: RebuildCounts,
    /// The last rebuild attempt, if any.
    pub last_rebuild: Option<RebuildReport>,
    /// When the last rebuild succeeded, by the wall clock: this guard's, or
    /// a fleet member's whose rebuilt set it took (so that an alert on its
    /// age fires on no member of a fleet that rebuilds by turns).
    pub last_rebuild_succeeded_at: Option<std::time::SystemTime>,
}

impl Guard {
    /// Reads the guard's statistics: sums the striped counters and reads each
    /// live filter's fill. Costs microseconds; meant for a dashboard or a
    /// maintenance tick, not for every request.
    pub fn stats(&self) -> GuardStats {
        let counters = &self.inner.counters;
        let count = |counter: Counter| counters.sum(counter as usize);
        // Absent answers and false positives are read once, here, so that
        // the counts and the rates made from them agree.
        let checks = self.verdict_counts();
        let outcomes = self.outcomes_with(checks.absent);
        let removed = count(Counter::Removed);
        let (baseline, rebuilds, last_rebuild, last_rebuild_succeeded_at) = {
            let history = self.history();
            (
                history.baseline,
                history.rebuilds,
                history.last_rebuild.clone(),
                history.last_success_time,
            )
        };

        let live = self.inner.live.load();
        let mut estimated_items = 0.0;
        let mut capacity = 0;
        let mut all_clear = 1.0;
        for generation in &live.generations {
            let filter = generation.filter.stats();
            estimated_items += filter.estimated_items;
            capacity = generation.capacity.saturating_add(capacity);
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
        let observed_fpr = outcomes.since(baseline.outcomes).observed_fpr();
        let over_filtered = over_filtered(&outcomes, checks.maybe_present, estimated_fpr);
        let negatives = over_filtered + (outcomes.absent + outcomes.false_positives) as f64;
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
            false_positives: outcomes.false_positives,
            stale_negatives: count(Counter::StaleNegatives),
            staleness_checks_failed: count(Counter::StalenessChecksFailed),
            confirmed_absent_hits: count(Counter::ConfirmedAbsentHits),
            unverified_positives: outcomes.unverified,
            over_filtered,
            over_filtering_rate: (negatives > 0.0).then(|| over_filtered / negatives),
            shadowed_absent: count(Counter::ShadowedAbsent),
            would_be_false_negatives: count(Counter::WouldBeFalseNegatives),
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
            fenced: live.fenced,
            maintenance_running: self
                .inner
                .maintenance_tasks
                .load(std::sync::atomic::Ordering::Relaxed)
                > 0,
            generations: live.generations.len(),
            swaps: live.number,
            memory_bytes: live.memory_bytes(),
            rebuilding: live.shadow.is_some(),
            rebuilds,
            last_rebuild,
            last_rebuild_succeeded_at,
        }
    }

    /// The counter values a rebuild's swap measures from.
    pub(crate) fn baseline_now(&self) -> Baseline {
        Baseline {
            outcomes: self.outcomes(),
            removed: self.inner.counters.sum(Counter::Removed as usize),
        }
    }

    /// The checks counted since the guard was built, by verdict.
    pub(crate) fn verdict_counts(&self) -> VerdictCounts {
        let count = |counter: Counter| self.inner.counters.sum(counter as usize);
        // Checks read after the two it contains, so that it is at least their sum.
        let maybe_present = count(Counter::MaybePresent);
        let warming = count(Counter::Warming);
        let checks = count(Counter::Checks);
        VerdictCounts {
            absent: checks.saturating_sub(maybe_present + warming),
            maybe_present,
            warming,
        }
    }

    /// The outcomes counted since the guard was built.
    pub(crate) fn outcomes(&self) -> Outcomes {
        self.outcomes_with(self.verdict_counts().absent)
    }

    fn outcomes_with(&self, absent: u64) -> Outcomes {
        let count = |counter: Counter| self.inner.counters.sum(counter as usize);
        Outcomes {
            absent,
            false_positives: count(Counter::FalsePositives),
            true_positives: count(Counter::TruePositives),
            unverified: count(Counter::UnverifiedPositives),
            remembered: count(Counter::RememberedFalsePositives),
        }
    }

    /// The false-positive rate observed since the live filters were last
    /// rebuilt, as the drift rebuild's trigger and the drift gauge take it:
    /// judged on the verified false positives' count (the evidence), at the
    /// rate that counts the trusted ones too; both as the backend answered
    /// them: one absent key a bot asks again and again, remembered by a
    /// loader's cache, is no drift, and a rebuild (same seed, same keys)
    /// would let it through again.
    pub(crate) fn evidenced_fpr_since_rebuild(&self) -> Option<f64> {
        let baseline = self.history().baseline;
        self.outcomes()
            .since(baseline.outcomes)
            .asked()
            .evidenced_fpr()
    }
}

/// Outcomes since the last rebuild before an observed drift counts: fewer
/// would let sampling noise trigger rebuilds (or spike the drift metric).
const MIN_OBSERVED_OUTCOMES: u64 = 10_000;
/// False positives since the last rebuild before an observed drift counts.
const MIN_OBSERVED_FALSE_POSITIVES: u64 = 20;

/// The trusted positives estimated false. Without a verified sample, from
/// the fill: of the `absent / (1 - fpr)` absent keys checked, `fpr` passed
/// as positives; their share of all positives applies to the trusted ones.
fn over_filtered(outcomes: &Outcomes, positives: u64, estimated_fpr: f64) -> f64 {
    if outcomes.unverified == 0 {
        return 0.0;
    }
    let false_share = outcomes.verified_false_share().unwrap_or_else(|| {
        let passed_absent =
            outcomes.absent as f64 * estimated_fpr / (1.0 - estimated_fpr).max(f64::MIN_POSITIVE);
        (passed_absent / positives.max(1) as f64).min(1.0)
    });
    outcomes.unverified as f64 * false_share
}

fn ratio(part: u64, whole: u64) -> Option<f64> {
    (whole > 0).then(|| part as f64 / whole as f64)
}
