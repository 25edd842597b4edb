//! The `redis` feature against a real `redis-server` that each test starts on
//! a free loopback port and stops. Without `redis-server` they fail, saying
//! what to install.

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
        .seed(0x5eed)
        .source(RedisSource::new(server.client(), "item:*").strip_prefix("item:"))
        .rebuild_policy(policy.retry_backoff(Duration::from_millis(20), Duration::from_millis(200)))
        .maintenance_interval(Duration::from_millis(20))
        .build()
        .unwrap()
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
    assert_eq!(guarded.get("7").await.unwrap(), Some(b"value 7".to_vec()));
    // A batch: the candidates the guard rules out never reach Redis, and the
    // rest go in one MGET.
    let mgets_before = server.command_calls("mget");
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
    assert_eq!(server.command_calls("mget") - mgets_before, 1);

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
        loader.get("1").await.is_err(),
        "the backend path fails as the backend does"
    );

    // Maintenance stops while Redis comes back and is filled: a build that
    // ran in between would see an empty store and rightly answer its keys,
    // written behind the guard's back, `Absent` (seen in CI).
    maintenance.shutdown().await;
    assert!(guard.is_warming());
    let server = RedisServer::start_on(port);
    server.populate(0..10_000);
    let maintenance = guard.spawn_maintenance();
    wait_until("the first build once Redis is up", || !guard.is_warming()).await;
    maintenance.shutdown().await;
    for id in 0..10_000 {
        assert_eq!(guard.check(id.to_string()), Verdict::MaybePresent);
    }
    assert_eq!(loader.get("1").await.unwrap(), Some(b"value 1".to_vec()));
}

/// A Redis source that runs `act` after each page of a pass, given the
/// page's number and keys, before the pass goes on.
struct ActsOnPages<A> {
    source: RedisSource,
    act: A,
}

type Act = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

impl<A: Fn(usize, &[Vec<u8>]) -> Act + Send + Sync + 'static> bloomguard::KeySource
    for ActsOnPages<A>
{
    fn scan(&self) -> bloomguard::source::KeyStream<'_> {
        use futures_util::StreamExt;
        Box::pin(
            self.source
                .scan()
                .enumerate()
                .then(move |(page, batch)| async move {
                    if let Ok(keys) = &batch {
                        (self.act)(page, keys).await;
                    }
                    batch
                }),
        )
    }
}

/// A Redis source that runs `act` after each pass's first page: the pass
/// is certainly in the middle when the test acts.
fn acts_mid_pass(
    source: RedisSource,
    act: impl Fn() -> Act + Send + Sync + 'static,
) -> ActsOnPages<impl Fn(usize, &[Vec<u8>]) -> Act + Send + Sync + 'static> {
    ActsOnPages {
        source,
        act: move |page, _: &[Vec<u8>]| -> Act {
            if page == 0 { act() } else { Box::pin(async {}) }
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_scan_leaves_the_old_filter_serving() {
    let mut server = RedisServer::start();
    let port = server.port;
    server.populate(0..100_000);
    let paused = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let resume = std::sync::Arc::new(tokio::sync::Semaphore::new(1)); // the first build runs through
    let source = acts_mid_pass(
        RedisSource::new(server.client(), "item:*")
            .strip_prefix("item:")
            .count(10),
        {
            let (paused, resume) = (paused.clone(), resume.clone());
            move || -> Act {
                let (paused, resume) = (paused.clone(), resume.clone());
                Box::pin(async move {
                    paused.store(true, std::sync::atomic::Ordering::SeqCst);
                    resume.acquire().await.unwrap().forget();
                })
            }
        },
    );
    let guard = Guard::builder()
        .expected_items(200_000)
        .source(source)
        .rebuild_policy(RebuildPolicy::default().write_settle(Duration::ZERO))
        .build()
        .unwrap();
    guard.rebuild().await.unwrap();
    let generation = guard.stats().swaps;

    paused.store(false, std::sync::atomic::Ordering::SeqCst);
    let rebuilding = tokio::spawn({
        let guard = guard.clone();
        async move { guard.rebuild().await }
    });
    wait_until("the second pass to pause after its first page", || {
        paused.load(std::sync::atomic::Ordering::SeqCst)
    })
    .await;
    server.kill();
    resume.add_permits(1_000); // this pass and the ones after go on
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

/// A `SCAN` cursor means nothing to another process (a restart, a failover):
/// keys after it may be skipped. A pass across a restart fails, whatever
/// the connection did meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_across_a_redis_restart_fails() {
    let server = RedisServer::start();
    let client = server.client();
    a_restart_mid_pass_fails_it(server, client, |_| {}).await;
}

/// The same over RESP3, where `INFO` answers a verbatim string: a pass
/// that read it as bytes failed every time, and the retry too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_across_a_redis_restart_fails_over_resp3() {
    let server = RedisServer::start();
    let port = server.port;
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/?protocol=resp3")).unwrap();
    a_restart_mid_pass_fails_it(server, client, |_| {}).await;
}

/// The same, for a user that may not run `INFO` and a connection that
/// reconnects on its own (RESP3 tells the client of a dropped connection,
/// so no `SCAN` fails): the pass must still not be taken as whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_across_a_redis_restart_fails_where_info_is_denied() {
    let server = RedisServer::start();
    let port = server.port;
    let _user = without_info(port);
    let client = redis::Client::open(format!(
        "redis://scanner:any@127.0.0.1:{port}/?protocol=resp3"
    ))
    .unwrap();
    a_restart_mid_pass_fails_it(server, client, |port| {
        without_info(port);
    })
    .await;
}

