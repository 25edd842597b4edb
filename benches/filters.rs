//! `AtomicBloom` against the Rust Bloom filters people reach for, in one run.
//!
//! ```text
//! cargo bench --bench filters                              # n = 1M, 10M, 32M
//! BLOOMGUARD_BENCH_SIZES=1M cargo bench --bench filters    # a quick look
//! BLOOMGUARD_BENCH_THREADS=1,4,8,16 cargo bench --bench filters -- threads/  # where the cores exist
//! ```
//!
//! Every contender is sized for the same target FPR (1 %) and sees the same keys
//! (16–40 bytes). Each timed iteration handles 64 keys, so ns/key is the
//! reported time divided by 64. Before the timings, a table of bits/key and
//! measured FPR (1M never-inserted probes) is printed and written to
//! `target/criterion/filters-accuracy.md`.

use std::hint::black_box;
use std::sync::RwLock;
use std::time::{Duration, Instant};

mod common;

use bloomguard::AtomicBloom;
use common::{CHUNK, KeySet, bench_sizes, label, thread_counts, wall_time_of};
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput, measurement::WallTime};
use xxhash_rust::xxh3::xxh3_64;

const TARGET_FPR: f64 = 0.01;
const ABSENT_KEYS: usize = 4_000_000;
const FPR_PROBES: usize = 1_000_000;

// ---- contenders ----

trait Contender: Sync {
    fn build(n: usize) -> Self;
    fn insert(&mut self, key: &[u8]);
    fn contains(&self, key: &[u8]) -> bool;
    fn clear(&mut self);
    fn bits(&self) -> u64;
}

struct Bloomguard(AtomicBloom);
impl Contender for Bloomguard {
    fn build(n: usize) -> Self {
        Self(AtomicBloom::new(n as u64, TARGET_FPR).unwrap())
    }
    fn insert(&mut self, key: &[u8]) {
        self.0.insert(key);
    }
    fn contains(&self, key: &[u8]) -> bool {
        self.0.contains(key)
    }
    fn clear(&mut self) {
        self.0.clear();
    }
    fn bits(&self) -> u64 {
        self.0.bits()
    }
}

/// fastbloom's lock-free filter with its default hasher (SipHash-1-3).
struct FastbloomAtomicSip(fastbloom::AtomicBloomFilter);
impl Contender for FastbloomAtomicSip {
    fn build(n: usize) -> Self {
        Self(fastbloom::AtomicBloomFilter::with_false_pos(TARGET_FPR).expected_items(n))
    }
    fn insert(&mut self, key: &[u8]) {
        self.0.insert(key);
    }
    fn contains(&self, key: &[u8]) -> bool {
        self.0.contains(key)
    }
    fn clear(&mut self) {
        self.0.clear();
    }
    fn bits(&self) -> u64 {
        self.0.num_bits() as u64
    }
}

/// fastbloom's lock-free filter fed a one-shot xxh3 source hash: its fastest configuration.
struct FastbloomAtomicXxh3(fastbloom::AtomicBloomFilter);
impl Contender for FastbloomAtomicXxh3 {
    fn build(n: usize) -> Self {
        Self(fastbloom::AtomicBloomFilter::with_false_pos(TARGET_FPR).expected_items(n))
    }
    fn insert(&mut self, key: &[u8]) {
        self.0.insert_hash(xxh3_64(key));
    }
    fn contains(&self, key: &[u8]) -> bool {
        self.0.contains_hash(xxh3_64(key))
    }
    fn clear(&mut self) {
        self.0.clear();
    }
    fn bits(&self) -> u64 {
        self.0.num_bits() as u64
    }
}

