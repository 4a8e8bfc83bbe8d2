//! The decision for a cancelled run whose MacBuild is not finished: delete an unclaimed MacBuild,
//! ask the holder to cancel, and end the run once the holder confirms its VM deleted, or with the
//! VM's retirement unconfirmed when the holder is unreachable or the grace is spent.

use super::*;

pub(super) fn decide_cancel(mut d: Draft, b: &BuildView, live: Option<Liveness>, timing: &Timing) -> Plan {
    let now = d.now;
    let Some(agent) = b.holder.clone() else {
        // Unclaimed: no VM exists. Delete it, fenced on the resourceVersion we saw unclaimed.
        let msg = format!(
            "CustomRun cancelled before a Mac host claimed MacBuild {}; no VM was created",
            b.key()
        );
        let action = b.delete_unless_deleting(Some(b.resource_version.clone()));
        return d.finish("False", reason::CANCELLED, msg, VmRetirement::None, Some(b), action);
    };
    let live = live.unwrap_or(Liveness::Missing);
    d.set_unreachable(Some(&agent), Some(live));
    let action = b.request_cancel_unless_requested();
    let requested_at = d
        .extra
        .cancel_requested_at
        .as_deref()
        .and_then(parse_time)
        .unwrap_or(now);
    d.extra.cancel_requested_at = Some(rfc3339(requested_at));

    if b.vm_deleted && b.cancel_requested {
        let msg = format!("MacBuild {} cancelled; agent {agent} {}", b.key(), b.confirmed_text());
        return d.finish(
            "False",
            reason::CANCELLED,
            msg,
            b.confirmed_retirement(),
            Some(b),
            action,
        );
    }
    match live {
        Liveness::Expired { .. } | Liveness::Missing => {
            let msg = format!(
                "CustomRun cancelled; VM retirement unconfirmed: {}; the MacBuild keeps the cancel request until the \
                 agent returns",
                lease_phrase(&agent, live)
            );
            d.finish(
                "False",
                reason::CANCELLED,
                msg,
                VmRetirement::Unconfirmed,
                Some(b),
                action,
            )
        }
        Liveness::Live { expires, .. } => {
            let give_up = add(requested_at, timing.grace);
            if now >= give_up {
                let msg = format!(
                    "CustomRun cancelled; VM retirement unconfirmed: {} but did not confirm the VM deleted within \
                     {} of the cancel request; the MacBuild keeps the cancel request",
                    lease_phrase(&agent, live),
                    format_secs(timing.grace)
                );
                return d.finish(
                    "False",
                    reason::CANCELLED,
                    msg,
                    VmRetirement::Unconfirmed,
                    Some(b),
                    action,
                );
            }
            let msg = format!(
                "cancel requested on MacBuild {}; waiting for agent {agent} to delete its VM",
                b.key()
            );
            d.set_succeeded("Unknown", own::CANCELLING, msg);
            let requeue = next_wake(now, &[give_up, expires]);
            d.into_plan(action, requeue, None)
        }
    }
}
