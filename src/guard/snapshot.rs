//! The live set as one value: every filter with what it was sized for and
//! how long it has been open, so that a fleet snapshot carries a rotating
//! guard's windows and a growing guard's capacities, and a member that
//! loads it replaces its own set rather than OR filters of other shapes.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use xxhash_rust::xxh3::xxh3_64;

use super::Guard;
use super::live::Generation;
use crate::error::{DecodeError, FilterParameter, IncompatibleFilters};
use crate::filter::AtomicBloom;

/// `BGLS`: a bloomguard live set.
const MAGIC: [u8; 4] = *b"BGLS";
/// 2: the whole set is checksummed (1 checked each filter's bytes only, and
/// a window's age, a capacity or a rate could change unnoticed).
const VERSION: u8 = 2;
/// The xxh3-64 of every byte before it, at the end.
const CHECKSUM_LEN: usize = 8;
/// Filters a set may hold, at most: a grown guard's ceiling with room to spare,
/// so that a forged count cannot make a reader loop or allocate for long.
const MAX_FILTERS: usize = 1_024;

/// One filter of a [`LiveSnapshot`].
pub(crate) struct SnapshotFilter {
    pub(crate) filter: AtomicBloom,
    pub(crate) capacity: u64,
    pub(crate) fp_rate: f64,
    /// How long the filter had been open for inserts when the snapshot was taken.
    pub(crate) age: Duration,
}

/// Encodes `generations` (oldest first) as `[magic][version][count u32]`
/// then, per filter, `[capacity u64][fp_rate f64][age_ms u64][len u64]
/// [filter bytes]`, then the xxh3-64 of all of that, little-endian.
fn encode(generations: &[Arc<Generation>]) -> Vec<u8> {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(&MAGIC);
    bytes.push(VERSION);
    bytes.extend_from_slice(&(generations.len() as u32).to_le_bytes());
    for g in generations {
        let encoded = g.filter.to_bytes();
        bytes.extend_from_slice(&g.capacity.to_le_bytes());
        bytes.extend_from_slice(&g.fp_rate.to_le_bytes());
        let age_ms = u64::try_from(g.opened_at().elapsed().as_millis()).unwrap_or(u64::MAX);
        bytes.extend_from_slice(&age_ms.to_le_bytes());
        bytes.extend_from_slice(&(encoded.len() as u64).to_le_bytes());
        bytes.extend_from_slice(&encoded);
    }
    let checksum = xxh3_64(&bytes);
    bytes.extend_from_slice(&checksum.to_le_bytes());
    bytes
}

/// Every filter of a guard's live set, oldest first, as decoded.
pub(crate) struct LiveSnapshot {
    pub(crate) filters: Vec<SnapshotFilter>,
}

impl LiveSnapshot {
    pub(crate) fn from_bytes(bytes: &[u8]) -> Result<Self, DecodeError> {
        let mut bytes = checked_content(bytes)?;
        let header = take(&mut bytes, MAGIC.len() + 1 + 4)?;
        let count = u32::from_le_bytes(header[5..9].try_into().expect("4 bytes")) as usize;
        if count == 0 || count > MAX_FILTERS {
            return Err(DecodeError::InvalidHeader("filter count out of range"));
        }
        let mut filters = Vec::with_capacity(count);
        for _ in 0..count {
            let capacity = u64_at(&mut bytes)?;
            let fp_rate = f64::from_bits(u64_at(&mut bytes)?);
            let age = Duration::from_millis(u64_at(&mut bytes)?);
            let len = usize::try_from(u64_at(&mut bytes)?).map_err(|_| DecodeError::Truncated)?;
            let filter = AtomicBloom::from_bytes(take(&mut bytes, len)?)?;
            if !(fp_rate > 0.0 && fp_rate < 1.0) || capacity == 0 {
                return Err(DecodeError::InvalidHeader("capacity or rate out of range"));
            }
            filters.push(SnapshotFilter {
                filter,
                capacity,
                fp_rate,
                age,
            });
        }
        if !bytes.is_empty() {
            return Err(DecodeError::TrailingBytes);
        }
        Ok(Self { filters })
    }
}

