//! The seen-items gate: "has this user already seen this item?" for every
//! candidate of a recommendation feed, answered by a guard in front of the
//! store so that only "maybe" answers cost a lookup.
//!
//! ```text
//! cargo run --release --features redis,postgres --example seen_items
//! REDIS_URL=redis://127.0.0.1:6379/ cargo run --release --features redis,postgres --example seen_items
//! DATABASE_URL=postgres://app@127.0.0.1/app cargo run --release --features redis,postgres --example seen_items
//! cargo run --release --features redis,postgres --example seen_items -- --help
//! ```
//!
//! It draws a seen history (users by Zipf activity, items by Zipf
//! popularity), writes it to the store — an embedded in-memory store, Redis
//! when `REDIS_URL` is set, a Redis Cluster with `REDIS_CLUSTER_URLS`,
//! PostgreSQL with `DATABASE_URL` — and builds the guard from the store as a
//! `KeySource`. Then it replays feed requests (120 candidates each, 97 %
//! unseen by default) through `GuardedLoader::contains_many`: `check_many`
//! (64 keys at a time), one batch lookup (MGET) for the "maybe" candidates (`--verify sample:F` or
//! `none` trusts most or all of them instead). Users keep seeing new
//! items, so the history grows while it runs, the filter's drift rises and
//! the maintenance task rebuilds it (or rotates windows, `--lifecycle
//! rotate`). The same replay without the guard comes second; the report
//! puts them side by side, and a picture of the guard over time is written.
//!
//! Requests run on one thread (a current-thread runtime); the guard's
//! maintenance runs on a second one, as a service's background task would.
//! Every few requests are audited against the ground truth, and when the
//! requests end every item the store holds is checked in every guard: a
//! false negative stops the run with an error.

pub(crate) mod replay;
pub(crate) mod report;
pub(crate) mod store;
mod workload;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bloomguard::{Guard, GuardBuilder, Lifecycle, RebuildPolicy, Verify};
use clap::{Parser, ValueEnum};

use replay::Pacing;
use report::{Outcome, draw_chart, exact_set_bytes};
use store::{Backend, MemoryStore, SeenStore};
use workload::{Shape, Workload, seen_key};

