//! Where a rebuild reads the keys from: [`KeySource`].

use std::fmt;
use std::pin::Pin;

use futures_core::Stream;
use futures_util::{StreamExt, stream};

pub use crate::error::SourceError;

/// Keys streamed in batches: a Redis `SCAN` page, a database cursor's fetch.
pub type KeyBatch = Vec<Vec<u8>>;

/// The stream one pass of a [`KeySource`] yields.
pub type KeyStream<'a> = Pin<Box<dyn Stream<Item = Result<KeyBatch, SourceError>> + Send + 'a>>;

/// Everything the store holds, streamed for a rebuild.
///
/// Each call of [`scan`](Self::scan) starts a fresh pass. A pass must yield
/// every key that is in the store for its whole duration; keys written or
/// deleted while it runs may or may not appear (the guaranty of Redis `SCAN`).
/// Writes made during a pass are covered by the guard itself, which inserts
/// them into the filter being built as well (see [`Guard::insert`]).
///
/// A pass should stream: a rebuild over ten million keys then needs memory for
/// one batch, not for the key set.
///
/// For keys held in memory, [`from_fn`] wraps a closure that lists them.
///
/// [`Guard::insert`]: crate::Guard::insert
pub trait KeySource: Send + Sync + 'static {
    /// Starts a pass over every key.
    fn scan(&self) -> KeyStream<'_>;
}

impl<S: KeySource + ?Sized> KeySource for std::sync::Arc<S> {
    fn scan(&self) -> KeyStream<'_> {
        (**self).scan()
    }
}

impl<S: KeySource + ?Sized> KeySource for Box<S> {
    fn scan(&self) -> KeyStream<'_> {
        (**self).scan()
    }
}

/// A [`KeySource`] over whatever a closure lists at the start of each pass:
/// an in-memory store, a snapshot, a test fixture.
///
/// The closure cannot fail, so what it lists is taken for the whole store:
/// one that meets an error and lists nothing (or part) has the guard answer
/// `Absent` for every key it left out. Over a store that can fail (a
/// database, a file), implement [`KeySource`] and yield a [`SourceError`]:
/// the pass then fails and the old filters keep serving.
///
/// ```
/// use std::sync::{Arc, RwLock};
/// use std::collections::HashSet;
///
/// let store = Arc::new(RwLock::new(HashSet::from(["item:1".to_string()])));
/// let listed = Arc::clone(&store);
/// let source = bloomguard::source::from_fn(move || {
///     listed.read().unwrap().iter().cloned().collect::<Vec<_>>()
/// });
/// # let _ = source;
/// ```
pub fn from_fn<F, I>(list: F) -> FnSource<F>
where
    F: Fn() -> I + Send + Sync + 'static,
    I: IntoIterator,
    I::Item: AsRef<[u8]>,
    I::IntoIter: Send + Unpin + 'static,
{
    FnSource { list }
}

/// The [`KeySource`] made by [`from_fn`].
#[derive(Clone)]
pub struct FnSource<F> {
    list: F,
}

impl<F> fmt::Debug for FnSource<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FnSource").finish_non_exhaustive()
    }
}

/// Keys per batch when a source is an iterator.
const ITERATOR_BATCH: usize = 4096;

impl<F, I> KeySource for FnSource<F>
where
    F: Fn() -> I + Send + Sync + 'static,
    I: IntoIterator,
    I::Item: AsRef<[u8]>,
    I::IntoIter: Send + Unpin + 'static,
{
    fn scan(&self) -> KeyStream<'_> {
        // Always ready: a rebuild over it yields to the runtime between
        // batches on its own (see `rebuild.rs`).
        let keys = (self.list)().into_iter().map(|key| key.as_ref().to_vec());
        Box::pin(stream::iter(keys).chunks(ITERATOR_BATCH).map(Ok))
    }
}

/// A source whose pass lists its keys at once (before a test writes more)
/// and yields them only once the gate opens: a slow scan that has passed
/// the keys written later. It counts the passes that began.
#[cfg(all(test, not(bloomguard_loom)))]
pub(crate) struct GatedSource {
    keys: Vec<Vec<u8>>,
    gate: std::sync::Arc<tokio::sync::Semaphore>,
    pub(crate) scans: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

#[cfg(all(test, not(bloomguard_loom)))]
impl GatedSource {
    pub(crate) fn new(keys: Vec<Vec<u8>>, gate: &std::sync::Arc<tokio::sync::Semaphore>) -> Self {
        Self {
            keys,
            gate: std::sync::Arc::clone(gate),
            scans: std::sync::Arc::default(),
        }
    }
}

#[cfg(all(test, not(bloomguard_loom)))]
impl KeySource for GatedSource {
    fn scan(&self) -> KeyStream<'_> {
        self.scans
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (keys, gate) = (self.keys.clone(), std::sync::Arc::clone(&self.gate));
        Box::pin(stream::once(async move {
            gate.acquire().await.expect("never closed").forget();
            Ok(keys)
        }))
    }
}