/// fastbloom's single-threaded filter, xxh3 source hash.
struct FastbloomXxh3(fastbloom::BloomFilter);
impl Contender for FastbloomXxh3 {
    fn build(n: usize) -> Self {
        Self(fastbloom::BloomFilter::with_false_pos(TARGET_FPR).expected_items(n))
    }
    fn insert(&mut self, key: &[u8]) {
        self.0.insert_hash(xxh3_64(key));
    }
    fn contains(&self, key: &[u8]) -> bool {
        self.0.contains_hash(xxh3_64(key))
    }
    fn clear(&mut self) {
        self.0.clear();
    }
    fn bits(&self) -> u64 {
        self.0.num_bits() as u64
    }
}

/// The `bloomfilter` crate, as most code uses it.
struct BloomfilterCrate(bloomfilter::Bloom<[u8]>);
impl Contender for BloomfilterCrate {
    fn build(n: usize) -> Self {
        Self(bloomfilter::Bloom::new_for_fp_rate(n, TARGET_FPR).unwrap())
    }
    fn insert(&mut self, key: &[u8]) {
        self.0.set(key);
    }
    fn contains(&self, key: &[u8]) -> bool {
        self.0.check(key)
    }
    fn clear(&mut self) {
        self.0.clear();
    }
    fn bits(&self) -> u64 {
        self.0.len()
    }
}

/// Parquet's split-block filter with SIMD, at 10 bits/key (it takes no FPR target).
struct SbbfXxh3(sbbf_rs_safe::Filter);
impl Contender for SbbfXxh3 {
    fn build(n: usize) -> Self {
        Self(sbbf_rs_safe::Filter::new(10, n))
    }
    fn insert(&mut self, key: &[u8]) {
        self.0.insert_hash(xxh3_64(key));
    }
    fn contains(&self, key: &[u8]) -> bool {
        self.0.contains_hash(xxh3_64(key))
    }
    fn clear(&mut self) {
        self.0.reset();
    }
    fn bits(&self) -> u64 {
        self.0.as_bytes().len() as u64 * 8
    }
}

/// The design most articles show: a bit vector behind an `RwLock`, FNV-1a,
/// double hashing `h1 + i·h2`, textbook size and k.
struct RwLockFnv {
    bits: RwLock<Vec<u64>>,
    num_bits: u64,
    k: u32,
}

impl RwLockFnv {
    fn fnv1a(key: &[u8]) -> u64 {
        key.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
    }

    fn positions(&self, key: &[u8]) -> impl Iterator<Item = u64> + use<> {
        let h = Self::fnv1a(key);
        let (h1, h2) = (h & 0xffff_ffff, (h >> 32) | 1);
        let m = self.num_bits;
        (0..u64::from(self.k)).map(move |i| (h1.wrapping_add(i.wrapping_mul(h2))) % m)
    }
}

impl Contender for RwLockFnv {
    fn build(n: usize) -> Self {
        let ln2 = std::f64::consts::LN_2;
        let num_bits = (-(n as f64) * TARGET_FPR.ln() / (ln2 * ln2)).ceil() as u64;
        let k = ((num_bits as f64 / n as f64) * ln2).round() as u32;
        Self {
            bits: RwLock::new(vec![0; num_bits.div_ceil(64) as usize]),
            num_bits,
            k,
        }
    }
    fn insert(&mut self, key: &[u8]) {
        // Hashed under the lock: collecting the positions first cost this
        // contender an allocation per insert that the others do not make.
        let mut bits = self.bits.write().unwrap();
        for p in self.positions(key) {
            bits[(p / 64) as usize] |= 1 << (p % 64);
        }
    }
    fn contains(&self, key: &[u8]) -> bool {
        let bits = self.bits.read().unwrap();
        self.positions(key)
            .all(|p| bits[(p / 64) as usize] & (1 << (p % 64)) != 0)
    }
    fn clear(&mut self) {
        self.bits.write().unwrap().fill(0);
    }
    fn bits(&self) -> u64 {
        self.num_bits
    }
}

// ---- harness ----

struct Workload {
    n: usize,
    present: KeySet,
    absent: KeySet,
}

fn filled<C: Contender>(workload: &Workload) -> C {
    let mut filter = C::build(workload.n);
    for i in 0..workload.present.len() {
        filter.insert(workload.present.get(i));
    }
    filter
}

