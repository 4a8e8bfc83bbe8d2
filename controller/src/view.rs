//! Adapters between API objects and the pure core: MacBuild → [`BuildView`], Lease →
//! [`LeaseView`], and the MacBuild the controller creates for a CustomRun.
//!
//! # Agent Lease convention
//!
//! Each agent holds a `coordination.k8s.io/v1` Lease named `tartan-agent-<agent>` (see
//! [`lease_name`]), where `<agent>` is the name the agent writes into a MacBuild's
//! `status.claim.holder`; `spec.holderIdentity` is that same name and the Lease carries the label
//! `tartan.dev/agent=<agent>`. It lives in the MacBuild's namespace, unless the controller runs
//! with `--agent-lease-namespace NS`, in which case all agent Leases live in `NS`.

use crate::customrun::{CustomRun, label};
use crate::decide::{BuildView, LeaseView, Stage};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Resource as _;
use kube::api::ObjectMeta;
use std::collections::BTreeMap;
use std::time::Duration;
use tartan_api::text::clean_str;
use tartan_api::{
    AttemptRecord, CUSTOM_RUN_LABEL, ConditionType, FINISHED_LABEL, MacBuild, MacBuildSpec, MacBuildStatus, Outcome,
    Phase,
};

/// Longest MacBuild status message copied into a CustomRun: the agent's cause (a failing
/// step's last lines, `tartan_api::text::TAIL_BYTES`) with room for what is said around it.
pub const MESSAGE_MAX: usize = tartan_api::text::TAIL_BYTES * 2;

/// Prefix of every agent Lease's name.
pub const LEASE_PREFIX: &str = "tartan-agent-";

/// The Lease name of `agent`.
pub fn lease_name(agent: &str) -> String {
    format!("{LEASE_PREFIX}{agent}")
}

/// The agent a Lease belongs to, if it follows the convention.
pub fn lease_agent(lease: &Lease) -> Option<String> {
    let name = lease.metadata.name.as_deref()?;
    let agent = name.strip_prefix(LEASE_PREFIX)?;
    (!agent.is_empty()).then(|| agent.to_string())
}

fn stage(phase: Phase) -> Stage {
    match phase {
        Phase::Pending => Stage::Pending,
        Phase::Admitted => Stage::Admitted,
        Phase::Booting => Stage::Booting,
        Phase::Running => Stage::Running,
        Phase::Collecting => Stage::Collecting,
        Phase::Retiring => Stage::Retiring,
        Phase::Succeeded => Stage::Succeeded,
        Phase::Failed => Stage::Failed,
        Phase::Cancelled => Stage::Cancelled,
    }
}

/// What the pure core needs to know about a MacBuild.
pub fn build_view(mb: &MacBuild) -> BuildView {
    let meta = &mb.metadata;
    let status = mb.status.clone().unwrap_or_default();
    let claim = status.claim.as_ref();
    let results = status.results.clone().unwrap_or_default();
    // Why it ended: the MacBuild's Succeeded condition, else the last attempt's recorded reason,
    // else the outcome's name.
    let reason = status
        .condition(ConditionType::Succeeded)
        .map(|c| c.reason.as_str().to_string())
        .or_else(|| {
            status
                .current_attempt()
                .and_then(|a| a.reason)
                .map(|r| r.as_str().to_string())
        })
        .or_else(|| status.outcome.map(|o| o.as_str().to_string()));
    BuildView {
        namespace: meta.namespace.clone().unwrap_or_default(),
        name: meta.name.clone().unwrap_or_default(),
        uid: meta.uid.clone().unwrap_or_default(),
        resource_version: meta.resource_version.clone().unwrap_or_default(),
        controller_uid: meta
            .owner_references
            .iter()
            .flatten()
            .find(|o| o.controller == Some(true))
            .map(|o| o.uid.clone()),
        deleting: meta.deletion_timestamp.is_some(),
        cancel_requested: mb.spec.cancel_requested,
        stage: status.phase.map(stage),
        holder: claim.map(|c| c.holder.clone()).filter(|h| !h.is_empty()),
        attempt: claim.map(|c| c.attempt.clone()).filter(|a| !a.is_empty()),
        vm: status.vm.clone(),
        journal_seq: status.journal_seq,
        vm_deleted: status.condition(ConditionType::VMDeleted).is_some_and(|c| c.is_true()),
        nothing_admitted: nothing_admitted(&status),
        reason,
        // Copied into the CustomRun: only clean, bounded text, whoever wrote the status.
        message: status.message.as_deref().map(|m| clean_str(m, MESSAGE_MAX)),
        tests_passed: results.tests_passed,
        tests_total: results.tests_total,
        artifact: results.artifact_url,
        // Copied into the CustomRun's `logs` result: clean and bounded like the message.
        logs: status.logs.as_deref().map(|l| clean_str(l, MESSAGE_MAX)),
    }
}

