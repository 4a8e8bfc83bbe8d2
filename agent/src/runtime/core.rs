//! The agent's per-build state and its one owner, [`Builds`]: the journal, what it says of every
//! attempt, what the agent knows of each build besides (status snapshot, claim epoch, task,
//! what earlier runs delivered, compaction and finalizer debts), the quarantined unknown VMs, and
//! the slot reservations ([`super::slots`]).
//!
//! Who owns what:
//! - [`Builds`] owns all of it. Its maps are private and change only through its methods (and
//!   [`Shared`]'s journal steps, in this file); each takes the lock for a few map operations and
//!   at most a journal write (synced, in `block_in_place`), and never holds it across an await.
//!   Callers get copies, never the lock.
//! - A build's task owns its [`SlotReservation`], if it holds one (`build::BuildTask`).
//! - [`Shared`] holds `Builds` beside the agent's config, clients, delivery and Events.
//!
//! One rule holds everything together: a transition is journaled (synced) before anyone acts on
//! it, and only then is the cluster told. [`Shared::journal`] is the first step (append, then the
//! state and the slots follow the record); it returns a [`Journaled`] whose record is had only
//! through [`Shared::report`], the second step (status delivery, Events, waking slot waiters),
//! which each call site takes right after.

use super::slots::{SlotBook, SlotReservation};
use crate::cluster::delivery::DeliveryHandle;
use crate::cluster::events::Events;
use crate::config::Config;
use crate::host::{CancelHandle, Withdrawal};
use crate::journal::{Journal, JournalError, JournalHealth};
use crate::machine::{self, Attempt, AttemptKey, SlotHolder, Transition, attempt_holders, decide_retry, free_slot};
use crate::record::{BuildRef, Record};
use crate::recovery::Replay;
use crate::status::{Reporter, next_status, snapshot_is_journaled};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use tartan_api::{AttemptState, BuildResults, MacBuild, MacBuildStatus, Outcome, Reason};
use tartan_tart::Tart;
use tokio::sync::{Mutex, Notify};

mod warm;
pub use warm::{Placed, PoolTally, PoolWork, refill_deadline, warm_deadline, warm_record, warm_vm_name};

/// What this agent knows of one build (by uid) besides its attempts.
#[derive(Default)]
struct BuildEntry {
    /// The last status snapshot, the base of the next one.
    status: Option<MacBuildStatus>,
    /// The claim epoch this agent holds on it.
    epoch: Option<u64>,
    /// How to withdraw its task, while it has one on this agent.
    task: Option<CancelHandle>,
    /// `status.journalSeq` its MacBuild showed at agent start under this agent's claim: what
    /// earlier runs delivered if it is a seq of theirs. It may be an earlier holder's (a claim
    /// writes no seq), so only equality with a record's seq says that record was delivered.
    delivered_before: Option<u64>,
    /// Finished here and its records dropped by compaction: the journal no longer names it, and
    /// it must still never be claimed again.
    compacted: bool,
    /// Finished, but its finalizer could not be removed: compaction keeps its records, so that
    /// the next agent start removes it.
    finalizer_owed: bool,
    /// Its [`LateClaimAnswer`] was given.
    late_answer_given: bool,
}

impl BuildEntry {
    fn is_empty(&self) -> bool {
        self.status.is_none()
            && self.epoch.is_none()
            && self.task.is_none()
            && self.delivered_before.is_none()
            && !self.compacted
            && !self.finalizer_owed
            && !self.late_answer_given
    }
}

/// How long after the agent gave up on a claim write the write may still be applied: an API server
/// applies or drops a request it has read within its request timeout (60 s by default). Until
/// then an unconfirmed claim's records stay, so a late landing is still answered.
const CLAIM_LANDS_WITHIN: k8s_openapi::jiff::SignedDuration = k8s_openapi::jiff::SignedDuration::from_secs(120);

/// What [`Builds::withdraw_or_pick_new`] found.
#[derive(Default)]
pub struct Picked<'a> {
    /// The builds new to this agent.
    pub new: Vec<&'a Arc<MacBuild>>,
    /// Answers owed for claims that landed late.
    pub late_answers: Vec<LateClaimAnswer>,
}

/// A claim whose write got no answer (its attempt journaled `ClaimUnconfirmed`, nothing cloned)
/// that the MacBuild shows landed after the attempt's own status write was refused for want of
/// it: this agent holds the build and must answer, or nobody ever would. The answer is that
/// record's status again (never admitted, `VMDeleted` true) and the finalizer's removal.
pub struct LateClaimAnswer {
    pub build: BuildRef,
    pub status: MacBuildStatus,
    pub seq: u64,
}

/// Everything behind the one lock.
struct Core {
    journal: Journal,
    /// Every attempt the journal knows, as of its last record.
    attempts: AttemptBook,
    /// Per build (by uid), what the journal's attempts do not say.
    builds: BTreeMap<String, BuildEntry>,
    /// Quarantined VMs with the prefix and no attempt: they block a slot until an operator
    /// removes them (vm → slot, if one was recorded).
    unknown: BTreeMap<String, Option<u8>>,
    /// The warm pool's VMs not yet retired ([`warm`]).
    warm: BTreeMap<String, warm::WarmState>,
    /// Claimed builds waiting for the slot a warm VM gives up: no refill takes a slot before them.
    waiting: BTreeSet<String>,
    /// The pool's counts ([`warm::PoolTally`]; the idle seconds of retired warm VMs apart).
    pool_tally: warm::PoolTally,
    pool_idle_seconds: f64,
    /// A warm VM retired since the last compaction: its records can go.
    warm_retired: bool,
}

