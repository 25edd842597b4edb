//! The `http` form of the guard layer: keys from requests, 404 for misses.

use std::fmt;

use std::borrow::Cow;

use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use percent_encoding::percent_decode_str;

use super::{GuardLayer, GuardPolicy};
use crate::error::ConfigError;
use crate::guard::Guard;
use crate::verify::Verify;

/// Picks the key of an HTTP request, or `None` to let it through unguarded
/// (other routes, other methods).
///
/// The guard's key and the store's key must be the same bytes, or the guard
/// answers 404 for items that exist. A router hands its handlers the
/// *decoded* path segment (`/items/caf%C3%A9` → `café`), so the key must be
/// decoded the same way: [`PathKey`] does that for a route template, and is
/// what most services want. For anything else, implement this trait, or
/// wrap a closure with [`key_fn`]; return a borrowed key where you can (the
/// absent path then allocates nothing) and an owned one where you must.
pub trait HttpKey<B>: Send + Sync + 'static {
    /// The key of `request`, if it has one: what a [`GuardLayer`] checks.
    fn key<'r>(&self, request: &'r Request<B>) -> Option<Cow<'r, str>>;

    /// The keys an [`InsertLayer`](crate::InsertLayer) inserts before the
    /// write (up to two; `[key, None]` unless the implementation knows
    /// better). The two sides err in opposite directions: a write keyed
    /// needlessly costs a false positive, a write missed answers 404 for a
    /// stored item; a read keyed wrongly answers 404, a read missed asks
    /// the backend. So the write side may key more than `key` would, and
    /// more than one id where it cannot tell which one the store gets.
    fn write_keys<'r>(&self, request: &'r Request<B>) -> [Option<Cow<'r, str>>; 2] {
        [self.key(request), None]
    }
}

/// A closure as an [`HttpKey`], from [`key_fn`].
#[derive(Clone, Copy)]
pub struct KeyFn<F>(F);

/// Makes a closure `|req| -> Option<Cow<str>>` an [`HttpKey`] (the bound
/// here lets Rust infer a key borrowed from the request).
///
/// The closure answers for every request the layer wraps: return `None`
/// for each one that is not a read of the item (other methods, other
/// routes, deeper paths), or the guard answers 404 for them. The one below
/// cannot tell `/items/{id}` from a static sibling route such as
/// `/items/featured`: layer it on the item's route alone
/// (`.route("/items/{id}", get(handler).layer(…))`), not on a router that
/// holds both, or check axum's `MatchedPath` in the closure. An
/// [`InsertLayer`](crate::InsertLayer) needs a closure of its own, one that
/// keys the writes: the one below answers `None` for them, and an insert
/// layer given it would insert nothing.
///
/// ```
/// use std::borrow::Cow;
/// use axum::{body::Body, http::{Method, Request}};
/// use bloomguard::layer::{HttpKey, key_fn};
///
/// // GET /items/{id}: the tenant header and the decoded id, as the store
/// // names the item.
/// let key = key_fn(|req: &Request<Body>| {
///     if req.method() != Method::GET {
///         return None; // a write creates the id: never 404 it
///     }
///     let tenant = req.headers().get("x-tenant")?.to_str().ok()?;
///     let id = req.uri().path().strip_prefix("/items/")?;
///     if id.is_empty() || id.contains('/') {
///         return None; // `/items/` or `/items/42/comments`: another route
///     }
///     let id = percent_encoding::percent_decode_str(id).decode_utf8().ok()?;
///     Some(Cow::Owned(format!("{tenant}:{id}")))
/// });
/// let get = |path: &str| {
///     Request::get(path).header("x-tenant", "t").body(Body::empty()).unwrap()
/// };
/// assert_eq!(key.key(&get("/items/a%20b")).as_deref(), Some("t:a b"));
/// assert_eq!(key.key(&get("/items/42/comments")), None);
/// ```
pub fn key_fn<B, F>(key: F) -> KeyFn<F>
where
    F: for<'r> Fn(&'r Request<B>) -> Option<Cow<'r, str>> + Send + Sync + 'static,
{
    KeyFn(key)
}

impl<B, F> HttpKey<B> for KeyFn<F>
where
    F: for<'r> Fn(&'r Request<B>) -> Option<Cow<'r, str>> + Send + Sync + 'static,
{
    #[inline]
    fn key<'r>(&self, request: &'r Request<B>) -> Option<Cow<'r, str>> {
        (self.0)(request)
    }
}

