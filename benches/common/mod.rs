//! Keys and settings shared by the benchmarks.

#![allow(dead_code)]

use std::hint::black_box;
use std::time::{Duration, Instant};

use bloomguard::{AtomicBloom, Guard, Verdict};
use criterion::{BenchmarkGroup, Throughput, measurement::WallTime};

/// Keys (or other work items) per timed chunk.
pub(crate) const CHUNK: usize = 64;

/// Keys stored back to back, so that walking them costs the same for everyone.
pub(crate) struct KeySet {
    bytes: Vec<u8>,
    ends: Vec<u32>,
}

impl KeySet {
    /// `count` distinct keys of 16–40 bytes, shaped like `user:…:item:…`.
    pub(crate) fn generate(prefix: &str, count: usize, seed: u64) -> Self {
        let mut bytes = Vec::with_capacity(count * 28);
        let mut ends = Vec::with_capacity(count);
        let mut state = seed;
        for i in 0..count {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let target_len = 16 + (state >> 59) as usize % 25;
            let start = bytes.len();
            bytes.extend_from_slice(format!("{prefix}:{}:item:{i}", i % 99_991).as_bytes());
            while bytes.len() - start < target_len {
                bytes.push(b'a' + (bytes.len() % 26) as u8);
            }
            ends.push(u32::try_from(bytes.len()).expect("key bytes fit in u32 offsets"));
        }
        Self { bytes, ends }
    }

    pub(crate) fn len(&self) -> usize {
        self.ends.len()
    }

    #[inline]
    pub(crate) fn get(&self, i: usize) -> &[u8] {
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.bytes[start..self.ends[i] as usize]
    }

    /// `count` keys of `absent` with, out of every 100, `present_per_100`
    /// of `present` spread among them (the seen-items mix: 3 in 100).
    pub(crate) fn mixed(
        present: &KeySet,
        absent: &KeySet,
        present_per_100: usize,
        count: usize,
    ) -> Self {
        let mut bytes = Vec::new();
        let mut ends = Vec::with_capacity(count);
        for i in 0..count {
            let key = if i % 100 < present_per_100 {
                present.get(i * 7919 % present.len())
            } else {
                absent.get(i % absent.len())
            };
            bytes.extend_from_slice(key);
            ends.push(u32::try_from(bytes.len()).expect("key bytes fit in u32 offsets"));
        }
        Self { bytes, ends }
    }

    pub(crate) fn slices(&self) -> Vec<&[u8]> {
        (0..self.len()).map(|i| self.get(i)).collect()
    }
}

pub(crate) fn label(n: usize) -> String {
    if n.is_multiple_of(1_000_000) {
        format!("{}M", n / 1_000_000)
    } else {
        n.to_string()
    }
}

/// Thread counts from `BLOOMGUARD_BENCH_THREADS` (like `1,2,4,8,16`), else 1 and 2.
pub(crate) fn thread_counts() -> Vec<usize> {
    std::env::var("BLOOMGUARD_BENCH_THREADS")
        .unwrap_or_else(|_| "1,2".into())
        .split(',')
        .map(|t| {
            t.trim()
                .parse()
                .expect("BLOOMGUARD_BENCH_THREADS: counts like 1,2,16")
        })
        .collect()
}

/// Filter sizes from `BLOOMGUARD_BENCH_SIZES` (like `1M,10M`), else `default`.
pub(crate) fn bench_sizes(default: &str) -> Vec<usize> {
    let spec = std::env::var("BLOOMGUARD_BENCH_SIZES").unwrap_or_else(|_| default.into());
    spec.split(',')
        .map(|s| {
            let s = s.trim();
            let (digits, scale) = s.strip_suffix('M').map_or((s, 1), |d| (d, 1_000_000));
            digits
                .parse::<usize>()
                .expect("BLOOMGUARD_BENCH_SIZES: counts like 1M,10M")
                * scale
        })
        .collect()
}

/// `threads` threads each make a worker and run it on 64-item chunks of
/// their own stretch of `items`; the iteration's time is their wall time.
/// Each sample goes on where the one before it stopped: restarted at the
/// first item, a sample on a filter past the cache would re-walk keys whose
/// lines the last one left in it.
pub(crate) fn bench_chunks<T, M, W>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: String,
    items: &[T],
    threads: usize,
    make_worker: M,
) where
    T: Sync,
    M: Fn() -> W + Sync,
    W: FnMut(&[T]),
{
    group.throughput(Throughput::Elements((CHUNK * threads) as u64));
    // Chunks run so far, in each thread's stretch alike.
    let mut done = 0u64;
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let from = done;
            done += iters;
            if threads == 1 {
                return run_stretch(items, from, iters, make_worker());
            }
            let span = items.len() / threads;
            wall_time_of(
                threads,
                |t| (make_worker(), &items[t * span..][..span]),
                |(worker, stretch)| run_stretch(stretch, from, iters, worker),
            )
        })
    });
}

