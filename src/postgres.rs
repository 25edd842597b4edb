//! PostgreSQL as the store behind a guard (the `postgres` feature, through
//! sqlx): [`PgSource`] streams a table's keys for rebuilds, [`PgLoader`]
//! reads values, one key with `= $1` and a batch with one query that joins
//! the keys, as an array, to the table.
//!
//! Both take a [`PgPool`], which reconnects on its own: a pass or a load
//! made while the database is gone fails (the rebuild is counted failed and
//! retried, the old filter serving meanwhile), and the next one succeeds once
//! it is back. A pass the server restarted (or recovered from a crash)
//! during fails too, though the pool reconnected between its pages.
//!
//! Table and column names are quoted as identifiers (a name with a `"` in it
//! stays a name), so they cannot inject SQL; a query given to
//! [`PgSource::from_query`] is SQL by intent, and is the caller's to trust.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::stream;
use sqlx::postgres::{PgPool, Postgres};

pub use crate::error::PgLoadError;
use crate::guard::source::{KeySource, KeyStream, SourceError};
use crate::loader::Loader;

/// `"name"`, or `"schema"."name"`: identifiers quoted so that no name can
/// end the identifier early.
fn quoted(name: &str) -> String {
    name.split('.')
        .map(|part| format!("\"{}\"", part.replace('"', "\"\"")))
        .collect::<Vec<_>>()
        .join(".")
}

/// Why a pass read by a standby fails: it replays its primary's writes
/// asynchronously, and may lack one for longer than any write settle.
const ON_A_STANDBY: &str = "the source reads a standby, which may lack writes its primary \
     took: give the PgSource a pool on the primary";

/// Where the key's collation is the database's default and at another
/// version than the one recorded for the database (its indexes were built
/// under that one): both, or `NULL`. PostgreSQL 15 and later record it.
const DATABASE_COLLATION_DRIFT: &str = "(SELECT format('recorded %s, now %s', datcollversion, \
     coalesce(pg_database_collation_actual_version(d.oid), 'none')) \
     FROM pg_database d, found WHERE found.collprovider = 'd' \
     AND d.datname = current_database() AND d.datcollversion IS NOT NULL \
     AND d.datcollversion IS DISTINCT FROM pg_database_collation_actual_version(d.oid))";

/// The statement behind [`KeyCheck`], over `key` of `relation`, with
/// `database_drift` for the database's default collation.
///
/// The type under every domain (a domain may be over another), and the
/// collation by name, as `pg_collation_for` spells it (quoted, and
/// qualified when not on the search path): `regcollation` needs
/// PostgreSQL 13. `pg_collation_for` fails on a type without collations
/// (an `int` column), whose own error would hide the one the check gives.
/// The collation's recorded version against the one its library now
/// gives, as PostgreSQL's own warning compares them (for the database's
/// default, the database's, from PostgreSQL 15).
fn key_check(relation: &str, key: &str, database_drift: &str) -> String {
    format!(
        "WITH RECURSIVE one AS (SELECT {key} AS key FROM {relation} LIMIT 1), \
         base(oid, over) AS (SELECT t.oid, t.typbasetype FROM one, pg_type t \
          WHERE t.oid = pg_typeof(one.key) \
          UNION ALL SELECT t.oid, t.typbasetype FROM base, pg_type t \
          WHERE t.oid = base.over), \
         key_collation AS (SELECT CASE WHEN t.typcollation <> 0 \
          THEN pg_collation_for(one.key) COLLATE \"C\" END AS name \
          FROM one, pg_type t WHERE t.oid = pg_typeof(one.key)), \
         found AS (SELECT c.oid, c.collprovider, c.collisdeterministic, c.collversion \
          FROM key_collation, pg_collation c JOIN pg_namespace n ON n.oid = c.collnamespace \
          WHERE key_collation.name COLLATE \"C\" IN \
          (quote_ident(c.collname), quote_ident(n.nspname) || '.' || quote_ident(c.collname))) \
         SELECT (SELECT format_type(oid, NULL) FROM base WHERE over = 0), \
         (SELECT bool_and(collisdeterministic) FROM found), \
         (SELECT name FROM key_collation), \
         coalesce((SELECT string_agg(format('recorded %s, now %s', collversion, \
          coalesce(pg_collation_actual_version(oid), 'none')), '; ') FROM found \
          WHERE collversion IS DISTINCT FROM pg_collation_actual_version(oid) \
          AND collversion IS NOT NULL), {database_drift})"
    )
}

