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
                libc::SECCOMP_FILTER_FLAG_TSYNC,
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
