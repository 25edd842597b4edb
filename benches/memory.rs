//! Past the last-level cache (issue #16): a filter many times the cache
//! (1,000M keys by default, about 1.2 GB at 1 %), where every absent probe
//! is a trip to memory. Per thread count, the batch and single-key queries
//! beside fastbloom's, and, over a buffer of the same size in the same run,
//! the memory system's own limits:
//! - `memory-dependent-load`: a pointer chase through one random cycle over
//!   every line of the buffer, so each load waits for the one before (the
//!   latency of a miss, reported as loads per second);
//! - `memory-random-line-reads`: loads of random lines that do not depend on
//!   each other, so the core keeps as many in flight as it can: the best
//!   rate a query that touches one line per key can reach.
//!
//! ```text
//! cargo bench --bench memory      # 1,000M keys: 2 filters + the buffer, ~3.6 GB; ~3 minutes on 2 cores
//! BLOOMGUARD_BENCH_SIZES=100M BLOOMGUARD_BENCH_THREADS=1,2,4,8,16 cargo bench --bench memory
//! python3 benches/summary.py memory
//! ```
//!
//! Both filters are filled with the same keys (the numbers `0..n` as 8
//! little-endian bytes, hashed with xxh3) on every core, then probed with 4M
//! absent keys of the usual shape; fastbloom is fed xxh3 through
//! `insert_hash`/`contains_hash`, its fastest configuration.

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use bloomguard::Guard;
use common::{
    KeySet, bench_chunks, bench_sizes, guard_batches, label, one_by_one, raw_batches, thread_counts,
};
use criterion::{Criterion, SamplingMode};
use rand::{Rng as _, SeedableRng};
use rand_chacha::ChaCha8Rng;
use xxhash_rust::xxh3::xxh3_64;

const TARGET_FPR: f64 = 0.01;
const PROBES: usize = 4_000_000;
const LINE_WORDS: usize = 64 / size_of::<u64>();

/// Runs `fill` on the ranges of `0..n` split over every core.
fn fill_on_every_core(n: usize, fill: impl Fn(std::ops::Range<u64>) + Sync) {
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    let span = n.div_ceil(cores) as u64;
    std::thread::scope(|s| {
        for core in 0..cores as u64 {
            let fill = &fill;
            let range = core * span..((core + 1) * span).min(n as u64);
            s.spawn(move || fill(range));
        }
    });
}

/// A buffer of `lines` cache lines whose first words link every line into
/// one random cycle (Sattolo's shuffle), so a walk visits them all before
/// it repeats and no prefetcher can guess the next one.
fn random_cycle(lines: usize, rng: &mut ChaCha8Rng) -> Vec<u64> {
    let mut next: Vec<u32> = (0..u32::try_from(lines).expect("lines fit in u32")).collect();
    for i in (1..lines).rev() {
        next.swap(i, rng.random_range(0..i));
    }
    let mut buffer = vec![0u64; lines * LINE_WORDS];
    for (line, &to) in next.iter().enumerate() {
        buffer[line * LINE_WORDS] = u64::from(to);
    }
    buffer
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    let probes = KeySet::generate("absent", PROBES, 2);
    let probes = probes.slices();
    for n in bench_sizes("1000M") {
        let started = Instant::now();
        let guard = Guard::builder()
            .expected_items(n as u64)
            .false_positive_rate(TARGET_FPR)
            .build()
            .unwrap();
        let live = guard.live_filters();
        let raw = live
            .newest()
            .expect("a guard without a source has a filter");
        let fastbloom = fastbloom::AtomicBloomFilter::with_false_pos(TARGET_FPR).expected_items(n);
        fill_on_every_core(n, |range| {
            let mut keys = Vec::with_capacity(4096);
            for first in range.clone().step_by(4096) {
                keys.clear();
                keys.extend((first..(first + 4096).min(range.end)).map(u64::to_le_bytes));
                raw.insert_many(&keys);
                for key in &keys {
                    fastbloom.insert_hash(xxh3_64(key));
                }
            }
        });
        let lines = raw.memory_bytes() / 64;
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let buffer = random_cycle(lines, &mut rng);
        let random_lines: Vec<u32> = (0..PROBES)
            .map(|_| rng.random_range(0..lines as u32))
            .collect();
        eprintln!(
            "n={}: bloomguard {:.2} GB (k = {}), fastbloom {:.2} GB (k = {}), buffer {:.2} GB; set up in {:.0?}",
            label(n),
            raw.memory_bytes() as f64 / 1e9,
            raw.k(),
            fastbloom.num_bits() as f64 / 8e9,
            fastbloom.num_hashes(),
            (buffer.len() * 8) as f64 / 1e9,
            started.elapsed(),
        );

        let mut group = criterion.benchmark_group(format!("memory/n={}", label(n)));
        group
            .sampling_mode(SamplingMode::Flat)
            .sample_size(20)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
        let (buffer, fastbloom, guard) = (&buffer, &fastbloom, &guard);
        for threads in thread_counts() {
            let id = |path: &str| format!("{path}/{threads}T");
            bench_chunks(
                &mut group,
                id("memory-dependent-load"),
                &random_lines,
                threads,
                || {
                    let mut at = None;
                    move |chunk: &[u32]| {
                        let mut line = at.unwrap_or(chunk[0] as usize);
                        for _ in chunk {
                            line = buffer[line * LINE_WORDS] as usize;
                        }
                        at = Some(black_box(line));
                    }
                },
            );
            bench_chunks(
                &mut group,
                id("memory-random-line-reads"),
                &random_lines,
                threads,
                || {
                    move |chunk: &[u32]| {
                        let mut sum = 0u64;
                        for &line in chunk {
                            sum = sum.wrapping_add(buffer[line as usize * LINE_WORDS]);
                        }
                        black_box(sum);
                    }
                },
            );
            bench_chunks(
                &mut group,
                id("fastbloom-contains-xxh3"),
                &probes,
                threads,
                || one_by_one(|k| fastbloom.contains_hash(xxh3_64(k))),
            );
            bench_chunks(&mut group, id("raw-contains"), &probes, threads, || {
                one_by_one(|k| raw.contains(k))
            });
            bench_chunks(
                &mut group,
                id("raw-contains-many"),
                &probes,
                threads,
                || raw_batches(raw),
            );
            bench_chunks(&mut group, id("guard-check-many"), &probes, threads, || {
                guard_batches(guard)
            });
        }
        group.finish();
    }
    criterion.final_summary();
}
