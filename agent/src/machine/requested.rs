//! The rules of an attempt in `Requested`: journaled, claiming, waiting for a slot. It is
//! admitted, or it ends without a VM (claim lost, withdrawn, a retry's window closed).

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use tartan_api::{AttemptState as S, Outcome, Reason};

use super::{Action, Adoption, Event, Refusal, Rule, Transition, finish, withdrawal_reason, withdrawal_text};

/// `Requested × event`.
pub(super) fn from_requested(r: &Rule, event: Event) -> Result<Transition, Refusal> {
    match event {
        Event::Admit { slot, slots, timeout } => admit(r, slot, slots, timeout, None),
        Event::Adopt {
            slot,
            slots,
            timeout,
            adoption,
        } => admit(r, slot, slots, timeout, Some(adoption)),
        Event::ClaimLost { holder } => Ok(claim_lost_unadmitted(r, holder)),
        Event::ClaimUnconfirmed { error } => Ok(claim_unconfirmed(r, error)),
        ev @ (Event::CancelRequested { .. } | Event::OwnerDeleted { .. }) => Ok(withdrawn_unadmitted(r, &ev)),
        Event::DeadlinePassed { .. } => retry_window_closed(r),
        _ => Err(r.not_allowed()),
    }
}

/// The claim is won and `slot` is free (or held by the warm VM of `adoption`, which the attempt
/// takes with it): admit and fix the deadline. The deadline file is written for the attempt's VM
/// (the warm VM's file is replaced: the watchdog then keeps the build's deadline for it).
fn admit(
    r: &Rule,
    slot: u8,
    slots: u8,
    timeout: SignedDuration,
    adoption: Option<Adoption>,
) -> Result<Transition, Refusal> {
    let (a, state, kind, now, cfg) = (r.a, r.state, r.kind, r.now, r.cfg);
    if !(1..=2).contains(&slots) || slot >= slots {
        return Err(Refusal::BadSlot {
            state,
            event: kind,
            slot,
            slots,
        });
    }
    let deadline = match a.deadline {
        // A retry keeps the original deadline and needs enough of it left.
        Some(deadline) => {
            let left = now.duration_until(deadline);
            if left < cfg.retry_min_remaining {
                return Err(Refusal::RetryWindowClosed {
                    state,
                    event: kind,
                    attempt: a.number,
                    deadline,
                    left,
                    needed: cfg.retry_min_remaining,
                });
            }
            deadline
        }
        None => now.checked_add(timeout).unwrap_or(Timestamp::MAX),
    };
    let (vm, adopting) = match &adoption {
        Some(w) => (w.vm.clone(), format!(", adopting warm VM {}", w.vm)),
        None => (r.vm(), String::new()),
    };
    let mut tr = r.t(
        S::Admitted,
        Some(Reason::SlotFree),
        format!("slot {}/{slots}, deadline {deadline}{adopting}", slot + 1),
        vec![Action::WriteDeadlineFile {
            vm: vm.clone(),
            deadline,
        }],
    );
    tr.actions.extend(super::deliver(a));
    if adoption.is_some() {
        // Last: its event (`Adopted`) ends the list.
        tr.actions.push(Action::ProbeAdopted { vm });
    }
    tr.slot = Some(slot);
    tr.deadline = Some(deadline);
    tr.adoption = adoption;
    Ok(tr)
}

/// A loser clones nothing and holds no slot: the attempt ends at once, without an
/// outcome (the winner's outcome is the build's) and without a status write (it would
/// be fenced out anyway).
fn claim_lost_unadmitted(r: &Rule, holder: String) -> Transition {
    r.t(
        S::Retired,
        Some(Reason::ClaimLost),
        format!("claim lost to {holder}; nothing cloned"),
        vec![],
    )
}

/// The claim's answer never came: nothing was cloned and no slot is held, as for a lost claim,
/// but the claim may have landed, making this agent the build's holder. The status (a build never
/// admitted, `VMDeleted` true) and the finalizer's removal answer for it then; fenced on the
/// claim, both are refused if another agent holds the build or nobody does.
fn claim_unconfirmed(r: &Rule, error: String) -> Transition {
    r.t(
        S::Retired,
        Some(Reason::ClaimUnconfirmed),
        format!("claim not confirmed ({error}); nothing cloned"),
        finish(r.a),
    )
}

/// Cancelled or owner deleted before admission: nothing was cloned.
fn withdrawn_unadmitted(r: &Rule, ev: &Event) -> Transition {
    let reason = withdrawal_reason(ev);
    let mut tr = r.t(
        S::Retired,
        Some(reason),
        format!("{} before admission; nothing cloned", withdrawal_text(r.a, reason)),
        finish(r.a),
    );
    tr.outcome = Some(Outcome::Cancelled);
    tr
}

/// A retry whose window closed while it waited for a slot.
fn retry_window_closed(r: &Rule) -> Result<Transition, Refusal> {
    let (a, state, kind, now, cfg) = (r.a, r.state, r.kind, r.now, r.cfg);
    let deadline = a.deadline.ok_or(Refusal::NoDeadline { state, event: kind })?;
    let left = now.duration_until(deadline);
    if left >= cfg.retry_min_remaining {
        return Err(Refusal::DeadlineNotReached {
            state,
            event: kind,
            deadline,
        });
    }
    let mut tr = r.t(
        S::Retired,
        Some(Reason::DeadlinePassed),
        format!(
            "not admitted: {}s left before the deadline {deadline}, a retry needs {}s",
            left.as_secs().max(0),
            cfg.retry_min_remaining.as_secs()
        ),
        finish(a),
    );
    tr.outcome = Some(Outcome::Failed);
    Ok(tr)
}