impl Core {
    fn entry(&mut self, uid: &str) -> &mut BuildEntry {
        self.builds.entry(uid.to_string()).or_default()
    }

    /// Changes `uid`'s entry and drops it once it holds nothing.
    fn update(&mut self, uid: &str, change: impl FnOnce(&mut BuildEntry)) {
        change(self.entry(uid));
        if self.builds.get(uid).is_some_and(BuildEntry::is_empty) {
            self.builds.remove(uid);
        }
    }

    fn status(&self, uid: &str) -> Option<&MacBuildStatus> {
        self.builds.get(uid).and_then(|b| b.status.as_ref())
    }

    fn has_task(&self, uid: &str) -> bool {
        self.builds.get(uid).is_some_and(|b| b.task.is_some())
    }

    /// Who holds a slot now: open attempts, quarantined unknown VMs, warm VMs and reservations
    /// (a warm VM reserved for adoption counts once, as its reservation).
    fn slot_holders(&self, book: &SlotBook) -> Vec<SlotHolder> {
        let mut holders = attempt_holders(self.attempts.values());
        holders.extend(
            self.unknown
                .values()
                .map(|slot| slot.map_or(SlotHolder::Unnumbered, SlotHolder::Slot)),
        );
        holders.extend(self.warm_holders(&book.adopting()));
        holders.extend(book.holders());
        holders
    }

    fn latest_attempt(&self, uid: &str) -> Option<&Attempt> {
        self.attempts.of_build(uid).max_by_key(|a| a.number)
    }

    /// Whether the journal says this agent finished `uid`: its last attempt is retired with an
    /// outcome (a lost claim has none) and no task follows it. Such a build is only ever
    /// redelivered, never claimed, admitted or cloned again, whatever a cached MacBuild says.
    fn finished_here(&self, uid: &str) -> bool {
        self.builds.get(uid).is_some_and(|b| b.compacted)
            || self
                .latest_attempt(uid)
                .is_some_and(|a| a.state == AttemptState::Retired && a.outcome.is_some())
    }

    /// The answer owed when `mb` shows `me`'s claim on the attempt this agent journaled last, as
    /// `ClaimUnconfirmed`, and not that record's status: the claim landed after the agent gave up
    /// on it. `None` once given.
    fn late_claim_answer(&self, uid: &str, mb: &MacBuild, me: &str) -> Option<LateClaimAnswer> {
        let shown = mb.status.as_ref()?;
        let claim = shown.claim.as_ref().filter(|c| c.holder == me)?;
        let latest = self.latest_attempt(uid)?;
        let seq = latest.last_seq?;
        let unanswered = latest.state == AttemptState::Retired
            && latest.reason == Some(Reason::ClaimUnconfirmed)
            && claim.attempt == tartan_api::attempt_id(&latest.build.name, latest.number)
            // Not this record's seq: whatever seq the MacBuild shows is an earlier holder's
            // (a claim writes none), and two agents' seqs do not compare.
            && shown.journal_seq != Some(seq);
        let entry = self.builds.get(uid)?;
        (unanswered && !entry.late_answer_given).then(|| LateClaimAnswer {
            build: latest.build.clone(),
            status: entry.status.clone().unwrap_or_default(),
            seq,
        })
    }

    /// Whether this agent still has anything to do for `uid` (an attempt not yet retired).
    fn has_open_attempt(&self, uid: &str) -> bool {
        self.attempts.of_build(uid).any(|a| a.state != AttemptState::Retired)
    }
}

/// The attempts, by build uid and attempt number: each scan asks for the attempts of every
/// MacBuild in view, which must not mean reading every attempt the journal holds.
#[derive(Default)]
struct AttemptBook(BTreeMap<(String, u32), Attempt>);

impl AttemptBook {
    fn key_of(key: &AttemptKey) -> (String, u32) {
        (key.build.uid.clone(), key.attempt)
    }

    fn get(&self, key: &AttemptKey) -> Option<&Attempt> {
        self.0.get(&Self::key_of(key))
    }

    fn get_mut(&mut self, key: &AttemptKey) -> Option<&mut Attempt> {
        self.0.get_mut(&Self::key_of(key))
    }

    fn contains_key(&self, key: &AttemptKey) -> bool {
        self.0.contains_key(&Self::key_of(key))
    }

    fn insert(&mut self, key: AttemptKey, attempt: Attempt) {
        self.0.insert(Self::key_of(&key), attempt);
    }

    fn values(&self) -> impl Iterator<Item = &Attempt> {
        self.0.values()
    }

    /// The attempts of build `uid`, lowest number first.
    fn of_build(&self, uid: &str) -> impl Iterator<Item = &Attempt> {
        self.0
            .range((uid.to_string(), 0)..=(uid.to_string(), u32::MAX))
            .map(|(_, a)| a)
    }

