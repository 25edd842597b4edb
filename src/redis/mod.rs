//! Redis as the store behind a guard (the `redis` feature): [`RedisSource`]
//! streams every key for rebuilds with `SCAN`, [`RedisLoader`] reads values
//! with `GET`/`MGET`.
//!
//! Both connect lazily: a guard built while Redis is down stays warming
//! (its rebuilds fail and are retried), and starts serving once Redis is
//! up. The loader reads through a [`ConnectionManager`] (a cluster
//! connection on a cluster), which reconnects on its own: one whose Redis
//! restarted fails the calls made while it was gone and recovers without
//! being rebuilt. A source's pass on a plain Redis runs on a connection of
//! its own that does not reconnect: a pass a restart cut short fails, and
//! is retried. Both kinds of connection run a task on the runtime that made
//! them (a manager: that last remade it). A cluster connection whose
//! runtime stopped (a warm-up runtime, a test of its own) is made again on
//! the runtime of the next call; a manager's next call fails, and the one
//! after it reconnects on its own runtime.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::{TryStreamExt, stream};
use std::sync::Arc;

use arc_swap::ArcSwapOption;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Client, RedisError, Value};
use tokio::sync::OnceCell;

pub mod fleet;

pub use fleet::{FleetError, FleetHandle, FleetSync, FleetWrite, FleetWriteError, StreamPosition};

use crate::guard::source::{KeyBatch, KeySource, KeyStream, SourceError};
use crate::loader::Loader;

/// A lazily made connection to one Redis node (a connection manager) or to
/// a Redis Cluster, shared by the clones of a source or loader.
#[derive(Clone)]
struct Connection {
    target: Target,
    response_timeout: Duration,
}

#[derive(Clone)]
enum Target {
    Node {
        client: Client,
        manager: Arc<OnceCell<ConnectionManager>>,
    },
    Cluster {
        client: Box<ClusterClient>,
        connection: Arc<ClusterSlot>,
    },
}

/// The cluster connection a source's or loader's clones share. The redis
/// crate runs its driver as a task on the runtime that made it, and the
/// connection fails every call for good once that runtime stops, so a
/// witness task on the same runtime tells when to make another.
#[derive(Default)]
struct ClusterSlot {
    made: ArcSwapOption<MadeCluster>,
    /// Held while one is made, so that callers queue for one attempt at a
    /// time (each within its own timeout, the wait included).
    making: tokio::sync::Mutex<()>,
}

struct MadeCluster {
    connection: ClusterConnection,
    /// Held by a task on the runtime that made the connection, which drops
    /// it when it stops.
    runtime_alive: std::sync::Weak<()>,
    /// Ends that task when this is dropped (its slot dropped or remade).
    _ends_witness: tokio::sync::oneshot::Sender<()>,
}

impl ClusterSlot {
    fn usable(&self) -> Option<ClusterConnection> {
        let made = self.made.load();
        let made = made.as_ref()?;
        (made.runtime_alive.strong_count() > 0).then(|| made.connection.clone())
    }

    async fn get(
        &self,
        client: &ClusterClient,
        timeout: Duration,
    ) -> Result<ClusterConnection, RedisError> {
        if let Some(connection) = self.usable() {
            return Ok(connection);
        }
        // The wait for the lock counts too: callers queued behind attempts
        // that each time out (a cluster that does not answer) would
        // otherwise return one timeout apart, the last after all of them.
        within(timeout, self.make(client)).await
    }

    async fn make(&self, client: &ClusterClient) -> Result<ClusterConnection, RedisError> {
        let _making = self.making.lock().await;
        if let Some(connection) = self.usable() {
            return Ok(connection);
        }
        let connection = client.get_async_connection().await?;
        let alive = Arc::new(());
        let runtime_alive = Arc::downgrade(&alive);
        let (ends_witness, ended) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let _alive = alive;
            let _ = ended.await;
        });
        self.made.store(Some(Arc::new(MadeCluster {
            connection: connection.clone(),
            runtime_alive,
            _ends_witness: ends_witness,
        })));
        Ok(connection)
    }
}

/// A connection made: to a node, or to the cluster (which routes each
/// command to the node serving its keys, and splits multi-slot `MGET`s).
#[derive(Clone)]
enum Live {
    Node(ConnectionManager),
    /// One `SCAN` pass's own connection to a node, which does not reconnect
    /// (see [`Connection::for_pass`]).
    Pass(MultiplexedConnection),
    Cluster(ClusterConnection, Duration),
}

impl redis::aio::ConnectionLike for Live {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        match self {
            Self::Node(manager) => manager.req_packed_command(cmd),
            Self::Pass(connection) => connection.req_packed_command(cmd),
            Self::Cluster(cluster, timeout) => {
                let timeout = *timeout;
                Box::pin(within(timeout, cluster.req_packed_command(cmd)))
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Node(manager) => manager.req_packed_commands(pipeline, offset, count),
            Self::Pass(connection) => connection.req_packed_commands(pipeline, offset, count),
            Self::Cluster(cluster, timeout) => {
                let timeout = *timeout;
                Box::pin(within(
                    timeout,
                    cluster.req_packed_commands(pipeline, offset, count),
                ))
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Node(manager) => manager.get_db(),
            Self::Pass(connection) => connection.get_db(),
            Self::Cluster(cluster, _) => cluster.get_db(),
        }
    }
}

/// Whether the server refused to run a command at all (an ACL denying it,
/// a proxy without it), rather than failed to run it.
pub(crate) fn refused(error: &RedisError) -> bool {
    error.code() == Some("NOPERM")
        || error
            .detail()
            .is_some_and(|detail| detail.to_ascii_lowercase().starts_with("unknown command"))
}

/// Whether a failed command may answer otherwise when asked again (the
/// connection, a timeout, a node loading or busy): what it would have told
/// is unknown. Any other error is the server's word that it does not run
/// the command (refused, unknown, "cluster support disabled").
fn may_answer_later(error: &RedisError) -> bool {
    error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || matches!(
            error.code(),
            Some("LOADING" | "BUSY" | "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN")
        )
}

/// `call`, failed with a timeout error after `timeout` (the connection
/// manager has its own; a cluster connection is given one here).
async fn within<T>(
    timeout: Duration,
    call: impl Future<Output = redis::RedisResult<T>>,
) -> redis::RedisResult<T> {
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or_else(|_| {
            Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no answer from the cluster in time",
            )))
        })
}

/// The longest a connection waits between attempts to reach Redis again.
pub(crate) const RECONNECT_MAX_DELAY: Duration = Duration::from_millis(500);

impl Connection {
    fn new(client: Client, response_timeout: Duration) -> Self {
        Self {
            target: Target::Node {
                client,
                manager: Arc::new(OnceCell::new()),
            },
            response_timeout,
        }
    }

    fn cluster(client: ClusterClient, response_timeout: Duration) -> Self {
        Self {
            target: Target::Cluster {
                client: Box::new(client),
                connection: Arc::default(),
            },
            response_timeout,
        }
    }