/// The two columns of a page's [`KeyOrder`]: the key's type and collation
/// as the page's statement compared them, by name and by oid (one dropped
/// and made again under its name, a domain over another type or a locale
/// of another order, is another), known without a row, from a subquery
/// that reads none (the text under "C" whatever the column's, or a
/// migration would change the page's result type, as its keys would);
/// and when the server started and last ran crash recovery (which resets
/// the shared stats, and their `stats_reset`, while the postmaster stays).
/// The collation's oid is looked up by the name `pg_collation_for` gives
/// (`regcollation` is from PostgreSQL 13): qualified, or else the one the
/// search path shows, so that one of that name made in another schema
/// meanwhile fails no pass. Split by `parse_ident`, the name is looked up
/// through `pg_collation`'s index (a comparison with each row's quoted
/// name scanned every collation: 0.8 ms a page with ICU's, 0.05 ms now).
fn key_order(relation: &str, key: &str) -> String {
    let no_row = format!("(SELECT {key} FROM {relation} LIMIT 0)");
    format!(
        "(format_type(pg_typeof({no_row}), NULL) || ' (type ' || \
         pg_typeof({no_row})::oid::text || ') under ' || \
         coalesce(pg_collation_for({no_row}), 'no collation') || ' (collation ' || \
         coalesce((SELECT string_agg(c.oid::text, ', ' ORDER BY c.oid) \
          FROM parse_ident(pg_collation_for({no_row}) COLLATE \"C\") AS part, \
          pg_collation c JOIN pg_namespace n ON n.oid = c.collnamespace \
          WHERE c.collname = part[cardinality(part)] AND CASE WHEN cardinality(part) = 2 \
          THEN n.nspname = part[1] ELSE pg_collation_is_visible(c.oid) END), 'none') || ')') \
         COLLATE \"C\", \
         extract(epoch FROM pg_postmaster_start_time())::text || ' ' || \
         coalesce(extract(epoch FROM (SELECT stats_reset FROM pg_stat_archiver))::text, '')"
    )
}

/// Turns a stored key into the bytes the guard holds.
type KeyMap = Arc<dyn Fn(&str) -> Vec<u8> + Send + Sync>;

