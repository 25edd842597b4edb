//! A small cache of keys the backend confirmed absent after the filter said
//! "maybe": the false positives worth remembering, answered absent next time.
//!
//! A cached "absent" must never outlive an insert of the key, nor be made
//! from a backend answer that raced with one. So every insert leaves a mark
//! (`Inserted { at }`) in place of whatever the key had, and an answer is
//! only cached when no insert of the key happened within `write_settle`
//! before the backend was asked: an insert's store write lands within that
//! time (the same contract rebuilds rely on), so a backend read that started
//! later than that saw it. Marks are kept for twice the settle, and an
//! answer that took longer than the settle to come back is not cached, so a
//! mark is never swept while an answer that raced with its insert can still
//! arrive. Marks and expired entries are swept when the map outgrows twice
//! its capacity.

use std::time::Duration;

use dashmap::DashMap;
use dashmap::mapref::entry::Entry as MapEntry;
use tokio::time::Instant;

use crate::error::ConfigError;

#[derive(Debug, Clone, Copy)]
enum Entry {
    Absent { until: Instant },
    Inserted { at: Instant },
}

#[derive(Debug)]
pub(crate) struct ConfirmedAbsent {
    entries: DashMap<Box<[u8]>, Entry>,
    capacity: usize,
    ttl: Duration,
    write_settle: Duration,
}

impl ConfirmedAbsent {
    pub(crate) fn new(
        capacity: usize,
        ttl: Duration,
        write_settle: Duration,
    ) -> Result<Self, ConfigError> {
        if capacity == 0 {
            return Err(ConfigError::out_of_range(
                "confirmed-absent capacity",
                capacity,
                "at least 1",
            ));
        }
        super::check_duration("confirmed-absent ttl", ttl)?;
        Ok(Self {
            entries: DashMap::new(),
            capacity,
            ttl,
            write_settle,
        })
    }

    /// Whether the backend confirmed `key` absent, recently and since its last insert.
    pub(crate) fn is_absent(&self, key: &[u8]) -> bool {
        self.entries.get(key).is_some_and(
            |entry| matches!(*entry, Entry::Absent { until } if until > Instant::now()),
        )
    }

    /// Marks `key` inserted: from now on no cached answer for it holds.
    pub(crate) fn note_insert(&self, key: &[u8]) {
        self.entries
            .insert(key.into(), Entry::Inserted { at: Instant::now() });
        if self.entries.len() > 2 * self.capacity {
            self.sweep();
        }
    }

    /// Remembers that the backend, asked at `asked_at`, did not have `key`.
    pub(crate) fn remember(&self, key: &[u8], asked_at: Instant) {
        if asked_at.elapsed() > self.write_settle {
            return;
        }
        let absent = Entry::Absent {
            until: Instant::now() + self.ttl,
        };
        if let Some(mut entry) = self.entries.get_mut(key) {
            match *entry {
                Entry::Inserted { at } if at + self.write_settle > asked_at => {}
                _ => *entry = absent,
            }
            return;
        }
        if self.entries.len() >= self.capacity {
            self.sweep();
            if self.entries.len() >= self.capacity {
                return;
            }
        }
        // An insert may have marked the key since the look-up above.
        if let MapEntry::Vacant(vacant) = self.entries.entry(key.into()) {
            vacant.insert(absent);
        }
    }

    /// Drops expired answers and marks older than twice the write settle.
    fn sweep(&self) {
        let now = Instant::now();
        self.entries.retain(|_, entry| match *entry {
            Entry::Absent { until } => until > now,
            Entry::Inserted { at } => at + 2 * self.write_settle > now,
        });
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}
