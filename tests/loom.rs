//! Model checks of the filter's concurrent paths under every interleaving loom
//! explores. Run with (`--lib` adds the models beside the read sections and
//! the insert/rebuild handshake in `src/guard`):
//!
//! ```text
//! RUSTFLAGS="--cfg bloomguard_loom" CARGO_TARGET_DIR=target/loom cargo test --release --lib --test loom
//! ```
#![cfg(bloomguard_loom)]

use bloomguard::{AtomicBloom, FilterBuilder};
use loom::sync::Arc;
use loom::thread;

fn one_block_filter() -> AtomicBloom {
    // One block and five probes: the two keys' bits share words, so the
    // threads' read-modify-writes really race. (Checked: an insert that does
    // load-then-store instead of fetch_or fails this model.)
    FilterBuilder::with_params(512, 5).seed(7).build().unwrap()
}

/// Every interleaving with up to two preemptions: enough to put a racing
/// write between any read and read-modify-write pair of the other thread.
fn model(body: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(body);
}

#[test]
fn racing_inserts_lose_no_key_and_count_every_bit_once() {
    model(|| {
        let filter = Arc::new(one_block_filter());
        let writers: Vec<_> = ["left", "right"]
            .into_iter()
            .map(|key| {
                let filter = Arc::clone(&filter);
                thread::spawn(move || {
                    filter.insert(key);
                    assert!(filter.contains(key), "a thread sees its own insert");
                })
            })
            .collect();
        for writer in writers {
            writer.join().unwrap();
        }
        assert!(filter.contains("left") && filter.contains("right"));
        let recount = AtomicBloom::from_bytes(&filter.to_bytes())
            .unwrap()
            .stats()
            .set_bits;
        assert_eq!(filter.stats().set_bits, recount);
    });
}

#[test]
fn a_reader_after_join_always_sees_the_insert() {
    model(|| {
        let filter = Arc::new(one_block_filter());
        let writer = {
            let filter = Arc::clone(&filter);
            thread::spawn(move || filter.insert("key"))
        };
        let reader = {
            let filter = Arc::clone(&filter);
            // Concurrent with the insert: either answer is allowed, but the call must not tear.
            thread::spawn(move || filter.contains("other"))
        };
        writer.join().unwrap();
        reader.join().unwrap();
        assert!(filter.contains("key"));
    });
}
