//! Recovery at agent start (docs/resume.md), as one pure planner.
//!
//! [`plan`] reads the replayed journal, tart's VM list and what the cluster says about each
//! MacBuild, and returns ordered [`RecoveryAction`]s. It decides nothing the attempt machine
//! decides: every transition it wants goes through [`machine::step`] as an [`Event`], so the
//! rules (outcomes, retries, slots, deletion wording) live in one place. Some events need I/O
//! first: [`RecoveryAction::KillVmProcesses`] kills, and its count becomes the event
//! ([`Ending::event`]), which is how "killed N tart process(es)" reaches the journal; a delete's
//! result becomes `VmDeleted`/`DeleteFailed` through [`DeleteContext::deleted`].
//!
//! The runtime performs the actions in order. For each one that leads into the machine it runs
//! that attempt's `step → journal → act → event` loop to rest before the next action (rest =
//! `Retired`, `Quarantined` waiting for its retry, or `Requested` waiting for a slot). Admissions
//! wait until the whole plan is done, so quarantined unknown VMs block their slots first.
//!
//! [`machine::step`]: crate::machine::step

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use tartan_api::{AttemptState, Reason, VM_PREFIX};

use crate::machine::{
    self, Action, Attempt, AttemptKey, Config, DeleteContext, Event, NextAttempt, SlotHolder, attempt_holders,
    decide_retry, free_slot,
};
use crate::record::{BuildRef, PLAIN_RECORD_VERSION, Record};

/// This agent's identity: the claim holder name it writes into MacBuilds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentId(pub String);

/// One entry of `tart list --format json` (local VMs only).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObservedVm {
    pub name: String,
    pub running: bool,
}

/// The claim a MacBuild's status names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimView {
    pub holder: String,
    pub attempt: u32,
}

/// What the cluster says about one MacBuild that exists.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildView {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The owner (CustomRun) is gone, or the MacBuild's ownerReference points at nothing.
    pub owner_deleted: bool,
    /// `metadata.deletionTimestamp` is set (our finalizer holds it).
    pub deletion_requested: bool,
    /// Cancellation was requested through the MacBuild.
    pub cancel_requested: bool,
    pub claim: Option<ClaimView>,
    /// `status.journalSeq`: the journal record whose status the cluster holds.
    pub journal_seq: Option<u64>,
    /// `spec.maxAttempts` (1–3), `None` for the default.
    pub max_attempts: Option<u8>,
    pub timeout_seconds: u32,
    /// Our finalizer is still on the object.
    pub has_finalizer: bool,
    /// `metadata.generation`: an attempt is resumed only on the generation it started with.
    pub generation: Option<i64>,
}

/// The MacBuilds that exist. A build absent here is gone (its uid is not found).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClusterView {
    pub builds: Vec<BuildView>,
    /// Assumed from the journal while the cluster cannot be read ([`ClusterView::as_journaled`]):
    /// nothing that needs the cluster's word (a claim still ours, no cancel) is decided with it.
    pub assumed: bool,
}

impl ClusterView {
    /// What recovery assumes while the cluster cannot be read: every build the journal names
    /// still exists as the journal left it — not withdrawn, claimed by `me` for its latest
    /// attempt, holding its latest record, under the journal's `maxAttempts`. Only the host side
    /// of the plan made with it is acted on ([`host_side`]); the rest waits for the real view.
    pub fn as_journaled(rp: &Replay, me: &AgentId) -> ClusterView {
        ClusterView {
            builds: rp
                .latest_by_build()
                .into_values()
                .map(|a| BuildView {
                    namespace: a.build.namespace.clone(),
                    name: a.build.name.clone(),
                    uid: a.build.uid.clone(),
                    owner_deleted: false,
                    deletion_requested: false,
                    cancel_requested: false,
                    claim: Some(ClaimView {
                        holder: me.0.clone(),
                        attempt: a.number,
                    }),
                    journal_seq: a.last_seq,
                    max_attempts: Some(a.max_attempts),
                    timeout_seconds: 0,
                    has_finalizer: false,
                    generation: a.generation,
                })
                .collect(),
            assumed: true,
        }
    }

