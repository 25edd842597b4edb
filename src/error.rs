//! Errors for bad parameters, bad snapshots and mismatched filters.

use std::fmt;

/// A parameter given to a constructor or builder is outside what it accepts.
///
/// The error names the parameter, the value it got and the accepted range, so
/// that a misconfiguration reads clearly in a log.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConfigError {
    /// `parameter` was `value`, which lies outside `accepted`.
    OutOfRange {
        /// The parameter's name, as the API spells it.
        parameter: &'static str,
        /// The value that was given.
        value: String,
        /// The range that is accepted.
        accepted: &'static str,
    },
    /// The filter these parameters ask for is larger than the memory budget.
    TooLarge {
        /// Bytes the filter would need.
        bytes: u64,
        /// The budget (`max_bytes`).
        max_bytes: u64,
    },
}

impl ConfigError {
    pub(crate) fn out_of_range(
        parameter: &'static str,
        value: impl fmt::Display,
        accepted: &'static str,
    ) -> Self {
        Self::OutOfRange {
            parameter,
            value: value.to_string(),
            accepted,
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::OutOfRange {
                parameter,
                value,
                accepted,
            } => write!(
                f,
                "{parameter} = {value} is out of range: expected {accepted}"
            ),
            Self::TooLarge { bytes, max_bytes } => write!(
                f,
                "the filter would need {bytes} bytes, over the budget max_bytes = {max_bytes}"
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Snapshot bytes that cannot be turned back into the filter they came from.
///
/// Decoding never panics and never returns a filter that differs from the one
/// that was encoded: anything it cannot vouch for is one of these.
#[derive(Debug)]
#[non_exhaustive]
pub enum DecodeError {
    /// The bytes do not start with the bloomguard snapshot magic.
    BadMagic,
    /// The snapshot was written by a format version this build does not know.
    UnsupportedVersion {
        /// The version in the snapshot.
        found: u16,
        /// The newest version this build reads.
        supported: u16,
    },
    /// The snapshot uses a bit layout or hash scheme this build does not know.
    UnknownScheme {
        /// `"layout"` or `"hash"`.
        what: &'static str,
        /// The identifier in the snapshot.
        id: u8,
    },
    /// The input ended before the snapshot did.
    Truncated,
    /// The input goes on after the end of the snapshot.
    TrailingBytes,
    /// The checksum does not match the content: the bytes were altered.
    ChecksumMismatch,
    /// The header holds parameters no filter can have.
    InvalidHeader(&'static str),
    /// The filter described is larger than the memory budget for decoding.
    TooLarge {
        /// Bytes the filter would need.
        bytes: u64,
        /// The budget.
        max_bytes: u64,
    },
    /// Reading from the source failed.
    Io(std::io::Error),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::BadMagic => f.write_str("not a bloomguard snapshot (bad magic)"),
            Self::UnsupportedVersion { found, supported } => write!(
                f,
                "snapshot format version {found} is not supported (this build reads up to {supported})"
            ),
            Self::UnknownScheme { what, id } => write!(f, "unknown {what} identifier {id}"),
            Self::Truncated => f.write_str("snapshot is truncated"),
            Self::TrailingBytes => f.write_str("unexpected bytes after the end of the snapshot"),
            Self::ChecksumMismatch => {
                f.write_str("snapshot checksum mismatch: the bytes were altered")
            }
            Self::InvalidHeader(why) => write!(f, "invalid snapshot header: {why}"),
            Self::TooLarge { bytes, max_bytes } => write!(
                f,
                "snapshot describes a {bytes}-byte filter, over the budget of {max_bytes} bytes"
            ),
            Self::Io(e) => write!(f, "reading the snapshot failed: {e}"),
        }
    }
}

impl std::error::Error for DecodeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io(e) => Some(e),
            _ => None,
        }
    }
}

impl From<std::io::Error> for DecodeError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Self::Truncated
        } else {
            Self::Io(e)
        }
    }
}

/// Two filters cannot be combined because they differ in shape or seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncompatibleFilters {
    /// The first parameter that differs: `"bits"`, `"k"` or `"seed"`.
    pub parameter: &'static str,
}

impl fmt::Display for IncompatibleFilters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "filters differ in {}: only filters with the same bits, k and seed can be combined",
            self.parameter
        )
    }
}

impl std::error::Error for IncompatibleFilters {}

/// A guard that was still warming (its first build not complete) when a
/// bounded wait for it ran out, from [`Guard::ready_within`](crate::Guard::ready_within).
/// The guard keeps failing open (answering `Warming`) meanwhile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StillWarming {
    pub(crate) guard: String,
    pub(crate) waited: std::time::Duration,
}

impl fmt::Display for StillWarming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "guard {:?} is still warming after {:?}: its first build has not completed \
             (is its maintenance task running, and its source reachable?)",
            self.guard, self.waited
        )
    }
}

impl std::error::Error for StillWarming {}
