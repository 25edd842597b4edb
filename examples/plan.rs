//! The sizing calculator: bytes, k and bits per key for a number of items and a
//! target false-positive rate, from bloomguard's own sizing model.
//!
//! ```text
//! cargo run --example plan -- --items 10M --fpr 0.001
//! ```

use bloomguard::{ConfigError, Plan, plan};
use clap::Parser;

/// Size a bloomguard filter.
#[derive(Debug, Parser)]
#[command(about = "Size a bloomguard filter: bytes, k and bits/key for items and a target FPR")]
struct Args {
    /// Distinct items the filter must hold (suffixes k, M, G allowed: 10M).
    #[arg(long, default_value = "10M", value_parser = parse_count)]
    items: u64,
    /// Target false-positive rate, in (0, 1).
    #[arg(long, default_value_t = 0.01)]
    fpr: f64,
}

fn parse_count(text: &str) -> Result<u64, String> {
    let (digits, scale) = match text.trim().char_indices().last() {
        Some((i, 'k' | 'K')) => (&text[..i], 1e3),
        Some((i, 'm' | 'M')) => (&text[..i], 1e6),
        Some((i, 'g' | 'G' | 'b' | 'B')) => (&text[..i], 1e9),
        _ => (text, 1.0),
    };
    let value: f64 = digits
        .trim()
        .replace('_', "")
        .parse()
        .map_err(|_| format!("`{text}` is not a count such as 5000, 2.5M or 1G"))?;
    if !(value.is_finite() && value >= 0.0) {
        return Err(format!("`{text}` is not a count"));
    }
    Ok((value * scale).round() as u64)
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

fn row(plan: &Plan) -> String {
    format!(
        "| {:>12} | {:>8} | {:>11} | {:>2} | {:>8.2} | {:>8.2} | {:>10.3e} |",
        plan.expected_items,
        plan.false_positive_rate,
        human_bytes(plan.bytes),
        plan.k,
        plan.bits_per_key,
        plan.textbook_bits_per_key(),
        plan.predicted_fpr,
    )
}

fn main() -> Result<(), ConfigError> {
    let args = Args::parse();
    let chosen = plan(args.items, args.fpr)?;
    println!(
        "{} items at {} FPR: {} bytes ({}), k = {}, {:.2} bits/key (textbook unblocked: {:.2}), predicted FPR {:.4e}\n",
        chosen.expected_items,
        chosen.false_positive_rate,
        chosen.bytes,
        human_bytes(chosen.bytes),
        chosen.k,
        chosen.bits_per_key,
        chosen.textbook_bits_per_key(),
        chosen.predicted_fpr,
    );
    println!("|        items |      FPR |       bytes |  k | bits/key | textbook | predicted  |");
    println!("|-------------:|---------:|------------:|---:|---------:|---------:|-----------:|");
    for fpr in [0.1, 0.05, 0.01, 0.005, 0.001, 1e-4, 1e-5, 1e-6] {
        println!("{}", row(&plan(args.items, fpr)?));
    }
    Ok(())
}
