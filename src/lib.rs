#![doc = include_str!("../README.md")]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod error;
pub mod filter;
mod stats;
mod sync;

pub use error::{ConfigError, DecodeError, IncompatibleFilters};
pub use filter::{AtomicBloom, FORMAT_VERSION, FilterBuilder, FilterStats, Plan, plan};