    /// The MacBuild an attempt belongs to, by uid (a recreated MacBuild of the same name is another build).
    pub fn get(&self, build: &BuildRef) -> Option<&BuildView> {
        self.builds.iter().find(|b| b.uid == build.uid)
    }
}

/// A VM with our prefix that no attempt accounts for, quarantined in the journal and not yet gone.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownVm {
    pub vm: String,
    pub slot: Option<u8>,
}

/// A warm VM of the pool that its records leave open (not `Retired`): it holds its slot until
/// its deletion is confirmed (or it was handed to a build).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WarmEntry {
    pub vm: String,
    pub profile: crate::pool::WarmProfile,
    /// Its last recorded state: `Booting` (cloned or being cloned), `Running` (ready),
    /// `Retiring` (its deletion asked for) or `Quarantined` (its deletion failed).
    pub state: AttemptState,
    pub slot: Option<u8>,
    /// Its first record's time: when its clone was asked for.
    pub since: Timestamp,
}

/// The journal folded into attempts, open unknown-VM quarantines and open warm VMs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Replay {
    /// Every attempt, in the order of its first record.
    pub attempts: Vec<Attempt>,
    /// Unknown VMs quarantined and not resolved.
    pub unknown: Vec<UnknownVm>,
    /// Warm VMs not retired.
    pub warm: Vec<WarmEntry>,
}

/// Folds replayed records. `max_attempts` comes from each attempt's `Requested` record (journals
/// written before it was recorded: `default_max_attempts`); the cluster's view may override it
/// (see [`Replay::see`]).
pub fn replay(records: &[Record], cfg: &Config) -> Replay {
    let mut out = Replay::default();
    let mut index: BTreeMap<(String, u32), usize> = BTreeMap::new();
    for r in records {
        match (&r.build, r.attempt) {
            (Some(build), Some(n)) => match index.get(&(build.uid.clone(), n)) {
                Some(&i) => out.attempts[i].observe(r),
                None => {
                    if let Some(a) = Attempt::from_record(r, cfg.default_max_attempts) {
                        index.insert((build.uid.clone(), n), out.attempts.len());
                        out.attempts.push(a);
                    }
                }
            },
            (None, _) if r.warm.is_some() => fold_warm(&mut out.warm, r),
            (None, _) => {
                let Some(vm) = &r.vm else { continue };
                out.unknown.retain(|u| &u.vm != vm);
                if r.to == AttemptState::Quarantined {
                    out.unknown.push(UnknownVm {
                        vm: vm.clone(),
                        slot: r.slot,
                    });
                }
            }
            // A build without an attempt number is not a record this agent writes.
            (Some(_), None) => {}
        }
    }
    out
}

/// Folds one record of a warm VM into the open ones.
fn fold_warm(warm: &mut Vec<WarmEntry>, r: &Record) {
    let (Some(vm), Some(profile)) = (&r.vm, &r.warm) else {
        return;
    };
    // Only a warm VM's name is the pool's to delete: a record naming any other VM (a damaged or
    // edited journal) is not taken in; such a VM, if present, is an unknown VM, never deleted.
    if !tartan_api::is_warm_vm(vm) || tartan_api::check_vm_name(vm).is_err() {
        tracing::warn!(target: "journal", %vm, seq = r.seq, "a warm pool record names a VM that is no warm VM; ignored");
        return;
    }
    match warm.iter_mut().find(|w| &w.vm == vm) {
        _ if r.to == AttemptState::Retired => warm.retain(|w| &w.vm != vm),
        Some(w) => {
            w.state = r.to;
            w.slot = r.slot.or(w.slot);
        }
        None => warm.push(WarmEntry {
            vm: vm.clone(),
            profile: profile.clone(),
            state: r.to,
            slot: r.slot,
            since: r.time,
        }),
    }
}

impl Replay {
    /// The attempt with the highest number of each build (by uid).
    pub fn latest_by_build(&self) -> BTreeMap<&str, &Attempt> {
        let mut latest: BTreeMap<&str, &Attempt> = BTreeMap::new();
        for a in &self.attempts {
            let e = latest.entry(a.build.uid.as_str()).or_insert(a);
            if a.number > e.number {
                *e = a;
            }
        }
        latest
    }

