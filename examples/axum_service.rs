//! An axum service with a guard in front of its store.
//!
//! ```text
//! cargo run --release --example axum_service --features metrics
//! curl -i localhost:3000/items/42                   # 200: the store has it
//! curl -i localhost:3000/items/nope                 # 404 from the guard: no store read
//! curl -i -X POST localhost:3000/items/new -d hello # the guard learns "new" before the write
//! curl localhost:3000/metrics                       # Prometheus text
//! ```
//!
//! The store holds items `0` … `99999` (written at start), and the guard
//! rebuilds from it (a `KeySource`) when its false-positive rate drifts.
//! Where the store lives comes from the environment, as for the main job:
//!
//! - nothing set: an in-memory map;
//! - `REDIS_URL=redis://127.0.0.1:6379/`: one Redis node;
//! - `REDIS_CLUSTER_URLS=redis://127.0.0.1:7000/,redis://127.0.0.1:7001/`:
//!   a Redis Cluster, given by some of its nodes.
//!
//! On Redis (add `--features metrics,redis`) items are the keys
//! `bloomguard:item:{id}`: the guard rebuilds from a `SCAN` of every master
//! ([`RedisSource`](bloomguard::redis::RedisSource)), reads go through a
//! [`RedisLoader`](bloomguard::redis::RedisLoader), writes are `SET`s.
//! `PORT` picks the port (default 3000).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Router, serve};
use bloomguard::layer::PathKey;
use bloomguard::{Guard, GuardLayer, InsertLayer, RebuildPolicy, source};
use dashmap::DashMap;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The items route. The guard's key is the `{id}` decoded exactly as the
/// handlers' `Path(id)` decodes it, so the guard, the handlers and the store
/// name an item by the same string (`/items/%34%32` is item `42`).
const ITEM_ROUTE: &str = "/items/{id}";

/// The header on the guard's own 404s, telling them from the handler's.
pub(crate) static ANSWERED_BY: HeaderName = HeaderName::from_static("x-answered-by");

/// Where the items live.
pub(crate) enum Store {
    /// An in-memory map: item id → value.
    Memory(Arc<DashMap<String, Bytes>>),
    /// Redis, one node or a cluster.
    #[cfg(feature = "redis")]
    Redis(Box<RedisItems>),
}

/// Where the environment says the items live: `REDIS_CLUSTER_URLS` (seed
/// nodes, comma-separated), `REDIS_URL`, or in memory when neither is set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StoreAt {
    Memory,
    Redis(String),
    RedisCluster(Vec<String>),
}

impl StoreAt {
    pub(crate) fn from_env(
        redis_url: Option<&str>,
        redis_cluster_urls: Option<&str>,
    ) -> Result<Self, String> {
        let seeds: Vec<String> = redis_cluster_urls
            .unwrap_or_default()
            .split(',')
            .map(str::trim)
            .filter(|seed| !seed.is_empty())
            .map(str::to_owned)
            .collect();
        match (redis_url, seeds.is_empty()) {
            (Some(_), false) => {
                Err("both REDIS_URL and REDIS_CLUSTER_URLS are set: choose one store".into())
            }
            (Some(url), true) => Ok(Self::Redis(url.to_owned())),
            (None, false) => Ok(Self::RedisCluster(seeds)),
            (None, true) => Ok(Self::Memory),
        }
    }
}

/// The items on Redis: read through the crate's loader, listed for rebuilds
/// by its source, written with `SET`.
#[cfg(feature = "redis")]
pub(crate) struct RedisItems {
    loader: bloomguard::redis::RedisLoader,
    source: bloomguard::redis::RedisSource,
    writer: RedisWriter,
}

#[cfg(feature = "redis")]
#[derive(Clone)]
enum RedisWriter {
    Node(redis::aio::ConnectionManager),
    Cluster(redis::cluster_async::ClusterConnection),
}

/// Redis keys of the items: `bloomguard:item:{id}`.
#[cfg(feature = "redis")]
pub(crate) const REDIS_PREFIX: &str = "bloomguard:item:";

impl Store {
    /// Opens the store at `at` and writes items `0 .. items` into it.
    pub(crate) async fn open(at: &StoreAt, items: u64) -> Result<Self, Box<dyn std::error::Error>> {
        let store = match at {
            StoreAt::Memory => Self::Memory(Arc::default()),
            #[cfg(feature = "redis")]
            StoreAt::Redis(url) => Self::Redis(Box::new(RedisItems::node(url).await?)),
            #[cfg(feature = "redis")]
            StoreAt::RedisCluster(seeds) => {
                Self::Redis(Box::new(RedisItems::cluster(seeds).await?))
            }
            #[cfg(not(feature = "redis"))]
            StoreAt::Redis(_) | StoreAt::RedisCluster(_) => {
                return Err("Redis needs the `redis` feature: \
                    cargo run --release --example axum_service --features metrics,redis"
                    .into());
            }
        };
        let ids: Vec<u64> = (0..items).collect();
        for chunk in ids.chunks(10_000) {
            let pairs: Vec<(String, Bytes)> = chunk
                .iter()
                .map(|id| (id.to_string(), Bytes::from(format!("item {id}"))))
                .collect();
            store.write_all(pairs).await?;
        }
        Ok(store)
    }

    async fn read(&self, id: &str) -> Result<Option<Bytes>, Box<dyn std::error::Error>> {
        match self {
            Self::Memory(items) => Ok(items.get(id).map(|value| value.clone())),
            #[cfg(feature = "redis")]
            Self::Redis(redis) => Ok(redis.loader.get(id).await?.map(Bytes::from)),
        }
    }

