//! The filters a guard answers from, swapped as one value, and
//! [`LiveState`]: the only place that swaps them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::time::Instant;

use super::sections::{self, Published, Record};
use super::writes::{QuietWait, WriteTracker};
use crate::error::{FilterParameter, IncompatibleFilters};
use crate::filter::{AtomicBloom, Probe};
use crate::sync::unpoisoned;

/// A loaded live set, held for one check or insert (arc-swap's `Guard`,
/// named so that it is not confused with this crate's).
pub(crate) type LoadedSet = arc_swap::Guard<Arc<LiveSet>>;

/// The live set, and the only ways to change it.
///
/// Readers load the set without a lock. Every change is a method here that
/// takes the swap lock, reads the current set and stores the next one, so
/// two changes never interleave and neither loses the other's work (a
/// rotation racing a rebuild's commit, a merge racing a rebuild). The lock is
/// never held across an `.await`.
///
/// The write trackers live here too: `writes` counts the inserts in
/// progress against the set, and a rebuild's shadow brings its own; when a
/// shadow is committed or abandoned its tracker joins `earlier_writes`, and
/// the next rebuild waits until all of them are quiet ([`Self::writes_quiet`])
/// before it reads its source (see `writes.rs` for why).
pub(crate) struct LiveState {
    /// The set for inserts and for whatever holds on to a set.
    set: ArcSwap<LiveSet>,
    /// The same set for checks, read inside a read section (no locked
    /// instruction per check; see `sections.rs`).
    checked: Published<LiveSet>,
    /// Serialises every store of `set`; guards no data of its own, so a
    /// panic elsewhere cannot leave anything half-changed behind it.
    swap_lock: Mutex<()>,
    writes: WriteTracker,
    /// Pending-write counts of earlier rebuilds' shadows, committed or
    /// abandoned. Only the counts are kept, so no replaced filter stays in
    /// memory for them.
    earlier_writes: Mutex<Vec<EarlierWrites>>,
}

/// A retired shadow's pending-write count, with how far the current wait
/// has come with it.
struct EarlierWrites {
    writes: Arc<WriteTracker>,
    wait: QuietWait,
}

/// One rebuild's wait for the inserts that may have missed its shadow
/// ([`LiveState::writes_quiet`]): how far it has come with the guard's own
/// count.
pub(crate) struct WritesWait {
    own: QuietWait,
}

impl LiveState {
    pub(crate) fn new(set: LiveSet) -> Self {
        let set = Arc::new(set.answering_found());
        Self {
            checked: Published::new(Arc::clone(&set), sections::registry()),
            set: ArcSwap::new(set),
            swap_lock: Mutex::new(()),
            writes: WriteTracker::new(),
            earlier_writes: Mutex::new(Vec::new()),
        }
    }

    /// The set now, for one check or insert.
    #[inline]
    pub(crate) fn load(&self) -> LoadedSet {
        self.set.load()
    }

    /// Runs `f` on the set now, inside `record`'s read section: for checks.
    #[inline]
    pub(crate) fn read<R>(&self, record: &Record, f: impl FnOnce(&LiveSet) -> R) -> R {
        self.checked.read(record, f)
    }

    /// Whether `set` (loaded and still held) is the set checks read now. A
    /// replaced set is published for checks first, so `false` comes no
    /// later than a load would see the replacement.
    #[inline]
    pub(crate) fn is_current(&self, set: &LiveSet) -> bool {
        self.checked.is_current(set)
    }

    /// Frees the replaced sets no check can still be reading, waiting up to
    /// `wait` for the checks running now.
    pub(crate) fn reclaim(&self, wait: Option<Duration>) {
        self.checked.reclaim(wait);
    }

    /// Makes `next` the set, for checks first: an insert that loads the new
    /// set happens after it, so a check after that insert reads the new set
    /// too. Callers hold the swap lock.
    fn publish(&self, next: LiveSet) {
        self.publish_then(next, || ());
    }

