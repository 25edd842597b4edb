#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod error;
pub mod filter;
#[cfg(feature = "guard")]
#[cfg_attr(docsrs, doc(cfg(feature = "guard")))]
pub mod guard;
#[cfg(feature = "guard")]
#[cfg_attr(docsrs, doc(cfg(feature = "guard")))]
pub mod layer;
#[cfg(feature = "guard")]
#[cfg_attr(docsrs, doc(cfg(feature = "guard")))]
pub mod loader;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
mod stats;
mod sync;
#[cfg(feature = "guard")]
mod task;
#[cfg(feature = "guard")]
#[cfg_attr(docsrs, doc(cfg(feature = "guard")))]
pub mod verify;

pub use error::{ConfigError, DecodeError, FilterParameter, IncompatibleFilters, StillWarming};
pub use filter::{AtomicBloom, FORMAT_VERSION, FilterBuilder, FilterStats, Plan, plan};
#[cfg(feature = "guard")]
pub use guard::source::{self, KeySource, SourceError};
#[cfg(feature = "guard")]
pub use guard::{
    Guard, GuardBuilder, GuardReader, GuardStats, Lifecycle, LiveFilters, MaintenanceHandle,
    PendingWrite, RebuildError, RebuildOutcome, RebuildPolicy, RebuildReport, Verdict,
};
#[cfg(feature = "guard")]
pub use layer::{GuardLayer, GuardService, InsertLayer, InsertService};
#[cfg(feature = "guard")]
pub use loader::{GuardedLoader, Loader};
#[cfg(feature = "guard")]
pub use verify::Verify;
