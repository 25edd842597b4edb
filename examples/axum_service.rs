//! An axum service with a guard in front of its store.
//!
//! ```text
//! cargo run --release --example axum_service --features metrics,redis
//! curl -i localhost:3000/items/42          # 200: the store has it
//! curl -i localhost:3000/items/nope        # 404, answered by the guard: no store read
//! curl -i -X POST localhost:3000/items/new -d hello   # the guard learns "new" before the write
//! curl localhost:3000/stats                # the guard's statistics as JSON
//! curl localhost:3000/metrics              # Prometheus text
//! ```
//!
//! Routes:
//! - `GET /items/{id}`: read from the store, behind `GuardLayer::for_http`.
//! - `POST /items/{id}`: write the request body to the store, behind
//!   `InsertLayer::for_http` (the guard first, then the store).
//! - `GET /stats`: `Guard::stats` as JSON; `GET /metrics`: the `metrics`
//!   exporter's Prometheus text.
//!
//! The store is an in-memory map holding `item:0` … `item:99999` (ids 0 to
//! 99999), read by the guard's rebuilds as a `KeySource`. With `REDIS_URL`
//! set (and `--features metrics,redis`), the items live in that Redis under
//! `bloomguard:item:` instead: reads are `GET`s through a `RedisLoader`,
//! writes `SET`s, and the guard rebuilds with a `RedisSource` (SCAN). `PORT`
//! picks the port (default 3000).

#![allow(dead_code)] // `tests/axum_service.rs` includes this file for its `app`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use bloomguard::layer::PathKey;
use bloomguard::{Guard, GuardLayer, InsertLayer, MaintenanceHandle, RebuildPolicy, source};
use dashmap::DashMap;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// Items the store starts with.
pub(crate) const SEEDED_ITEMS: u64 = 100_000;

/// The backend: an in-memory map that counts its reads.
#[derive(Debug, Default)]
pub(crate) struct Store {
    pub(crate) items: DashMap<String, Bytes>,
    reads: AtomicU64,
    /// How long a read waits, standing in for a remote backend's round trip.
    read_delay: Option<Duration>,
    /// Items in Redis instead of `items`.
    #[cfg(feature = "redis")]
    redis: Option<RedisItems>,
}

/// Where the items live when `REDIS_URL` is set.
#[cfg(feature = "redis")]
#[derive(Clone)]
pub(crate) struct RedisItems {
    client: redis::Client,
    loader: bloomguard::redis::RedisLoader,
    writer: redis::aio::MultiplexedConnection,
}

#[cfg(feature = "redis")]
impl std::fmt::Debug for RedisItems {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisItems").finish_non_exhaustive()
    }
}

/// Redis keys of the items: `bloomguard:item:{id}`.
#[cfg(feature = "redis")]
const REDIS_PREFIX: &str = "bloomguard:item:";

impl Store {
    pub(crate) fn seeded(items: u64) -> Self {
        let store = Self::default();
        for id in 0..items {
            store
                .items
                .insert(id.to_string(), Bytes::from(format!("item {id}")));
        }
        store
    }

    /// `items` items written to the Redis at `url`, read and written there.
    #[cfg(feature = "redis")]
    pub(crate) async fn seeded_in_redis(url: &str, items: u64) -> redis::RedisResult<Self> {
        let client = redis::Client::open(url)?;
        let mut writer = client.get_multiplexed_async_connection().await?;
        let ids: Vec<u64> = (0..items).collect();
        for chunk in ids.chunks(10_000) {
            let mut command = redis::cmd("MSET");
            for id in chunk {
                command
                    .arg(format!("{REDIS_PREFIX}{id}"))
                    .arg(format!("item {id}"));
            }
            let () = command.query_async(&mut writer).await?;
        }
        let loader = bloomguard::redis::RedisLoader::new(client.clone()).prefix(REDIS_PREFIX);
        Ok(Self {
            redis: Some(RedisItems {
                client,
                loader,
                writer,
            }),
            ..Self::default()
        })
    }

    /// Every read waits `delay` first, like a backend across the network
    /// (tokio's timer rounds it up to whole milliseconds).
    pub(crate) fn with_read_delay(mut self, delay: Duration) -> Self {
        self.read_delay = Some(delay);
        self
    }

    /// Reads the store has served: the backend calls the guard did not avoid.
    pub(crate) fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
}

#[derive(Clone)]
struct AppState {
    store: Arc<Store>,
    guard: Guard,
    prometheus: PrometheusHandle,
}

