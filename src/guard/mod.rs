//! [`Guard`]: the live filters in front of a store, kept correct and useful
//! while the data under them changes.
//!
//! A guard answers [`check`](Guard::check) from the filters it holds, read
//! inside a read section (`sections`): no lock, no locked instruction, then
//! the probes. Around that it runs the
//! lifecycle of its [`Lifecycle`] and [`RebuildPolicy`] policies — rebuild from a
//! [`KeySource`], rotation of time windows, growth — and measures itself
//! ([`GuardStats`]).
//!
//! # The ordering rule
//! A guard never answers [`Verdict::Absent`] for a key that is in the store,
//! provided every write reaches the guard **before** it becomes visible in
//! the store: call [`insert`](Guard::insert) first, then write (or let
//! [`insert_then_write`](Guard::insert_then_write) do both in that order).
//! Writing first leaves a window in which a reader finds the key in the store
//! but the guard says absent. And the write must become visible within the
//! [write settle](RebuildPolicy::write_settle) (250 ms by default) of its
//! insert: a rebuild that reads the store meanwhile keeps only what it finds
//! there after the settle. A slower write (a long transaction) holds a
//! [`PendingWrite`] ([`begin_write`](Guard::begin_write)) across it, as
//! `insert_then_write` does. Writes that bypass the guard altogether make it
//! stale; the optional staleness check ([`GuardBuilder::staleness_check`])
//! finds them and triggers a rebuild.
//!
//! ```
//! use bloomguard::{Guard, Verdict};
//!
//! let guard = Guard::builder().name("items").expected_items(100_000).build()?;
//! guard.insert("item:1"); // before the store write
//! assert_eq!(guard.check("item:1"), Verdict::MaybePresent);
//! match guard.check("item:2") {
//!     Verdict::Absent => { /* answer "not found" without asking the store */ }
//!     Verdict::MaybePresent | Verdict::Warming => { /* ask the store */ }
//! }
//! # Ok::<(), bloomguard::ConfigError>(())
//! ```

mod builder;
mod insert_clock;
mod live;
mod maintenance;
mod policy;
mod reader;
mod rebuild;
pub(crate) mod sections;
#[cfg(feature = "redis")]
pub(crate) mod snapshot;
pub mod source;
mod staleness;
mod stats;
mod writes;

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tokio::sync::Notify;

use crate::error::{ConfigError, IncompatibleFilters, StillWarming};
use crate::filter::{AtomicBloom, FilterBuilder, MIN_FALSE_POSITIVE_RATE, hash_key};
use crate::stats::ThreadCounters;
use crate::sync::unpoisoned;
pub use builder::GuardBuilder;
use insert_clock::InsertClock;
use live::{Generation, LiveSet, LiveState};
pub use maintenance::MaintenanceHandle;
#[cfg(feature = "redis")]
pub(crate) use maintenance::RebuildTurns;
use policy::MAX_GROWN_FILTERS;
pub(crate) use policy::check_duration;
pub use policy::{Lifecycle, MAX_DURATION, RebuildPolicy};
pub use reader::GuardReader;
pub use rebuild::{RebuildError, RebuildOutcome, RebuildReport};
pub use source::{KeySource, SourceError};
use staleness::{StaleFindings, StalenessSampler, Verifier};
use stats::{Counter, History, VerdictTally};
pub use stats::{GuardStats, RebuildCounts, VerdictCounts};
use writes::HeldIn;
pub use writes::PendingWrite;

/// A guard's answer for a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use]
pub enum Verdict {
    /// Certainly not in the store: the backend may be skipped.
    Absent,
    /// Maybe in the store: ask the backend (and report what it said with
    /// [`Guard::record_outcome`]).
    MaybePresent,
    /// No filter has been built yet: ask the backend.
    Warming,
}

impl Verdict {
    /// Whether the backend may be skipped.
    pub fn is_absent(self) -> bool {
        self == Self::Absent
    }
}

/// Live Bloom filters in front of a store; cheap to clone (an `Arc` inside),
/// `Send + Sync`. Made by [`Guard::builder`]; see the [module docs](self)
/// for the ordering rule. Not for signal handlers: a thread's first check
/// allocates, and a handler's check or insert that interrupts one of the
/// thread's own could let a replaced filter be freed while it is read.
///
/// ```
/// # tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap().block_on(async {
/// use bloomguard::{Guard, Verdict, source};
///
/// let guard = Guard::builder()
///     .name("items")
///     .expected_items(10_000)
///     .source(source::from_fn(|| ["item:1"])) // lists the store's keys
///     .build()?;
/// let maintenance = guard.spawn_maintenance(); // first build, then rebuilds
/// guard.ready().await;
/// guard.insert("item:2"); // before the store write
/// assert_eq!(guard.check("item:1"), Verdict::MaybePresent);
/// assert_eq!(guard.check("item:2"), Verdict::MaybePresent);
/// assert_eq!(guard.check("item:3"), Verdict::Absent); // no store call needed
/// maintenance.shutdown().await;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone)]
pub struct Guard {
    inner: Arc<Inner>,
}

