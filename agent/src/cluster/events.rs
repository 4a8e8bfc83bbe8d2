//! Kubernetes Events (`events.k8s.io/v1`) for journaled transitions, so `kubectl describe mb`
//! shows the history: reason = the transition's reason (the target state when it has none), note
//! = the journal line (`#120 a1 Booting -> Running (GuestReady) tart exec ready after 13.91s`).
//!
//! Best effort: events go through a bounded queue to one sending task, so publishing never blocks
//! the caller or delivery; a full queue drops the event and a failed publish is logged, nothing
//! more.
//!
//! Each event is published through a fresh kube `Recorder`: the Recorder merges events with the
//! same reason and action into a series for six minutes (keeping the first note), which would hide
//! e.g. the second attempt's `VMDeleted` line.

use super::timed;
use crate::host::disk::Pressure;
use crate::record::{BuildRef, Record};
use k8s_openapi::api::core::v1::ObjectReference;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use std::time::Duration;
use tartan_api::{API_VERSION, AttemptState, KIND, Outcome, Reason};
use tokio::sync::mpsc;

/// How many events may wait for the API before new ones are dropped.
const QUEUE: usize = 256;

/// The Event for `record`, or `None` for a record without a MacBuild (an unknown VM).
pub fn event_for(record: &Record) -> Option<(ObjectReference, Event)> {
    let build = record.build.as_ref()?;
    let warning = matches!(
        record.reason,
        Some(
            Reason::DeleteFailed
                | Reason::ClaimLost
                | Reason::ClaimUnconfirmed
                | Reason::VMStartFailed
                | Reason::ArtifactUploadFailed
                | Reason::SecretNotAllowed
                | Reason::SecretMissing
                | Reason::SecretUnreadable
        )
    ) || record.to == AttemptState::Quarantined
        || matches!(record.outcome, Some(Outcome::Failed | Outcome::Interrupted));
    let reason = record
        .reason
        .map_or_else(|| record.to.as_str().to_string(), |r| r.as_str().to_string());
    Some((
        reference(build),
        Event {
            type_: if warning { EventType::Warning } else { EventType::Normal },
            reason,
            note: Some(truncate(&record.to_string(), 1024)),
            action: record.to.as_str().to_string(),
            secondary: None,
        },
    ))
}

/// The Event on a build this agent leaves waiting because its disk is below the floor
/// (`[disk] min_free_gib`): a Warning `DiskPressure`, sent once per build and pressure.
pub fn disk_pressure_event(build: &BuildRef, agent_id: &str, pressure: &Pressure) -> (ObjectReference, Event) {
    let note = format!(
        "agent {agent_id} claims no new build: {}; another agent may claim it, or this one once space is freed",
        pressure.describe()
    );
    (
        reference(build),
        Event {
            type_: EventType::Warning,
            reason: "DiskPressure".into(),
            note: Some(truncate(&note, 1024)),
            action: "Waiting".into(),
            secondary: None,
        },
    )
}

fn reference(build: &BuildRef) -> ObjectReference {
    ObjectReference {
        api_version: Some(API_VERSION.to_string()),
        kind: Some(KIND.to_string()),
        name: Some(build.name.clone()),
        namespace: Some(build.namespace.clone()),
        uid: Some(build.uid.clone()),
        ..Default::default()
    }
}

