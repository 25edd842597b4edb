//! The guard's lifecycle: rebuild, rotation, growth, warming, drift, staleness,
//! cancellation — each judged first by the one rule (no false negatives).

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::common::{StopOnDrop, absent_keys, keys, three_sigma_limit, wait_until};
use bloomguard::source::{self, KeyBatch, KeySource, KeyStream, SourceError};
use bloomguard::{
    AtomicBloom, ConfigError, FilterParameter, Guard, GuardBuilder, GuardedLoader, Lifecycle,
    Loader, RebuildError, RebuildOutcome, RebuildPolicy, Verdict,
};
use futures_core::Stream;

/// An in-memory store, shared by writers and the key source.
type Store = Arc<RwLock<HashSet<Vec<u8>>>>;

fn store_with(keys: &[String]) -> Store {
    Arc::new(RwLock::new(
        keys.iter().map(|k| k.as_bytes().to_vec()).collect(),
    ))
}

fn source_of(store: &Store) -> impl KeySource + use<> {
    let listed = Arc::clone(store);
    source::from_fn(move || listed.read().unwrap().iter().cloned().collect::<Vec<_>>())
}

/// A guard over `source` that rebuilds only when told to, without waiting for
/// a write settle (the tests that write concurrently set their own policy).
fn manual_guard(expected_items: u64, source: impl KeySource) -> Guard {
    Guard::builder()
        .expected_items(expected_items)
        .seed(0x5eed)
        .source(source)
        .rebuild_policy(RebuildPolicy::default().write_settle(Duration::ZERO))
        .build()
        .unwrap()
}

/// A guard over `store` rebuilding by `policy` (with no write settle),
/// whose maintenance task looks every 20 ms.
fn maintained(expected_items: u64, store: &Store, policy: RebuildPolicy) -> GuardBuilder {
    Guard::builder()
        .expected_items(expected_items)
        .seed(0x5eed)
        .source(source_of(store))
        .rebuild_policy(policy.write_settle(Duration::ZERO))
        .maintenance_interval(Duration::from_millis(20))
}

/// A source that yields `inner`'s batches with a pause before each, and can
/// be told to fail after some batches or to hang.
struct ScriptedSource {
    inner: Box<dyn KeySource>,
    pause: Duration,
    /// Batches after which the next scans fail; `NEVER` for none.
    fail_after_batches: AtomicUsize,
    /// Batches after which the next scans hang; `NEVER` for none.
    hang_after_batches: AtomicUsize,
}

const NEVER: usize = usize::MAX;

impl ScriptedSource {
    fn new(inner: impl KeySource) -> Self {
        Self::pausing(inner, Duration::ZERO)
    }

    fn pausing(inner: impl KeySource, pause: Duration) -> Self {
        Self {
            inner: Box::new(inner),
            pause,
            fail_after_batches: AtomicUsize::new(NEVER),
            hang_after_batches: AtomicUsize::new(NEVER),
        }
    }
}

impl KeySource for ScriptedSource {
    fn scan(&self) -> KeyStream<'_> {
        Box::pin(ScriptedStream {
            inner: self.inner.scan(),
            pause: self.pause,
            sleep: None,
            yielded: 0,
            fail_after: self.fail_after_batches.load(Ordering::SeqCst),
            hang_after: self.hang_after_batches.load(Ordering::SeqCst),
        })
    }
}

struct ScriptedStream<'a> {
    inner: KeyStream<'a>,
    pause: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    yielded: usize,
    fail_after: usize,
    hang_after: usize,
}

impl Stream for ScriptedStream<'_> {
    type Item = Result<KeyBatch, SourceError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.fail_after == self.yielded {
            return Poll::Ready(Some(Err(SourceError::new("connection reset by peer"))));
        }
        if self.hang_after == self.yielded {
            return Poll::Pending;
        }
        if !self.pause.is_zero() {
            let pause = self.pause;
            let sleep = self
                .sleep
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(pause)));
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.sleep = None;
        }
        let next = self.inner.as_mut().poll_next(cx);
        if let Poll::Ready(Some(Ok(_))) = next {
            self.yielded += 1;
        }
        next
    }
}

fn assert_all_present(guard: &Guard, keys: &[String], when: &str) {
    let missing = keys
        .iter()
        .filter(|k| guard.check(k.as_bytes()) == Verdict::Absent)
        .count();
    assert_eq!(missing, 0, "{missing} false negatives {when}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_false_negatives_across_rebuilds_with_concurrent_writers() {
    let initial = keys(0, 200_000);
    let store = store_with(&initial);
    // ~50 batches with a pause before each: the scan overlaps the writers.
    let source = ScriptedSource::pausing(source_of(&store), Duration::from_millis(2));
    let guard = Guard::builder()
        .name("rebuild")
        .expected_items(100_000)
        .source(source)
        .rebuild_policy(RebuildPolicy::default().write_settle(Duration::ZERO))
        .build()
        .unwrap();
    guard.rebuild().await.unwrap();
    assert_all_present(&guard, &initial, "after the first build");

    // Set when the writers are to stop, and by the drop should the test
    // panic first (they would spin on for the rest of the binary).
    let stopped = Arc::new(AtomicBool::new(false));
    let stop_writers = StopOnDrop(&stopped);
    let writers: Vec<_> = (0..2u64)
        .map(|w| {
            let (guard, store, stopped) = (guard.clone(), Arc::clone(&store), Arc::clone(&stopped));
            std::thread::spawn(move || {
                let mut written = Vec::new();
                let mut n = 1_000_000 + w * 10_000_000;
                while !stopped.load(Ordering::Relaxed) || written.len() < 20_000 {
                    let key = keys(n, 1).pop().unwrap();
                    // The ordering rule: guard first, then the store. The
                    // pending write holds a rebuild's scan until the store
                    // has the key, however long this thread is descheduled.
                    let pending = guard.begin_write(&key);
                    store.write().unwrap().insert(key.as_bytes().to_vec());
                    drop(pending);
                    written.push(key);
                    n += 1;
                }
                written
            })
        })
        .collect();

    let mut generations = HashSet::new();
    for _ in 0..3 {
        let report = guard.rebuild().await.unwrap();
        assert_eq!(report.outcome, RebuildOutcome::Succeeded);
        generations.insert(guard.stats().swaps);
    }
    drop(stop_writers);
    let mut written = Vec::new();
    for writer in writers {
        written.extend(writer.join().unwrap());
    }
    assert!(written.len() >= 40_000);
    assert_eq!(
        generations.len(),
        3,
        "every rebuild swapped a new filter in"
    );
    assert_all_present(&guard, &initial, "inserted before the rebuilds");
    assert_all_present(&guard, &written, "inserted during and between the rebuilds");

    // And a rebuild after the writers stopped reads them all from the store.
    let report = guard.rebuild().await.unwrap();
    assert_eq!(report.keys as usize, initial.len() + written.len());
    assert_all_present(&guard, &written, "after a final rebuild");
}

/// A bulk load: threads inserting in tight loops while a rebuild waits for
/// the inserts that may have missed its new filter. Each insert counted
/// itself in for its whole run, whether it saw the new filter or not, so
/// the count the rebuild waits on was almost never zero at once across
/// the threads, and the rebuild timed out waiting for writes none of which
/// it needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_load_of_inserts_does_not_starve_a_rebuild() {
    rebuild_during_a_bulk_load(4).await;
}

/// The same with far more threads than the count has stripes (a stripe per
/// core, 64 at most): each insert still passes through the count before it
/// sees the new filter, so with 64 threads one pass finding every stripe at
/// zero at once was as good as never, and the rebuild timed out (so did a
/// wait for each stripe at zero once, in half the runs). The wait now sends
/// new inserts to the count's other side while it drains one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_load_on_many_threads_does_not_starve_a_rebuild() {
    rebuild_during_a_bulk_load(64).await;
}

/// Rebuilds once while `threads` threads insert new keys in tight loops,
/// and asserts that the rebuild succeeded within its 30 s timeout (the
/// starved one never did; a loaded machine may take seconds).
async fn rebuild_during_a_bulk_load(threads: u64) {
    let store = store_with(&keys(0, 1_000));
    let guard = Guard::builder()
        .expected_items(1_000_000)
        .source(source_of(&store))
        .rebuild_policy(
            RebuildPolicy::default()
                .write_settle(Duration::ZERO)
                .timeout(Duration::from_secs(30)),
        )
        .build()
        .unwrap();
    let stopped = Arc::new(AtomicBool::new(false));
    let stop_loaders = StopOnDrop(&stopped);
    let loaders: Vec<_> = (0..threads)
        .map(|thread| {
            let (guard, stopped) = (guard.clone(), Arc::clone(&stopped));
            std::thread::spawn(move || {
                let mut key = thread << 48;
                while !stopped.load(Ordering::Relaxed) {
                    guard.insert(key.to_le_bytes());
                    key += 1;
                }
                key - (thread << 48)
            })
        })
        .collect();
    // Every loader under way before the rebuild begins.
    wait_until("the loaders to insert", || guard.stats().inserts > 100_000).await;
    let rebuilt = guard.rebuild().await;
    drop(stop_loaders);
    let inserted: u64 = loaders.into_iter().map(|l| l.join().unwrap()).sum();
    assert!(
        rebuilt.is_ok(),
        "{rebuilt:?} with {inserted} keys inserted meanwhile"
    );
}

