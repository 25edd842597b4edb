//! The filters a guard answers from, swapped as one value.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use tokio::time::Instant;

use super::writes::WriteTracker;
use crate::filter::AtomicBloom;

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
    /// Changes whenever `generations` does.
    pub(crate) number: u64,
}

impl LiveSet {
    pub(crate) fn warming() -> Self {
        Self {
            generations: Vec::new(),
            warming: true,
            shadow: None,
            number: 0,
        }
    }

    /// A set that serves from `generations`, numbered as the next swap.
    pub(crate) fn serving(&self, generations: Vec<Arc<Generation>>) -> Self {
        Self {
            warming: false,
            ..self.replaced(generations)
        }
    }

    pub(crate) fn newest(&self) -> Option<&Arc<Generation>> {
        self.generations.last()
    }

    /// The same filters with `shadow` taking inserts alongside.
    pub(crate) fn with_shadow(&self, shadow: Option<Arc<Shadow>>) -> Self {
        Self {
            generations: self.generations.clone(),
            warming: self.warming,
            shadow,
            number: self.number,
        }
    }

    /// A new set of generations, numbered as the next swap.
    pub(crate) fn replaced(&self, generations: Vec<Arc<Generation>>) -> Self {
        Self {
            generations,
            warming: self.warming,
            shadow: self.shadow.clone(),
            number: self.number + 1,
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
    pub(crate) opened_at: Instant,
    /// The set-bit count at which the filter holds `capacity` keys.
    pub(crate) full_at_set_bits: u64,
    /// Inserts whose hash has these bits clear check whether the filter is full.
    pub(crate) fullness_check_mask: u64,
}

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
            opened_at: Instant::now(),
            full_at_set_bits,
            fullness_check_mask: (1u64 << interval.ilog2()) - 1,
        }
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
    /// by the guard after this build ends (see `Guard::earlier_writes`).
    pub(crate) writes: Arc<WriteTracker>,
    /// Set when a filter merged into the live set could not be merged into
    /// this one: committing it would lose that filter's keys.
    pub(crate) missed_a_merge: AtomicBool,
}
