//! Counters that many threads bump at once without fighting over one cache line.

use std::sync::OnceLock;

use crossbeam_utils::CachePadded;

use crate::sync::{AtomicU64, Ordering};

/// The counters of one stripe, alone on their cache lines: `CachePadded`
/// knows each target's line (128 bytes on x86-64, which prefetches lines in
/// pairs, and on aarch64).
#[cfg(feature = "guard")]
type Stripe<const N: usize> = CachePadded<[AtomicU64; N]>;

/// `N` counters split into per-thread stripes, summed on read; added to
/// atomically, with the ordering the caller asks (the guard's count of
/// writes in flight, which a rebuild waits on).
///
/// A thread adds only to its own stripe, so concurrent writers do not
/// serialise on one cache line, and the `N` counters of a stripe share its
/// lines, so bumping several of them costs one line. `sum` is exact once
/// writers are quiet and a consistent-enough snapshot while they are not.
/// Kept by hand: the `metrics` facade records through a global recorder
/// (often one atomic per series), which would put a shared line back on
/// every check.
#[cfg(feature = "guard")]
pub(crate) struct StripedCounters<const N: usize> {
    stripes: Box<[Stripe<N>]>,
}

#[cfg(feature = "guard")]
impl<const N: usize> StripedCounters<N> {
    pub(crate) fn new() -> Self {
        let stripes = (0..stripe_count())
            .map(|_| CachePadded::new(std::array::from_fn(|_| AtomicU64::new(0))))
            .collect();
        Self { stripes }
    }

    /// The stripe the calling thread writes to.
    #[inline]
    pub(crate) fn current_stripe(&self) -> usize {
        thread_stripe() & (self.stripes.len() - 1)
    }

    /// Adds `n` to counter `counter` in a given stripe, for callers that must
    /// undo an addition in the stripe they made it in.
    #[inline]
    pub(crate) fn add_in_stripe(&self, stripe: usize, counter: usize, n: u64, order: Ordering) {
        self.stripes[stripe][counter].fetch_add(n, order);
    }

    pub(crate) fn sum(&self, counter: usize) -> u64 {
        self.stripes
            .iter()
            .map(|s| s[counter].load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }

    /// Reads counter `counter` in each stripe not yet in `seen` (a bit per
    /// stripe; there are at most 64) and adds those found at zero; returns
    /// whether every stripe is in `seen` now.
    pub(crate) fn mark_stripes_at_zero(
        &self,
        counter: usize,
        seen: &mut u64,
        order: Ordering,
    ) -> bool {
        for (index, stripe) in self.stripes.iter().enumerate() {
            if *seen & (1 << index) == 0 && stripe[counter].load(order) == 0 {
                *seen |= 1 << index;
            }
        }
        seen.count_ones() as usize == self.stripes.len()
    }
}

#[cfg(feature = "guard")]
impl<const N: usize> std::fmt::Debug for StripedCounters<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries((0..N).map(|counter| self.sum(counter)))
            .finish()
    }
}

/// `N` counters with a stripe of their own for each thread that counts,
/// added to with a plain load and store (no locked instruction: a check
/// counts its verdict this way), summed on read.
///
/// A thread's stripe is its read-section record's index (`guard::sections`),
/// which one live thread owns at a time, so no two threads write one stripe.
/// Threads whose index is past the owned stripes (more threads counting at
/// once than four per core), or whose locals are being torn down, share a
/// last stripe, added to atomically.
#[cfg(feature = "guard")]
pub(crate) struct ThreadCounters<const N: usize> {
    /// One per record index below their number.
    owned: Box<[Stripe<N>]>,
    shared: Stripe<N>,
}

#[cfg(feature = "guard")]
impl<const N: usize> ThreadCounters<N> {
    pub(crate) fn new() -> Self {
        static OWNED: OnceLock<usize> = OnceLock::new();
        // `available_parallelism` reads cgroup files: once per process.
        let owned = *OWNED.get_or_init(|| {
            std::thread::available_parallelism()
                .map_or(8, |n| n.get())
                .saturating_mul(4)
                .next_power_of_two()
                .clamp(16, 256)
        });
        let stripe = || CachePadded::new(std::array::from_fn(|_| AtomicU64::new(0)));
        Self {
            owned: (0..owned).map(|_| stripe()).collect(),
            shared: stripe(),
        }
    }

    /// Adds `n` to `counter` for the calling thread.
    #[inline]
    pub(crate) fn add(&self, counter: usize, n: u64) {
        match crate::guard::sections::thread_record_index() {
            Some(index) => self.add_for(index, counter, n),
            None => self.add_shared(counter, n),
        }
    }

    /// Adds `n` to `counter` for the thread owning the record numbered `index`
    /// (the calling thread's own).
    #[inline(always)]
    pub(crate) fn add_for(&self, index: usize, counter: usize, n: u64) {
        match self.owned.get(index) {
            Some(stripe) => add_as_its_only_writer(&stripe[counter], n),
            None => self.add_shared(counter, n),
        }
    }

