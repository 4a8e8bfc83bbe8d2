//! Table-style tests of [`decide`]: arrange a CustomRun, a MacBuild view and a Lease, decide at
//! `now`, assert the status, the action and the requeue.

use super::*;
use crate::customrun::{CustomRunSpec, Param};
use serde_json::json;

const NS: &str = "ci";
const NAME: &str = "build-42-mac-build";
const RUN_UID: &str = "run-uid-1";
const AGENT: &str = "agent-a";

fn t(s: &str) -> Timestamp {
    s.parse().unwrap()
}

/// CustomRun start of the seed's timeout case: deadline 02:53:40, grace ends 02:54:25.
fn t0() -> Timestamp {
    t("2026-10-05T02:52:00Z")
}

fn secs(n: i64) -> Timestamp {
    t0() + SignedDuration::from_secs(n)
}

fn timing() -> Timing {
    Timing::default()
}

fn run() -> CustomRun {
    let spec = CustomRunSpec {
        custom_ref: Some(crate::customrun::CustomRef {
            api_version: Some("tartan.dev/v1alpha1".into()),
            kind: Some("MacBuild".into()),
            ..Default::default()
        }),
        params: vec![
            Param {
                name: "image".into(),
                value: json!("ghcr.io/cirruslabs/macos-sequoia-xcode:16"),
            },
            Param {
                name: "steps".into(),
                value: json!(["xcodebuild build", "xcodebuild test"]),
            },
        ],
        timeout: Some("100s".into()),
        service_account_name: "default".into(),
        ..Default::default()
    };
    let mut r = CustomRun::new(NAME, spec);
    r.metadata.namespace = Some(NS.into());
    r.metadata.uid = Some(RUN_UID.into());
    r.metadata.generation = Some(1);
    r.metadata.creation_timestamp = Some(Time(t0()));
    r
}

/// The run after `decide` at `at` (status written back, as the I/O layer would).
fn after(mut r: CustomRun, build: Option<&BuildView>, lease: Option<&LeaseView>, at: Timestamp) -> CustomRun {
    let plan = decide(&r, build, lease, &timing(), at);
    r.status = Some(plan.status);
    r
}

fn started() -> CustomRun {
    after(run(), None, None, t0())
}

fn cancelled(mut r: CustomRun) -> CustomRun {
    r.spec.status = Some("RunCancelled".into());
    r.spec.status_message = Some("CustomRun cancelled as the PipelineRun it belongs to has been cancelled.".into());
    r.metadata.generation = Some(r.metadata.generation.unwrap_or(1) + 1);
    r
}

fn build() -> BuildView {
    BuildView {
        namespace: NS.into(),
        name: NAME.into(),
        uid: "mb-uid-1".into(),
        resource_version: "17".into(),
        controller_uid: Some(RUN_UID.into()),
        ..Default::default()
    }
}

fn claimed(stage: Stage) -> BuildView {
    BuildView {
        stage: Some(stage),
        holder: Some(AGENT.into()),
        attempt: Some(format!("{NAME}#1")),
        vm: Some("mb-ci-build-42-mac-build-c49f62f4".into()),
        journal_seq: Some(120),
        ..build()
    }
}

fn finished(stage: Stage, reason: &str) -> BuildView {
    BuildView {
        vm_deleted: true,
        reason: Some(reason.into()),
        attempt: Some(format!("{NAME}#2")),
        tests_passed: Some(2),
        tests_total: Some(2),
        artifact: Some("s3://ci-artifacts/app/App.ipa".into()),
        logs: Some("s3://ci-artifacts/app/mb-ci-build-42-mac-build-c49f62f4/logs/".into()),
        ..claimed(stage)
    }
}

fn lease(renewed: Timestamp) -> LeaseView {
    LeaseView {
        holder_identity: Some(AGENT.into()),
        renew_time: Some(renewed),
        duration: Some(Duration::from_secs(20)),
    }
}

fn succeeded(p: &Plan) -> &Condition {
    assert_eq!(
        p.status.conditions[0].type_, SUCCEEDED,
        "Succeeded must stay conditions[0]"
    );
    &p.status.conditions[0]
}

fn state(p: &Plan) -> (String, String) {
    let c = succeeded(p);
    (c.status.clone(), c.reason.clone().unwrap_or_default())
}

fn result(p: &Plan, name: &str) -> String {
    p.status
        .results
        .iter()
        .find(|r| r.name == name)
        .unwrap_or_else(|| panic!("no result {name}"))
        .value
        .clone()
}

fn unreachable(p: &Plan) -> Option<&Condition> {
    p.status.conditions.iter().find(|c| c.type_ == HOST_UNREACHABLE)
}

fn extra(p: &Plan) -> Extra {
    serde_json::from_value(p.status.extra_fields.clone().unwrap()).unwrap()
}

fn msg(p: &Plan) -> String {
    succeeded(p).message.clone().unwrap_or_default()
}

#[test]
fn new_run_is_started_and_its_macbuild_created() {
    let p = decide(&run(), None, None, &timing(), t0());
    assert_eq!(p.status.start_time, Some(Time(t0())));
    assert_eq!(state(&p), ("Unknown".into(), "Pending".into()));
    let BuildAction::Create(spec) = &p.action else {
        panic!("expected Create, got {:?}", p.action)
    };
    assert_eq!(spec["image"], "ghcr.io/cirruslabs/macos-sequoia-xcode:16");
    assert_eq!(spec["timeoutSeconds"], 100);
    assert_eq!(
        p.requeue_after,
        Some(Duration::from_millis(100_100)),
        "requeue at the deadline"
    );
    assert_eq!(p.status.observed_generation, Some(1));
    assert!(p.status.results.is_empty());
    assert_eq!(extra(&p).deadline.as_deref(), Some("2026-10-05T02:53:40Z"));
    assert_eq!(p.finished, None);
}

#[test]
fn start_time_is_never_before_creation() {
    // A controller clock behind the apiserver's: startTime is the creation timestamp.
    let p = decide(&run(), None, None, &timing(), t0() - SignedDuration::from_secs(5));
    assert_eq!(p.status.start_time, Some(Time(t0())));
    // Later reconciles keep the first startTime.
    let r = after(run(), None, None, secs(3));
    let p = decide(&r, Some(&build()), None, &timing(), secs(30));
    assert_eq!(p.status.start_time, Some(Time(secs(3))));
}

