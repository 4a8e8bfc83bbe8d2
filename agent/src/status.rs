//! The MacBuild status an agent reports after each journaled transition (pure).
//!
//! The journal is the truth; this turns "the previous status + the record just synced" into the
//! next status snapshot. Terminal records carry the snapshot in the journal so that recovery can
//! submit it again without recomputing anything.

use crate::machine::Attempt;
use crate::record::Record;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use tartan_api::{
    AttemptRecord, AttemptState, BuildResults, Claim, Condition, ConditionReason, ConditionStatus, ConditionType,
    MacBuildStatus, Outcome, Phase, Reason, attempt_id,
};

/// Who reports, and what is known beyond the record itself.
#[derive(Clone, Debug)]
pub struct Reporter<'a> {
    /// This agent's id: `claim.holder` and each attempt's `host`.
    pub holder: &'a str,
    /// The claim epoch the agent holds (see `tartan_api::Claim`).
    pub epoch: u64,
    /// Results gathered at `Collecting` (test counts, artifact URL), if any.
    pub results: Option<&'a BuildResults>,
    /// Whether another attempt will follow an interrupted one (decided by `machine::decide_retry`).
    pub retry_follows: bool,
    /// The MacBuild generation the agent acted on.
    pub generation: Option<i64>,
    /// Where the attempt's step logs are shipped, once shipping started (`status.logs`).
    pub logs: Option<&'a str>,
}

/// Whether a record's snapshot belongs in the journal: the records recovery may have to deliver
/// again (the outcome is fixed from `Retiring` on).
pub fn snapshot_is_journaled(record: &Record) -> bool {
    matches!(
        record.to,
        AttemptState::Retiring | AttemptState::Retired | AttemptState::Quarantined
    )
}

/// The status after `record` (already folded into `attempt`), starting from `previous`.
pub fn next_status(
    previous: &MacBuildStatus,
    attempt: &Attempt,
    record: &Record,
    who: &Reporter<'_>,
) -> MacBuildStatus {
    let mut status = previous.clone();
    let now = record.time;
    let id = attempt_id(&attempt.build.name, attempt.number);
    let new_attempt = status.claim.as_ref().is_none_or(|c| c.attempt != id);

    status.claim = Some(Claim {
        holder: who.holder.to_string(),
        attempt: id.clone(),
        epoch: who.epoch,
    });
    status.phase = Some(Phase::for_attempt(record.to, attempt.outcome, who.retry_follows));
    status.outcome = attempt.outcome;
    status.journal_seq = Some(record.seq);
    status.vm = Some(attempt.vm.clone());
    status.deadline = attempt.deadline.map(Time);
    // The results journaled when the outcome was fixed (entering `Retiring`) are the attempt's
    // until it is retired: a later record (the delete's retry, or recovery's fresh executor that
    // gathered nothing) never replaces them.
    let outcome_fixed_earlier = matches!(record.from, Some(AttemptState::Retiring | AttemptState::Quarantined));
    if new_attempt {
        status.results = who.results.cloned();
    } else if let Some(results) = who.results
        && !outcome_fixed_earlier
    {
        status.results = Some(results.clone());
    }

    // A new attempt ships under its own folder; an executor that has not started shipping yet
    // (after a restart) leaves the attempt's known location as it is.
    if new_attempt || who.logs.is_some() {
        status.logs = who.logs.map(str::to_string);
    }

    let entry = match status.attempts.iter().position(|a| a.number == attempt.number) {
        Some(i) => &mut status.attempts[i],
        None => {
            status.attempts.push(AttemptRecord {
                number: attempt.number,
                id,
                vm: attempt.vm.clone(),
                host: who.holder.to_string(),
                outcome: None,
                reason: None,
                started_at: None,
                finished_at: None,
                message: None,
            });
            status.attempts.last_mut().expect("just pushed")
        }
    };
    // An adopting attempt's VM is the warm one from its admission on.
    entry.vm.clone_from(&attempt.vm);
    if record.to == AttemptState::Admitted && entry.started_at.is_none() {
        entry.started_at = Some(Time(now));
    }
    if entry.outcome.is_none() && attempt.outcome.is_some() {
        entry.outcome = attempt.outcome;
        entry.reason = attempt.reason;
    }
    if record.to == AttemptState::Retired {
        entry.finished_at = Some(Time(now));
    }
    // Once the outcome is fixed, the attempt's message says why it ended (the deletion that
    // follows is in the VMDeleted condition).
    match &attempt.cause {
        Some(cause) if attempt.outcome.is_some() => entry.message = Some(cause.clone()),
        _ if !record.detail.is_empty() => entry.message = Some(record.detail.clone()),
        _ => {}
    }
    // The reason recorded with the outcome (e.g. TestsPassed), not the latest one (VMDeleted).
    let outcome_reason = entry.reason;

    for condition in conditions_for(attempt, outcome_reason, record, who) {
        let condition = match who.generation {
            Some(g) => condition.observed(g),
            None => condition,
        };
        status.set_condition(condition);
    }
    status.message = Some(message_for(attempt, record, who));
    status
}