    /// [`publish`](Self::publish), running `published` once checks and
    /// inserts find `next`, before the sets it replaced are reclaimed
    /// (which waits for the reads of them, and may free large filters).
    fn publish_then(&self, next: LiveSet, published: impl FnOnce()) {
        let next = Arc::new(next.answering_found());
        self.checked.replace_then(next, |next| self.set.store(next));
        published();
        self.checked.reclaim(Some(sections::GRACE_WAIT));
    }

    /// The set now, to hold on to.
    pub(crate) fn load_full(&self) -> Arc<LiveSet> {
        self.set.load_full()
    }

    /// The swap cell itself, for a reader's cache (`arc_swap::Cache`), which
    /// only loads from it.
    pub(crate) fn cell(&self) -> &ArcSwap<LiveSet> {
        &self.set
    }

    /// Inserts in progress against the set: counted in before an insert
    /// loads the set, out once its write is visible.
    #[inline]
    pub(crate) fn writes(&self) -> &WriteTracker {
        &self.writes
    }

    /// Begins a wait for the inserts that may have missed the shadow
    /// installed last.
    pub(crate) fn begin_writes_wait(&self) -> WritesWait {
        for earlier in unpoisoned(self.earlier_writes.lock()).iter_mut() {
            earlier.wait = QuietWait::default();
        }
        WritesWait {
            own: QuietWait::default(),
        }
    }

    /// Whether every insert that may have missed the shadow installed last
    /// is done: the set's own count, then the earlier shadows' (a pending
    /// write moves from the first to the second, never back). An earlier
    /// tracker is read only once the own count was quiet, and dropped once
    /// it is quiet too: until then a write counted in the own one may still
    /// move into it.
    pub(crate) fn writes_quiet(&self, wait: &mut WritesWait) -> bool {
        if !self.writes.is_quiet(&mut wait.own) {
            return false;
        }
        let mut earlier = unpoisoned(self.earlier_writes.lock());
        earlier.retain_mut(|earlier| !earlier.writes.is_quiet(&mut earlier.wait));
        earlier.is_empty()
    }

    /// Starts sending inserts to a rebuild's shadow as well as to the live
    /// filters.
    pub(crate) fn install_shadow(&self, shadow: Arc<Shadow>) {
        let _swap = unpoisoned(self.swap_lock.lock());
        let set = self.set.load();
        self.publish(set.with_shadow(Some(shadow)));
    }

    /// Makes the shadow the only live filter and ends warming. Refused
    /// (`false`, nothing changed) when a filter merged during the build
    /// could not be merged into the shadow: committing would lose its keys.
    pub(crate) fn commit_shadow(&self, shadow: &Arc<Shadow>) -> bool {
        {
            let _swap = unpoisoned(self.swap_lock.lock());
            if shadow
                .missed_a_merge
                .load(std::sync::atomic::Ordering::Relaxed)
            {
                return false;
            }
            let set = self.set.load();
            let mut rebuilt = set.serving(vec![Arc::clone(&shadow.generation)]);
            rebuilt.shadow = None;
            self.publish(rebuilt);
        }
        // Writes that counted on the shadow while it was built are in the
        // live filter now, but not in the next rebuild's.
        self.retire_writes(shadow);
        true
    }

    /// Stops sending inserts to `shadow`, if it is still installed.
    pub(crate) fn abandon_shadow(&self, shadow: &Arc<Shadow>) {
        {
            let _swap = unpoisoned(self.swap_lock.lock());
            let set = self.set.load();
            if set.shadow.as_ref().is_some_and(|s| Arc::ptr_eq(s, shadow)) {
                self.publish(set.with_shadow(None));
            }
        }
        // Writes that counted on the shadow are only in the live filters
        // now: the next rebuild must wait for them.
        self.retire_writes(shadow);
    }

