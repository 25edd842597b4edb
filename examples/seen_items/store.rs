//! Where the seen history lives: an embedded in-memory store, Redis when
//! `REDIS_URL` is set, or PostgreSQL when `DATABASE_URL` is. Each is a
//! `Loader` (batches with one lookup pass, one MGET, or one query joining the
//! keys to the table) and a `KeySource` for the guard's rebuilds.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bloomguard::Loader;
use bloomguard::source::{KeyBatch, KeySource, KeyStream, SourceError};
use futures_core::Stream;
use xxhash_rust::xxh3::Xxh3DefaultBuilder;

/// The store's answer to "has this user seen this item?": found or not.
pub(crate) type Seen = ();

/// The store, counting the lookups it serves.
#[derive(Debug, Clone)]
pub(crate) struct SeenStore {
    backend: Backend,
    lookups: Arc<Lookups>,
}

#[derive(Debug, Clone)]
pub(crate) enum Backend {
    Memory(Arc<MemoryStore>),
    #[cfg(feature = "redis")]
    Redis(Arc<RedisStore>),
    #[cfg(feature = "postgres")]
    Postgres(Arc<PgStore>),
}

#[derive(Debug, Default)]
struct Lookups {
    keys: AtomicU64,
    calls: AtomicU64,
}

/// Keys looked up and calls made, at some moment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LookupCount {
    keys: u64,
    calls: u64,
}

impl SeenStore {
    pub(crate) fn new(backend: Backend) -> Self {
        Self {
            backend,
            lookups: Arc::default(),
        }
    }

    #[cfg(feature = "redis")]
    pub(crate) fn backend(&self) -> &Backend {
        &self.backend
    }

    pub(crate) fn lookups(&self) -> LookupCount {
        LookupCount {
            keys: self.lookups.keys.load(Ordering::Relaxed),
            calls: self.lookups.calls.load(Ordering::Relaxed),
        }
    }

    /// Keys looked up and calls made since `before`.
    pub(crate) fn lookups_since(&self, before: LookupCount) -> (u64, u64) {
        let now = self.lookups();
        (now.keys - before.keys, now.calls - before.calls)
    }

    /// Writes `keys` as seen now (with the store's expiry, if any).
    pub(crate) async fn write(&self, keys: &[String]) -> Result<(), String> {
        match &self.backend {
            Backend::Memory(memory) => {
                memory.write(keys);
                Ok(())
            }
            #[cfg(feature = "redis")]
            Backend::Redis(redis) => redis.write(keys).await,
            #[cfg(feature = "postgres")]
            Backend::Postgres(postgres) => postgres.write(keys).await,
        }
    }

    /// The keys, streamed for a rebuild.
    pub(crate) fn source(&self) -> Box<dyn KeySource> {
        match &self.backend {
            Backend::Memory(memory) => Box::new(Arc::clone(memory)),
            #[cfg(feature = "redis")]
            Backend::Redis(redis) => Box::new(redis.source()),
            #[cfg(feature = "postgres")]
            Backend::Postgres(postgres) => Box::new(postgres.source()),
        }
    }

    pub(crate) fn describe(&self) -> String {
        match &self.backend {
            Backend::Memory(_) => "embedded in-memory store".into(),
            #[cfg(feature = "redis")]
            Backend::Redis(redis) => redis.describe(),
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => format!("PostgreSQL (table {TABLE})"),
        }
    }
}

/// Which of a batch's keys a store's loader found: only that a value
/// exists matters here.
#[cfg(any(feature = "redis", feature = "postgres"))]
fn seen_in<V, E: std::fmt::Display>(
    values: Result<Vec<Option<V>>, E>,
) -> Result<Vec<Option<Seen>>, String> {
    let values = values.map_err(|error| error.to_string())?;
    Ok(values.into_iter().map(|value| value.map(|_| ())).collect())
}

impl Loader<String> for SeenStore {
    type Value = Seen;
    type Error = String;

    async fn load(&self, key: String) -> Result<Option<Seen>, String> {
        Ok(self.load_many(vec![key]).await?.pop().flatten())
    }

    async fn load_many(&self, keys: Vec<String>) -> Result<Vec<Option<Seen>>, String> {
        self.lookups.calls.fetch_add(1, Ordering::Relaxed);
        self.lookups
            .keys
            .fetch_add(keys.len() as u64, Ordering::Relaxed);
        self.find(&keys).await
    }
}

