//! What a guard does as its data changes: [`Lifecycle`] and [`RebuildPolicy`].

use std::time::Duration;

use crate::error::ConfigError;

/// How a guard's filters age: one of three shapes. A [`RebuildPolicy`] policy may
/// be combined with any of them.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Lifecycle {
    /// One filter, replaced only by a rebuild. The default.
    Single,
    /// `generations` filters, each open for inserts for `period`: a query ORs
    /// them, an insert goes to the newest, and every `period` the oldest is
    /// dropped and a fresh one opened. A key stays present for at least
    /// `(generations − 1) × period` and at most `generations × period`
    /// (counted from the insert, or from the drop of a write's
    /// [`PendingWrite`](crate::PendingWrite), when the write landed; on the
    /// other members of a fleet, from the write's first append, or from its
    /// second where the write took over half the write settle):
    /// "seen in the last 30 days" without deletion, in bounded memory, with
    /// `rotate(31, one_day)` (a window of W periods takes W + 1 generations).
    /// The maintenance task rotates between its other work: a rotation
    /// that falls due during a rebuild (on a fleet, with taking the turn
    /// for it and sharing its set) or a staleness check waits for it to
    /// end, and the oldest keys stay present for as much longer. The
    /// write settle must be shorter than the window: a key could otherwise
    /// leave before its write lands. A write held open by a `PendingWrite`
    /// keeps its key present all the while on a guard of its own; in a
    /// fleet, one held open longer than `(generations − 1) × period`
    /// leaves the other members' filters, and the snapshots they publish
    /// (which the writer may adopt), until its second append, at its end.
    ///
    /// `expected_items` is per generation, and each generation is sized for
    /// `false_positive_rate / generations`, so that the OR meets the target.
    ///
    /// A rebuild (from a source, on any trigger) replaces every generation
    /// with one filter of what the source lists, whose window starts with
    /// the rebuild: give a rotating guard a source only if it lists just
    /// the keys inside the window (a store that expires them), or every key
    /// it ever held is present again for a whole window, in a filter sized
    /// for all of them. A key inserted but not listed by the source leaves
    /// at the rebuild. A generation restored from a snapshot (a fleet
    /// member's) keeps the age it had when the snapshot was taken: its
    /// window runs on longer by the time the snapshot waited.
    Rotate {
        /// How many generations are queried (2 to 64).
        generations: usize,
        /// How long each generation takes inserts.
        period: Duration,
    },
    /// Starts with one filter for `expected_items`; when the newest is full
    /// it opens another, `expansion` times larger, with its false-positive
    /// rate multiplied by `tightening`. The first filter is sized for
    /// `false_positive_rate × (1 − tightening)`, so the rates form a series
    /// whose sum — the compound rate — stays under the target however many
    /// filters are added (the scheme of RedisBloom's scalable filters, after
    /// Almeida et al., "Scalable Bloom Filters", 2007). For sets of unknown size.
    ///
    /// A guard opens at most 32 filters (with `expansion` 2.0, about 4·10⁹
    /// times `expected_items`; with 1.0, only 32 times): past the last one's
    /// capacity it keeps filling that one, whose rate then climbs, and logs
    /// a warning when it opens it. A rebuild starts over from one filter,
    /// sized for the keys it read.
    Grow {
        /// Capacity ratio of each new filter to the previous one (1.0 to 16.0; 2.0 is usual).
        expansion: f64,
        /// FPR ratio of each new filter to the previous one (in (0, 1); 0.5 is usual).
        tightening: f64,
    },
}

/// The most filters a growing guard opens; past it, it keeps filling the last one.
pub(crate) const MAX_GROWN_FILTERS: usize = 32;

/// The longest duration any guard option accepts: 100 years. Longer ones
/// (`Duration::MAX` among them) would overflow the clock arithmetic of the
/// maintenance task, so the builder refuses them by name.
pub const MAX_DURATION: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// A duration option: positive and at most [`MAX_DURATION`].
pub(crate) fn check_duration(parameter: &'static str, value: Duration) -> Result<(), ConfigError> {
    check_duration_or_zero(parameter, value)?;
    if value.is_zero() {
        return Err(ConfigError::out_of_range(
            parameter,
            format!("{value:?}"),
            "a positive duration of at most 100 years",
        ));
    }
    Ok(())
}

/// A duration option that may be zero: at most [`MAX_DURATION`].
fn check_duration_or_zero(parameter: &'static str, value: Duration) -> Result<(), ConfigError> {
    if value > MAX_DURATION {
        return Err(ConfigError::out_of_range(
            parameter,
            format!("{value:?}"),
            "a duration of at most 100 years",
        ));
    }
    Ok(())
}

impl Lifecycle {
    /// [`Lifecycle::Rotate`] with `generations` generations of `period` each.
    pub fn rotate(generations: usize, period: Duration) -> Self {
        Self::Rotate {
            generations,
            period,
        }
    }

