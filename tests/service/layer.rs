//! `GuardLayer` in both forms and `InsertLayer`: what reaches the inner
//! service, what the guard counts, and that errors pass through.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bloomguard::layer::PathKey;
use bloomguard::{Guard, GuardLayer, InsertLayer, Verdict, Verify};
use http::{Method, Request, Response, StatusCode};
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

fn guard_with(keys: &[&str]) -> Guard {
    let guard = Guard::builder()
        .expected_items(10_000)
        .seed(1)
        .build()
        .unwrap();
    for key in keys {
        guard.insert(key);
    }
    guard
}

#[tokio::test]
async fn loader_form_answers_absent_keys_without_calling_the_backend() {
    let guard = guard_with(&["item:1", "item:2"]);
    let calls = Arc::new(AtomicUsize::new(0));
    let backend = {
        let calls = Arc::clone(&calls);
        service_fn(move |key: String| {
            calls.fetch_add(1, Ordering::SeqCst);
            async move { Ok::<_, Infallible>((key == "item:1").then_some(key.len())) }
        })
    };
    let service = ServiceBuilder::new()
        .layer(GuardLayer::for_loader(guard.clone()))
        .service(backend);

    let absent: Vec<String> = (0..1_000).map(|i| format!("absent:{i}")).collect();
    for key in &absent {
        assert_eq!(service.clone().oneshot(key.clone()).await.unwrap(), None);
    }
    let stats = guard.stats();
    assert_eq!(
        stats.checks.absent + stats.checks.maybe_present,
        1_000,
        "the guard checked every call"
    );
    assert_eq!(
        calls.load(Ordering::SeqCst) as u64,
        stats.checks.maybe_present,
        "only maybe-present keys reached the backend"
    );
    assert_eq!(stats.false_positives, stats.checks.maybe_present);

    // Found, and a guard false positive that the backend does not have.
    let calls_before = calls.load(Ordering::SeqCst);
    assert_eq!(
        service.clone().oneshot("item:1".into()).await.unwrap(),
        Some(6)
    );
    assert_eq!(
        service.clone().oneshot("item:2".into()).await.unwrap(),
        None
    );
    assert_eq!(calls.load(Ordering::SeqCst), calls_before + 2);
    let after = guard.stats();
    assert_eq!(after.found, 1);
    assert_eq!(after.false_positives, stats.false_positives + 1);
}

#[tokio::test]
async fn errors_pass_through_and_are_not_counted_as_not_found() {
    let guard = guard_with(&["item:1"]);
    let service = GuardLayer::for_loader(guard.clone()).layer(service_fn(|_key: String| async {
        Err::<Option<u8>, _>(std::io::Error::other("backend down"))
    }));
    let error = service.oneshot("item:1".into()).await.unwrap_err();
    assert_eq!(error.to_string(), "backend down");
    let stats = guard.stats();
    assert_eq!((stats.found, stats.false_positives), (0, 0));
}

#[tokio::test]
async fn poll_ready_is_the_inner_services() {
    let guard = guard_with(&["item:1"]);
    let (service, mut handle) =
        tower_test::mock::spawn_layer::<String, Option<u8>, _>(GuardLayer::for_loader(guard));
    let mut service = service;
    handle.allow(0);
    assert!(
        service.poll_ready().is_pending(),
        "the inner service is not ready"
    );
    handle.allow(1);
    assert!(service.poll_ready().is_ready());
    let response = service.call("item:1".to_string());
    let (request, send) = handle.next_request().await.unwrap();
    assert_eq!(request, "item:1");
    send.send_response(Some(7));
    assert_eq!(response.await.unwrap(), Some(7));
}

type Body = String;

fn http_backend(
    calls: Arc<AtomicUsize>,
) -> impl Service<Request<Body>, Response = Response<Body>, Error = Infallible, Future: Send> + Clone
{
    service_fn(move |request: Request<Body>| {
        calls.fetch_add(1, Ordering::SeqCst);
        let status = match request.uri().path() {
            "/items/1" => StatusCode::OK,
            "/items/broken" => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::NOT_FOUND,
        };
        let mut response = Response::new(String::from("from the backend"));
        *response.status_mut() = status;
        async move { Ok::<_, Infallible>(response) }
    })
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(String::new()).unwrap()
}