/// Every key of a table (or query), streamed by keyset pagination: each page
/// is `… WHERE key > $last ORDER BY key LIMIT n`, its own short statement, so
/// a rebuild of a hundred million rows holds no long transaction and one
/// page in memory. The key column must be `text` or `varchar` (or a domain
/// over one) under a deterministic collation: a pass over keys that compare
/// equal by case or accent, or over `citext` or `char(n)`, fails. It should
/// be indexed (a primary key is). Each page checks how the keys compare,
/// and the pass fails where a page found another type or collation than
/// the first (a migration during the pass, even one undone before its end).
/// A pass fails as well where the collation's library changed version
/// since the indexes were built (an upgrade of glibc or ICU, of which
/// PostgreSQL only warns): an index in the old order makes the pages skip
/// keys. PostgreSQL records that version for a collation object (ICU ones
/// from version 10, libc ones from 13), but for the database's default
/// only from 15: before 15, check the key's index after an upgrade of the
/// operating system's C library (amcheck's `bt_index_check`) or `REINDEX`
/// it. A pass on a standby fails too: it may lack writes its primary
/// took, for longer than any write settle (each page is checked, as a
/// router balancing reads may send any page to one). A
/// logical replica (a subscriber) is not in recovery and is not noticed:
/// point the source at the primary.
/// Each page runs in a transaction of its own (a pooler in statement mode,
/// which refuses `BEGIN`, fails every pass) under `row_security = off`:
/// where a row-level security policy applies to the source's role (any
/// policy, one that hides nothing too), the pass fails rather than list
/// only the rows the policy shows it. Give the source a role no policy
/// applies to: one with `BYPASSRLS`, or the table's owner unless the table
/// forces row-level security. sqlx prepares its statements and runs them
/// again by name: behind a pooler in transaction mode, that needs one that
/// keeps prepared statements per client (PgBouncer 1.21 or later with
/// `max_prepared_statements` set), or another client's statement of the
/// same name may run in its place (for the loader too).
/// PostgreSQL 12 or later.
///
/// A pass runs where the guard rebuilds: its maintenance task, a fleet
/// member's recovery, a caller of [`Guard::rebuild`](crate::Guard::rebuild).
/// A sqlx connection works only while the runtime that opened it runs, so a
/// pool serves one runtime: where rebuilds run on a runtime of their own,
/// give the source a pool of its own, or a connection a pass opened into
/// the service's pool fails the service's queries once that runtime stops.
/// Make it lazy and without idle reaping (`connect_lazy_with`,
/// `idle_timeout(None)`, `max_lifetime(None)`), so that it starts no task
/// on the runtime that builds it.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use bloomguard::{Guard, postgres::PgSource};
///
/// let pool = sqlx::PgPool::connect("postgres://app@127.0.0.1/app").await?;
/// let guard = Guard::builder()
///     .expected_items(10_000_000)
///     // `id` is a `text` column; for another type (or `char(n)`) list it
///     // as text, `PgSource::from_query(pool, "SELECT id::text AS id FROM
///     // items", "id")`, with an index on `(id::text)` for the pages, and
///     // check keys in that text form (see `from_query`).
///     .source(PgSource::new(pool, "items", "id"))
///     .build()?;
/// # let _ = guard;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PgSource {
    pool: PgPool,
    /// Whether the server is a standby, the keys of
    /// `SELECT key … ORDER BY key LIMIT $1`, and the [`KeyOrder`] they
    /// were read in.
    first_page: String,
    /// The same, `… WHERE key > $1 ORDER BY key LIMIT $2`.
    next_page: String,
    /// Whether the keys compare byte for byte (see [`KeyCheck`]), asked in
    /// the first page's transaction before the page: on PostgreSQL 15 and
    /// later, and before it (which records no version for the database's
    /// default collation).
    key_check: String,
    key_check_before_15: String,
    page: i64,
    map_key: Option<KeyMap>,
}

impl PgSource {
    /// Keys per page unless told.
    pub const DEFAULT_PAGE: i64 = 10_000;

    /// The keys in column `key_column` of `table` (`"name"` or
    /// `"schema.name"`: split at each `.` and each part quoted; a table
    /// whose name holds a `.` takes [`from_query`](Self::from_query)).
    /// An unqualified name resolves on each pooled connection's
    /// `search_path`: qualify it where connections differ (a session's
    /// temporary table of the same name comes first there).
    pub fn new(pool: PgPool, table: &str, key_column: &str) -> Self {
        Self::over(pool, &quoted(table), &quoted(key_column))
    }

