//! The fleet contract against a real `redis-server` per test, with the
//! faults injected by the test: once a fleet write completes, no member
//! answers `Absent` for its key, and a member that cannot show it caught up
//! answers `MaybePresent` (fenced) meanwhile.
//!
//! Each scenario keeps a ledger of completed writes and an auditor that
//! checks every completed key on the other members, over and over, for the
//! whole scenario.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use bloomguard::redis::fleet::{FleetSync, FleetSyncBuilder, StreamPosition};
use bloomguard::redis::{FleetError, FleetWriteError, RedisSource};
use bloomguard::{Guard, Lifecycle, RebuildPolicy, Verdict};
use common::fleet::{
    LEASE, Ledger, Member, audit, caught_up, exists, guard, join, join_with, keep_writing, keys,
};
use common::redis_server::RedisServer;
use common::tcp_proxy::{StallAt, TcpProxy};
use common::wait_until;
use tokio_util::sync::CancellationToken;

/// Member `a` on the server, and member `b` reaching it through a proxy
/// that the test can stall or cut.
struct BehindAProxy {
    server: RedisServer,
    proxy: Arc<TcpProxy>,
    a: Member,
    b: Member,
}

/// Joins `a` and `b` (through the proxy) to `fleet`; returns once `b` caught up.
async fn behind_a_proxy(
    fleet: &str,
    configure: impl Fn(FleetSyncBuilder) -> FleetSyncBuilder,
) -> BehindAProxy {
    let server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let a = join_with(guard("a"), server.client(), fleet, &configure).await;
    let b = join_with(guard("b"), proxy.client(), fleet, &configure).await;
    caught_up(&b).await;
    BehindAProxy {
        server,
        proxy,
        a,
        b,
    }
}

/// Stalls the proxy in front of `member` and waits until it fenced itself.
async fn stall_until_fenced(proxy: &TcpProxy, member: &Member) {
    proxy.stall();
    wait_until("the stalled member to fence itself", || {
        member.guard().is_fenced()
    })
    .await;
}

/// Has the fleet's record say it began under another Redis process, as after
/// a failover: the next script to read the record begins a new one. Not
/// within the millisecond the record began in, as no real restart is:
/// there the new record took the old one's name, and with it the old one's
/// place (the mark test's rare timeout under load: a member's held renewal
/// ran in that millisecond). Returns when the record it ends began.
fn as_after_a_failover(connection: &mut redis::Connection, fleet: &str) -> u64 {
    let since = record_began(connection, fleet);
    // Bounded: a few milliseconds at most, unless a test put the record in
    // Redis's future.
    for _ in 0..100 {
        let (seconds, micros): (u64, u64) = redis::cmd("TIME").query(connection).unwrap();
        if seconds * 1_000 + micros / 1_000 > since {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let () = redis::cmd("HSET")
        .arg(format!("{{{fleet}}}:since:record"))
        .arg("run")
        .arg("another")
        .query(connection)
        .unwrap();
    since
}

/// When the fleet's record began (`{fleet}:since`).
fn record_began(connection: &mut redis::Connection, fleet: &str) -> u64 {
    redis::cmd("GET")
        .arg(format!("{{{fleet}}}:since"))
        .query(connection)
        .unwrap()
}

/// Waits until the fleet's record is another than the one begun at `before`.
async fn until_a_record_other_than(connection: &mut redis::Connection, fleet: &str, before: u64) {
    wait_until("the record to begin anew", || {
        record_began(connection, fleet) != before
    })
    .await;
}

/// The record `{fleet}:snapshot:needed` marks, if any.
fn marked_record(connection: &mut redis::Connection, fleet: &str) -> Option<u64> {
    redis::cmd("GET")
        .arg(format!("{{{fleet}}}:snapshot:needed"))
        .query(connection)
        .unwrap()
}

/// Whether the fleet's snapshot holds the keys from before its record
/// began (published under the record by a member that held them).
fn snapshot_covers_the_record(connection: &mut redis::Connection, fleet: &str) -> bool {
    let (manifest, since): (Option<String>, Option<String>) = redis::pipe()
        .get(format!("{{{fleet}}}:snapshot"))
        .get(format!("{{{fleet}}}:since"))
        .query(connection)
        .unwrap();
    manifest
        .zip(since)
        .is_some_and(|(manifest, since)| manifest.ends_with(&format!(" 0 {since}")))
}

/// Whether `{name}:snapshot:needed` names the fleet's record now.
fn record_is_marked(connection: &mut redis::Connection, fleet: &str) -> bool {
    let (marked, since): (Option<u64>, Option<u64>) = redis::pipe()
        .get(format!("{{{fleet}}}:snapshot:needed"))
        .get(format!("{{{fleet}}}:since"))
        .query(connection)
        .unwrap();
    marked.is_some() && marked == since
}

/// The error a join of `guard` to `fleet` fails with.
async fn refused_join(
    guard: Guard,
    client: redis::Client,
    fleet: &str,
    lease: Duration,
) -> FleetError {
    let fleet = FleetSync::builder(guard, client, fleet)
        .lease(lease)
        .build();
    fleet.join().await.unwrap_err()
}

/// Writes 20 keys through `member` (acknowledged by the fleet) and returns
/// them: the keys from before the loss that a test then looks for.
async fn write_keys_from_before(member: &Member) -> Vec<String> {
    write_keys(member, "before").await
}

/// Writes the 20 keys `{prefix}:0` to `{prefix}:19` through `member`
/// (acknowledged by the fleet) and returns them.
async fn write_keys(member: &Member, prefix: &str) -> Vec<String> {
    let keys: Vec<String> = (0..20).map(|n| format!("{prefix}:{n}")).collect();
    for key in &keys {
        member.fleet.insert_then_write(key, async {}).await.unwrap();
    }
    keys
}

/// Kills Redis, waits until every one of `members` has fenced itself and
/// `outage` after, and restarts Redis from its last dump.
async fn down_for(server: &mut RedisServer, members: &[&Member], outage: Duration) {
    server.kill();
    wait_until("every member to fence itself", || {
        members.iter().all(|member| member.guard().is_fenced())
    })
    .await;
    tokio::time::sleep(outage).await;
    server.restart_from_dump();
}

/// [`down_for`] longer than a lease ([`LEASE`]).
async fn down_for_longer_than_a_lease(server: &mut RedisServer, members: &[&Member]) {
    down_for(server, members, LEASE * 5).await;
}

/// Asserts, every few milliseconds until `until`, that no member of
/// `members` answers `Absent` for any of `keys` (see [`none_answers_absent`]).
async fn none_answers_absent_until(
    until: tokio::time::Instant,
    members: &[&Member],
    keys: &[&[String]],
) {
    while tokio::time::Instant::now() < until {
        for keys in keys {
            none_answers_absent(members, keys);
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Asserts that no member of `members` answers `Absent` for any of `keys`,
/// which the fleet acknowledged.
fn none_answers_absent(members: &[&Member], keys: &[String]) {
    for member in members {
        for key in keys {
            assert_ne!(
                member.guard().check(key),
                Verdict::Absent,
                "{key}, acknowledged, on {}",
                member.fleet.member()
            );
        }
    }
}

/// Appends `key` to the fleet's stream as a member's write does, without
/// waiting for the members to apply it (a write through the fleet does).
fn member_entry(fleet: &str, key: &str) -> redis::Cmd {
    member_entry_at(fleet, key, "*")
}

/// [`member_entry`] at the id `id` (`*`: the next one).
fn member_entry_at(fleet: &str, key: &str, id: impl redis::ToRedisArgs) -> redis::Cmd {
    let mut entry = (key.len() as u32).to_le_bytes().to_vec();
    entry.extend_from_slice(key.as_bytes());
    let mut append = redis::cmd("XADD");
    append
        .arg(format!("{{{fleet}}}:inserts"))
        .arg(id)
        .arg("k")
        .arg(entry)
        .arg("m")
        .arg("elsewhere");
    append
}

/// Appends `count` keys from `prefix` as [`member_entry`] does; returns the
/// last entry's position.
fn append_entries(
    connection: &mut redis::Connection,
    fleet: &str,
    prefix: &str,
    count: usize,
) -> StreamPosition {
    let mut last = StreamPosition::START;
    for key in keys(prefix, count) {
        last = member_entry(fleet, &key).query(connection).unwrap();
    }
    last
}

/// A lease long enough that a member's call held in a proxy (calls time
/// out after a lease) outlasts what the test does meanwhile.
fn long_lease(builder: FleetSyncBuilder) -> FleetSyncBuilder {
    builder.lease(Duration::from_secs(8))
}

/// `member` publishing a snapshot, on a task of its own.
fn spawn_publish(member: &Member) -> tokio::task::JoinHandle<Result<StreamPosition, FleetError>> {
    let fleet = member.fleet.clone();
    tokio::spawn(async move { fleet.publish_snapshot().await })
}

/// The fleet's manifest, "position version chunks fresh since".
fn manifest(connection: &mut redis::Connection, fleet: &str) -> String {
    redis::cmd("GET")
        .arg(format!("{{{fleet}}}:snapshot"))
        .query(connection)
        .unwrap()
}

/// Where `fleet`'s lease of `member` ends, as Redis holds it (`None`: it
/// holds none).
fn lease_end(connection: &mut redis::Connection, fleet: &str, member: &str) -> Option<f64> {
    redis::cmd("ZSCORE")
        .arg(format!("{{{fleet}}}:leases"))
        .arg(member)
        .query(connection)
        .unwrap()
}

/// How many entries the fleet's stream holds.
fn stream_length(connection: &mut redis::Connection, fleet: &str) -> u64 {
    redis::cmd("XLEN")
        .arg(format!("{{{fleet}}}:inserts"))
        .query(connection)
        .unwrap()
}

/// The stream position a manifest's snapshot covers.
fn manifest_position(manifest: &str) -> StreamPosition {
    manifest.split(' ').next().unwrap().parse().unwrap()
}

/// The key of the first chunk of the snapshot `manifest` names.
fn first_chunk(fleet: &str, manifest: &str) -> String {
    chunks_named(fleet, manifest).swap_remove(0)
}

/// The chunk keys `manifest` (`{position} {version} {count} {fresh} {since}`) names.
fn chunks_named(fleet: &str, manifest: &str) -> Vec<String> {
    let fields: Vec<&str> = manifest.split(' ').collect();
    let count: usize = fields[2].parse().unwrap();
    (0..count)
        .map(|i| format!("{{{fleet}}}:snapshot:{}:{}:{i}", fields[4], fields[1]))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_steady_state_no_member_answers_absent_for_a_completed_write() {
    let server = RedisServer::start();
    // Nothing stalls here: a write waits as long as a loaded machine needs.
    let patient = |builder: FleetSyncBuilder| builder.ack_timeout(Duration::from_secs(30));
    let a = join_with(guard("a"), server.client(), "steady", patient).await;
    let b = join(guard("b"), server.client(), "steady").await;
    let c = join(guard("c"), server.client(), "steady").await;
    for member in [&a, &b, &c] {
        caught_up(member).await;
    }
    let ledger = Ledger::default();
    let audit = audit(&ledger, vec![b.guard().clone(), c.guard().clone()]);
    let written = keep_writing(&ledger, &a.fleet, keys("steady", 600))
        .await
        .unwrap();
    audit.finish().await;
    assert_eq!(written, 600, "every write completed");

    let stats = a.fleet.stats();
    assert_eq!(stats.local_inserts, 600);
    assert!(stats.ack_latency_p99.is_some(), "{stats:?}");
    // A renewal late for a moment drops a member from the count until the next.
    wait_until("the stats to count three members", || {
        a.fleet.stats().members == 3
    })
    .await;
    // Each write's append, and a second one for a write slower than half
    // the settle (the first waits out the new fleet's first lease).
    wait_until("the others to count the inserts as remote", || {
        b.fleet.stats().remote_inserts >= 600 && c.fleet.stats().remote_inserts >= 600
    })
    .await;
    assert_eq!(a.fleet.stats().remote_inserts, 0, "{:?}", a.fleet.stats());
    for member in [a, b, c] {
        member.handle.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_connections_cost_no_completed_write() {
    let server = RedisServer::start();
    let a = join(guard("a"), server.client(), "killed").await;
    let b = join(guard("b"), server.client(), "killed").await;
    caught_up(&b).await;
    let ledger = Ledger::default();
    let audit = audit(&ledger, vec![b.guard().clone()]);
    let writer = keep_writing(&ledger, &a.fleet, keys("killed", 1_500));
    let mut admin = server.client().get_connection().unwrap();
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        for kind in ["normal", "pubsub"] {
            let _: redis::Value = redis::cmd("CLIENT")
                .arg("KILL")
                .arg("TYPE")
                .arg(kind)
                .query(&mut admin)
                .unwrap();
        }
    }
    let written = writer.await.unwrap();
    caught_up(&b).await;
    audit.finish().await;
    assert!(written > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_member_fences_itself_and_catches_up_after() {
    // The server is held by the binding: dropping it would kill it.
    let BehindAProxy {
        server: _server,
        proxy,
        a,
        b,
    } = behind_a_proxy("stall", |builder| builder).await;
    let ledger = Ledger::default();
    let audit = audit(&ledger, vec![b.guard().clone()]);
    let writer = keep_writing(&ledger, &a.fleet, keys("before", 100));
    assert_eq!(writer.await.unwrap(), 100);

    proxy.stall();
    // Writers wait at most a lease for the stalled member, then go on.
    let writer = keep_writing(&ledger, &a.fleet, keys("during", 300));
    wait_until("the stalled member to fence itself", || {
        b.guard().is_fenced()
    })
    .await;
    assert_eq!(
        writer.await.unwrap(),
        300,
        "writes go on without the stalled member"
    );
    tokio::time::sleep(Duration::from_secs(2)).await; // 3 s of stall in all
    assert!(b.guard().is_fenced(), "still fenced while stalled");
    proxy.resume();
    caught_up(&b).await;
    let report = audit.finish().await;
    assert!(
        report.answered_fenced[0],
        "the fenced member answered MaybePresent"
    );
    assert!(
        b.fleet.stats().fences >= 2,
        "fenced at joining and at the stall"
    );
    for key in ledger.completed() {
        assert_eq!(b.guard().check(&key), Verdict::MaybePresent, "{key}");
    }
}

/// A member's lease watch ran among its tasks on its runtime: a runtime
/// whose workers were all blocked (a blocking call in a handler, CPU-bound
/// work on a worker) held the fence back past the lease, while writers,
/// counting the member out once its lease lapsed in Redis, completed writes
/// it had not applied: it answered `Absent` for them until its runtime ran
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_runtime_is_blocked_fences_itself_when_its_lease_lapses() {
    use std::sync::atomic::{AtomicBool, Ordering};

    let server = RedisServer::start();
    let a = join(guard("a"), server.client(), "blocked").await;
    caught_up(&a).await;
    // `b` runs on a runtime of its own: one thread, which the test blocks
    // until it has checked b's answers (longer than a lease).
    let (joined, b_joined) = tokio::sync::oneshot::channel::<Guard>();
    let (block, blocked) = tokio::sync::oneshot::channel::<()>();
    let (release, released) = std::sync::mpsc::channel::<()>();
    let blocking = Arc::new(AtomicBool::new(false));
    let b_thread = {
        let (client, blocking) = (server.client(), blocking.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let b = join(guard("b"), client, "blocked").await;
                caught_up(&b).await;
                joined.send(b.guard().clone()).unwrap();
                blocked.await.unwrap();
                blocking.store(true, Ordering::SeqCst);
                // Returns at once should the test fail (the sender dropped).
                let _ = released.recv_timeout(Duration::from_secs(60));
                caught_up(&b).await;
                b.handle.shutdown().await;
            });
        })
    };
    let b = b_joined.await.unwrap();
    block.send(()).unwrap();
    wait_until("b's runtime to block", || blocking.load(Ordering::SeqCst)).await;

    // The first write waits for `b` until its lease lapses; the others
    // count it out at once.
    let ledger = Ledger::default();
    let written = keep_writing(&ledger, &a.fleet, keys("blocked", 50))
        .await
        .unwrap();
    assert_eq!(written, 50, "writes go on without the blocked member");
    let answers: Vec<Verdict> = ledger.completed().iter().map(|key| b.check(key)).collect();
    let absent = answers.iter().filter(|&&v| v == Verdict::Absent).count();
    assert_eq!(
        absent, 0,
        "completed writes answered Absent by the blocked member"
    );
    assert!(b.is_fenced());

    release.send(()).unwrap();
    tokio::task::spawn_blocking(move || b_thread.join().unwrap())
        .await
        .unwrap();
    for key in ledger.completed() {
        assert_eq!(b.check(&key), Verdict::MaybePresent, "{key}");
    }
    a.handle.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_costs_no_completed_write() {
    let mut server = RedisServer::start();
    let port = server.port;
    let a = join(guard("a"), server.client(), "restart").await;
    let b = join(guard("b"), server.client(), "restart").await;
    caught_up(&b).await;
    let ledger = Ledger::default();
    let audit = audit(&ledger, vec![b.guard().clone()]);
    assert_eq!(
        keep_writing(&ledger, &a.fleet, keys("before", 200))
            .await
            .unwrap(),
        200
    );
    server.kill();
    // Writes made while Redis is gone fail, and are not made.
    let ran = Arc::new(Mutex::new(false));
    let flag = Arc::clone(&ran);
    let refused = a
        .fleet
        .insert_then_write("while-down", async move { *flag.lock().unwrap() = true })
        .await;
    assert!(
        matches!(refused, Err(FleetWriteError::NotWritten(_))),
        "{refused:?}"
    );
    assert!(
        !*ran.lock().unwrap(),
        "a failed append does not run the write"
    );
    let _server = RedisServer::start_on(port);
    let writer = keep_writing(&ledger, &a.fleet, keys("after", 300));
    let written = writer.await.unwrap();
    assert!(written > 200, "writes resume once Redis is back: {written}");
    caught_up(&b).await;
    audit.finish().await;
}

/// A Redis that comes back without its data has a new stream, whose ids
/// may sort below a member's old position (its clock behind the old
/// server's). The member's first renewal there must not publish that old
/// position as applied: writers would count it as having applied entries
/// it never read. It publishes the new stream's start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_lost_its_data_no_member_publishes_its_old_position() {
    let mut server = RedisServer::start();
    let port = server.port;
    let a = join(guard("a"), server.client(), "lost").await;
    a.fleet.insert_then_write("before", async {}).await.unwrap();
    caught_up(&a).await;
    let old_position = a.fleet.stats().position;
    assert!(old_position > StreamPosition::START);
    server.kill();
    let server = RedisServer::start_on(port);
    let mut connection = server.client().get_connection().unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let published = loop {
        let applied: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
            .arg("{lost}:applied")
            .query(&mut connection)
            .unwrap();
        if let Some(position) = applied.into_values().next() {
            break position;
        }
        assert!(tokio::time::Instant::now() < deadline, "no renewal");
        tokio::time::sleep(Duration::from_millis(2)).await;
    };
    assert_eq!(
        published, "0-0",
        "the first renewal on the new Redis published the old stream's position {old_position}"
    );
}

/// A write whose wait for the members spans Redis losing its data: its
/// entry went with the old stream, so no member can apply it, and the new
/// stream's entries (later in Redis's clock) must not stand in for it. The
/// writer compared positions across the two streams: member b, stalled when
/// the entry was appended, caught up with the new stream past the entry's
/// position, `begin_write` returned, and b answered Absent for its key.
/// (`insert_then_write` appends a key again when its write took longer than
/// half the write settle, which a wait across a loss does at the default
/// settle; `begin_write` makes no second append.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_waiting_when_redis_lost_its_data_is_not_confirmed_by_the_new_stream() {
    let BehindAProxy {
        server,
        proxy,
        a,
        b,
    } = behind_a_proxy("inflight", |builder| builder).await;
    let mut connection = server.client().get_connection().unwrap();
    // b's lease stays live while stalled (it fences itself only after most
    // of a lease), so the writer waits for b to apply the entry.
    proxy.stall();
    let write = tokio::spawn({
        let writer = a.fleet.clone();
        async move { writer.begin_write("in-flight").await }
    });
    wait_until("the write to be appended", || {
        stream_length(&mut connection, "inflight") > 0
    })
    .await;
    let () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
    // b's read may have been answered with the entry already: the reply,
    // held in the stalled proxy, is lost with the connection, as a reply in
    // flight when Redis went down is.
    proxy.cut();
    proxy.resume();
    // Entries on the new stream, which b applies once it is through.
    let later = tokio::spawn({
        let writer = a.fleet.clone();
        async move {
            for key in keys("after", 20) {
                writer.insert_then_write(&key, async {}).await.unwrap();
            }
        }
    });
    let outcome = tokio::time::timeout(Duration::from_secs(30), write)
        .await
        .expect("the write ended")
        .unwrap();
    later.await.unwrap();
    caught_up(&b).await;
    match outcome {
        Ok(pending) => {
            assert_ne!(
                b.guard().check("in-flight"),
                Verdict::Absent,
                "begin_write returned, yet b never applied its entry"
            );
            pending.finish().await.unwrap();
        }
        Err(error) => assert!(matches!(error, FleetError::EntryLost), "{error}"),
    }
}

/// A member catching up (fenced until it reaches the stream's end its
/// renewal saw) whose read ran after Redis lost its data read the new
/// stream's first entry, later in Redis's clock than that end, and took
/// the target as reached: it unfenced, lacking every entry it had yet to
/// apply, and answered `Absent` for their keys. A read under another fleet
/// record than the one it began under now moves nothing, and the member
/// stays fenced until its renewal sees the loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_of_the_stream_after_a_loss_does_not_end_a_catch_up() {
    let server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let mut connection = server.client().get_connection().unwrap();
    // A lease long enough for the test's steps before the joiner would
    // fence itself anyway.
    let settings =
        |builder: FleetSyncBuilder| builder.lease(Duration::from_secs(4)).stream_max_len(50);
    let a = join_with(guard("a"), server.client(), "caught", settings).await;
    for key in keys("before", 200) {
        a.fleet.insert_then_write(&key, async {}).await.unwrap();
    }
    // The joiner starts from this snapshot, then reads the entry after it.
    a.fleet.publish_snapshot().await.unwrap();
    let snapshot_at = manifest_position(&manifest(&mut connection, "caught"));
    a.fleet
        .insert_then_write("after the snapshot", async {})
        .await
        .unwrap();

    // The joiner's first read after the snapshot is held: its join's
    // renewal set the catch-up target, and it has applied nothing after the
    // snapshot. (The read names the position, then its count of 1,000
    // entries; no other command names the two in a row. Its renewals wait
    // for the read too.)
    let first_read = format!("{snapshot_at}\r\n$4\r\n1000\r\n");
    proxy.stall_at(first_read.as_bytes(), StallAt::Before);
    let b = join_with(guard("b"), proxy.client(), "caught", settings).await;
    wait_until("b's read to stall", || proxy.is_stalled()).await;
    assert!(b.guard().is_fenced());
    let () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
    // The new stream's first entry, later than anything before the loss
    // (the write itself waits out the new record's first lease).
    let write = tokio::spawn({
        let writer = a.fleet.clone();
        async move {
            writer
                .insert_then_write("on the new stream", async {})
                .await
        }
    });
    wait_until("the new stream's first entry", || {
        stream_length(&mut connection, "caught") > 0
    })
    .await;
    proxy.resume();
    caught_up(&b).await;
    assert_eq!(
        b.guard().check("after the snapshot"),
        Verdict::MaybePresent,
        "a completed write answered Absent by a member that never applied it"
    );
    write.await.unwrap().unwrap();
}

/// After Redis lost its data, the keys acknowledged before are only in the
/// members that lived through it. A member joining after must get them:
/// from a snapshot one of those members publishes, or it stays fenced. The
/// survivor's request for a snapshot used to be dropped when its first
/// renewal on the new Redis had it catch up (fenced) with entries appended
/// since, and never made again; a member joining without a source then
/// started at the new stream's start and answered Absent for every key
/// from before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_after_redis_lost_its_data_holds_the_keys_from_before() {
    let server = RedisServer::start();
    let a = join(guard("a"), server.client(), "amnesia").await;
    let before = write_keys_from_before(&a).await;
    caught_up(&a).await;
    // Redis loses its data, and a writer appends to the new stream before
    // `a` renews: `a` catches up with it, fenced, when it learns of the loss.
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::pipe()
        .atomic()
        .cmd("FLUSHALL")
        .ignore()
        .cmd("XADD")
        .arg("{amnesia}:inserts")
        .arg("*")
        .arg("k")
        .arg("after")
        .arg("m")
        .arg("elsewhere")
        .ignore()
        .query(&mut connection)
        .unwrap();
    let c = join(guard("c"), server.client(), "amnesia").await;
    caught_up(&c).await;
    for key in &before {
        assert_ne!(
            c.guard().check(key),
            Verdict::Absent,
            "{key}, acknowledged before the loss, is absent on a member that joined after"
        );
    }
    caught_up(&a).await;
}

/// A Redis that restarts from an older dump (its last `SAVE`, after a
/// crash) keeps the fleet's record, `{name}:since`, but not the entries
/// appended after the dump: a member joining then replayed the shorter
/// stream from its start and answered Absent for keys acknowledged after
/// the dump, or adopted the dumped snapshot and replayed the same. Redis's
/// run id changes with the restart; the record begins anew with it, and
/// snapshots from before it are not taken for what it lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_after_redis_restarted_from_an_older_dump_holds_every_key() {
    let mut server = RedisServer::start();
    let a = join(guard("a"), server.client(), "dump").await;
    let b = join(guard("b"), server.client(), "dump").await;
    a.fleet.insert_then_write("dumped", async {}).await.unwrap();
    // The dump holds a snapshot too, whose stream will lack what follows.
    a.fleet.publish_snapshot().await.unwrap();
    let () = redis::cmd("SAVE")
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    let after_dump = write_keys(&a, "after-dump").await;
    caught_up(&b).await;
    server.restart_from_dump();
    let c = join(guard("c"), server.client(), "dump").await;
    caught_up(&c).await;
    for key in after_dump.iter().chain(["dumped".to_owned()].iter()) {
        assert_ne!(
            c.guard().check(key),
            Verdict::Absent,
            "{key}, acknowledged before the restart, is absent on a member that joined after"
        );
    }
    drop((a, b, c, server));
}

/// Redis's clock stepped back (an hour here) leaves the fleet's record
/// beginning in the future, and the lease of a member that is gone ending
/// there: joins slept and writes waited for the record's "first lease" and
/// for that member until the clock caught up. The record begins anew
/// instead, and a lease ends within a lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_from_redis_future_does_not_hold_joins_and_writes() {
    let server = RedisServer::start();
    let a = join_with(guard("a"), server.client(), "clock", |builder| {
        builder.ack_timeout(Duration::from_secs(20))
    })
    .await;
    let mut connection = server.client().get_connection().unwrap();
    let (seconds, _): (u64, u64) = redis::cmd("TIME").query(&mut connection).unwrap();
    let an_hour_ahead = (seconds + 3_600) * 1_000;
    let () = redis::pipe()
        .cmd("SET")
        .arg("{clock}:since")
        .arg(an_hour_ahead)
        .ignore()
        .cmd("ZADD")
        .arg("{clock}:leases")
        .arg(an_hour_ahead)
        .arg("gone")
        .ignore()
        .cmd("HSET")
        .arg("{clock}:applied")
        .arg("gone")
        .arg("0-0")
        .ignore()
        .query(&mut connection)
        .unwrap();
    let joined = tokio::time::timeout(
        Duration::from_secs(30),
        join(guard("b"), server.client(), "clock"),
    )
    .await
    .expect("a join waited for Redis's clock to reach the record");
    let written = tokio::time::timeout(
        Duration::from_secs(30),
        a.fleet.insert_then_write("after the step", async {}),
    )
    .await
    .expect("a write waited for Redis's clock to reach the record");
    written.unwrap();
    caught_up(&joined).await;
    assert_eq!(
        joined.guard().check("after the step"),
        Verdict::MaybePresent
    );
}

/// A loss, then a failover (or a restart, or a clock step) before a member
/// whose lease had lapsed renews: the stream it finds is kept from the
/// record of the loss, not from the member's own. It used to be told only
/// of the last change (kept), replayed the new stream and lacked what was
/// acknowledged without it before the loss; it recovers from a snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_lapsed_across_a_loss_and_a_failover_recovers() {
    let BehindAProxy {
        server,
        proxy,
        a,
        b,
    } = behind_a_proxy("twice", |builder| builder).await;
    stall_until_fenced(&proxy, &b).await;
    a.fleet
        .insert_then_write("while-b-lapsed", async {})
        .await
        .unwrap();
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
    wait_until("`a` to mark the record after the loss", || {
        exists(&mut connection, "{twice}:snapshot:needed")
    })
    .await;
    let since_after_the_loss = as_after_a_failover(&mut connection, "twice");
    until_a_record_other_than(&mut connection, "twice", since_after_the_loss).await;
    proxy.resume();
    caught_up(&b).await;
    assert_ne!(
        b.guard().check("while-b-lapsed"),
        Verdict::Absent,
        "acknowledged without `b` before the loss"
    );
}

