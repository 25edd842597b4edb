//! Catching writes that bypassed the guard: a sample of `Absent` answers is
//! checked against the store, off the request path.

use std::cell::Cell;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;

use super::source::SourceError;
use crate::error::ConfigError;

/// Keys waiting for verification, at most; more samples are dropped.
const QUEUE_CAPACITY: usize = 1024;

type ExistsFuture = Pin<Box<dyn Future<Output = Result<bool, SourceError>> + Send>>;
type ExistsFn = Arc<dyn Fn(Vec<u8>) -> ExistsFuture + Send + Sync>;

/// Findings whose keys are kept, at most (8 bytes each): past it the
/// oldest are let go.
const KEPT_FINDINGS: usize = 4_096;

/// Stale answers the check found, and how many of them a rebuild has
/// repaired. A rebuild repairs only those found before it read its source:
/// its scan may have passed the key of one found while it read.
#[derive(Debug, Default)]
pub(crate) struct StaleFindings {
    found: AtomicU64,
    repaired: AtomicU64,
    /// The hashes of the keys found (the newest [`KEPT_FINDINGS`]): their
    /// inserts went into this guard's set alone, and a set that replaces it
    /// whole (a fleet snapshot) gets them back, repaired or not: a snapshot
    /// read before this guard's own rebuild repaired one may be taken after.
    found_keys: Mutex<VecDeque<u64>>,
}

impl StaleFindings {
    /// Records a finding of the key hashing to `hash`. Before its insert:
    /// a set adopted after this puts it back, and one adopted before it is
    /// the set the insert then goes into.
    pub(crate) fn record(&self, hash: u64) {
        let mut kept = crate::sync::unpoisoned(self.found_keys.lock());
        self.found.fetch_add(1, Ordering::Relaxed);
        if kept.len() == KEPT_FINDINGS {
            kept.pop_front();
        }
        kept.push_back(hash);
    }

    /// The hashes of the keys found (the newest [`KEPT_FINDINGS`]), for a
    /// set adopted from a fleet snapshot (the `redis` feature).
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) fn found_hashes(&self) -> Vec<u64> {
        let kept = crate::sync::unpoisoned(self.found_keys.lock());
        kept.iter().copied().collect()
    }

    /// Whether a finding waits for a rebuild.
    pub(crate) fn unrepaired(&self) -> bool {
        self.found.load(Ordering::Relaxed) > self.repaired.load(Ordering::Relaxed)
    }

    /// The findings so far, taken before reading the source: their keys
    /// were in the store when found, so the read sees them.
    pub(crate) fn so_far(&self) -> u64 {
        self.found.load(Ordering::Relaxed)
    }

    /// Marks the findings up to `so_far` (taken before the read) repaired.
    pub(crate) fn repaired(&self, so_far: u64) {
        self.repaired.fetch_max(so_far, Ordering::Relaxed);
    }
}

/// The staleness check as configured on the builder.
pub(crate) struct StalenessCheck {
    fraction: f64,
    exists: ExistsFn,
}

impl StalenessCheck {
    pub(crate) fn new<F, Fut>(fraction: f64, exists: F) -> Self
    where
        F: Fn(Vec<u8>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<bool, SourceError>> + Send + 'static,
    {
        Self {
            fraction,
            exists: Arc::new(move |key| Box::pin(exists(key))),
        }
    }

    /// The sampling half (on the request path) and the verifying half (in
    /// the maintenance task), joined by a bounded queue.
    pub(crate) fn split(self) -> Result<(StalenessSampler, Verifier), ConfigError> {
        if !(self.fraction > 0.0 && self.fraction <= 1.0) {
            return Err(ConfigError::out_of_range(
                "staleness fraction",
                self.fraction,
                "(0, 1]",
            ));
        }
        let (queue, keys) = mpsc::channel(QUEUE_CAPACITY);
        // A sample is taken when a uniform u64 falls at or below the threshold.
        let threshold = if self.fraction >= 1.0 {
            u64::MAX
        } else {
            (self.fraction * u64::MAX as f64) as u64
        };
        Ok((
            StalenessSampler { threshold, queue },
            Verifier {
                keys,
                exists: self.exists,
            },
        ))
    }
}

pub(crate) struct StalenessSampler {
    threshold: u64,
    queue: mpsc::Sender<Vec<u8>>,
}

impl StalenessSampler {
    #[inline]
    pub(crate) fn maybe_sample(&self, key: &[u8]) {
        if next_random() <= self.threshold {
            // A full queue means the verifier is behind: dropping a sample
            // only makes the check a little less eager. The key is copied
            // once there is room for it.
            if let Ok(room) = self.queue.try_reserve() {
                room.send(key.to_vec());
            }
        }
    }
}

pub(crate) struct Verifier {
    pub(crate) keys: mpsc::Receiver<Vec<u8>>,
    exists: ExistsFn,
}

impl Verifier {
    pub(crate) fn exists(&self, key: Vec<u8>) -> ExistsFuture {
        (self.exists)(key)
    }
}

/// A per-thread xorshift generator: sampling needs no quality beyond
/// "uniform enough" and must cost no shared state.
fn next_random() -> u64 {
    thread_local! {
        static STATE: Cell<u64> = const { Cell::new(0) };
    }
    STATE.with(|state| {
        let mut x = state.get();
        if x == 0 {
            x = crate::filter::random_seed() | 1;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        state.set(x);
        x
    })
}
