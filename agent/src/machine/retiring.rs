//! The rules of an attempt whose outcome is fixed (`Retiring`, `Quarantined`): its VM is deleted,
//! or the deletion retried until it is gone; then the slot frees and a retry or the build's end
//! follows. Also [`retire`] (entering `Retiring`), [`retired`] (entering `Retired`) and
//! [`continue_retirement`] (the deletion such an attempt still owes).

use k8s_openapi::jiff::Timestamp;
use tartan_api::{AttemptState, AttemptState as S, Outcome, Reason};

use super::{
    Action, Attempt, Config, DeleteContext, Deleted, Event, Refusal, Rule, Transition, at_start, context, decide_retry,
    deliver, finish, secs2, show, withdrawal_reason, withdrawal_text,
};

/// `Retiring × event`.
pub(super) fn from_retiring(r: &Rule, event: Event) -> Result<Transition, Refusal> {
    match event {
        ev @ (Event::CancelRequested { .. } | Event::OwnerDeleted { .. }) => withdrawn_after_outcome(r, &ev),
        Event::DeadlinePassed { .. } | Event::WatchdogRemovedVm => Err(outcome_fixed(r)),
        Event::VmDeleted { how } => Ok(vm_deleted(r, how)),
        Event::DeleteFailed { context, error } => Ok(delete_failed(r, context, error)),
        _ => Err(r.not_allowed()),
    }
}

/// `Quarantined × event`.
pub(super) fn from_quarantined(r: &Rule, event: Event) -> Result<Transition, Refusal> {
    match event {
        ev @ (Event::CancelRequested { .. } | Event::OwnerDeleted { .. }) => withdrawn_after_outcome(r, &ev),
        Event::DeadlinePassed { .. } | Event::WatchdogRemovedVm => Err(outcome_fixed(r)),
        Event::VmDeleted { how } => Ok(quarantine_resolved(r, how)),
        _ => Err(r.not_allowed()),
    }
}

/// Once the outcome is fixed a cancel cannot change it; it is recorded so that no retry
/// follows (also after a restart), once.
fn withdrawn_after_outcome(r: &Rule, ev: &Event) -> Result<Transition, Refusal> {
    let a = r.a;
    if a.withdrawn.is_some() {
        return Err(outcome_fixed(r));
    }
    let reason = withdrawal_reason(ev);
    Ok(r.t(
        r.state,
        Some(reason),
        format!(
            "{}; outcome {} already recorded and kept; no retry",
            withdrawal_text(a, reason),
            show(&a.outcome)
        ),
        vec![continue_retirement(a, r.cfg, at_start(ev))],
    ))
}

fn outcome_fixed(r: &Rule) -> Refusal {
    Refusal::OutcomeFixed {
        state: r.state,
        event: r.kind,
        outcome: r.a.outcome,
    }
}

/// The VM's deletion is confirmed: `Retired`.
fn vm_deleted(r: &Rule, how: Deleted) -> Transition {
    let a = r.a;
    let detail = match how {
        // Refused before its boot (a mount or Secret refused): the deletion found nothing.
        Deleted::Stopped { .. } if !a.boot_started => {
            format!("no VM was cloned for attempt {}: nothing to delete", a.number)
        }
        Deleted::Stopped { took } => format!("stopped and deleted in {}", secs2(took)),
        Deleted::AtAgentStart => "deleted (or already absent) at agent start".to_string(),
        Deleted::ByWatchdog => "already deleted by the watchdog".to_string(),
        Deleted::OnRetry => "deleted on retry".to_string(),
    };
    retired(
        a,
        r.t(S::Retired, Some(Reason::VMDeleted), detail, vec![]),
        r.now,
        r.cfg,
    )
}

/// The deletion failed: the slot is quarantined and the deletion retried later.
fn delete_failed(r: &Rule, context: DeleteContext, error: String) -> Transition {
    let when = match context {
        DeleteContext::AgentStart => " at agent start",
        DeleteContext::Watchdog => " after the watchdog",
        DeleteContext::Normal | DeleteContext::Retry => "",
    };
    let mut actions = deliver(r.a);
    actions.push(Action::RetryDeleteLater {
        vm: r.vm(),
        after: r.cfg.quarantine_retry,
    });
    r.t(
        S::Quarantined,
        Some(Reason::DeleteFailed),
        format!("could not delete{when}, slot quarantined: {error}"),
        actions,
    )
}

/// A quarantined VM is gone at last: `Retired`, the slot released.
fn quarantine_resolved(r: &Rule, how: Deleted) -> Transition {
    let how = match how {
        Deleted::Stopped { .. } | Deleted::OnRetry => "deleted on retry",
        Deleted::AtAgentStart => "deleted at agent start",
        Deleted::ByWatchdog => "deleted by the watchdog",
    };
    let detail = format!("clone directory gone ({how}); slot released");
    retired(
        r.a,
        r.t(S::Retired, Some(Reason::Resolved), detail, vec![]),
        r.now,
        r.cfg,
    )
}

/// The deletion still owed by an attempt in `Retiring`/`Quarantined` whose transition stays there
/// (a withdrawal recorded after the outcome was fixed): a withdrawal never stops the deletion, so
/// every record in those states carries the action that leads on to `Retired`.
pub fn continue_retirement(a: &Attempt, cfg: &Config, at_start: Option<u32>) -> Action {
    let vm = a.vm.clone();
    match (a.state, a.outcome_reason) {
        // The watchdog took the VM: only confirm it is gone, never touch it.
        (AttemptState::Retiring, Some(Reason::WatchdogDeadline)) => Action::ConfirmVmGone { vm },
        (AttemptState::Retiring, _) => Action::StopAndDeleteVm {
            vm,
            context: context(at_start),
        },
        _ => Action::RetryDeleteLater {
            vm,
            after: cfg.quarantine_retry,
        },
    }
}

/// Enter `Retiring` with a fixed outcome and start the VM's deletion.
pub(super) fn retire(r: &Rule, reason: Reason, outcome: Outcome, detail: String, context: DeleteContext) -> Transition {
    let mut actions = deliver(r.a);
    actions.push(Action::StopAndDeleteVm { vm: r.vm(), context });
    let mut tr = r.t(AttemptState::Retiring, Some(reason), detail, actions);
    tr.outcome = Some(outcome);
    tr
}

/// Complete a transition into `Retired`: the slot frees, then either the next attempt is
/// admitted or the build is finished (status, then finalizer).
fn retired(a: &Attempt, mut tr: Transition, now: Timestamp, cfg: &Config) -> Transition {
    tr.actions.push(Action::RemoveDeadlineFile { vm: a.vm.clone() });
    if let Some(slot) = a.slot {
        tr.actions.push(Action::ReleaseSlot { slot });
    }
    match decide_retry(a, now, cfg) {
        Ok(next) => {
            tr.actions.extend(deliver(a));
            tr.actions.push(Action::AdmitNextAttempt {
                attempt: next.attempt,
                deadline: next.deadline,
            });
        }
        Err(why) => {
            // Say why an interrupted build ends here; other outcomes end by nature.
            if a.outcome == Some(Outcome::Interrupted) {
                tr.detail = format!("{}; no retry: {why}", tr.detail);
            }
            tr.actions.extend(finish(a));
        }
    }
    tr
}