    /// The keys in column `key_column` of the rows `query` returns (a
    /// `SELECT`, wrapped as a subquery: `SELECT id FROM items WHERE NOT deleted`).
    ///
    /// A write that brings a row into the query's result is a write of its
    /// key under the [ordering rule](crate::guard#the-ordering-rule): an
    /// `UPDATE … SET deleted = false`, like an `INSERT`, inserts into the
    /// guard first. The loader must apply the same filter, or a deleted
    /// row is served on a false positive and answered absent otherwise.
    /// The query must depend on stored rows only: a filter on `now()`, a
    /// session setting or the role (`WHERE publish_at <= now()`) brings
    /// rows in with no write, which the guard answers absent until the
    /// next rebuild.
    ///
    /// A key of another type listed as text (`SELECT id::text AS id`)
    /// holds the column's canonical text: `check` keys in that form only.
    /// A uuid the application received as `A0EEBC99-…` (upper case) is
    /// absent in a guard that holds `a0eebc99-…`, though the store's
    /// `= $1::uuid` finds it; so are `007` and `+7` for an `int` 7.
    /// Parse and format a key before checking it, or
    /// [`map_key`](Self::map_key) to the form the application checks.
    pub fn from_query(pool: PgPool, query: &str, key_column: &str) -> Self {
        Self::over(pool, &format!("({query}) AS listed"), &quoted(key_column))
    }

    fn over(pool: PgPool, relation: &str, key: &str) -> Self {
        // Each page says whether the server that read it is a standby:
        // behind a router that balances reads, any page may be read on one
        // (and `pg_is_in_recovery()`, volatile, keeps pgpool's on the
        // primary). One row even for an empty page. The keys come back
        // under a fixed collation: a result that took the column's would
        // change type with a migration of its collation, and every
        // connection that had prepared the query would then fail each page
        // ("cached plan must not change result type"); the pages are
        // ordered by the column all the same.
        let order = key_order(relation, key);
        let page = |after: &str, limit: &str| {
            format!(
                "SELECT pg_is_in_recovery(), ARRAY(SELECT {key}::text FROM {relation} \
                 WHERE {after} ORDER BY {key} LIMIT {limit}) COLLATE \"C\", {order}"
            )
        };
        Self {
            pool,
            // A NULL key names no item: the first page skips it, and later
            // pages by `>`.
            first_page: page(&format!("{key} IS NOT NULL"), "$1"),
            next_page: page(&format!("{key} > $1"), "$2"),
            key_check: key_check(relation, key, DATABASE_COLLATION_DRIFT),
            key_check_before_15: key_check(relation, key, "NULL"),
            page: Self::DEFAULT_PAGE,
            map_key: None,
        }
    }

    /// Keys per page (at least 1).
    #[must_use]
    pub fn page(mut self, keys: i64) -> Self {
        self.page = keys.max(1);
        self
    }

    /// What the guard holds for a stored key, when the application checks
    /// something else than the column's text (a prefix, an encoding).
    ///
    /// Every check must then ask with the mapped key. A [`GuardedLoader`]
    /// checks and loads with one key, and [`PgLoader`] queries the column
    /// with it unchanged: over a `PgLoader`, leave the keys unmapped (or
    /// load with a [`Loader`] of your own that takes the mapped key back).
    ///
    /// [`GuardedLoader`]: crate::GuardedLoader
    #[must_use]
    pub fn map_key(mut self, map: impl Fn(&str) -> Vec<u8> + Send + Sync + 'static) -> Self {
        self.map_key = Some(Arc::new(map));
        self
    }

    /// The page of keys after `last`, and the [`KeyOrder`] its statement
    /// read them in; fails where a standby read it (it replays its
    /// primary's writes asynchronously, and may lack one for longer than
    /// any write settle). The first page asks first, in its transaction,
    /// whether the keys compare byte for byte ([`KeyCheck`]).
    ///
    /// Each page runs in a transaction of its own under `row_security =
    /// off`: where a row-level security policy applies to the source's
    /// role, PostgreSQL fails the statement rather than leave out the rows
    /// the policy hides, which a loader under another role reads.
    async fn page_after(&self, last: Option<&str>) -> Result<(Vec<String>, KeyOrder), SourceError> {
        // One round trip for both (a simple query may hold two statements).
        let mut transaction = self
            .pool
            .begin_with("BEGIN; SET LOCAL row_security = off")
            .await
            .map_err(SourceError::new)?;
        let page = match last {
            None => {
                self.check_keys(&mut transaction).await?;
                sqlx::query_as(&self.first_page).bind(self.page)
            }
            Some(last) => sqlx::query_as(&self.next_page).bind(last).bind(self.page),
        };
        let (standby, keys, compared_as, server_started): (bool, Vec<String>, String, String) =
            page.fetch_one(&mut *transaction)
                .await
                .map_err(unfiltered_error)?;
        transaction.commit().await.map_err(SourceError::new)?;
        if standby {
            return Err(SourceError::new(ON_A_STANDBY));
        }
        Ok((
            keys,
            KeyOrder {
                compared_as,
                server_started,
            },
        ))
    }