    /// [`Lifecycle::Grow`] with `expansion` and the usual tightening of 0.5.
    pub fn grow(expansion: f64) -> Self {
        Self::Grow {
            expansion,
            tightening: 0.5,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        match *self {
            Self::Single => Ok(()),
            Self::Rotate {
                generations,
                period,
            } => {
                if !(2..=64).contains(&generations) {
                    return Err(ConfigError::out_of_range(
                        "generations",
                        generations,
                        "2..=64",
                    ));
                }
                check_duration("period", period)
            }
            Self::Grow {
                expansion,
                tightening,
            } => {
                if !(1.0..=16.0).contains(&expansion) {
                    return Err(ConfigError::out_of_range(
                        "expansion",
                        expansion,
                        "1.0..=16.0",
                    ));
                }
                if !(tightening > 0.0 && tightening < 1.0) {
                    return Err(ConfigError::out_of_range(
                        "tightening",
                        tightening,
                        "(0, 1)",
                    ));
                }
                Ok(())
            }
        }
    }

    /// The false-positive rate of the first filter, such that the OR of all
    /// filters meets `target`.
    pub(crate) fn first_filter_rate(&self, target: f64) -> f64 {
        match *self {
            Self::Single => target,
            Self::Rotate { generations, .. } => target / generations as f64,
            Self::Grow { tightening, .. } => target * (1.0 - tightening),
        }
    }
}

/// When a guard with a [`KeySource`](crate::KeySource) rebuilds its filter, and how.
///
/// Triggers (any of them): a schedule ([`every`](Self::every)), drift of the
/// estimated or observed false-positive rate over a multiple of the target
/// ([`when_drift_exceeds`](Self::when_drift_exceeds)), removals past a share
/// of the items ([`when_removed_exceeds`](Self::when_removed_exceeds)), a
/// stale filter reported by the staleness check, and
/// [`Guard::rebuild`](crate::Guard::rebuild) called by hand. The maintenance
/// task (see [`Guard::spawn_maintenance`](crate::Guard::spawn_maintenance))
/// applies the policy; the first build of a guard with a source is always due.
///
/// ```
/// use std::time::Duration;
/// use bloomguard::RebuildPolicy;
///
/// let policy = RebuildPolicy::default()
///     .when_drift_exceeds(2.0)
///     .every(Duration::from_secs(3600));
/// # let _ = policy;
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct RebuildPolicy {
    pub(crate) every: Option<Duration>,
    pub(crate) drift_threshold: Option<f64>,
    pub(crate) removed_fraction: Option<f64>,
    pub(crate) headroom: f64,
    pub(crate) timeout: Duration,
    pub(crate) write_settle: Duration,
    pub(crate) retry_backoff: (Duration, Duration),
}

impl Default for RebuildPolicy {
    /// No trigger of its own: a rebuild runs when asked
    /// ([`Guard::rebuild`](crate::Guard::rebuild)), when the guard was never
    /// built, or when the staleness check found it stale.
    fn default() -> Self {
        Self {
            every: None,
            drift_threshold: None,
            removed_fraction: None,
            headroom: Self::DEFAULT_HEADROOM,
            timeout: Self::DEFAULT_TIMEOUT,
            write_settle: Self::DEFAULT_WRITE_SETTLE,
            retry_backoff: (Duration::from_secs(1), Duration::from_secs(300)),
        }
    }
}

impl RebuildPolicy {
    /// Room left for growth: a rebuild sizes for `counted keys × headroom`.
    pub const DEFAULT_HEADROOM: f64 = 1.5;
    /// A rebuild running longer than this fails, and the old filter keeps serving.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);
    /// How long a rebuild waits, once it takes inserts into both filters,
    /// before it starts reading the source. See [`write_settle`](Self::write_settle).
    pub const DEFAULT_WRITE_SETTLE: Duration = Duration::from_millis(250);

    /// Rebuild on a schedule: `period` after the last successful build.
    #[must_use]
    pub fn every(mut self, period: Duration) -> Self {
        self.every = Some(period);
        self
    }

    /// Rebuild when the estimated or observed false-positive rate exceeds
    /// `ratio` × the target (2.0 is a good start). The observed rate is
    /// judged here on the false positives the backend answered, after at
    /// least 20 of them: the ones a loader's confirmed-absent cache answered
    /// again, which
    /// [`GuardStats::observed_fpr`](crate::GuardStats::observed_fpr) counts,
    /// can all be one absent key asked again and again, which a rebuild
    /// (same seed, same keys) would let through again. Without such a
    /// cache (the HTTP layer has none) the backend answers every ask of
    /// such a key, so a rebuild for the observed rate comes at most once a
    /// minute after the last successful rebuild (or ten times that
    /// rebuild's length, if longer), with a cache or without.
    #[must_use]
    pub fn when_drift_exceeds(mut self, ratio: f64) -> Self {
        self.drift_threshold = Some(ratio);
        self
    }