/// Fills `server` with 100,000 keys and rebuilds a guard over `client`
/// whose first pass restarts Redis after its first page (same port, same
/// keys, then `prepare(port)`), giving the connection time to come back
/// before the next page: the pass fails, and the retry reads every key.
async fn a_restart_mid_pass_fails_it(server: RedisServer, client: redis::Client, prepare: fn(u16)) {
    server.populate(0..100_000);
    let port = server.port;
    let source = RedisSource::new(client, "item:*")
        .strip_prefix("item:")
        .count(100);
    let server = std::sync::Arc::new(std::sync::Mutex::new(server));
    let restarted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let guard = Guard::builder()
        .expected_items(200_000)
        .source(acts_mid_pass(source, move || -> Act {
            let (server, restarted) = (server.clone(), restarted.clone());
            Box::pin(async move {
                if restarted.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    return;
                }
                server.lock().unwrap().kill();
                let back = RedisServer::start_on(port);
                back.populate(0..100_000);
                prepare(port);
                *server.lock().unwrap() = back;
                tokio::time::sleep(Duration::from_secs(1)).await;
            })
        }))
        .rebuild_policy(RebuildPolicy::default().write_settle(Duration::ZERO))
        .build()
        .unwrap();
    match guard.rebuild().await {
        Err(error) => assert!(
            matches!(error, bloomguard::RebuildError::Source(_)),
            "{error}"
        ),
        Ok(report) => panic!(
            "a pass across a restart was taken as whole ({} of 100000 keys read)",
            report.keys
        ),
    }
    assert!(guard.is_warming(), "no partial filter was swapped in");
    let report = guard.rebuild().await.unwrap();
    assert_eq!(report.keys, 100_000, "the retry reads every key");
}

/// A prefix with a glob character in it, written into the `MATCH` pattern
/// as it is: `shop[eu]:*` matches `shope:…`, never `shop[eu]:1`, so a pass
/// would list nothing and the guard answer `Absent` for every key. The pass
/// fails instead, saying how to write the pattern.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pattern_that_cannot_match_the_stripped_prefix_fails_the_pass() {
    let server = RedisServer::start();
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("SET")
        .arg("shop[eu]:1")
        .arg("x")
        .query(&mut connection)
        .unwrap();
    let guard = common::guard_from(
        RedisSource::new(server.client(), "shop[eu]:*").strip_prefix("shop[eu]:"),
    );
    let error = guard
        .rebuild()
        .await
        .expect_err("a pattern that cannot match its own prefix fails the pass");
    assert!(error.to_string().contains(r"shop\[eu]:*"), "{error}");
    assert_eq!(guard.check("1"), Verdict::Warming);

    let escaped = common::guard_from(
        RedisSource::new(server.client(), r"shop\[eu]:*").strip_prefix("shop[eu]:"),
    );
    assert_eq!(escaped.rebuild().await.unwrap().keys, 1);
    assert_eq!(escaped.check("1"), Verdict::MaybePresent);
}

/// An empty pattern (a setting left unset: `RedisSource::new(client,
/// env_or_default)`) is `MATCH ""`, which lists the empty key alone: the
/// pass listed nothing and the guard answered `Absent` for every stored
/// key. It fails instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_pattern_fails_the_pass() {
    let server = RedisServer::start();
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("SET")
        .arg("item:1")
        .arg("x")
        .query(&mut connection)
        .unwrap();
    let guard = common::guard_from(RedisSource::new(server.client(), ""));
    let error = guard
        .rebuild()
        .await
        .expect_err("an empty pattern fails the pass");
    assert!(error.to_string().contains("pattern is empty"), "{error}");
    assert_eq!(guard.check("item:1"), Verdict::Warming);
}

/// Redis answers `SCAN … TYPE` with a type it does not know (a misspelt
/// `strings`) with no keys and no error: the pass listed nothing, and the
/// guard answered `Absent` for every stored key. Such a pass fails, naming
/// the types; a module's type, which Redis cannot be asked about, is taken
/// as told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_type_redis_does_not_know_fails_the_pass() {
    let server = RedisServer::start();
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("SET")
        .arg("item:1")
        .arg("x")
        .query(&mut connection)
        .unwrap();
    let source = || RedisSource::new(server.client(), "item:*").strip_prefix("item:");
    let misspelt = common::guard_from(source().key_type("strings"));
    let error = misspelt
        .rebuild()
        .await
        .expect_err("a type Redis does not know fails the pass");
    assert!(error.to_string().contains("`strings`"), "{error}");
    assert_eq!(misspelt.check("1"), Verdict::Warming);

    let known = common::guard_from(source().key_type("STRING"));
    assert_eq!(known.rebuild().await.unwrap().keys, 1);
    assert_eq!(known.check("1"), Verdict::MaybePresent);
    let module = common::guard_from(source().module_key_type("ReJSON-RL"));
    assert_eq!(
        module.rebuild().await.unwrap().keys,
        0,
        "no key of that type"
    );
}

/// A loader's own source lists the keys the loader reads, from its one
/// prefix: glob characters in it are escaped in the pattern, and a key the
/// unescaped glob would match (`shope:3`) is not listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loaders_source_lists_every_key_the_loader_reads_and_no_other() {
    let server = RedisServer::start();
    let mut connection = server.client().get_connection().unwrap();
    for key in ["shop[eu]:1", "shop[eu]:2", "shope:3", "other:4"] {
        let () = redis::cmd("SET")
            .arg(key)
            .arg(format!("value of {key}"))
            .query(&mut connection)
            .unwrap();
    }
    let loader = RedisLoader::new(server.client()).prefix("shop[eu]:");
    let guard = common::guard_from(loader.source().count(1));
    assert_eq!(guard.rebuild().await.unwrap().keys, 2);
    assert_eq!(guard.check("1"), Verdict::MaybePresent);
    assert_eq!(guard.check("2"), Verdict::MaybePresent);
    let items = GuardedLoader::new(guard, loader);
    assert_eq!(
        items.get("2").await.unwrap(),
        Some(b"value of shop[eu]:2".to_vec())
    );
}

/// `MGET` answers nil for a key holding a hash, as for a missing one: a
/// batch must not read it as not found (the confirmed-absent cache would
/// then answer `get` from that), but fail as `GET` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_over_a_key_that_is_not_a_string_fails_as_get_does() {
    let server = RedisServer::start();
    server.populate(0..10);
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("HSET")
        .arg("item:h")
        .arg("field")
        .arg("value")
        .query(&mut connection)
        .unwrap();
    let guard = guard_over(
        &server,
        RebuildPolicy::default().write_settle(Duration::ZERO),
    );
    guard.rebuild().await.unwrap();
    let loader = RedisLoader::new(server.client()).prefix("item:");
    assert!(loader.get("h").await.is_err(), "GET answers WRONGTYPE");
    let batch = loader.get_many(&["1", "h", "nope"]).await;
    assert!(batch.is_err(), "a batch over a hash answered {batch:?}");
    assert_eq!(
        loader.get_many(&["1", "nope"]).await.unwrap(),
        vec![Some(b"value 1".to_vec()), None]
    );

    let guarded = GuardedLoader::new(guard, loader)
        .confirmed_absent_cache(100, Duration::from_secs(60))
        .unwrap();
    assert!(guarded.get_many(&["h".to_string()]).await.is_err());
    assert!(
        guarded.get("h").await.is_err(),
        "the batch left a not-found answer behind"
    );
}

