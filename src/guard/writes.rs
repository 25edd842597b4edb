//! Inserts whose store writes may still be on their way, so that a rebuild
//! does not read the source before they land.
//!
//! The race this closes: an insert loads the live filters just before a
//! rebuild installs its new filter, so it goes into the old filter only, and
//! its write reaches the store after the rebuild's scan passed that key. The
//! key would then be in neither the scan nor the new filter: a false negative
//! after the swap. So every insert is counted in the guard's count from
//! before it loads the live filters: a plain `insert` until it returns (its
//! store write is then covered by the write settle), a [`PendingWrite`]
//! until it is dropped. One that finds a new filter installed moves its
//! count at once to that filter's own tracker, since its key is in the
//! filter being built. After installing, a rebuild waits until the guard's
//! count, and the trackers of earlier builds, are drained (see
//! `WriteTracker::is_quiet`). (Counting every insert in the guard's count
//! for its whole run left a rebuild no moment at zero under threads
//! inserting in tight loops; so did waiting for the whole count at zero
//! once a new filter was installed, under 64 such threads.)
//!
//! When a build ends, its tracker joins the ones the next rebuild waits
//! for: a key counted there is in that build's filter (or, if the build was
//! abandoned, in the old one), but not in the filter the next rebuild
//! installs, and its write may still land after that rebuild's scan.

use std::sync::Arc;

use super::Guard;

use crate::stats::StripedCounters;
use crate::sync::{AtomicU64, Ordering, fence};

/// Per-thread stripes of "inserts in progress", on two sides: new inserts
/// count on the side `side` names, and a wait drains one side while the
/// other takes them (see [`is_quiet`](Self::is_quiet)). Each insert is
/// undone in the stripe and side it was made in, so every count is ≥ 0.
pub(crate) struct WriteTracker {
    in_flight: StripedCounters<2>,
    /// The side new inserts count on (0 or 1).
    side: AtomicU64,
}

/// Where an insert was counted in, to count it out of the same place.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CountedIn {
    stripe: usize,
    side: usize,
}

impl WriteTracker {
    pub(crate) fn new() -> Self {
        Self {
            in_flight: StripedCounters::new(),
            side: AtomicU64::new(0),
        }
    }

    /// Counts an insert in; returns where to count it out. Call it before
    /// loading the live filters.
    #[inline]
    pub(crate) fn enter(&self) -> CountedIn {
        let counted = CountedIn {
            stripe: self.in_flight.current_stripe(),
            // Any side will do for the handshake: a wait reads both.
            side: self.side.load(Ordering::Relaxed) as usize,
        };
        self.in_flight
            .add_in_stripe(counted.stripe, counted.side, 1, Ordering::Relaxed);
        // Pairs with the fence in `is_quiet`: either this insert's load of the
        // live filters sees the new filter installed, or the rebuild's read of
        // the count sees this insert.
        fence(Ordering::SeqCst);
        counted
    }

    #[inline]
    pub(crate) fn exit(&self, counted: CountedIn) {
        self.in_flight
            .add_in_stripe(counted.stripe, counted.side, u64::MAX, Ordering::Release);
    }

    /// Moves a write counted in here to the tracker of the filter being
    /// built, `to`; returns where to count it out there. In before out, so
    /// that no moment finds it counted nowhere.
    #[inline]
    pub(crate) fn move_to(&self, counted: CountedIn, to: &WriteTracker) -> CountedIn {
        let moved = to.enter();
        self.exit(counted);
        moved
    }

    /// Whether no insert counted in before the caller's last store of the
    /// live filters is still in progress; `wait` carries what earlier calls
    /// of the same wait found (start each wait with a new one).
    ///
    /// Safety rests on the fence pairing alone: every stripe of both sides
    /// is read at zero once after the store, and an insert that missed the
    /// new filter is seen by each such read (had a read missed its count-in,
    /// its load would have found the new filter), so a read at zero of its
    /// stripe comes after it counted out, whichever side it counted on.
    ///
    /// The two sides are there so that the wait ends. Every insert passes
    /// through the guard's count before it finds a new filter, so with many
    /// threads inserting in tight loops the count is almost never at zero
    /// (64 threads on two cores: not once in 10 s). So the wait sends new
    /// inserts to the other side, waits for each stripe of the old one to be
    /// read at zero, and does the same for the other side. A side being
    /// drained gets no new inserts but one from each thread that read the
    /// side before its next fence.
    pub(crate) fn is_quiet(&self, wait: &mut QuietWait) -> bool {
        while wait.sides_drained < 2 {
            let side = *wait
                .draining
                .get_or_insert_with(|| self.side.fetch_xor(1, Ordering::Relaxed) as usize);
            fence(Ordering::SeqCst);
            if !self.in_flight.mark_stripes_at_zero(
                side,
                &mut wait.stripes_at_zero,
                Ordering::Acquire,
            ) {
                return false;
            }
            *wait = QuietWait {
                sides_drained: wait.sides_drained + 1,
                ..QuietWait::default()
            };
        }
        true
    }
}