/// A member whose lease had lapsed when Redis restarted from an older dump
/// (or failed over to a replica that lacked the last writes) finds its
/// record kept, but the stream without what was acknowledged without it.
/// It used to replay that stream and answer Absent; it now counts as
/// starting afresh, and recovers from the snapshot of a member that was
/// caught up (which marks the record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_lapsed_when_redis_restarted_from_an_older_dump_recovers() {
    let BehindAProxy {
        server,
        proxy,
        a,
        b,
    } = behind_a_proxy("dumped", |builder| builder).await;
    stall_until_fenced(&proxy, &b).await;
    a.fleet
        .insert_then_write("after-the-dump", async {})
        .await
        .unwrap();
    // As after a restart from a dump taken before that write: its entry is
    // gone, and the record begins anew under another process.
    let mut connection = server.client().get_connection().unwrap();
    type Entries = Vec<(String, Vec<(String, Vec<u8>)>)>;
    let newest: Entries = redis::cmd("XREVRANGE")
        .arg("{dumped}:inserts")
        .arg("+")
        .arg("-")
        .arg("COUNT")
        .arg(1)
        .query(&mut connection)
        .unwrap();
    let () = redis::pipe()
        .atomic()
        .cmd("XDEL")
        .arg("{dumped}:inserts")
        .arg(&newest[0].0)
        .ignore()
        .cmd("HSET")
        .arg("{dumped}:since:record")
        .arg("run")
        .arg("another")
        .ignore()
        .query(&mut connection)
        .unwrap();
    proxy.resume();
    caught_up(&b).await;
    assert_ne!(
        b.guard().check("after-the-dump"),
        Verdict::Absent,
        "acknowledged without `b`, and gone from the stream"
    );
}

/// A member that found no snapshot holding the keys from before Redis lost
/// its data recovers however late it renews: the mark used to be cleared
/// by the first such snapshot, and a member that looked for one just
/// before it was published (its renewal just after) took the start of the
/// new stream for all there was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_missed_the_snapshot_from_before_a_loss_still_recovers() {
    let server = RedisServer::start();
    let a = join(guard("a"), server.client(), "late").await;
    let before = write_keys_from_before(&a).await;
    caught_up(&a).await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let manifest: Option<String> = redis::cmd("GET")
            .arg("{late}:snapshot")
            .query(&mut connection)
            .unwrap();
        if manifest.is_some() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "`a` published nothing"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // As if `c` had looked for it just before.
    let () = redis::cmd("DEL")
        .arg("{late}:snapshot")
        .query(&mut connection)
        .unwrap();
    let c = join(guard("c"), server.client(), "late").await;
    caught_up(&c).await;
    for key in &before {
        assert_ne!(c.guard().check(key), Verdict::Absent, "{key}");
    }
}

/// A loss's need, once a snapshot met it, does not outlive it: it used to
/// be carried to every later record that kept the stream, and after a
/// restart or a failover that every member lived through fenced (each then
/// counts as fresh: the stream's end may be lost) all of them recovered,
/// none could publish, and a fleet without a source stayed fenced for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_met_need_is_not_carried_to_a_restart_every_member_lived_through_fenced() {
    let server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let a = join(guard("a"), proxy.client(), "met").await;
    let b = join(guard("b"), proxy.client(), "met").await;
    let before = write_keys_from_before(&a).await;
    caught_up(&b).await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
    wait_until("a snapshot holding the keys from before the loss", || {
        snapshot_covers_the_record(&mut connection, "met")
    })
    .await;
    a.fleet
        .insert_then_write("between", async {})
        .await
        .unwrap();
    caught_up(&a).await;
    caught_up(&b).await;
    // A restart that outlasts every lease: renewals sent before it (while
    // caught up) die with their connections.
    proxy.stall();
    wait_until("both members to fence themselves", || {
        a.guard().is_fenced() && b.guard().is_fenced()
    })
    .await;
    as_after_a_failover(&mut connection, "met");
    proxy.cut();
    proxy.resume();
    caught_up(&a).await;
    caught_up(&b).await;
    for member in [&a, &b] {
        for key in before.iter().map(String::as_str).chain(["between"]) {
            assert_ne!(member.guard().check(key), Verdict::Absent, "{key}");
        }
    }
    // Nor later, once the snapshot that met it is replaced (by one of
    // members that count as fresh since the restart).
    a.fleet.publish_snapshot().await.unwrap();
    // Both members renewed meanwhile (a renewal is where the mark came
    // back), however slow the machine.
    let lease_of = |connection: &mut redis::Connection, member: &Member| {
        lease_end(connection, "met", member.fleet.member())
    };
    let leases_before = [lease_of(&mut connection, &a), lease_of(&mut connection, &b)];
    tokio::time::sleep(LEASE * 4).await;
    wait_until("both members to renew", || {
        [&a, &b]
            .into_iter()
            .zip(leases_before)
            .all(|(member, before)| lease_of(&mut connection, member) > before)
    })
    .await;
    assert!(
        !record_is_marked(&mut connection, "met"),
        "the met need came back"
    );
    caught_up(&a).await;
    caught_up(&b).await;
}