    /// Keeps the attempts of the builds `keep` says yes to (by uid).
    fn retain_builds(&mut self, mut keep: impl FnMut(&str) -> bool) {
        self.0.retain(|(uid, _), _| keep(uid));
    }
}

/// The one owner of per-build state (see the module's comment).
pub struct Builds {
    core: Mutex<Core>,
    slots: Arc<SlotBook>,
    /// Wakes the warm pool's task.
    pool_changed: Notify,
}

/// The attempts' gauges for `/metrics`, read under one lock.
pub struct Gauges {
    pub by_state: Vec<(AttemptState, usize)>,
    pub slots_busy: usize,
    pub unknown_vms: usize,
    pub journal_next_seq: u64,
}

impl Builds {
    /// The state over `journal` with nothing known yet: recovery fills it in.
    pub fn new(journal: Journal) -> Builds {
        Builds {
            core: Mutex::new(Core {
                journal,
                attempts: AttemptBook::default(),
                builds: BTreeMap::new(),
                unknown: BTreeMap::new(),
                warm: BTreeMap::new(),
                waiting: BTreeSet::new(),
                pool_tally: warm::PoolTally::default(),
                pool_idle_seconds: 0.0,
                warm_retired: false,
            }),
            slots: SlotBook::new(),
            pool_changed: Notify::new(),
        }
    }

    /// See [`SlotBook::waiting_held`].
    pub fn waiting_held(&self, uid: &str) -> super::slots::HeldWait {
        self.slots.waiting_held(uid)
    }

    /// Whether a build this agent holds waits for a slot: no new build may be claimed then.
    pub fn held_build_waits(&self) -> bool {
        self.slots.held_build_waits()
    }

    /// Signalled whenever a slot may have become free.
    pub fn slot_freed(&self) -> &Notify {
        self.slots.freed()
    }

    /// Wakes whoever waits for a slot (a task ended; an operator may have removed a VM), and the
    /// warm pool, which may refill it.
    pub fn notify_slot_freed(&self) {
        self.slots.notify_freed();
        self.pool_changed.notify_one();
    }

    /// Reserves the lowest free slot of `slots` for `uid`, if one is free: what no open attempt,
    /// quarantined unknown VM or other reservation holds.
    pub async fn reserve(&self, uid: &str, slots: u8) -> Option<SlotReservation> {
        let core = self.core.lock().await;
        let slot = free_slot(slots, &core.slot_holders(&self.slots))?;
        Some(self.slots.reserve_free(uid, slot))
    }

    /// How many of `slots` no one holds (published on the Lease for other agents' claim waits).
    pub async fn free_slots(&self, slots: u8) -> u32 {
        let holders = self.core.lock().await.slot_holders(&self.slots).len();
        let usable = usize::from(slots.min(2));
        u32::try_from(usable.saturating_sub(holders)).unwrap_or(0)
    }

    /// Whether a slot of `slots` is free now (the claim a free slot would make is due).
    pub async fn has_free_slot(&self, slots: u8) -> bool {
        let core = self.core.lock().await;
        free_slot(slots, &core.slot_holders(&self.slots)).is_some()
    }

    /// Registers the task of build `uid` and how to withdraw it.
    pub async fn task_started(&self, uid: &str, handle: CancelHandle) {
        self.core.lock().await.entry(uid).task = Some(handle);
    }

    /// Whether build `uid` has a task on this agent.
    pub async fn has_task(&self, uid: &str) -> bool {
        self.core.lock().await.has_task(uid)
    }

    /// The builds that have a task on this agent (as their latest attempt names them).
    pub async fn with_tasks(&self) -> Vec<BuildRef> {
        let core = self.core.lock().await;
        core.builds
            .iter()
            .filter(|(_, b)| b.task.is_some())
            .filter_map(|(uid, _)| core.latest_attempt(uid).map(|a| a.build.clone()))
            .collect()
    }

    /// Forgets the task of `uid`: it has ended.
    pub async fn task_ended(&self, uid: &str) {
        let mut core = self.core.lock().await;
        core.update(uid, |b| b.task = None);
        // It no longer waits for a slot (a refill may take it).
        core.waiting.remove(uid);
    }

    /// Records whether `uid`'s finalizer is still owed (its removal failed for good) or not.
    pub async fn set_finalizer_owed(&self, uid: &str, owed: bool) {
        self.core.lock().await.update(uid, |b| b.finalizer_owed = owed);
    }

    /// Records a claim this agent made (won, or written without an answer): its epoch, and the
    /// MacBuild's status as the claim left it (or as last read).
    pub async fn claim_made(&self, uid: &str, epoch: u64, status: Option<MacBuildStatus>) {
        let mut core = self.core.lock().await;
        let entry = core.entry(uid);
        entry.epoch = Some(epoch);
        if let Some(status) = status {
            entry.status = Some(status);
        }
    }

    /// Whether the journal has attempt `key`.
    pub async fn has_attempt(&self, key: &AttemptKey) -> bool {
        self.core.lock().await.attempts.contains_key(key)
    }

    /// The journal's view of attempt `key`.
    pub async fn attempt(&self, key: &AttemptKey) -> Option<Attempt> {
        self.core.lock().await.attempts.get(key).cloned()
    }

