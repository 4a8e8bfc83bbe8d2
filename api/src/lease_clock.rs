//! "Is my Lease still good?" on two clocks, shared by the agent's Lease
//! (`agent/src/cluster/lease.rs`) and the controller's leader election (`controller/src/leader.rs`).
//!
//! A holder counts its Lease from the moment its last successful renewal request was *sent*, so it
//! never thinks the Lease lasts longer than the API server (which stamped it later) does. It counts
//! on both clocks and trusts the earlier end:
//! - the monotonic clock is immune to wall-clock steps, but stands still while a machine sleeps
//!   (macOS, a paused VM);
//! - the wall clock counts sleep, but can be stepped either way.
//!
//! A step of the wall clock forward therefore ends the Lease early (safe: the holder stops sooner);
//! a step back cannot extend it past the monotonic end.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::time::{Duration, Instant};

/// One moment read on both clocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    pub mono: Instant,
    pub wall: Timestamp,
}

impl Stamp {
    /// Now, on both clocks.
    pub fn now() -> Stamp {
        Stamp {
            mono: Instant::now(),
            wall: Timestamp::now(),
        }
    }
}

/// Whether less than `span` has passed since `since_mono` on the monotonic clock at `now_mono`, and
/// (when `since_wall` is known) since `since_wall` on the wall clock at `now_wall`.
///
/// No arithmetic can overflow: a `span` too large for either clock counts as "forever" on that clock.
pub fn within(
    since_mono: Instant,
    since_wall: Option<Timestamp>,
    span: Duration,
    now_mono: Instant,
    now_wall: Timestamp,
) -> bool {
    // `saturating_duration_since`: an instant before `since` (impossible on one monotonic clock,
    // possible with instants from a paused test clock) counts as no time passed.
    let mono_ok = now_mono.saturating_duration_since(since_mono) < span;
    let wall_ok = since_wall.is_none_or(|at| {
        let span = SignedDuration::try_from(span).unwrap_or(SignedDuration::MAX);
        at.checked_add(span).map_or(true, |end| now_wall < end)
    });
    mono_ok && wall_ok
}

/// [`within`] with both ends as [`Stamp`]s.
pub fn stamp_within(since: Stamp, span: Duration, now: Stamp) -> bool {
    within(since.mono, Some(since.wall), span, now.mono, now.wall)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn secs(n: i64) -> SignedDuration {
        SignedDuration::from_secs(n)
    }

    #[test]
    fn both_clocks_must_agree() {
        let t0 = Stamp::now();
        let span = Duration::from_secs(10);
        let at = |mono: u64, wall: i64| Stamp {
            mono: t0.mono + Duration::from_secs(mono),
            wall: t0.wall + secs(wall),
        };
        assert!(stamp_within(t0, span, at(0, 0)));
        assert!(stamp_within(t0, span, at(9, 9)));
        assert!(!stamp_within(t0, span, at(10, 9)), "the monotonic end");
        assert!(!stamp_within(t0, span, at(9, 10)), "the wall end");
        // The machine slept an hour: the monotonic clock did not count it, the wall clock did.
        assert!(!stamp_within(t0, span, at(1, 3600)));
        // The wall clock was stepped back a minute: the monotonic end still holds.
        assert!(stamp_within(t0, span, at(9, -60)));
        assert!(!stamp_within(t0, span, at(10, -60)));
        // No wall reading: the monotonic clock alone.
        assert!(within(
            t0.mono,
            None,
            span,
            t0.mono + Duration::from_secs(9),
            t0.wall + secs(3600)
        ));
    }

    #[test]
    fn extreme_spans_and_instants_do_not_overflow() {
        let t0 = Stamp::now();
        assert!(stamp_within(t0, Duration::MAX, t0));
        assert!(!stamp_within(t0, Duration::ZERO, t0), "a zero span is never within");
        let wall_max = Stamp {
            mono: t0.mono,
            wall: Timestamp::MAX,
        };
        assert!(stamp_within(wall_max, Duration::from_secs(1), wall_max));
        // An instant before `since` counts as no time passed.
        let later = Stamp {
            mono: t0.mono + Duration::from_secs(5),
            wall: t0.wall,
        };
        assert!(stamp_within(later, Duration::from_secs(1), t0));
    }

    proptest! {
        /// Within iff less than `span` passed on the monotonic clock and on the wall clock, for any
        /// forward monotonic advance and any wall step (forward or back).
        #[test]
        fn within_iff_both_elapsed_are_short(
            span_ms in 0u64..100_000,
            mono_ms in 0u64..200_000,
            wall_ms in -200_000i64..200_000,
        ) {
            let t0 = Stamp::now();
            let now = Stamp {
                mono: t0.mono + Duration::from_millis(mono_ms),
                wall: t0.wall + SignedDuration::from_millis(wall_ms),
            };
            let expected = mono_ms < span_ms && wall_ms < span_ms as i64;
            prop_assert_eq!(stamp_within(t0, Duration::from_millis(span_ms), now), expected);
        }

        /// Once out, later readings of both clocks never bring it back (monotonic in time).
        #[test]
        fn once_out_stays_out(
            span_ms in 0u64..100_000,
            a_ms in 0u64..200_000,
            more_ms in 0u64..200_000,
        ) {
            let t0 = Stamp::now();
            let at = |ms: u64| Stamp {
                mono: t0.mono + Duration::from_millis(ms),
                wall: t0.wall + SignedDuration::from_millis(ms as i64),
            };
            let span = Duration::from_millis(span_ms);
            if !stamp_within(t0, span, at(a_ms)) {
                prop_assert!(!stamp_within(t0, span, at(a_ms + more_ms)));
            }
        }
    }
}
