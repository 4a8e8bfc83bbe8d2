//! The checker on hand-made worlds: a clean run passes, and each invariant is broken once.

use super::*;
use serde_json::json;
use tartan_agent::record::{BuildRef, RECORD_VERSION};

const V1: &str = "mb-ns-b1-00000001";
const V2: &str = "mb-ns-b1-00000002";

fn rec(seq: u64, uid: &str, attempt: u32, vm: &str, from: Option<AttemptState>, to: AttemptState) -> Record {
    Record {
        version: RECORD_VERSION,
        seq,
        time: Timestamp::from_second(1_800_000_000 + seq as i64).unwrap(),
        build: Some(BuildRef {
            namespace: "ns".into(),
            name: if uid == "u1" { "b1".into() } else { format!("b-{uid}") },
            uid: uid.into(),
        }),
        attempt: Some(attempt),
        vm: Some(vm.into()),
        from,
        to,
        reason: None,
        detail: String::new(),
        outcome: None,
        slot: None,
        deadline: None,
        max_attempts: None,
        step: None,
        generation: None,
        status: None,
        warm: None,
    }
}

/// One attempt's records from `Requested` to `Retired`, starting at `seq`.
fn attempt(seq: u64, uid: &str, n: u32, vm: &str, outcome: Outcome, reason: Reason) -> Vec<Record> {
    use AttemptState::*;
    let states = [Requested, Admitted, Booting, Running, Collecting, Retiring, Retired];
    let mut out = vec![];
    let mut prev = None;
    for (i, s) in states.into_iter().enumerate() {
        let mut r = rec(seq + i as u64, uid, n, vm, prev, s);
        if s != Requested {
            r.slot = Some(0);
        }
        if s == Admitted {
            r.reason = Some(Reason::SlotFree);
        }
        if s == Retiring {
            r.reason = Some(reason);
            r.outcome = Some(outcome);
            r.status = Some(json!({"phase": "Retiring", "results": RESULTS.clone()}));
        }
        if s == Retired {
            r.reason = Some(Reason::VMDeleted);
            let phase = match outcome {
                Outcome::Succeeded => "Succeeded",
                Outcome::Failed => "Failed",
                Outcome::Cancelled => "Cancelled",
                Outcome::Interrupted => "Pending",
            };
            r.status = Some(json!({"phase": phase, "results": RESULTS.clone()}));
        }
        prev = Some(s);
        out.push(r);
    }
    out
}

/// What each attempt of these worlds collects (as journaled in status snapshots).
static RESULTS: std::sync::LazyLock<Value> =
    std::sync::LazyLock::new(|| json!({"testsPassed": 2, "testsTotal": 2, "artifactUrl": "file:///a/App.ipa"}));

fn good() -> World {
    World {
        agents: vec![AgentFacts {
            id: "agent-a".into(),
            journal: attempt(1, "u1", 1, V1, Outcome::Succeeded, Reason::TestsPassed),
            watchdog: vec![],
            vms_left: vec!["base-image".into()],
        }],
        planted: vec![PlantedVm {
            agent: "agent-a".into(),
            vm: "base-image".into(),
            present: true,
        }],
        custom_runs: vec![json!({
            "metadata": {"name": "b1"},
            "spec": {"params": [{"name": "max-attempts", "value": "2"}]},
            "status": {
                "completionTime": "2027-01-15T08:00:30Z",
                "conditions": [{"type": "Succeeded", "status": "True", "reason": "TestsPassed", "message": ""}],
                "results": [{"name": "attempt", "value": "b1#1"}, {"name": "vmRetirement", "value": "deleted"},
                    {"name": "testsPassed", "value": "2"}, {"name": "testsTotal", "value": "2"},
                    {"name": "artifact", "value": "file:///a/App.ipa"}],
            },
        })],
        macbuilds: vec![json!({
            "metadata": {"name": "b1", "uid": "u1"},
            "spec": {"maxAttempts": 2},
            "status": {"phase": "Succeeded", "journalSeq": 7, "vm": V1, "attempts": [{"number": 1}]},
        })],
        leases: vec![json!({"spec": {"holderIdentity": "agent-a", "leaseDurationSeconds": 20}})],
        refused_terminal_status: false,
        delivery_blocked: Vec::new(),
    }
}

