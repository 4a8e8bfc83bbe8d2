//! The `[timing]` section: its defaults for unset keys and the checks that tie its durations
//! together (`Timing::resolve`, called by `Config::from_toml`).

use super::*;

/// The longest `timing.lease_duration` accepted.
pub(super) const MAX_LEASE_DURATION: Duration = Duration::from_secs(3600);

pub(super) const HOUR: Duration = Duration::from_secs(3600);
pub(super) const DAY: Duration = Duration::from_secs(24 * 3600);

impl Timing {
    /// `[timing]`: the defaults for what is not set, then [`Timing::check`].
    pub(super) fn resolve(t: RawTiming) -> Result<Timing, Refusal> {
        let d = Timing::default();
        let pick = |v: Option<HumaneDuration>, default: Duration| v.map_or(default, |h| h.0);
        let timing = Timing {
            lease_renew: pick(t.lease_renew, d.lease_renew),
            lease_duration: pick(t.lease_duration, d.lease_duration),
            api_timeout: pick(t.api_timeout, d.api_timeout),
            retry_min_window: pick(t.retry_min_window, d.retry_min_window),
            watchdog_grace: pick(t.watchdog_grace, d.watchdog_grace),
            status_retry_initial: pick(t.status_retry_initial, d.status_retry_initial),
            status_retry_max: pick(t.status_retry_max, d.status_retry_max),
            resume_probe: pick(t.resume_probe, d.resume_probe),
            step_poll: pick(t.step_poll, d.step_poll),
            compaction_interval: pick(t.compaction_interval, d.compaction_interval),
            claim_spread: pick(t.claim_spread, d.claim_spread),
            uncached_claim_delay: pick(t.uncached_claim_delay, d.uncached_claim_delay),
        };
        timing.check().map_err(|(key, why)| Refusal { key, why })?;
        Ok(timing)
    }

    /// The upper bounds of the keys bounded by no other one: a mistyped or hostile value is
    /// refused at load instead of overflowing a timer's or deadline's arithmetic later.
    pub(super) fn check_bounds(&self) -> Result<(), (&'static str, String)> {
        let bounded = [
            (
                "timing.retry_min_window",
                self.retry_min_window,
                DAY,
                "1d",
                "an interrupted build would almost never have that long left to be retried",
            ),
            (
                "timing.watchdog_grace",
                self.watchdog_grace,
                HOUR,
                "1h",
                "a VM past its deadline would be given up that late (keep it equal to the watchdog's --grace)",
            ),
            (
                "timing.status_retry_max",
                self.status_retry_max,
                HOUR,
                "1h",
                "a refused status write would wait up to that long before it is sent again",
            ),
            (
                "timing.resume_probe",
                self.resume_probe,
                HOUR,
                "1h",
                "a start would wait that long for a guest that does not answer",
            ),
            (
                "timing.compaction_interval",
                self.compaction_interval,
                DAY,
                "1d",
                "delivered builds would stay in the journal that long",
            ),
        ];
        for (key, value, max, max_text, why) in bounded {
            if value > max {
                return Err((key, format!("{}s is more than {max_text}: {why}", value.as_secs_f64())));
            }
        }
        Ok(())
    }
    /// The relations the agent relies on; returns the offending key and why.
    pub(super) fn check(&self) -> Result<(), (&'static str, String)> {
        let secs = |d: Duration| format!("{}s", d.as_secs_f64());
        if self.lease_renew.is_zero() {
            return Err(("timing.lease_renew", "must be more than 0".into()));
        }
        // At most an hour: a longer Lease keeps a dead agent's builds from being seen as
        // unreachable (and a huge one overflowed the keeper's expiry arithmetic).
        if self.lease_duration.as_secs() == 0
            || self.lease_duration.subsec_nanos() != 0
            || self.lease_duration > MAX_LEASE_DURATION
        {
            return Err((
                "timing.lease_duration",
                format!(
                    "{} must be a whole number of seconds, from 1 to {} (leaseDurationSeconds)",
                    secs(self.lease_duration),
                    secs(MAX_LEASE_DURATION)
                ),
            ));
        }
        if self.lease_renew >= self.lease_duration {
            return Err((
                "timing.lease_renew",
                format!(
                    "{} must be shorter than timing.lease_duration ({}), or the Lease expires between renewals",
                    secs(self.lease_renew),
                    secs(self.lease_duration)
                ),
            ));
        }
        if self.api_timeout.is_zero() || self.api_timeout >= self.lease_renew {
            return Err((
                "timing.api_timeout",
                format!(
                    "{} must be more than 0 and shorter than timing.lease_renew ({})",
                    secs(self.api_timeout),
                    secs(self.lease_renew)
                ),
            ));
        }
        if self.status_retry_initial.is_zero() || self.status_retry_initial > self.status_retry_max {
            return Err((
                "timing.status_retry_initial",
                format!(
                    "{} must be more than 0 and at most timing.status_retry_max ({})",
                    secs(self.status_retry_initial),
                    secs(self.status_retry_max)
                ),
            ));
        }
        if self.step_poll.is_zero() || self.step_poll > Duration::from_secs(60) {
            return Err((
                "timing.step_poll",
                format!(
                    "{} must be more than 0 and at most 60s (a finished step is noticed one poll late)",
                    secs(self.step_poll)
                ),
            ));
        }
        if self.resume_probe.is_zero() {
            return Err(("timing.resume_probe", "must be more than 0".into()));
        }
        if self.compaction_interval.is_zero() {
            return Err(("timing.compaction_interval", "must be more than 0".into()));
        }
        if self.claim_spread > Duration::from_secs(60) {
            return Err((
                "timing.claim_spread",
                format!(
                    "{} is more than 60s: every claim would wait up to that long",
                    secs(self.claim_spread)
                ),
            ));
        }
        if self.uncached_claim_delay > Duration::from_secs(3600) {
            return Err((
                "timing.uncached_claim_delay",
                format!(
                    "{} is more than 1h: a build whose image no free host holds would wait that long",
                    secs(self.uncached_claim_delay)
                ),
            ));
        }
        self.check_bounds()
    }
}
