#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod error;
pub mod filter;
pub mod guard;
pub mod layer;
pub mod loader;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
mod stats;
mod sync;
mod task;
pub mod verify;

pub use error::{ConfigError, DecodeError, FilterParameter, IncompatibleFilters, StillWarming};
pub use filter::{AtomicBloom, FORMAT_VERSION, FilterBuilder, FilterStats, Plan, plan};
pub use guard::source::{self, KeySource, SourceError};
pub use guard::{
    Guard, GuardBuilder, GuardReader, GuardStats, Lifecycle, LiveFilters, MaintenanceHandle,
    PendingWrite, RebuildError, RebuildOutcome, RebuildPolicy, RebuildReport, Verdict,
};
pub use layer::{GuardLayer, GuardService, InsertLayer, InsertService};
pub use loader::{GuardedLoader, Loader};
pub use verify::Verify;
