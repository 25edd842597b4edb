//! Every error the crate returns, in one place: bad parameters, bad
//! snapshots, mismatched filters, a source that failed, a rebuild that did
//! not complete, a guard still warming, and (the `redis` feature) a fleet's
//! snapshot that could not be published or loaded.

use std::error::Error;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IncompatibleFilters {
    /// The first parameter that differs.
    pub differs_in: FilterParameter,
}

/// A parameter two filters must share to be combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FilterParameter {
    /// The number of bits (blocks).
    Bits,
    /// The number of probes per key.
    K,
    /// The hash seed.
    Seed,
}

impl fmt::Display for FilterParameter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Bits => "bits",
            Self::K => "k",
            Self::Seed => "seed",
        })
    }
}

impl fmt::Display for IncompatibleFilters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "filters differ in {}: only filters with the same bits, k and seed can be combined",
            self.differs_in
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

/// A [`KeySource`](crate::KeySource) failed: the store was unreachable, a cursor broke.
/// Cheap to clone (the cause is shared), so that a rebuild's report can keep it.
#[derive(Debug, Clone)]
pub struct SourceError {
    cause: Arc<dyn Error + Send + Sync>,
}

impl SourceError {
    /// Wraps the cause of the failure (an error, or a message).
    pub fn new(cause: impl Into<Box<dyn Error + Send + Sync>>) -> Self {
        Self {
            cause: Arc::from(cause.into()),
        }
    }
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "key source failed: {}", self.cause)
    }
}

impl Error for SourceError {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&*self.cause)
    }
}

/// Why a rebuild did not complete. The live filters keep serving.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum RebuildError {
    /// The guard has no [`KeySource`](crate::KeySource).
    NoSource,
    /// The source failed.
    Source(SourceError),
    /// The rebuild ran past its timeout.
    TimedOut(Duration),
    /// The rebuild ran past its timeout still waiting for inserts and
    /// [`PendingWrite`](crate::PendingWrite)s begun before it: one is held
    /// open longer than that (a `PendingWrite` kept alive by mistake, or a
    /// request under an [`InsertLayer`](crate::InsertLayer) that takes that
    /// long). Every rebuild fails this way until it closes.
    WritesStillOpen(Duration),
    /// The new filter could not be sized (over the memory budget).
    Config(ConfigError),
    /// A filter was merged into the guard ([`Guard::merge_filter`](crate::Guard::merge_filter)),
    /// or a fleet snapshot replaced its filters, while this rebuild ran, and
    /// could not be merged into the new filter too (another size): swapping
    /// would lose its keys. A later rebuild (the maintenance task retries)
    /// reads them from the store.
    MergedDuringRebuild,
    /// The rebuild's future was dropped before it finished (its caller was
    /// cancelled, or the maintenance task stopped).
    Cancelled,
}

impl fmt::Display for RebuildError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NoSource => f.write_str("the guard has no key source to rebuild from"),
            Self::Source(error) => write!(f, "rebuild failed: {error}"),
            Self::TimedOut(timeout) => write!(f, "rebuild timed out after {timeout:?}"),
            Self::WritesStillOpen(timeout) => write!(
                f,
                "rebuild timed out after {timeout:?} waiting for writes begun before it \
                 (a PendingWrite or an InsertLayer request still open)"
            ),
            Self::Config(error) => write!(f, "rebuild cannot size the new filter: {error}"),
            Self::MergedDuringRebuild => f.write_str(
                "a filter was merged into the guard during the rebuild; the rebuilt filter would lose its keys",
            ),
            Self::Cancelled => f.write_str("the rebuild was dropped before it finished"),
        }
    }
}

impl std::error::Error for RebuildError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Source(error) => Some(error),
            Self::Config(error) => Some(error),
            Self::NoSource
            | Self::TimedOut(_)
            | Self::WritesStillOpen(_)
            | Self::MergedDuringRebuild
            | Self::Cancelled => None,
        }
    }
}

impl From<ConfigError> for RebuildError {
    fn from(error: ConfigError) -> Self {
        Self::Config(error)
    }
}