fn conditions_for(
    attempt: &Attempt,
    outcome_reason: Option<Reason>,
    record: &Record,
    who: &Reporter<'_>,
) -> Vec<Condition> {
    let now = record.time;
    let state_reason = ConditionReason::from(record.to);
    let detail = record.detail.clone();
    let mut out = Vec::new();

    let claimed = match record.to {
        AttemptState::Requested => Condition::new(
            ConditionType::Claimed,
            ConditionStatus::True,
            state_reason,
            format!("claimed by {}; waiting for a slot", who.holder),
            now,
        ),
        _ if record.reason == Some(Reason::SlotFree) => Condition::new(
            ConditionType::Claimed,
            ConditionStatus::True,
            Reason::SlotFree,
            detail.clone(),
            now,
        ),
        _ => Condition::new(
            ConditionType::Claimed,
            ConditionStatus::True,
            ConditionReason::SlotFree,
            format!("held by {}", who.holder),
            now,
        ),
    };
    // Only (re)write `Claimed` when it says something new: admission or a new request.
    if matches!(record.to, AttemptState::Requested | AttemptState::Admitted) {
        out.push(claimed);
    }

    out.push(match record.to {
        // `Adopted`: the build started in a warm VM of the pool (the detail names it).
        AttemptState::Running if matches!(record.reason, Some(Reason::GuestReady | Reason::Adopted)) => Condition::new(
            ConditionType::VMReady,
            ConditionStatus::True,
            record.reason.unwrap_or(Reason::GuestReady),
            detail.clone(),
            now,
        ),
        AttemptState::Running | AttemptState::Collecting => Condition::new(
            ConditionType::VMReady,
            ConditionStatus::True,
            Reason::GuestReady,
            "guest answers tart exec",
            now,
        ),
        AttemptState::Requested | AttemptState::Admitted | AttemptState::Booting => Condition::new(
            ConditionType::VMReady,
            ConditionStatus::Unknown,
            state_reason,
            "the guest has not answered yet",
            now,
        ),
        _ => Condition::new(
            ConditionType::VMReady,
            ConditionStatus::False,
            state_reason,
            format!("attempt {} is {}", attempt.number, record.to),
            now,
        ),
    });

    out.push(match record.to {
        AttemptState::Retired => Condition::new(
            ConditionType::VMDeleted,
            ConditionStatus::True,
            record.reason.map(ConditionReason::from).unwrap_or(state_reason),
            detail.clone(),
            now,
        ),
        AttemptState::Quarantined => Condition::new(
            ConditionType::VMDeleted,
            ConditionStatus::False,
            record.reason.map(ConditionReason::from).unwrap_or(state_reason),
            format!("VM {} is quarantined: {detail}", attempt.vm),
            now,
        ),
        _ => Condition::new(
            ConditionType::VMDeleted,
            ConditionStatus::False,
            state_reason,
            format!("VM {} exists or may exist", attempt.vm),
            now,
        ),
    });

    let terminal = record.to == AttemptState::Retired && !who.retry_follows;
    out.push(match (terminal, attempt.outcome) {
        (true, Some(Outcome::Succeeded)) => Condition::new(
            ConditionType::Succeeded,
            ConditionStatus::True,
            outcome_reason
                .map(ConditionReason::from)
                .unwrap_or(ConditionReason::TestsPassed),
            format!("attempt {} succeeded", attempt.number),
            now,
        ),
        (true, Some(outcome)) => Condition::new(
            ConditionType::Succeeded,
            ConditionStatus::False,
            match (outcome, outcome_reason) {
                (Outcome::Interrupted, _) => ConditionReason::AttemptsExhausted,
                (_, Some(reason)) => ConditionReason::from(reason),
                (_, None) => ConditionReason::from(record.to),
            },
            format!("attempt {} ended {outcome}", attempt.number),
            now,
        ),
        _ => Condition::new(
            ConditionType::Succeeded,
            ConditionStatus::Unknown,
            state_reason,
            format!("attempt {} is {}", attempt.number, record.to),
            now,
        ),
    });
    out
}