fn accuracy_row<C: Contender>(name: &str, workload: &Workload, filter: &C) -> String {
    let probes = FPR_PROBES.min(workload.absent.len());
    let hits = (0..probes)
        .filter(|&i| filter.contains(workload.absent.get(i)))
        .count();
    format!(
        "| {name} | {} | {:.2} | {:.3} % |",
        workload.n,
        filter.bits() as f64 / workload.n as f64,
        100.0 * hits as f64 / probes as f64
    )
}

/// Average insert cost over a filter's whole life, from empty to full: keys go
/// in order, and the filter is cleared (untimed) whenever all n are in.
fn bench_insert<C: Contender>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    workload: &Workload,
) {
    let mut filter = C::build(workload.n);
    let mut next = 0;
    group.bench_function(format!("insert/{name}"), |b| {
        b.iter_custom(|iters| {
            let mut elapsed = Duration::ZERO;
            for _ in 0..iters {
                if next + CHUNK > workload.present.len() {
                    filter.clear();
                    next = 0;
                }
                let start = Instant::now();
                for i in next..next + CHUNK {
                    filter.insert(black_box(workload.present.get(i)));
                }
                elapsed += start.elapsed();
                next += CHUNK;
            }
            elapsed
        })
    });
}

fn bench_query<C: Contender>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    filter: &C,
    keys: &KeySet,
    what: &str,
) {
    let mut next = 0;
    group.bench_function(format!("{what}/{name}"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                if next + CHUNK > keys.len() {
                    next = 0;
                }
                for i in next..next + CHUNK {
                    black_box(filter.contains(black_box(keys.get(i))));
                }
                next += CHUNK;
            }
            start.elapsed()
        })
    });
}

fn bench_batch_query(
    group: &mut BenchmarkGroup<'_, WallTime>,
    filter: &AtomicBloom,
    keys: &[&[u8]],
    what: &str,
) {
    let mut next = 0;
    let mut found = [false; CHUNK];
    group.bench_function(format!("{what}/bloomguard-batch"), |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                if next + CHUNK > keys.len() {
                    next = 0;
                }
                filter.contains_many(black_box(&keys[next..next + CHUNK]), &mut found);
                black_box(&found);
                next += CHUNK;
            }
            start.elapsed()
        })
    });
}

fn bench_batch_insert(group: &mut BenchmarkGroup<'_, WallTime>, workload: &Workload) {
    let mut filter = Bloomguard::build(workload.n).0;
    let keys = workload.present.slices();
    let mut next = 0;
    group.bench_function("insert/bloomguard-batch", |b| {
        b.iter_custom(|iters| {
            let mut elapsed = Duration::ZERO;
            for _ in 0..iters {
                if next + CHUNK > keys.len() {
                    filter.clear();
                    next = 0;
                }
                let start = Instant::now();
                black_box(filter.insert_many(black_box(&keys[next..next + CHUNK])));
                elapsed += start.elapsed();
                next += CHUNK;
            }
            elapsed
        })
    });
}

/// Runs insert and query benchmarks for one contender and returns its accuracy row.
fn bench_contender<C: Contender>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    workload: &Workload,
) -> String {
    bench_insert::<C>(group, name, workload);
    let filter = filled::<C>(workload);
    bench_query(group, name, &filter, &workload.present, "present");
    bench_query(group, name, &filter, &workload.absent, "absent");
    accuracy_row(name, workload, &filter)
}