#[tokio::test]
async fn http_form_answers_404_and_classifies_responses() {
    let guard = guard_with(&["1", "2", "broken"]);
    let calls = Arc::new(AtomicUsize::new(0));
    let service = GuardLayer::for_http(
        guard.clone(),
        PathKey::route("/items/{id}").method(Method::GET),
    )
    .layer(http_backend(Arc::clone(&calls)));

    // Absent: 404 with an empty body, no call.
    let response = service.clone().oneshot(get("/items/nope")).await.unwrap();
    assert_eq!(response.status(), StatusCode::NOT_FOUND);
    assert!(response.body().is_empty());
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    // Found, false positive, neither.
    let found = service.clone().oneshot(get("/items/1")).await.unwrap();
    assert_eq!(found.status(), StatusCode::OK);
    let missing = service.clone().oneshot(get("/items/2")).await.unwrap();
    assert_eq!(missing.body(), "from the backend", "the backend's own 404");
    let broken = service.clone().oneshot(get("/items/broken")).await.unwrap();
    assert_eq!(broken.status(), StatusCode::INTERNAL_SERVER_ERROR);
    let stats = guard.stats();
    assert_eq!((stats.found, stats.false_positives), (1, 1));

    // No key: passes through unguarded and uncounted.
    let checks = stats.checks.total();
    let other = service.clone().oneshot(get("/health")).await.unwrap();
    assert_eq!(other.status(), StatusCode::NOT_FOUND);
    assert_eq!(guard.stats().checks.total(), checks);
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

/// A `PathKey` given no method keys reads only: the guard cannot know
/// whether a `PUT` creates the id (an upsert), and a `DELETE` or a CORS
/// preflight must reach the handler whatever the filter holds.
#[tokio::test]
async fn without_a_method_only_reads_are_guarded() {
    let guard = guard_with(&["x"]);
    let calls = Arc::new(AtomicUsize::new(0));
    let service = GuardLayer::for_http(guard.clone(), PathKey::route("/items/{id}"))
        .verify(Verify::Sample(0.01), || {
            Response::new(String::from("trusted as present"))
        })
        .unwrap()
        .layer(http_backend(Arc::clone(&calls)));
    let request = |method: Method, path: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .body(String::new())
            .unwrap()
    };

    // Reads are guarded: an absent id is answered here.
    for method in [Method::GET, Method::HEAD] {
        let response = service
            .clone()
            .oneshot(request(method.clone(), "/items/new"))
            .await
            .unwrap();
        assert!(response.body().is_empty(), "{method} answered by the guard");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    // An upsert of a new id, a delete of a maybe-present one (which a
    // sampled verify would answer "present" without running it), a
    // preflight: each reaches the handler.
    for (method, path) in [
        (Method::PUT, "/items/new"),
        (Method::DELETE, "/items/x"),
        (Method::OPTIONS, "/items/new"),
        (Method::POST, "/items/new"),
    ] {
        let before = calls.load(Ordering::SeqCst);
        let response = service
            .clone()
            .oneshot(request(method.clone(), path))
            .await
            .unwrap();
        assert_eq!(response.body(), "from the backend", "{method} {path}");
        assert_eq!(calls.load(Ordering::SeqCst), before + 1, "{method} {path}");
    }
}

/// A 304 says the client's copy of the item is current: the item exists.
/// After an `Absent`, shadow mode counts it as a would-be false negative.
#[tokio::test]
async fn a_not_modified_answer_counts_as_found() {
    let guard = guard_with(&[]);
    let not_modified = service_fn(|_request: Request<Body>| async {
        let mut response = Response::new(String::new());
        *response.status_mut() = StatusCode::NOT_MODIFIED;
        Ok::<_, Infallible>(response)
    });
    let service = GuardLayer::for_http(
        guard.clone(),
        PathKey::route("/items/{id}").method(Method::GET),
    )
    .shadow()
    .layer(not_modified);
    let response = service.oneshot(get("/items/cached")).await.unwrap();
    assert_eq!(response.status(), StatusCode::NOT_MODIFIED);
    assert_eq!(guard.stats().would_be_false_negatives, 1);
}

#[tokio::test]
async fn the_absent_response_is_configurable() {
    let guard = guard_with(&[]);
    let service = GuardLayer::for_http(guard, PathKey::route("/items/{id}"))
        .with_absent_response(|| {
            let mut response = Response::new(String::from("no such item"));
            *response.status_mut() = StatusCode::GONE;
            response
        })
        .layer(http_backend(Arc::new(AtomicUsize::new(0))));
    let response = service.oneshot(get("/items/x")).await.unwrap();
    assert_eq!(response.status(), StatusCode::GONE);
    assert_eq!(response.body(), "no such item");
}

#[tokio::test]
async fn the_insert_layer_inserts_before_the_inner_service_writes() {
    let guard = guard_with(&[]);
    let seen_by_the_writer = Arc::new(AtomicUsize::new(0));
    let writer = {
        let (guard, seen) = (guard.clone(), Arc::clone(&seen_by_the_writer));
        service_fn(move |request: Request<Body>| {
            let key = request
                .uri()
                .path()
                .trim_start_matches("/items/")
                .to_owned();
            if guard.check(&key) == Verdict::MaybePresent {
                seen.fetch_add(1, Ordering::SeqCst);
            }
            async move { Ok::<_, Infallible>(Response::new(String::new())) }
        })
    };
    let service = InsertLayer::for_http(
        guard.clone(),
        PathKey::route("/items/{id}").method(Method::POST),
    )
    .layer(writer);
    for id in 0..100 {
        let request = Request::post(format!("/items/new-{id}"))
            .body(String::new())
            .unwrap();
        service.clone().oneshot(request).await.unwrap();
    }
    assert_eq!(seen_by_the_writer.load(Ordering::SeqCst), 100);
    assert_eq!(guard.stats().inserts, 100);
    // GETs are not writes.
    service
        .clone()
        .oneshot(get("/items/read-only"))
        .await
        .unwrap();
    assert_eq!(guard.stats().inserts, 100);
}

/// `Router::layer` wraps every route of the router, static siblings of the
/// guarded one too: `/users/me` has the shape of `/users/{id}` but is
/// another route, and must reach its handler (axum routes a static segment
/// before a parameter). With axum's matched route at hand (the `axum`
/// feature), the key is taken only on the template's own route.
#[cfg(feature = "axum")]
#[tokio::test]
async fn a_static_sibling_route_is_not_guarded_as_the_template() {
    use axum::Router;
    use axum::body::Body;
    use axum::extract::Path;
    use axum::routing::get;

    let guard = guard_with(&["1"]);
    let users = Router::new()
        .route(
            "/users/{id}",
            get(|Path(id): Path<String>| async move { id }),
        )
        .route("/users/me", get(|| async { "me" }))
        .layer(GuardLayer::for_http(
            guard.clone(),
            PathKey::route("/users/{id}").method(Method::GET),
        ));
    let app = Router::new().merge(users.clone()).nest("/api", users);
    let status = |path: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::get(path).body(Body::empty()).unwrap();
            app.oneshot(request).await.unwrap().status()
        }
    };
    for prefix in ["", "/api"] {
        let path = |rest: &str| -> &'static str { format!("{prefix}{rest}").leak() };
        assert_eq!(
            status(path("/users/me")).await,
            StatusCode::OK,
            "{prefix}/users/me"
        );
        assert_eq!(status(path("/users/1")).await, StatusCode::OK);
        assert_eq!(
            status(path("/users/2")).await,
            StatusCode::NOT_FOUND,
            "{prefix}: the template's own route is still guarded"
        );
    }
    assert_eq!(guard.stats().checks.absent, 2);

    // A literal route spelled with escaped braces (`{{id}}` is the text
    // `{id}`) is a static sibling too, not the template's parameter.
    let literal = Router::new()
        .route(
            "/users/{id}",
            get(|Path(id): Path<String>| async move { id }),
        )
        .route("/users/{{me}}", get(|| async { "the literal route" }))
        .layer(GuardLayer::for_http(
            guard.clone(),
            PathKey::route("/users/{id}").method(Method::GET),
        ));
    let request = Request::get("/users/{me}").body(Body::empty()).unwrap();
    let response = literal.oneshot(request).await.unwrap();
    assert_eq!(
        response.status(),
        StatusCode::OK,
        "the literal route /users/{{me}}"
    );
}

