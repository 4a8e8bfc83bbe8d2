//! The pure core: given a CustomRun, what we see of its MacBuild and of the holder's Lease, and
//! `now`, decide the CustomRun's whole status, the one action on the MacBuild, and when to look
//! again. No I/O and no clock reads here; every rule of the custom-task contract and of the
//! controller's deadlines (README.md, "When a process dies") is a branch of [`decide`] and a row in
//! the tests below.

use crate::customrun::{Condition, CustomRun, CustomRunResult, CustomRunStatus, SUCCEEDED, reason};
use crate::duration::{format_secs, parse_go_duration};
use crate::params::{SpecError, macbuild_spec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::time::Duration;

/// Timing configuration; the defaults are the source's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    /// Applied when `spec.timeout` is unset (Tekton's `default-timeout-minutes`, 60 m).
    pub default_timeout: Duration,
    /// How long past the CustomRun deadline (or a cancel request) to wait for `VMDeleted`.
    pub grace: Duration,
    /// Lease duration assumed when a Lease does not state `leaseDurationSeconds`.
    pub lease_duration: Duration,
    /// How long after a run's completion it is labelled out of the watches: the label's two
    /// writes then do not compete with a burst of runs finishing (a catch-up after a restart).
    pub finished_label_after: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            default_timeout: Duration::from_secs(60 * 60),
            grace: Duration::from_secs(45),
            lease_duration: Duration::from_secs(20),
            finished_label_after: Duration::from_secs(30),
        }
    }
}

/// Condition type shown while the holder's Lease is expired (after `Succeeded`).
pub const HOST_UNREACHABLE: &str = "HostUnreachable";

/// `Succeeded=False` / `Unknown` reasons of our own (Tekton's constants are in `customrun::reason`).
pub mod own_reason {
    pub const RETRIES_NOT_SUPPORTED: &str = "RetriesNotSupported";
    pub const WORKSPACE_NOT_SUPPORTED: &str = "CustomRunWorkspaceNotSupported";
    pub const INVALID_TIMEOUT: &str = "InvalidTimeout";
    pub const MACBUILD_NAME_TAKEN: &str = "MacBuildNameTaken";
    /// `Unknown` while a MacBuild of the same name, not ours, is being deleted (a run created
    /// again under its name): ours is created once that one is gone.
    pub const MACBUILD_NAME_TERMINATING: &str = "MacBuildNameTerminating";
    pub const MACBUILD_DELETED: &str = "MacBuildDeleted";
    pub const PENDING: &str = "Pending";
    pub const DELETING_VM: &str = "DeletingVM";
    pub const CANCELLING: &str = "Cancelling";
    pub const TIMING_OUT: &str = "TimingOut";
    pub const LEASE_EXPIRED: &str = "LeaseExpired";
    pub const LEASE_RENEWED: &str = "LeaseRenewed";
    /// `HostUnreachable=False` on a run the agent ended itself while its Lease still looked
    /// expired (its status write outran its next renewal).
    pub const RESULT_DELIVERED: &str = "ResultDelivered";
}
use own_reason as own;

mod cancel;
mod timeout;
mod without_build;

use cancel::decide_cancel;
use timeout::decide_timeout;
use without_build::decide_without_build;

/// Result names (all values are strings, as Tekton requires).
pub mod result {
    pub const ATTEMPT: &str = "attempt";
    pub const TESTS_PASSED: &str = "testsPassed";
    pub const TESTS_TOTAL: &str = "testsTotal";
    pub const ARTIFACT: &str = "artifact";
    pub const VM_RETIREMENT: &str = "vmRetirement";
    /// Where the step logs were shipped (the MacBuild's `status.logs`); empty without one.
    pub const LOGS: &str = "logs";
}

/// What is known about the build's VM when the CustomRun ends (`vmRetirement` result).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum VmRetirement {
    /// The holding agent confirmed the VM deleted (or the MacBuild, held by its finalizer, is gone).
    Deleted,
    /// Nobody confirmed it; the MacBuild keeps the cancel/deletion request for the agent.
    Unconfirmed,
    /// No VM was created: no agent claimed the build, or the one that claimed it never admitted it.
    None,
}