/// How far one wait for a [`WriteTracker`] has come
/// ([`WriteTracker::is_quiet`]).
#[derive(Debug, Default)]
pub(crate) struct QuietWait {
    sides_drained: u8,
    /// The side being drained, once new inserts were sent to the other.
    draining: Option<usize>,
    /// The stripes of that side found at zero (a bit per stripe).
    stripes_at_zero: u64,
}

impl std::fmt::Debug for WriteTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteTracker")
            .field(
                "in_flight",
                &self.in_flight.sum(0).wrapping_add(self.in_flight.sum(1)),
            )
            .finish()
    }
}

/// A key inserted into the guard whose write to the store is still in
/// progress; drop it once the write is visible. While it lives, a rebuild
/// that could miss the write waits before it reads the source (up to its
/// timeout, then it fails with
/// [`RebuildError::WritesStillOpen`](crate::RebuildError::WritesStillOpen)),
/// so the key is in the rebuilt filter whether the scan sees the write or not.
/// On a rotating guard, every rotation while it lives writes its key into
/// the generation it opens (the write may land any time before the drop),
/// and the drop writes the key into the newest generation again: the key's
/// window counts from the write landing, however many rotations passed
/// while it was open.
///
/// Made by [`Guard::begin_write`](crate::Guard::begin_write); most code uses
/// [`Guard::insert_then_write`](crate::Guard::insert_then_write) instead. It
/// holds a clone of the guard, so it can travel with a response future.
#[must_use = "the write counts as in progress until this is dropped"]
pub struct PendingWrite {
    pub(crate) guard: Guard,
    pub(crate) held: HeldIn,
    /// The key's hash, to close its pending write in the guard's insert
    /// clock (for a loader's confirmed-absent cache) once the write has landed.
    pub(crate) hash: u64,
    /// Whether the insert clock counted this write as pending (it had
    /// started), or the guard as one the clock cannot place.
    pub(crate) timed: bool,
}

/// Which count a [`PendingWrite`] holds.
pub(crate) enum HeldIn {
    /// No filter is being built: the next rebuild must wait for this write.
    Guard(CountedIn),
    /// The key is in the filter being built too, so that build need not
    /// wait; the next one does, through this count of that filter's.
    Shadow(Arc<WriteTracker>, CountedIn),
}

impl Drop for PendingWrite {
    fn drop(&mut self) {
        self.guard.renew_when_written(self.hash);
        self.guard.close_pending_write(self.hash, self.timed);
        match &self.held {
            HeldIn::Guard(counted) => self.guard.inner.live.writes().exit(*counted),
            HeldIn::Shadow(writes, counted) => writes.exit(*counted),
        }
    }
}

