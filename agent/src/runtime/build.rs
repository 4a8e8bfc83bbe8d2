//! One build on this agent: its attempts, one after the other, from the claim (or from recovery)
//! until its VM is confirmed gone and no attempt follows.
//!
//! The loop for an attempt is "step → journal (synced) → report → act → event": nothing happens
//! on the host or in the cluster before the transition asking for it is in the journal.
//!
//! A build's task owns a [`BuildTask`]: its withdrawal signal and the slot reservation it holds
//! between attempts. Reservations move by value (the scan's or a retry's wait's into
//! [`claim_and_run`] and [`admit`]); whatever path ends the task drops what it still holds, which
//! frees the slot.

use super::core::{Placed, Shared};
use super::slots::SlotReservation;
use crate::cluster::claim::{self, ClaimOutcome};
use crate::host::{
    AttemptExecutor, AttemptHooks, CancelSignal, ExecutorConfig, HostAttempt, Performed, Withdrawal, cancel_pair,
};
use crate::machine::{self, Action, Attempt, AttemptKey, Event, NextAttempt, Refusal, Transition};
use crate::record::{BuildRef, Record};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Api;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tartan_api::{AttemptState, BuildResults, MacBuild, MacBuildSpec, vm_name};

/// Where an attempt stands when its loop stops.
#[derive(Debug, PartialEq)]
pub enum Rest {
    /// The attempt is retired; `next` is owed when the machine asked for another attempt.
    Retired { next: Option<NextAttempt> },
    /// A transition could not be journaled: once the journal can be written again the attempt
    /// is taken over as after a fault (its VM was stopped and deleted meanwhile).
    JournalFailed(String),
    /// A transition was refused; the attempt stays as the journal says and the next agent start
    /// recovers it.
    Stuck(String),
}

/// Registers a task for the build `uid` on this agent: the main loop withdraws it through the
/// handle kept with the build's state, and every executor of the build (all its attempts) listens
/// to the returned signal, so a withdrawal that comes before an executor exists is not lost.
pub async fn register(shared: &Shared, uid: &str) -> CancelSignal {
    let (handle, signal) = cancel_pair();
    shared.builds.task_started(uid, handle).await;
    signal
}

/// What a build's task carries from attempt to attempt: the build's withdrawal signal, and the
/// slot reservation the task holds, if any: one handed on by an attempt retired with a retry owed,
/// or one whose admission is not journaled yet (its journal write failed; the take-over admits it
/// again). Dropped with the task, which frees that slot.
#[derive(Debug)]
pub struct BuildTask {
    pub cancel: CancelSignal,
    slot: Option<SlotReservation>,
}

impl BuildTask {
    /// A task holding no slot.
    pub fn new(cancel: CancelSignal) -> BuildTask {
        BuildTask { cancel, slot: None }
    }

    /// A task holding `reservation` (for its next attempt).
    pub fn holding(cancel: CancelSignal, reservation: SlotReservation) -> BuildTask {
        BuildTask {
            cancel,
            slot: Some(reservation),
        }
    }

    /// The slot the task holds a reservation of, if any.
    pub fn reserved_slot(&self) -> Option<u8> {
        self.slot.as_ref().map(SlotReservation::slot)
    }
}

/// The executor for `attempt`, listening to its build's withdrawal signal.
pub fn executor_for(shared: &Shared, attempt: &Attempt, spec: MacBuildSpec, cancel: &CancelSignal) -> AttemptExecutor {
    let provisional = Timestamp::now() + SignedDuration::from_secs(i64::from(spec.timeout_seconds));
    let host = HostAttempt {
        build: attempt.build.clone(),
        attempt: attempt.number,
        vm: attempt.vm.clone(),
        deadline: attempt.deadline.unwrap_or(provisional),
        spec,
        agent: shared.config.agent_id.clone(),
    };
    let cfg = ExecutorConfig {
        artifacts: shared.config.artifacts.clone(),
        local_images: shared.config.local_images.clone(),
        detach_vm: shared.machine.resume_after_restart,
        step_poll: shared.config.timing.step_poll,
        log_ship: crate::host::log_shipper::ShipSettings {
            interval: shared.config.logs.ship_interval,
            ..Default::default()
        },
        mounts: shared.config.mounts.clone(),
        network: shared.config.network.clone(),
        secrets: (!shared.config.secrets.allowed.is_empty()).then(|| crate::host::env::SecretAccess {
            allowed: shared.config.secrets.allowed.iter().cloned().collect(),
            source: Arc::new(crate::host::env::KubeSecrets {
                client: shared.client.clone(),
                timeout: shared.config.timing.api_timeout,
            }),
        }),
        build_log_budget: shared.config.logs.max_build_bytes,
        ..ExecutorConfig::new(&shared.config.state_dir)
    };
    AttemptExecutor::new(host, shared.tart.clone(), cfg, cancel.clone())
}

