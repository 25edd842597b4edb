//! The `http` form of the guard layer: keys from requests, 404 for misses.

use std::fmt;

use http::{Request, Response, StatusCode};

use super::{GuardLayer, GuardPolicy};
use crate::guard::Guard;

/// Picks the key of an HTTP request, or `None` to let it through unguarded
/// (other routes, other methods).
///
/// Implemented for closures `Fn(&Request<B>) -> Option<&str>` that borrow
/// the key from the request, so that taking it allocates nothing:
/// `|req: &Request<Body>| req.uri().path().strip_prefix("/items/")`.
pub trait HttpKey<B>: Send + Sync + 'static {
    /// The key of `request`, if it has one.
    fn key<'r>(&self, request: &'r Request<B>) -> Option<&'r str>;
}

impl<B, F> HttpKey<B> for F
where
    F: for<'r> Fn(&'r Request<B>) -> Option<&'r str> + Send + Sync + 'static,
{
    #[inline]
    fn key<'r>(&self, request: &'r Request<B>) -> Option<&'r str> {
        self(request)
    }
}

/// The policy of [`GuardLayer::for_http`].
pub struct HttpPolicy<K, ResBody> {
    key: K,
    absent: fn() -> Response<ResBody>,
}

impl<K, ResBody: Default> HttpPolicy<K, ResBody> {
    /// Keys from `key`, misses answered 404 with an empty body.
    pub fn new(key: K) -> Self {
        Self {
            key,
            absent: not_found::<ResBody>,
        }
    }
}

/// The default answer for an absent key: 404 with an empty body.
fn not_found<ResBody: Default>() -> Response<ResBody> {
    let mut response = Response::new(ResBody::default());
    *response.status_mut() = StatusCode::NOT_FOUND;
    response
}

impl<B, ResBody, K: HttpKey<B>> GuardPolicy<Request<B>, Response<ResBody>>
    for HttpPolicy<K, ResBody>
{
    #[inline]
    fn key<'r>(&self, request: &'r Request<B>) -> Option<&'r [u8]> {
        self.key.key(request).map(str::as_bytes)
    }

    #[inline]
    fn absent_response(&self) -> Response<ResBody> {
        (self.absent)()
    }

    /// 2xx: found; 404: not found; anything else says neither.
    fn found(&self, response: &Response<ResBody>) -> Option<bool> {
        let status = response.status();
        if status.is_success() {
            Some(true)
        } else if status == StatusCode::NOT_FOUND {
            Some(false)
        } else {
            None
        }
    }
}

impl<K, ResBody> fmt::Debug for HttpPolicy<K, ResBody> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpPolicy").finish_non_exhaustive()
    }
}

impl<K, ResBody> GuardLayer<HttpPolicy<K, ResBody>> {
    /// Guards `http` services (axum routers and handlers, hyper services):
    /// `key` picks the key of a request, and a key the guard rules out is
    /// answered 404 with an empty body, without calling the service. After
    /// `MaybePresent`, a 404 from the service counts as a false positive
    /// and a 2xx as found.
    ///
    /// ```
    /// use axum::{Router, body::Body, extract::Path, http::Request, routing::get};
    /// use bloomguard::{Guard, GuardLayer};
    ///
    /// let guard = Guard::builder().expected_items(1_000_000).build()?;
    /// let app: Router = Router::new()
    ///     .route("/items/{id}", get(|Path(id): Path<String>| async move { id }))
    ///     .layer(GuardLayer::for_http(guard, |req: &Request<Body>| {
    ///         req.uri().path().strip_prefix("/items/")
    ///     }));
    /// # let _ = app;
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// ```
    ///
    /// The bound is on the closure itself so that Rust infers a key borrowed
    /// from the request; a key type of your own goes through
    /// [`HttpPolicy::new`] and [`GuardLayer::with_policy`].
    pub fn for_http<B>(guard: Guard, key: K) -> Self
    where
        K: for<'r> Fn(&'r Request<B>) -> Option<&'r str> + Send + Sync + 'static,
        ResBody: Default,
    {
        Self::with_policy(guard, HttpPolicy::new(key))
    }

    /// Answers absent keys with `response()` instead of an empty 404.
    pub fn with_absent_response(self, response: fn() -> Response<ResBody>) -> Self
    where
        K: Clone,
    {
        let HttpPolicy { key, .. } = std::sync::Arc::unwrap_or_clone(self.policy);
        Self::with_policy(
            self.guard,
            HttpPolicy {
                key,
                absent: response,
            },
        )
    }
}

impl<K: Clone, ResBody> Clone for HttpPolicy<K, ResBody> {
    fn clone(&self) -> Self {
        Self {
            key: self.key.clone(),
            absent: self.absent,
        }
    }
}
