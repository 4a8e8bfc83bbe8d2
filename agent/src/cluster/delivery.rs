//! Status delivery: every journaled transition's status snapshot is written to its MacBuild after
//! the journal sync, fenced on the claim.
//!
//! The write is a JSON patch on the status subresource: `test /metadata/uid`, `test
//! /status/claim/holder`, `test /status/claim/attempt`, a [`Fence`] test, then `replace /status`
//! with the snapshot (whose `journalSeq` is the record's seq). A stale attempt's write therefore
//! fails its test (422) and changes nothing.
//!
//! The fence tests that the MacBuild still shows the `journalSeq` this agent last knew it to show
//! (the one it delivered, or read): a write whose answer was lost (timed out) may still be applied
//! by the API server later, after a newer write of the same attempt landed, and without the fence
//! it would take the status back (a terminal status replaced by an older one: the pipeline never
//! hears the end). With it, that late write fails its test. Before any status was delivered there
//! is no `journalSeq` to test (and JSON patch cannot test for absence portably), so the first write
//! tests the resourceVersion read instead.
//!
//! Per MacBuild, one worker delivers in order and only the newest submitted snapshot matters: a
//! newer submission replaces one still waiting, and a snapshot older than one already delivered
//! is never sent. Each MacBuild has its own worker, so one build's refused writes never hold up
//! another's. At most `concurrency` writes (with their fresh reads) are in flight at once across
//! all workers: a burst (every undelivered status after a restart) queues here, not at the API
//! server, where the agent's Lease renewal would wait behind it. A worker waiting out a backoff
//! holds no permit.
//!
//! A write tests this holder's claim of its attempt or, for a retry whose own claim was never
//! written, this holder's claim of the attempt before, which the write moves on ([`claim_to_test`]).
//! A 409/422 is resolved by reading the MacBuild again ([`after_refusal`]): if the claim is neither,
//! the attempt is stale (*fenced out*): its deliveries stop and it is reported; if the MacBuild
//! shows exactly this write, an earlier try landed; if its fence
//! moved (an earlier try, or a late write, landed since), the snapshot is written again on the
//! fresh fence — it is the newest this agent has for the build, and only this agent writes under
//! its claim; if nothing moved, the write was refused (an admission policy's `Invalid`), like a 403. A
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
use tartan_api::{Claim, MacBuild, MacBuildStatus, Phase};
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

/// What a status write tests besides the claim: that the MacBuild still shows what this agent last
/// knew it to show, so a write applied late (after a newer one) fails instead of taking it back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fence {
    /// `status.journalSeq` is this.
    JournalSeq(u64),
    /// No `status.journalSeq` yet: the object's `metadata.resourceVersion` is this (any write
    /// since fails the test; the fresh read then gives the next fence).
    ResourceVersion(String),
}

impl Fence {
    /// The fence a write based on the read `mb` tests.
    pub fn of(mb: &MacBuild) -> Fence {
        match mb.status.as_ref().and_then(|s| s.journal_seq) {
            Some(seq) => Fence::JournalSeq(seq),
            None => Fence::ResourceVersion(mb.metadata.resource_version.clone().unwrap_or_default()),
        }
    }

    fn op(&self) -> json_patch::PatchOperation {
        match self {
            Fence::JournalSeq(seq) => op_test(&["status", "journalSeq"], json!(seq)),
            Fence::ResourceVersion(rv) => op_test(&["metadata", "resourceVersion"], json!(rv)),
        }
    }
}

/// The status `snapshot` is written as at journal record `seq`.
fn written_status(snapshot: &MacBuildStatus, seq: u64) -> MacBuildStatus {
    let mut status = snapshot.clone();
    status.journal_seq = Some(seq);
    status
}

/// The status write for `snapshot` at journal record `seq`: tests on uid, holder, attempt and
/// `fence`, then the whole status. `None` if the snapshot names no claim (it could not be fenced).
pub fn status_patch(uid: &str, snapshot: &MacBuildStatus, seq: u64, fence: &Fence) -> Option<JsonPatch> {
    Some(status_patch_under(uid, snapshot, seq, fence, snapshot.claim.as_ref()?))
}

/// [`status_patch`] testing the claim `tested` (see [`claim_to_test`]).
fn status_patch_under(uid: &str, snapshot: &MacBuildStatus, seq: u64, fence: &Fence, tested: &Claim) -> JsonPatch {
    JsonPatch(vec![
        op_test(&["metadata", "uid"], json!(uid)),
        op_test(&["status", "claim", "holder"], json!(tested.holder)),
        op_test(&["status", "claim", "attempt"], json!(tested.attempt)),
        fence.op(),
        op_replace(&["status"], json!(written_status(snapshot, seq))),
    ])
}