/// `bytes` without their checksum, once it matches. The magic and version
/// are looked at first, so that other input and older sets say what they are.
fn checked_content(bytes: &[u8]) -> Result<&[u8], DecodeError> {
    if bytes.len() < MAGIC.len() + 1 + CHECKSUM_LEN {
        return Err(DecodeError::Truncated);
    }
    if bytes[..MAGIC.len()] != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    if bytes[MAGIC.len()] != VERSION {
        return Err(DecodeError::UnsupportedVersion {
            found: u16::from(bytes[MAGIC.len()]),
            supported: u16::from(VERSION),
        });
    }
    let (content, checksum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    if xxh3_64(content) != u64::from_le_bytes(checksum.try_into().expect("8 bytes")) {
        return Err(DecodeError::ChecksumMismatch);
    }
    Ok(content)
}

fn take<'a>(bytes: &mut &'a [u8], len: usize) -> Result<&'a [u8], DecodeError> {
    if bytes.len() < len {
        return Err(DecodeError::Truncated);
    }
    let (head, rest) = bytes.split_at(len);
    *bytes = rest;
    Ok(head)
}

fn u64_at(bytes: &mut &[u8]) -> Result<u64, DecodeError> {
    Ok(u64::from_le_bytes(
        take(bytes, 8)?.try_into().expect("8 bytes"),
    ))
}

impl Guard {
    /// The live set now, encoded; `None` while warming (it says nothing of
    /// the store yet).
    pub(crate) fn encode_live_set(&self) -> Option<Vec<u8>> {
        let live = self.inner.live.load_full();
        (!live.warming && !live.generations.is_empty()).then(|| encode(&live.generations))
    }

    /// Replaces the live set with `snapshot`'s and fences the guard in the
    /// same swap (see `LiveState::replace_fenced`); ends warming when
    /// `covers_the_store`. Each filter's window goes on from the age it had.
    ///
    /// # Errors
    /// [`IncompatibleFilters`] when a filter was made with another seed:
    /// checks hash keys once, with the guard's seed.
    ///
    /// A `rebuilt` snapshot (another guard's fresh rebuild) counts as this
    /// guard's rebuild: the drift and removals are measured from here, and
    /// a scheduled rebuild is next due a period from now. It repairs none
    /// of this guard's stale answers (see `StaleFindings`).
    pub(crate) fn replace_from_snapshot(
        &self,
        snapshot: LiveSnapshot,
        covers_the_store: bool,
        rebuilt: bool,
    ) -> Result<(), IncompatibleFilters> {
        if snapshot
            .filters
            .iter()
            .any(|f| f.filter.seed() != self.inner.seed)
        {
            return Err(IncompatibleFilters {
                differs_in: FilterParameter::Seed,
            });
        }
        let now = Instant::now();
        let generations = snapshot
            .filters
            .into_iter()
            .map(|f| {
                let mut generation = Generation::new(f.filter, f.capacity, f.fp_rate);
                generation.made_at = now.checked_sub(f.age).unwrap_or(now);
                Arc::new(generation)
            })
            .collect();
        self.stamp_every_key();
        self.inner
            .live
            .replace_fenced(generations, covers_the_store);
        // Keys the staleness check found here went into the set just
        // replaced: the store holds them, and the set taken may be older
        // than the rebuild that repaired them, or that rebuild a scan away
        // (see `StaleFindings::record` for the order).
        for hash in self.inner.stale.found_hashes() {
            self.insert_hash(hash);
        }
        if rebuilt {
            let baseline = self.baseline_now();
            let mut history = self.history();
            history.baseline = baseline;
            history.last_success_at = Some(now);
            history.last_success_time = Some(std::time::SystemTime::now());
            // Stale answers this guard found stay unrepaired: the other
            // guard's read of the source may have begun before they were
            // found, and passed their keys. This guard rebuilds for them,
            // and holds their keys meanwhile (above).
        }
        if covers_the_store {
            self.inner.left_warming.notify_waiters();
        }
        Ok(())
    }

    /// Fences the guard (every check answers `MaybePresent`) or lifts it.
    pub(crate) fn set_fenced(&self, fenced: bool) {
        self.inner.live.set_fenced(fenced);
    }

    /// The settings that must agree across a fleet, as text: what its
    /// members record in Redis and compare.
    pub(crate) fn fleet_settings(&self) -> Vec<(&'static str, String)> {
        vec![
            ("seed", format!("{:#x}", self.inner.seed)),
            ("expected_items", self.inner.expected_items.to_string()),
            ("false_positive_rate", self.inner.target_fpr.to_string()),
            ("lifecycle", format!("{:?}", self.inner.lifecycle)),
            // A snapshot of a guard without a source says nothing of the
            // store's keys written before the fleet: it must not end the
            // warming of one with a source.
            ("source", self.inner.source.is_some().to_string()),
            (
                "write_settle_ms",
                self.inner
                    .rebuild_policy
                    .write_settle
                    .as_millis()
                    .to_string(),
            ),
        ]
    }

