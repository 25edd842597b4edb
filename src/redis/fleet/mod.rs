//! A fleet of service instances that keeps the one rule together, through Redis.
//!
//! **To set one up**, see the example on [`FleetSync`]: every instance builds
//! its guard with the same size, rate and seed, joins, and writes through
//! [`FleetSync::insert_then_write`]. The rest of this page is the contract
//! and how it holds through faults, for whoever operates the fleet.
//!
//! **The contract.** Once a fleet write completes —
//! [`FleetSync::insert_then_write`] returned `Ok`, or
//! [`FleetWrite::finish`] did after the store write — no member of the fleet
//! answers `Absent` for its key until its lifecycle forgets it (a rotation
//! window ends, or a rebuild runs after the store dropped it). A member that
//! cannot show that it has applied every insert acknowledged to a writer is
//! **fenced**: it answers `MaybePresent` (a fenced member costs backend
//! calls, never wrong answers), says so in [`FleetSync::stats`], and answers
//! `Absent` again once it has caught up. A failed append means the write is
//! not made.
//!
//! How it holds:
//! - **Acknowledged inserts** (`membership.rs`). A write inserts into the
//!   local guard, appends the key to the stream `{name}:inserts`, and waits
//!   until every member holding a live lease has applied it (members publish
//!   the last entry they applied; a notice wakes the writers), or until the
//!   lease of each one that has not has run out. Then it writes the store.
//!   Normal cost: one apply latency; worst case: one lease, or about two
//!   and a half after a restart or failover that members lived through
//!   fenced (they settle first: below).
//! - **Leases and fencing.** Each member renews a lease in Redis every
//!   quarter lease, timed on its own clock from before the renewal, and fences
//!   itself when it runs out (the clock assumption is spelled out in
//!   `membership.rs` and below). A member whose lease lapsed, or that just
//!   joined, stays fenced until it has applied the stream up to the last entry
//!   that existed when it renewed.
//! - **Catching up** (`stream.rs`). A member reads the stream in order and
//!   notices when it was trimmed past its position: then it withdraws its
//!   lease, fences, and recovers from the latest snapshot plus the stream
//!   after it, asking the fleet for a fresh snapshot when none covers its gap,
//!   and rebuilding from its own source meanwhile when it has one.
//! - **Snapshots of the whole live set** (`snapshot.rs`). Every filter of a
//!   rotating or growing guard, with its window or capacity, and the stream
//!   position it covers. A member that joins or recovers **replaces** its live
//!   set with the snapshot and replays the stream from its position (fenced
//!   meanwhile); a warming guard leaves warming through the fleet only this
//!   way, with the snapshot's coverage proven (nothing after its position was
//!   trimmed from the stream). Publishing trims the stream to the previous
//!   snapshot's position, so retention follows the snapshot period.
//! - **Writes slower than the write settle.** A member's own rebuild covers
//!   a remote insert whose store write lands within the write settle of the
//!   append (its rebuild waits that long before reading its source). A write
//!   that took longer than half the settle appends its key once more when it
//!   has landed, and waits for that to be acknowledged too, so a rebuild that
//!   started meanwhile gets the key from the stream.
//! - **Redis losing its data** (a restart without persistence), **or some
//!   of it** (a restart from an older dump, a failover to a replica), **or
//!   its clock stepping back.** The fleet's record (`{name}:since`) begins
//!   anew when it is gone, when Redis's run id is not the one it began
//!   under, or when it begins in Redis's future: writers wait out its first
//!   lease again, and members replay the stream (from where it was trimmed
//!   where Redis kept it, from its start where it is new). The keys
//!   acknowledged before a loss are then in the sets of the members that
//!   lived through it, and nowhere else: the first renewal of each marks
//!   the record (`{name}:snapshot:needed`), and they are asked at every
//!   renewal until one of them has published a snapshot. For as long as the
//!   record lasts, a member that started at the new stream's start holds
//!   none of those keys: it recovers (fenced) from that snapshot, or from a
//!   rebuild of its own source. A later record over the kept stream (a
//!   restart, a failover) carries the mark on until a snapshot has met the
//!   need, which then ends; a member still without those keys loads that
//!   snapshot, and while none has met the need it marks the later record
//!   itself (a dump saved before the mark was). A member from before that does
//!   not renew within the new record's first lease (stalled) is not known to
//!   the ones that join meanwhile. A member that was fenced when the record
//!   began anew counts as starting afresh, and stays fenced until a renewal a
//!   lease later says whether the record is marked; over a kept stream only
//!   members that were caught up mark it. Over a kept stream,
//!   every member from before also reports the newest entry its set held
//!   (with every one before it) when the record began: the newest of these
//!   is the record's **frontier**, and one a restart from an older dump cut
//!   (past the newest entry the stream had when a record began since the
//!   one the entry is of) marks the record as well, however many entries
//!   are appended or trimmed meanwhile, and across restarts (up to 64
//!   records back). A member whose last renewal found its record marked,
//!   while its set held what preceded it (it lived through the record's
//!   start caught up, vouched at its frontier, or took a snapshot or a
//!   rebuild that holds it), carries the mark into the next record at its
//!   first renewal there while the need is neither met, covered by the
//!   snapshot in Redis, nor accepted: a dump saved before the mark lost it.
//!   (A member that joins by taking such a snapshot and meets a restart
//!   before it renews carries nothing.) Deleting the mark accepts the
//!   need. Every
//!   member that counts as starting afresh there (made fresh by the change,
//!   or joining or recovering since) waits, fenced, until the record is two
//!   leases and half a second old, by when every member from before that
//!   reached Redis again within a lease of it has reported. Then one made
//!   fresh by the change vouches for what preceded the record if it holds
//!   the frontier, as a caught-up member does; the others recover from a
//!   snapshot that holds what preceded the record where it is marked, and
//!   go on with the stream where it is not. Writers do not count a member
//!   fresh there as having applied anything until then (what it applies
//!   meanwhile it would not report at a second restart), so a write in
//!   those seconds waits for it. So after a restart from an older dump,
//!   what a lapsed member or a joiner lacks comes from the snapshot of a
//!   member that was caught up or holds the frontier, also when no member
//!   was caught up (Redis down for longer than a lease), and a renewal
//!   sent while caught up that waits out the outage (it marks the record,
//!   and its member, fenced by then, counts as fresh) no longer leaves the
//!   fleet without a member to vouch. A member from before that does not
//!   renew by then (stalled, slow to reach Redis again, or gone for good)
//!   is not known: what it alone held is lost with it. A failover back to
//!   a master that never resynced keeps its run id, and is not noticed.
//! - **One configuration per fleet.** The first member records the settings
//!   that must agree (seed, size, rate, lifecycle, write settle, lease, and
//!   the version of what members write for each other) under
//!   `{name}:settings`; a member configured otherwise refuses to join with
//!   [`FleetError::SettingsDiffer`]. A joiner checks them after waiting out
//!   a young record's first lease, and the members running record theirs
//!   again at their first renewal after Redis lost its data: so after a
//!   loss the members from before record first, and a member that finds
//!   another's settings there fences itself until it leaves (logged at
//!   ERROR; restart it configured as the fleet is).
//!
//! **What the fleet does not cover.**
//! - A Redis that evicts keys it holds without a TTL (`maxmemory-policy`
//!   `allkeys-*`) may evict a lease or the record, and cost a member
//!   acknowledged inserts: a member warns at join when it can read the
//!   policy. Use `noeviction`, or a `volatile-*` policy.
//! - Keys inserted with [`Guard::insert`] alone reach no other member, and a
//!   member that replaces its set from a snapshot forgets them: in a fleet,
//!   write through the `FleetSync`.
//! - A Redis failover to an asynchronous replica can lose acknowledged
//!   entries without the members noticing, unless appends and renewals wait
//!   for replicas ([`wait_for_replicas`](FleetSyncBuilder::wait_for_replicas)).
//!   A restart or a failover is noticed (Redis's run id changes, and the
//!   fleet's record begins anew) and handled either way.
//! - Members without a source recover only from snapshots: if every one of
//!   them falls behind the trimmed stream at once, none can publish one and
//!   all stay fenced (answering `MaybePresent`) until one is restarted with
//!   a snapshot to load. [`snapshot_every`](FleetSyncBuilder::snapshot_every)
//!   keeps one at hand. The same holds after Redis lost its data when no
//!   member from before can vouch for the keys acknowledged before (none is
//!   left, or each was fenced when it happened, as when Redis was down for
//!   longer than a lease, or still waiting for the frontier of a record that a
//!   restart began seconds before): deleting `{name}:snapshot:needed` accepts
//!   that those keys are lost, and the members take the new stream (a restart
//!   within a lease of the deletion may have them mark the next record, and so
//!   may a member reporting an entry Redis cut, at its first renewal in a
//!   record: delete it again). A member cut off from Redis for all of one
//!   record that still lacked the keys a loss before it needed can also leave
//!   such a fleet fenced with a mark no member can meet, and so can a member
//!   that reported the newest entry of a kept stream that Redis cut and did
//!   not come back to vouch for it. Members with a source rebuild; without
//!   one, deleting the mark ends it, as above. A restart from a
//!   dump saved before the record it ends began (a failover, a restart or
//!   a clock step began that record, and Redis saved nothing since) is
//!   taken for a new stream: every member replays the restored one from
//!   its start, finds it trimmed, and recovers, fenced, and none can
//!   publish. Members with a source rebuild; without one, deleting the
//!   mark has them adopt the dump's snapshot and lose every key
//!   acknowledged after the dump was saved. Have Redis persist every write
//!   (`appendonly yes`) or give a member a source.
//!
//! **Clocks.** Durations are measured on each machine's monotonic clock and on
//! Redis's; no wall clock is compared. The leases assume that these clocks
//! run at the same rate within an eighth of a lease over a lease, and that
//! the member's lease watch, a thread of its own that sets the fence when
//! the lease runs out, is not kept off a core for that long. A runtime
//! whose workers are all blocked (a synchronous call in a handler, on a
//! `current_thread` runtime) does not hold the fence back; a process paused
//! as a whole past its lease (a debugger, `SIGSTOP`, a frozen VM) may answer
//! from a stale set as it resumes, until that thread has run. A pause that
//! the monotonic clock does not count (the host suspended; a VM paused, on
//! hypervisors that stop the guest's clock with it) is unseen by that
//! thread: the member answers from its set for up to the rest of its lease
//! after it resumes, though writers counted it out meanwhile. Take a member
//! out of service before suspending its host.
//! Redis times leases on its wall clock: a step back begins the record
//! anew (above), but a step forward by more than an eighth of a lease can
//! lapse live leases in Redis's eyes, and writers then count out members that
//! still answer, until their next renewal (a quarter lease). Keep Redis's host
//! on a clock that slews rather than steps (chrony and ntpd step only at boot
//! by default).
//!
//! **The seed travels in the clear.** Snapshots in Redis carry the fleet's
//! seed in their header, and whoever knows the seed can craft keys that
//! defeat the guard (see SECURITY.md in the repository): read access to these
//! Redis keys is part of the secret, and write access lets a writer replace
//! the fleet's filter. Keep them behind Redis ACLs.
//!
//! All keys of a fleet share the hash tag `{name}`, so they live in one slot:
//! on a Redis Cluster ([`FleetSync::cluster_builder`]) one master serves the
//! whole fleet, and [`wait_for_replicas`](FleetSyncBuilder::wait_for_replicas)
//! keeps the contract across its failover. Moving that slot to another
//! master (resharding) stops the fleet while it moves: the fleet's scripts
//! name keys that are absent by design (a snapshot not yet asked for), and
//! a migrating slot answers such a script `TRYAGAIN`, so members fence and
//! writes fail until the move ends; the new master then begins a new
//! record, as a failover does (writes wait out its first lease). Move it
//! at a quiet time.

