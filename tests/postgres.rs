//! The `postgres` feature against a real PostgreSQL server that each test
//! starts (`initdb` into a temporary directory, `pg_ctl` on a free loopback
//! port) and removes.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bloomguard::postgres::{PgLoadError, PgLoader, PgSource};
use bloomguard::source::{KeySource, KeyStream};
use bloomguard::{GuardLayer, GuardedLoader, RebuildError, Verdict};
use common::guard_from;
use common::postgres_server::PostgresServer;
use futures_util::StreamExt;
use sqlx::Connection as _;
use tower::{Layer, ServiceExt};

/// `items(id text primary key, name text)` with ids `0..rows`.
async fn items(pool: &sqlx::PgPool, rows: i64) {
    sqlx::query("CREATE TABLE items (id text PRIMARY KEY, name text NOT NULL)")
        .execute(pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO items SELECT i::text, 'item ' || i FROM generate_series(0, $1 - 1) i")
        .bind(rows)
        .execute(pool)
        .await
        .unwrap();
}

/// Runs each statement in turn.
async fn execute(pool: &sqlx::PgPool, statements: &[&str]) {
    for statement in statements {
        sqlx::query(statement).execute(pool).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_by_keyset_pages_holds_exactly_the_table() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    items(&pool, 25_000).await;
    // Pages of 1,000 (the last one full: the pass ends on an empty page).
    let guard = guard_from(PgSource::new(pool.clone(), "items", "id").page(1_000));
    let report = guard.rebuild().await.unwrap();
    assert_eq!(report.keys, 25_000);
    assert!((0..25_000).all(|i| guard.check(i.to_string()) == Verdict::MaybePresent));
    let absent = (25_000..125_000)
        .filter(|i| guard.check(i.to_string()).is_absent())
        .count();
    assert!(absent > 98_000, "{absent}");

    // A query, and a key transform: the guard holds what the app checks.
    let source = PgSource::from_query(
        pool.clone(),
        "SELECT id FROM items WHERE id LIKE '1%'",
        "id",
    )
    .page(333)
    .map_key(|id| format!("item:{id}").into_bytes());
    let mapped = guard_from(source);
    let report = mapped.rebuild().await.unwrap();
    let expected = (0..25_000)
        .filter(|i| i.to_string().starts_with('1'))
        .count() as u64;
    assert_eq!(report.keys, expected);
    assert_eq!(mapped.check("item:1999"), Verdict::MaybePresent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_made_during_a_rebuild_survive_it() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    items(&pool, 20_000).await;
    let guard = guard_from(PgSource::new(pool.clone(), "items", "id").page(500));
    guard.rebuild().await.unwrap();
    let rebuilding = {
        let guard = guard.clone();
        tokio::spawn(async move {
            for _ in 0..5 {
                guard.rebuild().await.unwrap();
            }
        })
    };
    let mut written = Vec::new();
    for i in 20_000..20_400 {
        let id = i.to_string();
        // The ordering rule: the guard first, then the database.
        let insert = sqlx::query("INSERT INTO items VALUES ($1, 'new')")
            .bind(&id)
            .execute(&pool);
        guard.insert_then_write(&id, insert).await.unwrap();
        written.push(id);
    }
    rebuilding.await.unwrap();
    guard.rebuild().await.unwrap();
    for id in &written {
        assert_eq!(guard.check(id), Verdict::MaybePresent, "{id}");
    }
}

/// A source that runs `act` once, after its first page: the pass is
/// certainly in the middle when it acts.
struct ActsMidPass<F> {
    source: PgSource,
    act: F,
    acted: AtomicBool,
}

fn acts_mid_pass<F: Fn() + Send + Sync + 'static>(source: PgSource, act: F) -> ActsMidPass<F> {
    ActsMidPass {
        source,
        act,
        acted: AtomicBool::new(false),
    }
}

impl<F: Fn() + Send + Sync + 'static> KeySource for ActsMidPass<F> {
    fn scan(&self) -> KeyStream<'_> {
        Box::pin(self.source.scan().enumerate().map(|(page, batch)| {
            if page == 0 && !self.acted.swap(true, Ordering::Relaxed) {
                (self.act)();
            }
            batch
        }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restarted_mid_rebuild_fails_the_pass_and_the_retry_succeeds() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    items(&pool, 10_000).await;
    let server = Arc::new(std::sync::Mutex::new(server));
    let guard = guard_from(acts_mid_pass(
        PgSource::new(pool.clone(), "items", "id").page(1_000),
        {
            let server = Arc::clone(&server);
            move || server.lock().unwrap().stop()
        },
    ));
    let failed = guard.rebuild().await.unwrap_err();
    assert!(matches!(failed, RebuildError::Source(_)), "{failed}");
    assert!(guard.is_warming(), "no partial filter was swapped in");
    assert_eq!(guard.stats().rebuilds.failed, 1);

    server.lock().unwrap().start_again();
    let report = guard.rebuild().await.unwrap();
    assert_eq!(report.keys, 10_000);
    assert_eq!(guard.check("9999"), Verdict::MaybePresent);
}

/// A server restarted between two pages, the pool reconnecting before the
/// next: the pages before and after were read from two runs of the server
/// (after a crash that lost commits, or a failover to a standby behind its
/// primary, a row deleted in the first may be back in the second, among
/// keys the pass had read). The pass fails, and the retry reads whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_restarted_between_pages_fails_the_pass() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    items(&pool, 10_000).await;
    let server = std::sync::Mutex::new(server);
    let guard = guard_from(acts_mid_pass(
        PgSource::new(pool.clone(), "items", "id").page(1_000),
        move || {
            let mut server = server.lock().unwrap();
            server.stop();
            server.start_again();
        },
    ));
    match guard.rebuild().await {
        Err(failed) => assert!(
            matches!(failed, RebuildError::Source(_)) && failed.to_string().contains("restarted"),
            "{failed}"
        ),
        Ok(report) => panic!(
            "a pass across a restart was taken as whole ({} keys read)",
            report.keys
        ),
    }
    assert!(guard.is_warming(), "no partial filter was swapped in");
    assert_eq!(guard.rebuild().await.unwrap().keys, 10_000);
}

/// A server process that crashed between two pages: the postmaster ends
/// every session and runs crash recovery (which, under `synchronous_commit
/// = off`, loses the last commits: a row deleted may be back), then takes
/// connections again, its start time unchanged. The pass fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_crash_between_pages_fails_the_pass() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    items(&pool, 10_000).await;
    let mut victim = sqlx::PgConnection::connect(&server.url()).await.unwrap();
    let (backend,): (i32,) = sqlx::query_as("SELECT pg_backend_pid()")
        .fetch_one(&mut victim)
        .await
        .unwrap();
    let crashed = Arc::new(AtomicBool::new(false));
    let guard = guard_from(acts_mid_pass(
        PgSource::new(pool.clone(), "items", "id").page(1_000),
        {
            let crashed = Arc::clone(&crashed);
            move || {
                server.crash_backend(backend);
                crashed.store(true, Ordering::Relaxed);
            }
        },
    ));
    let outcome = guard.rebuild().await;
    assert!(
        crashed.load(Ordering::Relaxed),
        "the pass went past its first page"
    );
    match outcome {
        Err(failed) => assert!(
            failed.to_string().contains("recovered from a crash"),
            "{failed}"
        ),
        Ok(report) => panic!(
            "a pass across a crash recovery was taken as whole ({} keys read)",
            report.keys
        ),
    }
    assert_eq!(guard.rebuild().await.unwrap().keys, 10_000);
}

/// Row-level security on the table for the role the source connects as
/// (a read-only role of its own, as a pool of its own suggests): every
/// page lists only the rows its policy lets through, and the pass looked
/// whole, while the loader, connecting as the table's owner, reads them
/// all. The pass fails, naming row-level security.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_row_level_security_hides_from_the_source_fail_the_pass() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    items(&pool, 1_000).await;
    execute(
        &pool,
        &[
            "CREATE ROLE scanner LOGIN",
            "GRANT SELECT ON items TO scanner",
            "ALTER TABLE items ENABLE ROW LEVEL SECURITY",
            "CREATE POLICY below_five ON items FOR SELECT TO scanner USING (id < '5')",
        ],
    )
    .await;
    let url = format!("postgres://scanner@127.0.0.1:{}/postgres", server.port);
    let scanner = sqlx::PgPool::connect(&url).await.unwrap();
    let guard = guard_from(PgSource::new(scanner, "items", "id"));
    match guard.rebuild().await {
        Err(failed) => assert!(
            failed.to_string().contains("row-level security"),
            "{failed}"
        ),
        Ok(report) => {
            let absent = (0..1_000)
                .filter(|i| guard.check(i.to_string()).is_absent())
                .count();
            panic!(
                "a pass under row-level security was taken as whole ({} keys read): {absent} \
                 of the 1000 rows answer absent",
                report.keys
            )
        }
    }
    // The owner's pool reads every row.
    let owner = guard_from(PgSource::new(pool, "items", "id"));
    assert_eq!(owner.rebuild().await.unwrap().keys, 1_000);
}