fn invariants_broken(world: &World) -> BTreeSet<u8> {
    check(world).iter().map(|v| v.invariant).collect()
}

#[track_caller]
fn assert_breaks(world: &World, invariant: u8) {
    let found = check(world);
    assert!(
        found.iter().any(|v| v.invariant == invariant),
        "expected a violation of invariant {invariant}, found {found:#?}"
    );
}

#[test]
fn a_clean_run_has_no_violation() {
    assert_eq!(check(&good()), vec![]);
}

#[test]
fn a_retry_after_interruption_is_clean() {
    let mut w = good();
    let mut j = attempt(1, "u1", 1, V2, Outcome::Interrupted, Reason::AgentRestarted);
    j.extend(attempt(8, "u1", 2, V1, Outcome::Succeeded, Reason::TestsPassed));
    w.agents[0].journal = j;
    w.macbuilds[0]["status"]["journalSeq"] = json!(14);
    w.macbuilds[0]["status"]["attempts"] = json!([{"number": 1}, {"number": 2}]);
    w.custom_runs[0]["status"]["results"][0]["value"] = json!("b1#2");
    assert_eq!(check(&w), vec![]);
}

#[test]
fn overlapping_admissions_break_1() {
    let mut w = good();
    let mut other = rec(
        4,
        "u2",
        1,
        "mb-ns-b2-1",
        Some(AttemptState::Requested),
        AttemptState::Admitted,
    );
    other.slot = Some(0);
    w.agents[0].journal.insert(3, other);
    assert_breaks(&w, 1);
}

#[test]
fn a_slot_released_without_confirmed_deletion_breaks_2() {
    let mut w = good();
    w.agents[0].journal[6].reason = Some(Reason::DeadlinePassed);
    assert_breaks(&w, 2);
    let mut w = good();
    w.agents[0].vms_left.push(V1.into());
    assert_breaks(&w, 2);
}

#[test]
fn a_leftover_vm_breaks_3() {
    let mut w = good();
    w.agents[0].vms_left.push("mb-ns-never-journaled".into());
    assert_eq!(invariants_broken(&w), [3].into());
    // Quarantined, but the MacBuild names another VM.
    let mut w = good();
    w.agents[0].journal[6].to = AttemptState::Quarantined;
    w.agents[0].journal[6].reason = Some(Reason::DeleteFailed);
    w.agents[0].vms_left.push(V1.into());
    w.macbuilds[0]["status"]["vm"] = json!(V2);
    assert_breaks(&w, 3);
}

#[test]
fn a_terminal_status_against_the_journal_breaks_4() {
    let mut w = good();
    w.agents[0].journal[5].outcome = Some(Outcome::Failed);
    assert_breaks(&w, 4);
    // Timed out with unconfirmed retirement while the lease was fresh.
    let mut w = good();
    w.custom_runs[0]["status"]["conditions"][0] = json!({"type": "Succeeded", "status": "False",
        "reason": "CustomRunTimedOut",
        "message": "MacBuild did not finish within timeout 10s + 45s grace; VM retirement unconfirmed: agent agent-a lease expired (last renewed 2027-01-15T08:00:25Z)"});
    w.custom_runs[0]["status"]["results"][1]["value"] = json!("unconfirmed");
    assert_eq!(invariants_broken(&w), [4].into());
    // The same, 25s after the last renewal: allowed.
    w.custom_runs[0]["status"]["completionTime"] = json!("2027-01-15T08:00:50Z");
    assert_eq!(check(&w), vec![]);
    // Unconfirmed with no word on the lease.
    w.custom_runs[0]["status"]["conditions"][0]["message"] = json!("timed out");
    assert_breaks(&w, 4);
}