/// Whether `status` says no attempt of the build was ever admitted: it lists attempts (an agent's
/// status always does), all of the holder's own, none with an admission time or an outcome but
/// `Cancelled` (a cancel before admission), and no host deadline was fixed.
fn nothing_admitted(status: &MacBuildStatus) -> bool {
    let holder = holder_of(status);
    !status.attempts.is_empty()
        && status.deadline.is_none()
        && !status.attempts.iter().any(|a| may_have_had_a_vm(a, holder))
}

fn holder_of(status: &MacBuildStatus) -> Option<&str> {
    status.claim.as_ref().map(|c| c.holder.as_str())
}

/// Whether attempt `a` may have had a VM, as a status of `holder`'s lists it: it was admitted (an
/// admission time, or an outcome only a run gives), or it is another host's (a build handed on:
/// that host may have admitted it without this status showing it).
fn may_have_had_a_vm(a: &AttemptRecord, holder: Option<&str>) -> bool {
    a.started_at.is_some() || a.outcome.is_some_and(|o| o != Outcome::Cancelled) || Some(a.host.as_str()) != holder
}

/// Whether `meta` carries [`FINISHED_LABEL`].
pub fn marked_finished(meta: &ObjectMeta) -> bool {
    meta.labels.as_ref().is_some_and(|l| l.contains_key(FINISHED_LABEL))
}

/// The JSON patch that adds [`FINISHED_LABEL`] to the object `meta` describes, fenced on its
/// uid: a same-named object created since (a CustomRun deleted and created again) fails the
/// `test` instead of being hidden from the watches while it still has work. `labels_exist`: the
/// object has a labels map (a JSON patch cannot add into a map that is not there).
pub fn finished_label_patch(uid: &str, labels_exist: bool) -> json_patch::Patch {
    use json_patch::jsonptr::PointerBuf;
    use json_patch::{AddOperation, PatchOperation, TestOperation};
    let (path, value) = if labels_exist {
        (
            PointerBuf::from_tokens(["metadata", "labels", FINISHED_LABEL]),
            serde_json::Value::from("true"),
        )
    } else {
        (
            PointerBuf::from_tokens(["metadata", "labels"]),
            serde_json::json!({ FINISHED_LABEL: "true" }),
        )
    };
    json_patch::Patch(vec![
        PatchOperation::Test(TestOperation {
            path: PointerBuf::from_tokens(["metadata", "uid"]),
            value: uid.into(),
        }),
        PatchOperation::Add(AddOperation { path, value }),
    ])
}