/// A hot standby replays its primary's writes asynchronously, and may be
/// behind by more than any write settle (here: its replay paused). A guard
/// rebuilt from it would answer `Absent` for a row the primary holds, so a
/// pass on a standby fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_on_a_standby_fails() {
    let primary = PostgresServer::start();
    let primary_pool = primary.pool().await;
    items(&primary_pool, 100).await;
    let standby = PostgresServer::start_standby_of(&primary);
    let standby_pool = standby.pool().await;
    sqlx::query("SELECT pg_wal_replay_pause()")
        .execute(&standby_pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO items VALUES ('written after the pause', 'new')")
        .execute(&primary_pool)
        .await
        .unwrap();
    let on_standby: i64 = sqlx::query_scalar("SELECT count(*) FROM items")
        .fetch_one(&standby_pool)
        .await
        .unwrap();
    assert_eq!(on_standby, 100, "the standby lacks the new row");

    let guard = guard_from(PgSource::new(standby_pool, "items", "id"));
    let error = guard
        .rebuild()
        .await
        .expect_err("a pass on a standby fails");
    assert!(error.to_string().contains("standby"), "{error}");
    assert!(guard.is_warming());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loader_reads_one_key_and_batches_in_one_query() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    items(&pool, 1_000).await;
    let guard = guard_from(PgSource::new(pool.clone(), "items", "id"));
    guard.rebuild().await.unwrap();
    let loader = PgLoader::<String>::new(pool.clone(), "items", "id", "name");
    let gate = GuardedLoader::new(guard.clone(), loader.clone());

    assert_eq!(gate.get("7").await.unwrap().as_deref(), Some("item 7"));
    assert_eq!(gate.get("absent").await.unwrap(), None);
    let keys: Vec<String> = ["3", "nope", "999", "3"].map(String::from).to_vec();
    let values = gate.get_many(&keys).await.unwrap();
    let values: Vec<Option<&str>> = values.iter().map(|v| v.as_deref()).collect();
    assert_eq!(
        values,
        [Some("item 3"), None, Some("item 999"), Some("item 3")]
    );

    // Behind the tower layer, as any loader service.
    let service = GuardLayer::for_loader(guard).layer(loader);
    let loaded = service.oneshot("42".to_owned()).await.unwrap();
    assert_eq!(loaded.as_deref(), Some("item 42"));
}

