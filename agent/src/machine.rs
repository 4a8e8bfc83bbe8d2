//! The attempt machine: one pure transition function for every rule of an attempt's life (the states
//! and their order: README.md, "How it works").
//!
//! [`step`] takes the attempt as the journal knows it ([`Attempt`]), one [`Event`] and `now`, and
//! returns either a [`Transition`] or a typed [`Refusal`]. A transition names the record to journal
//! (via [`Attempt::record`]) and the [`Action`]s the runtime performs *after* that record is synced,
//! in order ("journal first, then act"). Actions report back as new events (e.g. `StopAndDeleteVm`
//! ends in [`Event::VmDeleted`] or [`Event::DeleteFailed`]), so the runtime is a loop of
//! `step → journal → act → event` and every rule lives here. Recovery (`recovery.rs`) feeds the
//! same events, so a restarted agent follows the same rules.
//!
//! Nothing here reads a clock or touches a VM: `now` is an argument, I/O is an [`Action`].

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use std::fmt;
use tartan_api::{AttemptState, Outcome, Reason};

use crate::pool::WarmProfile;
use crate::record::{BuildRef, PLAIN_RECORD_VERSION, Record};

mod open;
mod requested;
mod retiring;

pub use retiring::continue_retirement;

/// Host-wide knobs of the machine. Defaults are the source document's figures.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Number of VM slots on this host: 1 or 2 (tart runs at most 2 macOS VMs).
    pub slots: u8,
    /// A retry starts only with at least this much left before the original deadline (120 s).
    pub retry_min_remaining: SignedDuration,
    /// The watchdog deletes a VM this long after its deadline (60 s); recovery uses it to tell a
    /// watchdog deletion from a VM that vanished for another reason.
    pub watchdog_grace: SignedDuration,
    /// The longest wait between deletion retries of a quarantined VM (they start at 1 s and double).
    pub quarantine_retry: SignedDuration,
    /// `maxAttempts` when the MacBuild does not say (2).
    pub default_max_attempts: u8,
    /// At agent start, an attempt whose VM still runs and whose guest answers is followed again
    /// (`on_restart = "resume"`, the default) rather than interrupted and retried (`"restart"`).
    pub resume_after_restart: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            slots: 1,
            retry_min_remaining: SignedDuration::from_secs(120),
            watchdog_grace: SignedDuration::from_secs(60),
            quarantine_retry: SignedDuration::from_secs(30),
            default_max_attempts: 2,
            resume_after_restart: true,
        }
    }
}

/// The accepted range of `maxAttempts`.
pub const MAX_ATTEMPTS_RANGE: std::ops::RangeInclusive<u8> = 1..=3;

/// Longest record detail: room for a failing step's last lines (`tartan_api::text::TAIL_BYTES`)
/// and what is said around them. Longer details are cut ([`tartan_api::text::clean`]).
pub const DETAIL_MAX: usize = tartan_api::text::TAIL_BYTES + 2048;

