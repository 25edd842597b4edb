//! The side-by-side report and the picture of the guard over time.

use std::path::Path;
use std::time::Duration;

use plotters::prelude::*;

use bloomguard::Verify;

use super::LifecycleChoice;
use super::replay::{Event, Phase, Sample};

/// What a run measured.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub(crate) guarded: Phase,
    pub(crate) baseline: Option<Phase>,
    pub(crate) verify: Verify,
    pub(crate) lifecycle: LifecycleChoice,
    pub(crate) target_fpr: f64,
    pub(crate) target_rate: u64,
    pub(crate) filter_bytes: usize,
    /// An exact `HashSet<String>` of the same keys (the same count).
    pub(crate) exact_set_bytes: usize,
    pub(crate) history_before: usize,
    pub(crate) history_after: usize,
}

impl Outcome {
    /// Share of the checks that did not reach the store.
    pub(crate) fn avoided(&self) -> f64 {
        1.0 - self.guarded.store_keys as f64 / self.guarded.checks.max(1) as f64
    }

    pub(crate) fn memory_ratio(&self) -> f64 {
        self.filter_bytes as f64 / self.exact_set_bytes as f64
    }

    pub(crate) fn print(&self) {
        let phases: Vec<&Phase> = self.baseline.iter().chain([&self.guarded]).collect();
        let row = |label: &str, cell: &dyn Fn(&Phase) -> String| {
            let cells: String = phases
                .iter()
                .map(|phase| format!("{:>16}", cell(phase)))
                .collect();
            println!("{label:<36}{cells}");
        };
        let heading: String = phases
            .iter()
            .map(|phase| {
                format!(
                    "{:>16}",
                    if phase.guarded {
                        "with guard"
                    } else {
                        "no guard"
                    }
                )
            })
            .collect();
        println!("\n{:<36}{heading}", "");
        row("requests", &|p| p.requests.to_string());
        let rate = match self.target_rate {
            0 => "requests/s (unpaced)".to_string(),
            rate => format!("requests/s (target {rate})"),
        };
        row(&rate, &|p| {
            format!("{:.0}", p.requests as f64 / p.elapsed.as_secs_f64())
        });
        row("checks/s", &|p| {
            format!("{:.2} M", p.checks as f64 / p.elapsed.as_secs_f64() / 1e6)
        });
        row("store lookups per request", &|p| {
            format!("{:.2}", per_request(p, p.store_keys))
        });
        row("store round trips per request", &|p| {
            format!("{:.3}", per_request(p, p.store_calls))
        });
        row("store lookups avoided", &|p| {
            format!(
                "{:.1} %",
                100.0 * (1.0 - p.store_keys as f64 / p.checks.max(1) as f64)
            )
        });
        let guarded_only = |p: &Phase, value: Option<f64>| match value {
            Some(rate) if p.guarded => format!("{:.3} %", 100.0 * rate),
            _ => "-".into(),
        };
        // Under `--verify none` no "maybe" was looked up: the rate is the
        // filters' estimate, and says so.
        let fpr_label = match self.verify {
            Verify::None => "estimated FPR, nothing verified",
            _ => "observed FPR",
        };
        row(
            &format!("{fpr_label} (target {:.2} %)", 100.0 * self.target_fpr),
            &|p| guarded_only(p, p.guard_fpr),
        );
        row("unseen items hidden, audited", &|p| {
            guarded_only(p, p.hidden_rate())
        });
        row("unseen items hidden, guard's estimate", &|p| {
            guarded_only(p, p.estimated_over_filtering)
        });
        row("negatives among the checks", &|p| {
            format!(
                "{:.1} %",
                100.0 * (1.0 - p.found as f64 / p.checks.max(1) as f64)
            )
        });
        row("latency per request p50", &|p| {
            format_latency(p.latency_quantile(0.5))
        });
        row("latency per request p99", &|p| {
            format_latency(p.latency_quantile(0.99))
        });
        row("latency per request p99.9", &|p| {
            format_latency(p.latency_quantile(0.999))
        });
        if let Some(fleet) = &self.guarded.fleet {
            // Under the guarded column, with or without a baseline beside it.
            let blank = if self.baseline.is_some() { "-" } else { "" };
            let cell = |value: String| {
                let pad = if blank.is_empty() { 0 } else { 16 };
                format!("{blank:>pad$}{value:>16}")
            };
            println!(
                "{:<36}{}",
                format!("fleet write acknowledged p50 ({})", fleet.instances),
                cell(format_latency(fleet.ack_quantile(0.5)))
            );
            println!(
                "{:<36}{}",
                "fleet write acknowledged p99",
                cell(format_latency(fleet.ack_quantile(0.99)))
            );
            println!(
                "{:<36}{}",
                "fleet: largest lag of a member",
                cell(format_latency(fleet.largest_lag))
            );
        }
        println!(
            "{:<36}{:>16}{:>16}",
            "memory: exact HashSet vs filter",
            mib(self.exact_set_bytes),
            mib(self.filter_bytes)
        );
        println!();
        for line in self.conclusions() {
            println!("{line}");
        }
    }

