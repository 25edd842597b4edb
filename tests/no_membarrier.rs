//! A host that refuses `membarrier(2)` (a seccomp profile that blocks it):
//! read sections then fence on both sides instead of leaving the barrier to
//! the reclaiming side. A binary of its own, because a process decides once,
//! at its first check, which way its sections go, and this one must decide
//! with the call already refused.

#![cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64"),
    feature = "guard"
))]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bloomguard::{Guard, Verdict, source};
use common::alloc_meter::{AllocMeter, process_live_bytes};
use common::membarrier::refuse_membarrier;
use common::{StopOnDrop, keys};

#[global_allocator]
static ALLOCATOR: AllocMeter = AllocMeter;

const REBUILDS: usize = 40;

/// Checks on two threads run through 40 swaps of the live filter: none
/// answers `Absent` for a stored key (each swap is seen, and no filter is
/// read after it is freed), and the replaced filters are freed rather than
/// kept (a reclaim that never freed would hold all 40).
#[test]
fn without_membarrier_checks_see_every_swap_and_replaced_filters_are_freed() {
    refuse_membarrier();
    let stored = keys(0, 20_000);
    let listed = stored.clone();
    let guard = Guard::builder()
        .expected_items(500_000)
        .seed(11)
        .source(source::from_fn(move || listed.clone()))
        .build()
        .unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(guard.rebuild()).unwrap();
    let filter_bytes = guard.stats().memory_bytes as isize;
    // Settles allocations made once (the first reclaim's list, thread records).
    runtime.block_on(guard.rebuild()).unwrap();
    let before = process_live_bytes();

    let stop = AtomicBool::new(false);
    let checked = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for first in [0, stored.len() / 2] {
            let (guard, stored, stop, checked) = (&guard, &stored, &stop, &checked);
            scope.spawn(move || {
                let mut count = 0u64;
                for key in stored.iter().cycle().skip(first) {
                    assert_ne!(guard.check(key), Verdict::Absent, "{key}");
                    count += 1;
                    if count.is_multiple_of(1_024) && stop.load(Ordering::Relaxed) {
                        break;
                    }
                }
                checked.fetch_add(count, Ordering::Relaxed);
            });
        }
        let _stop = StopOnDrop(&stop);
        for _ in 0..REBUILDS {
            runtime.block_on(guard.rebuild()).unwrap();
            // Lets the checkers run a while on each set.
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    // No check is running now: this swap's reclaim frees whatever earlier
    // ones had to leave to it.
    runtime.block_on(guard.rebuild()).unwrap();
    let grown = process_live_bytes() - before;

    assert!(checked.load(Ordering::Relaxed) > 0);
    assert_eq!(guard.stats().swaps as usize, REBUILDS + 3);
    assert!(
        grown < 2 * filter_bytes,
        "{grown} bytes more after {REBUILDS} swaps of a {filter_bytes}-byte filter"
    );
}
