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
//! ```
//!
//! Futures are polled by hand with a no-op waker (every one is ready at
//! once), so the figures are the layer's own cost, without a runtime. Each
//! timed iteration makes 64 calls.

mod common;

use std::convert::Infallible;
use std::future::{Future, Ready, ready};
use std::hint::black_box;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bloomguard::{Guard, GuardLayer, GuardedLoader};
use common::{CHUNK, KeySet, bench_sizes, label};
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

fn leak(keys: &KeySet) -> Vec<&'static [u8]> {
    (0..keys.len())
        .map(|i| &*Box::leak(keys.get(i).to_vec().into_boxed_slice()))
        .collect()
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
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

        let mut group = criterion.benchmark_group(format!("layer/n={}", label(n)));
        group
            .throughput(Throughput::Elements(CHUNK as u64))
            .sampling_mode(SamplingMode::Flat)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(2));
        bench_calls(&mut group, "bare/no-op", &absent, no_op());
        bench_keys(&mut group, "absent/raw-contains", &absent, |key| {
            raw.contains(key)
        });
        bench_calls(&mut group, "absent/guarded", &absent, layer.layer(no_op()));
        bench_calls(
            &mut group,
            "absent/guarded-clone-per-call",
            &absent,
            ClonePerCall(layer.layer(no_op())),
        );
        // What the loader's path starts from.
        bench_keys(&mut group, "absent/guard-check", &absent, |key| {
            loader.guard().check(key).is_absent()
        });
        bench_keys(&mut group, "absent/loader-get", &absent, |key| {
            poll_ready_now(loader.get(key)).unwrap().is_some()
        });
        bench_calls(
            &mut group,
            "maybe-present/guarded",
            &present,
            layer.layer(no_op()),
        );
        group.finish();
    }
    criterion.final_summary();
}