/// A NULL key names no item: the pass skips it. It sorts last, so a table
/// smaller than a page had it on its first page, whose decoding failed every
/// pass: the guard stayed warming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_null_key_is_skipped_not_a_failed_pass() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    execute(
        &pool,
        &[
            "CREATE TABLE drafts (id text, name text)",
            "INSERT INTO drafts VALUES ('1', 'one'), (NULL, 'unnamed'), ('2', 'two')",
        ],
    )
    .await;
    for page in [1, 10_000] {
        let guard = guard_from(PgSource::new(pool.clone(), "drafts", "id").page(page));
        let report = guard.rebuild().await.unwrap();
        assert_eq!(report.keys, 2, "page of {page}");
        assert_eq!(guard.check("2"), Verdict::MaybePresent);
    }
}

/// A batch answers each key as `get` does, whatever text the database
/// gives back for the row: a `char(5)` column returns `'abc  '` for the key
/// `'abc'`, and a case-insensitive collation `'Ab'` for `'ab'`. The batch
/// matched the rows by the returned text, and answered `None` for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_each_key_as_get_does_whatever_text_the_rows_hold() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    execute(&pool, &[
        "CREATE TABLE codes (code char(5) PRIMARY KEY, name text NOT NULL)",
        "INSERT INTO codes VALUES ('abc', 'padded'), ('abcde', 'full')",
        "CREATE COLLATION any_case (provider = icu, locale = 'und-u-ks-level2', deterministic = false)",
        "CREATE TABLE handles (handle text COLLATE any_case NOT NULL, name text NOT NULL)",
        "INSERT INTO handles VALUES ('Ab', 'mixed')",
    ])
    .await;
    let codes = PgLoader::<String>::new(pool.clone(), "codes", "code", "name");
    let asked = ["abc", "abcde", "nope", "abc"];
    let mut one_by_one = Vec::new();
    for key in asked {
        one_by_one.push(codes.get(key).await.unwrap());
    }
    assert_eq!(one_by_one[0].as_deref(), Some("padded"));
    assert_eq!(codes.get_many(&asked).await.unwrap(), one_by_one);
    // A NUL, which no text value holds (PostgreSQL refuses it as a
    // parameter): not found, not an error for the whole batch.
    assert_eq!(codes.get("a\0b").await.unwrap(), None);
    assert_eq!(
        codes.get_many(&["abc", "a\0b"]).await.unwrap(),
        [Some("padded".to_owned()), None]
    );

    let handles = PgLoader::<String>::new(pool, "handles", "handle", "name");
    assert_eq!(handles.get("ab").await.unwrap().as_deref(), Some("mixed"));
    assert_eq!(
        handles.get_many(&["ab", "AB", "x"]).await.unwrap(),
        [Some("mixed".to_owned()), Some("mixed".to_owned()), None]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_or_bad_sql_is_a_clear_error_and_a_stuck_call_times_out() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    let guard = guard_from(PgSource::new(pool.clone(), "missing", "id"));
    let error = guard.rebuild().await.unwrap_err();
    assert!(
        error.to_string().contains("\"missing\" does not exist"),
        "{error}"
    );
    let guard = guard_from(PgSource::from_query(pool.clone(), "SELEC id FROM t", "id"));
    let error = guard.rebuild().await.unwrap_err();
    assert!(error.to_string().contains("syntax error"), "{error}");
    let loader = PgLoader::<String>::new(pool.clone(), "missing", "id", "name");
    let error = loader.get("1").await.unwrap_err();
    assert!(matches!(error, PgLoadError::Database(_)), "{error}");

    items(&pool, 10).await;
    // A transaction holding the table locked: the loader's read waits.
    let mut locker = pool.begin().await.unwrap();
    sqlx::query("LOCK TABLE items IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *locker)
        .await
        .unwrap();
    let impatient = PgLoader::<String>::new(pool.clone(), "items", "id", "name")
        .timeout(Duration::from_millis(200));
    let error = impatient.get("1").await.unwrap_err();
    assert!(matches!(error, PgLoadError::TimedOut(_)), "{error}");
    locker.rollback().await.unwrap();
    // With the default timeout: the read may need a new connection first.
    let loader = PgLoader::<String>::new(pool.clone(), "items", "id", "name");
    assert_eq!(loader.get("1").await.unwrap().as_deref(), Some("item 1"));
}

/// Under a non-deterministic collation (case-insensitive here) 'A' and 'a'
/// compare equal: a page ending at 'A' continues with `key > 'A'` and skips
/// 'a', which is in the table for the whole pass. Such a pass fails, saying
/// why, rather than rebuild without the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_under_a_non_deterministic_collation_fail_the_pass() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    execute(&pool, &[
        "CREATE COLLATION any_case (provider = icu, locale = 'und-u-ks-level2', deterministic = false)",
        "CREATE TABLE tags (name text COLLATE any_case NOT NULL)",
        "INSERT INTO tags VALUES ('A'), ('a'), ('b')",
    ])
    .await;
    let guard = guard_from(PgSource::new(pool.clone(), "tags", "name").page(1));
    match guard.rebuild().await {
        Err(error) => assert!(error.to_string().contains("deterministic"), "{error}"),
        Ok(report) => panic!(
            "a pass read {} of the 3 keys and was taken as whole",
            report.keys
        ),
    }
    assert!(guard.is_warming());

    // The same keys under a deterministic collation: every one read.
    sqlx::query("ALTER TABLE tags ALTER COLUMN name TYPE text COLLATE \"C\"")
        .execute(&pool)
        .await
        .unwrap();
    let report = guard.rebuild().await.unwrap();
    assert_eq!(report.keys, 3);
    assert_eq!(guard.check("a"), Verdict::MaybePresent);
}

