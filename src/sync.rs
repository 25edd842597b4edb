//! The one place the crate takes its atomic types from, so that a `loom` model
//! (built with `RUSTFLAGS="--cfg bloomguard_loom"`) can swap in its checked versions.

#[cfg(bloomguard_loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering, fence};
#[cfg(all(not(bloomguard_loom), feature = "guard"))]
pub(crate) use std::sync::atomic::fence;
#[cfg(not(bloomguard_loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};

#[cfg(bloomguard_loom)]
pub(crate) use loom::sync::Mutex;
#[cfg(bloomguard_loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicPtr};
#[cfg(all(not(bloomguard_loom), feature = "guard"))]
pub(crate) use std::sync::Mutex;
#[cfg(all(not(bloomguard_loom), feature = "guard"))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicPtr};

#[cfg(all(not(bloomguard_loom), feature = "guard"))]
pub(crate) use process_barrier::{
    heavy as heavy_barrier, light as light_barrier, light_is_enough as light_barrier_is_enough,
};

/// Takes a lock whether or not an earlier holder panicked. Every lock in
/// this crate guards data its holders leave whole (a value replaced in one
/// assignment, a list pushed to or filtered, a histogram recorded into), so
/// the poison carries nothing worth failing a check or a rebuild for.
#[cfg(feature = "guard")]
pub(crate) fn unpoisoned<G>(locked: std::sync::LockResult<G>) -> G {
    locked.unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// What the reclaiming side's barrier ordered.
#[cfg(feature = "guard")]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HeavyBarrier {
    /// Every thread of the process ran a full barrier (`membarrier`): it
    /// pairs with sections that fence and sections that do not alike.
    EveryThread,
    /// Only the calling thread fenced: it pairs with sections that fence.
    ThisThread,
}

/// Asymmetric barriers for read sections (`guard::sections`): the reading
/// side's `light` pairs with the reclaiming side's `heavy` as two `SeqCst`
/// fences would. On Linux with `membarrier(2)`'s private expedited command
/// (4.14+), `heavy` makes every running thread of the process execute a
/// full barrier, so `light` is a compiler fence; elsewhere both are fences.
/// Which one `light` is, each reader's record says (from [`light_is_enough`]
/// when the record is made, until a turn below): a byte on a line the check
/// touches anyway, not a global loaded on every check.
///
/// Should `membarrier` fail after it was chosen (a seccomp profile applied
/// later, or the kernel out of memory for the expedited command), the
/// process turns its readers to fences for good: `heavy` says it ordered
/// only its own thread, and the reclaimer waits for every record to fence
/// its sections (see `guard::sections`). Each later `heavy` still tries
/// `membarrier`, which may serve again (the failure was one thread's: a
/// filter installed on it alone; or the kernel's memory came back): a
/// barrier that reaches every thread needs no record to have fenced.
/// Kept here: the `membarrier` crate links Windows libraries on Linux.
#[cfg(all(not(bloomguard_loom), feature = "guard"))]
mod process_barrier {
    use std::sync::atomic::{AtomicU8, Ordering, compiler_fence, fence};

    use super::HeavyBarrier;

    const UNDECIDED: u8 = 0;
    const MEMBARRIER: u8 = 1;
    const FENCES: u8 = 2;
    /// Readers fence, as with `FENCES`, after a `membarrier` failed; the
    /// process is still registered for it, and reclaims still try it.
    const TURNED: u8 = 3;

    static STRATEGY: AtomicU8 = AtomicU8::new(UNDECIDED);

    /// The reading side: `light_is_enough` is what the reader's record says.
    #[inline]
    pub(crate) fn light(light_is_enough: bool) {
        if light_is_enough {
            compiler_fence(Ordering::SeqCst);
        } else {
            fence(Ordering::SeqCst);
        }
    }

    /// Whether `membarrier` serves, so that `light` may be a compiler fence
    /// (decided on the first call; `false` for good after a turn, even
    /// where a later `membarrier` serves: a record made then would not
    /// fence, and the next failure would find it unfenced).
    pub(crate) fn light_is_enough() -> bool {
        strategy() == MEMBARRIER
    }

