//! Leases and acknowledgements: who is in the fleet, and when a writer may
//! count on every member having applied its insert.
//!
//! Each member holds a lease in the sorted set `{name}:leases`, scored with
//! its expiry on Redis's clock, and publishes the last stream entry it
//! applied in the hash `{name}:applied`. A writer that appended entry `e`
//! waits until every member whose lease is live has applied `e`; a member
//! whose lease runs out stops counting, and it has fenced itself by then
//! (below). Both checks run as Lua scripts, so each sees one instant of
//! Redis's clock.
//!
//! **The clock assumption.** A member times its lease on its own monotonic
//! clock from *before* it sent the renewal, and fences itself an eighth of a
//! lease early; Redis times the same lease from when it ran the renewal, which
//! is later. So a member believes its lease over no later than Redis does,
//! provided its clock and Redis's run at the same rate within an eighth of a
//! lease per lease (NTP-disciplined clocks drift by parts per million) and
//! its lease watch wakes within that eighth: a thread of its own, so that a
//! runtime whose workers are busy does not hold the fence back. Wall clocks are
//! never compared, only durations.
//!
//! **Redis losing its data** (a restart without persistence) loses the
//! leases: members still believe theirs. So `{name}:since` records when
//! Redis's copy of the fleet began, and writers wait until one lease has
//! passed since then before counting on an empty or partial member list; by
//! then every member that held a lease before has either renewed (and is
//! waited for) or fenced itself. A member whose renewal finds a new
//! `since` knows the data was lost: caught up, it republishes a snapshot of
//! what it holds; fenced, it recovers, since what it had not applied yet
//! may be gone. Joiners wait out that same lease before choosing where to
//! start. A writer whose wait spans the loss is not acknowledged: its entry
//! may be gone, and the new stream's positions, later in Redis's clock,
//! would read as past it (each append returns the record it went under, and
//! the acknowledgement compares the record first).
//!
//! A renewal whose reply was lost may have found the lease lapsed, so the
//! next one is not taken as continuous; a reply to a renewal sent before the
//! member gave its lease up (recovering, leaving) is ignored.

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;
use tokio::time::Instant;

use super::position::POSITION_BEFORE;
use super::stream::Appended;
use super::{FleetSync, Lack, StreamPosition};
use crate::error::FleetError;
use crate::sync::unpoisoned;

/// The Lua functions every script that reads the fleet's record begins
/// with (`now_ms()` is Redis's clock in milliseconds).
/// `record_since(since_key, record_key, stream_key)` is when the record began,
/// begun anew (now) when `since_key` is missing (Redis lost its data), when
/// Redis's run id is not the one the record began under (a restart, which
/// may have loaded an older dump, or a failover to a replica that may lack
/// writes), or when it lies in Redis's future (its clock stepped back:
/// writers would wait out the record's first lease until it caught up).
/// `record_key` (a hash) keeps that run id, and a field `r{since}` for each
/// record since the last loss (restarts, failovers and clock steps keep the
/// stream, at `stream_key`; a loss starts the list over), and for each
/// record begun over a kept stream `k{since}`: the stream's newest entry
/// then (a member's entry past it, the restart cut), and the record it
/// began over; and for
/// `record_kept(record_key, known)`: whether the stream holds everything
/// since the record `known` (a member's) began. Records are told apart by
/// name, not by order, and not by entry ids: clocks step and differ.
pub(super) const RECORD_SINCE: &str = r"
-- Redis's clock, in milliseconds.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- The stream's newest entry (`0-0`: none).
local function newest_entry(stream_key)
  local newest = redis.call('XREVRANGE', stream_key, '+', '-', 'COUNT', 1)
  return newest[1] and newest[1][1] or '0-0'
end
local function record_since(since_key, record_key, stream_key)
  local run = string.match(redis.call('INFO', 'server'), 'run_id:(%x+)')
  -- Without a run id, a restart from an older dump would keep the record.
  if not run then
    error('INFO server has no run_id: the fleet cannot tell a restart')
  end
  local now = now_ms()
  local since = tonumber(redis.call('GET', since_key))
  if not since or since > now or redis.call('HGET', record_key, 'run') ~= run then
    local over_kept = since ~= nil
    if not since then
      redis.call('DEL', record_key)
    elseif redis.call('HEXISTS', record_key, 'r' .. since) == 0 then
      -- Written before records were listed: taken as kept.
      redis.call('HSET', record_key, 'r' .. since, 1)
    end
    local over = since
    since = now
    redis.call('SET', since_key, since)
    redis.call('HSET', record_key, 'run', run, 'r' .. since, 1)
    -- Begun over the stream Redis kept, which may have lost its end: members
    -- from before say what they held (the frontier), and what they held
    -- past its newest entry then is gone. `k{since}`: that entry, and the
    -- record this one began over (see `cut_since`, in `RENEW`).
    if over_kept then
      redis.call('HSET', record_key, 'k' .. since, newest_entry(stream_key) .. ' ' .. over)
    end
  end
  return since