/// The restart tests stop a server and start it on the same port while
/// clients keep reconnecting to it. A port among the kernel's outgoing ones
/// could be handed to such a client as its own end, connecting it to itself
/// and keeping the server from binding (a rare flake of these tests).
#[test]
fn test_servers_listen_below_the_ports_clients_connect_from() {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .expect("Linux's outgoing port range");
    let lowest_outgoing: u16 = range.split_whitespace().next().unwrap().parse().unwrap();
    let server = RedisServer::start();
    assert!(
        server.port < lowest_outgoing,
        "port {} is in the outgoing range from {lowest_outgoing}",
        server.port
    );
    let cluster_ports = common::ports::free_loopback_port(true);
    assert!(cluster_ports + 10_000 < lowest_outgoing);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loader_reconnects_after_redis_restarts() {
    let mut server = RedisServer::start();
    let port = server.port;
    server.populate(0..10);
    // Time for a first connection on a loaded machine; a call to a Redis
    // that is down fails sooner (connection refused).
    let loader = RedisLoader::new(server.client())
        .prefix("item:")
        .timeout(Duration::from_secs(5));
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

/// A replica serves what its master sent it, asynchronously: a write the
/// master took may be missing from the replica's `SCAN` for longer than any
/// write settle, and a guard rebuilt from it answers `Absent` for it. A
/// pass on a replica fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_on_a_replica_fails() {
    let (_master, replica) = replica_of_a_populated_master();
    let guard = guard_over(
        &replica,
        RebuildPolicy::default().write_settle(Duration::ZERO),
    );
    let error = guard
        .rebuild()
        .await
        .expect_err("a pass on a replica fails");
    assert!(error.to_string().contains("replica"), "{error}");
    assert!(guard.is_warming());
}

/// A user that may not run `INFO` (a common ACL): the source asks `ROLE`
/// instead, and a pass on a replica still fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_on_a_replica_fails_where_info_is_denied() {
    let (_master, replica) = replica_of_a_populated_master();
    let source = RedisSource::new(without_info(replica.port), "item:*").strip_prefix("item:");
    let guard = common::guard_from(source);
    let error = guard
        .rebuild()
        .await
        .expect_err("a pass on a replica fails");
    assert!(error.to_string().contains("replica"), "{error}");
}

/// Where `INFO` is denied, a `CLUSTER NODES` that may answer when asked
/// again (`LOADING`) fails the pass: read as "not a cluster", as it was, a
/// node of a cluster (whose `SCAN` lists its own slots only) passed for the
/// whole store. One that says the server has no cluster does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_nodes_that_may_answer_later_fails_the_pass_where_info_is_denied() {
    let loading = pass_over(
        INFO_DENIED,
        MASTER,
        "-LOADING Redis is loading the dataset\r\n",
    )
    .await;
    let error = loading.expect_err("a node that may be one of a cluster");
    assert!(error.to_string().contains("loading the dataset"), "{error}");
    let plain = pass_over(INFO_DENIED, MASTER, NO_CLUSTER).await;
    assert_eq!(plain.unwrap(), 1, "a plain Redis is read");
}

/// An `INFO` without a run id (a proxy's, a compatible server's) reads as
/// denied: `ROLE` is asked, and a pass on a replica fails. It was taken
/// for a master's, without asking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_info_without_a_run_id_asks_role_and_a_replica_fails_the_pass() {
    let info = bulk("# Server\r\nredis_version:7.0.0\r\n");
    let replica = "*5\r\n$5\r\nslave\r\n$9\r\n127.0.0.1\r\n:6379\r\n$9\r\nconnected\r\n:0\r\n";
    let error = pass_over(&info, replica, NO_CLUSTER).await.unwrap_err();
    assert!(error.to_string().contains("replica"), "{error}");
}

/// Where `INFO` is denied, a `ROLE` that may answer when asked again, or
/// answers in another shape, fails the pass: either read as "not a
/// replica", and a replica's pass went on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_cannot_be_read_fails_the_pass_where_info_is_denied() {
    for (role, says) in [
        (
            "-LOADING Redis is loading the dataset\r\n",
            "loading the dataset",
        ),
        ("+OK\r\n", "ROLE answered"),
    ] {
        let error = pass_over(INFO_DENIED, role, NO_CLUSTER).await.unwrap_err();
        assert!(error.to_string().contains(says), "{role}: {error}");
    }
}

/// Valkey 8 names the mode `server_mode` (`redis_mode` only with its
/// `extended-redis-compatibility`): one master of a Valkey cluster, its
/// `INFO` allowed, was read as a plain node without asking `CLUSTER NODES`,
/// and its pass, a third of the keys, ended whole. So was any compatible
/// server whose `INFO` names no mode. `CLUSTER NODES` is now asked of every
/// plain node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_master_of_a_cluster_whose_info_names_no_redis_mode_fails_the_pass() {
    let one_of_three = bulk(
        "07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004 myself,master - 0 0 1 \
         connected 0-5460\n",
    );
    for mode in ["server_mode:cluster\r\n", ""] {
        let info = bulk(&format!(
            "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\n{mode}\
             run_id:2f0ba4a7d0f1e1c0a41e2b0c5d9b8e7f6a5c4d3b\r\n# Replication\r\nrole:master\r\n\
             master_replid:8c3b7a1d2e4f6a8b0c1d3e5f7a9b1c2d3e4f5a6b\r\n# Commandstats\r\n\
             cmdstat_info:calls=1,usec=10,usec_per_call=10.00\r\n"
        ));
        match pass_over(&info, MASTER, &one_of_three).await {
            Err(error) => assert!(
                error.to_string().contains("use RedisSource::cluster"),
                "{error}"
            ),
            Ok(keys) => {
                panic!("{mode:?}: a pass over one master of three ended whole, {keys} key(s)")
            }
        }
    }
}

