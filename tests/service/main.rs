//! The tower layers and the axum example over real HTTP, and the allocation-free absent path.
//!
//! One test binary per area (one link instead of one per file); each file
//! is a module, and `common` is the support they share.

#[path = "../common/mod.rs"]
mod common;

/// Counts allocations for the tests that measure them (`common::alloc_meter`).
#[global_allocator]
static ALLOCATOR: common::alloc_meter::AllocMeter = common::alloc_meter::AllocMeter;

mod allocations;
#[cfg(feature = "metrics")]
mod axum_service;
mod layer;
#[cfg(feature = "axum")]
mod wiring;