    /// The reclaiming side's barrier. A failed `membarrier` turns the
    /// process to fences (before this one), so that records made from then
    /// on fence their sections.
    #[must_use]
    pub(crate) fn heavy() -> HeavyBarrier {
        let strategy = strategy();
        if strategy == MEMBARRIER || strategy == TURNED {
            if membarrier::private_expedited() {
                return HeavyBarrier::EveryThread;
            }
            if STRATEGY
                .compare_exchange(MEMBARRIER, TURNED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                tracing::warn!(
                    error = %std::io::Error::last_os_error(),
                    "membarrier(2) failed after it was chosen: read sections fence from now on, \
                     and while it fails, replaced filters are freed once every thread that used \
                     a guard before has used one again or exited"
                );
            }
        }
        // SeqCst: pairs with the readers' fences, and orders the switch above
        // before the reclaimer's reads of the records.
        fence(Ordering::SeqCst);
        HeavyBarrier::ThisThread
    }

    /// Decides once whether `membarrier` serves (registering the process
    /// for it); only a failure in `heavy` changes it, to fences, for good.
    fn strategy() -> u8 {
        let decided = STRATEGY.load(Ordering::Acquire);
        if decided != UNDECIDED {
            return decided;
        }
        let chosen = if membarrier::register() {
            MEMBARRIER
        } else {
            FENCES
        };
        match STRATEGY.compare_exchange(UNDECIDED, chosen, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => chosen,
            Err(first) => first,
        }
    }

    #[cfg(target_os = "linux")]
    mod membarrier {
        // From linux/include/uapi/linux/membarrier.h.
        const QUERY: libc::c_int = 0;
        const GLOBAL: libc::c_int = 1;
        const PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
        const REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

        fn membarrier(command: libc::c_int) -> libc::c_long {
            // SAFETY: membarrier(2) takes a command and flags (0), touches no
            // memory of ours, and reports failure in its return value.
            unsafe { libc::syscall(libc::SYS_membarrier, command, 0 as libc::c_int) }
        }

        pub(super) fn register() -> bool {
            let supported = membarrier(QUERY);
            let needed = libc::c_long::from(PRIVATE_EXPEDITED | REGISTER_PRIVATE_EXPEDITED);
            supported >= 0
                && supported & needed == needed
                && membarrier(REGISTER_PRIVATE_EXPEDITED) == 0
        }

        /// A barrier on every thread of the process; `false` if none
        /// could be made (the registered command failed, and so did the
        /// global one, which needs no registration but waits for a grace
        /// period of the whole system).
        pub(super) fn private_expedited() -> bool {
            membarrier(PRIVATE_EXPEDITED) == 0 || membarrier(GLOBAL) == 0
        }
    }

    #[cfg(not(target_os = "linux"))]
    mod membarrier {
        pub(super) fn register() -> bool {
            false
        }

        pub(super) fn private_expedited() -> bool {
            unreachable!("never chosen without Linux");
        }
    }
}

/// Under loom a model's process starts with fences on both sides, the
/// pairing `membarrier` gives, which loom can check. A model that sets
/// [`loom_strategy::STRATEGY`] to `MEMBARRIER` first gets records whose
/// sections do not fence, and a heavy barrier that always fails and turns
/// the process to fences: a `membarrier` that fails after it was chosen.
#[cfg(bloomguard_loom)]
pub(crate) mod loom_strategy {
    pub(crate) const MEMBARRIER: u8 = 1;
    pub(crate) const FENCES: u8 = 2;

    loom::lazy_static! {
        /// Reset for every execution of a model.
        pub(crate) static ref STRATEGY: loom::sync::atomic::AtomicU8 =
            loom::sync::atomic::AtomicU8::new(FENCES);
    }
}

#[cfg(bloomguard_loom)]
pub(crate) fn light_barrier(light_is_enough: bool) {
    if !light_is_enough {
        fence(Ordering::SeqCst);
    }
}

#[cfg(bloomguard_loom)]
pub(crate) fn light_barrier_is_enough() -> bool {
    loom_strategy::STRATEGY.load(Ordering::Acquire) == loom_strategy::MEMBARRIER
}

#[cfg(bloomguard_loom)]
pub(crate) fn heavy_barrier() -> HeavyBarrier {
    use loom_strategy::{FENCES, MEMBARRIER, STRATEGY};
    if STRATEGY.load(Ordering::Acquire) == MEMBARRIER {
        // The model's membarrier fails: the process turns, as in `process_barrier::heavy`.
        let _ = STRATEGY.compare_exchange(MEMBARRIER, FENCES, Ordering::AcqRel, Ordering::Acquire);
    }
    fence(Ordering::SeqCst);
    HeavyBarrier::ThisThread
}

#[cfg(bloomguard_loom)]
pub(crate) use loom::thread::yield_now;
#[cfg(all(not(bloomguard_loom), feature = "guard"))]
pub(crate) use std::thread::yield_now;
