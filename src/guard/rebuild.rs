//! Rebuilding a guard's filter from its [`KeySource`] without losing a key.
//!
//! 1. A new filter (the shadow) is installed beside the live ones: from then
//!    on every insert goes into both.
//! 2. The rebuild waits for inserts begun before the install to finish (see
//!    `writes.rs`), then for the policy's write settle.
//! 3. It streams the source into the shadow, counting keys.
//! 4. One publish makes the shadow the live filter: for checks' read
//!    sections first, then for inserts (see `LiveState::publish`); the set
//!    it replaced is freed once no section can still be reading it.
//!
//! The shadow must exist before the source is read, so its size is a guess:
//! the larger of the configured items and the best count at hand (the last
//! rebuild's, or the live filter's estimate) × headroom. When the source
//! turns out larger, the rebuild sizes again from the count it made and reads
//! the source a second time, rather than swap in a filter over its capacity.
//!
//! Any failure — a source error, a timeout, the future dropped — removes the
//! shadow and leaves the live filters serving.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use futures_util::StreamExt;
use tokio::time::Instant;
use tracing::Instrument;

pub use crate::error::RebuildError;

use super::Guard;
use super::live::{Generation, Shadow};
use super::source::KeySource;
use super::writes::WriteTracker;
use crate::error::SourceError;
use crate::filter::AtomicBloom;

/// Reads of the source per rebuild, at most (see the module docs).
const MAX_PASSES: u32 = 2;
/// How often a rebuild looks whether earlier inserts have finished.
const PENDING_WRITES_POLL: Duration = Duration::from_millis(1);

/// How a rebuild attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RebuildOutcome {
    /// The new filter is live.
    Succeeded,
    /// The source failed or the new filter could not be sized.
    Failed,
    /// The policy's timeout passed first.
    TimedOut,
    /// The rebuild was dropped before it finished (shutdown).
    Cancelled,
}

/// One rebuild attempt, as [`GuardStats::last_rebuild`](super::GuardStats::last_rebuild) shows it.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RebuildReport {
    /// How it ended.
    pub outcome: RebuildOutcome,
    /// When it ended.
    pub finished_at: SystemTime,
    /// How long it ran.
    pub duration: Duration,
    /// Keys read from the source in the last pass.
    pub keys: u64,
    /// Reads of the source (2 when the first guess at the size was too small).
    pub passes: u32,
    /// Keys the new filter was sized for.
    pub capacity: u64,
    /// What went wrong, for an attempt that did not succeed.
    pub error: Option<RebuildError>,
}

/// What a completed build swapped in.
struct Built {
    keys: u64,
    passes: u32,
    capacity: u64,
}

impl Guard {
    /// Rebuilds the filter from the source now and swaps it in; waits for a
    /// rebuild already running to end first. Inserts made meanwhile go into
    /// both filters, so the swap loses none of them.
    ///
    /// Cancel-safe: dropping the future abandons the new filter and leaves
    /// the live ones serving.
    ///
    /// # Errors
    /// [`RebuildError`]; the live filters keep serving, and the failure is
    /// counted in [`GuardStats::rebuilds`](super::GuardStats::rebuilds).
    ///
    /// # Panics
    /// Polled outside a tokio runtime, or on one built without its time
    /// driver (`enable_time`): it keeps its timeout and write settle on
    /// tokio's timer.
    pub async fn rebuild(&self) -> Result<RebuildReport, RebuildError> {
        if self.inner.source.is_none() {
            return Err(RebuildError::NoSource);
        }
        let one_at_a_time = self.inner.rebuild_lock.lock().await;
        self.rebuild_holding(one_at_a_time).await
    }

    /// The maintenance task's rebuild: only if still due once the rebuild
    /// lock is taken (`None` if not). One that held the lock meanwhile (a
    /// manual `rebuild` at startup, beside the task's first build) may have
    /// done it, and a second pass over the store would only repeat it.
    pub(super) async fn rebuild_if_due(&self) -> Option<Result<RebuildReport, RebuildError>> {
        let one_at_a_time = self.inner.rebuild_lock.lock().await;
        self.rebuild_due(Instant::now())?;
        Some(self.rebuild_holding(one_at_a_time).await)
    }

