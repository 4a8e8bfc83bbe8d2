//! Typed status conditions of a MacBuild and the helper that updates them.
//!
//! A condition's `reason` is either a transition reason from the journal ([`Reason`]) or the name
//! of the attempt state that explains a not-yet-true condition (DESIGN.md shows
//! `VMDeleted False reason Running`), so [`ConditionReason`] is the union of both plus the few
//! reasons that only exist at the level of the whole build.

use crate::vocab::{AttemptState, ConditionType, Reason, UnknownName, vocabulary};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

vocabulary! {
    /// The status of a condition, spelled as Kubernetes spells it.
    ConditionStatus {
        /// The condition holds.
        True => "True",
        /// The condition does not hold.
        False => "False",
        /// Not known yet (e.g. the guest has not answered so far).
        Unknown => "Unknown",
    }
}

impl From<bool> for ConditionStatus {
    fn from(holds: bool) -> Self {
        if holds {
            ConditionStatus::True
        } else {
            ConditionStatus::False
        }
    }
}

vocabulary! {
    /// Why a condition has its status: every [`Reason`], every [`AttemptState`] name, and the
    /// build-level reasons below. Spellings are identical to the journal's, so a condition and the
    /// journal record that caused it read the same.
    ConditionReason {
        /// A slot was free and the attempt was admitted into it.
        SlotFree => "SlotFree",
        /// `tart exec` answered inside the guest.
        GuestReady => "GuestReady",
        /// The previous step exited 0 and the next one is being started in the guest.
        StepStarted => "StepStarted",
        /// The agent stopped and left the attempt running in its VM.
        Detached => "Detached",
        /// A restarted agent follows the same attempt again.
        Resumed => "Resumed",
        /// Every step succeeded and the test report (if any) had no failure.
        TestsPassed => "TestsPassed",
        /// The test report lists failures.
        TestsFailed => "TestsFailed",
        /// A build or test step exited non-zero.
        StepFailed => "StepFailed",
        /// `tart clone`, `set` or `run` failed, or the guest never answered.
        VMStartFailed => "VMStartFailed",
        /// The artifact could not be published after retries.
        ArtifactUploadFailed => "ArtifactUploadFailed",
        /// The agent found the attempt open at start; the process that ran it is gone.
        AgentRestarted => "AgentRestarted",
        /// The agent's task running the attempt failed (a panic); the VM is deleted and a retry
        /// may follow.
        AgentFault => "AgentFault",
        /// The VM's deletion is confirmed.
        VMDeleted => "VMDeleted",
        /// `tart delete` failed or the VM directory is still there.
        DeleteFailed => "DeleteFailed",
        /// A quarantined VM is gone at last.
        Resolved => "Resolved",
        /// Another agent won the claim; nothing was cloned.
        ClaimLost => "ClaimLost",
        /// The watchdog deleted the VM after the host execution deadline.
        WatchdogDeadline => "WatchdogDeadline",
        /// The agent found the attempt past its host execution deadline.
        DeadlinePassed => "DeadlinePassed",
        /// A VM with the agent's prefix and no open attempt.
        UnknownVM => "UnknownVM",
        /// The MacBuild asked for cancellation, or was deleted.
        CancelRequested => "CancelRequested",
        /// The MacBuild's owner (the CustomRun) was deleted.
        OwnerDeleted => "OwnerDeleted",
        /// The attempt is claimed but holds no slot yet.
        Requested => "Requested",
        /// The attempt holds a slot; the VM is about to be cloned.
        Admitted => "Admitted",
        /// The VM is being cloned and started.
        Booting => "Booting",
        /// The steps run in the guest.
        Running => "Running",
        /// Test report and artifacts are being gathered.
        Collecting => "Collecting",
        /// The outcome is fixed; the VM is being stopped and deleted.
        Retiring => "Retiring",
        /// The VM's deletion is confirmed and the slot is free.
        Retired => "Retired",
        /// The VM could not be confirmed gone; its slot stays reserved.
        Quarantined => "Quarantined",
        /// The last attempt was interrupted and `maxAttempts` allows no further one.
        AttemptsExhausted => "AttemptsExhausted",
        /// An interrupted attempt was not retried: less than 120 s were left before the host
        /// execution deadline.
        NoTimeToRetry => "NoTimeToRetry",
        /// A step ran longer than its `timeoutSeconds` and was killed in the guest.
        StepTimedOut => "StepTimedOut",
        /// The MacBuild asks for a mount the agent's config does not declare; nothing was cloned.
        MountNotDeclared => "MountNotDeclared",
        /// `spec.env` names a Secret this agent is not allowed to read; nothing was cloned.
        SecretNotAllowed => "SecretNotAllowed",
        /// A Secret or a key that `spec.env` names does not exist; nothing was cloned.
        SecretMissing => "SecretMissing",
        /// A Secret `spec.env` names could not be read, or holds a value no environment variable
        /// can carry.
        SecretUnreadable => "SecretUnreadable",
    }
}