    /// How long a rebuild may take before it is abandoned.
    pub(crate) fn rebuild_timeout(&self) -> Duration {
        self.inner.rebuild_policy.timeout
    }

    /// How long after an insert its store write may land and still be seen
    /// by a rebuild that started meanwhile.
    pub(crate) fn write_settle(&self) -> Duration {
        self.inner.rebuild_policy.write_settle
    }
}

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;
    use crate::Lifecycle;
    use crate::guard::source::GatedSource;

    /// A rotating guard (seed 9, hour-long periods) with "old" in its first
    /// generation and "new" in its second.
    fn rotated_once(expected_items: u64, generations: usize) -> Guard {
        let guard = Guard::builder()
            .expected_items(expected_items)
            .seed(9)
            .lifecycle(Lifecycle::Rotate {
                generations,
                period: Duration::from_secs(3_600),
            })
            .build()
            .unwrap();
        guard.insert("old");
        guard.rotate().unwrap();
        guard.insert("new");
        guard
    }

    #[test]
    fn a_rotating_set_round_trips_with_its_windows() {
        let guard = rotated_once(1_000, 3);
        let bytes = guard.encode_live_set().unwrap();
        let decoded = LiveSnapshot::from_bytes(&bytes).unwrap();
        assert_eq!(decoded.filters.len(), 2);

        let other = Guard::builder()
            .expected_items(1_000)
            .seed(9)
            .build()
            .unwrap();
        other.replace_from_snapshot(decoded, true, false).unwrap();
        assert!(other.is_fenced(), "replaced sets start fenced");
        other.set_fenced(false);
        assert_eq!(other.live_filters().len(), 2);
        assert!(!other.check("old").is_absent());
        assert!(!other.check("new").is_absent());

        for cut in [0, 3, 9, bytes.len() - 1] {
            assert!(
                LiveSnapshot::from_bytes(&bytes[..cut]).is_err(),
                "cut at {cut}"
            );
        }
    }

    /// The live set of another instance (seed `seed`) that holds `key`.
    fn another_instances_snapshot(seed: u64, key: &str) -> LiveSnapshot {
        let other = Guard::builder()
            .expected_items(1_000)
            .seed(seed)
            .build()
            .unwrap();
        other.insert(key);
        LiveSnapshot::from_bytes(&other.encode_live_set().unwrap()).unwrap()
    }

    /// A member that adopts the fleet's snapshot while its own first build
    /// is scanning: the key another instance wrote after the scan passed it
    /// is in the snapshot only, and must stay after that build commits.
    #[tokio::test]
    async fn a_rebuild_that_commits_after_a_snapshot_keeps_the_snapshots_keys() {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let member = Guard::builder()
            .expected_items(1_000)
            .seed(3)
            .source(GatedSource::new(
                vec![b"in the store before".to_vec()],
                &gate,
            ))
            .rebuild_policy(crate::RebuildPolicy::default().write_settle(Duration::ZERO))
            .build()
            .unwrap();
        let rebuild = tokio::spawn({
            let member = member.clone();
            async move { member.rebuild().await }
        });
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while member.inner.live.load().shadow.is_none() {
            assert!(
                std::time::Instant::now() < deadline,
                "the rebuild never installed its shadow"
            );
            tokio::task::yield_now().await;
        }
        let snapshot = another_instances_snapshot(3, "written by another instance");
        member.replace_from_snapshot(snapshot, true, false).unwrap();
        member.set_fenced(false);
        assert!(!member.check("written by another instance").is_absent());

        gate.add_permits(1);
        rebuild
            .await
            .unwrap()
            .expect("the same geometry: the build commits");
        assert!(
            !member.check("written by another instance").is_absent(),
            "the committed build lost the snapshot's key"
        );
        assert!(!member.check("in the store before").is_absent());
    }

    /// A member that replaces its set with the fleet's snapshot skips the
    /// stream entries the snapshot covers, and with them the per-key insert
    /// stamps the loader's confirmed-absent cache trusts: an answer cached
    /// before must not hide a key whose write lands after the replacement.
    #[tokio::test(start_paused = true)]
    async fn a_cached_absent_does_not_outlive_a_replacement_by_a_snapshot() {
        let settle = Duration::from_millis(100);
        let member = Guard::builder()
            .expected_items(1_000)
            .seed(5)
            .rebuild_policy(crate::RebuildPolicy::default().write_settle(settle))
            .build()
            .unwrap();
        let store = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
        let listed = Arc::clone(&store);
        let loader = crate::GuardedLoader::new(member.clone(), move |key: String| {
            let found = listed.lock().unwrap().contains(&key);
            async move { Ok::<_, std::convert::Infallible>(found.then_some(())) }
        })
        .confirmed_absent_cache(100, Duration::from_secs(60))
        .unwrap();
        member.insert("item:1"); // a false positive for now
        tokio::time::advance(2 * settle).await;
        assert_eq!(loader.get("item:1").await.unwrap(), None);
        assert_eq!(loader.get("item:1").await.unwrap(), None);
        assert_eq!(member.stats().confirmed_absent_hits, 1, "cached");

        let snapshot = another_instances_snapshot(5, "item:1");
        member.replace_from_snapshot(snapshot, true, false).unwrap();
        member.set_fenced(false);
        // The other instance's write lands within its settle.
        store.lock().unwrap().insert("item:1".to_string());
        assert_eq!(
            loader.get("item:1").await.unwrap(),
            Some(()),
            "an answer cached before the snapshot hid a key it brought"
        );
    }

    /// A fenced guard answers every check "maybe" whatever its filters hold:
    /// a miss after one says nothing of them. Counted as false positives,
    /// they drove the observed rate toward 1 and, with a drift threshold,
    /// a full rebuild every 10,000 outcomes while the fence lasted.
    #[tokio::test]
    async fn misses_while_fenced_are_not_false_positives() {
        let member = Guard::builder().expected_items(1_000).build().unwrap();
        let loader = crate::GuardedLoader::new(member.clone(), |_key: String| async {
            Ok::<_, std::convert::Infallible>(None::<()>)
        });
        member.set_fenced(true);
        for n in 0..100 {
            let key = format!("item:{n}");
            assert_eq!(member.check(&key), crate::Verdict::MaybePresent);
            member.record_outcome(false);
            assert_eq!(loader.get(&key).await.unwrap(), None);
        }
        let stats = member.stats();
        assert_eq!(stats.false_positives, 0, "{stats:?}");
        assert_eq!(stats.observed_fpr, None);

        member.set_fenced(false);
        assert_eq!(loader.get("item:0").await.unwrap(), None);
        member.record_outcome(false); // as after a "maybe" of its filters
        assert_eq!(member.stats().false_positives, 1);
    }

    /// A fenced member may lack keys the fleet acknowledged without it (its
    /// lease lapsed): no insert of them was stamped here, so the insert
    /// clock cannot vouch for a shared "not found" and a joined call asks
    /// the backend itself.
    #[tokio::test(start_paused = true)]
    async fn a_fenced_guard_shares_no_not_found_with_a_joined_call() {
        let settle = Duration::from_millis(100);
        let member = Guard::builder()
            .expected_items(1_000)
            .rebuild_policy(crate::RebuildPolicy::default().write_settle(settle))
            .build()
            .unwrap();
        let store = Arc::new(std::sync::Mutex::new(std::collections::HashSet::new()));
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let loader = crate::GuardedLoader::new(member.clone(), {
            let (store, gate) = (Arc::clone(&store), Arc::clone(&gate));
            move |key: String| {
                let found = store.lock().unwrap().contains(&key);
                let gate = Arc::clone(&gate);
                async move {
                    gate.acquire().await.unwrap().forget();
                    Ok::<_, std::convert::Infallible>(found.then_some(()))
                }
            }
        })
        .confirmed_absent_cache(100, Duration::from_secs(60)) // times inserts
        .unwrap();
        tokio::time::advance(2 * settle).await;
        member.set_fenced(true);
        let before = tokio::spawn({
            let loader = loader.clone();
            async move { loader.get("item:1").await }
        });
        tokio::task::yield_now().await; // its load reads the store
        // Another instance's write completes without this member.
        store.lock().unwrap().insert("item:1".to_string());
        let after = tokio::spawn({
            let loader = loader.clone();
            async move { loader.get("item:1").await }
        });
        tokio::task::yield_now().await; // it joins the load
        gate.add_permits(2);
        assert_eq!(before.await.unwrap().unwrap(), None);
        assert_eq!(
            after.await.unwrap().unwrap(),
            Some(()),
            "a fenced guard's joined call took a not-found older than a completed write"
        );
    }

    /// A window's age, a capacity or a rate lies outside the filters' own
    /// checksums: a changed age alone would have an adopter rotate at once
    /// and drop a generation still inside its window.
    #[test]
    fn a_changed_bit_anywhere_in_the_set_is_refused() {
        let guard = rotated_once(100, 2);
        let bytes = guard.encode_live_set().unwrap();
        let mut changed = bytes.clone();
        for at in 0..bytes.len() {
            for bit in [0x01_u8, 0x40] {
                changed[at] ^= bit;
                assert!(
                    LiveSnapshot::from_bytes(&changed).is_err(),
                    "bit {bit:#04x} of byte {at} (of {}) changed, and the set still decoded",
                    bytes.len()
                );
                changed[at] ^= bit;
            }
        }
    }

    /// What a set's capacities add up to saturates: a set decoded from a
    /// trusted writer that sized its filters for "unbounded" must not make
    /// `stats()` overflow.
    #[test]
    fn capacities_that_add_past_u64_saturate_in_stats() {
        let generation = |seed| SnapshotFilter {
            filter: AtomicBloom::with_seed(100, 0.01, seed).unwrap(),
            capacity: u64::MAX,
            fp_rate: 0.01,
            age: Duration::ZERO,
        };
        let guard = Guard::builder()
            .expected_items(100)
            .seed(9)
            .lifecycle(Lifecycle::Rotate {
                generations: 2,
                period: Duration::from_secs(3_600),
            })
            .build()
            .unwrap();
        let snapshot = LiveSnapshot {
            filters: vec![generation(9), generation(9)],
        };
        guard.replace_from_snapshot(snapshot, true, false).unwrap();
        assert_eq!(guard.stats().capacity, u64::MAX);
    }

    #[test]
    fn a_set_of_another_seed_is_refused() {
        let guard = Guard::builder()
            .expected_items(1_000)
            .seed(1)
            .build()
            .unwrap();
        let snapshot = LiveSnapshot::from_bytes(&guard.encode_live_set().unwrap()).unwrap();
        let other = Guard::builder()
            .expected_items(1_000)
            .seed(2)
            .build()
            .unwrap();
        assert!(other.replace_from_snapshot(snapshot, true, false).is_err());
        assert!(!other.is_fenced());
    }

    /// The checksum keeps a fuzzer's bytes from ever reaching the parser
    /// (AFL cannot forge it), so the parser is tried here past it: a valid
    /// set with bytes overwritten, cut short or lengthened, checksummed
    /// again, decodes or is refused, and never panics or allocates for a
    /// forged length.
    #[test]
    fn a_forged_set_with_a_good_checksum_is_refused_without_a_panic() {
        use proptest::prelude::*;
        use proptest::test_runner::{Config, RngSeed, TestRunner};

        let guard = rotated_once(1_000, 3);
        let valid = guard.encode_live_set().unwrap();
        let content_len = valid.len() - CHECKSUM_LEN;
        let mut runner = TestRunner::new(Config {
            cases: 2_000,
            rng_seed: RngSeed::Fixed(0x5eed),
            failure_persistence: None,
            ..Config::default()
        });
        let forgeries = (
            proptest::collection::vec((5..content_len, any::<u8>()), 0..8),
            prop_oneof![Just(None), (5..content_len).prop_map(Some)],
            proptest::collection::vec(any::<u8>(), 0..16),
        );
        runner
            .run(&forgeries, |(overwrites, cut_at, appended)| {
                let mut content = valid[..content_len].to_vec();
                for (at, byte) in overwrites {
                    content[at] = byte;
                }
                if let Some(at) = cut_at {
                    content.truncate(at);
                }
                content.extend_from_slice(&appended);
                let checksum = xxh3_64(&content);
                content.extend_from_slice(&checksum.to_le_bytes());
                if let Ok(set) = LiveSnapshot::from_bytes(&content) {
                    prop_assert!(!set.filters.is_empty() && set.filters.len() <= MAX_FILTERS);
                }
                Ok(())
            })
            .unwrap();
    }
}