/// One attempt as the journal knows it: the fold of its records ([`Attempt::observe`]).
///
/// `max_attempts` and `build_gone` are not journaled; the runtime (or recovery) sets them from
/// the MacBuild it sees.
#[derive(Clone, Debug, PartialEq)]
pub struct Attempt {
    pub build: BuildRef,
    /// 1-based attempt number (`a1`).
    pub number: u32,
    /// The VM this attempt creates; names carry the attempt, so never reused.
    pub vm: String,
    pub state: AttemptState,
    /// The slot (0-based), from admission on.
    pub slot: Option<u8>,
    /// The host execution deadline: fixed at the first admission, inherited by retries.
    pub deadline: Option<Timestamp>,
    /// The outcome, once fixed (entering `Retiring`, or a terminal record from `Requested`).
    pub outcome: Option<Outcome>,
    /// The reason of the last transition (tells a watchdog retirement from a normal one).
    pub reason: Option<Reason>,
    /// Why the attempt ended: the detail of the record that fixed its outcome (e.g. the failing
    /// step, its exit code and its last lines). Journaled with that record, so it survives restarts.
    pub cause: Option<String>,
    /// The reason recorded with the outcome (e.g. `WatchdogDeadline`), kept when a later record
    /// (a withdrawal) changes `reason`.
    pub outcome_reason: Option<Reason>,
    /// A cancel or owner deletion was recorded; no retry may follow.
    pub withdrawn: Option<Reason>,
    /// `maxAttempts` of the MacBuild (1–3).
    pub max_attempts: u8,
    /// `max_attempts` came from the journal (journals written before it was recorded leave it
    /// to the cluster's view).
    pub max_attempts_journaled: bool,
    /// The MacBuild no longer exists: nothing is delivered to it and no finalizer is removed.
    pub build_gone: bool,
    /// Sequence number of the last journaled record of this attempt.
    pub last_seq: Option<u64>,
    /// Time of the last journaled record (recovery re-decides a retry as of then).
    pub last_time: Option<Timestamp>,
    /// The step (0-based) the last `StepStarted` record started; `None` while the first one runs
    /// (entering `Running` starts step 0).
    pub step: Option<u32>,
    /// When the current step started: the time of the record that started it (entering `Running`
    /// for step 0, its `StepStarted` record for a later one). Not journaled on its own: replaying
    /// the journal gives it back, so a resumed step's `timeoutSeconds` counts from its first start.
    pub step_since: Option<Timestamp>,
    /// The MacBuild generation the attempt started with (its first record that names one);
    /// `None` for attempts journaled before generations were.
    pub generation: Option<i64>,
    /// The attempt got as far as `Booting` (its clone was asked for): before that no VM of it
    /// exists, and its retirement says so instead of a deletion.
    pub boot_started: bool,
    /// The claim moved to another holder while the attempt was open (its status write was
    /// fenced out): it stops, deletes its VM and frees its slot, and writes nothing more to the
    /// MacBuild (no status, no finalizer release: the build is the new holder's).
    pub claim_lost: bool,
    /// It was admitted into a warm VM of the pool (its `Admitted` record names the VM and its
    /// profile): that VM exists from the admission on, and it is never cloned or booted.
    pub adopted: bool,
}

impl Attempt {
    /// A not yet journaled attempt in `Requested`; pass it to [`request`] for its first record
    /// (a retry's original deadline arrives through that record).
    pub fn new(build: BuildRef, number: u32, vm: impl Into<String>, max_attempts: u8) -> Attempt {
        Attempt {
            build,
            number,
            vm: vm.into(),
            state: AttemptState::Requested,
            slot: None,
            deadline: None,
            outcome: None,
            reason: None,
            cause: None,
            outcome_reason: None,
            withdrawn: None,
            max_attempts,
            max_attempts_journaled: false,
            build_gone: false,
            last_seq: None,
            last_time: None,
            step: None,
            step_since: None,
            generation: None,
            boot_started: false,
            claim_lost: false,
            adopted: false,
        }
    }

    /// Starts a view from an attempt's first replayed record; `None` for records that do not
    /// belong to an attempt (an `UnknownVM` quarantine).
    pub fn from_record(r: &Record, max_attempts: u8) -> Option<Attempt> {
        let mut a = Attempt::new(r.build.clone()?, r.attempt?, r.vm.clone()?, max_attempts);
        a.observe(r);
        Some(a)
    }

    /// Folds one journaled record of this attempt into the view. Outcome, slot and deadline are
    /// kept when a later record omits them: an outcome fixed at `Retiring` is never undone.
    pub fn observe(&mut self, r: &Record) {
        self.state = r.to;
        self.reason = r.reason;
        if self.outcome.is_none() && r.outcome.is_some() {
            self.cause = Some(r.detail.clone());
            self.outcome_reason = r.reason;
        }
        self.outcome = self.outcome.or(r.outcome);
        self.slot = r.slot.or(self.slot);
        self.deadline = self.deadline.or(r.deadline);
        if matches!(r.reason, Some(Reason::CancelRequested | Reason::OwnerDeleted)) {
            self.withdrawn = self.withdrawn.or(r.reason);
        }
        if let Some(max) = r.max_attempts {
            self.max_attempts = max;
            self.max_attempts_journaled = true;
        }
        self.step = r.step.or(self.step);
        self.generation = self.generation.or(r.generation);
        let may_have_cloned = |s: Option<AttemptState>| {
            matches!(
                s,
                Some(AttemptState::Booting | AttemptState::Running | AttemptState::Collecting)
            )
        };
        self.boot_started |= may_have_cloned(Some(r.to)) || may_have_cloned(r.from);
        self.claim_lost |= r.reason == Some(Reason::ClaimLost);
        if r.to == AttemptState::Admitted
            && r.warm.is_some()
            && let Some(vm) = &r.vm
        {
            // The warm VM exists already: it is this attempt's VM, to delete like a booted one.
            self.adopted = true;
            self.boot_started = true;
            self.vm = vm.clone();
        }
        if r.to == AttemptState::Running
            && matches!(
                r.reason,
                Some(Reason::GuestReady | Reason::StepStarted | Reason::Adopted)
            )
        {
            self.step_since = Some(r.time);
        }
        self.last_seq = Some(r.seq);
        self.last_time = Some(r.time);
    }

