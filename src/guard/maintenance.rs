//! The background task that applies a guard's policies.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::FutureExt as _;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::stats::Counter;
use super::{Guard, Inner, Lifecycle, RebuildError, staleness::Verifier};
use crate::sync::unpoisoned;
use crate::task::StoppableTask;

/// How long the staleness check waits for the store's answer.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a failing staleness check is logged at most.
const FAILED_CHECK_REPORT_SPACING: Duration = Duration::from_secs(60);
/// The pause after a failed staleness check, doubled with each failure in
/// a row up to the second: a store that refuses is not asked about every
/// queued sample at once (samples taken meanwhile wait in the queue, or
/// are dropped once it is full).
const FAILED_CHECK_PAUSE: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(5));
/// The least time from a successful rebuild to one for observed drift (see
/// `Guard::rebuild_due`).
const OBSERVED_DRIFT_SPACING: Duration = Duration::from_secs(60);
/// And at least this many times the last successful rebuild's length, so
/// that such rebuilds keep the store busy a tenth of the time at most.
const OBSERVED_DRIFT_SPACING_FACTOR: u32 = 10;

/// The running maintenance task of a guard, from [`Guard::spawn_maintenance`].
///
/// Dropping the handle stops the task at its next step (a rebuild in
/// progress is abandoned, and the live filters keep serving);
/// [`shutdown`](Self::shutdown) also waits for it to end. The task holds no
/// strong reference to the guard between its steps, so it also ends once
/// every [`Guard`] clone is dropped (after the step it is in: a rebuild
/// under way runs to its end or its timeout, a staleness check to its
/// answer).
///
/// If the task dies (a panic in a [`KeySource`](crate::KeySource), say), it
/// logs at ERROR, [`panicked`](Self::panicked) turns true and
/// [`GuardStats::maintenance_running`](crate::GuardStats::maintenance_running)
/// false: no rebuild or rotation happens until a new task is spawned (a
/// fleet's rebuild turn it held is given back first).
///
/// Keep the handle; a statement that drops it is flagged by the compiler:
///
/// ```compile_fail
/// #![deny(unused_must_use)]
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let guard = bloomguard::Guard::builder().build().unwrap();
/// guard.spawn_maintenance(); // dropped at once: the task stops, a guard with a source stays warming
/// # });
/// ```
///
/// ```
/// #![deny(unused_must_use)]
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// let guard = bloomguard::Guard::builder().build().unwrap();
/// let maintenance = guard.spawn_maintenance(); // runs until shut down or dropped
/// maintenance.shutdown().await;
/// # });
/// ```
#[derive(Debug)]
#[must_use = "dropping the handle stops the maintenance task at once (a guard with a source then stays warming): keep it for as long as the guard serves"]
pub struct MaintenanceHandle {
    task: StoppableTask,
}

impl MaintenanceHandle {
    /// Stops the task and waits until it has ended.
    pub async fn shutdown(self) {
        self.task.shutdown().await;
    }

    /// Whether the task has ended (stopped, or died: see [`panicked`](Self::panicked)).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Whether the task ended by panicking.
    pub fn panicked(&self) -> bool {
        self.task.panicked()
    }
}

impl Guard {
    /// Starts the task that applies the guard's policies on the current
    /// tokio runtime: the first build, scheduled and triggered rebuilds
    /// (retried with exponential backoff after failures), rotation, the
    /// staleness check, and (with the `metrics` feature) publishing metrics.
    ///
    /// Run one per guard: the staleness check's queue goes to the first task
    /// started (and back to the guard when it ends).
    ///
    /// # Panics
    /// Outside a tokio runtime, as [`tokio::spawn`] does, or on one built
    /// without its time driver (`enable_time`), which the task sleeps on.
    pub fn spawn_maintenance(&self) -> MaintenanceHandle {
        self.spawn_maintenance_inner(None)
    }

