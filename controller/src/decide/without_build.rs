//! The decision while the run has no MacBuild of its own (none yet, gone, or another run's under
//! its name on its way out): fail on a cancel, a passed deadline, a MacBuild deleted behind the
//! controller's back or a spec the controller refuses; otherwise create the MacBuild, or wait for
//! the name to come free.

use super::*;

/// How often a run waiting for a terminating same-name MacBuild looks again, in case the watch
/// event of its removal is missed (it maps to the run by name and namespace, so it usually comes).
const NAME_TERMINATING_RECHECK: Duration = Duration::from_secs(5);

#[allow(clippy::too_many_arguments)]
pub(super) fn decide_without_build(
    mut d: Draft,
    run: &CustomRun,
    key: &str,
    name: &str,
    timeout: Option<Duration>,
    deadline: Option<Timestamp>,
    cancelled: bool,
    timeout_text: &str,
    terminating: Option<&BuildView>,
) -> Plan {
    let now = d.now;
    // A MacBuild that once existed and is gone: a claimed one is held by the agent's finalizer
    // until its VM is gone, so an absent MacBuild means no VM is left.
    let existed = d.extra.mac_build_uid.is_some();
    let retirement = if d.extra.holder.is_some() {
        VmRetirement::Deleted
    } else {
        VmRetirement::None
    };
    if cancelled {
        let msg = if existed {
            format!("CustomRun cancelled; MacBuild {key} is gone")
        } else {
            "CustomRun cancelled before a MacBuild was created".to_string()
        };
        return d.finish("False", reason::CANCELLED, msg, retirement, None, BuildAction::None);
    }
    if deadline.is_some_and(|dl| now >= dl) {
        let msg = if existed {
            format!("MacBuild did not finish within timeout {timeout_text}; MacBuild {key} is gone")
        } else {
            format!("MacBuild was not created within timeout {timeout_text}")
        };
        return d.finish("False", reason::TIMED_OUT, msg, retirement, None, BuildAction::None);
    }
    if existed {
        let msg =
            format!("MacBuild {key} was deleted outside the controller before it finished; the build is not restarted");
        return d.finish("False", own::MACBUILD_DELETED, msg, retirement, None, BuildAction::None);
    }
    // Validation: only before the MacBuild exists.
    if let Some(retries) = run.spec.retries.filter(|r| *r > 0) {
        let msg = format!(
            "spec.retries is {retries}: Tekton retries are refused because retries belong to the Tartan agent, \
             which alone knows whether the previous attempt's VM is gone. Remove `retries` from the pipeline task \
             and set param max-attempts (1-3) instead"
        );
        return d.finish(
            "False",
            own::RETRIES_NOT_SUPPORTED,
            msg,
            VmRetirement::None,
            None,
            BuildAction::None,
        );
    }
    if !run.spec.workspaces.is_empty() {
        let msg = "MacBuild runs in a VM on a Mac host and cannot mount Tekton workspaces; pass sources with \
                   params git-url/git-revision and publish with artifact-destination"
            .to_string();
        return d.finish(
            "False",
            own::WORKSPACE_NOT_SUPPORTED,
            msg,
            VmRetirement::None,
            None,
            BuildAction::None,
        );
    }
    let spec = match macbuild_spec(&run.spec, timeout) {
        Err(e) => return invalid(d, &e),
        Ok(spec) => spec,
    };
    if let Some(old) = terminating {
        let owner = old
            .controller_uid
            .as_deref()
            .map_or_else(|| "no controller".to_string(), |uid| format!("controller uid {uid}"));
        let msg = format!(
            "MacBuild {key} of an earlier run ({owner}) is being deleted (its agent deletes its VM first); \
             this run's MacBuild is created once that one is gone"
        );
        d.set_succeeded("Unknown", own::MACBUILD_NAME_TERMINATING, msg);
        let mut wake = deadline.into_iter().collect::<Vec<_>>();
        wake.push(add(now, NAME_TERMINATING_RECHECK));
        let requeue = next_wake(now, &wake);
        return d.into_plan(BuildAction::None, requeue, None);
    }
    let msg = format!("creating MacBuild {key}");
    d.extra.mac_build = Some(name.to_string());
    d.set_succeeded("Unknown", own::PENDING, msg);
    let requeue = next_wake(now, &deadline.into_iter().collect::<Vec<_>>());
    d.into_plan(BuildAction::Create(spec), requeue, None)
}