    /// The sentences under the table: what the guard saved, what the
    /// verification mode cost, how the guard aged, and (rotation) why the
    /// observed FPR sits above the target.
    pub(crate) fn conclusions(&self) -> Vec<String> {
        let guarded = &self.guarded;
        let mut lines = vec![
            format!(
                "the guard kept {:.1} % of the lookups from the store; the filter takes 1/{:.0} of the exact set's memory; no false negatives: {} answers for items the store held, audited against the ground truth, and {} seen items checked in the guards at the end (one at a time and in batches)",
                100.0 * self.avoided(),
                1.0 / self.memory_ratio(),
                guarded.audited_seen,
                guarded.swept,
            ),
            describe_verify(self.verify, self.target_fpr),
        ];
        let growth = if self.history_before == 0 {
            format!("grew from a cold start to {} pairs", self.history_after)
        } else {
            format!(
                "grew {:.1} % ({} → {} pairs seen, expired ones included)",
                100.0 * (self.history_after as f64 / self.history_before as f64 - 1.0),
                self.history_before,
                self.history_after
            )
        };
        let rebuilds = guarded.events.iter().filter(|e| e.rebuild).count();
        let rotations = guarded.events.len() - rebuilds;
        let peak = guarded
            .timeline
            .iter()
            .map(|s| s.estimated_drift)
            .fold(0.0, f64::max);
        let last = guarded.timeline.last().map_or(0.0, |s| s.estimated_drift);
        lines.push(format!(
            "lifecycle: users saw {} new items in the guarded replay, the history {growth}; estimated drift peaked at {peak:.2} and ended at {last:.2}; {rebuilds} rebuild(s){}{}",
            guarded.written,
            if rotations > 0 {
                format!(", {rotations} rotation(s)")
            } else {
                String::new()
            },
            describe_events(&guarded.events),
        ));
        if self.lifecycle == LifecycleChoice::Rotate {
            let estimated = guarded.timeline.last().map_or(0.0, |s| s.estimated_fpr);
            let observed = guarded
                .guard_fpr
                .map_or("-".into(), |rate| format!("{:.3} %", 100.0 * rate));
            lines.push(format!(
                "why the observed FPR ({observed}) is above the filters' estimate ({:.3} %): the store forgets a seen item after --window, but the guard keeps it until its generation retires (up to one rotation period plus a safety margin longer, so that it never forgets a key the store still holds). A candidate in that gap answers \"maybe\", the store no longer has it, and it counts as a false positive although the fill is on target; each rotation drops the oldest generation, and with it most of the gap.",
                100.0 * estimated
            ));
        }
        lines
    }
}

/// What `--verify` did to the answers, in a sentence.
fn describe_verify(verify: Verify, target_fpr: f64) -> String {
    let target = format!("{:.2} %", 100.0 * target_fpr);
    match verify {
        Verify::All => format!(
            "verify all: every \"maybe\" was checked in the store, so the guard hides no unseen item (the audited row above counts what the run saw); a false positive cost a lookup (the observed FPR above; {target} targeted)."
        ),
        Verify::Sample(fraction) => format!(
            "verify sample:{fraction}: a \"maybe\" was trusted as seen without a lookup, except a hash-chosen {:.2} % checked to keep the false-positive rate measured; the price is hiding about the FPR ({target} targeted) of the unseen items, shown above as audited and as the guard estimates it.",
            100.0 * fraction
        ),
        Verify::None => format!(
            "verify none: every \"maybe\" was trusted as seen, and the store was never asked; about the FPR ({target} targeted) of the unseen items were hidden, and the guard estimates it from the filters' fill."
        ),
    }
}

fn per_request(phase: &Phase, count: u64) -> f64 {
    count as f64 / phase.requests.max(1) as f64
}

fn format_latency(latency: Duration) -> String {
    if latency < Duration::from_millis(1) {
        format!("{:.1} µs", latency.as_secs_f64() * 1e6)
    } else {
        format!("{:.2} ms", latency.as_secs_f64() * 1e3)
    }
}

fn mib(bytes: usize) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

fn describe_events(events: &[Event]) -> String {
    if events.is_empty() {
        return String::new();
    }
    let times: Vec<String> = events.iter().map(|e| format!("{:.1} s", e.at)).collect();
    format!(" (at {})", times.join(", "))
}

/// Memory of a `HashSet<String>` holding `keys` (hashbrown: one control byte
/// and one `String` per bucket, buckets a power of two at ≤ 7/8 load, plus
/// each key's heap bytes).
pub(crate) fn exact_set_bytes(count: usize, key_bytes: usize) -> usize {
    let buckets = (count * 8 / 7 + 1).next_power_of_two();
    buckets * (std::mem::size_of::<String>() + 1) + key_bytes
}

