//! The shared vocabulary: attempt states, transition reasons, outcomes and condition types.
//!
//! These names appear in the host journal, in MacBuild status and in Kubernetes Events, so they
//! are enums with one spelling each (`as_str`) rather than loose strings.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

macro_rules! vocabulary {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident => $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant,)+];

            /// The one spelling used in the journal, in status and in Events.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text,)+ }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownName;
            fn from_str(s: &str) -> Result<Self, UnknownName> {
                match s {
                    $($text => Ok($name::$variant),)+
                    _ => Err(UnknownName { kind: stringify!($name), name: s.to_string() }),
                }
            }
        }
    };
}

// Other modules of this crate (condition reasons, phases) declare their vocabularies the same way.
pub(crate) use vocabulary;

/// A name that is not part of the vocabulary (e.g. a damaged journal record or a newer agent).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {kind} {name:?}")]
pub struct UnknownName {
    pub kind: &'static str,
    pub name: String,
}

/// Declares [`Reason`], [`AttemptState`] and [`ConditionReason`] from one table, so a reason is
/// written (and documented) once. Each entry names the vocabulary it belongs to: a `Reason` or an
/// `AttemptState` is also a `ConditionReason` (a condition and the journal record that caused it
/// read the same), a `ConditionReason` entry exists only at the level of the whole build. Each
/// enum keeps the table's order (the CRD lists a condition's reasons in it), and `From<Reason>`
/// and `From<AttemptState>` for `ConditionReason` follow from the table.
macro_rules! reasons {
    (
        $(#[$reason_meta:meta])* Reason;
        $(#[$state_meta:meta])* AttemptState;
        $(#[$condition_meta:meta])* ConditionReason;
        $($table:tt)*
    ) => {
        reasons!(@sort
            [$(#[$reason_meta])*] [$(#[$state_meta])*] [$(#[$condition_meta])*]
            [] [] [] [] []
            $($table)*
        );
    };
    // Accumulators: the three enums' entries, then the variant names of Reason and AttemptState.
    (@sort $rm:tt $sm:tt $cm:tt [$($r:tt)*] [$($s:tt)*] [$($c:tt)*] [$($rv:ident)*] [$($sv:ident)*]
        $(#[$m:meta])* Reason $v:ident => $t:literal, $($rest:tt)*
    ) => {
        reasons!(@sort $rm $sm $cm
            [$($r)* $(#[$m])* $v => $t,] [$($s)*] [$($c)* $(#[$m])* $v => $t,] [$($rv)* $v] [$($sv)*]
            $($rest)*
        );
    };
    (@sort $rm:tt $sm:tt $cm:tt [$($r:tt)*] [$($s:tt)*] [$($c:tt)*] [$($rv:ident)*] [$($sv:ident)*]
        $(#[$m:meta])* AttemptState $v:ident => $t:literal, $($rest:tt)*
    ) => {
        reasons!(@sort $rm $sm $cm
            [$($r)*] [$($s)* $(#[$m])* $v => $t,] [$($c)* $(#[$m])* $v => $t,] [$($rv)*] [$($sv)* $v]
            $($rest)*
        );
    };
    (@sort $rm:tt $sm:tt $cm:tt [$($r:tt)*] [$($s:tt)*] [$($c:tt)*] [$($rv:ident)*] [$($sv:ident)*]
        $(#[$m:meta])* ConditionReason $v:ident => $t:literal, $($rest:tt)*
    ) => {
        reasons!(@sort $rm $sm $cm
            [$($r)*] [$($s)*] [$($c)* $(#[$m])* $v => $t,] [$($rv)*] [$($sv)*]
            $($rest)*
        );
    };
    (@sort [$($rm:tt)*] [$($sm:tt)*] [$($cm:tt)*] [$($r:tt)*] [$($s:tt)*] [$($c:tt)*] [$($rv:ident)*] [$($sv:ident)*]) => {
        vocabulary! { $($rm)* Reason { $($r)* } }
        vocabulary! { $($sm)* AttemptState { $($s)* } }
        vocabulary! { $($cm)* ConditionReason { $($c)* } }

        impl From<Reason> for ConditionReason {
            fn from(reason: Reason) -> Self {
                match reason { $(Reason::$rv => ConditionReason::$rv,)* }
            }
        }

        impl From<AttemptState> for ConditionReason {
            fn from(state: AttemptState) -> Self {
                match state { $(AttemptState::$sv => ConditionReason::$sv,)* }
            }
        }
    };
}

reasons! {
    /// Why a transition happened. These are the journal's and the conditions' reasons.
    Reason;
    /// The states of one attempt (README.md, "How it works").
    AttemptState;
    /// Why a condition has its status: every [`Reason`], every [`AttemptState`] name, and the
    /// build-level reasons below. Spellings are identical to the journal's, so a condition and the
    /// journal record that caused it read the same.
    ConditionReason;
    /// A slot was free and the attempt was admitted into it.
    Reason SlotFree => "SlotFree",
    /// `tart exec` answered inside the guest.
    Reason GuestReady => "GuestReady",
    /// The previous step exited 0 and the next one is being started in the guest.
    Reason StepStarted => "StepStarted",
    /// The agent stopped (launchd's SIGTERM: an upgrade, a bootout) and left the attempt
    /// running in its VM; the next start resumes it.
    Reason Detached => "Detached",
    /// A restarted agent found the attempt's VM running and its guest answering, and follows
    /// the same attempt again.
    Reason Resumed => "Resumed",
    /// Every step succeeded and the test report (if any) had no failure.
    Reason TestsPassed => "TestsPassed",
    /// The test report lists failures.
    Reason TestsFailed => "TestsFailed",
    /// A build or test step exited non-zero.
    Reason StepFailed => "StepFailed",
    /// `tart clone`, `set` or `run` failed, or the guest never answered.
    Reason VMStartFailed => "VMStartFailed",
    /// The artifact could not be published after retries.
    Reason ArtifactUploadFailed => "ArtifactUploadFailed",
    /// The agent found the attempt open at start; the process that ran it is gone.
    Reason AgentRestarted => "AgentRestarted",
    /// The agent's task running the attempt failed (a panic); the VM is deleted and a retry
    /// may follow.
    Reason AgentFault => "AgentFault",
    /// The VM's deletion is confirmed.
    Reason VMDeleted => "VMDeleted",
    /// `tart delete` failed or the VM directory is still there.
    Reason DeleteFailed => "DeleteFailed",
    /// A quarantined VM is gone at last.
    Reason Resolved => "Resolved",
    /// Another agent won the claim; nothing was cloned.
    Reason ClaimLost => "ClaimLost",
    /// The claim's write got no answer before the build's time ran out; nothing was cloned. Its
    /// status and the finalizer's removal still go out, fenced on the claim: they answer for the
    /// claim if it landed after all, and are refused if it did not.
    Reason ClaimUnconfirmed => "ClaimUnconfirmed",
    /// The watchdog deleted the VM after the host execution deadline.
    Reason WatchdogDeadline => "WatchdogDeadline",
    /// The agent found the attempt past its host execution deadline.
    Reason DeadlinePassed => "DeadlinePassed",
    /// A VM with the agent's prefix and no open attempt.
    Reason UnknownVM => "UnknownVM",
    /// The MacBuild asked for cancellation, or was deleted.
    Reason CancelRequested => "CancelRequested",
    /// The MacBuild's owner (the CustomRun) was deleted.
    Reason OwnerDeleted => "OwnerDeleted",
    /// The attempt took a warm VM of the agent's pool, booted ahead of it: no clone, no boot.
    /// On the warm VM's own record: it was handed to that attempt, with its slot.
    Reason Adopted => "Adopted",
    /// A warm VM of the agent's pool gives up its slot: a build of another image needs it, it
    /// waited `max_idle` without a build, or the pool no longer asks for it.
    Reason Evicted => "Evicted",
    /// The MacBuild is claimed; no slot is reserved yet.
    AttemptState Requested => "Requested",
    /// A slot is reserved and the host execution deadline is fixed.
    AttemptState Admitted => "Admitted",
    /// `tart clone` / `set` / `run` are in progress; the guest is not answering yet.
    AttemptState Booting => "Booting",
    /// `tart exec` answers; the spec's steps run.
    AttemptState Running => "Running",
    /// Test report and artifacts are being gathered.
    AttemptState Collecting => "Collecting",
    /// The outcome is fixed; the VM is being stopped and deleted.
    AttemptState Retiring => "Retiring",
    /// The VM's deletion is confirmed; the slot is free.
    AttemptState Retired => "Retired",
    /// Deletion failed or the VM cannot be accounted for; the slot stays reserved.
    AttemptState Quarantined => "Quarantined",
    /// The last attempt was interrupted and `maxAttempts` allows no further one.
    ConditionReason AttemptsExhausted => "AttemptsExhausted",
    /// An interrupted attempt was not retried: less than 120 s were left before the host
    /// execution deadline.
    ConditionReason NoTimeToRetry => "NoTimeToRetry",
    /// A step ran longer than its `timeoutSeconds` and was killed in the guest.
    Reason StepTimedOut => "StepTimedOut",
    /// The MacBuild asks for a mount (`spec.mounts`) the agent's config does not declare;
    /// nothing was cloned.
    Reason MountNotDeclared => "MountNotDeclared",
    /// `spec.env` names a Secret this agent is not allowed to read (its `[secrets] allowed`
    /// list); nothing was cloned.
    Reason SecretNotAllowed => "SecretNotAllowed",
    /// A Secret or a key that `spec.env` names does not exist; nothing was cloned.
    Reason SecretMissing => "SecretMissing",
    /// A Secret `spec.env` names could not be read (RBAC refused, API unreachable) or holds a
    /// value no environment variable can carry.
    Reason SecretUnreadable => "SecretUnreadable",
}

impl AttemptState {
    /// States in which the attempt holds a slot (everything between admission and confirmed deletion).
    pub fn holds_slot(self) -> bool {
        !matches!(self, AttemptState::Requested | AttemptState::Retired)
    }

    /// States in which a VM may exist on the host for this attempt.
    pub fn may_have_vm(self) -> bool {
        matches!(
            self,
            AttemptState::Admitted
                | AttemptState::Booting
                | AttemptState::Running
                | AttemptState::Collecting
                | AttemptState::Retiring
                | AttemptState::Quarantined
        )
    }
}

vocabulary! {
    /// How an attempt ended. Only `Interrupted` permits a retry.
    Outcome {
        /// Build and tests passed and the artifact was published.
        Succeeded => "Succeeded",
        /// A build or test step failed, or the deadline passed. Never retried.
        Failed => "Failed",
        /// The process running the attempt died (or lost the VM); a retry may follow.
        Interrupted => "Interrupted",
        /// Cancel request, MacBuild deletion or owner deletion. Never retried.
        Cancelled => "Cancelled",
    }
}

impl Outcome {
    /// Only an interrupted attempt may be followed by another one.
    pub fn permits_retry(self) -> bool {
        self == Outcome::Interrupted
    }
}

vocabulary! {
    /// Condition types on a MacBuild's status.
    ConditionType {
        /// An agent holds the MacBuild (`True/SlotFree`), or lost it (`False/ClaimLost`).
        Claimed => "Claimed",
        /// The guest answers `tart exec`.
        VMReady => "VMReady",
        /// The current attempt's VM is confirmed gone. Terminal CustomRun status waits for it.
        VMDeleted => "VMDeleted",
        /// The build's overall result, once known.
        Succeeded => "Succeeded",
    }
}

/// The API group and version of the MacBuild resource.
pub const GROUP: &str = "tartan.dev";
pub const VERSION: &str = "v1alpha1";
pub const API_VERSION: &str = "tartan.dev/v1alpha1";
pub const KIND: &str = "MacBuild";

/// The finalizer the claiming agent adds; removed only once the VM is confirmed gone.
pub const FINALIZER: &str = "tartan.dev/vm-cleanup";

/// Every VM the agent creates starts with this; it never touches a VM without it.
pub const VM_PREFIX: &str = "mb-";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_round_trips_through_str_and_serde() {
        fn check<T>(all: &[T])
        where
            T: Copy + fmt::Display + FromStr<Err = UnknownName> + PartialEq + fmt::Debug + Serialize,
            T: for<'de> Deserialize<'de>,
        {
            for v in all {
                let text = v.to_string();
                assert_eq!(text.parse::<T>().unwrap(), *v);
                let json = serde_json::to_string(v).unwrap();
                assert_eq!(json, format!("\"{text}\""));
                assert_eq!(serde_json::from_str::<T>(&json).unwrap(), *v);
            }
        }
        check(AttemptState::ALL);
        check(Outcome::ALL);
        check(Reason::ALL);
        check(ConditionType::ALL);
    }

    #[test]
    fn unknown_names_are_refused_with_the_kind() {
        let err = "Sleeping".parse::<AttemptState>().unwrap_err();
        assert_eq!(err.to_string(), "unknown AttemptState \"Sleeping\"");
    }

    #[test]
    fn only_interrupted_permits_retry() {
        let retryable: Vec<_> = Outcome::ALL.iter().filter(|o| o.permits_retry()).collect();
        assert_eq!(retryable, vec![&Outcome::Interrupted]);
    }

    #[test]
    fn slot_is_held_from_admission_until_retired() {
        let holding: Vec<_> = AttemptState::ALL.iter().filter(|s| s.holds_slot()).copied().collect();
        assert_eq!(
            holding,
            vec![
                AttemptState::Admitted,
                AttemptState::Booting,
                AttemptState::Running,
                AttemptState::Collecting,
                AttemptState::Retiring,
                AttemptState::Quarantined
            ]
        );
    }
}