/// A spec for an attempt whose MacBuild is gone: only retiring actions (stop, delete) run, and
/// they need nothing from it.
pub fn spec_of_gone_build() -> MacBuildSpec {
    MacBuildSpec {
        max_attempts: 1,
        ..MacBuildSpec::new(String::new(), Vec::new())
    }
}

/// Follows `attempt` from `first` until it rests, through the host's step → journal → act loop.
/// `slot` is the build task's reservation: the journal steps admit or hand it on ([`Shared::journal`]).
pub async fn run_attempt(
    shared: &Shared,
    exec: &mut AttemptExecutor,
    attempt: &mut Attempt,
    first: Event,
    generation: Option<i64>,
    slot: &mut Option<SlotReservation>,
) -> Rest {
    let mut hooks = Hooks {
        shared,
        generation,
        next: None,
        slot,
    };
    match crate::host::drive(exec, attempt, first, &shared.machine, &mut hooks).await {
        Ok(AttemptState::Retired) => Rest::Retired { next: hooks.next },
        Ok(state) => Rest::Stuck(format!("{} rests in {state} with nothing to do", attempt.key())),
        Err(error @ crate::host::DriveError::Journal { .. }) => {
            tracing::error!(attempt = %attempt.key(), %error, "attempt stopped until the journal can be written again");
            Rest::JournalFailed(error.to_string())
        }
        Err(error) => {
            tracing::error!(attempt = %attempt.key(), %error, "attempt stopped; it stays as journaled");
            Rest::Stuck(error.to_string())
        }
    }
}

/// The runtime's side of an attempt's loop: the journal, then the report (status and Events),
/// and the non-host actions.
struct Hooks<'a> {
    shared: &'a Shared,
    generation: Option<i64>,
    /// The next attempt the machine asked for, if any.
    next: Option<NextAttempt>,
    /// The build task's slot reservation.
    slot: &'a mut Option<SlotReservation>,
}

impl AttemptHooks for Hooks<'_> {
    async fn journal(
        &mut self,
        attempt: &Attempt,
        t: &Transition,
        results: &BuildResults,
        logs: Option<&str>,
    ) -> Result<Record, String> {
        let journaled = self
            .shared
            .journal(attempt, t, Some(results), self.generation, logs, self.slot)
            .await
            .map_err(|e| e.to_string())?;
        Ok(self.shared.report(journaled))
    }

    async fn act(&mut self, attempt: &Attempt, action: &Action) -> Option<Event> {
        match action {
            // Status went out with the journal write; slots are computed from the journal.
            Action::DeliverStatus | Action::ReleaseSlot { .. } => None,
            Action::RemoveFinalizer => {
                release_finalizer(self.shared, &attempt.build).await;
                None
            }
            Action::AdmitNextAttempt {
                attempt: number,
                deadline,
            } => {
                self.next = Some(NextAttempt {
                    build: attempt.build.clone(),
                    attempt: *number,
                    deadline: *deadline,
                });
                None
            }
            other => {
                tracing::error!(attempt = %attempt.key(), action = ?other, "action not for the runtime; ignored");
                None
            }
        }
    }
}

/// How long the finalizer's removal is retried: it outlasts an API outage the agent rode out
/// (the MacBuild only waits meanwhile, which is the safe side).
const FINALIZER_RETRY_FOR: Duration = Duration::from_secs(3600);

