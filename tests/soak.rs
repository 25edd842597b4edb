//! A bounded soak of one process: writers at full speed, readers on every
//! read path, and maintenance rebuilding and rotating as fast as its policy
//! allows. Ignored by default; `.ci/run` runs it for `BLOOMGUARD_SOAK_SECS`
//! (60 unless told):
//!
//! `BLOOMGUARD_SOAK_SECS=60 cargo test --all-features --test soak -- --ignored --nocapture`
//!
//! Judged by the one rule: a key whose store write has completed is never
//! answered `Absent` (until a rotating guard's window lets it go), no task
//! panics, and resident memory stays flat once the key space is written.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use bloomguard::{Guard, GuardLayer, Lifecycle, RebuildPolicy, Verdict, source};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};

/// Distinct keys the writers cycle through: the store stops growing once
/// all are written, so memory can be judged flat after that.
const KEY_SPACE: u64 = 200_000;
const WRITERS: u64 = 2;
const READERS: u64 = 4;
const ROTATION_PERIOD: Duration = Duration::from_millis(200);
const GENERATIONS: usize = 4;

/// Keys and when they were last inserted (the rotating guard's truth).
type Store = Arc<RwLock<HashMap<Vec<u8>, Instant>>>;

fn key(n: u64) -> Vec<u8> {
    format!("user:{}:item:{}", n % 9_973, n).into_bytes()
}

/// A small seeded generator (xorshift), one per task: deterministic draws.
struct Draws(u64);

impl Draws {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[derive(Default)]
struct Counts {
    writes: AtomicU64,
    checks: AtomicU64,
    missed_by_rebuilding: AtomicU64,
    missed_by_rotating: AtomicU64,
}

fn resident_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status");
    kib / 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "a soak of ~60 s: run by .ci/run, or by hand with --ignored"]
