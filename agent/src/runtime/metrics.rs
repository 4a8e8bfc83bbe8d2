//! `/metrics` (Prometheus text) and `/healthz` on the configured address (loopback by default).
//! Values are read from the agent's state at scrape time, so there is nothing to keep in step.

use super::core::Shared;
use crate::cluster::lease::LeaseState;
use crate::journal::{Failing, JournalHealth};
use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::Arc;
use tartan_api::AttemptState;
use tokio::sync::watch;
use tokio::time::Instant;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: String,
}

struct Scrape {
    shared: Arc<Shared>,
    lease: watch::Receiver<LeaseState>,
    /// Read without the core lock, so `/healthz` answers even while a journal write hangs.
    journal: JournalHealth,
}

/// Starts serving; the returned task ends with the agent.
pub async fn serve(
    shared: Arc<Shared>,
    lease: watch::Receiver<LeaseState>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let address = shared.config.metrics_address;
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("binding the metrics address {address} (config key metrics_address)"))?;
    let journal = shared.core.lock().await.journal.health();
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(Arc::new(Scrape { shared, lease, journal }));
    Ok(tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "metrics server stopped");
        }
    }))
}

async fn healthz(State(scrape): State<Arc<Scrape>>) -> (StatusCode, String) {
    let recovery = scrape.shared.recovery_waits.lock().expect("not poisoned").clone();
    health_answer(scrape.journal.failing(), recovery)
}

/// 503 with the reasons while the journal cannot be written (the agent claims nothing then) or
/// recovery still waits for the cluster.
fn health_answer(journal: Option<Failing>, recovery_waits: Option<String>) -> (StatusCode, String) {
    let mut why = Vec::new();
    if let Some(f) = journal {
        why.push(format!(
            "journal cannot be written since {} ({} failed tries): {}; no new build is claimed until a write works",
            f.since, f.failures, f.error
        ));
    }
    why.extend(recovery_waits);
    if why.is_empty() {
        (StatusCode::OK, "ok".into())
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, why.join("\n") + "\n")
    }
}

async fn metrics(State(scrape): State<Arc<Scrape>>) -> String {
    let mut registry = Registry::with_prefix("tartan_agent");
    let attempts = Family::<StateLabels, Gauge>::default();
    let slots_busy = Gauge::<i64>::default();
    let slots = Gauge::<i64>::default();
    let unknown_vms = Gauge::<i64>::default();
    let journal_next_seq = Gauge::<i64>::default();
    let lease_fresh = Gauge::<i64>::default();
    let recovery_waits = Gauge::<i64>::default();
    let journal_failing = Gauge::<i64>::default();
    registry.register(
        "journal_failing",
        "1 while journal writes fail (no new build is claimed)",
        journal_failing.clone(),
    );
    registry.register("attempts", "Attempts known to the journal, by state", attempts.clone());
    registry.register("slots", "Configured VM slots", slots.clone());
    registry.register(
        "slots_busy",
        "Slots held by attempts, quarantined VMs or reservations",
        slots_busy.clone(),
    );
    registry.register(
        "unknown_vms",
        "Quarantined VMs with the prefix and no attempt",
        unknown_vms.clone(),
    );
    registry.register(
        "journal_next_seq",
        "Sequence number of the next journal record",
        journal_next_seq.clone(),
    );
    registry.register(
        "lease_fresh",
        "1 while the Lease is fresh enough to claim new builds",
        lease_fresh.clone(),
    );
    registry.register(
        "recovery_waits_for_cluster",
        "1 while the part of recovery that needs the cluster waits for it to answer",
        recovery_waits.clone(),
    );
    recovery_waits.set(i64::from(
        scrape.shared.recovery_waits.lock().expect("not poisoned").is_some(),
    ));
    {
        let core = scrape.shared.core.lock().await;
        for state in AttemptState::ALL {
            let n = core.attempts.values().filter(|a| a.state == *state).count();
            attempts
                .get_or_create(&StateLabels {
                    state: state.as_str().to_string(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        slots.set(i64::from(scrape.shared.config.slots));
        slots_busy.set(i64::try_from(core.slot_holders().len()).unwrap_or(i64::MAX));
        unknown_vms.set(i64::try_from(core.unknown.len()).unwrap_or(i64::MAX));
        journal_next_seq.set(i64::try_from(core.journal.next_seq()).unwrap_or(i64::MAX));
    }
    lease_fresh.set(i64::from(scrape.lease.borrow().can_claim(Instant::now())));
    journal_failing.set(i64::from(scrape.journal.failing().is_some()));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).expect("writing to a String cannot fail");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn healthz_is_red_with_the_reason_while_the_journal_fails() {
        assert_eq!(health_answer(None, None), (StatusCode::OK, "ok".to_string()));
        let (code, body) = health_answer(
            Some(Failing {
                since: "2026-10-05T02:41:40Z".parse().unwrap(),
                error: "creating a journal file: Not a directory".into(),
                failures: 3,
            }),
            None,
        );
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        for needle in [
            "since 2026-10-05T02:41:40Z",
            "3 failed tries",
            "Not a directory",
            "no new build is claimed",
        ] {
            assert!(body.contains(needle), "{needle:?} not in {body}");
        }
    }

    #[test]
    fn healthz_is_red_while_recovery_waits_for_the_cluster() {
        let why = "recovery waits for the API server https://10.0.0.1:6443/: connection refused".to_string();
        let (code, body) = health_answer(None, Some(why.clone()));
        assert_eq!((code, body), (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")));
    }
}
