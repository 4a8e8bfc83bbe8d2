//! Status delivery: every journaled transition's status snapshot is written to its MacBuild after
//! the journal sync, fenced on the claim.
//!
//! The write is a JSON patch on the status subresource: `test /metadata/uid`, `test
//! /status/claim/holder`, `test /status/claim/attempt`, then `replace /status` with the snapshot
//! (whose `journalSeq` is the record's seq). A stale attempt's write therefore fails its test
//! (422) and changes nothing.
//!
//! Per MacBuild, one worker delivers in order and only the newest submitted snapshot matters: a
//! newer submission replaces one still waiting, and a snapshot older than one already delivered
//! is never sent. Each MacBuild has its own worker, so one build's refused writes never hold up
//! another's. At most `concurrency` writes (with their fresh reads) are in flight at once across
//! all workers: a burst (every undelivered status after a restart) queues here, not at the API
//! server, where the agent's Lease renewal would wait behind it. A worker waiting out a backoff
//! holds no permit.
//!
//! A 409/422 is resolved by reading the MacBuild again: if the claim is no longer this holder and
//! attempt, the attempt is stale (*fenced out*): its deliveries stop and it is reported; if the
//! claim is still ours, the write was refused (an admission policy's `Invalid`), like a 403. A
//! refused or failed write is retried with capped exponential backoff and jitter, until it lands,
//! a newer snapshot replaces it, or the MacBuild is gone.

use super::{CallError, op_replace, op_test, patch_params, timed};
use crate::config::Config;
use crate::record::BuildRef;
use json_patch::Patch as JsonPatch;
use kube::api::{Api, Patch};
use serde_json::json;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tartan_api::{Claim, MacBuild, MacBuildStatus};
use tokio::sync::{Notify, Semaphore, watch};

/// What delivery needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeliveryConfig {
    /// Limit of one API request.
    pub api_timeout: Duration,
    /// First wait before a retry; doubles per try.
    pub retry_initial: Duration,
    /// Longest wait between tries.
    pub retry_max: Duration,
    /// Writes in flight at once, across all MacBuilds.
    pub concurrency: usize,
}

impl DeliveryConfig {
    pub fn from_config(config: &Config) -> DeliveryConfig {
        DeliveryConfig {
            api_timeout: config.timing.api_timeout,
            retry_initial: config.timing.status_retry_initial,
            retry_max: config.timing.status_retry_max,
            concurrency: config.status_concurrency,
        }
    }
}

/// The status write for `snapshot` at journal record `seq`: tests on uid, holder and attempt,
/// then the whole status. `None` if the snapshot names no claim (it could not be fenced).
pub fn status_patch(uid: &str, snapshot: &MacBuildStatus, seq: u64) -> Option<JsonPatch> {
    let claim = snapshot.claim.as_ref()?;
    let mut status = snapshot.clone();
    status.journal_seq = Some(seq);
    Some(JsonPatch(vec![
        op_test(&["metadata", "uid"], json!(uid)),
        op_test(&["status", "claim", "holder"], json!(claim.holder)),
        op_test(&["status", "claim", "attempt"], json!(claim.attempt)),
        op_replace(&["status"], json!(status)),
    ]))
}

/// The wait before try `tries + 1` (after `tries` failed ones): `initial * 2^(tries-1)`, capped at
/// `max`, then scaled by `jitter` in [0.5, 1.0] so agents refused together do not retry together.
pub fn backoff(cfg: &DeliveryConfig, tries: u32, jitter: f64) -> Duration {
    let exp = tries.saturating_sub(1).min(31);
    let base = cfg.retry_initial.saturating_mul(1u32 << exp).min(cfg.retry_max);
    base.mul_f64(jitter.clamp(0.5, 1.0))
}

/// A jitter factor in [0.5, 1.0) from the process's random hasher keys.
fn jitter() -> f64 {
    let bits = std::collections::hash_map::RandomState::new().build_hasher().finish();
    0.5 + (bits >> 11) as f64 / (1u64 << 53) as f64 * 0.5
}

/// A write that landed, or why it will never land.
#[derive(Clone, Debug, PartialEq)]
pub enum Delivered {
    /// The MacBuild now shows the snapshot at this seq.
    Written,
    /// The claim is no longer this holder and attempt: this attempt's writes are stale.
    FencedOut { now: Option<Claim> },
    /// The MacBuild is gone (or its name belongs to a new MacBuild).
    Gone,
}