impl<F> fmt::Debug for KeyFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyFn").finish_non_exhaustive()
    }
}

/// The key of a route's one path parameter, decoded as axum's `Path`
/// extractor decodes it: the raw segment percent-decoded (`%20` → space,
/// `%2F` → `/`, `+` left as it is), and `None` where that is not UTF-8 (axum
/// rejects those requests itself). So the guard sees the very `id` that a
/// handler taking `Path(id): Path<String>` sees, and a store key made from
/// it by one function ([`map`](Self::map)) agrees on both sides.
///
/// A segment that needs no decoding is borrowed: the absent path of a plain
/// id allocates nothing.
///
/// **Static routes beside the template.** axum's `Router::layer` wraps every
/// route of the router, and `/items/featured` has the shape of
/// `/items/{id}`. With the `axum` feature, `PathKey` takes a key only on the
/// route axum matched to this template (its `MatchedPath`, under any
/// `nest`), so `/items/featured` reaches its own handler. A request axum
/// routed to a `nest_service` or a fallback has no matched route (such a
/// service routes for itself): the guard lets it through, whether its layer
/// is the router's or wraps the service itself, and says so once at WARN.
/// Guard such a service with a layer inside its own `Router`, where its
/// routes are matched. (Routing it with `route_service("/items/{id}", …)`
/// would not do: the outer route then matches `/items/featured` too, which
/// the service may serve itself.) Taking the key from the matched
/// route needs the layer inside the router (`Router::layer`,
/// `route_layer`): one wrapped
/// around the router from outside (`GuardLayer::layer(router)`, a
/// `ServiceBuilder` around the app) runs before axum routes and sees no
/// matched route. Without the feature, or outside, put the layer on the
/// route alone (`get(read_item).layer(…)`), or keep static routes of the
/// template's shape out from under it: the guard would answer 404 for them.
///
/// **Nests, rewrites, and the two sides.** A [`GuardLayer`] keys a request
/// only where it is sure of the item.
/// - With the `axum` feature, all of these must hold, and the id is then
///   taken from the path the request came with (axum's `OriginalUri`):
///   - the route axum matched ends with the template;
///   - that route has no capture but the template's;
///   - the route of the layer's own router is no longer than the template
///     (a `nest`'s literal prefix is stripped before the layer, so a layer
///     inside `nest("/api", …)` keyed `/items/{id}` guards
///     `/api/items/{id}`);
///   - the path the layer sees still holds the id (a layer below a nest
///     that stripped it, `nest("/users/{user}", …)`, keys nothing);
///   - no middleware rewrote the end of the path since it came (it may name
///     another item then).
///
///   Not keyed, then: a longer route of the layer's own router,
///   `/users/{u}/items/{id}`, and `/items/{id}` inside
///   `nest("/users/{u}", …)`, whose handlers may read another key (they get
///   both captures); and a layer outside a nest, unless keyed with the
///   whole template, `/api/items/{id}`.
/// - Without the feature, only a path the layer sees that is the whole
///   template is keyed (a layer outside a `nest` then lets the nest's
///   requests through unguarded: give it the whole template,
///   `/api/items/{id}`). It cannot tell what a `nest` stripped: a layer
///   inside `nest("/users/{u}", …)` keys `/items/{id}`'s id alone, while
///   the handler gets both captures and may store another key. Turn the
///   feature on (it is on by default), or key with a [`key_fn`] that reads
///   both captures (a `PathKey` takes one: the whole template
///   `/users/{u}/items/{id}` has two).
///
/// An [`InsertLayer`](crate::InsertLayer) keys a write wherever the path
/// ends with the template from its parameter on (the literals before it
/// need only agree where the path still has them; trailing slashes are
/// tried off, so a `/items/{id}/` alias is written under `/items/{id}`),
/// in the path it sees and, where that differs, in the one the request
/// came with ([`HttpKey::write_keys`]): every id a read of the item can be
/// keyed with. A needless insert costs only a false positive.
///
/// So put both layers inside any middleware that rewrites the path before
/// routing (a normalizer, a case-folder): a rewrite the insert layer never
/// sees (other than trimmed trailing slashes) cannot be followed, and a
/// guard outside one keys the id as it came while the store has it as
/// rewritten. Inside the app, below a rewrite, the guard lets through what
/// it cannot tie to the original path (with the `axum` feature, which
/// reads that path; without it both layers see only the path that reaches
/// them, so no middleware may rewrite it between the router and them: a
/// guard there keys the rewritten id while the handler's `Path` holds the
/// routed one). One wiring stays out of reach: an
/// insert layer below a nest that strips the id sees only the id as it
/// came, so an id a middleware rewrote before that nest cannot be followed
/// while a guard above the nest keys it; put the insert layer above such
/// a nest.
///
/// **Ids the handler parses.** The key is the segment's text. A handler
/// taking `Path<u64>` or `Path<Uuid>` reads `/items/042` as item 42 and an
/// upper-case UUID as the lower-case one; give both sides one spelling with
/// [`map`](Self::map) (parse, and format the parsed value), or the guard
/// answers 404 for the other spellings of a stored id.
///
/// ```
/// use axum::http::{Method, Request};
/// use bloomguard::layer::{HttpKey, PathKey};
///
/// let key = PathKey::route("/items/{id}").method(Method::GET);
/// let request = |uri: &str| Request::get(uri).body(()).unwrap();
/// assert_eq!(key.key(&request("/items/42")).as_deref(), Some("42"));
/// assert_eq!(key.key(&request("/items/caf%C3%A9")).as_deref(), Some("café"));
/// assert_eq!(key.key(&request("/items/a%20b")).as_deref(), Some("a b"));
/// assert_eq!(key.key(&request("/items/x%2Fy")).as_deref(), Some("x/y"));
/// assert_eq!(key.key(&request("/items/a+b")).as_deref(), Some("a+b"));
/// assert_eq!(key.key(&request("/users/42")), None); // another route
///
/// // One function names the item for the guard and for the store.
/// fn item_key(id: &str) -> String { format!("item:{id}") }
/// let key = PathKey::route("/items/{id}").map(item_key);
/// assert_eq!(key.key(&request("/items/%34%32")).as_deref(), Some("item:42"));
/// ```
#[derive(Clone)]
pub struct PathKey {
    method: Option<Method>,
    /// The template's segments after the leading `/`; `None` marks the parameter.
    segments: Vec<Option<String>>,
    map: Option<fn(&str) -> String>,
}