/// A router's layer wraps a `nest_service` and its fallback too, where
/// axum sets no matched route (a nested service routes for itself, and a
/// fallback matched nothing): the guard cannot tell the template's route
/// from a static sibling there (`/users/me`), and lets the request through;
/// so in a router nested in another, and around the service itself, which
/// axum's public types do not tell apart from those.
#[cfg(feature = "axum")]
#[tokio::test]
async fn a_nested_service_or_fallback_is_not_guarded_as_the_template() {
    use axum::Router;
    use axum::body::Body;
    use axum::extract::Path;
    use axum::routing::get;

    let guard = guard_with(&["1"]);
    let users = Router::new()
        .route(
            "/users/{id}",
            get(|Path(id): Path<String>| async move { id }),
        )
        .route("/users/me", get(|| async { "me" }));
    let layer = |template| {
        GuardLayer::for_http(guard.clone(), PathKey::route(template).method(Method::GET))
    };
    let nested = Router::new()
        .nest_service("/api", users.clone())
        .layer(layer("/api/users/{id}"));
    let fallback = Router::new()
        .route("/health", get(|| async { "ok" }))
        .fallback_service(users.clone())
        .layer(layer("/users/{id}"));
    let nested_in_a_nest = Router::new().nest("/v1", nested.clone());
    let around = Router::new().nest_service("/api", layer("/users/{id}").layer(users));
    for (app, path) in [
        (nested, "/api/users/me"),
        (fallback, "/users/me"),
        (nested_in_a_nest, "/v1/api/users/me"),
        (around, "/api/users/me"),
    ] {
        let request = Request::get(path).body(Body::empty()).unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path}");
    }
    assert_eq!(guard.stats().checks.total(), 0, "nothing was keyed");
}