mod membership;
mod position;
mod rebuilds;
mod snapshot;
mod stats;
mod stream;

pub use crate::error::{FleetError, FleetWriteError, InvalidStreamPosition};
pub use position::StreamPosition;
pub use stats::FleetStats;

use std::fmt;
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use redis::Client;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::Connection;
use crate::guard::{Guard, MAX_DURATION, PendingWrite};
use crate::sync::unpoisoned;
use crate::task::StoppableTask;
use membership::{Frontier, Renewal};
use snapshot::SnapshotId;
use stats::FleetCounters;

/// One instance's membership of its fleet. Cheap to clone. See the
/// [module docs](crate::redis::fleet) for the contract it keeps.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use bloomguard::Guard;
/// use bloomguard::redis::fleet::FleetSync;
///
/// // Every instance: the same size, rate and seed.
/// let guard = Guard::builder().name("items").expected_items(1_000_000).seed(0x5eed).build()?;
/// let client = redis::Client::open("redis://127.0.0.1:6379")?;
/// let fleet = FleetSync::builder(guard.clone(), client, "items").build();
/// let membership = fleet.join().await?; // fenced until caught up with the fleet
/// let store = std::sync::Mutex::new(std::collections::HashMap::new());
/// fleet
///     .insert_then_write("item:42", async { store.lock().unwrap().insert("item:42", "…") })
///     .await?; // now no instance answers Absent for item:42
/// membership.shutdown().await; // leaves the fleet; the guard stays fenced
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct FleetSync {
    inner: Arc<Inner>,
}

struct Inner {
    guard: Guard,
    redis: FleetRedis,
    /// Commands, scripts and renewals; the consumer's blocking reads have
    /// their own connection.
    connection: Connection,
    keys: Keys,
    /// This member's id in the fleet's lease set.
    member: String,
    settings: Settings,
    state: Mutex<MemberState>,
    /// Bumped whenever a member announces what it applied; writers waiting
    /// for acknowledgements watch it.
    applied_notices: watch::Sender<u64>,
    /// Whether a refused announcement (an ACL) was logged at WARN.
    announce_refusal_told: std::sync::atomic::AtomicBool,
    /// Wakes the lease watch thread when the lease changed (with `state`).
    lease_changed: Condvar,
    /// A snapshot was published (a recovering member waits for one).
    snapshot_published: Notify,
    /// A member asked for a snapshot.
    snapshot_requested: Notify,
    /// Wakes the lease keeper to renew now (the consumer read a stream of a
    /// record this member has not taken in).
    renewal_wanted: Notify,
    counters: FleetCounters,
    /// Keys of slow writes to announce as landed again (`announce_landed`).
    landed_unannounced: Mutex<LandedUnannounced>,
}

/// Keys of slow writes whose second append is still to be made, and
/// whether a task is making it: one task per member, however many such
/// writes there are, and each key once.
#[derive(Default)]
struct LandedUnannounced {
    keys: std::collections::HashSet<Vec<u8>>,
    announcing: bool,
}

/// Where a fleet's Redis is: one node, or a cluster (with its seed nodes:
/// the notice subscriber connects to one of them, since every node of a
/// cluster hears every `PUBLISH`).
#[derive(Clone)]
enum FleetRedis {
    Node(Client),
    Cluster {
        client: Box<redis::cluster::ClusterClient>,
        seeds: Vec<String>,
    },
}

impl fmt::Debug for FleetRedis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Node(client) => f.debug_tuple("Node").field(client).finish(),
            Self::Cluster { seeds, .. } => f.debug_struct("Cluster").field("seeds", seeds).finish(),
        }
    }
}

impl FleetRedis {
    /// A connection of its own, timing out calls after `timeout`.
    fn connection(&self, timeout: Duration) -> Connection {
        match self {
            Self::Node(client) => Connection::new(client.clone(), timeout),
            Self::Cluster { client, .. } => Connection::cluster(client.as_ref().clone(), timeout),
        }
    }

    /// A client of one node, for the notices (the `attempt`-th seed of a cluster).
    fn notices_client(&self, attempt: usize) -> Option<Client> {
        match self {
            Self::Node(client) => Some(client.clone()),
            Self::Cluster { seeds, .. } => Client::open(seeds[attempt % seeds.len()].as_str()).ok(),
        }
    }
}

/// The Redis keys of one fleet, all under the hash tag `{name}`.
struct Keys {
    /// The fleet's name, the hash tag of every key below.
    name: String,
    stream: String,
    /// The newest entry trimmed from the stream.
    trimmed: String,
    leases: String,
    applied: String,
    /// The token of each member's last renewal to run (a hash).
    renewals: String,
    since: String,
    /// The Redis run id the record in `since` began under, and the records
    /// since the last loss (a hash).
    record: String,
    settings: String,
    manifest: String,
    snapshot_version: String,
    snapshot_lock: String,
    /// The record whose members need the keys acknowledged before it began
    /// (Redis lost them) from a snapshot (see `snapshot`).
    snapshot_needed: String,
    rebuild_lock: String,
    notices: String,
}

impl Keys {
    fn new(name: &str) -> Self {
        let key = |suffix: &str| format!("{{{name}}}:{suffix}");
        Self {
            name: name.to_owned(),
            stream: key("inserts"),
            trimmed: key("inserts:trimmed"),
            leases: key("leases"),
            applied: key("applied"),
            renewals: key("renewals"),
            since: key("since"),
            record: key("since:record"),
            settings: key("settings"),
            manifest: key("snapshot"),
            snapshot_version: key("snapshot:version"),
            snapshot_lock: key("snapshot:lock"),
            snapshot_needed: key("snapshot:needed"),
            rebuild_lock: key("rebuild:lock"),
            notices: key("notices"),
        }
    }

    /// A snapshot's chunk, named by the record it was published under as
    /// well as its version: a loss resets the version counter, and a
    /// publish that took its version before would otherwise write over the
    /// chunks of one published after.
    fn chunk(&self, snapshot: SnapshotId, index: usize) -> String {
        let SnapshotId { since, version } = snapshot;
        format!("{}:{since}:{version}:{index}", self.manifest)
    }
}

#[derive(Debug, Clone)]
struct Settings {
    lease: Duration,
    ack_timeout: Duration,
    stream_max_len: usize,
    chunk_bytes: usize,
    snapshot_every: Option<Duration>,
    /// Replicas that must hold each append and renewal before it counts.
    replicas: usize,
}

/// What this member knows of its standing in the fleet. Never held across
/// an `.await`.
#[derive(Debug, Default)]
struct MemberState {
    /// The stream entry this member applied last.
    position: StreamPosition,
    /// The fleet record a read found, not yet this member's, that it asked
    /// for a renewal at once for (one ask per record: renewals that fail go
    /// on at their pace).
    renewal_asked_for: Option<u64>,
    /// When to fence unless renewed first: the lease as this member times it,
    /// an eighth early. `None`: no lease (not joined, left, recovering).
    fence_at: Option<Instant>,
    renewed_at: Option<Instant>,
    /// Fenced until the stream is applied up to here (after joining, or
    /// renewing a lease that had lapsed).
    catch_up_to: Option<StreamPosition>,
    /// The stream was trimmed past this member: it needs a snapshot, or a
    /// rebuild of its own.
    recovering: bool,
    /// Another member published its rebuilt set (this snapshot): replace
    /// ours with it.
    rebuilt_elsewhere: Option<SnapshotId>,
    /// Bumped whenever this member gives its lease up.
    lease_epoch: u64,
    /// A renewal failed: it may have found the lease lapsed.
    lease_in_doubt: bool,
    /// Renewals sent: each one's token is the count with it.
    renewals_sent: u64,
    /// The token of the last renewal whose reply was taken in (0: none).
    /// Redis counts a renewal as continuous only where the lease was last
    /// taken by that one, not by a first run of the same renewal.
    renewal_taken: u64,
    /// When the fleet's record in Redis began, as of the last renewal.
    fleet_since: Option<u64>,
    /// The record (its `fleet_since`) from whose stream's start this
    /// member's set holds keys, when it holds none from before it: it
    /// started there without a snapshot, or adopted one of a member that
    /// did. `None`: it holds those from before too (it lived through the
    /// record's change, or adopted a snapshot or a rebuild that did).
    fresh_in: Option<u64>,
    /// The newest entry of the stream that this member's set held, with
    /// every one before it, when the record began over a kept stream (a
    /// restart, a failover), whose end Redis may have lost (a restart from
    /// an older dump). Reported at each renewal: the newest over all
    /// members from before is the record's frontier (see `Frontier`).
    /// While the member is fresh in the record, its position says nothing
    /// of what it holds past this: the stream may have a hole there. `None`:
    /// nothing held from before, or its position says it all.
    held_before: Option<StreamPosition>,
    /// Whether the last renewal found the keys from before a data loss
    /// wanted in a snapshot (`{name}:snapshot:needed`).
    snapshot_needed: bool,
    /// This member's record, as of its last renewal, where that said it is
    /// marked and this member's set holds what preceded it (not fresh in
    /// it, lacking nothing an earlier one needed): a dump saved before the
    /// mark loses it, and this member's first renewal in a later record
    /// carries it on while unmet.
    held_need_of: Option<u64>,
    /// Whether a renewal has confirmed the record this member chose its
    /// position (and `fresh_in`) under: one that finds another at once
    /// says its set holds nothing certain of either.
    record_confirmed: bool,
    /// The record this member last renewed in: only such a member marks
    /// the next one as needing what preceded it.
    leased_in: Option<u64>,
    /// Made fresh by a record that began anew: fenced until a renewal sent
    /// after this says whether the record is marked (every member from
    /// before that renews, and was caught up, has marked it by then).
    fresh_until_renewed_after: Option<Instant>,
    /// Times a renewal found the record new and sent this member back to
    /// the start of the new stream: a read begun before one is not applied
    /// as a position, even where the position looks unchanged.
    stream_resets: u64,
    /// When the consumer last read the stream (a renewal needs a live consumer).
    last_read_at: Option<Instant>,
    /// Whether the guard is fenced now.
    fenced: bool,
    /// Whether the lease watch thread should go on (`FleetSync::watch_lease`).
    lease_watched: bool,
    /// Redis lost its data, the fleet's settings with it: record ours again
    /// (or find another member's), as the join did.
    settings_unchecked: bool,
    /// The settings recorded after a loss are another member's: fenced for
    /// good, since rebuilds made under one write settle miss the slow writes
    /// of the other.
    settings_differ: bool,
    /// Times the live set was replaced from a snapshot.
    replacements: u64,
    members: u64,
    /// The stream's newest entry, as of the last read or renewal.
    stream_end: StreamPosition,
    lag_entries: u64,
}

