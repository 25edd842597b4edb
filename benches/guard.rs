//! What a `Guard` adds to the filter it holds: the read section and the
//! counting on `check`, the in-flight count on `insert`; and every read path
//! of issue #16 on the seen-items mix beside fastbloom, per thread count.
//!
//! ```text
//! cargo bench --bench guard                                   # n = 1M, 10M; 1 and 2 threads
//! BLOOMGUARD_BENCH_THREADS=1,2,4,8,16 cargo bench --bench guard
//! BLOOMGUARD_BENCH_SIZES=10M,100M cargo bench --bench guard -- paths/ && python3 benches/summary.py paths
//! ```
//!
//! The raw paths call `AtomicBloom` directly on the guard's own filter (1 %
//! FPR), so both sides probe the same memory. Each timed iteration handles 64 keys per thread. Before the
//! criterion runs, an interleaved measurement of the single-thread paths is
//! printed at the end and written to `target/criterion/guard-overhead.md`.

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use bloomguard::{AtomicBloom, Guard, Lifecycle};
use common::{
    BLOCK, CHUNK, KeySet, Path, ROUNDS, bench_chunks, bench_sizes, guard_batches, interleaved,
    label, one_by_one, raw_batches, thread_counts, wall_time_of,
};
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput, measurement::WallTime};
use xxhash_rust::xxh3::xxh3_64;

const TARGET_FPR: f64 = 0.01;
const ABSENT_KEYS: usize = 4_000_000;
/// Of every 100 keys checked in the mix, how many are present (seen items).
const PRESENT_PER_100: usize = 3;

/// The paths of issue #16's table on the seen-items mix (3 keys in 100
/// present), fastbloom's atomic filter fed xxh3 beside them, at every
/// thread count: the figures BENCHMARKS.md shows with threads as columns.
/// Inserts go into cleared filters (their memory mapped already: a fresh
/// filter of ours is mapped lazily, fastbloom's as it is built), as
/// `bench_inserts` says.
fn bench_paths(
    criterion: &mut Criterion,
    n: usize,
    mix: &[&[u8]],
    present: &[&[u8]],
    guard: &Guard,
) {
    let live = guard.live_filters();
    let raw = live
        .newest()
        .expect("a guard without a source has a filter");
    let fastbloom = fastbloom::AtomicBloomFilter::with_false_pos(TARGET_FPR).expected_items(n);
    for key in present {
        fastbloom.insert_hash(xxh3_64(key));
    }
    let mut group = criterion.benchmark_group(format!("paths/n={}", label(n)));
    group
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));
    for threads in thread_counts() {
        let id = |path: &str| format!("{path}/{threads}T");
        bench_chunks(
            &mut group,
            id("fastbloom-contains-xxh3"),
            mix,
            threads,
            || one_by_one(|k| fastbloom.contains_hash(xxh3_64(k))),
        );
        bench_chunks(&mut group, id("raw-contains"), mix, threads, || {
            one_by_one(|k| raw.contains(k))
        });
        bench_chunks(&mut group, id("raw-contains-many"), mix, threads, || {
            raw_batches(raw)
        });
        bench_chunks(&mut group, id("guard-check"), mix, threads, || {
            one_by_one(|k| guard.check(k))
        });
        bench_chunks(&mut group, id("guard-reader-check"), mix, threads, || {
            let mut reader = guard.reader();
            one_by_one(move |k| reader.check(k))
        });
        bench_chunks(&mut group, id("guard-check-many"), mix, threads, || {
            guard_batches(guard)
        });
        bench_inserts(
            &mut group,
            id("fastbloom-insert-xxh3"),
            present,
            threads,
            fastbloom::AtomicBloomFilter::with_false_pos(TARGET_FPR).expected_items(n),
            |filter| filter.clear(),
            |filter, k| {
                filter.insert_hash(xxh3_64(k));
            },
        );
        bench_inserts(
            &mut group,
            id("raw-insert"),
            present,
            threads,
            AtomicBloom::new(n as u64, TARGET_FPR).unwrap(),
            |filter| filter.clear(),
            |filter, k| {
                filter.insert(k);
            },
        );
    }
    group.finish();
}

/// The interleaved table for one filter size, as Markdown rows.
fn overhead_rows(
    n: usize,
    absent: &KeySet,
    present: &KeySet,
    raw: &AtomicBloom,
    guard: &Guard,
) -> Vec<String> {
    let mut rows = Vec::new();
    for (what, keys) in [("absent", absent), ("present", present)] {
        let mut reader = guard.reader();
        let mut raw_path = |k: &[u8]| raw.contains(k);
        let mut check_path = |k: &[u8]| guard.check(k).is_absent();
        let mut reader_path = |k: &[u8]| reader.check(k).is_absent();
        let mut paths: [Path<'_, '_>; 3] = [
            ("raw contains", &mut raw_path),
            ("Guard::check", &mut check_path),
            ("GuardReader::check", &mut reader_path),
        ];
        let medians = interleaved(&keys.slices(), &mut paths);
        for ((path, _), median) in paths.iter().zip(&medians) {
            rows.push(format!(
                "| {} | {what} | {path} | {median:.1} | {:+.1} |",
                label(n),
                median - medians[0]
            ));
        }
    }
    rows
}