    /// Fails unless the keys compare byte for byte: text or varchar under a
    /// deterministic collation, at the version its indexes were built
    /// under. Under one that ignores case or accents, `'a'` equals `'A'`,
    /// and a page ending at `'A'` goes on with `key > 'A'`, past `'a'`;
    /// `citext` orders without case but compares with a text parameter as
    /// text, so under "C" the page after `'a'` skips `'B'`; `char(n)` pads
    /// its keys. (The store's `= $1` would also find `'A'` for `'a'`, which
    /// the guard, holding bytes, answers absent.)
    async fn check_keys(&self, transaction: &mut sqlx::PgConnection) -> Result<(), SourceError> {
        // Known from the connection's start, unless a pooler kept it back.
        let server_version = match transaction.server_version_num() {
            Some(version) => version,
            None => sqlx::query_scalar::<_, String>("SHOW server_version_num")
                .fetch_one(&mut *transaction)
                .await
                .map_err(SourceError::new)?
                .parse()
                .map_err(SourceError::new)?,
        };
        let key_check = if server_version < 150_000 {
            &self.key_check_before_15
        } else {
            &self.key_check
        };
        let (key_type, deterministic, collation, version_drift): KeyCheck =
            sqlx::query_as(key_check)
                .fetch_one(&mut *transaction)
                .await
                .map_err(unfiltered_error)?;
        if let Some(key_type) = &key_type
            && !matches!(key_type.as_str(), "text" | "character varying")
        {
            return Err(SourceError::new(format!(
                "the key column is {key_type}, not text or varchar: its keys do not compare \
                 byte for byte (citext ignores case, char(n) pads), so pages would skip keys \
                 and the guard would not hold them as the application checks them"
            )));
        }
        if deterministic == Some(false) {
            return Err(SourceError::new(
                "the key column's collation is not deterministic: keys it compares equal \
                 (by case or accent) would be skipped between pages; give the column a \
                 deterministic collation (COLLATE \"C\", or the database's default)",
            ));
        }
        if let (Some(collation), None) = (&collation, deterministic) {
            // Named, but not found where the name says (a session's
            // temporary collation): whether it is deterministic is unknown.
            return Err(SourceError::new(format!(
                "the key column's collation {collation} was not found in pg_collation: \
                 cannot tell whether it compares keys byte for byte"
            )));
        }
        if let (Some(collation), Some(drift)) = (&collation, version_drift) {
            return Err(SourceError::new(format!(
                "the key column's collation {collation} has changed version since its indexes \
                 were built ({drift}): they may hold the keys in an order the server no \
                 longer compares in, and pages searched through them skip keys; REINDEX \
                 what uses it, then record the version (ALTER COLLATION … REFRESH VERSION, \
                 or for the database's default ALTER DATABASE … REFRESH COLLATION VERSION)"
            )));
        }
        Ok(())
    }
}

/// A failed statement of a pass, saying what to do where a row-level
/// security policy refused it.
fn unfiltered_error(error: sqlx::Error) -> SourceError {
    match error.as_database_error() {
        Some(database) if database.message().contains("row-level security") => {
            SourceError::new(format!(
                "{}: a pass would leave out the rows a policy hides from the source's role; \
                 give the source a role no policy applies to (one with BYPASSRLS, or the \
                 table's owner unless the table forces row-level security)",
                database.message()
            ))
        }
        _ => SourceError::new(error),
    }
}