end
local function record_kept(record_key, known)
  return redis.call('HEXISTS', record_key, 'r' .. known) == 1
end
-- Whether the snapshot (its manifest at `manifest_key`) holds the keys
-- from before `record`: published under it by a member that held them.
local function covers(manifest_key, record)
  local manifest = redis.call('GET', manifest_key)
  if not manifest then return false end
  local fresh, published_in = string.match(manifest, '^%S+ %S+ %S+ (%d) (%d+)$')
  return fresh == '0' and tonumber(published_in) == tonumber(record)
end
-- Whether the need of the marked record `record` was met: a later record
-- found a snapshot holding what preceded it (listed as `m{record}`, gone
-- with the list at a loss).
local function met(record_key, record)
  return redis.call('HEXISTS', record_key, 'm' .. record) == 1
end
-- Marks the record `record`: a snapshot holding what preceded it is
-- needed. Listed as `n{record}` (and `marks` says a list exists), since a
-- later record that carries the need on takes the mark over.
local function mark(needed_key, record_key, record)
  redis.call('SET', needed_key, record)
  redis.call('HSET', record_key, 'n' .. record, 1, 'marks', 1)
end
-- With the mark deleted (which accepts that what it needed is lost), the
-- list goes too, and the needs it accepted are noted (`a{record}`): a later
-- mark, or a member that held one, must not revive them. (A need met stays
-- listed: a member lacking it loads the snapshot.)
local function forget_marks(record_key)
  if redis.call('HEXISTS', record_key, 'marks') == 0 then return end
  for _, field in ipairs(redis.call('HKEYS', record_key)) do
    local record = string.sub(field, 2)
    if string.sub(field, 1, 1) == 'n'
      and redis.call('HEXISTS', record_key, 'm' .. record) == 0 then
      redis.call('HDEL', record_key, field)
      redis.call('HSET', record_key, 'a' .. record, 1)
    end
  end
  redis.call('HDEL', record_key, 'marks')
end
-- Whether the record `since` needs the keys from before it from a
-- snapshot, and whether the member lacks keys from before an earlier
-- record that the snapshot holds: `{needed, lacks}`.
-- A member that knew an earlier record (`known`, 0: none) marks it first.
-- A marked record's need goes on in a later one that keeps its stream
-- until a snapshot has met it; then it ends (a met need carried on sent
-- members fenced across a restart, fresh in it, to recover for good).
-- A member fresh in a marked record (`fresh_in`; `lacked` = '1': it saw it
-- marked; or listed as marked, the list going with a deleted mark) lacks its
-- keys in a later one too: it is told, to load the snapshot, and while none
-- has met the need it marks the later record itself, whatever became of the
-- mark (a dump saved before it). One fresh there over a kept stream whose set
-- held that record's frontier (`holds`, '0-0': nothing) lacks nothing the
-- record needed: the later record's frontier judges it.
local function snapshot_needed(needed_key, record_key, manifest_key, known, fresh_in, lacked, holds, since)
  local marked = tonumber(redis.call('GET', needed_key))
  if not marked then forget_marks(record_key) end
  if marked and marked ~= since and record_kept(record_key, marked)
    and not met(record_key, marked) then
    if covers(manifest_key, marked) then
      redis.call('HSET', record_key, 'm' .. marked, 1)
    else
      mark(needed_key, record_key, since)
    end
  end
  fresh_in = tonumber(fresh_in)
  local lacks = 0
  if fresh_in ~= 0 and fresh_in ~= since and record_kept(record_key, fresh_in)
    and (marked == fresh_in or lacked == '1'
      or redis.call('HEXISTS', record_key, 'n' .. fresh_in) == 1) then
    -- (Without that frontier, a dump saved before its reports, members
    -- from before report into this record's again.)
    local frontier = redis.call('HGET', record_key, 'f' .. fresh_in)
    if holds == '0-0' or (frontier and position_before(holds, frontier)) then
      lacks = 1
    end
    if not met(record_key, fresh_in) and not covers(manifest_key, fresh_in) then
      mark(needed_key, record_key, since)
    end
  end
  if tonumber(known) ~= 0 and tonumber(known) ~= since then
    mark(needed_key, record_key, since)
  end
  local needed = 0
  if tonumber(redis.call('GET', needed_key)) == since then needed = 1 end
  return needed, lacks
end
";

/// The record as a member that does not renew sees it (recovering):
/// `{since, needed, aged, lacks}` (`KEYS`: since, the record hash, the
/// mark, the snapshot's manifest, the stream; `ARGV[1]`: the record the member renewed
/// in, which it marks as a renewal of a member that is not caught up does;
/// `ARGV[2]`: the lease; `ARGV[3]`, `ARGV[4]`: the record it is fresh in,
/// and whether it saw that one marked): whether the record is marked,
/// whether it is a lease old (every member from before that renews has
/// marked it by then), and whether the member lacks the keys an earlier
/// marked record needed (see `snapshot_needed`).
static RECORD: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &[
            // First: `snapshot_needed` calls it.
            POSITION_BEFORE,
            RECORD_SINCE,
            r"
local since = record_since(KEYS[1], KEYS[2], KEYS[5])
local marks = ARGV[1]
if record_kept(KEYS[2], ARGV[1]) then marks = 0 end
local needed, lacks = snapshot_needed(KEYS[3], KEYS[2], KEYS[4], marks, ARGV[3], ARGV[4], '0-0', since)
local now = now_ms()
local aged = 0
if now >= since + tonumber(ARGV[2]) then aged = 1 end
return {since, needed, aged, lacks}
",
        ]
        .concat(),
    )
});