    fn add_shared(&self, counter: usize, n: u64) {
        self.shared[counter].fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn sum(&self, counter: usize) -> u64 {
        self.owned
            .iter()
            .chain([&self.shared])
            .map(|s| s[counter].load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }
}

#[cfg(feature = "guard")]
impl<const N: usize> std::fmt::Debug for ThreadCounters<N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries((0..N).map(|counter| self.sum(counter)))
            .finish()
    }
}

/// Adds `n` (wrapping) to a word only the calling thread writes, without a
/// locked instruction: a reader summing meanwhile sees the old value or the
/// new one.
#[cfg(feature = "guard")]
#[inline(always)]
fn add_as_its_only_writer(count: &AtomicU64, n: u64) {
    count.store(
        count.load(Ordering::Relaxed).wrapping_add(n),
        Ordering::Relaxed,
    );
}

/// One counter many threads add to, each on a word of its own where it can
/// be had: a filter's set-bit count.
///
/// A thread that holds a read-section record (it checked or inserted
/// through a guard; `guard::sections`) adds to word 0 of the stripe its
/// record's index names, with a plain load and store: one live thread owns a
/// record at a time. Any other thread (record index past the stripes, no
/// record, no `guard` feature) adds to word 1 of a stripe chosen by its
/// thread number, atomically. Claiming a record just to count would
/// allocate, and may pick the process's barrier with a system call, on a
/// thread that only uses filters. Both words share the stripe's line, so
/// the memory is what a striped counter alone takes.
pub(crate) struct PerThreadCounter {
    stripes: Box<[CachePadded<[AtomicU64; 2]>]>,
}

impl PerThreadCounter {
    pub(crate) fn new() -> Self {
        let stripes = (0..stripe_count())
            .map(|_| CachePadded::new([AtomicU64::new(0), AtomicU64::new(0)]))
            .collect();
        Self { stripes }
    }

    /// Adds `n` (wrapping).
    #[inline]
    pub(crate) fn add(&self, n: u64) {
        #[cfg(feature = "guard")]
        if let Some(stripe) = crate::guard::sections::claimed_thread_record_index()
            .and_then(|index| self.stripes.get(index))
        {
            add_as_its_only_writer(&stripe[0], n);
            return;
        }
        self.stripes[thread_stripe() & (self.stripes.len() - 1)][1].fetch_add(n, Ordering::Relaxed);
    }

    /// Exact once writers are quiet.
    pub(crate) fn sum(&self) -> u64 {
        self.stripes
            .iter()
            .flat_map(|stripe| stripe.iter())
            .map(|word| word.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }

    /// Replaces the total with `value` (callers make sure no writer is active).
    pub(crate) fn set(&self, value: u64) {
        for (i, word) in self
            .stripes
            .iter()
            .flat_map(|stripe| stripe.iter())
            .enumerate()
        {
            word.store(if i == 0 { value } else { 0 }, Ordering::Relaxed);
        }
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.stripes)
    }
}

impl std::fmt::Debug for PerThreadCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("PerThreadCounter")
            .field(&self.sum())
            .finish()
    }
}

/// A power of two at least the number of cores, so that threads rarely share a stripe.
fn stripe_count() -> usize {
    static COUNT: OnceLock<usize> = OnceLock::new();
    *COUNT.get_or_init(|| {
        std::thread::available_parallelism()
            .map_or(8, |n| n.get())
            .next_power_of_two()
            .clamp(4, 64)
    })
}

/// A number fixed per thread: threads take consecutive numbers as they first
/// count, so that up to `stripe_count()` threads never share a stripe (a hash
/// of anything per-thread collides for two threads one time in four with
/// four stripes, which showed as halved 2-thread throughput).
#[inline]
fn thread_stripe() -> usize {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicUsize, Ordering as StdOrdering};

    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    STRIPE.with(|stripe| {
        let mut number = stripe.get();
        if number == usize::MAX {
            number = NEXT.fetch_add(1, StdOrdering::Relaxed) & (usize::MAX >> 1);
            stripe.set(number);
        }
        number
    })
}

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;

    /// Threads with a record (on 2 cores, more of them than stripes, so
    /// that some indices fall past them) and threads without one, all
    /// alive at once and counting at once.
    #[test]
    fn per_thread_counter_sums_across_threads() {
        const THREADS: usize = 40;
        // Enough that threads sharing a word would lose additions.
        const ADDS: usize = 200_000;
        let counter = PerThreadCounter::new();
        let all_alive = std::sync::Barrier::new(THREADS);
        std::thread::scope(|s| {
            for t in 0..THREADS {
                let (counter, all_alive) = (&counter, &all_alive);
                s.spawn(move || {
                    #[cfg(feature = "guard")]
                    if t % 2 == 0 {
                        crate::guard::sections::thread_record_index();
                    }
                    let _ = t;
                    all_alive.wait();
                    for i in 0..ADDS {
                        counter.add(3);
                        if i % 1024 == 0 {
                            // Interleave, so that threads on one stripe overlap.
                            std::thread::yield_now();
                        }
                    }
                });
            }
        });
        assert_eq!(counter.sum(), (THREADS * ADDS) as u64 * 3);
        counter.set(5);
        assert_eq!(counter.sum(), 5);
    }
}
