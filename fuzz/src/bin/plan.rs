//! Sizing parameters: any items, rate and budget. A plan either is refused
//! with a `ConfigError` or meets its target; building never panics and never
//! exceeds the budget.

fn main() {
    afl::fuzz!(|bytes: &[u8]| {
        let Some((items, rest)) = bytes.split_first_chunk::<8>() else { return };
        let Some((rate, rest)) = rest.split_first_chunk::<8>() else { return };
        let items = u64::from_le_bytes(*items);
        let rate = f64::from_le_bytes(*rate);
        let budget = rest.first().map_or(1 << 20, |b| 1u64 << (b % 24));
        if let Ok(plan) = bloomguard::plan(items, rate) {
            // Past 2^64 bits the blocks are capped, as `plan` documents.
            use bloomguard::filter::BLOCK_BITS;
            let capped = plan.bits >= u64::MAX / BLOCK_BITS * BLOCK_BITS;
            assert!(capped || plan.predicted_fpr <= rate, "{plan:?}");
        }
        if let Ok(filter) = bloomguard::FilterBuilder::for_items(items, rate).max_bytes(budget).build() {
            assert!(filter.memory_bytes() as u64 >= budget.min(64));
            assert!((filter.bits() / 8) <= budget);
        }
    });
}
