//! The axum example, served on a loopback port and driven over real HTTP.

#[path = "../examples/axum_service.rs"]
#[allow(unreachable_pub, clippy::duplicated_attributes)]
mod example;

mod common;

use std::net::SocketAddr;

use metrics_exporter_prometheus::PrometheusBuilder;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One HTTP/1.1 request on a fresh connection; returns the status and body.
async fn http(address: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let (status, _, body) = http_with_head(address, method, path, body).await;
    (status, body)
}

/// [`http`], with the response's head (status line and headers) too.
async fn http_with_head(
    address: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String, String) {
    let mut stream = TcpStream::connect(address).await.unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, body) = response
        .split_once("\r\n\r\n")
        .expect("a response has a head and a body");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("a status line");
    (status, head.to_ascii_lowercase(), body.to_owned())
}

fn metric_value(scrape: &str, series: &str) -> Option<f64> {
    scrape
        .lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guarded_http_service_end_to_end() {
    let prometheus = PrometheusBuilder::new().install_recorder().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = example::start(SocketAddr::from(([127, 0, 0, 1], 0)), prometheus, async {
        let _ = stopped.await;
    })
    .await
    .unwrap();
    let address = running.address;

    // Absent ids: 404, and (but for false positives) no store read. The
    // guard's 404s carry its header, the handler's do not.
    let reads_before = running.store.reads();
    let mut not_found = 0;
    let mut by_guard = 0;
    let marker = format!("\r\n{}: bloomguard", example::ANSWERED_BY);
    for i in 0..1_000 {
        let (status, head, body) =
            http_with_head(address, "GET", &format!("/items/absent-{i}"), "").await;
        assert_eq!(status, 404);
        assert!(body.is_empty());
        not_found += 1;
        by_guard += u64::from(head.contains(&marker));
    }
    let stats = running.guard.stats();
    assert_eq!(by_guard, stats.checks.absent, "the guard's own 404s say so");
    let store_reads = running.store.reads() - reads_before;
    assert_eq!(not_found, 1_000);
    assert_eq!(
        store_reads, stats.false_positives,
        "only the guard's false positives reached the store"
    );
    assert_eq!(stats.checks.absent + stats.false_positives, 1_000);
    assert!(
        store_reads <= 30,
        "1 % target: {store_reads} of 1000 reached the store"
    );

    // Present ids: 200 with their value.
    for id in (0..example::SEEDED_ITEMS).step_by(997) {
        let (status, body) = http(address, "GET", &format!("/items/{id}"), "").await;
        assert_eq!((status, body), (200, format!("item {id}")));
    }

    // A POSTed id is visible at once.
    let (status, _) = http(address, "POST", "/items/fresh-1", "hello").await;
    assert_eq!(status, 201);
    let (status, body) = http(address, "GET", "/items/fresh-1", "").await;
    assert_eq!((status, body.as_str()), (200, "hello"));

    // Stats and metrics reflect the traffic.
    let (status, body) = http(address, "GET", "/stats", "").await;
    assert_eq!(status, 200);
    let json: serde_json::Value = serde_json::from_str(&body).unwrap();
    let stats = running.guard.stats();
    assert_eq!(json["checks"]["absent"], stats.checks.absent);
    assert_eq!(json["inserts"], 1);
    assert!(json["found"].as_u64().unwrap() >= 101);
    assert_eq!(json["store_reads"], running.store.reads());

    let (status, head, scrape) = http_with_head(address, "GET", "/metrics", "").await;
    assert_eq!(status, 200);
    assert!(
        head.contains("\r\ncontent-type: text/plain; version=0.0.4"),
        "the Prometheus text format: {head}"
    );
    let absent = metric_value(
        &scrape,
        r#"bloomguard_checks_total{guard="items",verdict="absent"}"#,
    );
    assert_eq!(absent, Some(stats.checks.absent as f64), "{scrape}");
    assert_eq!(
        metric_value(&scrape, r#"bloomguard_inserts_total{guard="items"}"#),
        Some(1.0)
    );

    // Graceful shutdown.
    stop.send(()).unwrap();
    running.server.await.unwrap().unwrap();
    running.maintenance.shutdown().await;
}

/// Ids that a URL must encode, as a client sends them and as the handler
/// (axum's `Path`) and the store see them.
const ENCODED_IDS: [(&str, &str); 6] = [
    ("a%20b", "a b"),
    ("caf%C3%A9", "café"),
    ("j%C3%B6rg", "jörg"),
    ("x%2Fy", "x/y"),
    ("a+b", "a+b"),
    ("%2B1", "+1"),
];

/// Writes every encoded id over HTTP, reads them back, rebuilds the guard
/// from the store and reads them again: 200 each time. Before the guard's
/// key was the decoded segment, the rebuild turned them into 404s.
async fn encoded_ids_round_trip(running: &example::Running) {
    let address = running.address;
    for (encoded, _) in ENCODED_IDS {
        let (status, _) = http(address, "POST", &format!("/items/{encoded}"), "v").await;
        assert_eq!(status, 201, "POST {encoded}");
    }
    for (encoded, _) in ENCODED_IDS {
        let (status, _) = http(address, "GET", &format!("/items/{encoded}"), "").await;
        assert_eq!(status, 200, "GET {encoded} after the write");
    }
    running.guard.rebuild().await.unwrap();
    for (encoded, decoded) in ENCODED_IDS {
        let (status, body) = http(address, "GET", &format!("/items/{encoded}"), "").await;
        assert_eq!(
            (status, body.as_str()),
            (200, "v"),
            "GET {encoded} ({decoded}) after a rebuild"
        );
    }
    // An existing item, its id spelled with escapes.
    let (status, body) = http(address, "GET", "/items/%34%32", "").await;
    assert_eq!((status, body.as_str()), (200, "item 42"));
}

/// The example's service over `store`, on a loopback port, until the test ends.
async fn serve(store: example::Store) -> example::Running {
    let prometheus = PrometheusBuilder::new().build_recorder().handle();
    let address = SocketAddr::from(([127, 0, 0, 1], 0));
    example::start_with(
        example::app,
        store,
        address,
        prometheus,
        std::future::pending(),
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_that_need_encoding_survive_writes_and_rebuilds() {
    let running = serve(example::Store::seeded(100)).await;
    encoded_ids_round_trip(&running).await;
    for (_, decoded) in ENCODED_IDS {
        assert!(
            running.store.items.contains_key(decoded),
            "the store holds {decoded:?}"
        );
    }
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_that_need_encoding_survive_writes_and_rebuilds_on_redis() {
    let server = common::redis_server::RedisServer::start();
    let store = example::Store::seeded_in_redis(&server.url(), 100)
        .await
        .unwrap();
    encoded_ids_round_trip(&serve(store).await).await;
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