/// Renews (or takes) this member's lease and publishes its position
/// (`ARGV[3]`), or `0-0` when the member read it under another fleet record
/// than the one in Redis now (`ARGV[4]`, its `since`): a Redis that lost its
/// data has a new stream, which the old position says nothing of.
/// A member from before such a loss (`ARGV[5]`, the record it held a lease
/// in; 0: none) marks `KEYS[5]` with the record: a snapshot holding what
/// preceded it is needed, for as long as the record lasts. Where Redis kept
/// the stream, only a member that was caught up (`ARGV[6]` = 1) marks: one
/// whose lease had lapsed vouches for nothing, and through a failover that
/// lapsed every lease nobody has to; a member fresh in a marked record
/// (`ARGV[7]`; `ARGV[8]` = 1: it saw the mark) carries the need on.
/// Over a kept stream, every member from before also reports the newest
/// entry its set holds with every one before it: at a record's first
/// renewal what it holds now (`ARGV[12]`), at later ones what it held when
/// the record began (`ARGV[11]`; `0-0`: nothing reported). The newest of
/// these is the record's frontier (`f{since}` in `KEYS[6]`), and one the
/// stream no longer holds (Redis cut its end: past the newest entry kept
/// when a record began since the one the entry is of, or gone and past the
/// trim mark) marks the record, whether or
/// not a member was caught up (`ARGV[13]`: what it held when it became
/// fresh in its record over a kept stream, `0-0`: it did not, for
/// `snapshot_needed`; `ARGV[14]`: how long members from before have to
/// report, [`FleetSync::frontier_wait`]). A member whose set holds what a
/// marked record needed (`ARGV[15]`, that record; 0: none) carries the mark
/// on at its first renewal here, where a dump saved before it lost it.
/// Returns
/// `{continuous, last, members, since, needed, kept, trimmed, covered, lacks, frontier, settled}`:
/// whether the lease it held was still live in Redis, the stream's last
/// entry id, how many members hold live leases now, when the fleet's record
/// began (which changes when Redis lost the fleet's data or restarted),
/// whether the record is marked, whether the stream holds everything since
/// the member's record (`ARGV[4]`) began,
/// the newest entry trimmed from the stream, whether the snapshot in
/// `KEYS[8]` holds what preceded the record, whether the member lacks
/// the keys an earlier marked record needed, where what it reported stands
/// ([`Frontier`]: 0, 1, 2), and whether the record's frontier is settled
/// (the record began on a new stream, or is `ARGV[14]` old). Drops
/// lapsed members on the way.
///
/// The lease counts as continuous only where the member's last renewal
/// taken in (`ARGV[10]`, its token) is the one that took it, by `KEYS[9]`,
/// where each run leaves its own token (`ARGV[9]`): a cluster client
/// resends a command whose reply it lost, and that resend finds the lease
/// its first run took, which may have found it lapsed.
static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &[
            POSITION_BEFORE,
            RECORD_SINCE,
            r"
-- Whether a restart cut the entry `held`: it is past the newest entry the
-- stream kept when a record began (`k{record}`) since the one `held` is of.
-- That is `from` where `of_from`, a record before `from` otherwise, whose
-- own start is then looked at too. The records are walked by name from
-- `since` back. `nil` where the list breaks off (a record begun by an
-- earlier build of this crate, which kept `1`).
local function cut_since(record_key, since, from, held, of_from)
  local record, from = tostring(since), tostring(from)
  for _ = 1, 64 do
    if of_from and record == from then return false end
    local kept, over = string.match(redis.call('HGET', record_key, 'k' .. record) or '', '^(%d+%-%d+) (%d+)$')
    if not kept then return nil end
    if position_before(kept, held) then return true end
    if record == from then return false end
    record = over
  end
  return nil
end
local since = record_since(KEYS[3], KEYS[6], KEYS[4])
local now = now_ms()
local previous = redis.call('ZSCORE', KEYS[1], ARGV[1])
local continuous = 0
if previous and tonumber(previous) > now and redis.call('HGET', KEYS[9], ARGV[1]) == ARGV[10] then
  continuous = 1
end
for _, lapsed in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('HDEL', KEYS[2], lapsed)
  redis.call('HDEL', KEYS[9], lapsed)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
-- Leases further ahead than one (Redis's clock stepped back) end within one.
local lease_end = now + tonumber(ARGV[2])
for _, ahead in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. lease_end, '+inf')) do
  redis.call('ZADD', KEYS[1], lease_end, ahead)
