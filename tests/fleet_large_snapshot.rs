//! One fleet scenario in a binary of its own: a member whose set takes
//! longer to encode than its lease. It takes about 1 GB and loads both
//! cores (an encoding thread, and Redis taking in each snapshot): beside
//! the other fleet tests, their short leases would lapse for want of a
//! core, so it runs alone, as the read sections' binaries do.

mod common;

use std::time::Duration;

use bloomguard::Guard;
use common::fleet::{Ledger, audit, caught_up, exists, join_with, keep_writing, keys};
use common::redis_server::RedisServer;
use common::wait_until;

/// A member's own heavy work ran among its tasks, beside the one that
/// fenced it when its lease ran out: encoding a set for a snapshot that
/// takes longer than the lease let the lease lapse in Redis with the member
/// unfenced; writers stopped waiting for it, and it answered `Absent` for
/// their keys until the encoding ended. (The fence has a thread of its own
/// now, and the work runs on tokio's blocking pool, off the tasks that
/// renew the lease and apply the stream.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_encoding_a_large_snapshot_still_fences_when_its_lease_lapses() {
    let server = RedisServer::start();
    // About 240 MB a filter: 0.6-0.8 s to encode here, longer than the
    // lease (whose last eighth, 50 ms, is the margin a member fences in).
    let large = |name: &str| {
        Guard::builder()
            .name(name)
            .expected_items(200_000_000)
            .seed(0xf1ee7)
            .build()
            .unwrap()
    };
    let lease = Duration::from_millis(400);
    let a = join_with(large("a"), server.client(), "encoding", |builder| {
        builder.lease(lease).snapshot_every(Duration::from_secs(1))
    })
    .await;
    let b = join_with(large("b"), server.client(), "encoding", |builder| {
        builder.lease(lease)
    })
    .await;
    caught_up(&a).await;
    caught_up(&b).await;
    let ledger = Ledger::default();
    let audit = audit(&ledger, vec![a.guard().clone()]);
    let writes = keep_writing(&ledger, &b.fleet, keys("encoding", 20_000));
    // Under load a publish may find `a` fenced (a renewal late), and tries
    // again a period later: wait for one, then for the encodings after it.
    let mut connection = server.client().get_connection().unwrap();
    wait_until("a snapshot of the large set", || {
        exists(&mut connection, "{encoding}:snapshot")
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    writes.abort();
    let report = audit.finish().await;
    assert!(
        report.rounds > 10 && !ledger.completed().is_empty(),
        "{report:?}"
    );
    for member in [a, b] {
        member.handle.shutdown().await;
    }
}
