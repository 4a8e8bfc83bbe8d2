//! Humane durations on the command line: `60s`, `2m`, `1m30s`, `500ms`, ISO 8601 `PT1M`, or a
//! bare number of seconds.

use k8s_openapi::jiff::SignedDuration;
use std::time::Duration;

/// Parses a non-negative duration (for clap's `value_parser`).
pub fn parse_duration(text: &str) -> Result<SignedDuration, String> {
    let text = text.trim();
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

/// Like [`parse_duration`], as a `std::time::Duration`.
pub fn parse_std_duration(text: &str) -> Result<Duration, String> {
    let d = parse_duration(text)?;
    Duration::try_from(d).map_err(|e| format!("{text:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_humane_and_iso_forms() {
        let s = SignedDuration::from_secs;
        assert_eq!(parse_duration("60s"), Ok(s(60)));
        assert_eq!(parse_duration("2m"), Ok(s(120)));
        assert_eq!(parse_duration("1m30s"), Ok(s(90)));
        assert_eq!(parse_duration("1m 30s"), Ok(s(90)));
        assert_eq!(parse_duration("PT1M"), Ok(s(60)));
        assert_eq!(parse_duration("45"), Ok(s(45)));
        assert_eq!(parse_duration(" 0s "), Ok(SignedDuration::ZERO));
        assert_eq!(parse_duration("500ms"), Ok(SignedDuration::from_millis(500)));
        assert_eq!(parse_std_duration("250ms"), Ok(Duration::from_millis(250)));
    }

    #[test]
    fn refuses_garbage_and_negative_durations() {
        assert!(parse_duration("soon").unwrap_err().contains("not a duration"));
        assert!(parse_duration("").is_err());
        assert!(parse_duration("-5s").unwrap_err().contains("negative"));
        assert!(parse_duration("1 fortnight").is_err());
    }
}