impl VmRetirement {
    pub fn as_str(self) -> &'static str {
        match self {
            VmRetirement::Deleted => "deleted",
            VmRetirement::Unconfirmed => "unconfirmed",
            VmRetirement::None => "none",
        }
    }
}

/// Where the MacBuild stands (its `status.phase`; `None` = no status yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Pending,
    Admitted,
    Booting,
    Running,
    Collecting,
    Retiring,
    Succeeded,
    Failed,
    Cancelled,
}

impl Stage {
    fn is_terminal(self) -> bool {
        matches!(self, Stage::Succeeded | Stage::Failed | Stage::Cancelled)
    }

    /// The CustomRun `Unknown` reason while the build is in this stage.
    fn running_reason(self) -> &'static str {
        match self {
            Stage::Pending => own::PENDING,
            Stage::Admitted => "Admitted",
            Stage::Booting => "BootingVM",
            Stage::Running => reason::RUNNING,
            Stage::Collecting => "Collecting",
            Stage::Retiring | Stage::Succeeded | Stage::Failed | Stage::Cancelled => own::DELETING_VM,
        }
    }
}

/// What the controller sees of the MacBuild (built from the api crate's type by the I/O layer).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BuildView {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub resource_version: String,
    /// uid in the MacBuild's controller ownerReference, if any.
    pub controller_uid: Option<String>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// `spec.cancelRequested`.
    pub cancel_requested: bool,
    pub stage: Option<Stage>,
    pub holder: Option<String>,
    pub attempt: Option<String>,
    pub vm: Option<String>,
    pub journal_seq: Option<u64>,
    /// The `VMDeleted` condition is `True`.
    pub vm_deleted: bool,
    /// The status lists attempts and shows none ever admitted (no admission time, no host
    /// deadline): a holder that confirms its VM deleted then confirms that none was made.
    pub nothing_admitted: bool,
    /// Why the build ended (the MacBuild's `Succeeded` condition reason, else its outcome).
    pub reason: Option<String>,
    pub message: Option<String>,
    pub tests_passed: Option<u32>,
    pub tests_total: Option<u32>,
    pub artifact: Option<String>,
    /// `status.logs`: where the step logs are shipped.
    pub logs: Option<String>,
}

impl BuildView {
    fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// What the holder's `VMDeleted=True` confirms: its VM deleted, or, when no attempt was ever
    /// admitted (a claim whose answer came too late, a cancel before admission), that no VM was
    /// made at all.
    fn confirmed_retirement(&self) -> VmRetirement {
        if self.nothing_admitted {
            VmRetirement::None
        } else {
            VmRetirement::Deleted
        }
    }

    /// What the holder confirmed, for a message: see [`BuildView::confirmed_retirement`].
    fn confirmed_text(&self) -> &'static str {
        if self.nothing_admitted {
            "confirmed it never admitted the build: no VM was created"
        } else {
            "confirmed its VM deleted"
        }
    }

    /// Deletes the MacBuild (fenced on `precondition_rv`), unless its deletion is under way.
    fn delete_unless_deleting(&self, precondition_rv: Option<String>) -> BuildAction {
        if self.deleting {
            BuildAction::None
        } else {
            BuildAction::Delete { precondition_rv }
        }
    }

    /// Asks the agent to cancel, unless the MacBuild already asks it.
    fn request_cancel_unless_requested(&self) -> BuildAction {
        if self.cancel_requested {
            BuildAction::None
        } else {
            BuildAction::RequestCancel
        }
    }
}

/// The holder's Lease as read from the API.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LeaseView {
    pub holder_identity: Option<String>,
    pub renew_time: Option<Timestamp>,
    pub duration: Option<Duration>,
}

/// What the holder's Lease says at `now`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    Live { renewed: Timestamp, expires: Timestamp },
    Expired { renewed: Option<Timestamp> },
    Missing,
}

/// Whether `agent`'s Lease is live at `now`. A Lease held by someone else, or never renewed, is
/// not evidence of this agent's renewals.
pub fn liveness(agent: &str, lease: Option<&LeaseView>, default_duration: Duration, now: Timestamp) -> Liveness {
    let Some(lease) = lease else { return Liveness::Missing };
    let renewed = lease.renew_time;
    if lease.holder_identity.as_deref() != Some(agent) {
        return Liveness::Expired { renewed };
    }
    let Some(renewed) = renewed else {
        return Liveness::Expired { renewed: None };
    };
    let duration = lease.duration.unwrap_or(default_duration);
    let expires = add(renewed, duration);
    if now < expires {
        Liveness::Live { renewed, expires }
    } else {
        Liveness::Expired { renewed: Some(renewed) }
    }
}

