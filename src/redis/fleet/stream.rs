//! The insert stream: appending, applying in order, noticing a gap, and
//! recovering from one.

use std::sync::LazyLock;
use std::time::Duration;

use futures_util::StreamExt;
use redis::streams::StreamRangeReply;
use redis::{Script, Value};
use tokio::time::Instant;

use super::super::Live;
use super::membership::RECORD_SINCE;
use super::{FleetSync, MemberState, StreamPosition};
use crate::error::FleetError;
use crate::guard::RebuildError;

/// What a read of the stream began under.
#[derive(Clone, Copy, Debug)]
pub(super) struct ReadBegun {
    /// The member's stream resets (see `MemberState::stream_resets`).
    resets: u64,
    /// The member's catch-up target.
    catch_up_to: Option<StreamPosition>,
    /// The fleet record the member's position belongs to.
    fleet_since: Option<u64>,
}

impl ReadBegun {
    pub(super) fn now(state: &MemberState) -> Self {
        Self {
            resets: state.stream_resets,
            catch_up_to: state.catch_up_to,
            fleet_since: state.fleet_since,
        }
    }
}

/// Entries applied per read, at most.
const READ_COUNT: usize = 1_000;
/// Keys applied between yields to the member's other tasks: a read of many
/// large batches, applied in one go, held its renewals up as long (see
/// `off_the_member_task`).
const KEYS_BETWEEN_YIELDS: usize = 4_096;
/// Wait before reconnecting after a failed read.
const RECONNECT_BACKOFF: Duration = Duration::from_millis(100);

/// Appends one entry holding the keys `ARGV[4]` (encoded by [`encode_keys`]),
/// and trims the stream to about `ARGV[3]` entries, recording in `KEYS[2]`
/// the newest entry it removed: stream trimming does not record that itself
/// (`max-deleted-entry-id` counts only `XDEL`), and it is how a member knows
/// whether entries after its position are gone. Trims in steps of a
/// hundredth of the cap, so that most appends do not trim. Returns the
/// entry's id and the record it was appended under (`{id, since}`). The
/// fleet's record (`KEYS[3]`, `KEYS[4]`) begins first, if it is to begin:
/// an entry older than the record is one Redis kept.
static APPEND: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &[
            RECORD_SINCE,
            r"
local since = record_since(KEYS[3], KEYS[4], KEYS[1])
local id
if ARGV[2] == '1' then
  id = redis.call('XADD', KEYS[1], '*', 'k', ARGV[4], 'm', ARGV[1], 'landed', '1')
else
  id = redis.call('XADD', KEYS[1], '*', 'k', ARGV[4], 'm', ARGV[1])
end
local cap = tonumber(ARGV[3])
local excess = redis.call('XLEN', KEYS[1]) - cap
if excess > 0 and excess >= math.max(1, math.floor(cap / 100)) then
  local doomed = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', excess + 1)
  redis.call('SET', KEYS[2], doomed[excess][1])
  redis.call('XTRIM', KEYS[1], 'MINID', doomed[excess + 1][1])
end
return {id, since}
",
        ]
        .concat(),
    )
});

/// An entry in the stream, and the fleet's record it was appended under:
/// positions compare only within one record, since a stream Redis lost is
/// followed by a new one whose ids are later in Redis's clock.
#[derive(Debug, Clone, Copy)]
pub(super) struct Appended {
    pub(super) entry: StreamPosition,
    pub(super) since: u64,
}

/// The keys of one entry: each as its length (u32, little-endian) and its
/// bytes. One entry per batch, not per key: a member parses each entry's
/// fields into a map, which costs far more than the inserts.
fn encode_keys<K: AsRef<[u8]>>(keys: &[K]) -> Vec<u8> {
    let len: usize = keys.iter().map(|key| 4 + key.as_ref().len()).sum();
    let mut encoded = Vec::with_capacity(len);
    for key in keys {
        let key = key.as_ref();
        encoded.extend_from_slice(&(key.len() as u32).to_le_bytes());
        encoded.extend_from_slice(key);
    }
    encoded
}