fn message_for(attempt: &Attempt, record: &Record, who: &Reporter<'_>) -> String {
    match record.to {
        AttemptState::Quarantined => format!(
            "attempt {} not confirmed stopped; its VM {} is quarantined",
            attempt.number, attempt.vm
        ),
        AttemptState::Retired if who.retry_follows => format!(
            "attempt {} ended {}; attempt {} follows",
            attempt.number,
            attempt.outcome.map(|o| o.as_str()).unwrap_or("without outcome"),
            attempt.number + 1
        ),
        // The pipeline's answer to "why": the CustomRun's message is built from this one.
        AttemptState::Retiring | AttemptState::Retired => match (attempt.outcome, &attempt.cause) {
            (Some(outcome), Some(cause)) => {
                let mut m = format!(
                    "attempt {} {}: {cause}",
                    attempt.number,
                    outcome.as_str().to_lowercase()
                );
                // Why no retry follows an interrupted attempt is said by the record that retires it.
                if record.to == AttemptState::Retired && outcome == Outcome::Interrupted && !record.detail.is_empty() {
                    m = format!("{m}; {}", record.detail);
                }
                m
            }
            _ => record.to_string(),
        },
        _ => record.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{BuildRef, RECORD_VERSION};
    use k8s_openapi::jiff::Timestamp;

    fn build() -> BuildRef {
        BuildRef {
            namespace: "ci".into(),
            name: "build-42".into(),
            uid: "u1".into(),
        }
    }

    fn rec(seq: u64, attempt: u32, from: Option<AttemptState>, to: AttemptState, reason: Option<Reason>) -> Record {
        Record {
            version: RECORD_VERSION,
            seq,
            time: Timestamp::from_second(1_780_000_000 + seq as i64).unwrap(),
            build: Some(build()),
            attempt: Some(attempt),
            vm: Some(format!("mb-ci-build-42-0000000{attempt}")),
            from,
            to,
            reason,
            detail: format!("detail {seq}"),
            outcome: None,
            slot: Some(0),
            deadline: None,
            max_attempts: None,
            step: None,
            generation: None,
            status: None,
            warm: None,
        }
    }

    fn who(results: Option<&BuildResults>, retry_follows: bool) -> Reporter<'_> {
        Reporter {
            holder: "mac-mini-07",
            epoch: 1,
            results,
            retry_follows,
            generation: Some(1),
            logs: None,
        }
    }

    /// Folds records through `Attempt::observe` and `next_status`, as the runtime does.
    fn run(records: &[Record], who: &Reporter<'_>) -> (Attempt, MacBuildStatus) {
        let mut attempt = Attempt::from_record(&records[0], 2).unwrap();
        let mut status = MacBuildStatus::default();
        for r in records {
            attempt.observe(r);
            status = next_status(&status, &attempt, r, who);
        }
        (attempt, status)
    }

    fn condition(s: &MacBuildStatus, t: ConditionType) -> (ConditionStatus, ConditionReason) {
        let c = s.condition(t).unwrap_or_else(|| panic!("no {t} condition in {s:?}"));
        (c.status, c.reason)
    }

    fn happy(outcome_reason: Reason, outcome: Outcome) -> Vec<Record> {
        use AttemptState::*;
        let mut retiring = rec(6, 1, Some(Collecting), Retiring, Some(outcome_reason));
        retiring.outcome = Some(outcome);
        vec![
            rec(1, 1, None, Requested, None),
            rec(2, 1, Some(Requested), Admitted, Some(Reason::SlotFree)),
            rec(3, 1, Some(Admitted), Booting, None),
            rec(4, 1, Some(Booting), Running, Some(Reason::GuestReady)),
            rec(5, 1, Some(Running), Collecting, None),
            retiring,
            rec(7, 1, Some(Retiring), Retired, Some(Reason::VMDeleted)),
        ]
    }

    #[test]
    fn succeeded_build_is_terminal_only_once_the_vm_is_deleted() {
        let results = BuildResults {
            tests_passed: Some(2),
            tests_total: Some(2),
            artifact_url: Some("s3://a/b".into()),
        };
        let records = happy(Reason::TestsPassed, Outcome::Succeeded);
        let (_, at_retiring) = run(&records[..6], &who(Some(&results), false));
        assert_eq!(at_retiring.phase, Some(Phase::Retiring));
        assert_eq!(
            condition(&at_retiring, ConditionType::VMDeleted).0,
            ConditionStatus::False
        );
        assert_eq!(
            condition(&at_retiring, ConditionType::Succeeded).0,
            ConditionStatus::Unknown
        );

        let (_, done) = run(&records, &who(Some(&results), false));
        assert_eq!(done.phase, Some(Phase::Succeeded));
        assert_eq!(done.outcome, Some(Outcome::Succeeded));
        assert_eq!(done.journal_seq, Some(7));
        assert_eq!(
            condition(&done, ConditionType::VMDeleted),
            (ConditionStatus::True, ConditionReason::VMDeleted)
        );
        assert_eq!(
            condition(&done, ConditionType::Succeeded),
            (ConditionStatus::True, ConditionReason::TestsPassed)
        );
        assert_eq!(done.results, Some(results));
        let claim = done.claim.unwrap();
        assert_eq!(
            (claim.holder.as_str(), claim.attempt.as_str()),
            ("mac-mini-07", "build-42#1")
        );
        let a = &done.attempts[0];
        assert_eq!(
            (a.outcome, a.reason),
            (Some(Outcome::Succeeded), Some(Reason::TestsPassed))
        );
        assert!(a.started_at.is_some() && a.finished_at.is_some());
    }

    #[test]
    fn guest_ready_sets_vm_ready_with_the_boot_time() {
        let records = happy(Reason::TestsPassed, Outcome::Succeeded);
        let (_, s) = run(&records[..4], &who(None, false));
        assert_eq!(s.phase, Some(Phase::Running));
        let ready = s.condition(ConditionType::VMReady).unwrap();
        assert_eq!(
            (ready.status, ready.reason),
            (ConditionStatus::True, ConditionReason::GuestReady)
        );
        assert_eq!(ready.message, "detail 4");
        assert_eq!(ready.observed_generation, Some(1));
    }

    #[test]
    fn failed_build_carries_the_reason() {
        let (_, s) = run(&happy(Reason::StepFailed, Outcome::Failed), &who(None, false));
        assert_eq!(s.phase, Some(Phase::Failed));
        assert_eq!(
            condition(&s, ConditionType::Succeeded),
            (ConditionStatus::False, ConditionReason::StepFailed)
        );
    }

    #[test]
    fn interrupted_attempt_with_a_retry_is_pending_not_terminal() {
        use AttemptState::*;
        let mut retiring = rec(5, 1, Some(Running), Retiring, Some(Reason::AgentRestarted));
        retiring.outcome = Some(Outcome::Interrupted);
        let records = vec![
            rec(1, 1, None, Requested, None),
            rec(2, 1, Some(Requested), Admitted, Some(Reason::SlotFree)),
            rec(3, 1, Some(Admitted), Booting, None),
            rec(4, 1, Some(Booting), Running, Some(Reason::GuestReady)),
            retiring,
            rec(6, 1, Some(Retiring), Retired, Some(Reason::VMDeleted)),
        ];
        let (_, s) = run(&records, &who(None, true));
        assert_eq!(s.phase, Some(Phase::Pending));
        assert_eq!(condition(&s, ConditionType::Succeeded).0, ConditionStatus::Unknown);
        assert_eq!(
            s.message.as_deref(),
            Some("attempt 1 ended Interrupted; attempt 2 follows")
        );

        // Without a retry it is terminal: attempts are exhausted.
        let (_, s) = run(&records, &who(None, false));
        assert_eq!(s.phase, Some(Phase::Failed));
        assert_eq!(
            condition(&s, ConditionType::Succeeded),
            (ConditionStatus::False, ConditionReason::AttemptsExhausted)
        );
    }

    /// Recovery drives the retirement with a fresh executor that gathered nothing: the results
    /// journaled at `Retiring` must survive every later record (the chaos run's lost result).
    #[test]
    fn results_fixed_at_retiring_survive_a_later_record_with_empty_results() {
        use AttemptState::*;
        let results = BuildResults {
            tests_passed: Some(4),
            tests_total: Some(4),
            artifact_url: Some("file:///srv/a/".into()),
        };
        let empty = BuildResults::default();
        let records = happy(Reason::TestsPassed, Outcome::Succeeded);
        let (mut attempt, mut status) = run(&records[..6], &who(Some(&results), false));
        assert_eq!(status.results.as_ref(), Some(&results));
        // Quarantined, withdrawn while the agent was down, then resolved by a restarted agent.
        let later = [
            rec(7, 1, Some(Retiring), Quarantined, Some(Reason::DeleteFailed)),
            rec(8, 1, Some(Quarantined), Quarantined, Some(Reason::CancelRequested)),
            rec(9, 1, Some(Quarantined), Retired, Some(Reason::Resolved)),
        ];
        for r in &later {
            attempt.observe(r);
            status = next_status(&status, &attempt, r, &who(Some(&empty), false));
            assert_eq!(status.results.as_ref(), Some(&results), "after #{}", r.seq);
        }
        // Killed during Retiring instead: the restarted agent's Retired record keeps them too.
        let (_, status) = run(&records[..6], &who(Some(&results), false));
        let (mut a, _) = run(&records[..6], &who(Some(&results), false));
        a.observe(&records[6]);
        let status = next_status(&status, &a, &records[6], &who(Some(&empty), false));
        assert_eq!(status.results.as_ref(), Some(&results));
    }

    /// `status.logs` appears with the first record that knows it, survives records of an
    /// executor that has not started shipping (a restarted agent), and a new attempt drops it.
    #[test]
    fn the_logs_location_is_kept_for_its_attempt_and_dropped_by_the_next() {
        use AttemptState::*;
        let records = happy(Reason::TestsPassed, Outcome::Succeeded);
        let url = "s3://ci/app/mb-ci-build-42-00000001/logs/";
        let shipping = Reporter {
            logs: Some(url),
            ..who(None, false)
        };
        let (mut attempt, mut status) = run(&records[..1], &who(None, false));
        assert_eq!(status.logs, None);
        for (i, r) in records[1..].iter().enumerate() {
            attempt.observe(r);
            let reporter = if i < 2 { &shipping } else { &who(None, false) };
            status = next_status(&status, &attempt, r, reporter);
            assert_eq!(status.logs.as_deref(), Some(url), "after #{}", r.seq);
        }
        let second = rec(20, 2, None, Requested, None);
        let mut a2 = Attempt::from_record(&second, 2).unwrap();
        a2.observe(&second);
        status = next_status(&status, &a2, &second, &who(None, false));
        assert_eq!(status.logs, None, "the next attempt ships under its own folder");
    }

    #[test]
    fn a_new_attempt_gets_its_own_entry_and_drops_old_results() {
        use AttemptState::*;
        let results = BuildResults {
            tests_passed: Some(1),
            tests_total: Some(2),
            artifact_url: None,
        };
        let mut status = MacBuildStatus::default();
        let first = rec(1, 1, None, Requested, None);
        let mut a1 = Attempt::from_record(&first, 2).unwrap();
        a1.observe(&first);
        status = next_status(&status, &a1, &first, &who(Some(&results), false));
        assert!(status.results.is_some());

        let second = rec(9, 2, None, Requested, None);
        let mut a2 = Attempt::from_record(&second, 2).unwrap();
        a2.observe(&second);
        status = next_status(&status, &a2, &second, &who(None, false));
        assert_eq!(status.results, None);
        assert_eq!(status.attempts.len(), 2);
        assert_eq!(status.claim.unwrap().attempt, "build-42#2");
    }

    #[test]
    fn quarantine_names_the_vm_and_keeps_the_slot_message() {
        use AttemptState::*;
        let mut retiring = rec(261, 1, Some(Running), Retiring, Some(Reason::AgentRestarted));
        retiring.outcome = Some(Outcome::Interrupted);
        let records = vec![
            rec(1, 1, None, Requested, None),
            rec(2, 1, Some(Requested), Admitted, Some(Reason::SlotFree)),
            retiring,
            rec(262, 1, Some(Retiring), Quarantined, Some(Reason::DeleteFailed)),
        ];
        let (a, s) = run(&records, &who(None, true));
        assert_eq!(s.phase, Some(Phase::Pending));
        assert_eq!(
            s.message.as_deref(),
            Some(format!("attempt 1 not confirmed stopped; its VM {} is quarantined", a.vm).as_str())
        );
        assert_eq!(
            condition(&s, ConditionType::VMDeleted),
            (ConditionStatus::False, ConditionReason::DeleteFailed)
        );
        assert!(snapshot_is_journaled(&records[3]));
        assert!(!snapshot_is_journaled(&records[1]));
    }

    #[test]
    fn a_failed_build_says_why_in_its_message_and_its_attempt() {
        let mut records = happy(Reason::StepFailed, Outcome::Failed);
        records[5].detail = "step build exited 3; its output ends:\n…\nerror: no such module 'Foo'".into();
        let (_, at_retiring) = run(&records[..6], &who(None, false));
        let want = "attempt 1 failed: step build exited 3; its output ends:\n…\nerror: no such module 'Foo'";
        assert_eq!(at_retiring.message.as_deref(), Some(want));
        let (_, done) = run(&records, &who(None, false));
        assert_eq!(done.message.as_deref(), Some(want));
        assert_eq!(
            done.attempts[0].message.as_deref(),
            Some(&want["attempt 1 failed: ".len()..])
        );
        // The deletion is still told, by its condition.
        assert_eq!(done.condition(ConditionType::VMDeleted).unwrap().message, "detail 7");

        let (_, passed) = run(&happy(Reason::TestsPassed, Outcome::Succeeded), &who(None, false));
        assert_eq!(passed.message.as_deref(), Some("attempt 1 succeeded: detail 6"));
    }

    #[test]
    fn an_interrupted_build_without_retry_says_why_none_follows() {
        use AttemptState::*;
        let mut retiring = rec(5, 1, Some(Running), Retiring, Some(Reason::AgentRestarted));
        retiring.outcome = Some(Outcome::Interrupted);
        retiring.detail = "found Running at agent start; killed 1 tart process(es)".into();
        let mut retired = rec(6, 1, Some(Retiring), Retired, Some(Reason::VMDeleted));
        retired.detail = "deleted (or already absent) at agent start; no retry: attempt 2 of 2 used".into();
        let records = vec![
            rec(1, 1, None, Requested, None),
            rec(2, 1, Some(Requested), Admitted, Some(Reason::SlotFree)),
            retiring,
            retired,
        ];
        let (_, s) = run(&records, &who(None, false));
        assert_eq!(
            s.message.as_deref(),
            Some(
                "attempt 1 interrupted: found Running at agent start; killed 1 tart process(es); \
                 deleted (or already absent) at agent start; no retry: attempt 2 of 2 used"
            )
        );
    }
}
