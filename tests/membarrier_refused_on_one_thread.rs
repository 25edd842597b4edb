//! A process whose `membarrier(2)` is refused on one thread only (a seccomp
//! filter installed on that thread alone, as a sandboxed worker has it),
//! after its read sections began relying on the call. A binary of its own:
//! a process picks its barrier when it builds its first guard, and turns
//! its readers to fences for good.

#![cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64"),
    feature = "guard"
))]

mod common;

use std::sync::mpsc;

use bloomguard::Verdict;
use common::alloc_meter::{AllocMeter, process_live_bytes};
use common::membarrier::{
    SwappedGuard, membarrier_refused, refuse_membarrier_on_this_thread, require_private_expedited,
};

#[global_allocator]
static ALLOCATOR: AllocMeter = AllocMeter;

const SWAPS: usize = 20;

/// A swap on the refused thread turns the process's readers to fences.
/// Every reclaim after it, on any thread, then waited for each thread that
/// had used a guard before to use one again, though `membarrier` still
/// served every other thread: one that never did (parked here) kept every
/// replaced filter for as long as it lived. A reclaim whose `membarrier`
/// serves reaches that thread too, and frees them.
#[test]
fn after_one_threads_membarrier_is_refused_the_others_reclaims_still_free() {
    require_private_expedited();
    let swapped = SwappedGuard::new();
    let (guard, stored, filter_bytes) = (&swapped.guard, &swapped.stored, swapped.filter_bytes);
    assert_ne!(guard.check(&stored[0]), Verdict::Absent);
    swapped.swap(1);

    let (checked, heard_checked) = mpsc::channel::<()>();
    let (release, parked) = mpsc::channel::<()>();
    let kept = std::thread::scope(|scope| {
        // Owned by this closure: its unwinding drops it and ends the park.
        let release = release;
        scope.spawn(move || {
            // Its record is made while membarrier serves, and its sections
            // do not fence; then it idles, checking nothing.
            assert_ne!(guard.check(&stored[1]), Verdict::Absent);
            checked.send(()).unwrap();
            let _ = parked.recv();
        });
        heard_checked.recv().unwrap();
        scope
            .spawn(|| {
                refuse_membarrier_on_this_thread();
                swapped.swap(1);
            })
            .join()
            .unwrap();
        assert!(!membarrier_refused(), "refused on the other thread only");

        let before = process_live_bytes();
        swapped.swap(SWAPS);
        let kept = process_live_bytes() - before;
        drop(release);
        kept
    });
    assert!(
        kept < 2 * filter_bytes,
        "{kept} bytes kept after {SWAPS} swaps of a {filter_bytes}-byte filter, with a thread \
         parked since before the turn"
    );
    for key in stored.iter().step_by(97) {
        assert_ne!(guard.check(key), Verdict::Absent, "{key}");
    }
}