fn single_thread(c: &mut Criterion, workload: &Workload, accuracy: &mut Vec<String>) {
    let mut group = c.benchmark_group(format!("n={}", label(workload.n)));
    group
        .throughput(Throughput::Elements(CHUNK as u64))
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));

    accuracy.push(bench_contender::<Bloomguard>(
        &mut group,
        "bloomguard",
        workload,
    ));
    bench_batch_insert(&mut group, workload);
    let filter = filled::<Bloomguard>(workload).0;
    bench_batch_query(&mut group, &filter, &workload.present.slices(), "present");
    bench_batch_query(&mut group, &filter, &workload.absent.slices(), "absent");
    drop(filter);
    accuracy.push(bench_contender::<FastbloomAtomicXxh3>(
        &mut group,
        "fastbloom-atomic-xxh3",
        workload,
    ));
    accuracy.push(bench_contender::<FastbloomAtomicSip>(
        &mut group,
        "fastbloom-atomic-sip",
        workload,
    ));
    accuracy.push(bench_contender::<FastbloomXxh3>(
        &mut group,
        "fastbloom-xxh3",
        workload,
    ));
    accuracy.push(bench_contender::<SbbfXxh3>(
        &mut group,
        "sbbf-rs-xxh3",
        workload,
    ));
    accuracy.push(bench_contender::<BloomfilterCrate>(
        &mut group,
        "bloomfilter",
        workload,
    ));
    accuracy.push(bench_contender::<RwLockFnv>(
        &mut group,
        "rwlock-fnv",
        workload,
    ));
    group.finish();
}

/// Aggregate query throughput of threads sharing one filter, half present and
/// half absent keys, each thread on its own stretch of keys.
fn bench_threads<C: Contender>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    filter: &C,
    workload: &Workload,
    threads: usize,
) {
    group.throughput(Throughput::Elements((CHUNK * threads) as u64));
    // Chunks run so far in each thread's stretch: a sample goes on where
    // the last stopped, as in `common::bench_chunks`.
    let mut done = 0usize;
    group.bench_function(format!("{threads}T/{name}"), |b| {
        b.iter_custom(|iters| {
            let span = workload.present.len().min(workload.absent.len()) / threads;
            let from = done % (span / CHUNK).max(1) * CHUNK;
            done += iters as usize;
            wall_time_of(
                threads,
                |t| t,
                |t| {
                    let mut next = t * span + from;
                    let start = Instant::now();
                    for round in 0..iters as usize {
                        let keys = if round % 2 == 0 {
                            &workload.present
                        } else {
                            &workload.absent
                        };
                        if next + CHUNK > (t + 1) * span {
                            next = t * span;
                        }
                        for i in next..next + CHUNK {
                            black_box(filter.contains(keys.get(i)));
                        }
                        next += CHUNK;
                    }
                    start.elapsed()
                },
            )
        })
    });
}

fn multi_thread(c: &mut Criterion, workload: &Workload) {
    let mut group = c.benchmark_group(format!("threads/n={}", label(workload.n)));
    group
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let bloomguard = filled::<Bloomguard>(workload);
    let fastbloom = filled::<FastbloomAtomicXxh3>(workload);
    let rwlock = filled::<RwLockFnv>(workload);
    for threads in thread_counts() {
        bench_threads(&mut group, "bloomguard", &bloomguard, workload, threads);
        bench_threads(
            &mut group,
            "fastbloom-atomic-xxh3",
            &fastbloom,
            workload,
            threads,
        );
        bench_threads(&mut group, "rwlock-fnv", &rwlock, workload, threads);
    }
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    let mut accuracy = vec![
        "| contender | n | bits/key | measured FPR |".to_string(),
        "|---|---:|---:|---:|".to_string(),
    ];
    let mut absent = KeySet::generate("absent", ABSENT_KEYS, 2);
    for n in bench_sizes("1M,10M,32M") {
        let workload = Workload {
            n,
            present: KeySet::generate("user", n, 1),
            absent,
        };
        single_thread(&mut criterion, &workload, &mut accuracy);
        if n == 10_000_000 || bench_sizes("1M,10M,32M").len() == 1 {
            multi_thread(&mut criterion, &workload);
        }
        absent = workload.absent;
    }
    criterion.final_summary();
    let table = accuracy.join("\n");
    println!("\n{table}");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("target/criterion/filters-accuracy.md");
    if std::fs::create_dir_all(path.parent().unwrap()).is_ok() {
        let _ = std::fs::write(&path, table + "\n");
    }
}