#[test]
fn invalid_runs_fail_at_once_with_a_specific_reason_and_no_requeue() {
    let mut retries = run();
    retries.spec.retries = Some(1);
    let mut workspaces = run();
    workspaces.spec.workspaces = vec![json!({"name": "src", "emptyDir": {}})];
    let mut bad_timeout = run();
    bad_timeout.spec.timeout = Some("ten minutes".into());
    let mut bad_param = run();
    bad_param.spec.params.push(Param {
        name: "xcode".into(),
        value: json!("16"),
    });
    let mut no_image = run();
    no_image.spec.params.remove(0);
    let mut named_ref = run();
    named_ref.spec.custom_ref.as_mut().unwrap().name = Some("template".into());
    let cases: Vec<(&str, CustomRun, &str, &str)> = vec![
        (
            "retries",
            retries,
            "RetriesNotSupported",
            "retries belong to the Tartan agent",
        ),
        ("workspaces", workspaces, "CustomRunWorkspaceNotSupported", "workspaces"),
        ("timeout", bad_timeout, "InvalidTimeout", "spec.timeout"),
        ("unknown param", bad_param, "InvalidParams", "unknown param \"xcode\""),
        ("missing image", no_image, "InvalidParams", "missing \"image\""),
        ("named customRef", named_ref, "InvalidCustomRef", "customRef.name"),
    ];
    for (what, r, want_reason, needle) in cases {
        let p = decide(&r, None, None, &timing(), t0());
        assert_eq!(state(&p), ("False".into(), want_reason.into()), "{what}");
        assert!(msg(&p).contains(needle), "{what}: {}", msg(&p));
        assert_eq!(p.action, BuildAction::None, "{what}");
        assert_eq!(p.requeue_after, None, "{what}");
        assert!(p.status.completion_time.is_some(), "{what}");
        assert_eq!(result(&p, "vmRetirement"), "none", "{what}");
        assert_eq!(
            p.finished.as_ref().map(|f| f.reason.as_str()),
            Some(want_reason),
            "{what}"
        );
    }
    // retries: 0 is what Tekton writes for no retries; it is fine.
    let mut zero = run();
    zero.spec.retries = Some(0);
    assert!(matches!(
        decide(&zero, None, None, &timing(), t0()).action,
        BuildAction::Create(_)
    ));
}

#[test]
fn unknown_reason_per_build_stage() {
    let cases: &[(Option<&str>, Stage, &str)] = &[
        (None, Stage::Pending, "Pending"),
        (Some(AGENT), Stage::Pending, "Pending"),
        (Some(AGENT), Stage::Admitted, "Admitted"),
        (Some(AGENT), Stage::Booting, "BootingVM"),
        (Some(AGENT), Stage::Running, "Running"),
        (Some(AGENT), Stage::Collecting, "Collecting"),
        (Some(AGENT), Stage::Retiring, "DeletingVM"),
        // Outcome fixed but VMDeleted not yet True: still not terminal.
        (Some(AGENT), Stage::Succeeded, "DeletingVM"),
        (Some(AGENT), Stage::Failed, "DeletingVM"),
    ];
    for (holder, stage, want) in cases {
        let b = BuildView {
            holder: holder.map(String::from),
            ..claimed(*stage)
        };
        let p = decide(&started(), Some(&b), Some(&lease(secs(8))), &timing(), secs(10));
        assert_eq!(state(&p), ("Unknown".into(), (*want).into()), "{holder:?} {stage:?}");
        assert_eq!(p.action, BuildAction::None);
        assert!(p.finished.is_none());
        assert!(unreachable(&p).is_none());
        assert!(msg(&p).contains("ci/build-42-mac-build"), "{}", msg(&p));
    }
}

#[test]
fn running_build_records_extra_fields_and_requeues_at_the_earliest_deadline() {
    let b = claimed(Stage::Running);
    let p = decide(&started(), Some(&b), Some(&lease(secs(8))), &timing(), secs(10));
    assert_eq!(
        succeeded(&p).message.as_deref(),
        Some("MacBuild ci/build-42-mac-build running on agent-a (attempt build-42-mac-build#1)")
    );
    let e = extra(&p);
    assert_eq!(e.mac_build.as_deref(), Some(NAME));
    assert_eq!(e.mac_build_uid.as_deref(), Some("mb-uid-1"));
    assert_eq!(e.holder.as_deref(), Some(AGENT));
    assert_eq!(e.attempt.as_deref(), Some("build-42-mac-build#1"));
    assert_eq!(e.journal_seq, Some(120));
    assert_eq!(e.phase.as_deref(), Some("Running"));
    // Lease expires at 28s, before the 100s deadline.
    assert_eq!(p.requeue_after, Some(Duration::from_millis(18_100)));
    // No timeout at all and a live lease: only the lease expiry wakes us.
    let mut none = started();
    none.spec.timeout = Some("0s".into());
    let p = decide(&none, Some(&b), Some(&lease(secs(8))), &timing(), secs(10));
    assert_eq!(p.requeue_after, Some(Duration::from_millis(18_100)));
    assert!(extra(&p).deadline.is_none());
    // No timeout and unclaimed: nothing time-based, wait for a change.
    let p = decide(&none, Some(&build()), None, &timing(), secs(10));
    assert_eq!(p.requeue_after, None);
}

#[test]
fn unset_timeout_uses_the_configured_default_and_zero_means_none() {
    let mut r = run();
    r.spec.timeout = None;
    let p = decide(&r, None, None, &timing(), t0());
    assert_eq!(extra(&p).deadline.as_deref(), Some("2026-10-05T03:52:00Z"));
    let BuildAction::Create(spec) = &p.action else { panic!() };
    assert_eq!(spec["timeoutSeconds"], 3600);
    let custom = Timing {
        default_timeout: Duration::from_secs(7200),
        ..timing()
    };
    let p = decide(&r, None, None, &custom, t0());
    assert_eq!(extra(&p).deadline.as_deref(), Some("2026-10-05T04:52:00Z"));
    r.spec.timeout = Some("0s".into());
    let p = decide(&r, None, None, &timing(), t0());
    assert_eq!(p.requeue_after, None);
    // Long after any default deadline, a run without timeout is still running.
    let r = after(r, None, None, t0());
    let p = decide(
        &r,
        Some(&claimed(Stage::Running)),
        Some(&lease(secs(99_990))),
        &timing(),
        secs(100_000),
    );
    assert_eq!(state(&p).0, "Unknown");
}

#[test]
fn success_only_after_vm_deleted_with_string_results() {
    let r = after(
        started(),
        Some(&claimed(Stage::Running)),
        Some(&lease(secs(5))),
        secs(10),
    );
    let p = decide(
        &r,
        Some(&finished(Stage::Succeeded, "TestsPassed")),
        Some(&lease(secs(55))),
        &timing(),
        secs(60),
    );
    assert_eq!(state(&p), ("True".into(), "TestsPassed".into()));
    assert_eq!(p.status.completion_time, Some(Time(secs(60))));
    assert_eq!(
        succeeded(&p).last_transition_time.as_deref(),
        Some("2026-10-05T02:53:00Z")
    );
    let results: Vec<(String, String)> = p
        .status
        .results
        .iter()
        .map(|r| (r.name.clone(), r.value.clone()))
        .collect();
    let want = [
        ("attempt", "build-42-mac-build#2"),
        ("testsPassed", "2"),
        ("testsTotal", "2"),
        ("artifact", "s3://ci-artifacts/app/App.ipa"),
        ("vmRetirement", "deleted"),
        ("logs", "s3://ci-artifacts/app/mb-ci-build-42-mac-build-c49f62f4/logs/"),
    ];
    assert_eq!(results, want.map(|(a, b)| (a.to_string(), b.to_string())));
    assert_eq!(p.action, BuildAction::None);
    assert_eq!(p.requeue_after, None);
    assert_eq!(
        p.finished,
        Some(Finished {
            status: "True".into(),
            reason: "TestsPassed".into(),
            vm_retirement: VmRetirement::Deleted
        })
    );
    assert_eq!(
        p.events.iter().map(|e| e.reason.as_str()).collect::<Vec<_>>(),
        vec!["TestsPassed"]
    );
    // Terminal phase without VMDeleted=True is not terminal.
    let not_yet = BuildView {
        vm_deleted: false,
        ..finished(Stage::Succeeded, "TestsPassed")
    };
    let p = decide(&r, Some(&not_yet), Some(&lease(secs(55))), &timing(), secs(60));
    assert_eq!(state(&p), ("Unknown".into(), "DeletingVM".into()));
    assert!(p.status.results.is_empty());
}

