//! Filter benchmarks (in progress).
fn main() {}