    /// The attempt of build `uid` with the highest number, if any.
    pub async fn latest_attempt(&self, uid: &str) -> Option<Attempt> {
        self.core.lock().await.latest_attempt(uid).cloned()
    }

    /// Whether build `uid` is new to this agent: no task, no open attempt, not finished here.
    pub async fn is_new(&self, uid: &str) -> bool {
        let core = self.core.lock().await;
        !core.has_task(uid) && !core.has_open_attempt(uid) && !core.finished_here(uid)
    }

    /// One pass over `builds` under one lock: withdraws the task of each build that has one and
    /// whose MacBuild asks for it (a cancel request, a deletion), and returns the builds new to
    /// this agent (no task, no open attempt, not finished here), with the answers owed for claims
    /// of `me` that landed after their attempt was journaled `ClaimUnconfirmed` (see
    /// [`LateClaimAnswer`]), each given once.
    pub async fn withdraw_or_pick_new<'a>(&self, builds: &'a [Arc<MacBuild>], me: &str) -> Picked<'a> {
        let mut core = self.core.lock().await;
        let mut picked = Picked::default();
        for mb in builds {
            let Some(uid) = mb.metadata.uid.as_deref() else {
                continue;
            };
            if let Some(handle) = core.builds.get(uid).and_then(|b| b.task.as_ref()) {
                if let Some(why) = super::build::withdrawal_of(mb) {
                    handle.cancel(why);
                }
                continue;
            }
            if let Some(answer) = core.late_claim_answer(uid, mb, me) {
                core.update(uid, |b| b.late_answer_given = true);
                picked.late_answers.push(answer);
            }
            // A claim would be for the attempt the MacBuild numbers next: one the journal has
            // already (a claim lost or unconfirmed on this build as it stands) is never made again.
            let next = crate::cluster::claim::first_attempt_number(mb);
            if !core.has_open_attempt(uid)
                && !core.finished_here(uid)
                && !core.attempts.of_build(uid).any(|a| a.number == next)
            {
                picked.new.push(mb);
            }
        }
        picked
    }

    /// Withdraws (`why`) the task of `uid` if it has one and its latest attempt is `which`;
    /// returns that attempt.
    pub async fn withdraw_latest_if(
        &self,
        uid: &str,
        which: impl Fn(&Attempt) -> bool,
        why: Withdrawal,
    ) -> Option<Attempt> {
        let core = self.core.lock().await;
        let latest = core.latest_attempt(uid).filter(|a| which(a))?;
        let handle = core.builds.get(uid)?.task.as_ref()?;
        handle.cancel(why);
        Some(latest.clone())
    }

    /// The VMs of attempts the journal has open.
    pub async fn open_vms(&self) -> BTreeSet<String> {
        let core = self.core.lock().await;
        core.attempts
            .values()
            .filter(|a| a.state != AttemptState::Retired)
            .map(|a| a.vm.clone())
            .chain(core.warm.keys().cloned())
            .collect()
    }

    /// The quarantined unknown VMs and the slot each blocks.
    pub async fn unknown_vms(&self) -> Vec<(String, Option<u8>)> {
        let core = self.core.lock().await;
        core.unknown.iter().map(|(vm, slot)| (vm.clone(), *slot)).collect()
    }

    /// The sequence number the next journal record gets.
    pub async fn next_seq(&self) -> u64 {
        self.core.lock().await.journal.next_seq()
    }

    /// A handle telling whether journal appends fail (read without the lock later).
    pub async fn journal_health(&self) -> JournalHealth {
        self.core.lock().await.journal.health()
    }

    /// Takes in what recovery replayed: every attempt and unknown VM, and the last status
    /// snapshot of each build (the journal's, else the cluster's, from `records`).
    pub async fn load_replay(&self, replayed: &Replay, records: &[Record]) {
        let mut core = self.core.lock().await;
        for a in &replayed.attempts {
            core.attempts.insert(a.key(), a.clone());
        }
        for u in &replayed.unknown {
            core.unknown.insert(u.vm.clone(), u.slot);
        }
        Builds::load_warm(&mut core, &replayed.warm);
        for r in records {
            if let (Some(b), Some(status)) = (&r.build, r.saved_status()) {
                core.entry(&b.uid).status = Some(status);
            }
        }
    }

    /// Takes in what only the cluster knows: our claim epochs, what earlier runs delivered (both
    /// of the builds `agent` holds), and the status of builds the journal saved none for.
    pub async fn learn_from_cluster(&self, agent: &str, macbuilds: &BTreeMap<String, MacBuild>) {
        let mut core = self.core.lock().await;
        for (uid, mb) in macbuilds {
            let Some(status) = &mb.status else { continue };
            let entry = core.entry(uid);
            // Sequence numbers are this agent's only while it holds the claim.
            if let Some(claim) = &status.claim
                && claim.holder == agent
            {
                entry.epoch = Some(claim.epoch);
                if let Some(seq) = status.journal_seq {
                    entry.delivered_before = Some(seq);
                }
            }
            entry.status.get_or_insert_with(|| status.clone());
        }
    }

    /// Applies the cluster's view to known attempts: whether each build is gone, its maxAttempts.
    pub async fn refresh_attempts<'a>(&self, seen: impl IntoIterator<Item = &'a Attempt>) {
        let mut core = self.core.lock().await;
        for a in seen {
            if let Some(known) = core.attempts.get_mut(&a.key()) {
                known.build_gone = a.build_gone;
                known.max_attempts = a.max_attempts;
            }
        }
    }

    /// The attempts' gauges for `/metrics`.
    pub async fn gauges(&self) -> Gauges {
        let core = self.core.lock().await;
        Gauges {
            by_state: AttemptState::ALL
                .iter()
                .map(|s| (*s, core.attempts.values().filter(|a| a.state == *s).count()))
                .collect(),
            slots_busy: core.slot_holders(&self.slots).len(),
            unknown_vms: core.unknown.len(),
            journal_next_seq: core.journal.next_seq(),
        }
    }
}