    /// The step the guest runs now (0 until a `StepStarted` record names a later one).
    pub fn current_step(&self) -> u32 {
        self.step.unwrap_or(0)
    }

    /// The record to journal for `t` (the status snapshot is the runtime's to fill in).
    pub fn record(&self, t: &Transition, seq: u64) -> Record {
        Record {
            version: PLAIN_RECORD_VERSION,
            seq,
            time: t.at,
            build: Some(self.build.clone()),
            attempt: Some(self.number),
            vm: Some(t.adoption.as_ref().map_or_else(|| self.vm.clone(), |w| w.vm.clone())),
            from: t.from,
            to: t.to,
            reason: t.reason,
            detail: t.detail.clone(),
            outcome: t.outcome,
            slot: t.slot.or(self.slot),
            deadline: t.deadline.or(self.deadline),
            max_attempts: (t.to == AttemptState::Requested).then_some(self.max_attempts),
            step: t.step,
            generation: self.generation,
            status: None,
            warm: t.adoption.as_ref().map(|w| w.profile.clone()),
        }
    }

    /// The key recovery and the runtime use to name this attempt.
    pub fn key(&self) -> AttemptKey {
        AttemptKey {
            build: self.build.clone(),
            attempt: self.number,
        }
    }
}

/// Names one attempt of one MacBuild (the uid tells a recreated MacBuild apart).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AttemptKey {
    pub build: BuildRef,
    pub attempt: u32,
}

impl fmt::Display for AttemptKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} a{}", self.build, self.attempt)
    }
}

/// Where a deletion happens; it only changes the journal's wording (the source's phrases).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeleteContext {
    /// The attempt ended while the agent ran it.
    Normal,
    /// Recovery at agent start; the VM may already be absent.
    AgentStart,
    /// The watchdog reported the VM deleted; the agent only confirms it is gone.
    Watchdog,
    /// A quarantined VM's deletion is retried.
    Retry,
}

/// How a VM's deletion was confirmed ([`Event::VmDeleted`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deleted {
    /// `tart stop` + `tart delete` took this long.
    Stopped { took: SignedDuration },
    /// Deleted, or found already absent, at agent start.
    AtAgentStart,
    /// The watchdog had deleted it; the agent found it gone.
    ByWatchdog,
    /// A retried deletion of a quarantined VM succeeded (or found it gone).
    OnRetry,
}

impl DeleteContext {
    /// The confirmation to send after a successful delete in this context (`took` is the
    /// measured time of `tart stop` + `tart delete`, used only in the normal case).
    pub fn deleted(self, took: SignedDuration) -> Deleted {
        match self {
            DeleteContext::Normal => Deleted::Stopped { took },
            DeleteContext::AgentStart => Deleted::AtAgentStart,
            DeleteContext::Watchdog => Deleted::ByWatchdog,
            DeleteContext::Retry => Deleted::OnRetry,
        }
    }
}