/// An `int` key column compares as numbers (`'10' < '9'` as text): the pass
/// fails saying the column must be text. The check itself failed first,
/// with PostgreSQL's "collations are not supported by type integer".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_int_key_column_fails_the_pass_saying_so() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    execute(
        &pool,
        &[
            "CREATE TABLE numbered (id int PRIMARY KEY)",
            "INSERT INTO numbered VALUES (9), (10)",
        ],
    )
    .await;
    let guard = guard_from(PgSource::new(pool.clone(), "numbered", "id"));
    let error = guard.rebuild().await.unwrap_err();
    assert!(
        error
            .to_string()
            .contains("is integer, not text or varchar"),
        "{error}"
    );
}

/// A key column under a collation the check cannot find by the name
/// `pg_collation_for` gives (a session's temporary one, named `pg_temp.…`
/// where its schema is `pg_temp_N`): whether it is deterministic was
/// unknown, and the pass went on as if it were, over a collation that is
/// not (it ended whole).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_column_under_a_collation_the_check_cannot_find_fails_the_pass() {
    let server = PostgresServer::start();
    // One connection: the temporary collation and table are its own.
    let one_connection = server.one_connection_pool().await;
    execute(
        &one_connection,
        &[
            "CREATE COLLATION pg_temp.hidden (provider = icu, locale = 'und', \
             deterministic = false)",
            "CREATE TEMP TABLE tags (name text COLLATE pg_temp.hidden NOT NULL)",
            "INSERT INTO tags VALUES ('a'), ('A'), ('b')",
        ],
    )
    .await;
    let guard = guard_from(PgSource::new(one_connection.clone(), "tags", "name"));
    let error = guard.rebuild().await.unwrap_err();
    assert!(error.to_string().contains("was not found"), "{error}");
}

