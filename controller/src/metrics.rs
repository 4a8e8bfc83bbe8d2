//! Prometheus metrics served on `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

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
    registry: Registry,
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
        Metrics {
            reconciles,
            errors,
            customruns,
            timeouts,
            leader,
            refused_writes,
            events_dropped,
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

    /// The text exposition format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
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
}
