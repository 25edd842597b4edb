//! The seen-items gate: "has this user already seen this item?", answered by an
//! `AtomicBloom` in front of the store, so that only "maybe" answers cost a lookup.
//!
//! ```text
//! cargo run --release --example seen_items
//! ```
//!
//! The store here is an embedded in-memory set. (The guard with background
//! rebuilds, the tower layer and the Redis store are being built on top of this
//! filter; this example grows with them.)

use std::collections::HashSet;
use std::time::Instant;

use bloomguard::AtomicBloom;

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

fn main() {
    if std::env::var_os("REDIS_URL").is_some() {
        eprintln!(
            "note: REDIS_URL is set, but the Redis store is not built yet; using the in-memory store"
        );
    }
    let mut rng = Rng(0x5eed);
    let (store, seen_by_user) = generate_history(&mut rng);
    println!(
        "history: {} users, {} seen (user, item) pairs",
        USERS,
        store.len()
    );

    let started = Instant::now();
    let filter = AtomicBloom::new(store.len() as u64, TARGET_FPR).expect("valid parameters");
    for key in &store {
        filter.insert(key);
    }
    println!("filter built from the store in {:.1?}", started.elapsed());

    // Replay feed requests: each checks 120 candidates, 97 % of them unseen.
    let mut candidates = Vec::with_capacity(CANDIDATES_PER_REQUEST as usize);
    let mut found = vec![false; CANDIDATES_PER_REQUEST as usize];
    let (mut checks, mut backend_calls, mut false_positives, mut unseen) = (0u64, 0u64, 0u64, 0u64);
    let mut gate_time = std::time::Duration::ZERO;
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
        filter.contains_many(&candidates, &mut found);
        gate_time += gate.elapsed();
        for (key, &maybe) in candidates.iter().zip(&found) {
            checks += 1;
            let really_seen = store.contains(key);
            assert!(
                maybe || !really_seen,
                "false negative for {key}: the one rule broke"
            );
            unseen += u64::from(!really_seen);
            if maybe {
                backend_calls += 1;
                false_positives += u64::from(!really_seen);
            }
        }
    }

    let stats = filter.stats();
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
        format!("{:.1} MiB", filter.memory_bytes() as f64 / (1 << 20) as f64)
    );
    println!(
        "\nfilter: {} bits, k = {}, fill {:.3}, estimated items {:.0}, estimated FPR {:.3}%",
        stats.bits,
        stats.k,
        stats.fill_ratio,
        stats.estimated_items,
        100.0 * stats.estimated_fpr
    );
}