/// `tags(name text COLLATE {collation})` holding `B Z a c`, and the
/// collations `linguistic` (`a B c Z`), `bytewise` and `elsewhere.bytewise`
/// (both libc "C": `B Z a c`; `elsewhere` is off the search path).
async fn tags_under_bytewise(pool: &sqlx::PgPool, collation: &str) {
    execute(
        pool,
        &[
            "CREATE COLLATION linguistic (provider = icu, locale = 'und')",
            "CREATE COLLATION bytewise (provider = libc, locale = 'C')",
            "CREATE SCHEMA elsewhere",
            "CREATE COLLATION elsewhere.bytewise (provider = libc, locale = 'C')",
            &format!("CREATE TABLE tags (name text COLLATE {collation} NOT NULL)"),
            "INSERT INTO tags VALUES ('B'), ('Z'), ('a'), ('c')",
        ],
    )
    .await;
}

const TO_LINGUISTIC: &str = "ALTER TABLE tags ALTER COLUMN name TYPE text COLLATE linguistic";
const TO_BYTEWISE: &str = "ALTER TABLE tags ALTER COLUMN name TYPE text COLLATE bytewise";

/// `tags` under `key_collation` (see `tags_under_bytewise`); then a pass
/// over them on `source_pool`, pages of `page`, that runs the next of
/// `migrations` before each page after the first. Fails the test unless
/// the pass fails, saying the collation changed.
async fn a_pass_across_migrations(
    server: &PostgresServer,
    source_pool: sqlx::PgPool,
    page: i64,
    key_collation: &str,
    migrations: &[&str],
) {
    let pool = server.pool().await;
    tags_under_bytewise(&pool, key_collation).await;
    let source = PgSource::new(source_pool, "tags", "name").page(page);
    let mut pass = source.scan();
    let mut read = pass.next().await.unwrap().unwrap();
    let mut migrations = migrations.iter();
    let failed = loop {
        if let Some(migration) = migrations.next() {
            // Raw: a migration of several statements runs as one transaction.
            sqlx::raw_sql(migration).execute(&pool).await.unwrap();
        }
        match pass.next().await {
            Some(Ok(keys)) => read.extend(keys),
            Some(Err(error)) => break Some(error),
            None => break None,
        }
    };
    let Some(error) = failed else {
        let read: Vec<_> = read
            .iter()
            .map(|key| String::from_utf8_lossy(key))
            .collect();
        panic!("the pass ended whole having read {read:?} of the 4 keys");
    };
    assert!(
        error.to_string().contains("changed during the pass"),
        "{error}"
    );
}

