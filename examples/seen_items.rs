//! The seen-items gate: "has this user already seen this item?", answered by a
//! `Guard` in front of the store, so that only "maybe" answers cost a lookup.
//!
//! ```text
//! cargo run --release --features redis --example seen_items
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --release --features redis --example seen_items
//! ```
//!
//! The store is an embedded in-memory set, or a real Redis when `REDIS_URL`
//! is set (and the `redis` feature is on): the history is written there under
//! `bloomguard:seen:`, the guard's first build SCANs it back, and the "maybe"
//! candidates of each request are verified with one MGET. Either way every
//! answer is checked against the generated history: a false negative stops
//! the run. (Issue #6 grows this into the full demo: Zipf workloads, a
//! report with latency, the lifecycle over time, a picture.)

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use bloomguard::{Guard, Rebuild, Verdict, source};

const USERS: u64 = 20_000;
const ITEMS: u64 = 500_000;
const REQUESTS: u64 = 20_000;
const CANDIDATES_PER_REQUEST: u64 = 120;
const NEGATIVE_RATIO: f64 = 0.97;
const TARGET_FPR: f64 = 0.01;

/// SplitMix64: a seeded generator, so every run replays the same history.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next()) * u128::from(bound)) >> 64) as u64
    }

    /// Skewed towards small values, as activity and popularity are.
    fn skewed_below(&mut self, bound: u64) -> u64 {
        let uniform = self.next() as f64 / u64::MAX as f64;
        ((uniform.powi(3) * bound as f64) as u64).min(bound - 1)
    }
}

fn seen_key(user: u64, item: u64) -> String {
    format!("user:{user}:item:{item}")
}

/// The exact store and, per user, the items they saw (to draw positives from).
fn generate_history(rng: &mut Rng) -> (HashSet<String>, Vec<Vec<u64>>) {
    let mut store = HashSet::new();
    let mut seen_by_user = vec![Vec::new(); USERS as usize];
    for (user, seen) in seen_by_user.iter_mut().enumerate() {
        let activity = 5 + rng.skewed_below(400);
        for _ in 0..activity {
            let item = rng.skewed_below(ITEMS);
            if store.insert(seen_key(user as u64, item)) {
                seen.push(item);
            }
        }
    }
    (store, seen_by_user)
}

/// Where the seen history lives.
enum Store {
    Memory(Arc<HashSet<String>>),
    #[cfg(feature = "redis")]
    Redis(bloomguard::redis::RedisLoader),
}

/// Redis keys are `REDIS_PREFIX + user:…:item:…`.
#[cfg(feature = "redis")]
const REDIS_PREFIX: &str = "bloomguard:seen:";

impl Store {
    /// The store the environment asks for, with the guard reading it.
    async fn open(
        history: &Arc<HashSet<String>>,
    ) -> Result<(Self, Guard), Box<dyn std::error::Error>> {
        let builder = Guard::builder()
            .name("seen_items")
            .expected_items(history.len() as u64)
            .false_positive_rate(TARGET_FPR)
            .rebuild(Rebuild::manual().write_settle(std::time::Duration::ZERO));
        if let Ok(url) = std::env::var("REDIS_URL") {
            #[cfg(feature = "redis")]
            {
                use bloomguard::redis::{RedisLoader, RedisSource};
                let client = redis::Client::open(url.as_str())?;
                let mut connection = client.get_multiplexed_async_connection().await?;
                let keys: Vec<&String> = history.iter().collect();
                for chunk in keys.chunks(10_000) {
                    let mut command = redis::cmd("MSET");
                    for key in chunk {
                        command.arg(format!("{REDIS_PREFIX}{key}")).arg(1);
                    }
                    let () = command.query_async(&mut connection).await?;
                }
                println!(
                    "store: Redis at {url} ({} keys written under {REDIS_PREFIX})",
                    keys.len()
                );
                let source = RedisSource::new(client.clone(), format!("{REDIS_PREFIX}*"))
                    .strip_prefix(REDIS_PREFIX);
                let loader = RedisLoader::new(client).prefix(REDIS_PREFIX);
                return Ok((Self::Redis(loader), builder.source(source).build()?));
            }
            #[cfg(not(feature = "redis"))]
            eprintln!(
                "note: REDIS_URL={url} is set, but the `redis` feature is off; using the in-memory store"
            );
        }
        println!("store: in-memory set");
        let listed = Arc::clone(history);
        let source = source::from_fn(move || listed.iter().cloned().collect::<Vec<_>>());
        Ok((
            Self::Memory(Arc::clone(history)),
            builder.source(source).build()?,
        ))
    }

