//! [`AtomicBloom`]: a lock-free, cache-line-blocked Bloom filter.

mod blocks;
mod codec;
mod hash;
mod kernel;
mod math;

use std::fmt;

pub use codec::FORMAT_VERSION;
#[cfg(feature = "guard")]
pub(crate) use math::check_false_positive_rate;
pub use math::{BLOCK_BITS, MAX_HASHES, MIN_FALSE_POSITIVE_RATE, Plan, plan};

use crate::error::{ConfigError, FilterParameter, IncompatibleFilters};
use crate::stats::PerThreadCounter;
use crate::sync::{AtomicU64, Ordering};
use blocks::Blocks;
use hash::block_index;
pub(crate) use hash::hash_key;
use kernel::Kernel;

/// The memory budget a filter may take unless [`FilterBuilder::max_bytes`] says otherwise: 4 GiB.
pub const DEFAULT_MAX_BYTES: u64 = 4 << 30;

const WORDS_PER_BLOCK: usize = (BLOCK_BITS / 64) as usize;
/// Keys hashed ahead in a batch query or insert, so that their cache misses
/// overlap: each key's block is fetched while the 63 others of its group are
/// hashed or tested. 64 against 16 measured 1.35-1.4x the absent and 2x the
/// present batch query past the cache (32M and 100M keys), the same in it.
const BATCH_LANES: usize = 64;

/// One 512-bit block on its own 64-byte cache line: every probe of a key lands in one.
#[repr(C, align(64))]
struct Block([AtomicU64; WORDS_PER_BLOCK]);

/// A Bloom filter that many threads insert into and query at once, without a lock.
///
/// Each key maps to one 512-bit block (one cache line) and sets or tests all of
/// its `k` bits inside it, so a query costs one cache miss. Inserts read the
/// block first and issue `fetch_or` only when a bit is still missing, so
/// re-inserting known keys costs no write traffic. Keys are hashed with xxh3-64
/// under a per-filter seed, random unless fixed, so that outsiders cannot
/// craft colliding keys.
///
/// ```
/// use bloomguard::AtomicBloom;
///
/// let filter = AtomicBloom::new(1_000_000, 0.01)?;
/// assert!(filter.insert(b"user:42:item:7"));
/// assert!(filter.contains(b"user:42:item:7")); // inserted keys are always found
/// let maybe = filter.contains(b"user:42:item:8"); // false, but for 1 % of absent keys
/// # let _ = maybe;
/// # Ok::<(), bloomguard::ConfigError>(())
/// ```
///
/// # Memory ordering
/// Bits are set with `Relaxed` read-modify-writes and read with `Relaxed`
/// loads. Bits are only ever set (until [`clear`](Self::clear)), so an insert
/// that *happens-before* a query — through a join, a channel, a mutex, a
/// network round trip — is always seen by it: no false negatives. A query
/// running concurrently with the insert of the same key may see it or not.
pub struct AtomicBloom {
    blocks: Blocks,
    k: u32,
    kernel: Kernel,
    seed: u64,
    /// Items and FPR the filter was sized for; `None` for explicit sizing.
    target: Option<(u64, f64)>,
    /// Added to by every insert that sets a bit. A thread that holds a
    /// read-section record adds without a locked instruction: a locked add
    /// measured ~3.5 ns of a ~38 ns insert at 1M keys.
    set_bits: PerThreadCounter,
}

/// Statistics of a filter, read from its exact set-bit count.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct FilterStats {
    /// Bits of storage.
    pub bits: u64,
    /// Bytes of storage.
    pub bytes: u64,
    /// Hash probes per key.
    pub k: u32,
    /// Items the filter was sized for (`None` when sized with explicit parameters).
    pub capacity: Option<u64>,
    /// The false-positive rate the filter was sized for, if any.
    pub target_fpr: Option<f64>,
    /// Bits currently set.
    pub set_bits: u64,
    /// `set_bits / bits`.
    pub fill_ratio: f64,
    /// Distinct items the fill implies (counts each distinct key once, whatever
    /// the number of inserts).
    pub estimated_items: f64,
    /// The false-positive rate at the current fill, from the per-block model.
    pub estimated_fpr: f64,
}