/// Removes our finalizer, retrying with capped backoff for up to [`FINALIZER_RETRY_FOR`]. A
/// build whose finalizer could not be removed stays in the journal (compaction keeps it), so the
/// next agent start removes it.
pub async fn release_finalizer(shared: &Shared, build: &BuildRef) {
    let started = std::time::Instant::now();
    let mut wait = Duration::from_millis(500);
    loop {
        match claim::release(
            &shared.client,
            shared.config.timing.api_timeout,
            build,
            &shared.config.agent_id,
        )
        .await
        {
            Ok(()) => {
                shared.builds.set_finalizer_owed(&build.uid, false).await;
                return;
            }
            Err(error) if started.elapsed() < FINALIZER_RETRY_FOR => {
                tracing::warn!(%build, %error, retry_in = ?wait, "finalizer not removed yet")
            }
            Err(error) => {
                tracing::error!(%build, %error, "finalizer still on after {FINALIZER_RETRY_FOR:?}; the next agent start removes it");
                shared.builds.set_finalizer_owed(&build.uid, true).await;
                return;
            }
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_secs(30));
    }
}

/// Why a MacBuild could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadBuildError {
    #[error("reading MacBuild {build}: {error}")]
    Api { build: BuildRef, error: kube::Error },
    #[error("reading MacBuild {build}: no answer within {limit:?}")]
    Timeout { build: BuildRef, limit: Duration },
}

/// Reads the MacBuild named by `build`, if it still exists with the same uid.
pub async fn read_build(shared: &Shared, build: &BuildRef) -> Result<Option<MacBuild>, ReadBuildError> {
    let api: Api<MacBuild> = Api::namespaced(shared.client.clone(), &build.namespace);
    let limit = shared.config.timing.api_timeout;
    match tokio::time::timeout(limit, api.get_opt(&build.name)).await {
        Ok(Ok(Some(mb))) if mb.metadata.uid.as_deref() == Some(build.uid.as_str()) => Ok(Some(mb)),
        Ok(Ok(_)) => Ok(None),
        Ok(Err(error)) => Err(ReadBuildError::Api {
            build: build.clone(),
            error,
        }),
        Err(_) => Err(ReadBuildError::Timeout {
            build: build.clone(),
            limit,
        }),
    }
}

/// Journals attempt `number` of `mb` (`[*] -> Requested`), claims it and admits it into the slot
/// of `reservation`, then runs it. Returns where the attempt rests; a slot the attempt hands on to
/// its retry is left in `task`.
pub async fn claim_and_run(
    shared: &Shared,
    mb: &MacBuild,
    number: u32,
    retry_of: Option<&NextAttempt>,
    reservation: SlotReservation,
    task: &mut BuildTask,
) -> Rest {
    let build = BuildRef::of(mb);
    let vm = vm_name(&build.namespace, &build.name, &build.uid, number);
    let max_attempts = u8::try_from(mb.spec.max_attempts).unwrap_or(shared.machine.default_max_attempts);
    let mut attempt = Attempt::new(build.clone(), number, vm, max_attempts);
    let generation = mb.metadata.generation;
    // The journal, not a cached MacBuild, says what was run: an attempt it already has is never
    // requested (and so never cloned) again.
    if shared.builds.has_attempt(&attempt.key()).await {
        tracing::warn!(attempt = %attempt.key(), "the journal already has this attempt; not claiming it again");
        return Rest::Retired { next: None };
    }
    let t = machine::request(&attempt, retry_of, Timestamp::now());
    match shared.journal(&attempt, &t, None, generation, None, &mut None).await {
        Ok(journaled) => attempt.observe(&shared.report(journaled)),
        Err(error) => return Rest::JournalFailed(error.to_string()),
    }
    admit(shared, mb, &mut attempt, reservation, task).await
}