#[test]
fn failure_carries_the_builds_reason() {
    let p = decide(
        &started(),
        Some(&finished(Stage::Failed, "TestsFailed")),
        Some(&lease(secs(50))),
        &timing(),
        secs(60),
    );
    assert_eq!(state(&p), ("False".into(), "TestsFailed".into()));
    assert_eq!(result(&p, "vmRetirement"), "deleted");
    assert!(p.events[0].warning);
    // A build that finished before we noticed the deadline keeps its own outcome.
    let p = decide(
        &started(),
        Some(&finished(Stage::Succeeded, "TestsPassed")),
        None,
        &timing(),
        secs(500),
    );
    assert_eq!(state(&p), ("True".into(), "TestsPassed".into()));
}

#[test]
fn a_failure_tells_the_pipeline_its_cause() {
    let cause = "attempt 1 failed: step build exited 3; its output ends:\n…\nerror: no such module 'Foo'";
    let b = BuildView {
        message: Some(cause.into()),
        ..finished(Stage::Failed, "StepFailed")
    };
    let p = decide(&started(), Some(&b), Some(&lease(secs(50))), &timing(), secs(60));
    assert_eq!(state(&p), ("False".into(), "StepFailed".into()));
    assert_eq!(
        msg(&p),
        format!("MacBuild {NS}/{NAME} failed: StepFailed; no VM of it is left. {cause}")
    );
    assert!(p.events[0].message.ends_with(cause), "{}", p.events[0].message);
}

#[test]
fn finished_runs_are_never_reopened() {
    let done = after(
        started(),
        Some(&finished(Stage::Succeeded, "TestsPassed")),
        Some(&lease(secs(50))),
        secs(60),
    );
    let before = done.status.clone().unwrap();
    // Tekton patches every child on PipelineRun cancel/timeout, finished ones included.
    let patched = cancelled(done);
    let inputs: Vec<(Option<BuildView>, Option<LeaseView>)> = vec![
        (None, None),
        (Some(claimed(Stage::Running)), None),
        (Some(finished(Stage::Failed, "TestsFailed")), Some(lease(secs(1)))),
    ];
    for (b, l) in inputs {
        let p = decide(&patched, b.as_ref(), l.as_ref(), &timing(), secs(10_000));
        let mut want = before.clone();
        want.observed_generation = Some(2);
        assert_eq!(p.status, want);
        assert_eq!(p.action, BuildAction::None);
        assert_eq!(p.requeue_after, None);
        assert!(p.events.is_empty());
        assert!(p.finished.is_none());
    }
}

#[test]
fn host_unreachable_while_the_holder_lease_is_expired() {
    let r = after(
        started(),
        Some(&claimed(Stage::Running)),
        Some(&lease(secs(5))),
        secs(10),
    );
    // Renewed at 5s, 20s duration: expired from 25s.
    let p = decide(
        &r,
        Some(&claimed(Stage::Running)),
        Some(&lease(secs(5))),
        &timing(),
        secs(30),
    );
    assert_eq!(state(&p), ("Unknown".into(), "Running".into()), "the build goes on");
    assert_eq!(p.status.conditions[1].type_, HOST_UNREACHABLE, "after Succeeded");
    let c = unreachable(&p).unwrap();
    assert_eq!((c.status.as_str(), c.reason.as_deref()), ("True", Some("LeaseExpired")));
    assert_eq!(
        c.message.as_deref(),
        Some(
            "agent agent-a lease expired (last renewed 2026-10-05T02:52:05Z); the build goes on if the agent comes back"
        )
    );
    assert!(p.events.iter().any(|e| e.warning && e.reason == HOST_UNREACHABLE));
    assert_eq!(
        p.requeue_after,
        Some(Duration::from_millis(70_100)),
        "next: the deadline"
    );
    // The agent comes back: False/LeaseRenewed, build still running.
    let r = CustomRun {
        status: Some(p.status),
        ..r
    };
    let p = decide(
        &r,
        Some(&claimed(Stage::Running)),
        Some(&lease(secs(40))),
        &timing(),
        secs(41),
    );
    let c = unreachable(&p).unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_deref()),
        ("False", Some("LeaseRenewed"))
    );
    assert_eq!(state(&p).0, "Unknown");
    assert!(p.events.iter().any(|e| e.reason == "LeaseRenewed"));
}

/// Seen in CI: the agent, back from a partition, delivered its terminal status before its next
/// Lease renewal, and the ended run kept `HostUnreachable=True`.
#[test]
fn a_run_the_agent_ended_itself_is_not_left_host_unreachable() {
    let expired_lease = lease(secs(5));
    let running = after(
        started(),
        Some(&claimed(Stage::Running)),
        Some(&expired_lease),
        secs(30),
    );
    assert_eq!(unreachable_of(&running), Some(("True".into(), "LeaseExpired".into())));
    let done = finished(Stage::Succeeded, "TestsPassed");
    let p = decide(&running, Some(&done), Some(&expired_lease), &timing(), secs(31));
    assert_eq!(state(&p), ("True".into(), "TestsPassed".into()));
    let c = unreachable(&p).unwrap();
    assert_eq!(
        (c.status.as_str(), c.reason.as_deref()),
        ("False", Some("ResultDelivered"))
    );
    assert!(p.events.iter().any(|e| !e.warning && e.reason == "ResultDelivered"));
    // A run that never had the condition does not gain one; a live Lease still says LeaseRenewed.
    let quiet = after(
        started(),
        Some(&claimed(Stage::Running)),
        Some(&lease(secs(25))),
        secs(30),
    );
    let p = decide(&quiet, Some(&done), Some(&expired_lease), &timing(), secs(31));
    assert!(unreachable(&p).is_none(), "{:?}", p.status.conditions);
    let p = decide(&running, Some(&done), Some(&lease(secs(31))), &timing(), secs(31));
    assert_eq!(unreachable(&p).unwrap().reason.as_deref(), Some("LeaseRenewed"));
}

fn unreachable_of(r: &CustomRun) -> Option<(String, String)> {
    let c = r
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == HOST_UNREACHABLE)?;
    Some((c.status.clone(), c.reason.clone().unwrap_or_default()))
}

#[test]
fn liveness_table() {
    let now = secs(30);
    let d = Duration::from_secs(20);
    let cases: Vec<(&str, Option<LeaseView>, Liveness)> = vec![
        ("missing", None, Liveness::Missing),
        (
            "live",
            Some(lease(secs(15))),
            Liveness::Live {
                renewed: secs(15),
                expires: secs(35),
            },
        ),
        (
            "expired exactly at duration",
            Some(lease(secs(10))),
            Liveness::Expired {
                renewed: Some(secs(10)),
            },
        ),
        (
            "other holder",
            Some(LeaseView {
                holder_identity: Some("agent-b".into()),
                ..lease(secs(29))
            }),
            Liveness::Expired {
                renewed: Some(secs(29)),
            },
        ),
        (
            "never renewed",
            Some(LeaseView {
                renew_time: None,
                ..lease(secs(0))
            }),
            Liveness::Expired { renewed: None },
        ),
        (
            "duration unset uses the default",
            Some(LeaseView {
                duration: None,
                ..lease(secs(15))
            }),
            Liveness::Live {
                renewed: secs(15),
                expires: secs(35),
            },
        ),
        (
            "longer lease",
            Some(LeaseView {
                duration: Some(Duration::from_secs(60)),
                ..lease(secs(0))
            }),
            Liveness::Live {
                renewed: secs(0),
                expires: secs(60),
            },
        ),
    ];
    for (what, l, want) in cases {
        assert_eq!(liveness(AGENT, l.as_ref(), d, now), want, "{what}");
    }
}

