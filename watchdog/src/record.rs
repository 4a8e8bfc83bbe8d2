//! The watchdog's record: one JSON line per action in `<state>/watchdog.jsonl`, appended and synced
//! before the action's effects are trusted (e.g. before the deadline file is removed), and the same
//! line in the log.
//!
//! The line has the source document's form:
//! `{"time":"2026-10-05T02:56:40.151497Z","vm":"...","deadline":"2026-10-05T02:55:36.40012Z","action":"deleted","detail":"killed 0 tart process(es); stopped and deleted in 1.18s"}`
//! (`deadline` is `null` when a deadline file could not be read).

use k8s_openapi::jiff::{Timestamp, Unit};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The file name of the record inside the state directory.
pub const RECORD_FILE: &str = "watchdog.jsonl";

/// What the watchdog did (or failed to do) about one VM or one deadline file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// The VM was stopped and deleted, and its directory is confirmed gone.
    Deleted,
    /// The VM did not exist (any more) when the watchdog acted; its deadline file was removed.
    AlreadyAbsent,
    /// Killing, stopping or deleting failed, or the directory is still there; retried with backoff.
    DeleteFailed,
    /// The VM is gone but its deadline file could not be removed; retried with backoff.
    DeadlineFileRemoveFailed,
    /// A deadline file cannot be used (unreadable, malformed, wrong VM name or prefix). Recorded once
    /// per version of the file and left in place for an operator.
    BadDeadlineFile,
}

impl Action {
    /// Every action, for counting them (`tartan_agent_watchdog_actions_total`).
    pub const ALL: [Action; 5] = [
        Action::Deleted,
        Action::AlreadyAbsent,
        Action::DeleteFailed,
        Action::DeadlineFileRemoveFailed,
        Action::BadDeadlineFile,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Action::Deleted => "deleted",
            Action::AlreadyAbsent => "already-absent",
            Action::DeleteFailed => "delete-failed",
            Action::DeadlineFileRemoveFailed => "deadline-file-remove-failed",
            Action::BadDeadlineFile => "bad-deadline-file",
        }
    }
}

/// One line of `watchdog.jsonl`. Field order is the source document's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    /// When the action finished, with microsecond precision.
    pub time: String,
    pub vm: String,
    /// The host execution deadline from the deadline file (`null` if it could not be read).
    pub deadline: Option<String>,
    pub action: Action,
    pub detail: String,
}

impl Line {
    pub fn new(time: Timestamp, vm: &str, deadline: Option<Timestamp>, action: Action, detail: String) -> Line {
        Line {
            time: micros(time).to_string(),
            vm: vm.to_string(),
            deadline: deadline.map(|d| d.to_string()),
            action,
            detail,
        }
    }
}

/// `ts` rounded to microseconds, as the source prints times.
pub fn micros(ts: Timestamp) -> Timestamp {
    ts.round(Unit::Microsecond).unwrap_or(ts)
}

/// Failure to write the record. The watchdog does not act on an unrecorded deletion's aftermath
/// (the deadline file stays, so the next attempt records it again).
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("cannot open the watchdog record {path} for appending: {source}; check the state directory's permissions")]
    Open { path: PathBuf, source: std::io::Error },
    #[error(
        "cannot append to the watchdog record {path}: {source}; the deadline file is kept so the action is retried"
    )]
    Append { path: PathBuf, source: std::io::Error },
    #[error("cannot sync the state directory {path} after creating the watchdog record: {source}")]
    SyncDir { path: PathBuf, source: std::io::Error },
}

/// The append-only record file, shared by the concurrent VM tasks.
#[derive(Debug)]
pub struct Record {
    path: PathBuf,
    file: Mutex<File>,
}