    async fn rebuild_holding(
        &self,
        _one_at_a_time: tokio::sync::MutexGuard<'_, ()>,
    ) -> Result<RebuildReport, RebuildError> {
        let Some(source) = &self.inner.source else {
            return Err(RebuildError::NoSource);
        };
        let mut attempt = Attempt {
            guard: self,
            started: Instant::now(),
            finished: false,
        };
        let timeout = self.inner.rebuild_policy.timeout;
        let span = tracing::info_span!("bloomguard.rebuild", guard = %self.inner.name);
        let waiting_for_writes = AtomicBool::new(false);
        let result = tokio::time::timeout(
            timeout,
            self.build_from(source.as_ref(), &waiting_for_writes),
        )
        .instrument(span.clone())
        .await
        .unwrap_or_else(|_| {
            Err(if waiting_for_writes.load(Ordering::Relaxed) {
                RebuildError::WritesStillOpen(timeout)
            } else {
                RebuildError::TimedOut(timeout)
            })
        });
        span.in_scope(|| attempt.finish(result))
    }

    /// Says in `waiting_for_writes` while it waits for earlier writes, so
    /// that a timeout there can name them.
    async fn build_from(
        &self,
        source: &dyn KeySource,
        waiting_for_writes: &AtomicBool,
    ) -> Result<Built, RebuildError> {
        let fp_rate = self.first_filter_rate();
        let mut capacity = self.first_guess_capacity(fp_rate);
        for pass in 1..=MAX_PASSES {
            let shadow = Arc::new(Shadow {
                generation: Arc::new(Generation::new(
                    self.new_filter(capacity, fp_rate)?,
                    capacity,
                    fp_rate,
                )),
                writes: Arc::new(WriteTracker::new()),
                missed_a_merge: AtomicBool::new(false),
            });
            let installed = Installed::new(self, Arc::clone(&shadow));
            waiting_for_writes.store(true, Ordering::Relaxed);
            self.wait_for_earlier_writes().await;
            waiting_for_writes.store(false, Ordering::Relaxed);
            tokio::time::sleep(self.inner.rebuild_policy.write_settle).await;
            let stale_so_far = self.inner.stale.so_far();
            let keys = stream_into(&shadow.generation.filter, source).await?;
            if keys <= capacity || pass == MAX_PASSES {
                installed.commit(keys, stale_so_far)?;
                return Ok(Built {
                    keys,
                    passes: pass,
                    capacity,
                });
            }
            tracing::info!(
                guard = %self.inner.name,
                keys,
                capacity,
                "the source holds more keys than the new filter was sized for: reading it again"
            );
            // A whole pass's count, kept whether the next pass ends or not:
            // a retry after a timeout there sizes from it, and reads once.
            self.history().last_counted = Some(keys);
            capacity = self.capacity_for(keys);
        }
        unreachable!("the last pass always commits")
    }

    /// The larger of the configured items and `counted × headroom`.
    fn capacity_for(&self, counted: u64) -> u64 {
        let with_headroom = (counted as f64 * self.inner.rebuild_policy.headroom).ceil() as u64;
        self.inner.expected_items.max(with_headroom)
    }

    /// The capacity for the best count at hand before reading the source:
    /// the last whole pass's, or what the live filters' fill implies,
    /// whichever is larger, within the memory budget. A guess over it would
    /// fail every retry the same way before reading the source, so a store
    /// that outgrew the budget once (or a fill that counts deleted keys)
    /// would keep the guard from ever rebuilding; within it, each retry
    /// reads the store, fails at the second pass while the store is too
    /// large, and succeeds once it fits.
    fn first_guess_capacity(&self, fp_rate: f64) -> u64 {
        let last_counted = self.history().last_counted.unwrap_or(0);
        let live = self.inner.live.load();
        let estimated: f64 = live
            .generations
            .iter()
            .map(|g| g.filter.stats().estimated_items)
            .sum();
        let estimated = self.capacity_for(estimated as u64);
        let guess = self.capacity_for(last_counted).max(estimated);
        self.inner.filters.fitting(guess, fp_rate)
    }

    /// Waits until every insert begun before the shadow was installed has
    /// finished, abandoned rebuilds' pending writes included.
    async fn wait_for_earlier_writes(&self) {
        let live = &self.inner.live;
        let mut wait = live.begin_writes_wait();
        while !live.writes_quiet(&mut wait) {
            tokio::time::sleep(PENDING_WRITES_POLL).await;
        }
    }

    fn record_attempt(&self, report: RebuildReport, built: Option<&Built>) {
        let mut history = self.history();
        let counts = &mut history.rebuilds;
        match report.outcome {
            RebuildOutcome::Succeeded => counts.succeeded += 1,
            RebuildOutcome::Failed => counts.failed += 1,
            RebuildOutcome::TimedOut => counts.timed_out += 1,
            RebuildOutcome::Cancelled => counts.cancelled += 1,
        }
        if let Some(built) = built {
            history.last_counted = Some(built.keys);
            history.last_success_at = Some(Instant::now());
            history.last_success_took = Some(report.duration);
            history.last_success_time = Some(std::time::SystemTime::now());
        }
        #[cfg(feature = "metrics")]
        crate::metrics::record_rebuild(&self.inner.name, &report);
        history.last_rebuild = Some(report);
        drop(history);
        if built.is_some() {
            // After the record, so that a woken `ready()` sees the build in the stats.
            self.inner.left_warming.notify_waiters();
        }
    }
}