/// Trims a MacBuild for the controller's watch cache to what [`build_view`] reads (and what
/// an Event or a fenced delete names: kind, name, uid, resourceVersion): no managedFields,
/// annotations, label values or finalizers (the agent's), no spec but `cancelRequested`, only the
/// `Succeeded` and `VMDeleted` conditions without their messages, and at most two attempts
/// without messages (the current one, and one that says whether any was admitted). At 10,000 builds the spec's steps, the attempt
/// history and the conditions are most of the memory.
pub fn trim_macbuild(mb: &mut MacBuild) {
    mb.metadata.managed_fields = None;
    mb.metadata.annotations = None;
    mb.metadata.finalizers = None;
    // Only whether it has labels (adding the finished label by JSON patch needs to know) and
    // the finished label itself: our own write of it is kept trimmed, and without it a retried
    // reconcile would label the MacBuild again.
    if let Some(labels) = mb.metadata.labels.as_mut() {
        labels.retain(|k, _| k == FINISHED_LABEL);
    }
    let spec = &mut mb.spec;
    spec.image = String::new();
    spec.source = None;
    spec.steps = Vec::new();
    spec.test_report = None;
    spec.artifacts = None;
    spec.resources = None;
    spec.host_selector = BTreeMap::new();
    if let Some(status) = mb.status.as_mut() {
        status
            .conditions
            .retain(|c| matches!(c.type_, ConditionType::Succeeded | ConditionType::VMDeleted));
        for c in &mut status.conditions {
            c.message = String::new();
        }
        // build_view reads the current attempt's reason only when no Succeeded condition gives one,
        // and whether any attempt may have had a VM (`nothing_admitted`): one that may stands for
        // all earlier ones, a finished build keeps one attempt, and no attempt keeps its message.
        let succeeded = status.condition(ConditionType::Succeeded).is_some();
        let holder = holder_of(status).map(str::to_string);
        let may_have_had_a_vm = |a: &AttemptRecord| may_have_had_a_vm(a, holder.as_deref());
        let current = status.attempts.pop();
        let witness = match &current {
            Some(c) if may_have_had_a_vm(c) => None,
            _ => status.attempts.drain(..).find(|a| may_have_had_a_vm(a)),
        };
        let mut kept: Vec<AttemptRecord> = witness.into_iter().collect();
        match current {
            Some(c) if !succeeded => kept.push(c),
            Some(c) if kept.is_empty() => kept.push(c),
            _ => {}
        }
        for a in &mut kept {
            a.message = None;
        }
        status.attempts = kept;
    }
}

/// Trims a CustomRun for the watch cache: managedFields, annotations and ownerReferences (the
/// PipelineRun's, on every run) are never read; the spec, labels (copied to the MacBuild), uid
/// and status (written back whole) are.
pub fn trim_customrun(run: &mut CustomRun) {
    run.metadata.managed_fields = None;
    run.metadata.annotations = None;
    run.metadata.owner_references = None;
}

/// Trims a Lease for the watch cache: its managedFields are never read.
pub fn trim_lease(lease: &mut Lease) {
    lease.metadata.managed_fields = None;
}

/// What the pure core needs to know about a Lease.
pub fn lease_view(lease: &Lease) -> LeaseView {
    let spec = lease.spec.clone().unwrap_or_default();
    LeaseView {
        holder_identity: spec.holder_identity,
        renew_time: spec.renew_time.map(|t| t.0).or(spec.acquire_time.map(|t| t.0)),
        duration: spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map(Duration::from_secs),
    }
}

/// The MacBuild for `run`: same name and namespace, a controller ownerReference to the CustomRun,
/// the CustomRun's labels plus `tekton.dev/customRun` and `tartan.dev/custom-run`. `spec` is the
/// JSON the pure core mapped from params / `customSpec.spec`; a spec the MacBuild type refuses
/// is an error for the CustomRun.
pub fn new_macbuild(run: &CustomRun, spec: serde_json::Value) -> Result<MacBuild, NewMacBuildError> {
    let spec: MacBuildSpec = serde_json::from_value(spec).map_err(NewMacBuildError::Spec)?;
    let name = run.metadata.name.clone().unwrap_or_default();
    let mut labels: BTreeMap<String, String> = run.metadata.labels.clone().unwrap_or_default();
    if let Some(embedded) = run.spec.custom_spec.as_ref().and_then(|s| s.metadata.as_ref()) {
        labels.extend(embedded.labels.clone());
    }
    // Ours and the agents' to set (`tartan.dev/finished` once the run is finished: a MacBuild
    // born with it would be hidden from our watch; `tartan.dev/agent` names the holder): none
    // comes from the pipeline's labels.
    let ours = |key: &str| {
        key.split_once('/')
            .is_some_and(|(prefix, _)| prefix == tartan_api::GROUP)
    };
    labels.retain(|key, _| !ours(key));
    labels.insert(label::CUSTOM_RUN.into(), name.clone());
    labels.insert(CUSTOM_RUN_LABEL.into(), name.clone());
    let mut owner = run.controller_owner_ref(&()).ok_or(NewMacBuildError::NoUid)?;
    // Foreground deletion of the CustomRun waits for the MacBuild (and so for the agent's
    // finalizer); needs `customruns/finalizers: update` under OwnerReferencesPermissionEnforcement.
    owner.block_owner_deletion = Some(true);
    Ok(MacBuild {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: run.metadata.namespace.clone(),
            labels: Some(labels),
            owner_references: Some(vec![owner]),
            ..Default::default()
        },
        spec,
        status: None,
    })
}