impl MemberState {
    /// What a renewal tells Redis of the keys from before a record this
    /// member may lack.
    fn lack(&self) -> Lack {
        let lacked = self.snapshot_needed && self.fresh_in_its_record();
        Lack {
            fresh_in: self.fresh_in,
            lacked,
            held_before: self.held_before.unwrap_or_default(),
            holds: self.holds_up_to(),
            held_when_made_fresh: self.held_when_made_fresh().unwrap_or_default(),
            held_need_of: self.held_need_of.filter(|_| !self.fresh_in_its_record()),
        }
    }

    /// What this member held when it became fresh in its record over a
    /// kept stream: past it, the stream may lack entries that other members
    /// hold, whatever its position says.
    fn held_when_made_fresh(&self) -> Option<StreamPosition> {
        self.held_before.filter(|_| self.fresh_in_its_record())
    }

    /// Whether this member is fresh in the record it renewed in last (see
    /// `fresh_in`): its set holds nothing certain from before that record.
    fn fresh_in_its_record(&self) -> bool {
        self.fresh_in.is_some() && self.fresh_in == self.fleet_since
    }

    /// The position writers count this member as having applied: none while
    /// it waits to learn whether it holds the frontier of a record over a
    /// kept stream. It holds what it applies since, but reports what it
    /// held when made fresh: a write acknowledged on its position then, and
    /// cut by a second restart, would be reported by no member.
    fn applied_for_writers(&self) -> StreamPosition {
        if self.held_when_made_fresh().is_some() {
            StreamPosition::START
        } else {
            self.position
        }
    }

    /// Fresh in `record` from its stream's start (joined there, or adopted a
    /// snapshot of a member that was): where that stream was kept and its
    /// frontier is not settled yet, its position may run past a hole that
    /// other members' reports have still to show, so it reports nothing,
    /// and writers do not count it, until the frontier settles (its first
    /// renewal clears this where the record began on a new stream).
    fn starts_fresh_in(&mut self, record: Option<u64>) {
        self.fresh_in = record;
        self.held_before = record.map(|_| StreamPosition::START);
    }

    /// The newest entry of its record's stream that this member's set holds
    /// with every one before it.
    fn holds_up_to(&self) -> StreamPosition {
        self.held_when_made_fresh()
            .unwrap_or_else(|| self.held_before.unwrap_or_default().max(self.position))
    }

    /// This member no longer counts on its lease: a renewal's reply still
    /// on its way says nothing of a lease now (its epoch is stale), and the
    /// next renewal taken in is not continuous whatever Redis says. A
    /// renewal this member never took in may have taken the lease again
    /// meanwhile (one of a dropped join, one resent after a `NOSCRIPT`),
    /// while writers had counted this member out.
    fn give_up_lease(&mut self) {
        self.lease_epoch += 1;
        self.fence_at = None;
        self.lease_in_doubt = true;
    }

    fn must_fence(&self, now: Instant) -> bool {
        self.fence_at.is_none_or(|at| now >= at)
            || self.catch_up_to.is_some()
            || self.recovering
            || self.fresh_until_renewed_after.is_some()
            || self.settings_differ
    }
}

/// What [`MemberState::lack`] tells.
struct Lack {
    /// The record this member is fresh in (see `MemberState::fresh_in`).
    fresh_in: Option<u64>,
    /// It saw that record marked: it lacks the keys the record needs, and
    /// goes on lacking them in a record that keeps its stream.
    lacked: bool,
    /// What it held when the record began (`START`: nothing reported).
    held_before: StreamPosition,
    /// What it holds now ([`MemberState::holds_up_to`]): what it held
    /// before, should the renewal find the record begun anew.
    holds: StreamPosition,
    /// [`MemberState::held_when_made_fresh`] (`START`: none): at an earlier
    /// marked record's frontier, it lacks nothing that record needed.
    held_when_made_fresh: StreamPosition,
    /// `MemberState::held_need_of`, while its set holds what preceded it.
    held_need_of: Option<u64>,
}

/// The shortest lease and snapshot period: shorter ones would have members
/// do little else than renew or publish.
const SHORTEST_PERIOD: Duration = Duration::from_millis(100);

/// The version of what members write for each other (stream entries,
/// snapshots, keys), recorded with the fleet's settings: a member that
/// wrote entries another cannot read would have them skipped, and
/// acknowledged, by it. Raised with every change to that format.
const PROTOCOL: u32 = 1;

/// Configures a [`FleetSync`]; made by [`FleetSync::builder`].
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct FleetSyncBuilder {
    guard: Guard,
    redis: FleetRedis,
    name: String,
    settings: Settings,
    /// The acknowledgement timeout given; 3 leases and half a second unless told.
    ack_timeout: Option<Duration>,
}

impl FleetSyncBuilder {
    /// How long a member's lease lasts (4 s unless told): the longest a
    /// writer waits for a member that stopped answering, and the longest a
    /// member that lost Redis answers before it fences itself. Renewed every
    /// quarter lease. At least 100 ms, at most
    /// [`MAX_DURATION`].
    pub fn lease(mut self, lease: Duration) -> Self {
        self.settings.lease = lease.clamp(SHORTEST_PERIOD, MAX_DURATION);
        self
    }

    /// How long a writer waits for members that keep their leases but do not
    /// apply its insert (3 leases and half a second unless told) before it
    /// gives up, and the write is not made. At least 100 ms (a member
    /// applies an insert a Redis round trip after its append, at best), at
    /// most [`MAX_DURATION`]. After a Redis restart or failover that members
    /// lived through fenced, writes wait up to about two and a half leases
    /// and half a second for them to settle (see the module docs): a shorter
    /// timeout fails those writes.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = Some(timeout.clamp(SHORTEST_PERIOD, MAX_DURATION));
        self
    }

    /// Caps the insert stream at about `max_len` entries (`XADD … MAXLEN ~`),
    /// a ceiling under the retention that snapshots set. A member that falls
    /// further behind recovers from a snapshot. Keep it above the entries
    /// appended while a snapshot is encoded, uploaded and loaded: a publish
    /// the cap trimmed past is refused, and a snapshot trimmed past before
    /// a joiner loads it covers nothing, so that members without a source
    /// would stay fenced. At least 1.
    pub fn stream_max_len(mut self, max_len: usize) -> Self {
        self.settings.stream_max_len = max_len.max(1);
        self
    }

    /// Splits snapshots into Redis strings of at most `bytes` each (at
    /// least 1; default [`DEFAULT_SNAPSHOT_CHUNK_BYTES`](FleetSync::DEFAULT_SNAPSHOT_CHUNK_BYTES)).
    /// Each chunk is a key of its own, written and read in one command:
    /// small chunks make many.
    pub fn snapshot_chunk_bytes(mut self, bytes: usize) -> Self {
        self.settings.chunk_bytes = bytes.max(1);
        self
    }

    /// Publishes a snapshot every `period` (one member at a time), which
    /// also trims the stream to the snapshot before. Unless told, only when
    /// a member asks for one. At least 100 ms, at most
    /// [`MAX_DURATION`]. Keep it above the time a member takes to read a
    /// snapshot (its size over the link to Redis): a publish deletes the
    /// snapshot it replaces, and a member reading that one starts over, so
    /// with a shorter period members that join or recover without a source
    /// stay fenced.
    pub fn snapshot_every(mut self, period: Duration) -> Self {
        self.settings.snapshot_every = Some(period.clamp(SHORTEST_PERIOD, MAX_DURATION));
        self
    }

    /// Counts an append (a write's insert) or a lease renewal only once
    /// `replicas` replicas of the fleet's Redis hold it (`WAIT`), so that a
    /// failover to a replica loses no acknowledged insert and no lease a
    /// member counts on. 0 (unless told) for one node. On a cluster, give
    /// the fleet's master at least `replicas + 1` replicas: after a
    /// failover the promoted one must still have `replicas` of its own, or
    /// no write is made ([`FleetError::NotReplicated`]) and every member
    /// fences itself until a replica is back. Tested with 2 replicas per
    /// master and `wait_for_replicas(1)`. Each `WAIT` waits up to half a
    /// lease; one the master does not answer fails after a lease. Redis
    /// holds a connection's later commands while its `WAIT` waits, and a
    /// member's appends and renewals share one connection: they go out one
    /// replica acknowledgement apart (on loopback, 32 writers over 3 members
    /// acknowledged 10.6 k writes/s against 14.0 k without; see
    /// BENCHMARKS.md), and a replica that lags holds renewals up with them.
    pub fn wait_for_replicas(mut self, replicas: usize) -> Self {
        self.settings.replicas = replicas;
        self
    }

    /// The member, not yet joined: see [`FleetSync::join`]. Fences the
    /// guard (unless another member follows it already): until a join has
    /// caught it up, it cannot show that it holds what the fleet's writers
    /// were told it does, so it answers `MaybePresent`.
    pub fn build(mut self) -> FleetSync {
        self.settings.ack_timeout = self.ack_timeout.unwrap_or_else(|| {
            (3 * self.settings.lease + crate::redis::RECONNECT_MAX_DELAY).min(MAX_DURATION)
        });
        let fenced = !self.guard.in_fleet();
        if fenced {
            self.guard.set_fenced(true);
        }
        let seed = RandomState::new().hash_one(std::process::id());
        FleetSync {
            inner: Arc::new(Inner {
                connection: self.redis.connection(self.settings.lease),
                member: format!("{}:{seed:016x}", self.guard.name()),
                guard: self.guard,
                redis: self.redis,
                keys: Keys::new(&self.name),
                settings: self.settings,
                state: Mutex::new(MemberState {
                    fenced,
                    ..MemberState::default()
                }),
                applied_notices: watch::Sender::new(0),
                announce_refusal_told: std::sync::atomic::AtomicBool::new(false),
                lease_changed: Condvar::new(),
                snapshot_published: Notify::new(),
                snapshot_requested: Notify::new(),
                renewal_wanted: Notify::new(),
                counters: FleetCounters::default(),
                landed_unannounced: Mutex::default(),
            }),
        }
    }
}