/// The claim a write of a snapshot under `claim` tests, the MacBuild's status being `shown`:
/// `claim` itself, or this holder's claim of the attempt just before, which the write then moves
/// on as the retry's own claim would have (that claim tests the same: `claim::next_claim_patch`).
/// The second is a retry that ended before its claim was written (cancelled or its owner deleted
/// while it waited, its window closed, its claim unanswered): its first delivered record is its
/// last, and without it the MacBuild would show the attempt before "Pending" for ever (seed 81043,
/// `chaos-2928`). Never over an end the attempt before reached (a terminal phase): no retry
/// follows one. `None`: the attempt is stale (fenced out).
pub fn claim_to_test(shown: Option<&MacBuildStatus>, claim: &Claim) -> Option<Claim> {
    let now = shown
        .and_then(|s| s.claim.as_ref())
        .filter(|n| n.holder == claim.holder)?;
    if now.attempt == claim.attempt {
        return Some(now.clone());
    }
    let previous = tartan_api::parse_attempt_id(&claim.attempt)
        .filter(|(_, n)| *n > 1)
        .map(|(name, n)| tartan_api::attempt_id(name, n - 1));
    let ended = shown.and_then(|s| s.phase).is_some_and(Phase::is_terminal);
    (previous.as_deref() == Some(now.attempt.as_str()) && !ended).then(|| now.clone())
}

/// What a 409/422 on a status write means, from the MacBuild read after it.
#[derive(Clone, Debug, PartialEq)]
pub enum AfterRefusal {
    /// The MacBuild is gone (or its name belongs to a new MacBuild).
    Gone,
    /// The claim is no longer this holder and attempt.
    FencedOut { now: Option<Claim> },
    /// The MacBuild shows exactly the status written: an earlier try landed, its answer lost.
    Landed,
    /// The fence moved (an earlier try or a late write landed since it was learnt): write again,
    /// testing this one. Under our claim only this agent writes, and the snapshot being written is
    /// the newest it has for the build, so writing it over whatever landed is right.
    Moved(Fence),
    /// Every test still holds: the write itself was refused (an admission policy's `Invalid`).
    Refused,
}

/// The decision after a status write testing `fence` for `written` (the status as sent, under
/// `claim`) was refused with 409/422, `fresh` the MacBuild read since.
pub fn after_refusal(
    fresh: Option<&MacBuild>,
    uid: &str,
    (claim, tested): (&Claim, &Claim),
    written: &MacBuildStatus,
    fence: &Fence,
) -> AfterRefusal {
    let Some(fresh) = fresh.filter(|m| m.metadata.uid.as_deref() == Some(uid)) else {
        return AfterRefusal::Gone;
    };
    let now = fresh.status.as_ref().and_then(|s| s.claim.clone());
    let Some(to_test) = claim_to_test(fresh.status.as_ref(), claim) else {
        return AfterRefusal::FencedOut { now };
    };
    // Compared as JSON: what the API returns went through the same encoding as what was sent.
    if fresh.status.as_ref().map(serde_json::to_value).and_then(Result::ok) == serde_json::to_value(written).ok() {
        return AfterRefusal::Landed;
    }
    match Fence::of(fresh) {
        now if now != *fence || to_test != *tested => AfterRefusal::Moved(now),
        _ => AfterRefusal::Refused,
    }
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
    /// The status changed under each of this many writes in a row.
    #[error("the MacBuild's status changed under {0} writes in a row")]
    Moving(u32),
    /// The snapshot names no claim to fence the write with; this is a bug in the caller.
    #[error("the snapshot has no claim to fence the write with")]
    NoClaim,
}

/// How many times one try writes again on a moved fence before it counts as failed (each time,
/// something else wrote the status between our read and our write).
const REFENCES: u32 = 4;