impl Record {
    /// Opens (or creates, syncing the directory) `<state_dir>/watchdog.jsonl` for appending.
    pub fn open(state_dir: &Path) -> Result<Record, RecordError> {
        let path = state_dir.join(RECORD_FILE);
        let existed = path.exists();
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&path)
            .map_err(|source| RecordError::Open {
                path: path.clone(),
                source,
            })?;
        end_torn_line(&file).map_err(|source| RecordError::Append {
            path: path.clone(),
            source,
        })?;
        if !existed {
            File::open(state_dir)
                .and_then(|d| d.sync_all())
                .map_err(|source| RecordError::SyncDir {
                    path: state_dir.to_path_buf(),
                    source,
                })?;
        }
        Ok(Record {
            path,
            file: Mutex::new(file),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `line` as one JSON line, syncs it, and logs it. Each line is a single `write` on an
    /// `O_APPEND` descriptor, so lines from concurrent tasks never interleave.
    pub fn append(&self, line: &Line) -> Result<(), RecordError> {
        let mut text = serde_json::to_string(line).expect("a Line always serialises");
        match line.action {
            Action::Deleted | Action::AlreadyAbsent => tracing::info!(target: "watchdog", "{text}"),
            _ => tracing::warn!(target: "watchdog", "{text}"),
        }
        text.push('\n');
        let file = self.file.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        (&*file)
            .write_all(text.as_bytes())
            .and_then(|()| file.sync_data())
            .map_err(|source| RecordError::Append {
                path: self.path.clone(),
                source,
            })
    }
}

/// If a previous watchdog died mid-line, ends that line so the next one starts on its own line.
fn end_torn_line(file: &File) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    let len = file.metadata()?.len();
    if len == 0 {
        return Ok(());
    }
    let mut last = [0u8; 1];
    file.read_exact_at(&mut last, len - 1)?;
    if last[0] != b'\n' {
        (&*file).write_all(b"\n")?;
        file.sync_data()?;
    }
    Ok(())
}

/// Reads every complete line of a record file (for tests, tools and the benchmark). A torn last line
/// (the watchdog died mid-write) is skipped.
pub fn read_lines(path: &Path) -> std::io::Result<Vec<Line>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_has_the_source_documents_form() {
        let line = Line::new(
            "2026-10-05T02:56:40.151497321Z".parse().unwrap(),
            "mb-x",
            Some("2026-10-05T02:55:36.40012Z".parse().unwrap()),
            Action::Deleted,
            "killed 0 tart process(es); stopped and deleted in 1.18s".into(),
        );
        assert_eq!(
            serde_json::to_string(&line).unwrap(),
            r#"{"time":"2026-10-05T02:56:40.151497Z","vm":"mb-x","deadline":"2026-10-05T02:55:36.40012Z","action":"deleted","detail":"killed 0 tart process(es); stopped and deleted in 1.18s"}"#
        );
    }

    #[test]
    fn action_names_match_their_serde_spelling() {
        for a in [
            Action::Deleted,
            Action::AlreadyAbsent,
            Action::DeleteFailed,
            Action::DeadlineFileRemoveFailed,
            Action::BadDeadlineFile,
        ] {
            assert_eq!(serde_json::to_string(&a).unwrap(), format!("\"{}\"", a.as_str()));
        }
    }

    #[test]
    fn lines_are_appended_and_read_back_and_a_torn_tail_is_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let record = Record::open(dir.path()).unwrap();
        let t: Timestamp = "2026-10-05T02:56:40Z".parse().unwrap();
        record
            .append(&Line::new(t, "mb-a", Some(t), Action::DeleteFailed, "x".into()))
            .unwrap();
        record
            .append(&Line::new(t, "mb-b.json", None, Action::BadDeadlineFile, "y".into()))
            .unwrap();
        drop(record);
        // Reopening appends rather than truncating.
        let record = Record::open(dir.path()).unwrap();
        record
            .append(&Line::new(t, "mb-a", Some(t), Action::Deleted, "z".into()))
            .unwrap();
        std::fs::OpenOptions::new()
            .append(true)
            .open(record.path())
            .unwrap()
            .write_all(b"{\"time\":\"2026")
            .unwrap();
        let lines = read_lines(record.path()).unwrap();
        let actions: Vec<Action> = lines.iter().map(|l| l.action).collect();
        assert_eq!(
            actions,
            vec![Action::DeleteFailed, Action::BadDeadlineFile, Action::Deleted]
        );
        assert_eq!(lines[1].deadline, None);
        // A watchdog starting after the torn write puts its first line on a line of its own.
        drop(record);
        let record = Record::open(dir.path()).unwrap();
        record
            .append(&Line::new(t, "mb-c", Some(t), Action::AlreadyAbsent, "w".into()))
            .unwrap();
        let actions: Vec<Action> = read_lines(record.path()).unwrap().iter().map(|l| l.action).collect();
        assert_eq!(
            actions,
            vec![
                Action::DeleteFailed,
                Action::BadDeadlineFile,
                Action::Deleted,
                Action::AlreadyAbsent
            ]
        );
    }
}
