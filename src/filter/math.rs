//! Sizing a cache-line-blocked filter, and reading its state back from the fill.
//!
//! In a blocked filter every key lands in one 512-bit block, so the load is
//! uneven: the number of keys in a block is Poisson-distributed with mean
//! λ = n / blocks. With `j` keys in a block, each setting `k` bits with
//! replacement, the block's fill is `1 − (1 − 1/512)^(j·k)` and a query that
//! lands there is a false positive with probability `fill^k`. The filter's FPR
//! is the expectation of that over `j`. Crowded blocks cost more than empty
//! blocks save, which is why a blocked filter needs more bits per key than the
//! textbook `−ln p / (ln 2)²` (about 0.3 more at 1 %) and a smaller `k`.

use crate::error::ConfigError;

/// Bits in one block: one 64-byte cache line.
pub const BLOCK_BITS: u64 = 512;
/// The most hash probes a filter may use.
pub const MAX_HASHES: u32 = 32;
/// The largest `k` [`plan`] considers; more never pays off for a 512-bit block.
const MAX_PLANNED_HASHES: u32 = 24;
/// The most keys per block [`plan`] considers: far past any useful load.
const MAX_KEYS_PER_BLOCK: f64 = 16_384.0;
/// The lowest false-positive rate a filter may be sized for. Below it the
/// sizing model (an alternating sum over a block's bits) loses its digits to
/// cancellation, so a plan could no longer show that it meets the target.
pub const MIN_FALSE_POSITIVE_RATE: f64 = 1e-8;

/// What a filter sized for `expected_items` at `false_positive_rate` looks like.
///
/// Returned by [`plan`], which allocates nothing: use it to see the cost of a
/// target before building, or to print a sizing table.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Plan {
    /// Items the filter is sized for.
    pub expected_items: u64,
    /// The target false-positive rate.
    pub false_positive_rate: f64,
    /// Bits of storage (a multiple of 512).
    pub bits: u64,
    /// Bytes of storage (`bits / 8`).
    pub bytes: u64,
    /// Hash probes per key.
    pub k: u32,
    /// `bits / expected_items`.
    pub bits_per_key: f64,
    /// The model's false-positive rate at `expected_items`; at most the
    /// target, except past 2^64 bits (see [`plan`]).
    pub predicted_fpr: f64,
}

impl Plan {
    /// The textbook optimum for an unblocked filter, `−ln p / (ln 2)²` bits per key,
    /// for comparison with [`Plan::bits_per_key`].
    pub fn textbook_bits_per_key(&self) -> f64 {
        -self.false_positive_rate.ln() / std::f64::consts::LN_2.powi(2)
    }
}

/// The smallest blocked filter (then the fewest probes) whose modelled
/// false-positive rate at `expected_items` is at most `false_positive_rate`.
/// Where that filter would pass 2^64 bits (some 10^18 items at 1 %), the
/// largest filter of whole blocks, whose predicted rate misses the target:
/// no memory budget admits it, and building it fails with `TooLarge`.
///
/// ```
/// let plan = bloomguard::plan(1_000_000, 0.01)?;
/// assert_eq!(plan.k, 6);
/// assert!(plan.bits_per_key < 10.0 && plan.predicted_fpr <= 0.01);
/// # Ok::<(), bloomguard::ConfigError>(())
/// ```
///
/// # Errors
/// [`ConfigError::OutOfRange`] if `expected_items` is zero or
/// `false_positive_rate` is not a number in
/// [[`MIN_FALSE_POSITIVE_RATE`], 1).
pub fn plan(expected_items: u64, false_positive_rate: f64) -> Result<Plan, ConfigError> {
    check_items(expected_items)?;
    check_false_positive_rate(false_positive_rate)?;
    let n = expected_items as f64;
    let (mut blocks, k) = (1..=MAX_PLANNED_HASHES)
        .map(|k| {
            let lambda = max_keys_per_block(k, false_positive_rate);
            ((n / lambda).ceil().max(1.0) as u64, k)
        })
        .min()
        .expect("at least one k is tried");
    // The model's last digits are noise: where rounding put the load a hair
    // over the target, a few more blocks (0.025 % each step) bring it under.
    while blocked_fpr(n / blocks as f64, k) > false_positive_rate {
        blocks = blocks.saturating_add(blocks / 4096 + 1);
    }
    // Past 2^64 bits, the largest filter of whole blocks: no budget admits
    // it, and the builder says so.
    blocks = blocks.min(u64::MAX / BLOCK_BITS);
    let bits = blocks * BLOCK_BITS;
    Ok(Plan {
        expected_items,
        false_positive_rate,
        bits,
        bytes: bits / 8,
        k,
        bits_per_key: bits as f64 / n,
        predicted_fpr: blocked_fpr(n / blocks as f64, k),
    })
}

