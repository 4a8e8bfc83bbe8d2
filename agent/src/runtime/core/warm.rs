//! The warm pool's share of [`Builds`]: its VMs as the journal has them, the builds waiting for a
//! slot a warm VM gives up, and where a claimed build runs. Under `Builds`' one lock, so a warm
//! VM's slot passes to the build that adopts it, or becomes free, in the same locked step as its
//! journal record, and a refill takes a slot only where no build holds or waits for one.
//!
//! A warm VM's records have no build and no attempt; they carry `warm` (its profile):
//! `[*] -> Booting` (its slot and deadline, before its clone), `Booting -> Running (GuestReady)`,
//! then either `Running -> Retired (Adopted)` (journaled in one write with the adopting attempt's
//! `Admitted` record) or `-> Retiring (Evicted | AgentRestarted | VMStartFailed)` and, once its
//! deletion is confirmed, `Retiring -> Retired (VMDeleted)` (or `-> Quarantined (DeleteFailed)`).

use super::{Builds, Core};
use crate::journal::JournalError;
use crate::machine::{Adoption, SlotHolder, free_slot};
use crate::pool::{self, Occupancy, Placement, PoolSpec, PoolStep, WarmPhase, WarmProfile, WarmVm, WhyDelete};
use crate::record::{Record, WARM_RECORD_VERSION};
use crate::recovery::WarmEntry;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::collections::BTreeSet;
use std::time::Duration;
use tartan_api::{AttemptState, MacBuildSpec, Reason};

use super::super::slots::{SlotBook, SlotReservation};

/// A warm VM as the agent knows it.
#[derive(Clone, Debug)]
pub(super) struct WarmState {
    profile: WarmProfile,
    slot: Option<u8>,
    /// Its last journaled state: `Booting`, `Running`, `Retiring` or `Quarantined`.
    state: AttemptState,
    /// When its clone was asked for.
    since: Timestamp,
    /// When it was recorded ready: its idle age (towards `max_idle`) counts from then, so a long
    /// pull or boot does not expire it before it could serve.
    ready_at: Option<Timestamp>,
    /// Left by an earlier run of the agent: deleted, never handed to a build.
    stale: bool,
    /// A build waits for its slot: the pool deletes it next.
    evict_for: Option<String>,
    /// A task of the pool works on it (its refill, or its deletion).
    busy: bool,
    /// Its refill task was told to stop (and delete it).
    cancelled: bool,
    /// A failed deletion is tried again from then on.
    retry_from: Option<std::time::Instant>,
}

impl WarmState {
    fn phase(&self) -> WarmPhase {
        match self.state {
            _ if self.stale || self.evict_for.is_some() => WarmPhase::Deleting,
            AttemptState::Booting => WarmPhase::Preparing,
            AttemptState::Running => WarmPhase::Ready,
            _ => WarmPhase::Deleting,
        }
    }

    fn holder(&self) -> SlotHolder {
        self.slot.map_or(SlotHolder::Unnumbered, SlotHolder::Slot)
    }
}

/// Where a claimed build runs, as [`Builds::place`] decided.
#[derive(Debug)]
pub enum Placed {
    /// A slot is reserved for it (with a warm VM to adopt, or cold).
    Reserved(SlotReservation),
    /// A warm VM gives its slot up for it (its deletion is asked for, or under way), or one that
    /// serves it is booting: claim it once that slot is free or that VM ready. No refill takes a
    /// slot meanwhile.
    Waiting,
    /// Builds hold every slot.
    Full,
}

/// What the pool's task is to do now; the first record of each is journaled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PoolWork {
    /// Clone and boot `vm` as `profile` (its `[*] -> Booting` record holds `slot`; the watchdog
    /// deletes it after `deadline`).
    Refill {
        vm: String,
        profile: WarmProfile,
        slot: u8,
        deadline: Timestamp,
    },
    /// Stop and delete `vm` (its `-> Retiring` record is journaled, or it is quarantined and
    /// tried again): it is no longer adoptable.
    Delete { vm: String },
    /// `vm` is still being prepared and must go: its refill task stops and deletes it.
    CancelRefill { vm: String },
}

