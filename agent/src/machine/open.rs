//! The rules of an open attempt (`Admitted`, `Booting`, `Running`, `Collecting`: a VM may exist
//! and the outcome is not fixed yet): one dispatcher per state, the rules that lead on through
//! the boot, the steps and the collection, and [`from_open`], the endings every open state shares
//! (withdrawal, deadline, agent fault or restart, claim moved, spec changed).

use k8s_openapi::jiff::SignedDuration;
use tartan_api::{AttemptState as S, Outcome, Reason};

use super::retiring::retire;
use super::{
    Action, DeleteContext, Event, Refusal, Rule, Transition, at_start, context, deliver, doing, secs2, with_start,
    withdrawal_reason, withdrawal_text,
};

/// `Admitted × event`.
pub(super) fn from_admitted(r: &Rule, event: Event) -> Result<Transition, Refusal> {
    match event {
        // An adopted warm VM is booted already: cloning onto its name is never asked for.
        Event::Boot if r.a.adopted => Err(r.not_allowed()),
        Event::Boot => Ok(boot(r)),
        Event::Adopted { after } if r.a.adopted => Ok(adopted(r, after)),
        Event::Resume {
            after,
            clone_again: true,
        } => resume_unbooted(r, after),
        Event::EnvRefused { reason, error } => Ok(env_refused(r, reason, error)),
        Event::VmStartFailed { error } => Ok(vm_start_failed(r, error)),
        Event::MountRefused { error } => Ok(mount_refused(r, error)),
        ev => from_open(r, ev),
    }
}

/// `Booting × event`.
pub(super) fn from_booting(r: &Rule, event: Event) -> Result<Transition, Refusal> {
    match event {
        Event::GuestReady { after } => Ok(guest_ready(r, after)),
        Event::Detach => Ok(detach(r)),
        Event::Resume {
            after,
            clone_again: true,
        } => Ok(resume_clone_again(r, after)),
        Event::Resume {
            after,
            clone_again: false,
        } => Ok(resume(r, after)),
        Event::EnvRefused { reason, error } => Ok(env_refused(r, reason, error)),
        Event::VmStartFailed { error } => Ok(vm_start_failed(r, error)),
        Event::MountRefused { error } => Ok(mount_refused(r, error)),
        Event::WatchdogRemovedVm => watchdog_removed_vm(r),
        ev => from_open(r, ev),
    }
}

/// `Running × event`.
pub(super) fn from_running(r: &Rule, event: Event) -> Result<Transition, Refusal> {
    match event {
        Event::StepStarting {
            index,
            of,
            name,
            previous,
        } => step_starting(r, index, of, name, previous),
        Event::Detach => Ok(detach(r)),
        Event::Resume {
            after,
            clone_again: false,
        } => Ok(resume(r, after)),
        Event::StepsSucceeded { steps } => Ok(steps_succeeded(r, steps)),
        Event::EnvRefused { reason, error } => Ok(env_refused(r, reason, error)),
        Event::StepFailed {
            step,
            exit_code,
            output,
        } => Ok(step_failed(r, step, exit_code, output)),
        Event::StepTimedOut {
            step,
            timeout_seconds,
            killed,
            output,
        } => Ok(step_timed_out(r, step, timeout_seconds, killed, output)),
        Event::WatchdogRemovedVm => watchdog_removed_vm(r),
        ev => from_open(r, ev),
    }
}

/// `Collecting × event`.
pub(super) fn from_collecting(r: &Rule, event: Event) -> Result<Transition, Refusal> {
    match event {
        Event::Detach => Ok(detach(r)),
        Event::Resume {
            after,
            clone_again: false,
        } => Ok(resume(r, after)),
        Event::TestsPassed { passed, total } => Ok(tests_passed(r, passed, total)),
        Event::TestsFailed { failed, total } => Ok(tests_failed(r, failed, total)),
        Event::TestReportUnusable { error } => Ok(test_report_unusable(r, error)),
        Event::ArtifactUploadFailed { error } => Ok(artifact_upload_failed(r, error)),
        Event::WatchdogRemovedVm => watchdog_removed_vm(r),
        ev => from_open(r, ev),
    }
}