end
redis.call('ZADD', KEYS[1], lease_end, ARGV[1])
redis.call('HSET', KEYS[9], ARGV[1], ARGV[9])
local applied = ARGV[3]
if tonumber(ARGV[4]) ~= since then applied = '0-0' end
local kept = 0
if record_kept(KEYS[6], ARGV[4]) then kept = 1 end
-- A member from before: the keys acknowledged then are in its set only.
local marks = ARGV[5]
if kept == 1 and ARGV[6] ~= '1' then marks = 0 end
local needed, lacks = snapshot_needed(KEYS[5], KEYS[6], KEYS[8], marks, ARGV[7], ARGV[8], ARGV[13], since)
local trimmed = redis.call('GET', KEYS[7]) or '0-0'
-- The record's frontier: the newest entry of the kept stream that a member
-- from before holds (with every one before it). Past the newest entry the
-- stream kept when the record began, or past the trim mark and gone from
-- the stream, it was cut (a restart from an older dump): the members at it
-- hold what the stream lost, acknowledged perhaps without the others. (The
-- trim mark moves on with appends, and new entries can take a cut one's id
-- where Redis's clock is behind; the newest entry kept does not move.)
-- At a first renewal in the record, what it holds now, of its record
-- `ARGV[4]` (or, made fresh there, what it held then: of the one before);
-- at later ones, what it held when this record began.
local held, of_from = '0-0', false
if kept == 1 then
  if tonumber(ARGV[4]) ~= since then
    held, of_from = ARGV[12], ARGV[13] == '0-0'
  else
    held = ARGV[11]
  end
end
local frontier, aged = 0, 0
if now >= since + tonumber(ARGV[14]) then aged = 1 end
-- Every member from before has had time to say what it held, or the
-- record began on a new stream, of which none held anything.
local settled = aged
if redis.call('HEXISTS', KEYS[6], 'k' .. since) == 0 then settled = 1 end
if held ~= '0-0' then
  local newest = redis.call('HGET', KEYS[6], 'f' .. since)
  if not newest or position_before(newest, held) then
    newest = held
    redis.call('HSET', KEYS[6], 'f' .. since, held)
  end
  local cut = cut_since(KEYS[6], since, ARGV[4], held, of_from)
    or (position_before(trimmed, held) and #redis.call('XRANGE', KEYS[4], held, held) == 0)
  -- Marked once: a member's later reports, the record aged, would undo
  -- an operator's deletion of the mark at every renewal.
  if (tonumber(ARGV[4]) ~= since or aged == 0) and cut then
    mark(KEYS[5], KEYS[6], since)
    needed = 1
  end
  frontier = 1
  if not position_before(held, newest) then frontier = 2 end
end
-- A member whose set holds what a marked record needed (`ARGV[15]`; 0:
-- none), at its first renewal in a later one: that mark may be gone with a
-- dump saved before it. Carried on while unmet, as a need is (see
-- `snapshot_needed`), unless an operator accepted its loss (`a{record}`).
local held_need = tonumber(ARGV[15])
if held_need ~= 0 and held_need ~= since and tonumber(ARGV[4]) ~= since
  and record_kept(KEYS[6], held_need) and not met(KEYS[6], held_need)
  and not covers(KEYS[8], held_need)
  and redis.call('HEXISTS', KEYS[6], 'a' .. held_need) == 0 then
  mark(KEYS[5], KEYS[6], since)
  needed = 1
end
redis.call('HSET', KEYS[2], ARGV[1], applied)
local covered = 0
if covers(KEYS[8], since) then covered = 1 end
return {continuous, newest_entry(KEYS[4]), redis.call('ZCARD', KEYS[1]), since, needed, kept, trimmed, covered, lacks, frontier, settled}
",
        ]
        .concat(),
    )
});

