//! The README's main job, `examples/seen_items`, run end to end at a small
//! scale: the in-memory store with rebuilds and with rotation, and a real
//! Redis. A false negative makes the run itself fail (every request is
//! audited against the ground truth here).

#[allow(dead_code, unreachable_pub)]
#[path = "../examples/seen_items/main.rs"]
mod seen_items;

mod common;

use std::path::{Path, PathBuf};

use clap::{CommandFactory, FromArgMatches};
use common::redis_server::RedisServer;

/// The demo's flags as a test gives them. The store URLs' environment
/// variables are not read: a developer's shell that sets `DATABASE_URL`
/// would otherwise point the in-memory runs at that database.
fn parse<'a>(args: impl IntoIterator<Item = &'a str>) -> Result<seen_items::Args, clap::Error> {
    let command = ["redis_url", "redis_cluster_urls", "database_url"]
        .into_iter()
        .fold(seen_items::Args::command(), |command, store| {
            command.mut_arg(store, |arg| arg.env(None))
        });
    seen_items::Args::from_arg_matches(&command.try_get_matches_from(args)?)
}

fn chart_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("bloomguard-{name}-{}.svg", std::process::id()))
}

/// A small run, paced so that a slow machine keeps up: 1,500 requests/s of
/// 120 candidates for 3 s, each showing the user 8 new items, so the history
/// grows by ~35 % and drifts past the rebuild threshold.
fn small_run(chart: &Path, extra: &[&str]) -> seen_items::Args {
    let mut args = vec![
        "seen_items",
        "--users",
        "5000",
        "--items",
        "50000",
        "--history",
        "100000",
        "--rate",
        "1500",
        "--duration",
        "3s",
        "--concurrency",
        "16",
        "--new-seen",
        "8",
        "--audit-every",
        "1",
        "--quiet",
        "--chart",
    ];
    args.push(chart.to_str().unwrap());
    args.extend_from_slice(extra);
    parse(args).unwrap()
}

fn run(args: seen_items::Args) -> seen_items::report::Outcome {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime
        .block_on(seen_items::run(args))
        .unwrap_or_else(|error| panic!("the demo failed: {error}"))
}

/// The run met what a false negative needs to show: answers for items the
/// store held (the run fails on one answered unseen), and a sweep of the
/// seen items over every guard at its end (the same; an item expired by
/// the ground truth and answered absent is asked of the store).
fn assert_the_audit_had_something_to_catch(guarded: &seen_items::replay::Phase, answers: u64) {
    assert!(
        guarded.audited_seen >= answers,
        "{} answers audited for items the store held",
        guarded.audited_seen
    );
    assert!(
        guarded.swept >= 5_000,
        "{} seen items swept over the guards",
        guarded.swept
    );
}

fn assert_the_gate_pays_off(outcome: &seen_items::report::Outcome) {
    let guarded = &outcome.guarded;
    assert!(guarded.requests >= 4_000, "{} requests", guarded.requests);
    assert_the_audit_had_something_to_catch(guarded, 1_000);
    assert!(
        outcome.avoided() >= 0.95,
        "only {:.3} of the lookups avoided",
        outcome.avoided()
    );
    assert!(
        outcome.memory_ratio() <= 1.0 / 20.0,
        "the filter takes {:.3} of the exact set",
        outcome.memory_ratio()
    );
    let baseline = outcome.baseline.as_ref().expect("a baseline replay");
    assert_eq!(
        baseline.store_keys, baseline.checks,
        "without the guard every check is a lookup"
    );
}

/// The audit is no formality: seen items written to the store without
/// the guard's insert (a write path that bypasses the guard; the demo's
/// test-only `--bypass-guard-every`) are answered unseen when they come
/// back, and the run fails naming a false negative.
#[test]
fn a_write_that_bypasses_the_guard_fails_the_run_as_a_false_negative() {
    let chart = chart_path("bypass");
    let args = small_run(&chart, &["--bypass-guard-every", "10", "--no-baseline"]);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let error = runtime
        .block_on(seen_items::run(args))
        .expect_err("a run whose guard missed writes passed its audit");
    assert!(error.to_string().contains("false negative"), "{error}");
}