impl AtomicBloom {
    /// A filter sized so that its false-positive rate with `expected_items`
    /// distinct keys is at most `fp_rate`, with a random seed.
    ///
    /// Sizing accounts for blocking (see [`plan`]): at 1 % it takes about 9.9
    /// bits per key with k = 6, 0.3 bits more than the textbook unblocked filter.
    ///
    /// # Errors
    /// [`ConfigError`] if `expected_items` is 0, `fp_rate` is not in [1e-8, 1), or
    /// the filter would exceed [`DEFAULT_MAX_BYTES`].
    pub fn new(expected_items: u64, fp_rate: f64) -> Result<Self, ConfigError> {
        FilterBuilder::for_items(expected_items, fp_rate).build()
    }

    /// Like [`new`](Self::new) with a fixed seed, for filters that must agree
    /// across processes (to be combined with [`union`](Self::union), or
    /// compared in tests).
    ///
    /// **Keep a fixed seed secret.** Whoever knows it can compute keys that
    /// all land in one block, which defeats the filter (they pass it 100 % of
    /// the time) while its statistics barely move; snapshots carry the seed
    /// in the clear. See SECURITY.md in the repository.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_seed(expected_items: u64, fp_rate: f64, seed: u64) -> Result<Self, ConfigError> {
        FilterBuilder::for_items(expected_items, fp_rate)
            .seed(seed)
            .build()
    }

    /// A filter of `bits` bits (rounded up to a whole 512-bit block) with `k`
    /// probes per key, and a random seed.
    ///
    /// ```
    /// let filter = bloomguard::AtomicBloom::with_params(1_000, 4)?;
    /// assert_eq!((filter.bits(), filter.k()), (1_024, 4));
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// ```
    ///
    /// # Errors
    /// [`ConfigError`] if `bits` is 0, `k` is not in `1..=MAX_HASHES`, or the
    /// filter would exceed [`DEFAULT_MAX_BYTES`].
    pub fn with_params(bits: u64, k: u32) -> Result<Self, ConfigError> {
        FilterBuilder::with_params(bits, k).build()
    }

    /// A builder for a fixed seed, a memory budget or explicit parameters.
    pub fn builder(expected_items: u64, fp_rate: f64) -> FilterBuilder {
        FilterBuilder::for_items(expected_items, fp_rate)
    }

    fn allocate(blocks: u64, k: u32, seed: u64, target: Option<(u64, f64)>) -> Self {
        Self::from_blocks(Blocks::zeroed(blocks as usize), k, seed, target)
    }

    fn from_blocks(blocks: Blocks, k: u32, seed: u64, target: Option<(u64, f64)>) -> Self {
        Self {
            blocks,
            k,
            kernel: Kernel::for_hashes(k),
            seed,
            target,
            set_bits: PerThreadCounter::new(),
        }
    }

    /// Adds `key`. Returns `true` if any of its bits was newly set, `false` if
    /// the key was already (or falsely) present.
    #[inline]
    pub fn insert(&self, key: impl AsRef<[u8]>) -> bool {
        self.insert_hashed(self.hash(key.as_ref()))
    }

    /// Whether `key` may have been inserted: `false` means certainly not.
    #[inline]
    pub fn contains(&self, key: impl AsRef<[u8]>) -> bool {
        self.contains_hashed(self.hash(key.as_ref()))
    }

    /// The hash [`insert_hashed`](Self::insert_hashed) and
    /// [`contains_hashed`](Self::contains_hashed) take: xxh3-64 of the key
    /// under this filter's seed. It is only meaningful for this filter (or
    /// one with the same seed).
    #[inline]
    pub fn hash(&self, key: &[u8]) -> u64 {
        hash_key(key, self.seed)
    }

    /// [`insert`](Self::insert) for a key already hashed with [`hash`](Self::hash).
    ///
    /// ```
    /// let filter = bloomguard::AtomicBloom::new(1_000, 0.01)?;
    /// let hash = filter.hash(b"user:42:item:7"); // hash once, use twice
    /// filter.insert_hashed(hash);
    /// assert!(filter.contains_hashed(hash) && filter.contains(b"user:42:item:7"));
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// ```
    #[inline]
    pub fn insert_hashed(&self, hash: u64) -> bool {
        // Starts the line's miss one step before the read check needs it:
        // one instruction. Against no prefetch it measured the same at 1M
        // keys and within noise at 10M; see `prefetch` for what it asks.
        prefetch::<true>(self.block_of(hash));
        let newly_set = self.set_prefetched(hash);
        if newly_set > 0 {
            self.set_bits.add(u64::from(newly_set));
        }
        newly_set > 0
    }

    /// Inserts every key, hashing a group ahead and prefetching its blocks so
    /// that the memory misses of a bulk load (a rebuild) overlap. Returns how
    /// many keys set at least one new bit.
    ///
    /// ```
    /// let filter = bloomguard::AtomicBloom::new(1000, 0.01)?;
    /// assert_eq!(filter.insert_many(&["a", "b", "a"]), 2);
    /// assert!(filter.contains("b"));
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// ```
    pub fn insert_many<K: AsRef<[u8]>>(&self, keys: &[K]) -> u64 {
        let (mut added, mut newly_set) = (0, 0);
        self.in_prefetched_groups::<true>(
            keys.len(),
            |i| self.hash(keys[i].as_ref()),
            |_, hash| {
                let set = self.set_prefetched(hash);
                added += u64::from(set > 0);
                newly_set += u64::from(set);
            },
        );
        // Once per call: on a thread without a section record (a rebuild's
        // worker) each add is a locked instruction.
        if newly_set > 0 {
            self.set_bits.add(newly_set);
        }
        added
    }

    /// Sets the hash's bits, returning how many were newly set; the caller
    /// adds them to `set_bits`.
    #[inline]
    fn set_prefetched(&self, hash: u64) -> u32 {
        // Most inserts into a warm filter find their bits set already: reading
        // first skips the locked instructions and leaves the line clean.
        let block = self.block_of(hash);
        if (self.kernel.contains)(block, hash) {
            return 0;
        }
        (self.kernel.insert)(block, hash)
    }

    /// [`contains`](Self::contains) for a key already hashed with [`hash`](Self::hash).
    #[inline]
    pub fn contains_hashed(&self, hash: u64) -> bool {
        (self.kernel.contains)(self.block_of(hash), hash)
    }

    /// Answers [`contains`](Self::contains) for every key, writing `out[i]` for
    /// `keys[i]`. Hashes a group of keys and prefetches their blocks before
    /// reading any, so that on filters larger than the cache the memory misses
    /// of different keys overlap instead of queueing.
    ///
    /// ```
    /// let filter = bloomguard::AtomicBloom::with_seed(1000, 0.01, 7)?;
    /// filter.insert("a");
    /// let mut found = [false; 2];
    /// filter.contains_many(&["a", "b"], &mut found);
    /// assert_eq!(found, [true, false]);
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// ```
    ///
    /// # Panics
    /// If `out` and `keys` differ in length.
    pub fn contains_many<K: AsRef<[u8]>>(&self, keys: &[K], out: &mut [bool]) {
        assert_eq!(
            keys.len(),
            out.len(),
            "contains_many: keys and out differ in length"
        );
        self.contains_batch(|i| self.hash(keys[i].as_ref()), out);
    }

    /// [`contains_many`](Self::contains_many) for hashes from [`hash`](Self::hash).
    ///
    /// # Panics
    /// If `out` and `hashes` differ in length.
    pub fn contains_many_hashed(&self, hashes: &[u64], out: &mut [bool]) {
        assert_eq!(
            hashes.len(),
            out.len(),
            "contains_many_hashed: hashes and out differ in length"
        );
        self.contains_batch(|i| hashes[i], out);
    }

    fn contains_batch(&self, hash_of: impl Fn(usize) -> u64, out: &mut [bool]) {
        self.in_prefetched_groups::<false>(out.len(), hash_of, |i, hash| {
            out[i] = self.contains_hashed(hash);
        });
    }

    /// Calls `each(i, hash_of(i))` for `i` in `0..count`, a group of
    /// [`BATCH_LANES`] at a time: the group's hashes are made first, each
    /// block prefetched as its hash is made, so that the group's cache misses
    /// overlap. Prefetching as it goes measured 35 % faster than hashing a
    /// whole group first: the first misses start sooner.
    #[inline]
    fn in_prefetched_groups<const FOR_WRITE: bool>(
        &self,
        count: usize,
        hash_of: impl Fn(usize) -> u64,
        mut each: impl FnMut(usize, u64),
    ) {
        let mut hashes = [0u64; BATCH_LANES];
        for start in (0..count).step_by(BATCH_LANES) {
            let group = &mut hashes[..BATCH_LANES.min(count - start)];
            for (lane, hash) in group.iter_mut().enumerate() {
                *hash = hash_of(start + lane);
                prefetch::<FOR_WRITE>(self.block_of(*hash));
            }
            for (lane, &hash) in group.iter().enumerate() {
                each(start + lane, hash);
            }
        }
    }

    /// Adds every key of `other` to `self`, so that `self` answers "maybe" for
    /// anything either filter held. Safe to call while others insert and query.
    ///
    /// ```
    /// use bloomguard::AtomicBloom;
    ///
    /// // Filters built apart (two processes, two shards) agree on bits, k and seed.
    /// let (east, west) = (AtomicBloom::with_seed(1_000, 0.01, 7)?, AtomicBloom::with_seed(1_000, 0.01, 7)?);
    /// east.insert("a");
    /// west.insert("b");
    /// east.union(&west)?;
    /// assert!(east.contains("a") && east.contains("b"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`IncompatibleFilters`] unless both filters have the same bits, k and seed.
    pub fn union(&self, other: &AtomicBloom) -> Result<(), IncompatibleFilters> {
        self.check_compatible(other)?;
        let mut newly_set = 0u64;
        for (mine, theirs) in self.words().zip(other.words()) {
            let bits = theirs.load(Ordering::Relaxed);
            if mine.load(Ordering::Relaxed) & bits != bits {
                let before = mine.fetch_or(bits, Ordering::Relaxed);
                newly_set += u64::from((bits & !before).count_ones());
            }
        }
        self.set_bits.add(newly_set);
        Ok(())
    }

    /// Whether [`union`](Self::union) accepts `other`.
    pub fn check_compatible(&self, other: &AtomicBloom) -> Result<(), IncompatibleFilters> {
        let differs_in = if self.blocks.len() != other.blocks.len() {
            FilterParameter::Bits
        } else if self.k != other.k {
            FilterParameter::K
        } else if self.seed != other.seed {
            FilterParameter::Seed
        } else {
            return Ok(());
        };
        Err(IncompatibleFilters { differs_in })
    }

    /// Empties the filter. It takes `&mut self`, so no insert can run
    /// meanwhile, and a filter shared with others cannot be emptied under
    /// them: a guard's live filters, emptied, would answer `Absent` for every
    /// key they held (the guard swaps a fresh filter in instead).
    ///
    /// ```compile_fail
    /// let guard = bloomguard::Guard::builder().expected_items(1_000).build()?;
    /// guard.live_filters().newest().unwrap().clear(); // shared: refused
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// ```
    pub fn clear(&mut self) {
        for word in self.words() {
            word.store(0, Ordering::Relaxed);
        }
        self.set_bits.set(0);
    }

    /// Bits, probes, fill and what the fill implies.
    ///
    /// The set-bit count is exact (kept as inserts set bits), so reading the
    /// statistics costs a sum over a few counter stripes, not a scan.
    ///
    /// ```
    /// let filter = bloomguard::AtomicBloom::new(10_000, 0.01)?;
    /// for i in 0..10_000 {
    ///     filter.insert(format!("key:{i}"));
    /// }
    /// let stats = filter.stats();
    /// assert!((stats.estimated_items - 10_000.0).abs() < 300.0);
    /// assert!((stats.estimated_fpr - 0.01).abs() < 0.002);
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// ```
    pub fn stats(&self) -> FilterStats {
        let bits = self.bits();
        let set_bits = self.set_bits.sum().min(bits);
        let fill_ratio = set_bits as f64 / bits as f64;
        let keys_per_block = math::keys_per_block_from_fill(set_bits, bits, self.k);
        FilterStats {
            bits,
            bytes: bits / 8,
            k: self.k,
            capacity: self.target.map(|(items, _)| items),
            target_fpr: self.target.map(|(_, fpr)| fpr),
            set_bits,
            fill_ratio,
            estimated_items: keys_per_block * self.blocks.len() as f64,
            // A full filter passes every key; the model only approaches that.
            estimated_fpr: if set_bits == bits {
                1.0
            } else {
                math::blocked_fpr(keys_per_block, self.k)
            },
        }
    }

    /// Bits of storage (a multiple of 512).
    pub fn bits(&self) -> u64 {
        self.blocks.len() as u64 * BLOCK_BITS
    }

    /// Bits currently set: exact once writers are quiet, and cheap enough to
    /// poll (a sum over a few per-thread stripes).
    pub fn set_bits(&self) -> u64 {
        self.set_bits.sum().min(self.bits())
    }

    /// The set-bit count at which the filter is expected to hold `items`
    /// distinct keys: a fill level to compare [`set_bits`](Self::set_bits) with.
    #[cfg(feature = "guard")]
    pub(crate) fn set_bits_expected_at(&self, items: u64) -> u64 {
        let keys_per_block = items as f64 / self.blocks.len() as f64;
        (math::expected_fill(keys_per_block, self.k) * self.bits() as f64) as u64
    }

    /// Hash probes per key.
    pub fn k(&self) -> u32 {
        self.k
    }

    /// The hash seed (stored in snapshots).
    ///
    /// **Keep a fixed seed secret.** Whoever knows it can compute keys that
    /// all land in one block, which defeats the filter (they pass it 100 % of
    /// the time) while its statistics barely move; snapshots carry the seed
    /// in the clear. See SECURITY.md in the repository.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Heap bytes the filter holds, bit storage and counters together.
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of_val::<[Block]>(&self.blocks) + self.set_bits.memory_bytes()
    }

    #[inline]
    fn block_of(&self, hash: u64) -> &Block {
        &self.blocks[block_index(hash, self.blocks.len() as u64)]
    }

    /// [`contains_hashed`](Self::contains_hashed) detached from the borrow,
    /// for a holder that keeps the filter alive beside it (`None` for a
    /// filter without blocks, which no builder or decoder makes).
    #[cfg(feature = "guard")]
    pub(crate) fn probe(&self) -> Option<Probe> {
        Some(Probe {
            blocks: std::ptr::NonNull::new(self.blocks.as_ptr().cast_mut())
                .filter(|_| !self.blocks.is_empty())?,
            len: self.blocks.len() as u64,
            contains: self.kernel.contains,
        })
    }

    fn words(&self) -> impl Iterator<Item = &AtomicU64> {
        self.blocks.iter().flat_map(|block| &block.0)
    }
}

