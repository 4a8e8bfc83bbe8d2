//! The decision for a run past its deadline whose MacBuild is not finished: delete an unclaimed
//! MacBuild, ask the holder to cancel, and end the run once the holder confirms its VM deleted, or
//! after the deadline's (and the cancel request's) grace with the VM's retirement unconfirmed.

use super::*;

/// `holder_recorded`: the run's status (as read) already names a holder and an attempt.
pub(super) fn decide_timeout(
    mut d: Draft,
    b: &BuildView,
    live: Option<Liveness>,
    timing: &Timing,
    deadline: Timestamp,
    timeout_text: &str,
    holder_recorded: bool,
) -> Plan {
    let now = d.now;
    let Some(agent) = b.holder.clone() else {
        let msg = format!(
            "no Mac host claimed MacBuild {} within timeout {timeout_text}; no VM was created and the MacBuild is deleted",
            b.key()
        );
        let action = b.delete_unless_deleting(Some(b.resource_version.clone()));
        return d.finish("False", reason::TIMED_OUT, msg, VmRetirement::None, Some(b), action);
    };
    let live = live.unwrap_or(Liveness::Missing);
    d.set_unreachable(Some(&agent), Some(live));
    let grace = format_secs(timing.grace);
    if b.vm_deleted && b.cancel_requested {
        let msg = format!(
            "MacBuild did not finish within timeout {timeout_text}; agent {agent} cancelled it and {}",
            b.confirmed_text()
        );
        return d.finish(
            "False",
            reason::TIMED_OUT,
            msg,
            b.confirmed_retirement(),
            Some(b),
            BuildAction::None,
        );
    }
    // A live holder gets the grace from our cancel request: when we first ask after the
    // deadline's grace (down or behind at the deadline), the ask is recorded and waited on. A
    // request the MacBuild shows but the run does not (the status write that recorded it was
    // lost) is taken as made now: its time is unknown, and ending at once would give a live
    // holder no grace at all. An unreachable holder cannot answer, so its grace is the deadline's
    // alone.
    let mut give_up = add(deadline, timing.grace);
    if matches!(live, Liveness::Live { .. }) {
        let asked_at = d
            .extra
            .cancel_requested_at
            .as_deref()
            .and_then(parse_time)
            .unwrap_or(now);
        d.extra.cancel_requested_at = Some(rfc3339(asked_at));
        give_up = give_up.max(add(asked_at, timing.grace));
    }
    if now >= give_up {
        // What happens to the MacBuild next differs: a live agent releases it once it confirms
        // the VM gone; an unreachable one holds it (finalizer) until it returns.
        let (why, next) = match live {
            Liveness::Live { .. } => (
                format!("{} but has not confirmed the VM deleted", lease_phrase(&agent, live)),
                "the MacBuild is deleted once the agent confirms its VM is gone",
            ),
            other => (
                lease_phrase(&agent, other),
                "the MacBuild is kept until the agent returns",
            ),
        };
        let msg = format!(
            "MacBuild did not finish within timeout {timeout_text} + {grace} grace; VM retirement unconfirmed: {why}; \
             {next}"
        );
        let action = b.delete_unless_deleting(None);
        if matches!(action, BuildAction::Delete { .. }) && !holder_recorded {
            // The delete goes out before this status is written, and the agent's finalizer lets
            // the MacBuild go once its VM is gone: if this write then failed, the next reconcile
            // would find no MacBuild and nothing in the run naming a holder, and report
            // `vmRetirement=none` and no attempt for a build that ran (seen in chaos). So the
            // holder and attempt are written first, and the MacBuild deleted on the next round.
            let msg = format!(
                "MacBuild did not finish within timeout {timeout_text} + {grace} grace; recording its holder \
                 {agent} ({}) before ending the run",
                attempt_of(b)
            );
            d.set_succeeded("Unknown", own::TIMING_OUT, msg);
            return d.into_plan(BuildAction::None, next_wake(now, &[now]), None);
        }
        return d.finish(
            "False",
            reason::TIMED_OUT,
            msg,
            VmRetirement::Unconfirmed,
            Some(b),
            action,
        );
    }
    let msg = format!(
        "MacBuild did not finish within timeout {timeout_text}; cancel requested, waiting up to {grace} for agent \
         {agent} to delete its VM"
    );
    d.set_succeeded("Unknown", own::TIMING_OUT, msg);
    let action = b.request_cancel_unless_requested();
    let mut wake = vec![give_up];
    if let Liveness::Live { expires, .. } = live {
        wake.push(expires);
    }
    let requeue = next_wake(now, &wake);
    d.into_plan(action, requeue, None)
}
