//! Middleware that answers "absent" for keys the guard rules out, without
//! calling the inner service.
//!
//! [`GuardLayer`] wraps a service in a [`GuardService`]: it takes the key of
//! each request, checks it, and on [`Verdict::Absent`] answers at once (no
//! call, and no allocation unless the key or the answer needs one: a
//! percent-encoded id, [`PathKey::map`](http::PathKey::map),
//! `with_absent_header`; or the check does, as [`Guard::check`] says: a
//! staleness sample, a thread's first check). Otherwise it calls the inner service and counts what
//! the response says — found, not found (a false positive after
//! `MaybePresent`), or neither — in the guard's statistics. Errors pass
//! through unchanged and are never counted as "not found". Requests without
//! a key pass through unguarded.
//!
//! Two ready-made forms:
//! - [`GuardLayer::for_loader`] over a loader service
//!   `Service<K, Response = Option<V>>`: the key is the request, a miss is `Ok(None)`.
//! - [`GuardLayer::for_http`] over `http` services (axum, hyper): a key
//!   function picks the key from the request, a miss is a 404 with an empty
//!   body (or the response given to [`with_absent_response`](GuardLayer::with_absent_response)),
//!   and a 404 after `MaybePresent` is a false positive.
//!
//! For the write path, [`InsertLayer`] inserts a request's key before the
//! inner service writes it (the ordering rule of the [guard](crate::guard)).
//!
//! Where the guard layer sits decides what its answer skips. Outside an
//! authentication layer, it answers an absent id 404 before the 401 a
//! stored one gets, which tells anyone which ids exist; outside a CORS or
//! caching layer, its 404 lacks their headers. Make it the innermost:
//! axum runs the last `.layer` added first, so add the guard's before
//! theirs (`.layer(guard).layer(auth).layer(cors)` runs CORS, then
//! authentication, then the guard).
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! use bloomguard::{Guard, GuardLayer};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! let guard = Guard::builder().expected_items(1_000).build()?;
//! guard.insert("item:1");
//! let backend = service_fn(|key: String| async move {
//!     Ok::<_, std::convert::Infallible>((key == "item:1").then_some(42))
//! });
//! let service = ServiceBuilder::new()
//!     .layer(GuardLayer::for_loader(guard.clone()))
//!     .service(backend);
//! assert_eq!(service.clone().oneshot("item:1".to_string()).await?, Some(42));
//! assert_eq!(service.oneshot("item:2".to_string()).await?, None); // the backend was not called
//! assert_eq!(guard.stats().checks.absent, 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

mod future;
mod http;
mod insert;

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use tower_layer::Layer;
use tower_service::Service;

use crate::guard::{Guard, Verdict};
pub use future::ResponseFuture;
pub use http::{HttpKey, HttpPolicy, KeyFn, PathKey, key_fn};
pub use insert::{InsertFuture, InsertLayer, InsertService};

/// How a [`GuardService`] reads a request and its response: the key, the
/// answer on `Absent`, and whether a response means found.
///
/// [`LoaderPolicy`] and [`HttpPolicy`] are the ready-made ones; implement it
/// for other request shapes.
pub trait GuardPolicy<Request, Response> {
    /// The request's key: borrowed from it where it can be (no allocation),
    /// owned where it must be made (a decoded id, a prefix); `None` when the
    /// request has no key and passes through unguarded.
    fn key<'r>(&self, request: &'r Request) -> Option<Cow<'r, [u8]>>;

    /// The response for a request whose key is absent. Called on the hot
    /// path: it should not allocate.
    fn absent_response(&self) -> Response;

    /// `Some(true)` if the response says the key was found, `Some(false)` if
    /// not found, `None` if it says neither (a 5xx, a redirect…).
    fn found(&self, response: &Response) -> Option<bool>;

    /// For a key the guard answered `MaybePresent`: `Some(response)` answers
    /// the request as "present" without calling the service, where the
    /// policy's [`Verify`](crate::Verify) trusts this key; `None` (the default) calls it.
    #[inline]
    fn answer_trusted(&self, key: &[u8]) -> Option<Response> {
        let _ = key;
        None
    }
}

/// The policy of [`GuardLayer::for_loader`]: the request is the key, the
/// response an `Option` (`None`: not found).
#[derive(Debug, Clone, Copy, Default)]
pub struct LoaderPolicy;

impl<K: AsRef<[u8]>, V> GuardPolicy<K, Option<V>> for LoaderPolicy {
    #[inline]
    fn key<'r>(&self, key: &'r K) -> Option<Cow<'r, [u8]>> {
        Some(Cow::Borrowed(key.as_ref()))
    }

    #[inline]
    fn absent_response(&self) -> Option<V> {
        None
    }

    fn found(&self, response: &Option<V>) -> Option<bool> {
        Some(response.is_some())
    }
}

/// Wraps services in a [`GuardService`]. See the [module docs](self).
pub struct GuardLayer<P> {
    shared: Arc<Shared<P>>,
    shadow: bool,
}