/// A member without the keys a marked record needed, when a snapshot met
/// that need before a restart that every member lived through fenced,
/// loads that snapshot: it used to mark the record after the restart,
/// which every member then lacked (each counts as fresh), and none could
/// publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_lacking_what_a_met_need_held_loads_it_after_a_restart() {
    let server = RedisServer::start();
    let to_a = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let to_z = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let a = join(guard("a"), to_a.client(), "lacking").await;
    let before = write_keys_from_before(&a).await;
    caught_up(&a).await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
    wait_until("a snapshot holding the keys from before the loss", || {
        snapshot_covers_the_record(&mut connection, "lacking")
    })
    .await;
    // `z` joins when no snapshot is at hand (and `a` cannot publish one):
    // it lacks the keys from before, and recovers.
    stall_until_fenced(&to_a, &a).await;
    let () = redis::cmd("DEL")
        .arg("{lacking}:snapshot")
        .query(&mut connection)
        .unwrap();
    let z = join(guard("z"), to_z.client(), "lacking").await;
    assert!(z.guard().is_fenced());
    // `z` stalls; `a` publishes again, then stalls too.
    to_z.stall();
    to_a.resume();
    wait_until("`a` to publish the keys from before again", || {
        snapshot_covers_the_record(&mut connection, "lacking")
    })
    .await;
    stall_until_fenced(&to_a, &a).await;
    // A restart that outlasts every lease.
    as_after_a_failover(&mut connection, "lacking");
    for proxy in [&to_a, &to_z] {
        proxy.cut();
        proxy.resume();
    }
    caught_up(&a).await;
    caught_up(&z).await;
    for key in &before {
        assert_ne!(z.guard().check(key), Verdict::Absent, "{key}");
    }
}

/// A member without the keys a marked record needs lacks them in the
/// next record too: a restart from a dump saved before the mark was
/// (within a second of it, under `appendfsync everysec`) used to leave
/// the new record unmarked, and a lease later such a member took the new
/// stream for all there was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_lacking_what_a_lost_mark_needed_marks_the_next_record() {
    let server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let a = join(guard("a"), proxy.client(), "unsaved").await;
    let before = write_keys_from_before(&a).await;
    caught_up(&a).await;
    // `a` lives through the loss fenced: it holds the keys, but cannot
    // vouch for them, and no member can publish them.
    stall_until_fenced(&proxy, &a).await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
    proxy.resume();
    wait_until("`a` to mark the keys from before as needed", || {
        exists(&mut connection, "{unsaved}:snapshot:needed")
    })
    .await;
    let c = join(guard("c"), server.client(), "unsaved").await;
    assert!(c.guard().is_fenced());
    // As after a restart from a dump without the mark.
    let () = redis::pipe()
        .atomic()
        .del("{unsaved}:snapshot:needed")
        .hset("{unsaved}:since:record", "run", "another")
        .query(&mut connection)
        .unwrap();
    wait_until("a member without the keys to mark the new record", || {
        record_is_marked(&mut connection, "unsaved")
    })
    .await;
    for _ in 0..200 {
        for key in &before {
            assert_ne!(c.guard().check(key), Verdict::Absent, "{key}");
        }
        tokio::time::sleep(LEASE / 20).await;
    }
}

/// After a loss that every member lived through fenced (their leases
/// lapsed first), none can vouch for the keys from before, and the fleet
/// stays fenced. Deleting the mark accepts their loss: a member that was
/// recovering then takes the new stream. It used to keep the mark it saw
/// last (a recovering member does not renew) and wait for good, and then,
/// with no member unfenced to publish a snapshot, to wait for one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_mark_lets_a_recovering_member_take_the_new_stream() {
    let server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let b = join(guard("b"), proxy.client(), "accept").await;
    b.fleet.insert_then_write("before", async {}).await.unwrap();
    caught_up(&b).await;
    stall_until_fenced(&proxy, &b).await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
    proxy.resume();
    wait_until("`b` to mark the keys from before as needed", || {
        exists(&mut connection, "{accept}:snapshot:needed")
    })
    .await;
    assert!(b.guard().is_fenced());
    // A restart while `b` recovers begins another record, which keeps the
    // mark (and `b` marks no record twice: it marked it again at every look
    // for a snapshot, undoing the deletion below).
    let since = as_after_a_failover(&mut connection, "accept");
    // It timed out once under CI load (not reproduced since): the state
    // says where `b` was.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let marked = marked_record(&mut connection, "accept");
        if marked.is_some_and(|marked| marked != since) {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the mark ({marked:?}) still names the record before the restart ({since}); `b`: {:?}",
            b.fleet
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let () = redis::cmd("DEL")
        .arg("{accept}:snapshot:needed")
        .query(&mut connection)
        .unwrap();
    caught_up(&b).await;
    // `b` applies the new stream: a write another member makes reaches it.
    let c = join(guard("c"), server.client(), "accept").await;
    c.fleet.insert_then_write("after", async {}).await.unwrap();
    caught_up(&b).await;
    assert_eq!(b.guard().check("after"), Verdict::MaybePresent);
    // The deletion accepted that loss for good: a later failover, which
    // `c` marks (it was caught up), leaves both answering. A list of marked
    // records that outlived the deletion had both recover for good, each
    // waiting for a snapshot that only a member holding that loss's keys
    // could publish.
    let since = as_after_a_failover(&mut connection, "accept");
    wait_until("`c` to mark the record the failover began", || {
        let marked = marked_record(&mut connection, "accept");
        marked.is_some_and(|marked| marked != since)
    })
    .await;
    tokio::time::sleep(LEASE * 2).await;
    caught_up(&b).await;
    caught_up(&c).await;
}

/// A record that begins anew over a stream Redis kept (a failover, a
/// restart from a dump, a clock step, the first run of a version that
/// records the run id) sent every member back to the stream's start: past
/// a trimmed stream they all recovered, none could publish the snapshot
/// that needed, and members without a source stayed fenced for good. They
/// replay the kept stream from where it was trimmed instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_replay_a_trimmed_stream_kept_across_a_new_record() {
    let server = RedisServer::start();
    let mut connection = server.client().get_connection().unwrap();
    let short = |builder: FleetSyncBuilder| builder.stream_max_len(50);
    for change in ["run id", "clock step"] {
        let fleet = format!("kept-{}", change.replace(' ', "-"));
        let a = join_with(guard("a"), server.client(), &fleet, short).await;
        let b = join_with(guard("b"), server.client(), &fleet, short).await;
        let written: Vec<String> = (0..200).map(|n| format!("kept:{n}")).collect();
        for key in &written {
            a.fleet.insert_then_write(key, async {}).await.unwrap();
        }
        caught_up(&b).await;
        let trimmed: Option<String> = redis::cmd("GET")
            .arg(format!("{{{fleet}}}:inserts:trimmed"))
            .query(&mut connection)
            .unwrap();
        assert!(trimmed.is_some(), "the stream was trimmed");
        if change == "run id" {
            as_after_a_failover(&mut connection, &fleet);
        } else {
            // As after Redis's clock stepped back an hour.
            let (seconds, _): (u64, u64) = redis::cmd("TIME").query(&mut connection).unwrap();
            let () = redis::cmd("SET")
                .arg(format!("{{{fleet}}}:since"))
                .arg((seconds + 3_600) * 1_000)
                .query(&mut connection)
                .unwrap();
        }
        a.fleet.insert_then_write("after", async {}).await.unwrap();
        caught_up(&a).await;
        caught_up(&b).await;
        for key in written.iter().chain(["after".to_owned()].iter()) {
            assert_eq!(
                b.guard().check(key),
                Verdict::MaybePresent,
                "{change}: {key}"
            );
        }
    }
}

/// A member's notices subscription gone silent (its peer gone without a
/// reset, a NAT or load balancer dropping the idle connection) was never
/// noticed: the member heard no request for a snapshot again, and a
/// joiner behind the trimmed stream, which only that member could serve,
/// stayed fenced. The subscription is now pinged every lease and made
/// again when no answer comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_notices_go_silent_subscribes_again() {
    let server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    proxy.mark(b"SUBSCRIBE");
    let short = |builder: FleetSyncBuilder| builder.stream_max_len(50);
    let b = join_with(guard("b"), proxy.client(), "silent", short).await;
    caught_up(&b).await;
    let written: Vec<String> = (0..200).map(|n| format!("silent:{n}")).collect();
    for key in &written {
        b.fleet.insert_then_write(key, async {}).await.unwrap();
    }
    assert!(proxy.silence_marked() >= 1, "b's subscription");
    // Past the trimmed stream, `c` needs a snapshot, which only `b` can
    // publish; `c` asks for one every lease.
    let c = join_with(guard("c"), server.client(), "silent", short).await;
    caught_up(&c).await;
    for key in &written {
        assert_eq!(c.guard().check(key), Verdict::MaybePresent, "{key}");
    }
}

/// A snapshot whose position was read before Redis lost its data must not
/// be published into the Redis that lost it: its position is in a stream
/// that is gone, and a joiner adopting it would skip the new stream's
/// entries below it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_taken_before_redis_lost_its_data_is_not_published_after() {
    let server = RedisServer::start();
    let a = join(guard("a"), server.client(), "flushed").await;
    a.fleet.insert_then_write("before", async {}).await.unwrap();
    caught_up(&a).await;
    let old_position = a.fleet.stats().position.to_string();
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
    let published = a.fleet.publish_snapshot().await;
    let manifest: Option<String> = redis::cmd("GET")
        .arg("{flushed}:snapshot")
        .query(&mut connection)
        .unwrap();
    assert!(
        manifest
            .as_deref()
            .is_none_or(|manifest| !manifest.starts_with(&old_position)),
        "published {published:?} into the emptied Redis: {manifest:?}"
    );
}

/// A snapshot's chunks were named by a version that `INCR` hands out and
/// a loss resets. A member that took its version before Redis lost its data
/// and wrote its chunks after overwrote a survivor's snapshot of the same
/// version: a member joining then adopted the late publisher's set, which
/// lacks the new stream's entries, at the survivor's position past them, and
/// answered Absent for them; the late publish, refused, then deleted the
/// survivor's chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_straddling_a_loss_leaves_the_survivors_snapshot_whole() {
    // b's calls time out after a lease. a learns of the loss at a renewal
    // and publishes by the next few (a quarter lease apart): half of b's
    // wait here, measured at the default lease.
    let BehindAProxy {
        server,
        proxy,
        a,
        b,
    } = behind_a_proxy("straddle", long_lease).await;
    let before = write_keys_from_before(&a).await;
    caught_up(&b).await;
    // Once, so that Redis holds b's scripts: its next publish takes a
    // version in one step.
    b.fleet.publish_snapshot().await.unwrap();
    let mut connection = server.client().get_connection().unwrap();
    let version = "{straddle}:snapshot:version";
    let () = redis::cmd("SET")
        .arg(version)
        .arg(41)
        .query(&mut connection)
        .unwrap();
    // b takes version 42; its chunks wait.
    proxy.stall_at(b"snapshot:version", StallAt::After);
    let late = spawn_publish(&b);
    wait_until("b to take its version", || {
        proxy.is_stalled()
            && redis::cmd("GET")
                .arg(version)
                .query::<u64>(&mut connection)
                .unwrap()
                == 42
    })
    .await;
    // Redis loses its data, and a key is written on the new stream (as a
    // member appends it; a write through the fleet would wait out the new
    // record's first lease, and b's call would time out meanwhile). a, which
    // lived through the loss, publishes past it: version 42 again.
    let () = redis::pipe()
        .atomic()
        .cmd("FLUSHALL")
        .ignore()
        .cmd("SET")
        .arg(version)
        .arg(41)
        .ignore()
        .add_command(member_entry("straddle", "after"))
        .ignore()
        .query(&mut connection)
        .unwrap();
    wait_until("a to publish what preceded the loss", || {
        snapshot_covers_the_record(&mut connection, "straddle")
    })
    .await;
    let manifest = manifest(&mut connection, "straddle");
    assert_eq!(manifest.split(' ').nth(1), Some("42"), "{manifest}");
    // b writes its chunks, its manifest is refused, and its clean-up waits.
    proxy.stall_at(b"\r\nDEL\r\n", StallAt::Before);
    proxy.resume();
    wait_until("b to clean up", || proxy.is_stalled()).await;
    let expected: Vec<&str> = before.iter().map(String::as_str).chain(["after"]).collect();
    let c = join_with(guard("c"), server.client(), "straddle", long_lease).await;
    caught_up(&c).await;
    for key in &expected {
        assert_ne!(
            c.guard().check(key),
            Verdict::Absent,
            "{key} is absent on a member that joined from the survivor's snapshot"
        );
    }
    proxy.resume();
    let refused = late.await.unwrap();
    assert!(
        matches!(refused, Err(FleetError::SnapshotRefused)),
        "b's position is in the lost stream: {refused:?}"
    );
    let d = join_with(guard("d"), server.client(), "straddle", long_lease).await;
    caught_up(&d).await;
    for key in &expected {
        assert_ne!(
            d.guard().check(key),
            Verdict::Absent,
            "{key} is absent on a member that joined after the late publish"
        );
    }
}

/// A publish takes the member's position first and writes its snapshot
/// after; another member's publishes meanwhile can trim the stream past that
/// position. The late snapshot still replaced the fleet's: members joining
/// or recovering found none that the stream continues, and stayed fenced
/// until the next publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_the_stream_was_trimmed_past_does_not_replace_the_fleets() {
    let BehindAProxy {
        server,
        proxy,
        a,
        b,
    } = behind_a_proxy("trimmed-past", long_lease).await;
    a.fleet.insert_then_write("first", async {}).await.unwrap();
    caught_up(&b).await;
    proxy.stall_at(b"snapshot:version", StallAt::Before);
    let late = spawn_publish(&b);
    wait_until("b to take its position", || proxy.is_stalled()).await;
    // Entries b has not read; a publishes past them twice, and the second
    // publish trims the stream to the first's position.
    let mut connection = server.client().get_connection().unwrap();
    let last = append_entries(&mut connection, "trimmed-past", "later", 3);
    wait_until("a to apply them", || a.fleet.stats().position == last).await;
    a.fleet.publish_snapshot().await.unwrap();
    a.fleet.publish_snapshot().await.unwrap();
    let trimmed: StreamPosition = redis::cmd("GET")
        .arg("{trimmed-past}:inserts:trimmed")
        .query(&mut connection)
        .unwrap();
    proxy.resume();
    let outcome = late.await.unwrap();
    let position = manifest_position(&manifest(&mut connection, "trimmed-past"));
    assert!(
        position >= trimmed,
        "b published {outcome:?}: the fleet's snapshot is at {position}, the stream trimmed to {trimmed}"
    );
    assert!(
        matches!(outcome, Err(FleetError::SnapshotRefused)),
        "{outcome:?}"
    );
}

/// A publish trims the stream to the snapshot it replaced, once it switched
/// the manifest. Another member's publish in between, from further behind,
/// replaces the manifest with a snapshot before that trim: the trim then
/// cut the stream past the snapshot that stands, and joining or recovering
/// members found none the stream continues until the next publish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_trim_stops_at_the_snapshot_that_stands() {
    let BehindAProxy {
        server,
        proxy,
        a,
        b,
    } = behind_a_proxy("late-trim", long_lease).await;
    let z_proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let z = join_with(guard("z"), z_proxy.client(), "late-trim", long_lease).await;
    for key in keys("early", 3) {
        a.fleet.insert_then_write(&key, async {}).await.unwrap();
    }
    caught_up(&z).await;
    let mut connection = server.client().get_connection().unwrap();
    // z takes its position; its publish waits.
    z_proxy.stall_at(b"snapshot:version", StallAt::Before);
    let behind = spawn_publish(&z);
    wait_until("z to take its position", || z_proxy.is_stalled()).await;
    // a publishes further on; b publishes further still, and its trim to
    // a's snapshot waits.
    let first = append_entries(&mut connection, "late-trim", "first", 2);
    wait_until("a to apply them", || a.fleet.stats().position == first).await;
    a.fleet.publish_snapshot().await.unwrap();
    let a_chunk = first_chunk("late-trim", &manifest(&mut connection, "late-trim"));
    let second = append_entries(&mut connection, "late-trim", "second", 2);
    wait_until("b to apply them", || b.fleet.stats().position == second).await;
    proxy.stall_at(a_chunk.as_bytes(), StallAt::Before);
    let ahead = spawn_publish(&b);
    wait_until("b to switch the manifest", || proxy.is_stalled()).await;
    // z's snapshot replaces b's; then b trims.
    z_proxy.resume();
    let z_published = behind.await.unwrap().unwrap();
    proxy.resume();
    ahead.await.unwrap().unwrap();
    let (manifest, trimmed): (String, Option<StreamPosition>) = redis::pipe()
        .get("{late-trim}:snapshot")
        .get("{late-trim}:inserts:trimmed")
        .query(&mut connection)
        .unwrap();
    let standing = manifest_position(&manifest);
    assert_eq!(standing, z_published, "z's snapshot stands");
    assert!(
        trimmed.is_none_or(|trimmed| trimmed <= standing),
        "the stream was trimmed to {trimmed:?}, past the snapshot at {standing}"
    );
}

