//! Adversary round 17: `vmRetirement=none` for a holder that never admitted the build
//! (`nothing_admitted`), and the watch cache's trim that must read the same.
//!
//! Every case starts from a MacBuild as the API would return it (JSON), reads it through
//! `build_view` (trimmed and not), and decides the CustomRun with the real `decide`.

use super::*;
use crate::customrun::{CustomRef, CustomRunSpec, Param};
use crate::view::{build_view, trim_macbuild};
use serde_json::{Value, json};
use tartan_api::MacBuild;

const NAME: &str = "build-7";
const RUN_UID: &str = "run-uid-7";

fn t0() -> Timestamp {
    "2026-10-05T02:52:00Z".parse().unwrap()
}

fn at(secs: i64) -> Timestamp {
    t0() + SignedDuration::from_secs(secs)
}

/// A CustomRun (timeout 100 s) as the controller has started it; `cancelled`: the pipeline
/// cancelled it since.
fn run(cancelled: bool) -> CustomRun {
    let spec = CustomRunSpec {
        custom_ref: Some(CustomRef {
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
                value: json!(["xcodebuild build"]),
            },
        ],
        timeout: Some("100s".into()),
        service_account_name: "default".into(),
        ..Default::default()
    };
    let mut r = CustomRun::new(NAME, spec);
    r.metadata.namespace = Some("ci".into());
    r.metadata.uid = Some(RUN_UID.into());
    r.metadata.generation = Some(1);
    r.metadata.creation_timestamp = Some(Time(t0()));
    let started = decide(&r, None, None, &Timing::default(), t0());
    r.status = Some(started.status);
    if cancelled {
        r.spec.status = Some("RunCancelled".into());
        r.metadata.generation = Some(2);
    }
    r
}

fn macbuild(status: Value, cancel_requested: bool) -> MacBuild {
    serde_json::from_value(json!({
        "apiVersion": "tartan.dev/v1alpha1", "kind": "MacBuild",
        "metadata": {"name": NAME, "namespace": "ci", "uid": "mb-uid-7", "resourceVersion": "40",
            "ownerReferences": [{"apiVersion": "tekton.dev/v1beta1", "kind": "CustomRun", "name": NAME,
                "uid": RUN_UID, "controller": true}]},
        "spec": {"image": "img", "steps": [{"name": "build", "run": ["true"]}], "cancelRequested": cancel_requested},
        "status": status,
    }))
    .unwrap()
}

fn lease(holder: &str, renewed: Timestamp) -> LeaseView {
    LeaseView {
        holder_identity: Some(holder.into()),
        renew_time: Some(renewed),
        duration: Some(Duration::from_secs(20)),
    }
}

fn vm_retirement(p: &Plan) -> String {
    p.status
        .results
        .iter()
        .find(|r| r.name == result::VM_RETIREMENT)
        .map(|r| r.value.clone())
        .unwrap_or_else(|| panic!("no vmRetirement result: {:?}", p.status))
}

fn message(p: &Plan) -> String {
    p.status.conditions[0].message.clone().unwrap_or_default()
}

fn vm_deleted() -> Value {
    json!({"type": "VMDeleted", "status": "True", "reason": "VMDeleted", "message": "",
        "lastTransitionTime": "2026-10-05T02:53:00Z"})
}

/// The status agent-b writes for its attempt 2 of a build handed on from agent-a: agent-a's
/// attempt 1 listed as agent-a last reported it (admitted and booting, but its `Admitted` record
/// never reached the cluster, so no `startedAt`: see agent/tests/adversary17_claims.rs part 3;
/// not finished, no outcome), agent-b's own attempt 2 never admitted (`a2`: its outcome and
/// reason, its phase). `status.deadline` is agent-b's attempt's: none.
fn handed_on_status(a2_outcome: Option<&str>, a2_reason: &str, phase: &str) -> Value {
    json!({
        "phase": phase, "outcome": a2_outcome,
        "claim": {"holder": "agent-b", "attempt": format!("{NAME}#2"), "epoch": 2},
        "journalSeq": 12, "vm": "mb-ci-build-7-a2",
        "conditions": [vm_deleted()],
        "attempts": [
            {"number": 1, "id": format!("{NAME}#1"), "vm": "mb-ci-build-7-a1", "host": "agent-a"},
            {"number": 2, "id": format!("{NAME}#2"), "vm": "mb-ci-build-7-a2", "host": "agent-b",
             "outcome": a2_outcome, "reason": a2_reason, "finishedAt": "2026-10-05T02:53:00Z"},
        ],
    })
}

