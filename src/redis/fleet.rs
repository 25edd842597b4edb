//! A fleet of service instances answering from one set, through Redis.
//!
//! Each instance's [`FleetSync`] does two things:
//! - **Insert propagation.** [`FleetSync::insert`] inserts into the local
//!   guard, then appends the key to the stream `{name}:inserts` (capped with
//!   `MAXLEN ~`). Every instance's consumer task reads the stream and inserts
//!   what it finds into its own guard.
//! - **Snapshots.** [`FleetSync::publish_snapshot`] writes the encoded filter
//!   in chunks, then points the manifest `{name}:snapshot` at them together
//!   with the id of the last stream entry it covers, and publishes a notice
//!   on `{name}:snapshots`. An instance that
//!   starts, receives a notice, or finds that the stream was trimmed past its
//!   position loads the snapshot (decoded, checked, merged with
//!   [`Guard::merge_filter`]) and replays the stream from the snapshot's id.
//!
//! All instances of a fleet must build their guards with the same size,
//! rate and [`seed`](crate::GuardBuilder::seed), so that their filters can be
//! merged.
//!
//! **The seed travels in the clear.** Snapshots in Redis carry the fleet's
//! seed in their header, and whoever knows the seed can craft keys that
//! defeat the guard (see SECURITY.md in the repository): read access to these
//! Redis keys is part of the secret, and write access lets a writer replace
//! the fleet's filter. Keep them behind Redis ACLs.

pub use crate::error::FleetError;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use redis::{Client, RedisError, Value};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument;

use super::Connection;
use crate::filter::AtomicBloom;
use crate::guard::Guard;
use crate::task::StoppableTask;

/// How long one blocking read of the stream waits for new entries.
const READ_BLOCK: Duration = Duration::from_millis(200);
/// Entries read per call.
const READ_COUNT: usize = 1_000;
/// Reads of a snapshot that publishers keep replacing, before giving up.
const SNAPSHOT_READ_ATTEMPTS: u32 = 3;
/// Wait before reconnecting after a failed read.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(200);

/// One instance's link to its fleet. Cheap to clone. See the [module docs](crate::redis::fleet).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use bloomguard::Guard;
/// use bloomguard::redis::fleet::FleetSync;
///
/// // Every instance: the same size, rate and seed.
/// let guard = Guard::builder().name("items").expected_items(1_000_000).seed(0x5eed).build()?;
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let fleet = FleetSync::new(guard.clone(), client, "items");
/// fleet.load_snapshot().await?; // what the fleet knows so far, if published
/// let consumer = fleet.spawn(); // applies the other instances' inserts
/// fleet.insert("item:42").await?; // here and, through Redis, everywhere
/// fleet.publish_snapshot().await?; // now and then, from one instance
/// consumer.shutdown().await;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct FleetSync {
    inner: Arc<Inner>,
}

struct Inner {
    guard: Guard,
    client: Client,
    writer: Connection,
    snapshot_key: String,
    channel: String,
    stream: String,
    max_len: usize,
    chunk_bytes: usize,
    /// The id of the last stream entry this instance has applied.
    position: Mutex<StreamId>,
    /// Set by a snapshot notice: load the snapshot at the next step.
    snapshot_due: Notify,
}

/// What `{name}:snapshot` holds: where the snapshot's chunks are, and the
/// stream position it covers.
struct Manifest {
    position: StreamId,
    version: u64,
    chunks: usize,
}

impl Manifest {
    fn parse(text: &str) -> Option<Self> {
        let mut fields = text.split(' ');
        let manifest = Self {
            position: StreamId::parse(fields.next()?)?,
            version: fields.next()?.parse().ok()?,
            chunks: fields.next()?.parse().ok()?,
        };
        fields.next().is_none().then_some(manifest)
    }
}

/// One attempt at reading the snapshot.
enum Read {
    None,
    /// Its chunks were deleted while we read them.
    Replaced,
    Snapshot(StreamId, AtomicBloom),
}

/// A stream entry as the reply shapes it: id, then field-value pairs.
type Entry = (String, Vec<(String, Vec<u8>)>);

/// A stream entry id, `milliseconds-sequence`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default)]
struct StreamId(u64, u64);

impl StreamId {
    fn parse(id: &str) -> Option<Self> {
        let (ms, seq) = id.split_once('-')?;
        Some(Self(ms.parse().ok()?, seq.parse().ok()?))
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.0, self.1)
    }
}