impl SeenStore {
    /// Which of `keys` the store holds, asked by the audit: not counted
    /// among the lookups the guard is measured by.
    pub(crate) async fn holds(&self, keys: &[String]) -> Result<Vec<bool>, String> {
        Ok(self.find(keys).await?.iter().map(Option::is_some).collect())
    }

    async fn find(&self, keys: &[String]) -> Result<Vec<Option<Seen>>, String> {
        match &self.backend {
            Backend::Memory(memory) => Ok(keys
                .iter()
                .map(|key| memory.contains(key).then_some(()))
                .collect()),
            #[cfg(feature = "redis")]
            Backend::Redis(redis) => redis.contains_many(keys).await,
            #[cfg(feature = "postgres")]
            Backend::Postgres(postgres) => postgres.contains_many(keys).await,
        }
    }
}

const SHARDS: usize = 64;

type Shard = HashMap<String, Instant, Xxh3DefaultBuilder>;

/// Sharded, so that a rebuild listing one shard holds up writes to that
/// shard only.
#[derive(Debug)]
pub(crate) struct MemoryStore {
    shards: Vec<RwLock<Shard>>,
    expires_after: Option<Duration>,
}

impl MemoryStore {
    pub(crate) fn new(expires_after: Option<Duration>) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| RwLock::default()).collect(),
            expires_after,
        }
    }

    fn shard(&self, key: &str) -> &RwLock<Shard> {
        // Middle bits: the maps use the low ones for buckets and the top ones
        // for their control bytes.
        &self.shards[(Xxh3DefaultBuilder.hash_one(key) >> 32) as usize % SHARDS]
    }

    fn is_live(&self, written_at: Instant, now: Instant) -> bool {
        self.expires_after
            .is_none_or(|ttl| now.saturating_duration_since(written_at) < ttl)
    }

    pub(crate) fn contains(&self, key: &str) -> bool {
        let shard = self.shard(key).read().unwrap();
        shard
            .get(key)
            .is_some_and(|&at| self.is_live(at, Instant::now()))
    }

    pub(crate) fn write(&self, keys: &[String]) {
        let now = Instant::now();
        for key in keys {
            self.shard(key).write().unwrap().insert(key.clone(), now);
        }
    }

    /// The live keys of shard `index`.
    fn list_shard(&self, index: usize) -> KeyBatch {
        let now = Instant::now();
        let shard = self.shards[index].read().unwrap();
        shard
            .iter()
            .filter(|&(_, &at)| self.is_live(at, now))
            .map(|(key, _)| key.as_bytes().to_vec())
            .collect()
    }
}

/// A pass lists one shard per batch.
impl KeySource for MemoryStore {
    fn scan(&self) -> KeyStream<'_> {
        Box::pin(ShardScan {
            store: self,
            next: 0,
        })
    }
}

struct ShardScan<'a> {
    store: &'a MemoryStore,
    next: usize,
}

impl Stream for ShardScan<'_> {
    type Item = Result<KeyBatch, SourceError>;

    fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.next == SHARDS {
            return Poll::Ready(None);
        }
        let batch = self.store.list_shard(self.next);
        self.next += 1;
        Poll::Ready(Some(Ok(batch)))
    }
}

/// Redis keys are `PREFIX + user:…:item:…`.
#[cfg(feature = "redis")]
pub(crate) const PREFIX: &str = "bloomguard:seen:";

#[cfg(feature = "redis")]
#[derive(Debug, Clone)]
pub(crate) struct RedisStore {
    url: String,
    loader: bloomguard::redis::RedisLoader,
    source: bloomguard::redis::RedisSource,
    writes: Writes,
    expires_after: Option<Duration>,
}

/// Where the writes go: one node, or a cluster (with its seed nodes, which
/// the fleet of `--instances` connects to as well).
#[cfg(feature = "redis")]
#[derive(Clone)]
enum Writes {
    Node(Box<redis::Client>, redis::aio::MultiplexedConnection),
    Cluster(redis::cluster_async::ClusterConnection, Vec<String>),
}

#[cfg(feature = "redis")]
impl std::fmt::Debug for Writes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Node(..) => "Node",
            Self::Cluster(..) => "Cluster",
        })
    }
}

/// The name of the fleet the instances form (`--instances`).
#[cfg(feature = "redis")]
pub(crate) const FLEET: &str = "seen_items";