#[test]
fn unconfirmed_with_a_live_lease_is_true_only_when_the_cluster_refused_the_confirmation() {
    let mut w = good();
    w.macbuilds[0]["status"]["journalSeq"] = json!(6);
    w.custom_runs[0]["status"]["conditions"][0] = json!({"type": "Succeeded", "status": "False",
        "reason": "CustomRunTimedOut",
        "message": "MacBuild did not finish within timeout 5s + 3s grace; VM retirement unconfirmed: agent agent-a lease is live (last renewed 2027-01-15T08:00:25Z) but has not confirmed the VM deleted"});
    w.custom_runs[0]["status"]["results"][1]["value"] = json!("unconfirmed");
    assert!(invariants_broken(&w).contains(&4));
    // The holder had not deleted the VM when the run ended (quarantined, deleted later): no
    // confirmation came, so `unconfirmed` is the truth.
    let mut quarantined = w.clone();
    for r in &mut quarantined.agents[0].journal {
        r.time = Timestamp::from_second(1_800_000_000 + 60 + r.seq as i64).unwrap();
    }
    quarantined.custom_runs[0]["status"]["completionTime"] = json!("2027-01-15T08:00:30Z");
    assert!(
        !invariants_broken(&quarantined).contains(&4),
        "{:#?}",
        check(&quarantined)
    );
    // A chaos run's window in which the agents' writes could not reach the cluster, from before
    // the deletion was journaled until the run ended: the confirmation was held up.
    let deleted_at = w.agents[0].journal.last().unwrap().time;
    let mut held_up = w.clone();
    held_up.delivery_blocked = vec![(
        deleted_at - k8s_openapi::jiff::SignedDuration::from_secs(1),
        deleted_at + k8s_openapi::jiff::SignedDuration::from_secs(60),
    )];
    assert!(!invariants_broken(&held_up).contains(&4), "{:#?}", check(&held_up));
    // The deletion journaled 2 s before the run ended: its confirmation may still have been on
    // its way to the controller (seen at 50 hosts); 10 s before, the controller had it.
    let mut in_flight = w.clone();
    let ended = |after: i64| json!((deleted_at + k8s_openapi::jiff::SignedDuration::from_secs(after)).to_string());
    in_flight.custom_runs[0]["status"]["completionTime"] = ended(2);
    assert!(!invariants_broken(&in_flight).contains(&4), "{:#?}", check(&in_flight));
    in_flight.custom_runs[0]["status"]["completionTime"] = ended(10);
    assert!(invariants_broken(&in_flight).contains(&4));
    // A window long over before the deletion explains nothing.
    let mut stale = w.clone();
    stale.delivery_blocked = vec![(
        deleted_at - k8s_openapi::jiff::SignedDuration::from_secs(600),
        deleted_at - k8s_openapi::jiff::SignedDuration::from_secs(300),
    )];
    assert!(invariants_broken(&stale).contains(&4));
    w.refused_terminal_status = true;
    assert_eq!(check(&w), vec![]);
}

#[test]
fn a_timeout_says_deleted_only_when_a_deletion_was_journaled_before_it() {
    let mut w = good();
    w.custom_runs[0]["status"]["conditions"][0] = json!({"type": "Succeeded", "status": "False",
        "reason": "CustomRunTimedOut",
        "message": "MacBuild did not finish within timeout 5s; agent agent-a cancelled it and confirmed its VM deleted"});
    w.custom_runs[0]["status"]["completionTime"] = json!("2027-01-15T09:00:00Z");
    assert!(!invariants_broken(&w).contains(&4), "{:#?}", check(&w));
    // The journal confirms no deletion before the run ended: `deleted` is a lie.
    w.custom_runs[0]["status"]["completionTime"] = json!("2027-01-15T07:00:00Z");
    assert!(invariants_broken(&w).contains(&4));
}