/// A route of the layer's own router that only ends with the template
/// (`/users/{user}/items/{id}` beside `/items/{id}`) is another route: its
/// handler may read another key (`{user}:{id}`), which a guard built from
/// the store holds while the bare id is absent. A nest's prefix is not in
/// the path the layer sees; a route's own prefix is, and then the guard
/// cannot know the key. The same for a layer outside a nest keyed with the
/// nest's part of the route left out: it lets those requests through.
#[cfg(feature = "axum")]
#[tokio::test]
async fn a_longer_route_that_ends_with_the_template_is_not_guarded() {
    use axum::Router;
    use axum::body::Body;
    use axum::extract::Path;
    use axum::routing::get;

    // The store holds `1` and `7:99`; the guard, built from it, the same.
    let guard = guard_with(&["1", "7:99"]);
    let stored = |key: String| async move {
        if key == "1" || key == "7:99" {
            StatusCode::OK
        } else {
            StatusCode::NOT_FOUND
        }
    };
    let guarded = GuardLayer::for_http(
        guard.clone(),
        PathKey::route("/items/{id}").method(Method::GET),
    );
    let app = Router::new()
        .route("/items/{id}", get(move |Path(id): Path<String>| stored(id)))
        .route(
            "/users/{user}/items/{id}",
            get(move |Path((user, id)): Path<(String, String)>| stored(format!("{user}:{id}"))),
        )
        .layer(guarded.clone());
    let outside = Router::new()
        .nest(
            "/api",
            Router::new().route("/items/{id}", get(move |Path(id): Path<String>| stored(id))),
        )
        .layer(guarded);
    let status = |app: &Router, path: &'static str| {
        let app = app.clone();
        async move {
            let request = Request::get(path).body(Body::empty()).unwrap();
            app.oneshot(request).await.unwrap().status()
        }
    };
    assert_eq!(
        status(&app, "/users/7/items/99").await,
        StatusCode::OK,
        "the user's item is stored under 7:99"
    );
    assert_eq!(guard.stats().checks.absent, 0);
    assert_eq!(status(&app, "/items/2").await, StatusCode::NOT_FOUND);
    assert_eq!(
        guard.stats().checks.absent,
        1,
        "the template's own route is still guarded"
    );
    assert_eq!(
        status(&outside, "/api/items/2").await,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        guard.stats().checks.absent,
        1,
        "outside the nest, /items/{{id}} does not name the route: not guarded"
    );

    // The same route through a nest with a parameter of its own: axum hands
    // the handler both captures, and the layer inside sees `/items/99` only.
    // The nest's capture may be a whole segment or part of one.
    for (nest, path) in [
        ("/users/{user}", "/users/7/items/99"),
        ("/u_{user}", "/u_7/items/99"),
    ] {
        let tenants = Router::new().nest(
            nest,
            Router::new()
                .route(
                    "/items/{id}",
                    get(move |Path((user, id)): Path<(String, String)>| {
                        stored(format!("{user}:{id}"))
                    }),
                )
                .layer(GuardLayer::for_http(
                    guard.clone(),
                    PathKey::route("/items/{id}").method(Method::GET),
                )),
        );
        assert_eq!(
            status(&tenants, path).await,
            StatusCode::OK,
            "{nest}: a nest's capture is the handler's too"
        );
    }
    assert_eq!(guard.stats().checks.absent, 1);
}

