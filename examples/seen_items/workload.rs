//! The seen history and the feed requests: who is active, what is popular,
//! and which candidates a user has already seen.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// SplitMix64: seeded, so every run replays the same history and requests.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(s) over ranks 0..n: rank r is drawn with weight 1/(r+1)^s. Drawn by
/// binary search in the cumulative weights, so it is exact but costs ~20
/// steps; the request path draws from a pre-drawn pool instead.
#[derive(Debug)]
pub(crate) struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    pub(crate) fn new(n: u64, exponent: f64) -> Self {
        let mut total = 0.0;
        let cumulative = (1..=n)
            .map(|rank| {
                total += (rank as f64).powf(-exponent);
                total
            })
            .collect();
        Self { cumulative }
    }

    pub(crate) fn sample(&self, rng: &mut Rng) -> u64 {
        let target = rng.unit() * self.cumulative.last().copied().unwrap_or(0.0);
        self.cumulative.partition_point(|&c| c <= target) as u64
    }
}

/// The shape of the workload, from the command line.
#[derive(Debug, Clone)]
pub(crate) struct Shape {
    pub(crate) users: u64,
    pub(crate) items: u64,
    pub(crate) history: u64,
    pub(crate) user_skew: f64,
    pub(crate) item_skew: f64,
    pub(crate) candidates: usize,
    pub(crate) negative_ratio: f64,
    pub(crate) seed: u64,
}

/// `user:{user}:item:{item}`, the key the store and the guard hold.
pub(crate) fn seen_key(pair: u64) -> String {
    let mut key = String::with_capacity(32);
    write_seen_key(&mut key, pair);
    key
}

/// [`seen_key`] into `key`, reusing its buffer.
pub(crate) fn write_seen_key(key: &mut String, pair: u64) {
    key.clear();
    let _ = write!(key, "user:{}:item:{}", pair >> 32, pair & 0xffff_ffff);
}

/// Hashes a (user, item) pair with one multiply: the pairs are not chosen
/// by an adversary, and SipHash showed in the profile of the request loop.
#[derive(Debug, Default)]
pub(crate) struct PairHasher(u64);

impl Hasher for PairHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.write_u64(u64::from(byte));
        }
    }

    fn write_u64(&mut self, pair: u64) {
        self.0 = (self.0 ^ pair)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(26);
    }
}

type PairMap<V> = HashMap<u64, V, BuildHasherDefault<PairHasher>>;

fn pair(user: u64, item: u64) -> u64 {
    (user << 32) | item
}

/// Every (user, item) pair seen so far, when, and per user what they saw (to
/// draw the candidates they have seen from). The run's ground truth: a
/// candidate the guard answers `Absent` must not be in here (unless expired).
#[derive(Debug)]
pub(crate) struct Truth {
    seen: Mutex<Seen>,
    /// Entries older than this are gone from the store (rotation mode).
    pub(crate) expires_after: Option<Duration>,
}

#[derive(Debug, Default)]
struct Seen {
    written_at: PairMap<Instant>,
    by_user: Vec<Vec<u32>>,
}

impl Truth {
    /// The distinct pairs seen so far.
    pub(crate) fn len(&self) -> usize {
        self.seen.lock().unwrap().written_at.len()
    }

    /// Every pair seen so far.
    pub(crate) fn pairs(&self) -> Vec<u64> {
        self.seen
            .lock()
            .unwrap()
            .written_at
            .keys()
            .copied()
            .collect()
    }

    /// Records that `user` saw `item`; false if they had already.
    pub(crate) fn record(&self, pair: u64, now: Instant) -> bool {
        let mut seen = self.seen.lock().unwrap();
        let fresh = seen.written_at.insert(pair, now).is_none();
        if fresh {
            seen.by_user[(pair >> 32) as usize].push(pair as u32);
        }
        fresh
    }

    /// Whether `user` has ever seen `item` (expired or not).
    pub(crate) fn has_seen(&self, pair: u64) -> bool {
        self.seen.lock().unwrap().written_at.contains_key(&pair)
    }

    /// Whether the store must still hold `pair` at `now`. Within `margin` of
    /// its expiry the store may already have dropped it, so it counts as
    /// not required.
    pub(crate) fn must_hold(&self, pair: u64, now: Instant, margin: Duration) -> bool {
        let seen = self.seen.lock().unwrap();
        seen.written_at
            .get(&pair)
            .is_some_and(|&at| match self.expires_after {
                None => true,
                Some(ttl) => now.saturating_duration_since(at) + margin < ttl,
            })
    }
}

/// Generates the history and the requests.
#[derive(Debug)]
pub(crate) struct Workload {
    pub(crate) shape: Shape,
    /// Users drawn by activity: a request comes from `active_users[i]`.
    active_users: Vec<u32>,
    /// Items drawn by popularity, for the candidates a user has not seen.
    popular_items: Vec<u32>,
    pub(crate) truth: Truth,
}

/// Popular items a heavy user has seen are drawn again, up to this often.
const REDRAWS: usize = 8;

/// Draws per pool: small enough to stay in the cache.
const POOL: usize = 1 << 16;

impl Workload {
    /// Draws the seen history: `shape.history` distinct pairs, users by
    /// activity, items by popularity.
    pub(crate) fn generate(shape: Shape, expires_after: Option<Duration>) -> Self {
        let mut rng = Rng::new(shape.seed);
        let users = Zipf::new(shape.users, shape.user_skew);
        let items = Zipf::new(shape.items, shape.item_skew);
        let active_users = (0..POOL).map(|_| users.sample(&mut rng) as u32).collect();
        let popular_items = (0..POOL).map(|_| items.sample(&mut rng) as u32).collect();
        let truth = Truth {
            seen: Mutex::new(Seen {
                written_at: PairMap::with_capacity_and_hasher(
                    shape.history as usize,
                    Default::default(),
                ),
                by_user: vec![Vec::new(); shape.users as usize],
            }),
            expires_after,
        };
        let now = Instant::now();
        while (truth.len() as u64) < shape.history {
            let (user, item) = (users.sample(&mut rng), items.sample(&mut rng));
            truth.record(pair(user, item), now);
        }
        Self {
            shape,
            active_users,
            popular_items,
            truth,
        }
    }

    /// One feed request: its user, and its candidates as pairs. A share
    /// `1 - negative_ratio` of them are drawn from what the user has seen.
    pub(crate) fn request(&self, rng: &mut Rng, candidates: &mut Vec<u64>) {
        let user = u64::from(self.active_users[rng.below(POOL as u64) as usize]);
        candidates.clear();
        let seen = self.truth.seen.lock().unwrap();
        let history = &seen.by_user[user as usize];
        for _ in 0..self.shape.candidates {
            let item = if !history.is_empty() && rng.unit() >= self.shape.negative_ratio {
                history[rng.below(history.len() as u64) as usize]
            } else {
                self.unseen_item(rng, user, &seen)
            };
            candidates.push(pair(user, u64::from(item)));
        }
    }

    /// A popular item `user` has not seen (or, rarely, one they have, after
    /// [`REDRAWS`] tries).
    fn unseen_item(&self, rng: &mut Rng, user: u64, seen: &Seen) -> u32 {
        let mut item = 0;
        for _ in 0..REDRAWS {
            item = self.popular_items[rng.below(POOL as u64) as usize];
            if !seen.written_at.contains_key(&pair(user, u64::from(item))) {
                break;
            }
        }
        item
    }
}