impl FleetSync {
    /// Entries the insert stream keeps at most, about, unless told.
    pub const DEFAULT_STREAM_MAX_LEN: usize = 1_000_000;
    /// Bytes per snapshot chunk unless told: 32 MiB, well under Redis's
    /// 512 MB string limit and its default client query buffer.
    pub const DEFAULT_SNAPSHOT_CHUNK_BYTES: usize = 32 << 20;
    /// A member's lease unless told.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(4);

    /// Configures `guard`'s membership of the fleet `name` on the Redis
    /// behind `client`.
    pub fn builder(guard: Guard, client: Client, name: &str) -> FleetSyncBuilder {
        Self::builder_on(guard, FleetRedis::Node(client), name)
    }

    /// Configures `guard`'s membership of the fleet `name` on the Redis
    /// Cluster whose seed nodes are `seeds`. Every key of the fleet carries
    /// the hash tag `{name}`, so they live in one slot, served by one master;
    /// see [`wait_for_replicas`](FleetSyncBuilder::wait_for_replicas) to
    /// keep the contract across a failover.
    ///
    /// # Errors
    /// A seed that is not a Redis URL.
    pub fn cluster_builder(
        guard: Guard,
        seeds: &[impl AsRef<str>],
        name: &str,
    ) -> Result<FleetSyncBuilder, redis::RedisError> {
        let seeds: Vec<String> = seeds.iter().map(|seed| seed.as_ref().to_owned()).collect();
        let client = redis::cluster::ClusterClient::new(seeds.clone())?;
        let redis = FleetRedis::Cluster {
            client: Box::new(client),
            seeds,
        };
        Ok(Self::builder_on(guard, redis, name))
    }

    fn builder_on(guard: Guard, redis: FleetRedis, name: &str) -> FleetSyncBuilder {
        FleetSyncBuilder {
            guard,
            redis,
            name: name.to_owned(),
            settings: Settings {
                lease: Self::DEFAULT_LEASE,
                ack_timeout: Duration::ZERO, // set by `build`
                stream_max_len: Self::DEFAULT_STREAM_MAX_LEN,
                chunk_bytes: Self::DEFAULT_SNAPSHOT_CHUNK_BYTES,
                snapshot_every: None,
                replicas: 0,
            },
            ack_timeout: None,
        }
    }

    /// Runs `script` and, where replicas are wanted, waits until that many
    /// hold what it wrote. The `WAIT` rides in one pipeline with the
    /// script: `WAIT` counts the replicas holding what its own connection
    /// wrote, and one sent on its own could go out on a connection made
    /// since (the manager reconnecting for another command, the cluster
    /// client resending it after a drop), which wrote nothing and counted
    /// every connected replica at once. A resent pipeline runs the script
    /// again, which the fleet's scripts allow (a renewal's token tells).
    async fn run_replicated<T: redis::FromRedisValue>(
        &self,
        connection: &mut super::Live,
        script: &redis::ScriptInvocation<'_>,
    ) -> Result<T, FleetError> {
        let wanted = self.inner.settings.replicas;
        if wanted == 0 {
            return Ok(script.invoke_async(connection).await?);
        }
        // Half a lease: answered before the connection's own timeout (a
        // lease), and a renewal that waited that long is in doubt anyway.
        let wait_ms = (self.inner.settings.lease / 2).as_millis() as u64;
        let mut pipeline = redis::pipe();
        pipeline
            .invoke_script(script)
            .cmd("WAIT")
            .arg(wanted)
            .arg(wait_ms)
            .ignore_errors();
        let mut loaded = false;
        loop {
            let (reply, acknowledged): (redis::Value, redis::Value) =
                pipeline.query_async(connection).await?;
            let reply = match reply.extract_error() {
                // A node that never ran the script (a fresh one, a promoted
                // replica): load it and run both again. Redis ran neither
                // the script nor a write before that `WAIT`.
                Err(error)
                    if !loaded
                        && error.kind()
                            == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
                {
                    script.load_async(connection).await?;
                    loaded = true;
                    continue;
                }
                reply => reply?,
            };
            let acknowledged: usize = redis::from_redis_value(acknowledged.extract_error()?)
                .map_err(redis::RedisError::from)?;
            if acknowledged < wanted {
                return Err(FleetError::NotReplicated {
                    wanted,
                    acknowledged,
                });
            }
            return Ok(redis::from_redis_value(reply).map_err(redis::RedisError::from)?);
        }
    }

    /// The guard this instance answers from.
    pub fn guard(&self) -> &Guard {
        &self.inner.guard
    }

    /// This member's id in the fleet (`{guard name}:{random}`).
    pub fn member(&self) -> &str {
        &self.inner.member
    }

    /// Inserts `key` into every member of the fleet, then runs `write` (the
    /// store write). Returns `write`'s output once every member holding a
    /// lease has applied the insert (or fenced itself).
    ///
    /// # Errors
    /// [`FleetWriteError::NotWritten`] when the append or its
    /// acknowledgement failed: `write` did not run.
    /// [`FleetWriteError::Unconfirmed`] when `write` ran but its landing could
    /// not be confirmed (see [`FleetWrite::finish`]).
    pub async fn insert_then_write<T>(
        &self,
        key: impl AsRef<[u8]>,
        write: impl Future<Output = T>,
    ) -> Result<T, FleetWriteError<T>> {
        let pending = self
            .begin_write(key)
            .await
            .map_err(FleetWriteError::NotWritten)?;
        let output = write.await;
        match pending.finish().await {
            Ok(()) => Ok(output),
            Err(error) => Err(FleetWriteError::Unconfirmed { output, error }),
        }
    }

    /// Inserts `key` into every member of the fleet and returns once each
    /// member holding a lease has applied it (or fenced itself). Make the
    /// store write then, and call [`FleetWrite::finish`] once it has landed.
    ///
    /// # Errors
    /// Redis failed, members did not acknowledge within the timeout, or
    /// Redis lost its data meanwhile ([`FleetError::EntryLost`]): do not
    /// write (the key may reach some members: a false positive, never a
    /// false negative).
    pub async fn begin_write(&self, key: impl AsRef<[u8]>) -> Result<FleetWrite, FleetError> {
        self.begin_write_many(&[key]).await
    }

