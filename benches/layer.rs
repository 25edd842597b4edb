//! What `GuardService` adds to a request: the layer over a no-op inner
//! service against the bare inner service, for absent and maybe-present keys;
//! and the absent paths users call — the layer on a fresh service clone per
//! call (as axum's router makes one), `GuardedLoader::get`, and the
//! `Guard::check` the loader starts from — against the raw filter's
//! `contains` on the same filter (issue #16: at least 0.9× its rate).
//!
//! ```text
//! cargo bench --bench layer                                # 100,000 keys
//! BLOOMGUARD_BENCH_SIZES=1M,32M cargo bench --bench layer  # past the cache too
//! BLOOMGUARD_COUNT_INSTRUCTIONS=1 cargo bench --bench layer # instructions a key (valgrind)
//! ```
//!
//! Futures are polled by hand with a no-op waker (every one is ready at
//! once), so the figures are the layer's own cost, without a runtime. Each
//! timed iteration makes 64 calls. Before the criterion runs, the absent
//! paths are also measured interleaved (see `common::interleaved`); that
//! table is printed at the end and written to
//! `target/criterion/layer-overhead.md`.

mod common;

use std::convert::Infallible;
use std::future::{Future, Ready, ready};
use std::hint::black_box;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bloomguard::{Guard, GuardLayer, GuardedLoader};
use common::{BLOCK, CHUNK, KeySet, Path, ROUNDS, bench_sizes, interleaved, label};
use criterion::{BenchmarkGroup, Criterion, SamplingMode, Throughput, measurement::WallTime};
use tower::{Layer, Service, service_fn};

const KEYS: usize = 100_000;

fn poll_ready_now<F: Future>(future: F) -> F::Output {
    let mut context = Context::from_waker(Waker::noop());
    match pin!(future).poll(&mut context) {
        Poll::Ready(output) => output,
        Poll::Pending => unreachable!("every future here is ready at once"),
    }
}

/// The inner service: answers at once, found.
fn no_op() -> impl Service<
    &'static [u8],
    Response = Option<u32>,
    Error = Infallible,
    Future = Ready<Result<Option<u32>, Infallible>>,
> + Clone {
    service_fn(|_key: &'static [u8]| ready(Ok(Some(1))))
}

fn bench_calls<S>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    keys: &[&'static [u8]],
    mut service: S,
) where
    S: Service<&'static [u8], Response = Option<u32>, Error = Infallible>,
{
    bench_keys(group, id, keys, |key| {
        poll_ready_now(service.call(key)).unwrap().is_some()
    });
}

/// Times `call` on 64 keys per iteration, walking through `keys`.
fn bench_keys(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    keys: &[&'static [u8]],
    mut call: impl FnMut(&'static [u8]) -> bool,
) {
    let mut next = 0;
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                if next + CHUNK > keys.len() {
                    next = 0;
                }
                for key in &keys[next..next + CHUNK] {
                    black_box(call(black_box(key)));
                }
                next += CHUNK;
            }
            start.elapsed()
        })
    });
}

/// Calls a fresh clone of the service each time, as axum's router does.
struct ClonePerCall<S>(S);

impl<S, R> Service<R> for ClonePerCall<S>
where
    S: Service<R> + Clone,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: R) -> Self::Future {
        self.0.clone().call(request)
    }
}

/// A criterion id for a path's name: "layer, one service" → "layer-one-service".
fn slug(name: &str) -> String {
    name.split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|word| !word.is_empty())
        .map(str::to_ascii_lowercase)
        .collect::<Vec<_>>()
        .join("-")
}

fn leak(keys: &KeySet) -> Vec<&'static [u8]> {
    (0..keys.len())
        .map(|i| &*Box::leak(keys.get(i).to_vec().into_boxed_slice()))
        .collect()
}

/// Set (to a path's index, or `none`) in a run under callgrind: that run
/// takes each absent key through the one path, once, and stops.
const COUNTED_PATH: &str = "BLOOMGUARD_COUNTED_PATH";

