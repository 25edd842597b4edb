//! Redis as the store behind a guard (the `redis` feature): [`RedisSource`]
//! streams every key for rebuilds with `SCAN`, [`RedisLoader`] reads values
//! with `GET`/`MGET`.
//!
//! Both connect lazily through a [`ConnectionManager`], which reconnects on
//! its own: a guard built while Redis is down stays warming (its rebuilds
//! fail and are retried), and starts serving once Redis is up; a loader
//! whose Redis restarted fails the calls made while it was gone and
//! recovers without being rebuilt.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::{TryStreamExt, stream};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, RedisError};
use tokio::sync::OnceCell;

pub mod fleet;

pub use fleet::{FleetError, FleetHandle, FleetSync, FleetWriteError, StreamPosition};

use crate::guard::source::{KeyBatch, KeySource, KeyStream, SourceError};
use crate::loader::Loader;

/// A lazily made connection manager, shared by the clones of a source or loader.
#[derive(Clone)]
struct Connection {
    client: Client,
    manager: std::sync::Arc<OnceCell<ConnectionManager>>,
    response_timeout: Duration,
}

impl Connection {
    fn new(client: Client, response_timeout: Duration) -> Self {
        Self {
            client,
            manager: std::sync::Arc::new(OnceCell::new()),
            response_timeout,
        }
    }

    /// The connection manager, made on first use (and tried again on the
    /// next use if Redis could not be reached).
    async fn get(&self) -> Result<ConnectionManager, RedisError> {
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.response_timeout))
            .set_connection_timeout(Some(self.response_timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        self.manager
            .get_or_try_init(|| self.client.get_connection_manager_with_config(config))
            .await
            .cloned()
    }
}

/// Every key matching a pattern, streamed with `SCAN … MATCH … COUNT`: a
/// rebuild over ten million keys holds one page of keys at a time.
///
/// ```no_run
/// use bloomguard::{Guard, redis::RedisSource};
///
/// let client = redis::Client::open("redis://127.0.0.1/")?;
/// let guard = Guard::builder()
///     .expected_items(10_000_000)
///     .source(RedisSource::new(client, "item:*").strip_prefix("item:"))
///     .build()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct RedisSource {
    connection: Connection,
    pattern: String,
    count: usize,
    key_type: Option<String>,
    strip_prefix: Option<Vec<u8>>,
}

impl RedisSource {
    /// Keys asked for per `SCAN` call unless told: Redis's default is 10,
    /// far too few for a rebuild.
    pub const DEFAULT_COUNT: usize = 1_000;
    /// How long one `SCAN` call may take.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

    /// Keys matching `pattern` (`SCAN`'s `MATCH` glob, `*` for all).
    pub fn new(client: Client, pattern: impl Into<String>) -> Self {
        Self {
            connection: Connection::new(client, Self::DEFAULT_TIMEOUT),
            pattern: pattern.into(),
            count: Self::DEFAULT_COUNT,
            key_type: None,
            strip_prefix: None,
        }
    }

    /// The `COUNT` hint of each `SCAN` call (default [`DEFAULT_COUNT`](Self::DEFAULT_COUNT)).
    #[must_use]
    pub fn count(mut self, count: usize) -> Self {
        self.count = count.max(1);
        self
    }

    /// Only keys of this Redis type (`SCAN … TYPE`: `string`, `hash`, …).
    #[must_use]
    pub fn key_type(mut self, key_type: impl Into<String>) -> Self {
        self.key_type = Some(key_type.into());
        self
    }

    /// Removes `prefix` from each key before it reaches the filter, so the
    /// guard holds the ids the application checks (`item:42` → `42`).
    #[must_use]
    pub fn strip_prefix(mut self, prefix: impl AsRef<[u8]>) -> Self {
        self.strip_prefix = Some(prefix.as_ref().to_vec());
        self
    }

    /// How long one `SCAN` call may take (default [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT)).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.connection.response_timeout = timeout;
        self
    }

    async fn scan_page(&self, cursor: u64) -> Result<(u64, KeyBatch), RedisError> {
        let mut command = redis::cmd("SCAN");
        command
            .arg(cursor)
            .arg("MATCH")
            .arg(&self.pattern)
            .arg("COUNT")
            .arg(self.count);
        if let Some(key_type) = &self.key_type {
            command.arg("TYPE").arg(key_type);
        }
        let mut manager = self.connection.get().await?;
        command.query_async(&mut manager).await
    }

    fn strip_prefix_from(&self, keys: &mut KeyBatch) {
        if let Some(prefix) = &self.strip_prefix {
            for key in keys.iter_mut().filter(|key| key.starts_with(prefix)) {
                key.drain(..prefix.len());
            }
        }
    }
}