/// The items route. The guard's key is its `{id}` decoded exactly as the
/// handlers' `Path(id)` is (`PathKey`), so that the guard, the handlers and
/// the store name an item by the same string (`%34%32` is item `42`).
const ITEM_ROUTE: &str = "/items/{id}";

/// The header on the guard's own 404s.
pub(crate) static ANSWERED_BY: HeaderName = HeaderName::from_static("x-answered-by");

fn item_id(method: Method) -> PathKey {
    PathKey::route(ITEM_ROUTE).method(method)
}

/// The guard over `store`, rebuilt from it when its false-positive rate drifts.
pub(crate) fn guard_over(store: &Arc<Store>) -> Guard {
    let builder = Guard::builder()
        .name("items")
        .expected_items(1_000_000)
        .false_positive_rate(0.01)
        .rebuild_policy(RebuildPolicy::default().when_drift_exceeds(2.0));
    #[cfg(feature = "redis")]
    if let Some(redis) = &store.redis {
        let scan =
            bloomguard::redis::RedisSource::new(redis.client.clone(), format!("{REDIS_PREFIX}*"))
                .strip_prefix(REDIS_PREFIX);
        return builder
            .source(scan)
            .build()
            .expect("the options above are in range");
    }
    let listed = Arc::clone(store);
    builder
        .source(source::from_fn(move || {
            listed
                .items
                .iter()
                .map(|item| item.key().clone())
                .collect::<Vec<_>>()
        }))
        .build()
        .expect("the options above are in range")
}

/// The service: routes, the guard on reads, the insert on writes.
pub(crate) fn app(store: Arc<Store>, guard: Guard, prometheus: PrometheusHandle) -> Router {
    // The guard's 404s say so, to tell them from the handler's.
    let guarded_reads = GuardLayer::for_http(guard.clone(), item_id(Method::GET))
        .with_absent_header(ANSWERED_BY.clone(), HeaderValue::from_static("bloomguard"));
    routes()
        .layer(guarded_reads)
        .layer(InsertLayer::for_http(guard.clone(), item_id(Method::POST)))
        .with_state(AppState {
            store,
            guard,
            prometheus,
        })
}

/// The same service without the guard layer on reads, for comparison
/// (`benches/http.rs`).
pub(crate) fn unguarded_app(
    store: Arc<Store>,
    guard: Guard,
    prometheus: PrometheusHandle,
) -> Router {
    routes()
        .layer(InsertLayer::for_http(guard.clone(), item_id(Method::POST)))
        .with_state(AppState {
            store,
            guard,
            prometheus,
        })
}

fn routes() -> Router<AppState> {
    Router::new()
        .route(ITEM_ROUTE, get(read_item).post(write_item))
        .route("/stats", get(stats))
        .route("/metrics", get(metrics))
}

