//! Pure decisions, with `now` always passed in: which VMs are overdue, when the loop must wake
//! next, how long a failed delete waits before its retry, and what changed in the deadline folder.
//!
//! Nothing here reads a clock, a file or a process; the loop in `run.rs` gathers those facts and
//! only carries out what these functions decide.

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::collections::BTreeMap;
use std::time::Duration;
use tartan_api::VM_PREFIX;

/// What the loop knows about one VM named by a valid deadline file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tracked {
    /// The host execution deadline from the deadline file.
    pub deadline: Timestamp,
    /// A task is stopping/deleting this VM right now; it is not picked again until it reports back.
    pub in_flight: bool,
    /// Consecutive failed attempts to delete it (0 until the first failure).
    pub failures: u32,
    /// After a failure: do not try again before this time.
    pub retry_at: Option<Timestamp>,
}

impl Tracked {
    pub fn new(deadline: Timestamp) -> Tracked {
        Tracked {
            deadline,
            in_flight: false,
            failures: 0,
            retry_at: None,
        }
    }

    /// When this VM becomes due: its deadline plus the grace, or later if a retry is pending.
    pub fn due_at(&self, grace: SignedDuration) -> Timestamp {
        let first = add(self.deadline, grace);
        match self.retry_at {
            Some(retry) if retry > first => retry,
            _ => first,
        }
    }
}

/// `ts + d`, clamped to the representable range instead of failing.
pub fn add(ts: Timestamp, d: SignedDuration) -> Timestamp {
    ts.saturating_add(d).unwrap_or(if d.is_negative() {
        Timestamp::MIN
    } else {
        Timestamp::MAX
    })
}

/// Whether the watchdog may ever act on a VM of this name: only the agent's own VMs.
pub fn is_ours(vm: &str) -> bool {
    vm.len() > VM_PREFIX.len() && vm.starts_with(VM_PREFIX)
}

/// The VMs to act on now: the agent's prefix, not already being handled, and `deadline + grace`
/// (or the pending retry time) at or before `now`. Sorted by due time, then name, so the most
/// overdue VM starts first when the concurrency bound holds the others back.
pub fn overdue(tracked: &BTreeMap<String, Tracked>, now: Timestamp, grace: SignedDuration) -> Vec<String> {
    let mut due: Vec<(Timestamp, &String)> = tracked
        .iter()
        .filter(|(vm, t)| is_ours(vm) && !t.in_flight)
        .map(|(vm, t)| (t.due_at(grace), vm))
        .filter(|(at, _)| *at <= now)
        .collect();
    due.sort();
    due.into_iter().map(|(_, vm)| vm.clone()).collect()
}

/// The earliest time any tracked VM (not in flight) becomes due, if there is one.
pub fn next_wake(tracked: &BTreeMap<String, Tracked>, grace: SignedDuration) -> Option<Timestamp> {
    tracked
        .iter()
        .filter(|(vm, t)| is_ours(vm) && !t.in_flight)
        .map(|(_, t)| t.due_at(grace))
        .min()
}

/// How long the loop sleeps: until the next due time, but never longer than `rescan` (so new and
/// removed deadline files, and wall-clock jumps, are noticed within one rescan interval), and
/// zero if something is already due.
pub fn sleep_for(next_wake: Option<Timestamp>, now: Timestamp, rescan: Duration) -> Duration {
    let Some(at) = next_wake else { return rescan };
    let until = at.duration_since(now);
    if until.is_negative() || until.is_zero() {
        return Duration::ZERO;
    }
    match Duration::try_from(until) {
        Ok(d) => d.min(rescan),
        Err(_) => rescan,
    }
}

/// The wait before retry number `failures` (1 after the first failure): `base` doubled each time,
/// capped at `cap`.
pub fn backoff(failures: u32, base: Duration, cap: Duration) -> Duration {
    let doublings = failures.saturating_sub(1).min(31);
    base.saturating_mul(1u32 << doublings).min(cap)
}

/// What identifies one version of a file in the deadline folder. An atomic rewrite (temp file +
/// rename) changes the inode even when size and mtime look the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint {
    pub inode: u64,
    pub len: u64,
    pub mtime_ns: i128,
}

/// The difference between two listings of the deadline folder.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// New files and files whose fingerprint changed: these are (re)read.
    pub changed: Vec<String>,
    /// Files that disappeared: their VMs are forgotten.
    pub removed: Vec<String>,
}

/// Compares the previous listing with the current one (keys are file names).
pub fn diff(before: &BTreeMap<String, Fingerprint>, after: &BTreeMap<String, Fingerprint>) -> Changes {
    let changed = after
        .iter()
        .filter(|(name, fp)| before.get(*name) != Some(fp))
        .map(|(name, _)| name.clone())
        .collect();
    let removed = before
        .keys()
        .filter(|name| !after.contains_key(*name))
        .cloned()
        .collect();
    Changes { changed, removed }
}

