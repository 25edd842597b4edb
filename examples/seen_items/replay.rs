//! Replays feed requests against the store, with the guard in front or
//! without it, and records what it cost and how the guard aged meanwhile.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bloomguard::{Guard, GuardStats, GuardedLoader, Loader};
use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::mpsc;

use super::store::SeenStore;
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
    pub(crate) show_progress: bool,
}

/// The guard's state at one moment of a guarded phase.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    pub(crate) at: f64,
    pub(crate) fill_ratio: f64,
    pub(crate) estimated_fpr: f64,
    /// False positives ÷ negatives since the previous sample.
    pub(crate) observed_fpr: Option<f64>,
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
    pub(crate) audited_checks: u64,
    pub(crate) written: u64,
    pub(crate) elapsed: Duration,
    /// Per-request latency in nanoseconds, sorted.
    pub(crate) latencies: Vec<u64>,
    pub(crate) timeline: Vec<Sample>,
    pub(crate) events: Vec<Event>,
}

impl Phase {
    pub(crate) fn latency_quantile(&self, q: f64) -> Duration {
        let Some(last) = self.latencies.len().checked_sub(1) else {
            return Duration::ZERO;
        };
        Duration::from_nanos(self.latencies[(q * last as f64).round() as usize])
    }

    /// Negatives are the checks the store did not have; the guard's false
    /// positives are the store calls for them.
    pub(crate) fn observed_fpr(&self) -> f64 {
        let negatives = self.checks - self.found;
        let false_positives = self.store_keys - self.found;
        false_positives as f64 / negatives.max(1) as f64
    }
}

#[derive(Debug, Default)]
struct Tally {
    requests: AtomicU64,
    checks: AtomicU64,
    found: AtomicU64,
    audited_checks: AtomicU64,
    written: AtomicU64,
}

/// What every worker shares.
struct Run {
    workload: Arc<Workload>,
    store: SeenStore,
    gate: Option<GuardedLoader<String, SeenStore>>,
    pacing: Pacing,
    started: Instant,
    deadline: Instant,
    tally: Tally,
}

impl Run {
    /// The guard in front of the store, in a guarded phase.
    fn guard(&self) -> Option<&Guard> {
        self.gate.as_ref().map(GuardedLoader::guard)
    }
}

/// Runs one phase: `pacing.concurrency` workers on the current runtime
/// (one thread), each issuing requests until the deadline.
pub(crate) async fn run(
    workload: &Arc<Workload>,
    store: &SeenStore,
    guard: Option<&Guard>,
    pacing: &Pacing,
    seed: u64,
) -> Result<Phase, String> {
    let lookups_before = store.lookups();
    let started = Instant::now();
    let run = Arc::new(Run {
        workload: Arc::clone(workload),
        store: store.clone(),
        gate: guard.map(|guard| GuardedLoader::new(guard.clone(), store.clone())),
        pacing: pacing.clone(),
        started,
        deadline: started + pacing.duration,
        tally: Tally::default(),
    });
    let (seen, to_write) = mpsc::channel(WRITE_QUEUE);
    let writer = tokio::spawn(write_seen(Arc::clone(&run), to_write));
    let workers: Vec<_> = (0..pacing.concurrency)
        .map(|id| tokio::spawn(worker(Arc::clone(&run), id, seed, seen.clone())))
        .collect();
    drop(seen);
    let observing = tokio::spawn(observe(Arc::clone(&run)));
    let mut latencies = Vec::new();
    for worker in workers {
        latencies.extend(worker.await.map_err(|error| error.to_string())??);
    }
    let elapsed = started.elapsed();
    writer.await.map_err(|error| error.to_string())??;
    let (timeline, events) = observing.await.map_err(|error| error.to_string())?;
    latencies.sort_unstable();
    let (store_keys, store_calls) = store.lookups_since(lookups_before);
    let tally = &run.tally;
    Ok(Phase {
        guarded: guard.is_some(),
        requests: tally.requests.load(Ordering::Relaxed),
        checks: tally.checks.load(Ordering::Relaxed),
        store_keys,
        store_calls,
        found: tally.found.load(Ordering::Relaxed),
        audited_checks: tally.audited_checks.load(Ordering::Relaxed),
        written: tally.written.load(Ordering::Relaxed),
        elapsed,
        latencies,
        timeline,
        events,
    })
}

