//! Snapshots of a member's whole live set, published for the fleet and
//! loaded by members that join or recover.
//!
//! The encoded set goes into chunks of at most `snapshot_chunk_bytes` under
//! the fleet's record and a version number the record hands out once
//! (`{name}:snapshot:{since}:{version}:{i}`); then the manifest
//! `{name}:snapshot` ("position version chunks fresh since") is switched to
//! it in one step, so a reader sees the old snapshot or the new one, never a
//! mix. The switch is refused when the fleet's record in Redis is no longer
//! the one the position was read under, or the stream was trimmed past the
//! position meanwhile. The switch sets the old snapshot's chunks to expire;
//! then, still under that record, they are deleted and the stream is
//! trimmed to the older of the two positions (whoever is still loading the
//! old one can replay from there).
//!
//! After Redis lost its data, the keys acknowledged before are in the sets
//! of the members that lived through it, and nowhere else in the fleet:
//! their renewals mark the new record in `{name}:snapshot:needed`, and are
//! asked to publish until one of them (or a member holding one of their
//! snapshots, or a rebuild from the store) has. A member whose set starts at the new stream's
//! start (`fresh`: it joined after the loss without such a snapshot) cannot
//! publish meanwhile, and recovers when its renewal sees the mark. So does
//! one that loaded a snapshot published under the record before (`since`):
//! after a restart from an older dump, the stream after it lacks what was
//! appended after the dump.

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;
use tracing::Instrument;

use super::membership::RECORD_SINCE;
use super::position::POSITION_BEFORE;
use super::{FleetSync, StreamPosition, off_the_member_task};
use crate::error::FleetError;
use crate::guard::snapshot::LiveSnapshot;

/// Reads of a snapshot that publishers keep replacing, before giving up.
const SNAPSHOT_READ_ATTEMPTS: u32 = 3;

/// Names one published snapshot: the fleet's record it was published
/// under and its version. The version counter restarts when Redis loses its
/// data, so a version alone can name two snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct SnapshotId {
    /// The fleet's record (`{name}:since`) it was published under.
    pub(super) since: u64,
    pub(super) version: u64,
}

/// What `{name}:snapshot` holds: where the snapshot's chunks are, and the
/// stream position it covers.
struct Manifest {
    position: StreamPosition,
    id: SnapshotId,
    chunks: usize,
    /// Its publisher's set holds keys from the start of the fleet's record
    /// in Redis only (see [`MemberState::fresh_in`](super::MemberState)).
    fresh: bool,
}

impl Manifest {
    fn parse(text: &str) -> Option<Self> {
        let mut fields = text.split(' ');
        let position = fields.next()?.parse().ok()?;
        let version = fields.next()?.parse().ok()?;
        let chunks = fields.next()?.parse().ok()?;
        // Without these (written before they were), it is taken for one
        // that holds nothing from before its record.
        let fresh = match fields.next() {
            Some("0") => false,
            Some("1") | None => true,
            Some(_) => return None,
        };
        let since = fields.next().map_or(Some(0), |since| since.parse().ok())?;
        let manifest = Self {
            position,
            id: SnapshotId { since, version },
            chunks,
            fresh,
        };
        fields.next().is_none().then_some(manifest)
    }

    /// Whether the set holds the keys from before `record` began (where
    /// Redis lost them): published under `record` by a member that held
    /// them. One from an earlier record lacks what that record's end lost
    /// (a restart from an older dump keeps the snapshot, not the entries
    /// after it).
    fn holds_what_preceded(&self, record: Option<u64>) -> bool {
        !self.fresh && Some(self.id.since) == record
    }
}

/// How a published snapshot is announced.
#[derive(Debug, Clone, Copy)]
pub(super) enum Notice {
    /// For members that join or recover.
    Snapshot,
    /// A fresh rebuild: every member replaces its set with it.
    Rebuilt,
}

/// One attempt at reading the snapshot.
enum Read {
    /// None stands, another than the one asked for, or one the stream was
    /// trimmed past.
    None,
    /// Its chunks were deleted while we read them.
    Replaced,
    Snapshot(Manifest, LiveSnapshot),
}

