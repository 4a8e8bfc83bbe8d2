//! `tartan-agent journal` against a journal whose writer (this test) holds the lock.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use tartan_agent::journal::{Journal, JournalOptions};
use tartan_agent::lock::StateLock;
use tartan_agent::record::{BuildRef, Record};
use tartan_api::{AttemptState, Outcome, Reason};

fn record(from: Option<AttemptState>, to: AttemptState, reason: Reason, detail: &str) -> Record {
    Record {
        version: 0,
        seq: 0,
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

fn agent() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tartan-agent"))
}

struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn prints_records_in_the_source_form_and_follows_a_live_journal() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path();
    let lock = StateLock::acquire(state).unwrap();
    let (mut journal, _) = Journal::open(&lock, JournalOptions { max_file_bytes: 700 }).unwrap();
    journal
        .append(&mut record(None, AttemptState::Admitted, Reason::SlotFree, ""))
        .unwrap();
    journal
        .append(&mut record(
            Some(AttemptState::Booting),
            AttemptState::Running,
            Reason::GuestReady,
            "tart exec ready after 13.91s",
        ))
        .unwrap();

    let output = agent().args(["journal", "--state-dir"]).arg(state).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert_eq!(
        String::from_utf8(output.stdout).unwrap(),
        "#1 a1 [*] -> Admitted (SlotFree)\n#2 a1 Booting -> Running (GuestReady) tart exec ready after 13.91s\n"
    );

    let output = agent()
        .args(["journal", "--json", "--state-dir"])
        .arg(state)
        .output()
        .unwrap();
    let lines: Vec<Record> = String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[1].detail, "tart exec ready after 13.91s");

    let mut follow = Reaped(
        agent()
            .args(["journal", "--follow", "--state-dir"])
            .arg(state)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut lines = BufReader::new(follow.0.stdout.take().unwrap()).lines();
    let mut next_line = || lines.next().expect("follow ended").unwrap();
    assert_eq!(next_line(), "#1 a1 [*] -> Admitted (SlotFree)");
    assert!(next_line().starts_with("#2 a1 Booting -> Running"));
    // New records, across several file rotations, show up as they are appended.
    for i in 0..6 {
        let mut r = record(
            Some(AttemptState::Running),
            AttemptState::Running,
            Reason::GuestReady,
            &format!("step {i}"),
        );
        let seq = journal.append(&mut r).unwrap();
        assert_eq!(
            next_line(),
            format!("#{seq} a1 Running -> Running (GuestReady) step {i}")
        );
    }
    let mut last = record(
        Some(AttemptState::Retiring),
        AttemptState::Retired,
        Reason::VMDeleted,
        "deleted in 1.18s",
    );
    last.outcome = Some(Outcome::Succeeded);
    journal.append(&mut last).unwrap();
    assert_eq!(
        next_line(),
        "#9 a1 Retiring -> Retired (VMDeleted) deleted in 1.18s outcome=Succeeded"
    );
}

#[test]
fn a_missing_journal_is_one_error_line_and_a_failure_exit() {
    let dir = tempfile::tempdir().unwrap();
    let output = agent()
        .args(["journal", "--state-dir"])
        .arg(dir.path().join("nowhere"))
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("nowhere"), "{stderr}");
}
