//! From key bytes to a block and the probe bits inside it, in one pass over the key.
//!
//! The scheme is part of the snapshot format ([`HASH_SCHEME_ID`]): changing
//! any constant here changes which bits a key sets, so it needs a new id.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Identifies this hash scheme in snapshots: xxh3-64 with the filter's seed;
/// block from the hash by multiply-high; probes from 9-bit slices of the mixed hash.
pub(crate) const HASH_SCHEME_ID: u8 = 1;

/// Probe positions taken from one mixed 64-bit word before it is remixed.
const PROBES_PER_WORD: u32 = 64 / 9;

#[inline]
pub(crate) fn hash_key(key: &[u8], seed: u64) -> u64 {
    xxh3_64_with_seed(key, seed)
}

/// Maps a hash onto `0..num_blocks` by multiply-high ("fastrange"): no
/// division, and all 64 bits take part, so filters of any size spread evenly.
#[inline]
pub(crate) fn block_index(hash: u64, num_blocks: u64) -> usize {
    ((u128::from(hash) * u128::from(num_blocks)) >> 64) as usize
}

/// Visits the `K` bit positions (0..512) of `hash` in its block, stopping at
/// the first for which `visit` answers `false`; returns whether none did.
///
/// The hash goes through a strong bijective mixer (the SplitMix64 finalizer)
/// and each position is the next 9-bit slice of the result; after seven slices
/// the word is mixed again. Slices of a well-mixed word are independent of each
/// other and of the high bits that chose the block, so the measured FPR meets
/// the model's; and two multiplications serve seven probes, where the
/// golden-ratio sequence of RocksDB's FastLocalBloom spends one per probe.
/// `K` is a constant so that the loop unrolls (see `kernel.rs`).
#[inline(always)]
pub(crate) fn visit_probes<const K: u32>(hash: u64, mut visit: impl FnMut(u32) -> bool) -> bool {
    let mut word = mix(hash);
    let mut slices = word;
    for probe in 0..K {
        if probe > 0 && probe % PROBES_PER_WORD == 0 {
            word = mix(word.wrapping_add(GOLDEN_GAMMA));
            slices = word;
        }
        if !visit((slices & 511) as u32) {
            return false;
        }
        slices >>= 9;
    }
    true
}

/// SplitMix64's increment: steps the mixer to a fresh, unrelated word.
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The SplitMix64 finalizer (Stafford's Mix13): every output bit depends on every input bit.
#[inline]
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_stable_across_versions_and_platforms() {
        // Pinned values: if these change, snapshots written before no longer answer the same.
        assert_eq!(hash_key(b"user:42:item:7", 0), 0x89c5_5a82_2227_cba8);
        assert_eq!(block_index(u64::MAX, 1000), 999);
        assert_eq!(block_index(0, 1000), 0);
    }

    #[test]
    fn probes_are_k_positions_inside_the_block() {
        for hash in [0u64, 1, 0xdead_beef, u64::MAX] {
            let mut positions = Vec::new();
            assert!(visit_probes::<32>(hash, |bit| {
                positions.push(bit);
                true
            }));
            assert_eq!(positions.len(), 32);
            assert!(positions.iter().all(|&bit| bit < 512));
            let mut visited = 0;
            assert!(!visit_probes::<32>(hash, |_| {
                visited += 1;
                visited < 3
            }));
            assert_eq!(visited, 3, "stops at the first refusal");
        }
        // Pinned: the positions are part of the snapshot format.
        let mut first = Vec::new();
        visit_probes::<9>(0x89c5_5a82_2227_cba8, |bit| {
            first.push(bit);
            true
        });
        assert_eq!(first, [155, 422, 61, 489, 464, 336, 87, 435, 195]);
    }
}
