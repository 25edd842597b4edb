//! `GuardLayer` in both forms and `InsertLayer`: what reaches the inner
//! service, what the guard counts, and that errors pass through.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bloomguard::layer::PathKey;
use bloomguard::{Guard, GuardLayer, InsertLayer, Verdict};
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
    let mut answered = 0;
    for key in &absent {
        assert_eq!(service.clone().oneshot(key.clone()).await.unwrap(), None);
        answered += 1;
    }
    let stats = guard.stats();
    assert_eq!(answered, 1_000);
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
}

/// The guard layer and the insert layer at different `nest` levels: a
/// layer inside a nest sees the path with the nest's prefix stripped, one
/// outside it all of it, and one wrapped around the whole app no matched
/// route. Wherever the guard keys a read, the insert layer must have keyed
/// the write to the same id, or the read answers 404 for an item just
/// stored.
#[cfg(feature = "axum")]
#[tokio::test]
async fn layers_at_different_nest_levels_key_the_same_id() {
    use std::collections::HashSet;
    use std::sync::Mutex;

    use axum::Router;
    use axum::body::Body;
    use axum::extract::{Path, State};
    use axum::routing::get;
    use tower::util::BoxCloneSyncService;

    type Store = Arc<Mutex<HashSet<String>>>;
    type App = BoxCloneSyncService<Request<Body>, axum::response::Response, Infallible>;
    async fn read(State(store): State<Store>, Path(id): Path<String>) -> StatusCode {
        if store.lock().unwrap().contains(&id) {
            StatusCode::OK
        } else {
            StatusCode::NOT_FOUND
        }
    }
    async fn write(State(store): State<Store>, Path(id): Path<String>) -> StatusCode {
        store.lock().unwrap().insert(id);
        StatusCode::CREATED
    }
    fn read_key() -> PathKey {
        PathKey::route("/items/{id}").method(Method::GET)
    }
    fn write_key() -> PathKey {
        PathKey::route("/items/{id}").method(Method::POST)
    }
    type Build = fn(&Guard, &Store) -> App;
    let arrangements: [(&str, Build); 4] = [
        ("guard inside the nest, insert outside", |guard, store| {
            let items = Router::new()
                .route("/items/{id}", get(read).post(write))
                .with_state(store.clone())
                .layer(GuardLayer::for_http(guard.clone(), read_key()));
            App::new(
                Router::new()
                    .nest("/api", items)
                    .layer(InsertLayer::for_http(guard.clone(), write_key())),
            )
        }),
        ("insert inside the nest, guard outside", |guard, store| {
            let items = Router::new()
                .route("/items/{id}", get(read).post(write))
                .with_state(store.clone())
                .layer(InsertLayer::for_http(guard.clone(), write_key()));
            App::new(
                Router::new()
                    .nest("/api", items)
                    .layer(GuardLayer::for_http(guard.clone(), read_key())),
            )
        }),
        ("the template across the nest's edge", |guard, store| {
            let items = Router::new()
                .route("/{id}", get(read).post(write))
                .with_state(store.clone())
                .layer(InsertLayer::for_http(guard.clone(), write_key()));
            App::new(
                Router::new()
                    .nest("/api/items", items)
                    .layer(GuardLayer::for_http(guard.clone(), read_key())),
            )
        }),
        ("insert around the app, guard inside", |guard, store| {
            let items = Router::new()
                .route("/items/{id}", get(read).post(write))
                .with_state(store.clone());
            let app = Router::new()
                .nest("/api", items)
                .layer(GuardLayer::for_http(guard.clone(), read_key()));
            App::new(InsertLayer::for_http(guard.clone(), write_key()).layer(app))
        }),
    ];
    for (arrangement, build) in arrangements {
        let guard = guard_with(&[]);
        let store = Store::default();
        let app = build(&guard, &store);
        let status = |request: Request<Body>| {
            let app = app.clone();
            async move { app.oneshot(request).await.unwrap().status() }
        };
        let post = Request::post("/api/items/n%31")
            .body(Body::empty())
            .unwrap();
        assert_eq!(status(post).await, StatusCode::CREATED, "{arrangement}");
        assert!(store.lock().unwrap().contains("n1"), "{arrangement}");
        let read = Request::get("/api/items/n1").body(Body::empty()).unwrap();
        assert_eq!(
            status(read).await,
            StatusCode::OK,
            "{arrangement}: the item was stored"
        );
        assert_eq!(guard.stats().inserts, 1, "{arrangement}");
        let missing = Request::get("/api/items/n2").body(Body::empty()).unwrap();
        assert_eq!(
            status(missing).await,
            StatusCode::NOT_FOUND,
            "{arrangement}"
        );
        assert_eq!(guard.stats().checks.absent, 1, "{arrangement}");
    }
}

