//! The items service the HTTP bench and the Redis tests drive: the axum
//! example's shape (`examples/axum_service.rs`) plus what measuring needs —
//! a store that counts its reads, can wait like a remote one, or lives in
//! Redis, and the same service without the guard for comparison.
//!
//! Part of the tests' shared support; `benches/http.rs` includes it with `#[path]`.

#![allow(dead_code)] // each includer uses its own part

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use bloomguard::layer::PathKey;
use bloomguard::{Guard, GuardLayer, InsertLayer, MaintenanceHandle, RebuildPolicy, source};
use dashmap::DashMap;

use super::http_client::HttpClient;

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
        .seed(0x5eed)
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
pub(crate) fn app(store: Arc<Store>, guard: Guard) -> Router {
    // The guard's 404s say so, to tell them from the handler's.
    let guarded_reads = GuardLayer::for_http(guard.clone(), item_id(Method::GET))
        .with_absent_header(ANSWERED_BY.clone(), HeaderValue::from_static("bloomguard"));
    routes()
        .layer(guarded_reads)
        .layer(InsertLayer::for_http(guard.clone(), item_id(Method::POST)))
        .with_state(store)
}

/// The same service without the guard layer on reads, for comparison
/// (`benches/http.rs`).
pub(crate) fn unguarded_app(store: Arc<Store>, guard: Guard) -> Router {
    routes()
        .layer(InsertLayer::for_http(guard.clone(), item_id(Method::POST)))
        .with_state(store)
}

fn routes() -> Router<Arc<Store>> {
    Router::new().route(ITEM_ROUTE, get(read_item).post(write_item))
}

async fn read_item(State(store): State<Arc<Store>>, Path(id): Path<String>) -> impl IntoResponse {
    store.reads.fetch_add(1, Ordering::Relaxed);
    if let Some(delay) = store.read_delay {
        tokio::time::sleep(delay).await;
    }
    #[cfg(feature = "redis")]
    if let Some(redis) = &store.redis {
        return match redis.loader.get(&id).await {
            Ok(Some(value)) => (StatusCode::OK, value).into_response(),
            Ok(None) => StatusCode::NOT_FOUND.into_response(),
            Err(_) => StatusCode::BAD_GATEWAY.into_response(),
        };
    }
    match store.items.get(&id) {
        Some(value) => (StatusCode::OK, value.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn write_item(
    State(store): State<Arc<Store>>,
    Path(id): Path<String>,
    body: Bytes,
) -> StatusCode {
    // InsertLayer has put the id into the guard already.
    #[cfg(feature = "redis")]
    if let Some(redis) = &store.redis {
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
    store.items.insert(id, body);
    StatusCode::CREATED
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

/// Makes the router of the service.
pub(crate) type MakeApp = fn(Arc<Store>, Guard) -> Router;

/// Builds the guard over `store` (waiting for its first build) and serves
/// the router `make_app` makes on `address` until `shutdown` resolves.
pub(crate) async fn start(
    make_app: MakeApp,
    store: Store,
    address: SocketAddr,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<Running> {
    let store = Arc::new(store);
    let guard = guard_over(&store);
    let maintenance = guard.spawn_maintenance();
    guard.ready().await;
    let (address, server) = serve(
        make_app(Arc::clone(&store), guard.clone()),
        address,
        shutdown,
    )
    .await?;
    Ok(Running {
        address,
        store,
        guard,
        maintenance,
        server,
    })
}

/// A server task answering with `router` on `address` (port 0: any free
/// one) until `shutdown` resolves; returns the address it listens on.
pub(crate) async fn serve(
    router: Router,
    address: SocketAddr,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<std::io::Result<()>>)> {
    let listener = tokio::net::TcpListener::bind(address).await?;
    let address = listener.local_addr()?;
    let server = tokio::spawn(async move {
        axum::serve(listener, router)
            .with_graceful_shutdown(shutdown)
            .await
    });
    Ok((address, server))
}

/// Ids that a URL must encode, as a client sends them and as the handler
/// (axum's `Path`) and the store see them.
pub(crate) const ENCODED_IDS: [(&str, &str); 6] = [
    ("a%20b", "a b"),
    ("caf%C3%A9", "café"),
    ("j%C3%B6rg", "jörg"),
    ("x%2Fy", "x/y"),
    ("a+b", "a+b"),
    ("%2B1", "+1"),
];

/// Writes every encoded id over HTTP, reads them back, rebuilds `guard` from
/// its store and reads them again: 200 "v" each time; then item 42 spelled
/// with escapes. Before the guard's key was the decoded segment, the
/// rebuild turned these into 404s.
pub(crate) async fn assert_encoded_ids_round_trip(client: &mut HttpClient, guard: &Guard) {
    for (encoded, _) in ENCODED_IDS {
        let reply = client.post(&format!("/items/{encoded}"), "v").await;
        assert_eq!(reply.status, 201, "POST {encoded}");
    }
    for (encoded, _) in ENCODED_IDS {
        let reply = client.get(&format!("/items/{encoded}")).await;
        assert_eq!(reply.status, 200, "GET {encoded} after the write");
    }
    guard.rebuild().await.unwrap();
    for (encoded, decoded) in ENCODED_IDS {
        let reply = client.get(&format!("/items/{encoded}")).await;
        assert_eq!(
            (reply.status.as_u16(), reply.text()),
            (200, "v"),
            "GET {encoded} ({decoded}) after a rebuild"
        );
    }
    let reply = client.get("/items/%34%32").await;
    assert_eq!((reply.status.as_u16(), reply.text()), (200, "item 42"));
}