/// How long a snapshot's chunk lives while no manifest names it: before
/// its manifest does, since a publish dropped before (an instance stopped,
/// a `timeout` around [`FleetSync::publish_snapshot`]) leaves chunks that
/// nothing names, which would otherwise stay in Redis for good; and after
/// a new manifest replaced it, should the publisher's clean-up be cut off.
/// Far longer than a publish takes (one that outlasts it is refused, and
/// publishes again later) or a member's read of the replaced snapshot.
const UNNAMED_CHUNK_LIFETIME: Duration = Duration::from_secs(3600);

/// The code of [`SET_MANIFEST`]'s and [`NEXT_VERSION`]'s refusals.
const MANIFEST_REFUSED: &str = "BLOOMGUARD_MANIFEST_REFUSED";

/// A refusal of a publish's script as [`FleetError::SnapshotRefused`].
fn refusal(error: redis::RedisError) -> FleetError {
    if error.to_string().contains(MANIFEST_REFUSED) {
        FleetError::SnapshotRefused
    } else {
        error.into()
    }
}

/// Points the manifest (`KEYS[1]`) at a new snapshot (`ARGV[1]`), returning
/// the one before, when the fleet's record is the one the snapshot's
/// position (`ARGV[4]`) was read under (`ARGV[2]`, its `since`), and the
/// stream still holds every entry after that position (none after it was
/// trimmed, `KEYS[5]`); an error otherwise ([`MANIFEST_REFUSED`]). In a Redis
/// that lost its data since, the position is in a stream that is gone, and
/// a member adopting it would skip the new stream's entries; past a trim,
/// no member can use the snapshot, and it would replace one they can.
/// The snapshot's chunks (`KEYS[7..]`; `KEYS[6]` is the stream, for
/// `record_since`), written to expire (a publish
/// dropped before this script leaves them to no manifest), must all be
/// there, and are kept from then on (none, where one is missing: the rest
/// expire whether the publisher's clean-up reaches Redis or not). The
/// replaced snapshot's chunks expire from then on ([`RETIRE`] deletes them
/// sooner, unless the publisher is cut off first), in `ARGV[5]` ms; not
/// when the manifest named this snapshot already (the script resent).
static SET_MANIFEST: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &[
            RECORD_SINCE,
            POSITION_BEFORE,
            r"
if record_since(KEYS[2], KEYS[4], KEYS[6]) ~= tonumber(ARGV[2]) then
  return redis.error_reply('BLOOMGUARD_MANIFEST_REFUSED the fleet record changed since the snapshot was taken')
end
if ARGV[3] == '1' and tonumber(redis.call('GET', KEYS[3])) == tonumber(ARGV[2]) then
  return redis.error_reply('BLOOMGUARD_MANIFEST_REFUSED this member holds no keys from before Redis lost its data')
end
local trimmed = redis.call('GET', KEYS[5])
if trimmed and position_before(ARGV[4], trimmed) then
  return redis.error_reply('BLOOMGUARD_MANIFEST_REFUSED the stream was trimmed past the snapshot meanwhile')
end
for i = 7, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then
    return redis.error_reply('BLOOMGUARD_MANIFEST_REFUSED a chunk of the snapshot expired before its manifest')
  end
end
for i = 7, #KEYS do redis.call('PERSIST', KEYS[i]) end
local replaced = redis.call('SET', KEYS[1], ARGV[1], 'GET')
if replaced and replaced ~= ARGV[1] then
  local fields = {}
  for field in string.gmatch(replaced, '%S+') do fields[#fields + 1] = field end
  local version, chunks, since = fields[2], tonumber(fields[3]), fields[5] or '0'
  for i = 0, (chunks or 0) - 1 do
    redis.call('PEXPIRE', KEYS[1] .. ':' .. since .. ':' .. version .. ':' .. i, ARGV[5])
  end
end
return replaced
",
        ]
        .concat(),
    )
});

