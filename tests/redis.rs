//! The `redis` feature against a real `redis-server` that each test starts on
//! a free loopback port and stops. Without `redis-server` the tests are
//! skipped, except under CI (`CI=true`), where that is a failure.

mod common;

use std::time::Duration;

use bloomguard::redis::{RedisLoader, RedisSource};
use bloomguard::{Guard, GuardLayer, GuardedLoader, RebuildPolicy, Verdict};
use common::redis_server::RedisServer;
use common::wait_until;
use tower::{ServiceExt, layer::Layer};

fn guard_over(server: &RedisServer, policy: RebuildPolicy) -> Guard {
    Guard::builder()
        .expected_items(100_000)
        .source(RedisSource::new(server.client(), "item:*").strip_prefix("item:"))
        .rebuild_policy(policy.retry_backoff(Duration::from_millis(20), Duration::from_millis(200)))
        .maintenance_interval(Duration::from_millis(20))
        .build()
        .unwrap()
}

/// How often the server ran `command`, from `INFO commandstats`.
fn command_calls(server: &RedisServer, command: &str) -> u64 {
    let mut connection = server.client().get_connection().unwrap();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut connection)
        .unwrap();
    let prefix = format!("cmdstat_{command}:calls=");
    info.lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .map_or(0, |rest| rest.split(',').next().unwrap().parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_rebuilds_from_scan_and_loads_with_get_and_mget() {
    let server = RedisServer::start();
    server.populate(0..50_000);
    let guard = guard_over(
        &server,
        RebuildPolicy::default().write_settle(Duration::ZERO),
    );
    let report = guard.rebuild().await.unwrap();
    assert_eq!(report.keys, 50_000);
    for id in (0..50_000).step_by(7) {
        assert_eq!(
            guard.check(id.to_string()),
            Verdict::MaybePresent,
            "id {id}"
        );
    }
    let absent = (0..10_000)
        .filter(|i| guard.check(format!("absent-{i}")).is_absent())
        .count();
    assert!(
        absent > 9_700,
        "{absent} of 10000 absent ids answered absent"
    );

    let loader = RedisLoader::new(server.client()).prefix("item:");
    assert_eq!(loader.get("42").await.unwrap(), Some(b"value 42".to_vec()));
    assert_eq!(loader.get("nope").await.unwrap(), None);
    let many = loader.get_many(&["1", "nope", "3"]).await.unwrap();
    assert_eq!(
        many,
        vec![Some(b"value 1".to_vec()), None, Some(b"value 3".to_vec())]
    );

    let guarded = GuardedLoader::new(guard.clone(), loader.clone());
    assert_eq!(
        guarded.get("7".to_string()).await.unwrap(),
        Some(b"value 7".to_vec())
    );
    // A batch: the candidates the guard rules out never reach Redis, and the
    // rest go in one MGET.
    let mgets_before = command_calls(&server, "mget");
    let candidates: Vec<String> = (0..100)
        .map(|i| match i % 10 {
            0 => (i * 100).to_string(),
            _ => format!("absent-batch-{i}"),
        })
        .collect();
    let values = guarded.get_many(&candidates).await.unwrap();
    for (candidate, value) in candidates.iter().zip(&values) {
        let expected = (!candidate.starts_with("absent")).then(|| format!("value {candidate}"));
        assert_eq!(value.as_deref(), expected.as_deref().map(str::as_bytes));
    }
    assert_eq!(command_calls(&server, "mget") - mgets_before, 1);

    let service = GuardLayer::for_loader(guard.clone()).layer(loader);
    assert_eq!(
        service.clone().oneshot("8".to_string()).await.unwrap(),
        Some(b"value 8".to_vec())
    );
    assert_eq!(service.oneshot("absent-1".to_string()).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_at_start_keeps_the_guard_warming_until_it_comes_up() {
    let mut probe = RedisServer::start();
    let port = probe.port;
    probe.kill(); // the port is known; nothing listens on it now
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let guard = Guard::builder()
        .expected_items(100_000)
        .source(RedisSource::new(client.clone(), "item:*").strip_prefix("item:"))
        .rebuild_policy(
            RebuildPolicy::default()
                .write_settle(Duration::ZERO)
                .retry_backoff(Duration::from_millis(20), Duration::from_millis(200)),
        )
        .maintenance_interval(Duration::from_millis(20))
        .build()
        .unwrap();
    let maintenance = guard.spawn_maintenance();
    wait_until("failed first builds", || guard.stats().rebuilds.failed >= 2).await;
    assert_eq!(
        guard.check("1"),
        Verdict::Warming,
        "never Absent while Redis is down"
    );
    let loader = GuardedLoader::new(guard.clone(), RedisLoader::new(client).prefix("item:"));
    assert!(
        loader.get("1".to_string()).await.is_err(),
        "the backend path fails as the backend does"
    );

    let server = RedisServer::start_on(port);
    server.populate(0..10_000);
    wait_until("the first build once Redis is up", || !guard.is_warming()).await;
    maintenance.shutdown().await;
    for id in 0..10_000 {
        assert_eq!(guard.check(id.to_string()), Verdict::MaybePresent);
    }
    assert_eq!(
        loader.get("1".to_string()).await.unwrap(),
        Some(b"value 1".to_vec())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_scan_leaves_the_old_filter_serving() {
    let mut server = RedisServer::start();
    let port = server.port;
    server.populate(0..100_000);
    // Ten keys a SCAN call: the pass takes thousands of round trips.
    let guard = Guard::builder()
        .expected_items(200_000)
        .source(
            RedisSource::new(server.client(), "item:*")
                .strip_prefix("item:")
                .count(10),
        )
        .rebuild_policy(RebuildPolicy::default().write_settle(Duration::ZERO))
        .build()
        .unwrap();
    guard.rebuild().await.unwrap();
    let generation = guard.stats().swaps;

    let rebuilding = tokio::spawn({
        let guard = guard.clone();
        async move { guard.rebuild().await }
    });
    wait_until("the second rebuild to start", || guard.stats().rebuilding).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!rebuilding.is_finished(), "the scan was still running");
    server.kill();
    let error = rebuilding.await.unwrap().unwrap_err();
    assert!(
        matches!(error, bloomguard::RebuildError::Source(_)),
        "{error}"
    );
    let stats = guard.stats();
    assert_eq!(stats.rebuilds.failed, 1);
    assert_eq!(stats.swaps, generation, "the old filter is still live");
    for id in (0..100_000).step_by(13) {
        assert_eq!(guard.check(id.to_string()), Verdict::MaybePresent);
    }

    let server = RedisServer::start_on(port);
    server.populate(0..100_000);
    let report = guard.rebuild().await.unwrap();
    assert_eq!(report.keys, 100_000);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loader_reconnects_after_redis_restarts() {
    let mut server = RedisServer::start();
    let port = server.port;
    server.populate(0..10);
    let loader = RedisLoader::new(server.client())
        .prefix("item:")
        .timeout(Duration::from_millis(500));
    assert_eq!(loader.get("1").await.unwrap(), Some(b"value 1".to_vec()));

    server.kill();
    assert!(loader.get("1").await.is_err(), "Redis is down");
    let server = RedisServer::start_on(port);
    server.populate(0..10);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(value) = loader.get("2").await {
            assert_eq!(value, Some(b"value 2".to_vec()));
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the loader never reconnected"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The HTTP service's ids that need encoding, stored in Redis: written over
/// HTTP, read back, and read again after a rebuild from a `SCAN` of Redis —
/// the guard's key, the handler's id and the Redis key stay one string.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_that_need_encoding_survive_writes_and_rebuilds_on_redis() {
    use common::http_client::HttpClient;
    use common::items_service::{self, Store};

    let server = RedisServer::start();
    let store = Store::seeded_in_redis(&server.url(), 100).await.unwrap();
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    let running = items_service::start(items_service::app, store, address, std::future::pending())
        .await
        .unwrap();
    let mut client = HttpClient::connect(running.address).await;
    items_service::assert_encoded_ids_round_trip(&mut client, &running.guard).await;
    running.maintenance.shutdown().await;
}