/// The key check's row: the keys' type (a domain's base type), whether
/// their collation is deterministic, its name, and how its version
/// drifted (`NULL`s: no rows; all but the type also for a type without
/// collations).
type KeyCheck = (Option<String>, Option<bool>, Option<String>, Option<String>);

/// How a page's statement compared the keys, and which run of the server
/// read them: every page of a pass must find the first page's.
#[derive(Clone, Debug)]
struct KeyOrder {
    /// The key's type and collation (`text "C"`).
    compared_as: String,
    /// `pg_postmaster_start_time()` and the archiver's `stats_reset`, in
    /// seconds since the epoch.
    server_started: String,
}

impl KeyOrder {
    /// Why the pass that began with `start` cannot be trusted whole, if it
    /// cannot: the server restarted (or another took its place), and the
    /// pages were read from two runs of it (after a crash that lost
    /// commits, or a failover to a standby behind, a row deleted in the
    /// first may be back in the second, among keys already read); or a
    /// migration (another type or collation, even one undone before the
    /// pass ended) left pages in two orders, and the page after a key can
    /// skip keys that sorted after it before.
    fn change_since(&self, start: &KeyOrder) -> Option<String> {
        if self.server_started != start.server_started {
            return Some(
                "the server restarted, recovered from a crash or failed over during the \
                 pass: its pages were read from two runs of it, and a row deleted in the \
                 first may be back in the second; the next pass reads it whole"
                    .to_owned(),
            );
        }
        (self.compared_as != start.compared_as).then(|| {
            format!(
                "the key column's type or collation changed during the pass ({} to {}): \
                 pages compared keys in two orders and may have skipped some; the next \
                 pass reads it whole",
                start.compared_as, self.compared_as
            )
        })
    }
}

impl KeySource for PgSource {
    /// One pass, a page at a time, until a page comes back short. Each
    /// page's statement must find the keys compared as the first page's
    /// did, on the same run of the server: a migration during the pass (a
    /// column turned citext, another collation, even one undone before the
    /// end) changes how the later pages compare, with no error, and so
    /// does a restart between two pages the pool reconnected across.
    fn scan(&self) -> KeyStream<'_> {
        // `None`: done; else the key to read after (`None`: the first page)
        // and how the keys compared on the first page.
        let start = Some((None::<String>, None::<KeyOrder>));
        let pages = stream::try_unfold(start, move |state| async move {
            let Some((after, began)) = state else {
                return Ok::<_, SourceError>(None); // past the last page
            };
            let (keys, order) = self.page_after(after.as_deref()).await?;
            let began = began.unwrap_or_else(|| order.clone());
            if let Some(why) = order.change_since(&began) {
                return Err(SourceError::new(why));
            }
            let next = (keys.len() as i64 == self.page).then(|| keys.last().cloned());
            let batch = keys
                .iter()
                .map(|key| match &self.map_key {
                    Some(map) => map(key),
                    None => key.as_bytes().to_vec(),
                })
                .collect();
            Ok(Some((
                batch,
                next.flatten().map(|last| (Some(last), Some(began))),
            )))
        });
        Box::pin(pages)
    }
}

impl fmt::Debug for PgSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgSource")
            .field("next_page", &self.next_page)
            .field("page", &self.page)
            .field("map_key", &self.map_key.is_some())
            .finish_non_exhaustive()
    }
}