/// What happened to an attempt. Each variant names who sends it.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The claim is won and `slot` (0-based, of `slots`) is free: admit and fix the deadline
    /// (now + `timeout`, or the inherited deadline for a retry).
    Admit {
        slot: u8,
        slots: u8,
        timeout: SignedDuration,
    },
    /// The fenced claim write failed: another agent (`holder`) owns the MacBuild. Sent to an open
    /// attempt when a status write of it was fenced out (its claim moved on meanwhile).
    ClaimLost { holder: String },
    /// The fenced claim write got no answer (`error`) before the build's time ran out: it may have
    /// landed. Nothing was cloned; the attempt ends, and its status and the finalizer's removal go
    /// out fenced on the claim, answering for it if it landed (refused if it did not).
    ClaimUnconfirmed { error: String },
    /// The claim is won and a ready warm VM serves the build: admit it into that VM's slot,
    /// with that VM as the attempt's (no clone, no boot), and fix the deadline as [`Event::Admit`].
    Adopt {
        slot: u8,
        slots: u8,
        timeout: SignedDuration,
        adoption: Adoption,
    },
    /// The admission's actions are done (deadline file written): clone and start the VM.
    Boot,
    /// The adopted warm VM's guest answered `tart exec`, `after` the admission.
    Adopted { after: SignedDuration },
    /// `tart exec` answered, `after` the start of booting.
    GuestReady { after: SignedDuration },
    /// Step `index - 1` exited 0 and step `index` (0-based, of `of`), named `name`, is next:
    /// its start is journaled before the guest is asked to run it, so it is never started twice.
    StepStarting {
        index: u32,
        of: u32,
        name: String,
        previous: String,
    },
    /// The agent is stopping (SIGTERM) and leaves the attempt running in its VM.
    Detach,
    /// A restarted agent found the VM running and the guest answering, `after` the agent
    /// started: follow the same attempt again from where the journal says it was. With
    /// `clone_again` (`Booting` only) the VM does not exist: the previous agent stopped before
    /// its clone finished (an image pull can take minutes), so the boot starts over with the clone.
    Resume { after: SignedDuration, clone_again: bool },
    /// Every step exited 0.
    StepsSucceeded { steps: u32 },
    /// A step exited non-zero (`exit_code` -1: it could not be run). `output` says why: the end
    /// of the step's output, or tart's error.
    StepFailed {
        step: String,
        exit_code: i32,
        output: String,
    },
    /// Clone/set/run failed or the guest never answered.
    VmStartFailed { error: String },
    /// The test report has no failure and the artifact was uploaded.
    TestsPassed { passed: u32, total: u32 },
    /// The test report lists failures.
    TestsFailed { failed: u32, total: u32 },
    /// The test report could not be read or counted (or its counts cannot be trusted): the
    /// build fails, with `error` as its cause.
    TestReportUnusable { error: String },
    /// The artifact could not be published after retries.
    ArtifactUploadFailed { error: String },
    /// The MacBuild asked for cancellation or is being deleted. `at_start` is the number of tart
    /// processes recovery killed, when found at agent start.
    CancelRequested { at_start: Option<u32> },
    /// The MacBuild's owner (the CustomRun) was deleted. `at_start` as for `CancelRequested`.
    OwnerDeleted { at_start: Option<u32> },
    /// The host execution deadline passed (for a `Requested` retry: too little is left to start).
    DeadlinePassed { at_start: Option<u32> },
    /// The VM is gone after the deadline: the watchdog deleted it.
    WatchdogRemovedVm,
    /// Recovery found the attempt open at agent start and killed `killed` tart processes.
    AgentRestarted { killed: u32 },
    /// The MacBuild's spec is not the one the attempt started with (`change` says how: the
    /// generations, or a step index past the end of the steps), so the attempt is not resumed:
    /// it is interrupted and its VM deleted. `at_start` as for `CancelRequested` (found by
    /// recovery), `None` when the resumed executor found it.
    SpecChanged { change: String, at_start: Option<u32> },
    /// The agent's own task driving the attempt failed (a panic, with its message): the attempt
    /// is interrupted as if the agent had restarted, and its VM deleted.
    AgentFault { message: String },
    /// The VM's deletion is confirmed.
    VmDeleted { how: Deleted },
    /// `tart delete` failed (or the VM is still listed).
    DeleteFailed { context: DeleteContext, error: String },
    /// Step `step` ran longer than its `timeoutSeconds` (`timeout_seconds`); `killed` says how its
    /// job in the guest was stopped, `output` is the end of its output.
    StepTimedOut {
        step: String,
        timeout_seconds: u32,
        killed: String,
        output: String,
    },
    /// The MacBuild asks for a mount the agent's config does not declare (or a malformed list):
    /// found before the clone, so nothing was cloned.
    MountRefused { error: String },
    /// `spec.env` could not be made (a Secret not allowed, missing, or unreadable): the build
    /// fails with `reason` (`SecretNotAllowed`, `SecretMissing`, `SecretUnreadable`) and `error`,
    /// which names the variable and the Secret, never a value. Sent before the clone, or when a
    /// restarted agent reads the Secrets again for a running attempt.
    EnvRefused { reason: Reason, error: String },
}