/// Whether every member with a live lease has applied entry `ARGV[1]`,
/// appended under the record begun at `ARGV[3]`.
/// Returns `{behind, wait_ms, grace_ms, lost}`: how many have not, how long
/// until the last of their leases runs out, how long until the fleet's
/// record is a lease old (writers wait that out: a member from before a
/// loss may not know of it yet), and 1 when the record is another one
/// (Redis lost its data: no member can apply the entry, and the new
/// stream's positions say nothing of it).
static ACKNOWLEDGED: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &[
            RECORD_SINCE,
            POSITION_BEFORE,
            r"
local since = record_since(KEYS[3], KEYS[4], KEYS[5])
if since ~= tonumber(ARGV[3]) then
  return {0, 0, 0, 1}
end
local now = now_ms()
local grace = math.max(0, since + tonumber(ARGV[2]) - now)
local behind, wait = 0, 0
local members = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf', 'WITHSCORES')
for i = 1, #members, 2 do
  local applied = redis.call('HGET', KEYS[2], members[i])
  if not applied or position_before(applied, ARGV[1]) then
    behind = behind + 1
    wait = math.max(wait, tonumber(members[i + 1]) - now)
  end
end
return {behind, wait, grace, 0}
",
        ]
        .concat(),
    )
});

/// How long writers still wait out the fleet record's first lease
/// (`ARGV[1]`), and when the record began (`{wait_ms, since}`), starting it
/// when there is none.
static GRACE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        &[
            RECORD_SINCE,
            r"
local since = record_since(KEYS[1], KEYS[2], KEYS[3])
local now = now_ms()
return {math.max(0, since + tonumber(ARGV[1]) - now), since}
",
        ]
        .concat(),
    )
});

/// Longest pause between two looks at members that are behind, where their
/// announcements go unheard: each look is a script that runs `INFO`.
const LONGEST_POLL: Duration = Duration::from_millis(100);

/// What a renewal found.
pub(super) struct Renewal {
    pub(super) sent_at: Instant,
    /// This renewal's token (see `RENEW`).
    pub(super) token: u64,
    /// The member's lease epoch when it was sent: a reply to a renewal sent
    /// before the member gave its lease up says nothing of the lease now.
    pub(super) epoch: u64,
    /// When the fleet's record in Redis began.
    pub(super) fleet_since: u64,
    pub(super) continuous: bool,
    pub(super) last: StreamPosition,
    pub(super) members: u64,
    /// `{name}:snapshot:needed` marks the record: the keys acknowledged
    /// before it began are in the sets of the members from before only.
    pub(super) snapshot_needed: bool,
    /// The fleet's snapshot holds those keys (published under the record
    /// by a member that held them).
    pub(super) snapshot_covers: bool,
    /// Every record since the member's was begun by a restart, a failover
    /// or a clock step, none by a loss: Redis kept the stream (though a
    /// restart from an older dump or a failover to a replica that lacked
    /// the last writes may have lost its end).
    pub(super) kept: bool,
    /// The newest entry trimmed from the stream (`START`: none).
    pub(super) trimmed: StreamPosition,
    /// The member is fresh in an earlier record whose keys were needed,
    /// and has not loaded them: it recovers (from the snapshot that met the
    /// need, or one under this record).
    pub(super) lacks_what_preceded: bool,
    /// Where what this member held when the record began over a kept
    /// stream (`MemberState::held_before`) stands against the record's
    /// frontier.
    pub(super) frontier: Frontier,
    /// Every member from before the record that reached Redis again within
    /// a lease of it has reported what it held: the record is
    /// [`FleetSync::frontier_wait`] old, or it began on a new stream, of
    /// which no member held anything.
    pub(super) frontier_settled: bool,
}