impl PathKey {
    /// Matches paths of `template`: literal segments and one `{name}`
    /// parameter, as axum spells routes (`"/items/{id}"`,
    /// `"/users/{user}/seen"`).
    ///
    /// # Panics
    /// If the template does not start with `/`, has no parameter or more
    /// than one, or a wildcard (`{*path}`), whose id spans segments: a
    /// programming error, caught where the route is declared. Key a
    /// wildcard route with a [`key_fn`] that reads what the handler stores,
    /// and never under a `{id}` template (the guard would key one segment
    /// of an id that may hold several).
    pub fn route(template: &str) -> Self {
        let rest = template
            .strip_prefix('/')
            .unwrap_or_else(|| panic!("route {template:?} must start with '/'"));
        let segments: Vec<Option<String>> = rest
            .split('/')
            .map(|segment| {
                assert!(
                    !segment.starts_with("{*"),
                    "route {template:?}: a wildcard's id spans segments, which PathKey does not key"
                );
                (!is_parameter(segment)).then(|| segment.to_owned())
            })
            .collect();
        let parameters = segments.iter().filter(|s| s.is_none()).count();
        assert!(
            parameters == 1,
            "route {template:?} must have exactly one {{parameter}}, has {parameters}"
        );
        Self {
            method: None,
            segments,
            map: None,
        }
    }

    /// Only requests of this method have a key; others pass through
    /// (`.method(Method::GET)` leaves `HEAD` to the handler).
    ///
    /// Without it, a [`GuardLayer`] guards the reads, `GET` and `HEAD`, and
    /// lets every other method through: it cannot know whether a `PUT`
    /// creates the id, and a `DELETE` or a CORS preflight must reach the
    /// handler whatever the filter holds. An [`InsertLayer`] without it
    /// inserts for every method (a needless insert costs a false positive,
    /// a missed one a wrong 404): give it the write method.
    ///
    /// [`InsertLayer`]: crate::InsertLayer
    #[must_use]
    pub fn method(mut self, method: Method) -> Self {
        self.method = Some(method);
        self
    }

