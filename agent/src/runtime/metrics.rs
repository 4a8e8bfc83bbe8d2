//! `/metrics` (Prometheus text) and `/healthz` on the configured address (loopback by default).
//! Values are read from the agent's state ([`super::core::Builds::gauges`]) at scrape time, so
//! there is nothing to keep in step; this module owns only the watchdog record's tally.

use super::core::Shared;
use super::watchdog_tally::WatchdogTally;
use crate::cluster::lease::LeaseState;
use crate::host::disk::Pressure;
use crate::journal::{Failing, JournalHealth};
use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::Arc;
use tokio::sync::watch;
use tokio::time::Instant;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ActionLabels {
    action: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FsLabels {
    fs: String,
}

struct Scrape {
    shared: Arc<Shared>,
    lease: watch::Receiver<LeaseState>,
    /// Read without the core lock, so `/healthz` answers even while a journal write hangs.
    journal: JournalHealth,
    watchdog: Arc<std::sync::Mutex<WatchdogTally>>,
}

/// Starts serving; the returned task ends with the agent.
pub async fn serve(
    shared: Arc<Shared>,
    lease: watch::Receiver<LeaseState>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let address = shared.config.metrics_address;
    let limits = shared.config.metrics_limits;
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("binding the metrics address {address} (config key metrics_address)"))?;
    let journal = shared.builds.journal_health().await;
    let watchdog = Arc::new(std::sync::Mutex::new(WatchdogTally::new(&shared.config.state_dir)));
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(Arc::new(Scrape {
            shared,
            lease,
            journal,
            watchdog,
        }));
    let bound = listener.local_addr().map_or(address, |a| a);
    // The bound address (port 0 picks one), in the message so that tests can find it.
    tracing::info!("serving /metrics, /healthz on {bound}");
    Ok(tokio::spawn(tartan_serve::serve(
        "the agent's metrics server",
        listener,
        app,
        limits,
        Arc::default(),
    )))
}

/// The warm pool's figures (docs/warm-pool.md): what it holds, what it served and what it cost.
fn register_pool(registry: &mut Registry, tally: super::core::PoolTally) {
    let gauge = |v: usize| {
        let g = Gauge::<i64>::default();
        g.set(i64::try_from(v).unwrap_or(i64::MAX));
        g
    };
    let counter = |v: u64| {
        let c = Counter::<u64>::default();
        c.inc_by(v);
        c
    };
    registry.register(
        "warm_vms_ready",
        "Warm VMs booted and free for a build",
        gauge(tally.ready),
    );
    registry.register(
        "warm_vms_preparing",
        "Warm VMs being cloned or booted",
        gauge(tally.preparing),
    );
    registry.register(
        "warm_adoptions",
        "Builds started in a warm VM (no clone, no boot)",
        counter(tally.adoptions),
    );
    registry.register(
        "warm_misses",
        "Builds started cold while the pool was configured",
        counter(tally.misses),
    );
    registry.register(
        "warm_evictions",
        "Warm VMs deleted for a build of another image",
        counter(tally.evictions),
    );
    let idle = Counter::<f64, std::sync::atomic::AtomicU64>::default();
    idle.inc_by(tally.idle_slot_seconds);
    registry.register(
        "warm_idle_slot_seconds",
        "Slot-seconds held by warm VMs without a build (booting or waiting)",
        idle,
    );
}

async fn healthz(State(scrape): State<Arc<Scrape>>) -> (StatusCode, String) {
    let recovery = scrape.shared.recovery_waits.lock().expect("not poisoned").clone();
    let disk = scrape.shared.disk.check().pressure;
    health_answer(scrape.journal.failing(), recovery, disk.as_ref())
}