/// Where a member's set stands against the record's frontier: the newest
/// entry of a kept stream (a restart, a failover) that any member from
/// before the record held, with every entry before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Frontier {
    /// It held nothing of that stream that it reported (it joined since,
    /// or the record began on a new stream).
    NotReported,
    /// Behind another member: it lacks what that one holds, if the
    /// stream lost it.
    Behind,
    /// At the frontier: once it is settled, it vouches for what
    /// preceded the record, as a member caught up through it does.
    At,
}

impl FleetSync {
    /// How long members from before a record over a kept stream have to
    /// report what they held before one at the frontier vouches, which is
    /// for good: a member whose lease was live when Redis went down reaches
    /// it again within its connection's timeout (a lease) and the delay
    /// between attempts, renews within a quarter lease after, and its clock
    /// may run an eighth of a lease apart from Redis's.
    fn frontier_wait(&self) -> Duration {
        2 * self.inner.settings.lease + crate::redis::RECONNECT_MAX_DELAY
    }

    /// Renews this member's lease, publishing its position.
    pub(super) async fn renew(&self) -> Result<Renewal, FleetError> {
        let keys = &self.inner.keys;
        let (position, epoch, fleet_since, leased_in, caught_up, lack, token, taken) = {
            let mut state = self.state();
            state.renewals_sent += 1;
            (
                state.applied_for_writers(),
                state.lease_epoch,
                state.fleet_since,
                state.leased_in,
                !state.fenced,
                state.lack(),
                state.renewals_sent,
                state.renewal_taken,
            )
        };
        let Lack {
            fresh_in,
            lacked,
            held_before,
            holds,
            held_when_made_fresh,
            held_need_of,
        } = lack;
        let sent_at = Instant::now();
        let mut connection = self.inner.connection.get().await?;
        type Reply = (
            u8,
            StreamPosition,
            u64,
            u64,
            u8,
            u8,
            StreamPosition,
            u8,
            u8,
            u8,
            u8,
        );
        let reply: Result<Reply, _> = self
            .run_replicated(
                &mut connection,
                RENEW
                    .key(&keys.leases)
                    .key(&keys.applied)
                    .key(&keys.since)
                    .key(&keys.stream)
                    .key(&keys.snapshot_needed)
                    .key(&keys.record)
                    .key(&keys.trimmed)
                    .key(&keys.manifest)
                    .key(&keys.renewals)
                    .arg(&self.inner.member)
                    .arg(self.inner.settings.lease.as_millis() as u64)
                    .arg(position)
                    // A position in another record's stream is published as 0-0.
                    .arg(fleet_since.unwrap_or(0))
                    .arg(leased_in.unwrap_or(0))
                    .arg(u8::from(caught_up))
                    .arg(fresh_in.unwrap_or(0))
                    .arg(u8::from(lacked))
                    .arg(token)
                    .arg(taken)
                    .arg(held_before)
                    .arg(holds)
                    .arg(held_when_made_fresh)
                    .arg(self.frontier_wait().as_millis() as u64)
                    .arg(held_need_of.unwrap_or(0)),
            )
            .await;
        // A renewal that failed may have run in Redis and found the lease
        // lapsed, and one its replicas do not hold yet would be lost in a
        // failover: either way the next renewal must not count as continuous.
        let (
            continuous,
            last,
            members,
            fleet_since,
            snapshot_needed,
            kept,
            trimmed,
            covers,
            lacks,
            frontier,
            settled,
        ) = reply.inspect_err(|_| {
            self.state().lease_in_doubt = true;
        })?;
        Ok(Renewal {
            sent_at,
            token,
            epoch,
            fleet_since,
            continuous: continuous == 1,
            last,
            members,
            snapshot_needed: snapshot_needed == 1,
            snapshot_covers: covers == 1,
            kept: kept == 1,
            trimmed,
            lacks_what_preceded: lacks == 1,
            frontier: match frontier {
                2 => Frontier::At,
                1 => Frontier::Behind,
                _ => Frontier::NotReported,
            },
            frontier_settled: settled == 1,
        })
    }