    /// [`begin_write`](Self::begin_write) for a batch of keys written to the
    /// store together: one append and one acknowledgement for all of them.
    ///
    /// # Errors
    /// As [`begin_write`](Self::begin_write).
    pub async fn begin_write_many<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
    ) -> Result<FleetWrite, FleetError> {
        let local = keys
            .iter()
            .map(|key| self.inner.guard.begin_write(key))
            .collect();
        let appended_at = Instant::now();
        if !keys.is_empty() {
            let appended = self.append(keys, false).await?;
            self.wait_for_members(appended).await?;
        }
        self.inner.counters.count_local_inserts(keys.len() as u64);
        Ok(FleetWrite {
            fleet: self.clone(),
            keys: keys.iter().map(|key| key.as_ref().to_vec()).collect(),
            _local: local,
            appended_at,
        })
    }

    /// Joins the fleet: checks this guard's settings against the fleet's,
    /// fences the guard, loads the latest snapshot when its coverage is proven
    /// (a warming guard leaves warming this way), takes a lease, and starts
    /// the tasks that apply the stream, keep the lease and publish
    /// snapshots, and a thread that fences the guard when the lease runs out
    /// (asleep until then; a blocked runtime does not hold it back). The
    /// guard answers `Absent` again once it has caught up.
    ///
    /// The first member of a new fleet (or of one whose Redis lost its data)
    /// returns one lease later: until then writers cannot know that no member
    /// from before still counts on its lease (see `membership.rs`).
    ///
    /// A fenced guard stays fenced after its member leaves or its tasks end:
    /// nothing keeps it up to date any more.
    ///
    /// # Errors
    /// [`FleetError::InvalidName`] for a name that is empty or starts
    /// with `}`; [`FleetError::AlreadyJoined`] while a member (this one or another)
    /// follows a fleet for the guard; [`FleetError::SettingsDiffer`];
    /// [`FleetError::LeaseWatchNotStarted`]; Redis errors. The guard stays fenced, answering `MaybePresent`, until a
    /// join succeeds: it cannot show it holds the fleet's writes. Dropping
    /// the future before it returns (a `timeout` around it) does the same;
    /// a lease it took lapses within a lease.
    ///
    /// # Panics
    /// Outside a tokio runtime.
    pub async fn join(&self) -> Result<FleetHandle, FleetError> {
        self.join_with(None).await
    }

    /// [`join`](Self::join), tied to the application's `shutdown` token
    /// (a `tokio_util::sync::CancellationToken`): cancelled during the join,
    /// it returns [`FleetError::ShuttingDown`] (the guard stays fenced, and
    /// may join again); cancelled later, the member leaves the fleet as
    /// [`FleetHandle::shutdown`] has it leave.
    ///
    /// # Errors
    /// As [`join`](Self::join), and [`FleetError::ShuttingDown`].
    pub async fn join_until(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<FleetHandle, FleetError> {
        self.join_with(Some(shutdown)).await
    }

    async fn join_with(
        &self,
        shutdown: Option<&CancellationToken>,
    ) -> Result<FleetHandle, FleetError> {
        // An empty tag (`{}:inserts`, or `{}x}:inserts` for `}x`) makes
        // Redis Cluster hash each whole key: the fleet's scripts, which
        // take several keys, would all fail with CROSSSLOT. Any other name
        // tags every key alike.
        let name = &self.inner.keys.name;
        if name.is_empty() || name.starts_with('}') {
            return Err(FleetError::InvalidName(name.clone()));
        }
        if !self.inner.guard.claim_for_fleet() {
            return Err(FleetError::AlreadyJoined);
        }
        self.inner.guard.set_fenced(true);
        self.state().fenced = true;
        self.inner.counters.count_fence();
        // Before the first renewal, which may unfence the guard: a join
        // that could fail after it would leave nothing to fence it again.
        let lease_watch = match self.watch_lease() {
            Ok(lease_watch) => lease_watch,
            Err(error) => {
                self.inner.guard.release_from_fleet();
                return Err(FleetError::LeaseWatchNotStarted(error));
            }
        };
        let mut unfinished = UnfinishedJoin {
            member: self.clone(),
            lease_watch: Some(lease_watch),
        };
        let entered = self.enter().instrument(self.span("join"));
        match shutdown {
            // The join waits out a young record's lease and may retry Redis
            // for as long: a shutdown meanwhile ends it at once.
            Some(shutdown) => tokio::select! {
                // Both ready in one poll: the shutdown wins, as documented.
                biased;
                () = shutdown.cancelled() => return Err(FleetError::ShuttingDown),
                entered = entered => entered?,
            },
            None => entered.await?,
        }
        let lease_watch = unfinished.lease_watch.take();
        self.take_rebuild_turns();
        let member = self.clone();
        // However the tasks end (left, panicked, aborted, never started),
        // nothing keeps the guard up to date any more.
        let ended = MembershipEnds {
            member: self.clone(),
            lease_watch,
        };
        let task = StoppableTask::spawn("fleet member", shutdown, |stop| async move {
            let _ended = ended;
            let run = async {
                tokio::join!(
                    member.consume(),
                    member.keep_lease(),
                    member.listen(),
                    member.publish_when_due(),
                );
            };
            tokio::select! {
                () = stop.cancelled() => member.leave().await,
                () = run.instrument(member.span("member")) => {}
            }
        });
        Ok(FleetHandle { task })
    }

    /// Records or compares the settings, finds where to start reading, and
    /// takes the first lease.
    async fn enter(&self) -> Result<(), FleetError> {
        self.warn_if_keys_may_be_evicted().await;
        // A fleet record younger than a lease (a new fleet, or a Redis that
        // lost its data) holds every write for the rest of that lease: wait
        // it out here rather than in the first writes, and before choosing
        // where to start, so that members from before a data loss have
        // renewed (and published what they hold) by then.
        let (grace, fleet_since) = self.grace().await?;
        // The record the position chosen below belongs to: a renewal that
        // finds another knows that Redis lost its data since.
        {
            let mut state = self.state();
            state.fleet_since = Some(fleet_since);
            state.record_confirmed = false;
            state.leased_in = None;
            state.fresh_until_renewed_after = None;
            // What it held before leaving is not what it joins with.
            state.held_before = None;
            state.held_need_of = None;
            // Learnt again by the first renewal; a stale one from before
            // leaving would have this member mark records it lacks nothing of.
            state.snapshot_needed = false;
            // What fenced a membership before is judged again by this join:
            // the settings checked below, the catch-up target set by its
            // renewal (an old one may lie in a stream Redis has lost, never
            // reached), a recovery where the start chosen below needs one.
            state.settings_differ = false;
            state.settings_unchecked = false;
            state.catch_up_to = None;
            state.recovering = false;
            // Whatever Redis still holds of an earlier lease, writers may
            // have counted this member out since: the join's renewal is
            // never continuous.
            state.lease_in_doubt = true;
            // Chosen below; an old one would set a snapshot adopted there a
            // catch-up target of its own.
            state.position = StreamPosition::START;
        }
        tokio::time::sleep(grace).await;
        // After the grace: following a loss, the members from before have
        // recorded their settings by then, and a joiner configured otherwise
        // is refused rather than record its own first.
        self.check_settings().await?;
        let snapshot = match self.load_covering_snapshot(None).await {
            Err(FleetError::Redis(error)) => return Err(error.into()),
            Err(error) => {
                tracing::warn!(%error, "fleet snapshot refused; joining from the stream");
                None
            }
            Ok(snapshot) => snapshot,
        };
        let start = match snapshot {
            Some(position) => position,
            None if self.trimmed_to().await? > StreamPosition::START => {
                // What was trimmed is in no snapshot we can prove: recover.
                self.state().recovering = true;
                StreamPosition::START
            }
            None => {
                // Nothing from before this record: if Redis lost its data,
                // the renewal below says so, and this member recovers.
                self.state().starts_fresh_in(Some(fleet_since));
                StreamPosition::START
            }
        };
        self.state().position = start;
        let renewal = self.renew().await?;
        self.renewed(renewal);
        Ok(())
    }

    /// Warns when Redis may evict any key: the fleet's leases, record and
    /// trim mark are what keep its contract (an evicted lease lets writers
    /// count its member out). Skipped where `CONFIG` is denied. (Under a
    /// `volatile-*` policy a snapshot's chunks, which expire until their
    /// manifest names them, may be evicted: the publish is then refused,
    /// and a member publishes again later.)
    async fn warn_if_keys_may_be_evicted(&self) {
        // A map: `CONFIG GET` answers one over RESP3, a flat list over RESP2.
        let policy: Result<std::collections::HashMap<String, String>, FleetError> = async {
            let mut connection = self.inner.connection.get().await?;
            Ok(redis::cmd("CONFIG")
                .arg("GET")
                .arg("maxmemory-policy")
                .query_async(&mut connection)
                .await?)
        }
        .await;
        match policy {
            Ok(reply) if reply.values().any(|value| value.starts_with("allkeys")) => {
                tracing::warn!(
                    policy = ?reply,
                    "Redis may evict the fleet's keys (maxmemory-policy allkeys-*): an evicted \
                     lease or record can cost a member acknowledged inserts; use noeviction or \
                     a volatile-* policy"
                );
            }
            Ok(_) => {}
            Err(error) => tracing::debug!(%error, "maxmemory-policy not read"),
        }
    }

    async fn check_settings(&self) -> Result<(), FleetError> {
        let mut ours = self.inner.guard.fleet_settings();
        ours.push((
            "lease_ms",
            self.inner.settings.lease.as_millis().to_string(),
        ));
        ours.push(("protocol", PROTOCOL.to_string()));
        let text: String = ours
            .iter()
            .map(|(name, value)| format!("{name}={value}"))
            .collect::<Vec<_>>()
            .join("\n");
        let mut connection = self.inner.connection.get().await?;
        let (recorded,): (String,) = redis::pipe()
            .set_options(
                &self.inner.keys.settings,
                &text,
                redis::SetOptions::default().conditional_set(redis::ExistenceCheck::NX),
            )
            .ignore()
            .get(&self.inner.keys.settings)
            .query_async(&mut connection)
            .await?;
        for (name, value) in &ours {
            let theirs = recorded
                .lines()
                .find_map(|field| field.strip_prefix(name)?.strip_prefix('='));
            if theirs != Some(value.as_str()) {
                return Err(FleetError::SettingsDiffer {
                    setting: name,
                    ours: value.clone(),
                    fleet: theirs.unwrap_or("(not recorded)").to_owned(),
                });
            }
        }
        Ok(())
    }

    /// After Redis lost its data: the join's settings check again, so that
    /// a member configured otherwise, joining after the loss, is refused
    /// (where this one records its settings first) or this one fences for
    /// good (where the other did). Retried at the next renewal if Redis fails.
    async fn check_settings_again(&self) {
        match self.check_settings().await {
            Ok(()) => self.state().settings_unchecked = false,
            Err(error @ FleetError::SettingsDiffer { .. }) => {
                tracing::error!(%error, "the fleet recorded other settings after a data loss: fenced until this member leaves");
                {
                    let mut state = self.state();
                    state.settings_unchecked = false;
                    state.settings_differ = true;
                }
                self.refresh_fence();
            }
            Err(error) => {
                tracing::debug!(%error, "settings not checked; again at the next renewal")
            }
        }
    }

    /// Leaving: give the lease back so that writers stop waiting; the guard
    /// stays fenced, since nothing keeps it up to date any more.
    async fn leave(&self) {
        self.inner.guard.set_rebuild_turns(None);
        self.withdraw().await;
    }

    /// Takes in what a renewal found.
    fn renewed(&self, renewal: Renewal) {
        let publish = {
            let mut state = self.state();
            if renewal.epoch != state.lease_epoch {
                // Sent before this member gave its lease up.
                return;
            }
            state.renewal_taken = renewal.token;
            let lease = self.inner.settings.lease;
            state.fence_at = Some(renewal.sent_at + fence_after(lease));
            state.renewed_at = Some(renewal.sent_at);
            state.members = renewal.members;
            let in_doubt = std::mem::take(&mut state.lease_in_doubt);
            let holds = state.holds_up_to();
            let lost_data = state
                .fleet_since
                .replace(renewal.fleet_since)
                .is_some_and(|since| since != renewal.fleet_since);
            if lost_data {
                // The stream began anew with the record: none of its entries
                // was applied here, whatever their ids (a Redis whose clock
                // is behind the old ones gives lower ids). Where Redis kept
                // it, it is replayed from where it was trimmed, if this
                // member had got that far; from its start otherwise, which
                // past a trim is a recovery. The consumer notices the move
                // (`apply_next`); targets in the old stream are gone with it.
                if (!state.record_confirmed || state.fenced) && !renewal.lacks_what_preceded {
                    // Joined under the record before and never saw it
                    // confirmed, or fenced (its lease lapsed, or it was
                    // catching up): whatever it holds of that record may
                    // lack what its end lost, a restart from an older dump
                    // or a failover to a replica that lacked the last writes.
                    // (One lacking the keys an earlier record needed stays
                    // fresh in that one: told so until it loads them.)
                    state.fresh_in = Some(renewal.fleet_since);
                    state.fresh_until_renewed_after = Some(renewal.sent_at + lease);
                }
                // What it held as the reply came: at least what the renewal
                // reported (reads stop at a record not yet taken in, so the
                // position is the old stream's), reported again at the next.
                state.held_before = renewal.kept.then_some(holds);
                let kept = renewal.kept;
                state.position = if kept && state.position >= renewal.trimmed {
                    renewal.trimmed
                } else {
                    StreamPosition::START
                };
                state.catch_up_to = None;
                state.stream_resets += 1;
                state.settings_unchecked = true;
            }
            // The newest entry known: a consumer that stopped reading
            // showed no lag, since its last read had reached the end.
            state.stream_end = if lost_data {
                renewal.last
            } else {
                state.stream_end.max(renewal.last)
            };
            if (!renewal.continuous || in_doubt || lost_data) && renewal.last > state.position {
                // Writers may have counted this member out while its lease
                // had lapsed: it must hold what they appended until now.
                let target = state.catch_up_to.unwrap_or_default().max(renewal.last);
                state.catch_up_to = Some(target);
            }
            if lost_data && state.fenced && !renewal.kept {
                // Entries acknowledged without this member may be gone with
                // Redis's data: only a snapshot or a rebuild has them. (Where
                // the stream was kept, a restart or a failover, it replays
                // the stream from its start.)
                state.recovering = true;
            }
            // Fresh in a record over a kept stream, which may have lost
            // entries this member lacks and another holds: until every
            // member from before has had time to say what it held
            // (`frontier_wait`), a late report may still mark the record,
            // and it waits, fenced.
            let fresh_here = state.fresh_in_its_record();
            let waits = fresh_here && !renewal.frontier_settled;
            if waits {
                state
                    .fresh_until_renewed_after
                    .get_or_insert(renewal.sent_at);
                // Whatever made it fresh: its position says nothing yet.
                state.held_before.get_or_insert(StreamPosition::START);
            }
            let fresh_over_kept = fresh_here && state.held_before.is_some();
            if fresh_over_kept && renewal.frontier_settled {
                // Its applied position counts for writers from now on.
                self.inner.renewal_wanted.notify_one();
                if renewal.frontier == Frontier::At {
                    // It holds the newest entry any member from before held,
                    // and every one before it: what preceded the record, as
                    // a member caught up through the change does.
                    state.fresh_in = None;
                    tracing::info!(
                        "this member holds the newest entries of the fleet's stream from \
                         before Redis restarted: it vouches for them"
                    );
                } else if !renewal.snapshot_needed {
                    // Unmarked: the stream holds what every member from
                    // before held, and its position says what it holds.
                    state.held_before = None;
                }
            }
            if !waits
                && state
                    .fresh_until_renewed_after
                    .is_some_and(|after| renewal.sent_at >= after)
            {
                state.fresh_until_renewed_after = None;
            }
            state.snapshot_needed = renewal.snapshot_needed;
            state.held_need_of = (renewal.snapshot_needed
                && !state.fresh_in_its_record()
                && !renewal.lacks_what_preceded)
                .then_some(renewal.fleet_since);
            let lacks_what_is_needed = renewal.lacks_what_preceded
                || (renewal.snapshot_needed && state.fresh_in_its_record() && !waits);
            if lacks_what_is_needed {
                // Started at the new stream's start: the keys from before
                // the loss are in other members' sets only.
                state.recovering = true;
            }
            state.record_confirmed = true;
            state.leased_in = Some(renewal.fleet_since);
            let publish = lost_data
                || (renewal.snapshot_needed && !renewal.snapshot_covers && !lacks_what_is_needed);
            if lost_data {
                tracing::warn!("the fleet's record in Redis is new: Redis lost its data");
            }
            publish
        };
        if publish {
            // Members that lived through the loss hold what the others lack:
            // asked again at every renewal until one of them has published
            // (one fenced while catching up cannot yet).
            self.inner.snapshot_requested.notify_one();
        }
        self.inner.lease_changed.notify_all();
        self.refresh_fence();
    }

    /// Fences or unfences the guard as the member's state requires.
    fn refresh_fence(&self) {
        self.refresh_fence_holding(&mut self.state(), Instant::now());
    }

    fn refresh_fence_holding(&self, state: &mut MemberState, now: Instant) {
        let fence = state.must_fence(now);
        if fence != state.fenced {
            state.fenced = fence;
            if fence {
                self.inner.counters.count_fence();
            }
            // Under the state lock, so that two refreshes cannot store their
            // answers in the opposite order.
            self.inner.guard.set_fenced(fence);
        }
    }

    /// Whether the consumer read the stream within the last half lease.
    fn consumer_is_reading(&self) -> bool {
        let state = self.state();
        !state.recovering
            && state
                .last_read_at
                .is_some_and(|at| at.elapsed() < self.inner.settings.lease / 2)
    }

    /// A span carrying the guard's name and the fleet's stream.
    fn span(&self, operation: &'static str) -> tracing::Span {
        tracing::info_span!(
            "bloomguard.fleet",
            operation,
            guard = %self.inner.guard.name(),
            stream = %self.inner.keys.stream
        )
    }

    fn state(&self) -> MutexGuard<'_, MemberState> {
        unpoisoned(self.inner.state.lock())
    }

    /// The stream position this instance has applied up to.
    pub fn position(&self) -> StreamPosition {
        self.state().position
    }
}

