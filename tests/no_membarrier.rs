//! A host that refuses `membarrier(2)` (a seccomp profile that blocks it):
//! read sections then fence on both sides instead of leaving the barrier to
//! the reclaiming side. A binary of its own, because a process decides once,
//! when it builds its first guard, which way its sections go, and this one
//! must decide with the call already refused.

#![cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64"),
    feature = "guard"
))]

mod common;

use common::alloc_meter::AllocMeter;
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
    swapped.assert_swaps_under_checks_free_what_they_replace(2, REBUILDS);
    assert_eq!(swapped.guard.stats().swaps as usize, REBUILDS + 3);
}