    fn retire_writes(&self, shadow: &Shadow) {
        unpoisoned(self.earlier_writes.lock()).push(EarlierWrites {
            writes: Arc::clone(&shadow.writes),
            wait: QuietWait::default(),
        });
    }

    /// Keeps the newest `keep - 1` generations and opens the one `open`
    /// makes for inserts. The new generation's clock starts once the set
    /// that holds it is published, after every insert that wrote into the
    /// old newest generation without seeing the new set (those that see it
    /// follow it: `Guard::follow_rotations`): their keys are kept for a full
    /// window, which ends `keep - 1` rotations on. A warming guard is left alone
    /// (its first build opens the first generation), and so is a set whose
    /// newest generation `due` does not find due.
    ///
    /// `open` returns, beside the generation, what to hold until the set is
    /// published (and no longer: not through the reclaim).
    pub(crate) fn rotate<Held>(
        &self,
        keep: usize,
        due: impl Fn(&Generation) -> bool,
        open: impl FnOnce() -> (Generation, Held),
    ) {
        let _swap = unpoisoned(self.swap_lock.lock());
        let set = self.set.load();
        if set.warming || !set.newest().is_some_and(|newest| due(newest)) {
            return;
        }
        let (generation, held) = open();
        let fresh = Arc::new(generation.with_clock_held());
        let keep_from = (set.generations.len() + 1).saturating_sub(keep);
        let mut kept = set.generations[keep_from..].to_vec();
        kept.push(Arc::clone(&fresh));
        self.publish_then(set.replaced(kept), || drop(held));
        fresh.start_clock();
    }

    /// Adds the generation `open` makes after `full`, unless another insert
    /// grew the set first (`full` is no longer the newest) or it already
    /// holds `max_generations`. `open` may decline (`None`).
    pub(crate) fn grow(
        &self,
        full: &Arc<Generation>,
        max_generations: usize,
        open: impl FnOnce(usize) -> Option<Generation>,
    ) {
        let _swap = unpoisoned(self.swap_lock.lock());
        let set = self.set.load();
        let still_newest = set.newest().is_some_and(|n| Arc::ptr_eq(n, full));
        if !still_newest {
            return;
        }
        if set.generations.len() >= max_generations {
            full.grows_no_further.store(true, Ordering::Relaxed);
            return;
        }
        if let Some(next) = open(set.generations.len()) {
            let mut generations = set.generations.clone();
            generations.push(Arc::new(next));
            self.publish(set.replaced(generations));
        }
    }

    /// ORs `filter` into the newest generation (and into a shadow being
    /// built, or marks that shadow as having missed it); with no generation
    /// yet, installs it as the first one through `first`. Never ends warming.
    ///
    /// # Errors
    /// [`IncompatibleFilters`] unless `filter` has the newest filter's
    /// geometry, or (with none) the `seed` the guard's filters use.
    pub(crate) fn merge(
        &self,
        filter: AtomicBloom,
        seed: u64,
        first: impl FnOnce(AtomicBloom) -> Generation,
    ) -> Result<(), IncompatibleFilters> {
        let _swap = unpoisoned(self.swap_lock.lock());
        let set = self.set.load();
        match set.newest() {
            Some(newest) => newest.filter.union(&filter)?,
            None if filter.seed() != seed => {
                return Err(IncompatibleFilters {
                    differs_in: FilterParameter::Seed,
                });
            }
            None => {}
        }
        if let Some(shadow) = &set.shadow {
            shadow.take_merged(&filter);
        }
        if set.newest().is_none() {
            self.publish(set.replaced(vec![Arc::new(first(filter))]));
        }
        Ok(())
    }

    /// Fences the set (every check answers `MaybePresent`) or lifts the
    /// fence; the filters stay as they are.
    #[cfg(feature = "redis")]
    pub(crate) fn set_fenced(&self, fenced: bool) {
        let _swap = unpoisoned(self.swap_lock.lock());
        let set = self.set.load();
        if set.fenced != fenced {
            self.publish(LiveSet {
                fenced,
                ..set.with_shadow(set.shadow.clone())
            });
        }
    }