impl From<Reason> for ConditionReason {
    // Exhaustive on purpose: a new journal reason must be given its condition spelling here.
    fn from(reason: Reason) -> Self {
        match reason {
            Reason::SlotFree => ConditionReason::SlotFree,
            Reason::GuestReady => ConditionReason::GuestReady,
            Reason::StepStarted => ConditionReason::StepStarted,
            Reason::Detached => ConditionReason::Detached,
            Reason::Resumed => ConditionReason::Resumed,
            Reason::TestsPassed => ConditionReason::TestsPassed,
            Reason::TestsFailed => ConditionReason::TestsFailed,
            Reason::StepFailed => ConditionReason::StepFailed,
            Reason::VMStartFailed => ConditionReason::VMStartFailed,
            Reason::ArtifactUploadFailed => ConditionReason::ArtifactUploadFailed,
            Reason::AgentRestarted => ConditionReason::AgentRestarted,
            Reason::AgentFault => ConditionReason::AgentFault,
            Reason::VMDeleted => ConditionReason::VMDeleted,
            Reason::DeleteFailed => ConditionReason::DeleteFailed,
            Reason::Resolved => ConditionReason::Resolved,
            Reason::ClaimLost => ConditionReason::ClaimLost,
            Reason::WatchdogDeadline => ConditionReason::WatchdogDeadline,
            Reason::DeadlinePassed => ConditionReason::DeadlinePassed,
            Reason::UnknownVM => ConditionReason::UnknownVM,
            Reason::CancelRequested => ConditionReason::CancelRequested,
            Reason::OwnerDeleted => ConditionReason::OwnerDeleted,
            Reason::StepTimedOut => ConditionReason::StepTimedOut,
            Reason::MountNotDeclared => ConditionReason::MountNotDeclared,
            Reason::SecretNotAllowed => ConditionReason::SecretNotAllowed,
            Reason::SecretMissing => ConditionReason::SecretMissing,
            Reason::SecretUnreadable => ConditionReason::SecretUnreadable,
        }
    }
}

impl From<AttemptState> for ConditionReason {
    // Exhaustive on purpose, like `From<Reason>`.
    fn from(state: AttemptState) -> Self {
        match state {
            AttemptState::Requested => ConditionReason::Requested,
            AttemptState::Admitted => ConditionReason::Admitted,
            AttemptState::Booting => ConditionReason::Booting,
            AttemptState::Running => ConditionReason::Running,
            AttemptState::Collecting => ConditionReason::Collecting,
            AttemptState::Retiring => ConditionReason::Retiring,
            AttemptState::Retired => ConditionReason::Retired,
            AttemptState::Quarantined => ConditionReason::Quarantined,
        }
    }
}

/// One condition on a MacBuild's status (`kubectl describe mb` shows these).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Condition {
    /// Which condition this is; at most one entry per type.
    #[serde(rename = "type")]
    pub type_: ConditionType,
    /// Whether it holds.
    pub status: ConditionStatus,
    /// Why it has this status.
    pub reason: ConditionReason,
    /// Human-readable detail, e.g. `tart exec ready after 13.91s`.
    #[serde(default)]
    pub message: String,
    /// When `status` last changed (not when reason or message last changed).
    pub last_transition_time: Time,
    /// The MacBuild `metadata.generation` the writer had seen.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
}

impl Condition {
    /// A condition whose status (if it is new or differs) changed at `now`.
    pub fn new(
        type_: ConditionType,
        status: ConditionStatus,
        reason: impl Into<ConditionReason>,
        message: impl Into<String>,
        now: Timestamp,
    ) -> Self {
        Condition {
            type_,
            status,
            reason: reason.into(),
            message: message.into(),
            last_transition_time: Time(now),
            observed_generation: None,
        }
    }

    /// The same condition, stamped with the generation the writer acted on.
    pub fn observed(mut self, generation: i64) -> Self {
        self.observed_generation = Some(generation);
        self
    }

    /// Whether the status is `True`.
    pub fn is_true(&self) -> bool {
        self.status == ConditionStatus::True
    }
}

/// Puts `update` into `conditions`, replacing the entry of the same type (new types are appended,
/// existing ones keep their position).
///
/// If the status is unchanged the stored `lastTransitionTime` is kept, so the time says when the
/// status changed, not when an agent last wrote. Returns whether anything changed, so writers can
/// skip a status write that would change nothing.
pub fn set_condition(conditions: &mut Vec<Condition>, update: Condition) -> bool {
    match conditions.iter_mut().find(|c| c.type_ == update.type_) {
        None => {
            conditions.push(update);
            true
        }
        Some(existing) => {
            let last_transition_time = if existing.status == update.status {
                existing.last_transition_time.clone()
            } else {
                update.last_transition_time.clone()
            };
            let merged = Condition {
                last_transition_time,
                ..update
            };
            if *existing == merged {
                false
            } else {
                *existing = merged;
                true
            }
        }
    }
}

