//! Keys the backend confirmed absent after the filter said "maybe": the
//! false positives worth remembering, answered absent next time.
//!
//! A cached answer must never hide a key being written. The guard stamps
//! each insert's time (see `crate::guard::insert_clock`), and an entry is
//! trusted only while its key has had no insert since the backend was asked
//! minus the write settle: a write lands within that settle of its insert
//! (the contract rebuilds rely on), so a backend read that began later saw
//! it. Changes that bring keys in without inserting each (a fleet
//! snapshot, a merged filter, a rebuild) count as an insert of every key.
//! The check is made on every read, so an insert needs no hook into this
//! cache and nothing this cache evicts can matter for correctness.
//!
//! Storage is moka's: bounded, with per-entry expiry and an admission
//! policy that keeps the frequently asked keys when it is full.

use std::time::Duration;

use moka::sync::Cache;
use tokio::time::Instant;

use crate::error::ConfigError;
use crate::guard::{Guard, check_duration};

pub(crate) struct ConfirmedAbsent {
    /// When the backend was asked, by key.
    asked_at: Cache<Box<[u8]>, Instant>,
    ttl: Duration,
}

impl ConfirmedAbsent {
    pub(crate) fn new(guard: &Guard, capacity: u64, ttl: Duration) -> Result<Self, ConfigError> {
        if capacity == 0 {
            return Err(ConfigError::out_of_range(
                "confirmed-absent capacity",
                capacity,
                "at least 1",
            ));
        }
        check_duration("confirmed-absent ttl", ttl)?;
        guard.time_inserts();
        Ok(Self {
            // moka's own expiry frees memory; `is_absent` decides, on the
            // tokio clock (which tests can pause), whether an entry is fresh.
            asked_at: Cache::builder()
                .max_capacity(capacity)
                .time_to_live(ttl)
                .build(),
            ttl,
        })
    }

    /// Whether the backend confirmed `key` absent within the ttl, and no
    /// insert of it since could have reached the store.
    pub(crate) fn is_absent(&self, guard: &Guard, key: &[u8]) -> bool {
        let Some(asked_at) = self.asked_at.get(key) else {
            return false;
        };
        let fresh = asked_at.elapsed() < self.ttl;
        if fresh && !guard.may_have_written_since(key, asked_at) {
            return true;
        }
        self.asked_at.invalidate(key);
        false
    }

    /// Remembers that the backend, asked at `asked_at`, did not have `key`.
    pub(crate) fn remember(&self, guard: &Guard, key: &[u8], asked_at: Instant) {
        if !guard.may_have_written_since(key, asked_at) {
            self.asked_at.insert(key.into(), asked_at);
        }
    }

    /// Entries held now, expired ones included until moka sweeps them.
    pub(crate) fn len(&self) -> u64 {
        // moka counts lazily: settle its pending bookkeeping first.
        self.asked_at.run_pending_tasks();
        self.asked_at.entry_count()
    }
}

impl std::fmt::Debug for ConfirmedAbsent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConfirmedAbsent")
            .field("entries", &self.len())
            .field("ttl", &self.ttl)
            .finish()
    }
}
