//! The items service (the axum example's shape, from the tests' support)
//! under load on loopback, with and without the guard layer: requests/s,
//! latency percentiles, and store reads per request.
//!
//! ```text
//! cargo bench --bench http
//! ```
//!
//! 97 % of the requests ask for ids the store does not have (the seen-items
//! shape). Two stores: the in-memory map, and the same map with every read
//! waiting 1 ms (a backend across a data centre). The load generator runs in the same process on the same 2 cores
//! as the server: 32 keep-alive connections, each sending its next request
//! when the last answer arrived, for 5 s per configuration.
//! The table is printed and written to `target/criterion/http-load.md`.

#[path = "../tests/common/items_service.rs"]
mod items_service;

#[path = "../tests/common/http_client.rs"]
#[allow(dead_code)] // the bench reads only the status
mod http_client;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_client::HttpClient;
use items_service::{MakeApp, SEEDED_ITEMS, Store};

const CONNECTIONS: usize = 32;
const DURATION: Duration = Duration::from_secs(5);
/// Out of 100 requests, how many ask for an id the store has.
const PRESENT_PER_100: u64 = 3;

/// Sends requests on one keep-alive connection until `until`; returns each
/// request's latency in microseconds.
async fn drive(address: SocketAddr, connection: u64, until: Instant) -> Vec<u32> {
    let mut client = HttpClient::connect(address).await;
    let mut latencies = Vec::new();
    let mut n = connection * 1_000_000;
    while Instant::now() < until {
        n += 1;
        let path = if n % 100 < PRESENT_PER_100 {
            format!("/items/{}", n % SEEDED_ITEMS)
        } else {
            format!("/items/absent-{n}")
        };
        let start = Instant::now();
        let reply = client.get(&path).await;
        latencies.push(start.elapsed().as_micros() as u32);
        assert!(matches!(reply.status.as_u16(), 200 | 404), "{reply:?}");
    }
    latencies
}

fn percentile(sorted: &[u32], p: f64) -> u32 {
    sorted[((sorted.len() - 1) as f64 * p) as usize]
}

async fn measure(
    duration: Duration,
    name: &str,
    read_delay: Option<Duration>,
    make_app: MakeApp,
) -> String {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let mut store = Store::seeded(SEEDED_ITEMS);
    if let Some(delay) = read_delay {
        store = store.with_read_delay(delay);
    }
    let running = items_service::start(
        make_app,
        store,
        SocketAddr::from(([127, 0, 0, 1], 0)),
        async {
            let _ = stopped.await;
        },
    )
    .await
    .unwrap();
    let reads_before = running.store.reads();
    let until = Instant::now() + duration;
    let started = Instant::now();
    let drivers: Vec<_> = (0..CONNECTIONS as u64)
        .map(|c| tokio::spawn(drive(running.address, c, until)))
        .collect();
    let mut latencies = Vec::new();
    for driver in drivers {
        latencies.extend(driver.await.unwrap());
    }
    let elapsed = started.elapsed().as_secs_f64();
    let reads = running.store.reads() - reads_before;
    latencies.sort_unstable();
    let requests = latencies.len();
    stop.send(()).unwrap();
    running.server.await.unwrap().unwrap();
    running.maintenance.shutdown().await;
    format!(
        "| {name} | {requests} | {:.0} | {} | {} | {:.3} |",
        requests as f64 / elapsed,
        percentile(&latencies, 0.5),
        percentile(&latencies, 0.99),
        reads as f64 / requests as f64,
    )
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let rows = runtime.block_on(async {
        // Warm-up, not reported: the first configuration measured ran ~20 % slow.
        let warm_up = Duration::from_secs(1);
        measure(warm_up, "warm-up", None, items_service::app).await;
        let mut rows = Vec::new();
        for (store, delay) in [
            ("in-memory", None),
            ("1 ms reads", Some(Duration::from_millis(1))),
        ] {
            for (name, app) in [
                ("without the guard", items_service::unguarded_app as MakeApp),
                ("with GuardLayer", items_service::app),
                ("without the guard (again)", items_service::unguarded_app),
            ] {
                let name = format!("{store}, {name}");
                rows.push(measure(DURATION, &name, delay, app).await);
            }
        }
        rows
    });
    let table = [
        "| configuration | requests | requests/s | p50 µs | p99 µs | store reads / request |"
            .to_string(),
        "|---|---:|---:|---:|---:|---:|".to_string(),
    ]
    .into_iter()
    .chain(rows)
    .collect::<Vec<_>>()
    .join("\n");
    println!("{table}");
    let _ = std::fs::create_dir_all("target/criterion");
    if let Err(error) = std::fs::write("target/criterion/http-load.md", table + "\n") {
        eprintln!("cannot write target/criterion/http-load.md: {error}");
    }
}