/// Why a transition could not be journaled; nothing of it may be performed.
#[derive(Debug, thiserror::Error)]
pub enum JournalWriteError {
    #[error("encoding status: {0}")]
    EncodeStatus(serde_json::Error),
    #[error("{0}; the transition is not recorded and nothing of it is done")]
    Append(JournalError),
}

/// A transition journaled (synced) and taken into the state, not yet reported: its record is
/// had only through [`Shared::report`].
#[must_use = "a journaled transition is reported (Shared::report) before it is acted on"]
pub struct Journaled {
    record: Record,
    build: BuildRef,
    snapshot: MacBuildStatus,
    deliver: bool,
}

/// What every task of the agent shares.
pub struct Shared {
    pub config: Config,
    pub machine: machine::Config,
    /// Per-build state, its one owner.
    pub builds: Builds,
    pub client: kube::Client,
    pub tart: Tart,
    pub delivery: DeliveryHandle,
    pub events: Events,
    /// The API server's URL, for log lines.
    pub api_server: String,
    /// Why recovery still waits for the cluster (it could not be read at start), if it does.
    pub recovery_waits: std::sync::Mutex<Option<String>>,
    /// The Lease keeper's state: a resumed attempt waits for a live Lease before it goes on.
    pub lease: tokio::sync::watch::Receiver<crate::cluster::lease::LeaseState>,
    /// When this agent process started (resume records say how long re-attaching took).
    pub started: std::time::Instant,
    /// Set when the agent must exit non-zero (a build's task kept failing): the main loop stops
    /// as on SIGTERM and `run` returns this as its error, so launchd starts the agent again.
    pub fatal: tokio::sync::watch::Sender<Option<String>>,
    /// The free-space floor: no new claim below it.
    pub disk: crate::host::disk::DiskFloor,
}

impl Shared {
    /// Journals `t` for `attempt` (synced) and takes it in: the attempt's new state, the status
    /// snapshot it implies, and its slot. `slot` is the build task's reservation: an `Admitted`
    /// record ends it (the attempt holds the slot now), a `Retired` one releases it or, when a
    /// retry follows, puts there the reservation the retired attempt hands on. Nothing is
    /// reported yet ([`Shared::report`]); on `Err` nothing of `t` may be performed (the journal
    /// failed closed) and nothing changed.
    pub async fn journal(
        &self,
        attempt: &Attempt,
        t: &Transition,
        results: Option<&BuildResults>,
        generation: Option<i64>,
        logs: Option<&str>,
        slot: &mut Option<SlotReservation>,
    ) -> Result<Journaled, JournalWriteError> {
        let uid = attempt.build.uid.clone();
        let mut core = self.builds.core.lock().await;
        let seq = core.journal.next_seq();
        let mut record = attempt.record(t, seq);
        // The generation the attempt started with, else the one it runs now (recovery compares it).
        record.generation = record.generation.or(generation);
        let mut after = attempt.clone();
        after.observe(&record);
        let retry_follows =
            after.outcome == Some(Outcome::Interrupted) && decide_retry(&after, t.at, &self.machine).is_ok();
        let entry = core.builds.get(&uid);
        let epoch = entry
            .and_then(|b| b.epoch)
            .or_else(|| core.status(&uid).and_then(|s| s.claim.as_ref()).map(|c| c.epoch))
            .unwrap_or(1);
        let previous = core.status(&uid).cloned().unwrap_or_default();
        let snapshot = next_status(
            &previous,
            &after,
            &record,
            &Reporter {
                holder: &self.config.agent_id,
                epoch,
                results,
                retry_follows,
                generation,
                logs,
            },
        );
        if snapshot_is_journaled(&record) {
            record.status = Some(serde_json::to_value(&snapshot).map_err(JournalWriteError::EncodeStatus)?);
        }
        // An adoption's `Admitted` record and the warm VM's `Retired (Adopted)` one are one write:
        // the VM and its slot pass to the attempt, never held by both or by neither.
        let mut batch = vec![record];
        batch.extend(core.handed_over(&batch[0]));
        if batch.len() > 1 {
            crate::crash_point!("warm.adopt.before");
        }
        let written =
            tokio::task::block_in_place(|| core.journal.append_batch(&mut batch)).map_err(JournalWriteError::Append)?;
        // The journal numbers a record with its `next_seq` (a failed append's number is reused).
        debug_assert_eq!(written.start, seq, "the journal numbered the record unexpectedly");
        let mut batch = batch.into_iter();
        let record = batch.next().expect("the attempt's record");
        tracing::info!(target: "journal", "{record}");
        for handed in batch {
            crate::crash_point!("warm.adopt.after");
            core.take_in_handed_over(&handed);
        }
        core.count_admission(&record, !self.config.pool.spec.entries.is_empty());
        core.attempts.insert(after.key(), after.clone());
        core.entry(&uid).status = Some(snapshot.clone());
        // The slot follows the record, in this locked step: never held by no one in between.
        match record.to {
            AttemptState::Admitted => {
                if let Some(reservation) = slot.take() {
                    reservation.admitted();
                }
            }
            // The slot passes straight to the next attempt, ahead of any other build.
            AttemptState::Retired if retry_follows => {
                if let Some(s) = record.slot {
                    *slot = Some(self.builds.slots.hand_to_retry(&uid, s));
                }
            }
            AttemptState::Retired => *slot = None,
            _ => {}
        }
        drop(core);
        Ok(Journaled {
            deliver: deliverable(&record, &after),
            build: attempt.build.clone(),
            snapshot,
            record,
        })
    }