/// Hands out the next snapshot version (`KEYS[3]`) under the fleet's
/// record the snapshot's position was read under (`ARGV[1]`); refuses
/// ([`MANIFEST_REFUSED`]) under another. So no record hands a version out
/// twice, and no two publishes write the same chunks, even across a restart
/// from an older dump (which begins another record).
static NEXT_VERSION: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &[
            RECORD_SINCE,
            r"
if record_since(KEYS[1], KEYS[2], KEYS[4]) ~= tonumber(ARGV[1]) then
  return redis.error_reply('BLOOMGUARD_MANIFEST_REFUSED the fleet record changed since the snapshot was taken')
end
return redis.call('INCR', KEYS[3])
",
        ]
        .concat(),
    )
});

/// Retires the snapshot a new manifest replaced: deletes its chunks
/// (`KEYS[6..]`) and trims the stream (`KEYS[3]`) to before `ARGV[2]`, the
/// older of the two snapshots' positions (a member still loading the
/// replaced one replays from there), recording the newest entry it removed
/// in `KEYS[4]` (as `APPEND` does). Never past the snapshot the manifest
/// (`KEYS[5]`) names now: another publish, from a member further behind,
/// may have replaced ours meanwhile. Only under the fleet's record the new
/// manifest was set under (`ARGV[1]`): after a failover, the new master may
/// still serve the replaced snapshot, and the stream after it. Nothing is
/// before `0-0` (a snapshot taken of an empty stream), and Redis refuses
/// the range `(0-0`; `DEL` takes the chunks a thousand at a time (Lua's
/// `unpack` has a limit).
static RETIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &[
            RECORD_SINCE,
            POSITION_BEFORE,
            r"
if record_since(KEYS[1], KEYS[2], KEYS[3]) ~= tonumber(ARGV[1]) then return 0 end
for first = 6, #KEYS, 1000 do
  redis.call('DEL', unpack(KEYS, first, math.min(first + 999, #KEYS)))
end
local trim_to = ARGV[2]
local standing = redis.call('GET', KEYS[5])
local standing_at = standing and string.match(standing, '^(%d+%-%d+) ')
if standing_at and position_before(standing_at, trim_to) then trim_to = standing_at end
if trim_to ~= '0-0' then
  local newest = redis.call('XREVRANGE', KEYS[3], '(' .. trim_to, '-', 'COUNT', 1)
  if newest[1] then
    redis.call('SET', KEYS[4], newest[1][1])
    redis.call('XTRIM', KEYS[3], 'MINID', trim_to)
  end
end
return 1
",
        ]
        .concat(),
    )
});

impl FleetSync {
    /// Publishes this member's whole live set and the stream position it
    /// covers as the fleet's snapshot, notifies the fleet, and trims the
    /// stream to the snapshot before. Returns the position.
    ///
    /// # Errors
    /// [`FleetError::Warming`] before the guard has a filter;
    /// [`FleetError::Fenced`] while this member is not caught up (or not
    /// joined): its set could lack acknowledged keys;
    /// [`FleetError::SnapshotRefused`] when it was out of date by the time
    /// it was written. Redis errors.
    pub async fn publish_snapshot(&self) -> Result<StreamPosition, FleetError> {
        self.publish(Notice::Snapshot)
            .instrument(self.span("publish_snapshot"))
            .await
    }

