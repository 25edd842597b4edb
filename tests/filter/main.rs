//! The filter itself: accuracy against its target, many threads at once, parameters, hostile input, the one rule, snapshots.
//!
//! One test binary per area (one link instead of one per file); each file
//! is a module, and `common` is the support they share.

#[path = "../common/mod.rs"]
mod common;

/// Counts allocations for the tests that measure them (`common::alloc_meter`).
#[global_allocator]
static ALLOCATOR: common::alloc_meter::AllocMeter = common::alloc_meter::AllocMeter;

mod accuracy;
mod concurrency;
mod config;
mod hostile_input;
mod no_false_negatives;
mod snapshot;