    /// Turns the decoded parameter into the key the store uses (a prefix,
    /// a namespace). Use the same function where the handler builds the
    /// store key, on the [`InsertLayer`](crate::InsertLayer)'s `PathKey`
    /// too, and make the key source list the same keys: a guard whose
    /// reads are mapped and whose inserts are not answers 404 for every
    /// new item until a rebuild. The key is then owned: one allocation per
    /// guarded request.
    #[must_use]
    pub fn map(mut self, to_key: fn(&str) -> String) -> Self {
        self.map = Some(to_key);
        self
    }

    /// The decoded parameter of `path`, if `path` is this route.
    pub fn parameter<'p>(&self, path: &'p str) -> Option<Cow<'p, str>> {
        let mut parts = path.strip_prefix('/')?.split('/');
        let parameter = Self::parameter_of(self.segments.iter(), &mut parts)?;
        if parts.next().is_some() {
            return None;
        }
        percent_decode_str(parameter).decode_utf8().ok()
    }

    /// The raw parameter where `path` ends with the template from its
    /// parameter on, and the template's literals before it agree with the
    /// path's segments before it: all of them ([`Prefix::Whole`]: the id
    /// wherever a nest's prefix puts the whole template), or those the path
    /// still has ([`Prefix::WherePresent`]: a nest may have stripped the
    /// others).
    fn raw_parameter_at_end<'p>(&self, path: &'p str, prefix: Prefix) -> Option<&'p str> {
        let mut parts = path.strip_prefix('/')?.rsplit('/');
        let parameter = self.parameter_from_end(&mut parts)?;
        let mut before = self
            .segments
            .iter()
            .rev()
            .skip_while(|s| s.is_some())
            .skip(1);
        let agrees = before.all(|segment| match parts.next() {
            None => prefix == Prefix::WherePresent,
            Some(part) => segment
                .as_deref()
                .is_some_and(|literal| unescapes_to(literal, part)),
        });
        agrees.then_some(parameter)
    }

    /// The decoded parameter where the path ends with the whole template.
    #[cfg(feature = "axum")]
    fn parameter_at_end<'p>(&self, path: &'p str) -> Option<Cow<'p, str>> {
        let parameter = self.raw_parameter_at_end(path, Prefix::Whole)?;
        percent_decode_str(parameter).decode_utf8().ok()
    }

    /// The decoded parameter where the path ends with the template as far
    /// as it goes ([`Prefix::WherePresent`]), trying once more without
    /// trailing slashes (a normalizing middleware may trim them before
    /// routing).
    fn parameter_near_end<'p>(&self, path: &'p str) -> Option<Cow<'p, str>> {
        let trimmed = path.trim_end_matches('/');
        let parameter = self
            .raw_parameter_at_end(path, Prefix::WherePresent)
            .or_else(|| {
                (trimmed != path)
                    .then(|| self.raw_parameter_at_end(trimmed, Prefix::WherePresent))
                    .flatten()
            })?;
        percent_decode_str(parameter).decode_utf8().ok()
    }

    /// The raw parameter where the reversed segments `parts` begin with the
    /// template's, from its end back to the parameter.
    fn parameter_from_end<'p>(&self, parts: &mut impl Iterator<Item = &'p str>) -> Option<&'p str> {
        let from_parameter = self
            .segments
            .iter()
            .rev()
            .take_while(|s| s.is_some())
            .chain([&None]);
        Self::parameter_of(from_parameter, parts)
    }

    /// The raw parameter where `parts` has the template's `segments`, in
    /// the same order (a literal is compared raw, as axum matches it).
    fn parameter_of<'s, 'p>(
        segments: impl Iterator<Item = &'s Option<String>>,
        parts: &mut impl Iterator<Item = &'p str>,
    ) -> Option<&'p str> {
        let mut parameter = None;
        for segment in segments {
            let part = parts.next()?;
            match segment {
                Some(literal) if unescapes_to(literal, part) => {}
                Some(_) => return None,
                None if part.is_empty() => return None,
                None => parameter = Some(part),
            }
        }
        parameter
    }

    /// Whether `matched`, a route as axum spells it (`/api/items/{id}`
    /// under a nest), ends with this template: the same literals, and a
    /// `{parameter}` (of any name) where the template has one.
    #[cfg(feature = "axum")]
    fn is_route(&self, matched: &str) -> bool {
        let mut parts = matched.rsplit('/');
        self.segments.iter().rev().all(|segment| {
            let Some(part) = parts.next() else {
                return false;
            };
            match segment {
                Some(literal) => part == literal,
                // `{*…}` is a wildcard of many segments.
                None => is_parameter(part) && !part.starts_with("{*"),
            }
        })
    }
}