#[test]
fn the_gate_avoids_lookups_and_a_rebuild_brings_drift_back() {
    let chart = chart_path("rebuild");
    let outcome = run(small_run(&chart, &[]));
    assert_the_gate_pays_off(&outcome);
    let guarded = &outcome.guarded;
    assert!(
        outcome.history_after as f64 >= outcome.history_before as f64 * 1.25,
        "the history grew: {} → {}",
        outcome.history_before,
        outcome.history_after
    );
    let first_rebuild = guarded
        .events
        .iter()
        .find(|event| event.rebuild)
        .expect("drift triggered a rebuild");
    let drift_at = |at: f64| {
        guarded
            .timeline
            .iter()
            .take_while(|sample| sample.at <= at)
            .last()
            .map_or(0.0, |sample| sample.estimated_drift)
    };
    let before = drift_at(first_rebuild.at - 0.05);
    let after = guarded
        .timeline
        .iter()
        .find(|sample| sample.at > first_rebuild.at)
        .unwrap()
        .estimated_drift;
    assert!(before > 1.0, "drift before the rebuild: {before}");
    assert!(after < before * 0.8, "drift fell from {before} to {after}");
    // Drift is allowed up to the rebuild threshold (1.1) while a rebuild runs.
    let observed = guarded.guard_fpr.expect("measured");
    assert!(observed <= 0.011, "observed FPR {observed}");
    assert_eq!(guarded.hidden, 0, "every maybe was verified");

    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.starts_with("<svg"), "an SVG picture");
    for label in ["fill ratio", "estimated FPR", "observed FPR", "rebuild"] {
        assert!(svg.contains(label), "the picture shows {label}");
    }
    std::fs::remove_file(chart).unwrap();
}

/// A machine slower than the pace: 50,000 requests fall due in 50 ms and
/// take seconds. The requests run past the deadline, and the report must
/// follow them: the drift they cause and the rebuild it triggers are in the
/// timeline. (Cut at the deadline, it missed them; on a loaded machine the
/// small run above lagged enough to miss its rebuild now and then.)
#[test]
fn a_run_slower_than_its_pace_still_reports_its_rebuild() {
    let chart = chart_path("lagging");
    let args = small_run(&chart, &["--rate", "1000000", "--duration", "50ms"]);
    let outcome = run(args);
    let guarded = &outcome.guarded;
    assert_eq!(
        guarded.requests, 50_000,
        "every request due before the deadline ran"
    );
    assert!(
        guarded.elapsed > std::time::Duration::from_millis(50),
        "the run lagged its pace: {:?}",
        guarded.elapsed
    );
    assert!(
        guarded.events.iter().any(|event| event.rebuild),
        "the drift of the late requests triggered a rebuild, and the report shows it"
    );
    let last = guarded.timeline.last().expect("samples").at;
    assert!(
        last >= guarded.elapsed.as_secs_f64() * 0.9,
        "the timeline follows the requests to their end: last sample at {last:.2} s of {:.2} s",
        guarded.elapsed.as_secs_f64()
    );
    std::fs::remove_file(chart).unwrap();
}

#[test]
fn rotation_forgets_no_key_the_store_still_holds() {
    let chart = chart_path("rotate");
    let outcome = run(small_run(
        &chart,
        &["--lifecycle", "rotate", "--window", "1s", "--no-baseline"],
    ));
    let guarded = &outcome.guarded;
    // A 1 s window holds only the last second's items: most candidates
    // drawn from a user's history have expired, ~0.3 a request are held.
    assert_the_audit_had_something_to_catch(guarded, 200);
    let rotations = guarded.events.iter().filter(|event| !event.rebuild).count();
    assert!(
        rotations >= 2,
        "{rotations} rotations in 3 s of 0.5 s periods"
    );
    assert!(outcome.avoided() >= 0.9, "{}", outcome.avoided());
    let explained = outcome
        .conclusions()
        .iter()
        .any(|line| line.starts_with("why the observed FPR") && line.contains("--window"));
    assert!(explained, "the report explains the FPR of rotation");
    std::fs::remove_file(chart).unwrap();
}

