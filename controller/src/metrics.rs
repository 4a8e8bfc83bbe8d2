//! Prometheus metrics served on `/metrics`.

use crate::decide::{Finished, Liveness, liveness};
use crate::view::{lease_agent, lease_view};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::Store;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;
use tartan_api::{ConditionStatus, ConditionType, MacBuildStatus};

/// Every `error` label of the failure counter (one per kind of reconcile error,
/// `reconcile::Error::metric_label`), each served from the start (at 0) so that a rate over it
/// exists before the first failure.
pub const ERROR_LABELS: [&str; 3] = ["api", "timeout", "conflicts"];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub status: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct IdentityLabels {
    pub identity: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetirementLabels {
    pub vm_retirement: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RetirementReasonLabels {
    pub vm_retirement: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct AgentLabels {
    pub namespace: String,
    pub agent: String,
}

/// The agent Lease caches of the reconcilers running now (none on a standby), read at each scrape.
struct AgentLeases {
    caches: Vec<Store<Lease>>,
    default_duration: Duration,
}

/// The controller's counters.
pub struct Metrics {
    /// Reconciles of MacBuild CustomRuns.
    pub reconciles: Counter,
    /// Failed reconciles, by error kind.
    pub errors: Family<ErrorLabels, Counter>,
    /// CustomRuns this controller ended, by `Succeeded` status and reason.
    pub customruns: Family<OutcomeLabels, Counter>,
    /// `CustomRunTimedOut` endings, by `vmRetirement`.
    pub timeouts: Family<RetirementLabels, Counter>,
    /// 1 while this replica leads (label: its identity), 0 while it stands by.
    pub leader: Family<IdentityLabels, Gauge>,
    /// API writes refused because this replica did not hold the leader Lease.
    pub refused_writes: Counter,
    /// Events dropped because the queue of Events waiting to be published was full.
    pub events_dropped: Counter,
    /// CustomRuns this controller ended, by `vmRetirement` and reason (timeouts and cancels alike).
    pub retirements: Family<RetirementReasonLabels, Counter>,
    /// 1 while an agent's Lease is expired (the agent stopped renewing), 0 while it is live; set
    /// at each scrape from `agent_leases`, by the leader only.
    agent_lease_expired: Family<AgentLabels, Gauge>,
    agent_leases: Mutex<AgentLeases>,
    /// The three times of a build ([`BuildTimes`]), observed once per CustomRun when this
    /// controller ends it.
    queue_wait: Histogram,
    start_latency: Histogram,
    delivery_lag: Histogram,
    registry: Registry,
}

/// Queue wait (CustomRun created -> claimed): seconds to hours while Macs are busy.
const QUEUE_WAIT_BUCKETS: [f64; 12] = [
    1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0,
];
/// Start latency (CustomRun created -> the guest answers, its first step starts): the queue wait
/// plus a clone and a boot, so rarely under ten seconds.
const START_LATENCY_BUCKETS: [f64; 12] = [
    5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0,
];
/// Delivery lag (result journaled on the Mac -> CustomRun terminal): a status write, a watch
/// event and a reconcile, so under a second when all is well; minutes mean a partition or a
/// controller catching up.
const DELIVERY_LAG_BUCKETS: [f64; 12] = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0];

/// The times of one ended build, in seconds, from the CustomRun's creation, the MacBuild status
/// the agent wrote (its conditions carry the agent's journal record times) and the moment the
/// controller makes the CustomRun terminal. A time whose two ends are not both known is `None`
/// (a build cancelled before any claim has no queue wait). The Mac's and the controller's
/// clocks differ, so a time across them that comes out negative counts as 0, and one longer than
/// the CustomRun has existed (plus [`CLOCK_SKEW_ALLOWED`]) is not observed: a Mac whose clock is
/// years off would otherwise skew every sum and average until the controller restarts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BuildTimes {
    /// CustomRun created -> first claimed (`Claimed` turned True).
    pub queue_wait: Option<f64>,
    /// CustomRun created -> its guest answered and steps began (`VMReady` turned True; for a
    /// retried build, that of the attempt that ran last).
    pub start_latency: Option<f64>,
    /// The result journaled (`Succeeded` turned True or False) -> the CustomRun made terminal.
    pub delivery_lag: Option<f64>,
}

/// How far a Mac's clock may be off the controller's before its times are not observed.
pub const CLOCK_SKEW_ALLOWED: f64 = 600.0;
/// The longest time observed when the CustomRun's creation is not known.
const LONGEST_OBSERVED: f64 = 7.0 * 86_400.0;

/// [`BuildTimes`] of a CustomRun created at `created` whose MacBuild status is `status`, ended at `now`.
pub fn build_times(created: Option<Timestamp>, status: Option<&MacBuildStatus>, now: Timestamp) -> BuildTimes {
    let millis = |from: Timestamp, to: Timestamp| to.as_millisecond() - from.as_millisecond();
    let longest = created.map_or(LONGEST_OBSERVED, |c| {
        millis(c, now).max(0) as f64 / 1000.0 + CLOCK_SKEW_ALLOWED
    });
    let seconds = |from: Timestamp, to: Timestamp| {
        let s = millis(from, to).max(0) as f64 / 1000.0;
        (s <= longest).then_some(s)
    };
    let turned = |type_: ConditionType, when: &dyn Fn(ConditionStatus) -> bool| {
        status
            .and_then(|s| s.condition(type_))
            .filter(|c| when(c.status))
            .map(|c| c.last_transition_time.0)
    };
    let claimed = turned(ConditionType::Claimed, &|s| s == ConditionStatus::True);
    let ready = turned(ConditionType::VMReady, &|s| s == ConditionStatus::True);
    let delivered = turned(ConditionType::Succeeded, &|s| s != ConditionStatus::Unknown);
    BuildTimes {
        queue_wait: created.zip(claimed).and_then(|(c, t)| seconds(c, t)),
        start_latency: created.zip(ready).and_then(|(c, t)| seconds(c, t)),
        delivery_lag: delivered.and_then(|t| seconds(t, now)),
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("tartan_controller");
        let reconciles = Counter::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let customruns = Family::<OutcomeLabels, Counter>::default();
        let timeouts = Family::<RetirementLabels, Counter>::default();
        registry.register("reconciles", "Reconciles of MacBuild CustomRuns", reconciles.clone());
        registry.register("reconcile_errors", "Failed reconciles by error kind", errors.clone());
        for error in ERROR_LABELS {
            let _ = errors.get_or_create(&ErrorLabels { error: error.into() });
        }
        registry.register(
            "customruns_finished",
            "CustomRuns ended by status and reason",
            customruns.clone(),
        );
        registry.register(
            "timeouts",
            "CustomRunTimedOut endings by vmRetirement",
            timeouts.clone(),
        );
        let leader = Family::<IdentityLabels, Gauge>::default();
        let refused_writes = Counter::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader Lease, 0 while it stands by",
            leader.clone(),
        );
        registry.register(
            "refused_writes",
            "API writes refused because this replica did not hold the leader Lease",
            refused_writes.clone(),
        );
        let events_dropped = Counter::default();
        registry.register(
            "events_dropped",
            "Events not published because the queue of Events waiting was full",
            events_dropped.clone(),
        );
        let retirements = Family::<RetirementReasonLabels, Counter>::default();
        registry.register(
            "customruns_by_vm_retirement",
            "CustomRuns ended by vmRetirement (deleted, unconfirmed, none) and reason",
            retirements.clone(),
        );
        let agent_lease_expired = Family::<AgentLabels, Gauge>::default();
        registry.register(
            "agent_lease_expired",
            "1 while an agent's Lease is expired (it stopped renewing), 0 while live; reported by the leader",
            agent_lease_expired.clone(),
        );
        let queue_wait = Histogram::new(QUEUE_WAIT_BUCKETS);
        registry.register(
            "build_queue_wait_seconds",
            "CustomRun created to claimed by an agent, observed when the controller ends the CustomRun",
            queue_wait.clone(),
        );
        let start_latency = Histogram::new(START_LATENCY_BUCKETS);
        registry.register(
            "build_start_latency_seconds",
            "CustomRun created to its VM ready and first step started, observed when the controller ends the CustomRun",
            start_latency.clone(),
        );
        let delivery_lag = Histogram::new(DELIVERY_LAG_BUCKETS);
        registry.register(
            "build_delivery_lag_seconds",
            "Result journaled on the Mac to the CustomRun made terminal",
            delivery_lag.clone(),
        );
        Metrics {
            queue_wait,
            start_latency,
            delivery_lag,
            reconciles,
            errors,
            customruns,
            timeouts,
            leader,
            refused_writes,
            events_dropped,
            retirements,
            agent_lease_expired,
            agent_leases: Mutex::new(AgentLeases {
                caches: Vec::new(),
                default_duration: Duration::from_secs(20),
            }),
            registry,
        }
    }
}