/// Whether a route's segment is a whole `{parameter}`: `{{…}}` is literal
/// text.
fn is_parameter(segment: &str) -> bool {
    segment.starts_with('{') && !segment.starts_with("{{") && segment.ends_with('}')
}

/// Whether `literal`, a route's text, is `raw` once its `{{` and `}}`
/// escapes are undone, as axum matches it (without allocating per request).
fn unescapes_to(literal: &str, raw: &str) -> bool {
    let mut raw = raw.chars();
    let mut literal = literal.chars().peekable();
    while let Some(c) = literal.next() {
        if matches!(c, '{' | '}') && literal.peek() == Some(&c) {
            literal.next();
        }
        if raw.next() != Some(c) {
            return false;
        }
    }
    raw.next().is_none()
}

/// The captures of a route as axum spells it: every `{` not part of a
/// `{{` escape opens one, whole segments (`{id}`, `{*rest}`) or parts of
/// one (`/t_{tenant}`).
#[cfg(feature = "axum")]
fn captures(route: &str) -> usize {
    let mut rest = route;
    let mut count = 0;
    while let Some(at) = rest.find('{') {
        match rest[at + 1..].strip_prefix('{') {
            Some(after_escape) => rest = after_escape,
            None => {
                count += 1;
                rest = &rest[at + 1..];
            }
        }
    }
    count
}

/// How much of the template before its parameter a path must hold
/// ([`PathKey::raw_parameter_at_end`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Prefix {
    #[cfg(feature = "axum")]
    Whole,
    WherePresent,
}

impl PathKey {
    /// Whether a guard may answer `request`: of the method given, or
    /// without one, a read.
    fn reads<B>(&self, request: &Request<B>) -> bool {
        match &self.method {
            Some(method) => method == request.method(),
            None => matches!(*request.method(), Method::GET | Method::HEAD),
        }
    }

    /// Whether an insert layer inserts for `request`: of the method given,
    /// or without one, whatever its method.
    fn writes<B>(&self, request: &Request<B>) -> bool {
        self.method.as_ref().is_none_or(|m| m == request.method())
    }

    fn mapped<'r>(&self, parameter: Cow<'r, str>) -> Cow<'r, str> {
        match self.map {
            Some(to_key) => Cow::Owned(to_key(&parameter)),
            None => parameter,
        }
    }
}

/// Says once a process that requests of a template's shape pass a
/// `PathKey` unguarded, axum having routed them to no route of its own: the
/// wiring looks guarded, and is not.
#[cfg(feature = "axum")]
#[cold]
fn report_unmatched_route() {
    static REPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !REPORTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            "PathKey lets through requests that an axum router routed to a nest_service or a \
             fallback (no matched route: it cannot tell the template's route from a static \
             sibling there): guard such a service with a layer inside its own Router, where its \
             routes are matched"
        );
    }
}

/// The whole path the request came with: inside an axum router, a layer
/// under a `nest` sees the path with the nest's prefix stripped; every
/// layer sees the same original.
fn original_path<B>(request: &Request<B>) -> &str {
    #[cfg(feature = "axum")]
    if let Some(original) = request.extensions().get::<axum::extract::OriginalUri>() {
        return original.path();
    }
    request.uri().path()
}