/// What went wrong between a guard and its fleet (the `redis` feature).
#[cfg(feature = "redis")]
#[derive(Debug)]
#[non_exhaustive]
pub enum FleetError {
    /// Redis failed.
    Redis(redis::RedisError),
    /// The snapshot does not decode.
    Decode(DecodeError),
    /// The snapshot's filters were made with another seed.
    Incompatible(IncompatibleFilters),
    /// The guard has no filter to publish yet (it is warming).
    Warming,
    /// This member cannot show that it holds every acknowledged insert (it
    /// is fenced), so a snapshot of it could lose keys: not published.
    Fenced,
    /// The snapshot's manifest is not `position version chunks fresh since`.
    BadManifest,
    /// The snapshot was out of date by the time it was written, and the
    /// fleet's snapshot is left as it was: Redis began a new fleet record
    /// since its position was read (no member could replay from it), another
    /// member's publish trimmed the stream past it meanwhile, or this member
    /// holds none of the keys Redis lost where those are what is needed.
    SnapshotRefused,
    /// Other members replaced the snapshot during each of `attempts` reads.
    KeptChanging {
        /// Reads tried.
        attempts: u32,
    },
    /// This guard is configured otherwise than the fleet it tries to join,
    /// so their snapshots and rebuilds would not agree.
    SettingsDiffer {
        /// The first setting that differs.
        setting: &'static str,
        /// This guard's value.
        ours: String,
        /// The value the fleet recorded.
        fleet: String,
    },
    /// Members holding a live lease did not apply the insert within the
    /// acknowledgement timeout (and kept renewing their leases), or the
    /// fleet's record was still in its first lease (after a restart or a
    /// failover: writers wait that out) when a timeout shorter than a lease
    /// ran out.
    Unacknowledged {
        /// How long the writer waited.
        waited: std::time::Duration,
        /// Members still behind; the record's first lease counts as one.
        members_behind: u64,
    },
    /// Redis began a new fleet record (it lost its data, restarted, failed
    /// over, or its clock stepped back) while the writer waited for the
    /// members to apply its entry: the entry may be gone, so no member may
    /// ever apply it. From [`FleetSync::begin_write`](crate::redis::fleet::FleetSync::begin_write),
    /// the insert was not acknowledged: do not write, try again. From
    /// [`FleetWrite::finish`](crate::redis::fleet::FleetWrite::finish), the
    /// second append was not: see there.
    EntryLost,
    /// The fleet's name is empty or starts with `}`: it is the Redis hash
    /// tag of every key of the fleet (`{name}:inserts`), which would then
    /// be empty, and Redis Cluster would spread the keys over slots.
    InvalidName(String),
    /// The guard follows a fleet already, through this member or another
    /// one: a guard has one member at a time (the first one's
    /// [`FleetHandle::shutdown`](crate::redis::fleet::FleetHandle::shutdown)
    /// lets it join again).
    AlreadyJoined,
    /// The application's shutdown token was cancelled before
    /// [`join_until`](crate::redis::fleet::FleetSync::join_until) finished,
    /// or the runtime shut down before a snapshot's encoding or decoding
    /// could start.
    ShuttingDown,
    /// The thread that fences the member when its lease runs out could not
    /// be started (the operating system refused a thread): not joined.
    LeaseWatchNotStarted(std::io::Error),
    /// Redis answered in a shape the fleet does not write.
    UnexpectedReply(&'static str),
    /// Fewer replicas than asked for acknowledged an append or a renewal
    /// within a lease (`FleetSyncBuilder::wait_for_replicas`).
    NotReplicated {
        /// Replicas asked for.
        wanted: usize,
        /// Replicas that acknowledged.
        acknowledged: usize,
    },
}

#[cfg(feature = "redis")]
impl fmt::Display for FleetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Redis(error) => write!(f, "fleet sync: {error}"),
            Self::Decode(error) => write!(f, "fleet snapshot refused: {error}"),
            Self::Incompatible(error) => write!(f, "fleet snapshot refused: {error}"),
            Self::Warming => f.write_str("the guard has no filter to publish yet"),
            Self::Fenced => f.write_str(
                "this member is fenced (behind the fleet's acknowledged inserts): not publishing",
            ),
            Self::SnapshotRefused => f.write_str(
                "fleet snapshot not published: out of date by the time it was written",
            ),
            Self::BadManifest => f.write_str(
                "fleet snapshot refused: its manifest is not \"position version chunks fresh since\"",
            ),
            Self::KeptChanging { attempts } => write!(
                f,
                "fleet snapshot was replaced during each of {attempts} reads; try again later"
            ),
            Self::SettingsDiffer {
                setting,
                ours,
                fleet,
            } => write!(
                f,
                "this guard's {setting} is {ours}, the fleet's is {fleet}: a member must be \
                 configured as the fleet is"
            ),
            Self::Unacknowledged {
                waited,
                members_behind,
            } => write!(
                f,
                "{members_behind} fleet member(s) did not apply the insert within {waited:?}"
            ),
            Self::EntryLost => f.write_str(
                "Redis began a new fleet record (a data loss, restart, failover or clock step) \
                 while the fleet applied the insert: not acknowledged",
            ),
            Self::InvalidName(name) => write!(
                f,
                "fleet name {name:?} cannot tag the fleet's Redis keys: give a name that is \
                 not empty and does not start with '}}'"
            ),
            Self::AlreadyJoined => {
                f.write_str("the guard follows a fleet already: one member per guard at a time")
            }
            Self::ShuttingDown => f.write_str("shutting down: the fleet join or snapshot did not finish"),
            Self::LeaseWatchNotStarted(error) => write!(
                f,
                "the thread that fences this member when its lease runs out did not start: {error}"
            ),
            Self::UnexpectedReply(what) => write!(f, "unexpected reply from Redis: {what}"),
            Self::NotReplicated {
                wanted,
                acknowledged,
            } => write!(
                f,
                "{acknowledged} of the {wanted} replicas asked for acknowledged the write in time"
            ),
        }
    }
}

