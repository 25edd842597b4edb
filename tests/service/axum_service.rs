//! The axum example, served on a loopback port and driven over real HTTP.

#[path = "../../examples/axum_service.rs"]
#[allow(unreachable_pub, dead_code)]
mod example;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::common::http_client::{HttpClient, Reply};
use crate::common::items_service::{self, ENCODED_IDS, assert_encoded_ids_round_trip};
use bloomguard::Guard;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};

/// The example's service on a loopback port, once its guard has built.
struct Running {
    address: SocketAddr,
    store: Arc<example::Store>,
    guard: Guard,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn serve(items: u64, prometheus: PrometheusHandle) -> Running {
    serve_from(&example::StoreAt::Memory, items, prometheus).await
}

async fn serve_from(at: &example::StoreAt, items: u64, prometheus: PrometheusHandle) -> Running {
    let store = Arc::new(example::Store::open(at, items).await.unwrap());
    let guard = example::guard_over(&store);
    guard.rebuild().await.expect("the first build");
    let app = example::app(Arc::clone(&store), guard.clone(), prometheus);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let loopback = SocketAddr::from(([127, 0, 0, 1], 0));
    let (address, server) = items_service::serve(app, loopback, async {
        let _ = stopped.await;
    })
    .await
    .unwrap();
    Running {
        address,
        store,
        guard,
        stop,
        server,
    }
}

fn answered_by_guard(reply: &Reply) -> bool {
    reply
        .headers
        .get(&example::ANSWERED_BY)
        .is_some_and(|value| value == "bloomguard")
}

fn metric_value(scrape: &str, series: &str) -> Option<f64> {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_http_service_end_to_end() {
    let prometheus = PrometheusBuilder::new().install_recorder().unwrap();
    let running = serve(100_000, prometheus).await;
    let mut client = HttpClient::connect(running.address).await;

    // Absent ids: 404. The guard's own 404s carry its header; the rest are
    // its false positives, which reached the store.
    let mut by_guard = 0;
    for i in 0..1_000 {
        let reply = client.get(&format!("/items/absent-{i}")).await;
        assert_eq!(reply.status, 404);
        assert!(reply.body.is_empty());
        by_guard += u64::from(answered_by_guard(&reply));
    }
    let stats = running.guard.stats();
    assert_eq!(by_guard, stats.checks.absent, "the guard's own 404s say so");
    assert_eq!(
        1_000 - by_guard,
        stats.false_positives,
        "only the guard's false positives reached the store"
    );
    assert!(
        stats.false_positives <= 30,
        "1 % target: {} of 1000 reached the store",
        stats.false_positives
    );

    // Present ids: 200 with their value, never the guard's header.
    for id in (0..100_000).step_by(997) {
        let reply = client.get(&format!("/items/{id}")).await;
        assert_eq!(
            (reply.status.as_u16(), reply.text()),
            (200, format!("item {id}").as_str())
        );
        assert!(!answered_by_guard(&reply));
    }

    // A POSTed id is visible at once.
    assert_eq!(client.post("/items/fresh-1", "hello").await.status, 201);
    let reply = client.get("/items/fresh-1").await;
    assert_eq!((reply.status.as_u16(), reply.text()), (200, "hello"));

    // Metrics reflect the traffic, in the Prometheus text format.
    let reply = client.get("/metrics").await;
    assert_eq!(reply.status, 200);
    let content_type = reply.headers.get("content-type").unwrap().to_str().unwrap();
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    let scrape = reply.text();
    let absent = metric_value(
        scrape,
        r#"bloomguard_checks_total{guard="items",verdict="absent"}"#,
    );
    assert_eq!(
        absent,
        Some(running.guard.stats().checks.absent as f64),
        "{scrape}"
    );
    assert_eq!(
        metric_value(scrape, r#"bloomguard_inserts_total{guard="items"}"#),
        Some(1.0)
    );

    // Graceful shutdown: the server ends once asked.
    drop(client);
    running.stop.send(()).unwrap();
    running.server.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_that_need_encoding_survive_writes_and_rebuilds() {
    let prometheus = PrometheusBuilder::new().build_recorder().handle();
    let running = serve(100, prometheus).await;
    let mut client = HttpClient::connect(running.address).await;
    assert_encoded_ids_round_trip(&mut client, &running.guard).await;
    let example::Store::Memory(items) = running.store.as_ref() else {
        panic!("the store is in memory");
    };
    for (_, decoded) in ENCODED_IDS {
        assert!(items.contains_key(decoded), "the store holds {decoded:?}");
    }
}

#[test]
fn the_store_comes_from_the_environment_as_for_the_main_job() {
    use example::StoreAt;
    assert_eq!(StoreAt::from_env(None, None), Ok(StoreAt::Memory));
    assert_eq!(StoreAt::from_env(None, Some(" ")), Ok(StoreAt::Memory));
    assert_eq!(
        StoreAt::from_env(Some("redis://127.0.0.1:6379/"), None),
        Ok(StoreAt::Redis("redis://127.0.0.1:6379/".into()))
    );
    assert_eq!(
        StoreAt::from_env(
            None,
            Some("redis://127.0.0.1:7000/, redis://127.0.0.1:7001/")
        ),
        Ok(StoreAt::RedisCluster(vec![
            "redis://127.0.0.1:7000/".into(),
            "redis://127.0.0.1:7001/".into()
        ]))
    );
    let both = StoreAt::from_env(Some("redis://a/"), Some("redis://b/")).unwrap_err();
    assert!(both.contains("choose one"), "{both}");
}

/// The example on Redis, as `REDIS_URL` or `REDIS_CLUSTER_URLS` runs it:
/// items seeded into Redis, absent ids answered by the guard, a POST
/// written to Redis (read back there by `value_in_redis`), and every id
/// still found after a rebuild from Redis's `SCAN`.
#[cfg(feature = "redis")]
async fn assert_the_example_serves_from_redis<F>(at: example::StoreAt, value_in_redis: F)
where
    F: AsyncFn(&str) -> Option<Vec<u8>>,
{
    let prometheus = PrometheusBuilder::new().build_recorder().handle();
    let running = serve_from(&at, 1_000, prometheus).await;
    assert_eq!(running.guard.stats().last_rebuild.unwrap().keys, 1_000);
    let mut client = HttpClient::connect(running.address).await;

    let reply = client.get("/items/42").await;
    assert_eq!((reply.status.as_u16(), reply.text()), (200, "item 42"));
    let mut by_guard = 0;
    for i in 0..200 {
        let reply = client.get(&format!("/items/absent-{i}")).await;
        assert_eq!(reply.status, 404);
        by_guard += u64::from(answered_by_guard(&reply));
    }
    assert!(
        by_guard >= 190,
        "{by_guard} of 200 absent ids answered by the guard"
    );

    assert_eq!(client.post("/items/fresh-1", "hello").await.status, 201);
    assert_eq!(
        value_in_redis(&format!("{}fresh-1", example::REDIS_PREFIX)).await,
        Some(b"hello".to_vec())
    );
    assert_encoded_ids_round_trip(&mut client, &running.guard).await;
    let reply = client.get("/items/fresh-1").await;
    assert_eq!((reply.status.as_u16(), reply.text()), (200, "hello"));

    drop(client);
    running.stop.send(()).unwrap();
    running.server.await.unwrap().unwrap();
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_serves_from_one_redis_node() {
    let server = crate::common::redis_server::RedisServer::start();
    let client = server.client();
    let value_in_redis = async |key: &str| {
        let mut connection = client.get_multiplexed_async_connection().await.unwrap();
        redis::cmd("GET")
            .arg(key)
            .query_async(&mut connection)
            .await
            .unwrap()
    };
    assert_the_example_serves_from_redis(example::StoreAt::Redis(server.url()), value_in_redis)
        .await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_serves_from_a_redis_cluster() {
    let cluster = crate::common::redis_cluster::RedisCluster::start();
    let client = cluster.client();
    let value_in_redis = async |key: &str| {
        let mut connection = client.get_async_connection().await.unwrap();
        redis::cmd("GET")
            .arg(key)
            .query_async(&mut connection)
            .await
            .unwrap()
    };
    let at = example::StoreAt::RedisCluster(cluster.urls());
    assert_the_example_serves_from_redis(at, value_in_redis).await;
}

#[test]
fn the_port_comes_from_port_or_is_refused() {
    assert_eq!(example::port_from(None), Ok(3000));
    assert_eq!(example::port_from(Some("8080")), Ok(8080));
    for bad in ["", "eighty", "70000", "-1"] {
        let error = example::port_from(Some(bad)).unwrap_err();
        assert!(error.contains("PORT"), "{bad:?}: {error}");
    }
}