/// The events every open state takes alike; any other is not a transition of `r.state`.
fn from_open(r: &Rule, event: Event) -> Result<Transition, Refusal> {
    match event {
        ev @ (Event::CancelRequested { .. } | Event::OwnerDeleted { .. }) => Ok(withdrawn_while_open(r, &ev)),
        Event::DeadlinePassed { at_start: killed } => deadline_passed(r, killed),
        Event::AgentFault { message } => Ok(agent_fault(r, message)),
        Event::AgentRestarted { killed } => Ok(agent_restarted(r, killed)),
        Event::ClaimLost { holder } => Ok(claim_moved(r, holder)),
        Event::SpecChanged { change, at_start } => Ok(spec_changed(r, change, at_start)),
        _ => Err(r.not_allowed()),
    }
}

/// The admission's actions are done: clone and start the VM.
fn boot(r: &Rule) -> Transition {
    let vm = r.vm();
    r.t(
        S::Booting,
        None,
        format!("cloning and starting {vm}"),
        vec![
            Action::CloneVm { vm: vm.clone() },
            Action::SetVm { vm: vm.clone() },
            Action::StartVm { vm: vm.clone() },
            Action::ProbeReady { vm },
        ],
    )
}

/// The guest answers: run step 0.
fn guest_ready(r: &Rule, after: SignedDuration) -> Transition {
    first_step(r, Reason::GuestReady, format!("tart exec ready after {}", secs2(after)))
}

/// The adopted warm VM's guest answered: the steps start, with no clone and no boot.
fn adopted(r: &Rule, after: SignedDuration) -> Transition {
    let detail = format!(
        "started from warm VM {}; tart exec answered after {}",
        r.vm(),
        secs2(after)
    );
    first_step(r, Reason::Adopted, detail)
}

/// Entering `Running` for step 0 (its `timeoutSeconds` counts from this record's time).
fn first_step(r: &Rule, reason: Reason, detail: String) -> Transition {
    let mut actions = deliver(r.a);
    actions.push(Action::RunStep {
        vm: r.vm(),
        index: 0,
        since: r.now,
    });
    r.t(S::Running, Some(reason), detail, actions)
}

/// The next step starts; its record comes first, so a step is never started twice.
fn step_starting(r: &Rule, index: u32, of: u32, name: String, previous: String) -> Result<Transition, Refusal> {
    let current = r.a.current_step();
    if index != current + 1 {
        return Err(Refusal::StepNotNext {
            state: r.state,
            event: r.kind,
            index,
            current,
        });
    }
    let mut tr = r.t(
        S::Running,
        Some(Reason::StepStarted),
        format!("step {previous} exited 0; starting {name} ({}/{of})", index + 1),
        vec![Action::RunStep {
            vm: r.vm(),
            index,
            since: r.now,
        }],
    );
    tr.step = Some(index);
    Ok(tr)
}

/// The agent stops and leaves the attempt running in its VM.
fn detach(r: &Rule) -> Transition {
    r.t(
        r.state,
        Some(Reason::Detached),
        format!(
            "agent stopping; {} runs on in {} and is resumed at the next start",
            doing(r.a),
            r.a.vm
        ),
        vec![],
    )
}

/// Stopped between the admission and the boot: the boot follows the deadline file.
fn resume_unbooted(r: &Rule, after: SignedDuration) -> Result<Transition, Refusal> {
    let deadline = r.a.deadline.ok_or(Refusal::NoDeadline {
        state: r.state,
        event: r.kind,
    })?;
    let vm = r.vm();
    Ok(r.t(
        r.state,
        Some(Reason::Resumed),
        format!(
            "{vm} was not booted yet when the agent stopped; booting it {} after the agent started",
            secs2(after)
        ),
        vec![Action::WriteDeadlineFile { vm, deadline }],
    ))
}

/// Stopped before the clone finished: the boot starts over with the clone.
fn resume_clone_again(r: &Rule, after: SignedDuration) -> Transition {
    let vm = r.vm();
    r.t(
        r.state,
        Some(Reason::Resumed),
        format!(
            "{vm} was not cloned yet when the agent stopped; cloning and starting it again {} after the agent started",
            secs2(after)
        ),
        vec![
            Action::CloneVm { vm: vm.clone() },
            Action::SetVm { vm: vm.clone() },
            Action::StartVm { vm: vm.clone() },
            Action::ProbeReady { vm },
        ],
    )
}

