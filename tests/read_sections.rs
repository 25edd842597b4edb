//! Checks under swaps on the path a Linux process takes when it can:
//! `membarrier(2)` on the swapping side, and read sections that do not fence.
//! A binary of its own, so that no other test in it changes which path the
//! process picks (`no_membarrier.rs` and `membarrier_revoked.rs` take the
//! others).

#![cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64"),
    feature = "guard"
))]

mod common;

use common::alloc_meter::AllocMeter;
use common::membarrier::{SwappedGuard, require_private_expedited};

#[global_allocator]
static ALLOCATOR: AllocMeter = AllocMeter;

const SWAPS: usize = 60;
/// More checkers than this 2-core VM has cores, so that some are preempted
/// mid-section and a swap finds sections it must wait for or leave to the
/// next one.
const CHECKERS: usize = 4;

/// Four threads check stored keys while the live filter is swapped 60
/// times under them. A replaced filter is zeroed as it is freed (the test's
/// allocator), so a check that read one after that would answer `Absent`:
/// none does, and the replaced filters are freed rather than kept.
#[test]
fn checks_under_swaps_never_read_a_freed_filter_and_replaced_filters_are_freed() {
    require_private_expedited();
    assert!(
        !private_expedited_answers(),
        "registered before any guard was used"
    );
    let swapped = SwappedGuard::new();
    swapped.assert_swaps_under_checks_free_what_they_replace(CHECKERS, SWAPS);
    assert_eq!(swapped.guard.stats().swaps as usize, SWAPS + 3);
    assert!(
        private_expedited_answers(),
        "the swaps did not register for membarrier: the path under test was not the one taken"
    );
}

/// Whether `MEMBARRIER_CMD_PRIVATE_EXPEDITED` serves this process: it fails
/// with `EPERM` until the process registered for it, which only the read
/// sections' first swap does.
fn private_expedited_answers() -> bool {
    const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
    // SAFETY: membarrier(2) with a command and flags 0 touches no memory.
    unsafe { libc::syscall(libc::SYS_membarrier, PRIVATE_EXPEDITED, 0) == 0 }
}