/// A migration during a pass that changes how the key column orders (its
/// collation) leaves the pages before it and after it in two orders. From
/// "C" (`B Z a c`) to a linguistic order (`a B c Z`), the page after `Z`,
/// last in both, is empty: the pass ended whole having read `B` and `Z`,
/// and the guard answered `Absent` for `a` and `c`. Both collations are
/// deterministic, which is all each end of the pass checked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_across_a_change_of_the_key_columns_collation_fails() {
    let server = PostgresServer::start();
    // One connection for every pass: the one that prepared the page
    // queries before the migration runs them after it.
    let one_connection = server.one_connection_pool().await;
    a_pass_across_migrations(
        &server,
        one_connection.clone(),
        2,
        "bytewise",
        &[TO_LINGUISTIC],
    )
    .await;
    // A pass under the new collation alone reads every key, on the same
    // connection (whose prepared pages once failed here: "cached plan must
    // not change result type").
    let guard = guard_from(PgSource::new(one_connection, "tags", "name").page(2));
    assert_eq!(guard.rebuild().await.unwrap().keys, 4);
    assert_eq!(guard.check("c"), Verdict::MaybePresent);
}

/// A migration of the key column's collation undone before the pass ended
/// (a rollback deploy): the page read under the other collation (`a B c Z`)
/// went on after `B` with `c`, and the next, under `bytewise` again (`B Z a c`),
/// after `c` with nothing. The check at the pass's two ends found `bytewise` at
/// both, and the pass ended whole having read `B` and `c`. Each page's
/// statement now says how it compared the keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collation_changed_and_changed_back_during_a_pass_fails_it() {
    let server = PostgresServer::start();
    let one_connection = server.one_connection_pool().await;
    a_pass_across_migrations(
        &server,
        one_connection,
        1,
        "bytewise",
        &[TO_LINGUISTIC, TO_BYTEWISE],
    )
    .await;
}