/// `threads` threads insert their own stretches of `keys` into one shared
/// `target`, in key order. When a stretch is used up, the target is `reset`
/// (untimed) and the walk starts over: every key goes into each emptied
/// target once, so every path sees the same fill levels.
fn bench_inserts<T: Sync>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: String,
    keys: &[&[u8]],
    threads: usize,
    mut target: T,
    reset: impl Fn(&mut T),
    insert: impl Fn(&T, &[u8]) + Sync,
) {
    group.throughput(Throughput::Elements((CHUNK * threads) as u64));
    let span = keys.len() / threads;
    let mut inserted = 0;
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let mut elapsed = Duration::ZERO;
            let mut left = iters as usize * CHUNK;
            while left > 0 {
                if inserted == span {
                    reset(&mut target);
                    inserted = 0;
                }
                let take = left.min(span - inserted);
                let stretch = |t: usize| &keys[t * span + inserted..][..take];
                let run = |stretch: &[&[u8]]| {
                    let start = Instant::now();
                    for key in stretch {
                        insert(&target, black_box(key));
                    }
                    start.elapsed()
                };
                elapsed += if threads == 1 {
                    run(stretch(0))
                } else {
                    wall_time_of(threads, stretch, run)
                };
                inserted += take;
                left -= take;
            }
            elapsed
        })
    });
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    let absent = KeySet::generate("absent", ABSENT_KEYS, 2);
    let mut overhead = vec![
        "| n | keys | path | median ns/key | added |".to_string(),
        "|---|---|---|---:|---:|".to_string(),
    ];
    for n in bench_sizes("1M,10M") {
        let present = KeySet::generate("user", n, 1);
        let guard = Guard::builder()
            .expected_items(n as u64)
            .false_positive_rate(TARGET_FPR)
            .build()
            .unwrap();
        // Three live generations, each a third of the keys: what a rotating guard ORs.
        let rotating = Guard::builder()
            .expected_items(n as u64 / 3)
            .false_positive_rate(TARGET_FPR)
            .lifecycle(Lifecycle::rotate(3, Duration::from_secs(3600)))
            .build()
            .unwrap();
        for i in 0..present.len() {
            guard.insert(present.get(i));
            rotating.insert(present.get(i));
            // Two rotations: a third would drop the first generation and
            // open an empty one (n / 3 · 3 < n).
            if i + 1 == n / 3 || i + 1 == 2 * (n / 3) {
                rotating.rotate().unwrap();
            }
        }

        // The raw paths probe the guard's own filter: two filters of the same
        // size would compete for the cache, and the one used less would lose.
        let live = guard.live_filters();
        let raw = live
            .newest()
            .expect("a guard without a source has a filter");
        overhead.extend(overhead_rows(n, &absent, &present, raw, &guard));

        let mut group = criterion.benchmark_group(format!("guard/n={}", label(n)));
        group
            .sampling_mode(SamplingMode::Flat)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(2));
        let (absent_slices, present_slices) = (absent.slices(), present.slices());
        for threads in thread_counts() {
            for (what, keys) in [("absent", &absent_slices), ("present", &present_slices)] {
                let id = |name: &str| format!("{what}/{threads}T/{name}");
                bench_chunks(&mut group, id("raw-contains"), keys, threads, || {
                    one_by_one(|k| raw.contains(k))
                });
                bench_chunks(&mut group, id("guard-check"), keys, threads, || {
                    one_by_one(|k| guard.check(k))
                });
                bench_chunks(&mut group, id("guard-reader-check"), keys, threads, || {
                    let mut reader = guard.reader();
                    one_by_one(move |k| reader.check(k))
                });
            }
        }
        bench_chunks(
            &mut group,
            "absent/1T/guard-check-3-generations".into(),
            &absent_slices,
            1,
            || one_by_one(|k| rotating.check(k)),
        );
        bench_chunks(
            &mut group,
            "absent/1T/raw-contains-many".into(),
            &absent_slices,
            1,
            || raw_batches(raw),
        );
        bench_chunks(
            &mut group,
            "absent/1T/guard-check-many".into(),
            &absent_slices,
            1,
            || guard_batches(&guard),
        );
        bench_inserts(
            &mut group,
            "insert/1T/raw-insert".into(),
            &present_slices,
            1,
            AtomicBloom::new(n as u64, TARGET_FPR).unwrap(),
            |filter| *filter = AtomicBloom::new(n as u64, TARGET_FPR).unwrap(),
            |filter, key| {
                filter.insert(key);
            },
        );
        bench_inserts(
            &mut group,
            "insert/1T/guard-insert".into(),
            &present_slices,
            1,
            Guard::builder().expected_items(n as u64).build().unwrap(),
            |guard| *guard = Guard::builder().expected_items(n as u64).build().unwrap(),
            |guard, key| guard.insert(key),
        );
        // A rotating guard's insert looks at its live set again after writing
        // (an insert stalled across two rotations must still land in the window).
        let rotating_guard = || {
            Guard::builder()
                .expected_items(n as u64)
                .lifecycle(Lifecycle::rotate(3, Duration::from_secs(3600)))
                .build()
                .unwrap()
        };
        bench_inserts(
            &mut group,
            "insert/1T/guard-insert-3-generations".into(),
            &present_slices,
            1,
            rotating_guard(),
            |guard| *guard = rotating_guard(),
            |guard, key| guard.insert(key),
        );
        group.finish();
        let mix = KeySet::mixed(&present, &absent, PRESENT_PER_100, absent.len());
        bench_paths(&mut criterion, n, &mix.slices(), &present_slices, &guard);
    }
    criterion.final_summary();
    let table = overhead.join("\n");
    println!("\nInterleaved, single thread ({ROUNDS} rounds of {BLOCK} keys, medians):\n{table}");
    let path = std::path::Path::new("target/criterion/guard-overhead.md");
    if let Err(error) = std::fs::write(path, table + "\n") {
        eprintln!("cannot write {}: {error}", path.display());
    }
}