struct Inner {
    name: String,
    expected_items: u64,
    target_fpr: f64,
    lifecycle: Lifecycle,
    rebuild_policy: RebuildPolicy,
    source: Option<Box<dyn KeySource>>,
    seed: u64,
    /// Makes each new filter: the seed above, the memory budget.
    filters: FilterBuilder,
    /// The live filters; every change of them goes through its methods.
    live: LiveState,
    /// One rebuild at a time.
    rebuild_lock: tokio::sync::Mutex<()>,
    counters: ThreadCounters<{ Counter::COUNT }>,
    history: Mutex<History>,
    /// What the staleness check found: the filter missed writes.
    stale: StaleFindings,
    /// Wakes the maintenance task early. Shared with the task, which must
    /// not keep the guard alive.
    wake: Arc<Notify>,
    /// Wakes `ready()` callers when a build ends warming.
    left_warming: Notify,
    /// Maintenance tasks running now; shared with them (they must not keep
    /// the guard alive), each counted until its future is dropped.
    maintenance_tasks: Arc<AtomicUsize>,
    /// When the guard was built: how long a warming guard has waited.
    built_at: tokio::time::Instant,
    maintenance_interval: Duration,
    staleness: Option<StalenessSampler>,
    /// When keys were last inserted, kept once a loader caches confirmed
    /// false positives (see `crate::loader`).
    insert_clock: OnceLock<InsertClock>,
    /// `PendingWrite`s open since before the insert clock started.
    untimed_writes: AtomicUsize,
    /// On a rotating guard, the hashes of the keys of open `PendingWrite`s
    /// (with how many of each): such a write may land in the store any time
    /// before its drop, so every rotation writes them into the generation
    /// it opens, or one open across `generations` rotations would be in no
    /// filter the guard reads. A mutex taken twice a write, on rotating
    /// guards only: the registry is empty between writes. A rotation holds
    /// it from its read until its set is published (taken under the swap
    /// lock; nothing takes that lock while holding this one), not through
    /// the reclaim that follows.
    open_write_keys: Mutex<HashMap<u64, usize>>,
    /// The verifying half of the staleness check, taken by the maintenance task.
    verifier: Mutex<Option<Verifier>>,
    /// Set while the guard's set is shared with others (a fleet).
    rebuild_turns: Mutex<Option<Arc<dyn maintenance::RebuildTurns>>>,
    /// Whether a fleet member follows the fleet for this guard (one at a time).
    #[cfg(feature = "redis")]
    in_fleet: std::sync::atomic::AtomicBool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // A maintenance task asleep until its next tick (which can be hours
        // away) would hold the staleness check's closure, and whatever it
        // holds, until then.
        self.wake.notify_one();
    }
}

impl Guard {
    /// Starts a [`GuardBuilder`].
    pub fn builder() -> GuardBuilder {
        GuardBuilder::default()
    }

    /// Whether `key` may be in the store: the filter probes inside a read
    /// section (two plain stores to the thread's own cache line; see
    /// `sections.rs`), and the verdict counted in the thread's own stripe.
    /// No lock, no locked instruction, no fence (on Linux 4.14+, where
    /// `membarrier(2)` serves; elsewhere one fence), and no allocation
    /// unless the staleness check samples this answer, or the thread checks
    /// for the first time (it claims a record, kept for the threads after
    /// it). A swap of the live filters that happened before the call is
    /// seen by it.
    #[inline]
    pub fn check(&self, key: impl AsRef<[u8]>) -> Verdict {
        let key = key.as_ref();
        let hash = self.hash(key);
        let verdict = sections::with_thread_record(|record| {
            let verdict = self
                .inner
                .live
                .read(record, |live| self.verdict_in(live, hash));
            let counters = &self.inner.counters;
            counters.add_for(record.index, Counter::Checks as usize, 1);
            // Inline, as the check's own count: through `count` (a call and
            // a loop over a tally) a present key took 3-7 ns more at 32M.
            match verdict {
                Verdict::Absent => {}
                Verdict::MaybePresent => {
                    counters.add_for(record.index, Counter::MaybePresent as usize, 1);
                }
                Verdict::Warming => counters.add_for(record.index, Counter::Warming as usize, 1),
            }
            verdict
        })
        .unwrap_or_else(|| {
            let verdict = self.verdict_in(&self.inner.live.load(), hash);
            let mut tally = VerdictTally::default();
            tally.add(verdict);
            self.count(None, tally);
            verdict
        });
        if verdict == Verdict::Absent {
            self.sample_absent(key);
        }
        verdict
    }

    /// [`check`](Self::check) for many keys at once, writing `out[i]` for
    /// `keys[i]`: one load of the live filters per group of 64 keys (a long
    /// batch may straddle a swap, each group answered from one set), and the
    /// keys' memory accesses overlapped (hashed and prefetched in groups).
    /// The seen-items gate checks its ~120 candidates per request this way.
    ///
    /// ```
    /// use bloomguard::{Guard, Verdict};
    ///
    /// let guard = Guard::builder().expected_items(1_000).build()?;
    /// guard.insert("user:1:item:2");
    /// let mut verdicts = [Verdict::Warming; 2];
    /// guard.check_many(&["user:1:item:2", "user:1:item:3"], &mut verdicts);
    /// assert_eq!(verdicts[0], Verdict::MaybePresent);
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// ```
    ///
    /// The keys' `as_ref` runs while the filters are held for reading (once
    /// per key, and again for an `Absent` one when the guard samples those
    /// for its staleness check): keep it quick, since a slow one delays the
    /// freeing of filters a rebuild replaced, in every guard of the process
    /// (sections are tracked per thread, not per guard), for as long as such
    /// calls keep running. It may check a guard itself.
    ///
    /// # Panics
    /// If `out` is shorter than `keys`.
    pub fn check_many<K: AsRef<[u8]>>(&self, keys: &[K], out: &mut [Verdict]) {
        assert_room_for(keys, out);
        for (keys, out) in keys.chunks(CHECK_GROUP).zip(out.chunks_mut(CHECK_GROUP)) {
            let out = &mut out[..keys.len()];
            // The keys' `as_ref` runs inside the section (a key type's that
            // checks a guard opens a nested section, which is a no-op).
            let counted = sections::with_thread_record(|record| {
                let tally = self
                    .inner
                    .live
                    .read(record, |live| self.group_verdicts_in(live, keys, out));
                self.count(Some(record.index), tally);
            });
            if counted.is_none() {
                let tally = self.group_verdicts_in(&self.inner.live.load(), keys, out);
                self.count(None, tally);
            }
            self.sample_absents(keys, out);
        }
    }

    /// [`check_many`](Self::check_many) in a set the caller has loaded.
    pub(crate) fn check_many_in<K: AsRef<[u8]>>(
        &self,
        live: &LiveSet,
        keys: &[K],
        out: &mut [Verdict],
    ) {
        assert_room_for(keys, out);
        for (keys, out) in keys.chunks(CHECK_GROUP).zip(out.chunks_mut(CHECK_GROUP)) {
            let out = &mut out[..keys.len()];
            let tally = self.group_verdicts_in(live, keys, out);
            self.count(None, tally);
            self.sample_absents(keys, out);
        }
    }

