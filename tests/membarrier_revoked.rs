//! A process whose `membarrier(2)` stops answering after its read sections
//! began relying on it (a seccomp profile applied once the service is up, or
//! a kernel out of memory for the expedited command). Threads that claimed
//! their records before then open sections with no fence, which only that
//! barrier paired with. A binary of its own: a process picks its barrier
//! when it builds its first guard.

#![cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64"),
    feature = "guard"
))]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Barrier, mpsc};

use bloomguard::Verdict;
use common::StopOnDrop;
use common::alloc_meter::{AllocMeter, process_live_bytes};
use common::membarrier::{
    SwappedGuard, membarrier_refused, refuse_membarrier, require_private_expedited,
};

#[global_allocator]
static ALLOCATOR: AllocMeter = AllocMeter;

/// Swaps while a parked thread, which checked before the refusal, has not
/// checked since; then swaps after it has.
const SWAPS_HELD: usize = 10;
const SWAPS_FREED: usize = 30;

/// Checkers claim their records while `membarrier` serves; so do an
/// inserter (which only counts, never opens a section), this thread and a
/// thread that then parks. Then `membarrier` is refused and the live filter
/// is swapped 40 times under them, and a new checker starts. No stored key
/// is answered `Absent`; nothing is freed while the parked thread has not
/// checked again (its sections could still be open without a fence, as far
/// as a reclaim can know; this thread cannot play that part, as the swaps'
/// own inserts acknowledge the turn); once it has, the replaced filters are
/// freed while the others keep checking and inserting. Before, no reclaim after the refusal freed
/// anything: each swap kept its replaced filter for the life of the process.
#[test]
fn after_membarrier_is_refused_checks_stay_correct_and_replaced_filters_are_freed() {
    require_private_expedited();
    let swapped = SwappedGuard::new();
    let (guard, stored, filter_bytes) = (&swapped.guard, &swapped.stored, swapped.filter_bytes);
    assert!(
        !membarrier_refused(),
        "this host refuses membarrier already"
    );
    // This thread holds its record from here on, made while membarrier serves.
    assert_ne!(guard.check(&stored[0]), Verdict::Absent);
    swapped.swap(1);
    let before = process_live_bytes();

    let stop = AtomicBool::new(false);
    let started = Barrier::new(5);
    // Channels, not barriers: if either side panics, the other's `recv` returns.
    let (recheck, told_to_recheck) = mpsc::channel::<()>();
    let (rechecked, heard_rechecked) = mpsc::channel::<()>();
    let check_until_stopped =
        |first, after_first: &dyn Fn()| swapped.check_until(first, &stop, after_first);
    let (held, kept) = std::thread::scope(|scope| {
        // Owned by this closure, so that its unwinding drops it and the
        // parked thread's `recv` returns.
        let recheck = recheck;
        scope.spawn(|| check_until_stopped(0, &|| _ = started.wait()));
        scope.spawn(|| check_until_stopped(1, &|| _ = started.wait()));
        scope.spawn(|| {
            for n in 0u64.. {
                guard.insert(format!("inserted:{}", n % 100_000));
                if n == 0 {
                    started.wait();
                }
                if n.is_multiple_of(64) && stop.load(Ordering::Relaxed) {
                    break;
                }
            }
        });
        let started = &started;
        scope.spawn(move || {
            let first = guard.check(&stored[2]);
            started.wait();
            assert_ne!(first, Verdict::Absent);
            if told_to_recheck.recv().is_ok() {
                // This thread's sections fence from now on.
                assert_ne!(guard.check(&stored[3]), Verdict::Absent);
                rechecked.send(()).unwrap();
            }
        });
        let _stop = StopOnDrop(&stop);
        // Every thread has its record, made under membarrier.
        started.wait();
        refuse_membarrier();
        swapped.swap(SWAPS_HELD);
        let held = process_live_bytes() - before;
        recheck.send(()).unwrap();
        heard_rechecked.recv().unwrap();
        assert_ne!(guard.check(&stored[1]), Verdict::Absent);
        // A thread started now fences from its first section.
        scope.spawn(|| check_until_stopped(stored.len() / 2, &|| {}));
        swapped.swap(SWAPS_FREED - 10);
        // The least kept over the last ten swaps: a checker descheduled
        // mid-section holds back the reclaims while it is off the CPU.
        let kept = (0..10)
            .map(|_| {
                swapped.swap(1);
                process_live_bytes() - before
            })
            .min()
            .unwrap();
        (held, kept)
    });
    assert!(
        held > (SWAPS_HELD as isize / 2) * filter_bytes,
        "{held} bytes kept: freed while a thread's sections were unfenced"
    );
    assert!(
        kept < (SWAPS_FREED as isize / 2) * filter_bytes,
        "{kept} bytes kept after {SWAPS_FREED} more swaps of a {filter_bytes}-byte filter \
         under running checks"
    );
    swapped.swap(1);
    let grown = process_live_bytes() - before;

    assert!(
        grown < 2 * filter_bytes,
        "{grown} bytes more after {} swaps of a {filter_bytes}-byte filter",
        SWAPS_HELD + SWAPS_FREED + 1
    );
}