/// The keys [`encode_keys`] wrote; `None` for bytes it did not write.
fn decode_keys(mut encoded: &[u8]) -> Option<Vec<&[u8]>> {
    let mut keys = Vec::new();
    while let Some((len, rest)) = encoded.split_first_chunk::<4>() {
        let len = u32::from_le_bytes(*len) as usize;
        if rest.len() < len {
            return None;
        }
        let (key, rest) = rest.split_at(len);
        keys.push(key);
        encoded = rest;
    }
    encoded.is_empty().then_some(keys)
}

/// Reads the entries after `ARGV[1]` (up to `ARGV[2]`) together with the
/// newest entry ever trimmed and the fleet's record (`KEYS[3]`, 0 for none),
/// in one step: `{last, trimmed, entries, since}`. (The record as it stands:
/// every append begins a new one first where Redis lost its data.)
static READ_AFTER: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local trimmed = redis.call('GET', KEYS[2]) or '0-0'
local since = redis.call('GET', KEYS[3]) or '0'
if redis.call('EXISTS', KEYS[1]) == 0 then return {'0-0', trimmed, {}, since} end
local last = '0-0'
local newest = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if newest[1] then last = newest[1][1] end
return {last, trimmed, redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2]), since}
",
    )
});

/// What one read found.
struct Read {
    last: StreamPosition,
    /// The newest entry trimmed from the stream.
    trimmed: StreamPosition,
    entries: StreamRangeReply,
    /// The fleet's record the stream belongs to (0: none yet).
    since: u64,
}

/// What the consumer does next.
enum Next {
    ReadAgain,
    Wait,
    Recover,
}

/// Sets this member's applied position (`ARGV[2]`) when the fleet's record
/// is the one it was read under (`ARGV[3]`, its `since`), and wakes the
/// writers (`ARGV[4]`, the notices channel).
static ANNOUNCE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &[
            RECORD_SINCE,
            r"
if record_since(KEYS[2], KEYS[3], KEYS[4]) == tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
end
redis.call('PUBLISH', ARGV[4], 'applied')
",
        ]
        .concat(),
    )
});