    /// Applies what only the cluster knows: each attempt's `maxAttempts`, and whether its
    /// MacBuild is gone (then nothing is delivered to it and no finalizer is removed).
    pub fn see(&mut self, cluster: &ClusterView, cfg: &Config) {
        for a in &mut self.attempts {
            match cluster.get(&a.build) {
                Some(b) => a.max_attempts = b.max_attempts.unwrap_or(cfg.default_max_attempts),
                None => a.build_gone = true,
            }
        }
    }

    /// Every slot holder: attempts in slot-holding states, quarantined unknown VMs and open
    /// warm VMs.
    pub fn slot_holders(&self) -> Vec<SlotHolder> {
        let mut h = attempt_holders(&self.attempts);
        h.extend(
            self.unknown
                .iter()
                .map(|u| u.slot)
                .chain(self.warm.iter().map(|w| w.slot))
                .map(|slot| slot.map_or(SlotHolder::Unnumbered, SlotHolder::Slot)),
        );
        h
    }
}

/// How an open attempt found at agent start ends, once its tart processes are killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The process that ran it is gone: `Interrupted`, a retry may follow.
    AgentRestarted,
    /// Cancelled, or the MacBuild was deleted (or is gone) while the agent was down.
    CancelRequested,
    /// The owner was deleted while the agent was down.
    OwnerDeleted,
    /// Past the host execution deadline with the VM still there.
    DeadlinePassed,
    /// The MacBuild's spec changed while the agent was down (generation `then` when the attempt
    /// started, `now` at agent start): the attempt is not resumed, it is interrupted.
    SpecChanged { then: i64, now: i64 },
}

impl Ending {
    /// The event to step once `killed` tart processes were killed.
    pub fn event(self, killed: u32) -> Event {
        match self {
            Ending::AgentRestarted => Event::AgentRestarted { killed },
            Ending::CancelRequested => Event::CancelRequested { at_start: Some(killed) },
            Ending::OwnerDeleted => Event::OwnerDeleted { at_start: Some(killed) },
            Ending::DeadlinePassed => Event::DeadlinePassed { at_start: Some(killed) },
            Ending::SpecChanged { then, now } => Event::SpecChanged {
                change: format!("generation {then} when the attempt started, {now} now"),
                at_start: Some(killed),
            },
        }
    }
}

/// One step of recovery, performed in order (see the module doc for how each feeds the machine).
#[derive(Clone, Debug, PartialEq)]
pub enum RecoveryAction {
    /// Journal [`RecoveryAction::record`] (`[*] -> Quarantined (UnknownVM)`); never delete the
    /// VM; it blocks `slot` (or, unnumbered, one of the slots left) until an operator removes it.
    QuarantineUnknownVm {
        vm: String,
        running: bool,
        slot: Option<u8>,
    },
    /// A quarantined unknown VM is gone: journal `Quarantined -> Retired (Resolved)`.
    ResolveUnknownVm { vm: String, slot: Option<u8> },
    /// Kill the VM's surviving tart processes (count them), then step `then.event(count)`.
    /// The only I/O before its record: the count belongs in the record, and the kill is safe to
    /// repeat (the process that ran the attempt is gone; after a crash here it finds 0).
    KillVmProcesses {
        attempt: AttemptKey,
        found: AttemptState,
        vm: String,
        then: Ending,
    },
    /// The attempt's VM still runs and the cluster says the build is ours and wanted: ask the
    /// guest whether it answers (bounded); if it does, step `Resume` and follow the attempt from
    /// where the journal left it; if not, kill the VM's tart processes and step `AgentRestarted`
    /// (as [`RecoveryAction::KillVmProcesses`] would). With `clone_again` (found `Admitted` or
    /// `Booting`, the VM absent: the clone never finished) the guest is not asked: a clone the
    /// previous agent left running is killed, and if the VM is still absent the boot starts
    /// (over) with its clone.
    Resume {
        attempt: AttemptKey,
        found: AttemptState,
        vm: String,
        clone_again: bool,
    },
    /// Step this event now; no I/O is needed first.
    Step { attempt: AttemptKey, event: Event },
    /// Delete the VM without a new transition first (`Retiring`: finish the deletion, keeping
    /// the outcome; `Quarantined`: the retry). The result becomes
    /// `VmDeleted { how: context.deleted(took) }` or `DeleteFailed { context, .. }`.
    DeleteVm {
        attempt: AttemptKey,
        vm: String,
        context: DeleteContext,
    },
    /// A watchdog retirement was in progress: confirm the VM is gone without touching it
    /// (`VmDeleted { how: ByWatchdog }`, else `DeleteFailed { context: Watchdog, .. }`).
    ConfirmVmGone { attempt: AttemptKey, vm: String },
    /// A `Requested` attempt whose claim we hold (or, for a retry, whose previous attempt's claim
    /// we hold): perform `ClaimBuild` for it again (idempotent), then `Admit` it with `timeout`
    /// once a slot is free (if refused with `RetryWindowClosed`, step `DeadlinePassed` instead).
    ResumeAdmission {
        attempt: AttemptKey,
        timeout: SignedDuration,
    },
    /// The cluster holds an older record of this attempt: submit the status saved in record `seq`.
    RedeliverStatus { attempt: AttemptKey, seq: u64 },
    /// The last record owes the next attempt: journal `machine::request` for it (then claim).
    AdmitNextAttempt { next: NextAttempt },
    /// The VM is confirmed gone and no attempt follows: remove our finalizer.
    RemoveFinalizer { build: BuildRef },
}