    /// Replaces the generations with `generations` (a fleet snapshot) and
    /// fences the set in the same store, so that no check sees the new
    /// filters before the caller has replayed what they lack. Ends warming
    /// when `covers_the_store`.
    ///
    /// A rebuild's shadow stays installed, and takes the snapshot's filters
    /// as it takes a merge's: it holds the store as scanned and every insert
    /// made here since, but not the keys other instances wrote meanwhile,
    /// which the snapshot brings in place of the stream entries the caller
    /// skips. Where the geometry differs, its commit is refused instead.
    #[cfg(feature = "redis")]
    pub(crate) fn replace_fenced(&self, generations: Vec<Arc<Generation>>, covers_the_store: bool) {
        let _swap = unpoisoned(self.swap_lock.lock());
        let set = self.set.load();
        if let Some(shadow) = &set.shadow {
            for generation in &generations {
                shadow.take_merged(&generation.filter);
            }
        }
        let mut next = set.replaced(generations);
        next.fenced = true;
        next.warming &= !covers_the_store;
        self.publish(next);
    }
}

impl std::fmt::Debug for LiveState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveState")
            .field("set", &self.set.load())
            .field("writes", &self.writes)
            .finish_non_exhaustive()
    }
}

/// What a guard's queries and inserts see at one moment: swapped whole
/// through `ArcSwap`, never changed in place (the filters' bits aside).
#[derive(Debug)]
pub(crate) struct LiveSet {
    /// Oldest first; the newest takes inserts. Empty while warming, unless
    /// a filter was merged in before the first build.
    pub(crate) generations: Vec<Arc<Generation>>,
    /// No complete pass over the guard's own source yet: every check answers
    /// `Warming`, whatever the generations hold. Only a build's commit ends it.
    pub(crate) warming: bool,
    /// A filter being built by a rebuild: inserts go here too.
    pub(crate) shadow: Option<Arc<Shadow>>,
    /// The guard's fleet cannot show that these filters hold every insert
    /// acknowledged to a writer: every check answers `MaybePresent`.
    pub(crate) fenced: bool,
    /// Changes whenever `generations` does.
    pub(crate) number: u64,
    /// The filter every check answers from when there is exactly one, and
    /// neither warming nor a fence overrides it (the usual case): its probe
    /// is read from this set's own memory, where `generations` takes three
    /// loads and three tests. Set as the set is published
    /// ([`Self::answering_found`]), after every other field is final; `None`
    /// sends checks the long way, which answers the same.
    pub(crate) answering: Option<Answering>,
}

/// The one filter a set answers from, with its probe copied out. Both
/// fields stay private: the probe is sound only beside the `Arc` it was
/// taken through.
#[derive(Clone, Debug)]
pub(crate) struct Answering {
    probe: Probe,
    generation: Arc<Generation>,
}

impl Answering {
    fn of(generation: &Arc<Generation>) -> Option<Self> {
        Some(Self {
            probe: generation.filter.probe()?,
            generation: Arc::clone(generation),
        })
    }

    pub(crate) fn generation(&self) -> &Arc<Generation> {
        &self.generation
    }

    /// Whether the filter may hold the key `hash` is the hash of (under the
    /// guard's seed, which every generation has).
    #[inline]
    pub(crate) fn contains_hashed(&self, hash: u64) -> bool {
        // SAFETY: the probe was taken from `generation`'s filter, which
        // `self` keeps alive.
        unsafe { self.probe.contains_hashed(hash) }
    }
}

impl LiveSet {
    pub(crate) fn warming() -> Self {
        Self {
            generations: Vec::new(),
            warming: true,
            shadow: None,
            fenced: false,
            number: 0,
            answering: None,
        }
    }