/// Claims `attempt` (already `Requested`) and runs it from the admission on, into the slot of
/// `reservation` (released if the claim is lost).
pub async fn admit(
    shared: &Shared,
    mb: &MacBuild,
    attempt: &mut Attempt,
    reservation: SlotReservation,
    task: &mut BuildTask,
) -> Rest {
    let build = attempt.build.clone();
    let timeout = SignedDuration::from_secs(i64::from(mb.spec.timeout_seconds));
    let first = match claim_with_retries(shared, mb, attempt.number, timeout).await {
        Ok(ClaimOutcome::Won { claim, macbuild }) => {
            shared.delivery.observed(&macbuild);
            shared
                .builds
                .claim_made(&build.uid, claim.epoch, macbuild.status.clone())
                .await;
            let slot = reservation.slot();
            let adoption = reservation.adoption().cloned();
            // Held by the task until the `Admitted` record ends it (or a failed write leaves it
            // for the take-over).
            task.slot = Some(reservation);
            let slots = shared.config.slots;
            match adoption {
                Some(adoption) => Event::Adopt {
                    slot,
                    slots,
                    timeout,
                    adoption,
                },
                None => Event::Admit { slot, slots, timeout },
            }
        }
        Ok(ClaimOutcome::Lost { reason }) => {
            drop(reservation);
            Event::ClaimLost { holder: reason }
        }
        Err((error, last_read)) => {
            drop(reservation);
            // The claim may have landed: the status that answers for it is built on the build as
            // last read, under the claim this agent wrote.
            let wrote = claim::claim_for(&last_read, &shared.config.agent_id, attempt.number);
            shared
                .builds
                .claim_made(&build.uid, wrote.epoch, last_read.status.clone())
                .await;
            // The last try's failure, without the error's "it will be tried again": it will not.
            Event::ClaimUnconfirmed {
                error: format!("{} MacBuild {} failed: {}", error.action, error.build, error.detail),
            }
        }
    };
    let event = match (
        &first,
        machine::step(attempt, first.clone(), Timestamp::now(), &shared.machine),
    ) {
        // Too little time is left for a retry: it ends here instead of being admitted.
        (Event::Admit { .. } | Event::Adopt { .. }, Err(Refusal::RetryWindowClosed { .. })) => {
            Event::DeadlinePassed { at_start: None }
        }
        _ => first,
    };
    // An adopting attempt's VM is the warm one from its admission on.
    let mut exec = match &event {
        Event::Adopt { adoption, .. } => {
            let adopting = Attempt {
                vm: adoption.vm.clone(),
                ..attempt.clone()
            };
            executor_for(shared, &adopting, mb.spec.clone(), &task.cancel)
        }
        _ => executor_for(shared, attempt, mb.spec.clone(), &task.cancel),
    };
    let generation = mb.metadata.generation;
    run_attempt(shared, &mut exec, attempt, event, generation, &mut task.slot).await
}

/// The fenced claim, retried with capped backoff while the API fails; bounded by the build's
/// timeout (an answer never came: nothing was cloned). The error comes with the build as last
/// read.
async fn claim_with_retries(
    shared: &Shared,
    mb: &MacBuild,
    number: u32,
    limit: SignedDuration,
) -> Result<ClaimOutcome, (claim::ClaimError, MacBuild)> {
    let started = std::time::Instant::now();
    let limit = Duration::try_from(limit).unwrap_or(Duration::from_secs(3600));
    let mut wait = Duration::from_millis(250);
    let mut current = mb.clone();
    loop {
        match claim::claim(
            &shared.client,
            shared.config.timing.api_timeout,
            &current,
            &shared.config.agent_id,
            number,
        )
        .await
        {
            Ok(outcome) => return Ok(outcome),
            Err(error) if started.elapsed() + wait < limit => {
                tracing::warn!(%error, retry_in = ?wait, "claim not confirmed; trying again");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(10));
                if let Ok(Some(fresh)) = read_build(shared, &BuildRef::of(mb)).await {
                    current = fresh;
                }
            }
            Err(error) => return Err((error, current)),
        }
    }
}

/// The reservation `held` if there is one, else waits until a slot is free for build `uid` (which
/// this agent holds: no new build is claimed meanwhile) and reserves it (a ready warm VM serving
/// `spec` is reserved for it to adopt, and a warm VM of another image gives its slot up for it);
/// `None` once `until` has passed.
pub async fn wait_for_slot(
    shared: &Shared,
    held: Option<SlotReservation>,
    uid: &str,
    spec: &MacBuildSpec,
    until: Timestamp,
) -> Option<SlotReservation> {
    if held.is_some() {
        return held;
    }
    let _waiting = shared.builds.waiting_held(uid);
    loop {
        let notified = shared.builds.slot_freed().notified();
        if let Placed::Reserved(reservation) = shared.builds.place(uid, shared.config.slots, spec).await {
            return Some(reservation);
        }
        let left = until.duration_since(Timestamp::now());
        let left = Duration::try_from(left).ok()?;
        // Re-check at least every few seconds: an operator may remove an unknown VM by hand.
        let _ = tokio::time::timeout(left.min(Duration::from_secs(2)), notified).await;
        if Timestamp::now() >= until {
            return None;
        }
    }
}