impl RecoveryAction {
    /// The build the action is for; `None` for the unknown-VM actions, which have no build.
    pub fn build(&self) -> Option<&BuildRef> {
        match self {
            RecoveryAction::KillVmProcesses { attempt, .. }
            | RecoveryAction::Resume { attempt, .. }
            | RecoveryAction::Step { attempt, .. }
            | RecoveryAction::DeleteVm { attempt, .. }
            | RecoveryAction::ConfirmVmGone { attempt, .. }
            | RecoveryAction::ResumeAdmission { attempt, .. }
            | RecoveryAction::RedeliverStatus { attempt, .. } => Some(&attempt.build),
            RecoveryAction::AdmitNextAttempt { next } => Some(&next.build),
            RecoveryAction::RemoveFinalizer { build } => Some(build),
            RecoveryAction::QuarantineUnknownVm { .. } | RecoveryAction::ResolveUnknownVm { .. } => None,
        }
    }

    /// The recovery action for the deletion an attempt in `Retiring`/`Quarantined` still owes
    /// ([`machine::continue_retirement`], the one place that decides it).
    fn finishing(attempt: AttemptKey, owed: Action) -> RecoveryAction {
        match owed {
            Action::ConfirmVmGone { vm } => RecoveryAction::ConfirmVmGone { attempt, vm },
            Action::StopAndDeleteVm { vm, context } => RecoveryAction::DeleteVm { attempt, vm, context },
            Action::RetryDeleteLater { vm, .. } => RecoveryAction::DeleteVm {
                attempt,
                vm,
                context: DeleteContext::Retry,
            },
            other => unreachable!("continue_retirement owes a deletion, not {other:?}"),
        }
    }

    /// The record to journal for the actions that journal without an attempt (unknown VMs).
    pub fn record(&self, seq: u64, now: Timestamp) -> Option<Record> {
        let (vm, slot, from, to, reason, detail) = match self {
            RecoveryAction::QuarantineUnknownVm { vm, running, slot } => (
                vm,
                *slot,
                None,
                AttemptState::Quarantined,
                Reason::UnknownVM,
                format!(
                    "{vm} ({}) has no open attempt; left to an operator, {}",
                    if *running { "running" } else { "stopped" },
                    match slot {
                        Some(s) => format!("slot {} blocked", s + 1),
                        None => "one slot blocked".to_string(),
                    }
                ),
            ),
            RecoveryAction::ResolveUnknownVm { vm, slot } => (
                vm,
                *slot,
                Some(AttemptState::Quarantined),
                AttemptState::Retired,
                Reason::Resolved,
                format!("{vm} is gone (removed by an operator); slot released"),
            ),
            _ => return None,
        };
        Some(Record {
            version: PLAIN_RECORD_VERSION,
            seq,
            time: now,
            build: None,
            attempt: None,
            vm: Some(vm.clone()),
            from,
            to,
            reason: Some(reason),
            detail,
            outcome: None,
            slot,
            deadline: None,
            max_attempts: None,
            step: None,
            generation: None,
            status: None,
            warm: None,
        })
    }
}