    /// [`spawn_maintenance`](Self::spawn_maintenance), stopping also when
    /// the application's `shutdown` token is cancelled: one token can stop
    /// a server and every guard's maintenance together.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
    /// use tokio_util::sync::CancellationToken;
    ///
    /// let shutdown = CancellationToken::new();
    /// let guard = bloomguard::Guard::builder().build()?;
    /// let maintenance = guard.spawn_maintenance_until(&shutdown);
    /// shutdown.cancel();
    /// maintenance.shutdown().await; // already stopping: returns at once
    /// assert!(!guard.stats().maintenance_running);
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// # }).unwrap();
    /// ```
    ///
    /// # Panics
    /// As [`spawn_maintenance`](Self::spawn_maintenance).
    pub fn spawn_maintenance_until(&self, shutdown: &CancellationToken) -> MaintenanceHandle {
        self.spawn_maintenance_inner(Some(shutdown))
    }

    fn spawn_maintenance_inner(&self, shutdown: Option<&CancellationToken>) -> MaintenanceHandle {
        // Here rather than at the task's first sleep, where the panic would
        // only be logged, and the guard would stay warming for ever.
        drop(tokio::time::sleep(Duration::ZERO));
        // Lent from here, so that it goes back even if the task is dropped
        // before it first runs (its runtime shut down).
        let verifier = LentVerifier::take(&self.inner);
        let task = Task {
            guard: Arc::downgrade(&self.inner),
            wake: Arc::clone(&self.inner.wake),
            interval: self.inner.maintenance_interval,
            backoff: Backoff::new(self.inner.rebuild_policy.retry_backoff),
            retry_at: None,
            warming_reported_at: None,
            checks_failed_in_a_row: 0,
            checks_resume_at: None,
            failed_check_reported_at: None,
            _running: Running::count(&self.inner.maintenance_tasks, &self.inner.name),
        };
        let span = tracing::info_span!("bloomguard.maintenance", guard = %self.inner.name);
        MaintenanceHandle {
            task: StoppableTask::spawn("guard maintenance", shutdown, |stop| {
                tracing::Instrument::instrument(task.run(stop, verifier), span)
            }),
        }
    }