/// Streams every key of `source` into `filter`; returns how many it read.
async fn stream_into(filter: &AtomicBloom, source: &dyn KeySource) -> Result<u64, RebuildError> {
    let mut keys = source.scan();
    let mut counted = 0;
    while let Some(batch) = keys.next().await {
        let batch = batch.map_err(RebuildError::Source)?;
        counted += batch.len() as u64;
        filter.insert_many(&batch);
        // A source that is always ready (an in-memory one) would otherwise
        // hold the worker thread, and the timeout could never fire.
        tokio::task::yield_now().await;
    }
    Ok(counted)
}

/// A shadow taking inserts beside the live filters; removed on drop unless
/// committed.
struct Installed<'a> {
    guard: &'a Guard,
    shadow: Arc<Shadow>,
    committed: bool,
}

impl<'a> Installed<'a> {
    fn new(guard: &'a Guard, shadow: Arc<Shadow>) -> Self {
        guard.inner.live.install_shadow(Arc::clone(&shadow));
        Self {
            guard,
            shadow,
            committed: false,
        }
    }

    /// Makes the shadow the only live filter, unless a merge it missed
    /// would be lost by that (then it is abandoned); `stale_so_far`: the
    /// staleness findings before the source was read, which it repairs.
    fn commit(mut self, keys: u64, stale_so_far: u64) -> Result<(), RebuildError> {
        let inner = &self.guard.inner;
        // The store's keys come in through the scan, not one insert each.
        self.guard.stamp_every_key();
        if !inner.live.commit_shadow(&self.shadow) {
            return Err(RebuildError::MergedDuringRebuild);
        }
        self.committed = true;
        let baseline = self.guard.baseline_now();
        self.guard.history().baseline = baseline;
        inner.stale.repaired(stale_so_far);
        tracing::info!(
            guard = %inner.name,
            keys,
            capacity = self.shadow.generation.capacity,
            "rebuilt filter is live"
        );
        Ok(())
    }
}

impl Drop for Installed<'_> {
    fn drop(&mut self) {
        if !self.committed {
            self.guard.inner.live.abandon_shadow(&self.shadow);
        }
    }
}

/// One rebuild attempt; records itself as cancelled if dropped unfinished.
struct Attempt<'a> {
    guard: &'a Guard,
    started: Instant,
    finished: bool,
}

impl Attempt<'_> {
    fn finish(
        &mut self,
        result: Result<Built, RebuildError>,
    ) -> Result<RebuildReport, RebuildError> {
        self.finished = true;
        let (outcome, built, error) = match result {
            Ok(built) => (RebuildOutcome::Succeeded, Some(built), None),
            Err(error) => {
                let outcome = match error {
                    RebuildError::TimedOut(_) | RebuildError::WritesStillOpen(_) => {
                        RebuildOutcome::TimedOut
                    }
                    _ => RebuildOutcome::Failed,
                };
                (outcome, None, Some(error))
            }
        };
        let report = self.report(outcome, built.as_ref(), error.clone());
        self.guard.record_attempt(report.clone(), built.as_ref());
        match error {
            None => Ok(report),
            Some(error) => {
                tracing::warn!(guard = %self.guard.inner.name, %error, "rebuild failed; the old filter keeps serving");
                Err(error)
            }
        }
    }

    fn report(
        &self,
        outcome: RebuildOutcome,
        built: Option<&Built>,
        error: Option<RebuildError>,
    ) -> RebuildReport {
        RebuildReport {
            outcome,
            finished_at: SystemTime::now(),
            duration: self.started.elapsed(),
            keys: built.map_or(0, |b| b.keys),
            passes: built.map_or(0, |b| b.passes),
            capacity: built.map_or(0, |b| b.capacity),
            error,
        }
    }
}

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        if !self.finished {
            // Unwinding: a bug (most likely the key source's), not a shutdown.
            let (outcome, error) = if std::thread::panicking() {
                let panicked = SourceError::new("the rebuild panicked (see the panic's message)");
                (RebuildOutcome::Failed, RebuildError::Source(panicked))
            } else {
                (RebuildOutcome::Cancelled, RebuildError::Cancelled)
            };
            let report = self.report(outcome, None, Some(error));
            self.guard.record_attempt(report, None);
        }
    }
}