/// 1,000 keys in one batch, a pass over them taking 200 ms (a pause before
/// the batch and one before the end).
fn read_in_200_ms() -> ScriptedSource {
    let store = store_with(&keys(0, 1_000));
    ScriptedSource::pausing(source_of(&store), Duration::from_millis(100))
}

/// A first build whose guess was far too small reads the source twice. A
/// timeout in the second pass lost the first pass's count: every retry
/// guessed the same, read twice, and timed out again, warming for good,
/// where one pass at the counted size fits the timeout.
#[tokio::test(start_paused = true)]
async fn a_count_from_a_rebuild_that_timed_out_sizes_the_retry() {
    let guard = Guard::builder()
        .expected_items(10)
        .source(read_in_200_ms())
        .rebuild_policy(
            RebuildPolicy::default()
                .write_settle(Duration::ZERO)
                .timeout(Duration::from_millis(300)),
        )
        .build()
        .unwrap();
    let first = guard.rebuild().await;
    assert!(matches!(first, Err(RebuildError::TimedOut(_))), "{first:?}");
    let retry = guard.rebuild().await.unwrap();
    assert_eq!((retry.passes, retry.keys), (1, 1_000));
    assert!(!guard.is_warming());
}

/// A guard of 10,000 items over `store`, within a memory budget of 64 KiB.
fn within_64_kib(store: &Store) -> Guard {
    Guard::builder()
        .expected_items(10_000)
        .max_bytes(64 * 1024)
        .source(source_of(store))
        .rebuild_policy(RebuildPolicy::default().write_settle(Duration::ZERO))
        .build()
        .unwrap()
}

/// A rebuild's first guess comes from the live filters' fill, which counts
/// keys deleted from the store (or never written) too. Past the memory
/// budget, every retry failed the same way (`TooLarge`), though the store's
/// keys fit it: the guard served its overfull filter for good.
#[tokio::test]
async fn a_guess_over_the_memory_budget_reads_the_source_within_it() {
    let store = store_with(&keys(0, 10_000));
    let guard = within_64_kib(&store);
    guard.rebuild().await.unwrap();
    // Inserted, then deleted from the store.
    for key in keys(10_000, 40_000) {
        guard.insert(key);
    }
    let report = guard.rebuild().await.unwrap();
    assert_eq!((report.passes, report.keys), (1, 10_000));
    let bytes = guard.live_filters().newest().unwrap().stats().bits / 8;
    assert!(bytes <= 64 * 1024, "a filter of {bytes} bytes");
}

/// A store that outgrew the memory budget fails its rebuilds; once it fits
/// again they succeed. The count of the pass that found it too large sized
/// every retry, unchecked against the budget: each failed before reading
/// the store again, and the guard never rebuilt (or stayed warming).
#[tokio::test]
async fn a_store_back_within_the_memory_budget_rebuilds_again() {
    let store = store_with(&keys(0, 10_000));
    let guard = within_64_kib(&store);
    guard.rebuild().await.unwrap();
    store
        .write()
        .unwrap()
        .extend(keys(10_000, 50_000).into_iter().map(String::into_bytes));
    let error = guard.rebuild().await.unwrap_err();
    assert!(matches!(error, RebuildError::Config(_)), "{error}");
    *store.write().unwrap() = keys(0, 10_000)
        .into_iter()
        .map(String::into_bytes)
        .collect();
    let report = guard.rebuild().await.unwrap();
    assert_eq!(report.keys, 10_000);
}

/// A manual rebuild at startup beside the maintenance task's first build:
/// the task, finding a build due, waited for the manual one's lock and then
/// read the whole store again, though the manual one had done the build.
#[tokio::test(start_paused = true)]
async fn a_manual_rebuild_beside_the_tasks_first_build_reads_the_store_once() {
    let guard = Guard::builder()
        .expected_items(10_000)
        .source(read_in_200_ms())
        .rebuild_policy(RebuildPolicy::default().write_settle(Duration::ZERO))
        .maintenance_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let manual = rebuild_in_background(&guard).await;
    let _maintenance = guard.spawn_maintenance();
    manual.await.unwrap().unwrap();
    // Time for a second pass (200 ms), had the task begun one.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let rebuilds = guard.stats().rebuilds;
    assert_eq!((rebuilds.succeeded, rebuilds.failed), (1, 0));
}

/// Starts a rebuild on its own task and returns once it has installed the
/// filter it builds (before it reads the source).
async fn rebuild_in_background(
    guard: &Guard,
) -> tokio::task::JoinHandle<Result<bloomguard::RebuildReport, RebuildError>> {
    let rebuilding = tokio::spawn({
        let guard = guard.clone();
        async move { guard.rebuild().await }
    });
    wait_until("the rebuild to install its filter", || {
        guard.stats().rebuilding
    })
    .await;
    rebuilding
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_write_holds_the_rebuild_until_it_lands() {
    let store = store_with(&[]);
    let guard = manual_guard(1_000, source_of(&store));
    guard.rebuild().await.unwrap();

    let pending = guard.begin_write("slow:write");
    let rebuilding = rebuild_in_background(&guard).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !rebuilding.is_finished(),
        "the rebuild must not read the source while a write is pending"
    );
    store.write().unwrap().insert(b"slow:write".to_vec());
    drop(pending);
    rebuilding.await.unwrap().unwrap();
    assert_eq!(guard.check("slow:write"), Verdict::MaybePresent);

    // insert_then_write covers the write the same way.
    let written = guard
        .insert_then_write("fast:write", async {
            store.write().unwrap().insert(b"fast:write".to_vec())
        })
        .await;
    assert!(written);
    guard.rebuild().await.unwrap();
    assert_eq!(guard.check("fast:write"), Verdict::MaybePresent);
}

/// A write begun while one rebuild ran went into that rebuild's filter (and
/// so did not hold it), but its store write may land after the *next*
/// rebuild's scan: the next rebuild must wait for it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_begun_during_one_rebuild_holds_the_next() {
    let store = store_with(&keys(0, 100));
    let source = ScriptedSource::pausing(source_of(&store), Duration::from_millis(300));
    let guard = manual_guard(1_000, source);
    guard.rebuild().await.unwrap();

    let first = rebuild_in_background(&guard).await;
    let pending = guard.begin_write("slow:write");
    first.await.unwrap().unwrap();

    let second = rebuild_in_background(&guard).await;
    tokio::time::sleep(Duration::from_millis(900)).await;
    assert!(
        !second.is_finished(),
        "the second rebuild must not read the source while a write begun during the first is pending"
    );
    store.write().unwrap().insert(b"slow:write".to_vec());
    drop(pending);
    second.await.unwrap().unwrap();
    assert_eq!(guard.check("slow:write"), Verdict::MaybePresent);
}

/// A fleet snapshot merged while a rebuild runs may hold keys whose store
/// writes land after the scan; a rebuilt filter of another size cannot take
/// the merge, so the rebuild must fail rather than swap those keys away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_merged_during_a_rebuild_is_not_swapped_away() {
    let store = store_with(&keys(0, 5_000));
    let source = ScriptedSource::pausing(source_of(&store), Duration::from_millis(300));
    let guard = manual_guard(1_000, source);
    guard.rebuild().await.unwrap();
    // Three times the keys: the next rebuild sizes a larger filter.
    for key in keys(5_000, 10_000) {
        guard.insert(&key);
        store.write().unwrap().insert(key.into_bytes());
    }
    let newest = guard.live_filters().newest().unwrap().to_bytes();
    let snapshot = AtomicBloom::from_bytes(&newest).unwrap();
    snapshot.insert("only:in:the:snapshot");

    let rebuilding = rebuild_in_background(&guard).await;
    guard.merge_filter(snapshot).unwrap();
    let error = rebuilding.await.unwrap().unwrap_err();
    assert!(
        matches!(error, RebuildError::MergedDuringRebuild),
        "{error}"
    );
    assert_eq!(guard.stats().rebuilds.failed, 1);
    assert_eq!(guard.check("only:in:the:snapshot"), Verdict::MaybePresent);

    // Once the store has the key, a rebuild reads it.
    store
        .write()
        .unwrap()
        .insert(b"only:in:the:snapshot".to_vec());
    guard.rebuild().await.unwrap();
    assert_eq!(guard.check("only:in:the:snapshot"), Verdict::MaybePresent);
}