    /// Learns the record as it is now without renewing (a recovering member
    /// gave its lease up): a record begun anew since sends this member to
    /// its stream's start with nothing certain from before it, and the mark
    /// may have been set or deleted.
    ///
    /// Returns whether the record is unmarked and a lease old, and this
    /// member lacks nothing an earlier record needed: every member from
    /// before that renews has marked it by then, so no member holds keys
    /// from before it that the fleet still wants.
    pub(super) async fn refresh_record(&self) -> Result<bool, FleetError> {
        let keys = &self.inner.keys;
        let (
            known,
            Lack {
                fresh_in, lacked, ..
            },
        ) = {
            let state = self.state();
            (state.leased_in, state.lack())
        };
        let mut connection = self.inner.connection.get().await?;
        let sent_at = Instant::now();
        let (since, needed, aged, lacks): (u64, u8, u8, u8) = RECORD
            .key(&keys.since)
            .key(&keys.record)
            .key(&keys.snapshot_needed)
            .key(&keys.manifest)
            .key(&keys.stream)
            .arg(known.unwrap_or(0))
            .arg(self.frontier_wait().as_millis() as u64)
            .arg(fresh_in.unwrap_or(0))
            .arg(u8::from(lacked))
            .invoke_async(&mut connection)
            .await?;
        let mut state = self.state();
        if known.is_some() {
            // Marked, if it was to be: once a record is enough.
            state.leased_in = Some(since);
        }
        if state.fleet_since != Some(since) {
            state.fleet_since = Some(since);
            state.stream_resets += 1;
            state.position = StreamPosition::START;
            state.catch_up_to = None;
            // Recovering: it loads a snapshot or rebuilds, replacing what
            // it held.
            state.held_before = None;
            if lacks == 0 {
                state.starts_fresh_in(Some(since));
                // As after a renewal that found the record new: a snapshot
                // adopted now may lack what a member from before holds
                // alone, and the mark saying so comes with that member's
                // next renewal, within a lease.
                state.fresh_until_renewed_after = Some(sent_at + self.inner.settings.lease);
            }
            // Otherwise fresh in the earlier record still: told so at each
            // look until it loads what that one needed.
        }
        state.snapshot_needed = needed == 1;
        Ok(needed == 0 && aged == 1 && lacks == 0)
    }

    /// How long writers still wait out the fleet record's first lease.
    pub(super) async fn grace(&self) -> Result<(Duration, u64), FleetError> {
        let mut connection = self.inner.connection.get().await?;
        let (grace_ms, fleet_since): (u64, u64) = GRACE
            .key(&self.inner.keys.since)
            .key(&self.inner.keys.record)
            .key(&self.inner.keys.stream)
            .arg(self.inner.settings.lease.as_millis() as u64)
            .invoke_async(&mut connection)
            .await?;
        Ok((Duration::from_millis(grace_ms), fleet_since))
    }

    /// Gives up this member's lease at once (leaving, or recovering), so
    /// that writers stop waiting for it.
    pub(super) async fn withdraw(&self) {
        self.state().give_up_lease();
        self.refresh_fence();
        let keys = &self.inner.keys;
        let withdrawn: Result<(), FleetError> = async {
            let mut connection = self.inner.connection.get().await?;
            redis::pipe()
                .zrem(&keys.leases, &self.inner.member)
                .ignore()
                .hdel(&keys.applied, &self.inner.member)
                .ignore()
                .hdel(&keys.renewals, &self.inner.member)
                .ignore()
                .exec_async(&mut connection)
                .await?;
            Ok(())
        }
        .await;
        if let Err(error) = withdrawn {
            tracing::debug!(%error, "lease not withdrawn; it will lapse");
        }
    }

