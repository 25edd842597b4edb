//! Snapshot decoding: any bytes, through `from_bytes` and `read_from`. A
//! decode either fails with a `DecodeError` or yields the filter those very
//! bytes encode; it never panics, and never holds more than the input.

fn main() {
    afl::fuzz!(|bytes: &[u8]| {
        let whole = bloomguard::AtomicBloom::from_bytes(bytes);
        if let Ok(filter) = &whole {
            assert_eq!(filter.to_bytes(), bytes, "a decoded snapshot re-encodes to its bytes");
        }
        // A small budget, as a caller reading untrusted bytes would set.
        let streamed = bloomguard::AtomicBloom::read_from_with_max_bytes(bytes, 1 << 24);
        if whole.is_ok() && bytes.len() < 1 << 24 {
            assert!(streamed.is_ok(), "read_from refused what from_bytes took");
        }
    });
}
