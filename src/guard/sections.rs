//! Read sections: how a check reads the live set with no locked instruction
//! and (where `membarrier(2)` serves) no `SeqCst` fence, and how a replaced
//! set is freed once no check can still be reading it (read-copy-update,
//! with asymmetric barriers).
//!
//! Each thread that checks owns a [`Record`] (claimed on its first check,
//! given back when it exits). A check opens a [`Section`] on it: two plain
//! stores to the thread's own cache line, around a plain load of the set's
//! pointer ([`Published::read`]). The price moves to the rare side: after a
//! swap, [`Published::reclaim`] issues one process-wide barrier
//! (`membarrier(2)` on Linux, see `crate::sync`) and waits for
//! the sections open at that moment to end, then drops the sets it replaced.
//! Where `membarrier` does not serve (not Linux, or refused), both sides
//! use a `SeqCst` fence instead: the section's opening store is followed by
//! one, as each record says.
//!
//! Should `membarrier` fail after it was chosen (a seccomp profile applied
//! later, or the kernel out of memory for the expedited command), the
//! process turns its readers to fences for good (`crate::sync`). The
//! sections of a thread that claimed its record before then did not fence,
//! and a reclaim whose `membarrier` fails too has nothing that pairs with
//! them; so it frees nothing until each claimed record's owner has said
//! from which of its sections on it fences (it learns from its record to
//! do so, at its next check or count) or given the record back. Replaced
//! sets then wait for every thread that held a record before the turn (it
//! checked, inserted or counted) to touch a guard again (or set a bit in
//! any filter) or exit; one that never does holds them for as long as it
//! lives (`tests/membarrier_revoked.rs`), unless a later reclaim's
//! `membarrier` serves (the failure was one thread's, or passed), which
//! reaches every thread (`tests/membarrier_refused_on_one_thread.rs`).
//!
//! Memory: a thread holds nothing between checks, so an idle thread keeps
//! no replaced set alive (but after the turn above, until it touches a
//! guard again or exits). A replaced set lives until the sections that were
//! open when it was replaced have ended; the swap waits up to
//! [`GRACE_WAIT`] for them (a check takes nanoseconds), and a section held
//! longer (its thread preempted mid-check, or a slow `as_ref` of a key type
//! in `check_many`, which runs inside the section) defers the drop to the
//! first swap or maintenance tick after that section ends (a guard with no
//! maintenance task keeps it until its next swap). Each replaced set waits
//! only for the sections open at the barrier after its replacement, not for
//! a moment with every section closed: long sections that keep overlapping
//! (threads preempted one after another on a throttled host) hold back no
//! set replaced before they opened.
//!
//! A child process made by `fork` copies every record, and one whose thread
//! was inside a section stays open there for good: each swap in the child
//! then waits [`GRACE_WAIT`] and keeps the set it replaced. A child should
//! build its own guards after `exec`, as with any multi-threaded state.
//!
//! Sections nest: one opened inside another (a key's `as_ref` that checks a
//! guard) opens nothing, and the outer one covers its reads. A signal
//! handler's section does not: a section's opening reads the record's
//! fence flag before it stores, and a handler that runs between the two
//! and acknowledges a turn to fences leaves the interrupted opening
//! unfenced where the record says it fences. Guards are not
//! async-signal-safe (`Guard`'s docs say so).

// Under loom the guard reads the slow way; only the models claim records.
#![cfg_attr(all(bloomguard_loom, not(test)), allow(dead_code))]

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::sync::{
    AtomicBool, AtomicPtr, AtomicU64, HeavyBarrier, Mutex, Ordering, fence, heavy_barrier,
    light_barrier, light_barrier_is_enough, unpoisoned,
};

/// How long a swap waits for the sections open at the swap to end before it
/// leaves the replaced sets to the next reclaim.
pub(crate) const GRACE_WAIT: Duration = Duration::from_millis(1);

/// One thread's read-section state, on a cache line of its own.
#[repr(align(128))]
pub(crate) struct Record {
    /// Odd while the owner is inside a section. Only the owner writes it.
    sequence: AtomicU64,
    /// Taken by a live thread (claimed with a CAS, given back at its exit).
    claimed: AtomicBool,
    /// Dense from 0, and owned by one live thread at a time: the index of
    /// the thread's own counter stripe (see `stats::ThreadCounters`).
    pub(crate) index: usize,
    /// Whether a compiler fence orders this record's sections (`membarrier`
    /// serves; see `crate::sync`): decided for the process at the latest
    /// while the first record is made. Turned off, for good, by a reclaimer
    /// whose `membarrier` failed; read by the owner at each section.
    light_barrier_is_enough: AtomicBool,
    /// The first of the owner's sections that fences ([`NO_FENCED_SECTION`]
    /// until one does): every section before it has ended once a reclaimer
    /// reads this (it is stored with release by the owner, after them).
    fences_from: AtomicU64,
    next: AtomicPtr<Record>,
}

/// [`Record::fences_from`] of a record none of whose sections fenced yet.
const NO_FENCED_SECTION: u64 = u64::MAX;