/// The pool's counts since the agent started, for `/metrics`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PoolTally {
    /// Builds admitted into a warm VM.
    pub adoptions: u64,
    /// Builds admitted cold while the pool was configured.
    pub misses: u64,
    /// Warm VMs deleted for a build of another image.
    pub evictions: u64,
    /// Slot-seconds held by warm VMs without a build: those retired so far, plus the open ones'.
    pub idle_slot_seconds: f64,
    /// Warm VMs ready and not reserved, and warm VMs booting.
    pub ready: usize,
    pub preparing: usize,
}

/// How long after a failed deletion a warm VM's deletion is tried again.
const DELETE_RETRY: Duration = Duration::from_secs(30);

impl Core {
    /// Every warm VM's slot, except those a reservation stands for (a build adopts them).
    pub(super) fn warm_holders(&self, adopting: &BTreeSet<String>) -> Vec<SlotHolder> {
        self.warm
            .iter()
            .filter(|(vm, _)| !adopting.contains(*vm))
            .map(|(_, w)| w.holder())
            .collect()
    }

    /// The warm VMs for the pool's decisions, except those reserved for adoption.
    fn pool_vms(&self, adopting: &BTreeSet<String>, now: Timestamp) -> Vec<WarmVm> {
        self.warm
            .iter()
            .filter(|(vm, _)| !adopting.contains(*vm))
            .map(|(vm, w)| WarmVm {
                name: vm.clone(),
                profile: w.profile.clone(),
                phase: w.phase(),
                age: w.ready_at.map_or(Duration::ZERO, |at| {
                    Duration::try_from(at.duration_until(now)).unwrap_or_default()
                }),
            })
            .collect()
    }

    /// The host's `slots` apart from the pool's VMs `warm` (as [`Core::pool_vms`] lists them):
    /// the other holders, and the builds waiting for a slot when `count_waiting`.
    fn occupancy(&self, book: &SlotBook, slots: u8, warm: &[WarmVm], count_waiting: bool) -> Occupancy {
        let holders = self.slot_holders(book).len();
        let waiting = if count_waiting { self.waiting.len() } else { 0 };
        Occupancy {
            usable: slots.min(2),
            builds: u8::try_from(holders.saturating_sub(warm.len())).unwrap_or(u8::MAX),
            waiting: u8::try_from(waiting).unwrap_or(u8::MAX),
        }
    }

    /// Appends one warm VM's record and takes it in.
    fn journal_warm(&mut self, mut record: Record) -> Result<Record, JournalError> {
        tokio::task::block_in_place(|| self.journal.append(&mut record))?;
        tracing::info!(target: "journal", vm = record.vm.as_deref().unwrap_or_default(), "{record}");
        self.take_in_warm(&record);
        Ok(record)
    }

    /// The warm VM's `Running -> Retired (Adopted)` record to journal with `admitted`, when that
    /// is an adopting attempt's `Admitted` record.
    pub(super) fn handed_over(&self, admitted: &Record) -> Option<Record> {
        let (AttemptState::Admitted, Some(vm), Some(profile)) = (admitted.to, &admitted.vm, &admitted.warm) else {
            return None;
        };
        let state = self.warm.get(vm).map_or(AttemptState::Running, |w| w.state);
        let mut record = warm_record(vm, profile, Some(state), AttemptState::Retired);
        record.reason = Some(Reason::Adopted);
        record.slot = admitted.slot;
        let by = match (&admitted.build, admitted.attempt) {
            (Some(b), Some(n)) => format!("{b} a{n}"),
            _ => "a build".to_string(),
        };
        record.detail = format!("handed to {by} with its slot");
        Some(record)
    }

    /// Takes in a handed-over warm VM's journaled record: the attempt holds its slot now.
    pub(super) fn take_in_handed_over(&mut self, record: &Record) {
        tracing::info!(target: "journal", "{record}");
        self.take_in_warm(record);
    }