/// The one write the plan makes on the MacBuild (the I/O layer does it before the status write).
#[derive(Clone, Debug, PartialEq)]
pub enum BuildAction {
    None,
    /// Create the MacBuild (named after the CustomRun) with this spec.
    Create(Value),
    /// Set `spec.cancelRequested: true`.
    RequestCancel,
    /// Delete the MacBuild. With a resourceVersion precondition when it must still be unclaimed
    /// (so an agent claiming it at that moment makes the delete fail instead of leaking a VM).
    Delete {
        precondition_rv: Option<String>,
    },
}

/// A Kubernetes Event to publish on the CustomRun.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    pub warning: bool,
    pub reason: String,
    pub message: String,
}

/// How a run ended, for metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finished {
    pub status: String,
    pub reason: String,
    pub vm_retirement: VmRetirement,
}

/// The decision for one reconcile.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The whole desired status (write it only if it differs from the current one).
    pub status: CustomRunStatus,
    pub action: BuildAction,
    pub events: Vec<Note>,
    /// When to reconcile again even if nothing changes (the next deadline).
    pub requeue_after: Option<Duration>,
    /// Set when this plan makes the CustomRun terminal.
    pub finished: Option<Finished>,
}

/// Controller state kept in `status.extraFields` (the only place Tekton's schema keeps for us).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Extra {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac_build: Option<String>,
    #[serde(default, rename = "macBuildUID", skip_serializing_if = "Option::is_none")]
    pub mac_build_uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub journal_seq: Option<u64>,
    /// The CustomRun deadline (startTime + timeout), when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<String>,
    /// When we first asked the MacBuild to cancel: on `spec.status: RunCancelled`, or on a
    /// timeout with a live holder (whose grace then runs from this ask).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel_requested_at: Option<String>,
}

/// RFC 3339 with whole seconds, as Kubernetes stamps times.
pub fn rfc3339(t: Timestamp) -> String {
    t.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

fn add(t: Timestamp, d: Duration) -> Timestamp {
    let d = SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX);
    t.saturating_add(d).unwrap_or(Timestamp::MAX)
}

fn until(from: Timestamp, to: Timestamp) -> Duration {
    Duration::try_from(to.duration_since(from)).unwrap_or(Duration::ZERO)
}

fn parse_time(text: &str) -> Option<Timestamp> {
    text.parse().ok()
}

/// The CustomRun's effective timeout: `spec.timeout`, or the default when unset; `0` = none.
pub fn effective_timeout(run: &CustomRun, timing: &Timing) -> Result<Option<Duration>, String> {
    match run.spec.timeout.as_deref() {
        None => Ok(Some(timing.default_timeout).filter(|d| !d.is_zero())),
        Some(text) => match parse_go_duration(text) {
            Ok(d) if d.is_zero() => Ok(None),
            Ok(d) => Ok(Some(d)),
            Err(e) => Err(format!("spec.timeout: {e}")),
        },
    }
}

fn lease_phrase(agent: &str, live: Liveness) -> String {
    match live {
        Liveness::Expired { renewed: Some(t) } => {
            format!("agent {agent} lease expired (last renewed {})", rfc3339(t))
        }
        Liveness::Expired { renewed: None } => format!("agent {agent} lease expired (never renewed)"),
        Liveness::Missing => format!("agent {agent} lease expired (no Lease found)"),
        Liveness::Live { renewed, .. } => format!("agent {agent} lease is live (last renewed {})", rfc3339(renewed)),
    }
}

/// Builder state for one decision.
struct Draft {
    status: CustomRunStatus,
    extra: Extra,
    events: Vec<Note>,
    old_succeeded: Option<Condition>,
    old_unreachable: Option<Condition>,
    now: Timestamp,
}