impl Record {
    /// Opens a read section: until it drops, nothing this thread reads
    /// through [`Published::read`] is freed. Inside a section already (a
    /// key's `as_ref` that checks a guard), it opens nothing: the outer
    /// section was open before anything this one reads was loaded, and stays
    /// open until after this one ends.
    #[inline]
    pub(crate) fn enter(&self) -> Section<'_> {
        let before = self.sequence.load(Ordering::Relaxed);
        if before.is_multiple_of(2) {
            let light = self.light_barrier_is_enough.load(Ordering::Relaxed);
            if !light {
                // This section fences (the flag never turns back on).
                self.fence_from_the_next_section_if_told();
            }
            // Release: a reclaimer that reads this value (having missed the
            // close of the section before) must still see that section's
            // reads done; a relaxed store would not carry them (loom found it).
            self.sequence.store(before + 1, Ordering::Release);
            // Orders the store above before the set's load, paired with the
            // reclaimer's heavy barrier (a compiler fence where membarrier
            // works).
            light_barrier(light);
        }
        Section {
            record: self,
            before,
        }
    }

    /// Makes the owner's sections fence from its next one on, if the process
    /// has turned to fences. Called by a thread that has just claimed the
    /// record: the fence pairs with the one a reclaimer makes after turning
    /// (see `crate::sync`) before it reads the records, so either that
    /// reclaimer sees this record claimed, or this sees the turn.
    fn fence_if_the_process_does(&self) {
        fence(Ordering::SeqCst);
        if !light_barrier_is_enough() {
            self.light_barrier_is_enough.store(false, Ordering::Relaxed);
            self.fence_from_the_next_section_if_told();
        }
    }

    /// For the owner, outside a section: the index its counters add under,
    /// acknowledging a turn on the way (a counting thread must not hold up
    /// reclaims, see below).
    #[inline]
    fn index_for_counting(&self) -> usize {
        self.fence_from_the_next_section_if_told();
        self.index
    }

    /// For the owner, outside a section: if a reclaimer told this record to
    /// fence and it has not said from which section on, says "the next one"
    /// (every earlier one has ended). Called as a section opens, and where a
    /// thread only counts (inserts, outcomes, a reader's flush; the set bits
    /// of a filter insert on a thread that holds a record), so that such a
    /// thread stops holding up reclaims after a turn too.
    fn fence_from_the_next_section_if_told(&self) {
        if !self.light_barrier_is_enough.load(Ordering::Relaxed)
            && self.fences_from.load(Ordering::Relaxed) == NO_FENCED_SECTION
        {
            let sequence = self.sequence.load(Ordering::Relaxed);
            if sequence.is_multiple_of(2) {
                self.fences_from.store(sequence + 1, Ordering::Release);
            }
        }
    }
}

/// An open read section; closes on drop (unless nested in another).
pub(crate) struct Section<'a> {
    record: &'a Record,
    /// The record's sequence before the section: odd when nested. The close
    /// is computed from it rather than kept beside it, one value less to
    /// carry across the probe (a spill, measured as a store per check).
    before: u64,
}

impl Drop for Section<'_> {
    #[inline]
    fn drop(&mut self) {
        if self.before.is_multiple_of(2) {
            // Release: the section's reads happen before a reclaimer that
            // sees the new value drops anything.
            self.record
                .sequence
                .store(self.before + 2, Ordering::Release);
        }
    }
}

/// Every record ever made: a list that only grows, as long as the most
/// threads that ever checked at once (records are reused after their
/// thread exits).
pub(crate) struct Registry {
    head: AtomicPtr<Record>,
    count: AtomicU64,
}

impl Registry {
    #[cfg(not(bloomguard_loom))]
    const fn new() -> Self {
        Self {
            head: AtomicPtr::new(std::ptr::null_mut()),
            count: AtomicU64::new(0),
        }
    }

    #[cfg(bloomguard_loom)]
    pub(crate) fn new() -> Self {
        Self {
            head: AtomicPtr::new(std::ptr::null_mut()),
            count: AtomicU64::new(0),
        }
    }

    fn records(&self) -> impl Iterator<Item = &Record> {
        let mut next = self.head.load(Ordering::Acquire);
        std::iter::from_fn(move || {
            // SAFETY: records are leaked, never freed, and published with a
            // release CAS after `next` was written.
            let record = unsafe { next.as_ref()? };
            next = record.next.load(Ordering::Acquire);
            Some(record)
        })
    }