#[test]
fn timeout_unclaimed_deletes_the_macbuild_fenced_on_its_resource_version() {
    let p = decide(&started(), Some(&build()), None, &timing(), secs(100));
    assert_eq!(state(&p), ("False".into(), "CustomRunTimedOut".into()));
    assert_eq!(
        p.action,
        BuildAction::Delete {
            precondition_rv: Some("17".into())
        }
    );
    assert_eq!(result(&p, "vmRetirement"), "none");
    assert!(
        msg(&p).contains("no Mac host claimed MacBuild ci/build-42-mac-build within timeout 100s"),
        "{}",
        msg(&p)
    );
    // Already being deleted: no second delete.
    let p = decide(
        &started(),
        Some(&BuildView {
            deleting: true,
            ..build()
        }),
        None,
        &timing(),
        secs(100),
    );
    assert_eq!(p.action, BuildAction::None);
    // Past the deadline with no MacBuild: never create one.
    let p = decide(&started(), None, None, &timing(), secs(100));
    assert_eq!(state(&p), ("False".into(), "CustomRunTimedOut".into()));
    assert_eq!(p.action, BuildAction::None);
}

#[test]
fn timeout_with_live_lease_cancels_and_waits_for_vm_deleted_up_to_grace() {
    let b = claimed(Stage::Running);
    // At the deadline: request cancel, wait until deadline + 45s.
    let p = decide(&started(), Some(&b), Some(&lease(secs(98))), &timing(), secs(100));
    assert_eq!(state(&p), ("Unknown".into(), "TimingOut".into()));
    assert_eq!(p.action, BuildAction::RequestCancel);
    assert_eq!(
        p.requeue_after,
        Some(Duration::from_millis(18_100)),
        "lease expiry at 118s comes first"
    );
    assert!(unreachable(&p).is_none());
    // Cancel already requested (and the ask recorded in the run at 100 s): no second patch.
    let asked = BuildView {
        cancel_requested: true,
        ..b.clone()
    };
    let seen = after(started(), Some(&b), Some(&lease(secs(98))), secs(100));
    let p = decide(&seen, Some(&asked), Some(&lease(secs(140))), &timing(), secs(141));
    assert_eq!(p.action, BuildAction::None);
    assert_eq!(
        p.requeue_after,
        Some(Duration::from_millis(4_100)),
        "grace ends at 145s"
    );
    // Agent confirms the VM deleted (cancelled) within grace.
    let gone = BuildView {
        vm_deleted: true,
        stage: Some(Stage::Retiring),
        ..asked.clone()
    };
    let p = decide(&started(), Some(&gone), Some(&lease(secs(120))), &timing(), secs(125));
    assert_eq!(state(&p), ("False".into(), "CustomRunTimedOut".into()));
    assert_eq!(result(&p, "vmRetirement"), "deleted");
    assert_eq!(p.action, BuildAction::None);
    let done = BuildView {
        stage: Some(Stage::Cancelled),
        reason: Some("CancelRequested".into()),
        ..gone
    };
    let p = decide(&started(), Some(&done), Some(&lease(secs(120))), &timing(), secs(125));
    assert_eq!(state(&p), ("False".into(), "CustomRunTimedOut".into()));
    assert_eq!(result(&p, "vmRetirement"), "deleted");
    // Live lease but no confirmation by the end of grace: unconfirmed, and the MacBuild deleted
    // (the run's status names its holder since the deadline).
    let seen = after(started(), Some(&b), Some(&lease(secs(98))), secs(100));
    let p = decide(&seen, Some(&asked), Some(&lease(secs(144))), &timing(), secs(145));
    assert_eq!(state(&p), ("False".into(), "CustomRunTimedOut".into()));
    assert_eq!(result(&p, "vmRetirement"), "unconfirmed");
    assert_eq!(p.action, BuildAction::Delete { precondition_rv: None });
    assert_eq!(
        msg(&p),
        "MacBuild did not finish within timeout 100s + 45s grace; VM retirement unconfirmed: agent agent-a lease is \
         live (last renewed 2026-10-05T02:54:24Z) but has not confirmed the VM deleted; the MacBuild is deleted once \
         the agent confirms its VM is gone"
    );
}

/// The cancel request reached the MacBuild but the run's status write that recorded when was lost:
/// the next reconcile, past the deadline's grace, ended the run `unconfirmed` at once although the
/// holder was live and asked only just before. The ask is taken as made now and waited on.
#[test]
fn a_cancel_request_whose_record_in_the_run_was_lost_still_gives_a_live_holder_its_grace() {
    let asked = BuildView {
        cancel_requested: true,
        ..claimed(Stage::Running)
    };
    let p = decide(&started(), Some(&asked), Some(&lease(secs(199))), &timing(), secs(200));
    assert_eq!(state(&p), ("Unknown".into(), "TimingOut".into()));
    assert_eq!(p.action, BuildAction::None, "no second cancel patch");
    assert_eq!(extra(&p).cancel_requested_at.as_deref(), Some("2026-10-05T02:55:20Z"));
    // Still waiting just before 200 + 45 s with the ask now recorded; given up at 245 s.
    let run = after(started(), Some(&asked), Some(&lease(secs(199))), secs(200));
    let p = decide(&run, Some(&asked), Some(&lease(secs(240))), &timing(), secs(244));
    assert_eq!(state(&p), ("Unknown".into(), "TimingOut".into()));
    let p = decide(&run, Some(&asked), Some(&lease(secs(240))), &timing(), secs(245));
    assert_eq!(state(&p), ("False".into(), "CustomRunTimedOut".into()), "{}", msg(&p));
    assert_eq!(result(&p, "vmRetirement"), "unconfirmed");
    // Unreachable, it gets no more than the deadline's grace (once the run names the holder).
    let run = after(started(), Some(&asked), Some(&lease(secs(150))), secs(200));
    let p = decide(&run, Some(&asked), Some(&lease(secs(150))), &timing(), secs(200));
    assert_eq!(state(&p), ("False".into(), "CustomRunTimedOut".into()), "{}", msg(&p));
    assert_eq!(result(&p, "vmRetirement"), "unconfirmed");
}

