//! The items service (the axum example's shape, from the tests' support)
//! under load on loopback, with and without the guard layer: requests/s,
//! latency percentiles, store reads per request, and the server's CPU time
//! per request.
//!
//! ```text
//! cargo bench --bench http
//! BLOOMGUARD_BENCH_CONNECTIONS=64 cargo bench --bench http   # other than 16 per core
//! cargo bench --bench http -- "in-memory, with"              # the configurations named so
//! ```
//!
//! 97 % of the requests ask for ids the store does not have (the seen-items
//! shape). Two stores: the in-memory map, and the same map with every read
//! waiting 1 ms (a backend across a data centre). The server and the load
//! generator (hyper's client) run on runtimes of their own, each with a
//! worker per core, in one process: 16 keep-alive connections per core,
//! each sending its next request when the last answer arrived, for 5 s per
//! configuration. The server's CPU time is what its threads spent on a CPU
//! (`/proc/self/task/*/schedstat`), so the load generator's share is not in
//! it. The table is printed and written to `target/criterion/http-load.md`.

#[path = "../tests/common/items_service.rs"]
mod items_service;

#[path = "../tests/common/http_client.rs"]
#[allow(dead_code)] // the bench reads only the status
mod http_client;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http_client::HttpClient;
use items_service::{MakeApp, SEEDED_ITEMS, Store};
use tokio::runtime::Runtime;

/// Keep-alive connections per core, unless `BLOOMGUARD_BENCH_CONNECTIONS` says how many in all.
const CONNECTIONS_PER_CORE: usize = 16;
/// The server runtime's worker threads are named this, so that their CPU
/// time can be told from the load generator's.
const SERVER_THREAD: &str = "items-server";
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

/// Nanoseconds the server runtime's threads have spent on a CPU so far.
fn server_cpu_nanos() -> u64 {
    let tasks = std::fs::read_dir("/proc/self/task").expect("Linux's /proc");
    tasks
        .filter_map(|task| {
            let task = task.ok()?.path();
            let name = std::fs::read_to_string(task.join("comm")).ok()?;
            if !name.starts_with(SERVER_THREAD) {
                return None;
            }
            let schedstat = std::fs::read_to_string(task.join("schedstat")).ok()?;
            schedstat.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum()
}

struct Load<'a> {
    server: &'a Runtime,
    clients: &'a Runtime,
    connections: usize,
}

impl Load<'_> {
    fn measure(
        &self,
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
        let running = self
            .server
            .block_on(items_service::start(
                make_app,
                store,
                SocketAddr::from(([127, 0, 0, 1], 0)),
                async {
                    let _ = stopped.await;
                },
            ))
            .unwrap();
        let reads_before = running.store.reads();
        let cpu_before = server_cpu_nanos();
        let started = Instant::now();
        let until = started + duration;
        let latencies = self.clients.block_on(async {
            let drivers: Vec<_> = (0..self.connections as u64)
                .map(|c| tokio::spawn(drive(running.address, c, until)))
                .collect();
            let mut latencies = Vec::new();
            for driver in drivers {
                latencies.extend(driver.await.unwrap());
            }
            latencies
        });
        let elapsed = started.elapsed().as_secs_f64();
        let server_cpu = server_cpu_nanos() - cpu_before;
        let reads = running.store.reads() - reads_before;
        let mut latencies = latencies;
        latencies.sort_unstable();
        let requests = latencies.len();
        stop.send(()).unwrap();
        self.server.block_on(async {
            running.server.await.unwrap().unwrap();
            running.maintenance.shutdown().await;
        });
        format!(
            "| {name} | {requests} | {:.0} | {} | {} | {:.3} | {:.1} |",
            requests as f64 / elapsed,
            percentile(&latencies, 0.5),
            percentile(&latencies, 0.99),
            reads as f64 / requests as f64,
            server_cpu as f64 / 1_000.0 / requests as f64,
        )
    }
}

fn runtime(threads: usize, name: &str) -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name(name)
        .enable_all()
        .build()
        .unwrap()
}

fn main() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let connections = std::env::var("BLOOMGUARD_BENCH_CONNECTIONS")
        .ok()
        .map(|n| n.parse().expect("BLOOMGUARD_BENCH_CONNECTIONS: a number"))
        .unwrap_or(CONNECTIONS_PER_CORE * cores);
    // Like criterion's filter: only the configurations whose name contains it.
    let filter = std::env::args()
        .skip(1)
        .find(|arg| !arg.starts_with("--"))
        .unwrap_or_default();
    let (server, clients) = (
        runtime(cores, SERVER_THREAD),
        runtime(cores, "load-generator"),
    );
    let load = Load {
        server: &server,
        clients: &clients,
        connections,
    };
    // Warm-up, not reported: the first configuration measured ran ~20 % slow.
    load.measure(Duration::from_secs(1), "warm-up", None, items_service::app);
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
            if name.contains(&filter) {
                rows.push(load.measure(DURATION, &name, delay, app));
            }
        }
    }
    let table = [
        format!("{cores} cores, {connections} connections"),
        String::new(),
        "| configuration | requests | requests/s | p50 µs | p99 µs | store reads / request | server CPU µs / request |"
            .to_string(),
        "|---|---:|---:|---:|---:|---:|---:|".to_string(),
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