    /// A record for the calling thread: a released one, or a new one.
    pub(crate) fn claim(&self) -> &Record {
        for record in self.records() {
            if !record.claimed.load(Ordering::Relaxed)
                && record
                    .claimed
                    .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                record.fence_if_the_process_does();
                return record;
            }
        }
        let light = light_barrier_is_enough();
        let record: &Record = Box::leak(Box::new(Record {
            sequence: AtomicU64::new(0),
            claimed: AtomicBool::new(true),
            index: self.count.fetch_add(1, Ordering::Relaxed) as usize,
            light_barrier_is_enough: AtomicBool::new(light),
            fences_from: AtomicU64::new(if light { NO_FENCED_SECTION } else { 0 }),
            next: AtomicPtr::new(std::ptr::null_mut()),
        }));
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            record.next.store(head, Ordering::Relaxed);
            let new_head = std::ptr::from_ref(record).cast_mut();
            match self
                .head
                .compare_exchange(head, new_head, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => break,
                Err(current) => head = current,
            }
        }
        record.fence_if_the_process_does();
        record
    }

    /// Gives `record` back for another thread to claim.
    ///
    /// # Safety
    /// `record` is claimed, no section of it is open, and none is opened
    /// through this claim again. Another thread may claim it next; two
    /// threads opening sections of one record would both write its
    /// sequence, and a reclaimer could then free a value one still reads.
    pub(crate) unsafe fn release(record: &Record) {
        record.claimed.store(false, Ordering::Release);
    }

    /// The sections open now, behind a heavy barrier: any that may read a
    /// value unpublished before this call is among them. `None` where a
    /// claimed record's sections do not fence and the barrier did not reach
    /// its thread (a turn to fences it has not acknowledged yet): nothing
    /// here pairs with those.
    fn open_sections(&self) -> Option<OpenSections<'_>> {
        // After this, a section that loaded a replaced pointer has made its
        // opening store visible here (and one opened later loads the new one),
        // if it fenced or the barrier reached every thread.
        let every_thread = heavy_barrier() == HeavyBarrier::EveryThread;
        let mut open = Vec::new();
        let mut unfenced = false;
        for record in self.records() {
            if !every_thread && record.fences_from.load(Ordering::Acquire) == NO_FENCED_SECTION {
                // A record released since holds no section (its owner ended
                // them all before giving it back), and a thread claiming it
                // anew fences (`fence_if_the_process_does`). A claimed one
                // may still open sections that nothing here pairs with:
                // wait for its owner to fence one.
                if record.claimed.load(Ordering::Acquire) {
                    record
                        .light_barrier_is_enough
                        .store(false, Ordering::Relaxed);
                    unfenced = true;
                }
                continue;
            }
            let sequence = record.sequence.load(Ordering::Acquire);
            if !sequence.is_multiple_of(2) {
                open.push((record, sequence));
            }
        }
        (!unfenced).then_some(open)
    }
}

/// Sections open at a heavy barrier: each record with its (odd) sequence
/// then. A section has ended once its record's sequence moved on (it only
/// grows, across owners too).
type OpenSections<'a> = Vec<(&'a Record, u64)>;

/// Drops from `open` the sections that have ended, waiting for the others
/// until `deadline` (`None`: for as long as it takes). `true` once none is
/// left.
fn forget_ended(open: &mut OpenSections<'_>, deadline: Option<Instant>) -> bool {
    let mut past_deadline = false;
    open.retain(|&(record, opened)| {
        let mut spins = 0u32;
        while record.sequence.load(Ordering::Acquire) == opened {
            past_deadline =
                past_deadline || deadline.is_some_and(|deadline| Instant::now() >= deadline);
            if past_deadline {
                return true;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                crate::sync::yield_now();
            }
        }
        false
    });
    open.is_empty()
}

/// The process's records.
#[cfg(not(bloomguard_loom))]
static REGISTRY: Registry = Registry::new();

#[cfg(not(bloomguard_loom))]
thread_local! {
    /// The calling thread's record once claimed: one load on the hot path
    /// (a constant-initialised local without a destructor).
    static CLAIMED: std::cell::Cell<Option<&'static Record>> = const { std::cell::Cell::new(None) };
    /// Gives the record back when the thread exits.
    static RELEASE_AT_EXIT: ThreadRecord = ThreadRecord(REGISTRY.claim());
}

#[cfg(not(bloomguard_loom))]
struct ThreadRecord(&'static Record);

#[cfg(not(bloomguard_loom))]
impl Drop for ThreadRecord {
    fn drop(&mut self) {
        // Later calls on this thread (from other locals' destructors) must
        // not use a record another thread may claim next.
        CLAIMED.set(None);
        // SAFETY: this thread claimed the record (`claim_for_this_thread`)
        // and, its locals torn down, opens no section of it again: later
        // calls find `CLAIMED` empty and `RELEASE_AT_EXIT` gone.
        unsafe { Registry::release(self.0) };
    }
}

/// Runs `f` with the calling thread's record; `None` while the thread's
/// locals are being torn down (the caller then reads the slow way).
#[cfg(not(bloomguard_loom))]
#[inline]
pub(crate) fn with_thread_record<R>(f: impl FnOnce(&Record) -> R) -> Option<R> {
    let record = match CLAIMED.get() {
        Some(record) => record,
        None => claim_for_this_thread()?,
    };
    Some(f(record))
}

#[cfg(not(bloomguard_loom))]
#[cold]
fn claim_for_this_thread() -> Option<&'static Record> {
    let record = RELEASE_AT_EXIT.try_with(|claimed| claimed.0).ok()?;
    CLAIMED.set(Some(record));
    Some(record)
}