impl FleetSync {
    /// Entries the insert stream keeps, about, unless told.
    pub const DEFAULT_STREAM_MAX_LEN: usize = 1_000_000;
    /// Bytes per snapshot chunk unless told: 32 MiB, well under Redis's
    /// 512 MB string limit and its default client query buffer.
    pub const DEFAULT_SNAPSHOT_CHUNK_BYTES: usize = 32 << 20;

    /// Splits snapshots into Redis strings of at most `bytes` each.
    ///
    /// # Panics
    /// If the sync was cloned or spawned already.
    #[must_use]
    pub fn snapshot_chunk_bytes(mut self, bytes: usize) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("configure a FleetSync before cloning or spawning it")
            .chunk_bytes = bytes.max(1);
        self
    }

    /// Links `guard` to the fleet `name` on the Redis behind `client`.
    pub fn new(guard: Guard, client: Client, name: &str) -> Self {
        Self {
            inner: Arc::new(Inner {
                guard,
                writer: Connection::new(client.clone(), Duration::from_secs(5)),
                client,
                snapshot_key: format!("{name}:snapshot"),
                channel: format!("{name}:snapshots"),
                stream: format!("{name}:inserts"),
                max_len: Self::DEFAULT_STREAM_MAX_LEN,
                chunk_bytes: Self::DEFAULT_SNAPSHOT_CHUNK_BYTES,
                position: Mutex::new(StreamId::default()),
                snapshot_due: Notify::new(),
            }),
        }
    }

    /// Caps the insert stream at about `max_len` entries (`XADD … MAXLEN ~`).
    /// An instance that falls further behind reloads the snapshot.
    ///
    /// # Panics
    /// If the sync was cloned or spawned already.
    #[must_use]
    pub fn stream_max_len(mut self, max_len: usize) -> Self {
        Arc::get_mut(&mut self.inner)
            .expect("configure a FleetSync before cloning or spawning it")
            .max_len = max_len.max(1);
        self
    }

    /// The guard this instance answers from.
    pub fn guard(&self) -> &Guard {
        &self.inner.guard
    }

    /// Inserts `key` into the local guard, then appends it to the fleet's
    /// stream. As with [`Guard::insert`], call it before the store write.
    ///
    /// # Errors
    /// Redis failed: the key is in this instance's guard, not yet in the others'.
    pub async fn insert(&self, key: impl AsRef<[u8]>) -> Result<(), RedisError> {
        let key = key.as_ref();
        self.inner.guard.insert(key);
        let mut connection = self.inner.writer.get().await?;
        let _: Value = redis::cmd("XADD")
            .arg(&self.inner.stream)
            .arg("MAXLEN")
            .arg("~")
            .arg(self.inner.max_len)
            .arg("*")
            .arg("k")
            .arg(key)
            .query_async(&mut connection)
            .await?;
        Ok(())
    }

    /// Writes this instance's filter and the stream position it covers as
    /// the fleet's snapshot, and notifies the fleet. Returns the position.
    ///
    /// The encoded filter goes into chunks of at most
    /// [`snapshot_chunk_bytes`](Self::snapshot_chunk_bytes) under a new
    /// version number (`{name}:snapshot:{version}:{i}`); then the manifest
    /// `{name}:snapshot` ("position version chunks") is switched to it in one
    /// `SET`, so a reader sees the old snapshot or the new one, never a mix;
    /// then the old version's chunks are deleted.
    ///
    /// # Errors
    /// [`FleetError::Warming`] before the guard has a filter; Redis errors.
    pub async fn publish_snapshot(&self) -> Result<String, FleetError> {
        self.publish_newest()
            .instrument(self.span("publish_snapshot"))
            .await
    }

    async fn publish_newest(&self) -> Result<String, FleetError> {
        let position = *self.lock_position();
        let encoded = {
            let live = self.inner.guard.live_filters();
            live.newest().ok_or(FleetError::Warming)?.to_bytes()
        };
        let mut connection = self.inner.writer.get().await?;
        let version: u64 = redis::cmd("INCR")
            .arg(format!("{}:version", self.inner.snapshot_key))
            .query_async(&mut connection)
            .await?;
        let chunks = encoded.chunks(self.inner.chunk_bytes);
        let count = chunks.len();
        for (i, chunk) in chunks.enumerate() {
            let () = redis::cmd("SET")
                .arg(self.chunk_key(version, i))
                .arg(chunk)
                .query_async(&mut connection)
                .await?;
        }
        let previous: Option<String> = redis::cmd("SET")
            .arg(&self.inner.snapshot_key)
            .arg(format!("{position} {version} {count}"))
            .arg("GET")
            .query_async(&mut connection)
            .await?;
        let _: i64 = redis::cmd("PUBLISH")
            .arg(&self.inner.channel)
            .arg(position.to_string())
            .query_async(&mut connection)
            .await?;
        if let Some(Manifest {
            version: old,
            chunks,
            ..
        }) = previous.as_deref().and_then(Manifest::parse)
            && old != version
        {
            let mut delete = redis::cmd("DEL");
            for i in 0..chunks {
                delete.arg(self.chunk_key(old, i));
            }
            let _: i64 = delete.query_async(&mut connection).await?;
        }
        Ok(position.to_string())
    }

    /// Loads the fleet's snapshot into the guard and moves this instance's
    /// stream position to the one the snapshot covers. `Ok(false)` when
    /// there is no snapshot yet.
    ///
    /// # Errors
    /// A snapshot that does not decode, or whose filter has other
    /// parameters, is refused ([`FleetError::Decode`],
    /// [`FleetError::Incompatible`]) and the guard keeps what it has.
    pub async fn load_snapshot(&self) -> Result<bool, FleetError> {
        self.load_latest()
            .instrument(self.span("load_snapshot"))
            .await
    }

    async fn load_latest(&self) -> Result<bool, FleetError> {
        // A publish that replaces the snapshot while we read it deletes the
        // chunks we are reading: read the new one then.
        for _ in 0..SNAPSHOT_READ_ATTEMPTS {
            match self.read_snapshot().await? {
                Read::None => return Ok(false),
                Read::Replaced => continue,
                Read::Snapshot(position, filter) => {
                    self.inner
                        .guard
                        .merge_filter(filter)
                        .map_err(FleetError::Incompatible)?;
                    let mut current = self.lock_position();
                    *current = (*current).max(position);
                    return Ok(true);
                }
            }
        }
        Err(FleetError::KeptChanging {
            attempts: SNAPSHOT_READ_ATTEMPTS,
        })
    }

    async fn read_snapshot(&self) -> Result<Read, FleetError> {
        let mut connection = self.inner.writer.get().await?;
        let manifest: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&self.inner.snapshot_key)
            .query_async(&mut connection)
            .await?;
        let Some(manifest) = manifest else {
            return Ok(Read::None);
        };
        let manifest = std::str::from_utf8(&manifest)
            .ok()
            .and_then(Manifest::parse)
            .ok_or(FleetError::BadManifest)?;
        let mut encoded = Vec::new();
        for i in 0..manifest.chunks {
            let chunk: Option<Vec<u8>> = redis::cmd("GET")
                .arg(self.chunk_key(manifest.version, i))
                .query_async(&mut connection)
                .await?;
            match chunk {
                Some(chunk) => encoded.extend_from_slice(&chunk),
                None => return Ok(Read::Replaced),
            }
        }
        let filter = AtomicBloom::from_bytes(&encoded).map_err(FleetError::Decode)?;
        Ok(Read::Snapshot(manifest.position, filter))
    }

    fn chunk_key(&self, version: u64, index: usize) -> String {
        format!("{}:{version}:{index}", self.inner.snapshot_key)
    }

    /// Starts the consumer: loads the snapshot, then applies the stream's
    /// entries as they come, reloading the snapshot on a notice or when the
    /// stream was trimmed past this instance. Reconnects after failures.
    /// Stops when the handle is dropped or shut down.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn spawn(&self) -> FleetHandle {
        self.spawn_with(None)
    }

    /// [`spawn`](Self::spawn), stopping also when the application's
    /// `shutdown` token is cancelled.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub fn spawn_until(&self, shutdown: &CancellationToken) -> FleetHandle {
        self.spawn_with(Some(shutdown))
    }

    fn spawn_with(&self, shutdown: Option<&CancellationToken>) -> FleetHandle {
        let sync = self.clone();
        FleetHandle {
            task: StoppableTask::spawn("fleet consumer", shutdown, |stop| async move {
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = sync.clone().consume().instrument(sync.span("consume")) => {}
                }
            }),
        }
    }

    /// A span carrying the guard's name and the fleet's stream.
    fn span(&self, operation: &'static str) -> tracing::Span {
        tracing::info_span!(
            "bloomguard.fleet",
            operation,
            guard = %self.inner.guard.name(),
            stream = %self.inner.stream
        )
    }

    fn lock_position(&self) -> std::sync::MutexGuard<'_, StreamId> {
        self.inner
            .position
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    async fn consume(self) {
        let listener = tokio::spawn(self.clone().listen_for_snapshots());
        let _stop_listener = AbortOnDropHandle::new(listener);
        let mut reload = true;
        let mut just_reloaded = false;
        let mut connection: Option<MultiplexedConnection> = None;
        loop {
            if reload {
                just_reloaded = true;
                match self.load_snapshot().await {
                    Ok(_) => {}
                    Err(error) => {
                        tracing::warn!(%error, "fleet snapshot not loaded; replaying the stream");
                    }
                }
                reload = false;
            }
            let Some(reader) = connection.as_mut() else {
                match self.inner.client.get_multiplexed_async_connection().await {
                    Ok(fresh) => connection = Some(fresh),
                    Err(_) => tokio::time::sleep(RECONNECT_BACKOFF).await,
                }
                continue;
            };
            // A consumer that fell behind the stream's trimmed end would
            // silently skip what was trimmed: look before every read.
            if self.trimmed_past_us(reader).await {
                if !just_reloaded {
                    reload = true;
                    continue;
                }
                // Even the snapshot is older than what the stream kept.
                tracing::warn!(
                    stream = %self.inner.stream,
                    "the insert stream was trimmed past the latest snapshot: publish snapshots \
                     more often than the stream's length lasts; replaying what it kept"
                );
                *self.lock_position() = StreamId::default();
            }
            let due = self.inner.snapshot_due.notified();
            tokio::select! {
                () = due => reload = true,
                read = self.read_entries(reader) => match read {
                    Ok(()) => just_reloaded = false,
                    Err(error) => {
                        tracing::debug!(%error, "fleet stream read failed; reconnecting");
                        connection = None;
                        tokio::time::sleep(RECONNECT_BACKOFF).await;
                    }
                },
            }
        }
    }

    /// Whether the oldest entry left in the stream is newer than the next
    /// one this instance needs.
    async fn trimmed_past_us(&self, connection: &mut MultiplexedConnection) -> bool {
        let position = *self.lock_position();
        if position == StreamId::default() {
            return false;
        }
        let oldest: Result<Vec<Entry>, _> = redis::cmd("XRANGE")
            .arg(&self.inner.stream)
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .query_async(connection)
            .await;
        match oldest {
            Ok(entries) => entries
                .first()
                .and_then(|(id, _)| StreamId::parse(id))
                .is_some_and(|oldest| oldest > position),
            Err(_) => false,
        }
    }

    async fn read_entries(&self, connection: &mut MultiplexedConnection) -> Result<(), RedisError> {
        let position = *self.lock_position();
        let reply: Option<Vec<(String, Vec<Entry>)>> = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(READ_COUNT)
            .arg("BLOCK")
            .arg(READ_BLOCK.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.inner.stream)
            .arg(position.to_string())
            .query_async(connection)
            .await?;
        let Some(streams) = reply else { return Ok(()) };
        let mut last = position;
        for (_, entries) in streams {
            for (id, fields) in entries {
                for (field, value) in fields {
                    if field == "k" {
                        self.inner.guard.insert(&value);
                    }
                }
                if let Some(id) = StreamId::parse(&id) {
                    last = last.max(id);
                }
            }
        }
        let mut current = self.lock_position();
        *current = (*current).max(last);
        Ok(())
    }

    /// Wakes the consumer whenever a snapshot is published.
    async fn listen_for_snapshots(self) {
        loop {
            if let Ok(mut pubsub) = self.inner.client.get_async_pubsub().await
                && pubsub.subscribe(&self.inner.channel).await.is_ok()
            {
                let mut messages = pubsub.on_message();
                while messages.next().await.is_some() {
                    self.inner.snapshot_due.notify_one();
                }
            }
            tokio::time::sleep(RECONNECT_BACKOFF).await;
        }
    }

    /// The stream position this instance has applied up to.
    pub fn position(&self) -> String {
        self.lock_position().to_string()
    }
}

impl fmt::Debug for FleetSync {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetSync")
            .field("stream", &self.inner.stream)
            .field("position", &self.position())
            .finish_non_exhaustive()
    }
}

/// The running consumer of a [`FleetSync`]; dropping it stops the consumer.
#[derive(Debug)]
#[must_use = "dropping the handle stops the fleet consumer at once: keep it for as long as the instance serves"]
pub struct FleetHandle {
    task: StoppableTask,
}

impl FleetHandle {
    /// Stops the consumer and waits for it to end.
    pub async fn shutdown(self) {
        self.task.shutdown().await;
    }

    /// Whether the consumer has ended (stopped, or died: see [`panicked`](Self::panicked)).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Whether the consumer ended by panicking (logged at ERROR when it did).
    pub fn panicked(&self) -> bool {
        self.task.panicked()
    }
}