    /// The verdicts for up to [`CHECK_GROUP`] keys in `live`, the memory
    /// accesses of each filter's probes overlapped (several generations:
    /// each key hashed once for all), neither counted nor sampled; returns
    /// their tally, counted from the probes' answers in one pass (a `match`
    /// per verdict was a second pass over the group).
    fn group_verdicts_in<K: AsRef<[u8]>>(
        &self,
        live: &LiveSet,
        keys: &[K],
        out: &mut [Verdict],
    ) -> VerdictTally {
        let n = keys.len();
        let mut tally = VerdictTally {
            checks: n as u64,
            ..VerdictTally::default()
        };
        if live.warming || live.generations.is_empty() {
            out.fill(Verdict::Warming);
            tally.warming = n as u64;
            return tally;
        }
        if live.fenced {
            out.fill(Verdict::MaybePresent);
            tally.maybe_present = n as u64;
            return tally;
        }
        let mut present = [false; CHECK_GROUP];
        if let Some(only) = &live.answering {
            // The filter's own batch: each block prefetched as its key is
            // hashed, so the first misses start sooner than after hashing all.
            only.generation()
                .filter
                .contains_many(keys, &mut present[..n]);
        } else {
            let mut hashes = [0u64; CHECK_GROUP];
            let mut in_generation = [false; CHECK_GROUP];
            for (hash, key) in hashes.iter_mut().zip(keys) {
                *hash = self.hash(key.as_ref());
            }
            for generation in live.generations.iter().rev() {
                generation
                    .filter
                    .contains_many_hashed(&hashes[..n], &mut in_generation[..n]);
                for (any, this) in present.iter_mut().zip(&in_generation[..n]) {
                    *any |= *this;
                }
            }
        }
        for (verdict, &maybe) in out.iter_mut().zip(&present[..n]) {
            *verdict = present_if(maybe);
            tally.maybe_present += u64::from(maybe);
        }
        tally
    }

    /// Adds `tally` to the guard's counters, in the stripe of the thread
    /// whose record index is `owner` (the caller's), or looked up.
    #[inline]
    pub(crate) fn count(&self, owner: Option<usize>, tally: VerdictTally) {
        let counters = &self.inner.counters;
        let owner = owner.or_else(sections::thread_record_index);
        let add = |counter: Counter, n: u64| match owner {
            Some(owner) => counters.add_for(owner, counter as usize, n),
            None => counters.add(counter as usize, n),
        };
        for (counter, n) in [
            (Counter::Checks, tally.checks),
            (Counter::MaybePresent, tally.maybe_present),
            (Counter::Warming, tally.warming),
        ] {
            if n > 0 {
                add(counter, n);
            }
        }
    }

    fn sample_absents<K: AsRef<[u8]>>(&self, keys: &[K], verdicts: &[Verdict]) {
        if self.inner.staleness.is_none() {
            return;
        }
        for (key, &verdict) in keys.iter().zip(verdicts) {
            if verdict == Verdict::Absent {
                self.sample_absent(key.as_ref());
            }
        }
    }

    /// `key`'s hash under the guard's seed, which every generation's filter
    /// has (the guard makes its own with it; merges and adopted snapshots
    /// with another are refused). A check hashes first: the hash then need
    /// not wait for the loads that reach the live filter.
    #[inline]
    pub(crate) fn hash(&self, key: &[u8]) -> u64 {
        hash_key(key, self.inner.seed)
    }

    /// The verdict in `live` for the key of `hash` (see [`hash`](Self::hash)),
    /// neither counted nor sampled.
    #[inline(always)]
    pub(crate) fn verdict_in(&self, live: &LiveSet, hash: u64) -> Verdict {
        // The usual case inline, the rest out of line: every instruction on
        // a check's path takes room in the CPU's window, which on a filter
        // larger than the cache decides how many checks' misses overlap.
        if let Some(only) = &live.answering {
            return present_if(only.contains_hashed(hash));
        }
        Self::verdict_in_any(live, hash)
    }

    #[cold]
    #[inline(never)]
    fn verdict_in_any(live: &LiveSet, hash: u64) -> Verdict {
        if live.warming || live.generations.is_empty() {
            return Verdict::Warming;
        }
        if live.fenced {
            return Verdict::MaybePresent;
        }
        present_if(live.filters_hold(hash))
    }

    /// Offers an `Absent` answer to the staleness check, if there is one.
    #[inline]
    pub(crate) fn sample_absent(&self, key: &[u8]) {
        if let Some(sampler) = &self.inner.staleness {
            sampler.maybe_sample(key);
        }
    }

    /// Whether the live filters hold the key hashing to `hash` now, whatever
    /// the guard answers (fenced, it answers "maybe" for every key), from
    /// the set a check reads (a swap publishes it before the inserts' one).
    fn filters_hold(&self, hash: u64) -> bool {
        self.read_live(|live| live.filters_hold(hash))
    }

    /// Merges a filter built elsewhere (a snapshot shipped by other means than
    /// a `FleetSync` (the `redis` feature), which replaces whole sets) into this guard:
    /// ORed into the newest live filter, or, while warming, installed as the
    /// first one. Either way no key already in the guard is lost. During a
    /// rebuild it is ORed into the new filter too; if that one has another
    /// size, the rebuild fails with [`RebuildError::MergedDuringRebuild`]
    /// rather than swap the merged keys away. A rebuild that reads its
    /// source again (it found more keys than it sized the filter for) makes
    /// a new filter without the keys merged during its first read: those
    /// keys' writes, made before the merge, are in the store by the second
    /// read, as the [write settle](crate::RebuildPolicy::write_settle)
    /// promises for any insert.
    ///
    /// A merge never ends [warming](Self::is_warming): the merged filter
    /// says nothing of the keys this guard's own store holds, so checks keep
    /// answering [`Verdict::Warming`] until the first build has read the
    /// whole source (the maintenance task keeps retrying it). The merged
    /// keys last until the next rebuild, which keeps what the source lists:
    /// merge only keys that are in this guard's store. A guard without a
    /// source never warms: it answers from its empty filter from `build` on,
    /// so restore into it before it serves (with the snapshot's seed given
    /// to [`GuardBuilder::seed`](crate::GuardBuilder::seed)), and treat an
    /// error here as fatal.
    ///
    /// # Errors
    /// [`IncompatibleFilters`] unless the filter has the newest filter's bits,
    /// k and seed (with no filter yet: the guard's seed).
    pub fn merge_filter(&self, filter: AtomicBloom) -> Result<(), IncompatibleFilters> {
        self.stamp_every_key();
        self.inner.live.merge(filter, self.inner.seed, |filter| {
            let capacity = filter.stats().capacity.unwrap_or(self.inner.expected_items);
            Generation::new(filter, capacity, self.first_filter_rate())
        })
    }

