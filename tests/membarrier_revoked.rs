//! A process whose `membarrier(2)` stops answering after its read sections
//! began relying on it (a seccomp profile applied once the service is up, or
//! a kernel out of memory for the expedited command). Threads that checked
//! before then open sections with no fence, which only that barrier paired
//! with. A binary of its own: a process picks its barrier at its first check.

#![cfg(all(
    target_os = "linux",
    any(target_arch = "x86_64", target_arch = "aarch64"),
    feature = "guard"
))]

mod common;

use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bloomguard::{Guard, Verdict, source};
use common::alloc_meter::{AllocMeter, process_live_bytes};
use common::keys;
use common::membarrier::{membarrier_refused, refuse_membarrier};

#[global_allocator]
static ALLOCATOR: AllocMeter = AllocMeter;

const REBUILDS: usize = 40;

/// Checkers that started while `membarrier` served keep checking through 40
/// swaps after it is refused: no stored key is answered `Absent`, nothing is
/// freed while a thread that checked before the refusal has not checked
/// since, and the replaced filters are freed once each such thread has
/// checked again or exited. Before, every reclaim after the refusal freed
/// nothing: each swap kept its replaced filter for the life of the process.
#[test]
fn after_membarrier_is_refused_checks_stay_correct_and_replaced_filters_are_freed() {
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
    assert!(
        !membarrier_refused(),
        "this host refuses membarrier already"
    );
    // This thread's first check picks the barrier while membarrier serves.
    assert_ne!(guard.check(&stored[0]), Verdict::Absent);
    let filter_bytes = guard.stats().memory_bytes as isize;
    runtime.block_on(guard.rebuild()).unwrap();
    let before = process_live_bytes();

    let stop = AtomicBool::new(false);
    let checked = AtomicU64::new(0);
    let started = Barrier::new(3);
    std::thread::scope(|scope| {
        for first in [0, stored.len() / 2] {
            let (guard, stored, stop, checked, started) =
                (&guard, &stored, &stop, &checked, &started);
            scope.spawn(move || {
                let mut count = 0u64;
                for key in stored.iter().cycle().skip(first) {
                    assert_ne!(guard.check(key), Verdict::Absent, "{key}");
                    count += 1;
                    if count == 1 {
                        started.wait();
                    }
                    if count.is_multiple_of(1_024) && stop.load(Ordering::Relaxed) {
                        break;
                    }
                }
                checked.fetch_add(count, Ordering::Relaxed);
            });
        }
        // Both checkers have made their records under membarrier.
        started.wait();
        refuse_membarrier();
        for _ in 0..REBUILDS {
            runtime.block_on(guard.rebuild()).unwrap();
            std::thread::sleep(Duration::from_millis(2));
        }
        stop.store(true, Ordering::Relaxed);
    });
    // This thread checked before the refusal and not since: a section of
    // its own could still be open with no fence, as far as a reclaim can
    // know, so nothing has been freed yet.
    let kept = process_live_bytes() - before;
    assert!(
        kept > (REBUILDS as isize / 2) * filter_bytes,
        "{kept} bytes kept: freed while a thread's sections were unfenced"
    );
    // The checkers have exited; this thread checks again (its sections
    // fence from now on).
    assert_ne!(guard.check(&stored[1]), Verdict::Absent);
    runtime.block_on(guard.rebuild()).unwrap();
    let grown = process_live_bytes() - before;

    assert!(checked.load(Ordering::Relaxed) > 0);
    assert!(
        grown < 2 * filter_bytes,
        "{grown} bytes more after {REBUILDS} swaps of a {filter_bytes}-byte filter"
    );
}