/// Instructions, loads and stores per key on each absent path, counted by
/// callgrind: deterministic where times on a shared VM swing by ±20 %, so a
/// change of a few instructions shows. Runs this bench under
/// `valgrind --tool=callgrind` once per path and once with no path (the
/// setup, subtracted). The counts follow from what the compiler inlined in
/// this bench; they rank the paths, they do not time them.
fn count_instructions(paths: &[&str]) {
    let exe = std::env::current_exe().expect("the bench's own path");
    let out = std::env::temp_dir().join(format!("bloomguard-callgrind-{}", std::process::id()));
    let count = |path: &str| -> Option<[u64; 3]> {
        let status = std::process::Command::new("valgrind")
            .args(["--tool=callgrind", "--cache-sim=yes"])
            .arg(format!("--callgrind-out-file={}", out.display()))
            .arg(&exe)
            .arg("--bench")
            .env(COUNTED_PATH, path)
            .env("BLOOMGUARD_BENCH_SIZES", KEYS.to_string())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .ok()?;
        let profile = std::fs::read_to_string(&out).ok()?;
        let _ = std::fs::remove_file(&out);
        // "events: Ir Dr Dw ..." and "summary: <counts in that order>".
        let totals: Vec<u64> = profile
            .lines()
            .find_map(|line| line.strip_prefix("summary: "))?
            .split_whitespace()
            .map(|n| n.parse().unwrap_or(0))
            .collect();
        (status.success() && totals.len() >= 3).then(|| [totals[0], totals[1], totals[2]])
    };
    let Some(setup) = count("none") else {
        println!("callgrind did not run (is valgrind installed?): no instruction counts");
        return;
    };
    let mut table = vec![
        "| absent keys through | instructions/key | loads/key | stores/key |".to_string(),
        "|---|---:|---:|---:|".to_string(),
    ];
    for (index, name) in paths.iter().enumerate() {
        let counted = count(&index.to_string()).expect("callgrind ran for the setup");
        let [instructions, loads, stores] =
            std::array::from_fn(|i| counted[i].saturating_sub(setup[i]) as f64 / KEYS as f64);
        table.push(format!(
            "| {name} | {instructions:.0} | {loads:.0} | {stores:.0} |"
        ));
    }
    let table = table.join("\n");
    println!("Counted by callgrind, {KEYS} absent keys a path:\n{table}");
    let path = std::path::Path::new("target/criterion/layer-instructions.md");
    if let Err(error) = std::fs::write(path, table + "\n") {
        eprintln!("cannot write {}: {error}", path.display());
    }
}

fn main() {
    let counted_path = std::env::var(COUNTED_PATH).ok();
    let mut criterion = Criterion::default().configure_from_args();
    let mut overhead = vec![
        "| n | absent keys through | median ns/key | rate vs raw `contains` |".to_string(),
        "|---|---|---:|---:|".to_string(),
    ];
    for n in bench_sizes(&KEYS.to_string()) {
        let present = leak(&KeySet::generate("user", n, 1));
        let absent = leak(&KeySet::generate("absent", n.clamp(KEYS, 4_000_000), 2));
        let guard = Guard::builder()
            .expected_items(n as u64)
            .false_positive_rate(0.01)
            .build()
            .unwrap();
        for key in &present {
            guard.insert(key);
        }
        let live = guard.live_filters();
        let raw = live
            .newest()
            .expect("a guard without a source has a filter");
        let layer = GuardLayer::for_loader(guard.clone());
        let loader = GuardedLoader::new(guard, |_key: &'static [u8]| {
            ready(Ok::<_, Infallible>(Some(1u32)))
        });

        let mut one_service = layer.layer(no_op());
        let mut clone_per_call = ClonePerCall(layer.layer(no_op()));
        let mut paths: [Path<'_, 'static>; 5] = [
            ("raw contains", &mut |key| raw.contains(key)),
            ("Guard::check", &mut |key| {
                loader.guard().check(key).is_absent()
            }),
            ("GuardedLoader::get", &mut |key| {
                poll_ready_now(loader.get(&key)).unwrap().is_some()
            }),
            ("layer, one service", &mut |key| {
                poll_ready_now(one_service.call(key)).unwrap().is_some()
            }),
            ("layer, clone per call", &mut |key| {
                poll_ready_now(clone_per_call.call(key)).unwrap().is_some()
            }),
        ];
        if let Some(counted) = &counted_path {
            if let Ok(index) = counted.parse::<usize>() {
                for &key in &absent {
                    black_box((paths[index].1)(black_box(key)));
                }
            }
            return;
        }
        if std::env::var_os("BLOOMGUARD_COUNT_INSTRUCTIONS").is_some() {
            count_instructions(&paths.map(|(name, _)| name));
            return;
        }
        let medians = interleaved(&absent, &mut paths);
        for ((path, _), median) in paths.iter().zip(&medians) {
            overhead.push(format!(
                "| {} | {path} | {median:.1} | {:.2}× |",
                label(n),
                medians[0] / median
            ));
        }

        let mut group = criterion.benchmark_group(format!("layer/n={}", label(n)));
        group
            .throughput(Throughput::Elements(CHUNK as u64))
            .sampling_mode(SamplingMode::Flat)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(2));
        bench_calls(&mut group, "bare/no-op", &absent, no_op());
        for (path, call) in &mut paths {
            bench_keys(&mut group, &format!("absent/{}", slug(path)), &absent, call);
        }
        bench_calls(
            &mut group,
            "maybe-present/guarded",
            &present,
            layer.layer(no_op()),
        );
        group.finish();
    }
    criterion.final_summary();
    let table = overhead.join("\n");
    println!("\nInterleaved, single thread ({ROUNDS} rounds of {BLOCK} keys, medians):\n{table}");
    let path = std::path::Path::new("target/criterion/layer-overhead.md");
    if let Err(error) = std::fs::write(path, table + "\n") {
        eprintln!("cannot write {}: {error}", path.display());
    }
}