/// One try at writing `snapshot` (as of journal record `seq`) to `build`, testing `fence` (read
/// first if unknown, and updated with what the try learns). The workers call it for every try.
pub async fn deliver_once(
    client: &kube::Client,
    api_timeout: Duration,
    build: &BuildRef,
    snapshot: &MacBuildStatus,
    seq: u64,
    fence: &mut Option<Fence>,
) -> Result<Delivered, DeliveryError> {
    let claim = snapshot.claim.as_ref().ok_or(DeliveryError::NoClaim)?;
    // Our claim of this attempt, unless a read shows the claim it follows (see [`claim_to_test`]).
    let mut tested = claim.clone();
    let written = written_status(snapshot, seq);
    let api: Api<MacBuild> = Api::namespaced(client.clone(), &build.namespace);
    let read = async || timed(api_timeout, api.get_opt(&build.name)).await;
    let mut current = match fence.clone() {
        Some(f) => f,
        None => {
            let fresh = read().await.map_err(DeliveryError::Failed)?;
            let Some(fresh) = fresh.filter(|m| m.metadata.uid.as_deref() == Some(build.uid.as_str())) else {
                return Ok(Delivered::Gone);
            };
            let now = fresh.status.as_ref().and_then(|s| s.claim.clone());
            match claim_to_test(fresh.status.as_ref(), claim) {
                Some(c) => tested = c,
                None => return Ok(Delivered::FencedOut { now }),
            }
            Fence::of(&fresh)
        }
    };
    *fence = Some(current.clone());
    for _ in 0..REFENCES {
        let patch = status_patch_under(&build.uid, snapshot, seq, &current, &tested);
        crate::crash_point!("status.write.before");
        let result = timed(
            api_timeout,
            api.patch_status(&build.name, &patch_params(), &Patch::Json::<()>(patch)),
        )
        .await;
        crate::crash_point!("status.write.after");
        let e = match result {
            Ok(_) => {
                *fence = Some(Fence::JournalSeq(seq));
                return Ok(Delivered::Written);
            }
            Err(e) if e.is_not_found() => return Ok(Delivered::Gone),
            Err(e) if e.is_precondition() => e,
            Err(e) if e.code() == Some(403) => return Err(DeliveryError::Refused(e)),
            // The write may still be applied: the fence stays what it was, so that it then fails
            // a later write's test, and the fresh read after it says where things stand.
            Err(e) => return Err(DeliveryError::Failed(e)),
        };
        // Which test failed, if any, only a fresh read tells.
        let fresh = match read().await {
            Ok(fresh) => fresh,
            Err(_) => return Err(DeliveryError::Failed(e)),
        };
        match after_refusal(fresh.as_ref(), &build.uid, (claim, &tested), &written, &current) {
            AfterRefusal::Gone => return Ok(Delivered::Gone),
            AfterRefusal::FencedOut { now } => return Ok(Delivered::FencedOut { now }),
            AfterRefusal::Landed => {
                *fence = Some(Fence::JournalSeq(seq));
                return Ok(Delivered::Written);
            }
            AfterRefusal::Refused => return Err(DeliveryError::Refused(e)),
            AfterRefusal::Moved(moved) => {
                tracing::info!(
                    "status of {build} (record {seq}): the MacBuild changed under the write ({current:?} -> {moved:?}); writing it again"
                );
                current = moved;
                *fence = Some(current.clone());
                let shown = fresh.as_ref().and_then(|m| m.status.as_ref());
                tested = claim_to_test(shown, claim).unwrap_or_else(|| claim.clone());
            }
        }
    }
    Err(DeliveryError::Moving(REFENCES))
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
    /// What the next write tests (see [`Fence`]); `None` until read or written.
    fence: Option<Fence>,
    running: bool,
    wake: Arc<Notify>,
    progress: watch::Sender<Progress>,
}