    /// The filters live now, oldest first (none while warming). The value
    /// keeps them in memory while it is held, even after a swap replaced
    /// them: hold it briefly (to encode a snapshot, to inspect a filter).
    ///
    /// Read them; write through the guard ([`insert`](Self::insert),
    /// [`merge_filter`](Self::merge_filter)). An insert into one of these
    /// goes around the guard: a rebuild running then never gets the key,
    /// the next swap forgets it, and a loader's confirmed-absent cache is
    /// not told. They cannot be emptied ([`AtomicBloom::clear`] takes
    /// `&mut self`). A snapshot of a rotating or growing guard needs every
    /// one of them ([`iter`](LiveFilters::iter)), not only the newest; and
    /// checks answer from them only when the guard is neither
    /// [warming](Self::is_warming) nor [fenced](Self::is_fenced).
    ///
    /// ```
    /// let guard = bloomguard::Guard::builder().expected_items(1_000).build()?;
    /// guard.insert("item:1");
    /// let live = guard.live_filters();
    /// let newest = live.newest().expect("a guard without a source starts with a filter");
    /// assert!(newest.contains("item:1"));
    /// let snapshot = newest.to_bytes();
    /// # let _ = snapshot;
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// ```
    pub fn live_filters(&self) -> LiveFilters {
        LiveFilters {
            live: self.inner.live.load_full(),
        }
    }

    /// A [`GuardReader`]: checks from a cached reference to the live
    /// filters, for one thread or one service clone.
    pub fn reader(&self) -> GuardReader {
        GuardReader::new(self)
    }

    /// Records that `key` is about to be written to the store. Call it
    /// **before** the write becomes visible (see the [module docs](self)):
    /// once it returns, `check(key)` never answers `Absent`.
    ///
    /// This instance's guard only. In a fleet, write through the
    /// `FleetSync` (`insert_then_write`, `begin_write_many`; the `redis`
    /// feature): no other member sees an insert made here, and this one
    /// forgets it when it next takes a snapshot. The same holds for
    /// [`begin_write`](Self::begin_write),
    /// [`insert_then_write`](Self::insert_then_write) and
    /// [`merge_filter`](Self::merge_filter).
    ///
    /// The write must become visible within the rebuild policy's
    /// [`write_settle`](RebuildPolicy::write_settle) (250 ms by default) of this
    /// call, or be covered by a [`PendingWrite`] ([`begin_write`](Self::begin_write)).
    #[inline]
    pub fn insert(&self, key: impl AsRef<[u8]>) {
        self.insert_hash(self.hash(key.as_ref()));
    }

    /// [`insert`](Self::insert) of the key hashing to `hash`.
    pub(crate) fn insert_hash(&self, hash: u64) {
        let writes = self.inner.live.writes();
        let counted = writes.enter();
        let live = self.inner.live.load();
        match &live.shadow {
            // The key goes into the filter being built: its build need not
            // wait for this insert, so the count moves to that filter's own
            // tracker before the insert runs (see `writes`).
            Some(shadow) => {
                let counted_there = writes.move_to(counted, &shadow.writes);
                self.insert_into(&live, hash);
                shadow.writes.exit(counted_there);
            }
            None => {
                self.insert_into(&live, hash);
                writes.exit(counted);
            }
        }
        // Last, as a rebuild counts the write settle from the exit above:
        // a thread preempted before it would otherwise leave a stamp older
        // than the settle the loader's confirmed-absent cache allows.
        self.stamp_insert(hash);
    }

    /// [`insert`](Self::insert) for a write that may take a while: the
    /// returned [`PendingWrite`] makes a rebuild wait for the write before it
    /// reads the source. Drop it once the write is visible in the store.
    pub fn begin_write(&self, key: impl AsRef<[u8]>) -> PendingWrite {
        let hash = self.hash(key.as_ref());
        let writes = self.inner.live.writes();
        let counted = writes.enter();
        // Before the load: a rotation that read the registry before this
        // held it until its set was published, so the load below finds that
        // set (or a later one) and the insert goes into its newest generation.
        self.keep_in_rotations(hash);
        let live = self.inner.live.load();
        self.insert_into(&live, hash);
        self.stamp_insert(hash);
        let held = match &live.shadow {
            Some(shadow) => {
                // The key is in the filter being built: that build does not
                // need to wait, but the next one must.
                let counted_there = writes.move_to(counted, &shadow.writes);
                HeldIn::Shadow(Arc::clone(&shadow.writes), counted_there)
            }
            None => HeldIn::Guard(counted),
        };
        PendingWrite {
            guard: self.clone(),
            held,
            hash,
            timed: self.open_pending_write(hash),
        }
    }

    /// Inserts `key`, then runs `write` (the store write), keeping the
    /// ordering rule and covering the write against a concurrent rebuild.
    ///
    /// Dropping this future before `write` completes (a cancelled request:
    /// axum drops a handler's future when its client disconnects) ends the
    /// cover at once. A write already sent that still lands more than the
    /// write settle later can then be missed by a rebuild's scan: spawn the
    /// whole call (`tokio::spawn(async move { guard.insert_then_write(key,
    /// write).await })`, so that the cover lives in the task with the
    /// write), or bound such writes below the settle (a statement timeout).
    /// Spawning only `write` does not help: the task outlives the cover
    /// dropped with this future. `write` must not have started yet (a
    /// `JoinHandle` of a task already spawned runs before the insert).
    ///
    /// The write is visible when its transaction commits: in an explicit
    /// transaction, `write` runs through the `COMMIT`, not just the
    /// statement. A commit whose outcome is unknown (the connection lost
    /// while it ran) may still land later; keep the cover
    /// ([`begin_write`](Self::begin_write)) until it is known, or rebuild
    /// once it is.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// use std::collections::HashSet;
    /// use std::sync::Mutex;
    ///
    /// let guard = bloomguard::Guard::builder().expected_items(1_000).build()?;
    /// let store = Mutex::new(HashSet::new());
    /// guard.insert_then_write("item:7", async { store.lock().unwrap().insert("item:7") }).await;
    /// assert!(!guard.check("item:7").is_absent());
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// # }).unwrap();
    /// ```
    pub async fn insert_then_write<T>(
        &self,
        key: impl AsRef<[u8]>,
        write: impl Future<Output = T>,
    ) -> T {
        let _pending = self.begin_write(key);
        write.await
    }