    /// The connection, made on first use (and tried again on the next use
    /// if Redis could not be reached). Both kinds reconnect on their own.
    async fn get(&self) -> Result<Live, RedisError> {
        match &self.target {
            Target::Node { client, manager } => {
                let config = ConnectionManagerConfig::new()
                    .set_response_timeout(Some(self.response_timeout))
                    .set_connection_timeout(Some(self.response_timeout))
                    .set_number_of_retries(2)
                    .set_max_delay(RECONNECT_MAX_DELAY);
                let manager = manager
                    .get_or_try_init(|| client.get_connection_manager_with_config(config))
                    .await?;
                Ok(Live::Node(manager.clone()))
            }
            Target::Cluster { client, connection } => {
                let connection = connection.get(client, self.response_timeout).await?;
                Ok(Live::Cluster(connection, self.response_timeout))
            }
        }
    }

    /// The connection one `SCAN` pass runs on. On a node, one of the
    /// pass's own that does not reconnect: a cursor means nothing to a
    /// restarted Redis, and a manager reconnects unseen where RESP3 tells
    /// it of the drop, so where `INFO` (and its run id) is denied only a
    /// request failing on the dropped connection shows the restart. On a
    /// cluster, the shared connection.
    async fn for_pass(&self) -> Result<Live, RedisError> {
        match &self.target {
            Target::Node { client, .. } => {
                let config = redis::AsyncConnectionConfig::new()
                    .set_response_timeout(Some(self.response_timeout))
                    .set_connection_timeout(Some(self.response_timeout));
                let connection = client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await?;
                Ok(Live::Pass(connection))
            }
            Target::Cluster { .. } => self.get().await,
        }
    }
}

/// Every key matching a pattern, streamed with `SCAN … MATCH … COUNT`: a
/// rebuild over ten million keys holds one page of keys at a time. A pass
/// across a restart of Redis fails (its `INFO` run id changed: the cursor
/// meant nothing to the new process), and so does one across a failover
/// behind an address that moves the connection, and back (its replication
/// id changed). So does a pass on a replica, which
/// may lack writes its master took for longer than any write settle, and
/// one on a single node of a Redis Cluster reached as a plain Redis (its
/// `SCAN` lists that node's slots only: use [`RedisSource::cluster`]; a
/// cluster of one master serving every slot is read whole).
/// `CLUSTER NODES` is asked of every plain node, whatever its `INFO` says
/// of its mode (Valkey names it `server_mode`). Where `INFO` is denied (or
/// answers without a run id, as some proxies do: read "denied" below for
/// that too), `ROLE` is asked instead; where `ROLE` and `CLUSTER NODES`
/// are denied too, a replica or a cluster node is not noticed.
/// On a plain Redis each pass runs on a connection of its own that does not
/// reconnect, so a restart that drops it fails the pass without `INFO` too
/// (one behind a TCP proxy or a virtual address, which keeps the client's
/// connection open, goes unnoticed without `INFO`). A cluster's connection
/// reconnects on its own, so nothing but `INFO` shows a master restarted
/// during a pass: [`RedisSource::cluster`] fails every pass where a master
/// refuses `INFO` or its `commandstats` section, or answers it without a
/// run id or with that section filtered (the guard stays warming, every key
/// "maybe"). The user needs `SCAN` and `INFO` (and
/// `CLUSTER NODES` and `CLUSTER SLOTS` on a cluster).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use bloomguard::{Guard, redis::RedisSource};
///
/// let client = redis::Client::open("redis://127.0.0.1/")?;
/// let guard = Guard::builder()
///     .expected_items(10_000_000)
///     .source(RedisSource::new(client, "item:*").strip_prefix("item:"))
///     .build()?;
/// let maintenance = guard.spawn_maintenance(); // builds, then rebuilds
/// guard.ready().await; // warming (every key "maybe") until the first build
/// # let _ = maintenance;
/// # Ok(())
/// # }
/// ```
///
/// With a [`RedisLoader`] reading the same keys, take the source from it
/// ([`RedisLoader::source`]): one prefix, written once.
#[derive(Clone)]
pub struct RedisSource {
    connection: Connection,
    pattern: Vec<u8>,
    count: usize,
    key_type: Option<KeyType>,
    strip_prefix: Option<Vec<u8>>,
}

/// The type a pass lists (`SCAN … TYPE`).
#[derive(Clone, Debug)]
struct KeyType {
    name: String,
    /// A module's type, which the pass cannot check: Redis lists no key,
    /// and says nothing, for a name it does not know.
    of_a_module: bool,
}

/// The types `SCAN … TYPE` knows without a module.
const REDIS_TYPES: [&str; 6] = ["string", "list", "set", "zset", "hash", "stream"];

impl RedisSource {
    /// Keys asked for per `SCAN` call unless told: Redis's default is 10,
    /// far too few for a rebuild.
    pub const DEFAULT_COUNT: usize = 1_000;
    /// How long one `SCAN` call may take.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

    /// Keys matching `pattern` (`SCAN`'s `MATCH` glob, `*` for all). An
    /// empty pattern, which matches the empty key alone, fails every pass.
    pub fn new(client: Client, pattern: impl Into<String>) -> Self {
        Self::over(
            Connection::new(client, Self::DEFAULT_TIMEOUT),
            pattern.into().into_bytes(),
        )
    }

    fn over(connection: Connection, pattern: Vec<u8>) -> Self {
        Self {
            connection,
            pattern,
            count: Self::DEFAULT_COUNT,
            key_type: None,
            strip_prefix: None,
        }
    }

    /// The `COUNT` hint of each `SCAN` call (default [`DEFAULT_COUNT`](Self::DEFAULT_COUNT);
    /// at least 1).
    #[must_use]
    pub fn count(mut self, count: usize) -> Self {
        self.count = count.max(1);
        self
    }

    /// Only keys of this Redis type (`SCAN … TYPE`): `string`, `list`,
    /// `set`, `zset`, `hash` or `stream`, in any case. Any other name fails
    /// every pass, saying so: Redis answers a type it does not know with no
    /// keys, and the guard would answer `Absent` for every one. A module's
    /// type goes through [`module_key_type`](Self::module_key_type).
    /// [`RedisLoader`] reads strings only: load keys of another type with a
    /// [`Loader`] of your own.
    #[must_use]
    pub fn key_type(mut self, key_type: impl Into<String>) -> Self {
        self.key_type = Some(KeyType {
            name: key_type.into(),
            of_a_module: false,
        });
        self
    }

    /// Only keys of a module's type (`ReJSON-RL`, …), as Redis names it in
    /// `TYPE`'s reply. Not checked: a name Redis does not know lists no
    /// key, and the guard answers `Absent` for every one.
    #[must_use]
    pub fn module_key_type(mut self, key_type: impl Into<String>) -> Self {
        self.key_type = Some(KeyType {
            name: key_type.into(),
            of_a_module: true,
        });
        self
    }

