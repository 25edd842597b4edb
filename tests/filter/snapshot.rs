//! Snapshots round-trip bit for bit, and anything else is refused with a `DecodeError`.

use std::path::PathBuf;

use crate::common::alloc_meter::measure;
use bloomguard::{AtomicBloom, DecodeError, FORMAT_VERSION, FilterBuilder};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

fn filled(expected: u64, p: f64, seed: u64, count: u64) -> AtomicBloom {
    let filter = AtomicBloom::with_seed(expected, p, seed).unwrap();
    for key in crate::common::keys(0, count) {
        filter.insert(key);
    }
    filter
}

fn answers(filter: &AtomicBloom, probes: &[String]) -> Vec<bool> {
    probes.iter().map(|key| filter.contains(key)).collect()
}

#[test]
fn round_trip_answers_identically() {
    let filter = filled(20_000, 0.01, 21, 20_000);
    let bytes = filter.to_bytes();
    assert_eq!(bytes.len(), filter.encoded_len());
    let copy = AtomicBloom::from_bytes(&bytes).unwrap();

    let mut probes = crate::common::keys(0, 20_000);
    probes.extend(crate::common::absent_keys(0, 50_000));
    assert_eq!(answers(&filter, &probes), answers(&copy, &probes));
    assert_eq!(copy.to_bytes(), bytes, "re-encoding is bit-identical");
    assert_eq!(copy.stats(), filter.stats());
    assert_eq!(
        (copy.seed(), copy.k(), copy.bits()),
        (21, filter.k(), filter.bits())
    );

    let mut streamed = Vec::new();
    filter.write_to(&mut streamed).unwrap();
    assert_eq!(streamed, bytes);
    let from_reader = AtomicBloom::read_from(&bytes[..]).unwrap();
    assert_eq!(from_reader.to_bytes(), bytes);
}

#[test]
fn explicit_parameters_round_trip_without_a_target() {
    let filter = FilterBuilder::with_params(4096, 5).seed(1).build().unwrap();
    filter.insert("x");
    let copy = AtomicBloom::from_bytes(&filter.to_bytes()).unwrap();
    assert_eq!(copy.stats().capacity, None);
    assert_eq!(copy.stats().target_fpr, None);
    assert!(copy.contains("x"));
}

#[test]
fn read_from_stops_at_the_end_of_one_snapshot() {
    let first = filled(100, 0.01, 1, 50);
    let second = filled(300, 0.001, 2, 200);
    let mut stream = first.to_bytes();
    stream.extend(second.to_bytes());
    let mut reader = &stream[..];
    assert_eq!(
        AtomicBloom::read_from(&mut reader).unwrap().to_bytes(),
        first.to_bytes()
    );
    assert_eq!(
        AtomicBloom::read_from(&mut reader).unwrap().to_bytes(),
        second.to_bytes()
    );
    assert!(reader.is_empty());
}

fn small_snapshot() -> Vec<u8> {
    filled(200, 0.01, 3, 200).to_bytes()
}

#[test]
fn every_truncation_is_refused() {
    let bytes = small_snapshot();
    for len in 0..bytes.len() {
        let err = AtomicBloom::from_bytes(&bytes[..len]).unwrap_err();
        assert!(
            matches!(err, DecodeError::Truncated),
            "length {len}: {err:?}"
        );
    }
}

#[test]
fn a_flipped_byte_anywhere_is_refused() {
    let bytes = small_snapshot();
    for position in 0..bytes.len() {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut corrupt = bytes.clone();
            corrupt[position] ^= flip;
            assert!(
                AtomicBloom::from_bytes(&corrupt).is_err(),
                "byte {position} xor {flip:#x} was accepted"
            );
        }
    }
}

#[test]
fn wrong_magic_future_version_and_trailing_bytes_are_named() {
    let bytes = small_snapshot();

    let mut foreign = bytes.clone();
    foreign[..8].copy_from_slice(b"NOTBLOOM");
    assert!(matches!(
        AtomicBloom::from_bytes(&foreign),
        Err(DecodeError::BadMagic)
    ));

    let mut future = bytes.clone();
    future[8..10].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    let err = AtomicBloom::from_bytes(&future).unwrap_err();
    assert!(
        matches!(err, DecodeError::UnsupportedVersion { found, supported }
        if found == FORMAT_VERSION + 1 && supported == FORMAT_VERSION)
    );
    assert!(err.to_string().contains("not supported"));

    let mut longer = bytes.clone();
    longer.push(0);
    assert!(matches!(
        AtomicBloom::from_bytes(&longer),
        Err(DecodeError::TrailingBytes)
    ));

    assert!(matches!(
        AtomicBloom::from_bytes(b""),
        Err(DecodeError::Truncated)
    ));
}