    /// Publishes, announcing the snapshot as `notice`.
    pub(super) async fn publish(&self, notice: Notice) -> Result<StreamPosition, FleetError> {
        let taken = || {
            let state = self.state();
            (!state.fenced && state.fence_at.is_some()).then_some((
                state.position,
                state.replacements,
                state.stream_resets,
                state.fleet_since,
                state.fresh_in_its_record(),
            ))
        };
        // The position first: the set holds at least every entry up to it.
        let (position, replacements, resets, fleet_since, fresh) =
            taken().ok_or(FleetError::Fenced)?;
        let since = fleet_since.unwrap_or(0);
        let guard = self.inner.guard.clone();
        let encoded = off_the_member_task(move || guard.encode_live_set())
            .await?
            .ok_or(FleetError::Warming)?;
        if taken()
            .is_none_or(|(_, now, resets_now, _, _)| now != replacements || resets_now != resets)
        {
            // Replaced from another snapshot meanwhile, or sent back to a new
            // stream's start: what we encoded may not hold what `position`
            // says, or `position` is in a stream that is gone.
            return Err(FleetError::Fenced);
        }
        let keys = &self.inner.keys;
        let mut connection = self.inner.connection.get().await?;
        let version: u64 = NEXT_VERSION
            .key(&keys.since)
            .key(&keys.record)
            .key(&keys.snapshot_version)
            .key(&keys.stream)
            .arg(since)
            .invoke_async(&mut connection)
            .await
            .map_err(refusal)?;
        let id = SnapshotId { since, version };
        let chunks = encoded.chunks(self.inner.settings.chunk_bytes);
        let count = chunks.len();
        for (i, chunk) in chunks.enumerate() {
            let written: Result<(), _> = redis::cmd("SET")
                .arg(keys.chunk(id, i))
                .arg(chunk)
                .arg("PX")
                .arg(UNNAMED_CHUNK_LIFETIME.as_millis() as u64)
                .query_async(&mut connection)
                .await;
            if let Err(error) = written {
                // Nobody's: left to expire, they would stay an hour, and
                // the next publish (within a lease) writes another copy.
                self.delete_chunks(id, i + 1).await;
                return Err(error.into());
            }
        }
        let mut set_manifest = SET_MANIFEST.prepare_invoke();
        set_manifest
            .key(&keys.manifest)
            .key(&keys.since)
            .key(&keys.snapshot_needed)
            .key(&keys.record)
            .key(&keys.trimmed)
            .key(&keys.stream);
        for i in 0..count {
            set_manifest.key(keys.chunk(id, i));
        }
        let previous: Option<String> = match set_manifest
            .arg(format!(
                "{position} {version} {count} {} {since}",
                u8::from(fresh)
            ))
            .arg(since)
            .arg(u8::from(fresh))
            .arg(position)
            .arg(UNNAMED_CHUNK_LIFETIME.as_millis() as u64)
            .invoke_async(&mut connection)
            .await
            .map_err(refusal)
        {
            Ok(previous) => previous,
            Err(FleetError::SnapshotRefused) => {
                // The chunks are nobody's. (Any other error may have come
                // after the script ran, and the manifest may point at them.)
                self.delete_chunks(id, count).await;
                return Err(FleetError::SnapshotRefused);
            }
            Err(error) => return Err(error),
        };
        // Retired before the notice, so that a failed notice leaves behind
        // no chunks that no manifest names; noticed whether or not it was.
        let retired = match previous.as_deref().and_then(Manifest::parse) {
            Some(old) if old.id != id => self.retire(since, &old, position).await,
            _ => Ok(()),
        };
        let notice = match notice {
            Notice::Snapshot => "snapshot".to_owned(),
            Notice::Rebuilt => format!("rebuilt {} {since} {version}", self.inner.member),
        };
        let _: i64 = redis::cmd("PUBLISH")
            .arg(&keys.notices)
            .arg(notice)
            .query_async(&mut connection)
            .await?;
        retired?;
        Ok(position)
    }

    /// Deletes the first `count` chunks of `id`, which no manifest names;
    /// where that fails they expire (`UNNAMED_CHUNK_LIFETIME`).
    async fn delete_chunks(&self, id: SnapshotId, count: usize) {
        let deleted = async {
            let mut connection = self.inner.connection.get().await?;
            let mut delete = redis::cmd("DEL");
            for i in 0..count {
                delete.arg(self.inner.keys.chunk(id, i));
            }
            delete.query_async::<i64>(&mut connection).await?;
            Ok::<_, FleetError>(())
        };
        if let Err(error) = deleted.await {
            tracing::debug!(%error, "unnamed snapshot chunks not deleted; they expire");
        }
    }

    /// Deletes the chunks of `old`, which the snapshot published at
    /// `position` under the record `since` replaced, and trims the stream to
    /// the older of the two ([`RETIRE`]).
    async fn retire(
        &self,
        since: u64,
        old: &Manifest,
        position: StreamPosition,
    ) -> Result<(), FleetError> {
        let keys = &self.inner.keys;
        let mut connection = self.inner.connection.get().await?;
        let mut retire = RETIRE.prepare_invoke();
        retire
            .key(&keys.since)
            .key(&keys.record)
            .key(&keys.stream)
            .key(&keys.trimmed)
            .key(&keys.manifest)
            .arg(since)
            .arg(old.position.min(position));
        for i in 0..old.chunks {
            retire.key(keys.chunk(old.id, i));
        }
        let retired: u8 = retire.invoke_async(&mut connection).await?;
        if retired == 0 {
            tracing::debug!(
                "the fleet's record changed since the manifest was set: the replaced snapshot is kept"
            );
        }
        Ok(())
    }