/// A migration that drops the key column's collation and makes another
/// under its name, in one transaction (`bytewise`, "C" order `B Z a c`,
/// again as a linguistic one, `a B c Z`): every page named the same type
/// and collation, and the pass ended whole having read `B` and `Z`. Each
/// page's statement now names them by oid too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collation_made_again_under_its_name_during_a_pass_fails_it() {
    a_pass_across_a_collation_made_again("bytewise").await;
}

/// The same under a collation named with its schema, off the search path
/// (`elsewhere.bytewise`), which the page's lookup finds by that name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_qualified_collation_made_again_under_its_name_during_a_pass_fails_it() {
    a_pass_across_a_collation_made_again("elsewhere.bytewise").await;
}

/// A pass over `tags` under `collation` (a "C" one, `B Z a c`), across one
/// migration that drops it and makes it again, linguistic (`a B c Z`).
async fn a_pass_across_a_collation_made_again(collation: &str) {
    let server = PostgresServer::start();
    let one_connection = server.one_connection_pool().await;
    let made_again_as_linguistic = format!(
        "ALTER TABLE tags ALTER COLUMN name TYPE text COLLATE \"C\"; \
         DROP COLLATION {collation}; \
         CREATE COLLATION {collation} (provider = icu, locale = 'und'); \
         ALTER TABLE tags ALTER COLUMN name TYPE text COLLATE {collation}"
    );
    a_pass_across_migrations(
        &server,
        one_connection,
        2,
        collation,
        &[&made_again_as_linguistic],
    )
    .await;
}

/// A collation of the key column's name made in another schema during a
/// pass (a tenant's, off the search path) changes nothing the pages
/// compare with: the pass reads every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collation_of_the_same_name_made_elsewhere_during_a_pass_fails_nothing() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    tags_under_bytewise(&pool, "bytewise").await;
    let source = PgSource::new(server.one_connection_pool().await, "tags", "name").page(2);
    let mut pass = source.scan();
    let mut read = pass.next().await.unwrap().unwrap();
    execute(
        &pool,
        &[
            "CREATE SCHEMA tenant",
            "CREATE COLLATION tenant.bytewise (provider = icu, locale = 'und')",
        ],
    )
    .await;
    while let Some(keys) = pass.next().await {
        read.extend(keys.unwrap());
    }
    read.sort();
    assert_eq!(read, [&b"B"[..], b"Z", b"a", b"c"]);
}