/// Replay a recommendation feed through a bloomguard seen-items gate, with
/// and without the guard, and report what it saved.
#[derive(Debug, Clone, Parser)]
#[command(name = "seen_items", args_override_self = true)]
pub(crate) struct Args {
    /// Users; their activity follows Zipf(--user-skew).
    #[arg(long, default_value_t = 100_000)]
    pub(crate) users: u64,
    /// Items; their popularity follows Zipf(--item-skew).
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) items: u64,
    /// (user, item) pairs seen before the run starts.
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) history: u64,
    /// Zipf exponent of user activity (0 = every user alike).
    #[arg(long, default_value_t = 0.8)]
    pub(crate) user_skew: f64,
    /// Zipf exponent of item popularity.
    #[arg(long, default_value_t = 1.0)]
    pub(crate) item_skew: f64,
    /// Candidates checked per feed request.
    #[arg(long, default_value_t = 120)]
    pub(crate) candidates: usize,
    /// Share of the candidates the user has not seen.
    #[arg(long, default_value_t = 0.97)]
    pub(crate) negative_ratio: f64,
    /// The guard's target false-positive rate.
    #[arg(long, default_value_t = 0.01)]
    pub(crate) fpr: f64,
    /// Feed requests per second to issue (the production peak is 18000,
    /// i.e. 2.16 M checks/s); 0 issues them as fast as they complete.
    #[arg(long, default_value_t = 18_000)]
    pub(crate) rate: u64,
    /// How long each replay runs: 10s, 500ms, 1m.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    pub(crate) duration: Duration,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 64)]
    pub(crate) concurrency: usize,
    /// Unseen candidates each request shows the user, written to the store
    /// as seen: this is how the history grows during the run.
    #[arg(long, default_value_t = 2)]
    pub(crate) new_seen: usize,
    /// How the guard ages: rebuild from the store on drift, or rotate
    /// time windows (the store then expires entries after --window).
    #[arg(long, value_enum, default_value_t = LifecycleChoice::Rebuild)]
    pub(crate) lifecycle: LifecycleChoice,
    /// Rebuild when the estimated FPR passes this multiple of the target (> 1).
    #[arg(long, default_value_t = 1.1)]
    pub(crate) drift: f64,
    /// A rebuild sizes the filter for the keys it counted times this.
    #[arg(long, default_value_t = 1.15)]
    pub(crate) headroom: f64,
    /// With `--lifecycle rotate`: how long a seen item counts as seen.
    #[arg(long, default_value = "4s", value_parser = humantime::parse_duration)]
    pub(crate) window: Duration,
    /// Skip the replay without the guard.
    #[arg(long)]
    pub(crate) no_baseline: bool,
    /// A fault for the tests: every n-th seen item goes to the store
    /// without the guard's insert (a write path that bypasses the guard),
    /// so that the audit has a false negative to catch (a single instance
    /// only: a fleet's writes go through it whole). Not for runs.
    #[arg(long, hide = true)]
    pub(crate) bypass_guard_every: Option<u64>,
    /// Every n-th request is checked against the ground truth (at least 1).
    #[arg(long, default_value_t = 8)]
    pub(crate) audit_every: u64,
    /// Which "maybe" answers are checked in the store: all; sample:F (a
    /// "maybe" is trusted as seen, except a hash-chosen fraction F that is
    /// checked so the false-positive rate stays measured); or none.
    #[arg(long, default_value_t = Verify::All)]
    pub(crate) verify: Verify,
    /// The store: Redis at this URL (needs the `redis` feature); the
    /// embedded in-memory store when unset.
    #[arg(long, env = "REDIS_URL")]
    pub(crate) redis_url: Option<String>,
    /// The store: a Redis Cluster with these seed nodes, comma-separated
    /// (needs the `redis` feature).
    #[arg(long, env = "REDIS_CLUSTER_URLS", value_delimiter = ',')]
    pub(crate) redis_cluster_urls: Vec<String>,
    /// The store: PostgreSQL at this URL (needs the `postgres` feature), the
    /// history in a table of its own (`bloomguard_seen`, recreated).
    #[arg(long, env = "DATABASE_URL")]
    pub(crate) database_url: Option<String>,
    /// Service instances, each with its own guard, joined as one fleet
    /// through Redis (needs `REDIS_URL` or `REDIS_CLUSTER_URLS`): requests are spread over them and
    /// each batch of history writes goes through the next one.
    #[arg(long, default_value_t = 1)]
    pub(crate) instances: usize,
    /// Where to write the picture (SVG).
    #[arg(long, default_value = "target/seen_items.svg")]
    pub(crate) chart: PathBuf,
    /// Seed of the history, the requests and the filter.
    #[arg(long, default_value_t = 0x5eed)]
    pub(crate) seed: u64,
    /// No progress bar.
    #[arg(long)]
    pub(crate) quiet: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LifecycleChoice {
    Rebuild,
    Rotate,
}

/// Generations kept in rotation mode.
const GENERATIONS: usize = 4;

/// How much longer the guard keeps a key than the store, at least.
const EXPIRY_MARGIN: Duration = Duration::from_millis(500);

/// The guard's size, in keys, when the history is smaller (a cold start).
const COLD_START_ITEMS: u64 = 10_000;

/// Requests per second assumed for sizing when `--rate 0` leaves it open.
const UNPACED_RATE_GUESS: u64 = 40_000;

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    // The requests run on this one thread; see the module docs.
    let outcome = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(Into::into)
        .and_then(|runtime| runtime.block_on(run(args.clone())));
    match outcome {
        Ok(outcome) => {
            outcome.print();
            println!("picture of the guard over time: {}", args.chart.display());
            std::process::ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("error: {error}");
            std::process::ExitCode::FAILURE
        }
    }
}