impl KeySource for RedisSource {
    /// One pass of `SCAN`, a page at a time, until the cursor comes back to 0.
    fn scan(&self) -> KeyStream<'_> {
        let pages = stream::try_unfold(Some(0), move |cursor| async move {
            let Some(cursor) = cursor else {
                return Ok::<_, RedisError>(None); // past the last page
            };
            let (next, mut keys) = self.scan_page(cursor).await?;
            self.strip_prefix_from(&mut keys);
            Ok(Some((keys, (next != 0).then_some(next))))
        });
        // SCAN may return empty pages before the end; skip them.
        Box::pin(
            pages
                .map_err(SourceError::new)
                .try_filter(|keys| std::future::ready(!keys.is_empty())),
        )
    }
}

impl fmt::Debug for RedisSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisSource")
            .field("pattern", &self.pattern)
            .field("count", &self.count)
            .field("key_type", &self.key_type)
            .finish_non_exhaustive()
    }
}

/// Values from Redis: `GET prefix+key`, and `MGET` for batches. Use it as a
/// [`Loader`] for [`GuardedLoader`](crate::GuardedLoader), or as a
/// `tower::Service` behind [`GuardLayer::for_loader`](crate::GuardLayer::for_loader).
#[derive(Clone)]
pub struct RedisLoader {
    connection: Connection,
    prefix: Vec<u8>,
}

impl RedisLoader {
    /// How long one call may take unless told.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

    /// Reads key `k` from Redis key `k` (see [`prefix`](Self::prefix)).
    pub fn new(client: Client) -> Self {
        Self {
            connection: Connection::new(client, Self::DEFAULT_TIMEOUT),
            prefix: Vec::new(),
        }
    }

    /// Reads key `k` from Redis key `prefix + k`.
    #[must_use]
    pub fn prefix(mut self, prefix: impl AsRef<[u8]>) -> Self {
        self.prefix = prefix.as_ref().to_vec();
        self
    }

    /// How long one call may take (default [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT)).
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.connection.response_timeout = timeout;
        self
    }

    fn redis_key(&self, key: &[u8]) -> Vec<u8> {
        let mut redis_key = Vec::with_capacity(self.prefix.len() + key.len());
        redis_key.extend_from_slice(&self.prefix);
        redis_key.extend_from_slice(key);
        redis_key
    }

    /// `GET`: the value of `key`, `None` if Redis does not have it.
    ///
    /// # Errors
    /// Redis unreachable, a timeout, or a reply that is not a string.
    pub async fn get(&self, key: impl AsRef<[u8]>) -> Result<Option<Vec<u8>>, RedisError> {
        let mut manager = self.connection.get().await?;
        redis::cmd("GET")
            .arg(self.redis_key(key.as_ref()))
            .query_async(&mut manager)
            .await
    }

    /// `MGET`: the values of `keys`, in order, in one round trip.
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub async fn get_many<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Vec<Option<Vec<u8>>>, RedisError> {
        self.query_many(self.mget(keys)).await
    }

    /// The `MGET` for `keys`, built before any await so that the keys need
    /// not outlive it; `None` for no keys.
    fn mget<K: AsRef<[u8]>>(&self, keys: &[K]) -> Option<redis::Cmd> {
        if keys.is_empty() {
            return None;
        }
        let mut command = redis::cmd("MGET");
        for key in keys {
            command.arg(self.redis_key(key.as_ref()));
        }
        Some(command)
    }

    async fn query_many(
        &self,
        mget: Option<redis::Cmd>,
    ) -> Result<Vec<Option<Vec<u8>>>, RedisError> {
        let Some(command) = mget else {
            return Ok(Vec::new());
        };
        let mut manager = self.connection.get().await?;
        command.query_async(&mut manager).await
    }
}

impl<K: AsRef<[u8]> + Send + 'static> Loader<K> for RedisLoader {
    type Value = Vec<u8>;
    type Error = RedisError;

    fn load(&self, key: K) -> impl Future<Output = Result<Option<Vec<u8>>, RedisError>> + Send {
        let loader = self.clone();
        async move { loader.get(key).await }
    }

    /// One `MGET` for the batch.
    fn load_many(
        &self,
        keys: Vec<K>,
    ) -> impl Future<Output = Result<Vec<Option<Vec<u8>>>, RedisError>> + Send {
        let (loader, mget) = (self.clone(), self.mget(&keys));
        async move { loader.query_many(mget).await }
    }
}

impl<K: AsRef<[u8]> + Send + 'static> tower_service::Service<K> for RedisLoader {
    type Response = Option<Vec<u8>>;
    type Error = RedisError;
    type Future = Pin<Box<dyn Future<Output = Result<Option<Vec<u8>>, RedisError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), RedisError>> {
        // The connection manager multiplexes: there is always room for a call.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, key: K) -> Self::Future {
        let loader = self.clone();
        Box::pin(async move { loader.get(key).await })
    }
}

impl fmt::Debug for RedisLoader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisLoader")
            .field("prefix", &String::from_utf8_lossy(&self.prefix))
            .finish_non_exhaustive()
    }
}