    /// Removes `prefix` from each key before it reaches the filter, so the
    /// guard holds the ids the application checks (`item:42` → `42`).
    ///
    /// The pattern is a glob: written by hand, it needs a `\` before each
    /// `[`, `*`, `?` or `\` of the prefix (`shop\[eu]:*` for the prefix
    /// `shop[eu]:`). A pattern that no key starting with the prefix can
    /// match (`shop[eu]:*` matches `shope:1`, never `shop[eu]:1`) fails
    /// every pass, saying so, rather than list nothing. A listed key that
    /// does not start with the prefix goes into the filter whole.
    /// [`RedisLoader::source`] writes both from the loader's prefix.
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

    /// Keys matching `pattern` in every master of a Redis Cluster: one
    /// `SCAN` cursor per master, routed to it by address (a cluster
    /// connection does not fan `SCAN` out by itself). A master that fails,
    /// restarts, migrates a slot or takes keys in by `MIGRATE` (keys moved
    /// out and back by a resharding put right count too), or a topology
    /// that changes, during the pass fails the pass (the rebuild is retried,
    /// the old filter serving), never a silent partial rebuild. A restart
    /// shows only in `INFO`: where a master refuses it (an ACL without
    /// `+info`) or its `commandstats` section, or answers it without a run
    /// id or with that section filtered, every pass fails, saying so.
    pub fn cluster(client: ClusterClient, pattern: impl Into<String>) -> Self {
        Self::over(
            Connection::cluster(client, Self::DEFAULT_TIMEOUT),
            pattern.into().into_bytes(),
        )
    }

    async fn scan_page(
        &self,
        live: &Live,
        node: Option<&MasterNode>,
        cursor: u64,
    ) -> Result<(u64, KeyBatch), RedisError> {
        let mut command = redis::cmd("SCAN");
        command
            .arg(cursor)
            .arg("MATCH")
            .arg(&self.pattern)
            .arg("COUNT")
            .arg(self.count);
        if let Some(key_type) = &self.key_type {
            command.arg("TYPE").arg(&key_type.name);
        }
        self.query_on(live, node, &command).await
    }