/// Control: a holder whose only attempts are its own, none admitted, says `none` (the point of
/// the change); admitted (a `startedAt`, or a host deadline), it says `deleted`. If this fails,
/// the finding below is moot.
#[test]
fn control_the_holders_own_unadmitted_attempts_read_none_and_admitted_ones_deleted() {
    let own = |started: Option<&str>, deadline: Option<&str>| {
        json!({
            "phase": "Cancelled", "outcome": "Cancelled", "deadline": deadline,
            "claim": {"holder": "agent-b", "attempt": format!("{NAME}#1"), "epoch": 1},
            "journalSeq": 12, "conditions": [vm_deleted()],
            "attempts": [{"number": 1, "id": format!("{NAME}#1"), "vm": "mb-ci-build-7-a1", "host": "agent-b",
                "outcome": "Cancelled", "reason": "CancelRequested", "startedAt": started,
                "finishedAt": "2026-10-05T02:53:00Z"}],
        })
    };
    for (what, status, want) in [
        ("never admitted", own(None, None), "none"),
        ("admitted", own(Some("2026-10-05T02:52:30Z"), None), "deleted"),
        ("host deadline only", own(None, Some("2026-10-05T03:52:30Z")), "deleted"),
    ] {
        let b = build_view(&macbuild(status, true));
        let p = decide(
            &run(true),
            Some(&b),
            Some(&lease("agent-b", at(20))),
            &Timing::default(),
            at(21),
        );
        assert_eq!(vm_retirement(&p), want, "{what}: {}", message(&p));
    }
}

/// The build was handed on from agent-a (unreachable, its attempt 1 admitted and its VM booting)
/// to agent-b, whose attempt 2 then ended before admission: cancelled by the pipeline, or its
/// claim unconfirmed and answered late, the run timing out. agent-b's `VMDeleted=True` confirms
/// nothing about agent-a's VM, which may still exist; the pipeline is told `none` ("no VM was
/// created"). It must hear at most `unconfirmed` (before this round it heard `deleted`, also
/// untrue). What gives it away: attempt 1 is another host's and not finished (no `finishedAt`,
/// no outcome).
#[test]
fn a_handed_on_build_listing_another_hosts_unfinished_attempt_never_reads_none() {
    let cancelled = macbuild(
        handed_on_status(Some("Cancelled"), "CancelRequested", "Cancelled"),
        true,
    );
    let unconfirmed = macbuild(handed_on_status(None, "ClaimUnconfirmed", "Pending"), true);
    let cases = [
        ("pipeline cancel, a2 cancelled", run(true), &cancelled, at(21)),
        ("run timed out, a2 claim unconfirmed", run(false), &unconfirmed, at(105)),
    ];
    for (what, r, mb, now) in cases {
        for trimmed in [false, true] {
            let mut mb = mb.clone();
            if trimmed {
                trim_macbuild(&mut mb);
            }
            let b = build_view(&mb);
            let p = decide(&r, Some(&b), Some(&lease("agent-b", now)), &Timing::default(), now);
            assert!(p.finished.is_some(), "{what}: the run ends ({})", message(&p));
            assert_ne!(
                vm_retirement(&p),
                "none",
                "{what} (trimmed: {trimmed}): agent-a's VM of attempt 1 may exist: {}",
                message(&p)
            );
        }
    }
}

/// One attempt of the generated lists: (number, admitted, outcome, reason).
type Spec = (u32, bool, Option<&'static str>, Option<&'static str>);

const KINDS: [(bool, Option<&str>, Option<&str>); 6] = [
    (false, None, None),
    (false, None, Some("ClaimUnconfirmed")),
    (true, None, Some("SlotFree")),
    (false, Some("Cancelled"), Some("CancelRequested")),
    (true, Some("Cancelled"), Some("CancelRequested")),
    (false, Some("Failed"), Some("StepFailed")),
];

fn attempt_json((n, started, outcome, reason): Spec) -> Value {
    json!({"number": n, "id": format!("{NAME}#{n}"), "vm": format!("mb-ci-build-7-a{n}"), "host": "agent-b",
        "outcome": outcome, "reason": reason, "message": format!("attempt {n} said something"),
        "startedAt": started.then_some("2026-10-05T02:52:30Z")})
}