impl std::fmt::Debug for PendingWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held_in = match self.held {
            HeldIn::Guard(..) => "guard",
            HeldIn::Shadow(..) => "filter being built",
        };
        f.debug_struct("PendingWrite")
            .field("guard", &self.guard.name())
            .field("held_in", &held_in)
            .finish()
    }
}

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;

    /// An insert counted on the side the wait drains second (a thread that
    /// read the side after a switch) keeps the wait open: a wait that
    /// drained one side only would miss it.
    #[test]
    fn a_wait_reads_both_sides() {
        let tracker = WriteTracker::new();
        tracker.side.store(1, Ordering::Relaxed);
        let counted = tracker.enter();
        tracker.side.store(0, Ordering::Relaxed);
        let mut wait = QuietWait::default();
        assert!(!tracker.is_quiet(&mut wait), "an insert still counted");
        assert!(!tracker.is_quiet(&mut wait), "still counted");
        tracker.exit(counted);
        assert!(tracker.is_quiet(&mut wait), "the insert is done");
    }

    /// A stripe found at zero stays done for the rest of the wait, while
    /// one still counting holds it.
    #[test]
    fn a_wait_keeps_what_it_found_and_waits_for_the_rest() {
        let tracker = WriteTracker::new();
        let counted = tracker.enter();
        let mut wait = QuietWait::default();
        assert!(!tracker.is_quiet(&mut wait));
        // New inserts go to the other side now, and finish.
        let later = tracker.enter();
        tracker.exit(later);
        assert!(!tracker.is_quiet(&mut wait), "the first insert is not done");
        // A thread that read the side before the switch counts in on the
        // side being drained, in a stripe already found at zero: the wait
        // does not need it (it loads the live filters after the switch).
        let other = CountedIn {
            stripe: usize::from(counted.stripe == 0),
            side: counted.side,
        };
        tracker
            .in_flight
            .add_in_stripe(other.stripe, other.side, 1, Ordering::Relaxed);
        tracker.exit(counted);
        assert!(
            tracker.is_quiet(&mut wait),
            "held by a stripe found at zero before"
        );
        tracker.exit(other);
    }
}

/// The handshake between an insert and a rebuild, under every interleaving
/// loom explores (`RUSTFLAGS="--cfg bloomguard_loom" cargo test --release --lib`). The
/// flag stands for the `ArcSwap` store that installs the filter being built,
/// with orderings weaker than `arc-swap`'s own.
#[cfg(all(test, bloomguard_loom))]
mod loom_tests {
    use loom::sync::Arc;
    use loom::sync::atomic::{AtomicBool, AtomicUsize};

    use super::*;

    #[test]
    fn a_rebuild_never_misses_an_insert_that_missed_its_filter() {
        loom::model(|| {
            let tracker = Arc::new(WriteTracker::new());
            let installed = Arc::new(AtomicBool::new(false));
            let writer = {
                let (tracker, installed) = (Arc::clone(&tracker), Arc::clone(&installed));
                loom::thread::spawn(move || {
                    let counted = tracker.enter();
                    let saw_the_new_filter = installed.load(Ordering::Relaxed);
                    if saw_the_new_filter {
                        tracker.exit(counted);
                    }
                    // Otherwise the write is still pending: the count stays.
                    saw_the_new_filter
                })
            };
            installed.store(true, Ordering::Relaxed);
            // Two polls of one wait, which switches sides between them.
            let mut wait = QuietWait::default();
            let quiet = tracker.is_quiet(&mut wait) || tracker.is_quiet(&mut wait);
            let saw_the_new_filter = writer.join().unwrap();
            assert!(
                saw_the_new_filter || !quiet,
                "the rebuild saw no pending write, yet the insert went to the old filter only"
            );
        });
    }

    /// A write that counted on one rebuild's filter is not in the next
    /// rebuild's: that one waits on the guard's count and then on the
    /// earlier filter's (the order the move between them needs).
    #[test]
    fn the_next_rebuild_waits_for_writes_counted_on_the_last_one() {
        loom::model(|| {
            let guard_writes = Arc::new(WriteTracker::new());
            let first_filter_writes = Arc::new(WriteTracker::new());
            // 0: no filter being built, 1: the first, 2: the second.
            let installed = Arc::new(AtomicUsize::new(0));
            let writer = {
                let (guard_writes, first_filter_writes, installed) = (
                    Arc::clone(&guard_writes),
                    Arc::clone(&first_filter_writes),
                    Arc::clone(&installed),
                );
                loom::thread::spawn(move || {
                    let counted = guard_writes.enter();
                    let saw = installed.load(Ordering::Relaxed);
                    match saw {
                        1 => {
                            guard_writes.move_to(counted, &first_filter_writes);
                        }
                        2 => guard_writes.exit(counted),
                        _ => {}
                    }
                    // The store write is still pending: nothing else exits.
                    saw
                })
            };
            installed.store(1, Ordering::Relaxed);
            installed.store(2, Ordering::Relaxed);
            let quiet = guard_writes.is_quiet(&mut QuietWait::default())
                && first_filter_writes.is_quiet(&mut QuietWait::default());
            let saw = writer.join().unwrap();
            assert!(
                saw == 2 || !quiet,
                "the second rebuild saw no pending write, yet the key is not in its filter"
            );
        });
    }
}
