//! The product modes: `Verify::Sample` and `Verify::None` trust "maybe"
//! answers and report the over-filtering they cost; shadow mode asks the
//! backend every time and counts the `Absent` answers it contradicts.

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use bloomguard::layer::PathKey;
use bloomguard::{Guard, GuardLayer, GuardedLoader, Verify};
use tower::{Layer, ServiceExt, service_fn};

use crate::common::captured_log::CapturedLog;

const STORED: usize = 10_000;
const ABSENT: usize = 100_000;

/// A guard over `STORED` keys `seen:i` at 1 %, seeded so every run is the same.
fn seen_guard() -> Guard {
    let guard = Guard::builder()
        .expected_items(STORED as u64)
        .false_positive_rate(0.01)
        .seed(0x5eed)
        .build()
        .unwrap();
    for i in 0..STORED {
        guard.insert(format!("seen:{i}"));
    }
    guard
}

/// The store behind the guard, counting the keys it is asked about.
#[derive(Clone, Default)]
struct CountingStore {
    asked: Arc<AtomicUsize>,
}

impl CountingStore {
    fn loader(&self) -> impl bloomguard::Loader<String, Value = (), Error = Infallible> + use<> {
        let asked = Arc::clone(&self.asked);
        move |key: String| {
            asked.fetch_add(1, Ordering::Relaxed);
            async move { Ok::<_, Infallible>(key.starts_with("seen:").then_some(())) }
        }
    }

    fn asked(&self) -> usize {
        self.asked.load(Ordering::Relaxed)
    }
}

/// Asks `seen` about every stored key and `ABSENT` others, 120 at a time;
/// returns how many of the others were answered "seen" (over-filtered).
async fn ask_everything<L>(seen: &GuardedLoader<String, L>) -> usize
where
    L: bloomguard::Loader<String, Value = (), Error = Infallible>,
{
    let stored = (0..STORED).map(|i| format!("seen:{i}"));
    let others = (0..ABSENT).map(|i| format!("unseen:{i}"));
    let keys: Vec<String> = stored.chain(others).collect();
    let mut over_filtered = 0;
    for batch in keys.chunks(120) {
        let answers = seen.contains_many(batch).await.unwrap();
        for (key, answer) in batch.iter().zip(answers) {
            if key.starts_with("seen:") {
                assert!(answer, "false negative for {key}");
            } else if answer {
                over_filtered += 1;
            }
        }
    }
    over_filtered
}

/// An estimate within 35 % of the truth: a sample of a few hundred
/// positives, or the fill's model, is that close at these sizes.
fn assert_near(what: &str, estimate: f64, truth: f64) {
    assert!(
        (estimate - truth).abs() < 0.35 * truth,
        "{what}: estimated {estimate}, truly {truth}"
    );
}

#[tokio::test]
async fn sampled_verification_asks_a_sample_and_estimates_what_it_hid() {
    let guard = seen_guard();
    let store = CountingStore::default();
    let seen = GuardedLoader::new(guard.clone(), store.loader())
        .verify(Verify::Sample(0.05))
        .unwrap();

    let over_filtered = ask_everything(&seen).await;

    let stats = guard.stats();
    let positives = stats.checks.maybe_present as usize;
    assert!(
        positives > STORED,
        "every stored key passes, and some others"
    );
    // Only the sample reached the store, and every stored key answered "seen".
    let asked = store.asked();
    assert!(
        asked * 10 < positives,
        "{asked} of {positives} positives were asked"
    );
    assert_eq!(stats.unverified_positives as usize + asked, positives);
    // The hidden absent keys are estimated from the sample's false share.
    assert!(over_filtered > 0);
    assert_near(
        "over-filtered keys",
        stats.over_filtered,
        over_filtered as f64,
    );
    let true_rate = over_filtered as f64 / ABSENT as f64;
    assert_near(
        "over-filtering rate",
        stats.over_filtering_rate.unwrap(),
        true_rate,
    );
    // The observed false-positive rate stays measured, trusted ones included.
    let true_fpr = (over_filtered + stats.false_positives as usize) as f64 / ABSENT as f64;
    let observed = stats.observed_fpr.expect("measured from the sample");
    assert_near("observed FPR", observed, true_fpr);
}

#[tokio::test]
async fn no_verification_never_asks_and_estimates_from_the_fill() {
    let guard = seen_guard();
    let store = CountingStore::default();
    let seen = GuardedLoader::new(guard.clone(), store.loader())
        .verify(Verify::None)
        .unwrap();

    let over_filtered = ask_everything(&seen).await;

    let stats = guard.stats();
    assert_eq!(store.asked(), 0);
    assert_eq!(stats.unverified_positives, stats.checks.maybe_present);
    assert_eq!(
        stats.observed_fpr, None,
        "nothing verified, nothing observed"
    );
    assert_near(
        "over-filtered keys",
        stats.over_filtered,
        over_filtered as f64,
    );
}

#[tokio::test]
async fn values_always_come_from_the_backend() {
    let guard = seen_guard();
    let store = CountingStore::default();
    let seen = GuardedLoader::new(guard.clone(), store.loader())
        .verify(Verify::None)
        .unwrap();
    assert_eq!(seen.get("seen:1").await.unwrap(), Some(()));
    let keys = ["seen:2".to_string(), "seen:3".to_string()];
    assert_eq!(seen.get_many(&keys).await.unwrap(), [Some(()), Some(())]);
    assert_eq!(store.asked(), 3);
    assert_eq!(guard.stats().unverified_positives, 0);
}

