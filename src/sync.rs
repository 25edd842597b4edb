//! The one place the crate takes its atomic types from, so that a `loom` model
//! (built with `RUSTFLAGS="--cfg bloomguard_loom"`) can swap in its checked versions.

#[cfg(bloomguard_loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering, fence};
#[cfg(all(not(bloomguard_loom), feature = "guard"))]
pub(crate) use std::sync::atomic::fence;
#[cfg(not(bloomguard_loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering};