/// A publish cleans up once it switched the manifest: it deletes the
/// replaced snapshot's chunks and trims the stream to it. A failover in
/// between, to a replica that never got the new manifest, left that
/// clean-up to the new master, which still serves the replaced snapshot:
/// its chunks were deleted under it, and no member could load it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_up_after_a_failover_spares_the_snapshot_the_new_master_serves() {
    let BehindAProxy {
        server,
        proxy,
        a,
        b,
    } = behind_a_proxy("cleanup", |builder| builder).await;
    a.fleet.insert_then_write("first", async {}).await.unwrap();
    caught_up(&b).await;
    a.fleet.publish_snapshot().await.unwrap();
    let mut connection = server.client().get_connection().unwrap();
    let manifest = manifest(&mut connection, "cleanup");
    let first_chunk = first_chunk("cleanup", &manifest);
    assert!(exists(&mut connection, &first_chunk), "{manifest}");
    // b's publish switches the manifest; its clean-up, which names a's
    // chunks, waits.
    proxy.stall_at(first_chunk.as_bytes(), StallAt::Before);
    let late = spawn_publish(&b);
    wait_until("b to switch the manifest", || proxy.is_stalled()).await;
    // The failover: a new master, holding a's manifest.
    as_after_a_failover(&mut connection, "cleanup");
    let () = redis::cmd("SET")
        .arg("{cleanup}:snapshot")
        .arg(&manifest)
        .query(&mut connection)
        .unwrap();
    proxy.resume();
    let outcome = late.await.unwrap();
    assert!(
        exists(&mut connection, &first_chunk),
        "b's publish ({outcome:?}) deleted the chunks of the snapshot the fleet serves"
    );
}

/// A write appended in the fleet record's first lease (after a restart or
/// a failover) waits that lease out, which nothing but time ends. It looked
/// at the members every 20 ms meanwhile, each look a script that runs
/// `INFO`: 50 a second per waiting writer, as Redis comes back. It now
/// sleeps the lease out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_in_the_records_first_lease_waits_it_out_without_polling() {
    let server = RedisServer::start();
    let lease = Duration::from_secs(2);
    let a = join_with(guard("a"), server.client(), "grace", |builder| {
        builder.lease(lease)
    })
    .await;
    let mut connection = server.client().get_connection().unwrap();
    as_after_a_failover(&mut connection, "grace");
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query(&mut connection)
        .unwrap();
    let started = std::time::Instant::now();
    a.fleet.insert_then_write("after", async {}).await.unwrap();
    let waited = started.elapsed();
    // `EVAL` too, where a script was not loaded yet.
    let scripts = server.command_calls("evalsha") + server.command_calls("eval");
    assert!(
        waited >= lease / 2,
        "the write waited {waited:?}: it was not held by the record's first lease"
    );
    // The member's own renewals, reads and announcements ran 27 or so (30
    // in all, about 15 a second, on 2026-11-25, three runs); looking every
    // 20 ms made it 122 (61 a second). A rate: a slow machine waits longer.
    let per_second = scripts as f64 / waited.as_secs_f64();
    assert!(
        per_second < 30.0,
        "{scripts} scripts ran while one write waited {waited:?}"
    );
}

/// A fleet's user without channel permission (`resetchannels`, Redis 7's
/// default for a new user): no notice is published or heard, and writers
/// learn of each acknowledgement by looking again (every 100 ms at most,
/// where it was every 20 ms): writes are still acknowledged by every member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_without_channel_permission_still_acknowledges_writes() {
    let server = RedisServer::start();
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("ACL")
        .arg(
            &[
                "SETUSER",
                "member",
                "on",
                "nopass",
                "~*",
                "resetchannels",
                "+@all",
            ][..],
        )
        .query(&mut connection)
        .unwrap();
    // `nopass` takes any password; without one the client sends no `AUTH`.
    let client =
        || redis::Client::open(format!("redis://member:any@127.0.0.1:{}/", server.port)).unwrap();
    let a = join(guard("a"), client(), "quiet").await;
    let b = join(guard("b"), client(), "quiet").await;
    caught_up(&b).await;
    for key in keys("quiet", 5) {
        a.fleet.insert_then_write(&key, async {}).await.unwrap();
        assert_eq!(b.guard().check(&key), Verdict::MaybePresent, "{key}");
    }
}

/// A member recovering where no member can publish (alone here, without a
/// source) tries the standing snapshot once a lease, and fetched every chunk
/// of it before finding that the stream was trimmed past it: the whole
/// filter downloaded again every lease, for as long as it stayed stranded.
/// It now asks for a snapshot having fetched none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovering_member_fetches_no_chunk_of_a_snapshot_the_stream_was_trimmed_past() {
    let server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let b = join(guard("b"), proxy.client(), "unfetched").await;
    b.fleet.insert_then_write("first", async {}).await.unwrap();
    b.fleet.publish_snapshot().await.unwrap();
    let mut connection = server.client().get_connection().unwrap();
    let chunk = first_chunk("unfetched", &manifest(&mut connection, "unfetched"));
    let mut requests = server.client().get_connection().unwrap();
    requests
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let requested = tokio::task::spawn_blocking(move || {
        let mut notices = requests.as_pubsub();
        notices.subscribe("{unfetched}:notices").unwrap();
        loop {
            let notice: String = notices.get_message().unwrap().get_payload().unwrap();
            if notice == "request" {
                return;
            }
        }
    });
    // Entries b has not read, trimmed away with the snapshot's position.
    proxy.stall();
    let last = append_entries(&mut connection, "unfetched", "gone", 3);
    let () = redis::cmd("SET")
        .arg("{unfetched}:inserts:trimmed")
        .arg(last)
        .query(&mut connection)
        .unwrap();
    proxy.stall_at(chunk.as_bytes(), StallAt::Before);
    proxy.resume();
    tokio::select! {
        requested = requested => requested.unwrap(),
        () = wait_until("b to fetch a chunk", || proxy.is_stalled()) => {}
    }
    assert!(
        !proxy.is_stalled(),
        "b fetched {chunk}, of a snapshot the stream was trimmed past"
    );
    assert!(b.fleet.stats().recoveries >= 1, "{:?}", b.fleet.stats());
    assert!(b.guard().is_fenced());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_the_trimmed_stream_left_behind_recovers_from_a_snapshot() {
    let small =
        |builder: FleetSyncBuilder| builder.stream_max_len(50).snapshot_chunk_bytes(16 << 10);
    let BehindAProxy {
        server,
        proxy,
        a,
        b,
    } = behind_a_proxy("trim", small).await;
    let ledger = Ledger::default();
    let audit = audit(&ledger, vec![b.guard().clone()]);
    stall_until_fenced(&proxy, &b).await;
    // Far more than the stream keeps, while B is away; no snapshot yet.
    assert_eq!(
        keep_writing(&ledger, &a.fleet, keys("away", 1_000))
            .await
            .unwrap(),
        1_000
    );
    proxy.resume();
    caught_up(&b).await;
    let report = audit.finish().await;
    assert!(
        report.answered_fenced[0],
        "the fenced member answered MaybePresent"
    );
    assert!(b.fleet.stats().recoveries >= 1, "{:?}", b.fleet.stats());
    for key in ledger.completed() {
        assert_eq!(b.guard().check(&key), Verdict::MaybePresent, "{key}");
    }
    // The snapshot B asked for, chunked, and only its chunks kept.
    let mut connection = server.client().get_connection().unwrap();
    let manifest: String = redis::cmd("GET")
        .arg("{trim}:snapshot")
        .query(&mut connection)
        .unwrap();
    let chunks: usize = manifest.split(' ').nth(2).unwrap().parse().unwrap();
    assert!(chunks > 1, "chunked: {manifest}");
}

/// A join dropped (a timeout around it) after its renewal ran in Redis but
/// before its reply came: Redis holds a lease for the member, which writers
/// count from then on, but not for the keys acknowledged before. A join
/// retried within that lease found it live and took itself for caught up:
/// it answered from an empty set, unfenced, before reading the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_join_dropped_after_its_renewal_ran_catches_up_when_retried() {
    let server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let a = join_with(guard("a"), server.client(), "redo", long_lease).await;
    let before = write_keys_from_before(&a).await;
    let b = long_lease(FleetSync::builder(guard("b"), proxy.client(), "redo")).build();
    proxy.stall_at(b"{redo}:leases", StallAt::After);
    // Dropped once its renewal has gone out, as a timeout around it would.
    tokio::select! {
        _ = b.join() => panic!("the join waits on its renewal's reply"),
        () = wait_until("the join's renewal to go out", || proxy.is_stalled()) => {}
    }
    let mut connection = server.client().get_connection().unwrap();
    wait_until("b's renewal to run", || {
        lease_end(&mut connection, "redo", b.member()).is_some()
    })
    .await;
    // The retried join's reader stops before its first read of the stream.
    proxy.stall_at(
        b"{redo}:inserts\r\n$22\r\n{redo}:inserts:trimmed",
        StallAt::Before,
    );
    proxy.resume();
    let handle = b.join().await.unwrap();
    wait_until("b's reader to stop at its first read", || {
        proxy.is_stalled()
    })
    .await;
    for key in &before {
        assert_ne!(
            b.guard().check(key),
            Verdict::Absent,
            "{key}, acknowledged before b joined"
        );
    }
    proxy.resume();
    caught_up(&Member { fleet: b, handle }).await;
    a.handle.shutdown().await;
}

async fn a_joiner_gets_every_window(lifecycle: Lifecycle, expected_items: u64, fleet: &str) {
    let server = RedisServer::start();
    let make = |name: &str| {
        Guard::builder()
            .name(name)
            .expected_items(expected_items)
            .seed(0xf1ee7)
            .lifecycle(lifecycle)
            .build()
            .unwrap()
    };
    let a = join(make("a"), server.client(), fleet).await;
    caught_up(&a).await;
    let ledger = Ledger::default();
    for round in 0..3 {
        keep_writing(&ledger, &a.fleet, keys(&format!("round{round}"), 2_000))
            .await
            .unwrap();
        if matches!(lifecycle, Lifecycle::Rotate { .. }) {
            a.guard().rotate().unwrap();
        }
    }
    let filters = a.guard().live_filters().len();
    assert!(filters >= 3, "{filters} filters");
    a.fleet.publish_snapshot().await.unwrap();

    let joiner = join(make("joiner"), server.client(), fleet).await;
    caught_up(&joiner).await;
    assert_eq!(
        joiner.guard().live_filters().len(),
        filters,
        "the whole set"
    );
    let audit = audit(&ledger, vec![joiner.guard().clone()]);
    audit.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_gets_every_window_of_a_rotating_guard() {
    let lifecycle = Lifecycle::Rotate {
        generations: 4,
        period: Duration::from_secs(3_600),
    };
    a_joiner_gets_every_window(lifecycle, 100_000, "rotate").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_gets_every_filter_of_a_grown_guard() {
    let lifecycle = Lifecycle::Grow {
        expansion: 2.0,
        tightening: 0.5,
    };
    a_joiner_gets_every_window(lifecycle, 1_000, "grow").await;
}

fn guard_over_store(server: &RedisServer, name: &str) -> Guard {
    Guard::builder()
        .name(name)
        .expected_items(100_000)
        .seed(0xf1ee7)
        .source(RedisSource::new(server.client(), "item:*").strip_prefix("item:"))
        .rebuild_policy(RebuildPolicy::default().write_settle(Duration::from_millis(250)))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_landing_after_the_settle_reaches_a_member_rebuilding_meanwhile() {
    let server = RedisServer::start();
    let a_guard = guard_over_store(&server, "a");
    let b_guard = guard_over_store(&server, "b");
    a_guard.rebuild().await.unwrap();
    b_guard.rebuild().await.unwrap();
    let a = join(a_guard, server.client(), "slow").await;
    let b = join(b_guard, server.client(), "slow").await;
    caught_up(&b).await;

    let ledger = Ledger::default();
    let audit = audit(&ledger, vec![b.guard().clone()]);
    let rebuilding = {
        let b = b.guard().clone();
        tokio::spawn(async move {
            for _ in 0..6 {
                b.rebuild().await.unwrap();
            }
        })
    };
    let landed_during_a_rebuild = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut writes = Vec::new();
    for i in 0..20 {
        let (fleet, ledger, client) = (a.fleet.clone(), ledger.clone(), server.client());
        let (b, landed_during_a_rebuild) =
            (b.guard().clone(), Arc::clone(&landed_during_a_rebuild));
        writes.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(i * 40)).await;
            let key = format!("{i}");
            let write = async {
                // The store write lands 400 ms after the insert.
                tokio::time::sleep(Duration::from_millis(400)).await;
                if b.stats().rebuilding {
                    landed_during_a_rebuild.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                let mut connection = client.get_multiplexed_async_connection().await.unwrap();
                let () = redis::cmd("SET")
                    .arg(format!("item:{key}"))
                    .arg("v")
                    .query_async(&mut connection)
                    .await
                    .unwrap();
            };
            fleet.insert_then_write(&key, write).await.unwrap();
            ledger.completed.lock().unwrap().push(key);
        }));
    }
    for write in writes {
        write.await.unwrap();
    }
    rebuilding.await.unwrap();
    assert!(
        landed_during_a_rebuild.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "no write landed while b rebuilt: the scenario did not happen"
    );
    b.guard().rebuild().await.unwrap();
    audit.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_leaves_warming_through_the_fleet_only_with_a_covering_snapshot() {
    let server = RedisServer::start();
    server.populate(0..5_000);
    let a_guard = guard_over_store(&server, "a");
    a_guard.rebuild().await.unwrap();
    let a = join(a_guard, server.client(), "bulk").await;
    caught_up(&a).await;
    a.fleet.publish_snapshot().await.unwrap();

    // B has a source but no build yet: the snapshot ends its warming.
    let b = join(guard_over_store(&server, "b"), server.client(), "bulk").await;
    caught_up(&b).await;
    assert!(!b.guard().is_warming(), "a covering snapshot ends warming");
    let stored: Vec<String> = (0..5_000).map(|i| i.to_string()).collect();
    assert!(stored.iter().all(|key| !b.guard().check(key).is_absent()));

    // Trim the stream past the snapshot, and leave no member to publish a new one.
    let small = |builder: FleetSyncBuilder| builder.stream_max_len(10);
    let writer = join_with(
        guard_over_store(&server, "w"),
        server.client(),
        "bulk",
        small,
    )
    .await;
    a.handle.shutdown().await;
    b.handle.shutdown().await;
    let written: Vec<String> = (5_000..5_500).map(|i| i.to_string()).collect();
    let mut store = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    for key in &written {
        let set = redis::cmd("SET")
            .arg(format!("item:{key}"))
            .arg("v")
            .clone();
        let mut store = store.clone();
        let write = async move { set.query_async::<()>(&mut store).await };
        writer
            .fleet
            .insert_then_write(key, write)
            .await
            .unwrap()
            .unwrap();
    }
    let _: redis::Value = redis::cmd("PING").query_async(&mut store).await.unwrap();
    writer.handle.shutdown().await;

    let c = join(guard_over_store(&server, "c"), server.client(), "bulk").await;
    assert!(
        c.guard().is_warming() || c.guard().is_fenced(),
        "no covering snapshot: still warming (or fenced)"
    );
    assert_ne!(c.guard().check("0"), Verdict::Absent);
    // Its own build (the recovery's) brings it in, stored keys and stream alike.
    caught_up(&c).await;
    assert!(!c.guard().is_warming());
    assert!(stored.iter().all(|key| !c.guard().check(key).is_absent()));
    assert!(written.iter().all(|key| !c.guard().check(key).is_absent()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_configured_otherwise_refuses_to_join() {
    let server = RedisServer::start();
    let _a = join(guard("a"), server.client(), "settings").await;
    let other = Guard::builder()
        .name("other")
        .expected_items(100_000)
        .seed(1)
        .build()
        .unwrap();
    let refused = refused_join(other.clone(), server.client(), "settings", LEASE).await;
    assert!(
        matches!(
            &refused,
            FleetError::SettingsDiffer {
                setting: "seed",
                ..
            }
        ),
        "{refused}"
    );
    assert!(
        other.is_fenced(),
        "a refused member cannot show it holds the fleet's writes"
    );
    assert_eq!(other.check("never inserted"), Verdict::MaybePresent);

    let other_lease = refused_join(guard("b"), server.client(), "settings", LEASE * 2).await;
    assert!(matches!(
        other_lease,
        FleetError::SettingsDiffer {
            setting: "lease_ms",
            ..
        }
    ));

    // A fleet of a build that wrote its entries otherwise (no protocol
    // recorded): this build's members would skip them, and acknowledge.
    let mut connection = server.client().get_connection().unwrap();
    let recorded: String = redis::cmd("GET")
        .arg("{settings}:settings")
        .query(&mut connection)
        .unwrap();
    assert!(recorded.contains("protocol="), "{recorded}");
    let older: Vec<&str> = recorded
        .lines()
        .filter(|line| !line.starts_with("protocol="))
        .collect();
    let () = redis::cmd("SET")
        .arg("{older}:settings")
        .arg(older.join("\n"))
        .query(&mut connection)
        .unwrap();
    let other_protocol = refused_join(guard("c"), server.client(), "older", LEASE).await;
    assert!(
        matches!(
            &other_protocol,
            FleetError::SettingsDiffer {
                setting: "protocol",
                ..
            }
        ),
        "{other_protocol}"
    );
}

/// Redis losing its data loses the fleet's settings too. The members
/// running record theirs again at their first renewal after, so a member
/// configured otherwise is still refused; before, only a join recorded
/// them, and one with another write settle joined (its rebuilds, shared
/// with the fleet, could then miss the others' slow writes). The joiner
/// comes at once: it checks after waiting out the new record's first
/// lease, by when `a` (renewing every quarter lease) has recorded its
/// settings; a joiner that checked first recorded its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_lost_its_data_a_member_configured_otherwise_is_still_refused() {
    let server = RedisServer::start();
    let _a = join(guard("a"), server.client(), "resettled").await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
    let slower = Guard::builder()
        .name("slower")
        .expected_items(100_000)
        .seed(0xf1ee7)
        .rebuild_policy(RebuildPolicy::default().write_settle(Duration::from_secs(10)))
        .build()
        .unwrap();
    let refused = refused_join(slower, server.client(), "resettled", LEASE).await;
    assert!(
        matches!(
            &refused,
            FleetError::SettingsDiffer {
                setting: "write_settle_ms",
                ..
            }
        ),
        "{refused}"
    );
    assert!(exists(&mut connection, "{resettled}:settings"));
}

/// The other way round: a member configured otherwise recorded its
/// settings first after the loss. The member running from before finds
/// them at its next renewal and stays fenced, rather than serve (and share
/// rebuilds) under settings the fleet does not hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_finding_other_settings_after_a_loss_stays_fenced() {
    let server = RedisServer::start();
    // Over the store: joining again after the loss, it lacks the keys from
    // before the loss that the record is marked as needing (it cannot show
    // it holds them), and rebuilds them.
    let a = join(guard_over_store(&server, "a"), server.client(), "diverged").await;
    caught_up(&a).await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::pipe()
        .atomic()
        .cmd("FLUSHALL")
        .ignore()
        .set("{diverged}:settings", "write_settle_ms=10000")
        .ignore()
        .query(&mut connection)
        .unwrap();
    // A member caught up when Redis lost its data is not fenced by the loss
    // itself: it holds every acknowledged key.
    wait_until("a to fence itself", || a.guard().is_fenced()).await;
    tokio::time::sleep(LEASE * 4).await;
    assert!(
        a.guard().is_fenced(),
        "a serves under settings the fleet does not hold"
    );
    assert!(!a.handle.is_finished());

    // Configured as the fleet now is (the other member's settings gone),
    // the same member joins again and serves: what fenced its last
    // membership is not carried into the next.
    a.handle.shutdown().await;
    let () = redis::cmd("DEL")
        .arg("{diverged}:settings")
        .query(&mut connection)
        .unwrap();
    let again = Member {
        handle: a.fleet.join().await.unwrap(),
        fleet: a.fleet,
    };
    caught_up(&again).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_snapshot_is_refused_and_the_member_joins_from_the_stream() {
    let server = RedisServer::start();
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("SET")
        .arg("{bad}:snapshot")
        .arg("0-1 7 1")
        .query(&mut connection)
        .unwrap();
    let () = redis::cmd("SET")
        .arg("{bad}:snapshot:0:7:0")
        .arg("this is not a filter")
        .query(&mut connection)
        .unwrap();
    let kept = guard("kept");
    kept.insert("kept");
    let member = join(kept, server.client(), "bad").await;
    caught_up(&member).await;
    assert_eq!(member.guard().check("kept"), Verdict::MaybePresent);
    assert_eq!(member.guard().stats().swaps, 1, "nothing was swapped in");
}

#[cfg(feature = "metrics")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_member_publishes_its_standing_as_metrics() {
    use bloomguard::metrics::{FLEET_FENCED, FLEET_INSERTS_TOTAL, FLEET_MEMBERS};
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let server = RedisServer::start();
    // Long leases: the gauges are read a moment after the count they show.
    let a = join_with(guard("a"), server.client(), "metrics", long_lease).await;
    let b = join_with(guard("b"), server.client(), "metrics", long_lease).await;
    caught_up(&a).await;
    caught_up(&b).await;
    let ledger = Ledger::default();
    keep_writing(&ledger, &a.fleet, keys("m", 5)).await.unwrap();
    wait_until("the lease renewal to count both members", || {
        a.fleet.stats().members == 2
    })
    .await;

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || a.fleet.publish_metrics());
    let mut values = std::collections::HashMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let (_, key) = key.into_parts();
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        assert!(labels.contains(&"guard=a".to_owned()), "{key:?}");
        values.insert((key.name().to_owned(), labels.join(",")), value);
    }
    let value = |name: &str, labels: &str| values.get(&(name.to_owned(), labels.to_owned()));
    assert_eq!(
        value(FLEET_FENCED, "guard=a"),
        Some(&DebugValue::Gauge(0.0.into()))
    );
    assert_eq!(
        value(FLEET_MEMBERS, "guard=a"),
        Some(&DebugValue::Gauge(2.0.into()))
    );
    assert!(matches!(
        value(FLEET_INSERTS_TOTAL, "guard=a,origin=local"),
        Some(DebugValue::Counter(n)) if *n == 5
    ));
}