/// Deletes every key matching `pattern`, a page of `SCAN` at a time.
#[cfg(feature = "redis")]
async fn unlink_matching(
    connection: &mut redis::aio::MultiplexedConnection,
    pattern: &str,
) -> Result<(), redis::RedisError> {
    let mut cursor = 0u64;
    loop {
        let (next, keys): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(10_000)
            .query_async(connection)
            .await?;
        if !keys.is_empty() {
            let () = redis::cmd("UNLINK")
                .arg(keys)
                .query_async(connection)
                .await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

#[cfg(feature = "redis")]
impl RedisStore {
    fn describe(&self) -> String {
        let kind = match self.writes {
            Writes::Node(..) => "Redis",
            Writes::Cluster(..) => "Redis Cluster",
        };
        format!("{kind} at {} (keys under {PREFIX})", self.url)
    }

    /// `guard`'s membership of the fleet of `--instances`, on the store's
    /// Redis: its node, or its cluster.
    pub(crate) fn fleet_member(
        &self,
        guard: bloomguard::Guard,
    ) -> Result<bloomguard::redis::fleet::FleetSyncBuilder, redis::RedisError> {
        use bloomguard::redis::FleetSync;
        match &self.writes {
            Writes::Node(client, _) => {
                Ok(FleetSync::builder(guard, client.as_ref().clone(), FLEET))
            }
            Writes::Cluster(_, seeds) => FleetSync::cluster_builder(guard, seeds, FLEET),
        }
    }

    /// Connects, and deletes what an earlier run left under [`PREFIX`].
    pub(crate) async fn open(
        url: &str,
        expires_after: Option<Duration>,
    ) -> Result<Self, redis::RedisError> {
        let client = redis::Client::open(url)?;
        let mut writes = client.get_multiplexed_async_connection().await?;
        // The fleet's keys too (`--instances`): its recorded settings are this run's.
        for pattern in [format!("{PREFIX}*"), format!("{{{FLEET}}}:*")] {
            unlink_matching(&mut writes, &pattern).await?;
        }
        let loader = bloomguard::redis::RedisLoader::new(client.clone()).prefix(PREFIX);
        Ok(Self {
            url: url.to_string(),
            source: loader.source(),
            loader,
            writes: Writes::Node(Box::new(client), writes),
            expires_after,
        })
    }

    /// Connects to the cluster whose seed nodes are `urls`, and deletes
    /// what an earlier run left under [`PREFIX`] and of the fleet on every
    /// master.
    pub(crate) async fn open_cluster(
        urls: &[String],
        expires_after: Option<Duration>,
    ) -> Result<Self, Box<dyn std::error::Error>> {
        let client = redis::cluster::ClusterClient::new(urls.to_vec())?;
        let mut writes = client.get_async_connection().await?;
        for pattern in [format!("{PREFIX}*"), format!("{{{FLEET}}}:*")] {
            let earlier = bloomguard::redis::RedisSource::cluster(client.clone(), pattern);
            let mut pages = earlier.scan();
            while let Some(keys) = futures_util::StreamExt::next(&mut pages).await {
                // UNLINK of many slots: the cluster connection splits it.
                let _: i64 = redis::cmd("UNLINK")
                    .arg(keys?)
                    .query_async(&mut writes)
                    .await?;
            }
        }
        // The replay without the guard asks for 2.16 M keys a second, far
        // more than a cluster on a few cores answers: its calls wait in the
        // connection's queue, for seconds, rather than fail.
        let loader = bloomguard::redis::RedisLoader::cluster(client)
            .prefix(PREFIX)
            .timeout(Duration::from_secs(60));
        Ok(Self {
            url: urls.join(","),
            source: loader.source(),
            loader,
            writes: Writes::Cluster(writes, urls.to_vec()),
            expires_after,
        })
    }

    /// `SET key 1 [PX ttl]` for each key in one pipeline on a node; on a
    /// cluster (where a pipeline goes to one node) one `MSET`, or with an
    /// expiry each `SET` at once over the cluster connection.
    pub(crate) async fn write(&self, keys: &[String]) -> Result<(), String> {
        let set = |key: &String| {
            let mut command = redis::cmd("SET");
            command.arg(format!("{PREFIX}{key}")).arg(1);
            if let Some(ttl) = self.expires_after {
                command.arg("PX").arg(ttl.as_millis() as u64);
            }
            command
        };
        let written = match self.writes.clone() {
            Writes::Node(_, mut connection) => {
                let mut pipeline = redis::pipe();
                for key in keys {
                    pipeline.add_command(set(key)).ignore();
                }
                pipeline.query_async::<()>(&mut connection).await
            }
            // One MSET, which the cluster connection splits by slot.
            Writes::Cluster(mut connection, _) if self.expires_after.is_none() => {
                let mut mset = redis::cmd("MSET");
                for key in keys {
                    mset.arg(format!("{PREFIX}{key}")).arg(1);
                }
                mset.query_async::<()>(&mut connection).await
            }
            Writes::Cluster(connection, _) => {
                let writes = keys.iter().map(|key| {
                    let (command, mut connection) = (set(key), connection.clone());
                    async move { command.query_async::<()>(&mut connection).await }
                });
                futures_util::future::try_join_all(writes).await.map(|_| ())
            }
        };
        written.map_err(|error| error.to_string())
    }

    async fn contains_many(&self, keys: &[String]) -> Result<Vec<Option<Seen>>, String> {
        seen_in(self.loader.get_many(keys).await)
    }

    fn source(&self) -> bloomguard::redis::RedisSource {
        self.source.clone()
    }
}

/// The history's table in PostgreSQL: one row per seen pair.
#[cfg(feature = "postgres")]
pub(crate) const TABLE: &str = "bloomguard_seen";

#[cfg(feature = "postgres")]
#[derive(Debug)]
pub(crate) struct PgStore {
    pool: sqlx::PgPool,
    /// The rebuilds' own pool: they run on the maintenance thread's runtime,
    /// and a sqlx connection works only while the runtime that opened it
    /// runs, so one a rebuild opened into `pool` would fail the requests once
    /// that runtime stopped.
    rebuilds_pool: sqlx::PgPool,
    loader: bloomguard::postgres::PgLoader<String>,
}

#[cfg(feature = "postgres")]
impl PgStore {
    /// Connects, and recreates [`TABLE`] (empty) with a primary key on the pair.
    pub(crate) async fn open(url: &str) -> Result<Self, sqlx::Error> {
        // The pool retries a refused connection for its whole acquire
        // timeout, then says only that it timed out: one connection made
        // alone first fails the job at once, with its cause.
        use sqlx::Connection as _;
        sqlx::PgConnection::connect(url).await?.close().await?;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(8)
            .connect(url)
            .await?;
        sqlx::query(&format!("DROP TABLE IF EXISTS {TABLE}"))
            .execute(&pool)
            .await?;
        sqlx::query(&format!("CREATE TABLE {TABLE} (pair text PRIMARY KEY)"))
            .execute(&pool)
            .await?;
        // The pair is the value too: only whether a row exists matters.
        let loader = bloomguard::postgres::PgLoader::new(pool.clone(), TABLE, "pair", "pair")
            .timeout(Duration::from_secs(5));
        // Lazy, so that each connection is opened by the runtime that uses it;
        // without idle reaping, which would run on this one.
        let rebuilds_pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_lazy_with((*pool.connect_options()).clone());
        Ok(Self {
            pool,
            rebuilds_pool,
            loader,
        })
    }

    /// One `INSERT … SELECT unnest($1)` for the batch.
    pub(crate) async fn write(&self, keys: &[String]) -> Result<(), String> {
        let insert =
            format!("INSERT INTO {TABLE} SELECT unnest($1::text[]) ON CONFLICT DO NOTHING");
        sqlx::query(&insert)
            .bind(keys)
            .execute(&self.pool)
            .await
            .map(|_| ())
            .map_err(|error| error.to_string())
    }

    async fn contains_many(&self, keys: &[String]) -> Result<Vec<Option<Seen>>, String> {
        seen_in(self.loader.get_many(keys).await)
    }

    pub(crate) fn source(&self) -> bloomguard::postgres::PgSource {
        bloomguard::postgres::PgSource::new(self.rebuilds_pool().clone(), TABLE, "pair")
    }

    /// The pool the requests use.
    #[allow(dead_code, reason = "tests/seen_items.rs holds its connections")]
    pub(crate) fn requests_pool(&self) -> &sqlx::PgPool {
        &self.pool
    }

    /// The pool the guard's rebuilds read from.
    pub(crate) fn rebuilds_pool(&self) -> &sqlx::PgPool {
        &self.rebuilds_pool
    }
}