    /// Counts an admission: into a warm VM, or cold while the pool is on (a miss).
    pub(super) fn count_admission(&mut self, admitted: &Record, pool_on: bool) {
        if admitted.to != AttemptState::Admitted {
            return;
        }
        if admitted.warm.is_some() {
            self.pool_tally.adoptions += 1;
        } else if pool_on {
            self.pool_tally.misses += 1;
        }
    }

    /// Follows a warm VM's journaled record.
    fn take_in_warm(&mut self, record: &Record) {
        let (Some(vm), Some(profile)) = (&record.vm, &record.warm) else {
            return;
        };
        if record.to == AttemptState::Retired {
            self.warm_retired = true;
            if let Some(w) = self.warm.remove(vm) {
                self.pool_idle_seconds += w.since.duration_until(record.time).as_secs_f64().max(0.0);
            }
            return;
        }
        let entry = self.warm.entry(vm.clone()).or_insert_with(|| WarmState {
            profile: profile.clone(),
            slot: record.slot,
            state: record.to,
            since: record.time,
            ready_at: None,
            stale: false,
            evict_for: None,
            busy: false,
            cancelled: false,
            retry_from: None,
        });
        entry.state = record.to;
        entry.slot = record.slot.or(entry.slot);
        if record.to == AttemptState::Running && record.reason == Some(Reason::GuestReady) {
            entry.ready_at = Some(record.time);
        }
    }
}

/// A warm VM's record (no build, no attempt).
pub fn warm_record(vm: &str, w: &WarmProfile, from: Option<AttemptState>, to: AttemptState) -> Record {
    Record {
        version: WARM_RECORD_VERSION,
        seq: 0,
        time: Timestamp::now(),
        build: None,
        attempt: None,
        vm: Some(vm.to_string()),
        from,
        to,
        reason: None,
        detail: String::new(),
        outcome: None,
        slot: None,
        deadline: None,
        max_attempts: None,
        step: None,
        generation: None,
        status: None,
        warm: Some(w.clone()),
    }
}

impl Builds {
    /// Takes in the warm VMs an earlier run left open: each is deleted (never handed to a build)
    /// and holds its slot until then. One an attempt names was handed to it (the attempt's record
    /// was written, its own not): the attempt's recovery deals with it.
    pub(super) fn load_warm(core: &mut Core, warm: &[WarmEntry]) {
        for w in warm {
            if core.attempts.values().any(|a| a.vm == w.vm && a.state.may_have_vm()) {
                tracing::info!(vm = %w.vm, "warm VM of an earlier run was handed to a build; the build's recovery has it");
                continue;
            }
            core.warm.insert(
                w.vm.clone(),
                WarmState {
                    profile: w.profile.clone(),
                    slot: w.slot,
                    state: w.state,
                    since: w.since,
                    ready_at: None,
                    stale: true,
                    evict_for: None,
                    busy: false,
                    cancelled: false,
                    retry_from: None,
                },
            );
        }
    }

