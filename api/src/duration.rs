//! Humane durations, one grammar for the agent's config and the command line.
//!
//! The core is a sum of numbers each followed by its unit: `500ms`, `5s`, `2m`, `1h`, `7d`,
//! `1m30s` (units `ms`, `s`, `m`, `h`, `d`, in any order, no spaces). The agent's config takes
//! exactly that ([`parse_unit_duration`]: a bare `5` in a file says no unit). The command line
//! ([`parse_duration`]) also takes a bare number of seconds (`45`) and what jiff reads as a
//! duration: `1m 30s`, `1.5s`, `2 mins`, ISO 8601 `PT1M`. Never negative.

use k8s_openapi::jiff::SignedDuration;
use std::time::Duration;

/// Parses a duration whose every number carries a unit (`500ms`, `5s`, `2m`, `1h`, `7d`, `1m30s`).
pub fn parse_unit_duration(text: &str) -> Result<Duration, String> {
    unit_sum(text.trim())
        .flatten()
        .ok_or_else(|| format!("{text:?} is not a duration; write e.g. \"500ms\", \"5s\", \"2m\" or \"1m30s\""))
}

/// Parses a non-negative duration the command line's way (for clap's `value_parser`): a unit sum
/// as [`parse_unit_duration`], a bare number of seconds, or a duration as jiff reads it.
pub fn parse_duration(text: &str) -> Result<SignedDuration, String> {
    let text = text.trim();
    match unit_sum(text) {
        Some(sum) => sum
            .and_then(|d| SignedDuration::try_from(d).ok())
            .ok_or_else(|| too_long(text)),
        None => parse_other(text),
    }
}

/// Like [`parse_duration`], as a `std::time::Duration` (a unit sum may exceed what
/// [`SignedDuration`] holds).
pub fn parse_std_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    match unit_sum(text) {
        Some(sum) => sum.ok_or_else(|| too_long(text)),
        None => Duration::try_from(parse_other(text)?).map_err(|e| format!("{text:?}: {e}")),
    }
}

fn too_long(text: &str) -> String {
    format!("{text:?} is too long")
}

/// `text` as numbers each followed by `ms`, `s`, `m`, `h` or `d` (`1m30s`, `7d`): `None` if it is
/// not of that form (also when a number does not fit in 64 bits: jiff says so), `Some(None)` if
/// the sum overflows.
fn unit_sum(text: &str) -> Option<Option<Duration>> {
    let mut rest = text;
    if rest.is_empty() {
        return None;
    }
    let mut total = Some(Duration::ZERO);
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
        if digits == 0 {
            return None;
        }
        let n: u64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit()).unwrap_or(rest.len());
        let secs_per_unit = match &rest[..unit_len] {
            "ms" => None,
            "s" => Some(1),
            "m" => Some(60),
            "h" => Some(3600),
            "d" => Some(24 * 3600),
            _ => return None,
        };
        let part = match secs_per_unit {
            None => Some(Duration::from_millis(n)),
            Some(unit) => n.checked_mul(unit).map(Duration::from_secs),
        };
        total = total.zip(part).and_then(|(t, p)| t.checked_add(p));
        rest = &rest[unit_len..];
    }
    Some(total)
}