/// The VM runs (and its guest answers): follow the attempt again from where the journal says.
fn resume(r: &Rule, after: SignedDuration) -> Transition {
    let (a, state, vm) = (r.a, r.state, r.vm());
    let actions = match state {
        S::Booting => vec![Action::ProbeReady { vm: vm.clone() }],
        S::Running => vec![Action::RunStep {
            vm: vm.clone(),
            index: a.current_step(),
            // A journal always has the record that entered `Running`; `now` only
            // guards a damaged one (the step then gets its full time again).
            since: a.step_since.unwrap_or(r.now),
        }],
        _ => vec![
            Action::CollectResults { vm: vm.clone() },
            Action::UploadArtifacts { vm: vm.clone() },
        ],
    };
    // A boot is resumed without asking the guest: its own readiness probe waits for it.
    let answering = if state == S::Booting {
        ""
    } else {
        " and its guest answering"
    };
    r.t(
        state,
        Some(Reason::Resumed),
        format!(
            "{vm} running{answering} {} after the agent started; following {} again",
            secs2(after),
            doing(a)
        ),
        actions,
    )
}

/// Every step exited 0: collect the results.
fn steps_succeeded(r: &Rule, steps: u32) -> Transition {
    let vm = r.vm();
    let mut actions = deliver(r.a);
    actions.extend([
        Action::CollectResults { vm: vm.clone() },
        Action::UploadArtifacts { vm },
    ]);
    r.t(S::Collecting, None, format!("{steps} step(s) succeeded"), actions)
}

/// `spec.env` could not be made: the build fails.
fn env_refused(r: &Rule, reason: Reason, error: String) -> Transition {
    retire(r, reason, Outcome::Failed, error, DeleteContext::Normal)
}

fn vm_start_failed(r: &Rule, error: String) -> Transition {
    // An adopted warm VM that does not answer is the pool's failure, not the build's: the
    // attempt is interrupted, so a retry starts cold (within `maxAttempts` and the deadline).
    let (outcome, what) = if r.a.adopted {
        (Outcome::Interrupted, "the adopted warm VM is not fit to serve")
    } else {
        (Outcome::Failed, "VM did not start")
    };
    retire(
        r,
        Reason::VMStartFailed,
        outcome,
        format!("{what}: {error}"),
        DeleteContext::Normal,
    )
}

/// A step exited non-zero (or could not be run): the build fails, naming the step and its output.
fn step_failed(r: &Rule, step: String, exit_code: i32, output: String) -> Transition {
    let what = if exit_code < 0 {
        format!("step {step} could not be run")
    } else {
        format!("step {step} exited {exit_code}")
    };
    let detail = match output.as_str() {
        "" => what,
        why if exit_code < 0 => format!("{what}: {why}"),
        last => format!("{what}; its output ends:\n{last}"),
    };
    retire(r, Reason::StepFailed, Outcome::Failed, detail, DeleteContext::Normal)
}

/// A mount the agent's config does not declare: refused before the clone.
fn mount_refused(r: &Rule, error: String) -> Transition {
    retire(
        r,
        Reason::MountNotDeclared,
        Outcome::Failed,
        error,
        DeleteContext::Normal,
    )
}

fn step_timed_out(r: &Rule, step: String, timeout_seconds: u32, killed: String, output: String) -> Transition {
    let what = format!("step {step} ran longer than its timeoutSeconds ({timeout_seconds}s); {killed}");
    let detail = match output.as_str() {
        "" => what,
        last => format!("{what}; its output ends:\n{last}"),
    };
    retire(r, Reason::StepTimedOut, Outcome::Failed, detail, DeleteContext::Normal)
}

fn tests_passed(r: &Rule, passed: u32, total: u32) -> Transition {
    retire(
        r,
        Reason::TestsPassed,
        Outcome::Succeeded,
        format!("{passed}/{total} tests passed"),
        DeleteContext::Normal,
    )
}

fn tests_failed(r: &Rule, failed: u32, total: u32) -> Transition {
    retire(
        r,
        Reason::TestsFailed,
        Outcome::Failed,
        format!("{failed}/{total} tests failed"),
        DeleteContext::Normal,
    )
}