    /// Which of `keys` the store holds: one lookup each in memory, one MGET for Redis.
    async fn contains_many(
        &self,
        keys: &[&String],
    ) -> Result<Vec<bool>, Box<dyn std::error::Error>> {
        match self {
            Self::Memory(set) => Ok(keys.iter().map(|key| set.contains(*key)).collect()),
            #[cfg(feature = "redis")]
            Self::Redis(loader) => Ok(loader
                .get_many(keys)
                .await?
                .into_iter()
                .map(|value| value.is_some())
                .collect()),
        }
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = Rng(0x5eed);
    let (history, seen_by_user) = generate_history(&mut rng);
    let history = Arc::new(history);
    println!(
        "history: {} users, {} seen (user, item) pairs",
        USERS,
        history.len()
    );

    let (store, guard) = Store::open(&history).await?;
    let started = Instant::now();
    let report = guard.rebuild().await?;
    println!(
        "guard built from the store in {:.1?} ({} keys)",
        started.elapsed(),
        report.keys
    );

    // Replay feed requests: each checks 120 candidates, 97 % of them unseen.
    let mut candidates = Vec::with_capacity(CANDIDATES_PER_REQUEST as usize);
    let mut verdicts = vec![Verdict::Warming; CANDIDATES_PER_REQUEST as usize];
    let (mut checks, mut backend_calls, mut false_positives, mut unseen) = (0u64, 0u64, 0u64, 0u64);
    let mut gate_time = std::time::Duration::ZERO;
    let replay_started = Instant::now();
    for _ in 0..REQUESTS {
        let user = rng.below(USERS);
        let seen = &seen_by_user[user as usize];
        candidates.clear();
        for _ in 0..CANDIDATES_PER_REQUEST {
            let positive = !seen.is_empty() && rng.next() as f64 / u64::MAX as f64 > NEGATIVE_RATIO;
            let item = if positive {
                seen[rng.below(seen.len() as u64) as usize]
            } else {
                rng.below(ITEMS)
            };
            candidates.push(seen_key(user, item));
        }
        let gate = Instant::now();
        guard.check_many(&candidates, &mut verdicts);
        gate_time += gate.elapsed();
        let maybe: Vec<&String> = candidates
            .iter()
            .zip(&verdicts)
            .filter(|(_, verdict)| !verdict.is_absent())
            .map(|(key, _)| key)
            .collect();
        let in_store = store.contains_many(&maybe).await?;
        for (key, found) in maybe.iter().zip(&in_store) {
            guard.record_outcome(key, *found);
        }
        for (key, verdict) in candidates.iter().zip(&verdicts) {
            checks += 1;
            let really_seen = history.contains(key);
            assert!(
                !verdict.is_absent() || !really_seen,
                "false negative for {key}: the one rule broke"
            );
            unseen += u64::from(!really_seen);
            if !verdict.is_absent() {
                backend_calls += 1;
                false_positives += u64::from(!really_seen);
            }
        }
    }
    let replay_time = replay_started.elapsed();

    let stats = guard.stats();
    let filter_bytes = stats.memory_bytes;
    let store = history;
    let set_bytes: usize = store.iter().map(|k| k.len()).sum::<usize>()
        + store.capacity() * (std::mem::size_of::<String>() + 1);
    println!("\n{:<34} {:>14} {:>14}", "", "no filter", "with filter");
    println!("{:<34} {:>14} {:>14}", "checks", checks, checks);
    println!(
        "{:<34} {:>14} {:>14}",
        "backend lookups", checks, backend_calls
    );
    println!(
        "{:<34} {:>14.2} {:>14.2}",
        "backend lookups per request",
        CANDIDATES_PER_REQUEST as f64,
        backend_calls as f64 / REQUESTS as f64
    );
    println!(
        "{:<34} {:>14} {:>13.1}%",
        "backend lookups avoided",
        "-",
        100.0 * (1.0 - backend_calls as f64 / checks as f64)
    );
    println!(
        "{:<34} {:>14} {:>13.3}%",
        "observed FPR (target 1 %)",
        "-",
        100.0 * false_positives as f64 / unseen as f64
    );
    println!(
        "{:<34} {:>14} {:>14.1}",
        "filter checks per second (M)",
        "-",
        checks as f64 / gate_time.as_secs_f64() / 1e6
    );
    println!(
        "{:<34} {:>14} {:>14}",
        "memory (exact HashSet vs filter)",
        format!("{:.1} MiB", set_bytes as f64 / (1 << 20) as f64),
        format!("{:.1} MiB", filter_bytes as f64 / (1 << 20) as f64)
    );
    println!(
        "{:<34} {:>14} {:>14.0}",
        "requests per second (end to end)",
        "-",
        REQUESTS as f64 / replay_time.as_secs_f64()
    );
    println!(
        "\nguard: fill {:.3}, estimated items {:.0}, estimated FPR {:.3}%, observed FPR {:.3}%, pass-through {:.3}",
        stats.fill_ratio,
        stats.estimated_items,
        100.0 * stats.estimated_fpr,
        100.0 * stats.observed_fpr.unwrap_or(0.0),
        stats.pass_through_ratio
    );
    Ok(())
}
