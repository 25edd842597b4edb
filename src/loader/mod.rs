//! [`GuardedLoader`]: a guard in front of any async loader, for code that
//! does not use tower.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! use std::collections::HashMap;
//! use std::sync::Arc;
//! use bloomguard::{Guard, GuardedLoader};
//!
//! let store = Arc::new(HashMap::from([("item:1".to_string(), 42u32)]));
//! let guard = Guard::builder().expected_items(1_000).build()?;
//! guard.insert("item:1");
//! let loader = GuardedLoader::new(guard, move |key: String| {
//!     let store = Arc::clone(&store);
//!     async move { Ok::<_, std::io::Error>(store.get(&key).copied()) }
//! });
//! assert_eq!(loader.get("item:1").await?, Some(42));
//! assert_eq!(loader.get("item:2").await?, None); // answered by the filter
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```
//!
//! # Concurrent calls on the same key
//! Loads of one key that pass the filter at the same time share one backend
//! call: the first caller runs it, the others wait for its result (errors
//! come to all of them as the same `Arc<E>`). If the first caller is
//! cancelled, a waiting caller takes over and calls the backend itself; the
//! shared entry is removed when the call completes, fails or is cancelled.
//! A "not found" is shared only with callers for whom it is still true: a
//! caller may have begun after a write of the key completed, which the
//! running call, begun before the write landed, missed. Where the guard
//! times its inserts (a [confirmed-absent cache](GuardedLoader::confirmed_absent_cache)
//! turns that on) and shows no insert of the key since the call began
//! (minus the write settle), waiters take the "not found"; otherwise they
//! share one more call, begun after all of them. A value found is shared
//! as it is: it may predate an update the waiter completed while the call
//! ran (updates and deletes stamp nothing), as a value read from a replica
//! may. Where that matters, read such keys from the store directly.
//!
//! So a backend call that never returns holds every later call of its key
//! (until its first caller is cancelled): bound the loader's calls, as
//! `RedisLoader` and `PgLoader` do (1 s
//! unless told). The call runs in its first caller's future, and so does
//! that bound: a `get` future kept but no longer polled (parked in a
//! `select!` that took another branch) holds the key's later calls for as
//! long as it is kept. Drop a `get` you stop polling.
//! (Kept by hand rather than moka's `try_get_with`, which caches the value:
//! a guard in front of a store must not; this keeps only the call in flight.)

mod confirmed;

use std::fmt;
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Duration;

use dashmap::DashMap;
use dashmap::mapref::entry::Entry;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::error::ConfigError;
use crate::guard::{Guard, Verdict};
use crate::verify::Verify;
use confirmed::ConfirmedAbsent;

/// An async lookup in the store behind a guard: `Ok(None)` when the key is
/// not there.
///
/// Implemented for closures `Fn(K) -> impl Future<Output = Result<Option<V>, E>>`.
pub trait Loader<K>: Send + Sync + 'static {
    /// What a found key loads.
    type Value: Clone + Send + Sync + 'static;
    /// What a failed load reports.
    type Error: Send + Sync + 'static;

    /// Looks `key` up in the store.
    fn load(&self, key: K)
    -> impl Future<Output = Result<Option<Self::Value>, Self::Error>> + Send;

    /// Looks many keys up, answering one value per key in their order (the
    /// [`GuardedLoader`] panics on another count). Override it where the
    /// store has a batch read (`MGET`, `WHERE id IN (…)`); the default loads
    /// the keys one after another.
    fn load_many(
        &self,
        keys: Vec<K>,
    ) -> impl Future<Output = Result<Vec<Option<Self::Value>>, Self::Error>> + Send
    where
        K: Send,
    {
        async move {
            let mut values = Vec::with_capacity(keys.len());
            for key in keys {
                values.push(self.load(key).await?);
            }
            Ok(values)
        }
    }
}

/// The output of a loader closure: `Result<Option<V>, E>`.
pub trait LoadResult {
    /// What a found key loads.
    type Value;
    /// What a failed load reports.
    type Error;
    /// Converts into the result a [`Loader`] returns.
    fn into_result(self) -> Result<Option<Self::Value>, Self::Error>;
}

impl<V, E> LoadResult for Result<Option<V>, E> {
    type Value = V;
    type Error = E;

    fn into_result(self) -> Result<Option<V>, E> {
        self
    }
}

impl<K, F, Fut> Loader<K> for F
where
    F: Fn(K) -> Fut + Send + Sync + 'static,
    Fut: Future + Send,
    Fut::Output: LoadResult,
    <Fut::Output as LoadResult>::Value: Clone + Send + Sync + 'static,
    <Fut::Output as LoadResult>::Error: Send + Sync + 'static,
{
    type Value = <Fut::Output as LoadResult>::Value;
    type Error = <Fut::Output as LoadResult>::Error;

    fn load(
        &self,
        key: K,
    ) -> impl Future<Output = Result<Option<Self::Value>, Self::Error>> + Send {
        let load = self(key);
        async move { load.await.into_result() }
    }
}

/// What a load returns: the value if found, or the backend's error, shared
/// with every caller that waited for the same call.
pub type Loaded<V, E> = Result<Option<V>, Arc<E>>;

/// A guard in front of a [`Loader`]: keys the filter rules out are answered
/// `None` without a backend call, the rest are loaded (with concurrent loads
/// of one key coalesced) and their outcome feeds the guard's statistics.
///
/// The guard sees a key as its bytes (`K: AsRef<[u8]>`), the coalescing as
/// `K`'s `Eq` and `Hash`: two keys equal as `K` must have the same bytes, or
/// one caller could be handed the other's answer.
///
/// Cheap to clone (an `Arc` inside). See the [module docs](self).
pub struct GuardedLoader<K, L: Loader<K>> {
    inner: Arc<Inner<K, L>>,
    verify: Verify,
    shadow: bool,
    confirmed_absent: Option<Arc<ConfirmedAbsent>>,
}

/// What [`GuardedLoader::get`] and [`GuardedLoader::contains`] return: the
/// guard's own answer, or the backend call, boxed.
///
/// Not `futures_util`'s `Either` of a `Ready`: taking the answer out of the
/// `Ready` could write it to memory and read it back in pieces of other
/// widths, which the CPU cannot forward from its store buffer. In a plain
/// loop over absent keys that stall cost each `get` ~3 ns (BENCHMARKS.md,
/// "The loader's absent answer"). A `bool` becomes the output in registers.
enum Answer<F> {
    /// Answered without the backend: present or not.
    Known(bool),
    Asking(Pin<Box<F>>),
}

/// An output that a known answer maps to.
trait FromKnown {
    fn from_known(present: bool) -> Self;
}

/// `get`: the guard alone only ever answers "absent".
impl<V, E> FromKnown for Result<Option<V>, E> {
    fn from_known(present: bool) -> Self {
        debug_assert!(!present, "`get` asks the backend for every maybe");
        Ok(None)
    }
}

/// `contains`: "absent", or a "maybe" the verify policy trusts.
impl<E> FromKnown for Result<bool, E> {
    fn from_known(present: bool) -> Self {
        Ok(present)
    }
}

impl<F> Future for Answer<F>
where
    F: Future,
    F::Output: FromKnown,
{
    type Output = F::Output;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.get_mut() {
            Self::Known(present) => Poll::Ready(FromKnown::from_known(*present)),
            Self::Asking(call) => call.as_mut().poll(cx),
        }
    }
}

/// Where a checked key's answer comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    /// Absent, without the backend.
    Absent,
    /// Present, trusted without the backend ([`Verify`]).
    Trusted,
    /// The backend answers.
    Ask,
}

struct Inner<K, L: Loader<K>> {
    guard: Guard,
    loader: L,
    in_flight: InFlight<K, L::Value, L::Error>,
}

/// The backend calls running, by key.
type InFlight<K, V, E> = DashMap<K, Arc<Flight<V, E>>>;

/// One backend call that several callers wait for.
struct Flight<V, E> {
    result: OnceLock<Loaded<V, E>>,
    /// Set when the call ends, completed or cancelled, before `done` wakes
    /// the waiters: one that listens only after that wake-up sees it.
    ended: AtomicBool,
    done: Notify,
    started: Instant,
}

impl<V, E> Flight<V, E> {
    fn new() -> Self {
        Self {
            result: OnceLock::new(),
            ended: AtomicBool::new(false),
            done: Notify::new(),
            started: Instant::now(),
        }
    }

    /// Waits for the call to end: its result, or `None` if the caller
    /// running it was cancelled.
    async fn ended(&self) -> Option<&Loaded<V, E>> {
        let done = self.done.notified();
        let mut done = std::pin::pin!(done);
        // Registered before looking, so an end in between still wakes us.
        done.as_mut().enable();
        if !self.ended.load(Ordering::Acquire) {
            done.await;
        }
        self.result.get()
    }
}

impl<K, L> GuardedLoader<K, L>
where
    K: AsRef<[u8]> + Hash + Eq + Clone + Send + Sync + 'static,
    L: Loader<K>,
{
    /// Puts `guard` in front of `loader`.
    pub fn new(guard: Guard, loader: L) -> Self {
        Self {
            inner: Arc::new(Inner {
                guard,
                loader,
                in_flight: DashMap::new(),
            }),
            verify: Verify::All,
            shadow: false,
            confirmed_absent: None,
        }
    }

    /// Which `MaybePresent` answers [`contains`](Self::contains) and
    /// [`contains_many`](Self::contains_many) check with the backend (see
    /// [`Verify`]); [`get`](Self::get) and [`get_many`](Self::get_many)
    /// always ask, since only the backend has the value.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// use bloomguard::{Guard, GuardedLoader, Verify};
    ///
    /// let guard = Guard::builder().expected_items(1_000).build()?;
    /// guard.insert("user:1:item:2");
    /// let seen = GuardedLoader::new(guard.clone(), |_key: String| async move {
    ///     Ok::<Option<()>, std::io::Error>(unreachable!("trusted, never asked"))
    /// })
    /// .verify(Verify::None)?;
    /// assert!(seen.contains("user:1:item:2").await?);
    /// assert_eq!(guard.stats().unverified_positives, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    ///
    /// # Errors
    /// A [`Verify::Sample`] fraction outside `(0, 1]`.
    pub fn verify(mut self, verify: Verify) -> Result<Self, ConfigError> {
        self.verify = verify.checked()?;
        Ok(self)
    }

    /// Shadow mode: every call goes to the backend whatever the guard says;
    /// the verdicts are counted, and an `Absent` the backend contradicts is
    /// counted as a would-be false negative
    /// ([`GuardStats::would_be_false_negatives`](crate::GuardStats::would_be_false_negatives))
    /// and logged. The calls the guard would have saved are
    /// [`GuardStats::shadowed_absent`](crate::GuardStats::shadowed_absent).
    /// For rolling a guard out: watch those two, then drop shadow mode.
    #[must_use]
    pub fn shadow(mut self) -> Self {
        self.shadow = true;
        self
    }

    /// Remembers up to `capacity` keys the backend confirmed absent after a
    /// false positive, for `ttl`, and answers them absent without asking
    /// again. Off by default. Clones of this loader share the cache.
    ///
    /// A cached answer never hides a key being written: it is trusted only
    /// while the key has had no [`Guard::insert`] since the backend was asked
    /// minus the rebuild policy's
    /// [`write_settle`](crate::RebuildPolicy::write_settle) (the time within
    /// which a write reaches the store after its insert), and never while a
    /// [`PendingWrite`](crate::PendingWrite) for it is open. For that the
    /// guard stamps each insert's time from now on (one atomic per insert).
    /// A rebuild's swap, a [`Guard::merge_filter`] and a fleet snapshot
    /// bring keys in without inserting each: they count as an insert of
    /// every key, so the cache asks again after each.
    ///
    /// The backend must show a write within the write settle of its insert.
    /// A backend that reads a replica shows it only once the replica has
    /// applied it: with a lag longer than the settle, a miss read before
    /// that would be remembered for `ttl` (where without the cache it would
    /// last as long as the lag). Over a replica, set the write settle above
    /// its lag, or keep the cache off.
    ///
    /// In a fleet, another member's `FleetWrite` (the `redis` feature)
    /// is open on that member only: here its key is stamped when its entry
    /// is applied, and again when the write, if slower than half the settle,
    /// is announced as landed (`FleetWrite::finish`).
    /// A miss asked here past the settle, while such a write was in flight,
    /// is remembered, and answered from the cache from the write's landing
    /// until that announcement is applied here (for `ttl` if it never is).
    /// Where fleet writes may take longer than the write settle, raise the
    /// settle above them, or keep the cache off.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
    /// use std::time::Duration;
    /// use bloomguard::{Guard, GuardedLoader};
    ///
    /// let guard = Guard::builder().expected_items(1_000).build()?;
    /// let loader = GuardedLoader::new(guard.clone(), |_key: String| async {
    ///     Ok::<Option<u32>, std::io::Error>(None) // the store holds nothing
    /// })
    /// .confirmed_absent_cache(10_000, Duration::from_secs(60))?;
    /// guard.insert("ghost"); // inserted, then the store write failed
    /// tokio::time::sleep(Duration::from_millis(300)).await; // past the write settle
    /// assert_eq!(loader.get("ghost").await?, None); // asks the backend
    /// assert_eq!(loader.get("ghost").await?, None); // from the cache
    /// assert_eq!(guard.stats().confirmed_absent_hits, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    ///
    /// # Errors
    /// A zero `capacity`, or a `ttl` that is zero or over
    /// [`MAX_DURATION`](crate::guard::MAX_DURATION).
    pub fn confirmed_absent_cache(
        mut self,
        capacity: u64,
        ttl: Duration,
    ) -> Result<Self, ConfigError> {
        let cache = ConfirmedAbsent::new(&self.inner.guard, capacity, ttl)?;
        self.confirmed_absent = Some(Arc::new(cache));
        Ok(self)
    }

    /// Keys held by the confirmed-absent cache (expired ones until they are
    /// swept); 0 without one.
    pub fn confirmed_absent_entries(&self) -> u64 {
        self.confirmed_absent
            .as_ref()
            .map_or(0, |cache| cache.len())
    }

    /// Loads `key` unless the guard rules it out.
    ///
    /// The guard is checked when `get` is called, the backend when the
    /// future is polled: an absent key's future is ready at once. (Checked
    /// inside the future, the key went through memory first, and a copy of
    /// the future before its poll made each check wait for the one before
    /// it to leave the CPU: 0.29× the raw filter's rate past the cache,
    /// against 0.55× now.)
    ///
    /// The key is borrowed (a `&str` for a `String` key, as `HashMap::get`
    /// takes one): it is copied into an owned one only to ask the backend,
    /// so an absent key costs no allocation (but where
    /// [`Guard::check`] makes one: a staleness check's sample of it, or a
    /// thread's first check).
    ///
    /// # Errors
    /// The loader's error, shared with every caller that waited on the same
    /// backend call.
    pub fn get<Q>(
        &self,
        key: &Q,
    ) -> impl Future<Output = Loaded<L::Value, L::Error>> + use<'_, Q, K, L>
    where
        Q: ToOwned<Owned = K> + AsRef<[u8]> + ?Sized,
    {
        let verdict = self.inner.guard.check(key.as_ref());
        // `Verify::All` trusts nothing: every route but `Absent` asks.
        if self.route(key.as_ref(), verdict, Verify::All) == Route::Absent {
            return Answer::Known(false);
        }
        let key = key.to_owned();
        // Boxed: inline, the backend call's state would make every `get`
        // future hundreds of bytes, copied on each call, absent or not.
        Answer::Asking(Box::pin(async move { self.ask(&key, verdict).await }))
    }

    /// Whether `key` is in the store: `false` when the guard rules it out,
    /// `true` for a "maybe" trusted by the [`verify`](Self::verify) policy,
    /// otherwise what the backend answers. Like [`get`](Self::get), it
    /// checks the guard when called, and borrows the key.
    ///
    /// # Errors
    /// The loader's error, shared with every caller that waited on the same
    /// backend call.
    pub fn contains<Q>(
        &self,
        key: &Q,
    ) -> impl Future<Output = Result<bool, Arc<L::Error>>> + use<'_, Q, K, L>
    where
        Q: ToOwned<Owned = K> + AsRef<[u8]> + ?Sized,
    {
        let verdict = self.inner.guard.check(key.as_ref());
        match self.route(key.as_ref(), verdict, self.verify) {
            Route::Absent => Answer::Known(false),
            Route::Trusted => Answer::Known(true),
            Route::Ask => {
                let key = key.to_owned();
                // Boxed for the reason `get` gives.
                Answer::Asking(Box::pin(async move {
                    Ok(self.ask(&key, verdict).await?.is_some())
                }))
            }
        }
    }

    /// Loads each of `keys` the guard does not rule out, with one
    /// [`Loader::load_many`] call for all of them; answers in the order of
    /// `keys`.
    ///
    /// Batches are not coalesced with other calls. With no key left to load,
    /// the backend is not called at all.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// use bloomguard::{Guard, GuardedLoader};
    ///
    /// let guard = Guard::builder().expected_items(1_000).build()?;
    /// guard.insert("item:2");
    /// let loader = GuardedLoader::new(guard, |key: &'static str| async move {
    ///     Ok::<_, std::io::Error>((key == "item:2").then_some("a lamp"))
    /// });
    /// let items = loader.get_many(&["item:2", "item:3"]).await?;
    /// assert_eq!(items, [Some("a lamp"), None]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    ///
    /// # Errors
    /// The loader's error: the whole batch fails, and nothing is counted.
    ///
    /// # Panics
    /// If [`Loader::load_many`] answers another number of values than it
    /// was given keys: the keys left over would read as not found.
    pub async fn get_many(&self, keys: &[K]) -> Result<Vec<Option<L::Value>>, Arc<L::Error>> {
        let mut values = vec![None; keys.len()];
        for (index, value) in self.load_routed(keys, Verify::All, |_, _| {}).await? {
            values[index] = value;
        }
        Ok(values)
    }

    /// Whether each of `keys` is in the store, in their order: the guard
    /// checks them (`check_many`, 64 at a time), then one
    /// [`Loader::load_many`] call loads the keys that
    /// the guard passes and the [`verify`](Self::verify) policy does not
    /// trust. This is the seen-items gate: ~120 candidates per request, and
    /// one `MGET` for the few "maybe" ones (with [`Verify::Sample`], for
    /// a sampled few of them).
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// use bloomguard::{Guard, GuardedLoader};
    ///
    /// let guard = Guard::builder().expected_items(1_000).build()?;
    /// guard.insert("user:1:item:2");
    /// let seen = GuardedLoader::new(guard, |key: &'static str| async move {
    ///     Ok::<_, std::io::Error>((key == "user:1:item:2").then_some(()))
    /// });
    /// let answers = seen.contains_many(&["user:1:item:2", "user:1:item:3"]).await?;
    /// assert_eq!(answers, [true, false]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    ///
    /// # Errors
    /// The loader's error: the whole batch fails, and nothing is counted.
    ///
    /// # Panics
    /// If [`Loader::load_many`] answers another number of values than it
    /// was given keys: the keys left over would read as not found.
    pub async fn contains_many(&self, keys: &[K]) -> Result<Vec<bool>, Arc<L::Error>> {
        let mut answers = vec![false; keys.len()];
        let loaded = self
            .load_routed(keys, self.verify, |index, route| {
                answers[index] = route == Route::Trusted;
            })
            .await?;
        for (index, value) in loaded {
            answers[index] = value.is_some();
        }
        Ok(answers)
    }

    /// Checks `keys` and routes each: tells `settled` the index and route
    /// of every key answered without the backend, and loads the others in
    /// one batch, returning their indices and values. A batch that asks
    /// nothing allocates nothing here (the verdicts live on the stack, one
    /// group of keys at a time), so the caller's answer is its only one.
    async fn load_routed(
        &self,
        keys: &[K],
        verify: Verify,
        mut settled: impl FnMut(usize, Route),
    ) -> Result<Vec<(usize, Option<L::Value>)>, Arc<L::Error>> {
        const GROUP: usize = crate::guard::CHECK_GROUP;
        let mut asked: Vec<(usize, Verdict)> = Vec::new();
        let mut verdicts = [Verdict::Warming; GROUP];
        for (group_index, group) in keys.chunks(GROUP).enumerate() {
            let verdicts = &mut verdicts[..group.len()];
            self.inner.guard.check_many(group, verdicts);
            for (offset, (key, &verdict)) in group.iter().zip(verdicts.iter()).enumerate() {
                let index = group_index * GROUP + offset;
                match self.route(key.as_ref(), verdict, verify) {
                    Route::Ask => asked.push((index, verdict)),
                    route => settled(index, route),
                }
            }
        }
        if asked.is_empty() {
            return Ok(Vec::new());
        }
        let asked_at = Instant::now();
        let loaded = self
            .inner
            .loader
            .load_many(
                asked
                    .iter()
                    .map(|&(index, _)| keys[index].clone())
                    .collect(),
            )
            .await
            .map_err(Arc::new)?;
        // A short answer would read as "not found" for the keys left over.
        assert_eq!(
            loaded.len(),
            asked.len(),
            "Loader::load_many answered {} values for {} keys: it must answer one per key, in order",
            loaded.len(),
            asked.len()
        );
        Ok(asked
            .into_iter()
            .zip(loaded)
            .map(|((index, verdict), value)| {
                self.record_answer(&keys[index], verdict, value.is_some(), asked_at);
                (index, value)
            })
            .collect())
    }

    /// Where the answer for `key`, checked `verdict`, comes from; counts a
    /// hit of the confirmed-absent cache, a trusted positive, or an absent
    /// answer passed on in shadow mode.
    fn route(&self, key: &[u8], verdict: Verdict, verify: Verify) -> Route {
        let guard = &self.inner.guard;
        if self.shadow {
            if verdict == Verdict::Absent {
                guard.count_shadowed_absent();
            }
            return Route::Ask;
        }
        match verdict {
            Verdict::Absent => Route::Absent,
            Verdict::Warming => Route::Ask,
            // A fenced guard's "maybe" is not its filters' (they may lack
            // keys the fleet acknowledged): neither trusted nor answered
            // from the cache, whose answers only inserts applied here renew.
            Verdict::MaybePresent if guard.is_fenced() => Route::Ask,
            Verdict::MaybePresent => {
                // A false positive the backend confirmed: absent without it.
                let confirmed = self
                    .confirmed_absent
                    .as_ref()
                    .is_some_and(|cache| cache.is_absent(guard, key));
                if confirmed {
                    guard.count_confirmed_absent_hit(verify.verifies(key));
                    Route::Absent
                } else if verify.verifies(key) {
                    Route::Ask
                } else {
                    guard.count_unverified_positive();
                    Route::Trusted
                }
            }
        }
    }

    /// Asks the backend about `key` (coalesced with concurrent asks) and
    /// counts its answer.
    async fn ask(&self, key: &K, verdict: Verdict) -> Loaded<L::Value, L::Error> {
        let (result, asked_at) = self.load_once(key).await;
        if let Ok(found) = &result {
            self.record_answer(key, verdict, found.is_some(), asked_at);
        }
        result
    }

    /// Counts the backend's answer for `key` (asked at `asked_at`) and
    /// remembers a confirmed false positive.
    fn record_answer(&self, key: &K, verdict: Verdict, found: bool, asked_at: Instant) {
        let guard = &self.inner.guard;
        guard.count_outcome(verdict, found);
        if !found
            && verdict == Verdict::MaybePresent
            && let Some(cache) = &self.confirmed_absent
        {
            cache.remember(guard, key.as_ref(), asked_at);
        }
    }

    /// The guard in front of the loader.
    pub fn guard(&self) -> &Guard {
        &self.inner.guard
    }

    /// The loader behind the guard.
    pub fn loader(&self) -> &L {
        &self.inner.loader
    }

    /// Backend calls in progress (one per key, however many callers wait).
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.len()
    }

    /// Runs the backend call for `key`, or waits for the one running; returns
    /// its result and when it started.
    async fn load_once(&self, key: &K) -> (Loaded<L::Value, L::Error>, Instant) {
        let in_flight = &self.inner.in_flight;
        let began = Instant::now();
        loop {
            let flight = match in_flight.entry(key.clone()) {
                Entry::Occupied(running) => Arc::clone(running.get()),
                Entry::Vacant(vacant) => {
                    let flight = Arc::new(Flight::new());
                    vacant.insert(Arc::clone(&flight));
                    return self.lead(key, flight).await;
                }
            };
            match flight.ended().await {
                Some(result) if self.may_share(key, &flight, result, began) => {
                    return (result.clone(), flight.started);
                }
                // Too old for this caller: a call begun after it (led by one
                // such caller, joined by the others) answers them all.
                Some(_) => {
                    in_flight.remove_if(key, |_, running| Arc::ptr_eq(running, &flight));
                }
                // The caller running it was cancelled: take over.
                None => {}
            }
        }
    }

    /// Whether a caller that joined `flight` at `began` may take its
    /// result. A value or an error, always; so any result of a call begun
    /// after the caller (strictly: under a paused clock, "at once" is not
    /// "after"). An older "not found" only where no write of the key
    /// can have landed after the call's read began: the caller may have
    /// begun after such a write completed, and the older read missed it.
    /// Without the insert clock (see `Guard::may_have_written_since`) that
    /// cannot be shown, nor on a fenced guard (a fleet member may lack
    /// inserts the fleet acknowledged without it, which stamped nothing
    /// here).
    fn may_share(
        &self,
        key: &K,
        flight: &Flight<L::Value, L::Error>,
        result: &Loaded<L::Value, L::Error>,
        began: Instant,
    ) -> bool {
        let guard = &self.inner.guard;
        !matches!(result, Ok(None))
            || flight.started > began
            || (!guard.is_fenced() && !guard.may_have_written_since(key.as_ref(), flight.started))
    }

    async fn lead(
        &self,
        key: &K,
        flight: Arc<Flight<L::Value, L::Error>>,
    ) -> (Loaded<L::Value, L::Error>, Instant) {
        let _leading = Leading {
            in_flight: &self.inner.in_flight,
            key,
            flight: &flight,
        };
        let result = self.inner.loader.load(key.clone()).await.map_err(Arc::new);
        let _ = flight.result.set(result.clone());
        (result, flight.started)
    }
}

/// The running call's entry: removed and its waiters woken when the call
/// ends, whether it completed or its caller was cancelled.
struct Leading<'a, K: Hash + Eq, V, E> {
    in_flight: &'a InFlight<K, V, E>,
    key: &'a K,
    flight: &'a Arc<Flight<V, E>>,
}

impl<K: Hash + Eq, V, E> Drop for Leading<'_, K, V, E> {
    fn drop(&mut self) {
        self.in_flight
            .remove_if(self.key, |_, running| Arc::ptr_eq(running, self.flight));
        // Waiters find the result, or none if the call was cancelled (and
        // one of them runs it again).
        self.flight.ended.store(true, Ordering::Release);
        self.flight.done.notify_waiters();
    }
}

impl<K, L: Loader<K>> Clone for GuardedLoader<K, L> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            verify: self.verify,
            shadow: self.shadow,
            confirmed_absent: self.confirmed_absent.clone(),
        }
    }
}

impl<K: Hash + Eq, L: Loader<K>> fmt::Debug for GuardedLoader<K, L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardedLoader")
            .field("guard", &self.inner.guard)
            .field("verify", &self.verify)
            .field("shadow", &self.shadow)
            .field("confirmed_absent", &self.confirmed_absent)
            .field("in_flight", &self.inner.in_flight.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A waiter takes the running call's entry under the map's lock and
    /// waits after releasing it; the caller running the call may be
    /// cancelled in between. Its waiter must still learn that the call
    /// ended (and run it again) rather than wait for a wake-up that came
    /// before it listened.
    #[tokio::test(start_paused = true)]
    async fn a_waiter_learns_of_a_call_cancelled_before_it_listened() {
        let in_flight: InFlight<String, (), ()> = DashMap::new();
        let key = "item:1".to_owned();
        let flight = Arc::new(Flight::new());
        in_flight.insert(key.clone(), Arc::clone(&flight));
        let waiter_took = Arc::clone(in_flight.get(&key).unwrap().value());
        drop(Leading {
            in_flight: &in_flight,
            key: &key,
            flight: &flight,
        });
        let ended = tokio::time::timeout(Duration::from_secs(60), waiter_took.ended()).await;
        assert!(
            matches!(ended, Ok(None)),
            "the waiter never learned that the call ended"
        );
    }
}