/// A node whose `INFO` says it runs in a cluster but whose ACL refuses
/// `CLUSTER NODES`: the refusal must not read as "not a cluster" (it did,
/// briefly, once `CLUSTER NODES` was asked of every plain node).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_that_refuses_cluster_nodes_fails_the_pass() {
    for mode in [
        "redis_mode:cluster",
        "server_mode:cluster",
        "cluster_enabled:1",
    ] {
        let info = bulk(&format!(
            "# Server\r\n{mode}\r\nrun_id:2f0ba4a7d0f1e1c0a41e2b0c5d9b8e7f6a5c4d3b\r\n\
             # Replication\r\nrole:master\r\n# Commandstats\r\n\
             cmdstat_info:calls=1,usec=10,usec_per_call=10.00\r\n"
        ));
        let refused =
            "-NOPERM User scanner has no permissions to run the 'cluster|nodes' command\r\n";
        match pass_over(&info, MASTER, refused).await {
            Err(error) => assert!(
                error.to_string().contains("CLUSTER NODES was refused"),
                "{mode}: {error}"
            ),
            Ok(keys) => panic!("{mode}: a pass over a cluster node ended whole, {keys} key(s)"),
        }
    }
}

/// A role other than a master's or a replica's (KeyDB's `active-replica`,
/// which takes writes and replicates its peer's) was read as a master's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_role_is_not_a_masters_fails_the_pass() {
    let info = bulk(
        "# Server\r\nrun_id:2f0ba4a7d0f1e1c0a41e2b0c5d9b8e7f6a5c4d3b\r\n# Replication\r\n\
         role:active-replica\r\n",
    );
    match pass_over(&info, MASTER, NO_CLUSTER).await {
        Err(error) => assert!(error.to_string().contains("\"active-replica\""), "{error}"),
        Ok(keys) => panic!("a pass over an active replica ended whole, {keys} key(s)"),
    }
}

const INFO_DENIED: &str = "-NOPERM this user has no permissions to run the 'info' command\r\n";
const MASTER: &str = "*3\r\n$6\r\nmaster\r\n:0\r\n*0\r\n";
const NO_CLUSTER: &str = "-ERR This instance has cluster support disabled\r\n";

fn bulk(text: &str) -> String {
    format!("${}\r\n{text}\r\n", text.len())
}

/// One pass of a source over a stand-in Redis that answers `INFO`, `ROLE`
/// and `CLUSTER …` as told, lists `item:1`, and takes anything else
/// (`CLIENT SETINFO`) with `OK`: the keys it read.
async fn pass_over(info: &str, role: &str, cluster: &str) -> Result<u64, bloomguard::RebuildError> {
    let (info, role, cluster) = (info.to_owned(), role.to_owned(), cluster.to_owned());
    let fake = common::fake_redis::FakeRedis::start(move |command| match command[0].as_slice() {
        b"INFO" => info.clone(),
        b"ROLE" => role.clone(),
        b"CLUSTER" => cluster.clone(),
        b"SCAN" => format!("*2\r\n{}*1\r\n{}", bulk("0"), bulk("item:1")),
        _ => "+OK\r\n".to_owned(),
    })
    .await;
    let guard = common::guard_from(RedisSource::new(fake.client(), "item:*").strip_prefix("item:"));
    guard.rebuild().await.map(|report| report.keys)
}

/// A master holding `item:0..100`, and a replica of it (still syncing,
/// perhaps). Both are stopped when dropped.
fn replica_of_a_populated_master() -> (RedisServer, RedisServer) {
    let master = RedisServer::start();
    master.populate(0..100);
    let port = master.port.to_string();
    let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
    (master, replica)
}

/// A user on the Redis at `port` that may run everything but `INFO`, and
/// a client logged in as it.
fn without_info(port: u16) -> redis::Client {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
    let mut connection = client.get_connection().unwrap();
    let () = redis::cmd("ACL")
        .arg(
            &[
                "SETUSER", "scanner", "on", "nopass", "~*", "&*", "+@all", "-info",
            ][..],
        )
        .query(&mut connection)
        .unwrap();
    // `nopass` takes any password; without one the client sends no `AUTH`.
    redis::Client::open(format!("redis://scanner:any@127.0.0.1:{port}/")).unwrap()
}

/// Loads through a cluster that does not answer (the connection to its
/// seed node stalls): callers queued for one attempt at a connection at a
/// time, each outside its timeout while it waited, so the last of eight
/// concurrent calls returned after eight timeouts. Each returns within its
/// own timeout now, the wait for other callers' attempts included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_through_a_silent_cluster_each_fail_within_their_timeout() {
    let server = RedisServer::start();
    let proxy = common::tcp_proxy::TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    proxy.stall();
    let seed = format!("redis://{}/", proxy.address);
    let client = redis::cluster::ClusterClient::new(vec![seed]).unwrap();
    let timeout = Duration::from_secs(1);
    let loader = RedisLoader::cluster(client).timeout(timeout);
    let started = tokio::time::Instant::now();
    let calls: Vec<_> = (0..8)
        .map(|i| {
            let loader = loader.clone();
            tokio::spawn(async move {
                let loaded = loader.get(i.to_string()).await;
                (loaded, started.elapsed())
            })
        })
        .collect();
    for call in calls {
        let (loaded, took) = call.await.unwrap();
        assert!(loaded.is_err(), "{loaded:?}");
        // Two timeouts at most (the connection, then the command), and
        // room for a slow machine; queued, the last took eight.
        assert!(
            took < timeout * 4,
            "a call took {took:?} with a {timeout:?} timeout"
        );
    }
}

/// The same source and loader over a real Redis Cluster (3 masters, 3
/// replicas) that each test starts.
mod cluster {
    use std::collections::HashSet;
    use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use bloomguard::source::{KeySource, KeyStream};
    use bloomguard::{GuardedLoader, RebuildError};
    use common::guard_from;
    use common::redis_cluster::RedisCluster;
    use futures_util::StreamExt;

    use super::*;

    const KEYS: u64 = 20_000;