    /// Tells the cluster what `journaled` recorded: hands the snapshot to status delivery (unless
    /// the record is not for the cluster) and the record to Events, and wakes slot waiters when
    /// the attempt retired. Returns the record, to act on.
    pub fn report(&self, journaled: Journaled) -> Record {
        let Journaled {
            record,
            build,
            snapshot,
            deliver,
        } = journaled;
        if deliver {
            self.delivery.submit(&build, snapshot, record.seq);
        }
        self.events.transition(&record);
        if record.to == AttemptState::Retired {
            self.builds.notify_slot_freed();
        }
        record
    }

    /// Whether the journal can be written (while it fails, this probes the disk with the
    /// journal's own backoff; see [`Journal::writable`]).
    pub async fn journal_writable(&self) -> bool {
        let mut core = self.builds.core.lock().await;
        tokio::task::block_in_place(|| core.journal.writable())
    }

    /// Journals a record without an attempt (an unknown VM's quarantine or resolution).
    pub async fn journal_unknown(&self, mut record: Record) -> Result<u64, JournalError> {
        let mut core = self.builds.core.lock().await;
        let seq = tokio::task::block_in_place(|| core.journal.append(&mut record))?;
        tracing::info!(target: "journal", "{record}");
        if let Some(vm) = &record.vm {
            if record.to == AttemptState::Quarantined {
                core.unknown.insert(vm.clone(), record.slot);
            } else {
                core.unknown.remove(vm);
            }
        }
        drop(core);
        self.builds.notify_slot_freed();
        Ok(seq)
    }

    /// Compacts the journal: drops the records of builds this agent has finished (every attempt
    /// retired, no task left) whose last record reached the cluster (or needs not: the claim was
    /// lost, or the MacBuild is gone), and of unknown VMs that were resolved. Returns how many
    /// builds were dropped.
    pub async fn compact_journal(&self) -> Result<usize, JournalError> {
        let mut core = self.builds.core.lock().await;
        let mut last: BTreeMap<String, (&Attempt, u64)> = BTreeMap::new();
        for a in core.attempts.values() {
            let seq = a.last_seq.unwrap_or(0);
            let entry = last.entry(a.build.uid.clone()).or_insert((a, seq));
            if a.number > entry.0.number {
                entry.0 = a;
            }
            entry.1 = entry.1.max(seq);
        }
        let done: BTreeSet<String> = last
            .iter()
            .filter(|(uid, (latest, seq))| {
                let entry = core.builds.get(*uid);
                let settled = entry.is_none_or(|b| b.task.is_none() && !b.finalizer_owed)
                    && !self.builds.slots.holds(uid)
                    && !core.has_open_attempt(uid);
                let progress = self.delivery.progress(&latest.build);
                let progress = progress.borrow();
                // An unconfirmed claim's status is refused (fenced out) when the claim did not
                // land: nothing is owed once another agent holds the build, or once a late landing
                // of the claim can be ruled out.
                let unconfirmed_refused = latest.reason == Some(Reason::ClaimUnconfirmed)
                    && progress.fenced_out.as_ref().is_some_and(|(stale, now)| {
                        // The verdict on this attempt's own write, not an earlier attempt's.
                        let landing_ruled_out = latest
                            .last_time
                            .is_some_and(|t| t + CLAIM_LANDS_WITHIN < k8s_openapi::jiff::Timestamp::now());
                        *stale == tartan_api::attempt_id(&latest.build.name, latest.number)
                            && (now.is_some() || landing_ruled_out)
                    });
                let nothing_owed = latest.build_gone
                    || latest.reason == Some(Reason::ClaimLost)
                    || unconfirmed_refused
                    || self.delivery.delivered(&latest.build).is_some_and(|d| d >= *seq)
                    || entry.and_then(|b| b.delivered_before) == Some(*seq)
                    || progress.gone;
                settled && nothing_owed
            })
            .map(|(uid, _)| uid.clone())
            .collect();
        if done.is_empty() && !core.warm_retired {
            return Ok(0);
        }
        core.warm_retired = false;
        // Unknown VMs' and open warm VMs' records stay; retired warm VMs' go.
        let unknown: BTreeSet<String> = core.unknown.keys().chain(core.warm.keys()).cloned().collect();
        let compaction = tokio::task::block_in_place(|| {
            core.journal.compact(|r| match &r.build {
                Some(b) => !done.contains(&b.uid),
                None => r.vm.as_ref().is_some_and(|vm| unknown.contains(vm)),
            })
        })?;
        let builds: Vec<BuildRef> = core
            .attempts
            .values()
            .filter(|a| done.contains(&a.build.uid))
            .map(|a| a.build.clone())
            .collect();
        let finished: Vec<String> = done.iter().filter(|uid| core.finished_here(uid)).cloned().collect();
        for uid in &finished {
            core.entry(uid).compacted = true;
        }
        core.attempts.retain_builds(|uid| !done.contains(uid));
        for uid in &done {
            core.update(uid, |b| {
                b.status = None;
                b.epoch = None;
                b.late_answer_given = false;
            });
        }
        drop(core);
        for b in &builds {
            self.delivery.forget(b);
        }
        tracing::info!(
            target: "journal",
            kept = compaction.kept,
            dropped = compaction.dropped,
            builds = done.len(),
            "journal compacted"
        );
        Ok(done.len())
    }