/// A controller down (or far behind) over a run's deadline and grace used to end it at once
/// `unconfirmed` when it came back, although the holder was live and had never been asked to
/// cancel (seen in chaos at 20 hosts: the agent confirmed a second later). A live holder gets the
/// grace from the controller's ask; an unreachable one does not (it cannot answer).
#[test]
fn timeout_first_seen_after_the_grace_asks_a_live_holder_and_waits_the_grace_from_then() {
    let b = claimed(Stage::Running);
    let run = started();
    let p = decide(&run, Some(&b), Some(&lease(secs(199))), &timing(), secs(200));
    assert_eq!(state(&p), ("Unknown".into(), "TimingOut".into()));
    assert_eq!(p.action, BuildAction::RequestCancel);
    assert_eq!(extra(&p).cancel_requested_at.as_deref(), Some("2026-10-05T02:55:20Z"));
    // The ask is kept in status: 10 s later, still waiting, until 200 + 45 s.
    let run = after(run, Some(&b), Some(&lease(secs(199))), secs(200));
    let asked = BuildView {
        cancel_requested: true,
        ..b.clone()
    };
    let p = decide(&run, Some(&asked), Some(&lease(secs(209))), &timing(), secs(210));
    assert_eq!(state(&p), ("Unknown".into(), "TimingOut".into()));
    assert_eq!(p.action, BuildAction::None);
    assert_eq!(
        p.requeue_after,
        Some(Duration::from_millis(19_100)),
        "the lease expiry at 229s first"
    );
    let gone = BuildView {
        vm_deleted: true,
        stage: Some(Stage::Retiring),
        ..asked.clone()
    };
    let p = decide(&run, Some(&gone), Some(&lease(secs(209))), &timing(), secs(211));
    assert_eq!(state(&p), ("False".into(), "CustomRunTimedOut".into()));
    assert_eq!(result(&p, "vmRetirement"), "deleted");
    // No confirmation within the grace from the ask: unconfirmed, as at the deadline's grace.
    let p = decide(&run, Some(&asked), Some(&lease(secs(244))), &timing(), secs(245));
    assert_eq!(result(&p, "vmRetirement"), "unconfirmed");
    assert_eq!(p.action, BuildAction::Delete { precondition_rv: None });
    // An expired holder cannot answer: unconfirmed at once, as before (once the run's status
    // names it: see a_claimed_macbuild_is_deleted_only_once_the_run_names_its_holder).
    let p = decide(&run, Some(&b), Some(&lease(secs(100))), &timing(), secs(200));
    assert_eq!(state(&p), ("False".into(), "CustomRunTimedOut".into()));
    assert_eq!(result(&p, "vmRetirement"), "unconfirmed");
}

/// A claimed MacBuild is deleted (unfenced) when a timed-out run gives up on its holder, and
/// the delete goes out before the status write. Seen in chaos (API outages): that write failed,
/// the agent finished, its finalizer let the MacBuild go, and the next reconcile, finding no
/// MacBuild and no holder in the run's status, ended it `vmRetirement=none` with no attempt,
/// although the build had been admitted and had run. A plan that deletes a claimed MacBuild is
/// decided on a run whose status already names its holder and attempt, so that losing the write
/// of that plan loses nothing.
#[test]
fn a_claimed_macbuild_is_deleted_only_once_the_run_names_its_holder() {
    let asked = BuildView {
        cancel_requested: true,
        ..claimed(Stage::Running)
    };
    // The run's status recorded the MacBuild unclaimed; later writes (the claim, the cancel ask)
    // were lost.
    let unclaimed_seen = after(started(), Some(&build()), None, secs(2));
    // A live holder's lease is renewed as time goes on; an expired one's is not.
    let holder = |live: bool, at: i64| lease(secs(if live { at - 5 } else { 100 }));
    for (what, r, live) in [
        ("expired holder, first seen past the grace", &unclaimed_seen, false),
        // The ask is taken as made when first seen: the grace runs from then.
        ("live holder asked to cancel, ask not recorded", &unclaimed_seen, true),
        ("expired holder, run status from before the MacBuild", &started(), false),
    ] {
        let mut now = 170;
        // Whatever is decided, if it deletes: its status write may fail, and then the MacBuild
        // is gone (the agent's finalizer let it go once the VM was deleted).
        let mut run = r.clone();
        for _ in 0..6 {
            let p = decide(&run, Some(&asked), Some(&holder(live, now)), &timing(), secs(now));
            if matches!(p.action, BuildAction::Delete { .. }) {
                let gone = decide(&run, None, None, &timing(), secs(now));
                assert_eq!(state(&gone), ("False".into(), "CustomRunTimedOut".into()), "{what}");
                assert_eq!(result(&gone, "vmRetirement"), "deleted", "{what}: {}", msg(&gone));
                assert_eq!(result(&gone, "attempt"), "build-42-mac-build#1", "{what}");
                // And the plan itself, had its write landed, tells the same attempt.
                assert_eq!(result(&p, "attempt"), "build-42-mac-build#1", "{what}");
                assert_eq!(result(&p, "vmRetirement"), "unconfirmed", "{what}");
                break;
            }
            // Not deleting yet: the status names the holder first, and comes back within the
            // grace.
            assert_eq!(p.finished, None, "{what}");
            assert_eq!(extra(&p).holder.as_deref(), Some(AGENT), "{what}");
            assert_eq!(extra(&p).attempt.as_deref(), Some("build-42-mac-build#1"), "{what}");
            let wait = p.requeue_after.expect("comes back");
            assert!(wait <= Duration::from_secs(45), "{what}: {wait:?}");
            run.status = Some(p.status);
            now += wait.as_secs_f64().ceil() as i64;
        }
        assert!(
            matches!(
                decide(&run, Some(&asked), Some(&holder(live, now)), &timing(), secs(now)).action,
                BuildAction::Delete { .. }
            ),
            "{what}: the MacBuild is deleted once the holder is recorded"
        );
        assert!(
            !live || now >= 215,
            "{what}: a live holder was given its grace from 170 s ({now} s)"
        );
    }
}

#[test]
fn timeout_with_expired_lease_ends_at_grace_with_the_seed_message() {
    let b = BuildView {
        cancel_requested: true,
        ..claimed(Stage::Running)
    };
    // The seed: last renewed 02:54:20, which is 140s after start. Before the grace ends the
    // CustomRun shows HostUnreachable and keeps waiting.
    let renewed = t("2026-10-05T02:53:00Z");
    let p = decide(&started(), Some(&b), Some(&lease(renewed)), &timing(), secs(120));
    assert_eq!(state(&p), ("Unknown".into(), "TimingOut".into()));
    let seen = after(started(), Some(&b), Some(&lease(renewed)), secs(120));
    assert_eq!(unreachable(&p).unwrap().status, "True");
    assert_eq!(p.requeue_after, Some(Duration::from_millis(25_100)));
    let seed_lease = lease(t("2026-10-05T02:54:20Z"));
    // Grace ends at 145s (02:54:25); the lease expired at 02:54:40? No: renewed 02:54:20 + 20s.
    // So take the seed literally: at 02:54:41 the lease is expired and grace is over.
    let p = decide(&seen, Some(&b), Some(&seed_lease), &timing(), t("2026-10-05T02:54:41Z"));
    assert_eq!(state(&p), ("False".into(), "CustomRunTimedOut".into()));
    assert_eq!(
        msg(&p),
        "MacBuild did not finish within timeout 100s + 45s grace; VM retirement unconfirmed: agent agent-a lease \
         expired (last renewed 2026-10-05T02:54:20Z); the MacBuild is kept until the agent returns"
    );
    assert_eq!(result(&p, "vmRetirement"), "unconfirmed");
    assert_eq!(result(&p, "attempt"), "build-42-mac-build#1");
    assert_eq!(p.action, BuildAction::Delete { precondition_rv: None });
    assert_eq!(
        unreachable(&p).unwrap().status,
        "True",
        "HostUnreachable stays after Succeeded"
    );
    assert_eq!(p.status.conditions[0].type_, SUCCEEDED);
    assert_eq!(
        p.finished,
        Some(Finished {
            status: "False".into(),
            reason: "CustomRunTimedOut".into(),
            vm_retirement: VmRetirement::Unconfirmed
        })
    );
    // Missing Lease altogether counts as expired.
    let p = decide(&seen, Some(&b), None, &timing(), secs(145));
    assert!(
        msg(&p).contains("agent agent-a lease expired (no Lease found)"),
        "{}",
        msg(&p)
    );
    // MacBuild already being deleted (finalizer holds it): no second delete.
    let deleting = BuildView { deleting: true, ..b };
    let p = decide(&started(), Some(&deleting), None, &timing(), secs(145));
    assert_eq!(p.action, BuildAction::None);
}

