//! Replays feed requests against the store, with the guard in front or
//! without it, and records what it cost and how the guard aged meanwhile.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bloomguard::{Guard, GuardStats, GuardedLoader, Loader, Verdict, Verify};
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::mpsc;

use super::store::SeenStore;
use rand::SeedableRng;

use super::workload::{Rng, Workload, seen_key, write_seen_key};

/// How a phase runs, from the command line.
#[derive(Debug, Clone)]
pub(crate) struct Pacing {
    pub(crate) duration: Duration,
    /// Requests per second to issue; 0 issues them as fast as they complete.
    pub(crate) rate: u64,
    pub(crate) concurrency: usize,
    /// Candidates the user sees per request, written to the store as seen.
    pub(crate) new_seen_per_request: usize,
    /// Every n-th request is checked against the ground truth.
    pub(crate) audit_every: u64,
    /// The tests' fault: every n-th seen item is written without the
    /// guard's insert.
    pub(crate) bypass_guard_every: Option<u64>,
    /// Which "maybe" answers go on to the store.
    pub(crate) verify: Verify,
    /// The drift at which the guard rebuilds, if drift triggers rebuilds: a
    /// rebuild due or running when the requests end is waited for, so the
    /// report shows it however slowly the machine ran.
    pub(crate) rebuild_drift: Option<f64>,
    pub(crate) show_progress: bool,
}

/// A fleet member (`--instances`); without the `redis` feature there are none.
#[cfg(feature = "redis")]
pub(crate) type Fleet = bloomguard::redis::FleetSync;
#[cfg(not(feature = "redis"))]
pub(crate) type Fleet = std::convert::Infallible;

/// What a fleet's members measured over a phase.
#[derive(Debug, Clone)]
pub(crate) struct FleetFigures {
    pub(crate) instances: usize,
    /// Time each batch of history writes waited for every member to apply it, sorted.
    pub(crate) acknowledgements: Vec<Duration>,
    /// The largest lag any member showed in the samples.
    pub(crate) largest_lag: Duration,
}

impl FleetFigures {
    pub(crate) fn ack_quantile(&self, q: f64) -> Duration {
        let Some(last) = self.acknowledgements.len().checked_sub(1) else {
            return Duration::ZERO;
        };
        self.acknowledgements[(q * last as f64).round() as usize]
    }
}

/// The guard's state at one moment of a guarded phase.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    pub(crate) at: f64,
    pub(crate) fill_ratio: f64,
    pub(crate) estimated_fpr: f64,
    /// False positives ÷ negatives since the previous sample (the trusted
    /// positives' false ones estimated by the guard).
    pub(crate) observed_fpr: Option<f64>,
    /// Over-filtered ÷ negatives since the previous sample, as the guard
    /// estimates it (none when every "maybe" is verified).
    pub(crate) over_filtering: Option<f64>,
    /// Share of checks since the previous sample that went to the store
    /// (none if there were no checks).
    pub(crate) pass_through: Option<f64>,
    pub(crate) estimated_drift: f64,
}

/// A rebuild or a rotation, seconds into the phase.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Event {
    pub(crate) at: f64,
    pub(crate) rebuild: bool,
}

#[derive(Debug, Default)]
pub(crate) struct Phase {
    pub(crate) guarded: bool,
    pub(crate) requests: u64,
    pub(crate) checks: u64,
    /// Keys the store was asked about, and the round trips that asked.
    pub(crate) store_keys: u64,
    pub(crate) store_calls: u64,
    /// Candidates the store had (seen items).
    pub(crate) found: u64,
    /// Audited candidates the store held for the whole request: where a
    /// false negative would have shown.
    pub(crate) audited_seen: u64,
    /// Checks of the pairs the store held at the end, in every instance's
    /// guard that was not fenced then.
    pub(crate) swept: u64,
    /// Audited candidates the store did not hold, and those of them answered
    /// "seen" anyway: unseen items hidden from the user (over-filtered).
    pub(crate) audited_unseen: u64,
    pub(crate) hidden: u64,
    /// The guard's counts over the phase: false-positive rate (trusted
    /// positives' false ones estimated) and estimated over-filtering.
    pub(crate) guard_fpr: Option<f64>,
    pub(crate) estimated_over_filtering: Option<f64>,
    pub(crate) written: u64,
    pub(crate) elapsed: Duration,
    /// Per-request latency in nanoseconds, sorted.
    pub(crate) latencies: Vec<u64>,
    pub(crate) timeline: Vec<Sample>,
    pub(crate) events: Vec<Event>,
    /// With `--instances`: the fleet's figures.
    pub(crate) fleet: Option<FleetFigures>,
}