macro_rules! event_kinds {
    ($($kind:ident,)+) => {
        /// The kind of an [`Event`], without its data (for tables and refusals).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum EventKind { $($kind,)+ }

        impl EventKind {
            /// Every kind, in declaration order.
            pub const ALL: &'static [EventKind] = &[$(EventKind::$kind,)+];

            /// The kind's name, as in the source.
            pub fn as_str(self) -> &'static str {
                match self { $(EventKind::$kind => stringify!($kind),)+ }
            }
        }

        impl Event {
            /// This event's kind.
            pub fn kind(&self) -> EventKind {
                match self { $(Event::$kind { .. } => EventKind::$kind,)+ }
            }
        }
    };
}

event_kinds! {
    Admit,
    Adopt,
    ClaimLost,
    ClaimUnconfirmed,
    Boot,
    Adopted,
    GuestReady,
    StepStarting,
    Detach,
    Resume,
    StepsSucceeded,
    StepFailed,
    VmStartFailed,
    TestsPassed,
    TestsFailed,
    TestReportUnusable,
    ArtifactUploadFailed,
    CancelRequested,
    OwnerDeleted,
    DeadlinePassed,
    WatchdogRemovedVm,
    AgentRestarted,
    SpecChanged,
    AgentFault,
    VmDeleted,
    DeleteFailed,
    StepTimedOut,
    MountRefused,
    EnvRefused,
}

impl fmt::Display for EventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// I/O the runtime performs after the transition's record is synced, in the order given.
/// A failing action becomes an event (noted per variant) and the remaining actions are dropped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Fenced claim write for this attempt (adds the finalizer) → `Admit` once a slot is free, or
    /// `ClaimLost`.
    ClaimBuild { attempt: u32 },
    /// Write the per-VM deadline file the watchdog reads; before any clone.
    WriteDeadlineFile { vm: String, deadline: Timestamp },
    /// `tart clone` of the spec's image onto a fresh name (failure → `VmStartFailed`).
    CloneVm { vm: String },
    /// `tart set --random-mac` plus the spec's resources (failure → `VmStartFailed`).
    SetVm { vm: String },
    /// `tart run --no-graphics` in the background (failure → `VmStartFailed`).
    StartVm { vm: String },
    /// Poll `tart exec <vm> true` → `GuestReady`, or `VmStartFailed` when it never answers.
    ProbeReady { vm: String },
    /// Ask the adopted warm VM's guest once more (`tart exec <vm> true`) → `Adopted`, or
    /// `VmStartFailed` when it does not answer within the probe timeout.
    ProbeAdopted { vm: String },
    /// Start step `index` in the guest as a detached job unless it was started already, and
    /// follow it to its exit → `StepStarting` for the next one, `StepsSucceeded` after the last,
    /// or `StepFailed`.
    /// `since` is when the step started (its `timeoutSeconds` counts from it, also when a
    /// restarted agent re-attaches).
    RunStep { vm: String, index: u32, since: Timestamp },
    /// Gather the test report → `TestsFailed` when it lists failures, `TestReportUnusable` when it
    /// cannot be counted, else go on.
    CollectResults { vm: String },
    /// Upload the artifacts (retrying) → `TestsPassed`, or `ArtifactUploadFailed`.
    UploadArtifacts { vm: String },
    /// `tart stop` + `tart delete` (absent counts as deleted) → `VmDeleted` with
    /// `context.deleted(took)`, or `DeleteFailed { context, .. }`.
    StopAndDeleteVm { vm: String, context: DeleteContext },
    /// The watchdog deleted the VM: check `tart list` without touching it → `VmDeleted
    /// { how: ByWatchdog }`, or `DeleteFailed { context: Watchdog, .. }` if it is still there.
    ConfirmVmGone { vm: String },
    /// Retry `tart delete` of a quarantined VM after `after` → `VmDeleted { how: OnRetry }`;
    /// on failure schedule this action again (no new record).
    RetryDeleteLater { vm: String, after: SignedDuration },
    /// The VM is gone: its deadline file has nothing left to guard.
    RemoveDeadlineFile { vm: String },
    /// Mark the slot free in the runtime's slot table.
    ReleaseSlot { slot: u8 },
    /// Submit the MacBuild status for the record just journaled (queued; retried on failure).
    DeliverStatus,
    /// Remove the agent's finalizer: the VM is confirmed gone and no retry follows.
    RemoveFinalizer,
    /// Journal the next attempt ([`request`]) and admit it once a slot is free, keeping the
    /// original deadline.
    AdmitNextAttempt { attempt: u32, deadline: Timestamp },
}