/// Fill, pass-through and the false-positive rates over the guarded phase,
/// with rebuilds (red) and rotations (orange) marked.
pub(crate) fn draw_chart(
    path: &Path,
    phase: &Phase,
    target_fpr: f64,
    verify: Verify,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (1000, 720)).into_drawing_area();
    root.fill(&WHITE)?;
    let (upper, lower) = root.split_vertically(360);
    let samples = &phase.timeline;

    let highest_ratio = samples
        .iter()
        .map(|s| s.fill_ratio.max(s.pass_through.unwrap_or(0.0)))
        .fold(0.1, f64::max);
    let mut chart = Panel {
        caption: &format!("bloomguard seen-items gate (verify {verify}): fill and pass-through"),
        y_desc: "ratio",
        end: phase.elapsed.as_secs_f64(),
        top: (highest_ratio * 1.25).min(1.0),
    }
    .draw_on(&upper)?;
    draw_line(
        &mut chart,
        samples,
        |s| Some(s.fill_ratio),
        BLUE,
        "fill ratio",
    )?;
    draw_line(
        &mut chart,
        samples,
        |s| s.pass_through,
        GREEN,
        "let through by the guard",
    )?;
    finish(&mut chart, &phase.events)?;

    let highest_fpr = samples
        .iter()
        .flat_map(|s| {
            [
                s.estimated_fpr,
                s.observed_fpr.unwrap_or(0.0),
                s.over_filtering.unwrap_or(0.0),
            ]
        })
        .fold(target_fpr, f64::max);
    let mut chart = Panel {
        caption: &format!(
            "false-positive rate: estimated from fill, observed from the store (verify {verify})"
        ),
        y_desc: "%",
        end: phase.elapsed.as_secs_f64(),
        top: highest_fpr * 100.0 * 1.25,
    }
    .draw_on(&lower)?;
    draw_line(
        &mut chart,
        samples,
        |s| Some(100.0 * s.estimated_fpr),
        BLUE,
        "estimated FPR",
    )?;
    draw_line(
        &mut chart,
        samples,
        |s| s.observed_fpr.map(|f| 100.0 * f),
        MAGENTA,
        "observed FPR",
    )?;
    if verify != Verify::All {
        draw_line(
            &mut chart,
            samples,
            |s| s.over_filtering.map(|f| 100.0 * f),
            CYAN,
            "unseen items hidden (estimated)",
        )?;
    }
    let end = phase.elapsed.as_secs_f64();
    chart
        .draw_series(LineSeries::new(
            [(0.0, 100.0 * target_fpr), (end, 100.0 * target_fpr)],
            BLACK,
        ))?
        .label("target")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 16, y)], BLACK));
    finish(&mut chart, &phase.events)?;
    root.present()?;
    Ok(())
}

type Chart<'a, 'b> = ChartContext<
    'a,
    SVGBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

/// One of the picture's two panels: seconds across, `y_desc` up to `top`.
struct Panel<'c> {
    caption: &'c str,
    y_desc: &'static str,
    end: f64,
    top: f64,
}

impl Panel<'_> {
    fn draw_on<'a, 'b>(
        &self,
        area: &'a DrawingArea<SVGBackend<'b>, plotters::coord::Shift>,
    ) -> Result<Chart<'a, 'b>, Box<dyn std::error::Error>> {
        let mut chart = ChartBuilder::on(area)
            .caption(self.caption, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(32)
            .y_label_area_size(48)
            .build_cartesian_2d(0.0..self.end, 0.0..self.top)?;
        chart
            .configure_mesh()
            .x_desc("seconds")
            .y_desc(self.y_desc)
            .draw()?;
        Ok(chart)
    }
}

/// Marks the rebuilds and rotations across the panel, and draws its legend.
fn finish<'a, 'b: 'a>(
    chart: &mut Chart<'a, 'b>,
    events: &[Event],
) -> Result<(), Box<dyn std::error::Error>> {
    let top = chart.y_range().end;
    for rebuild in [true, false] {
        let color = if rebuild { RED } else { RGBColor(255, 140, 0) };
        let lines: Vec<_> = events
            .iter()
            .filter(|event| event.rebuild == rebuild)
            .map(|event| PathElement::new([(event.at, 0.0), (event.at, top)], color))
            .collect();
        if lines.is_empty() {
            continue;
        }
        chart
            .draw_series(lines)?
            .label(if rebuild { "rebuild" } else { "rotation" })
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()?;
    Ok(())
}

fn draw_line(
    chart: &mut Chart<'_, '_>,
    samples: &[Sample],
    value: impl Fn(&Sample) -> Option<f64>,
    color: RGBColor,
    label: &str,
) -> Result<(), Box<dyn std::error::Error>> {
    let points = samples.iter().filter_map(|s| value(s).map(|v| (s.at, v)));
    chart
        .draw_series(LineSeries::new(points, color.stroke_width(2)))?
        .label(label)
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
    Ok(())
}