    /// Where the claimed build `uid` (spec `spec`) runs on a host of `slots` slots: in a ready warm
    /// VM that serves it (reserved for it to adopt), in a free slot, or, when only warm VMs hold
    /// the rest, in the slot of one the pool deletes for it. A build always wins over a refill.
    pub async fn place(&self, uid: &str, slots: u8, spec: &MacBuildSpec) -> Placed {
        let mut core = self.core.lock().await;
        let adopting = self.slots.adopting();
        let warm = core.pool_vms(&adopting, Timestamp::now());
        let holders = core.slot_holders(&self.slots);
        // Other waiting builds hold no slot against this one: whichever is placed first once a
        // slot is free takes it (counting them let two waiters block each other for ever).
        let occupancy = core.occupancy(&self.slots, slots, &warm, false);
        let placement = pool::place(spec, &warm, occupancy);
        match placement {
            Placement::Adopt(vm) => {
                let w = &core.warm[&vm];
                let (Some(slot), profile) = (w.slot, w.profile.clone()) else {
                    return Placed::Full;
                };
                core.waiting.remove(uid);
                Placed::Reserved(self.slots.reserve_adopting(uid, slot, Adoption { vm, profile }))
            }
            Placement::Cold => match free_slot(slots, &holders) {
                Some(slot) => {
                    core.waiting.remove(uid);
                    Placed::Reserved(self.slots.reserve_free(uid, slot))
                }
                None => Placed::Full,
            },
            Placement::Evict(vm) => {
                tracing::info!(%vm, build = uid, "a claimable build needs this warm VM's slot; evicting it");
                if let Some(w) = core.warm.get_mut(&vm) {
                    w.evict_for = Some(uid.to_string());
                }
                core.waiting.insert(uid.to_string());
                drop(core);
                self.pool_changed.notify_one();
                Placed::Waiting
            }
            Placement::AwaitReady(_) | Placement::AwaitDeletion => {
                core.waiting.insert(uid.to_string());
                Placed::Waiting
            }
            Placement::Full => Placed::Full,
        }
    }

    /// Forgets the builds waiting for a warm VM's slot that are no longer claimable here (taken
    /// elsewhere, finished, gone): their wait no longer holds refills back.
    pub async fn retain_waiting(&self, claimable: &BTreeSet<String>) {
        let mut core = self.core.lock().await;
        // A task waiting for a slot (a retry, an admission resumed at start) waits on.
        let waiting = std::mem::take(&mut core.waiting);
        core.waiting = waiting
            .into_iter()
            .filter(|uid| claimable.contains(uid) || core.has_task(uid))
            .collect();
    }

    /// Woken when the pool has something new to do (a build waits for a warm VM's slot).
    pub fn pool_changed(&self) -> &tokio::sync::Notify {
        &self.pool_changed
    }

    /// The images this host has a ready warm VM of, not reserved for a build (for its Lease).
    pub async fn ready_warm_images(&self) -> Vec<String> {
        let core = self.core.lock().await;
        pool::ready_images(&core.pool_vms(&self.slots.adopting(), Timestamp::now()))
    }

    /// The profiles of the ready warm VMs not reserved for a build: a build one of them serves
    /// is claimed at once here.
    pub async fn ready_warm_profiles(&self) -> Vec<WarmProfile> {
        let core = self.core.lock().await;
        core.pool_vms(&self.slots.adopting(), Timestamp::now())
            .into_iter()
            .filter(|w| w.phase == WarmPhase::Ready)
            .map(|w| w.profile)
            .collect()
    }

    /// The slots a build could be placed in now, warm ones included (a warm VM gives its slot
    /// up to a build): what the Lease publishes as free for other agents' claim waits.
    pub async fn claimable_slots(&self, slots: u8) -> u32 {
        let core = self.core.lock().await;
        let adopting = self.slots.adopting();
        let warm = core.pool_vms(&adopting, Timestamp::now());
        let occupancy = core.occupancy(&self.slots, slots, &warm, true);
        u32::from(pool::claimable_slots(&warm, occupancy))
    }

    /// The pool's counts for `/metrics`.
    pub async fn pool_tally(&self) -> PoolTally {
        let core = self.core.lock().await;
        let now = Timestamp::now();
        let vms = core.pool_vms(&self.slots.adopting(), now);
        let count = |phase| vms.iter().filter(|w| w.phase == phase).count();
        let open: f64 = core
            .warm
            .values()
            .map(|w| w.since.duration_until(now).as_secs_f64().max(0.0))
            .sum();
        PoolTally {
            idle_slot_seconds: core.pool_idle_seconds + open,
            ready: count(WarmPhase::Ready),
            preparing: count(WarmPhase::Preparing),
            ..core.pool_tally.clone()
        }
    }
}

