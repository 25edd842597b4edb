//! One rebuilder at a time: a member whose maintenance finds a rebuild due
//! takes the fleet's rebuild lock first; the one that holds it rebuilds from
//! the store and publishes the result, and every other member replaces its
//! set with that snapshot (fenced while it replays the stream after it). So
//! the store is read once per fleet rebuild, the fleet forgets deleted keys
//! together, and every member answers from the same filters. One exception:
//! a member whose staleness check found a key the store holds and it
//! answered `Absent` for rebuilds for it itself, after any snapshot it
//! adopts, since it cannot tell whether that snapshot's read of the store
//! began before its finding (so one write that bypassed the guards, found
//! by several members, costs a read of the store each).
//!
//! Correctness does not depend on the lock: a member that rebuilds on its
//! own (Redis unreachable, or recovering) keeps every acknowledged key (see
//! the module docs on writes slower than the settle), and replacing a set
//! with any snapshot whose stream continues is safe.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, LazyLock, Weak};

use redis::Script;

use super::snapshot::{Notice, SnapshotId};
use super::{FleetSync, Inner};
use crate::error::FleetError;
use crate::guard::RebuildTurns;

/// Deletes the lock in `KEYS[1]` if this member (`ARGV[1]`) still holds it.
static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
",
    )
});

/// Takes the rebuild turn in `KEYS[1]` for this member (`ARGV[1]`) for
/// `ARGV[2]` ms unless another member holds it. A turn in this member's own
/// name is taken again: it is what a resent take finds (the cluster client
/// sends a command again when a dropped connection lost its reply) and
/// what a give-back that failed leaves, and read as another's it held
/// every member off until it expired.
static TAKE_TURN: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
",
    )
});

/// The guard's side of the turns: holds the member weakly (the member holds
/// the guard).
struct Turns(Weak<Inner>);

impl Turns {
    fn member(&self) -> Option<FleetSync> {
        self.0.upgrade().map(|inner| FleetSync { inner })
    }
}

impl RebuildTurns for Turns {
    fn take(&self) -> Pin<Box<dyn Future<Output = bool> + Send + '_>> {
        Box::pin(async move {
            match self.member() {
                Some(member) => member.take_rebuild_turn().await,
                None => true,
            }
        })
    }

    fn ended(&self, committed: bool) -> Pin<Box<dyn Future<Output = ()> + Send + '_>> {
        Box::pin(async move {
            if let Some(member) = self.member() {
                if committed {
                    member.share_rebuild().await;
                }
                member.give_back_rebuild_turn().await;
            }
        })
    }
}

impl FleetSync {
    /// Has the guard's maintenance take turns with the other members.
    pub(super) fn take_rebuild_turns(&self) {
        let turns: Arc<dyn RebuildTurns> = Arc::new(Turns(Arc::downgrade(&self.inner)));
        self.inner.guard.set_rebuild_turns(Some(turns));
    }

    /// Whether this member may rebuild now. When Redis cannot say, it may:
    /// its own rebuild is safe, only not shared.
    async fn take_rebuild_turn(&self) -> bool {
        let taken: Result<bool, FleetError> = async {
            let mut connection = self.inner.connection.get().await?;
            Ok(TAKE_TURN
                .key(&self.inner.keys.rebuild_lock)
                .arg(&self.inner.member)
                .arg(self.inner.guard.rebuild_timeout().as_millis() as u64)
                .invoke_async(&mut connection)
                .await?)
        }
        .await;
        taken.unwrap_or(true)
    }

    /// Publishes the set this member just rebuilt for the others to
    /// replace theirs with.
    async fn share_rebuild(&self) {
        if let Err(error) = self.publish(Notice::Rebuilt).await {
            tracing::warn!(%error, "rebuilt set not shared; the others rebuild on their own");
        }
    }

    /// Gives the rebuild turn back, if this member still holds it.
    async fn give_back_rebuild_turn(&self) {
        let released: Result<i64, FleetError> = async {
            let mut connection = self.inner.connection.get().await?;
            Ok(RELEASE
                .key(&self.inner.keys.rebuild_lock)
                .arg(&self.inner.member)
                .invoke_async(&mut connection)
                .await?)
        }
        .await;
        if let Err(error) = released {
            tracing::debug!(%error, "rebuild turn not given back; it expires");
        }
    }

    /// Another member published its rebuilt set: `notice` is
    /// "{member} {since} {version}". Not taken when published under another
    /// fleet record than this member's: the version counter restarts with a
    /// record, and the snapshot of that version may be another by now.
    pub(super) fn rebuilt_elsewhere(&self, notice: &[u8]) {
        let notice = String::from_utf8_lossy(notice);
        let Some((rest, version)) = notice.rsplit_once(' ') else {
            return;
        };
        let Some((by, since)) = rest.rsplit_once(' ') else {
            return;
        };
        let (Ok(since), Ok(version)) = (since.parse(), version.parse()) else {
            return;
        };
        let mut state = self.state();
        if by != self.inner.member && state.fleet_since == Some(since) {
            state.rebuilt_elsewhere = Some(SnapshotId { since, version });
        }
    }

    /// Replaces this member's set with the rebuilt one (the consumer does,
    /// between two reads). Kept as it is when the snapshot cannot be used.
    pub(super) async fn replace_with_rebuilt(&self, rebuilt: SnapshotId) {
        match self.load_covering_snapshot(Some(rebuilt)).await {
            Ok(Some(_)) => self.refresh_fence(),
            Ok(None) => tracing::debug!(
                "the rebuilt set was replaced since, or its stream trimmed; keeping ours"
            ),
            Err(error) => tracing::warn!(%error, "rebuilt set not loaded; keeping ours"),
        }
    }
}