impl Draft {
    fn condition(&self, type_: &str, status: &str, why: &str, message: String, old: Option<&Condition>) -> Condition {
        // lastTransitionTime moves when status or reason changes (knative keeps it otherwise).
        let keep = old.filter(|o| o.status == status && o.reason.as_deref() == Some(why));
        Condition {
            type_: type_.into(),
            status: status.into(),
            reason: Some(why.into()),
            message: Some(message),
            severity: old.and_then(|o| o.severity.clone()),
            last_transition_time: keep
                .and_then(|o| o.last_transition_time.clone())
                .or_else(|| Some(rfc3339(self.now))),
        }
    }

    fn set_succeeded(&mut self, status: &str, why: &str, message: String) {
        // Messages quote what pipeline authors wrote (a param, an env key, a step name): cleaned
        // and bounded as the text copied from a MacBuild is, for the status and the Event alike.
        let message = tartan_api::text::clean_str(&message, crate::view::MESSAGE_MAX);
        let cond = self.condition(SUCCEEDED, status, why, message.clone(), self.old_succeeded.as_ref());
        let changed = self
            .old_succeeded
            .as_ref()
            .map(|o| (o.status.as_str(), o.reason.as_deref()))
            != Some((status, Some(why)));
        if changed {
            self.events.push(Note {
                warning: status == "False",
                reason: why.into(),
                message,
            });
        }
        put_condition(&mut self.status.conditions, cond);
    }

    /// `HostUnreachable` while the holder's Lease is expired; `False/LeaseRenewed` once it is back.
    fn set_unreachable(&mut self, holder: Option<&str>, live: Option<Liveness>) {
        let (Some(agent), Some(live)) = (holder, live) else {
            return;
        };
        let old = self.old_unreachable.clone();
        let was_true = old.as_ref().is_some_and(|c| c.status == "True");
        match live {
            Liveness::Live { renewed, .. } => {
                let msg = format!("agent {agent} renewed its lease at {}", rfc3339(renewed));
                self.set_reachable(own::LEASE_RENEWED, msg);
            }
            Liveness::Expired { .. } | Liveness::Missing => {
                let msg = format!(
                    "{}; the build goes on if the agent comes back",
                    lease_phrase(agent, live)
                );
                let cond = self.condition(HOST_UNREACHABLE, "True", own::LEASE_EXPIRED, msg.clone(), old.as_ref());
                if !was_true {
                    self.events.push(Note {
                        warning: true,
                        reason: HOST_UNREACHABLE.into(),
                        message: msg,
                    });
                }
                put_condition(&mut self.status.conditions, cond);
            }
        }
    }

    /// [`Draft::set_unreachable`] for a MacBuild the agent ended itself (terminal, VM deleted):
    /// that status came from the agent, so it reached the cluster whatever its Lease says. An
    /// earlier `HostUnreachable` is set `False/ResultDelivered` rather than kept `True` on the
    /// ended run; with no earlier one, none is added.
    fn set_reached_by_result(&mut self, holder: Option<&str>, live: Option<Liveness>) {
        let (Some(agent), Some(Liveness::Expired { .. } | Liveness::Missing)) = (holder, live) else {
            return self.set_unreachable(holder, live);
        };
        let msg = format!("agent {agent} delivered the build's end; its Lease had not been renewed yet");
        self.set_reachable(own::RESULT_DELIVERED, msg);
    }

    /// `HostUnreachable=False/<why>` when the run has the condition (none is added), with an
    /// Event when it turns from `True`.
    fn set_reachable(&mut self, why: &str, msg: String) {
        let Some(old) = self.old_unreachable.clone() else {
            return;
        };
        let cond = self.condition(HOST_UNREACHABLE, "False", why, msg.clone(), Some(&old));
        if old.status == "True" {
            self.events.push(Note {
                warning: false,
                reason: why.into(),
                message: msg,
            });
        }
        put_condition(&mut self.status.conditions, cond);
    }

