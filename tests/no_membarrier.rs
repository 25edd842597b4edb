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

use common::StopOnDrop;
use common::alloc_meter::{AllocMeter, process_live_bytes};
use common::membarrier::{SwappedGuard, refuse_membarrier};

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
    let swapped = SwappedGuard::new();
    // Settles allocations made once (the first reclaim's list, thread records).
    swapped.swap(1);
    let before = process_live_bytes();

    let stop = AtomicBool::new(false);
    let checked = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for first in [0, swapped.stored.len() / 2] {
            let (swapped, stop, checked) = (&swapped, &stop, &checked);
            scope.spawn(move || {
                let count = swapped.check_until(first, stop, || {});
                checked.fetch_add(count, Ordering::Relaxed);
            });
        }
        let _stop = StopOnDrop(&stop);
        swapped.swap(REBUILDS);
    });
    // No check is running now: this swap's reclaim frees whatever earlier
    // ones had to leave to it.
    swapped.swap(1);
    let grown = process_live_bytes() - before;

    assert!(checked.load(Ordering::Relaxed) > 0);
    assert_eq!(swapped.guard.stats().swaps as usize, REBUILDS + 3);
    let filter_bytes = swapped.filter_bytes;
    assert!(
        grown < 2 * filter_bytes,
        "{grown} bytes more after {REBUILDS} swaps of a {filter_bytes}-byte filter"
    );
}