    /// A set that serves from `generations`, numbered as the next swap.
    pub(crate) fn serving(&self, generations: Vec<Arc<Generation>>) -> Self {
        Self {
            warming: false,
            ..self.replaced(generations)
        }
    }

    /// The set with [`answering`](Self::answering) derived from its other
    /// fields, which must not change after this.
    fn answering_found(self) -> Self {
        let answering = match self.generations.as_slice() {
            [only] if !self.warming && !self.fenced => Answering::of(only),
            _ => None,
        };
        Self { answering, ..self }
    }

    pub(crate) fn newest(&self) -> Option<&Arc<Generation>> {
        self.generations.last()
    }

    /// Whether any generation's filter may hold the key `hash` is the hash
    /// of, whatever the set answers (warming, fenced). The newest first: it
    /// is the likeliest to hold a recent key.
    pub(crate) fn filters_hold(&self, hash: u64) -> bool {
        self.generations
            .iter()
            .rev()
            .any(|generation| generation.filter.contains_hashed(hash))
    }

    /// The same filters with `shadow` taking inserts alongside.
    pub(crate) fn with_shadow(&self, shadow: Option<Arc<Shadow>>) -> Self {
        Self {
            generations: self.generations.clone(),
            warming: self.warming,
            shadow,
            fenced: self.fenced,
            number: self.number,
            answering: None,
        }
    }

    /// A new set of generations, numbered as the next swap.
    pub(crate) fn replaced(&self, generations: Vec<Arc<Generation>>) -> Self {
        Self {
            generations,
            warming: self.warming,
            shadow: self.shadow.clone(),
            fenced: self.fenced,
            number: self.number + 1,
            answering: None,
        }
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        let generations: usize = self
            .generations
            .iter()
            .map(|g| g.filter.memory_bytes())
            .sum();
        generations
            + self
                .shadow
                .as_ref()
                .map_or(0, |s| s.generation.filter.memory_bytes())
    }
}

/// One filter of the live set, with what it was sized for.
#[derive(Debug)]
pub(crate) struct Generation {
    pub(crate) filter: AtomicBloom,
    pub(crate) capacity: u64,
    pub(crate) fp_rate: f64,
    /// When it was made, or, restored from a snapshot, made elsewhere.
    pub(crate) made_at: Instant,
    /// Nanoseconds from `made_at` to the publish of the set that opened it
    /// for inserts (a rotation's), which starts its window's clock;
    /// [`CLOCK_NOT_STARTED`] until then.
    clock_start_delay_ns: AtomicU64,
    /// The set-bit count at which the filter holds `capacity` keys.
    pub(crate) full_at_set_bits: u64,
    /// Inserts whose hash has these bits clear check whether the filter is full.
    pub(crate) fullness_check_mask: u64,
    /// A growing guard opens no filter after this one (it opened its last,
    /// or could not open the next): its inserts stop checking whether it is
    /// full, which would take the swap lock each time.
    pub(crate) grows_no_further: AtomicBool,
}

/// A rotation's generation whose set is not published yet: its window has
/// not begun, and reads of its clock (a snapshot's age) take it as now.
const CLOCK_NOT_STARTED: u64 = u64::MAX;

/// Inserts between two checks of the fill, at most: summing the stripes on
/// every insert would cost more than the insert.
const MAX_FULLNESS_CHECK_INTERVAL: u64 = 1024;

impl Generation {
    pub(crate) fn new(filter: AtomicBloom, capacity: u64, fp_rate: f64) -> Self {
        let full_at_set_bits = filter.set_bits_expected_at(capacity);
        // The overshoot past capacity is geometric with a mean of one
        // interval; at 1/2048 of the capacity even its far tail (10 means,
        // 0.5 %) raises the filter's FPR by ~2.5 %, which the tightened
        // rates of the later filters leave room for.
        let interval = (capacity / 2048).clamp(1, MAX_FULLNESS_CHECK_INTERVAL);
        Self {
            filter,
            capacity,
            fp_rate,
            made_at: Instant::now(),
            clock_start_delay_ns: AtomicU64::new(0),
            full_at_set_bits,
            fullness_check_mask: (1u64 << interval.ilog2()) - 1,
            grows_no_further: AtomicBool::new(false),
        }
    }