/// A ready warm VM of the pool that an attempt takes at its admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adoption {
    pub vm: String,
    /// What the VM was cloned and booted as.
    pub profile: WarmProfile,
}

/// The result of [`step`]: the record to journal and the actions to perform after it.
#[derive(Clone, Debug, PartialEq)]
pub struct Transition {
    /// `None` only for an attempt's first record.
    pub from: Option<AttemptState>,
    pub to: AttemptState,
    pub reason: Option<Reason>,
    /// Set only on the transition that fixes the outcome; later records leave it `None`.
    pub outcome: Option<Outcome>,
    pub detail: String,
    /// The slot chosen by this transition (admission only).
    pub slot: Option<u8>,
    /// The deadline fixed by this transition (admission, or a retry's request).
    pub deadline: Option<Timestamp>,
    /// The step this transition starts (`StepStarted` only).
    pub step: Option<u32>,
    /// The warm VM the attempt takes (an admission by [`Event::Adopt`] only).
    pub adoption: Option<Adoption>,
    /// The time of the decision (`now`).
    pub at: Timestamp,
    pub actions: Vec<Action>,
}

/// Why [`step`] refused an event. Every refusal names the state and the event.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("{event} is not a transition of an attempt in state {state}")]
    NotAllowed { state: AttemptState, event: EventKind },
    #[error("{event} refused in state {state}: outcome {} is already recorded and is kept", show(.outcome))]
    OutcomeFixed {
        state: AttemptState,
        event: EventKind,
        outcome: Option<Outcome>,
    },
    #[error("{event} refused in state {state}: slot {slot} is not one of the host's {slots} slot(s) (1 or 2)")]
    BadSlot {
        state: AttemptState,
        event: EventKind,
        slot: u8,
        slots: u8,
    },
    #[error(
        "{event} refused in state {state}: retry a{attempt} needs {}s before the deadline {deadline}, {}s left; \
         send DeadlinePassed to close it",
        .needed.as_secs(), .left.as_secs()
    )]
    RetryWindowClosed {
        state: AttemptState,
        event: EventKind,
        attempt: u32,
        deadline: Timestamp,
        left: SignedDuration,
        needed: SignedDuration,
    },
    #[error("{event} refused in state {state}: the attempt has no host execution deadline")]
    NoDeadline { state: AttemptState, event: EventKind },
    #[error(
        "{event} refused in state {state}: step {index} is not the one after step {current}; a step is never started twice"
    )]
    StepNotNext {
        state: AttemptState,
        event: EventKind,
        index: u32,
        current: u32,
    },
    #[error("{event} refused in state {state}: the deadline {deadline} has not passed")]
    DeadlineNotReached {
        state: AttemptState,
        event: EventKind,
        deadline: Timestamp,
    },
}

fn show(o: &Option<Outcome>) -> &'static str {
    o.map_or("(none)", Outcome::as_str)
}

impl Refusal {
    /// The state the event was refused in.
    pub fn state(&self) -> AttemptState {
        match self {
            Refusal::NotAllowed { state, .. }
            | Refusal::OutcomeFixed { state, .. }
            | Refusal::BadSlot { state, .. }
            | Refusal::RetryWindowClosed { state, .. }
            | Refusal::NoDeadline { state, .. }
            | Refusal::StepNotNext { state, .. }
            | Refusal::DeadlineNotReached { state, .. } => *state,
        }
    }

    /// The refused event's kind.
    pub fn event(&self) -> EventKind {
        match self {
            Refusal::NotAllowed { event, .. }
            | Refusal::OutcomeFixed { event, .. }
            | Refusal::BadSlot { event, .. }
            | Refusal::RetryWindowClosed { event, .. }
            | Refusal::NoDeadline { event, .. }
            | Refusal::StepNotNext { event, .. }
            | Refusal::DeadlineNotReached { event, .. } => *event,
        }
    }
}

/// Why no further attempt follows (see [`decide_retry`]).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NoRetry {
    #[error("outcome {} does not permit a retry (only Interrupted does)", show(.outcome))]
    NotInterrupted { outcome: Option<Outcome> },
    #[error("{reason} was recorded; a withdrawn build is never retried")]
    Withdrawn { reason: Reason },
    #[error("the MacBuild is gone")]
    BuildGone,
    #[error("attempt {attempt} of {max} used (maxAttempts {max})")]
    MaxAttemptsReached { attempt: u32, max: u8 },
    #[error("maxAttempts {max} is outside 1..=3")]
    InvalidMaxAttempts { max: u8 },
    #[error("the attempt has no host execution deadline to keep")]
    NoDeadline,
    #[error("{}s left before the deadline {deadline}, a retry needs {}s", .left.as_secs(), .needed.as_secs())]
    TooLittleTime {
        deadline: Timestamp,
        left: SignedDuration,
        needed: SignedDuration,
    },
}