impl fmt::Display for RecoveryAction {
    /// The log line for the action (the runtime logs it under the `recovery` target).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecoveryAction::QuarantineUnknownVm { vm, .. } => {
                write!(
                    f,
                    "{vm} has no open attempt; quarantining it as UnknownVM (never deleted)"
                )
            }
            RecoveryAction::ResolveUnknownVm { vm, .. } => write!(f, "unknown VM {vm} is gone; releasing its slot"),
            RecoveryAction::KillVmProcesses {
                attempt,
                found,
                vm,
                then,
            } => {
                write!(
                    f,
                    "{attempt} found {found} at agent start; killing tart processes of {vm} ({then:?})"
                )
            }
            RecoveryAction::Resume {
                attempt,
                found,
                vm,
                clone_again: false,
            } => write!(
                f,
                "{attempt} found {found} at agent start with {vm} running; resuming it if the guest answers"
            ),
            RecoveryAction::Resume {
                attempt,
                found,
                vm,
                clone_again: true,
            } => write!(
                f,
                "{attempt} found {found} at agent start before {vm} was cloned; cloning it once the Lease is live"
            ),
            RecoveryAction::Step { attempt, event } => write!(f, "{attempt}: {}", event.kind()),
            RecoveryAction::DeleteVm { attempt, vm, .. } => write!(f, "{attempt}: finishing the deletion of {vm}"),
            RecoveryAction::ConfirmVmGone { attempt, vm } => {
                write!(f, "{attempt}: confirming the watchdog deleted {vm}")
            }
            RecoveryAction::ResumeAdmission { attempt, .. } => {
                write!(f, "{attempt} holds its claim; admitting it once a slot is free")
            }
            RecoveryAction::RedeliverStatus { seq, .. } => {
                write!(f, "status behind journal (record {seq}); delivering it again")
            }
            RecoveryAction::AdmitNextAttempt { next } => write!(
                f,
                "{} a{} was interrupted; requesting a{} (deadline {} kept)",
                next.build,
                next.attempt - 1,
                next.attempt,
                next.deadline
            ),
            RecoveryAction::RemoveFinalizer { build } => {
                write!(
                    f,
                    "{build}: VM confirmed gone and no attempt follows; removing the finalizer"
                )
            }
        }
    }
}

/// The builds whose recovery needs no cluster: their latest attempt may have a VM (Admitted to
/// Quarantined), so killing, deleting and journaling it is the host's own business. Builds whose
/// latest attempt is `Requested` or `Retired` (claims, redelivery, owed retries, finalizers) need
/// the cluster's view first.
pub fn host_side(rp: &Replay) -> BTreeSet<String> {
    rp.latest_by_build()
        .into_iter()
        // Without a journaled maxAttempts the retry decision waits for the cluster too.
        .filter(|(_, a)| a.state.may_have_vm() && a.max_attempts_journaled)
        .map(|(uid, _)| uid.to_string())
        .collect()
}