impl<B> HttpKey<B> for PathKey {
    /// Only where the request is sure to be this route: the route axum
    /// matched ends with the template (the `axum` feature; none where an
    /// axum router routed the request to a nested service or a fallback),
    /// or before any router, the whole path is the template.
    #[inline]
    fn key<'r>(&self, request: &'r Request<B>) -> Option<Cow<'r, str>> {
        if !self.reads(request) {
            return None;
        }
        // A router's layer wraps its static routes too: `/items/featured`
        // has the template's shape, but axum routed it elsewhere.
        #[cfg(feature = "axum")]
        let parameter = match request.extensions().get::<axum::extract::MatchedPath>() {
            // A capture besides the template's own (in a nest's prefix:
            // `nest("/users/{user}", …)`) is the handler's too, and its key
            // may be made of both.
            Some(matched)
                if !self.is_route(matched.as_str()) || captures(matched.as_str()) != 1 =>
            {
                return None;
            }
            Some(_) => {
                // The id where the request came with it, if the path this
                // layer sees still holds that segment unchanged: a path
                // rewritten since (it no longer ends what came, or a nest
                // stripped the id and a rewrite may have changed it before)
                // may name another item than the one the store has.
                let (seen, original) = (request.uri().path(), original_path(request));
                // A segment the layer sees beyond the template's is the
                // route's own (a nest's prefix is stripped before the layer):
                // `/users/{user}/items/{id}` is another route than
                // `/items/{id}`, and its handler may read another key.
                if seen.matches('/').count() > self.segments.len()
                    || !original.ends_with(seen)
                    || self
                        .raw_parameter_at_end(seen, Prefix::WherePresent)
                        .is_none()
                {
                    return None;
                }
                self.parameter_at_end(original)?
            }
            // Routed by an axum router (it leaves the path it came with) to
            // no route of its own: a `nest_service` or a fallback, which
            // routes for itself and may hold a static sibling of the
            // template. (A layer around the service such a route reached
            // looks the same: axum's public types do not tell them apart.)
            None if request
                .extensions()
                .get::<axum::extract::OriginalUri>()
                .is_some() =>
            {
                if self.parameter(request.uri().path()).is_some() {
                    report_unmatched_route();
                }
                return None;
            }
            // Before any router: the whole path must be the template.
            None => self.parameter(request.uri().path())?,
        };
        #[cfg(not(feature = "axum"))]
        let parameter = self.parameter(request.uri().path())?;
        Some(self.mapped(parameter))
    }

    /// The id where the path the layer sees ends with the template from
    /// its parameter on, and the same in the path the request came with
    /// where the two differ (a nest stripped a prefix, or a middleware
    /// rewrote it), matched route or not: every id a read of the stored
    /// item can be keyed with (see "Nests, rewrites, and the two sides"
    /// above). A needless insert elsewhere
    /// (`POST /items/featured`, `/users/7/items/42`) only costs a false
    /// positive.
    fn write_keys<'r>(&self, request: &'r Request<B>) -> [Option<Cow<'r, str>>; 2] {
        if !self.writes(request) {
            return [None, None];
        }
        let seen = request.uri().path();
        let original = original_path(request);
        let first = self.parameter_near_end(seen);
        let second = (original != seen)
            .then(|| self.parameter_near_end(original))
            .flatten()
            .filter(|second| first.as_ref() != Some(second));
        [
            first.map(|id| self.mapped(id)),
            second.map(|id| self.mapped(id)),
        ]
    }
}

impl fmt::Debug for PathKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PathKey")
            .field("method", &self.method)
            .field("segments", &self.segments)
            .field("mapped", &self.map.is_some())
            .finish()
    }
}

/// Makes a response the guard gives without calling the service.
type Respond<ResBody> = fn() -> Response<ResBody>;

/// The policy of [`GuardLayer::for_http`].
pub struct HttpPolicy<K, ResBody> {
    key: K,
    absent: Respond<ResBody>,
    /// Added to the guard's own "absent" responses, to tell them from a handler's.
    absent_header: Option<(HeaderName, HeaderValue)>,
    /// Which "maybe" keys are answered `present()` without the service.
    trusted: Option<(Verify, Respond<ResBody>)>,
}

impl<K, ResBody: Default> HttpPolicy<K, ResBody> {
    /// Keys from `key`, misses answered 404 with an empty body.
    pub fn new(key: K) -> Self {
        Self {
            key,
            absent: not_found::<ResBody>,
            absent_header: None,
            trusted: None,
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
    fn key<'r>(&self, request: &'r Request<B>) -> Option<Cow<'r, [u8]>> {
        Some(match self.key.key(request)? {
            Cow::Borrowed(key) => Cow::Borrowed(key.as_bytes()),
            Cow::Owned(key) => Cow::Owned(key.into_bytes()),
        })
    }

    #[inline]
    fn absent_response(&self) -> Response<ResBody> {
        let mut response = (self.absent)();
        if let Some((name, value)) = &self.absent_header {
            response.headers_mut().insert(name.clone(), value.clone());
        }
        response
    }

    /// 2xx, and 304 (the client's copy of the item is current): found;
    /// 404: not found; anything else says neither.
    fn found(&self, response: &Response<ResBody>) -> Option<bool> {
        let status = response.status();
        if status.is_success() || status == StatusCode::NOT_MODIFIED {
            Some(true)
        } else if status == StatusCode::NOT_FOUND {
            Some(false)
        } else {
            None
        }
    }