/// Runs owed next attempts until none follows, then forgets the build's task (and frees the slot
/// it still holds, if any).
pub async fn follow_retries(shared: Arc<Shared>, build: BuildRef, mut rest: Rest, mut task: BuildTask) {
    // A failure the disk's recovery does not cure (a record the journal refuses, whatever the
    // disk does) must not loop: a few takeovers, a pause before each, then the next start.
    let mut takeovers = 0u32;
    loop {
        let next = match &rest {
            Rest::Retired { next: Some(next) } => next.clone(),
            Rest::JournalFailed(why) if takeovers >= MAX_TASK_FAULTS => {
                rest = Rest::Stuck(format!("journal write failed {takeovers} times: {why}"));
                continue;
            }
            Rest::JournalFailed(why) => {
                let why = format!("journal write failed: {why}");
                takeovers += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
                wait_until_journal_writable(&shared).await;
                rest = after_fault(&shared, &build, &why, &mut task).await;
                continue;
            }
            Rest::Retired { next: None } | Rest::Stuck(_) => break,
        };
        let latest = match read_build(&shared, &build).await {
            Ok(Some(mb)) => mb,
            Ok(None) => {
                tracing::info!(%build, "MacBuild is gone; no further attempt");
                break;
            }
            Err(error) => {
                tracing::warn!(%build, %error, "cannot read the MacBuild for the next attempt; retrying");
                tokio::time::sleep(Duration::from_secs(2)).await;
                rest = Rest::Retired { next: Some(next) };
                continue;
            }
        };
        // A withdrawal that came while the previous attempt was retiring ends the build here.
        if withdrawal_of(&latest).is_some() {
            let ending = Event::CancelRequested { at_start: None };
            rest = request_and_end(&shared, &latest, &next, ending, &mut task).await;
            continue;
        }
        let until = next.deadline - shared.machine.retry_min_remaining;
        let Some(reservation) = wait_for_slot(&shared, task.slot.take(), &build.uid, &latest.spec, until).await else {
            tracing::warn!(%build, attempt = next.attempt, "no slot before the retry window closed");
            let ending = Event::DeadlinePassed { at_start: None };
            rest = request_and_end(&shared, &latest, &next, ending, &mut task).await;
            continue;
        };
        rest = claim_and_run(&shared, &latest, next.attempt, Some(&next), reservation, &mut task).await;
    }
    if let Rest::Stuck(why) = &rest {
        tracing::error!(%build, %why, "build stopped; the next agent start recovers it from the journal");
    }
    shared.builds.task_ended(&build.uid).await;
    // A reservation must not outlive the task that would have used it: the slot a retired
    // attempt passed on to a next one that never came (its MacBuild gone) would count as used
    // until the agent restarts.
    drop(task);
    shared.builds.notify_slot_freed();
}

/// The next attempt must not start (withdrawn, or its window closed): journal it as requested,
/// then ended by `ending`. It takes no slot: one the task still holds is freed.
async fn request_and_end(
    shared: &Shared,
    mb: &MacBuild,
    next: &NextAttempt,
    ending: Event,
    task: &mut BuildTask,
) -> Rest {
    let build = BuildRef::of(mb);
    task.slot = None;
    let vm = vm_name(&build.namespace, &build.name, &build.uid, next.attempt);
    let max_attempts = u8::try_from(mb.spec.max_attempts).unwrap_or(shared.machine.default_max_attempts);
    let mut attempt = Attempt::new(build, next.attempt, vm, max_attempts);
    let t = machine::request(&attempt, Some(next), Timestamp::now());
    match shared
        .journal(&attempt, &t, None, mb.metadata.generation, None, &mut None)
        .await
    {
        Ok(journaled) => attempt.observe(&shared.report(journaled)),
        Err(error) => return Rest::JournalFailed(error.to_string()),
    }
    let mut exec = executor_for(shared, &attempt, mb.spec.clone(), &task.cancel);
    let generation = mb.metadata.generation;
    run_attempt(shared, &mut exec, &mut attempt, ending, generation, &mut task.slot).await
}

/// The withdrawal a MacBuild asks for, if any: a cancel request or a deletion.
pub fn withdrawal_of(mb: &MacBuild) -> Option<Withdrawal> {
    if mb.spec.cancel_requested || mb.metadata.deletion_timestamp.is_some() {
        Some(Withdrawal::CancelRequested)
    } else {
        None
    }
}

/// How many times a build's task is restarted after a panic before it is left to the next agent
/// start (a fault that repeats on every try must not loop).
const MAX_TASK_FAULTS: u32 = 3;