impl Phase {
    pub(crate) fn latency_quantile(&self, q: f64) -> Duration {
        let Some(last) = self.latencies.len().checked_sub(1) else {
            return Duration::ZERO;
        };
        Duration::from_nanos(self.latencies[(q * last as f64).round() as usize])
    }

    /// Share of the audited unseen candidates answered "seen".
    pub(crate) fn hidden_rate(&self) -> Option<f64> {
        (self.audited_unseen > 0).then(|| self.hidden as f64 / self.audited_unseen as f64)
    }
}

#[derive(Debug, Default)]
struct Tally {
    requests: AtomicU64,
    checks: AtomicU64,
    found: AtomicU64,
    audited_seen: AtomicU64,
    audited_unseen: AtomicU64,
    hidden: AtomicU64,
    written: AtomicU64,
}

/// What every worker shares.
struct Run {
    workload: Arc<Workload>,
    store: SeenStore,
    /// One per instance; none in the unguarded phase. Worker `i` asks gate
    /// `i % n`, as a load balancer would spread requests.
    gates: Vec<GuardedLoader<String, SeenStore>>,
    /// One per instance when the guards form a fleet: history write batch
    /// `b` goes through member `b % n`.
    fleets: Vec<Fleet>,
    acknowledgements: std::sync::Mutex<Vec<Duration>>,
    pacing: Pacing,
    started: Instant,
    deadline: Instant,
    tally: Tally,
    /// Set once every request is answered and its writes are stored.
    finished: AtomicBool,
}

impl Run {
    /// The first instance's guard, in a guarded phase: the one sampled.
    fn guard(&self) -> Option<&Guard> {
        self.gates.first().map(GuardedLoader::guard)
    }
}