/// A write that did not land and may be retried.
#[derive(Debug, thiserror::Error)]
pub enum DeliveryError {
    /// The API refused it (403, or 422 with our claim still in place: an admission policy).
    #[error("refused: {0}")]
    Refused(CallError),
    /// It failed on the way (timeout, connection, 5xx, ...).
    #[error("failed: {0}")]
    Failed(CallError),
    /// The snapshot names no claim to fence the write with; this is a bug in the caller.
    #[error("the snapshot has no claim to fence the write with")]
    NoClaim,
}

/// One try at writing `snapshot` (as of journal record `seq`) to `build`. Recovery calls it to
/// redeliver a saved status; the workers call it for every try.
pub async fn deliver_once(
    client: &kube::Client,
    api_timeout: Duration,
    build: &BuildRef,
    snapshot: &MacBuildStatus,
    seq: u64,
) -> Result<Delivered, DeliveryError> {
    let claim = snapshot.claim.as_ref().ok_or(DeliveryError::NoClaim)?;
    let patch = status_patch(&build.uid, snapshot, seq).ok_or(DeliveryError::NoClaim)?;
    let api: Api<MacBuild> = Api::namespaced(client.clone(), &build.namespace);
    crate::crash_point!("status.write.before");
    let written = timed(
        api_timeout,
        api.patch_status(&build.name, &patch_params(), &Patch::Json::<()>(patch)),
    )
    .await;
    crate::crash_point!("status.write.after");
    match written {
        Ok(_) => Ok(Delivered::Written),
        Err(e) if e.is_not_found() => Ok(Delivered::Gone),
        Err(e) if e.is_precondition() => {
            // Which test failed, if any, only a fresh read tells.
            let fresh = match timed(api_timeout, api.get_opt(&build.name)).await {
                Ok(fresh) => fresh,
                Err(_) => return Err(DeliveryError::Failed(e)),
            };
            let Some(fresh) = fresh.filter(|m| m.metadata.uid.as_deref() == Some(build.uid.as_str())) else {
                return Ok(Delivered::Gone);
            };
            let now = fresh.status.and_then(|s| s.claim);
            match &now {
                Some(c) if c.holder == claim.holder && c.attempt == claim.attempt => Err(DeliveryError::Refused(e)),
                _ => Ok(Delivered::FencedOut { now }),
            }
        }
        Err(e) if e.code() == Some(403) => Err(DeliveryError::Refused(e)),
        Err(e) => Err(DeliveryError::Failed(e)),
    }
}

/// Delivery of one MacBuild, as observed through [`DeliveryHandle::progress`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Progress {
    /// The newest seq the MacBuild is known to show.
    pub delivered: Option<u64>,
    /// The seq waiting to be written (or being retried), if any.
    pub pending: Option<u64>,
    /// Tries that did not land, in total.
    pub failed_tries: u64,
    /// The last refusal or failure, cleared when a write lands.
    pub last_error: Option<String>,
    /// An attempt found stale: its snapshots are no longer written. `(attempt id, claim found)`.
    pub fenced_out: Option<(String, Option<Claim>)>,
    /// The MacBuild is gone; nothing more is written to it.
    pub gone: bool,
}

struct Job {
    snapshot: MacBuildStatus,
    seq: u64,
}

struct BuildSlot {
    job: Option<Job>,
    /// The seq being written right now.
    in_flight: Option<u64>,
    running: bool,
    wake: Arc<Notify>,
    progress: watch::Sender<Progress>,
}

impl BuildSlot {
    fn new() -> BuildSlot {
        BuildSlot {
            job: None,
            in_flight: None,
            running: false,
            wake: Arc::new(Notify::new()),
            progress: watch::Sender::new(Progress::default()),
        }
    }
}

type Slots = Arc<Mutex<HashMap<BuildRef, BuildSlot>>>;

/// Submits snapshots and observes their delivery; cheap to clone.
#[derive(Clone)]
pub struct DeliveryHandle {
    client: kube::Client,
    cfg: DeliveryConfig,
    slots: Slots,
    /// One permit per write in flight.
    permits: Arc<Semaphore>,
}

/// Entry point: `Delivery::spawn(client, cfg)`.
pub struct Delivery;

impl Delivery {
    /// A delivery service on the current tokio runtime; workers start per MacBuild on demand.
    pub fn spawn(client: kube::Client, cfg: DeliveryConfig) -> DeliveryHandle {
        DeliveryHandle {
            permits: Arc::new(Semaphore::new(cfg.concurrency.max(1))),
            client,
            cfg,
            slots: Arc::default(),
        }
    }
}