/// What [`AtomicBloom::contains_hashed`] reads, copied out of the filter:
/// kept inline beside an `Arc` that keeps the filter alive, it saves the
/// load that reaches the filter first (a dependent load on every check).
#[cfg(feature = "guard")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Probe {
    blocks: std::ptr::NonNull<Block>,
    len: u64,
    contains: fn(&Block, u64) -> bool,
}

// SAFETY: a probe only reads the filter's atomics, which are `Sync`; when it
// may do so is up to its holder (see `contains_hashed`).
#[cfg(feature = "guard")]
unsafe impl Send for Probe {}
// SAFETY: as above.
#[cfg(feature = "guard")]
unsafe impl Sync for Probe {}

#[cfg(feature = "guard")]
impl Probe {
    /// [`AtomicBloom::contains_hashed`] on the filter this probe was taken from.
    ///
    /// # Safety
    /// That filter is alive (its blocks are freed only when it drops).
    #[inline]
    pub(crate) unsafe fn contains_hashed(&self, hash: u64) -> bool {
        // SAFETY: `block_index` is below `len` (a multiply-high by it), so
        // the block lies among the filter's `len`, alive by the caller's word.
        let block = unsafe { &*self.blocks.as_ptr().add(block_index(hash, self.len)) };
        (self.contains)(block, hash)
    }
}

