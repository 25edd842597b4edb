//! [`GuardBuilder`]: a guard's options, checked when it is built.

use std::fmt;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;

use super::live::{Generation, LiveSet, LiveState};
use super::policy::{Lifecycle, RebuildPolicy, check_duration};
use super::source::{KeySource, SourceError};
use super::staleness::{StaleFindings, StalenessCheck};
use super::stats::History;
use super::{Guard, Inner};
use crate::error::ConfigError;
use crate::filter::{FilterBuilder, check_false_positive_rate};
use crate::stats::ThreadCounters;

/// Options for a [`Guard`]. Every option has a default (the name's is
/// `"default"`); name each guard of a process so that its logs and metrics
/// tell it apart.
///
/// ```
/// use std::time::Duration;
/// use bloomguard::{Guard, Lifecycle, RebuildPolicy};
///
/// let guard = Guard::builder()
///     .name("seen_items")
///     .expected_items(1_000_000)
///     .false_positive_rate(0.01)
///     // "Seen in the last 30 days": a key stays at least 30 of 31 periods.
///     .lifecycle(Lifecycle::rotate(31, Duration::from_secs(24 * 3600)))
///     .build()?;
/// assert_eq!(guard.stats().generations, 1);
/// # Ok::<(), bloomguard::ConfigError>(())
/// ```
#[must_use]
pub struct GuardBuilder {
    name: String,
    expected_items: u64,
    false_positive_rate: f64,
    lifecycle: Lifecycle,
    rebuild_policy: RebuildPolicy,
    source: Option<Box<dyn KeySource>>,
    /// Seed and memory budget of every filter the guard makes; sized per filter.
    filters: FilterBuilder,
    staleness: Option<StalenessCheck>,
    maintenance_interval: Duration,
}

impl Default for GuardBuilder {
    fn default() -> Self {
        Self {
            name: "default".to_owned(),
            expected_items: Self::DEFAULT_EXPECTED_ITEMS,
            false_positive_rate: Self::DEFAULT_FALSE_POSITIVE_RATE,
            lifecycle: Lifecycle::Single,
            rebuild_policy: RebuildPolicy::default(),
            source: None,
            filters: FilterBuilder::for_items(
                Self::DEFAULT_EXPECTED_ITEMS,
                Self::DEFAULT_FALSE_POSITIVE_RATE,
            ),
            staleness: None,
            maintenance_interval: Self::DEFAULT_MAINTENANCE_INTERVAL,
        }
    }
}

impl GuardBuilder {
    /// Items a guard is sized for unless told: 1 million.
    pub const DEFAULT_EXPECTED_ITEMS: u64 = 1_000_000;
    /// The target false-positive rate unless told: 1 %.
    pub const DEFAULT_FALSE_POSITIVE_RATE: f64 = 0.01;
    /// How often the maintenance task looks at the policies unless told: 1 s.
    pub const DEFAULT_MAINTENANCE_INTERVAL: Duration = Duration::from_secs(1);

    /// How often the maintenance task evaluates the rebuild triggers and
    /// (with the `metrics` feature) publishes metrics. Rotations and the
    /// retry of a failed rebuild (after its backoff) do not wait for this
    /// tick, but rotations do wait for a rebuild or a staleness check the
    /// task is running (see [`Lifecycle::Rotate`](crate::Lifecycle::Rotate)).
    pub fn maintenance_interval(mut self, interval: Duration) -> Self {
        self.maintenance_interval = interval;
        self
    }

    /// A name for logs and the `guard` metrics label (default `"default"`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Distinct keys the filter is sized for (per generation when rotating).
    pub fn expected_items(mut self, items: u64) -> Self {
        self.expected_items = items;
        self
    }

    /// The false-positive rate to hold at `expected_items` (default 1 %).
    pub fn false_positive_rate(mut self, rate: f64) -> Self {
        self.false_positive_rate = rate;
        self
    }