impl FleetSync {
    /// Appends `keys` to the stream (at least one); `landed` marks the
    /// second append of a slow write.
    pub(super) async fn append<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        landed: bool,
    ) -> Result<Appended, FleetError> {
        let mut connection = self.inner.connection.get().await?;
        let (entry, since) = self
            .run_replicated(
                &mut connection,
                APPEND
                    .key(&self.inner.keys.stream)
                    .key(&self.inner.keys.trimmed)
                    .key(&self.inner.keys.since)
                    .key(&self.inner.keys.record)
                    .arg(&self.inner.member)
                    .arg(u8::from(landed))
                    .arg(self.inner.settings.stream_max_len)
                    .arg(encode_keys(keys)),
            )
            .await?;
        Ok(Appended { entry, since })
    }

    /// The newest entry ever trimmed from the stream (`START`: none).
    pub(super) async fn trimmed_to(&self) -> Result<StreamPosition, FleetError> {
        let mut connection = self.inner.connection.get().await?;
        let trimmed: Option<StreamPosition> = redis::cmd("GET")
            .arg(&self.inner.keys.trimmed)
            .query_async(&mut connection)
            .await?;
        Ok(trimmed.unwrap_or_default())
    }

    async fn read_after<C: redis::aio::ConnectionLike>(
        &self,
        connection: &mut C,
        position: StreamPosition,
        count: usize,
    ) -> Result<Read, FleetError> {
        let reply: (StreamPosition, StreamPosition, Value, u64) = READ_AFTER
            .key(&self.inner.keys.stream)
            .key(&self.inner.keys.trimmed)
            .key(&self.inner.keys.since)
            .arg(position)
            .arg(count.max(1))
            .invoke_async(connection)
            .await?;
        let (last, trimmed, entries, since) = reply;
        let entries = redis::from_redis_value(entries)
            .map_err(|_| FleetError::UnexpectedReply("stream entries"))?;
        Ok(Read {
            last,
            trimmed,
            entries,
            since,
        })
    }

    /// Applies the stream in order, for as long as the member runs.
    pub(super) async fn consume(&self) {
        let mut reader: Option<Live> = None;
        loop {
            if self.state().recovering {
                self.recover().await;
                continue;
            }
            let rebuilt = self.state().rebuilt_elsewhere.take();
            if let Some(rebuilt) = rebuilt {
                self.replace_with_rebuilt(rebuilt).await;
            }
            let Some(connection) = reader.as_mut() else {
                match self.connect_reader().await {
                    Ok(fresh) => reader = Some(fresh),
                    Err(error) => {
                        tracing::debug!(%error, "fleet stream unreachable; retrying");
                        tokio::time::sleep(RECONNECT_BACKOFF).await;
                    }
                }
                continue;
            };
            let next = match self.apply_next(connection).await {
                Ok(next) => next,
                Err(error) => {
                    tracing::debug!(%error, "fleet stream read failed; reconnecting");
                    reader = None;
                    tokio::time::sleep(RECONNECT_BACKOFF).await;
                    continue;
                }
            };
            match next {
                Next::ReadAgain => {}
                Next::Recover => {
                    self.state().recovering = true;
                    self.refresh_fence();
                }
                Next::Wait => {
                    if let Err(error) = self.wait_for_entries(connection).await {
                        tracing::debug!(%error, "fleet stream wait failed; reconnecting");
                        reader = None;
                    }
                }
            }
        }
    }

    /// The consumer's own connection: its blocking reads would hold up
    /// every command queued behind them on a shared one.
    async fn connect_reader(&self) -> Result<Live, FleetError> {
        let connection = self.inner.redis.connection(self.inner.settings.lease / 2);
        Ok(connection.get().await?)
    }

    /// Applies the entries after this member's position, if none were trimmed.
    async fn apply_next(&self, connection: &mut Live) -> Result<Next, FleetError> {
        let (position, begun) = {
            let state = self.state();
            (state.position, ReadBegun::now(&state))
        };
        let read = self.read_after(connection, position, READ_COUNT).await?;
        let read_at = Instant::now();
        if Some(read.since) != begun.fleet_since {
            // Redis lost its data since this member's last renewal (or
            // failed over, or restarted from an older dump): the stream is
            // another than the one its position and catch-up target are
            // in, and the new one's ids, later in Redis's clock, would pass
            // for reaching them. Nothing moves until a renewal takes the new
            // record in; the consumer reads on meanwhile, so the lease is
            // renewed, and at once the first time.
            let first_ask = {
                let mut state = self.state();
                state.last_read_at = Some(read_at);
                state.renewal_asked_for.replace(read.since) != Some(read.since)
            };
            if first_ask {
                self.inner.renewal_wanted.notify_one();
            }
            tokio::time::sleep(RECONNECT_BACKOFF).await;
            return Ok(Next::ReadAgain);
        }
        if read.trimmed > position {
            tracing::warn!(
                %position,
                trimmed_to = %read.trimmed,
                "the insert stream was trimmed past this member: recovering from a snapshot"
            );
            return Ok(Next::Recover);
        }
        let applied_any = !read.entries.ids.is_empty();
        let mut newest = position;
        let (mut remote, mut applied) = (0, 0);
        for entry in &read.entries.ids {
            let keys = match entry.map.get("k") {
                Some(Value::BulkString(encoded)) => decode_keys(encoded),
                _ => None,
            };
            // Not written by a member (every append encodes its keys): no
            // write waits on it, and reading it again would stall the fleet.
            let Some(keys) = keys else {
                tracing::warn!(id = %entry.id, "skipping a stream entry a member did not write");
                newest = entry
                    .id
                    .parse()
                    .map_err(|_| FleetError::UnexpectedReply("stream id"))?;
                continue;
            };
            for key in &keys {
                self.inner.guard.insert(key);
                applied += 1;
                if applied % KEYS_BETWEEN_YIELDS == 0 {
                    tokio::task::yield_now().await;
                }
            }
            let from: Option<String> = entry.get("m");
            if from.as_deref() != Some(self.inner.member.as_str()) {
                remote += keys.len() as u64;
            }
            newest = entry
                .id
                .parse()
                .map_err(|_| FleetError::UnexpectedReply("stream id"))?;
        }
        self.inner.counters.count_remote_inserts(remote);
        let Some((stranded, fleet_since)) =
            self.commit_read(begun, newest, read_at, read.last, read.entries.ids.len())
        else {
            // A renewal found Redis's data lost while this read ran, and sent
            // this member back to the new stream's start: the entries read
            // here are applied, but the position is that one.
            return Ok(Next::ReadAgain);
        };
        if stranded {
            return Ok(Next::Recover);
        }
        self.refresh_fence();
        if applied_any {
            self.announce_applied(newest, fleet_since).await;
            Ok(Next::ReadAgain)
        } else {
            Ok(Next::Wait)
        }
    }

    /// Moves this member to `newest`, where a read `begun` got to
    /// (`entries` applied, the stream ending at `stream_end`). `None`,
    /// nothing moved, when a renewal has sent the member back to a new
    /// stream's start since: its position may look the same (`START`), but
    /// the read was of the old stream. Otherwise whether the member is
    /// stranded (the entries it must hold are gone), and the fleet record
    /// its position belongs to.
    pub(super) fn commit_read(
        &self,
        begun: ReadBegun,
        newest: StreamPosition,
        read_at: Instant,
        stream_end: StreamPosition,
        entries: usize,
    ) -> Option<(bool, Option<u64>)> {
        let mut state = self.state();
        if state.stream_resets != begun.resets {
            return None;
        }
        state.position = newest;
        state.last_read_at = Some(read_at);
        state.stream_end = state.stream_end.max(stream_end);
        // Behind by this read's entries (by at least that many when it
        // filled a whole read).
        state.lag_entries = entries as u64;
        let stranded = match state.catch_up_to {
            Some(target) if newest >= target => {
                state.catch_up_to = None;
                false
            }
            // The stream ended before the entries this member had to hold
            // when the read began (Redis lost them): only a snapshot or a
            // rebuild has them. A target set since, by a renewal that Redis
            // ran after this read, is in the stream: read again.
            Some(_)
                if entries == 0 && begun.catch_up_to.is_some_and(|target| stream_end < target) =>
            {
                true
            }
            _ => false,
        };
        Some((stranded, state.fleet_since))
    }

    /// Publishes this member's position and wakes the writers waiting on
    /// it; not into a Redis whose fleet record is another than the one the
    /// position was read under (`fleet_since`): there it says nothing.
    async fn announce_applied(&self, position: StreamPosition, fleet_since: Option<u64>) {
        if self.state().held_when_made_fresh().is_some() {
            // Waiting to learn whether it holds its record's frontier: not
            // counted by writers until then (see `applied_for_writers`).
            return;
        }
        let keys = &self.inner.keys;
        let announced: Result<(), FleetError> = async {
            let mut connection = self.inner.connection.get().await?;
            let () = ANNOUNCE
                .key(&keys.applied)
                .key(&keys.since)
                .key(&keys.record)
                .key(&keys.stream)
                .arg(&self.inner.member)
                .arg(position)
                .arg(fleet_since.unwrap_or(0))
                .arg(&keys.notices)
                .invoke_async(&mut connection)
                .await?;
            Ok(())
        }
        .await;
        match announced {
            Ok(()) => {}
            // Refused for good, most likely (the `PUBLISH` the script ends
            // with, under an ACL without channel permission): said once.
            Err(FleetError::Redis(error))
                if crate::redis::refused(&error)
                    && !self
                        .inner
                        .announce_refusal_told
                        .swap(true, std::sync::atomic::Ordering::Relaxed) =>
            {
                tracing::warn!(
                    %error,
                    "applied position not announced: refused (an ACL without channel \
                     permission?); the lease renewal carries it, and writers wait for it"
                );
            }
            Err(error) => {
                tracing::debug!(%error, "applied position not announced; the lease renewal will");
            }
        }
    }

    /// Blocks until an entry after this member's position exists (or a
    /// quarter lease passed, to keep the consumer's heartbeat going).
    async fn wait_for_entries(&self, connection: &mut Live) -> Result<(), FleetError> {
        let position = self.state().position;
        let block = self.inner.settings.lease / 4;
        let _: Value = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(1)
            .arg("BLOCK")
            .arg(block.as_millis() as u64)
            .arg("STREAMS")
            .arg(&self.inner.keys.stream)
            .arg(position)
            .query_async(connection)
            .await?;
        self.state().last_read_at = Some(Instant::now());
        Ok(())
    }

    /// Recovers a member the stream left behind: withdraws its lease (so
    /// that writers stop waiting for it), then replaces its set with a
    /// snapshot that covers its gap; while there is none, asks the fleet for
    /// one and, when the guard has a source, rebuilds from it (the rebuild
    /// starts after the member's new position, so the stream after that
    /// position plus the rebuild hold everything). Fenced throughout, and
    /// until caught up after.
    async fn recover(&self) {
        self.inner.counters.count_recovery();
        self.withdraw().await;
        loop {
            let published = self.inner.snapshot_published.notified();
            let unwanted_and_aged = self.refresh_record().await.unwrap_or_else(|error| {
                tracing::debug!(%error, "fleet record not read; trying the snapshot anyway");
                false
            });
            match self.load_covering_snapshot(None).await {
                Ok(Some(_)) => break,
                Ok(None) if unwanted_and_aged && self.takes_the_new_stream().await => break,
                Ok(None) => {}
                Err(error) => tracing::warn!(%error, "fleet snapshot not loaded"),
            }
            self.request_snapshot().await;
            if self.rebuild_from_the_stream_end().await {
                break;
            }
            let _ = tokio::time::timeout(self.inner.settings.lease, published).await;
        }
        self.state().recovering = false;
        match self.renew().await {
            Ok(renewal) => self.renewed(renewal),
            Err(error) => tracing::debug!(%error, "lease not taken after recovering; retrying"),
        }
    }

    /// After a loss that no member can vouch for the keys from before of
    /// (the mark deleted to accept that), with no snapshot to load and the
    /// new stream whole: starts at its start, as a member joining then does.
    /// Only once the record is unmarked a lease after it began (see
    /// `refresh_record`).
    async fn takes_the_new_stream(&self) -> bool {
        if !matches!(self.trimmed_to().await, Ok(trimmed) if trimmed == StreamPosition::START) {
            return false;
        }
        let mut state = self.state();
        state.position = StreamPosition::START;
        state.catch_up_to = None;
        state.fresh_in = state.fleet_since;
        state.held_before = None;
        true
    }

    /// Moves to the stream's end and rebuilds the guard from its source.
    /// `false` when the guard has no source, the rebuild failed, or Redis
    /// began another record since this member last looked.
    async fn rebuild_from_the_stream_end(&self) -> bool {
        let last = async {
            let mut connection = self.inner.connection.get().await?;
            let read = self
                .read_after(&mut connection, StreamPosition::START, 0)
                .await?;
            Ok::<_, FleetError>((read.last, read.since))
        };
        let Ok((last, since)) = last.await else {
            return false;
        };
        let (position_before, moved_to) = {
            let mut state = self.state();
            if Some(since) != state.fleet_since {
                // The end of another record's stream (a restart since this
                // member last looked): no position here, and reported as
                // held it would pass for an entry a restart cut. The next
                // look at the record takes the new one in.
                return false;
            }
            let moved_to = last.max(state.position);
            (std::mem::replace(&mut state.position, moved_to), moved_to)
        };
        match self.inner.guard.rebuild().await {
            Ok(_) => {
                // From the store: it holds what was written before any loss.
                let mut state = self.state();
                state.fresh_in = None;
                state.held_before = None;
                true
            }
            // The guard holds what it held before: so does its position,
            // unless something else moved it meanwhile (a snapshot adopted).
            Err(error) => {
                let mut state = self.state();
                if state.position == moved_to {
                    state.position = position_before;
                }
                drop(state);
                if !matches!(error, RebuildError::NoSource) {
                    tracing::warn!(%error, "rebuild while recovering failed; retrying");
                }
                false
            }
        }
    }

    /// Listens for the fleet's notices: positions applied (waking writers),
    /// snapshots published, snapshots asked for. A subscription whose peer
    /// is gone without a reset (a host lost, a NAT or load balancer that
    /// dropped the idle connection) hears nothing and is told nothing: it is
    /// pinged every lease, and made again when no answer comes within one.
    pub(super) async fn listen(&self) {
        let lease = self.inner.settings.lease;
        let mut told_refused = false;
        for attempt in 0.. {
            let subscribed = match self.inner.redis.notices_client(attempt) {
                Some(client) => tokio::time::timeout(lease, self.subscribe(client)).await,
                None => {
                    tokio::time::sleep(RECONNECT_BACKOFF).await;
                    continue;
                }
            };
            if let Ok(Err(error)) = &subscribed
                && crate::redis::refused(error)
                && !std::mem::replace(&mut told_refused, true)
            {
                // Retried all the same, as the ACL may change: said once.
                tracing::warn!(
                    %error,
                    channel = %self.inner.keys.notices,
                    "the fleet's notices channel is refused (an ACL without channel \
                     permission?): writers learn of each acknowledgement by polling, and no \
                     member hears a snapshot asked for or published"
                );
            }
            if let Ok(Ok(subscription)) = subscribed {
                let (mut sink, mut notices) = subscription.split();
                let mut ping = tokio::time::interval_at(Instant::now() + lease, lease);
                ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                loop {
                    tokio::select! {
                        notice = notices.next() => match notice {
                            Some(notice) => self.take_notice(notice.get_payload_bytes()),
                            None => break,
                        },
                        _ = ping.tick() => {
                            let answered = tokio::time::timeout(lease, sink.ping::<Value>()).await;
                            if !matches!(answered, Ok(Ok(_))) {
                                break;
                            }
                        }
                    }
                }
            }
            tokio::time::sleep(RECONNECT_BACKOFF).await;
        }
    }

    async fn subscribe(&self, client: redis::Client) -> redis::RedisResult<redis::aio::PubSub> {
        let mut subscription = client.get_async_pubsub().await?;
        subscription.subscribe(&self.inner.keys.notices).await?;
        Ok(subscription)
    }

    fn take_notice(&self, notice: &[u8]) {
        match notice {
            b"applied" => self.inner.applied_notices.send_modify(|n| *n += 1),
            b"snapshot" => self.inner.snapshot_published.notify_waiters(),
            b"request" => self.inner.snapshot_requested.notify_one(),
            rebuilt => {
                if let Some(by) = rebuilt.strip_prefix(b"rebuilt ") {
                    self.rebuilt_elsewhere(by);
                }
            }
        }
    }

    async fn request_snapshot(&self) {
        let requested: Result<(), FleetError> = async {
            let mut connection = self.inner.connection.get().await?;
            let _: i64 = redis::cmd("PUBLISH")
                .arg(&self.inner.keys.notices)
                .arg("request")
                .query_async(&mut connection)
                .await?;
            Ok(())
        }
        .await;
        if let Err(error) = requested {
            tracing::debug!(%error, "snapshot not requested");
        }
    }
}

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_through_an_entry_and_a_cut_entry_is_refused() {
        let keys: [&[u8]; 4] = [b"item:1", b"", b"\xff\x00binary", b"item:4"];
        let encoded = encode_keys(&keys);
        assert_eq!(decode_keys(&encoded).unwrap(), keys);
        assert!(decode_keys(&encoded[..encoded.len() - 1]).is_none());
        assert_eq!(decode_keys(&[]).unwrap(), Vec::<&[u8]>::new());
    }
}