impl fmt::Debug for AtomicBloom {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AtomicBloom")
            .field("bits", &self.bits())
            .field("k", &self.k)
            .field("target", &self.target)
            .field("set_bits", &self.set_bits.sum())
            .finish_non_exhaustive()
    }
}

/// Options for an [`AtomicBloom`]: sizing, seed and memory budget.
///
/// ```
/// use bloomguard::FilterBuilder;
///
/// let filter = FilterBuilder::for_items(10_000, 0.001).seed(42).max_bytes(1 << 20).build()?;
/// assert_eq!(filter.seed(), 42);
/// # Ok::<(), bloomguard::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy)]
#[must_use]
pub struct FilterBuilder {
    sizing: Sizing,
    seed: Option<u64>,
    max_bytes: u64,
}

#[derive(Debug, Clone, Copy)]
enum Sizing {
    Target { items: u64, fp_rate: f64 },
    Explicit { bits: u64, k: u32 },
}

impl FilterBuilder {
    /// Sized for `expected_items` distinct keys at a false-positive rate of `fp_rate`.
    pub fn for_items(expected_items: u64, fp_rate: f64) -> Self {
        Self::new(Sizing::Target {
            items: expected_items,
            fp_rate,
        })
    }

    /// `bits` bits (rounded up to whole 512-bit blocks) and `k` probes per key.
    pub fn with_params(bits: u64, k: u32) -> Self {
        Self::new(Sizing::Explicit { bits, k })
    }