/// Runs one phase: `pacing.concurrency` workers on the current runtime
/// (one thread), each issuing requests until the deadline, through the
/// `guards` (none: the unguarded phase), which form a fleet when `fleets`
/// has one member per guard.
pub(crate) async fn run(
    workload: &Arc<Workload>,
    store: &SeenStore,
    guards: &[Guard],
    fleets: &[Fleet],
    pacing: &Pacing,
    seed: u64,
) -> Result<Phase, String> {
    let lookups_before = store.lookups();
    let guard = guards.first();
    let stats_before = guard.map(Guard::stats);
    let gates = guards
        .iter()
        .map(|guard| {
            GuardedLoader::new(guard.clone(), store.clone())
                .verify(pacing.verify)
                .map_err(|error| error.to_string())
        })
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    let run = Arc::new(Run {
        workload: Arc::clone(workload),
        store: store.clone(),
        gates,
        fleets: fleets.to_vec(),
        acknowledgements: std::sync::Mutex::new(Vec::new()),
        pacing: pacing.clone(),
        started,
        deadline: started + pacing.duration,
        tally: Tally::default(),
        finished: AtomicBool::new(false),
    });
    let (seen, to_write) = mpsc::channel(WRITE_QUEUE);
    // One writer per fleet member, so that each waits for its own
    // acknowledgements while the others write.
    let to_write = Arc::new(tokio::sync::Mutex::new(to_write));
    let writers: Vec<_> = (0..fleets.len().max(1))
        .map(|member| tokio::spawn(write_seen(Arc::clone(&run), member, Arc::clone(&to_write))))
        .collect();
    // The writers hold the queue: once every one has stopped (a failed
    // store write), the workers' sends fail rather than wait for room.
    drop(to_write);
    let workers: Vec<_> = (0..pacing.concurrency)
        .map(|id| tokio::spawn(worker(Arc::clone(&run), id, seed, seen.clone())))
        .collect();
    drop(seen);
    let observing = tokio::spawn(observe(Arc::clone(&run)));
    let mut latencies = Vec::new();
    for worker in workers {
        match worker.await.map_err(|error| error.to_string())? {
            Ok(answered) => latencies.extend(answered),
            // The writers' own error says why they stopped.
            Err(error) if error == WRITER_STOPPED => {
                for writer in writers {
                    writer.await.map_err(|error| error.to_string())??;
                }
                return Err(error);
            }
            Err(error) => return Err(error),
        }
    }
    let elapsed = started.elapsed();
    for writer in writers {
        writer.await.map_err(|error| error.to_string())??;
    }
    run.finished.store(true, Ordering::Release);
    let (timeline, events, largest_lag) = observing.await.map_err(|error| error.to_string())?;
    // After the rebuild the phase waited for: the filters the job ends on.
    let swept = sweep(&run).await?;
    let fleet = (!fleets.is_empty()).then(|| {
        let mut acknowledgements = std::mem::take(&mut *run.acknowledgements.lock().unwrap());
        acknowledgements.sort_unstable();
        FleetFigures {
            instances: fleets.len(),
            acknowledgements,
            largest_lag,
        }
    });
    latencies.sort_unstable();
    let (store_keys, store_calls) = store.lookups_since(lookups_before);
    let tally = &run.tally;
    let over_phase = guard
        .zip(stats_before.as_ref())
        .map(|(guard, before)| match pacing.verify {
            // Nothing verified: each sample read the fill of its time, and
            // the fill at the end would speak for the end only.
            Verify::None => {
                let rates: Vec<f64> = timeline.iter().filter_map(|s| s.over_filtering).collect();
                let mean =
                    (!rates.is_empty()).then(|| rates.iter().sum::<f64>() / rates.len() as f64);
                Rates {
                    false_positive: mean,
                    over_filtering: mean,
                }
            }
            _ => between(before, &guard.stats(), 1),
        });
    Ok(Phase {
        guarded: guard.is_some(),
        requests: tally.requests.load(Ordering::Relaxed),
        checks: tally.checks.load(Ordering::Relaxed),
        store_keys,
        store_calls,
        found: tally.found.load(Ordering::Relaxed),
        audited_seen: tally.audited_seen.load(Ordering::Relaxed),
        swept,
        audited_unseen: tally.audited_unseen.load(Ordering::Relaxed),
        hidden: tally.hidden.load(Ordering::Relaxed),
        guard_fpr: over_phase.and_then(|rates| rates.false_positive),
        estimated_over_filtering: over_phase.and_then(|rates| rates.over_filtering),
        written: tally.written.load(Ordering::Relaxed),
        elapsed,
        latencies,
        timeline,
        events,
        fleet,
    })
}