/// Runs a build's task (`work`, given the shared state and the build's withdrawal signal) and
/// watches how it ends: a panic must never leave an attempt open with its VM running and its slot
/// held. The open attempt is then interrupted (`AgentFault`, with the panic's message) or, past
/// its outcome, its owed deletion performed; the retries that may follow run as usual. If that
/// fails too, [`MAX_TASK_FAULTS`] times, the agent gives up and exits ([`give_up`]).
pub fn spawn_supervised<W, F>(shared: Arc<Shared>, build: BuildRef, cancel: CancelSignal, work: W)
where
    W: FnOnce(Arc<Shared>, CancelSignal) -> F + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    spawn_supervised_with(
        shared,
        build,
        cancel,
        work,
        |shared, build, cancel, message| async move {
            // The failed task's reservation, if it held one, was dropped with it: this one
            // reserves again if its attempt still needs a slot.
            let mut task = BuildTask::new(cancel);
            let rest = after_fault(&shared, &build, &message, &mut task).await;
            follow_retries(shared, build, rest, task).await;
        },
    );
}

/// [`spawn_supervised`] with the take-over after a fault given (tests make it fail too).
pub fn spawn_supervised_with<W, F, H, G>(
    shared: Arc<Shared>,
    build: BuildRef,
    cancel: CancelSignal,
    work: W,
    mut take_over: H,
) where
    W: FnOnce(Arc<Shared>, CancelSignal) -> F + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
    H: FnMut(Arc<Shared>, BuildRef, CancelSignal, String) -> G + Send + 'static,
    G: Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        let fenced = tokio::spawn(withdraw_when_fenced_out(Arc::clone(&shared), build.clone()));
        let _stop_watching = AbortOnDrop(fenced);
        let first = work(Arc::clone(&shared), cancel.clone());
        let take_over = |message: String| {
            tracing::error!(%build, %message, "the build's task failed; interrupting its open attempt");
            take_over(Arc::clone(&shared), build.clone(), cancel.clone(), message)
        };
        if let Err(failed) = supervise(first, take_over).await {
            give_up(&shared, &build, &failed.message).await;
        }
    });
}

/// After the build's task failed [`MAX_TASK_FAULTS`] times more: the agent cannot run it, and
/// leaving its attempt open would leave its VM running until the watchdog's deadline. Records the
/// open attempt's interruption (`AgentFault`), so that the next start deletes its VM instead of
/// resuming it (which frees its slot: the failed tasks' reservations went with them), and asks the agent to exit non-zero ([`Shared::fatal`]): launchd
/// starts it again, and recovery finishes what this process could not.
pub async fn give_up(shared: &Shared, build: &BuildRef, message: &str) {
    tracing::error!(%build, %message, "the build's task failed {} times; the agent exits so that launchd starts it again and recovery deletes its VM", MAX_TASK_FAULTS + 1);
    let open = shared.builds.latest_attempt(&build.uid).await.filter(|a| {
        matches!(
            a.state,
            AttemptState::Admitted | AttemptState::Booting | AttemptState::Running | AttemptState::Collecting
        )
    });
    if let Some(a) = open {
        let fault = Event::AgentFault {
            message: format!(
                "{message} (the task failed {} times; the agent exits and its next start deletes the VM)",
                MAX_TASK_FAULTS + 1
            ),
        };
        match machine::step(&a, fault, Timestamp::now(), &shared.machine) {
            Ok(t) => match shared.journal(&a, &t, None, a.generation, None, &mut None).await {
                Ok(journaled) => drop(shared.report(journaled)),
                Err(error) => {
                    tracing::error!(attempt = %a.key(), %error, "the interruption is not journaled; the next start recovers the attempt as found");
                }
            },
            Err(refusal) => {
                tracing::error!(attempt = %a.key(), %refusal, "the interruption is refused; the next start recovers the attempt as found")
            }
        }
    }
    shared.builds.task_ended(&build.uid).await;
    shared.builds.notify_slot_freed();
    shared.fatal.send_replace(Some(format!(
        "the task of build {build} failed {} times (last: {message})",
        MAX_TASK_FAULTS + 1
    )));
}