impl fmt::Debug for FleetSync {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetSync")
            .field("member", &self.inner.member)
            .field("stream", &self.inner.keys.stream)
            .field("state", &*self.state())
            .finish_non_exhaustive()
    }
}

/// Ends the member's standing when its tasks end (left, panicked, aborted
/// with their runtime, never started): the guard fenced, and the state its
/// stats and publishes read, its lease given up, so that a member frozen
/// at a position neither says it is unfenced nor publishes from there;
/// the guard takes no more of the fleet's rebuild turns, and may join again.
struct MembershipEnds {
    member: FleetSync,
    lease_watch: Option<membership::LeaseWatch>,
}

impl Drop for MembershipEnds {
    fn drop(&mut self) {
        let member = &self.member;
        member.inner.guard.set_rebuild_turns(None);
        member.inner.guard.set_fenced(true);
        member.state().give_up_lease();
        member.refresh_fence();
        // The member's tasks, which published its gauges, have ended:
        // `bloomguard_fleet_fenced` would stay at its last value.
        #[cfg(feature = "metrics")]
        member.publish_metrics();
        // Stopped before the guard is released: a join that follows starts
        // a watch of its own on the same state.
        drop(self.lease_watch.take());
        member.inner.guard.release_from_fleet();
    }
}

/// A fleet write in progress, from [`FleetSync::begin_write`]: every member
/// holds the key. Make the store write, then call [`finish`](Self::finish).
///
/// Dropped unfinished (its task cancelled, a client gone) more than half
/// the write settle after its append, it appends its keys again in the
/// background, on the tokio runtime it is dropped on, as `finish` would
/// (tried until Redis takes them, while a `FleetSync` of the member
/// lives), but waits for no member: the write may have landed, and a
/// member whose rebuild read its source earlier, or whose
/// [confirmed-absent cache](crate::GuardedLoader::confirmed_absent_cache)
/// kept the store's "absent" from before it landed, learns the key again.
/// A write that lands after the drop, a drop outside a runtime, or one on
/// a runtime that is shutting down (or never driven again) is not covered:
/// those members may miss the key until their next rebuild (the cache, for
/// its ttl), and on a rotating guard they count the key's window from the
/// first append.
#[must_use = "call `finish` once the store write has landed"]
pub struct FleetWrite {
    fleet: FleetSync,
    keys: Vec<Vec<u8>>,
    /// Covers this member's own rebuilds until the write lands: held until
    /// `finish` returns or the write is dropped.
    _local: Vec<PendingWrite>,
    appended_at: Instant,
}

impl FleetWrite {
    /// Tells the fleet that the store write has landed. A write slower than
    /// half the write settle appends its key again and waits for that to be
    /// acknowledged, so that a member whose rebuild read its source before
    /// the write landed still gets the key; faster ones return at once.
    ///
    /// # Errors
    /// The second append or its acknowledgement failed. A failed append is
    /// tried again in the background, as at a drop, until Redis takes it (one
    /// task per member for every such write, each key once, backing off to a
    /// lease between tries) or no `FleetSync` of the member is left, having
    /// left the fleet or not; until then a member whose rebuild read its
    /// source before the write landed lacks the key, and so does every member
    /// that replaces its set with that rebuild, a member whose
    /// confirmed-absent cache asked the store before the write landed may
    /// answer absent for it, and on a rotating guard a member that did not
    /// apply it counts the key's window from the first append.
    pub async fn finish(mut self) -> Result<(), FleetError> {
        if self.landed_late() {
            let appended = self.fleet.append(&self.keys, true).await?;
            // Appended: a drop from here on has nothing to announce.
            self.keys.clear();
            self.fleet.wait_for_members(appended).await?;
        }
        // Finished: not announced again at the drop, however late it is.
        self.keys.clear();
        Ok(())
    }

    /// Whether the write may land later than half the write settle after
    /// its append: then it is announced again once it has landed.
    fn landed_late(&self) -> bool {
        let settle = self.fleet.inner.guard.write_settle();
        !self.keys.is_empty() && self.appended_at.elapsed() > settle / 2
    }
}

impl Drop for FleetWrite {
    fn drop(&mut self) {
        if !self.landed_late() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let keys = std::mem::take(&mut self.keys);
        // This member's own `PendingWrite`s end with the drop (the fields'),
        // not with a task that a runtime no longer driven may never run.
        self.fleet.announce_landed(keys, &runtime);
    }
}

/// Keys appended by one `announce_landed` append at most.
const ANNOUNCED_AT_ONCE: usize = 1_024;

impl FleetSync {
    /// Appends the keys of a slow write that has (or may have) landed
    /// again, in the background, until Redis takes them: a member whose
    /// rebuild read its source before the write landed lacks them until
    /// then, and so does every member that replaces its set with that
    /// rebuild. One task per member retries every such key, backing off to
    /// a lease between tries, for as long as any handle to the member
    /// (a `FleetSync` clone) lives.
    fn announce_landed(&self, keys: Vec<Vec<u8>>, runtime: &tokio::runtime::Handle) {
        let mut unannounced = unpoisoned(self.inner.landed_unannounced.lock());
        unannounced.keys.extend(keys);
        if std::mem::replace(&mut unannounced.announcing, true) {
            return;
        }
        drop(unannounced);
        // Made before the spawn: a task dropped before it first runs (its
        // runtime shut down) still marks the member as without one.
        let announcing = Announcing {
            member: Arc::downgrade(&self.inner),
            released: false,
            in_flight: Vec::new(),
        };
        // The first append holds the member, as the write did; the retries
        // after it do not keep it alive.
        let fleet = self.clone();
        runtime.spawn(async move {
            let mut announcing = announcing;
            let mut fleet = Some(fleet);
            let mut wait = Duration::from_millis(100);
            let mut failed = 0_u32;
            loop {
                let Some(member) = fleet.take().or_else(|| announcing.member()) else {
                    tracing::warn!(
                        failed,
                        "the member ended before slow writes could be announced again: members \
                         may miss their keys until they rebuild"
                    );
                    return;
                };
                {
                    let mut unannounced = unpoisoned(member.inner.landed_unannounced.lock());
                    if unannounced.keys.is_empty() {
                        // Under the lock: a write that adds keys after this
                        // starts a task of its own.
                        unannounced.announcing = false;
                        announcing.released = true;
                        return;
                    }
                    announcing.in_flight = unannounced
                        .keys
                        .iter()
                        .take(ANNOUNCED_AT_ONCE)
                        .cloned()
                        .collect();
                    for key in &announcing.in_flight {
                        unannounced.keys.remove(key);
                    }
                }
                match member.append(&announcing.in_flight, true).await {
                    Ok(_) => {
                        announcing.in_flight.clear();
                        if failed > 0 {
                            tracing::info!(failed, "slow writes announced again");
                        }
                        failed = 0;
                        wait = Duration::from_millis(100);
                        continue;
                    }
                    Err(error) => {
                        if failed == 0 {
                            tracing::warn!(
                                %error,
                                keys = announcing.in_flight.len(),
                                "cannot announce slow writes again; retrying until Redis takes them"
                            );
                        }
                        failed += 1;
                        unpoisoned(member.inner.landed_unannounced.lock())
                            .keys
                            .extend(announcing.in_flight.drain(..));
                    }
                }
                let lease = member.inner.settings.lease;
                drop(member);
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(lease);
            }
        });
    }
}

