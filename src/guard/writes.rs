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
//! count, and the trackers of earlier builds, are zero. (Counting every
//! insert in the guard's count for its whole run left a rebuild no moment
//! at zero under threads inserting in tight loops.)
//!
//! When a build ends, its tracker joins the ones the next rebuild waits
//! for: a key counted there is in that build's filter (or, if the build was
//! abandoned, in the old one), but not in the filter the next rebuild
//! installs, and its write may still land after that rebuild's scan.

use std::sync::Arc;

use super::Guard;

use crate::stats::StripedCounter;
use crate::sync::{Ordering, fence};

/// Per-thread stripes of "inserts in progress"; each is undone in the stripe
/// it was made in, so that every stripe is a count ≥ 0 and a zero sum read
/// after installing means that no insert that missed the install is left.
pub(crate) struct WriteTracker {
    in_flight: StripedCounter,
}

impl WriteTracker {
    pub(crate) fn new() -> Self {
        Self {
            in_flight: StripedCounter::new(),
        }
    }

    /// Counts an insert in; returns the stripe to count it out of. Call it
    /// before loading the live filters.
    #[inline]
    pub(crate) fn enter(&self) -> usize {
        let stripe = self.in_flight.current_stripe();
        self.in_flight
            .add_in_stripe(stripe, 0, 1, Ordering::Relaxed);
        // Pairs with the fence in `is_quiet`: either this insert's load of the
        // live filters sees the new filter installed, or the rebuild's read of
        // the count sees this insert.
        fence(Ordering::SeqCst);
        stripe
    }

    #[inline]
    pub(crate) fn exit(&self, stripe: usize) {
        self.in_flight
            .add_in_stripe(stripe, 0, u64::MAX, Ordering::Release);
    }

    /// Moves a write counted in at `stripe` to the tracker of the filter
    /// being built, `to`; returns the stripe to count it out of there. In
    /// before out, so that no moment finds it counted nowhere.
    #[inline]
    pub(crate) fn move_to(&self, stripe: usize, to: &WriteTracker) -> usize {
        let moved = to.enter();
        self.exit(stripe);
        moved
    }

    /// Whether no insert counted in before the caller's last store of the live
    /// filters is still in progress.
    pub(crate) fn is_quiet(&self) -> bool {
        fence(Ordering::SeqCst);
        self.in_flight.sum_with(0, Ordering::Acquire) == 0
    }
}

impl std::fmt::Debug for WriteTracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteTracker")
            .field("in_flight", &self.in_flight.sum(0))
            .finish()
    }
}

/// A key inserted into the guard whose write to the store is still in
/// progress; drop it once the write is visible. While it lives, a rebuild
/// that could miss the write waits before it reads the source (up to its
/// timeout, then it fails with
/// [`RebuildError::WritesStillOpen`](crate::RebuildError::WritesStillOpen)),
/// so the key is in the rebuilt filter whether the scan sees the write or not.
/// On a rotating guard the drop writes the key into the newest generation
/// again: the key's window counts from the write landing, however many
/// rotations passed while it was open.
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
    Guard(usize),
    /// The key is in the filter being built too, so that build need not
    /// wait; the next one does, through this count of that filter's.
    Shadow(Arc<WriteTracker>, usize),
}

impl Drop for PendingWrite {
    fn drop(&mut self) {
        self.guard.renew_when_written(self.hash);
        self.guard.close_pending_write(self.hash, self.timed);
        match &self.held {
            HeldIn::Guard(stripe) => self.guard.inner.live.writes().exit(*stripe),
            HeldIn::Shadow(writes, stripe) => writes.exit(*stripe),
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
                    let stripe = tracker.enter();
                    let saw_the_new_filter = installed.load(Ordering::Relaxed);
                    if saw_the_new_filter {
                        tracker.exit(stripe);
                    }
                    // Otherwise the write is still pending: the count stays.
                    saw_the_new_filter
                })
            };
            installed.store(true, Ordering::Relaxed);
            let quiet = tracker.is_quiet();
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
                    let stripe = guard_writes.enter();
                    let saw = installed.load(Ordering::Relaxed);
                    match saw {
                        1 => {
                            guard_writes.move_to(stripe, &first_filter_writes);
                        }
                        2 => guard_writes.exit(stripe),
                        _ => {}
                    }
                    // The store write is still pending: nothing else exits.
                    saw
                })
            };
            installed.store(1, Ordering::Relaxed);
            installed.store(2, Ordering::Relaxed);
            let quiet = guard_writes.is_quiet() && first_filter_writes.is_quiet();
            let saw = writer.join().unwrap();
            assert!(
                saw == 2 || !quiet,
                "the second rebuild saw no pending write, yet the key is not in its filter"
            );
        });
    }
}
