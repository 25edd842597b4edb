//! `GuardedLoader`: the guard's answers, coalescing of concurrent loads
//! (completion, errors, cancellation), and the cache of confirmed false positives.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::common::wait_until;
use bloomguard::{Guard, GuardedLoader, RebuildPolicy};
use tokio::sync::Semaphore;

type GateLoad = std::pin::Pin<Box<dyn Future<Output = Result<Option<usize>, String>> + Send>>;

/// A loader whose calls wait for a permit, and that counts them.
#[derive(Clone)]
struct Gate {
    calls: Arc<AtomicUsize>,
    open: Arc<Semaphore>,
}

impl Gate {
    fn closed() -> Self {
        Self {
            calls: Arc::new(AtomicUsize::new(0)),
            open: Arc::new(Semaphore::new(0)),
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Answers `key.len()` for keys starting with "item", `None` otherwise,
    /// and fails for "broken".
    fn loader(&self) -> impl Fn(String) -> GateLoad + Send + Sync + 'static {
        let gate = self.clone();
        move |key: String| {
            let gate = gate.clone();
            Box::pin(async move {
                gate.calls.fetch_add(1, Ordering::SeqCst);
                gate.open.acquire().await.unwrap().forget();
                match key.as_str() {
                    "broken" => Err(format!("cannot load {key}")),
                    k if k.starts_with("item") => Ok(Some(k.len())),
                    _ => Ok(None),
                }
            })
        }
    }
}

/// `count` concurrent `get`s of `key`, each on a task of its own.
fn spawn_gets<L: bloomguard::Loader<String>>(
    loader: &GuardedLoader<String, L>,
    key: &str,
    count: usize,
) -> Vec<tokio::task::JoinHandle<bloomguard::loader::Loaded<L::Value, L::Error>>> {
    (0..count)
        .map(|_| {
            let (loader, key) = (loader.clone(), key.to_string());
            tokio::spawn(async move { loader.get(&key).await })
        })
        .collect()
}

fn guard_with(keys: &[&str]) -> Guard {
    let guard = Guard::builder().expected_items(10_000).build().unwrap();
    for key in keys {
        guard.insert(key);
    }
    guard
}

#[tokio::test]
async fn absent_keys_never_reach_the_loader() {
    let gate = Gate::closed();
    gate.open.add_permits(1_000);
    let loader = GuardedLoader::new(guard_with(&["item:1"]), gate.loader());
    let mut maybe = 0;
    for i in 0..1_000 {
        assert_eq!(loader.get(&format!("absent:{i}")).await.unwrap(), None);
    }
    maybe += loader.guard().stats().checks.maybe_present;
    assert_eq!(
        gate.calls() as u64,
        maybe,
        "only false positives were loaded"
    );
    assert_eq!(loader.get("item:1").await.unwrap(), Some(6));
    let stats = loader.guard().stats();
    assert_eq!((stats.found, stats.false_positives), (1, maybe));
}

/// The guard is asked when `get` or `contains` is called, so that an absent
/// key's future is ready at once and a copy of it before its poll waits for
/// nothing (measured in `benches/layer.rs`, `absent/loader-get`); the
/// backend only when the future is polled.
#[test]
fn the_guard_is_checked_when_get_is_called_and_the_backend_when_polled() {
    use std::task::{Context, Poll, Waker};
    let calls = Arc::new(AtomicUsize::new(0));
    let loader = GuardedLoader::new(guard_with(&["item:1"]), {
        let calls = Arc::clone(&calls);
        move |_key: String| {
            calls.fetch_add(1, Ordering::SeqCst);
            std::future::ready(Ok::<_, std::convert::Infallible>(Some(1u8)))
        }
    });
    let mut context = Context::from_waker(Waker::noop());
    let absent = loader.get("item:2");
    let unpolled = loader.get("item:1");
    assert_eq!(
        loader.guard().stats().checks.total(),
        2,
        "both checked when made"
    );
    let mut absent = std::pin::pin!(absent);
    assert!(matches!(
        absent.as_mut().poll(&mut context),
        Poll::Ready(Ok(None))
    ));
    assert!(matches!(
        std::pin::pin!(loader.contains("item:3")).poll(&mut context),
        Poll::Ready(Ok(false))
    ));
    drop(unpolled);
    assert_eq!(calls.load(Ordering::SeqCst), 0, "no backend call unpolled");
    let mut present = std::pin::pin!(loader.get("item:1"));
    assert!(matches!(
        present.as_mut().poll(&mut context),
        Poll::Ready(Ok(Some(1)))
    ));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

/// A `get` or `contains` future is moved on every call: the backend call's
/// state is boxed on the path that makes it, so that the absent path copies
/// a few words, not hundreds of bytes (measured in `benches/layer.rs`,
/// `absent/loader-get`).
#[test]
fn the_futures_of_get_and_contains_stay_small() {
    let loader = GuardedLoader::new(guard_with(&[]), |_key: String| async {
        Ok::<_, std::convert::Infallible>(Some(vec![0u8; 16]))
    });
    // The key (a 24-byte `String`), the loader's address, the verdict and
    // the box: 72 bytes; 280 with the call's state inline.
    let small = std::mem::size_of::<String>() + 64;
    assert!(std::mem::size_of_val(&loader.get("a")) <= small);
    assert!(std::mem::size_of_val(&loader.contains("a")) <= small);
}

// One thread: every spawned caller has run up to its wait before the
// test goes on, so that all of them join the first call.
#[tokio::test]
async fn concurrent_loads_of_one_key_share_one_call() {
    let gate = Gate::closed();
    let loader = GuardedLoader::new(guard_with(&["item:7"]), gate.loader());
    let waiters = spawn_gets(&loader, "item:7", 10);
    wait_until("the first call", || gate.calls() == 1).await;
    assert_eq!(gate.calls(), 1, "the others wait for it");
    assert_eq!(loader.in_flight(), 1);
    gate.open.add_permits(1);
    for waiter in waiters {
        assert_eq!(waiter.await.unwrap().unwrap(), Some(6));
    }
    assert_eq!(gate.calls(), 1);
    assert_eq!(
        loader.in_flight(),
        0,
        "the entry is removed when the call completes"
    );
}

/// A call that joins a load begun before a write landed must not take that
/// load's "not found" when the write (the insert, then the store write)
/// completed before the call began: it asks again.
#[tokio::test] // one thread: the second call has joined when the gate opens
async fn a_call_after_a_completed_write_is_not_handed_an_older_not_found() {
    let guard = guard_with(&[]);
    let store = Arc::new(std::sync::Mutex::new(
        std::collections::HashSet::<String>::new(),
    ));
    let gate = Gate::closed();
    let loader = GuardedLoader::new(guard.clone(), {
        let (store, gate) = (Arc::clone(&store), gate.clone());
        move |key: String| {
            // Reads the store when called, answers when the gate opens.
            let found = store.lock().unwrap().contains(&key);
            let gate = gate.clone();
            async move {
                gate.calls.fetch_add(1, Ordering::SeqCst);
                gate.open.acquire().await.unwrap().forget();
                Ok::<_, std::convert::Infallible>(found.then_some(()))
            }
        }
    });
    guard.insert("item:1"); // the write's insert
    let before = tokio::spawn({
        let loader = loader.clone();
        async move { loader.get("item:1").await }
    });
    wait_until("the first load", || gate.calls() == 1).await;
    store.lock().unwrap().insert("item:1".to_string()); // the write lands
    let after = tokio::spawn({
        let loader = loader.clone();
        async move { loader.get("item:1").await }
    });
    tokio::task::yield_now().await; // it runs up to its wait on the load
    assert_eq!(gate.calls(), 1, "joined, not called");
    gate.open.add_permits(2);
    assert_eq!(
        before.await.unwrap().unwrap(),
        None,
        "began before the write"
    );
    assert_eq!(
        after.await.unwrap().unwrap(),
        Some(()),
        "a call begun after the write completed was handed the older load's not-found"
    );
}

/// Where the guard times its inserts and none of the key happened since the
/// load began, its "not found" is shared: a hot false positive costs one
/// backend call, not one per waiter. Untimed, the waiters share one more
/// call, begun after all of them.
#[tokio::test] // a running clock: a call begun after the waiters is later than them
async fn a_not_found_is_shared_where_no_write_can_have_landed_since() {
    for timed in [true, false] {
        let guard = guard_settling();
        let gate = Gate::closed();
        let mut loader = GuardedLoader::new(guard.clone(), gate.loader());
        if timed {
            loader = loader
                .confirmed_absent_cache(100, Duration::from_secs(60))
                .unwrap();
        }
        guard.insert("ghost"); // in the filter, never in the store
        tokio::time::sleep(2 * SETTLE).await;
        let waiters = spawn_gets(&loader, "ghost", 5);
        wait_until("the first call", || gate.calls() == 1).await;
        gate.open.add_permits(1);
        if !timed {
            // One waiter leads it; the others, on this one thread, join it
            // before it can answer.
            wait_until("a second call", || gate.calls() == 2).await;
            gate.open.add_permits(1);
        }
        for waiter in waiters {
            let answer = tokio::time::timeout(Duration::from_secs(30), waiter).await;
            assert_eq!(
                answer
                    .expect("a waiter made a call of its own")
                    .unwrap()
                    .unwrap(),
                None
            );
        }
        let expected = if timed { 1 } else { 2 };
        assert_eq!(gate.calls(), expected, "timed inserts: {timed}");
    }
}

#[tokio::test] // one thread, as above
async fn an_error_reaches_every_waiter_and_is_not_cached() {
    let gate = Gate::closed();
    let loader = GuardedLoader::new(guard_with(&["broken"]), gate.loader());
    let waiters = spawn_gets(&loader, "broken", 5);
    wait_until("the first call", || gate.calls() == 1).await;
    gate.open.add_permits(1);
    let errors: Vec<Arc<String>> = futures_errors(waiters).await;
    assert!(
        errors.iter().all(|e| Arc::ptr_eq(e, &errors[0])),
        "one shared error"
    );
    assert_eq!(*errors[0], "cannot load broken");
    assert_eq!(loader.in_flight(), 0, "removed on error too");
    gate.open.add_permits(1);
    assert!(loader.get("broken").await.is_err());
    assert_eq!(gate.calls(), 2, "a later load calls again");
    let stats = loader.guard().stats();
    assert_eq!(
        (stats.found, stats.false_positives),
        (0, 0),
        "errors are not outcomes"
    );
}

async fn futures_errors(
    waiters: Vec<tokio::task::JoinHandle<Result<Option<usize>, Arc<String>>>>,
) -> Vec<Arc<String>> {
    let mut errors = Vec::new();
    for waiter in waiters {
        errors.push(waiter.await.unwrap().unwrap_err());
    }
    errors
}

#[tokio::test] // one thread: the second call has joined when the first is cancelled
async fn a_waiter_takes_over_when_the_first_caller_is_cancelled() {
    let gate = Gate::closed();
    let loader = GuardedLoader::new(guard_with(&["item:9"]), gate.loader());
    let first = tokio::spawn({
        let loader = loader.clone();
        async move { loader.get("item:9").await }
    });
    wait_until("the first call", || gate.calls() == 1).await;
    let second = tokio::spawn({
        let loader = loader.clone();
        async move { loader.get("item:9").await }
    });
    tokio::task::yield_now().await; // it runs up to its wait on the load
    assert_eq!(gate.calls(), 1, "the second call waits on the first's load");
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    wait_until("the waiter to call again", || gate.calls() == 2).await;
    gate.open.add_permits(1);
    assert_eq!(second.await.unwrap().unwrap(), Some(6));
    assert_eq!(loader.in_flight(), 0, "removed on cancellation too");
}

/// A store of ids, shared with the test.
type Store = Arc<std::sync::Mutex<std::collections::HashSet<String>>>;

/// A loader over `store` with a confirmed-absent cache (60 s).
fn cached_loader_over(
    guard: &Guard,
    store: &Store,
) -> GuardedLoader<String, impl bloomguard::Loader<String, Value = (), Error = std::io::Error>> {
    let listed = Arc::clone(store);
    GuardedLoader::new(guard.clone(), move |key: String| {
        let found = listed.lock().unwrap().contains(&key);
        async move { Ok::<_, std::io::Error>(found.then_some(())) }
    })
    .confirmed_absent_cache(100, Duration::from_secs(60))
    .unwrap()
}

/// The write settle of the confirmed-absent cache tests.
const SETTLE: Duration = Duration::from_millis(100);

/// A guard whose writes reach the store within [`SETTLE`] of their insert.
fn guard_settling() -> Guard {
    Guard::builder()
        .expected_items(10_000)
        .rebuild_policy(RebuildPolicy::default().write_settle(SETTLE))
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn confirmed_false_positives_are_cached_until_inserted_or_expired() {
    let guard = guard_settling();
    let gate = Gate::closed();
    gate.open.add_permits(100);
    let loader = GuardedLoader::new(guard.clone(), gate.loader())
        .confirmed_absent_cache(100, Duration::from_secs(60))
        .unwrap();
    // "ghost" is in the filter but not in the store: a false positive.
    guard.insert("ghost");
    tokio::time::advance(2 * SETTLE).await;

    assert_eq!(loader.get("ghost").await.unwrap(), None);
    assert_eq!(gate.calls(), 1);
    assert_eq!(loader.get("ghost").await.unwrap(), None);
    assert_eq!(gate.calls(), 1, "the confirmed answer is reused");
    assert_eq!(guard.stats().confirmed_absent_hits, 1);
    // Still the filter's false positive, each time: a repeated one left out
    // would pull the observed rate (and the verified sample's false share)
    // down by how often it repeats.
    assert_eq!(guard.stats().false_positives, 2);
    assert_eq!(
        loader.clone().confirmed_absent_entries(),
        1,
        "clones share the cache"
    );

    // An insert drops the cached answer at once.
    guard.insert("ghost");
    assert_eq!(loader.get("ghost").await.unwrap(), None);
    assert_eq!(gate.calls(), 2, "asked again after the insert");
    // And an answer from within the write settle of that insert is not cached.
    assert_eq!(loader.get("ghost").await.unwrap(), None);
    assert_eq!(gate.calls(), 3);

    tokio::time::advance(2 * SETTLE).await;
    assert_eq!(loader.get("ghost").await.unwrap(), None);
    assert_eq!(loader.get("ghost").await.unwrap(), None);
    assert_eq!(gate.calls(), 4, "cached again once the insert has settled");
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(loader.get("ghost").await.unwrap(), None);
    assert_eq!(gate.calls(), 5, "expired after the ttl");
}

#[tokio::test(start_paused = true)]
async fn a_full_confirmed_absent_cache_still_takes_a_hot_false_positive() {
    let guard = Guard::builder().expected_items(10_000).build().unwrap();
    let gate = Gate::closed();
    gate.open.add_permits(1_000);
    let loader = GuardedLoader::new(guard.clone(), gate.loader())
        .confirmed_absent_cache(10, Duration::from_secs(600))
        .unwrap();
    let cold: Vec<String> = (0..10).map(|i| format!("cold:{i}")).collect();
    for key in cold.iter().chain(["hot".to_string()].iter()) {
        guard.insert(key); // false positives: in the filter, not in the store
    }
    tokio::time::advance(Duration::from_secs(1)).await;
    for key in &cold {
        assert_eq!(loader.get(key).await.unwrap(), None);
    }
    assert_eq!(
        loader.confirmed_absent_entries(),
        10,
        "full of live entries"
    );

    let before = gate.calls();
    for _ in 0..50 {
        assert_eq!(loader.get("hot").await.unwrap(), None);
        loader.confirmed_absent_entries(); // lets the cache settle its admissions
    }
    let hot_calls = gate.calls() - before;
    assert!(
        hot_calls < 10,
        "the hot key displaced a cold one: {hot_calls} backend calls for 50 asks"
    );
}

/// A write longer than the settle, covered by a `PendingWrite` as the docs
/// ask: between the moment it lands in the store and the drop of the
/// `PendingWrite`, no answer cached from before it may hide the key.
#[tokio::test(start_paused = true)]
async fn a_cached_absent_never_hides_a_write_still_pending() {
    let guard = guard_settling();
    let store = Arc::new(std::sync::Mutex::new(
        std::collections::HashSet::<String>::new(),
    ));
    // One write begins before the cache exists, when nothing times inserts.
    let early = guard.begin_write("early:1");
    let loader = cached_loader_over(&guard, &store);

    let pending = guard.begin_write("slow:1");
    tokio::time::advance(3 * SETTLE).await; // the write takes its time
    assert_eq!(
        loader.get("slow:1").await.unwrap(),
        None,
        "not in the store yet"
    );
    store.lock().unwrap().insert("slow:1".into()); // it lands; the PendingWrite is still held
    assert_eq!(
        loader.get("slow:1").await.unwrap(),
        Some(()),
        "the store has the key: the answer cached before it landed must not hide it"
    );
    drop(pending);
    assert_eq!(loader.get("slow:1").await.unwrap(), Some(()));

    assert_eq!(loader.get("early:1").await.unwrap(), None);
    store.lock().unwrap().insert("early:1".into());
    assert_eq!(
        loader.get("early:1").await.unwrap(),
        Some(()),
        "a write begun before the cache existed is not hidden either"
    );
    drop(early);
}

/// A write begun before the cache existed is timed by nothing, and its
/// close recorded no insert: a backend read that began while it was open,
/// before it landed, and answered after it closed was cached, and hid the
/// stored key from then on.
#[tokio::test(start_paused = true)]
async fn a_write_begun_before_the_cache_is_not_hidden_after_it_closes() {
    let guard = guard_settling();
    let store: Store = Arc::default();
    let early = guard.begin_write("early:1");
    // Reads the store when asked, answers when let through.
    let open = Arc::new(Semaphore::new(0));
    let calls = Arc::new(AtomicUsize::new(0));
    let loader = GuardedLoader::new(guard.clone(), {
        let (store, open, calls) = (Arc::clone(&store), Arc::clone(&open), Arc::clone(&calls));
        move |key: String| {
            let found = store.lock().unwrap().contains(&key);
            calls.fetch_add(1, Ordering::SeqCst);
            let open = Arc::clone(&open);
            async move {
                open.acquire().await.unwrap().forget();
                Ok::<_, std::io::Error>(found.then_some(()))
            }
        }
    })
    .confirmed_absent_cache(100, Duration::from_secs(60))
    .unwrap();
    tokio::time::advance(3 * SETTLE).await; // the write takes its time
    let read = tokio::spawn({
        let loader = loader.clone();
        async move { loader.get("early:1").await }
    });
    wait_until("the read to ask the store", || {
        calls.load(Ordering::SeqCst) == 1
    })
    .await;
    store.lock().unwrap().insert("early:1".into()); // it lands, and ends
    drop(early);
    open.add_permits(usize::MAX >> 4);
    assert_eq!(
        read.await.unwrap().unwrap(),
        None,
        "asked before the write landed"
    );
    assert_eq!(
        loader.get("early:1").await.unwrap(),
        Some(()),
        "the answer read before the write landed hides it"
    );
}

/// A filter merged into the guard brings keys the store holds without an
/// insert of each: no answer cached before the merge may hide one of them.
#[tokio::test(start_paused = true)]
async fn a_cached_absent_does_not_outlive_a_merged_filter() {
    let guard = guard_settling();
    let store = Arc::new(std::sync::Mutex::new(
        std::collections::HashSet::<String>::new(),
    ));
    let loader = cached_loader_over(&guard, &store);
    guard.insert("item:1"); // in the filter, not (yet) in the store
    tokio::time::advance(2 * SETTLE).await;
    assert_eq!(loader.get("item:1").await.unwrap(), None);
    assert_eq!(loader.get("item:1").await.unwrap(), None);
    assert_eq!(guard.stats().confirmed_absent_hits, 1, "cached");

    // Another process's filter, whose keys it wrote to the store itself.
    let theirs = {
        let live = guard.live_filters();
        let ours = live.newest().unwrap();
        bloomguard::FilterBuilder::with_params(ours.bits(), ours.k())
            .seed(ours.seed())
            .build()
            .unwrap()
    };
    theirs.insert("item:1");
    store.lock().unwrap().insert("item:1".into());
    guard.merge_filter(theirs).unwrap();
    assert_eq!(
        loader.get("item:1").await.unwrap(),
        Some(()),
        "an answer cached before the merge hid a key the merge brought"
    );
}

#[tokio::test]
async fn a_confirmed_absent_cache_needs_room_and_a_sane_ttl() {
    let guard = Guard::builder().build().unwrap();
    let refused = |capacity, ttl| {
        GuardedLoader::new(guard.clone(), Gate::closed().loader())
            .confirmed_absent_cache(capacity, ttl)
            .unwrap_err()
            .to_string()
    };
    assert!(refused(0, Duration::from_secs(1)).contains("confirmed-absent capacity"));
    let too_long = bloomguard::guard::MAX_DURATION + Duration::from_secs(1);
    assert!(refused(10, too_long).contains("confirmed-absent ttl"));
    assert!(refused(10, Duration::ZERO).contains("confirmed-absent ttl"));
    GuardedLoader::new(guard, Gate::closed().loader())
        .confirmed_absent_cache(10, bloomguard::guard::MAX_DURATION)
        .expect("the longest ttl is accepted");
}

/// A batch loader that records the batches it was asked for.
#[derive(Clone, Default)]
struct Recording {
    batches: Arc<std::sync::Mutex<Vec<Vec<String>>>>,
}

impl bloomguard::Loader<String> for Recording {
    type Value = usize;
    type Error = String;

    async fn load(&self, key: String) -> Result<Option<usize>, String> {
        self.load_many(vec![key])
            .await
            .map(|mut values| values.pop().flatten())
    }

    async fn load_many(&self, keys: Vec<String>) -> Result<Vec<Option<usize>>, String> {
        self.batches.lock().unwrap().push(keys.clone());
        if keys.iter().any(|key| key == "broken") {
            return Err("batch failed".into());
        }
        Ok(keys
            .iter()
            .map(|key| key.starts_with("item").then_some(key.len()))
            .collect())
    }
}

#[tokio::test]
async fn a_batch_loads_only_what_the_guard_lets_through_in_one_call() {
    let present: Vec<String> = (0..10).map(|i| format!("item:{i}")).collect();
    let guard = guard_with(&present.iter().map(String::as_str).collect::<Vec<_>>());
    let recording = Recording::default();
    let loader = GuardedLoader::new(guard, recording.clone());

    let mut candidates: Vec<String> = (0..200).map(|i| format!("absent:{i}")).collect();
    for (slot, key) in present.iter().enumerate() {
        candidates[slot * 20 + 3] = key.clone();
    }
    let values = loader.get_many(&candidates).await.unwrap();
    for (key, value) in candidates.iter().zip(&values) {
        let expected = key.starts_with("item").then_some(key.len());
        assert_eq!(
            *value, expected,
            "{key}: answers keep the order of the keys"
        );
    }
    let batches = recording.batches.lock().unwrap().clone();
    assert_eq!(batches.len(), 1, "one backend call for the batch");
    let stats = loader.guard().stats();
    assert_eq!(
        batches[0].len() as u64,
        10 + stats.false_positives,
        "only the present keys and the false positives were asked for"
    );
    assert_eq!(stats.found, 10);
    assert_eq!(stats.checks.absent + stats.checks.maybe_present, 200);

    let nothing_to_load: Vec<String> = (1_000..1_100)
        .map(|i| format!("absent:{i}"))
        .filter(|key| loader.guard().check(key).is_absent())
        .collect();
    let values = loader.get_many(&nothing_to_load).await.unwrap();
    assert!(values.iter().all(Option::is_none));
    assert_eq!(
        recording.batches.lock().unwrap().len(),
        1,
        "no call for an all-absent batch"
    );

    // The same batch as yes/no answers, past the first group of 64 keys:
    // verified (the default), and trusted without the backend.
    let answers = loader.contains_many(&candidates).await.unwrap();
    for (key, &answer) in candidates.iter().zip(&answers) {
        assert_eq!(answer, key.starts_with("item"), "{key}: verified");
    }
    let trusting = GuardedLoader::new(loader.guard().clone(), Recording::default())
        .verify(bloomguard::Verify::None)
        .unwrap();
    let answers = trusting.contains_many(&candidates).await.unwrap();
    for (key, &answer) in candidates.iter().zip(&answers) {
        assert!(answer || !key.starts_with("item"), "{key}: trusted");
        assert_eq!(
            answer,
            loader.guard().check(key) == bloomguard::Verdict::MaybePresent,
            "{key}"
        );
    }
    assert_eq!(
        answers.iter().filter(|&&answer| answer).count(),
        10 + stats.false_positives as usize
    );
}

#[tokio::test]
async fn a_failed_batch_fails_whole_and_counts_nothing() {
    let guard = guard_with(&["item:1", "broken"]);
    let loader = GuardedLoader::new(guard, Recording::default());
    let error = loader
        .get_many(&["item:1".to_string(), "broken".to_string()])
        .await
        .unwrap_err();
    assert_eq!(*error, "batch failed");
    let stats = loader.guard().stats();
    assert_eq!((stats.found, stats.false_positives), (0, 0));
}

#[tokio::test]
async fn the_default_batch_load_asks_one_key_at_a_time() {
    let gate = Gate::closed();
    gate.open.add_permits(100);
    let loader = GuardedLoader::new(guard_with(&["item:1", "item:22"]), gate.loader());
    let keys = [
        "item:1".to_string(),
        "absent".to_string(),
        "item:22".to_string(),
    ];
    let values = loader.get_many(&keys).await.unwrap();
    assert_eq!(values[0], Some(6));
    assert_eq!(values[2], Some(7));
    assert_eq!(values[1], None);
    assert_eq!(
        gate.calls() as u64,
        2 + loader.guard().stats().false_positives
    );
}

/// A batch loader that answers fewer values than it was given keys: the keys
/// left over must not read as "not found".
#[tokio::test]
#[should_panic(expected = "answered 1 values for 2 keys")]
async fn a_batch_loader_answering_short_is_a_clear_panic() {
    struct Short;
    impl bloomguard::Loader<String> for Short {
        type Value = ();
        type Error = std::convert::Infallible;
        async fn load(&self, _key: String) -> Result<Option<()>, Self::Error> {
            Ok(Some(()))
        }
        async fn load_many(&self, _keys: Vec<String>) -> Result<Vec<Option<()>>, Self::Error> {
            Ok(vec![Some(())]) // one answer, whatever was asked
        }
    }
    let loader = GuardedLoader::new(guard_with(&["item:1", "item:2"]), Short);
    let _ = loader
        .contains_many(&["item:1".to_string(), "item:2".to_string()])
        .await;
}