#[test]
fn the_gate_runs_against_real_redis() {
    let server = RedisServer::start();
    let chart = chart_path("redis");
    let url = server.url();
    let outcome = run(small_run(&chart, &["--redis-url", &url]));
    assert_the_gate_pays_off(&outcome);
    let guarded = &outcome.guarded;
    assert!(
        guarded.store_calls <= guarded.requests,
        "at most one MGET per request"
    );
    assert!(
        guarded.events.iter().any(|event| event.rebuild),
        "a rebuild from SCAN"
    );
    std::fs::remove_file(chart).unwrap();
}

/// Redis refusing writes mid-run (out of memory under `noeviction`) while
/// it still answers reads: the writer stopped with the error, the workers
/// blocked on a full queue it no longer drained, and the run never ended.
/// It ends now, with the store's error.
#[test]
fn a_store_that_refuses_writes_ends_the_run_with_its_error() {
    let server = RedisServer::start();
    let chart = chart_path("refused-writes");
    let url = server.url();
    let mut args = small_run(&chart, &["--redis-url", &url]);
    args.duration = std::time::Duration::from_secs(30);
    let (ended, outcome) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _ = ended.send(
            runtime
                .block_on(seen_items::run(args))
                .err()
                .map(|error| error.to_string()),
        );
    });
    let mut connection = server.client().get_connection().unwrap();
    // Once the guarded phase writes, past the 100,000 pairs of history
    // (a `SET` each).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while server.command_calls("set") < 110_000 {
        assert!(std::time::Instant::now() < deadline, "the run never wrote");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Under the default policy, `noeviction` (one parameter a `CONFIG SET`
    // before Redis 7).
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("1")
        .query(&mut connection)
        .unwrap();
    let error = outcome
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the run ended after its store refused writes")
        .expect("the run failed");
    assert!(error.to_lowercase().contains("oom"), "{error}");
    let _ = std::fs::remove_file(chart);
}

#[cfg(feature = "postgres")]
#[test]
fn the_gate_runs_against_real_postgres() {
    let server = common::postgres_server::PostgresServer::start();
    let chart = chart_path("postgres");
    let url = server.url();
    let outcome = run(small_run(&chart, &["--database-url", &url]));
    assert_the_gate_pays_off(&outcome);
    let guarded = &outcome.guarded;
    assert!(
        guarded.store_calls <= guarded.requests,
        "at most one query per request"
    );
    assert!(
        guarded.events.iter().any(|event| event.rebuild),
        "a rebuild by keyset pages"
    );
    std::fs::remove_file(chart).unwrap();

    let refused = parse([
        "seen_items",
        "--database-url",
        &url,
        "--lifecycle",
        "rotate",
    ])
    .unwrap()
    .check()
    .unwrap_err();
    assert!(refused.to_string().contains("expires keys"), "{refused}");
}

