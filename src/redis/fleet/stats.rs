//! What a member reports about its standing in the fleet.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;

use super::{FleetSync, StreamPosition};
use crate::sync::unpoisoned;

/// Counts kept beside the member's state; none is touched by a check.
pub(super) struct FleetCounters {
    local_inserts: AtomicU64,
    remote_inserts: AtomicU64,
    fences: AtomicU64,
    recoveries: AtomicU64,
    /// Acknowledgement latencies, in microseconds.
    acks: Mutex<Histogram<u64>>,
}

impl Default for FleetCounters {
    fn default() -> Self {
        Self {
            local_inserts: AtomicU64::new(0),
            remote_inserts: AtomicU64::new(0),
            fences: AtomicU64::new(0),
            recoveries: AtomicU64::new(0),
            acks: Mutex::new(Histogram::new(3).expect("3 significant digits are allowed")),
        }
    }
}

impl FleetCounters {
    pub(super) fn count_local_inserts(&self, count: u64) {
        self.local_inserts.fetch_add(count, Ordering::Relaxed);
    }

    pub(super) fn count_remote_inserts(&self, count: u64) {
        self.remote_inserts.fetch_add(count, Ordering::Relaxed);
    }

    pub(super) fn count_fence(&self) {
        self.fences.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn count_recovery(&self) {
        self.recoveries.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn record_ack(&self, latency: Duration) {
        let micros = u64::try_from(latency.as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        unpoisoned(self.acks.lock()).saturating_record(micros);
    }
}

/// A member's standing in its fleet, from [`FleetSync::stats`].
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct FleetStats {
    /// Whether the guard is fenced now (answering `MaybePresent`).
    pub fenced: bool,
    /// Times the guard was fenced (joining, a lapsed lease, recovering).
    pub fences: u64,
    /// Times the member recovered from a gap in the stream.
    pub recoveries: u64,
    /// Times the live set was replaced with a snapshot: joining, recovering,
    /// or another member's rebuild.
    pub replacements: u64,
    /// The last stream entry applied.
    pub position: StreamPosition,
    /// Entries the last read found after the position (at least that many
    /// behind when it filled a whole read; 0 when caught up).
    pub lag_entries: u64,
    /// How far the position is behind the newest entry the member knows
    /// of (from its last read or renewal, a quarter lease apart at most
    /// while it reads), on Redis's clock.
    pub lag: Duration,
    /// Time since the lease was last renewed; `None` without a lease.
    pub lease_age: Option<Duration>,
    /// Members holding a live lease, as of the last renewal.
    pub members: u64,
    /// Inserts this member made through the fleet.
    pub local_inserts: u64,
    /// Inserts applied from other members.
    pub remote_inserts: u64,
    /// Inserts acknowledged by the fleet (including second appends of slow writes).
    pub acknowledgements: u64,
    /// Median time from append to acknowledgement.
    pub ack_latency_p50: Option<Duration>,
    /// 99th percentile of the same.
    pub ack_latency_p99: Option<Duration>,
    /// Slowest acknowledgement.
    pub ack_latency_max: Option<Duration>,
}

impl FleetSync {
    /// This member's standing in the fleet now.
    pub fn stats(&self) -> FleetStats {
        let counters = &self.inner.counters;
        let (position, lag_entries, lag, lease_age, members, fenced, replacements) = {
            let state = self.state();
            (
                state.position,
                state.lag_entries,
                Duration::from_millis(state.position.millis_behind(state.stream_end)),
                state.fence_at.and(state.renewed_at).map(|at| at.elapsed()),
                state.members,
                state.fenced,
                state.replacements,
            )
        };
        let acks = unpoisoned(counters.acks.lock());
        let quantile =
            |q: f64| (!acks.is_empty()).then(|| Duration::from_micros(acks.value_at_quantile(q)));
        FleetStats {
            fenced,
            fences: counters.fences.load(Ordering::Relaxed),
            recoveries: counters.recoveries.load(Ordering::Relaxed),
            replacements,
            position,
            lag_entries,
            lag,
            lease_age,
            members,
            local_inserts: counters.local_inserts.load(Ordering::Relaxed),
            remote_inserts: counters.remote_inserts.load(Ordering::Relaxed),
            acknowledgements: acks.len(),
            ack_latency_p50: quantile(0.5),
            ack_latency_p99: quantile(0.99),
            ack_latency_max: (!acks.is_empty()).then(|| Duration::from_micros(acks.max())),
        }
    }
}