    #[inline]
    fn insert_into(&self, live: &LiveSet, hash: u64) {
        if let Some(newest) = live.newest() {
            if !newest.filter.insert_hashed(hash) {
                // Rare for distinct keys (about the FPR): a high share means
                // repeated keys, or keys crafted to crowd a few blocks.
                self.inner
                    .counters
                    .add(Counter::RedundantInserts as usize, 1);
            }
            match self.inner.lifecycle {
                Lifecycle::Grow { .. }
                    if !newest.grows_no_further.load(Ordering::Relaxed)
                        && newest.is_full_sampled(hash) =>
                {
                    self.grow(newest);
                }
                // The set unchanged since the load: no rotation to follow
                // (one pointer compare, not a second load of the set).
                Lifecycle::Rotate { .. } if !self.inner.live.is_current(live) => {
                    self.follow_rotations(newest, hash)
                }
                _ => {}
            }
        }
        if let Some(shadow) = &live.shadow {
            shadow.generation.filter.insert_hashed(hash);
        }
        self.inner.counters.add(Counter::Inserts as usize, 1);
    }

    /// Writes the key into the newest generation again wherever a rotation
    /// replaced the one it was written to (`wrote_to`, from the set the
    /// insert loaded) meanwhile. The next rotation but one drops that
    /// generation: an insert stalled across both would otherwise return with
    /// its key in no filter the guard reads. Written into the newest one
    /// found, the key stays for the window the lifecycle promises, counted
    /// from this insert's return.
    fn follow_rotations(&self, wrote_to: &Arc<Generation>, hash: u64) {
        let mut followed: Option<Arc<Generation>> = None;
        loop {
            let live = self.inner.live.load();
            match live.newest() {
                Some(newest) if !Arc::ptr_eq(newest, followed.as_ref().unwrap_or(wrote_to)) => {
                    newest.filter.insert_hashed(hash);
                    followed = Some(Arc::clone(newest));
                }
                _ => return,
            }
        }
    }

    /// On a rotating guard, writes the key of a [`PendingWrite`] being
    /// made into every generation a rotation opens until
    /// [`renew_when_written`](Self::renew_when_written).
    fn keep_in_rotations(&self, hash: u64) {
        if matches!(self.inner.lifecycle, Lifecycle::Rotate { .. }) {
            *unpoisoned(self.inner.open_write_keys.lock())
                .entry(hash)
                .or_default() += 1;
        }
    }

    /// Writes the key of a [`PendingWrite`] that ends into a rotating
    /// guard's newest generation again, then lets rotations forget it: its
    /// write is in the store from now on, so its window counts from here.
    pub(crate) fn renew_when_written(&self, hash: u64) {
        if !matches!(self.inner.lifecycle, Lifecycle::Rotate { .. }) {
            return;
        }
        let live = self.inner.live.load();
        if let Some(newest) = live.newest() {
            newest.filter.insert_hashed(hash);
            if !self.inner.live.is_current(&live) {
                self.follow_rotations(newest, hash);
            }
        }
        let mut open = unpoisoned(self.inner.open_write_keys.lock());
        if let Entry::Occupied(mut writes) = open.entry(hash) {
            *writes.get_mut() -= 1;
            if *writes.get() == 0 {
                writes.remove();
            }
        }
    }

    /// Reports what the backend answered for a key after `MaybePresent`:
    /// `found == false` is a false positive. (After `Warming`, report
    /// nothing, or only what was found: a miss there says nothing of the filter.)
    /// While the guard [is fenced](Self::is_fenced), a miss is not counted
    /// either: every check answers "maybe" then, whatever the filters hold.
    pub fn record_outcome(&self, found: bool) {
        self.count_outcome(Verdict::MaybePresent, found);
    }

    /// Counts the backend's answer for a key checked with `verdict` (an
    /// `Absent` one reaches the backend only in shadow mode).
    pub(crate) fn count_outcome(&self, verdict: Verdict, found: bool) {
        let counters = &self.inner.counters;
        // A fenced "maybe" is not the filters' (read now, after the backend
        // call: a fence that ended in between counts one miss too many).
        let verdict = match verdict {
            Verdict::MaybePresent if self.is_fenced() => Verdict::Warming,
            verdict => verdict,
        };
        match (verdict, found) {
            (Verdict::MaybePresent, true) => {
                counters.add(Counter::Found as usize, 1);
                counters.add(Counter::TruePositives as usize, 1);
            }
            (Verdict::Warming, true) => counters.add(Counter::Found as usize, 1),
            (Verdict::MaybePresent, false) => counters.add(Counter::FalsePositives as usize, 1),
            (Verdict::Absent, true) => {
                counters.add(Counter::WouldBeFalseNegatives as usize, 1);
                // No key in the line: keys can be personal data.
                tracing::warn!(
                    guard = %self.inner.name,
                    "shadow mode: the backend found a key the guard answered Absent for \
                     (a would-be false negative; see the guard's docs on the write path)"
                );
            }
            (Verdict::Warming | Verdict::Absent, false) => {}
        }
    }

    /// Counts a `MaybePresent` answer trusted as present without the backend.
    pub(crate) fn count_unverified_positive(&self) {
        self.inner
            .counters
            .add(Counter::UnverifiedPositives as usize, 1);
    }

    /// Counts an `Absent` answer passed on to the backend in shadow mode.
    pub(crate) fn count_shadowed_absent(&self) {
        self.inner.counters.add(Counter::ShadowedAbsent as usize, 1);
    }

    /// Starts timing inserts, for a loader's confirmed-absent cache.
    pub(crate) fn time_inserts(&self) {
        self.inner
            .insert_clock
            .get_or_init(InsertClock::new)
            .start();
    }

    /// Stamps an insert of the key hashing to `hash` when inserts are timed.
    #[inline]
    fn stamp_insert(&self, hash: u64) {
        if let Some(clock) = self.inner.insert_clock.get() {
            clock.stamp(hash);
        }
    }