/// Issues requests until the deadline; returns their latencies.
async fn worker(
    run: Arc<Run>,
    id: usize,
    seed: u64,
    seen: mpsc::Sender<Vec<u64>>,
) -> Result<Vec<u64>, String> {
    let pacing = &run.pacing;
    let mut rng = Rng::new(seed ^ (id as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d));
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
        // What the store must hold, taken before asking: a write that lands
        // while the request runs may or may not be seen by it.
        let must_hold: Vec<bool> = if audited {
            let now = Instant::now();
            pairs
                .iter()
                .map(|&pair| run.workload.truth.must_hold(pair, now, AUDIT_MARGIN))
                .collect()
        } else {
            Vec::new()
        };
        let answers = match &run.gate {
            Some(gate) => gate
                .get_many(&keys)
                .await
                .map_err(|error| error.to_string())?,
            None => run.store.load_many(keys.clone()).await?,
        };
        latencies.push(due.elapsed().as_nanos() as u64);

        if let Some(missed) = must_hold
            .iter()
            .zip(&answers)
            .position(|(&held, answer)| held && answer.is_none())
        {
            return Err(format!(
                "false negative: {} was seen and is in the store, but was answered unseen",
                keys[missed]
            ));
        }
        let found = answers.iter().filter(|answer| answer.is_some()).count() as u64;
        let tally = &run.tally;
        tally.requests.fetch_add(1, Ordering::Relaxed);
        tally.checks.fetch_add(keys.len() as u64, Ordering::Relaxed);
        tally.found.fetch_add(found, Ordering::Relaxed);
        tally
            .audited_checks
            .fetch_add(must_hold.len() as u64, Ordering::Relaxed);

        let shown: Vec<u64> = (0..keys.len())
            .filter(|&i| answers[i].is_none())
            .take(pacing.new_seen_per_request)
            .map(|i| pairs[i])
            .collect();
        if !shown.is_empty() && seen.send(shown).await.is_err() {
            return Err("the writer of seen items stopped".into());
        }
    }
    Ok(latencies)
}

/// Expiry (rotation mode) may drop a key this close to its deadline while
/// a request runs; such keys are not audited.
const AUDIT_MARGIN: Duration = Duration::from_secs(2);

/// Requests whose seen items wait to be written, at most.
const WRITE_QUEUE: usize = 1024;
/// Seen items written to the store in one go, at most.
const WRITE_BATCH: usize = 512;

/// Writes what users saw, batched as an impression log would be: guard first,
/// then the store (the ordering rule), and the pending writes hold a
/// rebuild's scan until the store has them. Ends when every worker has.
async fn write_seen(run: Arc<Run>, mut seen: mpsc::Receiver<Vec<u64>>) -> Result<(), String> {
    let mut batch = Vec::with_capacity(WRITE_BATCH);
    while let Some(pairs) = seen.recv().await {
        batch.extend(pairs);
        while batch.len() < WRITE_BATCH {
            let Ok(more) = seen.try_recv() else { break };
            batch.extend(more);
        }
        let keys: Vec<String> = batch.iter().map(|&pair| seen_key(pair)).collect();
        let written_at = Instant::now();
        let pending: Vec<_> = run
            .guard()
            .into_iter()
            .flat_map(|guard| keys.iter().map(|key| guard.begin_write(key)))
            .collect();
        run.store.write(&keys).await?;
        for &pair in &batch {
            run.workload.truth.record(pair, written_at);
        }
        drop(pending);
        run.tally
            .written
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        batch.clear();
    }
    Ok(())
}

/// Samples the guard and draws the progress bar until the deadline.
async fn observe(run: Arc<Run>) -> (Vec<Sample>, Vec<Event>) {
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
    while Instant::now() < run.deadline {
        ticks.tick().await;
        let at = run.started.elapsed().as_secs_f64();
        let requests = run.tally.requests.load(Ordering::Relaxed);
        let mut message = format!("{:>8.0} req/s", requests as f64 / at.max(1e-9));
        if let (Some(guard), Some(before)) = (guard, &mut previous) {
            let now = guard.stats();
            let sample = sample_between(before, &now, at);
            if now.generation != before.generation {
                let rebuild = now.rebuilds.succeeded != before.rebuilds.succeeded;
                events.push(Event { at, rebuild });
            }
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
    (timeline, events)
}

fn sample_between(before: &GuardStats, now: &GuardStats, at: f64) -> Sample {
    let absent = now.checks.absent - before.checks.absent;
    let passed = (now.checks.maybe_present + now.checks.warming)
        - (before.checks.maybe_present + before.checks.warming);
    let false_positives = now.false_positives - before.false_positives;
    let negatives = absent + false_positives;
    Sample {
        at,
        fill_ratio: now.fill_ratio,
        estimated_fpr: now.estimated_fpr,
        observed_fpr: (negatives >= 1_000).then(|| false_positives as f64 / negatives as f64),
        pass_through: (absent + passed > 0).then(|| passed as f64 / (absent + passed) as f64),
        estimated_drift: now.estimated_drift,
    }
}