#[cfg(feature = "redis")]
impl std::error::Error for FleetError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Redis(error) => Some(error),
            Self::Decode(error) => Some(error),
            Self::Incompatible(error) => Some(error),
            Self::LeaseWatchNotStarted(error) => Some(error),
            _ => None,
        }
    }
}

#[cfg(feature = "redis")]
impl From<redis::RedisError> for FleetError {
    fn from(error: redis::RedisError) -> Self {
        Self::Redis(error)
    }
}

/// A fleet write that failed: before the store write (not made), or after
/// it (made, but not confirmed to every member).
#[cfg(feature = "redis")]
#[derive(Debug)]
pub enum FleetWriteError<T> {
    /// The key could not be appended to the fleet or acknowledged: `write`
    /// did not run.
    NotWritten(FleetError),
    /// `write` ran and returned `output`, but the notice that it landed (sent
    /// for writes slower than half the write settle) was not acknowledged:
    /// a member rebuilding meanwhile may miss the key until its next rebuild.
    Unconfirmed {
        /// What `write` returned.
        output: T,
        /// Why the notice failed.
        error: FleetError,
    },
}

#[cfg(feature = "redis")]
impl<T> fmt::Display for FleetWriteError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotWritten(error) => write!(f, "fleet write not made: {error}"),
            Self::Unconfirmed { error, .. } => {
                write!(f, "fleet write made but not confirmed: {error}")
            }
        }
    }
}

#[cfg(feature = "redis")]
impl<T: fmt::Debug> std::error::Error for FleetWriteError<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::NotWritten(error) | Self::Unconfirmed { error, .. } => Some(error),
        }
    }
}

/// Text that is not a stream position (`milliseconds-sequence`).
#[cfg(feature = "redis")]
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidStreamPosition;

#[cfg(feature = "redis")]
impl fmt::Display for InvalidStreamPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not a stream position (milliseconds-sequence)")
    }
}

#[cfg(feature = "redis")]
impl std::error::Error for InvalidStreamPosition {}

/// A [`PgLoader`](crate::postgres::PgLoader) call that failed (the `postgres` feature).
#[cfg(feature = "postgres")]
#[derive(Debug)]
#[non_exhaustive]
pub enum PgLoadError {
    /// The database's error, as sqlx reports it: unreachable, a missing
    /// table or column, a value of another type.
    Database(sqlx::Error),
    /// The call took longer than the loader's timeout.
    TimedOut(std::time::Duration),
}

#[cfg(feature = "postgres")]
impl fmt::Display for PgLoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Database(error) => write!(f, "postgres: {error}"),
            Self::TimedOut(timeout) => write!(f, "postgres: no answer within {timeout:?}"),
        }
    }
}

#[cfg(feature = "postgres")]
impl std::error::Error for PgLoadError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Database(error) => Some(error),
            Self::TimedOut(_) => None,
        }
    }
}
