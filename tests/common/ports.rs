//! Loopback ports for the servers the tests start and stop.

/// A free loopback port below the kernel's range for outgoing connections
/// (`ip_local_port_range`, 32768 and up by default), where a test may stop
/// its server and start it again. A port from that range (what binding port
/// 0 gives) can be taken while the server is down by a client reconnecting
/// to it: Linux may give the client that very port as its own end, and the
/// client then connects to itself, after which the restarted server cannot
/// bind. With `with_bus`, the port 10000 above it (Redis Cluster's bus) is
/// free too and below the same range.
///
/// Picks go round a per-process sequence starting at a place set by the
/// process id, so that parallel tests in one binary never pick the same
/// port and test binaries rarely do; a port another process holds fails
/// the bind here and is skipped. A server that still finds its port taken
/// (a race with another process) fails to start and says so.
pub(crate) fn free_loopback_port(with_bus: bool) -> u16 {
    use std::net::TcpListener;
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 10_000;
    const SPAN: u32 = 12_000; // up to 22000, its bus up to 32000
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(2_654_435_761) % SPAN,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..SPAN {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN) as u16;
        let free = |port: u16| TcpListener::bind(("127.0.0.1", port)).is_ok();
        if free(port) && (!with_bus || free(port + 10_000)) {
            return port;
        }
    }
    panic!("no free loopback port between {FIRST} and {}", FIRST + SPAN)
}
