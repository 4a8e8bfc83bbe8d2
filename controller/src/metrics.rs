//! Prometheus metrics served on `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
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
        Metrics {
            reconciles,
            errors,
            customruns,
            timeouts,
            registry,
        }
    }
}

impl Metrics {
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
        let text = m.render();
        assert!(text.contains("tartan_controller_reconciles_total 1"), "{text}");
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