fn test_report_unusable(r: &Rule, error: String) -> Transition {
    retire(
        r,
        Reason::TestsFailed,
        Outcome::Failed,
        format!("test report unusable, so the build is not counted as passed: {error}"),
        DeleteContext::Normal,
    )
}

fn artifact_upload_failed(r: &Rule, error: String) -> Transition {
    retire(
        r,
        Reason::ArtifactUploadFailed,
        Outcome::Failed,
        format!("artifact upload failed after retries: {error}"),
        DeleteContext::Normal,
    )
}

/// Cancel or deletion in any open phase: Cancelled, never retried.
fn withdrawn_while_open(r: &Rule, ev: &Event) -> Transition {
    let reason = withdrawal_reason(ev);
    let detail = with_start(withdrawal_text(r.a, reason), r.state, at_start(ev));
    retire(r, reason, Outcome::Cancelled, detail, context(at_start(ev)))
}

/// The host execution deadline passed: the build fails and its VM is deleted.
fn deadline_passed(r: &Rule, killed: Option<u32>) -> Result<Transition, Refusal> {
    let (state, kind) = (r.state, r.kind);
    let deadline = r.a.deadline.ok_or(Refusal::NoDeadline { state, event: kind })?;
    if r.now < deadline {
        return Err(Refusal::DeadlineNotReached {
            state,
            event: kind,
            deadline,
        });
    }
    let detail = with_start(format!("host execution deadline {deadline} passed"), state, killed);
    Ok(retire(
        r,
        Reason::DeadlinePassed,
        Outcome::Failed,
        detail,
        context(killed),
    ))
}

/// The watchdog already deleted the VM: record the failure without touching the VM, then
/// only confirm it is gone.
fn watchdog_removed_vm(r: &Rule) -> Result<Transition, Refusal> {
    let (a, state, kind) = (r.a, r.state, r.kind);
    let deadline = a.deadline.ok_or(Refusal::NoDeadline { state, event: kind })?;
    if r.now < deadline {
        return Err(Refusal::DeadlineNotReached {
            state,
            event: kind,
            deadline,
        });
    }
    let mut actions = deliver(a);
    actions.push(Action::ConfirmVmGone { vm: r.vm() });
    let mut tr = r.t(
        S::Retiring,
        Some(Reason::WatchdogDeadline),
        format!("{} gone after the deadline {deadline}: deleted by the watchdog", a.vm),
        actions,
    );
    tr.outcome = Some(Outcome::Failed);
    Ok(tr)
}

/// The agent's own task for the attempt failed: interrupted, as if the agent had restarted.
fn agent_fault(r: &Rule, message: String) -> Transition {
    retire(
        r,
        Reason::AgentFault,
        Outcome::Interrupted,
        format!("the agent's task for this attempt failed: {message}"),
        DeleteContext::Normal,
    )
}

/// Recovery found the attempt open at agent start: interrupted.
fn agent_restarted(r: &Rule, killed: u32) -> Transition {
    let detail = with_start(String::new(), r.state, Some(killed));
    retire(
        r,
        Reason::AgentRestarted,
        Outcome::Interrupted,
        detail,
        DeleteContext::AgentStart,
    )
}

/// Another holder took the claim while the attempt ran (this agent was cut off or frozen
/// past its Lease): the build is theirs. Stop, delete our VM, free the slot; no outcome
/// (the new holder's is the build's), no status, no finalizer release, no retry.
fn claim_moved(r: &Rule, holder: String) -> Transition {
    r.t(
        S::Retiring,
        Some(Reason::ClaimLost),
        format!("claim moved to {holder}; this attempt stops and deletes its VM"),
        vec![Action::StopAndDeleteVm {
            vm: r.vm(),
            context: DeleteContext::Normal,
        }],
    )
}

/// The MacBuild's spec is not the one the attempt started with: not resumed, interrupted.
fn spec_changed(r: &Rule, change: String, at_start: Option<u32>) -> Transition {
    let detail = with_start(
        format!("the MacBuild's spec changed while the agent was stopped ({change}); the attempt is not resumed"),
        r.state,
        at_start,
    );
    retire(
        r,
        Reason::AgentRestarted,
        Outcome::Interrupted,
        detail,
        context(at_start),
    )
}