impl Metrics {
    /// Sets `tartan_controller_leader{identity}`.
    pub fn set_leader(&self, identity: &str, leading: bool) {
        self.leader
            .get_or_create(&IdentityLabels {
                identity: identity.to_string(),
            })
            .set(i64::from(leading));
    }

    /// Counts a CustomRun this controller ended.
    pub fn count_finish(&self, f: &Finished) {
        let vm_retirement = f.vm_retirement.as_str().to_string();
        self.customruns
            .get_or_create(&OutcomeLabels {
                status: f.status.clone(),
                reason: f.reason.clone(),
            })
            .inc();
        self.retirements
            .get_or_create(&RetirementReasonLabels {
                vm_retirement: vm_retirement.clone(),
                reason: f.reason.clone(),
            })
            .inc();
        if f.reason == crate::customrun::reason::TIMED_OUT {
            self.timeouts.get_or_create(&RetirementLabels { vm_retirement }).inc();
        }
    }

    /// Observes the [`BuildTimes`] of a CustomRun this controller just ended.
    pub fn observe_build_times(&self, times: BuildTimes) {
        for (histogram, value) in [
            (&self.queue_wait, times.queue_wait),
            (&self.start_latency, times.start_latency),
            (&self.delivery_lag, times.delivery_lag),
        ] {
            if let Some(v) = value {
                histogram.observe(v);
            }
        }
    }