#[test]
fn a_forged_size_is_refused_before_allocating() {
    let mut forged = small_snapshot();
    forged[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        AtomicBloom::from_bytes(&forged),
        Err(DecodeError::Truncated)
    ));
    assert!(matches!(
        AtomicBloom::read_from(&forged[..]),
        Err(DecodeError::TooLarge { .. })
    ));
    let small_budget = AtomicBloom::read_from_with_max_bytes(&small_snapshot()[..], 64);
    assert!(matches!(small_budget, Err(DecodeError::TooLarge { .. })));
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        rng_seed: RngSeed::Fixed(0xed17_5eed),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Random edits never panic, and never yield a filter that differs from the bytes.
    #[test]
    fn random_edits_never_yield_a_different_filter(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
        truncate in any::<bool>(),
    ) {
        let original = small_snapshot();
        let mut bytes = original.clone();
        for (at, value) in edits {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        if truncate {
            bytes.truncate(cut.index(bytes.len()));
        }
        if let Ok(filter) = AtomicBloom::from_bytes(&bytes) {
            prop_assert_eq!(&bytes, &original, "only the untouched snapshot decodes");
            prop_assert_eq!(filter.to_bytes(), bytes);
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let _ = AtomicBloom::from_bytes(&bytes);
        let mut with_magic = b"BLMGUARD\x01\x00\x01\x01".to_vec();
        with_magic.extend(&bytes);
        let _ = AtomicBloom::from_bytes(&with_magic);
    }
}

/// Bytes a decode may hold beyond twice the snapshot's size, whatever it
/// claims: a filter's fixed parts (its set-bit counter stripes), plus a little.
fn decode_slack_bytes() -> usize {
    let one_block = AtomicBloom::with_params(512, 1).unwrap();
    one_block.memory_bytes() - 64 + 256
}

/// Decodes `bytes` both ways, checking that neither holds more than twice
/// the input, and that only an intact snapshot decodes.
fn decode_within_budget(bytes: &[u8]) -> Result<(), TestCaseError> {
    let budget = 2 * bytes.len() + decode_slack_bytes();
    let (whole, used) = measure(|| AtomicBloom::from_bytes(bytes).map(|f| f.memory_bytes()));
    prop_assert!(
        used.peak_bytes <= budget,
        "from_bytes held {} bytes of a {}-byte input",
        used.peak_bytes,
        bytes.len()
    );
    let (streamed, used) = measure(|| AtomicBloom::read_from(bytes).map(|f| f.memory_bytes()));
    prop_assert!(
        used.peak_bytes <= budget,
        "read_from held {} bytes of a {}-byte input",
        used.peak_bytes,
        bytes.len()
    );
    // read_from stops at the snapshot's end, so bytes after it are no error there.
    prop_assert!(
        whole.is_err() || streamed.is_ok(),
        "{:?} vs {:?}",
        whole,
        streamed
    );
    Ok(())
}

#[test]
fn a_lying_header_costs_no_memory_before_the_payload_arrives() {
    // 156 bytes whose header claims 2^26 blocks: 4 GiB, inside the default budget.
    let mut lying = small_snapshot();
    lying.truncate(156);
    lying[16..24].copy_from_slice(&(1u64 << 26).to_le_bytes());
    let (result, used) = measure(|| AtomicBloom::read_from(&lying[..]).map(|_| ()));
    assert!(matches!(result, Err(DecodeError::Truncated)), "{result:?}");
    assert!(
        used.peak_bytes <= 2 * lying.len() + decode_slack_bytes(),
        "read_from held {} bytes for a {}-byte stream",
        used.peak_bytes,
        lying.len()
    );
}

#[test]
fn the_meter_sees_a_peak() {
    let ((), used) = measure(|| drop(std::hint::black_box(vec![0u8; 4096])));
    assert_eq!((used.allocations, used.peak_bytes), (1, 4096));
}

/// Offsets of the header fields with their edge values (see the format table in `codec.rs`).
const HEADER_EDGES: [(usize, &[u64]); 6] = [
    (12, &[0, 1, 32, 33, u32::MAX as u64]),       // k (4 bytes)
    (16, &[0, 1, 2, 1 << 26, 1 << 40, u64::MAX]), // blocks
    (24, &[0, u64::MAX]),                         // seed
    (32, &[0, 1, u64::MAX]),                      // capacity
    (
        40,
        &[0, 1, 0x3ff0_0000_0000_0000, 0x7ff8_0000_0000_0000, u64::MAX],
    ), // target FPR bits: 0, tiny, 1.0, NaN
    (48, &[0, 1, u64::MAX]),                      // reserved
];

/// Sets a header field and recomputes the checksum, so the decoder has to
/// judge the field itself.
fn with_header_field(mut bytes: Vec<u8>, offset: usize, value: u64) -> Vec<u8> {
    let width = if offset == 12 { 4 } else { 8 };
    bytes[offset..offset + width].copy_from_slice(&value.to_le_bytes()[..width]);
    let body = bytes.len() - 8;
    let checksum = xxhash_rust::xxh3::xxh3_64(&bytes[..body]);
    bytes[body..].copy_from_slice(&checksum.to_le_bytes());
    bytes
}

#[derive(Debug, Clone)]
enum Mutation {
    FlipBit(prop::sample::Index, u8),
    Truncate(prop::sample::Index),
    Extend(Vec<u8>),
    HeaderField(prop::sample::Index, prop::sample::Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<prop::sample::Index>(), 0..8u8).prop_map(|(at, bit)| Mutation::FlipBit(at, bit)),
        any::<prop::sample::Index>().prop_map(Mutation::Truncate),
        prop::collection::vec(any::<u8>(), 1..200).prop_map(Mutation::Extend),
        (any::<prop::sample::Index>(), any::<prop::sample::Index>())
            .prop_map(|(field, value)| Mutation::HeaderField(field, value)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 512,
        rng_seed: RngSeed::Fixed(0x5eed_b10f),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Valid snapshots, mutated: no panic, no decode holding more than twice
    /// the input, and only the untouched bytes decode.
    #[test]
    fn mutated_snapshots_are_refused_within_a_memory_budget(
        items in 1..400u64,
        seed in any::<u64>(),
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let original = filled(items, 0.01, seed, items);
        let original = original.to_bytes();
        let mut bytes = original.clone();
        for mutation in mutations {
            match mutation {
                Mutation::FlipBit(at, bit) if !bytes.is_empty() => {
                    let i = at.index(bytes.len());
                    bytes[i] ^= 1 << bit;
                }
                Mutation::Truncate(at) if !bytes.is_empty() => bytes.truncate(at.index(bytes.len())),
                Mutation::FlipBit(..) | Mutation::Truncate(_) => {}
                Mutation::Extend(extra) => bytes.extend(extra),
                Mutation::HeaderField(field, value) if bytes.len() >= 64 => {
                    let (offset, edges) = HEADER_EDGES[field.index(HEADER_EDGES.len())];
                    bytes = with_header_field(bytes, offset, edges[value.index(edges.len())]);
                }
                Mutation::HeaderField(..) => {}
            }
        }
        decode_within_budget(&bytes)?;
        if let Ok(filter) = AtomicBloom::from_bytes(&bytes) {
            prop_assert_eq!(filter.to_bytes(), bytes);
        }
    }
}

// ---- golden files: the format is a promise ----

struct Golden {
    file: &'static str,
    expected_items: u64,
    fp_rate: f64,
    seed: u64,
    inserted: u64,
}

const GOLDEN: [Golden; 2] = [
    Golden {
        file: "v1_n1000_p0.01_seed42.bloom",
        expected_items: 1_000,
        fp_rate: 0.01,
        seed: 42,
        inserted: 1_000,
    },
    Golden {
        file: "v1_n5000_p0.001_seed7.bloom",
        expected_items: 5_000,
        fp_rate: 0.001,
        seed: 7,
        inserted: 2_500,
    },
];
const GOLDEN_PROBES: u64 = 100_000;

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn build_golden(golden: &Golden) -> AtomicBloom {
    filled(
        golden.expected_items,
        golden.fp_rate,
        golden.seed,
        golden.inserted,
    )
}

/// The absent probes each golden filter answered "maybe" for, one index per line.
fn false_positive_indices(filter: &AtomicBloom) -> String {
    crate::common::absent_keys(0, GOLDEN_PROBES)
        .iter()
        .enumerate()
        .filter(|(_, key)| filter.contains(key))
        .map(|(i, _)| format!("{i}\n"))
        .collect()
}

#[test]
fn golden_snapshots_still_read_with_identical_answers() {
    for golden in &GOLDEN {
        let path = golden_dir().join(golden.file);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let filter = AtomicBloom::from_bytes(&bytes).unwrap();

        assert!(
            crate::common::keys(0, golden.inserted)
                .iter()
                .all(|key| filter.contains(key))
        );
        let expected = std::fs::read_to_string(path.with_extension("positives")).unwrap();
        assert_eq!(false_positive_indices(&filter), expected, "{}", golden.file);

        // Today's code, given the same keys and seed, writes the very same bytes:
        // hashing and layout have not moved.
        assert_eq!(build_golden(golden).to_bytes(), bytes, "{}", golden.file);
    }
}

/// Writes the golden files. Only for a new format version, never to make a failing test pass:
/// `BLOOMGUARD_WRITE_GOLDEN=1 cargo test --test filter -- --ignored write_golden_files`
#[test]
#[ignore = "writes tests/golden; run by hand for a new format version"]
fn write_golden_files() {
    assert_eq!(std::env::var("BLOOMGUARD_WRITE_GOLDEN").as_deref(), Ok("1"));
    for golden in &GOLDEN {
        let filter = build_golden(golden);
        let path = golden_dir().join(golden.file);
        std::fs::write(&path, filter.to_bytes()).unwrap();
        std::fs::write(
            path.with_extension("positives"),
            false_positive_indices(&filter),
        )
        .unwrap();
    }
}
