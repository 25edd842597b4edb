//! The `Absent` paths of `GuardService` and `GuardedLoader` allocate
//! nothing, and a batch of absent keys only its answer: a counting global
//! allocator watches the calls.

use std::convert::Infallible;
use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};

use bloomguard::layer::PathKey;
use bloomguard::{Guard, GuardLayer, GuardedLoader};
use http::{Request, Response, StatusCode, Uri};
use tower::{Layer, Service, service_fn};

use crate::common::alloc_meter::measure;

fn allocations_in(body: impl FnOnce()) -> usize {
    measure(body).1.allocations
}

/// Polls a future that is ready at once, without a runtime.
fn ready_now<F: Future>(future: F) -> F::Output {
    let mut context = Context::from_waker(Waker::noop());
    match pin!(future).poll(&mut context) {
        Poll::Ready(output) => output,
        Poll::Pending => panic!("an absent key is answered at once"),
    }
}

#[test]
fn the_loader_form_answers_absent_keys_without_allocating() {
    let guard = Guard::builder()
        .expected_items(10_000)
        .seed(0x5eed)
        .build()
        .unwrap();
    guard.insert("item:1");
    let mut service =
        GuardLayer::for_loader(guard.clone()).layer(service_fn(|_key: &'static str| async {
            Ok::<Option<u32>, Infallible>(Some(1))
        }));
    let keys: Vec<&'static str> = (0..10_000)
        .map(|i| &*Box::leak(format!("absent:{i}").into_boxed_str()))
        .collect();
    // Warm-up: a thread's first check claims its read-section record, which
    // may allocate one.
    let _ = ready_now(service.call(keys[0]));

    let mut absent = 0;
    let allocations = allocations_in(|| {
        for key in &keys {
            if guard.check(key).is_absent() {
                assert_eq!(ready_now(service.call(key)).unwrap(), None);
                absent += 1;
            }
        }
    });
    assert!(absent > 9_800, "{absent} absent answers");
    assert_eq!(
        allocations, 0,
        "{allocations} allocations for {absent} absent answers"
    );
}

#[test]
fn the_http_form_answers_404_without_allocating() {
    let guard = Guard::builder()
        .expected_items(10_000)
        .seed(0x5eed)
        .build()
        .unwrap();
    let mut service = GuardLayer::for_http(guard.clone(), PathKey::route("/items/{id}")).layer(
        service_fn(|_request: Request<String>| async {
            Ok::<_, Infallible>(Response::new(String::from("found")))
        }),
    );
    let requests: Vec<Request<String>> = (0..1_000)
        .map(|i| {
            let path: &'static str = Box::leak(format!("/items/absent-{i}").into_boxed_str());
            let mut request = Request::new(String::new());
            *request.uri_mut() = Uri::from_static(path);
            request
        })
        .collect();
    // Warm-up: a thread's first check claims its read-section record, which
    // may allocate one.
    let mut requests = requests.into_iter();
    for request in requests.by_ref().take(1) {
        let _ = ready_now(service.call(request));
    }

    let allocations = allocations_in(|| {
        for (i, request) in requests.enumerate() {
            // Half on a fresh clone per request, as axum's router calls it.
            let response = if i % 2 == 0 {
                ready_now(service.call(request))
            } else {
                ready_now(service.clone().call(request))
            };
            assert_eq!(response.unwrap().status(), StatusCode::NOT_FOUND);
        }
    });
    let absent = guard.stats().checks.absent;
    assert_eq!(absent, 1_000, "the guard answered every request");
    assert_eq!(
        allocations, 0,
        "{allocations} allocations for {absent} absent answers"
    );
}

/// A loader keyed by `String` is asked with a `&str`: it used to take the
/// owned key, which a caller holding the request's `&str` made for every
/// call, absent or not.
#[test]
fn the_loader_answers_absent_keys_without_allocating() {
    let (guard, loader) = loader_holding("item:1");
    let keys: Vec<String> = (0..10_000).map(|i| format!("absent:{i}")).collect();
    // Warm-up: a thread's first check claims its read-section record.
    let _ = ready_now(loader.get(keys[0].as_str()));

    let mut absent = 0;
    let allocations = allocations_in(|| {
        for key in &keys {
            if guard.check(key).is_absent() {
                assert_eq!(ready_now(loader.get(key.as_str())).unwrap(), None);
                assert!(!ready_now(loader.contains(key.as_str())).unwrap());
                absent += 1;
            }
        }
    });
    assert!(absent > 9_800, "{absent} absent answers");
    assert_eq!(
        allocations, 0,
        "{allocations} allocations for {absent} absent answers"
    );
    // A maybe still reaches the backend with the owned key.
    assert_eq!(run_to_completion(loader.get("item:1")), Some(1));
}

/// The seen-items gate's batch: ~120 candidates a request, none of them
/// seen. Its answer is the one allocation; the routing and the verdicts
/// used to add four more to every call.
#[test]
fn a_batch_of_absent_keys_allocates_only_its_answer() {
    let (guard, seen) = loader_holding("user:1:item:1");
    let candidates: Vec<String> = (0..12_000)
        .map(|i| format!("user:1:item:absent-{i}"))
        .filter(|key| guard.check(key).is_absent())
        .collect();
    let batches: Vec<&[String]> = candidates.chunks(120).collect();
    // Warm-up: a thread's first check claims its read-section record.
    let _ = ready_now(seen.contains_many(batches[0]));

    let allocations = allocations_in(|| {
        for batch in &batches {
            let answers = ready_now(seen.contains_many(batch)).unwrap();
            assert!(answers.len() == batch.len() && answers.iter().all(|&seen| !seen));
            let values = ready_now(seen.get_many(batch)).unwrap();
            assert!(values.len() == batch.len() && values.iter().all(Option::is_none));
        }
    });
    assert!(batches.len() > 90, "{} batches", batches.len());
    assert_eq!(
        allocations,
        2 * batches.len(),
        "{allocations} allocations for {} pairs of calls",
        batches.len()
    );
    // A maybe still reaches the backend, in the order of the batch.
    let mixed = [candidates[0].clone(), "user:1:item:1".to_string()];
    assert_eq!(run_to_completion(seen.get_many(&mixed)), [None, Some(1)]);
}

/// Runs a future that may wait (the backend call) on a small runtime.
fn run_to_completion<T, F: Future<Output = Result<T, std::sync::Arc<Infallible>>>>(future: F) -> T {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(future)
        .unwrap()
}

/// A guard holding `present`, and a `String`-keyed loader over a backend
/// that finds every key it is asked for (as `1`).
fn loader_holding(
    present: &str,
) -> (
    Guard,
    GuardedLoader<String, impl bloomguard::Loader<String, Value = u32, Error = Infallible>>,
) {
    let guard = Guard::builder()
        .expected_items(10_000)
        .seed(0x5eed)
        .build()
        .unwrap();
    guard.insert(present);
    let loader = GuardedLoader::new(guard.clone(), |_key: String| async {
        Ok::<Option<u32>, Infallible>(Some(1))
    });
    (guard, loader)
}

#[test]
fn the_counter_sees_allocations() {
    let counted = allocations_in(|| {
        std::hint::black_box(Box::new(7u64));
    });
    assert_eq!(counted, 1);
}
