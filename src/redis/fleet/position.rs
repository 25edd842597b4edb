//! Positions in a fleet's insert stream.

use std::fmt;
use std::str::FromStr;

use crate::error::InvalidStreamPosition;

/// A position in a fleet's insert stream: the id of a stream entry,
/// `milliseconds-sequence`, where the milliseconds are Redis's clock when
/// the entry was appended. Ordered as the stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct StreamPosition {
    millis: u64,
    sequence: u64,
}

impl StreamPosition {
    /// Before every entry (`0-0`).
    pub const START: Self = Self {
        millis: 0,
        sequence: 0,
    };

    /// Redis's clock, in milliseconds since the Unix epoch, when the entry was appended.
    pub fn millis(self) -> u64 {
        self.millis
    }

    /// The entry's number within its millisecond.
    pub fn sequence(self) -> u64 {
        self.sequence
    }

    /// How far this position is behind `newer`, in Redis's milliseconds.
    pub(crate) fn millis_behind(self, newer: Self) -> u64 {
        newer.millis.saturating_sub(self.millis)
    }
}

/// A Lua function for the fleet's scripts: whether stream id `a` comes
/// before `b` (both `milliseconds-sequence`), as [`StreamPosition`]s order.
pub(super) const POSITION_BEFORE: &str = r"
local function position_before(a, b)
  local a_millis, a_sequence = string.match(a, '^(%d+)-(%d+)$')
  local b_millis, b_sequence = string.match(b, '^(%d+)-(%d+)$')
  a_millis, b_millis = tonumber(a_millis), tonumber(b_millis)
  return a_millis < b_millis or (a_millis == b_millis and tonumber(a_sequence) < tonumber(b_sequence))
end
";

impl fmt::Display for StreamPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.millis, self.sequence)
    }
}

impl FromStr for StreamPosition {
    type Err = InvalidStreamPosition;

    fn from_str(id: &str) -> Result<Self, Self::Err> {
        let (millis, sequence) = id.split_once('-').ok_or(InvalidStreamPosition)?;
        Ok(Self {
            millis: millis.parse().map_err(|_| InvalidStreamPosition)?,
            sequence: sequence.parse().map_err(|_| InvalidStreamPosition)?,
        })
    }
}

impl redis::ToRedisArgs for StreamPosition {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        out.write_arg_fmt(self);
    }
}

impl redis::ToSingleRedisArg for StreamPosition {}

impl redis::FromRedisValue for StreamPosition {
    fn from_redis_value(value: redis::Value) -> Result<Self, redis::ParsingError> {
        let text: String = redis::FromRedisValue::from_redis_value(value)?;
        text.parse()
            .map_err(|_| redis::ParsingError::from(format!("not a stream id: {text:?}")))
    }
}

#[cfg(all(test, not(bloomguard_loom)))]
mod tests {
    use super::*;

    #[test]
    fn positions_parse_print_and_order_as_the_stream() {
        let early: StreamPosition = "1700000000000-3".parse().unwrap();
        let late: StreamPosition = "1700000000001-0".parse().unwrap();
        assert!(StreamPosition::START < early && early < late);
        assert_eq!(early.to_string(), "1700000000000-3");
        assert_eq!(early.millis_behind(late), 1);
        for bad in ["", "12", "a-1", "1-b", "1-2-3"] {
            assert_eq!(
                bad.parse::<StreamPosition>(),
                Err(InvalidStreamPosition),
                "{bad}"
            );
        }
    }
}