    /// Runs `command` on `node` (a cluster's master, routed by address), or
    /// on the one node of a plain Redis.
    async fn query_on<T: redis::FromRedisValue>(
        &self,
        live: &Live,
        node: Option<&MasterNode>,
        command: &redis::Cmd,
    ) -> Result<T, RedisError> {
        match (live.clone(), node) {
            (Live::Cluster(mut cluster, timeout), Some(node)) => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: node.host.clone(),
                    port: node.port,
                });
                let reply =
                    within(timeout, cluster.route_command(command.clone(), routing)).await?;
                // A routed command's error comes back as a value; as an
                // error, as on a node, `refused` can read it.
                Ok(redis::from_redis_value(reply.extract_error()?)?)
            }
            (mut live, _) => command.query_async(&mut live).await,
        }
    }

    /// The process serving `node` now, by its run id and replication id
    /// (and on a cluster its own config epoch and slots, and how many keys
    /// it has taken in by `MIGRATE`): a restart, or a failover to a replica
    /// (and back, behind an address that moves a connection), gives
    /// another, under which a `SCAN` cursor of the old process means
    /// nothing, and the keys after it may be skipped.
    /// A replica fails the pass: it may not hold a write its master took,
    /// for longer than any write settle. So does one node of a cluster
    /// reached as a plain Redis (its `SCAN` ends after its own slots),
    /// unless it serves every slot.
    /// On a cluster, a master migrating or importing a slot fails the pass:
    /// keys `MIGRATE` moves leave the topology unchanged until the slot
    /// changes owner, and could move from a master not yet scanned to one
    /// already scanned.
    async fn serving_process(
        &self,
        live: &Live,
        node: Option<&MasterNode>,
    ) -> Result<(String, Option<String>), RedisError> {
        // The default sections: `server` and `replication` among them (one
        // `INFO` may name only one section before Redis 7).
        let info = redis::cmd("INFO");
        // Where INFO is denied (an ACL) or has no run id (a proxy) on a
        // plain node, a restart goes unnoticed here (the pass's own
        // connection fails instead); `ROLE` is asked instead whether the
        // node is a replica (`CLUSTER NODES`, whether it is one of a
        // cluster, always is). On a cluster the pass fails.
        // Read as a plain value: `INFO` can hold text that is not UTF-8 (an
        // error code a script made up, in its error stats), which must not
        // read as a refusal, and over RESP3 it is a verbatim string. Only a
        // refusal (`NOPERM`, a command the server lacks) goes without; any
        // other error fails the pass.
        let info = match self.query_on::<Value>(live, node, &info).await {
            Ok(reply) => Some(info_text(reply)?),
            // A cluster's connection reconnects on its own: without `INFO`
            // nothing shows a master restarted during the pass (its id,
            // epoch and slots stay), nor keys `MIGRATE` moved and back.
            Err(error) if refused(&error) && node.is_some() => {
                return Err(not_trusted(format!(
                    "INFO was refused ({error}) on a master of the cluster: the pass cannot \
                     tell a master restarted during it; allow INFO"
                )));
            }
            Err(error) if refused(&error) => {
                tracing::debug!(%error, "INFO refused: a restart behind a proxy that keeps the connection goes unnoticed");
                None
            }
            Err(error) => return Err(error),
        };
        let field = |name: &str| {
            info.as_deref()?
                .lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        // An `INFO` without a run id (a proxy's, a compatible server's)
        // reads as denied: what it leaves out is asked for instead.
        let denied = field("run_id").is_none();
        let role = match field("role") {
            Some(role) => Some(role.to_owned()),
            None => self.role(live, node).await?,
        };
        if matches!(role.as_deref(), Some("slave" | "replica")) {
            return Err(not_trusted(if node.is_some() {
                "a master listed for the pass is a replica now (a failover in progress?); \
                 the rebuild is retried"
            } else {
                "the source reads a replica, which may lack writes its master took: \
                 point the RedisSource at the master"
            }));
        }
        // Any other role but a master's (KeyDB's `active-replica`, which
        // takes writes and replicates its peer's) may lack writes too.
        if let Some(role) = role.as_deref().filter(|role| *role != "master") {
            return Err(not_trusted(format!(
                "the source reads a node whose role is {role:?}, not a master's: it may lack \
                 writes another node took; point the RedisSource at a master"
            )));
        }
        // Each promotion makes a new replication id: a failover and a
        // failback leave the run id as it was. It also changes, once, when
        // a master without replicas frees its backlog (`repl-backlog-ttl`)
        // or takes its first replica, as the `MIGRATE` count does at a
        // `CONFIG RESETSTAT`: one pass fails, and the retry reads whole.
        if node.is_some() && denied {
            return Err(not_trusted(
                "INFO on a master of the cluster has no run_id: the pass cannot tell a master \
                 restarted during it",
            ));
        }
        let mut process = format!(
            "{} {}",
            field("run_id").unwrap_or_default(),
            field("master_replid").unwrap_or_default()
        );
        let mut nodes = redis::cmd("CLUSTER");
        nodes.arg("NODES");
        // Valkey 8 names the mode `server_mode`; `cluster_enabled` is in
        // the default `INFO` of both.
        let says_clustered = ["redis_mode", "server_mode"]
            .into_iter()
            .any(|mode| field(mode) == Some("cluster"))
            || field("cluster_enabled") == Some("1");
        // Asked of every plain node too, whatever its `INFO` says (a
        // compatible server's may name no mode). Where it names none, a
        // refusal ("cluster support disabled" on a plain Redis, or denied)
        // leaves nothing to check; one that may answer when asked again (a
        // timeout, `LOADING`) fails the pass: the node may be one of a
        // cluster, whose `SCAN` lists its own slots only.
        let nodes: Option<String> = match self.query_on(live, node, &nodes).await {
            Ok(nodes) => Some(nodes),
            Err(error) if node.is_none() && says_clustered && refused(&error) => {
                return Err(not_trusted(format!(
                    "CLUSTER NODES was refused ({error}) on a node whose INFO says it runs \
                     in a cluster: the pass cannot tell whether its SCAN lists every key; \
                     allow CLUSTER NODES, or use RedisSource::cluster"
                )));
            }
            Err(error) if node.is_some() || says_clustered || may_answer_later(&error) => {
                return Err(error);
            }
            Err(error) => {
                tracing::debug!(%error, "CLUSTER NODES refused: read as not a cluster");
                None
            }
        };
        // A cluster of one master read as a plain Redis too: keys can move
        // to a node added meanwhile, and back.
        if info.is_some() && nodes.is_some() {
            process.push(' ');
            process.push_str(&self.keys_taken_in(live, node).await?);
        }
        if let Some(nodes) = nodes {
            let myself = nodes.lines().find(|line| {
                line.split(' ')
                    .nth(2)
                    .is_some_and(|flags| flags.contains("myself"))
            });
            // The address reached another node than the one planned (a
            // node moved to it since the pass read the topology): this one
            // may be scanned twice and the planned one never.
            if let Some(planned) = node
                && myself.and_then(|line| line.split(' ').next()) != Some(planned.id.as_str())
            {
                return Err(not_trusted(
                    "a master's address reached another node (the topology changed); \
                     the rebuild is retried",
                ));
            }
            // Only a node's own line shows its `[slot->-id]` / `[slot-<-id]`.
            if myself.is_some_and(|line| line.contains('[')) {
                return Err(not_trusted(
                    "a slot is migrating between masters: keys may move past the pass; \
                     the rebuild is retried",
                ));
            }
            // A cluster of one master (one shard) is read whole as a plain
            // Redis; any other node of a cluster lists its own slots only.
            if node.is_none() && myself.map_or(0, slots_served) != CLUSTER_SLOTS {
                return Err(not_trusted(
                    "the source reaches one node of a Redis Cluster, whose SCAN lists that \
                     node's slots only: use RedisSource::cluster",
                ));
            }
            // Its own config epoch and slots, which it knows first: a slot
            // moved whole to or from it during the pass shows here even when
            // the node asked for the topology has not heard of it yet.
            if let Some(myself) = myself {
                let fields: Vec<&str> = myself.split(' ').collect();
                process.push(' ');
                process.push_str(&epoch_and_slots(&fields));
                return Ok((process, Some(myself.to_owned())));
            }
        }
        Ok((process, None))
    }

    /// How many times the node took keys in from another by `MIGRATE`
    /// (`RESTORE-ASKING` calls): keys moved out of a master not scanned yet
    /// into one scanned already, and back once the first was scanned (an
    /// interrupted resharding put right), leave no slot moved and no
    /// migration open by the end of a pass, but count here on both.
    async fn keys_taken_in(
        &self,
        live: &Live,
        node: Option<&MasterNode>,
    ) -> Result<String, RedisError> {
        let mut stats = redis::cmd("INFO");
        stats.arg("commandstats");
        let stats = match self.query_on(live, node, &stats).await {
            Ok(reply) => info_text(reply)?,
            // Where `INFO` answers but this section is refused (a proxy's
            // rule), the pass cannot see keys moved in and out: it fails.
            Err(error) if refused(&error) => {
                return Err(not_trusted(format!(
                    "INFO commandstats was refused ({error}) where INFO was not: the pass \
                     cannot tell keys moved by MIGRATE during it; allow it"
                )));
            }
            Err(error) => return Err(error),
        };
        // `INFO` itself ran on this node just before: a section without
        // it was filtered (a proxy's), and could hide `RESTORE-ASKING` too.
        // Lower-cased: a compatible server may name its commands in capitals.
        let stats = stats.to_ascii_lowercase();
        if !stats.lines().any(|line| line.starts_with("cmdstat_info:")) {
            return Err(not_trusted(
                "INFO commandstats lists no INFO calls where INFO was just called: the \
                 section is filtered (or was reset), and the pass cannot tell keys moved by \
                 MIGRATE",
            ));
        }
        Ok(stats
            .lines()
            .find_map(|line| line.strip_prefix("cmdstat_restore-asking:calls="))
            .and_then(|rest| rest.split(',').next())
            .unwrap_or("0")
            .to_owned())
    }

    /// The node's role by `ROLE` (`master`, `slave`); `None` where the
    /// node refuses `ROLE`. An answer of another shape, or a failure that
    /// may answer when asked again, fails the pass.
    async fn role(
        &self,
        live: &Live,
        node: Option<&MasterNode>,
    ) -> Result<Option<String>, RedisError> {
        let reply: redis::Value = match self.query_on(live, node, &redis::cmd("ROLE")).await {
            Ok(reply) => reply,
            Err(error) if may_answer_later(&error) => return Err(error),
            Err(_) => return Ok(None),
        };
        let role = match &reply {
            redis::Value::Array(fields) => match fields.first() {
                Some(redis::Value::BulkString(role)) => String::from_utf8(role.clone()).ok(),
                Some(redis::Value::SimpleString(role)) => Some(role.clone()),
                _ => None,
            },
            _ => None,
        };
        match role {
            Some(role) => Ok(Some(role)),
            None => Err(not_trusted(format!(
                "ROLE answered {reply:?}: the pass cannot tell whether it reads a replica"
            ))),
        }
    }

    /// [`serving_process`](Self::serving_process) of every node of a pass.
    /// On a cluster, the masters planned must serve every slot once by
    /// their own account: the node asked for the topology may not have
    /// heard yet that a slot moved to a master it lists without slots
    /// (gossip takes up to half the node timeout), and the pass would
    /// never scan that master.
    async fn serving_processes(
        &self,
        live: &Live,
        nodes: &[Option<MasterNode>],
    ) -> Result<Vec<String>, RedisError> {
        let mut processes = Vec::with_capacity(nodes.len());
        let mut own_lines = Vec::with_capacity(nodes.len());
        for node in nodes {
            let (process, own_line) = self.serving_process(live, node.as_ref()).await?;
            processes.push(process);
            own_lines.extend(own_line);
        }
        if nodes.iter().any(Option::is_some) && !serve_every_slot_once(&own_lines) {
            return Err(not_trusted(
                "the masters the pass planned do not serve every slot once by their own \
                 account (the node asked for the topology had not heard of a slot's move \
                 yet?); the rebuild is retried",
            ));
        }
        Ok(processes)
    }

    /// The masters serving slots now, and a fingerprint of the topology
    /// (ids, addresses, config epochs, slots) to compare after a pass.
    async fn masters(&self, live: &Live) -> Result<(Vec<MasterNode>, String), RedisError> {
        let mut live = live.clone();
        let nodes: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut live)
            .await?;
        let client_addresses = client_addresses(
            redis::cmd("CLUSTER")
                .arg("SLOTS")
                .query_async(&mut live)
                .await?,
        );
        let mut masters: Vec<(MasterNode, String)> = nodes
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split(' ').collect();
                let flags = fields.get(2)?;
                if !is_serving_master(flags) || fields.len() <= 8 {
                    return None;
                }
                let address = fields[1].split('@').next()?;
                let (host, port) = address.rsplit_once(':')?;
                let (host, port) = match client_addresses.get(fields[0]) {
                    Some(address) => address.clone(),
                    None => (host.to_owned(), port.parse().ok()?),
                };
                let node = MasterNode {
                    id: fields[0].to_owned(),
                    host,
                    port,
                };
                let fingerprint = format!("{} {address} {}", fields[0], epoch_and_slots(&fields));
                Some((node, fingerprint))
            })
            .collect();
        // Every slot must be listed under a serving master: a node that has
        // not yet seen a failover through would leave a third of the keys
        // out of the pass, and the pass would look complete.
        let served: u32 = nodes
            .lines()
            .map(slots_served)
            .fold(0u32, u32::saturating_add);
        if served != CLUSTER_SLOTS {
            return Err(not_trusted(format!(
                "{served} of the cluster's {CLUSTER_SLOTS} slots are served by a master the \
                 node asked knows of (a failover in progress?); the rebuild is retried"
            )));
        }
        // Each master left out above (an address that does not parse) is
        // caught by the masters' own lines, which need one planned master.
        if masters.is_empty() {
            return Err(not_trusted(
                "CLUSTER NODES lists no master the pass can reach by its address",
            ));
        }
        masters.sort_by(|a, b| a.1.cmp(&b.1));
        let fingerprint = masters
            .iter()
            .map(|(_, line)| line.as_str())
            .collect::<Vec<_>>()
            .join("\n");
        Ok((
            masters.into_iter().map(|(node, _)| node).collect(),
            fingerprint,
        ))
    }

    /// A pass of a type Redis does not know would list no key, and the
    /// guard would answer `Absent` for each: refused.
    fn key_type_is_known(&self) -> Result<(), RedisError> {
        match &self.key_type {
            Some(KeyType {
                name,
                of_a_module: false,
            }) if !REDIS_TYPES
                .iter()
                .any(|known| known.eq_ignore_ascii_case(name)) =>
            {
                Err(not_trusted(format!(
                    "`{name}` is not one of Redis's types ({}): SCAN would list no key of it; \
                     a module's type goes through RedisSource::module_key_type",
                    REDIS_TYPES.join(", ")
                )))
            }
            _ => Ok(()),
        }
    }

    /// A pass of a pattern that cannot match the keys whose prefix it
    /// strips would list none of them, and the guard would answer `Absent`
    /// for each: refused.
    fn pattern_admits_strip_prefix(&self) -> Result<(), RedisError> {
        if self.pattern.is_empty() {
            // `MATCH ""` lists the empty key alone: a pattern left empty by
            // a missing setting would make every other key `Absent`.
            return Err(not_trusted(
                "the pattern is empty, which matches no key but the empty one: use `*` \
                 for every key"
                    .to_owned(),
            ));
        }
        let Some(prefix) = &self.strip_prefix else {
            return Ok(());
        };
        if glob_admits_prefix(&self.pattern, prefix) {
            return Ok(());
        }
        Err(not_trusted(format!(
            "the pattern `{}` matches no key that starts with `{}`, the prefix the \
             source strips: a glob character of the prefix needs a `\\` before it \
             (`{}`)",
            String::from_utf8_lossy(&self.pattern),
            String::from_utf8_lossy(prefix),
            String::from_utf8_lossy(&glob_of_prefix(prefix)),
        )))
    }

    fn strip_prefix_from(&self, keys: &mut KeyBatch) {
        if let Some(prefix) = &self.strip_prefix {
            for key in keys.iter_mut().filter(|key| key.starts_with(prefix)) {
                key.drain(..prefix.len());
            }
        }
    }
}