    /// Adds a trigger for deleted keys: rebuild once the keys reported by
    /// [`Guard::note_removals`](crate::Guard::note_removals) since the last
    /// build exceed `fraction` of the keys that build counted. Deleted keys
    /// stay "maybe" in the filter and raise the real false-positive rate
    /// without changing the fill, so no fill-based estimate sees them.
    #[must_use]
    pub fn when_removed_exceeds(mut self, fraction: f64) -> Self {
        self.removed_fraction = Some(fraction);
        self
    }

    /// The new filter's capacity is `max(expected_items, counted × headroom)`
    /// (default [`DEFAULT_HEADROOM`](Self::DEFAULT_HEADROOM)). Before
    /// reading the source a rebuild takes the larger of two counts: the last
    /// whole pass's, and what the live filters' fill implies (which counts
    /// deleted keys too). The fill's is only a guess, and is kept within
    /// [`max_bytes`](crate::GuardBuilder::max_bytes); a counted one whose
    /// filter exceeds the budget fails the rebuild at once. Where the
    /// source holds more keys than the capacity taken, the rebuild reads it
    /// again at the size they need.
    #[must_use]
    pub fn headroom(mut self, headroom: f64) -> Self {
        self.headroom = headroom;
        self
    }

    /// A rebuild that takes longer fails (default [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT)).
    /// It counts the [write settle](Self::write_settle), which must be shorter.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long after [`Guard::insert`](crate::Guard::insert) (counted from
    /// the insert itself, a few instructions before it returns) the
    /// caller's write may take to become visible in the store, at most
    /// (default [`DEFAULT_WRITE_SETTLE`](Self::DEFAULT_WRITE_SETTLE)), as the
    /// guard's source and loaders read it: where they read a replica, its
    /// replication lag included.
    ///
    /// A rebuild starts taking inserts into both filters, waits for inserts
    /// and [`PendingWrite`](crate::PendingWrite)s begun before that to finish,
    /// then waits this long before it reads the source, so that a write
    /// following a plain `insert` is either in the new filter or in the
    /// store by the time the source is read. Writes that may take longer
    /// should hold a [`PendingWrite`](crate::PendingWrite) instead
    /// ([`Guard::insert_then_write`](crate::Guard::insert_then_write)).
    /// Zero is right only where every write does. Shorter than the
    /// [timeout](Self::timeout), which counts it.
    #[must_use]
    pub fn write_settle(mut self, settle: Duration) -> Self {
        self.write_settle = settle;
        self
    }

    /// Waits between failed attempts: the step starts at `first` and doubles
    /// up to `max`; each wait is drawn between half and all of its step, so
    /// that guards failing together do not retry together. Default: 1 s up
    /// to 300 s.
    #[must_use]
    pub fn retry_backoff(mut self, first: Duration, max: Duration) -> Self {
        self.retry_backoff = (first, max.max(first));
        self
    }

    /// Checks every option, the drift threshold against `target_fpr`: an
    /// estimated rate never exceeds 1, so drift never exceeds `1 / target_fpr`.
    pub(crate) fn validate(&self, target_fpr: f64) -> Result<(), ConfigError> {
        if let Some(ratio) = self.drift_threshold
            && !(ratio > 1.0 && ratio < 1.0 / target_fpr)
        {
            return Err(ConfigError::out_of_range(
                "drift threshold",
                ratio,
                "a ratio above 1.0 and below 1 / false_positive_rate (a false-positive rate never exceeds 1)",
            ));
        }
        if let Some(fraction) = self.removed_fraction
            && !(fraction > 0.0 && fraction.is_finite())
        {
            return Err(ConfigError::out_of_range(
                "removed fraction",
                fraction,
                "a finite fraction above 0",
            ));
        }
        if !(1.0..=100.0).contains(&self.headroom) {
            return Err(ConfigError::out_of_range(
                "headroom",
                self.headroom,
                "1.0..=100.0",
            ));
        }
        check_duration("timeout", self.timeout)?;
        if let Some(period) = self.every {
            check_duration("every", period)?;
        }
        check_duration_or_zero("write_settle", self.write_settle)?;
        // The timeout counts the settle: every attempt would time out.
        if self.write_settle >= self.timeout {
            return Err(ConfigError::out_of_range(
                "write_settle",
                format!("{:?}", self.write_settle),
                "a duration shorter than the rebuild timeout",
            ));
        }
        let (first, max) = self.retry_backoff;
        check_duration("retry_backoff", first)?;
        check_duration("retry_backoff", max)?;
        Ok(())
    }
}