    /// Waits until every member holding a live lease has applied `appended`,
    /// or its lease ran out.
    ///
    /// # Errors
    /// [`FleetError::EntryLost`] once Redis began another record.
    pub(super) async fn wait_for_members(&self, appended: Appended) -> Result<(), FleetError> {
        let Appended { entry, since } = appended;
        let started = Instant::now();
        let keys = &self.inner.keys;
        let mut notices = self.inner.applied_notices.subscribe();
        let mut connection = self.inner.connection.get().await?;
        loop {
            let (behind, wait_ms, grace_ms, lost): (u64, u64, u64, u8) = ACKNOWLEDGED
                .key(&keys.leases)
                .key(&keys.applied)
                .key(&keys.since)
                .key(&keys.record)
                .key(&keys.stream)
                .arg(entry)
                .arg(self.inner.settings.lease.as_millis() as u64)
                .arg(since)
                .invoke_async(&mut connection)
                .await?;
            if lost == 1 {
                return Err(FleetError::EntryLost);
            }
            if behind == 0 && grace_ms == 0 {
                let latency = started.elapsed();
                self.inner.counters.record_ack(latency);
                #[cfg(feature = "metrics")]
                crate::metrics::record_fleet_ack(self.inner.guard.name(), latency);
                return Ok(());
            }
            let waited = started.elapsed();
            if waited >= self.inner.settings.ack_timeout {
                return Err(FleetError::Unacknowledged {
                    waited,
                    members_behind: behind + u64::from(grace_ms > 0),
                });
            }
            let grace = Duration::from_millis(grace_ms);
            if behind == 0 {
                // Only time ends the record's first lease: no look sooner.
                let left = self.inner.settings.ack_timeout - waited;
                tokio::time::sleep(grace.min(left)).await;
                continue;
            }
            // A member's announcement wakes the wait; the longest pause is
            // for one that is lost (the notice subscriber reconnecting, or
            // an announcement that failed, which its next renewal makes).
            // No acknowledgement can come before the grace ends: looking
            // sooner is wasted.
            let pause = Duration::from_millis(wait_ms.max(1))
                .max(grace)
                .min(LONGEST_POLL)
                .min(self.inner.settings.lease / 8);
            tokio::select! {
                _ = notices.changed() => {}
                () = tokio::time::sleep(pause) => {}
            }
        }
    }

    /// Keeps the lease: renews every quarter lease while the consumer is
    /// reading; a member that stopped reading (stalled, recovering) lets its
    /// lease lapse, so that writers stop waiting for it.
    pub(super) async fn keep_lease(&self) {
        let period = self.inner.settings.lease / 4;
        loop {
            if self.consumer_is_reading() {
                match self.renew().await {
                    Ok(renewal) => self.renewed(renewal),
                    Err(error) => tracing::debug!(%error, "lease not renewed"),
                }
                if self.state().settings_unchecked {
                    self.check_settings_again().await;
                }
            }
            #[cfg(feature = "metrics")]
            self.publish_metrics();
            tokio::select! {
                () = tokio::time::sleep(period) => {}
                () = self.inner.renewal_wanted.notified() => {}
            }
        }
    }

    /// Starts the thread that fences the guard when its lease runs out. A
    /// thread of its own, not one of the member's tasks: a runtime whose
    /// workers are all busy (a blocking call in a handler, CPU-bound work)
    /// runs a timer late, past the lease, while writers that counted this
    /// member out once its lease lapsed in Redis complete writes it has not
    /// applied. It sleeps on the member's state until the lease changes or
    /// runs out, and ends with the [`LeaseWatch`].
    pub(super) fn watch_lease(&self) -> std::io::Result<LeaseWatch> {
        self.state().lease_watched = true;
        let member = self.clone();
        let thread = std::thread::Builder::new()
            .name("bloomguard-lease".to_owned())
            .spawn(move || member.fence_when_the_lease_runs_out());
        match thread {
            Ok(thread) => Ok(LeaseWatch {
                member: self.clone(),
                thread: Some(thread),
            }),
            Err(error) => {
                self.state().lease_watched = false;
                Err(error)
            }
        }
    }

    fn fence_when_the_lease_runs_out(&self) {
        let mut state = self.state();
        while state.lease_watched {
            let now = Instant::now();
            self.refresh_fence_holding(&mut state, now);
            state = match state.fence_at {
                Some(at) if at > now => {
                    unpoisoned(self.inner.lease_changed.wait_timeout(state, at - now)).0
                }
                _ => unpoisoned(self.inner.lease_changed.wait(state)),
            };
        }
    }
}

/// The running lease watch of [`FleetSync::watch_lease`]: dropped, it stops
/// the thread and waits for it (at once: the thread only sleeps on the
/// member's state, which no one holds for long).
pub(super) struct LeaseWatch {
    member: FleetSync,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for LeaseWatch {
    fn drop(&mut self) {
        // Under the state lock, which the thread holds from checking the
        // flag until it sleeps: the wake-up cannot fall between the two.
        self.member.state().lease_watched = false;
        self.member.inner.lease_changed.notify_all();
        if let Some(thread) = self.thread.take() {
            // Its panic, if any, was reported by the panic hook already.
            let _ = thread.join();
        }
    }
}
