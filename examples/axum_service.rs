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
//! The store is an in-memory map holding items `0` … `99999`; the guard
//! rebuilds from it (a `KeySource`) when its false-positive rate drifts.
//! `PORT` picks the port (default 3000). For Redis behind the guard, see
//! `bloomguard::redis` and the main job (`examples/seen_items`).

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

/// The backend: item id → value.
pub(crate) type Store = DashMap<String, Bytes>;

/// The items route. The guard's key is the `{id}` decoded exactly as the
/// handlers' `Path(id)` decodes it, so the guard, the handlers and the store
/// name an item by the same string (`/items/%34%32` is item `42`).
const ITEM_ROUTE: &str = "/items/{id}";

/// The header on the guard's own 404s, telling them from the handler's.
pub(crate) static ANSWERED_BY: HeaderName = HeaderName::from_static("x-answered-by");

pub(crate) fn seeded_store(items: u64) -> Arc<Store> {
    let store = Store::new();
    for id in 0..items {
        store.insert(id.to_string(), Bytes::from(format!("item {id}")));
    }
    Arc::new(store)
}

/// The guard over `store`, rebuilt from it when its false-positive rate drifts.
pub(crate) fn guard_over(store: &Arc<Store>) -> Guard {
    let listed = Arc::clone(store);
    Guard::builder()
        .name("items")
        .expected_items(1_000_000)
        .rebuild_policy(RebuildPolicy::default().when_drift_exceeds(2.0))
        .source(source::from_fn(move || {
            listed
                .iter()
                .map(|item| item.key().clone())
                .collect::<Vec<_>>()
        }))
        .build()
        .expect("the options above are in range")
}

/// The service: the guard answers absent ids before the read handler runs,
/// and learns every id before the write handler stores it.
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
    match store.get(&id) {
        Some(value) => (StatusCode::OK, value.clone()).into_response(),
        None => StatusCode::NOT_FOUND.into_response(),
    }
}

async fn write_item(
    State(store): State<Arc<Store>>,
    Path(id): Path<String>,
    body: Bytes,
) -> StatusCode {
    store.insert(id, body); // InsertLayer put the id into the guard first
    StatusCode::CREATED
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
    let prometheus = PrometheusBuilder::new().install_recorder()?;
    let store = seeded_store(100_000);
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