    /// How the filters age: [`Lifecycle::Single`] (default), rotation or growth.
    pub fn lifecycle(mut self, lifecycle: Lifecycle) -> Self {
        self.lifecycle = lifecycle;
        self
    }

    /// When and how to rebuild from the [`source`](Self::source).
    pub fn rebuild_policy(mut self, policy: RebuildPolicy) -> Self {
        self.rebuild_policy = policy;
        self
    }

    /// Where rebuilds read every key from. A guard with a source starts
    /// [`Verdict::Warming`](super::Verdict::Warming) and serves once its first build completes; a
    /// guard without one starts with an empty filter and learns every key
    /// through [`Guard::insert`].
    pub fn source(mut self, source: impl KeySource) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// Fixes the hash seed of every filter of the guard (random otherwise),
    /// for filters that must agree across processes: see
    /// [`FilterBuilder::seed`], and keep a fixed seed secret.
    pub fn seed(mut self, seed: u64) -> Self {
        self.filters = self.filters.seed(seed);
        self
    }

    /// The most bytes one filter of the guard may take: see
    /// [`FilterBuilder::max_bytes`]. A rebuild makes one filter of the
    /// whole store, sized for `max(expected_items, keys × headroom)` (see
    /// [`RebuildPolicy::headroom`](crate::RebuildPolicy::headroom)): a
    /// store whose filter would take more fails its rebuilds
    /// ([`RebuildError::Config`](crate::RebuildError::Config)), even on a
    /// [growing](crate::Lifecycle::Grow) guard whose generations each fit.
    /// The live filters keep serving, or the guard stays warming if none
    /// was built yet, until the store fits again (each retry reads it).
    /// Leave room for the headroom: at least `headroom` times the store's
    /// filter. In a fleet, a member adopts the fleet's snapshot whatever
    /// its filters take (the budget is not among the settings members
    /// compare): give every member the same budget.
    pub fn max_bytes(mut self, max_bytes: u64) -> Self {
        self.filters = self.filters.max_bytes(max_bytes);
        self
    }