/// Aborts a task when dropped (the watcher of a build ends with the build's task).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Withdraws the build's open attempt once delivery finds a status write of it fenced out: the
/// claim moved to another holder (this agent was cut off or frozen past its Lease), so the
/// attempt must stop and delete its VM instead of running its copy of the build to the end.
/// Delivery writes nothing more for that attempt; the machine's `ClaimLost` owes the MacBuild
/// nothing either.
pub async fn withdraw_when_fenced_out(shared: Arc<Shared>, build: BuildRef) {
    let mut progress = shared.delivery.progress(&build);
    loop {
        let fenced = progress.borrow_and_update().fenced_out.clone();
        if let Some((stale, now)) = fenced {
            let open_and_stale = |a: &Attempt| {
                matches!(
                    a.state,
                    AttemptState::Admitted | AttemptState::Booting | AttemptState::Running | AttemptState::Collecting
                ) && tartan_api::attempt_id(&build.name, a.number) == stale
            };
            let withdrawn = shared
                .builds
                .withdraw_latest_if(&build.uid, open_and_stale, Withdrawal::ClaimMoved)
                .await;
            if let Some(a) = withdrawn {
                let found = now.map_or("no claim".to_string(), |c| {
                    format!("claim {} by {}", c.attempt, c.holder)
                });
                tracing::error!(attempt = %a.key(), %found, "status write fenced out: the claim moved; stopping the attempt and deleting its VM");
                return;
            }
        }
        if progress.changed().await.is_err() {
            return;
        }
    }
}

/// A build's task failed more often than [`MAX_TASK_FAULTS`] take-overs allow.
#[derive(Debug, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct TaskFailed {
    /// The last failure's panic message.
    pub message: String,
}