#[test]
fn cancellation_table() {
    let expired = lease(secs(-15));
    // (what, MacBuild, Lease, expected Succeeded, expected action, expected vmRetirement)
    type Case<'a> = (
        &'a str,
        Option<BuildView>,
        Option<LeaseView>,
        (&'a str, &'a str),
        BuildAction,
        Option<&'a str>,
    );
    let cases: Vec<Case> = vec![
        (
            "no MacBuild yet",
            None,
            None,
            ("False", "CustomRunCancelled"),
            BuildAction::None,
            Some("none"),
        ),
        (
            "unclaimed",
            Some(build()),
            None,
            ("False", "CustomRunCancelled"),
            BuildAction::Delete {
                precondition_rv: Some("17".into()),
            },
            Some("none"),
        ),
        (
            "claimed, live lease: ask and wait",
            Some(claimed(Stage::Booting)),
            Some(lease(secs(9))),
            ("Unknown", "Cancelling"),
            BuildAction::RequestCancel,
            None,
        ),
        (
            "claimed, expired lease: at once, unconfirmed",
            Some(claimed(Stage::Running)),
            Some(expired.clone()),
            ("False", "CustomRunCancelled"),
            BuildAction::RequestCancel,
            Some("unconfirmed"),
        ),
        (
            "agent confirmed the VM deleted",
            Some(BuildView {
                cancel_requested: true,
                vm_deleted: true,
                ..claimed(Stage::Retiring)
            }),
            Some(lease(secs(9))),
            ("False", "CustomRunCancelled"),
            BuildAction::None,
            Some("deleted"),
        ),
        (
            "MacBuild ended Cancelled",
            Some(BuildView {
                cancel_requested: true,
                ..finished(Stage::Cancelled, "CancelRequested")
            }),
            Some(lease(secs(9))),
            ("False", "CustomRunCancelled"),
            BuildAction::None,
            Some("deleted"),
        ),
        (
            "build had already succeeded: the truth wins",
            Some(finished(Stage::Succeeded, "TestsPassed")),
            Some(lease(secs(9))),
            ("True", "TestsPassed"),
            BuildAction::None,
            Some("deleted"),
        ),
    ];
    for (what, b, l, want, action, retirement) in cases {
        let p = decide(&cancelled(started()), b.as_ref(), l.as_ref(), &timing(), secs(10));
        assert_eq!(
            (state(&p).0.as_str(), state(&p).1.as_str()),
            want,
            "{what}: {}",
            msg(&p)
        );
        assert_eq!(p.action, action, "{what}");
        match retirement {
            Some(r) => assert_eq!(result(&p, "vmRetirement"), r, "{what}"),
            None => assert!(p.status.results.is_empty(), "{what}"),
        }
        assert_eq!(p.status.observed_generation, Some(2), "{what}");
    }
    // The expired case names the agent and its last renewal.
    let p = decide(
        &cancelled(started()),
        Some(&claimed(Stage::Running)),
        Some(&expired),
        &timing(),
        secs(10),
    );
    assert!(
        msg(&p).contains("agent agent-a lease expired (last renewed 2026-10-05T02:51:45Z)"),
        "{}",
        msg(&p)
    );
    assert_eq!(unreachable(&p).unwrap().status, "True");
}

#[test]
fn cancel_with_live_lease_is_bounded_by_grace_from_the_request() {
    let r = cancelled(started());
    let b = claimed(Stage::Running);
    let p = decide(&r, Some(&b), Some(&lease(secs(9))), &timing(), secs(10));
    assert_eq!(extra(&p).cancel_requested_at.as_deref(), Some("2026-10-05T02:52:10Z"));
    let r = CustomRun {
        status: Some(p.status),
        ..r
    };
    let asked = BuildView {
        cancel_requested: true,
        ..b
    };
    let p = decide(&r, Some(&asked), Some(&lease(secs(50))), &timing(), secs(54));
    assert_eq!(state(&p), ("Unknown".into(), "Cancelling".into()));
    assert_eq!(p.action, BuildAction::None);
    assert_eq!(
        p.requeue_after,
        Some(Duration::from_millis(1_100)),
        "grace ends 45s after the request"
    );
    assert_eq!(
        extra(&p).cancel_requested_at.as_deref(),
        Some("2026-10-05T02:52:10Z"),
        "kept"
    );
    let p = decide(&r, Some(&asked), Some(&lease(secs(50))), &timing(), secs(55));
    assert_eq!(state(&p), ("False".into(), "CustomRunCancelled".into()));
    assert_eq!(result(&p, "vmRetirement"), "unconfirmed");
    assert!(
        msg(&p).contains("did not confirm the VM deleted within 45s"),
        "{}",
        msg(&p)
    );
}

#[test]
fn a_macbuild_we_do_not_control_is_not_adopted() {
    let foreign = BuildView {
        controller_uid: Some("someone-else".into()),
        ..claimed(Stage::Running)
    };
    let p = decide(&started(), Some(&foreign), None, &timing(), secs(5));
    assert_eq!(state(&p), ("False".into(), "MacBuildNameTaken".into()));
    assert_eq!(p.action, BuildAction::None);
    assert!(msg(&p).contains("not controlled by this CustomRun"));
    let orphan = BuildView {
        controller_uid: None,
        ..build()
    };
    let p = decide(&started(), Some(&orphan), None, &timing(), secs(5));
    assert_eq!(state(&p).1, "MacBuildNameTaken");
}

#[test]
fn a_macbuild_deleted_behind_our_back_is_not_recreated() {
    let r = after(started(), Some(&build()), None, secs(2));
    let p = decide(&r, None, None, &timing(), secs(5));
    assert_eq!(state(&p), ("False".into(), "MacBuildDeleted".into()));
    assert_eq!(p.action, BuildAction::None);
    assert_eq!(result(&p, "vmRetirement"), "none");
    // Once claimed, its finalizer held it until the VM was gone.
    let r = after(
        started(),
        Some(&claimed(Stage::Running)),
        Some(&lease(secs(1))),
        secs(2),
    );
    let p = decide(&r, None, None, &timing(), secs(5));
    assert_eq!(result(&p, "vmRetirement"), "deleted");
    assert_eq!(result(&p, "attempt"), "build-42-mac-build#1");
}