/// An `INFO` reply as text: a bulk string (lossy: it can hold text that is
/// not UTF-8, an error code a script made up, in its error stats), or a
/// verbatim string over RESP3.
fn info_text(reply: Value) -> Result<String, RedisError> {
    match reply {
        Value::BulkString(bytes) => Ok(String::from_utf8_lossy(&bytes).into_owned()),
        Value::VerbatimString { text, .. } | Value::SimpleString(text) => Ok(text),
        other => Err(not_trusted(format!(
            "INFO answered {other:?}, not text: the pass cannot tell a restart"
        ))),
    }
}

/// An error where Redis answered, but not so that the answer can be
/// trusted: a pass that may have skipped keys, a short `MGET` reply.
fn not_trusted(why: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> RedisError {
    RedisError::from(std::io::Error::other(why))
}

/// The `SCAN` glob of every key that starts with `prefix`: its glob
/// characters escaped, then `*`.
fn glob_of_prefix(prefix: &[u8]) -> Vec<u8> {
    let mut glob = Vec::with_capacity(prefix.len() + 1);
    for &byte in prefix {
        if matches!(byte, b'*' | b'?' | b'[' | b'\\') {
            glob.push(b'\\');
        }
        glob.push(byte);
    }
    glob.push(b'*');
    glob
}

/// Whether a key that starts with `prefix` can match the `SCAN` glob
/// `pattern`: false where the pattern reads a character of the prefix as
/// glob syntax. Our own, as Redis's dialect (`\` escapes, `[^a-z]`
/// classes) is no path glob's.
fn glob_admits_prefix(pattern: &[u8], prefix: &[u8]) -> bool {
    let mut at = 0;
    for &byte in prefix {
        match pattern.get(at) {
            None => return false,
            Some(b'*') => return can_match_something(&pattern[at + 1..]),
            Some(b'?') => at += 1,
            Some(b'[') => {
                let (in_class, length) = class_admits(&pattern[at + 1..], byte);
                if !in_class {
                    return false;
                }
                at += 1 + length;
            }
            // A `\` last in the pattern is itself (as in Redis).
            Some(b'\\') if at + 1 < pattern.len() => {
                if pattern[at + 1] != byte {
                    return false;
                }
                at += 2;
            }
            Some(&literal) => {
                if literal != byte {
                    return false;
                }
                at += 1;
            }
        }
    }
    can_match_something(&pattern[at..])
}

/// Whether some string matches the glob `pattern`: not where it holds a
/// class that admits nothing (`[]`, or a `[` that ends the pattern).
fn can_match_something(pattern: &[u8]) -> bool {
    let mut at = 0;
    while at < pattern.len() {
        match pattern[at] {
            b'\\' => at += 2,
            b'[' => {
                let class = &pattern[at + 1..];
                if class.is_empty() || class[0] == b']' {
                    return false;
                }
                at += 1 + class_admits(class, 0).1;
            }
            _ => at += 1,
        }
    }
    true
}

/// Whether the `[…]` class whose body starts `class` (after its `[`)
/// admits `byte`, and how many bytes the body takes with its `]`.
fn class_admits(class: &[u8], byte: u8) -> (bool, usize) {
    let negated = class.first() == Some(&b'^');
    let mut at = usize::from(negated);
    let mut admitted = false;
    while at < class.len() && class[at] != b']' {
        if class[at] == b'\\' && at + 1 < class.len() {
            admitted |= class[at + 1] == byte;
            at += 2;
        } else if class.get(at + 1) == Some(&b'-') && at + 2 < class.len() {
            let (low, high) = (class[at].min(class[at + 2]), class[at].max(class[at + 2]));
            admitted |= (low..=high).contains(&byte);
            at += 3;
        } else {
            admitted |= class[at] == byte;
            at += 1;
        }
    }
    (admitted != negated, (at + 1).min(class.len()))
}

/// A `CLUSTER NODES` line's config epoch and slots (its fields 6 and 8…):
/// what the node serves, in the view of the node that answered.
fn epoch_and_slots(fields: &[&str]) -> String {
    let mut own = fields.get(6).copied().unwrap_or_default().to_owned();
    for slots in fields.iter().skip(8) {
        own.push(' ');
        own.push_str(slots);
    }
    own
}

/// Whether a `CLUSTER NODES` line's flags are a master's that serves: it
/// has not failed and has an address. Whole flags: `nofailover`, which
/// `cluster-replica-no-failover` sets on every node, is not `fail`.
fn is_serving_master(flags: &str) -> bool {
    let mut flags = flags.split(',');
    flags.clone().any(|flag| flag == "master")
        && !flags.any(|flag| matches!(flag, "fail" | "fail?" | "noaddr"))
}

/// Hash slots in a Redis Cluster.
const CLUSTER_SLOTS: u32 = 16_384;

/// The slot ranges a `CLUSTER NODES` line serves: none unless it is a
/// master that has not failed and has an address.
fn slot_ranges(line: &str) -> impl Iterator<Item = std::ops::RangeInclusive<u32>> + '_ {
    let serving = is_serving_master(line.split(' ').nth(2).unwrap_or(""));
    line.split(' ')
        .skip(8)
        .filter(move |range| serving && !range.starts_with('['))
        .filter_map(|range| {
            // Slots are 0..16384: anything else (a broken reply) counts for none.
            let slot = |text: &str| {
                text.parse::<u32>()
                    .ok()
                    .filter(|&slot| slot < CLUSTER_SLOTS)
            };
            let (first, last) = range.split_once('-').unwrap_or((range, range));
            match (slot(first), slot(last)) {
                (Some(first), Some(last)) if last >= first => Some(first..=last),
                _ => None,
            }
        })
}