impl Builds {
    /// One round of the pool's decisions over `spec` on a host of `slots` slots, taken and
    /// journaled in one locked step:
    /// stale and evicted VMs and those [`pool::plan`] drops are deleted (their `-> Retiring`
    /// records first), quarantined ones tried again, VMs still preparing are cancelled, and
    /// entries short of their size refilled into free slots (their `[*] -> Booting` records first).
    /// A VM a task already works on is left to it.
    pub async fn pool_round(&self, spec: &PoolSpec, slots: u8, now: Timestamp) -> Result<Vec<PoolWork>, JournalError> {
        let mut core = self.core.lock().await;
        let adopting = self.slots.adopting();
        let mut work = Vec::new();
        let done = owed_work(&mut core, &adopting, &mut work)
            .and_then(|()| self.planned_work(&mut core, spec, slots, now, &adopting, &mut work));
        if let Err(error) = done {
            // Nothing of this round is handed out: what it journaled is done by a later round (a
            // `Retiring` VM is deleted, a `Booting` one whose refill never started too).
            for w in &work {
                let (PoolWork::Refill { vm, .. } | PoolWork::Delete { vm } | PoolWork::CancelRefill { vm }) = w;
                if let Some(state) = core.warm.get_mut(vm) {
                    state.busy = matches!(w, PoolWork::CancelRefill { .. });
                    state.cancelled = false;
                }
            }
            return Err(error);
        }
        Ok(work)
    }

    /// What [`pool::plan`] asks for: expired and unwanted VMs deleted (or their refills
    /// cancelled), entries short of their size refilled into free slots.
    fn planned_work(
        &self,
        core: &mut Core,
        spec: &PoolSpec,
        slots: u8,
        now: Timestamp,
        adopting: &BTreeSet<String>,
        work: &mut Vec<PoolWork>,
    ) -> Result<(), JournalError> {
        let warm = core.pool_vms(adopting, now);
        let occupancy = core.occupancy(&self.slots, slots, &warm, true);
        for step in pool::plan(spec, &warm, occupancy) {
            match step {
                PoolStep::Delete { vm, why } if !core.warm.get(&vm).is_some_and(|w| w.busy) => {
                    let text = match why {
                        WhyDelete::Expired => format!("waited {:?} (max_idle) without a build", spec.max_idle),
                        WhyDelete::Unwanted => "the pool's configuration no longer asks for it".to_string(),
                    };
                    work.push(begin_delete(core, &vm, Some((Reason::Evicted, text)))?);
                }
                PoolStep::Delete { vm, .. } => cancel_refill(core, &vm, work),
                PoolStep::Refill { entry } => {
                    let holders = core.slot_holders(&self.slots);
                    let Some(slot) = free_slot(slots, &holders) else {
                        break;
                    };
                    let profile = spec.entries[entry].profile.clone();
                    let deadline = refill_deadline(now, spec.max_idle);
                    work.push(begin_refill(core, profile, slot, deadline)?);
                }
            }
        }
        Ok(())
    }

    /// The refill of `vm` ended: ready (`Booting -> Running (GuestReady)`), or not (`Booting ->
    /// Retiring` with the reason and detail given: `VMStartFailed`, or `Evicted` when it was
    /// cancelled; the refill task deletes it).
    pub async fn warm_booted(
        &self,
        vm: &str,
        outcome: Result<(SignedDuration, Timestamp), (Reason, String)>,
    ) -> Result<(), JournalError> {
        let mut core = self.core.lock().await;
        let Some(w) = core.warm.get(vm).cloned() else {
            return Ok(());
        };
        let mut record = warm_record(vm, &w.profile, Some(w.state), AttemptState::Running);
        match outcome {
            Ok((after, deadline)) => {
                record.deadline = Some(deadline);
                record.reason = Some(Reason::GuestReady);
                record.detail = format!("warm VM ready: tart exec answered after {:.2}s", after.as_secs_f64());
                if let Some(w) = core.warm.get_mut(vm) {
                    w.busy = false;
                }
            }
            Err((reason, detail)) => {
                if reason == Reason::Evicted && w.evict_for.is_some() {
                    core.pool_tally.evictions += 1;
                }
                record.to = AttemptState::Retiring;
                record.reason = Some(reason);
                record.detail = tartan_api::text::clean_str(&detail, 1024);
            }
        }
        crate::crash_point!("warm.booted.before");
        core.journal_warm(record)?;
        crate::crash_point!("warm.booted.after");
        drop(core);
        // A build may wait for this VM: the scan places it again.
        self.notify_slot_freed();
        self.pool_changed.notify_one();
        Ok(())
    }

