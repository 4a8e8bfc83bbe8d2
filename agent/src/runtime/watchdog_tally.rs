//! Counts of the watchdog's actions, read from its record (`<state>/watchdog.jsonl`) for
//! `/metrics`: the watchdog serves nothing itself, and its record is the durable fact, so the
//! counts survive restarts of both processes. Read incrementally from where the last scrape
//! stopped; a record that shrank (replaced by hand) is counted again from its start.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use tartan_watchdog::{Action, Line, RECORD_FILE};

/// The longest record line kept whole; longer ones (never written by the watchdog) are skipped.
const MAX_LINE: usize = 64 * 1024;

/// What has been counted so far.
#[derive(Debug)]
pub struct WatchdogTally {
    path: PathBuf,
    /// Bytes of the record already read, complete lines only.
    offset: u64,
    counts: BTreeMap<&'static str, u64>,
}

impl WatchdogTally {
    pub fn new(state_dir: &Path) -> WatchdogTally {
        WatchdogTally {
            path: state_dir.join(RECORD_FILE),
            offset: 0,
            counts: Action::ALL.iter().map(|a| (a.as_str(), 0)).collect(),
        }
    }

    /// Lines of the record by action (every action present, 0 when it never happened).
    pub fn counts(&self) -> &BTreeMap<&'static str, u64> {
        &self.counts
    }

    /// Reads the complete lines appended since the last call. A missing record counts nothing.
    pub fn catch_up(&mut self) -> std::io::Result<()> {
        let mut file = match File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        let len = file.metadata()?.len();
        if len < self.offset {
            self.offset = 0;
            self.counts.values_mut().for_each(|n| *n = 0);
        }
        file.seek(SeekFrom::Start(self.offset))?;
        // Up to the length seen now: what the watchdog appends meanwhile is for the next scrape.
        let mut rest = file.take(len - self.offset);
        let mut chunk = vec![0u8; 64 * 1024];
        let mut line: Vec<u8> = Vec::new();
        // Bytes of the current line, also while it is skipped.
        let mut line_bytes = 0u64;
        let mut skipping = false;
        loop {
            let n = rest.read(&mut chunk)?;
            if n == 0 {
                break;
            }
            for piece in chunk[..n].split_inclusive(|b| *b == b'\n') {
                let complete = piece.ends_with(b"\n");
                line_bytes += u64::try_from(piece.len()).unwrap_or(u64::MAX);
                if !skipping {
                    line.extend_from_slice(piece);
                    if line.len() > MAX_LINE {
                        line.clear();
                        skipping = true;
                    }
                }
                if complete {
                    self.offset += line_bytes;
                    line_bytes = 0;
                    if !skipping {
                        self.count(&line);
                    }
                    line.clear();
                    skipping = false;
                }
            }
        }
        Ok(())
    }

    fn count(&mut self, line: &[u8]) {
        // A torn line (a watchdog killed mid-write, ended by the next one) is not an action.
        if let Ok(parsed) = serde_json::from_slice::<Line>(line) {
            *self.counts.entry(parsed.action.as_str()).or_default() += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn line(vm: &str, action: &str) -> String {
        format!(
            r#"{{"time":"2026-10-05T02:56:40.151497Z","vm":"{vm}","deadline":"2026-10-05T02:55:36.40012Z","action":"{action}","detail":"d"}}"#
        ) + "\n"
    }

    fn append(path: &Path, text: &str) {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }

    fn counted(t: &WatchdogTally) -> Vec<(&'static str, u64)> {
        t.counts()
            .iter()
            .filter(|(_, n)| **n > 0)
            .map(|(a, n)| (*a, *n))
            .collect()
    }

    #[test]
    fn counts_each_complete_line_once_across_scrapes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(RECORD_FILE);
        let mut t = WatchdogTally::new(dir.path());
        // No record yet: every action at 0.
        t.catch_up().unwrap();
        assert_eq!(t.counts().len(), Action::ALL.len());
        assert_eq!(counted(&t), vec![]);

        append(
            &path,
            &(line("tartan-a", "delete-failed") + &line("tartan-a", "deleted")),
        );
        // Half a line: waits for its end.
        let third = line("tartan-b", "deleted");
        append(&path, &third[..20]);
        t.catch_up().unwrap();
        assert_eq!(counted(&t), vec![("delete-failed", 1), ("deleted", 1)]);
        append(&path, &third[20..]);
        // A torn line ended by the next watchdog, and a line longer than any record line: skipped.
        append(&path, "{\"time\":\"2026-10\n");
        append(&path, &format!("{}\n", "x".repeat(MAX_LINE * 3)));
        append(&path, &line("tartan-c", "already-absent"));
        t.catch_up().unwrap();
        t.catch_up().unwrap();
        assert_eq!(
            counted(&t),
            vec![("already-absent", 1), ("delete-failed", 1), ("deleted", 2)]
        );
        assert_eq!(t.offset, std::fs::metadata(&path).unwrap().len());

        // Replaced by a shorter record: counted from its start.
        std::fs::write(&path, line("tartan-d", "bad-deadline-file")).unwrap();
        t.catch_up().unwrap();
        assert_eq!(counted(&t), vec![("bad-deadline-file", 1)]);
    }
}