    /// When the generation's window began: when it was made, or when a
    /// rotation published it (now, until it has: an early read errs towards
    /// a longer window).
    pub(crate) fn opened_at(&self) -> Instant {
        match self.clock_start_delay_ns.load(Ordering::Acquire) {
            CLOCK_NOT_STARTED => Instant::now(),
            delay => self.made_at + Duration::from_nanos(delay),
        }
    }

    /// Holds the window's clock until [`start_clock`](Self::start_clock).
    fn with_clock_held(self) -> Self {
        self.clock_start_delay_ns
            .store(CLOCK_NOT_STARTED, Ordering::Relaxed);
        self
    }

    /// Starts the window's clock now: the set that opens it is published.
    fn start_clock(&self) {
        let delay = u64::try_from(self.made_at.elapsed().as_nanos())
            .unwrap_or(u64::MAX)
            .min(CLOCK_NOT_STARTED - 1);
        self.clock_start_delay_ns.store(delay, Ordering::Release);
    }

    /// Whether the filter holds its capacity, checked on a sample of inserts.
    #[inline]
    pub(crate) fn is_full_sampled(&self, hash: u64) -> bool {
        (hash >> 32) & self.fullness_check_mask == 0
            && self.filter.set_bits() >= self.full_at_set_bits
    }
}

/// A filter a rebuild is filling from the source, and the inserts that must
/// not be lost should the rebuild be abandoned.
#[derive(Debug)]
pub(crate) struct Shadow {
    /// Becomes the live generation when the rebuild commits.
    pub(crate) generation: Arc<Generation>,
    /// Shared with the pending writes that count on this filter, and kept
    /// by the guard after this build ends (see `LiveState`).
    pub(crate) writes: Arc<WriteTracker>,
    /// Set when a filter merged into the live set (or a snapshot replacing
    /// it) could not be merged into this one: committing it would lose that
    /// filter's keys.
    pub(crate) missed_a_merge: AtomicBool,
}

