//! The write path: insert a request's key before the inner service writes it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::Request;
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::HttpKey;
use super::Shared;
use crate::guard::{Guard, PendingWrite};

/// Inserts the key of each request into the guard **before** calling the
/// inner service, which writes it to the store: the ordering rule of the
/// [guard](crate::guard), for routes that create items. The insert counts as
/// a pending write until the inner service has answered, so a rebuild
/// running meanwhile waits for it (see [`PendingWrite`]). A response future
/// dropped before that (the client went away) ends the cover: a handler
/// whose write can land later than the
/// [write settle](crate::RebuildPolicy::write_settle) after that (a slow
/// database behind a client timeout) moves the write into a task of its
/// own together with a [`PendingWrite`] of its own
/// ([`Guard::begin_write`]) for the same key, dropped once the write has
/// landed; spawning the write alone does not keep the cover. So does the
/// answer itself: a
/// handler that writes after it has answered (from a task it spawned, or
/// while its response body streams) must have the write visible in the
/// store within the
/// [write settle](crate::RebuildPolicy::write_settle), or hold a
/// [`PendingWrite`] of its own ([`Guard::begin_write`]) until it is.
///
/// A write whose request has no key (another route, another method) goes
/// through without an insert, as it must for the routes that write other
/// things. So every request that stores an item has to be one the key
/// names ([`HttpKey::write_keys`](crate::layer::HttpKey::write_keys)), with
/// the id the guard layer's key reads back:
/// - **each write method:** `PathKey::method` takes one; for `POST` and
///   `PUT` both, stack an `InsertLayer` for each;
/// - **each route that writes the item:** `PathKey` writes a route whose
///   path ends with its template (a nest's prefix, a `/items/{id}/` alias)
///   under the same id, but not one of another shape
///   (`/items/{id}/copy`): give such a route its own layer keyed on its
///   template.
///
/// `PathKey` keys a write at any nest level and through the rewrites it
/// can see (see its "Nests, rewrites, and the two sides"), with the `axum`
/// feature. Without it, an `InsertLayer` inside a nest whose prefix holds
/// the id (`nest("/users/{user}", …)` around the layer) sees the path with
/// the prefix stripped, finds no id, and inserts nothing: put the layer
/// above that nest. A stored item
/// whose write was not keyed is answered 404 until a rebuild from the
/// store picks it up. That includes an id the server makes up (a `POST
/// /items` that answers with the new item's id): no request names it, so
/// the handler inserts it
/// ([`Guard::insert_then_write`](crate::Guard::insert_then_write)) before
/// it writes.
///
/// **One instance only.** The insert goes into this process's guard. In a
/// fleet of instances sharing a store, the others' guards never see it and
/// answer 404 for the item until they rebuild: write through
/// `FleetSync::insert_then_write` (`bloomguard::redis::fleet`, the `redis`
/// feature) in the handler instead of this layer.
///
/// ```
/// use axum::{Router, http::Method, routing::post};
/// use bloomguard::{Guard, InsertLayer, layer::PathKey};
///
/// let guard = Guard::builder().expected_items(1_000_000).build()?;
/// let app: Router = Router::new()
///     .route("/items/{id}", post(|| async { "created" }))
///     .layer(InsertLayer::for_http(guard, PathKey::route("/items/{id}").method(Method::POST)));
/// # let _ = app;
/// # Ok::<(), bloomguard::ConfigError>(())
/// ```
pub struct InsertLayer<K> {
    shared: Arc<Shared<K>>,
}

impl<K> InsertLayer<K> {
    /// Inserts the key `key` picks from each `http` request (requests
    /// without one pass through).
    /// `K` is an [`HttpKey`] of the requests the service takes.
    pub fn for_http(guard: Guard, key: K) -> Self {
        Self {
            shared: Arc::new(Shared { guard, policy: key }),
        }
    }
}

impl<K> Clone for InsertLayer<K> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K> fmt::Debug for InsertLayer<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InsertLayer")
            .field("guard", &self.shared.guard)
            .finish_non_exhaustive()
    }
}

impl<S, K> Layer<S> for InsertLayer<K> {
    type Service = InsertService<S, K>;

    fn layer(&self, inner: S) -> Self::Service {
        InsertService {
            inner,
            shared: Arc::clone(&self.shared),
        }
    }
}

/// A service whose requests' keys are inserted into a guard before it runs;
/// made by [`InsertLayer`].
pub struct InsertService<S, K> {
    inner: S,
    shared: Arc<Shared<K>>,
}

impl<S, K> InsertService<S, K> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, K, B> Service<Request<B>> for InsertService<S, K>
where
    S: Service<Request<B>>,
    K: HttpKey<B>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = InsertFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let pending = self
            .shared
            .policy
            .write_keys(&request)
            .map(|key| key.map(|key| self.shared.guard.begin_write(key.as_bytes())));
        InsertFuture {
            future: self.inner.call(request),
            pending,
        }
    }
}

impl<S: Clone, K> Clone for InsertService<S, K> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, K> fmt::Debug for InsertService<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InsertService")
            .field("inner", &self.inner)
            .field("guard", &self.shared.guard)
            .finish_non_exhaustive()
    }
}

pin_project! {
    /// The inner service's future, holding the insert's [`PendingWrite`]
    /// until it completes.
    pub struct InsertFuture<F> {
        #[pin]
        future: F,
        pending: [Option<PendingWrite>; 2],
    }
}

impl<F: Future> Future for InsertFuture<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let output = ready!(this.future.poll(cx));
        *this.pending = [None, None];
        Poll::Ready(output)
    }
}

impl<F> fmt::Debug for InsertFuture<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InsertFuture")
            .field("pending", &self.pending)
            .finish_non_exhaustive()
    }
}