/// The attempt a retry creates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NextAttempt {
    pub build: BuildRef,
    pub attempt: u32,
    /// The original deadline, kept.
    pub deadline: Timestamp,
}

/// Whether `a` may be followed by another attempt at `now`: only after `Interrupted`, only if
/// the build was not withdrawn, only below `maxAttempts`, and only with at least
/// `cfg.retry_min_remaining` left before the original deadline.
pub fn decide_retry(a: &Attempt, now: Timestamp, cfg: &Config) -> Result<NextAttempt, NoRetry> {
    if a.outcome != Some(Outcome::Interrupted) {
        return Err(NoRetry::NotInterrupted { outcome: a.outcome });
    }
    if a.build_gone {
        return Err(NoRetry::BuildGone);
    }
    if let Some(reason) = a.withdrawn {
        return Err(NoRetry::Withdrawn { reason });
    }
    if !MAX_ATTEMPTS_RANGE.contains(&a.max_attempts) {
        return Err(NoRetry::InvalidMaxAttempts { max: a.max_attempts });
    }
    if a.number >= u32::from(a.max_attempts) {
        return Err(NoRetry::MaxAttemptsReached {
            attempt: a.number,
            max: a.max_attempts,
        });
    }
    let deadline = a.deadline.ok_or(NoRetry::NoDeadline)?;
    let left = now.duration_until(deadline);
    if left < cfg.retry_min_remaining {
        return Err(NoRetry::TooLittleTime {
            deadline,
            left,
            needed: cfg.retry_min_remaining,
        });
    }
    Ok(NextAttempt {
        build: a.build.clone(),
        attempt: a.number + 1,
        deadline,
    })
}

/// The first record of an attempt (`[*] -> Requested`), before its claim. `a` comes from
/// [`Attempt::new`]; for a retry pass the original deadline, which the record keeps.
pub fn request(a: &Attempt, retry_of: Option<&NextAttempt>, now: Timestamp) -> Transition {
    let (detail, deadline) = match retry_of {
        Some(next) => (
            format!(
                "retry after a{} was interrupted; deadline {} kept",
                a.number.saturating_sub(1),
                next.deadline
            ),
            Some(next.deadline),
        ),
        None => ("claiming".to_string(), None),
    };
    Transition {
        from: None,
        to: AttemptState::Requested,
        reason: None,
        outcome: None,
        detail,
        slot: None,
        deadline,
        step: None,
        adoption: None,
        at: now,
        actions: vec![Action::ClaimBuild { attempt: a.number }],
    }
}

/// The one transition function. Pure: `now` is an argument, I/O comes back as [`Action`]s.
///
/// A dispatcher over the source state; each rule is a named function of the state's module
/// (`requested`, `open`, `retiring`).
pub fn step(a: &Attempt, event: Event, now: Timestamp, cfg: &Config) -> Result<Transition, Refusal> {
    use AttemptState as S;
    let r = Rule {
        a,
        state: a.state,
        kind: event.kind(),
        now,
        cfg,
    };
    match a.state {
        S::Requested => requested::from_requested(&r, event),
        S::Admitted => open::from_admitted(&r, event),
        S::Booting => open::from_booting(&r, event),
        S::Running => open::from_running(&r, event),
        S::Collecting => open::from_collecting(&r, event),
        S::Retiring => retiring::from_retiring(&r, event),
        S::Quarantined => retiring::from_quarantined(&r, event),
        S::Retired => Err(r.not_allowed()),
    }
}

/// What every rule reads: the attempt, the event's kind (for refusals), the time of the decision
/// and the host's knobs.
struct Rule<'a> {
    a: &'a Attempt,
    state: AttemptState,
    kind: EventKind,
    now: Timestamp,
    cfg: &'a Config,
}