/// Values from a table: `SELECT value … WHERE key = $1` for one key, and for
/// a batch one query joining the keys (`unnest($1) WITH ORDINALITY`) to the
/// table, whose rows answer the keys by position: each key gets what `= $1`
/// finds for it, whatever text the row holds (a `char(n)` key is padded;
/// `=` compares it to the key without its trailing blanks, so ask for
/// `abc`, not `abc  `). A key holding a NUL, which no text value holds, is
/// not found.
/// Use it as a [`Loader`] for
/// [`GuardedLoader`](crate::GuardedLoader), or as a `tower::Service` behind
/// [`GuardLayer::for_loader`](crate::GuardLayer::for_loader). `V` is what the
/// value column decodes to (`String` for text, `Vec<u8>` for bytea, …).
///
/// The key column must be text (`text`, `varchar`, `char(n)`): each key is
/// sent as `text`, and `= $1` on a column of another type fails every call
/// (implement [`Loader`] with the query that casts for such a column). It
/// must compare keys byte for byte, as the guard does: a
/// deterministic collation, not one that ignores case or accents. Under
/// those, `= $1` finds the row of `'A'` for `'a'`, which a guard holding
/// `'A'` answers absent without asking. [`PgSource`] refuses such a column;
/// the loader cannot, since the guard answers before it runs. (A `citext`
/// column compares with the text parameter as text, byte for byte, so the
/// loader finds `'A'` for `'A'` alone; it is the source's pages that its
/// ordering breaks, and a source over it lists it as text: `from_query`
/// with `SELECT email::text AS email`.)
///
/// A pool over a read replica answers from it: its lag must fit the
/// guard's write settle, or a read just after a write misses it (and a
/// confirmed-absent cache keeps the miss).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use bloomguard::{Guard, GuardedLoader, postgres::{PgLoader, PgSource}};
///
/// let pool = sqlx::PgPool::connect("postgres://app@127.0.0.1/app").await?;
/// // The guard holds every `id` of the table (a `text` column), read by its
/// // rebuilds: a guard told of no key answers `Absent` for all of them.
/// let guard = Guard::builder()
///     .expected_items(1_000_000)
///     .source(PgSource::new(pool.clone(), "items", "id"))
///     .build()?;
/// let maintenance = guard.spawn_maintenance();
/// guard.ready().await;
/// let names = GuardedLoader::new(guard, PgLoader::<String>::new(pool, "items", "id", "name"));
/// let name = names.get("42").await?;
/// # let _ = (name, maintenance);
/// # Ok(())
/// # }
/// ```
pub struct PgLoader<V> {
    pool: PgPool,
    one: Arc<str>,
    many: Arc<str>,
    timeout: Duration,
    value: PhantomData<fn() -> V>,
}

impl<V> Clone for PgLoader<V> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            one: Arc::clone(&self.one),
            many: Arc::clone(&self.many),
            timeout: self.timeout,
            value: PhantomData,
        }
    }
}

impl<V> PgLoader<V>
where
    V: for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres> + Send + Unpin + 'static,
{
    /// How long one call may take unless told.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

    /// Reads column `value_column` of the row of `table` whose text column
    /// `key_column` is the key.
    pub fn new(pool: PgPool, table: &str, key_column: &str, value_column: &str) -> Self {
        let (table, key, value) = (quoted(table), quoted(key_column), quoted(value_column));
        Self {
            pool,
            one: format!("SELECT {value} FROM {table} WHERE {key} = $1").into(),
            // Rows are matched to the keys asked by position, not by the key
            // text they return: a `char(n)` column pads it, and a
            // non-deterministic collation returns the row's spelling.
            many: format!(
                "SELECT asked.position, stored.{value} \
                 FROM unnest($1::text[]) WITH ORDINALITY AS asked(key, position) \
                 JOIN {table} AS stored ON stored.{key} = asked.key"
            )
            .into(),
            timeout: Self::DEFAULT_TIMEOUT,
            value: PhantomData,
        }
    }

    /// How long one call may take (default [`DEFAULT_TIMEOUT`](Self::DEFAULT_TIMEOUT)).
    ///
    /// A call past it is dropped, but PostgreSQL is not told: the
    /// statement runs on (behind a lock, say), and its connection returns
    /// to the pool only once it ends. Give the pool's connections a
    /// `statement_timeout` a little above this one, or timed-out calls can
    /// hold every connection of the pool.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The value of `key`, `None` if no row has it.
    ///
    /// # Errors
    /// The database's error (a missing table, a bad column type…) or
    /// [`PgLoadError::TimedOut`].
    pub async fn get(&self, key: &str) -> Result<Option<V>, PgLoadError> {
        let Some(key) = askable(key) else {
            return Ok(None);
        };
        let query = sqlx::query_scalar(&self.one)
            .bind(key)
            .fetch_optional(&self.pool);
        self.within_timeout(query).await
    }

    /// The values of `keys`, in their order, in one round trip.
    ///
    /// # Errors
    /// As [`get`](Self::get).
    pub async fn get_many<K: AsRef<str>>(&self, keys: &[K]) -> Result<Vec<Option<V>>, PgLoadError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        // A key no row can hold asked as NULL, which matches none: not
        // found, and the other keys answered.
        let asked: Vec<Option<&str>> = keys.iter().map(|key| askable(key.as_ref())).collect();
        let query = sqlx::query_as::<_, (i64, V)>(&self.many)
            .bind(&asked)
            .fetch_all(&self.pool);
        let mut values: Vec<Option<V>> = std::iter::repeat_with(|| None).take(keys.len()).collect();
        // A key asked twice is answered twice (it has a position each).
        for (position, value) in self.within_timeout(query).await? {
            if let Some(slot) = usize::try_from(position - 1)
                .ok()
                .and_then(|i| values.get_mut(i))
            {
                slot.get_or_insert(value);
            }
        }
        Ok(values)
    }

    async fn within_timeout<T>(
        &self,
        query: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, PgLoadError> {
        tokio::time::timeout(self.timeout, query)
            .await
            .map_err(|_| PgLoadError::TimedOut(self.timeout))?
            .map_err(PgLoadError::Database)
    }
}