pub(crate) fn check_items(expected_items: u64) -> Result<(), ConfigError> {
    if expected_items == 0 {
        return Err(ConfigError::out_of_range(
            "expected_items",
            0,
            "an integer of at least 1",
        ));
    }
    Ok(())
}

/// A target false-positive rate a filter can be sized for and shown to meet.
pub(crate) fn check_false_positive_rate(rate: f64) -> Result<(), ConfigError> {
    if !(MIN_FALSE_POSITIVE_RATE..1.0).contains(&rate) {
        return Err(ConfigError::out_of_range(
            "false_positive_rate",
            rate,
            "a number in [1e-8, 1): below 1e-8 the sizing model cannot vouch for the rate",
        ));
    }
    Ok(())
}

/// The false-positive rate of a blocked filter holding `keys_per_block` keys
/// per block on average, `k` probes each.
///
/// Exact for Poisson-distributed block loads and independent uniform probes:
/// a query probes `d ≤ k` distinct bits (probes may coincide), and with `j`
/// keys in its block those `d` bits are all set with probability
/// `Σᵢ (−1)ⁱ C(d,i) (1 − i/512)^(j·k)`; averaged over the Poisson `j` that is
/// `Σᵢ (−1)ⁱ C(d,i) exp(λ((1 − i/512)^k − 1))`. The simpler `E[fill^k]`
/// ignores coinciding probes and comes out 1–2 % low, which a measurement
/// over millions of probes shows.
pub(crate) fn blocked_fpr(keys_per_block: f64, k: u32) -> f64 {
    if keys_per_block <= 0.0 {
        return 0.0;
    }
    if !keys_per_block.is_finite() {
        return 1.0;
    }
    let k_usize = k as usize;
    // none_hit[i]: the chance, over the Poisson load, that no key of the block hits i given bits.
    let mut none_hit = [0.0f64; MAX_HASHES as usize + 1];
    for (i, slot) in none_hit.iter_mut().enumerate().take(k_usize + 1) {
        let miss_one_key = (1.0 - i as f64 / BLOCK_BITS as f64).powi(k as i32);
        *slot = (keys_per_block * (miss_one_key - 1.0)).exp();
    }
    let distinct = distinct_probe_distribution(k);
    let mut fpr = 0.0;
    for (d, &p_d) in distinct.iter().enumerate().take(k_usize + 1) {
        if p_d == 0.0 {
            continue;
        }
        // Inclusion–exclusion over which of the d query bits stay clear.
        let mut all_set = 0.0;
        let mut binomial = 1.0;
        for (i, &none) in none_hit.iter().enumerate().take(d + 1) {
            let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
            all_set += sign * binomial * none;
            binomial = binomial * (d - i) as f64 / (i + 1) as f64;
        }
        fpr += p_d * all_set;
    }
    fpr.clamp(0.0, 1.0)
}

/// `P[d]`: the chance that `k` uniform probes into a block hit exactly `d` distinct bits.
fn distinct_probe_distribution(k: u32) -> [f64; MAX_HASHES as usize + 1] {
    let bits = BLOCK_BITS as f64;
    let mut distribution = [0.0f64; MAX_HASHES as usize + 1];
    distribution[0] = 1.0;
    for throws in 0..k as usize {
        for d in (0..=throws).rev() {
            let p = distribution[d];
            distribution[d] = p * d as f64 / bits;
            distribution[d + 1] += p * (bits - d as f64) / bits;
        }
    }
    distribution
}

/// The largest mean load per block at which `k` probes still meet `target`.
fn max_keys_per_block(k: u32, target: f64) -> f64 {
    let (mut low, mut high) = (0.0, MAX_KEYS_PER_BLOCK);
    if blocked_fpr(high, k) <= target {
        return high;
    }
    for _ in 0..64 {
        let mid = 0.5 * (low + high);
        if blocked_fpr(mid, k) <= target {
            low = mid;
        } else {
            high = mid;
        }
    }
    low
}