    /// Writes `item:{i}` = `value {i}` across the slots, and waits until
    /// every replica holds its master's keys.
    async fn populate(cluster: &RedisCluster) {
        let mut connection = cluster.client().get_async_connection().await.unwrap();
        for chunk in (0..KEYS).collect::<Vec<_>>().chunks(500) {
            let writes = chunk.iter().map(|i| {
                let mut connection = connection.clone();
                async move {
                    let () = redis::cmd("SET")
                        .arg(format!("item:{i}"))
                        .arg(format!("value {i}"))
                        .query_async(&mut connection)
                        .await
                        .unwrap();
                }
            });
            futures_util::future::join_all(writes).await;
        }
        let _: String = redis::cmd("PING")
            .query_async(&mut connection)
            .await
            .unwrap();
        let sizes = || -> Vec<u64> {
            cluster
                .ports
                .iter()
                .map(|&port| {
                    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/")).unwrap();
                    let mut node = client.get_connection().unwrap();
                    redis::cmd("DBSIZE").query::<u64>(&mut node).unwrap()
                })
                .collect()
        };
        // Each of the 3 shards holds its keys once per node.
        let copies = cluster.ports.len() as u64 / 3;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while sizes().iter().sum::<u64>() != copies * KEYS {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the replicas never held their masters' keys: {:?}\n{}",
                sizes(),
                cluster.nodes()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_rebuild_scans_every_master_and_batches_load_across_slots() {
        let cluster = RedisCluster::start();
        populate(&cluster).await;
        // The loader's own source: `SCAN … MATCH item:*` on every master.
        let loader = RedisLoader::cluster(cluster.client()).prefix("item:");
        let guard = guard_from(loader.source().count(500));
        let report = guard.rebuild().await.unwrap();
        assert_eq!(report.keys, KEYS, "every master's keys, once");
        assert!((0..KEYS).all(|i| guard.check(i.to_string()) == Verdict::MaybePresent));

        let gate = GuardedLoader::new(guard, loader);
        // Keys of many slots, and a missing one, in one call.
        let keys: Vec<String> = ["1", "2", "3", "4", "5", "missing", "19999"]
            .map(String::from)
            .to_vec();
        let values = gate.get_many(&keys).await.unwrap();
        let values: Vec<Option<String>> = values
            .into_iter()
            .map(|value| value.map(|bytes| String::from_utf8(bytes).unwrap()))
            .collect();
        let expected: Vec<Option<String>> = keys
            .iter()
            .map(|key| (key != "missing").then(|| format!("value {key}")))
            .collect();
        assert_eq!(values, expected);

        // A key that holds no string, among keys of other slots: `EXISTS`
        // is split by slot and summed like the `MGET`, and the batch fails.
        let mut writes = cluster.client().get_async_connection().await.unwrap();
        let () = redis::cmd("HSET")
            .arg("item:h")
            .arg("field")
            .arg("value")
            .query_async(&mut writes)
            .await
            .unwrap();
        let loader = RedisLoader::cluster(cluster.client()).prefix("item:");
        let batch = loader.get_many(&["1", "h", "missing", "19999"]).await;
        assert!(batch.is_err(), "a batch over a hash answered {batch:?}");
    }

    /// The redis crate runs a cluster connection's driver as a task on the
    /// runtime that made it. A loader and source first used on a runtime
    /// that then stopped (a warm-up runtime, a test's own) failed every
    /// later call with "Unable to send command", and the guard never
    /// rebuilt again. The first call on the serving runtime makes another.
    #[test]
    fn a_cluster_connection_outlives_the_runtime_that_made_it() {
        let cluster = RedisCluster::start();
        let runtime = || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
        };
        let loader = RedisLoader::cluster(cluster.client()).prefix("item:");
        let guard = guard_from(loader.source());
        let warm_up = runtime();
        warm_up.block_on(async {
            let mut writes = cluster.client().get_async_connection().await.unwrap();
            let () = redis::cmd("SET")
                .arg("item:1")
                .arg("one")
                .query_async(&mut writes)
                .await
                .unwrap();
            assert_eq!(guard.rebuild().await.unwrap().keys, 1);
            assert_eq!(loader.get("1").await.unwrap().as_deref(), Some(&b"one"[..]));
        });
        drop(warm_up);

        runtime().block_on(async {
            assert_eq!(
                loader.get("1").await.unwrap().as_deref(),
                Some(&b"one"[..]),
                "a load on the serving runtime"
            );
            assert_eq!(
                guard.rebuild().await.unwrap().keys,
                1,
                "a rebuild on the serving runtime"
            );
        });
    }

    /// A plain source on one node of a cluster scans that node's slots only,
    /// and its cursor ends as if it read them all: a guard built from it
    /// would answer `Absent` for every key the other masters hold.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_plain_source_on_one_cluster_node_fails() {
        let cluster = RedisCluster::start();
        populate(&cluster).await;
        let one_node = redis::Client::open(cluster.urls()[0].as_str()).unwrap();
        let guard =
            refused_as_one_node(RedisSource::new(one_node, "item:*").strip_prefix("item:")).await;
        assert!(guard.is_warming());
    }

    /// A guard rebuilt from `source`, a plain source on one node of a
    /// cluster: its pass failed, naming the source that reads them all.
    async fn refused_as_one_node(source: RedisSource) -> bloomguard::Guard {
        let guard = guard_from(source);
        let error = guard
            .rebuild()
            .await
            .expect_err("one node of a cluster is not the whole store");
        assert!(
            error.to_string().contains("RedisSource::cluster"),
            "{error}"
        );
        guard
    }

