//! Go duration strings (`spec.timeout` is a `metav1.Duration`: `1h0m0s`, `30m`, `1.5h`, `0s`)
//! and the seconds spelling used in Tartan's messages (`100s`, `45s`).

use std::time::Duration;

/// Why a duration string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("empty duration")]
    Empty,
    #[error("negative duration {0:?}")]
    Negative(String),
    #[error("invalid duration {0:?}: expected Go syntax such as 1h0m0s, 30m, 90s or 1.5h")]
    Invalid(String),
    #[error("unknown unit {unit:?} in duration {text:?} (units: ns, us, ms, s, m, h)")]
    UnknownUnit { text: String, unit: String },
    #[error("duration {0:?} overflows")]
    Overflow(String),
}

/// Parses a duration the way Go's `time.ParseDuration` does (`"0"` alone needs no unit; a
/// leading `+` is allowed). Negative durations are refused: a negative timeout is meaningless.
pub fn parse_go_duration(text: &str) -> Result<Duration, DurationError> {
    let s = text.trim();
    if s.is_empty() {
        return Err(DurationError::Empty);
    }
    let (neg, mut rest) = match s.as_bytes()[0] {
        b'-' => (true, &s[1..]),
        b'+' => (false, &s[1..]),
        _ => (false, s),
    };
    if rest == "0" {
        return Ok(Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(DurationError::Invalid(text.to_string()));
    }
    let mut total_nanos: u128 = 0;
    while !rest.is_empty() {
        let num_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number = &rest[..num_end];
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(DurationError::Invalid(text.to_string()));
        }
        rest = &rest[num_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = &rest[..unit_end];
        rest = &rest[unit_end..];
        let nanos_per_unit: u128 = match unit {
            "ns" => 1,
            "us" | "µs" | "μs" => 1_000,
            "ms" => 1_000_000,
            "s" => 1_000_000_000,
            "m" => 60 * 1_000_000_000,
            "h" => 3600 * 1_000_000_000,
            "" => return Err(DurationError::Invalid(text.to_string())),
            other => {
                return Err(DurationError::UnknownUnit {
                    text: text.to_string(),
                    unit: other.to_string(),
                });
            }
        };
        let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
        let int: u128 = if int_part.is_empty() {
            0
        } else {
            int_part
                .parse()
                .map_err(|_| DurationError::Overflow(text.to_string()))?
        };
        let mut nanos = int
            .checked_mul(nanos_per_unit)
            .ok_or_else(|| DurationError::Overflow(text.to_string()))?;
        // Fractions are exact up to the nanosecond, like Go.
        let mut scale = nanos_per_unit;
        for digit in frac_part.bytes().take(30) {
            scale /= 10;
            nanos += u128::from(digit - b'0') * scale;
        }
        total_nanos = total_nanos
            .checked_add(nanos)
            .ok_or_else(|| DurationError::Overflow(text.to_string()))?;
    }
    if neg && total_nanos > 0 {
        return Err(DurationError::Negative(text.to_string()));
    }
    let secs = u64::try_from(total_nanos / 1_000_000_000).map_err(|_| DurationError::Overflow(text.to_string()))?;
    Ok(Duration::new(secs, (total_nanos % 1_000_000_000) as u32))
}

/// Seconds with up to millisecond precision, as Tartan's messages spell durations: `100s`,
/// `45s`, `0.25s`.
pub fn format_secs(d: Duration) -> String {
    let millis = d.as_millis();
    if millis.is_multiple_of(1000) {
        format!("{}s", millis / 1000)
    } else {
        let text = format!("{}.{:03}", millis / 1000, millis % 1000);
        format!("{}s", text.trim_end_matches('0'))
    }
}

/// A clap value parser for flags such as `--grace 45s` (Go syntax).
pub fn parse_flag(text: &str) -> Result<Duration, DurationError> {
    parse_go_duration(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse() {
        let cases: &[(&str, Duration)] = &[
            ("0", Duration::ZERO),
            ("0s", Duration::ZERO),
            ("-0s", Duration::ZERO),
            ("1h0m0s", Duration::from_secs(3600)),
            ("30m0s", Duration::from_secs(1800)),
            ("30m", Duration::from_secs(1800)),
            ("1m40s", Duration::from_secs(100)),
            ("100s", Duration::from_secs(100)),
            ("+5s", Duration::from_secs(5)),
            ("1.5h", Duration::from_secs(5400)),
            (".5s", Duration::from_millis(500)),
            ("1.s", Duration::from_secs(1)),
            ("250ms", Duration::from_millis(250)),
            ("10us", Duration::from_micros(10)),
            ("10µs", Duration::from_micros(10)),
            ("7ns", Duration::from_nanos(7)),
            (
                "2h45m30.5s",
                Duration::from_millis((2 * 3600 + 45 * 60 + 30) * 1000 + 500),
            ),
        ];
        for (text, want) in cases {
            assert_eq!(parse_go_duration(text), Ok(*want), "{text}");
        }
    }

    #[test]
    fn bad_durations_are_refused_with_the_reason() {
        assert_eq!(parse_go_duration(""), Err(DurationError::Empty));
        assert_eq!(parse_go_duration("-5s"), Err(DurationError::Negative("-5s".into())));
        for bad in ["5", "s", "1..5s", "h1", "-", "1h 2m", "."] {
            assert!(parse_go_duration(bad).is_err(), "{bad} should be refused");
        }
        assert_eq!(
            parse_go_duration("3d"),
            Err(DurationError::UnknownUnit {
                text: "3d".into(),
                unit: "d".into()
            })
        );
        assert!(matches!(
            parse_go_duration("99999999999999999999999h"),
            Err(DurationError::Overflow(_))
        ));
        assert!(
            parse_go_duration("5x")
                .unwrap_err()
                .to_string()
                .contains("unknown unit \"x\"")
        );
    }

    #[test]
    fn seconds_spelling() {
        assert_eq!(format_secs(Duration::from_secs(100)), "100s");
        assert_eq!(format_secs(Duration::from_secs(45)), "45s");
        assert_eq!(format_secs(Duration::from_secs(3600)), "3600s");
        assert_eq!(format_secs(Duration::from_millis(250)), "0.25s");
        assert_eq!(format_secs(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format_secs(Duration::ZERO), "0s");
    }
}