/// The announcing task of a member: marks it ended however it ends (its
/// runtime shut down, too, before or while it ran), so that a later write
/// starts another, and puts back the keys of an append it did not finish.
struct Announcing {
    member: std::sync::Weak<Inner>,
    /// Marked ended already, by the task.
    released: bool,
    /// The keys of the append under way.
    in_flight: Vec<Vec<u8>>,
}

impl Announcing {
    fn member(&self) -> Option<FleetSync> {
        self.member.upgrade().map(|inner| FleetSync { inner })
    }
}

impl Drop for Announcing {
    fn drop(&mut self) {
        if let Some(inner) = self.member.upgrade() {
            let mut unannounced = unpoisoned(inner.landed_unannounced.lock());
            unannounced.keys.extend(self.in_flight.drain(..));
            if !self.released {
                unannounced.announcing = false;
            }
        }
    }
}

impl fmt::Debug for FleetWrite {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FleetWrite")
            .field("member", &self.fleet.inner.member)
            .field("keys", &self.keys.len())
            .field("since", &self.appended_at.elapsed())
            .finish_non_exhaustive()
    }
}

/// A member's running tasks; dropping it stops them (the lease then lapses).
#[derive(Debug)]
#[must_use = "dropping the handle stops the member's tasks at once: keep it for as long as the instance serves"]
pub struct FleetHandle {
    task: StoppableTask,
}

impl FleetHandle {
    /// Leaves the fleet (gives the lease back) and waits for the tasks to
    /// end. The guard stays fenced.
    pub async fn shutdown(self) {
        self.task.shutdown().await;
    }

    /// Whether the tasks have ended (left, or died: see [`panicked`](Self::panicked)).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Whether the tasks ended by panicking (logged at ERROR when they did).
    pub fn panicked(&self) -> bool {
        self.task.panicked()
    }
}

/// Undoes a join that did not finish, by an error or by its future being
/// dropped (a `timeout` around `join`, which waits out a young fleet's first
/// lease): leaves the guard fenced, as the join began by making it, since
/// it cannot show it holds the fleet's writes. A lease it took lapses
/// within a lease (writers wait for it until then): deleting it from here
/// could race a retried join's renewal of the same member.
struct UnfinishedJoin {
    member: FleetSync,
    /// Taken by a join that finished, for its tasks to end.
    lease_watch: Option<membership::LeaseWatch>,
}

impl Drop for UnfinishedJoin {
    fn drop(&mut self) {
        let Some(lease_watch) = self.lease_watch.take() else {
            return;
        };
        let member = &self.member;
        member.state().give_up_lease();
        // The join's renewal may have unfenced the guard.
        member.refresh_fence();
        drop(lease_watch);
        tracing::warn!(
            guard = %member.inner.guard.name(),
            "fleet join did not finish: the guard stays fenced (every check answers \
             MaybePresent) until a join succeeds"
        );
        // Last: another join may claim the guard once it is released.
        member.inner.guard.release_from_fleet();
    }
}

/// How long after sending a renewal a member fences itself unless renewed
/// again: its lease, an eighth early (the margin of the clock assumption).
fn fence_after(lease: Duration) -> Duration {
    lease - lease / 8
}

/// Runs `work` on tokio's blocking pool. A member's tasks run as one (its
/// consumer, lease renewals and publisher): work as long as encoding or
/// decoding a whole set, run among them, held the renewals and the stream
/// up for as long, and the member fenced for want of a renewal.
///
/// # Errors
/// [`FleetError::ShuttingDown`] where the runtime shut down before `work` ran.
async fn off_the_member_task<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, FleetError> {
    match tokio::task::spawn_blocking(work).await {
        Ok(done) => Ok(done),
        Err(failed) if failed.is_panic() => std::panic::resume_unwind(failed.into_panic()),
        Err(_) => Err(FleetError::ShuttingDown),
    }
}

