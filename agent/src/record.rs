//! One host-journal record: a transition of one attempt (or of an unaccounted VM).
//!
//! This is the unit the journal stores, the attempt machine emits and the recovery planner
//! replays. Its `Display` is the form of the source document:
//! `#120 a1 Booting -> Running (GuestReady) tart exec ready after 13.91s`.

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};
use std::fmt;
use tartan_api::{AttemptState, Outcome, Reason};

use crate::pool::WarmProfile;

/// The MacBuild an attempt belongs to. The uid tells a recreated MacBuild of the same name apart.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BuildRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

impl BuildRef {
    /// The build a MacBuild object is (by namespace, name and uid).
    pub fn of(mb: &tartan_api::MacBuild) -> BuildRef {
        BuildRef {
            namespace: mb.metadata.namespace.clone().unwrap_or_default(),
            name: mb.metadata.name.clone().unwrap_or_default(),
            uid: mb.metadata.uid.clone().unwrap_or_default(),
        }
    }
}

impl fmt::Display for BuildRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The newest record layout this agent reads; a record with a newer version is refused, not
/// guessed at. Version 2 adds `warm` (the warm pool's records); version 3 the reason
/// `ClaimUnconfirmed`, which an older agent cannot decode (it would take the record for damage
/// and drop it). Every other record is still written as version 1 ([`Record::layout_version`]),
/// so a journal without either stays readable by an agent that knows only version 1.
pub const RECORD_VERSION: u32 = 3;

/// The layout of the warm pool's records (and of an attempt's record adopting a warm VM).
pub const WARM_RECORD_VERSION: u32 = 2;

/// The layout of every record without `warm` or a newer reason.
pub const PLAIN_RECORD_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Layout version of this record ([`RECORD_VERSION`] when written by this build).
    #[serde(rename = "v")]
    pub version: u32,
    /// Journal-wide sequence number, strictly increasing by one.
    pub seq: u64,
    /// Wall-clock time the transition was decided.
    pub time: Timestamp,
    /// The MacBuild, or `None` for a VM the agent cannot account for (`UnknownVM`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<BuildRef>,
    /// Attempt number (1-based: `a1`, `a2`; `<macbuild>#<n>` outside the journal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// The VM this attempt created or will create (names carry the attempt, so never reused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vm: Option<String>,
    /// The state before; `None` for the first record of an attempt (`[*]` in the diagram).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<AttemptState>,
    pub to: AttemptState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    /// Free text for people: measured times, counts, tart's messages.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// The slot (0-based) the attempt occupies, from admission on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<u8>,
    /// The host execution deadline, fixed at the first admission and kept by retries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Timestamp>,
    /// `maxAttempts` the attempt runs under, on its `Requested` record: the retry decision is
    /// the journal's alone, so recovery can make it while the cluster is unreachable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u8>,
    /// The step (0-based, in the order the guest runs them: the source checkout's commands, then
    /// the spec's steps) this record starts: recovery re-attaches to it and never starts it twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u32>,
    /// The MacBuild's `metadata.generation` the attempt runs (its spec as of this generation):
    /// recovery resumes an attempt only while the MacBuild still has the generation its records
    /// name. Absent in journals written before it was recorded, and for unknown VMs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// For terminal records: the MacBuild status to submit (again, if it did not arrive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<serde_json::Value>,
    /// The warm pool: on a warm VM's own records (no `build`), what it was cloned and booted as;
    /// on an attempt's `Admitted` record, the warm VM it adopted (then `vm` names that VM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<WarmProfile>,
}

impl Record {
    /// The layout version this record needs: 3 for the reason `ClaimUnconfirmed`, 2 when it has
    /// a `warm` field, else 1.
    pub fn layout_version(&self) -> u32 {
        if self.reason == Some(tartan_api::Reason::ClaimUnconfirmed) {
            RECORD_VERSION
        } else if self.warm.is_some() {
            WARM_RECORD_VERSION
        } else {
            PLAIN_RECORD_VERSION
        }
    }

    /// The journal's short attempt id (`a1`), `warm` for a warm pool VM's records, or `-` for
    /// other records without an attempt.
    pub fn attempt_label(&self) -> String {
        match self.attempt {
            Some(n) => format!("a{n}"),
            None if self.warm.is_some() => "warm".to_string(),
            None => "-".to_string(),
        }
    }