/// At most `max` bytes, cut at a character boundary (the API limits a note to 1 kB).
fn truncate(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// Publishes transition events in the background.
#[derive(Clone)]
pub struct Events {
    queue: mpsc::Sender<(ObjectReference, Event)>,
}

impl Events {
    /// Starts the sending task; `agent_id` is the reporting instance, each request limited to
    /// `api_timeout`.
    pub fn spawn(client: kube::Client, agent_id: &str, api_timeout: Duration) -> Events {
        let (queue, mut rx) = mpsc::channel::<(ObjectReference, Event)>(QUEUE);
        let reporter = Reporter {
            controller: "tartan-agent".into(),
            instance: Some(agent_id.to_string()),
        };
        tokio::spawn(async move {
            while let Some((reference, event)) = rx.recv().await {
                let recorder = Recorder::new(client.clone(), reporter.clone());
                let target = format!(
                    "{}/{}",
                    reference.namespace.as_deref().unwrap_or_default(),
                    reference.name.as_deref().unwrap_or_default()
                );
                if let Err(e) = timed(api_timeout, recorder.publish(&event, &reference)).await {
                    tracing::warn!(
                        "event {} for MacBuild {target} not published: {e}; the transition is in the journal and status, \
                         only `kubectl describe` misses it",
                        event.reason
                    );
                }
            }
        });
        Events { queue }
    }

    /// Queues [`disk_pressure_event`] for `build`; never waits.
    pub fn disk_pressure(&self, build: &BuildRef, agent_id: &str, pressure: &Pressure) {
        if let Err(e) = self.queue.try_send(disk_pressure_event(build, agent_id, pressure)) {
            tracing::warn!("DiskPressure event for MacBuild {build} dropped: {e}");
        }
    }

    /// Queues the event of `record`; never waits.
    pub fn transition(&self, record: &Record) {
        let Some(item) = event_for(record) else { return };
        if let Err(e) = self.queue.try_send(item) {
            tracing::warn!("event for record #{} dropped: {e}", record.seq);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::RECORD_VERSION;

    fn record() -> Record {
        Record {
            version: RECORD_VERSION,
            seq: 120,
            time: "2026-10-05T02:41:40.304Z".parse().unwrap(),
            build: Some(BuildRef {
                namespace: "ci".into(),
                name: "b".into(),
                uid: "uid-1".into(),
            }),
            attempt: Some(1),
            vm: Some("mb-ci-b-1".into()),
            from: Some(AttemptState::Booting),
            to: AttemptState::Running,
            reason: Some(Reason::GuestReady),
            detail: "tart exec ready after 13.91s".into(),
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
    fn event_carries_reason_and_journal_line() {
        let (r, e) = event_for(&record()).unwrap();
        assert_eq!(
            (r.api_version.as_deref(), r.kind.as_deref()),
            (Some("tartan.dev/v1alpha1"), Some("MacBuild"))
        );
        assert_eq!(
            (r.namespace.as_deref(), r.name.as_deref(), r.uid.as_deref()),
            (Some("ci"), Some("b"), Some("uid-1"))
        );
        assert_eq!(e.type_, EventType::Normal);
        assert_eq!(e.reason, "GuestReady");
        assert_eq!(e.action, "Running");
        assert_eq!(
            e.note.as_deref(),
            Some("#120 a1 Booting -> Running (GuestReady) tart exec ready after 13.91s")
        );
    }

    #[test]
    fn failures_are_warnings_and_unknown_vms_have_no_event() {
        let mut r = record();
        r.to = AttemptState::Quarantined;
        r.reason = Some(Reason::DeleteFailed);
        assert_eq!(event_for(&r).unwrap().1.type_, EventType::Warning);
        r.reason = None;
        r.to = AttemptState::Retiring;
        r.outcome = Some(Outcome::Succeeded);
        let (_, e) = event_for(&r).unwrap();
        assert_eq!((e.type_, e.reason.as_str()), (EventType::Normal, "Retiring"));
        r.build = None;
        assert!(event_for(&r).is_none());
        assert_eq!(truncate("héllo", 2), "h");
    }

    #[test]
    fn a_build_left_waiting_for_disk_space_gets_a_warning_naming_the_agent_and_the_space() {
        let build = record().build.unwrap();
        let pressure = Pressure {
            min_free: 20 << 30,
            below: vec![(
                crate::host::disk::Filesystem::TartHome,
                "/Users/ci/.tart".into(),
                5 << 30,
            )],
        };
        let (r, e) = disk_pressure_event(&build, "mac-mini-07", &pressure);
        assert_eq!((r.name.as_deref(), r.uid.as_deref()), (Some("b"), Some("uid-1")));
        assert_eq!(
            (e.type_, e.reason.as_str(), e.action.as_str()),
            (EventType::Warning, "DiskPressure", "Waiting")
        );
        let note = e.note.unwrap();
        for needle in ["mac-mini-07", "tart_home /Users/ci/.tart has 5.0 GiB free", "20.0 GiB"] {
            assert!(note.contains(needle), "{needle:?} not in {note}");
        }
    }
}