/// The VM a file in the deadline folder is about: `<vm>.json`. Other names (the writer's temp
/// files, hidden files, anything else) are not deadline files.
pub fn vm_of_file(file_name: &str) -> Option<&str> {
    if file_name.starts_with('.') {
        return None;
    }
    let vm = file_name.strip_suffix(".json")?;
    (!vm.is_empty()).then_some(vm)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ts(s: &str) -> Timestamp {
        s.parse().unwrap()
    }

    fn secs(n: i64) -> SignedDuration {
        SignedDuration::from_secs(n)
    }

    fn table(entries: &[(&str, Tracked)]) -> BTreeMap<String, Tracked> {
        entries.iter().map(|(vm, t)| (vm.to_string(), t.clone())).collect()
    }

    const T0: &str = "2026-10-05T02:55:36.40012Z";

    #[test]
    fn a_vm_is_overdue_exactly_at_deadline_plus_grace() {
        let t = table(&[("mb-a", Tracked::new(ts(T0)))]);
        let grace = secs(60);
        let due = add(ts(T0), grace);
        assert!(overdue(&t, add(due, SignedDuration::from_nanos(-1)), grace).is_empty());
        assert_eq!(overdue(&t, due, grace), vec!["mb-a"]);
        assert_eq!(overdue(&t, add(due, secs(3600)), grace), vec!["mb-a"]);
    }

    #[test]
    fn zero_grace_and_past_deadlines() {
        let t = table(&[("mb-a", Tracked::new(ts(T0)))]);
        assert_eq!(overdue(&t, ts(T0), SignedDuration::ZERO), vec!["mb-a"]);
        assert!(overdue(&t, add(ts(T0), secs(-1)), SignedDuration::ZERO).is_empty());
    }

    #[test]
    fn overdue_skips_foreign_names_in_flight_and_pending_retries() {
        let now = add(ts(T0), secs(120));
        let in_flight = Tracked {
            in_flight: true,
            ..Tracked::new(ts(T0))
        };
        let retry_later = Tracked {
            failures: 1,
            retry_at: Some(add(now, secs(1))),
            ..Tracked::new(ts(T0))
        };
        let retry_now = Tracked {
            failures: 2,
            retry_at: Some(now),
            ..Tracked::new(ts(T0))
        };
        let t = table(&[
            ("mb-due", Tracked::new(ts(T0))),
            ("other-vm", Tracked::new(ts(T0))),
            ("mb-", Tracked::new(ts(T0))),
            ("MB-upper", Tracked::new(ts(T0))),
            ("mb-busy", in_flight),
            ("mb-retry-later", retry_later),
            ("mb-retry-now", retry_now),
            ("mb-future", Tracked::new(add(now, secs(10)))),
        ]);
        assert_eq!(overdue(&t, now, secs(60)), vec!["mb-due", "mb-retry-now"]);
    }

    #[test]
    fn overdue_orders_most_overdue_first() {
        let t = table(&[
            ("mb-c", Tracked::new(add(ts(T0), secs(2)))),
            ("mb-a", Tracked::new(add(ts(T0), secs(5)))),
            ("mb-b", Tracked::new(ts(T0))),
            ("mb-d", Tracked::new(ts(T0))),
        ]);
        assert_eq!(
            overdue(&t, add(ts(T0), secs(100)), secs(60)),
            vec!["mb-b", "mb-d", "mb-c", "mb-a"]
        );
    }

    #[test]
    fn next_wake_is_the_earliest_deadline_plus_grace() {
        let grace = secs(60);
        assert_eq!(next_wake(&BTreeMap::new(), grace), None);
        let t = table(&[
            ("mb-late", Tracked::new(add(ts(T0), secs(30)))),
            ("mb-early", Tracked::new(ts(T0))),
            ("foreign-earlier", Tracked::new(add(ts(T0), secs(-500)))),
            (
                "mb-busy-earlier",
                Tracked {
                    in_flight: true,
                    ..Tracked::new(add(ts(T0), secs(-400)))
                },
            ),
        ]);
        assert_eq!(next_wake(&t, grace), Some(add(ts(T0), grace)));
    }

    #[test]
    fn next_wake_respects_a_pending_retry() {
        let grace = secs(60);
        let retry = add(ts(T0), secs(90));
        let t = table(&[(
            "mb-a",
            Tracked {
                failures: 1,
                retry_at: Some(retry),
                ..Tracked::new(ts(T0))
            },
        )]);
        assert_eq!(next_wake(&t, grace), Some(retry));
        // A retry time earlier than deadline + grace never makes a VM due early.
        let t = table(&[(
            "mb-a",
            Tracked {
                failures: 1,
                retry_at: Some(ts(T0)),
                ..Tracked::new(ts(T0))
            },
        )]);
        assert_eq!(next_wake(&t, grace), Some(add(ts(T0), grace)));
    }

    #[test]
    fn far_future_and_far_past_deadlines_do_not_overflow() {
        let t = table(&[
            ("mb-max", Tracked::new(Timestamp::MAX)),
            ("mb-min", Tracked::new(Timestamp::MIN)),
        ]);
        assert_eq!(next_wake(&t, secs(60)), Some(add(Timestamp::MIN, secs(60))));
        assert_eq!(overdue(&t, ts(T0), secs(60)), vec!["mb-min"]);
        assert_eq!(Tracked::new(Timestamp::MAX).due_at(secs(60)), Timestamp::MAX);
    }

    #[test]
    fn sleep_is_until_the_next_due_time_capped_by_the_rescan_interval() {
        let now = ts(T0);
        let rescan = Duration::from_secs(1);
        assert_eq!(sleep_for(None, now, rescan), rescan);
        assert_eq!(
            sleep_for(Some(add(now, SignedDuration::from_millis(250))), now, rescan),
            Duration::from_millis(250)
        );
        assert_eq!(sleep_for(Some(add(now, secs(3600))), now, rescan), rescan);
        assert_eq!(sleep_for(Some(now), now, rescan), Duration::ZERO);
        assert_eq!(sleep_for(Some(add(now, secs(-5))), now, rescan), Duration::ZERO);
        assert_eq!(sleep_for(Some(Timestamp::MAX), now, rescan), rescan);
    }

    #[test]
    fn backoff_doubles_from_base_and_stops_at_the_cap() {
        let base = Duration::from_secs(1);
        let cap = Duration::from_secs(60);
        let got: Vec<u64> = (0..10).map(|n| backoff(n, base, cap).as_secs()).collect();
        assert_eq!(got, vec![1, 1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(backoff(u32::MAX, base, cap), cap);
        assert_eq!(
            backoff(40, Duration::from_millis(100), Duration::from_secs(5)),
            Duration::from_secs(5)
        );
    }

    fn fp(inode: u64, len: u64, mtime_ns: i128) -> Fingerprint {
        Fingerprint { inode, len, mtime_ns }
    }

    fn listing(entries: &[(&str, Fingerprint)]) -> BTreeMap<String, Fingerprint> {
        entries.iter().map(|(n, f)| (n.to_string(), *f)).collect()
    }

    #[test]
    fn diff_reports_added_changed_and_removed_files() {
        let before = listing(&[
            ("mb-a.json", fp(1, 10, 5)),
            ("mb-b.json", fp(2, 10, 5)),
            ("mb-c.json", fp(3, 10, 5)),
        ]);
        let after = listing(&[
            ("mb-a.json", fp(1, 10, 5)), // unchanged
            ("mb-b.json", fp(9, 10, 5)), // replaced by rename: new inode, same size and mtime
            ("mb-d.json", fp(4, 10, 5)), // new
        ]);
        let changes = diff(&before, &after);
        assert_eq!(changes.changed, vec!["mb-b.json", "mb-d.json"]);
        assert_eq!(changes.removed, vec!["mb-c.json"]);
        assert_eq!(diff(&after, &after), Changes::default());
        assert_eq!(diff(&BTreeMap::new(), &after).changed.len(), 3);
        assert_eq!(diff(&after, &BTreeMap::new()).removed.len(), 3);
    }

    #[test]
    fn diff_notices_size_and_mtime_changes_in_place() {
        let before = listing(&[("mb-a.json", fp(1, 10, 5))]);
        assert_eq!(
            diff(&before, &listing(&[("mb-a.json", fp(1, 11, 5))])).changed,
            vec!["mb-a.json"]
        );
        assert_eq!(
            diff(&before, &listing(&[("mb-a.json", fp(1, 10, 6))])).changed,
            vec!["mb-a.json"]
        );
    }

    #[test]
    fn only_json_files_that_are_not_hidden_are_deadline_files() {
        assert_eq!(vm_of_file("mb-a.json"), Some("mb-a"));
        assert_eq!(vm_of_file(".mb-a.json.tmp"), None);
        assert_eq!(vm_of_file(".mb-a.json"), None);
        assert_eq!(vm_of_file("mb-a.json.tmp"), None);
        assert_eq!(vm_of_file("mb-a"), None);
        assert_eq!(vm_of_file(".json"), None);
    }

    #[test]
    fn only_prefixed_names_are_ours() {
        assert!(is_ours("mb-ci-build-42-c49f62f4"));
        assert!(!is_ours("mb-"));
        assert!(!is_ours("ghcr-base"));
        assert!(!is_ours("xmb-a"));
        assert!(!is_ours(""));
    }
}