    /// The MacBuild status saved in a terminal record, for redelivery.
    pub fn saved_status(&self) -> Option<tartan_api::MacBuildStatus> {
        serde_json::from_value(self.status.clone()?).ok()
    }

    /// The attempt id used outside the journal: `<macbuild>#<n>`.
    pub fn attempt_id(&self) -> Option<String> {
        Some(tartan_api::attempt_id(&self.build.as_ref()?.name, self.attempt?))
    }
}

impl fmt::Display for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{} {} ", self.seq, self.attempt_label())?;
        match self.from {
            Some(from) => write!(f, "{from} -> {}", self.to)?,
            None => write!(f, "[*] -> {}", self.to)?,
        }
        if let Some(reason) = self.reason {
            write!(f, " ({reason})")?;
        }
        if !self.detail.is_empty() {
            write!(f, " {}", self.detail)?;
        }
        if let Some(outcome) = self.outcome {
            write!(f, " outcome={outcome}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u64, from: Option<AttemptState>, to: AttemptState, reason: Reason, detail: &str) -> Record {
        Record {
            version: PLAIN_RECORD_VERSION,
            seq,
            time: "2026-10-05T02:41:40.304Z".parse().unwrap(),
            build: Some(BuildRef {
                namespace: "ci".into(),
                name: "build-42-mac-build".into(),
                uid: "u-1".into(),
            }),
            attempt: Some(1),
            vm: Some("mb-ci-build-42-mac-build-c49f62f4".into()),
            from,
            to,
            reason: Some(reason),
            detail: detail.into(),
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

    #[test]
    fn displays_in_the_source_documents_form() {
        let r = record(
            120,
            Some(AttemptState::Booting),
            AttemptState::Running,
            Reason::GuestReady,
            "tart exec ready after 13.91s",
        );
        assert_eq!(
            r.to_string(),
            "#120 a1 Booting -> Running (GuestReady) tart exec ready after 13.91s"
        );

        let mut r = record(
            121,
            Some(AttemptState::Running),
            AttemptState::Retiring,
            Reason::AgentRestarted,
            "found Running at agent start; killed 0 tart process(es)",
        );
        r.outcome = Some(Outcome::Interrupted);
        assert_eq!(
            r.to_string(),
            "#121 a1 Running -> Retiring (AgentRestarted) found Running at agent start; killed 0 tart process(es) outcome=Interrupted"
        );
    }

    #[test]
    fn first_record_and_unknown_vm_render_without_a_previous_state() {
        let mut r = record(
            7,
            None,
            AttemptState::Quarantined,
            Reason::UnknownVM,
            "mb-ci-x-1 has no open attempt",
        );
        r.attempt = None;
        r.build = None;
        assert_eq!(
            r.to_string(),
            "#7 - [*] -> Quarantined (UnknownVM) mb-ci-x-1 has no open attempt"
        );
        assert_eq!(r.attempt_id(), None);
    }

    #[test]
    fn serde_round_trip_omits_empty_fields() {
        let r = record(1, None, AttemptState::Requested, Reason::SlotFree, "");
        let json = serde_json::to_value(&r).unwrap();
        assert!(json.get("detail").is_none());
        assert!(json.get("outcome").is_none());
        assert_eq!(json["v"], 1);
        let back: Record = serde_json::from_value(json).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.attempt_id().unwrap(), "build-42-mac-build#1");
    }

    /// Journals written before the generation was recorded still replay (the field is absent,
    /// read as unknown); a record that has it keeps it, and an attempt keeps the first it saw.
    #[test]
    fn the_generation_is_optional_in_the_record_and_the_first_one_is_the_attempts() {
        let mut r = record(1, None, AttemptState::Requested, Reason::SlotFree, "");
        let old = serde_json::to_value(&r).unwrap();
        assert!(old.get("generation").is_none());
        let back: Record = serde_json::from_value(old).unwrap();
        assert_eq!(back.generation, None);
        r.generation = Some(3);
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["generation"], 3);
        let back: Record = serde_json::from_value(json).unwrap();
        assert_eq!(back.generation, Some(3));
        let mut a = crate::machine::Attempt::from_record(&back, 1).unwrap();
        let mut later = record(
            2,
            Some(AttemptState::Requested),
            AttemptState::Admitted,
            Reason::SlotFree,
            "",
        );
        later.generation = Some(4);
        a.observe(&later);
        assert_eq!(a.generation, Some(3));
    }
}