/// Plans recovery at agent start. Pure: `now` is an argument; see [`RecoveryAction`] for order.
///
/// Order: unknown VMs first (so their slots are blocked before anything is admitted), then every
/// open attempt in journal order, then finished builds (redelivery, owed retries, finalizers).
pub fn plan(
    replayed: &[Record],
    vms: &[ObservedVm],
    cluster: &ClusterView,
    me: &AgentId,
    now: Timestamp,
    cfg: &Config,
) -> Vec<RecoveryAction> {
    let mut rp = replay(replayed, cfg);
    rp.see(cluster, cfg);
    let attempts = &rp.attempts;
    // Never touch (or even account for) a VM without our prefix.
    let ours: Vec<&ObservedVm> = vms.iter().filter(|v| v.name.starts_with(VM_PREFIX)).collect();
    let mut out = Vec::new();

    // 1. Unknown VMs: resolve the gone ones, quarantine new ones into the lowest free slot.
    plan_unknown_vms(&rp, &ours, cfg, &mut out);

    // 2. Open attempts, each from its last recorded transition.
    for a in attempts {
        let b = cluster.get(&a.build);
        let withdrawal = withdrawal(b);
        let key = a.key();
        match a.state {
            AttemptState::Requested => {
                let claim_mine = b
                    .and_then(|b| b.claim.as_ref())
                    .is_some_and(|c| is_mine_or_followed(c, me, a.number));
                out.push(requested(a, b, withdrawal, claim_mine, now, cfg));
            }
            AttemptState::Admitted | AttemptState::Booting | AttemptState::Running | AttemptState::Collecting => {
                out.push(open_with_vm(a, &ours, cluster, me, now, cfg));
            }
            AttemptState::Retiring | AttemptState::Quarantined => {
                // The outcome is kept; a withdrawal is recorded once so that no retry follows.
                // Its transition carries the deletion still owed (the machine never lets a
                // withdrawal stop it), so nothing else is planned for the attempt then.
                if let (Some(w), None) = (withdrawal, a.withdrawn) {
                    let event = match w {
                        Ending::OwnerDeleted => Event::OwnerDeleted { at_start: Some(0) },
                        _ => Event::CancelRequested { at_start: Some(0) },
                    };
                    out.push(RecoveryAction::Step { attempt: key, event });
                    continue;
                }
                out.push(RecoveryAction::finishing(
                    key,
                    machine::continue_retirement(a, cfg, Some(0)),
                ));
            }
            AttemptState::Retired => {}
        }
    }

    // 3. Finished builds: the last attempt of each build, if it is Retired.
    plan_finished_builds(attempts, cluster, me, now, cfg, &mut out);
    out
}

/// Step 1 of [`plan`]: unknown VMs journaled earlier that are gone are resolved; VMs with our
/// prefix that no attempt accounts for are quarantined into the lowest free slot.
fn plan_unknown_vms(rp: &Replay, ours: &[&ObservedVm], cfg: &Config, out: &mut Vec<RecoveryAction>) {
    let attempts = &rp.attempts;
    let present = |vm: &str| ours.iter().any(|v| v.name == vm);
    let mut holders = attempt_holders(attempts);
    holders.extend(
        rp.warm
            .iter()
            .map(|w| w.slot.map_or(SlotHolder::Unnumbered, SlotHolder::Slot)),
    );
    for u in &rp.unknown {
        if present(&u.vm) {
            holders.push(u.slot.map_or(SlotHolder::Unnumbered, SlotHolder::Slot));
        } else {
            out.push(RecoveryAction::ResolveUnknownVm {
                vm: u.vm.clone(),
                slot: u.slot,
            });
        }
    }
    let accounted: BTreeSet<&str> = attempts
        .iter()
        .filter(|a| a.state.may_have_vm())
        .map(|a| a.vm.as_str())
        .chain(rp.unknown.iter().map(|u| u.vm.as_str()))
        // The pool's own VMs are the pool's to delete (the runtime does, first thing).
        .chain(rp.warm.iter().map(|w| w.vm.as_str()))
        .collect();
    let mut strays: Vec<&&ObservedVm> = ours.iter().filter(|v| !accounted.contains(v.name.as_str())).collect();
    strays.sort_by(|a, b| a.name.cmp(&b.name));
    for v in strays {
        let slot = free_slot(cfg.slots, &holders);
        holders.push(slot.map_or(SlotHolder::Unnumbered, SlotHolder::Slot));
        out.push(RecoveryAction::QuarantineUnknownVm {
            vm: v.name.clone(),
            running: v.running,
            slot,
        });
    }
}