/// What a layer's services share (the guard, and the policy or, for
/// [`InsertLayer`](crate::InsertLayer), the key extractor) behind one
/// reference count: axum clones the service for every request, and each
/// count is a locked instruction on a line every core's requests touch.
#[derive(Clone)]
pub(crate) struct Shared<P> {
    pub(crate) guard: Guard,
    pub(crate) policy: P,
}

impl GuardLayer<LoaderPolicy> {
    /// Guards a loader service `Service<K, Response = Option<V>>`: the
    /// request is the key, and a key the guard rules out is answered
    /// `Ok(None)` without a call.
    pub fn for_loader(guard: Guard) -> Self {
        Self::with_policy(guard, LoaderPolicy)
    }
}

impl<P> GuardLayer<P> {
    /// Guards services with a policy of your own.
    pub fn with_policy(guard: Guard, policy: P) -> Self {
        Self {
            shared: Arc::new(Shared { guard, policy }),
            shadow: false,
        }
    }

    /// Shadow mode: every request goes to the inner service whatever the
    /// guard says; verdicts are counted, and an `Absent` whose response
    /// says "found" is counted as a would-be false negative
    /// ([`GuardStats::would_be_false_negatives`](crate::GuardStats::would_be_false_negatives))
    /// and logged. The calls the guard would have saved are
    /// [`GuardStats::shadowed_absent`](crate::GuardStats::shadowed_absent).
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// use bloomguard::{Guard, GuardLayer};
    /// use tower::{Layer, ServiceExt, service_fn};
    ///
    /// let guard = Guard::builder().expected_items(1_000).build()?;
    /// // The store holds a key written behind the guard's back: a bug in
    /// // the write path, which shadow mode shows before it costs an answer.
    /// let backend = service_fn(|key: String| async move {
    ///     Ok::<_, std::convert::Infallible>((key == "item:7").then_some(7))
    /// });
    /// let service = GuardLayer::for_loader(guard.clone()).shadow().layer(backend);
    /// assert_eq!(service.oneshot("item:7".to_string()).await?, Some(7)); // asked anyway
    /// assert_eq!(guard.stats().would_be_false_negatives, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub fn shadow(mut self) -> Self {
        self.shadow = true;
        self
    }

    /// The guard this layer checks.
    pub fn guard(&self) -> &Guard {
        &self.shared.guard
    }
}

impl<P> Clone for GuardLayer<P> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
            shadow: self.shadow,
        }
    }
}

impl<S, P> Layer<S> for GuardLayer<P> {
    type Service = GuardService<S, P>;

    fn layer(&self, inner: S) -> Self::Service {
        GuardService {
            inner,
            shared: Arc::clone(&self.shared),
            shadow: self.shadow,
        }
    }
}

impl<P> fmt::Debug for GuardLayer<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardLayer")
            .field("guard", &self.shared.guard)
            .field("shadow", &self.shadow)
            .finish_non_exhaustive()
    }
}

/// A service behind a guard, made by [`GuardLayer`]. Each request's key is
/// checked with [`Guard::check`], so a clone per request (as axum's router
/// makes) costs no more than a service kept per connection.
pub struct GuardService<S, P> {
    inner: S,
    shared: Arc<Shared<P>>,
    shadow: bool,
}

impl<S, P> GuardService<S, P> {
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

impl<S, P, Request> Service<Request> for GuardService<S, P>
where
    S: Service<Request>,
    P: GuardPolicy<Request, S::Response>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future, P, S::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    #[inline]
    fn call(&mut self, request: Request) -> Self::Future {
        let Shared { guard, policy } = &*self.shared;
        let Some(key) = policy.key(&request) else {
            return ResponseFuture::passed_through(self.inner.call(request));
        };
        let verdict = guard.check(&key);
        let answer = match verdict {
            Verdict::Absent if self.shadow => {
                guard.count_shadowed_absent();
                None
            }
            Verdict::Absent => Some(policy.absent_response()),
            // A fenced guard's "maybe" is not its filters': never trusted.
            Verdict::MaybePresent if self.shadow || guard.is_fenced() => None,
            Verdict::MaybePresent => {
                let trusted = policy.answer_trusted(&key);
                if trusted.is_some() {
                    guard.count_unverified_positive();
                }
                trusted
            }
            Verdict::Warming => None,
        };
        drop(key);
        match answer {
            Some(response) => ResponseFuture::answered(response),
            None => ResponseFuture::called::<Request>(
                self.inner.call(request),
                Arc::clone(&self.shared),
                verdict,
            ),
        }
    }
}

impl<S: Clone, P> Clone for GuardService<S, P> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
            shadow: self.shadow,
        }
    }
}

impl<S: fmt::Debug, P> fmt::Debug for GuardService<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardService")
            .field("inner", &self.inner)
            .field("guard", &self.shared.guard)
            .finish_non_exhaustive()
    }
}