    fn new(sizing: Sizing) -> Self {
        Self {
            sizing,
            seed: None,
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }

    /// Fixes the hash seed (random otherwise).
    ///
    /// **Keep a fixed seed secret.** Whoever knows it can compute keys that
    /// all land in one block, which defeats the filter (they pass it 100 % of
    /// the time) while its statistics barely move; snapshots carry the seed
    /// in the clear. See SECURITY.md in the repository.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Refuses filters larger than `max_bytes` (default [`DEFAULT_MAX_BYTES`]).
    pub fn max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// The same options, sized for `expected_items` at `fp_rate`: how a
    /// guard makes each of its filters from one template.
    #[cfg(feature = "guard")]
    pub(crate) fn sized_for(self, expected_items: u64, fp_rate: f64) -> Self {
        Self {
            sizing: Sizing::Target {
                items: expected_items,
                fp_rate,
            },
            ..self
        }
    }

    /// The most items, up to `items`, that a filter at `fp_rate` sized for
    /// them fits the budget with (`items` itself where it fits, or where no
    /// count does): a guess at a size may shrink to the budget, a count may
    /// not.
    #[cfg(feature = "guard")]
    pub(crate) fn fitting(&self, items: u64, fp_rate: f64) -> u64 {
        let bytes_for = |items: u64| plan(items, fp_rate).map_or(u64::MAX, |plan| plan.bytes);
        let bytes = bytes_for(items);
        if bytes <= self.max_bytes {
            return items;
        }
        // Bytes grow in proportion to items (one k for a given rate): scale
        // down, then step down the rest of the way a block's rounding leaves.
        let mut fitting = (items as f64 * self.max_bytes as f64 / bytes as f64) as u64;
        while fitting > 0 && bytes_for(fitting) > self.max_bytes {
            fitting -= fitting / 1024 + 1;
        }
        if fitting == 0 { items } else { fitting }
    }

    /// The same options with the seed fixed (drawn now if none was given),
    /// so that every filter made from them shares it; and that seed.
    #[cfg(feature = "guard")]
    pub(crate) fn with_fixed_seed(self) -> (Self, u64) {
        let seed = self.seed.unwrap_or_else(random_seed);
        (self.seed(seed), seed)
    }

    /// Allocates the filter: a zeroed allocation, whose pages the OS maps
    /// as inserts first touch them, so a large filter is ready at once and
    /// grows resident as it fills.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first parameter out of range, or
    /// [`ConfigError::TooLarge`] when the filter would exceed the budget.
    pub fn build(self) -> Result<AtomicBloom, ConfigError> {
        let (blocks, k, target) = match self.sizing {
            Sizing::Target { items, fp_rate } => {
                let plan = plan(items, fp_rate)?;
                (plan.bits / BLOCK_BITS, plan.k, Some((items, fp_rate)))
            }
            Sizing::Explicit { bits, k } => {
                if bits == 0 {
                    return Err(ConfigError::out_of_range(
                        "bits",
                        bits,
                        "an integer of at least 1",
                    ));
                }
                if !(1..=MAX_HASHES).contains(&k) {
                    return Err(ConfigError::out_of_range("k", k, "an integer in 1..=32"));
                }
                (bits.div_ceil(BLOCK_BITS), k, None)
            }
        };
        let bytes = blocks.saturating_mul(BLOCK_BITS / 8);
        if bytes > self.max_bytes || !blocks::fit_one_allocation(bytes) {
            return Err(ConfigError::TooLarge {
                bytes,
                max_bytes: self.max_bytes,
            });
        }
        let seed = self.seed.unwrap_or_else(random_seed);
        Ok(AtomicBloom::allocate(blocks, k, seed, target))
    }
}

/// A seed outsiders cannot predict, from the standard library's per-process
/// random keys mixed with a counter (so two filters in one process differ too).
pub(crate) fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static FILTERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(FILTERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    hasher.finish()
}

/// Starts loading `block` into the cache, hinting intent to write if
/// `FOR_WRITE` (so that it could arrive exclusive, ready for a locked
/// instruction).
///
/// The hint becomes `prefetchw` only where the build targets a CPU that has
/// it (`-C target-cpu=…` with `prfchw`); a baseline x86-64 build emits a
/// plain `prefetcht0` for both. An inline-asm `prefetchw` measured no
/// faster on the 2-core AMD VM (single inserts at 1M and 10M keys, batch
/// inserts at 10M and 32M), so the baseline keeps the plain prefetch
/// rather than detect the instruction at run time.
#[inline]
fn prefetch<const FOR_WRITE: bool>(block: &Block) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    {
        use std::arch::x86_64::{_MM_HINT_ET0, _MM_HINT_T0, _mm_prefetch};
        let address = (block as *const Block).cast();
        // SAFETY: prefetching is only a hint: it never faults, reads nothing
        // into the program and changes no memory; the pointer comes from a
        // live reference anyway.
        unsafe {
            if FOR_WRITE {
                _mm_prefetch::<_MM_HINT_ET0>(address);
            } else {
                _mm_prefetch::<_MM_HINT_T0>(address);
            }
        }
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = block;
}