    /// Samples `fraction` (in (0, 1]) of the `Absent` answers and asks `exists` whether
    /// the store has the key anyway, off the request path, in the
    /// maintenance task. A key found there was written without
    /// [`Guard::insert`]: the filter is stale. The guard inserts it, counts
    /// it ([`GuardStats::stale_negatives`](super::GuardStats::stale_negatives)),
    /// logs it and, with a source, rebuilds (other keys may have been written
    /// so). In a fleet the key goes into this member only, and every fleet
    /// snapshot it adopts gets the key back (the last 4,096 found, repaired
    /// by a rebuild or not: a snapshot older than that rebuild lacks them).
    /// A check that fails, times out (5 s) or panics is followed by a pause
    /// (100 ms, doubling with each failure in a row up to 5 s; samples taken
    /// meanwhile wait in the queue or are dropped), is counted in
    /// [`GuardStats::staleness_checks_failed`](super::GuardStats::staleness_checks_failed)
    /// and logged at WARN (at once, then at most once a minute; a panic is
    /// also printed by the panic hook, each time).
    ///
    /// A sampled answer costs one copy of the key; when the queue of keys to
    /// verify is full, samples are dropped.
    pub fn staleness_check<F, Fut>(mut self, fraction: f64, exists: F) -> Self
    where
        F: Fn(Vec<u8>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<bool, SourceError>> + Send + 'static,
    {
        self.staleness = Some(StalenessCheck::new(fraction, exists));
        self
    }

    /// Builds the guard.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first option out of range: zero items, a
    /// rate outside [1e-8, 1), a lifecycle or rebuild parameter out of range
    /// (a rotating guard's write settle must be shorter than its window),
    /// a `maintenance_interval` of zero or over 100 years,
    /// a staleness fraction outside (0, 1], or a first filter over the
    /// memory budget.
    pub fn build(self) -> Result<Guard, ConfigError> {
        check_false_positive_rate(self.false_positive_rate)?;
        check_duration("maintenance_interval", self.maintenance_interval)?;
        self.lifecycle.validate()?;
        self.rebuild_policy.validate(self.false_positive_rate)?;
        // A write lands within the settle of its insert, and the window
        // counts from the insert: a settle as long lets a key leave first.
        if let Lifecycle::Rotate {
            generations,
            period,
        } = self.lifecycle
            && self.rebuild_policy.write_settle >= period.saturating_mul(generations as u32 - 1)
        {
            return Err(ConfigError::out_of_range(
                "write_settle",
                format!("{:?}", self.rebuild_policy.write_settle),
                "a duration shorter than a rotating guard's window, (generations − 1) × period",
            ));
        }
        let first_rate = self.lifecycle.first_filter_rate(self.false_positive_rate);
        if first_rate < crate::filter::MIN_FALSE_POSITIVE_RATE
            && self.false_positive_rate >= crate::filter::MIN_FALSE_POSITIVE_RATE
        {
            // The rate asked for is valid; what each filter of the
            // lifecycle would get is not: name the one the user gave.
            return Err(ConfigError::out_of_range(
                "false_positive_rate",
                self.false_positive_rate,
                "a rate that leaves each filter of the lifecycle at least 1e-8 (a rotating \
                 guard's filters each get the rate / generations, a growing guard's first \
                 the rate × (1 − tightening))",
            ));
        }
        // Sizing the first filter checks items, rate and budget, even for a
        // guard that only builds it after its first scan.
        let (filters, seed) = self.filters.with_fixed_seed();
        let first = filters.sized_for(self.expected_items, first_rate).build()?;
        let (staleness, verifier) = match self.staleness {
            Some(check) => {
                let (sampler, verifier) = check.split()?;
                (Some(sampler), Some(verifier))
            }
            None => (None, None),
        };
        let live = match self.source {
            Some(_) => LiveSet::warming(),
            None => LiveSet::warming().serving(vec![Arc::new(Generation::new(
                first,
                self.expected_items,
                first_rate,
            ))]),
        };
        // Chooses the read sections' barrier here: registering for
        // membarrier(2) waits out a grace period of a threaded process's
        // CPUs (10 to 23 ms measured), which would otherwise fall on the
        // first check, a request's.
        #[cfg(not(bloomguard_loom))]
        let _ = crate::sync::light_barrier_is_enough();
        let guard = Guard {
            inner: Arc::new(Inner {
                name: self.name,
                expected_items: self.expected_items,
                target_fpr: self.false_positive_rate,
                lifecycle: self.lifecycle,
                rebuild_policy: self.rebuild_policy,
                source: self.source,
                seed,
                filters,
                live: LiveState::new(live),
                rebuild_lock: tokio::sync::Mutex::new(()),
                counters: ThreadCounters::new(),
                history: Mutex::new(History::default()),
                stale: StaleFindings::default(),
                wake: Arc::new(Notify::new()),
                left_warming: Notify::new(),
                maintenance_tasks: Arc::new(AtomicUsize::new(0)),
                built_at: tokio::time::Instant::now(),
                maintenance_interval: self.maintenance_interval,
                staleness,
                verifier: Mutex::new(verifier),
                rebuild_turns: Mutex::new(None),
                #[cfg(feature = "redis")]
                in_fleet: std::sync::atomic::AtomicBool::new(false),
                insert_clock: OnceLock::new(),
                untimed_writes: AtomicUsize::new(0),
                open_write_keys: Mutex::default(),
            }),
        };
        Ok(guard)
    }
}

impl fmt::Debug for GuardBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardBuilder")
            .field("name", &self.name)
            .field("expected_items", &self.expected_items)
            .field("false_positive_rate", &self.false_positive_rate)
            .field("lifecycle", &self.lifecycle)
            .field("rebuild_policy", &self.rebuild_policy)
            .field("source", &self.source.is_some())
            .field("staleness_check", &self.staleness.is_some())
            .finish_non_exhaustive()
    }
}
