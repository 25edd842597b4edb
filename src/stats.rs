//! Counters that many threads bump at once without fighting over one cache line.

use std::sync::OnceLock;

use crate::sync::{AtomicU64, Ordering};

/// One counter slot on a cache line of its own. 128 bytes because x86-64
/// prefetches cache lines in pairs, so 64-byte padding still shares traffic.
#[repr(align(128))]
#[derive(Default)]
struct Padded(AtomicU64);

/// A counter split into per-thread stripes, summed on read.
///
/// `add` touches only the calling thread's stripe, so concurrent writers do not
/// serialise on one cache line; `sum` is exact once writers are quiet and a
/// consistent-enough snapshot while they are not.
pub(crate) struct StripedCounter {
    stripes: Box<[Padded]>,
}

impl StripedCounter {
    pub(crate) fn new() -> Self {
        let stripes = (0..stripe_count()).map(|_| Padded::default()).collect();
        Self { stripes }
    }

    #[inline]
    pub(crate) fn add(&self, n: u64) {
        let stripe = &self.stripes[thread_stripe() & (self.stripes.len() - 1)];
        stripe.0.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn sum(&self) -> u64 {
        self.stripes
            .iter()
            .map(|s| s.0.load(Ordering::Relaxed))
            .fold(0, u64::wrapping_add)
    }

    pub(crate) fn memory_bytes(&self) -> usize {
        std::mem::size_of_val(&*self.stripes)
    }

    /// Replaces the total with `value` (callers make sure no writer is active).
    pub(crate) fn set(&self, value: u64) {
        for (i, stripe) in self.stripes.iter().enumerate() {
            stripe
                .0
                .store(if i == 0 { value } else { 0 }, Ordering::Relaxed);
        }
    }
}

impl std::fmt::Debug for StripedCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("StripedCounter").field(&self.sum()).finish()
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

/// A number fixed per thread, spread over stripes: the address of a
/// thread-local byte, which differs between live threads. Reading it is one
/// address computation: no lazy initialisation, no registration.
#[inline]
fn thread_stripe() -> usize {
    thread_local! {
        static MARKER: u8 = const { 0 };
    }
    let address = MARKER.with(|marker| std::ptr::from_ref(marker) as usize) as u64;
    // Thread-local blocks sit at page-aligned distances: mix the address so
    // that neighbouring threads land on different stripes.
    (address.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_across_threads() {
        let counter = StripedCounter::new();
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        counter.add(3);
                    }
                });
            }
        });
        assert_eq!(counter.sum(), 8 * 10_000 * 3);
        counter.set(5);
        assert_eq!(counter.sum(), 5);
    }
}