/// Whether `guard`, a fleet member's, is unfenced (caught up with the
/// fleet) by `deadline`, looked at every 10 ms.
pub(crate) async fn caught_up_by(guard: &Guard, deadline: Instant) -> bool {
    while guard.is_fenced() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

/// Checks every pair ever written against every instance's guard, once
/// the writes are done and the last rebuild has ended: the requests only
/// meet the pairs their users are drawn for. A pair the store holds by the
/// ground truth must not be absent; one the truth has expired (its clock
/// starts before the guard's insert, the store's after) is asked of the
/// store when the guard answers it absent, so that a guard forgetting a
/// key before the store does shows, which the truth alone cannot. A fenced
/// member answers "maybe" to all, so each is given a while to catch up
/// first; one that does not fails the run, as unchecked. Returns how many
/// checks could have failed.
async fn sweep(run: &Run) -> Result<u64, String> {
    let mut swept = 0;
    let written = run.workload.truth.pairs();
    for (instance, gate) in run.gates.iter().enumerate() {
        if !caught_up_by(gate.guard(), Instant::now() + SWEEP_CATCH_UP).await {
            return Err(format!(
                "instance {instance}'s fleet member is still fenced {SWEEP_CATCH_UP:?} after \
                 the final check reached it: its guard could not be checked"
            ));
        }
        swept += written.len() as u64;
        let mut absent_after_expiry = Vec::new();
        // Both ways of asking: one key at a time, and in the batches the
        // requests ask in.
        let mut batched = [Verdict::Warming; 64];
        for group in written.chunks(batched.len()) {
            let keys: Vec<String> = group.iter().map(|&pair| seen_key(pair)).collect();
            gate.guard().check_many(&keys, &mut batched[..keys.len()]);
            for ((key, &pair), answer) in keys.into_iter().zip(group).zip(batched) {
                if !answer.is_absent() && !gate.guard().check(&key).is_absent() {
                    continue;
                }
                // The time after the check: held then, so held during it.
                let until = run.workload.truth.held_until(pair).flatten();
                if until.is_none_or(|until| Instant::now() + EXPIRY_SKEW < until) {
                    return Err(format!(
                        "false negative: instance {instance}'s guard answers {key} absent, \
                         which the store holds"
                    ));
                }
                absent_after_expiry.push(key);
            }
        }
        // Asked after the guard: a pair the store holds now it held then
        // (no write runs any more, and expiry only removes).
        for keys in absent_after_expiry.chunks(512) {
            let held = run.store.holds(keys).await?;
            if let Some(still) = held.iter().position(|&held| held) {
                return Err(format!(
                    "false negative: instance {instance}'s guard answers {} absent, which the \
                     store still holds (its expiry has not come)",
                    keys[still]
                ));
            }
        }
    }
    Ok(swept)
}

/// How long the sweep waits for a fenced fleet member to catch up.
const SWEEP_CATCH_UP: Duration = Duration::from_secs(30);

/// A worker's error once no writer takes seen items any more.
const WRITER_STOPPED: &str = "the writer of seen items stopped";

/// Issues requests until the deadline; returns their latencies.
async fn worker(
    run: Arc<Run>,
    id: usize,
    seed: u64,
    seen: mpsc::Sender<Vec<u64>>,
) -> Result<Vec<u64>, String> {
    let pacing = &run.pacing;
    let mut rng = Rng::seed_from_u64(seed ^ (id as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
    let mut pairs = Vec::with_capacity(run.workload.shape.candidates);
    let mut keys: Vec<String> = Vec::new();
    let mut latencies = Vec::new();
    for n in 0u64.. {
        // Paced requests are due on a fixed schedule, and their latency
        // counts from when they were due: a slow answer delays the next
        // ones, and that shows (no coordinated omission).
        let due = if pacing.rate == 0 {
            Instant::now()
        } else {
            let slot = n * pacing.concurrency as u64 + id as u64;
            run.started + Duration::from_secs_f64(slot as f64 / pacing.rate as f64)
        };
        if due >= run.deadline {
            break;
        }
        if due > Instant::now() {
            // (A sleep rounds up to the timer's millisecond: never sleep
            // for a request already due.)
            tokio::time::sleep_until(due.into()).await;
        }

        run.workload.request(&mut rng, &mut pairs);
        keys.resize_with(pairs.len(), String::new);
        for (key, &pair) in keys.iter_mut().zip(&pairs) {
            write_seen_key(key, pair);
        }
        let audited = n % pacing.audit_every == id as u64 % pacing.audit_every;
        // What was written, taken before asking: a write that lands while
        // the request runs may or may not be seen by it.
        let held_until: Vec<Option<Option<Instant>>> = if audited {
            pairs
                .iter()
                .map(|&pair| run.workload.truth.held_until(pair))
                .collect()
        } else {
            Vec::new()
        };
        let gate = run.gates.get(id % run.gates.len().max(1));
        let answers: Vec<bool> = match gate {
            Some(gate) => gate
                .contains_many(&keys)
                .await
                .map_err(|error| error.to_string())?,
            None => run
                .store
                .load_many(keys.clone())
                .await?
                .iter()
                .map(Option::is_some)
                .collect(),
        };
        latencies.push(due.elapsed().as_nanos() as u64);

        // Held for the whole request: written before it began, and still
        // held after its answer (expiry only ever removes).
        let answered = Instant::now();
        let must_hold: Vec<bool> = held_until
            .iter()
            .map(|held| {
                held.is_some_and(|until| until.is_none_or(|until| answered + EXPIRY_SKEW < until))
            })
            .collect();
        if let Some(missed) = must_hold
            .iter()
            .zip(&answers)
            .position(|(&held, &seen)| held && !seen)
        {
            // Which one answered it: the guard, or a store that lost it.
            let by = match gate.map(|gate| gate.guard().check(&keys[missed])) {
                Some(Verdict::Absent) => "the guard answers it absent",
                Some(_) => "the guard holds it, so the store did not return it (evicted?)",
                None => "the store did not return it (evicted?)",
            };
            return Err(format!(
                "false negative: {} was seen and written to the store, but was answered \
                 unseen: {by}",
                keys[missed]
            ));
        }
        let tally = &run.tally;
        if audited {
            // Read after the answer: a write that landed meanwhile was seen.
            // Expiry is left out: the store's and the truth's clocks for a
            // write differ by the write's duration, so near its end a pair
            // is neither surely held nor surely gone.
            let unseen: Vec<bool> = pairs
                .iter()
                .map(|&pair| !run.workload.truth.has_seen(pair))
                .collect();
            let hidden = unseen.iter().zip(&answers).filter(|&(&u, &seen)| u && seen);
            tally
                .hidden
                .fetch_add(hidden.count() as u64, Ordering::Relaxed);
            let unseen = unseen.iter().filter(|&&u| u).count() as u64;
            tally.audited_unseen.fetch_add(unseen, Ordering::Relaxed);
        }
        let found = answers.iter().filter(|&&seen| seen).count() as u64;
        tally.requests.fetch_add(1, Ordering::Relaxed);
        tally.checks.fetch_add(keys.len() as u64, Ordering::Relaxed);
        tally.found.fetch_add(found, Ordering::Relaxed);
        tally.audited_seen.fetch_add(
            must_hold.iter().filter(|&&held| held).count() as u64,
            Ordering::Relaxed,
        );

        let shown: Vec<u64> = (0..keys.len())
            .filter(|&i| !answers[i])
            .take(pacing.new_seen_per_request)
            .map(|i| pairs[i])
            .collect();
        if !shown.is_empty() && seen.send(shown).await.is_err() {
            return Err(WRITER_STOPPED.into());
        }
    }
    Ok(latencies)
}

/// How far the store's expiry clock (Redis's wall clock) may drift ahead of
/// this process's over a run: a pair this close to its expiry is not
/// required. A step of the wall clock (an NTP step) is not covered.
const EXPIRY_SKEW: Duration = Duration::from_millis(50);

/// Requests whose seen items wait to be written, at most.
const WRITE_QUEUE: usize = 1024;
/// Seen items written to the store in one go, at most.
const WRITE_BATCH: usize = 512;

/// Writes what users saw, batched as an impression log would be: guard first,
/// then the store (the ordering rule), and the pending writes hold a
/// rebuild's scan until the store has them. In a fleet, through `member`,
/// counting a batch as written once the fleet acknowledged it. Ends when
/// every worker has.
async fn write_seen(
    run: Arc<Run>,
    member: usize,
    seen: Arc<tokio::sync::Mutex<mpsc::Receiver<Vec<u64>>>>,
) -> Result<(), String> {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    loop {
        {
            let mut seen = seen.lock().await;
            let Some(pairs) = seen.recv().await else {
                break;
            };
            batch.extend(pairs);
            while batch.len() < WRITE_BATCH {
                let Ok(more) = seen.try_recv() else { break };
                batch.extend(more);
            }
        }
        let keys: Vec<String> = batch.iter().map(|&pair| seen_key(pair)).collect();
        let written_at = Instant::now();
        match run.fleets.get(member) {
            Some(fleet) => {
                let acknowledged = write_through(fleet, &run.store, &keys).await?;
                run.acknowledgements.lock().unwrap().push(acknowledged);
            }
            None => {
                let bypassed = |pair: u64| {
                    run.pacing
                        .bypass_guard_every
                        .is_some_and(|n| pair.is_multiple_of(n))
                };
                let pending: Vec<_> = run
                    .guard()
                    .into_iter()
                    .flat_map(|guard| {
                        keys.iter()
                            .zip(&batch)
                            .filter(|&(_, &pair)| !bypassed(pair))
                            .map(|(key, _)| guard.begin_write(key))
                    })
                    .collect();
                run.store.write(&keys).await?;
                drop(pending);
            }
        }
        for &pair in &batch {
            run.workload.truth.record(pair, written_at);
        }
        run.tally
            .written
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        batch.clear();
    }
    Ok(())
}

/// Writes `keys` through a fleet member; returns how long the fleet took
/// to acknowledge them.
#[cfg(feature = "redis")]
async fn write_through(
    fleet: &Fleet,
    store: &SeenStore,
    keys: &[String],
) -> Result<Duration, String> {
    let started = Instant::now();
    let write = fleet
        .begin_write_many(keys)
        .await
        .map_err(|error| error.to_string())?;
    let acknowledged = started.elapsed();
    store.write(keys).await?;
    write.finish().await.map_err(|error| error.to_string())?;
    Ok(acknowledged)
}

#[cfg(not(feature = "redis"))]
async fn write_through(fleet: &Fleet, _: &SeenStore, _: &[String]) -> Result<Duration, String> {
    match *fleet {}
}

/// The member's lag behind the fleet's stream, and how often it replaced
/// its set with a snapshot (another member's rebuild).
#[cfg(feature = "redis")]
fn lag_and_replacements(fleet: &Fleet) -> (Duration, u64) {
    let stats = fleet.stats();
    (stats.lag, stats.replacements)
}

#[cfg(not(feature = "redis"))]
fn lag_and_replacements(fleet: &Fleet) -> (Duration, u64) {
    match *fleet {}
}

/// How long a phase waits, after its requests, for a rebuild due or running.
const REBUILD_WAIT: Duration = Duration::from_secs(30);

/// Samples the guard and draws the progress bar until the requests are
/// done (a slow machine runs past the deadline), then while a rebuild is due
/// or running (up to [`REBUILD_WAIT`]).
async fn observe(run: Arc<Run>) -> (Vec<Sample>, Vec<Event>, Duration) {
    let guard = run.guard();
    let pacing = &run.pacing;
    let every = (pacing.duration / 200).max(Duration::from_millis(20));
    let progress = if pacing.show_progress {
        ProgressBar::new(pacing.duration.as_millis() as u64)
    } else {
        ProgressBar::hidden()
    };
    progress.set_style(
        ProgressStyle::with_template("{prefix:>9} [{bar:30}] {elapsed:>3} {msg}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    progress.set_prefix(if guard.is_some() {
        "guarded"
    } else {
        "no guard"
    });
    let (mut timeline, mut events) = (Vec::new(), Vec::new());
    let mut previous = guard.map(Guard::stats);
    let mut ticks = tokio::time::interval(every);
    let mut rebuild_wait_ends = None;
    let mut largest_lag = Duration::ZERO;
    let mut replacements_before = run
        .fleets
        .first()
        .map_or(0, |fleet| lag_and_replacements(fleet).1);
    loop {
        ticks.tick().await;
        let members: Vec<_> = run.fleets.iter().map(lag_and_replacements).collect();
        largest_lag = members
            .iter()
            .map(|&(lag, _)| lag)
            .fold(largest_lag, Duration::max);
        // The sampled guard's set replaced with another member's rebuild.
        let replacements = members.first().map_or(0, |&(_, replacements)| replacements);
        if run.finished.load(Ordering::Acquire) {
            let ends = *rebuild_wait_ends.get_or_insert_with(|| Instant::now() + REBUILD_WAIT);
            let rebuild_pending = previous.as_ref().is_some_and(|stats| {
                stats.rebuilding
                    || pacing
                        .rebuild_drift
                        .is_some_and(|drift| stats.estimated_drift > drift)
            });
            if !rebuild_pending || Instant::now() >= ends {
                break;
            }
        }
        let at = run.started.elapsed().as_secs_f64();
        let requests = run.tally.requests.load(Ordering::Relaxed);
        let mut message = format!("{:>8.0} req/s", requests as f64 / at.max(1e-9));
        if let (Some(guard), Some(before)) = (guard, &mut previous) {
            let now = guard.stats();
            let sample = sample_between(before, &now, at);
            if now.swaps != before.swaps {
                let rebuild = now.rebuilds.succeeded != before.rebuilds.succeeded
                    || replacements != replacements_before;
                events.push(Event { at, rebuild });
            }
            replacements_before = replacements;
            message += &format!(
                "  fill {:.2}  est. FPR {:.2} %  drift {:.2}  rebuilds {}",
                sample.fill_ratio,
                100.0 * sample.estimated_fpr,
                sample.estimated_drift,
                now.rebuilds.succeeded
            );
            timeline.push(sample);
            *before = now;
        }
        progress.set_position(run.started.elapsed().as_millis() as u64);
        progress.set_message(message);
    }
    progress.finish_and_clear();
    (timeline, events, largest_lag)
}

fn sample_between(before: &GuardStats, now: &GuardStats, at: f64) -> Sample {
    let absent = now.checks.absent - before.checks.absent;
    let passed = (now.checks.maybe_present + now.checks.warming)
        - (before.checks.maybe_present + before.checks.warming);
    let rates = between(before, now, MIN_NEGATIVES_PER_SAMPLE);
    Sample {
        at,
        fill_ratio: now.fill_ratio,
        estimated_fpr: now.estimated_fpr,
        observed_fpr: rates.false_positive,
        over_filtering: rates.over_filtering,
        pass_through: (absent + passed > 0).then(|| passed as f64 / (absent + passed) as f64),
        estimated_drift: now.estimated_drift,
    }
}

/// Fewer negatives than this between two samples say too little of a rate.
const MIN_NEGATIVES_PER_SAMPLE: u64 = 1_000;

/// Rates among the negatives a guard counted between two readings.
#[derive(Debug, Clone, Copy)]
struct Rates {
    /// False positives (trusted ones estimated) ÷ negatives.
    false_positive: Option<f64>,
    /// Trusted positives estimated false ÷ negatives; none if none were trusted.
    over_filtering: Option<f64>,
}

/// The guard's rates between `before` and `now`, if at least
/// `min_negatives` negatives were counted. Trusted positives are judged by
/// the verified ones' false share; with none verified (`--verify none`), by
/// the filters' fill now.
fn between(before: &GuardStats, now: &GuardStats, min_negatives: u64) -> Rates {
    let absent = (now.checks.absent - before.checks.absent) as f64;
    let verified_false = (now.false_positives - before.false_positives) as f64;
    let verified_true = (now.found - before.found) as f64;
    let trusted = (now.unverified_positives - before.unverified_positives) as f64;
    let unknown = Rates {
        false_positive: None,
        over_filtering: None,
    };
    let false_share = if trusted == 0.0 {
        0.0
    } else if verified_false + verified_true > 0.0 {
        verified_false / (verified_false + verified_true)
    } else if absent >= min_negatives as f64 {
        return Rates {
            false_positive: Some(now.estimated_fpr),
            over_filtering: Some(now.estimated_fpr),
        };
    } else {
        return unknown;
    };
    let over_filtered = trusted * false_share;
    let negatives = absent + verified_false + over_filtered;
    if negatives < min_negatives.max(1) as f64 {
        return unknown;
    }
    Rates {
        false_positive: Some((verified_false + over_filtered) / negatives),
        over_filtering: (trusted > 0.0).then(|| over_filtered / negatives),
    }
}