    /// Loads the fleet's snapshot if the stream still holds everything after
    /// its position: replaces the live set with it (fenced, until the stream
    /// after it is applied), ends warming, and moves this member's position
    /// to it. `Ok(None)` when there is no snapshot, or one that the stream
    /// no longer continues. With `rebuilt` (another member's rebuild), only
    /// that snapshot is loaded (`Ok(None)` when another stands), and it
    /// counts as this member's rebuild too.
    ///
    /// # Errors
    /// A snapshot that does not decode, or whose filters have another seed,
    /// is refused ([`FleetError::Decode`], [`FleetError::Incompatible`]) and
    /// the guard keeps what it has; [`FleetError::KeptChanging`].
    pub(super) async fn load_covering_snapshot(
        &self,
        rebuilt: Option<SnapshotId>,
    ) -> Result<Option<StreamPosition>, FleetError> {
        // A publish that replaces the snapshot while we read it deletes the
        // chunks we are reading: read the new one then.
        for _ in 0..SNAPSHOT_READ_ATTEMPTS {
            let read_under = self.state().fleet_since;
            // Another member's rebuild replaces this member's set only with
            // that very set: whatever stands in its place by now may be
            // older than what this member holds (a Redis restarted from an
            // older dump, which no script has noticed yet, serves that
            // dump's snapshot).
            match self.read_snapshot(rebuilt).await? {
                Read::None => return Ok(None),
                Read::Replaced => continue,
                Read::Snapshot(manifest, set) => {
                    let position = manifest.position;
                    if self.trimmed_to().await? > position {
                        return Ok(None);
                    }
                    let fresh_in = (!manifest.holds_what_preceded(read_under))
                        .then_some(read_under)
                        .flatten();
                    let rebuilt = rebuilt.is_some(); // that very snapshot
                    let adopted =
                        self.adopt_snapshot(read_under, position, fresh_in, set, rebuilt)?;
                    if adopted {
                        return Ok(Some(position));
                    }
                }
            }
        }
        Err(FleetError::KeptChanging {
            attempts: SNAPSHOT_READ_ATTEMPTS,
        })
    }

    /// Replaces the live set with `set`, read while the fleet's record in
    /// Redis was `read_under`, and moves this member to its `position`.
    /// `fresh_in`: the record whose start the set holds keys from, if it
    /// holds none from before (its publisher's).
    /// `false`, nothing changed, when a renewal has found another record
    /// since: Redis lost its data, and the position is in a stream that is
    /// gone (the new one's ids may sort below it).
    pub(super) fn adopt_snapshot(
        &self,
        read_under: Option<u64>,
        position: StreamPosition,
        fresh_in: Option<u64>,
        set: LiveSnapshot,
        rebuilt: bool,
    ) -> Result<bool, FleetError> {
        let mut state = self.state();
        if state.fleet_since != read_under {
            return Ok(false);
        }
        self.inner
            .guard
            .replace_from_snapshot(set, true, rebuilt)
            .map_err(FleetError::Incompatible)?;
        state.fenced = true;
        state.replacements += 1;
        state.starts_fresh_in(fresh_in);
        // Read with a plain `GET`: the next renewal says whether the record
        // it belongs to still stands.
        state.record_confirmed = false;
        // Replay from the snapshot, and do not answer before reaching where
        // this member had got to.
        let reached = state.position;
        state.position = position;
        if reached > position {
            state.catch_up_to = Some(state.catch_up_to.unwrap_or_default().max(reached));
        }
        Ok(true)
    }