/// A bare number of seconds, or whatever jiff reads as a duration.
fn parse_other(text: &str) -> Result<SignedDuration, String> {
    let parsed = match text.parse::<u64>() {
        Ok(secs) => i64::try_from(secs)
            .map(SignedDuration::from_secs)
            .map_err(|_| format!("{text} seconds is too long")),
        Err(_) => text
            .parse::<SignedDuration>()
            .map_err(|e| format!("{text:?} is not a duration like 60s, 2m or 1m30s: {e}")),
    }?;
    if parsed.is_negative() {
        return Err(format!("{text:?} is negative; a duration here must be zero or more"));
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Seconds and nanoseconds, or the error word for word.
    type Parsed = Result<(u64, u32), &'static str>;

    /// The command line's parser before it moved here (watchdog/src/duration.rs): every input and
    /// its result, errors word for word.
    const COMMAND_LINE: &[(&str, Parsed)] = &[
        ("60s", Ok((60, 0))),
        ("2m", Ok((120, 0))),
        ("1m30s", Ok((90, 0))),
        ("1m 30s", Ok((90, 0))),
        ("1h30m", Ok((5400, 0))),
        ("PT1M", Ok((60, 0))),
        ("45", Ok((45, 0))),
        ("0", Ok((0, 0))),
        (" 0s ", Ok((0, 0))),
        ("500ms", Ok((0, 500_000_000))),
        ("1.5s", Ok((1, 500_000_000))),
        ("5 s", Ok((5, 0))),
        ("+5s", Ok((5, 0))),
        ("1 hour", Ok((3600, 0))),
        ("2 mins", Ok((120, 0))),
        ("1sec", Ok((1, 0))),
        ("1s1ms", Ok((1, 1_000_000))),
        ("10000000000000h", Ok((36_000_000_000_000_000, 0))),
        ("9223372036854775807", Ok((9_223_372_036_854_775_807, 0))),
        ("9223372036854775808", Err("9223372036854775808 seconds is too long")),
        ("18446744073709551615", Err("18446744073709551615 seconds is too long")),
        ("-5s", Err("\"-5s\" is negative; a duration here must be zero or more")),
        (
            "",
            Err(
                "\"\" is not a duration like 60s, 2m or 1m30s: an empty string is not a valid duration in either \
                 the ISO 8601 format or Jiff's \"friendly\" format",
            ),
        ),
        (
            "soon",
            Err(
                "\"soon\" is not a duration like 60s, 2m or 1m30s: failed to parse input in the \"friendly\" \
                 duration format: expected duration to start with a unit value (a decimal integer) after an \
                 optional sign, but no integer was found",
            ),
        ),
        (
            "5x",
            Err(
                "\"5x\" is not a duration like 60s, 2m or 1m30s: failed to parse input in the \"friendly\" \
                 duration format: expected to find unit designator suffix (e.g., `years` or `secs`) after \
                 parsing integer",
            ),
        ),
        (
            "99999999999999999999ms",
            Err(
                "\"99999999999999999999ms\" is not a duration like 60s, 2m or 1m30s: failed to parse input in \
                 the \"friendly\" duration format: number too big to parse into 64-bit integer",
            ),
        ),
        (
            "1w",
            Err(
                "\"1w\" is not a duration like 60s, 2m or 1m30s: failed to parse input in the \"friendly\" \
                 duration format: parsing calendar units (weeks in this case) in this context is not supported \
                 (perhaps try parsing into a `jiff::Span` instead)",
            ),
        ),
        (
            "P1D",
            Err(
                "\"P1D\" is not a duration like 60s, 2m or 1m30s: parsing ISO 8601 duration in this context \
                 requires that the duration contain a time component and no components of days or greater",
            ),
        ),
    ];

    /// Every input the agent config's parser (agent/src/config.rs) accepts, with its value.
    const CONFIG_ACCEPTED: &[(&str, (u64, u32))] = &[
        ("5s", (5, 0)),
        ("5s ", (5, 0)),
        (" 0s ", (0, 0)),
        ("500ms", (0, 500_000_000)),
        ("2m", (120, 0)),
        ("1h", (3600, 0)),
        ("7d", (604_800, 0)),
        ("1d", (86_400, 0)),
        ("1m30s", (90, 0)),
        ("90s", (90, 0)),
        ("1h30m", (5400, 0)),
        ("1s1ms", (1, 1_000_000)),
        ("1ms1s", (1, 1_000_000)),
        ("10000000000000h", (36_000_000_000_000_000, 0)),
        ("213503982335d", (18_446_744_073_744_000, 0)),
        ("150000000000000d", (12_960_000_000_000_000_000, 0)),
    ];

    /// Inputs the agent config's parser refuses (a number without its unit, spaces, fractions,
    /// signs, ISO 8601, words, overflow), all with the same message.
    const CONFIG_REFUSED: &[&str] = &[
        "",
        " ",
        "5",
        "45",
        "s",
        "5x",
        "-5s",
        "+5s",
        "5 s",
        "1m 30s",
        "1.5s",
        "PT1M",
        "5 seconds",
        "1sec",
        "5S",
        "1w",
        "1h30",
        "99999999999999999999ms",
        "300000000000000d",
        "200000000000000d200000000000000d",
    ];

    #[test]
    fn the_command_line_reads_what_it_read_before() {
        for (input, want) in COMMAND_LINE {
            let want = want.map(|(s, n)| Duration::new(s, n)).map_err(str::to_string);
            assert_eq!(parse_std_duration(input), want, "{input:?}");
            let signed = parse_duration(input).map(|d| Duration::try_from(d).unwrap());
            assert_eq!(signed, want, "{input:?} as a SignedDuration");
        }
    }

    #[test]
    fn the_config_reads_what_it_read_before_and_the_command_line_reads_it_too() {
        for (input, (s, n)) in CONFIG_ACCEPTED {
            assert_eq!(parse_unit_duration(input), Ok(Duration::new(*s, *n)), "{input:?}");
            assert_eq!(
                parse_std_duration(input),
                Ok(Duration::new(*s, *n)),
                "{input:?} on the command line"
            );
        }
        for input in CONFIG_REFUSED {
            assert_eq!(
                parse_unit_duration(input),
                Err(format!(
                    "{input:?} is not a duration; write e.g. \"500ms\", \"5s\", \"2m\" or \"1m30s\""
                )),
                "{input:?}"
            );
        }
    }

    /// What the command line gains from the config's grammar: days, and units in any order.
    #[test]
    fn days_and_units_in_any_order_are_read_everywhere() {
        let s = SignedDuration::from_secs;
        assert_eq!(parse_duration("7d"), Ok(s(7 * 24 * 3600)));
        assert_eq!(parse_duration("1ms1s"), Ok(SignedDuration::from_millis(1001)));
        // A sum past what a SignedDuration holds fits a std Duration only.
        assert_eq!(
            parse_duration("150000000000000d"),
            Err("\"150000000000000d\" is too long".to_string())
        );
        assert_eq!(
            parse_std_duration("300000000000000d"),
            Err("\"300000000000000d\" is too long".to_string())
        );
    }
}