    /// The same where the user may not run `INFO`: the source asks
    /// `CLUSTER NODES` whether the node is one of a cluster.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_plain_source_on_one_cluster_node_fails_where_info_is_denied() {
        let cluster = RedisCluster::start();
        populate(&cluster).await;
        refused_as_one_node(RedisSource::new(
            super::without_info(cluster.masters()[0]),
            "item:*",
        ))
        .await;
    }

    /// A cluster of one master (one shard, as a managed service's cluster
    /// mode starts): its one node serves every slot, so its `SCAN` is the
    /// whole store, and a plain source reads it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_plain_source_on_a_one_master_cluster_reads_it_whole() {
        let config =
            std::env::temp_dir().join(format!("bloomguard-one-master-{}.conf", std::process::id()));
        let server = RedisServer::start_with(&[
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            config.to_str().unwrap(),
        ]);
        let mut connection = server.client().get_connection().unwrap();
        let () = redis::cmd("CLUSTER")
            .arg("ADDSLOTSRANGE")
            .arg(0)
            .arg(16383)
            .query(&mut connection)
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut connection)
                .unwrap();
            if info.contains("cluster_state:ok") {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{info}");
            std::thread::sleep(Duration::from_millis(50));
        }
        // One key a command: a cluster refuses an `MSET` across slots.
        for i in 0..100 {
            let () = redis::cmd("SET")
                .arg(format!("item:{i}"))
                .arg(i)
                .query(&mut connection)
                .unwrap();
        }
        let guard = guard_over(
            &server,
            RebuildPolicy::default().write_settle(Duration::ZERO),
        );
        let report = guard.rebuild().await.unwrap();
        assert_eq!(report.keys, 100);
        let _ = std::fs::remove_file(config);
    }

    /// Nodes that announce a hostname (as on Kubernetes): the client names
    /// its connections by what `CLUSTER SLOTS` says (`localhost`), not by
    /// the IP `CLUSTER NODES` lists first, and a pass must reach every
    /// master by that name.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_that_announces_hostnames_is_scanned_whole() {
        let cluster = RedisCluster::start_announcing_hostnames();
        populate(&cluster).await;
        let source = RedisSource::cluster(cluster.client(), "item:*").strip_prefix("item:");
        let guard = guard_from(source);
        let report = guard.rebuild().await.unwrap();
        assert_eq!(report.keys, KEYS, "every master's keys, once");
    }

    /// Nodes configured with `cluster-replica-no-failover yes` carry the
    /// flag `nofailover`, which the source's test for the flag `fail`
    /// matched: every master counted as failed, every pass failed ("a
    /// failover in progress?"), and the guard stayed warming.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cluster_whose_replicas_never_fail_over_is_scanned_whole() {
        let cluster = RedisCluster::start_without_replica_failover();
        populate(&cluster).await;
        let source = RedisSource::cluster(cluster.client(), "item:*").strip_prefix("item:");
        let guard = guard_from(source);
        let report = guard.rebuild().await.unwrap();
        assert_eq!(report.keys, KEYS, "every master's keys, once");
    }

    /// A connection to the cluster node on `port` alone.
    fn node(port: u16) -> redis::Connection {
        redis::Client::open(format!("redis://127.0.0.1:{port}/"))
            .unwrap()
            .get_connection()
            .unwrap()
    }

    /// `CLUSTER SETSLOT slot state…` on `node`.
    fn set_slot(node: &mut redis::Connection, slot: u16, state: &[&str]) {
        redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(state)
            .exec(node)
            .unwrap();
    }

    /// The masters' ids and ports, in the order a pass reads them (by id).
    fn masters_in_pass_order(cluster: &RedisCluster) -> Vec<(String, u16)> {
        let mut masters: Vec<(String, u16)> = cluster
            .masters()
            .into_iter()
            .map(|port| {
                let id = redis::cmd("CLUSTER").arg("MYID").query(&mut node(port));
                (id.unwrap(), port)
            })
            .collect();
        masters.sort();
        masters
    }

    /// Writes `count` keys `item:{tag}:i` into one slot of the master on
    /// `port`; returns the tag and the slot.
    fn keys_in_one_slot(cluster: &RedisCluster, port: u16, count: u64) -> (String, u16) {
        let tag = (0..)
            .map(|i| format!("moved{i}"))
            .find(|tag| cluster.master_of(&format!("item:{{{tag}}}")) == port)
            .unwrap();
        let mut writes = node(port);
        for i in 0..count {
            let () = redis::cmd("SET")
                .arg(format!("item:{{{tag}}}:{i}"))
                .arg("x")
                .query(&mut writes)
                .unwrap();
        }
        let slot = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(&tag)
            .query(&mut writes)
            .unwrap();
        (tag, slot)
    }

    /// A slot migrating between two masters while a pass runs: `MIGRATE`
    /// can move keys from a master not yet scanned to one already scanned,
    /// and the topology stays the same until the slot changes owner. Such a
    /// pass fails; once the slot is stable again, the retry reads every key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pass_during_a_slot_migration_fails_and_the_retry_after_it_succeeds() {
        let cluster = RedisCluster::start();
        populate(&cluster).await;
        let from = cluster.master_of("item:0");
        let to = *cluster
            .masters()
            .iter()
            .find(|&&port| port != from)
            .unwrap();
        let (mut source, mut target) = (node(from), node(to));
        let id = |node: &mut redis::Connection| -> String {
            redis::cmd("CLUSTER").arg("MYID").query(node).unwrap()
        };
        let (source_id, target_id) = (id(&mut source), id(&mut target));
        let slot: u16 = redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg("item:0")
            .query(&mut source)
            .unwrap();
        set_slot(&mut target, slot, &["IMPORTING", &source_id]);
        set_slot(&mut source, slot, &["MIGRATING", &target_id]);

        let guard =
            guard_from(RedisSource::cluster(cluster.client(), "item:*").strip_prefix("item:"));
        let failed = guard.rebuild().await.unwrap_err();
        assert!(
            matches!(failed, RebuildError::Source(_)) && failed.to_string().contains("migrating"),
            "{failed}"
        );
        assert!(guard.is_warming(), "no partial filter was swapped in");

        set_slot(&mut source, slot, &["STABLE"]);
        set_slot(&mut target, slot, &["STABLE"]);
        let report = guard.rebuild().await.unwrap();
        assert_eq!(report.keys, KEYS);
    }

    /// A slot moved whole (its keys migrated, then its owner changed on both
    /// masters) from the master a pass reads last to the one it is reading:
    /// the moved keys may land behind that master's cursor, and no master
    /// shows a migration any more by the end. The two masters' own slots,
    /// read from each at both ends of the pass, differ (the topology read
    /// at the end may too, where the node asked has heard of the move): the
    /// pass fails, and the retry reads every key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_slot_moved_whole_during_a_pass_fails_it() {
        const MOVED: u64 = 2_000;
        let cluster = RedisCluster::start();
        populate(&cluster).await;
        let masters = masters_in_pass_order(&cluster);
        let ((to_id, to), (from_id, from)) = (masters[0].clone(), masters[2].clone());
        // Keys enough in one slot of the last master that some land behind
        // the first one's cursor.
        let (_, slot) = keys_in_one_slot(&cluster, from, MOVED);
        let move_slot = move || -> Act {
            let (to_id, from_id) = (to_id.clone(), from_id.clone());
            Box::pin(async move {
                let (mut target, mut source) = (node(to), node(from));
                set_slot(&mut target, slot, &["IMPORTING", &from_id]);
                set_slot(&mut source, slot, &["MIGRATING", &to_id]);
                let keys: Vec<String> = redis::cmd("CLUSTER")
                    .arg("GETKEYSINSLOT")
                    .arg(slot)
                    .arg(MOVED + 10)
                    .query(&mut source)
                    .unwrap();
                redis::cmd("MIGRATE")
                    .arg(&["127.0.0.1", &to.to_string(), "", "0", "10000", "KEYS"][..])
                    .arg(keys)
                    .exec(&mut source)
                    .unwrap();
                set_slot(&mut target, slot, &["NODE", &to_id]);
                set_slot(&mut source, slot, &["NODE", &to_id]);
            })
        };
        let moved_once = AtomicBool::new(false);
        let guard = guard_from(super::acts_mid_pass(
            RedisSource::cluster(cluster.client(), "item:*")
                .count(100)
                .strip_prefix("item:"),
            move || -> Act {
                if moved_once.swap(true, Ordering::Relaxed) {
                    Box::pin(async {})
                } else {
                    move_slot()
                }
            },
        ));
        match guard.rebuild().await {
            Err(failed) => assert!(matches!(failed, RebuildError::Source(_)), "{failed}"),
            Ok(report) => panic!(
                "a pass across a slot's move was taken as whole ({} of {} keys read)",
                report.keys,
                KEYS + MOVED
            ),
        }
        assert!(guard.is_warming(), "no partial filter was swapped in");
        // Once every node has heard of the move, a pass reads every key.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let report = loop {
            match guard.rebuild().await {
                Ok(report) => break report,
                Err(error) => assert!(
                    tokio::time::Instant::now() < deadline,
                    "no pass succeeded after the move: {error}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(report.keys, KEYS + MOVED);
    }

    /// The keys (prefix stripped) the cluster node on `port` holds itself.
    fn keys_on(port: u16) -> HashSet<Vec<u8>> {
        let mut connection = node(port);
        let mut keys = HashSet::new();
        let mut cursor = 0u64;
        loop {
            let (next, page): (u64, Vec<Vec<u8>>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg("item:*")
                .arg("COUNT")
                .arg(1_000)
                .query(&mut connection)
                .unwrap();
            keys.extend(page.into_iter().map(|key| key["item:".len()..].to_vec()));
            if next == 0 {
                return keys;
            }
            cursor = next;
        }
    }

    /// Keys moved out of the master a pass reads last into the one it reads
    /// first, once that one is half read, and back once the last is half
    /// read (a resharding interrupted and put right): no slot changed owner,
    /// no migration is open by the end, and no run id changed, yet the
    /// moved keys behind both cursors were read on neither master. The
    /// masters' counts of keys taken in by `MIGRATE` differ between the
    /// pass's ends: it fails.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_moved_out_and_back_during_a_pass_fail_it() {
        const MOVED: u64 = 2_000;
        let cluster = RedisCluster::start();
        populate(&cluster).await;
        let masters = masters_in_pass_order(&cluster);
        let ((first_id, first), (last_id, last)) = (masters[0].clone(), masters[2].clone());
        let (first_keys, last_keys) = (keys_on(first), keys_on(last));
        let (tag, slot) = keys_in_one_slot(&cluster, last, MOVED);
        // `MIGRATE` of the slot's keys from `from` to the node on `to`.
        let migrate = move |from: &mut redis::Connection, to: u16| {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(slot)
                .arg(MOVED + 10)
                .query(from)
                .unwrap();
            // The tagged keys, and any of the others in the slot.
            assert!(
                keys.len() as u64 >= MOVED,
                "{} keys in the slot",
                keys.len()
            );
            let () = redis::pipe()
                .cmd("ASKING")
                .ignore()
                .cmd("MIGRATE")
                .arg(&["127.0.0.1", &to.to_string(), "", "0", "10000", "KEYS"][..])
                .arg(keys)
                .ignore()
                .query(from)
                .unwrap();
        };
        let step = Arc::new(AtomicU8::new(0));
        let (read_of_first, read_of_last) = (AtomicU64::new(0), AtomicU64::new(0));
        let acting = Arc::clone(&step);
        let guard = guard_from(super::ActsOnPages {
            source: RedisSource::cluster(cluster.client(), "item:*")
                .count(100)
                .strip_prefix("item:"),
            act: move |_, keys: &[Vec<u8>]| -> Act {
                let counted = |read: &AtomicU64, of: &HashSet<Vec<u8>>| {
                    let here = keys.iter().filter(|key| of.contains(*key)).count() as u64;
                    read.fetch_add(here, Ordering::Relaxed) + here
                };
                let half_of_first =
                    counted(&read_of_first, &first_keys) * 2 >= first_keys.len() as u64;
                let half_of_last = counted(&read_of_last, &last_keys) * 2 >= last_keys.len() as u64;
                let (first_id, last_id) = (first_id.clone(), last_id.clone());
                match acting.load(Ordering::Relaxed) {
                    0 if half_of_first => {
                        acting.store(1, Ordering::Relaxed);
                        let mut target = node(first);
                        let mut source = node(last);
                        set_slot(&mut target, slot, &["IMPORTING", &last_id]);
                        set_slot(&mut source, slot, &["MIGRATING", &first_id]);
                        migrate(&mut source, first);
                    }
                    1 if half_of_last => {
                        acting.store(2, Ordering::Relaxed);
                        // The owner takes its keys back once it no longer
                        // sends the slot's missing keys on (`ASK`).
                        let mut holder = node(first);
                        let mut owner = node(last);
                        set_slot(&mut owner, slot, &["STABLE"]);
                        migrate(&mut holder, last);
                        set_slot(&mut holder, slot, &["STABLE"]);
                    }
                    _ => {}
                }
                Box::pin(async {})
            },
        });
        let outcome = guard.rebuild().await;
        assert_eq!(
            step.load(Ordering::Relaxed),
            2,
            "the keys moved out and back during the pass"
        );
        match outcome {
            Err(failed) => assert!(
                matches!(failed, RebuildError::Source(_)) && failed.to_string().contains("MIGRATE"),
                "{failed}"
            ),
            Ok(report) => {
                let absent = (0..MOVED)
                    .filter(|i| guard.check(format!("{{{tag}}}:{i}")).is_absent())
                    .count();
                panic!(
                    "a pass across keys moved out and back was taken as whole ({} keys read, \
                     duplicates included): {absent} of the {MOVED} moved keys answer absent",
                    report.keys
                )
            }
        }
        let report = guard.rebuild().await.unwrap();
        assert_eq!(report.keys, KEYS + MOVED);
    }

    /// A `SCAN` cursor means nothing to another process: a master restarted
    /// during the pass (the same node, its keys reloaded from its dump) may
    /// list keys in another order, and the keys the new order puts before
    /// the cursor are skipped. The pass fails, and the retry reads every key.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_master_restarted_mid_pass_fails_it() {
        let (guard, error, restarted) =
            a_restarted_master_fails_the_pass(|cluster| cluster.client(), |_| {}).await;
        assert!(restarted, "the pass went past its first page");
        assert!(error.to_string().contains("another run id"), "{error}");
        assert_eq!(guard.rebuild().await.unwrap().keys, KEYS);
    }

    /// The same for a user that may not run `INFO`, whose pass cannot see
    /// the restart (its node id, epoch and slots stay): every pass fails
    /// before its first page, naming `INFO`. Where a refused `INFO` was let
    /// through, the pass was taken as whole and 478 of the restarted
    /// master's 6,679 keys answered `Absent`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_master_restarted_mid_pass_fails_it_where_info_is_denied() {
        let (_, error, restarted) = a_restarted_master_fails_the_pass(
            |cluster| {
                for &port in &cluster.ports {
                    super::without_info(port);
                }
                redis::cluster::ClusterClientBuilder::new(cluster.urls())
                    .username("scanner")
                    .password("any")
                    .build()
                    .unwrap()
            },
            |port| {
                super::without_info(port);
            },
        )
        .await;
        assert!(error.to_string().contains("INFO was refused"), "{error}");
        assert!(!restarted, "the pass failed before its first page");
    }

    /// Rebuilds a guard over a 3-master cluster (no replicas, so that a
    /// master down for a moment is not failed over) through `client`; the
    /// first pass restarts the first master it reads after its first page
    /// (then `prepare(port)`). The pass must fail, and leave the guard
    /// warming; returns the guard, the error and whether the restart
    /// happened (a pass can fail before it).
    async fn a_restarted_master_fails_the_pass(
        client: fn(&RedisCluster) -> redis::cluster::ClusterClient,
        prepare: fn(u16),
    ) -> (bloomguard::Guard, RebuildError, bool) {
        let cluster = RedisCluster::start_with_replicas(0);
        populate(&cluster).await;
        let first = masters_in_pass_order(&cluster)[0].1;
        let first_keys = keys_on(first);
        let source = RedisSource::cluster(client(&cluster), "item:*")
            .count(500)
            .strip_prefix("item:");
        let cluster = Arc::new(Mutex::new(cluster));
        let restarted = Arc::new(AtomicBool::new(false));
        let guard = guard_from(super::acts_mid_pass(source, {
            let (cluster, restarted) = (Arc::clone(&cluster), Arc::clone(&restarted));
            move || -> Act {
                if !restarted.swap(true, Ordering::Relaxed) {
                    cluster.lock().unwrap().restart(first);
                    prepare(first);
                }
                Box::pin(async {})
            }
        }));
        let error = match guard.rebuild().await {
            Err(error) => error,
            Ok(report) => {
                let absent = first_keys
                    .iter()
                    .filter(|key| guard.check(key).is_absent())
                    .count();
                panic!(
                    "a pass across a master's restart was taken as whole ({} keys read): {absent} \
                     of the restarted master's {} keys answer absent",
                    report.keys,
                    first_keys.len()
                )
            }
        };
        assert!(matches!(error, RebuildError::Source(_)), "{error}");
        assert!(guard.is_warming(), "no partial filter was swapped in");
        (guard, error, restarted.load(Ordering::Relaxed))
    }

    /// A source that kills a master after its first page.
    struct KillsAMasterMidPass {
        source: RedisSource,
        cluster: Arc<Mutex<RedisCluster>>,
        killed: AtomicBool,
    }

    impl KeySource for KillsAMasterMidPass {
        fn scan(&self) -> KeyStream<'_> {
            Box::pin(self.source.scan().enumerate().map(|(page, batch)| {
                if page == 0 && !self.killed.swap(true, Ordering::Relaxed) {
                    let mut cluster = self.cluster.lock().unwrap();
                    let masters = cluster.masters();
                    cluster.kill(*masters.last().unwrap());
                }
                batch
            }))
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_master_killed_mid_scan_fails_the_pass_and_the_retry_after_failover_succeeds() {
        let cluster = RedisCluster::start();
        populate(&cluster).await;
        let cluster = Arc::new(Mutex::new(cluster));
        let guard = guard_from(KillsAMasterMidPass {
            source: RedisSource::cluster(cluster.lock().unwrap().client(), "item:*")
                .count(500)
                .strip_prefix("item:"),
            cluster: Arc::clone(&cluster),
            killed: AtomicBool::new(false),
        });
        let failed = guard.rebuild().await.unwrap_err();
        assert!(matches!(failed, RebuildError::Source(_)), "{failed}");
        assert!(guard.is_warming(), "no partial filter was swapped in");

        let healed = Arc::clone(&cluster);
        tokio::task::spawn_blocking(move || healed.lock().unwrap().wait_until_healed())
            .await
            .unwrap();
        // The replica promoted holds the dead master's keys.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let report = loop {
            match guard.rebuild().await {
                Ok(report) => break report,
                Err(error) => {
                    assert!(tokio::time::Instant::now() < deadline, "{error}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        assert_eq!(report.keys, KEYS);

        // The loader follows the failover too.
        let loader = RedisLoader::cluster(cluster.lock().unwrap().client()).prefix("item:");
        let keys: Vec<String> = (0..100).map(|i| i.to_string()).collect();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        let values = loop {
            match loader.get_many(&keys).await {
                Ok(values) => break values,
                Err(error) => {
                    assert!(tokio::time::Instant::now() < deadline, "{error}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        assert!(
            values.iter().all(Option::is_some),
            "every key loaded after the failover"
        );
    }
}
