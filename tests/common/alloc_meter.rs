//! A global allocator that measures one thread's allocations while asked to:
//! how many calls, and the peak of live bytes above the starting point; and
//! the bytes the whole process holds, at any time.
//!
//! Kept by hand (no crate measures per-thread peaks this way): a test binary
//! installs it with `#[global_allocator] static A: AllocMeter = AllocMeter;`
//! and wraps the code under test in [`measure`].
//!
//! Asked to ([`zero_large_blocks_when_freed`]), it also zeroes every block
//! of a page or more before freeing it: a check that reads a filter after it
//! was freed then finds no bit set and answers `Absent`, which the tests
//! assert against. Without that, a freed filter usually keeps its bits (the
//! system allocator leaves a large block as it was, or hands it to the next
//! filter of the same keys), and such a read answers right by luck.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};

/// Forwards to the system allocator, counting on the measuring thread.
#[derive(Debug)]
pub(crate) struct AllocMeter;

/// What [`measure`] saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Measured {
    /// Calls of `alloc`, `alloc_zeroed` and growing `realloc`.
    pub(crate) allocations: usize,
    /// The most bytes this thread held at once, above what it held at the start.
    pub(crate) peak_bytes: usize,
}

#[derive(Clone, Copy)]
struct Meter {
    allocations: usize,
    live: isize,
    peak: isize,
}

thread_local! {
    static METER: Cell<Option<Meter>> = const { Cell::new(None) };
}

/// Bytes held by the whole process through this allocator, every thread.
static PROCESS_LIVE: AtomicIsize = AtomicIsize::new(0);

/// Whether blocks of [`ZEROED_FROM`] bytes or more are zeroed before they are freed.
static ZERO_LARGE_BLOCKS: AtomicBool = AtomicBool::new(false);
const ZEROED_FROM: usize = 4_096;

/// From now on, blocks of a page or more are zeroed before they are freed.
pub(crate) fn zero_large_blocks_when_freed() {
    ZERO_LARGE_BLOCKS.store(true, Ordering::Relaxed);
}

/// The bytes every thread holds now through the meter (since the binary began).
pub(crate) fn process_live_bytes() -> isize {
    PROCESS_LIVE.load(Ordering::Relaxed)
}

fn note(allocations: usize, bytes: isize) {
    PROCESS_LIVE.fetch_add(bytes, Ordering::Relaxed);
    let _ = METER.try_with(|meter| {
        if let Some(mut m) = meter.get() {
            m.allocations += allocations;
            m.live += bytes;
            m.peak = m.peak.max(m.live);
            meter.set(Some(m));
        }
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; the
// additions are a thread-local counter, which does not allocate, and zeroing
// a block the caller is freeing.
unsafe impl GlobalAlloc for AllocMeter {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(1, layout.size() as isize);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(1, layout.size() as isize);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(0, -(layout.size() as isize));
        if layout.size() >= ZEROED_FROM && ZERO_LARGE_BLOCKS.load(Ordering::Relaxed) {
            // SAFETY: the caller owns the block's `layout.size()` bytes until
            // it is freed below.
            unsafe { ptr.write_bytes(0, layout.size()) };
        }
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let grows = usize::from(new_size > layout.size());
        note(grows, new_size as isize - layout.size() as isize);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

/// Runs `body`, measuring what this thread allocates meanwhile.
pub(crate) fn measure<T>(body: impl FnOnce() -> T) -> (T, Measured) {
    METER.with(|meter| {
        meter.set(Some(Meter {
            allocations: 0,
            live: 0,
            peak: 0,
        }))
    });
    let output = body();
    let meter = METER.with(|meter| meter.take().expect("measuring was on"));
    (
        output,
        Measured {
            allocations: meter.allocations,
            peak_bytes: meter.peak.max(0) as usize,
        },
    )
}
