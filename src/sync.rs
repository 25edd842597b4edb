//! The one place the crate takes its atomic types from, so that a `loom` model
//! (built with `RUSTFLAGS="--cfg loom"`) can swap in its checked versions.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicU64, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicU64, Ordering, fence};