/// An upgrade of the library behind a collation (glibc 2.28 reordered most
/// locales; ICU changes too) leaves the indexes built before it in the old
/// order, which the server's comparisons no longer follow: PostgreSQL
/// records the version each collation was built with and only warns. Made
/// here by relabelling a key column and its primary key, built in "C" order
/// (`B Z a c`), as under `collation` (`a B c Z`), and recording another
/// version for it (`record_another_version`). The pages, read through the
/// index, ended after `B` and `Z` (the index's search for `> 'Z'` found
/// nothing), and the pass was taken as whole without `a` and `c`. Once the
/// index is rebuilt and the version recorded (`refresh`), a pass reads all.
async fn a_pass_over_an_index_in_another_version_of(
    server: &PostgresServer,
    database: &str,
    collation: &str,
    record_another_version: &str,
    refresh: &str,
) {
    let pool = server.pool_on(database).await;
    let relabel_as = format!("'{collation}'::regcollation");
    execute(
        &pool,
        &[
            "CREATE TABLE tags (name text COLLATE \"C\" PRIMARY KEY)",
            "INSERT INTO tags VALUES ('B'), ('Z'), ('a'), ('c')",
            &format!(
                "UPDATE pg_attribute SET attcollation = {relabel_as} \
                 WHERE attrelid IN ('tags'::regclass, 'tags_pkey'::regclass) AND attname = 'name'"
            ),
            &format!(
                "UPDATE pg_index SET indcollation = ({relabel_as}::oid::text)::oidvector \
                 WHERE indexrelid = 'tags_pkey'::regclass"
            ),
            record_another_version,
            // Four rows: the pages use the index only where told to.
            "ALTER ROLE postgres SET enable_seqscan = off",
        ],
    )
    .await;
    let guard = guard_from(PgSource::new(server.pool_on(database).await, "tags", "name").page(2));
    match guard.rebuild().await {
        Err(error) => assert!(
            error.to_string().contains("recorded 1.0, now")
                && error.to_string().contains("REINDEX"),
            "{error}"
        ),
        Ok(report) => panic!(
            "a pass read {} of the 4 keys and was taken as whole; a: {:?}",
            report.keys,
            guard.check("a")
        ),
    }
    assert!(guard.is_warming());

    execute(&pool, &["REINDEX TABLE tags", refresh]).await;
    assert_eq!(guard.rebuild().await.unwrap().keys, 4);
    assert_eq!(guard.check("a"), Verdict::MaybePresent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_under_a_collation_of_another_version_fail_the_pass() {
    let server = PostgresServer::start();
    execute(
        &server.pool().await,
        &["CREATE COLLATION linguistic (provider = icu, locale = 'und')"],
    )
    .await;
    a_pass_over_an_index_in_another_version_of(
        &server,
        "postgres",
        "linguistic",
        "UPDATE pg_collation SET collversion = '1.0' WHERE collname = 'linguistic'",
        "ALTER COLLATION linguistic REFRESH VERSION",
    )
    .await;
}

/// The same under the database's default collation, whose version
/// PostgreSQL 15 and later record for the database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_under_a_database_default_of_another_version_fail_the_pass() {
    let server = PostgresServer::start();
    execute(
        &server.pool().await,
        &[
            "CREATE DATABASE linguistic TEMPLATE template0 LOCALE_PROVIDER icu \
           ICU_LOCALE 'und' LOCALE 'C.UTF-8'",
        ],
    )
    .await;
    a_pass_over_an_index_in_another_version_of(
        &server,
        "linguistic",
        "default",
        "UPDATE pg_database SET datcollversion = '1.0' WHERE datname = current_database()",
        "ALTER DATABASE linguistic REFRESH COLLATION VERSION",
    )
    .await;
}

/// `citext` orders case-insensitively, but `key > $1` with a text parameter
/// compares as text: under the "C" collation, `'B' > 'a'` is false, so the
/// page after `'a'` skipped `'B'`, which the guard then answered absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_of_a_case_insensitive_type_fail_the_pass() {
    let server = PostgresServer::start();
    let pool = server.pool().await;
    execute(
        &pool,
        &[
            "CREATE EXTENSION citext",
            "CREATE TABLE handles (name citext COLLATE \"C\" PRIMARY KEY)",
            "INSERT INTO handles VALUES ('B'), ('a'), ('c')",
        ],
    )
    .await;
    let guard = guard_from(PgSource::new(pool.clone(), "handles", "name").page(1));
    match guard.rebuild().await {
        Err(error) => assert!(error.to_string().contains("citext"), "{error}"),
        Ok(report) => panic!(
            "a pass read {} of the 3 keys and was taken as whole; B: {:?}",
            report.keys,
            guard.check("B")
        ),
    }
    assert!(guard.is_warming());

    // As a domain over text, which compares as text: every key read.
    execute(
        &pool,
        &[
            "CREATE DOMAIN handle AS text",
            "ALTER TABLE handles ALTER COLUMN name TYPE handle COLLATE \"C\"",
        ],
    )
    .await;
    let report = guard.rebuild().await.unwrap();
    assert_eq!(report.keys, 3);
    assert_eq!(guard.check("B"), Verdict::MaybePresent);

    // A domain over that domain compares as text too: it was taken for
    // its own base, the domain, and every pass failed.
    execute(
        &pool,
        &[
            "CREATE DOMAIN user_handle AS handle",
            "ALTER TABLE handles ALTER COLUMN name TYPE user_handle COLLATE \"C\"",
        ],
    )
    .await;
    let report = guard.rebuild().await.unwrap();
    assert_eq!(report.keys, 3);
}