/// How many slots a `CLUSTER NODES` line serves.
fn slots_served(line: &str) -> u32 {
    slot_ranges(line)
        .map(|range| range.end() - range.start() + 1)
        .fold(0u32, u32::saturating_add)
}

/// Whether the `CLUSTER NODES` lines, each a master's own, serve every
/// slot, and none twice.
fn serve_every_slot_once(own_lines: &[String]) -> bool {
    let mut claims = vec![0u8; CLUSTER_SLOTS as usize];
    for range in own_lines.iter().flat_map(|line| slot_ranges(line)) {
        for slot in range {
            claims[slot as usize] = claims[slot as usize].saturating_add(1);
        }
    }
    claims.iter().all(|&claims| claims == 1)
}

/// A master of a cluster: its node id, and its address as the cluster
/// client names it.
#[derive(Debug, Clone)]
struct MasterNode {
    id: String,
    host: String,
    port: u16,
}

/// The masters' addresses by node id, as `CLUSTER SLOTS` gives them: the
/// cluster client names its connections so (a hostname where the nodes
/// announce one and prefer it), and routing by address looks them up by
/// that name. `CLUSTER NODES` lists the IP first whatever the nodes
/// prefer. A master without a usable address here (an empty or unknown
/// endpoint, a reply without ids) is left to its `CLUSTER NODES` address.
fn client_addresses(slots: redis::Value) -> HashMap<String, (String, u16)> {
    use redis::Value;
    let text = |value: &Value| match value {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(text) => Some(text.clone()),
        _ => None,
    };
    let Value::Array(ranges) = slots else {
        return HashMap::new();
    };
    ranges
        .iter()
        .filter_map(|range| {
            let Value::Array(range) = range else {
                return None;
            };
            // [first slot, last slot, master, replicas…]; a node is
            // [host, port, id, …].
            let Value::Array(master) = range.get(2)? else {
                return None;
            };
            let host = text(master.first()?).filter(|host| !host.is_empty() && host != "?")?;
            let Value::Int(port) = master.get(1)? else {
                return None;
            };
            let id = text(master.get(2)?)?;
            let port = u16::try_from(*port).ok()?;
            Some((id, (host, port)))
        })
        .collect()
}

/// Where a pass is: which node (none: the one node of a plain Redis), and
/// its cursor.
struct Pass {
    live: Live,
    nodes: Vec<Option<MasterNode>>,
    node: usize,
    cursor: u64,
    /// The cluster's topology when the pass started.
    topology: Option<String>,
    /// The process serving each node when the pass started.
    processes: Vec<String>,
}