    fn finish(
        mut self,
        status: &str,
        why: &str,
        message: String,
        retirement: VmRetirement,
        build: Option<&BuildView>,
        action: BuildAction,
    ) -> Plan {
        self.set_succeeded(status, why, message);
        let ltt = self.status.succeeded().and_then(|c| c.last_transition_time.clone());
        self.status.completion_time = Some(Time(ltt.as_deref().and_then(parse_time).unwrap_or(self.now)));
        let text = |v: Option<u32>| v.map(|n| n.to_string()).unwrap_or_default();
        self.status.results = vec![
            res(
                result::ATTEMPT,
                build
                    .and_then(|b| b.attempt.clone())
                    .or(self.extra.attempt.clone())
                    .unwrap_or_default(),
            ),
            res(result::TESTS_PASSED, text(build.and_then(|b| b.tests_passed))),
            res(result::TESTS_TOTAL, text(build.and_then(|b| b.tests_total))),
            res(
                result::ARTIFACT,
                build.and_then(|b| b.artifact.clone()).unwrap_or_default(),
            ),
            res(result::VM_RETIREMENT, retirement.as_str().into()),
            res(result::LOGS, build.and_then(|b| b.logs.clone()).unwrap_or_default()),
        ];
        let finished = Finished {
            status: status.into(),
            reason: why.into(),
            vm_retirement: retirement,
        };
        self.into_plan(action, None, Some(finished))
    }

    fn into_plan(mut self, action: BuildAction, requeue_after: Option<Duration>, finished: Option<Finished>) -> Plan {
        self.status.extra_fields = Some(serde_json::to_value(&self.extra).expect("Extra serializes"));
        Plan {
            status: self.status,
            action,
            events: self.events,
            requeue_after,
            finished,
        }
    }
}

fn res(name: &str, value: String) -> CustomRunResult {
    CustomRunResult {
        name: name.into(),
        value,
    }
}

/// Replaces the condition of the same type, keeping `Succeeded` first and others after it.
fn put_condition(conditions: &mut Vec<Condition>, cond: Condition) {
    if let Some(slot) = conditions.iter_mut().find(|c| c.type_ == cond.type_) {
        *slot = cond;
    } else {
        conditions.push(cond);
    }
    if let Some(i) = conditions.iter().position(|c| c.type_ == SUCCEEDED) {
        let s = conditions.remove(i);
        conditions.insert(0, s);
    }
}

/// The plan for a finished run: done runs are never touched again (a cancel patch on a finished
/// run changes nothing), so its status stays as it is but for `observedGeneration`, with no
/// action, no events and no requeue. It needs neither the MacBuild nor a Lease. `None` while the
/// run is not done.
pub fn settled(run: &CustomRun) -> Option<Plan> {
    let current = run.status.as_ref().filter(|s| s.is_done())?;
    let mut status = current.clone();
    status.observed_generation = run.metadata.generation.or(current.observed_generation);
    Some(Plan {
        status,
        action: BuildAction::None,
        events: vec![],
        requeue_after: None,
        finished: None,
    })
}

/// Whether `run` is finished and its status already says everything (`observedGeneration`
/// included): a reconcile of it has nothing to read and nothing to write.
pub fn nothing_owed(run: &CustomRun) -> bool {
    settled(run).is_some_and(|plan| run.status.as_ref() == Some(&plan.status))
}

/// For a run with nothing owed: how long until it is due its finished label (`None`: now).
/// Counted from `completionTime`, and never more than the delay from `now`; a run without one is
/// due now.
pub fn finished_label_wait(run: &CustomRun, timing: &Timing, now: Timestamp) -> Option<Duration> {
    let completed = run.status.as_ref()?.completion_time.as_ref()?.0;
    let due = completed
        .checked_add(SignedDuration::try_from(timing.finished_label_after).ok()?)
        .ok()?;
    let wait = now.duration_until(due);
    // Capped: a completion time ahead of our clock must not put the label off for longer.
    wait.is_positive()
        .then(|| wait.unsigned_abs().min(timing.finished_label_after))
}

/// How long a run due its finished label waits for a free labelling slot before it tries again:
/// 2 s, plus up to 2 s more spread by its uid, so the runs waiting together do not all come back
/// together.
pub fn label_slot_retry(run_uid: &str) -> Duration {
    use std::hash::{Hash as _, Hasher as _};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    run_uid.hash(&mut h);
    Duration::from_secs(2) + Duration::from_millis(h.finish() % 2000)
}