impl BuildSlot {
    fn new() -> BuildSlot {
        BuildSlot {
            job: None,
            in_flight: None,
            fence: None,
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

    /// As [`DeliveryHandle::submit`], for a claim found to have landed after a write of its
    /// attempt was fenced out for want of it (the claim's own answer was lost): that verdict is
    /// withdrawn first, and the next write reads the MacBuild for its fence.
    pub fn submit_after_late_claim(&self, build: &BuildRef, snapshot: MacBuildStatus, seq: u64) {
        {
            let mut slots = self.slots.lock().expect("delivery slots lock");
            let slot = slots.entry(build.clone()).or_insert_with(BuildSlot::new);
            let attempt = snapshot.claim.as_ref().map(|c| c.attempt.as_str());
            let refused = slot
                .progress
                .borrow()
                .fenced_out
                .as_ref()
                .is_some_and(|(a, _)| Some(a.as_str()) == attempt);
            if refused {
                slot.fence = None;
                slot.progress.send_modify(|p| p.fenced_out = None);
            }
        }
        self.submit(build, snapshot, seq);
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

    /// Tells delivery what a read of `mb` (at recovery, or the claim's answer) showed, so that its
    /// first write needs no read of its own. Kept only while nothing fresher is known.
    pub fn observed(&self, mb: &MacBuild) {
        let build = BuildRef::of(mb);
        let mut slots = self.slots.lock().expect("delivery slots lock");
        let slot = slots.entry(build).or_insert_with(BuildSlot::new);
        if slot.fence.is_none() {
            slot.fence = Some(Fence::of(mb));
        }
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
        let (job, wake, progress, mut fence) = {
            let mut map = slots.lock().expect("delivery slots lock");
            let Some(slot) = map.get_mut(&build) else { return };
            slot.in_flight = None;
            match slot.job.take() {
                Some(job) => {
                    slot.in_flight = Some(job.seq);
                    (job, slot.wake.clone(), slot.progress.clone(), slot.fence.clone())
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
        let result = deliver_once(&client, cfg.api_timeout, &build, &job.snapshot, job.seq, &mut fence).await;
        drop(permit);
        if let Some(slot) = slots.lock().expect("delivery slots lock").get_mut(&build) {
            slot.fence = fence;
        }
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
        let p = serde_json::to_value(status_patch("uid-1", &snapshot, 120, &Fence::JournalSeq(118)).unwrap()).unwrap();
        assert_eq!(
            p,
            json!([
                {"op": "test", "path": "/metadata/uid", "value": "uid-1"},
                {"op": "test", "path": "/status/claim/holder", "value": "mac-mini-07"},
                {"op": "test", "path": "/status/claim/attempt", "value": "b#2"},
                {"op": "test", "path": "/status/journalSeq", "value": 118},
                {"op": "replace", "path": "/status", "value": {
                    "phase": "Running",
                    "claim": {"holder": "mac-mini-07", "attempt": "b#2", "epoch": 2},
                    "journalSeq": 120}},
            ])
        );
        // Before any status was delivered: the resourceVersion read.
        let p =
            serde_json::to_value(status_patch("uid-1", &snapshot, 1, &Fence::ResourceVersion("77".into())).unwrap())
                .unwrap();
        assert_eq!(
            p[3],
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": "77"})
        );
        assert!(status_patch("uid-1", &MacBuildStatus::default(), 1, &Fence::JournalSeq(1)).is_none());
    }

    fn claim(holder: &str, attempt: &str) -> Claim {
        Claim {
            holder: holder.into(),
            attempt: attempt.into(),
            epoch: 1,
        }
    }

    fn build_showing(uid: &str, rv: &str, status: Option<MacBuildStatus>) -> MacBuild {
        let mut mb = MacBuild::new("b", tartan_api::MacBuildSpec::new("img", vec![]));
        mb.metadata.uid = Some(uid.into());
        mb.metadata.resource_version = Some(rv.into());
        mb.status = status;
        mb
    }

    fn status_at(claim: &Claim, phase: Phase, seq: Option<u64>) -> MacBuildStatus {
        MacBuildStatus {
            phase: Some(phase),
            claim: Some(claim.clone()),
            journal_seq: seq,
            ..Default::default()
        }
    }

    #[test]
    fn fence_is_the_journal_seq_shown_or_else_the_resource_version() {
        let c = claim("mac-a", "b#1");
        assert_eq!(
            Fence::of(&build_showing("u", "5", Some(status_at(&c, Phase::Running, Some(29))))),
            Fence::JournalSeq(29)
        );
        assert_eq!(
            Fence::of(&build_showing("u", "5", Some(status_at(&c, Phase::Pending, None)))),
            Fence::ResourceVersion("5".into())
        );
        assert_eq!(
            Fence::of(&build_showing("u", "6", None)),
            Fence::ResourceVersion("6".into())
        );
    }

    /// The decisions after a refused (409/422) status write of record 31 that tested seq 29.
    #[test]
    fn after_a_refusal_the_fresh_read_decides() {
        let c = claim("mac-a", "b#1");
        let written = status_at(&c, Phase::Succeeded, Some(31));
        let fence = Fence::JournalSeq(29);
        let decide = |fresh: Option<&MacBuild>| after_refusal(fresh, "u", (&c, &c), &written, &fence);
        assert_eq!(decide(None), AfterRefusal::Gone);
        assert_eq!(
            decide(Some(&build_showing("other-uid", "9", Some(written.clone())))),
            AfterRefusal::Gone,
            "a new MacBuild of that name"
        );
        // Another holder or attempt: stale, whatever its journalSeq says.
        let theirs = claim("mac-b", "b#2");
        assert_eq!(
            decide(Some(&build_showing(
                "u",
                "9",
                Some(status_at(&theirs, Phase::Running, Some(3)))
            ))),
            AfterRefusal::FencedOut { now: Some(theirs) }
        );
        assert_eq!(
            decide(Some(&build_showing("u", "9", Some(MacBuildStatus::default())))),
            AfterRefusal::FencedOut { now: None }
        );
        // Our write is there (an earlier try's answer was lost).
        assert_eq!(
            decide(Some(&build_showing("u", "9", Some(written.clone())))),
            AfterRefusal::Landed
        );
        // An older write of ours landed since (record 30, timed out earlier): write again on it.
        assert_eq!(
            decide(Some(&build_showing(
                "u",
                "9",
                Some(status_at(&c, Phase::Retiring, Some(30)))
            ))),
            AfterRefusal::Moved(Fence::JournalSeq(30))
        );
        // A journalSeq carried over from an earlier holder's journal may be higher than ours: it is
        // not ours to keep, so it is written over too.
        assert_eq!(
            decide(Some(&build_showing(
                "u",
                "9",
                Some(status_at(&c, Phase::Pending, Some(500)))
            ))),
            AfterRefusal::Moved(Fence::JournalSeq(500))
        );
        // The fence still holds: an admission policy refused the write.
        assert_eq!(
            decide(Some(&build_showing(
                "u",
                "9",
                Some(status_at(&c, Phase::Collecting, Some(29)))
            ))),
            AfterRefusal::Refused
        );
        // Fenced on the resourceVersion (nothing delivered yet): any write since moves it.
        let rv = Fence::ResourceVersion("9".into());
        let pending = Some(status_at(&c, Phase::Pending, None));
        assert_eq!(
            after_refusal(
                Some(&build_showing("u", "9", pending.clone())),
                "u",
                (&c, &c),
                &written,
                &rv
            ),
            AfterRefusal::Refused
        );
        assert_eq!(
            after_refusal(Some(&build_showing("u", "10", pending)), "u", (&c, &c), &written, &rv),
            AfterRefusal::Moved(Fence::ResourceVersion("10".into()))
        );
    }

    #[test]
    fn a_write_tests_its_own_claim_or_the_one_of_ours_it_follows() {
        let a2 = claim("mac-a", "b#2");
        let pending = |c: &Claim| status_at(c, Phase::Pending, Some(29));
        let test = |now: Option<Claim>| claim_to_test(now.as_ref().map(pending).as_ref(), &a2);
        assert_eq!(test(Some(a2.clone())), Some(a2.clone()));
        // Our retry's claim was never written: the write moves our claim of b#1 on.
        assert_eq!(test(Some(claim("mac-a", "b#1"))), Some(claim("mac-a", "b#1")));
        // Anyone else's, an older or a later attempt of ours, or none: stale.
        for now in [
            Some(claim("mac-b", "b#1")),
            Some(claim("mac-b", "b#2")),
            Some(claim("mac-a", "b#3")),
            Some(claim("mac-a", "c#1")),
            Some(claim("", "b#1")),
            None,
        ] {
            assert_eq!(test(now.clone()), None, "{now:?}");
        }
        let b1 = pending(&claim("mac-a", "b#1"));
        assert_eq!(claim_to_test(Some(&b1), &claim("mac-a", "b#0")), None);
        let a3 = claim("mac-a", "b#3");
        assert_eq!(claim_to_test(Some(&b1), &a3), None, "two attempts back");
        assert_eq!(claim_to_test(Some(&pending(&a2)), &a3), Some(a2.clone()));
        // No retry follows an end: the attempt before's terminal status is never written over.
        for phase in [Phase::Succeeded, Phase::Failed, Phase::Cancelled] {
            let ended = status_at(&claim("mac-a", "b#1"), phase, Some(29));
            assert_eq!(claim_to_test(Some(&ended), &a2), None, "{phase:?}");
        }
        // After a refusal: the MacBuild still shows our b#1 and the fence held; a write that
        // tested b#2 goes again testing b#1, one that tested b#1 was refused.
        let shown = build_showing(
            "u",
            "9",
            Some(status_at(&claim("mac-a", "b#1"), Phase::Pending, Some(29))),
        );
        let written = status_at(&a2, Phase::Cancelled, Some(31));
        let fence = Fence::JournalSeq(29);
        assert_eq!(
            after_refusal(Some(&shown), "u", (&a2, &a2), &written, &fence),
            AfterRefusal::Moved(fence.clone())
        );
        assert_eq!(
            after_refusal(Some(&shown), "u", (&a2, &claim("mac-a", "b#1")), &written, &fence),
            AfterRefusal::Refused
        );
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