impl KeySource for RedisSource {
    /// One pass of `SCAN`, a page at a time, until the cursor comes back to
    /// 0 (on a cluster: on every master in turn, and the topology the same
    /// at the end as at the start).
    fn scan(&self) -> KeyStream<'_> {
        let pages = stream::try_unfold(None::<Pass>, move |pass| async move {
            let mut pass = match pass {
                Some(pass) => pass,
                None => {
                    self.key_type_is_known()?;
                    self.pattern_admits_strip_prefix()?;
                    let live = self.connection.for_pass().await?;
                    let (nodes, topology) = match &self.connection.target {
                        Target::Node { .. } => (vec![None], None),
                        Target::Cluster { .. } => {
                            let (masters, topology) = self.masters(&live).await?;
                            (masters.into_iter().map(Some).collect(), Some(topology))
                        }
                    };
                    Pass {
                        processes: self.serving_processes(&live, &nodes).await?,
                        live,
                        nodes,
                        node: 0,
                        cursor: 0,
                        topology,
                    }
                }
            };
            let Some(node) = pass.nodes.get(pass.node) else {
                return Ok::<_, RedisError>(None); // past the last page
            };
            let (next, mut keys) = self
                .scan_page(&pass.live, node.as_ref(), pass.cursor)
                .await?;
            self.strip_prefix_from(&mut keys);
            pass.cursor = next;
            if next == 0 {
                pass.node += 1;
                if pass.node == pass.nodes.len() {
                    if let Some(before) = &pass.topology
                        && self.masters(&pass.live).await?.1 != *before
                    {
                        return Err(not_trusted(
                            "the cluster's topology changed during the pass: some keys may have \
                             moved past it; the rebuild is retried",
                        ));
                    }
                    if self.serving_processes(&pass.live, &pass.nodes).await? != pass.processes {
                        return Err(not_trusted(
                            "a node changed during the pass: Redis restarted (another run id), \
                             failed over (another replication id), took keys in by MIGRATE, or \
                             a master's slots changed; its cursor may have skipped keys, and \
                             the rebuild is retried",
                        ));
                    }
                }
            }
            Ok(Some((keys, Some(pass))))
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
            .field("pattern", &String::from_utf8_lossy(&self.pattern))
            .field("count", &self.count)
            .field("key_type", &self.key_type)
            .finish_non_exhaustive()
    }
}

/// Values from Redis: `GET prefix+key`, and `MGET` for batches. Use it as a
/// [`Loader`] for [`GuardedLoader`](crate::GuardedLoader), or as a
/// `tower::Service` behind [`GuardLayer::for_loader`](crate::GuardLayer::for_loader).
///
/// **String values only.** A key holding a hash, a list or a set is an
/// error for `get` (Redis answers `WRONGTYPE`) and for a batch that holds
/// it: `MGET` answers such a key nil, as a missing one, so an `EXISTS` of
/// the same keys goes beside it (on the same connection, no second round
/// trip). Where more keys exist than `MGET` found strings, the nil keys'
/// `TYPE`s are asked (a second round trip), and a batch holding one of
/// another type fails rather than answer it not found; a key written
/// between the two commands is a string, and its nil stands. The check
/// compares counts: a string key of the same batch deleted or expiring
/// between the two commands can hide one such key from it (the batches
/// around it fail). For keys of another type (a [`RedisSource`] with
/// [`key_type`](RedisSource::key_type) other than `string`), implement
/// [`Loader`] with the command that reads them (`HGETALL`, `SMEMBERS`).
///
/// The user needs `GET`, `MGET`, `EXISTS` and `TYPE`.
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