/// Whether `plan`, decided from cached (watch) inputs, must be decided again from fresh reads
/// before it is acted on: it ends the run or deletes the MacBuild on facts that a cache a moment
/// behind can get wrong (a MacBuild absent, unclaimed or not finished yet, a Lease expired). A
/// MacBuild that is terminal with its VM deleted stays so, so its verdict needs no second read.
pub fn needs_fresh_inputs(plan: &Plan, build: Option<&BuildView>) -> bool {
    let settled_by_build = build.is_some_and(|b| b.stage.is_some_and(Stage::is_terminal) && b.vm_deleted);
    let deletes = matches!(plan.action, BuildAction::Delete { .. });
    deletes || (plan.finished.is_some() && !settled_by_build)
}

/// Common start of every decision: bump `observedGeneration`; a done run is returned untouched
/// (`Err`); otherwise mark it started if needed and return the draft and the start time.
fn begin(run: &CustomRun, now: Timestamp) -> Result<(Draft, Timestamp), Box<Plan>> {
    if let Some(plan) = settled(run) {
        return Err(Box::new(plan));
    }
    let current = run.status.clone().unwrap_or_default();
    let mut status = current.clone();
    status.observed_generation = run.metadata.generation.or(current.observed_generation);

    let extra: Extra = current
        .extra_fields
        .clone()
        .and_then(|v| serde_json::from_value(v).ok())
        .unwrap_or_default();
    let mut d = Draft {
        old_succeeded: current.succeeded().cloned(),
        old_unreachable: current.conditions.iter().find(|c| c.type_ == HOST_UNREACHABLE).cloned(),
        status,
        extra,
        events: vec![],
        now,
    };

    // Mark started: startTime = now, never before the creation timestamp.
    let start = match d.status.start_time.as_ref() {
        Some(t) => t.0,
        None => {
            let created = run.metadata.creation_timestamp.as_ref().map(|t| t.0);
            let start = created.map_or(now, |c| c.max(now));
            d.status.start_time = Some(Time(start));
            d.set_succeeded("Unknown", reason::STARTED, "CustomRun started".into());
            start
        }
    };
    Ok((d, start))
}

/// The CustomRun fails because the API refused the MacBuild it maps to (e.g. a schema
/// violation on create): `False/InvalidMacBuildSpec` with the API's message.
pub fn refuse_spec(run: &CustomRun, message: String, now: Timestamp) -> Plan {
    match begin(run, now) {
        Err(done) => *done,
        Ok((d, _)) => {
            let e = SpecError::Spec(message);
            invalid(d, &e)
        }
    }
}

/// Decide everything for one CustomRun at `now`. `build` is the MacBuild named after the run
/// (if it exists); `lease` is the Lease of `build`'s holder (if it has one and the Lease exists).
pub fn decide(
    run: &CustomRun,
    build: Option<&BuildView>,
    lease: Option<&LeaseView>,
    timing: &Timing,
    now: Timestamp,
) -> Plan {
    let (mut d, start) = match begin(run, now) {
        Ok(v) => v,
        Err(done) => return *done,
    };
    let name = run.metadata.name.clone().unwrap_or_default();
    let ns = run.metadata.namespace.clone().unwrap_or_default();
    let key = format!("{ns}/{name}");

    let timeout = match effective_timeout(run, timing) {
        Ok(t) => t,
        Err(e) => return decide_invalid_timeout(d, build, e),
    };
    let deadline = timeout.map(|t| add(start, t));
    d.extra.deadline = deadline.map(rfc3339);
    let past_deadline = deadline.is_some_and(|dl| now >= dl);
    let timeout_text = timeout.map(format_secs).unwrap_or_default();
    let cancelled = run.spec.is_cancelled();

    let Some(b) = build else {
        return decide_without_build(d, run, &key, &name, timeout, deadline, cancelled, &timeout_text, None);
    };

    let run_uid = run.metadata.uid.as_deref().unwrap_or_default();
    if b.controller_uid.as_deref() != Some(run_uid) && b.deleting {
        // Another run's MacBuild under our name, on its way out (a PipelineRun deleted and
        // created again while the agent's finalizer holds the old build until its VM is gone):
        // the name is free once it is gone, which its watch event or the requeue shows us.
        return decide_without_build(
            d,
            run,
            &key,
            &name,
            timeout,
            deadline,
            cancelled,
            &timeout_text,
            Some(b),
        );
    }
    if b.controller_uid.as_deref() != Some(run_uid) {
        return refuse_foreign_build(d, b, run_uid);
    }

    let known_before = (d.extra.holder.clone(), d.extra.attempt.clone());
    record_build(&mut d, b);
    // Whether the run's status already names a holder and an attempt: only then may the
    // MacBuild be deleted (see `decide_timeout`). Any recorded ones do: a MacBuild showing a new
    // attempt every round (a crash loop, a hostile agent) must not keep the run from ending.
    let holder_recorded = known_before.0.is_some() && known_before.1.is_some();

    let holder = b.holder.as_deref();
    let live = holder.map(|h| liveness(h, lease, timing.lease_duration, now));

    // Terminal only after VMDeleted=True: the build's own outcome, which wins over a later
    // cancel or deadline (the first terminal fact wins).
    if b.stage.is_some_and(Stage::is_terminal) && b.vm_deleted {
        return decide_settled_build(d, b, holder, live, cancelled, past_deadline, &timeout_text);
    }

    if cancelled {
        return decide_cancel(d, b, live, timing);
    }

    if past_deadline {
        let deadline = deadline.expect("past_deadline implies a deadline");
        return decide_timeout(d, b, live, timing, deadline, &timeout_text, holder_recorded);
    }

    decide_running(d, b, holder, live, deadline)
}