    /// The deletion of `vm` ended: confirmed (`-> Retired (VMDeleted)`, its slot free), or not
    /// (`-> Quarantined (DeleteFailed)`, tried again after [`DELETE_RETRY`]).
    pub async fn warm_deleted(&self, vm: &str, outcome: Result<(), String>) -> Result<(), JournalError> {
        let mut core = self.core.lock().await;
        let Some(w) = core.warm.get(vm).cloned() else {
            return Ok(());
        };
        let mut record = warm_record(vm, &w.profile, Some(w.state), AttemptState::Retired);
        match &outcome {
            Ok(()) => {
                record.reason = Some(Reason::VMDeleted);
                record.detail = "warm VM deleted; its slot is free".to_string();
            }
            Err(error) => {
                record.to = AttemptState::Quarantined;
                record.reason = Some(Reason::DeleteFailed);
                record.detail = tartan_api::text::clean_str(
                    &format!("warm VM not deleted ({error}); tried again in {DELETE_RETRY:?}, its slot stays held"),
                    1024,
                );
            }
        }
        crate::crash_point!("warm.deleted.before");
        core.journal_warm(record)?;
        crate::crash_point!("warm.deleted.after");
        if let Some(w) = core.warm.get_mut(vm) {
            w.busy = false;
            w.retry_from = Some(std::time::Instant::now() + DELETE_RETRY);
        }
        drop(core);
        if outcome.is_ok() {
            self.notify_slot_freed();
        }
        self.pool_changed.notify_one();
        Ok(())
    }
}

/// The deletions owed whatever the plan says (stale, evicted for a build, a refill that never
/// started, a deletion to try again), and the refills to stop for a build.
fn owed_work(core: &mut Core, adopting: &BTreeSet<String>, work: &mut Vec<PoolWork>) -> Result<(), JournalError> {
    let owed: Vec<(String, Option<(Reason, String)>)> = core
        .warm
        .iter()
        .filter(|(vm, w)| !adopting.contains(*vm) && !w.busy)
        .filter_map(|(vm, w)| owed_deletion(w).map(|why| (vm.clone(), why)))
        .collect();
    for (vm, why) in owed {
        work.push(begin_delete(core, &vm, why)?);
    }
    // A VM still booting that a build waits for is stopped by its refill task.
    let booting: Vec<String> = core
        .warm
        .iter()
        .filter(|(_, w)| w.busy && w.state == AttemptState::Booting && w.evict_for.is_some())
        .map(|(vm, _)| vm.clone())
        .collect();
    for vm in booting {
        cancel_refill(core, &vm, work);
    }
    Ok(())
}

/// Asks `vm`'s refill task to stop (and delete it), once.
fn cancel_refill(core: &mut Core, vm: &str, work: &mut Vec<PoolWork>) {
    if let Some(w) = core.warm.get_mut(vm)
        && !w.cancelled
    {
        w.cancelled = true;
        work.push(PoolWork::CancelRefill { vm: vm.to_string() });
    }
}

/// Why `w` is owed a deletion now, if it is: `Some(None)` when its `-> Retiring` record exists
/// already (a retry), `Some(Some(reason, detail))` for the record to write first.
fn owed_deletion(w: &WarmState) -> Option<Option<(Reason, String)>> {
    match w.state {
        AttemptState::Retiring => Some(None),
        AttemptState::Quarantined => w
            .retry_from
            .is_none_or(|at| std::time::Instant::now() >= at)
            .then_some(None),
        _ if w.stale => Some(Some((
            Reason::AgentRestarted,
            "warm VM of an earlier agent run; deleted, never handed to a build".to_string(),
        ))),
        // Booting with no refill task: the round that journaled it failed before handing it out.
        AttemptState::Booting => Some(Some((
            Reason::VMStartFailed,
            "its refill never started (the journal failed in the same round); deleted".to_string(),
        ))),
        AttemptState::Running => w.evict_for.as_ref().map(|uid| {
            Some((
                Reason::Evicted,
                format!("build {uid} needs its slot (no warm VM serves it)"),
            ))
        }),
        _ => None,
    }
}