impl Rule<'_> {
    /// A transition out of the attempt's state; the rules that fix an outcome, a slot, a
    /// deadline or a step set them on it.
    fn t(&self, to: AttemptState, reason: Option<Reason>, detail: String, actions: Vec<Action>) -> Transition {
        Transition {
            from: Some(self.state),
            to,
            reason,
            outcome: None,
            // Details carry tart's and the guest's words into the journal, the status and events.
            detail: tartan_api::text::clean_str(&detail, DETAIL_MAX),
            slot: None,
            deadline: None,
            step: None,
            adoption: None,
            at: self.now,
            actions,
        }
    }

    fn not_allowed(&self) -> Refusal {
        Refusal::NotAllowed {
            state: self.state,
            event: self.kind,
        }
    }

    fn vm(&self) -> String {
        self.a.vm.clone()
    }
}

/// Terminal status, then the finalizer (skipped when the MacBuild is gone).
fn finish(a: &Attempt) -> Vec<Action> {
    if a.build_gone || a.claim_lost {
        vec![]
    } else {
        vec![Action::DeliverStatus, Action::RemoveFinalizer]
    }
}

fn deliver(a: &Attempt) -> Vec<Action> {
    if a.build_gone || a.claim_lost {
        vec![]
    } else {
        vec![Action::DeliverStatus]
    }
}

fn withdrawal_reason(ev: &Event) -> Reason {
    match ev {
        Event::OwnerDeleted { .. } => Reason::OwnerDeleted,
        _ => Reason::CancelRequested,
    }
}

fn withdrawal_text(a: &Attempt, reason: Reason) -> String {
    match reason {
        Reason::OwnerDeleted => "owner deleted".to_string(),
        _ if a.build_gone => "MacBuild deleted".to_string(),
        _ => "cancel requested".to_string(),
    }
}

fn at_start(ev: &Event) -> Option<u32> {
    match ev {
        Event::CancelRequested { at_start } | Event::OwnerDeleted { at_start } | Event::DeadlinePassed { at_start } => {
            *at_start
        }
        _ => None,
    }
}

fn context(at_start: Option<u32>) -> DeleteContext {
    if at_start.is_some() {
        DeleteContext::AgentStart
    } else {
        DeleteContext::Normal
    }
}

/// Appends the source's at-start wording: "found Running at agent start; killed 0 tart process(es)".
fn with_start(cause: String, state: AttemptState, killed: Option<u32>) -> String {
    match killed {
        None => cause,
        Some(n) => {
            let found = format!("found {state} at agent start; killed {n} tart process(es)");
            if cause.is_empty() {
                found
            } else {
                format!("{cause}; {found}")
            }
        }
    }
}

/// What an open attempt is doing, for the detach and resume records.
fn doing(a: &Attempt) -> String {
    match a.state {
        AttemptState::Booting => "the boot".to_string(),
        AttemptState::Running => format!("step {}", a.current_step() + 1),
        _ => "the collection of results".to_string(),
    }
}

fn secs2(d: SignedDuration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

/// One claim on a slot: an attempt in a slot-holding state, or a quarantined unknown VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotHolder {
    /// Holds exactly this slot.
    Slot(u8),
    /// Holds some slot without a number (an unknown VM found when every slot was taken): it
    /// blocks one of whatever slots are left.
    Unnumbered,
}

/// The lowest free slot of `slots` (1 or 2), or `None`. A slot is free only when no attempt
/// holds it (every state but `Requested`/`Retired`, so `Quarantined` keeps it) and no unknown VM
/// blocks it; this never returns a held slot, so two admitted allocations never share one.
pub fn free_slot(slots: u8, holders: &[SlotHolder]) -> Option<u8> {
    let free: Vec<u8> = (0..slots.min(2))
        .filter(|s| !holders.contains(&SlotHolder::Slot(*s)))
        .collect();
    let unnumbered = holders.iter().filter(|h| **h == SlotHolder::Unnumbered).count();
    // Unnumbered holders take free slots from the top, so the lowest stays predictable.
    if free.len() > unnumbered {
        free.first().copied()
    } else {
        None
    }
}

/// The slot holders among `attempts` (those whose state holds a slot).
pub fn attempt_holders<'a>(attempts: impl IntoIterator<Item = &'a Attempt>) -> Vec<SlotHolder> {
    attempts
        .into_iter()
        .filter(|a| a.state.holds_slot())
        .map(|a| a.slot.map_or(SlotHolder::Unnumbered, SlotHolder::Slot))
        .collect()
}

#[cfg(test)]
mod tests;