/// The guard's rebuilds run on the maintenance thread's runtime, and a sqlx
/// connection works only while the runtime that opened it runs: one a
/// rebuild opened into the requests' pool failed the next request after the
/// maintenance runtime stopped ("A Tokio 1.x context was found, but it is
/// being shutdown"), as the baseline run after the guarded one did.
#[cfg(feature = "postgres")]
#[test]
fn a_rebuild_on_the_maintenance_runtime_leaves_the_requests_a_working_pool() {
    use bloomguard::KeySource as _;
    use futures_util::TryStreamExt as _;

    let server = common::postgres_server::PostgresServer::start();
    let requests = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // A pool connection dropped outside a runtime panics, and during a
    // failure's unwinding that aborts the binary.
    let _in_requests = requests.enter();
    let store = requests
        .block_on(seen_items::store::PgStore::open(&server.url()))
        .unwrap();
    requests
        .block_on(store.write(&["before".to_owned()]))
        .unwrap();
    // Every connection the requests' pool opened, held as requests would
    // hold them, so that a pass sharing the pool would open one of its own.
    let requests_pool = store.requests_pool().clone();
    let held = requests.block_on(async {
        common::wait_until("the requests' connections back in their pool", || {
            requests_pool.num_idle() >= requests_pool.size() as usize
        })
        .await;
        let mut held = Vec::new();
        for _ in 0..requests_pool.size() {
            held.push(requests_pool.acquire().await.unwrap());
        }
        held
    });
    let opened_by_requests = requests_pool.size();

    let source = store.source();
    let rebuilds_pool = store.rebuilds_pool().clone();
    let keys = std::thread::spawn(move || {
        let maintenance = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        maintenance.block_on(async {
            let batches: Vec<_> = source
                .scan()
                .try_collect()
                .await
                .unwrap_or_else(|error| panic!("the pass: {error}"));
            // The runtime runs on, as the maintenance task's does, until the
            // pass's connection is back in its pool.
            common::wait_until("the pass's connection back in its pool", || {
                rebuilds_pool.num_idle() > 0
            })
            .await;
            batches.iter().map(|batch| batch.len()).sum::<usize>()
        })
    })
    .join()
    .unwrap();
    assert_eq!(keys, 1, "the pass listed the stored key");

    // Whether a request meets the stopped runtime's connection at once
    // depends on tokio's cached readiness; the pool's size says it is there.
    assert_eq!(
        requests_pool.size(),
        opened_by_requests,
        "the pass opened a connection into the requests' pool on the maintenance runtime"
    );
    drop(held);
    for _ in 0..=opened_by_requests {
        requests
            .block_on(store.write(&["after".to_owned()]))
            .unwrap_or_else(|error| {
                panic!("a request after the maintenance runtime stopped: {error}")
            });
    }
}

#[test]
fn the_gate_runs_against_a_real_redis_cluster() {
    let cluster = common::redis_cluster::RedisCluster::start();
    let chart = chart_path("cluster");
    let urls = cluster.urls().join(",");
    let outcome = run(small_run(
        &chart,
        &["--redis-cluster-urls", &urls, "--no-baseline"],
    ));
    let guarded = &outcome.guarded;
    assert_the_audit_had_something_to_catch(guarded, 1_000);
    assert!(
        guarded.store_calls <= guarded.requests,
        "at most one MGET per request, split by the cluster connection"
    );
    assert!(
        guarded.events.iter().any(|event| event.rebuild),
        "a rebuild from every master's SCAN"
    );

    // Three instances as one fleet over the same cluster (the store starts
    // over), every request audited as on one node.
    let outcome = run(small_run(
        &chart,
        &[
            "--redis-cluster-urls",
            &urls,
            "--instances",
            "3",
            "--no-baseline",
        ],
    ));
    assert_three_instances_ran_as_one_fleet(&outcome);
    std::fs::remove_file(chart).unwrap();
}

/// A run of `--instances 3` with every request audited (a member answering
/// "unseen" for an item whose fleet write completed fails the run): it did
/// the work, and every write batch was acknowledged by the fleet.
fn assert_three_instances_ran_as_one_fleet(outcome: &seen_items::report::Outcome) {
    let guarded = &outcome.guarded;
    assert_the_audit_had_something_to_catch(guarded, 1_000);
    let fleet = guarded.fleet.as_ref().expect("the fleet's figures");
    assert_eq!(fleet.instances, 3);
    assert!(
        fleet.acknowledgements.len() as u64 >= guarded.written / 512,
        "every write batch was acknowledged"
    );
    assert!(
        guarded.events.iter().any(|event| event.rebuild),
        "the first instance rebuilt, or took another member's rebuilt set"
    );
}