/// Step 2 of [`plan`] for an attempt that may have a VM (Admitted to Collecting): resume it, or
/// kill its VM's processes and end it, or record that the watchdog removed its VM.
fn open_with_vm(
    a: &Attempt,
    ours: &[&ObservedVm],
    cluster: &ClusterView,
    me: &AgentId,
    now: Timestamp,
    cfg: &Config,
) -> RecoveryAction {
    let b = cluster.get(&a.build);
    let withdrawal = withdrawal(b);
    let key = a.key();
    let present = |vm: &str| ours.iter().any(|v| v.name == vm);
    let overdue = a.deadline.filter(|d| now >= *d);
    let vm_existed = a.state != AttemptState::Admitted;
    let watchdog = overdue.is_some_and(|d| {
        vm_existed && !present(&a.vm) && now >= d.checked_add(cfg.watchdog_grace).unwrap_or(Timestamp::MAX)
    });
    let claim_mine = b
        .and_then(|b| b.claim.as_ref())
        .is_some_and(|c| is_mine(c, me, a.number));
    let vm_running = ours.iter().any(|v| v.name == a.vm && v.running);
    // The spec the attempt runs is the one of the generation it started with: one
    // changed meanwhile (a step removed, say) is not followed from the old step's
    // index. A journal from before generations were recorded cannot tell; the
    // executor then refuses a step index past the end of the steps.
    let spec_changed = match (a.generation, b.and_then(|b| b.generation)) {
        (Some(then), Some(now)) if then != now => Some(Ending::SpecChanged { then, now }),
        _ => None,
    };
    // Admitted, or a boot whose clone never finished (stopped mid-pull): nothing
    // exists to lose, and the boot is made (again) within the same attempt.
    // An adopted attempt's VM was the pool's, booted before it: gone, it is never cloned again
    // under its name (the machine refuses `Boot` for it); the attempt is interrupted instead.
    let clone_again =
        matches!(a.state, AttemptState::Admitted | AttemptState::Booting) && !present(&a.vm) && !a.adopted;
    // Resume only on the cluster's word that the build is still ours and wanted, and
    // only what got as far as a running VM, or has no VM yet.
    let resumable = cfg.resume_after_restart
        && !cluster.assumed
        && ((vm_existed && vm_running) || clone_again)
        && claim_mine
        && withdrawal.is_none()
        && overdue.is_none()
        && spec_changed.is_none();
    if resumable {
        return RecoveryAction::Resume {
            attempt: key,
            found: a.state,
            vm: a.vm.clone(),
            clone_again,
        };
    }
    // Past the deadline it is the reason even with a cancel waiting, as in the
    // executor: both are seen only now, the time was up first, and the watchdog may
    // have deleted the VM since. An owner deleted while the agent was down is
    // recorded Cancelled (no pipeline is told), and a MacBuild that is gone is told
    // nothing: their withdrawals are recorded as they were.
    let deadline_first = overdue.is_some() && b.is_some() && withdrawal != Some(Ending::OwnerDeleted);
    let then = match withdrawal {
        Some(w) if !deadline_first => w,
        // The VM is gone past deadline + grace: the watchdog took it; do not touch it.
        _ if watchdog => {
            return RecoveryAction::Step {
                attempt: key,
                event: Event::WatchdogRemovedVm,
            };
        }
        _ if overdue.is_some() => Ending::DeadlinePassed,
        _ => spec_changed.unwrap_or(Ending::AgentRestarted),
    };
    RecoveryAction::KillVmProcesses {
        attempt: key,
        found: a.state,
        vm: a.vm.clone(),
        then,
    }
}