/// Seen at 20 hosts: a host still trying to claim attempt 1 when the MacBuild was deleted
/// journals its claim `Cancelled` (nothing cloned) while the host that won it retried after an
/// interruption. The attempt's outcome is its holder's, not a losing claimer's.
#[test]
fn a_losing_claimers_cancelled_claim_is_not_the_attempts_outcome() {
    use AttemptState::*;
    let mut w = good();
    let mut j = attempt(1, "u1", 1, V2, Outcome::Interrupted, Reason::AgentRestarted);
    j.extend(attempt(8, "u1", 2, V1, Outcome::Succeeded, Reason::TestsPassed));
    w.agents[0].journal = j;
    w.macbuilds[0]["status"]["journalSeq"] = json!(14);
    w.macbuilds[0]["status"]["attempts"] = json!([{"number": 1}, {"number": 2}]);
    w.custom_runs[0]["status"]["results"][0]["value"] = json!("b1#2");
    let mut gave_up = rec(2, "u1", 1, V2, Some(Requested), Retired);
    gave_up.reason = Some(Reason::CancelRequested);
    gave_up.outcome = Some(Outcome::Cancelled);
    let claimer = AgentFacts {
        id: "agent-0".into(),
        journal: vec![rec(1, "u1", 1, V2, None, Requested), gave_up],
        watchdog: vec![],
        vms_left: vec![],
    };
    w.agents.insert(0, claimer);
    w.leases
        .push(json!({"spec": {"holderIdentity": "agent-0", "leaseDurationSeconds": 20}}));
    assert_eq!(check(&w), vec![]);
}

/// Seen at 20 hosts (seed 2901): a host still claiming a build when the controller deleted its
/// finished MacBuild journals its claim `Cancelled`; the run's outcome is its holder's.
#[test]
fn a_losing_claimers_cancelled_claim_is_not_the_builds_outcome() {
    use AttemptState::*;
    let mut w = good();
    let mut gave_up = rec(20, "u1", 1, V1, Some(Requested), Retired);
    gave_up.reason = Some(Reason::CancelRequested);
    gave_up.outcome = Some(Outcome::Cancelled);
    w.agents.push(AgentFacts {
        id: "agent-b".into(),
        journal: vec![rec(19, "u1", 1, V1, None, Requested), gave_up],
        watchdog: vec![],
        vms_left: vec![],
    });
    w.leases
        .push(json!({"spec": {"holderIdentity": "agent-b", "leaseDurationSeconds": 20}}));
    assert_eq!(check(&w), vec![]);
}

/// chaos-fleet seed 2901: a run ended `CustomRunTimedOut` with `vmRetirement=none` and no
/// attempt (its MacBuild deleted, nothing in its status naming a holder) although a host had
/// admitted and run the build. `none` says no VM was ever created: a lie, invariant 4.
#[test]
fn vm_retirement_none_for_a_build_a_host_admitted_breaks_4() {
    let mut w = good();
    w.macbuilds.clear();
    w.custom_runs[0]["status"]["conditions"][0] = json!({"type": "Succeeded", "status": "False",
        "reason": "CustomRunTimedOut",
        "message": "MacBuild did not finish within timeout 19s; MacBuild ns/b1 is gone"});
    w.custom_runs[0]["status"]["results"] = json!([{"name": "attempt", "value": ""},
        {"name": "vmRetirement", "value": "none"}]);
    assert_breaks(&w, 4);
    // Admitted only after the run ended: not this run's claim to make (the checker cannot
    // tell), so not flagged here.
    w.custom_runs[0]["status"]["completionTime"] = json!("2027-01-15T07:00:00Z");
    assert!(!invariants_broken(&w).contains(&4), "{:#?}", check(&w));
}