/// The run's timeout cannot be worked out: the run fails `False/InvalidTimeout`, and a MacBuild
/// already made is asked to cancel.
fn decide_invalid_timeout(d: Draft, build: Option<&BuildView>, e: String) -> Plan {
    let action = if build.is_some_and(|b| !b.cancel_requested) {
        BuildAction::RequestCancel
    } else {
        BuildAction::None
    };
    d.finish(
        "False",
        own::INVALID_TIMEOUT,
        e,
        retirement_without_confirmation(build),
        build,
        action,
    )
}

/// A live MacBuild under the run's name that another controller owns: refused, never adopted.
fn refuse_foreign_build(d: Draft, b: &BuildView, run_uid: &str) -> Plan {
    let msg = format!(
        "MacBuild {} exists but is not controlled by this CustomRun (uid {run_uid}); refusing to adopt it. \
         Delete or rename it and re-run the pipeline",
        b.key()
    );
    d.finish(
        "False",
        own::MACBUILD_NAME_TAKEN,
        msg,
        VmRetirement::None,
        None,
        BuildAction::None,
    )
}

/// Record what we see, for `kubectl get customrun -o yaml` and for later reconciles.
fn record_build(d: &mut Draft, b: &BuildView) {
    d.extra.mac_build = Some(b.name.clone());
    d.extra.mac_build_uid = Some(b.uid.clone());
    d.extra.phase = b.stage.map(|s| format!("{s:?}"));
    if b.holder.is_some() {
        d.extra.holder = b.holder.clone();
    }
    if b.attempt.is_some() {
        d.extra.attempt = b.attempt.clone();
    }
    if b.vm.is_some() {
        d.extra.vm = b.vm.clone();
    }
    d.extra.journal_seq = b.journal_seq.or(d.extra.journal_seq);
}

/// The MacBuild is terminal and its VM deleted: its own outcome is the run's verdict.
fn decide_settled_build(
    mut d: Draft,
    b: &BuildView,
    holder: Option<&str>,
    live: Option<Liveness>,
    cancelled: bool,
    past_deadline: bool,
    timeout_text: &str,
) -> Plan {
    d.set_reached_by_result(holder, live);
    let build_reason = b
        .reason
        .clone()
        .unwrap_or_else(|| format!("{:?}", b.stage.unwrap_or(Stage::Failed)));
    let detail = b.message.clone().unwrap_or_default();
    match b.stage {
        Some(Stage::Succeeded) => {
            let msg = format!(
                "MacBuild {} succeeded ({}); its VM is deleted. {detail}",
                b.key(),
                attempt_of(b)
            );
            d.finish(
                "True",
                &build_reason,
                msg.trim_end().into(),
                b.confirmed_retirement(),
                Some(b),
                BuildAction::None,
            )
        }
        Some(Stage::Cancelled) if cancelled => {
            let msg = format!("MacBuild {} cancelled; {NO_VM_LEFT}", b.key());
            d.finish(
                "False",
                reason::CANCELLED,
                msg,
                b.confirmed_retirement(),
                Some(b),
                BuildAction::None,
            )
        }
        Some(Stage::Cancelled) if past_deadline => {
            let msg = format!("MacBuild did not finish within timeout {timeout_text}; {NO_VM_LEFT}");
            d.finish(
                "False",
                reason::TIMED_OUT,
                msg,
                b.confirmed_retirement(),
                Some(b),
                BuildAction::None,
            )
        }
        _ => {
            let msg = format!("MacBuild {} failed: {build_reason}; {NO_VM_LEFT}. {detail}", b.key());
            d.finish(
                "False",
                &build_reason,
                msg.trim_end().into(),
                b.confirmed_retirement(),
                Some(b),
                BuildAction::None,
            )
        }
    }
}