impl DeliveryHandle {
    /// Queues `snapshot` (the status as of journal record `seq`) for `build`. It replaces a
    /// snapshot still waiting; a seq not newer than one already delivered or queued is ignored, as
    /// is a snapshot of an attempt found stale or of a MacBuild that is gone.
    pub fn submit(&self, build: &BuildRef, snapshot: MacBuildStatus, seq: u64) {
        let mut slots = self.slots.lock().expect("delivery slots lock");
        let slot = slots.entry(build.clone()).or_insert_with(BuildSlot::new);
        let progress = slot.progress.borrow().clone();
        let newest = progress
            .delivered
            .max(slot.job.as_ref().map(|j| j.seq))
            .max(slot.in_flight);
        let attempt = snapshot.claim.as_ref().map(|c| c.attempt.as_str());
        let stale = progress
            .fenced_out
            .as_ref()
            .is_some_and(|(a, _)| Some(a.as_str()) == attempt);
        if progress.gone || stale || newest.is_some_and(|n| seq <= n) {
            tracing::debug!("status of {build} (record {seq}) not queued: superseded, stale or gone");
            return;
        }
        slot.job = Some(Job { snapshot, seq });
        slot.progress.send_modify(|p| p.pending = Some(seq));
        slot.wake.notify_one();
        if !slot.running {
            slot.running = true;
            tokio::spawn(worker(
                self.client.clone(),
                self.cfg.clone(),
                self.slots.clone(),
                self.permits.clone(),
                build.clone(),
            ));
        }
    }

    /// The delivery progress of `build`.
    pub fn progress(&self, build: &BuildRef) -> watch::Receiver<Progress> {
        let mut slots = self.slots.lock().expect("delivery slots lock");
        slots
            .entry(build.clone())
            .or_insert_with(BuildSlot::new)
            .progress
            .subscribe()
    }

    /// The newest seq `build` is known to show.
    pub fn delivered(&self, build: &BuildRef) -> Option<u64> {
        self.progress(build).borrow().delivered
    }

    /// Drops what is kept about `build` (once it is finished and released). A snapshot still
    /// waiting is abandoned.
    pub fn forget(&self, build: &BuildRef) {
        let mut slots = self.slots.lock().expect("delivery slots lock");
        if let Some(slot) = slots.remove(build) {
            slot.wake.notify_one();
        }
    }
}

