//! How much of the guard's "maybe" a consumer trusts: [`Verify`], and shadow
//! mode for rolling a guard out.
//!
//! A `MaybePresent` verdict is usually checked with the backend (a false
//! positive costs one lookup). A presence question — "has this user seen
//! this item?" — can instead trust it: the answer is "present", at most the
//! false-positive rate of the absent keys are wrongly hidden (over-filtered),
//! and the backend is not called at all. [`Verify::Sample`] still sends a
//! fixed, hash-chosen fraction of the positives on to the backend, so the
//! guard keeps measuring its false-positive rate and drift, and estimates how
//! many of the trusted positives were false ([`GuardStats::over_filtered`]).
//! Over-filtering never makes a false negative: it only hides absent keys,
//! never present ones.
//!
//! Shadow mode, on [`GuardedLoader`](crate::GuardedLoader) and
//! [`GuardLayer`](crate::GuardLayer), is the opposite end: every request goes
//! to the backend, and an `Absent` verdict the backend contradicts is counted
//! as a would-be false negative ([`GuardStats::would_be_false_negatives`])
//! with a warning in the log. The checks the guard would have saved are
//! [`GuardStats::shadowed_absent`].
//!
//! [`GuardStats::over_filtered`]: crate::GuardStats::over_filtered
//! [`GuardStats::would_be_false_negatives`]: crate::GuardStats::would_be_false_negatives
//! [`GuardStats::shadowed_absent`]: crate::GuardStats::shadowed_absent

use std::fmt;
use std::str::FromStr;

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::error::ConfigError;

/// Which `MaybePresent` answers of a presence question go on to the backend.
///
/// Values (the stored item) always come from the backend, so this applies
/// where the answer is presence only:
/// [`GuardedLoader::contains`](crate::GuardedLoader::contains) and
/// [`contains_many`](crate::GuardedLoader::contains_many), and an HTTP layer
/// given a response for "present"
/// ([`GuardLayer::verify`](crate::GuardLayer::verify)).
///
/// Parses from `all`, `none` and `sample:F` (`sample:0.01`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Verify {
    /// Every "maybe" is checked with the backend (the default).
    #[default]
    All,
    /// A "maybe" is trusted as present, except a fraction (in `(0, 1]`)
    /// chosen by a hash of the key, which is checked so that the observed
    /// false-positive rate stays measured. The same key is always in or
    /// always out of the sample.
    Sample(f64),
    /// Every "maybe" is trusted as present; the backend is never called.
    /// The observed false-positive rate is then unknown and over-filtering
    /// is estimated from the filters' fill.
    None,
}

/// The sampling hash's own seed, so that which keys are sampled is unrelated
/// to the filter's bits (and so to which keys are false positives).
const SAMPLE_SEED: u64 = 0x5a3e_1b0c_7f29_d846;

impl Verify {
    /// Refuses a sample fraction outside `(0, 1]` (NaN included).
    pub(crate) fn checked(self) -> Result<Self, ConfigError> {
        match self {
            Self::Sample(fraction) if !(fraction > 0.0 && fraction <= 1.0) => Err(
                ConfigError::out_of_range("Verify::Sample", fraction, "a fraction in (0, 1]"),
            ),
            verify => Ok(verify),
        }
    }

    /// Whether a `MaybePresent` answer for `key` goes on to the backend.
    #[inline]
    pub(crate) fn verifies(self, key: &[u8]) -> bool {
        match self {
            Self::All => true,
            Self::None => false,
            // Compared in the 53 bits an f64 holds exactly: sampled keys are
            // those whose hash falls below fraction × 2^53.
            Self::Sample(fraction) => {
                let position = xxh3_64_with_seed(key, SAMPLE_SEED) >> 11;
                (position as f64) < fraction * (1u64 << 53) as f64
            }
        }
    }
}

impl fmt::Display for Verify {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::All => f.write_str("all"),
            Self::Sample(fraction) => write!(f, "sample:{fraction}"),
            Self::None => f.write_str("none"),
        }
    }
}

impl FromStr for Verify {
    type Err = ConfigError;

    fn from_str(text: &str) -> Result<Self, ConfigError> {
        let refused = || ConfigError::out_of_range("verify", text, "all, none or sample:F");
        match text {
            "all" => Ok(Self::All),
            "none" => Ok(Self::None),
            _ => {
                let fraction = text
                    .strip_prefix("sample:")
                    .ok_or_else(refused)?
                    .parse::<f64>()
                    .map_err(|_| refused())?;
                Self::Sample(fraction).checked()
            }
        }
    }
}

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses() {
        assert_eq!("all".parse::<Verify>(), Ok(Verify::All));
        assert_eq!("none".parse::<Verify>(), Ok(Verify::None));
        assert_eq!("sample:0.01".parse::<Verify>(), Ok(Verify::Sample(0.01)));
        for bad in [
            "",
            "some",
            "sample:",
            "sample:0",
            "sample:1.5",
            "sample:NaN",
        ] {
            assert!(bad.parse::<Verify>().is_err(), "{bad:?} was accepted");
        }
        assert_eq!(
            Verify::Sample(0.25).to_string().parse(),
            Ok(Verify::Sample(0.25))
        );
    }

    #[test]
    fn samples_about_the_fraction_asked() {
        for fraction in [0.01, 0.1, 0.5] {
            let sampled = (0..100_000u32)
                .filter(|i| Verify::Sample(fraction).verifies(format!("key:{i}").as_bytes()))
                .count();
            let share = sampled as f64 / 100_000.0;
            assert!(
                (share - fraction).abs() < 0.1 * fraction + 0.002,
                "asked {fraction}, sampled {share}"
            );
        }
        assert!(Verify::Sample(1.0).verifies(b"any"));
    }
}