impl Shadow {
    /// ORs `filter`, put into the live set, into this one too; marks the
    /// shadow as having missed it where the geometry differs. Callers hold
    /// the swap lock, which `LiveState::commit_shadow` reads the mark under.
    fn take_merged(&self, filter: &AtomicBloom) {
        if self.generation.filter.union(filter).is_err() {
            self.missed_a_merge
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The locking rule at work: changes racing from many threads each see the
/// one before (none is lost). arc-swap's internals are not loom-aware, so
/// this runs on real threads; the insert/rebuild handshake has its loom
/// models in `writes.rs`.
#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;
    use crate::filter::FilterBuilder;

    fn generation() -> Generation {
        let filter = FilterBuilder::for_items(1_000, 0.01)
            .seed(7)
            .build()
            .unwrap();
        Generation::new(filter, 1_000, 0.01)
    }

    /// Checks read the set through a plain pointer (`sections.rs`); a swap
    /// still frees the set it replaced once no check reads it, so rebuilds
    /// do not pile up filters.
    #[test]
    fn a_replaced_set_is_freed_once_no_check_reads_it() {
        let state = LiveState::new(LiveSet::warming().serving(vec![Arc::new(generation())]));
        let replaced = Arc::downgrade(&state.load_full());
        let record = sections::registry().claim();
        let number = state.read(record, |set| set.number);
        state.rotate(1, |_| true, || (generation(), ()));
        // Another test's check may be inside a section for a moment.
        state.reclaim(None);
        assert!(replaced.upgrade().is_none(), "the replaced set was freed");
        assert_eq!(
            state.read(record, |set| set.number),
            number + 1,
            "the next check reads the new set"
        );
        // SAFETY: its sections have ended, and the claim is not used again.
        unsafe { sections::Registry::release(record) };
    }

    /// The filter a check answers from without looking at the flags is set
    /// exactly when they allow it: a stale one would answer a fenced or
    /// warming guard's checks from the filter (a false `Absent`).
    #[test]
    fn the_answering_filter_follows_every_change() {
        fn assert_derived(state: &LiveState, what: &str) {
            let set = state.load_full();
            let expected = match set.generations.as_slice() {
                [only] if !set.warming && !set.fenced => Some(Arc::as_ptr(only)),
                _ => None,
            };
            assert_eq!(
                set.answering
                    .as_ref()
                    .map(|only| Arc::as_ptr(&only.generation)),
                expected,
                "{what}"
            );
        }
        let state = LiveState::new(LiveSet::warming());
        assert_derived(&state, "warming, no filter");
        let merged = FilterBuilder::for_items(1_000, 0.01)
            .seed(7)
            .build()
            .unwrap();
        state
            .merge(merged, 7, |filter| Generation::new(filter, 1_000, 0.01))
            .unwrap();
        assert_derived(&state, "warming with a merged filter");
        let shadow = new_shadow();
        state.install_shadow(Arc::clone(&shadow));
        assert_derived(&state, "a shadow installed while warming");
        assert!(state.commit_shadow(&shadow));
        assert_derived(&state, "warming ended by a commit");
        assert!(state.load().answering.is_some());
        state.rotate(2, |_| true, || (generation(), ()));
        assert_derived(&state, "two generations");
        state.rotate(1, |_| true, || (generation(), ()));
        assert_derived(&state, "one generation again");
        let shadow = new_shadow();
        state.install_shadow(Arc::clone(&shadow));
        assert_derived(&state, "a shadow installed while serving");
        state.abandon_shadow(&shadow);
        assert_derived(&state, "the shadow abandoned");
        let newest = Arc::clone(state.load().newest().unwrap());
        state.grow(&newest, 3, |_| Some(generation()));
        assert_derived(&state, "grown to two generations");
        #[cfg(feature = "redis")]
        {
            state.set_fenced(true);
            assert_derived(&state, "fenced");
            state.set_fenced(false);
            assert_derived(&state, "unfenced");
            state.replace_fenced(vec![Arc::new(generation())], true);
            assert_derived(&state, "replaced and fenced");
        }
    }

    /// The probe copied into the set answers what its filter answers, for
    /// keys in it and keys not (a probe reading the wrong block or with the
    /// wrong kernel would lose inserted keys).
    #[test]
    fn the_answering_probe_answers_as_its_filter() {
        let state = LiveState::new(LiveSet::warming().serving(vec![Arc::new(generation())]));
        let set = state.load_full();
        let answering = set.answering.as_ref().expect("one serving generation");
        let filter = &answering.generation.filter;
        for i in 0..1_000 {
            filter.insert(format!("in:{i}"));
        }
        let (mut present, mut false_positives) = (0, 0);
        for i in 0..1_000 {
            for key in [format!("in:{i}"), format!("out:{i}")] {
                let found = answering.contains_hashed(filter.hash(key.as_bytes()));
                assert_eq!(found, filter.contains(&key), "{key}");
                present += usize::from(found && key.starts_with("in:"));
                false_positives += usize::from(found && key.starts_with("out:"));
            }
        }
        assert_eq!(present, 1_000);
        assert!(
            false_positives < 50,
            "{false_positives} of 1,000 absent keys"
        );
    }

    fn new_shadow() -> Arc<Shadow> {
        Arc::new(Shadow {
            generation: Arc::new(generation()),
            writes: Arc::new(WriteTracker::new()),
            missed_a_merge: AtomicBool::new(false),
        })
    }

    /// A pending write that loaded a set with shadow S1, and moves its count
    /// from the guard's tracker to S1's after S1 was committed: a rebuild
    /// installed meanwhile must wait for it. Pruning S1's tracker while the
    /// guard's own count was still up lost the write (a false negative once
    /// that rebuild commits without the key).
    #[test]
    fn a_write_moving_to_an_earlier_shadow_keeps_the_next_rebuild_waiting() {
        let state = LiveState::new(LiveSet::warming().serving(vec![Arc::new(generation())]));
        let first = new_shadow();
        state.install_shadow(Arc::clone(&first));
        let counted = state.writes().enter();
        let seen = state.load_full();
        assert!(state.commit_shadow(&first));
        state.install_shadow(new_shadow());
        let mut wait = state.begin_writes_wait();
        assert!(
            !state.writes_quiet(&mut wait),
            "the write is counted in the guard"
        );
        let counted_there = state
            .writes()
            .move_to(counted, &seen.shadow.as_ref().unwrap().writes);
        assert!(
            !state.writes_quiet(&mut wait),
            "the write is counted in the first shadow's tracker now"
        );
        seen.shadow.as_ref().unwrap().writes.exit(counted_there);
        assert!(state.writes_quiet(&mut wait), "the write is done");
    }

    /// A set replaced from a snapshot while a rebuild's shadow is installed:
    /// the snapshot's keys (written to the store by other instances, maybe
    /// after the rebuild's scan passed them) must survive the commit.
    #[cfg(feature = "redis")]
    #[test]
    fn a_commit_after_a_snapshot_replaced_the_set_keeps_its_keys() {
        let snapshot_of = |key: &str| {
            let generation = generation();
            generation.filter.insert(key);
            vec![Arc::new(generation)]
        };
        // The same geometry: the shadow takes the snapshot's bits.
        let state = LiveState::new(LiveSet::warming());
        let shadow = new_shadow();
        state.install_shadow(Arc::clone(&shadow));
        state.replace_fenced(snapshot_of("from the fleet"), true);
        assert!(state.commit_shadow(&shadow));
        assert!(
            state.load().generations[0]
                .filter
                .contains("from the fleet")
        );
        // Another geometry: the commit is refused and the snapshot stays.
        let state = LiveState::new(LiveSet::warming());
        let other_size = Arc::new(Shadow {
            generation: Arc::new(Generation::new(
                FilterBuilder::for_items(5_000, 0.01)
                    .seed(7)
                    .build()
                    .unwrap(),
                5_000,
                0.01,
            )),
            writes: Arc::new(WriteTracker::new()),
            missed_a_merge: AtomicBool::new(false),
        });
        state.install_shadow(Arc::clone(&other_size));
        state.replace_fenced(snapshot_of("from the fleet"), true);
        assert!(!state.commit_shadow(&other_size), "the commit is refused");
        assert!(
            state.load().generations[0]
                .filter
                .contains("from the fleet")
        );
    }

    #[test]
    fn racing_changes_are_serialised_and_none_is_lost() {
        let state = LiveState::new(LiveSet::warming().serving(vec![Arc::new(generation())]));
        let first = state.load().number;
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..100 {
                        state.rotate(3, |_| true, || (generation(), ()));
                    }
                });
            }
            scope.spawn(|| {
                for _ in 0..100 {
                    let merged = FilterBuilder::for_items(1_000, 0.01)
                        .seed(7)
                        .build()
                        .unwrap();
                    merged.insert("merged");
                    state
                        .merge(merged, 7, |_| unreachable!("never empty"))
                        .unwrap();
                }
            });
        });
        let set = state.load();
        assert_eq!(set.number, first + 400, "every rotation saw the one before");
        assert_eq!(set.generations.len(), 3);
        assert!(!set.warming);
    }
}
