//! [`GuardReader`]: a guard handle for one thread or one service clone, whose
//! checks skip the `ArcSwap` protection protocol.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use arc_swap::{ArcSwap, Cache};

use super::live::{Answering, LiveSet};
use super::stats::VerdictTally;
use super::{Guard, Inner, Verdict, present_if};

/// A handle on a [`Guard`] that keeps its own reference to the live filters
/// and only compares pointers per check to see whether they changed.
///
/// [`Guard::check`] reads the live filters inside a read section (two
/// plain stores to the thread's own record) and counts each verdict in the
/// thread's own stripe. A reader answers the same verdicts from a cached
/// `Arc` that it refreshes whenever the guard swaps filters, and counts 64
/// verdicts at a time; with one live filter it also skips a dependent load.
/// It needs `&mut self`, so it suits a worker loop; `Guard::check` is as
/// fast within a few nanoseconds (see BENCHMARKS.md) and needs no handle.
///
/// The cached filters are only refreshed on the next check: a reader left
/// idle keeps the filters it last saw in memory (two sets of them, when a
/// batch came last), even after a rebuild replaced them (`Guard::check`
/// keeps nothing between checks). Drop idle readers.
///
/// ```
/// use bloomguard::{Guard, Verdict};
///
/// let guard = Guard::builder().expected_items(1_000).build()?;
/// let mut reader = guard.reader();
/// guard.insert("item:1");
/// assert_eq!(reader.check("item:1"), Verdict::MaybePresent);
/// # Ok::<(), bloomguard::ConfigError>(())
/// ```
pub struct GuardReader {
    guard: Guard,
    live: Cache<LiveSwap, Arc<LiveSet>>,
    /// The set `only` was read from, held so that no later set can take its
    /// address: after a batch refreshed the cache and dropped it, an address
    /// alone could match a new set and answer from a replaced filter.
    only_from: Option<Arc<LiveSet>>,
    /// The set's [`answering`](LiveSet::answering) filter, kept here: one
    /// dependent load closer than through the set.
    only: Option<Answering>,
    /// Checks not yet added to the guard's counters.
    uncounted: VerdictTally,
    /// Whether the guard samples `Absent` answers (tested first: it never changes).
    samples_absent: bool,
}

/// Checks a reader counts locally before adding them to the guard's counters:
/// a locked add per check would be most of a reader's overhead (measured).
const FLUSH_EVERY: u64 = 64;

/// The guard's `ArcSwap`, reached through the `Arc` that keeps it alive.
#[derive(Clone)]
struct LiveSwap(Arc<Inner>);

impl Deref for LiveSwap {
    type Target = ArcSwap<LiveSet>;

    fn deref(&self) -> &Self::Target {
        self.0.live.cell()
    }
}

impl GuardReader {
    pub(crate) fn new(guard: &Guard) -> Self {
        Self {
            guard: guard.clone(),
            live: Cache::new(LiveSwap(Arc::clone(&guard.inner))),
            only_from: None,
            only: None,
            uncounted: VerdictTally::default(),
            samples_absent: guard.inner.staleness.is_some(),
        }
    }

    /// [`Guard::check`], answered from the cached filters. Verdicts reach
    /// [`Guard::stats`] 64 at a time (per verdict), or when the reader is
    /// flushed or dropped.
    #[inline]
    pub fn check(&mut self, key: impl AsRef<[u8]>) -> Verdict {
        let key = key.as_ref();
        let hash = self.guard.hash(key);
        let live = self.live.load();
        if !self
            .only_from
            .as_ref()
            .is_some_and(|from| Arc::ptr_eq(from, live))
        {
            self.only_from = Some(Arc::clone(live));
            self.only = live.answering.clone();
        }
        let verdict = match &self.only {
            Some(only) => present_if(only.contains_hashed(hash)),
            None => self.guard.verdict_in(live, hash),
        };
        self.uncounted.add(verdict);
        if self.uncounted.checks == FLUSH_EVERY {
            self.flush();
        }
        if self.samples_absent && verdict == Verdict::Absent {
            self.guard.sample_absent(key);
        }
        verdict
    }

    /// Adds the checks counted locally to the guard's statistics.
    pub fn flush(&mut self) {
        if self.uncounted.checks > 0 {
            self.guard.count(None, std::mem::take(&mut self.uncounted));
        }
    }

    /// [`Guard::check_many`], answered from the cached filters.
    ///
    /// # Panics
    /// If `out` is shorter than `keys`.
    pub fn check_many<K: AsRef<[u8]>>(&mut self, keys: &[K], out: &mut [Verdict]) {
        self.guard.check_many_in(self.live.load(), keys, out);
    }

    /// The guard this reader reads.
    pub fn guard(&self) -> &Guard {
        &self.guard
    }
}

impl Drop for GuardReader {
    fn drop(&mut self) {
        self.flush();
    }
}

impl Clone for GuardReader {
    fn clone(&self) -> Self {
        Self::new(&self.guard)
    }
}

impl fmt::Debug for GuardReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardReader")
            .field("guard", &self.guard)
            .finish_non_exhaustive()
    }
}