/// The expected share of bits set with `keys_per_block` keys per block on
/// average: `1 − exp(λ·((1 − 1/512)^k − 1))` over Poisson block loads.
#[cfg(feature = "guard")]
pub(crate) fn expected_fill(keys_per_block: f64, k: u32) -> f64 {
    let untouched_by_one_key = (1.0 - 1.0 / BLOCK_BITS as f64).powi(k as i32);
    1.0 - (keys_per_block * (untouched_by_one_key - 1.0)).exp()
}

/// The mean number of keys per block that leaves `set_bits` of `bits` set,
/// the inverse of [`expected_fill`].
///
/// Finite and monotone up to a full filter: a filter with every bit set
/// reads as the load that leaves half a bit clear in expectation, the most
/// its fill can tell.
pub(crate) fn keys_per_block_from_fill(set_bits: u64, bits: u64, k: u32) -> f64 {
    if set_bits == 0 || bits == 0 {
        return 0.0;
    }
    let clear = (bits - set_bits.min(bits)) as f64;
    let clear_share = clear.max(0.5) / bits as f64;
    let untouched_by_one_key = (1.0 - 1.0 / BLOCK_BITS as f64).powi(k as i32);
    clear_share.ln() / (untouched_by_one_key - 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plan past 2^64 bits is of whole blocks still: it saturated to
    /// `u64::MAX` bits, which no filter of whole blocks has, and predicted
    /// the FPR of more blocks than that.
    #[test]
    fn a_plan_past_two_to_the_sixty_four_bits_is_of_whole_blocks() {
        let largest = plan(u64::MAX, 0.01).unwrap();
        assert_eq!(largest.bits % BLOCK_BITS, 0);
        let blocks = largest.bits / BLOCK_BITS;
        let predicted = blocked_fpr(u64::MAX as f64 / blocks as f64, largest.k);
        assert_eq!(largest.predicted_fpr, predicted);
    }

    #[test]
    fn one_percent_lands_near_ten_bits_per_key_with_six_probes() {
        let plan = plan(1_000_000, 0.01).unwrap();
        assert_eq!(plan.k, 6);
        assert!((9.7..10.1).contains(&plan.bits_per_key), "{plan:?}");
        assert!(plan.predicted_fpr <= 0.01);
        assert_eq!(plan.bits % BLOCK_BITS, 0);
    }

    #[test]
    fn blocking_costs_little_over_the_textbook() {
        for p in [0.1, 0.01, 0.001, 0.0001] {
            let plan = plan(10_000_000, p).unwrap();
            let ratio = plan.bits_per_key / plan.textbook_bits_per_key();
            assert!((1.0..1.2).contains(&ratio), "p = {p}: ratio {ratio}");
        }
    }

    #[test]
    fn model_is_monotone_in_load() {
        let mut last = 0.0;
        for i in 1..200 {
            let fpr = blocked_fpr(f64::from(i), 6);
            assert!(fpr >= last);
            last = fpr;
        }
        assert!(blocked_fpr(1e9, 6) > 0.99);
    }

    #[test]
    fn fill_inversion_round_trips() {
        for lambda in [1.0, 20.0, 51.2, 300.0] {
            let k = 6;
            let fill = 1.0
                - ((1.0 - 1.0 / 512.0_f64).powi(k) - 1.0)
                    .mul_add(lambda, 0.0)
                    .exp();
            let bits = 1u64 << 40;
            let back = keys_per_block_from_fill((fill * bits as f64) as u64, bits, k as u32);
            assert!((back - lambda).abs() < 1e-5 * lambda, "{lambda} -> {back}");
        }
    }

    #[test]
    fn rejects_bad_parameters() {
        assert!(plan(0, 0.01).is_err());
        for p in [
            0.0,
            1.0,
            -0.5,
            2.0,
            f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ] {
            let err = plan(100, p).unwrap_err();
            assert!(err.to_string().contains("false_positive_rate"), "{err}");
        }
        for p in [MIN_FALSE_POSITIVE_RATE / 2.0, 1e-15, 5e-324] {
            let err = plan(100, p).unwrap_err();
            assert!(err.to_string().contains("false_positive_rate"), "{err}");
        }
    }
}
