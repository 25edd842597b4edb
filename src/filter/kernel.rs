//! The two block operations, compiled once for every k so that the probe loop
//! unrolls and carries no loop counter.
//!
//! A filter picks its pair once, at construction: a runtime-k loop measured
//! ~75 ns a query on 10 M keys, against ~50 ns unrolled.

use super::Block;
use super::hash::visit_probes;
use crate::sync::Ordering;

/// `contains` and `insert` on one block for a fixed k.
#[derive(Clone, Copy)]
pub(super) struct Kernel {
    /// Whether every probe bit of the hash is set, tested in stages (see
    /// [`FIRST_STAGE`]).
    pub(super) contains: fn(&Block, u64) -> bool,
    /// Sets every probe bit and returns how many were newly set: one
    /// single-bit `fetch_or` per probe (x86 `lock bts`), branch-free, exact
    /// even when threads race on one word. Measured faster than a
    /// read-test-CAS per word, whose branches on loaded data mispredict on half
    /// the words of a filling filter.
    pub(super) insert: fn(&Block, u64) -> u32,
}

impl Kernel {
    pub(super) fn for_hashes(k: u32) -> Self {
        KERNELS[(k - 1) as usize]
    }

    const fn of<const K: u32>() -> Self {
        Self {
            contains: contains::<K>,
            insert: insert::<K>,
        }
    }
}

/// How many probe bits `contains` tests before its first branch on them.
///
/// A branch per bit, taken at the first clear one, is a coin toss on a
/// filter about half full, and each miss costs a refill of the pipeline: on a
/// filter in the cache (1M keys), absent keys took 20 ns a query that way and
/// 10 ns with the first four bits ANDed without a branch. The one branch goes
/// on to the other probes only when those four are all set, which for an
/// absent key happens at most once in 16 (at the design load of a 1 % filter,
/// 45 % of the bits set, once in 24): it is predicted that well. The price is
/// four loads from the key's line for every absent key, where the per-bit
/// query stopped after two on average.
///
/// Past the cache, absent single keys are as fast as with the per-bit query,
/// and batches (`contains_many`) 1.8× faster; a stream of present keys there
/// ran ~5 ns slower in 6 of 8 measured pairs (see BENCHMARKS.md, "One branch
/// after the first four bits").
const FIRST_STAGE: u32 = 4;

fn contains<const K: u32>(block: &Block, hash: u64) -> bool {
    // Bit 0 is the AND of the probe bits so far; the bits above it are noise.
    let mut all_set: u64 = 1;
    let mut tested = 0;
    // For the usual k the loop unrolls and `tested` folds into constants.
    visit_probes::<K>(hash, |bit| {
        all_set &= block.0[(bit >> 6) as usize].load(Ordering::Relaxed) >> (bit & 63);
        tested += 1;
        tested != FIRST_STAGE || all_set & 1 == 1
    })
    // `visit_probes` stops only at the first stage; the bits after it (all
    // of them when k < FIRST_STAGE) count through this.
    && all_set & 1 == 1
}

fn insert<const K: u32>(block: &Block, hash: u64) -> u32 {
    let mut newly_set = 0;
    visit_probes::<K>(hash, |bit| {
        let mask = 1 << (bit & 63);
        let before = block.0[(bit >> 6) as usize].fetch_or(mask, Ordering::Relaxed);
        newly_set += u32::from(before & mask == 0);
        true
    });
    newly_set
}

macro_rules! kernels {
    ($($k:literal)*) => { [$(Kernel::of::<$k>()),*] };
}

/// Indexed by k − 1, for k in `1..=MAX_HASHES`.
static KERNELS: [Kernel; super::MAX_HASHES as usize] = kernels!(
    1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32
);

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;
    use crate::filter::WORDS_PER_BLOCK;
    use crate::sync::AtomicU64;

    fn block(words: [u64; WORDS_PER_BLOCK]) -> Block {
        Block(words.map(AtomicU64::new))
    }

    /// The positions of the first `k` probes, from the probe sequence itself
    /// (which does not depend on k), sorted and without repeats.
    fn probe_bits(k: u32, hash: u64) -> Vec<u32> {
        let mut bits = Vec::new();
        let mut left = k;
        visit_probes::<{ crate::filter::MAX_HASHES }>(hash, |bit| {
            bits.push(bit);
            left -= 1;
            left > 0
        });
        bits.sort_unstable();
        bits.dedup();
        bits
    }

    fn set_bits(block: &Block) -> Vec<u32> {
        let mut bits = Vec::new();
        for (word, value) in block.0.iter().enumerate() {
            let value = value.load(Ordering::Relaxed);
            bits.extend(
                (0..64)
                    .filter(|bit| value >> bit & 1 == 1)
                    .map(|bit| word as u32 * 64 + bit),
            );
        }
        bits
    }

    /// Every k answers "present" exactly when all of its bits are set: with
    /// all of them set, and with any single one of them cleared, before the
    /// branch or after it. `insert` sets exactly those bits.
    #[test]
    fn contains_needs_every_probe_bit_before_and_after_the_branch() {
        use rand::{Rng as _, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(16);
        let hashes: Vec<u64> = (0..200).map(|_| rng.random()).collect();
        for k in 1..=crate::filter::MAX_HASHES {
            let kernel = Kernel::for_hashes(k);
            for &hash in &hashes {
                let bits = probe_bits(k, hash);
                let only_its_bits = block([0; WORDS_PER_BLOCK]);
                (kernel.insert)(&only_its_bits, hash);
                assert_eq!(set_bits(&only_its_bits), bits, "k = {k}: insert's bits");
                assert!(
                    (kernel.contains)(&only_its_bits, hash),
                    "k = {k}: after insert"
                );
                let empty = block([0; WORDS_PER_BLOCK]);
                assert!(!(kernel.contains)(&empty, hash), "k = {k}: none set");
                for &cleared in &bits {
                    let one_missing = block([u64::MAX; WORDS_PER_BLOCK]);
                    one_missing.0[(cleared / 64) as usize]
                        .fetch_and(!(1 << (cleared % 64)), Ordering::Relaxed);
                    assert!(
                        !(kernel.contains)(&one_missing, hash),
                        "k = {k}, hash {hash:#x}: bit {cleared} clear, yet present"
                    );
                }
            }
        }
    }
}