/// A guard given to a fleet member answers `MaybePresent` from then until
/// a join has caught it up: before `join` runs (a service that serves while
/// it joins in the background), and after a join given up half-way (a
/// timeout around it: the first member of a young fleet waits out a lease).
/// Unfenced, it answered `Absent` for every key the other members wrote.
/// A later join lifts the fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_not_joined_yet_or_whose_join_was_dropped_answers_maybe() {
    let server = RedisServer::start();
    let guard = guard("a");
    let fleet = FleetSync::builder(guard.clone(), server.client(), "dropped")
        .lease(LEASE)
        .build();
    assert!(guard.is_fenced(), "a member not joined yet");
    assert_eq!(guard.check("never inserted"), Verdict::MaybePresent);
    let joined = tokio::time::timeout(LEASE / 4, fleet.join()).await;
    assert!(joined.is_err(), "still waiting out the fleet's first lease");
    assert!(guard.is_fenced(), "a dropped join lifted the fence");
    assert_eq!(guard.check("never inserted"), Verdict::MaybePresent);

    let member = Member {
        handle: fleet.join().await.unwrap(),
        fleet,
    };
    caught_up(&member).await;
    assert_eq!(member.guard().check("never inserted"), Verdict::Absent);
}

/// A source whose passes fail once told to.
struct FailsWhenTold {
    failing: std::sync::atomic::AtomicBool,
}

impl bloomguard::KeySource for FailsWhenTold {
    fn scan(&self) -> bloomguard::source::KeyStream<'_> {
        let pass = if self.failing.load(std::sync::atomic::Ordering::SeqCst) {
            Err(bloomguard::SourceError::new("the store is down"))
        } else {
            Ok(vec![b"1".to_vec()])
        };
        Box::pin(futures_util::stream::once(async move { pass }))
    }
}

/// Guard `a` over `source`, whose maintenance rebuilds every 100 ms and,
/// after a failure, waits a minute: one failed rebuild in a test's time.
fn rebuilding_often(source: Arc<impl bloomguard::KeySource>) -> Guard {
    Guard::builder()
        .name("a")
        .expected_items(1_000)
        .seed(0xf1ee7)
        .source(source)
        .rebuild_policy(
            RebuildPolicy::default()
                .every(Duration::from_millis(100))
                .retry_backoff(Duration::from_secs(60), Duration::from_secs(60)),
        )
        .maintenance_interval(Duration::from_millis(20))
        .build()
        .unwrap()
}

/// The fleet's rebuild turn is given back however the rebuild ends: a
/// failed one used to keep it for the whole rebuild timeout (10 minutes by
/// default), and no member rebuilt meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_rebuild_gives_the_fleets_rebuild_turn_back() {
    let server = RedisServer::start();
    let source = Arc::new(FailsWhenTold {
        failing: std::sync::atomic::AtomicBool::new(false),
    });
    let guard = rebuilding_often(Arc::clone(&source));
    guard.rebuild().await.unwrap();
    let a = join(guard, server.client(), "turn").await;
    caught_up(&a).await;
    source
        .failing
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let maintenance = a.guard().spawn_maintenance();
    wait_until("a failed rebuild", || {
        a.guard().stats().rebuilds.failed >= 1
    })
    .await;
    let mut connection = server.client().get_connection().unwrap();
    wait_until("the turn given back", || {
        let holder: Option<String> = redis::cmd("GET")
            .arg("{turn}:rebuild:lock")
            .query(&mut connection)
            .unwrap();
        holder.is_none()
    })
    .await;
    maintenance.shutdown().await;
}

/// A guard follows one fleet through one member at a time. A second join
/// ran a second set of tasks on the same guard: its snapshot could replace
/// the set under the first one's reads (which then moved past entries the
/// new set lacks), and its failure unfenced a guard whose lease had lapsed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_in_a_fleet_cannot_join_again_until_it_left() {
    let server = RedisServer::start();
    let a = join(guard("a"), server.client(), "once").await;
    match a.fleet.join().await {
        Err(FleetError::AlreadyJoined) => {}
        other => panic!("a second join of a running member: {other:?}"),
    }
    let other_member = FleetSync::builder(a.guard().clone(), server.client(), "once")
        .lease(LEASE)
        .build();
    match other_member.join().await {
        Err(FleetError::AlreadyJoined) => {}
        other => panic!("a second member over the same guard: {other:?}"),
    }
    assert!(!a.handle.panicked());
    a.handle.shutdown().await;
    let again = other_member
        .join()
        .await
        .expect("joins once the first one left");
    caught_up(&Member {
        fleet: other_member,
        handle: again,
    })
    .await;
}

/// A source whose pass, once told, stalls the network in front of the
/// member's Redis and fails: the turn's release then waits on the network.
struct StallsAndFailsWhenTold {
    proxy: Arc<TcpProxy>,
    failing: std::sync::atomic::AtomicBool,
    failed: std::sync::atomic::AtomicBool,
}

impl bloomguard::KeySource for StallsAndFailsWhenTold {
    fn scan(&self) -> bloomguard::source::KeyStream<'_> {
        use std::sync::atomic::Ordering::SeqCst;
        let pass = if self.failing.load(SeqCst) {
            self.proxy.stall();
            self.failed.store(true, SeqCst);
            Err(bloomguard::SourceError::new("the store is down"))
        } else {
            Ok(vec![b"1".to_vec()])
        };
        Box::pin(futures_util::stream::once(async move { pass }))
    }
}

/// A key source whose passes panic once told to (a bug in it).
struct PanicsWhenTold {
    panicking: std::sync::atomic::AtomicBool,
}

impl bloomguard::KeySource for PanicsWhenTold {
    fn scan(&self) -> bloomguard::source::KeyStream<'_> {
        assert!(
            !self.panicking.load(std::sync::atomic::Ordering::SeqCst),
            "a bug in the key source"
        );
        Box::pin(futures_util::stream::once(async {
            Ok(vec![b"1".to_vec()])
        }))
    }
}

/// A key source that panics ends the maintenance task (documented), which
/// gave its rebuild turn back only after a rebuild that returned: the turn
/// stayed taken for the rebuild timeout (10 minutes by default), and no
/// other member rebuilt meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_source_that_panics_gives_the_rebuild_turn_back() {
    let server = RedisServer::start();
    let source = Arc::new(PanicsWhenTold {
        panicking: std::sync::atomic::AtomicBool::new(false),
    });
    let guard = rebuilding_often(Arc::clone(&source));
    guard.rebuild().await.unwrap();
    let a = join(guard, server.client(), "panics").await;
    caught_up(&a).await;
    source
        .panicking
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let maintenance = a.guard().spawn_maintenance();
    wait_until("the task to end", || maintenance.is_finished()).await;
    assert!(maintenance.panicked());
    let holder: Option<String> = redis::cmd("GET")
        .arg("{panics}:rebuild:lock")
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    assert_eq!(holder, None, "the rebuild turn outlived the panic");
}

/// A member finding the rebuild turn taken in its own name takes it. That
/// is what the cluster client's resent `SET NX` finds when the first run
/// took the turn and its reply was lost, and what a give-back that failed
/// leaves: the member read the turn as another's and did not rebuild until
/// it expired (10 minutes by default), nor did any other member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_finding_the_rebuild_turn_in_its_own_name_takes_it() {
    let server = RedisServer::start();
    let guard = rebuilding_often(Arc::new(FailsWhenTold {
        failing: std::sync::atomic::AtomicBool::new(false),
    }));
    guard.rebuild().await.unwrap();
    let a = join(guard, server.client(), "own").await;
    caught_up(&a).await;
    let _: () = redis::cmd("SET")
        .arg("{own}:rebuild:lock")
        .arg(a.fleet.member())
        .arg("PX")
        .arg(600_000)
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    let rebuilt = a.guard().stats().rebuilds.succeeded;
    let maintenance = a.guard().spawn_maintenance();
    wait_until("a rebuild on the member's own turn", || {
        a.guard().stats().rebuilds.succeeded > rebuilt
    })
    .await;
    maintenance.shutdown().await;
}

/// The maintenance task's shutdown returns after the rebuild turn is given
/// back. It used to be given back by a task of its own, which the runtime's
/// end (a rolling deploy: shut down, then exit) aborted: the turn stayed
/// taken for the rebuild timeout (10 minutes by default), and no member
/// rebuilt meanwhile.
#[test]
fn shutting_maintenance_down_gives_the_rebuild_turn_back_first() {
    use std::sync::atomic::Ordering::SeqCst;
    let server = RedisServer::start();
    let network = tokio::runtime::Runtime::new().unwrap();
    let proxy = network.block_on(TcpProxy::start(([127, 0, 0, 1], server.port).into()));
    let source = Arc::new(StallsAndFailsWhenTold {
        proxy: Arc::clone(&proxy),
        failing: std::sync::atomic::AtomicBool::new(false),
        failed: std::sync::atomic::AtomicBool::new(false),
    });
    let guard = rebuilding_often(Arc::clone(&source));
    let member_runtime = tokio::runtime::Runtime::new().unwrap();
    let resumed = member_runtime.block_on(async {
        guard.rebuild().await.unwrap();
        // Calls time out after a lease: long enough to outlast the stall.
        let a = join_with(guard, proxy.client(), "shutdown", |builder| {
            builder.lease(Duration::from_secs(10))
        })
        .await;
        caught_up(&a).await;
        source.failing.store(true, SeqCst);
        let maintenance = a.guard().spawn_maintenance();
        wait_until("a failed pass", || source.failed.load(SeqCst)).await;
        let resumed = std::thread::spawn({
            let proxy = Arc::clone(&proxy);
            move || {
                std::thread::sleep(Duration::from_millis(500));
                proxy.resume();
            }
        });
        maintenance.shutdown().await;
        resumed
    });
    drop(member_runtime); // the process exits
    resumed.join().unwrap();
    let holder: Option<String> = redis::cmd("GET")
        .arg("{shutdown}:rebuild:lock")
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    assert_eq!(holder, None, "the rebuild turn outlived the shutdown");
}

/// A publish dropped half-way (a deploy stops the instance, a `timeout`
/// around `publish_snapshot`) leaves chunks that no manifest names: they
/// expire, where they stayed in Redis for good before, a snapshot's worth
/// of memory per interrupted publish. A manifest's own chunks never do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_of_an_interrupted_publish_expire_and_a_manifests_do_not() {
    let server = RedisServer::start();
    // About 120 KB in chunks of 16 bytes: thousands of writes, so that the
    // publish is certainly dropped among them.
    let a = join_with(guard("a"), server.client(), "orphans", |builder| {
        builder.snapshot_chunk_bytes(16)
    })
    .await;
    caught_up(&a).await;
    let admin = Mutex::new(server.client().get_connection().unwrap());
    fn query<T: redis::FromRedisValue>(
        admin: &Mutex<redis::Connection>,
        command: &mut redis::Cmd,
    ) -> T {
        command.query(&mut *admin.lock().unwrap()).unwrap()
    }
    let chunks =
        || -> Vec<String> { query(&admin, redis::cmd("KEYS").arg("{orphans}:snapshot:*:*:*")) };
    let ttl = |chunk: &str| -> i64 { query(&admin, redis::cmd("PTTL").arg(chunk)) };
    let first_chunk_written = async {
        while chunks().is_empty() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::select! {
        published = a.fleet.publish_snapshot() => panic!("not dropped half-way: {published:?}"),
        () = first_chunk_written => {}
    }
    let orphans = chunks();
    assert!(!orphans.is_empty());
    for chunk in &orphans {
        assert!(
            ttl(chunk) > 0,
            "{chunk} of the dropped publish never expires"
        );
    }

    a.fleet.publish_snapshot().await.unwrap();
    // By the manifest: a write of the dropped publish already sent may
    // still land after the listing above.
    let named = chunks_named("orphans", &manifest(&mut admin.lock().unwrap(), "orphans"));
    assert!(!named.is_empty());
    for chunk in &named {
        assert_eq!(ttl(chunk), -1, "{chunk}, named by the manifest, expires");
    }
}