/// The insert layer's key without a matched route or the original path (a
/// layer inside a `nest` without the `axum` feature, or a plain tower
/// stack): the template's end is enough, so a write under a nest whose
/// prefix the layer no longer sees is keyed as a guard outside it keys
/// the read (`/api/items/{id}` on the whole path).
#[test]
fn the_insert_key_needs_only_the_end_of_the_template() {
    use bloomguard::layer::HttpKey;
    let post = |path: &str| Request::post(path).body(()).unwrap();
    let whole = PathKey::route("/api/items/{id}").method(Method::POST);
    let keys = |path: &str| {
        whole
            .write_keys(&post(path))
            .map(|key| key.map(|k| k.into_owned()))
    };
    assert_eq!(keys("/api/items/42"), [Some("42".into()), None]);
    assert_eq!(
        keys("/items/42"),
        [Some("42".into()), None],
        "under nest(\"/api\")"
    );
    assert_eq!(
        keys("/42"),
        [Some("42".into()), None],
        "under nest(\"/api/items\")"
    );
    assert_eq!(
        keys("/items/42/"),
        [Some("42".into()), None],
        "a trailing slash"
    );
    assert_eq!(
        keys("/items/42//"),
        [Some("42".into()), None],
        "trailing slashes"
    );
    assert_eq!(keys("/users/42"), [None, None], "another route");
    assert_eq!(keys("/api/items/"), [None, None], "no id");
    // The guard's key stays exact without a matched route.
    let read = PathKey::route("/api/items/{id}");
    let get = |path: &str| Request::get(path).body(()).unwrap();
    assert_eq!(read.key(&get("/items/42")), None);
    assert_eq!(read.key(&get("/api/items/42")).as_deref(), Some("42"));
}

/// A trailing-slash alias of the template: its writes are inserted under
/// the template's id (a normalizer may have trimmed the slash before the
/// route), and the guard, sure of the template only, lets its reads
/// through.
#[test]
fn a_trailing_slash_alias_is_written_under_the_template_and_read_unguarded() {
    use bloomguard::layer::HttpKey;
    let request = |method: Method, path: &str| {
        Request::builder()
            .method(method)
            .uri(path)
            .body(())
            .unwrap()
    };
    let writes = PathKey::route("/items/{id}").method(Method::POST);
    let reads = PathKey::route("/items/{id}").method(Method::GET);
    let post = request(Method::POST, "/items/x/");
    assert_eq!(writes.write_keys(&post), [Some("x".into()), None]);
    assert_eq!(reads.key(&request(Method::GET, "/items/x/")), None);
    assert_eq!(
        reads.key(&request(Method::GET, "/items/x")).as_deref(),
        Some("x")
    );
    // Its own template keys the alias on both sides.
    let alias = PathKey::route("/items/{id}/");
    assert_eq!(
        alias.key(&request(Method::GET, "/items/x/")).as_deref(),
        Some("x")
    );
    assert_eq!(alias.key(&request(Method::GET, "/items/x")), None);
}