    /// Writes every `(id, value)` pair: on Redis one `MSET`, which a
    /// cluster connection splits by slot.
    async fn write_all(
        &self,
        pairs: Vec<(String, Bytes)>,
    ) -> Result<(), Box<dyn std::error::Error>> {
        match self {
            Self::Memory(items) => {
                for (id, value) in pairs {
                    items.insert(id, value);
                }
            }
            #[cfg(feature = "redis")]
            Self::Redis(redis) => {
                let mut mset = redis::cmd("MSET");
                for (id, value) in &pairs {
                    mset.arg(format!("{REDIS_PREFIX}{id}")).arg(value.as_ref());
                }
                let () = match redis.writer.clone() {
                    RedisWriter::Node(mut node) => mset.query_async(&mut node).await?,
                    RedisWriter::Cluster(mut cluster) => mset.query_async(&mut cluster).await?,
                };
            }
        }
        Ok(())
    }

    /// The ids in the store, listed for the guard's rebuilds.
    fn source(&self) -> Box<dyn bloomguard::KeySource> {
        match self {
            Self::Memory(items) => {
                let items = Arc::clone(items);
                Box::new(source::from_fn(move || {
                    items
                        .iter()
                        .map(|item| item.key().clone())
                        .collect::<Vec<_>>()
                }))
            }
            #[cfg(feature = "redis")]
            Self::Redis(redis) => Box::new(redis.source.clone()),
        }
    }
}

#[cfg(feature = "redis")]
impl RedisItems {
    async fn node(url: &str) -> redis::RedisResult<Self> {
        let client = redis::Client::open(url)?;
        let loader = bloomguard::redis::RedisLoader::new(client.clone()).prefix(REDIS_PREFIX);
        Ok(Self {
            source: loader.source(),
            loader,
            writer: RedisWriter::Node(client.get_connection_manager().await?),
        })
    }

    async fn cluster(seeds: &[String]) -> redis::RedisResult<Self> {
        let client = redis::cluster::ClusterClient::new(seeds.to_vec())?;
        let loader = bloomguard::redis::RedisLoader::cluster(client.clone()).prefix(REDIS_PREFIX);
        Ok(Self {
            source: loader.source(),
            loader,
            writer: RedisWriter::Cluster(client.get_async_connection().await?),
        })
    }
}

/// The guard over `store`, rebuilt from it when its false-positive rate drifts.
pub(crate) fn guard_over(store: &Store) -> Guard {
    Guard::builder()
        .name("items")
        .expected_items(1_000_000)
        .rebuild_policy(RebuildPolicy::default().when_drift_exceeds(2.0))
        .source(store.source())
        .build()
        .expect("the options above are in range")
}

/// The service: the guard answers absent ids before the read handler runs,
/// and learns every id before the write handler stores it. Built without
/// the `axum` feature, the layers key every path under `Router::layer` by
/// the template: a static route beside it (`/items/featured`) would be
/// keyed as an id and answered 404; with such routes, turn the feature on
/// or layer the template's route alone.
pub(crate) fn app(store: Arc<Store>, guard: Guard, prometheus: PrometheusHandle) -> Router {
    let item_id = |method| PathKey::route(ITEM_ROUTE).method(method);
    let items = Router::new()
        .route(ITEM_ROUTE, get(read_item).post(write_item))
        .layer(
            GuardLayer::for_http(guard.clone(), item_id(Method::GET))
                .with_absent_header(ANSWERED_BY.clone(), HeaderValue::from_static("bloomguard")),
        )
        .layer(InsertLayer::for_http(guard.clone(), item_id(Method::POST)))
        .with_state(store);
    let metrics = get(move || async move {
        guard.publish_metrics();
        let text_format = "text/plain; version=0.0.4; charset=utf-8";
        ([(header::CONTENT_TYPE, text_format)], prometheus.render())
    });
    items.route("/metrics", metrics)
}

async fn read_item(State(store): State<Arc<Store>>, Path(id): Path<String>) -> impl IntoResponse {
    match store.read(&id).await {
        Ok(Some(value)) => (StatusCode::OK, value).into_response(),
        Ok(None) => StatusCode::NOT_FOUND.into_response(),
        Err(_) => StatusCode::BAD_GATEWAY.into_response(),
    }
}

async fn write_item(
    State(store): State<Arc<Store>>,
    Path(id): Path<String>,
    body: Bytes,
) -> StatusCode {
    // InsertLayer has put the id into the guard already.
    match store.write_all(vec![(id, body)]).await {
        Ok(()) => StatusCode::CREATED,
        Err(_) => StatusCode::BAD_GATEWAY,
    }
}

/// The port to serve on: `PORT`, or 3000 when it is unset.
pub(crate) fn port_from(variable: Option<&str>) -> Result<u16, String> {
    let Some(text) = variable else {
        return Ok(3000);
    };
    text.trim()
        .parse()
        .map_err(|_| format!("PORT={text:?} is not a port number (0 to 65535)"))
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    if let Err(error) = run().await {
        eprintln!("error: {error}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let port = port_from(std::env::var("PORT").ok().as_deref())?;
    let at = StoreAt::from_env(
        std::env::var("REDIS_URL").ok().as_deref(),
        std::env::var("REDIS_CLUSTER_URLS").ok().as_deref(),
    )?;
    let prometheus = PrometheusBuilder::new().install_recorder()?;
    let store = Arc::new(Store::open(&at, 100_000).await?);
    let guard = guard_over(&store);
    let maintenance = guard.spawn_maintenance(); // first build, then rebuilds
    guard.ready().await;

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!(
        "serving http://{} (try /items/42, /items/nope, /metrics); ctrl-c stops",
        listener.local_addr()?
    );
    serve(listener, app(store, guard.clone(), prometheus))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    maintenance.shutdown().await;
    println!("stopped: {:?}", guard.stats().checks);
    Ok(())
}