/// A publish cut off after switching the manifest left the replaced
/// snapshot's chunks in Redis for good: they were kept (`PERSIST`) once
/// their own manifest named them, and only the clean-up after the switch
/// deleted them. The switch now lets them expire like unnamed chunks, and
/// the clean-up deletes them sooner when it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_a_switch_replaced_expire_when_its_clean_up_is_cut_off() {
    let BehindAProxy {
        server, proxy, b, ..
    } = behind_a_proxy("replaced", |builder| builder).await;
    b.fleet.publish_snapshot().await.unwrap();
    let mut admin = server.client().get_connection().unwrap();
    let replaced = manifest(&mut admin, "replaced");
    let replaced_chunks = chunks_named("replaced", &replaced);
    // The clean-up is the first command to name the replaced chunks.
    proxy.stall_at(replaced_chunks[0].as_bytes(), StallAt::Before);
    let publishing = tokio::spawn({
        let fleet = b.fleet.clone();
        async move { fleet.publish_snapshot().await }
    });
    wait_until("the clean-up to stall", || proxy.is_stalled()).await;
    proxy.cut();
    proxy.resume();
    let published = publishing.await.unwrap();
    assert!(published.is_err(), "{published:?}");
    assert_ne!(manifest(&mut admin, "replaced"), replaced, "switched");
    for chunk in &replaced_chunks {
        let ttl: i64 = redis::cmd("PTTL").arg(chunk).query(&mut admin).unwrap();
        assert!(ttl > 0, "{chunk}, named by no manifest, kept (PTTL {ttl})");
    }
}

/// A publish cut off while it uploaded its chunks left those it had
/// written in Redis for an hour (they expire only when no manifest names
/// them), and a member publishes again within a lease: another copy of the
/// filter each time. They are deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_of_a_publish_cut_off_mid_upload_are_deleted() {
    let BehindAProxy {
        server, proxy, b, ..
    } = behind_a_proxy("cutoff", |builder| builder.snapshot_chunk_bytes(1 << 10)).await;
    let mut admin = server.client().get_connection().unwrap();
    let (since, version): (u64, Option<u64>) = redis::pipe()
        .get("{cutoff}:since")
        .get("{cutoff}:snapshot:version")
        .query(&mut admin)
        .unwrap();
    let next = version.unwrap_or(0) + 1;
    let chunk = |i: usize| format!("{{cutoff}}:snapshot:{since}:{next}:{i}");
    proxy.stall_at(chunk(2).as_bytes(), StallAt::Before);
    let publishing = tokio::spawn({
        let fleet = b.fleet.clone();
        async move { fleet.publish_snapshot().await }
    });
    wait_until("the upload to stall", || proxy.is_stalled()).await;
    assert!(exists(&mut admin, &chunk(0)) && exists(&mut admin, &chunk(1)));
    proxy.cut();
    proxy.resume();
    let published = publishing.await.unwrap();
    assert!(published.is_err(), "{published:?}");
    for i in 0..3 {
        assert!(!exists(&mut admin, &chunk(i)), "{} left behind", chunk(i));
    }
}

/// A member whose tasks ended without leaving (its runtime dropped, a
/// panic) keeps no standing: its stats say fenced, and it publishes no
/// snapshot from the position it froze at.
#[test]
fn a_member_whose_tasks_ended_without_leaving_keeps_no_standing() {
    let server = RedisServer::start();
    let member_runtime = tokio::runtime::Runtime::new().unwrap();
    let member = member_runtime.block_on(async {
        let guard = guard_over_store(&server, "a");
        guard.rebuild().await.unwrap();
        let member = join(guard, server.client(), "ended").await;
        caught_up(&member).await;
        member
    });
    drop(member_runtime); // aborts the member's tasks
    assert!(member.guard().is_fenced());
    assert!(member.fleet.stats().fenced, "the stats say fenced too");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let published = runtime.block_on(member.fleet.publish_snapshot());
    assert!(
        matches!(published, Err(FleetError::Fenced)),
        "{published:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_member_rebuilds_for_all_and_the_fleet_forgets_deleted_keys_together() {
    let server = RedisServer::start();
    server.populate(0..1_000);
    let every = |guard: &str| {
        Guard::builder()
            .name(guard)
            .expected_items(100_000)
            .seed(0xf1ee7)
            .source(RedisSource::new(server.client(), "item:*").strip_prefix("item:"))
            .rebuild_policy(
                RebuildPolicy::default()
                    .write_settle(Duration::from_millis(250))
                    .every(Duration::from_millis(500)),
            )
            .maintenance_interval(Duration::from_millis(50))
            .build()
            .unwrap()
    };
    let (a, b, c) = (every("a"), every("b"), guard_over_store(&server, "c"));
    for guard in [&a, &b, &c] {
        guard.rebuild().await.unwrap();
    }
    let members = [
        join(a, server.client(), "turns").await,
        join(b, server.client(), "turns").await,
        join(c, server.client(), "turns").await,
    ];
    for member in &members {
        caught_up(member).await;
    }
    let rebuilds = |member: &Member| member.guard().stats().rebuilds.succeeded;

    // Another member holds the turn: nobody here rebuilds, nothing is forgotten.
    let mut admin = server.client().get_connection().unwrap();
    let () = redis::cmd("SET")
        .arg("{turns}:rebuild:lock")
        .arg("someone else")
        .query(&mut admin)
        .unwrap();
    let maintenance: Vec<_> = members[..2]
        .iter()
        .map(|member| member.guard().spawn_maintenance())
        .collect();
    let deleted: Vec<String> = (0..500).map(|i| i.to_string()).collect();
    let kept: Vec<String> = (500..1_000).map(|i| i.to_string()).collect();
    let mut unlink = redis::cmd("UNLINK");
    for key in &deleted {
        unlink.arg(format!("item:{key}"));
    }
    let _: i64 = unlink.query(&mut admin).unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for member in &members {
        assert_eq!(
            rebuilds(member),
            1,
            "{}: not its turn",
            member.guard().name()
        );
        assert!(
            deleted
                .iter()
                .all(|key| !member.guard().check(key).is_absent())
        );
    }

    // The turn is free: one member rebuilds, and every member, the one
    // without maintenance included, forgets the deleted keys.
    let _: i64 = redis::cmd("DEL")
        .arg("{turns}:rebuild:lock")
        .query(&mut admin)
        .unwrap();
    for member in &members {
        wait_until("the deleted keys to be forgotten", || {
            let forgotten = deleted
                .iter()
                .filter(|key| member.guard().check(key).is_absent())
                .count();
            forgotten > 450
        })
        .await;
        assert!(
            kept.iter()
                .all(|key| !member.guard().check(key).is_absent())
        );
    }
    assert_eq!(
        rebuilds(&members[2]),
        1,
        "c never rebuilt: it replaced its set"
    );
    assert!(
        rebuilds(&members[0]) + rebuilds(&members[1]) > 2,
        "a or b rebuilt"
    );
    for task in maintenance {
        task.shutdown().await;
    }
}

/// A `GuardedLoader`'s backend over the ledger's store, counting its calls
/// in `asked`.
fn ledger_backend(
    ledger: &Ledger,
    asked: &Arc<std::sync::atomic::AtomicU64>,
) -> impl Fn(String) -> std::future::Ready<Result<Option<()>, std::convert::Infallible>>
+ Send
+ Sync
+ use<> {
    let (store, asked) = (Arc::clone(&ledger.store), Arc::clone(asked));
    move |key| {
        asked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        std::future::ready(Ok(store.lock().unwrap().contains(&key).then_some(())))
    }
}

/// A loader over the ledger's store on `member`'s guard that asks about
/// every "maybe" and keeps the store's "absent" for ten minutes.
fn verifying_caching_loader(
    member: &Member,
    ledger: &Ledger,
) -> bloomguard::GuardedLoader<
    String,
    impl bloomguard::Loader<String, Value = (), Error = std::convert::Infallible>,
> {
    let asked = Arc::new(std::sync::atomic::AtomicU64::new(0));
    bloomguard::GuardedLoader::new(member.guard().clone(), ledger_backend(ledger, &asked))
        .verify(bloomguard::Verify::All)
        .unwrap()
        .confirmed_absent_cache(1_000, Duration::from_secs(600))
        .unwrap()
}

/// A slow write of `key` on `writer`, whose store write lands once
/// `loader` (another member's) asked for it past the write settle and kept
/// the store's "absent" then.
async fn a_slow_write_cached_as_absent<L>(
    writer: &Member,
    loader: &bloomguard::GuardedLoader<String, L>,
    ledger: &Ledger,
    key: &str,
) -> bloomguard::redis::FleetWrite
where
    L: bloomguard::Loader<String, Value = (), Error = std::convert::Infallible>,
{
    let write = writer.fleet.begin_write(key).await.unwrap();
    tokio::time::sleep(RebuildPolicy::DEFAULT_WRITE_SETTLE * 2).await;
    assert!(!loader.contains(key).await.unwrap(), "not written yet");
    ledger.store.lock().unwrap().insert(key.to_owned());
    write
}

/// Waits (30 s at most) until `loader` finds `key`, which the store holds.
async fn until_the_cache_finds<L>(loader: &bloomguard::GuardedLoader<String, L>, key: &str)
where
    L: bloomguard::Loader<String, Value = (), Error = std::convert::Infallible>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !loader.contains(key).await.unwrap() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the cache kept answering absent for a stored key"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_member_trusts_neither_its_maybe_nor_its_cached_absent_answers() {
    use axum::body::Body;
    use axum::http::{Method, Request, Response};
    use bloomguard::layer::PathKey;
    use bloomguard::{GuardLayer, GuardedLoader, Verify};
    use tower::{Layer, ServiceExt};

    // The server is held by the binding: dropping it would kill it.
    let BehindAProxy {
        server: _server,
        proxy,
        a,
        b,
    } = behind_a_proxy("cache", |builder| builder).await;
    let ledger = Ledger::default();
    let asked = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let loader = GuardedLoader::new(b.guard().clone(), ledger_backend(&ledger, &asked))
        .verify(Verify::None)
        .unwrap()
        .confirmed_absent_cache(1_000, Duration::from_secs(600))
        .unwrap();

    // Fenced: the "maybe" is not the filter's, so the backend is asked
    // (and says absent, which the cache keeps).
    stall_until_fenced(&proxy, &b).await;
    assert!(!loader.contains("late").await.unwrap());
    assert_eq!(
        asked.load(std::sync::atomic::Ordering::Relaxed),
        1,
        "asked while fenced"
    );
    proxy.resume();
    caught_up(&b).await;

    // Fenced again, and the key written meanwhile: the cached "absent" from
    // before must not answer for it.
    stall_until_fenced(&proxy, &b).await;
    assert!(ledger.write(&a.fleet, "late".to_owned()).await);
    assert!(
        loader.contains("late").await.unwrap(),
        "a completed write answered absent from the cache"
    );
    // Nor does the HTTP layer trust a fenced "maybe".
    let service = GuardLayer::for_http(
        b.guard().clone(),
        PathKey::route("/seen/{pair}").method(Method::GET),
    )
    .verify(Verify::None, || Response::new(String::from("trusted")))
    .unwrap()
    .layer(tower::service_fn(|_: Request<Body>| async {
        Ok::<_, std::convert::Infallible>(Response::new(String::from("asked")))
    }));
    let request = Request::get("/seen/late").body(Body::empty()).unwrap();
    assert_eq!(service.oneshot(request).await.unwrap().body(), "asked");
    proxy.resume();
    caught_up(&b).await;
    assert!(loader.contains("late").await.unwrap());
}

/// A slow write's `FleetWrite` dropped unfinished once the write had
/// landed (its task cancelled: a client gone). b, asked about the key while
/// the write was in flight and past the write settle, kept the backend's
/// "absent" in its confirmed-absent cache; nothing announced the key to b
/// again, so the cache answered absent for a stored key until its ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_write_dropped_unfinished_still_clears_the_other_members_cached_absent() {
    let server = RedisServer::start();
    let a = join(guard("a"), server.client(), "dropped").await;
    let b = join(guard("b"), server.client(), "dropped").await;
    let ledger = Ledger::default();
    let loader = verifying_caching_loader(&b, &ledger);
    let write = a_slow_write_cached_as_absent(&a, &loader, &ledger, "slow").await;
    drop(write);
    until_the_cache_finds(&loader, "slow").await;
}