/// Journals `vm`'s `-> Retiring` record (unless `why` is `None`: it has one) and marks it busy.
fn begin_delete(core: &mut Core, vm: &str, why: Option<(Reason, String)>) -> Result<PoolWork, JournalError> {
    let w = core.warm[vm].clone();
    if let Some((reason, detail)) = why {
        if reason == Reason::Evicted && w.evict_for.is_some() {
            core.pool_tally.evictions += 1;
        }
        let mut record = warm_record(vm, &w.profile, Some(w.state), AttemptState::Retiring);
        record.reason = Some(reason);
        record.detail = detail;
        crate::crash_point!("warm.evict.before");
        core.journal_warm(record)?;
        crate::crash_point!("warm.evict.after");
    }
    if let Some(w) = core.warm.get_mut(vm) {
        w.busy = true;
    }
    Ok(PoolWork::Delete { vm: vm.to_string() })
}

/// Journals a new warm VM's `[*] -> Booting` record into `slot` and marks it busy (its refill).
fn begin_refill(
    core: &mut Core,
    profile: WarmProfile,
    slot: u8,
    deadline: Timestamp,
) -> Result<PoolWork, JournalError> {
    let seq = core.journal.next_seq();
    let vm = warm_vm_name(seq);
    let mut record = warm_record(&vm, &profile, None, AttemptState::Booting);
    record.slot = Some(slot);
    record.deadline = Some(deadline);
    record.detail = format!("warm VM {vm} of {} into slot {}: cloning", profile.image, slot + 1);
    crate::crash_point!("warm.refill.before");
    core.journal_warm(record)?;
    crate::crash_point!("warm.refill.after");
    if let Some(w) = core.warm.get_mut(&vm) {
        w.busy = true;
    }
    Ok(PoolWork::Refill {
        vm,
        profile,
        slot,
        deadline,
    })
}

/// A warm VM's name: the warm prefix (Tartan's, so recovery and the watchdog know it, and never
/// a build VM's), the journal sequence of its first record (unique in this journal) and a
/// checksum of the clock (unique beyond it).
pub fn warm_vm_name(seq: u64) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let salt = crc32fast::hash(&nanos.to_le_bytes());
    format!("{}{seq}-{salt:08x}", tartan_api::WARM_VM_PREFIX)
}

/// How long a refill's clone (an image pull included) and boot may take: its deadline file lies
/// this much further out until the VM is ready, then it is rewritten from then on.
pub const REFILL_ALLOWANCE: Duration = Duration::from_secs(3600);

/// A refill's deadline: [`warm_deadline`] plus [`REFILL_ALLOWANCE`].
pub fn refill_deadline(now: Timestamp, max_idle: Duration) -> Timestamp {
    warm_deadline(now, max_idle + REFILL_ALLOWANCE)
}

/// How long past `max_idle` a warm VM's deadline file lies: the pool deletes an expired warm VM
/// within a round (every few seconds); the watchdog only when the agent could not.
pub const WARM_DEADLINE_MARGIN: Duration = Duration::from_secs(60);

/// A ready warm VM's deadline for the watchdog: `max_idle` from `now` (its readiness), plus
/// [`WARM_DEADLINE_MARGIN`].
pub fn warm_deadline(now: Timestamp, max_idle: Duration) -> Timestamp {
    let life = SignedDuration::try_from(max_idle + WARM_DEADLINE_MARGIN).unwrap_or(SignedDuration::MAX);
    now.checked_add(life).unwrap_or(Timestamp::MAX)
}

#[cfg(test)]
mod tests;
