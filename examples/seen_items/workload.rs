//! The seen history and the feed requests: who is active, what is popular,
//! and which candidates a user has already seen.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::{Rng as _, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Zipf};

/// The workload's random source, seeded so that every run replays the same
/// history and requests; ChaCha8 because its stream is specified, so the
/// same seed draws the same workload on every platform.
pub(crate) type Rng = ChaCha8Rng;

/// Ranks 0..n, rank r drawn with weight 1/(r+1)^s (rand_distr's Zipf, which
/// draws from 1..=n in constant time, without a table).
#[derive(Debug)]
struct Ranks(Zipf<f64>);

impl Ranks {
    fn new(what: &str, n: u64, exponent: f64) -> Result<Self, String> {
        Zipf::new(n as f64, exponent)
            .map(Self)
            .map_err(|error| format!("{what}: Zipf over {n} with exponent {exponent}: {error}"))
    }

    fn sample(&self, rng: &mut Rng) -> u64 {
        self.0.sample(rng) as u64 - 1
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

    /// Every pair the store still holds at `now`, with when it stops
    /// holding it at the earliest (`None`: never).
    pub(crate) fn held_at(&self, now: Instant) -> Vec<(u64, Option<Instant>)> {
        let seen = self.seen.lock().unwrap();
        seen.written_at
            .iter()
            .map(|(&pair, &at)| (pair, self.expires_at(at)))
            .filter(|&(_, expires)| expires.is_none_or(|expires| now < expires))
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

    /// Whether `pair` was written, and if so until when the store holds it
    /// at the earliest (`Some(None)`: for good). A pair's time is taken
    /// before the guard's insert and the store's write, so the store's own
    /// expiry comes no sooner.
    pub(crate) fn held_until(&self, pair: u64) -> Option<Option<Instant>> {
        let seen = self.seen.lock().unwrap();
        seen.written_at.get(&pair).map(|&at| self.expires_at(at))
    }

    fn expires_at(&self, written_at: Instant) -> Option<Instant> {
        self.expires_after.map(|ttl| written_at + ttl)
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
    ///
    /// # Errors
    /// A skew or a count that no Zipf distribution has.
    pub(crate) fn generate(shape: Shape, expires_after: Option<Duration>) -> Result<Self, String> {
        let mut rng = Rng::seed_from_u64(shape.seed);
        let users = Ranks::new("--users/--user-skew", shape.users, shape.user_skew)?;
        let items = Ranks::new("--items/--item-skew", shape.items, shape.item_skew)?;
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
        Ok(Self {
            shape,
            active_users,
            popular_items,
            truth,
        })
    }

    /// One feed request: its user, and its candidates as pairs. A share
    /// `1 - negative_ratio` of them are drawn from what the user has seen.
    pub(crate) fn request(&self, rng: &mut Rng, candidates: &mut Vec<u64>) {
        let user = u64::from(self.active_users[rng.random_range(0..POOL)]);
        candidates.clear();
        let seen = self.truth.seen.lock().unwrap();
        let history = &seen.by_user[user as usize];
        for _ in 0..self.shape.candidates {
            let item = if !history.is_empty() && rng.random::<f64>() >= self.shape.negative_ratio {
                history[rng.random_range(0..history.len())]
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
            item = self.popular_items[rng.random_range(0..POOL)];
            if !seen.written_at.contains_key(&pair(user, u64::from(item))) {
                break;
            }
        }
        item
    }
}
