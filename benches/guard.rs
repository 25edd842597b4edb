//! What a `Guard` adds to the filter it holds: the `ArcSwap` load and the
//! striped counting on `check`, the in-flight count on `insert`.
//!
//! ```text
//! cargo bench --bench guard                                   # n = 1M, 10M; 1 and 2 threads
//! BLOOMGUARD_BENCH_THREADS=1,2,4,8,16 cargo bench --bench guard
//! ```
//!
//! The raw paths call `AtomicBloom` directly on the guard's own filter (1 %
//! FPR), so both sides probe the same memory. Each timed iteration handles 64 keys per thread. Before the
//! criterion runs, an interleaved measurement of the single-thread paths is
//! printed at the end and written to `target/criterion/guard-overhead.md`.

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use bloomguard::{AtomicBloom, Guard, Lifecycle, Verdict};
use common::{KeySet, bench_sizes, label, thread_counts};
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput, measurement::WallTime};

const TARGET_FPR: f64 = 0.01;
const CHUNK: usize = 64;
const ABSENT_KEYS: usize = 4_000_000;

/// `threads` threads each make a checker and run it over their own stretch
/// of `keys`; the iteration's time is the slowest thread's.
fn bench_checks<M, C>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: String,
    keys: &KeySet,
    threads: usize,
    make_checker: M,
) where
    M: Fn() -> C + Sync,
    C: FnMut(&[u8]) -> bool,
{
    group.throughput(Throughput::Elements((CHUNK * threads) as u64));
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            if threads == 1 {
                return run_stretch(keys, 0, keys.len(), iters, make_checker());
            }
            let barrier = std::sync::Barrier::new(threads);
            let span = keys.len() / threads;
            std::thread::scope(|s| {
                let workers: Vec<_> = (0..threads)
                    .map(|t| {
                        let (barrier, make_checker) = (&barrier, &make_checker);
                        s.spawn(move || {
                            let checker = make_checker();
                            barrier.wait();
                            run_stretch(keys, t * span, span, iters, checker)
                        })
                    })
                    .collect();
                workers
                    .into_iter()
                    .map(|w| w.join().unwrap())
                    .max()
                    .unwrap()
            })
        })
    });
}

fn run_stretch(
    keys: &KeySet,
    first: usize,
    span: usize,
    iters: u64,
    mut check: impl FnMut(&[u8]) -> bool,
) -> Duration {
    let mut next = first;
    let start = Instant::now();
    for _ in 0..iters {
        if next + CHUNK > first + span {
            next = first;
        }
        for i in next..next + CHUNK {
            black_box(check(black_box(keys.get(i))));
        }
        next += CHUNK;
    }
    start.elapsed()
}

/// `contains_many` against `check_many`, 64 keys a call.
fn bench_batches(
    group: &mut BenchmarkGroup<'_, WallTime>,
    keys: &KeySet,
    raw: &AtomicBloom,
    guard: &Guard,
) {
    group.throughput(Throughput::Elements(CHUNK as u64));
    let keys = keys.slices();
    let mut found = [false; CHUNK];
    bench_batch(group, "absent/1T/raw-contains-many", &keys, |chunk| {
        raw.contains_many(chunk, &mut found);
        black_box(&found);
    });
    let mut verdicts = [Verdict::Warming; CHUNK];
    bench_batch(group, "absent/1T/guard-check-many", &keys, |chunk| {
        guard.check_many(chunk, &mut verdicts);
        black_box(&verdicts);
    });
}

fn bench_batch(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    keys: &[&[u8]],
    mut batch: impl FnMut(&[&[u8]]),
) {
    let mut next = 0;
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                if next + CHUNK > keys.len() {
                    next = 0;
                }
                batch(black_box(&keys[next..next + CHUNK]));
                next += CHUNK;
            }
            start.elapsed()
        })
    });
}

/// Keys per timed block of the interleaved measurement.
const BLOCK: usize = 16_384;
/// Rounds of the interleaved measurement; the median of each path is kept.
const ROUNDS: usize = 301;

/// A named way to check a key.
type Path<'a> = (&'a str, &'a mut dyn FnMut(&[u8]) -> bool);