/// Why no MacBuild can be made for a CustomRun.
#[derive(Debug, thiserror::Error)]
pub enum NewMacBuildError {
    #[error("the MacBuild spec is invalid: {0}")]
    Spec(#[source] serde_json::Error),
    #[error("the CustomRun has no uid yet")]
    NoUid,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::customrun::CustomRunSpec;
    use k8s_openapi::api::coordination::v1::LeaseSpec;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, OwnerReference};
    use k8s_openapi::jiff::Timestamp;
    use serde_json::json;

    fn mb(status: serde_json::Value) -> MacBuild {
        serde_json::from_value(json!({
            "apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild",
            "metadata": {"name": "b", "namespace": "ci", "uid": "u1", "resourceVersion": "9",
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "not-controller"},
                    {"apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun", "name": "b", "uid": "run-1", "controller": true}]},
            "spec": {"image": "img", "steps": [{"name": "build", "run": ["true"]}], "cancelRequested": true},
            "status": status,
        }))
        .unwrap()
    }

    #[test]
    fn a_finished_macbuild_reads_as_terminal_with_results() {
        let v = build_view(&mb(json!({
            "phase": "Succeeded", "outcome": "Succeeded",
            "claim": {"holder": "mac-mini-07", "attempt": "b#2", "epoch": 2},
            "conditions": [
                {"type": "VMDeleted", "status": "True", "reason": "VMDeleted", "message": "", "lastTransitionTime": "2026-10-05T02:55:00Z"},
                {"type": "Succeeded", "status": "True", "reason": "TestsPassed", "message": "2/2", "lastTransitionTime": "2026-10-05T02:55:00Z"}],
            "journalSeq": 130, "vm": "mb-ci-b-1234abcd",
            "results": {"testsPassed": 2, "testsTotal": 2, "artifactUrl": "s3://a/b.ipa"},
            "logs": "s3://a/mb-ci-b-1234abcd/logs/",
        })));
        assert_eq!(v.stage, Some(Stage::Succeeded));
        assert!(v.vm_deleted);
        assert!(v.cancel_requested);
        assert_eq!(v.controller_uid.as_deref(), Some("run-1"));
        assert_eq!(v.holder.as_deref(), Some("mac-mini-07"));
        assert_eq!(v.attempt.as_deref(), Some("b#2"));
        assert_eq!(v.reason.as_deref(), Some("TestsPassed"));
        assert_eq!((v.tests_passed, v.tests_total), (Some(2), Some(2)));
        assert_eq!(v.artifact.as_deref(), Some("s3://a/b.ipa"));
        assert_eq!(v.logs.as_deref(), Some("s3://a/mb-ci-b-1234abcd/logs/"));
        assert_eq!(v.journal_seq, Some(130));
        assert_eq!(v.resource_version, "9");
    }

    /// Whether any attempt was admitted, read from the status and kept by the cache's trim: a
    /// hand-over's second holder that never admitted its attempt still shows the first admitted.
    #[test]
    fn nothing_admitted_reads_the_attempts_admission_times_and_survives_the_trim() {
        let attempt = |n: u32, started: Option<&str>| {
            json!({"number": n, "id": format!("b#{n}"), "vm": format!("mb-ci-b-{n}"), "host": "mac-mini-07",
                "startedAt": started})
        };
        let deleted = json!([{"type": "VMDeleted", "status": "True", "reason": "ClaimUnconfirmed", "message": "",
            "lastTransitionTime": "2026-10-05T02:55:00Z"}]);
        let cases = [
            ("claim only", json!([attempt(1, None)]), false, true),
            ("no attempts listed", json!([]), false, false),
            (
                "admitted",
                json!([attempt(1, Some("2026-10-05T02:50:00Z"))]),
                false,
                false,
            ),
            ("host deadline only", json!([attempt(1, None)]), true, false),
            (
                "handed on, second never admitted",
                json!([
                    attempt(1, Some("2026-10-05T02:50:00Z")),
                    attempt(2, None),
                    attempt(3, None)
                ]),
                false,
                false,
            ),
        ];
        for (what, attempts, deadline, want) in cases {
            let mut status = json!({"phase": "Pending", "claim": {"holder": "mac-mini-07", "attempt": "b#1", "epoch": 1},
                "conditions": deleted, "attempts": attempts});
            if deadline {
                status["deadline"] = json!("2026-10-05T03:50:00Z");
            }
            let full = mb(status);
            assert_eq!(build_view(&full).nothing_admitted, want, "{what}");
            let mut trimmed = full.clone();
            trim_macbuild(&mut trimmed);
            assert_eq!(build_view(&trimmed).nothing_admitted, want, "{what}, trimmed");
            assert!(
                trimmed.status.unwrap().attempts.len() <= 2,
                "{what}: the trim keeps at most two attempts"
            );
        }
    }

    #[test]
    fn the_status_message_is_cleaned_and_bounded_before_it_reaches_the_customrun() {
        let raw = format!(
            "attempt 1 failed: \u{1b}[31merror\u{1b}[0m\u{0}\r\n{}",
            "x".repeat(20_000)
        );
        let v = build_view(&mb(json!({"phase": "Failed", "message": raw})));
        let m = v.message.unwrap();
        assert!(m.starts_with("attempt 1 failed: error\nxxx"), "{}", &m[..40]);
        assert!(m.len() <= MESSAGE_MAX, "{} bytes", m.len());
        assert!(m.chars().all(|c| c == '\n' || !c.is_control()));
    }

    #[test]
    fn a_trimmed_macbuild_reads_the_same_and_keeps_only_the_current_attempt() {
        let mut full = mb(json!({
            "phase": "Failed", "outcome": "Failed", "message": "attempt 2 failed",
            "claim": {"holder": "mac-mini-07", "attempt": "b#2", "epoch": 2},
            "conditions": [{"type": "VMDeleted", "status": "True", "reason": "VMDeleted", "message": "", "lastTransitionTime": "2026-10-05T02:55:00Z"}],
            "attempts": [
                {"number": 1, "id": "b#1", "vm": "mb-1", "host": "h", "outcome": "Interrupted", "reason": "AgentRestarted"},
                {"number": 2, "id": "b#2", "vm": "mb-2", "host": "h", "outcome": "Failed", "reason": "StepFailed"}],
            "journalSeq": 7, "vm": "mb-2", "results": {"testsPassed": 1, "testsTotal": 2},
        }));
        full.metadata.finalizers = Some(vec!["tartan.dev/vm-deleted".to_string()]);
        full.metadata.labels = Some(BTreeMap::from([("tekton.dev/customRun".to_string(), "b".to_string())]));
        full.metadata.annotations = Some(BTreeMap::from([("a".to_string(), "x".repeat(1000))]));
        full.metadata.managed_fields = Some(vec![Default::default()]);
        full.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(Timestamp::now()));
        let mut trimmed = full.clone();
        trim_macbuild(&mut trimmed);
        assert_eq!(build_view(&trimmed), build_view(&full));
        assert_eq!(build_view(&trimmed).reason.as_deref(), Some("StepFailed"));
        assert!(trimmed.spec.steps.is_empty() && trimmed.spec.image.is_empty());
        assert!(trimmed.spec.cancel_requested);
        assert_eq!(trimmed.status.as_ref().unwrap().attempts.len(), 1);
        assert_eq!(
            (
                trimmed.metadata.labels,
                trimmed.metadata.annotations,
                trimmed.metadata.managed_fields,
                trimmed.metadata.finalizers
            ),
            (Some(BTreeMap::new()), None, None, None)
        );
        let mut labelled = full.clone();
        labelled
            .metadata
            .labels
            .as_mut()
            .unwrap()
            .insert(FINISHED_LABEL.into(), "true".into());
        trim_macbuild(&mut labelled);
        assert!(
            marked_finished(&labelled.metadata),
            "found by the adversary review: a trimmed own write of the label must still show it"
        );
        let mut bare = full.clone();
        bare.metadata.labels = None;
        trim_macbuild(&mut bare);
        assert_eq!(
            bare.metadata.labels, None,
            "no labels map stays none: a JSON patch must create it"
        );
    }

    /// Found by the controller benchmark at 10,000 runs: a finished MacBuild's other conditions,
    /// their messages and its attempts were cached though nothing reads them (one attempt, without
    /// its message, still says whether any was admitted).
    #[test]
    fn a_trimmed_finished_macbuild_keeps_two_conditions_without_messages_and_one_attempt() {
        let full = mb(json!({
            "phase": "Failed", "outcome": "Failed", "message": "attempt 2 failed",
            "claim": {"holder": "mac-mini-07", "attempt": "b#2", "epoch": 2},
            "conditions": [
                {"type": "Claimed", "status": "True", "reason": "SlotFree", "message": "held by mac-mini-07", "lastTransitionTime": "2026-10-05T02:50:00Z"},
                {"type": "VMReady", "status": "False", "reason": "Retired", "message": "attempt 2 is Retired", "lastTransitionTime": "2026-10-05T02:55:00Z"},
                {"type": "VMDeleted", "status": "True", "reason": "VMDeleted", "message": "VM mb-2 deleted", "lastTransitionTime": "2026-10-05T02:55:00Z"},
                {"type": "Succeeded", "status": "False", "reason": "StepFailed", "message": "step a failed", "lastTransitionTime": "2026-10-05T02:55:00Z"}],
            "attempts": [
                {"number": 1, "id": "b#1", "vm": "mb-1", "host": "h", "outcome": "Interrupted", "reason": "AgentRestarted"},
                {"number": 2, "id": "b#2", "vm": "mb-2", "host": "h", "outcome": "Failed", "reason": "StepTimedOut"}],
            "journalSeq": 7, "vm": "mb-2",
        }));
        let mut trimmed = full.clone();
        trim_macbuild(&mut trimmed);
        assert_eq!(build_view(&trimmed), build_view(&full));
        assert_eq!(
            build_view(&trimmed).reason.as_deref(),
            Some("StepFailed"),
            "the condition's reason"
        );
        let status = trimmed.status.unwrap();
        assert_eq!(status.attempts.len(), 1, "one attempt says whether any was admitted");
        assert_eq!(status.attempts[0].message, None);
        let kept: Vec<(&str, &str)> = status
            .conditions
            .iter()
            .map(|c| (c.type_.as_str(), c.message.as_str()))
            .collect();
        assert_eq!(kept, [("VMDeleted", ""), ("Succeeded", "")]);
    }

    proptest::proptest! {
        /// Whatever conditions, attempts and phase a MacBuild's status has (in any order, with or
        /// without a Succeeded condition, with or without attempt reasons), the trimmed copy the
        /// cache keeps reads as the whole object does.
        #[test]
        fn any_trimmed_macbuild_reads_as_the_whole_one(
            conditions in proptest::sample::subsequence(
                vec!["Claimed", "VMReady", "VMDeleted", "Succeeded"], 0..=4),
            shuffle in proptest::collection::vec(proptest::prelude::any::<u8>(), 4),
            truths in proptest::collection::vec(proptest::sample::select(vec!["True", "False", "Unknown"]), 4),
            attempt_reasons in proptest::collection::vec(
                proptest::option::of(proptest::sample::select(vec!["AgentRestarted", "StepFailed", "ClaimLost", "DeadlinePassed"])), 0..4),
            phase in proptest::option::of(proptest::sample::select(vec!["Pending", "Running", "Succeeded", "Failed"])),
            outcome in proptest::option::of(proptest::sample::select(vec!["Succeeded", "Failed", "Interrupted"])),
        ) {
            let mut conditions: Vec<(usize, &str)> = conditions.into_iter().enumerate().collect();
            conditions.sort_by_key(|(i, _)| shuffle[*i]);
            let conditions: Vec<serde_json::Value> = conditions
                .iter()
                .map(|(i, t)| json!({"type": t, "status": truths[*i], "reason": "VMDeleted",
                    "message": format!("{t} message"), "lastTransitionTime": "2026-10-05T02:55:00Z"}))
                .collect();
            let attempts: Vec<serde_json::Value> = attempt_reasons
                .iter()
                .enumerate()
                .map(|(n, r)| json!({"number": n + 1, "id": format!("b#{}", n + 1), "vm": format!("mb-{}", n + 1),
                    "host": "h", "outcome": "Interrupted", "reason": r}))
                .collect();
            let full = mb(json!({"phase": phase, "outcome": outcome, "message": "m",
                "claim": {"holder": "mac-mini-07", "attempt": "b#1", "epoch": 1},
                "conditions": conditions, "attempts": attempts, "vm": "mb-1", "journalSeq": 3}));
            let mut trimmed = full.clone();
            trim_macbuild(&mut trimmed);
            proptest::prop_assert_eq!(build_view(&trimmed), build_view(&full));
        }
    }

    /// Tekton's PipelineRun owner reference and annotations are on every run and never read.
    #[test]
    fn a_trimmed_customrun_keeps_what_the_controller_reads() {
        let full: CustomRun = serde_json::from_value(json!({
            "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
            "metadata": {"name": "b", "namespace": "ci", "uid": "run-1", "resourceVersion": "12", "generation": 2,
                "labels": {"tekton.dev/pipelineRun": "p", "tekton.dev/pipelineTask": "mac-build"},
                "ownerReferences": [{"apiVersion": "tekton.dev/v1", "kind": "PipelineRun", "name": "p", "uid": "p-1", "controller": true}],
                "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}", "tekton.dev/note": "x"},
                "managedFields": [{"manager": "tekton"}]},
            "spec": {"customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"},
                "params": [{"name": "image", "value": "img"}, {"name": "steps", "value": ["make"]}], "timeout": "1h0m0s"},
            "status": {"conditions": [{"type": "Succeeded", "status": "Unknown", "reason": "Running"}],
                "extraFields": {"holder": "mac-mini-07"}},
        }))
        .unwrap();
        let mut trimmed = full.clone();
        trim_customrun(&mut trimmed);
        let mut want = full.clone();
        want.metadata.managed_fields = None;
        want.metadata.annotations = None;
        want.metadata.owner_references = None;
        assert_eq!(
            serde_json::to_value(&trimmed).unwrap(),
            serde_json::to_value(&want).unwrap()
        );
        let made = |run: &CustomRun| {
            serde_json::to_value(new_macbuild(run, json!({"image": "img", "steps": []})).unwrap()).unwrap()
        };
        assert_eq!(made(&trimmed), made(&full), "the MacBuild made from it is the same");
    }

    #[test]
    fn the_finished_label_patch_tests_the_uid_and_creates_the_labels_map_when_missing() {
        let mut run = json!({"metadata": {"uid": "u1", "labels": {"a": "b"}}});
        let patch = finished_label_patch("u1", true);
        json_patch::patch(&mut run, &patch).unwrap();
        assert_eq!(run["metadata"]["labels"], json!({"a": "b", FINISHED_LABEL: "true"}));

        let mut bare = json!({"metadata": {"uid": "u1"}});
        json_patch::patch(&mut bare, &finished_label_patch("u1", false)).unwrap();
        assert_eq!(bare["metadata"]["labels"], json!({FINISHED_LABEL: "true"}));

        let mut recreated = json!({"metadata": {"uid": "u2", "labels": {}}});
        assert!(json_patch::patch(&mut recreated, &finished_label_patch("u1", true)).is_err());
        assert_eq!(
            recreated["metadata"]["labels"],
            json!({}),
            "a same-named newer object is left alone"
        );
    }

    #[test]
    fn a_new_macbuild_never_carries_the_finished_label() {
        // Nor any other of ours from the pipeline (adversary round 8: `tartan.dev/agent` listed an
        // unclaimed build under a host).
        let mut run: CustomRun = serde_json::from_value(json!({
            "apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun",
            "metadata": {"name": "r", "namespace": "ci", "uid": "u1", "labels": {
                FINISHED_LABEL: "true", "team": "ios", "tartan.dev/agent": "mac-01", "tartan.dev.evil/x": "kept"}},
            "spec": {"customRef": {"apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild"}},
        }))
        .unwrap();
        let spec = json!({"image": "img", "steps": [{"name": "build", "run": ["true"]}]});
        let mb = new_macbuild(&run, spec.clone()).unwrap();
        let labels = mb.metadata.labels.unwrap();
        assert!(!labels.contains_key(FINISHED_LABEL) && labels["team"] == "ios");
        assert!(!labels.contains_key("tartan.dev/agent") && labels["tartan.dev.evil/x"] == "kept");
        assert_eq!(labels[CUSTOM_RUN_LABEL], "r");
        assert!(marked_finished(&run.metadata));
        run.metadata.labels = None;
        assert!(!marked_finished(&run.metadata));
    }

    #[test]
    fn an_unclaimed_macbuild_has_no_holder_and_no_stage() {
        let v = build_view(&mb(serde_json::Value::Null));
        assert_eq!(v.stage, None);
        assert_eq!(v.holder, None);
        assert!(!v.vm_deleted);
        assert_eq!(v.reason, None);
    }

    #[test]
    fn failed_reason_falls_back_to_the_last_attempt() {
        let v = build_view(&mb(json!({
            "phase": "Failed", "outcome": "Interrupted",
            "attempts": [{"number": 1, "id": "b#1", "vm": "mb-x", "host": "h", "outcome": "Interrupted", "reason": "AgentRestarted"}],
        })));
        assert_eq!(v.reason.as_deref(), Some("AgentRestarted"));
        assert!(!v.vm_deleted);
    }

    #[test]
    fn lease_naming_and_view() {
        assert_eq!(lease_name("agent-a"), "tartan-agent-agent-a");
        let renewed: Timestamp = "2026-10-05T02:54:20.123456Z".parse().unwrap();
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(lease_name("agent-a")),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some("agent-a".into()),
                renew_time: Some(MicroTime(renewed)),
                lease_duration_seconds: Some(20),
                ..Default::default()
            }),
        };
        assert_eq!(lease_agent(&lease).as_deref(), Some("agent-a"));
        let v = lease_view(&lease);
        assert_eq!(v.renew_time, Some(renewed));
        assert_eq!(v.duration, Some(Duration::from_secs(20)));
        let other = Lease {
            metadata: ObjectMeta {
                name: Some("kube-scheduler".into()),
                ..Default::default()
            },
            spec: None,
        };
        assert_eq!(lease_agent(&other), None);
        assert_eq!(lease_view(&other), LeaseView::default());
    }

    #[test]
    fn new_macbuild_is_owned_and_labelled() {
        let mut run = CustomRun::new("build-42-mac-build", CustomRunSpec::default());
        run.metadata.namespace = Some("ci".into());
        run.metadata.uid = Some("run-uid".into());
        run.metadata.labels = Some(BTreeMap::from([
            ("tekton.dev/pipelineRun".to_string(), "build-42".to_string()),
            ("tekton.dev/pipelineTask".to_string(), "mac-build".to_string()),
        ]));
        let spec = json!({"image": "img", "steps": [{"name": "build", "run": ["make"]}], "timeoutSeconds": 100});
        let m = new_macbuild(&run, spec).unwrap();
        assert_eq!(m.metadata.name.as_deref(), Some("build-42-mac-build"));
        assert_eq!(m.metadata.namespace.as_deref(), Some("ci"));
        let owner: &OwnerReference = &m.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (
                owner.api_version.as_str(),
                owner.kind.as_str(),
                owner.uid.as_str(),
                owner.controller,
                owner.block_owner_deletion
            ),
            ("tekton.dev/v1beta1", "CustomRun", "run-uid", Some(true), Some(true))
        );
        let labels = m.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["tekton.dev/pipelineRun"], "build-42");
        assert_eq!(labels["tekton.dev/pipelineTask"], "mac-build");
        assert_eq!(labels["tekton.dev/customRun"], "build-42-mac-build");
        assert_eq!(labels["tartan.dev/custom-run"], "build-42-mac-build");
        assert_eq!(m.spec.timeout_seconds, 100);
        assert!(!m.spec.cancel_requested);
        let err = new_macbuild(&run, json!({"image": "img", "steps": "make"}))
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("the MacBuild spec is invalid"), "{err}");
    }
}