/// A slow write whose second append Redis refused (here an ACL that denies
/// the writer `XADD` for a while; a failover, a cut connection), in
/// `finish` and in the one retry made after it: b, asked about the key
/// while the write was in flight and past the write settle, kept the
/// backend's "absent" in its confirmed-absent cache, and nothing announced
/// the key to b again, so the cache answered absent for a stored key for
/// its ttl (and a rebuild shared meanwhile would have left it out of every
/// member). The second append is retried until Redis takes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_writes_refused_second_append_is_retried_until_redis_takes_it() {
    let server = RedisServer::start();
    let mut connection = server.client().get_connection().unwrap();
    let writer_acl = |commands: &str| {
        let mut command = redis::cmd("ACL");
        command
            .arg("SETUSER")
            .arg("writer")
            .arg("on")
            .arg(">pw")
            .arg("~*")
            .arg("&*")
            .arg("+@all")
            .arg(commands);
        command
    };
    let () = writer_acl("+xadd").query(&mut connection).unwrap();
    let as_writer =
        redis::Client::open(format!("redis://writer:pw@127.0.0.1:{}/", server.port)).unwrap();
    let a = join(guard("a"), as_writer, "refused").await;
    let b = join(guard("b"), server.client(), "refused").await;
    let ledger = Ledger::default();
    let loader = verifying_caching_loader(&b, &ledger);
    let write = a_slow_write_cached_as_absent(&a, &loader, &ledger, "slow").await;
    // Every command but `XADD` (Redis checks the ones a script calls too):
    // appends fail, renewals and reads go on.
    let () = writer_acl("-xadd").query(&mut connection).unwrap();
    assert!(
        write.finish().await.is_err(),
        "the second append was refused"
    );
    wait_until("the second append's retry to be refused too", || {
        let denials: Vec<redis::Value> =
            redis::cmd("ACL").arg("LOG").query(&mut connection).unwrap();
        denials
            .into_iter()
            .map(|entry| {
                redis::from_redis_value::<std::collections::HashMap<String, redis::Value>>(entry)
                    .unwrap()
            })
            .filter(|entry| {
                entry
                    .get("object")
                    .cloned()
                    .map(redis::from_redis_value::<String>)
                    == Some(Ok("xadd".to_owned()))
            })
            .map(|entry| redis::from_redis_value::<u64>(entry["count"].clone()).unwrap())
            .sum::<u64>()
            >= 2
    })
    .await;
    let () = writer_acl("+xadd").query(&mut connection).unwrap();
    until_the_cache_finds(&loader, "slow").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_the_fleet_keeps_its_contract_across_a_failover() {
    // Two replicas per master: once one is promoted, the other still holds
    // every append (`wait_for_replicas(1)`), so writes go on.
    let mut cluster = common::redis_cluster::RedisCluster::start_with_replicas(2);
    let urls = cluster.urls();
    let join_cluster = |name: &'static str| {
        let urls = urls.clone();
        async move {
            // Each `WAIT` waits up to half a lease: nine nodes on a loaded
            // machine may take more than the usual lease's 300 ms.
            let fleet = FleetSync::cluster_builder(guard(name), &urls, "cfleet")
                .unwrap()
                .lease(Duration::from_secs(2))
                .wait_for_replicas(1)
                .build();
            let handle = fleet.join().await.unwrap();
            Member { fleet, handle }
        }
    };
    let a = join_cluster("a").await;
    let b = join_cluster("b").await;
    let c = join_cluster("c").await;
    for member in [&a, &b, &c] {
        caught_up(member).await;
    }
    // A snapshot replacing another: the switch names the replaced chunks'
    // keys itself, which a cluster node serves as keys of the script's slot.
    a.fleet.publish_snapshot().await.unwrap();
    a.fleet.publish_snapshot().await.unwrap();
    let ledger = Ledger::default();
    let audit = audit(&ledger, vec![b.guard().clone(), c.guard().clone()]);
    assert_eq!(
        keep_writing(&ledger, &a.fleet, keys("before", 300))
            .await
            .unwrap(),
        300
    );

    // The master of the fleet's slot dies while A keeps writing. Writes that
    // fail meanwhile are not made (the ledger counts only the others).
    let stop = CancellationToken::new();
    let writer = {
        let (ledger, fleet, stop) = (ledger.clone(), a.fleet.clone(), stop.clone());
        tokio::spawn(async move {
            let mut completed = 0;
            for i in 0.. {
                if stop.is_cancelled() {
                    break;
                }
                completed += u64::from(ledger.write(&fleet, format!("during:{i}")).await);
            }
            completed
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let master = cluster.master_of("{cfleet}:inserts");
    cluster.kill(master);
    let cluster = tokio::task::spawn_blocking(move || {
        cluster.wait_until_healed();
        cluster
    })
    .await
    .unwrap();
    let resumed = ledger.completed().len();
    wait_until("writes to complete again", || {
        ledger.completed().len() > resumed + 100
    })
    .await;
    stop.cancel();
    let completed = writer.await.unwrap();
    assert!(completed > 0, "writes resume after the failover");
    for member in [&a, &b, &c] {
        caught_up(member).await;
    }
    audit.finish().await;
    for key in ledger.completed() {
        for member in [&b, &c] {
            assert_eq!(member.guard().check(&key), Verdict::MaybePresent, "{key}");
        }
    }
    drop(cluster);
}

/// An append counts only once a replica holds it. Its `WAIT` went out on
/// its own: when Redis dropped the connection the `WAIT` blocked on, the
/// cluster client sent it again on a new connection, which had written
/// nothing, so it counted every connected replica at once. The store write
/// ran though no replica held its append, and a failover to that replica
/// would have lost the insert from the fleet's stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_is_not_counted_as_replicated_by_a_wait_resent_on_a_new_connection() {
    let cluster = common::redis_cluster::RedisCluster::start();
    // Long enough for the test to find the `WAIT` (half a lease) blocked.
    let lease = Duration::from_secs(4);
    let fleet = FleetSync::cluster_builder(guard("a"), &cluster.urls(), "waited")
        .unwrap()
        .lease(lease)
        .wait_for_replicas(1)
        .build();
    let handle = fleet.join().await.unwrap();
    let a = Member { fleet, handle };
    caught_up(&a).await;

    let master = cluster.master_of("{waited}:inserts");
    let [replica] = cluster.replicas_of(master)[..] else {
        panic!("one replica per master")
    };
    let mut on_master = redis::Client::open(format!("redis://127.0.0.1:{master}/"))
        .unwrap()
        .get_connection()
        .unwrap();
    let appended_before = stream_length(&mut on_master, "waited");
    cluster.pause(replica);
    let write = {
        let fleet = a.fleet.clone();
        tokio::spawn(async move { fleet.insert_then_write("unreplicated", async {}).await })
    };
    // Drop the member's connection to the master while the `WAIT` after
    // the append blocks. A renewal's may block before it, up to half a
    // lease: the connection runs its commands in order, so the append has
    // run once the stream is longer, and any `WAIT` blocked then is after it.
    let waiting = tokio::task::block_in_place(|| {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let appended = stream_length(&mut on_master, "waited") > appended_before;
            let clients: String = redis::cmd("CLIENT")
                .arg("LIST")
                .query(&mut on_master)
                .unwrap();
            let blocked = clients.lines().find_map(|client| {
                let field =
                    |name: &str| client.split(' ').find_map(|field| field.strip_prefix(name));
                (field("cmd=") == Some("wait")).then(|| field("id=").unwrap().to_owned())
            });
            if let Some(id) = blocked.filter(|_| appended) {
                return id;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no WAIT blocked on the master: {clients}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    // Still waiting: a `WAIT` found after the write gave up would be a
    // later renewal's, and cutting it would test nothing.
    assert!(
        !write.is_finished(),
        "the write ended before its WAIT was cut"
    );
    let killed: u64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(&waiting)
        .query(&mut on_master)
        .unwrap();
    assert_eq!(killed, 1, "the connection blocked in WAIT");
    let written = write.await.unwrap();
    let replication: String = redis::cmd("INFO")
        .arg("replication")
        .query(&mut on_master)
        .unwrap();
    cluster.resume(replica);
    assert!(
        matches!(written, Err(FleetWriteError::NotWritten(_))),
        "the store write ran ({written:?}) though no replica held its append: {replication}"
    );
}

/// A join waits out a young record's lease, and retries Redis for as long:
/// `join_until` ends it when the application shuts down meanwhile, the
/// guard fenced and free to join again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_during_join_until_ends_the_join() {
    let server = RedisServer::start();
    let member = FleetSync::builder(guard("a"), server.client(), "shutting")
        .lease(LEASE)
        .build();
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    let joined = member.join_until(&shutdown).await;
    assert!(
        matches!(joined, Err(FleetError::ShuttingDown)),
        "{joined:?}"
    );
    assert_eq!(
        member.guard().check("never inserted"),
        Verdict::MaybePresent
    );
    let again = Member {
        handle: member.join().await.unwrap(),
        fleet: member,
    };
    caught_up(&again).await;
}

/// A member joining again (the same `FleetSync`) after Redis lost its data
/// adopts a snapshot of the new stream: its old position, in the lost
/// stream and ahead of every id of the new one, became a catch-up target
/// the new stream never reached, and it recovered again and again, fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_joining_again_after_a_loss_is_not_held_to_its_old_position() {
    let server = RedisServer::start();
    let a = join(guard("a"), server.client(), "again").await;
    caught_up(&a).await;
    let ledger = Ledger::default();
    let written = keep_writing(&ledger, &a.fleet, keys("again", 20));
    assert_eq!(written.await.unwrap(), 20);
    a.handle.shutdown().await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("FLUSHALL").query(&mut connection).unwrap();
    let b = join(guard("b"), server.client(), "again").await;
    caught_up(&b).await;
    b.fleet.publish_snapshot().await.unwrap();
    let again = Member {
        handle: a.fleet.join().await.unwrap(),
        fleet: a.fleet,
    };
    caught_up(&again).await;
}

/// A Redis that may evict any key (`allkeys-lru`) may evict a lease or the
/// record: joining warns, over RESP2 and over RESP3, whose `CONFIG GET`
/// answers a map (read as a list, it failed and the warning was lost).
#[test]
fn joining_a_redis_that_may_evict_any_key_warns_over_either_protocol() {
    let server = RedisServer::start_with(&["--maxmemory-policy", "allkeys-lru"]);
    for protocol in ["2", "3"] {
        let log = common::captured_log::CapturedLog::default();
        tracing::subscriber::with_default(log.subscriber(), || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let url = format!("redis://127.0.0.1:{}/?protocol=resp{protocol}", server.port);
                let client = redis::Client::open(url).unwrap();
                let member = join(guard("a"), client, &format!("evicting{protocol}")).await;
                member.handle.shutdown().await;
            });
        });
        let log = log.text();
        assert!(
            log.contains("maxmemory-policy allkeys"),
            "RESP{protocol}: {log}"
        );
    }
}

/// A member recovering (the stream trimmed past what it holds, no snapshot
/// covering it) when Redis restarts from an older dump: it learns of the
/// new record from its own look at it, not from a renewal, and the dump's
/// snapshot covers the dump's stream. It used to adopt that snapshot and
/// answer at once, before the member from before (`c`, held back for less
/// than a lease) had renewed and marked the record as needing the keys it
/// alone held: all 100 keys acknowledged after the dump answered `Absent`,
/// 0.14 s after the restart. It now stays fenced a lease after learning of
/// the record, as a renewal that finds it does, and loads `c`'s snapshot
/// once `c` has marked it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_recovering_when_redis_restarts_from_an_older_dump_waits_for_the_mark() {
    let mut server = RedisServer::start();
    let port = server.port;
    // A lease long enough that `c`, held back below, keeps it.
    let settings =
        |builder: FleetSyncBuilder| builder.lease(Duration::from_secs(6)).stream_max_len(50);
    // `c` hears no request for a snapshot: `r` stays recovering.
    let c_proxy = TcpProxy::start(([127, 0, 0, 1], port).into()).await;
    c_proxy.mark(b"SUBSCRIBE");
    let c = join_with(guard("c"), c_proxy.client(), "window", settings).await;
    for n in 0..10 {
        c.fleet
            .insert_then_write(format!("early:{n}"), async {})
            .await
            .unwrap();
    }
    c.fleet.publish_snapshot().await.unwrap();
    let () = redis::cmd("SAVE")
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    let after_dump: Vec<String> = (0..100).map(|n| format!("after-dump:{n}")).collect();
    for key in &after_dump {
        c.fleet.insert_then_write(key, async {}).await.unwrap();
    }
    assert!(c_proxy.silence_marked() > 0, "c's notices silenced");
    // Over RESP3 the client learns of the restart's dropped connection and
    // makes another at once: `r`'s first look after it reads the record.
    let resp3 = redis::Client::open(format!("redis://127.0.0.1:{port}/?protocol=resp3")).unwrap();
    let r = join_with(guard("r"), resp3, "window", settings).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        r.guard().is_fenced(),
        "r recovers: no snapshot covers its gap"
    );

    c_proxy.stall();
    server.restart_from_dump();
    let mut admin = server.client().get_connection().unwrap();
    let restarted = tokio::time::Instant::now();
    let mut c_resumed = false;
    loop {
        // Wakes `r`'s recovery, which waits for a published snapshot.
        let _: i64 = redis::cmd("PUBLISH")
            .arg("{window}:notices")
            .arg("snapshot")
            .query(&mut admin)
            .unwrap();
        if !r.guard().is_fenced() {
            let absent: Vec<&String> = after_dump
                .iter()
                .filter(|key| r.guard().check(key).is_absent())
                .collect();
            assert!(
                absent.is_empty(),
                "{} keys acknowledged after the dump answer Absent on the recovered \
                 member (c resumed: {c_resumed}), {:?} after the restart",
                absent.len(),
                restarted.elapsed()
            );
            break;
        }
        // Held back for less than its lease: `c` still counts as caught up.
        if !c_resumed && restarted.elapsed() > Duration::from_millis(1_500) {
            c_proxy.resume();
            c_resumed = true;
        }
        assert!(
            restarted.elapsed() < Duration::from_secs(60),
            "r never recovered"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop((c, r, server));
}
/// A member lapsed (`b`, stalled) while the other acknowledged 20 keys
/// without it; then Redis went down for longer than a lease and restarted
/// from a dump older than those keys. Both were fenced when the record
/// began anew, so over the kept stream neither marked it, and `b` replayed
/// the stream and answered `Absent` for all 20 (seen in 3 runs of 3; where
/// a renewal `a` sent before it fenced ran only after the restart, it
/// marked as caught up and both stayed fenced instead). Now each reports
/// the newest entry it holds: `a`'s is gone from the stream, which marks
/// the record; `a` holds the newest, vouches once members from before have
/// had time to report, and publishes; `b`, behind it, recovers from that
/// snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_lapsed_before_a_long_outage_and_an_older_dump_keeps_what_the_dump_cut() {
    let BehindAProxy {
        mut server,
        proxy,
        a,
        b,
    } = behind_a_proxy("outage", |builder| builder).await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    stall_until_fenced(&proxy, &b).await;
    let after_dump = write_keys(&a, "after-dump").await;
    server.kill();
    wait_until("`a` to fence itself", || a.guard().is_fenced()).await;
    // Down for longer than a lease: renewals `a` sent before it fenced end.
    tokio::time::sleep(LEASE * 5).await;
    server.restart_from_dump();
    proxy.resume();
    // Checked once both answer from their filters: fenced, every answer is
    // "maybe", whatever they hold.
    caught_up(&a).await;
    caught_up(&b).await;
    none_answers_absent(&[&a, &b], &after_dump);
}

/// Redis down for longer than a lease and restarted with nothing cut: both
/// members, fenced then, wait to learn whether one holds the record's
/// frontier. A write made meanwhile counted them as having applied it, and
/// a second restart, from a dump saved before that write, cut it: each
/// reported only what it held when the first record began (the stream past
/// that may have had a hole), so nothing marked the second record, and `c`,
/// joining then, answered `Absent` for a completed write (seen on 7816def).
/// Writers no longer count a member while it waits: the write completes
/// only after they have settled, or fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_while_the_members_wait_on_the_frontier_survives_a_second_restart() {
    let mut server = RedisServer::start();
    let a = join(guard("a"), server.client(), "settling").await;
    let b = join(guard("b"), server.client(), "settling").await;
    let mut connection = server.client().get_connection().unwrap();
    let before = record_began(&mut connection, "settling");
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    down_for_longer_than_a_lease(&mut server, &[&a, &b]).await;
    let mut connection = server.client().get_connection().unwrap();
    until_a_record_other_than(&mut connection, "settling", before).await;
    let began = tokio::time::Instant::now();
    // The second restart's dump: the record, and the stream before the write.
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    let ledger = Ledger::default();
    let write = tokio::spawn({
        let (ledger, via) = (ledger.clone(), a.fleet.clone());
        async move { ledger.write(&via, "during-the-wait".to_owned()).await }
    });
    // Past the record's first lease (writers wait that out), within the
    // members' wait (two leases and half a second).
    tokio::time::sleep_until(began + LEASE * 2).await;
    server.restart_from_dump();
    let _ = write.await.unwrap();
    let c = join(guard("c"), server.client(), "settling").await;
    caught_up(&c).await;
    caught_up(&a).await;
    caught_up(&b).await;
    none_answers_absent(&[&a, &b, &c], &ledger.completed());
}

/// `a`, behind a proxy, has 20 keys acknowledged after Redis saved its
/// dump, and is cut off (stalled) as Redis restarts from that dump: the
/// restart cut what `a` alone holds. Returns the server, `a`'s proxy, `a`
/// and the keys.
async fn restarted_without_what_a_holds(
    fleet: &str,
) -> (RedisServer, Arc<TcpProxy>, Member, Vec<String>) {
    let mut server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let a = join(guard("a"), proxy.client(), fleet).await;
    let () = redis::cmd("SAVE")
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    let after_dump = write_keys(&a, "after-dump").await;
    proxy.stall();
    server.restart_from_dump();
    (server, proxy, a, after_dump)
}

/// A restart from an older dump cut what `a` alone holds, and `a` reaches
/// Redis again only after a lease (cut off meanwhile), within the time
/// members from before have to report. `c`, joining after the restart,
/// waited a lease, replayed the cut stream and answered `Absent` for those
/// keys until `a`'s report marked the record (seen on 7816def). A member
/// fresh in a record over a kept stream now waits, fenced, until members
/// from before have had time to report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_waits_for_a_late_report_of_what_a_restart_cut() {
    let (server, proxy, a, after_dump) = restarted_without_what_a_holds("late").await;
    let mut connection = server.client().get_connection().unwrap();
    let c = join(guard("c"), server.client(), "late").await;
    // The record began with `c`'s join, a lease before it returned.
    let began = tokio::time::Instant::now() - LEASE;
    let report_at = began + LEASE * 13 / 10;
    none_answers_absent_until(report_at, &[&c], &[&after_dump]).await;
    proxy.resume();
    wait_until("`a` to report what the restart cut", || {
        exists(&mut connection, "{late}:snapshot:needed")
    })
    .await;
    none_answers_absent(&[&c], &after_dump);
    caught_up(&c).await;
    caught_up(&a).await;
    none_answers_absent(&[&a, &c], &after_dump);
}

/// A lease for the scenarios that must fit in a record's first leases on a
/// loaded machine: a joiner alone waits one out.
const SLOW_LEASE: Duration = Duration::from_millis(1_500);

/// [`join`] with [`SLOW_LEASE`].
async fn join_slowly(guard: Guard, client: redis::Client, fleet: &str) -> Member {
    join_with(guard, client, fleet, |builder| builder.lease(SLOW_LEASE)).await
}

/// As `restarted_without_what_a_holds`, but `a` lapses before the restart,
/// so that nothing it sent caught up marks the record: only its report of
/// what it held (returned too) can; and the dump's stream holds keys
/// (`before`, returned first), so that its newest entry is no start.
async fn lapsed_then_restarted_without_what_a_holds(
    fleet: &str,
) -> (
    RedisServer,
    Arc<TcpProxy>,
    Member,
    [Vec<String>; 2],
    StreamPosition,
) {
    let mut server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let a = join_slowly(guard("a"), proxy.client(), fleet).await;
    let before = write_keys_from_before(&a).await;
    let () = redis::cmd("SAVE")
        .query(&mut server.client().get_connection().unwrap())
        .unwrap();
    let after_dump = write_keys(&a, "after-dump").await;
    let held_by_a = a.fleet.position();
    proxy.stall();
    wait_until("`a` to fence itself", || a.guard().is_fenced()).await;
    server.restart_from_dump();
    (server, proxy, a, [before, after_dump], held_by_a)
}

/// Appends `count` entries straight to the stream, waits until `member`
/// has applied them, and trims the stream to the last as a member's append
/// does past its cap (recording the newest entry it removed), so that the
/// trim mark passes every entry before them.
async fn append_and_trim_past(
    connection: &mut redis::Connection,
    fleet: &str,
    member: &Member,
    count: usize,
) {
    let mut pipe = redis::pipe();
    for n in 0..count {
        pipe.add_command(member_entry(fleet, &format!("filler:{n}")));
    }
    let appended: Vec<StreamPosition> = pipe.query(connection).unwrap();
    let last = *appended.last().unwrap();
    wait_until("the member to apply the entries", || {
        member.fleet.position() >= last
    })
    .await;
    let () = redis::pipe()
        .cmd("SET")
        .arg(format!("{{{fleet}}}:inserts:trimmed"))
        .arg(appended[count - 2])
        .ignore()
        .cmd("XTRIM")
        .arg(format!("{{{fleet}}}:inserts"))
        .arg("MINID")
        .arg(last)
        .ignore()
        .query(connection)
        .unwrap();
}

/// Resumes `a`'s connection (within the record's first lease and a half,
/// begun at `began`: it must report before the wait on the frontier, two
/// leases and half a second, is over), and asserts until well after that
/// wait that no member answers `Absent` for any of `keys`, and that the
/// record is marked.
async fn resume_and_expect_the_cut_reported(
    server: &RedisServer,
    proxy: &TcpProxy,
    members: &[&Member],
    keys: &[Vec<String>; 2],
    began: tokio::time::Instant,
    fleet: &str,
) {
    let resumed_at = tokio::time::Instant::now();
    assert!(
        resumed_at < began + SLOW_LEASE * 3 / 2,
        "resumed {:?} after the record began: too late for the test to mean anything",
        resumed_at - began
    );
    proxy.resume();
    let settled = began + SLOW_LEASE * 5 + Duration::from_millis(500);
    let keys = [keys[0].as_slice(), keys[1].as_slice()];
    none_answers_absent_until(settled, members, &keys).await;
    let mut connection = server.client().get_connection().unwrap();
    assert!(exists(
        &mut connection,
        &format!("{{{fleet}}}:snapshot:needed")
    ));
    for keys in keys {
        none_answers_absent(members, keys);
    }
}