/// Step 3 of [`plan`]: for each build whose last attempt is Retired and still ours, redeliver a
/// status the cluster has not seen, admit a retry the journal owes, or remove the finalizer.
fn plan_finished_builds(
    attempts: &[Attempt],
    cluster: &ClusterView,
    me: &AgentId,
    now: Timestamp,
    cfg: &Config,
    out: &mut Vec<RecoveryAction>,
) {
    let mut last: BTreeMap<&str, u32> = BTreeMap::new();
    for a in attempts {
        let n = last.entry(a.build.uid.as_str()).or_insert(a.number);
        *n = (*n).max(a.number);
    }
    for a in attempts.iter().filter(|a| a.state == AttemptState::Retired) {
        if last[a.build.uid.as_str()] != a.number {
            continue;
        }
        // A gone MacBuild gets nothing delivered; one another agent (or attempt) holds is not ours.
        // A retry that ended before its claim was written is ours under the claim it follows:
        // its end is delivered under that claim (`delivery::claim_to_test`).
        let Some(b) = cluster.get(&a.build) else { continue };
        if !b.claim.as_ref().is_some_and(|c| is_mine_or_followed(c, me, a.number)) {
            continue;
        }
        let Some(seq) = a.last_seq else { continue };
        // Equal or not: a seq the MacBuild shows under our claim may be an earlier holder's,
        // from another agent's journal (a claim writes none).
        if b.journal_seq != Some(seq) {
            out.push(RecoveryAction::RedeliverStatus { attempt: a.key(), seq });
        }
        // Did the last record's own actions admit a next attempt? Decide as of that record,
        // from the journal alone, exactly as `step` did then.
        let as_journaled = Attempt {
            build_gone: false,
            ..a.clone()
        };
        let owed = a.last_time.and_then(|t| decide_retry(&as_journaled, t, cfg).ok());
        match owed {
            Some(next) => {
                let mut a2 = Attempt::new(a.build.clone(), next.attempt, String::new(), a.max_attempts);
                a2.deadline = Some(next.deadline);
                out.push(RecoveryAction::AdmitNextAttempt { next });
                // The claim for the new attempt is part of its request; then the same rules
                // as for any attempt found in Requested.
                out.push(requested(&a2, Some(b), withdrawal(Some(b)), true, now, cfg));
            }
            None if b.has_finalizer => out.push(RecoveryAction::RemoveFinalizer { build: a.build.clone() }),
            None => {}
        }
    }
}

/// What to do with an attempt in `Requested` at agent start (nothing was cloned for it).
fn requested(
    a: &Attempt,
    b: Option<&BuildView>,
    withdrawal: Option<Ending>,
    claim_mine: bool,
    now: Timestamp,
    cfg: &Config,
) -> RecoveryAction {
    let key = a.key();
    let event = match (withdrawal, b) {
        (Some(Ending::OwnerDeleted), _) => Event::OwnerDeleted { at_start: None },
        (Some(_), _) => Event::CancelRequested { at_start: None },
        // A first attempt nobody holds: the agent died before its claim write, which is made
        // now (fenced like any first claim); recording it lost would leave the build unclaimed.
        (None, Some(b)) if !(claim_mine || a.number == 1 && b.claim.is_none()) => Event::ClaimLost {
            holder: b
                .claim
                .as_ref()
                .map_or("nobody (claim not confirmed at agent start)".to_string(), |c| {
                    format!("{} (a{})", c.holder, c.attempt)
                }),
        },
        _ => match a.deadline {
            Some(d) if now.duration_until(d) < cfg.retry_min_remaining => Event::DeadlinePassed { at_start: None },
            _ => {
                let secs = b.map_or(0, |b| i64::from(b.timeout_seconds));
                return RecoveryAction::ResumeAdmission {
                    attempt: key,
                    timeout: SignedDuration::from_secs(secs),
                };
            }
        },
    };
    RecoveryAction::Step { attempt: key, event }
}

fn is_mine(c: &ClaimView, me: &AgentId, attempt: u32) -> bool {
    c.holder == me.0 && c.attempt == attempt
}

/// Ours for `attempt`, or our claim of the attempt before (a retry's claim names it until the
/// retry's own claim write).
fn is_mine_or_followed(c: &ClaimView, me: &AgentId, attempt: u32) -> bool {
    is_mine(c, me, attempt) || (c.holder == me.0 && c.attempt.checked_add(1) == Some(attempt))
}

/// Whether the cluster withdrew the build while the agent was down (a gone build counts as
/// deleted). Owner deletion is named first: it is the more specific cause.
fn withdrawal(b: Option<&BuildView>) -> Option<Ending> {
    match b {
        None => Some(Ending::CancelRequested),
        Some(b) if b.owner_deleted => Some(Ending::OwnerDeleted),
        Some(b) if b.cancel_requested || b.deletion_requested => Some(Ending::CancelRequested),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests;
