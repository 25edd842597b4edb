//! What the fleet contract costs, on a redis-server of the bench's own on
//! loopback, every member in this process:
//! - the latency a fleet write adds (append until every member applied it),
//!   p50 and p99, with 3 and 8 members, one write at a time;
//! - acknowledged writes per second with 32 writers over 3 members, and the
//!   same with every append waiting for a replica (`wait_for_replicas(1)`,
//!   on a master with one replica of the bench's own);
//! - the time from a member losing Redis (a stalling proxy) to fencing
//!   itself, against its lease;
//! - the share of checks that pass through while fenced;
//! - the time a member takes to catch up after a 3 s stall.
//!
//! ```text
//! cargo bench --features redis --bench fleet
//! ```
//!
//! The table is printed and written to `target/criterion/fleet.md`.

#[path = "../tests/common/ports.rs"]
mod ports;
#[path = "../tests/common/redis_server.rs"]
#[allow(dead_code)] // the bench starts servers only
mod redis_server;
#[path = "../tests/common/tcp_proxy.rs"]
#[allow(dead_code)] // the bench stalls; it never cuts
mod tcp_proxy;

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use bloomguard::redis::fleet::{FleetHandle, FleetSync};
use bloomguard::{Guard, Verdict};
use redis_server::RedisServer;
use tcp_proxy::TcpProxy;

const LEASE: Duration = Duration::from_secs(1);

fn guard(name: &str) -> Guard {
    Guard::builder()
        .name(name)
        .expected_items(1_000_000)
        .seed(0xbe4c)
        .build()
        .unwrap()
}

async fn members(
    client: &redis::Client,
    fleet: &str,
    count: usize,
) -> Vec<(FleetSync, FleetHandle)> {
    replicated_members(client, fleet, count, 0).await
}

async fn replicated_members(
    client: &redis::Client,
    fleet: &str,
    count: usize,
    replicas: usize,
) -> Vec<(FleetSync, FleetHandle)> {
    let mut joined = Vec::new();
    for i in 0..count {
        let member = FleetSync::builder(guard(&format!("m{i}")), client.clone(), fleet)
            .lease(LEASE)
            .wait_for_replicas(replicas)
            .build();
        let handle = member.join().await.unwrap();
        joined.push((member, handle));
    }
    for (member, _) in &joined {
        while member.guard().is_fenced() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    joined
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// p50 and p99 of one write at a time through the first member.
async fn write_latency(server: &RedisServer, count: usize) -> (Duration, Duration) {
    let fleet = format!("latency{count}");
    let joined = members(&server.client(), &fleet, count).await;
    let writer = &joined[0].0;
    let mut latencies = Vec::new();
    for i in 0..3_000 {
        let started = Instant::now();
        writer
            .insert_then_write(format!("key:{i}"), async {})
            .await
            .unwrap();
        latencies.push(started.elapsed());
    }
    latencies.sort_unstable();
    (quantile(&latencies, 0.5), quantile(&latencies, 0.99))
}

/// Acknowledged writes per second, 32 writers spread over 3 members whose
/// appends wait for `replicas` replicas.
async fn throughput(server: &RedisServer, replicas: usize) -> f64 {
    let fleet = format!("throughput{replicas}");
    let joined = replicated_members(&server.client(), &fleet, 3, replicas).await;
    let started = Instant::now();
    let until = started + Duration::from_secs(5);
    let writers: Vec<_> = (0..32)
        .map(|w| {
            let member = joined[w % joined.len()].0.clone();
            tokio::spawn(async move {
                let mut written = 0u64;
                while Instant::now() < until {
                    member
                        .insert_then_write(format!("w{w}:{written}"), async {})
                        .await
                        .unwrap();
                    written += 1;
                }
                written
            })
        })
        .collect();
    let mut written = 0;
    for writer in writers {
        written += writer.await.unwrap();
    }
    written as f64 / started.elapsed().as_secs_f64()
}

struct StallFigures {
    time_to_fence: Duration,
    pass_through_while_fenced: f64,
    catch_up: Duration,
    written_during_stall: u64,
}

/// A member behind a proxy that stalls for 3 s while another writes.
async fn stall(server: &RedisServer) -> StallFigures {
    let proxy = TcpProxy::start(([127, 0, 0, 1], server.port).into()).await;
    let writer = members(&server.client(), "stall", 1).await.remove(0);
    let stalled = members(&proxy.client(), "stall", 1).await.remove(0);
    for i in 0..1_000 {
        writer
            .0
            .insert_then_write(format!("before:{i}"), async {})
            .await
            .unwrap();
    }

    proxy.stall();
    let lost_redis = Instant::now();
    let writing = {
        let writer = writer.0.clone();
        tokio::spawn(async move {
            let mut written = 0u64;
            while lost_redis.elapsed() < Duration::from_secs(3) {
                writer
                    .insert_then_write(format!("during:{written}"), async {})
                    .await
                    .unwrap();
                written += 1;
            }
            written
        })
    };
    while !stalled.0.guard().is_fenced() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let time_to_fence = lost_redis.elapsed();
    // Absent keys: an unfenced guard rules nearly all of them out.
    let checks = 100_000;
    let passed = (0..checks)
        .filter(|i| stalled.0.guard().check(format!("absent:{i}")) != Verdict::Absent)
        .count();
    let written_during_stall = writing.await.unwrap();
    proxy.resume();
    let resumed = Instant::now();
    while stalled.0.guard().is_fenced() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    StallFigures {
        time_to_fence,
        pass_through_while_fenced: passed as f64 / checks as f64,
        catch_up: resumed.elapsed(),
        written_during_stall,
    }
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = RedisServer::start();
    let mut table = String::new();
    writeln!(table, "| figure | value |").unwrap();
    writeln!(table, "|---|---:|").unwrap();
    runtime.block_on(async {
        for count in [3, 8] {
            let (p50, p99) = write_latency(&server, count).await;
            writeln!(
                table,
                "| write latency with {count} members, p50 / p99 | {p50:.2?} / {p99:.2?} |"
            )
            .unwrap();
        }
        let per_second = throughput(&server, 0).await;
        writeln!(
            table,
            "| acknowledged writes/s (32 writers, 3 members) | {per_second:.0} |"
        )
        .unwrap();
        let port = server.port.to_string();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &port]);
        let mut master = server.client().get_connection().unwrap();
        while !redis::cmd("INFO")
            .arg("replication")
            .query::<String>(&mut master)
            .unwrap()
            .contains("state=online")
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let per_second = throughput(&server, 1).await;
        drop(replica);
        writeln!(
            table,
            "| the same, each append and renewal waiting for 1 replica | {per_second:.0} |"
        )
        .unwrap();
        let stall = stall(&server).await;
        writeln!(
            table,
            "| losing Redis → fenced (lease {LEASE:?}) | {:.0?} |",
            stall.time_to_fence
        )
        .unwrap();
        writeln!(
            table,
            "| pass-through while fenced | {:.1} % |",
            100.0 * stall.pass_through_while_fenced
        )
        .unwrap();
        writeln!(
            table,
            "| writes completed during the 3 s stall | {} |",
            stall.written_during_stall
        )
        .unwrap();
        writeln!(
            table,
            "| catch-up after the 3 s stall | {:.0?} |",
            stall.catch_up
        )
        .unwrap();
    });
    print!("{table}");
    std::fs::create_dir_all("target/criterion").unwrap();
    std::fs::write("target/criterion/fleet.md", table).unwrap();
}