#[test]
fn a_sample_outside_zero_to_one_is_refused() {
    let guard = seen_guard();
    for fraction in [0.0, -0.1, 1.5, f64::NAN] {
        let loader = GuardedLoader::new(guard.clone(), CountingStore::default().loader());
        let error = loader.verify(Verify::Sample(fraction)).unwrap_err();
        assert!(error.to_string().contains("Verify::Sample"), "{error}");
    }
}

#[test]
fn shadow_mode_asks_every_time_and_counts_what_would_have_been_wrong() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let guard = seen_guard();
    let store = CountingStore::default();
    let seen = GuardedLoader::new(guard.clone(), store.loader()).shadow();
    let captured = CapturedLog::default();
    tracing::subscriber::with_default(captured.subscriber(), || {
        runtime.block_on(async {
            // Stored behind the guard's back: the backend has it, the guard not.
            let forgotten = "seen:written-behind-its-back".to_string();
            assert!(seen.contains(&forgotten).await.unwrap());
            assert_eq!(seen.get(&forgotten).await.unwrap(), Some(()));
            let others: Vec<String> = (0..1_000).map(|i| format!("unseen:{i}")).collect();
            let answers = seen.contains_many(&others).await.unwrap();
            assert!(answers.iter().all(|&answer| !answer));
        });
    });

    let stats = guard.stats();
    assert_eq!(store.asked(), 1_002, "every key went to the backend");
    assert_eq!(stats.would_be_false_negatives, 2);
    assert_eq!(stats.shadowed_absent, stats.checks.absent);
    assert!(stats.shadowed_absent >= 2 + 900, "{stats:?}");
    let log = captured.text();
    assert!(log.contains("would-be false negative"), "{log}");
    assert!(
        !log.contains("written-behind"),
        "the key reached the log: {log}"
    );
}

type ResponseBody = String;

fn seen_handler(
    calls: Arc<AtomicUsize>,
) -> impl tower::Service<
    Request<Body>,
    Response = Response<ResponseBody>,
    Error = Infallible,
    Future: Send,
> + Clone {
    service_fn(move |request: Request<Body>| {
        calls.fetch_add(1, Ordering::Relaxed);
        let seen = request.uri().path().starts_with("/seen/seen:");
        let mut response = Response::new(String::from("from the handler"));
        if !seen {
            *response.status_mut() = StatusCode::NOT_FOUND;
        }
        async move { Ok::<_, Infallible>(response) }
    })
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).unwrap()
}

fn seen_route() -> PathKey {
    PathKey::route("/seen/{pair}").method(Method::GET)
}

#[tokio::test]
async fn the_http_layer_trusts_positives_as_its_verify_policy_says() {
    let guard = seen_guard();
    let calls = Arc::new(AtomicUsize::new(0));
    let service = GuardLayer::for_http(guard.clone(), seen_route())
        .verify(Verify::Sample(0.05), || {
            Response::new(String::from("trusted"))
        })
        .unwrap()
        .layer(seen_handler(Arc::clone(&calls)));

    let mut trusted = 0;
    for i in 0..2_000 {
        let response = service
            .clone()
            .oneshot(get(&format!("/seen/seen:{i}")))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK, "seen:{i}");
        trusted += usize::from(response.body() == "trusted");
    }
    let asked = calls.load(Ordering::Relaxed);
    assert_eq!(trusted + asked, 2_000);
    assert!(asked > 0 && asked < 200, "{asked} of 2000 were asked");
    let stats = guard.stats();
    assert_eq!(stats.unverified_positives as usize, trusted);
    assert_eq!(stats.found as usize, asked);

    let refused = GuardLayer::for_http(guard, seen_route())
        .verify(Verify::Sample(2.0), || Response::new(String::new()));
    assert!(refused.is_err());
}

#[tokio::test]
async fn the_http_layer_in_shadow_mode_calls_the_handler_for_absent_keys() {
    let guard = seen_guard();
    let calls = Arc::new(AtomicUsize::new(0));
    let service = GuardLayer::for_http(guard.clone(), seen_route())
        .shadow()
        .layer(seen_handler(Arc::clone(&calls)));
    let response = service
        .clone()
        .oneshot(get("/seen/seen:not-inserted"))
        .await
        .unwrap();
    assert_eq!(response.body(), "from the handler");
    let response = service.oneshot(get("/seen/unseen:1")).await.unwrap();
    assert_eq!(response.body(), "from the handler");
    assert_eq!(calls.load(Ordering::Relaxed), 2);
    let stats = guard.stats();
    assert_eq!(stats.would_be_false_negatives, 1);
    assert_eq!(stats.shadowed_absent, 2);
}

#[tokio::test]
async fn the_guards_own_404_can_carry_a_header() {
    let guard = seen_guard();
    let marker = (
        HeaderName::from_static("x-bloomguard"),
        HeaderValue::from_static("absent"),
    );
    let service = GuardLayer::for_http(guard.clone(), seen_route())
        .with_absent_header(marker.0.clone(), marker.1.clone())
        .layer(seen_handler(Arc::new(AtomicUsize::new(0))));
    let mut by_guard = 0;
    let mut by_handler = HashSet::new();
    for i in 0..1_000 {
        let response = service
            .clone()
            .oneshot(get(&format!("/seen/unseen:{i}")))
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND);
        match response.headers().get(&marker.0) {
            Some(value) => {
                assert_eq!(value, marker.1);
                assert!(response.body().is_empty());
                by_guard += 1;
            }
            None => {
                assert_eq!(response.body(), "from the handler");
                by_handler.insert(i);
            }
        }
    }
    // The handler's 404s are exactly the guard's false positives.
    assert_eq!(by_handler.len() as u64, guard.stats().false_positives);
    assert_eq!(by_guard as u64, guard.stats().checks.absent);
}