/// The lease bookkeeping's answers to replies that arrive late, get lost,
/// or come from a Redis that lost its data: what a member fenced for
/// stays fenced until it has caught up (or recovered).
#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;
    use stream::ReadBegun;

    /// Every key of a fleet carries its name as a Redis hash tag; an empty
    /// one (an empty name, or one whose `}` ends the tag at once) leaves
    /// Redis Cluster to hash each whole key, and every script of the fleet
    /// failed with CROSSSLOT: the fleet never worked, without saying why.
    #[tokio::test]
    async fn a_name_that_makes_no_hash_tag_is_refused_at_join() {
        for name in ["", "}items"] {
            let guard = Guard::builder().expected_items(1_000).build().unwrap();
            let client = Client::open("redis://127.0.0.1:1/").unwrap();
            let member = FleetSync::builder(guard.clone(), client, name).build();
            match member.join().await {
                Err(FleetError::InvalidName(refused)) => assert_eq!(refused, name),
                other => panic!("{name:?}: {other:?}"),
            }
            assert!(guard.is_fenced(), "a fleet member until it joins");
        }
    }

    /// The acknowledgement timeout is 3 leases and the longest reconnect
    /// delay unless told, whichever lease is set, and in whichever order.
    #[test]
    fn the_ack_timeout_follows_the_lease_unless_told() {
        let built = |configure: fn(FleetSyncBuilder) -> FleetSyncBuilder| {
            let guard = Guard::builder().expected_items(1_000).build().unwrap();
            let client = Client::open("redis://127.0.0.1:1/").unwrap();
            let member = configure(FleetSync::builder(guard, client, "t")).build();
            member.inner.settings.ack_timeout
        };
        let reconnect = crate::redis::RECONNECT_MAX_DELAY;
        assert_eq!(built(|b| b), 3 * FleetSync::DEFAULT_LEASE + reconnect);
        assert_eq!(
            built(|b| b.lease(Duration::from_secs(30))),
            Duration::from_secs(90) + reconnect
        );
        assert_eq!(
            built(|b| b
                .ack_timeout(Duration::from_secs(5))
                .lease(Duration::from_secs(30))),
            Duration::from_secs(5)
        );
    }

    fn member() -> FleetSync {
        member_with_lease(FleetSync::DEFAULT_LEASE)
    }

    fn member_with_lease(lease: Duration) -> FleetSync {
        let guard = Guard::builder().expected_items(1_000).build().unwrap();
        let client = Client::open("redis://127.0.0.1:1/").unwrap();
        let member = FleetSync::builder(guard, client, "t").lease(lease).build();
        member.state().fleet_since = Some(1);
        member.state().position = "100-0".parse().unwrap();
        member
    }

    fn renewal(member: &FleetSync, continuous: bool, fleet_since: u64) -> Renewal {
        Renewal {
            sent_at: Instant::now(),
            token: 0,
            epoch: member.state().lease_epoch,
            fleet_since,
            continuous,
            last: "200-0".parse().unwrap(),
            members: 2,
            snapshot_needed: false,
            snapshot_covers: false,
            kept: false,
            trimmed: StreamPosition::START,
            lacks_what_preceded: false,
            frontier: Frontier::NotReported,
            frontier_settled: true,
        }
    }

    /// The lease watch fences the guard when the lease runs out with no
    /// runtime running at all, a renewal meanwhile moves that moment on,
    /// and dropping the watch ends its thread.
    #[test]
    fn the_lease_watch_fences_without_a_runtime_and_ends_with_its_handle() {
        // A long lease: the renewal in time must outlast a loaded machine's
        // stalls of this thread and the 3 s sleep below by far.
        let member = member_with_lease(Duration::from_secs(30));
        let holders = Arc::strong_count(&member.inner);
        let watch = member.watch_lease().unwrap();
        let lease = member.inner.settings.lease;
        let fence_soon = |after: Duration| Renewal {
            sent_at: Instant::now() + after - fence_after(lease),
            ..renewal(&member, true, 1)
        };
        // Two seconds to renew in: a loaded machine may stall this thread
        // between two statements for a good part of one.
        member.renewed(fence_soon(Duration::from_secs(2)));
        assert!(!member.guard().is_fenced());
        let first_fence_at = member.state().fence_at.unwrap();
        member.renewed(renewal(&member, true, 1)); // renewed in time
        assert!(member.state().fence_at.unwrap() > first_fence_at);
        // Past the first fence time, far short of the renewed one's.
        std::thread::sleep(Duration::from_secs(3));
        assert!(
            !member.guard().is_fenced(),
            "fenced at the lease renewed since"
        );

        member.renewed(fence_soon(Duration::from_millis(100)));
        let fence_at = member.state().fence_at.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !member.guard().is_fenced() {
            assert!(std::time::Instant::now() < deadline, "never fenced");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(Instant::now() >= fence_at);

        drop(watch);
        assert_eq!(
            Arc::strong_count(&member.inner),
            holders,
            "the thread ended"
        );
    }

    /// The lag counts from the newest entry a renewal found too: it counted
    /// from the last read's end only, and a member whose consumer stopped
    /// reading showed none.
    #[test]
    fn the_lag_counts_from_the_newest_entry_a_renewal_found() {
        let member = member(); // at 100-0
        member.renewed(renewal(&member, true, 1)); // the stream ends at 200-0
        assert_eq!(member.stats().lag, Duration::from_millis(100));
    }

    /// A rebuilt notice from the record before names a version the counter
    /// hands out again in this one: taken, it would count another member's
    /// ordinary snapshot as a rebuild here, and put this member's own
    /// rebuilds off.
    #[test]
    fn a_rebuilt_notice_from_another_record_is_not_taken() {
        let member = member();
        member.rebuilt_elsewhere(b"other 999 42");
        assert!(member.state().rebuilt_elsewhere.is_none());
        member.rebuilt_elsewhere(b"other 1 42");
        assert_eq!(
            member.state().rebuilt_elsewhere,
            Some(SnapshotId {
                since: 1,
                version: 42
            })
        );
        member.state().rebuilt_elsewhere = None;
        member.rebuilt_elsewhere(format!("{} 1 43", member.inner.member).as_bytes());
        assert!(member.state().rebuilt_elsewhere.is_none(), "not its own");
    }

    /// A record that began anew over a kept stream (a restart from a dump,
    /// a failover, a clock step) sends a member that was fenced back to
    /// replay the stream from where it was trimmed. Only a lost stream makes
    /// it recover: that needs a snapshot, which through a failover that
    /// fenced every member none could publish.
    #[test]
    fn a_fenced_member_replays_a_stream_kept_across_a_new_record() {
        // Whether Redis kept the stream, the newest trimmed entry, and where
        // the member (at 100-0) replays from.
        for (kept, trimmed, recovers, from) in [
            (true, "0-0", false, "0-0"),
            (true, "40-0", false, "40-0"),
            (true, "140-0", false, "0-0"), // trimmed past it: `apply_next` recovers
            (false, "0-0", true, "0-0"),
        ] {
            let member = member();
            member.renewed(renewal(&member, true, 1));
            member.state().fence_at = Some(Instant::now()); // its lease ran out
            member.refresh_fence();
            assert!(member.guard().is_fenced());
            member.renewed(Renewal {
                kept,
                trimmed: trimmed.parse().unwrap(),
                ..renewal(&member, false, 2_000)
            });
            assert_eq!(member.state().recovering, recovers, "kept {kept}");
            assert_eq!(
                member.state().position,
                from.parse().unwrap(),
                "{kept} {trimmed}"
            );
            assert!(member.guard().is_fenced());
        }
    }

    /// A member that started at the new stream's start holds none of the
    /// keys from before Redis lost its data: once a member from before
    /// marks them needed, it recovers (fenced) until a snapshot has them.
    /// One from before stays up and is asked to publish.
    #[test]
    fn a_member_fresh_in_the_record_recovers_while_a_snapshot_is_needed() {
        let fresh = member();
        fresh.state().fresh_in = Some(1);
        fresh.renewed(renewal(&fresh, true, 1));
        assert!(!fresh.guard().is_fenced(), "nothing needed yet");
        fresh.renewed(Renewal {
            snapshot_needed: true,
            ..renewal(&fresh, true, 1)
        });
        assert!(fresh.state().recovering);
        assert!(fresh.guard().is_fenced());

        let from_before = member();
        from_before.state().fresh_in = Some(0); // started in an older record
        from_before.renewed(renewal(&from_before, true, 1));
        from_before.renewed(Renewal {
            snapshot_needed: true,
            ..renewal(&from_before, true, 1)
        });
        assert!(!from_before.state().recovering);
        assert!(!from_before.guard().is_fenced());
    }

    /// A member fenced when the record began anew over a kept stream holds
    /// what it held then, and the stream may have lost entries past it that
    /// another member holds: it waits, fenced, until members from before
    /// have had time to report. Then, at the frontier, it vouches for what preceded the
    /// record; behind it, with the record marked, it recovers; unmarked, it
    /// goes on, its position saying what it holds.
    #[test]
    fn a_member_made_fresh_over_a_kept_stream_waits_then_goes_by_the_frontier() {
        let held: StreamPosition = "150-0".parse().unwrap();
        for (frontier, marked, vouches, recovers) in [
            (Frontier::At, true, true, false),
            (Frontier::Behind, true, false, true),
            (Frontier::Behind, false, false, false),
        ] {
            let member = member();
            member.state().position = held;
            member.renewed(renewal(&member, true, 1));
            member.state().fence_at = Some(Instant::now()); // its lease lapsed
            member.refresh_fence();
            member.renewed(Renewal {
                kept: true,
                frontier_settled: false,
                ..renewal(&member, false, 2)
            });
            assert_eq!(member.state().held_when_made_fresh(), Some(held));
            assert_eq!(member.state().applied_for_writers(), StreamPosition::START);
            let later = |aged| Renewal {
                kept: true,
                frontier,
                snapshot_needed: marked,
                frontier_settled: aged,
                ..renewal(&member, true, 2)
            };
            member.renewed(later(false));
            assert!(!member.state().recovering, "{frontier:?}: waits");
            assert_eq!(member.state().fresh_in, Some(2));
            assert!(member.guard().is_fenced());
            member.renewed(later(true));
            assert_eq!(member.state().fresh_in.is_none(), vouches, "{frontier:?}");
            assert_eq!(member.state().recovering, recovers, "{frontier:?}");
            if !marked {
                assert_eq!(member.state().held_before, None);
            }
        }
    }

    #[test]
    fn a_renewal_after_one_whose_reply_was_lost_does_not_count_as_continuous() {
        let member = member();
        member.renewed(renewal(&member, true, 1));
        assert!(!member.guard().is_fenced(), "live lease, caught up");
        // The failed renewal may have run in Redis and found the lease lapsed.
        member.state().lease_in_doubt = true;
        member.renewed(renewal(&member, true, 1));
        assert!(
            member.guard().is_fenced(),
            "fenced until the stream up to 200-0 is applied"
        );
        assert_eq!(member.state().catch_up_to, Some("200-0".parse().unwrap()));
    }

    /// A lease given up (a withdraw, a join dropped mid-renewal) may be
    /// taken again by a renewal whose reply this member never takes in (one
    /// sent before, resent after a `NOSCRIPT`; one of a dropped join), or
    /// takes in after another's: Redis then calls the next renewal
    /// continuous, though writers counted this member out in between.
    #[test]
    fn a_renewal_after_the_lease_was_given_up_does_not_count_as_continuous() {
        let member = member();
        member.renewed(renewal(&member, true, 1));
        assert!(!member.guard().is_fenced(), "live lease, caught up");
        member.state().give_up_lease();
        member.refresh_fence();
        member.renewed(renewal(&member, true, 1));
        assert!(
            member.guard().is_fenced(),
            "fenced until the stream up to 200-0 is applied"
        );
        assert_eq!(member.state().catch_up_to, Some("200-0".parse().unwrap()));
    }

    #[test]
    fn a_renewal_sent_before_the_lease_was_given_up_is_ignored() {
        let member = member();
        let stale = renewal(&member, true, 1);
        member.state().give_up_lease();
        member.renewed(stale);
        assert_eq!(member.state().fence_at, None);
        member.refresh_fence();
        assert!(member.guard().is_fenced());
    }

    /// Redis came back without its data, and its clock behind the old
    /// entries' ids: the new stream's entries may sort below the position a
    /// caught-up member had. Keeping that position would skip them, and
    /// publish it as applied to writers waiting on them.
    #[test]
    fn a_member_of_a_redis_that_lost_its_data_reads_the_new_stream_from_its_start() {
        let member = member();
        member.renewed(renewal(&member, true, 1));
        assert!(!member.guard().is_fenced(), "live lease, caught up");
        let mut lost = renewal(&member, true, 2);
        lost.last = "50-0".parse().unwrap();
        member.renewed(lost);
        assert_eq!(member.state().position, StreamPosition::START);
        assert_eq!(member.state().catch_up_to, Some("50-0".parse().unwrap()));
        assert!(
            member.guard().is_fenced(),
            "until the new stream is applied"
        );
    }

    /// A snapshot read from Redis while a renewal found the fleet's record
    /// new: its position is in the lost stream, and adopting it would set
    /// the member past the new stream's entries.
    #[test]
    fn a_snapshot_read_across_a_data_loss_is_not_adopted() {
        let member = member();
        let snapshot = || {
            let bytes = member.guard().encode_live_set().unwrap();
            crate::guard::snapshot::LiveSnapshot::from_bytes(&bytes).unwrap()
        };
        let read_under = member.state().fleet_since;
        member.renewed(renewal(&member, true, 2)); // Redis lost its data meanwhile
        let position = "150-0".parse().unwrap();
        assert!(
            !member
                .adopt_snapshot(read_under, position, None, snapshot(), false)
                .unwrap()
        );
        assert_eq!(member.state().position, StreamPosition::START);
        assert_eq!(member.state().replacements, 0, "the set was not replaced");

        let read_under = member.state().fleet_since;
        assert!(
            member
                .adopt_snapshot(read_under, position, None, snapshot(), false)
                .unwrap()
        );
        assert_eq!(member.state().position, position);
        assert!(
            member.guard().is_fenced(),
            "until the stream after it is applied"
        );
    }

    /// A read of the old stream that ends after a renewal found Redis's
    /// data lost: the member's position must stay at the new stream's
    /// start, even where it was there already (a young fleet) and so looks
    /// unchanged.
    #[test]
    fn a_read_that_spans_a_data_loss_moves_no_position() {
        let member = member();
        member.state().position = StreamPosition::START;
        member.renewed(renewal(&member, true, 1));
        let begun = ReadBegun::now(&member.state());
        member.renewed(renewal(&member, true, 2)); // Redis lost its data
        assert_eq!(member.state().position, StreamPosition::START);
        let read_of_the_old_stream = "300-0".parse().unwrap();
        let now = Instant::now();
        assert!(
            member
                .commit_read(
                    begun,
                    read_of_the_old_stream,
                    now,
                    read_of_the_old_stream,
                    3
                )
                .is_none()
        );
        assert_eq!(member.state().position, StreamPosition::START);

        let begun = ReadBegun::now(&member.state());
        let read = "50-0".parse().unwrap();
        assert!(member.commit_read(begun, read, now, read, 1).is_some());
        assert_eq!(member.state().position, read);
    }

    /// An empty read that Redis ran before a renewal that found the stream
    /// longer (the renewal's reply taken in first, setting the catch-up
    /// target) says nothing of the entries up to that target: the member
    /// reads again. It recovered, as if Redis had lost them, and a lone
    /// member without a source stayed fenced for good where the stream was
    /// trimmed past the last snapshot. A read begun with the target set
    /// that ends before it does show them lost.
    #[test]
    fn an_empty_read_older_than_its_catch_up_target_does_not_strand_the_member() {
        let member = member(); // at 100-0
        member.renewed(renewal(&member, true, 1));
        let position = member.state().position;
        let begun = ReadBegun::now(&member.state());
        member.state().lease_in_doubt = true; // a renewal failed
        member.renewed(renewal(&member, true, 1)); // the stream ends at 200-0
        assert!(member.state().catch_up_to.is_some());
        let read = member.commit_read(begun, position, Instant::now(), position, 0);
        assert!(
            matches!(read, Some((false, _))),
            "stranded by a newer target"
        );

        let begun = ReadBegun::now(&member.state());
        let read = member.commit_read(begun, position, Instant::now(), position, 0);
        assert!(matches!(read, Some((true, _))), "begun with the target set");
    }

    #[test]
    fn a_fenced_member_of_a_redis_that_lost_its_data_recovers() {
        let member = member();
        member.state().fenced = true;
        member.guard().set_fenced(true);
        member.renewed(renewal(&member, false, 2));
        assert!(member.state().recovering, "what it missed may be gone");
        assert!(member.guard().is_fenced());

        let caught_up = self::member();
        caught_up.renewed(renewal(&caught_up, true, 1));
        caught_up.state().position = "200-0".parse().unwrap();
        caught_up.renewed(renewal(&caught_up, false, 2));
        assert!(
            !caught_up.state().recovering,
            "it holds every acknowledged key"
        );
    }
}