    #[inline]
    fn answer_trusted(&self, key: &[u8]) -> Option<Response<ResBody>> {
        let (verify, present) = self.trusted?;
        (!verify.verifies(key)).then(present)
    }
}

impl<K, ResBody> fmt::Debug for HttpPolicy<K, ResBody> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpPolicy").finish_non_exhaustive()
    }
}

impl<K, ResBody> GuardLayer<HttpPolicy<K, ResBody>> {
    /// Guards `http` services (axum routers and handlers, hyper services):
    /// `key` picks the key of a request (usually a [`PathKey`]), and a key
    /// the guard rules out is answered 404 with an empty body, without
    /// calling the service. After `MaybePresent`, a 404 from the service
    /// counts as a false positive and a 2xx or a 304 as found.
    ///
    /// ```
    /// use axum::{Router, extract::Path, http::Method, routing::get};
    /// use bloomguard::{Guard, GuardLayer, layer::PathKey};
    ///
    /// // The guard must hold every id the store holds: from a source that
    /// // rebuilds it (see the crate docs), or, as here, inserted. Every
    /// // other id is answered 404 without calling the handler.
    /// let guard = Guard::builder().expected_items(1_000_000).build()?;
    /// guard.insert("42");
    /// let app: Router = Router::new()
    ///     // The guard's key is the decoded `{id}`, the very string the handler gets.
    ///     .route("/items/{id}", get(|Path(id): Path<String>| async move { id }))
    ///     .layer(GuardLayer::for_http(guard, PathKey::route("/items/{id}").method(Method::GET)));
    /// # let _ = app;
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// ```
    ///
    /// `K` is an [`HttpKey`] of the requests the service takes, checked where
    /// the layer is applied.
    pub fn for_http(guard: Guard, key: K) -> Self
    where
        ResBody: Default,
    {
        Self::with_policy(guard, HttpPolicy::new(key))
    }

    /// Answers absent keys with `response()` instead of an empty 404.
    #[must_use]
    pub fn with_absent_response(self, response: fn() -> Response<ResBody>) -> Self
    where
        K: Clone,
    {
        self.map_policy(|policy| policy.absent = response)
    }

    /// Adds `name: value` to the guard's own "absent" answers, so a client,
    /// a log or a test can tell them from a handler's 404 (off by default).
    /// Costs one small allocation per absent answer (the header map).
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
    /// use axum::{Router, body::Body, http::{HeaderName, HeaderValue, Request}, routing::get};
    /// use bloomguard::{Guard, GuardLayer, layer::PathKey};
    /// use tower::ServiceExt;
    ///
    /// let guard = Guard::builder().expected_items(1_000).build()?;
    /// guard.insert("7"); // the one stored item (a real guard has a source)
    /// let app: Router = Router::new()
    ///     .route("/items/{id}", get(|axum::extract::Path(id): axum::extract::Path<String>| async move {
    ///         if id == "7" { Ok("item 7") } else { Err(axum::http::StatusCode::NOT_FOUND) }
    ///     }))
    ///     .layer(
    ///         GuardLayer::for_http(guard, PathKey::route("/items/{id}"))
    ///             .with_absent_header(HeaderName::from_static("x-bloomguard"), HeaderValue::from_static("absent")),
    ///     );
    /// let response = app.oneshot(Request::get("/items/8").body(Body::empty())?).await?;
    /// assert_eq!(response.status(), 404);
    /// assert_eq!(response.headers()["x-bloomguard"], "absent"); // not the handler's 404
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    #[must_use]
    pub fn with_absent_header(self, name: HeaderName, value: HeaderValue) -> Self
    where
        K: Clone,
    {
        self.map_policy(|policy| policy.absent_header = Some((name, value)))
    }