    /// Why a rebuild is due now, if it is.
    ///
    /// One for observed drift waits [`OBSERVED_DRIFT_SPACING`] after the
    /// last success, or ten times that success's length: without a
    /// confirmed-absent cache (the HTTP layer has none) its evidence can be
    /// one absent key asked again and again, which a rebuild of the same
    /// size (same seed, same keys) lets through again, and the guard would
    /// rescan its store as fast as the evidence came back.
    pub(super) fn rebuild_due(&self, now: Instant) -> Option<&'static str> {
        self.inner.source.as_ref()?;
        let policy = &self.inner.rebuild_policy;
        if self.is_warming() {
            return Some("first build");
        }
        if self.inner.stale.unrepaired() {
            return Some("stale filter");
        }
        let (last_success_at, last_counted, baseline, last_success_took) = {
            let history = self.history();
            (
                history.last_success_at,
                history.last_counted,
                history.baseline,
                history.last_success_took,
            )
        };
        if let Some(every) = policy.every
            && last_success_at.is_none_or(|at| now >= at + every)
        {
            return Some("schedule");
        }
        if let Some(fraction) = policy.removed_fraction {
            let removed = self
                .inner
                .counters
                .sum(Counter::Removed as usize)
                .saturating_sub(baseline.removed);
            if removed as f64 > fraction * last_counted.unwrap_or(0).max(1) as f64 {
                return Some("removed keys");
            }
        }
        if let Some(threshold) = policy.drift_threshold {
            let stats = self.stats();
            if stats.estimated_drift > threshold {
                return Some("estimated drift");
            }
            let spacing = OBSERVED_DRIFT_SPACING
                .max(last_success_took.unwrap_or_default() * OBSERVED_DRIFT_SPACING_FACTOR);
            if self
                .evidenced_fpr_since_rebuild()
                .is_some_and(|rate| rate > threshold * self.inner.target_fpr)
                && last_success_at.is_none_or(|at| now >= at + spacing)
            {
                return Some("observed drift");
            }
        }
        None
    }

    /// When the newest generation of a rotating guard is due to retire;
    /// never while warming, where a rotation changes nothing (and a filter
    /// merged then would be due at once, every tick, until the first build).
    fn next_rotation(&self) -> Option<Instant> {
        let Lifecycle::Rotate { period, .. } = self.inner.lifecycle else {
            return None;
        };
        let live = self.inner.live.load();
        if live.warming {
            return None;
        }
        Some(live.newest()?.opened_at() + period)
    }

    /// Asks the store about a key the guard answered `Absent` for; returns
    /// why the store gave no answer, if it did not.
    async fn verify_absent(&self, verifier: &Verifier, key: Vec<u8>) -> Option<String> {
        // A panic in the user's check is a failed check, not the end of
        // the task that rebuilds and rotates.
        let asked = AssertUnwindSafe(async { verifier.exists(key.clone()).await }).catch_unwind();
        let hash = self.hash(&key);
        let failure = match tokio::time::timeout(VERIFY_TIMEOUT, asked).await {
            // Re-checked after the store answered: an insert that preceded
            // the write the store just showed is in the filter by now. The
            // filters, not the verdict: fenced (catching up after taking a
            // fleet snapshot), the guard answers "maybe" for a key the set
            // it took may lack.
            Ok(Ok(Ok(true))) if !self.filters_hold(hash) => {
                // The store holds it: never `Absent` again, whether or not
                // a rebuild follows (a guard without a source has none), and
                // kept for a fleet snapshot that replaces the set
                // (`replace_from_snapshot`).
                self.inner.stale.record(hash);
                self.insert_hash(hash);
                self.inner.counters.add(Counter::StaleNegatives as usize, 1);
                // No key in the line: keys can be personal data.
                tracing::warn!(
                    guard = %self.inner.name,
                    key_bytes = key.len(),
                    rebuilding = self.inner.source.is_some(),
                    "stale filter: the store holds a key the guard answered absent for \
                     (written without Guard::insert?); inserted it"
                );
                None
            }
            Ok(Ok(Ok(_))) => None,
            Ok(Ok(Err(error))) => Some(error.to_string()),
            Ok(Err(_panic)) => Some("the check panicked".to_owned()),
            Err(_) => Some(format!("no answer within {VERIFY_TIMEOUT:?}")),
        };
        if failure.is_some() {
            self.inner
                .counters
                .add(Counter::StalenessChecksFailed as usize, 1);
        }
        failure
    }
}

/// How long a guard waits before asking again for a rebuild that another
/// guard sharing its set is making.
const ANOTHER_GUARDS_TURN: Duration = Duration::from_secs(1);