/// The MacBuild is neither finished nor cancelled nor past its deadline: report how it runs and
/// wake at the deadline or the Lease's expiry.
fn decide_running(
    mut d: Draft,
    b: &BuildView,
    holder: Option<&str>,
    live: Option<Liveness>,
    deadline: Option<Timestamp>,
) -> Plan {
    let now = d.now;
    d.set_unreachable(holder, live);
    let (why, msg) = running_reason(b, live);
    d.set_succeeded("Unknown", why, msg);
    let mut wake = deadline.into_iter().collect::<Vec<_>>();
    if let Some(Liveness::Live { expires, .. }) = live {
        wake.push(expires);
    }
    let requeue = next_wake(now, &wake);
    d.into_plan(BuildAction::None, requeue, None)
}

/// What a terminal MacBuild with `VMDeleted=True` proves about VMs, however it ended: none is left.
/// Not "its VM is deleted": a build that failed or was cancelled before its clone never had one
/// (the agent's own message then says "nothing was cloned").
const NO_VM_LEFT: &str = "no VM of it is left";

fn attempt_of(b: &BuildView) -> String {
    b.attempt
        .clone()
        .map_or_else(|| "no attempt".into(), |a| format!("attempt {a}"))
}

fn running_reason(b: &BuildView, live: Option<Liveness>) -> (&'static str, String) {
    let stage = b.stage.unwrap_or(Stage::Pending);
    let why = if b.holder.is_none() {
        own::PENDING
    } else {
        stage.running_reason()
    };
    let msg = match (&b.holder, why) {
        (None, _) => format!("MacBuild {} created; waiting for a Mac host to claim it", b.key()),
        (Some(h), own::DELETING_VM) => {
            format!(
                "MacBuild {} finishing on {h} ({}); waiting for its VM to be deleted",
                b.key(),
                attempt_of(b)
            )
        }
        (Some(h), _) => {
            let lease = match live {
                Some(Liveness::Live { .. }) | None => String::new(),
                Some(other) => format!("; {}", lease_phrase(h, other)),
            };
            format!(
                "MacBuild {} {} on {h} ({}){lease}",
                b.key(),
                why.to_lowercase(),
                attempt_of(b)
            )
        }
    };
    let msg = match b.message.as_deref().filter(|m| !m.is_empty()) {
        Some(m) if b.holder.is_some() => format!("{msg}: {m}"),
        _ => msg,
    };
    (why, msg)
}

fn next_wake(now: Timestamp, times: &[Timestamp]) -> Option<Duration> {
    // A little slack so the requeued reconcile sees `now >= deadline`.
    times
        .iter()
        .filter(|t| **t > now)
        .min()
        .map(|t| until(now, *t) + Duration::from_millis(100))
        .or_else(|| times.iter().any(|t| *t <= now).then_some(Duration::from_millis(100)))
}

fn retirement_without_confirmation(build: Option<&BuildView>) -> VmRetirement {
    match build {
        Some(b) if b.holder.is_some() => {
            if b.stage.is_some_and(Stage::is_terminal) && b.vm_deleted {
                b.confirmed_retirement()
            } else {
                VmRetirement::Unconfirmed
            }
        }
        _ => VmRetirement::None,
    }
}

fn invalid(d: Draft, e: &SpecError) -> Plan {
    d.finish(
        "False",
        e.reason(),
        e.to_string(),
        VmRetirement::None,
        None,
        BuildAction::None,
    )
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "adversary17_tests.rs"]
mod adversary17_tests;