impl Args {
    /// What clap's types cannot say, and the guard's options as the guard
    /// checks them: all of it before any time goes into the history.
    pub(crate) fn check(&self) -> Result<(), Box<dyn std::error::Error>> {
        let fits_u32 = |n: u64| (1..=u64::from(u32::MAX)).contains(&n);
        if !fits_u32(self.users) || !fits_u32(self.items) {
            return Err("--users and --items must be between 1 and 2^32 - 1".into());
        }
        if self.history > self.users.saturating_mul(self.items) / 2 {
            return Err("--history must be at most half of --users × --items".into());
        }
        if !(0.0..=1.0).contains(&self.negative_ratio) {
            return Err("--negative-ratio must be within [0, 1]".into());
        }
        if self.candidates == 0 || self.concurrency == 0 {
            return Err("--candidates and --concurrency must be at least 1".into());
        }
        if self.duration.is_zero() || self.window.is_zero() {
            return Err("--duration and --window must be longer than zero".into());
        }
        let stores = usize::from(self.redis_url.is_some())
            + usize::from(self.database_url.is_some())
            + usize::from(!self.redis_cluster_urls.is_empty());
        if stores > 1 {
            return Err(
                "more than one of REDIS_URL, REDIS_CLUSTER_URLS and DATABASE_URL is set: choose one store"
                    .into(),
            );
        }
        if self.database_url.is_some() && self.lifecycle == LifecycleChoice::Rotate {
            return Err(
                "--lifecycle rotate needs a store that expires keys: Redis or the in-memory one"
                    .into(),
            );
        }
        if self.instances == 0 {
            return Err("--instances must be at least 1".into());
        }
        let on_redis = self.redis_url.is_some() || !self.redis_cluster_urls.is_empty();
        if self.instances > 1 && (!on_redis || cfg!(not(feature = "redis"))) {
            return Err("--instances above 1 needs Redis (REDIS_URL or REDIS_CLUSTER_URLS, and the `redis` feature): the fleet syncs through it".into());
        }
        if self.audit_every == 0 {
            return Err("--audit-every must be at least 1 (1 audits every request)".into());
        }
        self.guard_builder().build()?;
        Ok(())
    }
}