/// Runs the paths one after another, round after round, and keeps each
/// path's median ns/key. Criterion times one bench after another, so machine
/// noise (±20 % on this VM) lands on whole benches and can swamp a
/// difference of a few ns; interleaving spreads it over all paths alike, so
/// the differences between medians are what the guard adds. Every timed
/// block is a stretch of keys no path touched in the previous rounds, so no
/// path finds the filter blocks warmed by the one before it.
fn interleaved(keys: &KeySet, paths: &mut [Path<'_>]) -> Vec<f64> {
    let mut samples = vec![Vec::with_capacity(ROUNDS); paths.len()];
    let blocks = keys.len() / BLOCK;
    let mut next_block = 0;
    for _ in 0..ROUNDS {
        for ((_, check), times) in paths.iter_mut().zip(&mut samples) {
            let first = next_block % blocks * BLOCK;
            next_block += 1;
            let start = Instant::now();
            for i in first..first + BLOCK {
                black_box(check(black_box(keys.get(i))));
            }
            times.push(start.elapsed().as_nanos() as f64 / BLOCK as f64);
        }
    }
    samples
        .into_iter()
        .map(|mut times| {
            times.sort_by(f64::total_cmp);
            times[times.len() / 2]
        })
        .collect()
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
        let mut paths: [Path<'_>; 3] = [
            ("raw contains", &mut raw_path),
            ("Guard::check", &mut check_path),
            ("GuardReader::check", &mut reader_path),
        ];
        let medians = interleaved(keys, &mut paths);
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

/// Inserts in key order, restarting (untimed, on fresh filters) once all
/// keys are in, so that both see the same fill levels.
fn bench_inserts<T>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    keys: &KeySet,
    fresh: impl Fn() -> T,
    insert: impl Fn(&T, &[u8]),
) {
    group.throughput(Throughput::Elements(CHUNK as u64));
    let mut target = fresh();
    let mut next = 0;
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let mut elapsed = Duration::ZERO;
            for _ in 0..iters {
                if next + CHUNK > keys.len() {
                    target = fresh();
                    next = 0;
                }
                let start = Instant::now();
                for i in next..next + CHUNK {
                    insert(&target, black_box(keys.get(i)));
                }
                elapsed += start.elapsed();
                next += CHUNK;
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
            if (i + 1) % (n / 3) == 0 && i + 1 < n {
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
        for threads in thread_counts() {
            for (what, keys) in [("absent", &absent), ("present", &present)] {
                let id = |name: &str| format!("{what}/{threads}T/{name}");
                bench_checks(&mut group, id("raw-contains"), keys, threads, || {
                    |k: &[u8]| raw.contains(k)
                });
                bench_checks(&mut group, id("guard-check"), keys, threads, || {
                    |k: &[u8]| guard.check(k).is_absent()
                });
                bench_checks(&mut group, id("guard-reader-check"), keys, threads, || {
                    let mut reader = guard.reader();
                    move |k: &[u8]| reader.check(k).is_absent()
                });
            }
        }
        bench_checks(
            &mut group,
            "absent/1T/guard-check-3-generations".into(),
            &absent,
            1,
            || |k: &[u8]| rotating.check(k).is_absent(),
        );
        bench_batches(&mut group, &absent, raw, &guard);
        bench_inserts(
            &mut group,
            "insert/1T/raw-insert",
            &present,
            || AtomicBloom::new(n as u64, TARGET_FPR).unwrap(),
            |filter, key| {
                filter.insert(key);
            },
        );
        bench_inserts(
            &mut group,
            "insert/1T/guard-insert",
            &present,
            || Guard::builder().expected_items(n as u64).build().unwrap(),
            |guard, key| guard.insert(key),
        );
        group.finish();
    }
    criterion.final_summary();
    let table = overhead.join("\n");
    println!("\nInterleaved, single thread ({ROUNDS} rounds of {BLOCK} keys, medians):\n{table}");
    let path = std::path::Path::new("target/criterion/guard-overhead.md");
    if let Err(error) = std::fs::write(path, table + "\n") {
        eprintln!("cannot write {}: {error}", path.display());
    }
}