async fn read_item(State(state): State<AppState>, Path(id): Path<String>) -> impl IntoResponse {
    state.store.reads.fetch_add(1, Ordering::Relaxed);
    if let Some(delay) = state.store.read_delay {
        tokio::time::sleep(delay).await;
    }
    #[cfg(feature = "redis")]
    if let Some(redis) = &state.store.redis {
        return match redis.loader.get(&id).await {
            Ok(Some(value)) => (StatusCode::OK, value).into_response(),
            Ok(None) => StatusCode::NOT_FOUND.into_response(),
            Err(_) => StatusCode::BAD_GATEWAY.into_response(),
        };
    }
    match state.store.items.get(&id) {
        Some(value) => (StatusCode::OK, value.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn write_item(
    State(state): State<AppState>,
    Path(id): Path<String>,
    body: Bytes,
) -> StatusCode {
    // InsertLayer has put the id into the guard already.
    #[cfg(feature = "redis")]
    if let Some(redis) = &state.store.redis {
        let mut writer = redis.writer.clone();
        let written: redis::RedisResult<()> = redis::cmd("SET")
            .arg(format!("{REDIS_PREFIX}{id}"))
            .arg(body.as_ref())
            .query_async(&mut writer)
            .await;
        return match written {
            Ok(()) => StatusCode::CREATED,
            Err(_) => StatusCode::BAD_GATEWAY,
        };
    }
    state.store.items.insert(id, body);
    StatusCode::CREATED
}

async fn stats(State(state): State<AppState>) -> Json<serde_json::Value> {
    let stats = state.guard.stats();
    Json(serde_json::json!({
        "name": stats.name,
        "checks": {
            "absent": stats.checks.absent,
            "maybe_present": stats.checks.maybe_present,
            "warming": stats.checks.warming,
        },
        "inserts": stats.inserts,
        "found": stats.found,
        "false_positives": stats.false_positives,
        "pass_through_ratio": stats.pass_through_ratio,
        "observed_fpr": stats.observed_fpr,
        "estimated_fpr": stats.estimated_fpr,
        "target_fpr": stats.target_fpr,
        "estimated_drift": stats.estimated_drift,
        "fill_ratio": stats.fill_ratio,
        "estimated_items": stats.estimated_items,
        "generations": stats.generations,
        "generation": stats.swaps,
        "memory_bytes": stats.memory_bytes,
        "rebuilds_succeeded": stats.rebuilds.succeeded,
        "store_reads": state.store.reads(),
    }))
}

/// The Prometheus text exposition format's media type.
const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    state.guard.publish_metrics();
    (
        [(header::CONTENT_TYPE, PROMETHEUS_TEXT)],
        state.prometheus.render(),
    )
}

/// The port to serve on: `PORT`, or 3000 when it is unset.
pub(crate) fn port_from(variable: Option<&str>) -> Result<u16, String> {
    match variable {
        None => Ok(3000),
        Some(text) => text
            .trim()
            .parse()
            .map_err(|_| format!("PORT={text:?} is not a port number (0 to 65535)")),
    }
}

/// A running service: where it listens, and what it is made of.
#[derive(Debug)]
pub(crate) struct Running {
    pub(crate) address: SocketAddr,
    pub(crate) store: Arc<Store>,
    pub(crate) guard: Guard,
    pub(crate) maintenance: MaintenanceHandle,
    pub(crate) server: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Seeds a store, builds the guard (waiting for its first build), and
/// serves on `address` until `shutdown` resolves.
pub(crate) async fn start(
    address: SocketAddr,
    prometheus: PrometheusHandle,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<Running> {
    let store = Store::seeded(SEEDED_ITEMS);
    start_with(app, store, address, prometheus, shutdown).await
}

/// Makes the router of the service.
pub(crate) type MakeApp = fn(Arc<Store>, Guard, PrometheusHandle) -> Router;

/// [`start`] with the router made by `make_app`, over `store`.
pub(crate) async fn start_with(
    make_app: MakeApp,
    store: Store,
    address: SocketAddr,
    prometheus: PrometheusHandle,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<Running> {
    let store = Arc::new(store);
    let guard = guard_over(&store);
    let maintenance = guard.spawn_maintenance();
    guard.ready().await;
    let listener = tokio::net::TcpListener::bind(address).await?;
    let address = listener.local_addr()?;
    let service = make_app(Arc::clone(&store), guard.clone(), prometheus);
    let server = tokio::spawn(async move {
        axum::serve(listener, service)
            .with_graceful_shutdown(shutdown)
            .await
    });
    Ok(Running {
        address,
        store,
        guard,
        maintenance,
        server,
    })
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    match serve().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("error: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn serve() -> Result<(), Box<dyn std::error::Error>> {
    let port = port_from(std::env::var("PORT").ok().as_deref())?;
    let store = match std::env::var("REDIS_URL") {
        #[cfg(feature = "redis")]
        Ok(url) => {
            println!("store: Redis at {url}, items under {REDIS_PREFIX}");
            Store::seeded_in_redis(&url, SEEDED_ITEMS).await?
        }
        #[cfg(not(feature = "redis"))]
        Ok(url) => {
            eprintln!(
                "note: REDIS_URL={url} is set, but the `redis` feature is off; using the in-memory store"
            );
            Store::seeded(SEEDED_ITEMS)
        }
        Err(_) => Store::seeded(SEEDED_ITEMS),
    };
    let prometheus = PrometheusBuilder::new().install_recorder()?;
    let running = start_with(
        app,
        store,
        SocketAddr::from(([127, 0, 0, 1], port)),
        prometheus,
        async {
            let _ = tokio::signal::ctrl_c().await;
        },
    )
    .await?;
    println!(
        "serving http://{} ({} items; try /items/42, /items/nope, /stats, /metrics); ctrl-c stops",
        running.address, SEEDED_ITEMS
    );
    running.server.await??;
    running.maintenance.shutdown().await;
    println!("stopped: {:?}", running.guard.stats().checks);
    Ok(())
}