/// The whole demo; returns what it measured.
pub(crate) async fn run(args: Args) -> Result<Outcome, Box<dyn std::error::Error>> {
    args.check()?;
    let expires_after = (args.lifecycle == LifecycleChoice::Rotate).then_some(args.window);
    // The store first: a bad URL is reported before any time goes into
    // drawing and writing the history.
    let store = open_store(&args, expires_after).await?;

    let started = Instant::now();
    let workload = Arc::new(Workload::generate(
        Shape {
            users: args.users,
            items: args.items,
            history: args.history,
            user_skew: args.user_skew,
            item_skew: args.item_skew,
            candidates: args.candidates,
            negative_ratio: args.negative_ratio,
            seed: args.seed,
        },
        expires_after,
    )?);
    let history_before = workload.truth.len();
    println!(
        "history: {history_before} seen (user, item) pairs of {} users and {} items, drawn in {:.1?}",
        args.users,
        args.items,
        started.elapsed()
    );

    let started = Instant::now();
    let keys: Vec<String> = workload.truth.pairs().into_iter().map(seen_key).collect();
    for chunk in keys.chunks(10_000) {
        store.write(chunk).await?;
    }
    drop(keys);
    println!(
        "store: {}, history written in {:.1?}",
        store.describe(),
        started.elapsed()
    );

    let started = Instant::now();
    let guards = (0..args.instances)
        .map(|i| {
            let name = match args.instances {
                1 => "seen_items".to_owned(),
                _ => format!("seen_items-{i}"),
            };
            args.guard_builder()
                .name(name)
                .source(store.source())
                .build()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let maintenance: Vec<Maintenance> = guards.iter().cloned().map(Maintenance::start).collect();
    for guard in &guards {
        guard.ready_within(Duration::from_secs(300)).await?;
    }
    let guard = &guards[0];
    let stats = guard.stats();
    println!(
        "guard: first build from the store in {:.1?}: {} keys, {:.1} MiB, k sized for {:.2} % (estimated {:.3} %){}",
        started.elapsed(),
        stats.last_rebuild.as_ref().map_or(0, |report| report.keys),
        stats.memory_bytes as f64 / f64::from(1 << 20),
        100.0 * args.fpr,
        100.0 * stats.estimated_fpr,
        match args.instances {
            1 => String::new(),
            n => format!(", in each of {n} instances"),
        }
    );
    let fleet = Fleet::join(&store, &guards).await?;

    let pacing = Pacing {
        duration: args.duration,
        rate: args.rate,
        concurrency: args.concurrency,
        new_seen_per_request: args.new_seen,
        audit_every: args.audit_every,
        bypass_guard_every: args.bypass_guard_every.filter(|&n| n > 0),
        verify: args.verify,
        rebuild_drift: match args.lifecycle {
            LifecycleChoice::Rebuild => Some(args.drift),
            LifecycleChoice::Rotate => None,
        },
        show_progress: !args.quiet,
    };
    let guarded = replay::run(
        &workload,
        &store,
        &guards,
        &fleet.members,
        &pacing,
        args.seed,
    )
    .await?;
    // The live filters only: a rebuild still running at the end would add
    // its shadow filter, which is gone once it swaps.
    let filter_bytes = guard
        .live_filters()
        .iter()
        .map(|filter| filter.memory_bytes())
        .sum();
    fleet.leave().await;
    for task in maintenance {
        task.stop();
    }
    let history_after = workload.truth.len();
    // The keys the store holds after the guarded run (in rotation mode, the
    // unexpired ones), before the baseline's writes add to them.
    let held = workload.truth.held_at(Instant::now());
    let key_bytes: usize = held.iter().map(|&(pair, _)| seen_key(pair).len()).sum();
    let baseline = if args.no_baseline {
        None
    } else {
        Some(replay::run(&workload, &store, &[], &[], &pacing, args.seed).await?)
    };

    let outcome = Outcome {
        guarded,
        baseline,
        verify: args.verify,
        lifecycle: args.lifecycle,
        target_fpr: args.fpr,
        target_rate: args.rate,
        filter_bytes,
        exact_set_bytes: exact_set_bytes(held.len(), key_bytes),
        history_before,
        history_after,
    };
    if let Some(parent) = args.chart.parent() {
        std::fs::create_dir_all(parent)?;
    }
    draw_chart(&args.chart, &outcome.guarded, args.fpr, args.verify)?;
    Ok(outcome)
}

async fn open_store(
    args: &Args,
    expires_after: Option<Duration>,
) -> Result<SeenStore, Box<dyn std::error::Error>> {
    if let Some(url) = &args.database_url {
        #[cfg(feature = "postgres")]
        {
            let postgres = store::PgStore::open(url)
                .await
                .map_err(|error| format!("PostgreSQL at DATABASE_URL: {error}"))?;
            return Ok(SeenStore::new(Backend::Postgres(Arc::new(postgres))));
        }
        #[cfg(not(feature = "postgres"))]
        return Err(format!(
            "PostgreSQL at {url} was asked for, but the `postgres` feature is off \
             (cargo run --release --features redis,postgres --example seen_items)"
        )
        .into());
    }
    if !args.redis_cluster_urls.is_empty() {
        #[cfg(feature = "redis")]
        {
            let cluster = store::RedisStore::open_cluster(&args.redis_cluster_urls, expires_after)
                .await
                .map_err(|error| format!("Redis Cluster at REDIS_CLUSTER_URLS: {error}"))?;
            return Ok(SeenStore::new(Backend::Redis(Arc::new(cluster))));
        }
        #[cfg(not(feature = "redis"))]
        return Err("a Redis Cluster was asked for, but the `redis` feature is off".into());
    }
    if let Some(url) = &args.redis_url {
        #[cfg(feature = "redis")]
        {
            let redis = store::RedisStore::open(url, expires_after)
                .await
                .map_err(|error| format!("Redis at REDIS_URL: {error}"))?;
            return Ok(SeenStore::new(Backend::Redis(Arc::new(redis))));
        }
        #[cfg(not(feature = "redis"))]
        return Err(format!(
            "Redis at {url} was asked for, but the `redis` feature is off \
             (cargo run --release --features redis --example seen_items)"
        )
        .into());
    }
    Ok(SeenStore::new(Backend::Memory(Arc::new(MemoryStore::new(
        expires_after,
    )))))
}

impl Args {
    /// The guard, but for its source (the store).
    fn guard_builder(&self) -> GuardBuilder {
        // Room for the history to grow before the first rebuild; a cold
        // start (`--history 0`) gets a small filter that rebuilds as users
        // see items.
        let expected = ((self.history as f64 * self.headroom) as u64).max(COLD_START_ITEMS);
        let builder = Guard::builder()
            .name("seen_items")
            .expected_items(expected)
            .false_positive_rate(self.fpr)
            .seed(self.seed)
            .maintenance_interval(Duration::from_millis(50));
        match self.lifecycle {
            LifecycleChoice::Rebuild => builder.rebuild_policy(
                RebuildPolicy::default()
                    .when_drift_exceeds(self.drift)
                    .headroom(self.headroom),
            ),
            LifecycleChoice::Rotate => {
                // A key leaves the guard (G-1 to G periods after its insert)
                // no sooner than the store expires it (--window after its
                // write, which follows the insert by far less than the margin).
                let period = (self.window + EXPIRY_MARGIN) / (GENERATIONS as u32 - 1);
                // The first build holds the history; each later generation
                // only what users see in one period.
                let rate = if self.rate == 0 {
                    UNPACED_RATE_GUESS
                } else {
                    self.rate
                };
                let requests_per_period = rate as f64 * period.as_secs_f64();
                let seen_per_period = requests_per_period * self.new_seen.max(1) as f64;
                builder
                    .expected_items((seen_per_period * self.headroom) as u64)
                    .lifecycle(Lifecycle::rotate(GENERATIONS, period))
                    .rebuild_policy(RebuildPolicy::default())
            }
        }
    }
}

/// The instances' fleet memberships (`--instances`), their tasks on a
/// runtime of their own threads.
struct Fleet {
    members: Vec<replay::Fleet>,
    #[cfg(feature = "redis")]
    handles: Vec<bloomguard::redis::FleetHandle>,
    #[cfg(feature = "redis")]
    runtime: Option<FleetRuntime>,
}

/// The fleet's runtime, shut down without waiting for its threads however
/// the job ends: dropped inside the job's own runtime, as on an error path,
/// a plain `Runtime` panics, and the error it carried is never printed.
#[cfg(feature = "redis")]
struct FleetRuntime(Option<tokio::runtime::Runtime>);

#[cfg(feature = "redis")]
impl Drop for FleetRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// How long joined members may take to catch up before the job gives up.
#[cfg(feature = "redis")]
const JOIN_CATCH_UP: Duration = Duration::from_secs(60);

impl Fleet {
    /// Joins the guards as one fleet when there are several (on the Redis
    /// store, which `Args::check` made sure of).
    #[cfg_attr(not(feature = "redis"), allow(clippy::unused_async))]
    async fn join(store: &SeenStore, guards: &[Guard]) -> Result<Self, Box<dyn std::error::Error>> {
        #[cfg(feature = "redis")]
        if let (true, Backend::Redis(redis)) = (guards.len() > 1, store.backend()) {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            let spawner = runtime.handle().clone();
            let runtime = FleetRuntime(Some(runtime));
            let mut members = Vec::new();
            let mut handles = Vec::new();
            for guard in guards {
                let member = redis.fleet_member(guard.clone())?.build();
                let joining = member.clone();
                handles.push(spawner.spawn(async move { joining.join().await }).await??);
                members.push(member);
            }
            let deadline = std::time::Instant::now() + JOIN_CATCH_UP;
            for (instance, member) in members.iter().enumerate() {
                if !replay::caught_up_by(member.guard(), deadline).await {
                    return Err(format!(
                        "instance {instance}'s fleet member did not catch up within \
                         {JOIN_CATCH_UP:?} of joining"
                    )
                    .into());
                }
            }
            println!("fleet: {} instances joined through Redis", members.len());
            return Ok(Self {
                members,
                handles,
                runtime: Some(runtime),
            });
        }
        let _ = (store, guards);
        Ok(Self {
            members: Vec::new(),
            #[cfg(feature = "redis")]
            handles: Vec::new(),
            #[cfg(feature = "redis")]
            runtime: None,
        })
    }

    async fn leave(self) {
        #[cfg(feature = "redis")]
        {
            for handle in self.handles {
                handle.shutdown().await;
            }
            drop(self.runtime);
        }
    }
}

/// The guard's maintenance task, on a runtime of its own thread.
struct Maintenance {
    stop: tokio::sync::oneshot::Sender<()>,
    thread: std::thread::JoinHandle<()>,
}

impl Maintenance {
    fn start(guard: Guard) -> Self {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the maintenance task");
            runtime.block_on(async move {
                let task = guard.spawn_maintenance();
                let _ = stopped.await;
                task.shutdown().await;
            });
        });
        Self { stop, thread }
    }

    fn stop(self) {
        let _ = self.stop.send(());
        self.thread
            .join()
            .expect("the maintenance thread ended cleanly");
    }
}