/// Runs `threads` threads that each `prepare` (untimed), wait for the others,
/// then `run` what they prepared; returns the wall time from the first
/// thread's start to the last one's end. (The slowest thread's own time
/// would leave out a thread that started late, after another had run: work
/// done one after another would count as done at once.)
pub(crate) fn wall_time_of<P, R>(
    threads: usize,
    prepare: impl Fn(usize) -> P + Sync,
    run: impl Fn(P) -> R + Sync,
) -> Duration {
    let barrier = std::sync::Barrier::new(threads);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, prepare, run) = (&barrier, &prepare, &run);
                s.spawn(move || {
                    let prepared = prepare(t);
                    barrier.wait();
                    let start = Instant::now();
                    black_box(run(prepared));
                    (start, Instant::now())
                })
            })
            .collect();
        let spans: Vec<(Instant, Instant)> =
            workers.into_iter().map(|w| w.join().unwrap()).collect();
        let first_start = spans.iter().map(|&(start, _)| start).min().unwrap();
        let last_end = spans.iter().map(|&(_, end)| end).max().unwrap();
        last_end - first_start
    })
}

/// A worker that hands a chunk's keys to `check` one at a time.
pub(crate) fn one_by_one<R>(mut check: impl FnMut(&[u8]) -> R) -> impl FnMut(&[&[u8]]) {
    move |chunk| {
        for key in chunk {
            black_box(check(black_box(key)));
        }
    }
}

/// A worker that checks a chunk with `contains_many`.
pub(crate) fn raw_batches(raw: &AtomicBloom) -> impl FnMut(&[&[u8]]) {
    let mut found = [false; CHUNK];
    move |chunk| {
        raw.contains_many(chunk, &mut found);
        black_box(&found);
    }
}

/// A worker that checks a chunk with `check_many`.
pub(crate) fn guard_batches(guard: &Guard) -> impl FnMut(&[&[u8]]) {
    let mut verdicts = [Verdict::Warming; CHUNK];
    move |chunk| {
        guard.check_many(chunk, &mut verdicts);
        black_box(&verdicts);
    }
}

/// Runs `iters` chunks of `items`, going on from chunk `from` (round and
/// round).
fn run_stretch<T>(items: &[T], from: u64, iters: u64, mut work: impl FnMut(&[T])) -> Duration {
    let chunks = (items.len() / CHUNK).max(1) as u64;
    let mut next = (from % chunks) as usize * CHUNK;
    let start = Instant::now();
    for _ in 0..iters {
        if next + CHUNK > items.len() {
            next = 0;
        }
        work(black_box(&items[next..next + CHUNK]));
        next += CHUNK;
    }
    start.elapsed()
}

/// Keys per timed block of the interleaved measurement.
pub(crate) const BLOCK: usize = 16_384;
/// Rounds of the interleaved measurement; the median of each path is kept.
pub(crate) const ROUNDS: usize = 301;

/// A named way to check a key.
pub(crate) type Path<'a, 'k> = (&'a str, &'a mut dyn FnMut(&'k [u8]) -> bool);

/// Runs the paths one after another, round after round, and keeps each
/// path's median ns/key. Criterion times one bench after another, so machine
/// noise (±20 % on this VM) lands on whole benches and can swamp a
/// difference of a few ns; interleaving spreads it over all paths alike, so
/// the differences between medians are what the guard adds. Every timed
/// block is a stretch of keys no path touched in the previous rounds, so no
/// path finds the filter blocks warmed by the one before it.
pub(crate) fn interleaved<'k>(keys: &[&'k [u8]], paths: &mut [Path<'_, 'k>]) -> Vec<f64> {
    let mut samples = vec![Vec::with_capacity(ROUNDS); paths.len()];
    let blocks = keys.len() / BLOCK;
    let mut next_block = 0;
    for _ in 0..ROUNDS {
        for ((_, check), times) in paths.iter_mut().zip(&mut samples) {
            let first = next_block % blocks * BLOCK;
            next_block += 1;
            let start = Instant::now();
            for key in &keys[first..first + BLOCK] {
                black_box(check(black_box(key)));
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