async fn worker(client: kube::Client, cfg: DeliveryConfig, slots: Slots, permits: Arc<Semaphore>, build: BuildRef) {
    let mut tries: u32 = 0;
    loop {
        // The permit comes first, so the job taken below is the newest when the write goes out.
        let Ok(permit) = permits.clone().acquire_owned().await else {
            return;
        };
        // Take the newest job, or end (under the lock, so a submit either sees us running or
        // starts a new worker).
        let (job, wake, progress) = {
            let mut map = slots.lock().expect("delivery slots lock");
            let Some(slot) = map.get_mut(&build) else { return };
            slot.in_flight = None;
            match slot.job.take() {
                Some(job) => {
                    slot.in_flight = Some(job.seq);
                    (job, slot.wake.clone(), slot.progress.clone())
                }
                None => {
                    slot.running = false;
                    return;
                }
            }
        };
        let attempt = job
            .snapshot
            .claim
            .as_ref()
            .map(|c| c.attempt.clone())
            .unwrap_or_default();
        let result = deliver_once(&client, cfg.api_timeout, &build, &job.snapshot, job.seq).await;
        drop(permit);
        let put_back = |job: Job| {
            let mut map = slots.lock().expect("delivery slots lock");
            if let Some(slot) = map.get_mut(&build)
                && slot.job.is_none()
            {
                slot.job = Some(job);
            }
        };
        match result {
            Ok(Delivered::Written) => {
                tries = 0;
                if progress.borrow().last_error.is_some() {
                    tracing::info!("status of {build} (record {}) delivered after retries", job.seq);
                }
                progress.send_modify(|p| {
                    p.delivered = p.delivered.max(Some(job.seq));
                    if p.pending == Some(job.seq) {
                        p.pending = None;
                    }
                    p.last_error = None;
                });
            }
            Ok(Delivered::FencedOut { now }) => {
                tries = 0;
                let found = now.as_ref().map_or("no claim".to_string(), |c| {
                    format!("claim {} by {}", c.attempt, c.holder)
                });
                tracing::error!(
                    "status of {build} (record {}) fenced out: attempt {attempt} is stale, the MacBuild shows {found}; \
                     no more status writes for that attempt",
                    job.seq
                );
                progress.send_modify(|p| {
                    p.fenced_out = Some((attempt.clone(), now.clone()));
                    p.pending = None;
                });
                // A queued snapshot of the same attempt is just as stale.
                let mut map = slots.lock().expect("delivery slots lock");
                if let Some(slot) = map.get_mut(&build)
                    && slot
                        .job
                        .as_ref()
                        .is_some_and(|j| j.snapshot.claim.as_ref().map(|c| &c.attempt) == Some(&attempt))
                {
                    slot.job = None;
                }
            }
            Ok(Delivered::Gone) => {
                tracing::warn!(
                    "status of {build} (record {}) not delivered: the MacBuild is gone",
                    job.seq
                );
                progress.send_modify(|p| {
                    p.gone = true;
                    p.pending = None;
                });
                if let Some(slot) = slots.lock().expect("delivery slots lock").get_mut(&build) {
                    slot.job = None;
                }
            }
            Err(DeliveryError::NoClaim) => {
                tracing::error!(
                    "status of {build} (record {}) not delivered: the snapshot names no claim (a bug)",
                    job.seq
                );
                progress.send_modify(|p| p.pending = None);
            }
            Err(e) => {
                tries = tries.saturating_add(1);
                let wait = backoff(&cfg, tries, jitter());
                tracing::error!(
                    "status of {build} (record {}) {e}; will retry in {:.1}s (try {tries})",
                    job.seq,
                    wait.as_secs_f64()
                );
                progress.send_modify(|p| {
                    p.failed_tries += 1;
                    p.last_error = Some(e.to_string());
                });
                let seq = job.seq;
                put_back(job);
                // A newer snapshot (or `forget`) cuts the wait short.
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = wake.notified() => tracing::debug!("status of {build}: newer than record {seq} submitted"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tartan_api::Phase;

    fn cfg() -> DeliveryConfig {
        DeliveryConfig {
            api_timeout: Duration::from_secs(4),
            retry_initial: Duration::from_secs(1),
            retry_max: Duration::from_secs(30),
            concurrency: 8,
        }
    }

    #[test]
    fn status_patch_is_fenced_on_uid_holder_and_attempt_and_sets_journal_seq() {
        let snapshot = MacBuildStatus {
            phase: Some(Phase::Running),
            claim: Some(Claim {
                holder: "mac-mini-07".into(),
                attempt: "b#2".into(),
                epoch: 2,
            }),
            journal_seq: Some(1),
            ..Default::default()
        };
        let p = serde_json::to_value(status_patch("uid-1", &snapshot, 120).unwrap()).unwrap();
        assert_eq!(
            p,
            json!([
                {"op": "test", "path": "/metadata/uid", "value": "uid-1"},
                {"op": "test", "path": "/status/claim/holder", "value": "mac-mini-07"},
                {"op": "test", "path": "/status/claim/attempt", "value": "b#2"},
                {"op": "replace", "path": "/status", "value": {
                    "phase": "Running",
                    "claim": {"holder": "mac-mini-07", "attempt": "b#2", "epoch": 2},
                    "journalSeq": 120}},
            ])
        );
        assert!(status_patch("uid-1", &MacBuildStatus::default(), 1).is_none());
    }

    #[test]
    fn backoff_doubles_is_capped_and_jittered() {
        let c = cfg();
        assert_eq!(backoff(&c, 1, 1.0), Duration::from_secs(1));
        assert_eq!(backoff(&c, 2, 1.0), Duration::from_secs(2));
        assert_eq!(backoff(&c, 5, 1.0), Duration::from_secs(16));
        assert_eq!(backoff(&c, 6, 1.0), Duration::from_secs(30));
        assert_eq!(backoff(&c, 1000, 1.0), Duration::from_secs(30));
        assert_eq!(backoff(&c, 6, 0.5), Duration::from_secs(15));
        assert_eq!(backoff(&c, 6, 0.0), Duration::from_secs(15), "jitter is clamped");
        for _ in 0..100 {
            let j = jitter();
            assert!((0.5..1.0).contains(&j), "{j}");
        }
    }
}