async fn soak_keeps_the_one_rule_and_flat_memory() {
    let seconds: u64 = std::env::var("BLOOMGUARD_SOAK_SECS")
        .ok()
        .map(|s| {
            s.parse()
                .expect("BLOOMGUARD_SOAK_SECS is a number of seconds")
        })
        .unwrap_or(60);
    let run_for = Duration::from_secs(seconds);
    let store: Store = Arc::default();
    let listed = Arc::clone(&store);
    let rebuilding = Guard::builder()
        .name("soak_rebuild")
        .expected_items(KEY_SPACE / 4)
        .source(source::from_fn(move || {
            listed.read().unwrap().keys().cloned().collect::<Vec<_>>()
        }))
        .rebuild_policy(
            RebuildPolicy::default()
                .every(Duration::from_millis(100))
                .write_settle(Duration::from_millis(5))
                .retry_backoff(Duration::from_millis(10), Duration::from_millis(50)),
        )
        .maintenance_interval(Duration::from_millis(10))
        .build()
        .unwrap();
    let rotating = Guard::builder()
        .name("soak_rotate")
        .expected_items(KEY_SPACE)
        .lifecycle(Lifecycle::rotate(GENERATIONS, ROTATION_PERIOD))
        .build()
        .unwrap();
    let maintenance = [rebuilding.spawn_maintenance(), rotating.spawn_maintenance()];
    rebuilding
        .ready_within(Duration::from_secs(30))
        .await
        .unwrap();

    let counts = Arc::new(Counts::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let (store, counts, stop) = (Arc::clone(&store), Arc::clone(&counts), Arc::clone(&stop));
        let (rebuilding, rotating) = (rebuilding.clone(), rotating.clone());
        tasks.push(tokio::spawn(async move {
            let mut draws = Draws(0x9e37_79b9 + writer);
            while !stop.load(Ordering::Relaxed) {
                let key = key(draws.next() % KEY_SPACE);
                let inserted_at = Instant::now();
                rotating.insert(&key);
                let write = async {
                    tokio::task::yield_now().await;
                    store.write().unwrap().insert(key.clone(), inserted_at);
                };
                if draws.next().is_multiple_of(2) {
                    rebuilding.insert_then_write(&key, write).await;
                } else {
                    let pending = rebuilding.begin_write(&key);
                    write.await;
                    drop(pending);
                }
                counts.writes.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for reader in 0..READERS {
        let (store, counts, stop) = (Arc::clone(&store), Arc::clone(&counts), Arc::clone(&stop));
        let (rebuilding, rotating) = (rebuilding.clone(), rotating.clone());
        tasks.push(tokio::spawn(async move {
            let mut draws = Draws(0x5eed + reader);
            let mut guard_reader = rebuilding.reader();
            let looked_up = Arc::clone(&store);
            let mut layered = GuardLayer::for_loader(rebuilding.clone()).layer(service_fn(
                move |key: Vec<u8>| {
                    let found = looked_up.read().unwrap().contains_key(&key);
                    async move { Ok::<_, Infallible>(found.then_some(())) }
                },
            ));
            let mut batch = vec![Verdict::Warming; 16];
            while !stop.load(Ordering::Relaxed) {
                let keys: Vec<Vec<u8>> = (0..16).map(|_| key(draws.next() % KEY_SPACE)).collect();
                // What the store held before the checks: every one of these
                // writes completed, so its insert happened before the checks.
                let written: Vec<Option<Instant>> = {
                    let store = store.read().unwrap();
                    keys.iter().map(|k| store.get(k).copied()).collect()
                };
                rebuilding.check_many(&keys, &mut batch);
                let (mut missed_by_rebuilding, mut missed_by_rotating) = (0, 0);
                for (i, (key, at)) in keys.iter().zip(&written).enumerate() {
                    let Some(at) = at else { continue };
                    let absent = match i % 4 {
                        0 => rebuilding.check(key).is_absent(),
                        1 => guard_reader.check(key).is_absent(),
                        2 => batch[i].is_absent(),
                        _ => {
                            let service = layered.ready().await.unwrap();
                            service.call(key.clone()).await.unwrap().is_none()
                        }
                    };
                    // The rotating guard keeps a key for at least
                    // (generations − 1) periods after its last insert. The
                    // clock is read after the check: a check that was late
                    // (a preempted thread) must not be judged by an earlier time.
                    let rotated_out = rotating.check(key).is_absent();
                    let in_window = at.elapsed() < ROTATION_PERIOD * (GENERATIONS as u32 - 1);
                    missed_by_rebuilding += u64::from(absent);
                    missed_by_rotating += u64::from(rotated_out && in_window);
                }
                counts.checks.fetch_add(32, Ordering::Relaxed);
                counts
                    .missed_by_rebuilding
                    .fetch_add(missed_by_rebuilding, Ordering::Relaxed);
                counts
                    .missed_by_rotating
                    .fetch_add(missed_by_rotating, Ordering::Relaxed);
                tokio::task::yield_now().await;
            }
        }));
    }

    // Memory, once a second; the first quarter is warm-up (the key space
    // filling the store).
    let started = Instant::now();
    let mut resident = Vec::new();
    while started.elapsed() < run_for {
        tokio::time::sleep(Duration::from_secs(1)).await;
        resident.push(resident_mib());
    }
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("no soak task panicked");
    }
    let (rebuild_stats, rotate_stats) = (rebuilding.stats(), rotating.stats());
    for handle in &maintenance {
        assert!(!handle.is_finished() && !handle.panicked());
    }
    for handle in maintenance {
        handle.shutdown().await;
    }

    let after_warm_up = &resident[resident.len() / 4..];
    let (low, high) = (
        *after_warm_up.iter().min().unwrap(),
        *after_warm_up.iter().max().unwrap(),
    );
    println!(
        "soak {seconds} s: {} writes, {} checks, {} rebuilds ({} failed), {} rotations, {} keys stored",
        counts.writes.load(Ordering::Relaxed),
        counts.checks.load(Ordering::Relaxed),
        rebuild_stats.rebuilds.succeeded,
        rebuild_stats.rebuilds.failed + rebuild_stats.rebuilds.timed_out,
        rotate_stats.swaps,
        store.read().unwrap().len(),
    );
    println!("soak resident MiB, once a second: {resident:?}");
    assert_eq!(
        (
            counts.missed_by_rebuilding.load(Ordering::Relaxed),
            counts.missed_by_rotating.load(Ordering::Relaxed)
        ),
        (0, 0),
        "false negatives (rebuilding guard, rotating guard)"
    );
    // That the soak wrote, rebuilt and rotated at all; how much depends on
    // the machine, and the totals are printed above.
    assert!(counts.writes.load(Ordering::Relaxed) > 0);
    assert!(rebuild_stats.rebuilds.succeeded > 0, "{rebuild_stats:?}");
    assert!(rotate_stats.swaps > 0, "{rotate_stats:?}");
    assert!(
        high - low <= 64,
        "resident memory moved {low} → {high} MiB after warm-up: {resident:?}"
    );
}
