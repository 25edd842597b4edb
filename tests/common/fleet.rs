//! The fleet tests' members, ledger of completed writes and auditor
//! (`tests/fleet.rs`, and the tests that take a binary of their own).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bloomguard::redis::fleet::{FleetHandle, FleetSync, FleetSyncBuilder};
use bloomguard::{Guard, Verdict};
use tokio_util::sync::CancellationToken;

use super::wait_until;

/// Short, so that scenarios about lapsed leases run in seconds.
pub(crate) const LEASE: Duration = Duration::from_millis(600);

pub(crate) fn guard(name: &str) -> Guard {
    Guard::builder()
        .name(name)
        .expected_items(100_000)
        .seed(0xf1ee7)
        .build()
        .unwrap()
}

pub(crate) struct Member {
    pub(crate) fleet: FleetSync,
    pub(crate) handle: FleetHandle,
}

impl Member {
    pub(crate) fn guard(&self) -> &Guard {
        self.fleet.guard()
    }
}

pub(crate) async fn join(guard: Guard, client: redis::Client, fleet: &str) -> Member {
    join_with(guard, client, fleet, |builder| builder).await
}

pub(crate) async fn join_with(
    guard: Guard,
    client: redis::Client,
    fleet: &str,
    configure: impl FnOnce(FleetSyncBuilder) -> FleetSyncBuilder,
) -> Member {
    let fleet = configure(FleetSync::builder(guard, client, fleet).lease(LEASE)).build();
    let handle = fleet.join().await.unwrap();
    Member { fleet, handle }
}

/// Whether Redis holds `key`.
pub(crate) fn exists(connection: &mut redis::Connection, key: &str) -> bool {
    redis::cmd("EXISTS").arg(key).query(connection).unwrap()
}

/// Waits until the member is caught up (not fenced).
pub(crate) async fn caught_up(member: &Member) {
    wait_until("the member to catch up", || !member.guard().is_fenced()).await;
}

/// A store of keys, and the keys whose fleet write completed.
#[derive(Default, Clone)]
pub(crate) struct Ledger {
    pub(crate) store: Arc<Mutex<HashSet<String>>>,
    pub(crate) completed: Arc<Mutex<Vec<String>>>,
}

impl Ledger {
    /// Writes `key` through `via`; `true` once the write completed.
    pub(crate) async fn write(&self, via: &FleetSync, key: String) -> bool {
        let store = Arc::clone(&self.store);
        let stored = key.clone();
        let written = via
            .insert_then_write(&key, async move { store.lock().unwrap().insert(stored) })
            .await;
        if written.is_ok() {
            self.completed.lock().unwrap().push(key);
        }
        written.is_ok()
    }

    pub(crate) fn completed(&self) -> Vec<String> {
        self.completed.lock().unwrap().clone()
    }
}

/// What the auditor saw.
#[derive(Debug, Default)]
pub(crate) struct AuditReport {
    /// Completed keys a member answered `Absent` for: must stay empty.
    pub(crate) absent: Vec<String>,
    pub(crate) rounds: u64,
    /// Per member: a completed key was answered `MaybePresent` while fenced.
    pub(crate) answered_fenced: Vec<bool>,
}

pub(crate) struct Audit {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<AuditReport>,
}

/// Checks every completed key on each of `members` until stopped.
pub(crate) fn audit(ledger: &Ledger, members: Vec<Guard>) -> Audit {
    let stop = CancellationToken::new();
    let ledger = ledger.clone();
    let stopped = stop.clone();
    let task = tokio::spawn(async move {
        let mut report = AuditReport {
            answered_fenced: vec![false; members.len()],
            ..AuditReport::default()
        };
        loop {
            let last_round = stopped.is_cancelled();
            // Only keys completed before the round starts.
            let completed = ledger.completed();
            for (i, member) in members.iter().enumerate() {
                let fenced = member.is_fenced();
                for key in &completed {
                    match member.check(key) {
                        Verdict::Absent => report.absent.push(format!("{}: {key}", member.name())),
                        Verdict::MaybePresent if fenced => report.answered_fenced[i] = true,
                        _ => {}
                    }
                }
            }
            report.rounds += 1;
            if last_round {
                return report;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    });
    Audit { stop, task }
}

impl Audit {
    pub(crate) async fn finish(self) -> AuditReport {
        self.stop.cancel();
        let report = self.task.await.unwrap();
        assert!(
            report.absent.is_empty(),
            "completed writes answered Absent ({} times), first: {:?}",
            report.absent.len(),
            &report.absent[..report.absent.len().min(5)]
        );
        report
    }
}

/// Writes `keys` through `via`, one after another, until done or stopped.
pub(crate) fn keep_writing(
    ledger: &Ledger,
    via: &FleetSync,
    keys: Vec<String>,
) -> tokio::task::JoinHandle<u64> {
    let (ledger, via) = (ledger.clone(), via.clone());
    tokio::spawn(async move {
        let mut completed = 0;
        for key in keys {
            completed += u64::from(ledger.write(&via, key).await);
        }
        completed
    })
}

pub(crate) fn keys(prefix: &str, count: usize) -> Vec<String> {
    (0..count).map(|i| format!("{prefix}:{i}")).collect()
}