/// A middleware that rewrites the path inside the app (a trailing slash
/// trimmed, an id lower-cased) after axum noted the original: the router
/// routes, and the handler stores, by the rewritten path. The insert layer
/// must insert the id the guard will check for every read of the stored
/// item, or the guard must let those reads through.
#[cfg(feature = "axum")]
#[tokio::test]
async fn a_path_rewritten_inside_the_app_never_costs_a_stored_item() {
    use std::collections::HashSet;
    use std::sync::Mutex;

    use axum::Router;
    use axum::body::Body;
    use axum::extract::{Path, State};
    use axum::routing::get;

    type Store = Arc<Mutex<HashSet<String>>>;
    async fn read(State(store): State<Store>, Path(id): Path<String>) -> StatusCode {
        if store.lock().unwrap().contains(&id) {
            StatusCode::OK
        } else {
            StatusCode::NOT_FOUND
        }
    }
    async fn write(State(store): State<Store>, Path(id): Path<String>) -> StatusCode {
        store.lock().unwrap().insert(id);
        StatusCode::CREATED
    }
    /// Trims a trailing slash and lower-cases the path, as a normalizing
    /// middleware in front of a nested API would.
    fn normalized<B>(mut request: Request<B>) -> Request<B> {
        let path = request.uri().path();
        let path = path
            .strip_suffix('/')
            .filter(|p| !p.is_empty())
            .unwrap_or(path);
        *request.uri_mut() = path.to_lowercase().parse().unwrap();
        request
    }
    let guard = guard_with(&[]);
    let store = Store::default();
    let api = Router::new()
        .route("/items/{id}", get(read).post(write))
        .with_state(store.clone())
        .layer(InsertLayer::for_http(
            guard.clone(),
            PathKey::route("/items/{id}").method(Method::POST),
        ))
        .layer(GuardLayer::for_http(
            guard.clone(),
            PathKey::route("/items/{id}").method(Method::GET),
        ));
    let app = Router::new().nest_service(
        "/api",
        ServiceBuilder::new()
            .map_request(normalized::<Body>)
            .service(api),
    );
    let status = |method: Method, path: &str| {
        let app = app.clone();
        let request = Request::builder()
            .method(method)
            .uri(path)
            .body(Body::empty())
            .unwrap();
        async move { app.oneshot(request).await.unwrap().status() }
    };
    for (written_as, stored, read_as) in [
        ("/api/items/n1/", "n1", "/api/items/n1"),
        ("/api/items/n2", "n2", "/api/items/n2/"),
        ("/api/items/N3", "n3", "/api/items/n3"),
        ("/api/items/n4", "n4", "/api/items/N4"),
    ] {
        assert_eq!(status(Method::POST, written_as).await, StatusCode::CREATED);
        assert!(store.lock().unwrap().contains(stored), "{written_as}");
        assert_eq!(
            status(Method::GET, read_as).await,
            StatusCode::OK,
            "written as {written_as}, read as {read_as}"
        );
    }
    assert_eq!(
        status(Method::GET, "/api/items/n5").await,
        StatusCode::NOT_FOUND
    );
    assert!(guard.stats().checks.absent >= 1, "the guard still answers");
}

/// The id in a nest's prefix, a literal after it, and a rewrite inside
/// the app: the layers under the nest see `/seen` only, so the id the
/// guard could key comes from the original path, which the rewrite may
/// have changed since. The guard must let such reads through.
#[cfg(feature = "axum")]
#[tokio::test]
async fn an_id_the_layers_do_not_see_is_not_guarded_through_a_rewrite() {
    use std::collections::HashSet;
    use std::sync::Mutex;

    use axum::Router;
    use axum::body::Body;
    use axum::extract::{Path, State};
    use axum::routing::get;

    type Store = Arc<Mutex<HashSet<String>>>;
    async fn read(State(store): State<Store>, Path(user): Path<String>) -> StatusCode {
        if store.lock().unwrap().contains(&user) {
            StatusCode::OK
        } else {
            StatusCode::NOT_FOUND
        }
    }
    async fn write(State(store): State<Store>, Path(user): Path<String>) -> StatusCode {
        store.lock().unwrap().insert(user);
        StatusCode::CREATED
    }
    fn lower_cased<B>(mut request: Request<B>) -> Request<B> {
        *request.uri_mut() = request.uri().path().to_lowercase().parse().unwrap();
        request
    }
    let guard = guard_with(&[]);
    let store = Store::default();
    let template = "/users/{user}/seen";
    let seen = Router::new()
        .route("/seen", get(read).post(write))
        .with_state(store.clone())
        .layer(InsertLayer::for_http(
            guard.clone(),
            PathKey::route(template).method(Method::POST),
        ))
        .layer(GuardLayer::for_http(
            guard.clone(),
            PathKey::route(template).method(Method::GET),
        ));
    let app = Router::new().nest_service(
        "/api",
        ServiceBuilder::new()
            .map_request(lower_cased::<Body>)
            .service(Router::new().nest("/users/{user}", seen)),
    );
    let status = |method: Method, path: &str| {
        let app = app.clone();
        let request = Request::builder()
            .method(method)
            .uri(path)
            .body(Body::empty())
            .unwrap();
        async move { app.oneshot(request).await.unwrap().status() }
    };
    for (written_as, read_as) in [
        ("/api/users/N1/seen", "/api/users/n1/seen"),
        ("/api/users/n2/seen", "/api/users/N2/seen"),
    ] {
        assert_eq!(status(Method::POST, written_as).await, StatusCode::CREATED);
        assert_eq!(
            status(Method::GET, read_as).await,
            StatusCode::OK,
            "written as {written_as}, read as {read_as}"
        );
    }
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

/// A trailing-slash alias of the template is another route, with no key
/// under the template; keyed on its own template, it names the same id.
#[test]
fn a_trailing_slash_alias_is_keyed_by_its_own_template() {
    use bloomguard::layer::HttpKey;
    let post = |path: &str| Request::post(path).body(()).unwrap();
    let template = PathKey::route("/items/{id}").method(Method::POST);
    let alias = PathKey::route("/items/{id}/").method(Method::POST);
    assert_eq!(template.key(&post("/items/x/")), None);
    assert_eq!(alias.key(&post("/items/x/")).as_deref(), Some("x"));
    assert_eq!(alias.key(&post("/items/x")), None);
    assert_eq!(template.key(&post("/items/x")).as_deref(), Some("x"));
}