/// chaos-fleet seed 2901 (chaos-427): the controller deleted an unclaimed MacBuild at its
/// timeout (fenced on its resourceVersion) while a host, on a stale watch, was starting to claim
/// it; the host journaled its claim ended, nothing cloned. The run's `vmRetirement=none` and
/// empty attempt are the truth, not an undelivered result.
#[test]
fn a_claim_that_never_got_to_admission_is_not_a_result_the_run_owes() {
    use AttemptState::*;
    let mut w = good();
    let mut gave_up = rec(2, "u1", 1, V1, Some(Requested), Retired);
    gave_up.reason = Some(Reason::CancelRequested);
    gave_up.outcome = Some(Outcome::Cancelled);
    gave_up.detail = "MacBuild deleted before admission; nothing cloned".into();
    gave_up.status = Some(json!({"phase": "Cancelled", "claim": {"holder": "agent-a", "attempt": "b1#1", "epoch": 1}}));
    w.agents[0].journal = vec![rec(1, "u1", 1, V1, None, Requested), gave_up];
    w.macbuilds.clear();
    w.custom_runs[0]["status"]["conditions"][0] = json!({"type": "Succeeded", "status": "False",
        "reason": "CustomRunTimedOut",
        "message": "no Mac host claimed MacBuild ns/b1 within timeout 18s; no VM was created and the MacBuild is deleted"});
    w.custom_runs[0]["status"]["results"] = json!([{"name": "attempt", "value": ""},
        {"name": "vmRetirement", "value": "none"}]);
    assert_eq!(check(&w), vec![]);
    // Had the host admitted it, the same run would lie (invariants 4 and 6).
    w.agents[0].journal = attempt(1, "u1", 1, V1, Outcome::Cancelled, Reason::CancelRequested);
    assert_breaks(&w, 4);
    assert_breaks(&w, 6);
}

/// chaos-fleet seed 81043 (chaos-2928): attempt 1 was interrupted by an agent restart and its VM
/// deleted; the retry was journaled, and the run cancelled before its claim was written, so it
/// ended nothing cloned. The controller ended the run on attempt 1's deleted VM: naming the last
/// attempt that ran is the truth. Had the retry been admitted, the same run would lie.
#[test]
fn a_run_ended_before_its_retry_was_admitted_names_the_attempt_that_ran() {
    use AttemptState::*;
    let mut w = good();
    let mut j = attempt(1, "u1", 1, V1, Outcome::Interrupted, Reason::AgentRestarted);
    j.push(rec(8, "u1", 2, V2, None, Requested));
    let mut gave_up = rec(9, "u1", 2, V2, Some(Requested), Retired);
    gave_up.reason = Some(Reason::CancelRequested);
    gave_up.outcome = Some(Outcome::Cancelled);
    gave_up.detail = "cancel requested before admission; nothing cloned".into();
    gave_up.status = Some(json!({"phase": "Cancelled", "claim": {"holder": "agent-a", "attempt": "b1#2", "epoch": 1}}));
    j.push(gave_up);
    w.agents[0].journal = j;
    w.macbuilds[0]["status"] = json!({"phase": "Cancelled", "journalSeq": 9, "vm": V1, "attempts": [{"number": 1}]});
    w.custom_runs[0]["status"]["conditions"][0] = json!({"type": "Succeeded", "status": "False",
        "reason": "CustomRunCancelled", "message": "MacBuild ns/b1 cancelled; agent agent-a deleted its VM"});
    w.custom_runs[0]["status"]["results"][0]["value"] = json!("b1#1");
    assert_eq!(check(&w), vec![]);
    // The retry admitted: the run names an attempt that did not end the build.
    let mut admitted = w.clone();
    let mut j = attempt(1, "u1", 1, V1, Outcome::Interrupted, Reason::AgentRestarted);
    j.extend(attempt(8, "u1", 2, V2, Outcome::Cancelled, Reason::CancelRequested));
    admitted.agents[0].journal = j;
    admitted.macbuilds[0]["status"]["journalSeq"] = json!(14);
    assert_breaks(&admitted, 6);
    // Even were its end journaled as a withdrawn claim's, with the admission on record.
    for r in &mut admitted.agents[0].journal {
        if r.attempt == Some(2) && r.to == AttemptState::Retired {
            (r.reason, r.outcome) = (Some(Reason::CancelRequested), Some(Outcome::Cancelled));
        }
    }
    assert_breaks(&admitted, 6);
    // Attempt 1 failed rather than interrupted: no retry follows it, and the run is not cancelled.
    let mut failed = w.clone();
    for r in &mut failed.agents[0].journal {
        if r.outcome == Some(Outcome::Interrupted) {
            r.outcome = Some(Outcome::Failed);
        }
    }
    assert_breaks(&failed, 6);
    // A run that says the build failed, or names an attempt two back, is not this case.
    let mut not_cancelled = w.clone();
    not_cancelled.custom_runs[0]["status"]["conditions"][0]["reason"] = json!("AgentRestarted");
    assert_breaks(&not_cancelled, 6);
    let mut two_back = w.clone();
    for r in &mut two_back.agents[0].journal {
        if r.attempt == Some(2) {
            r.attempt = Some(3);
        }
    }
    assert_breaks(&two_back, 6);
    // The withdrawn retry on another host (a hand-over): attempt 1's host never spoke for it.
    let mut handed_over = w.clone();
    let retry: Vec<Record> = handed_over.agents[0].journal.split_off(7);
    handed_over.agents.push(AgentFacts {
        id: "agent-b".into(),
        journal: retry,
        watchdog: vec![],
        vms_left: vec![],
    });
    assert_breaks(&handed_over, 6);
    // `deleted` with no deletion of attempt 1 journaled is not the truth.
    let mut undeleted = w;
    undeleted.agents[0]
        .journal
        .retain(|r| r.to != AttemptState::Retired || r.attempt == Some(2));
    assert_breaks(&undeleted, 6);
}

