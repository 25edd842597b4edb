//! The one rule: a key that was inserted is always reported present.

use bloomguard::{AtomicBloom, FilterBuilder, FilterParameter};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        rng_seed: RngSeed::Fixed(0x0e_5eed),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn every_inserted_key_is_present_when_sized_for_a_target(
        keys in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..48), 0..2_000),
        expected_items in 1u64..5_000,
        fp_rate in 1e-6f64..0.5,
        seed in any::<u64>(),
    ) {
        let filter = AtomicBloom::with_seed(expected_items, fp_rate, seed).unwrap();
        let added = keys.iter().filter(|key| filter.insert(key)).count() as u64;
        for key in &keys {
            prop_assert!(filter.contains(key));
        }
        // The bulk path sets exactly the bits the single path does, and
        // counts them and the keys that set one alike.
        let bulk = AtomicBloom::with_seed(expected_items, fp_rate, seed).unwrap();
        prop_assert_eq!(bulk.insert_many(&keys), added);
        prop_assert_eq!(bulk.to_bytes(), filter.to_bytes());
        prop_assert_eq!(bulk.stats().set_bits, filter.stats().set_bits);
        let mut found = vec![false; keys.len()];
        filter.contains_many(&keys, &mut found);
        prop_assert!(found.iter().all(|&f| f));
    }

    #[test]
    fn every_inserted_key_is_present_with_explicit_parameters(
        keys in prop::collection::vec(".{0,40}", 0..1_000),
        bits in 1u64..100_000,
        k in 1u32..=32,
        seed in any::<u64>(),
    ) {
        let filter = FilterBuilder::with_params(bits, k).seed(seed).build().unwrap();
        for key in &keys {
            filter.insert(key);
        }
        prop_assert!(keys.iter().all(|key| filter.contains(key)));
        // What survives a snapshot and a union survives them intact.
        let copy = AtomicBloom::from_bytes(&filter.to_bytes()).unwrap();
        let merged = FilterBuilder::with_params(bits, k).seed(seed).build().unwrap();
        merged.union(&copy).unwrap();
        prop_assert!(keys.iter().all(|key| copy.contains(key) && merged.contains(key)));
    }

    #[test]
    fn hashed_and_byte_paths_agree(keys in prop::collection::vec(any::<u64>(), 0..500)) {
        let filter = AtomicBloom::with_seed(1_000, 0.01, 99).unwrap();
        let hashes: Vec<u64> = keys.iter().map(|k| filter.hash(&k.to_le_bytes())).collect();
        for &hash in &hashes {
            filter.insert_hashed(hash);
        }
        for key in &keys {
            prop_assert!(filter.contains(key.to_le_bytes()));
        }
        let mut found = vec![false; hashes.len()];
        filter.contains_many_hashed(&hashes, &mut found);
        prop_assert!(found.iter().all(|&f| f));
    }
}

#[test]
fn insert_reports_whether_bits_were_new() {
    let filter = AtomicBloom::with_seed(1_000, 0.01, 3).unwrap();
    assert!(filter.insert("first"));
    assert!(!filter.insert("first"), "a second insert sets nothing new");
    let set_bits = filter.stats().set_bits;
    assert!(
        (1..=6).contains(&set_bits),
        "k = 6 sets at most 6 bits: {set_bits}"
    );
}

#[test]
fn union_holds_both_sides_and_refuses_strangers() {
    let left = AtomicBloom::with_seed(10_000, 0.01, 5).unwrap();
    let right = AtomicBloom::with_seed(10_000, 0.01, 5).unwrap();
    let left_keys = crate::common::keys(0, 3_000);
    let right_keys = crate::common::keys(3_000, 3_000);
    left_keys.iter().for_each(|k| _ = left.insert(k));
    right_keys.iter().for_each(|k| _ = right.insert(k));
    left.union(&right).unwrap();
    assert!(
        left_keys
            .iter()
            .chain(&right_keys)
            .all(|k| left.contains(k))
    );
    // The counter stays exact: it equals what a snapshot counts bit by bit.
    let recount = AtomicBloom::from_bytes(&left.to_bytes())
        .unwrap()
        .stats()
        .set_bits;
    assert_eq!(left.stats().set_bits, recount);

    let other_seed = AtomicBloom::with_seed(10_000, 0.01, 6).unwrap();
    assert_eq!(
        left.union(&other_seed).unwrap_err().differs_in,
        FilterParameter::Seed
    );
    let other_size = AtomicBloom::with_seed(20_000, 0.01, 5).unwrap();
    assert_eq!(
        left.union(&other_size).unwrap_err().differs_in,
        FilterParameter::Bits
    );
    let other_k = FilterBuilder::with_params(left.bits(), 3)
        .seed(5)
        .build()
        .unwrap();
    assert_eq!(
        left.union(&other_k).unwrap_err().differs_in,
        FilterParameter::K
    );
}

#[test]
fn clear_empties_the_filter() {
    let mut filter = AtomicBloom::with_seed(1_000, 0.01, 8).unwrap();
    let keys = crate::common::keys(0, 500);
    keys.iter().for_each(|k| _ = filter.insert(k));
    filter.clear();
    assert_eq!(filter.stats().set_bits, 0);
    assert!(keys.iter().all(|k| !filter.contains(k)));
}