/// The condition of type `type_`, if present.
pub fn find_condition(conditions: &[Condition], type_: ConditionType) -> Option<&Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Timestamp {
        Timestamp::from_second(1_790_000_000 + seconds).unwrap()
    }

    #[test]
    fn every_journal_reason_and_state_keeps_its_spelling_as_a_condition_reason() {
        for reason in Reason::ALL {
            assert_eq!(ConditionReason::from(*reason).as_str(), reason.as_str());
        }
        for state in AttemptState::ALL {
            assert_eq!(ConditionReason::from(*state).as_str(), state.as_str());
        }
        for reason in ConditionReason::ALL {
            assert_eq!(reason.as_str().parse::<ConditionReason>().unwrap(), *reason);
        }
        for status in ConditionStatus::ALL {
            assert_eq!(status.as_str().parse::<ConditionStatus>().unwrap(), *status);
        }
        assert_eq!(ConditionStatus::from(true), ConditionStatus::True);
        assert_eq!(ConditionStatus::from(false), ConditionStatus::False);
    }

    #[test]
    fn condition_serializes_with_kubernetes_field_names() {
        let c = Condition::new(
            ConditionType::VMDeleted,
            ConditionStatus::False,
            AttemptState::Running,
            "VM mb-x-1 is running",
            at(0),
        )
        .observed(3);
        let json = serde_json::to_value(&c).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "type": "VMDeleted",
                "status": "False",
                "reason": "Running",
                "message": "VM mb-x-1 is running",
                "lastTransitionTime": "2026-09-21T14:13:20Z",
                "observedGeneration": 3
            })
        );
        assert_eq!(serde_json::from_value::<Condition>(json).unwrap(), c);
    }

    #[test]
    fn a_new_type_is_appended_and_reported_as_a_change() {
        let mut conditions = vec![Condition::new(
            ConditionType::Claimed,
            ConditionStatus::True,
            Reason::SlotFree,
            "",
            at(0),
        )];
        let ready = Condition::new(
            ConditionType::VMReady,
            ConditionStatus::True,
            Reason::GuestReady,
            "",
            at(5),
        );
        assert!(set_condition(&mut conditions, ready.clone()));
        assert_eq!(conditions.len(), 2);
        assert_eq!(conditions[1], ready);
    }

    #[test]
    fn same_status_keeps_the_transition_time_but_takes_reason_and_message() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            Condition::new(
                ConditionType::VMDeleted,
                ConditionStatus::False,
                AttemptState::Booting,
                "",
                at(0),
            ),
        );
        let changed = set_condition(
            &mut conditions,
            Condition::new(
                ConditionType::VMDeleted,
                ConditionStatus::False,
                AttemptState::Running,
                "run",
                at(9),
            ),
        );
        assert!(changed);
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].reason, ConditionReason::Running);
        assert_eq!(conditions[0].message, "run");
        assert_eq!(conditions[0].last_transition_time, Time(at(0)));
    }

    #[test]
    fn a_status_change_moves_the_transition_time() {
        let mut conditions = Vec::new();
        set_condition(
            &mut conditions,
            Condition::new(
                ConditionType::VMDeleted,
                ConditionStatus::False,
                AttemptState::Running,
                "",
                at(0),
            ),
        );
        assert!(set_condition(
            &mut conditions,
            Condition::new(
                ConditionType::VMDeleted,
                ConditionStatus::True,
                Reason::VMDeleted,
                "",
                at(7)
            ),
        ));
        assert_eq!(conditions[0].status, ConditionStatus::True);
        assert_eq!(conditions[0].last_transition_time, Time(at(7)));
    }

    #[test]
    fn an_identical_update_at_a_later_time_is_no_change() {
        let mut conditions = Vec::new();
        let first = Condition::new(
            ConditionType::Claimed,
            ConditionStatus::True,
            Reason::SlotFree,
            "m",
            at(0),
        );
        set_condition(&mut conditions, first.clone());
        let again = Condition::new(
            ConditionType::Claimed,
            ConditionStatus::True,
            Reason::SlotFree,
            "m",
            at(30),
        );
        assert!(!set_condition(&mut conditions, again));
        assert_eq!(conditions, vec![first]);
    }

    #[test]
    fn a_new_observed_generation_alone_is_a_change() {
        let mut conditions = Vec::new();
        let c = Condition::new(
            ConditionType::Claimed,
            ConditionStatus::True,
            Reason::SlotFree,
            "",
            at(0),
        );
        set_condition(&mut conditions, c.clone().observed(1));
        assert!(set_condition(&mut conditions, c.observed(2)));
        assert_eq!(conditions[0].observed_generation, Some(2));
    }

    #[test]
    fn find_condition_by_type() {
        let conditions = vec![
            Condition::new(
                ConditionType::Claimed,
                ConditionStatus::True,
                Reason::SlotFree,
                "",
                at(0),
            ),
            Condition::new(
                ConditionType::VMDeleted,
                ConditionStatus::True,
                Reason::VMDeleted,
                "",
                at(1),
            ),
        ];
        assert!(find_condition(&conditions, ConditionType::VMDeleted).unwrap().is_true());
        assert!(find_condition(&conditions, ConditionType::VMReady).is_none());
    }
}