    /// Reads the snapshot the manifest names; with `only`, that one only
    /// (`Read::None` for another, before reading any chunk).
    async fn read_snapshot(&self, only: Option<SnapshotId>) -> Result<Read, FleetError> {
        let keys = &self.inner.keys;
        let mut connection = self.inner.connection.get().await?;
        let manifest: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&keys.manifest)
            .query_async(&mut connection)
            .await?;
        let Some(manifest) = manifest else {
            return Ok(Read::None);
        };
        let manifest = std::str::from_utf8(&manifest)
            .ok()
            .and_then(Manifest::parse)
            .ok_or(FleetError::BadManifest)?;
        let wanted = only.is_none_or(|only| only == manifest.id) && {
            let state = self.state();
            !state.snapshot_needed || manifest.holds_what_preceded(state.fleet_since)
        };
        if !wanted {
            // The keys from before the record began are what is wanted.
            return Ok(Read::None);
        }
        // One the stream no longer continues is refused once read (see
        // `load_covering_snapshot`), so it is not worth its chunks: a
        // member recovering where no member can publish would fetch the
        // whole filter again every lease.
        if self.trimmed_to().await? > manifest.position {
            return Ok(Read::None);
        }
        let mut encoded = Vec::new();
        for i in 0..manifest.chunks {
            let chunk: Option<Vec<u8>> = redis::cmd("GET")
                .arg(keys.chunk(manifest.id, i))
                .query_async(&mut connection)
                .await?;
            match chunk {
                Some(chunk) => encoded.extend_from_slice(&chunk),
                None => return Ok(Read::Replaced),
            }
        }
        let set = off_the_member_task(move || LiveSnapshot::from_bytes(&encoded))
            .await?
            .map_err(FleetError::Decode)?;
        Ok(Read::Snapshot(manifest, set))
    }

    /// Publishes a snapshot every `snapshot_every`, and when a member asks
    /// for one; one member at a time (a lock held for a lease).
    pub(super) async fn publish_when_due(&self) {
        loop {
            let requested = self.inner.snapshot_requested.notified();
            match self.inner.settings.snapshot_every {
                Some(period) => {
                    tokio::select! {
                        () = tokio::time::sleep(period) => {}
                        () = requested => {}
                    }
                }
                None => requested.await,
            }
            if !self.take_publish_turn().await {
                continue;
            }
            match self.publish_snapshot().await {
                Ok(_) | Err(FleetError::Fenced | FleetError::Warming) => {}
                Err(FleetError::SnapshotRefused) => {
                    tracing::debug!("fleet snapshot out of date by the time it was written");
                }
                Err(error) => tracing::warn!(%error, "fleet snapshot not published"),
            }
        }
    }

    /// Whether this member may publish now (no other did within a lease).
    async fn take_publish_turn(&self) -> bool {
        if self.inner.guard.is_fenced() || self.inner.guard.is_warming() {
            return false;
        }
        // Never given back: the turn spaces publishes a lease apart. A
        // resent take that finds the turn its first run took skips one.
        let taken: Result<Option<String>, FleetError> = async {
            let mut connection = self.inner.connection.get().await?;
            Ok(redis::cmd("SET")
                .arg(&self.inner.keys.snapshot_lock)
                .arg(&self.inner.member)
                .arg("NX")
                .arg("PX")
                .arg(self.inner.settings.lease.as_millis() as u64)
                .query_async(&mut connection)
                .await?)
        }
        .await;
        matches!(taken, Ok(Some(_)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A set published under the record before, or from the start of this
    /// one, cannot stand for the keys that preceded this record.
    #[test]
    fn only_a_covering_snapshot_of_this_record_holds_what_preceded_it() {
        let parse = |text| Manifest::parse(text).unwrap();
        let covering = parse("5-0 7 2 0 1000");
        assert!(covering.holds_what_preceded(Some(1000)));
        assert!(
            !covering.holds_what_preceded(Some(2000)),
            "published before the record began"
        );
        assert!(!parse("5-0 7 2 1 1000").holds_what_preceded(Some(1000)));
        let older = parse("5-0 7 2");
        assert!(older.fresh && !older.holds_what_preceded(Some(0)));
        assert!(Manifest::parse("5-0 7 2 2 1000").is_none());
        assert!(Manifest::parse("5-0 7 2 0 1000 more").is_none());
    }
}