#[test]
fn too_many_attempts_or_a_retry_after_failure_break_5() {
    let mut w = good();
    let mut j = attempt(1, "u1", 1, V2, Outcome::Failed, Reason::StepFailed);
    j.extend(attempt(8, "u1", 2, V1, Outcome::Succeeded, Reason::TestsPassed));
    w.agents[0].journal = j;
    assert_breaks(&w, 5);
    let mut w = good();
    let mut j = attempt(1, "u1", 1, V2, Outcome::Interrupted, Reason::AgentRestarted);
    j.extend(attempt(8, "u1", 2, V1, Outcome::Succeeded, Reason::TestsPassed));
    w.agents[0].journal = j;
    w.macbuilds[0]["spec"]["maxAttempts"] = json!(1);
    assert_breaks(&w, 5);
}

#[test]
fn an_undelivered_or_doubled_result_breaks_6() {
    let mut w = good();
    w.macbuilds[0]["status"]["journalSeq"] = json!(6);
    w.macbuilds[0]["status"]["phase"] = json!("Collecting");
    assert_breaks(&w, 6);
    let mut w = good();
    w.macbuilds[0]["status"]["attempts"] = json!([{"number": 1}, {"number": 1}]);
    assert_breaks(&w, 6);
    let mut w = good();
    w.macbuilds.clear();
    w.custom_runs[0]["status"]["conditions"][0]["status"] = json!("Unknown");
    assert_breaks(&w, 6);
}

#[test]
fn deleting_a_foreign_vm_breaks_7() {
    let mut w = good();
    w.planted[0].present = false;
    w.agents[0].vms_left.clear();
    assert_eq!(invariants_broken(&w), [7].into());
    let mut w = good();
    w.agents[0].watchdog.push(Line {
        time: "2027-01-15T08:00:20Z".into(),
        vm: "mb-someone-elses".into(),
        deadline: None,
        action: Action::Deleted,
        detail: String::new(),
    });
    assert_breaks(&w, 7);
}

