//! Many threads insert and query one filter at once, without a lock.

use std::sync::atomic::{AtomicBool, Ordering};

use bloomguard::AtomicBloom;

#[test]
fn concurrent_writers_lose_nothing_while_readers_query() {
    const WRITERS: u64 = 4;
    const PER_WRITER: u64 = 50_000;
    let filter = AtomicBloom::with_seed(WRITERS * PER_WRITER, 0.01, 11).unwrap();
    let key_sets: Vec<Vec<String>> = (0..WRITERS)
        .map(|w| crate::common::keys(w * PER_WRITER, PER_WRITER))
        .collect();
    let writing = AtomicBool::new(true);

    std::thread::scope(|s| {
        let writers: Vec<_> = key_sets
            .iter()
            .map(|keys| {
                let filter = &filter;
                s.spawn(move || {
                    for key in keys {
                        filter.insert(key);
                        // A key this thread inserted is visible to it at once.
                        assert!(filter.contains(key));
                    }
                })
            })
            .collect();
        for _ in 0..2 {
            s.spawn(|| {
                let probes = crate::common::absent_keys(0, 10_000);
                let mut rounds = 0;
                while writing.load(Ordering::Relaxed) || rounds == 0 {
                    let mut found = vec![false; probes.len()];
                    filter.contains_many(&probes, &mut found);
                    rounds += 1;
                }
            });
        }
        for writer in writers {
            writer.join().unwrap();
        }
        writing.store(false, Ordering::Relaxed);
    });

    for keys in &key_sets {
        assert!(keys.iter().all(|key| filter.contains(key)));
    }
    // Striped counting lost no bit either: it matches a recount of the payload.
    let recount = AtomicBloom::from_bytes(&filter.to_bytes())
        .unwrap()
        .stats()
        .set_bits;
    assert_eq!(filter.stats().set_bits, recount);
}

#[test]
fn overlapping_writers_count_each_bit_once() {
    let filter = AtomicBloom::with_seed(100_000, 0.01, 12).unwrap();
    let keys = crate::common::keys(0, 100_000);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| keys.iter().for_each(|key| _ = filter.insert(key)));
        }
    });
    let recount = AtomicBloom::from_bytes(&filter.to_bytes())
        .unwrap()
        .stats()
        .set_bits;
    assert_eq!(filter.stats().set_bits, recount);
    assert!(keys.iter().all(|key| filter.contains(key)));
}

#[test]
fn filter_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<AtomicBloom>();
}
