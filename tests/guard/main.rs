//! The guard and what reads it without tower: lifecycle, the loader, product modes, metrics.
//!
//! One test binary per area (one link instead of one per file); each file
//! is a module, and `common` is the support they share.

#[path = "../common/mod.rs"]
mod common;

mod guard;
mod loader;
#[cfg(feature = "metrics")]
mod metrics;
mod verify;