    /// Stamps an insert of every key when inserts are timed: before a
    /// change that brings keys in without inserting each (see `insert_clock`).
    pub(crate) fn stamp_every_key(&self) {
        if let Some(clock) = self.inner.insert_clock.get() {
            clock.stamp_every_key();
        }
    }

    /// Opens a pending write in the insert clock, when inserts are timed;
    /// `true` if it did (the `PendingWrite` must close it).
    /// Otherwise it counts the write among those the clock cannot place.
    fn open_pending_write(&self, hash: u64) -> bool {
        match self.inner.insert_clock.get() {
            Some(clock) => {
                clock.open_pending(hash);
                true
            }
            None => {
                self.inner.untimed_writes.fetch_add(1, Ordering::SeqCst);
                false
            }
        }
    }

    /// Closes what [`open_pending_write`](Self::open_pending_write) opened.
    pub(crate) fn close_pending_write(&self, hash: u64, timed: bool) {
        match self.inner.insert_clock.get() {
            Some(clock) if timed => clock.close_pending(hash),
            clock => {
                // A read that began while the write was open may have missed
                // it: its answer must not be cached once the count is zero.
                if let Some(clock) = clock {
                    clock.stamp(hash);
                }
                self.inner.untimed_writes.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }

    /// Whether `key` may have been inserted, and so written to the store,
    /// after a backend read that began at `asked_at`: inserted at or after
    /// `asked_at` minus the write settle (see
    /// [`RebuildPolicy::write_settle`]). `true` while inserts are not timed.
    pub(crate) fn may_have_written_since(
        &self,
        key: &[u8],
        asked_at: tokio::time::Instant,
    ) -> bool {
        let Some(clock) = self.inner.insert_clock.get() else {
            return true;
        };
        // A write begun before the clock started may land any time.
        if self.inner.untimed_writes.load(Ordering::SeqCst) > 0 {
            return true;
        }
        let settle = self.inner.rebuild_policy.write_settle;
        let since = asked_at.checked_sub(settle).unwrap_or(self.inner.built_at);
        clock.inserted_since(self.hash(key), since)
    }

    pub(crate) fn count_confirmed_absent_hit(&self, verified: bool) {
        let counters = &self.inner.counters;
        counters.add(Counter::ConfirmedAbsentHits as usize, 1);
        // The filter's false positive still, each time the key is asked:
        // left out, a repeated one would pull the observed rate, and the
        // verified sample's false share, down by how often it repeats. Only
        // for a key the verification samples: the share is the sample's.
        if verified {
            counters.add(Counter::FalsePositives as usize, 1);
            counters.add(Counter::RememberedFalsePositives as usize, 1);
        }
    }

    /// Reports that the store deleted `count` keys. A Bloom filter cannot
    /// forget: a deleted key stays "maybe" until the next rebuild, raising
    /// the real false-positive rate without changing the fill. The guard
    /// counts these and rebuilds once they pass
    /// [`RebuildPolicy::when_removed_exceeds`].
    pub fn note_removals(&self, count: u64) {
        self.inner.counters.add(Counter::Removed as usize, count);
    }

    /// The guard's name, as given to the builder (the `guard` metrics label).
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Whether the guard's fleet member has fenced it: behind the inserts
    /// its fleet acknowledged, it answers every check `MaybePresent` until it
    /// has caught up (see `redis::fleet`, the `redis` feature). Never for a
    /// guard outside a fleet.
    pub fn is_fenced(&self) -> bool {
        self.read_live(|live| live.fenced)
    }

    /// Whether the guard has not yet completed a pass over its source (every
    /// check answers `Warming`). A guard without a source never warms.
    pub fn is_warming(&self) -> bool {
        self.read_live(|live| live.warming)
    }

    /// Reads the live set the way [`check`](Self::check) does, so that a
    /// caller asking about a verdict it just got (the loader and the layer
    /// ask whether a "maybe" came from a fenced set) reads the same set or
    /// a newer one: a swap updates the checks' pointer before the rest.
    fn read_live<R>(&self, read: impl Fn(&LiveSet) -> R) -> R {
        sections::with_thread_record(|record| self.inner.live.read(record, &read))
            .unwrap_or_else(|| read(&self.inner.live.load()))
    }

    /// Waits until the guard has left warming: its first build has
    /// completed, so checks can answer [`Verdict::Absent`]. Returns at once
    /// for a guard without a source. Needs the maintenance task running
    /// ([`spawn_maintenance`](Self::spawn_maintenance)) or a
    /// [`rebuild`](Self::rebuild) to finish; see
    /// [`ready_within`](Self::ready_within) for a bounded wait.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
    /// use bloomguard::{Guard, Verdict, source};
    ///
    /// let guard = Guard::builder()
    ///     .source(source::from_fn(|| vec!["item:1"]))
    ///     .build()?;
    /// assert_eq!(guard.check("item:1"), Verdict::Warming);
    /// let maintenance = guard.spawn_maintenance();
    /// guard.ready().await;
    /// assert_eq!(guard.check("item:1"), Verdict::MaybePresent);
    /// assert_eq!(guard.check("item:2"), Verdict::Absent);
    /// maintenance.shutdown().await;
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// # }).unwrap();
    /// ```
    pub async fn ready(&self) {
        loop {
            let left_warming = self.inner.left_warming.notified();
            let mut left_warming = std::pin::pin!(left_warming);
            // Registered before the look, so a commit in between still wakes us.
            left_warming.as_mut().enable();
            if !self.is_warming() {
                return;
            }
            left_warming.await;
        }
    }

    /// [`ready`](Self::ready), giving up after `timeout`.
    ///
    /// # Errors
    /// [`StillWarming`] if the first build has not completed by then; the
    /// guard keeps answering `Warming` (failing open) meanwhile.
    ///
    /// # Panics
    /// Polled outside a tokio runtime, or on one built without its time
    /// driver (`enable_time`), whose timer it waits on.
    pub async fn ready_within(&self, timeout: Duration) -> Result<(), StillWarming> {
        tokio::time::timeout(timeout, self.ready())
            .await
            .map_err(|_| StillWarming {
                guard: self.inner.name.clone(),
                waited: timeout,
            })
    }

    /// Drops the oldest generation and opens a fresh one for inserts, now.
    /// The maintenance task does this every period of a
    /// [`Lifecycle::Rotate`] guard; with another lifecycle it does nothing.
    /// A call of its own shortens the window: the keys of the generation it
    /// drops go, however recently they were inserted (right after a
    /// scheduled rotation, those of the last period), so a key no longer
    /// stays `(generations − 1) × period`.
    ///
    /// # Errors
    /// [`ConfigError`] if the fresh filter would exceed the memory budget.
    pub fn rotate(&self) -> Result<(), ConfigError> {
        self.rotate_where(|_| true)
    }

    /// The rotation the maintenance task found due at `now`, unless the set
    /// changed since so that it is no longer due (a rotation meanwhile, or a
    /// fleet snapshot from a member that just rotated): a second rotation
    /// at once would drop the generation that was newest a moment ago.
    pub(crate) fn rotate_if_due(&self, now: tokio::time::Instant) -> Result<(), ConfigError> {
        let Lifecycle::Rotate { period, .. } = self.inner.lifecycle else {
            return Ok(());
        };
        self.rotate_where(|newest| newest.opened_at() + period <= now)
    }

    /// Rotates if `due` says so of the newest generation, decided under the
    /// swap lock (and once before, to skip making a filter for nothing).
    fn rotate_where(&self, due: impl Fn(&Generation) -> bool) -> Result<(), ConfigError> {
        let Lifecycle::Rotate { generations, .. } = self.inner.lifecycle else {
            return Ok(());
        };
        if !self
            .inner
            .live
            .load()
            .newest()
            .is_some_and(|newest| due(newest))
        {
            return Ok(());
        }
        let _span = tracing::info_span!("bloomguard.rotate", guard = %self.inner.name).entered();
        let rate = self.first_filter_rate();
        let filter = self.new_filter(self.inner.expected_items, rate)?;
        self.inner.live.rotate(generations, due, || {
            // Held until the new set is published: a write that registers
            // after this read loads that set (see `begin_write`), whatever
            // number of generations the rotation keeps.
            let open_writes = unpoisoned(self.inner.open_write_keys.lock());
            for &hash in open_writes.keys() {
                filter.insert_hashed(hash);
            }
            (
                Generation::new(filter, self.inner.expected_items, rate),
                open_writes,
            )
        });
        Ok(())
    }

    /// Opens a larger filter after `full`, unless another insert did first.
    #[cold]
    fn grow(&self, full: &Arc<Generation>) {
        let Lifecycle::Grow {
            expansion,
            tightening,
        } = self.inner.lifecycle
        else {
            return;
        };
        self.inner.live.grow(full, MAX_GROWN_FILTERS, |opened| {
            let capacity = (full.capacity as f64 * expansion).ceil() as u64;
            // Clamped: the rates left in the series then add at most 1e-8
            // a filter to the compound rate.
            let rate = (full.fp_rate * tightening).max(MIN_FALSE_POSITIVE_RATE);
            let next = self
                .new_generation(capacity, rate)
                .inspect_err(|error| {
                    full.grows_no_further.store(true, Ordering::Relaxed);
                    tracing::warn!(
                        guard = %self.inner.name,
                        %error,
                        "cannot grow: the newest filter keeps taking inserts past its capacity"
                    );
                })
                .ok();
            if next.is_some() && opened + 1 == MAX_GROWN_FILTERS {
                tracing::warn!(
                    guard = %self.inner.name,
                    filters = MAX_GROWN_FILTERS,
                    capacity = full.capacity,
                    "opened the last filter a growing guard opens: past its capacity it keeps \
                     taking inserts and its false-positive rate climbs (size expected_items \
                     or expansion up, or rebuild)"
                );
            }
            next
        });
    }

    fn new_generation(&self, capacity: u64, fp_rate: f64) -> Result<Generation, ConfigError> {
        let filter = self.new_filter(capacity, fp_rate)?;
        Ok(Generation::new(filter, capacity, fp_rate))
    }

    fn new_filter(&self, capacity: u64, fp_rate: f64) -> Result<AtomicBloom, ConfigError> {
        self.inner.filters.sized_for(capacity, fp_rate).build()
    }

    fn first_filter_rate(&self) -> f64 {
        self.inner
            .lifecycle
            .first_filter_rate(self.inner.target_fpr)
    }

    fn history(&self) -> MutexGuard<'_, History> {
        unpoisoned(self.inner.history.lock())
    }
}

/// The filters a guard answered from at one moment, from [`Guard::live_filters`].
pub struct LiveFilters {
    live: Arc<LiveSet>,
}

impl LiveFilters {
    /// The filters, oldest first.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = &AtomicBloom> {
        self.live.generations.iter().map(|g| &g.filter)
    }