/// `key` where a row can hold it: no text value holds a NUL, and PostgreSQL
/// refuses one as a parameter, so such a key is not found rather than an
/// error.
fn askable(key: &str) -> Option<&str> {
    (!key.contains('\0')).then_some(key)
}

impl<K, V> Loader<K> for PgLoader<V>
where
    K: AsRef<str> + Send + 'static,
    V: for<'r> sqlx::Decode<'r, Postgres>
        + sqlx::Type<Postgres>
        + Clone
        + Send
        + Sync
        + Unpin
        + 'static,
{
    type Value = V;
    type Error = PgLoadError;

    fn load(&self, key: K) -> impl Future<Output = Result<Option<V>, PgLoadError>> + Send {
        let loader = self.clone();
        async move { loader.get(key.as_ref()).await }
    }

    /// One query for the batch: the keys as an array, joined to the table.
    fn load_many(
        &self,
        keys: Vec<K>,
    ) -> impl Future<Output = Result<Vec<Option<V>>, PgLoadError>> + Send {
        let loader = self.clone();
        let keys: Vec<String> = keys.iter().map(|key| key.as_ref().to_owned()).collect();
        async move { loader.get_many(&keys).await }
    }
}

impl<K, V> tower_service::Service<K> for PgLoader<V>
where
    K: AsRef<str> + Send + 'static,
    V: for<'r> sqlx::Decode<'r, Postgres> + sqlx::Type<Postgres> + Send + Unpin + 'static,
{
    type Response = Option<V>;
    type Error = PgLoadError;
    type Future = Pin<Box<dyn Future<Output = Result<Option<V>, PgLoadError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), PgLoadError>> {
        // The pool queues calls beyond its connections: always room for one.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, key: K) -> Self::Future {
        let loader = self.clone();
        Box::pin(async move { loader.get(key.as_ref()).await })
    }
}

impl<V> fmt::Debug for PgLoader<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgLoader")
            .field("many", &self.many)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::quoted;

    #[test]
    fn names_are_quoted_so_that_none_ends_the_identifier() {
        assert_eq!(quoted("items"), "\"items\"");
        assert_eq!(quoted("app.items"), "\"app\".\"items\"");
        assert_eq!(
            quoted("x\"; DROP TABLE t; --"),
            "\"x\"\"; DROP TABLE t; --\""
        );
    }
}