/// 503 with the reasons while the agent claims no new build for a reason of its own host: the
/// journal cannot be written, recovery still waits for the cluster, or the disk is below the
/// floor. Builds already running go on in each case; nothing restarts the agent on it.
fn health_answer(
    journal: Option<Failing>,
    recovery_waits: Option<String>,
    disk: Option<&Pressure>,
) -> (StatusCode, String) {
    let mut why = Vec::new();
    if let Some(f) = journal {
        why.push(format!(
            "journal cannot be written since {} ({} failed tries): {}; no new build is claimed until a write works",
            f.since, f.failures, f.error
        ));
    }
    why.extend(recovery_waits);
    if let Some(p) = disk {
        why.push(format!(
            "disk pressure: {}; no new build is claimed until space is freed (running builds go on)",
            p.describe()
        ));
    }
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
    let disk_free = Family::<FsLabels, Gauge>::default();
    let disk_min_free = Gauge::<i64>::default();
    let disk_pressure = Gauge::<i64>::default();
    registry.register(
        "disk_free_bytes",
        "Free bytes on the filesystem of state_dir and of tart_home (absent while unreadable)",
        disk_free.clone(),
    );
    registry.register(
        "disk_min_free_bytes",
        "The disk floor ([disk] min_free_gib; 0 = off)",
        disk_min_free.clone(),
    );
    registry.register(
        "disk_pressure",
        "1 while a filesystem is below the disk floor (no new build is claimed)",
        disk_pressure.clone(),
    );
    let disk = scrape.shared.disk.check();
    for r in &disk.readings {
        if let Ok(free) = r.free {
            disk_free
                .get_or_create(&FsLabels {
                    fs: r.fs.as_str().to_string(),
                })
                .set(i64::try_from(free).unwrap_or(i64::MAX));
        }
    }
    disk_min_free.set(i64::try_from(scrape.shared.disk.min_free()).unwrap_or(i64::MAX));
    disk_pressure.set(i64::from(disk.pressure.is_some()));
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
        let gauges = scrape.shared.builds.gauges().await;
        for (state, n) in gauges.by_state {
            attempts
                .get_or_create(&StateLabels {
                    state: state.as_str().to_string(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        slots.set(i64::from(scrape.shared.config.slots));
        slots_busy.set(i64::try_from(gauges.slots_busy).unwrap_or(i64::MAX));
        unknown_vms.set(i64::try_from(gauges.unknown_vms).unwrap_or(i64::MAX));
        journal_next_seq.set(i64::try_from(gauges.journal_next_seq).unwrap_or(i64::MAX));
    }
    lease_fresh.set(i64::from(scrape.lease.borrow().can_claim(Instant::now())));
    register_pool(&mut registry, scrape.shared.builds.pool_tally().await);
    let watchdog_actions = Family::<ActionLabels, Counter>::default();
    registry.register(
        "watchdog_actions",
        "Lines of the watchdog's record (watchdog.jsonl) by action: deleted is a VM the agent did not retire in time",
        watchdog_actions.clone(),
    );
    let tally = Arc::clone(&scrape.watchdog);
    let counted = tokio::task::spawn_blocking(move || {
        let mut tally = tally.lock().unwrap_or_else(|p| p.into_inner());
        let read = tally.catch_up();
        (read, tally.counts().clone())
    })
    .await;
    match counted {
        Ok((read, counts)) => {
            if let Err(error) = read {
                tracing::warn!(%error, "reading the watchdog's record for /metrics; its counts stay as last read");
            }
            for (action, n) in counts {
                watchdog_actions
                    .get_or_create(&ActionLabels {
                        action: action.to_string(),
                    })
                    .inc_by(n);
            }
        }
        Err(error) => tracing::warn!(%error, "counting the watchdog's record for /metrics"),
    }
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
        assert_eq!(health_answer(None, None, None), (StatusCode::OK, "ok".to_string()));
        let (code, body) = health_answer(
            Some(Failing {
                since: "2026-10-05T02:41:40Z".parse().unwrap(),
                error: "creating a journal file: Not a directory".into(),
                failures: 3,
            }),
            None,
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
        let (code, body) = health_answer(None, Some(why.clone()), None);
        assert_eq!((code, body), (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")));
    }

    #[test]
    fn healthz_is_red_with_the_filesystem_and_its_free_space_under_disk_pressure() {
        let pressure = Pressure {
            min_free: 20 << 30,
            below: vec![(crate::host::disk::Filesystem::StateDir, "/var/tartan".into(), 3 << 30)],
        };
        let (code, body) = health_answer(None, None, Some(&pressure));
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        for needle in [
            "disk pressure",
            "state_dir /var/tartan has 3.0 GiB free",
            "20.0 GiB",
            "running builds go on",
        ] {
            assert!(body.contains(needle), "{needle:?} not in {body}");
        }
    }
}