/// The calling thread's record's index, for counting outside a read
/// section; `None` as for [`with_thread_record`].
pub(crate) fn thread_record_index() -> Option<usize> {
    with_thread_record(Record::index_for_counting)
}

/// [`thread_record_index`] for a thread that holds its record already;
/// `None` (and nothing claimed) otherwise.
#[cfg(not(bloomguard_loom))]
#[inline]
pub(crate) fn claimed_thread_record_index() -> Option<usize> {
    CLAIMED.get().map(Record::index_for_counting)
}

#[cfg(bloomguard_loom)]
pub(crate) fn claimed_thread_record_index() -> Option<usize> {
    None
}

/// Whether the calling thread is inside a read section now (its own
/// record's sequence is odd; only this thread writes it).
#[cfg(not(bloomguard_loom))]
fn this_thread_reads() -> bool {
    CLAIMED
        .get()
        .is_some_and(|record| !record.sequence.load(Ordering::Relaxed).is_multiple_of(2))
}

#[cfg(bloomguard_loom)]
fn this_thread_reads() -> bool {
    false
}

/// The process's registry, which every guard's sets are read under.
#[cfg(not(bloomguard_loom))]
pub(crate) fn registry() -> &'static Registry {
    &REGISTRY
}

/// Under loom a model makes its own registries; the guard's checks read
/// the slow way (through `ArcSwap`), as with no thread record.
#[cfg(bloomguard_loom)]
pub(crate) fn registry() -> &'static Registry {
    Box::leak(Box::new(Registry::new()))
}

#[cfg(bloomguard_loom)]
#[inline]
pub(crate) fn with_thread_record<R>(_: impl FnOnce(&Record) -> R) -> Option<R> {
    None
}

/// A value readers reach through a plain pointer load inside a section,
/// replaced under the owner's lock and freed after a grace period.
pub(crate) struct Published<T> {
    registry: &'static Registry,
    current: AtomicPtr<T>,
    /// Owns the current value and every replaced one not yet freed.
    owned: Mutex<Owned<T>>,
}

struct Owned<T> {
    current: Arc<T>,
    /// Replaced since the last barrier.
    retired: Vec<Arc<T>>,
    /// Replaced before a barrier, each batch freed once the sections open
    /// at its barrier have ended: no later moment need find every section
    /// closed at once.
    waiting: Vec<Waiting<T>>,
}

struct Waiting<T> {
    /// Held until `open` is empty, then dropped with the batch.
    _values: Vec<Arc<T>>,
    open: OpenSections<'static>,
}

impl<T> Published<T> {
    pub(crate) fn new(value: Arc<T>, registry: &'static Registry) -> Self {
        Self {
            registry,
            current: AtomicPtr::new(Arc::as_ptr(&value).cast_mut()),
            owned: Mutex::new(Owned {
                current: value,
                retired: Vec::new(),
                waiting: Vec::new(),
            }),
        }
    }

    /// Runs `f` on the value, inside `record`'s section.
    #[inline]
    pub(crate) fn read<R>(&self, record: &Record, f: impl FnOnce(&T) -> R) -> R {
        let _section = record.enter();
        // SAFETY: the pointee is owned by `owned` (as current or retired)
        // until a reclaim has seen this section closed; the section is open
        // until `f` returns. Acquire pairs with `replace`'s release store,
        // so the value's contents are visible.
        let value = unsafe { &*self.current.load(Ordering::Acquire) };
        f(value)
    }

    /// Makes `value` the one new sections read; the value it replaces is
    /// kept until a [`reclaim`](Self::reclaim) sees no section reading it.
    pub(crate) fn replace(&self, value: Arc<T>) {
        let mut owned = unpoisoned(self.owned.lock());
        self.current
            .store(Arc::as_ptr(&value).cast_mut(), Ordering::Release);
        let replaced = std::mem::replace(&mut owned.current, value);
        owned.retired.push(replaced);
    }

    /// Whether `value` is the one new sections read: a pointer compare,
    /// nothing dereferenced. The caller holds `value`, so its address cannot
    /// have been reused for a newer one.
    #[inline]
    pub(crate) fn is_current(&self, value: &T) -> bool {
        std::ptr::eq(self.current.load(Ordering::Acquire), value)
    }

    /// Replaces the value for sections, then hands it to `publish_elsewhere`
    /// (the cell inserts load it from). In that order: whatever loads the
    /// new value there, and whatever happens after that, reads it in a
    /// section too. Reversed, a key written only into the new value (a
    /// generation a rotation opened) could be missed by a check that follows
    /// its insert.
    pub(crate) fn replace_then(&self, value: Arc<T>, publish_elsewhere: impl FnOnce(Arc<T>)) {
        self.replace(Arc::clone(&value));
        publish_elsewhere(value);
    }