#[test]
fn transition_time_moves_only_when_status_or_reason_changes() {
    let b = claimed(Stage::Running);
    let r = after(started(), Some(&b), Some(&lease(secs(9))), secs(10));
    let ltt = |r: &CustomRun| r.status.as_ref().unwrap().conditions[0].last_transition_time.clone();
    assert_eq!(ltt(&r).as_deref(), Some("2026-10-05T02:52:10Z"));
    let again = after(
        r.clone(),
        Some(&BuildView {
            journal_seq: Some(121),
            ..b.clone()
        }),
        Some(&lease(secs(19))),
        secs(20),
    );
    assert_eq!(ltt(&again), ltt(&r));
    let p = decide(&r, Some(&b), Some(&lease(secs(19))), &timing(), secs(20));
    assert!(p.events.is_empty(), "no event without a change");
    let collecting = after(
        r.clone(),
        Some(&claimed(Stage::Collecting)),
        Some(&lease(secs(19))),
        secs(20),
    );
    assert_eq!(ltt(&collecting).as_deref(), Some("2026-10-05T02:52:20Z"));
    // Same inputs, same plan: reconciles are idempotent.
    let p1 = decide(&again, Some(&b), Some(&lease(secs(19))), &timing(), secs(21));
    let p2 = decide(
        &CustomRun {
            status: Some(p1.status.clone()),
            ..again
        },
        Some(&b),
        Some(&lease(secs(19))),
        &timing(),
        secs(21),
    );
    assert_eq!(p1.status, p2.status);
}

#[test]
fn status_never_carries_unknown_top_level_keys() {
    // Tekton prunes anything but these; results are strings by construction.
    let p = decide(
        &started(),
        Some(&finished(Stage::Succeeded, "TestsPassed")),
        None,
        &timing(),
        secs(50),
    );
    let json = serde_json::to_value(&p.status).unwrap();
    let allowed = [
        "observedGeneration",
        "conditions",
        "annotations",
        "startTime",
        "completionTime",
        "results",
        "retriesStatus",
        "extraFields",
    ];
    for key in json.as_object().unwrap().keys() {
        assert!(allowed.contains(&key.as_str()), "{key} would be pruned");
    }
}

#[test]
fn a_spec_the_api_refuses_fails_the_run_once() {
    let p = refuse_spec(
        &run(),
        "MacBuild.tartan.dev \"x\" is invalid: spec.steps[0].name: Invalid value".into(),
        t0(),
    );
    assert_eq!(state(&p), ("False".into(), "InvalidMacBuildSpec".into()));
    assert!(msg(&p).contains("spec.steps[0].name"));
    assert_eq!(p.action, BuildAction::None);
    assert_eq!(p.status.start_time, Some(Time(t0())));
    // Never reopens a finished run.
    let done = after(
        started(),
        Some(&finished(Stage::Succeeded, "TestsPassed")),
        None,
        secs(50),
    );
    let p = refuse_spec(&done, "late".into(), secs(60));
    assert_eq!(state(&p), ("True".into(), "TestsPassed".into()));
}

#[test]
fn a_finished_run_is_settled_without_its_macbuild_or_lease() {
    let done = after(
        started(),
        Some(&finished(Stage::Succeeded, "TestsPassed")),
        Some(&lease(secs(50))),
        secs(60),
    );
    // What decide says for it, whatever it sees, settled says without looking.
    let settled_plan = settled(&done).expect("a finished run is settled");
    for (b, l) in [
        (None, None),
        (Some(claimed(Stage::Running)), Some(lease(secs(1)))),
        (Some(finished(Stage::Failed, "TestsFailed")), None),
    ] {
        let p = decide(&done, b.as_ref(), l.as_ref(), &timing(), secs(10_000));
        assert_eq!(p.status, settled_plan.status);
        assert_eq!((p.action, p.requeue_after), (BuildAction::None, None));
    }
    assert!(nothing_owed(&done), "its status already says everything");
    // A spec patch on the finished run (Tekton cancels every child) still owes observedGeneration.
    let patched = cancelled(done);
    assert!(!nothing_owed(&patched));
    assert_eq!(settled(&patched).unwrap().status.observed_generation, Some(2));
    // Runs still going are never settled.
    assert!(settled(&started()).is_none());
    assert!(!nothing_owed(&started()));
    assert!(!nothing_owed(&run()));
}

#[test]
fn verdicts_a_stale_cache_could_get_wrong_are_read_again() {
    let running = after(
        started(),
        Some(&claimed(Stage::Running)),
        Some(&lease(secs(5))),
        secs(10),
    );
    // The build's own terminal outcome with its VM deleted never changes back: no second read.
    let b = finished(Stage::Succeeded, "TestsPassed");
    let p = decide(&running, Some(&b), Some(&lease(secs(5))), &timing(), secs(20));
    assert!(p.finished.is_some());
    assert!(!needs_fresh_inputs(&p, Some(&b)));
    // Still running: nothing irreversible.
    let b = claimed(Stage::Running);
    let p = decide(&running, Some(&b), Some(&lease(secs(15))), &timing(), secs(20));
    assert!(!needs_fresh_inputs(&p, Some(&b)));
    // A MacBuild that seems gone: MacBuildDeleted only on a fresh read.
    let p = decide(&running, None, None, &timing(), secs(20));
    assert!(p.finished.is_some());
    assert!(needs_fresh_inputs(&p, None));
    // Cancelled with the holder's Lease looking expired: ends unconfirmed, read again first.
    let b = claimed(Stage::Running);
    let p = decide(&cancelled(running.clone()), Some(&b), None, &timing(), secs(20));
    assert!(p.finished.is_some());
    assert!(needs_fresh_inputs(&p, Some(&b)));
    // Cancelled before any claim: a (fenced) delete, read again first.
    let p = decide(&cancelled(started()), Some(&build()), None, &timing(), secs(20));
    assert!(matches!(p.action, BuildAction::Delete { .. }));
    assert!(needs_fresh_inputs(&p, Some(&build())));
}

#[test]
fn a_finished_run_is_due_its_label_a_while_after_its_completion() {
    let mut r = run();
    let t = timing();
    assert_eq!(t.finished_label_after, Duration::from_secs(30));
    // No status, or no completion time: due now.
    assert_eq!(finished_label_wait(&r, &t, t0()), None);
    r.status = Some(CustomRunStatus {
        completion_time: Some(Time(t0())),
        ..Default::default()
    });
    assert_eq!(finished_label_wait(&r, &t, t0()), Some(Duration::from_secs(30)));
    assert_eq!(finished_label_wait(&r, &t, secs(29)), Some(Duration::from_secs(1)));
    assert_eq!(finished_label_wait(&r, &t, secs(30)), None);
    assert_eq!(finished_label_wait(&r, &t, secs(3600)), None);
    // A completion time ahead of our clock waits no longer than the delay.
    assert_eq!(finished_label_wait(&r, &t, secs(-10)), Some(Duration::from_secs(30)));
    assert_eq!(
        finished_label_wait(&r, &t, secs(-86_400)),
        Some(Duration::from_secs(30))
    );
    let now = Timing {
        finished_label_after: Duration::ZERO,
        ..timing()
    };
    assert_eq!(finished_label_wait(&r, &now, t0()), None);
}

#[test]
fn a_run_waiting_for_a_labelling_slot_comes_back_within_2_to_4_s_spread_by_uid() {
    let waits: std::collections::BTreeSet<Duration> = (0..200).map(|i| label_slot_retry(&format!("uid-{i}"))).collect();
    assert!(
        waits
            .iter()
            .all(|w| (Duration::from_secs(2)..Duration::from_secs(4)).contains(w)),
        "{waits:?}"
    );
    assert!(
        waits.len() > 150,
        "200 runs come back at only {} distinct times",
        waits.len()
    );
    assert_eq!(label_slot_retry("uid-7"), label_slot_retry("uid-7"));
}