#[tokio::test]
async fn a_failing_source_leaves_the_old_filter_serving() {
    let initial = keys(0, 20_000);
    let store = store_with(&initial);
    let source = Arc::new(ScriptedSource::new(source_of(&store)));
    let guard = manual_guard(10_000, Arc::clone(&source));
    guard.rebuild().await.unwrap();
    let swaps = guard.stats().swaps;

    source.fail_after_batches.store(2, Ordering::SeqCst);
    let error = guard.rebuild().await.unwrap_err();
    assert!(matches!(error, RebuildError::Source(_)), "{error}");
    assert!(error.to_string().contains("connection reset"), "{error}");
    let stats = guard.stats();
    assert_eq!(stats.rebuilds.failed, 1);
    assert_eq!(stats.swaps, swaps, "no swap after a failure");
    assert!(!stats.rebuilding, "the abandoned filter is gone");
    let report = stats.last_rebuild.expect("the failed attempt is reported");
    assert_eq!(report.outcome, RebuildOutcome::Failed);
    assert!(
        matches!(&report.error, Some(RebuildError::Source(cause)) if cause.to_string().contains("connection reset")),
        "the report keeps the typed error: {:?}",
        report.error
    );
    assert_all_present(&guard, &initial, "after a failed rebuild");

    source.fail_after_batches.store(NEVER, Ordering::SeqCst);
    guard.rebuild().await.unwrap();
    assert_eq!(guard.stats().rebuilds.succeeded, 2);
    assert_all_present(&guard, &initial, "after a later rebuild");
}

// A paused clock: the 300 ms timeout runs out only once the source hangs,
// however long the passes that succeed take on a loaded machine.
#[tokio::test(start_paused = true)]
async fn a_hanging_source_times_out_and_a_later_rebuild_succeeds() {
    let initial = keys(0, 20_000);
    let store = store_with(&initial);
    let source = Arc::new(ScriptedSource::new(source_of(&store)));
    let guard = Guard::builder()
        .expected_items(10_000)
        .source(Arc::clone(&source))
        .rebuild_policy(
            RebuildPolicy::default()
                .write_settle(Duration::ZERO)
                .timeout(Duration::from_millis(300)),
        )
        .build()
        .unwrap();
    guard.rebuild().await.unwrap();

    source.hang_after_batches.store(1, Ordering::SeqCst);
    let error = guard.rebuild().await.unwrap_err();
    assert!(matches!(error, RebuildError::TimedOut(_)), "{error}");
    let stats = guard.stats();
    assert_eq!(stats.rebuilds.timed_out, 1);
    assert!(!stats.rebuilding);
    assert_all_present(&guard, &initial, "after a timed-out rebuild");

    source.hang_after_batches.store(NEVER, Ordering::SeqCst);
    guard.rebuild().await.unwrap();
    assert_all_present(&guard, &initial, "after a later rebuild");
}

/// A write held open past the rebuild's timeout (a `PendingWrite` leaked,
/// or a slow request under an `InsertLayer`) fails every rebuild; the error
/// says so, rather than leaving a timed-out source to blame.
#[tokio::test(start_paused = true)]
async fn a_write_held_open_past_the_timeout_is_named_in_the_error() {
    let initial = keys(0, 1_000);
    let store = store_with(&initial);
    let guard = Guard::builder()
        .expected_items(10_000)
        .source(source_of(&store))
        .rebuild_policy(RebuildPolicy::default().timeout(Duration::from_secs(30)))
        .build()
        .unwrap();
    guard.rebuild().await.unwrap();

    let held = guard.begin_write("held");
    let error = guard.rebuild().await.unwrap_err();
    assert!(
        error.to_string().contains("writes begun before it"),
        "{error}"
    );
    assert!(matches!(error, RebuildError::WritesStillOpen(_)), "{error}");
    assert_eq!(guard.stats().rebuilds.timed_out, 1);

    drop(held);
    guard.rebuild().await.unwrap();
    assert_all_present(&guard, &initial, "after the write closed");
}

#[tokio::test]
async fn a_dropped_rebuild_is_counted_as_cancelled() {
    let initial = keys(0, 50_000);
    let store = store_with(&initial);
    let source = ScriptedSource::pausing(source_of(&store), Duration::from_millis(20));
    let guard = manual_guard(50_000, source);
    guard.rebuild().await.unwrap();

    let cancelled = tokio::time::timeout(Duration::from_millis(50), guard.rebuild()).await;
    assert!(cancelled.is_err(), "the rebuild was still streaming");
    let stats = guard.stats();
    assert_eq!(stats.rebuilds.cancelled, 1);
    assert!(!stats.rebuilding);
    assert_all_present(&guard, &initial, "after a cancelled rebuild");
}

#[tokio::test]
async fn a_source_larger_than_guessed_is_read_again_at_its_size() {
    let initial = keys(0, 60_000);
    let store = store_with(&initial);
    let guard = manual_guard(10_000, source_of(&store));
    let report = guard.rebuild().await.unwrap();
    assert_eq!((report.passes, report.keys), (2, 60_000));
    assert_eq!(
        report.capacity, 90_000,
        "counted × the default headroom of 1.5"
    );
    let stats = guard.stats();
    assert!(stats.estimated_fpr <= stats.target_fpr, "{stats:?}");
    assert_all_present(&guard, &initial, "after a two-pass rebuild");
}