#[test]
fn three_instances_as_one_fleet_keep_every_seen_item_seen() {
    let server = RedisServer::start();
    let chart = chart_path("fleet");
    let url = server.url();
    let outcome = run(small_run(
        &chart,
        &["--redis-url", &url, "--instances", "3", "--no-baseline"],
    ));
    assert_three_instances_ran_as_one_fleet(&outcome);
    std::fs::remove_file(chart).unwrap();

    let refused = parse(["seen_items", "--instances", "2"])
        .unwrap()
        .check()
        .unwrap_err();
    assert!(refused.to_string().contains("REDIS_URL"), "{refused}");
}

#[test]
fn sampled_verification_trusts_most_positives_and_measures_what_it_hides() {
    let chart = chart_path("sample");
    let outcome = run(small_run(
        &chart,
        &["--verify", "sample:0.01", "--no-baseline"],
    ));
    let guarded = &outcome.guarded;
    assert_the_audit_had_something_to_catch(guarded, 1_000);
    let lookups_per_request = guarded.store_keys as f64 / guarded.requests as f64;
    assert!(
        lookups_per_request < 0.5,
        "{lookups_per_request} store lookups per request"
    );
    // Unseen items hidden: about the FPR, measured against the truth and
    // estimated by the guard from its sample.
    let hidden = guarded.hidden_rate().expect("unseen candidates audited");
    assert!(hidden > 0.0 && hidden <= 0.02, "hidden {hidden}");
    let estimated = guarded
        .estimated_over_filtering
        .expect("the guard estimates it");
    assert!(
        estimated > hidden / 2.0 && estimated < hidden * 2.0,
        "estimated {estimated}, audited {hidden}"
    );
    let svg = std::fs::read_to_string(&chart).unwrap();
    for label in ["verify sample:0.01", "unseen items hidden (estimated)"] {
        assert!(svg.contains(label), "the picture shows {label}");
    }
    assert!(outcome.conclusions()[1].starts_with("verify sample:0.01"));
    std::fs::remove_file(chart).unwrap();
}

#[test]
fn without_verification_the_store_is_never_asked() {
    let chart = chart_path("none");
    let outcome = run(small_run(&chart, &["--verify", "none", "--no-baseline"]));
    let guarded = &outcome.guarded;
    assert_eq!(guarded.store_keys, 0);
    assert_the_audit_had_something_to_catch(guarded, 1_000);
    let hidden = guarded.hidden_rate().unwrap();
    assert!(hidden > 0.0 && hidden <= 0.02, "hidden {hidden}");
    assert!(guarded.estimated_over_filtering.is_some());
    std::fs::remove_file(chart).unwrap();
}

#[test]
fn bad_flags_are_refused_before_the_history_is_drawn() {
    let chart = chart_path("flags");
    let refused = |extra: &[&str], says: &str| {
        let error = small_run(&chart, extra).check().unwrap_err().to_string();
        assert!(error.contains(says), "{extra:?}: {error}");
    };
    // The guard's own options, checked by the guard's builder up front.
    refused(&["--fpr", "2"], "false_positive_rate");
    refused(&["--drift", "0.5"], "drift");
    refused(&["--audit-every", "0"], "--audit-every");
    assert!(small_run(&chart, &["--history", "0"]).check().is_ok());
    let unparsed = parse(["seen_items", "--verify", "sample:2"]);
    assert!(unparsed.is_err(), "a sample fraction above 1");
}

#[test]
fn a_cold_start_builds_from_an_empty_store_and_grows() {
    let chart = chart_path("cold");
    let outcome = run(small_run(&chart, &["--history", "0", "--no-baseline"]));
    let guarded = &outcome.guarded;
    assert_eq!(outcome.history_before, 0);
    assert_the_audit_had_something_to_catch(guarded, 1_000);
    assert!(outcome.history_after > 10_000, "{}", outcome.history_after);
    assert!(guarded.events.iter().any(|event| event.rebuild));
    assert!(outcome.conclusions()[2].contains("cold start"));
    std::fs::remove_file(chart).unwrap();
}