    /// The filter taking inserts, if any.
    pub fn newest(&self) -> Option<&AtomicBloom> {
        self.live.newest().map(|g| &g.filter)
    }

    /// How many filters there are (0 while warming, unless a filter was
    /// merged meanwhile).
    pub fn len(&self) -> usize {
        self.live.generations.len()
    }

    /// Whether there is none (the guard is warming, and nothing was merged).
    pub fn is_empty(&self) -> bool {
        self.live.generations.is_empty()
    }

    /// The number of the swap that made these filters live (see
    /// [`GuardStats::swaps`]).
    pub fn swaps(&self) -> u64 {
        self.live.number
    }
}

impl fmt::Debug for LiveFilters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LiveFilters")
            .field("swaps", &self.live.number)
            .field("filters", &self.live.generations.len())
            .finish()
    }
}

/// Keys [`Guard::check_many`] hashes and probes together: enough to
/// overlap their cache misses, few enough to stay on the stack.
pub(crate) const CHECK_GROUP: usize = 64;

/// # Panics
/// If `out` is shorter than `keys`.
fn assert_room_for<K>(keys: &[K], out: &[Verdict]) {
    assert!(
        out.len() >= keys.len(),
        "check_many: {} verdicts for {} keys",
        out.len(),
        keys.len()
    );
}

fn present_if(maybe: bool) -> Verdict {
    if maybe {
        Verdict::MaybePresent
    } else {
        Verdict::Absent
    }
}