    /// The agent Lease caches `tartan_controller_agent_lease_expired` is read from: the running
    /// reconcilers' (replaced when they start, emptied when this replica stops leading, so that
    /// a standby reports no stale Lease).
    pub fn watch_agent_leases(&self, caches: Vec<Store<Lease>>, default_duration: Duration) {
        *self.agent_leases.lock().unwrap_or_else(|p| p.into_inner()) = AgentLeases {
            caches,
            default_duration,
        };
    }

    /// The text exposition format.
    pub fn render(&self) -> String {
        self.agent_lease_expired.clear();
        {
            let leases = self.agent_leases.lock().unwrap_or_else(|p| p.into_inner());
            let all: Vec<_> = leases.caches.iter().flat_map(|c| c.state()).collect();
            let now = Timestamp::now();
            for (labels, expired) in agent_lease_states(all.iter().map(|l| &**l), leases.default_duration, now) {
                self.agent_lease_expired.get_or_create(&labels).set(i64::from(expired));
            }
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// Whether each agent Lease (named `tartan-agent-<agent>`) is expired at `now`, by the rule the
/// reconciler uses for `HostUnreachable` ([`liveness`]); other Leases are left out, and a Lease
/// seen twice (two namespaces' caches sharing a Lease namespace) is reported once.
pub fn agent_lease_states<'a>(
    leases: impl IntoIterator<Item = &'a Lease>,
    default_duration: Duration,
    now: Timestamp,
) -> BTreeMap<AgentLabels, bool> {
    let mut out = BTreeMap::new();
    for lease in leases {
        let Some(agent) = lease_agent(lease) else { continue };
        let expired = !matches!(
            liveness(&agent, Some(&lease_view(lease)), default_duration, now),
            Liveness::Live { .. }
        );
        let labels = AgentLabels {
            namespace: lease.metadata.namespace.clone().unwrap_or_default(),
            agent,
        };
        out.insert(labels, expired);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_render_with_labels() {
        let m = Metrics::default();
        m.reconciles.inc();
        m.errors.get_or_create(&ErrorLabels { error: "kube".into() }).inc();
        m.customruns
            .get_or_create(&OutcomeLabels {
                status: "False".into(),
                reason: "CustomRunTimedOut".into(),
            })
            .inc();
        m.timeouts
            .get_or_create(&RetirementLabels {
                vm_retirement: "unconfirmed".into(),
            })
            .inc();
        m.set_leader("tartan-controller-7d9-x2", true);
        m.refused_writes.inc();
        m.events_dropped.inc();
        let text = m.render();
        assert!(text.contains("tartan_controller_reconciles_total 1"), "{text}");
        assert!(
            text.contains("tartan_controller_leader{identity=\"tartan-controller-7d9-x2\"} 1"),
            "{text}"
        );
        assert!(text.contains("tartan_controller_refused_writes_total 1"), "{text}");
        assert!(text.contains("tartan_controller_events_dropped_total 1"), "{text}");
        // Every error kind is served from the start.
        for kind in ["timeout", "conflicts"] {
            let line = format!("tartan_controller_reconcile_errors_total{{error=\"{kind}\"}} 0");
            assert!(text.contains(&line), "no {line:?} in\n{text}");
        }
        assert!(
            text.contains("tartan_controller_reconcile_errors_total{error=\"kube\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "tartan_controller_customruns_finished_total{status=\"False\",reason=\"CustomRunTimedOut\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("tartan_controller_timeouts_total{vm_retirement=\"unconfirmed\"} 1"),
            "{text}"
        );
    }

    fn finished(status: &str, reason: &str, vm_retirement: crate::decide::VmRetirement) -> Finished {
        Finished {
            status: status.into(),
            reason: reason.into(),
            vm_retirement,
        }
    }

    #[test]
    fn every_ending_is_counted_by_vm_retirement_and_timeouts_also_apart() {
        use crate::decide::VmRetirement::{Deleted, Unconfirmed};
        let m = Metrics::default();
        m.count_finish(&finished("False", "CustomRunTimedOut", Unconfirmed));
        m.count_finish(&finished("False", "CustomRunCancelled", Unconfirmed));
        m.count_finish(&finished("False", "CustomRunCancelled", Unconfirmed));
        m.count_finish(&finished("True", "Succeeded", Deleted));
        let text = m.render();
        for line in [
            "tartan_controller_customruns_by_vm_retirement_total{vm_retirement=\"unconfirmed\",reason=\"CustomRunTimedOut\"} 1",
            "tartan_controller_customruns_by_vm_retirement_total{vm_retirement=\"unconfirmed\",reason=\"CustomRunCancelled\"} 2",
            "tartan_controller_customruns_by_vm_retirement_total{vm_retirement=\"deleted\",reason=\"Succeeded\"} 1",
            "tartan_controller_customruns_finished_total{status=\"False\",reason=\"CustomRunCancelled\"} 2",
            "tartan_controller_timeouts_total{vm_retirement=\"unconfirmed\"} 1",
        ] {
            assert!(text.contains(line), "no {line:?} in\n{text}");
        }
        assert_eq!(text.matches("tartan_controller_timeouts_total{").count(), 1, "{text}");
    }

    fn lease(ns: &str, name: &str, holder: Option<&str>, renewed: Option<&str>, secs: Option<i32>) -> Lease {
        use k8s_openapi::api::coordination::v1::LeaseSpec;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
        Lease {
            metadata: kube::api::ObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: holder.map(Into::into),
                renew_time: renewed.map(|t| MicroTime(t.parse().unwrap())),
                lease_duration_seconds: secs,
                ..Default::default()
            }),
        }
    }

    #[test]
    fn agent_leases_are_expired_by_the_host_unreachable_rule() {
        let now: Timestamp = "2026-10-05T03:00:00Z".parse().unwrap();
        let leases = [
            // Renewed 10 s ago for 15 s: live.
            lease(
                "ci",
                "tartan-agent-mac-1",
                Some("mac-1"),
                Some("2026-10-05T02:59:50Z"),
                Some(15),
            ),
            // Renewed 15 s ago for 15 s: expired at `now`.
            lease(
                "ci",
                "tartan-agent-mac-2",
                Some("mac-2"),
                Some("2026-10-05T02:59:45Z"),
                Some(15),
            ),
            // No duration: the default (20 s) applies, so 19 s ago is live.
            lease(
                "ci",
                "tartan-agent-mac-3",
                Some("mac-3"),
                Some("2026-10-05T02:59:41Z"),
                None,
            ),
            // Held by someone else, or never renewed: not evidence of the agent's renewals.
            lease(
                "ci",
                "tartan-agent-mac-4",
                Some("mac-9"),
                Some("2026-10-05T02:59:59Z"),
                Some(15),
            ),
            lease("ci", "tartan-agent-mac-5", Some("mac-5"), None, Some(15)),
            // Not an agent Lease (the controllers' own): left out.
            lease(
                "ci",
                "tartan-controller",
                Some("ctl-a"),
                Some("2026-10-05T02:59:59Z"),
                Some(15),
            ),
            // The same Lease seen through a second namespace's cache: once.
            lease(
                "ci",
                "tartan-agent-mac-1",
                Some("mac-1"),
                Some("2026-10-05T02:59:50Z"),
                Some(15),
            ),
            lease(
                "other",
                "tartan-agent-mac-1",
                Some("mac-1"),
                Some("2026-10-05T02:00:00Z"),
                Some(15),
            ),
        ];
        let got: Vec<(String, String, bool)> = agent_lease_states(&leases, Duration::from_secs(20), now)
            .into_iter()
            .map(|(l, e)| (l.namespace, l.agent, e))
            .collect();
        let want: Vec<(String, String, bool)> = [
            ("ci", "mac-1", false),
            ("ci", "mac-2", true),
            ("ci", "mac-3", false),
            ("ci", "mac-4", true),
            ("ci", "mac-5", true),
            ("other", "mac-1", true),
        ]
        .iter()
        .map(|(n, a, e)| (n.to_string(), a.to_string(), *e))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn agent_lease_expired_is_rendered_from_the_watched_caches_and_gone_once_they_are_dropped() {
        use kube::runtime::reflector::store::Writer;
        use kube::runtime::watcher::Event;
        let m = Metrics::default();
        let mut writer: Writer<Lease> = Writer::default();
        writer.apply_watcher_event(&Event::Apply(lease(
            "ci",
            "tartan-agent-mac-2",
            Some("mac-2"),
            Some("2020-01-01T00:00:00Z"),
            Some(15),
        )));
        m.watch_agent_leases(vec![writer.as_reader()], Duration::from_secs(20));
        let line = "tartan_controller_agent_lease_expired{namespace=\"ci\",agent=\"mac-2\"} 1";
        assert!(m.render().contains(line), "no {line:?} in\n{}", m.render());
        // Leadership lost: a standby reports no Lease.
        m.watch_agent_leases(Vec::new(), Duration::from_secs(20));
        assert!(
            !m.render().contains("tartan_controller_agent_lease_expired{"),
            "{}",
            m.render()
        );
    }

    fn status_with(conditions: &[(ConditionType, ConditionStatus, &str)]) -> MacBuildStatus {
        let mut status = MacBuildStatus::default();
        for (type_, cs, at) in conditions {
            status.set_condition(tartan_api::Condition::new(
                *type_,
                *cs,
                tartan_api::ConditionReason::SlotFree,
                "",
                at.parse().unwrap(),
            ));
        }
        status
    }

    #[test]
    fn build_times_come_from_the_conditions_that_turned_and_are_never_negative() {
        use ConditionStatus::{False, True, Unknown};
        use ConditionType::{Claimed, Succeeded, VMReady};
        let created: Timestamp = "2026-10-05T02:00:00Z".parse().unwrap();
        let now: Timestamp = "2026-10-05T02:10:00Z".parse().unwrap();
        let ended = [
            (Claimed, True, "2026-10-05T02:00:30Z"),
            (VMReady, True, "2026-10-05T02:01:40.5Z"),
            (Succeeded, True, "2026-10-05T02:09:58Z"),
        ];
        #[allow(clippy::type_complexity)]
        let cases: &[(&str, Option<Timestamp>, Option<MacBuildStatus>, BuildTimes)] = &[
            (
                "a build that ran and was delivered",
                Some(created),
                Some(status_with(&ended)),
                BuildTimes {
                    queue_wait: Some(30.0),
                    start_latency: Some(100.5),
                    delivery_lag: Some(2.0),
                },
            ),
            (
                "cancelled before any claim: nothing to observe",
                Some(created),
                None,
                BuildTimes {
                    queue_wait: None,
                    start_latency: None,
                    delivery_lag: None,
                },
            ),
            (
                "claimed, never ready, no result yet (timed out): only the queue wait",
                Some(created),
                Some(status_with(&[
                    (Claimed, True, "2026-10-05T02:00:30Z"),
                    (VMReady, Unknown, "2026-10-05T02:00:31Z"),
                    (Succeeded, Unknown, "2026-10-05T02:00:31Z"),
                ])),
                BuildTimes {
                    queue_wait: Some(30.0),
                    start_latency: None,
                    delivery_lag: None,
                },
            ),
            (
                "failed after boot: the VM no longer ready, a False result still delivered",
                Some(created),
                Some(status_with(&[
                    (Claimed, True, "2026-10-05T02:00:30Z"),
                    (VMReady, False, "2026-10-05T02:05:00Z"),
                    (Succeeded, False, "2026-10-05T02:09:00Z"),
                ])),
                BuildTimes {
                    queue_wait: Some(30.0),
                    start_latency: None,
                    delivery_lag: Some(60.0),
                },
            ),
            (
                "the Mac's clock ahead of the controller's: 0, not negative",
                Some("2026-10-05T02:00:40Z".parse().unwrap()),
                Some(status_with(&[
                    (Claimed, True, "2026-10-05T02:00:30Z"),
                    (Succeeded, True, "2026-10-05T02:10:05Z"),
                ])),
                BuildTimes {
                    queue_wait: Some(0.0),
                    start_latency: None,
                    delivery_lag: Some(0.0),
                },
            ),
            (
                "no creation time (never from an API server, but not a panic)",
                None,
                Some(status_with(&ended)),
                BuildTimes {
                    queue_wait: None,
                    start_latency: None,
                    delivery_lag: Some(2.0),
                },
            ),
        ];
        for (what, created, status, want) in cases {
            assert_eq!(build_times(*created, status.as_ref(), now), *want, "{what}");
        }
    }

    /// Adversary finding: the conditions' times are the agent's (a hostile agent, or a Mac
    /// whose clock is off by a year): only negative times are refused, so one status claiming
    /// year 9999 adds ~2.5e11 s to `build_queue_wait_seconds_sum` for good (every average and
    /// rate of it on the dashboard is garbage until the controller restarts). A time beyond any
    /// build's possible length should not be observed.
    #[test]
    fn an_absurd_time_from_the_agent_is_not_observed() {
        use ConditionStatus::True;
        use ConditionType::{Claimed, Succeeded, VMReady};
        let created: Timestamp = "2026-10-05T02:00:00Z".parse().unwrap();
        let now: Timestamp = "2026-10-05T02:10:00Z".parse().unwrap();
        let status = status_with(&[
            (Claimed, True, "9999-01-01T00:00:00Z"),
            (VMReady, True, "9999-01-01T00:00:00Z"),
            (Succeeded, True, "1970-01-01T00:00:00Z"),
        ]);
        let times = build_times(Some(created), Some(&status), now);
        let week = 7.0 * 86_400.0;
        for (what, t) in [
            ("queue wait", times.queue_wait),
            ("start latency", times.start_latency),
            ("delivery lag", times.delivery_lag),
        ] {
            assert!(t.is_none_or(|s| s <= week), "{what} observed as {t:?} s");
        }
    }

    #[test]
    fn build_times_are_served_as_histograms_from_the_start() {
        let m = Metrics::default();
        let before = m.render();
        for family in [
            "build_queue_wait_seconds",
            "build_start_latency_seconds",
            "build_delivery_lag_seconds",
        ] {
            let line = format!("# TYPE tartan_controller_{family} histogram");
            assert!(before.contains(&line), "no {line:?} in\n{before}");
        }
        m.observe_build_times(BuildTimes {
            queue_wait: Some(30.0),
            start_latency: None,
            delivery_lag: Some(0.3),
        });
        let text = m.render();
        for line in [
            "tartan_controller_build_queue_wait_seconds_count 1",
            "tartan_controller_build_queue_wait_seconds_bucket{le=\"30.0\"} 1",
            "tartan_controller_build_queue_wait_seconds_bucket{le=\"15.0\"} 0",
            "tartan_controller_build_start_latency_seconds_count 0",
            "tartan_controller_build_delivery_lag_seconds_bucket{le=\"0.5\"} 1",
            "tartan_controller_build_delivery_lag_seconds_bucket{le=\"0.25\"} 0",
        ] {
            assert!(text.contains(line), "no {line:?} in\n{text}");
        }
    }
}