    /// For presence endpoints ("has this user seen this item?"): answers a
    /// "maybe" key with `present()`, without calling the service, unless
    /// `verify` sends it on (see [`Verify`]). The guard counts the trusted
    /// answers and estimates how many were false
    /// ([`GuardStats::over_filtered`](crate::GuardStats::over_filtered)).
    ///
    /// ```
    /// use axum::{Router, http::{Method, StatusCode}, routing::get};
    /// use bloomguard::{Guard, GuardLayer, Verify, layer::PathKey};
    ///
    /// let guard = Guard::builder().expected_items(1_000).build()?;
    /// guard.insert("u1:i9"); // the pairs seen (a real guard has a source)
    /// let seen = PathKey::route("/seen/{pair}").method(Method::GET);
    /// let app: Router = Router::new()
    ///     .route("/seen/{pair}", get(|axum::extract::Path(pair): axum::extract::Path<String>| async move {
    ///         if pair == "u1:i9" { StatusCode::OK } else { StatusCode::NOT_FOUND } // the store's answer
    ///     }))
    ///     .layer(GuardLayer::for_http(guard, seen).verify(Verify::Sample(0.01), || {
    ///         axum::http::Response::new(axum::body::Body::empty()) // 200: seen
    ///     })?);
    /// # let _ = app;
    /// # Ok::<(), bloomguard::ConfigError>(())
    /// ```
    ///
    /// # Errors
    /// A [`Verify::Sample`] fraction outside `(0, 1]`.
    pub fn verify(
        self,
        verify: Verify,
        present: fn() -> Response<ResBody>,
    ) -> Result<Self, ConfigError>
    where
        K: Clone,
    {
        let verify = verify.checked()?;
        Ok(self.map_policy(|policy| {
            policy.trusted = (verify != Verify::All).then_some((verify, present));
        }))
    }

    fn map_policy(self, change: impl FnOnce(&mut HttpPolicy<K, ResBody>)) -> Self
    where
        K: Clone,
    {
        let mut shared = std::sync::Arc::unwrap_or_clone(self.shared);
        change(&mut shared.policy);
        Self {
            shared: std::sync::Arc::new(shared),
            ..self
        }
    }
}

impl<K: Clone, ResBody> Clone for HttpPolicy<K, ResBody> {
    fn clone(&self) -> Self {
        Self {
            key: self.key.clone(),
            absent: self.absent,
            absent_header: self.absent_header.clone(),
            trusted: self.trusted,
        }
    }
}

#[cfg(all(test, feature = "axum"))]
mod tests {
    use super::{PathKey, captures};

    /// A catch-all's id spans segments: the guard keyed its last segment
    /// only, the insert layer nothing, and the guard answered 404 for what
    /// the handler stored (without the `axum` feature).
    #[test]
    #[should_panic(expected = "wildcard")]
    fn a_wildcard_template_is_refused() {
        let _ = PathKey::route("/files/{*path}");
    }

    /// `{{v1}}` is literal text to axum: it was taken for the parameter,
    /// and a legal route panicked with "has 2".
    #[test]
    fn an_escaped_brace_segment_is_literal_text() {
        use super::HttpKey;
        let key = PathKey::route("/{{v1}}/items/{id}");
        let get = |path: &str| http::Request::get(path).body(()).unwrap();
        assert_eq!(key.key(&get("/{v1}/items/42")).as_deref(), Some("42"));
        assert_eq!(key.key(&get("/v1/items/42")), None);
        // The insert layer's key, and the guard's under a router, compare
        // the literals before the parameter from the path's end.
        assert_eq!(
            key.write_keys(&get("/{v1}/items/42"))[0].as_deref(),
            Some("42")
        );
        assert_eq!(
            key.parameter_at_end("/api/{v1}/items/42").as_deref(),
            Some("42")
        );
        assert_eq!(key.parameter_at_end("/api/v1/items/42"), None);
        assert!(key.is_route("/api/{{v1}}/items/{id}"));
        assert!(super::unescapes_to("a{{b}}c", "a{b}c"));
        assert!(!super::unescapes_to("a{{b}}c", "a{{b}}c"));
    }

    #[test]
    #[should_panic(expected = "has 0")]
    fn a_template_whose_only_braces_are_escaped_has_no_parameter() {
        let _ = PathKey::route("/items/{{id}}");
    }

    #[test]
    fn every_unescaped_brace_opens_a_capture() {
        assert_eq!(captures("/items/{id}"), 1);
        assert_eq!(captures("/users/{user}/items/{id}"), 2);
        assert_eq!(captures("/u_{user}/items/{id}"), 2, "part of a segment");
        assert_eq!(captures("/files/{*rest}"), 1);
        assert_eq!(captures("/{{literal}}/items/{id}"), 1, "an escape");
        assert_eq!(
            captures("/{{x}}{t}/items/{id}"),
            2,
            "an escape, then a capture"
        );
    }
}