impl fmt::Debug for Guard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let live = self.inner.live.load();
        f.debug_struct("Guard")
            .field("name", &self.inner.name)
            .field("lifecycle", &self.inner.lifecycle)
            .field("generations", &live.generations.len())
            .field("swaps", &live.number)
            .field("rebuilding", &live.shadow.is_some())
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;

    /// An insert loads the live set, then writes into its newest generation.
    /// Stalled in between across two rotations, it wrote into a generation
    /// both had dropped, and returned with its key in no filter the guard
    /// reads: `Absent` at once, where a key stays for a window.
    #[test]
    fn an_insert_stalled_across_two_rotations_still_lands_in_the_window() {
        let guard = Guard::builder()
            .expected_items(1_000)
            .lifecycle(Lifecycle::rotate(2, Duration::from_secs(3600)))
            .build()
            .unwrap();
        let hash = guard.hash(b"stalled");
        let loaded = guard.inner.live.load();
        guard.rotate().unwrap();
        guard.rotate().unwrap();
        guard.insert_into(&loaded, hash);
        drop(loaded);
        assert_eq!(guard.check("stalled"), Verdict::MaybePresent);
    }

    /// An insert that loaded the live set while a rotation made its new
    /// generation wrote into the old newest one; the new generation's window
    /// was counted from its making, before that insert, so the old one (and
    /// the key) left up to that long before the key's window ended.
    #[test]
    fn a_rotations_window_starts_after_the_inserts_into_the_set_it_replaces() {
        let guard = Guard::builder()
            .expected_items(1_000)
            .lifecycle(Lifecycle::rotate(2, Duration::from_secs(3600)))
            .build()
            .unwrap();
        let rate = guard.first_filter_rate();
        let filter = guard.new_filter(1_000, rate).unwrap();
        let mut inserted_at = None;
        guard.inner.live.rotate(
            2,
            |_| true,
            || {
                let fresh = Generation::new(filter, 1_000, rate);
                std::thread::scope(|scope| {
                    scope.spawn(|| {
                        guard.insert("meanwhile");
                        inserted_at = Some(tokio::time::Instant::now());
                    });
                });
                (fresh, ())
            },
        );
        let live = guard.inner.live.load();
        let newest = live.newest().unwrap();
        assert!(
            !newest.filter.contains_hashed(guard.hash(b"meanwhile")),
            "the insert wrote into the old newest generation"
        );
        assert!(newest.opened_at() >= inserted_at.unwrap());
    }

    /// A write held open (`begin_write`) while two rotations pass put its
    /// key into a generation both dropped, and the write may land in the
    /// store any time before its `PendingWrite` drops: the key answered
    /// `Absent` from the second rotation until the drop. Its window counts
    /// from the drop, not from the begin.
    #[test]
    fn a_write_held_open_across_rotations_keeps_its_key_while_open_and_after() {
        let guard = Guard::builder()
            .expected_items(1_000)
            .lifecycle(Lifecycle::rotate(2, Duration::from_secs(3600)))
            .build()
            .unwrap();
        let pending = guard.begin_write("slow");
        let other = guard.begin_write("other");
        drop(other);
        for rotation in 1..=3 {
            guard.rotate().unwrap();
            assert_eq!(
                guard.check("slow"),
                Verdict::MaybePresent,
                "rotation {rotation}, the write still open"
            );
        }
        drop(pending); // the write is in the store now
        guard.rotate().unwrap();
        assert_eq!(guard.check("slow"), Verdict::MaybePresent);
        guard.rotate().unwrap();
        assert_eq!(guard.check("slow"), Verdict::Absent, "its window is over");
        assert_eq!(guard.check("other"), Verdict::Absent, "ended long ago");
        assert!(unpoisoned(guard.inner.open_write_keys.lock()).is_empty());
    }

    /// Writes begun while another thread rotates keep their keys in every
    /// set published while they are open, whichever rotation each begin
    /// raced (the registry is read under the swap lock, the write's set
    /// loaded after it registers). Each write stays open across three
    /// rotations, checked after each.
    #[test]
    fn writes_begun_during_rotations_stay_present_while_open() {
        let guard = Guard::builder()
            .expected_items(1_000)
            .seed(11)
            .lifecycle(Lifecycle::rotate(2, Duration::from_secs(3600)))
            .build()
            .unwrap();
        let rotations = AtomicUsize::new(0);
        let stop = std::sync::atomic::AtomicBool::new(false);
        let mut absent_while_open = Vec::new();
        std::thread::scope(|scope| {
            let rotating = scope.spawn(|| {
                while !stop.load(Ordering::Acquire) {
                    guard.rotate().unwrap();
                    rotations.fetch_add(1, Ordering::Release);
                }
            });
            for write in 0..300 {
                let key = format!("open:{write}");
                let pending = guard.begin_write(&key);
                let begun = rotations.load(Ordering::Acquire);
                let mut seen = begun;
                while seen < begun + 3 {
                    let now = rotations.load(Ordering::Acquire);
                    if now > seen {
                        seen = now;
                        if guard.check(&key) == Verdict::Absent {
                            absent_while_open.push(key.clone());
                        }
                    }
                    // A panic there would otherwise leave this loop waiting.
                    assert!(!rotating.is_finished(), "the rotating thread ended");
                    std::thread::yield_now();
                }
                drop(pending);
            }
            stop.store(true, Ordering::Release);
        });
        assert!(absent_while_open.is_empty(), "{absent_while_open:?}");
    }

    /// An insert that runs while the insert clock is being made finds no
    /// clock and stamps nothing, yet comes after the clock's start: a read
    /// asked up to the write settle after it may miss its write, and the
    /// confirmed-absent cache must not keep that miss.
    #[test]
    fn an_insert_while_the_clock_starts_is_not_taken_as_older() {
        let settle = Duration::from_millis(100);
        let guard = Guard::builder()
            .expected_items(1_000)
            .rebuild_policy(RebuildPolicy::default().write_settle(settle))
            .build()
            .unwrap();
        let mut inserted_at = None;
        // The first maker of the clock, with an insert in its window.
        guard.inner.insert_clock.get_or_init(|| {
            let clock = InsertClock::new();
            std::thread::sleep(Duration::from_millis(2));
            inserted_at = Some(tokio::time::Instant::now());
            guard.insert("racing");
            clock
        });
        guard.time_inserts();
        let asked_at = inserted_at.unwrap() + settle;
        assert!(guard.may_have_written_since(b"racing", asked_at));
    }
}