#[test]
fn a_same_name_macbuild_being_deleted_is_waited_for_then_ours_is_created() {
    // A PipelineRun deleted and created again under its name: the old run's MacBuild is still
    // held by its agent's finalizer while the VM is deleted.
    let leaving = BuildView {
        controller_uid: Some("the-old-run".into()),
        deleting: true,
        ..claimed(Stage::Retiring)
    };
    let p = decide(&started(), Some(&leaving), None, &timing(), secs(5));
    assert_eq!(state(&p), ("Unknown".into(), "MacBuildNameTerminating".into()));
    assert_eq!(p.action, BuildAction::None);
    assert!(p.finished.is_none());
    assert!(
        msg(&p).contains("of an earlier run (controller uid the-old-run) is being deleted"),
        "{}",
        msg(&p)
    );
    assert!(
        p.requeue_after.is_some_and(|r| r <= Duration::from_secs(6)),
        "{:?}",
        p.requeue_after
    );
    assert!(!needs_fresh_inputs(&p, Some(&leaving)));
    // Once it is gone, ours is created.
    let r = after(started(), Some(&leaving), None, secs(5));
    let p = decide(&r, None, None, &timing(), secs(8));
    assert!(matches!(p.action, BuildAction::Create(_)), "{:?}", p.action);
    assert_eq!(state(&p), ("Unknown".into(), "Pending".into()));
    // Cancelled or timed out while waiting: ended without a MacBuild, as without one.
    let p = decide(&cancelled(r.clone()), Some(&leaving), None, &timing(), secs(8));
    assert_eq!(state(&p), ("False".into(), reason::CANCELLED.into()));
    assert_eq!(p.action, BuildAction::None);
    assert_eq!(result(&p, "vmRetirement"), "none");
    let p = decide(&r, Some(&leaving), None, &timing(), secs(101));
    assert_eq!(state(&p), ("False".into(), reason::TIMED_OUT.into()));
    assert!(msg(&p).contains("was not created within timeout"), "{}", msg(&p));
    // A same-name MacBuild that is not being deleted is still refused.
    let staying = BuildView {
        deleting: false,
        ..leaving
    };
    let p = decide(&started(), Some(&staying), None, &timing(), secs(5));
    assert_eq!(state(&p), ("False".into(), "MacBuildNameTaken".into()));
}

/// A build refused before its clone (a mount not declared, a Secret not allowed) never had a
/// VM: the pipeline is not told that "its VM is deleted", only that none is left, beside the
/// agent's own "nothing was cloned". Cancelled builds (maybe before their clone) alike.
#[test]
fn a_build_that_never_had_a_vm_is_not_said_to_have_had_its_vm_deleted() {
    let cause = "attempt 1 failed: mount \"pods\" is not declared by this agent's config ([[mounts]]: it declares \
                 spm, seed); nothing was cloned";
    let b = BuildView {
        message: Some(cause.into()),
        ..finished(Stage::Failed, "MountNotDeclared")
    };
    let p = decide(&started(), Some(&b), Some(&lease(secs(50))), &timing(), secs(60));
    assert_eq!(state(&p), ("False".into(), "MountNotDeclared".into()));
    assert_eq!(
        msg(&p),
        format!("MacBuild {NS}/{NAME} failed: MountNotDeclared; no VM of it is left. {cause}")
    );
    let b = finished(Stage::Cancelled, "CancelRequested");
    let p = decide(&cancelled(started()), Some(&b), None, &timing(), secs(60));
    assert_eq!(msg(&p), format!("MacBuild {NS}/{NAME} cancelled; no VM of it is left"));
    let p = decide(&started(), Some(&b), None, &timing(), secs(101));
    assert_eq!(
        msg(&p),
        "MacBuild did not finish within timeout 100s; no VM of it is left"
    );
}

/// Found by an adversary (round 4): `decide_timeout` deleted the MacBuild (and ends the run) only once the run's status
/// already names the holder and attempt it sees; the holder writes both. An agent whose MacBuild
/// shows another attempt at every reconcile (flapping, a crash loop retrying, or hostile) makes
/// `holder_recorded` false every round: the run is kept `Unknown/TimingOut` and requeued at once,
/// forever, long past the deadline's grace, where it used to end `unconfirmed`.
#[test]
fn a_timed_out_run_ends_even_if_the_macbuild_shows_a_new_attempt_every_round() {
    let mut run = started();
    for (round, live) in [(0i64, true), (0, false)]
        .into_iter()
        .flat_map(|(_, l)| (0..40).map(move |i| (i, l)))
    {
        let b = BuildView {
            cancel_requested: true,
            attempt: Some(format!("{NAME}#{round}")),
            ..claimed(Stage::Running)
        };
        let now = secs(200 + round * 30);
        let l = if live { lease(now) } else { lease(secs(100)) };
        let p = decide(&run, Some(&b), Some(&l), &timing(), now);
        if p.finished.is_some() {
            return;
        }
        if round == 39 {
            panic!(
                "still {:?} at {now} ({}s past the deadline, live holder {live}): {}",
                state(&p),
                100 + round * 30,
                msg(&p)
            );
        }
        run.status = Some(p.status);
    }
}

/// A holder whose claim landed but which never admitted the build (its claim's answer came too
/// late, or the cancel came first) confirms `VMDeleted` for a VM it never made: the run says
/// `none` and why, on a timeout, a cancel and a build that ended cancelled, never `deleted`.
#[test]
fn a_holder_that_never_admitted_the_build_confirms_that_no_vm_was_made() {
    let unadmitted = BuildView {
        stage: Some(Stage::Pending),
        cancel_requested: true,
        vm_deleted: true,
        nothing_admitted: true,
        ..claimed(Stage::Pending)
    };
    let timed_out = decide(
        &started(),
        Some(&unadmitted),
        Some(&lease(secs(120))),
        &timing(),
        secs(125),
    );
    assert_eq!(state(&timed_out), ("False".into(), "CustomRunTimedOut".into()));
    let cancelled_run = cancelled(started());
    let cancel = decide(
        &cancelled_run,
        Some(&unadmitted),
        Some(&lease(secs(20))),
        &timing(),
        secs(21),
    );
    assert_eq!(state(&cancel), ("False".into(), "CustomRunCancelled".into()));
    let ended = BuildView {
        stage: Some(Stage::Cancelled),
        reason: Some("CancelRequested".into()),
        ..unadmitted.clone()
    };
    let settled = decide(
        &cancelled_run,
        Some(&ended),
        Some(&lease(secs(20))),
        &timing(),
        secs(21),
    );
    assert_eq!(state(&settled), ("False".into(), "CustomRunCancelled".into()));
    for (what, p) in [
        ("timed out", &timed_out),
        ("cancelled", &cancel),
        ("ended cancelled", &settled),
    ] {
        assert_eq!(result(p, "vmRetirement"), "none", "{what}: {}", msg(p));
        assert!(!msg(p).contains("VM deleted"), "{what}: {}", msg(p));
    }
    assert!(
        msg(&timed_out).contains("never admitted the build: no VM was created"),
        "{}",
        msg(&timed_out)
    );
    // The same confirmation from a holder that admitted an attempt: `deleted`, as always.
    let admitted = BuildView {
        nothing_admitted: false,
        ..unadmitted
    };
    let p = decide(
        &started(),
        Some(&admitted),
        Some(&lease(secs(120))),
        &timing(),
        secs(125),
    );
    assert_eq!(result(&p, "vmRetirement"), "deleted");
    assert!(msg(&p).contains("confirmed its VM deleted"), "{}", msg(&p));
}