    /// Journals `Detach` for every attempt that is booting, running or collecting, then keeps the
    /// state locked until the process exits, so no task records anything after it: the VMs and
    /// the steps' guest jobs run on, and the next start resumes them (`on_restart = "resume"`).
    pub async fn detach_and_hold(&self) {
        let mut core = self.builds.core.lock().await;
        let open: Vec<Attempt> = core
            .attempts
            .values()
            .filter(|a| {
                matches!(
                    a.state,
                    AttemptState::Booting | AttemptState::Running | AttemptState::Collecting
                )
            })
            .cloned()
            .collect();
        for mut a in open {
            let now = k8s_openapi::jiff::Timestamp::now();
            let t = match machine::step(&a, machine::Event::Detach, now, &self.machine) {
                Ok(t) => t,
                Err(refusal) => {
                    tracing::error!(attempt = %a.key(), %refusal, "not detached; recovered as found at the next start");
                    continue;
                }
            };
            let mut record = a.record(&t, core.journal.next_seq());
            match tokio::task::block_in_place(|| core.journal.append(&mut record)) {
                Ok(_) => {
                    tracing::info!(target: "journal", "{record}");
                    a.observe(&record);
                    core.attempts.insert(a.key(), a);
                }
                Err(error) => {
                    tracing::error!(attempt = %a.key(), %error, "detach not journaled; the next start recovers the attempt as found")
                }
            }
        }
        // Held until the process exits: a task finishing a step now must not journal past the detach.
        std::mem::forget(core);
    }
}

