// Link definitions ahead of the README's: the first of two wins, so rustdoc
// links items where GitHub, reading the README's own, links their source,
// and the repository's other files to their docs.rs source view.
#![doc = "[`AtomicBloom`]: crate::AtomicBloom"]
#![doc = "[`Guard`]: crate::Guard"]
#![doc = "[`KeySource`]: crate::KeySource"]
#![doc = "[`GuardLayer`]: crate::GuardLayer"]
#![doc = "[`GuardService`]: crate::GuardService"]
#![doc = "[`InsertLayer`]: crate::InsertLayer"]
#![doc = "[`GuardedLoader`]: crate::GuardedLoader"]
// (A feature's items, only where it is on: without it the README's own
// definitions stand.)
#![cfg_attr(feature = "postgres", doc = "[`PgSource`]: crate::postgres::PgSource")]
#![cfg_attr(feature = "postgres", doc = "[`PgLoader`]: crate::postgres::PgLoader")]
#![cfg_attr(feature = "redis", doc = "[`RedisSource`]: crate::redis::RedisSource")]
#![cfg_attr(feature = "redis", doc = "[`RedisLoader`]: crate::redis::RedisLoader")]
#![cfg_attr(feature = "redis", doc = "[`FleetSync`]: crate::redis::FleetSync")]
#![cfg_attr(feature = "redis", doc = "[fleet module docs]: crate::redis::fleet")]
#![doc = "[`verify`]: crate::verify"]
#![doc = "[examples-readme]: https://docs.rs/crate/bloomguard/latest/source/examples/README.md"]
#![doc = "[security]: https://docs.rs/crate/bloomguard/latest/source/SECURITY.md"]
#![doc = "[benchmarks]: https://docs.rs/crate/bloomguard/latest/source/BENCHMARKS.md"]
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