    /// Frees the replaced values no section can still read, waiting up to
    /// `wait` (`None`: as long as it takes) for the sections open now.
    pub(crate) fn reclaim(&self, wait: Option<Duration>) {
        // A swap made inside a section of this thread (a key's `as_ref` in
        // `check_many` that grows or rotates a guard) cannot outwait that
        // section: the next swap or maintenance tick frees what it replaced.
        if this_thread_reads() {
            return;
        }
        // Outside a section, this thread acknowledges a turn to fences on
        // its own record, as counting does: one that only swaps (a timer
        // that rotates) would otherwise hold up every reclaim after it.
        let _ = claimed_thread_record_index();
        let mut owned = unpoisoned(self.owned.lock());
        // Every retired value was unpublished before the barrier behind
        // these open sections, so once they have ended, none can be
        // reading it.
        if !owned.retired.is_empty()
            && let Some(open) = self.registry.open_sections()
        {
            let values = std::mem::take(&mut owned.retired);
            owned.waiting.push(Waiting {
                _values: values,
                open,
            });
        }
        let deadline = wait.map(|wait| Instant::now() + wait);
        owned
            .waiting
            .retain_mut(|batch| !forget_ended(&mut batch.open, deadline));
    }

    /// Replaced values not freed yet.
    #[cfg(test)]
    pub(crate) fn retired(&self) -> usize {
        let owned = unpoisoned(self.owned.lock());
        owned.retired.len() + owned.waiting.iter().map(|b| b._values.len()).sum::<usize>()
    }
}

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use std::sync::Barrier;
    use std::sync::atomic::AtomicBool as StdAtomicBool;

    use super::*;

    /// A value that says when it was dropped.
    struct Watched<'a>(&'a StdAtomicBool);

    impl Drop for Watched<'_> {
        fn drop(&mut self) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn read_on_this_thread<T, R>(published: &Published<T>, f: impl FnOnce(&T) -> R) -> R {
        with_thread_record(|record| published.read(record, f)).expect("a thread record")
    }

    /// A swap made inside a section of its own thread (a key's `as_ref`
    /// in `check_many` that inserts into a guard it grows, or rotates it)
    /// cannot outwait that section: its reclaim leaves the replaced value
    /// to a later one, rather than spin for its grace period (or, unbounded,
    /// for ever).
    #[test]
    fn a_reclaim_inside_a_section_of_its_own_thread_leaves_the_value_to_a_later_one() {
        let first_dropped: &'static StdAtomicBool = Box::leak(Box::new(StdAtomicBool::new(false)));
        let published: &'static Published<Watched<'static>> = Box::leak(Box::new(Published::new(
            Arc::new(Watched(first_dropped)),
            registry(),
        )));
        let (returned, reclaim_returned) = std::sync::mpsc::channel();
        // Not scoped: a reclaim that spins for ever must fail the test, not hang it.
        std::thread::spawn(move || {
            read_on_this_thread(published, |_| {
                published.replace(Arc::new(Watched(Box::leak(Box::new(StdAtomicBool::new(
                    false,
                ))))));
                published.reclaim(None);
                returned.send(first_dropped.load(std::sync::atomic::Ordering::SeqCst))
            })
            .unwrap();
        });
        let dropped_inside = reclaim_returned
            .recv_timeout(Duration::from_secs(60))
            .expect("the reclaim waited for its own thread's section");
        assert!(
            !dropped_inside,
            "freed while its own thread's section could read it"
        );
        assert_eq!(published.retired(), 1);
        published.reclaim(None);
        assert!(first_dropped.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn a_replaced_value_lives_while_a_section_reads_it_and_is_freed_after() {
        let (first_dropped, second_dropped) =
            (StdAtomicBool::new(false), StdAtomicBool::new(false));
        let published = Published::new(Arc::new(Watched(&first_dropped)), registry());
        let (inside, replaced) = (Barrier::new(2), Barrier::new(2));
        std::thread::scope(|scope| {
            scope.spawn(|| {
                read_on_this_thread(&published, |value| {
                    inside.wait();
                    replaced.wait();
                    // Still open: the reclaim below could not free it.
                    assert!(!value.0.load(std::sync::atomic::Ordering::SeqCst));
                });
            });
            inside.wait();
            published.replace(Arc::new(Watched(&second_dropped)));
            published.reclaim(Some(Duration::from_millis(20)));
            assert_eq!(published.retired(), 1, "kept for the open section");
            assert!(!first_dropped.load(std::sync::atomic::Ordering::SeqCst));
            replaced.wait();
        });
        published.reclaim(None);
        assert_eq!(published.retired(), 0);
        assert!(first_dropped.load(std::sync::atomic::Ordering::SeqCst));
        assert!(!second_dropped.load(std::sync::atomic::Ordering::SeqCst));
        // The next section reads the new value.
        read_on_this_thread(&published, |value| {
            assert!(std::ptr::eq(value.0, &second_dropped))
        });
    }

    /// Two long sections that overlap (threads preempted mid-check, one
    /// after the other): each reclaim found one of them open and freed
    /// nothing, though the first value could only be read in the first
    /// section. Sections that keep overlapping so kept every replaced value.
    /// A value is now freed once the sections open when it was replaced
    /// have ended, whatever opened since.
    #[test]
    fn a_value_is_freed_once_the_sections_open_at_its_replacement_end() {
        let dropped = [(); 3].map(|()| StdAtomicBool::new(false));
        let published = Published::new(Arc::new(Watched(&dropped[0])), registry());
        let wait = Some(Duration::from_millis(20));
        let (first_open, first_may_end, first_ended) =
            (Barrier::new(2), Barrier::new(2), Barrier::new(2));
        let (second_open, second_may_end) = (Barrier::new(2), Barrier::new(2));
        let (first_freed, second_freed, retired) = std::thread::scope(|scope| {
            scope.spawn(|| {
                read_on_this_thread(&published, |_| {
                    first_open.wait();
                    first_may_end.wait();
                });
                first_ended.wait();
            });
            first_open.wait();
            published.replace(Arc::new(Watched(&dropped[1])));
            published.reclaim(wait);
            scope.spawn(|| {
                read_on_this_thread(&published, |_| {
                    second_open.wait();
                    second_may_end.wait();
                });
            });
            second_open.wait();
            published.replace(Arc::new(Watched(&dropped[2])));
            first_may_end.wait();
            first_ended.wait();
            // The second section still reads the second value.
            published.reclaim(wait);
            let seen = (
                dropped[0].load(std::sync::atomic::Ordering::SeqCst),
                dropped[1].load(std::sync::atomic::Ordering::SeqCst),
                published.retired(),
            );
            second_may_end.wait();
            seen
        });
        assert!(
            first_freed,
            "the first value outlived every section that could read it"
        );
        assert!(!second_freed);
        assert_eq!(retired, 1);
        published.reclaim(None);
        assert!(dropped[1].load(std::sync::atomic::Ordering::SeqCst));
        assert!(!dropped[2].load(std::sync::atomic::Ordering::SeqCst));
    }

    /// A section opened inside another (a key's `as_ref` that checks a
    /// guard, inside `check_many`'s section) must keep the outer one open,
    /// both while it reads and after it ends.
    #[test]
    fn a_nested_section_leaves_the_outer_one_open() {
        let (first_dropped, second_dropped) =
            (StdAtomicBool::new(false), StdAtomicBool::new(false));
        let published = Published::new(Arc::new(Watched(&first_dropped)), registry());
        let other = Published::new(Arc::new(0u64), registry());
        // This thread's own section is the one open: each reclaim below
        // waits it out, gives up, and must keep the replaced value.
        let reclaim_keeps_it = |when: &str| {
            published.reclaim(Some(Duration::from_millis(20)));
            assert_eq!(published.retired(), 1, "kept {when}");
        };
        read_on_this_thread(&published, |value| {
            with_thread_record(|record| {
                other.read(record, |_| {
                    published.replace(Arc::new(Watched(&second_dropped)));
                    reclaim_keeps_it("while the nested section reads");
                })
            })
            .expect("a thread record");
            reclaim_keeps_it("after the nested section ended");
            assert!(!value.0.load(std::sync::atomic::Ordering::SeqCst));
        });
        published.reclaim(None);
        assert!(first_dropped.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn with_no_section_open_a_replaced_value_is_freed_at_once() {
        let (dropped, unwatched) = (StdAtomicBool::new(false), StdAtomicBool::new(false));
        let published = Published::new(Arc::new(Watched(&dropped)), registry());
        published.replace(Arc::new(Watched(&unwatched)));
        published.reclaim(Some(GRACE_WAIT));
        // Other tests' checks may hold a section open for a moment: wait them out.
        published.reclaim(None);
        assert!(dropped.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn a_thread_that_exits_gives_its_record_back() {
        let index = std::thread::spawn(|| with_thread_record(|record| record.index).unwrap())
            .join()
            .unwrap();
        let record = registry()
            .records()
            .find(|record| record.index == index)
            .unwrap();
        assert_eq!(
            record.sequence.load(Ordering::Relaxed) % 2,
            0,
            "no section left open"
        );
        // Released at the thread's exit, unless another thread took it since.
        let claimed_again = record.claimed.load(Ordering::Relaxed);
        let records = registry().records().count();
        assert!(!claimed_again || records > 1);
    }
}

/// The read-section protocol under every interleaving loom explores
/// (`RUSTFLAGS="--cfg bloomguard_loom" cargo test --release --lib`). Both
/// barriers are `SeqCst` fences here, the pairing `membarrier` provides,
/// unless a model starts its process on `membarrier` (see `crate::sync`).
/// A dropped value writes to a cell that outlives it, so that a read racing
/// the drop is reported as such rather than read from freed memory.
#[cfg(all(test, bloomguard_loom))]
mod loom_tests {
    use loom::cell::UnsafeCell;
    use loom::sync::Arc as LoomArc;

    use super::*;

    struct Value(&'static UnsafeCell<u64>);

    impl Value {
        fn new(value: u64) -> Self {
            Self(Box::leak(Box::new(UnsafeCell::new(value))))
        }

        fn get(&self) -> u64 {
            // SAFETY: written only by `drop`, which loom orders against this.
            self.0.with(|value| unsafe { *value })
        }
    }

    impl Drop for Value {
        fn drop(&mut self) {
            self.0.with_mut(|value| unsafe { *value = 0 });
        }
    }

    /// A value of 1 published under a registry of the model's own.
    fn published_value() -> (&'static Registry, LoomArc<Published<Value>>) {
        let registry: &'static Registry = Box::leak(Box::new(Registry::new()));
        let published = Published::new(Arc::new(Value::new(1)), registry);
        (registry, LoomArc::new(published))
    }

    /// Starts the model's process on `membarrier`: records made from here
    /// on open sections with no fence, until a reclaim's barrier fails.
    fn start_on_membarrier() {
        crate::sync::loom_strategy::STRATEGY
            .store(crate::sync::loom_strategy::MEMBARRIER, Ordering::Relaxed);
    }

    /// Replaces the value and reclaims until it is freed.
    fn replace_and_reclaim_until_freed(published: &Published<Value>) {
        published.replace(Arc::new(Value::new(2)));
        while published.retired() > 0 {
            published.reclaim(None);
            loom::thread::yield_now();
        }
    }

    /// What one section reads, on a record claimed for it and then given back.
    fn read_in_one_section(registry: &Registry, published: &Published<Value>) -> u64 {
        let record = registry.claim();
        let seen = published.read(record, Value::get);
        // SAFETY: its sections have ended, and the claim is not used again.
        unsafe { Registry::release(record) };
        seen
    }

    /// Loom explores every interleaving of a model up to this many
    /// preemptions; unbounded, the three-thread and two-section models run
    /// for hours. Three covers a preemption at each side of a section.
    fn bounded() -> loom::model::Builder {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder
    }

    #[test]
    fn no_section_reads_a_value_after_its_reclaim_dropped_it() {
        loom::model(|| {
            let (registry, published) = published_value();
            let reader = {
                let published = LoomArc::clone(&published);
                loom::thread::spawn(move || read_in_one_section(registry, &published))
            };
            published.replace(Arc::new(Value::new(2)));
            published.reclaim(None);
            let seen = reader.join().unwrap();
            assert!(seen == 1 || seen == 2, "read {seen}");
        });
    }

    /// An insert loads the set from a cell of its own (`LiveState::set`, an
    /// `ArcSwap`; here a number standing in for it) and may write its key
    /// into the new set only. A check that follows such an insert must read
    /// the new set in its section: `replace_then` publishes for sections
    /// first.
    #[test]
    fn a_section_after_an_insert_that_loaded_the_new_value_reads_it() {
        bounded().check(|| {
            let (registry, published) = published_value();
            let for_inserts = LoomArc::new(AtomicU64::new(1));
            let inserted = LoomArc::new(AtomicBool::new(false));
            let publisher = {
                let (published, for_inserts) =
                    (LoomArc::clone(&published), LoomArc::clone(&for_inserts));
                loom::thread::spawn(move || {
                    published.replace_then(Arc::new(Value::new(2)), |value| {
                        for_inserts.store(value.get(), Ordering::Release);
                    });
                })
            };
            let inserter = {
                let (for_inserts, inserted) =
                    (LoomArc::clone(&for_inserts), LoomArc::clone(&inserted));
                loom::thread::spawn(move || {
                    if for_inserts.load(Ordering::Acquire) == 2 {
                        inserted.store(true, Ordering::Release);
                    }
                })
            };
            if inserted.load(Ordering::Acquire) {
                let record = registry.claim();
                let seen = published.read(record, Value::get);
                // SAFETY: its section has ended, and the claim is not used again.
                unsafe { Registry::release(record) };
                assert_eq!(seen, 2, "the check after the insert read the old set");
            }
            publisher.join().unwrap();
            inserter.join().unwrap();
        });
    }

    /// The maintenance task's reclaim runs on a thread of its own, racing
    /// both the reader and the swap that retires the value.
    #[test]
    fn a_reclaim_on_another_thread_waits_for_the_section() {
        bounded().check(|| {
            let (registry, published) = published_value();
            let reader = {
                let published = LoomArc::clone(&published);
                loom::thread::spawn(move || read_in_one_section(registry, &published))
            };
            let reclaimer = {
                let published = LoomArc::clone(&published);
                loom::thread::spawn(move || published.reclaim(None))
            };
            published.replace(Arc::new(Value::new(2)));
            reclaimer.join().unwrap();
            let seen = reader.join().unwrap();
            assert!(seen == 1 || seen == 2, "read {seen}");
        });
    }

    /// A reader that gives its record back and claims one again (a thread
    /// exiting, another starting) between two sections, while a swap
    /// reclaims: the second section's record may be the first's.
    #[test]
    fn a_reused_record_keeps_the_protocol() {
        bounded().check(|| {
            let (registry, published) = published_value();
            let reader = {
                let published = LoomArc::clone(&published);
                loom::thread::spawn(move || {
                    let before = read_in_one_section(registry, &published);
                    let after = read_in_one_section(registry, &published);
                    (before, after)
                })
            };
            published.replace(Arc::new(Value::new(2)));
            published.reclaim(None);
            let (before, after) = reader.join().unwrap();
            assert!(before <= after && after >= 1, "read {before} then {after}");
        });
    }

    /// A reclaim past its deadline leaves the value with the sections open
    /// at its barrier; later reclaims, with no barrier of their own (nothing
    /// new retired), free it once those have ended.
    #[test]
    fn a_value_left_by_a_reclaim_is_freed_by_a_later_one_once_its_sections_end() {
        bounded().check(|| {
            let (registry, published) = published_value();
            let reader = {
                let published = LoomArc::clone(&published);
                loom::thread::spawn(move || read_in_one_section(registry, &published))
            };
            published.replace(Arc::new(Value::new(2)));
            while published.retired() > 0 {
                published.reclaim(Some(Duration::ZERO));
                loom::thread::yield_now();
            }
            let seen = reader.join().unwrap();
            assert!(seen == 1 || seen == 2, "read {seen}");
        });
    }

    /// A section nested in another (a key's `as_ref` that checks a second
    /// guard inside `check_many`'s section) opens nothing: the outer one,
    /// open since before the nested read's load, keeps what it reads alive
    /// while the second guard swaps and reclaims.
    #[test]
    fn a_nested_section_is_covered_by_the_outer_one() {
        bounded().check(|| {
            let (registry, outer) = published_value();
            let inner = LoomArc::new(Published::new(Arc::new(Value::new(1)), registry));
            let reader = {
                let (outer, inner) = (LoomArc::clone(&outer), LoomArc::clone(&inner));
                loom::thread::spawn(move || {
                    let record = registry.claim();
                    let seen = outer.read(record, |_| inner.read(record, Value::get));
                    // SAFETY: its sections have ended, and the claim is not used again.
                    unsafe { Registry::release(record) };
                    seen
                })
            };
            inner.replace(Arc::new(Value::new(2)));
            inner.reclaim(None);
            let seen = reader.join().unwrap();
            assert!(seen == 1 || seen == 2, "read {seen}");
        });
    }

    /// A process whose `membarrier` failed after a thread claimed its
    /// record: that thread's sections do not fence until it sees the
    /// reclaimer's word, and the reclaimer's own fence pairs with nothing
    /// in them. The reclaim frees nothing until the thread has fenced a
    /// section or given its record back, and no section reads a freed value.
    #[test]
    fn after_membarrier_fails_a_reclaim_waits_for_unfenced_sections() {
        bounded().check(|| {
            start_on_membarrier();
            let (registry, published) = published_value();
            let record = registry.claim();
            assert!(record.light_barrier_is_enough.load(Ordering::Relaxed));
            let reader = {
                let published = LoomArc::clone(&published);
                loom::thread::spawn(move || {
                    let first = published.read(record, Value::get);
                    let second = published.read(record, Value::get);
                    // SAFETY: its sections have ended, and the claim is not used again.
                    unsafe { Registry::release(record) };
                    (first, second)
                })
            };
            replace_and_reclaim_until_freed(&published);
            let (first, second) = reader.join().unwrap();
            assert!(first >= 1 && second >= first, "read {first} then {second}");
        });
    }

    /// A reader claims its record while the reclaim turns the process to
    /// fences: one made under `membarrier` and given back (the reclaim
    /// skips a record no thread holds), or a new one (the reclaim may not
    /// reach it in the list). Either way the holder must fence: the fence
    /// after its claim pairs with the reclaimer's after the turn.
    fn a_record_claimed_during_the_turn_fences(with_one_to_reuse: bool) {
        bounded().check(move || {
            start_on_membarrier();
            let (registry, published) = published_value();
            if with_one_to_reuse {
                // SAFETY: claimed only to be given back; no section opened.
                unsafe { Registry::release(registry.claim()) };
            }
            let reader = {
                let published = LoomArc::clone(&published);
                loom::thread::spawn(move || read_in_one_section(registry, &published))
            };
            replace_and_reclaim_until_freed(&published);
            let seen = reader.join().unwrap();
            assert!(seen >= 1, "read {seen}");
        });
    }

    #[test]
    fn a_record_claimed_again_during_the_turn_fences() {
        a_record_claimed_during_the_turn_fences(true);
    }

    #[test]
    fn a_record_made_during_the_turn_fences() {
        a_record_claimed_during_the_turn_fences(false);
    }

    /// A check that starts after a swap returned reads the new value.
    #[test]
    fn a_section_after_a_replace_reads_the_new_value() {
        loom::model(|| {
            let (registry, published) = published_value();
            let replaced = LoomArc::new(crate::sync::AtomicBool::new(false));
            let reader = {
                let (published, replaced) = (LoomArc::clone(&published), LoomArc::clone(&replaced));
                loom::thread::spawn(move || {
                    let after = replaced.load(Ordering::Acquire);
                    let seen = read_in_one_section(registry, &published);
                    assert!(
                        !after || seen == 2,
                        "a section after the replace read {seen}"
                    );
                })
            };
            published.replace(Arc::new(Value::new(2)));
            replaced.store(true, Ordering::Release);
            published.reclaim(None);
            reader.join().unwrap();
        });
    }
}