/// Whether a record's status goes to the cluster: not before the claim (a `Requested` record),
/// not for a claim another agent won, and not to a MacBuild that is gone.
fn deliverable(record: &Record, attempt: &Attempt) -> bool {
    record.to != AttemptState::Requested && record.reason != Some(Reason::ClaimLost) && !attempt.build_gone
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::JournalOptions;
    use crate::lock::StateLock;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A state over a real journal in a temporary directory.
    fn builds() -> (Builds, StateLock, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let lock = StateLock::acquire(dir.path()).unwrap();
        let (journal, _) = Journal::open(&lock, JournalOptions::default()).unwrap();
        (Builds::new(journal), lock, dir)
    }

    fn build(uid: &str) -> BuildRef {
        BuildRef {
            namespace: "ci".into(),
            name: format!("b-{uid}"),
            uid: uid.into(),
        }
    }

    /// Puts an attempt of `uid` into the state as the journal would after its `state` record.
    async fn attempt_in(builds: &Builds, uid: &str, state: AttemptState, slot: Option<u8>) -> AttemptKey {
        let mut a = Attempt::new(build(uid), 1, format!("mb-ci-{uid}-a1"), 2);
        a.state = state;
        a.slot = slot;
        let key = a.key();
        builds.core.lock().await.attempts.insert(key.clone(), a);
        key
    }

    #[tokio::test]
    async fn free_slots_count_attempts_unknown_vms_and_reservations() {
        let (builds, _lock, _dir) = builds();
        assert_eq!(builds.free_slots(2).await, 2);
        assert_eq!(builds.free_slots(5).await, 2, "never more than two slots");
        let r = builds.reserve("a", 2).await.unwrap();
        assert_eq!((r.slot(), builds.free_slots(2).await), (0, 1));
        let key = attempt_in(&builds, "b", AttemptState::Retiring, Some(1)).await;
        assert_eq!(builds.free_slots(2).await, 0, "a retiring attempt keeps its slot");
        assert!(builds.reserve("c", 2).await.is_none());
        assert!(!builds.has_free_slot(2).await);
        drop(r);
        assert_eq!(builds.free_slots(2).await, 1);
        // Only `Retired` (the VM's deletion confirmed) frees an attempt's slot.
        for state in [AttemptState::Quarantined, AttemptState::Retired] {
            builds.core.lock().await.attempts.get_mut(&key).unwrap().state = state;
            let expected = if state == AttemptState::Retired { 2 } else { 1 };
            assert_eq!(builds.free_slots(2).await, expected, "{state}");
        }
        builds.core.lock().await.unknown.insert("mb-stray".into(), None);
        assert_eq!(builds.free_slots(2).await, 1, "an unknown VM blocks a slot");
        assert_eq!(builds.reserve("d", 1).await, None, "…the only one of a one-slot host");
    }

    #[tokio::test]
    async fn a_reservation_dropped_on_any_path_frees_its_slot() {
        let (builds, _lock, _dir) = builds();
        // Whatever way a holder ends (an early return, an error, a panic), the value is dropped.
        async fn claim(builds: &Builds, how: u8) -> Result<u8, String> {
            let r = builds.reserve("a", 1).await.ok_or("no slot")?;
            match how {
                0 => Ok(r.slot()),
                1 => Err("the claim failed".to_string())?,
                _ => panic!("the task failed"),
            }
        }
        assert_eq!(claim(&builds, 0).await, Ok(0));
        assert_eq!(builds.free_slots(1).await, 1);
        assert!(claim(&builds, 1).await.is_err());
        assert_eq!(builds.free_slots(1).await, 1);
        let panicked = futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(claim(&builds, 2))).await;
        assert!(panicked.is_err());
        assert_eq!(builds.free_slots(1).await, 1);
        assert!(builds.slots.is_empty());
    }

    #[tokio::test]
    async fn an_admitted_reservation_leaves_the_slot_to_its_attempt() {
        let (builds, _lock, _dir) = builds();
        let r = builds.reserve("a", 1).await.unwrap();
        attempt_in(&builds, "a", AttemptState::Admitted, Some(r.slot())).await;
        r.admitted();
        assert!(builds.slots.is_empty());
        assert_eq!(builds.free_slots(1).await, 0, "the admitted attempt holds the slot");
        assert!(builds.reserve("b", 1).await.is_none());
    }

    /// Many tasks on several threads reserve, hold and release (or admit into an attempt that
    /// later retires) at once: no slot ever has two holders, and at most `min(slots, 2)` are held.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_reservations_never_exceed_the_slots() {
        for slots in [1u8, 2, 3] {
            let (builds, _lock, _dir) = builds();
            let builds = Arc::new(builds);
            let occupied: Arc<[AtomicUsize; 2]> = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
            let most = Arc::new(AtomicUsize::new(0));
            let granted = Arc::new(AtomicUsize::new(0));
            let tasks: Vec<_> = (0..8)
                .map(|t| {
                    let (builds, occupied) = (Arc::clone(&builds), Arc::clone(&occupied));
                    let (most, granted) = (Arc::clone(&most), Arc::clone(&granted));
                    tokio::spawn(async move {
                        for round in 0..150 {
                            let uid = format!("t{t}-r{round}");
                            let Some(r) = builds.reserve(&uid, slots).await else {
                                tokio::task::yield_now().await;
                                continue;
                            };
                            granted.fetch_add(1, Ordering::SeqCst);
                            let slot = usize::from(r.slot());
                            assert_eq!(
                                occupied[slot].fetch_add(1, Ordering::SeqCst),
                                0,
                                "slot {slot} held twice"
                            );
                            let now: usize = occupied.iter().map(|o| o.load(Ordering::SeqCst)).sum();
                            most.fetch_max(now, Ordering::SeqCst);
                            tokio::task::yield_now().await;
                            if round % 2 == 0 {
                                // Admitted: the attempt holds the slot until it is retired.
                                let key = attempt_in(&builds, &uid, AttemptState::Admitted, Some(r.slot())).await;
                                {
                                    let _core = builds.core.lock().await;
                                    r.admitted();
                                }
                                tokio::task::yield_now().await;
                                occupied[slot].fetch_sub(1, Ordering::SeqCst);
                                builds.core.lock().await.attempts.get_mut(&key).unwrap().state = AttemptState::Retired;
                            } else {
                                occupied[slot].fetch_sub(1, Ordering::SeqCst);
                                drop(r);
                            }
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
            let usable = usize::from(slots.min(2));
            assert!(
                most.load(Ordering::SeqCst) <= usable,
                "slots {slots}: {most:?} held at once"
            );
            assert!(granted.load(Ordering::SeqCst) > 0);
            assert!(builds.slots.is_empty());
            assert_eq!(builds.free_slots(slots).await, u32::try_from(usable).unwrap());
        }
    }

    #[tokio::test]
    async fn per_build_entries_hold_what_is_known_and_go_when_empty() {
        let (builds, _lock, _dir) = builds();
        let (handle, _signal) = crate::host::cancel_pair();
        builds.task_started("a", handle).await;
        builds.set_finalizer_owed("a", true).await;
        assert!(!builds.is_new("a").await);
        builds.task_ended("a").await;
        assert!(
            builds.core.lock().await.builds.contains_key("a"),
            "the finalizer is still owed"
        );
        builds.set_finalizer_owed("a", false).await;
        assert!(builds.core.lock().await.builds.is_empty());
        assert!(builds.is_new("a").await);
    }
}
