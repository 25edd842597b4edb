//! The guard layer and the insert layer wired at different places of an
//! axum app: nest levels, a middleware that rewrites the path. Wherever the
//! guard keys a read, the write of the same item must have inserted that
//! key, or the guard answers 404 for an item just stored.

use std::collections::HashSet;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::Response;
use axum::routing::get;
use bloomguard::layer::{HttpPolicy, PathKey};
use bloomguard::{Guard, GuardLayer, InsertLayer};
use http::{Method, Request, StatusCode};
use tower::util::BoxCloneSyncService;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

/// The ids the handlers stored.
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

/// `GET` and `POST` of `route`, over `store`.
fn items(route: &str, store: &Store) -> Router {
    Router::new()
        .route(route, get(read).post(write))
        .with_state(store.clone())
}

fn guard_layer(guard: &Guard, template: &str) -> GuardLayer<HttpPolicy<PathKey, Body>> {
    GuardLayer::for_http(guard.clone(), PathKey::route(template).method(Method::GET))
}

fn insert_layer(guard: &Guard, template: &str) -> InsertLayer<PathKey> {
    InsertLayer::for_http(guard.clone(), PathKey::route(template).method(Method::POST))
}

fn empty_guard() -> Guard {
    Guard::builder()
        .expected_items(10_000)
        .seed(1)
        .build()
        .unwrap()
}

/// The status `app` answers `method path` with.
async fn status<S>(app: &S, method: Method, path: &str) -> StatusCode
where
    S: Service<Request<Body>, Response = Response, Error = Infallible> + Clone,
{
    let request = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::empty())
        .unwrap();
    app.clone().oneshot(request).await.unwrap().status()
}

/// A middleware's rewrite before the inner router routes: trailing
/// slashes trimmed and the path lower-cased, as a normalizer would.
fn normalized(mut request: Request<Body>) -> Request<Body> {
    let path = request.uri().path();
    let path = match path.trim_end_matches('/') {
        "" => "/",
        trimmed => trimmed,
    };
    *request.uri_mut() = path.to_lowercase().parse().unwrap();
    request
}

/// A layer inside a nest sees the path with the nest's prefix stripped, one
/// outside it all of it (a guard there is keyed with the whole route), one
/// wrapped around the whole app no matched route.
#[tokio::test]
async fn layers_at_different_nest_levels_key_the_same_id() {
    type App = BoxCloneSyncService<Request<Body>, Response, Infallible>;
    type Build = fn(&Guard, &Store) -> App;
    let arrangements: [(&str, Build); 4] = [
        ("guard inside the nest, insert outside", |guard, store| {
            let items = items("/items/{id}", store).layer(guard_layer(guard, "/items/{id}"));
            App::new(
                Router::new()
                    .nest("/api", items)
                    .layer(insert_layer(guard, "/items/{id}")),
            )
        }),
        ("insert inside the nest, guard outside", |guard, store| {
            let items = items("/items/{id}", store).layer(insert_layer(guard, "/items/{id}"));
            App::new(
                Router::new()
                    .nest("/api", items)
                    .layer(guard_layer(guard, "/api/items/{id}")),
            )
        }),
        ("the template across the nest's edge", |guard, store| {
            let items = items("/{id}", store).layer(insert_layer(guard, "/items/{id}"));
            App::new(
                Router::new()
                    .nest("/api/items", items)
                    .layer(guard_layer(guard, "/api/items/{id}")),
            )
        }),
        ("insert around the app, guard inside", |guard, store| {
            let app = Router::new()
                .nest("/api", items("/items/{id}", store))
                .layer(guard_layer(guard, "/api/items/{id}"));
            App::new(insert_layer(guard, "/items/{id}").layer(app))
        }),
    ];
    for (arrangement, build) in arrangements {
        let (guard, store) = (empty_guard(), Store::default());
        let app = build(&guard, &store);
        let created = status(&app, Method::POST, "/api/items/n%31").await;
        assert_eq!(created, StatusCode::CREATED, "{arrangement}");
        assert!(store.lock().unwrap().contains("n1"), "{arrangement}");
        assert_eq!(
            status(&app, Method::GET, "/api/items/n1").await,
            StatusCode::OK,
            "{arrangement}: the item was stored"
        );
        assert_eq!(guard.stats().inserts, 1, "{arrangement}");
        let missing = status(&app, Method::GET, "/api/items/n2").await;
        assert_eq!(missing, StatusCode::NOT_FOUND, "{arrangement}");
        assert_eq!(guard.stats().checks.absent, 1, "{arrangement}");
    }
}

/// A rewrite inside the app, after axum noted the original path: the
/// router routes, and the handler stores, by the rewritten one.
#[tokio::test]
async fn a_path_rewritten_inside_the_app_never_costs_a_stored_item() {
    let (guard, store) = (empty_guard(), Store::default());
    let api = items("/items/{id}", &store)
        .layer(insert_layer(&guard, "/items/{id}"))
        .layer(guard_layer(&guard, "/items/{id}"));
    let app = Router::new().nest_service(
        "/api",
        ServiceBuilder::new().map_request(normalized).service(api),
    );
    for (written_as, stored, read_as) in [
        ("/api/items/n1/", "n1", "/api/items/n1"),
        ("/api/items/n2", "n2", "/api/items/n2/"),
        ("/api/items/N3", "n3", "/api/items/n3"),
        ("/api/items/n4", "n4", "/api/items/N4"),
    ] {
        assert_eq!(
            status(&app, Method::POST, written_as).await,
            StatusCode::CREATED
        );
        assert!(store.lock().unwrap().contains(stored), "{written_as}");
        assert_eq!(
            status(&app, Method::GET, read_as).await,
            StatusCode::OK,
            "written as {written_as}, read as {read_as}"
        );
    }
    let missing = status(&app, Method::GET, "/api/items/n5").await;
    assert_eq!(missing, StatusCode::NOT_FOUND);
    assert!(guard.stats().checks.absent >= 1, "the guard still answers");
}

/// The id in a nest's prefix, a literal after it, and a rewrite inside the
/// app: the layers under the nest see `/seen` only, so the id the guard
/// could key comes from the original path, which the rewrite may have
/// changed since. The guard must let such reads through.
#[tokio::test]
async fn an_id_the_layers_do_not_see_is_not_guarded_through_a_rewrite() {
    let (guard, store) = (empty_guard(), Store::default());
    let template = "/users/{user}/seen";
    let seen = items("/seen", &store)
        .layer(insert_layer(&guard, template))
        .layer(guard_layer(&guard, template));
    let app = Router::new().nest_service(
        "/api",
        ServiceBuilder::new()
            .map_request(normalized)
            .service(Router::new().nest("/users/{user}", seen)),
    );
    for (written_as, read_as) in [
        ("/api/users/N1/seen", "/api/users/n1/seen"),
        ("/api/users/n2/seen", "/api/users/N2/seen"),
    ] {
        assert_eq!(
            status(&app, Method::POST, written_as).await,
            StatusCode::CREATED
        );
        assert_eq!(
            status(&app, Method::GET, read_as).await,
            StatusCode::OK,
            "written as {written_as}, read as {read_as}"
        );
    }
}
