//! Typed status conditions of a MacBuild and the helper that updates them.
//!
//! A condition's `reason` is either a transition reason from the journal
//! ([`Reason`](crate::vocab::Reason)) or the name of the attempt state that explains a
//! not-yet-true condition (e.g. `VMDeleted False reason Running`), so [`ConditionReason`] is the
//! union of both plus the few reasons that only exist at the level of the whole build.

// Declared beside `Reason` and `AttemptState`, from the same table (vocab.rs).
pub use crate::vocab::ConditionReason;
use crate::vocab::{ConditionType, UnknownName, vocabulary};
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
    use crate::vocab::{AttemptState, Reason};

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