/// Who rebuilds when several guards share one set (the members of a
/// fleet): the maintenance task asks before each rebuild it schedules, and
/// reports each one that succeeded, so that one guard rebuilds for all and
/// the others replace their sets with its result.
pub(crate) trait RebuildTurns: Send + Sync {
    /// Whether this guard may rebuild now; `false`: another one is.
    fn take(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send + '_>>;
    /// The rebuild this guard took the turn for has ended: committed (its
    /// set is then shared), failed or cancelled. The turn is given back
    /// either way, so that a failed rebuild holds up no other guard. The
    /// task awaits it, also when shutting down: a task of its own would end
    /// with the runtime, before the turn is given back.
    fn ended(
        &self,
        committed: bool,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>;
}

impl Guard {
    /// Has the maintenance task take turns at rebuilding (`None`: rebuild
    /// whenever due).
    #[cfg(feature = "redis")]
    pub(crate) fn set_rebuild_turns(&self, turns: Option<Arc<dyn RebuildTurns>>) {
        *unpoisoned(self.inner.rebuild_turns.lock()) = turns;
    }

    /// Marks the guard as followed by a fleet member; `false` when one
    /// follows it already.
    #[cfg(feature = "redis")]
    pub(crate) fn claim_for_fleet(&self) -> bool {
        !self.inner.in_fleet.swap(true, Ordering::AcqRel)
    }

    /// Whether a fleet member follows the guard (or is joining with it).
    #[cfg(feature = "redis")]
    pub(crate) fn in_fleet(&self) -> bool {
        self.inner.in_fleet.load(Ordering::Acquire)
    }

    /// The member that claimed the guard no longer follows the fleet.
    #[cfg(feature = "redis")]
    pub(crate) fn release_from_fleet(&self) {
        self.inner.in_fleet.store(false, Ordering::Release);
    }

    fn rebuild_turns(&self) -> Option<Arc<dyn RebuildTurns>> {
        unpoisoned(self.inner.rebuild_turns.lock()).clone()
    }
}

struct Task {
    guard: Weak<Inner>,
    wake: Arc<Notify>,
    interval: Duration,
    backoff: Backoff,
    retry_at: Option<Instant>,
    /// When the task last logged that the guard is still warming.
    warming_reported_at: Option<Instant>,
    /// Staleness checks failed since the last one answered.
    checks_failed_in_a_row: u64,
    /// When the staleness check may ask the store again, after a failure.
    checks_resume_at: Option<Instant>,
    /// When the task last logged a failed staleness check.
    failed_check_reported_at: Option<Instant>,
    /// Counts the task in `GuardStats::maintenance_running` until it is
    /// dropped: returned, panicked or cancelled alike.
    _running: Running,
}

/// One running maintenance task, counted while it lives.
struct Running {
    tasks: Arc<AtomicUsize>,
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    guard: String,
}

impl Running {
    fn count(tasks: &Arc<AtomicUsize>, guard: &str) -> Self {
        tasks.fetch_add(1, Ordering::Relaxed);
        Self {
            tasks: Arc::clone(tasks),
            guard: guard.to_owned(),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let last = self.tasks.fetch_sub(1, Ordering::Relaxed) == 1;
        #[cfg(feature = "metrics")]
        if last {
            crate::metrics::record_maintenance_stopped(&self.guard);
        }
        #[cfg(not(feature = "metrics"))]
        let _ = last;
    }
}

/// Runs `work` (a rebuild, which may take minutes), publishing the guard's
/// metrics as it starts (a first build's `warming`) and every `interval`
/// until it ends (`rebuilding` from the first interval on, once the new
/// filter is installed): the gauges would otherwise stand still meanwhile,
/// and a first build would leave them unpublished until it ended.
#[cfg(feature = "metrics")]
async fn publishing_meanwhile<T>(
    guard: &Guard,
    interval: Duration,
    work: impl Future<Output = T>,
) -> T {
    let mut work = std::pin::pin!(work);
    loop {
        guard.publish_metrics();
        tokio::select! {
            output = &mut work => return output,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

#[cfg(not(feature = "metrics"))]
async fn publishing_meanwhile<T>(
    _guard: &Guard,
    _interval: Duration,
    work: impl Future<Output = T>,
) -> T {
    work.await
}

impl Task {
    async fn run(mut self, stop: CancellationToken, mut verifier: LentVerifier) {
        loop {
            let Some(guard) = self.upgrade() else { break };
            if verifier.verifier.is_none() {
                // A task started before the last one gave it back (a handle
                // dropped, and another task spawned at once).
                verifier = LentVerifier::take(&guard.inner);
            }
            let now = Instant::now();
            if guard.next_rotation().is_some_and(|at| now >= at)
                && let Err(error) = guard.rotate_if_due(now)
            {
                tracing::warn!(guard = %guard.name(), %error, "cannot rotate");
            }
            self.report_long_warming(&guard, now);
            if self.retry_at.is_none_or(|at| now >= at)
                && let Some(reason) = guard.rebuild_due(now)
            {
                let turns = guard.rebuild_turns();
                let give_back = async |committed| {
                    if let Some(turns) = &turns {
                        turns.ended(committed).await;
                    }
                };
                let my_turn = match &turns {
                    None => true,
                    Some(turns) => tokio::select! {
                        () = stop.cancelled() => {
                            give_back(false).await; // in case it was taken
                            break;
                        }
                        my_turn = turns.take() => my_turn,
                    },
                };
                if my_turn {
                    tracing::debug!(guard = %guard.name(), reason, "rebuilding");
                    tokio::select! {
                        () = stop.cancelled() => {
                            give_back(false).await;
                            break;
                        }
                        result = AssertUnwindSafe(
                            publishing_meanwhile(&guard, self.interval, guard.rebuild_if_due()),
                        )
                        .catch_unwind() => {
                            let result = match result {
                                Ok(result) => result,
                                Err(panic) => {
                                    // A panic in the key source still ends
                                    // the task, as documented, but holds no
                                    // other guard's rebuilds up meanwhile.
                                    give_back(false).await;
                                    std::panic::resume_unwind(panic);
                                }
                            };
                            // Sharing a committed set uploads it: a stop
                            // meanwhile gives the turn back without it.
                            let committed = result.as_ref().is_some_and(Result::is_ok);
                            tokio::select! {
                                () = stop.cancelled() => {
                                    give_back(false).await;
                                    break;
                                }
                                () = give_back(committed) => {}
                            }
                            if let Some(result) = result {
                                self.after_rebuild(result.map(|_| ()));
                            }
                        }
                    }
                } else {
                    // Another guard of the set is rebuilding it for all.
                    self.retry_at = Some(now + ANOTHER_GUARDS_TURN);
                }
            }
            #[cfg(feature = "metrics")]
            guard.publish_metrics();
            // Sets replaced while a check was preempted mid-read wait here.
            guard.inner.live.reclaim(Some(super::sections::GRACE_WAIT));

            let now = Instant::now();
            // A retry waits for its backoff, not for the tick after it.
            let retry_at = self.retry_at.filter(|&at| at > now);
            let checks_resume_at = self.checks_resume_at.filter(|&at| at > now);
            let wake_at = [guard.next_rotation(), retry_at, checks_resume_at]
                .into_iter()
                .flatten()
                .fold(now + self.interval, Instant::min);
            // Holding the guard while asleep would keep it alive forever.
            drop(guard);
            let woken = self.wake.notified();
            let key_to_verify = tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep_until(wake_at) => None,
                () = woken => None,
                Some(key) = recv(&mut verifier.verifier), if checks_resume_at.is_none() => Some(key),
            };
            if let (Some(key), Some(check), Some(guard)) =
                (key_to_verify, verifier.verifier.as_ref(), self.upgrade())
            {
                tokio::select! {
                    () = stop.cancelled() => break,
                    failure = guard.verify_absent(check, key) => {
                        self.report_failed_check(&guard, failure);
                    }
                }
            }
        }
        // Stopped (its handle dropped or shut down) while the guard serves
        // on, and no other task took over: only this line and
        // `maintenance_running` tell. (This task still counts itself.)
        if let Some(guard) = self.upgrade()
            && guard.inner.maintenance_tasks.load(Ordering::Acquire) <= 1
        {
            tracing::info!(
                guard = %guard.name(),
                "maintenance stopped: no rebuild, rotation or staleness check until another \
                 task is spawned"
            );
        }
    }

    /// Logs a failing staleness check at once, then at most once a minute
    /// (with how many failed in a row): seen, without a line per sample.
    fn report_failed_check(&mut self, guard: &Guard, failure: Option<String>) {
        let Some(failure) = failure else {
            self.checks_failed_in_a_row = 0;
            self.checks_resume_at = None;
            return;
        };
        self.checks_failed_in_a_row += 1;
        let now = Instant::now();
        let (first, longest) = FAILED_CHECK_PAUSE;
        let doublings = (self.checks_failed_in_a_row - 1).min(16) as u32;
        self.checks_resume_at = Some(now + first.saturating_mul(1 << doublings).min(longest));
        if self
            .failed_check_reported_at
            .is_none_or(|at| now.saturating_duration_since(at) >= FAILED_CHECK_REPORT_SPACING)
        {
            self.failed_check_reported_at = Some(now);
            tracing::warn!(
                guard = %guard.inner.name,
                %failure,
                in_a_row = self.checks_failed_in_a_row,
                "staleness check failed: stale answers go unnoticed while it fails"
            );
        }
    }

    /// Logs a guard still warming past its rebuild timeout, once per timeout:
    /// it fails open meanwhile, so only the log and the stats show it.
    fn report_long_warming(&mut self, guard: &Guard, now: Instant) {
        let timeout = guard.inner.rebuild_policy.timeout;
        let since = self.warming_reported_at.unwrap_or(guard.inner.built_at);
        if guard.is_warming() && now.saturating_duration_since(since) > timeout {
            self.warming_reported_at = Some(now);
            let stats = guard.stats();
            tracing::warn!(
                guard = %guard.name(),
                warming_for = ?now.saturating_duration_since(guard.inner.built_at),
                failed_builds = stats.rebuilds.failed + stats.rebuilds.timed_out,
                "the guard is still warming (answering every check \"maybe\"): its first build has not completed"
            );
        }
    }

    fn upgrade(&self) -> Option<Guard> {
        self.guard.upgrade().map(|inner| Guard { inner })
    }

    fn after_rebuild(&mut self, result: Result<(), RebuildError>) {
        match result {
            Ok(()) => {
                self.backoff.reset();
                self.retry_at = None;
            }
            Err(_) => self.retry_at = Some(Instant::now() + self.backoff.next_wait()),
        }
    }
}

/// The staleness check's queue, lent to one task: handed back to the guard
/// for a task started later however this one ends (returned, panicked in a
/// key source, aborted with its runtime).
struct LentVerifier {
    guard: Weak<Inner>,
    verifier: Option<Verifier>,
}

impl LentVerifier {
    /// The guard's queue, if no other task holds it.
    fn take(inner: &Arc<Inner>) -> Self {
        Self {
            guard: Arc::downgrade(inner),
            verifier: unpoisoned(inner.verifier.lock()).take(),
        }
    }
}

impl Drop for LentVerifier {
    fn drop(&mut self) {
        if let (Some(inner), Some(verifier)) = (self.guard.upgrade(), self.verifier.take()) {
            *unpoisoned(inner.verifier.lock()) = Some(verifier);
            // A task started meanwhile takes it at its next turn: now.
            inner.wake.notify_one();
        }
    }
}

/// The next key to verify, or never when there is no staleness check.
async fn recv(verifier: &mut Option<Verifier>) -> Option<Vec<u8>> {
    match verifier {
        Some(verifier) => verifier.keys.recv().await,
        None => std::future::pending().await,
    }
}

/// Waits between failed rebuilds: doubles from `first` up to `max`.
#[derive(Debug)]
struct Backoff {
    first: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    fn new((first, max): (Duration, Duration)) -> Self {
        Self {
            first,
            max,
            next: first,
        }
    }

    /// The next wait: between half and all of the current step ("equal
    /// jitter"), so that guards failing together (a store restart under a
    /// fleet) do not retry in lockstep; the step doubles up to `max`.
    fn next_wait(&mut self) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(self.max);
        step / 2 + (step / 2).mul_f64(unit_random())
    }

    fn reset(&mut self) {
        self.next = self.first;
    }
}

/// A number in [0, 1) that differs from call to call and process to process:
/// std's randomly keyed hasher, since jitter needs no more than that.
fn unit_random() -> f64 {
    use std::hash::{BuildHasher, RandomState};
    (RandomState::new().hash_one(0u8) >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;
    use crate::Verdict;

    #[test]
    fn backoff_waits_half_to_all_of_a_doubling_step() {
        let first = Duration::from_millis(100);
        let max = Duration::from_millis(800);
        let mut waits = Vec::new();
        for _ in 0..10 {
            let mut backoff = Backoff::new((first, max));
            for step in [100, 200, 400, 800, 800] {
                let step = Duration::from_millis(step);
                let wait = backoff.next_wait();
                assert!(
                    step / 2 <= wait && wait <= step,
                    "{wait:?} for a step of {step:?}"
                );
                waits.push(wait);
            }
        }
        let mut distinct = waits.clone();
        distinct.sort();
        distinct.dedup();
        assert!(distinct.len() > waits.len() / 2, "jittered: {waits:?}");
    }

    /// A rotation of a warming set changes nothing, so a warming guard is
    /// not due one. A filter merged while warming is its newest generation:
    /// once its period passed, the maintenance task rotated (a full-size
    /// filter made and dropped) and woke again at once, until the first
    /// build committed.
    /// A rebuild repairs the stale answers found before it read its source,
    /// not one found while it reads: the scan may have passed that key.
    #[tokio::test]
    async fn a_stale_answer_found_while_a_rebuild_reads_is_not_repaired_by_it() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let source = crate::guard::source::GatedSource::new(vec![b"listed".to_vec()], &gate);
        let scans = Arc::clone(&source.scans);
        let guard = crate::Guard::builder()
            .expected_items(1_000)
            .seed(7)
            .source(source)
            .rebuild_policy(crate::RebuildPolicy::default().write_settle(Duration::ZERO))
            // The store holds every key asked about.
            .staleness_check(1.0, |_| async { Ok(true) })
            .build()
            .unwrap();
        let verifier = guard.inner.verifier.lock().unwrap().take().unwrap();
        gate.add_permits(1);
        guard.rebuild().await.unwrap();

        let rebuild = tokio::spawn({
            let guard = guard.clone();
            async move { guard.rebuild().await }
        });
        while scans.load(Ordering::Relaxed) < 2 {
            tokio::task::yield_now().await;
        }
        // Written behind the guard's back after the scan listed the store.
        let key = b"written while the rebuild reads".to_vec();
        assert!(!guard.filters_hold(guard.hash(&key)));
        guard.verify_absent(&verifier, key).await;
        assert_eq!(guard.rebuild_due(Instant::now()), Some("stale filter"));

        gate.add_permits(1);
        rebuild.await.unwrap().unwrap();
        assert_eq!(
            guard.rebuild_due(Instant::now()),
            Some("stale filter"),
            "the rebuild that committed never read the key"
        );
    }

    /// A key the staleness check found (written behind the guard's back)
    /// went into this guard's set alone: a fleet snapshot adopted before
    /// the guard's own rebuild replaced the set, and the guard answered
    /// `Absent` again for a key it knew the store holds. The set adopted
    /// gets the keys of unrepaired findings back.
    #[tokio::test]
    async fn a_stale_answer_found_is_kept_across_an_adopted_snapshot() {
        let member = |name: &str| {
            crate::Guard::builder()
                .name(name)
                .expected_items(1_000)
                .seed(7)
                .staleness_check(1.0, |_| async { Ok(true) })
                .build()
                .unwrap()
        };
        let guard = member("a");
        let verifier = guard.inner.verifier.lock().unwrap().take().unwrap();
        let key = b"written behind the guard".to_vec();
        assert!(!guard.filters_hold(guard.hash(&key)));
        guard.verify_absent(&verifier, key.clone()).await;
        assert_eq!(guard.check(&key), Verdict::MaybePresent);

        // Another member's set, which never held the key.
        let other = member("b");
        other.insert("elsewhere");
        let snapshot =
            crate::guard::snapshot::LiveSnapshot::from_bytes(&other.encode_live_set().unwrap())
                .unwrap();
        guard.replace_from_snapshot(snapshot, true, true).unwrap();
        // A rebuilt set taken counts as this member's rebuild (for an alert
        // on its age).
        assert!(guard.stats().last_rebuild_succeeded_at.is_some());
        guard.set_fenced(false);
        assert_eq!(guard.check("elsewhere"), Verdict::MaybePresent);
        assert_eq!(guard.check(&key), Verdict::MaybePresent);
    }

    /// Fenced (catching up after taking a fleet snapshot), the guard
    /// answers "maybe" for every key: the check's re-check read that
    /// verdict, took the key for held and dropped the finding, while the
    /// set taken lacked the key, which answered `Absent` once the fence
    /// lifted. The re-check reads the filters.
    #[tokio::test]
    async fn a_stale_answer_found_while_fenced_is_kept() {
        let guard = crate::Guard::builder()
            .expected_items(1_000)
            .seed(7)
            .staleness_check(1.0, |_| async { Ok(true) })
            .build()
            .unwrap();
        let verifier = guard.inner.verifier.lock().unwrap().take().unwrap();
        let key = b"written behind the guard".to_vec();
        guard.set_fenced(true);
        guard.verify_absent(&verifier, key.clone()).await;
        guard.set_fenced(false);
        assert_eq!(guard.check(&key), Verdict::MaybePresent);
    }

    /// A finding this guard's own rebuild repaired is still put into a set
    /// it takes after: a fleet snapshot read before that rebuild (Redis was
    /// unreachable, the member rebuilt alone, then recovered from the fleet's
    /// older snapshot) lacks the key, and the repair had let it go.
    #[tokio::test]
    async fn a_stale_answer_repaired_is_kept_across_an_older_snapshot_taken_after() {
        let store = Arc::new(std::sync::Mutex::new(vec!["listed".to_owned()]));
        let guard = crate::Guard::builder()
            .expected_items(1_000)
            .seed(7)
            .source(crate::source::from_fn({
                let store = Arc::clone(&store);
                move || store.lock().unwrap().clone()
            }))
            .rebuild_policy(crate::RebuildPolicy::default().write_settle(Duration::ZERO))
            .staleness_check(1.0, |_| async { Ok(true) })
            .build()
            .unwrap();
        let verifier = guard.inner.verifier.lock().unwrap().take().unwrap();
        guard.rebuild().await.unwrap();
        let older = guard.encode_live_set().unwrap();

        let key = "written behind the guard";
        store.lock().unwrap().push(key.to_owned());
        guard.verify_absent(&verifier, key.into()).await;
        guard.rebuild().await.unwrap();
        assert_eq!(guard.rebuild_due(Instant::now()), None, "repaired");

        let older = crate::guard::snapshot::LiveSnapshot::from_bytes(&older).unwrap();
        guard.replace_from_snapshot(older, true, true).unwrap();
        guard.set_fenced(false);
        assert_eq!(guard.check(key), Verdict::MaybePresent);
    }

    /// The task finds a rotation due, then rotates: a rotation in between
    /// (`Guard::rotate`, or a fleet snapshot from a member that just
    /// rotated) must not be followed by a second one at once, which would
    /// drop the generation that was newest a moment ago, with its keys.
    #[tokio::test(start_paused = true)]
    async fn a_rotation_found_due_is_not_applied_to_a_set_rotated_meanwhile() {
        let period = Duration::from_secs(3600);
        let guard = crate::Guard::builder()
            .expected_items(1_000)
            .lifecycle(crate::Lifecycle::rotate(2, period))
            .build()
            .unwrap();
        tokio::time::advance(period).await;
        let now = Instant::now();
        assert!(guard.next_rotation().is_some_and(|at| now >= at), "due");
        guard.insert("just before the other rotation");
        guard.rotate().unwrap();
        guard.rotate_if_due(now).unwrap();
        assert_eq!(
            guard.check("just before the other rotation"),
            Verdict::MaybePresent
        );
    }

    #[test]
    fn a_warming_guard_is_never_due_to_rotate() {
        let guard = crate::Guard::builder()
            .expected_items(1_000)
            .seed(7)
            .lifecycle(crate::Lifecycle::rotate(2, Duration::from_millis(1)))
            .rebuild_policy(crate::RebuildPolicy::default().write_settle(Duration::ZERO))
            .source(crate::source::from_fn(Vec::<Vec<u8>>::new))
            .build()
            .unwrap();
        let merged = crate::AtomicBloom::with_seed(1_000, 0.01, 7).unwrap();
        guard.merge_filter(merged).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(guard.is_warming());
        assert_eq!(guard.next_rotation(), None);
    }
}