#[tokio::test]
async fn warming_never_answers_absent() {
    let initial = keys(0, 20_000);
    let store = store_with(&initial);
    let source = ScriptedSource::pausing(source_of(&store), Duration::from_millis(30));
    let guard = Guard::builder()
        .expected_items(20_000)
        .seed(0x5eed)
        .source(source)
        .build()
        .unwrap();
    assert!(guard.is_warming());
    let probes = absent_keys(0, 1_000);
    for key in &probes {
        assert_eq!(guard.check(key), Verdict::Warming);
    }
    guard.insert("inserted:while:warming");
    store
        .write()
        .unwrap()
        .insert(b"inserted:while:warming".to_vec());

    let maintenance = guard.spawn_maintenance();
    // While the first build streams, no answer is Absent: a check followed
    // by "still warming" happened before the build completed.
    let mut checked_while_warming = 0;
    while guard.is_warming() {
        for key in probes.iter().take(50) {
            let verdict = guard.check(key);
            if guard.is_warming() {
                assert_ne!(verdict, Verdict::Absent);
                checked_while_warming += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(checked_while_warming > 0);
    maintenance.shutdown().await;
    assert_all_present(&guard, &initial, "after the first build");
    assert_eq!(guard.check("inserted:while:warming"), Verdict::MaybePresent);
    let absent = probes.iter().filter(|k| guard.check(k).is_absent()).count();
    assert!(absent > 950, "the built filter answers absent: {absent}");
    let stats = guard.stats();
    assert!(stats.checks.warming >= 1_000);
    assert_eq!(stats.rebuilds.succeeded, 1);
}

#[test]
fn rotation_forgets_keys_older_than_the_window_in_bounded_memory() {
    let generations = 3;
    let guard = Guard::builder()
        .expected_items(10_000)
        .lifecycle(Lifecycle::rotate(generations, Duration::from_secs(3600)))
        .seed(7)
        .build()
        .unwrap();
    let windows: Vec<Vec<String>> = (0..6).map(|w| keys(w * 10_000, 10_000)).collect();
    let memory = guard.stats().memory_bytes;

    for (age, window) in windows.iter().enumerate() {
        for key in window {
            guard.insert(key);
        }
        // Every window inserted in the last `generations` periods is present.
        for recent in windows[age.saturating_sub(generations - 1)..=age].iter() {
            assert_all_present(&guard, recent, "inside the window");
        }
        // Windows older than that are gone, up to false positives.
        for old in windows[..age.saturating_sub(generations - 1)].iter() {
            let still = old.iter().filter(|k| !guard.check(k).is_absent()).count();
            let limit = three_sigma_limit(0.01, old.len()) * old.len() as f64;
            assert!((still as f64) <= limit, "{still} old keys still present");
        }
        guard.rotate().unwrap();
        let stats = guard.stats();
        assert!(stats.generations <= generations);
    }
    for _ in 0..100 {
        guard.rotate().unwrap();
    }
    let stats = guard.stats();
    assert_eq!(stats.generations, generations);
    assert!(
        stats.memory_bytes <= generations * memory,
        "{} bytes after many rotations, one generation is {memory}",
        stats.memory_bytes
    );
}

#[tokio::test(start_paused = true)]
async fn the_maintenance_task_rotates_on_time() {
    let period = Duration::from_secs(60);
    let guard = Guard::builder()
        .expected_items(1_000)
        .lifecycle(Lifecycle::rotate(2, period))
        .build()
        .unwrap();
    let maintenance = guard.spawn_maintenance();
    let first = guard.stats().swaps;
    guard.insert("old");
    tokio::time::sleep(period + Duration::from_secs(1)).await;
    assert_eq!(guard.stats().swaps, first + 1);
    assert_eq!(guard.check("old"), Verdict::MaybePresent, "one period old");
    guard.insert("young");
    tokio::time::sleep(period).await;
    assert_eq!(guard.stats().swaps, first + 2);
    assert_eq!(guard.check("old"), Verdict::Absent, "two periods old: gone");
    assert_eq!(guard.check("young"), Verdict::MaybePresent);
    maintenance.shutdown().await;
}

#[test]
fn growth_keeps_the_compound_fpr_under_target() {
    let target = 0.01;
    let guard = Guard::builder()
        .expected_items(10_000)
        .false_positive_rate(target)
        .lifecycle(Lifecycle::grow(2.0))
        .seed(7)
        .build()
        .unwrap();
    let inserted = keys(0, 100_000);
    for key in &inserted {
        guard.insert(key);
    }
    let stats = guard.stats();
    assert!(stats.generations >= 4, "grew: {stats:?}");
    assert!(stats.capacity >= 100_000, "{stats:?}");
    assert!(stats.estimated_fpr <= target, "{stats:?}");
    assert_all_present(&guard, &inserted, "after growing");

    let probes = absent_keys(0, 200_000);
    let false_positives = probes
        .iter()
        .filter(|k| !guard.check(k).is_absent())
        .count();
    let measured = false_positives as f64 / probes.len() as f64;
    assert!(
        measured <= three_sigma_limit(target, probes.len()),
        "compound FPR {measured} over the target {target}"
    );
}

/// Growth stops at 32 filters; past the last one's capacity the guard keeps
/// every key in it (its rate climbs, it loses none). With `grow(1.0)` the
/// halving rates used to fall below what a filter can be sized for at the
/// 19th: growth stopped there, and logged a warning at every sampled insert
/// after.
#[test]
fn growth_stops_at_its_last_filter_and_loses_no_key() {
    let guard = Guard::builder()
        .expected_items(100)
        .lifecycle(Lifecycle::grow(1.0))
        .seed(7)
        .build()
        .unwrap();
    let inserted = keys(0, 100 * 40);
    for key in &inserted {
        guard.insert(key);
    }
    let stats = guard.stats();
    assert_eq!(stats.generations, 32, "{stats:?}");
    assert_all_present(&guard, &inserted, "past the last filter's capacity");
}

#[test]
fn an_overfilled_guard_without_growth_reports_drift() {
    let guard = Guard::builder().expected_items(10_000).build().unwrap();
    for key in keys(0, 40_000) {
        guard.insert(key);
    }
    let stats = guard.stats();
    assert!(stats.estimated_drift > 2.0, "{stats:?}");
    assert!(stats.estimated_items > 30_000.0, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_triggers_a_rebuild_that_restores_the_target() {
    let store = store_with(&[]);
    let policy = RebuildPolicy::default()
        .when_drift_exceeds(2.0)
        .retry_backoff(Duration::from_millis(10), Duration::from_millis(100));
    let guard = maintained(10_000, &store, policy).build().unwrap();
    guard.rebuild().await.unwrap();
    let overfill = keys(0, 50_000);
    for key in &overfill {
        guard.insert(key);
        store.write().unwrap().insert(key.as_bytes().to_vec());
    }
    assert!(guard.stats().estimated_drift > 2.0);
    let maintenance = guard.spawn_maintenance();
    wait_until("a drift rebuild", || guard.stats().rebuilds.succeeded >= 2).await;
    let stats = guard.stats();
    assert!(
        stats.estimated_fpr <= stats.target_fpr,
        "after the drift rebuild: {stats:?}"
    );
    assert!(stats.capacity >= 50_000);
    assert_all_present(&guard, &overfill, "after the drift rebuild");
    maintenance.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removals_past_the_threshold_trigger_a_rebuild() {
    let initial = keys(0, 1_000);
    let store = store_with(&initial);
    let policy = RebuildPolicy::default().when_removed_exceeds(0.1);
    let guard = maintained(1_000, &store, policy).build().unwrap();
    guard.rebuild().await.unwrap();
    let maintenance = guard.spawn_maintenance();
    for key in &initial[..150] {
        store.write().unwrap().remove(key.as_bytes());
        guard.note_removals(1);
    }
    wait_until("a removal rebuild", || {
        guard.stats().rebuilds.succeeded >= 2
    })
    .await;
    let stats = guard.stats();
    assert_eq!(stats.removed_since_rebuild, 0);
    assert_eq!(stats.last_rebuild.unwrap().keys, 850);
    let forgotten = initial[..150]
        .iter()
        .filter(|k| guard.check(k).is_absent())
        .count();
    assert!(
        forgotten > 130,
        "removed keys are gone after the rebuild: {forgotten}"
    );
    maintenance.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_staleness_check_catches_writes_that_bypassed_the_guard() {
    let store = store_with(&keys(0, 1_000));
    let verified = Arc::clone(&store);
    let guard = maintained(10_000, &store, RebuildPolicy::default())
        .staleness_check(1.0, move |key| {
            let found = verified.read().unwrap().contains(&key);
            async move { Ok(found) }
        })
        .build()
        .unwrap();
    let maintenance = guard.spawn_maintenance();
    wait_until("the first build", || !guard.is_warming()).await;

    // A writer that forgot the guard.
    store.write().unwrap().insert(b"bypassed:1".to_vec());
    assert_eq!(guard.check("bypassed:1"), Verdict::Absent);
    wait_until("the stale negative to be found", || {
        guard.stats().stale_negatives >= 1
    })
    .await;
    // Inserted at once, and the rebuild it asks for (other keys may have
    // bypassed the guard too) follows.
    assert_eq!(guard.check("bypassed:1"), Verdict::MaybePresent);
    wait_until("the stale rebuild", || {
        guard.stats().rebuilds.succeeded >= 2
    })
    .await;
    assert_eq!(guard.stats().stale_negatives, 1);

    // Keys that really are absent are not reported.
    for key in absent_keys(0, 100) {
        let _ = guard.check(key);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(guard.stats().stale_negatives, 1);
    maintenance.shutdown().await;
}

/// A key the staleness check found in the store is one the guard must not
/// answer `Absent` for again: it goes into the filter at once, and a guard
/// without a source (no rebuild to wait for) answers "maybe" for it from
/// then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_staleness_check_found_is_inserted() {
    let guard = sourceless_checked_by(|key| async move { Ok(key == b"bypassed") });
    let maintenance = guard.spawn_maintenance();
    assert_eq!(guard.check("bypassed"), Verdict::Absent);
    wait_until("the stale negative to be found", || {
        guard.stats().stale_negatives >= 1
    })
    .await;
    assert_eq!(guard.check("bypassed"), Verdict::MaybePresent);
    maintenance.shutdown().await;
}

/// A staleness check that fails (an ACL, a store down) or panics checks
/// nothing: that shows in the statistics rather than as "no stale answer",
/// and a panic in it stops neither the checks after it nor the task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_or_panicking_staleness_check_is_counted_and_the_task_goes_on() {
    let guard = sourceless_checked_by(|key: Vec<u8>| async move {
        match key.as_slice() {
            b"refused" => Err(SourceError::new(std::io::Error::other("NOAUTH"))),
            b"panics" => panic!("a bug in the check"),
            _ => Ok(false),
        }
    });
    let maintenance = guard.spawn_maintenance();
    assert_eq!(guard.check("refused"), Verdict::Absent);
    wait_until("the failed check to be counted", || {
        guard.stats().staleness_checks_failed >= 1
    })
    .await;
    assert_eq!(guard.check("panics"), Verdict::Absent);
    wait_until("the panicking check to be counted", || {
        guard.stats().staleness_checks_failed >= 2
    })
    .await;
    assert!(!maintenance.is_finished(), "the task goes on");
    assert_eq!(guard.stats().stale_negatives, 0);
    maintenance.shutdown().await;
}

/// A store that refuses every staleness check (down, or a circuit breaker
/// open) was asked about every queued sample at once, one after another,
/// the maintenance task spinning through its loop for each: 1,000 calls in
/// no time against a store already failing. After a failed check the task
/// now waits before the next, doubling up to a few seconds.
#[tokio::test(start_paused = true)]
async fn a_failing_staleness_check_backs_off() {
    let calls = Arc::new(AtomicUsize::new(0));
    let guard = sourceless_checked_by({
        let calls = Arc::clone(&calls);
        move |_key: Vec<u8>| {
            calls.fetch_add(1, Ordering::Relaxed);
            async {
                Err(SourceError::new(std::io::Error::other(
                    "connection refused",
                )))
            }
        }
    });
    let maintenance = guard.spawn_maintenance();
    for n in 0..1_000 {
        assert_eq!(guard.check(format!("item:{n}")), Verdict::Absent);
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    let asked = calls.load(Ordering::Relaxed);
    assert!(
        (2..=20).contains(&asked),
        "{asked} checks of 1,000 samples in 10 s against a failing store"
    );
    maintenance.shutdown().await;
}

/// A guard without a source whose maintenance asks `exists` about every
/// `Absent` answer.
fn sourceless_checked_by<F, Fut>(exists: F) -> Guard
where
    F: Fn(Vec<u8>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<bool, SourceError>> + Send + 'static,
{
    Guard::builder()
        .expected_items(1_000)
        .maintenance_interval(Duration::from_millis(20))
        .staleness_check(1.0, exists)
        .build()
        .unwrap()
}

#[tokio::test]
async fn the_maintenance_task_ends_with_its_handle_or_its_guard() {
    let guard = Guard::builder().expected_items(1_000).build().unwrap();
    let handle = guard.spawn_maintenance();
    assert!(!handle.is_finished());
    handle.shutdown().await;

    let handle = guard.spawn_maintenance();
    drop(guard);
    wait_until("the task to see the guard gone", || handle.is_finished()).await;
}

#[test]
fn stats_count_checks_outcomes_and_pass_through() {
    let guard = Guard::builder()
        .name("stats")
        .expected_items(10_000)
        .build()
        .unwrap();
    for key in keys(0, 1_000) {
        guard.insert(key);
    }
    for key in keys(0, 100) {
        assert_eq!(guard.check(&key), Verdict::MaybePresent);
        guard.record_outcome(true);
    }
    let mut false_positives = 0;
    for key in absent_keys(0, 900) {
        if guard.check(&key) == Verdict::MaybePresent {
            guard.record_outcome(false);
            false_positives += 1;
        }
    }
    let stats = guard.stats();
    assert_eq!(stats.name, "stats");
    assert_eq!(stats.inserts, 1_000);
    assert_eq!(stats.checks.total(), 1_000);
    assert_eq!(stats.checks.maybe_present, 100 + false_positives);
    assert_eq!(stats.found, 100);
    assert_eq!(stats.false_positives, false_positives);
    let expected_pass = (100 + false_positives) as f64 / 1_000.0;
    assert!((stats.pass_through_ratio - expected_pass).abs() < 1e-12);
    let observed = false_positives as f64 / 900.0;
    assert!((stats.observed_fpr.unwrap() - observed).abs() < 1e-12);
    assert!((stats.observed_drift.unwrap() - observed / 0.01).abs() < 1e-9);
    assert!((stats.estimated_items - 1_000.0).abs() < 50.0, "{stats:?}");
    assert!(stats.estimated_fpr < 0.01 && stats.fill_ratio > 0.0);
    assert_eq!(stats.generations, 1);
    assert!(stats.memory_bytes >= 10_000 * 9 / 8);
}

#[test]
fn bad_options_are_named_errors() {
    let out_of_range = |result: Result<Guard, ConfigError>| match result {
        Err(ConfigError::OutOfRange { parameter, .. }) => parameter,
        other => panic!("expected OutOfRange, got {other:?}"),
    };
    assert_eq!(
        out_of_range(Guard::builder().false_positive_rate(1.5).build()),
        "false_positive_rate"
    );
    assert_eq!(
        out_of_range(Guard::builder().expected_items(0).build()),
        "expected_items"
    );
    assert_eq!(
        out_of_range(
            Guard::builder()
                .lifecycle(Lifecycle::rotate(1, Duration::from_secs(1)))
                .build()
        ),
        "generations"
    );
    assert_eq!(
        out_of_range(Guard::builder().lifecycle(Lifecycle::grow(0.5)).build()),
        "expansion"
    );
    // A rebuild's timeout counts its write settle: every attempt would time
    // out, and a guard with a source would stay warming for ever.
    assert_eq!(
        out_of_range(
            Guard::builder()
                .rebuild_policy(
                    RebuildPolicy::default()
                        .timeout(Duration::from_secs(1))
                        .write_settle(Duration::from_secs(1))
                )
                .build()
        ),
        "write_settle"
    );
    // A write lands within the settle of its insert, and a rotating guard
    // keeps the key for its window from the insert: a settle as long as the
    // window lets a key leave before its write lands (and a fleet member,
    // which counts from the write's first append, forget a write that the
    // writer still holds open).
    assert_eq!(
        out_of_range(
            Guard::builder()
                .lifecycle(Lifecycle::rotate(3, Duration::from_millis(500)))
                .rebuild_policy(RebuildPolicy::default().write_settle(Duration::from_secs(1)))
                .build()
        ),
        "write_settle"
    );
    assert_eq!(
        out_of_range(
            Guard::builder()
                .rebuild_policy(RebuildPolicy::default().when_drift_exceeds(0.5))
                .build()
        ),
        "drift threshold"
    );
    assert_eq!(
        out_of_range(
            Guard::builder()
                .staleness_check(0.0, |_| async { Ok(false) })
                .build()
        ),
        "staleness fraction"
    );
    assert!(matches!(
        Guard::builder().expected_items(u64::MAX / 2).build(),
        Err(ConfigError::TooLarge { .. })
    ));
}

#[tokio::test]
async fn rebuild_without_a_source_is_an_error() {
    let guard = Guard::builder().build().unwrap();
    assert!(matches!(guard.rebuild().await, Err(RebuildError::NoSource)));
}

#[test]
fn a_guard_is_send_sync_and_cheap_to_clone() {
    fn assert_send_sync<T: Send + Sync + Clone + 'static>() {}
    assert_send_sync::<Guard>();
    let guard = Guard::builder().build().unwrap();
    let clone = guard.clone();
    clone.insert("shared");
    assert_eq!(guard.check("shared"), Verdict::MaybePresent);
}

#[tokio::test]
async fn readers_and_batches_answer_as_check_does_across_swaps() {
    let initial = keys(0, 20_000);
    let store = store_with(&initial);
    let guard = manual_guard(40_000, source_of(&store));
    let mut reader = guard.reader();
    assert_eq!(reader.check(&initial[0]), Verdict::Warming);
    let mut verdicts = vec![Verdict::Absent; 3];
    guard.check_many(&initial[..3], &mut verdicts);
    assert_eq!(verdicts, [Verdict::Warming; 3]);

    guard.rebuild().await.unwrap();
    // The reader's cached filters were replaced: it must see the new ones.
    let later = keys(100_000, 1_000);
    for key in &later {
        guard.insert(key);
    }
    for key in initial.iter().chain(&later) {
        assert_eq!(reader.check(key), Verdict::MaybePresent, "{key}");
    }
    let probes: Vec<String> = initial
        .iter()
        .take(500)
        .cloned()
        .chain(absent_keys(0, 500))
        .collect();
    let mut batch = vec![Verdict::Warming; probes.len()];
    guard.check_many(&probes, &mut batch);
    let one_by_one: Vec<Verdict> = probes.iter().map(|k| guard.check(k)).collect();
    assert_eq!(batch, one_by_one);
    assert!(batch[..500].iter().all(|v| *v == Verdict::MaybePresent));

    // With several generations the batch ORs them like check does.
    let rotating = Guard::builder()
        .expected_items(1_000)
        .lifecycle(Lifecycle::rotate(3, Duration::from_secs(60)))
        .build()
        .unwrap();
    let (older, newer) = (keys(0, 500), keys(500, 500));
    older.iter().for_each(|k| rotating.insert(k));
    rotating.rotate().unwrap();
    newer.iter().for_each(|k| rotating.insert(k));
    let both: Vec<&String> = older.iter().chain(&newer).collect();
    let mut verdicts = vec![Verdict::Absent; both.len()];
    rotating.check_many(&both, &mut verdicts);
    assert!(verdicts.iter().all(|v| *v == Verdict::MaybePresent));

    reader.flush();
    let before = guard.stats().checks.total();
    for key in &probes[..10] {
        let _ = reader.check(key);
    }
    drop(reader);
    assert_eq!(
        guard.stats().checks.total(),
        before + 10,
        "a dropped reader flushes its counts"
    );
}

/// A reader's batch refreshes its cached filters; the single check after it
/// must not take a new set for the one it last answered from. The batch
/// frees the one-filter set the single check saw, and the rotation after it
/// allocates the next set on this thread, which a thread-caching allocator
/// (glibc's) serves from the freed set's address: a reader that compared
/// addresses answered from the generation rotated out, and missed the key.
#[test]
fn a_reader_sees_a_rotation_after_its_batch_refreshed_its_filters() {
    for round in 0..100 {
        let guard = Guard::builder()
            .expected_items(1_000)
            .lifecycle(Lifecycle::rotate(2, Duration::from_secs(3_600)))
            .build()
            .unwrap();
        let mut reader = guard.reader();
        let _ = reader.check("any");
        guard.rotate().unwrap();
        reader.check_many(&["any"], &mut [Verdict::Warming]);
        guard.rotate().unwrap();
        guard.insert("key");
        assert_eq!(reader.check("key"), Verdict::MaybePresent, "round {round}");
    }
}

/// A guard (seed 7) over `store` whose source fails at once until the test
/// sets its `fail_after_batches` to `NEVER`; the maintenance task, once
/// spawned, ticks every `interval` and retries with a backoff of
/// `(first, max)` milliseconds.
fn guard_failing_to_build(
    store: &Store,
    (first, max): (u64, u64),
    interval: Duration,
) -> (Guard, Arc<ScriptedSource>) {
    let source = Arc::new(ScriptedSource::new(source_of(store)));
    source.fail_after_batches.store(0, Ordering::SeqCst);
    let guard = Guard::builder()
        .expected_items(10_000)
        .seed(7)
        .source(Arc::clone(&source))
        .rebuild_policy(
            RebuildPolicy::default()
                .write_settle(Duration::ZERO)
                .retry_backoff(Duration::from_millis(first), Duration::from_millis(max)),
        )
        .maintenance_interval(interval)
        .build()
        .unwrap();
    (guard, source)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_builds_are_retried_with_backoff_until_one_succeeds() {
    let initial = keys(0, 5_000);
    let (guard, source) =
        guard_failing_to_build(&store_with(&initial), (20, 80), Duration::from_millis(5));
    let started = std::time::Instant::now();
    let maintenance = guard.spawn_maintenance();
    wait_until("three failed first builds", || {
        guard.stats().rebuilds.failed >= 3
    })
    .await;
    assert!(guard.is_warming(), "no filter until a build succeeds");
    assert_eq!(guard.check(&initial[0]), Verdict::Warming);

    source.fail_after_batches.store(NEVER, Ordering::SeqCst);
    let failing_for = started.elapsed();
    wait_until("the retry to succeed", || !guard.is_warming()).await;
    maintenance.shutdown().await;
    assert_all_present(&guard, &initial, "after the retried build");
    let stats = guard.stats();
    assert_eq!(stats.rebuilds.succeeded, 1);
    // Backoff steps double 20 → 40 → 80 ms (each wait half to all of its
    // step, so at least 40 ms from the third on): at most one attempt per
    // 20 ms however long the source failed, where 5 ms ticks made four
    // (and one more in flight at the switch).
    let most = 4 + failing_for.as_millis() / 20;
    assert!(
        u128::from(stats.rebuilds.failed) <= most,
        "{:?} in {failing_for:?}",
        stats.rebuilds
    );
}

/// A failed build is retried after its backoff, whatever the maintenance
/// interval: the task slept until its next tick, so with an interval of an
/// hour a guard whose first build failed for a moment stayed warming for
/// the hour.
#[tokio::test(start_paused = true)]
async fn a_failed_build_is_retried_after_its_backoff_not_at_the_next_tick() {
    let (guard, source) = guard_failing_to_build(
        &store_with(&keys(0, 1_000)),
        (1_000, 1_000),
        Duration::from_secs(3_600),
    );
    let maintenance = guard.spawn_maintenance();
    wait_until("the first build to fail", || {
        guard.stats().rebuilds.failed == 1
    })
    .await;
    source.fail_after_batches.store(NEVER, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert!(
        !guard.is_warming(),
        "not retried within 10 s of a 1 s backoff: {:?}",
        guard.stats().rebuilds
    );
    maintenance.shutdown().await;
}

/// A rebuild whose source panicked was recorded as cancelled (a shutdown),
/// hiding a source's bug in the stats and metrics.
#[tokio::test]
async fn a_rebuild_that_panics_is_recorded_as_failed() {
    let guard = Guard::builder()
        .expected_items(1_000)
        .source(source::from_fn(|| -> Vec<Vec<u8>> {
            panic!("a bug in the key source")
        }))
        .build()
        .unwrap();
    let rebuilt =
        futures_util::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(guard.rebuild())).await;
    assert!(rebuilt.is_err(), "the panic goes on to the caller");
    let stats = guard.stats();
    assert_eq!(
        (stats.rebuilds.failed, stats.rebuilds.cancelled),
        (1, 0),
        "{:?}",
        stats.last_rebuild
    );
}

/// A filter shaped like a default guard's (10,000 items at 1 %) with `seed`,
/// holding `keys`: what a fleet snapshot brings.
fn snapshot_holding(seed: u64, keys: &[&str]) -> AtomicBloom {
    let filter = AtomicBloom::with_seed(10_000, 0.01, seed).unwrap();
    for key in keys {
        filter.insert(key);
    }
    filter
}

/// A check hashes a key once, with the guard's seed, and probes whichever
/// filter is live with that hash: a filter of another seed among them would
/// miss its own keys (false `Absent`s). So a guard takes none, warming or not.
#[tokio::test]
async fn a_guard_refuses_filters_of_another_seed() {
    let stored = keys(0, 1_000);
    let store = store_with(&stored);
    let guard = Guard::builder()
        .expected_items(10_000)
        .seed(7)
        .source(source_of(&store))
        .build()
        .unwrap();
    let foreign = || snapshot_holding(8, &["fleet:only"]);
    let refused = guard.merge_filter(foreign()).unwrap_err();
    assert_eq!(refused.differs_in, FilterParameter::Seed, "while warming");
    assert!(guard.live_filters().iter().next().is_none());

    guard.rebuild().await.unwrap();
    let refused = guard.merge_filter(foreign()).unwrap_err();
    assert_eq!(refused.differs_in, FilterParameter::Seed, "while serving");
    assert_all_present(&guard, &stored, "after the refusals");
    guard
        .merge_filter(snapshot_holding(7, &["fleet:only"]))
        .unwrap();
    assert_eq!(guard.check("fleet:only"), Verdict::MaybePresent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merge_into_a_warming_guard_keeps_it_warming_until_its_first_build() {
    let stored = keys(0, 2_000);
    let store = store_with(&stored);
    let guard = Guard::builder()
        .expected_items(10_000)
        .seed(7)
        .source(source_of(&store))
        .rebuild_policy(RebuildPolicy::default().write_settle(Duration::ZERO))
        .build()
        .unwrap();
    guard
        .merge_filter(snapshot_holding(7, &["fleet:only"]))
        .unwrap();
    assert!(
        guard.is_warming(),
        "a merge is no complete pass over the source"
    );
    for key in &stored {
        assert_eq!(
            guard.check(key),
            Verdict::Warming,
            "{key} before the first build"
        );
    }

    let maintenance = guard.spawn_maintenance();
    tokio::time::timeout(Duration::from_secs(30), guard.ready())
        .await
        .expect("the first build still runs after a merge");
    assert_all_present(&guard, &stored, "after the first build");
    // `ready` may see the swap before the build's record lands in the stats.
    wait_until("the build's record", || {
        guard.stats().rebuilds.succeeded == 1
    })
    .await;
    maintenance.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merge_after_a_failed_first_build_keeps_the_guard_warming_and_retrying() {
    let stored = keys(0, 2_000);
    let (guard, source) =
        guard_failing_to_build(&store_with(&stored), (10, 20), Duration::from_millis(5));
    let maintenance = guard.spawn_maintenance();
    wait_until("a failed first build", || {
        guard.stats().rebuilds.failed >= 1
    })
    .await;
    guard
        .merge_filter(snapshot_holding(7, &["fleet:only"]))
        .unwrap();
    let failed_at_merge = guard.stats().rebuilds.failed;
    wait_until("more retries after the merge", || {
        guard.stats().rebuilds.failed >= failed_at_merge + 2
    })
    .await;
    assert!(guard.is_warming());
    assert_eq!(guard.check(&stored[0]), Verdict::Warming);

    source.fail_after_batches.store(NEVER, Ordering::SeqCst);
    tokio::time::timeout(Duration::from_secs(30), guard.ready())
        .await
        .expect("the retried first build");
    assert_all_present(&guard, &stored, "after the retried first build");
    maintenance.shutdown().await;
}

#[tokio::test]
async fn ready_with_a_timeout_says_when_the_guard_is_still_warming() {
    let store = store_with(&keys(0, 10));
    let guard = manual_guard(1_000, source_of(&store));
    let err = guard
        .ready_within(Duration::from_millis(20))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("warming"), "{err}");
    guard.rebuild().await.unwrap();
    guard.ready_within(Duration::from_millis(20)).await.unwrap();
    // A guard without a source is ready from the start.
    Guard::builder().build().unwrap().ready().await;
}

#[test]
fn a_saturated_filter_reads_finite_monotone_estimates() {
    // Every k, a tiny filter filled one key at a time until every bit is set.
    for k in 1..=bloomguard::filter::MAX_HASHES {
        let filter = AtomicBloom::with_params(2_048, k).unwrap();
        let mut last = filter.stats();
        let mut n = 0u64;
        while last.set_bits < filter.bits() {
            filter.insert(n.to_le_bytes());
            n += 1;
            let now = filter.stats();
            for (what, value) in [
                ("estimated_fpr", now.estimated_fpr),
                ("estimated_items", now.estimated_items),
            ] {
                assert!(
                    value.is_finite(),
                    "k = {k}, fill {}: {what} {value}",
                    now.fill_ratio
                );
            }
            // Monotone up to the model's rounding floor: its alternating sum
            // loses ~1e-16 × C(k, k/2), under 1e-9 for the k a plan picks
            // (≤ 24) and under 1e-6 for the largest explicit k.
            let rounding = if k <= 24 { 1e-9 } else { 1e-6 };
            assert!(
                now.estimated_fpr >= last.estimated_fpr - rounding,
                "k = {k}: {last:?} → {now:?}"
            );
            assert!(
                now.estimated_items >= last.estimated_items,
                "k = {k}: {last:?} → {now:?}"
            );
            assert!(now.estimated_fpr <= 1.0);
            last = now;
        }
        assert_eq!(last.fill_ratio, 1.0);
        assert_eq!(
            last.estimated_fpr, 1.0,
            "k = {k}: a full filter passes every key"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_guard_reports_its_drift_and_rebuilds() {
    let initial = keys(0, 1_000);
    let store = store_with(&initial);
    let policy = RebuildPolicy::default().when_drift_exceeds(2.0);
    let guard = maintained(1_000, &store, policy).build().unwrap();
    guard.rebuild().await.unwrap();
    let overfill = keys(1_000, 100_000);
    for key in &overfill {
        guard.insert(key);
        store.write().unwrap().insert(key.as_bytes().to_vec());
    }
    let stats = guard.stats();
    assert_eq!(stats.fill_ratio, 1.0, "{stats:?}");
    assert!(
        stats.estimated_drift.is_finite() && stats.estimated_drift > 2.0,
        "{stats:?}"
    );
    assert!(stats.estimated_items.is_finite(), "{stats:?}");

    let maintenance = guard.spawn_maintenance();
    wait_until("a drift rebuild of the saturated filter", || {
        guard.stats().rebuilds.succeeded >= 2
    })
    .await;
    let stats = guard.stats();
    assert!(stats.estimated_drift < 1.0, "after the rebuild: {stats:?}");
    assert_all_present(&guard, &overfill, "after the rebuild");
    maintenance.shutdown().await;
}

/// The first `ghost:{i}` key that `guard` lets through: a false positive
/// of its filter, which no store here holds.
fn a_false_positive(guard: &Guard) -> String {
    (0..)
        .map(|i| format!("ghost:{i}"))
        .find(|key| guard.check(key) == Verdict::MaybePresent)
        .unwrap()
}

/// A loader behind `guard` that finds a key where `store` holds it.
fn loader_over(
    guard: &Guard,
    store: &Store,
) -> GuardedLoader<String, impl Loader<String, Value = (), Error = std::io::Error> + use<>> {
    let held = Arc::clone(store);
    GuardedLoader::new(guard.clone(), move |key: String| {
        let found = held.read().unwrap().contains(key.as_bytes());
        async move { Ok::<_, std::io::Error>(found.then_some(())) }
    })
}

/// One absent key asked again and again (a bot on a missing id) that the
/// filter lets through: a loader's confirmed-absent cache answers it after
/// the first ask. Its hits are false positives, but one key is no evidence
/// of drift: a rebuild (same seed, same keys) lets it through again, and
/// rebuilding on it would rescan the store every tick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hot_false_positive_is_no_evidence_of_drift() {
    let store = store_with(&keys(0, 1_000));
    let policy = RebuildPolicy::default().when_drift_exceeds(2.0);
    let guard = maintained(1_000, &store, policy).build().unwrap();
    guard.rebuild().await.unwrap();
    let ghost = a_false_positive(&guard);
    let loader = loader_over(&guard, &store)
        .confirmed_absent_cache(100, Duration::from_secs(600))
        .unwrap();
    let maintenance = guard.spawn_maintenance();
    for (i, absent) in absent_keys(0, 20_000).into_iter().enumerate() {
        assert_eq!(loader.get(&absent).await.unwrap(), None);
        if i % 20 == 0 {
            assert_eq!(loader.get(&ghost).await.unwrap(), None);
        }
    }
    assert!(guard.stats().confirmed_absent_hits >= 900);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        guard.stats().rebuilds.succeeded,
        1,
        "rebuilt on one hot key"
    );
    maintenance.shutdown().await;
}

/// The same hot key without a confirmed-absent cache (the HTTP layer has
/// none): every ask of it reaches the backend and counts as a false
/// positive, so the evidence for observed drift came back within
/// 10,000 answers of each rebuild, and the guard rescanned its store again
/// and again, each rebuild (same seed, same keys) letting the key through
/// as before. A rebuild for observed drift now waits a minute after the
/// last success, or ten times that success's length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hot_false_positive_without_a_cache_does_not_rebuild_again_and_again() {
    let store = store_with(&keys(0, 1_000));
    let policy = RebuildPolicy::default().when_drift_exceeds(2.0);
    let guard = maintained(1_000, &store, policy).build().unwrap();
    // The second build is sized for what the first counted, as every later
    // one is: the same filter, the same false positives.
    guard.rebuild().await.unwrap();
    guard.rebuild().await.unwrap();
    let ghost = a_false_positive(&guard);
    let loader = loader_over(&guard, &store);
    let maintenance = guard.spawn_maintenance();
    for (i, absent) in absent_keys(0, 60_000).into_iter().enumerate() {
        assert_eq!(loader.get(&absent).await.unwrap(), None);
        if i % 20 == 0 {
            assert_eq!(loader.get(&ghost).await.unwrap(), None);
            // Time for the maintenance task to see the evidence.
            tokio::task::yield_now().await;
        }
        if i % 10_000 == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let rebuilds = guard.stats().rebuilds.succeeded;
    assert!(
        rebuilds <= 3,
        "{rebuilds} rebuilds on one hot key (the first two builds included)"
    );
    maintenance.shutdown().await;
}

#[test]
fn a_drift_threshold_the_rate_can_never_reach_is_refused() {
    // At 1 % the estimated FPR can reach 100×, never more.
    let err = Guard::builder()
        .false_positive_rate(0.01)
        .rebuild_policy(RebuildPolicy::default().when_drift_exceeds(150.0))
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("drift threshold"), "{err}");
}

/// A rotating guard's filters each get the rate divided by the
/// generations, a growing guard's first the rate × (1 − tightening): the
/// least rate accepted (1e-8) left them at 5e-9, and the error named 5e-9,
/// a value the user never gave. It names the rate given, and why.
#[test]
fn a_rate_the_lifecycle_divides_below_the_least_is_refused_as_given() {
    for lifecycle in [
        Lifecycle::rotate(2, Duration::from_secs(60)),
        Lifecycle::grow(2.0),
    ] {
        let err = Guard::builder()
            .false_positive_rate(1e-8)
            .lifecycle(lifecycle)
            .build()
            .unwrap_err();
        match &err {
            ConfigError::OutOfRange {
                parameter, value, ..
            } => assert_eq!(
                (*parameter, value.as_str()),
                ("false_positive_rate", "0.00000001"),
                "{err}"
            ),
            other => panic!("{other:?}"),
        }
        assert!(
            err.to_string().contains("each filter of the lifecycle"),
            "{err}"
        );
    }
}

#[test]
fn durations_that_would_overflow_an_instant_are_refused_by_name() {
    let named = |result: Result<Guard, ConfigError>| match result {
        Err(ConfigError::OutOfRange { parameter, .. }) => parameter,
        other => panic!("expected OutOfRange, got {other:?}"),
    };
    let huge = Duration::MAX;
    let store = store_with(&[]);
    let with_source = || Guard::builder().source(source_of(&store));
    assert_eq!(
        named(Guard::builder().maintenance_interval(huge).build()),
        "maintenance_interval"
    );
    assert_eq!(
        named(
            Guard::builder()
                .lifecycle(Lifecycle::rotate(4, huge))
                .build()
        ),
        "period"
    );
    assert_eq!(
        named(
            with_source()
                .rebuild_policy(RebuildPolicy::default().every(huge))
                .build()
        ),
        "every"
    );
    assert_eq!(
        named(
            with_source()
                .rebuild_policy(RebuildPolicy::default().timeout(huge))
                .build()
        ),
        "timeout"
    );
    assert_eq!(
        named(
            with_source()
                .rebuild_policy(RebuildPolicy::default().write_settle(huge))
                .build()
        ),
        "write_settle"
    );
    assert_eq!(
        named(
            with_source()
                .rebuild_policy(RebuildPolicy::default().retry_backoff(huge, huge))
                .build()
        ),
        "retry_backoff"
    );
    // The longest accepted durations run without overflowing anything.
    let longest = bloomguard::guard::MAX_DURATION;
    let guard = with_source()
        .maintenance_interval(longest)
        .rebuild_policy(
            RebuildPolicy::default()
                .every(longest)
                .retry_backoff(longest, longest)
                .timeout(longest),
        )
        .build()
        .unwrap();
    drop(guard);
}

/// A source whose first scan panics (a bug in user code, inside the
/// maintenance task); later ones list `keys`.
struct PanicsOnce {
    panicked: AtomicBool,
    keys: Vec<Vec<u8>>,
}

impl PanicsOnce {
    fn listing(keys: &[&str]) -> Self {
        Self {
            panicked: AtomicBool::new(false),
            keys: keys.iter().map(|key| key.as_bytes().to_vec()).collect(),
        }
    }
}

impl KeySource for PanicsOnce {
    fn scan(&self) -> KeyStream<'_> {
        if !self.panicked.swap(true, Ordering::Relaxed) {
            panic!("a bug in the key source, once");
        }
        Box::pin(futures_util::stream::iter([Ok(self.keys.clone())]))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_maintenance_task_that_dies_says_so() {
    let guard = Guard::builder()
        .source(PanicsOnce::listing(&[]))
        .build()
        .unwrap();
    assert!(!guard.stats().maintenance_running);
    let maintenance = guard.spawn_maintenance();
    wait_until("the task to die", || maintenance.is_finished()).await;
    assert!(maintenance.panicked(), "the handle reports the panic");
    assert!(
        !guard.stats().maintenance_running,
        "the stats report it too"
    );
    assert!(guard.is_warming(), "and the guard keeps failing open");

    let guard = Guard::builder().build().unwrap();
    let maintenance = guard.spawn_maintenance();
    wait_until("the task to start", || guard.stats().maintenance_running).await;
    assert!(!maintenance.panicked());
    maintenance.shutdown().await;
    assert!(!guard.stats().maintenance_running);
}

/// The staleness check's queue belongs to the task running it: a task
/// started after one that panicked must get it back, or absent answers are
/// never verified again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_started_after_a_panic_still_checks_staleness() {
    let guard = checked_for_staleness(PanicsOnce::listing(&["listed"]));
    let maintenance = guard.spawn_maintenance();
    wait_until("the task to die", || maintenance.is_finished()).await;
    assert!(maintenance.panicked());
    verifies_absent_answers(&guard).await;
}

/// A guard over `source` with a staleness check whose store holds every
/// key asked about: each `Absent` answer is a stale one.
fn checked_for_staleness(source: impl KeySource) -> Guard {
    Guard::builder()
        .expected_items(1_000)
        .source(source)
        .rebuild_policy(RebuildPolicy::default().write_settle(Duration::ZERO))
        .maintenance_interval(Duration::from_millis(20))
        .staleness_check(1.0, |_| async { Ok(true) })
        .build()
        .unwrap()
}

/// Its maintenance task checks an `Absent` answer against the store.
async fn verifies_absent_answers(guard: &Guard) {
    let maintenance = guard.spawn_maintenance();
    guard.ready().await;
    assert_eq!(
        guard.check("written behind the guard's back"),
        Verdict::Absent
    );
    wait_until("the absent answer to be verified", || {
        guard.stats().stale_negatives >= 1
    })
    .await;
    maintenance.shutdown().await;
}

/// A task dropped before it first ran (its runtime shut down at once), and
/// one replaced at once by another (its handle dropped, a new task
/// spawned before the old one ended): the staleness queue goes to the task
/// after them.
#[test]
fn a_task_that_never_ran_or_was_replaced_at_once_hands_the_staleness_check_on() {
    let guard = checked_for_staleness(source::from_fn(|| vec!["listed"]));
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let never_ran = runtime.block_on(async { guard.spawn_maintenance() });
    drop(runtime);
    drop(never_ran);

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let replaced = guard.spawn_maintenance();
        drop(replaced);
        verifies_absent_answers(&guard).await;
    });
}

#[tokio::test]
async fn the_applications_shutdown_token_stops_maintenance() {
    let shutdown = tokio_util::sync::CancellationToken::new();
    let guard = Guard::builder().expected_items(1_000).build().unwrap();
    let maintenance = guard.spawn_maintenance_until(&shutdown);
    wait_until("the task to start", || guard.stats().maintenance_running).await;
    shutdown.cancel();
    // The handle is still held: the application's token alone stopped it.
    wait_until("the task to stop", || maintenance.is_finished()).await;
    assert!(!guard.stats().maintenance_running);
    assert!(!maintenance.panicked());
}

/// A key whose `as_ref` checks a guard itself (a key type with logging or
/// metrics in it could). `check_many` reads the keys' bytes inside its read
/// section, so the inner check opens a nested one, which must neither panic
/// nor close the outer section (that would let a swap free the filters it
/// is reading: `sections::tests::a_nested_section_leaves_the_outer_one_open`).
#[test]
fn a_key_type_that_checks_a_guard_in_as_ref_is_answered() {
    struct Nosy<'a> {
        watcher: &'a Guard,
        key: &'a str,
    }
    impl AsRef<[u8]> for Nosy<'_> {
        fn as_ref(&self) -> &[u8] {
            let _ = self.watcher.check("watched");
            self.key.as_bytes()
        }
    }
    let (guard, watcher) = (
        Guard::builder().expected_items(100).build().unwrap(),
        Guard::builder().expected_items(100).build().unwrap(),
    );
    guard.insert("in");
    let keys = [
        Nosy {
            watcher: &watcher,
            key: "in",
        },
        Nosy {
            watcher: &guard,
            key: "out",
        },
    ];
    let mut verdicts = [Verdict::Warming; 2];
    guard.check_many(&keys, &mut verdicts);
    assert_eq!(verdicts[0], Verdict::MaybePresent);
    assert_eq!(
        watcher.stats().checks.absent + watcher.stats().checks.maybe_present,
        1
    );
}

/// A maintenance task holds its guard weakly, and ends once the guard is
/// dropped; also when its next tick is an hour away, since it would keep
/// the staleness check's closure (and what it holds: a pool, a client)
/// until then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maintenance_lets_go_of_a_dropped_guard_at_once() {
    let held_by_the_check = Arc::new(());
    let guard = Guard::builder()
        .expected_items(1_000)
        .maintenance_interval(Duration::from_secs(3_600))
        .staleness_check(0.5, {
            let held = Arc::clone(&held_by_the_check);
            move |_key| {
                let _ = &held;
                async { Ok(false) }
            }
        })
        .build()
        .unwrap();
    let maintenance = guard.spawn_maintenance();
    tokio::time::sleep(Duration::from_millis(50)).await; // asleep until its next tick
    drop(guard);
    wait_until("the task to let the check go", || {
        Arc::strong_count(&held_by_the_check) == 1
    })
    .await;
    drop(maintenance);
}

/// On a runtime without its time driver the maintenance task panicked at
/// its first sleep, which was only logged: the guard stayed warming for
/// ever. Starting it says so at once instead.
#[test]
#[should_panic(expected = "enable_time")]
fn maintenance_on_a_runtime_without_timers_panics_where_it_is_started() {
    let guard = Guard::builder()
        .source(bloomguard::source::from_fn(|| vec!["item:1"]))
        .build()
        .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        let _maintenance = guard.spawn_maintenance();
    });
}