/// Runs `first` in its own task; each time a task fails (panics), runs `take_over(message)` in a
/// new one, at most [`MAX_TASK_FAULTS`] times. `Err` carries the last failure when they ran out.
pub async fn supervise<F, H, G>(first: F, mut take_over: H) -> Result<(), TaskFailed>
where
    F: Future<Output = ()> + Send + 'static,
    H: FnMut(String) -> G,
    G: Future<Output = ()> + Send + 'static,
{
    let mut task = tokio::spawn(first);
    let mut faults = 0;
    loop {
        let message = match task.await {
            Ok(()) => return Ok(()),
            Err(e) if e.is_panic() => panic_message(e.into_panic()),
            Err(e) => e.to_string(),
        };
        faults += 1;
        if faults > MAX_TASK_FAULTS {
            return Err(TaskFailed { message });
        }
        task = tokio::spawn(take_over(message));
    }
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// Takes over the open attempt of `build` after its task failed.
async fn after_fault(shared: &Shared, build: &BuildRef, message: &str, task: &mut BuildTask) -> Rest {
    let latest = shared.builds.latest_attempt(&build.uid).await;
    let Some(a) = latest.clone().filter(|a| a.state != AttemptState::Retired) else {
        // The last attempt is retired: the retry it owed (if any) still follows, decided from
        // the journal as when it was retired.
        let next = latest.and_then(|a| machine::decide_retry(&a, a.last_time?, &shared.machine).ok());
        return Rest::Retired { next };
    };
    let start = match a.state {
        AttemptState::Admitted | AttemptState::Booting | AttemptState::Running | AttemptState::Collecting => {
            Start::Event(Event::AgentFault {
                message: message.to_string(),
            })
        }
        AttemptState::Retiring | AttemptState::Quarantined => {
            Start::Perform(machine::continue_retirement(&a, &shared.machine, None))
        }
        // Nothing was cloned yet: the claim is resumed (the same attempt, claimed again — a claim
        // this agent already holds is accepted as its own) once a slot is free.
        AttemptState::Requested | AttemptState::Retired => {
            // A read that fails says nothing about the build (the API may be down a moment): it
            // is read again, or the attempt would stay open, and the build unclaimed by anyone
            // else, until the agent restarts.
            let mut wait = Duration::from_secs(1);
            let mb = loop {
                match read_build(shared, build).await {
                    Ok(mb) => break mb,
                    Err(error) => {
                        tracing::warn!(%build, %error, retry_in = ?wait, "cannot read the MacBuild to resume its claim; retrying");
                        tokio::time::sleep(wait).await;
                        wait = (wait * 2).min(Duration::from_secs(30));
                    }
                }
            };
            // (A slot the task still holds goes with it: `follow_retries` ends on `Stuck`.)
            let Some(mb) = mb else {
                return Rest::Stuck(format!("{} failed before its admission: {message}", a.key()));
            };
            return resume_admission(shared, &mb, a, task).await;
        }
    };
    let mb = read_build(shared, build).await.ok().flatten();
    let generation = mb.as_ref().and_then(|m| m.metadata.generation);
    drive(shared, &mb, &a.key(), start, generation, task).await
}

/// Waits (checking at most once a second; the journal backs off its own probes) until the
/// journal can be written again.
async fn wait_until_journal_writable(shared: &Shared) {
    while !shared.journal_writable().await {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Claims a `Requested` attempt again (a claim this agent already holds is accepted as its own)
/// and runs it once a slot is free (at once with the reservation `task` holds, if any); past its
/// window it ends `DeadlinePassed`.
pub async fn resume_admission(shared: &Shared, mb: &MacBuild, mut a: Attempt, task: &mut BuildTask) -> Rest {
    let until = a
        .deadline
        .unwrap_or_else(|| Timestamp::now() + SignedDuration::from_secs(i64::from(mb.spec.timeout_seconds)));
    match wait_for_slot(shared, task.slot.take(), &a.build.uid, &mb.spec, until).await {
        Some(reservation) => admit(shared, mb, &mut a, reservation, task).await,
        None => {
            let start = Start::Event(Event::DeadlinePassed { at_start: None });
            let generation = mb.metadata.generation;
            drive(shared, &Some(mb.clone()), &a.key(), start, generation, task).await
        }
    }
}

/// The journal's view of attempt `key`, if it has one.
pub async fn known_attempt(shared: &Shared, key: &AttemptKey) -> Option<Attempt> {
    let found = shared.builds.attempt(key).await;
    if found.is_none() {
        tracing::error!(attempt = %key, "the journal does not have this attempt");
    }
    found
}

/// How an attempt's loop starts when no task was following it (at recovery, or after its task
/// failed): with an event, or with a host action whose result is the first event (a deletion, a
/// confirmation that the watchdog deleted the VM).
pub enum Start {
    Event(Event),
    Perform(Action),
}

/// Follows attempt `key` from `start` with a fresh executor until it rests (a retry's slot it
/// hands on is left in `task`).
pub async fn drive(
    shared: &Shared,
    mb: &Option<MacBuild>,
    key: &AttemptKey,
    start: Start,
    generation: Option<i64>,
    task: &mut BuildTask,
) -> Rest {
    let Some(mut a) = known_attempt(shared, key).await else {
        return Rest::Stuck(format!("unknown attempt {key}"));
    };
    let spec = mb.as_ref().map_or_else(spec_of_gone_build, |mb| mb.spec.clone());
    let mut exec = executor_for(shared, &a, spec, &task.cancel);
    // Running or later, or resumed with its VM running: the clone was made.
    if matches!(a.state, AttemptState::Running | AttemptState::Collecting)
        || matches!(start, Start::Event(Event::Resume { clone_again: false, .. }))
    {
        exec.vm_was_created();
    }
    let event = match start {
        Start::Event(event) => event,
        Start::Perform(action) => match exec.perform(&action).await {
            Performed::Event(event) => event,
            other => return Rest::Stuck(format!("{action:?} for {key} ended without an event: {other:?}")),
        },
    };
    run_attempt(shared, &mut exec, &mut a, event, generation, &mut task.slot).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex as StdMutex;

    #[tokio::test]
    async fn a_panicking_task_is_taken_over_with_its_message() {
        let seen = Arc::new(StdMutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        let result = supervise(async { panic!("attempt to add with overflow") }, move |message| {
            log.lock().unwrap().push(message);
            async {}
        })
        .await;
        assert_eq!(result, Ok(()));
        assert_eq!(*seen.lock().unwrap(), vec!["attempt to add with overflow".to_string()]);
    }

    #[tokio::test]
    async fn a_fault_that_repeats_is_given_up_after_a_bound() {
        let calls = Arc::new(StdMutex::new(0));
        let count = Arc::clone(&calls);
        let result = supervise(async { panic!("first") }, move |_| {
            *count.lock().unwrap() += 1;
            async { panic!("again") }
        })
        .await;
        assert_eq!(
            result,
            Err(TaskFailed {
                message: "again".to_string()
            })
        );
        assert_eq!(*calls.lock().unwrap(), MAX_TASK_FAULTS);
    }

    #[tokio::test]
    async fn a_task_that_ends_normally_is_not_taken_over() {
        let result = supervise(async {}, |_| -> std::future::Ready<()> { panic!("must not be called") }).await;
        assert_eq!(result, Ok(()));
    }
}
