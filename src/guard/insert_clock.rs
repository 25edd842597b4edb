//! When each key was last inserted, approximately: the guard's side of the
//! loader's confirmed-absent cache (see `crate::loader::ConfirmedAbsent`).
//!
//! A cached "absent" must not outlive an insert of its key, nor be made from
//! a backend answer that raced with one. Rather than mark every inserted key
//! (memory that grows with the inserts, and marks a bounded cache could
//! evict), each insert stamps the time into one of a fixed set of stripes
//! chosen by the key's hash; the cache trusts an answer only while the
//! key's stripe has had no insert since "asked minus the write settle". A
//! collision with another key's insert costs one more backend call, never a
//! wrong answer.
//!
//! A write held open by a `PendingWrite` may land in the store any time
//! before the drop, long after its insert's stamp: while one is open, its
//! stripe counts as "inserted now".
//!
//! Some changes bring keys in without an insert of each: a fleet snapshot
//! replacing the set (its keys' stream entries are skipped), a merged
//! filter, a rebuild's commit. Each stamps every stripe at once.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use tokio::time::Instant;

/// 4096 stripes (48 KiB: a stamp and a pending count each): with 10,000
/// inserts a second, a stripe sees one
/// every 0.4 s, so a hot false positive is re-asked about that often.
const STRIPES: usize = 1 << 12;

pub(crate) struct InsertClock {
    base: Instant,
    /// Nanoseconds after `base` of the latest insert into each stripe.
    last_insert: Box<[AtomicU64]>,
    /// Nanoseconds after `base` of the latest change that stamped every
    /// stripe at once ([`stamp_every_key`](Self::stamp_every_key));
    /// [`NOT_STARTED`] until [`start`](Self::start).
    every_key: AtomicU64,
    /// `PendingWrite`s open in each stripe.
    pending: Box<[AtomicU32]>,
}

/// Every key counts as inserted at any time: an insert that ran while the
/// clock was being made, before inserts could find it, stamped nothing.
const NOT_STARTED: u64 = u64::MAX;

impl InsertClock {
    /// A clock that answers "maybe" for every key until [`start`](Self::start).
    pub(crate) fn new() -> Self {
        Self {
            base: Instant::now(),
            last_insert: (0..STRIPES).map(|_| AtomicU64::new(0)).collect(),
            every_key: AtomicU64::new(NOT_STARTED),
            pending: (0..STRIPES).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// Starts answering, once inserts find the clock: every key counts as
    /// inserted now, for the inserts that ran before they could.
    pub(crate) fn start(&self) {
        let now = self.ticks(Instant::now());
        // Only the first start: a later one would move a stamp back.
        let _ =
            self.every_key
                .compare_exchange(NOT_STARTED, now, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// Stamps an insert of the key hashing to `hash`, now.
    #[inline]
    pub(crate) fn stamp(&self, hash: u64) {
        let now = self.ticks(Instant::now());
        // SeqCst: an insert that returned before a cache read began is seen by it.
        self.stripe(hash).fetch_max(now, Ordering::SeqCst);
    }

    /// Stamps an insert of every key, now: for a change that brings keys in
    /// without inserting each. Call it before the change is visible.
    pub(crate) fn stamp_every_key(&self) {
        let now = self.ticks(Instant::now());
        self.every_key.fetch_max(now, Ordering::SeqCst);
    }

    /// Opens a pending write of the key hashing to `hash` (stamped too).
    pub(crate) fn open_pending(&self, hash: u64) {
        self.pending[stripe_of(hash)].fetch_add(1, Ordering::SeqCst);
        self.stamp(hash);
    }

    /// Closes a pending write opened by [`open_pending`](Self::open_pending):
    /// its write has landed, now.
    pub(crate) fn close_pending(&self, hash: u64) {
        self.stamp(hash);
        self.pending[stripe_of(hash)].fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether a key hashing to `hash` may have been inserted at or after
    /// `since`, or has a write pending now.
    /// Inserts from before the clock started were not stamped: it answers
    /// "maybe" for any `since` up to its start.
    pub(crate) fn inserted_since(&self, hash: u64, since: Instant) -> bool {
        let since_ticks = self.ticks(since);
        since <= self.base
            || self.pending[stripe_of(hash)].load(Ordering::SeqCst) > 0
            || self.every_key.load(Ordering::SeqCst) >= since_ticks
            || self.stripe(hash).load(Ordering::SeqCst) >= since_ticks
    }

    fn stripe(&self, hash: u64) -> &AtomicU64 {
        &self.last_insert[stripe_of(hash)]
    }

    /// `at` as a stamp: nanoseconds after `base` (0 for earlier: answers
    /// about those are "maybe" anyway, see `inserted_since`).
    fn ticks(&self, at: Instant) -> u64 {
        let nanos = at.saturating_duration_since(self.base).as_nanos();
        u64::try_from(nanos).unwrap_or(u64::MAX)
    }
}

/// The top bits: the filter's block index uses the high bits too, but only
/// as a product with the block count, so these stay well spread.
fn stripe_of(hash: u64) -> usize {
    (hash >> (64 - STRIPES.trailing_zeros())) as usize
}

impl std::fmt::Debug for InsertClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InsertClock")
            .field("stripes", &self.last_insert.len())
            .finish()
    }
}