#[test]
fn an_undelivered_result_of_a_timed_out_run_breaks_6_unless_the_cluster_refused_it() {
    let mut w = good();
    w.macbuilds[0]["status"]["journalSeq"] = json!(6);
    w.macbuilds[0]["status"]["phase"] = json!("Retiring");
    w.custom_runs[0]["status"]["conditions"][0] = json!({"type": "Succeeded", "status": "False",
        "reason": "CustomRunTimedOut", "message": "MacBuild did not finish within timeout 5s"});
    // (`vmRetirement` stays `deleted`, journaled before the end: `none` would be a lie of its own.)
    // A timeout alone does not excuse an undelivered result.
    assert_eq!(invariants_broken(&w), [6].into());
    // Refused past the deadline (invariant 6's exception): the timeout stands.
    w.refused_terminal_status = true;
    assert_eq!(check(&w), vec![]);
}

#[test]
fn results_other_than_those_journaled_at_retiring_break_8() {
    // Issue 11 defect 1: the restarted agent resolves the quarantine with empty results and the
    // CustomRun shows them.
    let mut w = good();
    let retired = w.agents[0].journal.last_mut().unwrap();
    retired.from = Some(AttemptState::Quarantined);
    retired.reason = Some(Reason::Resolved);
    retired.status = Some(json!({"phase": "Succeeded", "results": {}}));
    for n in ["testsPassed", "testsTotal", "artifact"] {
        let results = w.custom_runs[0]["status"]["results"].as_array_mut().unwrap();
        results.iter_mut().find(|r| r["name"] == n).unwrap()["value"] = json!("");
    }
    assert_eq!(invariants_broken(&w), [8].into());
    // One count off is as wrong.
    let mut w = good();
    w.custom_runs[0]["status"]["results"][2]["value"] = json!("1");
    assert_eq!(invariants_broken(&w), [8].into());
    // A timed-out run never got the result: nothing to compare.
    w.custom_runs[0]["status"]["conditions"][0]["reason"] = json!("CustomRunTimedOut");
    w.custom_runs[0]["status"]["conditions"][0]["status"] = json!("False");
    w.custom_runs[0]["status"]["results"][1]["value"] = json!("none");
    assert!(!invariants_broken(&w).contains(&8));
}

#[test]
fn a_finished_attempt_admitted_again_breaks_9() {
    // Issue 11 defect 3: 34 ms after `Retired`, the same attempt is claimed, admitted and cloned.
    use AttemptState::*;
    let mut w = good();
    let again = [Requested, Admitted, Booting];
    let mut prev = None;
    for (i, s) in again.into_iter().enumerate() {
        let mut r = rec(8 + i as u64, "u1", 1, V1, prev, s);
        if s != Requested {
            r.slot = Some(0);
        }
        prev = Some(s);
        w.agents[0].journal.push(r);
    }
    let found = check(&w);
    let nine: Vec<&Violation> = found.iter().filter(|v| v.invariant == 9).collect();
    assert_eq!(
        nine.len(),
        2,
        "the attempt admitted twice and the VM cloned twice: {found:#?}"
    );
    assert!(nine[0].message.contains("b1#1 admitted 2 times"), "{}", nine[0]);
    assert!(
        nine[1].message.contains(&format!("VM {V1} cloned 2 times")),
        "{}",
        nine[1]
    );
    // Across agents too: another host admitting the same attempt.
    let mut w = good();
    w.agents.push(AgentFacts {
        id: "agent-b".into(),
        journal: attempt(1, "u1", 1, V1, Outcome::Succeeded, Reason::TestsPassed),
        watchdog: vec![],
        vms_left: vec![],
    });
    assert!(invariants_broken(&w).contains(&9));
}