    /// Reads key `k` from Redis Cluster key `k`: `GET` is routed to the
    /// node serving the key, and a batch's `MGET` is split by slot and
    /// joined again by the cluster connection (one call on the caller's
    /// side). Follows failovers on its own. A client that reads from
    /// replicas answers from them: their lag must fit the guard's write
    /// settle, or a read just after a write misses it (and a
    /// confirmed-absent cache keeps the miss).
    ///
    /// The cluster connection's driver runs on the runtime that made it
    /// (the first call's); once that runtime is dropped, the next call
    /// makes another. A runtime kept but no longer driven (a
    /// `current_thread` runtime kept after a warm-up) keeps a connection
    /// whose driver never runs, and every call times out: drop it.
    pub fn cluster(client: ClusterClient) -> Self {
        Self {
            connection: Connection::cluster(client, Self::DEFAULT_TIMEOUT),
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

    /// The [`RedisSource`] of the keys this loader reads: every Redis key
    /// that starts with its [`prefix`](Self::prefix) (escaped in the
    /// `SCAN` pattern where it holds glob characters), stripped of it. The
    /// guard in front of the loader then holds the keys the loader is
    /// asked for, from one prefix written once: a pattern and a strip
    /// written apart can disagree, and the guard answers `Absent` for every
    /// key they disagree on.
    ///
    /// Over the same client (a cluster's for a cluster loader) on a
    /// connection of its own, so a pass's `SCAN`s do not queue before the
    /// loader's reads, with the source's own
    /// [`DEFAULT_TIMEOUT`](RedisSource::DEFAULT_TIMEOUT) (set another with
    /// [`RedisSource::timeout`]). It lists keys of every Redis type, so a
    /// hash or a list under the prefix is in the guard, and reading it
    /// through the loader fails (`WRONGTYPE` for `get`, an error for a
    /// batch).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use bloomguard::{Guard, GuardedLoader, redis::RedisLoader};
    ///
    /// let client = redis::Client::open("redis://127.0.0.1/")?;
    /// let loader = RedisLoader::new(client).prefix("item:");
    /// let guard = Guard::builder()
    ///     .expected_items(10_000_000)
    ///     .source(loader.source()) // `SCAN 0 MATCH item:*`, keys stripped of `item:`
    ///     .build()?;
    /// let maintenance = guard.spawn_maintenance(); // builds, then rebuilds
    /// guard.ready().await; // warming (every key "maybe") until the first build
    /// let items: GuardedLoader<String, _> = GuardedLoader::new(guard, loader);
    /// let item = items.get("42").await?;
    /// # let _ = (item, maintenance);
    /// # Ok(())
    /// # }
    /// ```
    pub fn source(&self) -> RedisSource {
        let connection = match &self.connection.target {
            Target::Node { client, .. } => {
                Connection::new(client.clone(), RedisSource::DEFAULT_TIMEOUT)
            }
            Target::Cluster { client, .. } => {
                Connection::cluster((**client).clone(), RedisSource::DEFAULT_TIMEOUT)
            }
        };
        RedisSource::over(connection, glob_of_prefix(&self.prefix)).strip_prefix(&self.prefix)
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

    /// `MGET`: the values of `keys`, in order, in one round trip (two where
    /// a key may hold no string: see [`RedisLoader`]).
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub async fn get_many<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<Vec<Option<Vec<u8>>>, RedisError> {
        self.query_many(self.redis_keys(keys)).await
    }

    /// The Redis keys of `keys`, taken before any await so that the keys
    /// need not outlive it.
    fn redis_keys<K: AsRef<[u8]>>(&self, keys: &[K]) -> Vec<Vec<u8>> {
        keys.iter()
            .map(|key| self.redis_key(key.as_ref()))
            .collect()
    }

    async fn query_many(&self, keys: Vec<Vec<u8>>) -> Result<Vec<Option<Vec<u8>>>, RedisError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let (mut mget, mut exists) = (redis::cmd("MGET"), redis::cmd("EXISTS"));
        mget.arg(&keys);
        exists.arg(&keys);
        let asked = keys.len();
        let mut manager = self.connection.get().await?;
        let mut beside = manager.clone();
        let (values, existing): (Vec<Option<Vec<u8>>>, usize) = futures_util::try_join!(
            mget.query_async(&mut manager),
            exists.query_async(&mut beside)
        )?;
        // A proxy's odd reply (nil, one string) reads as a short array: the
        // keys left over would read as not found.
        if values.len() != asked {
            return Err(not_trusted(format!(
                "MGET of {asked} keys answered {} values",
                values.len()
            )));
        }
        let found = values.iter().filter(|value| value.is_some()).count();
        if existing > found {
            // Either a key holds no string, or one was written between the
            // two commands (its nil is then the answer of the moment before):
            // each nil key's type tells which.
            let nil_keys = keys
                .iter()
                .zip(&values)
                .filter(|(_, value)| value.is_none())
                .map(|(key, _)| key);
            let types = futures_util::future::try_join_all(nil_keys.map(|key| {
                let mut connection = manager.clone();
                let mut command = redis::cmd("TYPE");
                command.arg(key);
                async move {
                    let kind: String = command.query_async(&mut connection).await?;
                    Ok::<_, RedisError>((key, kind))
                }
            }))
            .await?;
            if let Some((key, kind)) = types
                .into_iter()
                .find(|(_, kind)| kind != "string" && kind != "none")
            {
                return Err(not_trusted(format!(
                    "MGET answered nil for `{}`, which holds a {kind}: RedisLoader reads \
                     strings (GET answers WRONGTYPE)",
                    String::from_utf8_lossy(key)
                )));
            }
        }
        Ok(values)
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
        let (loader, keys) = (self.clone(), self.redis_keys(&keys));
        async move { loader.query_many(keys).await }
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

#[cfg(test)]
mod tests {
    use super::{glob_admits_prefix, may_answer_later, serve_every_slot_once};

    /// A failed `CLUSTER NODES` (or, where `INFO` is denied, `ROLE`) reads as
    /// "not a cluster", "not a replica" only where the server said it does
    /// not run the command; one that may answer when asked again (a node
    /// loading, busy, a connection cut) fails the pass, since the node may
    /// be one of a cluster, whose `SCAN` lists its own slots only.
    #[test]
    fn only_a_failure_that_may_answer_later_fails_the_pass() {
        let error = |reply: &str| {
            redis::parse_redis_value(reply.as_bytes())
                .unwrap()
                .extract_error()
                .unwrap_err()
        };
        for does_not_run in [
            "-ERR This instance has cluster support disabled\r\n",
            "-NOPERM User scanner has no permissions to run the 'cluster|nodes' command\r\n",
            "-ERR unknown subcommand 'NODES'\r\n",
            "-ERR unknown command 'ROLE'\r\n",
        ] {
            assert!(!may_answer_later(&error(does_not_run)), "{does_not_run}");
        }
        for may_answer in [
            "-LOADING Redis is loading the dataset in memory\r\n",
            "-BUSY Redis is busy running a script\r\n",
            "-MASTERDOWN Link with MASTER is down\r\n",
        ] {
            assert!(may_answer_later(&error(may_answer)), "{may_answer}");
        }
        let cut =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert!(may_answer_later(&cut));
    }

    /// The planned masters' own `CLUSTER NODES` lines decide whether a
    /// pass can cover the cluster: a node asked for the topology that had
    /// not heard of slot 100's move to `d` yet planned `a` and `b` only,
    /// and `a` no longer serves slot 100 by its own account.
    #[test]
    fn the_planned_masters_must_serve_every_slot_once_by_their_own_account() {
        let own = |id: &str, slots: &str| {
            format!("{id} 127.0.0.1:7000@17000 myself,master - 0 0 1 connected {slots}")
        };
        let covered = |lines: &[String]| serve_every_slot_once(lines);
        assert!(covered(&[own("a", "0-8191"), own("b", "8192-16383")]));
        assert!(!covered(&[
            own("a", "0-99 101-8191"),
            own("b", "8192-16383")
        ]));
        assert!(covered(&[
            own("a", "0-99 101-8191"),
            own("b", "8192-16383"),
            own("d", "100"),
        ]));
        // Claimed twice (one master heard of the move, the other not yet).
        assert!(!covered(&[
            own("a", "0-8191"),
            own("b", "8192-16383"),
            own("d", "100"),
        ]));
        // A slot being imported is its source's until it moves (the
        // marker fails the pass on its own, in `serving_process`).
        assert!(covered(&[
            own("a", "0-8191"),
            own("b", "8192-16383"),
            own("d", "[100-<-a]"),
        ]));
        // A failed master serves nothing; `nofailover` is no failure; a
        // broken range counts for none.
        let flagged = |flags: &str| {
            format!("a 127.0.0.1:7000@17000 myself,master,{flags} - 0 0 1 connected 0-8191")
        };
        assert!(!covered(&[flagged("fail"), own("b", "8192-16383")]));
        assert!(!covered(&[flagged("fail?"), own("b", "8192-16383")]));
        assert!(covered(&[flagged("nofailover"), own("b", "8192-16383")]));
        assert!(!covered(&[own("a", "0-8191 x-y"), own("b", "8192-16384")]));
    }

    #[test]
    fn a_glob_admits_a_prefix_only_where_its_keys_can_match() {
        for (pattern, prefix, admits) in [
            ("item:*", "item:", true),
            ("item:[0-9]*", "item:", true),
            ("*", "item:", true),
            ("ite?:*", "item:", true),
            ("item", "item:", false),
            ("user:*", "item:", false),
            // Glob syntax met by the prefix's own characters.
            ("shop[eu]:*", "shop[eu]:", false),
            (r"shop\[eu]:*", "shop[eu]:", true),
            ("a*b:*", "a*b:", true),
            (r"a\*b:*", "a*b:", true),
            (r"a\\b:*", r"a\b:", true),
            (r"a\b:*", r"a\b:", false),
            // Classes: ranges either way round, negation, escapes, no `]`.
            ("[a-c]x*", "bx", true),
            ("[c-a]x*", "bx", true),
            ("[^a-c]x*", "bx", false),
            ("[^a-c]x*", "dx", true),
            (r"[\]]x*", "]x", true),
            ("[ab", "b", true),
            // A rest that no key can match: an empty class, a `[` last.
            ("item:[]*", "item:", false),
            ("item:*[]", "item:", false),
            ("item:[", "item:", false),
            ("item:[^]*", "item:", true),
            (r"item:\[*", "item:", true),
        ] {
            assert_eq!(
                glob_admits_prefix(pattern.as_bytes(), prefix.as_bytes()),
                admits,
                "{pattern} against {prefix}"
            );
        }
    }
}
