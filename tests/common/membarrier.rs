//! Makes this process a host where `membarrier(2)` is refused, as a seccomp
//! profile does: the kernel then answers every call with `EPERM`.

/// `AUDIT_ARCH_*` of the build's target (linux/audit.h), which a seccomp
/// filter must check before it trusts a system call's number.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xC000_003E;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xC000_00B7;

/// Installs, on every thread of the process (and those it starts later), a
/// filter that fails `membarrier` with `EPERM` and allows every other call.
pub(crate) fn refuse_membarrier() {
    install_refusal(libc::SECCOMP_FILTER_FLAG_TSYNC);
}

/// The same filter on the calling thread alone (and threads it starts
/// later), as a sandboxed worker thread has it.
#[allow(dead_code)] // not every binary that shares this module refuses on one thread
pub(crate) fn refuse_membarrier_on_this_thread() {
    install_refusal(0);
}

fn install_refusal(flags: libc::c_ulong) {
    const NR: u32 = 0; // offset of `seccomp_data.nr`
    const ARCH: u32 = 4; // offset of `seccomp_data.arch`
    let load = |offset| libc::sock_filter {
        code: (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16,
        jt: 0,
        jf: 0,
        k: offset,
    };
    let jump_if_equal = |value, jt, jf| libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k: value,
    };
    let answer = |action| libc::sock_filter {
        code: (libc::BPF_RET | libc::BPF_K) as u16,
        jt: 0,
        jf: 0,
        k: action,
    };
    let mut program = [
        load(ARCH),
        jump_if_equal(AUDIT_ARCH, 1, 0),
        answer(libc::SECCOMP_RET_ALLOW),
        load(NR),
        jump_if_equal(libc::SYS_membarrier as u32, 0, 1),
        answer(libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        answer(libc::SECCOMP_RET_ALLOW),
    ];
    let filter = libc::sock_fprog {
        len: program.len() as u16,
        filter: program.as_mut_ptr(),
    };
    // SAFETY: prctl with integer arguments; seccomp reads `filter`, which
    // points to `program`, both alive for the call.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                flags,
                &filter as *const libc::sock_fprog,
            ),
            0,
            "seccomp filter: {}",
            std::io::Error::last_os_error()
        );
    }
    assert!(membarrier_refused(), "membarrier still answers");
}

/// Whether `membarrier`'s query command fails with `EPERM` now.
pub(crate) fn membarrier_refused() -> bool {
    query() == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Fails the test unless the kernel offers what bloomguard's read sections
/// pick when they can (the private expedited command and its registration,
/// Linux 4.14+): without it the process would start on fences, and a test
/// of what happens when that command stops answering would test nothing.
pub(crate) fn require_private_expedited() {
    const NEEDED: libc::c_long = (1 << 3) | (1 << 4);
    let offered = query();
    assert!(
        offered >= 0 && offered & NEEDED == NEEDED,
        "this test needs membarrier(2) MEMBARRIER_CMD_PRIVATE_EXPEDITED (Linux 4.14+); \
         the kernel answered {offered} to MEMBARRIER_CMD_QUERY"
    );
}

fn query() -> libc::c_long {
    // SAFETY: the query command (0) with flags 0 reads and writes no memory.
    unsafe { libc::syscall(libc::SYS_membarrier, 0, 0) }
}

/// A guard over 20,000 stored keys that a test swaps under checks, sized
/// so that each replaced filter shows in the process's live bytes. Its
/// binary installs [`AllocMeter`](super::alloc_meter::AllocMeter), which
/// zeroes a filter as it is freed, so that a check reading one after that
/// answers `Absent` for a stored key.
pub(crate) struct SwappedGuard {
    pub(crate) guard: bloomguard::Guard,
    pub(crate) stored: Vec<String>,
    /// Bytes of one live filter.
    pub(crate) filter_bytes: isize,
    /// Runs the rebuilds on the test's own thread.
    runtime: tokio::runtime::Runtime,
}

impl SwappedGuard {
    /// Built and serving (one rebuild done).
    pub(crate) fn new() -> Self {
        super::alloc_meter::zero_large_blocks_when_freed();
        let stored = super::keys(0, 20_000);
        let listed = stored.clone();
        let guard = bloomguard::Guard::builder()
            .expected_items(500_000)
            .seed(11)
            .source(bloomguard::source::from_fn(move || listed.clone()))
            .build()
            .unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(guard.rebuild()).unwrap();
        let filter_bytes = guard.stats().memory_bytes as isize;
        Self {
            guard,
            stored,
            filter_bytes,
            runtime,
        }
    }

    /// Swaps the live filter `times` times (a rebuild each), letting the
    /// checkers run a while on each set.
    pub(crate) fn swap(&self, times: usize) {
        for _ in 0..times {
            self.runtime.block_on(self.guard.rebuild()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }

    /// Checks the stored keys from the `first`th on, round and round, until
    /// `stop` is set, asserting that none is answered `Absent`; calls
    /// `after_first` once the first is checked, before asserting on it (a
    /// barrier there must not wait for a thread that panicked).
    pub(crate) fn check_until(
        &self,
        first: usize,
        stop: &std::sync::atomic::AtomicBool,
        after_first: impl FnOnce(),
    ) {
        let mut after_first = Some(after_first);
        let mut count = 0u64;
        for key in self.stored.iter().cycle().skip(first) {
            let verdict = self.guard.check(key);
            if let Some(after_first) = after_first.take() {
                after_first();
            }
            assert_ne!(verdict, bloomguard::Verdict::Absent, "{key}");
            count += 1;
            if count.is_multiple_of(1_024) && stop.load(std::sync::atomic::Ordering::Relaxed) {
                break;
            }
        }
    }

    /// Swaps the live filter `swaps` times while `checkers` threads check
    /// the stored keys (each from its own offset, asserting none is
    /// answered `Absent`). The swaps begin once every checker has checked
    /// a key, and the checkers stop after the last: every swap runs under
    /// checks.
    fn swap_under_checks(&self, checkers: usize, swaps: usize) {
        let stop = std::sync::atomic::AtomicBool::new(false);
        let started = std::sync::Barrier::new(checkers + 1);
        std::thread::scope(|scope| {
            for checker in 0..checkers {
                let first = checker * self.stored.len() / checkers;
                let (stop, started) = (&stop, &started);
                scope.spawn(move || self.check_until(first, stop, || _ = started.wait()));
            }
            let _stop = super::StopOnDrop(&stop);
            started.wait();
            self.swap(swaps);
        });
    }

    /// Swaps `swaps` times under `checkers` checking threads (see
    /// [`swap_under_checks`](Self::swap_under_checks)), then once with none
    /// running, whose reclaim frees whatever the earlier ones had to leave
    /// to it; asserts that the replaced filters were freed (a reclaim that never freed would hold all of them).
    pub(crate) fn assert_swaps_under_checks_free_what_they_replace(
        &self,
        checkers: usize,
        swaps: usize,
    ) {
        // Settles allocations made once (the first reclaim's list, thread records).
        self.swap(1);
        let before = super::alloc_meter::process_live_bytes();
        self.swap_under_checks(checkers, swaps);
        self.swap(1);
        let grown = super::alloc_meter::process_live_bytes() - before;

        let filter_bytes = self.filter_bytes;
        assert!(
            grown < 2 * filter_bytes,
            "{grown} bytes more after {swaps} swaps of a {filter_bytes}-byte filter"
        );
    }
}