#[test]
fn a_stale_holders_fenced_out_result_is_not_owed_to_the_cluster() {
    // agent-a holds the build (the MacBuild shows its claim and its result); agent-z held it
    // before a hand-over and ran its copy to the end later: its writes were refused by the fence.
    let mut w = good();
    w.macbuilds[0]["status"]["claim"] = json!({"holder": "agent-a", "attempt": "b1#1", "epoch": 1});
    let mut stale = attempt(20, "u1", 1, V2, Outcome::Succeeded, Reason::TestsPassed);
    for r in stale.iter_mut().filter(|r| r.status.is_some()) {
        r.status.as_mut().unwrap()["claim"] = json!({"holder": "agent-z", "attempt": "b1#1", "epoch": 1});
    }
    w.agents.push(AgentFacts {
        id: "agent-z".into(),
        journal: stale.clone(),
        watchdog: vec![],
        vms_left: vec![],
    });
    assert!(!invariants_broken(&w).contains(&6), "{:#?}", check(&w));
    // Without the hand-over (its snapshots claim nothing), the same late result is owed.
    for r in stale.iter_mut().filter(|r| r.status.is_some()) {
        r.status.as_mut().unwrap()["claim"] = Value::Null;
    }
    w.agents[1].journal = stale;
    assert_breaks(&w, 6);
}

#[test]
fn a_resume_or_detach_in_admitted_is_not_a_second_admission() {
    // An agent stopped right after admitting (issue 13): `Admitted -> Admitted (Detached)`, then
    // `(Resumed)` at its next start; the attempt was admitted once.
    use AttemptState::*;
    let mut w = good();
    let journal = &mut w.agents[0].journal;
    let admitted = journal.iter().position(|r| r.to == Admitted).expect("an admission");
    for (i, reason) in [Reason::Detached, Reason::Resumed].into_iter().enumerate() {
        let mut r = rec(100 + i as u64, "u1", 1, V1, Some(Admitted), Admitted);
        r.reason = Some(reason);
        r.slot = Some(0);
        journal.insert(admitted + 1 + i, r);
    }
    assert!(!invariants_broken(&w).contains(&9), "{:#?}", check(&w));
}

#[test]
fn once_the_macbuild_is_gone_the_result_owed_is_the_latest_claims_not_a_stale_holders() {
    // agent-z ran attempt 1 (epoch 1) and lost the build to agent-a, which ran attempt 2 (epoch 2)
    // to the end; agent-z, cut off, ended its copy later. The run was deleted afterwards and took
    // the MacBuild with it: what the run said is agent-a's result, whichever agent is listed last.
    let claimed = |records: &mut Vec<Record>, holder: &str, n: u32| {
        for r in records.iter_mut().filter(|r| r.status.is_some()) {
            r.status.as_mut().unwrap()["claim"] = json!({"holder": holder, "attempt": format!("b1#{n}"), "epoch": n});
        }
    };
    let mut current = attempt(1, "u1", 2, V2, Outcome::Succeeded, Reason::TestsPassed);
    claimed(&mut current, "agent-a", 2);
    let mut stale = attempt(20, "u1", 1, V1, Outcome::Failed, Reason::StepFailed);
    claimed(&mut stale, "agent-z", 1);
    let mut w = good();
    w.agents[0].journal = current;
    w.agents.push(AgentFacts {
        id: "agent-z".into(),
        journal: stale,
        watchdog: vec![],
        vms_left: vec![],
    });
    w.macbuilds.clear();
    w.custom_runs[0]["status"]["results"][0]["value"] = json!("b1#2");
    assert!(!invariants_broken(&w).contains(&6), "{:#?}", check(&w));
    // Listed the other way round, the same.
    w.agents.reverse();
    assert!(!invariants_broken(&w).contains(&6), "{:#?}", check(&w));
    // A run naming the stale holder's attempt tells what the cluster never took.
    w.custom_runs[0]["status"]["results"][0]["value"] = json!("b1#1");
    assert_breaks(&w, 6);
}