/// Every list of up to four attempts over six kinds (admitted or not, each outcome, a reason or
/// none), numbered in order, reversed, or all the same number; with and without a `Succeeded`
/// condition and a host deadline: the trimmed MacBuild reads exactly as the full one
/// (`BuildView` equal, so `nothing_admitted` and the reason too), keeps at most two attempts, and
/// trimming again changes nothing.
#[test]
fn the_trimmed_macbuild_reads_the_same_for_every_short_attempt_list() {
    let mut lists: Vec<Vec<usize>> = vec![vec![]];
    for _ in 0..4 {
        let longer: Vec<Vec<usize>> = lists
            .iter()
            .filter(|l| l.len() == lists.last().map_or(0, Vec::len))
            .flat_map(|l| {
                (0..KINDS.len()).map(move |k| {
                    let mut l = l.clone();
                    l.push(k);
                    l
                })
            })
            .collect();
        lists.extend(longer);
    }
    assert_eq!(lists.len(), 1 + 6 + 36 + 216 + 1296);
    let mut checked = 0;
    let mut read_none = 0;
    for kinds in &lists {
        for numbering in 0..3 {
            let specs: Vec<Spec> = kinds
                .iter()
                .enumerate()
                .map(|(i, &k)| {
                    let n = match numbering {
                        0 => i as u32 + 1,
                        1 => (kinds.len() - i) as u32,
                        _ => 1,
                    };
                    (n, KINDS[k].0, KINDS[k].1, KINDS[k].2)
                })
                .collect();
            for succeeded in [false, true] {
                for deadline in [false, true] {
                    let mut conditions = vec![vm_deleted()];
                    if succeeded {
                        conditions.push(json!({"type": "Succeeded", "status": "False", "reason": "StepFailed",
                            "message": "m", "lastTransitionTime": "2026-10-05T02:53:00Z"}));
                    }
                    let status = json!({
                        "phase": "Failed", "outcome": "Failed",
                        "claim": {"holder": "agent-b", "attempt": format!("{NAME}#1"), "epoch": 1},
                        "deadline": deadline.then_some("2026-10-05T03:52:00Z"),
                        "conditions": conditions,
                        "attempts": specs.iter().map(|s| attempt_json(*s)).collect::<Vec<_>>(),
                    });
                    let full = macbuild(status, false);
                    let mut trimmed = full.clone();
                    trim_macbuild(&mut trimmed);
                    let what = format!("{specs:?}, succeeded {succeeded}, deadline {deadline}");
                    let view = build_view(&full);
                    assert_eq!(build_view(&trimmed), view, "{what}");
                    let kept = trimmed.status.as_ref().unwrap().attempts.clone();
                    assert!(kept.len() <= 2, "{what}: kept {kept:?}");
                    let mut again = trimmed.clone();
                    trim_macbuild(&mut again);
                    assert_eq!(again, trimmed, "{what}: trimming again changes nothing");
                    read_none += usize::from(view.nothing_admitted);
                    checked += 1;
                }
            }
        }
    }
    // The generator reaches both answers (a list with nothing admitted, and one with something).
    assert!(read_none > 0 && read_none < checked, "{read_none} of {checked}");
}

/// Hostile statuses: a deadline with no attempts, no attempts at all, an empty claim, a huge
/// attempt list with one admitted attempt buried in the middle (trimmed and not).
#[test]
fn odd_statuses_never_read_as_nothing_admitted_when_something_may_have_been() {
    let base = |attempts: Value, deadline: Option<&str>, claim: Value| {
        json!({"phase": "Cancelled", "outcome": "Cancelled", "claim": claim, "deadline": deadline,
            "conditions": [vm_deleted()], "attempts": attempts})
    };
    let claim = json!({"holder": "agent-b", "attempt": format!("{NAME}#1"), "epoch": 1});
    let mut huge: Vec<Value> = (1..=5000)
        .map(|n| attempt_json((n, false, Some("Cancelled"), Some("CancelRequested"))))
        .collect();
    huge[2500] = attempt_json((2501, true, None, Some("SlotFree")));
    let cases = [
        (
            "a host deadline and no attempts",
            base(json!([]), Some("2026-10-05T03:52:00Z"), claim.clone()),
        ),
        ("no attempts listed", base(json!([]), None, claim.clone())),
        (
            "one admitted attempt among 5,000",
            base(Value::Array(huge), None, claim.clone()),
        ),
    ];
    for (what, status) in cases {
        let full = macbuild(status, true);
        let mut trimmed = full.clone();
        trim_macbuild(&mut trimmed);
        for (view, which) in [(build_view(&full), "full"), (build_view(&trimmed), "trimmed")] {
            assert!(!view.nothing_admitted, "{what} ({which})");
            let p = decide(
                &run(true),
                Some(&view),
                Some(&lease("agent-b", at(20))),
                &Timing::default(),
                at(21),
            );
            assert_eq!(vm_retirement(&p), "deleted", "{what} ({which}): {}", message(&p));
        }
    }
    // An empty claim (holder ""): nobody confirms anything; unadmitted attempts listed or not,
    // the run is never told the holder confirmed that no VM was made.
    let empty = json!({"holder": "", "attempt": "", "epoch": 1});
    let listed = json!([attempt_json((1, false, Some("Cancelled"), Some("CancelRequested")))]);
    let view = build_view(&macbuild(base(listed, None, empty), true));
    assert_eq!(view.holder, None);
    let p = decide(
        &run(true),
        Some(&view),
        Some(&lease("agent-b", at(20))),
        &Timing::default(),
        at(21),
    );
    assert!(
        !message(&p).contains("never admitted the build"),
        "no holder confirmed anything: {}",
        message(&p)
    );
}
