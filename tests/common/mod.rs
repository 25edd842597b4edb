//! Key sets shared by the integration tests: deterministic, shaped like real keys.

#![allow(dead_code)]

pub(crate) mod alloc_meter;
#[cfg(feature = "guard")]
pub(crate) mod captured_log;
#[cfg(feature = "redis")]
pub(crate) mod fake_redis;
#[cfg(feature = "redis")]
pub(crate) mod fleet;
pub(crate) mod http_client;
pub(crate) mod items_service;
#[cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64"),
    feature = "guard"
))]
pub(crate) mod membarrier;
pub(crate) mod ports;
#[cfg(feature = "postgres")]
pub(crate) mod postgres_server;
pub(crate) mod redis_cluster;
pub(crate) mod redis_server;
pub(crate) mod tcp_proxy;

/// Sets its flag when dropped: a test's own thread holds one inside
/// `std::thread::scope`, so that workers looping until the flag is set stop
/// also when the test panics (the scope waits for them before it passes the
/// panic on, and would wait for ever).
pub(crate) struct StopOnDrop<'a>(pub(crate) &'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// `user:{u}:item:{i}` keys, numbered `first..first + count` (13–30 bytes).
pub(crate) fn keys(first: u64, count: u64) -> Vec<String> {
    (first..first + count)
        .map(|n| format!("user:{}:item:{}", n / 97, n * 7919 % 1_000_003))
        .collect()
}

/// Keys from a namespace no call to [`keys`] produces.
pub(crate) fn absent_keys(first: u64, count: u64) -> Vec<String> {
    (first..first + count)
        .map(|n| format!("absent:{}:item:{}", n / 97, n))
        .collect()
}

/// A guard sized for 100,000 keys that rebuilds from `source`.
#[cfg(feature = "guard")]
pub(crate) fn guard_from(source: impl bloomguard::KeySource) -> bloomguard::Guard {
    bloomguard::Guard::builder()
        .expected_items(100_000)
        .seed(0x5eed)
        .source(source)
        .build()
        .unwrap()
}

/// Polls `condition` every few milliseconds for up to 30 s: generous, so a
/// slow machine only makes a test slower, never wrong.
pub(crate) async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Upper limit of a measured rate `p` over `trials` with three standard deviations of noise.
pub(crate) fn three_sigma_limit(p: f64, trials: usize) -> f64 {
    p + 3.0 * (p * (1.0 - p) / trials as f64).sqrt()
}