/// A restart from an older dump cut what `a` alone holds, `a` having lapsed
/// before it, and more entries than the stream keeps were appended before
/// `a` reported: trimming took the evidence of the cut with it (`a`'s
/// newest entry, gone from the stream but no longer past the trim mark),
/// nobody marked the record, and `w`, joining after the restart, answered
/// `Absent` for `a`'s keys once the wait on the frontier ended (seen on
/// a3f6512). A record begun over a kept stream now keeps the stream's
/// newest entry then: what a member held past it, the restart cut. Nobody
/// then holds every key (`a` lacks the entries trimmed before it read
/// them), so both stay fenced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_report_of_what_a_restart_cut_stands_after_the_stream_trims_past_it() {
    let (server, proxy, a, keys, held_by_a) =
        lapsed_then_restarted_without_what_a_holds("trimmed").await;
    let began = tokio::time::Instant::now();
    let w = join_slowly(guard("w"), server.client(), "trimmed").await;
    let mut connection = server.client().get_connection().unwrap();
    append_and_trim_past(&mut connection, "trimmed", &w, 30).await;
    let trimmed: StreamPosition = redis::cmd("GET")
        .arg("{trimmed}:inserts:trimmed")
        .query(&mut connection)
        .unwrap();
    assert!(
        trimmed > held_by_a,
        "trimmed to {trimmed}, `a` at {held_by_a}"
    );
    resume_and_expect_the_cut_reported(&server, &proxy, &[&a, &w], &keys, began, "trimmed").await;
}

/// As above, but a new entry takes the id of `a`'s newest, as where the
/// restarted Redis's clock is behind the old one's (`XADD *` gives the
/// newest entry's millisecond then): the stream held an entry at `a`'s
/// report, which passed for what `a` held, and `w` answered `Absent` for
/// `a`'s keys (seen on a3f6512).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_entry_whose_id_a_new_one_took_is_still_reported_cut() {
    let (server, proxy, a, keys, held_by_a) =
        lapsed_then_restarted_without_what_a_holds("same-id").await;
    let began = tokio::time::Instant::now();
    let w = join_slowly(guard("w"), server.client(), "same-id").await;
    let mut connection = server.client().get_connection().unwrap();
    let appended: StreamPosition = member_entry_at("same-id", "after-restart", held_by_a)
        .query(&mut connection)
        .unwrap();
    assert_eq!(appended, held_by_a);
    wait_until("`w` to apply the entry", || w.fleet.position() >= appended).await;
    resume_and_expect_the_cut_reported(&server, &proxy, &[&a, &w], &keys, began, "same-id").await;
}

/// As the trimmed case above, but Redis restarts a second time, from a dump
/// that keeps what the first record appended, before `a` reports: `a`'s
/// newest entry is older than the stream's newest when the second record
/// began, and only the first record's says it was cut. Checked against
/// the second alone, nobody marked it, and `w` answered `Absent` for `a`'s
/// keys (seen on d4ac4ba). The records are walked back to `a`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_from_before_two_restarts_stands_after_the_stream_trims_past_it() {
    let (mut server, proxy, a, keys, held_by_a) =
        lapsed_then_restarted_without_what_a_holds("twice").await;
    let w = join_slowly(guard("w"), server.client(), "twice").await;
    let mut connection = server.client().get_connection().unwrap();
    let first = record_began(&mut connection, "twice");
    let appended: StreamPosition = member_entry("twice", "in-the-first-record")
        .query(&mut connection)
        .unwrap();
    assert!(
        appended > held_by_a,
        "appended {appended}, `a` at {held_by_a}"
    );
    wait_until("`w` to apply the entry", || w.fleet.position() >= appended).await;
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    server.restart_from_dump();
    let mut connection = server.client().get_connection().unwrap();
    until_a_record_other_than(&mut connection, "twice", first).await;
    let began = tokio::time::Instant::now();
    append_and_trim_past(&mut connection, "twice", &w, 30).await;
    resume_and_expect_the_cut_reported(&server, &proxy, &[&a, &w], &keys, began, "twice").await;
}

/// A restart from an older dump cut what `a` alone holds while `a` was
/// caught up, and `a` marked the record; Redis then went down for longer
/// than a lease and restarted from a dump saved after that record began
/// (and after an entry appended in it) but before `a`'s mark. `a`, fenced
/// through the outage, reported the newest entry it held, which that dump
/// kept, nobody marked the new record, and `j`, joining after it, answered
/// `Absent` for `a`'s keys once the wait on the frontier ended (seen on
/// cac9752). A member whose set holds what a marked record needed carries
/// the mark into the next record while the need is unmet. `w`, which took
/// those keys from `a`'s snapshot, leaves before the outage: `a`, which
/// joined the fleet from its stream's start, must carry the mark (a first
/// version of the carrying left it to members that took a snapshot: seen
/// failing on 1248beb).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_restart_cut_stays_marked_after_a_later_dump_lost_the_mark() {
    a_mark_lost_with_a_dump("lost-mark", false).await;
}

/// As above, but `a` leaves and joins again before the outage (a rolling
/// deploy), taking its keys from its own snapshot, as `w` did, and `w`
/// stays: no member remembered the entry the first restart cut, and `j`
/// answered `Absent` for `a`'s keys (seen on 5ea27ec, which judged that
/// entry again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_restart_cut_stays_marked_after_a_later_dump_lost_the_mark_and_a_rejoin() {
    a_mark_lost_with_a_dump("lost-mark-rejoin", true).await;
}

async fn a_mark_lost_with_a_dump(fleet: &str, rejoin: bool) {
    // `SLOW_LEASE`: `a` stays caught up through a restart with its
    // connection stalled.
    let mut server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let mut a = join_slowly(guard("a"), proxy.client(), fleet).await;
    let before = write_keys_from_before(&a).await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    let after_dump = write_keys(&a, "after-dump").await;
    let first = record_began(&mut connection, fleet);
    proxy.stall();
    server.restart_from_dump();
    // A joiner begins the second record, marking nothing.
    let (client, name) = (server.client(), fleet.to_owned());
    let joining = tokio::spawn(async move { join_slowly(guard("w"), client, &name).await });
    let mut connection = server.client().get_connection().unwrap();
    until_a_record_other_than(&mut connection, fleet, first).await;
    let appended: StreamPosition = member_entry(fleet, "in-the-second-record")
        .query(&mut connection)
        .unwrap();
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    proxy.resume();
    wait_until("`a` to mark the record", || {
        exists(&mut connection, &format!("{{{fleet}}}:snapshot:needed"))
    })
    .await;
    wait_until("`a` to apply the entry", || a.fleet.position() >= appended).await;
    let w = joining.await.unwrap();
    caught_up(&w).await;
    none_answers_absent(&[&w], &after_dump);
    if rejoin {
        let guard = a.guard().clone();
        a.handle.shutdown().await;
        a = join_slowly(guard, proxy.client(), fleet).await;
        caught_up(&a).await;
    }
    let w = if rejoin {
        Some(w)
    } else {
        w.handle.shutdown().await;
        None
    };
    // Down for longer than a lease, then back from the dump without the mark.
    let before_the_outage: Vec<&Member> = [Some(&a), w.as_ref()].into_iter().flatten().collect();
    down_for(&mut server, &before_the_outage, SLOW_LEASE * 3 / 2).await;
    let began = tokio::time::Instant::now();
    let j = join_slowly(guard("j"), server.client(), fleet).await;
    let members: Vec<&Member> = [Some(&a), w.as_ref(), Some(&j)]
        .into_iter()
        .flatten()
        .collect();
    // The wait on the frontier is two leases and half a second.
    let settled = began + SLOW_LEASE * 4;
    none_answers_absent_until(settled, &members, &[&after_dump, &before]).await;
    let mut connection = server.client().get_connection().unwrap();
    assert!(exists(
        &mut connection,
        &format!("{{{fleet}}}:snapshot:needed")
    ));
    caught_up(&a).await;
    caught_up(&j).await;
    none_answers_absent(&members, &after_dump);
}

/// The other side of carrying a lost mark on: a need whose mark an
/// operator deleted (accepting the loss) is not revived by a member whose
/// set held it, cut off from Redis from before the deletion until a later
/// record that nobody lived through caught up (here with no snapshot
/// covering the accepted record either, as where the manifest was
/// replaced). Without the note the deletion leaves, `w` marked the new
/// record (seen with the note's check taken out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_mark_is_not_carried_on_by_a_member_that_held_its_need() {
    let mut server = RedisServer::start();
    let a = join_slowly(guard("a"), server.client(), "accepted").await;
    write_keys_from_before(&a).await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    let after_dump = write_keys(&a, "after-dump").await;
    let first = record_began(&mut connection, "accepted");
    // `a`, caught up through the restart, marks the record it begins, and
    // `w`, joining then, takes the keys it needed from `a`'s snapshot.
    server.restart_from_dump();
    let mut connection = server.client().get_connection().unwrap();
    until_a_record_other_than(&mut connection, "accepted", first).await;
    let accepted = record_began(&mut connection, "accepted");
    wait_until("`a` to mark the record", || {
        marked_record(&mut connection, "accepted") == Some(accepted)
    })
    .await;
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let w = join_slowly(guard("w"), proxy.client(), "accepted").await;
    caught_up(&w).await;
    none_answers_absent(&[&w], &after_dump);
    // A renewal of `w`'s sees the mark with the keys in its set.
    tokio::time::sleep(SLOW_LEASE).await;
    a.handle.shutdown().await;
    proxy.stall();
    // The operator accepts the loss; no snapshot covers the record.
    let () = redis::pipe()
        .del("{accepted}:snapshot:needed")
        .ignore()
        .del("{accepted}:snapshot")
        .ignore()
        .cmd("SAVE")
        .ignore()
        .query(&mut connection)
        .unwrap();
    down_for(&mut server, &[&w], SLOW_LEASE * 3 / 2).await;
    proxy.resume();
    let mut connection = server.client().get_connection().unwrap();
    until_a_record_other_than(&mut connection, "accepted", accepted).await;
    // `w` vouches once the wait on the frontier (two leases and half a
    // second) is over.
    caught_up(&w).await;
    assert_eq!(marked_record(&mut connection, "accepted"), None);
    none_answers_absent(&[&w], &after_dump);
}

/// The other side of the reports: Redis restarts from a dump that holds
/// everything, `a` having lapsed before it; `a` reports the stream's newest
/// entry, which the record kept, so nothing marks the record, and both
/// members go on holding every key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_of_what_a_restart_kept_marks_nothing() {
    let mut server = RedisServer::start();
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let a = join(guard("a"), proxy.client(), "whole").await;
    let keys = write_keys_from_before(&a).await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    proxy.stall();
    wait_until("`a` to fence itself", || a.guard().is_fenced()).await;
    server.restart_from_dump();
    let w = join(guard("w"), server.client(), "whole").await;
    proxy.resume();
    caught_up(&w).await;
    caught_up(&a).await;
    let mut connection = server.client().get_connection().unwrap();
    let record = record_began(&mut connection, "whole");
    let frontier: Option<String> = redis::cmd("HGET")
        .arg("{whole}:since:record")
        .arg(format!("f{record}"))
        .query(&mut connection)
        .unwrap();
    assert!(frontier.is_some(), "`a` reported nothing");
    assert!(!exists(&mut connection, "{whole}:snapshot:needed"));
    none_answers_absent(&[&a, &w], &keys);
}

/// As above, but Redis restarts again, keeping the stream, before `a`
/// reports: `c`, fenced by the second restart, reported the position it
/// had reached in the first record, past what the first restart cut, so it
/// held the second record's frontier, vouched, and published a set without
/// `a`'s keys, which `a` then loaded (seen on 642cf30). A member fresh in a
/// record over a kept stream reports nothing until the frontier settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_fenced_by_a_second_restart_does_not_vouch_past_a_hole() {
    let (mut server, proxy, a, after_dump) = restarted_without_what_a_holds("hole").await;
    let c = join(guard("c"), server.client(), "hole").await;
    let mut connection = server.client().get_connection().unwrap();
    let appended: StreamPosition = member_entry("hole", "in-the-first-record")
        .query(&mut connection)
        .unwrap();
    wait_until("`c` to apply the entry", || c.fleet.position() >= appended).await;
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    // Within the members' wait on the first record's frontier.
    server.restart_from_dump();
    proxy.resume();
    caught_up(&a).await;
    caught_up(&c).await;
    none_answers_absent(&[&a, &c], &after_dump);
}

/// As above, but a second restart comes from a dump saved after the first
/// record began and before `a` reported into it: the record, without its
/// frontier or its mark. `a`, which saw the mark, took itself for lacking
/// what the first record needed, since no frontier said it held it, and
/// recovered with every other member: nobody could vouch, and a fleet
/// without a source stayed fenced (seen on 903fbc4). The second record's
/// frontier, which `a` reports into again, judges it instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_restart_from_before_the_reports_leaves_the_holder_able_to_vouch() {
    let (mut server, proxy, a, after_dump) = restarted_without_what_a_holds("reports").await;
    let mut connection = server.client().get_connection().unwrap();
    let before = record_began(&mut connection, "reports");
    // A joiner begins the record; the restart below may cut its join short.
    let joining = FleetSync::builder(guard("j"), server.client(), "reports")
        .lease(LEASE)
        .build();
    let joiner = tokio::spawn(async move { joining.join().await });
    until_a_record_other_than(&mut connection, "reports", before).await;
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    // Fenced when it learns of the record: made fresh in it.
    wait_until("`a` to fence itself", || a.guard().is_fenced()).await;
    proxy.resume();
    wait_until("`a` to report what the restart cut", || {
        exists(&mut connection, "{reports}:snapshot:needed")
    })
    .await;
    // `a` takes in the reply that says so.
    tokio::time::sleep(LEASE / 2).await;
    server.restart_from_dump();
    joiner.abort();
    let c = join(guard("c"), server.client(), "reports").await;
    caught_up(&a).await;
    caught_up(&c).await;
    none_answers_absent(&[&a, &c], &after_dump);
}

/// Redis down for about a lease, then restarted from an older dump: the
/// member's renewal made while it was still caught up (before it fenced
/// itself) waits out the outage and runs after the restart, marking the new
/// record as one a caught-up member lived through; the member, fenced by
/// the time the reply comes, takes itself for fresh in that record, so it
/// lacked what it vouched for, nobody could publish the snapshot the mark
/// asked for, and a fleet without a source stayed fenced (every check
/// "maybe") until `{name}:snapshot:needed` was deleted: 3 runs of 3 timed
/// out waiting for a joiner to catch up. (Judging the member as its renewal
/// was sent, tried and reverted, let one whose lease lapsed after sending,
/// while writes were acknowledged without it, vouch for a set that lacks
/// them.) Now the member holds the record's frontier, the newest entry any
/// member from before holds, and vouches by that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_that_waited_out_a_restart_from_an_older_dump_leaves_the_fleet_able_to_recover() {
    let mut server = RedisServer::start();
    let a = join(guard("a"), server.client(), "outage").await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    let after_dump = write_keys(&a, "after-dump").await;
    server.kill();
    wait_until("`a` to fence itself", || a.guard().is_fenced()).await;
    server.restart_from_dump();
    let c = join(guard("c"), server.client(), "outage").await;
    caught_up(&c).await;
    caught_up(&a).await;
    for member in [&a, &c] {
        for key in &after_dump {
            assert_ne!(member.guard().check(key), Verdict::Absent, "{key}");
        }
    }
}

/// Redis down for longer than a lease, every member caught up before it,
/// then restarted from a dump older than the last writes: no member was
/// caught up when the record began anew, and each holds what the dump cut.
/// Nobody marked the record, and `c`, joining then, replayed the kept
/// stream from its start and answered `Absent` for the keys the dump cut
/// (seen on 2026-11-26, before the frontier). Now the members report what
/// they held; it is gone from the stream, which marks the record; they
/// hold the newest, vouch, and one publishes the snapshot `c` loads. The
/// fleet recovers without a source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sourceless_fleet_through_a_long_outage_and_an_older_dump_recovers_with_every_key() {
    let mut server = RedisServer::start();
    let a = join(guard("a"), server.client(), "outage").await;
    let b = join(guard("b"), server.client(), "outage").await;
    let mut connection = server.client().get_connection().unwrap();
    let () = redis::cmd("SAVE").query(&mut connection).unwrap();
    let after_dump = write_keys(&a, "after-dump").await;
    caught_up(&b).await;
    down_for_longer_than_a_lease(&mut server, &[&a, &b]).await;
    caught_up(&a).await;
    caught_up(&b).await;
    let c = join(guard("c"), server.client(), "outage").await;
    caught_up(&c).await;
    none_answers_absent(&[&a, &b, &c], &after_dump);
    drop((a, b, c, server));
}
